//! Incremental UTF-8 decoding of token bytes, owned (unlike `kimi_tokenizer::StreamDecoder`,
//! which borrows the tokenizer) so it can live inside a response stream.

use kimi_tokenizer::Tokenizer;

/// Turns token bytes into text, holding back a character split across tokens. Invalid
/// bytes become U+FFFD as [`String::from_utf8_lossy`] places them.
#[derive(Debug, Default)]
pub(crate) struct ByteDecoder {
    pending: Vec<u8>,
}

impl ByteDecoder {
    /// Adds bytes and returns the text now complete.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut text = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(valid) => {
                    text.push_str(valid);
                    start = self.pending.len();
                    break;
                }
                Err(err) => {
                    let valid_end = start + err.valid_up_to();
                    text.push_str(&String::from_utf8_lossy(&self.pending[start..valid_end]));
                    match err.error_len() {
                        Some(len) => {
                            text.push('\u{FFFD}');
                            start = valid_end + len;
                        }
                        None => {
                            start = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        text
    }

    /// Flushes what is held back; an incomplete character becomes U+FFFD.
    pub(crate) fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

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
