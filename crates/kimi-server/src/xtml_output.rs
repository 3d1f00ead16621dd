//! Kimi K3 output in XTML (spec §5) → reasoning, content and OpenAI tool calls, streamed.
//!
//! ```text
//! [<|open|>think<|sep|>]REASONING<|close|>think<|sep|>     (the prompt opens think)
//! <|open|>response<|sep|>ANSWER<|close|>response<|sep|>
//! <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//!   <|open|>argument key="k" type="string"<|sep|>raw<|close|>argument<|sep|>
//!   <|open|>argument key="n" type="number"<|sep|>3<|close|>argument<|sep|>   (JSON)
//!   | <|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>
//! <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>
//! ```
//!
//! Everything is lexed as text: control tokens arrive as their marker strings, so a marker
//! spelled in ordinary tokens is structure too and no marker ever reaches the client. A text
//! end that could begin a marker (`<|clo`) is held back until the next token decides it;
//! an element header (`<|open|>call tool="f" index="1"`) is held until its `<|sep|>`, and one
//! cut by `max_tokens` before it is dropped.
//!
//! Defensive choices (spec §5, known failures): a section opens from any state, so a
//! missing `<|close|>think<|sep|>` still yields the answer and the calls (vLLM #53246);
//! text outside every element is content; prose or JSON that merely looks like a call stays
//! content (no JSON-array fallback, sglang #34604); a typed value that is not valid JSON
//! becomes a JSON string of its raw text; a `json` payload that is not an object becomes
//! `{}`, so arguments are always a JSON object; a call cut short still closes its object.

use std::sync::atomic::{AtomicU64, Ordering};

use kimi_tokenizer::xtml::{unescape_attr, CLOSE, END_OF_MSG, OPEN, SEP};
use kimi_tokenizer::Tokenizer;

use crate::decode::{token_bytes, ByteDecoder};

const MARKERS: [&str; 4] = [OPEN, CLOSE, SEP, END_OF_MSG];
/// A header longer than this is not one: its text is given back to the section it was in.
const MAX_HEADER_BYTES: usize = 1024;

/// Ids of the four XTML control tokens in one tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct XtmlTokens {
    ids: [u32; 4],
}

impl XtmlTokens {
    /// `None` unless the tokenizer has every marker as one token.
    pub(crate) fn find(tokenizer: &Tokenizer) -> Option<XtmlTokens> {
        let mut ids = [0; 4];
        for (slot, name) in ids.iter_mut().zip(MARKERS) {
            *slot = tokenizer.token_id(name)?;
        }
        Some(XtmlTokens { ids })
    }

    /// `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`.
    pub(crate) fn ids(&self) -> [u32; 4] {
        self.ids
    }

    fn marker(&self, id: u32) -> Option<&'static str> {
        self.ids.iter().position(|&m| m == id).map(|i| MARKERS[i])
    }
}

/// Where the prompt left the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XtmlStart {
    /// Inside `think` (the thinking generation prompt).
    Think,
    /// Inside `response` (the no-thinking generation prompt).
    Response,
    /// Between messages (no generation prompt).
    Message,
}

/// What the output added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum XtmlEvent {
    Reasoning(String),
    Content(String),
    /// A call began: index from 0 in this response, a fresh id, the function name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of a call's arguments, a JSON object as text.
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    /// Inside the message, outside every element: bare text is content.
    Top,
    Think,
    Response,
    Tools,
    Call,
    Argument,
    Json,
    /// The message ended; the rest is ignored.
    Done,
}

/// One call being assembled into a JSON object.
#[derive(Debug)]
struct Call {
    index: usize,
    /// Whether `{` was written.
    opened: bool,
    /// The current argument: its key prefix (`{"k":` or `,"k":`), string-typed, and value.
    argument: Option<(String, bool, String)>,
    /// A `json type="object"` payload.
    json: Option<String>,
}

/// Splits one sequence's output into events.
#[derive(Debug)]
pub(crate) struct XtmlParser {
    tokens: XtmlTokens,
    parse_tools: bool,
    skip_special: bool,
    bytes: ByteDecoder,
    /// Text that may be the start of a marker.
    pending: String,
    /// An element header being read: whether it closes, and its text so far.
    header: Option<(bool, String)>,
    section: Section,
    /// Trailing whitespace of bare text, dropped if an element follows.
    top_space: String,
    /// No bare text since the last element: leading whitespace is dropped.
    top_fresh: bool,
    call: Option<Call>,
    num_calls: usize,
    events: Vec<XtmlEvent>,
}

impl XtmlParser {
    /// A parser; with `parse_tools` false a tools section is read and dropped.
    pub(crate) fn new(
        tokens: XtmlTokens,
        start: XtmlStart,
        parse_tools: bool,
        skip_special: bool,
    ) -> Self {
        XtmlParser {
            tokens,
            parse_tools,
            skip_special,
            bytes: ByteDecoder::default(),
            pending: String::new(),
            header: None,
            section: match start {
                XtmlStart::Think => Section::Think,
                XtmlStart::Response => Section::Response,
                XtmlStart::Message => Section::Top,
            },
            top_space: String::new(),
            top_fresh: true,
            call: None,
            num_calls: 0,
            events: Vec::new(),
        }
    }

    /// Calls reported so far.
    pub(crate) fn num_calls(&self) -> usize {
        self.num_calls
    }

    /// Feeds one generated token.
    pub(crate) fn push_token(&mut self, tokenizer: &Tokenizer, id: u32) -> Vec<XtmlEvent> {
        if let Some(marker) = self.tokens.marker(id) {
            let rest = self.bytes.finish();
            self.lex(&rest);
            self.lex(marker);
        } else if !(self.skip_special && tokenizer.is_special(id)) {
            let text = self.bytes.push(&token_bytes(tokenizer, id));
            self.lex(&text);
        }
        std::mem::take(&mut self.events)
    }

    /// Feeds generated text (markers spelled out).
    #[cfg(test)]
    pub(crate) fn push_text(&mut self, text: &str) -> Vec<XtmlEvent> {
        self.lex(text);
        std::mem::take(&mut self.events)
    }

    /// End of generation: held-back text, a header cut before `<|sep|>` (dropped) and a call
    /// cut short (closed).
    pub(crate) fn finish(&mut self) -> Vec<XtmlEvent> {
        let rest = self.bytes.finish();
        self.lex(&rest);
        let pending = std::mem::take(&mut self.pending);
        // A lone `<` is text; `<|` and longer are a marker cut off.
        if pending.len() < 2 {
            self.text(&pending);
        }
        self.header = None;
        self.leave_call();
        self.section = Section::Done;
        std::mem::take(&mut self.events)
    }

    fn lex(&mut self, text: &str) {
        self.pending.push_str(text);
        loop {
            let found = MARKERS
                .iter()
                .filter_map(|m| self.pending.find(m).map(|at| (at, *m)))
                .min();
            let Some((at, marker)) = found else {
                break;
            };
            let before: String = self.pending.drain(..at + marker.len()).collect();
            self.text(&before[..at]);
            self.marker(marker);
        }
        let hold = partial_marker_len(&self.pending);
        let ready: String = self.pending.drain(..self.pending.len() - hold).collect();
        self.text(&ready);
    }

    fn marker(&mut self, marker: &str) {
        if marker == SEP {
            if let Some((closing, header)) = self.header.take() {
                self.element(closing, &header);
            }
            return;
        }
        // A header without its `<|sep|>` ends at the next marker.
        if let Some((closing, header)) = self.header.take() {
            self.element(closing, &header);
        }
        match marker {
            OPEN => self.header = Some((false, String::new())),
            CLOSE => self.header = Some((true, String::new())),
            _ => {
                self.leave_call();
                self.section = Section::Done;
            }
        }
    }

    fn text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if let Some((_, header)) = &mut self.header {
            header.push_str(text);
            if header.len() > MAX_HEADER_BYTES {
                let (_, header) = self.header.take().unwrap_or_default();
                self.text(&header);
            }
            return;
        }
        match self.section {
            Section::Top => {
                // Whitespace around elements is layout, not content.
                let text = if self.top_fresh {
                    text.trim_start()
                } else {
                    text
                };
                let body = text.trim_end();
                if body.is_empty() {
                    if !self.top_fresh {
                        self.top_space.push_str(text);
                    }
                    return;
                }
                self.top_fresh = false;
                let out = std::mem::take(&mut self.top_space) + body;
                self.top_space = text[body.len()..].to_string();
                self.emit_text(XtmlEvent::Content(out));
            }
            Section::Think => self.emit_text(XtmlEvent::Reasoning(text.into())),
            Section::Response => self.emit_text(XtmlEvent::Content(text.into())),
            Section::Argument => self.argument_text(text),
            Section::Json => {
                if let Some(call) = &mut self.call {
                    call.json.get_or_insert_with(String::new).push_str(text);
                }
            }
            Section::Tools | Section::Call | Section::Done => {}
        }
    }

    /// Merges with the previous event of the same kind.
    fn emit_text(&mut self, event: XtmlEvent) {
        match (self.events.last_mut(), event) {
            (Some(XtmlEvent::Reasoning(a)), XtmlEvent::Reasoning(b))
            | (Some(XtmlEvent::Content(a)), XtmlEvent::Content(b)) => a.push_str(&b),
            (_, event) => self.events.push(event),
        }
    }

    /// A complete header: `TAG attrs` after `<|open|>`, or `TAG` after `<|close|>`.
    fn element(&mut self, closing: bool, header: &str) {
        let header = header.trim();
        let tag = header.split_whitespace().next().unwrap_or("");
        if self.section == Section::Done {
            return;
        }
        let known = [
            "think", "response", "tools", "call", "argument", "json", "message",
        ];
        if known.contains(&tag) {
            self.top_space.clear();
            self.top_fresh = true;
        }
        if closing {
            match tag {
                "think" | "response" | "tools" => self.enter(Section::Top),
                "call" => self.enter(Section::Tools),
                "argument" => {
                    self.end_argument();
                    self.section = Section::Call;
                }
                "json" => self.section = Section::Call,
                "message" => self.enter(Section::Done),
                _ => {}
            }
            return;
        }
        match tag {
            "think" => self.enter(Section::Think),
            "response" => self.enter(Section::Response),
            "tools" => self.enter(Section::Tools),
            "message" => self.enter(Section::Top),
            "call" => {
                self.leave_call();
                let attrs = attributes(&header[tag.len()..]);
                let name = attr(&attrs, "tool").or_else(|| attr(&attrs, "name"));
                self.section = Section::Call;
                if let Some(name) = name.filter(|_| self.parse_tools) {
                    let index = self.num_calls;
                    self.num_calls += 1;
                    self.events.push(XtmlEvent::CallStart {
                        index,
                        id: fresh_call_id(),
                        name,
                    });
                    self.call = Some(Call {
                        index,
                        opened: false,
                        argument: None,
                        json: None,
                    });
                }
            }
            "argument" => {
                self.end_argument();
                let attrs = attributes(&header[tag.len()..]);
                let key = attr(&attrs, "key").unwrap_or_default();
                // No type means a string, as in sglang's and mlx-lm's parsers.
                let is_string = attr(&attrs, "type").is_none_or(|t| t == "string");
                self.section = Section::Argument;
                if let Some(call) = &mut self.call {
                    let key = serde_json::to_string(&key).unwrap_or_else(|_| "\"\"".into());
                    let prefix = format!("{}{key}:", if call.opened { "," } else { "{" });
                    call.opened = true;
                    call.argument = Some((prefix, is_string, String::new()));
                    if is_string {
                        self.arguments_from_current("\"");
                    }
                }
            }
            "json" => self.section = Section::Json,
            // An element this parser does not know: its content stays where it is.
            _ => {}
        }
    }

    /// Moves to a section outside any call.
    fn enter(&mut self, section: Section) {
        self.leave_call();
        self.section = section;
    }

    fn argument_text(&mut self, text: &str) {
        let Some(call) = &mut self.call else {
            return;
        };
        let Some((_, is_string, value)) = &mut call.argument else {
            return;
        };
        if *is_string {
            let escaped = json_escape(text);
            self.arguments_from_current(&escaped);
        } else {
            value.push_str(text);
        }
    }

    /// Sends text of the current call's arguments; a string argument's prefix goes first.
    fn arguments_from_current(&mut self, text: &str) {
        let Some(call) = &mut self.call else {
            return;
        };
        let mut out = String::new();
        if let Some((prefix, true, _)) = &mut call.argument {
            out.push_str(&std::mem::take(prefix));
        }
        out.push_str(text);
        let index = call.index;
        self.arguments(index, out);
    }

    fn arguments(&mut self, index: usize, text: String) {
        if text.is_empty() {
            return;
        }
        match self.events.last_mut() {
            Some(XtmlEvent::Arguments { index: i, text: t }) if *i == index => t.push_str(&text),
            _ => self.events.push(XtmlEvent::Arguments { index, text }),
        }
    }

    /// Closes the current argument: a string's quote, or a typed value checked as JSON.
    fn end_argument(&mut self) {
        let Some(call) = &mut self.call else {
            return;
        };
        let Some((prefix, is_string, value)) = call.argument.take() else {
            return;
        };
        let index = call.index;
        let text = if is_string {
            "\"".to_string()
        } else if serde_json::from_str::<serde::de::IgnoredAny>(&value).is_ok() {
            prefix + value.trim()
        } else {
            tracing::debug!("XTML argument is not valid JSON, kept as a string: {value:?}");
            prefix + &serde_json::to_string(&value).unwrap_or_default()
        };
        self.arguments(index, text);
    }

    /// Finishes the current call's JSON object, if a call is open.
    fn leave_call(&mut self) {
        self.end_argument();
        let Some(call) = self.call.take() else {
            return;
        };
        let text = match (call.opened, call.json) {
            (true, _) => "}".to_string(),
            (false, Some(json)) if is_json_object(&json) => json.trim().to_string(),
            (false, json) => {
                // Arguments are always an object: a client indexing a string or list is
                // sglang #34604's crash.
                if let Some(json) = json {
                    tracing::debug!("XTML json payload is not a JSON object, dropped: {json:?}");
                }
                "{}".to_string()
            }
        };
        self.arguments(call.index, text);
    }
}

fn is_json_object(text: &str) -> bool {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).is_ok()
}

/// The longest end of `text` that is a proper prefix of a marker.
fn partial_marker_len(text: &str) -> usize {
    let longest = MARKERS.iter().map(|m| m.len() - 1).max().unwrap_or(0);
    (1..=longest.min(text.len()))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && MARKERS
                    .iter()
                    .any(|m| m.starts_with(&text[text.len() - n..]))
        })
        .unwrap_or(0)
}

/// `key="value"` pairs, values unescaped; parsing stops at anything else.
fn attributes(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim();
        let after = &rest[eq + 2..];
        let Some(end) = after.find('"') else {
            break;
        };
        if key.is_empty() || key.contains(char::is_whitespace) {
            break;
        }
        out.push((key.to_string(), unescape_attr(&after[..end])));
        rest = after[end + 1..].trim_start();
    }
    out
}

fn attr(attrs: &[(String, String)], key: &str) -> Option<String> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// `text` as the inside of a JSON string.
fn json_escape(text: &str) -> String {
    let quoted = serde_json::to_string(text).unwrap_or_default();
    quoted
        .get(1..quoted.len().saturating_sub(1))
        .unwrap_or_default()
        .to_string()
}

/// An OpenAI-style call id, unique in this process (`call_` + 24 hex digits).
pub(crate) fn fresh_call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("call_{nanos:016x}{:08x}", n as u32)
}

#[cfg(test)]
mod tests;
