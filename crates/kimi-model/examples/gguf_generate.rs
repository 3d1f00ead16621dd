//! Greedy generation from a Llama-architecture GGUF file on the CPU backend (a test and
//! measurement tool; `kimi-infer` is the real front end).
//!
//! ```text
//! cargo run --release -p kimi-model --example gguf_generate -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf --ids 6403,1980,253,655 -n 24
//! cargo run --release -p kimi-model --example gguf_generate -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf --chat "What is the capital of France?"
//! ```
//! Prints the prompt ids, the generated ids, their text (the tokenizer comes from the same
//! file) and prefill/decode speed. Flags: `--ids A,B,..` | `--prompt TEXT` | `--chat TEXT`,
//! `-n N` (tokens to generate, default 32), `--ignore-eos`, `--threads N`.

use std::time::Instant;

use kimi_cpu::CpuBackend;
use kimi_gguf::GgufFile;
use kimi_model::{Batch, CausalLm, ForwardOptions, Llama};
use kimi_ops::Segment;
use kimi_tokenizer::Tokenizer;

struct Args {
    path: String,
    ids: Option<Vec<u32>>,
    prompt: Option<String>,
    chat: bool,
    max_tokens: usize,
    ignore_eos: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        path: String::new(),
        ids: None,
        prompt: None,
        chat: false,
        max_tokens: 32,
        ignore_eos: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--ids" => {
                let ids = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<u32>().map_err(|e| format!("--ids: {e}")))
                    .collect::<Result<Vec<_>, _>>()?;
                args.ids = Some(ids);
            }
            "--prompt" => args.prompt = Some(value()?),
            "--chat" => (args.prompt, args.chat) = (Some(value()?), true),
            "-n" | "--max-tokens" => {
                args.max_tokens = value()?.parse().map_err(|e| format!("-n: {e}"))?
            }
            "--threads" => {
                let n = value()?.parse().map_err(|e| format!("--threads: {e}"))?;
                kimi_cpu::set_num_threads(n)?;
            }
            "--ignore-eos" => args.ignore_eos = true,
            path if args.path.is_empty() && !path.starts_with('-') => args.path = path.into(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.path.is_empty() || args.ids.is_none() == args.prompt.is_none() {
        return Err("usage: gguf_generate FILE.gguf (--ids A,B,.. | --prompt TEXT | --chat TEXT) [-n N] [--ignore-eos] [--threads N]".into());
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let start = Instant::now();
    let file = GgufFile::open(&args.path)?;
    let model = Llama::load(CpuBackend::new(), &file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    println!(
        "loaded {} in {:.2} s ({})",
        args.path,
        start.elapsed().as_secs_f64(),
        kimi_ops::Backend::name(model.backend())
    );
    let prompt_ids = match (&args.ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if args.chat => {
            let template = tokenizer
                .chat_template()
                .ok_or("the file has no chat template")?;
            let messages = [serde_json::json!({"role": "user", "content": text})];
            tokenizer.encode(&template.render(&messages, None, true)?, true)?
        }
        (None, Some(text)) => tokenizer.encode(text, false)?,
        (None, None) => unreachable!("parse_args requires one"),
    };
    println!("prompt ids ({}): {prompt_ids:?}", prompt_ids.len());

    let (generated, prefill_s, decode_s) = generate(&model, &prompt_ids, &args)?;
    println!("generated ids ({}): {generated:?}", generated.len());
    println!("text: {:?}", tokenizer.decode(&generated, false)?);
    println!(
        "prefill {} tokens in {:.3} s ({:.1} tok/s); decode {} tokens in {:.3} s ({:.1} tok/s)",
        prompt_ids.len(),
        prefill_s,
        prompt_ids.len() as f64 / prefill_s,
        generated.len().saturating_sub(1),
        decode_s,
        generated.len().saturating_sub(1) as f64 / decode_s.max(1e-9),
    );
    Ok(())
}

/// Greedy decoding; returns the generated ids, prefill seconds and decode seconds (the
/// first token comes from the prefill).
fn generate(
    model: &Llama<CpuBackend>,
    prompt: &[u32],
    args: &Args,
) -> Result<(Vec<u32>, f64, f64), Box<dyn std::error::Error>> {
    let (mut pool, mut cache) = model.single_cache(prompt.len() + args.max_tokens)?;
    let mut step = |tokens: &[u32]| -> Result<u32, kimi_model::ModelError> {
        let batch = Batch {
            tokens: tokens.to_vec(),
            segments: vec![Segment {
                start: 0,
                len: tokens.len(),
            }],
            logits_rows: vec![tokens.len() - 1],
            sampling: None,
        };
        let out = model.forward(
            &batch,
            &mut pool,
            &mut [&mut cache],
            ForwardOptions::default(),
        )?;
        Ok(argmax(&out.logits))
    };
    let is_end = |id: u32| !args.ignore_eos && model.eos_token_ids().contains(&id);
    let start = Instant::now();
    let mut out = vec![step(prompt)?];
    let prefill_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    while out.len() < args.max_tokens && !is_end(out[out.len() - 1]) {
        out.push(step(&out[out.len() - 1..])?);
    }
    Ok((out, prefill_s, start.elapsed().as_secs_f64()))
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}
