//! AWQ's scale groups (`quantized::awq::scale_groups`) must be folds that keep the model's
//! function: each group's readers take their input columns times `s` and its producer (a
//! norm's weight, or an up projection's rows) takes `1/s`. With powers of two every product
//! is the same number, so the logits must come out bit for bit:
//! * on the Kimi K3 fixture: AttnRes mixes feeding the input norms, gated MLA with its
//!   `q_a`/`kv_a` norms, LatentMoE's latent norm before its up-projection, the router
//!   compensated, SiTU everywhere (its up half is not linear, so no up→down group: folding
//!   one anyway must change the logits, the control that shows the check can fail);
//! * on a Kimi Linear fixture: the same norms and SwiGLU's up→down folds.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use kimi_core::DType;
use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_model::quantized::awq::{scale_groups, Prev, ScaleGroup};
use kimi_model::{
    Batch, CausalLm, CheckpointSource, ForwardOptions, KimiLinear, Result, WeightSource,
};
use kimi_ops::Segment;
use kimi_weights::Checkpoint;

/// A checkpoint with some tensors replaced by f32 values.
struct Scaled<'a> {
    inner: &'a dyn WeightSource,
    over: HashMap<String, Vec<f32>>,
}

impl WeightSource for Scaled<'_> {
    fn contains(&self, name: &str) -> bool {
        self.over.contains_key(name) || self.inner.contains(name)
    }
    fn load(&self, name: &str, shape: &[usize]) -> Result<(DType, Cow<'_, [u8]>)> {
        match self.over.get(name) {
            Some(v) => {
                assert_eq!(v.len(), shape.iter().product::<usize>(), "{name}");
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Ok((DType::F32, Cow::Owned(bytes)))
            }
            None => self.inner.load(name, shape),
        }
    }
    fn check_all_used(&self, _used: &HashSet<String>) -> Result<()> {
        // The plain load of the same checkpoint checks that (and skips K3's vision tensors).
        Ok(())
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }
}

fn f32_values(source: &dyn WeightSource, name: &str, shape: &[usize]) -> Vec<f32> {
    let (dtype, bytes) = source.load(name, shape).expect("tensor");
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        other => panic!("{name}: {other}"),
    }
}

/// Every group folded with scales that are powers of two (different per channel and group).
fn fold(
    source: &dyn WeightSource,
    shapes: &BTreeMap<String, Vec<usize>>,
    groups: &[ScaleGroup],
) -> HashMap<String, Vec<f32>> {
    let mut over: HashMap<String, Vec<f32>> = HashMap::new();
    let values = |name: &str, over: &mut HashMap<String, Vec<f32>>| -> Vec<f32> {
        over.remove(name)
            .unwrap_or_else(|| f32_values(source, name, &shapes[name]))
    };
    for (gi, g) in groups.iter().enumerate() {
        let k = *shapes[&g.linears[0]].last().expect("a matrix");
        let s: Vec<f32> = (0..k)
            .map(|c| [0.5f32, 2.0, 4.0, 0.25, 1.0][(c + gi) % 5])
            .collect();
        for name in g.linears.iter().chain(&g.compensate) {
            let mut v = values(name, &mut over);
            for row in v.chunks_exact_mut(k) {
                row.iter_mut().zip(&s).for_each(|(w, s)| *w *= s);
            }
            over.insert(name.clone(), v);
        }
        match &g.prev {
            Prev::Norm(name) => {
                let mut v = values(name, &mut over);
                v.iter_mut().zip(&s).for_each(|(w, s)| *w /= s);
                over.insert(name.clone(), v);
            }
            Prev::Linear(name) => {
                let mut v = values(name, &mut over);
                let cols = *shapes[name].last().expect("a matrix");
                for (row, s) in v.chunks_exact_mut(cols).zip(&s) {
                    row.iter_mut().for_each(|w| *w /= s);
                }
                over.insert(name.clone(), v);
            }
        }
    }
    over
}

fn logits(model: &KimiLinear<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let (mut pool, mut cache) = model.single_cache(ids.len()).expect("cache");
    let batch = Batch {
        tokens: ids.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: ids.len(),
        }],
        logits_rows: (0..ids.len()).collect(),
        sampling: None,
    };
    model
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .expect("forward")
        .logits
}

/// The fixture's logits as stored and with `groups(up_is_linear)` folded.
fn folded_logits(dir: &str, up_is_linear: bool) -> (Vec<f32>, Vec<f32>, Vec<ScaleGroup>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(dir);
    let ckpt = Checkpoint::open(&dir).expect("checkpoint");
    let config = ckpt.config().clone();
    let shapes: BTreeMap<String, Vec<usize>> = ckpt
        .tensor_names()
        .into_iter()
        .filter_map(|n| ckpt.shape(n).map(|s| (n.to_string(), s.to_vec())))
        .collect();
    // What `quantize` rounds: the layers' matrices, not the routers.
    let targets: HashSet<String> = shapes
        .iter()
        .filter(|(n, s)| {
            s.len() == 2
                && n.ends_with(".weight")
                && n.contains(".layers.")
                && !n.ends_with(".gate.weight")
        })
        .map(|(n, _)| n.clone())
        .collect();
    let groups = scale_groups(&shapes, &targets, config.hidden_size, up_is_linear);
    let source = CheckpointSource::new(&ckpt).expect("layout");
    let over = fold(&source, &shapes, &groups);
    let scaled = Scaled {
        inner: &source,
        over,
    };
    let backend = || CpuBackend::with_quant_matmul(QuantMatmul::F32);
    let vocab = config.vocab_size.min(900);
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 % vocab) as u32).collect();
    let plain = KimiLinear::load(backend(), &ckpt).expect("model");
    let folded = KimiLinear::load_from(backend(), config, &scaled).expect("folded model");
    (logits(&plain, &ids), logits(&folded, &ids), groups)
}

#[test]
fn k3_scale_groups_keep_the_function() {
    let (plain, folded, groups) = folded_logits("kimi-k3/k3-tiny-7l", false);
    let prev = |g: &ScaleGroup| match &g.prev {
        Prev::Norm(n) | Prev::Linear(n) => n.clone(),
    };
    for want in [
        "input_layernorm",
        "post_attention_layernorm",
        "q_a_layernorm",
        "kv_a_layernorm",
        "routed_expert_norm",
    ] {
        assert!(
            groups.iter().any(|g| prev(g).contains(want)),
            "no group after {want}: {groups:#?}"
        );
    }
    assert!(groups.iter().all(|g| matches!(g.prev, Prev::Norm(_))));
    assert!(groups.iter().any(|g| g
        .compensate
        .iter()
        .any(|n| n.ends_with("block_sparse_moe.gate.weight"))));
    let same = plain
        .iter()
        .zip(&folded)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "folding K3's scale groups changed the logits");

    // The control: SiTU's up half is not linear, so an up→down fold changes the function.
    let (plain, folded, _) = folded_logits("kimi-k3/k3-tiny-7l", true);
    let (num, den) = plain
        .iter()
        .zip(&folded)
        .fold((0f64, 0f64), |(n, d), (a, b)| {
            (n + ((a - b) as f64).powi(2), d + (*a as f64).powi(2))
        });
    assert!((num / den).sqrt() > 1e-4, "{}", (num / den).sqrt());
}

#[test]
fn kimi_linear_scale_groups_keep_the_function() {
    let (plain, folded, groups) = folded_logits("kimi-linear/hub-bf16-released-like", true);
    assert!(groups.iter().any(|g| matches!(g.prev, Prev::Linear(_))));
    let same = plain
        .iter()
        .zip(&folded)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same,
        "folding Kimi Linear's scale groups changed the logits"
    );
}
