//! Expert parallelism with each rank's experts in tiers (the way full Kimi K3 fits one
//! node: its experts spread over the GPUs, and beyond their memory): two ranks as threads on
//! the CPU backend, each keeping most of its share in host memory behind a tiny cache, the
//! tokens dispatched to the experts' owners by all-to-all. The logits agree with the whole
//! model's to f32 rounding in every feed mode, and rank 0's tiers run every path (hits,
//! fills, cold experts; the others' run alike but report nowhere). Experts in tiers move
//! between ranks too: each rank places its new share in tiers again, and the logits stay.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::parallel::{ExpertDispatch, ExpertSplit, Shard, TensorParallel};
use kimi_model::{
    CausalLm, CheckpointSource, ExpertOffload, KimiLinear, LoadOptions, ModelError, OffloadAmount,
    WeightsReopener,
};
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

/// `host` of each rank's experts per layer in host memory behind `slots` cache slots.
fn tiers(host: usize, slots: usize) -> ExpertOffload {
    ExpertOffload {
        host: OffloadAmount::Experts(host),
        cache: OffloadAmount::Experts(slots),
        policy: CachePolicy::default(),
        store: Arc::new(HostBackend::new(Arc::new(backend()))),
    }
}

/// The checkpoint in `dir` opened again at every call (the experts a rank takes on).
fn reopener(dir: PathBuf) -> WeightsReopener {
    WeightsReopener::new(move |f| {
        let ckpt = Checkpoint::open(&dir).map_err(|e| ModelError::Input(e.to_string()))?;
        f(&CheckpointSource::new(&ckpt)?)
    })
}

fn two_ranks(
    dir: &Path,
    dispatch: ExpertDispatch,
    offload: ExpertOffload,
) -> kimi_model::Result<TensorParallel<CpuBackend>> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let source = CheckpointSource::new(&ckpt).unwrap();
    let parts = (0..2)
        .map(|rank| {
            let options = LoadOptions {
                shard: Shard {
                    rank,
                    world: 2,
                    experts: ExpertSplit::Experts,
                },
                expert_dispatch: dispatch,
                offload: Some(offload.clone()),
                reopen: Some(reopener(dir.to_path_buf())),
                ..LoadOptions::default()
            };
            KimiLinear::load_with(backend(), ckpt.config().clone(), &source, &options)
        })
        .collect::<kimi_model::Result<Vec<_>>>()?;
    TensorParallel::new(parts, Duration::from_secs(60))
}

#[test]
fn each_rank_with_its_experts_in_tiers_gives_the_whole_models_logits() {
    let mut fills = 0;
    for dir in ["kimi-k3/k3-tiny-7l", "kimi-linear/native-f32-short"] {
        let dir = fixture(dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let whole = KimiLinear::load(backend(), &ckpt).unwrap();
        let e = ckpt.config().moe.as_ref().unwrap().num_experts;
        let ids: Vec<u32> = (0..11)
            .map(|i| ((i * 37 + 5) % ckpt.config().vocab_size) as u32)
            .collect();
        // Each rank holds e/2 experts per layer, all in host memory behind one slot.
        let split = two_ranks(&dir, ExpertDispatch::AllToAll, tiers(e / 2, 1)).unwrap();
        for step in [11, 3, 1] {
            let err = common::rel_err(
                &common::logits_in_steps(&split, &ids, step),
                &common::logits_in_steps(&whole, &ids, step),
            );
            assert!(
                err < 1e-5,
                "{}, {step} tokens per pass: relative error {err:.2e}",
                dir.display()
            );
        }
        // Rank 0's tiers ran: hits and cold experts on each, fills on one at least.
        let counts = split.offload_counts().expect("tier counts");
        assert!(
            counts.hits > 0 && counts.cold_pairs > 0,
            "{}: {counts:?}",
            dir.display()
        );
        fills += counts.fills;
        let placement = split.expert_placement();
        assert!(!placement.is_empty(), "the start log's placement");
        // Experts in tiers move: each rank's new share is placed in tiers again (the
        // same budgets), and the logits stay the whole model's.
        let mut split = split;
        use kimi_model::parallel::ExpertPlacement;
        let moe = ckpt.config().layers.iter().enumerate();
        let alternating = moe
            .filter(|(_, l)| l.ffn == kimi_core::config::Ffn::Moe)
            .map(|(i, _)| (i, (0..e).map(|x| x % 2).collect()))
            .collect();
        let swapped = Arc::new(ExpertPlacement::from_owners(2, alternating).unwrap());
        split.set_expert_ranks(Arc::clone(&swapped)).unwrap();
        assert_eq!(split.expert_ranks().as_deref(), Some(&*swapped));
        let before = split.offload_counts().expect("tier counts");
        for step in [11, 1] {
            let err = common::rel_err(
                &common::logits_in_steps(&split, &ids, step),
                &common::logits_in_steps(&whole, &ids, step),
            );
            assert!(
                err < 1e-5,
                "{}, moved, {step} tokens per pass: relative error {err:.2e}",
                dir.display()
            );
        }
        let after = split.offload_counts().expect("tier counts after the move");
        assert!(
            after.cold_pairs > 0,
            "{}: {after:?} (before {before:?})",
            dir.display()
        );
    }
    assert!(fills > 0, "no slot was filled");
}

#[test]
fn experts_in_tiers_under_expert_parallelism_without_dispatch_are_refused() {
    let dir = fixture("kimi-k3/k3-tiny-7l");
    let e = match two_ranks(&dir, ExpertDispatch::AllReduce, tiers(2, 1)) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("--expert-dispatch all-to-all"), "{e}");
}
