//! Where weights come from: a safetensors checkpoint or a GGUF file on disk, or
//! deterministic random values for benchmarks and smoke tests of full-size shapes without a
//! download.

use std::borrow::Cow;
use std::collections::HashSet;

use half::bf16;
use kimi_core::DType;
use kimi_gguf::{GgmlType, GgufFile};
use kimi_weights::{Checkpoint, SafetensorsDir};
use rayon::prelude::*;

use crate::{ModelError, Result};

/// A provider of named, shape-checked tensors.
pub trait WeightSource {
    /// Whether an optional tensor is present.
    fn contains(&self, name: &str) -> bool;
    /// The tensor `name`, which must have `shape`: its dtype and little-endian bytes.
    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)>;
    /// Fails if the source holds tensors outside `used`.
    fn check_all_used(&self, used: &HashSet<String>) -> Result<()>;
    /// The stored shape of `name`, where the source knows it before a load (a tensor whose
    /// layout varies between checkpoints, such as K3's padded `A_log`). Default: unknown.
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let _ = name;
        None
    }
    /// Every tensor name the source holds, where it can list them. Default: none.
    fn names(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What [`WeightsReopener`] calls with the weights opened again.
pub type WithSource<'a> = dyn FnMut(&dyn WeightSource) -> Result<()> + 'a;

/// Opens a model's weights again after it loaded, for a rank that takes on routed experts
/// when the expert placement changes (`CausalLm::set_expert_ranks`): a checkpoint is
/// reopened (its files are mapped, not read), random weights are made again.
#[derive(Clone)]
pub struct WeightsReopener(std::sync::Arc<Reopen>);

/// Opens the weights and calls its argument with them.
type Reopen = dyn Fn(&mut WithSource<'_>) -> Result<()> + Send + Sync;

impl WeightsReopener {
    /// A reopener that opens the weights and calls its argument with them.
    pub fn new(open: impl Fn(&mut WithSource<'_>) -> Result<()> + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(open))
    }

    /// Calls `f` with the weights opened again.
    pub fn with(&self, f: &mut WithSource<'_>) -> Result<()> {
        (self.0)(f)
    }
}

impl std::fmt::Debug for WeightsReopener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightsReopener")
    }
}

impl WeightSource for SafetensorsDir {
    fn contains(&self, name: &str) -> bool {
        SafetensorsDir::contains(self, name)
    }
    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let view = self.get_shaped(name, shape)?;
        Ok((view.dtype, Cow::Borrowed(view.bytes)))
    }
    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        Ok(SafetensorsDir::check_all_used(self, used)?)
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        SafetensorsDir::shape(self, name).map(<[usize]>::to_vec)
    }
    fn names(&self) -> Vec<String> {
        self.tensor_names().into_iter().map(String::from).collect()
    }
}

impl WeightSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        WeightSource::contains(&**self, name)
    }
    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        WeightSource::load(&**self, name, shape)
    }
    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        WeightSource::check_all_used(&**self, used)
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        WeightSource::shape(&**self, name)
    }
    fn names(&self) -> Vec<String> {
        WeightSource::names(&**self)
    }
}

/// GGUF tensors by their GGUF names (`blk.0.attn_q.weight`), shapes outermost first
/// (`[out, in]` for a matrix whose ggml `ne` is `[in, out]`), in their stored type.
impl WeightSource for GgufFile {
    fn contains(&self, name: &str) -> bool {
        self.tensor(name).is_ok()
    }
    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let tensor = self.tensor(name)?;
        let found = tensor.info.shape_outer_first();
        let dtype = gguf_dtype(tensor.info.ggml_type);
        match dtype {
            Some(dtype) if found == shape => Ok((dtype, Cow::Borrowed(tensor.bytes))),
            Some(_) => Err(format_error(
                self,
                format!("tensor `{name}` has shape {found:?}, the model needs {shape:?}"),
            )),
            None => Err(format_error(
                self,
                format!(
                    "tensor `{name}` has type {}, which kimi-infer cannot run",
                    tensor.info.ggml_type
                ),
            )),
        }
    }
    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        let unused: Vec<&str> = self
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .filter(|name| !used.contains(*name))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        Err(format_error(
            self,
            format!("tensors the model does not use: {}", unused.join(", ")),
        ))
    }
}

/// `n` block-quantized values of `dtype` as bf16 bytes, widened a chunk of whole blocks at a
/// time (no f32 copy of the whole tensor): GGUF weights for a backend without kernels for
/// their type. The f32 values are exact; bf16 rounds them to nearest even.
pub(crate) fn quantized_to_bf16(dtype: DType, bytes: &[u8], n: usize) -> Result<Vec<u8>> {
    const CHUNK_BLOCKS: usize = 4096;
    let unsupported = || kimi_ops::Error::Unsupported(format!("widening {dtype} to bf16"));
    if let Some(block_bytes) = kimi_core::qblocks::block_bytes(dtype) {
        // The blocks of quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors).
        if !n.is_multiple_of(32) || bytes.len() != n / 32 * block_bytes {
            return Err(kimi_ops::Error::Unsupported(format!(
                "{n} values of {dtype} in {} bytes",
                bytes.len()
            ))
            .into());
        }
        let mut out = Vec::with_capacity(2 * n);
        let mut chunk = vec![0f32; CHUNK_BLOCKS * 32];
        for blocks in bytes.chunks(CHUNK_BLOCKS * block_bytes) {
            let part = &mut chunk[..blocks.len() / block_bytes * 32];
            kimi_core::qblocks::dequantize(dtype, blocks, part);
            out.extend(
                part.iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
            );
        }
        return Ok(out);
    }
    let ty = GgmlType::all()
        .find(|t| gguf_dtype(*t) == Some(dtype) && t.is_quantized())
        .ok_or_else(unsupported)?;
    let (values, block_bytes) = (ty.block_size(), ty.type_size());
    if !n.is_multiple_of(values) || bytes.len() != n / values * block_bytes {
        return Err(kimi_ops::Error::Unsupported(format!(
            "{n} values of {dtype} in {} bytes",
            bytes.len()
        ))
        .into());
    }
    let mut out = Vec::with_capacity(2 * n);
    let mut chunk = vec![0f32; CHUNK_BLOCKS * values];
    for blocks in bytes.chunks(CHUNK_BLOCKS * block_bytes) {
        let part = &mut chunk[..blocks.len() / block_bytes * values];
        kimi_gguf::dequantize_row(ty, blocks, part)?;
        out.extend(
            part.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()),
        );
    }
    Ok(out)
}

/// The dtype of a GGUF tensor type, if kimi-infer has one for it.
pub(crate) fn gguf_dtype(ty: GgmlType) -> Option<DType> {
    Some(match ty {
        GgmlType::F32 => DType::F32,
        GgmlType::F16 => DType::F16,
        GgmlType::BF16 => DType::BF16,
        GgmlType::Q8_0 => DType::Q8_0,
        GgmlType::Q4_0 => DType::Q4_0,
        GgmlType::Q4_1 => DType::Q4_1,
        GgmlType::Q5_0 => DType::Q5_0,
        GgmlType::Q5_1 => DType::Q5_1,
        GgmlType::Q4_K => DType::Q4_K,
        GgmlType::Q5_K => DType::Q5_K,
        GgmlType::Q6_K => DType::Q6_K,
        GgmlType::MXFP4 => DType::MXFP4,
        _ => return None,
    })
}

pub(crate) fn format_error(file: &GgufFile, reason: String) -> ModelError {
    ModelError::Format {
        path: file.path().to_path_buf(),
        reason,
    }
}

/// Random weights with a scale that keeps activations finite through any depth:
/// linear weights uniform in ±1/√in, norms near 1, decay parameters in their trained ranges.
/// The values depend only on the seed and the tensor name.
pub struct RandomWeights {
    /// Stored dtype of matrices (`A_log` and `dt_bias` stay f32 as in real checkpoints).
    /// [`DType::Q4Z`] makes the linear layers 4-bit as AWQ and GPTQ checkpoints have them
    /// (see [`quantized_like_awq`]); the rest is bf16.
    pub dtype: DType,
    /// Seed mixed into every tensor's values.
    pub seed: u64,
}

impl WeightSource for RandomWeights {
    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let n = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| too_large(name, shape, None))?;
        if name.ends_with(".weight_packed") || name.ends_with(".weight_scale") {
            return Ok((
                DType::U8,
                Cow::Owned(random_mxfp4_plane(name, shape, n, self.seed)?),
            ));
        }
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let a = fan_in.max(1.0).powf(-0.5);
        if self.dtype == DType::Q4Z && quantized_like_awq(name, shape) {
            return Ok((
                DType::Q4Z,
                Cow::Owned(random_q4z(name, shape, n, a, self.seed)?),
            ));
        }
        let dtype = if self.dtype == DType::Q4Z {
            DType::BF16
        } else {
            self.dtype
        };
        let value: fn(f32, f32) -> f32 = if name.ends_with("A_log") {
            |u, _| (1.0 + 15.0 * u).ln()
        } else if name.ends_with("dt_bias") || name.ends_with("e_score_correction_bias") {
            |u, _| (u - 0.5) * 0.2
        } else if name.contains("norm") {
            |u, _| 1.0 + (u - 0.5) * 0.1
        } else {
            |u, a| (2.0 * u - 1.0) * a
        };
        let keep_f32 = name.ends_with("A_log") || name.ends_with("dt_bias") || dtype == DType::F32;
        let esize = if keep_f32 { 4 } else { 2 };
        let seed = self.seed ^ fnv(name);
        // Fixed-size chunks with their own streams: the same values on any thread count, and
        // a 48B-parameter model fills in seconds instead of minutes.
        const CHUNK: usize = 1 << 16;
        let mut bytes = zeroed_bytes(name, shape, n.checked_mul(esize))?;
        bytes
            .par_chunks_mut(CHUNK * esize)
            .enumerate()
            .for_each(|(ci, chunk)| {
                let mut state = seed ^ (ci as u64).wrapping_mul(0xd1b54a32d192ed03);
                for el in chunk.chunks_exact_mut(esize) {
                    let v = value(splitmix_unit(&mut state), a);
                    if keep_f32 {
                        el.copy_from_slice(&v.to_le_bytes());
                    } else {
                        el.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                    }
                }
            });
        Ok((
            if keep_f32 { DType::F32 } else { DType::BF16 },
            Cow::Owned(bytes),
        ))
    }

    fn check_all_used(&self, _used: &HashSet<String>) -> Result<()> {
        Ok(())
    }
}

/// Another source whose routers prefer some experts: each MoE layer's
/// `e_score_correction_bias` (the selection-only bias of Kimi's sigmoid routers) gets
/// `−skew · ln(r + 1)` added, `r` the expert's rank in a per-layer permutation drawn from
/// the tensor's name. Selection then behaves roughly like a Zipf law over that ranking
/// (a Gumbel-like spread of the scores turns an additive bias into a factor on the odds);
/// `bench` measures and prints what share of the routed pairs the most-used experts take,
/// which is the figure to quote. Every other tensor is the inner source's.
pub struct SkewedRouting<S> {
    /// The weights before the routers are skewed.
    pub inner: S,
    /// Bias per unit of `ln(rank + 1)`; 0 leaves the routers as they are.
    pub skew: f32,
}

impl<S: WeightSource> WeightSource for SkewedRouting<S> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let (dtype, bytes) = self.inner.load(name, shape)?;
        if self.skew == 0.0 || !name.ends_with("e_score_correction_bias") {
            return Ok((dtype, bytes));
        }
        let mut values: Vec<f32> = match dtype {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Input(format!(
                    "{name}: a skewed router needs an f32 or bf16 bias, not {other}"
                )))
            }
        };
        let seed = fnv(name) ^ 0x5ca1ab1e;
        let mut order: Vec<(u64, usize)> = (0..values.len())
            .map(|i| {
                let mut state = seed ^ (i as u64).wrapping_mul(0xd1b54a32d192ed03);
                splitmix_unit(&mut state);
                (state, i)
            })
            .collect();
        order.sort_unstable();
        for (rank, &(_, i)) in order.iter().enumerate() {
            values[i] -= self.skew * ((rank + 1) as f32).ln();
        }
        let out: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        Ok((dtype, Cow::Owned(out)))
    }

    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        self.inner.check_all_used(used)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
}

/// Whether a 4-bit checkpoint made by AutoAWQ or GPTQ quantizes this tensor: the matrices
/// of the linear layers (whole 32-value blocks along their input), not the embeddings, the
/// LM head, norms, convolutions or MoE routers (`…gate.weight`, kept in 16 bits).
pub(crate) fn quantized_like_awq(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2
        && shape[1].is_multiple_of(32)
        && name.ends_with(".weight")
        && !name.ends_with(".gate.weight")
        && !["norm", "embed", "lm_head", "conv"]
            .iter()
            .any(|part| name.contains(part))
}

/// A random [`DType::Q4Z`] matrix as an RTN quantizer with an integer zero point writes one:
/// codes uniform over 1..=15, `z = 8`, `d = a / 8` (values in `[−7a/8, 7a/8]`, mean zero).
/// Code 0 is left out so that the values are symmetric: all 16 codes would give every row
/// the same negative mean, hence every hidden state a common direction, and the routers
/// would then send every token to the same few experts (as a model of such weights did:
/// 10 % of the experts took every pair), unlike the bf16 random weights or a trained model.
fn random_q4z(name: &str, shape: &[usize], n: usize, a: f32, seed: u64) -> Result<Vec<u8>> {
    let bytes = DType::Q4Z.storage_bytes(n);
    let mut out = zeroed_bytes(name, shape, bytes)?;
    let seed = seed ^ fnv(name);
    // Chunks of whole blocks with their own streams, as for the float weights.
    const CHUNK_BLOCKS: usize = 1 << 11;
    let bb = DType::Q4Z.block_bytes();
    out.par_chunks_mut(CHUNK_BLOCKS * bb)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let mut state = seed ^ (ci as u64).wrapping_mul(0xd1b54a32d192ed03);
            for block in chunk.chunks_exact_mut(bb) {
                let codes: [u8; 32] =
                    std::array::from_fn(|_| 1 + ((splitmix_unit(&mut state) * 15.0) as u8).min(14));
                kimi_core::qblocks::write_q4z(&codes, a / 8.0, 8.0, block);
            }
        });
    Ok(out)
}

/// One plane of a random MXFP4 matrix: uniform codes, or E8M0 scales of 2^-8 .. 2^-5 so that
/// the values (up to ±6 · scale) keep activations finite through any depth.
fn random_mxfp4_plane(name: &str, shape: &[usize], n: usize, seed: u64) -> Result<Vec<u8>> {
    let scales = name.ends_with(".weight_scale");
    let mut bytes = zeroed_bytes(name, shape, Some(n))?;
    const CHUNK: usize = 1 << 16;
    let seed = seed ^ fnv(name);
    bytes
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let mut state = seed ^ (ci as u64).wrapping_mul(0xd1b54a32d192ed03);
            for b in chunk.iter_mut() {
                let u = splitmix_unit(&mut state);
                *b = if scales {
                    119 + (u * 4.0) as u8
                } else {
                    (u * 256.0) as u8
                };
            }
        });
    Ok(bytes)
}

/// `bytes` zero bytes for tensor `name`, or an error where the size overflows or the
/// allocator refuses it (a config's sizes are input: they must not abort the process).
fn zeroed_bytes(name: &str, shape: &[usize], bytes: Option<usize>) -> Result<Vec<u8>> {
    let len = bytes.ok_or_else(|| too_large(name, shape, None))?;
    // Ask first, then take zeroed pages (mapped lazily, filled in parallel by the caller)
    // rather than writing `len` zeros on one thread.
    let mut probe = Vec::<u8>::new();
    probe
        .try_reserve_exact(len)
        .map_err(|_| too_large(name, shape, Some(len)))?;
    drop(probe);
    Ok(vec![0u8; len])
}

fn too_large(name: &str, shape: &[usize], bytes: Option<usize>) -> ModelError {
    let size = match bytes {
        Some(b) => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        None => "more bytes than memory can address".into(),
    };
    ModelError::Input(format!(
        "cannot allocate random weights for `{name}` {shape:?}: {size}"
    ))
}

/// splitmix64 step mapped to [0, 1).
fn splitmix_unit(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9e3779b97f4a7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RandomWeights` of Q4Z: the linear layers as 4-bit blocks (integer zero point 8,
    /// values within ±(7/8)/√in, symmetric about zero), everything AWQ keeps in 16 bits as
    /// bf16, the same bytes on every call.
    #[test]
    fn random_q4z_weights_quantize_the_linear_layers_like_awq() {
        let source = RandomWeights {
            dtype: DType::Q4Z,
            seed: 5,
        };
        let name = "model.layers.1.block_sparse_moe.experts.3.w1.weight";
        let (dtype, bytes) = source.load(name, &[48, 256]).unwrap();
        assert_eq!(dtype, DType::Q4Z);
        assert_eq!(bytes.len(), DType::Q4Z.storage_bytes(48 * 256).unwrap());
        assert_eq!(source.load(name, &[48, 256]).unwrap().1, bytes);
        let mut values = vec![0.0f32; 48 * 256];
        assert!(kimi_core::qblocks::dequantize(
            DType::Q4Z,
            &bytes,
            &mut values
        ));
        let a = 1.0 / 16.0;
        let edge = a * 7.0 / 8.0;
        assert!(values.iter().all(|v| (-edge..=edge).contains(v)));
        // Codes spread over the range: both ends occur.
        assert!(values.contains(&-edge) && values.contains(&edge));
        // Zero mean (a common offset makes the routers pick the same experts for every
        // token): the mean of 12,288 values of standard deviation 0.5a is within 0.02a.
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64;
        assert!(mean.abs() < 0.02 * a as f64, "mean {mean}");
        for (name, shape) in [
            ("model.layers.1.block_sparse_moe.gate.weight", vec![8, 256]),
            ("model.layers.0.input_layernorm.weight", vec![256]),
            ("model.embed_tokens.weight", vec![100, 256]),
            ("lm_head.weight", vec![100, 256]),
            ("model.layers.0.self_attn.q_conv1d.weight", vec![64, 4]),
            ("model.layers.0.self_attn.f_b_proj.weight", vec![64, 24]),
        ] {
            let (dtype, _) = source.load(name, &shape).unwrap();
            assert_eq!(dtype, DType::BF16, "{name}");
        }
        assert!(quantized_like_awq(
            "model.layers.0.self_attn.kv_b_proj.weight",
            &[512, 512]
        ));
    }

    /// Widening to bf16 gives the bf16 rounding of every dequantized value, across chunk
    /// boundaries, and refuses bytes that do not hold `n` values.
    #[test]
    fn quantized_weights_widen_to_the_bf16_of_their_values() {
        for (dtype, ty, n) in [
            (DType::Q8_0, GgmlType::Q8_0, 32 * 4096 * 2 + 32 * 5),
            (DType::Q4_K, GgmlType::Q4_K, 256 * 4096 + 256 * 3),
            (DType::Q6_K, GgmlType::Q6_K, 256 * 7),
        ] {
            let values: Vec<f32> = (0..n)
                .map(|i| ((i as u32).wrapping_mul(2654435761) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let bytes = kimi_gguf::quantize(ty, &values).unwrap();
            let want: Vec<u8> = kimi_gguf::dequantize(ty, &bytes, n)
                .unwrap()
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            assert_eq!(
                quantized_to_bf16(dtype, &bytes, n).unwrap(),
                want,
                "{dtype}"
            );
            let short = &bytes[..bytes.len() - 1];
            let err = quantized_to_bf16(dtype, short, n).unwrap_err().to_string();
            assert!(err.contains(&format!("{n} values of {dtype}")), "{err}");
        }
        assert!(quantized_to_bf16(DType::BF16, &[0, 0], 1).is_err());
    }

    /// A skewed router's bias is the inner one minus `skew · ln(rank + 1)` over a permutation
    /// (every rank once), in the inner dtype; other tensors and a skew of 0 are untouched.
    #[test]
    fn skewed_routing_ranks_each_layers_experts() {
        let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
        let skew = 0.5f32;
        let load = |dtype, skew| {
            let source = SkewedRouting {
                inner: RandomWeights { dtype, seed: 3 },
                skew,
            };
            let (got, bytes) = source.load(bias, &[64]).unwrap();
            assert_eq!(got, dtype);
            bytes.into_owned()
        };
        let f32s = |b: Vec<u8>| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let (before, after) = (f32s(load(DType::F32, 0.0)), f32s(load(DType::F32, skew)));
        let ranks: Vec<usize> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| (((b - a) / skew).exp() - 1.0).round() as usize)
            .collect();
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..64).collect::<Vec<_>>(), "one expert per rank");
        for ((b, a), r) in before.iter().zip(&after).zip(&ranks) {
            assert_eq!(*a, b - skew * ((r + 1) as f32).ln());
        }
        // bf16: the same ranks, the skewed value rounded once.
        let plain = load(DType::BF16, 0.0);
        let want: Vec<u8> = plain
            .chunks_exact(2)
            .zip(&ranks)
            .flat_map(|(c, r)| {
                let b = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                bf16::from_f32(b - skew * ((r + 1) as f32).ln()).to_le_bytes()
            })
            .collect();
        assert_eq!(load(DType::BF16, skew), want);
        let source = SkewedRouting {
            inner: RandomWeights {
                dtype: DType::BF16,
                seed: 3,
            },
            skew,
        };
        let other = "model.layers.1.mlp.gate.weight";
        assert_eq!(
            source.load(other, &[4, 8]).unwrap().1.as_ref(),
            source.inner.load(other, &[4, 8]).unwrap().1.as_ref()
        );
    }
}
