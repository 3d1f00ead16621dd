//! A model split over ranks (threads of this process, on the CPU backend) against the whole
//! model: tensor parallelism over 2 and 4 ranks with the experts split inside, and expert
//! parallelism over 2 and 4 ranks (the experts' outputs summed by an all-reduce, or tokens
//! dispatched to the experts' owners by all-to-all), in every feed mode (the whole prompt
//! in one pass, chunks, token by token, and two sequences batched through a shared pool;
//! over 4 ranks a decode step has fewer tokens than ranks).
//!
//! The ranks sum partial products in another order than one rank does, so the logits agree
//! to f32 rounding (relative error below 1e-5, argmax equal), not bit for bit. The real
//! fixtures' heads split over 2 ranks; random-weight models of the same layouts with 4
//! heads cover 4 ranks.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kimi_core::{DType, ModelConfig};
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::parallel::{ExpertDispatch, ExpertSplit, Shard, TensorParallel};
use kimi_model::{
    Batch, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, LoadOptions, RandomWeights,
    SeqCache, WeightSource,
};
use kimi_ops::Segment;
use kimi_weights::Checkpoint;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(path)
}

fn backend() -> CpuBackend {
    CpuBackend::with_quant_matmul(QuantMatmul::F32)
}

fn load(config: &ModelConfig, source: &dyn WeightSource, shard: Shard) -> KimiLinear<CpuBackend> {
    load_dispatching(config, source, shard, ExpertDispatch::AllReduce)
}

fn load_dispatching(
    config: &ModelConfig,
    source: &dyn WeightSource,
    shard: Shard,
    expert_dispatch: ExpertDispatch,
) -> KimiLinear<CpuBackend> {
    let options = LoadOptions {
        shard,
        expert_dispatch,
        ..LoadOptions::default()
    };
    KimiLinear::load_with(backend(), config.clone(), source, &options).unwrap()
}

/// The whole model and the model split `world` ways with `experts` split so, their
/// outputs combined by `dispatch`.
fn pair(
    config: &ModelConfig,
    source: &dyn WeightSource,
    world: usize,
    experts: ExpertSplit,
    dispatch: ExpertDispatch,
) -> (KimiLinear<CpuBackend>, TensorParallel<CpuBackend>) {
    let whole = load(config, source, Shard::SINGLE);
    let parts = (0..world)
        .map(|rank| {
            load_dispatching(
                config,
                source,
                Shard {
                    rank,
                    world,
                    experts,
                },
                dispatch,
            )
        })
        .collect();
    let split = TensorParallel::new(parts, Duration::from_secs(60)).unwrap();
    (whole, split)
}

/// Logits of every position of `ids`, `step` tokens per pass.
fn run(model: &dyn CausalLm<CpuBackend>, ids: &[u32], step: usize) -> Vec<f32> {
    common::logits_in_steps(model, ids, step)
}

/// Two sequences batched through one pool: prefill both, then decode both together.
fn run_batched(model: &dyn CausalLm<CpuBackend>, a: &[u32], b: &[u32]) -> Vec<f32> {
    let block = 4;
    let mut pool = model.new_pool(32, block, 4).unwrap();
    let blocks = |first: u32, n: usize| (first..first + n.div_ceil(block) as u32).collect();
    let mut sa = SeqCache::new(1, blocks(0, a.len()));
    let mut sb = SeqCache::new(3, blocks(16, b.len()));
    let (pa, pb) = (a.len() - 2, b.len() - 2);
    let mut out = Vec::new();
    let prefill = Batch {
        tokens: [&a[..pa], &b[..pb]].concat(),
        segments: vec![
            Segment { start: 0, len: pa },
            Segment { start: pa, len: pb },
        ],
        logits_rows: vec![pa - 1, pa + pb - 1],
        sampling: None,
    };
    let y = model
        .forward(
            &prefill,
            &mut pool,
            &mut [&mut sa, &mut sb],
            ForwardOptions::default(),
        )
        .unwrap();
    out.extend(y.logits);
    for i in 0..2 {
        let step = Batch {
            tokens: vec![a[pa + i], b[pb + i]],
            segments: vec![Segment { start: 0, len: 1 }, Segment { start: 1, len: 1 }],
            logits_rows: vec![0, 1],
            sampling: None,
        };
        let y = model
            .forward(
                &step,
                &mut pool,
                &mut [&mut sa, &mut sb],
                ForwardOptions::default(),
            )
            .unwrap();
        out.extend(y.logits);
    }
    out
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

fn argmax_rows(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i)
        })
        .collect()
}

/// Every feed mode of the split model against the whole one.
fn check(
    label: &str,
    config: &ModelConfig,
    source: &dyn WeightSource,
    world: usize,
    experts: ExpertSplit,
) {
    check_dispatch(
        label,
        config,
        source,
        world,
        experts,
        ExpertDispatch::AllReduce,
    );
}

/// [`check`] with the experts' outputs combined by `dispatch`.
fn check_dispatch(
    label: &str,
    config: &ModelConfig,
    source: &dyn WeightSource,
    world: usize,
    experts: ExpertSplit,
    dispatch: ExpertDispatch,
) {
    let (whole, split) = pair(config, source, world, experts, dispatch);
    let vocab = config.vocab_size;
    let ids: Vec<u32> = (0..13).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
    let other: Vec<u32> = (0..9).map(|i| ((i * 11 + 3) % vocab) as u32).collect();
    let label = format!("{label}, {world} ranks, experts {experts:?}, {dispatch:?}");
    for step in [ids.len(), 5, 1] {
        let want = run(&whole, &ids, step);
        let got = run(&split, &ids, step);
        let err = rel_err(&got, &want);
        eprintln!("{label}, {step} tokens per pass: relative error {err:.2e}");
        assert!(
            err < 1e-5,
            "{label}, {step} tokens per pass: relative error {err:.2e}"
        );
        assert_eq!(
            argmax_rows(&got, vocab),
            argmax_rows(&want, vocab),
            "{label}, {step} tokens per pass"
        );
    }
    let want = run_batched(&whole, &ids, &other);
    let got = run_batched(&split, &ids, &other);
    let err = rel_err(&got, &want);
    assert!(err < 1e-5, "{label}, batched: relative error {err:.2e}");
    let traffic = split.lead().dispatch_traffic();
    match dispatch {
        ExpertDispatch::AllReduce => assert_eq!(traffic, None, "{label}"),
        ExpertDispatch::AllToAll => {
            let t = traffic.expect("the MoE layers dispatch");
            eprintln!("{label}: rank 0 dispatch traffic {t:?}");
            assert!(
                t.steps > 0 && t.pairs_sent > 0 && t.bytes_sent > 0,
                "{label}"
            );
        }
    }
}

/// Expert parallelism with each split `check` runs: outputs summed by an all-reduce and
/// tokens dispatched by all-to-all.
fn check_expert_parallel(
    label: &str,
    config: &ModelConfig,
    source: &dyn WeightSource,
    world: usize,
) {
    for dispatch in [ExpertDispatch::AllReduce, ExpertDispatch::AllToAll] {
        check_dispatch(label, config, source, world, ExpertSplit::Experts, dispatch);
    }
}

/// A fixture checkpoint's config and weights.
fn fixture_model(dir: &str) -> (ModelConfig, Checkpoint) {
    let ckpt = Checkpoint::open(&fixture(dir)).unwrap();
    (ckpt.config().clone(), ckpt)
}

#[test]
fn kimi_k3_fixture_over_two_ranks() {
    let (config, ckpt) = fixture_model("kimi-k3/k3-tiny-7l");
    let source = CheckpointSource::new(&ckpt).unwrap();
    check("k3-tiny-7l", &config, &source, 2, ExpertSplit::Tensor);
    check_expert_parallel("k3-tiny-7l", &config, &source, 2);
}

#[test]
fn kimi_linear_fixture_over_two_ranks() {
    let (config, ckpt) = fixture_model("kimi-linear/native-f32-short");
    let source = CheckpointSource::new(&ckpt).unwrap();
    check("native-f32-short", &config, &source, 2, ExpertSplit::Tensor);
    check_expert_parallel("native-f32-short", &config, &source, 2);
}

/// A fixture's config with 4 KDA and 4 MLA heads and widths that split 4 ways.
fn four_way(dir: &str, widths: &[(&str, u64)]) -> ModelConfig {
    let text = std::fs::read_to_string(fixture(dir).join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = match v.get_mut("text_config") {
        Some(t) => t,
        None => &mut v,
    };
    t["linear_attn_config"]["num_heads"] = 4.into();
    t["num_attention_heads"] = 4.into();
    t["num_key_value_heads"] = 4.into();
    for (k, n) in widths {
        t[*k] = (*n).into();
    }
    ModelConfig::from_json(&v).unwrap()
}

#[test]
fn kimi_linear_layout_over_four_ranks() {
    let config = four_way(
        "kimi-linear/hub-f32-sharded",
        &[
            ("intermediate_size", 64),
            ("moe_intermediate_size", 16),
            ("num_experts", 8),
        ],
    );
    let source = RandomWeights {
        dtype: DType::F32,
        seed: 7,
    };
    check(
        "Kimi Linear, random",
        &config,
        &source,
        4,
        ExpertSplit::Tensor,
    );
    for world in [4, 2] {
        check_expert_parallel("Kimi Linear, random", &config, &source, world);
    }
}

/// Tied embeddings split by vocabulary rows serve both ends: each rank looks up its rows
/// and multiplies the final states by the same rows, whose logits are gathered.
#[test]
fn tied_embeddings_split_by_vocabulary_rows() {
    let mut config = four_way(
        "kimi-linear/hub-f32-sharded",
        &[
            ("intermediate_size", 64),
            ("moe_intermediate_size", 16),
            ("num_experts", 8),
        ],
    );
    config.tie_word_embeddings = true;
    let source = RandomWeights {
        dtype: DType::F32,
        seed: 5,
    };
    check("tied embeddings", &config, &source, 4, ExpertSplit::Tensor);
}

/// A vocabulary that does not divide over the ranks keeps the embedding and the LM head
/// whole on every rank (where it divides, every other test splits both by vocabulary rows,
/// sums the embedding rows and gathers the logits).
#[test]
fn a_vocabulary_that_does_not_divide_keeps_the_head_whole() {
    let config = four_way(
        "kimi-linear/hub-f32-sharded",
        &[
            ("intermediate_size", 64),
            ("moe_intermediate_size", 16),
            ("num_experts", 8),
            ("vocab_size", 258),
        ],
    );
    let source = RandomWeights {
        dtype: DType::F32,
        seed: 11,
    };
    check(
        "vocabulary of 258",
        &config,
        &source,
        4,
        ExpertSplit::Tensor,
    );
}

#[test]
fn kimi_k3_layout_over_four_ranks() {
    // MXFP4 experts split inside need whole 32-value scale blocks per rank: 128 / 4.
    let config = four_way(
        "kimi-k3/k3-tiny-7l",
        &[("intermediate_size", 128), ("moe_intermediate_size", 128)],
    );
    let source = RandomWeights {
        dtype: DType::F32,
        seed: 11,
    };
    check("K3, random", &config, &source, 4, ExpertSplit::Tensor);
    check_expert_parallel("K3, random", &config, &source, 4);
}

/// Whole experts placed by skewed routing counts (each rank a scattered set of ids) give
/// the logits of one rank too, summed by an all-reduce or dispatched by all-to-all.
#[test]
fn experts_placed_by_measured_load_give_the_same_logits() {
    use kimi_model::parallel::{ExpertLoads, ExpertPlacement};
    let (config, ckpt) = fixture_model("kimi-k3/k3-tiny-7l");
    let source = CheckpointSource::new(&ckpt).unwrap();
    // Every MoE layer: expert e got (e * 37) % 11 + e tokens.
    let loads: ExpertLoads = (1..config.layers.len())
        .map(|l| (l, (0..8u64).map(|e| (e * 37) % 11 + e + l as u64).collect()))
        .collect();
    let placement = Arc::new(ExpertPlacement::balanced(&loads, 2).unwrap());
    assert!(
        placement.local(1, 0, 8) != vec![0, 1, 2, 3],
        "the test needs a scattered placement"
    );
    let whole = load(&config, &source, Shard::SINGLE);
    let ids: Vec<u32> = (0..11)
        .map(|i| ((i * 37 + 5) % config.vocab_size) as u32)
        .collect();
    for dispatch in [ExpertDispatch::AllReduce, ExpertDispatch::AllToAll] {
        let parts = (0..2)
            .map(|rank| {
                let options = LoadOptions {
                    shard: Shard {
                        rank,
                        world: 2,
                        experts: ExpertSplit::Experts,
                    },
                    expert_placement: Some(placement.clone()),
                    expert_dispatch: dispatch,
                    ..LoadOptions::default()
                };
                KimiLinear::load_with(backend(), config.clone(), &source, &options).unwrap()
            })
            .collect();
        let split = TensorParallel::new(parts, Duration::from_secs(60)).unwrap();
        for step in [11, 1] {
            let err = rel_err(&run(&split, &ids, step), &run(&whole, &ids, step));
            assert!(
                err < 1e-5,
                "{dispatch:?}, {step} tokens per pass: relative error {err:.2e}"
            );
        }
    }
}

#[test]
fn all_to_all_dispatch_without_expert_parallelism_is_refused() {
    let (config, ckpt) = fixture_model("kimi-k3/k3-tiny-7l");
    let source = CheckpointSource::new(&ckpt).unwrap();
    for shard in [
        Shard::SINGLE,
        Shard {
            rank: 0,
            world: 2,
            experts: ExpertSplit::Tensor,
        },
    ] {
        let options = LoadOptions {
            shard,
            expert_dispatch: ExpertDispatch::AllToAll,
            ..LoadOptions::default()
        };
        let e = KimiLinear::load_with(backend(), config.clone(), &source, &options)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("needs expert parallelism"), "{e}");
    }
}

#[test]
fn parts_that_do_not_split_are_refused_naming_what() {
    let (config, ckpt) = fixture_model("kimi-linear/hub-f32-sharded");
    let source = CheckpointSource::new(&ckpt).unwrap();
    let options = LoadOptions {
        shard: Shard {
            rank: 0,
            world: 2,
            experts: ExpertSplit::Tensor,
        },
        ..LoadOptions::default()
    };
    let e = KimiLinear::load_with(backend(), config, &source, &options)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("the MLA heads (3) does not split over 2 ranks"),
        "{e}"
    );
}

#[test]
fn a_split_part_without_its_collective_is_an_error_not_a_wrong_answer() {
    let (config, ckpt) = fixture_model("kimi-k3/k3-tiny-7l");
    let source = CheckpointSource::new(&ckpt).unwrap();
    let part = load(
        &config,
        &source,
        Shard {
            rank: 0,
            world: 2,
            experts: ExpertSplit::Tensor,
        },
    );
    let (mut pool, mut cache) = part.single_cache(4).unwrap();
    let batch = Batch {
        tokens: vec![1, 2],
        segments: vec![Segment { start: 0, len: 2 }],
        logits_rows: vec![1],
        sampling: None,
    };
    let e = part
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs only with its collective"), "{e}");
}
