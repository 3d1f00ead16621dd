//! The model against float64 reference logits.
//!
//! Kimi Linear fixtures come from `scripts/make_fixtures.py` (tiny random checkpoints in the
//! hub layout, made with `KimiLinearForCausalLM` of transformers 5.17; `native-saved-*`, the
//! same weights as its `save_pretrained` writes them, from `scripts/make_saved_fixtures.py`);
//! see `fixtures/kimi-linear/README.md`. Kimi K3 fixtures come from `scripts/make_k3_fixtures.py`
//! (tiny random checkpoints in the released K3 layout: the `language_model.` wrapper, shards,
//! MXFP4 experts), their logits from our float64 reference of the spec
//! (`scripts/k3_reference.py`), checked against mlx-lm's K3 model; see
//! `fixtures/kimi-k3/README.md`.
//! Every fixture is checked in three feed modes — whole-prompt prefill, 16-token chunks
//! through the caches and token-by-token decode — and by a greedy continuation. The feed
//! modes run through a paged cache whose block table is scattered and out of order, whose
//! block size does not divide the prompt and whose unused rows hold NaN. These checks run
//! on exact f32 products (`QuantMatmul::F32`); the K3 fixtures' MXFP4 experts on the integer
//! kernels have a check of their own.

use std::path::{Path, PathBuf};

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::{
    Batch, CachePool, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, LayerPool, SeqCache,
};
use kimi_ops::Backend;
use kimi_ops::{KdaMode, MlaMode, Segment};
use kimi_weights::Checkpoint;
use serde_json::Value;

/// f32 CPU arithmetic against a float64 reference.
const TOLERANCE: f64 = 1e-4;

fn fixtures_root(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../fixtures/{family}"))
}

/// Every committed fixture: Kimi Linear's and Kimi K3's.
fn fixture_dirs() -> Vec<PathBuf> {
    let mut all = Vec::new();
    for (family, at_least) in [("kimi-linear", 6), ("kimi-k3", 2)] {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_root(family))
            .unwrap_or_else(|e| panic!("fixtures/{family}: {e}"))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("reference.json").exists())
            .collect();
        dirs.sort();
        assert!(
            dirs.len() >= at_least,
            "expected the committed {family} fixtures, found {}",
            dirs.len()
        );
        all.extend(dirs);
    }
    all
}

/// Reads a little-endian float64 `.npy` matrix.
fn read_npy_f64(path: &Path) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(path).expect("npy readable");
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).expect("ascii header");
    assert!(
        header.contains("'<f8'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("shape");
    let shape: Vec<usize> = shape_text
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data = bytes[start + header_len..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    (shape, data)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

struct Fixture {
    name: String,
    model: KimiLinear<CpuBackend>,
    prompt: Vec<u32>,
    logits: Vec<f64>,
    vocab: usize,
    reference: Value,
}

fn load(dir: &Path) -> Fixture {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let ckpt = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = KimiLinear::load(CpuBackend::with_quant_matmul(QuantMatmul::F32), &ckpt)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt = ids(&reference["prompt_ids"]);
    let (shape, logits) = read_npy_f64(&dir.join("logits.npy"));
    assert_eq!(shape[0], prompt.len(), "{name}: logits rows");
    Fixture {
        name,
        vocab: shape[1],
        model,
        prompt,
        logits,
        reference,
    }
}

/// Tokens per block of the test pools: divides none of the fixture prompts.
const BLOCK_SIZE: usize = 3;

/// A pool of `num_blocks` blocks of [`BLOCK_SIZE`] tokens and `num_slots` slots whose
/// MLA rows and KDA states all hold NaN: anything read before it is written poisons the
/// logits.
fn poisoned_pool(
    model: &KimiLinear<CpuBackend>,
    num_blocks: usize,
    num_slots: usize,
) -> CachePool<CpuBackend> {
    let be = model.backend();
    let mut pool = model.new_pool(num_blocks, BLOCK_SIZE, num_slots).unwrap();
    let nan = |t: &mut <CpuBackend as Backend>::Tensor| {
        let shape = be.shape(t).to_vec();
        let n = shape.iter().product();
        *t = be.upload_f32(&shape, &vec![f32::NAN; n]).unwrap();
    };
    for layer in &mut pool.layers {
        match layer {
            LayerPool::Mla { latent } => nan(latent),
            LayerPool::Kda { conv, state } => {
                conv.iter_mut().flatten().for_each(nan);
                state.iter_mut().for_each(nan);
            }
            LayerPool::Kv { k, v } => {
                nan(k);
                nan(v);
            }
        }
    }
    pool
}

/// A poisoned pool for one sequence of up to `max_tokens` tokens and that sequence, whose
/// block table takes every other block, last first: `[2m-2, 2m-4, …, 0]`.
fn scattered(
    model: &KimiLinear<CpuBackend>,
    max_tokens: usize,
) -> (CachePool<CpuBackend>, SeqCache) {
    let m = max_tokens.div_ceil(BLOCK_SIZE);
    let pool = poisoned_pool(model, 2 * m, 3);
    let table = (0..m as u32).rev().map(|b| 2 * b).collect();
    (pool, SeqCache::new(2, table))
}

/// Logits of every position, feeding `step` tokens per forward pass through one cache.
fn run(model: &KimiLinear<CpuBackend>, ids: &[u32], step: usize, opts: ForwardOptions) -> Vec<f32> {
    let (mut pool, mut cache) = scattered(model, ids.len());
    let mut out = Vec::new();
    for chunk in ids.chunks(step) {
        let batch = Batch {
            tokens: chunk.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: chunk.len(),
            }],
            logits_rows: (0..chunk.len()).collect(),
            sampling: None,
        };
        out.extend(
            model
                .forward(&batch, &mut pool, &mut [&mut cache], opts)
                .unwrap()
                .logits,
        );
    }
    out
}

/// Rows whose greedy choice differs from the reference's, among rows where the reference's
/// best two logits are clearly apart (more than 1e-4 of the row's largest magnitude).
fn argmax_mismatches(got: &[f32], want: &[f64], vocab: usize) -> Vec<usize> {
    let mut bad = Vec::new();
    for (r, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        if w[order[0]] - w[order[1]] <= 1e-4 * scale {
            continue;
        }
        if kimi_ops::argmax_row(g) as usize != order[0] {
            bad.push(r);
        }
    }
    bad
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

fn check_modes(modes: &[(&str, usize, ForwardOptions)]) {
    for dir in fixture_dirs() {
        let f = load(&dir);
        for (label, step, opts) in modes {
            let step = if *step == 0 { f.prompt.len() } else { *step };
            let got = run(&f.model, &f.prompt, step, *opts);
            let err = rel_err(&got, &f.logits);
            eprintln!("{:<28} {label:<22} rel err {err:.2e}", f.name);
            assert!(
                err <= TOLERANCE,
                "{}: {label}: relative error {err:.3e} > {TOLERANCE:e}",
                f.name
            );
            let bad = argmax_mismatches(&got, &f.logits, f.vocab);
            assert!(
                bad.is_empty(),
                "{}: {label}: greedy choice differs at rows {bad:?}",
                f.name
            );
        }
        assert_eq!(f.vocab, f.model.config().vocab_size);
    }
}

#[test]
fn prefill_matches_reference() {
    check_modes(&[
        ("prefill", 0, ForwardOptions::default()),
        (
            "prefill recurrent",
            0,
            ForwardOptions {
                kda_mode: KdaMode::Recurrent,
                mla_mode: MlaMode::Absorbed,
                ..ForwardOptions::default()
            },
        ),
    ]);
}

#[test]
fn chunked_step_16_matches_reference() {
    check_modes(&[("step 16", 16, ForwardOptions::default())]);
}

#[test]
fn decode_step_1_matches_reference() {
    check_modes(&[
        ("step 1", 1, ForwardOptions::default()),
        (
            "step 1 expanded",
            1,
            ForwardOptions {
                kda_mode: KdaMode::Chunked,
                mla_mode: MlaMode::Expanded,
                ..ForwardOptions::default()
            },
        ),
    ]);
}

#[test]
fn greedy_continuation_matches_reference() {
    for dir in fixture_dirs() {
        let f = load(&dir);
        let greedy = &f.reference["greedy"];
        let mut ids = ids(&greedy["prompt_ids"]);
        let want = self::ids(&greedy["new_tokens"]);
        let (mut pool, mut cache) = f.model.single_cache(ids.len() + want.len()).unwrap();
        let mut feed = ids.clone();
        let mut got = Vec::new();
        while got.len() < want.len() {
            let batch = Batch {
                tokens: feed.clone(),
                segments: vec![Segment {
                    start: 0,
                    len: feed.len(),
                }],
                logits_rows: vec![feed.len() - 1],
                sampling: None,
            };
            let logits = f
                .model
                .forward(
                    &batch,
                    &mut pool,
                    &mut [&mut cache],
                    ForwardOptions::default(),
                )
                .unwrap()
                .logits;
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map(|(i, _)| i as u32)
                .unwrap();
            got.push(next);
            ids.push(next);
            feed = vec![next];
        }
        assert_eq!(got, want, "{}: greedy tokens", f.name);
    }
}

/// Feeds several sequences `step` tokens at a time, all in each forward pass, through one
/// shared pool; returns each sequence's logits of every position.
fn run_together(
    model: &KimiLinear<CpuBackend>,
    pool: &mut CachePool<CpuBackend>,
    seqs: &mut [(&[u32], &mut SeqCache)],
    step: usize,
) -> Vec<Vec<f32>> {
    let mut outs = vec![Vec::new(); seqs.len()];
    loop {
        let mut batch = Batch::default();
        let mut owners = Vec::new();
        for (i, (ids, seq)) in seqs.iter().enumerate() {
            let chunk = &ids[seq.num_tokens.min(ids.len())..];
            let chunk = &chunk[..chunk.len().min(step)];
            if chunk.is_empty() {
                continue;
            }
            let start = batch.tokens.len();
            batch.tokens.extend_from_slice(chunk);
            batch.segments.push(Segment {
                start,
                len: chunk.len(),
            });
            batch.logits_rows.extend(start..start + chunk.len());
            owners.push((i, chunk.len()));
        }
        if owners.is_empty() {
            return outs;
        }
        let mut refs: Vec<&mut SeqCache> = Vec::new();
        let mut rest: &mut [(&[u32], &mut SeqCache)] = seqs;
        let mut taken = 0;
        for &(i, _) in &owners {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(i + 1 - taken);
            refs.push(&mut *head[i - taken].1);
            rest = tail;
            taken = i + 1;
        }
        let logits = model
            .forward(&batch, pool, &mut refs, ForwardOptions::default())
            .unwrap()
            .logits;
        let vocab = model.config().vocab_size;
        let mut rows = logits.chunks_exact(vocab);
        for &(i, len) in &owners {
            for _ in 0..len {
                outs[i].extend_from_slice(rows.next().unwrap());
            }
        }
    }
}

/// Two sequences share a pool and every forward pass, their blocks interleaved and out of
/// order; then both finish and a third takes the first's slot and their blocks (stale rows
/// and state included). Each gets exactly the logits it gets alone in its own pool.
#[test]
fn sequences_sharing_a_pool_match_running_alone() {
    const STEP: usize = 7;
    for dir in fixture_dirs() {
        let f = load(&dir);
        let p = &f.prompt;
        let (a, b, c) = (&p[..p.len() / 2 + 1], &p[..], &p[3..p.len() - 2]);
        let blocks = |n: usize| n.div_ceil(BLOCK_SIZE);
        let num_blocks = blocks(a.len()) + blocks(b.len()) + 1;
        let mut pool = poisoned_pool(&f.model, num_blocks, 2);
        // Block k of the pool goes to A when k is odd (highest first), else to B.
        let mut ids: Vec<u32> = (0..num_blocks as u32).rev().collect();
        ids.sort_by_key(|k| k % 2 == 0);
        let mut seq_a = SeqCache::new(1, ids[..blocks(a.len())].to_vec());
        let mut seq_b = SeqCache::new(0, ids[blocks(a.len())..].to_vec());
        let together = run_together(
            &f.model,
            &mut pool,
            &mut [(a, &mut seq_a), (b, &mut seq_b)],
            STEP,
        );
        let alone = |ids: &[u32]| run(&f.model, ids, STEP, ForwardOptions::default());
        assert_eq!(together[0], alone(a), "{}: A", f.name);
        assert_eq!(together[1], alone(b), "{}: B", f.name);
        // A and B are finished: C reuses A's slot and their blocks, in another order.
        let mut table = seq_a.block_table.clone();
        table.reverse();
        table.extend(&seq_b.block_table);
        let mut seq_c = SeqCache::new(seq_a.slot, table);
        let got = run_together(&f.model, &mut pool, &mut [(c, &mut seq_c)], STEP);
        assert_eq!(got[0], alone(c), "{}: C", f.name);
    }
}

/// The Kimi K3 fixtures with `--int8-matmul`: the MXFP4 experts on the integer kernels
/// (activations rounded to int8 per 32 values), against the f32 products of the same
/// weights, by whole-prompt prefill and token-by-token decode. Top-k routing is
/// discontinuous (one flipped near-tie moves a token's logits by O(1)), so every expert is
/// made active, as in the q4_k_m int8 check of `gguf_kimi.rs`; what is left is the
/// activations' rounding (~0.3 % per expert product), which these tiny random models
/// amplify about tenfold: measured 4.7e-2 (k3-tiny-5l-b2) and 8.1e-2 (k3-tiny-7l) in both
/// feed modes on x86, and the same by decode on aarch64 (NEON; its prefill, row-major
/// above `INT8_MAX_TOKENS`, is the f32 product); bound 0.15. A kernel that lost the bias,
/// doubled the scale or swapped the nibbles misses it by far (measured 0.58 to 1.3).
#[test]
fn k3_int8_matmul_stays_near_the_f32_products() {
    const BOUND: f64 = 0.15;
    for dir in fixture_dirs()
        .into_iter()
        .filter(|d| d.parent().is_some_and(|p| p.ends_with("kimi-k3")))
    {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut config = ckpt.config().clone();
        let moe = config.moe.as_mut().expect("K3 has experts");
        moe.top_k = moe.num_experts;
        moe.topk_group = moe.num_expert_groups;
        let source = CheckpointSource::new(&ckpt).unwrap();
        let model = |mode| {
            let be = CpuBackend::with_quant_matmul(mode);
            KimiLinear::load_from(be, config.clone(), &source).unwrap()
        };
        let (exact, int8) = (model(QuantMatmul::F32), model(QuantMatmul::Int8));
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let prompt = ids(&reference["prompt_ids"]);
        for (label, step) in [("prefill", prompt.len()), ("step 1", 1)] {
            let opts = ForwardOptions::default();
            let want: Vec<f64> = run(&exact, &prompt, step, opts)
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let err = rel_err(&run(&int8, &prompt, step, opts), &want);
            eprintln!("{name:<28} int8 {label:<10} rel err vs f32 {err:.2e}");
            assert!(err <= BOUND, "{name}: int8 {label}: {err:.3e} > {BOUND}");
        }
    }
}
