#!/usr/bin/env python3
"""Float64 NumPy reference of the Kimi K3 text model, written from shared/docs/kimi-k3-spec.md.

This is a straight transcription of spec section 3 (forward math) over the checkpoint layout of
section 2, with no optimisation: every token of the KDA recurrence is stepped one by one with an
fp64 state, MLA is plain causal softmax attention, every routed expert is dequantised from its
MXFP4 planes (section 2.3) and run per token. It only needs numpy (the safetensors files are read
by a small parser below, so BF16 needs no extra package and every tensor's dtype comes from the
file header, spec section 7 item 4).

What it reads (a K3 checkpoint directory):
  config.json        the KimiK3ForConditionalGeneration wrapper with a nested `text_config`
                     (a bare kimi_linear text config is accepted too)
  *.safetensors      `model.safetensors.index.json` + shards, or one `model.safetensors`.
                     Text tensors live under `language_model.model.` and the head is
                     `language_model.lm_head.weight`; `vision_tower.*` / `mm_projector.*` are
                     skipped.

Library use (scripts/make_k3_fixtures.py does this):
    from k3_reference import K3Reference
    ref = K3Reference.load("fixtures/kimi-k3/<name>")
    logits = ref.forward([1, 2, 3])          # float64 [T, vocab]

Command line:
    python3 scripts/k3_reference.py DIR [--ids 1,2,3] [--compare DIR/logits.npy]
    python3 scripts/k3_reference.py --self-test     # MXFP4 decode against hand-computed values
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# safetensors reading (header-driven dtypes)
# ---------------------------------------------------------------------------------------------

_RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "U8": np.uint8, "I8": np.int8, "I32": np.int32, "I64": np.int64, "U32": np.uint32,
}


def read_safetensors(path):
    """Returns {name: (dtype_string, numpy array)} for one .safetensors file.

    Floating tensors are returned as float64 (BF16 is widened exactly: its 16 bits are the top
    half of an f32); integer tensors (the MXFP4 U8 planes) keep their integer type.
    """
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        begin, end = info["data_offsets"]
        raw = np.frombuffer(blob, dtype=_RAW_DTYPES[dt], count=(end - begin) // np.dtype(_RAW_DTYPES[dt]).itemsize,
                            offset=base + begin).reshape(info["shape"])
        if dt == "BF16":
            arr = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif dt in ("F64", "F32", "F16"):
            arr = raw.astype(np.float64)
        else:
            arr = raw.copy()
        out[name] = (dt, arr)
    return out


def read_checkpoint_dir(d):
    """All tensors of a checkpoint directory: {name: (dtype, array)}, via the index if present."""
    index = os.path.join(d, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for fn in files:
        part = read_safetensors(os.path.join(d, fn))
        if weight_map is not None:
            wrong = [k for k in part if weight_map.get(k) != fn]
            if wrong:
                raise ValueError(f"{fn}: tensors not mapped to this shard by the index: {wrong[:3]}")
        tensors.update(part)
    if weight_map is not None and set(weight_map) != set(tensors):
        raise ValueError(f"index lists tensors missing from the shards: {sorted(set(weight_map) - set(tensors))[:3]}")
    return tensors


# ---------------------------------------------------------------------------------------------
# MXFP4 (spec section 2.3)
# ---------------------------------------------------------------------------------------------

# E2M1 magnitudes for code bits 2..0; bit 3 is the sign.
E2M1_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_BLOCK = 32


def e2m1_decode(codes):
    """4-bit codes (any int array, values 0..15) -> float64; code 0x8 gives -0.0."""
    codes = np.asarray(codes).astype(np.int64)
    mag = E2M1_LUT[codes & 7]
    return np.where(codes & 8, -mag, mag)


def e8m0_decode(s):
    """E8M0 scale bytes -> 2^(s-127). s = 255 is NaN per the OCP MX spec (spec section 7 item 2)."""
    s = np.asarray(s).astype(np.int64)
    out = np.ldexp(1.0, s - 127)
    return np.where(s == 255, np.nan, out)


def mxfp4_dequantize(packed, scale):
    """packed U8 [out, in/2], scale U8 [out, in/32] -> float64 [out, in].

    The low nibble of byte j holds input column 2j, the high nibble column 2j+1, and one scale
    byte covers 32 consecutive input columns of its row.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    rows, half = packed.shape
    cols = 2 * half
    if scale.shape != (rows, cols // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit packed {packed.shape}")
    codes = np.empty((rows, cols), dtype=np.int64)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    vals = e2m1_decode(codes)
    return vals * np.repeat(e8m0_decode(scale), MXFP4_BLOCK, axis=1)


def test_mxfp4_decode():
    """Hand-computed checks of the decode: nibble order, E2M1 table and sign, E8M0 scale, -0."""
    # One row of 64 inputs = 32 packed bytes and 2 scale bytes.
    packed = np.zeros((2, 32), dtype=np.uint8)
    packed[0, 0] = 0x21   # col 0 <- low nibble 0x1 = +0.5 ; col 1 <- high nibble 0x2 = +1.0
    packed[0, 1] = 0x8F   # col 2 <- 0xF = -6.0           ; col 3 <- 0x8 = -0.0
    packed[0, 2] = 0x7B   # col 4 <- 0xB = -1.5           ; col 5 <- 0x7 = +6.0
    packed[0, 16] = 0xC5  # col 32 <- 0x5 = +3.0 (second block) ; col 33 <- 0xC = -2.0
    packed[1, 31] = 0xE3  # row 1 col 62 <- 0x3 = +1.5 ; col 63 <- 0xE = -4.0
    scale = np.array([[127, 130], [125, 121]], dtype=np.uint8)  # 1, 8 ; 1/4, 1/64
    w = mxfp4_dequantize(packed, scale)
    expect = {(0, 0): 0.5, (0, 1): 1.0, (0, 2): -6.0, (0, 3): -0.0, (0, 4): -1.5, (0, 5): 6.0,
              (0, 32): 3.0 * 8, (0, 33): -2.0 * 8, (1, 62): 1.5 / 64, (1, 63): -4.0 / 64,
              (0, 6): 0.0, (1, 0): 0.0}
    for (r, c), v in expect.items():
        assert w[r, c] == v, (r, c, w[r, c], v)
    assert np.signbit(w[0, 3]) and not np.signbit(w[0, 6]), "code 0x8 must decode to -0.0"
    assert np.count_nonzero(w) == 9  # -0.0 counts as zero
    assert list(e2m1_decode(range(16))) == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    assert e8m0_decode(127) == 1.0 and e8m0_decode(0) == 2.0 ** -127 and np.isnan(e8m0_decode(255))
    return True


# ---------------------------------------------------------------------------------------------
# Math helpers (all float64)
# ---------------------------------------------------------------------------------------------

def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms_norm(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis; w=None normalises without a weight."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def situ_glu(gate, up, beta1, beta2):
    """SiTU-GLU (spec section 3.5): beta1*tanh(g/beta1)*sigmoid(g) * beta2*tanh(u/beta2)."""
    a = beta1 * np.tanh(gate / beta1) * sigmoid(gate)
    u = up if beta2 is None else beta2 * np.tanh(up / beta2)
    return a * u


def softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

class K3Reference:
    """Float64 K3 text model. Build with K3Reference.load(dir) or K3Reference(config, tensors)."""

    def __init__(self, config, tensors):
        self.wrapper = config
        tc = config.get("text_config", config)
        self.cfg = tc
        self.dtypes = {}      # text tensor name (without prefix) -> stored dtype
        self.skipped = []     # vision_tower.* / mm_projector.* names
        self.w = {}
        for name, (dt, arr) in tensors.items():
            key = self._text_key(name)
            if key is None:
                self.skipped.append(name)
                continue
            self.w[key] = arr
            self.dtypes[key] = dt

        self.H = tc["hidden_size"]
        self.vocab = tc["vocab_size"]
        self.n_layers = tc["num_hidden_layers"]
        self.eps = tc["rms_norm_eps"]
        la = tc["linear_attn_config"]
        self.kda_layers = set(la["kda_layers"])           # 1-based (spec section 1.2)
        self.mla_layers = set(la.get("full_attn_layers", []))
        for i in range(self.n_layers):
            if ((i + 1) in self.kda_layers) == ((i + 1) in self.mla_layers):
                raise ValueError(f"layer {i}: must be in exactly one of kda_layers/full_attn_layers")
        self.kda_heads = la["num_heads"]
        self.kda_dim = la["head_dim"]
        self.conv_k = la["short_conv_kernel_size"]
        self.gate_lb = la["gate_lower_bound"]
        if not la.get("use_full_rank_gate", False):
            raise NotImplementedError("K3 reference expects use_full_rank_gate = true")
        if not tc.get("mla_use_nope", False):
            raise NotImplementedError("K3 MLA is NoPE (mla_use_nope = true)")
        self.mla_gate = tc.get("mla_use_output_gate", False)
        self.beta1 = tc.get("activation_situ_beta") or 1.0
        self.beta2 = tc.get("activation_situ_linear_beta")
        if tc.get("hidden_act") != "situ":
            raise NotImplementedError("K3 uses hidden_act = situ")
        self.block_size = tc["attn_res_block_size"]
        ng, tg = tc.get("num_expert_group", 1), tc.get("topk_group", 1)
        if tc.get("use_grouped_topk", False) and ng > 1 and ng > tg:
            raise NotImplementedError("group-limited routing (never used by K3: 1 group)")
        if tc.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise NotImplementedError("K3 router is sigmoid")
        self.warnings = set()
        self._stats = None    # optional dict filled by forward(ids, stats)
        self._experts = {}    # (layer, expert) -> (w1, w2, w3) dequantised, filled lazily

    @staticmethod
    def _text_key(name):
        """Checkpoint name -> name relative to `language_model.` (None for vision tensors)."""
        if name.startswith(("vision_tower.", "mm_projector.")):
            return None
        if not name.startswith("language_model."):
            raise KeyError(f"unexpected tensor outside language_model.: {name}")
        key = name[len("language_model."):]
        if key.startswith("layers."):          # compatibility alias (spec section 2.1)
            key = "model." + key
        return key

    @classmethod
    def load(cls, d):
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        return cls(config, read_checkpoint_dir(d))

    # -- helpers -----------------------------------------------------------------------------

    def p(self, name):
        return self.w["model." + name]

    def is_moe(self, i):
        tc = self.cfg
        return (tc.get("num_experts") or 0) > 0 and i >= tc.get("first_k_dense_replace", 0) \
            and i % tc.get("moe_layer_freq", 1) == 0

    def expert(self, layer, e):
        """(w1 gate, w2 down, w3 up) of one routed expert, dequantised from MXFP4 (or read plain)."""
        k = (layer, e)
        if k not in self._experts:
            pre = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            mats = []
            for proj in ("w1", "w2", "w3"):
                if pre + proj + ".weight_packed" in self.w:
                    mats.append(mxfp4_dequantize(self.w[pre + proj + ".weight_packed"],
                                                 self.w[pre + proj + ".weight_scale"]))
                else:
                    mats.append(self.w[pre + proj + ".weight"])
            self._experts[k] = tuple(mats)
        return self._experts[k]

    def attn_res_mix(self, blocks, partial, prefix):
        """Block AttnRes mix (spec section 3.6): per-token softmax over [blocks..., partial].

        logit_k = RMSNorm_without_weight(V_k) . (norm.weight * proj.weight); the mix is over the
        un-normalised V_k.
        """
        if not blocks:
            return partial
        w_eff = self.p(prefix + "_norm.weight") * self.p(prefix + "_proj.weight").reshape(-1)
        V = np.stack(blocks + [partial])                                   # [n+1, T, H]
        logits = rms_norm(V, None, self.eps) @ w_eff                        # [n+1, T]
        pi = softmax(logits, axis=0)
        if self._stats is not None:
            self._stats.setdefault("attn_res_max_weight", []).extend(np.max(pi, axis=0).tolist())
        return np.einsum("kt,kth->th", pi, V)

    # -- sublayers ---------------------------------------------------------------------------

    def kda(self, L, x):
        """Kimi Delta Attention with the safe gate (spec section 3.2). x: [T, H] (normed)."""
        a = f"layers.{L}.self_attn."
        T = x.shape[0]
        Hh, D = self.kda_heads, self.kda_dim

        def causal_conv(u, w):
            # w: [P, 1, K]; tap 0 multiplies the oldest input; zero left padding; then SiLU.
            K = w.shape[-1]
            w = w.reshape(w.shape[0], K)
            pad = np.concatenate([np.zeros((K - 1, u.shape[1])), u], axis=0)
            y = sum(w[:, j] * pad[j:j + T] for j in range(K))
            return silu(y)

        q = causal_conv(x @ self.p(a + "q_proj.weight").T, self.p(a + "q_conv1d.weight"))
        k = causal_conv(x @ self.p(a + "k_proj.weight").T, self.p(a + "k_conv1d.weight"))
        v = causal_conv(x @ self.p(a + "v_proj.weight").T, self.p(a + "v_conv1d.weight"))
        q, k, v = (t.reshape(T, Hh, D) for t in (q, k, v))
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6) * D ** -0.5
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        beta = sigmoid(x @ self.p(a + "b_proj.weight").T)                       # [T, Hh]
        z = (x @ self.p(a + "f_a_proj.weight").T) @ self.p(a + "f_b_proj.weight").T
        z = (z + self.p(a + "dt_bias").reshape(-1)).reshape(T, Hh, D)
        a_log = self.p(a + "A_log").reshape(-1)
        if np.any(a_log[Hh:] != 0):       # the stored pad is zero in the released file (spec 7.3)
            self.warnings.add(f"layer {L}: A_log padding beyond num_heads is not zero (ignored)")
        A = np.exp(a_log[:Hh])                                                   # per head; rest is padding
        g = self.gate_lb * sigmoid(A[None, :, None] * z)                         # (lb, 0)
        alpha = np.exp(g)                                                        # [T, Hh, D(k)]

        S = np.zeros((Hh, D, D))                                                 # [head, k, v]
        o = np.empty((T, Hh, D))
        for t in range(T):
            S = S * alpha[t][:, :, None]                                         # decay on the key axis
            u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", S, q[t])

        gate = sigmoid(x @ self.p(a + "g_proj.weight").T).reshape(T, Hh, D)
        o = rms_norm(o, self.p(a + "o_norm.weight"), self.eps) * gate
        return o.reshape(T, Hh * D) @ self.p(a + "o_proj.weight").T

    def mla(self, L, x):
        """Gated NoPE MLA with q-LoRA (spec section 3.3). x: [T, H] (normed)."""
        a = f"layers.{L}.self_attn."
        tc = self.cfg
        T = x.shape[0]
        nh = tc["num_attention_heads"]
        dn, dr, dv, r = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"], tc["kv_lora_rank"]
        if tc.get("q_lora_rank"):
            cq = rms_norm(x @ self.p(a + "q_a_proj.weight").T, self.p(a + "q_a_layernorm.weight"), 1e-6)
            q = cq @ self.p(a + "q_b_proj.weight").T
        else:
            q = x @ self.p(a + "q_proj.weight").T
        q = q.reshape(T, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        ckv = x @ self.p(a + "kv_a_proj_with_mqa.weight").T                     # [T, r + dr]
        c_kv = rms_norm(ckv[:, :r], self.p(a + "kv_a_layernorm.weight"), 1e-6)
        k_pe = ckv[:, r:]                                                        # not rotated, shared
        kv = (c_kv @ self.p(a + "kv_b_proj.weight").T).reshape(T, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        scores = (np.einsum("thd,shd->hts", q_nope, k_nope)
                  + np.einsum("thd,sd->hts", q_pe, k_pe)) * (dn + dr) ** -0.5
        causal = np.tril(np.ones((T, T), dtype=bool))
        scores = np.where(causal[None], scores, -np.inf)
        probs = softmax(scores, axis=-1)
        o = np.einsum("hts,shd->thd", probs, v).reshape(T, nh * dv)
        if self.mla_gate:
            o = o * sigmoid(x @ self.p(a + "g_proj.weight").T)                 # gate from the layer input
        return o @ self.p(a + "o_proj.weight").T

    def dense_mlp(self, prefix, x):
        g = x @ self.p(prefix + "gate_proj.weight").T
        u = x @ self.p(prefix + "up_proj.weight").T
        return situ_glu(g, u, self.beta1, self.beta2) @ self.p(prefix + "down_proj.weight").T

    def route(self, L, x):
        """Sigmoid router + correction bias for selection only (spec section 3.4).

        Returns (indices [T, k], weights [T, k], selection margins [T]) where the margin is the gap
        between the k-th and (k+1)-th biased score (how decisive the choice is).
        """
        tc = self.cfg
        m = f"layers.{L}.block_sparse_moe."
        k = tc["num_experts_per_token"]
        s = sigmoid(x @ self.p(m + "gate.weight").T)                             # [T, E]
        bias_key = "model." + m + "gate.e_score_correction_bias"
        biased = s + self.w[bias_key] if bias_key in self.w else s
        order = np.argsort(-biased, axis=-1, kind="stable")
        idx = order[:, :k]
        sel = np.take_along_axis(s, idx, axis=-1)
        if tc.get("moe_renormalize", True) and k > 1:
            sel = sel / (np.sum(sel, axis=-1, keepdims=True) + 1e-20)
        sel = sel * tc.get("routed_scaling_factor", 1.0)
        if self._stats is not None:
            plain = np.sort(np.argsort(-s, axis=-1, kind="stable")[:, :k], axis=-1)
            self._stats.setdefault("bias_changed", []).append(np.any(plain != np.sort(idx, axis=-1), axis=-1))
        b_sorted = np.take_along_axis(biased, order, axis=-1)
        margin = b_sorted[:, k - 1] - b_sorted[:, k] if b_sorted.shape[1] > k else np.full(len(x), np.inf)
        return idx, sel, margin

    def latent_moe(self, L, x):
        """LatentMoE (spec section 3.5): down -> experts -> weighted sum -> RMSNorm -> up, + shared."""
        tc = self.cfg
        m = f"layers.{L}.block_sparse_moe."
        idx, wts, margin = self.route(L, x)
        if self._stats is not None:
            self._stats.setdefault("routing", []).append((L, idx, margin))
        latent = tc.get("routed_expert_hidden_size")
        z = x @ self.p(m + "routed_expert_down_proj.weight").T if latent else x
        u = np.zeros_like(z)
        for t in range(x.shape[0]):
            for e, w in zip(idx[t], wts[t]):
                w1, w2, w3 = self.expert(L, int(e))
                u[t] += w * (situ_glu(w1 @ z[t], w3 @ z[t], self.beta1, self.beta2) @ w2.T)
        if tc.get("latent_moe_use_norm", False):
            u = rms_norm(u, self.p(m + "routed_expert_norm.weight"), self.eps)
        y = u @ self.p(m + "routed_expert_up_proj.weight").T if latent else u
        if tc.get("num_shared_experts", 0):
            y = y + self.dense_mlp(m + "shared_experts.", x)                   # on the unprojected x
        return y

    # -- whole model ------------------------------------------------------------------------

    def forward(self, ids, stats=None):
        """Logits float64 [T, vocab] for token ids (one sequence, one pass, no cache).

        stats (optional dict) collects the routing decisions, AttnRes weights and block count.
        """
        self._stats = stats
        ids = np.asarray(ids, dtype=np.int64)
        blocks = []
        p = self.p("embed_tokens.weight")[ids]                                   # [T, H]
        for L in range(self.n_layers):
            ln = f"layers.{L}."
            h = self.attn_res_mix(blocks, p, ln + "self_attention_res")
            if L % self.block_size == 0:          # layer 0 stores the embedding as block 0
                blocks.append(p)
                p = None
            xa = rms_norm(h, self.p(ln + "input_layernorm.weight"), self.eps)
            a = self.kda(L, xa) if (L + 1) in self.kda_layers else self.mla(L, xa)
            p = a if p is None else p + a
            h = self.attn_res_mix(blocks, p, ln + "mlp_res")
            xm = rms_norm(h, self.p(ln + "post_attention_layernorm.weight"), self.eps)
            mlp = self.latent_moe(L, xm) if self.is_moe(L) else self.dense_mlp(ln + "mlp.", xm)
            p = p + mlp
        final = self.attn_res_mix(blocks, p, "output_attn_res")
        if stats is not None:
            stats["final_sources"] = len(blocks) + 1
        hidden = rms_norm(final, self.p("norm.weight"), self.eps)
        head = self.w["lm_head.weight"] if "lm_head.weight" in self.w else self.p("embed_tokens.weight")
        return hidden @ head.T

    def greedy(self, prompt, n_new):
        """n_new greedy tokens by repeated full forward passes; also the smallest top-2 margin."""
        seq = list(prompt)
        new, margins = [], []
        for _ in range(n_new):
            last = self.forward(seq)[-1]
            top = np.argsort(-last, kind="stable")[:2]
            margins.append(float(last[top[0]] - last[top[1]]))
            new.append(int(top[0]))
            seq.append(int(top[0]))
        return new, min(margins)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", help="K3 checkpoint directory")
    ap.add_argument("--ids", help="comma-separated prompt ids (default: reference.json prompt_ids)")
    ap.add_argument("--compare", help="a logits .npy file to compare with")
    ap.add_argument("--self-test", action="store_true", help="run the MXFP4 decode unit check")
    args = ap.parse_args()
    if args.self_test or not args.dir:
        test_mxfp4_decode()
        print("MXFP4 decode self-test: ok")
        if not args.dir:
            return
    if args.ids:
        ids = [int(t) for t in args.ids.split(",")]
    else:
        with open(os.path.join(args.dir, "reference.json")) as f:
            ids = json.load(f)["prompt_ids"]
    ref = K3Reference.load(args.dir)
    logits = ref.forward(ids)
    print(f"logits {logits.shape}, argmax of last position {int(np.argmax(logits[-1]))}, "
          f"skipped {len(ref.skipped)} vision tensors")
    if args.compare:
        other = np.load(args.compare)
        err = np.max(np.abs(logits - other))
        print(f"max abs diff {err:.3e}, relative {err / np.max(np.abs(other)):.3e}")


if __name__ == "__main__":
    sys.exit(main())
