//! Experts beyond the backend's memory: a layer's routed experts split into tiers.
//!
//! ```text
//! expert e ─► resident: the backend's memory, for good
//!          └► host store (HostExperts): host memory, computed there when cold
//!               └► cache slot: a device copy, filled after the router has run
//!                    (or a MoE layer ahead, predicted: [`CachePolicy::predict_next`];
//!                    or after the host computed it: [`CachePolicy::copy_behind`])
//! ```
//!
//! Per MoE step ([`TieredBank::run`]) the routes are read back, the [`ExpertCache`] plans
//! hits, fills (copies into slots, evicting) and cold experts; the backend computes every
//! pair whose expert is resident or in a slot, and the host store the cold pairs, whose
//! sum is added. Without cold experts the result has the bits of the all-resident bank;
//! with them the host's sum is rounded separately.

mod cache;
mod costs;
mod host;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use cache::{CachePolicy, CacheStep, ExpertCache, Fill};
pub use costs::{MissCosts, MissPolicy};
pub use host::{ColdPair, HostBackend, HostExpertStore, HostExperts, HostLayerBuilder};

use crate::experts::ExpertView;
use crate::{Activation, Backend, Error, LockedRegion, MlpWeights, MoeRoutes, Result};

/// An amount of experts per MoE layer, or of bytes over all MoE layers (the flags'
/// gigabytes), turned into experts per layer by [`ExpertOffload::per_layer`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OffloadAmount {
    /// Experts per MoE layer.
    Experts(usize),
    /// Bytes of stored expert weights, spread evenly over the MoE layers.
    Bytes(u64),
}

/// How a model places its routed experts when they do not all fit the backend's memory
/// (given at load).
#[derive(Clone)]
pub struct ExpertOffload {
    /// Routed experts kept in host memory instead of the backend's: the highest ids of each
    /// layer (without routing statistics every expert is as likely). Bytes round up to
    /// whole experts.
    pub host: OffloadAmount,
    /// Device slots that cache host experts. Bytes round down to whole experts.
    pub cache: OffloadAmount,
    /// How the slots are chosen.
    pub policy: CachePolicy,
    /// Where the host experts live and are computed.
    pub store: Arc<dyn HostExpertStore>,
}

impl ExpertOffload {
    /// `(host experts, cache slots)` of one layer of `num_experts` experts of
    /// `expert_bytes` each, in a model of `moe_layers` MoE layers.
    pub fn per_layer(
        &self,
        num_experts: usize,
        expert_bytes: u64,
        moe_layers: usize,
    ) -> (usize, usize) {
        let per_layer = |b: u64| b / moe_layers.max(1) as u64;
        let host = match self.host {
            OffloadAmount::Experts(n) => n,
            OffloadAmount::Bytes(b) => per_layer(b).div_ceil(expert_bytes.max(1)) as usize,
        };
        let slots = match self.cache {
            OffloadAmount::Experts(n) => n,
            OffloadAmount::Bytes(b) => (per_layer(b) / expert_bytes.max(1)) as usize,
        };
        let host = host.min(num_experts);
        (host, slots.min(host))
    }
}

impl std::fmt::Debug for ExpertOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertOffload")
            .field("host", &self.host)
            .field("cache", &self.cache)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Counters of a tiered bank (or of several, summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadCounts {
    /// MoE steps run.
    pub steps: u64,
    /// Host experts needed and found in a slot.
    pub hits: u64,
    /// Host experts copied into a slot.
    pub fills: u64,
    /// Fills that replaced another expert.
    pub evictions: u64,
    /// Host experts computed on the host.
    pub cold_experts: u64,
    /// Token-expert pairs computed on the host.
    pub cold_pairs: u64,
    /// Token-expert pairs computed by the backend.
    pub device_pairs: u64,
    /// Bytes copied into slots.
    pub bytes_moved: u64,
    /// Nanoseconds the host spent computing cold experts.
    pub host_ns: u64,
    /// Nanoseconds the tiered steps took on the calling thread, from reading the routes to
    /// queueing the sum (the host's share included; the device's products run on).
    pub step_ns: u64,
    /// Host experts copied into a slot ahead of their step, on the previous MoE layer's
    /// prediction ([`CachePolicy::predict_next`]) or after the host computed them
    /// ([`CachePolicy::copy_behind`]); their bytes count in `bytes_moved`.
    pub ahead_fills: u64,
    /// Of those, the ones their step then needed (counted among its hits).
    pub ahead_used: u64,
}

impl OffloadCounts {
    /// Hits over host experts needed (hits + fills + cold), or `None` before any.
    pub fn hit_rate(&self) -> Option<f64> {
        let needed = self.hits + self.fills + self.cold_experts;
        (needed > 0).then(|| self.hits as f64 / needed as f64)
    }
}

impl std::ops::Sub for OffloadCounts {
    type Output = Self;

    /// The counts since `o` (an earlier reading of the same counters).
    fn sub(self, o: Self) -> Self {
        Self {
            steps: self.steps.saturating_sub(o.steps),
            hits: self.hits.saturating_sub(o.hits),
            fills: self.fills.saturating_sub(o.fills),
            evictions: self.evictions.saturating_sub(o.evictions),
            cold_experts: self.cold_experts.saturating_sub(o.cold_experts),
            cold_pairs: self.cold_pairs.saturating_sub(o.cold_pairs),
            device_pairs: self.device_pairs.saturating_sub(o.device_pairs),
            bytes_moved: self.bytes_moved.saturating_sub(o.bytes_moved),
            host_ns: self.host_ns.saturating_sub(o.host_ns),
            step_ns: self.step_ns.saturating_sub(o.step_ns),
            ahead_fills: self.ahead_fills.saturating_sub(o.ahead_fills),
            ahead_used: self.ahead_used.saturating_sub(o.ahead_used),
        }
    }
}

impl std::ops::AddAssign for OffloadCounts {
    fn add_assign(&mut self, o: Self) {
        self.steps += o.steps;
        self.hits += o.hits;
        self.fills += o.fills;
        self.evictions += o.evictions;
        self.cold_experts += o.cold_experts;
        self.cold_pairs += o.cold_pairs;
        self.device_pairs += o.device_pairs;
        self.bytes_moved += o.bytes_moved;
        self.host_ns += o.host_ns;
        self.step_ns += o.step_ns;
        self.ahead_fills += o.ahead_fills;
        self.ahead_used += o.ahead_used;
    }
}

#[derive(Default)]
struct Counters([AtomicU64; 12]);

impl Counters {
    fn add(&self, c: OffloadCounts) {
        let v = [
            c.steps,
            c.hits,
            c.fills,
            c.evictions,
            c.cold_experts,
            c.cold_pairs,
            c.device_pairs,
            c.bytes_moved,
            c.host_ns,
            c.step_ns,
            c.ahead_fills,
            c.ahead_used,
        ];
        for (a, v) in self.0.iter().zip(v) {
            a.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn get(&self) -> OffloadCounts {
        let v: Vec<u64> = self.0.iter().map(|a| a.load(Ordering::Relaxed)).collect();
        OffloadCounts {
            steps: v[0],
            hits: v[1],
            fills: v[2],
            evictions: v[3],
            cold_experts: v[4],
            cold_pairs: v[5],
            device_pairs: v[6],
            bytes_moved: v[7],
            host_ns: v[8],
            step_ns: v[9],
            ahead_fills: v[10],
            ahead_used: v[11],
        }
    }
}

/// How long the host's threads stay awake for a tiered step's cold experts: longer than a
/// step waits for its routes (a layer of decode on the device).
const HOST_WORK_WITHIN: std::time::Duration = std::time::Duration::from_millis(2);

/// Where a tiered bank's experts are (or, summed, a model's).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Placement {
    /// Experts in the backend's memory for good.
    pub resident: usize,
    /// Experts in the host store.
    pub host: usize,
    /// Device slots caching host experts.
    pub slots: usize,
    /// Bytes of the resident experts and of the slots (as stored).
    pub device_bytes: u64,
    /// Bytes of the host experts.
    pub host_bytes: u64,
    /// What a miss costs on either side, where they choose ([`MissPolicy::Auto`]; summed
    /// placements keep the first bank's).
    pub miss_costs: Option<MissCosts>,
}

impl std::ops::AddAssign for Placement {
    fn add_assign(&mut self, o: Self) {
        self.resident += o.resident;
        self.host += o.host;
        self.slots += o.slots;
        self.device_bytes += o.device_bytes;
        self.host_bytes += o.host_bytes;
        self.miss_costs = self.miss_costs.or(o.miss_costs);
    }
}

struct Slots<T> {
    weights: Vec<MlpWeights<T>>,
    cache: ExpertCache,
    /// The host's measured step times over the times its [`MissCosts`] predicted (a moving
    /// average): cold experts computed beside the device's work, many per step, run slower
    /// than the lone expert timed at load.
    host_scale: f64,
    /// Experts copied in ahead since the last step (to count the ones it used).
    ahead: Vec<usize>,
    /// Whether copies ahead were queued since the last step: the step's device work waits
    /// for them ([`Backend::await_ahead`]).
    ahead_pending: bool,
    /// When those copies are expected to be done, by the measured copy cost: until then
    /// the link is busy, which the step's `Auto` placement counts on the copy side.
    ahead_until: Option<std::time::Instant>,
}

/// The next MoE layer's bank and the routes predicted for it, given to a step so that it
/// copies the predicted experts into that bank's slots ahead ([`CachePolicy::predict_next`]).
pub struct NextLayer<'a, T> {
    /// The next MoE layer's experts.
    pub bank: &'a TieredBank<T>,
    /// Its router's choices on this layer's input.
    pub routes: MoeRoutes<T>,
}

/// A layer's routed experts in tiers: some resident, the rest in a host store with a cache
/// of device slots in front of it.
pub struct TieredBank<T> {
    resident: Vec<Option<MlpWeights<T>>>,
    /// The host store's memory, page-locked by the backend for its slot fills (each lock
    /// keeps the store alive); unlocked when the bank goes.
    _locked: Vec<LockedRegion>,
    host: Arc<dyn HostExperts>,
    slots: Mutex<Slots<T>>,
    policy: CachePolicy,
    placement: Placement,
    /// Measured costs of a miss on either side, under [`MissPolicy::Auto`] with slots.
    costs: Option<MissCosts>,
    counters: Counters,
    /// One bit per recent step (the newest lowest): whether it had cold experts. The host
    /// is woken ahead of a step only while some recent step had them.
    recent_cold: AtomicU32,
    /// The same for misses of either kind (copied in or cold): a step predicts this bank's
    /// experts for it only while some recent step missed ([`TieredBank::wants_prediction`]).
    recent_miss: AtomicU32,
}

impl<T> TieredBank<T> {
    /// A bank of `resident.len()` experts: `Some` ones stay in the backend's memory, the
    /// `None` ones are `host`'s, cached in up to `slots` device slots (filled at start with
    /// the lowest-id host experts).
    pub fn new<B: Backend<Tensor = T>>(
        be: &B,
        resident: Vec<Option<MlpWeights<T>>>,
        host: Arc<dyn HostExperts>,
        slots: usize,
        policy: CachePolicy,
    ) -> Result<Self> {
        let host_ids: Vec<usize> = (0..resident.len())
            .filter(|&e| resident[e].is_none())
            .collect();
        for &e in &host_ids {
            if host.matrices(e).is_none() {
                return Err(Error::Shape {
                    op: "expert offload",
                    detail: format!("expert {e} is neither resident nor in the host store"),
                });
            }
        }
        let slots = slots.min(host_ids.len());
        let mut locked = Vec::new();
        if slots > 0 {
            // The store keeps its regions mapped and unwritten while it lives.
            let owner: Arc<dyn Send + Sync> = Arc::new(host.clone());
            for region in host.regions() {
                if let Some(l) = be.lock_host_region(region, owner.clone())? {
                    locked.push(l);
                }
            }
        }
        let mut cache = ExpertCache::new(resident.len(), slots, policy);
        let mut weights = Vec::with_capacity(slots);
        for (slot, &e) in host_ids.iter().take(slots).enumerate() {
            weights.push(upload_expert(be, host.as_ref(), e)?);
            cache.place(e, slot);
        }
        // Timed on host experts that no slot took: the slots' uploads have read other
        // experts since they were loaded, so in a real model these are out of the CPU's
        // caches, as a step's cold experts are. A bank whose host experts all have slots
        // times those.
        let costs = match (policy.miss, weights.first_mut()) {
            (MissPolicy::Auto, Some(w)) => {
                let fresh = match &host_ids[slots..] {
                    [] => &host_ids[..],
                    rest => rest,
                };
                Some(MissCosts::measure(
                    be,
                    host.as_ref(),
                    fresh,
                    w,
                    host_ids[0],
                )?)
            }
            _ => None,
        };
        // Every expert of a layer has the same shapes and format: a host expert's stored
        // size stands for the resident ones too.
        let host_bytes: u64 = host_ids.iter().map(|&e| host.bytes(e) as u64).sum();
        let per_expert = host_ids.first().map_or(0, |&e| host.bytes(e) as u64);
        let resident_count = resident.iter().flatten().count();
        let placement = Placement {
            resident: resident_count,
            host: host_ids.len(),
            slots,
            device_bytes: (resident_count + slots) as u64 * per_expert,
            host_bytes,
            miss_costs: costs,
        };
        Ok(Self {
            resident,
            _locked: locked,
            host,
            slots: Mutex::new(Slots {
                weights,
                cache,
                host_scale: 1.0,
                ahead: Vec::new(),
                ahead_pending: false,
                ahead_until: None,
            }),
            policy,
            placement,
            costs,
            counters: Counters::default(),
            recent_cold: AtomicU32::new(0),
            // Missing until its first steps say otherwise.
            recent_miss: AtomicU32::new(u32::MAX),
        })
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.resident.len()
    }

    /// Whether the bank has no experts.
    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }

    /// Where the experts are.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The measured costs of a miss on either side, where they choose ([`MissPolicy::Auto`]
    /// with slots).
    pub fn miss_costs(&self) -> Option<MissCosts> {
        self.costs
    }

    /// The counters so far.
    pub fn counts(&self) -> OffloadCounts {
        self.counters.get()
    }

    /// How the slots are chosen.
    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// Whether the layer before should predict this bank's experts and copy them ahead:
    /// it has slots and one of its last 32 steps missed. Where every step hits, the
    /// prediction (a router and a read-back per layer) would cost without saving.
    pub fn wants_prediction(&self) -> bool {
        self.placement.slots > 0 && self.recent_miss.load(Ordering::Relaxed) != 0
    }

    /// See [`crate::ExpertBank::run`]. With `next`, the next MoE layer's predicted experts
    /// are copied into its slots once this step's device work is queued, beside the host's
    /// share of this step.
    pub fn run<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        routes: MoeRoutes<T>,
        act: Activation,
        next: Option<NextLayer<'_, T>>,
    ) -> Result<(T, T)> {
        const OP: &str = "moe_experts (tiered)";
        let started = std::time::Instant::now();
        if self.recent_cold.load(Ordering::Relaxed) != 0 {
            // The host's threads, idle while the device worked, are woken now rather than
            // when the routes come back: waking them takes longer than a lone cold expert.
            // Only while cold experts are frequent: otherwise they would spin for nothing.
            self.host.expect_work(HOST_WORK_WITHIN);
        }
        let mut sets = vec![&routes];
        sets.extend(next.as_ref().map(|n| &n.routes));
        let mut read = be.read_route_sets(&sets)?.into_iter();
        let Some((ids, weights)) = read.next() else {
            return Err(Error::Shape {
                op: OP,
                detail: "the routes were not read back".into(),
            });
        };
        let next_routes = read.next();
        let k = routes.top_k.max(1);
        let e_count = self.resident.len();
        if ids.len() != weights.len() || !ids.len().is_multiple_of(k) {
            return Err(Error::Shape {
                op: OP,
                detail: format!(
                    "{} expert ids, {} weights, top_k {k}",
                    ids.len(),
                    weights.len()
                ),
            });
        }
        if let Some(bad) = ids.iter().find(|&&e| e as usize >= e_count) {
            return Err(Error::Shape {
                op: OP,
                detail: format!("routes name expert {bad} of {e_count}"),
            });
        }
        let n = ids.len() / k;
        let (pairs, needed) = self.host_pairs(&ids);
        let mut guard = self.lock_slots()?;
        let slots = &mut *guard;
        let ahead_used = slots
            .ahead
            .drain(..)
            .filter(|&e| pairs[e] > 0 && slots.cache.slot_of(e).is_some())
            .count() as u64;
        if std::mem::take(&mut slots.ahead_pending) {
            be.await_ahead()?;
        }
        let now = std::time::Instant::now();
        let backlog_s = slots
            .ahead_until
            .take()
            .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64());
        let costs = self.costs.map(|c| c.with_host_scaled(slots.host_scale));
        let step = slots.cache.step_behind(&needed, costs.as_ref(), backlog_s);
        // What the load-time costs say the host's share takes, to correct them by.
        let predicted: f64 = match &self.costs {
            Some(c) => c.host_step_s(step.cold.iter().map(|&e| pairs[e])),
            None => 0.0,
        };
        let mut counts = OffloadCounts {
            steps: 1,
            hits: step.hits.len() as u64,
            fills: step.fills.len() as u64,
            evictions: step.fills.iter().filter(|f| f.evicted.is_some()).count() as u64,
            cold_experts: step.cold.len() as u64,
            ahead_used,
            ..OffloadCounts::default()
        };
        // The input is read back before the device's copies and products are queued, so
        // that the host computes its share while the device does the rest.
        let xs = if step.cold.is_empty() {
            Vec::new()
        } else {
            be.to_f32(x)?
        };
        for f in &step.fills {
            let m = host_matrices(self.host.as_ref(), f.expert)?;
            let w = &mut slots.weights[f.slot];
            be.upload_into(&mut w.gate, m.gate)?;
            be.upload_into(&mut w.up, m.up)?;
            be.upload_into(&mut w.down, m.down)?;
            counts.bytes_moved += self.host.bytes(f.expert) as u64;
        }
        let mut is_cold = vec![false; e_count];
        for &e in &step.cold {
            is_cold[e] = true;
        }
        let mut cold = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            if is_cold[e as usize] {
                cold.push(ColdPair {
                    row: i / k,
                    expert: e as usize,
                    weight: weights[i],
                });
            }
        }
        counts.cold_pairs = cold.len() as u64;
        let had_cold = u32::from(!cold.is_empty());
        let had_miss = u32::from(!cold.is_empty() || !step.fills.is_empty());
        for (recent, bit) in [(&self.recent_cold, had_cold), (&self.recent_miss, had_miss)] {
            let _ = recent.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(bits << 1 | bit)
            });
        }
        counts.device_pairs = (ids.len() - cold.len()) as u64;

        let out_width = self.host.out_width();
        // The cold experts are absent from the device's view: the backend skips their pairs
        // (the host adds them below). Any device expert stands in for their weights, as for
        // the experts no route names.
        let stand_in = self
            .resident
            .iter()
            .flatten()
            .next()
            .or(slots.weights.first());
        let (mut y, experts) = match stand_in {
            Some(stand_in) => {
                let view: Vec<(&MlpWeights<T>, bool)> = (0..e_count)
                    .map(|e| match (&self.resident[e], slots.cache.slot_of(e)) {
                        (Some(w), _) => (w, true),
                        (None, Some(s)) => (&slots.weights[s], true),
                        (None, None) => (stand_in, !is_cold[e]),
                    })
                    .collect();
                let view = if cold.is_empty() {
                    ExpertView::per_call(view.into_iter().map(|(w, _)| w).collect())
                } else {
                    ExpertView::partial(view)
                };
                let y = be.moe_experts(x, &routes, &view, act)?;
                (y, routes.experts)
            }
            None => (be.zeros(&[n, out_width])?, routes.experts),
        };
        drop(guard);
        // The link's time from now, by the measured costs: busy with the queued copies and
        // this step's own, idle while the host computes this step's share. Copies ahead and
        // behind take only the idle part (to the nearest copy), so that they never hold up
        // a later step's own copies; without measured costs, one token's worth.
        let mut link = costs.as_ref().map(|c| {
            let busy_s = backlog_s + step.fills.len() as f64 * c.fill_s;
            (busy_s, c.host_step_s(step.cold.iter().map(|&e| pairs[e])))
        });
        // Copies of `fill_s` each that fit the idle part, and the link's state for the bank
        // that queues them; `fallback` copies where there are no costs to size them by.
        let idle_copies = |link: Option<(f64, f64)>, fill_s: f64, fallback: usize| match link
            .filter(|_| fill_s > 0.0)
        {
            Some((busy_s, host_s)) => {
                let idle_s = (host_s - busy_s).max(0.0);
                ((idle_s / fill_s + 0.5) as usize, Some((busy_s, fill_s)))
            }
            None => (fallback, None),
        };
        if let (Some(n), Some((next_ids, _))) = (&next, &next_routes) {
            let fill_s = n.bank.costs.map_or(0.0, |c| c.fill_s);
            let (limit, busy) = idle_copies(link, fill_s, k);
            let (_, predicted) = n.bank.host_pairs(next_ids);
            let queued = n.bank.copy_ahead(be, &predicted, limit, busy)?;
            if let Some((busy_s, _)) = link.as_mut() {
                *busy_s += queued as f64 * fill_s;
            }
        }
        if self.policy.copy_behind && !step.cold.is_empty() {
            let fill_s = costs.as_ref().map_or(0.0, |c| c.fill_s);
            let (limit, busy) = idle_copies(link, fill_s, step.cold.len());
            let cold: Vec<(usize, usize)> = step.cold.iter().map(|&e| (e, pairs[e])).collect();
            self.copy_ahead(be, &cold, limit, busy)?;
        }
        if !cold.is_empty() {
            let width = be.shape(x).last().copied().unwrap_or(0);
            let host_started = std::time::Instant::now();
            let yc = self.host.compute(&xs, n, width, &cold, act)?;
            let took = host_started.elapsed().as_secs_f64();
            counts.host_ns = (took * 1e9) as u64;
            if predicted > 0.0 {
                if let Ok(mut slots) = self.slots.lock() {
                    let ratio = (took / predicted).clamp(0.25, 16.0);
                    slots.host_scale = 0.8 * slots.host_scale + 0.2 * ratio;
                }
            }
            be.add_assign(&mut y, &be.upload_f32(&[n, out_width], &yc)?)?;
        }
        counts.step_ns = started.elapsed().as_nanos() as u64;
        self.counters.add(counts);
        Ok((y, experts))
    }
}

impl<T> TieredBank<T> {
    /// Pairs per expert id of `ids` (ids past the bank count nothing), and the host experts
    /// among them with their pairs.
    fn host_pairs(&self, ids: &[u32]) -> (Vec<usize>, Vec<(usize, usize)>) {
        let mut pairs = vec![0usize; self.resident.len()];
        for &e in ids {
            if let Some(p) = pairs.get_mut(e as usize) {
                *p += 1;
            }
        }
        let host = (0..pairs.len())
            .filter(|&e| pairs[e] > 0 && self.resident[e].is_none())
            .map(|e| (e, pairs[e]))
            .collect();
        (pairs, host)
    }

    fn lock_slots(&self) -> Result<std::sync::MutexGuard<'_, Slots<T>>> {
        self.slots
            .lock()
            .map_err(|_| Error::Device("expert cache lock poisoned".into()))
    }

    /// Copies up to `limit` of the host experts `wanted` lists with their pairs (a
    /// predicted step's, or the cold experts of the step just made) into slots ahead of the
    /// bank's next step ([`ExpertCache::ahead`]); returns how many were queued. With `link = (busy_s,
    /// fill_s)` the copies start once the link's queued work is done, `busy_s` from now,
    /// and each takes `fill_s`: the step counts what is left of them.
    fn copy_ahead<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        wanted: &[(usize, usize)],
        limit: usize,
        link: Option<(f64, f64)>,
    ) -> Result<usize> {
        if limit == 0 {
            return Ok(0);
        }
        let mut guard = self.lock_slots()?;
        let slots = &mut *guard;
        let fills = slots.cache.ahead(wanted, limit);
        let mut counts = OffloadCounts::default();
        for f in &fills {
            let m = host_matrices(self.host.as_ref(), f.expert)?;
            let w = &mut slots.weights[f.slot];
            be.upload_into_ahead(&mut w.gate, m.gate)?;
            be.upload_into_ahead(&mut w.up, m.up)?;
            be.upload_into_ahead(&mut w.down, m.down)?;
            counts.bytes_moved += self.host.bytes(f.expert) as u64;
            counts.ahead_fills += 1;
            slots.ahead.push(f.expert);
        }
        slots.ahead_pending |= !fills.is_empty();
        if let (Some((busy_s, fill_s)), false) = (link, fills.is_empty()) {
            let secs = busy_s + fills.len() as f64 * fill_s;
            slots.ahead_until = std::time::Duration::try_from_secs_f64(secs)
                .ok()
                .and_then(|d| std::time::Instant::now().checked_add(d));
        }
        self.counters.add(counts);
        Ok(fills.len())
    }
}

fn host_matrices(host: &dyn HostExperts, e: usize) -> Result<MlpWeights<crate::HostTensor<'_>>> {
    host.matrices(e).ok_or_else(|| Error::Shape {
        op: "expert offload",
        detail: format!("expert {e} is not in the host store"),
    })
}

fn upload_expert<B: Backend>(
    be: &B,
    host: &dyn HostExperts,
    e: usize,
) -> Result<MlpWeights<B::Tensor>> {
    let m = host_matrices(host, e)?;
    Ok(MlpWeights {
        gate: be.upload(m.gate)?,
        up: be.upload(m.up)?,
        down: be.upload(m.down)?,
    })
}
