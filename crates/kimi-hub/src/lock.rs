//! The per-blob lock `huggingface_hub` takes (an `flock` on `.locks/<repo>/<etag>.lock`),
//! taken the same way so that the two tools never write the same blob at once.

use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::FlockOperation;

use crate::HubError;

/// A held lock; released when dropped (the descriptor closes).
pub(crate) struct BlobLock {
    _file: Option<std::fs::File>,
}

/// Waits for the exclusive lock on `path`. Where the file system has no `flock` (some
/// network mounts) it goes on unlocked, as `huggingface_hub` falls back to a weaker lock.
pub(crate) async fn lock(path: &Path) -> Result<BlobLock, HubError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(HubError::io(parent))?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.create(true).truncate(false).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o664);
    let file = options.open(path).map_err(HubError::io(path))?;
    let start = Instant::now();
    let mut said = Duration::ZERO;
    loop {
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(BlobLock { _file: Some(file) }),
            Err(rustix::io::Errno::WOULDBLOCK) | Err(rustix::io::Errno::INTR) => {
                if start.elapsed() >= said + Duration::from_secs(10) {
                    said = start.elapsed();
                    tracing::info!(lock = %path.display(), "waiting for another download of this file ({said:?})");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => {
                tracing::warn!(lock = %path.display(), "cannot lock ({e}); going on without the lock");
                return Ok(BlobLock { _file: None });
            }
        }
    }
}
