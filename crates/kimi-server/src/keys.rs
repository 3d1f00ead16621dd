//! API keys with names and per-key limits: from `--api-key` (named `key-1`, `key-2`, ... by
//! position), from a key file (`--api-key-file`), or from `KIMI_API_KEYS`
//! (`name=key,name=key`).
//!
//! A key file has one key per line, `NAME KEY` then optional limits, `#` starts a comment:
//!
//! ```text
//! # name   key              limits (each optional; absent: the command's defaults)
//! alice    sk-alice-3f9c1e  rpm=60 tpm=20000 concurrency=4
//! batch    sk-batch-77aa01  tpm=500000
//! ```
//!
//! Keys are compared in constant time against every configured key; logs and metrics name
//! a key by its name, never by its text.

use std::path::Path;

use axum::http::{header, HeaderMap};

/// Limits of one key; `None` means "no limit of this kind" (after defaults are applied).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    /// Requests admitted per minute.
    pub requests_per_minute: Option<u64>,
    /// Prompt + completion tokens per minute (checked when a request arrives, charged when
    /// it ends).
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once (a stream counts until its last event).
    pub max_concurrent: Option<u64>,
}

impl KeyLimits {
    /// Each limit this key sets, else the one of `defaults`.
    pub fn or(self, defaults: KeyLimits) -> KeyLimits {
        KeyLimits {
            requests_per_minute: self.requests_per_minute.or(defaults.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(defaults.tokens_per_minute),
            max_concurrent: self.max_concurrent.or(defaults.max_concurrent),
        }
    }

    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        *self == KeyLimits::default()
    }
}

/// One accepted key. `Debug` shows the name, never the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// How logs, metrics and limits name the key.
    pub name: String,
    secret: String,
    /// This key's own limits (unset ones fall back to the command's defaults).
    pub limits: KeyLimits,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("name", &self.name)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// A key file or key list that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file cannot be read.
    #[error("cannot read the API key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line or entry is malformed.
    #[error("{origin}: {message}")]
    Malformed {
        /// `FILE line N`, or the variable and entry.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@'))
}

fn valid_secret(secret: &str) -> bool {
    !secret.is_empty() && secret.len() <= 512 && secret.bytes().all(|b| b.is_ascii_graphic())
}

impl ApiKey {
    /// A key with a name and no limits of its own.
    ///
    /// # Errors
    ///
    /// A message when the name is not 1–64 of `[A-Za-z0-9._@-]` or the key is not 1–512
    /// printable ASCII characters without spaces.
    pub fn new(name: &str, secret: &str) -> Result<ApiKey, String> {
        if !valid_name(name) {
            return Err(format!(
                "the key name `{name}` must be 1-64 letters, digits or . _ @ -"
            ));
        }
        if !valid_secret(secret) {
            return Err(format!(
                "the key named `{name}` must be 1-512 printable characters without spaces"
            ));
        }
        Ok(ApiKey {
            name: name.to_string(),
            secret: secret.to_string(),
            limits: KeyLimits::default(),
        })
    }

    /// Parses a key file's text (see the module docs); `origin` names the file in errors.
    ///
    /// # Errors
    ///
    /// [`KeyError::Malformed`] naming the line.
    pub fn parse_file_text(text: &str, origin: &str) -> Result<Vec<ApiKey>, KeyError> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let malformed = |message: String| KeyError::Malformed {
                origin: format!("{origin} line {}", i + 1),
                message,
            };
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(name), Some(secret)) = (words.next(), words.next()) else {
                return Err(malformed(
                    "expected `NAME KEY [rpm=N] [tpm=N] [concurrency=N]`".into(),
                ));
            };
            let mut key = ApiKey::new(name, secret).map_err(malformed)?;
            for word in words {
                let (field, value) = word.split_once('=').ok_or_else(|| {
                    malformed(format!(
                        "`{word}` is not a limit (rpm=N, tpm=N, concurrency=N)"
                    ))
                })?;
                let n: u64 = value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                    malformed(format!(
                        "`{word}`: the limit must be a whole number above 0"
                    ))
                })?;
                let slot = match field {
                    "rpm" => &mut key.limits.requests_per_minute,
                    "tpm" => &mut key.limits.tokens_per_minute,
                    "concurrency" => &mut key.limits.max_concurrent,
                    _ => {
                        return Err(malformed(format!(
                            "unknown limit `{field}` (rpm, tpm or concurrency)"
                        )))
                    }
                };
                *slot = Some(n);
            }
            keys.push(key);
        }
        Ok(keys)
    }

    /// Reads a key file (see the module docs).
    ///
    /// # Errors
    ///
    /// [`KeyError`] naming the file, and the line for a malformed one.
    pub fn read_file(path: &Path) -> Result<Vec<ApiKey>, KeyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse_file_text(&text, &shown)
    }

    /// Parses `name=key,name=key` (the `KIMI_API_KEYS` variable); `origin` names it in
    /// errors.
    ///
    /// # Errors
    ///
    /// [`KeyError::Malformed`] naming the entry (by position, never by its key).
    pub fn parse_list(text: &str, origin: &str) -> Result<Vec<ApiKey>, KeyError> {
        text.split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .enumerate()
            .map(|(i, entry)| {
                let malformed = |message: String| KeyError::Malformed {
                    origin: format!("{origin} entry {}", i + 1),
                    message,
                };
                let (name, secret) = entry
                    .split_once('=')
                    .ok_or_else(|| malformed("expected `name=key`".into()))?;
                ApiKey::new(name.trim(), secret.trim()).map_err(malformed)
            })
            .collect()
    }
}

/// The keys a server accepts.
#[derive(Clone, Debug, Default)]
pub struct KeySet {
    keys: Vec<ApiKey>,
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

impl KeySet {
    /// Unnamed keys (named `key-1`, `key-2`, ... by position, as `--api-key` gives them)
    /// followed by named ones.
    ///
    /// # Errors
    ///
    /// A message for a malformed key or a name or key given twice.
    pub fn build(unnamed: &[String], named: &[ApiKey]) -> Result<KeySet, String> {
        let mut keys = Vec::with_capacity(unnamed.len() + named.len());
        for (i, secret) in unnamed.iter().enumerate() {
            keys.push(ApiKey::new(&format!("key-{}", i + 1), secret)?);
        }
        keys.extend(named.iter().cloned());
        for (i, key) in keys.iter().enumerate() {
            for other in &keys[..i] {
                if other.name == key.name {
                    return Err(format!("the API key name `{}` is used twice", key.name));
                }
                if other.secret == key.secret {
                    return Err(format!(
                        "the API keys named `{}` and `{}` are the same key",
                        other.name, key.name
                    ));
                }
            }
        }
        Ok(KeySet { keys })
    }

    /// Whether no key is configured (every client is served).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The key that `presented` is; every key is compared, match or not.
    pub fn find(&self, presented: &[u8]) -> Option<&ApiKey> {
        self.keys.iter().fold(None, |found, key| {
            let equal = constant_time_eq(key.secret.as_bytes(), presented);
            found.or(equal.then_some(key))
        })
    }

    /// The key of a request's `Authorization: Bearer <key>` header, if it is one of these.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<&ApiKey> {
        let value = headers.get(header::AUTHORIZATION)?.as_bytes();
        let scheme = value.get(..7)?;
        if !scheme.eq_ignore_ascii_case(b"bearer ") {
            return None;
        }
        self.find(value[7..].trim_ascii())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        let set = KeySet::build(&["alpha".into(), "beta-key".into()], &[]).expect("keys");
        let name = |k: &[u8]| set.find(k).map(|k| k.name.clone());
        assert_eq!(name(b"alpha").as_deref(), Some("key-1"));
        assert_eq!(name(b"beta-key").as_deref(), Some("key-2"));
        assert_eq!(name(b"alph"), None);
        assert_eq!(name(b"alphaa"), None);
        assert_eq!(name(b""), None);
        assert!(KeySet::default().find(b"alpha").is_none());
    }

    #[test]
    fn key_files_parse_with_limits_and_comments() {
        let text = "# team keys\n\nalice sk-a rpm=60 tpm=2000 concurrency=2 # interactive\n\
                    batch  sk-b\ttpm=9\n";
        let keys = ApiKey::parse_file_text(text, "keys.txt").expect("parses");
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0].name, "alice");
        assert_eq!(
            keys[0].limits,
            KeyLimits {
                requests_per_minute: Some(60),
                tokens_per_minute: Some(2000),
                max_concurrent: Some(2)
            }
        );
        assert_eq!(keys[1].limits.tokens_per_minute, Some(9));
        assert!(!format!("{keys:?}").contains("sk-a"), "Debug shows no key");
    }

    #[test]
    fn bad_key_files_name_the_line() {
        for (text, needle) in [
            ("alice\n", "keys.txt line 1: expected `NAME KEY"),
            ("a k\nb k2 rpm=0\n", "keys.txt line 2: `rpm=0`"),
            ("a k burst=3\n", "unknown limit `burst`"),
            ("a k rpm\n", "`rpm` is not a limit"),
            ("a/b k\n", "key name `a/b`"),
        ] {
            let err = ApiKey::parse_file_text(text, "keys.txt").expect_err(text);
            assert!(err.to_string().contains(needle), "{err} lacks {needle}");
        }
    }

    #[test]
    fn env_lists_and_duplicates() {
        let keys = ApiKey::parse_list("alice=sk-a=b, bob=sk-b,", "KIMI_API_KEYS").expect("list");
        assert_eq!(keys[0].name, "alice");
        let set = KeySet::build(&[], &keys).expect("set");
        assert_eq!(set.find(b"sk-a=b").map(|k| k.name.as_str()), Some("alice"));
        let err = ApiKey::parse_list("alice", "KIMI_API_KEYS").expect_err("no =");
        assert!(err.to_string().contains("KIMI_API_KEYS entry 1"));
        let twice = KeySet::build(&["sk-a=b".into()], &keys).expect_err("same key");
        assert!(twice.contains("`key-1` and `alice`"), "{twice}");
        let dup = ApiKey::parse_list("a=x,a=y", "E").expect("parses");
        assert!(KeySet::build(&[], &dup).is_err());
    }

    #[test]
    fn bearer_headers() {
        let set = KeySet::build(&["sk-1".into()], &[]).expect("keys");
        let mut headers = HeaderMap::new();
        assert!(set.authenticate(&headers).is_none());
        headers.insert(
            header::AUTHORIZATION,
            "bearer  sk-1 ".parse().expect("value"),
        );
        assert_eq!(
            set.authenticate(&headers).map(|k| k.name.as_str()),
            Some("key-1")
        );
        headers.insert(header::AUTHORIZATION, "Basic sk-1".parse().expect("value"));
        assert!(set.authenticate(&headers).is_none());
    }
}
