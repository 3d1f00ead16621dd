//! `quantize --method awq`: the channel scales of every scale group
//! ([`kimi_model::quantized::awq::scale_groups`]) searched and folded, then every matrix's
//! groups clipped, all on f32 copies of the tensors that change; the writer rounds the
//! results to nearest ([`super::quantize`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use anyhow::Context;
use kimi_model::quantized::awq::{self, Member, Prev};
use kimi_model::quantized::rtn::RtnOptions;
use kimi_weights::SafetensorsDir;
use serde_json::Value;

use super::calibrate::InputStats;

/// Matrices not clipped, by the start of their module's name: queries and keys (AutoAWQ's
/// rule: attention scores are sensitive to their rounding; MLA's `kv_*` hold keys too).
/// AutoAWQ matches anywhere in the path, which also skips Mixtral's `block_sparse_moe.*`.
const NO_CLIP: [&str; 6] = ["q_", "k_", "kv_", "query", "key", "Wqkv"];

fn may_clip(name: &str) -> bool {
    let module = name.trim_end_matches(".weight");
    let last = module.rsplit('.').next().unwrap_or(module);
    !NO_CLIP.iter().any(|p| last.starts_with(p))
}

/// The new f32 values of every tensor AWQ changed (scaled, folded, and clipped where `clip`),
/// by name.
pub fn apply(
    files: &SafetensorsDir,
    config: &Value,
    stats: &HashMap<String, Arc<InputStats>>,
    targets: &HashSet<String>,
    o: RtnOptions,
    clip: bool,
    round_scale: &(impl Fn(f32) -> f32 + Sync),
) -> anyhow::Result<HashMap<String, Vec<f32>>> {
    // Kimi K3's wrapper nests the text model's config.
    let text = config.get("text_config").unwrap_or(config);
    let hidden = text
        .get("hidden_size")
        .and_then(Value::as_u64)
        .context("config.json has no hidden_size")? as usize;
    // SiTU's up half passes through β₂·tanh(·/β₂): a scale cannot move from it to the down
    // projection.
    let up_is_linear = !(text.get("hidden_act").and_then(Value::as_str) == Some("situ")
        && text
            .get("activation_situ_linear_beta")
            .is_some_and(|b| !b.is_null()));
    let shapes: BTreeMap<String, Vec<usize>> = files
        .tensor_names()
        .into_iter()
        .filter_map(|n| files.shape(n).map(|s| (n.to_string(), s.to_vec())))
        .collect();
    let groups = awq::scale_groups(&shapes, targets, hidden, up_is_linear);
    let mut values: HashMap<String, Vec<f32>> = HashMap::new();
    let load = |name: &str, values: &mut HashMap<String, Vec<f32>>| -> anyhow::Result<()> {
        if !values.contains_key(name) {
            let view = files.get(name)?;
            values.insert(name.to_string(), view.to_f32_vec());
        }
        Ok(())
    };
    // H of each record (stacked matrices share one), made symmetric once.
    let mut hessians: HashMap<*const InputStats, Arc<Vec<f32>>> = HashMap::new();
    let mut hessian_of = |name: &str| -> Option<Arc<Vec<f32>>> {
        let s = stats.get(name)?;
        Some(
            hessians
                .entry(Arc::as_ptr(s))
                .or_insert_with(|| {
                    Arc::new(
                        s.hessian
                            .symmetric()
                            .into_iter()
                            .map(|v| v as f32)
                            .collect(),
                    )
                })
                .clone(),
        )
    };
    let mut scale_of: HashMap<String, Vec<f32>> = HashMap::new();
    let (mut searched, mut gain) = (0usize, 0f64);
    let bar = crate::progress::count_bar(groups.len() as u64, "awq scales");
    for g in &groups {
        if let Some(b) = &bar {
            b.inc(1);
        }
        // The mean |x| over every distinct record of the group.
        let mut seen = HashSet::new();
        let (mut abs, mut rows) = (Vec::new(), 0u64);
        for n in &g.linears {
            if let Some(s) = stats.get(n).filter(|s| seen.insert(Arc::as_ptr(s))) {
                abs.resize(s.abs_sum.len(), 0f64);
                abs.iter_mut().zip(&s.abs_sum).for_each(|(a, v)| *a += v);
                rows += s.hessian.rows;
            }
        }
        if rows == 0 {
            continue;
        }
        let k = abs.len();
        let x_mean: Vec<f32> = abs.iter().map(|a| (a / rows as f64) as f32).collect();
        for n in g.linears.iter().chain(&g.compensate) {
            load(n, &mut values)?;
        }
        let hs: Vec<Option<Arc<Vec<f32>>>> = g.linears.iter().map(|n| hessian_of(n)).collect();
        let members: Vec<Member<'_>> = g
            .linears
            .iter()
            .zip(&hs)
            .map(|(n, h)| {
                let v = &values[n];
                Member {
                    values: v,
                    rows: v.len() / k,
                    hessian: h.as_ref().map(|h| h.as_slice()),
                }
            })
            .collect();
        let choice = awq::search_scale(&members, k, &x_mean, o, round_scale);
        drop(members);
        searched += 1;
        if choice.error_before > 0.0 {
            gain += choice.error_after / choice.error_before;
        }
        tracing::debug!(group = ?g.prev, alpha = choice.alpha, before = choice.error_before, after = choice.error_after, "awq scale");
        let s = &choice.scales;
        for n in g.linears.iter().chain(&g.compensate) {
            let v = values.get_mut(n).context("loaded above")?;
            for row in v.chunks_exact_mut(k) {
                row.iter_mut().zip(s).for_each(|(w, s)| *w *= s);
            }
        }
        for n in &g.linears {
            scale_of.insert(n.clone(), s.clone());
        }
        match &g.prev {
            Prev::Norm(n) => {
                load(n, &mut values)?;
                let v = values.get_mut(n).context("loaded above")?;
                v.iter_mut().zip(s).for_each(|(w, s)| *w /= s);
            }
            Prev::Linear(n) => {
                load(n, &mut values)?;
                let v = values.get_mut(n).context("loaded above")?;
                let m = v.len() / k;
                for (row, s) in v.chunks_exact_mut(m).zip(s) {
                    row.iter_mut().for_each(|w| *w /= s);
                }
            }
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // Clipping, each matrix against its inputs as scaled: H' = S⁻¹ H S⁻¹.
    let mut clipped = 0usize;
    let mut names: Vec<&String> = targets.iter().collect();
    names.sort();
    let bar = crate::progress::count_bar(names.len() as u64, "awq clipping");
    for n in names {
        if let Some(b) = &bar {
            b.inc(1);
        }
        if !clip || !may_clip(n) {
            continue;
        }
        let Some(h) = hessian_of(n) else {
            continue;
        };
        load(n, &mut values)?;
        let k = (h.len() as f64).sqrt() as usize;
        let h: Vec<f32> = match scale_of.get(n) {
            Some(s) => h
                .iter()
                .enumerate()
                .map(|(idx, v)| v / (s[idx / k] * s[idx % k]))
                .collect(),
            None => h.to_vec(),
        };
        let v = values.get_mut(n).context("loaded above")?;
        let rows = v.len() / k;
        awq::clip(v, rows, k, &h, o, round_scale);
        clipped += 1;
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    eprintln!(
        "awq: {searched} scale groups (output error after scaling {:.1} % of plain rounding's on \
         average), {clipped} matrices clipped",
        100.0 * gain / searched.max(1) as f64
    );
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;
    use std::path::{Path, PathBuf};

    use kimi_model::{CheckpointSource, WeightSource};
    use kimi_weights::Checkpoint;

    /// A checkpoint's tensors with some replaced by f32 values.
    struct Overridden<'a> {
        base: CheckpointSource<'a>,
        values: &'a HashMap<String, Vec<f32>>,
    }

    impl WeightSource for Overridden<'_> {
        fn contains(&self, name: &str) -> bool {
            self.base.contains(name)
        }
        fn load(
            &self,
            name: &str,
            shape: &[usize],
        ) -> kimi_model::Result<(kimi_core::DType, Cow<'_, [u8]>)> {
            match self.values.get(name) {
                Some(v) => Ok((
                    kimi_core::DType::F32,
                    Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
                )),
                None => self.base.load(name, shape),
            }
        }
        fn check_all_used(&self, used: &HashSet<String>) -> kimi_model::Result<()> {
            self.base.check_all_used(used)
        }
    }

    fn repo(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(path)
    }

    /// AWQ's scales, folded without rounding or clipping, leave the model's function as it
    /// was: every norm, up projection and reader (the MoE router among them) got its share
    /// (f32 fixture: KDA, MLA, MoE with a shared expert).
    #[test]
    fn folded_scales_keep_the_logits() {
        let dir = tempfile::tempdir().unwrap();
        let fixture = repo("fixtures/kimi-linear/hub-f32-mla-first");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(f), dir.path().join(f)).unwrap();
        }
        let vocab: String = (0..=255u8)
            .map(|b| {
                const B64: &[u8; 64] =
                    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
                let (c0, c1) = (B64[(b >> 2) as usize], B64[((b & 3) << 4) as usize]);
                format!("{}{}== {b}\n", c0 as char, c1 as char)
            })
            .collect();
        std::fs::write(dir.path().join("tiktoken.model"), vocab).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let o = RtnOptions {
            bits: 4,
            group_size: Some(8),
            symmetric: false,
        };
        let targets: Vec<(String, usize)> = ckpt
            .tensor_names()
            .into_iter()
            .filter(|n| {
                n.ends_with("proj.weight") || n.contains(".experts.") && n.ends_with(".weight")
            })
            .filter_map(|n| {
                ckpt.shape(n)
                    .filter(|s| s.len() == 2)
                    .map(|s| (n.to_string(), s[1]))
            })
            .collect();
        let readme = repo("README.md");
        let stats = super::super::calibrate::calibrate(&super::super::calibrate::CalibrationPlan {
            model: dir.path(),
            text: &readme,
            ctx: 64,
            tokens: 512,
            targets: &targets,
            memory_bytes: 1 << 30,
        })
        .unwrap();
        let names: HashSet<String> = targets.iter().map(|(n, _)| n.clone()).collect();
        let folded = apply(&ckpt, ckpt.config_json(), &stats, &names, o, false, &|s| s).unwrap();
        assert!(
            folded
                .keys()
                .any(|n| n.ends_with("block_sparse_moe.gate.weight")),
            "the router was not compensated"
        );
        assert!(folded.keys().any(|n| n.ends_with("input_layernorm.weight")));
        let ids: Vec<u32> = b"Folded scales change nothing."
            .iter()
            .map(|&b| b as u32)
            .collect();
        let run = |source: &dyn WeightSource| {
            let backend = kimi_cpu::CpuBackend::with_quant_matmul(kimi_cpu::QuantMatmul::F32);
            let loaded =
                kimi_model::registry::load_config(backend, ckpt.config().clone(), source).unwrap();
            kimi_engine::Engine::new(loaded.model)
                .logits(&ids, ids.len())
                .unwrap()
        };
        let base = CheckpointSource::new(&ckpt).unwrap();
        let reference = run(&base);
        let scaled = run(&Overridden {
            base: CheckpointSource::new(&ckpt).unwrap(),
            values: &folded,
        });
        let num: f64 = reference
            .iter()
            .zip(&scaled)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = reference.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        // 5e-7 here; leaving the router uncompensated gives 0.3.
        assert!(rel < 1e-5, "relative logit change {rel}");
    }
}
