//! Llama-architecture GGUF models on the CPU backend.
//!
//! The demo-model tests run SmolLM2-135M-Instruct Q4_1 (`scripts/fetch_demo_model.sh`
//! puts it in `models/`) against the golden token ids of `shared/docs/demo-model.md`
//! (a NumPy reference forward pass); they print a notice and pass when the file is absent.
//! The other tests build a tiny random Llama GGUF in memory.

use std::path::{Path, PathBuf};

use kimi_cpu::{CpuBackend, QuantMatmul};
use kimi_gguf::{GgmlType, GgufFile, GgufWriter, Value};
use kimi_model::{
    Batch, CausalLm, ForwardOptions, LayerPool, Llama, LlamaConfig, ModelError, SeqCache,
};
use kimi_ops::{Backend, HostTensor, Segment};
use kimi_tokenizer::Tokenizer;

const RAW_PROMPT_IDS: [u32; 4] = [6403, 1980, 253, 655];
const RAW_GOLDEN: [u32; 24] = [
    28, 260, 2240, 282, 23324, 27108, 436, 253, 15114, 39228, 28, 351, 25854, 41658, 284, 14055,
    9018, 30, 1249, 347, 260, 929, 3514, 411,
];
const CHAT_PROMPT_IDS: [u32; 37] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];
const CHAT_GOLDEN: [u32; 7] = [504, 3575, 282, 4649, 314, 7042, 30];
const IM_END: u32 = 2;

/// The raw prompt's golden continuation as far as the demo-model tests follow it: all of it,
/// or its first ten ids under qemu (`KIMI_TEST_EMULATED`, scripts/arm/test.sh), where each
/// step runs about a hundred times slower: the same kernels over fewer steps.
fn raw_golden() -> &'static [u32] {
    if std::env::var_os("KIMI_TEST_EMULATED").is_some() {
        &RAW_GOLDEN[..10]
    } else {
        &RAW_GOLDEN
    }
}

fn demo_model_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The demo model, or `None` (with a notice) when it has not been fetched.
fn demo_model() -> Option<GgufFile> {
    let path = demo_model_path();
    if !path.exists() {
        eprintln!(
            "SKIPPED: {} is absent; run scripts/fetch_demo_model.sh to fetch the demo model",
            path.display()
        );
        return None;
    }
    Some(GgufFile::open(&path).expect("the demo model opens"))
}

fn one_segment(tokens: &[u32]) -> Batch {
    Batch {
        tokens: tokens.to_vec(),
        segments: vec![Segment {
            start: 0,
            len: tokens.len(),
        }],
        logits_rows: vec![tokens.len() - 1],
        sampling: None,
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let best = logits
        .iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > logits[best] { i } else { best });
    best as u32
}

/// Greedy decoding through the [`CausalLm`] interface: prefill, then one token at a time,
/// stopping after `max_tokens` or at an end-of-sequence id.
fn greedy(model: &dyn CausalLm<CpuBackend>, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let (mut pool, mut cache) = model
        .single_cache(prompt.len() + max_tokens)
        .expect("cache");
    let mut out = Vec::new();
    let mut tokens = prompt.to_vec();
    while out.len() < max_tokens {
        let logits = model
            .forward(
                &one_segment(&tokens),
                &mut pool,
                &mut [&mut cache],
                ForwardOptions::default(),
            )
            .expect("forward")
            .logits;
        let next = argmax(&logits);
        out.push(next);
        if model.eos_token_ids().contains(&next) {
            break;
        }
        tokens = vec![next];
    }
    assert_eq!(cache.num_tokens, prompt.len() + out.len() - 1);
    out
}

#[test]
fn demo_model_config_matches_its_metadata() {
    let Some(file) = demo_model() else { return };
    let c = LlamaConfig::from_gguf(&file).unwrap();
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (30, 576, 1536)
    );
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!((c.vocab_size, c.max_context), (49152, 8192));
    assert_eq!((c.rope_theta, c.rms_norm_eps), (100_000.0, 1e-5));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.eos_token_ids, [IM_END]);
}

#[test]
fn demo_tokenizer_gives_the_golden_prompt_ids() {
    let Some(file) = demo_model() else { return };
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(
        tok.encode("Once upon a time", false).unwrap(),
        RAW_PROMPT_IDS
    );
    let template = tok.chat_template().expect("the GGUF has a chat template");
    let messages =
        [serde_json::json!({"role": "user", "content": "What is the capital of France?"})];
    let prompt = template.render(&messages, None, true).unwrap();
    assert!(prompt.starts_with(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    ));
    let ids = tok.encode(&prompt, true).unwrap();
    assert_eq!(ids, CHAT_PROMPT_IDS);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids().first(), Some(&IM_END));
    assert!(tok.is_special(IM_END) && !tok.is_special(6403));
    // Every digit is its own piece (the smollm pre-tokenizer).
    let digits = tok.encode("2024", false).unwrap();
    assert_eq!(digits.len(), 4);
    assert_eq!(tok.decode(&digits, false).unwrap(), "2024");
}

/// The golden ids come from an f32 reference, so they are checked on the f32 matmul path
/// (`QuantMatmul::F32`); the int8 default can flip near-ties (see the next test).
#[test]
fn demo_model_greedy_continuations_match_the_golden_ids() {
    let Some(file) = demo_model() else { return };
    let model = Llama::load(CpuBackend::with_quant_matmul(QuantMatmul::F32), &file).unwrap();
    let raw = greedy(&model, &RAW_PROMPT_IDS, raw_golden().len());
    assert_eq!(raw[..10], RAW_GOLDEN[..10], "first ten ids");
    assert_eq!(raw, raw_golden());
    let chat = greedy(&model, &CHAT_PROMPT_IDS, 16);
    assert_eq!(chat[..CHAT_GOLDEN.len()], CHAT_GOLDEN);
    assert_eq!(chat[CHAT_GOLDEN.len()..], [IM_END]);
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(
        tok.decode(&chat, true).unwrap(),
        "The capital of France is Paris."
    );
}

/// Prefill, decode and a two-sequence batch give the same logits on the real weights (f32
/// matmul path; the int8 path is compared with it in the next test).
#[test]
fn demo_model_prefill_decode_and_batches_agree() {
    let Some(file) = demo_model() else { return };
    let model = Llama::load(CpuBackend::with_quant_matmul(QuantMatmul::F32), &file).unwrap();
    check_feed_modes_agree(&model, &CHAT_PROMPT_IDS[..12], &RAW_PROMPT_IDS, 1e-3);
}

/// Logits after prefilling `prompt` and then after each token of `continuation` fed one at
/// a time (the decode path), teacher-forced: `continuation.len()` rows.
fn decode_logits(model: &Llama<CpuBackend>, prompt: &[u32], continuation: &[u32]) -> Vec<Vec<f32>> {
    let opts = ForwardOptions::default();
    let (mut pool, mut cache) = model
        .single_cache(prompt.len() + continuation.len())
        .unwrap();
    let mut rows = vec![
        model
            .forward(&one_segment(prompt), &mut pool, &mut [&mut cache], opts)
            .unwrap()
            .logits,
    ];
    for &id in &continuation[..continuation.len() - 1] {
        rows.push(
            model
                .forward(&one_segment(&[id]), &mut pool, &mut [&mut cache], opts)
                .unwrap()
                .logits,
        );
    }
    rows
}

/// Largest difference, over the whole vocabulary, allowed between the int8 and the f32
/// paths' logits. Rounding the activations to 8 bits (half a step of 1/127 of each
/// 32-value block's largest value) in all 211 matmuls of a decode step moved these logits
/// by at most 1.13 while the prompt still ran in f32 (0.26–1.13 per position, on logits of
/// magnitude ~20). Since the prompt runs on the integer kernels too where the weights are
/// interleaved (AVX2 or AVX-512 VNNI), its keys and values carry the same rounding: at most 1.52
/// measured; the bound leaves 1.3× that. The int8 mode also keeps keys and values in f16
/// (1.29 → 1.45 on an AVX2 machine with it). Greedy ids are held to a sharper check below.
const INT8_LOGIT_TOLERANCE: f32 = 2.0;

/// Greedy ids the int8 path may pick differently from the f32 one over the 31 teacher-forced
/// positions of both prompts. Only positions whose f32 margin (best minus second-best
/// logit) is within twice that position's largest logit difference can flip at all (checked
/// below); two such flip, both also flipped by llama.cpp's int8 products (`BENCHMARKS.md`):
/// the chat prompt's first answer token (margin 0.082, logits moved by up to 1.0) and the
/// raw prompt's fifth token (margin 0.16, moved by up to 0.9; it flips with the AVX2
/// kernels' order of float additions and not with the AVX-512 VNNI kernels'). A kernel
/// change that flips more needs a look.
const MAX_GREEDY_FLIPS: usize = 2;

/// The default (int8-activation) decode path against the f32 one, teacher-forced on the
/// golden continuations: every logit within [`INT8_LOGIT_TOLERANCE`], the same greedy id
/// wherever the logit differences cannot reorder the two best tokens, and at most
/// [`MAX_GREEDY_FLIPS`] other ids. The chat prompt's first answer token flips, as llama.cpp's
/// does, which is why the golden-id test runs the f32 path. Batching two decode steps gives
/// exactly the logits of each step alone.
#[test]
fn demo_model_int8_decode_stays_close_to_the_f32_path() {
    let Some(file) = demo_model() else { return };
    let exact = Llama::load(CpuBackend::with_quant_matmul(QuantMatmul::F32), &file).unwrap();
    let fast = Llama::load(CpuBackend::new(), &file).unwrap();
    let mut worst = 0f32;
    let mut flips = Vec::new();
    for (prompt, golden) in [
        (&RAW_PROMPT_IDS[..], raw_golden()),
        (&CHAT_PROMPT_IDS[..], &CHAT_GOLDEN[..]),
    ] {
        let want = decode_logits(&exact, prompt, golden);
        let got = decode_logits(&fast, prompt, golden);
        for (pos, (w, g)) in want.iter().zip(&got).enumerate() {
            let diff = w.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff);
            assert!(
                diff <= INT8_LOGIT_TOLERANCE,
                "position {pos}: logits differ by {diff}"
            );
            let best = argmax(w);
            let runner_up = w
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != best as usize)
                .fold(f32::MIN, |m, (_, v)| m.max(*v));
            let margin = w[best as usize] - runner_up;
            if argmax(g) != best {
                // No logit moved by more than `diff`: a wider margin cannot flip.
                assert!(
                    margin <= 2.0 * diff,
                    "position {pos}: flipped at margin {margin}, logits moved by {diff}"
                );
                flips.push((pos, margin));
            }
        }
    }
    assert!(
        flips.len() <= MAX_GREEDY_FLIPS,
        "greedy ids flipped at (position, f32 margin) {flips:?}"
    );
    eprintln!("largest int8 - f32 logit difference: {worst}");

    // Two sequences decoding in one batch: each row equals its step alone, bit for bit.
    let opts = ForwardOptions::default();
    let alone = |prompt: &[u32], id: u32| {
        let (mut pool, mut cache) = fast.single_cache(prompt.len() + 1).unwrap();
        fast.forward(&one_segment(prompt), &mut pool, &mut [&mut cache], opts)
            .unwrap();
        fast.forward(&one_segment(&[id]), &mut pool, &mut [&mut cache], opts)
            .unwrap()
            .logits
    };
    // Both sequences in one pool, each with its own blocks and slot.
    let bs = kimi_model::SINGLE_BLOCK_SIZE;
    let per = (RAW_PROMPT_IDS.len().max(CHAT_PROMPT_IDS.len()) + 2).div_ceil(bs) as u32;
    let mut pool = fast.new_pool(2 * per as usize, bs, 2).unwrap();
    let mut ca = SeqCache::new(0, (0..per).collect());
    let mut cb = SeqCache::new(1, (per..2 * per).collect());
    fast.forward(
        &one_segment(&RAW_PROMPT_IDS),
        &mut pool,
        &mut [&mut ca],
        opts,
    )
    .unwrap();
    fast.forward(
        &one_segment(&CHAT_PROMPT_IDS),
        &mut pool,
        &mut [&mut cb],
        opts,
    )
    .unwrap();
    let batch = Batch {
        tokens: vec![RAW_GOLDEN[0], CHAT_GOLDEN[0]],
        segments: vec![Segment { start: 0, len: 1 }, Segment { start: 1, len: 1 }],
        logits_rows: vec![0, 1],
        sampling: None,
    };
    let both = fast
        .forward(&batch, &mut pool, &mut [&mut ca, &mut cb], opts)
        .unwrap()
        .logits;
    let vocab = fast.vocab_size();
    assert_eq!(both[..vocab], alone(&RAW_PROMPT_IDS, RAW_GOLDEN[0]));
    assert_eq!(both[vocab..], alone(&CHAT_PROMPT_IDS, CHAT_GOLDEN[0]));
}

/// The two quantized types of the demo model read back sanely, and the CPU backend's
/// quantized matmul equals a plain product with the dequantized weights.
#[test]
fn demo_model_quantized_tensors_are_sane() {
    let Some(file) = demo_model() else { return };
    let be = CpuBackend::with_quant_matmul(QuantMatmul::F32);
    for (name, ty) in [
        ("blk.0.attn_q.weight", GgmlType::Q4_1),
        ("token_embd.weight", GgmlType::Q8_0),
    ] {
        let t = file.tensor(name).unwrap();
        assert_eq!(t.info.ggml_type, ty, "{name}");
        let shape = t.info.shape_outer_first();
        let values = t.to_f32().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "{name}");
        let mean_square = values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32;
        let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            mean_square > 1e-6 && max < 50.0,
            "{name}: rms {} max {max}",
            mean_square.sqrt()
        );
        let dtype = match ty {
            GgmlType::Q4_1 => kimi_core::DType::Q4_1,
            _ => kimi_core::DType::Q8_0,
        };
        let w = be
            .upload(HostTensor {
                shape: &shape,
                dtype,
                bytes: t.bytes,
            })
            .unwrap();
        assert_eq!(be.size_bytes(&w), t.bytes.len());
        assert_eq!(be.to_f32(&w).unwrap(), values);
        let cols = shape[1];
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
            .collect();
        let y = be
            .to_f32(
                &be.matmul(&be.upload_f32(&[2, cols], &x).unwrap(), &w)
                    .unwrap(),
            )
            .unwrap();
        for row in [0, 1, shape[0] / 2, shape[0] - 1] {
            for t in 0..2 {
                let want: f64 = (0..cols)
                    .map(|i| f64::from(x[t * cols + i]) * f64::from(values[row * cols + i]))
                    .sum();
                let got = f64::from(y[t * shape[0] + row]);
                assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "{name}");
            }
        }
        // The int8 path: off by at most the activations' rounding, half a step (the block's
        // largest |x| / 127) per value.
        let fast = CpuBackend::new();
        let w8 = fast
            .upload(HostTensor {
                shape: &shape,
                dtype,
                bytes: t.bytes,
            })
            .unwrap();
        let y8 = fast
            .to_f32(
                &fast
                    .matmul(&fast.upload_f32(&[2, cols], &x).unwrap(), &w8)
                    .unwrap(),
            )
            .unwrap();
        for row in [0, 1, shape[0] / 2, shape[0] - 1] {
            for t in 0..2 {
                let xt = &x[t * cols..(t + 1) * cols];
                let wr = &values[row * cols..(row + 1) * cols];
                let want: f64 = xt.iter().zip(wr).map(|(a, b)| f64::from(a * b)).sum();
                let bound: f64 = (0..cols)
                    .map(|i| {
                        let block = &xt[i / 32 * 32..i / 32 * 32 + 32];
                        let step = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                        f64::from(wr[i].abs() * step) / 2.0
                    })
                    .sum();
                let got = f64::from(y8[t * shape[0] + row]);
                assert!(
                    (got - want).abs() <= bound * (1.0 + 1e-5) + 1e-4 * (1.0 + want.abs()),
                    "{name} int8: {got} vs {want} (bound {bound})"
                );
            }
        }
    }
}

// --- A tiny random Llama GGUF, built in memory -------------------------------------------

const TINY_VOCAB: usize = 40;
const TINY_HIDDEN: usize = 256;
const TINY_FFN: usize = 256;
const TINY_HEADS: usize = 4;
const TINY_KV_HEADS: usize = 2;
const TINY_CONTEXT: u32 = 64;

/// Deterministic values in ±`scale`.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// How to spoil the tiny GGUF for the error tests.
#[derive(Default)]
struct Spoil {
    arch: Option<&'static str>,
    /// A tensor stored with its dimensions swapped.
    transposed: Option<&'static str>,
    /// An extra tensor the model does not use.
    extra_tensor: bool,
    /// A metadata value replaced.
    meta: Option<(&'static str, Value)>,
}

/// A two-layer Llama GGUF (hidden 256, 4 heads of 64 over 2 kv heads, tied embeddings)
/// whose tensors use every block type the CPU backend supports.
fn tiny_gguf(spoil: Spoil) -> GgufFile {
    use GgmlType::*;
    let (h, kv) = (TINY_HIDDEN, TINY_KV_HEADS * TINY_HIDDEN / TINY_HEADS);
    let mut w = GgufWriter::new();
    let arch = spoil.arch.unwrap_or("llama");
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(arch.into())),
        ("llama.block_count", Value::U32(2)),
        ("llama.embedding_length", Value::U32(h as u32)),
        ("llama.feed_forward_length", Value::U32(TINY_FFN as u32)),
        ("llama.attention.head_count", Value::U32(TINY_HEADS as u32)),
        (
            "llama.attention.head_count_kv",
            Value::U32(TINY_KV_HEADS as u32),
        ),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(TINY_CONTEXT)),
        ("tokenizer.ggml.eos_token_id", Value::U32(3)),
    ];
    for (key, value) in meta {
        let value = match &spoil.meta {
            Some((k, v)) if *k == key => v.clone(),
            _ => value,
        };
        w.add_metadata(key, value).unwrap();
    }
    let mut tensors = vec![("token_embd.weight".to_string(), vec![TINY_VOCAB, h], Q8_0)];
    let types = [
        [Q4_K, Q5_K, Q6_K, Q8_0, Q4_1, Q4_0, Q4_1],
        [Q4_1, Q4_1, Q8_0, Q4_1, Q4_K, Q5_K, Q6_K],
    ];
    for (i, [q, k, v, o, gate, up, down]) in types.into_iter().enumerate() {
        for (name, shape, ty) in [
            ("attn_norm", vec![h], F32),
            ("attn_q", vec![h, h], q),
            ("attn_k", vec![kv, h], k),
            ("attn_v", vec![kv, h], v),
            ("attn_output", vec![h, h], o),
            ("ffn_norm", vec![h], F32),
            ("ffn_gate", vec![TINY_FFN, h], gate),
            ("ffn_up", vec![TINY_FFN, h], up),
            ("ffn_down", vec![h, TINY_FFN], down),
        ] {
            tensors.push((format!("blk.{i}.{name}.weight"), shape, ty));
        }
    }
    tensors.push(("output_norm.weight".into(), vec![h], F32));
    if spoil.extra_tensor {
        tensors.push(("rope_freqs.weight".into(), vec![32], F32));
    }
    for (seed, (name, mut shape, ty)) in tensors.into_iter().enumerate() {
        let n = shape.iter().product();
        let data = match name.contains("norm") {
            true => values(n, seed as u64, 0.1)
                .iter()
                .map(|v| 1.0 + v)
                .collect(),
            false => values(n, seed as u64, 1.0 / (shape[shape.len() - 1] as f32).sqrt()),
        };
        if spoil.transposed == Some(name.as_str()) {
            shape.reverse();
        }
        let bytes = kimi_gguf::quantize(ty, &data).unwrap();
        w.add_tensor(name, &shape, ty, bytes).unwrap();
    }
    GgufFile::from_vec(w.to_bytes().unwrap()).unwrap()
}

/// Logits of the last row after feeding `a` whole, against feeding it token by token, and
/// a batch of `a` and `b` against `a` and `b` alone.
fn check_feed_modes_agree(model: &dyn CausalLm<CpuBackend>, a: &[u32], b: &[u32], tol: f32) {
    let opts = ForwardOptions::default();
    let vocab = model.vocab_size();
    let whole = {
        let (mut pool, mut cache) = model.single_cache(a.len()).unwrap();
        let mut batch = one_segment(a);
        batch.logits_rows = (0..a.len()).collect();
        model
            .forward(&batch, &mut pool, &mut [&mut cache], opts)
            .unwrap()
            .logits
    };
    // Token by token through a scattered table of 2-token blocks in a shared pool.
    let mut pool = model.new_pool(16, 2, 2).unwrap();
    let mut cache = SeqCache::new(1, vec![9, 3, 14, 0, 7, 11]);
    for (t, &id) in a.iter().enumerate() {
        let step = model
            .forward(&one_segment(&[id]), &mut pool, &mut [&mut cache], opts)
            .unwrap()
            .logits;
        assert_close(&step, &whole[t * vocab..(t + 1) * vocab], tol);
    }
    assert_eq!(cache.num_tokens, a.len());

    let alone = |ids: &[u32]| {
        let (mut pool, mut cache) = model.single_cache(ids.len()).unwrap();
        model
            .forward(&one_segment(ids), &mut pool, &mut [&mut cache], opts)
            .unwrap()
            .logits
    };
    let batch = Batch {
        tokens: [a, b].concat(),
        segments: vec![
            Segment {
                start: 0,
                len: a.len(),
            },
            Segment {
                start: a.len(),
                len: b.len(),
            },
        ],
        logits_rows: vec![a.len() - 1, a.len() + b.len() - 1],
        sampling: None,
    };
    // Both in the pool above, in blocks the first sequence never used (it is finished) and
    // in the blocks it left behind, stale rows included.
    let mut ca = SeqCache::new(0, vec![15, 1, 12, 2, 4, 10]);
    let mut cb = SeqCache::new(1, vec![3, 0]);
    let both = model
        .forward(&batch, &mut pool, &mut [&mut ca, &mut cb], opts)
        .unwrap()
        .logits;
    assert_close(&both[..vocab], &alone(a), tol);
    assert_close(&both[vocab..], &alone(b), tol);
}

fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "logit {i}: {g} vs {w}");
    }
}

#[test]
fn tiny_model_prefill_decode_and_batches_agree() {
    let file = tiny_gguf(Spoil::default());
    let config = LlamaConfig::from_gguf(&file).unwrap();
    assert_eq!((config.head_dim, config.num_kv_heads), (64, 2));
    assert_eq!(config.rope_style, kimi_ops::RopeStyle::Adjacent);
    assert!(config.tie_word_embeddings);
    assert_eq!(config.eos_token_ids, [3]);
    // The f32 matmul path: prefill (9 tokens) and decode then run the same kernels. The
    // default int8 path is checked on the demo model below.
    let model = Llama::load(CpuBackend::with_quant_matmul(QuantMatmul::F32), &file).unwrap();
    check_feed_modes_agree(&model, &[5, 9, 1, 33, 7, 7, 12, 0, 39], &[2, 4, 8], 1e-5);
    let generated = greedy(&model, &[5, 9, 1], 12);
    assert!(!generated.is_empty() && generated.iter().all(|&id| id < 40));
}

/// Logits of every position of `ids` fed whole, and the bytes of the key/value pools.
fn prefill_logits_and_pool_bytes(model: &Llama<CpuBackend>, ids: &[u32]) -> (Vec<f32>, usize) {
    let (mut pool, mut cache) = model.single_cache(ids.len()).unwrap();
    let mut batch = one_segment(ids);
    batch.logits_rows = (0..ids.len()).collect();
    let logits = model
        .forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )
        .unwrap()
        .logits;
    let be = model.backend();
    let bytes = pool
        .layers
        .iter()
        .map(|l| match l {
            LayerPool::Kv { k, v } => be.size_bytes(k) + be.size_bytes(v),
            _ => 0,
        })
        .sum();
    (logits, bytes)
}

/// Largest logit change (relative to the largest logit) that the f16 key/value cache may
/// cause on the tiny model. f16 keeps 11 significant bits, so each cached key and value
/// moves by at most 2^-12 of itself (2.4e-4); through two layers of attention the logits
/// moved by 1.8e-4 of the largest (measured, AVX-512 VNNI machine); the bound leaves 4x
/// that.
const F16_CACHE_LOGIT_TOLERANCE: f32 = 8e-4;

/// `--kv-cache-dtype f16` halves the key/value pools in either matmul mode and moves the
/// logits by the f16 rounding of the cached rows only; `f32` keeps the exact pools under the
/// integer kernels too, and `auto` is f32 with f32 products (the golden tests' setting).
#[test]
fn f16_kv_cache_halves_the_pools_and_rounds_only_the_cached_rows() {
    use kimi_ops::KvCacheDtype;
    let file = tiny_gguf(Spoil::default());
    let load = |mode, dtype| {
        Llama::load(
            CpuBackend::with_quant_matmul(mode).with_kv_cache_dtype(dtype),
            &file,
        )
        .unwrap()
    };
    let ids = [5, 9, 1, 33, 7, 7, 12, 0, 39, 2, 4, 8];
    let (exact, exact_bytes) =
        prefill_logits_and_pool_bytes(&load(QuantMatmul::F32, KvCacheDtype::Auto), &ids);
    let (f16, f16_bytes) =
        prefill_logits_and_pool_bytes(&load(QuantMatmul::F32, KvCacheDtype::F16), &ids);
    assert_eq!(f16_bytes * 2, exact_bytes);
    assert_ne!(f16, exact, "the cached rows were not rounded");
    let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = f16
        .iter()
        .zip(&exact)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!(
        "f16 cache: largest logit change {:.2e} of {scale}",
        worst / scale
    );
    assert!(
        worst <= F16_CACHE_LOGIT_TOLERANCE * scale,
        "{worst} of {scale}"
    );
    let (_, f32_bytes) =
        prefill_logits_and_pool_bytes(&load(QuantMatmul::Int8, KvCacheDtype::F32), &ids);
    let (_, auto_int8_bytes) =
        prefill_logits_and_pool_bytes(&load(QuantMatmul::Int8, KvCacheDtype::Auto), &ids);
    assert_eq!((f32_bytes, auto_int8_bytes), (exact_bytes, f16_bytes));
}

#[test]
fn tiny_model_rejects_what_it_cannot_run() {
    let format_error = |spoil: Spoil| match Llama::load(CpuBackend::new(), &tiny_gguf(spoil)) {
        Err(ModelError::Format { reason, .. }) => reason,
        other => panic!("expected a format error, got {:?}", other.err()),
    };
    let reason = format_error(Spoil {
        extra_tensor: true,
        ..Spoil::default()
    });
    assert!(reason.contains("rope_freqs.weight"), "{reason}");
    let reason = format_error(Spoil {
        transposed: Some("blk.1.attn_k.weight"),
        ..Spoil::default()
    });
    assert!(
        reason.contains("blk.1.attn_k.weight") && reason.contains("[256, 128]"),
        "{reason}"
    );
    let reason = format_error(Spoil {
        arch: Some("qwen2"),
        ..Spoil::default()
    });
    assert!(reason.contains("qwen2"), "{reason}");
    // Numbers that would load and then give NaN logits are refused, naming the key.
    for (key, value) in [
        ("llama.rope.freq_base", Value::F32(f32::NAN)),
        ("llama.rope.freq_base", Value::F32(-10_000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
        ),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(-1e-5)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(0.0)),
        ("llama.feed_forward_length", Value::U32(0)),
        ("llama.context_length", Value::U32(0)),
    ] {
        let shown = format!("{value:?}");
        let reason = format_error(Spoil {
            meta: Some((key, value)),
            ..Spoil::default()
        });
        assert!(reason.starts_with(key), "{key} = {shown}: {reason}");
    }

    let model = Llama::load(CpuBackend::new(), &tiny_gguf(Spoil::default())).unwrap();
    let opts = ForwardOptions::default();
    let (mut pool, mut cache) = model.single_cache(TINY_CONTEXT as usize + 1).unwrap();
    let too_long = vec![1u32; TINY_CONTEXT as usize + 1];
    let err = model
        .forward(&one_segment(&too_long), &mut pool, &mut [&mut cache], opts)
        .unwrap_err();
    assert!(err.to_string().contains("context of 64"), "{err}");
    let bad_id = model.forward(&one_segment(&[40]), &mut pool, &mut [&mut cache], opts);
    assert!(bad_id.is_err());
    let mut short = SeqCache::new(0, vec![]);
    assert!(model
        .forward(&one_segment(&[1]), &mut pool, &mut [&mut short], opts)
        .is_err());
    let mut no_slot = SeqCache::new(1, vec![0]);
    assert!(model
        .forward(&one_segment(&[1]), &mut pool, &mut [&mut no_slot], opts)
        .is_err());
    let mut other_layout = kimi_model::CachePool::new(model.backend(), &[], 4, 16, 1).unwrap();
    assert!(model
        .forward(
            &one_segment(&[1]),
            &mut other_layout,
            &mut [&mut cache],
            opts
        )
        .is_err());
}

#[test]
fn random_weights_build_a_llama() {
    let config = LlamaConfig {
        vocab_size: 32,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 8,
        rope_theta: 10_000.0,
        rope_style: kimi_ops::RopeStyle::Adjacent,
        rms_norm_eps: 1e-5,
        max_context: 128,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
    };
    let source = kimi_model::RandomWeights {
        dtype: kimi_core::DType::BF16,
        seed: 3,
    };
    let model = Llama::load_from(CpuBackend::new(), config, &source).unwrap();
    check_feed_modes_agree(&model, &[1, 2, 3, 4, 5, 6], &[7, 8], 1e-5);
}

/// The demo vocabulary has no token for some bytes (e.g. 0x04), which its BPE drops: the
/// length bound of `encode_within` counts only the bytes tokens stand for, so a prompt
/// padded with them is encoded exactly as before, while a 30 MB one is refused unread.
#[test]
fn demo_tokenizer_bounds_prompts_by_length_exactly() {
    use kimi_tokenizer::Bounded;
    let Some(file) = demo_model() else { return };
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let longest = tok.max_token_bytes().expect("a byte-level BPE");
    let padded = format!("{}What is the capital of France?", "\u{4}".repeat(100_000));
    let ids = tok.encode(&padded, true).unwrap();
    assert!(ids.len() < 20, "{} ids: the padding is dropped", ids.len());
    assert_eq!(
        tok.encode_within(&padded, true, 20).unwrap(),
        Bounded::Fits(ids)
    );
    let huge = "hello world ".repeat(2_500_000);
    let start = std::time::Instant::now();
    let Bounded::TooLong { at_least } = tok.encode_within(&huge, true, 8192).unwrap() else {
        panic!("30 MB fits in 8192 ids?");
    };
    assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
    assert_eq!(at_least, huge.len().div_ceil(longest));
}
