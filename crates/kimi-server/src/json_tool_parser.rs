//! Tool calls written as text by models without Kimi's tool tokens, parsed while they
//! stream (the formats are in [`crate::tool_format`]):
//!
//! ```text
//! hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> <tool_call>...
//! llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}; {"name": ...}
//! mistral      text [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]
//! generic      {"tool_calls": [{"name": "f", "arguments": {...}}, {...}]}
//! ```
//!
//! Tags are matched on text, so a tag split over several tokens is found too; text that
//! could be the start of a tag is held back until the next token decides it. The two
//! formats that open with a bare `{` only do so at the start of the output, and the first
//! key decides: `name` (llama3_json) or `tool_calls` (generic) is a call, any other JSON
//! is an ordinary answer and is given back as content. Text from an opener until its first
//! call has started is held too, so a malformed call comes back as content instead of being
//! lost. Whitespace between and after calls is dropped.

use kimi_tokenizer::Tokenizer;

use crate::decode::{token_bytes, ByteDecoder};
use crate::json_call::{CallScanner, ObjectScanner, Step};
use crate::tool_format::JsonToolKind;
use crate::xtml_output::fresh_call_id;

/// What the output added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolEvent {
    Content(String),
    /// A call began: its index from 0 in this response, a fresh id, the function name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of a call's arguments (JSON text).
    Arguments {
        index: usize,
        text: String,
    },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";
/// Mistral's newer form, `[TOOL_CALLS]name[ARGS]{...}`, one tag per call.
const MISTRAL_ARGS: &str = "[ARGS]";
/// Longest function name read before `[ARGS]` (OpenAI allows 64).
const MAX_NAME_CHARS: usize = 64 + MISTRAL_ARGS.len();

#[derive(Debug)]
enum Mode {
    /// Text. JSON formats look for `{` (or `<|python_tag|>`) while `at_start`.
    Content,
    /// Every further character is content.
    Plain,
    /// Generic: inside `{"tool_calls"` before the list, reading the envelope's first key.
    EnvelopeKey(CallScanner),
    /// Generic: after the key, before `[`.
    EnvelopeList,
    /// Expecting a call object (`{`), or in a list `]`.
    BeforeCall,
    InCall(CallScanner),
    /// Mistral: a function name up to `[ARGS]`.
    MistralName(String),
    /// Mistral: the arguments object after `[ARGS]`, streamed as it comes.
    MistralArguments(ObjectScanner),
    /// After a call object: a separator, a closing tag or bracket.
    AfterCall,
    /// Generic: after the list's `]`, before the envelope's `}`.
    EnvelopeClose,
}

/// Splits one sequence's text output into content and tool calls.
#[derive(Debug)]
pub(crate) struct JsonToolParser {
    kind: JsonToolKind,
    skip_special: bool,
    bytes: ByteDecoder,
    mode: Mode,
    /// No content yet (JSON formats only call at the start).
    at_start: bool,
    /// Content that may be the start of an opening tag.
    pending: String,
    /// Raw text since the opener, until a call starts: given back as content on failure.
    held: String,
    /// Whitespace after a call, dropped unless more content follows.
    space: String,
    /// In a Hermes call: text after the object, looking for the closing tag.
    closing: String,
    index: Option<usize>,
    num_calls: usize,
    events: Vec<ToolEvent>,
}

impl JsonToolParser {
    pub(crate) fn new(kind: JsonToolKind, skip_special: bool) -> Self {
        JsonToolParser {
            // Both Mistral forms are read, whichever the template shows.
            kind: match kind {
                JsonToolKind::MistralArgs => JsonToolKind::Mistral,
                other => other,
            },
            skip_special,
            bytes: ByteDecoder::default(),
            mode: Mode::Content,
            at_start: true,
            pending: String::new(),
            held: String::new(),
            space: String::new(),
            closing: String::new(),
            index: None,
            num_calls: 0,
            events: Vec::new(),
        }
    }

    /// Calls reported so far.
    pub(crate) fn num_calls(&self) -> usize {
        self.num_calls
    }

    /// Feeds one generated token. Special tokens count as their text when they spell a tag
    /// of the format (`[TOOL_CALLS]`, `<|python_tag|>`); others follow `skip_special`.
    pub(crate) fn push_token(&mut self, tokenizer: &Tokenizer, id: u32) -> Vec<ToolEvent> {
        let bytes = token_bytes(tokenizer, id);
        if tokenizer.is_special(id) {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let rest = self.bytes.finish();
            self.push_str(&rest);
            let is_tag = [
                HERMES_OPEN,
                HERMES_CLOSE,
                MISTRAL_OPEN,
                MISTRAL_ARGS,
                PYTHON_TAG,
            ]
            .contains(&&*text);
            if is_tag || !self.skip_special {
                self.push_str(&text);
            }
        } else {
            let text = self.bytes.push(&bytes);
            self.push_str(&text);
        }
        std::mem::take(&mut self.events)
    }

    /// Feeds generated text.
    #[cfg(test)]
    pub(crate) fn push_text(&mut self, text: &str) -> Vec<ToolEvent> {
        self.push_str(text);
        std::mem::take(&mut self.events)
    }

    fn push_str(&mut self, text: &str) {
        for ch in text.chars() {
            self.push_char(ch);
        }
        self.flush_arguments();
    }

    /// End of output: held text becomes content, a call cut short is closed.
    pub(crate) fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = self.bytes.finish();
        self.push_str(&rest);
        match std::mem::replace(&mut self.mode, Mode::Plain) {
            Mode::InCall(mut scanner) if scanner.named() => {
                let out = scanner.finish();
                self.report(out.start, out.arguments);
            }
            _ => {}
        }
        let held = std::mem::take(&mut self.held);
        self.content(&held);
        let pending = std::mem::take(&mut self.pending);
        self.content(&pending);
        std::mem::take(&mut self.events)
    }

    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let mut text = text.to_string();
        if !self.space.is_empty() || self.num_calls > 0 {
            // After a call, whitespace-only runs wait for text.
            self.space += &text;
            if self.space.trim().is_empty() {
                return;
            }
            text = std::mem::take(&mut self.space);
        }
        self.at_start = false;
        match self.events.last_mut() {
            Some(ToolEvent::Content(last)) => *last += &text,
            _ => self.events.push(ToolEvent::Content(text)),
        }
    }

    /// Gives the held text back as content; the rest is read as content (and, for the
    /// formats that only call at the start, as plain text).
    fn give_back(&mut self, ch: Option<char>) {
        let mut held = std::mem::take(&mut self.held);
        held.extend(ch);
        self.mode = self.content_mode();
        self.content(&held);
    }

    fn open_tag(&self) -> Option<&'static str> {
        match self.kind {
            JsonToolKind::Hermes => Some(HERMES_OPEN),
            JsonToolKind::Mistral | JsonToolKind::MistralArgs => Some(MISTRAL_OPEN),
            JsonToolKind::Llama3Json if self.at_start => Some(PYTHON_TAG),
            JsonToolKind::Llama3Json | JsonToolKind::Generic => None,
        }
    }

    fn push_char(&mut self, ch: char) {
        match &mut self.mode {
            Mode::Plain => self.content(&ch.to_string()),
            Mode::Content => self.content_char(ch),
            Mode::EnvelopeKey(scanner) => {
                let step = scanner.push(ch);
                let is_calls = scanner.first_key().map(|key| key == "tool_calls");
                self.held.push(ch);
                match (step, is_calls) {
                    (Step::Open, None) => {}
                    (Step::Open, Some(true)) => self.mode = Mode::EnvelopeList,
                    _ => self.give_back(None),
                }
            }
            Mode::EnvelopeList => {
                self.held.push(ch);
                match ch {
                    ':' => {}
                    '[' => self.mode = Mode::BeforeCall,
                    c if c.is_whitespace() => {}
                    _ => self.give_back(None),
                }
            }
            Mode::BeforeCall => match ch {
                '{' => {
                    self.held.push(ch);
                    let mut scanner = CallScanner::new();
                    scanner.push(ch);
                    self.mode = Mode::InCall(scanner);
                }
                ']' if self.in_list() => self.after_list(),
                c if self.kind == JsonToolKind::Mistral
                    && is_name_char(c)
                    && self.held.trim_end() == MISTRAL_OPEN =>
                {
                    self.held.push(ch);
                    self.mode = Mode::MistralName(ch.to_string());
                }
                c if c.is_whitespace() || (c == '[' && self.kind == JsonToolKind::Mistral) => {
                    self.held.push(ch);
                }
                _ => self.not_a_call(ch),
            },
            Mode::InCall(scanner) => {
                let step = scanner.push(ch);
                let started = scanner.started();
                if !started {
                    self.held.push(ch);
                }
                match step {
                    Step::Open => {
                        if self.kind == JsonToolKind::Llama3Json
                            && !started
                            && scanner.first_key().is_some_and(|k| k != "name")
                        {
                            self.give_back(None);
                        }
                    }
                    Step::Closed => {
                        let out = scanner.finish();
                        self.report(out.start, out.arguments);
                        self.index = None;
                        self.closing.clear();
                        self.mode = Mode::AfterCall;
                    }
                    Step::Malformed if scanner.named() => {
                        let out = scanner.finish();
                        self.report(out.start, out.arguments);
                        self.index = None;
                        self.closing.clear();
                        self.mode = Mode::AfterCall;
                    }
                    Step::Malformed => self.give_back(None),
                }
            }
            Mode::MistralName(name) => {
                self.held.push(ch);
                name.push(ch);
                if let Some(name) = name.strip_suffix(MISTRAL_ARGS) {
                    let name = name.to_string();
                    self.report(Some(name), String::new());
                    self.mode = Mode::MistralArguments(ObjectScanner::default());
                } else if name.chars().count() > MAX_NAME_CHARS
                    || !(is_name_char(ch) || MISTRAL_ARGS.contains(ch))
                {
                    self.give_back(None);
                }
            }
            Mode::MistralArguments(scanner) => {
                if !scanner.begun() && ch.is_whitespace() {
                    return;
                }
                let step = scanner.push(ch);
                if step != Step::Malformed {
                    self.report(None, ch.to_string());
                }
                if step != Step::Open {
                    // A call per tag: the next one opens with `[TOOL_CALLS]` again.
                    if step == Step::Malformed && self.index.is_some() {
                        self.report(None, "{}".into());
                    }
                    self.index = None;
                    self.mode = Mode::Content;
                    if step == Step::Malformed {
                        self.content_char(ch);
                    }
                }
            }
            Mode::AfterCall => self.after_call_char(ch),
            Mode::EnvelopeClose => {
                if ch == '}' {
                    self.mode = Mode::Plain;
                } else if !ch.is_whitespace() {
                    self.mode = Mode::Plain;
                    self.content(&ch.to_string());
                }
            }
        }
    }

    fn in_list(&self) -> bool {
        matches!(self.kind, JsonToolKind::Mistral | JsonToolKind::Generic)
    }

    fn after_list(&mut self) {
        self.held.clear();
        self.mode = match self.kind {
            JsonToolKind::Generic => Mode::EnvelopeClose,
            _ => self.content_mode(),
        };
    }

    /// Text where a call object should be.
    fn not_a_call(&mut self, ch: char) {
        if self.num_calls == 0 || !self.held.is_empty() {
            self.give_back(Some(ch));
        } else {
            self.mode = self.content_mode();
            self.content_char(ch);
        }
    }

    fn content_mode(&self) -> Mode {
        match self.kind {
            JsonToolKind::Hermes | JsonToolKind::Mistral | JsonToolKind::MistralArgs => {
                Mode::Content
            }
            JsonToolKind::Llama3Json | JsonToolKind::Generic => Mode::Plain,
        }
    }

    fn after_call_char(&mut self, ch: char) {
        self.held.clear();
        match self.kind {
            JsonToolKind::Hermes => {
                // Anything between the object and `</tool_call>` is dropped.
                self.closing.push(ch);
                if self.closing.ends_with(HERMES_CLOSE) {
                    self.mode = Mode::Content;
                } else if !HERMES_CLOSE.contains(ch) && !ch.is_whitespace() {
                    // No closing tag: the text goes on as content.
                    let text = std::mem::take(&mut self.closing);
                    self.mode = Mode::Content;
                    for c in text.chars() {
                        self.content_char(c);
                    }
                }
            }
            JsonToolKind::Mistral | JsonToolKind::MistralArgs | JsonToolKind::Generic => match ch {
                ',' => self.mode = Mode::BeforeCall,
                ']' => self.after_list(),
                c if c.is_whitespace() => {}
                _ => {
                    self.mode = self.content_mode();
                    self.content_char(ch);
                }
            },
            JsonToolKind::Llama3Json => match ch {
                ';' => self.mode = Mode::BeforeCall,
                c if c.is_whitespace() => {}
                _ => {
                    self.mode = Mode::Plain;
                    self.content(&ch.to_string());
                }
            },
        }
    }

    fn content_char(&mut self, ch: char) {
        let json_start = matches!(self.kind, JsonToolKind::Llama3Json | JsonToolKind::Generic);
        if json_start && self.at_start && self.pending.is_empty() {
            if ch.is_whitespace() {
                self.held.push(ch);
                return;
            }
            if ch == '{' {
                self.held.push(ch);
                let mut scanner = CallScanner::new();
                scanner.push(ch);
                self.mode = match self.kind {
                    JsonToolKind::Generic => Mode::EnvelopeKey(scanner),
                    _ => Mode::InCall(scanner),
                };
                return;
            }
        }
        let Some(tag) = self.open_tag() else {
            self.give_back(Some(ch));
            return;
        };
        self.pending.push(ch);
        if self.pending == tag {
            self.pending.clear();
            let held = std::mem::take(&mut self.held);
            self.content(&held);
            self.space.clear();
            self.held = tag.to_string();
            self.mode = Mode::BeforeCall;
            return;
        }
        // Keep the longest end of `pending` that could still begin the tag.
        let keep = (0..self.pending.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| tag.starts_with(&self.pending[i..]))
            .unwrap_or(self.pending.len());
        let emit: String = self.pending.drain(..keep).collect();
        if !emit.is_empty() {
            let held = std::mem::take(&mut self.held);
            self.content(&held);
            self.content(&emit);
        }
    }

    fn flush_arguments(&mut self) {
        if let Mode::InCall(scanner) = &mut self.mode {
            let out = scanner.take();
            if out.start.is_some() {
                self.held.clear();
            }
            self.report(out.start, out.arguments);
        }
    }

    fn report(&mut self, start: Option<String>, arguments: String) {
        if let Some(name) = start {
            let index = self.num_calls;
            self.num_calls += 1;
            self.index = Some(index);
            self.held.clear();
            self.space.clear();
            self.events.push(ToolEvent::CallStart {
                index,
                id: fresh_call_id(),
                name,
            });
        }
        let Some(index) = self.index else { return };
        if arguments.is_empty() {
            return;
        }
        match self.events.last_mut() {
            Some(ToolEvent::Arguments { index: i, text }) if *i == index => *text += &arguments,
            _ => self.events.push(ToolEvent::Arguments {
                index,
                text: arguments,
            }),
        }
    }
}

/// A character of a function name (OpenAI's rule).
fn is_name_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || ch == '_' || ch == '-'
}

#[cfg(test)]
#[path = "json_tool_parser_tests.rs"]
mod tests;
