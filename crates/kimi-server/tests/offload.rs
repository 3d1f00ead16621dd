//! A server whose model keeps its routed experts in host memory behind a forced tiny
//! cache of device slots: `/metrics` reports where the experts are and what the tiers did.

use crate::common;

use std::sync::Arc;

use common::*;
use kimi_cpu::CpuBackend;
use kimi_model::{ExpertOffload, KimiLinear, LoadOptions, OffloadAmount};
use kimi_ops::offload::{CachePolicy, HostBackend};
use kimi_weights::Checkpoint;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_the_expert_tiers() {
    let dir = demo_dir();
    let ckpt = Checkpoint::open(dir.path()).expect("demo checkpoint opens");
    let options = LoadOptions {
        offload: Some(ExpertOffload {
            host: OffloadAmount::Experts(usize::MAX),
            cache: OffloadAmount::Experts(1),
            policy: CachePolicy::default(),
            store: Arc::new(HostBackend::new(Arc::new(CpuBackend::new()))),
        }),
        ..LoadOptions::default()
    };
    let model = KimiLinear::load_checkpoint_with(CpuBackend::new(), &ckpt, &options)
        .expect("demo model loads with its experts in host memory");
    let layers = model.expert_placement().len() as f64;
    let experts = model.expert_placement()[0].1.host as f64;
    assert!(layers > 0.0 && experts > 1.0);
    let server = start_model(dir, model, server_config(), serving_config()).await;

    let before = get(server.addr, "/metrics").await.text();
    let host = metric(&before, "kimi:expert_offload_experts", "host");
    assert_eq!(host, Some(layers * experts), "{before}");
    assert_eq!(
        metric(&before, "kimi:expert_offload_experts", "cache_slot"),
        Some(layers),
        "{before}"
    );
    assert_eq!(
        metric(&before, "kimi:expert_offload_experts", "device"),
        Some(0.0)
    );
    assert_eq!(
        metric(&before, "kimi:expert_cache_hits_total", ""),
        Some(0.0)
    );

    let r = post(
        server.addr,
        "/v1/chat/completions",
        &chat("Hello there", 12),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let text = get(server.addr, "/metrics").await.text();
    let m = |name: &str| metric(&text, name, "").unwrap_or_else(|| panic!("{name}:\n{text}"));
    // One slot per layer in front of every expert: prefill and decode miss, fill, evict and
    // compute the rest on the host.
    assert!(m("kimi:expert_cache_fills_total") > 0.0, "{text}");
    assert!(m("kimi:expert_cache_evictions_total") > 0.0, "{text}");
    assert!(m("kimi:expert_cold_pairs_total") > 0.0, "{text}");
    assert!(m("kimi:expert_cache_bytes_moved_total") > 0.0, "{text}");
    let hit_ratio = m("kimi:expert_cache_hit_ratio");
    assert!((0.0..=1.0).contains(&hit_ratio), "{text}");
    let per_token = m("kimi:expert_bytes_moved_per_token");
    let tokens = m("kimi:engine_step_tokens_total");
    let moved = m("kimi:expert_cache_bytes_moved_total");
    assert!(
        (per_token - moved / tokens).abs() <= 1e-6 * per_token,
        "{text}"
    );
}
