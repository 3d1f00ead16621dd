//! The expert offload flags: which routed experts stay in the device's memory, which live in
//! host RAM (computed there when cold) and how many device slots cache them.

use std::sync::Arc;

use clap::Args;
use kimi_model::{CausalLm, ExpertOffload, LoadOptions, OffloadAmount};
use kimi_ops::offload::{CachePolicy, HostBackend};
use kimi_ops::Backend;

/// Flags of [`crate::args::ModelArgs`] for experts beyond the device's memory.
#[derive(Args, Clone, Debug, Default)]
pub struct OffloadArgs {
    /// GiB of routed-expert weights (stored size, over all MoE layers) kept in host RAM
    /// instead of the device, as vLLM's flag of this name: the highest expert ids of each
    /// layer, rounded up to whole experts. Cold experts are computed on the CPU.
    #[arg(long, value_name = "GIB")]
    pub cpu_offload_gb: Option<f64>,
    /// Routed experts per MoE layer kept in host RAM (instead of `--cpu-offload-gb`).
    #[arg(long, value_name = "N", conflicts_with = "cpu_offload_gb")]
    pub offload_experts: Option<usize>,
    /// GiB of device memory (over all MoE layers) for slots that cache host experts, filled
    /// after each layer's router has run; rounded down to whole experts. Default: none.
    #[arg(long, value_name = "GIB")]
    pub expert_cache_gb: Option<f64>,
    /// Device slots per MoE layer for host experts (instead of `--expert-cache-gb`).
    #[arg(long, value_name = "N", conflicts_with = "expert_cache_gb")]
    pub expert_cache_slots: Option<usize>,
    /// Keep the experts that `--cpu-offload-gb` / `--offload-experts` move off the device
    /// in memory-mapped files in DIR (unnamed: nothing is left there when the process
    /// ends) instead of anonymous RAM, as transformers' `offload_folder`: the page cache
    /// keeps what fits in RAM and reads the rest from disk when it is needed. DIR's disk
    /// must have room for them (reserved as they load).
    #[arg(long, value_name = "DIR")]
    pub offload_folder: Option<std::path::PathBuf>,
}

impl OffloadArgs {
    /// The load options these flags ask for (`offload: None` without any).
    pub fn load_options(&self) -> anyhow::Result<LoadOptions> {
        let gib = |flag: &str, v: f64| -> anyhow::Result<u64> {
            anyhow::ensure!(
                (0.0..1e9).contains(&v),
                "--{flag} must be a number of GiB >= 0, got {v}"
            );
            Ok((v * (1u64 << 30) as f64) as u64)
        };
        let host = match (self.cpu_offload_gb, self.offload_experts) {
            (Some(v), _) => Some(OffloadAmount::Bytes(gib("cpu-offload-gb", v)?)),
            (None, Some(n)) => Some(OffloadAmount::Experts(n)),
            (None, None) => None,
        };
        let cache = match (self.expert_cache_gb, self.expert_cache_slots) {
            (Some(v), _) => Some(OffloadAmount::Bytes(gib("expert-cache-gb", v)?)),
            (None, Some(n)) => Some(OffloadAmount::Experts(n)),
            (None, None) => None,
        };
        let Some(host) = host else {
            anyhow::ensure!(
                cache.is_none(),
                "--expert-cache-gb / --expert-cache-slots cache experts kept in host RAM: give \
                 --cpu-offload-gb or --offload-experts too"
            );
            anyhow::ensure!(
                self.offload_folder.is_none(),
                "--offload-folder keeps the experts moved off the device: give \
                 --cpu-offload-gb or --offload-experts too"
            );
            return Ok(LoadOptions::default());
        };
        // The host store: a CPU backend with f32 products (its tensors keep the stored
        // layout, which the device slots are filled from).
        let cpu = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
        let store = match &self.offload_folder {
            Some(dir) => {
                let file = kimi_cpu::WeightFile::new(dir)
                    .map_err(|e| anyhow::anyhow!("--offload-folder: {e}"))?;
                let tier = format!("memory-mapped files in {}", dir.display());
                HostBackend::new(Arc::new(cpu.keeping_weights_in(Arc::new(file)))).in_tier(tier)
            }
            None => HostBackend::new(Arc::new(cpu)),
        };
        Ok(LoadOptions {
            offload: Some(ExpertOffload {
                host,
                cache: cache.unwrap_or(OffloadAmount::Experts(0)),
                policy: CachePolicy::default(),
                store: Arc::new(store),
            }),
            ..LoadOptions::default()
        })
    }
}

/// Says once where the experts went, when some are off the device.
pub fn report_placement<B: Backend>(model: &dyn CausalLm<B>, options: &LoadOptions) {
    let layers = model.expert_placement();
    let Some((_, first)) = layers.first() else {
        return;
    };
    let tier = options
        .offload
        .as_ref()
        .map_or_else(|| "host RAM".to_string(), |o| o.store.tier());
    let (device, host): (u64, u64) = layers.iter().fold((0, 0), |(d, h), (_, p)| {
        (d + p.device_bytes, h + p.host_bytes)
    });
    eprintln!(
        "experts: per MoE layer {} on {} and {} in {tier} with {} cache slots ({} layers: {} \
         on the device, {} in {tier}); cold experts computed on the CPU",
        first.resident,
        model.backend().name(),
        first.host,
        first.slots,
        layers.len(),
        crate::inspect::bytes(device),
        crate::inspect::bytes(host),
    );
}
