//! Experts in tiers against all experts resident, on the CPU backend with tiny forced
//! caches so that every path runs: misses filling slots, hits, evictions, cold experts
//! computed by the host store, and banks with no slot at all.
//!
//! Without cold experts the tiered model must give the resident model's logits bit for
//! bit (the same kernels read the same bytes from slots); with cold experts the host's
//! sum is rounded on its own, so they agree to f32 rounding. Both are also checked against
//! the fixtures' float64 reference logits.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::{ExpertOffload, KimiLinear, LoadOptions, OffloadAmount, OffloadCounts};
use kimi_ops::offload::{CachePolicy, HostBackend};
use kimi_weights::Checkpoint;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(path)
}

fn backend() -> CpuBackend {
    CpuBackend::with_quant_matmul(QuantMatmul::F32)
}

fn load(dir: &Path, offload: Option<(OffloadAmount, OffloadAmount)>) -> KimiLinear<CpuBackend> {
    load_with(
        dir,
        offload.map(|(host, cache)| (host, cache, CachePolicy::default())),
    )
}

/// The checkpoint in `dir` with `(host, cache, policy)` tiers (host store on the CPU
/// backend), or all resident.
fn load_with(
    dir: &Path,
    offload: Option<(OffloadAmount, OffloadAmount, CachePolicy)>,
) -> KimiLinear<CpuBackend> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let options = LoadOptions {
        offload: offload.map(|(host, cache, policy)| ExpertOffload {
            host,
            cache,
            policy,
            store: Arc::new(HostBackend::new(Arc::new(backend()))),
        }),
        ..LoadOptions::default()
    };
    KimiLinear::load_checkpoint_with(backend(), &ckpt, &options).unwrap()
}

fn prompt(dir: &Path) -> Vec<u32> {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of every position, `step` tokens per forward pass.
fn run(model: &KimiLinear<CpuBackend>, ids: &[u32], step: usize) -> Vec<f32> {
    common::logits_in_steps(model, ids, step)
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - *w as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (num / den).sqrt()
}

use OffloadAmount::Experts;

/// One fixture in every split: (host experts, slots) per layer, and what must have run.
fn check(dir: &str, experts: usize) {
    let dir = fixture(dir);
    let ids = prompt(&dir);
    let resident = load(&dir, None);
    assert!(resident.offload_counts().is_none());
    // Token by token (one route per step: the cache turns over) and in chunks of 16.
    for step in [1, 16] {
        let want = run(&resident, &ids, step);
        let half = experts / 2;
        for (host, slots) in [
            (experts, 0),       // every expert on the host, no slot: all cold
            (experts, 1),       // one slot: constant eviction, most experts cold
            (half, 2),          // half resident, the rest through two slots
            (experts, experts), // every expert through a slot: never cold
        ] {
            let model = load(&dir, Some((Experts(host), Experts(slots))));
            let placement = model.expert_placement();
            assert!(!placement.is_empty());
            for (_, p) in &placement {
                assert_eq!((p.resident, p.host, p.slots), (experts - host, host, slots));
            }
            let got = run(&model, &ids, step);
            let c: OffloadCounts = model.offload_counts().unwrap();
            let label = format!(
                "{} step {step}, {host} on the host, {slots} slots",
                dir.display()
            );
            eprintln!("{label}: {c:?}");
            assert!(c.steps > 0, "{label}");
            if slots == 0 {
                assert_eq!((c.hits, c.fills, c.device_pairs), (0, 0, 0), "{label}");
            }
            if slots < host {
                assert!(c.cold_pairs > 0, "{label}: no cold pair");
            }
            // Token by token the routes move on every step; a chunk of 16 tokens may keep
            // needing the slot's holder.
            if slots == 1 && step == 1 {
                assert!(c.evictions > 0 && c.fills > 0, "{label}: no eviction");
                assert!(c.bytes_moved > 0, "{label}");
            }
            if slots == host {
                assert_eq!(c.cold_pairs, 0, "{label}");
                assert!(c.hits > 0, "{label}: no hit");
                assert_eq!(got, want, "{label}: not the resident bits");
            } else {
                let err = rel_err(&got, &want);
                assert!(err < 1e-5, "{label}: relative error {err:.2e}");
            }
        }
    }
}

#[test]
fn kimi_k3_tiers_match_resident_experts() {
    check("kimi-k3/k3-tiny-7l", 8);
}

#[test]
fn kimi_linear_tiers_match_resident_experts() {
    check("kimi-linear/hub-f32-sharded", 6);
}

/// Host experts in memory-mapped files (`--offload-folder`) instead of RAM: the same bits
/// where no expert is cold, f32 rounding where some are, and every host expert's bytes in
/// the folder's files.
#[test]
fn experts_in_an_offload_folder_match_resident_experts() {
    let dir = fixture("kimi-k3/k3-tiny-7l");
    let ids = prompt(&dir);
    let want = run(&load(&dir, None), &ids, 1);
    let folder = tempfile::tempdir().unwrap();
    for (host, slots) in [(8, 8), (8, 1), (4, 2)] {
        let file = Arc::new(kimi_cpu::WeightFile::new(folder.path()).unwrap());
        let store = HostBackend::new(Arc::new(backend().keeping_weights_in(file.clone())));
        let ckpt = Checkpoint::open(&dir).unwrap();
        let options = LoadOptions {
            offload: Some(ExpertOffload {
                host: Experts(host),
                cache: Experts(slots),
                policy: CachePolicy::default(),
                store: Arc::new(store),
            }),
            ..LoadOptions::default()
        };
        let model = KimiLinear::load_checkpoint_with(backend(), &ckpt, &options).unwrap();
        let host_bytes: u64 = model
            .expert_placement()
            .iter()
            .map(|(_, p)| p.host_bytes)
            .sum();
        assert!(host_bytes > 0);
        assert_eq!(file.bytes(), host_bytes, "{host} host experts");
        let got = run(&model, &ids, 1);
        let label = format!("{host} host experts, {slots} slots");
        if slots == host {
            assert_eq!(got, want, "{label}");
        } else {
            let err = rel_err(&got, &want);
            assert!(err < 1e-5, "{label}: relative error {err:.2e}");
            assert!(model.offload_counts().unwrap().cold_pairs > 0, "{label}");
        }
    }
    // Unnamed files: the folder stays empty.
    assert_eq!(std::fs::read_dir(folder.path()).unwrap().count(), 0);
}

/// `--offload-miss`: `cpu` copies nothing after the start (every miss computed on the
/// host), `auto` measures both sides when the bank is made and sends each miss one way;
/// either way the logits are the resident model's to f32 rounding.
#[test]
fn miss_policies_serve_misses_on_either_side() {
    use kimi_ops::offload::MissPolicy;
    let dir = fixture("kimi-linear/hub-f32-sharded");
    let ids = prompt(&dir);
    let want = run(&load(&dir, None), &ids, 1);
    for miss in [MissPolicy::Host, MissPolicy::Auto] {
        let policy = CachePolicy {
            miss,
            ..CachePolicy::default()
        };
        let model = load_with(&dir, Some((Experts(6), Experts(2), policy)));
        let got = run(&model, &ids, 1);
        let c = model.offload_counts().unwrap();
        let label = format!("{miss:?}: {c:?}");
        let err = rel_err(&got, &want);
        assert!(err < 1e-5, "{label}: relative error {err:.2e}");
        let placement = model.expert_placement();
        match miss {
            MissPolicy::Host => {
                assert_eq!((c.fills, c.bytes_moved), (0, 0), "{label}");
                assert!(c.cold_pairs > 0 && c.hits > 0, "{label}");
                assert!(placement.iter().all(|(_, p)| p.miss_costs.is_none()));
            }
            _ => {
                // Every bank measured its own costs: positive and finite.
                for (_, p) in &placement {
                    let m = p.miss_costs.expect("auto measures the costs");
                    for v in [m.fill_s, m.host_first_s] {
                        assert!(v.is_finite() && v > 0.0, "{label}: {m:?}");
                    }
                    for v in [m.host_next_s, m.host_more_s] {
                        assert!(v.is_finite() && v >= 0.0, "{label}: {m:?}");
                    }
                }
                assert!(c.hits + c.fills + c.cold_experts > 0, "{label}");
            }
        }
    }
}

#[test]
fn byte_budgets_become_whole_experts_per_layer() {
    let dir = fixture("kimi-k3/k3-tiny-7l");
    let model = load(&dir, Some((Experts(8), Experts(0))));
    let (_, p) = model.expert_placement()[0];
    let per_expert = p.host_bytes / 8;
    let layers = model.expert_placement().len() as u64;
    // 2.5 experts' worth of every layer on the host rounds up to 3; 1.5 slots down to 1.
    let model = load(
        &dir,
        Some((
            OffloadAmount::Bytes(per_expert * layers * 5 / 2),
            OffloadAmount::Bytes(per_expert * layers * 3 / 2),
        )),
    );
    for (_, p) in model.expert_placement() {
        assert_eq!((p.resident, p.host, p.slots), (5, 3, 1));
    }
}

/// A host store in RAM reports the mappings its experts lie in (each once, covering every
/// expert's bytes) for a device backend to page-lock for its slot fills; the disk tier's
/// files are never reported (locking them would read the files into RAM).
#[test]
fn host_experts_report_lockable_regions_in_ram_and_none_on_disk() {
    use kimi_core::DType;
    use kimi_ops::offload::HostExpertStore;
    use kimi_ops::{HostTensor, MlpWeights};
    let (rows, cols) = (32usize, 64usize);
    let bytes: Vec<u8> = (0..rows * cols * 2).map(|i| (i % 97) as u8).collect();
    let matrix = |shape: &'static [usize]| HostTensor {
        shape,
        dtype: DType::BF16,
        bytes: &bytes,
    };
    let folder = tempfile::tempdir().unwrap();
    for on_disk in [false, true] {
        let be = if on_disk {
            let file = kimi_cpu::WeightFile::new(folder.path()).unwrap();
            backend().keeping_weights_in(Arc::new(file))
        } else {
            backend()
        };
        let mut layer = HostBackend::new(Arc::new(be)).begin_layer(4);
        for e in 0..4 {
            let w = MlpWeights {
                gate: matrix(&[32, 64]),
                up: matrix(&[32, 64]),
                down: matrix(&[64, 32]),
            };
            layer.add(e, w).unwrap();
        }
        let experts = layer.finish().unwrap();
        let regions = experts.regions();
        if on_disk {
            assert!(regions.is_empty(), "{regions:?}");
            continue;
        }
        assert!(!regions.is_empty());
        for pair in regions.windows(2) {
            assert!(pair[0].start + pair[0].len <= pair[1].start, "{regions:?}");
        }
        for e in 0..4 {
            let m = experts.matrices(e).unwrap();
            for t in [m.gate, m.up, m.down] {
                let (a, n) = (t.bytes.as_ptr() as usize, t.bytes.len());
                assert!(
                    regions
                        .iter()
                        .any(|r| r.start <= a && a + n <= r.start + r.len),
                    "expert {e}'s bytes at {a:#x} are in no region of {regions:?}"
                );
            }
        }
    }
}

/// A store that counts the host's wake-up calls (`HostExperts::expect_work`).
struct CountingStore {
    inner: HostBackend<CpuBackend>,
    wakes: Arc<std::sync::atomic::AtomicUsize>,
}

struct CountingBuilder {
    inner: Box<dyn kimi_ops::offload::HostLayerBuilder>,
    wakes: Arc<std::sync::atomic::AtomicUsize>,
}

struct CountingExperts {
    inner: Arc<dyn kimi_ops::offload::HostExperts>,
    wakes: Arc<std::sync::atomic::AtomicUsize>,
}

impl kimi_ops::offload::HostExpertStore for CountingStore {
    fn begin_layer(&self, n: usize) -> Box<dyn kimi_ops::offload::HostLayerBuilder> {
        Box::new(CountingBuilder {
            inner: self.inner.begin_layer(n),
            wakes: self.wakes.clone(),
        })
    }
    fn name(&self) -> String {
        self.inner.name()
    }
}

impl kimi_ops::offload::HostLayerBuilder for CountingBuilder {
    fn add(
        &mut self,
        e: usize,
        w: kimi_ops::MlpWeights<kimi_ops::HostTensor<'_>>,
    ) -> kimi_ops::Result<()> {
        self.inner.add(e, w)
    }
    fn finish(self: Box<Self>) -> kimi_ops::Result<Arc<dyn kimi_ops::offload::HostExperts>> {
        Ok(Arc::new(CountingExperts {
            inner: self.inner.finish()?,
            wakes: self.wakes,
        }))
    }
}

impl kimi_ops::offload::HostExperts for CountingExperts {
    fn matrices(&self, e: usize) -> Option<kimi_ops::MlpWeights<kimi_ops::HostTensor<'_>>> {
        self.inner.matrices(e)
    }
    fn bytes(&self, e: usize) -> usize {
        self.inner.bytes(e)
    }
    fn out_width(&self) -> usize {
        self.inner.out_width()
    }
    fn expect_work(&self, within: std::time::Duration) {
        self.wakes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.expect_work(within);
    }
    fn compute(
        &self,
        x: &[f32],
        rows: usize,
        width: usize,
        pairs: &[kimi_ops::offload::ColdPair],
        act: kimi_ops::Activation,
    ) -> kimi_ops::Result<Vec<f32>> {
        self.inner.compute(x, rows, width, pairs, act)
    }
}

/// A tiered step wakes the host's threads ahead of its routes only while recent steps had
/// cold experts: with every host expert in a slot it never does, with no slots it does.
#[test]
fn the_host_is_woken_ahead_only_while_cold_experts_are_frequent() {
    use kimi_ops::offload::MissPolicy;
    let dir = fixture("kimi-linear/hub-f32-sharded");
    let ids = prompt(&dir);
    for (slots, miss) in [(6, MissPolicy::Copy), (0, MissPolicy::Host)] {
        let wakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ckpt = Checkpoint::open(&dir).unwrap();
        let options = LoadOptions {
            offload: Some(ExpertOffload {
                host: Experts(6),
                cache: Experts(slots),
                policy: CachePolicy {
                    miss,
                    ..CachePolicy::default()
                },
                store: Arc::new(CountingStore {
                    inner: HostBackend::new(Arc::new(backend())),
                    wakes: wakes.clone(),
                }),
            }),
            ..LoadOptions::default()
        };
        let model = KimiLinear::load_checkpoint_with(backend(), &ckpt, &options).unwrap();
        run(&model, &ids, 1);
        let c = model.offload_counts().unwrap();
        let woken = wakes.load(std::sync::atomic::Ordering::Relaxed);
        if slots == 6 {
            assert_eq!((c.cold_experts, woken), (0, 0), "{c:?}");
        } else {
            // Every step after the first cold one, in every bank.
            assert!(c.cold_experts > 0, "{c:?}");
            assert!(woken as u64 >= c.steps / 2, "{woken} wake-ups in {c:?}");
        }
    }
}

/// The logits of `ids` fed `step` tokens at a time through the checkpoint in `dir` with
/// `(host, slots, policy)` tiers, and the tiers' counts.
fn run_tiered(
    dir: &Path,
    (host, slots, policy): (usize, usize, CachePolicy),
    ids: &[u32],
    step: usize,
) -> (Vec<f32>, OffloadCounts) {
    let model = load_with(dir, Some((Experts(host), Experts(slots), policy)));
    let got = run(&model, ids, step);
    (got, model.offload_counts().unwrap())
}

/// The resident logits bit for bit where no pair was cold, else to f32 rounding.
fn assert_resident_logits(got: &[f32], want: &[f32], c: &OffloadCounts, label: &str) {
    if c.cold_pairs == 0 {
        assert_eq!(got, want, "{label}: not the resident bits");
    } else {
        let err = rel_err(got, want);
        assert!(err < 1e-5, "{label}: relative error {err:.2e}");
    }
    eprintln!("{label}");
}

/// Runs `case` on each tiered fixture (with its routed experts per layer) at steps of 1
/// and 16 tokens, given its prompt and the all-resident logits.
fn each_fixture_and_step(mut case: impl FnMut(&Path, usize, &[u32], usize, &[f32])) {
    for (dir, experts) in [
        ("kimi-linear/hub-f32-sharded", 6),
        ("kimi-k3/k3-tiny-7l", 8),
    ] {
        let dir = fixture(dir);
        let ids = prompt(&dir);
        let resident = load(&dir, None);
        for step in [1, 16] {
            let want = run(&resident, &ids, step);
            case(&dir, experts, &ids, step, &want);
        }
    }
}

/// `--offload-prefetch next-layer`: each tiered step predicts the next MoE layer's experts
/// (its router on this layer's input) and copies them into that layer's slots ahead. The
/// logits stay the resident model's (bit for bit where no expert is cold), the copies
/// ahead are counted, and some are used by the step they were made for.
#[test]
fn experts_copied_ahead_on_the_next_layers_prediction_change_no_logit() {
    use kimi_ops::offload::MissPolicy;
    each_fixture_and_step(|dir, experts, ids, step, want| {
        for (host, slots, miss) in [
            (experts, 1, MissPolicy::Copy),
            (experts, 2, MissPolicy::Host),
            (experts / 2, 2, MissPolicy::Auto),
            (experts, experts - 1, MissPolicy::Copy),
        ] {
            let policy = CachePolicy {
                miss,
                predict_next: true,
                ..CachePolicy::default()
            };
            let (got, c) = run_tiered(dir, (host, slots, policy), ids, step);
            let label = format!(
                "{} step {step}, {host} on the host, {slots} slots, {miss:?}: {c:?}",
                dir.display()
            );
            // Token by token the predictions move on; a chunk of 16 tokens may predict
            // every expert, leaving no slot to copy into.
            if step == 1 {
                assert!(c.ahead_fills > 0, "{label}: nothing copied ahead");
                assert!(c.ahead_used > 0, "{label}: no copy ahead used");
            }
            assert!(c.ahead_used <= c.ahead_fills, "{label}");
            assert!(c.hits >= c.ahead_used, "{label}");
            assert_resident_logits(&got, want, &c, &label);
        }
    });
}

/// `--offload-copy-behind`: the experts the host computed in a step are copied into slots
/// after it. Under `cpu` misses (which never fill a slot themselves) the cache then learns
/// them: later steps hit, the copies are counted, and the logits stay the resident model's
/// (bit for bit where nothing was cold).
#[test]
fn experts_copied_behind_the_host_fill_the_cache_and_change_no_logit() {
    use kimi_ops::offload::MissPolicy;
    each_fixture_and_step(|dir, experts, ids, step, want| {
        for (host, slots, miss, predict_next) in [
            (experts, 2, MissPolicy::Host, false),
            (experts, experts - 1, MissPolicy::Host, false),
            (experts / 2, 2, MissPolicy::Auto, false),
            (experts, 2, MissPolicy::Host, true),
        ] {
            let policy = CachePolicy {
                miss,
                predict_next,
                copy_behind: true,
                ..CachePolicy::default()
            };
            let (got, c) = run_tiered(dir, (host, slots, policy), ids, step);
            let label = format!(
                "{} step {step}, {host} on the host, {slots} slots, {miss:?}, \
                     predict_next {predict_next}: {c:?}",
                dir.display()
            );
            if miss == MissPolicy::Host && !predict_next {
                // Only the copies behind fill slots here.
                assert!(c.ahead_fills > 0, "{label}: nothing copied behind");
                assert_eq!(c.fills, 0, "{label}: a cpu miss filled a slot");
                assert!(c.ahead_used > 0 && c.hits > 0, "{label}: no copy used");
            }
            assert!(c.ahead_used <= c.ahead_fills, "{label}");
            assert!(c.cold_pairs > 0 || miss != MissPolicy::Host, "{label}");
            assert_resident_logits(&got, want, &c, &label);
        }
    });
}
