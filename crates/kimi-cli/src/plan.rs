//! `kimi-infer plan`: whether a model fits a machine, where its bytes go, and the decode
//! tokens/s the machine's bandwidths allow. The arithmetic is `kimi_model::plan`'s; this
//! file reads the flags and prints.
//!
//! Default bandwidths and where they come from:
//! - GPU: 4,800 GB/s, the H200 datasheet figure. Measured copies reach 4.0–4.5 TB/s (Azure
//!   ND H200 v5 stream results, `shared/docs/performance-anchors.md` §5.1) and 4.3 TB/s on
//!   this project's H200 machines.
//! - PCIe: 55 GB/s per GPU. PCIe 5.0 x16 carries 63 GB/s raw; a pinned 4 GiB host-to-device
//!   copy measured 55.4 GB/s on an H200 here (torch, Dec 2026); Azure's nvbandwidth on ND
//!   H200 v5 reports 52.
//! - Host RAM: 614 GB/s, the peak of 2 sockets × 8 channels of DDR5-4800 (the Xeon Platinum
//!   8480C hosts of HGX H200 nodes such as ND H200 v5). CPU engines reach 50–70% of the
//!   peak on MoE decode (performance-anchors §4).
//! - Disk: 7 GB/s, one PCIe 4.0 x4 NVMe drive's sequential read. ND H200 v5's striped local
//!   NVMe reads 55 GB/s (Azure fio results); this project's virtual disks about 1.5.
//!
//! `--measured BENCH.json` replaces the link figure, and adds the CPU's expert rate, with
//! what `bench` measured on the machine (`offload_miss_costs`: the time of one slot fill and
//! of the CPU computing one expert for one token, over the expert's stored bytes).

use std::io::Write;

use std::path::{Path, PathBuf};

use anyhow::Context;
use kimi_model::plan::{Machine, Plan, Roofline, Tier, Workload};
use kimi_model::ModelSummary;
use serde_json::json;

use crate::args::PlanArgs;
use crate::inspect::{grouped, human, is_broken_pipe, si};

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;

/// Batches the rooflines are always given at.
const ROOFLINE_BATCHES: [u64; 2] = [1, 64];

pub fn plan(a: PlanArgs) -> anyhow::Result<()> {
    match report(a) {
        Err(e) if is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}

/// `summary` with a quantized checkpoint's routed experts counted as the CUDA backend will
/// hold them (4-bit ones packed, other packed types widened to bf16:
/// `KernelConfig::keeps_routed_experts` under this process's `KIMI_CUDA_*` settings) where
/// the config's dtype says otherwise. Only a checkpoint directory whose config names a
/// quantization tool is read (one expert's tensors); a config file, an unquantized
/// checkpoint or one that cannot be read here is sized by its config, as before (`run`
/// and `serve` name what is wrong with a checkpoint when they load it).
fn as_held_on_gpus(
    summary: ModelSummary,
    path: &Path,
    cfg: &kimi_core::ModelConfig,
) -> ModelSummary {
    if !path.is_dir() {
        return summary;
    }
    let Ok(ckpt) = kimi_weights::Checkpoint::open(path) else {
        return summary;
    };
    let Ok(source) = kimi_model::CheckpointSource::new(&ckpt) else {
        return summary;
    };
    if source.quant_scheme().is_none() {
        return summary;
    }
    let kernels = kimi_cuda::KernelConfig::from_env();
    let keeps = |d| kernels.keeps_routed_experts(d);
    match kimi_model::routed_expert_bytes(&keeps, &source, cfg) {
        Ok(Some(bytes)) => summary.with_routed_expert_bytes(bytes),
        _ => summary,
    }
}

fn report(a: PlanArgs) -> anyhow::Result<()> {
    for (flag, value) in [
        ("--gpu-bw", a.gpu_bw),
        ("--pcie-bw", a.pcie_bw),
        ("--ram-bw", a.ram_bw),
        ("--disk-bw", a.disk_bw),
    ] {
        anyhow::ensure!(
            value.is_finite() && value > 0.0,
            "{flag} must be a positive number of GB/s, not {value}"
        );
    }
    anyhow::ensure!(a.batch >= 1, "--batch must be at least 1");
    let path = crate::hub::resolve_model(&a.model, false)?;
    let cfg = crate::load::config_of(&path)?;
    let summary = as_held_on_gpus(ModelSummary::new(&cfg), &path, &cfg);
    let measured = a.measured.as_deref().map(Measured::read).transpose()?;
    let machine = Machine {
        gpus: a.gpus,
        gpu_mem: a.gpu_mem,
        gpu_reserve: a.gpu_reserve,
        ram: a.ram,
        ram_reserve: a.ram_reserve,
        disk: a.disk,
        gpu_bw: a.gpu_bw * GB,
        pcie_bw: measured.as_ref().map_or(a.pcie_bw * GB, |m| m.link_bw()),
        ram_bw: a.ram_bw * GB,
        cpu_expert_bw: measured.as_ref().map(|m| m.cpu_bw()),
        disk_bw: a.disk_bw * GB,
    };
    let workload = Workload {
        batch: a.batch,
        context: a.context,
    };
    let plan = Plan::new(&summary, &machine, workload);
    let mut batches = ROOFLINE_BATCHES.to_vec();
    if !batches.contains(&a.batch) {
        batches.push(a.batch);
        batches.sort_unstable();
    }
    let rooflines: Vec<Roofline> = batches
        .iter()
        .map(|&b| plan.roofline(&summary, b))
        .collect();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.json {
        let mut v = to_json(&a, &cfg, &summary, &plan, &rooflines);
        if let Some(m) = &measured {
            v["measured"] = m.to_json();
        }
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    write_text(&a, &cfg, &summary, &plan, &rooflines, &mut out)?;
    if let Some(m) = &measured {
        writeln!(out, "measured   {}", m.describe())?;
    }
    Ok(())
}

/// What one `bench` run with experts in host RAM measured (its `offload_miss_costs`).
struct Measured {
    file: PathBuf,
    backend: String,
    fill_s: f64,
    cpu_s: f64,
    expert_bytes: f64,
}

impl Measured {
    fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--measured: cannot read {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("--measured: {} is not JSON", path.display()))?;
        let costs = v.get("offload_miss_costs").filter(|c| !c.is_null());
        let Some(costs) = costs else {
            anyhow::bail!(
                "--measured: {} has no offload_miss_costs: it must be the JSON of a `bench` run                  with experts in host RAM (--cpu-offload-gb, --offload-experts)",
                path.display()
            );
        };
        let field = |name: &str| -> anyhow::Result<f64> {
            costs
                .get(name)
                .and_then(|x| x.as_f64())
                .filter(|x| x.is_finite() && *x > 0.0)
                .with_context(|| {
                    format!(
                        "--measured: {}: offload_miss_costs.{name} is missing or not a positive \
                         number",
                        path.display()
                    )
                })
        };
        // Runs before `expert_bytes` was written: the expert's size from the config it ran.
        let expert_bytes = match field("expert_bytes") {
            Ok(b) => b,
            Err(_) => {
                let model = v.get("model").and_then(|m| m.as_str()).unwrap_or_default();
                match crate::load::config_of(Path::new(model)) {
                    Ok(cfg) => ModelSummary::new(&cfg).bytes_per_expert as f64,
                    Err(_) => anyhow::bail!(
                        "--measured: {} has no offload_miss_costs.expert_bytes (a run older than \
                         the field) and its model `{model}` cannot be read for the expert's size",
                        path.display()
                    ),
                }
            }
        };
        Ok(Self {
            file: path.to_path_buf(),
            backend: v
                .get("backend")
                .and_then(|b| b.as_str())
                .unwrap_or("an unnamed backend")
                .to_string(),
            fill_s: field("fill_ms")? / 1e3,
            cpu_s: field("cpu_first_ms")? / 1e3,
            expert_bytes,
        })
    }

    /// One GPU's host-to-device rate for expert fills, bytes/s.
    fn link_bw(&self) -> f64 {
        self.expert_bytes / self.fill_s
    }

    /// The CPU's rate computing experts, bytes of weights per second.
    fn cpu_bw(&self) -> f64 {
        self.expert_bytes / self.cpu_s
    }

    fn describe(&self) -> String {
        format!(
            "{} ({}): a slot fill {:.3} ms and the CPU {:.3} ms per {} expert -> link {:.1} \
             GB/s per GPU, CPU experts {:.1} GB/s (these replace --pcie-bw and cap --ram-bw for \
             the CPU's experts)",
            self.file.display(),
            self.backend,
            self.fill_s * 1e3,
            self.cpu_s * 1e3,
            si(self.expert_bytes as u64),
            self.link_bw() / GB,
            self.cpu_bw() / GB
        )
    }

    fn to_json(&self) -> serde_json::Value {
        json!({"file": self.file.display().to_string(), "backend": self.backend,
               "fill_seconds": self.fill_s, "cpu_expert_seconds": self.cpu_s,
               "expert_bytes": self.expert_bytes, "link_bytes_per_s": self.link_bw(),
               "cpu_expert_bytes_per_s": self.cpu_bw()})
    }
}

fn tier_label(t: Tier) -> &'static str {
    match t {
        Tier::Gpu => "GPU HBM",
        Tier::Ram => "host RAM",
        Tier::Disk => "disk",
    }
}

fn percent(used: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        100.0 * used as f64 / of as f64
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.0} GiB", bytes as f64 / GIB)
}

/// One line saying whether the model fits, and where.
fn verdict(p: &Plan) -> String {
    let holding: Vec<_> = p.tiers.iter().filter(|t| t.used() > 0).collect();
    let used: u64 = holding.iter().map(|t| t.used()).sum();
    let capacity: u64 = holding.iter().map(|t| t.capacity).sum();
    let names: Vec<&str> = holding.iter().map(|t| tier_label(t.tier)).collect();
    if !p.fits() {
        if p.fixed_shortfall > 0 {
            let first = p.tiers.first().map_or("memory", |t| tier_label(t.tier));
            return format!(
                "no: the non-expert weights and caches ({}) exceed {first} by {}",
                si(p.weights + p.cache),
                si(p.fixed_shortfall)
            );
        }
        return format!(
            "no: short by {} ({} routed experts, {:.1} per layer, have no place in {})",
            si(p.shortfall_bytes()),
            grouped(p.experts_unplaced),
            p.experts_unplaced as f64 / p.moe_layers.max(1) as f64,
            names.join(" + ")
        );
    }
    let share = percent(used, capacity);
    let nearly = if share >= 90.0 { ", nearly full" } else { "" };
    let mut line = format!(
        "yes, in {}: {} of their usable {} ({share:.1}%{nearly})",
        names.join(" + "),
        si(used),
        si(capacity)
    );
    if let Some(gpu) = p.tier(Tier::Gpu) {
        if !p.fits_in_gpus() {
            line += &format!(
                "; not in GPU HBM alone (short by {})",
                si(p.needed_bytes().saturating_sub(gpu.capacity))
            );
        }
    }
    line
}

fn write_text(
    a: &PlanArgs,
    cfg: &kimi_core::ModelConfig,
    s: &ModelSummary,
    p: &Plan,
    rooflines: &[Roofline],
    out: &mut impl Write,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "model      {}: {}, {} layers, {} parameters ({} active per token)",
        a.model.display(),
        cfg.model_type,
        cfg.layers.len(),
        human(s.params.total),
        human(s.params.active)
    )?;
    writeln!(
        out,
        "weights    {}: routed experts {} ({} x {} per layer x {} layers), everything else {}",
        si(s.total_bytes()),
        si(s.routed_expert_bytes()),
        si(s.bytes_per_expert),
        s.num_experts,
        s.num_moe_layers,
        si(s.non_expert_bytes())
    )?;
    writeln!(
        out,
        "caches     {} for {} sequences x {} tokens ({} each: KDA state {} f32, windows {}, MLA {})",
        si(p.cache),
        a.batch,
        grouped(a.context),
        si(s.cache_bytes_per_seq(a.context)),
        si(s.kda_state_bytes_per_seq()),
        si(s.kda_conv_bytes_per_seq()),
        si(s.mla_cache_bytes_per_token() * a.context)
    )?;
    if a.context > cfg.max_position_embeddings as u64 {
        writeln!(
            out,
            "note       --context {} is longer than the model's {} tokens",
            a.context, cfg.max_position_embeddings
        )?;
    }
    let m = &p.machine;
    let gpus = if m.gpus > 0 {
        format!(
            "{} GPUs x {} ({} kept free each), ",
            m.gpus,
            gib(m.gpu_mem),
            gib(m.gpu_reserve)
        )
    } else {
        "no GPUs, ".to_string()
    };
    writeln!(
        out,
        "machine    {gpus}RAM {} ({} kept free), disk {}",
        gib(m.ram),
        gib(m.ram_reserve),
        gib(m.disk)
    )?;
    writeln!(out, "needed     {}", si(p.needed_bytes()))?;
    writeln!(out)?;
    writeln!(
        out,
        "placement  {:<9} {:>11}  {:>11}  {:>6}  holds",
        "tier", "usable", "used", "use"
    )?;
    for t in &p.tiers {
        let mut holds = Vec::new();
        if t.fixed > 0 {
            holds.push(format!("non-expert weights + caches {}", si(t.fixed)));
        }
        if t.experts > 0 {
            holds.push(format!(
                "{:.1} experts per layer ({} in all, {})",
                p.experts_per_layer(t.tier),
                grouped(t.experts),
                si(t.expert_bytes)
            ));
        }
        if holds.is_empty() {
            holds.push("nothing".into());
        }
        writeln!(
            out,
            "           {:<9} {:>11}  {:>11}  {:>5.1}%  {}",
            tier_label(t.tier),
            si(t.capacity),
            si(t.used()),
            percent(t.used(), t.capacity),
            holds.join(", ")
        )?;
    }
    writeln!(out, "fits       {}", verdict(p))?;
    if m.disk < s.total_bytes() {
        writeln!(
            out,
            "note       the checkpoint ({}) is larger than the disk ({}): it loads from other storage",
            si(s.total_bytes()),
            si(m.disk)
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "decode     tokens/s = batch / step time, a step = each link's bytes / its bandwidth, the \
         links used in sequence or overlapped\n           (ceilings: uniform routing; compute, \
         launches and inter-GPU traffic not counted)"
    )?;
    for r in rooflines {
        writeln!(
            out,
            "batch {:<4} {:.1} routed experts per layer read",
            r.batch, r.experts_touched_per_layer
        )?;
        for sc in &r.scenarios {
            let (serial, overlapped) = (sc.serial_seconds(), sc.overlapped_seconds());
            writeln!(
                out,
                "  {:<64} {:>8.1} tok/s in sequence, {:>8.1} overlapped",
                sc.description,
                sc.tokens_per_second(serial),
                sc.tokens_per_second(overlapped)
            )?;
            for l in &sc.links {
                writeln!(
                    out,
                    "    {:<16} {:>10} per step / {:>7.0} GB/s = {:>9.2} ms",
                    l.name,
                    si(l.bytes.round() as u64),
                    l.bandwidth / GB,
                    1e3 * l.seconds()
                )?;
            }
        }
    }
    let link = match a.measured {
        Some(_) => format!("{:.1} GB/s each (measured, below)", m.pcie_bw / GB),
        None => format!("{} GB/s each (5.0 x16, pinned)", a.pcie_bw),
    };
    writeln!(
        out,
        "bandwidths GPU {} GB/s each (H200 datasheet), PCIe {link}, host RAM {} GB/s (2 x 8 x \
         DDR5-4800 peak), disk {} GB/s (one NVMe); --gpu-bw, --pcie-bw, --ram-bw, --disk-bw, \
         --measured change them",
        a.gpu_bw, a.ram_bw, a.disk_bw
    )?;
    Ok(())
}

fn to_json(
    a: &PlanArgs,
    cfg: &kimi_core::ModelConfig,
    s: &ModelSummary,
    p: &Plan,
    rooflines: &[Roofline],
) -> serde_json::Value {
    let m = &p.machine;
    let tiers: Vec<_> = p
        .tiers
        .iter()
        .map(|t| {
            json!({"tier": t.tier.name(), "capacity_bytes": t.capacity, "fixed_bytes": t.fixed,
                   "experts": t.experts, "experts_per_layer": p.experts_per_layer(t.tier),
                   "expert_bytes": t.expert_bytes, "used_bytes": t.used()})
        })
        .collect();
    let rooflines: Vec<_> = rooflines
        .iter()
        .map(|r| {
            let scenarios: Vec<_> = r
                .scenarios
                .iter()
                .map(|sc| {
                    let links: Vec<_> = sc
                        .links
                        .iter()
                        .map(|l| json!({"link": l.name, "bytes": l.bytes,
                                        "bandwidth_bytes_per_s": l.bandwidth, "seconds": l.seconds()}))
                        .collect();
                    let (serial, overlapped) = (sc.serial_seconds(), sc.overlapped_seconds());
                    json!({"scenario": sc.name, "description": sc.description, "links": links,
                           "serial_seconds": serial, "overlapped_seconds": overlapped,
                           "tokens_per_s_serial": sc.tokens_per_second(serial),
                           "tokens_per_s_overlapped": sc.tokens_per_second(overlapped)})
                })
                .collect();
            json!({"batch": r.batch, "experts_touched_per_layer": r.experts_touched_per_layer,
                   "scenarios": scenarios})
        })
        .collect();
    json!({
        "model": a.model.display().to_string(), "model_type": cfg.model_type,
        "total_params": s.params.total, "active_params": s.params.active,
        "weight_bytes": s.total_bytes(), "routed_expert_bytes": s.routed_expert_bytes(),
        "non_expert_bytes": s.non_expert_bytes(), "bytes_per_expert": s.bytes_per_expert,
        "experts_per_layer": s.num_experts, "moe_layers": s.num_moe_layers,
        "machine": {"gpus": m.gpus, "gpu_mem_bytes": m.gpu_mem, "gpu_reserve_bytes": m.gpu_reserve,
                    "ram_bytes": m.ram, "ram_reserve_bytes": m.ram_reserve, "disk_bytes": m.disk,
                    "gpu_bw_gb_s": a.gpu_bw, "pcie_bw_gb_s": m.pcie_bw / GB, "ram_bw_gb_s": a.ram_bw,
                    "disk_bw_gb_s": a.disk_bw},
        "workload": {"batch": a.batch, "context": a.context},
        "cache_bytes": p.cache, "cache_bytes_per_sequence": s.cache_bytes_per_seq(a.context),
        "needed_bytes": p.needed_bytes(), "fits": p.fits(), "fits_in_gpus": p.fits_in_gpus(),
        "shortfall_bytes": p.shortfall_bytes(), "experts_unplaced": p.experts_unplaced,
        "tiers": tiers, "rooflines": rooflines,
    })
}
