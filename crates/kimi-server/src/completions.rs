//! `POST /v1/completions`: text or token-id prompts (one or a batch), `echo`, `logprobs`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use kimi_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use crate::access_log::RequestRecord;
use crate::chat::usage;
use crate::constraint::Processor;
use crate::decode::token_text;
use crate::error::ApiError;
use crate::fields::{bad_value, token_id, wrong_type, Body};
use crate::generation::{Delta, OutputFormat, OutputOptions, Run, SequenceSetup, TokenLogprob};
use crate::params::{finalize, parse_common};
use crate::response::{collect, logprob_value, stream, ChunkWriter, CollectedChoice};
use crate::state::{unix_now, AppState, Inner};
use crate::{blocking, check_model, deadline};

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;
/// The most sequences (prompts × n) one request may start.
const MAX_SEQUENCES: usize = 256;

struct Prepared {
    model: String,
    /// Prompt ids, one list per prompt.
    prompts: Vec<Vec<u32>>,
    setups: Vec<SequenceSetup>,
    options: OutputOptions,
    n: usize,
    echo: bool,
    stream: bool,
    include_usage: bool,
}

/// The prompts of a request: a string, a list of strings, a list of ids, a list of lists.
fn parse_prompts(inner: &Inner, body: &Body) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| inner.encode_prompt(text, true, "prompt");
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| token_id("prompt", v, inner.vocab_size))
            .collect()
    };
    let prompts = match body.required("prompt")? {
        Value::String(text) => vec![encode(text)?],
        Value::Array(items) if items.is_empty() => return Err(bad_value("prompt", "is empty")),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|item| match item {
                    Value::String(text) => encode(text),
                    other => Err(wrong_type("prompt", "a list of strings", other)),
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![ids(items)?],
            Value::Array(_) => items
                .iter()
                .map(|item| match item {
                    Value::Array(inner_items) => ids(inner_items),
                    other => Err(wrong_type("prompt", "a list of token-id lists", other)),
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(wrong_type(
                    "prompt",
                    "a string, a list of strings, or token ids",
                    other,
                ))
            }
        },
        other => {
            return Err(wrong_type(
                "prompt",
                "a string, a list of strings, or token ids",
                other,
            ))
        }
    };
    Ok(prompts)
}

fn prepare(inner: &Inner, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let body = Body::parse(bytes)?;
    let model = check_model(inner, &body)?;
    let prompts = parse_prompts(inner, &body)?;
    let common = parse_common(&body, inner.vocab_size, &["max_tokens"])?;
    let echo = body.bool("echo")?.unwrap_or(false);
    let logprobs = body.int_in("logprobs", 0, 20)?;
    if body.get("suffix").is_some_and(|s| s.as_str() != Some("")) {
        return Err(bad_value("suffix", "is not supported"));
    }
    if prompts.len() * common.n > MAX_SEQUENCES {
        return Err(bad_value(
            "n",
            format!("times the number of prompts must be at most {MAX_SEQUENCES}"),
        ));
    }
    let mut setups = Vec::with_capacity(prompts.len() * common.n);
    for prompt in &prompts {
        let mut sampling = finalize(
            &common,
            prompt.len(),
            inner.max_model_len,
            inner.vocab_size,
            Some(DEFAULT_MAX_TOKENS),
            "prompt",
            "logprobs",
        )?;
        sampling.logprobs = logprobs.map(|n| n as usize);
        for i in 0..common.n {
            let mut params = sampling.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            setups.push(SequenceSetup {
                prompt: prompt.clone(),
                params,
                processor: Processor::build(&common.logit_bias, &[], None),
            });
        }
    }
    Ok(Prepared {
        model,
        prompts,
        setups,
        options: OutputOptions {
            format: OutputFormat::Text,
            named_tool: false,
            logprobs: logprobs.is_some(),
            skip_special: common.skip_special_tokens,
        },
        n: common.n,
        echo,
        stream: common.stream,
        include_usage: common.include_usage,
    })
}

/// The handler.
pub(crate) async fn completions(
    State(state): State<AppState>,
    record: Option<Extension<Arc<RequestRecord>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let arrival = Instant::now();
    let inner = Arc::clone(&state.inner);
    let prepared = match blocking(move || prepare(&inner, &body)).await {
        Ok(prepared) => prepared,
        Err(err) => return err.into_response(),
    };
    let num_choices = prepared.setups.len();
    let options = prepared.options;
    let mut run = match Run::submit(
        &state.inner,
        prepared.setups,
        options,
        arrival,
        record.map(|r| r.0),
    ) {
        Ok(run) => run,
        Err(err) => return err.into_response(),
    };
    let tokenizer = Arc::clone(&state.inner.tokenizer);
    let echoes: Vec<Echo> = (0..num_choices)
        .map(|choice| {
            let prompt = &prepared.prompts[choice / prepared.n];
            if prepared.echo {
                Echo::of(&tokenizer, prompt)
            } else {
                Echo::default()
            }
        })
        .collect();
    let prompt_tokens = prepared.prompts.iter().map(Vec::len).sum();
    let mut writer = CompletionWriter {
        id: state.inner.response_id("cmpl"),
        created: unix_now(),
        model: prepared.model,
        include_usage: prepared.include_usage,
        prompt_tokens,
        want_logprobs: options.logprobs,
        offsets: echoes.iter().map(|e| e.text.chars().count()).collect(),
        echoes,
        tokenizer,
    };
    let deadline = deadline(&state.inner, arrival);
    if prepared.stream {
        return stream(run, writer, deadline);
    }
    match collect(&mut run, num_choices, deadline).await {
        Ok(choices) => Json(writer.whole(choices, run.completion_tokens())).into_response(),
        Err(err) => err.into_response(),
    }
}

/// An echoed prompt: its text and tokens (whose logprobs are unknown: `null`).
#[derive(Debug, Default)]
struct Echo {
    text: String,
    tokens: Vec<String>,
}

impl Echo {
    fn of(tokenizer: &Tokenizer, prompt: &[u32]) -> Echo {
        Echo {
            text: tokenizer.decode(prompt, false).unwrap_or_default(),
            tokens: prompt.iter().map(|&id| token_text(tokenizer, id)).collect(),
        }
    }

    fn add_to(&self, lp: &mut LogprobsJson) {
        let mut offset = 0;
        for token in &self.tokens {
            lp.tokens.push(json!(token));
            lp.token_logprobs.push(Value::Null);
            lp.top_logprobs.push(Value::Null);
            lp.text_offset.push(json!(offset));
            offset += token.chars().count();
        }
    }
}

/// The legacy completions logprobs object, built up.
#[derive(Debug, Default)]
struct LogprobsJson {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
}

impl LogprobsJson {
    fn add(&mut self, tokenizer: &Tokenizer, entries: &[TokenLogprob], mut offset: usize) {
        for entry in entries {
            let text = token_text(tokenizer, entry.token);
            self.tokens.push(json!(text));
            self.token_logprobs
                .push(json!(logprob_value(entry.logprob)));
            let top: Map<String, Value> = entry
                .top
                .iter()
                .map(|&(id, lp)| (token_text(tokenizer, id), json!(logprob_value(lp))))
                .collect();
            self.top_logprobs.push(Value::Object(top));
            self.text_offset.push(json!(offset));
            offset += text.chars().count();
        }
    }

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// Writes `text_completion` chunks.
struct CompletionWriter {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
    want_logprobs: bool,
    echoes: Vec<Echo>,
    /// Per choice: characters of text sent so far (for `text_offset`).
    offsets: Vec<usize>,
    tokenizer: Arc<Tokenizer>,
}

impl CompletionWriter {
    /// The `text_completion` body of collected choices.
    fn whole(&mut self, choices: Vec<CollectedChoice>, completion_tokens: usize) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let echo = self
                    .echoes
                    .get_mut(index)
                    .map(std::mem::take)
                    .unwrap_or_default();
                let logprobs = self.want_logprobs.then(|| {
                    let mut lp = LogprobsJson::default();
                    echo.add_to(&mut lp);
                    lp.add(&self.tokenizer, &c.logprobs, echo.text.chars().count());
                    lp.into_json()
                });
                json!({"index": index, "text": echo.text + &c.content, "logprobs": logprobs,
                       "finish_reason": c.finish_reason})
            })
            .collect();
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.prompt_tokens, completion_tokens),
        })
    }

    fn chunk(
        &self,
        index: usize,
        text: String,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl ChunkWriter for CompletionWriter {
    fn opening(&mut self) -> Vec<Value> {
        let mut chunks = Vec::new();
        for index in 0..self.echoes.len() {
            let echo = std::mem::take(&mut self.echoes[index]);
            if echo.text.is_empty() {
                continue;
            }
            let logprobs = self.want_logprobs.then(|| {
                let mut lp = LogprobsJson::default();
                echo.add_to(&mut lp);
                lp.into_json()
            });
            chunks.push(self.chunk(index, echo.text, logprobs, None));
        }
        chunks
    }

    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value> {
        if delta.content.is_empty() && delta.logprobs.is_empty() && delta.finish_reason.is_none() {
            return None;
        }
        let offset = self.offsets.get(index).copied().unwrap_or(0);
        let logprobs = (self.want_logprobs && !delta.logprobs.is_empty()).then(|| {
            let mut lp = LogprobsJson::default();
            lp.add(&self.tokenizer, &delta.logprobs, offset);
            lp.into_json()
        });
        if let Some(o) = self.offsets.get_mut(index) {
            *o += delta.content.chars().count();
        }
        Some(self.chunk(index, delta.content, logprobs, delta.finish_reason))
    }

    fn usage(&mut self, completion_tokens: usize) -> Option<Value> {
        self.include_usage.then(|| {
            json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(self.prompt_tokens, completion_tokens),
            })
        })
    }
}
