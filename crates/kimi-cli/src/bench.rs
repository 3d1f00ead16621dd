//! `kimi-infer bench`: prefill and decode throughput, peak memory, and decode bandwidth
//! against the machine's measured memory bandwidth.

use std::time::Instant;

use kimi_engine::sampling::SamplingParams;
use kimi_model::{Batch, CausalLm, ForwardOptions, SeqCache};
use kimi_ops::{Backend, Segment};
use rayon::prelude::*;
use serde_json::json;

use crate::args::BenchArgs;
use crate::inspect::bytes;

pub fn bench(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.prompt_len.is_empty()
            && a.prompt_len.iter().all(|&n| n >= 1)
            && a.gen_len >= 2
            && a.repeats >= 1,
        "need --prompt-len >= 1, --gen-len >= 2, --repeats >= 1"
    );
    anyhow::ensure!(
        a.decode_batch.iter().all(|&b| b >= 1) && a.decode_steps >= 1 && a.context >= 1,
        "need --decode-batch sizes >= 1, --decode-steps >= 1 and --context >= 1"
    );
    anyhow::ensure!(
        a.routing_skew == 0.0 || a.random_config.is_some(),
        "--routing-skew skews the routers of --random-config weights; a checkpoint routes as trained"
    );
    crate::load::with_backend!(a.model, |backend| bench_on(backend, a))
}

fn bench_on<B: Backend + 'static>(backend: B, a: BenchArgs) -> anyhow::Result<()> {
    let on_gpu = backend.memory_info().is_some();
    let load_start = Instant::now();
    let (mut loaded, bytes_per_param) = match &a.random_config {
        Some(cfg) => {
            let dtype = a.random_dtype.dtype();
            (
                crate::load::load_random(backend, cfg, dtype, &a.model, a.routing_skew)?,
                Some(dtype.block_bytes() as f64 / dtype.block_size() as f64),
            )
        }
        None => (crate::load::load(backend, &a.model, false)?, None),
    };
    let load_secs = load_start.elapsed().as_secs_f64();
    loaded.engine.prefill_chunk = a
        .prefill_chunk
        .unwrap_or(if on_gpu { 8192 } else { 512 })
        .max(1);
    let backend_name = loaded.engine.model().backend().name();
    let memory_after_load = device_memory_used(loaded.engine.model().backend());
    let vocab = loaded.engine.model().vocab_size() as u64;
    let (total_params, active_params) = loaded.params();
    let ckpt_bytes_per_param =
        bytes_per_param.unwrap_or_else(|| weight_bytes_per_param(&loaded.dir, total_params));
    let weight_bytes_per_token = loaded.weight_bytes_per_token(ckpt_bytes_per_param);
    let bandwidth = loaded
        .engine
        .model()
        .backend()
        .measure_read_bandwidth()
        .unwrap_or_else(measure_host_read_bandwidth);
    println!(
        "model       {} ({} params, {} active)",
        loaded.dir.display(),
        total_params,
        active_params
    );
    println!("backend     {backend_name}");
    println!("loaded      in {load_secs:.1} s");

    let params = SamplingParams {
        max_tokens: a.gen_len,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut runs = Vec::new();
    for &prompt_len in &a.prompt_len {
        let prompt = bench_prompt(prompt_len, vocab, 0);
        let (mut best_prefill, mut best_decode) = (f64::MAX, f64::MAX);
        for _ in 0..a.repeats {
            let g = loaded.engine.generate(&prompt, &params, &[], |_| {
                std::ops::ControlFlow::Continue(())
            })?;
            best_prefill = best_prefill.min(g.prefill_secs);
            // The first token comes from the prefill logits; each later one costs a decode step.
            best_decode = best_decode.min(g.decode_secs / (g.tokens.len().max(2) - 1) as f64);
        }
        // Recurrent state is read and written once per token; the cache is read once (f32).
        let (cache_per_token, state_per_seq) = loaded.cache_values();
        let state_bytes_per_token = 2.0 * 4.0 * state_per_seq as f64
            + 4.0 * cache_per_token as f64 * (prompt_len + a.gen_len / 2) as f64;
        let bytes_per_token = weight_bytes_per_token + state_bytes_per_token;
        let decode_tps = 1.0 / best_decode;
        let achieved = bytes_per_token * decode_tps;
        println!(
            "prefill     {:.1} tokens/s ({prompt_len} tokens in {:.3} s)",
            prompt_len as f64 / best_prefill,
            best_prefill
        );
        println!(
            "decode      {:.2} tokens/s ({:.2} ms/token after {prompt_len} prompt tokens)",
            decode_tps,
            best_decode * 1e3
        );
        println!(
            "bandwidth   {} read per token -> {}/s, {:.1}% of the measured {}/s",
            bytes(bytes_per_token as u64),
            bytes(achieved as u64),
            100.0 * achieved / bandwidth,
            bytes(bandwidth as u64)
        );
        runs.push(json!({
            "prompt_len": prompt_len, "gen_len": a.gen_len,
            "prefill_tokens_per_sec": prompt_len as f64 / best_prefill,
            "prefill_secs": best_prefill,
            "decode_tokens_per_sec": decode_tps,
            "decode_ms_per_token": best_decode * 1e3,
            "decode_bytes_per_token": bytes_per_token,
            "decode_bytes_per_sec": achieved,
            "decode_bandwidth_fraction": achieved / bandwidth,
        }));
    }
    let placement = loaded.engine.model().expert_placement();
    // With the expert's stored bytes, so that `plan --measured` turns the times into rates.
    let expert_bytes = match &loaded.info {
        crate::load::ModelInfo::Kimi(cfg) => {
            Some(kimi_model::ModelSummary::new(cfg).bytes_per_expert)
        }
        crate::load::ModelInfo::Gguf { .. } => None,
    };
    let miss_costs = placement.first().and_then(|(_, p)| p.miss_costs).map(|c| {
        json!({"fill_ms": c.fill_s * 1e3, "cpu_first_ms": c.host_first_s * 1e3,
               "cpu_next_ms": c.host_next_s * 1e3,
               "cpu_more_ms": c.host_more_s * 1e3, "expert_bytes": expert_bytes})
    });
    let mut batches = Vec::new();
    let mut memory_peak = memory_after_load;
    for &batch in &a.decode_batch {
        let r = decode_batch(
            loaded.engine.model(),
            batch,
            a.context,
            a.decode_steps,
            vocab,
        )?;
        println!(
            "decode x{batch:<4} {:.1} tokens/s ({:.2} ms/step, median of {} steps at context {})",
            batch as f64 / r.median_step_secs,
            r.median_step_secs * 1e3,
            a.decode_steps,
            a.context
        );
        memory_peak = memory_peak.max(r.memory_used);
        let top10 = routing_concentration(&r.routed, 0.10);
        let top25 = routing_concentration(&r.routed, 0.25);
        if let (Some(t10), Some(t25)) = (top10, top25) {
            // Few pairs over many experts concentrate by chance: say how many there were.
            let layers = r.routed.iter().filter(|c| c.iter().any(|&n| n > 0));
            let (moe_layers, pairs, experts) = layers.fold((0, 0u64, 0), |(l, p, _), c| {
                (l + 1, p + c.iter().sum::<u64>(), c.len())
            });
            println!(
                "  routing   the most-used 10 % of experts took {:.1} % of routed pairs, 25 % took {:.1} % ({} pairs per layer over {experts} experts)",
                t10 * 100.0,
                t25 * 100.0,
                pairs / moe_layers.max(1) as u64
            );
        }
        let ranks = expert_rank_balance(loaded.engine.model(), &r.routed);
        let offload = r.offload.map(|c| {
            let tokens = (batch * a.decode_steps).max(1) as f64;
            let per_step = |ns: u64| ns as f64 / 1e6 / a.decode_steps.max(1) as f64;
            let (tiered_ms, host_ms) = (per_step(c.step_ns), per_step(c.host_ns));
            println!(
                "  experts   hit rate {}, {} moved and {:.1} cold pairs per token",
                c.hit_rate()
                    .map_or("-".into(), |h| format!("{:.1} %", h * 100.0)),
                bytes((c.bytes_moved as f64 / tokens) as u64),
                c.cold_pairs as f64 / tokens
            );
            println!(
                "  experts   {tiered_ms:.2} ms per step in the tiered MoE steps, {host_ms:.2} of them on the host's cold experts"
            );
            if c.ahead_fills + c.ahead_used > 0 {
                // Per token rather than as a share: a copy made in the step before the
                // measured ones counts when a measured step uses it.
                println!(
                    "  experts   {:.1} copied ahead per token (on the next layer's prediction or behind the CPU), {:.1} copied ahead used per token",
                    c.ahead_fills as f64 / tokens,
                    c.ahead_used as f64 / tokens
                );
            }
            json!({
                "hit_rate": c.hit_rate(),
                "hits": c.hits, "fills": c.fills, "evictions": c.evictions,
                "cold_experts": c.cold_experts, "cold_pairs": c.cold_pairs,
                "device_pairs": c.device_pairs,
                "ahead_fills": c.ahead_fills, "ahead_used": c.ahead_used,
                "bytes_moved_per_token": c.bytes_moved as f64 / tokens,
                "tiered_ms_per_step": tiered_ms,
                "host_ms_per_step": host_ms,
            })
        });
        // Where a batch's prefill (its `--context` tokens per sequence) spent its time.
        let prefill_offload = r.prefill_offload.map(|c| {
            println!(
                "  prefill   {:.3} s: {:.3} s in the tiered MoE steps, {:.3} s of them on the host's {} cold pairs ({} experts)",
                r.prefill_secs,
                c.step_ns as f64 / 1e9,
                c.host_ns as f64 / 1e9,
                c.cold_pairs,
                c.cold_experts
            );
            json!({
                "tiered_secs": c.step_ns as f64 / 1e9, "host_secs": c.host_ns as f64 / 1e9,
                "cold_pairs": c.cold_pairs, "cold_experts": c.cold_experts,
                "hits": c.hits, "fills": c.fills,
            })
        });
        batches.push(json!({
            "expert_ranks": ranks,
            "offload": offload,
            "prefill_offload": prefill_offload,
            "routing_top10_share": top10, "routing_top25_share": top25,
            "batch": batch, "context": a.context, "steps": a.decode_steps,
            "tokens_per_sec": batch as f64 / r.median_step_secs,
            "median_step_ms": r.median_step_secs * 1e3,
            "min_step_ms": r.min_step_secs * 1e3,
            "prefill_secs": r.prefill_secs,
            "device_memory_used_bytes": r.memory_used,
        }));
    }
    let engine_batch = if a.batch > 0 {
        let prompt = bench_prompt(a.prompt_len[0], vocab, 0);
        Some(batched_throughput(loaded.engine, &a, &prompt)?)
    } else {
        None
    };
    if let Some(tps) = engine_batch {
        println!(
            "batched     {tps:.1} output tokens/s with {} concurrent requests (engine loop, no HTTP)",
            a.batch
        );
    }
    let peak_rss = peak_rss_bytes();
    println!("peak RSS    {}", bytes(peak_rss));
    if on_gpu {
        println!(
            "device mem  {} after load, {} at most while decoding batches",
            bytes(memory_after_load),
            bytes(memory_peak)
        );
    }
    let result = json!({
        "model": loaded.dir.display().to_string(),
        "offload_miss_costs": miss_costs,
        "offload_prefetch": clap::ValueEnum::to_possible_value(&a.model.offload.offload_prefetch)
            .map(|v| v.get_name().to_string()),
        "offload_copy_behind": a.model.offload.offload_copy_behind,
        "routing_skew": a.routing_skew,
        "backend": backend_name,
        "threads": kimi_cpu::num_threads(),
        "total_params": total_params, "active_params": active_params,
        "load_secs": load_secs,
        "measured_read_bandwidth_bytes_per_sec": bandwidth,
        "runs": runs,
        "decode_batches": batches,
        "batch": a.batch,
        "batch_output_tokens_per_sec": engine_batch,
        "peak_rss_bytes": peak_rss,
        "device_memory_used_after_load_bytes": on_gpu.then_some(memory_after_load),
        "device_memory_used_peak_bytes": on_gpu.then_some(memory_peak),
    });
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
        println!("saved       {}", path.display());
    }
    Ok(())
}

/// A deterministic prompt of `len` ids spread over the vocabulary; `salt` makes prompts differ.
fn bench_prompt(len: usize, vocab: u64, salt: u64) -> Vec<u32> {
    (0..len as u64)
        .map(|i| ((i * 2654435761 + salt * 40503) % vocab) as u32)
        .collect()
}

/// Bytes of device memory in use (0 on the CPU).
fn device_memory_used<B: Backend>(backend: &B) -> u64 {
    backend
        .memory_info()
        .map_or(0, |(free, total)| total.saturating_sub(free))
}

/// What timing decode steps of a batch found.
struct BatchTiming {
    median_step_secs: f64,
    min_step_secs: f64,
    prefill_secs: f64,
    memory_used: u64,
    /// The expert tiers' counters over the timed decode steps (with offloaded experts).
    offload: Option<kimi_model::OffloadCounts>,
    /// The same over the batch's prefill.
    prefill_offload: Option<kimi_model::OffloadCounts>,
    /// Routed pairs per expert of each layer over the timed decode steps.
    routed: Vec<Vec<u64>>,
}

/// Under expert parallelism, how evenly the measured steps' routed pairs fell on the ranks'
/// experts (the largest rank's over the mean, averaged over the MoE layers), for the
/// placement in use and for the one `--expert-load` or `--enable-eplb` would make of these
/// counts; printed, and returned for the JSON.
fn expert_rank_balance<B: kimi_ops::Backend>(
    model: &dyn kimi_model::CausalLm<B>,
    routed: &[Vec<u64>],
) -> Option<serde_json::Value> {
    let placement = model.expert_ranks()?;
    let loads: kimi_model::parallel::ExpertLoads = routed
        .iter()
        .enumerate()
        .filter(|(_, c)| c.iter().any(|&n| n > 0))
        .map(|(l, c)| (l, c.clone()))
        .collect();
    let now = placement.mean_imbalance(&loads);
    let balanced = kimi_model::parallel::ExpertPlacement::balanced(&loads, placement.world())
        .ok()
        .map(|b| b.mean_imbalance(&loads));
    println!(
        "  ranks     the busiest rank's experts took {now:.2}x the mean of routed pairs{}",
        balanced.map_or(String::new(), |b| format!(
            " ({b:.2}x placed by these counts)"
        ))
    );
    Some(json!({"world": placement.world(), "imbalance": now, "balanced_imbalance": balanced}))
}

/// The share of routed pairs the most-used `fraction` of each MoE layer's experts took,
/// averaged over the layers (`fraction` itself where routing is uniform); `None` without
/// routed experts.
fn routing_concentration(routed: &[Vec<u64>], fraction: f64) -> Option<f64> {
    let shares: Vec<f64> = routed
        .iter()
        .filter(|counts| counts.iter().any(|&c| c > 0))
        .map(|counts| {
            let mut sorted = counts.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let top = ((counts.len() as f64 * fraction).round() as usize).max(1);
            let total: u64 = sorted.iter().sum();
            sorted[..top.min(sorted.len())].iter().sum::<u64>() as f64 / total as f64
        })
        .collect();
    (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
}

/// Prefills `batch` sequences with `context` tokens each (several sequences per forward pass,
/// at most ~8K tokens), then times `steps` forward passes that decode one token for every
/// sequence: the model's own batched decode, without scheduler, each next token picked
/// greedily on the backend as the serving engine does for greedy requests.
fn decode_batch<B: Backend>(
    model: &dyn CausalLm<B>,
    batch: usize,
    context: usize,
    steps: usize,
    vocab: u64,
) -> anyhow::Result<BatchTiming> {
    anyhow::ensure!(
        context + steps < model.max_context(),
        "--context {context} + --decode-steps {steps} exceed the model's context"
    );
    // One pool for the batch: each sequence gets its own run of blocks and a state slot.
    let block_size = kimi_model::SINGLE_BLOCK_SIZE;
    let per_seq = (context + steps + 1).div_ceil(block_size);
    let mut pool = model.new_pool(batch * per_seq, block_size, batch)?;
    let mut caches: Vec<SeqCache> = (0..batch)
        .map(|s| {
            let first = (s * per_seq) as u32;
            SeqCache::new(s as u32, (first..first + per_seq as u32).collect())
        })
        .collect();
    let opts = ForwardOptions {
        greedy_ids: true,
        ..ForwardOptions::default()
    };
    let before_prefill = model.offload_counts();
    let prefill_start = Instant::now();
    let per_pass = (8192 / context).max(1);
    let mut last = vec![0u32; batch];
    for first in (0..batch).step_by(per_pass) {
        let group = first..(first + per_pass).min(batch);
        let mut b = Batch::default();
        for s in group.clone() {
            let start = b.tokens.len();
            b.tokens.extend(bench_prompt(context, vocab, s as u64 + 1));
            b.segments.push(Segment {
                start,
                len: context,
            });
            b.logits_rows.push(b.tokens.len() - 1);
        }
        let mut refs: Vec<&mut SeqCache> = caches[group.clone()].iter_mut().collect();
        let out = model.forward(&b, &mut pool, &mut refs, opts)?;
        for (s, &id) in group.zip(&out.token_ids) {
            last[s] = id;
        }
    }
    let prefill_secs = prefill_start.elapsed().as_secs_f64();
    let mut times = Vec::with_capacity(steps);
    let mut memory_used = 0;
    let offload_before = model.offload_counts();
    let mut routed: Vec<Vec<u64>> = Vec::new();
    for _ in 0..steps {
        let b = Batch {
            tokens: last.clone(),
            segments: (0..batch).map(|s| Segment { start: s, len: 1 }).collect(),
            logits_rows: (0..batch).collect(),
            sampling: None,
        };
        let mut refs: Vec<&mut SeqCache> = caches.iter_mut().collect();
        let t = Instant::now();
        let out = model.forward(&b, &mut pool, &mut refs, opts)?;
        times.push(t.elapsed().as_secs_f64());
        routed.resize_with(routed.len().max(out.expert_counts.len()), Vec::new);
        for (sum, counts) in routed.iter_mut().zip(&out.expert_counts) {
            sum.resize(sum.len().max(counts.len()), 0);
            for (s, &c) in sum.iter_mut().zip(counts) {
                *s += u64::from(c);
            }
        }
        memory_used = memory_used.max(device_memory_used(model.backend()));
        anyhow::ensure!(out.token_ids.len() == batch, "one token per sequence");
        last.copy_from_slice(&out.token_ids);
    }
    times.sort_by(f64::total_cmp);
    let offload = match (offload_before, model.offload_counts()) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let prefill_offload = match (before_prefill, offload_before) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    Ok(BatchTiming {
        median_step_secs: times[times.len() / 2],
        min_step_secs: times[0],
        prefill_secs,
        memory_used,
        offload,
        prefill_offload,
        routed,
    })
}

/// Average stored bytes per parameter (2 for bf16 checkpoints).
fn weight_bytes_per_param(dir: &std::path::Path, total_params: u64) -> f64 {
    match kimi_weights::Checkpoint::open(dir) {
        Ok(c) if total_params > 0 => c.total_bytes() as f64 / total_params as f64,
        _ => 2.0,
    }
}

/// Bytes per second for summing a 512 MiB buffer on every worker thread.
fn measure_host_read_bandwidth() -> f64 {
    // Integer sums vectorize (f32 ones are a serial chain of adds: that measured the adder,
    // 9 GB/s on a machine whose two cores read 25 GB/s from DRAM).
    let data = vec![1u64; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = data
            .par_chunks(1 << 15)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (data.len() * 8) as f64 / best
}

/// Peak resident memory of this process (Linux `VmHWM`), 0 where unknown.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Output tokens per second of `a.batch` concurrent requests through the serving engine.
fn batched_throughput<B: Backend + 'static>(
    engine: kimi_engine::Engine<B>,
    a: &BenchArgs,
    prompt: &[u32],
) -> anyhow::Result<f64> {
    use kimi_engine::{EngineHandle, Event, Request, ServingConfig};
    let max_model_len = prompt.len() + a.gen_len + 1;
    let block_size = 16;
    let config = ServingConfig {
        max_model_len,
        max_num_seqs: a.batch,
        max_num_batched_tokens: (prompt.len() * 2).max(a.batch),
        block_size,
        num_blocks: a.batch * max_model_len.div_ceil(block_size) + 1,
        max_waiting: a.batch,
        expert_rebalance: None,
    };
    let handle = EngineHandle::spawn(engine.into_model(), config)?;
    let params = SamplingParams {
        max_tokens: a.gen_len,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    // Best of `--repeats` waves through one engine, as the single-sequence figures; the
    // first wave also pays one-time costs (CUDA graph captures per batch size).
    let mut best = 0.0f64;
    for _ in 0..a.repeats {
        let before = handle.metrics();
        let start = Instant::now();
        let mut receivers = Vec::with_capacity(a.batch);
        for i in 0..a.batch {
            // Different prompts so no two requests are identical.
            let mut p = prompt.to_vec();
            p[0] = (i as u32) % (handle.vocab_size() as u32);
            let request = Request {
                prompt: p,
                params: params.clone(),
                eos_ids: vec![],
                logits_processor: None,
            };
            receivers.push(
                handle
                    .submit(request)
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .1,
            );
        }
        let mut tokens = 0usize;
        for mut rx in receivers {
            while let Some(event) = rx.blocking_recv() {
                match event {
                    Event::Token(_) => tokens += 1,
                    Event::Finished { .. } => break,
                    Event::Error(e) => anyhow::bail!("batched request failed: {e}"),
                    // Bench requests sample; they never search beams.
                    Event::Started { .. } | Event::Beams(_) => {}
                }
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let after = handle.metrics();
        let steps = after.steps_total - before.steps_total;
        // How the wave was scheduled, comparable with a server's `kimi:engine_step*` counters.
        // A step is one forward pass; its tokens are every position fed to it (prompt-chunk
        // tokens plus one per decoding sequence), not output tokens.
        println!(
            "wave        {:.1} output tokens/s: {steps} steps, {:.1} tokens/step (prompt + decode tokens fed per forward pass), {:.3} s in passes of {wall:.3} s",
            tokens as f64 / wall,
            (after.step_tokens_total - before.step_tokens_total) as f64 / steps.max(1) as f64,
            after.step_seconds_total - before.step_seconds_total,
        );
        best = best.max(tokens as f64 / wall);
    }
    handle.shutdown(false);
    Ok(best)
}
