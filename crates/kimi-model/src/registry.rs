//! Which model definition a file is: the one place that maps checkpoints and GGUF files to
//! architectures. A new family joins here (a variant of [`Architecture`], a line in its
//! recognisers, and a load arm); front ends never name the model types themselves.

use kimi_core::config::Family;
use kimi_core::ModelConfig;
use kimi_gguf::GgufFile;
use kimi_ops::Backend;
use kimi_weights::Checkpoint;

use crate::{CausalLm, KimiLinear, Llama, LoadOptions, ModelError, Result, WeightSource};

/// The architectures kimi-infer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Kimi Linear (`kimi_linear` checkpoints, llama.cpp's `kimi-linear` GGUF files).
    KimiLinear,
    /// Kimi K3's text model (`kimi_k3` checkpoints), run by the Kimi Linear definition with
    /// K3's variants switched on by its config.
    KimiK3,
    /// Llama-family models: GGUF files (the SmolLM2 demo model) and `LlamaForCausalLM`
    /// checkpoints.
    Llama,
}

impl Architecture {
    /// The architecture of a parsed checkpoint config.
    pub fn of_config(config: &ModelConfig) -> Self {
        match config.family {
            Family::KimiLinear => Architecture::KimiLinear,
            Family::KimiK3 => Architecture::KimiK3,
        }
    }

    /// The architecture of a GGUF file, from `general.architecture`: `kimi-linear` and
    /// `kimi-k3` are Kimi Linear and Kimi K3 in llama.cpp's layouts; anything else goes to
    /// the llama-family loader, which names the architectures it does not run.
    pub fn of_gguf(file: &GgufFile) -> Self {
        match file.get_str("general.architecture").ok() {
            Some(crate::gguf_kimi::ARCH) => Architecture::KimiLinear,
            Some(crate::gguf_kimi::ARCH_K3) => Architecture::KimiK3,
            _ => Architecture::Llama,
        }
    }

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::KimiLinear => "Kimi Linear",
            Architecture::KimiK3 => "Kimi K3",
            Architecture::Llama => "Llama-family",
        }
    }
}

/// A loaded model of any architecture, with what front ends report about it.
pub struct LoadedModel<B: Backend> {
    /// The model, ready for an engine.
    pub model: Box<dyn CausalLm<B>>,
    /// What it is.
    pub architecture: Architecture,
    /// The Kimi config (`None` for llama-family files, which describe themselves in
    /// their GGUF metadata).
    pub config: Option<ModelConfig>,
    /// Tensors of a vision encoder the checkpoint held and the text model skipped.
    pub ignored_vision_tensors: usize,
}

/// Loads a checkpoint directory's model onto `backend`.
pub fn load_checkpoint<B: Backend + 'static>(
    backend: B,
    ckpt: &Checkpoint,
) -> Result<LoadedModel<B>> {
    load_checkpoint_with(backend, ckpt, &LoadOptions::default())
}

/// [`load_checkpoint`] with options.
pub fn load_checkpoint_with<B: Backend + 'static>(
    backend: B,
    ckpt: &Checkpoint,
    options: &LoadOptions,
) -> Result<LoadedModel<B>> {
    let architecture = Architecture::of_config(ckpt.config());
    // Both Kimi architectures are the one definition; the config picks the variants.
    let model = KimiLinear::load_checkpoint_with(backend, ckpt, options)?;
    Ok(LoadedModel {
        architecture,
        config: Some(model.config().clone()),
        ignored_vision_tensors: model.ignored_vision_tensors(),
        model: Box::new(model),
    })
}

/// Loads a `LlamaForCausalLM` checkpoint directory (float or quantized by a tool) onto
/// `backend`; `json` is its config.json, read from `config_path`.
pub fn load_llama_checkpoint<B: Backend + 'static>(
    backend: B,
    files: &kimi_weights::SafetensorsDir,
    json: &serde_json::Value,
    config_path: &std::path::Path,
) -> Result<LoadedModel<B>> {
    let config = crate::LlamaConfig::from_hf_json(json, config_path)?;
    let source = crate::llama_hf::HfLlamaSource::new(files, json, config_path)?;
    Ok(LoadedModel {
        model: Box::new(Llama::load_from(backend, config, &source)?),
        architecture: Architecture::Llama,
        config: None,
        ignored_vision_tensors: 0,
    })
}

/// A Kimi model split over `world` ranks of this process ([`crate::parallel`]): rank `r`
/// runs on `backend.rank_backend(r)`, `experts` says how the routed experts split, and
/// `timeout` bounds each collective. `source` gives the weights (`None`: the checkpoint's).
pub fn load_split<B>(
    backend: B,
    config: ModelConfig,
    source: &dyn WeightSource,
    options: &LoadOptions,
    world: usize,
    experts: crate::parallel::ExpertSplit,
    timeout: std::time::Duration,
) -> Result<LoadedModel<B>>
where
    B: Backend + 'static,
    B::Tensor: 'static,
{
    let architecture = Architecture::of_config(&config);
    let others = (1..world)
        .map(|r| backend.rank_backend(r))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut parts = Vec::with_capacity(world);
    for (rank, be) in std::iter::once(backend).chain(others).enumerate() {
        let options = LoadOptions {
            shard: crate::parallel::Shard {
                rank,
                world,
                experts,
            },
            ..options.clone()
        };
        parts.push(KimiLinear::load_with(be, config.clone(), source, &options)?);
    }
    let ignored_vision_tensors = parts.first().map_or(0, |p| p.ignored_vision_tensors());
    let model = crate::parallel::TensorParallel::new(parts, timeout)?;
    Ok(LoadedModel {
        architecture,
        config: Some(config),
        ignored_vision_tensors,
        model: Box::new(model),
    })
}

/// Rank `shard.rank`'s part of a model split over rank processes (one per GPU), joined to
/// `comm` (every rank's collective of one group: [`Backend::join_process_group`]).
pub fn load_rank_part<B: Backend + 'static>(
    backend: B,
    config: ModelConfig,
    source: &dyn WeightSource,
    options: &LoadOptions,
    shard: crate::parallel::Shard,
    comm: std::sync::Arc<dyn kimi_ops::Collective<B>>,
) -> Result<KimiLinear<B>> {
    let options = LoadOptions {
        shard,
        ..options.clone()
    };
    let mut part = KimiLinear::load_with(backend, config, source, &options)?;
    part.set_collective(comm)?;
    Ok(part)
}

/// Rank 0 of a model split over rank processes: its part ([`load_rank_part`]), which
/// hands every call to the other ranks through `links` (from the rendezvous) and answers
/// for them all ([`crate::parallel::ProcessRanks`]).
#[allow(clippy::too_many_arguments)]
pub fn load_rank_lead<B: Backend + 'static>(
    backend: B,
    config: ModelConfig,
    source: &dyn WeightSource,
    options: &LoadOptions,
    experts: crate::parallel::ExpertSplit,
    comm: std::sync::Arc<dyn kimi_ops::Collective<B>>,
    links: Vec<kimi_ops::bootstrap::rendezvous::Link>,
    timeout: std::time::Duration,
) -> Result<LoadedModel<B>> {
    let architecture = Architecture::of_config(&config);
    let shard = crate::parallel::Shard {
        rank: 0,
        world: comm.world(),
        experts,
    };
    let part = load_rank_part(
        backend,
        config.clone(),
        source,
        options,
        shard,
        comm.clone(),
    )?;
    let ignored_vision_tensors = part.ignored_vision_tensors();
    let model = crate::parallel::ProcessRanks::new(part, comm, links, timeout)?;
    Ok(LoadedModel {
        architecture,
        config: Some(config),
        ignored_vision_tensors,
        model: Box::new(model),
    })
}

/// Builds the model a config describes from any weight source (random weights for
/// benchmarks of full-size shapes).
pub fn load_config<B: Backend + 'static>(
    backend: B,
    config: ModelConfig,
    source: &dyn WeightSource,
) -> Result<LoadedModel<B>> {
    load_config_with(backend, config, source, &LoadOptions::default())
}

/// [`load_config`] with options.
pub fn load_config_with<B: Backend + 'static>(
    backend: B,
    config: ModelConfig,
    source: &dyn WeightSource,
    options: &LoadOptions,
) -> Result<LoadedModel<B>> {
    let architecture = Architecture::of_config(&config);
    let model = KimiLinear::load_with(backend, config, source, options)?;
    Ok(LoadedModel {
        architecture,
        config: Some(model.config().clone()),
        ignored_vision_tensors: model.ignored_vision_tensors(),
        model: Box::new(model),
    })
}

/// Loads a GGUF file's model onto `backend`.
pub fn load_gguf<B: Backend + 'static>(backend: B, file: &GgufFile) -> Result<LoadedModel<B>> {
    load_gguf_with(backend, file, &LoadOptions::default())
}

/// [`load_gguf`] with options.
pub fn load_gguf_with<B: Backend + 'static>(
    backend: B,
    file: &GgufFile,
    options: &LoadOptions,
) -> Result<LoadedModel<B>> {
    match Architecture::of_gguf(file) {
        Architecture::Llama if options.offload.is_some() => Err(ModelError::Input(
            "expert offload applies to mixture-of-experts models; this llama-family GGUF has \
             no routed experts"
                .into(),
        )),
        Architecture::Llama if options.shard.is_split() => Err(ModelError::Input(
            "tensor parallelism is not implemented for llama-family GGUF models yet".into(),
        )),
        Architecture::Llama => Ok(LoadedModel {
            model: Box::new(Llama::load(backend, file)?),
            architecture: Architecture::Llama,
            config: None,
            ignored_vision_tensors: 0,
        }),
        architecture => {
            let model = KimiLinear::load_gguf_with(backend, file, options)?;
            Ok(LoadedModel {
                architecture,
                config: Some(model.config().clone()),
                ignored_vision_tensors: 0,
                model: Box::new(model),
            })
        }
    }
}
