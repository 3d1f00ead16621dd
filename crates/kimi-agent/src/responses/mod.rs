//! The agent server: OpenAI's Responses API in front of the tool loop.
//!
//! ```text
//! POST /v1/responses ─► auth (kimi-server's API keys) ─► parse ─► conversation of
//!     previous_response_id (from the store) + input ─► Agent::run
//!        stream: false ─► the response object (every step as output items)
//!        stream: true  ─► SSE: response.created, output_item.added, output_text.delta,
//!                         function_call_arguments.delta, output_item.done, ...,
//!                         response.completed | incomplete | failed
//! GET /v1/responses/{id}, DELETE /v1/responses/{id}, GET /v1/models, GET /health
//! ```

mod output;
mod request;
mod store;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use kimi_server::keys::KeySet;
use kimi_server::{ApiError, ConnectionCounters, ListenConfig};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::agent::{Agent, Event, RunOutcome, Stop};
use crate::message::random_id;
pub use output::{item_json, ResponseHead};
pub use store::ResponseStore;

/// Settings of the agent server.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Accepted API keys (none: no authentication), as `serve` takes them.
    pub keys: Arc<KeySet>,
    /// Connections, header timeouts and TLS (kimi-server's listener).
    pub listen: ListenConfig,
    /// The model name clients send and `/v1/models` lists.
    pub model_name: String,
    /// Runs at once; more get 429.
    pub max_concurrent_runs: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Responses kept for `previous_response_id`.
    pub store_entries: usize,
    /// Bytes the kept responses may take.
    pub store_bytes: usize,
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            keys: Arc::new(KeySet::default()),
            listen: ListenConfig {
                max_connections: 1024,
                keep_alive_timeout: Some(std::time::Duration::from_secs(5)),
                shutdown_timeout: Some(std::time::Duration::from_secs(30)),
                tls: None,
            },
            model_name: "kimi-agent".into(),
            max_concurrent_runs: 64,
            max_body_bytes: 32 << 20,
            store_entries: 1024,
            store_bytes: 256 << 20,
        }
    }
}

struct Shared {
    agent: Arc<Agent>,
    settings: ServerSettings,
    store: Mutex<ResponseStore>,
    runs: Arc<Semaphore>,
}

/// The server's state.
#[derive(Clone)]
pub struct AgentServer {
    shared: Arc<Shared>,
}

impl AgentServer {
    /// A server for `agent`.
    pub fn new(agent: Arc<Agent>, settings: ServerSettings) -> AgentServer {
        let store = ResponseStore::new(settings.store_entries, settings.store_bytes);
        let runs = Arc::new(Semaphore::new(settings.max_concurrent_runs.max(1)));
        AgentServer {
            shared: Arc::new(Shared {
                agent,
                settings,
                store: Mutex::new(store),
                runs,
            }),
        }
    }

    /// Every route.
    pub fn router(&self) -> Router {
        let protected = Router::new()
            .route("/v1/responses", post(create_response))
            .route(
                "/v1/responses/{id}",
                get(retrieve_response).delete(delete_response),
            )
            .route("/v1/models", get(list_models))
            .route_layer(middleware::from_fn_with_state(self.clone(), require_key));
        Router::new()
            .merge(protected)
            .route("/health", get(|| async { StatusCode::OK }))
            .fallback(|uri: axum::http::Uri| async move { ApiError::route_not_found(uri.path()) })
            .layer(DefaultBodyLimit::max(self.shared.settings.max_body_bytes))
            .with_state(self.clone())
    }

    /// Serves on `listener` (kimi-server's listener: connection cap, header timeouts,
    /// TLS) until `shutdown` resolves, then lets open requests finish.
    ///
    /// # Errors
    ///
    /// What stopped serving.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), kimi_server::ServerError> {
        let listen = self.shared.settings.listen.clone();
        let counters = Arc::new(ConnectionCounters::default());
        kimi_server::serve_app(listener, self.router(), listen, counters, shutdown).await
    }
}

async fn require_key(State(server): State<AgentServer>, request: Request, next: Next) -> Response {
    let keys = &server.shared.settings.keys;
    if keys.is_empty() || keys.authenticate(request.headers()).is_some() {
        next.run(request).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

async fn list_models(State(server): State<AgentServer>) -> Json<Value> {
    let s = &server.shared;
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.settings.model_name,
            "object": "model",
            "created": output::now(),
            "owned_by": "kimi-infer",
            "max_model_len": s.agent.context.window,
        }]
    }))
}

fn not_found(id: &str) -> ApiError {
    let mut err = ApiError::invalid(format!("No response found with id '{id}'."), None);
    err.status = StatusCode::NOT_FOUND;
    err
}

async fn retrieve_response(
    State(server): State<AgentServer>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let found = server
        .shared
        .store
        .lock()
        .ok()
        .and_then(|s| s.get(&id))
        .ok_or_else(|| not_found(&id))?;
    Ok(Json(found.response.clone()))
}

async fn delete_response(
    State(server): State<AgentServer>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let removed = server
        .shared
        .store
        .lock()
        .ok()
        .and_then(|mut s| s.remove(&id));
    match removed {
        Some(_) => Ok(Json(
            json!({"id": id, "object": "response.deleted", "deleted": true}),
        )),
        None => Err(not_found(&id)),
    }
}

async fn create_response(State(server): State<AgentServer>, body: Bytes) -> Response {
    match prepare(&server, &body) {
        Ok(prepared) => {
            if prepared.stream {
                stream_response(server, prepared).into_response()
            } else {
                whole_response(server, prepared).await
            }
        }
        Err(e) => e.into_response(),
    }
}

struct Prepared {
    head: ResponseHead,
    run: crate::agent::RunRequest,
    stream: bool,
    permit: OwnedSemaphorePermit,
}

fn prepare(server: &AgentServer, body: &Bytes) -> Result<Prepared, ApiError> {
    let shared = &server.shared;
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("The body is not valid JSON: {e}"), None))?;
    let mut parsed = request::parse(&value, &shared.settings.model_name)?;
    if let Some(previous) = &parsed.previous_response_id {
        let stored = shared
            .store
            .lock()
            .ok()
            .and_then(|s| s.get(previous))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("Previous response with id '{previous}' not found."),
                    Some("previous_response_id"),
                )
            })?;
        let mut conversation = stored.conversation.clone();
        conversation.append(&mut parsed.run.messages);
        parsed.run.messages = conversation;
    }
    let permit = Arc::clone(&shared.runs).try_acquire_owned().map_err(|_| {
        ApiError::overloaded(format!(
            "{} agent runs are in progress (the server's limit); retry later",
            shared.settings.max_concurrent_runs
        ))
    })?;
    let head = ResponseHead {
        id: format!("resp_{}", random_id()),
        created_at: output::now(),
        model: shared.settings.model_name.clone(),
        previous_response_id: parsed.previous_response_id,
        store: parsed.store,
        echo: parsed.echo,
    };
    Ok(Prepared {
        head,
        run: parsed.run,
        stream: parsed.stream,
        permit,
    })
}

fn keep(server: &AgentServer, head: &ResponseHead, response: &Value, outcome: RunOutcome) {
    if !head.store {
        return;
    }
    if let Ok(mut store) = server.shared.store.lock() {
        store.insert(head.id.clone(), response.clone(), outcome.messages);
    }
}

async fn whole_response(server: AgentServer, prepared: Prepared) -> Response {
    let Prepared {
        head, run, permit, ..
    } = prepared;
    let agent = Arc::clone(&server.shared.agent);
    // On its own task, so that a client that hangs up does not cut a tool call short in a
    // way that leaves no record; the permit ends with the run.
    let task = tokio::spawn(async move {
        let outcome = agent.run(run, None).await;
        drop(permit);
        outcome
    });
    let outcome = match task.await {
        Ok(outcome) => outcome,
        Err(e) => return ApiError::internal(format!("the agent run failed: {e}")).into_response(),
    };
    if let Stop::Failed { message, .. } = &outcome.stop {
        if outcome.items.is_empty() {
            let mut err = ApiError::internal(message.clone());
            err.status = StatusCode::BAD_GATEWAY;
            return err.into_response();
        }
    }
    let response = head.finished(&outcome);
    keep(&server, &head, &response, outcome);
    Json(response).into_response()
}

/// Aborts the run when the stream is dropped (the client went away).
struct AbortOnDrop(tokio::task::JoinHandle<RunOutcome>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct StreamState {
    server: AgentServer,
    head: ResponseHead,
    events: mpsc::UnboundedReceiver<Event>,
    task: Option<AbortOnDrop>,
    writer: output::EventWriter,
    pending: VecDeque<(String, Value)>,
}

fn stream_response(
    server: AgentServer,
    prepared: Prepared,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let Prepared {
        head, run, permit, ..
    } = prepared;
    let (tx, rx) = mpsc::unbounded_channel();
    let agent = Arc::clone(&server.shared.agent);
    let task = tokio::spawn(async move {
        let outcome = agent.run(run, Some(&tx)).await;
        drop(permit);
        outcome
    });
    let mut writer = output::EventWriter::default();
    let pending: VecDeque<_> = writer.start(&head.in_progress()).into();
    let state = StreamState {
        server,
        head,
        events: rx,
        task: Some(AbortOnDrop(task)),
        writer,
        pending,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some((kind, data)) = s.pending.pop_front() {
                let event = SseEvent::default().event(kind).data(data.to_string());
                return Some((Ok(event), s));
            }
            let task = s.task.as_mut()?;
            match s.events.recv().await {
                Some(event) => {
                    let events = s.writer.translate(&event);
                    s.pending.extend(events);
                }
                None => {
                    // The run is over (its sender is gone).
                    let joined = (&mut task.0).await;
                    s.task = None;
                    match joined {
                        Ok(outcome) => {
                            let response = s.head.finished(&outcome);
                            let finish = s.writer.finish(&response);
                            keep(&s.server, &s.head, &response, outcome);
                            s.pending.push_back(finish);
                        }
                        Err(e) => {
                            let error = s
                                .writer
                                .error("server_error", &format!("the agent run failed: {e}"));
                            s.pending.push_back(error);
                        }
                    }
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}
