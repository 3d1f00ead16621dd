//! Token bytes to text for responses: incremental UTF-8 assembly that can live inside a
//! response stream (unlike `kimi_tokenizer::StreamDecoder`, which borrows the tokenizer).

use kimi_tokenizer::Tokenizer;

/// Incremental UTF-8 assembly of token bytes (shared with `kimi_tokenizer::StreamDecoder`).
pub(crate) type ByteDecoder = kimi_tokenizer::Utf8Stream;

/// A token's bytes (empty for unknown ids).
pub(crate) fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    tokenizer.token_bytes(id).unwrap_or_default()
}

/// A token as text for logprobs: its bytes, lossily decoded.
pub(crate) fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&token_bytes(tokenizer, id)).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_split_characters() {
        let mut d = ByteDecoder::default();
        let bytes = "é!".as_bytes();
        assert_eq!(d.push(&bytes[..1]), "");
        assert_eq!(d.push(&bytes[1..]), "é!");
        assert_eq!(d.push(&[0xff, b'a']), "\u{FFFD}a");
        assert_eq!(d.push(&[0xe4]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
