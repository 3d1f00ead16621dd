//! Lark grammars (llguidance) for forced tool calls in the text formats: exactly the text
//! [`JsonToolKind::write_calls`] writes, with each call's arguments held to its tool's JSON
//! schema, one call or up to [`MAX_PARALLEL_CALLS`].

use serde_json::Value;

use crate::constraint::{with_layout, MAX_PARALLEL_CALLS};
use crate::tool_format::{JsonToolFormat, JsonToolKind};

/// `text` as a Lark string literal.
fn literal(text: &str) -> Result<String, String> {
    serde_json::to_string(text).map_err(|e| e.to_string())
}

/// The grammar of one to `MAX_PARALLEL_CALLS` calls (one when `single`) of `tools` (name,
/// parameters schema).
pub(crate) fn tool_calls(
    format: &JsonToolFormat,
    tools: &[(&str, &Value)],
    single: bool,
) -> Result<String, String> {
    let kind = format.kind;
    if kind == JsonToolKind::MistralArgs {
        return mistral_args_calls(format, tools, single);
    }
    let key = kind.arguments_key();
    let (open, separator, close) = match kind {
        JsonToolKind::Hermes => (
            "<tool_call>\n",
            "\n</tool_call>\n<tool_call>\n",
            "\n</tool_call>",
        ),
        JsonToolKind::Llama3Json => ("", "; ", ""),
        JsonToolKind::Mistral | JsonToolKind::MistralArgs => ("[", ", ", "]"),
        JsonToolKind::Generic => ("{\"tool_calls\": [", ", ", "]}"),
    };
    // A tag that is one special token is named by its id: text cannot produce it.
    let opener = match (kind, format.tag_token) {
        (JsonToolKind::Hermes, Some(id)) => format!("<[{id}]> {}", literal("\n")?),
        (JsonToolKind::Mistral, Some(id)) => format!("<[{id}]> {}", literal(open)?),
        (JsonToolKind::Mistral, None) => literal(&format!("[TOOL_CALLS]{open}"))?,
        _ if open.is_empty() => String::new(),
        _ => literal(open)?,
    };
    let separator = match (kind, format.tag_token) {
        (JsonToolKind::Hermes, Some(id)) => {
            format!(
                "{} <[{id}]> {}",
                literal("\n</tool_call>\n")?,
                literal("\n")?
            )
        }
        _ => literal(separator)?,
    };
    let close = if close.is_empty() {
        String::new()
    } else {
        literal(close)?
    };
    let tail = repeated(&format!("{separator} call"), single);
    let mut lark = format!("start: {opener} call {tail} {close}\n");
    let alternatives: Vec<String> = tools
        .iter()
        .enumerate()
        .map(|(t, (name, _))| {
            let name = serde_json::to_string(name).map_err(|e| e.to_string())?;
            let head = literal(&format!("{{\"name\": {name}, \"{key}\": "))?;
            Ok(format!("{head} args_{t} \"}}\""))
        })
        .collect::<Result<_, String>>()?;
    lark += &format!("call: {}\n", alternatives.join(" | "));
    lark += &arguments_rules(tools)?;
    Ok(lark)
}

/// `item` again up to `MAX_PARALLEL_CALLS - 1` times (none when `single`), as nested
/// optionals.
fn repeated(item: &str, single: bool) -> String {
    let mut tail = String::new();
    let more = if single { 1 } else { MAX_PARALLEL_CALLS };
    for _ in 1..more {
        tail = format!("({item} {tail})?");
    }
    tail
}

/// `args_T: %json SCHEMA` for each tool.
fn arguments_rules(tools: &[(&str, &Value)]) -> Result<String, String> {
    let mut rules = String::new();
    for (t, (_, schema)) in tools.iter().enumerate() {
        let schema =
            serde_json::to_string(&with_layout((*schema).clone())).map_err(|e| e.to_string())?;
        rules += &format!("args_{t}: %json {schema}\n");
    }
    Ok(rules)
}

/// Mistral's newer form: `[TOOL_CALLS]name[ARGS]{...}` per call.
fn mistral_args_calls(
    format: &JsonToolFormat,
    tools: &[(&str, &Value)],
    single: bool,
) -> Result<String, String> {
    let tag = |token: Option<u32>, text: &str| match token {
        Some(id) => Ok(format!("<[{id}]>")),
        None => literal(text),
    };
    let open = tag(format.tag_token, "[TOOL_CALLS]")?;
    let args = tag(format.args_token, "[ARGS]")?;
    let alternatives: Vec<String> = tools
        .iter()
        .enumerate()
        .map(|(t, (name, _))| Ok(format!("{} {args} args_{t}", literal(name)?)))
        .collect::<Result<_, String>>()?;
    let tail = repeated("call", single);
    let mut lark = format!(
        "start: call {tail}\ncall: {open} ({})\n",
        alternatives.join(" | ")
    );
    lark += &arguments_rules(tools)?;
    Ok(lark)
}
