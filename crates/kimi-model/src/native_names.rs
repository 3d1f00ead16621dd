//! Checkpoints in the layouts transformers writes itself, read by hub name.
//!
//! The model asks for hub tensor names (`shared/docs/kimi-linear-spec.md` §2). transformers
//! ≥ 5.17 writes two other layouts (its `conversion_mapping.py`, `kimi_linear` entry):
//!
//! * `save_pretrained(dir)` undoes its weight conversions on save, but the reverse of its
//!   `.block_sparse_moe. → .mlp.` renaming also catches dense MLP layers, which come out as
//!   `model.layers.N.block_sparse_moe.{gate,up,down}_proj.weight`;
//! * `save_pretrained(dir, save_original_format=False)` writes the in-memory names: experts
//!   fused into `mlp.experts.gate_up_proj` `[E, 2I, D]` (gate rows first) and
//!   `mlp.experts.down_proj` `[E, D, I]`, the three convolutions fused into
//!   `self_attn.conv1d.weight` `[3HK, 1, W]` (q | k | v), the forget gate's tensors under
//!   `self_attn.forget_gate.`, every MoE tensor under `mlp.`.
//!
//! [`RULES`] is the one table of those differences. [`CheckpointSource`] detects the layout
//! from the stored names and answers each hub name from its stored tensor, or from a slice
//! of a fused one (borrowed, no copy).

use std::borrow::Cow;
use std::collections::HashSet;

use kimi_core::DType;
use kimi_weights::{Checkpoint, WeightsError};

use crate::quantized::{QuantReader, QuantScheme};
use crate::source::WeightSource;
use crate::{ModelError, Result};

/// How a checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointLayout {
    /// The hub names, as the released checkpoints store them.
    Hub,
    /// transformers' `save_pretrained` (≥ 5.17): dense MLPs under `block_sparse_moe.`.
    SavePretrained,
    /// transformers' in-memory names (`save_pretrained(save_original_format=False)`).
    InMemory,
}

impl std::fmt::Display for CheckpointLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Hub => "the hub layout",
            Self::SavePretrained => "transformers' save_pretrained layout",
            Self::InMemory => "transformers' in-memory layout (save_original_format=False)",
        })
    }
}

/// Which part of the stored tensor holds the hub tensor.
#[derive(Clone, Copy, Debug)]
enum Part {
    /// All of it, with the hub shape.
    Whole,
    /// Block `index` of `of` equal blocks of rows, `[of·rows, ..]`; with `experts`, of the
    /// expert that the hub name's `*` numbers in a stacked `[E, of·rows, ..]` tensor.
    Rows {
        experts: bool,
        of: usize,
        index: usize,
    },
}

/// One difference: the hub name after `model.layers.N.` (`*` stands for an expert number)
/// and where `layout` stores it.
struct Rule {
    layout: CheckpointLayout,
    hub: &'static str,
    stored: &'static str,
    part: Part,
}

const fn rule(
    layout: CheckpointLayout,
    hub: &'static str,
    stored: &'static str,
    part: Part,
) -> Rule {
    Rule {
        layout,
        hub,
        stored,
        part,
    }
}

const fn rows(experts: bool, of: usize, index: usize) -> Part {
    Part::Rows { experts, of, index }
}

use CheckpointLayout::{InMemory, SavePretrained};
use Part::Whole;

/// Every name transformers stores differently from the hub, per layout (one rule a line).
#[rustfmt::skip]
const RULES: &[Rule] = &[
    rule(SavePretrained, "mlp.gate_proj.weight", "block_sparse_moe.gate_proj.weight", Whole),
    rule(SavePretrained, "mlp.up_proj.weight", "block_sparse_moe.up_proj.weight", Whole),
    rule(SavePretrained, "mlp.down_proj.weight", "block_sparse_moe.down_proj.weight", Whole),
    // llm-compressor saves MoE experts as it calibrates them, linearized into one module
    // per expert with Llama's names.
    rule(SavePretrained, "block_sparse_moe.experts.*.w1.weight", "block_sparse_moe.experts.*.gate_proj.weight", Whole),
    rule(SavePretrained, "block_sparse_moe.experts.*.w3.weight", "block_sparse_moe.experts.*.up_proj.weight", Whole),
    rule(SavePretrained, "block_sparse_moe.experts.*.w2.weight", "block_sparse_moe.experts.*.down_proj.weight", Whole),
    rule(InMemory, "block_sparse_moe.experts.*.w1.weight", "mlp.experts.gate_up_proj", rows(true, 2, 0)),
    rule(InMemory, "block_sparse_moe.experts.*.w3.weight", "mlp.experts.gate_up_proj", rows(true, 2, 1)),
    rule(InMemory, "block_sparse_moe.experts.*.w2.weight", "mlp.experts.down_proj", rows(true, 1, 0)),
    rule(InMemory, "block_sparse_moe.gate.weight", "mlp.gate.weight", Whole),
    rule(InMemory, "block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias", Whole),
    rule(InMemory, "block_sparse_moe.shared_experts.gate_proj.weight", "mlp.shared_experts.gate_proj.weight", Whole),
    rule(InMemory, "block_sparse_moe.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.weight", Whole),
    rule(InMemory, "block_sparse_moe.shared_experts.down_proj.weight", "mlp.shared_experts.down_proj.weight", Whole),
    rule(InMemory, "self_attn.q_conv1d.weight", "self_attn.conv1d.weight", rows(false, 3, 0)),
    rule(InMemory, "self_attn.k_conv1d.weight", "self_attn.conv1d.weight", rows(false, 3, 1)),
    rule(InMemory, "self_attn.v_conv1d.weight", "self_attn.conv1d.weight", rows(false, 3, 2)),
    rule(InMemory, "self_attn.f_a_proj.weight", "self_attn.forget_gate.f_a_proj.weight", Whole),
    rule(InMemory, "self_attn.f_b_proj.weight", "self_attn.forget_gate.f_b_proj.weight", Whole),
    rule(InMemory, "self_attn.A_log", "self_attn.forget_gate.A_log", Whole),
    rule(InMemory, "self_attn.dt_bias", "self_attn.forget_gate.dt_bias", Whole),
];

/// `name` split after its `model.layers.N.`: (that head, the rest).
fn split_layer(name: &str) -> Option<(&str, &str)> {
    let at = name.find("model.layers.")? + "model.layers.".len();
    let digits = name[at..].bytes().take_while(u8::is_ascii_digit).count();
    let end = at + digits;
    (digits > 0 && name[end..].starts_with('.')).then(|| (&name[..=end], &name[end + 1..]))
}

/// The expert number `*` stands for if `rest` matches `pattern` (0 when it has no `*`).
fn matches(pattern: &str, rest: &str) -> Option<usize> {
    let (mut p, mut r) = (pattern.split('.'), rest.split('.'));
    let mut expert = 0;
    loop {
        match (p.next(), r.next()) {
            (None, None) => return Some(expert),
            (Some("*"), Some(seg))
                if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) =>
            {
                expert = seg.parse().ok()?;
            }
            (Some(a), Some(b)) if a == b => {}
            _ => return None,
        }
    }
}

/// Where a hub name is stored.
struct Place {
    stored: String,
    part: Part,
    expert: usize,
    /// Whether a rule renamed it.
    renamed: bool,
}

/// A [`Checkpoint`] as a [`WeightSource`] of hub names, whichever layout it stores.
pub struct CheckpointSource<'c> {
    ckpt: &'c Checkpoint,
    layout: CheckpointLayout,
    /// Experts stacked in a fused tensor: the config's count.
    num_experts: Option<usize>,
    /// The checkpoint's `quantization_config`: weights stored in a tool's quantized
    /// tensors are answered from them (`crate::quantized`).
    quant: QuantReader,
}

/// Suffixes of the tensors quantization tools store in place of `.weight`.
const QUANT_SUFFIXES: [&str; 2] = [".weight_packed", ".qweight"];

/// A stored name as the `.weight` it stands for (for layout detection).
fn as_weight(name: &str) -> Cow<'_, str> {
    for suffix in QUANT_SUFFIXES {
        if let Some(base) = name.strip_suffix(suffix) {
            return Cow::Owned(format!("{base}.weight"));
        }
    }
    Cow::Borrowed(name)
}

impl<'c> CheckpointSource<'c> {
    /// Detects the layout from the stored names: one that only transformers' layouts have
    /// (`block_sparse_moe.gate_proj.weight`, `mlp.experts.gate_up_proj`, ...). Fails if the
    /// names of both of its layouts are present.
    pub fn new(ckpt: &'c Checkpoint) -> Result<Self> {
        let mut seen: Vec<(CheckpointLayout, &str)> = Vec::new();
        for stored in ckpt.tensor_names() {
            let name = as_weight(stored);
            let Some((_, rest)) = split_layer(&name) else {
                continue;
            };
            if let Some(r) = RULES.iter().find(|r| matches(r.stored, rest).is_some()) {
                if !seen.iter().any(|(l, _)| *l == r.layout) {
                    seen.push((r.layout, stored));
                }
            }
        }
        let layout = match seen[..] {
            [] => CheckpointLayout::Hub,
            [(layout, _)] => layout,
            [(a, x), (b, y), ..] => {
                return Err(ModelError::Format {
                    path: ckpt.dir().to_path_buf(),
                    reason: format!(
                        "the checkpoint mixes {a} (`{x}`) and {b} (`{y}`); kimi-infer reads one"
                    ),
                })
            }
        };
        let quant = QuantScheme::from_config(ckpt.config_json(), &ckpt.dir().join("config.json"))?;
        Ok(Self {
            ckpt,
            layout,
            num_experts: ckpt.config().moe.as_ref().map(|m| m.num_experts),
            quant: QuantReader::new(quant),
        })
    }

    /// The checkpoint's quantization scheme, if it has one.
    pub fn quant_scheme(&self) -> Option<&QuantScheme> {
        self.quant.scheme()
    }

    /// The scheme, where `stored` is held in its quantized tensors.
    fn quantized(&self, stored: &str) -> Option<&QuantScheme> {
        self.quant.holding(self.ckpt, stored)
    }

    /// Whether `stored` is stored, as itself or as quantized tensors.
    fn stores(&self, stored: &str) -> bool {
        self.ckpt.contains(stored) || self.quantized(stored).is_some()
    }

    /// The layout found.
    pub fn layout(&self) -> CheckpointLayout {
        self.layout
    }

    /// Where `hub` is stored: as itself when present or in the hub layout, else by the
    /// layout's rule, if one matches.
    fn place(&self, hub: &str) -> Place {
        let same = || Place {
            stored: hub.to_string(),
            part: Whole,
            expert: 0,
            renamed: false,
        };
        if self.layout == CheckpointLayout::Hub || self.stores(hub) {
            return same();
        }
        let Some((head, rest)) = split_layer(hub) else {
            return same();
        };
        RULES
            .iter()
            .filter(|r| r.layout == self.layout)
            .find_map(|r| {
                matches(r.hub, rest).map(|expert| Place {
                    stored: format!("{head}{}", r.stored.replace('*', &expert.to_string())),
                    part: r.part,
                    expert,
                    renamed: true,
                })
            })
            .unwrap_or_else(same)
    }

    /// A stored tensor's error, with the hub name it stands for.
    fn error(&self, hub: &str, place: &Place, source: WeightsError) -> ModelError {
        if !place.renamed {
            return source.into();
        }
        ModelError::Stored {
            hub: hub.to_string(),
            stored: place.stored.clone(),
            layout: self.layout.to_string(),
            source: Box::new(source),
        }
    }

    /// The stored shape that holds `shape` at `part`.
    fn stored_shape(&self, part: Part, shape: &[usize], found: &[usize]) -> Vec<usize> {
        match part {
            Whole => shape.to_vec(),
            Part::Rows { experts, of, .. } => {
                let mut s = Vec::with_capacity(shape.len() + 1);
                if experts {
                    // The config's expert count; without one, whatever is stored.
                    s.push(self.num_experts.or(found.first().copied()).unwrap_or(0));
                }
                s.push(of * shape.first().copied().unwrap_or(0));
                s.extend_from_slice(shape.get(1..).unwrap_or(&[]));
                s
            }
        }
    }
}

impl WeightSource for CheckpointSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.stores(&self.place(name).stored)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let place = self.place(name);
        if let Some(q) = self.quantized(&place.stored) {
            if !matches!(place.part, Whole) {
                return Err(ModelError::Format {
                    path: q.config_path().to_path_buf(),
                    reason: format!(
                        "`{name}` is part of the quantized `{}`; quantized fused tensors are \
                         not supported",
                        place.stored
                    ),
                });
            }
            let (dtype, bytes) = self.quant.decode(q, self.ckpt, &place.stored, shape)?;
            return Ok((dtype, Cow::Owned(bytes)));
        }
        let view = self
            .ckpt
            .get(&place.stored)
            .map_err(|e| self.error(name, &place, e))?;
        let want = self.stored_shape(place.part, shape, view.shape);
        let mismatch = |expected: Vec<usize>| WeightsError::Shape {
            name: place.stored.clone(),
            file: view.file.to_path_buf(),
            expected,
            found: view.shape.to_vec(),
        };
        if view.shape != want {
            return Err(self.error(name, &place, mismatch(want)));
        }
        let Part::Rows { experts, of, index } = place.part else {
            return Ok((view.dtype, Cow::Borrowed(view.bytes)));
        };
        let block = shape.iter().product::<usize>() * view.dtype.size_bytes();
        let expert = if experts { place.expert } else { 0 };
        let start = (expert * of + index) * block;
        match view.bytes.get(start..start + block) {
            Some(bytes) if !view.dtype.is_quantized() => Ok((view.dtype, Cow::Borrowed(bytes))),
            _ => Err(ModelError::Format {
                path: view.file.to_path_buf(),
                reason: format!(
                    "`{name}` is expert {expert} of `{}` {:?} ({}), which does not hold it",
                    place.stored, view.shape, view.dtype
                ),
            }),
        }
    }

    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        let stored = used.iter().map(|hub| self.place(hub).stored).collect();
        let stored = self.quant.with_parts(stored);
        Ok(kimi_weights::SafetensorsDir::check_all_used(
            self.ckpt, &stored,
        )?)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let place = self.place(name);
        if let Some(q) = self.quantized(&place.stored) {
            return q.shape(self.ckpt, &place.stored);
        }
        let found = self.ckpt.shape(&place.stored)?;
        match place.part {
            Whole => Some(found.to_vec()),
            // A slice's shape is the model's to say.
            Part::Rows { .. } => None,
        }
    }

    fn names(&self) -> Vec<String> {
        self.ckpt
            .tensor_names()
            .into_iter()
            .map(String::from)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_split_after_the_layer_number() {
        assert_eq!(
            split_layer("language_model.model.layers.12.mlp.gate.weight"),
            Some(("language_model.model.layers.12.", "mlp.gate.weight"))
        );
        assert_eq!(split_layer("model.layers.x.mlp"), None);
        assert_eq!(split_layer("model.norm.weight"), None);
    }

    #[test]
    fn patterns_capture_the_expert_number() {
        let p = "block_sparse_moe.experts.*.w1.weight";
        assert_eq!(
            matches(p, "block_sparse_moe.experts.37.w1.weight"),
            Some(37)
        );
        assert_eq!(matches(p, "block_sparse_moe.experts.x.w1.weight"), None);
        assert_eq!(matches(p, "block_sparse_moe.experts.3.w3.weight"), None);
        assert_eq!(matches("self_attn.A_log", "self_attn.A_log"), Some(0));
        assert_eq!(matches("self_attn.A_log", "self_attn.A_log.x"), None);
    }

    /// Each layout's stored names are no hub name and no other layout's hub name, so that
    /// detection cannot mistake one layout for another.
    #[test]
    fn stored_names_identify_their_layout() {
        for r in RULES {
            assert!(
                !RULES.iter().any(|o| matches(o.hub, r.stored).is_some()),
                "{} is also a hub name",
                r.stored
            );
            assert_ne!(r.layout, CheckpointLayout::Hub);
        }
    }
}
