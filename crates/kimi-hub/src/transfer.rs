//! One file's transfer: into a `.incomplete` file, resumed with `Range` requests after a cut
//! or a stall, hashed as it arrives, and renamed into place only when its size and checksum
//! match what the hub lists. A corrupted file is deleted, never moved.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::header::CONTENT_RANGE;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use crate::api::{Failure, HubClient, RepoFile, Subject};
use crate::download::{Event, Observer};
use crate::error::ChecksumMismatch;
use crate::hash::Hasher;
use crate::repo::RepoId;
use crate::HubError;

/// Times a file that arrived whole but hashed wrong is fetched again from scratch (a bad
/// proxy or a flipped bit in transit) before the download fails.
const CORRUPTION_RETRIES: u32 = 1;

/// One file to fetch.
pub(crate) struct Job<'a> {
    pub repo: &'a RepoId,
    pub commit: &'a str,
    pub file: &'a RepoFile,
    /// The partial download.
    pub incomplete: PathBuf,
    /// Where the verified file goes.
    pub destination: PathBuf,
}

/// The partial file with the hash of its bytes so far.
struct Partial {
    file: tokio::fs::File,
    len: u64,
    hasher: Option<Hasher>,
}

/// Fetches `job`'s file; returns the bytes that came over the network.
pub(crate) async fn fetch(
    client: &HubClient,
    job: &Job<'_>,
    observer: &dyn Observer,
) -> Result<u64, HubError> {
    let file = job.file;
    let subject = Subject {
        repo: job.repo,
        revision: job.commit,
        file: Some(&file.path),
    };
    let url = client.resolve_url(job.repo, job.commit, &file.path);
    let mut partial = open_partial(job).await?;
    observer.event(Event::FileStarted {
        path: &file.path,
        size: file.size,
        resumed_from: partial.len,
    });
    let mut received = 0u64;
    let mut tries = 0u32;
    let mut corruption_retries = CORRUPTION_RETRIES;
    loop {
        let before = partial.len;
        let outcome = if partial.len < file.size {
            transfer(client, job, &url, subject, &mut partial, observer).await
        } else {
            Ok(())
        };
        received += partial.len.saturating_sub(before);
        match outcome {
            Ok(()) if partial.len == file.size => match verify(job, &mut partial).await? {
                None => {
                    finish(job, partial).await?;
                    observer.event(Event::FileDone { path: &file.path });
                    return Ok(received);
                }
                Some(mismatch) => {
                    // Whatever went wrong is in the bytes we have: start over from nothing.
                    discard(job, &mut partial, observer).await?;
                    if corruption_retries == 0 {
                        let _ = tokio::fs::remove_file(&job.incomplete).await;
                        return Err(mismatch);
                    }
                    corruption_retries -= 1;
                    tracing::warn!(error = %mismatch, "fetching the file again");
                    observer.event(Event::Retrying {
                        path: &file.path,
                        error: &mismatch,
                        delay: Duration::ZERO,
                    });
                }
            },
            Ok(()) => {
                // The body ended early without a transport error (a server that closed the
                // connection cleanly): resume like any cut transfer.
                let short = HubError::Transport {
                    url: url.clone(),
                    what: format!(
                        "the transfer ended after {} of {} bytes",
                        partial.len, file.size
                    ),
                };
                tries = retry_or_fail(
                    client,
                    Failure::transient(short),
                    tries,
                    partial.len > before,
                    file,
                    observer,
                )
                .await?;
            }
            Err(failure) => {
                tries = retry_or_fail(client, failure, tries, partial.len > before, file, observer)
                    .await?;
            }
        }
    }
}

/// Counts a failed try, waits, and says whether to go on (`Ok(tries)`) or not.
async fn retry_or_fail(
    client: &HubClient,
    failure: Failure,
    tries: u32,
    progressed: bool,
    file: &RepoFile,
    observer: &dyn Observer,
) -> Result<u32, HubError> {
    // A try that moved bytes forward starts the count again: a long download over a flaky
    // link keeps going as long as it progresses.
    let tries = if progressed { 1 } else { tries + 1 };
    if !failure.transient || tries >= client.retry.attempts {
        return Err(failure.error);
    }
    let delay = client.retry.delay(tries, failure.retry_after);
    tracing::warn!(file = %file.path, error = %failure.error, "resuming in {delay:?} (try {tries} of {})", client.retry.attempts);
    observer.event(Event::Retrying {
        path: &file.path,
        error: &failure.error,
        delay,
    });
    tokio::time::sleep(delay).await;
    Ok(tries)
}

/// One request: from the partial file's length to the end (or until it fails).
async fn transfer(
    client: &HubClient,
    job: &Job<'_>,
    url: &str,
    subject: Subject<'_>,
    partial: &mut Partial,
    observer: &dyn Observer,
) -> Result<(), Failure> {
    let file = job.file;
    let (mut response, headers) = client.open_file(url, partial.len, subject).await?;
    if headers.etag.as_deref().is_some_and(|e| e != file.etag()) {
        tracing::warn!(file = %file.path, "the hub's ETag {:?} differs from its listing's {}", headers.etag, file.etag());
    }
    match response.status() {
        StatusCode::RANGE_NOT_SATISFIABLE => {
            // Our partial file is not a prefix the server knows: start over.
            discard(job, partial, observer).await?;
            return Err(Failure::transient(HubError::Transport {
                url: url.to_string(),
                what: "the server refused to resume (416); starting over".into(),
            }));
        }
        StatusCode::PARTIAL_CONTENT => {
            let start = response
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(content_range_start);
            if start != Some(partial.len) {
                discard(job, partial, observer).await?;
                return Err(Failure::transient(HubError::BadResponse {
                    url: url.to_string(),
                    what: format!(
                        "asked for bytes from {} and got Content-Range {:?}; starting over",
                        partial.len,
                        response.headers().get(CONTENT_RANGE)
                    ),
                }));
            }
        }
        _ if partial.len > 0 => {
            // A server that ignores Range sends the whole file again.
            tracing::info!(file = %file.path, "the server does not resume; starting over");
            discard(job, partial, observer).await?;
        }
        _ => {}
    }
    let io = |e| Failure::fatal(HubError::io(&job.incomplete)(e));
    loop {
        let chunk = match tokio::time::timeout(client.idle_timeout, response.chunk()).await {
            Err(_) => {
                return Err(Failure::transient(HubError::Transport {
                    url: url.to_string(),
                    what: format!("no data for {:?}", client.idle_timeout),
                }))
            }
            Ok(Err(e)) => return Err(crate::api::transport_failure(url, e)),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(chunk))) => chunk,
        };
        if partial.len + chunk.len() as u64 > file.size {
            discard(job, partial, observer).await?;
            return Err(Failure::fatal(HubError::SizeMismatch {
                repo: job.repo.to_string(),
                revision: job.commit.to_string(),
                file: file.path.clone(),
                expected: file.size,
                actual: partial.len + chunk.len() as u64,
            }));
        }
        partial.file.write_all(&chunk).await.map_err(io)?;
        if let Some(h) = partial.hasher.as_mut() {
            h.update(&chunk);
        }
        partial.len += chunk.len() as u64;
        observer.event(Event::Progress {
            path: &file.path,
            bytes: chunk.len() as u64,
        });
    }
}

/// Opens (or creates) the partial file and hashes what it already holds.
async fn open_partial(job: &Job<'_>) -> Result<Partial, HubError> {
    let path = &job.incomplete;
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(HubError::io(parent))?;
    }
    let io = HubError::io(path);
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .await
        .map_err(HubError::io(path))?;
    let mut len = file.metadata().await.map_err(HubError::io(path))?.len();
    if len > job.file.size {
        file.set_len(0).await.map_err(HubError::io(path))?;
        len = 0;
    }
    let mut hasher = job.file.checksum().map(|c| c.hasher(job.file.size));
    if let Some(h) = hasher.as_mut() {
        if len > 0 {
            hash_prefix(&mut file, len, h).await.map_err(io)?;
        }
    }
    file.seek(std::io::SeekFrom::Start(len))
        .await
        .map_err(HubError::io(path))?;
    Ok(Partial { file, len, hasher })
}

async fn hash_prefix(
    file: &mut tokio::fs::File,
    len: u64,
    hasher: &mut Hasher,
) -> std::io::Result<()> {
    file.seek(std::io::SeekFrom::Start(0)).await?;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let want = buf.len().min(left as usize);
        let n = file.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the partial file shrank while it was read",
            ));
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

/// Empties the partial file (its bytes cannot be trusted or used).
async fn discard(
    job: &Job<'_>,
    partial: &mut Partial,
    observer: &dyn Observer,
) -> Result<(), HubError> {
    let path = &job.incomplete;
    partial.file.set_len(0).await.map_err(HubError::io(path))?;
    partial
        .file
        .seek(std::io::SeekFrom::Start(0))
        .await
        .map_err(HubError::io(path))?;
    if partial.len > 0 {
        observer.event(Event::Rewound {
            path: &job.file.path,
            bytes: partial.len,
        });
    }
    partial.len = 0;
    partial.hasher = job.file.checksum().map(|c| c.hasher(job.file.size));
    Ok(())
}

/// `None` when the bytes hash to the hub's checksum, else the mismatch.
async fn verify(job: &Job<'_>, partial: &mut Partial) -> Result<Option<HubError>, HubError> {
    let Some(expected) = job.file.checksum() else {
        tracing::debug!(file = %job.file.path, "the hub gives no checksum for this file; size checked only");
        return Ok(None);
    };
    let actual = partial
        .hasher
        .take()
        .map(Hasher::finish_hex)
        .unwrap_or_default();
    if actual == expected.hex() {
        return Ok(None);
    }
    Ok(Some(HubError::ChecksumMismatch(Box::new(
        ChecksumMismatch {
            repo: job.repo.to_string(),
            revision: job.commit.to_string(),
            file: job.file.path.clone(),
            algorithm: expected.algorithm(),
            expected: expected.hex().to_string(),
            actual,
        },
    ))))
}

/// Flushes the verified file to disk and renames it into place.
async fn finish(job: &Job<'_>, partial: Partial) -> Result<(), HubError> {
    let Partial { mut file, .. } = partial;
    let io = HubError::io(&job.incomplete);
    file.flush().await.map_err(io)?;
    file.sync_all()
        .await
        .map_err(HubError::io(&job.incomplete))?;
    drop(file);
    if let Some(parent) = job.destination.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(HubError::io(parent))?;
    }
    tokio::fs::rename(&job.incomplete, &job.destination)
        .await
        .map_err(HubError::io(&job.destination))
}

/// The first byte of `Content-Range: bytes <start>-<end>/<total>`.
fn content_range_start(value: &str) -> Option<u64> {
    value
        .trim()
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Hashes a file already on disk (a `--local-dir` file without metadata), to see whether it
/// can be kept.
pub(crate) async fn file_matches(path: &Path, file: &RepoFile) -> bool {
    let Some(expected) = file.checksum() else {
        return false;
    };
    let Ok(mut f) = tokio::fs::File::open(path).await else {
        return false;
    };
    let mut hasher = expected.hasher(file.size);
    hash_prefix(&mut f, file.size, &mut hasher).await.is_ok()
        && f.metadata().await.is_ok_and(|m| m.len() == file.size)
        && hasher.finish_hex() == expected.hex()
}

#[cfg(test)]
mod tests {
    #[test]
    fn content_ranges() {
        assert_eq!(super::content_range_start("bytes 100-199/200"), Some(100));
        assert_eq!(super::content_range_start("bytes */200"), None);
    }
}
