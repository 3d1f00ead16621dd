//! Typed, never-panicking access to the fields of one JSON object of a `config.json`.
//!
//! Every reader treats JSON `null` as absent (Python writes `None` as `null`), accepts a list
//! of alias spellings, and reports problems as [`ConfigError`] naming the field as written.

use serde_json::{Map, Value};

use super::ConfigError;

/// Largest size or count accepted for any dimension. Real Kimi configs stay far below it; the
/// cap keeps products such as `vocab_size * hidden_size` far from overflowing `usize`
/// downstream.
pub(super) const MAX_DIM: u64 = 1 << 24;

/// Largest context length accepted.
pub(super) const MAX_CONTEXT: u64 = u32::MAX as u64;

/// One JSON object together with the dotted path that leads to it (`""` for the top level,
/// `"linear_attn_config."` for the nested table).
#[derive(Clone, Copy)]
pub(super) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'static str,
}

/// Builds [`ConfigError::Invalid`].
pub(super) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Describes a JSON value in a few words for error messages.
pub(super) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if s.chars().count() <= 40 => format!("the string {s:?}"),
        Value::String(_) => "a long string".into(),
        Value::Array(a) => format!("an array of {} items", a.len()),
        Value::Object(_) => "an object".into(),
    }
}

impl<'a> Fields<'a> {
    /// Wraps `obj`, whose fields are reported as `prefix` + name.
    pub(super) fn new(obj: &'a Map<String, Value>, prefix: &'static str) -> Self {
        Fields { obj, prefix }
    }

    /// The dotted name of `key` for error messages.
    pub(super) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value of `key`, treating `null` as absent.
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// The first present spelling among `keys` and its value. Two spellings that are both
    /// present must hold the same value.
    pub(super) fn alias(
        &self,
        keys: &[&'static str],
    ) -> Result<Option<(&'static str, &'a Value)>, ConfigError> {
        let mut found: Option<(&'static str, &'a Value)> = None;
        for &key in keys {
            let Some(value) = self.get(key) else { continue };
            match found {
                None => found = Some((key, value)),
                Some((first, first_value)) if first_value != value => {
                    return Err(invalid(
                        self.name(first),
                        format!(
                            "is {} but its alias `{}` is {}; give one spelling or equal values",
                            describe(first_value),
                            self.name(key),
                            describe(value)
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(found)
    }

    /// The error for a required field that is absent, naming every accepted spelling.
    pub(super) fn missing(&self, keys: &[&'static str]) -> ConfigError {
        let names: Vec<String> = keys.iter().map(|k| self.name(k)).collect();
        ConfigError::Missing(names.join(" / "))
    }

    /// A non-negative integer no larger than `max`, if present.
    pub(super) fn uint_opt(
        &self,
        keys: &[&'static str],
        max: u64,
    ) -> Result<Option<u64>, ConfigError> {
        let Some((key, value)) = self.alias(keys)? else {
            return Ok(None);
        };
        as_uint(&self.name(key), value, max).map(Some)
    }

    /// A size or count that must be present and at least 1.
    pub(super) fn positive(&self, keys: &[&'static str]) -> Result<usize, ConfigError> {
        self.positive_opt(keys)?.ok_or_else(|| self.missing(keys))
    }

    /// A size or count that is at least 1, if present.
    pub(super) fn positive_opt(&self, keys: &[&'static str]) -> Result<Option<usize>, ConfigError> {
        self.positive_opt_max(keys, MAX_DIM)
    }

    /// A number in `1..=max`, if present.
    pub(super) fn positive_opt_max(
        &self,
        keys: &[&'static str],
        max: u64,
    ) -> Result<Option<usize>, ConfigError> {
        let Some((key, value)) = self.alias(keys)? else {
            return Ok(None);
        };
        let n = as_uint(&self.name(key), value, max)?;
        if n == 0 {
            return Err(invalid(self.name(key), "must be at least 1, found 0"));
        }
        Ok(Some(to_usize(n)))
    }

    /// A count that may be zero, if present.
    pub(super) fn count_opt(&self, keys: &[&'static str]) -> Result<Option<usize>, ConfigError> {
        Ok(self.uint_opt(keys, MAX_DIM)?.map(to_usize))
    }

    /// A finite number, if present.
    pub(super) fn f32_opt(&self, keys: &[&'static str]) -> Result<Option<f32>, ConfigError> {
        let Some((key, value)) = self.alias(keys)? else {
            return Ok(None);
        };
        let Some(x) = value.as_f64() else {
            return Err(invalid(
                self.name(key),
                format!("expected a number, found {}", describe(value)),
            ));
        };
        let x32 = x as f32;
        if !x32.is_finite() {
            return Err(invalid(
                self.name(key),
                format!("must be a finite number, found {x}"),
            ));
        }
        Ok(Some(x32))
    }

    /// A finite number greater than zero, or `default` when absent.
    pub(super) fn positive_f32_or(
        &self,
        keys: &[&'static str],
        default: f32,
    ) -> Result<f32, ConfigError> {
        match self.f32_opt(keys)? {
            None => Ok(default),
            Some(x) if x > 0.0 => Ok(x),
            Some(x) => Err(invalid(
                self.name(keys.first().copied().unwrap_or("?")),
                format!("must be greater than 0, found {x}"),
            )),
        }
    }

    /// A boolean, if present.
    pub(super) fn bool_opt(&self, keys: &[&'static str]) -> Result<Option<bool>, ConfigError> {
        let Some((key, value)) = self.alias(keys)? else {
            return Ok(None);
        };
        value.as_bool().map(Some).ok_or_else(|| {
            invalid(
                self.name(key),
                format!("expected true or false, found {}", describe(value)),
            )
        })
    }

    /// A string, if present.
    pub(super) fn str_opt(&self, keys: &[&'static str]) -> Result<Option<&'a str>, ConfigError> {
        let Some((key, value)) = self.alias(keys)? else {
            return Ok(None);
        };
        value.as_str().map(Some).ok_or_else(|| {
            invalid(
                self.name(key),
                format!("expected a string, found {}", describe(value)),
            )
        })
    }

    /// A nested object, if present.
    pub(super) fn object_opt(
        &self,
        key: &'static str,
    ) -> Result<Option<&'a Map<String, Value>>, ConfigError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_object().map(Some).ok_or_else(|| {
            invalid(
                self.name(key),
                format!("expected an object, found {}", describe(value)),
            )
        })
    }

    /// An array, if present.
    pub(super) fn array_opt(&self, key: &'static str) -> Result<Option<&'a [Value]>, ConfigError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        value.as_array().map(|a| Some(a.as_slice())).ok_or_else(|| {
            invalid(
                self.name(key),
                format!("expected an array, found {}", describe(value)),
            )
        })
    }
}

/// Reads `value` as an integer in `0..=max`; `field` names it in errors.
pub(super) fn as_uint(field: &str, value: &Value, max: u64) -> Result<u64, ConfigError> {
    if let Some(n) = value.as_u64() {
        if n > max {
            return Err(invalid(
                field,
                format!("{n} is larger than the supported maximum {max}"),
            ));
        }
        return Ok(n);
    }
    let reason = match value {
        Value::Number(n) if n.is_i64() => format!("must not be negative, found {n}"),
        Value::Number(n) => format!("expected a whole number, found {n}"),
        other => format!("expected a whole number, found {}", describe(other)),
    };
    Err(invalid(field, reason))
}

/// Converts a value already capped by [`MAX_DIM`] or [`MAX_CONTEXT`].
pub(super) fn to_usize(n: u64) -> usize {
    // Both caps fit in 32 bits, so this saturation never triggers on supported targets.
    usize::try_from(n).unwrap_or(usize::MAX)
}
