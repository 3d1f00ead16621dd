//! `kimi-infer logits`: the reference-comparison entry point.

use kimi_model::ForwardOptions;
use kimi_ops::{Backend, KdaMode, MlaMode};

use crate::args::{KdaModeArg, LogitsArgs, MlaModeArg};

pub fn logits(a: LogitsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!a.ids.is_empty(), "--ids needs at least one token id");
    crate::load::with_backend!(a.model, |backend| logits_on(backend, a))
}

fn logits_on<B: Backend + 'static>(backend: B, a: LogitsArgs) -> anyhow::Result<()> {
    let mut loaded = crate::load::load(backend, &a.model, false)?;
    loaded.engine.options = ForwardOptions {
        kda_mode: match a.kda_mode {
            KdaModeArg::Auto => KdaMode::Auto,
            KdaModeArg::Recurrent => KdaMode::Recurrent,
            KdaModeArg::Chunked => KdaMode::Chunked,
        },
        mla_mode: match a.mla_mode {
            MlaModeArg::Auto => MlaMode::Auto,
            MlaModeArg::Expanded => MlaMode::Expanded,
            MlaModeArg::Absorbed => MlaMode::Absorbed,
        },
        ..ForwardOptions::default()
    };
    let step = a.step.unwrap_or(a.ids.len());
    anyhow::ensure!(step >= 1, "--step must be at least 1");
    let logits = loaded.engine.logits(&a.ids, step)?;
    let vocab = loaded.engine.model().vocab_size();
    crate::npy::write_f32(&a.out, &[a.ids.len(), vocab], &logits)?;
    eprintln!(
        "wrote {} x {vocab} logits to {}",
        a.ids.len(),
        a.out.display()
    );
    Ok(())
}
