//! Calibration for `quantize --method gptq|awq`: the model runs in f32 on the CPU over
//! windows of a calibration text with a tap installed ([`kimi_ops::calibrate`]), and every
//! matrix to be quantized gets the statistics of the inputs it multiplied: `H = Σ xᵀx`
//! (GPTQ's Hessian, also AWQ's loss) and `Σ |x|` per input channel (AWQ's activation
//! scale). Matrices stacked into one product (Q/K/V) share one record; each routed expert
//! sees only the tokens routed to it.
//!
//! The inputs are those of the float model (every layer's statistics from one forward pass),
//! not of a model whose earlier layers are already quantized. Hessians take `k² · 4` bytes
//! each; when all of them would not fit `--calibration-memory-gb`, the layers are split
//! into passes over the text, each recording a share of them.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_engine::Engine;
use kimi_model::quantized::gptq::Hessian;
use kimi_ops::calibrate::InputTap;
use kimi_tokenizer::Tokenizer;

/// The inputs one matrix (or one stack of matrices) multiplied.
pub struct InputStats {
    /// `Σ xᵀx`.
    pub hessian: Hessian,
    /// `Σ |x|` per input channel.
    pub abs_sum: Vec<f64>,
}

impl InputStats {
    fn new(k: usize) -> Self {
        Self {
            hessian: Hessian::new(k),
            abs_sum: vec![0.0; k],
        }
    }

    fn add(&mut self, x: &[f32], n: usize) {
        let k = self.abs_sum.len();
        for row in x.chunks_exact(k).take(n) {
            for (s, &v) in self.abs_sum.iter_mut().zip(row) {
                *s += v.abs() as f64;
            }
        }
        self.hessian.add(x, n);
    }
}

/// What the tap knows: which stored key holds which checkpoint matrices, and the records of
/// the keys this pass wants.
#[derive(Default)]
struct Recorder {
    /// The stored name of a name the model loads by (llama models load by GGUF names).
    stored_name: Option<fn(&str) -> Option<String>>,
    parts: Mutex<HashMap<usize, Vec<String>>>,
    /// Names recorded in this pass.
    wanted: Mutex<HashSet<String>>,
    stats: Mutex<HashMap<usize, InputStats>>,
}

impl InputTap for Recorder {
    fn weight(&self, key: usize, parts: &[(String, usize)]) {
        let names = parts
            .iter()
            .map(|(n, _)| {
                self.stored_name
                    .and_then(|f| f(n))
                    .unwrap_or_else(|| n.clone())
            })
            .collect();
        lock(&self.parts).insert(key, names);
    }

    fn input(&self, key: usize, x: &[f32], n: usize, k: usize) {
        let wanted = {
            let parts = lock(&self.parts);
            let wanted = lock(&self.wanted);
            parts
                .get(&key)
                .is_some_and(|names| names.iter().any(|p| wanted.contains(p)))
        };
        if wanted {
            lock(&self.stats)
                .entry(key)
                .or_insert_with(|| InputStats::new(k))
                .add(x, n);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How calibration runs.
pub struct CalibrationPlan<'a> {
    /// The model directory (a Kimi or llama checkpoint with float weights).
    pub model: &'a Path,
    /// The calibration text.
    pub text: &'a Path,
    /// Tokens per window.
    pub ctx: usize,
    /// Tokens in all.
    pub tokens: usize,
    /// The matrices to record, with their input widths.
    pub targets: &'a [(String, usize)],
    /// Bytes of Hessians one pass may hold.
    pub memory_bytes: u64,
}

/// Runs the calibration; returns the statistics of every target the model multiplied
/// (targets it never multiplied, such as weights an op reads other than by a product, are
/// absent).
pub fn calibrate(plan: &CalibrationPlan<'_>) -> anyhow::Result<HashMap<String, Arc<InputStats>>> {
    let text = std::fs::read_to_string(plan.text)
        .with_context(|| format!("reading --calibration-text {}", plan.text.display()))?;
    let tokenizer = Tokenizer::from_dir(plan.model)
        .with_context(|| format!("cannot load the tokenizer in {}", plan.model.display()))?;
    let ids = tokenizer
        .encode(&text, false)
        .with_context(|| format!("tokenizing {}", plan.text.display()))?;
    let windows: Vec<&[u32]> = ids
        .chunks_exact(plan.ctx)
        .take(plan.tokens / plan.ctx)
        .collect();
    anyhow::ensure!(
        !windows.is_empty(),
        "{} tokenizes to {} tokens, less than one window of --calibration-ctx {}",
        plan.text.display(),
        ids.len(),
        plan.ctx
    );

    let (json, _) = kimi_model::llama_hf::read_config_json(plan.model)?;
    let recorder = Arc::new(Recorder {
        stored_name: kimi_model::llama_hf::is_llama_config(&json)
            .then_some(kimi_model::llama_hf::hf_name as fn(&str) -> Option<String>),
        ..Recorder::default()
    });
    let backend = CpuBackend::with_quant_matmul(QuantMatmul::F32);
    let engine = kimi_ops::calibrate::with_tap(recorder.clone(), || load(backend, plan.model))?;

    let passes = passes(plan.targets, plan.memory_bytes);
    let bar = crate::progress::count_bar((passes.len() * windows.len()) as u64, "calibrating");
    let mut by_key: HashMap<usize, Arc<InputStats>> = HashMap::new();
    for (p, names) in passes.iter().enumerate() {
        *lock(&recorder.wanted) = names.iter().cloned().collect();
        for (i, w) in windows.iter().enumerate() {
            kimi_ops::calibrate::with_tap(recorder.clone(), || engine.logits(w, w.len()))
                .with_context(|| format!("calibration window {} (pass {})", i + 1, p + 1))?;
            match &bar {
                Some(b) => b.inc(1),
                None => tracing::debug!(pass = p + 1, window = i + 1, "calibrated"),
            }
        }
        for (key, stats) in lock(&recorder.stats).drain() {
            by_key.insert(key, Arc::new(stats));
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let parts = lock(&recorder.parts);
    let mut out = HashMap::new();
    for (key, stats) in by_key {
        for name in parts.get(&key).into_iter().flatten() {
            out.insert(name.clone(), stats.clone());
        }
    }
    eprintln!(
        "calibrated on {} windows of {} tokens of {} ({} pass{})",
        windows.len(),
        plan.ctx,
        plan.text.display(),
        passes.len(),
        if passes.len() == 1 { "" } else { "es" }
    );
    Ok(out)
}

/// Loads the checkpoint on the CPU (a llama checkpoint or a Kimi one).
fn load(backend: CpuBackend, dir: &Path) -> anyhow::Result<Engine<CpuBackend>> {
    let (json, config_path) = kimi_model::llama_hf::read_config_json(dir)?;
    let loaded = if kimi_model::llama_hf::is_llama_config(&json) {
        let files = kimi_weights::SafetensorsDir::open(dir)?;
        kimi_model::registry::load_llama_checkpoint(backend, &files, &json, &config_path)?
    } else {
        let ckpt = kimi_weights::Checkpoint::open(dir)?;
        kimi_model::registry::load_checkpoint(backend, &ckpt)?
    };
    Ok(Engine::new(loaded.model))
}

/// The targets split into passes whose Hessians fit `budget` bytes, whole layers at a time
/// (names outside `model.layers.N.` go with the first pass).
fn passes(targets: &[(String, usize)], budget: u64) -> Vec<Vec<String>> {
    let mut by_layer: std::collections::BTreeMap<usize, (u64, Vec<String>)> = Default::default();
    for (name, k) in targets {
        let layer = layer_of(name).unwrap_or(0);
        let e = by_layer.entry(layer).or_default();
        e.0 += (*k as u64).pow(2) * 4;
        e.1.push(name.clone());
    }
    let mut passes: Vec<(u64, Vec<String>)> = Vec::new();
    for (_, (bytes, names)) in by_layer {
        match passes.last_mut() {
            Some((b, n)) if *b + bytes <= budget => {
                *b += bytes;
                n.extend(names);
            }
            _ => passes.push((bytes, names)),
        }
    }
    passes.into_iter().map(|(_, n)| n).collect()
}

/// `N` of a name under `…layers.N.`.
pub fn layer_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once("layers.")?;
    rest.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_keep_layers_whole_within_the_budget() {
        let t = |n: &str, k: usize| (n.to_string(), k);
        let targets = [
            t("model.layers.0.a.weight", 10),
            t("model.layers.0.b.weight", 10),
            t("model.layers.1.a.weight", 10),
            t("model.layers.2.a.weight", 20),
        ];
        // 400 + 400 | 400 | 1600 bytes.
        let p = passes(&targets, 1000);
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].len(), 2);
        assert_eq!(passes(&targets, 1 << 20).len(), 1);
        assert_eq!(layer_of("language_model.model.layers.12.mlp.w"), Some(12));
    }
}
