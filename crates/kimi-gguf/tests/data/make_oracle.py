#!/usr/bin/env python3
"""Writes tests/data/oracle.gguf, the independent oracle for kimi-gguf's tests.

Everything in it comes from implementations independent of kimi-gguf: the `gguf` Python
package (gguf-py, llama.cpp's own Python GGUF library) and ggml's reference quantizers:
  - metadata of every value type, written by gguf-py's GGUFWriter (so the Rust reader is
    checked against the reference writer);
  - for each supported type T, `T.raw` (random blocks with sane scale fields) and
    `T.dequant` (F32, gguf.quants.dequantize of those blocks);
  - `quant.input` (F32, 8 rows of 256 values from different distributions, signed zeros
    and a sparse row included) and `T.quant`, its quantization to each type T by ggml's
    own quantize_row_*_ref, run through GGML_REF (below). (gguf-py quantizes the 32-value
    formats too, but gives a zero min the other sign than ggml now and then.)

Regenerate (needs PyPI):
  python3 -m venv /tmp/ggufpy && /tmp/ggufpy/bin/pip install gguf==0.19.0
  GGML_REF=/path/to/ref /tmp/ggufpy/bin/python crates/kimi-gguf/tests/data/make_oracle.py
GGML_REF is a program, not part of this repository, built from the quantize_row_*_ref
functions of llama.cpp's ggml/src/ggml-quants.c: `ref TYPE < values.f32 > blocks`
quantizes little-endian f32 values (TYPE is one of Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K
Q6_K) and writes the blocks. The committed oracle.gguf used llama.cpp commit 01243c5.
"""
import os
import subprocess

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T, GGUFValueType as V

rng = np.random.default_rng(20261130)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.gguf")
w = gguf.GGUFWriter(out, arch="oracle")

w.add_key_value("t.u8", 200, V.UINT8)
w.add_key_value("t.i8", -100, V.INT8)
w.add_key_value("t.u16", 60000, V.UINT16)
w.add_key_value("t.i16", -30000, V.INT16)
w.add_key_value("t.u32", 4000000000, V.UINT32)
w.add_key_value("t.i32", -2000000000, V.INT32)
w.add_key_value("t.u64", 18000000000000000000, V.UINT64)
w.add_key_value("t.i64", -9000000000000000000, V.INT64)
w.add_key_value("t.f32", 0.15625, V.FLOAT32)
w.add_key_value("t.f64", -2.5e-300, V.FLOAT64)
w.add_key_value("t.bool", True, V.BOOL)
w.add_key_value("t.string", "héllo ✓", V.STRING)
w.add_key_value("t.array_u16", [1, 2, 65535], V.ARRAY, sub_type=V.UINT16)
w.add_key_value("t.array_f32", [0.5, -1.25], V.ARRAY, sub_type=V.FLOAT32)
w.add_key_value("t.array_string", ["a", "", "ü"], V.ARRAY, sub_type=V.STRING)
w.add_key_value("t.array_bool", [True, False], V.ARRAY, sub_type=V.BOOL)
w.add_key_value("t.nested", [[1, 2], ["x"]], V.ARRAY)

# Byte offsets of the f16 scale fields in each block.
SCALE_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
for qtype, fields in SCALE_FIELDS.items():
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = 4 if block_size == 256 else 8
    raw = rng.integers(0, 256, size=(2, num_blocks // 2 * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for f in fields:
        scale = rng.uniform(-0.1, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, f:f + 2] = scale.view(np.uint8).reshape(-1, 2)
    name = qtype.name
    w.add_tensor(f"{name}.raw", raw, raw_dtype=qtype)
    w.add_tensor(f"{name}.dequant", gguf.quants.dequantize(raw, qtype).astype(np.float32))

# Quantization inputs: one 256-value row per distribution.
n = 256
sparse = rng.standard_normal(n) * (rng.integers(0, 10, n) == 0)  # with signed zeros
rows = [
    rng.standard_normal(n),
    rng.uniform(-1, 1, n),
    rng.standard_normal(n) * 0.02 * np.where(rng.integers(0, 50, n) == 0, 8, 1),
    sparse,
    rng.uniform(0.5, 2.0, n),
    np.where(np.arange(n) == 100, 5.0, 0.0),
    np.concatenate([np.full(128, 0.75), np.full(128, -3.0)]),
    np.zeros(n),
]
quant_input = np.stack(rows).astype(np.float32)
w.add_tensor("quant.input", quant_input)
for qtype in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]:
    blocks = subprocess.run([os.environ["GGML_REF"], qtype.name], input=quant_input.tobytes(),
                            capture_output=True, check=True).stdout
    raw = np.frombuffer(blocks, dtype=np.uint8).reshape(len(rows), -1)
    w.add_tensor(f"{qtype.name}.quant", raw, raw_dtype=qtype)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", out, os.path.getsize(out), "bytes")
