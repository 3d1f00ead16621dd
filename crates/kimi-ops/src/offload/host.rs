//! The host tier: experts in host memory, lent to device slots as stored and computed there
//! for the few tokens that need a cold one.

use std::sync::Arc;

use crate::{Activation, Backend, Error, HostRegion, HostTensor, MlpWeights, Result};

/// One token-expert pair computed on the host: `weight · expert(x[row])`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColdPair {
    /// The token's row of the input.
    pub row: usize,
    /// The expert id.
    pub expert: usize,
    /// Its combine weight.
    pub weight: f32,
}

/// A layer's experts in host memory.
pub trait HostExperts: Send + Sync {
    /// Expert `e`'s matrices as [`Backend::upload`] takes them (stored format), if the
    /// store holds it.
    fn matrices(&self, e: usize) -> Option<MlpWeights<HostTensor<'_>>>;
    /// Stored bytes of expert `e` (its three matrices; 0 if absent).
    fn bytes(&self, e: usize) -> usize;
    /// Width of an expert's output.
    fn out_width(&self) -> usize;
    /// The whole regions of host memory the experts' bytes lie in that a device backend
    /// may page-lock ([`Backend::host_region`]), each once; they stay mapped and unwritten
    /// while the store lives. Default: none.
    fn regions(&self) -> Vec<HostRegion> {
        Vec::new()
    }
    /// Says that [`HostExperts::compute`] may be called within `within` (see
    /// [`Backend::expect_work`]). Default: nothing.
    fn expect_work(&self, within: std::time::Duration) {
        let _ = within;
    }
    /// `Σ weight · expert(x[row])` over `pairs`, for `x` row-major `[rows, width]` f32;
    /// returns `[rows, out_width]` (rows without pairs zero). Experts are summed in id
    /// order.
    fn compute(
        &self,
        x: &[f32],
        rows: usize,
        width: usize,
        pairs: &[ColdPair],
        act: Activation,
    ) -> Result<Vec<f32>>;
}

/// Where host experts are made: one [`HostLayerBuilder`] per MoE layer.
pub trait HostExpertStore: Send + Sync {
    /// Starts a layer of `num_experts` expert ids.
    fn begin_layer(&self, num_experts: usize) -> Box<dyn HostLayerBuilder>;
    /// Short name for logs (the backend computing cold experts).
    fn name(&self) -> String;
    /// Where the experts are kept, for logs: "host RAM" unless the store says otherwise.
    fn tier(&self) -> String {
        "host RAM".into()
    }
}

/// Takes a layer's host experts one by one as the loader reads them.
pub trait HostLayerBuilder {
    /// Adds expert `e` from its stored matrices.
    fn add(&mut self, e: usize, weights: MlpWeights<HostTensor<'_>>) -> Result<()>;
    /// The finished layer.
    fn finish(self: Box<Self>) -> Result<Arc<dyn HostExperts>>;
}

/// A host store on any backend whose tensors live in host memory
/// ([`Backend::host_view`]): the CPU backend, which also computes the cold experts.
pub struct HostBackend<H> {
    be: Arc<H>,
    tier: Option<String>,
}

impl<H> HostBackend<H> {
    /// A store on `backend`.
    pub fn new(backend: Arc<H>) -> Self {
        Self {
            be: backend,
            tier: None,
        }
    }

    /// This store, described in logs as keeping its experts in `tier` (where the backend
    /// keeps its weights somewhere other than RAM, e.g. memory-mapped files on disk).
    pub fn in_tier(mut self, tier: impl Into<String>) -> Self {
        self.tier = Some(tier.into());
        self
    }
}

impl<H: Backend + 'static> HostExpertStore for HostBackend<H>
where
    H::Tensor: 'static,
{
    fn begin_layer(&self, num_experts: usize) -> Box<dyn HostLayerBuilder> {
        Box::new(HostLayer {
            be: self.be.clone(),
            experts: (0..num_experts).map(|_| None).collect(),
        })
    }

    fn name(&self) -> String {
        self.be.name()
    }

    fn tier(&self) -> String {
        self.tier.clone().unwrap_or_else(|| "host RAM".into())
    }
}

struct HostLayer<H: Backend> {
    be: Arc<H>,
    experts: Vec<Option<MlpWeights<H::Tensor>>>,
}

impl<H: Backend + 'static> HostLayerBuilder for HostLayer<H>
where
    H::Tensor: 'static,
{
    fn add(&mut self, e: usize, w: MlpWeights<HostTensor<'_>>) -> Result<()> {
        let slots = self.experts.len();
        let slot = self.experts.get_mut(e).ok_or_else(|| Error::Shape {
            op: "expert offload",
            detail: format!("host expert {e} of a layer of {slots}"),
        })?;
        let w = MlpWeights {
            gate: self.be.upload(w.gate)?,
            up: self.be.upload(w.up)?,
            down: self.be.upload(w.down)?,
        };
        for t in [&w.gate, &w.up, &w.down] {
            if self.be.host_view(t).is_none() {
                return Err(Error::Unsupported(format!(
                    "{} as the host store of offloaded experts (its tensors are not kept in \
                     host memory in their stored layout)",
                    self.be.name()
                )));
            }
        }
        *slot = Some(w);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<Arc<dyn HostExperts>> {
        Ok(Arc::new(*self))
    }
}

impl<H: Backend> HostExperts for HostLayer<H> {
    fn matrices(&self, e: usize) -> Option<MlpWeights<HostTensor<'_>>> {
        let w = self.experts.get(e)?.as_ref()?;
        Some(MlpWeights {
            gate: self.be.host_view(&w.gate)?,
            up: self.be.host_view(&w.up)?,
            down: self.be.host_view(&w.down)?,
        })
    }

    fn bytes(&self, e: usize) -> usize {
        self.matrices(e).map_or(0, |m| {
            m.gate.bytes.len() + m.up.bytes.len() + m.down.bytes.len()
        })
    }

    fn expect_work(&self, within: std::time::Duration) {
        self.be.expect_work(within);
    }

    fn out_width(&self) -> usize {
        self.experts
            .iter()
            .flatten()
            .next()
            .and_then(|w| self.be.shape(&w.down).first().copied())
            .unwrap_or(0)
    }

    fn regions(&self) -> Vec<HostRegion> {
        let mut regions: Vec<HostRegion> = self
            .experts
            .iter()
            .flatten()
            .flat_map(|w| [&w.gate, &w.up, &w.down])
            .filter_map(|t| self.be.host_region(t))
            .collect();
        regions.sort_by_key(|r| (r.start, r.len));
        regions.dedup();
        regions
    }

    fn compute(
        &self,
        x: &[f32],
        rows: usize,
        width: usize,
        pairs: &[ColdPair],
        act: Activation,
    ) -> Result<Vec<f32>> {
        const OP: &str = "cold experts";
        if x.len() != rows * width {
            return Err(Error::Shape {
                op: OP,
                detail: format!("{} values for {rows} rows of {width}", x.len()),
            });
        }
        let out_width = self.out_width();
        let mut out = vec![0f32; rows * out_width];
        let mut order: Vec<&ColdPair> = pairs.iter().collect();
        order.sort_by_key(|p| (p.expert, p.row));
        let groups: Vec<&[&ColdPair]> = order.chunk_by(|a, b| a.expert == b.expert).collect();
        // Every cold expert's rows gathered first, then all of them through the backend's
        // FFN together (the CPU backend's threads share the experts instead of taking one
        // expert's small product after another).
        let mut inputs = Vec::with_capacity(groups.len());
        let mut weights = Vec::with_capacity(groups.len());
        for group in &groups {
            let e = group[0].expert;
            let w = self
                .experts
                .get(e)
                .and_then(Option::as_ref)
                .ok_or_else(|| Error::Shape {
                    op: OP,
                    detail: format!("expert {e} is not in the host store"),
                })?;
            let mut gathered = Vec::with_capacity(group.len() * width);
            for p in group.iter() {
                if p.row >= rows {
                    return Err(Error::Shape {
                        op: OP,
                        detail: format!("pair row {} of {rows}", p.row),
                    });
                }
                gathered.extend_from_slice(&x[p.row * width..(p.row + 1) * width]);
            }
            inputs.push(self.be.upload_f32(&[group.len(), width], &gathered)?);
            weights.push(w);
        }
        let items: Vec<_> = inputs.iter().zip(weights).collect();
        let ys = self.be.ffn_many(&items, act)?;
        // Summed per expert in id order, as one expert after another did.
        for (group, y) in groups.iter().zip(&ys) {
            let y = self.be.to_f32(y)?;
            for (p, y) in group.iter().zip(y.chunks_exact(out_width)) {
                let o = &mut out[p.row * out_width..(p.row + 1) * out_width];
                for (o, v) in o.iter_mut().zip(y) {
                    *o += p.weight * v;
                }
            }
        }
        Ok(out)
    }
}
