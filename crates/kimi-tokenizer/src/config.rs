//! `tokenizer_config.json`: special-token names and ids, bos/eos, chat template.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::TokenizerError;

/// The parts of a Hugging Face `tokenizer_config.json` this crate uses.
#[derive(Debug, Default, Clone)]
pub(crate) struct TokenizerConfig {
    /// `added_tokens_decoder`: id → token content.
    pub added_tokens: BTreeMap<u32, String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The chat template source; a named list resolves to its "default" entry.
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Reads `path`; a missing file yields the empty config.
    pub fn load_optional(path: &Path) -> Result<Self, TokenizerError> {
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = read_to_string(path)?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, TokenizerError> {
        let json: Value = serde_json::from_str(text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |reason: String| TokenizerError::InvalidFile {
            path: path.to_path_buf(),
            reason,
        };
        let Value::Object(root) = json else {
            return Err(invalid("top level is not a JSON object".into()));
        };
        let mut config = Self::default();
        if let Some(decoder) = root.get("added_tokens_decoder") {
            let Value::Object(entries) = decoder else {
                return Err(invalid("`added_tokens_decoder` is not an object".into()));
            };
            for (key, entry) in entries {
                let id: u32 = key.parse().map_err(|_| {
                    invalid(format!(
                        "`added_tokens_decoder` key {key:?} is not a token id"
                    ))
                })?;
                let content = token_content(entry).ok_or_else(|| {
                    invalid(format!(
                        "`added_tokens_decoder[{key}]` has no string `content`"
                    ))
                })?;
                config.added_tokens.insert(id, content);
            }
        }
        config.bos_token = special_token_field(&root, "bos_token", path)?;
        config.eos_token = special_token_field(&root, "eos_token", path)?;
        config.chat_template = match root.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(value) => Some(select_chat_template(value).map_err(invalid)?),
        };
        Ok(config)
    }
}

/// `"<s>"` or `{"content": "<s>", ...}` (an AddedToken dict).
fn token_content(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn special_token_field(
    root: &serde_json::Map<String, Value>,
    field: &str,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match root.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => token_content(value)
            .map(Some)
            .ok_or_else(|| TokenizerError::InvalidFile {
                path: path.to_path_buf(),
                reason: format!(
                    "`{field}` is neither a string nor an object with string `content`"
                ),
            }),
    }
}

/// HF allows a single template string or a list of `{name, template}`; take "default" (as
/// transformers does when no name is asked for), else the first entry.
fn select_chat_template(value: &Value) -> Result<String, String> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Array(entries) => {
            let mut first = None;
            for entry in entries {
                let name = entry.get("name").and_then(Value::as_str);
                let Some(template) = entry.get("template").and_then(Value::as_str) else {
                    return Err("`chat_template` list entry has no string `template`".into());
                };
                if name == Some("default") {
                    return Ok(template.to_owned());
                }
                first.get_or_insert(template);
            }
            first
                .map(str::to_owned)
                .ok_or_else(|| "`chat_template` is an empty list".into())
        }
        _ => Err("`chat_template` is neither a string nor a list of {name, template}".into()),
    }
}

pub(crate) fn read_to_string(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The chat template of a model directory: `chat_template.jinja` wins over the config's
/// `chat_template`, as in transformers (which loads the file and overrides the config value).
pub(crate) fn find_chat_template(
    dir: &Path,
    config: &TokenizerConfig,
) -> Result<Option<(String, PathBuf)>, TokenizerError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return Ok(Some((read_to_string(&jinja)?, jinja)));
    }
    Ok(config
        .chat_template
        .clone()
        .map(|source| (source, dir.join("tokenizer_config.json"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TokenizerConfig, TokenizerError> {
        TokenizerConfig::parse(text, Path::new("tokenizer_config.json"))
    }

    #[test]
    fn reads_added_tokens_and_specials() {
        let config = parse(
            r#"{"added_tokens_decoder": {"5": {"content": "[BOS]", "special": true}},
                "bos_token": "[BOS]", "eos_token": {"content": "[EOS]", "__type": "AddedToken"},
                "pad_token": null}"#,
        )
        .unwrap();
        assert_eq!(
            config.added_tokens.get(&5).map(String::as_str),
            Some("[BOS]")
        );
        assert_eq!(config.bos_token.as_deref(), Some("[BOS]"));
        assert_eq!(config.eos_token.as_deref(), Some("[EOS]"));
        assert_eq!(config.chat_template, None);
    }

    #[test]
    fn template_list_takes_default() {
        let config = parse(
            r#"{"chat_template": [{"name": "tool_use", "template": "A"},
                                  {"name": "default", "template": "B"}]}"#,
        )
        .unwrap();
        assert_eq!(config.chat_template.as_deref(), Some("B"));
        let config = parse(r#"{"chat_template": [{"name": "rag", "template": "C"}]}"#).unwrap();
        assert_eq!(config.chat_template.as_deref(), Some("C"));
    }

    #[test]
    fn errors_name_the_file_and_problem() {
        let err = parse(r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("tokenizer_config.json"), "{text}");
        assert!(text.contains("\"x\""), "{text}");
        assert!(parse("[1,2]").is_err());
        assert!(parse("{").is_err());
        assert!(parse(r#"{"bos_token": 3}"#).is_err());
        assert!(parse(r#"{"chat_template": 3}"#).is_err());
    }
}
