//! What can go wrong, each naming the repository, revision and file it concerns.

use std::path::PathBuf;

/// An error of a hub request, a download or a cache look-up.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// `REPO_ID` is not of the hub's form.
    #[error("`{id}` is not a repository id: {why} (expected `org/name`, letters, digits, `-`, `_` and `.`)")]
    BadRepoId { id: String, why: &'static str },

    /// A revision that cannot name a ref (empty, `..`, an absolute path).
    #[error("`{revision}` is not a revision name (a branch, tag or 40-hex commit)")]
    BadRevision { revision: String },

    /// A file name in the hub's listing that would escape the snapshot folder.
    #[error("{repo}: the hub lists a file named `{file}`, which is not a safe relative path; refusing it")]
    UnsafePath { repo: String, file: String },

    /// The repository does not exist, or is private and the token cannot see it.
    #[error("{repo}: repository not found on {endpoint}{hint}")]
    RepoNotFound {
        repo: String,
        endpoint: String,
        hint: &'static str,
    },

    /// The repository exists but the revision does not.
    #[error("{repo}: revision `{revision}` not found")]
    RevisionNotFound { repo: String, revision: String },

    /// The revision exists but the file does not.
    #[error("{repo}@{revision}: file `{file}` not found")]
    EntryNotFound {
        repo: String,
        revision: String,
        file: String,
    },

    /// A gated or private repository refused the request (401/403).
    #[error("{repo}: access denied ({status}){file_part}: {reason}")]
    AccessDenied {
        repo: String,
        status: u16,
        file_part: String,
        reason: String,
    },

    /// An HTTP status the download cannot go on from (after retries, for transient ones).
    #[error("{url}: the server answered {status}{message}")]
    Status {
        url: String,
        status: u16,
        message: String,
    },

    /// A transport error (connection, TLS, timeout, cut transfer), after retries.
    #[error("{url}: {what}")]
    Transport { url: String, what: String },

    /// A response that is not what the hub's API sends.
    #[error("{url}: unexpected response: {what}")]
    BadResponse { url: String, what: String },

    /// A downloaded file whose bytes do not hash to the hub's checksum: it was deleted.
    #[error("{0}")]
    ChecksumMismatch(Box<ChecksumMismatch>),

    /// A downloaded file of another length than the hub listed.
    #[error("{repo}@{revision}: `{file}` arrived with {actual} bytes, the hub lists {expected}")]
    SizeMismatch {
        repo: String,
        revision: String,
        file: String,
        expected: u64,
        actual: u64,
    },

    /// Not enough free space for what remains to be downloaded.
    #[error(
        "not enough free space in {dir}: {repo} needs {} more but only {} are free: short by {} \
         (free some space, or download elsewhere with --cache-dir or --local-dir)",
        human_bytes(*needed), human_bytes(*available), human_bytes(needed.saturating_sub(*available))
    )]
    NoSpace {
        repo: String,
        dir: PathBuf,
        needed: u64,
        available: u64,
    },

    /// `--include`/`--exclude` left nothing to download.
    #[error("{repo}@{revision}: no file matches the --include/--exclude patterns ({patterns})")]
    NothingMatches {
        repo: String,
        revision: String,
        patterns: String,
    },

    /// The repository (at this revision) is not in the cache.
    #[error("{repo}@{revision} is not in the Hugging Face cache {cache}{hint}")]
    NotCached {
        repo: String,
        revision: String,
        cache: PathBuf,
        hint: &'static str,
    },

    /// `HF_HUB_OFFLINE` forbids network access.
    #[error("{repo}: HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it to download")]
    Offline { repo: String },

    /// A file-system error, naming the path.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The details of [`HubError::ChecksumMismatch`].
#[derive(Debug, thiserror::Error)]
#[error(
    "{repo}@{revision}: `{file}` is corrupted: its {algorithm} is {actual}, the hub says \
     {expected}; the partial file was deleted and nothing was put in place"
)]
pub struct ChecksumMismatch {
    pub repo: String,
    pub revision: String,
    pub file: String,
    pub algorithm: &'static str,
    pub expected: String,
    pub actual: String,
}

impl HubError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| HubError::Io { path, source }
    }
}

/// A byte count for people: `1.50 GiB`, `312.0 MiB`, `17 B`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn bytes_read_as_people_say_them() {
        assert_eq!(human_bytes(17), "17 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_bytes(1_500_000_000_000), "1.36 TiB");
    }
}
