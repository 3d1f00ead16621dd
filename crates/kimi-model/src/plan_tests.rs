#![allow(clippy::unwrap_used)]

use kimi_core::ModelConfig;

use super::*;
use crate::summary::tests::k3;

const GIB: u64 = 1 << 30;
const GB: f64 = 1e9;

/// The 8 × H200 node of spec §6, capacities as `kimi-infer plan` takes them by default
/// (GiB) and bandwidths as its defaults.
fn h200_node(gpus: u64) -> Machine {
    Machine {
        gpus,
        gpu_mem: 141 * GIB,
        gpu_reserve: 2 * GIB,
        ram: 560 * GIB,
        ram_reserve: 16 * GIB,
        disk: 235 * GIB,
        gpu_bw: 4800.0 * GB,
        pcie_bw: 55.0 * GB,
        ram_bw: 614.0 * GB,
        cpu_expert_bw: None,
        disk_bw: 7.0 * GB,
    }
}

const SERVE: Workload = Workload {
    batch: 64,
    context: 8192,
};

fn k3_plan(machine: &Machine) -> (ModelSummary, Plan) {
    let s = ModelSummary::new(&k3());
    let p = Plan::new(&s, machine, SERVE);
    (s, p)
}

/// The accounting closes: every expert is somewhere or counted missing, and each tier's
/// bytes stay within its capacity.
fn check_consistent(p: &Plan) {
    let placed: u64 = p.tiers.iter().map(|t| t.experts).sum();
    assert_eq!(placed + p.experts_unplaced, p.experts_total);
    for t in &p.tiers {
        assert!(
            t.expert_bytes <= t.capacity.saturating_sub(t.fixed),
            "{t:?}"
        );
    }
    // The first tier books all fixed bytes, even those it lacks room for.
    let used: u64 = p.tiers.iter().map(TierUse::used).sum();
    assert_eq!(
        used + p.experts_unplaced * p.bytes_per_expert,
        p.needed_bytes()
    );
}

#[test]
fn touched_experts_follow_the_uniform_routing_formula() {
    assert_eq!(experts_touched(896, 16, 0), 0.0);
    assert!((experts_touched(896, 16, 1) - 16.0).abs() < 1e-9);
    // performance-anchors §5.2: K3 touches about 120 experts at B = 8, 613 at 64, 887 at 256.
    assert_eq!(experts_touched(896, 16, 8).round(), 120.0);
    assert_eq!(experts_touched(896, 16, 64).round(), 613.0);
    assert_eq!(experts_touched(896, 16, 256).round(), 887.0);
    assert_eq!(experts_touched(256, 8, 64).round(), 222.0);
    assert!(experts_touched(896, 16, 100_000) <= 896.0);
    assert_eq!(experts_touched(0, 16, 64), 0.0);
}

/// Spec §6: on 8 × H200 the weights do not fit in HBM; HBM and host RAM hold them only when
/// nearly all of both is used; the local disk is not needed (and cannot hold the checkpoint).
#[test]
fn k3_on_eight_h200_needs_host_ram_nearly_full() {
    let (_, p) = k3_plan(&h200_node(8));
    check_consistent(&p);
    assert!(p.fits());
    assert!(!p.fits_in_gpus());
    let (gpu, ram) = (p.tier(Tier::Gpu).unwrap(), p.tier(Tier::Ram).unwrap());
    assert!(gpu.used() < p.needed_bytes() && gpu.experts > 0);
    assert!(ram.experts > 0);
    assert_eq!(p.tier(Tier::Disk).unwrap().experts, 0);
    let per_layer = p.experts_per_layer(Tier::Gpu);
    assert!((600.0..700.0).contains(&per_layer), "{per_layer}");
    assert_eq!(
        p.experts_per_layer(Tier::Gpu) + p.experts_per_layer(Tier::Ram),
        896.0
    );
    let used = (gpu.used() + ram.used()) as f64 / (gpu.capacity + ram.capacity) as f64;
    assert!(used > 0.85, "{used}");
    assert!(p.machine.disk < p.needed_bytes());
    // With the spec's decimal figures (8 × 141 GB, 560 GB) the use is nearer still.
    let mut decimal = h200_node(8);
    (decimal.gpu_mem, decimal.ram) = (141_000_000_000, 560_000_000_000);
    let (_, p) = k3_plan(&decimal);
    let (gpu, ram) = (p.tier(Tier::Gpu).unwrap(), p.tier(Tier::Ram).unwrap());
    assert!(p.fits() && !p.fits_in_gpus());
    let used = (gpu.used() + ram.used()) as f64 / (gpu.capacity + ram.capacity) as f64;
    assert!(used > 0.95, "{used}");
}

#[test]
fn k3_fits_sixteen_h200() {
    let (s, p) = k3_plan(&h200_node(16));
    check_consistent(&p);
    assert!(p.fits_in_gpus());
    assert_eq!(p.experts_per_layer(Tier::Gpu), 896.0);
    let r = p.roofline(&s, 1);
    assert_eq!(r.scenarios.len(), 1);
    assert_eq!(r.scenarios[0].links.len(), 1);
    // Batch 1 reads every non-expert weight and 16 experts per layer from HBM.
    let link = &r.scenarios[0].links[0];
    let weights =
        s.non_expert_read_bytes(1) + s.component(crate::Component::RoutedExperts).read_bytes;
    assert!(link.bytes > weights as f64 && link.bytes < weights as f64 + 2e9);
    assert_eq!(link.bandwidth, 16.0 * 4800.0 * GB);
}

/// Too little memory: the shortfall names the missing bytes.
#[test]
fn shortfalls_are_counted() {
    let mut small = h200_node(8);
    small.ram = 64 * GIB;
    let (_, p) = k3_plan(&small);
    check_consistent(&p);
    assert!(!p.fits());
    assert!(p.experts_unplaced > 0);
    assert!(p.tier(Tier::Disk).unwrap().experts > 0);
    let placed: u64 = p.tiers.iter().map(TierUse::used).sum();
    assert_eq!(p.shortfall_bytes(), p.needed_bytes() - placed);
    // GPUs too small for the non-expert weights and caches.
    let mut tiny = h200_node(1);
    tiny.gpu_mem = 80 * GIB;
    let (_, p) = k3_plan(&tiny);
    assert!(p.fixed_shortfall > 0 && !p.fits());
    assert_eq!(p.tier(Tier::Gpu).unwrap().experts, 0);
    assert_eq!(
        p.fixed_shortfall,
        p.weights + p.cache - p.tier(Tier::Gpu).unwrap().capacity
    );
}

/// Offloaded experts give two rooflines; each adds or overlaps its links; batch 64 reads
/// more bytes per step but fewer per token.
#[test]
fn k3_rooflines_on_eight_h200() {
    let (s, p) = k3_plan(&h200_node(8));
    let one = p.roofline(&s, 1);
    let many = p.roofline(&s, 64);
    assert_eq!(one.scenarios.len(), 2);
    for (a, b) in one.scenarios.iter().zip(&many.scenarios) {
        assert!(a.serial_seconds() >= a.overlapped_seconds());
        assert!(b.links[0].bytes > a.links[0].bytes);
        let per_token =
            |sc: &Scenario| sc.links.iter().map(|l| l.bytes).sum::<f64>() / sc.batch as f64;
        assert!(per_token(b) < per_token(a));
        assert!(b.tokens_per_second(b.serial_seconds()) > a.tokens_per_second(a.serial_seconds()));
    }
    // Host experts: 8 PCIe links of 55 GB/s (440 GB/s) for the GPU roofline, 614 GB/s for the CPU.
    let gpu = &one.scenarios[0];
    assert_eq!(gpu.links[1].bandwidth, 440.0 * GB);
    assert_eq!(one.scenarios[1].links[1].bandwidth, 614.0 * GB);
    // The host share of the 16 × 92 experts a token reads crosses the link.
    let host_share = p.tier(Tier::Ram).unwrap().experts as f64 / p.experts_total as f64;
    let expect = host_share * (16 * 92 * s.bytes_per_expert) as f64;
    assert!((gpu.links[1].bytes - expect).abs() < 1.0);
}

/// Kimi Linear on one H200 with bf16 weights and a 4,096-token context reads 6.33 GB per
/// step at batch 1 and about 92.6 GB at batch 64 (performance-anchors §5.3, which leaves out
/// the convolution windows).
#[test]
fn kimi_linear_roofline_matches_the_anchor_table() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json"
    );
    let cfg = ModelConfig::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let s = ModelSummary::new(&cfg);
    let work = Workload {
        batch: 64,
        context: 4096,
    };
    let p = Plan::new(&s, &h200_node(1), work);
    assert!(p.fits_in_gpus());
    let bytes = |b| p.roofline(&s, b).scenarios[0].links[0].bytes / GB;
    assert_eq!(format!("{:.2}", bytes(1)), "6.33");
    let b64 = bytes(64);
    assert!((b64 - 92.6).abs() / 92.6 < 0.003, "{b64}");
}

/// Without GPUs the CPU holds and reads everything; experts overflow to disk.
#[test]
fn cpu_only_machine() {
    let mut m = h200_node(0);
    m.ram = 1400 * GIB;
    let (s, p) = k3_plan(&m);
    check_consistent(&p);
    assert!(p.tier(Tier::Gpu).is_none());
    assert_eq!(p.tier(Tier::Ram).unwrap().fixed, p.weights + p.cache);
    assert!(p.fits() && p.tier(Tier::Disk).unwrap().experts > 0);
    let r = p.roofline(&s, 1);
    assert_eq!(r.scenarios.len(), 1);
    assert_eq!(r.scenarios[0].links.len(), 2);
}
