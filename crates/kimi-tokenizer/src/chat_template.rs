//! Chat templates rendered with minijinja the way transformers renders them: Jinja with
//! `trim_blocks` and `lstrip_blocks`, Python string/dict methods (pycompat), transformers'
//! `tojson`, `raise_exception` and `strftime_now`.

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

use crate::pyjson::tojson_filter;
use crate::TokenizerError;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the `bos_token` / `eos_token` strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; fails with [`TokenizerError::TemplateSyntax`] on a syntax error.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizerError> {
        let syntax_error = |source| TokenizerError::TemplateSyntax {
            origin: None,
            source,
        };
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(syntax_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(syntax_error)?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos_token,
            eos_token,
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (OpenAI-style JSON objects) and optional `tools` (OpenAI tool
    /// schemas). The template sees `messages`, `tools` (`none` when absent),
    /// `add_generation_prompt`, `bos_token` and `eos_token`, as with transformers'
    /// `apply_chat_template`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let context = minijinja::context! {
            messages => json_list(messages),
            tools => tools.map_or(Value::from(()), json_list),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref(),
            eos_token => self.eos_token.as_deref(),
        };
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|template| template.render(context))
            .map_err(TokenizerError::TemplateRender)
    }
}

fn json_list(items: &[serde_json::Value]) -> Value {
    Value::from(items.iter().map(json_to_value).collect::<Vec<_>>())
}

/// Converts JSON to a template value, keeping object key order (the tools JSON a template
/// prints must keep the caller's order).
pub(crate) fn json_to_value(json: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            (None, None) => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => json_list(items),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

/// `raise_exception(message)`: templates call it to reject a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current time (UTC) formatted with Python `strftime` codes.
fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    strftime(&format, now)
}

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats UTC `unix_seconds` with the common `strftime` codes (C locale), including glibc's
/// `%-d`-style unpadded forms. Unknown codes are copied through.
pub(crate) fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; Monday = 0.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.next_if_eq(&'-').is_some();
        let Some(code) = chars.next() else {
            out.push('%');
            break;
        };
        let number = |value: i64, width: usize| {
            if unpadded {
                value.to_string()
            } else {
                format!("{value:0width$}")
            }
        };
        let text = match code {
            'Y' => year.to_string(),
            'y' => number(year.rem_euclid(100), 2),
            'm' => number(month, 2),
            'd' => number(day, 2),
            'e' => format!("{day:>2}"),
            'j' => number(day_of_year, 3),
            'H' => number(hour, 2),
            'I' => number(hour12, 2),
            'M' => number(minute, 2),
            'S' => number(second, 2),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            'A' => WEEKDAYS[weekday].to_owned(),
            'a' => WEEKDAYS[weekday][..3].to_owned(),
            'B' => month_name.to_owned(),
            'b' | 'h' => month_name[..3].to_owned(),
            'u' => (weekday + 1).to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'Z' => "UTC".to_owned(),
            'z' => "+0000".to_owned(),
            '%' => "%".to_owned(),
            other => format!("%{}{other}", if unpadded { "-" } else { "" }),
        };
        out.push_str(&text);
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A, %B %-d, %I%p %j %%", t),
            "Thursday, February 29, 01PM 060 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%a %Q %", 0), "Thu %Q %");
        assert_eq!(strftime("%F", -1), "1969-12-31");
    }

    #[test]
    fn hf_whitespace_and_python_methods() {
        let source = "{% for m in messages %}\n  {{ m.role | upper }}:{{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        let template = ChatTemplate::new(source, None, None).unwrap();
        let messages = [json!({"role": "user", "content": "  hi  "})];
        assert_eq!(
            template.render(&messages, None, true).unwrap(),
            "  USER:hi\n>"
        );
    }

    #[test]
    fn globals_and_errors() {
        let source = "{{ bos_token }}{% if tools is none %}no tools{% endif %}{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}{{ messages[0].get('name', 'anon') }}{{ eos_token }}";
        let template = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())).unwrap();
        let one = [json!({"role": "user", "content": "x"})];
        assert_eq!(
            template.render(&one, None, false).unwrap(),
            "<s>no toolsanon</s>"
        );
        let two = [one[0].clone(), one[0].clone()];
        let err = template.render(&two, None, false).unwrap_err().to_string();
        assert!(err.contains("only one message"), "{err}");
        let err = ChatTemplate::new("{% if %}", None, None).unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateSyntax { .. }));
    }

    #[test]
    fn strftime_now_is_callable() {
        let template = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
        let year: i64 = template.render(&[], None, false).unwrap().parse().unwrap();
        assert!(year >= 2024);
    }
}
