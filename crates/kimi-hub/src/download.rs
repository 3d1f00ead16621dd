//! A repository's download: list the commit's files, keep those the patterns take, check
//! the free space for what is missing, fetch a few files at a time (each verified before it
//! is put in place), link them into `snapshots/<commit>/`, and only then point
//! `refs/<revision>` at the commit, so that a name resolves to a complete snapshot or to the
//! one it resolved to before.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use sha1::{Digest, Sha1};

use crate::api::{HubClient, RepoFile};
use crate::cache::{write_atomic, write_tree_cache, RepoCache};
use crate::glob::FileFilter;
use crate::lock::lock;
use crate::repo::{safe_relative_path, validate_revision, RepoId};
use crate::transfer::{fetch, file_matches, Job};
use crate::HubError;

/// What a download reports as it goes (to draw progress bars).
#[derive(Debug)]
pub enum Event<'a> {
    /// The plan: every selected file, and what of it must come over the network.
    Planned {
        files: usize,
        bytes: u64,
        fetch_files: usize,
        fetch_bytes: u64,
    },
    /// A file's transfer starts, `resumed_from` bytes already on disk.
    FileStarted {
        path: &'a str,
        size: u64,
        resumed_from: u64,
    },
    /// Bytes arrived.
    Progress { path: &'a str, bytes: u64 },
    /// Bytes on disk were thrown away (a corrupted or unresumable transfer starts over).
    Rewound { path: &'a str, bytes: u64 },
    /// A transient failure; the transfer resumes after `delay`.
    Retrying {
        path: &'a str,
        error: &'a HubError,
        delay: Duration,
    },
    /// The file is verified and in place.
    FileDone { path: &'a str },
}

/// Receives [`Event`]s (from several transfers at once).
pub trait Observer: Send + Sync {
    fn event(&self, event: Event<'_>);
}

impl<F: Fn(Event<'_>) + Send + Sync> Observer for F {
    fn event(&self, event: Event<'_>) {
        self(event)
    }
}

/// Draws nothing.
pub struct Quiet;

impl Observer for Quiet {
    fn event(&self, _: Event<'_>) {}
}

/// What to download and where.
#[derive(Clone, Debug)]
pub struct DownloadOptions {
    /// Branch, tag or commit.
    pub revision: String,
    /// `--include`/`--exclude`.
    pub filter: FileFilter,
    /// The hub cache (`HF_HUB_CACHE`).
    pub cache_dir: PathBuf,
    /// Plain files in this folder instead of the cache (`huggingface_hub`'s `local_dir`).
    pub local_dir: Option<PathBuf>,
    /// Files transferred at once.
    pub max_workers: usize,
}

/// A finished download.
#[derive(Clone, Debug)]
pub struct Downloaded {
    /// The commit the revision named.
    pub commit: String,
    /// The snapshot folder (or the local folder): what a loader opens.
    pub path: PathBuf,
    /// Files selected.
    pub files: usize,
    /// Bytes of the selected files.
    pub bytes: u64,
    /// Files that had to be transferred.
    pub fetched_files: usize,
    /// Bytes that came over the network.
    pub fetched_bytes: u64,
}

/// One blob (cache mode) or file (local mode) to transfer.
struct Fetch<'a> {
    file: &'a RepoFile,
    incomplete: PathBuf,
    destination: PathBuf,
    lock: PathBuf,
}

/// Downloads `repo` as `options` say.
pub async fn download(
    client: &HubClient,
    repo: &RepoId,
    options: &DownloadOptions,
    observer: &dyn Observer,
) -> Result<Downloaded, HubError> {
    validate_revision(&options.revision)?;
    let (commit, siblings) = client.revision(repo, &options.revision).await?;
    let listing = client.list_files(repo, &commit, &siblings).await?;
    let mut selected = Vec::new();
    for file in &listing {
        let (path, _) = safe_relative_path(repo, &file.path)?;
        if options.filter.accepts(&file.path) {
            selected.push((path, file));
        }
    }
    if selected.is_empty() && !listing.is_empty() {
        return Err(HubError::NothingMatches {
            repo: repo.to_string(),
            revision: options.revision.clone(),
            patterns: options.filter.describe(),
        });
    }
    match &options.local_dir {
        None => {
            to_cache(
                client, repo, options, &commit, &listing, &selected, observer,
            )
            .await
        }
        Some(dir) => {
            to_local_dir(
                client, repo, options, dir, &commit, &listing, &selected, observer,
            )
            .await
        }
    }
}

async fn to_cache(
    client: &HubClient,
    repo: &RepoId,
    options: &DownloadOptions,
    commit: &str,
    listing: &[RepoFile],
    selected: &[(PathBuf, &RepoFile)],
    observer: &dyn Observer,
) -> Result<Downloaded, HubError> {
    let cache = RepoCache::new(&options.cache_dir, repo);
    cache.prepare()?;
    write_tree_cache(cache.tree_cache_folder(), commit, listing)?;
    // Files with the same contents share a blob: fetch each blob once.
    let mut by_etag: HashMap<&str, &RepoFile> = HashMap::new();
    for (_, file) in selected {
        by_etag.entry(file.etag()).or_insert(file);
    }
    let mut fetches: Vec<Fetch> = by_etag
        .into_values()
        .filter(|f| !cache.blob_path(f.etag()).is_file())
        .map(|f| Fetch {
            file: f,
            incomplete: cache.incomplete_path(f.etag()),
            destination: cache.blob_path(f.etag()),
            lock: cache.lock_path(f.etag()),
        })
        .collect();
    fetches.sort_by(|a, b| a.file.path.cmp(&b.file.path));
    let blobs_dir = cache.dir().join("blobs");
    let fetched_bytes = run_fetches(
        client, repo, commit, &fetches, &blobs_dir, selected, options, observer,
    )
    .await?;
    for (path, file) in selected {
        cache.link(commit, path, file.etag())?;
    }
    cache.write_ref(&options.revision, commit)?;
    Ok(Downloaded {
        commit: commit.to_string(),
        path: cache.snapshot_dir(commit),
        files: selected.len(),
        bytes: selected.iter().map(|(_, f)| f.size).sum(),
        fetched_files: fetches.len(),
        fetched_bytes,
    })
}

#[allow(clippy::too_many_arguments)]
async fn to_local_dir(
    client: &HubClient,
    repo: &RepoId,
    options: &DownloadOptions,
    dir: &Path,
    commit: &str,
    listing: &[RepoFile],
    selected: &[(PathBuf, &RepoFile)],
    observer: &dyn Observer,
) -> Result<Downloaded, HubError> {
    let meta_root = dir.join(".cache").join("huggingface");
    std::fs::create_dir_all(&meta_root).map_err(HubError::io(&meta_root))?;
    let gitignore = meta_root.join(".gitignore");
    if !gitignore.exists() {
        write_atomic(&gitignore, b"*")?;
    }
    write_tree_cache(&meta_root, commit, listing)?;
    let mut fetches = Vec::new();
    for (path, file) in selected {
        let target = dir.join(path);
        let paths = LocalPaths::new(dir, path);
        if local_file_is_current(&target, &paths.metadata, file, commit).await {
            continue;
        }
        fetches.push(Fetch {
            file,
            incomplete: paths.incomplete(file.etag()),
            destination: target,
            lock: paths.lock,
        });
    }
    let fetched_bytes = run_fetches(
        client, repo, commit, &fetches, dir, selected, options, observer,
    )
    .await?;
    Ok(Downloaded {
        commit: commit.to_string(),
        path: dir.to_path_buf(),
        files: selected.len(),
        bytes: selected.iter().map(|(_, f)| f.size).sum(),
        fetched_files: fetches.len(),
        fetched_bytes,
    })
}

/// Checks the space, then transfers `fetches` `max_workers` at a time; returns the bytes
/// that came over the network.
#[allow(clippy::too_many_arguments)]
async fn run_fetches(
    client: &HubClient,
    repo: &RepoId,
    commit: &str,
    fetches: &[Fetch<'_>],
    space_dir: &Path,
    selected: &[(PathBuf, &RepoFile)],
    options: &DownloadOptions,
    observer: &dyn Observer,
) -> Result<u64, HubError> {
    // What is already in `.incomplete` files needs no new room.
    let needed: u64 = fetches
        .iter()
        .map(|f| {
            let have = std::fs::metadata(&f.incomplete).map_or(0, |m| m.len());
            f.file.size.saturating_sub(have)
        })
        .sum();
    observer.event(Event::Planned {
        files: selected.len(),
        bytes: selected.iter().map(|(_, f)| f.size).sum(),
        fetch_files: fetches.len(),
        fetch_bytes: needed,
    });
    crate::space::check_space(repo.as_str(), space_dir, needed)?;
    let local = options.local_dir.as_deref();
    stream::iter(fetches)
        .map(|f| fetch_one(client, repo, commit, f, local, observer))
        .buffer_unordered(options.max_workers.max(1))
        .try_fold(0u64, async |sum, n| Ok(sum + n))
        .await
}

async fn fetch_one(
    client: &HubClient,
    repo: &RepoId,
    commit: &str,
    f: &Fetch<'_>,
    local_dir: Option<&Path>,
    observer: &dyn Observer,
) -> Result<u64, HubError> {
    let _lock = lock(&f.lock).await?;
    // Another process may have put the blob in place while we waited for its lock.
    if local_dir.is_none() && f.destination.is_file() {
        observer.event(Event::FileDone { path: &f.file.path });
        return Ok(0);
    }
    let job = Job {
        repo,
        commit,
        file: f.file,
        incomplete: f.incomplete.clone(),
        destination: f.destination.clone(),
    };
    let n = fetch(client, &job, observer).await?;
    if let Some(dir) = local_dir {
        let (path, _) = safe_relative_path(repo, &f.file.path)?;
        write_local_metadata(&LocalPaths::new(dir, &path).metadata, commit, f.file.etag())?;
    }
    Ok(n)
}

/// `huggingface_hub`'s bookkeeping for a `local_dir` download, under
/// `<dir>/.cache/huggingface/download/`.
struct LocalPaths {
    /// `<path>.metadata`: commit, etag and time of the file's download.
    metadata: PathBuf,
    /// `<path>.lock`.
    lock: PathBuf,
}

impl LocalPaths {
    fn new(dir: &Path, path: &Path) -> Self {
        let base = dir
            .join(".cache")
            .join("huggingface")
            .join("download")
            .join(path);
        let with = |suffix: &str| {
            let mut name = base.as_os_str().to_os_string();
            name.push(suffix);
            PathBuf::from(name)
        };
        Self {
            metadata: with(".metadata"),
            lock: with(".lock"),
        }
    }

    /// `<short hash of the metadata file's name>.<etag>.incomplete` beside the metadata.
    fn incomplete(&self, etag: &str) -> PathBuf {
        let name = self
            .metadata
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let short = base64::engine::general_purpose::URL_SAFE.encode(Sha1::digest(name.as_bytes()));
        self.metadata
            .with_file_name(format!("{short}.{etag}.incomplete"))
    }
}

/// True when `target` is this file already: its metadata names the same etag, or (no
/// metadata) its bytes hash to the hub's checksum.
async fn local_file_is_current(
    target: &Path,
    metadata: &Path,
    file: &RepoFile,
    commit: &str,
) -> bool {
    let Ok(stat) = std::fs::metadata(target) else {
        return false;
    };
    if stat.len() != file.size {
        return false;
    }
    if let Ok(text) = std::fs::read_to_string(metadata) {
        if text.lines().nth(1) == Some(file.etag()) {
            return true;
        }
    }
    if file_matches(target, file).await {
        return write_local_metadata(metadata, commit, file.etag()).is_ok();
    }
    false
}

fn write_local_metadata(path: &Path, commit: &str, etag: &str) -> Result<(), HubError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    write_atomic(path, format!("{commit}\n{etag}\n{now}\n").as_bytes())
}
