//! Reading request fields out of parsed JSON with errors that name the field, as OpenAI's
//! API does (`param`). Absent and `null` fields are the same: "not given".

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The top-level JSON object of a request body.
pub(crate) struct Body {
    map: Map<String, Value>,
}

/// JSON's name for a value's type, for error messages.
pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// 400 saying `field` should be of type `expected`.
pub(crate) fn wrong_type(field: &str, expected: &str, got: &Value) -> ApiError {
    let got = type_name(got);
    ApiError::invalid(
        format!("`{field}` must be {expected}, got {got}"),
        Some(field),
    )
    .code("invalid_type")
}

/// 400 saying `field` has a bad value.
pub(crate) fn bad_value(field: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(format!("`{field}` {message}"), Some(field)).code("invalid_value")
}

/// A JSON number as an integer, if it is one (`3` and `3.0` are, `3.5` is not).
pub(crate) fn as_integer(value: &Value) -> Option<i64> {
    let n = value.as_number()?;
    if let Some(i) = n.as_i64() {
        return Some(i);
    }
    if n.is_u64() {
        return Some(i64::MAX);
    }
    let f = n.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 9.0e18).then_some(f as i64)
}

impl Body {
    /// Parses a request body, which must be one JSON object.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        let value: Value = serde_json::from_slice(bytes).map_err(|err| {
            ApiError::invalid(format!("The request body is not valid JSON: {err}"), None)
                .code("invalid_json")
        })?;
        match value {
            Value::Object(map) => Ok(Body { map }),
            other => Err(ApiError::invalid(
                format!(
                    "The request body must be a JSON object, got {}",
                    type_name(&other)
                ),
                None,
            )
            .code("invalid_json")),
        }
    }

    /// The field's value; `None` when absent or `null`.
    pub(crate) fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    /// A required field.
    pub(crate) fn required(&self, field: &str) -> Result<&Value, ApiError> {
        self.get(field).ok_or_else(|| {
            ApiError::invalid(format!("`{field}` is required"), Some(field)).code("missing_field")
        })
    }

    /// A number field.
    pub(crate) fn f32(&self, field: &str) -> Result<Option<f32>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(f) => Ok(Some(f as f32)),
                None => Err(wrong_type(field, "a number", v)),
            },
        }
    }

    /// An integer field (any sign).
    pub(crate) fn int(&self, field: &str) -> Result<Option<i64>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => as_integer(v)
                .map(Some)
                .ok_or_else(|| wrong_type(field, "an integer", v)),
        }
    }

    /// An integer field that must be in `[min, max]`.
    pub(crate) fn int_in(&self, field: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        match self.int(field)? {
            Some(i) if i < min || i > max => Err(bad_value(
                field,
                format!("must be in [{min}, {max}], got {i}"),
            )),
            other => Ok(other),
        }
    }

    /// A boolean field.
    pub(crate) fn bool(&self, field: &str) -> Result<Option<bool>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(field, "a boolean", v)),
        }
    }

    /// A string field.
    pub(crate) fn str(&self, field: &str) -> Result<Option<&str>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(field, "a string", v)),
        }
    }

    /// An object field.
    pub(crate) fn object(&self, field: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(wrong_type(field, "an object", v)),
        }
    }

    /// An array field.
    pub(crate) fn array(&self, field: &str) -> Result<Option<&Vec<Value>>, ApiError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(wrong_type(field, "an array", v)),
        }
    }

    /// A string or a list of strings (`stop`).
    pub(crate) fn strings(&self, field: &str) -> Result<Vec<String>, ApiError> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong_type(field, "a string or a list of strings", other)),
                })
                .collect(),
            Some(v) => Err(wrong_type(field, "a string or a list of strings", v)),
        }
    }

    /// A list of token ids below `vocab_size`.
    pub(crate) fn token_ids(&self, field: &str, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| token_id(field, item, vocab_size))
                .collect(),
            Some(v) => Err(wrong_type(field, "a list of token ids", v)),
        }
    }
}

/// One token id: an integer in `0..vocab_size`.
pub(crate) fn token_id(field: &str, value: &Value, vocab_size: usize) -> Result<u32, ApiError> {
    let id = as_integer(value).ok_or_else(|| wrong_type(field, "a list of token ids", value))?;
    if id < 0 || id as u64 >= vocab_size as u64 {
        return Err(bad_value(
            field,
            format!("has token id {id}, outside the vocabulary (0..{vocab_size})"),
        ));
    }
    Ok(id as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_names_them_in_errors() {
        let body = Body::parse(
            br#"{"t": 0.5, "i": 3, "f": 3.0, "s": "x", "n": null, "b": true, "l": ["a"]}"#,
        )
        .expect("object");
        assert_eq!(body.f32("t").ok().flatten(), Some(0.5));
        assert_eq!(body.int("i").ok().flatten(), Some(3));
        assert_eq!(body.int("f").ok().flatten(), Some(3));
        assert_eq!(body.int("n").ok().flatten(), None);
        assert_eq!(body.strings("s").ok(), Some(vec!["x".to_string()]));
        assert_eq!(body.strings("l").ok(), Some(vec!["a".to_string()]));
        let err = body.int("t").expect_err("0.5 is not an integer");
        assert_eq!(err.param.as_deref(), Some("t"));
        let err = body.f32("s").expect_err("a string is not a number");
        assert_eq!(err.message, "`s` must be a number, got string");
        assert!(body.bool("i").is_err());
        assert!(Body::parse(b"[1]").is_err());
        assert!(Body::parse(b"{").is_err());
        assert!(body.int_in("i", 4, 5).is_err());
    }
}
