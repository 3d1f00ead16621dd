//! Python's `json.dumps` for template values, as transformers' chat-template `tojson` filter
//! calls it: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//! Unlike Jinja's own `tojson` it does not HTML-escape `<`, `>`, `&` or `'`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// `json.dumps` options.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(unit)`: newline and `unit` per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python's defaults for the given indent: `(", ", ": ")` on one line, `(",", ": ")` indented.
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        Self {
            ensure_ascii: false,
            indent,
            item_separator: item_separator.into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The `tojson` filter: `value | tojson(ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        // Python: an int is that many spaces (negative: none), a str is used as is.
        Some(v) => Some(match v.as_str() {
            Some(unit) => unit.to_owned(),
            None => {
                let spaces = v.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be int or str",
                    )
                })?;
                " ".repeat(usize::try_from(spaces).unwrap_or(0))
            }
        }),
    };
    let mut options = DumpOptions::new(indent);
    if let Some(ensure_ascii) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        options.ensure_ascii = ensure_ascii;
    }
    if let Some(sort_keys) = kwargs.get::<Option<bool>>("sort_keys")? {
        options.sort_keys = sort_keys;
    }
    if let Some(separators) = kwargs.get::<Option<Value>>("separators")? {
        if !separators.is_none() {
            let parts: Vec<Value> = separators.try_iter()?.collect();
            let [item, key] = parts.as_slice() else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            };
            let (Some(item), Some(key)) = (item.as_str(), key.as_str()) else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            };
            options.item_separator = item.to_owned();
            options.key_separator = key.to_owned();
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(dumps(value, &options)?))
}

/// Serializes `value` as Python's `json.dumps` would.
pub(crate) fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, options, 0)?;
    Ok(out)
}

fn not_serializable(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: object of type {} is not JSON serializable",
            value.kind()
        ),
    )
}

fn write_value(
    out: &mut String,
    value: &Value,
    options: &DumpOptions,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => write_string(
            out,
            value.as_str().unwrap_or_default(),
            options.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(
                out,
                ('[', ']'),
                &items,
                options,
                depth,
                |out, item, depth| write_value(out, item, options, depth),
            )?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                ('{', '}'),
                &entries,
                options,
                depth,
                |out, (key, item), depth| {
                    write_string(out, key, options.ensure_ascii);
                    out.push_str(&options.key_separator);
                    write_value(out, item, options, depth)
                },
            )?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// Writes `[a, b]` / `{...}` with Python's layout: empty containers stay `[]`, indented ones put
/// each item on its own line.
fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    options: &DumpOptions,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(unit) = &options.indent {
            out.push('\n');
            (0..level).for_each(|_| out.push_str(unit));
        }
    };
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python converts str, int, float, bool and None keys to strings.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool | ValueKind::Number => {
            let mut out = String::new();
            write_value(&mut out, key, &DumpOptions::new(None), 0)?;
            Ok(out)
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let float = f64::try_from(value.clone()).map_err(|_| not_serializable(value))?;
    out.push_str(&python_float_repr(float));
    Ok(())
}

/// Python's `float.__repr__` (shortest round-trip digits; exponent form below 1e-4 and from
/// 1e16 on), with json's `NaN` / `Infinity`.
pub(crate) fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // `{:e}` gives the shortest round-trip digits, e.g. "1.2345e-5".
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let plain = format!("{x}");
        if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// json's string encoder: `ensure_ascii=False` escapes only `"`, `\` and control chars;
/// `ensure_ascii=True` also every char outside `' '..='~'` (astral ones as surrogate pairs).
pub(crate) fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson_filter);
        env.render_str(template, ctx).unwrap()
    }

    fn data() -> Value {
        let json = serde_json::json!({
            "name": "get_weather", "b": [1, 2.5, true, null, "<é>\n\"", []], "a": {}, "x": 1e20
        });
        crate::chat_template::json_to_value(&json)
    }

    #[test]
    fn matches_python_json_dumps() {
        // Expected strings produced with CPython's json.dumps on the same object.
        assert_eq!(
            render("{{ d | tojson }}", minijinja::context! { d => data() }),
            r#"{"name": "get_weather", "b": [1, 2.5, true, null, "<é>\n\"", []], "a": {}, "x": 1e+20}"#
        );
        assert_eq!(
            render(
                "{{ d | tojson(separators=(',', ':')) }}",
                minijinja::context! { d => data() }
            ),
            r#"{"name":"get_weather","b":[1,2.5,true,null,"<é>\n\"",[]],"a":{},"x":1e+20}"#
        );
        assert_eq!(
            render("{{ d | tojson(indent=2, sort_keys=true) }}", minijinja::context! { d => data() }),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null,\n    \"<é>\\n\\\"\",\n    []\n  ],\n  \"name\": \"get_weather\",\n  \"x\": 1e+20\n}"
        );
        assert_eq!(
            render(
                "{{ 'é😀\x7f' | tojson(ensure_ascii=true) }}",
                Value::UNDEFINED
            ),
            r#""\u00e9\ud83d\ude00\u007f""#
        );
    }

    #[test]
    fn float_repr_is_pythons() {
        for (x, expected) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (f64::INFINITY, "Infinity"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(python_float_repr(x), expected);
        }
    }

    #[test]
    fn undefined_is_an_error() {
        let env = {
            let mut env = minijinja::Environment::new();
            env.add_filter("tojson", tojson_filter);
            env
        };
        assert!(env
            .render_str("{{ missing | tojson }}", Value::UNDEFINED)
            .is_err());
        assert!(env
            .render_str("{{ 1 | tojson(bogus=1) }}", Value::UNDEFINED)
            .is_err());
    }
}
