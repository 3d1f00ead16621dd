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
