#![allow(clippy::unwrap_used)]

use std::path::Path;

use super::*;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn config(path: &str) -> ModelConfig {
    ModelConfig::from_json_str(&std::fs::read_to_string(repo(path)).unwrap()).unwrap()
}

/// The published Kimi K3 config, as committed for the CLI and the README.
pub(crate) fn k3() -> ModelConfig {
    config("configs/kimi-k3.config.json")
}

/// `x / scale` printed with `places` decimals, as the spec prints its figures.
fn shown(x: u64, scale: f64, places: usize) -> String {
    format!("{:.*}", places, x as f64 / scale)
}

/// The released checkpoint's table sums to 49,122,681,728 parameters (spec §0, [INV]); the
/// active count is the one this crate has always reported.
#[test]
fn released_48b_parameter_count() {
    let cfg = config("crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json");
    let s = ModelSummary::new(&cfg);
    assert_eq!(s.params.total, 49_122_681_728);
    assert_eq!(s.params.active, 3_484_459_904);
    assert_eq!(
        (s.num_kda_layers, s.num_mla_layers, s.num_moe_layers),
        (20, 7, 26)
    );
    assert_eq!(s.mla_cache_elems_per_token, 576 * 7);
    assert_eq!(s.kda_state_elems_per_seq * 4, 40 << 20);
    assert_eq!(
        s.params.per_layer.iter().sum::<u64>() + s.params.embedding_and_head,
        s.params.total
    );
    // bf16 everywhere but A_log [1,1,32,1] and dt_bias [4096], which are f32.
    assert_eq!(s.weight_dtype, DType::BF16);
    assert_eq!(s.total_bytes(), 2 * s.params.total + 2 * 20 * (32 + 4096));
    assert_eq!(s.a_log_padding, 0);
    assert_eq!(s.bytes_per_expert, 3 * 2304 * 1024 * 2);
}

/// Spec appendix: the recount of the published config, to the spec's printed precision, and
/// its per-component terms exactly.
#[test]
fn k3_published_config_matches_the_spec_recount() {
    let s = ModelSummary::new(&k3());
    let (h, v, p) = (7168u64, 163_840u64, 96 * 128u64);
    assert_eq!(
        (s.num_kda_layers, s.num_mla_layers, s.num_moe_layers),
        (69, 24, 92)
    );
    // The appendix counts the 96 A_log entries heads read; the checkpoint stores 128.
    let kda = 4 * p * h + h * p + 3 * p * 4 + 128 * h + p * 128 + 96 * h + p + 128 + 96;
    let mla = 1536 * h + 1536 + 96 * 192 * 1536 + 576 * h + 512 + 96 * 256 * 512 + 2 * h * p;
    let expert = 3 * 3584 * 3072;
    let want = [
        (Component::Embedding, v * h),
        (Component::Kda, 69 * (kda + 32)),
        (Component::Mla, 24 * mla),
        (Component::DenseFfn, 3 * h * 33792),
        (Component::Router, 92 * (896 * h + 896)),
        (Component::SharedExperts, 92 * 3 * h * 6144),
        (Component::Latent, 92 * (2 * 3584 * h + 3584)),
        (Component::RoutedExperts, 92 * 896 * expert),
        (Component::Norms, 93 * 2 * h + h),
        (Component::AttnRes, 93 * 4 * h + 2 * h),
        (Component::LmHead, v * h),
    ];
    for (c, n) in want {
        assert_eq!(s.component(c).params, n, "{c:?}");
    }
    assert_eq!(s.a_log_padding, 69 * 32);
    // Appendix: total 2,779,484,476,000 with 96 A_log entries per layer.
    assert_eq!(s.params.total, 2_779_484_476_000 + s.a_log_padding);
    assert_eq!(shown(s.params.total, 1e12, 4), "2.7795");
    assert_eq!(shown(s.params.active, 1e9, 2), "105.36");
    assert_eq!(shown(s.active_params_without_embedding(), 1e9, 2), "104.19");
    assert_eq!(s.params.per_layer.len(), 93);
    // Bytes: 17,547,264 per MXFP4 expert (spec §2.2), bf16 elsewhere, f32 vectors.
    assert_eq!(s.bytes_per_expert, 17_547_264);
    assert_eq!(s.routed_expert_bytes(), 92 * 896 * 17_547_264);
    assert_eq!(shown(s.routed_expert_bytes(), 1e12, 4), "1.4465");
    assert_eq!(shown(s.non_expert_bytes(), 1e12, 4), "0.1135");
    assert_eq!(shown(s.total_bytes(), 1e12, 4), "1.5599");
    let f32_values = 69 * (128 + p) + 92 * 896;
    let non_expert_params = s.params.total - 92 * 896 * expert;
    assert_eq!(s.non_expert_bytes(), 2 * non_expert_params + 2 * f32_values);
    assert_eq!(
        s.layer_bytes.iter().sum::<u64>()
            + s.component(Component::Embedding).bytes
            + s.component(Component::LmHead).bytes
            + 3 * h * 2,
        s.total_bytes()
    );
    // Decode reads 16 experts per MoE layer: 25.8 GB (spec §3.5).
    assert_eq!(
        s.component(Component::RoutedExperts).read_bytes,
        16 * 92 * 17_547_264
    );
    assert_eq!(
        shown(s.component(Component::RoutedExperts).read_bytes, 1e9, 1),
        "25.8"
    );
    // Caches (spec §3.9): 434 MB of f32 state, 15.3 MB of bf16 conv windows, 27,648 B/token.
    assert_eq!(s.kda_state_bytes_per_seq(), 69 * 96 * 128 * 128 * 4);
    assert_eq!(shown(s.kda_state_bytes_per_seq(), 1e6, 0), "434");
    assert_eq!(shown(s.kda_conv_bytes_per_seq(), 1e6, 1), "15.3");
    assert_eq!(s.mla_cache_bytes_per_token(), 27_648);
    assert_eq!(
        shown(s.mla_cache_bytes_per_token() * (1 << 20), 1e9, 0),
        "29"
    );
}

/// SiTU, the gate forms and the AttnRes vectors are the only differences to a plain
/// Kimi Linear count: the activation changes nothing.
#[test]
fn activation_does_not_change_counts() {
    let mut cfg = k3();
    let before = ModelSummary::new(&cfg);
    cfg.activation = kimi_core::config::Activation::Silu;
    assert_eq!(ModelSummary::new(&cfg), before);
}

/// The config alone predicts every byte the tiny checkpoints store (vision tensors aside):
/// the tensor list, the shapes and the dtypes of the arithmetic are the checkpoint's.
#[test]
fn bytes_from_config_equal_the_checkpoint_bytes() {
    for dir in [
        "fixtures/kimi-linear/hub-bf16-irregular",
        "fixtures/kimi-linear/hub-f32-sharded",
        "fixtures/kimi-k3/k3-tiny-5l-b2",
    ] {
        let ckpt = kimi_weights::Checkpoint::open(&repo(dir)).unwrap();
        let s = ModelSummary::new(ckpt.config());
        let (mut bytes, mut elems, mut packed) = (0u64, 0u64, 0u64);
        for name in ckpt.tensor_names() {
            if name.starts_with("vision_tower.") || name.starts_with("mm_projector.") {
                continue;
            }
            let view = ckpt.get(name).unwrap();
            bytes += view.bytes.len() as u64;
            if name.contains(".experts.") && view.dtype == DType::U8 {
                packed += view.bytes.len() as u64;
            } else {
                elems += view.shape.iter().product::<usize>() as u64;
            }
        }
        assert_eq!(s.total_bytes(), bytes, "{dir}");
        if packed > 0 {
            assert_eq!(s.routed_expert_bytes(), packed, "{dir}");
        }
        let routed = s.component(Component::RoutedExperts).params;
        let stored = if packed > 0 { elems + routed } else { elems };
        assert_eq!(s.params.total, stored, "{dir}");
    }
}
