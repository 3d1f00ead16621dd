//! Models by name: the Hugging Face hub's HTTP API and its shared cache.
//!
//! [`Hub::download`] fetches a repository (or the files `--include`/`--exclude` select) at a
//! revision into the cache that `huggingface_hub` uses (`HF_HUB_CACHE`, layout in
//! [`cache`]), or into a plain folder: resumable (`Range`), checked against the hub's sha256
//! (LFS files) or git blob sha1 (regular files) before anything is put in place, a few files
//! at a time, after a free-space check. [`Hub::resolve`] turns `org/name[@revision]` into the
//! cached snapshot's folder without touching the network. `HF_ENDPOINT`, `HF_TOKEN`,
//! `HF_HOME`/`HF_HUB_CACHE` and `HF_HUB_OFFLINE` mean what they mean to `huggingface_hub`.
//!
//! This crate knows nothing of models: files in, folders out.

pub mod api;
pub mod cache;
mod config;
pub mod download;
mod error;
pub mod glob;
mod hash;
mod listing;
mod lock;
pub mod repo;
mod space;
#[cfg(feature = "testing")]
pub mod testing;
mod transfer;

use std::path::PathBuf;

pub use api::{HubClient, RepoFile, RetryPolicy};
pub use cache::RepoCache;
pub use config::{HubConfig, DEFAULT_ENDPOINT};
pub use download::{DownloadOptions, Downloaded, Event, Observer, Quiet};
pub use error::{human_bytes, ChecksumMismatch, HubError};
pub use glob::FileFilter;
pub use hash::{git_sha1_hex, sha256_hex, Checksum};
pub use repo::{ModelRef, RepoId, DEFAULT_REVISION};
pub use space::available_bytes;

/// The hub as this process's environment describes it.
pub struct Hub {
    config: HubConfig,
    client: HubClient,
}

impl Hub {
    /// A hub from `config`.
    pub fn new(config: HubConfig) -> Result<Self, HubError> {
        let client = HubClient::new(&config.endpoint, config.token.clone())?;
        Ok(Self { config, client })
    }

    /// The configuration.
    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// The client (to change its retry policy or timeouts).
    pub fn client_mut(&mut self) -> &mut HubClient {
        &mut self.client
    }

    /// Downloads `repo`. With `HF_HUB_OFFLINE` set nothing is fetched: an already cached
    /// snapshot of the revision is returned, anything else is an error.
    pub async fn download(
        &self,
        repo: &RepoId,
        options: &DownloadOptions,
        observer: &dyn Observer,
    ) -> Result<Downloaded, HubError> {
        if self.config.offline {
            if options.local_dir.is_none() {
                if let Ok(path) =
                    RepoCache::new(&options.cache_dir, repo).resolve(&options.revision)
                {
                    let commit = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    return Ok(Downloaded {
                        commit,
                        path,
                        files: 0,
                        bytes: 0,
                        fetched_files: 0,
                        fetched_bytes: 0,
                    });
                }
            }
            return Err(HubError::Offline {
                repo: repo.to_string(),
            });
        }
        download::download(&self.client, repo, options, observer).await
    }

    /// The cached snapshot folder of `model` (or the file it names inside it), offline.
    pub fn resolve(&self, model: &ModelRef) -> Result<PathBuf, HubError> {
        resolve_cached(&self.config.cache_dir, model)
    }
}

/// The snapshot folder of `model` in the cache at `cache_dir` (or the file `model` names in
/// it), without any network access.
pub fn resolve_cached(cache_dir: &std::path::Path, model: &ModelRef) -> Result<PathBuf, HubError> {
    let snapshot = RepoCache::new(cache_dir, &model.repo).resolve(&model.revision)?;
    match &model.file {
        None => Ok(snapshot),
        Some(file) => {
            let path = snapshot.join(repo::safe_relative_path(&model.repo, file)?.0);
            if path.exists() {
                Ok(path)
            } else {
                Err(HubError::EntryNotFound {
                    repo: model.repo.to_string(),
                    revision: model.revision.clone(),
                    file: format!("{file} (not in the cached snapshot {})", snapshot.display()),
                })
            }
        }
    }
}
