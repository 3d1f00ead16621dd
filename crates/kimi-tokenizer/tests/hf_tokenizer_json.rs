//! The tokenizer.json path on a real-format byte-level BPE trained and saved by `tokenizers`.

use crate::common;

use kimi_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use serde_json::json;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Trains a small byte-level BPE and writes `tokenizer.json` (+ optional extra files).
fn trained_dir(extra: &[(&str, &str)]) -> tempfile::TempDir {
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .unwrap();
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(400)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .build();
    let corpus: Vec<String> = common::varied_texts().into_iter().take(15).collect();
    tokenizer.train(&mut trainer, corpus.iter()).unwrap();
    tokenizer
        .add_tokens([AddedToken::from("<custom>", false)])
        .unwrap();
    let dir = common::write_dir(extra);
    tokenizer
        .save(dir.path().join("tokenizer.json"), true)
        .unwrap();
    dir
}

fn config() -> String {
    json!({
        "eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"},
        "bos_token": null,
        "chat_template": [{"name": "tool_use", "template": "tools!"}, {"name": "default", "template": CHATML}],
    })
    .to_string()
}

#[test]
fn loads_and_round_trips() {
    let dir = trained_dir(&[("tokenizer_config.json", &config())]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.num_base_tokens(), None);
    let endoftext = tok.token_id("<|endoftext|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let custom = tok.token_id("<custom>").unwrap();
    assert!(tok.is_special(endoftext) && tok.is_special(im_end) && !tok.is_special(custom));
    assert_eq!(tok.eos_ids(), vec![endoftext, im_end]);
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.vocab_size(), custom as usize + 1);
    assert_eq!(tok.token_bytes(im_end).unwrap(), b"<|im_end|>");
    assert_eq!(tok.token_bytes(tok.vocab_size() as u32), None);

    for text in common::varied_texts() {
        let ids = tok.encode(&text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        // Byte-level: the tokens' raw bytes are the text's bytes.
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tok.token_bytes(id).unwrap())
            .collect();
        assert_eq!(bytes, text.as_bytes());
        let mut stream = StreamDecoder::new(&tok, false);
        let mut out: String = ids.iter().map(|&id| stream.push(id)).collect();
        out.push_str(&stream.finish());
        assert_eq!(out, text);
    }
}

#[test]
fn special_tokens_only_when_allowed() {
    let dir = trained_dir(&[("tokenizer_config.json", &config())]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let text = "<|im_start|>user\nhi<|im_end|>";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids.first(), Some(&im_start));
    assert_eq!(ids.last(), Some(&im_end));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    let plain = tok.encode(text, false).unwrap();
    assert!(plain.iter().all(|&id| !tok.is_special(id)), "{plain:?}");
    assert_eq!(tok.decode(&plain, false).unwrap(), text);
    // Non-special added tokens are still matched as tokens.
    assert_eq!(
        tok.encode("<custom>", false).unwrap(),
        [tok.token_id("<custom>").unwrap()]
    );
    let err = tok.decode(&[tok.vocab_size() as u32], false).unwrap_err();
    assert!(matches!(err, TokenizerError::UnknownId { .. }));
}

#[test]
fn chat_template_from_config_list_and_jinja_override() {
    let dir = trained_dir(&[("tokenizer_config.json", &config())]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let messages = [json!({"role": "user", "content": "hi"})];
    let prompt = tok
        .chat_template()
        .unwrap()
        .render(&messages, None, true)
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&prompt, true).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);

    let dir = trained_dir(&[
        ("tokenizer_config.json", &config()),
        ("chat_template.jinja", "jinja wins"),
    ]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render(&messages, None, true)
            .unwrap(),
        "jinja wins"
    );

    let dir = trained_dir(&[]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(tok.chat_template().is_none());
    assert!(tok.eos_ids().contains(&tok.token_id("<|im_end|>").unwrap()));
}

#[test]
fn encode_within_equals_encode_or_refuses_early() {
    let dir = trained_dir(&[("tokenizer_config.json", &config())]);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(
        tok.max_token_bytes().is_some(),
        "a byte-level BPE bounds its tokens"
    );
    common::check_encode_within(&tok);
}

#[test]
fn a_normalizing_tokenizer_has_no_byte_bound() {
    // Lowercasing (like any normalizer) may change the text's length, so its tokens' bytes
    // say nothing sure about how much text they stand for.
    let dir = trained_dir(&[("tokenizer_config.json", &config())]);
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["normalizer"] = json!({"type": "Lowercase"});
    std::fs::write(&path, json.to_string()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.max_token_bytes(), None);
    // Without the bound, encode_within still gives encode's ids or refuses past the limit.
    common::check_encode_within(&tok);
}
