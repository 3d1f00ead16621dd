//! [`KimiGguf`]: a llama.cpp Kimi Linear or Kimi K3 GGUF seen as hub checkpoint tensors, so
//! that `KimiLinear::load_from` runs unchanged. Layout changes of llama.cpp's converter are
//! undone here: `ssm_a = -exp(A_log)` back to `A_log`, stacked experts sliced (borrowed,
//! still quantized; K3's as `MXFP4` blocks under the plain `.weight` name), `attn_k_b`/
//! `attn_v_b` re-joined into `kv_b_proj` (as f32, because the key half is stored
//! transposed), convolutions and `A` reshaped, and K3's folded AttnRes scores served as the
//! mix's norm with a projection of ones (the model's fold `norm ⊙ proj` gives them back
//! exactly).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

use kimi_core::{DType, ModelConfig};
use kimi_gguf::{GgmlType, GgufFile, TensorData};

use super::recipes::{recipes, Layout, Recipe};
use crate::source::{format_error, gguf_dtype, WeightSource};
use crate::Result;

/// Where a hub tensor's values live in the GGUF.
#[derive(Clone, Copy)]
enum Target {
    /// All of recipe `.0`.
    Whole(usize),
    /// Expert `.1` of the stacked recipe `.0`.
    Expert(usize, usize),
    /// `kv_b_proj` from its key and value recipes.
    KvB { keys: usize, values: usize },
    /// An AttnRes mix's norm: the folded score of recipe `.0`.
    ResNorm(usize),
    /// An AttnRes mix's projection: ones, `[1, d]` (recipe `.0` holds the fold).
    ResProj(usize),
}

/// A Kimi Linear GGUF as a [`WeightSource`] of hub-named tensors.
pub struct KimiGguf<'f> {
    file: &'f GgufFile,
    recipes: Vec<Recipe>,
    by_hub: HashMap<String, Target>,
}

impl<'f> KimiGguf<'f> {
    /// Maps the tensors `config` (from [`super::config_from_gguf`]) calls for.
    pub fn new(file: &'f GgufFile, config: &ModelConfig) -> Self {
        let recipes = recipes(config);
        let mut by_hub = HashMap::new();
        let mut keys = HashMap::new();
        for (i, r) in recipes.iter().enumerate() {
            match r.layout {
                Layout::Same | Layout::NegExp => {
                    by_hub.insert(r.hub[0].clone(), Target::Whole(i));
                }
                Layout::Stacked => {
                    for (e, hub) in r.hub.iter().enumerate() {
                        by_hub.insert(hub.clone(), Target::Expert(i, e));
                    }
                }
                Layout::KvBKeys => {
                    keys.insert(r.hub[0].clone(), i);
                }
                Layout::KvBValues => {
                    if let Some(&k) = keys.get(&r.hub[0]) {
                        by_hub.insert(r.hub[0].clone(), Target::KvB { keys: k, values: i });
                    }
                }
                Layout::ResScore => {
                    by_hub.insert(r.hub[0].clone(), Target::ResNorm(i));
                    by_hub.insert(r.hub[1].clone(), Target::ResProj(i));
                }
            }
        }
        KimiGguf {
            file,
            recipes,
            by_hub,
        }
    }

    fn target(&self, hub: &str) -> Result<(Target, &Recipe)> {
        let target = self.by_hub.get(hub).copied().ok_or_else(|| {
            format_error(self.file, format!("no tensor of a Kimi GGUF holds `{hub}`"))
        })?;
        let (Target::Whole(i)
        | Target::Expert(i, _)
        | Target::KvB { keys: i, .. }
        | Target::ResNorm(i)
        | Target::ResProj(i)) = target;
        Ok((target, &self.recipes[i]))
    }

    /// Recipe `i`'s tensor, checked against the shape llama.cpp's converter writes (unit
    /// dimensions may be dropped, as after llama-quantize) and for a type kimi-infer runs.
    fn tensor(&self, i: usize) -> Result<(TensorData<'f>, DType)> {
        let r = &self.recipes[i];
        let ne = |shape: &[usize]| shape.iter().rev().copied().collect::<Vec<_>>();
        let t = self.file.tensor(&r.gguf).map_err(|_| {
            format_error(
                self.file,
                format!(
                    "tensor `{}` is missing; the metadata calls for shape {:?} (ggml ne {:?})",
                    r.gguf,
                    r.shape,
                    ne(&r.shape)
                ),
            )
        })?;
        let found = t.info.shape_outer_first();
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&found) != squeeze(&r.shape) {
            return Err(format_error(
                self.file,
                format!(
                    "tensor `{}` has shape {found:?} (ggml ne {:?}); the metadata calls for {:?} \
                     (ggml ne {:?})",
                    r.gguf,
                    t.info.ne,
                    r.shape,
                    ne(&r.shape)
                ),
            ));
        }
        let dtype = gguf_dtype(t.info.ggml_type).ok_or_else(|| {
            format_error(
                self.file,
                format!(
                    "tensor `{}` has type {}, which kimi-infer cannot run",
                    r.gguf, t.info.ggml_type
                ),
            )
        })?;
        Ok((t, dtype))
    }

    fn values(&self, i: usize) -> Result<Vec<f32>> {
        Ok(self.tensor(i)?.0.to_f32()?)
    }
}

impl WeightSource for KimiGguf<'_> {
    fn contains(&self, name: &str) -> bool {
        match self.target(name) {
            Ok((Target::KvB { keys, values }, _)) => [keys, values]
                .iter()
                .all(|&i| self.file.tensor(&self.recipes[i].gguf).is_ok()),
            Ok((_, r)) => self.file.tensor(&r.gguf).is_ok(),
            Err(_) => false,
        }
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.target(name).ok()? {
            (Target::ResProj(_), r) => Some(vec![1, r.hub_shape.iter().product()]),
            (_, r) => Some(r.hub_shape.clone()),
        }
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let (target, recipe) = self.target(name)?;
        let expected = self.shape(name).unwrap_or_default();
        if expected != shape {
            return Err(format_error(
                self.file,
                format!(
                    "`{name}` (GGUF `{}`) has shape {expected:?} by the metadata, the model \
                     needs {shape:?}",
                    recipe.gguf
                ),
            ));
        }
        match target {
            Target::Whole(i) if recipe.layout == Layout::NegExp => {
                let a = self.values(i)?;
                let a_log = a
                    .iter()
                    .map(|&v| {
                        // ssm_a = -exp(A_log) < 0; f64 keeps the round trip within an ulp.
                        (v < 0.0).then(|| (-(v as f64)).ln() as f32).ok_or_else(|| {
                            format_error(
                                self.file,
                                format!("`{}` must be -exp(A_log) < 0, found {v}", recipe.gguf),
                            )
                        })
                    })
                    .collect::<Result<Vec<f32>>>()?;
                Ok((DType::F32, Cow::Owned(f32_bytes(&a_log))))
            }
            Target::Whole(i) | Target::ResNorm(i) => {
                let (t, dtype) = self.tensor(i)?;
                Ok((dtype, Cow::Borrowed(t.bytes)))
            }
            Target::ResProj(_) => Ok((
                DType::F32,
                Cow::Owned(f32_bytes(&vec![1.0; shape.iter().product()])),
            )),
            Target::Expert(i, e) => {
                let (t, dtype) = self.tensor(i)?;
                let [rows, cols] = recipe.hub_shape[..] else {
                    return Err(format_error(self.file, format!("`{name}` is not a matrix")));
                };
                let row_bytes = t.info.ggml_type.row_bytes(cols).unwrap_or(usize::MAX);
                let start = e * rows * row_bytes;
                let bytes = t
                    .bytes
                    .get(start..start + rows * row_bytes)
                    .ok_or_else(|| {
                        format_error(
                            self.file,
                            format!("`{}` is too short for expert {e}", recipe.gguf),
                        )
                    })?;
                Ok((dtype, Cow::Borrowed(bytes)))
            }
            Target::KvB { keys, values } => {
                let kv_b = join_kv_b(
                    &self.recipes[keys],
                    &self.values(keys)?,
                    &self.values(values)?,
                );
                // f16 holds f16 and bf16 sources' values exactly and quantized ones to
                // within 2^-11 of their (far coarser) steps, at half the bytes MLA decode
                // reads per step; f32 sources stay f32.
                let (_, kd) = self.tensor(keys)?;
                let (_, vd) = self.tensor(values)?;
                if kd == DType::F32 || vd == DType::F32 {
                    Ok((DType::F32, Cow::Owned(f32_bytes(&kv_b))))
                } else {
                    let bytes = kv_b
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                        .collect();
                    Ok((DType::F16, Cow::Owned(bytes)))
                }
            }
        }
    }

    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        let mut wanted = HashSet::new();
        for hub in used {
            match self.target(hub)?.0 {
                Target::Whole(i)
                | Target::Expert(i, _)
                | Target::ResNorm(i)
                | Target::ResProj(i) => {
                    wanted.insert(self.recipes[i].gguf.as_str());
                }
                Target::KvB { keys, values } => {
                    wanted.insert(self.recipes[keys].gguf.as_str());
                    wanted.insert(self.recipes[values].gguf.as_str());
                }
            }
        }
        let unused: Vec<&str> = self
            .file
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !wanted.contains(n))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        Err(format_error(
            self.file,
            format!("tensors the model does not use: {}", unused.join(", ")),
        ))
    }
}

/// `kv_b_proj` `[heads·(nope + v), rank]` from `attn_k_b` `[heads, rank, nope]` (transposed
/// per head) and `attn_v_b` `[heads, v, rank]`.
pub(crate) fn join_kv_b(keys: &Recipe, k_b: &[f32], v_b: &[f32]) -> Vec<f32> {
    let [heads, rank, nope] = keys.shape[..] else {
        return Vec::new();
    };
    let v = v_b.len() / (heads * rank).max(1);
    let mut out = Vec::with_capacity(heads * (nope + v) * rank);
    for h in 0..heads {
        let kh = &k_b[h * rank * nope..(h + 1) * rank * nope];
        for j in 0..nope {
            out.extend((0..rank).map(|r| kh[r * nope + j]));
        }
        out.extend_from_slice(&v_b[h * v * rank..(h + 1) * v * rank]);
    }
    out
}

pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The GGUF type of a stored dtype.
pub(crate) fn ggml_type(dtype: DType) -> Option<GgmlType> {
    Some(match dtype {
        DType::F32 => GgmlType::F32,
        DType::F16 => GgmlType::F16,
        DType::BF16 => GgmlType::BF16,
        DType::Q8_0 => GgmlType::Q8_0,
        DType::Q4_0 => GgmlType::Q4_0,
        DType::Q4_1 => GgmlType::Q4_1,
        DType::Q5_0 => GgmlType::Q5_0,
        DType::Q5_1 => GgmlType::Q5_1,
        DType::Q4_K => GgmlType::Q4_K,
        DType::Q5_K => GgmlType::Q5_K,
        DType::Q6_K => GgmlType::Q6_K,
        DType::MXFP4 => GgmlType::MXFP4,
        _ => return None,
    })
}
