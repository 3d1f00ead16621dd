//! Tokenizers stored in GGUF metadata (`tokenizer.ggml.*`), built as `tokenizers` models.
//!
//! Only `tokenizer.ggml.model = gpt2` (byte-level BPE) is supported, with the
//! pre-tokenizers llama.cpp (`src/llama-vocab.cpp`) maps to the GPT-2 regex:
//!
//! ```text
//! pre = smollm | starcoder | refact | …   split every digit (\p{N}) into its own piece, then
//!                                         the GPT-2 regex, byte-level
//! pre = gpt-2 | mpt | olmo | … (or none)  the GPT-2 regex, byte-level
//! ```
//! Tokens of type 3 (control) become special tokens, type 4 (user-defined) plain added tokens.
//!
//! `pre = kimi-k2` (Kimi's `tiktoken.model` as llama.cpp's converter writes it) is built as
//! the tiktoken backend instead: ranks are the ids of the normal tokens, specials follow.

use std::collections::HashMap;

use kimi_gguf::{Array, GgufFile};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

use crate::hf::{HfTokenizer, PieceScheme};
use crate::tiktoken::TiktokenBpe;
use crate::TokenizerError;

/// Pre-tokenizers that split digits one by one before the GPT-2 regex (llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_STARCODER` group).
const DIGIT_SPLIT_PRE: [&str; 7] = [
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
];

/// Pre-tokenizers that are the GPT-2 regex alone (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GPT2`
/// group).
const GPT2_PRE: [&str; 5] = ["gpt-2", "phi-2", "jina-es", "jina-de", "mpt"];

/// ggml token types (`enum llama_token_type`).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_UNUSED: i32 = 5;

/// A GGUF file's tokenizer and the metadata around it.
pub(crate) struct GgufTokenizer {
    pub hf: HfTokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub chat_template: Option<String>,
}

pub(crate) fn load(file: &GgufFile) -> Result<GgufTokenizer, TokenizerError> {
    let invalid = |reason: String| TokenizerError::InvalidFile {
        path: file.path().to_path_buf(),
        reason,
    };
    let model = file.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(invalid(format!(
            "tokenizer.ggml.model `{model}` is not supported (only gpt2 byte-level BPE)"
        )));
    }
    let pre = match file.get("tokenizer.ggml.pre") {
        Some(_) => file.get_str("tokenizer.ggml.pre")?,
        None => "gpt-2",
    };
    let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
        invalid(format!(
            "tokenizer.ggml.pre `{pre}` is not supported (supported: {}, {})",
            DIGIT_SPLIT_PRE.join(", "),
            GPT2_PRE.join(", ")
        ))
    })?;
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types = token_types(file, tokens.len())?;

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(invalid("tokenizer.ggml.tokens has duplicate tokens".into()));
    }
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| invalid(format!("merge `{m}` is not two tokens")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|source| TokenizerError::HfLoad {
            path: file.path().to_path_buf(),
            source,
        })?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::default()));
    let added = |kind: i32, special: bool| {
        tokens
            .iter()
            .zip(&types)
            .filter(move |(_, &t)| t == kind)
            .map(move |(token, _)| AddedToken::from(token.clone(), special))
            .collect::<Vec<_>>()
    };
    inner
        .add_special_tokens(added(TOKEN_TYPE_CONTROL, true))
        .and_then(|_| inner.add_tokens(added(TOKEN_TYPE_USER_DEFINED, false)))
        .map_err(|err| invalid(format!("added tokens: {err}")))?;

    let optional_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
        match file.get(key) {
            Some(_) => Ok(Some(file.get_u32(key)?)),
            None => Ok(None),
        }
    };
    let chat_template = match file.get("tokenizer.chat_template") {
        Some(_) => Some(file.get_str("tokenizer.chat_template")?.to_string()),
        None => None,
    };
    Ok(GgufTokenizer {
        // ByteLevel pre-tokenizer, no normalizer, added tokens that strip nothing.
        hf: HfTokenizer::new(inner, PieceScheme::ByteLevel, true),
        bos_id: optional_id("tokenizer.ggml.bos_token_id")?,
        eos_id: optional_id("tokenizer.ggml.eos_token_id")?,
        chat_template,
    })
}

/// `tokenizer.ggml.pre` of Kimi's tiktoken vocabulary in llama.cpp's converter.
pub(crate) const KIMI_PRE: &str = "kimi-k2";

/// Whether the file holds Kimi's vocabulary (gpt2 model, `kimi-k2` pre-tokenizer).
pub(crate) fn is_kimi(file: &GgufFile) -> bool {
    file.get_str("tokenizer.ggml.model").ok() == Some("gpt2")
        && file.get_str("tokenizer.ggml.pre").ok() == Some(KIMI_PRE)
}

/// Kimi's tiktoken BPE from the token list llama.cpp's converter writes: normal tokens are
/// the byte-level-encoded tiktoken ranks (id = rank), the control (or unused) tokens after
/// them the special tokens. The merges are not needed: tiktoken merges by rank.
pub(crate) fn kimi_bpe(file: &GgufFile) -> Result<TiktokenBpe, TokenizerError> {
    let invalid = |reason: String| TokenizerError::InvalidFile {
        path: file.path().to_path_buf(),
        reason,
    };
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types = token_types(file, tokens.len())?;
    let n_base = types
        .iter()
        .position(|&t| t != TOKEN_TYPE_NORMAL)
        .unwrap_or(types.len());
    if let Some(i) = types[n_base..].iter().position(|&t| t == TOKEN_TYPE_NORMAL) {
        return Err(invalid(format!(
            "{KIMI_PRE} vocabulary: normal token {} follows the special tokens from {n_base}",
            n_base + i
        )));
    }
    let decode = byte_decoder();
    let base = tokens[..n_base]
        .iter()
        .enumerate()
        .map(|(id, t)| {
            t.chars()
                .map(|c| decode.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .ok_or_else(|| invalid(format!("token {id} {t:?} is not byte-level text")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let specials = tokens[n_base..]
        .iter()
        .zip(n_base as u32..)
        .map(|(name, id)| (name.clone(), id))
        .collect();
    TiktokenBpe::build(base, specials, file.path())
}

/// The `tokenizer.ggml.*` entries llama.cpp's converter writes for Kimi's tiktoken
/// vocabulary (`KimiLinearModel.set_vocab`): `vocab_size` byte-level tokens (`[PAD{i}]`
/// unused where an id has no token), control specials, and the merges recovered from the
/// ranks (each token's last merge under tiktoken's rank order).
pub(crate) fn kimi_metadata(
    bpe: &TiktokenBpe,
    vocab_size: usize,
) -> Vec<(String, kimi_gguf::Value)> {
    use kimi_gguf::Value;
    let n_base = bpe.n_base();
    let ranks: HashMap<&[u8], u32> = (0..n_base)
        .filter_map(|id| bpe.token_bytes(id).map(|b| (b, id)))
        .collect();
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    let mut merges = Vec::new();
    for id in 0..vocab_size as u32 {
        match bpe.token_bytes(id) {
            Some(bytes) if id < n_base => {
                tokens.push(byte_level_text(bytes));
                types.push(TOKEN_TYPE_NORMAL);
                if let Some((a, b)) = last_merge(bytes, id, &ranks) {
                    merges.push(format!("{} {}", byte_level_text(a), byte_level_text(b)));
                }
            }
            Some(name) => {
                tokens.push(String::from_utf8_lossy(name).into_owned());
                types.push(TOKEN_TYPE_CONTROL);
            }
            None => {
                tokens.push(format!("[PAD{id}]"));
                types.push(TOKEN_TYPE_UNUSED);
            }
        }
    }
    let mut meta = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(KIMI_PRE.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
    ];
    // gguf-py cannot write an empty array (nor read back its element type); llama.cpp needs
    // no merges for `pre = kimi-k2`. Only a vocabulary of single bytes has none.
    if !merges.is_empty() {
        meta.push((
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(merges)),
        ));
    }
    meta
}

/// The two parts BPE joins last to form `token` (rank `rank`): merge adjacent parts by
/// lowest rank below `rank` until none is left (llama.cpp's `QwenModel.bpe(max_rank=rank)`).
fn last_merge<'t>(
    token: &'t [u8],
    rank: u32,
    ranks: &HashMap<&[u8], u32>,
) -> Option<(&'t [u8], &'t [u8])> {
    if token.len() < 2 {
        return None;
    }
    let mut cuts: Vec<usize> = (0..=token.len()).collect();
    loop {
        let best = (0..cuts.len() - 2)
            .filter_map(|i| {
                let r = *ranks.get(&token[cuts[i]..cuts[i + 2]])?;
                (r < rank).then_some((r, i))
            })
            .min();
        match best {
            Some((_, i)) => {
                cuts.remove(i + 1);
            }
            None => break,
        }
    }
    (cuts.len() == 3).then(|| (&token[..cuts[1]], &token[cuts[1]..]))
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the others for
/// `U+0100 + n` in byte order.
fn byte_encoder() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap_or('\u{FFFD}')
            }
        })
        .collect()
}

fn byte_decoder() -> HashMap<char, u8> {
    byte_encoder().into_iter().zip(0..=255u8).collect()
}

/// Byte-level text of `bytes` (the form `tokenizer.ggml.tokens` stores).
pub(crate) fn byte_level_text(bytes: &[u8]) -> String {
    let enc = byte_encoder();
    bytes.iter().map(|&b| enc[b as usize]).collect()
}

fn pre_tokenizer(pre: &str) -> Option<PreTokenizerWrapper> {
    // `tokenizers`' ByteLevel regex is GPT-2's; `add_prefix_space` is off in GGUF gpt2 vocabs.
    let byte_level = ByteLevel::new(false, true, true);
    if DIGIT_SPLIT_PRE.contains(&pre) {
        Some(
            Sequence::new(vec![
                Digits::new(true).into(),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])
            .into(),
        )
    } else if GPT2_PRE.contains(&pre) {
        Some(byte_level.into())
    } else {
        None
    }
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<&'a [String], TokenizerError> {
    match file.get_array(key)? {
        Array::String(v) => Ok(v),
        other => Err(TokenizerError::InvalidFile {
            path: file.path().to_path_buf(),
            reason: format!(
                "{key} is an array of {}, not of strings",
                other.element_type()
            ),
        }),
    }
}

/// `tokenizer.ggml.token_type`, one per token; all normal (1) when absent.
fn token_types(file: &GgufFile, num_tokens: usize) -> Result<Vec<i32>, TokenizerError> {
    let key = "tokenizer.ggml.token_type";
    if file.get(key).is_none() {
        return Ok(vec![1; num_tokens]);
    }
    let types: Vec<i32> = match file.get_array(key)? {
        Array::I32(v) => v.clone(),
        Array::U32(v) => v.iter().map(|&t| t as i32).collect(),
        other => {
            return Err(TokenizerError::InvalidFile {
                path: file.path().to_path_buf(),
                reason: format!("{key} is an array of {}", other.element_type()),
            })
        }
    };
    if types.len() != num_tokens {
        return Err(TokenizerError::InvalidFile {
            path: file.path().to_path_buf(),
            reason: format!("{key} has {} entries for {num_tokens} tokens", types.len()),
        });
    }
    Ok(types)
}

#[cfg(test)]
mod tests {
    use kimi_gguf::{Array, GgufFile, GgufWriter, Value};

    use crate::Tokenizer;

    /// A byte-level vocabulary where "12" and " 12" are tokens, so the pre-tokenizer
    /// decides whether they are used.
    fn tiny(pre: &str) -> Result<Tokenizer, crate::TokenizerError> {
        let tokens = [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<extra>",
            "a",
            "b",
            "ab",
            "Ġ",
            "1",
            "2",
            "Ġ1",
            "12",
            "Ġ12",
        ];
        let merges = ["a b", "Ġ 1", "Ġ1 2", "1 2"];
        let strings =
            |v: &[&str]| Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()));
        let mut w = GgufWriter::new();
        let mut types = vec![1i32; tokens.len()];
        types[..3].fill(3);
        types[3] = 4;
        let meta = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String(pre.into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            ("tokenizer.ggml.merges", strings(&merges)),
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            (
                "tokenizer.chat_template",
                Value::String("{% for m in messages %}{{ bos_token }}{{ m.content }}{{ eos_token }}{% endfor %}".into()),
            ),
        ];
        for (key, value) in meta {
            w.add_metadata(key, value).expect("metadata");
        }
        Tokenizer::from_gguf(&GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parses"))
    }

    #[test]
    fn digits_split_only_with_the_smollm_pre_tokenizer() {
        let smollm = tiny("smollm").unwrap();
        assert_eq!(smollm.encode("ab 12", false).unwrap(), [6, 7, 8, 9]);
        let gpt2 = tiny("gpt-2").unwrap();
        assert_eq!(gpt2.encode("ab 12", false).unwrap(), [6, 12]);
        assert_eq!(gpt2.decode(&[6, 12], false).unwrap(), "ab 12");
    }

    #[test]
    fn control_tokens_are_special_and_ids_come_from_metadata() {
        let tok = tiny("smollm").unwrap();
        assert_eq!(tok.vocab_size(), 13);
        assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(3));
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_ids(), [2, 0]);
        assert_eq!(
            tok.encode("<|im_start|>ab<extra>", true).unwrap(),
            [1, 6, 3]
        );
        assert_eq!(tok.decode(&[1, 6, 2], true).unwrap(), "ab");
        let messages = [serde_json::json!({"role": "user", "content": "ab"})];
        let template = tok.chat_template().expect("a template");
        assert_eq!(
            template.render(&messages, None, true).unwrap(),
            "<|im_start|>ab<|im_end|>"
        );
    }

    #[test]
    fn other_tokenizers_are_rejected_by_name() {
        let err = tiny("qwen2").unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.pre `qwen2`"), "{err}");
        let mut w = GgufWriter::new();
        w.add_metadata("tokenizer.ggml.model", Value::String("llama".into()))
            .expect("metadata");
        let file = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("parses");
        let err = Tokenizer::from_gguf(&file).unwrap_err().to_string();
        assert!(err.contains("`llama` is not supported"), "{err}");
    }
}

#[cfg(test)]
mod kimi_tests {
    use std::path::Path;

    use kimi_gguf::{Array, GgufFile, GgufWriter, Value};

    use crate::Tokenizer;

    /// The demo tiktoken vocabulary written as llama.cpp's converter writes Kimi's
    /// (byte-level tokens, control tokens after the base ones, `pre = kimi-k2`) encodes and
    /// decodes exactly as the directory it came from.
    #[test]
    fn kimi_k2_vocabulary_matches_the_tiktoken_directory() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer");
        let want = Tokenizer::from_dir(&dir).expect("demo tokenizer");
        let n = want.vocab_size() as u32;
        let n_base = want.num_base_tokens().expect("tiktoken");
        let tokens: Vec<String> = (0..n)
            .map(|id| {
                let bytes = want.token_bytes(id).expect("token");
                if id < n_base {
                    super::byte_level_text(&bytes)
                } else {
                    String::from_utf8(bytes).expect("special names are text")
                }
            })
            .collect();
        let types: Vec<i32> = (0..n).map(|id| if id < n_base { 1 } else { 3 }).collect();
        let mut w = GgufWriter::new();
        let meta = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String(super::KIMI_PRE.into())),
            ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
            ("tokenizer.ggml.eos_token_id", Value::U32(want.eos_ids()[0])),
        ];
        for (k, v) in meta {
            w.add_metadata(k, v).expect("metadata");
        }
        let file = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("gguf");
        let got = Tokenizer::from_gguf(&file).expect("kimi-k2 tokenizer");
        for text in [
            "Hello, world! 123 4567",
            "  tabs\tand\nnew lines\n\n",
            "中文 mixed Ünïcödé's",
        ] {
            let ids = want.encode(text, false).expect("encode");
            assert_eq!(got.encode(text, false).expect("encode"), ids, "{text:?}");
            assert_eq!(got.decode(&ids, false).expect("decode"), text);
        }
        assert_eq!(got.eos_ids()[0], want.eos_ids()[0]);

        // The metadata written for a converted model loads back to the same tokenizer.
        let mut w = GgufWriter::new();
        for (k, v) in want.gguf_metadata(n as usize).expect("tiktoken vocabulary") {
            w.add_metadata(k, v).expect("metadata");
        }
        let file = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("gguf");
        let back = Tokenizer::from_gguf(&file).expect("written tokenizer");
        let text = "Hello, world! 中文 and   spaces";
        assert_eq!(back.encode(text, false).ok(), want.encode(text, false).ok());
        assert!(file
            .get_array("tokenizer.ggml.merges")
            .is_ok_and(|m| !m.is_empty()));
    }

    /// The byte-level stand-in vocabulary of random-weight conversions loads back from its
    /// GGUF metadata: bytes are ids 0–255, the rest are special tokens, bos/eos kept.
    #[test]
    fn byte_level_placeholder_round_trips_through_gguf() {
        assert!(Tokenizer::byte_level_placeholder(255, None, None, None).is_none());
        let tok = Tokenizer::byte_level_placeholder(1000, Some(744), Some(746), Some(999))
            .expect("placeholder");
        let meta = tok.gguf_metadata(1000).expect("tiktoken backend");
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.add_metadata(k, v).expect("metadata");
        }
        let file = GgufFile::from_vec(w.to_bytes().expect("bytes")).expect("gguf");
        assert_eq!(
            file.get_array("tokenizer.ggml.tokens")
                .map(|t| t.len())
                .ok(),
            Some(1000)
        );
        let back = Tokenizer::from_gguf(&file).expect("placeholder tokenizer");
        assert_eq!(back.vocab_size(), 1000);
        let text = "Hi, wörld\n";
        let ids = back.encode(text, false).expect("encode");
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(back.decode(&ids, false).expect("decode"), text);
        assert_eq!(back.bos_id(), Some(744));
        assert_eq!(back.eos_ids(), vec![746]);
        assert_eq!(back.token_id("[PAD]"), Some(999));
        assert_eq!(back.token_id("<|reserved_token_300|>"), Some(300));
        assert!(file.get("tokenizer.ggml.merges").is_none());
    }
}
