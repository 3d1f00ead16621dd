//! A MoE layer's routed experts: the bank a model owns ([`ExpertBank`]) and the view of
//! device-resident weights a backend computes with ([`ExpertView`]).

use crate::offload::TieredBank;
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
            Self::Tiered(_) => None,
        }
    }

    /// The tiered bank, if this is one.
    pub fn tiered(&self) -> Option<&TieredBank<T>> {
        match self {
            Self::Resident(_) => None,
            Self::Tiered(t) => Some(t),
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
        match self {
            Self::Resident(e) => {
                let y = be.moe_experts(x, &routes, &ExpertView::new(e), act)?;
                Ok((y, routes.experts))
            }
            Self::Tiered(t) => t.run(be, x, routes, act),
        }
    }
}

/// The weights [`Backend::moe_experts`] may read, by expert id, all in the backend's
/// memory. A resident bank lends its experts as they are (`stable`: the same addresses on
/// every call, so a backend may cache tables of them); a tiered bank lends, per call, its
/// resident experts and the cache slots holding the others, with any expert the call's
/// routes do not use at full weight standing for itself or for another (`stable` false).
pub struct ExpertView<'a, T> {
    experts: Vec<&'a MlpWeights<T>>,
    stable: bool,
}

impl<'a, T> ExpertView<'a, T> {
    /// Every expert of `experts`, expert `e` at index `e`; the same on every call.
    pub fn new(experts: &'a [MlpWeights<T>]) -> Self {
        Self {
            experts: experts.iter().collect(),
            stable: true,
        }
    }

    /// A view made for one call.
    pub fn per_call(experts: Vec<&'a MlpWeights<T>>) -> Self {
        Self {
            experts,
            stable: false,
        }
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
