//! One model split over several ranks: tensor parallelism for attention and the dense
//! feed-forwards, and tensor or expert parallelism for the routed experts, with the ranks
//! meeting in [`kimi_ops::Collective`]s.
//!
//! A rank loads its part of every weight ([`ShardedSource`]: which tensors split by rows,
//! which by columns and which stay whole, as vLLM's column- and row-parallel layers split
//! them) and runs the whole batch: each mixer's and feed-forward's output is a partial sum
//! that one all-reduce completes, so every rank holds the same full activations between
//! sublayers.
//!
//! ```text
//! KDA  q/k/v/conv/f_b/g/b/A_log/dt_bias by heads → local heads → o_proj by columns → Σ
//! MLA  q(_b)/kv_b/g by heads (kv_a, norms whole: the latent cache is every rank's)
//!      → o_proj by columns → Σ
//! MLP  gate/up by rows → down by columns → Σ   (dense layers and shared experts)
//! MoE  router whole; experts split inside (tensor) or whole experts per rank (expert
//!      parallel); LatentMoE's latent sum is completed before its norm
//! ```
//!
//! Under expert parallelism the routed experts' outputs are summed by an all-reduce, or,
//! with [`ExpertDispatch::AllToAll`], each rank dispatches its share of the tokens to the
//! experts' owners and gathers the outputs back (`dispatch.rs`).
//!
//! [`TensorParallel`] runs the ranks of one process as threads behind one [`crate::CausalLm`].

pub mod control;
mod dispatch;
mod group;
mod placement;
mod process;
mod source;

pub(crate) use dispatch::TokenDispatch;
pub use dispatch::{DispatchTraffic, ExpertDispatch};
pub use group::TensorParallel;
pub use placement::{loads_from_metrics, ExpertLoads, ExpertPlacement};
pub use process::{serve_worker, ProcessRanks};
pub use source::ShardedSource;

/// The MoE layers of `config`: (decoder layer index, routed experts).
pub(crate) fn moe_layers(config: &kimi_core::ModelConfig) -> Vec<(usize, usize)> {
    let e = config.moe.as_ref().map_or(0, |m| m.num_experts);
    config
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.ffn == kimi_core::config::Ffn::Moe)
        .map(|(i, _)| (i, e))
        .collect()
}

/// Moves the routed experts from `current` to `target` one MoE layer at a time (the layers
/// whose owners change), so that at most one layer's moved experts are held twice: every
/// rank stages the layer (`on_every_rank`), then all commit it. A stage that fails is
/// discarded everywhere and the move stops there; the layers before it stay moved.
pub(crate) fn move_experts(
    current: Option<std::sync::Arc<ExpertPlacement>>,
    target: &ExpertPlacement,
    layers: &[(usize, usize)],
    mut on_every_rank: impl FnMut(control::RankJob) -> crate::Result<()>,
) -> crate::Result<()> {
    use control::RankJob;
    let Some(mut at) = current else {
        return Err(crate::ModelError::Input(
            "the expert placement changes only where whole experts are spread over ranks".into(),
        ));
    };
    if target.world() != at.world() {
        return Err(crate::ModelError::Input(format!(
            "an expert placement over {} ranks for a model over {}",
            target.world(),
            at.world()
        )));
    }
    let changing: Vec<(usize, usize)> = layers
        .iter()
        .copied()
        .filter(|&(l, e)| at.owners(l, e) != target.owners(l, e))
        .collect();
    for (done, &(layer, e)) in changing.iter().enumerate() {
        let next = std::sync::Arc::new(at.with_layer_of(target, layer, e));
        if let Err(err) = on_every_rank(RankJob::StageExperts(next.clone())) {
            let _ = on_every_rank(RankJob::DiscardExperts);
            return Err(crate::ModelError::Input(format!(
                "{err} (layer {layer}; {done} of {} changing layers moved, the rest stay)",
                changing.len()
            )));
        }
        on_every_rank(RankJob::CommitExperts)?;
        at = next;
    }
    Ok(())
}

/// How a rank's routed experts are split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertSplit {
    /// Every expert's intermediate width split over the ranks like a dense MLP (vLLM's
    /// default).
    #[default]
    Tensor,
    /// Whole experts per rank, `num_experts / world` each in id order (vLLM's
    /// `--enable-expert-parallel`).
    Experts,
}

/// This rank's place among the ranks that split a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// How the routed experts are split.
    pub experts: ExpertSplit,
}

impl Default for Shard {
    fn default() -> Self {
        Self::SINGLE
    }
}

impl Shard {
    /// The whole model on one rank.
    pub const SINGLE: Self = Self {
        rank: 0,
        world: 1,
        experts: ExpertSplit::Tensor,
    };

    /// Whether the model is split at all.
    pub fn is_split(&self) -> bool {
        self.world > 1
    }

    /// `n / world`, or an error naming `what` where `n` does not split evenly.
    pub fn part(&self, n: usize, what: &str) -> crate::Result<usize> {
        if !n.is_multiple_of(self.world) {
            return Err(crate::ModelError::Input(format!(
                "{what} ({n}) does not split over {} ranks",
                self.world
            )));
        }
        Ok(n / self.world)
    }

    /// This rank's expert ids of decoder layer `layer` (in id order): all of them unless
    /// whole experts are spread, then `placement`'s share or, without one, a contiguous run.
    pub fn local_experts(
        &self,
        placement: Option<&ExpertPlacement>,
        layer: usize,
        num_experts: usize,
    ) -> Vec<usize> {
        match (self.experts, placement) {
            (ExpertSplit::Tensor, _) => (0..num_experts).collect(),
            (ExpertSplit::Experts, Some(p)) => p.local(layer, self.rank, num_experts),
            (ExpertSplit::Experts, None) => {
                placement::contiguous(self.rank, self.world, num_experts)
            }
        }
    }
}
