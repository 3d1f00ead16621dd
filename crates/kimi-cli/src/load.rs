//! Resolving `--model` and loading checkpoint, model and tokenizer.

use std::path::PathBuf;

use anyhow::Context;
use kimi_cpu::CpuBackend;
use kimi_engine::Engine;
use kimi_model::KimiLinear;
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

use crate::args::ModelArgs;

/// A loaded model with its tokenizer (when the directory has one).
pub struct Loaded {
    pub engine: Engine<CpuBackend>,
    pub tokenizer: Option<Tokenizer>,
    pub dir: PathBuf,
}

/// The checkpoint directory `--model` names, or the built-in demo model.
pub fn model_dir(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(dir) => Ok(dir.clone()),
        None => {
            eprintln!("note: no --model given; using the built-in demo model (tiny, random weights: expect gibberish)");
            crate::demo::demo_dir()
        }
    }
}

/// Loads weights onto the CPU backend, and the tokenizer if the directory has one.
pub fn load(args: &ModelArgs, need_tokenizer: bool) -> anyhow::Result<Loaded> {
    let dir = model_dir(args)?;
    let ckpt = Checkpoint::open(&dir)
        .with_context(|| format!("cannot open the model in {}", dir.display()))?;
    let model = KimiLinear::load(CpuBackend::new(), &ckpt)
        .with_context(|| format!("cannot load the weights in {}", dir.display()))?;
    let tokenizer = if need_tokenizer {
        Some(
            Tokenizer::from_dir(&dir)
                .with_context(|| format!("cannot load the tokenizer in {}", dir.display()))?,
        )
    } else {
        None
    };
    Ok(Loaded {
        engine: Engine::new(model),
        tokenizer,
        dir,
    })
}

/// Builds the model of a config.json with deterministic random weights (for benchmarks).
pub fn load_random(config: &std::path::Path, dtype: kimi_core::DType) -> anyhow::Result<Loaded> {
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg = kimi_core::ModelConfig::from_json_str(&text)
        .with_context(|| format!("in {}", config.display()))?;
    let source = kimi_model::RandomWeights { dtype, seed: 0 };
    let model = KimiLinear::load_from(CpuBackend::new(), cfg, &source)?;
    Ok(Loaded {
        engine: Engine::new(model),
        tokenizer: None,
        dir: config.to_path_buf(),
    })
}
