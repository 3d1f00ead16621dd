//! Quantized Hugging Face checkpoints, read as the quantization tools write them.
//!
//! `config.json`'s `quantization_config` names the tool (`quant_method`); each matrix the
//! model asks for as `X.weight` is then answered from the tensors that tool stores for it:
//!
//! | method | stored for `X` | value of `w[r, c]` |
//! |---|---|---|
//! | compressed-tensors `pack-quantized` | `weight_packed` i32 `[rows, cols·bits/32]` (element `i` of a row at bit `i·bits` of its words), `weight_scale` `[rows, groups]`, `weight_zero_point` (asymmetric: i32 packed along rows, or i8), `weight_shape`, `weight_g_idx` (activation order) | `(u − uz) · s`, `u` the stored code (`q + 2^(bits−1)`) |
//! | compressed-tensors `int-quantized` | `weight` i8, `weight_scale`, `weight_zero_point` (i8, asymmetric) | `(q − z) · s` |
//! | compressed-tensors `float-quantized` | `weight` F8_E4M3, `weight_scale` (`[1]`, `[rows, 1]`, `[rows, groups]` or blocks) | `e4m3(q) · s` |
//! | compressed-tensors `mxfp4-pack-quantized` | `weight_packed` u8 `[rows, cols/2]`, `weight_scale` E8M0 `[rows, cols/32]` | MXFP4 |
//! | AutoAWQ (`version: gemm`) | `qweight` i32 `[cols, rows/8]` (nibble `i` of word `j` is row `8j + [0,2,4,6,1,3,5,7][i]`), `qzeros` i32 `[cols/g, rows/8]` (same order), `scales` f16 `[cols/g, rows]` | `(q − z) · s` |
//! | GPTQ (AutoGPTQ, GPTQModel) | `qweight` i32 `[cols·bits/32, rows]` (packed along the input), `qzeros` i32 `[groups, rows·bits/32]`, `scales` `[groups, rows]`, `g_idx` `[cols]` | `(q − z) · s`, `z` = stored + 1 in the v1 format |
//! | `fp8` (DeepSeek V3, Kimi K2) | `weight` F8_E4M3, `weight_scale_inv` f32 `[⌈rows/128⌉, ⌈cols/128⌉]` | `e4m3(q) · s` |
//!
//! Each matrix is rewritten once at load into the block types of `kimi_core::qblocks` (or
//! MXFP4), values unchanged; a matrix those blocks cannot hold exactly (groups smaller than
//! 32 values, activation orders that split a 32-value block between groups, rows that are
//! not whole blocks) is widened to f32, also exactly. Anything else the format stores is
//! refused with the tensor, the file and the field named.

pub mod awq;
pub mod gptq;
mod repack;
pub mod rtn;

use std::path::{Path, PathBuf};

use kimi_core::DType;
use kimi_weights::{SafetensorsDir, TensorView};
use serde_json::Value;

use crate::{ModelError, Result};
pub(crate) use repack::{Fp8Matrix, IntMatrix};

/// The quantization tool of a checkpoint and what its config says about the layout.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantMethod {
    /// llm-compressor's compressed-tensors (`pack-quantized`, `int-quantized`,
    /// `float-quantized`, `mxfp4-pack-quantized`); the stored tensors say which.
    CompressedTensors {
        /// The `num_bits` of the config groups' integer weights (a packed row's width
        /// alone can fit two: 16 values are two words at 3 bits and at 4).
        int_bits: Vec<u32>,
    },
    /// AutoAWQ's GEMM layout, 4-bit.
    Awq {
        /// Input columns per scale (`group_size`; `-1`: the whole row).
        group_size: Option<usize>,
    },
    /// GPTQ (AutoGPTQ, GPTQModel, optimum).
    Gptq {
        /// Bits per code (2, 4 or 8; 3-bit packing crosses words and is refused).
        bits: u32,
        /// `group_size` (`None` for `-1`: one group per row).
        group_size: Option<usize>,
        /// The v1 format (AutoGPTQ's, `checkpoint_format: gptq`) stores zero points minus
        /// one; v2 (`gptq_v2`) stores them as they are.
        v1: bool,
    },
    /// Block-scaled FP8 (`quant_method: fp8`, `weight_scale_inv`).
    Fp8 {
        /// `weight_block_size` `[rows, cols]`; `None`: one scale per tensor.
        block: Option<[usize; 2]>,
    },
}

/// A checkpoint's `quantization_config`, read once when it is opened.
#[derive(Clone, Debug)]
pub struct QuantScheme {
    /// The tool.
    pub method: QuantMethod,
    /// Where the config was (`quantization_config` or `text_config.quantization_config`),
    /// for messages.
    field: String,
    config_path: PathBuf,
}

/// A matrix read from a checkpoint's quantized tensors: its repacked dtype and bytes, and
/// every stored tensor that went into it.
pub(crate) struct Decoded {
    pub dtype: DType,
    pub bytes: Vec<u8>,
    pub parts: Vec<String>,
}

/// A checkpoint's quantization scheme for a weight source: which weights its quantized
/// tensors hold, their decoding, and the stored tensors read as their parts (so that the
/// check for unused tensors counts them). Both families' checkpoint sources read through it.
pub(crate) struct QuantReader {
    scheme: Option<QuantScheme>,
    parts: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl QuantReader {
    pub fn new(scheme: Option<QuantScheme>) -> Self {
        Self {
            scheme,
            parts: Default::default(),
        }
    }

    /// The scheme, if the checkpoint has one.
    pub fn scheme(&self) -> Option<&QuantScheme> {
        self.scheme.as_ref()
    }

    /// The scheme, where the stored weight `stored` is held in its quantized tensors.
    pub fn holding(&self, files: &SafetensorsDir, stored: &str) -> Option<&QuantScheme> {
        self.scheme.as_ref().filter(|q| q.holds(files, stored))
    }

    /// Decodes `stored` (held by `q`, of logical shape `shape`), recording its parts as read.
    pub fn decode(
        &self,
        q: &QuantScheme,
        files: &SafetensorsDir,
        stored: &str,
        shape: &[usize],
    ) -> Result<(DType, Vec<u8>)> {
        let decoded = q.decode(files, stored, shape)?;
        self.parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(decoded.parts);
        Ok((decoded.dtype, decoded.bytes))
    }

    /// `used` with every tensor read as a part added.
    pub fn with_parts(
        &self,
        mut used: std::collections::HashSet<String>,
    ) -> std::collections::HashSet<String> {
        let parts = self
            .parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        used.extend(parts.iter().cloned());
        used
    }
}

/// Tensors a quantized checkpoint stores beside a weight for activation quantization, which
/// kimi-infer does not apply (activations stay f32): read as part of the weight.
const ACTIVATION_PARTS: [&str; 4] = [
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
];

impl QuantScheme {
    /// The scheme of a checkpoint's config.json (at the top level, or in K3's
    /// `text_config`), `None` where it has none. Fails naming the field for a method or
    /// a layout kimi-infer cannot read.
    pub fn from_config(json: &Value, config_path: &Path) -> Result<Option<Self>> {
        let (q, field) = match json.get("quantization_config") {
            Some(q) => (q, "quantization_config".to_string()),
            None => match json
                .get("text_config")
                .and_then(|t| t.get("quantization_config"))
            {
                Some(q) => (q, "text_config.quantization_config".to_string()),
                None => return Ok(None),
            },
        };
        let bad = |what: String| ModelError::Format {
            path: config_path.to_path_buf(),
            reason: what,
        };
        let text = |key: &str| q.get(key).and_then(Value::as_str);
        let method = text("quant_method").unwrap_or("(absent)");
        let group = |key: &str| -> Result<Option<usize>> {
            match q.get(key).and_then(Value::as_i64) {
                None | Some(-1) => Ok(None),
                Some(g) if g > 0 => Ok(Some(g as usize)),
                Some(g) => Err(bad(format!(
                    "{field}.{key} is {g}; expected -1 or a positive size"
                ))),
            }
        };
        let method = match method {
            "compressed-tensors" => {
                for key in ["sparsity_config", "transform_config"] {
                    if q.get(key).is_some_and(|v| !is_empty(v)) {
                        return Err(bad(format!(
                            "{field}.{key}: sparse or rotated compressed-tensors checkpoints \
                             are not supported"
                        )));
                    }
                }
                let mut int_bits: Vec<u32> = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .into_iter()
                    .flat_map(|g| g.values())
                    .filter_map(|g| g.get("weights"))
                    .filter(|w| w.get("type").and_then(Value::as_str) == Some("int"))
                    .filter_map(|w| w.get("num_bits").and_then(Value::as_u64))
                    .map(|b| b as u32)
                    .collect();
                int_bits.sort_unstable();
                int_bits.dedup();
                QuantMethod::CompressedTensors { int_bits }
            }
            "awq" => {
                let version = text("version").unwrap_or("gemm").to_ascii_lowercase();
                if version != "gemm" {
                    return Err(bad(format!(
                        "{field}.version {version:?}: kimi-infer reads AutoAWQ's GEMM layout \
                         (\"gemm\") only"
                    )));
                }
                let bits = q.get("bits").or(q.get("w_bit")).and_then(Value::as_u64);
                if bits.is_some_and(|b| b != 4) {
                    return Err(bad(format!(
                        "{field}.bits is {}; AutoAWQ's GEMM layout is 4-bit",
                        bits.unwrap_or(0)
                    )));
                }
                if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(bad(format!(
                        "{field}.zero_point false: AutoAWQ's GEMM layout stores zero points"
                    )));
                }
                let key = if q.get("group_size").is_some() {
                    "group_size"
                } else {
                    "q_group_size"
                };
                QuantMethod::Awq {
                    group_size: group(key)?,
                }
            }
            "gptq" => {
                let bits = q.get("bits").and_then(Value::as_u64).unwrap_or(4);
                if ![2, 4, 8].contains(&bits) {
                    return Err(bad(format!(
                        "{field}.bits is {bits}; kimi-infer reads 2-, 4- and 8-bit GPTQ"
                    )));
                }
                let format = text("checkpoint_format")
                    .or(text("format"))
                    .unwrap_or("gptq");
                let v1 = match format {
                    "gptq" => true,
                    "gptq_v2" => false,
                    other => {
                        return Err(bad(format!(
                            "{field}.checkpoint_format {other:?}: kimi-infer reads the \"gptq\" \
                             and \"gptq_v2\" layouts"
                        )))
                    }
                };
                QuantMethod::Gptq {
                    bits: bits as u32,
                    group_size: group("group_size")?,
                    v1,
                }
            }
            "fp8" => {
                if let Some(fmt) = text("fmt") {
                    if fmt != "e4m3" {
                        return Err(bad(format!(
                            "{field}.fmt {fmt:?}: kimi-infer reads E4M3 FP8 weights"
                        )));
                    }
                }
                let block = match q.get("weight_block_size") {
                    None | Some(Value::Null) => None,
                    Some(v) => {
                        let dims: Option<Vec<usize>> = v.as_array().map(|a| {
                            a.iter()
                                .filter_map(Value::as_u64)
                                .map(|x| x as usize)
                                .collect()
                        });
                        match dims.as_deref() {
                            Some(&[r, c]) if r > 0 && c > 0 => Some([r, c]),
                            _ => {
                                return Err(bad(format!(
                                    "{field}.weight_block_size is {v}; expected [rows, cols]"
                                )))
                            }
                        }
                    }
                };
                QuantMethod::Fp8 { block }
            }
            other => {
                return Err(bad(format!(
                    "{field}.quant_method {other:?}: kimi-infer reads {}",
                    kimi_core::config::QUANT_METHODS.join(", ")
                )))
            }
        };
        Ok(Some(Self {
            method,
            field,
            config_path: config_path.to_path_buf(),
        }))
    }

    /// Whether the stored weight `weight` (a name ending in `.weight`) is held in this
    /// scheme's quantized tensors rather than as a float matrix.
    pub(crate) fn holds(&self, ckpt: &SafetensorsDir, weight: &str) -> bool {
        let Some(base) = weight.strip_suffix(".weight") else {
            return false;
        };
        match self.method {
            QuantMethod::CompressedTensors { .. } => {
                ckpt.contains(&format!("{base}.weight_packed"))
                    || (ckpt.contains(weight) && ckpt.contains(&format!("{base}.weight_scale")))
            }
            QuantMethod::Awq { .. } | QuantMethod::Gptq { .. } => {
                ckpt.contains(&format!("{base}.qweight"))
            }
            QuantMethod::Fp8 { .. } => ckpt.contains(&format!("{base}.weight_scale_inv")),
        }
    }

    /// The logical shape of a quantized weight, where the stored tensors tell it.
    pub(crate) fn shape(&self, ckpt: &SafetensorsDir, weight: &str) -> Option<Vec<usize>> {
        let base = weight.strip_suffix(".weight")?;
        match self.method {
            QuantMethod::CompressedTensors { .. } => {
                if let Ok(shape) = ckpt.get(&format!("{base}.weight_shape")) {
                    return ints(&shape).map(|v| v.into_iter().map(|x| x as usize).collect());
                }
                ckpt.shape(weight).map(<[usize]>::to_vec)
            }
            QuantMethod::Awq { .. } => {
                let s = ckpt.shape(&format!("{base}.qweight"))?;
                Some(vec![s.get(1)? * 8, s[0]])
            }
            QuantMethod::Gptq { .. } => {
                let s = ckpt.shape(&format!("{base}.scales"))?;
                let g = ckpt.shape(&format!("{base}.g_idx"));
                let cols = g.and_then(|g| g.first().copied());
                Some(vec![*s.get(1)?, cols?])
            }
            QuantMethod::Fp8 { .. } => ckpt.shape(weight).map(<[usize]>::to_vec),
        }
    }

    /// Reads the stored weight `weight` of logical shape `shape` (`[rows, cols]`) from its
    /// quantized tensors.
    pub(crate) fn decode(
        &self,
        ckpt: &SafetensorsDir,
        weight: &str,
        shape: &[usize],
    ) -> Result<Decoded> {
        let base = weight.strip_suffix(".weight").unwrap_or(weight);
        let &[rows, cols] = shape else {
            return Err(ModelError::Input(format!(
                "`{weight}` is stored quantized, but the model needs it with shape {shape:?}, \
                 not a matrix"
            )));
        };
        let mut planes = Planes {
            ckpt,
            base,
            parts: Vec::new(),
        };
        let (dtype, bytes) = match &self.method {
            QuantMethod::CompressedTensors { int_bits } => {
                compressed(&mut planes, rows, cols, int_bits)?
            }
            QuantMethod::Awq { group_size } => awq(&mut planes, rows, cols, *group_size)?,
            QuantMethod::Gptq {
                bits,
                group_size,
                v1,
            } => gptq(&mut planes, rows, cols, *bits, *group_size, *v1)?,
            QuantMethod::Fp8 { block } => fp8_block(&mut planes, rows, cols, *block, &self.field)?,
        };
        for part in ACTIVATION_PARTS {
            let name = format!("{base}.{part}");
            if ckpt.contains(&name) {
                planes.parts.push(name);
            }
        }
        Ok(Decoded {
            dtype,
            bytes,
            parts: planes.parts,
        })
    }

    /// config.json, for errors about the scheme.
    pub(crate) fn config_path(&self) -> &Path {
        &self.config_path
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// The stored tensors of one weight, each recorded as used when read.
struct Planes<'c> {
    ckpt: &'c SafetensorsDir,
    base: &'c str,
    parts: Vec<String>,
}

impl<'c> Planes<'c> {
    fn name(&self, part: &str) -> String {
        format!("{}.{part}", self.base)
    }

    fn has(&self, part: &str) -> bool {
        self.ckpt.contains(&self.name(part))
    }

    /// `{base}.{part}`, which must be one of `dtypes`.
    fn get(&mut self, part: &str, dtypes: &[DType]) -> Result<TensorView<'c>> {
        let name = self.name(part);
        let view = self.ckpt.get(&name)?;
        if !dtypes.contains(&view.dtype) {
            let allowed: Vec<String> = dtypes.iter().map(ToString::to_string).collect();
            return Err(self.error(
                &view,
                format!("is {}; expected {}", view.dtype, allowed.join(" or ")),
            ));
        }
        self.parts.push(name);
        Ok(view)
    }

    /// `{base}.{part}` with exactly `shape`.
    fn get_shaped(
        &mut self,
        part: &str,
        dtypes: &[DType],
        shape: &[usize],
    ) -> Result<TensorView<'c>> {
        let view = self.get(part, dtypes)?;
        if view.shape != shape {
            return Err(self.error(
                &view,
                format!(
                    "has shape {:?}; this layout needs {shape:?} here",
                    view.shape
                ),
            ));
        }
        Ok(view)
    }

    fn error(&self, view: &TensorView<'_>, what: String) -> ModelError {
        ModelError::Format {
            path: view.file.to_path_buf(),
            reason: format!("tensor `{}` {what}", view.name),
        }
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Little-endian i32 values of an I32 tensor.
fn i32s(view: &TensorView<'_>) -> Vec<i32> {
    view.bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Integer values of an I64, I32 or I8 tensor.
fn ints(view: &TensorView<'_>) -> Option<Vec<i64>> {
    Some(match view.dtype {
        DType::I64 => view
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .collect(),
        DType::I32 => i32s(view).into_iter().map(i64::from).collect(),
        DType::I8 => view.bytes.iter().map(|&b| i64::from(b as i8)).collect(),
        _ => return None,
    })
}

/// `bits`-wide field `i` of a little-endian stream of 32-bit words (fields may cross words).
fn field(words: &[u32], i: usize, bits: u32) -> u8 {
    let bit = i * bits as usize;
    let (w, off) = (bit / 32, (bit % 32) as u32);
    let mut v = u64::from(words.get(w).copied().unwrap_or(0)) >> off;
    if off + bits > 32 {
        v |= u64::from(words.get(w + 1).copied().unwrap_or(0)) << (32 - off);
    }
    (v & ((1 << bits) - 1)) as u8
}

/// `(columns per group, group of each column)` for `groups` scale columns over `cols`
/// input columns, or an error naming the scale tensor.
fn plain_groups(cols: usize, groups: usize) -> Option<(usize, Vec<u32>)> {
    if groups == 0 {
        return None;
    }
    let size = cols.div_ceil(groups);
    (cols.div_ceil(size) == groups).then(|| (size, (0..cols).map(|c| (c / size) as u32).collect()))
}

/// compressed-tensors: the format is told by the tensors stored for the weight.
fn compressed(
    p: &mut Planes<'_>,
    rows: usize,
    cols: usize,
    int_bits: &[u32],
) -> Result<(DType, Vec<u8>)> {
    if p.has("weight_packed") {
        let packed = p.get("weight_packed", &[DType::I32, DType::U8])?;
        if packed.dtype == DType::U8 {
            return mxfp4(p, packed, rows, cols);
        }
        if p.has("weight_shape") {
            let shape = p.get("weight_shape", &[DType::I64, DType::I32])?;
            let found = ints(&shape).unwrap_or_default();
            if found != [rows as i64, cols as i64] {
                return Err(p.error(
                    &shape,
                    format!("says {found:?}; the model needs [{rows}, {cols}]"),
                ));
            }
        }
        let words = packed.shape.get(1).copied().unwrap_or(0);
        // The config's widths first, then the common ones.
        let bits = int_bits
            .iter()
            .copied()
            .chain([4, 8, 2, 3, 5, 6, 7, 1])
            .find(|&b| (1..=8).contains(&b) && (cols * b as usize).div_ceil(32) == words)
            .filter(|_| packed.shape.first() == Some(&rows));
        let Some(bits) = bits else {
            return Err(p.error(
                &packed,
                format!(
                    "has shape {:?}; [{rows}, {cols}] values of 1 to 8 bits pack into \
                     [{rows}, ⌈{cols}·bits/32⌉]",
                    packed.shape
                ),
            ));
        };
        let w: Vec<u32> = i32s(&packed).into_iter().map(|x| x as u32).collect();
        let mut codes = vec![0u8; rows * cols];
        for (r, row) in codes.chunks_exact_mut(cols).enumerate() {
            let words = &w[r * words..(r + 1) * words];
            for (c, v) in row.iter_mut().enumerate() {
                *v = field(words, c, bits);
            }
        }
        return int_planes(p, rows, cols, bits, codes, 1 << (bits - 1));
    }
    let weight = p.get("weight", &[DType::I8, DType::F8E4M3])?;
    if weight.shape != [rows, cols] {
        return Err(p.error(
            &weight,
            format!(
                "has shape {:?}; the model needs [{rows}, {cols}]",
                weight.shape
            ),
        ));
    }
    if weight.dtype == DType::I8 {
        // int-quantized: signed codes; `+128` makes them the unsigned codes of Q8Z.
        let codes = weight
            .bytes
            .iter()
            .map(|&b| (b as i8 as i16 + 128) as u8)
            .collect();
        return int_planes(p, rows, cols, 8, codes, 128);
    }
    let scale = p.get("weight_scale", &FLOATS)?;
    let scales = scale.to_f32_vec();
    let (row_block, col_block) = match scale.shape {
        [] | [1] | [1, 1] => (rows, cols),
        [r, 1] if *r == rows => (1, cols),
        [r, g] if *r == rows && plain_groups(cols, *g).is_some() => (1, cols.div_ceil(*g)),
        // Blocks (`strategy: block`): the tools' 128 where it gives the stored count.
        [r, c] if *r > 0 && *c > 0 => (tile(rows, *r), tile(cols, *c)),
        _ => {
            return Err(p.error(
                &scale,
                format!(
                    "has shape {:?}, which scales no tiling of [{rows}, {cols}]",
                    scale.shape
                ),
            ));
        }
    };
    if scales.len() != rows.div_ceil(row_block) * cols.div_ceil(col_block) {
        return Err(p.error(
            &scale,
            format!(
                "has shape {:?}, which scales no tiling of [{rows}, {cols}]",
                scale.shape
            ),
        ));
    }
    Ok(Fp8Matrix {
        rows,
        cols,
        codes: weight.bytes,
        row_block,
        col_block,
        scales,
    }
    .repack())
}

/// The scales, zero points and groups of a compressed-tensors integer weight whose codes are
/// read; `offset` is the stored zero of a symmetric code (`2^(bits−1)`).
fn int_planes(
    p: &mut Planes<'_>,
    rows: usize,
    cols: usize,
    bits: u32,
    codes: Vec<u8>,
    offset: i64,
) -> Result<(DType, Vec<u8>)> {
    let scale = p.get("weight_scale", &FLOATS)?;
    let per_tensor = matches!(scale.shape, [] | [1] | [1, 1]);
    let groups = match scale.shape {
        _ if per_tensor => 1,
        [r, g] if *r == rows => *g,
        _ => 0,
    };
    let mut scales = scale.to_f32_vec();
    if per_tensor {
        scales = vec![scales.first().copied().unwrap_or(0.0); rows];
    }
    let group_of = if p.has("weight_g_idx") {
        let g = p.get_shaped("weight_g_idx", &[DType::I32, DType::I64], &[cols])?;
        let idx = ints(&g).unwrap_or_default();
        if idx.iter().any(|&x| x < 0 || x as usize >= groups) {
            return Err(p.error(&g, format!("holds a group outside 0..{groups}")));
        }
        idx.into_iter().map(|x| x as u32).collect()
    } else {
        match plain_groups(cols, groups) {
            Some((_, g)) => g,
            None => {
                return Err(p.error(
                    &scale,
                    format!(
                        "has shape {:?}; expected [{rows}, groups] or [1]",
                        scale.shape
                    ),
                ))
            }
        }
    };
    let zeros = if p.has("weight_zero_point") {
        let zp = p.get("weight_zero_point", &[DType::I32, DType::I8])?;
        let z: Vec<f32> = match (zp.dtype, zp.shape) {
            (DType::I8, [r, g]) if *r == rows && *g == groups => zp
                .bytes
                .iter()
                .map(|&b| (i64::from(b as i8) + offset) as f32)
                .collect(),
            // Packed along the rows: column g's words hold row r at bit r·bits.
            (DType::I32, [w, g]) if *g == groups && *w == (rows * bits as usize).div_ceil(32) => {
                let words: Vec<u32> = i32s(&zp).into_iter().map(|x| x as u32).collect();
                let mut z = vec![0f32; rows * groups];
                for g in 0..groups {
                    let col: Vec<u32> = (0..*w).map(|i| words[i * groups + g]).collect();
                    for r in 0..rows {
                        z[r * groups + g] = f32::from(field(&col, r, bits));
                    }
                }
                z
            }
            _ => {
                return Err(p.error(
                    &zp,
                    format!(
                        "has shape {:?}; expected i8 [{rows}, {groups}] or i32 \
                         [⌈{rows}·{bits}/32⌉, {groups}] (packed along rows)",
                        zp.shape
                    ),
                ))
            }
        };
        z
    } else {
        vec![offset as f32; rows * groups]
    };
    Ok(IntMatrix {
        rows,
        cols,
        bits,
        codes,
        groups,
        scales,
        zeros,
        group_of,
    }
    .repack())
}

/// compressed-tensors MXFP4: the planes K3's experts use, for any matrix.
fn mxfp4(
    p: &mut Planes<'_>,
    packed: TensorView<'_>,
    rows: usize,
    cols: usize,
) -> Result<(DType, Vec<u8>)> {
    if !cols.is_multiple_of(32) || packed.shape != [rows, cols / 2] {
        return Err(p.error(
            &packed,
            format!(
                "has shape {:?}; MXFP4 [{rows}, {cols}] packs into [{rows}, {}]",
                packed.shape,
                cols / 2
            ),
        ));
    }
    let scale = p.get_shaped(
        "weight_scale",
        &[DType::U8, DType::E8M0],
        &[rows, cols / 32],
    )?;
    if let Some(i) = scale.bytes.iter().position(|&e| e == 255) {
        return Err(p.error(
            &scale,
            format!(
                "row {}, block {} holds the E8M0 NaN scale 255",
                i / (cols / 32),
                i % (cols / 32)
            ),
        ));
    }
    let mut blocks = vec![0u8; rows * cols / 32 * 17];
    for ((out, c), s) in blocks
        .chunks_exact_mut(cols / 32 * 17)
        .zip(packed.bytes.chunks_exact(cols / 2))
        .zip(scale.bytes.chunks_exact(cols / 32))
    {
        kimi_gguf::mxfp4::from_planes(c, s, out);
    }
    Ok((DType::MXFP4, blocks))
}

/// The group of each input column from a group size (`None`: the whole row), checked
/// against the scale rows stored.
fn sized_groups(cols: usize, group_size: Option<usize>) -> (usize, Vec<u32>) {
    let size = group_size.unwrap_or(cols).max(1);
    (
        cols.div_ceil(size),
        (0..cols).map(|c| (c / size) as u32).collect(),
    )
}

/// AutoAWQ GEMM: `qweight [cols, rows/8]`, `qzeros [groups, rows/8]`, `scales [groups, rows]`.
fn awq(
    p: &mut Planes<'_>,
    rows: usize,
    cols: usize,
    group_size: Option<usize>,
) -> Result<(DType, Vec<u8>)> {
    /// Nibble of output row `8j + k` within word `j`: the inverse of AWQ's `[0,2,4,6,1,3,5,7]`.
    const NIBBLE_OF: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
    if !rows.is_multiple_of(8) {
        return Err(ModelError::Input(format!(
            "`{}.qweight`: AWQ packs 8 output rows per word; the model needs {rows} rows",
            p.base
        )));
    }
    let (groups, group_of) = sized_groups(cols, group_size);
    let qweight = p.get_shaped("qweight", &[DType::I32], &[cols, rows / 8])?;
    let qzeros = p.get_shaped("qzeros", &[DType::I32], &[groups, rows / 8])?;
    let scales = p.get_shaped(
        "scales",
        &[DType::F16, DType::BF16, DType::F32],
        &[groups, rows],
    )?;
    let unpack = |words: Vec<i32>, n_rows: usize| -> Vec<u8> {
        // [n_rows, rows] codes, output row fastest.
        let mut out = vec![0u8; n_rows * rows];
        for (i, w) in words.iter().enumerate() {
            let (r, j) = (i / (rows / 8), i % (rows / 8));
            for k in 0..8 {
                out[r * rows + 8 * j + k] = ((*w as u32 >> (4 * NIBBLE_OF[k])) & 0xF) as u8;
            }
        }
        out
    };
    let codes_t = unpack(i32s(&qweight), cols);
    let zeros_t = unpack(i32s(&qzeros), groups);
    let scales_t = scales.to_f32_vec();
    Ok(IntMatrix {
        rows,
        cols,
        bits: 4,
        codes: transpose(&codes_t, cols, rows),
        groups,
        scales: transpose(&scales_t, groups, rows),
        zeros: transpose(&zeros_t, groups, rows)
            .into_iter()
            .map(f32::from)
            .collect(),
        group_of,
    }
    .repack())
}

/// GPTQ: `qweight [cols·bits/32, rows]` (packed along the input), `qzeros [groups,
/// rows·bits/32]`, `scales [groups, rows]`, `g_idx [cols]`.
fn gptq(
    p: &mut Planes<'_>,
    rows: usize,
    cols: usize,
    bits: u32,
    group_size: Option<usize>,
    v1: bool,
) -> Result<(DType, Vec<u8>)> {
    let per_word = (32 / bits) as usize;
    if !cols.is_multiple_of(per_word) || !rows.is_multiple_of(per_word) {
        return Err(ModelError::Input(format!(
            "`{}.qweight`: GPTQ packs {per_word} {bits}-bit codes per word; the model needs \
             [{rows}, {cols}]",
            p.base
        )));
    }
    let scales = p.get("scales", &[DType::F16, DType::BF16, DType::F32])?;
    let groups = match scales.shape {
        [g, r] if *r == rows => *g,
        _ => {
            return Err(p.error(
                &scales,
                format!("has shape {:?}; expected [groups, {rows}]", scales.shape),
            ))
        }
    };
    let group_of: Vec<u32> = if p.has("g_idx") {
        let g = p.get_shaped("g_idx", &[DType::I32, DType::I64], &[cols])?;
        let idx = ints(&g).unwrap_or_default();
        if idx.iter().any(|&x| x < 0 || x as usize >= groups) {
            return Err(p.error(&g, format!("holds a group outside 0..{groups}")));
        }
        idx.into_iter().map(|x| x as u32).collect()
    } else {
        let (n, g) = sized_groups(cols, group_size);
        if n != groups {
            return Err(p.error(
                &scales,
                format!("has {groups} groups; group_size gives {n}"),
            ));
        }
        g
    };
    let qweight = p.get_shaped("qweight", &[DType::I32], &[cols / per_word, rows])?;
    let qzeros = p.get_shaped("qzeros", &[DType::I32], &[groups, rows / per_word])?;
    let mask = (1u32 << bits) - 1;
    let qw = i32s(&qweight);
    let mut codes = vec![0u8; rows * cols];
    for (i, w) in qw.iter().enumerate() {
        let (wr, r) = (i / rows, i % rows);
        for k in 0..per_word {
            codes[r * cols + wr * per_word + k] = ((*w as u32 >> (bits as usize * k)) & mask) as u8;
        }
    }
    let qz = i32s(&qzeros);
    let one = if v1 { 1.0 } else { 0.0 };
    let mut zeros = vec![0f32; rows * groups];
    for (i, w) in qz.iter().enumerate() {
        let (g, wc) = (i / (rows / per_word), i % (rows / per_word));
        for k in 0..per_word {
            let z = (*w as u32 >> (bits as usize * k)) & mask;
            zeros[(wc * per_word + k) * groups + g] = z as f32 + one;
        }
    }
    Ok(IntMatrix {
        rows,
        cols,
        bits,
        codes,
        groups,
        scales: transpose(&scales.to_f32_vec(), groups, rows),
        zeros,
        group_of,
    }
    .repack())
}

/// `quant_method: fp8`: E4M3 `weight` with `weight_scale_inv` per block (or per tensor).
fn fp8_block(
    p: &mut Planes<'_>,
    rows: usize,
    cols: usize,
    block: Option<[usize; 2]>,
    field: &str,
) -> Result<(DType, Vec<u8>)> {
    let weight = p.get_shaped("weight", &[DType::F8E4M3], &[rows, cols])?;
    let scale = p.get("weight_scale_inv", &FLOATS)?;
    let [rb, cb] = block.unwrap_or([rows, cols]);
    let want = [rows.div_ceil(rb), cols.div_ceil(cb)];
    let per_tensor = block.is_none() && matches!(scale.shape, [] | [1] | [1, 1]);
    if scale.shape != want && !per_tensor {
        return Err(p.error(
            &scale,
            format!(
                "has shape {:?}; {field}.weight_block_size {:?} over [{rows}, {cols}] needs {want:?}",
                scale.shape,
                block.map_or_else(|| "(absent)".to_string(), |b| format!("{b:?}"))
            ),
        ));
    }
    Ok(Fp8Matrix {
        rows,
        cols,
        codes: weight.bytes,
        row_block: rb,
        col_block: cb,
        scales: scale.to_f32_vec(),
    }
    .repack())
}

/// The tile size that cuts `n` into `count` tiles: 128 (the tools' block) where it does.
fn tile(n: usize, count: usize) -> usize {
    if n.div_ceil(128) == count {
        128
    } else {
        n.div_ceil(count)
    }
}

/// `[a, b]` → `[b, a]`.
fn transpose<T: Copy + Default>(v: &[T], a: usize, b: usize) -> Vec<T> {
    let mut out = vec![T::default(); a * b];
    for i in 0..a {
        for j in 0..b {
            out[j * a + i] = v[i * b + j];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_cross_words_in_a_little_endian_stream() {
        // 3-bit fields 0..=9 then 7 packed densely: field 10 spans bits 30..33.
        let values: Vec<u32> = (0..11).map(|i| if i == 10 { 7 } else { i % 8 }).collect();
        let mut words = [0u32; 2];
        for (i, v) in values.iter().enumerate() {
            let bit = i * 3;
            words[bit / 32] |= v << (bit % 32);
            if bit % 32 + 3 > 32 {
                words[bit / 32 + 1] |= v >> (32 - bit % 32);
            }
        }
        for (i, v) in values.iter().enumerate() {
            assert_eq!(u32::from(field(&words, i, 3)), *v, "{i}");
        }
        assert_eq!(field(&[0x8765_4321], 0, 4), 1);
        assert_eq!(field(&[0x8765_4321], 7, 4), 8);
        assert_eq!(field(&[0x8765_4321], 3, 8), 0x87);
    }

    #[test]
    fn configs_name_what_cannot_be_read() {
        let path = Path::new("config.json");
        let parse = |q: Value| {
            QuantScheme::from_config(&serde_json::json!({"quantization_config": q}), path)
        };
        let err = |q: Value| parse(q).expect_err("refused").to_string();
        assert!(err(serde_json::json!({"quant_method": "bitsandbytes"}))
            .contains("quant_method \"bitsandbytes\""));
        assert!(
            err(serde_json::json!({"quant_method": "awq", "version": "gemv"}))
                .contains("quantization_config.version")
        );
        assert!(err(serde_json::json!({"quant_method": "gptq", "bits": 3}))
            .contains("quantization_config.bits"));
        assert!(
            err(serde_json::json!({"quant_method": "gptq", "checkpoint_format": "marlin"}))
                .contains("checkpoint_format")
        );
        assert!(err(serde_json::json!({"quant_method": "fp8", "fmt": "e5m2"})).contains("fmt"));
        assert!(err(serde_json::json!({"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24-bitmask"}})).contains("sparsity_config"));
        let s = parse(serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"})).unwrap().unwrap();
        assert_eq!(
            s.method,
            QuantMethod::Gptq {
                bits: 4,
                group_size: None,
                v1: false
            }
        );
        let s = parse(serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}))
            .unwrap()
            .unwrap();
        assert_eq!(
            s.method,
            QuantMethod::Fp8 {
                block: Some([128, 128])
            }
        );
        assert!(QuantScheme::from_config(&serde_json::json!({}), path)
            .unwrap()
            .is_none());
    }
}
