//! The building blocks of a Kimi Linear decoder layer: weights, loading and forward.
//!
//! Tensor names are the hub checkpoint names of `shared/docs/kimi-linear-spec.md` §2; Kimi
//! K3's variants (`shared/docs/kimi-k3-spec.md` §2–§3: the full-rank KDA output gate and
//! padded `A_log`, the MLA output gate, SiTU, LatentMoE and MXFP4 experts) are options of
//! the same blocks, chosen by the config.

use std::collections::HashSet;

use kimi_core::config::{KdaConfig, KdaOutputGate, MlaConfig};
use kimi_core::DType;
use kimi_ops::offload::ExpertOffload;
use kimi_ops::{
    Backend, HostTensor, KdaMode, KdaStepInputs, KdaStepWeights, MlaDims, MlaMode, MlpWeights,
    PagedSeq, Segment,
};

use crate::source::{quantized_to_bf16, WeightSource};
use crate::Result;

/// `KIMI_WIDEN_QUANT=1`: see [`Loader::upload`].
pub(crate) fn widen_everywhere() -> bool {
    std::env::var("KIMI_WIDEN_QUANT").is_ok_and(|v| v == "1")
}

/// What a loaded matrix is used as, which decides whether the backend keeps its
/// block-quantized dtype ([`Backend::stores`] or [`Backend::stores_experts`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// Any weight but a routed expert's (dense layers, shared experts, projections).
    Weight,
    /// A routed expert's matrix, run by the backend's MoE kernels.
    Expert,
}

/// Loads tensors by name with shape checks, remembering which names were used.
pub(crate) struct Loader<'a, B: Backend> {
    pub backend: &'a B,
    pub source: &'a dyn WeightSource,
    pub used: HashSet<String>,
    /// Put before every name asked for (`language_model.` for Kimi K3's wrapper).
    pub prefix: &'static str,
    /// Where routed experts go when they do not all stay in the backend's memory.
    pub offload: Option<ExpertOffload>,
    /// MoE layers of the model (the offload's byte budgets are spread over them).
    pub moe_layers: usize,
    /// This rank's part of a split model (the source already cuts each tensor to it).
    pub shard: crate::parallel::Shard,
    /// Which rank holds which experts under expert parallelism.
    pub placement: Option<std::sync::Arc<crate::parallel::ExpertPlacement>>,
    /// How expert parallelism combines the routed experts' outputs.
    pub dispatch: crate::parallel::ExpertDispatch,
}

/// A matrix read into host memory as the backend's upload takes it (for the host tier of
/// offloaded experts).
pub(crate) struct HostMatrix {
    pub shape: [usize; 2],
    pub dtype: DType,
    pub bytes: Vec<u8>,
}

impl HostMatrix {
    pub fn tensor(&self) -> HostTensor<'_> {
        HostTensor {
            shape: &self.shape,
            dtype: self.dtype,
            bytes: &self.bytes,
        }
    }
}

impl<B: Backend> Loader<'_, B> {
    /// The stored name of `name`.
    pub fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Whether an optional tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(&self.full(name))
    }

    /// Loads `name` as stored, recording it as used.
    fn load(&mut self, name: &str, shape: &[usize]) -> Result<(String, DType, Vec<u8>)> {
        let full = self.full(name);
        let (dtype, bytes) = self.source.load(&full, shape)?;
        let bytes = bytes.into_owned();
        self.used.insert(full.clone());
        Ok((full, dtype, bytes))
    }

    pub fn get(&mut self, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        self.get_as(name, shape, Role::Weight)
    }

    /// A routed expert's matrix, as [`Loader::get`] but kept as the backend keeps routed
    /// experts ([`Loader::upload_expert`]).
    pub fn get_expert(&mut self, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        self.get_as(name, shape, Role::Expert)
    }

    fn get_as(&mut self, name: &str, shape: &[usize], role: Role) -> Result<B::Tensor> {
        let full = self.full(name);
        let (dtype, bytes) = self.source.load(&full, shape)?;
        self.used.insert(full.clone());
        let t = self.upload_as(&full, shape, dtype, &bytes, role)?;
        if let [rows, _] = shape {
            self.tap_weight(&t, &[(full, *rows)]);
        }
        Ok(t)
    }

    /// Names a loaded matrix to the calibration tap of this thread, if one is installed
    /// ([`kimi_ops::calibrate`]).
    fn tap_weight(&self, t: &B::Tensor, parts: &[(String, usize)]) {
        if let Some(tap) = kimi_ops::calibrate::tap() {
            if let Some(stored) = self.backend.host_view(t) {
                tap.weight(kimi_ops::calibrate::weight_key(&stored), parts);
            }
        }
    }

    /// A routed expert's matrix in host memory, as [`Loader::get_expert`] would upload it
    /// (widened to bf16 where the backend does not keep routed experts of its type).
    pub fn host_expert_matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<HostMatrix> {
        let (full, dtype, bytes) = self.load(name, &[rows, cols])?;
        self.host_stored(&full, [rows, cols], dtype, bytes, Role::Expert)
    }

    /// Whether a weight of `dtype` used as `role` is uploaded as stored rather than widened
    /// to bf16 on the host.
    fn keeps(&self, dtype: DType, role: Role) -> bool {
        if !dtype.is_quantized() {
            return true;
        }
        if widen_everywhere() {
            return false;
        }
        match role {
            Role::Weight => self.backend.stores(dtype),
            Role::Expert => self.backend.stores_experts(dtype),
        }
    }

    fn host_stored(
        &self,
        name: &str,
        shape: [usize; 2],
        dtype: DType,
        bytes: Vec<u8>,
        role: Role,
    ) -> Result<HostMatrix> {
        if self.keeps(dtype, role) {
            return Ok(HostMatrix {
                shape,
                dtype,
                bytes,
            });
        }
        let widened = quantized_to_bf16(dtype, &bytes, shape[0] * shape[1]).map_err(|e| {
            crate::ModelError::Input(format!("cannot widen {name} to bf16 for this backend: {e}"))
        })?;
        Ok(HostMatrix {
            shape,
            dtype: DType::BF16,
            bytes: widened,
        })
    }

    /// Uploads a weight as stored, or widened to bf16 where the backend has no kernels for
    /// its block-quantized type ([`Backend::stores`]): a GGUF file on CUDA. `KIMI_WIDEN_QUANT=1`
    /// widens on every backend, so that a CPU run sees the weights a CUDA run does.
    pub fn upload(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
    ) -> Result<B::Tensor> {
        self.upload_as(name, shape, dtype, bytes, Role::Weight)
    }

    /// Uploads a routed expert's matrix as [`Loader::upload`] does, but widened where the
    /// backend does not keep routed experts of its type ([`Backend::stores_experts`]: its
    /// MoE kernels may take fewer types than its matmuls).
    pub fn upload_expert(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
    ) -> Result<B::Tensor> {
        self.upload_as(name, shape, dtype, bytes, Role::Expert)
    }

    fn upload_as(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
        role: Role,
    ) -> Result<B::Tensor> {
        if self.keeps(dtype, role) {
            return Ok(self.backend.upload(HostTensor {
                shape,
                dtype,
                bytes,
            })?);
        }
        let widened = quantized_to_bf16(dtype, bytes, shape.iter().product()).map_err(|e| {
            crate::ModelError::Input(format!("cannot widen {name} to bf16 for this backend: {e}"))
        })?;
        Ok(self.backend.upload(HostTensor {
            shape,
            dtype: DType::BF16,
            bytes: &widened,
        })?)
    }

    /// Loads a tensor and keeps it in f32 on the backend whatever its stored dtype (the MoE
    /// router: its logits decide which experts run, so it runs in f32 as the reference does,
    /// and converting once here spares every forward pass a conversion).
    pub fn get_f32(&mut self, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        let full = self.full(name);
        let (dtype, bytes) = self.source.load(&full, shape)?;
        self.used.insert(full.clone());
        match float_values(dtype, &bytes) {
            Some(values) => Ok(self.backend.upload_f32(shape, &values)?),
            // Block-quantized routers stay as stored; the backend converts per call.
            None => self.upload(&full, shape, dtype, &bytes),
        }
    }

    /// The f32 values of a float tensor of `shape`, as stored, or an error naming it.
    pub fn values(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (full, dtype, bytes) = self.load(name, shape)?;
        float_values(dtype, &bytes).ok_or_else(|| {
            crate::ModelError::Input(format!(
                "tensor {full} is {dtype}; a float type (f32, f16, bf16) is needed"
            ))
        })
    }

    /// A KDA layer's `A_log` as the `[1, 1, H, 1]` f32 tensor the gate reads. Kimi Linear
    /// stores it so; Kimi K3 stores a `[N]` vector with N ≥ H whose first H entries are the
    /// per-head values and the rest zero padding (spec §2.2, §7 item 3).
    pub fn a_log(&mut self, name: &str, heads: usize) -> Result<B::Tensor> {
        let shape = self.source.shape(&self.full(name));
        let values = match shape.as_deref() {
            Some([n]) if *n >= heads => {
                let n = *n;
                let v = self.values(name, &[n])?;
                if let Some(i) = (heads..n).find(|&i| v[i] != 0.0) {
                    return Err(crate::ModelError::Input(format!(
                        "tensor {}: entry {i} is {} but entries {heads}.. of a padded A_log \
                         must be zero ({heads} heads)",
                        self.full(name),
                        v[i]
                    )));
                }
                v[..heads].to_vec()
            }
            Some([1, 1, h, 1]) if *h == heads => self.values(name, &[1, 1, heads, 1])?,
            Some(other) => {
                return Err(crate::ModelError::Input(format!(
                    "tensor {} has shape {other:?}; expected [1, 1, {heads}, 1] or [N] with \
                     N >= {heads} (per-head values, zero padding)",
                    self.full(name)
                )))
            }
            None => self.values(name, &[1, 1, heads, 1])?,
        };
        Ok(self.backend.upload_f32(&[1, 1, heads, 1], &values)?)
    }

    /// A routed expert's MXFP4 matrix `[rows, cols]` from its two planes
    /// `{name}.weight_packed` (U8 `[rows, cols/2]`) and `{name}.weight_scale` (U8 or
    /// F8_E8M0 `[rows, cols/32]`), repacked into ggml MXFP4 blocks (4.25 bits per weight,
    /// values unchanged); kept as the backend keeps routed experts
    /// ([`Loader::upload_expert`]).
    pub fn mxfp4(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Tensor> {
        let m = self.host_mxfp4(name, rows, cols)?;
        self.upload_expert(&self.full(name), &m.shape, m.dtype, &m.bytes)
    }

    /// [`Loader::mxfp4`]'s blocks in host memory.
    pub fn host_mxfp4(&mut self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix> {
        let bad = |what: String| crate::ModelError::Input(what);
        if !cols.is_multiple_of(32) {
            return Err(bad(format!(
                "{}: MXFP4 rows of {cols} values are not whole 32-value blocks",
                self.full(name)
            )));
        }
        let (codes_name, codes_type, codes) =
            self.load(&format!("{name}.weight_packed"), &[rows, cols / 2])?;
        let (scales_name, scales_type, scales) =
            self.load(&format!("{name}.weight_scale"), &[rows, cols / 32])?;
        let blocks = mxfp4_blocks(
            (&codes_name, codes_type, &codes),
            (&scales_name, scales_type, &scales),
            rows,
            cols,
        )?;
        self.host_stored(
            &codes_name,
            [rows, cols],
            DType::MXFP4,
            blocks,
            Role::Expert,
        )
    }

    /// The matrices `names` (each `[rows_i, cols]`) stacked by rows into one
    /// `[Σ rows_i, cols]` matrix when they share a dtype, so that one matmul reads the input
    /// once for all of them; else each alone.
    pub fn stacked(
        &mut self,
        names: &[(String, usize)],
        cols: usize,
    ) -> Result<Stacked<B::Tensor>> {
        let names: Vec<(String, usize)> = names.iter().map(|(n, r)| (self.full(n), *r)).collect();
        let mut parts = Vec::with_capacity(names.len());
        for (name, rows) in &names {
            parts.push(self.source.load(name, &[*rows, cols])?);
            self.used.insert(name.clone());
        }
        let rows: Vec<usize> = names.iter().map(|(_, r)| *r).collect();
        let dtype = parts[0].0;
        if parts.iter().all(|(d, _)| *d == dtype) {
            let bytes: Vec<u8> = parts.iter().flat_map(|(_, b)| b.iter().copied()).collect();
            let shape = [rows.iter().sum(), cols];
            let w = self.upload(&names[0].0, &shape, dtype, &bytes)?;
            self.tap_weight(&w, &names);
            return Ok(Stacked::One(w, rows));
        }
        let mut each = Vec::with_capacity(parts.len());
        for (((dtype, bytes), rows), (name, _)) in parts.iter().zip(&rows).zip(&names) {
            let w = self.upload(name, &[*rows, cols], *dtype, bytes)?;
            self.tap_weight(&w, &[(name.clone(), *rows)]);
            each.push(w);
        }
        Ok(Stacked::Each(each))
    }

    pub fn mlp(
        &mut self,
        prefix: &str,
        names: [&str; 3],
        hidden: usize,
        width: usize,
    ) -> Result<MlpWeights<B::Tensor>> {
        Ok(MlpWeights {
            gate: self.get(&format!("{prefix}.{}.weight", names[0]), &[width, hidden])?,
            up: self.get(&format!("{prefix}.{}.weight", names[1]), &[width, hidden])?,
            down: self.get(&format!("{prefix}.{}.weight", names[2]), &[hidden, width])?,
        })
    }
}

/// The f32 values of a float tensor's bytes; `None` for other dtypes.
fn float_values(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Matrices that multiply the same input: stacked by rows into one (one read of the input,
/// one launch on a GPU) or, where their dtypes differ, kept apart.
pub(crate) enum Stacked<T> {
    /// `[Σ rows, cols]` and each part's rows.
    One(T, Vec<usize>),
    Each(Vec<T>),
}

impl<T> Stacked<T> {
    /// `x · wᵢᵀ` for every part, in order.
    pub fn matmul<B: Backend<Tensor = T>>(&self, be: &B, x: &T) -> Result<Vec<T>> {
        match self {
            Stacked::One(w, rows) => Ok(be.matmul_split(x, w, rows)?),
            Stacked::Each(ws) => ws.iter().map(|w| Ok(be.matmul(x, w)?)).collect(),
        }
    }
}

/// KDA mixer weights.
pub(crate) struct KdaLayer<T> {
    /// q, k, v, f_a, g_a and b projections of the layer input (see [`KdaLayer::project`]).
    input_proj: Stacked<T>,
    conv: [T; 3],
    f_b: T,
    a_log: T,
    dt_bias: T,
    /// The low-rank output gate's up-projection; `None` where the input projection holds a
    /// full-rank `g_proj` (Kimi K3) whose product is the gate itself.
    g_b: Option<T>,
    o_norm: T,
    o: T,
}

/// What [`KdaLayer::project`] returns: q, k, v before the convolutions, the forget-gate
/// pre-activation f, the β logits and the output gate z.
struct KdaProjections<T> {
    qkv: [T; 3],
    f: T,
    beta_logits: T,
    z: T,
}

impl<T> KdaLayer<T> {
    pub fn load<B: Backend<Tensor = T>>(
        ld: &mut Loader<'_, B>,
        p: &str,
        hidden: usize,
        c: &KdaConfig,
    ) -> Result<Self> {
        let (h, d, w) = (c.num_heads, c.head_dim, c.conv_kernel);
        let width = h * d;
        let gate = match c.output_gate {
            KdaOutputGate::LowRank => (format!("{p}.g_a_proj.weight"), d),
            KdaOutputGate::FullRank => (format!("{p}.g_proj.weight"), width),
        };
        let input_proj = ld.stacked(
            &[
                (format!("{p}.q_proj.weight"), width),
                (format!("{p}.k_proj.weight"), width),
                (format!("{p}.v_proj.weight"), width),
                (format!("{p}.f_a_proj.weight"), d),
                gate,
                (format!("{p}.b_proj.weight"), h),
            ],
            hidden,
        )?;
        let g_b = match c.output_gate {
            KdaOutputGate::LowRank => Some(ld.get(&format!("{p}.g_b_proj.weight"), &[width, d])?),
            KdaOutputGate::FullRank => None,
        };
        Ok(Self {
            input_proj,
            conv: [
                ld.get(&format!("{p}.q_conv1d.weight"), &[width, 1, w])?,
                ld.get(&format!("{p}.k_conv1d.weight"), &[width, 1, w])?,
                ld.get(&format!("{p}.v_conv1d.weight"), &[width, 1, w])?,
            ],
            f_b: ld.get(&format!("{p}.f_b_proj.weight"), &[width, d])?,
            a_log: ld.a_log(&format!("{p}.A_log"), h)?,
            dt_bias: ld.get(&format!("{p}.dt_bias"), &[width])?,
            g_b,
            o_norm: ld.get(&format!("{p}.o_norm.weight"), &[d])?,
            o: ld.get(&format!("{p}.o_proj.weight"), &[hidden, width])?,
        })
    }

    /// The projections of the normalised layer input `x [n, hidden]`.
    fn project<B: Backend<Tensor = T>>(&self, be: &B, x: &T) -> Result<KdaProjections<T>> {
        let mut parts = self.input_proj.matmul(be, x)?.into_iter();
        let mut next = || {
            parts
                .next()
                .ok_or_else(|| crate::forward::input("KDA projections"))
        };
        let (q, k, v, f_a, g, b) = (next()?, next()?, next()?, next()?, next()?, next()?);
        let (f, z) = match &self.g_b {
            Some(g_b) => be.matmul_pair((&f_a, &self.f_b), (&g, g_b))?,
            None => (be.matmul(&f_a, &self.f_b)?, g),
        };
        Ok(KdaProjections {
            qkv: [q, k, v],
            f,
            beta_logits: b,
            z,
        })
    }

    /// `x` is the normalised layer input `[n, hidden]`; `caches[s]` is segment `s`'s KDA
    /// state slot (convolution windows and recurrent state).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        c: &KdaConfig,
        eps: f32,
        segments: &[Segment],
        caches: &mut [(&mut [T; 3], &mut T)],
        mode: KdaMode,
    ) -> Result<T> {
        // Decode (one token per sequence): one fused step where the backend has one. Forced
        // chunked mode keeps the separate ops so tests can drive the chunked kernels.
        let decode =
            !segments.is_empty() && segments.iter().all(|s| s.len == 1) && mode != KdaMode::Chunked;
        let p = self.project(be, x)?;
        if decode {
            let inputs = KdaStepInputs {
                qkv: [&p.qkv[0], &p.qkv[1], &p.qkv[2]],
                f: &p.f,
                beta_logits: &p.beta_logits,
                z: &p.z,
            };
            let weights = KdaStepWeights {
                conv: [&self.conv[0], &self.conv[1], &self.conv[2]],
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
                o_norm: &self.o_norm,
                gate: c.gate,
                eps,
            };
            let y = be.kda_decode(&inputs, &weights, c.num_heads, segments, caches)?;
            return Ok(be.matmul(&y, &self.o)?);
        }
        let mut streams = Vec::with_capacity(3);
        for (i, pre) in p.qkv.iter().enumerate() {
            let mut states: Vec<&mut T> = caches.iter_mut().map(|(conv, _)| &mut conv[i]).collect();
            streams.push(be.short_conv_silu(pre, &self.conv[i], segments, &mut states)?);
        }
        let g = be.kda_gate(&p.f, &self.a_log, &self.dt_bias, c.num_heads, c.gate)?;
        let beta = be.sigmoid(&p.beta_logits)?;
        let z = p.z;
        let mut states: Vec<&mut T> = caches.iter_mut().map(|(_, s)| &mut **s).collect();
        let o = be.kda(
            &streams[0],
            &streams[1],
            &streams[2],
            &g,
            &beta,
            c.num_heads,
            segments,
            &mut states,
            mode,
        )?;
        let y = be.gated_rms_norm(&o, &z, &self.o_norm, eps)?;
        Ok(be.matmul(&y, &self.o)?)
    }
}

/// How MLA forms its queries.
enum QueryProj<T> {
    /// A full `q_proj` (Kimi Linear).
    Full(T),
    /// q-LoRA: `q_b_proj(RMSNorm(q_a_proj(x)))` (Kimi K2/K3).
    LowRank { a: T, norm: T, b: T },
}

/// MLA mixer weights.
pub(crate) struct MlaLayer<T> {
    q: QueryProj<T>,
    kv_a: T,
    kv_a_norm: T,
    kv_b: T,
    /// Output gate `g_proj [H*v, hidden]` (Kimi K3), applied as `o ⊙ sigmoid(g_proj(x))`.
    gate: Option<T>,
    o: T,
}

impl<T> MlaLayer<T> {
    pub fn load<B: Backend<Tensor = T>>(
        ld: &mut Loader<'_, B>,
        p: &str,
        hidden: usize,
        c: &MlaConfig,
    ) -> Result<Self> {
        let h = c.num_heads;
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let q = match c.q_lora_rank {
            None => QueryProj::Full(ld.get(&format!("{p}.q_proj.weight"), &[h * qk, hidden])?),
            Some(rank) => QueryProj::LowRank {
                a: ld.get(&format!("{p}.q_a_proj.weight"), &[rank, hidden])?,
                norm: ld.get(&format!("{p}.q_a_layernorm.weight"), &[rank])?,
                b: ld.get(&format!("{p}.q_b_proj.weight"), &[h * qk, rank])?,
            },
        };
        Ok(Self {
            q,
            kv_a: ld.get(
                &format!("{p}.kv_a_proj_with_mqa.weight"),
                &[c.kv_lora_rank + c.qk_rope_head_dim, hidden],
            )?,
            kv_a_norm: ld.get(&format!("{p}.kv_a_layernorm.weight"), &[c.kv_lora_rank])?,
            kv_b: ld.get(
                &format!("{p}.kv_b_proj.weight"),
                &[h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank],
            )?,
            gate: match c.output_gate {
                true => Some(ld.get(&format!("{p}.g_proj.weight"), &[h * c.v_head_dim, hidden])?),
                false => None,
            },
            o: ld.get(&format!("{p}.o_proj.weight"), &[hidden, h * c.v_head_dim])?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend<Tensor = T>>(
        &self,
        be: &B,
        x: &T,
        c: &MlaConfig,
        segments: &[Segment],
        pool: &mut T,
        seqs: &[PagedSeq<'_>],
        mode: MlaMode,
    ) -> Result<T> {
        let q = match &self.q {
            QueryProj::Full(w) => be.matmul(x, w)?,
            QueryProj::LowRank { a, norm, b } => {
                let low = be.rms_norm(&be.matmul(x, a)?, norm, c.latent_norm_eps)?;
                be.matmul(&low, b)?
            }
        };
        let parts = be.matmul_split(x, &self.kv_a, &[c.kv_lora_rank, c.qk_rope_head_dim])?;
        let latent_c = be.rms_norm(&parts[0], &self.kv_a_norm, c.latent_norm_eps)?;
        let latent = be.concat_cols(&[&latent_c, &parts[1]])?;
        let dims = MlaDims {
            num_heads: c.num_heads,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            scale: ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5),
        };
        let mut o = be.mla(&q, &latent, &self.kv_b, &dims, segments, pool, seqs, mode)?;
        if let Some(g) = &self.gate {
            // The gate reads the layer's normalised input, not the attention output.
            o = be.sigmoid_gate(&o, &be.matmul(x, g)?)?;
        }
        Ok(be.matmul(&o, &self.o)?)
    }
}

/// ggml MXFP4 blocks `[rows, cols / 32 × 17 bytes]` from a matrix's two checkpoint planes,
/// each `(name, dtype, bytes)`: U8 codes `[rows, cols / 2]` (column `2i` in the low nibble of
/// byte `i`) and U8/E8M0 scales `[rows, cols / 32]`. The values are unchanged; E8M0's NaN
/// (255) is refused with the tensor, row and block named rather than run into NaNs.
pub(crate) fn mxfp4_blocks(
    (codes_name, codes_type, codes): (&str, DType, &[u8]),
    (scales_name, scales_type, scales): (&str, DType, &[u8]),
    rows: usize,
    cols: usize,
) -> Result<Vec<u8>> {
    let bad = |what: String| crate::ModelError::Input(what);
    if codes_type != DType::U8 {
        return Err(bad(format!(
            "tensor {codes_name} is {codes_type}; MXFP4 codes are U8"
        )));
    }
    if !matches!(scales_type, DType::U8 | DType::E8M0) {
        return Err(bad(format!(
            "tensor {scales_name} is {scales_type}; MXFP4 scales are U8 or F8_E8M0"
        )));
    }
    let blocks = cols / 32;
    if let Some(i) = scales.iter().position(|&e| e == 255) {
        return Err(bad(format!(
            "tensor {scales_name}: row {}, block {} holds the E8M0 NaN scale 255",
            i / blocks,
            i % blocks
        )));
    }
    let mut out = vec![0u8; rows * blocks * 17];
    for ((row, c), s) in out
        .chunks_exact_mut(blocks * 17)
        .zip(codes.chunks_exact(cols / 2))
        .zip(scales.chunks_exact(blocks))
    {
        kimi_gguf::mxfp4::from_planes(c, s, row);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::collections::{HashMap, HashSet};

    use kimi_core::DType;
    use kimi_cpu::CpuBackend;
    use kimi_ops::Backend;

    use super::{Loader, Role};
    use crate::source::WeightSource;

    struct Mem(HashMap<String, (DType, Vec<u8>)>);

    impl WeightSource for Mem {
        fn contains(&self, name: &str) -> bool {
            self.0.contains_key(name)
        }
        fn load(&self, name: &str, _shape: &[usize]) -> crate::Result<(DType, Cow<'_, [u8]>)> {
            let (dtype, bytes) = &self.0[name];
            Ok((*dtype, Cow::Borrowed(bytes)))
        }
        fn check_all_used(&self, _used: &HashSet<String>) -> crate::Result<()> {
            Ok(())
        }
    }

    /// One Q8_0 block: scale 0.5 (f16), codes -16..16.
    fn q8_0_block() -> Vec<u8> {
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((-16i8..16).map(|v| v as u8));
        b
    }

    /// The CPU backend keeps routed experts as it keeps every other weight
    /// ([`Backend::stores_experts`] defaults to [`Backend::stores`]): packed Q8_0 experts
    /// load packed, through the device and the host-tier paths alike. (A backend that keeps
    /// fewer expert types, CUDA's, is checked by its own loads; the test has no such backend.)
    #[test]
    fn cpu_keeps_routed_experts_as_it_keeps_other_weights() {
        if super::widen_everywhere() {
            return;
        }
        let be = CpuBackend::new();
        let block = q8_0_block();
        let source = Mem(HashMap::from([
            ("dense".to_string(), (DType::Q8_0, block.clone())),
            ("expert".to_string(), (DType::Q8_0, block.clone())),
        ]));
        let mut ld = Loader {
            backend: &be,
            source: &source,
            used: HashSet::new(),
            prefix: "",
            offload: None,
            moe_layers: 1,
            shard: crate::parallel::Shard::SINGLE,
            placement: None,
            dispatch: crate::parallel::ExpertDispatch::AllReduce,
        };
        for dtype in [DType::Q8_0, DType::Q4_K, DType::MXFP4, DType::BF16] {
            assert_eq!(be.stores_experts(dtype), be.stores(dtype), "{dtype}");
            assert!(ld.keeps(dtype, Role::Expert), "{dtype}");
            assert!(ld.keeps(dtype, Role::Weight), "{dtype}");
        }
        let dense = ld.get("dense", &[1, 32]).unwrap();
        let expert = ld.get_expert("expert", &[1, 32]).unwrap();
        let host = ld.host_expert_matrix("expert", 1, 32).unwrap();
        assert_eq!((host.dtype, &host.bytes), (DType::Q8_0, &block));
        assert_eq!(be.size_bytes(&expert), block.len());
        assert_eq!(be.size_bytes(&dense), block.len());
        let want: Vec<f32> = (-16..16).map(|v| v as f32 * 0.5).collect();
        assert_eq!(be.to_f32(&expert).unwrap(), want);
        let uploaded = ld
            .upload_expert("expert", &host.shape, host.dtype, &host.bytes)
            .unwrap();
        assert_eq!(be.to_f32(&uploaded).unwrap(), want);
    }
}
