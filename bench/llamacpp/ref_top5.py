# f32 NumPy reference forward pass for the demo model (llama arch, SmolLM2-135M) read from a GGUF.
# Prints the top-5 logits of each greedy step, to see how close a golden token is to a tie.
# Used to explain why llama.cpp's greedy output differs from shared/docs/demo-model.md (README.md).
#
#   G=target/llamacpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py   # from build.sh
#   python3 -m venv target/llamacpp/venv && target/llamacpp/venv/bin/pip install numpy pyyaml
#   target/llamacpp/venv/bin/python bench/llamacpp/ref_top5.py $G models/SmolLM2-135M-Instruct.Q4_1.gguf 6403,1980,253,655 5
#
# args: gguf-py dir, GGUF file, comma-separated prompt ids, number of greedy steps.
# Recomputes the whole sequence each step (no KV cache); ~2 s per step on 2 cores.
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from gguf import GGUFReader
from gguf.quants import dequantize
r = GGUFReader(sys.argv[2]); ids = [int(x) for x in sys.argv[3].split(',')]; steps = int(sys.argv[4])
W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)]) for t in r.tensors}
toks = [bytes(r.fields['tokenizer.ggml.tokens'].parts[i]).decode() for i in r.fields['tokenizer.ggml.tokens'].data]
L, H, KV, D, eps, base = 30, 9, 3, 64, 1e-5, 100000.0
def rms(x, w): return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
def rope(x, pos):  # x [T, nh, D], adjacent pairs
    inv = base ** (-np.arange(0, D, 2) / D); a = pos[:, None] * inv[None]; c, s = np.cos(a)[:, None], np.sin(a)[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]; o = np.empty_like(x); o[..., 0::2] = x0 * c - x1 * s; o[..., 1::2] = x0 * s + x1 * c; return o
def fwd(ids):
    T = len(ids); pos = np.arange(T, dtype=np.float64); x = W['token_embd.weight'][ids].astype(np.float64)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = f'blk.{l}.'; h = rms(x, W[p + 'attn_norm.weight'])
        q = rope((h @ W[p + 'attn_q.weight'].T).reshape(T, H, D), pos); k = rope((h @ W[p + 'attn_k.weight'].T).reshape(T, KV, D), pos)
        v = (h @ W[p + 'attn_v.weight'].T).reshape(T, KV, D); k = np.repeat(k, H // KV, 1); v = np.repeat(v, H // KV, 1)
        s = np.einsum('thd,shd->hts', q, k) / np.sqrt(D) + mask; s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
        x = x + np.einsum('hts,shd->thd', s, v).reshape(T, H * D) @ W[p + 'attn_output.weight'].T
        h = rms(x, W[p + 'ffn_norm.weight']); g = h @ W[p + 'ffn_gate.weight'].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W[p + 'ffn_up.weight'].T)) @ W[p + 'ffn_down.weight'].T
    return rms(x[-1], W['output_norm.weight']) @ W['token_embd.weight'].T
for _ in range(steps):
    lg = fwd(ids); top = np.argsort(-lg)[:5]
    print(' | '.join(f'{t} {toks[t]!r} {lg[t]:.3f}' for t in top), flush=True); ids.append(int(top[0]))
