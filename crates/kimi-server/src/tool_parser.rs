//! Kimi tool calls in generated tokens (spec §9.5), parsed on token ids:
//!
//! ```text
//! content <|tool_calls_section_begin|>
//!   <|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|> {json} <|tool_call_end|>
//!   ...
//! <|tool_calls_section_end|>
//! ```
//!
//! The markers are single special tokens, so no partial marker ever needs holding back.

use kimi_tokenizer::Tokenizer;

use crate::decode::{token_bytes, ByteDecoder};

/// Opens the tool-call section.
pub(crate) const SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
/// Closes the tool-call section.
pub(crate) const SECTION_END: &str = "<|tool_calls_section_end|>";
/// Opens one call (its id follows).
pub(crate) const TOOL_CALL_BEGIN: &str = "<|tool_call_begin|>";
/// Separates a call's id from its JSON arguments.
pub(crate) const TOOL_CALL_ARGUMENT_BEGIN: &str = "<|tool_call_argument_begin|>";
/// Closes one call.
pub(crate) const TOOL_CALL_END: &str = "<|tool_call_end|>";
/// A variant some checkpoints emit (vLLM accepts it too).
const SECTION_BEGIN_SINGULAR: &str = "<|tool_call_section_begin|>";

/// Ids of the tool-call markers in one tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ToolTokens {
    section_begin: u32,
    section_begin_singular: Option<u32>,
    section_end: u32,
    call_begin: u32,
    argument_begin: u32,
    call_end: u32,
}

impl ToolTokens {
    /// The markers' ids; `None` unless the tokenizer has all of them as special tokens.
    pub(crate) fn find(tokenizer: &Tokenizer) -> Option<ToolTokens> {
        let id = |name: &str| {
            tokenizer
                .token_id(name)
                .filter(|&id| tokenizer.is_special(id))
        };
        Some(ToolTokens {
            section_begin: id(SECTION_BEGIN)?,
            section_begin_singular: id(SECTION_BEGIN_SINGULAR),
            section_end: id(SECTION_END)?,
            call_begin: id(TOOL_CALL_BEGIN)?,
            argument_begin: id(TOOL_CALL_ARGUMENT_BEGIN)?,
            call_end: id(TOOL_CALL_END)?,
        })
    }

    /// The section-opening ids, to ban them when `tool_choice` is `none`.
    pub(crate) fn section_openers(&self) -> Vec<u32> {
        let mut ids = vec![self.section_begin];
        ids.extend(self.section_begin_singular);
        ids
    }
}

/// What one token meant.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Piece {
    /// A token of ordinary content.
    Content(u32),
    /// A call started: its index in this turn, id (`functions.NAME:IDX`) and function name.
    CallStart {
        /// 0-based in this response.
        index: usize,
        /// The id as the model wrote it.
        id: String,
        /// The function name taken from the id.
        name: String,
    },
    /// More of a call's argument text.
    Arguments {
        /// The call's index.
        index: usize,
        /// Argument text (UTF-8 complete).
        text: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    Content,
    Section,
    Id,
    Arguments,
}

/// Splits generated tokens into content and tool calls.
#[derive(Debug)]
pub(crate) struct ToolParser {
    tokens: ToolTokens,
    state: State,
    num_calls: usize,
    id_bytes: Vec<u8>,
    arguments: ByteDecoder,
}

/// The function name in a Kimi call id: `functions.get_weather:0` → `get_weather` (as vLLM's
/// `id.split(":")[0].split(".")[-1]`).
pub(crate) fn name_from_id(id: &str) -> String {
    let before_colon = id.split(':').next().unwrap_or(id);
    before_colon
        .rsplit('.')
        .next()
        .unwrap_or(before_colon)
        .trim()
        .to_string()
}

impl ToolParser {
    /// A parser for a tokenizer's markers.
    pub(crate) fn new(tokens: ToolTokens) -> Self {
        ToolParser {
            tokens,
            state: State::Content,
            num_calls: 0,
            id_bytes: Vec::new(),
            arguments: ByteDecoder::default(),
        }
    }

    /// Calls seen so far.
    pub(crate) fn num_calls(&self) -> usize {
        self.num_calls
    }

    /// Feeds one generated token.
    pub(crate) fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Vec<Piece> {
        let t = self.tokens;
        let is_section_begin = id == t.section_begin || Some(id) == t.section_begin_singular;
        match self.state {
            State::Content if is_section_begin => {
                self.state = State::Section;
                Vec::new()
            }
            State::Content => vec![Piece::Content(id)],
            State::Section if id == t.call_begin => {
                self.state = State::Id;
                self.id_bytes.clear();
                Vec::new()
            }
            State::Section if id == t.section_end => {
                self.state = State::Content;
                Vec::new()
            }
            // Anything else between calls (whitespace, stray markers) is dropped.
            State::Section => Vec::new(),
            State::Id if id == t.argument_begin => {
                self.state = State::Arguments;
                vec![self.start_call()]
            }
            State::Id if id == t.call_end => {
                // A call without arguments.
                self.state = State::Section;
                vec![self.start_call()]
            }
            State::Id => {
                if !tokenizer.is_special(id) {
                    self.id_bytes.extend(token_bytes(tokenizer, id));
                }
                Vec::new()
            }
            State::Arguments if id == t.call_end || id == t.section_end => {
                let pieces = self.flush_arguments();
                self.state = if id == t.call_end {
                    State::Section
                } else {
                    State::Content
                };
                pieces
            }
            State::Arguments if tokenizer.is_special(id) => Vec::new(),
            State::Arguments => {
                let text = self.arguments.push(&token_bytes(tokenizer, id));
                self.arguments_piece(text)
            }
        }
    }

    /// End of generation: flushes a call cut short.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        match self.state {
            State::Id => vec![self.start_call()],
            State::Arguments => self.flush_arguments(),
            State::Content | State::Section => Vec::new(),
        }
    }

    fn start_call(&mut self) -> Piece {
        let id = String::from_utf8_lossy(&self.id_bytes).trim().to_string();
        let index = self.num_calls;
        self.num_calls += 1;
        Piece::CallStart {
            index,
            name: name_from_id(&id),
            id,
        }
    }

    fn flush_arguments(&mut self) -> Vec<Piece> {
        let text = self.arguments.finish();
        self.arguments_piece(text)
    }

    fn arguments_piece(&self, text: String) -> Vec<Piece> {
        if text.is_empty() {
            return Vec::new();
        }
        vec![Piece::Arguments {
            index: self.num_calls.saturating_sub(1),
            text,
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_two_calls_after_content() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
        let tok = Tokenizer::from_dir(&dir).expect("demo tokenizer");
        let text = "Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        let ids = tok.encode(text, true).expect("encodes");
        let tokens = ToolTokens::find(&tok).expect("demo has tool tokens");
        let mut parser = ToolParser::new(tokens);
        let mut content = Vec::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for id in ids {
            for piece in parser.push(&tok, id) {
                match piece {
                    Piece::Content(id) => content.push(id),
                    Piece::CallStart { index, id, name } => {
                        assert_eq!(index, calls.len());
                        calls.push((id, name, String::new()));
                    }
                    Piece::Arguments { index, text } => calls[index].2 += &text,
                }
            }
        }
        assert!(parser.finish().is_empty());
        assert_eq!(tok.decode(&content, false).expect("decodes"), "Hi");
        assert_eq!(
            calls,
            vec![
                (
                    "functions.get_weather:0".into(),
                    "get_weather".into(),
                    "{\"city\": \"Paris\"}".into()
                ),
                (
                    "functions.get_time:1".into(),
                    "get_time".into(),
                    "{}".into()
                ),
            ]
        );
        assert_eq!(parser.num_calls(), 2);
        assert_eq!(name_from_id("weird"), "weird");
    }
}
