//! A commit's files as the hub lists them (`/tree/{commit}?recursive=true`): path, size, git
//! blob id and, for LFS files, the sha256 and size; checked before anything is named after
//! them on disk.

use serde::Deserialize;

use crate::hash::{is_hex, Checksum};
use crate::HubError;

/// A file of a repository at a commit, with what the hub says its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// `/`-separated path in the repository.
    pub path: String,
    /// Bytes of the file (of the LFS object, for LFS files).
    pub size: u64,
    /// The git blob id: of the content for a regular file, of the pointer for an LFS file.
    pub blob_id: String,
    /// For files stored in LFS: the object's sha256 and size.
    pub lfs: Option<LfsInfo>,
    /// The Xet content hash, where the hub gives one (kept for the tree cache only).
    pub xet_hash: Option<String>,
}

/// An LFS object's id and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LfsInfo {
    /// sha256 of the content, 64 hex digits.
    pub sha256: String,
    pub size: u64,
}

impl RepoFile {
    /// The name of the file's blob in the cache: the sha256 for an LFS file, else the git
    /// blob id (what the hub sends as `X-Linked-Etag` or `ETag`).
    pub fn etag(&self) -> &str {
        match &self.lfs {
            Some(lfs) => &lfs.sha256,
            None => &self.blob_id,
        }
    }

    /// What the file's bytes must hash to: the LFS sha256, else the git blob sha1 when the
    /// hub's id is one.
    pub fn checksum(&self) -> Option<Checksum> {
        match &self.lfs {
            Some(lfs) => Some(Checksum::Sha256(lfs.sha256.clone())),
            None if is_hex(&self.blob_id, 40) => Some(Checksum::GitSha1(self.blob_id.clone())),
            None => None,
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<TreeLfs>,
    #[serde(default, rename = "xetHash")]
    xet_hash: Option<String>,
}

#[derive(Deserialize)]
struct TreeLfs {
    oid: String,
    size: u64,
}

/// A listing entry as a file (`None` for folders), checked.
pub(crate) fn tree_file(entry: TreeEntry, url: &str) -> Result<Option<RepoFile>, HubError> {
    if entry.kind != "file" {
        return Ok(None);
    }
    let bad = |what: String| HubError::BadResponse {
        url: url.to_string(),
        what,
    };
    let lfs = match entry.lfs {
        Some(lfs) => {
            let sha256 = lfs.oid.to_ascii_lowercase();
            if !is_hex(&sha256, 64) {
                return Err(bad(format!(
                    "`{}` has lfs.oid `{}`, not a sha256",
                    entry.path, lfs.oid
                )));
            }
            Some(LfsInfo {
                sha256,
                size: lfs.size,
            })
        }
        None => None,
    };
    let size = match (&lfs, entry.size) {
        (Some(lfs), _) => lfs.size,
        (None, Some(size)) => size,
        (None, None) => return Err(bad(format!("`{}` has no size", entry.path))),
    };
    let blob_id = entry
        .oid
        .ok_or_else(|| bad(format!("`{}` has no oid", entry.path)))?;
    if !is_safe_etag(&blob_id) {
        return Err(bad(format!("`{}` has oid `{blob_id}`", entry.path)));
    }
    Ok(Some(RepoFile {
        path: entry.path,
        size,
        blob_id,
        lfs,
        xet_hash: entry.xet_hash,
    }))
}

/// True for an etag that can name a blob file: the hub's are hex digests; anything with a
/// path separator, a leading dot or odd characters is refused.
pub(crate) fn is_safe_etag(etag: &str) -> bool {
    !etag.is_empty()
        && etag.len() <= 128
        && !etag.starts_with('.')
        && etag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_entries_become_files() {
        let json = format!(
            r#"{{"type":"file","oid":"e3b0c44298fc1c149afbf4c8996fb92427ae41e4","size":5,
                "path":"m.safetensors","lfs":{{"oid":"{}","size":5,"pointerSize":130}}}}"#,
            "AB".repeat(32)
        );
        let lfs: TreeEntry = serde_json::from_str(&json).unwrap();
        let f = tree_file(lfs, "u").unwrap().unwrap();
        assert_eq!(f.etag(), "ab".repeat(32));
        assert!(matches!(f.checksum(), Some(Checksum::Sha256(_))));
        let dir: TreeEntry =
            serde_json::from_str(r#"{"type":"directory","oid":"x","size":0,"path":"d"}"#).unwrap();
        assert!(tree_file(dir, "u").unwrap().is_none());
        let bad: TreeEntry = serde_json::from_str(
            r#"{"type":"file","oid":"x","size":1,"path":"p","lfs":{"oid":"nothex","size":1}}"#,
        )
        .unwrap();
        assert!(tree_file(bad, "u").is_err());
    }

    #[test]
    fn etags_that_are_not_names_are_refused() {
        assert!(is_safe_etag(&"ab".repeat(32)));
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!is_safe_etag(bad), "{bad}");
        }
        let entry: TreeEntry =
            serde_json::from_str(r#"{"type":"file","oid":"../../evil","size":1,"path":"p"}"#)
                .unwrap();
        assert!(tree_file(entry, "u").is_err());
    }
}
