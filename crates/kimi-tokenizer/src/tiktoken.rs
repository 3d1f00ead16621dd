//! Kimi's tiktoken BPE: `tiktoken.model` (`base64(bytes) rank` lines) plus 256 + 2 special tokens,
//! pre-split by Kimi's regex. Follows Kimi's `tokenization_kimi.py` (spec §9.1–9.3).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use base64::Engine as _;
use tiktoken_rs::CoreBPE;

use crate::TokenizerError;

/// Kimi's pre-tokenization regex (spec §9.2), alternatives in order. `&&` is character-class
/// intersection; fancy-regex hands classes to regex-syntax, which implements it.
pub(crate) const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Kimi's `num_reserved_special_tokens`; the special ids are `n_base .. n_base + 256 + 2`.
pub(crate) const NUM_SPECIAL_TOKENS: u32 = 256 + 2;

/// Input is encoded in pieces of at most this many chars (`TIKTOKEN_MAX_ENCODE_CHARS`).
const MAX_ENCODE_CHARS: usize = 400_000;

/// Runs of whitespace / non-whitespace longer than this are cut (`MAX_NO_WHITESPACES_CHARS`).
const MAX_RUN_CHARS: usize = 25_000;

/// A loaded Kimi tiktoken vocabulary.
pub(crate) struct TiktokenBpe {
    bpe: CoreBPE,
    /// id → bytes; for special tokens, their text.
    tokens: Vec<Vec<u8>>,
    /// Base-token ids sorted by their bytes, for `token_id` look-ups.
    sorted_ids: Vec<u32>,
    specials: HashMap<String, u32>,
    n_base: u32,
    /// Bytes of the longest token (special tokens count their text).
    max_token_bytes: usize,
}

impl TiktokenBpe {
    /// Loads `vocab_path` with special-token names from `added_tokens` (read from `config_path`).
    pub fn load(
        vocab_path: &Path,
        added_tokens: &BTreeMap<u32, String>,
        config_path: &Path,
    ) -> Result<Self, TokenizerError> {
        let text = crate::config::read_to_string(vocab_path)?;
        let tokens = parse_vocab(&text, vocab_path)?;
        let n_base = u32::try_from(tokens.len())
            .ok()
            .filter(|n| n.checked_add(NUM_SPECIAL_TOKENS).is_some())
            .ok_or_else(|| TokenizerError::InvalidFile {
                path: vocab_path.to_path_buf(),
                reason: format!("{} tokens is too many for u32 ids", tokens.len()),
            })?;
        let specials = special_tokens(n_base, added_tokens, config_path)?;
        Self::build(tokens, specials, vocab_path)
    }

    /// The BPE of base tokens `tokens` (rank = id) and `specials` (ids `tokens.len()..`,
    /// contiguous), pre-split by Kimi's regex; `origin` names the source in errors.
    pub(crate) fn build(
        mut tokens: Vec<Vec<u8>>,
        specials: HashMap<String, u32>,
        origin: &Path,
    ) -> Result<Self, TokenizerError> {
        let vocab_path = origin;
        let n_base = u32::try_from(tokens.len()).map_err(|_| TokenizerError::InvalidFile {
            path: origin.to_path_buf(),
            reason: format!("{} tokens is too many for u32 ids", tokens.len()),
        })?;

        let encoder = tokens
            .iter()
            .zip(0u32..)
            .map(|(bytes, rank)| (bytes.clone(), rank))
            .collect();
        let special_encoder = specials
            .iter()
            .map(|(name, &id)| (name.clone(), id))
            .collect();
        let bpe = CoreBPE::new(encoder, special_encoder, KIMI_PATTERN).map_err(|err| {
            TokenizerError::InvalidFile {
                path: vocab_path.to_path_buf(),
                reason: format!("building the BPE failed: {err}"),
            }
        })?;

        let mut sorted_ids: Vec<u32> = (0..n_base).collect();
        sorted_ids.sort_unstable_by(|&a, &b| tokens[a as usize].cmp(&tokens[b as usize]));
        let mut names: Vec<(&String, u32)> = specials.iter().map(|(n, &id)| (n, id)).collect();
        names.sort_unstable_by_key(|&(_, id)| id);
        tokens.extend(names.into_iter().map(|(name, _)| name.as_bytes().to_vec()));
        let max_token_bytes = tokens.iter().map(Vec::len).max().unwrap_or(1).max(1);
        Ok(Self {
            bpe,
            tokens,
            sorted_ids,
            specials,
            n_base,
            max_token_bytes,
        })
    }

    /// Every token's bytes are a run of the text it encodes (byte-level BPE, special tokens
    /// matched literally), so no token covers more text than this.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    pub fn n_base(&self) -> u32 {
        self.n_base
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base && (id as usize) < self.tokens.len()
    }

    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(Vec::as_slice)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.specials.get(token) {
            return Some(id);
        }
        let index = self
            .sorted_ids
            .binary_search_by(|&id| self.tokens[id as usize].as_slice().cmp(token.as_bytes()))
            .ok()?;
        Some(self.sorted_ids[index])
    }

    /// Encodes as Kimi's `encode`: ≤400,000-char pieces, long runs cut, then tiktoken with
    /// `allowed_special="all"` (or no special tokens at all when `allow_special` is false).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_until(text, allow_special, usize::MAX)
    }

    /// [`Self::encode`], stopping after the first piece that takes the ids past `limit`: the
    /// pieces are encoded independently, so what comes back is always a prefix of the full
    /// encoding, and the full encoding itself when it has at most `limit` ids.
    pub fn encode_until(
        &self,
        text: &str,
        allow_special: bool,
        limit: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        let allowed: HashSet<&str> = if allow_special {
            self.specials.keys().map(String::as_str).collect()
        } else {
            HashSet::new()
        };
        let mut ids = Vec::new();
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for piece in split_long_runs(chunk, MAX_RUN_CHARS) {
                // `encode` (not `encode_ordinary`) because it reports regex failures instead of
                // panicking; with an empty allowed set it treats special-token text as text.
                let (piece_ids, _) = self
                    .bpe
                    .encode(piece, &allowed)
                    .map_err(|err| TokenizerError::Encode(err.message))?;
                ids.extend(piece_ids);
                if ids.len() > limit {
                    return Ok(ids);
                }
            }
        }
        Ok(ids)
    }

    /// Concatenated token bytes; errors on ids outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let token = self
                .tokens
                .get(id as usize)
                .ok_or(TokenizerError::UnknownId {
                    id,
                    vocab_size: self.tokens.len(),
                })?;
            if !(skip_special && id >= self.n_base) {
                bytes.extend_from_slice(token);
            }
        }
        Ok(bytes)
    }
}

/// Parses `tiktoken.model` into rank-ordered token bytes. As tiktoken's `load_tiktoken_bpe`
/// empty lines are skipped; in addition ranks must be exactly `0..n` and bytes unique (the
/// special ids start at `n`, so a gap or duplicate would shift them), and every single byte
/// must be a token (the BPE falls back to single bytes).
fn parse_vocab(text: &str, path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let line_error = |line: usize, reason: String| TokenizerError::VocabLine {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut entries = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let line_no = index + 1;
        let mut fields = line.split_whitespace();
        let (Some(encoded), Some(rank), None) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(line_error(
                line_no,
                "expected `<base64 token> <rank>`".into(),
            ));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|err| line_error(line_no, format!("bad base64 {encoded:?}: {err}")))?;
        let rank: usize = rank
            .parse()
            .map_err(|_| line_error(line_no, format!("bad rank {rank:?}")))?;
        entries.push((line_no, bytes, rank));
    }
    let num_tokens = entries.len();
    let mut tokens: Vec<Option<Vec<u8>>> = vec![None; num_tokens];
    let mut rank_lines = vec![0usize; num_tokens];
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::with_capacity(num_tokens);
    for (line_no, bytes, rank) in entries {
        if rank >= num_tokens {
            return Err(line_error(
                line_no,
                format!("rank {rank} is outside 0..{num_tokens} (ranks must be 0..n-1)"),
            ));
        }
        if tokens[rank].is_some() {
            let first = rank_lines[rank];
            return Err(line_error(
                line_no,
                format!("rank {rank} already used on line {first}"),
            ));
        }
        if let Some(first) = seen.insert(bytes.clone(), line_no) {
            return Err(line_error(
                line_no,
                format!("token bytes repeat line {first}"),
            ));
        }
        rank_lines[rank] = line_no;
        tokens[rank] = Some(bytes);
    }
    // Every rank in 0..n was filled exactly once (n entries, n distinct ranks below n).
    let tokens: Vec<Vec<u8>> = tokens.into_iter().flatten().collect();
    if let Some(byte) = (0..=255u8).find(|&b| !seen.contains_key(&[b][..])) {
        return Err(TokenizerError::InvalidFile {
            path: path.to_path_buf(),
            reason: format!("byte 0x{byte:02x} has no token (a byte-level BPE needs all 256)"),
        });
    }
    Ok(tokens)
}

/// Names the special ids `n_base .. n_base + 258` from `added_tokens_decoder`, the rest
/// `<|reserved_token_{id}|>`, exactly as Kimi's tokenizer does.
fn special_tokens(
    n_base: u32,
    added_tokens: &BTreeMap<u32, String>,
    config_path: &Path,
) -> Result<HashMap<String, u32>, TokenizerError> {
    let mut specials = HashMap::with_capacity(NUM_SPECIAL_TOKENS as usize);
    for id in n_base..n_base + NUM_SPECIAL_TOKENS {
        let name = match added_tokens.get(&id) {
            Some(name) => name.clone(),
            None => format!("<|reserved_token_{id}|>"),
        };
        let invalid = |reason| TokenizerError::InvalidFile {
            path: config_path.to_path_buf(),
            reason,
        };
        if name.is_empty() {
            return Err(invalid(format!("special token {id} has empty content")));
        }
        if let Some(other) = specials.insert(name.clone(), id) {
            return Err(invalid(format!(
                "special tokens {other} and {id} are both {name:?}"
            )));
        }
    }
    Ok(specials)
}

/// Cuts `text` into pieces of at most `max_chars` chars (Python slices by code point).
fn char_chunks(text: &str, max_chars: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        let cut = rest
            .char_indices()
            .nth(max_chars)
            .map_or(rest.len(), |(i, _)| i);
        let (chunk, tail) = rest.split_at(cut);
        rest = tail;
        done = rest.is_empty();
        Some(chunk)
    })
}

/// Python's `str.isspace`: Unicode White_Space plus the separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Kimi's `_split_whitespaces_or_nonwhitespaces`: cut whenever a run of whitespace or of
/// non-whitespace grows past `max_run` chars. Always yields at least one (maybe empty) piece.
fn split_long_runs(text: &str, max_run: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut run_len = 0usize;
    let mut run_is_space = text.chars().next().is_some_and(is_python_space);
    let mut start = 0;
    for (index, c) in text.char_indices() {
        let is_space = is_python_space(c);
        if run_is_space != is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                pieces.push(&text[start..index]);
                start = index;
                run_len = 1;
            }
        }
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let regex = fancy_regex::Regex::new(KIMI_PATTERN).unwrap();
        regex
            .find_iter(text)
            .map(|m| m.unwrap().as_str().to_owned())
            .collect()
    }

    #[test]
    fn regex_splits_han_case_and_contractions() {
        assert_eq!(pieces("Hello世界abc"), ["Hello", "世界", "abc"]);
        assert_eq!(pieces("HelloWorld"), ["Hello", "World"]);
        assert_eq!(pieces("HTTPServer"), ["HTTPServer"]);
        assert_eq!(pieces("it's I'LL"), ["it's", " I'LL"]);
        assert_eq!(pieces("日本語のテキスト"), ["日本語", "のテキスト"]);
        assert_eq!(pieces("x 12345"), ["x", " ", "123", "45"]);
        assert_eq!(pieces("a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
        assert_eq!(pieces("f(x);\n"), ["f", "(x", ");\n"]);
        assert_eq!(pieces("end   "), ["end", "   "]);
    }

    #[test]
    fn long_runs_are_cut_like_python() {
        assert_eq!(split_long_runs("", 3), [""]);
        assert_eq!(split_long_runs("abcdefg", 3), ["abc", "def", "g"]);
        assert_eq!(split_long_runs("ab     cd", 3), ["ab   ", "  cd"]);
        // U+001F counts as space in Python but is not Unicode White_Space.
        assert_eq!(
            split_long_runs("a\u{1f}\u{1f}\u{1f}\u{1f}", 3),
            ["a\u{1f}\u{1f}\u{1f}", "\u{1f}"]
        );
        let chunks: Vec<&str> = char_chunks("ééééé", 2).collect();
        assert_eq!(chunks, ["éé", "éé", "é"]);
        assert_eq!(char_chunks("", 2).collect::<Vec<_>>(), [""]);
    }

    #[test]
    fn vocab_errors_name_file_and_line() {
        let path = Path::new("dir/tiktoken.model");
        let single_bytes: String = (0..=255u8)
            .map(|b| {
                format!(
                    "{} {b}\n",
                    base64::engine::general_purpose::STANDARD.encode([b])
                )
            })
            .collect();
        assert_eq!(parse_vocab(&single_bytes, path).unwrap().len(), 256);
        for (extra, needle) in [
            ("YWI= 257\n", "257:"),
            ("YWI= 3\n", "already used on line 4"),
            ("YQ== 256\n", "repeat line 98"),
            ("!!! 256\n", "bad base64"),
            ("YWI=\n", "expected"),
            ("YWI= x\n", "bad rank"),
        ] {
            let err = parse_vocab(&format!("{single_bytes}{extra}"), path).unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with("dir/tiktoken.model:257: "), "{text}");
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let err = parse_vocab("YQ== 0\n", path).unwrap_err().to_string();
        assert!(err.contains("byte 0x00 has no token"), "{err}");
    }
}
