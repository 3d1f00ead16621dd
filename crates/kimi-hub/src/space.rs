//! Free space, checked before a download starts rather than discovered half-way through a
//! 1.5 TB transfer.

use std::path::{Path, PathBuf};

use crate::HubError;

/// Bytes an unprivileged process may still write on the file system holding `dir` (or its
/// nearest existing ancestor): `f_bavail × f_frsize` from `statvfs`.
pub fn available_bytes(dir: &Path) -> Result<u64, HubError> {
    let mut probe: PathBuf = dir.to_path_buf();
    while !probe.exists() {
        match probe.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => probe = parent.to_path_buf(),
            _ => {
                probe = PathBuf::from(".");
                break;
            }
        }
    }
    let stat = rustix::fs::statvfs(&probe).map_err(|e| HubError::Io {
        path: probe.clone(),
        source: e.into(),
    })?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Fails with a message naming `dir` and the shortfall when `needed` bytes do not fit.
pub fn check_space(repo: &str, dir: &Path, needed: u64) -> Result<(), HubError> {
    check_against(repo, dir, needed, available_bytes(dir)?)
}

fn check_against(repo: &str, dir: &Path, needed: u64, available: u64) -> Result<(), HubError> {
    if needed <= available {
        return Ok(());
    }
    Err(HubError::NoSpace {
        repo: repo.to_string(),
        dir: dir.to_path_buf(),
        needed,
        available,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shortfall_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let free = available_bytes(&dir.path().join("not/yet/made")).unwrap();
        assert!(free > 0);
        assert!(check_space("a/b", dir.path(), 1).is_ok());
        let err = check_against("a/b", Path::new("/data/hf"), 3 << 40, 1 << 40).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/data/hf"), "{text}");
        assert!(text.contains("short by 2.00 TiB"), "{text}");
        assert!(check_space("a/b", dir.path(), u64::MAX).is_err());
    }
}
