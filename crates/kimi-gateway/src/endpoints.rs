//! The gateway's own endpoints: `/v1/models` (the healthy upstreams' models, merged),
//! `/health` and `/metrics`.

use std::sync::{Arc, PoisonError};

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use kimi_server::ApiError;
use serde_json::{json, Value};

use crate::access_log::Record;
use crate::request::authenticate;
use crate::{metrics, Gateway};

/// Every model card of the healthy upstreams, once per id (the first upstream's card).
fn merged_models(gateway: &Gateway) -> Vec<Value> {
    let mut cards: Vec<Value> = Vec::new();
    for u in &gateway.shared.pool.upstreams {
        if !u.is_healthy() {
            continue;
        }
        let models = u.models.read().unwrap_or_else(PoisonError::into_inner);
        for card in models.iter().flatten() {
            let id = card.get("id");
            if id.is_some() && !cards.iter().any(|c| c.get("id") == id) {
                cards.push(card.clone());
            }
        }
    }
    cards
}

/// `GET /v1/models`.
pub(crate) async fn list_models(
    State(gateway): State<Gateway>,
    Extension(record): Extension<Arc<Record>>,
    request: Request,
) -> Response {
    if let Err(err) = authenticate(&gateway.shared, request.headers(), &record) {
        return err.into_response();
    }
    Json(json!({"object": "list", "data": merged_models(&gateway)})).into_response()
}

/// `GET /v1/models/{model}`.
pub(crate) async fn get_model(
    State(gateway): State<Gateway>,
    Extension(record): Extension<Arc<Record>>,
    Path(model): Path<String>,
    request: Request,
) -> Response {
    if let Err(err) = authenticate(&gateway.shared, request.headers(), &record) {
        return err.into_response();
    }
    match merged_models(&gateway)
        .into_iter()
        .find(|c| c.get("id").and_then(Value::as_str) == Some(model.as_str()))
    {
        Some(card) => Json(card).into_response(),
        None => ApiError::model_not_found(&model).into_response(),
    }
}

/// `GET /health`: 200 while at least one upstream is healthy, else 503 (so that a load
/// balancer in front skips a gateway with nothing behind it).
pub(crate) async fn health(State(gateway): State<Gateway>) -> Response {
    let healthy = gateway.healthy_upstreams();
    let total = gateway.shared.pool.upstreams.len();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"healthy_upstreams": healthy, "upstreams": total});
    (status, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text.
pub(crate) async fn metrics(State(gateway): State<Gateway>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&gateway.shared),
    )
        .into_response()
}
