//! A layer's feed-forward block: a dense gated MLP, Kimi Linear's fused MoE step, or the
//! composed MoE (SiTU, LatentMoE, MXFP4 experts, experts in tiers) of Kimi K3 spec §3.4–§3.5.

use kimi_core::config::{ExpertFormat, MoeConfig};
use kimi_ops::offload::{ExpertOffload, NextLayer, TieredBank};
use kimi_ops::{
    Activation, Backend, Collective, ExpertBank, HostTensor, MlpWeights, MoeRoutes, MoeRouting,
    MoeWeights,
};

use crate::parallel::{DispatchTraffic, ExpertDispatch, ExpertSplit, Shard, TokenDispatch};

use crate::layers::{HostMatrix, Loader};
use crate::Result;

/// The feed-forward block of a layer.
pub(crate) enum FfnLayer<T> {
    Dense(MlpWeights<T>, Activation),
    /// A plain SwiGLU MoE layer (Kimi Linear): the backend's fused step.
    Moe(MoeWeights<T>, MoeRouting),
    /// Routing, routed experts and shared experts as separate ops, for SiTU and LatentMoE
    /// (Kimi K3).
    Composed(Box<ComposedMoe<T>>),
}

/// LatentMoE's projections around the routed experts.
pub(crate) struct LatentProj<T> {
    /// `routed_expert_down_proj [latent, hidden]`.
    down: T,
    /// `routed_expert_norm [latent]`, on the weighted expert sum.
    norm: Option<T>,
    /// `routed_expert_up_proj [hidden, latent]`.
    up: T,
}

/// A MoE layer whose steps the model composes itself (Kimi K3 spec §3.4–§3.5):
///
/// ```text
/// routes = route(x)                          router on the full-width x
/// z      = latent.down(x)                    (x itself without a latent)
/// u      = Σ_k w_k · expert_k(z)             SiTU-GLU experts, MXFP4 or dense
/// y      = latent.up(RMSNorm(u)) + shared(x) shared experts on the unprojected x
/// ```
pub(crate) struct ComposedMoe<T> {
    router: T,
    correction_bias: Option<T>,
    routing: MoeRouting,
    bank: ExpertBank<T>,
    latent: Option<LatentProj<T>>,
    shared: Option<MlpWeights<T>>,
    act: Activation,
    eps: f32,
    /// Token dispatch by all-to-all under expert parallelism (`None`: this rank's partial
    /// sum, completed by an all-reduce).
    dispatch: Option<TokenDispatch>,
}

impl<T> FfnLayer<T> {
    /// The traffic of this layer's token dispatch, if it dispatches.
    pub fn dispatch_traffic(&self) -> Option<DispatchTraffic> {
        match self {
            Self::Composed(m) => m.dispatch.as_ref().map(TokenDispatch::traffic),
            _ => None,
        }
    }

    /// The layer's experts in tiers, if they are.
    pub fn tiered(&self) -> Option<&TieredBank<T>> {
        match self {
            Self::Composed(m) => m.bank.tiered(),
            _ => None,
        }
    }

    pub fn load_dense<B: Backend<Tensor = T>>(
        ld: &mut Loader<'_, B>,
        p: &str,
        hidden: usize,
        width: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self::Dense(
            ld.mlp(
                &format!("{p}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
                hidden,
                width,
            )?,
            act,
        ))
    }

    /// Decoder layer `layer`'s MoE block.
    pub fn load_moe<B: Backend<Tensor = T>>(
        ld: &mut Loader<'_, B>,
        layer: usize,
        hidden: usize,
        c: &MoeConfig,
        act: Activation,
        eps: f32,
    ) -> Result<Self> {
        let p = format!("model.layers.{layer}.block_sparse_moe");
        let e = c.num_experts;
        let router = ld.get_f32(&format!("{p}.gate.weight"), &[e, hidden])?;
        let bias_name = format!("{p}.gate.e_score_correction_bias");
        let correction_bias = if ld.contains(&bias_name) {
            Some(ld.get(&bias_name, &[e])?)
        } else {
            None
        };
        let expert_in = c.latent.map_or(hidden, |l| l.width);
        // Split over ranks, the shared experts are one MLP of this rank's share of their
        // width (the source cuts each tensor to it).
        let shared = match c.num_shared_experts {
            0 => None,
            n => Some(ld.mlp(
                &format!("{p}.shared_experts"),
                ["gate_proj", "up_proj", "down_proj"],
                hidden,
                n * c.expert_intermediate_size / ld.shard.world,
            )?),
        };
        let routing = MoeRouting {
            top_k: c.top_k,
            num_groups: c.num_expert_groups,
            topk_group: c.topk_group,
            renormalize: c.renormalize,
            scaling: c.routed_scaling_factor,
            weights_use_bias: c.weights_use_correction_bias,
        };
        let (local, dispatch) = rank_share(ld, layer, e)?;
        let bank = match ld.offload.clone() {
            // Each rank keeps its own share in tiers; the pairs come by token dispatch.
            Some(_) if local.len() < e && dispatch.is_none() => {
                return Err(crate::ModelError::Input(
                    "experts in tiers under expert parallelism need token dispatch \
                     (--expert-dispatch all-to-all)"
                        .into(),
                ))
            }
            Some(offload) if local.len() < e => {
                let bank = load_tiered(ld, &p, expert_in, c, &offload, &local)?;
                ExpertBank::TieredPartition {
                    ids: local,
                    bank: Box::new(bank),
                    total: e,
                }
            }
            Some(offload) => {
                let all: Vec<usize> = (0..e).collect();
                ExpertBank::Tiered(Box::new(load_tiered(ld, &p, expert_in, c, &offload, &all)?))
            }
            None => {
                let experts = local
                    .iter()
                    .map(|i| load_expert(ld, &format!("{p}.experts.{i}"), expert_in, c))
                    .collect::<Result<Vec<_>>>()?;
                match local.len() < e {
                    true => ExpertBank::Partition {
                        ids: local,
                        local: experts,
                        total: e,
                    },
                    false => ExpertBank::resident(experts),
                }
            }
        };
        let bank = match bank {
            // Kimi Linear's layers take the backend's fused step while all experts are
            // resident; experts in tiers need the composed one.
            ExpertBank::Resident(experts) if act == Activation::Silu && c.latent.is_none() => {
                return Ok(Self::Moe(
                    MoeWeights {
                        router,
                        correction_bias,
                        experts,
                        shared,
                    },
                    routing,
                ));
            }
            bank => bank,
        };
        let latent = match c.latent {
            None => None,
            Some(l) => Some(LatentProj {
                down: ld.get(
                    &format!("{p}.routed_expert_down_proj.weight"),
                    &[l.width, hidden],
                )?,
                norm: match l.norm {
                    true => Some(ld.get(&format!("{p}.routed_expert_norm.weight"), &[l.width])?),
                    false => None,
                },
                up: ld.get(
                    &format!("{p}.routed_expert_up_proj.weight"),
                    &[hidden, l.width],
                )?,
            }),
        };
        Ok(Self::Composed(Box::new(ComposedMoe {
            router,
            correction_bias,
            routing,
            bank,
            latent,
            shared,
            act,
            eps,
            dispatch,
        })))
    }

    /// Returns the output and, for MoE, the chosen experts (read with
    /// [`Backend::expert_ids`]). On a rank of a split model (`group`) the output is the
    /// whole one: this rank's partial sums are summed over the ranks here. `next` is the
    /// following layer's block, whose experts a bank in tiers may copy ahead
    /// ([`CachePolicy::predict_next`](kimi_ops::offload::CachePolicy)).
    pub fn forward<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        group: Option<&dyn Collective<B>>,
        next: Option<&Self>,
    ) -> Result<(T, Option<T>)> {
        let reduce = |y: &mut T| -> Result<()> {
            if let Some(g) = group {
                g.all_reduce_sum(be, y)?;
            }
            Ok(())
        };
        match self {
            Self::Dense(w, act) => {
                let mut y = be.ffn(x, w, *act)?;
                reduce(&mut y)?;
                Ok((y, None))
            }
            Self::Moe(w, r) => {
                let (mut y, chosen) = be.moe(x, w, r)?;
                reduce(&mut y)?;
                Ok((y, Some(chosen)))
            }
            Self::Composed(m) => {
                let routes = be.moe_route(x, &m.router, m.correction_bias.as_ref(), &m.routing)?;
                let next = m.next_layer(be, x, next)?;
                let shared = match &m.shared {
                    Some(shared) => Some(be.ffn(x, shared, m.act)?),
                    None => None,
                };
                // The routed sum over every rank's experts (`true`: token dispatch has
                // completed it), or this rank's partial sum (`false`).
                let routed = |z: &T, routes: MoeRoutes<T>| -> Result<(T, T, bool)> {
                    match (&m.dispatch, group) {
                        (Some(d), Some(g)) => {
                            let y = d.run(be, g, z, &routes, &m.bank, m.act)?;
                            Ok((y, routes.experts, true))
                        }
                        _ => {
                            let (y, chosen) = m.bank.run_before(be, z, routes, m.act, next)?;
                            Ok((y, chosen, false))
                        }
                    }
                };
                let (y, chosen) = match &m.latent {
                    None => {
                        let (mut y, chosen, complete) = routed(x, routes)?;
                        match (complete, shared) {
                            // Routed and shared partial sums complete together.
                            (false, shared) => {
                                if let Some(s) = &shared {
                                    be.add_assign(&mut y, s)?;
                                }
                                reduce(&mut y)?;
                            }
                            (true, Some(mut s)) => {
                                reduce(&mut s)?;
                                be.add_assign(&mut y, &s)?;
                            }
                            (true, None) => {}
                        }
                        (y, chosen)
                    }
                    Some(l) => {
                        let z = be.matmul(x, &l.down)?;
                        let (mut u, chosen, complete) = routed(&z, routes)?;
                        // The latent norm reads the whole expert sum.
                        if !complete {
                            reduce(&mut u)?;
                        }
                        if let Some(norm) = &l.norm {
                            u = be.rms_norm(&u, norm, m.eps)?;
                        }
                        let mut y = be.matmul(&u, &l.up)?;
                        if let Some(mut s) = shared {
                            reduce(&mut s)?;
                            be.add_assign(&mut y, &s)?;
                        }
                        (y, chosen)
                    }
                };
                Ok((y, Some(chosen)))
            }
        }
    }
}

impl<T> ComposedMoe<T> {
    /// Where this layer's experts are in tiers that predict the next layer
    /// (`predict_next`) and the next layer's are in tiers too, and have missed lately
    /// (`TieredBank::wants_prediction`): the next layer's router on
    /// this layer's input `x`, with that layer's bank. The prediction reads `x` as normed
    /// for this layer; the next layer's own input differs by this layer's output and
    /// attention, which is why it is a prediction.
    fn next_layer<'a, B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        next: Option<&'a FfnLayer<T>>,
    ) -> Result<Option<NextLayer<'a, T>>> {
        let predicts = self.bank.tiered().is_some_and(|t| t.policy().predict_next);
        let Some(FfnLayer::Composed(n)) = next.filter(|_| predicts && self.dispatch.is_none())
        else {
            return Ok(None);
        };
        let Some(bank) = n.bank.tiered().filter(|b| b.wants_prediction()) else {
            return Ok(None);
        };
        let routes = be.moe_route(x, &n.router, n.correction_bias.as_ref(), &n.routing)?;
        Ok(Some(NextLayer { bank, routes }))
    }
}

/// A routed expert's intermediate width on this rank: its share where the experts are
/// split inside (tensor parallelism), all of it where whole experts are spread.
fn expert_width<B: Backend>(ld: &Loader<'_, B>, c: &MoeConfig) -> usize {
    match ld.shard.experts {
        ExpertSplit::Tensor => c.expert_intermediate_size / ld.shard.world,
        ExpertSplit::Experts => c.expert_intermediate_size,
    }
}

/// This rank's experts of decoder layer `layer` under the loader's placement, and their
/// token dispatch where the experts' outputs travel by all-to-all.
fn rank_share<B: Backend>(
    ld: &Loader<'_, B>,
    layer: usize,
    e: usize,
) -> Result<(Vec<usize>, Option<TokenDispatch>)> {
    let local = ld.shard.local_experts(ld.placement.as_deref(), layer, e);
    let dispatch = match ld.dispatch {
        ExpertDispatch::AllReduce => None,
        ExpertDispatch::AllToAll => {
            if !ld.shard.is_split() || ld.shard.experts != ExpertSplit::Experts {
                return Err(crate::ModelError::Input(
                    "all-to-all expert dispatch needs expert parallelism (whole experts \
                     spread over several ranks)"
                        .into(),
                ));
            }
            let owned: Vec<Vec<usize>> = (0..ld.shard.world)
                .map(|rank| {
                    Shard { rank, ..ld.shard }.local_experts(ld.placement.as_deref(), layer, e)
                })
                .collect();
            Some(TokenDispatch::new(&owned, e)?)
        }
    };
    Ok((local, dispatch))
}

/// A MoE layer's share of the routed experts under a new placement, read but not in use
/// yet ([`FfnLayer::stage_share`], then [`FfnLayer::take_share`]).
pub(crate) struct StagedShare<T> {
    /// The experts this rank will hold, in id order.
    ids: Vec<usize>,
    /// Those it does not hold now, read from the weights.
    fresh: Vec<(usize, MlpWeights<T>)>,
    /// A share in tiers: all of `ids` placed in tiers again (the budgets are per share,
    /// so which experts live where changes with it).
    tiered: Option<Box<TieredBank<T>>>,
    dispatch: Option<TokenDispatch>,
}

impl<T> FfnLayer<T> {
    /// The ids of the routed experts this rank holds, where whole experts are spread over
    /// ranks.
    pub fn partition_ids(&self) -> Option<&[usize]> {
        match self {
            Self::Composed(m) => match &m.bank {
                ExpertBank::Partition { ids, .. } | ExpertBank::TieredPartition { ids, .. } => {
                    Some(ids)
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Reads the experts that the loader's placement gives this rank and that it does not
    /// hold yet (`None` for a layer whose experts are not spread). Nothing in use changes.
    pub fn stage_share<B: Backend<Tensor = T>>(
        &self,
        ld: &mut Loader<'_, B>,
        layer: usize,
        hidden: usize,
        c: &MoeConfig,
    ) -> Result<Option<StagedShare<T>>> {
        let Some(held) = self.partition_ids() else {
            return Ok(None);
        };
        let (ids, dispatch) = rank_share(ld, layer, c.num_experts)?;
        let expert_in = c.latent.map_or(hidden, |l| l.width);
        let p = format!("model.layers.{layer}.block_sparse_moe");
        if self.tiered().is_some() {
            let offload = ld.offload.clone().ok_or_else(|| {
                crate::ModelError::Input("experts in tiers move only with their tiers' plan".into())
            })?;
            let bank = load_tiered(ld, &p, expert_in, c, &offload, &ids)?;
            return Ok(Some(StagedShare {
                ids,
                fresh: Vec::new(),
                tiered: Some(Box::new(bank)),
                dispatch,
            }));
        }
        let fresh = ids
            .iter()
            .filter(|i| !held.contains(i))
            .map(|&i| {
                Ok((
                    i,
                    load_expert(ld, &format!("{p}.experts.{i}"), expert_in, c)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(StagedShare {
            ids,
            fresh,
            tiered: None,
            dispatch,
        }))
    }

    /// Whether [`FfnLayer::take_share`] can put `staged` in use: every expert it names is
    /// held or was read.
    pub fn check_share(&self, staged: &StagedShare<T>) -> Result<()> {
        let Some(ids) = self.partition_ids() else {
            return Err(crate::ModelError::Input(
                "an expert share for a layer without spread experts".into(),
            ));
        };
        if self.tiered().is_some() != staged.tiered.is_some() {
            return Err(crate::ModelError::Input(
                "an expert share staged for experts held otherwise (in tiers or not)".into(),
            ));
        }
        let known = |e: &usize| {
            staged.tiered.is_some() || ids.contains(e) || staged.fresh.iter().any(|(f, _)| f == e)
        };
        match staged.ids.iter().find(|e| !known(e)) {
            Some(e) => Err(crate::ModelError::Input(format!(
                "expert {e} of the new placement was not read"
            ))),
            None => Ok(()),
        }
    }

    /// Puts a share that passed [`FfnLayer::check_share`] in use (the experts given away
    /// are dropped; the dispatch keeps its traffic counts).
    pub fn take_share(&mut self, staged: StagedShare<T>) {
        let Self::Composed(m) = self else {
            return;
        };
        match (&mut m.bank, staged.tiered) {
            (ExpertBank::TieredPartition { ids, bank, .. }, Some(tiered)) => {
                *ids = staged.ids;
                *bank = tiered;
            }
            (ExpertBank::Partition { ids, local, .. }, None) => {
                let mut held: std::collections::HashMap<usize, MlpWeights<T>> =
                    ids.drain(..).zip(local.drain(..)).collect();
                held.extend(staged.fresh);
                for e in staged.ids {
                    if let Some(w) = held.remove(&e) {
                        ids.push(e);
                        local.push(w);
                    }
                }
            }
            // check_share refused any other pairing.
            _ => return,
        }
        m.dispatch = match (staged.dispatch, m.dispatch.take()) {
            (Some(new), Some(old)) => Some(new.continuing(&old)),
            (new, _) => new,
        };
    }
}

/// One routed expert: `w1` (gate), `w3` (up), `w2` (down), each MXFP4 planes
/// (`weight_packed` + `weight_scale`) or a plain `weight`, as the checkpoint stores it.
fn load_expert<B: Backend>(
    ld: &mut Loader<'_, B>,
    p: &str,
    expert_in: usize,
    c: &MoeConfig,
) -> Result<MlpWeights<B::Tensor>> {
    let width = expert_width(ld, c);
    let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<B::Tensor> {
        let base = format!("{p}.{name}");
        if is_mxfp4(ld, &base, c) {
            ld.mxfp4(&base, rows, cols)
        } else {
            ld.get_expert(&format!("{base}.weight"), &[rows, cols])
        }
    };
    Ok(MlpWeights {
        gate: matrix("w1", width, expert_in)?,
        up: matrix("w3", width, expert_in)?,
        down: matrix("w2", expert_in, width)?,
    })
}

/// The three matrices of one routed expert in host memory, as [`load_expert`] would
/// upload them.
fn load_expert_host<B: Backend>(
    ld: &mut Loader<'_, B>,
    p: &str,
    expert_in: usize,
    c: &MoeConfig,
) -> Result<MlpWeights<HostMatrix>> {
    let width = expert_width(ld, c);
    let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<HostMatrix> {
        let base = format!("{p}.{name}");
        if is_mxfp4(ld, &base, c) {
            ld.host_mxfp4(&base, rows, cols)
        } else {
            ld.host_expert_matrix(&format!("{base}.weight"), rows, cols)
        }
    };
    Ok(MlpWeights {
        gate: matrix("w1", width, expert_in)?,
        up: matrix("w3", width, expert_in)?,
        down: matrix("w2", expert_in, width)?,
    })
}

/// Experts `ids` of a layer placed in tiers by `offload`, as the bank's experts
/// `0..ids.len()` (all of the layer's, or a rank's share under expert parallelism: the
/// budgets apply to them): the first in the backend's memory, the last in the host store,
/// with device slots caching them.
fn load_tiered<B: Backend>(
    ld: &mut Loader<'_, B>,
    p: &str,
    expert_in: usize,
    c: &MoeConfig,
    offload: &ExpertOffload,
    ids: &[usize],
) -> Result<TieredBank<B::Tensor>> {
    let e = ids.len();
    let Some(&first_id) = ids.first() else {
        return Err(crate::ModelError::Input(format!(
            "{p}: no experts to place in tiers"
        )));
    };
    // The first expert's stored size turns the byte budgets into experts per layer.
    let first = load_expert_host(ld, &format!("{p}.experts.{first_id}"), expert_in, c)?;
    let bytes = [&first.gate, &first.up, &first.down]
        .iter()
        .map(|m| m.bytes.len() as u64)
        .sum();
    let (host, slots) = offload.per_layer(e, bytes, ld.moe_layers);
    let first_host = e - host;
    let mut builder = offload.store.begin_layer(e);
    let mut resident = Vec::with_capacity(e);
    let mut first = Some(first);
    for (i, &id) in ids.iter().enumerate() {
        let m = match first.take() {
            Some(m) => m,
            None => load_expert_host(ld, &format!("{p}.experts.{id}"), expert_in, c)?,
        };
        if i < first_host {
            let name = format!("{p}.experts.{id}");
            let up = |m: &HostMatrix| ld.upload_expert(&name, &m.shape, m.dtype, &m.bytes);
            resident.push(Some(MlpWeights {
                gate: up(&m.gate)?,
                up: up(&m.up)?,
                down: up(&m.down)?,
            }));
        } else {
            builder.add(i, host_view(&m))?;
            resident.push(None);
        }
    }
    let host = builder.finish()?;
    Ok(TieredBank::new(
        ld.backend,
        resident,
        host,
        slots,
        offload.policy,
    )?)
}

/// Whether `{base}` is stored as MXFP4 planes: the config says which form to expect; the
/// other is taken where only it exists.
fn is_mxfp4<B: Backend>(ld: &Loader<'_, B>, base: &str, c: &MoeConfig) -> bool {
    stored_as_mxfp4(&|name| ld.contains(name), base, c)
}

/// Whether the expert matrix `base` is stored as MXFP4 (`weight_packed` and its scales)
/// rather than as a `weight`, by the names `contains` finds.
fn stored_as_mxfp4(contains: &dyn Fn(&str) -> bool, base: &str, c: &MoeConfig) -> bool {
    let (packed, plain) = (format!("{base}.weight_packed"), format!("{base}.weight"));
    match c.expert_format {
        ExpertFormat::Mxfp4 => contains(&packed) || !contains(&plain),
        ExpertFormat::Dense => !contains(&plain) && contains(&packed),
    }
}

fn host_view(m: &MlpWeights<HostMatrix>) -> MlpWeights<HostTensor<'_>> {
    MlpWeights {
        gate: m.gate.tensor(),
        up: m.up.tensor(),
        down: m.down.tensor(),
    }
}

/// The bytes a checkpoint's routed experts will take on a backend where the config's dtype
/// does not say it ([`crate::ModelSummary`] counts them in that dtype): experts written by
/// a quantization tool (AWQ, GPTQ, compressed-tensors, FP8), decoded as the loader decodes
/// them and kept packed where `keeps` says the backend's MoE kernels take their type
/// ([`Backend::stores_experts`]), else widened to bf16; MXFP4 experts under a dense-format
/// config. One expert of the first MoE layer is read and its bytes counted for every expert
/// of every MoE layer. `None` where the config's arithmetic holds: no MoE, unquantized
/// experts, MXFP4 experts the config declares.
pub fn routed_expert_bytes(
    keeps: &dyn Fn(kimi_core::DType) -> bool,
    source: &dyn crate::WeightSource,
    cfg: &kimi_core::ModelConfig,
) -> Result<Option<u64>> {
    let Some(c) = &cfg.moe else { return Ok(None) };
    let is_moe = |l: &&kimi_core::config::LayerSpec| l.ffn == kimi_core::config::Ffn::Moe;
    let moe_layers = cfg.layers.iter().filter(is_moe).count() as u64;
    let Some(first) = cfg.layers.iter().position(|l| is_moe(&l)) else {
        return Ok(None);
    };
    let p = format!("model.layers.{first}.block_sparse_moe.experts.0");
    let (width, expert_in) = (
        c.expert_intermediate_size,
        c.latent.map_or(cfg.hidden_size, |l| l.width),
    );
    let mut bytes = 0u64;
    for (name, rows, cols) in [
        ("w1", width, expert_in),
        ("w3", width, expert_in),
        ("w2", expert_in, width),
    ] {
        let base = format!("{p}.{name}");
        let values = (rows * cols) as u64;
        if stored_as_mxfp4(&|n| source.contains(n), &base, c) {
            if c.expert_format == ExpertFormat::Mxfp4 {
                return Ok(None);
            }
            bytes += values * 17 / 32; // 16 bytes of codes and one E8M0 scale per 32 values
            continue;
        }
        let (dtype, stored) = source.load(&format!("{base}.weight"), &[rows, cols])?;
        if !dtype.is_quantized() {
            return Ok(None);
        }
        let kept = !crate::layers::widen_everywhere() && keeps(dtype);
        bytes += match kept {
            true => stored.len() as u64,
            false => values * kimi_core::DType::BF16.size_bytes() as u64,
        };
    }
    Ok(Some(bytes * c.num_experts as u64 * moe_layers))
}
