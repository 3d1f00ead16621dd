//! `POST /v1/chat/completions`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use kimi_tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::access_log::RequestRecord;
use crate::chat_format::{parse_thinking, render_prompt, PromptRequest, Thinking};
use crate::chat_request::{
    parse_messages, parse_response_format, parse_tool_choice, parse_tools, ResponseFormat,
    ToolChoice, ToolSpec,
};
use crate::constraint::Processor;
use crate::error::ApiError;
use crate::fields::{bad_value, Body};
use crate::generation::{Delta, OutputFormat, OutputOptions, Run, SequenceSetup};
use crate::params::{finalize, parse_common, CommonParams};
use crate::response::{chat_logprob, collect, stream, ChunkWriter, CollectedChoice};
use crate::state::ChatFormat;
use crate::state::{unix_now, AppState, Inner};
use crate::tool_format::ToolFormat;
use crate::xtml_output::XtmlStart;
use crate::{blocking, check_model, deadline};

/// A request ready to submit.
struct Prepared {
    model: String,
    prompt_tokens: usize,
    setups: Vec<SequenceSetup>,
    options: OutputOptions,
    common: CommonParams,
}

/// The handler.
pub(crate) async fn chat_completions(
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
    let Prepared {
        model,
        prompt_tokens,
        setups,
        options,
        common,
    } = prepared;
    let num_choices = setups.len();
    let mut run = match Run::submit(&state.inner, setups, options, arrival, record.map(|r| r.0)) {
        Ok(run) => run,
        Err(err) => return err.into_response(),
    };
    let writer = ChatWriter {
        id: state.inner.response_id("chatcmpl"),
        created: unix_now(),
        model,
        num_choices,
        include_usage: common.include_usage,
        prompt_tokens,
        tokenizer: Arc::clone(&state.inner.tokenizer),
    };
    let deadline = deadline(&state.inner, arrival);
    if common.stream {
        return stream(run, writer, deadline);
    }
    match collect(&mut run, num_choices, deadline).await {
        Ok(choices) => {
            Json(writer.whole(choices, run.completion_tokens(), options.logprobs)).into_response()
        }
        Err(err) => err.into_response(),
    }
}

pub(crate) fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

fn prepare(inner: &Inner, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let body = Body::parse(bytes)?;
    let model = check_model(inner, &body)?;
    let messages = parse_messages(&body)?;
    let tools = parse_tools(&body)?;
    let tool_choice = parse_tool_choice(&body, &tools)?;
    let parallel = body.bool("parallel_tool_calls")?.unwrap_or(true);
    let response_format = parse_response_format(&body)?;
    let common = parse_common(
        &body,
        inner.vocab_size,
        &["max_completion_tokens", "max_tokens"],
    )?;
    let logprobs = body.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = body.int_in("top_logprobs", 0, 20)?;
    if top_logprobs.is_some_and(|n| n > 0) && !logprobs {
        return Err(bad_value("top_logprobs", "requires `logprobs` to be true"));
    }
    let add_generation_prompt = body.bool("add_generation_prompt")?.unwrap_or(true);
    let thinking = match inner.chat_format {
        ChatFormat::Xtml(_) => parse_thinking(&body)?,
        ChatFormat::Template | ChatFormat::Unavailable => Thinking::default(),
    };
    let request = PromptRequest {
        messages: &messages,
        tools: &tools,
        tool_choice: &tool_choice,
        response_format: &response_format,
        add_generation_prompt,
        thinking,
    };
    for (i, tool) in tools.iter().enumerate() {
        inner
            .constraints
            .json(Some(&tool.parameters))
            .map_err(|e| {
                bad_value(
                    &format!("tools[{i}].function.parameters"),
                    format!("is not a usable JSON schema: {e}"),
                )
            })?;
    }
    let grammar = build_grammar(inner, &request, parallel)?;
    let prompt = render_prompt(inner, &request)?;
    let mut sampling = finalize(
        &common,
        prompt.len(),
        inner.max_model_len,
        inner.vocab_size,
        None,
        "messages",
        "top_logprobs",
    )?;
    if logprobs {
        sampling.logprobs = Some(top_logprobs.unwrap_or(0) as usize);
    }
    let parse_tools = !tools.is_empty() && tool_choice != ToolChoice::None;
    // XTML has no section token to ban: its prompt tells the model not to call, and a tools
    // section it writes anyway is dropped.
    let banned = match (&inner.tool_format, &tool_choice, inner.chat_format) {
        (Some(ToolFormat::Kimi(t)), ToolChoice::None, ChatFormat::Template)
            if !tools.is_empty() =>
        {
            t.section_openers()
        }
        _ => Vec::new(),
    };
    let format = match inner.chat_format {
        ChatFormat::Xtml(tokens) => OutputFormat::Xtml {
            tokens,
            start: request.xtml_start(),
            tools: parse_tools,
        },
        _ => match inner.tool_format {
            Some(ToolFormat::Kimi(tokens)) if parse_tools => OutputFormat::KimiK2Tools(tokens),
            Some(ToolFormat::Json(format)) if parse_tools => OutputFormat::JsonTools(format.kind),
            _ => OutputFormat::Text,
        },
    };
    let setups = (0..common.n)
        .map(|i| {
            let mut params = sampling.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            SequenceSetup {
                prompt: prompt.clone(),
                params,
                processor: Processor::build(&common.logit_bias, &banned, grammar.clone()),
            }
        })
        .collect();
    Ok(Prepared {
        model,
        prompt_tokens: prompt.len(),
        setups,
        options: OutputOptions {
            format,
            named_tool: matches!(tool_choice, ToolChoice::Named(_)),
            logprobs,
            skip_special: common.skip_special_tokens,
        },
        common,
    })
}

/// The grammar the output must follow, if any.
fn build_grammar(
    inner: &Inner,
    request: &PromptRequest<'_>,
    parallel: bool,
) -> Result<Option<llguidance::Matcher>, ApiError> {
    let (tools, tool_choice) = (request.tools, request.tool_choice);
    let forced: Vec<&ToolSpec> = match tool_choice {
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(name) => tools.iter().filter(|t| &t.name == name).collect(),
        ToolChoice::None | ToolChoice::Auto => Vec::new(),
    };
    let xtml = matches!(inner.chat_format, ChatFormat::Xtml(_));
    let constrained = !forced.is_empty() || *request.response_format != ResponseFormat::Text;
    let start = request.xtml_start();
    if xtml && constrained && start == XtmlStart::Message {
        return Err(bad_value(
            "add_generation_prompt",
            "must be true when `tool_choice` or `response_format` constrains the output",
        ));
    }
    let thinking = start == XtmlStart::Think;
    if !forced.is_empty() {
        if *request.response_format != ResponseFormat::Text {
            return Err(bad_value(
                "response_format",
                "cannot be combined with a required or named `tool_choice`",
            ));
        }
        let specs: Vec<(&str, &Value)> = forced
            .iter()
            .map(|t| (t.name.as_str(), &t.parameters))
            .collect();
        let single = !parallel || matches!(tool_choice, ToolChoice::Named(_));
        let matcher = match &inner.tool_format {
            _ if xtml => inner.constraints.xtml_tool_calls(&specs, single, thinking),
            Some(ToolFormat::Json(format)) => {
                inner.constraints.json_tool_calls(format, &specs, single)
            }
            Some(ToolFormat::Kimi(_)) | None => inner.constraints.tool_calls(&specs, single),
        };
        return matcher
            .map(Some)
            .map_err(|e| bad_value("tool_choice", format!("cannot be enforced: {e}")));
    }
    let schema = match request.response_format {
        ResponseFormat::Text => return Ok(None),
        ResponseFormat::JsonObject => None,
        ResponseFormat::JsonSchema(schema) => schema.as_ref(),
    };
    let matcher = if xtml {
        inner.constraints.xtml_json(schema, thinking)
    } else {
        inner.constraints.json(schema)
    };
    matcher.map(Some).map_err(|e| {
        bad_value(
            "response_format",
            format!("has an unusable JSON schema: {e}"),
        )
    })
}

/// Writes `chat.completion.chunk`s.
struct ChatWriter {
    id: String,
    created: u64,
    model: String,
    num_choices: usize,
    include_usage: bool,
    prompt_tokens: usize,
    tokenizer: Arc<Tokenizer>,
}

impl ChatWriter {
    /// The `chat.completion` body of collected choices.
    fn whole(
        &self,
        choices: Vec<CollectedChoice>,
        completion_tokens: usize,
        logprobs: bool,
    ) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let tool_calls: Vec<Value> = c
                    .tool_calls
                    .iter()
                    .map(|(id, name, arguments)| {
                        json!({"id": id, "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                    })
                    .collect();
                let mut message = json!({"role": "assistant", "content": c.content});
                if !c.reasoning.is_empty() {
                    message["reasoning_content"] = json!(c.reasoning);
                }
                if !tool_calls.is_empty() {
                    if c.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = Value::Array(tool_calls);
                }
                let logprobs = logprobs.then(|| {
                    let content: Vec<Value> = c
                        .logprobs
                        .iter()
                        .map(|e| chat_logprob(&self.tokenizer, e))
                        .collect();
                    json!({"content": content, "refusal": null})
                });
                json!({"index": index, "message": message, "logprobs": logprobs,
                       "finish_reason": c.finish_reason})
            })
            .collect();
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.prompt_tokens, completion_tokens),
        })
    }

    fn chunk(&self, choices: Vec<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl ChunkWriter for ChatWriter {
    fn opening(&mut self) -> Vec<Value> {
        (0..self.num_choices)
            .map(|index| {
                self.chunk(vec![json!({"index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null})])
            })
            .collect()
    }

    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value> {
        let mut body = json!({});
        if !delta.reasoning.is_empty() {
            body["reasoning_content"] = json!(delta.reasoning);
        }
        if !delta.content.is_empty() {
            body["content"] = json!(delta.content);
        }
        if !delta.tool_calls.is_empty() {
            let calls: Vec<Value> = delta
                .tool_calls
                .iter()
                .map(|call| {
                    let mut value =
                        json!({"index": call.index, "function": {"arguments": call.arguments}});
                    if let Some(id) = &call.id {
                        value["id"] = json!(id);
                        value["type"] = json!("function");
                    }
                    if let Some(name) = &call.name {
                        value["function"]["name"] = json!(name);
                    }
                    value
                })
                .collect();
            body["tool_calls"] = Value::Array(calls);
        }
        let has_body = body.as_object().is_some_and(|o| !o.is_empty());
        if !has_body && delta.finish_reason.is_none() && delta.logprobs.is_empty() {
            return None;
        }
        let logprobs = (!delta.logprobs.is_empty()).then(|| {
            let content: Vec<Value> = delta
                .logprobs
                .iter()
                .map(|e| chat_logprob(&self.tokenizer, e))
                .collect();
            json!({"content": content, "refusal": null})
        });
        Some(self.chunk(vec![
            json!({"index": index, "delta": body, "logprobs": logprobs,
                                    "finish_reason": delta.finish_reason}),
        ]))
    }

    fn usage(&mut self, completion_tokens: usize) -> Option<Value> {
        self.include_usage.then(|| {
            let mut chunk = self.chunk(Vec::new());
            chunk["usage"] = usage(self.prompt_tokens, completion_tokens);
            chunk
        })
    }
}
