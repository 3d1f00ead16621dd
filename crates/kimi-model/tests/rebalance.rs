//! Moving routed experts between ranks while a model runs (`CausalLm::set_expert_ranks`,
//! behind `serve --enable-eplb`), on the CPU backend with ranks as threads: after the move
//! the logits are those of a model loaded with the new placement, bit for bit, also for a
//! sequence whose prompt went through before the move (to f32 rounding: its caches carry
//! the old placement's); moving back gives the first bits again; a rank that cannot read
//! its new experts leaves every rank as it was, and a later try succeeds.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kimi_core::ModelConfig;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::parallel::control::RankJob;
use kimi_model::parallel::{
    ExpertDispatch, ExpertLoads, ExpertPlacement, ExpertSplit, Shard, TensorParallel,
};
use kimi_model::{
    CausalLm, CheckpointSource, KimiLinear, LoadOptions, ModelError, WeightsReopener,
};
use kimi_weights::Checkpoint;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(path)
}

/// The checkpoint in `dir` opened again at every call.
fn reopener(dir: PathBuf) -> WeightsReopener {
    WeightsReopener::new(move |f| {
        let ckpt = Checkpoint::open(&dir).map_err(|e| ModelError::Input(e.to_string()))?;
        f(&CheckpointSource::new(&ckpt)?)
    })
}

/// The fixture in `dir` over two ranks whose whole experts are placed by `placement`,
/// rank `r` reading its new experts through `reopen[r]`.
fn two_ranks(
    dir: &Path,
    placement: Option<Arc<ExpertPlacement>>,
    dispatch: ExpertDispatch,
    reopen: [Option<WeightsReopener>; 2],
) -> TensorParallel<CpuBackend> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let source = CheckpointSource::new(&ckpt).unwrap();
    let parts = reopen
        .into_iter()
        .enumerate()
        .map(|(rank, reopen)| {
            let options = LoadOptions {
                shard: Shard {
                    rank,
                    world: 2,
                    experts: ExpertSplit::Experts,
                },
                expert_placement: placement.clone(),
                expert_dispatch: dispatch,
                reopen,
                ..LoadOptions::default()
            };
            let be = CpuBackend::with_quant_matmul(QuantMatmul::F32);
            KimiLinear::load_with(be, ckpt.config().clone(), &source, &options).unwrap()
        })
        .collect();
    TensorParallel::new(parts, Duration::from_secs(60)).unwrap()
}

/// Skewed counts for every MoE layer of `config`, and the placement that balances them,
/// named to keep what it can of the contiguous split.
fn skewed_placement(config: &ModelConfig) -> (ExpertLoads, Arc<ExpertPlacement>) {
    let e = config.moe.as_ref().unwrap().num_experts;
    let loads: ExpertLoads = config
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.ffn == kimi_core::config::Ffn::Moe)
        .map(|(i, _)| {
            (
                i,
                (0..e as u64)
                    .map(|x| (x * 37) % 11 + x + i as u64)
                    .collect(),
            )
        })
        .collect();
    let contiguous = ExpertPlacement::default().with_world(2);
    let p = ExpertPlacement::balanced(&loads, 2)
        .unwrap()
        .keeping(&contiguous);
    assert!(contiguous.moves_to(&p, &loads) > 0, "the test needs moves");
    (loads, Arc::new(p))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits of the prompt's first `k` tokens in one pass, then of the rest token by token,
/// calling `between` on the model after the first pass.
fn across(
    model: &mut dyn CausalLm<CpuBackend>,
    ids: &[u32],
    k: usize,
    between: impl FnOnce(&mut dyn CausalLm<CpuBackend>),
) -> Vec<f32> {
    let (mut pool, mut cache) = model.single_cache(ids.len()).unwrap();
    let mut out = common::pass(model, &mut pool, &mut cache, &ids[..k]);
    between(model);
    for &t in &ids[k..] {
        out.extend(common::pass(model, &mut pool, &mut cache, &[t]));
    }
    out
}

#[test]
fn moved_experts_give_the_logits_of_a_model_loaded_with_their_placement() {
    for dir in ["kimi-k3/k3-tiny-7l", "kimi-linear/native-f32-short"] {
        let dir = fixture(dir);
        let config = Checkpoint::open(&dir).unwrap().config().clone();
        let (_, target) = skewed_placement(&config);
        let ids: Vec<u32> = (0..9)
            .map(|i| ((i * 37 + 5) % config.vocab_size) as u32)
            .collect();
        for dispatch in [ExpertDispatch::AllReduce, ExpertDispatch::AllToAll] {
            let label = format!("{}, {dispatch:?}", dir.display());
            let mut moving = two_ranks(
                &dir,
                None,
                dispatch,
                [Some(reopener(dir.clone())), Some(reopener(dir.clone()))],
            );
            let mut placed = two_ranks(&dir, Some(target.clone()), dispatch, [None, None]);
            // The prompt's first part before the move, the rest after: the sequence's
            // caches carry over.
            let got = across(&mut moving, &ids, 5, |m| {
                m.set_expert_ranks(target.clone()).unwrap();
            });
            assert_eq!(moving.expert_ranks().as_deref(), Some(&*target), "{label}");
            let before = common::logits_in_steps(&placed, &ids[..5], 5);
            let want = across(&mut placed, &ids, 5, |_| {});
            // The first pass ran under the old placement, and its caches carry that
            // placement's rounding: the same to f32 rounding throughout.
            assert_eq!(before.len() * 9, got.len() * 5, "{label}");
            let err = common::rel_err(&got, &want);
            assert!(
                err < 1e-5,
                "{label}: across the move, relative error {err:.2e}"
            );
            // A fresh sequence: the bits of the model loaded with the placement, whole
            // prompt and token by token.
            for step in [9, 1] {
                let (a, b) = (
                    common::logits_in_steps(&moving, &ids, step),
                    common::logits_in_steps(&placed, &ids, step),
                );
                assert!(
                    bits(&a) == bits(&b),
                    "{label}, {step} tokens per pass: relative error {:.2e}",
                    common::rel_err(&a, &b)
                );
            }
        }
    }
}

#[test]
fn a_rank_that_cannot_read_its_new_experts_leaves_every_rank_as_it_was_until_it_can() {
    let dir = fixture("kimi-k3/k3-tiny-7l");
    let config = Checkpoint::open(&dir).unwrap().config().clone();
    let (_, target) = skewed_placement(&config);
    // Rank 1's disk fails once, then comes back.
    let tries = Arc::new(AtomicUsize::new(0));
    let flaky = {
        let good = reopener(dir.clone());
        let tries = tries.clone();
        WeightsReopener::new(move |f| match tries.fetch_add(1, Ordering::SeqCst) {
            0 => Err(ModelError::Input("the disk went away".into())),
            _ => good.with(f),
        })
    };
    let mut model = two_ranks(
        &dir,
        None,
        ExpertDispatch::AllToAll,
        [Some(reopener(dir.clone())), Some(flaky)],
    );
    let ids: Vec<u32> = (0..7).map(|i| (i * 5 + 1) as u32).collect();
    let before = common::logits_in_steps(&model, &ids, 7);
    let e = model
        .set_expert_ranks(target.clone())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1") && e.contains("the disk went away"),
        "{e}"
    );
    assert!(e.contains("0 of"), "no layer moved: {e}");
    let contiguous = ExpertPlacement::default().with_world(2);
    assert_eq!(model.expert_ranks().as_deref(), Some(&contiguous));
    assert!(model.failure().is_none());
    // Rank 0 staged its experts and dropped them: the model runs as before, bit for bit.
    assert!(bits(&common::logits_in_steps(&model, &ids, 7)) == bits(&before));
    // The next try moves them, and moving them back gives the first bits again.
    model.set_expert_ranks(target.clone()).unwrap();
    assert_eq!(model.expert_ranks().as_deref(), Some(&*target));
    let placed = two_ranks(
        &dir,
        Some(target.clone()),
        ExpertDispatch::AllToAll,
        [None, None],
    );
    assert!(
        bits(&common::logits_in_steps(&model, &ids, 7))
            == bits(&common::logits_in_steps(&placed, &ids, 7))
    );
    model.set_expert_ranks(Arc::new(contiguous)).unwrap();
    assert!(bits(&common::logits_in_steps(&model, &ids, 7)) == bits(&before));
    // A model loaded without a way to read its weights again says so.
    let mut fixed = two_ranks(&dir, None, ExpertDispatch::AllReduce, [None, None]);
    let e = fixed.set_expert_ranks(target).unwrap_err().to_string();
    assert!(e.contains("cannot be read again"), "{e}");
    // A whole model has no expert ranks.
    let ckpt = Checkpoint::open(&dir).unwrap();
    let whole = KimiLinear::load(CpuBackend::new(), &ckpt).unwrap();
    assert!(CausalLm::expert_ranks(&whole).is_none());
}

#[test]
fn a_placement_job_travels_as_bytes_and_a_bad_one_is_refused() {
    let owners = BTreeMap::from([(1, vec![1, 0, 0, 1]), (3, vec![0, 1, 1, 0])]);
    let p = ExpertPlacement::from_owners(2, owners).unwrap();
    let bytes = RankJob::StageExperts(Arc::new(p.clone())).encode();
    match RankJob::decode(&bytes).unwrap() {
        RankJob::StageExperts(q) => assert_eq!(*q, p),
        other => panic!("{other:?}"),
    }
    for job in [RankJob::CommitExperts, RankJob::DiscardExperts] {
        let back = RankJob::decode(&job.encode()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{job:?}"));
        assert!(!back.meets_in_collectives());
    }
    // Rank 1 holding three of four experts: refused at the receiving end.
    let mut w = kimi_ops::bootstrap::codec::Writer::new();
    w.u8(5).usize(2).usize(1).usize(0).u32s(&[1, 1, 1, 0]);
    let e = RankJob::decode(&w.finish()).unwrap_err().to_string();
    assert!(e.contains("[1, 3] experts per rank"), "{e}");
}
