//! Lark grammars (llguidance) that force Kimi K3's XTML: a tools section calling the given
//! functions with typed arguments (`tool_choice` required or named), or a response holding
//! JSON (`response_format`). Each starts where the prompt left the model: inside `think`
//! (free reasoning, then `<|close|>think<|sep|>`) or inside `response`, and ends with
//! `<|close|>message<|sep|>`, after which the matcher stops the sequence.
//!
//! Arguments follow the schema's `properties` in their order, required ones always, optional
//! ones maybe; each value is raw text for a string (an `enum`/`const` and length limits are
//! kept) or `%json` of the property's schema for the other types, with one `type=` variant
//! per JSON type the schema allows. Undeclared keys are not offered. A schema without
//! `properties` is called with one `json type="object"` payload matching the whole schema.

use serde_json::{json, Map, Value};

use crate::constraint::{with_layout, MAX_PARALLEL_CALLS};
/// Free text: reasoning, or a string value (never a control token).
const TEXT: &str = "/(.|\\n)+/";

/// A lark string literal.
fn lit(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

/// The grammar's opening: close `think` (after optional reasoning), or close the prefilled
/// `response`.
fn opening(thinking: bool) -> &'static str {
    if thinking {
        "reasoning? <|close|> \"think\" <|sep|>"
    } else {
        ""
    }
}

/// A tools section of one call (`single`) or up to four, each to one of `tools`.
pub(crate) fn tool_calls(
    tools: &[(&str, &Value)],
    single: bool,
    thinking: bool,
) -> Result<String, String> {
    let num_calls = if single { 1 } else { MAX_PARALLEL_CALLS };
    let mut tail = String::new();
    for i in (1..num_calls).rev() {
        tail = format!("(call_{i} {tail})?");
    }
    let mut lark = if thinking {
        // A reply before the calls stays empty, so a forced call cannot ramble there.
        format!(
            "start: {} empty_response? tools <|close|> \"message\" <|sep|>\n\
             empty_response: <|open|> \"response\" <|sep|> <|close|> \"response\" <|sep|>\n",
            opening(true)
        )
    } else {
        "start: <|close|> \"response\" <|sep|> tools <|close|> \"message\" <|sep|>\n".to_string()
    };
    lark += &format!(
        "tools: <|open|> \"tools\" <|sep|> call_0 {tail} <|close|> \"tools\" <|sep|>\n\
         reasoning: {TEXT}\ntext: {TEXT}\n"
    );
    for i in 0..num_calls {
        let alternatives: Vec<String> = tools
            .iter()
            .enumerate()
            .map(|(t, (name, _))| {
                let header = format!("call tool=\"{name}\" index=\"{}\"", i + 1);
                format!("{} <|sep|> body_{t}", lit(&header))
            })
            .collect();
        lark += &format!(
            "call_{i}: <|open|> ({}) <|close|> \"call\" <|sep|>\n",
            alternatives.join(" | ")
        );
    }
    for (t, (_, schema)) in tools.iter().enumerate() {
        lark += &arguments(t, schema)?;
    }
    Ok(lark)
}

/// A response that is JSON matching `schema`.
pub(crate) fn json_response(schema: &Value, thinking: bool) -> Result<String, String> {
    let schema = serde_json::to_string(&with_layout(schema.clone())).map_err(|e| e.to_string())?;
    let lark = if thinking {
        format!(
            "start: {} <|open|> \"response\" <|sep|> answer <|close|> \"response\" <|sep|> \
             <|close|> \"message\" <|sep|>\nreasoning: {TEXT}\n",
            opening(true)
        )
    } else {
        "start: answer <|close|> \"response\" <|sep|> <|close|> \"message\" <|sep|>\n".into()
    };
    Ok(lark + &format!("answer: %json {schema}\n"))
}

/// `body_T`: the arguments of tool `t`.
fn arguments(t: usize, schema: &Value) -> Result<String, String> {
    let Some(properties) = schema.get("properties") else {
        let schema =
            serde_json::to_string(&with_layout(schema.clone())).map_err(|e| e.to_string())?;
        return Ok(format!(
            "body_{t}: <|open|> \"json type=\\\"object\\\"\" <|sep|> payload_{t} <|close|> \"json\" <|sep|>\n\
             payload_{t}: %json {schema}\n"
        ));
    };
    let Value::Object(properties) = properties else {
        return Err("`properties` must be an object".into());
    };
    let required: Vec<&str> = match schema.get("required") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(keys)) => keys.iter().filter_map(Value::as_str).collect(),
        Some(_) => return Err("`required` must be a list of names".into()),
    };
    if let Some(key) = required.iter().find(|k| !properties.contains_key(**k)) {
        return Err(format!("required property {key:?} has no schema"));
    }
    let mut lark = String::new();
    let mut body = Vec::new();
    for (k, (key, property)) in properties.iter().enumerate() {
        let variants = value_variants(property, schema, 0);
        if variants.is_empty() {
            if required.contains(&key.as_str()) {
                return Err(format!("property {key:?} accepts no value"));
            }
            continue;
        }
        let mut alternatives = Vec::new();
        for (v, (kind, restricted)) in variants.iter().enumerate() {
            let xtml_type = if kind == "integer" { "number" } else { kind };
            let header = format!(
                "argument key=\"{}\" type=\"{xtml_type}\"",
                kimi_tokenizer::xtml::escape_attr(key)
            );
            let value = format!("value_{t}_{k}_{v}");
            if kind == "string" {
                lark += &format!("{value}: {}\n", string_value(restricted));
            } else {
                let restricted = serde_json::to_string(&with_layout(restricted.clone()))
                    .map_err(|e| e.to_string())?;
                lark += &format!("{value}: %json {restricted}\n");
            }
            alternatives.push(format!("{} <|sep|> {value}", lit(&header)));
        }
        lark += &format!(
            "arg_{t}_{k}: <|open|> ({}) <|close|> \"argument\" <|sep|>\n",
            alternatives.join(" | ")
        );
        let optional = if required.contains(&key.as_str()) {
            ""
        } else {
            "?"
        };
        body.push(format!("arg_{t}_{k}{optional}"));
    }
    // An empty body: lark has no empty rule, so `body_T` matches an empty string literal.
    let body = if body.is_empty() {
        "\"\"".to_string()
    } else {
        body.join(" ")
    };
    Ok(lark + &format!("body_{t}: {body}\n"))
}

/// Raw text for a string: one of its `enum`/`const` values, or text within its length limits.
fn string_value(schema: &Value) -> String {
    let options: Option<Vec<&str>> = match (schema.get("const"), schema.get("enum")) {
        (Some(Value::String(one)), _) => Some(vec![one.as_str()]),
        (_, Some(Value::Array(values))) => Some(values.iter().filter_map(Value::as_str).collect()),
        _ => None,
    };
    if let Some(options) = options {
        let nonempty: Vec<String> = options
            .iter()
            .filter(|o| !o.is_empty())
            .map(|o| lit(o))
            .collect();
        let alternatives = format!("({})", nonempty.join(" | "));
        return match (nonempty.is_empty(), options.iter().any(|o| o.is_empty())) {
            (true, _) => "\"\"".into(),
            (false, true) => format!("{alternatives}?"),
            (false, false) => alternatives,
        };
    }
    let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    match schema.get("maxLength").and_then(Value::as_u64) {
        Some(0) => "\"\"".into(),
        Some(max) => format!("/(.|\\n){{{},{max}}}/{}", min.max(1), opt(min)),
        None if min > 1 => format!("/(.|\\n){{{min},}}/"),
        None => format!("text{}", opt(min)),
    }
}

fn opt(min: u64) -> &'static str {
    if min == 0 {
        "?"
    } else {
        ""
    }
}

/// The JSON types `schema` allows, each with the schema narrowed to it: `type` (one or a
/// list), local `$ref`s, `anyOf`/`oneOf` branches, `enum`/`const` values; all seven when
/// nothing says. `number` makes `integer` redundant. `$defs` of the root ride along.
fn value_variants(schema: &Value, root: &Value, depth: usize) -> Vec<(String, Value)> {
    const TYPES: [&str; 7] = [
        "string", "number", "integer", "boolean", "null", "object", "array",
    ];
    let Value::Object(map) = schema else {
        // `true` (anything) or `false` (nothing).
        return if schema == &Value::Bool(true) && depth < 8 {
            value_variants(&json!({}), root, depth + 1)
        } else {
            Vec::new()
        };
    };
    if let Some(target) = map
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| resolve(r, root))
    {
        if depth < 8 {
            return value_variants(target, root, depth + 1);
        }
    }
    let mut out: Vec<(String, Value)> = Vec::new();
    let branches = map
        .get("anyOf")
        .or_else(|| map.get("oneOf"))
        .and_then(Value::as_array);
    if let (Some(branches), true) = (branches, depth < 8) {
        for branch in branches {
            for (kind, narrowed) in value_variants(branch, root, depth + 1) {
                match out.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, Value::Object(existing))) if existing.contains_key("anyOf") => {
                        if let Some(Value::Array(list)) = existing.get_mut("anyOf") {
                            list.push(narrowed);
                        }
                    }
                    Some((_, existing)) => {
                        *existing = json!({"anyOf": [existing.clone(), narrowed]});
                    }
                    None => out.push((kind, narrowed)),
                }
            }
        }
    } else {
        let values: Option<Vec<&Value>> = match (map.get("const"), map.get("enum")) {
            (Some(one), _) => Some(vec![one]),
            (_, Some(Value::Array(values))) => Some(values.iter().collect()),
            _ => None,
        };
        let kinds: Vec<&str> = match map.get("type") {
            Some(Value::String(kind)) => vec![kind.as_str()],
            Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
            _ => match &values {
                Some(values) => TYPES
                    .iter()
                    .copied()
                    .filter(|t| {
                        values
                            .iter()
                            .any(|v| kimi_tokenizer::xtml::xtml_type(v) == *t)
                    })
                    .collect(),
                None => TYPES.iter().copied().filter(|t| *t != "integer").collect(),
            },
        };
        for kind in kinds.into_iter().filter(|k| TYPES.contains(k)) {
            let mut narrowed: Map<String, Value> = map.clone();
            narrowed.insert("type".into(), json!(kind));
            if let Some(values) = &values {
                let fitting: Vec<Value> = values
                    .iter()
                    .filter(|v| fits(v, kind))
                    .map(|v| (*v).clone())
                    .collect();
                if fitting.is_empty() {
                    continue;
                }
                narrowed.remove("const");
                narrowed.insert("enum".into(), Value::Array(fitting));
            }
            out.push((kind.to_string(), Value::Object(narrowed)));
        }
    }
    if out.iter().any(|(k, _)| k == "number") {
        out.retain(|(k, _)| k != "integer");
    }
    for (_, narrowed) in &mut out {
        for defs in ["$defs", "definitions"] {
            if let (Some(found), Value::Object(target)) = (root.get(defs), &mut *narrowed) {
                target.entry(defs).or_insert_with(|| found.clone());
            }
        }
    }
    out
}

fn fits(value: &Value, kind: &str) -> bool {
    match kind {
        "integer" => value.as_i64().is_some() || value.as_u64().is_some(),
        "number" => value.is_number(),
        other => kimi_tokenizer::xtml::xtml_type(value) == other,
    }
}

/// A local reference, `#/a/b`.
fn resolve<'a>(reference: &str, root: &'a Value) -> Option<&'a Value> {
    let path = reference.strip_prefix("#/")?;
    path.split('/').try_fold(root, |node, part| {
        node.get(part.replace("~1", "/").replace("~0", "~"))
    })
}

#[cfg(test)]
mod tests {
    use kimi_core::TokenId;
    use kimi_tokenizer::Tokenizer;

    use super::*;
    use crate::constraint::{Constraints, Processor};
    use crate::xtml_output::{XtmlEvent, XtmlParser, XtmlStart, XtmlTokens};

    const CLOSE_ID: TokenId = 960;

    fn k3() -> Tokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer-k3");
        Tokenizer::from_dir(&dir).expect("K3 demo tokenizer")
    }

    /// Walks the grammar over uniform logits: `<|close|>`, `}` or `"` whenever allowed (so
    /// free text and objects end soon), else the lowest allowed id (ids 0-255 are bytes).
    fn drive(matcher: llguidance::Matcher) -> Vec<TokenId> {
        let mut processor = Processor::build(&[], &[], Some(matcher)).expect("processor");
        let mut out = Vec::new();
        for _ in 0..400 {
            if processor.is_finished() {
                return out;
            }
            let mut logits = vec![0.0f32; 1212];
            processor.mask(&mut logits);
            let id = [CLOSE_ID, b'}'.into(), b'"'.into()]
                .into_iter()
                .find(|&id| logits[id as usize].is_finite())
                .unwrap_or_else(|| {
                    logits.iter().position(|l| l.is_finite()).expect("a token") as TokenId
                });
            processor.accept(id).expect("allowed token accepted");
            out.push(id);
        }
        panic!("the grammar did not finish: {out:?}");
    }

    /// `(text, calls as (name, arguments JSON))` of a walk, read back by the real parser.
    fn walk(matcher: llguidance::Matcher, start: XtmlStart) -> (String, Vec<(String, Value)>) {
        let tok = k3();
        let ids = drive(matcher);
        let mut parser =
            XtmlParser::new(XtmlTokens::find(&tok).expect("markers"), start, true, true);
        let mut events: Vec<XtmlEvent> = Vec::new();
        for &id in &ids {
            events.extend(parser.push_token(&tok, id));
        }
        events.extend(parser.finish());
        let mut calls: Vec<(String, String)> = Vec::new();
        for event in events {
            match event {
                XtmlEvent::CallStart { name, .. } => calls.push((name, String::new())),
                XtmlEvent::Arguments { index, text } => calls[index].1 += &text,
                XtmlEvent::Content(_) | XtmlEvent::Reasoning(_) => {}
            }
        }
        let calls = calls
            .into_iter()
            .map(|(n, a)| (n, serde_json::from_str(&a).expect("arguments are JSON")))
            .collect();
        (tok.decode(&ids, false).expect("decodes"), calls)
    }

    fn constraints() -> Constraints {
        Constraints::new(&k3(), 1212).expect("trie")
    }

    #[test]
    fn a_forced_call_has_typed_arguments() {
        let schema = json!({"type": "object", "required": ["unit", "days", "city"],
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
                "detail": {"type": ["boolean", "null"]},
                "where": {"$ref": "#/$defs/place"}},
            "$defs": {"place": {"type": "object", "properties": {"lat": {"type": "number"}},
                                "required": ["lat"]}}});
        for thinking in [false, true] {
            let matcher = constraints()
                .xtml_tool_calls(&[("get_weather", &schema)], false, thinking)
                .expect("grammar compiles");
            let start = if thinking {
                XtmlStart::Think
            } else {
                XtmlStart::Response
            };
            let (text, calls) = walk(matcher, start);
            let opening = if thinking {
                // An empty reply may come between the reasoning and the calls.
                "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
            } else {
                "<|close|>response<|sep|>"
            };
            let call = "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
                <|open|>argument key=\"city\" type=\"string\"<|sep|>";
            assert!(text.starts_with(&format!("{opening}{call}")), "{text}");
            assert!(
                text.ends_with("<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"),
                "{text}"
            );
            assert_eq!(calls.len(), 1, "{text}");
            let args = &calls[0].1;
            assert!(
                args["city"]
                    .as_str()
                    .is_some_and(|c| (2..=8).contains(&c.chars().count())),
                "{args}"
            );
            assert!(
                ["c", "f"].contains(&args["unit"].as_str().unwrap_or("")),
                "{args}"
            );
            assert!(
                args["days"].as_i64().is_some_and(|d| (1..=3).contains(&d)),
                "{args}"
            );
        }
    }

    #[test]
    fn free_form_parameters_take_a_json_payload_and_none_take_nothing() {
        let free = json!({"type": "object"});
        let none = json!({"type": "object", "properties": {}});
        let c = constraints();
        let (text, calls) = walk(
            c.xtml_tool_calls(&[("f", &free)], true, false)
                .expect("compiles"),
            XtmlStart::Response,
        );
        assert!(
            text.contains("<|open|>json type=\"object\"<|sep|>{"),
            "{text}"
        );
        assert!(calls[0].1.is_object());
        let (text, calls) = walk(
            c.xtml_tool_calls(&[("g", &none)], true, false)
                .expect("compiles"),
            XtmlStart::Response,
        );
        assert!(
            text.contains("index=\"1\"<|sep|><|close|>call<|sep|>"),
            "{text}"
        );
        assert_eq!(calls, vec![("g".to_string(), json!({}))]);
        let broken = json!({"type": "object", "properties": {}, "required": ["x"]});
        assert!(c.xtml_tool_calls(&[("h", &broken)], true, false).is_err());
    }

    #[test]
    fn a_json_response_is_wrapped_in_the_response_element() {
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                            "required": ["ok"], "additionalProperties": false});
        for thinking in [false, true] {
            let matcher = constraints()
                .xtml_json(Some(&schema), thinking)
                .expect("compiles");
            let ids = drive(matcher);
            let text = k3().decode(&ids, false).expect("decodes");
            let json_start = if thinking {
                text.strip_prefix("<|close|>think<|sep|><|open|>response<|sep|>")
            } else {
                Some(text.as_str())
            }
            .unwrap_or_else(|| panic!("{text}"));
            let body = json_start
                .strip_suffix("<|close|>response<|sep|><|close|>message<|sep|>")
                .unwrap_or_else(|| panic!("{text}"));
            let value: Value = serde_json::from_str(body).expect("JSON");
            assert!(value["ok"].is_boolean(), "{value}");
        }
    }
}
