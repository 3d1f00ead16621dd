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

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_engine::Engine;
use kimi_model::quantized::gptq::Hessian;
use kimi_model::WeightSource;
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

/// A name the model loads by to the stored one, where they differ.
type Rename = fn(&str) -> Option<String>;

/// What the tap knows: which stored key holds which checkpoint matrices, and the records of
/// the keys this pass wants.
#[derive(Default)]
struct Recorder {
    /// The stored name of a name the model loads by (llama models load by GGUF names).
    stored_name: Option<Rename>,
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
    let windows = windows(plan)?;
    let recorder = Arc::new(Recorder {
        stored_name: stored_name(plan.model)?,
        ..Recorder::default()
    });
    let backend = CpuBackend::with_quant_matmul(QuantMatmul::F32);
    let engine = kimi_ops::calibrate::with_tap(recorder.clone(), || load(backend, plan.model))?;

    let passes = passes(plan.targets, plan.memory_bytes);
    let bar = crate::progress::count_bar((passes.len() * windows.len()) as u64, "calibrating");
    let mut out = HashMap::new();
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
        out.extend(named(&recorder));
    }
    if let Some(b) = bar {
        b.finish_and_clear();
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
    load_over(backend, dir, &HashMap::new())
}

/// [`load`] with some matrices replaced by f32 values (by stored name).
fn load_over(
    backend: CpuBackend,
    dir: &Path,
    values: &HashMap<String, Vec<f32>>,
) -> anyhow::Result<Engine<CpuBackend>> {
    let (json, config_path) = kimi_model::llama_hf::read_config_json(dir)?;
    let loaded = if kimi_model::llama_hf::is_llama_config(&json) {
        let files = kimi_weights::SafetensorsDir::open(dir)?;
        let base = kimi_model::llama_hf::HfLlamaSource::new(&files, &json, &config_path)?;
        let source = Overlay {
            base: &base,
            values,
            stored: Some(kimi_model::llama_hf::hf_name),
        };
        let config = kimi_model::LlamaConfig::from_hf_json(&json, &config_path)?;
        let model = kimi_model::Llama::load_from(backend, config, &source)?;
        return Ok(Engine::new(model));
    } else {
        let ckpt = kimi_weights::Checkpoint::open(dir)?;
        let base = kimi_model::CheckpointSource::new(&ckpt)?;
        let source = Overlay {
            base: &base,
            values,
            stored: None,
        };
        kimi_model::registry::load_config(backend, ckpt.config().clone(), &source)?
    };
    Ok(Engine::new(loaded.model))
}

/// A weight source with some tensors replaced by f32 values, keyed by stored name
/// (`stored` maps the names the model asks for, where they differ).
struct Overlay<'a> {
    base: &'a dyn WeightSource,
    values: &'a HashMap<String, Vec<f32>>,
    stored: Option<Rename>,
}

impl Overlay<'_> {
    fn replaced(&self, name: &str) -> Option<&Vec<f32>> {
        match self.stored.and_then(|f| f(name)) {
            Some(stored) => self.values.get(&stored),
            None => self.values.get(name),
        }
    }
}

impl WeightSource for Overlay<'_> {
    fn contains(&self, name: &str) -> bool {
        self.base.contains(name)
    }
    fn load(&self, name: &str, shape: &[usize]) -> kimi_model::Result<(DType, Cow<'_, [u8]>)> {
        match self.replaced(name) {
            Some(v) if v.len() == shape.iter().product::<usize>() => {
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                // Still a read of the stored tensors (quantized parts count as used).
                self.base.load(name, shape)?;
                Ok((DType::F32, Cow::Owned(bytes)))
            }
            _ => self.base.load(name, shape),
        }
    }
    fn check_all_used(&self, used: &HashSet<String>) -> kimi_model::Result<()> {
        self.base.check_all_used(used)
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.base.shape(name)
    }
    fn names(&self) -> Vec<String> {
        self.base.names()
    }
}

/// GPTQ's sequential calibration: layer by layer, each calibrated on the outputs of the
/// layers before it as quantized (`quantize` turns one layer's statistics into its matrices'
/// rounded values, which replace the float ones from then on). Returns every layer's
/// statistics. The model is loaded again for each layer.
pub fn calibrate_sequential(
    plan: &CalibrationPlan<'_>,
    mut quantize: impl FnMut(
        &HashMap<String, Arc<InputStats>>,
    ) -> anyhow::Result<HashMap<String, Vec<f32>>>,
) -> anyhow::Result<HashMap<String, Arc<InputStats>>> {
    let windows = windows(plan)?;
    let mut layers: std::collections::BTreeMap<Option<usize>, Vec<String>> = Default::default();
    for (name, _) in plan.targets {
        layers.entry(layer_of(name)).or_default().push(name.clone());
    }
    let stored_name = stored_name(plan.model)?;
    let bar = crate::progress::count_bar((layers.len() * windows.len()) as u64, "calibrating");
    let mut replaced: HashMap<String, Vec<f32>> = HashMap::new();
    let mut all = HashMap::new();
    for (l, names) in layers.values().enumerate() {
        let recorder = Arc::new(Recorder {
            stored_name,
            ..Recorder::default()
        });
        *lock(&recorder.wanted) = names.iter().cloned().collect();
        let backend = CpuBackend::with_quant_matmul(QuantMatmul::F32);
        let engine = kimi_ops::calibrate::with_tap(recorder.clone(), || {
            load_over(backend, plan.model, &replaced)
        })?;
        for (i, w) in windows.iter().enumerate() {
            kimi_ops::calibrate::with_tap(recorder.clone(), || engine.logits(w, w.len()))
                .with_context(|| format!("calibration window {} (layer step {})", i + 1, l + 1))?;
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        let stats = named(&recorder);
        replaced.extend(quantize(&stats)?);
        all.extend(stats);
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    eprintln!(
        "calibrated layer by layer ({} steps) on {} windows of {} tokens of {}",
        layers.len(),
        windows.len(),
        plan.ctx,
        plan.text.display()
    );
    Ok(all)
}

/// The statistics a recorder gathered, by every stored name of each key.
fn named(recorder: &Recorder) -> HashMap<String, Arc<InputStats>> {
    let parts = lock(&recorder.parts);
    let mut out = HashMap::new();
    for (key, stats) in lock(&recorder.stats).drain() {
        let stats = Arc::new(stats);
        for name in parts.get(&key).into_iter().flatten() {
            out.insert(name.clone(), stats.clone());
        }
    }
    out
}

/// How a model at `dir` names the matrices it loads, where not by their stored names.
fn stored_name(dir: &Path) -> anyhow::Result<Option<Rename>> {
    let (json, _) = kimi_model::llama_hf::read_config_json(dir)?;
    Ok(kimi_model::llama_hf::is_llama_config(&json)
        .then_some(kimi_model::llama_hf::hf_name as Rename))
}

/// The calibration text's windows of token ids.
fn windows(plan: &CalibrationPlan<'_>) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(plan.text)
        .with_context(|| format!("reading --calibration-text {}", plan.text.display()))?;
    let tokenizer = Tokenizer::from_dir(plan.model)
        .with_context(|| format!("cannot load the tokenizer in {}", plan.model.display()))?;
    let ids = tokenizer
        .encode(&text, false)
        .with_context(|| format!("tokenizing {}", plan.text.display()))?;
    let windows: Vec<Vec<u32>> = ids
        .chunks_exact(plan.ctx)
        .take(plan.tokens / plan.ctx)
        .map(<[u32]>::to_vec)
        .collect();
    anyhow::ensure!(
        !windows.is_empty(),
        "{} tokenizes to {} tokens, less than one window of --calibration-ctx {}",
        plan.text.display(),
        ids.len(),
        plan.ctx
    );
    Ok(windows)
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
