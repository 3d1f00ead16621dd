//! `kimi-infer run` and `kimi-infer chat`: streamed generation to stdout.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;

use anyhow::Context;
use kimi_engine::beam::BeamParams;
use kimi_engine::sampling::SamplingParams;
use kimi_engine::stop::StopMatcher;
use kimi_engine::{Engine, FinishReason};
use kimi_ops::Backend;
use kimi_tokenizer::{StreamDecoder, Tokenizer};
use serde_json::json;

use crate::args::{ChatArgs, RunArgs, SamplingArgs};

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    crate::load::with_backend!(a.model, |backend| run_on(backend, a))
}

fn run_on<B: Backend + 'static>(backend: B, a: RunArgs) -> anyhow::Result<()> {
    let loaded = crate::load::load(backend, &a.model, true)?;
    let tok = loaded.tokenizer.as_ref().context("no tokenizer")?;
    let params = sampling_params(&a.sampling);
    let ids = if a.chat {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": a.prompt}));
        chat_ids(tok, &messages)?
    } else {
        tok.encode(&a.prompt, false)?
    };
    if let Some(num_beams) = a.num_beams {
        let beam = BeamParams {
            num_beams,
            num_return: num_beams,
            length_penalty: a.length_penalty,
            early_stopping: a.early_stopping,
        };
        let params = SamplingParams {
            beam: Some(beam),
            ..params
        };
        return crate::beam_run::run_beams(loaded.engine, tok, ids, params);
    }
    let out = generate_streaming(&loaded.engine, tok, &ids, &params)?;
    println!();
    if a.stats {
        eprintln!(
            "prompt: {} tokens in {:.3} s ({:.1} tok/s); generated: {} tokens in {:.3} s ({:.1} tok/s); finish: {:?}",
            out.num_prompt_tokens,
            out.prefill_secs,
            out.num_prompt_tokens as f64 / out.prefill_secs.max(1e-9),
            out.num_tokens,
            out.decode_secs,
            out.num_tokens.saturating_sub(1) as f64 / out.decode_secs.max(1e-9),
            out.finish
        );
    }
    Ok(())
}

pub fn chat(a: ChatArgs) -> anyhow::Result<()> {
    crate::load::with_backend!(a.model, |backend| chat_on(backend, a))
}

fn chat_on<B: Backend + 'static>(backend: B, a: ChatArgs) -> anyhow::Result<()> {
    let loaded = crate::load::load(backend, &a.model, true)?;
    let tok = loaded.tokenizer.as_ref().context("no tokenizer")?;
    let params = sampling_params(&a.sampling);
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    eprintln!(
        "chatting with {} — type a message, /help for commands",
        loaded.dir.display()
    );
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        std::io::stderr().flush().ok();
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        match ChatCommand::parse(line) {
            Some(ChatCommand::Exit) => break,
            Some(ChatCommand::Reset) => {
                // The system prompt is part of the setup, not of the conversation.
                messages.truncate(usize::from(a.system.is_some()));
                eprintln!("conversation cleared");
                continue;
            }
            Some(ChatCommand::Help) => {
                eprintln!("{CHAT_HELP}");
                continue;
            }
            Some(ChatCommand::Unknown) => {
                eprintln!("unknown command `{line}`; /help lists the commands");
                continue;
            }
            None => {}
        }
        let text = line.strip_prefix("//").map_or(line, |_| &line[1..]);
        messages.push(json!({"role": "user", "content": text}));
        let ids = chat_ids(tok, &messages)?;
        let out = generate_streaming(&loaded.engine, tok, &ids, &params)?;
        println!();
        messages.push(json!({"role": "assistant", "content": out.text}));
    }
    Ok(())
}

const CHAT_HELP: &str = "commands:
  /reset   clear the conversation (the system prompt stays)
  /help    show this list
  /exit    quit (also /quit, or end of input)
a line starting with // sends the rest, starting with /";

/// A line of `chat` input that is a command rather than a message.
#[derive(Debug, PartialEq, Eq)]
enum ChatCommand {
    Reset,
    Help,
    Exit,
    Unknown,
}

impl ChatCommand {
    /// `None` for a message; `//text` is the message `/text`.
    fn parse(line: &str) -> Option<ChatCommand> {
        let rest = line.strip_prefix('/')?;
        if rest.starts_with('/') {
            return None;
        }
        Some(match rest.trim() {
            "reset" | "clear" => ChatCommand::Reset,
            "help" | "?" => ChatCommand::Help,
            "exit" | "quit" => ChatCommand::Exit,
            _ => ChatCommand::Unknown,
        })
    }
}

/// The prompt ids of a conversation: the tokenizer's chat template where it has one, else
/// Kimi K3's XTML format (rendered by our own code, as K3 ships no template) where its
/// markers are in the vocabulary.
fn chat_ids(tok: &Tokenizer, messages: &[serde_json::Value]) -> anyhow::Result<Vec<u32>> {
    if let Some(template) = tok.chat_template() {
        return Ok(tok.encode(&template.render(messages, None, true)?, true)?);
    }
    let xtml = ["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"];
    if xtml.iter().all(|m| tok.token_id(m).is_some()) {
        let prompt =
            kimi_tokenizer::render_xtml(messages, &kimi_tokenizer::XtmlOptions::default())?;
        return Ok(tok.encode_xtml(&prompt)?);
    }
    anyhow::bail!(
        "this model has no chat template (tokenizer_config.json chat_template or \
         chat_template.jinja) and its tokenizer has no Kimi K3 XTML markers"
    )
}

pub fn sampling_params(s: &SamplingArgs) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        seed: s.seed,
        max_tokens: s.max_tokens,
        stop: s.stop.clone(),
        stop_token_ids: s.stop_ids.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs,
        beam: None,
    }
}

/// What a streamed generation produced.
pub struct Streamed {
    pub text: String,
    pub num_prompt_tokens: usize,
    pub num_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub finish: FinishReason,
}

/// Generates and prints text as it becomes complete UTF-8, honouring stop strings.
pub fn generate_streaming<B: Backend>(
    engine: &Engine<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
) -> anyhow::Result<Streamed> {
    let mut decoder = StreamDecoder::new(tok, true);
    let mut stops = StopMatcher::new(&params.stop);
    let mut text = String::new();
    let stdout = std::io::stdout();
    let emit = |s: &str, text: &mut String| {
        if !s.is_empty() {
            let mut out = stdout.lock();
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
            text.push_str(s);
        }
    };
    let mut eos = tok.eos_ids();
    eos.extend(engine.model().eos_token_ids().iter().copied());
    let gen = engine.generate(prompt, params, &eos, |s| {
        if let Some(n) = params.logprobs {
            let alts: Vec<String> = s
                .top_logprobs
                .iter()
                .take(n)
                .map(|(id, lp)| format!("{id}:{lp:.3}"))
                .collect();
            eprintln!(
                "[token {} logprob {:.4} top {}]",
                s.token,
                s.logprob,
                alts.join(" ")
            );
        }
        let piece = decoder.push(s.token);
        let out = stops.push(&piece);
        emit(&out.emit, &mut text);
        if out.stopped {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    let stopped_by_string = gen.finish == FinishReason::Cancelled;
    if !stopped_by_string {
        let tail = decoder.finish();
        let out = stops.push(&tail);
        emit(&out.emit, &mut text);
        if !out.stopped {
            let rest = stops.finish();
            emit(&rest, &mut text);
        }
    }
    Ok(Streamed {
        text,
        num_prompt_tokens: gen.num_prompt_tokens,
        num_tokens: gen.tokens.len(),
        prefill_secs: gen.prefill_secs,
        decode_secs: gen.decode_secs,
        finish: if stopped_by_string {
            FinishReason::Stop
        } else {
            gen.finish
        },
    })
}

#[cfg(test)]
mod tests {
    use super::ChatCommand;

    #[test]
    fn chat_commands_parse() {
        assert_eq!(ChatCommand::parse("/reset"), Some(ChatCommand::Reset));
        assert_eq!(ChatCommand::parse("/help"), Some(ChatCommand::Help));
        assert_eq!(ChatCommand::parse("/quit"), Some(ChatCommand::Exit));
        assert_eq!(ChatCommand::parse("/nope"), Some(ChatCommand::Unknown));
        assert_eq!(ChatCommand::parse("//reset"), None);
        assert_eq!(ChatCommand::parse("hello /reset"), None);
    }
}
