# Sourced by the device scripts: puts NCCL where cudarc's loader looks. cudarc dlopens
# `libnccl.so`, while NCCL's packages and PyTorch's nvidia-nccl wheel ship `libnccl.so.2`:
# the first one found (system, toolkit, the wheel) is linked under that name in a private
# folder at the front of LD_LIBRARY_PATH.
for d in /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null); do
  if [ -e "$d/libnccl.so.2" ]; then
    mkdir -p /tmp/kimi-nccl && ln -sf "$d/libnccl.so.2" /tmp/kimi-nccl/libnccl.so
    export LD_LIBRARY_PATH="/tmp/kimi-nccl:$d:${LD_LIBRARY_PATH:-}"
    break
  fi
done
