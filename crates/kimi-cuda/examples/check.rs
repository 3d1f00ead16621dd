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
//!
//! Usage: `check [ops] [fixtures] [big N_TOKENS] [profile]` (default: 1-3, 1000 tokens).

use std::borrow::Cow;
use std::collections::HashSet;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::bf16;
use kimi_core::config::{KdaGate, ModelConfig};
use kimi_core::DType;
use kimi_cpu::CpuBackend;
use kimi_cuda::{CudaBackend, GemmPrecision};
use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, KimiLinear, SeqCache, WeightSource};
use kimi_ops::{
    Backend, HostTensor, KdaMode, MlaDims, MlaMode, MlpWeights, MoeRouting, MoeWeights, PagedSeq,
    Segment,
};
use rayon::prelude::*;

type Res<T> = std::result::Result<T, Box<dyn Error>>;

#[path = "../tests/common/op_cases.rs"]
mod op_cases;
use op_cases::{rel_err, CpuRun, CudaRun, Rng};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = args.is_empty();
    let want = |s: &str| all || args.iter().any(|a| a == s);
    let big_tokens = args
        .iter()
        .position(|a| a == "big")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000usize);
    let mut failed = false;
    if args.iter().any(|a| a == "profile") {
        if let Err(e) = profile_big() {
            println!("profile: ERROR {e}");
            failed = true;
        }
    }
    if want("ops") {
        if let Err(e) = check_ops() {
            println!("ops: ERROR {e}");
            failed = true;
        }
    }
    if want("fixtures") {
        if let Err(e) = check_fixtures() {
            println!("fixtures: ERROR {e}");
            failed = true;
        }
    }
    if want("big") {
        if let Err(e) = check_big(big_tokens) {
            println!("big: ERROR {e}");
            failed = true;
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

fn check_ops() -> Res<()> {
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
    let cases = op_cases::cases();
    let cpu = CpuRun(CpuBackend::new());
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
                let ok = errs.len() == want.len() && errs.iter().all(|&e| e <= 1e-4);
                println!(
                    "{name:<50} rel err {}{}",
                    text.join(" "),
                    if ok { "" } else { "  FAIL" }
                );
                if !ok {
                    failures.push(name.clone());
                }
            }
            Err(e) => {
                println!("{name:<50} CUDA ERROR {e}");
                failures.push(name.clone());
            }
        }
        let _ = std::io::stdout().flush();
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} op cases over 1e-4 or failing: {failures:?}",
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
    m: &KimiLinear<B>,
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
        };
        out.extend(
            m.forward(&batch, &mut pool, &mut [&mut cache], opts)?
                .logits,
        );
    }
    Ok(out)
}

fn check_fixtures() -> Res<()> {
    println!("== 2. fixtures: CUDA logits vs transformers float64 reference (rel err)");
    let root = PathBuf::from("fixtures/kimi-linear");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    let absorbed = ForwardOptions {
        kda_mode: KdaMode::Auto,
        mla_mode: MlaMode::Absorbed,
    };
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let res = (|| -> Res<String> {
            let ckpt = kimi_weights::Checkpoint::open(&dir)?;
            let model = KimiLinear::load(CudaBackend::new(0)?, &ckpt)?;
            let reference: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
            let prompt: Vec<u32> = reference["prompt_ids"]
                .as_array()
                .ok_or("prompt_ids")?
                .iter()
                .filter_map(|x| x.as_u64().map(|v| v as u32))
                .collect();
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
                let num: f64 = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (*g as f64 - w).powi(2))
                    .sum();
                let den: f64 = want.iter().map(|w| w * w).sum();
                let err = if got.len() == want.len() {
                    (num / den).sqrt()
                } else {
                    f64::INFINITY
                };
                parts.push(format!("{label} {err:.2e}"));
            }
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

// ---------------------------------------------------------------- 48B-shaped model

/// RandomWeights' value ranges, generated in parallel (values differ from RandomWeights).
struct FastRandom;

impl WeightSource for FastRandom {
    fn contains(&self, _name: &str) -> bool {
        true
    }
    fn load(&self, name: &str, shape: &[usize]) -> kimi_model::Result<(DType, Cow<'_, [u8]>)> {
        let n: usize = shape.iter().product();
        let seed = name.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let a = fan_in.max(1.0).powf(-0.5);
        let kind = if name.ends_with("A_log") {
            0
        } else if name.ends_with("dt_bias") || name.ends_with("e_score_correction_bias") {
            1
        } else if name.contains("norm") {
            2
        } else {
            3
        };
        let value = move |u: f32| -> f32 {
            match kind {
                0 => (1.0 + 15.0 * u).ln(),
                1 => (u - 0.5) * 0.2,
                2 => 1.0 + (u - 0.5) * 0.1,
                _ => (2.0 * u - 1.0) * a,
            }
        };
        let keep_f32 = name.ends_with("A_log") || name.ends_with("dt_bias");
        let esize = if keep_f32 { 4 } else { 2 };
        let mut bytes = vec![0u8; n * esize];
        const CH: usize = 1 << 16;
        bytes
            .par_chunks_mut(CH * esize)
            .enumerate()
            .for_each(|(ci, chunk)| {
                let mut r = Rng(seed ^ (ci as u64).wrapping_mul(0x9e3779b97f4a7c15));
                for el in chunk.chunks_exact_mut(esize) {
                    let v = value(r.next());
                    if keep_f32 {
                        el.copy_from_slice(&v.to_le_bytes());
                    } else {
                        el.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                    }
                }
            });
        Ok((
            if keep_f32 { DType::F32 } else { DType::BF16 },
            Cow::Owned(bytes),
        ))
    }
    fn check_all_used(&self, _used: &HashSet<String>) -> kimi_model::Result<()> {
        Ok(())
    }
}

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

fn forward_last(
    model: &KimiLinear<CudaBackend>,
    pool: &mut CachePool<CudaBackend>,
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

/// `batch` sequences (16-token prompts) decoded together for `steps` steps: one forward of
/// `batch` one-token segments per step.
fn decode_batch(
    model: &KimiLinear<CudaBackend>,
    batch: usize,
    steps: usize,
    vocab: usize,
) -> Res<()> {
    // One pool of 16-token blocks; sequence s takes blocks s, s + batch, s + 2 batch, ...
    let per_seq = (16 + steps).div_ceil(16);
    let mut pool = model.new_pool(batch * per_seq, 16, batch)?;
    let mut caches: Vec<SeqCache> = (0..batch)
        .map(|s| {
            let table = (0..per_seq).map(|k| (k * batch + s) as u32).collect();
            SeqCache::new(s as u32, table)
        })
        .collect();
    let mut next = Vec::with_capacity(batch);
    for (s, c) in caches.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..16)
            .map(|i| ((i + 31 * s) * 9973 % vocab) as u32)
            .collect();
        let logits = forward_last(model, &mut pool, c, &prompt)?;
        next.push(argmax(&logits).0 as u32);
    }
    let mut step_ms = Vec::with_capacity(steps);
    let mut all_finite = true;
    for _ in 0..steps {
        let b = Batch {
            tokens: next.clone(),
            segments: (0..batch).map(|s| Segment { start: s, len: 1 }).collect(),
            logits_rows: (0..batch).collect(),
        };
        let mut refs: Vec<&mut SeqCache> = caches.iter_mut().collect();
        let ts = Instant::now();
        let logits = model
            .forward(&b, &mut pool, &mut refs, ForwardOptions::default())?
            .logits;
        step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
        for (s, row) in logits.chunks_exact(vocab).enumerate() {
            let (n, f) = argmax(row);
            all_finite &= f;
            next[s] = n as u32;
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
    let text = std::fs::read_to_string(
        "crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json",
    )?;
    let config = ModelConfig::from_json_str(&text)?;
    let backend = CudaBackend::new(0)?;
    let t0 = Instant::now();
    let model = KimiLinear::load_from(backend, config, &FastRandom)?;
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
    ) -> kimi_ops::Result<(Self::Tensor, Vec<u32>)> {
        self.timed("moe", |b| b.moe(x, w, r))
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
    let text = std::fs::read_to_string(
        "crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json",
    )?;
    let config = ModelConfig::from_json_str(&text)?;
    let backend = Profiled {
        inner: CudaBackend::new(0)?,
        times: Default::default(),
    };
    let model = KimiLinear::load_from(backend, config, &FastRandom)?;
    let vocab = model.config().vocab_size;
    let run =
        |(pool, cache): &mut (CachePool<Profiled>, SeqCache), toks: &[u32]| -> Res<Vec<f32>> {
            let batch = Batch {
                tokens: toks.to_vec(),
                segments: vec![Segment {
                    start: 0,
                    len: toks.len(),
                }],
                logits_rows: vec![toks.len() - 1],
            };
            Ok(model
                .forward(&batch, pool, &mut [cache], ForwardOptions::default())?
                .logits)
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
    }
    Ok(())
}
