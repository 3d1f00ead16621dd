//! Correctness and smoke check of the CUDA backend on a GPU, built here and run on the
//! device machine (`scripts/cuda/device-check.sh`).
//!
//! 1. Every `Backend` op of `CudaBackend` against `CpuBackend` on random inputs at several
//!    shapes: relative error `||got-ref|| / ||ref||` per op and output.
//! 2. Every fixture in `fixtures/kimi-linear/` loaded on the GPU: logits in three feed modes
//!    (whole prompt, 16-token steps, 1-token steps) against the float64 `logits.npy`.
//! 3. A Kimi-Linear-48B-A3B-shaped model with random bf16 weights: greedy generation with a
//!    NaN/Inf check, decode latency and prefill throughput.
//!
//! 4. With `profile` (only when named): per-op device time of decode and 8K prefill.
//! 5. With `mla-bench` (only when named): the MLA op alone on real dimensions: expanded
//!    prefill of 8192 tokens (the f32 and the tensor-core kernel, the op and the attention
//!    kernel alone, with its error against the f32 kernel), absorbed decode at contexts 1K/32K/128K for 1 and 64
//!    sequences, with the implied latent-read bandwidth.
//! 6. With `kda-bench` (only when named): chunked KDA at T=8192 (H=32/64/96, D=128; the
//!    tensor-core kernels with hi + lo and with bf16 operands, and the f32 kernels) and the
//!    KDA decode step per layer (fused and composed, B=1 and 64), synchronised wall time;
//!    then Kimi K3's: 96 heads with the safe gate, chunked at T=8192 (gate + rule) and the
//!    decode step at B=1, 64 and 256 (`bench/fla_kda.py --k3-heads 96` is the peer).
//! 12. With `k3-big [N_TOKENS]` (only when named; default 1000): Kimi K3 at full
//!     width cut to `K3_BIG_LAYERS` layers (default 4): part 3's graph check, N greedy
//!     tokens with all logits finite, 1K and 8K prefills.
//! 13. With `offload` (only when named): every fixture with its experts in tiers (host
//!     RAM, device slots, cold ones on the CPU), page-locked and staged fills, against the
//!     same model all resident (`check_parts/offload.rs`).
//! 14. With `nccl` (only when named): every collective of `NcclComm` against `ThreadGroup`
//!     on CPU ranks, bit for bit, at world 1 and at world = visible GPUs; abort and a missing
//!     rank end in errors, not hangs (`check_parts/nccl.rs`).
//! 15. With `split` (only when named): every fixture split over two ranks on GPU 0 (tensor
//!     parallel, expert parallel), the ranks threads meeting in `ThreadGroup`, against the
//!     same model on one rank: the CUDA side of the sharded model without a second GPU
//!     (`check_parts/split.rs`).
//!
//! 14. With `quant-bench` (only when named): the packed-weight GEMV (Q4Z, Q8Z, F8S) at the
//!     48B model's decode shapes against the bf16 GEMV, GB/s and the fraction of the
//!     measured HBM read bandwidth (`check_parts/quant_bench.rs`). `quant-ops` runs only
//!     the packed-weight op cases of 1.
//!
//! 11. With `k3-moe-bench` (only when named): one Kimi K3 LatentMoE layer at full width
//!     (896 MXFP4 experts top-16), decode batches against the HBM roofline
//!     (`check_parts/k3_layer.rs`). `k3-ops` runs only the K3 op cases of 1.
//!
//! 15. With `fp8-kv` (only when named): MLA over an FP8 E4M3 latent cache
//!     (`--kv-cache-dtype fp8`) against the CPU's FP8 cache: the op at several shapes (pool
//!     values identical, outputs within 1e-3), then every Kimi Linear fixture's logits, CUDA
//!     graphs and greedy tokens (`check_parts/fp8_kv.rs`).
//!
//! `kda-ops` and `moe-ops` (only when named) run just the KDA or MoE op cases of 1. `sample-bench` (only when
//! named) times sampling on the device against the argmax and copying logits to the host.
//! 7. With `tune` (only when named): decode step times of the 48B-shaped model with CUDA
//!    graphs, programmatic dependent launch and the memory pool's release threshold
//!    toggled, in one process; then the graph check.
//! 8. With `ncu-step` (only when named): one op-by-op decode step per `NCU_BATCH` inside a
//!    profiler range, for `ncu --profile-from-start off` (`scripts/cuda/ncu_summary.py`).
//! 9. With `gemv-bench` (only when named): the small-batch bf16 GEMV kernels at the 48B
//!    model's decode shapes, streaming from HBM, with and without programmatic launch.
//! 10. With `moe-bench` (only when named): one MoE layer of the 48B model (256 experts,
//!     top-8, hidden 2304, expert width 1024) at prefill sizes, the three grouped expert GEMMs
//!     and both precisions, against the single-stage kernel's output.
//!
//! Part 3 starts by decoding 40 steps at batch 1, 8 and 64 twice, through CUDA graphs and
//! op by op, and requires the logits to be bit-identical.
//!
//! Usage: `check [ops] [kda-ops] [fixtures] [big N_TOKENS] [profile] [mla-bench] [kda-bench]
//! [tune] [gemv-bench] [ncu-step] [moe-bench] [sample-bench] [k3-ops] [k3-moe-bench] [k3-big N_TOKENS] [offload] [split] [quant-ops] [quant-bench] [fp8-kv]`
//! (default: 1-3, 1000 tokens).

use std::collections::HashSet;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kimi_core::config::{KdaGate, ModelConfig};
use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_cuda::{
    CudaBackend, GemmPrecision, GemvKernel, GroupedMoeKernel, KdaChunkKernel, KdaStages,
    MlaPrefillKernel,
};
use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, KimiLinear, RandomWeights, SeqCache};
use kimi_ops::{
    Backend, HostTensor, KdaMode, KdaStepInputs, KdaStepWeights, MlaDims, MlaMode, MlpWeights,
    MoeRouting, MoeWeights, PagedSeq, RowSampling, Segment,
};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

#[path = "check_parts/fp8_kv.rs"]
mod fp8_kv;
#[path = "../tests/common/k3_cases.rs"]
mod k3_cases;
#[path = "check_parts/k3_layer.rs"]
mod k3_layer;
#[path = "check_parts/nccl.rs"]
mod nccl;
#[path = "check_parts/offload.rs"]
mod offload;
#[path = "../tests/common/op_cases.rs"]
mod op_cases;
#[path = "check_parts/quant_bench.rs"]
mod quant_bench;
#[path = "../tests/common/quant_cases.rs"]
mod quant_cases;
#[path = "check_parts/split.rs"]
mod split;
use op_cases::{rel_err, CpuRun, CudaRun};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = args.is_empty();
    let tokens_after = |stage: &str| {
        args.iter()
            .position(|a| a == stage)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(1000usize)
    };
    let (big_tokens, k3_big_tokens) = (tokens_after("big"), tokens_after("k3-big"));
    // (name, runs by default, what it runs), in order.
    type Stage<'a> = (&'static str, bool, Box<dyn Fn() -> Res<()> + 'a>);
    let stages: Vec<Stage> = vec![
        ("mla-bench", false, Box::new(mla_bench)),
        ("profile", false, Box::new(profile_big)),
        ("tune", false, Box::new(tune)),
        ("gemv-bench", false, Box::new(gemv_bench)),
        ("moe-bench", false, Box::new(moe_bench)),
        ("moe-decode", false, Box::new(moe_decode_bench)),
        ("ncu-step", false, Box::new(ncu_step)),
        ("decode-modes", false, Box::new(decode_modes)),
        ("kda-bench", false, Box::new(kda_bench)),
        ("sample-bench", false, Box::new(sample_bench)),
        (
            "kda-ops",
            false,
            Box::new(|| check_ops(op_cases::kda_cases())),
        ),
        (
            "moe-ops",
            false,
            Box::new(|| {
                let moe = op_cases::cases()
                    .into_iter()
                    .filter(|(name, _)| name.starts_with("moe"))
                    .collect();
                check_ops(moe)
            }),
        ),
        ("k3-ops", false, Box::new(|| check_ops(k3_cases::cases()))),
        (
            "quant-ops",
            false,
            Box::new(|| check_ops(quant_cases::cases())),
        ),
        ("quant-bench", false, Box::new(quant_bench::quant_bench)),
        ("k3-moe-bench", false, Box::new(k3_layer::k3_moe_bench)),
        (
            "ops",
            true,
            Box::new(|| {
                check_ops(
                    op_cases::cases()
                        .into_iter()
                        .chain(k3_cases::cases())
                        .chain(quant_cases::cases())
                        .collect(),
                )
            }),
        ),
        ("fixtures", true, Box::new(check_fixtures)),
        ("big", true, Box::new(|| check_big(big_tokens))),
        ("k3-big", false, Box::new(|| check_k3_big(k3_big_tokens))),
        ("offload", false, Box::new(offload::check_offload)),
        ("nccl", false, Box::new(nccl::check_nccl)),
        ("split", false, Box::new(split::check_split)),
        ("fp8-kv", false, Box::new(fp8_kv::check_fp8_kv)),
    ];
    let mut failed = false;
    for (name, default, run) in &stages {
        let named = args.iter().any(|a| a == name);
        if named || (*default && all) {
            if let Err(e) = run() {
                println!("{name}: ERROR {e}");
                failed = true;
            }
        }
    }
    println!(
        "{}",
        if failed {
            "RESULT: FAILED"
        } else {
            "RESULT: done"
        }
    );
}

fn check_ops(cases: Vec<(String, op_cases::Case)>) -> Res<()> {
    println!("== 1. ops: CudaBackend vs CpuBackend, relative error per output");
    let cpu_only = std::env::var_os("CHECK_CPU_ONLY").is_some();
    let cuda = match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if cpu_only => {
            println!("no device ({e}); running the CPU side only");
            None
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(c) = &cuda {
        println!("device: {}", c.name());
    }
    // The reference multiplies in f32: the CPU's default integer path for packed weights
    // (MXFP4, ggml blocks) rounds the activations to int8.
    let cpu = CpuRun(CpuBackend::with_quant_matmul(QuantMatmul::F32));
    let mut failures = Vec::new();
    for (name, c) in &cases {
        let want = match c(&cpu) {
            Ok(v) => v,
            Err(e) => {
                println!("{name:<50} CPU ERROR {e}");
                continue;
            }
        };
        let Some(cuda) = &cuda else {
            println!("{name:<50} CPU ok ({} outputs)", want.len());
            continue;
        };
        match c(&CudaRun(cuda)) {
            Ok(got) => {
                let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| rel_err(g, w)).collect();
                let text: Vec<String> = errs.iter().map(|e| format!("{e:.2e}")).collect();
                // The tolerance of tests/backend_ops.rs.
                let tol = op_cases::tolerance(name);
                let ok = errs.len() == want.len() && errs.iter().all(|&e| e <= tol);
                println!(
                    "{name:<60} rel err {}{}",
                    text.join(" "),
                    if ok { "" } else { "  FAIL" }
                );
                if !ok {
                    failures.push(name.clone());
                }
            }
            Err(e) => {
                println!("{name:<60} CUDA ERROR {e}");
                failures.push(name.clone());
            }
        }
        let _ = std::io::stdout().flush();
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} op cases over their tolerance or failing: {failures:?}",
            failures.len()
        )
        .into())
    }
}

// ---------------------------------------------------------------- fixtures

fn read_npy_f64(path: &Path) -> Res<(Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path)?;
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len])?;
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or("npy shape")?
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data = bytes[start + header_len..]
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    Ok((shape, data))
}

/// Logits of every position, feeding `step` tokens per forward pass through a paged cache
/// of 5-token blocks whose table takes every other block of the pool, last first.
fn run_model<B: Backend>(
    m: &dyn CausalLm<B>,
    ids: &[u32],
    step: usize,
    opts: ForwardOptions,
) -> Res<Vec<f32>> {
    let num_blocks = ids.len().div_ceil(5);
    let mut pool = m.new_pool(2 * num_blocks, 5, 1)?;
    let table = (0..num_blocks as u32).rev().map(|b| 2 * b).collect();
    let mut cache = SeqCache::new(0, table);
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
            m.forward(&batch, &mut pool, &mut [&mut cache], opts)?
                .logits,
        );
    }
    Ok(out)
}

/// The fixtures with a reference (`fixtures/kimi-linear/*`, `fixtures/kimi-k3/*`), sorted.
fn fixture_dirs() -> Res<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for root in ["fixtures/kimi-linear", "fixtures/kimi-k3"] {
        dirs.extend(
            std::fs::read_dir(root)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.join("reference.json").exists()),
        );
    }
    dirs.sort();
    Ok(dirs)
}

/// A fixture's prompt (its `reference.json`'s `prompt_ids`).
fn fixture_prompt(dir: &Path) -> Res<Vec<u32>> {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    Ok(reference["prompt_ids"]
        .as_array()
        .ok_or("prompt_ids")?
        .iter()
        .filter_map(|x| x.as_u64().map(|v| v as u32))
        .collect())
}

fn check_fixtures() -> Res<()> {
    println!(
        "== 2. fixtures: CUDA logits vs the float64 references (transformers for Kimi Linear, \
         ours from the spec for K3; rel err)"
    );
    let dirs = fixture_dirs()?;
    let absorbed = ForwardOptions {
        kda_mode: KdaMode::Auto,
        mla_mode: MlaMode::Absorbed,
        ..ForwardOptions::default()
    };
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let res = (|| -> Res<String> {
            let ckpt = kimi_weights::Checkpoint::open(&dir)?;
            let model = KimiLinear::load(CudaBackend::new(0)?, &ckpt)?;
            let prompt = fixture_prompt(&dir)?;
            let (_, want) = read_npy_f64(&dir.join("logits.npy"))?;
            let mut parts = vec![];
            for (label, step, opts, prec) in [
                (
                    "prefill",
                    prompt.len(),
                    ForwardOptions::default(),
                    GemmPrecision::Split,
                ),
                (
                    "step16",
                    16,
                    ForwardOptions::default(),
                    GemmPrecision::Split,
                ),
                ("step1", 1, ForwardOptions::default(), GemmPrecision::Split),
                (
                    "prefill-absorbed",
                    prompt.len(),
                    absorbed,
                    GemmPrecision::Split,
                ),
                (
                    "HALF prefill",
                    prompt.len(),
                    ForwardOptions::default(),
                    GemmPrecision::Half,
                ),
                (
                    "HALF step1",
                    1,
                    ForwardOptions::default(),
                    GemmPrecision::Half,
                ),
            ] {
                model.backend().set_gemm_precision(prec);
                let got = run_model(&model, &prompt, step, opts)?;
                parts.push(format!("{label} {:.2e}", fixture_err(&got, &want)));
                if label == "prefill" {
                    parts.push(format!(
                        "argmax {}",
                        argmax_agreement(&got, &want, model.config().vocab_size)
                    ));
                }
            }
            // The chunked KDA's f32 kernels beside its default tensor-core ones.
            model.backend().set_gemm_precision(GemmPrecision::Split);
            model
                .backend()
                .update_kernel_config(|c| c.kda_chunk = KdaChunkKernel::F32)?;
            let got = run_model(&model, &prompt, prompt.len(), ForwardOptions::default());
            model
                .backend()
                .update_kernel_config(|c| c.kda_chunk = KdaChunkKernel::Auto)?;
            parts.push(format!("prefill kda-f32 {:.2e}", fixture_err(&got?, &want)));
            Ok(format!("T={} | {}", prompt.len(), parts.join(" | ")))
        })();
        match res {
            Ok(s) => println!("{name:<28} {s}"),
            Err(e) => println!("{name:<28} ERROR {e}"),
        }
        let _ = std::io::stdout().flush();
    }
    Ok(())
}

/// Relative error of logits against a float64 reference (infinite if the lengths differ).
fn fixture_err(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// `matching/positions`: rows of `vocab` logits whose argmax equals the reference's.
fn argmax_agreement(got: &[f32], want: &[f64], vocab: usize) -> String {
    if vocab == 0 || got.len() != want.len() {
        return "n/a".into();
    }
    let best = |row: &mut dyn Iterator<Item = f64>| {
        row.enumerate()
            .fold(
                (0, f64::NEG_INFINITY),
                |b, (i, v)| if v > b.1 { (i, v) } else { b },
            )
            .0
    };
    let rows = want.len() / vocab;
    let same = (0..rows)
        .filter(|r| {
            let span = r * vocab..(r + 1) * vocab;
            best(&mut got[span.clone()].iter().map(|&v| v as f64))
                == best(&mut want[span].iter().copied())
        })
        .count();
    format!("{same}/{rows}")
}

// ---------------------------------------------------------------- 48B-shaped model

fn argmax(v: &[f32]) -> (usize, bool) {
    let mut best = 0;
    let mut finite = true;
    for (i, x) in v.iter().enumerate() {
        if !x.is_finite() {
            finite = false;
        }
        if *x > v[best] {
            best = i;
        }
    }
    (best, finite)
}

fn forward_last<B: Backend>(
    model: &KimiLinear<B>,
    pool: &mut CachePool<B>,
    cache: &mut SeqCache,
    toks: &[u32],
) -> Res<Vec<f32>> {
    let batch = Batch {
        tokens: toks.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: toks.len(),
        }],
        logits_rows: vec![toks.len() - 1],
        sampling: None,
    };
    Ok(model
        .forward(&batch, pool, &mut [cache], ForwardOptions::default())?
        .logits)
}

/// Greedy generation of `num_tokens` from a 16-token prompt, timing each decode step.
fn generate(model: &KimiLinear<CudaBackend>, num_tokens: usize, vocab: usize) -> Res<()> {
    let prompt: Vec<u32> = (0..16).map(|i| (i * 9973 % vocab) as u32).collect();
    let (mut pool, mut cache) = model.single_cache(prompt.len() + num_tokens)?;
    let logits = forward_last(model, &mut pool, &mut cache, &prompt)?;
    let (mut next, mut all_finite) = argmax(&logits);
    let mut generated = vec![next as u32];
    let t1 = Instant::now();
    let mut step_ms = Vec::with_capacity(num_tokens);
    for _ in 1..num_tokens {
        let ts = Instant::now();
        let logits = forward_last(model, &mut pool, &mut cache, &[next as u32])?;
        step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
        let (n, f) = argmax(&logits);
        all_finite &= f;
        next = n;
        generated.push(n as u32);
    }
    let dt = t1.elapsed().as_secs_f64();
    step_ms.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: usize| step_ms.get(step_ms.len() * q / 100).copied().unwrap_or(0.0);
    println!(
        "generated {} tokens greedily: all logits finite = {all_finite}; {:.1} tok/s; decode step median {:.2} ms, p10 {:.2} ms, p90 {:.2} ms",
        generated.len(),
        (generated.len() - 1) as f64 / dt,
        pick(50),
        pick(10),
        pick(90),
    );
    println!(
        "first generated ids: {:?}",
        &generated[..generated.len().min(16)]
    );
    let distinct: HashSet<u32> = generated.iter().copied().collect();
    println!("distinct generated ids: {}", distinct.len());
    let _ = std::io::stdout().flush();
    Ok(())
}

/// Sequences decoded together, one token each per step, in a pool of 16-token blocks
/// (sequence s takes blocks s, s + batch, s + 2 batch, ...).
struct DecodeRun {
    pool: CachePool<CudaBackend>,
    caches: Vec<SeqCache>,
    next: Vec<u32>,
}

impl DecodeRun {
    /// `batch` sequences after their 16-token prompts, with room for `steps` more tokens.
    fn new(model: &KimiLinear<CudaBackend>, batch: usize, steps: usize) -> Res<Self> {
        Self::with_prompt(model, batch, 16, steps)
    }

    /// `batch` sequences after `prompt_len`-token prompts, with room for `steps` more.
    fn with_prompt(
        model: &KimiLinear<CudaBackend>,
        batch: usize,
        prompt_len: usize,
        steps: usize,
    ) -> Res<Self> {
        let vocab = model.config().vocab_size;
        let per_seq = (prompt_len + steps).div_ceil(16);
        let mut pool = model.new_pool(batch * per_seq, 16, batch)?;
        let mut caches: Vec<SeqCache> = (0..batch)
            .map(|s| {
                let table = (0..per_seq).map(|k| (k * batch + s) as u32).collect();
                SeqCache::new(s as u32, table)
            })
            .collect();
        let mut next = Vec::with_capacity(batch);
        for (s, c) in caches.iter_mut().enumerate() {
            let prompt: Vec<u32> = (0..prompt_len)
                .map(|i| ((i + 31 * s) * 9973 % vocab) as u32)
                .collect();
            let logits = forward_last(model, &mut pool, c, &prompt)?;
            next.push(argmax(&logits).0 as u32);
        }
        Ok(Self { pool, caches, next })
    }

    /// One decode step of every sequence, feeding `tokens`; returns the logits.
    fn step(&mut self, model: &KimiLinear<CudaBackend>, tokens: &[u32]) -> Res<Vec<f32>> {
        let batch = self.caches.len();
        let b = Batch {
            tokens: tokens.to_vec(),
            segments: (0..batch).map(|s| Segment { start: s, len: 1 }).collect(),
            logits_rows: (0..batch).collect(),
            sampling: None,
        };
        let mut refs: Vec<&mut SeqCache> = self.caches.iter_mut().collect();
        Ok(model
            .forward(&b, &mut self.pool, &mut refs, ForwardOptions::default())?
            .logits)
    }
}

/// The Kimi-Linear-48B-A3B config with random bf16 weights on `backend`.
/// The 48B-shaped model with random weights: `CHECK_CONFIG` names another config (a cut one
/// on an H100), `CHECK_DTYPE=q4z` makes its linear layers 4-bit as AWQ has them.
fn big_model<B: Backend>(backend: B) -> Res<KimiLinear<B>> {
    let path = std::env::var("CHECK_CONFIG").unwrap_or_else(|_| {
        "crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json".into()
    });
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let config = ModelConfig::from_json_str(&text)?;
    let dtype = match std::env::var("CHECK_DTYPE").as_deref() {
        Ok("q4z") => DType::Q4Z,
        Ok("bf16") | Err(_) => DType::BF16,
        Ok(other) => return Err(format!("CHECK_DTYPE={other}: expected bf16 or q4z").into()),
    };
    Ok(KimiLinear::load_from(
        backend,
        config,
        &RandomWeights { dtype, seed: 0 },
    )?)
}

/// Decode step times of the 48B-shaped model after 1K-token prompts, in one process so that
/// the variants compare on the same machine state: CUDA graphs off/on at batch 1, 8 and 64,
/// and at batch 64 the routed-expert GEMV's row blocks per CTA.
fn tune() -> Res<()> {
    let model = big_model(CudaBackend::new(0)?)?;
    let be = model.backend();
    let (warm, timed) = (3, 12);
    // (label, CUDA graphs, programmatic dependent launch, GEMV kernel, pool keeps memory)
    let auto = GemvKernel::Auto;
    let variants: [(&str, bool, bool, GemvKernel, bool); 4] = [
        (
            "graphs off, pdl on, pool releases",
            false,
            true,
            auto,
            false,
        ),
        ("graphs off, pdl on, pool keeps   ", false, true, auto, true),
        ("graphs on,  pdl on, pool keeps   ", true, true, auto, true),
        (
            "graphs off, pdl off, pool keeps  ",
            false,
            false,
            auto,
            true,
        ),
    ];
    for batch in [1usize, 8, 64] {
        // One set of sequences for every variant (their contexts grow by a few hundred
        // tokens over the run); variants alternate, twice over.
        let total = 2 * variants.len() * (warm + timed);
        let mut run = DecodeRun::with_prompt(&model, batch, 1024, total)?;
        for round in 0..2 {
            for &(label, graphs, pdl, gemv, keep) in &variants {
                be.set_cuda_graphs(graphs);
                be.set_pdl(pdl);
                be.update_kernel_config(|c| c.gemv = gemv)?;
                be.set_pool_keeps_memory(keep)?;
                let ms = step_times(&model, &mut run, warm, timed)?;
                let med = ms[ms.len() / 2];
                println!(
                    "tune round {round} B={batch:<3} {label}: step median {med:.3} ms = {:.1} tok/s (min {:.3}, max {:.3})",
                    batch as f64 / med * 1e3,
                    ms[0],
                    ms[ms.len() - 1],
                );
                let _ = std::io::stdout().flush();
            }
        }
    }
    be.set_cuda_graphs(true);
    be.set_pdl(true);
    be.update_kernel_config(|c| c.gemv = GemvKernel::Auto)?;
    println!(
        "graph passes op-by-op/captured/replayed {:?}",
        be.graph_pass_counts()
    );
    if let Some(why) = be.last_graph_recapture() {
        println!("last recapture: {why}");
    }
    check_graphs(&model, &[1, 8, 64])
}

/// The 48B model's MoE shapes: hidden, expert width, experts, top-k.
const MOE_48B: (usize, usize, usize, usize) = (2304, 1024, 256, 8);

/// One MoE layer of the 48B shapes with random bf16 weights (a shared expert of the routed
/// width, a correction bias) and its ungrouped routing.
fn moe_48b_layer(
    be: &CudaBackend,
    r: &mut op_cases::Rng,
) -> Res<(MoeWeights<kimi_cuda::CudaTensor>, MoeRouting)> {
    let (d, inter, e, top_k) = MOE_48B;
    let router = op_cases::weight(
        be,
        &[e, d],
        &r.vec(e * d, (d as f32).powf(-0.5)),
        DType::BF16,
    )?;
    let experts = (0..e)
        .map(|_| op_cases::mlp_weights(be, r, d, inter))
        .collect::<Res<Vec<_>>>()?;
    let shared = Some(op_cases::mlp_weights(be, r, d, inter)?);
    let w = MoeWeights {
        router,
        correction_bias: Some(be.upload_f32(&[e], &r.vec(e, 0.1))?),
        experts,
        shared,
    };
    let routing = MoeRouting {
        top_k,
        num_groups: 1,
        topk_group: 1,
        renormalize: true,
        scaling: 2.5,
        weights_use_bias: false,
    };
    Ok((w, routing))
}

/// One 48B-shaped MoE layer at prefill sizes: each grouped expert GEMM (the CUTLASS one, the
/// pipelined `moe_mma_*` and the single-stage `moe_grouped_mma`) in both precisions, synchronised
/// wall time of the whole op (routing, shared expert and combine included) and the routed
/// experts' useful TFLOP/s; outputs compared with the single-stage kernel in Split.
fn moe_bench() -> Res<()> {
    println!("== MoE layer: 256 experts top-8 (groups 1), hidden 2304, width 1024, bf16 weights");
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let (d, inter, _, top_k) = MOE_48B;
    let mut r = op_cases::Rng(11);
    let (w, routing) = moe_48b_layer(&be, &mut r)?;
    for n in [256usize, 512, 1024, 8192] {
        let x = be.upload_f32(&[n, d], &r.vec(n * d, 1.0))?;
        let flops = (n * top_k * 3 * d * inter * 2) as f64;
        be.update_kernel_config(|c| {
            c.precision = GemmPrecision::Split;
            c.grouped_moe = GroupedMoeKernel::SingleStage;
        })?;
        let reference = be.to_f32(&be.moe(&x, &w, &routing)?.0)?;
        for (label, kernel) in [
            ("single-stage", GroupedMoeKernel::SingleStage),
            ("pipelined   ", GroupedMoeKernel::Pipelined),
            ("cutlass     ", GroupedMoeKernel::Cutlass),
        ] {
            for prec in [GemmPrecision::Split, GemmPrecision::Half] {
                be.update_kernel_config(|c| {
                    c.grouped_moe = kernel;
                    c.precision = prec;
                })?;
                let y = be.to_f32(&be.moe(&x, &w, &routing)?.0)?;
                let err = rel_err(&y, &reference);
                let reps = 5;
                be.synchronize()?;
                let t0 = Instant::now();
                for _ in 0..reps {
                    be.moe(&x, &w, &routing)?;
                }
                be.synchronize()?;
                let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
                println!(
                    "moe n={n:<5} {label} {prec:?}: {ms:.3} ms = {:.0} TFLOP/s routed (useful), rel err vs single-stage Split {err:.2e}",
                    flops / ms * 1e-9
                );
                let _ = std::io::stdout().flush();
            }
        }
    }
    be.update_kernel_config(|c| {
        c.precision = GemmPrecision::Split;
        c.grouped_moe = GroupedMoeKernel::Auto;
    })?;
    Ok(())
}

/// One decode-sized MoE layer of the 48B shapes (256 experts top-8, hidden 2304, width
/// 1024, a shared expert of the same width), routing included, at 1 and 8 tokens: the
/// streamed experts (`moe_stream_1`) against the shared MLP + `moe_expert_gemv`, 32 calls
/// inside a replayed pass, as in a decode step. Each call has fresh activations, so its 8
/// of 256 experts (127 MB with the shared one) are mostly cold in the 50 MB L2.
fn moe_decode_bench() -> Res<()> {
    println!("== MoE decode layer: 256 experts top-8 + shared, hidden 2304, width 1024, bf16");
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let (d, inter, e, _) = MOE_48B;
    let mut r = op_cases::Rng(13);
    let (w, routing) = moe_48b_layer(&be, &mut r)?;
    let calls = 32usize;
    let mut key = 1u64 << 41;
    for n in [1usize, 8] {
        // (8 tokens: routing and experts are one-token kernels; all rows take the others.)
        let xs = (0..calls)
            .map(|_| be.upload_f32(&[n, d], &r.vec(n * d, 1.0)))
            .collect::<kimi_ops::Result<Vec<_>>>()?;
        be.update_kernel_config(|c| {
            c.moe_stream = false;
            c.moe_route_one = false;
        })?;
        let reference = be.to_f32(&be.moe(&xs[0], &w, &routing)?.0)?;
        // Weights read per call: the distinct experts of the first call, plus the shared
        // expert and the router.
        let ids = be.expert_ids(&be.moe(&xs[0], &w, &routing)?.1)?;
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let bytes = ((distinct.len() + 1) * 3 * d * inter * 2 + e * d * 4) as f64;
        let mut line = format!("moe decode n={n} ({} experts):", distinct.len());
        // (label, one-launch routing, streamed experts, gate/up and down in one launch)
        for (label, route_one, stream, layer) in [
            ("3-launch routing + expert_gemv", false, false, false),
            ("route_one + expert_gemv", true, false, false),
            ("route_one + stream", true, true, false),
            ("route_one + layer", true, true, true),
        ] {
            be.update_kernel_config(|c| {
                c.moe_route_one = route_one;
                c.moe_stream = stream;
                c.moe_layer = layer;
            })?;
            let err = rel_err(&be.to_f32(&be.moe(&xs[0], &w, &routing)?.0)?, &reference);
            if err > 1e-5 {
                return Err(format!("moe decode n={n} {label}: rel err {err:.2e}").into());
            }
            key += 1;
            let pass = || -> kimi_ops::Result<()> {
                be.replayable(Some(key), || -> kimi_ops::Result<()> {
                    for x in &xs {
                        drop(be.moe(x, &w, &routing)?);
                    }
                    Ok(())
                })?
            };
            let secs = time_calls(&be, 2, 10, pass)? / calls as f64;
            line += &format!(
                "  {label} {:6.2} us ({:4.2} TB/s, rel err {err:.1e})",
                secs * 1e6,
                bytes / secs / 1e12
            );
        }
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    be.update_kernel_config(|c| {
        c.moe_stream = true;
        c.moe_route_one = true;
        c.moe_layer = true;
    })?;
    Ok(())
}

/// The streamed kernels' default shape (`StreamShape::default()` in kimi-cuda): tile KiB,
/// shared memory KiB per CTA.
const STREAM_DEFAULT_SHAPE: (usize, usize) = (40, 200);

/// The small-batch bf16 GEMV at the 48B model's decode shapes, inside a replayed pass (as in
/// a decode step): each shape rotates over enough copies of its matrix (>= 320 MB) that
/// every call streams from HBM, not L2. Both kernels, with and without programmatic
/// dependent launch, at 1 and 8 tokens.
fn gemv_bench() -> Res<()> {
    println!("== GEMV: bf16 weights, f32 activations, back-to-back calls in a CUDA graph");
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let mut r = op_cases::Rng(7);
    let shapes: [(&str, usize, usize); 11] = [
        ("kda in (q,k,v,f,g,b)", 12576, 2304),
        ("kda f_b / g_b", 4096, 128),
        ("o_proj", 2304, 4096),
        ("mla q_proj", 6144, 2304),
        ("mla kv_a", 576, 2304),
        ("shared gate / up", 1024, 2304),
        ("shared down", 2304, 1024),
        ("router", 256, 2304),
        ("dense gate / up", 9216, 2304),
        ("dense down", 2304, 9216),
        ("lm_head", 163840, 2304),
    ];
    // (label, GEMV kernel, PDL, streamed kernel's (tile KiB, shared memory KiB per CTA; 0
    // keeps the current value)).
    type Variant = (&'static str, GemvKernel, bool, (usize, usize));
    let variants: [Variant; 6] = [
        ("regs", GemvKernel::Register, true, (0, 0)),
        ("bulk", GemvKernel::Bulk, true, (0, 0)),
        ("s40/200", GemvKernel::Stream, true, (40, 200)),
        ("s20/200", GemvKernel::Stream, true, (20, 200)),
        ("s32/128", GemvKernel::Stream, true, (32, 128)),
        ("auto", GemvKernel::Auto, true, STREAM_DEFAULT_SHAPE),
    ];
    let mut key = 1u64 << 40;
    for (name, o, k) in shapes {
        let bytes = o * k * 2;
        let copies = (320usize << 20).div_ceil(bytes).clamp(1, 256);
        let host = r.vec(o * k, 0.05);
        let ws: Vec<_> = (0..copies)
            .map(|_| op_cases::weight(&be, &[o, k], &host, DType::BF16))
            .collect::<Res<_>>()?;
        drop(host);
        let calls = copies.max(32);
        for n in [1usize, 8] {
            let x = be.upload_f32(&[n, k], &r.vec(n * k, 1.0))?;
            let mut line = format!("gemv {name:<22} o={o:<6} k={k:<5} n={n}:");
            be.update_kernel_config(|c| c.gemv = GemvKernel::Register)?;
            let reference = be.to_f32(&be.matmul(&x, &ws[0])?)?;
            for &(label, kernel, pdl, (tile, cta)) in &variants {
                be.update_kernel_config(|c| {
                    c.gemv = kernel;
                    c.pdl = pdl;
                    if tile > 0 {
                        c.stream_shape.tile_bytes = tile << 10;
                    }
                    if cta > 0 {
                        c.stream_shape.cta_bytes = cta << 10;
                    }
                })?;
                let err = rel_err(&be.to_f32(&be.matmul(&x, &ws[0])?)?, &reference);
                if err > 1e-5 {
                    return Err(format!("gemv {name} n={n} {label}: rel err {err:.2e}").into());
                }
                key += 1;
                let pass = || -> kimi_ops::Result<()> {
                    be.replayable(Some(key), || -> kimi_ops::Result<()> {
                        for i in 0..calls {
                            drop(be.matmul(&x, &ws[i % copies])?);
                        }
                        Ok(())
                    })?
                };
                let secs = time_calls(&be, 2, 10, pass)? / calls as f64;
                line += &format!(
                    "  {label} {:6.2} us {:5.2} TB/s",
                    secs * 1e6,
                    bytes as f64 / secs / 1e12
                );
            }
            println!("{line}");
            let _ = std::io::stdout().flush();
        }
    }
    let (tile, cta) = STREAM_DEFAULT_SHAPE;
    be.update_kernel_config(|c| {
        c.gemv = GemvKernel::Auto;
        c.pdl = true;
        c.stream_shape.tile_bytes = tile << 10;
        c.stream_shape.cta_bytes = cta << 10;
    })?;
    Ok(())
}

/// Wall times (ms, sorted) of `timed` decode steps of `run` after `warm` untimed ones, each
/// step from a synchronised device.
fn step_times(
    model: &KimiLinear<CudaBackend>,
    run: &mut DecodeRun,
    warm: usize,
    timed: usize,
) -> Res<Vec<f64>> {
    let be = model.backend();
    let mut ms = Vec::with_capacity(timed);
    for i in 0..warm + timed {
        let t = run.next.clone();
        be.synchronize()?;
        let t0 = Instant::now();
        run.step(model, &t)?;
        if i >= warm {
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(ms)
}

/// Decode at B=1 of the 48B-shaped model in both precisions, after short, 1K and 8K
/// prompts, with the bf16 prefill kernels (CUTLASS experts, FlashInfer MLA) turned off one
/// at a time and with two MLA decode chunk sizes: which setting makes a step slower, in one
/// process.
fn decode_modes() -> Res<()> {
    let model = big_model(CudaBackend::new(0)?)?;
    let be = model.backend();
    // (label, precision, prompt, MoE grouped GEMM, MLA prefill kernel, MLA decode chunk)
    type Mode = (
        &'static str,
        GemmPrecision,
        usize,
        GroupedMoeKernel,
        MlaPrefillKernel,
        usize,
    );
    use GemmPrecision::{Half, Split};
    let (moe, no_cutlass) = (GroupedMoeKernel::Auto, GroupedMoeKernel::Pipelined);
    let (mla, no_fi) = (MlaPrefillKernel::Auto, MlaPrefillKernel::NoFlashInfer);
    let modes: [Mode; 10] = [
        ("split, 16-token prompt       ", Split, 16, moe, mla, 64),
        ("half,  16-token prompt       ", Half, 16, moe, mla, 64),
        ("split, 1K prompt             ", Split, 1024, moe, mla, 64),
        ("split, 1K, MLA chunks of 256 ", Split, 1024, moe, mla, 256),
        ("split, 8K, MLA chunks of 64  ", Split, 8192, moe, mla, 64),
        ("split, 8K, MLA chunks of 256 ", Split, 8192, moe, mla, 256),
        ("half,  1K prompt             ", Half, 1024, moe, mla, 64),
        (
            "half,  1K prompt, no CUTLASS ",
            Half,
            1024,
            no_cutlass,
            mla,
            64,
        ),
        ("half,  1K prompt, no FlashInf", Half, 1024, moe, no_fi, 64),
        ("split, 16-token prompt again ", Split, 16, moe, mla, 64),
    ];
    for (label, prec, prompt, moe, mla, chunk) in modes {
        be.update_kernel_config(|c| {
            c.precision = prec;
            c.grouped_moe = moe;
            c.mla_prefill = mla;
            c.mla_decode_min_chunk = chunk;
        })?;
        let (warm, timed) = (4, 16);
        let mut run = DecodeRun::with_prompt(&model, 1, prompt, warm + timed)?;
        let ms = step_times(&model, &mut run, warm, timed)?;
        println!(
            "decode-modes {label}: B=1 step median {:.3} ms (min {:.3}, max {:.3})",
            ms[ms.len() / 2],
            ms[0],
            ms[ms.len() - 1]
        );
        let _ = std::io::stdout().flush();
    }
    be.update_kernel_config(|c| {
        c.precision = Split;
        c.grouped_moe = GroupedMoeKernel::Auto;
        c.mla_prefill = MlaPrefillKernel::Auto;
        c.mla_decode_min_chunk = 64;
    })?;
    Ok(())
}

/// One decode step of the 48B-shaped model at each `NCU_BATCH` (default 1; `none` for no
/// decode step: ncu drops empty variables) after 16-token prompts, op by op, inside a
/// profiler range: run under `ncu --profile-from-start off` to time every kernel of exactly
/// one step.
fn ncu_step() -> Res<()> {
    let model = big_model(CudaBackend::new(0)?)?;
    let be = model.backend();
    be.set_cuda_graphs(false);
    // NCU_HALF=1: bf16 activations (`--bf16-activations`).
    if std::env::var_os("NCU_HALF").is_some() {
        be.set_gemm_precision(GemmPrecision::Half);
    }
    let batches: Vec<usize> = std::env::var("NCU_BATCH")
        .unwrap_or_else(|_| "1".into())
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    for batch in batches {
        let mut run = DecodeRun::new(&model, batch, 4)?;
        for _ in 0..2 {
            let t = run.next.clone();
            run.step(&model, &t)?;
        }
        be.synchronize()?;
        // SAFETY: plain profiler API calls bracketing one synchronised step.
        unsafe { cudarc::driver::sys::cuProfilerStart() };
        let t = run.next.clone();
        run.step(&model, &t)?;
        be.synchronize()?;
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuProfilerStop() };
        println!("ncu-step: profiled one decode step at batch {batch}");
    }
    // NCU_PREFILL=T: one T-token prompt, after a warm-up prompt, in the range too.
    if let Some(t) = std::env::var("NCU_PREFILL")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let vocab = model.config().vocab_size;
        let toks: Vec<u32> = (0..t).map(|i| (i * 7919 % vocab) as u32).collect();
        let mut warm = model.single_cache(t)?;
        forward_last(&model, &mut warm.0, &mut warm.1, &toks)?;
        let mut c = model.single_cache(t)?;
        be.synchronize()?;
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuProfilerStart() };
        forward_last(&model, &mut c.0, &mut c.1, &toks)?;
        be.synchronize()?;
        // SAFETY: as above.
        unsafe { cudarc::driver::sys::cuProfilerStop() };
        println!("ncu-step: profiled one prefill of {t} tokens");
    }
    if std::env::var_os("NCU_GRAPHS").is_some() {
        check_graphs(&model, &[64])?;
    }
    Ok(())
}

/// Decode steps replayed through CUDA graphs against the same steps issued op by op: two
/// identical runs stepped alternately, graphs on for one and off for the other.
fn check_graphs(model: &KimiLinear<CudaBackend>, batches: &[usize]) -> Res<()> {
    let be = model.backend();
    let vocab = model.config().vocab_size;
    let steps = 40;
    let mut failures = vec![];
    for &batch in batches {
        let mut graphed = DecodeRun::new(model, batch, steps)?;
        let mut eager = DecodeRun::new(model, batch, steps)?;
        let before = be.graph_pass_counts();
        let (mut identical, mut worst) = (0, 0f64);
        for _ in 0..steps {
            let tokens = graphed.next.clone();
            be.set_cuda_graphs(true);
            let g = graphed.step(model, &tokens)?;
            be.set_cuda_graphs(false);
            let e = eager.step(model, &tokens)?;
            identical += usize::from(g == e);
            worst = worst.max(rel_err(&g, &e));
            for (s, row) in g.chunks_exact(vocab).enumerate() {
                graphed.next[s] = argmax(row).0 as u32;
            }
        }
        be.set_cuda_graphs(true);
        let after = be.graph_pass_counts();
        let counts: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        let ok = identical == steps && counts[2] > 0;
        println!(
            "graphs B={batch}: {identical}/{steps} steps bit-identical to op by op, worst rel err \
             {worst:.2e}; graph passes op-by-op/captured/replayed {counts:?} -> {}",
            if ok { "ok" } else { "FAIL" }
        );
        if let Some(why) = be.last_graph_recapture() {
            println!("  last recapture: {why}");
        }
        let _ = std::io::stdout().flush();
        if !ok {
            failures.push(batch);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("graphed decode differs or never replayed at batch {failures:?}").into())
    }
}

/// `batch` sequences (16-token prompts) decoded together for `steps` steps: one forward of
/// `batch` one-token segments per step.
fn decode_batch(
    model: &KimiLinear<CudaBackend>,
    batch: usize,
    steps: usize,
    vocab: usize,
) -> Res<()> {
    let mut run = DecodeRun::new(model, batch, steps)?;
    let mut step_ms = Vec::with_capacity(steps);
    let mut all_finite = true;
    for _ in 0..steps {
        let tokens = run.next.clone();
        let ts = Instant::now();
        let logits = run.step(model, &tokens)?;
        step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
        for (s, row) in logits.chunks_exact(vocab).enumerate() {
            let (n, f) = argmax(row);
            all_finite &= f;
            run.next[s] = n as u32;
        }
    }
    step_ms.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: usize| step_ms.get(step_ms.len() * q / 100).copied().unwrap_or(0.0);
    println!(
        "decode batch {batch} x {steps} steps: finite = {all_finite}; step median {:.2} ms ({:.1} tok/s), p10 {:.2} ms, p90 {:.2} ms",
        pick(50),
        batch as f64 * 1e3 / pick(50),
        pick(10),
        pick(90),
    );
    let _ = std::io::stdout().flush();
    Ok(())
}

fn check_big(num_tokens: usize) -> Res<()> {
    println!("== 3. Kimi-Linear-48B-A3B-shaped model, random bf16 weights");
    let backend = CudaBackend::new(0)?;
    let t0 = Instant::now();
    let model = big_model(backend)?;
    let be = model.backend();
    be.synchronize()?;
    let (free, total) = be.mem_info()?;
    println!(
        "loaded in {:.1} s; device memory used {:.1} GiB of {:.1} GiB",
        t0.elapsed().as_secs_f64(),
        (total - free) as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    let _ = std::io::stdout().flush();
    let vocab = model.config().vocab_size;
    check_graphs(&model, &[1, 8, 64])?;
    for (prec, tokens) in [
        (GemmPrecision::Split, num_tokens),
        (GemmPrecision::Half, num_tokens.min(300)),
    ] {
        be.set_gemm_precision(prec);
        println!("-- GEMM precision {prec:?}");
        generate(&model, tokens, vocab)?;
        if prec == GemmPrecision::Split {
            decode_batch(&model, 8, 100, vocab)?;
        }
        for len in [1024usize, 8192] {
            let toks: Vec<u32> = (0..len).map(|i| (i * 7919 % vocab) as u32).collect();
            let (mut pool, mut c) = model.single_cache(len)?;
            be.synchronize()?;
            let ts = Instant::now();
            let logits = forward_last(&model, &mut pool, &mut c, &toks)?;
            be.synchronize()?;
            let s = ts.elapsed().as_secs_f64();
            let (_, f) = argmax(&logits);
            println!(
                "prefill {len} tokens: {:.3} s = {:.0} tok/s (finite {f})",
                s,
                len as f64 / s
            );
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}

/// Kimi K3 at full width (hidden 7168, 96 KDA heads, gated MLA, 896 MXFP4 experts top-16 in
/// the 3584 latent, AttnRes), random weights, cut to `K3_BIG_LAYERS` layers (default 4: three
/// KDA and one MLA): decode graphs against op-by-op, `num_tokens` greedy tokens with every
/// logit checked finite, and 1K / 8K prefills.
fn check_k3_big(num_tokens: usize) -> Res<()> {
    let layers: usize = std::env::var("K3_BIG_LAYERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    println!("== 3b. Kimi K3 at full width, {layers} layers, random weights");
    let text = std::fs::read_to_string("crates/kimi-core/tests/data/kimi-k3-trimmed.config.json")?;
    let mut json: serde_json::Value = serde_json::from_str(&text)?;
    let t = json.get_mut("text_config").ok_or("no text_config")?;
    t["num_hidden_layers"] = layers.into();
    for key in ["kda_layers", "full_attn_layers"] {
        let list = &mut t["linear_attn_config"][key];
        let kept: Vec<u64> = list
            .as_array()
            .ok_or("layer list")?
            .iter()
            .filter_map(|v| v.as_u64())
            .filter(|&i| i as usize <= layers)
            .collect();
        *list = kept.into();
    }
    let config = ModelConfig::from_json_str(&json.to_string())?;
    let t0 = Instant::now();
    let model = KimiLinear::load_from(
        CudaBackend::new(0)?,
        config,
        &RandomWeights {
            dtype: DType::BF16,
            seed: 0,
        },
    )?;
    let be = model.backend();
    be.synchronize()?;
    let (free, total) = be.mem_info()?;
    println!(
        "loaded in {:.1} s; device memory used {:.1} GiB of {:.1} GiB",
        t0.elapsed().as_secs_f64(),
        (total - free) as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    let _ = std::io::stdout().flush();
    let vocab = model.config().vocab_size;
    check_graphs(&model, &[1, 8, 64])?;
    generate(&model, num_tokens, vocab)?;
    for len in [1024usize, 8192] {
        let toks: Vec<u32> = (0..len).map(|i| (i * 7919 % vocab) as u32).collect();
        let (mut pool, mut c) = model.single_cache(len)?;
        be.synchronize()?;
        let ts = Instant::now();
        let logits = forward_last(&model, &mut pool, &mut c, &toks)?;
        be.synchronize()?;
        let (_, f) = argmax(&logits);
        println!(
            "prefill {len} tokens: {:.3} s (finite {f})",
            ts.elapsed().as_secs_f64()
        );
        let _ = std::io::stdout().flush();
    }
    Ok(())
}

// ---------------------------------------------------------------- per-op profile

/// Delegates to [`CudaBackend`], synchronising around every op to charge its device time.
struct Profiled {
    inner: CudaBackend,
    times: std::sync::Mutex<std::collections::BTreeMap<&'static str, (u64, f64)>>,
}

impl Profiled {
    fn timed<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&CudaBackend) -> kimi_ops::Result<T>,
    ) -> kimi_ops::Result<T> {
        self.inner.synchronize()?;
        let t0 = Instant::now();
        let r = f(&self.inner);
        self.inner.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        if let Ok(mut m) = self.times.lock() {
            let e = m.entry(op).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += dt;
        }
        r
    }

    fn report(&self, label: &str, per: f64) {
        let Ok(mut m) = self.times.lock() else { return };
        let total: f64 = m.values().map(|v| v.1).sum();
        println!(
            "{label}: {:.2} ms in ops (per {per} unit)",
            total * 1e3 / per
        );
        let mut rows: Vec<_> = m.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        for (op, (n, s)) in rows {
            println!(
                "  {op:<16} {:>7.1} calls {:>9.3} ms {:>5.1}%",
                *n as f64 / per,
                s * 1e3 / per,
                100.0 * s / total.max(1e-12)
            );
        }
        m.clear();
    }
}

impl Backend for Profiled {
    type Tensor = <CudaBackend as Backend>::Tensor;
    fn name(&self) -> String {
        self.inner.name()
    }
    fn stores(&self, dtype: DType) -> bool {
        self.inner.stores(dtype)
    }
    fn stores_experts(&self, dtype: DType) -> bool {
        self.inner.stores_experts(dtype)
    }
    fn upload(&self, host: HostTensor<'_>) -> kimi_ops::Result<Self::Tensor> {
        self.inner.upload(host)
    }
    fn upload_f32(&self, shape: &[usize], data: &[f32]) -> kimi_ops::Result<Self::Tensor> {
        self.inner.upload_f32(shape, data)
    }
    fn zeros(&self, shape: &[usize]) -> kimi_ops::Result<Self::Tensor> {
        self.timed("zeros", |b| b.zeros(shape))
    }
    fn to_f32(&self, t: &Self::Tensor) -> kimi_ops::Result<Vec<f32>> {
        self.timed("to_f32", |b| b.to_f32(t))
    }
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize] {
        self.inner.shape(t)
    }
    fn size_bytes(&self, t: &Self::Tensor) -> usize {
        self.inner.size_bytes(t)
    }
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> kimi_ops::Result<Self::Tensor> {
        self.timed("embedding", |b| b.embedding(table, ids))
    }
    fn matmul(&self, x: &Self::Tensor, w: &Self::Tensor) -> kimi_ops::Result<Self::Tensor> {
        self.timed("matmul", |b| b.matmul(x, w))
    }
    fn matmul_split(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        rows: &[usize],
    ) -> kimi_ops::Result<Vec<Self::Tensor>> {
        self.timed("matmul", |b| b.matmul_split(x, w, rows))
    }
    fn matmul_pair(
        &self,
        a: (&Self::Tensor, &Self::Tensor),
        b: (&Self::Tensor, &Self::Tensor),
    ) -> kimi_ops::Result<(Self::Tensor, Self::Tensor)> {
        self.timed("matmul", |be| be.matmul_pair(a, b))
    }
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("add_rms_norm", |b| b.add_rms_norm(x, y, w, eps))
    }
    fn expert_counts(
        &self,
        chosen: &[&Self::Tensor],
        num_experts: usize,
    ) -> kimi_ops::Result<Vec<Vec<u32>>> {
        self.timed("expert_counts", |b| b.expert_counts(chosen, num_experts))
    }
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("rms_norm", |b| b.rms_norm(x, w, eps))
    }
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> kimi_ops::Result<()> {
        self.timed("add_assign", |b| b.add_assign(x, y))
    }
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> kimi_ops::Result<Self::Tensor> {
        self.timed("select_rows", |b| b.select_rows(x, rows))
    }
    fn split_cols(
        &self,
        x: &Self::Tensor,
        widths: &[usize],
    ) -> kimi_ops::Result<Vec<Self::Tensor>> {
        self.timed("split_cols", |b| b.split_cols(x, widths))
    }
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> kimi_ops::Result<Self::Tensor> {
        self.timed("concat_cols", |b| b.concat_cols(parts))
    }
    fn sigmoid(&self, x: &Self::Tensor) -> kimi_ops::Result<Self::Tensor> {
        self.timed("sigmoid", |b| b.sigmoid(x))
    }
    fn mlp(
        &self,
        x: &Self::Tensor,
        w: &MlpWeights<Self::Tensor>,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("mlp", |b| b.mlp(x, w))
    }
    fn moe(
        &self,
        x: &Self::Tensor,
        w: &MoeWeights<Self::Tensor>,
        r: &MoeRouting,
    ) -> kimi_ops::Result<(Self::Tensor, Self::Tensor)> {
        self.timed("moe", |b| b.moe(x, w, r))
    }
    fn expert_ids(&self, chosen: &Self::Tensor) -> kimi_ops::Result<Vec<u32>> {
        self.timed("expert_ids", |b| b.expert_ids(chosen))
    }
    fn short_conv_silu(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        segments: &[Segment],
        states: &mut [&mut Self::Tensor],
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("short_conv", |b| b.short_conv_silu(x, w, segments, states))
    }
    fn kda_gate(
        &self,
        f: &Self::Tensor,
        a: &Self::Tensor,
        bias: &Self::Tensor,
        h: usize,
        gate: KdaGate,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("kda_gate", |b| b.kda_gate(f, a, bias, h, gate))
    }
    fn kda(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        h: usize,
        segments: &[Segment],
        states: &mut [&mut Self::Tensor],
        mode: KdaMode,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("kda", |b| {
            b.kda(q, k, v, g, beta, h, segments, states, mode)
        })
    }
    fn gated_rms_norm(
        &self,
        o: &Self::Tensor,
        z: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("gated_rms_norm", |b| b.gated_rms_norm(o, z, w, eps))
    }
    fn kda_decode(
        &self,
        x: &KdaStepInputs<'_, Self::Tensor>,
        w: &KdaStepWeights<'_, Self::Tensor>,
        h: usize,
        segments: &[Segment],
        caches: &mut [(&mut [Self::Tensor; 3], &mut Self::Tensor)],
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("kda_decode", |b| b.kda_decode(x, w, h, segments, caches))
    }
    fn mla(
        &self,
        q: &Self::Tensor,
        latent: &Self::Tensor,
        kv_b: &Self::Tensor,
        dims: &MlaDims,
        segments: &[Segment],
        pool: &mut Self::Tensor,
        seqs: &[PagedSeq<'_>],
        mode: MlaMode,
    ) -> kimi_ops::Result<Self::Tensor> {
        self.timed("mla", |b| {
            b.mla(q, latent, kv_b, dims, segments, pool, seqs, mode)
        })
    }
    fn fill_zero(&self, t: &mut Self::Tensor) -> kimi_ops::Result<()> {
        self.timed("fill_zero", |b| b.fill_zero(t))
    }
}

/// Per-op device time of a decode step and of an 8K prefill on the 48B-shaped model.
fn profile_big() -> Res<()> {
    println!("== 4. per-op profile, 48B-shaped model (each op synchronised: launch gaps are charged to ops)");
    let model = big_model(Profiled {
        inner: CudaBackend::new(0)?,
        times: Default::default(),
    })?;
    let vocab = model.config().vocab_size;
    let run = |(pool, cache): &mut (CachePool<Profiled>, SeqCache), toks: &[u32]| {
        forward_last(&model, pool, cache, toks)
    };
    for prec in [GemmPrecision::Split, GemmPrecision::Half] {
        model.backend().inner.set_gemm_precision(prec);
        let prompt: Vec<u32> = (0..512).map(|i| (i * 9973 % vocab) as u32).collect();
        let mut cache = model.single_cache(prompt.len() + 46)?;
        let mut next = argmax(&run(&mut cache, &prompt)?).0;
        for _ in 0..5 {
            next = argmax(&run(&mut cache, &[next as u32])?).0;
        }
        model.backend().report("(warm-up, discarded)", 1.0);
        let steps = 40;
        let t0 = Instant::now();
        for _ in 0..steps {
            next = argmax(&run(&mut cache, &[next as u32])?).0;
        }
        let wall = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
        println!("-- {prec:?}: decode at context ~520, profiled wall {wall:.2} ms/step");
        model.backend().report("decode step", steps as f64);
        let toks: Vec<u32> = (0..8192).map(|i| (i * 7919 % vocab) as u32).collect();
        let mut c = model.single_cache(toks.len())?;
        let t0 = Instant::now();
        run(&mut c, &toks)?;
        println!(
            "-- {prec:?}: prefill 8192, profiled wall {:.3} s",
            t0.elapsed().as_secs_f64()
        );
        model.backend().report("prefill 8192 (ms per prefill)", 1.0);
        let _ = std::io::stdout().flush();
        if prec == GemmPrecision::Split {
            profile_batch_decode(&model, 64, 256, 10)?;
        }
    }
    Ok(())
}

/// Per-op profile of decode steps of `batch` sequences after `context` prompt tokens each.
fn profile_batch_decode(
    model: &KimiLinear<Profiled>,
    batch: usize,
    context: usize,
    steps: usize,
) -> Res<()> {
    let vocab = model.config().vocab_size;
    let bs = kimi_model::SINGLE_BLOCK_SIZE;
    let per_seq = (context + steps + 1).div_ceil(bs);
    let mut pool = model.new_pool(batch * per_seq, bs, batch)?;
    let mut caches: Vec<SeqCache> = (0..batch)
        .map(|s| {
            let first = (s * per_seq) as u32;
            SeqCache::new(s as u32, (first..first + per_seq as u32).collect())
        })
        .collect();
    let mut b = Batch::default();
    for s in 0..batch {
        b.segments.push(Segment {
            start: b.tokens.len(),
            len: context,
        });
        b.tokens
            .extend((0..context).map(|i| ((i + 131 * s) * 9973 % vocab) as u32));
        b.logits_rows.push(b.tokens.len() - 1);
    }
    let mut refs: Vec<&mut SeqCache> = caches.iter_mut().collect();
    let out = model.forward(&b, &mut pool, &mut refs, ForwardOptions::default())?;
    let mut next: Vec<u32> = out
        .logits
        .chunks_exact(vocab)
        .map(|row| argmax(row).0 as u32)
        .collect();
    model.backend().report("(batched prefill, discarded)", 1.0);
    let t0 = Instant::now();
    for _ in 0..steps {
        let b = Batch {
            tokens: next.clone(),
            segments: (0..batch).map(|s| Segment { start: s, len: 1 }).collect(),
            logits_rows: (0..batch).collect(),
            sampling: None,
        };
        let mut refs: Vec<&mut SeqCache> = caches.iter_mut().collect();
        let logits = model
            .forward(&b, &mut pool, &mut refs, ForwardOptions::default())?
            .logits;
        for (s, row) in logits.chunks_exact(vocab).enumerate() {
            next[s] = argmax(row).0 as u32;
        }
    }
    let wall = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    println!(
        "-- Split: decode batch {batch} at context ~{context}, profiled wall {wall:.2} ms/step"
    );
    model
        .backend()
        .report(&format!("decode step, batch {batch}"), steps as f64);
    let _ = std::io::stdout().flush();
    Ok(())
}

// ---------------------------------------------------------------- MLA timing

/// H200 HBM bandwidth (spec sheet) the decode figures are compared with.
const H200_BYTES_PER_S: f64 = 4.8e12;

/// Times the MLA op on the real model's dimensions (one layer).
fn mla_bench() -> Res<()> {
    println!("== 5. mla-bench: one MLA layer, H=32, r=512, dn=128, dr=64, dv=128 (f32 activations and cache, bf16 kv_b)");
    let b = CudaBackend::new(0)?;
    println!("device: {}", b.name());
    let dims = MlaDims {
        num_heads: 32,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        scale: 192f32.powf(-0.5),
    };
    let (h, rk, dn, dr, dv) = (32usize, 512usize, 128usize, 64usize, 128usize);
    let (qw, lw) = (h * (dn + dr), rk + dr);
    let mut rng = op_cases::Rng(77);
    let kvb = op_cases::weight(
        &b,
        &[h * (dn + dv), rk],
        &rng.vec(h * (dn + dv) * rk, (rk as f32).powf(-0.5)),
        DType::BF16,
    )?;

    // Expanded prefill of one 8192-token segment over an empty cache (includes appending
    // the rows and the kv_b GEMM that decompresses them).
    let t_len = 8192usize;
    let q = b.upload_f32(&[t_len, qw], &rng.vec(t_len * qw, 1.0))?;
    let lat = b.upload_f32(&[t_len, lw], &rng.vec(t_len * lw, 1.0))?;
    let seg = [Segment {
        start: 0,
        len: t_len,
    }];
    let bs = 16usize;
    let table: Vec<u32> = (0..t_len.div_ceil(bs) as u32).collect();
    let mut pool = b.zeros(&[table.len(), bs, lw])?;
    let flops = 2.0 * h as f64 * (t_len * (t_len + 1) / 2) as f64 * (dn + dr + dv) as f64;
    for (label, kernel) in [
        ("f32 kernel", MlaPrefillKernel::F32),
        ("auto (mma)", MlaPrefillKernel::Auto),
    ] {
        b.update_kernel_config(|c| c.mla_prefill = kernel)?;
        let mut best = f64::INFINITY;
        for _ in 0..4 {
            b.synchronize()?;
            let t0 = Instant::now();
            let seqs = [PagedSeq {
                block_table: &table,
                num_cached: 0,
            }];
            let y = b.mla(
                &q,
                &lat,
                &kvb,
                &dims,
                &seg,
                &mut pool,
                &seqs,
                MlaMode::Expanded,
            )?;
            b.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
            drop(y);
        }
        println!(
            "expanded prefill T={t_len}, {label}, Split: {:.2} ms (best of 4) = {:.1} TFLOP/s causal attention (kv_b GEMM included in the time)",
            best * 1e3,
            flops / best / 1e12
        );
        let _ = std::io::stdout().flush();
    }

    // The attention kernel alone (no append, no kv_b GEMM) on random kv rows: the f32
    // kernel, then the tensor-core kernel with hi+lo operands (Split) and bf16 (Half), each
    // against the f32 kernel's output. q is scaled so that the softmax is not flat.
    let qa = b.upload_f32(&[t_len, qw], &rng.vec(t_len * qw, 4.0))?;
    let kv = b.upload_f32(
        &[t_len, h * (dn + dv)],
        &rng.vec(t_len * h * (dn + dv), 1.0),
    )?;
    let variants = [
        ("f32 kernel", MlaPrefillKernel::F32, GemmPrecision::Split),
        ("mma Split", MlaPrefillKernel::Auto, GemmPrecision::Split),
        (
            "mma Half",
            MlaPrefillKernel::NoFlashInfer,
            GemmPrecision::Half,
        ),
        ("FlashInfer", MlaPrefillKernel::Auto, GemmPrecision::Half),
    ];
    let mut reference: Vec<f32> = vec![];
    for (label, kernel, precision) in variants {
        b.update_kernel_config(|c| {
            c.mla_prefill = kernel;
            c.precision = precision;
        })?;
        let got = b.to_f32(&b.mla_expanded_attention(&qa, &lat, &kv, &dims, 0)?)?;
        if reference.is_empty() {
            reference = got.clone();
        }
        let err = rel_err(&got, &reference);
        let nonfinite = got.iter().filter(|x| !x.is_finite()).count();
        let secs = time_calls(&b, 1, 5, || {
            drop(b.mla_expanded_attention(&qa, &lat, &kv, &dims, 0)?);
            Ok(())
        })?;
        println!(
            "attention kernel T={t_len} H={h}, {label:<10}: {:7.2} ms = {:6.1} TFLOP/s, rel err vs f32 kernel {err:.2e}{}",
            secs * 1e3,
            flops / secs / 1e12,
            if nonfinite > 0 {
                format!(" ({nonfinite} non-finite outputs!)")
            } else {
                String::new()
            }
        );
        let _ = std::io::stdout().flush();
    }
    b.update_kernel_config(|c| {
        c.mla_prefill = MlaPrefillKernel::Auto;
        c.precision = GemmPrecision::Split;
    })?;
    drop((qa, kv, reference));

    // Segments that continue cached rows (chunked prefill) and ragged lengths: FlashInfer's
    // kernel (bf16 operands) against the f32 kernel on the same inputs.
    for (past, len) in [(1000usize, 512usize), (0, 77), (4096, 1)] {
        let total = past + len;
        let q = b.upload_f32(&[len, qw], &rng.vec(len * qw, 4.0))?;
        let rows = b.upload_f32(&[total, lw], &rng.vec(total * lw, 1.0))?;
        let kv = b.upload_f32(
            &[total, h * (dn + dv)],
            &rng.vec(total * h * (dn + dv), 1.0),
        )?;
        b.update_kernel_config(|c| c.mla_prefill = MlaPrefillKernel::F32)?;
        let want = b.to_f32(&b.mla_expanded_attention(&q, &rows, &kv, &dims, past)?)?;
        b.update_kernel_config(|c| {
            c.mla_prefill = MlaPrefillKernel::Auto;
            c.precision = GemmPrecision::Half;
        })?;
        let got = b.to_f32(&b.mla_expanded_attention(&q, &rows, &kv, &dims, past)?)?;
        b.set_gemm_precision(GemmPrecision::Split);
        let finite = got.iter().all(|x| x.is_finite());
        println!(
            "attention past={past} len={len}: FlashInfer rel err vs f32 kernel {:.2e} (finite {finite})",
            rel_err(&got, &want)
        );
    }

    // Absorbed decode: `batch` sequences at context `ctx`, one new token each per call.
    for &batch in &[1usize, 64] {
        for &ctx in &[1024usize, 32 * 1024, 128 * 1024] {
            // Each sequence owns a contiguous run of blocks; every step writes its token at
            // position `ctx` again, so the attended context stays `ctx + 1`.
            let per_seq = (ctx + 1).div_ceil(bs);
            let mut pool = b.zeros(&[batch * per_seq, bs, lw])?;
            let tables: Vec<Vec<u32>> = (0..batch)
                .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
                .collect();
            let q = b.upload_f32(&[batch, qw], &rng.vec(batch * qw, 1.0))?;
            let lat = b.upload_f32(&[batch, lw], &rng.vec(batch * lw, 1.0))?;
            let segs: Vec<Segment> = (0..batch).map(|s| Segment { start: s, len: 1 }).collect();
            let step = |pool: &mut _| -> Res<()> {
                let seqs: Vec<PagedSeq<'_>> = tables
                    .iter()
                    .map(|t| PagedSeq {
                        block_table: t,
                        num_cached: ctx,
                    })
                    .collect();
                b.mla(&q, &lat, &kvb, &dims, &segs, pool, &seqs, MlaMode::Auto)?;
                Ok(())
            };
            step(&mut pool)?;
            step(&mut pool)?;
            b.synchronize()?;
            let iters = 20;
            let t0 = Instant::now();
            for _ in 0..iters {
                step(&mut pool)?;
            }
            b.synchronize()?;
            let s = t0.elapsed().as_secs_f64() / iters as f64;
            let bytes = (batch * (ctx + 1) * lw * 4) as f64;
            println!(
                "absorbed decode B={batch:<3} ctx={:>4}K: {:.3} ms/layer, latent read {:.0} MB -> {:.2} TB/s ({:.0}% of 4.8 TB/s)",
                ctx / 1024,
                s * 1e3,
                bytes / 1e6,
                bytes / s / 1e12,
                100.0 * bytes / s / H200_BYTES_PER_S
            );
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- KDA timings

/// Mean seconds per call of `f` over `reps` calls after `warm` untimed ones, synchronised
/// before and after (wall time of queued device work).
fn time_calls(
    be: &CudaBackend,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> kimi_ops::Result<()>,
) -> Res<f64> {
    for _ in 0..warm {
        f()?;
    }
    be.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    be.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / reps as f64)
}

/// Choosing tokens from 163,840-token logits rows on the device: the argmax, sampling
/// under each filter, and copying the rows to the host (what host sampling starts with).
fn sample_bench() -> Res<()> {
    println!("== sampling on the device (wall time per call, ids back on the host)");
    let be = CudaBackend::new(0)?;
    let vocab = 163_840usize;
    let mut r = op_cases::Rng(5);
    let rules = |temperature, top_k, top_p, min_p| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        uniform: 0.5,
        ..RowSampling::greedy()
    };
    let sets = [
        ("temperature 1", rules(1.0, 0, 1.0, 0.0)),
        ("top-k 50", rules(0.7, 50, 1.0, 0.0)),
        ("top-p 0.9", rules(1.0, 0, 0.9, 0.0)),
        (
            "top-k 50 + top-p 0.9 + min-p 0.05",
            rules(0.8, 50, 0.9, 0.05),
        ),
    ];
    for rows in [1usize, 64] {
        let data = r.vec(rows * vocab, 4.0);
        let x = be.upload_f32(&[rows, vocab], &data)?;
        let s = time_calls(&be, 2, 20, || be.argmax_rows(&x).map(drop))?;
        println!("rows {rows:>2}: argmax {:8.1} us", s * 1e6);
        let s = time_calls(&be, 2, 20, || be.to_f32(&x).map(drop))?;
        println!("rows {rows:>2}: copy logits to host {:8.1} us", s * 1e6);
        for (label, set) in &sets {
            let params = vec![*set; rows];
            let mut y = be.upload_f32(&[rows, vocab], &data)?;
            let s = time_calls(&be, 2, 20, || {
                be.sample_rows(&mut y, &params, &[]).map(drop)
            })?;
            println!("rows {rows:>2}: sample, {label:<34} {:8.1} us", s * 1e6);
        }
    }
    Ok(())
}

/// Chunked KDA at T=8192 (B=1, D=128) and the per-layer decode step (H=32, D=128).
fn kda_bench() -> Res<()> {
    println!("== 5. KDA kernel timings (synchronised wall time, f32 activations and state)");
    let be = CudaBackend::new(0)?;
    println!("device: {}", be.name());
    let mut r = op_cases::Rng(99);
    let d = 128usize;
    for h in [32usize, 64, 96] {
        let t = 8192usize;
        let w = h * d;
        let q = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
        let k = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
        let v = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
        let g: Vec<f32> = r.vec(t * w, 1.0).iter().map(|x| -0.3 * (x + 1.0)).collect();
        let g = be.upload_f32(&[t, w], &g)?;
        let beta: Vec<f32> = r.vec(t * h, 1.0).iter().map(|x| 0.5 + 0.4 * x).collect();
        let beta = be.upload_f32(&[t, h], &beta)?;
        let mut state = be.zeros(&[h, d, d])?;
        let segs = [Segment { start: 0, len: t }];
        // The chunked kernels: tensor cores with hi + lo operands (the default), bf16 only,
        // and the f32 CUDA-core kernels.
        // Auto = blocked prep (default), MmaPairPrep = pair-loop prep; prep / state alone
        // through the stage hook.
        let f32_kernels = KdaChunkKernel::F32;
        for (label, kernel, prec) in [
            ("mma", KdaChunkKernel::Auto, GemmPrecision::Split),
            ("mma half", KdaChunkKernel::Auto, GemmPrecision::Half),
            (
                "mma oldprep",
                KdaChunkKernel::MmaPairPrep,
                GemmPrecision::Split,
            ),
            ("f32", f32_kernels, GemmPrecision::Split),
        ] {
            be.update_kernel_config(|c| {
                c.kda_chunk = kernel;
                c.precision = prec;
            })?;
            let mut times = [0.0f64; 3];
            let both = KdaStages::default();
            let prep_only = KdaStages {
                state: false,
                ..both
            };
            let state_only = KdaStages {
                prep: false,
                ..both
            };
            for (slot, stages) in [(0usize, both), (1, prep_only), (2, state_only)] {
                if kernel == f32_kernels && stages != both {
                    continue;
                }
                be.update_kernel_config(|c| c.kda_stages = stages)?;
                times[slot] = time_calls(&be, 2, 10, || {
                    be.kda(
                        &q,
                        &k,
                        &v,
                        &g,
                        &beta,
                        h,
                        &segs,
                        &mut [&mut state],
                        KdaMode::Chunked,
                    )
                    .map(drop)
                })?;
            }
            be.update_kernel_config(|c| {
                c.kda_stages = KdaStages::default();
                c.kda_chunk = KdaChunkKernel::Auto;
                c.precision = GemmPrecision::Split;
            })?;
            let s = times[0];
            // Model FLOPs as performance-anchors.md §1.3 (C=16 convention).
            let tflops = (t * h) as f64 * 117_760.0 / s / 1e12;
            let parts = if kernel == f32_kernels {
                String::new()
            } else {
                format!(
                    "  [prep {:.3} ms, state pass {:.3} ms]",
                    times[1] * 1e3,
                    times[2] * 1e3
                )
            };
            println!(
                "kda chunked {label:<11} T={t} H={h:<3} D={d}: {:8.3} ms  ({tflops:.1} model TFLOP/s){parts}",
                s * 1e3
            );
        }
        // The state is garbage after the stage-only runs; start the recurrence from zeros.
        state = be.zeros(&[h, d, d])?;
        let s = time_calls(&be, 1, 2, || {
            be.kda(
                &q,
                &k,
                &v,
                &g,
                &beta,
                h,
                &segs,
                &mut [&mut state],
                KdaMode::Recurrent,
            )
            .map(drop)
        })?;
        println!(
            "kda recurrent T={t} H={h:<3} D={d}: {:8.3} ms (token loop, for reference)",
            s * 1e3
        );
        let _ = std::io::stdout().flush();
    }
    kda_bench_k3_chunk(&be, &mut r)?;
    // Kimi Linear's decode (32 heads, softplus gate), then Kimi K3's (96 heads, safe gate).
    for (h, gate, batches) in [
        (32usize, KdaGate::Softplus, &[1usize, 64][..]),
        (96, KdaGate::LowerBound(-5.0), &[1, 64, 256][..]),
    ] {
        kda_bench_decode(&be, &mut r, h, gate, batches)?;
    }
    Ok(())
}

/// Kimi K3's chunked KDA at T=8192: 96 heads, the safe gate computed from the raw gate input
/// (`kda_gate`) and the chunked rule, timed together (as fla's `chunk_kda` with
/// `use_gate_in_kernel` and `safe_gate` does both).
fn kda_bench_k3_chunk(be: &CudaBackend, r: &mut op_cases::Rng) -> Res<()> {
    let (t, h, d) = (8192usize, 96usize, 128usize);
    let w = h * d;
    let q = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
    let k = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
    let v = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
    let f = be.upload_f32(&[t, w], &r.vec(t * w, 1.0))?;
    let a_log = op_cases::weight(be, &[1, 1, h, 1], &r.vec(h, 0.5), DType::F32)?;
    let dt_bias = op_cases::weight(be, &[w], &r.vec(w, 0.1), DType::F32)?;
    let beta: Vec<f32> = r.vec(t * h, 1.0).iter().map(|x| 0.5 + 0.4 * x).collect();
    let beta = be.upload_f32(&[t, h], &beta)?;
    let mut state = be.zeros(&[h, d, d])?;
    let segs = [Segment { start: 0, len: t }];
    let gate = KdaGate::LowerBound(-5.0);
    let gate_only = time_calls(be, 2, 10, || {
        be.kda_gate(&f, &a_log, &dt_bias, h, gate).map(drop)
    })?;
    let both = time_calls(be, 2, 10, || {
        let g = be.kda_gate(&f, &a_log, &dt_bias, h, gate)?;
        be.kda(
            &q,
            &k,
            &v,
            &g,
            &beta,
            h,
            &segs,
            &mut [&mut state],
            KdaMode::Chunked,
        )
        .map(drop)
    })?;
    let tflops = (t * h) as f64 * 117_760.0 / both / 1e12;
    println!(
        "kda k3 chunked safe gate T={t} H={h} D={d}: {:8.3} ms  ({tflops:.1} model TFLOP/s) [gate {:.3} ms]",
        both * 1e3,
        gate_only * 1e3
    );
    let _ = std::io::stdout().flush();
    Ok(())
}

/// One fused KDA decode step per layer (convolutions, gate, rule, gated norm) against the
/// composed ops, at each batch size.
fn kda_bench_decode(
    be: &CudaBackend,
    r: &mut op_cases::Rng,
    h: usize,
    gate: KdaGate,
    batches: &[usize],
) -> Res<()> {
    let d = 128usize;
    let width = h * d;
    let conv: Vec<_> = (0..3)
        .map(|_| op_cases::weight(be, &[width, 1, 4], &r.vec(width * 4, 0.5), DType::BF16))
        .collect::<Res<_>>()?;
    let a_log = op_cases::weight(be, &[1, 1, h, 1], &r.vec(h, 1.0), DType::F32)?;
    let dt_bias = op_cases::weight(be, &[width], &r.vec(width, 0.5), DType::F32)?;
    let o_norm = op_cases::weight(be, &[d], &r.vec(d, 1.0), DType::BF16)?;
    let weights = KdaStepWeights {
        conv: [&conv[0], &conv[1], &conv[2]],
        a_log: &a_log,
        dt_bias: &dt_bias,
        o_norm: &o_norm,
        gate,
        eps: 1e-5,
    };
    for &batch in batches {
        let pre: Vec<_> = (0..3)
            .map(|_| be.upload_f32(&[batch, width], &r.vec(batch * width, 1.0)))
            .collect::<Result<_, _>>()?;
        let f = be.upload_f32(&[batch, width], &r.vec(batch * width, 1.0))?;
        let bl = be.upload_f32(&[batch, h], &r.vec(batch * h, 1.0))?;
        let z = be.upload_f32(&[batch, width], &r.vec(batch * width, 1.0))?;
        let inputs = KdaStepInputs {
            qkv: [&pre[0], &pre[1], &pre[2]],
            f: &f,
            beta_logits: &bl,
            z: &z,
        };
        let mut caches = Vec::with_capacity(batch);
        for _ in 0..batch {
            caches.push((
                [
                    be.zeros(&[3, width])?,
                    be.zeros(&[3, width])?,
                    be.zeros(&[3, width])?,
                ],
                be.zeros(&[h, d, d])?,
            ));
        }
        let segs: Vec<Segment> = (0..batch).map(|s| Segment { start: s, len: 1 }).collect();
        for fused in [true, false] {
            let s = time_calls(be, 5, 200, || {
                let mut refs: Vec<_> = caches.iter_mut().map(|(c, s)| (c, s)).collect();
                let y = if fused {
                    be.kda_decode(&inputs, &weights, h, &segs, &mut refs)?
                } else {
                    kimi_ops::kda_decode_composed(be, &inputs, &weights, h, &segs, &mut refs)?
                };
                drop(y);
                Ok(())
            })?;
            // State bytes read and written per step: B * H * D * D * 4 * 2.
            let gbs = (batch * h * d * d * 8) as f64 / s / 1e9;
            println!(
                "kda decode step {} B={batch:<3} H={h} D={d}: {:8.1} us/layer ({gbs:.0} GB/s of state traffic)",
                if fused { "fused   " } else { "composed" },
                s * 1e6
            );
        }
        let _ = std::io::stdout().flush();
    }
    Ok(())
}
