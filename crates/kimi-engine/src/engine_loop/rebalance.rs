//! Rebalancing the routed experts over the ranks while serving (vLLM's `--enable-eplb`):
//! the engine counts the experts each step's tokens chose; every `step_interval` steps it
//! works out the placement that would have balanced those counts (each rank keeping as many
//! of its experts as it can) and moves the experts, between two steps, when that placement
//! beats the one in use by `min_gain`. Sequences in flight keep their caches and go on.

use kimi_model::parallel::{ExpertLoads, ExpertPlacement};

/// When the engine moves routed experts between ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertRebalance {
    /// Steps between looks at the counts; each look weighs the steps since the last.
    pub step_interval: u64,
    /// Move only when the imbalance of the placement in use (the largest rank's routed
    /// tokens over the mean, averaged over the MoE layers) exceeds the new placement's by
    /// this fraction: 0.05 asks for a 5 % better balance.
    pub min_gain: f64,
}

/// One look at the counts of a window of steps.
pub(crate) struct Look {
    /// Steps the counts cover.
    pub steps: u64,
    /// The imbalance of the placement in use over them.
    pub before: f64,
    /// The imbalance the balanced placement would have had.
    pub after: f64,
    /// Experts that placement moves.
    pub moves: usize,
    /// The placement to move to, where it is worth it.
    pub placement: Option<ExpertPlacement>,
}

/// The counts since the last look.
pub(crate) struct Rebalancer {
    config: ExpertRebalance,
    window: ExpertLoads,
    steps: u64,
    /// The interval's multiple before the next look: doubled after a move that failed (up
    /// to 16), so that a move that cannot be made does not stall every window.
    backoff: u64,
}

impl Rebalancer {
    pub(crate) fn new(config: ExpertRebalance) -> Self {
        Self {
            config,
            window: ExpertLoads::new(),
            steps: 0,
            backoff: 1,
        }
    }

    /// A move was made (`true`) or failed.
    pub(crate) fn moved(&mut self, ok: bool) {
        self.backoff = match ok {
            true => 1,
            false => (self.backoff * 2).min(16),
        };
    }

    /// Adds one step's counts (per decoder layer; empty for dense layers).
    pub(crate) fn note(&mut self, counts: &[Vec<u32>]) {
        for (layer, experts) in counts.iter().enumerate() {
            if experts.is_empty() {
                continue;
            }
            let sum = self.window.entry(layer).or_default();
            if sum.len() < experts.len() {
                sum.resize(experts.len(), 0);
            }
            for (s, &c) in sum.iter_mut().zip(experts) {
                *s += u64::from(c);
            }
        }
        self.steps += 1;
    }

    /// Whether a window of counts is complete (a look is due).
    pub(crate) fn due(&self) -> bool {
        self.steps
            >= self
                .config
                .step_interval
                .max(1)
                .saturating_mul(self.backoff)
    }

    /// Once `step_interval` steps have passed: how `current` did over them and what a
    /// balanced placement would do (the window starts again).
    pub(crate) fn look(&mut self, current: &ExpertPlacement) -> Option<Look> {
        if !self.due() {
            return None;
        }
        let window = std::mem::take(&mut self.window);
        let steps = std::mem::take(&mut self.steps);
        if window.values().all(|c| c.iter().all(|&n| n == 0)) {
            return None;
        }
        let before = current.mean_imbalance(&window);
        let balanced = ExpertPlacement::balanced(&window, current.world())
            .ok()?
            .keeping(current);
        let after = balanced.mean_imbalance(&window);
        let moves = current.moves_to(&balanced, &window);
        let worth = moves > 0 && before > after * (1.0 + self.config.min_gain);
        Some(Look {
            steps,
            before,
            after,
            moves,
            placement: worth.then_some(balanced),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skewed_window_moves_experts_and_an_even_one_does_not() {
        let mut r = Rebalancer::new(ExpertRebalance {
            step_interval: 2,
            min_gain: 0.05,
        });
        let current = ExpertPlacement::default().with_world(2);
        // Layer 1: experts 0 and 1 (rank 0's) take the tokens.
        r.note(&[vec![], vec![5, 4, 1, 0]]);
        assert!(r.look(&current).is_none(), "one step of two");
        r.note(&[vec![], vec![5, 4, 0, 1]]);
        let look = r.look(&current).unwrap();
        assert_eq!(look.steps, 2);
        // Counts [10, 8, 1, 1]: rank 0 has 18 of 20 (1.8 × the mean); balanced, {0, 3}
        // and {1, 2} have 11 and 9 (1.1).
        assert!((look.before - 1.8).abs() < 1e-9, "{}", look.before);
        assert!((look.after - 1.1).abs() < 1e-9, "{}", look.after);
        assert_eq!(look.moves, 2);
        let p = look.placement.unwrap();
        assert_eq!(p.local(1, 0, 4).len(), 2);
        // Balanced counts: nothing worth moving.
        r.note(&[vec![], vec![3, 0, 3, 0]]);
        r.note(&[vec![], vec![0, 3, 0, 3]]);
        let look = r.look(&current).unwrap();
        assert!(look.placement.is_none() && (look.before - 1.0).abs() < 1e-9);
        // After a failed move the next look waits twice as long.
        r.moved(false);
        for _ in 0..3 {
            r.note(&[vec![], vec![5, 4, 0, 1]]);
            assert!(r.look(&current).is_none());
        }
        r.note(&[vec![], vec![5, 4, 0, 1]]);
        assert!(r.look(&current).is_some_and(|l| l.steps == 4));
    }
}
