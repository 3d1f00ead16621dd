//! Helpers shared by kimi-model's integration tests.

use kimi_cpu::CpuBackend;
use kimi_model::{Batch, CachePool, CausalLm, ForwardOptions, SeqCache};
use kimi_ops::Segment;

/// Logits of every position of `ids` from a fresh single-sequence cache, `step` tokens per
/// forward pass.
pub fn logits_in_steps(model: &dyn CausalLm<CpuBackend>, ids: &[u32], step: usize) -> Vec<f32> {
    let (mut pool, mut cache) = model.single_cache(ids.len()).unwrap();
    let mut out = Vec::new();
    for chunk in ids.chunks(step) {
        out.extend(pass(model, &mut pool, &mut cache, chunk));
    }
    out
}

/// One forward pass of `chunk` through the sequence `cache`: the logits of every position.
pub fn pass(
    model: &dyn CausalLm<CpuBackend>,
    pool: &mut CachePool<CpuBackend>,
    cache: &mut SeqCache,
    chunk: &[u32],
) -> Vec<f32> {
    let batch = Batch {
        tokens: chunk.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: chunk.len(),
        }],
        logits_rows: (0..chunk.len()).collect(),
        sampling: None,
    };
    model
        .forward(&batch, pool, &mut [cache], ForwardOptions::default())
        .unwrap()
        .logits
}

/// `‖got − want‖ / ‖want‖`.
#[allow(dead_code)]
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}
