//! AWQ (Lin et al., 2023), as AutoAWQ runs it: before rounding, the input channels of the
//! matrices that read one activation are scaled up by `s` (and the activation down by
//! `1/s`, folded into the norm or matrix that produces it), so that the channels that
//! carry large activations lose less to rounding; then each group's range is clipped where
//! that lowers the output error. Both searches use the inputs' statistics from calibration:
//! `s = x̄^α / w̄^(1−α)` (AutoAWQ's "duo" scaling: `x̄` the mean `|x|` per channel, `w̄` the
//! mean group-normalised `|w|`), normalised by `√(max·min)`, for the `α` of `0, 0.05, …,
//! 0.95` whose rounded matrices change the outputs least; clipping tries `max|w| · (1,
//! 0.95, …, 0.55)` per row and group. The output error of a change `δ` of a row is
//! `δ H δᵀ` with `H = Σ xᵀx`, which is the sum over every calibration token without keeping
//! them.

use std::collections::{BTreeMap, HashSet};

use rayon::prelude::*;

use super::rtn::{GroupParams, RtnOptions};

/// What produces the activation a [`ScaleGroup`]'s matrices read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prev {
    /// An RMSNorm's weight `[k]`: divided by `s`.
    Norm(String),
    /// A matrix `[k, m]` whose output (with nothing but an element-wise product by another
    /// matrix's output after it) is the activation: its rows divided by `s`.
    Linear(String),
}

/// Matrices that read one activation of width `k`, scaled together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScaleGroup {
    /// Its producer.
    pub prev: Prev,
    /// The matrices to quantize (`[_, k]`): columns multiplied by `s`.
    pub linears: Vec<String>,
    /// Other readers kept in float (MoE routers): columns multiplied by `s` too, so that
    /// they compute what they did.
    pub compensate: Vec<String>,
}

/// The scale groups of a llama, Kimi Linear or Kimi K3 checkpoint in the hub layout (K3's
/// under `language_model.`), from its 2-D tensors' shapes: per layer, the input norm's
/// readers (every `self_attn.*` matrix of width `hidden` except `o_proj`), the
/// post-attention norm's readers (every `mlp.*` or `block_sparse_moe.*` matrix of width
/// `hidden` except the down projections, the router compensated; K3's latent
/// down-projection is one), MLA's `q_a_layernorm` before `q_b_proj` and `kv_a_layernorm`
/// before `kv_b_proj` (as AutoAWQ's DeepSeek-V2 model), LatentMoE's latent norm before its
/// up-projection, and, where `up_is_linear` (SwiGLU; not K3's SiTU, whose up half passes
/// through `β₂·tanh(·/β₂)`), each gated MLP's up projection before its down projection.
/// Matrices reached by no group (output projections, KDA's gates) are only clipped.
/// K3's AttnRes mixes feed the input norms, which still take the scales.
pub fn scale_groups(
    shapes: &BTreeMap<String, Vec<usize>>,
    targets: &HashSet<String>,
    hidden: usize,
    up_is_linear: bool,
) -> Vec<ScaleGroup> {
    let layers: std::collections::BTreeSet<String> = shapes
        .keys()
        .filter_map(|n| {
            let (pre, rest) = match n.strip_prefix("language_model.") {
                Some(rest) => ("language_model.", rest),
                None => ("", n.as_str()),
            };
            let rest = rest.strip_prefix("model.layers.")?;
            let (i, _) = rest.split_once('.')?;
            Some(format!("{pre}model.layers.{i}."))
        })
        .collect();
    let reads_hidden = |name: &str| {
        shapes
            .get(name)
            .is_some_and(|s| s.len() == 2 && s[1] == hidden && name.ends_with(".weight"))
    };
    // LatentMoE's `routed_expert_down_proj` reads the hidden state: a reader, not a down
    // projection.
    let is_down = |name: &str| {
        name.ends_with(".w2.weight")
            || (name.ends_with("down_proj.weight") && !name.contains("routed_expert_down_proj"))
    };
    let mut groups = Vec::new();
    for p in &layers {
        let readers = |prefixes: &[&str], skip: &dyn Fn(&str) -> bool| {
            let (mut linears, mut compensate) = (Vec::new(), Vec::new());
            for (name, _) in shapes.range(p.clone()..) {
                if !name.starts_with(p.as_str()) {
                    break;
                }
                let rest = &name[p.len()..];
                if !prefixes.iter().any(|q| rest.starts_with(q))
                    || !reads_hidden(name)
                    || skip(name)
                {
                    continue;
                }
                match targets.contains(name) {
                    true => linears.push(name.clone()),
                    false => compensate.push(name.clone()),
                }
            }
            (linears, compensate)
        };
        let norm = format!("{p}input_layernorm.weight");
        let (linears, compensate) =
            readers(&["self_attn."], &|n: &str| n.ends_with("o_proj.weight"));
        if shapes.contains_key(&norm) && !linears.is_empty() {
            groups.push(ScaleGroup {
                prev: Prev::Norm(norm),
                linears,
                compensate,
            });
        }
        let norm = format!("{p}post_attention_layernorm.weight");
        let (linears, compensate) = readers(&["mlp.", "block_sparse_moe."], &is_down);
        if shapes.contains_key(&norm) && !linears.is_empty() {
            groups.push(ScaleGroup {
                prev: Prev::Norm(norm),
                linears,
                compensate,
            });
        }
        // A norm before the one matrix that reads it (MLA's low-rank halves, LatentMoE).
        for (norm, reader) in [
            (
                "self_attn.q_a_layernorm.weight",
                "self_attn.q_b_proj.weight",
            ),
            (
                "self_attn.kv_a_layernorm.weight",
                "self_attn.kv_b_proj.weight",
            ),
            (
                "block_sparse_moe.routed_expert_norm.weight",
                "block_sparse_moe.routed_expert_up_proj.weight",
            ),
        ] {
            let (norm, reader) = (format!("{p}{norm}"), format!("{p}{reader}"));
            if shapes.contains_key(&norm) && targets.contains(&reader) {
                groups.push(ScaleGroup {
                    prev: Prev::Norm(norm),
                    linears: vec![reader],
                    compensate: Vec::new(),
                });
            }
        }
        if !up_is_linear {
            continue;
        }
        for (up, down) in [
            ("mlp.up_proj.weight", "mlp.down_proj.weight"),
            (
                "block_sparse_moe.shared_experts.up_proj.weight",
                "block_sparse_moe.shared_experts.down_proj.weight",
            ),
            (
                "mlp.shared_experts.up_proj.weight",
                "mlp.shared_experts.down_proj.weight",
            ),
        ] {
            let (up, down) = (format!("{p}{up}"), format!("{p}{down}"));
            if shapes.contains_key(&up) && targets.contains(&down) {
                groups.push(ScaleGroup {
                    prev: Prev::Linear(up),
                    linears: vec![down],
                    compensate: Vec::new(),
                });
            }
        }
        for (name, _) in shapes.range(format!("{p}block_sparse_moe.experts.")..) {
            let Some(expert) = name
                .strip_prefix(&format!("{p}block_sparse_moe.experts."))
                .and_then(|r| r.strip_suffix(".w3.weight"))
            else {
                if !name.starts_with(&format!("{p}block_sparse_moe.experts.")) {
                    break;
                }
                continue;
            };
            let down = format!("{p}block_sparse_moe.experts.{expert}.w2.weight");
            if targets.contains(&down) {
                groups.push(ScaleGroup {
                    prev: Prev::Linear(name.clone()),
                    linears: vec![down],
                    compensate: Vec::new(),
                });
            }
        }
    }
    groups
}

/// One matrix of a scale search: its values `[rows, k]` and its inputs' `H` (`[k, k]`,
/// symmetric, f32), if calibration saw it multiply anything.
pub struct Member<'a> {
    /// Row-major values.
    pub values: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// `Σ xᵀx` of its inputs.
    pub hessian: Option<&'a [f32]>,
}

/// The result of [`search_scale`].
#[derive(Clone, Debug)]
pub struct ScaleChoice {
    /// The scale per input channel.
    pub scales: Vec<f32>,
    /// The chosen `α`.
    pub alpha: f32,
    /// Output error at `α = 0` (no scaling) and at the choice.
    pub error_before: f64,
    /// Output error at the chosen `α`.
    pub error_after: f64,
}

/// Grid points of `α`.
const SCALE_GRID: usize = 20;

/// Searches the channel scales of one group (see the module's description); `x_mean` is
/// the mean `|x|` per channel.
pub fn search_scale(
    members: &[Member<'_>],
    k: usize,
    x_mean: &[f32],
    o: RtnOptions,
    round_scale: &(impl Fn(f32) -> f32 + Sync),
) -> ScaleChoice {
    let group = k / o.groups(k).unwrap_or(1);
    // w̄: |w| over its group's max, averaged over every row of every member.
    let mut w_mean = vec![0f64; k];
    let mut rows = 0usize;
    for m in members {
        for row in m.values.chunks_exact(k).take(m.rows) {
            for (g, part) in row.chunks(group).enumerate() {
                let max = part.iter().fold(0f32, |a, v| a.max(v.abs())) + 1e-6;
                for (c, v) in part.iter().enumerate() {
                    w_mean[g * group + c] += (v.abs() / max) as f64;
                }
            }
        }
        rows += m.rows;
    }
    let w_mean: Vec<f32> = w_mean
        .iter()
        .map(|v| (v / rows.max(1) as f64) as f32)
        .collect();
    let mut best: Option<ScaleChoice> = None;
    let mut before = 0.0;
    for i in 0..SCALE_GRID {
        let alpha = i as f32 / SCALE_GRID as f32;
        let mut s: Vec<f32> = x_mean
            .iter()
            .zip(&w_mean)
            .map(|(&x, &w)| (x.powf(alpha) / (w.powf(1.0 - alpha) + 1e-4)).max(1e-4))
            .collect();
        let (lo, hi) = s
            .iter()
            .fold((f32::INFINITY, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
        let norm = (lo * hi).sqrt();
        if norm.is_finite() && norm > 0.0 {
            s.iter_mut().for_each(|v| *v /= norm);
        }
        let error: f64 = members
            .iter()
            .filter_map(|m| m.hessian.map(|h| (m, h)))
            .map(|(m, h)| scaled_rounding_error(m.values, m.rows, k, &s, h, o, round_scale))
            .sum();
        if i == 0 {
            before = error;
        }
        if best.as_ref().is_none_or(|b| error < b.error_after) {
            best = Some(ScaleChoice {
                scales: s,
                alpha,
                error_before: before,
                error_after: error,
            });
        }
    }
    let mut best = best.unwrap_or(ScaleChoice {
        scales: vec![1.0; k],
        alpha: 0.0,
        error_before: 0.0,
        error_after: 0.0,
    });
    best.error_before = before;
    best
}

/// `Σ_r δ_r H δ_rᵀ` for `δ = RTN(W·diag s)·diag(1/s) − W`.
fn scaled_rounding_error(
    w: &[f32],
    rows: usize,
    k: usize,
    s: &[f32],
    h: &[f32],
    o: RtnOptions,
    round_scale: &(impl Fn(f32) -> f32 + Sync),
) -> f64 {
    let group = k / o.groups(k).unwrap_or(1);
    (0..rows)
        .into_par_iter()
        .map(|r| {
            let row = &w[r * k..(r + 1) * k];
            let scaled: Vec<f32> = row.iter().zip(s).map(|(v, s)| v * s).collect();
            let mut delta = vec![0f32; k];
            for (g, part) in scaled.chunks(group).enumerate() {
                let p = GroupParams::of(part, o, round_scale);
                for (c, &v) in part.iter().enumerate() {
                    let j = g * group + c;
                    delta[j] = p.value(p.code(v, o)) / s[j] - row[j];
                }
            }
            quad(&delta, h, k)
        })
        .sum()
}

/// `δ H δᵀ` for one row (`H` symmetric `[k, k]`).
fn quad(delta: &[f32], h: &[f32], k: usize) -> f64 {
    let mut total = 0f64;
    for (i, &di) in delta.iter().enumerate() {
        if di != 0.0 {
            total += di as f64 * dot(&h[i * k..(i + 1) * k], delta) as f64;
        }
    }
    total
}

/// A dot product in eight lanes (so that it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Clip ratios tried per group.
const CLIP_GRID: usize = 10;

/// Clips each row's groups of `w` `[rows, k]` in place to `±max|w| · r` for the ratio `r`
/// of `1, 0.95, …, 0.55` whose rounding changes the group's share of the outputs least (the
/// group's diagonal block of `h`). Returns the mean ratio chosen.
pub fn clip(
    w: &mut [f32],
    rows: usize,
    k: usize,
    h: &[f32],
    o: RtnOptions,
    round_scale: &(impl Fn(f32) -> f32 + Sync),
) -> f32 {
    let group = k / o.groups(k).unwrap_or(1);
    let ratios: f64 = w
        .par_chunks_mut(k)
        .take(rows)
        .map(|row| {
            let mut chosen = 0f64;
            let mut clamped = vec![0f32; group];
            let mut delta = vec![0f32; group];
            for (g, part) in row.chunks_mut(group).enumerate() {
                let max = part.iter().fold(0f32, |a, v| a.max(v.abs()));
                let block = |i: usize, j: usize| h[(g * group + i) * k + g * group + j];
                let mut best = (f64::INFINITY, 1f32);
                for step in 0..CLIP_GRID {
                    let ratio = 1.0 - step as f32 / (2 * CLIP_GRID) as f32;
                    let m = max * ratio;
                    for (c, &v) in clamped.iter_mut().zip(part.iter()) {
                        *c = v.clamp(-m, m);
                    }
                    let p = GroupParams::of(&clamped, o, round_scale);
                    for ((d, &c), &v) in delta.iter_mut().zip(&clamped).zip(part.iter()) {
                        *d = p.value(p.code(c, o)) - v;
                    }
                    let mut e = 0f64;
                    for i in 0..group {
                        if delta[i] != 0.0 {
                            let hd: f32 = (0..group).map(|j| block(i, j) * delta[j]).sum();
                            e += (delta[i] * hd) as f64;
                        }
                    }
                    if e < best.0 {
                        best = (e, ratio);
                    }
                }
                let m = max * best.1;
                part.iter_mut().for_each(|v| *v = v.clamp(-m, m));
                chosen += best.1 as f64;
            }
            chosen / (k / group) as f64
        })
        .sum();
    (ratios / rows.max(1) as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_of_a_llama_layer_and_a_kimi_moe_layer() {
        let mut shapes = BTreeMap::new();
        let h = 8;
        for (n, s) in [
            ("model.layers.0.input_layernorm.weight", vec![h]),
            ("model.layers.0.self_attn.q_proj.weight", vec![8, h]),
            ("model.layers.0.self_attn.k_proj.weight", vec![4, h]),
            ("model.layers.0.self_attn.o_proj.weight", vec![h, 8]),
            ("model.layers.0.post_attention_layernorm.weight", vec![h]),
            ("model.layers.0.mlp.gate_proj.weight", vec![16, h]),
            ("model.layers.0.mlp.up_proj.weight", vec![16, h]),
            ("model.layers.0.mlp.down_proj.weight", vec![h, 16]),
            ("model.layers.1.post_attention_layernorm.weight", vec![h]),
            ("model.layers.1.block_sparse_moe.gate.weight", vec![4, h]),
            (
                "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                vec![16, h],
            ),
            (
                "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                vec![h, 16],
            ),
            (
                "model.layers.1.block_sparse_moe.experts.0.w3.weight",
                vec![16, h],
            ),
        ] {
            shapes.insert(n.to_string(), s);
        }
        let targets: HashSet<String> = shapes
            .iter()
            .filter(|(n, s)| s.len() == 2 && !n.contains(".gate.weight"))
            .map(|(n, _)| n.clone())
            .collect();
        let g = scale_groups(&shapes, &targets, h, true);
        let names = |g: &ScaleGroup| {
            g.linears
                .iter()
                .map(|n| n.rsplit_once("layers.").unwrap().1.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(g.len(), 5, "{g:#?}");
        assert_eq!(
            names(&g[0]),
            ["0.self_attn.k_proj.weight", "0.self_attn.q_proj.weight"]
        );
        assert_eq!(
            names(&g[1]),
            ["0.mlp.gate_proj.weight", "0.mlp.up_proj.weight"]
        );
        assert_eq!(
            g[2].prev,
            Prev::Linear("model.layers.0.mlp.up_proj.weight".into())
        );
        assert_eq!(
            names(&g[3]),
            [
                "1.block_sparse_moe.experts.0.w1.weight",
                "1.block_sparse_moe.experts.0.w3.weight"
            ]
        );
        assert_eq!(
            g[3].compensate,
            ["model.layers.1.block_sparse_moe.gate.weight"]
        );
        assert_eq!(names(&g[4]), ["1.block_sparse_moe.experts.0.w2.weight"]);
    }

    /// With one input channel much louder than the others, the search picks a scale that
    /// lowers the output error below plain rounding's.
    #[test]
    fn scaling_helps_where_one_channel_is_loud() {
        let (rows, k, n) = (16, 64, 128);
        let mut seed = 5u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let w: Vec<f32> = (0..rows * k).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..n * k)
            .map(|i| if i % k < 4 { 20.0 * rnd() } else { rnd() })
            .collect();
        let mut h = vec![0f32; k * k];
        let mut x_mean = vec![0f32; k];
        for t in 0..n {
            for i in 0..k {
                x_mean[i] += x[t * k + i].abs() / n as f32;
                for j in 0..k {
                    h[i * k + j] += x[t * k + i] * x[t * k + j];
                }
            }
        }
        let o = RtnOptions {
            bits: 4,
            group_size: Some(32),
            symmetric: false,
        };
        let m = [Member {
            values: &w,
            rows,
            hessian: Some(&h),
        }];
        let c = search_scale(&m, k, &x_mean, o, &|s| s);
        assert!(
            c.alpha > 0.0 && c.error_after < 0.8 * c.error_before,
            "{c:?}"
        );
        let mut clipped = w.clone();
        let r = clip(&mut clipped, rows, k, &h, o, &|s| s);
        assert!((0.55..=1.0).contains(&r));
    }
}
