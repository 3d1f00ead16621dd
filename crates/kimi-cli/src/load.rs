//! Resolving `--model` and loading checkpoint, model and tokenizer.
//!
//! `--model` is a checkpoint directory (config.json + safetensors: Kimi Linear or Kimi K3) or
//! a `.gguf` file, or a hub repository `org/name[@revision]` that `crate::hub` resolves to
//! its snapshot in the Hugging Face cache; `kimi_model::registry` decides which model
//! definition loads it. Without it, the real demo model
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` is used when `scripts/fetch_demo_model.sh` has
//! fetched it, else the tiny random Kimi Linear compiled into the binary.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kimi_core::ModelConfig;
use kimi_engine::Engine;
use kimi_gguf::GgufFile;
use kimi_model::{registry, LoadedModel, ModelSummary};
use kimi_ops::Backend;
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

use crate::args::ModelArgs;
use crate::parallel::{Ranks, Split};

/// Where the demo GGUF lands, relative to the repository root.
pub const DEMO_GGUF: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// What kind of model was loaded, with what the commands need to know about it.
pub enum ModelInfo {
    /// Kimi Linear from a Hugging Face checkpoint.
    Kimi(Box<ModelConfig>),
    /// A llama-family model (GGUF file or checkpoint): parameters (every stored value),
    /// weight bytes and KV-cache values per token.
    Gguf {
        params: u64,
        weight_bytes: u64,
        kv_values_per_token: u64,
    },
}

/// Runs `$body` with `$b` bound to a fresh backend for the `--device` (and CPU matmul mode)
/// of `$args` ([`crate::args::ModelArgs`]).
/// Commands are generic over the backend; this is the one place that names them.
macro_rules! with_backend {
    ($args:expr, |$b:ident| $body:expr) => {{
        let (device, int8_matmul) = ($args.device, $args.int8_matmul);
        #[cfg(feature = "cuda")]
        let bf16_activations = $args.bf16_activations;
        match device {
            $crate::args::Device::Cpu => {
                if $args.bf16_activations {
                    anyhow::bail!("--bf16-activations applies to --device cuda only");
                }
                let $b = kimi_cpu::CpuBackend::with_quant_matmul(if int8_matmul {
                    kimi_cpu::QuantMatmul::Int8
                } else {
                    kimi_cpu::QuantMatmul::F32
                })
                .with_kv_cache_dtype($args.kv_cache_dtype);
                $body
            }
            #[cfg(feature = "cuda")]
            $crate::args::Device::Cuda(ordinal) => {
                // CUDA keeps MLA latent caches only (no attention caches yet): f32 or FP8.
                if $args.kv_cache_dtype == kimi_ops::KvCacheDtype::F16 {
                    anyhow::bail!(
                        "--kv-cache-dtype f16 applies to attention caches, which --device cuda \
                         does not run yet; CUDA's MLA latent caches take auto, f32 or fp8"
                    );
                }
                // The kernel choices: the `KIMI_CUDA_*` variables, then the flags.
                let mut config = kimi_cuda::KernelConfig::from_env();
                if bf16_activations {
                    config.precision = kimi_cuda::GemmPrecision::Half;
                }
                config.kv_cache = $args.kv_cache_dtype;
                let $b = kimi_cuda::CudaBackend::with_config(ordinal, config)
                    .map_err(|e| anyhow::anyhow!("cannot start CUDA device {ordinal}: {e}"))?;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            $crate::args::Device::Cuda(_) => anyhow::bail!(
                "this kimi-infer was built without CUDA support; rebuild with \
                 `cargo build --release -p kimi-cli --features cuda` (see scripts/cuda/setup.sh)"
            ),
        }
    }};
}
pub(crate) use with_backend;

/// A loaded model with its tokenizer (when one was asked for).
pub struct Loaded<B: Backend> {
    pub engine: Engine<B>,
    pub tokenizer: Option<Tokenizer>,
    pub dir: PathBuf,
    pub info: ModelInfo,
    /// Weight bytes a decoded token reads, counted from a Kimi GGUF's stored tensors (their
    /// types differ from the config's dtype); `None` elsewhere: from the config.
    pub stored_read_bytes_per_token: Option<u64>,
}

impl<B: Backend> Loaded<B> {
    /// Bytes of weights one decoded token reads.
    pub fn weight_bytes_per_token(&self, bytes_per_param: f64) -> f64 {
        if let Some(bytes) = self.stored_read_bytes_per_token {
            return bytes as f64;
        }
        match &self.info {
            // MXFP4 experts read 17/32 bytes per value: the summary counts every component
            // in its stored format.
            ModelInfo::Kimi(cfg)
                if cfg
                    .moe
                    .as_ref()
                    .is_some_and(|m| m.expert_format == kimi_core::config::ExpertFormat::Mxfp4) =>
            {
                ModelSummary::new(cfg).read_bytes_per_token() as f64
            }
            ModelInfo::Kimi(cfg) => ModelSummary::new(cfg).params.active as f64 * bytes_per_param,
            ModelInfo::Gguf { weight_bytes, .. } => *weight_bytes as f64,
        }
    }

    /// Total and active parameters (a dense GGUF model uses them all for every token).
    pub fn params(&self) -> (u64, u64) {
        match &self.info {
            ModelInfo::Kimi(cfg) => {
                let s = ModelSummary::new(cfg);
                (s.params.total, s.params.active)
            }
            ModelInfo::Gguf { params, .. } => (*params, *params),
        }
    }

    /// Bytes of the weights as stored.
    pub fn weight_bytes(&self) -> u64 {
        match &self.info {
            ModelInfo::Kimi(cfg) => ModelSummary::new(cfg).total_bytes(),
            ModelInfo::Gguf { weight_bytes, .. } => *weight_bytes,
        }
    }

    /// Cache values each token adds (MLA latent or K and V), and fixed state per sequence.
    pub fn cache_values(&self) -> (u64, u64) {
        match &self.info {
            ModelInfo::Kimi(cfg) => {
                let s = ModelSummary::new(cfg);
                (
                    s.mla_cache_elems_per_token,
                    s.kda_state_elems_per_seq + s.kda_conv_elems_per_seq,
                )
            }
            ModelInfo::Gguf {
                kv_values_per_token,
                ..
            } => (*kv_values_per_token, 0),
        }
    }
}

/// The model `--model` names (a path, or a hub repository resolved through the cache), or
/// the default demo model.
pub fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(path) => crate::hub::resolve_model(path, args.download),
        None if Path::new(DEMO_GGUF).is_file() => {
            eprintln!(
                "note: no --model given; using the demo model {DEMO_GGUF} (SmolLM2-135M-Instruct)"
            );
            Ok(PathBuf::from(DEMO_GGUF))
        }
        None => {
            eprintln!(
                "note: no --model given; using the built-in demo model (tiny, random weights: expect \
                 gibberish; scripts/fetch_demo_model.sh fetches a real one)"
            );
            crate::demo::demo_dir()
        }
    }
}

/// True for a path that names a GGUF file rather than a checkpoint directory.
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() || path.extension().is_some_and(|e| e == "gguf")
}

/// True for a path that names a bare `config.json` (any `.json` file) rather than a model.
pub fn is_config_file(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// Parses a config.json file.
pub fn read_config(path: &Path) -> anyhow::Result<ModelConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    ModelConfig::from_json_str(&text).with_context(|| format!("in {}", path.display()))
}

/// The config of `--model` for the commands that need no weights: a config.json file, or
/// the one in a checkpoint directory.
pub fn config_of(path: &Path) -> anyhow::Result<ModelConfig> {
    if is_config_file(path) {
        return read_config(path);
    }
    if path.is_dir() {
        return read_config(&path.join("config.json"));
    }
    if path.exists() {
        anyhow::bail!(
            "{} is neither a config.json nor a checkpoint directory (GGUF files are not \
             supported here)",
            path.display()
        );
    }
    anyhow::bail!("{} does not exist", path.display())
}

/// Loads weights onto `backend`, and the tokenizer if asked.
pub fn load<B: Backend + 'static>(
    backend: B,
    args: &ModelArgs,
    need_tokenizer: bool,
) -> anyhow::Result<Loaded<B>> {
    let path = model_path(args)?;
    let (ranks, split, mut options) = load_plan(args)?;
    if is_gguf(&path) {
        anyhow::ensure!(
            split.is_none(),
            "--tensor-parallel-size applies to checkpoint directories for now, not GGUF files"
        );
        return load_gguf(backend, &path, need_tokenizer, &options);
    }
    if let Ok((json, config_path)) = kimi_model::llama_hf::read_config_json(&path) {
        if kimi_model::llama_hf::is_llama_config(&json) {
            anyhow::ensure!(
                split.is_none() && options.offload.is_none(),
                "{}: tensor parallelism and expert offload apply to Kimi models",
                path.display()
            );
            return load_llama_dir(backend, &path, &json, &config_path, need_tokenizer);
        }
    }
    let mut ckpt = Checkpoint::open(&path)
        .with_context(|| format!("cannot open the model in {}", path.display()))?;
    if split.is_some() {
        options.reopen = Some(checkpoint_reopener(path.clone()));
    }
    if split.is_none() {
        let device = backend.memory_info();
        let utilization = args.gpu_memory_utilization;
        // Experts written by a quantization tool are counted as the backend will hold them
        // (packed, or widened to bf16). A tensor that cannot be read here fails the load
        // below, which names it: this estimate stays quiet.
        let expert_bytes = match (device, &options.offload) {
            (Some(_), None) => kimi_model::CheckpointSource::new(&ckpt)
                .and_then(|s| {
                    let keeps = |d| backend.stores_experts(d);
                    kimi_model::routed_expert_bytes(&keeps, &s, ckpt.config())
                })
                .ok()
                .flatten(),
            _ => None,
        };
        args.offload.auto_offload(
            &mut options,
            ckpt.config(),
            device,
            utilization,
            expert_bytes,
        )?;
    }
    let bar = crate::progress::watch_checkpoint(&mut ckpt);
    let loaded = match split {
        None => registry::load_checkpoint_with(backend, &ckpt, &options).map_err(Into::into),
        Some(_) => kimi_model::CheckpointSource::new(&ckpt)
            .map_err(Into::into)
            .and_then(|source| {
                load_ranks(backend, ckpt.config().clone(), &source, &options, &ranks)
            }),
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let loaded =
        loaded.with_context(|| format!("cannot load the weights in {}", path.display()))?;
    note_skipped_vision(&loaded);
    crate::offload::report_placement(loaded.model.as_ref(), &options);
    let tokenizer = if need_tokenizer {
        Some(
            Tokenizer::from_dir(&path)
                .with_context(|| format!("cannot load the tokenizer in {}", path.display()))?,
        )
    } else {
        None
    };
    Ok(Loaded {
        info: info_of(&loaded, None),
        engine: Engine::new(loaded.model),
        tokenizer,
        dir: path,
        stored_read_bytes_per_token: None,
    })
}

/// A `LlamaForCausalLM` checkpoint directory (float, or quantized by a tool or `quantize`).
fn load_llama_dir<B: Backend + 'static>(
    backend: B,
    path: &Path,
    json: &serde_json::Value,
    config_path: &Path,
    need_tokenizer: bool,
) -> anyhow::Result<Loaded<B>> {
    let files = kimi_weights::SafetensorsDir::open(path)
        .with_context(|| format!("cannot open the model in {}", path.display()))?;
    let spinner = crate::progress::spinner("loading weights");
    let loaded = registry::load_llama_checkpoint(backend, &files, json, config_path);
    if let Some(spinner) = spinner {
        spinner.finish_and_clear();
    }
    let loaded =
        loaded.with_context(|| format!("cannot load the weights in {}", path.display()))?;
    let tokenizer = match need_tokenizer {
        true => Some(
            Tokenizer::from_dir(path)
                .with_context(|| format!("cannot load the tokenizer in {}", path.display()))?,
        ),
        false => None,
    };
    let mut info = info_of(&loaded, None);
    if let ModelInfo::Gguf {
        params,
        weight_bytes,
        ..
    } = &mut info
    {
        // Stored values (a quantized weight counts its packed words).
        *params = files
            .tensor_names()
            .iter()
            .filter_map(|n| files.shape(n))
            .map(|s| s.iter().product::<usize>() as u64)
            .sum();
        *weight_bytes = files.total_bytes();
    }
    Ok(Loaded {
        info,
        engine: Engine::new(loaded.model),
        tokenizer,
        dir: path.to_path_buf(),
        stored_read_bytes_per_token: None,
    })
}

/// Says once that a multimodal checkpoint's vision encoder is not used.
fn note_skipped_vision<B: Backend>(loaded: &LoadedModel<B>) {
    if loaded.ignored_vision_tensors > 0 {
        eprintln!(
            "note: this {} checkpoint has a vision encoder ({} tensors); kimi-infer runs the \
             text model only, images are not supported yet",
            loaded.architecture.name(),
            loaded.ignored_vision_tensors
        );
    }
}

/// What the commands report about a loaded model (`file`: the GGUF it came from).
fn info_of<B: Backend>(loaded: &LoadedModel<B>, file: Option<&GgufFile>) -> ModelInfo {
    match (&loaded.config, file) {
        (Some(cfg), _) => ModelInfo::Kimi(Box::new(cfg.clone())),
        (None, file) => ModelInfo::Gguf {
            params: file.map_or(0, |f| f.tensors().iter().map(|t| t.num_elements()).sum()),
            weight_bytes: file.map_or(0, |f| f.tensors().iter().map(|t| t.size_bytes).sum()),
            kv_values_per_token: loaded
                .model
                .cache_specs()
                .iter()
                .map(|s| match s {
                    kimi_model::LayerSpec::Kv { width } => 2 * *width as u64,
                    kimi_model::LayerSpec::Mla { width } => *width as u64,
                    kimi_model::LayerSpec::Kda { .. } => 0,
                })
                .sum(),
        },
    }
}

fn load_gguf<B: Backend + 'static>(
    backend: B,
    path: &Path,
    need_tokenizer: bool,
    options: &kimi_model::LoadOptions,
) -> anyhow::Result<Loaded<B>> {
    let file = GgufFile::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let spinner = crate::progress::spinner("loading weights");
    let loaded = registry::load_gguf_with(backend, &file, options);
    if let Some(spinner) = spinner {
        spinner.finish_and_clear();
    }
    let loaded =
        loaded.with_context(|| format!("cannot load the weights in {}", path.display()))?;
    crate::offload::report_placement(loaded.model.as_ref(), options);
    let tokenizer = if need_tokenizer {
        let kimi = loaded.architecture != kimi_model::Architecture::Llama;
        if kimi && file.get("tokenizer.ggml.model").is_none() {
            anyhow::bail!(
                "{} carries no tokenizer (tokenizer.ggml.*): `kimi-infer convert` writes one only \
                 from Kimi's tiktoken.model; pass token ids (`kimi-infer logits --ids`) or use the \
                 checkpoint directory",
                path.display()
            );
        }
        Some(
            Tokenizer::from_gguf(&file)
                .with_context(|| format!("cannot load the tokenizer in {}", path.display()))?,
        )
    } else {
        None
    };
    Ok(Loaded {
        stored_read_bytes_per_token: loaded
            .config
            .as_ref()
            .map(|c| kimi_gguf_read_bytes(&file, c)),
        info: info_of(&loaded, Some(&file)),
        engine: Engine::new(loaded.model),
        tokenizer,
        dir: path.to_path_buf(),
    })
}

/// Weight bytes a decoded token reads from a Kimi GGUF, in the file's own types: every
/// tensor once, the stacked routed experts `top_k / num_experts` of theirs, one row of the
/// embedding (all of it when it is also the output head).
fn kimi_gguf_read_bytes(file: &GgufFile, cfg: &ModelConfig) -> u64 {
    let untied = file.tensor("output.weight").is_ok();
    let (top_k, experts) = cfg
        .moe
        .as_ref()
        .map_or((1, 1), |m| (m.top_k as u64, m.num_experts.max(1) as u64));
    file.tensors()
        .iter()
        .map(|t| {
            if t.name.contains("_exps.") {
                t.size_bytes * top_k / experts
            } else if t.name == "token_embd.weight" && untied {
                t.size_bytes / (cfg.vocab_size.max(1) as u64)
            } else {
                t.size_bytes
            }
        })
        .sum()
}

/// Builds the model of a config.json with deterministic random weights (for benchmarks).
pub fn load_random<B: Backend + 'static>(
    backend: B,
    config: &Path,
    dtype: kimi_core::DType,
    args: &ModelArgs,
    routing_skew: f32,
) -> anyhow::Result<Loaded<B>> {
    let (ranks, split, mut options) = load_plan(args)?;
    let cfg = read_config(config)?;
    if split.is_some() {
        options.reopen = Some(random_reopener(dtype, routing_skew));
    }
    // Refuse up front what cannot fit, rather than dying half-way through filling it.
    // Dense matrices take `dtype` (Q4Z: counted as bf16, which its embeddings and head are
    // and its matrices become where the backend widens them); routed experts that the
    // config stores as MXFP4 stay at 4.25 bits per value whatever `dtype` is, Q4Z ones at 6
    // where the backend keeps them packed.
    let summary = ModelSummary::new(&cfg);
    let mxfp4_experts = cfg
        .moe
        .as_ref()
        .is_some_and(|m| m.expert_format == kimi_core::config::ExpertFormat::Mxfp4);
    let experts = summary.component(kimi_model::Component::RoutedExperts);
    let q4z = dtype == kimi_core::DType::Q4Z;
    let dense_dtype = if q4z { kimi_core::DType::BF16 } else { dtype };
    let expert_bytes = if mxfp4_experts {
        experts.bytes
    } else if q4z && backend.stores_experts(dtype) {
        dtype
            .storage_bytes(experts.params as usize)
            .unwrap_or(usize::MAX) as u64
    } else {
        experts
            .params
            .saturating_mul(dense_dtype.size_bytes() as u64)
    };
    // The automatic placement counts the experts as they will be stored (packed Q4Z: 6 bits
    // a value, where the config's dtype would say 16).
    if split.is_none() {
        let device = backend.memory_info();
        let utilization = args.gpu_memory_utilization;
        args.offload
            .auto_offload(&mut options, &cfg, device, utilization, Some(expert_bytes))?;
    }
    let options = &options;
    // Experts offloaded to host RAM (less the device slots caching them) are not on the
    // device.
    let off_device = match (&options.offload, cfg.moe.as_ref()) {
        (Some(o), Some(m)) => {
            let layers = cfg
                .layers
                .iter()
                .filter(|l| l.ffn == kimi_core::config::Ffn::Moe)
                .count();
            let per_expert = expert_bytes / (m.num_experts * layers).max(1) as u64;
            let (host, slots) = o.per_layer(m.num_experts, per_expert, layers);
            ((host - slots) * layers) as u64 * per_expert
        }
        _ => 0,
    };
    let bytes = (summary.params.total - experts.params)
        .saturating_mul(dense_dtype.size_bytes() as u64)
        .saturating_add(expert_bytes)
        .saturating_sub(off_device);
    let room = backend
        .memory_info()
        .map(|(free, _)| free)
        .or_else(|| crate::memory::HostMemory::read().usable());
    if let Some(room) = room.filter(|&room| bytes > room) {
        anyhow::bail!(
            "the random {dtype} weights of {} need {}, more than the {} of memory left",
            config.display(),
            crate::cache_plan::gib(bytes),
            crate::cache_plan::gib(room)
        );
    }
    let source = random_source(dtype, routing_skew);
    let loaded = match split {
        None => registry::load_config_with(backend, cfg.clone(), &source, options)?,
        Some(_) => load_ranks(backend, cfg.clone(), &source, options, &ranks)?,
    };
    crate::offload::report_placement(loaded.model.as_ref(), options);
    Ok(Loaded {
        engine: Engine::new(loaded.model),
        tokenizer: None,
        dir: config.to_path_buf(),
        info: ModelInfo::Kimi(Box::new(cfg)),
        stored_read_bytes_per_token: None,
    })
}

/// The deterministic random weights of `bench --random-config` (and `serve`'s).
pub fn random_source(
    dtype: kimi_core::DType,
    skew: f32,
) -> kimi_model::SkewedRouting<kimi_model::RandomWeights> {
    kimi_model::SkewedRouting {
        inner: kimi_model::RandomWeights { dtype, seed: 0 },
        skew,
    }
}

/// The checkpoint in `path` opened again, for the experts a rank takes on when they move
/// between ranks (`serve --enable-eplb`).
pub fn checkpoint_reopener(path: PathBuf) -> kimi_model::WeightsReopener {
    kimi_model::WeightsReopener::new(move |f| {
        let ckpt = Checkpoint::open(&path).map_err(|e| {
            kimi_model::ModelError::Input(format!("reopening {}: {e}", path.display()))
        })?;
        f(&kimi_model::CheckpointSource::new(&ckpt)?)
    })
}

/// [`random_source`] made again, as [`checkpoint_reopener`] does for a checkpoint.
pub fn random_reopener(dtype: kimi_core::DType, skew: f32) -> kimi_model::WeightsReopener {
    kimi_model::WeightsReopener::new(move |f| f(&random_source(dtype, skew)))
}

/// How this process loads the model: its ranks, the split it loads for, and the options.
fn load_plan(args: &ModelArgs) -> anyhow::Result<(Ranks, Option<Split>, kimi_model::LoadOptions)> {
    let ranks = args
        .parallel
        .ranks(args.device == crate::args::Device::Cpu)?;
    let split = split_of(&ranks)?;
    let options = match &split {
        Some(split) => split_options(args, split)?,
        None => args.offload.load_options()?,
    };
    Ok((ranks, split, options))
}

/// The split this process loads the model for: `None` for the whole model; an error where
/// this process is not to load it (a launcher, or a rank other than 0, whose commands
/// `crate::ranks` runs instead).
fn split_of(ranks: &Ranks) -> anyhow::Result<Option<Split>> {
    match ranks {
        Ranks::One => Ok(None),
        Ranks::Threads(split) => Ok(Some(*split)),
        Ranks::Process(split, place) if place.rank == 0 => Ok(Some(*split)),
        Ranks::Process(..) | Ranks::Launch(_) => anyhow::bail!(
            "one process per rank (--distributed-executor-backend mp, --nnodes, RANK) applies \
             to serve, run, chat, logits, perplexity and bench"
        ),
    }
}

/// The load options of every rank of `split`: the offload flags, the expert placement and
/// dispatch.
pub fn split_options(args: &ModelArgs, split: &Split) -> anyhow::Result<kimi_model::LoadOptions> {
    let mut options = args.offload.load_options()?;
    options.expert_placement = crate::parallel::placement(&args.parallel, split.world)?;
    options.expert_dispatch = args.parallel.expert_dispatch.into();
    Ok(options)
}

/// A split model from `source`: every rank a thread, or rank 0 of rank processes (after
/// the rendezvous with the others, `crate::ranks`).
fn load_ranks<B: Backend + 'static>(
    backend: B,
    cfg: ModelConfig,
    source: &dyn kimi_model::WeightSource,
    options: &kimi_model::LoadOptions,
    ranks: &Ranks,
) -> anyhow::Result<LoadedModel<B>> {
    Ok(match ranks {
        Ranks::Threads(s) => {
            registry::load_split(backend, cfg, source, options, s.world, s.experts, s.timeout)?
        }
        Ranks::Process(s, place) => {
            let (comm, links) = crate::ranks::lead_group(&backend, s, place)?;
            registry::load_rank_lead(
                backend, cfg, source, options, s.experts, comm, links, s.timeout,
            )?
        }
        Ranks::One | Ranks::Launch(_) => registry::load_config_with(backend, cfg, source, options)?,
    })
}
