//! The Kimi tiktoken loader on OpenAI's real cl100k_base vocabulary (shipped inside
//! tiktoken-rs), written out as a Kimi-style `tiktoken.model` + `tokenizer_config.json`.

use crate::common;

use std::sync::OnceLock;

use kimi_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use tiktoken_rs::CoreBPE;

const CL100K_N_BASE: u32 = 100_256;

fn cl100k() -> &'static CoreBPE {
    tiktoken_rs::cl100k_base_singleton()
}

/// cl100k's BPE tokens in rank order, read back through tiktoken-rs's public API (the
/// `.tiktoken` text is `include_str!`'d privately, so this is the CARGO_HOME-independent way).
fn cl100k_tokens() -> &'static Vec<Vec<u8>> {
    static TOKENS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    TOKENS.get_or_init(|| {
        let tokens: Vec<Vec<u8>> = (0..CL100K_N_BASE)
            .map(|rank| cl100k().decode_bytes(&[rank]).unwrap())
            .collect();
        // Rank 100256 is unassigned in cl100k (its specials start at 100257).
        assert!(cl100k().decode_bytes(&[CL100K_N_BASE]).is_err());
        tokens
    })
}

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let model = common::tiktoken_model(cl100k_tokens());
        let config = common::kimi_config(CL100K_N_BASE, None);
        let template = common::kimi_template();
        let dir = common::write_dir(&[
            ("tiktoken.model", &model),
            ("tokenizer_config.json", &config),
            ("chat_template.jinja", &template),
        ]);
        Tokenizer::from_dir(dir.path()).unwrap()
    })
}

#[test]
fn specials_follow_kimi_layout() {
    let tok = tokenizer();
    let n = CL100K_N_BASE;
    assert_eq!(tok.num_base_tokens(), Some(n));
    assert_eq!(tok.vocab_size(), (n + 258) as usize);
    for (offset, name) in common::KIMI_SPECIALS {
        assert_eq!(tok.token_id(name), Some(n + offset), "{name}");
        assert!(tok.is_special(n + offset));
        assert_eq!(tok.token_bytes(n + offset).unwrap(), name.as_bytes());
    }
    // Unnamed special ids are `<|reserved_token_{id}|>` with the absolute id.
    assert_eq!(tok.token_id("<|reserved_token_100261|>"), Some(n + 5));
    assert_eq!(tok.token_id("<|reserved_token_100513|>"), Some(n + 257));
    assert_eq!(tok.token_id("<|reserved_token_100514|>"), None);
    assert!(!tok.is_special(n - 1));
    assert!(!tok.is_special(n + 258));
    assert_eq!(tok.bos_id(), Some(n));
    assert_eq!(tok.eos_ids(), vec![n + 1, n + 2]);
    // Base tokens are found by their bytes.
    assert_eq!(
        tok.token_id("hello"),
        cl100k().encode_ordinary("hello").first().copied()
    );
    assert_eq!(tok.token_bytes(n + 258), None);
}

#[test]
fn varied_text_round_trips() {
    let tok = tokenizer();
    for text in common::varied_texts() {
        for allow_special in [false, true] {
            let ids = tok.encode(&text, allow_special).unwrap();
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                text,
                "{:?}",
                &text[..text.len().min(60)]
            );
        }
    }
    let ids = tok.encode("", true).unwrap();
    assert!(ids.is_empty());
}

#[test]
fn plain_text_agrees_with_cl100k_where_the_regexes_split_alike() {
    // Lower-case words, numbers, punctuation, single newlines: both regexes cut these the same.
    let tok = tokenizer();
    for text in [
        "the quick brown fox jumps over the lazy dog.",
        "The year 2024 had 366 days; 1234567 is a number.",
        "print(add(1, 2))\nreturn x + y\n",
        "hello, world! how are you? (fine) [ok] {yes}",
        "déjà vu, naïve café",
        "你好世界",
    ] {
        assert_eq!(
            tok.encode(text, false).unwrap(),
            cl100k().encode_ordinary(text),
            "{text:?}"
        );
    }
}

#[test]
fn kimi_splits_differ_from_cl100k_as_the_regex_says() {
    let tok = tokenizer();
    let cl = |s: &str| cl100k().encode_ordinary(s);
    let ranks = cl100k_tokens()
        .iter()
        .zip(0u32..)
        .map(|(bytes, rank)| (bytes.clone(), rank))
        .collect();
    // (This call also fixes the map's hasher type to the one tiktoken-rs wants.)
    assert_eq!(tiktoken_rs::byte_pair_split(b"ab", &ranks), [&b"ab"[..]]);
    // Reference: the hand-split pieces of Kimi's regex, each BPE-merged with cl100k's ranks.
    let reference = |pieces: &[&str]| -> Vec<u32> {
        pieces
            .iter()
            .flat_map(|piece| match ranks.get(piece.as_bytes()) {
                Some(&rank) => vec![rank],
                None => tiktoken_rs::byte_pair_split(piece.as_bytes(), &ranks)
                    .into_iter()
                    .map(|part| ranks[part])
                    .collect::<Vec<u32>>(),
            })
            .collect()
    };
    // Case change splits a word; Han is split from other letters; contractions stay attached.
    for (word, parts) in [
        ("getValue", ["get", "Value"]),
        ("JavaScript", ["Java", "Script"]),
    ] {
        let kimi = tok.encode(word, false).unwrap();
        assert_eq!(kimi, [cl(parts[0]), cl(parts[1])].concat());
        assert_ne!(kimi, cl(word), "cl100k keeps {word:?} whole");
    }
    assert_eq!(
        tok.encode("Hello世界abc", false).unwrap(),
        reference(&["Hello", "世界", "abc"])
    );
    assert_eq!(tok.encode("it's", false).unwrap(), reference(&["it's"]));
    assert_eq!(
        tok.encode("We're here, I'LL go", false).unwrap(),
        reference(&["We're", " here", ",", " I'LL", " go"])
    );
    assert_eq!(
        tok.encode("x  \n\n  y", false).unwrap(),
        reference(&["x", "  \n\n", " ", " y"])
    );
}

#[test]
fn special_tokens_only_when_allowed() {
    let tok = tokenizer();
    let n = CL100K_N_BASE;
    let text = "<|im_user|>user<|im_middle|>hi<|im_end|>";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids[0], n + 3);
    assert_eq!(ids[ids.len() - 1], n + 2);
    assert_eq!(ids.iter().filter(|&&id| id >= n).count(), 3);
    assert_eq!(tok.decode(&ids, true).unwrap(), "userhi");

    let plain = tok.encode(text, false).unwrap();
    assert!(plain.iter().all(|&id| id < n));
    assert_eq!(tok.decode(&plain, false).unwrap(), text);
    // Reserved names are special too.
    assert_eq!(
        tok.encode("<|reserved_token_100300|>", true).unwrap(),
        [100_300]
    );
}

#[test]
fn long_inputs_are_cut_like_kimi() {
    let tok = tokenizer();
    // A 25,001-char non-space run is encoded as 25,000 + 1 chars.
    let run = "ab".repeat(12_500) + "c";
    let expected = [
        tok.encode(&run[..25_000], false).unwrap(),
        tok.encode(&run[25_000..], false).unwrap(),
    ]
    .concat();
    assert_eq!(tok.encode(&run, false).unwrap(), expected);
    // Over 400,000 chars the text is encoded in 400,000-char chunks.
    let words = "lorem ipsum dolor ".repeat(25_000);
    let (head, tail) = words.split_at(400_000);
    let expected = [
        tok.encode(head, false).unwrap(),
        tok.encode(tail, false).unwrap(),
    ]
    .concat();
    let ids = tok.encode(&words, false).unwrap();
    assert_eq!(ids, expected);
    assert_eq!(tok.decode(&ids, false).unwrap(), words);
}

#[test]
fn decode_handles_partial_utf8_and_unknown_ids() {
    let tok = tokenizer();
    let lone = (0..CL100K_N_BASE)
        .find(|&id| tok.token_bytes(id).unwrap() == [0xe4])
        .unwrap();
    assert_eq!(tok.token_bytes(lone).unwrap(), [0xe4]);
    assert_eq!(tok.decode(&[lone], false).unwrap(), "\u{fffd}");
    let good = tok.encode("ok", false).unwrap();
    assert_eq!(
        tok.decode(&[good.clone(), vec![lone], good].concat(), false)
            .unwrap(),
        "ok\u{fffd}ok"
    );
    let err = tok.decode(&[1, CL100K_N_BASE + 258], false).unwrap_err();
    assert!(matches!(
        err,
        TokenizerError::UnknownId {
            id: 100_514,
            vocab_size: 100_514
        }
    ));
}

#[test]
fn stream_decoder_matches_decode() {
    let tok = tokenizer();
    for text in common::varied_texts().iter().take(15) {
        let ids = tok.encode(text, true).unwrap();
        for skip_special in [false, true] {
            let mut stream = StreamDecoder::new(tok, skip_special);
            let mut out = String::new();
            for &id in &ids {
                let piece = stream.push(id);
                out.push_str(&piece);
            }
            out.push_str(&stream.finish());
            assert_eq!(out, tok.decode(&ids, skip_special).unwrap());
        }
    }
    // Pseudo-random ids, including lone bytes and specials: never a split char, same text.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let vocab = tok.vocab_size() as u64;
    for _ in 0..200 {
        let ids: Vec<u32> = (0..40)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Bias towards the single-byte tokens 0..256, where partial UTF-8 lives.
                let id = if state & 3 == 0 {
                    state % 256
                } else {
                    state % vocab
                };
                id as u32
            })
            .collect();
        for skip_special in [false, true] {
            let mut stream = StreamDecoder::new(tok, skip_special);
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&stream.push(id));
            }
            out.push_str(&stream.finish());
            assert_eq!(out, tok.decode(&ids, skip_special).unwrap());
        }
    }
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let tok = tokenizer();
    let byte_id = |b: u8| {
        (0..CL100K_N_BASE)
            .find(|&id| tok.token_bytes(id).unwrap() == [b])
            .unwrap()
    };
    // "😀" = F0 9F 98 80, fed one byte-token at a time.
    let ids: Vec<u32> = "😀".bytes().map(byte_id).collect();
    let mut stream = StreamDecoder::new(tok, true);
    assert_eq!(stream.push(ids[0]), "");
    assert_eq!(stream.push(ids[1]), "");
    assert_eq!(stream.push(tok.token_id("<|im_end|>").unwrap()), "");
    assert_eq!(stream.push(ids[2]), "");
    assert_eq!(stream.push(ids[3]), "😀");
    // An invalid continuation is replaced at once; a dangling prefix is flushed as U+FFFD.
    assert_eq!(stream.push(ids[0]), "");
    assert_eq!(stream.push(byte_id(b'A')), "\u{fffd}A");
    assert_eq!(stream.push(ids[0]), "");
    assert_eq!(stream.finish(), "\u{fffd}");
    assert_eq!(stream.push(CL100K_N_BASE + 300), "\u{fffd}");
    assert_eq!(stream.finish(), "");
}

#[test]
fn chat_prompt_encodes_to_special_ids() {
    let tok = tokenizer();
    let template = tok.chat_template().unwrap();
    let messages = [
        serde_json::json!({"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."}),
        serde_json::json!({"role": "user", "content": "Is 123 a prime?"}),
    ];
    let prompt = template.render(&messages, None, true).unwrap();
    let ids = tok.encode(&prompt, true).unwrap();
    let n = CL100K_N_BASE;
    assert_eq!(
        &ids[..3],
        [n + 10, tok.encode("system", false).unwrap()[0], n + 17]
    );
    assert_eq!(
        &ids[ids.len() - 3..],
        [n + 4, tok.encode("assistant", false).unwrap()[0], n + 17]
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}
