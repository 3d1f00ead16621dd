//! The checksums the hub publishes: the sha256 of an LFS file (`lfs.oid`), and the git blob
//! sha1 of a regular file (`oid`: sha1 of `blob <len>\0` followed by the bytes).

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// What a file's bytes must hash to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checksum {
    /// The LFS object id: sha256 of the content, 64 lowercase hex digits.
    Sha256(String),
    /// The git blob id: sha1 of `blob <len>\0<content>`, 40 lowercase hex digits.
    GitSha1(String),
}

impl Checksum {
    /// The algorithm's name, for messages.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Checksum::Sha256(_) => "sha256",
            Checksum::GitSha1(_) => "git blob sha1",
        }
    }

    /// The expected digest in hex.
    pub fn hex(&self) -> &str {
        match self {
            Checksum::Sha256(h) | Checksum::GitSha1(h) => h,
        }
    }

    /// A hasher for a file of `size` bytes.
    pub fn hasher(&self, size: u64) -> Hasher {
        match self {
            Checksum::Sha256(_) => Hasher::Sha256(Sha256::new()),
            Checksum::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
        }
    }
}

/// A running hash of a file being downloaded.
#[derive(Clone)]
pub enum Hasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl Hasher {
    /// Adds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::GitSha1(h) => h.update(bytes),
        }
    }

    /// The digest in lowercase hex.
    pub fn finish_hex(self) -> String {
        match self {
            Hasher::Sha256(h) => to_hex(&h.finalize()),
            Hasher::GitSha1(h) => to_hex(&h.finalize()),
        }
    }
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// True for `len` lowercase hex digits.
pub fn is_hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The sha256 of `bytes` in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    to_hex(&Sha256::digest(bytes))
}

/// The git blob sha1 of `bytes` in hex.
pub fn git_sha1_hex(bytes: &[u8]) -> String {
    let mut h = Checksum::GitSha1(String::new()).hasher(bytes.len() as u64);
    h.update(bytes);
    h.finish_hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_match_sha256sum_and_git() {
        assert_eq!(
            sha256_hex(b"hello\n"),
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            git_sha1_hex(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        assert!(is_hex(&sha256_hex(b""), 64));
        assert!(!is_hex("ABC", 3));
    }
}
