//! `kimi-infer bench`: prefill and decode throughput, peak memory, and decode bandwidth
//! against the machine's measured memory bandwidth.

use std::time::Instant;

use kimi_engine::sampling::SamplingParams;
use kimi_model::ModelSummary;
use rayon::prelude::*;
use serde_json::json;

use crate::args::{BenchArgs, RandomDType};
use crate::inspect::bytes;
use crate::load::ModelInfo;

pub fn bench(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.prompt_len >= 1 && a.gen_len >= 2 && a.repeats >= 1,
        "need --prompt-len >= 1, --gen-len >= 2, --repeats >= 1"
    );
    let load_start = Instant::now();
    let (loaded, bytes_per_param) = match &a.random_config {
        Some(cfg) => {
            let dtype = match a.random_dtype {
                RandomDType::Bf16 => kimi_core::DType::BF16,
                RandomDType::F32 => kimi_core::DType::F32,
            };
            (
                crate::load::load_random(cfg, dtype)?,
                Some(dtype.size_bytes() as f64),
            )
        }
        None => (crate::load::load(&a.model, false)?, None),
    };
    let load_secs = load_start.elapsed().as_secs_f64();
    let engine = &loaded.engine;
    let vocab = engine.model().vocab_size() as u64;
    let prompt: Vec<u32> = (0..a.prompt_len)
        .map(|i| ((i as u64 * 2654435761) % vocab) as u32)
        .collect();
    let params = SamplingParams {
        max_tokens: a.gen_len,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let (mut best_prefill, mut best_decode) = (f64::MAX, f64::MAX);
    for _ in 0..a.repeats {
        let g = engine.generate(&prompt, &params, &[], |_| {
            std::ops::ControlFlow::Continue(())
        })?;
        best_prefill = best_prefill.min(g.prefill_secs);
        // The first token comes from the prefill logits; each later one costs a decode step.
        best_decode = best_decode.min(g.decode_secs / (g.tokens.len().max(2) - 1) as f64);
    }
    let (total_params, active_params) = match &loaded.info {
        ModelInfo::Kimi(cfg) => {
            let s = ModelSummary::new(cfg);
            (s.params.total, s.params.active)
        }
        ModelInfo::Gguf { .. } => (0, 0),
    };
    let ckpt_bytes_per_param =
        bytes_per_param.unwrap_or_else(|| weight_bytes_per_param(&loaded.dir, total_params));
    let weight_bytes_per_token = loaded.weight_bytes_per_token(ckpt_bytes_per_param);
    // Recurrent state is read and written once per token; the cache is read once (f32 on the CPU).
    let (cache_per_token, state_per_seq) = loaded.cache_values();
    let state_bytes_per_token = 2.0 * 4.0 * state_per_seq as f64
        + 4.0 * cache_per_token as f64 * (a.prompt_len + a.gen_len / 2) as f64;
    let bytes_per_token = weight_bytes_per_token + state_bytes_per_token;
    let decode_tps = 1.0 / best_decode;
    let achieved = bytes_per_token * decode_tps;
    let bandwidth = measure_read_bandwidth();
    let batch = if a.batch > 0 {
        Some(batched_throughput(loaded.engine, &a, &prompt)?)
    } else {
        None
    };
    let peak_rss = peak_rss_bytes();
    let result = json!({
        "batch": a.batch,
        "batch_output_tokens_per_sec": batch,
        "model": loaded.dir.display().to_string(),
        "backend": format!("cpu ({} threads)", kimi_cpu::num_threads()),
        "total_params": total_params, "active_params": active_params,
        "load_secs": load_secs,
        "prompt_len": a.prompt_len, "gen_len": a.gen_len,
        "prefill_tokens_per_sec": a.prompt_len as f64 / best_prefill,
        "decode_tokens_per_sec": decode_tps,
        "decode_bytes_per_token": bytes_per_token,
        "decode_bytes_per_sec": achieved,
        "measured_read_bandwidth_bytes_per_sec": bandwidth,
        "decode_bandwidth_fraction": achieved / bandwidth,
        "peak_rss_bytes": peak_rss,
    });
    println!(
        "model       {} ({} params, {} active)",
        loaded.dir.display(),
        total_params,
        active_params
    );
    println!("backend     cpu, {} threads", kimi_cpu::num_threads());
    println!(
        "prefill     {:.1} tokens/s ({} tokens in {:.3} s)",
        a.prompt_len as f64 / best_prefill,
        a.prompt_len,
        best_prefill
    );
    println!(
        "decode      {:.2} tokens/s ({:.1} ms/token)",
        decode_tps,
        best_decode * 1e3
    );
    println!(
        "bandwidth   {} read per token -> {}/s, {:.0}% of the measured {}/s",
        bytes(bytes_per_token as u64),
        bytes(achieved as u64),
        100.0 * achieved / bandwidth,
        bytes(bandwidth as u64)
    );
    if let Some(tps) = batch {
        println!("batched     {tps:.1} output tokens/s with {} concurrent requests (engine loop, no HTTP)", a.batch);
    }
    println!("peak RSS    {}", bytes(peak_rss));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
        println!("saved       {}", path.display());
    }
    Ok(())
}

/// Average stored bytes per parameter (2 for bf16 checkpoints).
fn weight_bytes_per_param(dir: &std::path::Path, total_params: u64) -> f64 {
    match kimi_weights::Checkpoint::open(dir) {
        Ok(c) if total_params > 0 => c.total_bytes() as f64 / total_params as f64,
        _ => 2.0,
    }
}

/// Bytes per second for summing a 512 MiB buffer on every worker thread.
fn measure_read_bandwidth() -> f64 {
    let data = vec![1.0f32; 128 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = data
            .par_chunks(1 << 16)
            .map(|c| c.iter().sum::<f32>())
            .sum();
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (data.len() * 4) as f64 / best
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
fn batched_throughput(
    engine: kimi_engine::Engine<kimi_cpu::CpuBackend>,
    a: &BenchArgs,
    prompt: &[u32],
) -> anyhow::Result<f64> {
    use kimi_engine::{EngineHandle, Event, Request, ServingConfig};
    let max_model_len = a.prompt_len + a.gen_len + 1;
    let block_size = 16;
    let config = ServingConfig {
        max_model_len,
        max_num_seqs: a.batch,
        max_num_batched_tokens: (a.prompt_len * 2).max(a.batch),
        block_size,
        num_blocks: a.batch * max_model_len.div_ceil(block_size) + 1,
        max_waiting: a.batch,
    };
    let handle = EngineHandle::spawn(engine.into_model(), config)?;
    let params = SamplingParams {
        max_tokens: a.gen_len,
        ignore_eos: true,
        ..SamplingParams::default()
    };
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
                Event::Started { .. } => {}
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    handle.shutdown(false);
    Ok(tokens as f64 / secs)
}
