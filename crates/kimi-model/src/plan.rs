//! Where a model's bytes go on a machine, and the decode speed its bandwidths allow.
//!
//! Placement: the non-expert weights and the caches of the batch sit on the GPUs, split
//! evenly (tensor parallel; on host RAM without GPUs). Routed experts then fill the tiers in
//! order, whole experts only: GPU HBM (expert parallel, the same count on every GPU), host
//! RAM, disk.
//!
//! Roofline: a decode step of `B` tokens reads every non-expert weight once (one embedding
//! row per token), each sequence's KDA state and convolution windows (read and written back)
//! and its MLA cache, and the routed experts the batch touches: `E·(1 − (1 − k/E)^B)` distinct
//! experts per layer on average under uniform, independent routing, split over the tiers in
//! proportion to how many experts each holds (placement blind to popularity). Each link's
//! bytes over its bandwidth give a time; in sequence the times add, perfectly overlapped the
//! slowest link sets the pace. Compute, kernel launches and inter-GPU traffic are not
//! counted: these are ceilings.

use crate::summary::ModelSummary;

/// A machine: capacities in bytes, bandwidths in bytes per second.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// GPUs (0: the CPU holds and computes everything).
    pub gpus: u64,
    /// Memory of one GPU.
    pub gpu_mem: u64,
    /// Memory kept free on each GPU (CUDA context, workspaces, activations).
    pub gpu_reserve: u64,
    /// Host RAM.
    pub ram: u64,
    /// Host RAM kept free (operating system, the process itself).
    pub ram_reserve: u64,
    /// Free disk space.
    pub disk: u64,
    /// Memory bandwidth of one GPU.
    pub gpu_bw: f64,
    /// Host-to-GPU bandwidth of one GPU's link.
    pub pcie_bw: f64,
    /// Host memory read bandwidth, all sockets together.
    pub ram_bw: f64,
    /// The rate at which the CPU computes routed experts, in bytes of expert weights per
    /// second, where it was measured (`bench`'s `offload_miss_costs`); `None`: host RAM
    /// bandwidth, the ceiling.
    pub cpu_expert_bw: Option<f64>,
    /// Disk read bandwidth.
    pub disk_bw: f64,
}

/// What the caches are sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Sequences decoded together.
    pub batch: u64,
    /// Tokens each sequence holds.
    pub context: u64,
}

/// A memory tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// The GPUs' memory, all GPUs together.
    Gpu,
    /// Host RAM.
    Ram,
    /// Local disk.
    Disk,
}

impl Tier {
    /// A short name (JSON keys).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Ram => "ram",
            Tier::Disk => "disk",
        }
    }
}

/// What one tier holds.
#[derive(Clone, Debug, PartialEq)]
pub struct TierUse {
    /// The tier.
    pub tier: Tier,
    /// Usable bytes (reserves taken off).
    pub capacity: u64,
    /// Non-expert weights and caches placed here.
    pub fixed: u64,
    /// Routed experts placed here, over all MoE layers.
    pub experts: u64,
    /// Their bytes.
    pub expert_bytes: u64,
}

impl TierUse {
    /// Bytes placed here.
    pub fn used(&self) -> u64 {
        self.fixed + self.expert_bytes
    }
}

/// A placement of a model on a machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The machine.
    pub machine: Machine,
    /// The workload the caches are sized for.
    pub workload: Workload,
    /// Non-expert weight bytes.
    pub weights: u64,
    /// Cache bytes of the workload (KDA state and windows, MLA cache).
    pub cache: u64,
    /// Routed experts over all MoE layers.
    pub experts_total: u64,
    /// MoE layers.
    pub moe_layers: u64,
    /// Bytes of one routed expert.
    pub bytes_per_expert: u64,
    /// The tiers that exist, GPU first.
    pub tiers: Vec<TierUse>,
    /// Bytes of weights and caches the first tier lacks room for.
    pub fixed_shortfall: u64,
    /// Routed experts no tier has room for.
    pub experts_unplaced: u64,
}

/// Expected distinct experts per layer that `batch` tokens touch, each picking `top_k` of
/// `num_experts` uniformly and independently: `E·(1 − (1 − k/E)^B)`.
pub fn experts_touched(num_experts: u64, top_k: u64, batch: u64) -> f64 {
    if num_experts == 0 {
        return 0.0;
    }
    let e = num_experts as f64;
    let miss = 1.0 - (top_k.min(num_experts) as f64) / e;
    e * (1.0 - miss.powf(batch as f64))
}

impl Plan {
    /// Places `summary`'s model on `machine` for `workload`.
    pub fn new(summary: &ModelSummary, machine: &Machine, workload: Workload) -> Self {
        let weights = summary.non_expert_bytes();
        let cache = workload.batch * summary.cache_bytes_per_seq(workload.context);
        let fixed = weights + cache;
        let bpe = summary.bytes_per_expert;
        let experts_total = summary.num_experts * summary.num_moe_layers as u64;
        let mut left = if bpe == 0 { 0 } else { experts_total };
        let mut tiers = Vec::new();
        let mut take = |tier: Tier, capacity: u64, fixed: u64, slots: u64, left: &mut u64| {
            let experts = slots.min(*left);
            *left -= experts;
            tiers.push(TierUse {
                tier,
                capacity,
                fixed,
                experts,
                expert_bytes: experts * bpe,
            });
        };
        let slots = |free: u64| free.checked_div(bpe).unwrap_or(0);
        let ram = machine.ram.saturating_sub(machine.ram_reserve);
        let fixed_shortfall;
        if machine.gpus > 0 {
            let per_gpu = machine.gpu_mem.saturating_sub(machine.gpu_reserve);
            let capacity = per_gpu * machine.gpus;
            // Each GPU holds an equal share of the fixed bytes and whole experts beside it.
            let share = fixed.div_ceil(machine.gpus);
            fixed_shortfall = fixed.saturating_sub(capacity);
            let per_gpu_slots = slots(per_gpu.saturating_sub(share));
            take(
                Tier::Gpu,
                capacity,
                fixed,
                per_gpu_slots * machine.gpus,
                &mut left,
            );
            take(Tier::Ram, ram, 0, slots(ram), &mut left);
        } else {
            fixed_shortfall = fixed.saturating_sub(ram);
            take(
                Tier::Ram,
                ram,
                fixed,
                slots(ram.saturating_sub(fixed)),
                &mut left,
            );
        }
        take(Tier::Disk, machine.disk, 0, slots(machine.disk), &mut left);
        Self {
            machine: machine.clone(),
            workload,
            weights,
            cache,
            experts_total,
            moe_layers: summary.num_moe_layers as u64,
            bytes_per_expert: bpe,
            tiers,
            fixed_shortfall,
            experts_unplaced: left,
        }
    }

    /// Whether everything has a place.
    pub fn fits(&self) -> bool {
        self.fixed_shortfall == 0 && self.experts_unplaced == 0
    }

    /// Bytes the model and caches need in all.
    pub fn needed_bytes(&self) -> u64 {
        self.weights + self.cache + self.experts_total * self.bytes_per_expert
    }

    /// Bytes that have no place.
    pub fn shortfall_bytes(&self) -> u64 {
        self.fixed_shortfall + self.experts_unplaced * self.bytes_per_expert
    }

    /// What `tier` holds, if the machine has it.
    pub fn tier(&self, tier: Tier) -> Option<&TierUse> {
        self.tiers.iter().find(|t| t.tier == tier)
    }

    /// Whether the GPUs alone hold everything.
    pub fn fits_in_gpus(&self) -> bool {
        self.fits()
            && self
                .tier(Tier::Gpu)
                .is_some_and(|g| g.experts == self.experts_total)
    }

    /// Routed experts per MoE layer in `tier` (an average where layers differ by one).
    pub fn experts_per_layer(&self, tier: Tier) -> f64 {
        match (self.tier(tier), self.moe_layers) {
            (Some(t), l) if l > 0 => t.experts as f64 / l as f64,
            _ => 0.0,
        }
    }

    /// The decode rooflines of a step of `batch` tokens.
    pub fn roofline(&self, summary: &ModelSummary, batch: u64) -> Roofline {
        let m = &self.machine;
        let touched = experts_touched(summary.num_experts, summary.top_k, batch);
        let touched_bytes = touched * self.moe_layers as f64 * self.bytes_per_expert as f64;
        let share = |tier: Tier| -> f64 {
            match self.tier(tier) {
                Some(t) if self.experts_total > 0 => {
                    touched_bytes * t.experts as f64 / self.experts_total as f64
                }
                _ => 0.0,
            }
        };
        // Every sequence reads and rewrites its KDA state and windows, reads its MLA cache
        // and appends one token to it.
        let per_seq = 2 * (summary.kda_state_bytes_per_seq() + summary.kda_conv_bytes_per_seq())
            + summary.mla_cache_bytes_per_token() * (self.workload.context + 1);
        let home = summary.non_expert_read_bytes(batch) as f64 + (batch * per_seq) as f64;
        let (gpu, ram, disk) = (share(Tier::Gpu), share(Tier::Ram), share(Tier::Disk));
        let disk_link = Link::new("disk", disk, m.disk_bw);
        let mut scenarios = Vec::new();
        if m.gpus > 0 {
            let n = m.gpus as f64;
            let hbm = Link::new("GPU HBM", home + gpu, n * m.gpu_bw);
            // Host-resident experts stream to the GPUs over every GPU's link at once, as
            // fast as host memory can feed them.
            let pcie = Link::new("host->GPU PCIe", ram + disk, (n * m.pcie_bw).min(m.ram_bw));
            let cpu_bw = m.cpu_expert_bw.map_or(m.ram_bw, |c| c.min(m.ram_bw));
            let cpu = Link::new("host RAM (CPU)", ram + disk, cpu_bw);
            if ram + disk > 0.0 {
                scenarios.push(Scenario::new(
                    "gpu_experts",
                    "every expert computed on the GPUs; host experts cross PCIe",
                    batch,
                    vec![hbm.clone(), pcie, disk_link.clone()],
                ));
                scenarios.push(Scenario::new(
                    "cpu_experts",
                    match m.cpu_expert_bw {
                        None => "experts outside HBM computed by the CPU at host-memory bandwidth",
                        Some(_) => "experts outside HBM computed by the CPU at its measured rate",
                    },
                    batch,
                    vec![hbm, cpu, disk_link],
                ));
            } else {
                scenarios.push(Scenario::new(
                    "gpu",
                    "everything on the GPUs",
                    batch,
                    vec![hbm],
                ));
            }
        } else {
            let ram_link = Link::new("host RAM", home + ram + disk, m.ram_bw);
            scenarios.push(Scenario::new(
                "cpu",
                "everything computed by the CPU",
                batch,
                vec![ram_link, disk_link],
            ));
        }
        Roofline {
            batch,
            experts_touched_per_layer: touched,
            scenarios,
        }
    }
}

/// Bytes over one link in a decode step.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    /// What the link is.
    pub name: &'static str,
    /// Bytes it carries per step.
    pub bytes: f64,
    /// Its bandwidth, bytes per second.
    pub bandwidth: f64,
}

impl Link {
    fn new(name: &'static str, bytes: f64, bandwidth: f64) -> Self {
        Self {
            name,
            bytes,
            bandwidth,
        }
    }

    /// Seconds the bytes take (infinite over a link of no bandwidth).
    pub fn seconds(&self) -> f64 {
        match self.bytes {
            b if b <= 0.0 => 0.0,
            b => b / self.bandwidth,
        }
    }
}

/// One way of running the step.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// A short name (JSON keys).
    pub name: &'static str,
    /// What is assumed.
    pub description: &'static str,
    /// Tokens per step.
    pub batch: u64,
    /// The links with traffic.
    pub links: Vec<Link>,
}

impl Scenario {
    fn new(name: &'static str, description: &'static str, batch: u64, links: Vec<Link>) -> Self {
        let mut links: Vec<Link> = links.into_iter().filter(|l| l.bytes > 0.0).collect();
        if links.is_empty() {
            links.push(Link::new("none", 0.0, 1.0));
        }
        Self {
            name,
            description,
            batch,
            links,
        }
    }

    /// Step time with the links used one after another.
    pub fn serial_seconds(&self) -> f64 {
        self.links.iter().map(Link::seconds).sum()
    }

    /// Step time with the links overlapped perfectly.
    pub fn overlapped_seconds(&self) -> f64 {
        self.links.iter().map(Link::seconds).fold(0.0, f64::max)
    }

    /// Tokens per second at `seconds` per step.
    pub fn tokens_per_second(&self, seconds: f64) -> f64 {
        if seconds > 0.0 {
            self.batch as f64 / seconds
        } else {
            f64::INFINITY
        }
    }
}

/// The decode rooflines at one batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    /// Tokens per step.
    pub batch: u64,
    /// Expected distinct routed experts per MoE layer the step reads.
    pub experts_touched_per_layer: f64,
    /// The ways of running it.
    pub scenarios: Vec<Scenario>,
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
