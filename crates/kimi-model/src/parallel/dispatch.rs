//! Token dispatch for expert parallelism (vLLM's all-to-all backends, DeepEP): instead of
//! every rank running the whole batch through its own experts and one all-reduce summing
//! the partial outputs, each rank sends its share of the tokens to the ranks that own their
//! experts and gets the weighted expert outputs back.
//!
//! ```text
//! rank r: rows row_share(n) of the batch ─ routes (every rank routes every row) ─►
//!         pairs (row, expert, weight) grouped by the expert's owner
//!  ── all_to_all_rows ─► owner: [x_row | expert id | weight] rows, by sender
//!         one call of its experts on all received rows (one expert per row, weighted)
//!  ── all_to_all_rows ─► sender: each pair's w·expert(x), in the order it sent them
//!         per row, the pairs summed in expert-id order (as one rank sums them)
//!  ── all_gather_rows ─► the whole [n, d] routed output on every rank
//! ```
//!
//! The ids and weights travel as two more f32 columns of the dispatched rows (ids are
//! exact as f32 below 2^24). The pairs are staged on the host, as [`kimi_ops::ThreadGroup`]
//! stages every collective.

use std::ops::{AddAssign, Range};
use std::sync::atomic::{AtomicU64, Ordering};

use kimi_ops::{Activation, Backend, Collective, ExpertBank, MoeRoutes};

use crate::{ModelError, Result};

/// How expert parallelism combines the experts' outputs (vLLM's `--all2all-backend`
/// choice between the all-reduce and the all-to-all paths).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertDispatch {
    /// Every rank runs the whole batch through its experts; one all-reduce sums them.
    #[default]
    AllReduce,
    /// Each rank sends its share of the tokens to the experts' owners and gathers the
    /// outputs back ([`self`]).
    AllToAll,
}

/// Bytes one rank sends to the others for the routed experts of MoE layers, summed over
/// layer-steps: by the all-to-all dispatch, and what a ring all-reduce of the same output
/// would have sent (`2 (world − 1) / world` of it), for comparison.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchTraffic {
    /// MoE layer-steps dispatched.
    pub steps: u64,
    /// Rows dispatched to other ranks (pairs of a token and an expert they own).
    pub pairs_sent: u64,
    /// Bytes sent to other ranks: dispatched rows with their id and weight, returned
    /// outputs, and this rank's rows of the final all-gather.
    pub bytes_sent: u64,
    /// Bytes a ring all-reduce of the `[n, d]` f32 output would have sent instead.
    pub all_reduce_bytes: u64,
}

impl AddAssign for DispatchTraffic {
    fn add_assign(&mut self, o: Self) {
        self.steps += o.steps;
        self.pairs_sent += o.pairs_sent;
        self.bytes_sent += o.bytes_sent;
        self.all_reduce_bytes += o.all_reduce_bytes;
    }
}

/// The rows of a batch of `n` that rank `rank` of `world` dispatches: a contiguous run, as
/// even as possible (the first `n % world` ranks take one more; ranks past `n` none).
pub(crate) fn row_share(n: usize, world: usize, rank: usize) -> Range<usize> {
    let world = world.max(1);
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start.min(n)..(start + len).min(n)
}

/// One (token, expert) pair a rank dispatches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Pair {
    /// The token's row in the batch.
    pub row: usize,
    /// The expert's global id.
    pub expert: u32,
    /// The route's combine weight.
    pub weight: f32,
}

/// The pairs of `rows` (routes `ids`/`weights`, `[n, top_k]` row-major) grouped by the
/// rank that owns each expert (`owner[e]`): `out[j]` in (row, route) order.
pub(crate) fn group_pairs(
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    rows: Range<usize>,
    owner: &[usize],
    world: usize,
) -> Result<Vec<Vec<Pair>>> {
    if ids.len() != weights.len() || rows.end * top_k > ids.len() {
        return Err(ModelError::Input(format!(
            "expert dispatch: {} ids and {} weights for rows {rows:?} of top {top_k}",
            ids.len(),
            weights.len()
        )));
    }
    let mut out = vec![Vec::new(); world];
    for row in rows {
        for k in 0..top_k {
            let (expert, weight) = (ids[row * top_k + k], weights[row * top_k + k]);
            let to = owner
                .get(expert as usize)
                .copied()
                .filter(|&r| r < world)
                .ok_or_else(|| {
                    ModelError::Input(format!("expert dispatch: expert {expert} has no owner"))
                })?;
            out[to].push(Pair {
                row,
                expert,
                weight,
            });
        }
    }
    Ok(out)
}

/// One MoE layer's token dispatch: who owns which expert, and the traffic so far.
pub(crate) struct TokenDispatch {
    /// The owner rank of every expert id.
    owner: Vec<usize>,
    steps: AtomicU64,
    pairs_sent: AtomicU64,
    bytes_sent: AtomicU64,
    all_reduce_bytes: AtomicU64,
}

impl TokenDispatch {
    /// A dispatch over the ranks whose experts `owned[r]` lists (every id of
    /// `0..num_experts` once).
    pub fn new(owned: &[Vec<usize>], num_experts: usize) -> Result<Self> {
        let mut owner = vec![usize::MAX; num_experts];
        for (rank, ids) in owned.iter().enumerate() {
            for &e in ids {
                match owner.get_mut(e) {
                    Some(o) if *o == usize::MAX => *o = rank,
                    _ => {
                        return Err(ModelError::Input(format!(
                            "expert dispatch: expert {e} placed twice or out of range"
                        )))
                    }
                }
            }
        }
        if let Some(e) = owner.iter().position(|&o| o == usize::MAX) {
            return Err(ModelError::Input(format!(
                "expert dispatch: expert {e} is on no rank"
            )));
        }
        Ok(Self {
            owner,
            steps: AtomicU64::new(0),
            pairs_sent: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            all_reduce_bytes: AtomicU64::new(0),
        })
    }

    /// This dispatch with `old`'s traffic counts carried over (after a placement change).
    pub fn continuing(self, old: &Self) -> Self {
        self.count(old.traffic());
        self
    }

    /// The traffic of this layer so far (this rank's).
    pub fn traffic(&self) -> DispatchTraffic {
        DispatchTraffic {
            steps: self.steps.load(Ordering::Relaxed),
            pairs_sent: self.pairs_sent.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            all_reduce_bytes: self.all_reduce_bytes.load(Ordering::Relaxed),
        }
    }

    fn count(&self, t: DispatchTraffic) {
        self.steps.fetch_add(t.steps, Ordering::Relaxed);
        self.pairs_sent.fetch_add(t.pairs_sent, Ordering::Relaxed);
        self.bytes_sent.fetch_add(t.bytes_sent, Ordering::Relaxed);
        self.all_reduce_bytes
            .fetch_add(t.all_reduce_bytes, Ordering::Relaxed);
    }

    /// The routed experts' output `Σ_k w_k · expert_k(x)` `[n, d]` for the whole batch `x`
    /// `[n, d]` on every rank, `bank` holding this rank's experts: dispatched, computed by
    /// the owners and combined as the module says.
    pub fn run<B: Backend>(
        &self,
        be: &B,
        group: &dyn Collective<B>,
        x: &B::Tensor,
        routes: &MoeRoutes<B::Tensor>,
        bank: &ExpertBank<B::Tensor>,
        act: Activation,
    ) -> Result<B::Tensor> {
        let (world, rank) = (group.world(), group.rank());
        let (n, d) = match be.shape(x) {
            [n, d] => (*n, *d),
            other => {
                return Err(ModelError::Input(format!(
                    "expert dispatch of a {other:?} activation"
                )))
            }
        };
        let ids = be.expert_ids(&routes.experts)?;
        let weights = be.to_f32(&routes.weights)?;
        let rows = row_share(n, world, rank);
        let to = group_pairs(
            &ids,
            &weights,
            routes.top_k,
            rows.clone(),
            &self.owner,
            world,
        )?;

        // Dispatch: each pair's input row, then its expert id and weight.
        let packed = d + 2;
        let sent_rows: Vec<usize> = to.iter().flatten().map(|p| p.row).collect();
        let xs = match sent_rows.is_empty() {
            true => Vec::new(),
            false => be.to_f32(&be.select_rows(x, &sent_rows)?)?,
        };
        let mut parts = Vec::with_capacity(world);
        let mut next = 0;
        for pairs in &to {
            let mut v = Vec::with_capacity(pairs.len() * packed);
            for p in pairs {
                v.extend_from_slice(&xs[next * d..(next + 1) * d]);
                v.extend_from_slice(&[p.expert as f32, p.weight]);
                next += 1;
            }
            parts.push(be.upload_f32(&[pairs.len(), packed], &v)?);
        }
        let received = group.all_to_all_rows(be, &parts)?;

        // The owner: every received pair through its expert, in one call.
        let mut from = Vec::with_capacity(world);
        let (mut xr, mut er, mut wr) = (Vec::new(), Vec::new(), Vec::new());
        for part in &received {
            let v = be.to_f32(part)?;
            if v.len() % packed != 0 {
                return Err(ModelError::Input(format!(
                    "expert dispatch: received {} values, not rows of {packed}",
                    v.len()
                )));
            }
            for row in v.chunks_exact(packed) {
                xr.extend_from_slice(&row[..d]);
                er.push(row[d] as u32);
                wr.push(row[d + 1]);
            }
            from.push(v.len() / packed);
        }
        let m = er.len();
        let yr = match m {
            0 => Vec::new(),
            _ => {
                let y = bank.run_pairs(be, &be.upload_f32(&[m, d], &xr)?, &er, &wr, act)?;
                be.to_f32(&y)?
            }
        };
        if yr.len() != m * d {
            return Err(ModelError::Input(format!(
                "expert dispatch: experts of output width {} for input width {d}",
                yr.len().checked_div(m).unwrap_or(0)
            )));
        }
        let mut back = Vec::with_capacity(world);
        let mut start = 0;
        for &count in &from {
            back.push(be.upload_f32(&[count, d], &yr[start * d..(start + count) * d])?);
            start += count;
        }
        let returned = group.all_to_all_rows(be, &back)?;

        // Combine: each row's pairs summed in expert-id order, as one rank sums them.
        let returned = returned
            .iter()
            .map(|t| be.to_f32(t))
            .collect::<kimi_ops::Result<Vec<_>>>()?;
        let mut by_row: Vec<Vec<(u32, usize, usize)>> = vec![Vec::new(); rows.len()];
        for (j, pairs) in to.iter().enumerate() {
            if returned[j].len() != pairs.len() * d {
                return Err(ModelError::Input(format!(
                    "expert dispatch: rank {j} returned {} values for {} pairs",
                    returned[j].len(),
                    pairs.len()
                )));
            }
            for (i, p) in pairs.iter().enumerate() {
                by_row[p.row - rows.start].push((p.expert, j, i));
            }
        }
        let mut mine = vec![0f32; rows.len() * d];
        for (acc, pairs) in mine.chunks_exact_mut(d.max(1)).zip(&mut by_row) {
            pairs.sort_unstable();
            for &(_, j, i) in pairs.iter() {
                for (a, v) in acc.iter_mut().zip(&returned[j][i * d..(i + 1) * d]) {
                    *a += v;
                }
            }
        }
        let y = group.all_gather_rows(be, &be.upload_f32(&[rows.len(), d], &mine)?)?;

        let f32s = 4u64;
        let others = |j: usize| j != rank;
        let pairs_out: u64 = (0..world)
            .filter(|&j| others(j))
            .map(|j| to[j].len() as u64)
            .sum();
        let pairs_in: u64 = (0..world)
            .filter(|&j| others(j))
            .map(|j| from[j] as u64)
            .sum();
        let gathered = (rows.len() * d) as u64 * (world as u64 - 1);
        self.count(DispatchTraffic {
            steps: 1,
            pairs_sent: pairs_out,
            bytes_sent: f32s * (pairs_out * packed as u64 + pairs_in * d as u64 + gathered),
            all_reduce_bytes: f32s * 2 * (world as u64 - 1) * (n * d) as u64 / world as u64,
        });
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_split_evenly_and_ranks_past_the_batch_take_none() {
        let shares: Vec<_> = (0..4).map(|r| row_share(10, 4, r)).collect();
        assert_eq!(shares, vec![0..3, 3..6, 6..8, 8..10]);
        let one: Vec<_> = (0..4).map(|r| row_share(1, 4, r)).collect();
        assert_eq!(one, vec![0..1, 1..1, 1..1, 1..1]);
        assert!((0..3).all(|r| row_share(0, 3, r).is_empty()));
    }

    #[test]
    fn pairs_are_grouped_by_the_owner_of_their_expert() {
        // 4 experts over 2 ranks, scattered: rank 0 owns 1 and 2.
        let d = TokenDispatch::new(&[vec![1, 2], vec![0, 3]], 4).unwrap();
        // Three rows, top 2.
        let ids = [1, 3, 0, 2, 3, 0];
        let weights = [0.5, 0.25, 0.125, 1.0, 2.0, 4.0];
        let to = group_pairs(&ids, &weights, 2, 1..3, &d.owner, 2).unwrap();
        let pair = |row, expert, weight| Pair {
            row,
            expert,
            weight,
        };
        assert_eq!(to[0], vec![pair(1, 2, 1.0)]);
        assert_eq!(
            to[1],
            vec![pair(1, 0, 0.125), pair(2, 3, 2.0), pair(2, 0, 4.0)]
        );
        // A rank whose share is empty sends nothing anywhere.
        let none = group_pairs(&ids, &weights, 2, row_share(3, 4, 3), &d.owner, 2).unwrap();
        assert!(none.iter().all(Vec::is_empty));
        // An id without an owner is an error, not a dropped pair.
        let e = group_pairs(&[9, 0], &[1.0, 1.0], 2, 0..1, &d.owner, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expert 9 has no owner"), "{e}");
        // Placements that lose or repeat an expert are refused.
        assert!(TokenDispatch::new(&[vec![0, 1], vec![1, 3]], 4).is_err());
        assert!(TokenDispatch::new(&[vec![0, 1], vec![3]], 4).is_err());
    }

    /// Pseudo-random values in [-1, 1).
    fn values(seed: u64, len: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Dispatched over 2 and 4 ranks (experts scattered, batches larger and smaller than
    /// the world), every rank's routed output is one rank's bit for bit: each pair's
    /// weighted output is computed alone and each row's pairs are summed in expert-id
    /// order, as the CPU backend sums them.
    #[test]
    fn dispatched_experts_sum_as_one_rank_does() {
        use kimi_cpu::{CpuBackend, QuantMatmul};
        use kimi_ops::{MlpWeights, ThreadGroup};
        let (e, d, inter, k) = (8, 16, 12, 3);
        let be = CpuBackend::with_quant_matmul(QuantMatmul::F32);
        let expert = |be: &CpuBackend, i: usize| MlpWeights {
            gate: be
                .upload_f32(&[inter, d], &values(3 * i as u64, inter * d))
                .unwrap(),
            up: be
                .upload_f32(&[inter, d], &values(3 * i as u64 + 1, inter * d))
                .unwrap(),
            down: be
                .upload_f32(&[d, inter], &values(3 * i as u64 + 2, d * inter))
                .unwrap(),
        };
        for n in [6, 1] {
            let x = values(99, n * d);
            // Row t takes experts t, t + 3, t + 5 (mod 8), best first.
            let ids: Vec<u32> = (0..n)
                .flat_map(|t| [t % e, (t + 3) % e, (t + 5) % e])
                .map(|i| i as u32)
                .collect();
            let weights: Vec<f32> = values(7, n * k).iter().map(|w| w.abs()).collect();
            let routes = |be: &CpuBackend| MoeRoutes {
                experts: be.upload_expert_ids(&[n, k], &ids).unwrap(),
                weights: be.upload_f32(&[n, k], &weights).unwrap(),
                top_k: k,
            };
            let whole = ExpertBank::resident((0..e).map(|i| expert(&be, i)).collect());
            let xt = be.upload_f32(&[n, d], &x).unwrap();
            let (y, _) = whole.run(&be, &xt, routes(&be), Activation::Silu).unwrap();
            let want = be.to_f32(&y).unwrap();
            for world in [2, 4] {
                // Expert i on rank (3 i) mod world: no rank holds a contiguous run.
                let owned: Vec<Vec<usize>> = (0..world)
                    .map(|r| (0..e).filter(|i| (3 * i) % world == r).collect())
                    .collect();
                let group = ThreadGroup::new(world);
                let results: Vec<(Vec<f32>, DispatchTraffic)> = std::thread::scope(|s| {
                    let ranks: Vec<_> = (0..world)
                        .map(|rank| {
                            let (comm, owned, x) = (group.comm(rank), &owned, &x);
                            s.spawn(move || {
                                let be = CpuBackend::with_quant_matmul(QuantMatmul::F32);
                                let bank = ExpertBank::Partition {
                                    ids: owned[rank].clone(),
                                    local: owned[rank].iter().map(|&i| expert(&be, i)).collect(),
                                    total: e,
                                };
                                let dispatch = TokenDispatch::new(owned, e).unwrap();
                                let xt = be.upload_f32(&[n, d], x).unwrap();
                                let y = dispatch
                                    .run(&be, &comm, &xt, &routes(&be), &bank, Activation::Silu)
                                    .unwrap();
                                (be.to_f32(&y).unwrap(), dispatch.traffic())
                            })
                        })
                        .collect();
                    ranks.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rank, (got, traffic)) in results.iter().enumerate() {
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{n} rows over {world} ranks: rank {rank} differs"
                    );
                    assert_eq!(traffic.steps, 1);
                    let share = row_share(n, world, rank).len() as u64;
                    // Each of the rank's pairs whose expert is elsewhere crosses once.
                    let away = (row_share(n, world, rank)
                        .flat_map(|t| ids[t * k..(t + 1) * k].to_vec()))
                    .filter(|&i| (3 * i as usize) % world != rank)
                    .count() as u64;
                    assert_eq!(traffic.pairs_sent, away, "rank {rank}");
                    if share == 0 {
                        assert_eq!(traffic.pairs_sent, 0);
                    }
                    assert_eq!(
                        traffic.all_reduce_bytes,
                        4 * 2 * (world as u64 - 1) * (n * d) as u64 / world as u64
                    );
                }
            }
        }
    }
}
