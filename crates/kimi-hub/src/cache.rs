//! The hub's cache layout, exactly as `huggingface_hub` writes and reads it:
//!
//! ```text
//! <cache>/models--org--name/
//!     blobs/<etag>                  file contents, named by sha256 (LFS) or git sha1
//!     blobs/<etag>.incomplete       a partial download, resumed from its length
//!     refs/<revision>               the commit a branch or tag pointed at
//!     snapshots/<commit>/<path>     relative symlinks to ../../blobs/<etag>
//!     trees/<commit>.json           the commit's file listing (sizes and checksums)
//! <cache>/.locks/models--org--name/<etag>.lock
//! ```
//!
//! A blob is only renamed into `blobs/` once its checksum matched, and a snapshot entry only
//! links to such a blob, so a reader of `snapshots/` never sees a partial or corrupted file.

use std::path::{Path, PathBuf};

use crate::api::RepoFile;
use crate::repo::{is_commit_hash, validate_revision, RepoId};
use crate::HubError;

/// The tag that tells backup tools to skip the cache.
const CACHEDIR_TAG: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
# This file is a cache directory tag created by kimi-infer (the Hugging Face hub cache).\n\
# For information about cache directory tags, see:\n\
#\thttps://bford.info/cachedir/\n";

/// One repository's folder in a hub cache.
#[derive(Clone, Debug)]
pub struct RepoCache {
    cache_dir: PathBuf,
    repo: RepoId,
    dir: PathBuf,
}

impl RepoCache {
    /// The folder of `repo` in the cache at `cache_dir` (nothing is created).
    pub fn new(cache_dir: &Path, repo: &RepoId) -> Self {
        Self {
            cache_dir: cache_dir.to_path_buf(),
            repo: repo.clone(),
            dir: cache_dir.join(repo.cache_folder_name()),
        }
    }

    /// `<cache>/models--org--name`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache's root.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// The verified contents of a file, by etag.
    pub fn blob_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where a download of `etag` accumulates until it is verified.
    pub fn incomplete_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    /// The lock `huggingface_hub` takes while it downloads `etag` (we take the same one).
    pub fn lock_path(&self, etag: &str) -> PathBuf {
        self.cache_dir
            .join(".locks")
            .join(self.repo.cache_folder_name())
            .join(format!("{etag}.lock"))
    }

    /// `snapshots/<commit>`.
    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// `trees/<commit>.json`'s folder: the repository's folder.
    pub fn tree_cache_folder(&self) -> &Path {
        &self.dir
    }

    /// The commit `revision` names: itself when it is a commit hash, else what
    /// `refs/<revision>` holds.
    pub fn commit_for(&self, revision: &str) -> Result<Option<String>, HubError> {
        if is_commit_hash(revision) {
            return Ok(Some(revision.to_string()));
        }
        validate_revision(revision)?;
        let path = self.dir.join("refs").join(revision);
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let commit = text.trim();
                Ok(is_commit_hash(commit).then(|| commit.to_string()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(HubError::io(path)(e)),
        }
    }

    /// Records that `revision` points at `commit` (nothing for a commit hash).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if revision == commit {
            return Ok(());
        }
        validate_revision(revision)?;
        let path = self.dir.join("refs").join(revision);
        write_atomic(&path, commit.as_bytes())
    }

    /// The snapshot folder of `revision`, without any network access.
    pub fn resolve(&self, revision: &str) -> Result<PathBuf, HubError> {
        let not_cached = |hint| HubError::NotCached {
            repo: self.repo.to_string(),
            revision: revision.to_string(),
            cache: self.cache_dir.clone(),
            hint,
        };
        let Some(commit) = self.commit_for(revision)? else {
            return Err(not_cached(if self.dir.is_dir() {
                " (the repository is cached, but not this revision)"
            } else {
                ""
            }));
        };
        let dir = self.snapshot_dir(&commit);
        if dir.is_dir() {
            Ok(dir)
        } else {
            Err(not_cached(
                " (its ref names a commit whose snapshot is missing)",
            ))
        }
    }

    /// Makes `snapshots/<commit>/<path>` a relative symlink to `blobs/<etag>`.
    pub fn link(&self, commit: &str, path: &Path, etag: &str) -> Result<PathBuf, HubError> {
        let pointer = self.snapshot_dir(commit).join(path);
        let parent = pointer.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(parent).map_err(HubError::io(parent))?;
        // From snapshots/<commit>/<dirs...>/ back to the repository folder.
        let mut target = PathBuf::new();
        for _ in 0..path.components().count() + 1 {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        replace_with_symlink(&target, &pointer, &self.blob_path(etag))?;
        Ok(pointer)
    }

    /// Creates the folders a download writes to and tags the cache for backup tools.
    pub fn prepare(&self) -> Result<(), HubError> {
        for sub in ["blobs", "snapshots"] {
            let d = self.dir.join(sub);
            std::fs::create_dir_all(&d).map_err(HubError::io(&d))?;
        }
        let tag = self.cache_dir.join("CACHEDIR.TAG");
        if !tag.exists() {
            // Best effort, as huggingface_hub does: a read-only tag is no reason to fail.
            let _ = std::fs::write(&tag, CACHEDIR_TAG);
        }
        Ok(())
    }
}

#[cfg(unix)]
fn replace_with_symlink(target: &Path, link: &Path, _blob: &Path) -> Result<(), HubError> {
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    match std::fs::remove_file(link) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(HubError::io(link)(e)),
    }
    std::os::unix::fs::symlink(target, link).map_err(HubError::io(link))
}

/// Where symlinks do not exist, `huggingface_hub` copies the blob; so do we.
#[cfg(not(unix))]
fn replace_with_symlink(_target: &Path, link: &Path, blob: &Path) -> Result<(), HubError> {
    std::fs::copy(blob, link)
        .map(drop)
        .map_err(HubError::io(link))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that a reader sees the
/// old contents or the new ones, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(HubError::io(parent))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(HubError::io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        HubError::io(path)(e)
    })
}

/// Writes `trees/<commit>.json` in `huggingface_hub`'s format (version 1): the commit's full
/// listing, so that `snapshot_download(local_files_only=True)` can tell a complete snapshot.
pub fn write_tree_cache(folder: &Path, commit: &str, files: &[RepoFile]) -> Result<(), HubError> {
    let mut map = serde_json::Map::new();
    for f in files {
        let mut info = serde_json::Map::new();
        info.insert("size".into(), f.size.into());
        info.insert("blob_id".into(), f.blob_id.clone().into());
        if let Some(lfs) = &f.lfs {
            info.insert("lfs_sha256".into(), lfs.sha256.clone().into());
            info.insert("lfs_size".into(), lfs.size.into());
        }
        if let Some(xet) = &f.xet_hash {
            info.insert("xet_hash".into(), xet.clone().into());
        }
        map.insert(f.path.clone(), info.into());
    }
    let doc = serde_json::json!({ "format_version": 1, "files": map });
    let text = serde_json::to_vec_pretty(&doc).unwrap_or_default();
    write_atomic(&folder.join("trees").join(format!("{commit}.json")), &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_snapshots_and_links_follow_the_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = RepoId::parse("org/name").unwrap();
        let cache = RepoCache::new(tmp.path(), &repo);
        let commit = "0123456789abcdef0123456789abcdef01234567";
        assert!(matches!(
            cache.resolve("main"),
            Err(HubError::NotCached { .. })
        ));
        cache.prepare().unwrap();
        std::fs::write(cache.blob_path("abc"), b"x").unwrap();
        let pointer = cache.link(commit, Path::new("sub/f.txt"), "abc").unwrap();
        assert_eq!(
            std::fs::read_link(&pointer).unwrap(),
            PathBuf::from("../../../blobs/abc")
        );
        assert_eq!(std::fs::read(&pointer).unwrap(), b"x");
        // Linking again (same or another blob) replaces the entry.
        cache.link(commit, Path::new("sub/f.txt"), "abc").unwrap();
        cache.write_ref("main", commit).unwrap();
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("models--org--name/refs/main")).unwrap(),
            commit
        );
        assert_eq!(cache.resolve("main").unwrap(), cache.snapshot_dir(commit));
        assert_eq!(cache.resolve(commit).unwrap(), cache.snapshot_dir(commit));
        assert!(cache.resolve("v2").is_err());
        assert!(cache.resolve("../x").is_err());
        assert!(tmp.path().join("CACHEDIR.TAG").is_file());
    }
}
