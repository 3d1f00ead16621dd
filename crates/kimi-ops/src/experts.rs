//! A MoE layer's routed experts: the bank a model owns ([`ExpertBank`]) and the view of
//! device-resident weights a backend computes with ([`ExpertView`]).

use crate::offload::{NextLayer, TieredBank};
use crate::{Activation, Backend, MlpWeights, MoeRoutes, Result};

/// One layer's routed experts, as the model owns them: all in the backend's memory
/// (`Resident`), or split between the backend, a cache of device slots and a host store
/// ([`TieredBank`], experts beyond GPU memory). The layer code runs either through
/// [`ExpertBank::run`].
pub enum ExpertBank<T> {
    /// Every expert in the backend's memory in its stored format (bf16, ggml blocks,
    /// MXFP4), expert `e` at index `e`.
    Resident(Vec<MlpWeights<T>>),
    /// Experts placed in tiers.
    Tiered(Box<TieredBank<T>>),
    /// This rank's share of the experts under expert parallelism: experts `ids` of
    /// `total`; the other ranks hold the rest, and their pairs count nothing here (the
    /// ranks' outputs are summed).
    Partition {
        /// The local experts' ids, in order.
        ids: Vec<usize>,
        /// Their weights, `local[i]` for expert `ids[i]`.
        local: Vec<MlpWeights<T>>,
        /// Experts over all ranks.
        total: usize,
    },
    /// This rank's share under expert parallelism, in tiers (expert parallelism with
    /// experts beyond GPU memory): `bank` holds experts `ids` as its experts `0..ids.len()`.
    /// Runs only on the pairs token dispatch sends it ([`ExpertBank::run_pairs`]).
    TieredPartition {
        /// The local experts' ids, in order.
        ids: Vec<usize>,
        /// The local experts, expert `ids[i]` as the bank's `i`.
        bank: Box<TieredBank<T>>,
        /// Experts over all ranks.
        total: usize,
    },
}

impl<T> ExpertBank<T> {
    /// A bank whose experts all live in the backend's memory, expert `e` at index `e`.
    pub fn resident(experts: Vec<MlpWeights<T>>) -> Self {
        Self::Resident(experts)
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        match self {
            Self::Resident(e) => e.len(),
            Self::Tiered(t) => t.len(),
            Self::Partition { total, .. } | Self::TieredPartition { total, .. } => *total,
        }
    }

    /// Whether the bank has no experts.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The view of a resident bank (`None` for a tiered one: its view is made per call).
    pub fn view(&self) -> Option<ExpertView<'_, T>> {
        match self {
            Self::Resident(e) => Some(ExpertView::new(e)),
            Self::Tiered(_) | Self::Partition { .. } | Self::TieredPartition { .. } => None,
        }
    }

    /// The tiered bank, if this is one.
    pub fn tiered(&self) -> Option<&TieredBank<T>> {
        match self {
            Self::Tiered(t) | Self::TieredPartition { bank: t, .. } => Some(t),
            Self::Resident(_) | Self::Partition { .. } => None,
        }
    }

    /// `Σ_k w_k · expert_k(x)` over `routes` ([`Backend::moe_experts`]), wherever the
    /// experts live. Returns the output and the routes' expert ids (for
    /// [`Backend::expert_ids`]).
    pub fn run<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        routes: MoeRoutes<T>,
        act: Activation,
    ) -> Result<(T, T)> {
        self.run_before(be, x, routes, act, None)
    }

    /// [`ExpertBank::run`] that also copies the next MoE layer's predicted experts ahead
    /// ([`NextLayer`]; only a bank in tiers does).
    pub fn run_before<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        routes: MoeRoutes<T>,
        act: Activation,
        next: Option<NextLayer<'_, T>>,
    ) -> Result<(T, T)> {
        match self {
            Self::Resident(e) => {
                let y = be.moe_experts(x, &routes, &ExpertView::new(e), act)?;
                Ok((y, routes.experts))
            }
            Self::Tiered(t) => t.run(be, x, routes, act, next),
            Self::Partition { ids, local, total } => {
                let stand_in = local.first().ok_or_else(|| crate::Error::Shape {
                    op: "moe_experts (expert parallel)",
                    detail: "a rank without experts".into(),
                })?;
                let mut view: Vec<(&MlpWeights<T>, bool)> = vec![(stand_in, false); *total];
                for (&e, w) in ids.iter().zip(local) {
                    if let Some(slot) = view.get_mut(e) {
                        *slot = (w, true);
                    }
                }
                let view = ExpertView::partial(view);
                let y = be.moe_experts(x, &routes, &view, act)?;
                Ok((y, routes.experts))
            }
            Self::TieredPartition { .. } => Err(crate::Error::Unsupported(
                "experts in tiers under expert parallelism run on dispatched tokens \
                 (--expert-dispatch all-to-all)"
                    .into(),
            )),
        }
    }
}

impl<T> ExpertBank<T> {
    /// `weights[i] · expert(x_i)` for rows that each name one expert of this bank by its
    /// global id (`experts[i]`): the pairs a rank receives under expert parallelism with
    /// token dispatch, computed as routes of one expert per row. Returns `[rows, d]`.
    /// Every id must be held here (a partition's own experts, resident or in tiers); a
    /// whole bank in tiers is not supported.
    pub fn run_pairs<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        experts: &[u32],
        weights: &[f32],
        act: Activation,
    ) -> Result<T> {
        const OP: &str = "moe_experts (dispatched pairs)";
        let rows = experts.len();
        if weights.len() != rows || be.shape(x).first() != Some(&rows) {
            return Err(crate::Error::Shape {
                op: OP,
                detail: format!(
                    "{rows} expert ids and {} weights for rows {:?}",
                    weights.len(),
                    be.shape(x)
                ),
            });
        }
        let routes = |ids: &[u32]| -> Result<MoeRoutes<T>> {
            Ok(MoeRoutes {
                experts: be.upload_expert_ids(&[rows, 1], ids)?,
                weights: be.upload_f32(&[rows, 1], weights)?,
                top_k: 1,
            })
        };
        match self {
            Self::Resident(e) => be.moe_experts(x, &routes(experts)?, &ExpertView::new(e), act),
            Self::Partition { ids, local, total } => {
                let local_ids = local_ids(ids, *total, experts, OP)?;
                let view = ExpertView::per_call(local.iter().collect());
                be.moe_experts(x, &routes(&local_ids)?, &view, act)
            }
            Self::TieredPartition { ids, bank, total } => {
                let local_ids = local_ids(ids, *total, experts, OP)?;
                Ok(bank.run(be, x, routes(&local_ids)?, act, None)?.0)
            }
            Self::Tiered(_) => Err(crate::Error::Unsupported(
                "dispatched expert pairs on experts in tiers".into(),
            )),
        }
    }
}

/// Each of `experts` (global ids) as its index among this rank's experts `ids` (of
/// `total`); an id the rank does not hold is an error.
fn local_ids(ids: &[usize], total: usize, experts: &[u32], op: &'static str) -> Result<Vec<u32>> {
    let mut index = vec![u32::MAX; total];
    for (i, &e) in ids.iter().enumerate() {
        if let Some(slot) = index.get_mut(e) {
            *slot = i as u32;
        }
    }
    experts
        .iter()
        .map(|&e| match index.get(e as usize) {
            Some(&i) if i != u32::MAX => Ok(i),
            _ => Err(crate::Error::Shape {
                op,
                detail: format!("expert {e} is not held by this rank"),
            }),
        })
        .collect()
}

/// The weights [`Backend::moe_experts`] may read, by expert id, all in the backend's
/// memory. A resident bank lends its experts as they are (`stable`: the same addresses on
/// every call, so a backend may cache tables of them); a tiered bank lends, per call, its
/// resident experts and the cache slots holding the others, with any expert the call's
/// routes do not use at full weight standing for itself or for another (`stable` false).
pub struct ExpertView<'a, T> {
    experts: Vec<&'a MlpWeights<T>>,
    stable: bool,
    /// Per id, whether the expert is here (empty: all are). Pairs routed to an absent
    /// expert contribute nothing; its entry in `experts` is only a stand-in.
    present: Vec<bool>,
}

impl<'a, T> ExpertView<'a, T> {
    /// Every expert of `experts`, expert `e` at index `e`; the same on every call.
    pub fn new(experts: &'a [MlpWeights<T>]) -> Self {
        Self {
            experts: experts.iter().collect(),
            stable: true,
            present: Vec::new(),
        }
    }

    /// A view made for one call.
    pub fn per_call(experts: Vec<&'a MlpWeights<T>>) -> Self {
        Self {
            experts,
            stable: false,
            present: Vec::new(),
        }
    }

    /// A view made for one call in which some experts are absent (held by other ranks, or
    /// a tiered bank's cold experts, which the host computes):
    /// `(weights, present)` per id, the weights of an absent one only a stand-in. A backend
    /// must skip the pairs of absent experts, or refuse the view
    /// ([`ExpertView::has_absent`]).
    pub fn partial(experts: Vec<(&'a MlpWeights<T>, bool)>) -> Self {
        let (experts, present) = experts.into_iter().unzip();
        Self {
            experts,
            stable: false,
            present,
        }
    }

    /// Whether expert `e` is here (its pairs are computed).
    pub fn is_present(&self, e: usize) -> bool {
        self.present
            .get(e)
            .copied()
            .unwrap_or(e < self.experts.len())
    }

    /// Whether some experts are absent.
    pub fn has_absent(&self) -> bool {
        self.present.iter().any(|p| !p)
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        self.experts.len()
    }

    /// Whether the view has no experts.
    pub fn is_empty(&self) -> bool {
        self.experts.is_empty()
    }

    /// Expert `e`'s weights.
    pub fn expert(&self, e: usize) -> Option<&'a MlpWeights<T>> {
        self.experts.get(e).copied()
    }

    /// Every expert, in id order.
    pub fn experts(&self) -> &[&'a MlpWeights<T>] {
        &self.experts
    }

    /// Whether the view lends the same weights on every call.
    pub fn is_stable(&self) -> bool {
        self.stable
    }
}
