//! The embedded demo tokenizer (assets/demo-tokenizer, made by scripts/make_demo_tokenizer.py).

use crate::common;

use kimi_tokenizer::{StreamDecoder, Tokenizer};
use serde_json::json;

fn demo() -> Tokenizer {
    Tokenizer::from_dir(&common::assets_dir()).unwrap()
}

fn n_base() -> u32 {
    let text = std::fs::read_to_string(common::assets_dir().join("tiktoken.model")).unwrap();
    text.lines().filter(|line| !line.is_empty()).count() as u32
}

#[test]
fn loads_with_kimi_layout() {
    let tok = demo();
    let n = n_base();
    assert_eq!(n, 956);
    assert_eq!(tok.num_base_tokens(), Some(n));
    assert_eq!(tok.vocab_size(), n as usize + 258);
    for (offset, name) in common::KIMI_SPECIALS {
        assert_eq!(tok.token_id(name), Some(n + offset), "{name}");
    }
    assert_eq!(tok.bos_id(), Some(n));
    assert_eq!(tok.eos_ids(), vec![n + 1, n + 2]);
    // Ranks 0..255 are the single bytes in byte order.
    for b in 0..=255u8 {
        assert_eq!(tok.token_bytes(u32::from(b)).unwrap(), [b]);
    }
}

#[test]
fn encode_decode_round_trips() {
    let tok = demo();
    for text in common::varied_texts() {
        let ids = tok.encode(&text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Common words from the training text are single tokens.
    let ids = tok.encode(" the assistant", false).unwrap();
    assert!(ids.len() <= 3, "{ids:?}");
}

#[test]
fn template_in_config_matches_jinja_file() {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::assets_dir().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["chat_template"].as_str().unwrap(),
        common::kimi_template()
    );
}

#[test]
fn chat_round_trip_and_stream() {
    let tok = demo();
    let messages = [
        json!({"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."}),
        json!({"role": "user", "content": "Is 123 a prime? 🤔"}),
    ];
    let prompt = tok
        .chat_template()
        .unwrap()
        .render(&messages, None, true)
        .unwrap();
    let ids = tok.encode(&prompt, true).unwrap();
    let n = n_base();
    assert_eq!(ids[0], n + 10);
    assert_eq!(*ids.last().unwrap(), n + 17);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
    let mut stream = StreamDecoder::new(&tok, true);
    let mut text: String = ids.iter().map(|&id| stream.push(id)).collect();
    text.push_str(&stream.finish());
    assert_eq!(text, tok.decode(&ids, true).unwrap());
    assert!(text.contains("Is 123 a prime? 🤔"));
}

#[test]
fn directory_is_small() {
    let total: u64 = std::fs::read_dir(common::assets_dir())
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum();
    assert!(total < 50 * 1024, "{total} bytes");
}

#[test]
fn encode_within_equals_encode_or_refuses_early() {
    let tok = demo();
    common::check_encode_within(&tok);
    let longest = tok.max_token_bytes().expect("Kimi's BPE bounds its tokens");
    assert!(longest >= "<|im_assistant|>".len());
    // 30 MB is refused from its length alone, before any BPE work.
    let huge = "hello world ".repeat(2_500_000);
    let start = std::time::Instant::now();
    let got = tok.encode_within(&huge, true, 32_768).unwrap();
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());
    let kimi_tokenizer::Bounded::TooLong { at_least } = got else {
        panic!("30 MB fits in 32768 ids?");
    };
    assert!(at_least > 32_768 && at_least >= huge.len() / longest);
    // Under the byte bound, the BPE stops soon after the limit.
    let text = "hello world ".repeat(longest * 200);
    let got = tok.encode_within(&text, true, 100).unwrap();
    assert!(matches!(got, kimi_tokenizer::Bounded::TooLong { at_least } if at_least > 100));
}
