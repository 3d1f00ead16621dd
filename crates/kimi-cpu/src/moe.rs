//! Mixture of experts: sigmoid router with bias-corrected, group-limited top-k selection,
//! gated experts and shared experts (Kimi Linear spec §5, Kimi K3 spec §3.4–§3.5).

use crate::matmul::{glu, glu_many, matmul, matmul_many, QuantMatmul};
use crate::tensor::{shape_err, CpuTensor};
use kimi_ops::{Activation, MlpWeights, MoeRouting, MoeWeights, Result};

/// See `Backend::ffn`. Gate and up run in one parallel section (see [`glu`]).
pub fn mlp(
    x: &CpuTensor,
    w: &MlpWeights<CpuTensor>,
    act: Activation,
    mode: QuantMatmul,
) -> Result<CpuTensor> {
    let hidden = glu(x, &w.gate, &w.up, act, mode)?;
    matmul(&hidden, &w.down, mode)
}

/// [`mlp`] of several experts, each on its own rows, in one section of the team per
/// projection (an MoE layer's cold experts on the host); each result equals `mlp`'s bit
/// for bit.
pub fn mlp_many(
    items: &[(&CpuTensor, &MlpWeights<CpuTensor>)],
    act: Activation,
    mode: QuantMatmul,
) -> Result<Vec<CpuTensor>> {
    let inputs: Vec<(&CpuTensor, &CpuTensor, &CpuTensor)> =
        items.iter().map(|&(x, w)| (x, &w.gate, &w.up)).collect();
    let hidden = glu_many(&inputs, act, mode)?;
    let downs: Vec<(&CpuTensor, &CpuTensor)> = hidden
        .iter()
        .zip(items)
        .map(|(h, &(_, w))| (h, &w.down))
        .collect();
    matmul_many(&downs, mode)
}

/// Chosen experts and their weights for one token.
#[derive(Debug, PartialEq)]
pub struct Route {
    /// Expert ids, best first.
    pub experts: Vec<usize>,
    /// Combine weights (after renormalisation and scaling).
    pub weights: Vec<f32>,
}

/// Routes one token from its router logits.
pub fn route(logits: &[f32], bias: Option<&[f32]>, r: &MoeRouting) -> Route {
    let e = logits.len();
    let scores: Vec<f32> = logits.iter().map(|&x| crate::kda::sigmoid(x)).collect();
    let choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    let mut masked = choice.clone();
    if r.num_groups > 1 {
        // Group score = sum of the two best selection scores in the group; keep topk_group groups.
        let per = e / r.num_groups;
        let group_scores: Vec<f32> = (0..r.num_groups)
            .map(|g| {
                let top = top_indices(&choice[g * per..(g + 1) * per], 2.min(per));
                top.iter().map(|&i| choice[g * per + i]).sum()
            })
            .collect();
        let keep = top_indices(&group_scores, r.topk_group);
        for g in 0..r.num_groups {
            if !keep.contains(&g) {
                masked[g * per..(g + 1) * per]
                    .iter_mut()
                    .for_each(|v| *v = f32::NEG_INFINITY);
            }
        }
    }
    let experts = top_indices(&masked, r.top_k);
    let source = if r.weights_use_bias { &choice } else { &scores };
    let mut weights: Vec<f32> = experts.iter().map(|&i| source[i]).collect();
    if r.renormalize && r.top_k > 1 {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= r.scaling);
    Route { experts, weights }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Checks a router against the routing parameters.
fn check_router(d: usize, router: &CpuTensor, num_experts: usize, r: &MoeRouting) -> Result<()> {
    if router.shape() != [num_experts, d] || r.top_k == 0 || r.top_k > num_experts {
        return Err(shape_err(
            "moe",
            format!(
                "router {:?}, {num_experts} experts, top_k {}, hidden {d}",
                router.shape(),
                r.top_k
            ),
        ));
    }
    if r.num_groups == 0 || !num_experts.is_multiple_of(r.num_groups) || r.topk_group > r.num_groups
    {
        return Err(shape_err(
            "moe",
            format!("{num_experts} experts in {} groups", r.num_groups),
        ));
    }
    Ok(())
}

/// Routes every token of `x [n, d]`; see `Backend::moe_route`.
pub fn route_tokens(
    x: &CpuTensor,
    router: &CpuTensor,
    bias: Option<&CpuTensor>,
    r: &MoeRouting,
) -> Result<Vec<Route>> {
    let (n, d) = x.rows_cols("moe")?;
    let num_experts = router.shape().first().copied().unwrap_or(0);
    check_router(d, router, num_experts, r)?;
    if let Some(b) = bias.filter(|b| b.shape() != [num_experts]) {
        return Err(shape_err(
            "moe",
            format!("correction bias {:?} for {num_experts} experts", b.shape()),
        ));
    }
    // The router stays in f32: expert choice is sensitive to small changes.
    let logits = matmul(x, router, QuantMatmul::F32)?.to_f32_vec();
    let bias = bias.map(|b| b.f32_values());
    Ok((0..n)
        .map(|t| {
            route(
                &logits[t * num_experts..(t + 1) * num_experts],
                bias.as_deref(),
                r,
            )
        })
        .collect())
}

/// `Σ_k weight_k · expert_k(x)` per token over `routes`, plus `shared(x)` unweighted when
/// given: `[n, d_out]` values. Tokens are grouped by expert so each expert runs one product,
/// every used expert (and the shared one) in two sections: gate/up, then down.
pub fn run_experts(
    x: &CpuTensor,
    routes: &[Route],
    experts: &[&MlpWeights<CpuTensor>],
    shared: Option<&MlpWeights<CpuTensor>>,
    act: Activation,
    mode: QuantMatmul,
) -> Result<CpuTensor> {
    let (n, d) = x.rows_cols("moe")?;
    if routes.len() != n {
        return Err(shape_err(
            "moe_experts",
            format!("{} routes for {n} tokens", routes.len()),
        ));
    }
    if let Some(bad) = routes
        .iter()
        .flat_map(|r| &r.experts)
        .find(|&&e| e >= experts.len())
    {
        return Err(shape_err(
            "moe_experts",
            format!("route to expert {bad} of {}", experts.len()),
        ));
    }
    let out_dim = match experts.first().copied().or(shared) {
        Some(w) => w.down.shape().first().copied().unwrap_or(0),
        None => d,
    };
    let xs = x.as_f32("moe")?;
    let mut used = Vec::new();
    for (expert, &ew) in experts.iter().enumerate() {
        let users: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .filter_map(|(t, rt)| {
                rt.experts
                    .iter()
                    .position(|&e| e == expert)
                    .map(|k| (t, rt.weights[k]))
            })
            .collect();
        if users.is_empty() {
            continue;
        }
        let mut rows = Vec::with_capacity(users.len() * d);
        for (t, _) in &users {
            rows.extend_from_slice(&xs[t * d..(t + 1) * d]);
        }
        let rows = CpuTensor::f32(&[users.len(), d], rows)?;
        used.push((ew, users, rows));
    }
    let mut inputs: Vec<(&CpuTensor, &CpuTensor, &CpuTensor)> = used
        .iter()
        .map(|(ew, _, rows)| (rows, &ew.gate, &ew.up))
        .collect();
    if let Some(shared) = shared {
        inputs.push((x, &shared.gate, &shared.up));
    }
    let hidden = glu_many(&inputs, act, mode)?;
    let mut downs: Vec<(&CpuTensor, &CpuTensor)> = used
        .iter()
        .zip(&hidden)
        .map(|((ew, ..), h)| (h, &ew.down))
        .collect();
    if let (Some(shared), Some(h)) = (shared, hidden.last()) {
        downs.push((h, &shared.down));
    }
    let ys = matmul_many(&downs, mode)?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = out_dim;
    }
    let mut out = vec![0f32; n * out_dim];
    // Combined in the order the experts were multiplied one by one before: routed experts
    // by id, then the shared one, so the sums round as they did.
    for ((_, users, _), y) in used.iter().zip(&ys) {
        let ys = y.as_f32("moe")?;
        if ys.len() != users.len() * out_dim {
            return Err(shape_err(
                "moe_experts",
                "experts of different output widths".into(),
            ));
        }
        for (i, (t, wt)) in users.iter().enumerate() {
            for j in 0..out_dim {
                out[t * out_dim + j] += wt * ys[i * out_dim + j];
            }
        }
    }
    if let (Some(_), Some(y)) = (shared, ys.get(used.len())) {
        let y = y.as_f32("moe")?;
        if y.len() != out.len() {
            return Err(shape_err(
                "moe",
                "shared experts of another output width".into(),
            ));
        }
        for (o, v) in out.iter_mut().zip(y) {
            *o += v;
        }
    }
    CpuTensor::f32(&shape, out)
}

/// See `Backend::moe`: routing, SwiGLU experts and the shared experts in one step.
pub fn moe(
    x: &CpuTensor,
    w: &MoeWeights<CpuTensor>,
    r: &MoeRouting,
    mode: QuantMatmul,
) -> Result<(CpuTensor, Vec<u32>)> {
    let routes = route_tokens(x, &w.router, w.correction_bias.as_ref(), r)?;
    let experts: Vec<&MlpWeights<CpuTensor>> = w.experts.iter().collect();
    let y = run_experts(
        x,
        &routes,
        &experts,
        w.shared.as_ref(),
        Activation::Silu,
        mode,
    )?;
    let chosen = routes
        .iter()
        .flat_map(|rt| rt.experts.iter().map(|&e| e as u32))
        .collect();
    Ok((y, chosen))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(top_k: usize, groups: usize, topk_group: usize) -> MoeRouting {
        MoeRouting {
            top_k,
            num_groups: groups,
            topk_group,
            renormalize: true,
            scaling: 2.0,
            weights_use_bias: false,
        }
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let logits = [0.0, 1.0, 2.0, -1.0];
        let bias = [5.0, 0.0, 0.0, 0.0];
        let rt = route(&logits, Some(&bias), &routing(2, 1, 1));
        assert_eq!(rt.experts, vec![0, 2]);
        let (s0, s2) = (0.5f32, 1.0 / (1.0 + (-2f32).exp()));
        assert!((rt.weights[0] - 2.0 * s0 / (s0 + s2)).abs() < 1e-6);
    }

    #[test]
    fn groups_limit_selection() {
        // Group 1 (experts 2,3) holds the single best expert but group 0 has the better pair.
        let logits = [2.0, 2.0, 3.0, -5.0];
        let rt = route(&logits, None, &routing(2, 2, 1));
        assert_eq!(rt.experts, vec![0, 1]);
    }

    /// Several experts' FFNs in one go give each expert's own `mlp` bits, whatever their row
    /// counts.
    #[test]
    fn mlp_many_equals_mlp_per_expert() {
        let (d, inter) = (64, 48);
        let mut seed = 1u32;
        let mut values = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                })
                .collect()
        };
        let mut experts = Vec::new();
        let mut inputs = Vec::new();
        for rows in [1, 3, 8, 17] {
            experts.push(MlpWeights {
                gate: CpuTensor::f32(&[inter, d], values(inter * d)).unwrap(),
                up: CpuTensor::f32(&[inter, d], values(inter * d)).unwrap(),
                down: CpuTensor::f32(&[d, inter], values(d * inter)).unwrap(),
            });
            inputs.push(CpuTensor::f32(&[rows, d], values(rows * d)).unwrap());
        }
        let items: Vec<_> = inputs.iter().zip(&experts).collect();
        let act = Activation::Silu;
        let many = mlp_many(&items, act, QuantMatmul::F32).unwrap();
        for ((x, w), y) in items.iter().zip(&many) {
            let one = mlp(x, w, act, QuantMatmul::F32).unwrap();
            let (a, b) = (y.as_f32("test").unwrap(), one.as_f32("test").unwrap());
            assert_eq!(a.len(), b.len());
            assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
    }
}
