//! One tool call written as a JSON object, `{"name": "f", "arguments": {...}}` (Llama 3
//! writes `parameters`), read a character at a time so that its arguments can be streamed
//! while the model writes them.
//!
//! The call starts once its name is known; the arguments value is then passed on as raw
//! JSON text. Arguments written before the name are held until the name arrives; arguments
//! given as a JSON string (`"{\"a\": 1}"`) are decoded when the string closes, and missing
//! arguments become `{}`, so a finished call always carries an object.

/// Where the scanner is at the call object's top level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Before the opening `{`.
    Open,
    ExpectKey,
    InKey,
    ExpectColon,
    ExpectValue,
    InValue,
    AfterValue,
    Closed,
}

/// Which top-level value is being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueKind {
    Name,
    Arguments,
    Other,
}

/// What a character did to the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Consumed; the object is still open.
    Open,
    /// The closing `}`.
    Closed,
    /// Not JSON of a call object: the caller decides what the text was.
    Malformed,
}

/// Reads one call object.
#[derive(Debug)]
pub(crate) struct CallScanner {
    place: Place,
    key: String,
    key_escaped: bool,
    first_key: Option<String>,
    value: ValueKind,
    /// Nesting inside the current value, and its string state.
    value_depth: usize,
    in_string: bool,
    escaped: bool,
    /// A number or literal (`true`, `3`) without brackets or quotes.
    bare_value: bool,
    name_raw: String,
    name: Option<String>,
    arguments: String,
    /// The arguments are a JSON string to decode once it closes.
    arguments_quoted: bool,
    arguments_done: bool,
    sent: usize,
    started: bool,
}

/// What the caller should report for this call.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct CallOutput {
    /// The call's name, the first time it is known.
    pub start: Option<String>,
    /// More argument text.
    pub arguments: String,
}

impl CallScanner {
    pub(crate) fn new() -> Self {
        CallScanner {
            place: Place::Open,
            key: String::new(),
            key_escaped: false,
            first_key: None,
            value: ValueKind::Other,
            value_depth: 0,
            in_string: false,
            escaped: false,
            bare_value: false,
            name_raw: String::new(),
            name: None,
            arguments: String::new(),
            arguments_quoted: false,
            arguments_done: false,
            sent: 0,
            started: false,
        }
    }

    /// The first key of the object, once read: JSON formats that open with a bare `{` tell
    /// a call (`name`) from a JSON answer by it.
    pub(crate) fn first_key(&self) -> Option<&str> {
        self.first_key.as_deref()
    }

    /// Whether the function's name has been read.
    pub(crate) fn named(&self) -> bool {
        self.name.is_some()
    }

    /// Whether the call has been reported as started.
    pub(crate) fn started(&self) -> bool {
        self.started
    }

    /// Feeds one character.
    pub(crate) fn push(&mut self, ch: char) -> Step {
        match self.place {
            Place::Open if ch.is_whitespace() => Step::Open,
            Place::Open if ch == '{' => {
                self.place = Place::ExpectKey;
                Step::Open
            }
            Place::Open | Place::Closed => Step::Malformed,
            Place::ExpectKey | Place::AfterValue if ch.is_whitespace() => Step::Open,
            Place::ExpectKey if ch == '"' => {
                self.place = Place::InKey;
                self.key.clear();
                Step::Open
            }
            Place::ExpectKey | Place::AfterValue if ch == '}' => {
                self.place = Place::Closed;
                Step::Closed
            }
            Place::AfterValue if ch == ',' => {
                self.place = Place::ExpectKey;
                Step::Open
            }
            Place::ExpectKey | Place::AfterValue => Step::Malformed,
            Place::InKey => {
                if self.key_escaped {
                    self.key_escaped = false;
                    self.key.push(ch);
                } else if ch == '\\' {
                    self.key_escaped = true;
                    self.key.push(ch);
                } else if ch == '"' {
                    self.place = Place::ExpectColon;
                    self.first_key.get_or_insert_with(|| self.key.clone());
                } else {
                    self.key.push(ch);
                }
                Step::Open
            }
            Place::ExpectColon if ch.is_whitespace() => Step::Open,
            Place::ExpectColon if ch == ':' => {
                self.place = Place::ExpectValue;
                Step::Open
            }
            Place::ExpectColon => Step::Malformed,
            Place::ExpectValue if ch.is_whitespace() => Step::Open,
            Place::ExpectValue => {
                self.value = match self.key.as_str() {
                    "name" => ValueKind::Name,
                    "arguments" | "parameters" if !self.arguments_done => ValueKind::Arguments,
                    _ => ValueKind::Other,
                };
                self.value_depth = 0;
                self.in_string = false;
                self.escaped = false;
                self.bare_value = !matches!(ch, '{' | '[' | '"');
                if self.value == ValueKind::Arguments {
                    self.arguments.clear();
                    self.arguments_quoted = ch == '"';
                }
                self.place = Place::InValue;
                self.value_char(ch)
            }
            Place::InValue => self.value_char(ch),
        }
    }

    /// One character of a value, ending it where its JSON ends.
    fn value_char(&mut self, ch: char) -> Step {
        if self.bare_value && !self.in_string && (ch == ',' || ch == '}' || ch.is_whitespace()) {
            self.end_value();
            self.place = Place::AfterValue;
            return self.push(ch);
        }
        self.record(ch);
        let mut ended = false;
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if ch == '\\' {
                self.escaped = true;
            } else if ch == '"' {
                self.in_string = false;
                ended = self.value_depth == 0;
            }
        } else {
            match ch {
                '"' => self.in_string = true,
                '{' | '[' => self.value_depth += 1,
                '}' | ']' => {
                    if self.value_depth == 0 {
                        return Step::Malformed;
                    }
                    self.value_depth -= 1;
                    ended = self.value_depth == 0;
                }
                _ => {}
            }
        }
        if ended {
            self.end_value();
            self.place = Place::AfterValue;
        }
        Step::Open
    }

    fn record(&mut self, ch: char) {
        match self.value {
            ValueKind::Name => self.name_raw.push(ch),
            ValueKind::Arguments => self.arguments.push(ch),
            ValueKind::Other => {}
        }
    }

    fn end_value(&mut self) {
        match self.value {
            ValueKind::Name => {
                self.name = serde_json::from_str::<String>(&self.name_raw)
                    .ok()
                    .or_else(|| Some(self.name_raw.trim_matches('"').to_string()));
            }
            ValueKind::Arguments => {
                self.arguments_done = true;
                if self.arguments_quoted {
                    self.arguments = serde_json::from_str::<String>(&self.arguments)
                        .unwrap_or_else(|_| "{}".into());
                }
            }
            ValueKind::Other => {}
        }
        self.value = ValueKind::Other;
    }

    /// What is new since the last call: the start once the name is known, then argument
    /// text (a quoted arguments string only once decoded).
    pub(crate) fn take(&mut self) -> CallOutput {
        let mut out = CallOutput::default();
        let Some(name) = &self.name else {
            return out;
        };
        if !self.started {
            self.started = true;
            out.start = Some(name.clone());
        }
        if self.arguments_quoted && !self.arguments_done {
            return out;
        }
        out.arguments = self
            .arguments
            .get(self.sent..)
            .unwrap_or_default()
            .to_string();
        self.sent = self.arguments.len();
        out
    }

    /// The object closed or output ended: what remains, with `{}` for a call that gave no
    /// arguments. Nothing for a call that never named its function.
    pub(crate) fn finish(&mut self) -> CallOutput {
        if self.name.is_none() {
            return CallOutput::default();
        }
        if self.arguments.is_empty() && self.sent == 0 {
            self.arguments = "{}".into();
            self.arguments_quoted = false;
        } else if self.arguments_quoted && !self.arguments_done {
            // Cut inside a quoted arguments string: it cannot be decoded.
            self.arguments = "{}".into();
            self.arguments_quoted = false;
        }
        self.take()
    }
}

/// A bare JSON object (Mistral's `[ARGS]{...}`), told where it ends.
#[derive(Debug, Default)]
pub(crate) struct ObjectScanner {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl ObjectScanner {
    /// Whether the object's `{` has been read.
    pub(crate) fn begun(&self) -> bool {
        self.depth > 0
    }

    /// Feeds one character of the object (leading whitespace is the caller's).
    pub(crate) fn push(&mut self, ch: char) -> Step {
        if self.depth == 0 && ch != '{' {
            return Step::Malformed;
        }
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if ch == '\\' {
                self.escaped = true;
            } else if ch == '"' {
                self.in_string = false;
            }
            return Step::Open;
        }
        match ch {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    return Step::Closed;
                }
            }
            _ => {}
        }
        Step::Open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` one character at a time; the name and the argument text seen.
    fn scan(text: &str) -> (Option<String>, String, Step) {
        let mut scanner = CallScanner::new();
        let (mut name, mut args, mut last) = (None, String::new(), Step::Open);
        for ch in text.chars() {
            last = scanner.push(ch);
            let out = if last == Step::Closed {
                scanner.finish()
            } else {
                scanner.take()
            };
            name = name.or(out.start);
            args += &out.arguments;
            if last != Step::Open {
                break;
            }
        }
        (name, args, last)
    }

    #[test]
    fn reads_name_and_arguments_in_either_order() {
        let (name, args, step) =
            scan(r#"{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": [1, {"a": 2}]}}"#);
        assert_eq!(name.as_deref(), Some("get_weather"));
        assert_eq!(args, r#"{"city": "Pa}ris", "n": [1, {"a": 2}]}"#);
        assert_eq!(step, Step::Closed);
        let (name, args, _) = scan(r#"{"parameters": {"x": 1}, "id": 3, "name": "f\u0031"}"#);
        assert_eq!(
            (name.as_deref(), args.as_str()),
            (Some("f1"), r#"{"x": 1}"#)
        );
    }

    #[test]
    fn quoted_missing_and_odd_arguments() {
        let (_, args, _) = scan(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#);
        assert_eq!(args, r#"{"a": 1}"#);
        let (_, args, _) = scan(r#"{"name": "f"}"#);
        assert_eq!(args, "{}");
        let (name, args, step) = scan(r#"{"arguments": {}}"#);
        assert_eq!((name, args.as_str(), step), (None, "", Step::Closed));
        assert_eq!(scan("[1]").2, Step::Malformed);
        assert_eq!(scan(r#"{"name" 3}"#).2, Step::Malformed);
    }

    #[test]
    fn first_key_is_known_before_its_value() {
        let mut scanner = CallScanner::new();
        for ch in r#" {"answer""#.chars() {
            assert_eq!(scanner.push(ch), Step::Open);
        }
        assert_eq!(scanner.first_key(), Some("answer"));
        assert!(!scanner.started());
    }
}
