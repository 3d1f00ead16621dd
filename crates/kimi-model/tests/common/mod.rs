//! Helpers shared by kimi-model's integration tests.

use kimi_cpu::CpuBackend;
use kimi_model::{Batch, CausalLm, ForwardOptions};
use kimi_ops::Segment;

/// Logits of every position of `ids` from a fresh single-sequence cache, `step` tokens per
/// forward pass.
pub fn logits_in_steps(model: &dyn CausalLm<CpuBackend>, ids: &[u32], step: usize) -> Vec<f32> {
    let (mut pool, mut cache) = model.single_cache(ids.len()).unwrap();
    let mut out = Vec::new();
    for chunk in ids.chunks(step) {
        let batch = Batch {
            tokens: chunk.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: chunk.len(),
            }],
            logits_rows: (0..chunk.len()).collect(),
            sampling: None,
        };
        let y = model
            .forward(
                &batch,
                &mut pool,
                &mut [&mut cache],
                ForwardOptions::default(),
            )
            .unwrap();
        out.extend(y.logits);
    }
    out
}
