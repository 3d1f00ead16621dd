//! The expert offload flags: which routed experts stay in the device's memory, which live in
//! host RAM (computed there when cold) and how many device slots cache them.

use std::sync::Arc;

use clap::Args;
use kimi_model::{CausalLm, ExpertOffload, LoadOptions, OffloadAmount};
use kimi_ops::offload::{CachePolicy, HostBackend, HostExpertStore, MissCosts, MissPolicy};
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
    /// Where a host expert that a step needs and no slot holds is served: `copy` it into a
    /// device slot (evicting the least recently used), compute it on the CPU for the
    /// step's tokens (`cpu`), or `auto`: each miss on the side whose share of the step
    /// would end sooner, by the copy and CPU costs measured at load (in the start log).
    #[arg(long, value_name = "auto|copy|cpu", default_value = "auto")]
    pub offload_miss: MissPolicy,
    /// When host experts are copied into device slots: once a layer's router has chosen
    /// them (`router`), or also ahead, on a prediction made one MoE layer earlier (the
    /// next layer's router on this layer's input: `next-layer`), so that the copies run
    /// while the host computes its cold experts and the device the next attention.
    #[arg(long, value_name = "router|next-layer", default_value = "router")]
    pub offload_prefetch: OffloadPrefetch,
    /// Also copy the experts the CPU computed in a step (its cold ones) into device slots
    /// after it, while the link idles (as many as the CPU's share of the step leaves time
    /// for), so that the layer's next step finds them there: the CPU serves a miss at
    /// once and the cache still learns it.
    #[arg(long)]
    pub offload_copy_behind: bool,
}

/// `--offload-prefetch`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OffloadPrefetch {
    /// After each layer's router.
    #[default]
    Router,
    /// Also one MoE layer ahead, predicted.
    NextLayer,
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
        Ok(LoadOptions {
            offload: Some(ExpertOffload {
                host,
                cache: cache.unwrap_or(OffloadAmount::Experts(0)),
                policy: CachePolicy {
                    miss: self.offload_miss,
                    predict_next: self.offload_prefetch == OffloadPrefetch::NextLayer,
                    copy_behind: self.offload_copy_behind,
                    ..CachePolicy::default()
                },
                store: self.store()?,
            }),
            ..LoadOptions::default()
        })
    }

    /// The host store: a CPU backend with f32 products (its tensors keep the stored layout,
    /// which the device slots are filled from), in RAM or in `--offload-folder`'s files.
    fn store(&self) -> anyhow::Result<Arc<dyn HostExpertStore>> {
        let cpu = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
        Ok(match &self.offload_folder {
            Some(dir) => {
                let file = kimi_cpu::WeightFile::new(dir)
                    .map_err(|e| anyhow::anyhow!("--offload-folder: {e}"))?;
                let tier = format!("memory-mapped files in {}", dir.display());
                Arc::new(
                    HostBackend::new(Arc::new(cpu.keeping_weights_in(Arc::new(file))))
                        .in_tier(tier),
                )
            }
            None => Arc::new(HostBackend::new(Arc::new(cpu))),
        })
    }

    /// Fills `options` with an automatic split when no offload flag was given, the model
    /// runs on a GPU (`device` = its free and total bytes) and its weights would not fit
    /// ([`auto_plan`]); says what it chose. `expert_bytes`: what the routed experts will
    /// take on the device where that is not the config's dtype (4-bit experts kept packed).
    pub fn auto_offload(
        &self,
        options: &mut LoadOptions,
        cfg: &kimi_core::ModelConfig,
        device: Option<(u64, u64)>,
        utilization: Option<f64>,
        expert_bytes: Option<u64>,
    ) -> anyhow::Result<()> {
        let (Some((free, total)), None) = (device, &options.offload) else {
            return Ok(());
        };
        let summary = kimi_model::ModelSummary::new(cfg);
        let summary = match expert_bytes {
            Some(bytes) => summary.with_routed_expert_bytes(bytes),
            None => summary,
        };
        let utilization = utilization.unwrap_or(crate::cache_plan::DEFAULT_GPU_UTILIZATION);
        let host_room = crate::memory::HostMemory::read().usable();
        let Some(plan) = auto_plan(&summary, free, total, utilization, host_room)? else {
            return Ok(());
        };
        eprintln!(
            "the weights ({}) do not fit {} of the GPU's memory (85 % of \
             --gpu-memory-utilization {utilization}, the rest kept for the cache): {} of {} \
             routed experts per MoE layer go to {} with {} device cache slots (choose with \
             --cpu-offload-gb / --offload-experts and --expert-cache-slots)",
            crate::inspect::bytes(summary.total_bytes()),
            crate::inspect::bytes(plan.weight_room),
            plan.host,
            summary.num_experts,
            self.store()?.tier(),
            plan.slots,
        );
        options.offload = Some(ExpertOffload {
            host: OffloadAmount::Experts(plan.host),
            cache: OffloadAmount::Experts(plan.slots),
            policy: CachePolicy::default(),
            store: self.store()?,
        });
        Ok(())
    }
}

/// Share of the GPU budget (`--gpu-memory-utilization` of its memory) the weights may take
/// when experts are placed automatically; the rest is for the cache pool and activations.
pub const AUTO_WEIGHT_SHARE: f64 = 0.85;

/// An automatic split of the routed experts: per MoE layer, `host` experts in host RAM
/// behind `slots` device cache slots, the rest on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoPlan {
    /// Experts per MoE layer in host RAM.
    pub host: usize,
    /// Device slots per MoE layer caching them.
    pub slots: usize,
    /// Bytes of GPU memory the weights may take.
    pub weight_room: u64,
}

/// Share of the host memory this process may still take (`HostMemory::usable`) that the
/// routed experts may fill when every one of them is kept there.
pub const AUTO_HOST_SHARE: f64 = 0.75;

/// The split that fits the model's weights into [`AUTO_WEIGHT_SHARE`] of `utilization` of a
/// GPU of `total` bytes with `free` of them free (what others hold is not ours), or `None`
/// where they fit as they are. Every non-expert weight stays on the GPU. Where every routed
/// expert fits [`AUTO_HOST_SHARE`] of `host_room` (bytes of host memory still usable), all
/// of them live in host RAM and the GPU's room for experts is all cache slots: the cache
/// then holds whichever experts the traffic asks for, where resident experts would be the
/// lowest ids whatever the routing (the 48B with random routers, a 50 % budget, every miss
/// copied: hit rate 64 % → 83 % at batch 1, 60 % → 78 % at 16). Otherwise up to `top_k`
/// experts' worth per layer (at most half the room) become slots and the rest hold the
/// lowest expert ids. An error where not even the non-expert weights fit, or where the
/// model has no routed experts to move.
pub fn auto_plan(
    summary: &kimi_model::ModelSummary,
    free: u64,
    total: u64,
    utilization: f64,
    host_room: Option<u64>,
) -> anyhow::Result<Option<AutoPlan>> {
    anyhow::ensure!(
        utilization > 0.0 && utilization <= 1.0,
        "--gpu-memory-utilization must be in (0, 1], got {utilization}"
    );
    let used_by_others = total.saturating_sub(free);
    let budget = ((total as f64 * utilization) as u64).saturating_sub(used_by_others);
    let weight_room = (budget as f64 * AUTO_WEIGHT_SHARE) as u64;
    let weights = summary.total_bytes();
    if weights <= weight_room {
        return Ok(None);
    }
    let experts = summary
        .component(kimi_model::Component::RoutedExperts)
        .bytes;
    let layers = summary.num_moe_layers as u64;
    let per_expert = summary.bytes_per_expert;
    let room = |b: u64| crate::inspect::bytes(b);
    anyhow::ensure!(
        experts > 0 && layers > 0 && per_expert > 0,
        "the weights ({}) do not fit {} of the GPU's memory (85 % of --gpu-memory-utilization \
         {utilization}) and the model has no routed experts to keep in host RAM",
        room(weights),
        room(weight_room)
    );
    let dense = weights - experts;
    anyhow::ensure!(
        dense < weight_room,
        "the weights other than the routed experts ({}) do not fit {} of the GPU's memory \
         (85 % of --gpu-memory-utilization {utilization}); raise it or use more GPUs",
        room(dense),
        room(weight_room)
    );
    let num_experts = summary.num_experts as usize;
    let fit = (((weight_room - dense) / layers / per_expert) as usize).min(num_experts);
    if host_room.is_some_and(|room| experts as f64 <= room as f64 * AUTO_HOST_SHARE) {
        return Ok(Some(AutoPlan {
            host: num_experts,
            slots: fit,
            weight_room,
        }));
    }
    let slots = (summary.top_k as usize).min(fit / 2);
    let host = num_experts - (fit - slots);
    Ok(Some(AutoPlan {
        host,
        slots: slots.min(host),
        weight_room,
    }))
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
    // Under expert parallelism each rank places its own share; rank 0's is said.
    let whose = match model.expert_ranks() {
        Some(p) => format!("rank 0 of {}: ", p.world()),
        None => String::new(),
    };
    eprintln!(
        "experts: {whose}per MoE layer {} on {} and {} in {tier} with {} cache slots ({} \
         layers: {} on the device, {} in {tier}); cold experts computed on the CPU{}",
        first.resident,
        model.backend().name(),
        first.host,
        first.slots,
        layers.len(),
        crate::inspect::bytes(device),
        crate::inspect::bytes(host),
        also_filled(options.offload.as_ref().map(|o| o.policy)),
    );
    if let Some(c) = first.miss_costs {
        eprintln!(
            "{}",
            describe_miss_costs(&c, first.host_bytes / first.host.max(1) as u64)
        );
    }
}

/// The start log's words on slot fills besides a step's own misses, if any.
fn also_filled(policy: Option<CachePolicy>) -> String {
    let Some(p) = policy else {
        return String::new();
    };
    let mut ways = Vec::new();
    if p.predict_next {
        ways.push("one MoE layer ahead, predicted (--offload-prefetch)");
    }
    if p.copy_behind {
        ways.push("with the CPU's cold experts after it computed them (--offload-copy-behind)");
    }
    match ways.is_empty() {
        true => String::new(),
        false => format!("; slots also filled {}", ways.join(", and ")),
    }
}

/// The start log's line on measured miss costs, for experts of `expert_bytes`.
pub fn describe_miss_costs(c: &MissCosts, expert_bytes: u64) -> String {
    let rate = |s: f64| expert_bytes as f64 / s.max(1e-12) / 1e9;
    format!(
        "expert misses: copying one into a slot takes {:.3} ms ({:.1} GB/s), the CPU computes \
         one for a token in {:.3} ms ({:.1} GB/s), {:.3} ms per further token and {:.3} ms \
         ({:.1} GB/s) per further expert of the step: each miss goes where the step ends \
         sooner (--offload-miss auto)",
        c.fill_s * 1e3,
        rate(c.fill_s),
        c.host_first_s * 1e3,
        rate(c.host_first_s),
        c.host_next_s * 1e3,
        c.host_more_s * 1e3,
        rate(c.host_more_s),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kimi_model::{Component, ModelSummary};

    const GIB: u64 = 1 << 30;

    fn summary(path: &str) -> ModelSummary {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
        let cfg =
            kimi_core::ModelConfig::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        ModelSummary::new(&cfg)
    }

    /// Bytes the plan leaves on the GPU: every non-expert weight, the resident experts and
    /// the slots.
    fn on_gpu(s: &ModelSummary, p: &AutoPlan) -> u64 {
        let dense = s.total_bytes() - s.component(Component::RoutedExperts).bytes;
        let per_layer = s.num_experts as usize - p.host + p.slots;
        dense + (per_layer as u64) * s.num_moe_layers as u64 * s.bytes_per_expert
    }

    #[test]
    fn kimi_k3_keeps_what_fits_on_the_gpu_and_moves_the_rest() {
        let s = summary("../../configs/kimi-k3.config.json");
        // One H200: the non-expert weights (114 GB) take the room; every expert is the
        // host's and computed there (no slot would fit).
        let p = auto_plan(&s, 140 * GIB, 141 * GIB, 0.9, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            p.weight_room,
            ((((141 * GIB) as f64 * 0.9) as u64 - GIB) as f64 * AUTO_WEIGHT_SHARE) as u64
        );
        assert_eq!((p.host, p.slots), (s.num_experts as usize, 0), "{p:?}");
        assert!(on_gpu(&s, &p) <= p.weight_room, "{p:?}");
        // A 288 GiB card: some experts stay, `top_k` slots cache the others; everything
        // planned onto the GPU fits, and one more resident expert per layer would not.
        let p = auto_plan(&s, 288 * GIB, 288 * GIB, 0.9, None)
            .unwrap()
            .unwrap();
        assert!(p.host > 0 && p.host < s.num_experts as usize, "{p:?}");
        assert_eq!(p.slots, s.top_k as usize);
        assert!(on_gpu(&s, &p) <= p.weight_room, "{p:?}");
        let tighter = AutoPlan {
            host: p.host - 1,
            ..p
        };
        assert!(on_gpu(&s, &tighter) > p.weight_room, "{p:?}");
    }

    #[test]
    fn kimi_linear_48b_fits_an_h200_and_not_a_40_gib_card() {
        let s = summary("../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json");
        assert_eq!(
            auto_plan(&s, 141 * GIB, 141 * GIB, 0.9, None).unwrap(),
            None
        );
        let p = auto_plan(&s, 40 * GIB, 40 * GIB, 0.9, None)
            .unwrap()
            .unwrap();
        assert!(p.host > 0 && p.slots > 0, "{p:?}");
        assert!(on_gpu(&s, &p) <= p.weight_room);
        // A lower utilization moves more experts.
        let q = auto_plan(&s, 40 * GIB, 40 * GIB, 0.5, None)
            .unwrap()
            .unwrap();
        assert!(q.host > p.host, "{q:?} against {p:?}");
    }

    #[test]
    fn packed_4bit_experts_of_the_48b_fit_an_h100() {
        // bf16 experts do not fit 85 % of 90 % of an 80 GiB card; kept packed at 6 bits a
        // value (Q4Z) they do, with nothing moved to host RAM.
        let s = summary("../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json");
        assert!(auto_plan(&s, 79 * GIB, 80 * GIB, 0.9, None)
            .unwrap()
            .is_some());
        let values = s.component(Component::RoutedExperts).params;
        let packed = s.clone().with_routed_expert_bytes(values * 3 / 4);
        assert_eq!(packed.bytes_per_expert, s.bytes_per_expert * 3 / 8);
        assert_eq!(
            auto_plan(&packed, 79 * GIB, 80 * GIB, 0.9, None).unwrap(),
            None
        );
    }

    #[test]
    fn every_expert_goes_to_host_ram_behind_slots_where_it_fits_there() {
        let s = summary("../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json");
        let experts = s.component(Component::RoutedExperts).bytes;
        let split = auto_plan(&s, 40 * GIB, 40 * GIB, 0.9, None)
            .unwrap()
            .unwrap();
        // Host RAM with room for every expert (and a quarter more): the same GPU room, all
        // of it slots.
        let room = (experts as f64 / AUTO_HOST_SHARE) as u64 + 1;
        let p = auto_plan(&s, 40 * GIB, 40 * GIB, 0.9, Some(room))
            .unwrap()
            .unwrap();
        assert_eq!(p.host, s.num_experts as usize, "{p:?}");
        assert_eq!(p.slots, s.num_experts as usize - split.host + split.slots);
        assert!(on_gpu(&s, &p) <= p.weight_room, "{p:?}");
        // Too little: the split with resident experts.
        let q = auto_plan(&s, 40 * GIB, 40 * GIB, 0.9, Some(room - 2)).unwrap();
        assert_eq!(q, Some(split));
        // Nothing to move: nothing planned, whatever the host has.
        assert_eq!(
            auto_plan(&s, 141 * GIB, 141 * GIB, 0.9, Some(1 << 50)).unwrap(),
            None
        );
    }

    #[test]
    fn what_cannot_fit_is_an_error_naming_the_flag() {
        let s = summary("../../configs/kimi-k3.config.json");
        let e = auto_plan(&s, 24 * GIB, 24 * GIB, 0.9, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("other than the routed experts") && e.contains("--gpu-memory-utilization"),
            "{e}"
        );
        let e = auto_plan(&s, 24 * GIB, 24 * GIB, 1.5, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--gpu-memory-utilization must be in (0, 1]"),
            "{e}"
        );
    }
}
