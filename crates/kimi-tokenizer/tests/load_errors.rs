//! Loader errors name the file and the problem; odd inputs do not panic.

use crate::common;

use kimi_tokenizer::{Tokenizer, TokenizerError};

fn single_bytes() -> Vec<Vec<u8>> {
    (0..=255u8).map(|b| vec![b]).collect()
}

fn load(files: &[(&str, &str)]) -> Result<Tokenizer, TokenizerError> {
    let dir = common::write_dir(files);
    Tokenizer::from_dir(dir.path())
}

#[test]
fn missing_tokenizer() {
    let err = load(&[("tokenizer_config.json", "{}")]).unwrap_err();
    assert!(matches!(err, TokenizerError::NotFound { .. }), "{err}");
    let err = Tokenizer::from_dir(std::path::Path::new("/nonexistent/dir")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/dir"), "{err}");
}

#[test]
fn vocab_rank_gap_names_file_and_line() {
    let mut model = common::tiktoken_model(&single_bytes());
    model.push_str("YWI= 300\n");
    let err = load(&[("tiktoken.model", &model)]).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, TokenizerError::VocabLine { line: 257, .. }),
        "{text}"
    );
    assert!(
        text.contains("tiktoken.model:257:") && text.contains("rank 300"),
        "{text}"
    );
}

#[test]
fn bad_config_names_the_config() {
    let model = common::tiktoken_model(&single_bytes());
    let duplicate =
        r#"{"added_tokens_decoder": {"256": {"content": "[X]"}, "300": {"content": "[X]"}}}"#;
    let err = load(&[
        ("tiktoken.model", &model),
        ("tokenizer_config.json", duplicate),
    ])
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("tokenizer_config.json") && text.contains("[X]"),
        "{text}"
    );
    let empty = r#"{"added_tokens_decoder": {"257": {"content": ""}}}"#;
    let err = load(&[("tiktoken.model", &model), ("tokenizer_config.json", empty)]).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    let err = load(&[
        ("tiktoken.model", &model),
        ("tokenizer_config.json", "{oops"),
    ])
    .unwrap_err();
    assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
}

#[test]
fn template_syntax_error_names_the_file() {
    let model = common::tiktoken_model(&single_bytes());
    let err = load(&[
        ("tiktoken.model", &model),
        ("chat_template.jinja", "{% for %}"),
    ])
    .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, TokenizerError::TemplateSyntax { .. }),
        "{text}"
    );
    assert!(text.contains("chat_template.jinja"), "{text}");
}

#[test]
fn bad_tokenizer_json_names_the_file() {
    let err = load(&[("tokenizer.json", r#"{"model": {"type": "Nope"}}"#)]).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    let err = load(&[("tokenizer.json", "not json")]).unwrap_err();
    assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
}

/// The class intersection `[...&&[^\p{Han}]]` must work inside tiktoken-rs's own fancy-regex:
/// with a merge `a` + first byte of `世`, "a世" stays two pieces, while "aの" (Lo, not Han) is
/// one piece and merges.
#[test]
fn han_intersection_inside_the_bpe() {
    let mut tokens = single_bytes();
    tokens.push(vec![b'a', 0xe4]); // 256: "a" + first byte of 世 (E4 B8 96)
    tokens.push(vec![b'a', 0xe3]); // 257: "a" + first byte of の (E3 81 AE)
    let model = common::tiktoken_model(&tokens);
    let tok = load(&[
        ("tiktoken.model", &model),
        ("tokenizer_config.json", &common::kimi_config(258, None)),
    ])
    .unwrap();
    assert_eq!(tok.encode("a世", false).unwrap(), [97, 0xe4, 0xb8, 0x96]);
    assert_eq!(tok.encode("aの", false).unwrap(), [257, 0x81, 0xae]);
    assert_eq!(tok.vocab_size(), 258 + 258);
    assert_eq!(tok.token_id("[BOS]"), Some(258));
}

#[test]
fn odd_inputs_do_not_panic() {
    let model = common::tiktoken_model(&single_bytes());
    let tok = load(&[
        ("tiktoken.model", &model),
        ("tokenizer_config.json", &common::kimi_config(256, None)),
    ])
    .unwrap();
    for text in [
        "<|",
        "<|im_end",
        "[BOS][BOS]",
        "\u{10ffff}\u{feff}",
        "\r\r\n\n\r",
        "'s'S'LL",
    ] {
        for allow_special in [false, true] {
            let ids = tok.encode(text, allow_special).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
    }
    assert_eq!(tok.encode("[BOS][BOS]", true).unwrap(), [256, 256]);
    assert_eq!(tok.decode(&[], true).unwrap(), "");
    assert!(tok.decode(&[u32::MAX], false).is_err());
    assert_eq!(tok.token_bytes(u32::MAX), None);
    assert!(!tok.is_special(u32::MAX));
}
