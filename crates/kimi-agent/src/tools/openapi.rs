//! REST tools from an OpenAPI 3 document (JSON): one tool per operation with an
//! `operationId`. Path, query and header parameters become properties of the tool's
//! arguments; a JSON request body becomes the property `body`. Local `$ref`s
//! (`#/components/...`) are inlined; remote ones are refused. The arguments' schema is
//! closed (`additionalProperties: false`).

use std::path::Path;

use serde_json::{json, Map, Value};

use super::rest::{headers, parse_method, BodyArgs, QueryArgs, RestParts, RestTool};
use super::{seconds, Tool, ToolKind};
use crate::config::{resolve, OpenApiConfig};
use crate::schema::ArgsSchema;

/// Deepest `$ref` chain inlined; deeper (or recursive) schemas end in `{}` (any value).
const MAX_REF_DEPTH: usize = 16;

/// The tools of the document `config` names.
///
/// # Errors
///
/// An unreadable or non-OpenAPI-3 document, an operation that cannot be made a tool, or
/// an `operations` entry the document does not have.
pub fn tools(
    config: &OpenApiConfig,
    base_dir: &Path,
    client: &reqwest::Client,
) -> Result<Vec<Tool>, String> {
    let path = resolve(base_dir, &config.spec);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read it: {e}"))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| format!("not a JSON document: {e}"))?;
    let version = doc.get("openapi").and_then(Value::as_str).unwrap_or("");
    if !version.starts_with("3.") {
        return Err(format!(
            "`openapi` is `{version}`; OpenAPI 3.x documents are supported"
        ));
    }
    let base_url = match &config.base_url {
        Some(url) => url.clone(),
        None => doc
            .pointer("/servers/0/url")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or("the document has no `servers` entry; set `base_url`")?,
    };
    let base_url = base_url.trim_end_matches('/').to_string();
    let fixed_headers = headers(&config.headers)?;
    let timeout = seconds(config.timeout_seconds, "timeout_seconds")?;
    let paths = doc
        .get("paths")
        .and_then(Value::as_object)
        .ok_or("the document has no `paths`")?;
    let mut tools = Vec::new();
    for (route, item) in paths {
        let Some(item) = item.as_object() else {
            continue;
        };
        let shared_params = item.get("parameters").cloned().unwrap_or(json!([]));
        for method in ["get", "put", "post", "delete", "patch", "head"] {
            let Some(op) = item.get(method) else {
                continue;
            };
            let Some(id) = op.get("operationId").and_then(Value::as_str) else {
                continue;
            };
            if let Some(wanted) = &config.operations {
                if !wanted.iter().any(|w| w == id) {
                    continue;
                }
            }
            let what = format!("operation `{id}` ({} {route})", method.to_uppercase());
            let op =
                Operation::read(&doc, op, &shared_params).map_err(|e| format!("{what}: {e}"))?;
            let rest = RestTool::new(RestParts {
                client: client.clone(),
                method: parse_method(method)?,
                url: format!("{base_url}{route}"),
                path_args: op.path,
                query: QueryArgs::Listed(op.query),
                header_args: op.header,
                body: if op.has_body {
                    BodyArgs::Field("body".into())
                } else {
                    BodyArgs::None
                },
                headers: fixed_headers.clone(),
                timeout,
                max_bytes: config.max_response_bytes,
            })
            .map_err(|e| format!("{what}: {e}"))?;
            let name: String = format!("{}{id}", config.prefix)
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            tools.push(Tool {
                name,
                description: op.description,
                args: ArgsSchema::new(op.schema).map_err(|e| format!("{what}: {e}"))?,
                kind: ToolKind::Rest(rest),
            });
        }
    }
    if let Some(wanted) = &config.operations {
        for w in wanted {
            if !tools
                .iter()
                .any(|t| t.name == format!("{}{w}", config.prefix))
            {
                return Err(format!("the document has no operation `{w}`"));
            }
        }
    }
    Ok(tools)
}

struct Operation {
    description: String,
    schema: Value,
    path: Vec<String>,
    query: Vec<String>,
    header: Vec<String>,
    has_body: bool,
}

impl Operation {
    fn read(doc: &Value, op: &Value, shared: &Value) -> Result<Operation, String> {
        let summary = op.get("summary").and_then(Value::as_str).unwrap_or("");
        let detail = op.get("description").and_then(Value::as_str).unwrap_or("");
        let description = match (summary.is_empty(), detail.is_empty()) {
            (false, false) => format!("{summary}. {detail}"),
            (false, true) => summary.to_string(),
            _ => detail.to_string(),
        };
        let mut properties = Map::new();
        let mut required = Vec::new();
        let (mut path, mut query, mut header) = (Vec::new(), Vec::new(), Vec::new());
        let params = shared.as_array().into_iter().flatten().chain(
            op.get("parameters")
                .and_then(Value::as_array)
                .into_iter()
                .flatten(),
        );
        for param in params {
            let param = inline(doc, param, 0)?;
            let name = param
                .get("name")
                .and_then(Value::as_str)
                .ok_or("a parameter without a `name`")?
                .to_string();
            let place = param.get("in").and_then(Value::as_str).unwrap_or("");
            let list = match place {
                "path" => &mut path,
                "query" => &mut query,
                "header" => &mut header,
                // Cookies are not sent.
                _ => continue,
            };
            if list.contains(&name) {
                continue;
            }
            list.push(name.clone());
            let mut schema = param.get("schema").cloned().unwrap_or(json!({}));
            if let (Some(d), Some(obj)) = (param.get("description"), schema.as_object_mut()) {
                obj.entry("description").or_insert(d.clone());
            }
            if place == "path" || param.get("required") == Some(&Value::Bool(true)) {
                required.push(Value::String(name.clone()));
            }
            properties.insert(name, schema);
        }
        let mut has_body = false;
        if let Some(body) = op.get("requestBody") {
            let body = inline(doc, body, 0)?;
            let schema = body
                .pointer("/content/application~1json/schema")
                .cloned()
                .ok_or("only JSON request bodies (`application/json`) are supported")?;
            has_body = true;
            if body.get("required") == Some(&Value::Bool(true)) {
                required.push(json!("body"));
            }
            properties.insert("body".into(), schema);
        }
        // Closed: extra arguments would go nowhere, and a closed schema keeps constrained
        // decoding from inventing them.
        let mut schema =
            json!({"type": "object", "properties": properties, "additionalProperties": false});
        if !required.is_empty() {
            schema["required"] = Value::Array(required);
        }
        let schema = inline(doc, &schema, 0)?;
        Ok(Operation {
            description,
            schema,
            path,
            query,
            header,
            has_body,
        })
    }
}

/// `value` with every local `$ref` replaced by what it points to; a reference inside its
/// own expansion (a recursive schema) becomes `{}` (any value).
fn inline(doc: &Value, value: &Value, depth: usize) -> Result<Value, String> {
    inline_within(doc, value, depth, &mut Vec::new())
}

fn inline_within(
    doc: &Value,
    value: &Value,
    depth: usize,
    expanding: &mut Vec<String>,
) -> Result<Value, String> {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(target)) = map.get("$ref") {
                let pointer = target
                    .strip_prefix('#')
                    .ok_or_else(|| format!("`$ref: {target}`: only local references are read"))?;
                if depth >= MAX_REF_DEPTH || expanding.contains(target) {
                    return Ok(json!({}));
                }
                let found = doc
                    .pointer(pointer)
                    .ok_or_else(|| format!("`$ref: {target}` points to nothing"))?;
                expanding.push(target.clone());
                let out = inline_within(doc, found, depth + 1, expanding);
                expanding.pop();
                return out;
            }
            let mut out = Map::new();
            for (k, v) in map {
                out.insert(k.clone(), inline_within(doc, v, depth, expanding)?);
            }
            Ok(Value::Object(out))
        }
        Value::Array(items) => items
            .iter()
            .map(|v| inline_within(doc, v, depth, expanding))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array),
        other => Ok(other.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_are_inlined_and_cycles_end() {
        let doc = json!({"components": {"schemas": {
            "Pet": {"type": "object", "properties": {"name": {"type": "string"},
                    "friend": {"$ref": "#/components/schemas/Pet"}}}}}});
        let v = inline(&doc, &json!({"$ref": "#/components/schemas/Pet"}), 0).unwrap();
        assert_eq!(v["properties"]["name"]["type"], "string");
        assert_eq!(v["properties"]["friend"], json!({}));
        assert!(inline(&doc, &json!({"$ref": "http://x/y"}), 0).is_err());
        assert!(inline(&doc, &json!({"$ref": "#/nope"}), 0).is_err());
    }
}
