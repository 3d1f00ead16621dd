//! `kimi-infer serve`: the OpenAI-compatible server over the continuous-batching engine.

use std::sync::Arc;

use anyhow::Context;
use kimi_engine::{EngineHandle, ServingConfig};
use kimi_model::{Batch, CausalLm, ForwardOptions};
use kimi_ops::{Backend, Segment};
use kimi_server::ServerConfig;

use crate::args::ServeArgs;

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.gpu_memory_utilization > 0.0 && a.gpu_memory_utilization <= 1.0,
        "--gpu-memory-utilization must be in (0, 1]"
    );
    crate::load::with_backend!(a.model, |backend| serve_on(backend, a))
}

fn serve_on<B: Backend + 'static>(backend: B, a: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.block_size > 0, "--block-size must be at least 1");
    let mut loaded = match &a.random_config {
        Some(config) => crate::load::load_random(backend, config, kimi_core::DType::BF16)?,
        None => crate::load::load(backend, &a.model, a.tokenizer.is_none())?,
    };
    if let Some(dir) = &a.tokenizer {
        loaded.tokenizer = Some(
            kimi_tokenizer::Tokenizer::from_dir(dir)
                .with_context(|| format!("cannot load the tokenizer in {}", dir.display()))?,
        );
    }
    let tokenizer = Arc::new(
        loaded
            .tokenizer
            .take()
            .context("the model has no tokenizer")?,
    );
    let max_model_len = a
        .max_model_len
        .unwrap_or(loaded.engine.model().max_context().min(32768));
    // The pool's real layout: values per token over the block-pooled layers, values per
    // state slot over the KDA layers.
    let specs = loaded.engine.model().cache_specs();
    let per_token: u64 = specs.iter().map(|s| s.values_per_token() as u64).sum();
    let per_slot: u64 = specs.iter().map(|s| s.values_per_slot() as u64).sum();
    let workspace = match a.num_gpu_blocks_override {
        Some(_) => None,
        None => step_workspace(loaded.engine.model(), &a, max_model_len)?,
    };
    let memory = loaded.engine.model().backend().memory_info();
    let num_blocks = match a.num_gpu_blocks_override {
        Some(n) => n,
        None => cache_blocks(&a, (per_token, per_slot), max_model_len, memory, workspace)?,
    };
    let pool_bytes = 4
        * (num_blocks as u64 * a.block_size as u64 * per_token + a.max_num_seqs as u64 * per_slot);
    let serving = ServingConfig {
        max_model_len,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        block_size: a.block_size,
        num_blocks,
        max_waiting: 4096,
    };
    let engine = EngineHandle::spawn(loaded.engine.into_model(), serving)?;
    let chat_template = match &a.chat_template {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
        }
        None => None,
    };
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        match a.model.model.as_ref().or(a.random_config.as_ref()) {
            Some(dir) => dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "kimi".into()),
            None => "kimi-demo".into(),
        }
    });
    let config = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        served_model_name: name,
        api_keys: a
            .api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect(),
        chat_template,
        max_model_len: Some(max_model_len),
        ..ServerConfig::default()
    };
    eprintln!(
        "serving {} on http://{}:{} ({} cache blocks of {} tokens, up to {} sequences, \
         cache pool {:.2} GiB)",
        loaded.dir.display(),
        a.host,
        a.port,
        num_blocks,
        a.block_size,
        a.max_num_seqs,
        pool_bytes as f64 / (1u64 << 30) as f64
    );
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let result = runtime.block_on(kimi_server::serve(
        config,
        engine.clone(),
        tokenizer,
        shutdown_signal(),
    ));
    // The listener has stopped taking requests; let the running ones finish.
    engine.shutdown(true);
    result.context("the server failed")
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("shutting down: finishing running requests");
}

/// The device memory one engine step needs besides weights and caches, measured as vLLM's
/// profile run does: a pass over `max_num_batched_tokens` prompt tokens of one sequence
/// with up to `max_num_seqs` logits rows, on a cache of its own that is freed afterwards.
/// Afterwards the backend returns its unused memory, so that free memory counts weights
/// only. `None` where the backend does not track its allocations (the CPU).
fn step_workspace<B: Backend>(
    model: &dyn CausalLm<B>,
    a: &ServeArgs,
    max_model_len: usize,
) -> anyhow::Result<Option<u64>> {
    let be = model.backend();
    if be.memory_info().is_none() {
        // Host memory: the budget is a fraction of free RAM, no pass needed.
        return Ok(None);
    }
    let n = a.max_num_batched_tokens.min(max_model_len).max(1);
    let rows = n.min(a.max_num_seqs.max(1));
    let vocab = model.vocab_size().max(1);
    let batch = Batch {
        tokens: (0..n).map(|i| (i % vocab) as u32).collect(),
        segments: vec![Segment { start: 0, len: n }],
        logits_rows: (n - rows..n).collect(),
        sampling: None,
    };
    let (mut pool, mut seq) = model.single_cache(n)?;
    let options = ForwardOptions {
        greedy_ids: true,
        ..ForwardOptions::default()
    };
    let (out, workspace) =
        be.measure_workspace(|| model.forward(&batch, &mut pool, &mut [&mut seq], options));
    out.context("the memory-profiling pass failed")?;
    drop((pool, seq));
    be.release_unused_memory()?;
    if let Some(bytes) = workspace {
        eprintln!(
            "a {n}-token step needs {:.2} GiB of workspace (measured)",
            bytes as f64 / (1u64 << 30) as f64
        );
    }
    Ok(workspace)
}

/// Cache blocks that fit in the memory budget next to `max_num_seqs` KDA state slots,
/// capped at what `max_num_seqs` full-length sequences could use; the engine allocates
/// exactly this pool at start. Both backends keep caches in f32; `per_token`/`per_seq` count
/// cache values. On a GPU (`device_memory` = free and total bytes after the weights were
/// loaded) the budget is vLLM's: `--gpu-memory-utilization` of the total, minus what is
/// already used, minus one step's workspace (`workspace` as measured by [`step_workspace`],
/// else a generous 64 KiB per batched token); on the CPU it is that fraction of free RAM.
fn cache_blocks(
    a: &ServeArgs,
    (per_token, per_seq): (u64, u64),
    max_model_len: usize,
    device_memory: Option<(u64, u64)>,
    workspace: Option<u64>,
) -> anyhow::Result<usize> {
    let per_seq_blocks = max_model_len.div_ceil(a.block_size);
    let wanted = a.max_num_seqs * per_seq_blocks;
    let block_bytes = (a.block_size as u64 * per_token * 4).max(1);
    let state_bytes = per_seq * 4 * a.max_num_seqs as u64;
    let budget = match device_memory {
        Some((free, total)) => {
            let used = total.saturating_sub(free);
            let workspace = workspace.unwrap_or(a.max_num_batched_tokens as u64 * (64 << 10));
            ((total as f64 * a.gpu_memory_utilization) as u64)
                .saturating_sub(used)
                .saturating_sub(workspace)
        }
        None => {
            let Some(available) = mem_available_bytes() else {
                return Ok(wanted);
            };
            (available as f64 * a.gpu_memory_utilization) as u64
        }
    };
    let blocks = budget.saturating_sub(state_bytes) / block_bytes;
    let blocks = (blocks as usize).min(wanted);
    anyhow::ensure!(
        blocks >= per_seq_blocks,
        "not enough memory for one {max_model_len}-token sequence's cache; lower --max-model-len"
    );
    Ok(blocks)
}

/// Linux `MemAvailable`.
fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}
