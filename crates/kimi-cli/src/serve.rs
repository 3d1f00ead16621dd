//! `kimi-infer serve`: the OpenAI-compatible server over the continuous-batching engine.

use std::sync::Arc;

use anyhow::Context;
use kimi_engine::{EngineHandle, ServingConfig};
use kimi_model::{Batch, CausalLm, ForwardOptions};
use kimi_ops::{Backend, Segment};
use kimi_server::{AppState, ServerConfig};
use tokio::net::TcpListener;

use crate::args::ServeArgs;
use crate::cache_plan::{self, Budget, Shape, DEFAULT_CPU_UTILIZATION, DEFAULT_GPU_UTILIZATION};
use crate::load::ModelInfo;
use crate::memory::HostMemory;

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let prepared = prepare(&a)?;
    run(prepared, &a)
}

/// A loaded model with its engine thread, ready to be served: `serve` runs it on its
/// own port; `agent --model` serves it in-process on a loopback port.
pub struct Prepared {
    pub config: ServerConfig,
    pub engine: EngineHandle,
    pub tokenizer: Arc<kimi_tokenizer::Tokenizer>,
    banner: Banner,
}

impl Prepared {
    /// The model, described for a log line.
    pub fn model_description(&self) -> &str {
        &self.banner.model
    }
}

/// Loads the model and starts its engine from `serve`'s flags.
pub fn prepare(a: &ServeArgs) -> anyhow::Result<Prepared> {
    if let Some(u) = a.model.gpu_memory_utilization {
        anyhow::ensure!(
            u > 0.0 && u <= 1.0,
            "--gpu-memory-utilization must be in (0, 1], got {u}"
        );
    }
    crate::load::with_backend!(a.model, |backend| prepare_on(backend, a))
}

fn prepare_on<B: Backend + 'static>(backend: B, a: &ServeArgs) -> anyhow::Result<Prepared> {
    // Flags first: a bad one should not wait for the weights to load.
    let mut shape = Shape {
        block_size: a.block_size,
        max_num_seqs: a.max_num_seqs,
        max_model_len: a.max_model_len.unwrap_or(2),
        max_num_batched_tokens: a.max_num_batched_tokens,
        values_per_token: 0,
        values_per_slot: 0,
    };
    shape.validate()?;
    let named_keys = a.keys.named_keys()?;
    let tls = a.tls.load()?;
    let cors = a.cors.config();
    let mut loaded = match &a.random_config {
        Some(config) => {
            crate::load::load_random(backend, config, kimi_core::DType::BF16, &a.model, 0.0)?
        }
        None => crate::load::load(backend, &a.model, a.tokenizer.is_none())?,
    };
    if let Some(dir) = &a.tokenizer {
        let dir = &crate::hub::resolve_path("--tokenizer", dir, a.model.download)?;
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
    let context = loaded.engine.model().max_context();
    let max_model_len = a.max_model_len.unwrap_or(context.min(32768));
    anyhow::ensure!(
        max_model_len <= context,
        "--max-model-len {max_model_len} is more than the model's context of {context} tokens"
    );
    // The pool's real layout: values per token over the block-pooled layers, values per
    // state slot over the KDA layers.
    let specs = loaded.engine.model().cache_specs();
    shape.max_model_len = max_model_len;
    shape.values_per_token = specs
        .iter()
        .map(|s| match (s, a.model.kv_cache_dtype) {
            // An FP8 latent row is a byte per value and two f32 scales (on the CPU and on
            // CUDA alike): in f32 values, rounded up.
            (kimi_model::LayerSpec::Mla { width }, kimi_ops::KvCacheDtype::Fp8) => {
                kimi_ops::KvCacheDtype::Fp8
                    .latent_row_bytes(*width)
                    .div_ceil(4) as u64
            }
            // f16 keys and values: two values per f32.
            (kimi_model::LayerSpec::Kv { width }, kimi_ops::KvCacheDtype::F16) => *width as u64,
            _ => s.values_per_token() as u64,
        })
        .sum();
    shape.values_per_slot = specs.iter().map(|s| s.values_per_slot() as u64).sum();
    let device = loaded.engine.model().backend().memory_info();
    let host = HostMemory::read();
    let plan = match a.num_gpu_blocks_override {
        Some(n) => {
            let room = match device {
                Some((free, _)) => Some(free),
                None => host.usable(),
            };
            cache_plan::fixed(&shape, n, room)?
        }
        None => {
            let budget = match device {
                Some((free, total)) => Budget::Device {
                    free,
                    total,
                    utilization: a
                        .model
                        .gpu_memory_utilization
                        .unwrap_or(DEFAULT_GPU_UTILIZATION),
                    workspace: step_workspace(loaded.engine.model(), a, max_model_len)?,
                },
                None => Budget::Host {
                    memory: host,
                    utilization: a
                        .model
                        .gpu_memory_utilization
                        .unwrap_or(DEFAULT_CPU_UTILIZATION),
                    fixed: a.kv_cache_memory_bytes,
                },
            };
            cache_plan::plan(&shape, budget)?
        }
    };
    let num_blocks = plan.num_blocks;
    let serving = ServingConfig {
        max_model_len,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        block_size: a.block_size,
        num_blocks,
        max_waiting: 4096,
        expert_rebalance: expert_rebalance(a, loaded.engine.model())?,
    };
    let chat_template = match &a.chat_template {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
        }
        None => None,
    };
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        match a.model.model.as_ref().or(a.random_config.as_ref()) {
            // A hub model is served under its repository id, as vLLM does.
            Some(path) if crate::hub::repo_name(path).is_some() => {
                crate::hub::repo_name(path).unwrap_or_default()
            }
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
        api_keys: a.keys.unnamed_keys(),
        keys: named_keys,
        tls,
        cors,
        chat_template,
        tool_call_parser: a.tool_call_parser,
        max_model_len: Some(max_model_len),
        keep_alive_timeout: secs(a.timeout_keep_alive),
        body_timeout: secs(a.timeout_body),
        request_timeout: secs(a.request_timeout),
        max_connections: max_connections(a.max_connections)?,
        shutdown_timeout: secs(a.shutdown_timeout),
        ..ServerConfig::default()
    };
    let banner = Banner {
        model: describe_model(&loaded),
        backend: loaded.engine.model().backend().name(),
        plan,
        shape,
        memory: match device {
            Some((free, total)) => format!(
                "{} of {} free on the device",
                cache_plan::gib(free),
                cache_plan::gib(total)
            ),
            None => host.describe(),
        },
    };
    let engine = EngineHandle::spawn(loaded.engine.into_model(), serving)?;
    Ok(Prepared {
        config,
        engine,
        tokenizer,
        banner,
    })
}

fn run(prepared: Prepared, a: &ServeArgs) -> anyhow::Result<()> {
    let Prepared {
        mut config,
        engine,
        tokenizer,
        banner,
    } = prepared;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let addr = format!("{}:{}", config.host, config.port);
        let signals = Signals::new()?;
        let lease_ttl = config
            .request_timeout
            .unwrap_or(std::time::Duration::from_secs(3600));
        config.limiter = a.keys.limiter(&config.keys, lease_ttl).await?;
        let state = AppState::new(config, Arc::new(engine.clone()), tokenizer)?;
        let listener = TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        banner.log(&state, listener.local_addr().ok());
        // Set when the model fails for good: the server ends with that error.
        let failed = Arc::new(std::sync::Mutex::new(None::<String>));
        let stop = {
            let (failed, engine) = (Arc::clone(&failed), engine.clone());
            let drain = a.shutdown_timeout;
            async move {
                let mut signals = signals;
                tokio::select! {
                    _ = signals.next() => announce_drain(drain),
                    why = model_failure(&engine) => {
                        tracing::error!("the model can run no more steps ({why}): shutting down");
                        *lock(&failed) = Some(why);
                    }
                }
                exit_on_later_signal(signals);
            }
        };
        kimi_server::serve_listener(listener, state, stop)
            .await
            .context("the server failed")?;
        let why = lock(&failed).take();
        match why {
            Some(why) => Err(anyhow::anyhow!("the model failed for good: {why}")),
            None => Ok(()),
        }
    });
    // Every connection has finished or was cut at the shutdown timeout (cancelling its
    // requests): nothing is left for the engine to finish.
    engine.shutdown(false);
    // Blocking tasks still tokenizing a request are not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// `--enable-eplb`'s settings, checked against the loaded model.
fn expert_rebalance<B: Backend>(
    a: &ServeArgs,
    model: &dyn kimi_model::CausalLm<B>,
) -> anyhow::Result<Option<kimi_engine::ExpertRebalance>> {
    if !a.enable_eplb {
        return Ok(None);
    }
    anyhow::ensure!(
        a.eplb_step_interval > 0,
        "--eplb-step-interval must be at least 1"
    );
    anyhow::ensure!(
        a.eplb_min_gain.is_finite() && a.eplb_min_gain >= 0.0,
        "--eplb-min-gain must be a fraction of 0 or more, not {}",
        a.eplb_min_gain
    );
    anyhow::ensure!(
        model.expert_ranks().is_some(),
        "--enable-eplb moves routed experts between ranks: it needs a MoE model over \
         --tensor-parallel-size 2 or more with --enable-expert-parallel"
    );
    Ok(Some(kimi_engine::ExpertRebalance {
        step_interval: a.eplb_step_interval,
        min_gain: a.eplb_min_gain,
    }))
}

/// "Kimi Linear, 48.0 B parameters (3.0 B active), 91.5 GiB of weights".
fn describe_model<B: Backend>(loaded: &crate::load::Loaded<B>) -> String {
    let kind = match &loaded.info {
        ModelInfo::Kimi(cfg) => match cfg.family {
            kimi_core::config::Family::KimiLinear => "Kimi Linear",
            kimi_core::config::Family::KimiK3 => "Kimi K3",
        },
        ModelInfo::Gguf { .. } => "llama (GGUF)",
    };
    let (total, active) = loaded.params();
    let active = if active == total {
        String::new()
    } else {
        format!(" ({} active)", count(active))
    };
    format!(
        "{} ({kind}, {} parameters{active}, {} of weights)",
        loaded.dir.display(),
        count(total),
        cache_plan::size(loaded.weight_bytes())
    )
}

/// "134.5 M".
fn count(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e12 => format!("{:.2} T", n / 1e12),
        n if n >= 1e9 => format!("{:.1} B", n / 1e9),
        n if n >= 1e6 => format!("{:.1} M", n / 1e6),
        n => format!("{n}"),
    }
}

/// What `serve` says when it starts.
struct Banner {
    model: String,
    backend: String,
    plan: cache_plan::CachePlan,
    shape: Shape,
    memory: String,
}

impl Banner {
    fn log(&self, state: &AppState, addr: Option<std::net::SocketAddr>) {
        let config = state.config();
        let (plan, shape) = (&self.plan, &self.shape);
        let tokens = plan.num_blocks * shape.block_size;
        let full = plan.num_blocks / plan.blocks_per_seq.max(1);
        tracing::info!("model   {}", self.model);
        tracing::info!(
            "cache   {} blocks of {} tokens ({tokens} tokens: {full} sequences of {} at full \
             length; --max-num-seqs {}), {}; memory: {}",
            plan.num_blocks,
            shape.block_size,
            shape.max_model_len,
            shape.max_num_seqs,
            cache_plan::size(plan.pool_bytes),
            self.memory
        );
        if !plan.holds_all {
            tracing::warn!(
                "the cache holds {full} of --max-num-seqs {} sequences at full length \
                 (--max-model-len {}); past that, requests wait or are preempted",
                shape.max_num_seqs,
                shape.max_model_len
            );
        }
        let threads = if self.backend.starts_with("cpu") {
            format!("{} CPU threads", kimi_cpu::num_threads())
        } else {
            self.backend.clone()
        };
        let secs = |d: Option<std::time::Duration>| {
            d.map_or("none".to_string(), |d| format!("{}s", d.as_secs_f64()))
        };
        tracing::info!(
            "compute {threads}; up to {} connections; timeouts: keep-alive {}, body {}, \
             request {}, shutdown {}",
            config.max_connections,
            secs(config.keep_alive_timeout),
            secs(config.body_timeout),
            secs(config.request_timeout),
            secs(config.shutdown_timeout)
        );
        let keys = config.api_keys.len() + config.keys.len();
        let scheme = if config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let url = addr.map_or_else(
            || format!("{scheme}://{}:{}", config.host, config.port),
            |a| format!("{scheme}://{a}"),
        );
        crate::access_args::log_access(
            keys,
            config.limiter.as_deref(),
            config.tls.is_some(),
            config.cors.as_ref(),
            &url,
        );
        if keys == 0 && !is_loopback(&config.host) {
            tracing::warn!(
                "listening on {} without --api-key: anyone who can reach this address can \
                 use the model",
                config.host
            );
        }
        tracing::info!(
            model = %config.served_model_name,
            "serving `{}` on {url}",
            config.served_model_name
        );
    }
}

/// Whether `host` only accepts connections from this machine.
pub fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A flag's seconds, 0 meaning "no limit".
pub fn secs(s: f64) -> Option<std::time::Duration> {
    (s > 0.0).then(|| std::time::Duration::from_secs_f64(s))
}

/// `--max-connections`, or 1024 lowered to leave room under the open-file limit for the
/// model's files and the refusals past the cap.
pub fn max_connections(flag: Option<usize>) -> anyhow::Result<usize> {
    const RESERVED: u64 = 128;
    let soft = open_file_limit();
    match flag {
        Some(0) => anyhow::bail!("--max-connections must be at least 1"),
        Some(n) => {
            if let Some(soft) = soft.filter(|&soft| n as u64 + RESERVED > soft) {
                tracing::warn!(
                    "--max-connections {n} is close to the open-file limit ({soft}, ulimit -n): \
                     accepting may fail before the cap is reached"
                );
            }
            Ok(n)
        }
        None => {
            Ok(soft.map_or(1024, |soft| soft.saturating_sub(RESERVED).clamp(16, 1024)) as usize)
        }
    }
}

/// The soft limit on open files (`ulimit -n`), from /proc/self/limits.
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Resolves once the engine's model can run no more steps (a rank process of a split model
/// died), with why: the server ends rather than answer every request with an error.
async fn model_failure(engine: &EngineHandle) -> String {
    loop {
        if let Some(why) = engine.metrics().model_failure {
            return why;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Resolves on the first Ctrl-C or SIGTERM; a second one exits the process at once.
pub async fn shutdown_signal(mut signals: Signals, drain_secs: f64) {
    signals.next().await;
    announce_drain(drain_secs);
    exit_on_later_signal(signals);
}

fn announce_drain(drain_secs: f64) {
    let deadline = if drain_secs > 0.0 {
        format!("up to {drain_secs}s")
    } else {
        "no time limit".into()
    };
    tracing::info!(
        "shutting down: finishing running requests ({deadline}; signal again to exit now)"
    );
}

/// Once shutting down, a later signal exits at once. One within a second of the first is
/// the same request: a signal sent to a process group (a terminal's Ctrl-C, systemd's stop)
/// reaches a rank launcher's rank 0 both directly and passed on by the launcher.
fn exit_on_later_signal(mut signals: Signals) {
    let first = std::time::Instant::now();
    tokio::spawn(async move {
        loop {
            signals.next().await;
            if first.elapsed() >= std::time::Duration::from_secs(1) {
                tracing::warn!("second signal: exiting without finishing requests");
                std::process::exit(1);
            }
        }
    });
}

/// SIGINT (Ctrl-C) and SIGTERM as one stream. The handlers are installed when this is
/// made (inside the runtime), before the server says it is up: a signal sent as soon as
/// the banner appears must not find the default action, which kills the process.
pub struct Signals {
    #[cfg(unix)]
    handlers: Vec<tokio::signal::unix::Signal>,
}

impl Signals {
    pub fn new() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let handlers = [SignalKind::interrupt(), SignalKind::terminate()]
                .into_iter()
                .map(signal)
                .collect::<Result<_, _>>()
                .context("cannot install the SIGINT / SIGTERM handlers")?;
            Ok(Signals { handlers })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        {
            let [int, term] = &mut self.handlers[..] else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = int.recv() => {},
                _ = term.recv() => {},
            }
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
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
        tracing::info!(
            "a {n}-token step needs {} of workspace (measured)",
            cache_plan::gib(bytes)
        );
    }
    Ok(workspace)
}
