//! Resolving `--model` and loading checkpoint, model and tokenizer.
//!
//! `--model` is a checkpoint directory (config.json + safetensors: Kimi Linear) or a `.gguf`
//! file (llama-family models). Without it, the real demo model
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` is used when `scripts/fetch_demo_model.sh` has
//! fetched it, else the tiny random Kimi Linear compiled into the binary.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kimi_core::ModelConfig;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_engine::Engine;
use kimi_gguf::GgufFile;
use kimi_model::{KimiLinear, Llama, ModelSummary};
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

use crate::args::ModelArgs;

/// Where the demo GGUF lands, relative to the repository root.
pub const DEMO_GGUF: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// What kind of model was loaded, with what the commands need to know about it.
pub enum ModelInfo {
    /// Kimi Linear from a Hugging Face checkpoint.
    Kimi(Box<ModelConfig>),
    /// A llama-family GGUF: weight bytes and KV-cache values per token.
    Gguf {
        weight_bytes: u64,
        kv_values_per_token: u64,
    },
}

/// A loaded model with its tokenizer (when one was asked for).
pub struct Loaded {
    pub engine: Engine<CpuBackend>,
    pub tokenizer: Option<Tokenizer>,
    pub dir: PathBuf,
    pub info: ModelInfo,
}

impl Loaded {
    /// Bytes of weights one decoded token reads.
    pub fn weight_bytes_per_token(&self, bytes_per_param: f64) -> f64 {
        match &self.info {
            ModelInfo::Kimi(cfg) => ModelSummary::new(cfg).params.active as f64 * bytes_per_param,
            ModelInfo::Gguf { weight_bytes, .. } => *weight_bytes as f64,
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

/// The model `--model` names, or the default demo model.
pub fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(path) => Ok(path.clone()),
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

/// Loads weights onto the CPU backend, and the tokenizer if asked.
pub fn load(args: &ModelArgs, need_tokenizer: bool) -> anyhow::Result<Loaded> {
    let path = model_path(args)?;
    if is_gguf(&path) {
        let backend = match args.f32_matmul {
            true => CpuBackend::with_quant_matmul(QuantMatmul::F32),
            false => CpuBackend::new(),
        };
        return load_gguf(backend, &path, need_tokenizer);
    }
    let ckpt = Checkpoint::open(&path)
        .with_context(|| format!("cannot open the model in {}", path.display()))?;
    let model = KimiLinear::load(CpuBackend::new(), &ckpt)
        .with_context(|| format!("cannot load the weights in {}", path.display()))?;
    let tokenizer = if need_tokenizer {
        Some(
            Tokenizer::from_dir(&path)
                .with_context(|| format!("cannot load the tokenizer in {}", path.display()))?,
        )
    } else {
        None
    };
    let info = ModelInfo::Kimi(Box::new(model.config().clone()));
    Ok(Loaded {
        engine: Engine::new(model),
        tokenizer,
        dir: path,
        info,
    })
}

fn load_gguf(backend: CpuBackend, path: &Path, need_tokenizer: bool) -> anyhow::Result<Loaded> {
    let file = GgufFile::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let model = Llama::load(backend, &file)
        .with_context(|| format!("cannot load the weights in {}", path.display()))?;
    let tokenizer = if need_tokenizer {
        Some(
            Tokenizer::from_gguf(&file)
                .with_context(|| format!("cannot load the tokenizer in {}", path.display()))?,
        )
    } else {
        None
    };
    let c = model.config();
    let info = ModelInfo::Gguf {
        weight_bytes: file.tensors().iter().map(|t| t.size_bytes).sum(),
        kv_values_per_token: 2 * (c.num_layers * c.num_kv_heads * c.head_dim) as u64,
    };
    Ok(Loaded {
        engine: Engine::new(model),
        tokenizer,
        dir: path.to_path_buf(),
        info,
    })
}

/// Builds the model of a config.json with deterministic random weights (for benchmarks).
pub fn load_random(config: &Path, dtype: kimi_core::DType) -> anyhow::Result<Loaded> {
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg =
        ModelConfig::from_json_str(&text).with_context(|| format!("in {}", config.display()))?;
    let source = kimi_model::RandomWeights { dtype, seed: 0 };
    let model = KimiLinear::load_from(CpuBackend::new(), cfg.clone(), &source)?;
    Ok(Loaded {
        engine: Engine::new(model),
        tokenizer: None,
        dir: config.to_path_buf(),
        info: ModelInfo::Kimi(Box::new(cfg)),
    })
}
