//! Models by name: `kimi-infer download`, and `--model org/name[@revision]` resolved through
//! the Hugging Face cache (kimi-hub does the work; this is the command line around it).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar};
use kimi_hub::{
    human_bytes, DownloadOptions, Downloaded, Event, FileFilter, Hub, HubConfig, HubError,
    ModelRef, Observer, RepoId,
};

use crate::args::DownloadArgs;

/// Files transferred at once when `--model` downloads.
const DEFAULT_WORKERS: usize = 8;

/// `kimi-infer download`: fetches the repository and prints the folder a loader opens.
pub fn download(a: DownloadArgs) -> anyhow::Result<()> {
    let repo = RepoId::parse(&a.repo_id)?;
    let mut config = HubConfig::from_env();
    if let Some(dir) = a.cache_dir {
        config.cache_dir = dir;
    }
    if let Some(token) = a.token.filter(|t| !t.is_empty()) {
        config.token = Some(token);
    }
    anyhow::ensure!(a.max_workers >= 1, "--max-workers must be at least 1");
    let mut include = a.include;
    include.extend(a.files);
    let options = DownloadOptions {
        revision: a.revision,
        filter: FileFilter::new(&include, &a.exclude),
        cache_dir: config.cache_dir.clone(),
        local_dir: a.local_dir,
        max_workers: a.max_workers,
    };
    let done = fetch(config, &repo, &options)?;
    println!("{}", done.path.display());
    Ok(())
}

/// Runs a download with progress on stderr, and says what it did.
fn fetch(
    config: HubConfig,
    repo: &RepoId,
    options: &DownloadOptions,
) -> anyhow::Result<Downloaded> {
    let hub = Hub::new(config)?;
    let endpoint = hub.config().endpoint.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .context("cannot start the download's runtime")?;
    let progress = DownloadProgress::new(repo);
    let start = Instant::now();
    let done = runtime.block_on(hub.download(repo, options, &progress));
    progress.finish();
    let done = done?;
    let short = &done.commit[..done.commit.len().min(10)];
    if done.files > 0 {
        let fetched = if done.fetched_files == 0 {
            "all were in the cache already".to_string()
        } else {
            format!(
                "fetched {} ({}) in {:.1} s",
                human_bytes(done.fetched_bytes),
                files_count(done.fetched_files),
                start.elapsed().as_secs_f64()
            )
        };
        eprintln!(
            "{repo}@{} (commit {short}) from {endpoint}: {}, {}; {fetched}",
            options.revision,
            files_count(done.files),
            human_bytes(done.bytes),
        );
    } else {
        eprintln!(
            "{repo}@{} (commit {short}): in the cache (HF_HUB_OFFLINE is set)",
            options.revision
        );
    }
    Ok(done)
}

fn files_count(n: usize) -> String {
    if n == 1 {
        "1 file".into()
    } else {
        format!("{n} files")
    }
}

/// The path `--model` means: a path that exists as given; else `org/name[@revision][/file]`
/// resolved to its snapshot in the Hugging Face cache (offline), downloaded first when
/// `download` allows it; anything else as given, for the loader to report.
pub fn resolve_model(arg: &Path, download: bool) -> anyhow::Result<PathBuf> {
    resolve_path("--model", arg, download)
}

/// [`resolve_model`] for another flag that takes a model folder (`--tokenizer`).
pub fn resolve_path(flag: &str, arg: &Path, download: bool) -> anyhow::Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let Some(model) = arg.to_str().and_then(ModelRef::parse) else {
        return Ok(arg.to_path_buf());
    };
    let config = HubConfig::from_env();
    let path = match kimi_hub::resolve_cached(&config.cache_dir, &model) {
        Ok(path) => path,
        Err(HubError::NotCached { .. }) if download && !config.offline => {
            eprintln!(
                "note: {model} is not in the cache {}; downloading it",
                config.cache_dir.display()
            );
            let options = DownloadOptions {
                revision: model.revision.clone(),
                // A named file alone; else the whole repository.
                filter: FileFilter::new(&model.file.iter().cloned().collect::<Vec<_>>(), &[]),
                cache_dir: config.cache_dir.clone(),
                local_dir: None,
                max_workers: DEFAULT_WORKERS,
            };
            fetch(config.clone(), &model.repo, &options)
                .with_context(|| format!("cannot download {model}"))?;
            kimi_hub::resolve_cached(&config.cache_dir, &model)?
        }
        Err(e @ HubError::NotCached { .. }) => {
            let how = if config.offline {
                "HF_HUB_OFFLINE is set, so nothing is downloaded"
            } else {
                "run `kimi-infer download REPO_ID` first, or add --download"
            };
            anyhow::bail!(
                "{flag} {}: no such file or folder, and {e}: {how}",
                arg.display()
            );
        }
        Err(e) => return Err(e.into()),
    };
    let chosen = pick_model_file(&path, &model)?;
    eprintln!("note: {flag} {model} is {}", chosen.display());
    Ok(chosen)
}

/// In a snapshot folder: the folder itself for a checkpoint (config.json), else its one
/// GGUF file; several GGUF files must be told apart by name.
fn pick_model_file(path: &Path, model: &ModelRef) -> anyhow::Result<PathBuf> {
    if !path.is_dir() || path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("reading {}", path.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    ggufs.sort();
    match ggufs.len() {
        0 => Ok(path.to_path_buf()),
        1 => Ok(ggufs.remove(0)),
        _ => {
            let names: Vec<String> = ggufs
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            anyhow::bail!(
                "{model} has {} GGUF files; name one, e.g. --model {}/{}  (files: {})",
                names.len(),
                model,
                names[0],
                names.join(", ")
            )
        }
    }
}

/// The repository id when `arg` names a hub model rather than a path (for the served
/// model name: `org/name`, as vLLM reports it).
pub fn repo_name(arg: &Path) -> Option<String> {
    if arg.exists() {
        return None;
    }
    arg.to_str()
        .and_then(ModelRef::parse)
        .map(|m| m.repo.to_string())
}

/// Bars on a terminal (the whole download, and one per file in flight); elsewhere one line
/// per finished file.
struct DownloadProgress {
    repo: String,
    bars: Option<Bars>,
    /// Sizes of the files in flight, for the lines off a terminal.
    sizes: Mutex<std::collections::HashMap<String, u64>>,
}

struct Bars {
    multi: MultiProgress,
    total: ProgressBar,
    files: Mutex<std::collections::HashMap<String, ProgressBar>>,
}

impl DownloadProgress {
    fn new(repo: &RepoId) -> Self {
        let bars = std::io::stderr().is_terminal().then(|| {
            let multi = MultiProgress::new();
            let total = multi.add(ProgressBar::new(0).with_style(crate::progress::bytes_style()));
            total.set_message(repo.to_string());
            Bars {
                multi,
                total,
                files: Mutex::new(Default::default()),
            }
        });
        Self {
            repo: repo.to_string(),
            bars,
            sizes: Mutex::new(Default::default()),
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bars {
            b.total.finish_and_clear();
            let _ = b.multi.clear();
        }
    }
}

impl Observer for DownloadProgress {
    fn event(&self, event: Event<'_>) {
        match (&self.bars, event) {
            (Some(b), Event::Planned { fetch_bytes, .. }) => b.total.set_length(fetch_bytes),
            (
                Some(b),
                Event::FileStarted {
                    path,
                    size,
                    resumed_from,
                },
            ) => {
                let bar = ProgressBar::new(size)
                    .with_style(crate::progress::bytes_style())
                    .with_message(path.to_string())
                    .with_position(resumed_from);
                let bar = b.multi.add(bar);
                b.files
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(path.to_string(), bar);
            }
            (Some(b), Event::Progress { path, bytes }) => {
                b.total.inc(bytes);
                if let Some(bar) = b.files.lock().unwrap_or_else(|e| e.into_inner()).get(path) {
                    bar.inc(bytes);
                }
            }
            (Some(b), Event::Rewound { path, bytes }) => {
                b.total
                    .set_position(b.total.position().saturating_sub(bytes));
                if let Some(bar) = b.files.lock().unwrap_or_else(|e| e.into_inner()).get(path) {
                    bar.set_position(0);
                }
            }
            (Some(b), Event::FileDone { path }) => {
                if let Some(bar) = b
                    .files
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(path)
                {
                    bar.finish_and_clear();
                    b.multi.remove(&bar);
                }
            }
            (
                None,
                Event::Planned {
                    files,
                    bytes,
                    fetch_files,
                    fetch_bytes,
                },
            ) => {
                eprintln!(
                    "{}: {} ({}), {fetch_files} to fetch ({})",
                    self.repo,
                    files_count(files),
                    human_bytes(bytes),
                    human_bytes(fetch_bytes)
                );
            }
            (None, Event::FileStarted { path, size, .. }) => {
                self.sizes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(path.to_string(), size);
            }
            (None, Event::FileDone { path }) => {
                let size = self
                    .sizes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(path)
                    .unwrap_or(0);
                eprintln!("  {path}  {}  verified", human_bytes(size));
            }
            // Retries are logged as warnings by the library.
            _ => {}
        }
    }
}
