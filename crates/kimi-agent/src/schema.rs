//! Tool arguments: parsed from the model's JSON text and validated against the tool's
//! JSON schema (the `jsonschema` crate, drafts 4 to 2020-12) before anything runs.

use serde_json::Value;

/// Violations listed in one error message; more are counted.
const MAX_LISTED: usize = 5;

/// A tool's parameter schema, compiled.
#[derive(Debug)]
pub struct ArgsSchema {
    schema: Value,
    validator: jsonschema::Validator,
}

impl ArgsSchema {
    /// Compiles `schema`, which must describe an object (OpenAI's function parameters).
    ///
    /// # Errors
    ///
    /// Why the schema is not a valid JSON schema, or not an object schema.
    pub fn new(schema: Value) -> Result<ArgsSchema, String> {
        let Some(map) = schema.as_object() else {
            return Err("`parameters` must be a JSON schema object".into());
        };
        match map.get("type") {
            None => {}
            Some(Value::String(t)) if t == "object" => {}
            Some(other) => {
                return Err(format!(
                    "`parameters` must have `type: object` (tool arguments are an object), \
                     not {other}"
                ))
            }
        }
        let validator = jsonschema::validator_for(&schema)
            .map_err(|e| format!("`parameters` is not a valid JSON schema: {e}"))?;
        Ok(ArgsSchema { schema, validator })
    }

    /// The schema as given, for the model's tool list.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Checks `args` against the schema.
    ///
    /// # Errors
    ///
    /// A message for the model naming each violation and where it is.
    pub fn check(&self, args: &Value) -> Result<(), String> {
        let mut problems = Vec::new();
        let mut count = 0usize;
        for error in self.validator.iter_errors(args) {
            count += 1;
            if problems.len() < MAX_LISTED {
                let at = error.instance_path().to_string();
                let at = if at.is_empty() { "/".to_string() } else { at };
                problems.push(format!("at {at}: {error}"));
            }
        }
        if count == 0 {
            return Ok(());
        }
        let mut message = format!(
            "the arguments do not match the tool's schema ({count} problem{}): {}",
            if count == 1 { "" } else { "s" },
            problems.join("; ")
        );
        if count > problems.len() {
            message.push_str(&format!("; and {} more", count - problems.len()));
        }
        Err(message)
    }
}

/// The model's argument text as JSON (empty text is `{}`).
///
/// # Errors
///
/// A message for the model quoting the start of the text.
pub fn parse_arguments(text: &str) -> Result<Value, String> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    serde_json::from_str(text).map_err(|e| {
        let shown: String = text.chars().take(200).collect();
        format!("the arguments are not valid JSON ({e}): {shown}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn violations_are_named() {
        let s = ArgsSchema::new(json!({
            "type": "object",
            "properties": {"n": {"type": "integer", "maximum": 5}, "s": {"type": "string"}},
            "required": ["n"],
            "additionalProperties": false
        }))
        .unwrap();
        assert!(s.check(&json!({"n": 3})).is_ok());
        let err = s.check(&json!({"n": 9, "x": 1})).unwrap_err();
        assert!(err.contains("2 problems") && err.contains("/n"), "{err}");
        let err = s.check(&json!({"s": "a"})).unwrap_err();
        assert!(err.contains("\"n\" is a required property"), "{err}");
    }

    #[test]
    fn bad_schemas_and_arguments() {
        assert!(ArgsSchema::new(json!({"type": "string"})).is_err());
        assert!(ArgsSchema::new(json!([1])).is_err());
        assert!(
            ArgsSchema::new(json!({"type": "object", "properties": {"a": {"type": 5}}})).is_err()
        );
        assert_eq!(parse_arguments("").unwrap(), json!({}));
        assert!(parse_arguments("{oops")
            .unwrap_err()
            .contains("not valid JSON"));
    }
}
