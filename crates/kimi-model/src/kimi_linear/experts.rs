//! Moving routed experts between ranks (expert parallelism): a new placement is staged
//! first, every expert this rank takes on read from the weights again while the model keeps
//! running as it was, and then put in use or discarded. The ranks of a split model stage
//! together and switch only when all have staged, so a failure on any rank leaves every
//! rank as it was.

use std::collections::HashSet;
use std::sync::Arc;

use kimi_core::config::Ffn;
use kimi_ops::Backend;

use super::KimiLinear;
use crate::ffn::StagedShare;
use crate::forward::input;
use crate::layers::Loader;
use crate::parallel::{ExpertPlacement, ExpertSplit, ShardedSource};
use crate::Result;

/// A placement read but not in use yet: every spread MoE layer's new share.
pub(crate) struct StagedPlacement<T> {
    placement: Arc<ExpertPlacement>,
    layers: Vec<(usize, StagedShare<T>)>,
}

impl<B: Backend> KimiLinear<B> {
    /// Which rank holds which routed experts, where this is a rank of a model whose whole
    /// experts are spread over ranks (`None` otherwise).
    pub fn expert_ranks(&self) -> Option<Arc<ExpertPlacement>> {
        if !self.shard.is_split() || self.shard.experts != ExpertSplit::Experts {
            return None;
        }
        Some(
            self.expert_ranks.clone().unwrap_or_else(|| {
                Arc::new(ExpertPlacement::default().with_world(self.shard.world))
            }),
        )
    }

    /// Reads the experts that `placement` gives this rank and that it does not hold yet;
    /// the model runs on as it was until [`KimiLinear::commit_expert_ranks`]. The moved
    /// experts' memory is taken twice until then.
    pub fn stage_expert_ranks(&mut self, placement: Arc<ExpertPlacement>) -> Result<()> {
        self.staged = None;
        let Some(current) = self.expert_ranks() else {
            return Err(input(
                "the expert placement changes only where whole experts are spread over ranks",
            ));
        };
        if placement.world() != self.shard.world {
            return Err(input(&format!(
                "an expert placement over {} ranks for a model over {}",
                placement.world(),
                self.shard.world
            )));
        }
        let reopen = self.reopen.clone().ok_or_else(|| {
            input("the experts cannot move: this model's weights cannot be read again")
        })?;
        let moe = self
            .config
            .moe
            .clone()
            .ok_or_else(|| input("a model without MoE layers has no experts to move"))?;
        let hidden = self.config.hidden_size;
        let moe_layers = self
            .config
            .layers
            .iter()
            .filter(|l| l.ffn == Ffn::Moe)
            .count();
        let mut layers = Vec::new();
        reopen.with(&mut |source| {
            let sharded = ShardedSource::new(
                source,
                self.shard,
                moe.num_experts,
                Some(Arc::clone(&placement)),
                self.config.vocab_size,
            );
            let mut ld = Loader {
                backend: &self.backend,
                source: &sharded,
                used: HashSet::new(),
                prefix: self.config.tensor_prefix(),
                offload: self.offload.clone(),
                moe_layers,
                shard: self.shard,
                placement: Some(Arc::clone(&placement)),
                dispatch: self.expert_dispatch,
            };
            for (i, layer) in self.layers.iter().enumerate() {
                // A layer whose owners stay as they are keeps its experts and dispatch.
                if current.owners(i, moe.num_experts) == placement.owners(i, moe.num_experts) {
                    continue;
                }
                if let Some(share) = layer.ffn.stage_share(&mut ld, i, hidden, &moe)? {
                    layers.push((i, share));
                }
            }
            Ok(())
        })?;
        self.staged = Some(StagedPlacement { placement, layers });
        Ok(())
    }

    /// Puts the staged placement in use: the experts given away are dropped.
    pub fn commit_expert_ranks(&mut self) -> Result<()> {
        let staged = self
            .staged
            .take()
            .ok_or_else(|| input("no expert placement was staged"))?;
        // Checked first, so that the model changes whole or not at all.
        for (i, share) in &staged.layers {
            let layer = self
                .layers
                .get(*i)
                .ok_or_else(|| input(&format!("a staged expert share for layer {i}")))?;
            layer.ffn.check_share(share)?;
        }
        for (i, share) in staged.layers {
            if let Some(layer) = self.layers.get_mut(i) {
                layer.ffn.take_share(share);
            }
        }
        self.expert_ranks = Some(staged.placement);
        Ok(())
    }

    /// Drops a staged placement (another rank could not stage it).
    pub fn discard_staged_expert_ranks(&mut self) {
        self.staged = None;
    }
}
