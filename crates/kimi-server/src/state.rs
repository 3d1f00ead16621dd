//! [`AppState`]: what every handler shares.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kimi_tokenizer::{Bounded, ChatTemplate, Tokenizer, TokenizerError, XtmlPrompt};

use crate::config::ServerConfig;
use crate::constraint::Constraints;
use crate::error::{ApiError, ServerError};
use crate::generator::Generator;
use crate::keys::KeySet;
use crate::metrics::Metrics;
use crate::tool_format::{ToolCallParser, ToolFormat};
use crate::xtml_output::XtmlTokens;

/// How chat messages become a prompt and generated tokens become a message. Chosen once, in
/// [`AppState::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChatFormat {
    /// A Jinja chat template (`--chat-template`, or the tokenizer's): Kimi K2's format and
    /// others; K2 tool-call tokens are parsed when the tokenizer has them.
    Template,
    /// Kimi K3's XTML, rendered by `kimi_tokenizer::xtml` (K3 ships no template): chosen
    /// when there is no template and the tokenizer has `<|open|>`, `<|sep|>`, `<|close|>`
    /// and `<|end_of_msg|>`.
    Xtml(XtmlTokens),
    /// Neither: chat requests are refused.
    Unavailable,
}

impl ChatFormat {
    fn choose(has_template: bool, tokenizer: &Tokenizer) -> ChatFormat {
        match XtmlTokens::find(tokenizer) {
            _ if has_template => ChatFormat::Template,
            Some(tokens) => ChatFormat::Xtml(tokens),
            None => ChatFormat::Unavailable,
        }
    }
}

/// The server's shared state: configuration, engine, tokenizer, grammar compiler, metrics.
/// Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.inner.config)
            .field("max_model_len", &self.inner.max_model_len)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub config: ServerConfig,
    /// `config.api_keys` and `config.keys`.
    pub keys: KeySet,
    /// `config.cors`, built.
    pub cors: Option<tower_http::cors::CorsLayer>,
    pub generator: Arc<dyn Generator>,
    pub tokenizer: Arc<Tokenizer>,
    /// `config.chat_template`, compiled.
    pub chat_template_override: Option<ChatTemplate>,
    pub chat_format: ChatFormat,
    pub constraints: Constraints,
    /// How a template-based model writes tool calls (`None` for XTML and template-less
    /// models).
    pub tool_format: Option<ToolFormat>,
    pub metrics: Metrics,
    /// Sequences in flight (see [`Permit`]).
    pub num_pending: AtomicUsize,
    /// `min(config.max_model_len, engine's)`.
    pub max_model_len: usize,
    /// Logits per row.
    pub vocab_size: usize,
    /// Unix seconds at start (`created` of `/v1/models`).
    pub created: u64,
    next_id: AtomicU64,
}

/// Unix time in seconds.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl AppState {
    /// Prepares the state: compiles the chat-template override and the token trie for
    /// constrained decoding.
    ///
    /// # Errors
    ///
    /// [`ServerError::Config`] for a bad template or limit, [`ServerError::Constraint`] if the
    /// token trie cannot be built.
    pub fn new(
        config: ServerConfig,
        generator: Arc<dyn Generator>,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<AppState, ServerError> {
        if config.max_pending_requests == 0 {
            return Err(ServerError::Config(
                "max_pending_requests must be at least 1".into(),
            ));
        }
        let keys = KeySet::build(&config.api_keys, &config.keys).map_err(ServerError::Config)?;
        let cors = match &config.cors {
            Some(cors) => Some(cors.layer().map_err(ServerError::Config)?),
            None => None,
        };
        let token_text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_bytes(id))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        let chat_template_override = match &config.chat_template {
            Some(source) => Some(
                ChatTemplate::new(
                    source,
                    token_text(tokenizer.bos_id()),
                    token_text(tokenizer.eos_ids().first().copied()),
                )
                .map_err(|e| ServerError::Config(e.to_string()))?,
            ),
            None => None,
        };
        let vocab_size = generator.vocab_size();
        let engine_len = generator.max_model_len();
        let max_model_len = config
            .max_model_len
            .map_or(engine_len, |m| m.min(engine_len));
        let constraints = Constraints::new(&tokenizer, vocab_size)?;
        let template_source = chat_template_override
            .as_ref()
            .or_else(|| tokenizer.chat_template())
            .map(|t| t.source().to_string());
        let chat_format = ChatFormat::choose(template_source.is_some(), &tokenizer);
        let tool_format = match chat_format {
            ChatFormat::Template => Some(
                ToolFormat::choose(
                    config.tool_call_parser,
                    template_source.as_deref(),
                    &tokenizer,
                )
                .map_err(ServerError::Config)?,
            ),
            // K3's XTML has its own tool format.
            ChatFormat::Xtml(_)
                if !matches!(
                    config.tool_call_parser,
                    ToolCallParser::Auto | ToolCallParser::Kimi
                ) =>
            {
                return Err(ServerError::Config(format!(
                    "--tool-call-parser {} does not apply: this model speaks Kimi K3's XTML,                      whose tool calls need no parser option",
                    config.tool_call_parser
                )));
            }
            ChatFormat::Xtml(_) | ChatFormat::Unavailable => None,
        };
        tracing::debug!("chat format: {chat_format:?}");
        if let Some(format) = &tool_format {
            tracing::info!("tool calls: {} format", format.name());
        }
        let metrics = Metrics::new(&config.served_model_name);
        Ok(AppState {
            inner: Arc::new(Inner {
                config,
                keys,
                cors,
                generator,
                tokenizer,
                chat_template_override,
                chat_format,
                constraints,
                tool_format,
                metrics,
                num_pending: AtomicUsize::new(0),
                max_model_len,
                vocab_size,
                created: unix_now(),
                next_id: AtomicU64::new(0),
            }),
        })
    }

    /// The configuration it serves with.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    /// The longest prompt + output this server accepts.
    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
}

impl Inner {
    /// The chat template in use.
    pub(crate) fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template_override
            .as_ref()
            .or_else(|| self.tokenizer.chat_template())
    }

    /// Tokenizes a prompt (`param` names its field), refusing one with more than
    /// `max_model_len` tokens before the work grows with its length: a 30 MB message costs
    /// a length check, not a tokenization.
    pub(crate) fn encode_prompt(
        &self,
        text: &str,
        allow_special: bool,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        let bounded = self
            .tokenizer
            .encode_within(text, allow_special, self.max_model_len);
        self.prompt_ids(bounded, param)
    }

    /// [`Self::encode_prompt`] for an XTML prompt.
    pub(crate) fn encode_xtml_prompt(
        &self,
        prompt: &XtmlPrompt,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        let bounded = self
            .tokenizer
            .encode_xtml_within(prompt, self.max_model_len);
        self.prompt_ids(bounded, param)
    }

    fn prompt_ids(
        &self,
        bounded: Result<Bounded, TokenizerError>,
        param: &str,
    ) -> Result<Vec<u32>, ApiError> {
        match bounded {
            Ok(Bounded::Fits(ids)) => Ok(ids),
            Ok(Bounded::TooLong { at_least }) => Err(ApiError::context_length_exceeded(
                format!(
                    "This model's maximum context length is {} tokens. However, your prompt \
                     has at least {at_least} tokens.",
                    self.max_model_len
                ),
                param,
            )),
            Err(e) => Err(ApiError::invalid(
                format!("Cannot tokenize the prompt: {e}"),
                Some(param),
            )),
        }
    }

    /// A fresh response id such as `chatcmpl-0193…`.
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("{prefix}-{:x}{nanos:08x}{n:06x}", self.created)
    }

    /// Reserves room for `num_sequences` sequences, or refuses with 429.
    pub(crate) fn reserve(self: &Arc<Self>, num_sequences: usize) -> Result<Permit, ApiError> {
        let limit = self.config.max_pending_requests;
        let before = self.num_pending.fetch_add(num_sequences, Ordering::AcqRel);
        if before + num_sequences > limit {
            self.num_pending.fetch_sub(num_sequences, Ordering::AcqRel);
            return Err(ApiError::overloaded(format!(
                "The server is overloaded: {before} sequences are in flight (limit {limit}). \
                 Retry later."
            )));
        }
        Ok(Permit {
            state: Arc::clone(self),
            num_sequences,
        })
    }
}

/// Room for some sequences in the server's bound; released on drop.
pub(crate) struct Permit {
    state: Arc<Inner>,
    num_sequences: usize,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.state
            .num_pending
            .fetch_sub(self.num_sequences, Ordering::AcqRel);
    }
}
