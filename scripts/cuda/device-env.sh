# Sourced by the device scripts (device-bench.sh, offload-table.sh) from the repository root:
# cut_config, and cuBLAS 13 on the library path.
# cut_config SRC N DST: the config SRC cut to its first N layers (its KDA and MLA layer
# lists with it), written to DST.
cut_config() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); n = int(sys.argv[2]); t = c.get("text_config", c)
t["num_hidden_layers"] = n
la = t["linear_attn_config"]
for k in ("kda_layers", "full_attn_layers"):
    la[k] = [i for i in la[k] if i <= n]
json.dump(c, open(sys.argv[3], "w"), indent=1)
PY
}

# cuBLAS 13: the system toolkit, else PyTorch's pip wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null) \
  $(python3 -c 'import nvidia.cu13 as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null); do
  if [ -e "$d/libcublas.so.13" ]; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
