#!/usr/bin/env python3
"""Emulates the data path of `moe_int4_stream_layer` (kernels/int4_stream.cu) on the host:
the packed tile a producer fetches (part_fetch), the activations a lane holds (load_x) and
its row sums (row_dot), against a direct product of the dequantized rows, for both plane
formats (0: (q - z)·d with fractional z; 3: q·a - b). Needs numpy; not run by CI.
Usage: python3 scripts/cuda/emulate_int4_stream.py"""
import numpy as np
rng = np.random.default_rng(0)
def planes(R, C, fmt3):
    nb = C // 32
    q = rng.integers(0, 16, size=(R, nb, 32)).astype(np.uint8)
    codes = np.zeros((R, nb, 16), np.uint8)
    codes[:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    if fmt3:
        h = np.stack([rng.random((R, nb)).astype(np.float32) * .1, rng.standard_normal((R, nb)).astype(np.float32) * .1], -1)
        W = q * h[..., 0:1] - h[..., 1:2]
    else:
        h = np.stack([rng.random((R, nb)).astype(np.float32) * .1, rng.integers(0, 16, (R, nb)).astype(np.float32) + rng.random((R, nb)).astype(np.float32)], -1)
        W = (q - h[..., 1:2]) * h[..., 0:1]
    buf = codes.tobytes() + h.astype(np.float32).tobytes()
    return np.frombuffer(buf, np.uint8), W.reshape(R, C)
def part_fetch(m, rows, nb, r0, nr):
    codes = m[r0 * nb * 16:(r0 + nr) * nb * 16]
    hs = m[rows * nb * 16 + r0 * nb * 8: rows * nb * 16 + (r0 + nr) * nb * 8]
    return np.concatenate([codes, hs])
def load_x(x, words):
    xs = x.reshape(-1, 4)
    out = {}
    for lane in range(32):
        for j in range(words):
            c = lane + 32 * j
            a = xs[8 * (c >> 2) + (c & 3)]; b = xs[8 * (c >> 2) + (c & 3) + 4]
            out[(lane, j)] = (a, b, a.sum() + b.sum())
    return out
def row_dot(part, nr, r, nb, X, words, fmt3):
    code = part[:nr * nb * 16].view(np.uint32)[r * nb * 4:(r + 1) * nb * 4]
    head = part[nr * nb * 16:].view(np.float32).reshape(nr, nb, 2)[r]
    tot = 0.0
    for lane in range(32):
        acc = np.float32(0)
        for j in range(words):
            c = lane + 32 * j
            w = int(code[c]); hd = head[c >> 2]
            lo = w & 0x0F0F0F0F; hi = (w >> 4) & 0x0F0F0F0F
            a, b, s = X[(lane, j)]
            # Each value as the f32 0.5 + q/256 (`half_nib`), sums in f32 as the kernel does.
            half = lambda v, k: np.float32(0.5 + ((v >> (8 * k)) & 0xFF) / 256.0)
            p0 = np.float32(0); p1 = np.float32(0)
            for k in range(4):
                p0 = np.float32(p0 + half(lo, k) * a[k])
                p1 = np.float32(p1 + half(hi, k) * b[k])
            c0 = hd[1] if fmt3 else np.float32(hd[0] * hd[1])
            off = np.float32(np.float32(128.0) * hd[0] + c0)
            acc = np.float32(acc - off * s)
            acc = np.float32(acc + np.float32(256.0) * hd[0] * np.float32(p0 + p1))
        tot += acc
    return tot
for fmt3 in (0, 1):
    for R, C, rows in ((64, 512, 8), (96, 768, 32)):
        m, W = planes(R, C, fmt3)
        x = rng.standard_normal(C).astype(np.float32)
        X = load_x(x, C // 256)
        nb = C // 32
        worst = 0
        for r0 in range(0, R, rows):
            nr = min(rows, R - r0)
            part = part_fetch(m, R, nb, r0, nr)
            for r in range(nr):
                got = row_dot(part, nr, r, nb, X, C // 256, fmt3)
                ref = W[r0 + r].astype(np.float64) @ x
                worst = max(worst, abs(got - ref) / (abs(ref) + 1e-3))
        print("fmt3", fmt3, R, C, "worst rel", worst)
