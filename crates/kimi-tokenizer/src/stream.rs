//! Streaming detokenisation on raw token bytes.

use crate::Tokenizer;

/// Feeds token ids one at a time and returns the text that is complete. Bytes of a UTF-8
/// character split across tokens are held back until the character is complete; invalid
/// sequences become U+FFFD exactly as [`String::from_utf8_lossy`] would place them, so the
/// concatenated output equals the lossy decoding of all the tokens' bytes.
///
/// The stream works on [`Tokenizer::token_bytes`], so for `tokenizer.json` models whose decoder
/// rewrites text (e.g. SentencePiece stripping the first space) it keeps that space, as a
/// continuation of a prompt should.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    bytes: Utf8Stream,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that skips special tokens when `skip_special` is set.
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            bytes: Utf8Stream::default(),
        }
    }

    /// Adds one token and returns the newly completed text (possibly empty). An id outside the
    /// vocabulary yields U+FFFD.
    pub fn push(&mut self, id: u32) -> String {
        if self.skip_special && self.tokenizer.is_special(id) {
            return String::new();
        }
        match self.tokenizer.token_bytes(id) {
            Some(bytes) => self.bytes.push(&bytes),
            None => self.bytes.push("\u{FFFD}".as_bytes()),
        }
    }

    /// Flushes what is held back; an incomplete trailing character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        self.bytes.finish()
    }
}

/// Turns a stream of bytes into text, holding back a character split across pushes; invalid
/// bytes become U+FFFD where [`String::from_utf8_lossy`] would place them. Owns no tokenizer,
/// so it can live inside a response stream.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes and returns the text now complete (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Flushes what is held back; an incomplete trailing character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }

    fn take_complete(&mut self) -> String {
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
                    // The prefix up to `valid_up_to` is valid UTF-8 by definition.
                    text.push_str(&String::from_utf8_lossy(&self.pending[start..valid_end]));
                    match err.error_len() {
                        Some(len) => {
                            text.push('\u{FFFD}');
                            start = valid_end + len;
                        }
                        // An incomplete character at the end: wait for more bytes.
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
}
