//! Where a host expert's miss is served: copied into a device slot over the host link, or
//! computed by the host store for the step's few tokens (as KTransformers and llama.cpp's
//! `-ot exps=CPU` always do). The two run at the same time (the device's copies and
//! kernels are queued before the host starts on its share), so under [`MissPolicy::Auto`]
//! each miss goes to the side whose queue would end sooner, by costs measured on this
//! machine when the bank is made ([`MissCosts::measure`]).

use std::time::Instant;

use super::HostExperts;
use crate::{Activation, Backend, Error, MlpWeights, Result};

use super::host::ColdPair;

/// How misses of host experts are served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissPolicy {
    /// Every miss a slot can take is copied in; the host computes only what no slot takes.
    #[default]
    Copy,
    /// Misses are computed by the host; slots keep the experts they were given at start.
    Host,
    /// Each miss goes where the step's work ends sooner, by measured [`MissCosts`].
    Auto,
}

impl std::str::FromStr for MissPolicy {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "copy" => Ok(Self::Copy),
            "cpu" | "host" => Ok(Self::Host),
            "auto" => Ok(Self::Auto),
            other => Err(format!("`{other}` is not one of auto, copy, cpu")),
        }
    }
}

/// What serving one miss costs on either side, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MissCosts {
    /// Copying one expert (its three matrices) into a device slot.
    pub fill_s: f64,
    /// The host computing one expert for one token (reading its weights once): a step's
    /// first cold expert, which also pays for the call (its threads meeting twice).
    pub host_first_s: f64,
    /// Each further token of the same expert on the host.
    pub host_next_s: f64,
    /// Each further expert of the same step for one token: the host's threads share the
    /// experts of a step in one call, so only the first pays for the call.
    pub host_more_s: f64,
}

impl MissCosts {
    /// These costs with the host's times multiplied by `scale`.
    pub fn with_host_scaled(self, scale: f64) -> Self {
        Self {
            host_first_s: self.host_first_s * scale,
            host_next_s: self.host_next_s * scale,
            host_more_s: self.host_more_s * scale,
            ..self
        }
    }

    /// Seconds for the host to compute one expert for `pairs` tokens, alone in its step.
    pub fn host_s(&self, pairs: usize) -> f64 {
        self.host_added_s(0, pairs)
    }

    /// Seconds one more expert of `pairs` tokens adds to a step whose host share already
    /// has `before` experts.
    pub fn host_added_s(&self, before: usize, pairs: usize) -> f64 {
        let first = if before == 0 {
            self.host_first_s
        } else {
            self.host_more_s
        };
        first + pairs.saturating_sub(1) as f64 * self.host_next_s
    }

    /// Seconds for the host to compute, in one step, experts of these token counts.
    pub fn host_step_s(&self, pairs: impl IntoIterator<Item = usize>) -> f64 {
        pairs
            .into_iter()
            .enumerate()
            .map(|(i, p)| self.host_added_s(i, p))
            .sum()
    }

    /// Measures both sides on this machine. `fresh` lists host experts not read since they
    /// were loaded (at least one; up to eight are used), so that the host's timings read
    /// weights from memory, not from a cache, as a step's cold experts do; `slot` is a
    /// device slot holding host expert `holder`, which gets it back afterwards. A copy is
    /// the best of the first four fresh experts' timed copies into the slot (the backend
    /// synchronized around each); the host's first token the median of computing each of
    /// them alone for one token, each further token from computing the fourth for eight,
    /// each further expert from computing the other fresh ones together for one token (with
    /// fewer than six fresh experts, as dear as the first).
    pub fn measure<B: Backend>(
        be: &B,
        host: &dyn HostExperts,
        fresh: &[usize],
        slot: &mut MlpWeights<B::Tensor>,
        holder: usize,
    ) -> Result<Self> {
        let matrices = |e: usize| {
            host.matrices(e).ok_or_else(|| Error::Shape {
                op: "expert offload costs",
                detail: format!("expert {e} is not in the host store"),
            })
        };
        let together = fresh.get(4..fresh.len().min(8)).unwrap_or(&[]);
        let fresh = &fresh[..fresh.len().min(4)];
        let (&first, &last) = match (fresh.first(), fresh.last()) {
            (Some(f), Some(l)) => (f, l),
            _ => {
                return Err(Error::Shape {
                    op: "expert offload costs",
                    detail: "no host expert to time".into(),
                })
            }
        };
        let width = matrices(first)?.gate.shape.last().copied().unwrap_or(0);
        let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            let t = Instant::now();
            f()?;
            Ok(t.elapsed().as_secs_f64())
        };
        // Small values: the cost does not depend on them, and nothing overflows.
        let x = vec![0.01f32; 8 * width];
        let pairs = |expert: usize, n: usize| -> Vec<ColdPair> {
            (0..n)
                .map(|row| ColdPair {
                    row,
                    expert,
                    weight: 1.0,
                })
                .collect()
        };
        // The host first: the copies below read the experts too.
        // With the host's threads awake, as a tiered step has them (`TieredBank::run`).
        let awake = || {
            host.expect_work(std::time::Duration::from_millis(20));
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let mut ones = Vec::with_capacity(fresh.len());
        for &e in fresh {
            let p = pairs(e, 1);
            awake();
            ones.push(timed(&mut || {
                host.compute(&x, 8, width, &p, Activation::Silu).map(drop)
            })?);
        }
        ones.sort_by(f64::total_cmp);
        let one = ones[ones.len() / 2];
        let p = pairs(last, 8);
        awake();
        let eight = timed(&mut || host.compute(&x, 8, width, &p, Activation::Silu).map(drop))?;
        let more = if together.len() >= 2 {
            // One token each, every expert on its own row.
            let p: Vec<ColdPair> = together
                .iter()
                .enumerate()
                .map(|(row, &expert)| ColdPair {
                    row,
                    expert,
                    weight: 1.0,
                })
                .collect();
            awake();
            let all = timed(&mut || host.compute(&x, 8, width, &p, Activation::Silu).map(drop))?;
            ((all - one) / (together.len() - 1) as f64).clamp(0.0, one)
        } else {
            one
        };
        be.synchronize()?;
        let mut fill = f64::MAX;
        for &e in fresh {
            let m = matrices(e)?;
            fill = fill.min(timed(&mut || {
                be.upload_into(&mut slot.gate, m.gate)?;
                be.upload_into(&mut slot.up, m.up)?;
                be.upload_into(&mut slot.down, m.down)?;
                be.synchronize()
            })?);
        }
        let m = matrices(holder)?;
        be.upload_into(&mut slot.gate, m.gate)?;
        be.upload_into(&mut slot.up, m.up)?;
        be.upload_into(&mut slot.down, m.down)?;
        be.synchronize()?;
        Ok(Self {
            fill_s: fill,
            host_first_s: one,
            // The eighth-token timing's expert was read once already (one token): its
            // weights may be cached now, so this under- rather than overstates the slope.
            host_next_s: ((eight - one) / 7.0).max(0.0),
            host_more_s: more,
        })
    }
}

/// The running ends of the two queues while a step's misses are placed.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct MissQueues {
    copy_s: f64,
    host_s: f64,
    /// Experts booked on the host's side.
    host_experts: usize,
}

impl MissQueues {
    /// Queues whose copy side is still busy for `copy_s` seconds (copies queued earlier,
    /// ahead of this step).
    pub(super) fn behind(copy_s: f64) -> Self {
        Self {
            copy_s: copy_s.max(0.0),
            ..Self::default()
        }
    }

    /// Whether a miss of `pairs` tokens should be copied in (a slot being free for it),
    /// under `policy` with `costs` (`Auto` without costs copies); books it on its side.
    pub(super) fn choose_copy(
        &mut self,
        policy: MissPolicy,
        costs: Option<&MissCosts>,
        pairs: usize,
    ) -> bool {
        let copy = match (policy, costs) {
            (MissPolicy::Host, _) => false,
            (MissPolicy::Copy, _) | (MissPolicy::Auto, None) => true,
            (MissPolicy::Auto, Some(c)) => {
                self.copy_s + c.fill_s <= self.host_s + c.host_added_s(self.host_experts, pairs)
            }
        };
        match (costs, copy) {
            (Some(c), true) => self.copy_s += c.fill_s,
            (_, false) => self.book_host(costs, pairs),
            (None, true) => {}
        }
        copy
    }

    /// Books a miss that could not be copied (no slot free) on the host's side.
    pub(super) fn book_host(&mut self, costs: Option<&MissCosts>, pairs: usize) {
        if let Some(c) = costs {
            self.host_s += c.host_added_s(self.host_experts, pairs);
        }
        self.host_experts += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_balances_the_two_queues() {
        // A copy takes 1 ms, the host 2 ms for an expert's first token.
        let c = MissCosts {
            fill_s: 1e-3,
            host_first_s: 2e-3,
            host_next_s: 1e-4,
            host_more_s: 2e-3,
        };
        let mut q = MissQueues::default();
        let picks: Vec<bool> = (0..6)
            .map(|_| q.choose_copy(MissPolicy::Auto, Some(&c), 1))
            .collect();
        // copy 1, copy 2, (copy 3 vs host 2) host, copy 3, (copy 4 vs host 4) copy, host.
        assert_eq!(picks, [true, true, false, true, true, false]);
        // Many tokens make the host's share dearer.
        let mut q = MissQueues::default();
        assert!(q.choose_copy(MissPolicy::Auto, Some(&c), 1));
        assert!(q.choose_copy(MissPolicy::Auto, Some(&c), 20));
        // Of twelve misses the host takes a third (2 ms against 1 per expert); found 3x
        // slower than measured (6 ms), one.
        let slow = c.with_host_scaled(3.0);
        assert_eq!(slow.fill_s, c.fill_s);
        assert!((slow.host_s(2) - 3.0 * c.host_s(2)).abs() < 1e-12);
        let on_host = |costs: &MissCosts| {
            let mut q = MissQueues::default();
            (0..12)
                .filter(|_| !q.choose_copy(MissPolicy::Auto, Some(costs), 1))
                .count()
        };
        assert_eq!((on_host(&c), on_host(&slow)), (4, 1));
    }

    #[test]
    fn further_host_experts_of_a_step_cost_less_than_the_first() {
        // A copy 1 ms; the host 2 ms for its first expert, 0.5 ms for each further one.
        let c = MissCosts {
            fill_s: 1e-3,
            host_first_s: 2e-3,
            host_next_s: 1e-4,
            host_more_s: 5e-4,
        };
        assert!((c.host_step_s([1, 1, 3]) - (2e-3 + 5e-4 + 5e-4 + 2e-4)).abs() < 1e-12);
        let mut q = MissQueues::default();
        let picks: Vec<bool> = (0..8)
            .map(|_| q.choose_copy(MissPolicy::Auto, Some(&c), 1))
            .collect();
        // copy 1, copy 2 (2 against 2), host 2 (against copy 3), host 2.5, copy 3 (3
        // against 3), host 3 (against copy 4), host 3.5, copy 4 (4 against 4).
        assert_eq!(picks, [true, true, false, false, true, false, false, true]);
        // Priced as the first, each further expert would have taken a third of them.
        let flat = MissCosts {
            host_more_s: c.host_first_s,
            ..c
        };
        let mut q = MissQueues::default();
        let on_host = (0..12)
            .filter(|_| !q.choose_copy(MissPolicy::Auto, Some(&flat), 1))
            .count();
        assert_eq!(on_host, 4);
    }

    #[test]
    fn fixed_policies_ignore_costs() {
        let c = MissCosts {
            fill_s: 1.0,
            host_first_s: 1e-6,
            host_next_s: 0.0,
            host_more_s: 1e-6,
        };
        let mut q = MissQueues::default();
        assert!(q.choose_copy(MissPolicy::Copy, Some(&c), 1));
        assert!(!q.choose_copy(MissPolicy::Host, None, 1));
        assert!(q.choose_copy(MissPolicy::Auto, None, 1));
        assert_eq!("cpu".parse::<MissPolicy>(), Ok(MissPolicy::Host));
        assert!("gpu".parse::<MissPolicy>().is_err());
    }
}
