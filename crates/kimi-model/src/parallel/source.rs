//! A rank's part of every weight, cut from any [`WeightSource`] by tensor name.

use std::borrow::Cow;
use std::collections::HashSet;

use kimi_core::DType;

use super::{ExpertPlacement, ExpertSplit, Shard};
use crate::source::WeightSource;
use crate::{ModelError, Result};

/// How a tensor is split over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Every rank holds all of it.
    Whole,
    /// By its first dimension (output rows of a column-parallel matrix, per-channel
    /// vectors, convolution channels).
    Rows,
    /// By its last dimension (input columns of a row-parallel matrix).
    Cols,
    /// A per-head vector (`A_log`: `[1, 1, H, 1]`, or K3's `[N]` zero-padded past H).
    Heads,
}

/// Tensors split by their output rows: the column-parallel projections of attention heads
/// and of the gated MLPs.
const ROWS: [&str; 15] = [
    ".q_proj.weight",
    ".k_proj.weight",
    ".v_proj.weight",
    ".q_conv1d.weight",
    ".k_conv1d.weight",
    ".v_conv1d.weight",
    ".f_b_proj.weight",
    ".g_b_proj.weight",
    ".g_proj.weight",
    ".b_proj.weight",
    ".dt_bias",
    ".q_b_proj.weight",
    ".kv_b_proj.weight",
    ".gate_proj.weight",
    ".up_proj.weight",
];

/// The LM head's and the embedding's names (after any prefix): split by vocabulary rows
/// where the vocabulary divides over the ranks.
const LM_HEAD: &str = "lm_head.weight";
const EMBED: &str = "embed_tokens.weight";

/// Tensors split by their input columns: the row-parallel output projections.
const COLS: [&str; 2] = [".o_proj.weight", ".down_proj.weight"];

/// Routed experts' matrices (as stored: a plain weight or MXFP4 planes), split inside each
/// expert under [`ExpertSplit::Tensor`]: gate and up by rows, down by columns.
const EXPERT_ROWS: [&str; 6] = [
    ".w1.weight",
    ".w3.weight",
    ".w1.weight_packed",
    ".w3.weight_packed",
    ".w1.weight_scale",
    ".w3.weight_scale",
];
const EXPERT_COLS: [&str; 3] = [".w2.weight", ".w2.weight_packed", ".w2.weight_scale"];

fn split_of(name: &str, experts: ExpertSplit) -> Split {
    let ends = |list: &[&str]| list.iter().any(|s| name.ends_with(s));
    // The LM head and the embedding by vocabulary rows (whole where the vocabulary does not
    // divide over the ranks: [`ShardedSource::split`]).
    if name.ends_with(LM_HEAD) || name.ends_with(EMBED) || ends(&ROWS) {
        Split::Rows
    } else if ends(&COLS) {
        Split::Cols
    } else if name.ends_with(".A_log") {
        Split::Heads
    } else if experts == ExpertSplit::Tensor && ends(&EXPERT_ROWS) {
        Split::Rows
    } else if experts == ExpertSplit::Tensor && ends(&EXPERT_COLS) {
        Split::Cols
    } else {
        Split::Whole
    }
}

/// The decoder layer and routed expert id in a tensor name
/// (`…layers.{layer}.….experts.{id}.…`).
fn expert_id(name: &str) -> Option<(usize, usize)> {
    let after = |key: &str| -> Option<usize> {
        let rest = &name[name.find(key)? + key.len()..];
        rest.split('.').next()?.parse().ok()
    };
    Some((after("layers.")?, after(".experts.")?))
}

/// One rank's view of a weight source: asked for a tensor at this rank's shape, it loads
/// the whole stored tensor and returns this rank's slice of it.
pub struct ShardedSource<'a> {
    inner: &'a dyn WeightSource,
    shard: Shard,
    /// Routed experts per layer and their placement (to tell which experts other ranks
    /// hold).
    num_experts: usize,
    placement: Option<std::sync::Arc<ExpertPlacement>>,
    /// Whether the LM head is split by vocabulary rows (the vocabulary divides over the
    /// ranks), as the model asks for it.
    split_vocab: bool,
}

impl<'a> ShardedSource<'a> {
    /// Rank `shard.rank`'s slices of `inner`'s tensors; `num_experts` routed experts per
    /// MoE layer (0 for a dense model); `vocab_size` rows of the LM head, split by rows
    /// where they divide over the ranks and whole on every rank where they do not.
    pub fn new(
        inner: &'a dyn WeightSource,
        shard: Shard,
        num_experts: usize,
        placement: Option<std::sync::Arc<ExpertPlacement>>,
        vocab_size: usize,
    ) -> Self {
        Self {
            inner,
            shard,
            num_experts,
            placement,
            split_vocab: vocab_size.is_multiple_of(shard.world.max(1)),
        }
    }

    /// How `name` splits for this source (the head as the vocabulary allows).
    fn split(&self, name: &str) -> Split {
        match split_of(name, self.shard.experts) {
            Split::Rows
                if (name.ends_with(LM_HEAD) || name.ends_with(EMBED)) && !self.split_vocab =>
            {
                Split::Whole
            }
            split => split,
        }
    }

    /// The stored shape of `name` for this rank's `local` one.
    fn global_shape(&self, name: &str, split: Split, local: &[usize]) -> Result<Vec<usize>> {
        let w = self.shard.world;
        let mut g = local.to_vec();
        match split {
            Split::Whole => {}
            Split::Rows => {
                let first = g.first_mut().ok_or_else(|| scalar(name))?;
                *first *= w;
            }
            Split::Cols => {
                let last = g.last_mut().ok_or_else(|| scalar(name))?;
                *last *= w;
            }
            // As stored (K3 pads the vector past H); where the source cannot say, the
            // head axis of `[1, 1, H, 1]` (or the only one).
            Split::Heads => match self.inner.shape(name) {
                Some(stored) => g = stored,
                None => {
                    let axis = if g.len() == 4 { 2 } else { 0 };
                    let dim = g.get_mut(axis).ok_or_else(|| scalar(name))?;
                    *dim *= w;
                }
            },
        }
        Ok(g)
    }
}

fn scalar(name: &str) -> ModelError {
    ModelError::Input(format!(
        "tensor {name}: a scalar cannot be split over ranks"
    ))
}

/// Bytes of `n` values of `dtype`, whole blocks only.
fn bytes_of(dtype: DType, n: usize, name: &str) -> Result<usize> {
    if !n.is_multiple_of(dtype.block_size()) {
        return Err(ModelError::Input(format!(
            "tensor {name}: a rank's slice of {n} values is not whole {}-value blocks of {dtype}",
            dtype.block_size()
        )));
    }
    dtype
        .storage_bytes(n)
        .ok_or_else(|| ModelError::Input(format!("tensor {name}: {n} values of {dtype} overflow")))
}

impl WeightSource for ShardedSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        let split = self.split(name);
        if split == Split::Whole || !self.shard.is_split() {
            return self.inner.load(name, shape);
        }
        let global = self.global_shape(name, split, shape)?;
        let (dtype, bytes) = self.inner.load(name, &global)?;
        let r = self.shard.rank;
        let slice = match split {
            Split::Whole => unreachable!("whole tensors returned above"),
            // A contiguous run of the flattened values: rows (each of the other dims'
            // product values), or the heads of a per-head vector.
            Split::Rows | Split::Heads => {
                let local: usize = shape.iter().product();
                let (start, len) = (
                    bytes_of(dtype, r * local, name)?,
                    bytes_of(dtype, local, name)?,
                );
                bytes
                    .get(start..start + len)
                    .ok_or_else(|| {
                        ModelError::Input(format!(
                            "tensor {name}: rank {r}'s slice lies past its {} bytes",
                            bytes.len()
                        ))
                    })?
                    .to_vec()
            }
            Split::Cols => {
                let (cols, global_cols) = (shape[shape.len() - 1], global[global.len() - 1]);
                let row_bytes = bytes_of(dtype, global_cols, name)?;
                let (start, len) = (
                    bytes_of(dtype, r * cols, name)?,
                    bytes_of(dtype, cols, name)?,
                );
                let mut out = Vec::with_capacity(bytes.len() / self.shard.world);
                for row in bytes.chunks_exact(row_bytes.max(1)) {
                    out.extend_from_slice(&row[start..start + len]);
                }
                out
            }
        };
        Ok((dtype, Cow::Owned(slice)))
    }

    fn check_all_used(&self, used: &HashSet<String>) -> Result<()> {
        if self.shard.experts != ExpertSplit::Experts || !self.shard.is_split() {
            return self.inner.check_all_used(used);
        }
        // Other ranks' experts are theirs: count them used here.
        let mut used = used.clone();
        for name in self.inner.names() {
            if let Some((layer, e)) = expert_id(&name) {
                let local =
                    self.shard
                        .local_experts(self.placement.as_deref(), layer, self.num_experts);
                if !local.contains(&e) {
                    used.insert(name);
                }
            }
        }
        self.inner.check_all_used(&used)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let stored = self.inner.shape(name)?;
        let w = self.shard.world;
        let mut local = stored.clone();
        match self.split(name) {
            _ if !self.shard.is_split() => {}
            Split::Whole => {}
            Split::Rows => local[0] /= w,
            Split::Cols => *local.last_mut()? /= w,
            // Unknown: the loader then asks for `[1, 1, heads, 1]`, this rank's heads, and
            // `load` cuts them from whatever is stored (K3's padding is never read).
            Split::Heads => return None,
        }
        Some(local)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_as_the_parallel_layers_do() {
        use ExpertSplit::{Experts, Tensor};
        let p = "model.layers.3";
        for (name, want) in [
            ("self_attn.q_proj.weight", Split::Rows),
            ("self_attn.q_a_proj.weight", Split::Whole),
            ("self_attn.kv_a_proj_with_mqa.weight", Split::Whole),
            ("self_attn.kv_b_proj.weight", Split::Rows),
            ("self_attn.f_a_proj.weight", Split::Whole),
            ("self_attn.g_a_proj.weight", Split::Whole),
            ("self_attn.g_proj.weight", Split::Rows),
            ("self_attn.o_norm.weight", Split::Whole),
            ("self_attn.o_proj.weight", Split::Cols),
            ("self_attn.A_log", Split::Heads),
            ("mlp.down_proj.weight", Split::Cols),
            ("block_sparse_moe.gate.weight", Split::Whole),
            (
                "block_sparse_moe.shared_experts.up_proj.weight",
                Split::Rows,
            ),
            (
                "block_sparse_moe.routed_expert_down_proj.weight",
                Split::Whole,
            ),
            (
                "block_sparse_moe.routed_expert_up_proj.weight",
                Split::Whole,
            ),
            ("block_sparse_moe.experts.7.w2.weight_packed", Split::Cols),
            ("block_sparse_moe.experts.7.w1.weight", Split::Rows),
        ] {
            assert_eq!(split_of(&format!("{p}.{name}"), Tensor), want, "{name}");
        }
        assert_eq!(
            split_of("m.experts.7.w2.weight_scale", Experts),
            Split::Whole
        );
        for head in [
            "lm_head.weight",
            "language_model.lm_head.weight",
            "model.embed_tokens.weight",
            "language_model.model.embed_tokens.weight",
        ] {
            assert_eq!(split_of(head, Tensor), Split::Rows, "{head}");
        }
        assert_eq!(
            expert_id("model.layers.1.block_sparse_moe.experts.12.w1.weight"),
            Some((1, 12))
        );
        assert_eq!(expert_id("model.layers.1.mlp.gate_proj.weight"), None);
    }
}
