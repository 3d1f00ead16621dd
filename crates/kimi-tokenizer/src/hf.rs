//! `tokenizer.json` models through the `tokenizers` crate.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{LazyLock, OnceLock};

use serde_json::Value;

use crate::TokenizerError;

/// How a model token's string maps back to bytes, read off the `tokenizer.json` decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceScheme {
    /// GPT-2 byte-to-unicode alphabet (`ByteLevel` decoder).
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` is one byte (`Metaspace` / `ByteFallback`).
    SentencePiece,
    /// The token string is the text.
    Plain,
}

pub(crate) struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy with `encode_special_tokens` set, so special-token text encodes as text.
    plain: OnceLock<tokenizers::Tokenizer>,
    /// id → bytes (`None` for ids no token has).
    token_bytes: Vec<Option<Vec<u8>>>,
    special: HashSet<u32>,
    /// The most bytes of text one token can stand for, where that is bounded (see
    /// [`byte_exact`]).
    max_token_bytes: Option<usize>,
    /// Bytes that are a token on their own; the BPE drops the others (no unknown token).
    encodable: [bool; 256],
}

impl HfTokenizer {
    /// The `tokenizers` model itself.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        let text = crate::config::read_to_string(path)?;
        let json: Value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let scheme = piece_scheme(json.get("decoder").unwrap_or(&Value::Null));
        let inner = tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|source| {
            TokenizerError::HfLoad {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let exact = scheme == PieceScheme::ByteLevel && byte_exact(&json);
        Ok(Self::new(inner, scheme, exact))
    }

    /// Wraps a built tokenizer whose model tokens spell their bytes as `scheme` says;
    /// `byte_exact`: its tokens' bytes always concatenate to the text (see [`byte_exact`]).
    pub fn new(inner: tokenizers::Tokenizer, scheme: PieceScheme, byte_exact: bool) -> Self {
        let added = inner.get_added_tokens_decoder();
        let special = added
            .iter()
            .filter(|(_, token)| token.special)
            .map(|(&id, _)| id)
            .collect();
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab
            .values()
            .chain(added.keys())
            .max()
            .map_or(0, |&id| id as usize + 1);
        let mut token_bytes = vec![None; vocab_size];
        for (token, id) in vocab {
            token_bytes[id as usize] = Some(match added.get(&id) {
                Some(added) => added.content.as_bytes().to_vec(),
                None => piece_bytes(&token, scheme),
            });
        }
        for (id, token) in &added {
            token_bytes[*id as usize] = Some(token.content.as_bytes().to_vec());
        }
        // A byte with no token of its own is dropped by the BPE rather than encoded, so
        // only the others count towards the bound.
        let mut encodable = [false; 256];
        for bytes in token_bytes.iter().flatten() {
            if let [b] = bytes.as_slice() {
                encodable[usize::from(*b)] = true;
            }
        }
        let max_token_bytes = byte_exact.then(|| {
            token_bytes
                .iter()
                .flatten()
                .map(Vec::len)
                .max()
                .unwrap_or(1)
                .max(1)
        });
        Self {
            inner,
            plain: OnceLock::new(),
            token_bytes,
            special,
            max_token_bytes,
            encodable,
        }
    }

    /// The most bytes of text one token stands for, when that is bounded.
    pub fn max_token_bytes(&self) -> Option<usize> {
        self.max_token_bytes
    }

    /// The bytes of `text` that become part of some token (see `encodable`).
    pub fn encodable_bytes(&self, text: &str) -> usize {
        if self.encodable.iter().all(|&e| e) {
            return text.len();
        }
        text.bytes()
            .filter(|&b| self.encodable[usize::from(b)])
            .count()
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize)?.as_deref()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes without the post-processor's special tokens (`add_special_tokens=False`, as
    /// transformers does for rendered chat prompts); callers add BOS themselves if wanted.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tokenizer = if allow_special {
            &self.inner
        } else {
            self.plain.get_or_init(|| {
                let mut plain = self.inner.clone();
                plain.set_encode_special_tokens(true);
                plain
            })
        };
        let encoding = tokenizer
            .encode(text, false)
            .map_err(|err| TokenizerError::Encode(err.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes through the tokenizer's own decoder (so e.g. Metaspace strips the first space).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| self.token_bytes(id).is_none()) {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size(),
            });
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|err| TokenizerError::Decode(err.to_string()))
    }
}

/// Whether a `tokenizer.json` turns text into tokens whose bytes are runs of that text, so
/// that a text of `n` bytes has at least `n / longest token` tokens: a byte-level BPE with no
/// normalizer (which could shrink text) and no added token that strips the whitespace
/// around it (which could swallow any amount). Others (WordPiece, unigram, normalizers,
/// unknown tokens) can stand for unbounded text per token.
fn byte_exact(json: &Value) -> bool {
    let mut pre = Vec::new();
    collect_types(json.get("pre_tokenizer").unwrap_or(&Value::Null), &mut pre);
    let model_bpe = json
        .get("model")
        .and_then(|m| m.get("type"))
        .and_then(Value::as_str)
        == Some("BPE");
    let strips = json
        .get("added_tokens")
        .and_then(Value::as_array)
        .is_some_and(|tokens| {
            tokens.iter().any(|t| {
                ["lstrip", "rstrip"]
                    .iter()
                    .any(|k| t.get(*k).and_then(Value::as_bool) == Some(true))
            })
        });
    json.get("normalizer").is_none_or(Value::is_null)
        && model_bpe
        && pre.contains(&"ByteLevel")
        && !strips
}

fn piece_scheme(decoder: &Value) -> PieceScheme {
    let mut types = Vec::new();
    collect_types(decoder, &mut types);
    if types.contains(&"ByteLevel") {
        PieceScheme::ByteLevel
    } else if types
        .iter()
        .any(|t| matches!(*t, "Metaspace" | "ByteFallback" | "Replace"))
    {
        PieceScheme::SentencePiece
    } else {
        PieceScheme::Plain
    }
}

fn collect_types<'a>(value: &'a Value, types: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            if let Some(kind) = map.get("type").and_then(Value::as_str) {
                types.push(kind);
            }
            map.values().for_each(|v| collect_types(v, types));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_types(v, types)),
        _ => {}
    }
}

fn piece_bytes(token: &str, scheme: PieceScheme) -> Vec<u8> {
    match scheme {
        // As the `tokenizers` ByteLevel decoder: a token with any char outside the alphabet
        // is taken as UTF-8 text.
        PieceScheme::ByteLevel => token
            .chars()
            .map(byte_level_char_to_byte)
            .collect::<Option<Vec<u8>>>()
            .unwrap_or_else(|| token.as_bytes().to_vec()),
        PieceScheme::SentencePiece => match byte_fallback(token) {
            Some(byte) => vec![byte],
            None => token.replace('\u{2581}', " ").into_bytes(),
        },
        PieceScheme::Plain => token.as_bytes().to_vec(),
    }
}

/// `<0xNN>` → the byte NN.
fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the other
/// 68 bytes to U+0100.. in byte order; so every alphabet char is below U+0144.
fn byte_level_char_to_byte(c: char) -> Option<u8> {
    static TABLE: LazyLock<[Option<u8>; 0x144]> = LazyLock::new(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let mut table = [None; 0x144];
        let mut next = 0x100;
        for b in 0..=255u8 {
            if printable(b) {
                table[usize::from(b)] = Some(b);
            } else {
                table[next] = Some(b);
                next += 1;
            }
        }
        table
    });
    TABLE.get(c as usize).copied().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_inverts() {
        assert_eq!(byte_level_char_to_byte('a'), Some(b'a'));
        assert_eq!(byte_level_char_to_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_char_to_byte('Ā'), Some(0));
        assert_eq!(byte_level_char_to_byte('ł'), Some(0xa0));
        assert_eq!(byte_level_char_to_byte('Ń'), Some(0xad));
        assert_eq!(byte_level_char_to_byte(' '), None);
        assert_eq!(byte_level_char_to_byte('ń'), None);
        assert_eq!(piece_bytes("ĠHello", PieceScheme::ByteLevel), b" Hello");
        assert_eq!(piece_bytes("<0x0A>", PieceScheme::SentencePiece), b"\n");
        assert_eq!(piece_bytes("▁the", PieceScheme::SentencePiece), b" the");
    }
}
