//! `kimi-infer agent serve` and `agent run`: the agent layer (crate kimi-agent) in front of
//! an OpenAI-compatible endpoint, or of a model loaded in this process and served to the
//! agent on a loopback port with a one-time key (the same server as `kimi-infer serve`).

pub mod args;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kimi_agent::responses::ResponseHead;
use kimi_agent::{
    Agent, AgentLimits, AgentServer, ChatModel, ContextManager, Event, Item, Message, Registry,
    RunRequest, ServerSettings, Stop, TokenCounter,
};
use kimi_engine::EngineHandle;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::args::{Command, ServeArgs};
use args::{AgentArgs, AgentCommand, AgentCommon, AgentRunArgs, AgentServeArgs};

/// The log filter of `agent serve` (None: the default).
pub fn log_filter(command: &Command) -> Option<&'static str> {
    match command {
        Command::Agent(a) if matches!(a.command, AgentCommand::Serve(_)) => {
            Some("warn,kimi_agent=info,kimi_infer=info")
        }
        _ => None,
    }
}

pub fn agent(a: AgentArgs) -> anyhow::Result<()> {
    match a.command {
        AgentCommand::Serve(s) => serve(s),
        AgentCommand::Run(r) => run(r),
    }
}

/// The model the agent drives, however it is reached.
struct ModelSetup {
    model: ChatModel,
    counter: TokenCounter,
    window: usize,
    /// The in-process engine, shut down at the end.
    engine: Option<EngineHandle>,
    /// What the model is, for the log.
    description: String,
}

/// `serve`'s flags with their defaults, for the in-process model.
#[derive(Parser)]
struct ServeDefaults {
    #[command(flatten)]
    serve: ServeArgs,
}

/// Loads the model (when in-process) before the runtime starts: loading is blocking work.
fn load_in_process(common: &AgentCommon) -> anyhow::Result<Option<crate::serve::Prepared>> {
    if common.endpoint.is_some() {
        return Ok(None);
    }
    let mut serve = ServeDefaults::try_parse_from(["serve"])
        .context("the in-process server's defaults")?
        .serve;
    serve.model = common.model.clone();
    serve.max_model_len = common.max_model_len;
    serve.chat_template = common.chat_template.clone();
    serve.tool_call_parser = common.tool_call_parser;
    serve.tokenizer = common.tokenizer.clone();
    serve.host = "127.0.0.1".into();
    serve.port = 0;
    // Requests come from this process only; a one-time key keeps other local users out.
    serve.keys.api_keys = vec![kimi_agent::message::random_id()];
    // The agent's own budget bounds a task; the loopback server does not add one.
    serve.request_timeout = 0.0;
    Ok(Some(crate::serve::prepare(&serve)?))
}

async fn connect(
    common: &AgentCommon,
    prepared: Option<crate::serve::Prepared>,
) -> anyhow::Result<ModelSetup> {
    if let Some(prepared) = prepared {
        let description = prepared.model_description().to_string();
        let crate::serve::Prepared {
            config,
            engine,
            tokenizer,
            ..
        } = prepared;
        let key = config.api_keys.first().cloned();
        let name = config.served_model_name.clone();
        let window = common
            .context_window
            .or(config.max_model_len)
            .unwrap_or(8192);
        let state = kimi_server::AppState::new(config, Arc::new(engine.clone()), tokenizer.clone())
            .context("the in-process server")?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot open a loopback port for the in-process model")?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            if let Err(e) =
                kimi_server::serve_listener(listener, state, std::future::pending()).await
            {
                tracing::error!("the in-process model server failed: {e}");
            }
        });
        let model = ChatModel::new(&format!("http://{addr}/v1"), key, name)?;
        return Ok(ModelSetup {
            model,
            counter: TokenCounter::Tokenizer(tokenizer),
            window,
            engine: Some(engine),
            description: format!("{description}, in this process"),
        });
    }
    let Some(endpoint) = &common.endpoint else {
        anyhow::bail!("no model: give --endpoint or --model");
    };
    let key = common.endpoint_api_key.clone();
    let probe = ChatModel::new(endpoint, key.clone(), String::new())?;
    let listed = probe.list_models().await;
    let (name, listed_window) = match (&common.endpoint_model, listed) {
        (Some(name), Ok(models)) => {
            let window = models.iter().find(|(id, _)| id == name).and_then(|m| m.1);
            (name.clone(), window)
        }
        (Some(name), Err(e)) => {
            tracing::warn!("cannot list the models at {endpoint} ({e}); using `{name}`");
            (name.clone(), None)
        }
        (None, Ok(models)) => match models.into_iter().next() {
            Some((id, window)) => (id, window),
            None => anyhow::bail!("{endpoint}/models lists no model; give --endpoint-model"),
        },
        (None, Err(e)) => {
            return Err(anyhow::Error::new(e).context(format!(
                "cannot list the models at {endpoint} (--endpoint-model skips this)"
            )))
        }
    };
    let counter = match &common.tokenizer {
        Some(path) => TokenCounter::Tokenizer(Arc::new(load_tokenizer(path)?)),
        None => TokenCounter::Estimate,
    };
    let window = match common.context_window.or(listed_window.map(|w| w as usize)) {
        Some(w) => w,
        None => {
            tracing::warn!(
                "the endpoint does not report its context length: assuming 8192 tokens \
                 (--context-window sets it)"
            );
            8192
        }
    };
    let model = ChatModel::new(endpoint, key, name.clone())?;
    Ok(ModelSetup {
        model,
        counter,
        window,
        engine: None,
        description: format!("`{name}` at {endpoint}"),
    })
}

fn load_tokenizer(path: &std::path::Path) -> anyhow::Result<kimi_tokenizer::Tokenizer> {
    if path.is_dir() {
        return kimi_tokenizer::Tokenizer::from_dir(path)
            .with_context(|| format!("cannot load the tokenizer in {}", path.display()));
    }
    let gguf = kimi_gguf::GgufFile::open(path)
        .with_context(|| format!("cannot open {} as a GGUF file", path.display()))?;
    kimi_tokenizer::Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot read the tokenizer of {}", path.display()))
}

async fn build_agent(common: &AgentCommon, setup: &ModelSetup) -> anyhow::Result<Agent> {
    let registry = match &common.tools {
        Some(path) => Registry::load(path).await?,
        None => Registry::empty(),
    };
    anyhow::ensure!(common.max_steps >= 1, "--max-steps must be at least 1");
    anyhow::ensure!(
        common.time_budget > 0.0,
        "--time-budget must be more than 0"
    );
    anyhow::ensure!(
        common.step_max_tokens >= 1,
        "--step-max-tokens must be at least 1"
    );
    anyhow::ensure!(
        (common.step_max_tokens as usize) < setup.window,
        "--step-max-tokens {} leaves no room for the prompt in a context window of {} tokens",
        common.step_max_tokens,
        setup.window
    );
    Ok(Agent {
        registry: Arc::new(registry),
        model: setup.model.clone(),
        context: ContextManager {
            window: setup.window,
            counter: setup.counter.clone(),
            policy: common.overflow,
        },
        limits: AgentLimits {
            max_steps: common.max_steps,
            time_budget: Duration::from_secs_f64(common.time_budget),
            token_budget: common.token_budget,
            step_max_tokens: common.step_max_tokens,
        },
    })
}

fn describe_tools(registry: &Registry) -> String {
    if registry.is_empty() {
        return "none".into();
    }
    registry
        .tools()
        .map(|t| format!("{} ({})", t.name, t.kind()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn serve(a: AgentServeArgs) -> anyhow::Result<()> {
    // Flags first: a bad key file should not wait for the weights to load.
    let keys = api_keys(&a)?;
    let tls = a.tls.load()?;
    let prepared = load_in_process(&a.common)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let signals = crate::serve::Signals::new()?;
        let setup = connect(&a.common, prepared).await?;
        let agent = Arc::new(build_agent(&a.common, &setup).await?);
        let name = a
            .served_model_name
            .clone()
            .unwrap_or_else(|| setup.model.model.clone());
        let addr = format!("{}:{}", a.host, a.port);
        let listener = TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let counting = match &setup.counter {
            TokenCounter::Tokenizer(_) => "counted with the model's tokenizer",
            TokenCounter::Estimate => "estimated at one per 3 bytes (--tokenizer counts them)",
        };
        tracing::info!("model   {}", setup.description);
        tracing::info!("tools   {}", describe_tools(&agent.registry));
        tracing::info!("sandbox {}", kimi_agent::sandbox::Sandbox::status());
        tracing::info!(
            "context {} tokens, {counting}; overflow: {:?}; up to {} steps, {} s per task",
            setup.window,
            a.common.overflow,
            a.common.max_steps,
            a.common.time_budget
        );
        if keys.is_empty() && !crate::serve::is_loopback(&a.host) {
            tracing::warn!(
                "listening on {} without --api-key: anyone who can reach this address can \
                 run this agent's tools",
                a.host
            );
        }
        let url = listener
            .local_addr()
            .map_or(addr.clone(), |a| a.to_string());
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!(
            model = %name,
            "serving the Responses API on {scheme}://{url}/v1/responses"
        );
        let server = AgentServer::new(
            Arc::clone(&agent),
            ServerSettings {
                keys: Arc::new(keys),
                listen: kimi_server::ListenConfig {
                    tls,
                    ..ServerSettings::default().listen
                },
                model_name: name,
                max_concurrent_runs: a.max_concurrent_runs,
                ..ServerSettings::default()
            },
        );
        let served = server
            .serve(listener, crate::serve::shutdown_signal(signals, 30.0))
            .await
            .context("the agent server failed");
        agent.registry.shutdown().await;
        if let Some(engine) = &setup.engine {
            engine.shutdown(false);
        }
        served
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The keys of `--api-key`, `--api-key-file` and KIMI_API_KEYS, as `serve` reads them.
fn api_keys(a: &AgentServeArgs) -> anyhow::Result<kimi_server::keys::KeySet> {
    use kimi_server::keys::{ApiKey, KeySet};
    let mut named = match &a.api_key_file {
        Some(path) => ApiKey::read_file(path)?,
        None => Vec::new(),
    };
    if let Ok(list) = std::env::var("KIMI_API_KEYS") {
        named.extend(ApiKey::parse_list(&list, "KIMI_API_KEYS")?);
    }
    if named.iter().any(|k| !k.limits.is_unlimited()) {
        tracing::warn!("per-key limits in the key file are not applied by agent serve");
    }
    let unnamed: Vec<String> = a
        .api_keys
        .iter()
        .filter(|k| !k.is_empty())
        .cloned()
        .collect();
    KeySet::build(&unnamed, &named).map_err(anyhow::Error::msg)
}

fn tool_choice(text: &str, registry: &Registry) -> anyhow::Result<Option<Value>> {
    Ok(match text {
        "auto" => None,
        "none" | "required" => Some(json!(text)),
        name => {
            anyhow::ensure!(
                registry.get(name).is_some(),
                "--tool-choice `{name}`: there is no such tool (tools: {})",
                describe_tools(registry)
            );
            Some(json!({"type": "function", "function": {"name": name}}))
        }
    })
}

fn run(a: AgentRunArgs) -> anyhow::Result<()> {
    let prepared = load_in_process(&a.common)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let setup = connect(&a.common, prepared).await?;
        let agent = build_agent(&a.common, &setup).await?;
        let mut extra = serde_json::Map::new();
        if let Some(seed) = a.seed {
            extra.insert("seed".into(), json!(seed));
        }
        let request = RunRequest {
            instructions: a.instructions.clone(),
            messages: vec![Message::User {
                content: a.prompt.clone(),
            }],
            tool_choice: tool_choice(&a.tool_choice, &agent.registry)?,
            reset_tool_choice: true,
            max_output_tokens: a.max_output_tokens,
            temperature: a.temperature,
            parallel_tool_calls: true,
            extra,
            ..RunRequest::default()
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let printer = (!a.json).then(|| {
            tokio::spawn(async move {
                let mut printer = StepPrinter::default();
                while let Some(event) = rx.recv().await {
                    printer.print(&event);
                }
            })
        });
        let outcome = agent.run(request, Some(&tx)).await;
        drop(tx);
        if let Some(printer) = printer {
            let _ = printer.await;
        }
        agent.registry.shutdown().await;
        if let Some(engine) = &setup.engine {
            engine.shutdown(false);
        }
        if a.json {
            let head = ResponseHead {
                id: format!("resp_{}", kimi_agent::message::random_id()),
                created_at: 0,
                model: setup.model.model.clone(),
                previous_response_id: None,
                store: false,
                echo: Default::default(),
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&head.finished(&outcome))?
            );
        }
        match outcome.stop {
            Stop::Completed | Stop::AwaitingClient => Ok(()),
            Stop::Incomplete(reason) => {
                eprintln!(
                    "stopped before a final answer: {reason} (after {} steps)",
                    outcome.steps
                );
                Ok(())
            }
            Stop::Failed { message, .. } => Err(anyhow::anyhow!(message)),
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// Prints a run as it goes: text as it streams, each tool call and its output, a line
/// per step.
#[derive(Default)]
struct StepPrinter {
    in_text: bool,
}

/// Lines of a tool output shown.
const SHOWN_LINES: usize = 12;

impl StepPrinter {
    fn print(&mut self, event: &Event) {
        let mut out = std::io::stdout().lock();
        let _ = match event {
            Event::TextDelta { delta, .. } => {
                self.in_text = true;
                write!(out, "{delta}")
            }
            Event::ReasoningDelta { delta, .. } => write!(out, "{delta}"),
            Event::ItemAdded {
                item: Item::Reasoning { .. },
                ..
            } => write!(out, "[thinking] "),
            Event::ItemDone { item, .. } => self.item_done(&mut out, item),
            Event::Step(log) => {
                self.end_text(&mut out);
                writeln!(
                    out,
                    "── step {}: model {} ms, {} prompt + {} output tokens{}",
                    log.step,
                    log.model_time.as_millis(),
                    log.usage.prompt_tokens,
                    log.usage.completion_tokens,
                    if log.context.is_empty() {
                        String::new()
                    } else {
                        format!("; context: {}", log.context.join("; "))
                    }
                )
            }
            _ => Ok(()),
        };
        let _ = out.flush();
    }

    fn end_text(&mut self, out: &mut impl Write) {
        if self.in_text {
            let _ = writeln!(out);
            self.in_text = false;
        }
    }

    fn item_done(&mut self, out: &mut impl Write, item: &Item) -> std::io::Result<()> {
        match item {
            Item::Reasoning { .. } => writeln!(out),
            Item::FunctionCall {
                name, arguments, ..
            } => {
                self.end_text(out);
                writeln!(out, "→ {name}({arguments})")
            }
            Item::FunctionCallOutput {
                name,
                output,
                is_error,
                ..
            } => {
                let lines: Vec<&str> = output.lines().collect();
                let mark = if *is_error { " (failed)" } else { "" };
                writeln!(out, "← {name}{mark}:")?;
                for line in lines.iter().take(SHOWN_LINES) {
                    writeln!(out, "  {line}")?;
                }
                if lines.len() > SHOWN_LINES {
                    writeln!(out, "  [... {} more lines]", lines.len() - SHOWN_LINES)?;
                }
                Ok(())
            }
            Item::Message { .. } => {
                self.end_text(out);
                Ok(())
            }
        }
    }
}
