//! Which rank holds which routed experts under expert parallelism: by default each rank a
//! contiguous run of ids; from measured routing counts, a placement that balances the tokens
//! each rank's experts receive (every rank still holds the same number of experts, so
//! memory stays even).

use std::collections::BTreeMap;

use crate::{ModelError, Result};

/// The owner rank of every routed expert, per MoE layer (layers absent here use the
/// contiguous split).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpertPlacement {
    world: usize,
    owners: BTreeMap<usize, Vec<usize>>,
}

/// Tokens routed to each expert, per layer (decoder layer index → count per expert id), as
/// `/metrics` reports them (`kimi:moe_expert_tokens_total{layer, expert}`).
pub type ExpertLoads = BTreeMap<usize, Vec<u64>>;

impl ExpertPlacement {
    /// A placement over `world` ranks that, layer by layer, gives the most loaded experts
    /// first to the rank with the fewest tokens so far that still has room (`num_experts /
    /// world` experts each; ties to the lower id and rank).
    pub fn balanced(loads: &ExpertLoads, world: usize) -> Result<Self> {
        let mut owners = BTreeMap::new();
        for (&layer, counts) in loads {
            let e = counts.len();
            if world == 0 || !e.is_multiple_of(world) {
                return Err(ModelError::Input(format!(
                    "layer {layer}: {e} experts do not split over {world} ranks"
                )));
            }
            let room = e / world;
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
            let (mut load, mut held) = (vec![0u64; world], vec![0usize; world]);
            let mut owner = vec![0usize; e];
            for x in order {
                let r = (0..world)
                    .filter(|&r| held[r] < room)
                    .min_by_key(|&r| (load[r], r))
                    .unwrap_or(0);
                owner[x] = r;
                load[r] += counts[x];
                held[r] += 1;
            }
            owners.insert(layer, owner);
        }
        Ok(Self { world, owners })
    }

    /// The contiguous split over `world` ranks (every layer's ids in order).
    pub fn with_world(mut self, world: usize) -> Self {
        self.world = world;
        self
    }

    /// A placement from every listed layer's owner rank per expert id, checked: each owner
    /// below `world`, and every rank holding the same number of a layer's experts (memory
    /// stays even).
    pub fn from_owners(world: usize, owners: BTreeMap<usize, Vec<usize>>) -> Result<Self> {
        for (layer, owner) in &owners {
            let mut held = vec![0usize; world];
            for &r in owner {
                match held.get_mut(r) {
                    Some(h) => *h += 1,
                    None => {
                        return Err(ModelError::Input(format!(
                            "layer {layer}: an expert placed on rank {r} of {world}"
                        )))
                    }
                }
            }
            if held
                .iter()
                .any(|&h| h.checked_mul(world) != Some(owner.len()))
            {
                return Err(ModelError::Input(format!(
                    "layer {layer}: {held:?} experts per rank, not {} each",
                    owner.len() / world.max(1)
                )));
            }
        }
        Ok(Self { world, owners })
    }

    /// This placement with `layer`'s owners taken from `other` (a move made layer by
    /// layer).
    pub fn with_layer_of(&self, other: &Self, layer: usize, num_experts: usize) -> Self {
        let mut p = self.clone();
        p.owners.insert(layer, other.owners(layer, num_experts));
        p
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The layers placed otherwise than in order, with every expert's owner rank.
    pub fn layers(&self) -> impl Iterator<Item = (usize, &[usize])> {
        self.owners.iter().map(|(&l, o)| (l, o.as_slice()))
    }

    /// The owner rank of every expert of `layer`.
    pub fn owners(&self, layer: usize, num_experts: usize) -> Vec<usize> {
        match self.owners.get(&layer) {
            Some(owner) if owner.len() == num_experts => owner.clone(),
            _ => {
                let per = (num_experts / self.world.max(1)).max(1);
                (0..num_experts).map(|e| e / per).collect()
            }
        }
    }

    /// The experts of the layers in `loads` that change rank from `self` to `other`.
    pub fn moves_to(&self, other: &Self, loads: &ExpertLoads) -> usize {
        loads
            .iter()
            .map(|(&layer, counts)| {
                let e = counts.len();
                let (a, b) = (self.owners(layer, e), other.owners(layer, e));
                a.iter().zip(&b).filter(|(x, y)| x != y).count()
            })
            .sum()
    }

    /// This placement with its ranks renamed, layer by layer, so that as many experts as
    /// possible stay where `current` has them (the balance is the same under any naming;
    /// only the experts that must move are moved). Greedy: the (group, rank) pairs that
    /// share the most experts are matched first.
    pub fn keeping(mut self, current: &Self) -> Self {
        let w = self.world;
        for (&layer, owner) in self.owners.iter_mut() {
            let now = current.owners(layer, owner.len());
            let mut shared = vec![vec![0usize; w]; w];
            for (&g, &r) in owner.iter().zip(&now) {
                if g < w && r < w {
                    shared[g][r] += 1;
                }
            }
            let mut pairs: Vec<(usize, usize, usize)> = (0..w)
                .flat_map(|g| (0..w).map(move |r| (g, r)))
                .map(|(g, r)| (shared[g][r], g, r))
                .collect();
            pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            let (mut named, mut taken) = (vec![usize::MAX; w], vec![false; w]);
            for (_, g, r) in pairs {
                if named[g] == usize::MAX && !taken[r] {
                    named[g] = r;
                    taken[r] = true;
                }
            }
            for o in owner.iter_mut() {
                *o = named.get(*o).copied().unwrap_or(*o);
            }
        }
        self
    }

    /// The mean over `loads`' layers of [`ExpertPlacement::imbalance`] (1.0 with no layers).
    pub fn mean_imbalance(&self, loads: &ExpertLoads) -> f64 {
        let per_layer = self.imbalance(loads);
        match per_layer.len() {
            0 => 1.0,
            n => per_layer.values().sum::<f64>() / n as f64,
        }
    }

    /// Rank `rank`'s experts of `layer`, in id order.
    pub fn local(&self, layer: usize, rank: usize, num_experts: usize) -> Vec<usize> {
        match self.owners.get(&layer) {
            Some(owner) if owner.len() == num_experts => {
                (0..num_experts).filter(|&e| owner[e] == rank).collect()
            }
            _ => contiguous(rank, self.world.max(1), num_experts),
        }
    }

    /// The largest rank's tokens over the mean, per layer, for `loads` under this
    /// placement (1.0 is perfect balance).
    pub fn imbalance(&self, loads: &ExpertLoads) -> BTreeMap<usize, f64> {
        loads
            .iter()
            .map(|(&layer, counts)| {
                let per_rank: Vec<u64> = (0..self.world.max(1))
                    .map(|r| {
                        self.local(layer, r, counts.len())
                            .iter()
                            .map(|&e| counts[e])
                            .sum()
                    })
                    .collect();
                let total: u64 = per_rank.iter().sum();
                let max = per_rank.iter().copied().max().unwrap_or(0);
                let mean = total as f64 / per_rank.len() as f64;
                (layer, if total == 0 { 1.0 } else { max as f64 / mean })
            })
            .collect()
    }
}

/// Rank `rank`'s run of ids when `num_experts` split evenly in order.
pub(crate) fn contiguous(rank: usize, world: usize, num_experts: usize) -> Vec<usize> {
    let per = num_experts / world;
    (rank * per..(rank + 1) * per).collect()
}

/// Routing counts from Prometheus text (a saved `/metrics` of `kimi-infer serve`): every
/// `kimi:moe_expert_tokens_total{…layer="L",expert="E"…} N` line. Other lines are ignored;
/// a malformed count line is an error naming its line number.
pub fn loads_from_metrics(text: &str) -> Result<ExpertLoads> {
    let mut loads = ExpertLoads::new();
    for (i, line) in text.lines().enumerate() {
        let Some(rest) = line.strip_prefix("kimi:moe_expert_tokens_total{") else {
            continue;
        };
        let bad = || ModelError::Input(format!("line {}: not an expert count: {line}", i + 1));
        let (labels, value) = rest.rsplit_once('}').ok_or_else(bad)?;
        let label = |name: &str| -> Option<usize> {
            let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
            labels[start..].split('"').next()?.parse().ok()
        };
        let (layer, expert) = (
            label("layer").ok_or_else(bad)?,
            label("expert").ok_or_else(bad)?,
        );
        let count: f64 = value.trim().parse().map_err(|_| bad())?;
        if !(count >= 0.0 && count.is_finite()) || expert > 1 << 20 {
            return Err(bad());
        }
        let counts = loads.entry(layer).or_default();
        if counts.len() <= expert {
            counts.resize(expert + 1, 0);
        }
        counts[expert] = count as u64;
    }
    Ok(loads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skewed_layer_is_balanced_with_even_expert_counts() {
        // Experts 0..4 hot (contiguous: rank 0 takes all the heat).
        let counts = vec![100, 90, 80, 70, 1, 1, 1, 1];
        let loads = ExpertLoads::from([(3, counts.clone())]);
        let p = ExpertPlacement::balanced(&loads, 2).unwrap();
        for r in 0..2 {
            assert_eq!(p.local(3, r, 8).len(), 4);
        }
        let mut all: Vec<usize> = (0..2).flat_map(|r| p.local(3, r, 8)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        let balanced = p.imbalance(&loads)[&3];
        let plain = ExpertPlacement {
            world: 2,
            owners: BTreeMap::new(),
        }
        .imbalance(&loads)[&3];
        assert!(plain > 1.9 && balanced < 1.02, "{plain} {balanced}");
        // Layers without counts split in order.
        assert_eq!(p.local(5, 1, 8), vec![4, 5, 6, 7]);
    }

    #[test]
    fn a_new_placement_keeps_experts_where_they_are_when_it_can() {
        // The balanced split of these counts is {0, 3} / {1, 2} whatever the rank names;
        // from a current placement with 0 and 3 on rank 1, renaming keeps them there.
        let loads = ExpertLoads::from([(0, vec![10, 9, 8, 7])]);
        let current =
            ExpertPlacement::from_owners(2, BTreeMap::from([(0, vec![1, 0, 0, 1])])).unwrap();
        let fresh = ExpertPlacement::balanced(&loads, 2).unwrap();
        let kept = fresh.clone().keeping(&current);
        assert_eq!(kept.owners(0, 4), vec![1, 0, 0, 1]);
        assert_eq!(current.moves_to(&kept, &loads), 0);
        assert_eq!(kept.imbalance(&loads), fresh.imbalance(&loads));
        // From the contiguous split, two experts move.
        let plain = ExpertPlacement::default().with_world(2);
        assert_eq!(plain.owners(0, 4), vec![0, 0, 1, 1]);
        let kept = fresh.keeping(&plain);
        assert_eq!(plain.moves_to(&kept, &loads), 2);
        assert!(kept.mean_imbalance(&loads) < plain.mean_imbalance(&loads));
        // Uneven or out-of-range owners are refused.
        for bad in [vec![0, 0, 0, 1], vec![0, 2, 1, 1]] {
            assert!(ExpertPlacement::from_owners(2, BTreeMap::from([(0, bad)])).is_err());
        }
    }

    #[test]
    fn counts_are_read_from_metrics_text() {
        let text = "# HELP kimi:moe_expert_tokens_total Tokens\n\
            kimi:moe_expert_tokens_total{model_name=\"m\",layer=\"1\",expert=\"0\"} 5\n\
            kimi:moe_expert_tokens_total{model_name=\"m\",layer=\"1\",expert=\"2\"} 7\n\
            vllm:num_requests_running{model_name=\"m\"} 0\n";
        let loads = loads_from_metrics(text).unwrap();
        assert_eq!(loads, ExpertLoads::from([(1, vec![5, 0, 7])]));
        let e = loads_from_metrics("kimi:moe_expert_tokens_total{layer=\"x\",expert=\"0\"} 5")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1"), "{e}");
        let e = ExpertPlacement::balanced(&ExpertLoads::from([(0, vec![1, 2, 3])]), 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer 0: 3 experts do not split over 2 ranks"),
            "{e}"
        );
    }
}
