//! The tool loop.
//!
//! ```text
//! messages ─► fit the context ─► model call (chat completions, streamed, with the tools)
//!     ▲                                  │ text / reasoning / tool calls ─► events (items)
//!     │                          no calls ─► final answer: done
//!     │                          a client tool called ─► stop, the client answers it
//!     └── tool messages ◄─ fit the outputs ◄─ registry calls, in parallel
//! stops also at: max steps, time budget, token budgets, a context that cannot fit,
//! a model error
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedSender;

use crate::context::{ContextManager, OverflowPolicy};
use crate::message::{random_id, Message, ToolCall};
use crate::model::{ChatModel, ChatRequest, Delta, Usage};
use crate::tools::{CallContext, Registry, ToolOutput};

/// Server-wide limits of one run.
#[derive(Debug, Clone)]
pub struct AgentLimits {
    /// Most model calls per run.
    pub max_steps: usize,
    /// Wall-clock budget of a run.
    pub time_budget: Duration,
    /// Most tokens (prompt + completion, summed over the steps) per run.
    pub token_budget: Option<u64>,
    /// `max_tokens` of each model call (also the room kept for the answer).
    pub step_max_tokens: u64,
}

impl Default for AgentLimits {
    fn default() -> Self {
        AgentLimits {
            max_steps: 10,
            time_budget: Duration::from_secs(300),
            token_budget: None,
            step_max_tokens: 1024,
        }
    }
}

/// The agent: tools, model, context policy, limits.
#[derive(Debug)]
pub struct Agent {
    /// The tools it runs itself.
    pub registry: Arc<Registry>,
    /// The model.
    pub model: ChatModel,
    /// Context window and policy.
    pub context: ContextManager,
    /// Limits.
    pub limits: AgentLimits,
}

/// One run's input.
#[derive(Debug, Clone, Default)]
pub struct RunRequest {
    /// Instructions (a system message first, not part of the stored conversation).
    pub instructions: Option<String>,
    /// The conversation so far, ending with the new input.
    pub messages: Vec<Message>,
    /// Function tools the client runs itself (from the request's `tools`).
    pub client_tools: Vec<Value>,
    /// `tool_choice` of the first step.
    pub tool_choice: Option<Value>,
    /// Whether later steps go back to `auto` (the default: a required or named choice
    /// would otherwise call tools forever).
    pub reset_tool_choice: bool,
    /// Most output tokens, summed over the steps.
    pub max_output_tokens: Option<u64>,
    /// Most tool calls the agent runs.
    pub max_tool_calls: Option<usize>,
    /// Fewer steps than the server's limit.
    pub max_steps: Option<usize>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Whether the model may call several tools at once.
    pub parallel_tool_calls: bool,
    /// Fields passed to every chat-completions call (`seed`, `chat_template_kwargs`, ...).
    pub extra: Map<String, Value>,
}

/// An output item (as the Responses API shows them).
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// Assistant text.
    Message {
        /// `msg_...`.
        id: String,
        /// The text.
        text: String,
        /// Whether the model stopped at its token limit.
        incomplete: bool,
    },
    /// Reasoning text.
    Reasoning {
        /// `rs_...`.
        id: String,
        /// The text.
        text: String,
    },
    /// A tool call.
    FunctionCall {
        /// `fc_...`.
        id: String,
        /// The model's call id.
        call_id: String,
        /// Function name.
        name: String,
        /// Arguments (JSON text as the model wrote it).
        arguments: String,
    },
    /// A tool's result, as the model received it.
    FunctionCallOutput {
        /// `fco_...`.
        id: String,
        /// The call answered.
        call_id: String,
        /// The tool.
        name: String,
        /// The text.
        output: String,
        /// Whether the call failed.
        is_error: bool,
    },
}

/// What a run reports as it goes.
#[derive(Debug, Clone)]
pub enum Event {
    /// An item begins (text and arguments empty).
    ItemAdded {
        /// Its place in the output.
        index: usize,
        /// The item.
        item: Item,
    },
    /// More text of a message item.
    TextDelta {
        /// The item.
        index: usize,
        /// The text.
        delta: String,
    },
    /// More reasoning text.
    ReasoningDelta {
        /// The item.
        index: usize,
        /// The text.
        delta: String,
    },
    /// More arguments of a function call.
    ArgumentsDelta {
        /// The item.
        index: usize,
        /// The text.
        delta: String,
    },
    /// An item is complete.
    ItemDone {
        /// Its place in the output.
        index: usize,
        /// The item.
        item: Item,
    },
    /// A step finished.
    Step(StepLog),
}

/// One step, for logs and `agent run`.
#[derive(Debug, Clone)]
pub struct StepLog {
    /// 1-based.
    pub step: usize,
    /// Time of the model call.
    pub model_time: Duration,
    /// Tokens of the call.
    pub usage: Usage,
    /// Tool calls: name, failed, time.
    pub tools: Vec<(String, bool, Duration)>,
    /// Context-management actions.
    pub context: Vec<String>,
}

/// Why a run stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    /// A final answer.
    Completed,
    /// The model called a client tool: the client runs it and continues the conversation.
    AwaitingClient,
    /// A limit: `max_steps`, `max_time`, `max_output_tokens`, `max_tokens`,
    /// `context_length`.
    Incomplete(&'static str),
    /// The model endpoint failed.
    Failed {
        /// OpenAI-style code.
        code: String,
        /// What happened.
        message: String,
    },
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Output items in order.
    pub items: Vec<Item>,
    /// The conversation after the run (without the instructions).
    pub messages: Vec<Message>,
    /// Tokens over all steps.
    pub usage: Usage,
    /// Why it stopped.
    pub stop: Stop,
    /// Model calls made.
    pub steps: usize,
}

struct Emitter<'a> {
    items: Vec<Item>,
    sink: Option<&'a UnboundedSender<Event>>,
}

impl Emitter<'_> {
    fn send(&self, event: Event) {
        if let Some(sink) = self.sink {
            let _ = sink.send(event);
        }
    }

    fn add(&mut self, item: Item) -> usize {
        let index = self.items.len();
        self.items.push(item.clone());
        self.send(Event::ItemAdded { index, item });
        index
    }

    fn done(&mut self, index: usize, item: Item) {
        self.items[index] = item.clone();
        self.send(Event::ItemDone { index, item });
    }
}

impl Agent {
    /// Runs the loop. `events` (if given) receives every item as it forms; the outcome
    /// holds them too.
    pub async fn run(
        &self,
        request: RunRequest,
        events: Option<&UnboundedSender<Event>>,
    ) -> RunOutcome {
        let workdir = match &self.registry.sandbox().workdir {
            Some(dir) => Ok((dir.clone(), None)),
            None => tempfile::Builder::new()
                .prefix("kimi-agent-")
                .tempdir()
                .map(|d| (d.path().to_owned(), Some(d))),
        };
        let (workdir, _guard) = match workdir {
            Ok(w) => w,
            Err(e) => {
                return RunOutcome {
                    items: Vec::new(),
                    messages: request.messages,
                    usage: Usage::default(),
                    stop: Stop::Failed {
                        code: "server_error".into(),
                        message: format!("cannot create the tools' working directory: {e}"),
                    },
                    steps: 0,
                }
            }
        };
        let ctx = CallContext { workdir };
        self.run_in(request, events, &ctx).await
    }

    async fn run_in(
        &self,
        request: RunRequest,
        events: Option<&UnboundedSender<Event>>,
        ctx: &CallContext,
    ) -> RunOutcome {
        let start = Instant::now();
        let deadline = start + self.limits.time_budget;
        let max_steps = request
            .max_steps
            .map_or(self.limits.max_steps, |n| n.clamp(1, self.limits.max_steps));
        let mut out = Emitter {
            items: Vec::new(),
            sink: events,
        };
        let mut messages = request.messages.clone();
        let mut usage = Usage::default();
        let mut tool_calls_run = 0usize;
        let client_names: Vec<String> = request
            .client_tools
            .iter()
            .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
            .map(str::to_owned)
            .collect();
        let mut specs = self.registry.function_specs();
        specs.extend(request.client_tools.iter().cloned());
        let tools_tokens = self.context.tools_tokens(&specs);
        let instructions = request.instructions.as_ref().map(|text| Message::System {
            content: text.clone(),
        });
        let mut steps = 0;
        let stop = loop {
            if steps >= max_steps {
                break Stop::Incomplete("max_steps");
            }
            let now = Instant::now();
            if now >= deadline {
                break Stop::Incomplete("max_time");
            }
            let output_left = request
                .max_output_tokens
                .map(|m| m.saturating_sub(usage.completion_tokens));
            if output_left == Some(0) {
                break Stop::Incomplete("max_output_tokens");
            }
            if let Some(budget) = self.limits.token_budget {
                if usage.prompt_tokens + usage.completion_tokens >= budget {
                    break Stop::Incomplete("max_tokens");
                }
            }
            steps += 1;
            let step_max = output_left.map_or(self.limits.step_max_tokens, |l| {
                l.min(self.limits.step_max_tokens)
            });
            // The conversation the model sees: instructions first, then the history fitted
            // to the window (with room for the answer).
            let fixed = tools_tokens
                + step_max as usize
                + instructions
                    .as_ref()
                    .map_or(0, |m| self.context.message_tokens(m));
            let context_notes = match self.context.fit(&mut messages, fixed) {
                Ok(notes) => notes,
                Err(e) => {
                    tracing::warn!(target: "kimi_agent::loop", "step {steps}: {e}");
                    break Stop::Incomplete("context_length");
                }
            };
            let mut prompt: Vec<Message> = instructions.iter().cloned().collect();
            prompt.extend(messages.iter().cloned());
            let calls_exhausted = request
                .max_tool_calls
                .is_some_and(|max| tool_calls_run >= max);
            let tool_choice = if calls_exhausted {
                Some(json!("none"))
            } else if steps == 1 || !request.reset_tool_choice {
                request.tool_choice.clone()
            } else {
                None
            };
            let chat = ChatRequest {
                messages: prompt,
                tools: specs.clone(),
                tool_choice,
                max_tokens: Some(step_max),
                temperature: request.temperature,
                top_p: request.top_p,
                parallel_tool_calls: (!specs.is_empty()).then_some(request.parallel_tool_calls),
                extra: request.extra.clone(),
            };
            let model_start = Instant::now();
            let turn = self
                .model_turn(
                    &chat,
                    deadline.saturating_duration_since(model_start),
                    &mut out,
                )
                .await;
            let model_time = model_start.elapsed();
            let (turn, message_index) = match turn {
                Ok(t) => t,
                Err(stop) => break stop,
            };
            let mut step_usage = turn.usage;
            if step_usage.prompt_tokens == 0 {
                step_usage.prompt_tokens =
                    (self.context.conversation_tokens(&chat.messages) + tools_tokens) as u64;
            }
            if step_usage.completion_tokens == 0 {
                let text: usize = turn
                    .tool_calls
                    .iter()
                    .map(|c| self.context.counter.count(&c.arguments))
                    .sum::<usize>()
                    + self.context.counter.count(&turn.content);
                step_usage.completion_tokens = text as u64;
            }
            usage += step_usage;
            messages.push(Message::Assistant {
                content: turn.content.clone(),
                reasoning: turn.reasoning.clone(),
                tool_calls: turn.tool_calls.clone(),
            });
            let mut log = StepLog {
                step: steps,
                model_time,
                usage: step_usage,
                tools: Vec::new(),
                context: context_notes,
            };
            if turn.tool_calls.is_empty() {
                let cut_short = turn.finish_reason.as_deref() == Some("length");
                self.log_step(&log, &out);
                if cut_short && message_index.is_some() {
                    break Stop::Incomplete("max_output_tokens");
                }
                break Stop::Completed;
            }
            // Client tools end the run: their outputs come with the next request.
            let awaits_client = turn
                .tool_calls
                .iter()
                .any(|c| client_names.contains(&c.name) && self.registry.get(&c.name).is_none());
            let ours: Vec<&ToolCall> = turn
                .tool_calls
                .iter()
                .filter(|c| !client_names.contains(&c.name) || self.registry.get(&c.name).is_some())
                .collect();
            let results = self
                .run_tools(
                    &ours,
                    &mut tool_calls_run,
                    request.max_tool_calls,
                    deadline,
                    ctx,
                )
                .await;
            let outputs = self
                .fit_outputs(&ours, results, &messages, fixed, &chat.messages, &mut log)
                .await;
            for (call, (output, elapsed)) in ours.iter().zip(outputs) {
                log.tools
                    .push((call.name.clone(), output.is_error, elapsed));
                let item = Item::FunctionCallOutput {
                    id: format!("fco_{}", random_id()),
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    output: output.text.clone(),
                    is_error: output.is_error,
                };
                let index = out.add(item.clone());
                out.done(index, item);
                messages.push(Message::Tool {
                    call_id: call.id.clone(),
                    content: output.text,
                });
            }
            self.log_step(&log, &out);
            if awaits_client {
                break Stop::AwaitingClient;
            }
        };
        RunOutcome {
            items: out.items,
            messages,
            usage,
            stop,
            steps,
        }
    }

    fn log_step(&self, log: &StepLog, out: &Emitter<'_>) {
        let tools: Vec<String> = log
            .tools
            .iter()
            .map(|(name, failed, t)| {
                format!(
                    "{name} ({}, {} ms)",
                    if *failed { "error" } else { "ok" },
                    t.as_millis()
                )
            })
            .collect();
        tracing::info!(
            target: "kimi_agent::loop",
            "step {}: model {} ms, {} prompt + {} completion tokens{}{}",
            log.step,
            log.model_time.as_millis(),
            log.usage.prompt_tokens,
            log.usage.completion_tokens,
            if tools.is_empty() {
                String::new()
            } else {
                format!("; tools: {}", tools.join(", "))
            },
            if log.context.is_empty() {
                String::new()
            } else {
                format!("; context: {}", log.context.join("; "))
            }
        );
        out.send(Event::Step(log.clone()));
    }

    /// One streamed model call, its pieces turned into items as they arrive. Returns the
    /// turn and the index of its message item, if it has text.
    async fn model_turn(
        &self,
        chat: &ChatRequest,
        time_left: Duration,
        out: &mut Emitter<'_>,
    ) -> Result<(crate::model::ChatTurn, Option<usize>), Stop> {
        let first_item = out.items.len();
        let mut reasoning_index: Option<usize> = None;
        let mut message_index: Option<usize> = None;
        let mut call_indices: Vec<usize> = Vec::new();
        let mut pending_calls: Vec<(String, String)> = Vec::new();
        let result = {
            let mut on_delta = |delta: Delta| match delta {
                Delta::Reasoning(text) => {
                    let index = *reasoning_index.get_or_insert_with(|| {
                        out.add(Item::Reasoning {
                            id: format!("rs_{}", random_id()),
                            text: String::new(),
                        })
                    });
                    append(&mut out.items[index], &text);
                    out.send(Event::ReasoningDelta { index, delta: text });
                }
                Delta::Content(text) => {
                    let index = *message_index.get_or_insert_with(|| {
                        out.add(Item::Message {
                            id: format!("msg_{}", random_id()),
                            text: String::new(),
                            incomplete: false,
                        })
                    });
                    append(&mut out.items[index], &text);
                    out.send(Event::TextDelta { index, delta: text });
                }
                Delta::ToolCallStart { index: _, name } => {
                    let call_id = format!("call_{}", random_id());
                    pending_calls.push((name.clone(), call_id.clone()));
                    let index = out.add(Item::FunctionCall {
                        id: format!("fc_{}", random_id()),
                        call_id,
                        name,
                        arguments: String::new(),
                    });
                    call_indices.push(index);
                }
                Delta::ToolCallArguments { index, text } => {
                    if let Some(&item_index) = call_indices.get(index) {
                        append(&mut out.items[item_index], &text);
                        out.send(Event::ArgumentsDelta {
                            index: item_index,
                            delta: text,
                        });
                    }
                }
            };
            if time_left.is_zero() {
                Err(crate::error::ModelError::Timeout(0.0))
            } else {
                self.model.complete(chat, time_left, &mut on_delta).await
            }
        };
        let mut turn = match result {
            Ok(turn) => turn,
            Err(e) => {
                // Items this call began end as they are.
                for index in first_item..out.items.len() {
                    let item = out.items[index].clone();
                    out.send(Event::ItemDone { index, item });
                }
                let stop = match &e {
                    crate::error::ModelError::Timeout(_) => Stop::Incomplete("max_time"),
                    crate::error::ModelError::Status { code, message, .. }
                        if code.as_deref() == Some("context_length_exceeded") =>
                    {
                        tracing::warn!(target: "kimi_agent::loop", "{message}");
                        Stop::Incomplete("context_length")
                    }
                    _ => Stop::Failed {
                        code: "model_error".into(),
                        message: e.to_string(),
                    },
                };
                return Err(stop);
            }
        };
        // The call ids the items announced are the ones the conversation uses, so that
        // the client sees the same ids in function_call and function_call_output items.
        for (i, call) in turn.tool_calls.iter_mut().enumerate() {
            if let Some((_, call_id)) = pending_calls.get(i) {
                call.id = call_id.clone();
            }
        }
        let length = turn.finish_reason.as_deref() == Some("length");
        if let Some(index) = reasoning_index {
            let item = out.items[index].clone();
            out.done(index, item);
        }
        if let Some(index) = message_index {
            if let Item::Message { incomplete, .. } = &mut out.items[index] {
                *incomplete = length && turn.tool_calls.is_empty();
            }
            let item = out.items[index].clone();
            out.done(index, item);
        } else if turn.tool_calls.is_empty() {
            // A final answer with no text still gets its (empty) message.
            let item = Item::Message {
                id: format!("msg_{}", random_id()),
                text: String::new(),
                incomplete: length,
            };
            let index = out.add(item.clone());
            out.done(index, item);
            message_index = Some(index);
        }
        for (i, &index) in call_indices.iter().enumerate() {
            if let (
                Item::FunctionCall {
                    arguments, name, ..
                },
                Some(call),
            ) = (&mut out.items[index], turn.tool_calls.get(i))
            {
                // The accumulated call is authoritative (names can arrive late).
                arguments.clone_from(&call.arguments);
                name.clone_from(&call.name);
            }
            let item = out.items[index].clone();
            out.done(index, item);
        }
        Ok((turn, message_index))
    }

    /// Runs the calls in parallel; each result comes with its time. Calls past
    /// `max_tool_calls` or the time budget get an error instead.
    async fn run_tools(
        &self,
        calls: &[&ToolCall],
        run_so_far: &mut usize,
        max_calls: Option<usize>,
        deadline: Instant,
        ctx: &CallContext,
    ) -> Vec<(ToolOutput, Duration)> {
        let futures = calls.iter().map(|call| {
            let allowed = max_calls.is_none_or(|max| *run_so_far < max);
            if allowed {
                *run_so_far += 1;
            }
            async move {
                let started = Instant::now();
                if !allowed {
                    return (
                        ToolOutput::error(format!(
                            "not run: this response's limit of {} tool calls is reached; \
                             answer with what you have",
                            max_calls.unwrap_or(0)
                        )),
                        Duration::ZERO,
                    );
                }
                let left = deadline.saturating_duration_since(started);
                let output = match tokio::time::timeout(
                    left,
                    self.registry.call(&call.name, &call.arguments, ctx),
                )
                .await
                {
                    Ok(output) => output,
                    Err(_) => ToolOutput::error(
                        "the agent's time budget ran out while the tool was running",
                    ),
                };
                (output, started.elapsed())
            }
        });
        futures_util::future::join_all(futures).await
    }

    /// The outputs cut (or summarised) to share the room left in the window.
    async fn fit_outputs(
        &self,
        calls: &[&ToolCall],
        results: Vec<(ToolOutput, Duration)>,
        messages: &[Message],
        fixed: usize,
        prompt: &[Message],
        log: &mut StepLog,
    ) -> Vec<(ToolOutput, Duration)> {
        let used = self.context.conversation_tokens(messages) + fixed;
        let overhead = crate::context::MESSAGE_OVERHEAD * results.len();
        let available = self.context.window.saturating_sub(used + overhead);
        let sizes: Vec<usize> = results
            .iter()
            .map(|(o, _)| self.context.counter.count(&o.text))
            .collect();
        let budgets = self.context.output_budgets(available, &sizes);
        let task = prompt.iter().rev().find_map(|m| match m {
            Message::User { content } => Some(content.as_str()),
            _ => None,
        });
        let mut fitted = Vec::with_capacity(results.len());
        for (i, (mut output, elapsed)) in results.into_iter().enumerate() {
            if sizes[i] > budgets[i] {
                let name = calls.get(i).map_or("?", |c| c.name.as_str());
                let summary = if self.context.policy == OverflowPolicy::Summarize {
                    self.summarize(name, &output.text, budgets[i], task.unwrap_or(""))
                        .await
                } else {
                    None
                };
                match summary {
                    Some(text) => {
                        log.context.push(format!(
                            "the output of `{name}` ({} tokens) was summarised by the model",
                            sizes[i]
                        ));
                        output.text = text;
                    }
                    None => {
                        let (text, elided) = self.context.truncate(&output.text, budgets[i]);
                        log.context.push(format!(
                            "the output of `{name}` was cut by {elided} of {} tokens",
                            sizes[i]
                        ));
                        output.text = text;
                    }
                }
            }
            fitted.push((output, elapsed));
        }
        fitted
    }

    /// The model's summary of a tool output, within `budget` tokens; `None` if it fails.
    async fn summarize(&self, tool: &str, text: &str, budget: usize, task: &str) -> Option<String> {
        let room = self
            .context
            .window
            .saturating_sub(budget + 256 + self.context.counter.count(task));
        let (input, _) = self.context.truncate(text, room);
        let chat = ChatRequest {
            messages: vec![
                Message::System {
                    content: "You condense tool output for an assistant working on a task. Keep \
                              every fact, number, name, path and error the task may need; drop \
                              repetition. Answer with the condensed output only."
                        .into(),
                },
                Message::User {
                    content: format!("Task: {task}\n\nOutput of the tool `{tool}`:\n{input}"),
                },
            ],
            max_tokens: Some(budget.max(16) as u64),
            temperature: Some(0.0),
            ..ChatRequest::default()
        };
        let mut ignore = |_: Delta| {};
        match self
            .model
            .complete(&chat, Duration::from_secs(120), &mut ignore)
            .await
        {
            Ok(turn) if !turn.content.trim().is_empty() => {
                let (summary, _) = self.context.truncate(&turn.content, budget);
                Some(format!(
                    "[summary by the model of {} tokens of tool output]\n{summary}",
                    self.context.counter.count(text)
                ))
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(target: "kimi_agent::loop", "summarising `{tool}`'s output failed: {e}");
                None
            }
        }
    }
}

fn append(item: &mut Item, text: &str) {
    match item {
        Item::Message { text: t, .. } | Item::Reasoning { text: t, .. } => t.push_str(text),
        Item::FunctionCall { arguments, .. } => arguments.push_str(text),
        Item::FunctionCallOutput { .. } => {}
    }
}
