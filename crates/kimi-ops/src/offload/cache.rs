//! Which host experts hold a device slot: frequency with decay, the best-scored pinned,
//! least recently used for the rest. Pure bookkeeping, no tensors.

use super::costs::{MissCosts, MissPolicy, MissQueues};

/// How the slots of a layer's expert cache are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CachePolicy {
    /// Each step multiplies every expert's score by this before adding the pairs routed to
    /// it, so the score is a routing frequency that forgets old traffic (0.95: a step's
    /// weight halves in about 14 steps).
    pub decay: f32,
    /// Fraction of the slots whose holders, the best-scored experts in the cache, are never
    /// evicted; the rest are replaced least recently used first.
    pub pinned_fraction: f32,
    /// Which misses are copied into slots and which the host computes.
    pub miss: MissPolicy,
    /// Whether a step also predicts the next MoE layer's experts (that layer's router on
    /// this layer's input) and copies the predicted ones into its slots ahead, while the
    /// host computes this step's cold experts and the device the next layer's attention.
    pub predict_next: bool,
    /// Whether the experts the host computed in a step (cold ones) are also copied into
    /// slots after it, on the copy side while the link idles, so that the layer's next step
    /// finds them there: the host serves a miss at once, the cache still learns it.
    pub copy_behind: bool,
}

impl Default for CachePolicy {
    fn default() -> Self {
        Self {
            decay: 0.95,
            pinned_fraction: 0.5,
            miss: MissPolicy::Copy,
            predict_next: false,
            copy_behind: false,
        }
    }
}

/// One slot given to an expert for this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    /// The expert copied in.
    pub expert: usize,
    /// Its slot.
    pub slot: usize,
    /// The expert that held the slot before, if any.
    pub evicted: Option<usize>,
}

/// What a step of routing asks of the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStep {
    /// Needed experts already in a slot.
    pub hits: Vec<usize>,
    /// Needed experts copied into a slot now (most pairs first).
    pub fills: Vec<Fill>,
    /// Needed experts left where they are, for the host to compute: every slot is held by
    /// an expert this step needs or by a pinned one.
    pub cold: Vec<usize>,
}

/// The slot map of one layer's cache over `num_experts` expert ids.
#[derive(Clone, Debug)]
pub struct ExpertCache {
    policy: CachePolicy,
    slot_of: Vec<Option<usize>>,
    holder: Vec<Option<usize>>,
    last_used: Vec<u64>,
    score: Vec<f32>,
    tick: u64,
}

impl ExpertCache {
    /// An empty cache of `slots` slots for experts `0..num_experts`.
    pub fn new(num_experts: usize, slots: usize, policy: CachePolicy) -> Self {
        Self {
            policy,
            slot_of: vec![None; num_experts],
            holder: vec![None; slots],
            last_used: vec![0; slots],
            score: vec![0.0; num_experts],
            tick: 0,
        }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.holder.len()
    }

    /// The slot holding `expert`.
    pub fn slot_of(&self, expert: usize) -> Option<usize> {
        self.slot_of.get(expert).copied().flatten()
    }

    /// The expert held by `slot`.
    pub fn holder(&self, slot: usize) -> Option<usize> {
        self.holder.get(slot).copied().flatten()
    }

    /// Records that `slot` holds `expert` (the cache's contents at start).
    pub fn place(&mut self, expert: usize, slot: usize) {
        if expert >= self.slot_of.len() || slot >= self.holder.len() {
            return;
        }
        if let Some(old) = self.holder[slot].take() {
            self.slot_of[old] = None;
        }
        if let Some(s) = self.slot_of[expert].take() {
            self.holder[s] = None;
        }
        self.holder[slot] = Some(expert);
        self.slot_of[expert] = Some(slot);
    }

    /// Plans one step: `needed` lists the experts the step's routes use (each once, ids
    /// below `num_experts`) with their pair counts. Hits are touched, misses (most pairs
    /// first, then the most used, then lowest id) take a free slot, else the least recently
    /// used slot that holds neither a needed nor a pinned expert, else stay cold. The
    /// policy's [`MissPolicy`] may leave a miss cold that a slot could take: always
    /// (`Host`), or where the host's queue, by `costs`, would end sooner (`Auto`).
    pub fn step(&mut self, needed: &[(usize, usize)], costs: Option<&MissCosts>) -> CacheStep {
        self.step_behind(needed, costs, 0.0)
    }

    /// [`ExpertCache::step`] with the copy link still busy for `copy_backlog_s` seconds
    /// (copies made ahead of the step and not yet done), which `Auto` counts on the copy
    /// side.
    pub fn step_behind(
        &mut self,
        needed: &[(usize, usize)],
        costs: Option<&MissCosts>,
        copy_backlog_s: f64,
    ) -> CacheStep {
        self.tick += 1;
        let tick = self.tick;
        for s in &mut self.score {
            *s *= self.policy.decay;
        }
        let mut is_needed = vec![false; self.slot_of.len()];
        for &(e, pairs) in needed {
            if let Some(s) = self.score.get_mut(e) {
                *s += pairs as f32;
                is_needed[e] = true;
            }
        }
        let mut step = CacheStep::default();
        let mut misses = Vec::new();
        for &(e, pairs) in needed {
            match self.slot_of(e) {
                Some(s) => {
                    self.last_used[s] = tick;
                    step.hits.push(e);
                }
                None if e < self.slot_of.len() => misses.push((e, pairs)),
                None => {}
            }
        }
        self.order_misses(&mut misses);
        let pinned = self.pinned();
        let mut queues = MissQueues::behind(copy_backlog_s);
        for (e, pairs) in misses {
            let victim =
                self.victim(|s, h| !is_needed[h] && !pinned[h] && self.last_used[s] < tick);
            let victim = match victim {
                Some(slot) => queues
                    .choose_copy(self.policy.miss, costs, pairs)
                    .then_some(slot),
                None => {
                    queues.book_host(costs, pairs);
                    None
                }
            };
            match victim {
                Some(slot) => {
                    let evicted = self.holder[slot];
                    self.place(e, slot);
                    self.last_used[slot] = tick;
                    step.fills.push(Fill {
                        expert: e,
                        slot,
                        evicted,
                    });
                }
                None => step.cold.push(e),
            }
        }
        step
    }

    /// Plans copies ahead of a step: `predicted` lists the experts a step is expected to
    /// use (each once, with its expected pairs), before its routes are known. Up to `limit`
    /// of those without a slot (most pairs first, then the most used, then lowest id) take
    /// a free slot, else the least recently used one holding neither a predicted nor a
    /// pinned expert. Scores and hits are left to the step itself.
    pub fn ahead(&mut self, predicted: &[(usize, usize)], limit: usize) -> Vec<Fill> {
        let mut is_predicted = vec![false; self.slot_of.len()];
        let mut misses = Vec::new();
        for &(e, pairs) in predicted {
            if e >= self.slot_of.len() {
                continue;
            }
            is_predicted[e] = true;
            if self.slot_of(e).is_none() {
                misses.push((e, pairs));
            }
        }
        self.order_misses(&mut misses);
        let pinned = self.pinned();
        let mut fills = Vec::new();
        for (e, _) in misses.into_iter().take(limit) {
            let Some(slot) = self.victim(|_, h| !is_predicted[h] && !pinned[h]) else {
                break;
            };
            let evicted = self.holder[slot];
            self.place(e, slot);
            // Newest, so that the step's own misses evict it last.
            self.last_used[slot] = self.tick;
            fills.push(Fill {
                expert: e,
                slot,
                evicted,
            });
        }
        fills
    }

    /// Misses `(expert, pairs)` in the order they take slots: most pairs first, then the
    /// most used, then the lowest id.
    fn order_misses(&self, misses: &mut [(usize, usize)]) {
        misses.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then(self.score[b.0].total_cmp(&self.score[a.0]))
                .then(a.0.cmp(&b.0))
        });
    }

    /// A free slot, else the least recently used one whose holder may go (`evictable(slot,
    /// holder)`).
    fn victim(&self, evictable: impl Fn(usize, usize) -> bool) -> Option<usize> {
        let free = self.holder.iter().position(Option::is_none);
        free.or_else(|| {
            (0..self.holder.len())
                .filter(|&s| self.holder[s].is_some_and(|h| evictable(s, h)))
                .min_by_key(|&s| (self.last_used[s], s))
        })
    }

    /// Per expert id: whether it is one of the `pinned_fraction × slots` best-scored
    /// experts in the cache (ties to the lower id).
    fn pinned(&self) -> Vec<bool> {
        let mut cached: Vec<usize> = self.holder.iter().flatten().copied().collect();
        cached.sort_by(|&a, &b| self.score[b].total_cmp(&self.score[a]).then(a.cmp(&b)));
        let keep =
            (self.policy.pinned_fraction.clamp(0.0, 1.0) * self.holder.len() as f32) as usize;
        let mut pinned = vec![false; self.slot_of.len()];
        for &e in cached.iter().take(keep) {
            pinned[e] = true;
        }
        pinned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lru_only() -> CachePolicy {
        CachePolicy {
            decay: 0.95,
            pinned_fraction: 0.0,
            miss: MissPolicy::Copy,
            predict_next: false,
            copy_behind: false,
        }
    }

    impl ExpertCache {
        fn step_copying(&mut self, needed: &[(usize, usize)]) -> CacheStep {
            self.step(needed, None)
        }
    }

    /// `Auto` over LRU slots, a copy costing 1 ms, the host's first expert 2 ms, each
    /// further token 1 ms and each further expert `host_more_s`.
    fn auto(host_more_s: f64) -> (CachePolicy, MissCosts) {
        let policy = CachePolicy {
            miss: MissPolicy::Auto,
            ..lru_only()
        };
        let costs = MissCosts {
            fill_s: 1e-3,
            host_first_s: 2e-3,
            host_next_s: 1e-3,
            host_more_s,
        };
        (policy, costs)
    }

    #[test]
    fn auto_leaves_misses_to_the_host_where_it_is_sooner() {
        let (policy, costs) = auto(2e-3);
        let mut c = ExpertCache::new(16, 8, policy);
        let s = c.step(&[(1, 1), (2, 1), (3, 1), (4, 1), (5, 3)], Some(&costs));
        // 5 (three tokens) first: copy (1 ms against 4); 1 copy (2 against 2); 2 host (3
        // against 2); 3 copy (3 against 4); 4 copy (4 against 4).
        let filled: Vec<usize> = s.fills.iter().map(|f| f.expert).collect();
        assert_eq!(filled, [5, 1, 3, 4]);
        assert_eq!(s.cold, [2]);
        // A cold expert is not cached: it misses again, the cached ones hit.
        let s = c.step(&[(2, 1), (5, 1)], Some(&costs));
        assert_eq!(s.hits, [5]);
        assert_eq!(s.fills.len(), 1);
        // Host: no copies at all; slots filled before still hit.
        c.policy.miss = MissPolicy::Host;
        let s = c.step(&[(1, 1), (9, 1)], Some(&costs));
        assert_eq!((s.hits.as_slice(), s.cold.as_slice()), (&[1][..], &[9][..]));
        assert!(s.fills.is_empty());
    }

    #[test]
    fn a_busy_copy_link_sends_more_misses_to_the_host() {
        let (policy, costs) = auto(1e-3);
        let needed = [(1, 1), (2, 1), (3, 1)];
        // An idle link: copy (1 ms against 2), copy (2 against 2), host (3 against 2).
        let idle = ExpertCache::new(16, 8, policy).step(&needed, Some(&costs));
        assert_eq!(idle.fills.len(), 2, "{idle:?}");
        // The link busy for 3 ms: host (4 against 2), host (4 against 3), copy (4 against
        // 4).
        let busy = ExpertCache::new(16, 8, policy).step_behind(&needed, Some(&costs), 3e-3);
        assert!(busy.fills.len() < idle.fills.len(), "{idle:?} {busy:?}");
        assert_eq!(busy.fills.len() + busy.cold.len(), 3);
        assert_eq!(busy.cold.len(), 2, "{busy:?}");
    }

    #[test]
    fn misses_fill_free_slots_then_hit() {
        let mut c = ExpertCache::new(8, 2, lru_only());
        let s = c.step_copying(&[(3, 1), (5, 2)]);
        assert!(s.hits.is_empty() && s.cold.is_empty());
        // Most pairs first.
        assert_eq!(s.fills[0].expert, 5);
        assert_eq!(s.fills[1].expert, 3);
        let s = c.step_copying(&[(3, 1), (5, 1)]);
        assert_eq!(s.hits, vec![3, 5]);
        assert!(s.fills.is_empty());
    }

    #[test]
    fn least_recently_used_is_evicted_and_needed_ones_never() {
        let mut c = ExpertCache::new(8, 2, lru_only());
        c.step_copying(&[(1, 1)]);
        c.step_copying(&[(2, 1)]);
        c.step_copying(&[(1, 1)]);
        // 2 is the least recently used.
        let s = c.step_copying(&[(4, 1)]);
        assert_eq!(
            s.fills,
            vec![Fill {
                expert: 4,
                slot: c.slot_of(4).unwrap(),
                evicted: Some(2)
            }]
        );
        assert_eq!(c.slot_of(2), None);
        // Three needed experts, two slots both needed: the third is cold.
        let s = c.step_copying(&[(1, 3), (4, 2), (6, 1)]);
        assert_eq!(s.hits, vec![1, 4]);
        assert_eq!(s.cold, vec![6]);
    }

    #[test]
    fn a_slot_filled_this_step_is_not_taken_again_in_it() {
        let mut c = ExpertCache::new(8, 1, lru_only());
        let s = c.step_copying(&[(0, 2), (1, 1)]);
        assert_eq!(s.fills.len(), 1);
        assert_eq!(s.fills[0].expert, 0);
        assert_eq!(s.cold, vec![1]);
    }

    #[test]
    fn pinned_experts_survive_a_scan() {
        let mut c = ExpertCache::new(16, 2, CachePolicy::default());
        for _ in 0..10 {
            c.step_copying(&[(7, 4)]);
        }
        // A scan of one-off experts evicts only the unpinned slot.
        for e in 8..14 {
            let s = c.step_copying(&[(e, 1)]);
            assert_eq!(s.fills.len(), 1);
            assert_ne!(s.fills[0].evicted, Some(7));
        }
        assert!(c.slot_of(7).is_some());
    }

    #[test]
    fn copies_ahead_take_free_then_least_recent_slots_and_spare_predicted_ones() {
        let mut c = ExpertCache::new(16, 3, lru_only());
        c.step_copying(&[(1, 1)]);
        c.step_copying(&[(2, 1)]);
        // One free slot, then 1 (least recent); 2 is predicted, so kept; at most two.
        let fills = c.ahead(&[(2, 1), (5, 1), (6, 3), (7, 1)], 2);
        let got: Vec<(usize, Option<usize>)> =
            fills.iter().map(|f| (f.expert, f.evicted)).collect();
        assert_eq!(got, [(6, None), (5, Some(1))]);
        assert_eq!(c.slot_of(7), None);
        // The step then finds them in their slots.
        let s = c.step_copying(&[(5, 1), (6, 1), (9, 1)]);
        assert_eq!(s.hits, [5, 6]);
        assert_eq!(s.fills.len(), 1);
        assert_eq!(s.fills[0].evicted, Some(2));
        // Every slot predicted: nothing to evict.
        assert!(c.ahead(&[(5, 1), (6, 1), (9, 1), (11, 1)], 4).is_empty());
    }

    #[test]
    fn no_slots_means_everything_is_cold() {
        let mut c = ExpertCache::new(4, 0, CachePolicy::default());
        let s = c.step_copying(&[(0, 1), (3, 1)]);
        assert_eq!(s.cold, vec![0, 3]);
    }

    #[test]
    fn place_moves_an_expert() {
        let mut c = ExpertCache::new(4, 2, CachePolicy::default());
        c.place(1, 0);
        c.place(1, 1);
        assert_eq!((c.holder(0), c.holder(1)), (None, Some(1)));
        c.place(2, 1);
        assert_eq!((c.slot_of(1), c.slot_of(2)), (None, Some(1)));
    }
}
