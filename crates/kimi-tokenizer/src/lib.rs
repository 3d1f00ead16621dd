//! Tokenizers and chat templates for kimi-infer.
//!
//! [`Tokenizer::from_dir`] loads a model directory: Kimi's tiktoken BPE (`tiktoken.model` with
//! `tokenizer_config.json`; spec §9.1–9.3) or any Hugging Face `tokenizer.json`.
//! [`Tokenizer::from_gguf`] builds the byte-level BPE stored in a GGUF file's metadata. The chat
//! template ([`ChatTemplate`]) comes from `chat_template.jinja` or the config's
//! `chat_template` and renders like transformers' `apply_chat_template`; Kimi K3 ships no
//! template, and [`xtml`] renders its XTML format instead. [`StreamDecoder`]
//! turns generated ids into text without ever splitting a UTF-8 character.
//!
//! ```
//! use kimi_tokenizer::{StreamDecoder, Tokenizer};
//! # fn main() -> Result<(), kimi_tokenizer::TokenizerError> {
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
//! let tok = Tokenizer::from_dir(&dir)?;
//! let messages = [serde_json::json!({"role": "user", "content": "Hello!"})];
//! let prompt = tok.chat_template().expect("demo has a template").render(&messages, None, true)?;
//! assert!(prompt.ends_with("<|im_assistant|>assistant<|im_middle|>"));
//! let ids = tok.encode(&prompt, true)?;
//! assert_eq!(tok.decode(&ids, false)?, prompt);
//!
//! let mut stream = StreamDecoder::new(&tok, true);
//! let text: String = ids.iter().map(|&id| stream.push(id)).collect::<String>() + &stream.finish();
//! assert_eq!(text, "userHello!assistant");
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

mod chat_template;
mod config;
mod error;
mod gguf;
mod hf;
mod pyjson;
mod stream;
mod tiktoken;
pub mod xtml;

use std::path::Path;

pub use chat_template::ChatTemplate;
pub use error::TokenizerError;
pub use stream::{StreamDecoder, Utf8Stream};
pub use xtml::{render_xtml, XtmlError, XtmlOptions, XtmlPrompt};

use config::TokenizerConfig;
use hf::HfTokenizer;
use tiktoken::TiktokenBpe;

/// End-of-message tokens that stop generation when present as special tokens, besides the
/// config's `eos_token` (Kimi: `[EOS]` in tokenizer_config, `<|im_end|>` in config.json).
const END_OF_MESSAGE_TOKENS: [&str; 7] = [
    "<|im_end|>",
    "<|end_of_msg|>",
    "[EOS]",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
];

/// What [`Tokenizer::encode_within`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bounded {
    /// The text's ids, exactly those of [`Tokenizer::encode`]; no more than the limit.
    Fits(Vec<u32>),
    /// The text has more ids than the limit: at least this many.
    TooLong {
        /// A lower bound on the text's id count, above the limit.
        at_least: usize,
    },
}

enum Backend {
    Tiktoken(Box<TiktokenBpe>),
    Hf(Box<HfTokenizer>),
}

/// A loaded tokenizer: vocabulary, special tokens, bos/eos ids and chat template.
pub struct Tokenizer {
    backend: Backend,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Tiktoken(_) => "tiktoken",
            Backend::Hf(_) => "tokenizer.json",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl Tokenizer {
    /// Loads from a model directory: `tiktoken.model` (+ `tokenizer_config.json`) → Kimi
    /// tiktoken BPE; else `tokenizer.json` → HF tokenizers. The chat template is
    /// `chat_template.jinja` if present (it overrides the config, as in transformers), else
    /// `tokenizer_config.json` `chat_template` (a string, or a list of `{name, template}` of
    /// which "default" is taken, else the first).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = TokenizerConfig::load_optional(&config_path)?;
        let tiktoken_path = dir.join("tiktoken.model");
        let hf_path = dir.join("tokenizer.json");
        let backend = if tiktoken_path.is_file() {
            Backend::Tiktoken(Box::new(TiktokenBpe::load(
                &tiktoken_path,
                &config.added_tokens,
                &config_path,
            )?))
        } else if hf_path.is_file() {
            Backend::Hf(Box::new(HfTokenizer::load(&hf_path)?))
        } else {
            return Err(TokenizerError::NotFound {
                dir: dir.to_path_buf(),
            });
        };
        let chat_template = match config::find_chat_template(dir, &config)? {
            Some((source, origin)) => Some(
                ChatTemplate::new(&source, config.bos_token.clone(), config.eos_token.clone())
                    .map_err(|err| match err {
                        TokenizerError::TemplateSyntax { source, .. } => {
                            TokenizerError::TemplateSyntax {
                                origin: Some(origin),
                                source,
                            }
                        }
                        other => other,
                    })?,
            ),
            None => None,
        };
        let mut tokenizer = Tokenizer {
            backend,
            bos_id: None,
            eos_ids: Vec::new(),
            chat_template,
        };
        tokenizer.bos_id = config
            .bos_token
            .as_deref()
            .and_then(|t| tokenizer.token_id(t));
        tokenizer.eos_ids = tokenizer.find_eos_ids(config.eos_token.as_deref());
        Ok(tokenizer)
    }

    /// Builds the tokenizer stored in a GGUF file's metadata: `tokenizer.ggml.model = gpt2`
    /// (byte-level BPE from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, with the
    /// pre-tokenizer `tokenizer.ggml.pre` names), control tokens (`token_type` 3) as special
    /// tokens, bos/eos from `tokenizer.ggml.bos_token_id`/`eos_token_id`, and the chat
    /// template from `tokenizer.chat_template`. `tokenizer.ggml.pre = kimi-k2` builds Kimi's
    /// tiktoken BPE from the same token list. Other tokenizer models are rejected.
    pub fn from_gguf(file: &kimi_gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        if gguf::is_kimi(file) {
            return Self::from_gguf_kimi(file);
        }
        let loaded = gguf::load(file)?;
        let text = |id: Option<u32>| {
            id.and_then(|id| loaded.hf.token_bytes(id))
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let (bos_token, eos_token) = (text(loaded.bos_id), text(loaded.eos_id));
        let chat_template = loaded
            .chat_template
            .as_deref()
            .map(|source| ChatTemplate::new(source, bos_token, eos_token))
            .transpose()?;
        let mut tokenizer = Tokenizer {
            backend: Backend::Hf(Box::new(loaded.hf)),
            bos_id: loaded.bos_id,
            eos_ids: Vec::new(),
            chat_template,
        };
        tokenizer.eos_ids = loaded.eos_id.into_iter().collect();
        for id in tokenizer.find_eos_ids(None) {
            if !tokenizer.eos_ids.contains(&id) {
                tokenizer.eos_ids.push(id);
            }
        }
        Ok(tokenizer)
    }

    /// Kimi's vocabulary in a GGUF (`tokenizer.ggml.pre = kimi-k2`, as llama.cpp converts
    /// `tiktoken.model`): the tiktoken backend with Kimi's regex, not a `tokenizers` BPE.
    fn from_gguf_kimi(file: &kimi_gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        let bpe = gguf::kimi_bpe(file)?;
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match file.get(key) {
                Some(_) => Ok(Some(file.get_u32(key)?)),
                None => Ok(None),
            }
        };
        let (bos_id, eos_id) = (
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
        );
        let text = |id: Option<u32>| {
            id.and_then(|id| bpe.token_bytes(id))
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let chat_template = match file.get("tokenizer.chat_template") {
            Some(_) => Some(ChatTemplate::new(
                file.get_str("tokenizer.chat_template")?,
                text(bos_id),
                text(eos_id),
            )?),
            None => None,
        };
        let mut tokenizer = Tokenizer {
            backend: Backend::Tiktoken(Box::new(bpe)),
            bos_id,
            eos_ids: eos_id.into_iter().collect(),
            chat_template,
        };
        for id in tokenizer.find_eos_ids(None) {
            if !tokenizer.eos_ids.contains(&id) {
                tokenizer.eos_ids.push(id);
            }
        }
        Ok(tokenizer)
    }

    /// A stand-in vocabulary of `vocab_size` ids for a model that has no tokenizer (random
    /// weights): the 256 single bytes as ids 0–255, so text is encoded byte by byte, and every
    /// further id a special token (`[BOS]`, `[EOS]`, `[PAD]` at the given ids, else
    /// `<|reserved_token_{id}|>`). Its [`Self::gguf_metadata`] is Kimi's layout (`pre =
    /// kimi-k2`), which llama.cpp and kimi-infer both load. `None` below 256 ids. Ids of
    /// `bos`/`eos`/`pad` at or past `vocab_size` are left out.
    pub fn byte_level_placeholder(
        vocab_size: usize,
        bos: Option<u32>,
        eos: Option<u32>,
        pad: Option<u32>,
    ) -> Option<Tokenizer> {
        let n = u32::try_from(vocab_size).ok().filter(|&n| n >= 256)?;
        let in_vocab = |id: Option<u32>| id.filter(|&id| id < n);
        let (bos, eos, pad) = (in_vocab(bos), in_vocab(eos), in_vocab(pad));
        let specials = (256..n)
            .map(|id| {
                let name = if Some(id) == eos {
                    "[EOS]".to_string()
                } else if Some(id) == bos {
                    "[BOS]".to_string()
                } else if Some(id) == pad {
                    "[PAD]".to_string()
                } else {
                    format!("<|reserved_token_{id}|>")
                };
                (name, id)
            })
            .collect();
        let base = (0..=255u8).map(|b| vec![b]).collect();
        let bpe = TiktokenBpe::build(base, specials, Path::new("<byte-level placeholder>")).ok()?;
        Some(Tokenizer {
            backend: Backend::Tiktoken(Box::new(bpe)),
            bos_id: bos,
            eos_ids: eos.into_iter().collect(),
            chat_template: None,
        })
    }

    /// This tokenizer as the `tokenizer.ggml.*` metadata llama.cpp writes for a model of
    /// `vocab_size` rows (ids, chat template included), or `None` for a vocabulary GGUF
    /// cannot hold yet (only Kimi's tiktoken one is written).
    pub fn gguf_metadata(&self, vocab_size: usize) -> Option<Vec<(String, kimi_gguf::Value)>> {
        use kimi_gguf::Value;
        let Backend::Tiktoken(bpe) = &self.backend else {
            return None;
        };
        let mut meta = gguf::kimi_metadata(bpe, vocab_size);
        if let Some(id) = self.bos_id {
            meta.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(id)));
        }
        if let Some(&id) = self.eos_ids.first() {
            meta.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(id)));
        }
        if let Some(t) = &self.chat_template {
            meta.push((
                "tokenizer.chat_template".into(),
                Value::String(t.source().into()),
            ));
        }
        Some(meta)
    }

    /// This tokenizer as the files of a Hugging Face model directory: `tokenizer.json` and
    /// `tokenizer_config.json` (BOS/EOS tokens, whether BOS is added, the chat template).
    /// `None` for Kimi's tiktoken vocabulary, which has no `tokenizer.json` form.
    pub fn hf_files(&self, add_bos: bool) -> Result<Option<[(String, String); 2]>, TokenizerError> {
        let Backend::Hf(hf) = &self.backend else {
            return Ok(None);
        };
        let json = hf
            .inner()
            .to_string(true)
            .map_err(|e| TokenizerError::InvalidFile {
                path: "tokenizer.json".into(),
                reason: format!("cannot write it: {e}"),
            })?;
        let token = |id: Option<u32>| {
            id.and_then(|id| hf.inner().id_to_token(id))
                .map_or(serde_json::Value::Null, serde_json::Value::String)
        };
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": add_bos,
            "add_eos_token": false,
            "bos_token": token(self.bos_id),
            "eos_token": token(self.eos_ids.first().copied()),
            "clean_up_tokenization_spaces": false,
            "model_max_length": 1_000_000_000u64,
        });
        if let Some(t) = &self.chat_template {
            config["chat_template"] = serde_json::Value::String(t.source().into());
        }
        let config =
            serde_json::to_string_pretty(&config).map_err(|e| TokenizerError::InvalidFile {
                path: "tokenizer_config.json".into(),
                reason: e.to_string(),
            })?;
        Ok(Some([
            ("tokenizer.json".into(), json),
            ("tokenizer_config.json".into(), config),
        ]))
    }

    fn find_eos_ids(&self, eos_token: Option<&str>) -> Vec<u32> {
        let mut ids = Vec::new();
        if let Some(id) = eos_token.and_then(|t| self.token_id(t)) {
            ids.push(id);
        }
        for name in END_OF_MESSAGE_TOKENS {
            if let Some(id) = self.token_id(name).filter(|&id| self.is_special(id)) {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// Encodes `text`. With `allow_special`, special-token strings in the text become their
    /// special ids; otherwise they are encoded as plain text. Nothing (no BOS) is added.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Tiktoken(bpe) => bpe.encode(text, allow_special),
            Backend::Hf(hf) => hf.encode(text, allow_special),
        }
    }

    /// The most bytes of text one token can stand for, where the tokenizer bounds it: Kimi's
    /// tiktoken BPE and byte-level `tokenizer.json` / GGUF BPEs, whose tokens' bytes are
    /// always runs of the text (less the bytes a vocabulary without them drops). `None` for tokenizers that normalize text or have tokens
    /// standing for unbounded text (unknown-word tokens, whitespace-stripping added tokens).
    pub fn max_token_bytes(&self) -> Option<usize> {
        match &self.backend {
            Backend::Tiktoken(bpe) => Some(bpe.max_token_bytes()),
            Backend::Hf(hf) => hf.max_token_bytes(),
        }
    }

    /// [`Self::encode`] for text that may be far too long: ids only when there are at most
    /// `limit` of them (then exactly `encode`'s), otherwise a lower bound on their count,
    /// found with work bounded by `limit` rather than by the text: a text longer than
    /// `limit` × [`Self::max_token_bytes`] bytes is refused unread, and Kimi's BPE stops at
    /// the first piece past the limit.
    pub fn encode_within(
        &self,
        text: &str,
        allow_special: bool,
        limit: usize,
    ) -> Result<Bounded, TokenizerError> {
        if let Some(at_least) = self.too_long_by_bytes(self.encodable_bytes(text), limit) {
            return Ok(Bounded::TooLong { at_least });
        }
        let ids = match &self.backend {
            Backend::Tiktoken(bpe) => bpe.encode_until(text, allow_special, limit)?,
            Backend::Hf(hf) => hf.encode(text, allow_special)?,
        };
        Ok(bounded(ids, limit))
    }

    /// The bytes of `text` that tokens stand for (a byte-level BPE drops bytes it has no
    /// token for).
    fn encodable_bytes(&self, text: &str) -> usize {
        match &self.backend {
            Backend::Tiktoken(_) => text.len(),
            Backend::Hf(hf) => hf.encodable_bytes(text),
        }
    }

    /// The fewest ids `bytes` encodable bytes can have, when that is more than `limit`.
    fn too_long_by_bytes(&self, bytes: usize, limit: usize) -> Option<usize> {
        let at_least = bytes.div_ceil(self.max_token_bytes()?);
        (at_least > limit).then_some(at_least)
    }

    /// Encodes an XTML prompt segment by segment: markers as their control tokens, text as
    /// plain BPE (a `<|open|>` typed by a user stays text).
    pub fn encode_xtml(&self, prompt: &XtmlPrompt) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        for segment in prompt.segments() {
            ids.extend(self.encode(&segment.text, segment.control)?);
        }
        Ok(ids)
    }

    /// [`Self::encode_xtml`] with [`Self::encode_within`]'s bound.
    pub fn encode_xtml_within(
        &self,
        prompt: &XtmlPrompt,
        limit: usize,
    ) -> Result<Bounded, TokenizerError> {
        let bytes = prompt
            .segments()
            .iter()
            .map(|s| self.encodable_bytes(&s.text))
            .sum();
        if let Some(at_least) = self.too_long_by_bytes(bytes, limit) {
            return Ok(Bounded::TooLong { at_least });
        }
        let mut ids = Vec::new();
        for segment in prompt.segments() {
            let room = limit.saturating_sub(ids.len());
            match self.encode_within(&segment.text, segment.control, room)? {
                Bounded::Fits(more) => ids.extend(more),
                Bounded::TooLong { at_least } => {
                    return Ok(Bounded::TooLong {
                        at_least: ids.len() + at_least,
                    })
                }
            }
        }
        Ok(Bounded::Fits(ids))
    }

    /// Decodes `ids`; invalid UTF-8 becomes U+FFFD. Errors on ids outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Tiktoken(bpe) => {
                let bytes = bpe.decode_bytes(ids, skip_special)?;
                Ok(match String::from_utf8(bytes) {
                    Ok(text) => text,
                    Err(err) => String::from_utf8_lossy(err.as_bytes()).into_owned(),
                })
            }
            Backend::Hf(hf) => hf.decode(ids, skip_special),
        }
    }

    /// The raw bytes of one token (for special tokens, their text); `None` for unknown ids.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match &self.backend {
            Backend::Tiktoken(bpe) => bpe.token_bytes(id).map(<[u8]>::to_vec),
            Backend::Hf(hf) => hf.token_bytes(id).map(<[u8]>::to_vec),
        }
    }

    /// Highest token id + 1 (Kimi: number of BPE tokens + 258 special ids).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Tiktoken(bpe) => bpe.vocab_size(),
            Backend::Hf(hf) => hf.vocab_size(),
        }
    }

    /// The id of a token given as text, e.g. `"<|im_end|>"` (Kimi: a special token's name or a
    /// base token's exact bytes; `tokenizer.json`: the vocabulary string).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Tiktoken(bpe) => bpe.token_id(token),
            Backend::Hf(hf) => hf.token_id(token),
        }
    }

    /// Whether `id` is a special token (Kimi: every id from the number of BPE tokens on).
    pub fn is_special(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Tiktoken(bpe) => bpe.is_special(id),
            Backend::Hf(hf) => hf.is_special(id),
        }
    }

    /// The id of tokenizer_config's `bos_token`. Kimi's chat template does not emit it.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Stop tokens: tokenizer_config's `eos_token`, then whichever of `<|im_end|>`,
    /// `<|end_of_msg|>`, `[EOS]`,
    /// `<|endoftext|>`, `<|eot_id|>`, `<|end_of_text|>`, `<end_of_turn>` are special tokens.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// The chat template, if the directory has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Kimi tiktoken only: the number of BPE tokens, i.e. the first special id.
    pub fn num_base_tokens(&self) -> Option<u32> {
        match &self.backend {
            Backend::Tiktoken(bpe) => Some(bpe.n_base()),
            Backend::Hf(_) => None,
        }
    }
}

/// `ids` as a [`Bounded`] against `limit`.
fn bounded(ids: Vec<u32>, limit: usize) -> Bounded {
    if ids.len() > limit {
        Bounded::TooLong {
            at_least: ids.len(),
        }
    } else {
        Bounded::Fits(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<ChatTemplate>();
        check::<StreamDecoder<'static>>();
    }
}
