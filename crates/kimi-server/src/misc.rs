//! Small endpoints: `/v1/models`, `/health`, `/metrics`, `/tokenize`, `/detokenize`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::chat_format::{parse_thinking, render_prompt, PromptRequest, Thinking};
use crate::chat_request::{parse_messages, parse_response_format, parse_tool_choice, parse_tools};
use crate::decode::token_text;
use crate::error::ApiError;
use crate::fields::{bad_value, wrong_type, Body};
use crate::state::{AppState, ChatFormat, Inner};
use crate::{blocking, check_model};

fn model_card(inner: &Inner) -> Value {
    let name = &inner.config.served_model_name;
    json!({
        "id": name,
        "object": "model",
        "created": inner.created,
        "owned_by": "kimi-infer",
        "root": name,
        "parent": null,
        "max_model_len": inner.max_model_len,
    })
}

/// `GET /v1/models`.
pub(crate) async fn list_models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&state.inner)]}))
}

/// `GET /v1/models/{model}`.
pub(crate) async fn get_model(
    State(state): State<AppState>,
    Path(model): Path<String>,
) -> Response {
    if model == state.inner.config.served_model_name {
        Json(model_card(&state.inner)).into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
}

/// `GET /health`: 200 while the server runs.
pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`: Prometheus text.
pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    let inner = &state.inner;
    let engine = inner.generator.metrics();
    let mut text = inner
        .metrics
        .render(&engine, inner.num_pending.load(Ordering::Acquire));
    if let Some(limiter) = &inner.config.limiter {
        limiter.render_metrics(&mut text);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `POST /tokenize`: `{"prompt": text}` or `{"messages": [...]}` (vLLM's API).
pub(crate) async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let inner = Arc::clone(&state.inner);
    match blocking(move || tokenize_body(&inner, &body)).await {
        Ok(value) => Json(value).into_response(),
        Err(err) => err.into_response(),
    }
}

fn tokenize_body(inner: &Inner, bytes: &[u8]) -> Result<Value, ApiError> {
    let body = Body::parse(bytes)?;
    check_model(inner, &body)?;
    let tokens = if body.get("messages").is_some() {
        let messages = parse_messages(&body)?;
        let tools = parse_tools(&body)?;
        let add_generation_prompt = body.bool("add_generation_prompt")?.unwrap_or(true);
        let thinking = match inner.chat_format {
            ChatFormat::Xtml(_) => parse_thinking(&body)?,
            ChatFormat::Template | ChatFormat::Unavailable => Thinking::default(),
        };
        let request = PromptRequest {
            messages: &messages,
            tool_choice: &parse_tool_choice(&body, &tools)?,
            response_format: &parse_response_format(&body)?,
            tools: &tools,
            add_generation_prompt,
            thinking,
        };
        render_prompt(inner, &request)?
    } else {
        let prompt = match body.required("prompt")? {
            Value::String(s) => s,
            other => return Err(wrong_type("prompt", "a string", other)),
        };
        let special = body.bool("add_special_tokens")?.unwrap_or(true);
        inner.encode_prompt(prompt, special, "prompt")?
    };
    let mut out =
        json!({"count": tokens.len(), "max_model_len": inner.max_model_len, "tokens": tokens});
    if body.bool("return_token_strs")?.unwrap_or(false) {
        let strs: Vec<String> = tokens
            .iter()
            .map(|&id| token_text(&inner.tokenizer, id))
            .collect();
        out["token_strs"] = json!(strs);
    }
    Ok(out)
}

/// `POST /detokenize`: `{"tokens": [ids]}` → `{"prompt": text}`.
pub(crate) async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match crate::body_bytes(body) {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let inner = Arc::clone(&state.inner);
    let result = blocking(move || {
        let body = Body::parse(&body)?;
        check_model(&inner, &body)?;
        body.required("tokens")?;
        let vocab = inner.tokenizer.vocab_size().max(inner.vocab_size);
        let ids = body.token_ids("tokens", vocab)?;
        let text = inner
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| bad_value("tokens", e))?;
        Ok(json!({"prompt": text}))
    })
    .await;
    match result {
        Ok(value) => Json(value).into_response(),
        Err(err) => err.into_response(),
    }
}
