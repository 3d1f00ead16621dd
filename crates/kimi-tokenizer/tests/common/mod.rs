//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use base64::Engine as _;

/// Kimi's named special tokens as offsets from n_base (spec §9.3).
pub const KIMI_SPECIALS: [(u32, &str); 17] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|im_end|>"),
    (3, "<|im_user|>"),
    (4, "<|im_assistant|>"),
    (6, "<|start_header_id|>"),
    (7, "<|end_header_id|>"),
    (9, "[EOT]"),
    (10, "<|im_system|>"),
    (11, "<|tool_calls_section_begin|>"),
    (12, "<|tool_calls_section_end|>"),
    (13, "<|tool_call_begin|>"),
    (14, "<|tool_call_argument_begin|>"),
    (15, "<|tool_call_end|>"),
    (17, "<|im_middle|>"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

pub fn assets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/demo-tokenizer")
}

pub fn kimi_template() -> String {
    std::fs::read_to_string(assets_dir().join("chat_template.jinja")).unwrap()
}

/// A Kimi-style tokenizer_config.json for a vocabulary of `n_base` BPE tokens.
pub fn kimi_config(n_base: u32, chat_template: Option<&str>) -> String {
    let added: serde_json::Map<String, serde_json::Value> = KIMI_SPECIALS
        .iter()
        .map(|&(offset, name)| {
            let entry = serde_json::json!({
                "content": name, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": true
            });
            ((n_base + offset).to_string(), entry)
        })
        .collect();
    let mut config = serde_json::json!({
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
    });
    if let Some(template) = chat_template {
        config["chat_template"] = template.into();
    }
    config.to_string()
}

/// `tiktoken.model` text for rank-ordered tokens.
pub fn tiktoken_model(tokens: &[Vec<u8>]) -> String {
    tokens
        .iter()
        .enumerate()
        .map(|(rank, bytes)| {
            format!(
                "{} {rank}\n",
                base64::engine::general_purpose::STANDARD.encode(bytes)
            )
        })
        .collect()
}

/// Writes `files` into a fresh temporary directory.
pub fn write_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, content) in files {
        std::fs::write(dir.path().join(name), content).unwrap();
    }
    dir
}

/// Texts that exercise ASCII, CJK, emoji, code, whitespace runs, combining marks and controls.
pub fn varied_texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog. It's 12:45 and I'LL BE BACK.",
        "你好，世界！这是一个测试。Kimi 是月之暗面开发的模型。",
        "日本語のテキストとカタカナ、한국어 텍스트",
        "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ✓ ✗ ★",
        "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n\tprintln!(\"{x:?}\");\n}\n",
        "def f(a, b):\r\n    return a ** b  # comment\r\n\r\n",
        "  leading and trailing spaces   ",
        "\n\n\n\t\t  \u{a0}\u{3000}mixed whitespace\u{2028}\u{85}\u{1f}",
        "café naïve e\u{301} Ω≈ç√∫ ﬁ ÅÄÖ",
        "numbers 1234567890 3.14159 -42 1e-10 ٣٤٥ ⅓",
        "control \u{0}\u{1}\u{7f} chars",
        "<|im_end|> looks special [BOS] too",
        "HTTPServer camelCaseWord XMLHttpRequest iPhone",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    texts.push(" ".repeat(30_000) + "x");
    texts.push("a".repeat(50_001));
    texts.push("ab\n".repeat(10_000));
    texts.push("长".repeat(26_000));
    texts
}

/// Checks `encode_within` against `encode` on every varied text (with special tokens
/// allowed and not) at limits below, at and above each text's id count: the same ids when
/// they fit, else a lower bound past the limit that the real count meets.
pub fn check_encode_within(tok: &kimi_tokenizer::Tokenizer) {
    use kimi_tokenizer::Bounded;
    let mut texts = varied_texts();
    texts.push("<|im_end|>".repeat(50) + &"word ".repeat(400));
    for text in &texts {
        for special in [true, false] {
            let ids = tok.encode(text, special).unwrap();
            let n = ids.len();
            for limit in [0, 1, n / 2, n.saturating_sub(1), n, n + 1, 10 * n + 10] {
                match tok.encode_within(text, special, limit).unwrap() {
                    Bounded::Fits(got) => {
                        assert!(n <= limit, "{n} ids fit in {limit}?");
                        assert_eq!(got, ids, "limit {limit}");
                    }
                    Bounded::TooLong { at_least } => {
                        assert!(n > limit, "{n} ids refused at {limit}");
                        assert!(at_least > limit && at_least <= n, "{at_least} vs {n}");
                    }
                }
            }
        }
    }
}
