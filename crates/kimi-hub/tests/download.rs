//! Downloads from a local server speaking the hub's API (`kimi_hub::testing::LocalHub`):
//! the cache layout, checksums, resumed, stalled, slow and corrupted transfers, gated
//! repositories, mirrors without a tree API, `--local-dir`, and the free-space check.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kimi_hub::testing::{Faults, HostedRepo, LocalHub};
use kimi_hub::{
    download::download, resolve_cached, sha256_hex, DownloadOptions, Event, FileFilter, HubClient,
    HubError, ModelRef, Quiet, RepoCache, RepoId, RetryPolicy,
};

/// Deterministic bytes that do not compress or repeat.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

const WEIGHTS_LEN: usize = 300_000;

fn demo_repo() -> HostedRepo {
    HostedRepo::new("kimi-test/tiny")
        .file("config.json", br#"{"model_type":"tiny"}"#.to_vec())
        .file("sub/tokenizer_config.json", br#"{"bos":"<s>"}"#.to_vec())
        .lfs_file("model.safetensors", noise(WEIGHTS_LEN, 1))
        .lfs_file("copy/model.safetensors", noise(WEIGHTS_LEN, 1))
        .lfs_file("extra.bin", noise(70_000, 2))
}

fn client(hub: &LocalHub) -> HubClient {
    HubClient::new(&hub.endpoint, None)
        .unwrap()
        .with_retry(fast_retry())
        .with_idle_timeout(Duration::from_secs(10))
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        attempts: 5,
        first_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(50),
    }
}

fn options(cache: &Path) -> DownloadOptions {
    DownloadOptions {
        revision: "main".into(),
        filter: FileFilter::default(),
        cache_dir: cache.to_path_buf(),
        local_dir: None,
        max_workers: 4,
    }
}

fn repo_id() -> RepoId {
    RepoId::parse("kimi-test/tiny").unwrap()
}

fn file_requests(hub: &LocalHub) -> Vec<kimi_hub::testing::Logged> {
    hub.log()
        .into_iter()
        .filter(|l| l.method == "GET" && (l.server == "cdn" || l.uri.contains("/resolve/")))
        .collect()
}

/// Every path under `dir`, relative.
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_into_the_hub_cache_layout() {
    let repo = demo_repo();
    let commit = repo.commit();
    let hub = LocalHub::start(vec![repo]);
    hub.set_faults(Faults {
        page_size: Some(2),
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let progressed = AtomicU64::new(0);
    let observer = |e: Event<'_>| {
        if let Event::Progress { bytes, .. } = e {
            progressed.fetch_add(bytes, Ordering::Relaxed);
        }
    };
    let done = download(&client(&hub), &repo_id(), &options(cache.path()), &observer)
        .await
        .unwrap();
    assert_eq!(done.commit, commit);
    assert_eq!(done.files, 5);
    // The two copies of the weights share one blob, fetched once.
    assert_eq!(done.fetched_files, 4);
    let unique = (WEIGHTS_LEN + 70_000 + 21 + 13) as u64;
    assert_eq!(done.fetched_bytes, unique);
    assert_eq!(progressed.load(Ordering::Relaxed), unique);

    let root = cache.path().join("models--kimi-test--tiny");
    assert_eq!(done.path, root.join("snapshots").join(&commit));
    assert_eq!(
        std::fs::read_to_string(root.join("refs/main")).unwrap(),
        commit
    );
    let weights = noise(WEIGHTS_LEN, 1);
    let sha = sha256_hex(&weights);
    let snap = root.join("snapshots").join(&commit);
    assert_eq!(
        std::fs::read_link(snap.join("model.safetensors")).unwrap(),
        PathBuf::from(format!("../../blobs/{sha}"))
    );
    assert_eq!(
        std::fs::read_link(snap.join("copy/model.safetensors")).unwrap(),
        PathBuf::from(format!("../../../blobs/{sha}"))
    );
    assert_eq!(
        std::fs::read(snap.join("model.safetensors")).unwrap(),
        weights
    );
    // Regular files are named by their git blob id.
    let config_link = std::fs::read_link(snap.join("config.json")).unwrap();
    assert_eq!(
        config_link,
        PathBuf::from(format!(
            "../../blobs/{}",
            kimi_hub::git_sha1_hex(br#"{"model_type":"tiny"}"#)
        ))
    );
    assert!(root.join(format!("trees/{commit}.json")).is_file());
    assert!(
        !tree(&root).iter().any(|p| p.ends_with(".incomplete")),
        "{:?}",
        tree(&root)
    );
    // The tree listing was read page by page.
    assert!(hub.log().iter().any(|l| l.uri.contains("cursor=")));

    // Offline resolution finds it by name, with or without a revision or a file.
    let resolved = resolve_cached(cache.path(), &ModelRef::parse("kimi-test/tiny").unwrap());
    assert_eq!(resolved.unwrap(), snap);
    let by_commit = ModelRef::parse(&format!("kimi-test/tiny@{commit}/config.json")).unwrap();
    assert_eq!(
        resolve_cached(cache.path(), &by_commit).unwrap(),
        snap.join("config.json")
    );
    assert!(matches!(
        resolve_cached(cache.path(), &ModelRef::parse("kimi-test/tiny@v9").unwrap()),
        Err(HubError::NotCached { .. })
    ));

    // A second download finds every blob and transfers nothing.
    hub.clear_log();
    let again = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert_eq!(again.fetched_files, 0);
    assert!(file_requests(&hub).is_empty(), "{:?}", file_requests(&hub));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_and_exclude_select_files() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let mut opts = options(cache.path());
    opts.filter = FileFilter::new(&["*.json".into()], &["sub/".into()]);
    let done = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    assert_eq!(done.files, 1);
    assert_eq!(tree(&done.path), vec!["config.json"]);
    assert!(file_requests(&hub)
        .iter()
        .all(|l| l.uri.contains("config.json")));

    opts.filter = FileFilter::new(&["*.gguf".into()], &[]);
    let err = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap_err();
    assert!(matches!(err, HubError::NothingMatches { .. }), "{err}");
    assert!(err.to_string().contains("*.gguf"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_transfers_resume_with_range_requests() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        cut_after: Some(100_000),
        cuts: 2,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let done = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    let weights = std::fs::read(done.path.join("model.safetensors")).unwrap();
    assert_eq!(weights, noise(WEIGHTS_LEN, 1));
    let ranges: Vec<_> = hub
        .log()
        .into_iter()
        .filter(|l| l.server == "cdn" && l.uri.contains(&sha256_hex(&weights)))
        .map(|l| l.range)
        .collect();
    assert_eq!(
        ranges,
        vec![
            None,
            Some("bytes=100000-".to_string()),
            Some("bytes=200000-".to_string())
        ]
    );
    // Nothing was transferred twice.
    assert_eq!(done.fetched_bytes, (WEIGHTS_LEN + 70_000 + 21 + 13) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_file_left_by_an_earlier_run_is_resumed() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let weights = noise(WEIGHTS_LEN, 1);
    let sha = sha256_hex(&weights);
    let rc = RepoCache::new(cache.path(), &repo_id());
    rc.prepare().unwrap();
    std::fs::write(rc.incomplete_path(&sha), &weights[..123_456]).unwrap();
    let mut opts = options(cache.path());
    opts.filter = FileFilter::new(&["model.safetensors".into()], &[]);
    let done = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    assert_eq!(done.fetched_bytes, (WEIGHTS_LEN - 123_456) as u64);
    assert_eq!(
        std::fs::read(done.path.join("model.safetensors")).unwrap(),
        weights
    );
    let cdn: Vec<_> = hub
        .log()
        .into_iter()
        .filter(|l| l.server == "cdn")
        .collect();
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].range.as_deref(), Some("bytes=123456-"));
    assert!(!rc.incomplete_path(&sha).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_transfers_are_cut_and_resumed() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        stall_after: Some(50_000),
        stall_for: Duration::from_secs(30),
        stalls: 1,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let client = client(&hub).with_idle_timeout(Duration::from_millis(300));
    let start = Instant::now();
    let done = download(&client, &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        std::fs::read(done.path.join("model.safetensors")).unwrap(),
        noise(WEIGHTS_LEN, 1)
    );
    assert!(hub
        .log()
        .iter()
        .any(|l| l.server == "cdn" && l.range.as_deref() == Some("bytes=50000-")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_transfers_complete() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        chunk_delay: Some(Duration::from_millis(15)),
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    // Slower than the link but never idle for the timeout: no retries.
    let client = client(&hub).with_idle_timeout(Duration::from_millis(500));
    let done = download(&client, &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert_eq!(done.fetched_files, 4);
    assert!(hub.log().iter().all(|l| l.range.is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_files_never_reach_the_snapshot() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        corruptions: 100,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let err = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap_err();
    let HubError::ChecksumMismatch(ref mismatch) = err else {
        panic!("{err}")
    };
    assert_eq!(
        (mismatch.file.as_str(), mismatch.algorithm),
        ("model.safetensors", "sha256")
    );
    let text = err.to_string();
    assert!(
        text.contains("kimi-test/tiny") && text.contains("corrupted"),
        "{text}"
    );
    let root = cache.path().join("models--kimi-test--tiny");
    let files = tree(&root);
    let sha = sha256_hex(&noise(WEIGHTS_LEN, 1));
    assert!(!files.iter().any(|p| p.contains(&sha)), "{files:?}");
    assert!(
        !files
            .iter()
            .any(|p| p.starts_with("snapshots/") && p.ends_with("model.safetensors")),
        "{files:?}"
    );
    assert!(!root.join("refs/main").exists());
    assert!(resolve_cached(cache.path(), &ModelRef::parse("kimi-test/tiny").unwrap()).is_err());

    // One corrupted transfer is fetched again and the download succeeds.
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        corruptions: 1,
        ..Faults::default()
    });
    let done = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(done.path.join("model.safetensors")).unwrap(),
        noise(WEIGHTS_LEN, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regular_files_are_checked_against_their_git_blob_id() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("config.json".into()),
        corruptions: 100,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let err = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HubError::ChecksumMismatch(m) if m.algorithm == "git blob sha1"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_range_is_restarted_cleanly() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        ignore_range: true,
        cut_after: Some(100_000),
        cuts: 1,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let done = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(done.path.join("model.safetensors")).unwrap(),
        noise(WEIGHTS_LEN, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_servers_are_retried() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        unavailable: 3,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    // With the retries spent, the status is reported.
    hub.set_faults(Faults {
        unavailable: 1000,
        ..Faults::default()
    });
    let other = tempfile::tempdir().unwrap();
    let err = download(&client(&hub), &repo_id(), &options(other.path()), &Quiet)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("503"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gated_repositories_need_the_token_and_it_stays_on_the_hub() {
    let hub = LocalHub::start(vec![demo_repo().gated("hf_secret")]);
    let cache = tempfile::tempdir().unwrap();
    let err = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, HubError::AccessDenied { status: 401, .. }),
        "{text}"
    );
    assert!(
        text.contains("gated") && text.contains("HF_TOKEN"),
        "{text}"
    );

    let with_token = HubClient::new(&hub.endpoint, Some("hf_wrong".into()))
        .unwrap()
        .with_retry(fast_retry());
    let err = download(&with_token, &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not been granted access"), "{err}");

    hub.clear_log();
    let with_token = HubClient::new(&hub.endpoint, Some("hf_secret".into()))
        .unwrap()
        .with_retry(fast_retry());
    download(&with_token, &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    let log = hub.log();
    // (A request of the refused download may still land after the log was cleared.)
    assert!(log.iter().filter(|l| l.server == "hub").all(|l| l
        .authorization
        .as_deref()
        .is_some_and(|a| a.starts_with("Bearer hf_"))));
    let cdn: Vec<_> = log.iter().filter(|l| l.server == "cdn").collect();
    assert!(!cdn.is_empty());
    assert!(cdn.iter().all(|l| l.authorization.is_none()), "{cdn:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_names_are_reported_by_name() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let err = download(
        &client(&hub),
        &RepoId::parse("kimi-test/nope").unwrap(),
        &options(cache.path()),
        &Quiet,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, HubError::RepoNotFound { .. }), "{err}");
    assert!(err.to_string().contains("kimi-test/nope"), "{err}");
    let mut opts = options(cache.path());
    opts.revision = "v2".into();
    let err = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap_err();
    assert!(matches!(err, HubError::RevisionNotFound { .. }), "{err}");
    assert!(err.to_string().contains("`v2`"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_without_the_tree_api_is_asked_file_by_file() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        no_tree_api: true,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let done = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap();
    assert_eq!(done.files, 5);
    let sha = sha256_hex(&noise(WEIGHTS_LEN, 1));
    assert_eq!(
        std::fs::read_link(done.path.join("model.safetensors")).unwrap(),
        PathBuf::from(format!("../../blobs/{sha}"))
    );
    assert!(hub.log().iter().any(|l| l.method == "HEAD"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_dir_downloads_are_plain_files_with_metadata() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let local = tempfile::tempdir().unwrap();
    let mut opts = options(cache.path());
    opts.local_dir = Some(local.path().to_path_buf());
    let done = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    assert_eq!(done.path, local.path());
    let weights = local.path().join("copy/model.safetensors");
    assert!(!weights.is_symlink());
    assert_eq!(std::fs::read(&weights).unwrap(), noise(WEIGHTS_LEN, 1));
    let meta = std::fs::read_to_string(
        local
            .path()
            .join(".cache/huggingface/download/model.safetensors.metadata"),
    )
    .unwrap();
    let lines: Vec<_> = meta.lines().collect();
    assert_eq!(lines[0], done.commit);
    assert_eq!(lines[1], sha256_hex(&noise(WEIGHTS_LEN, 1)));
    assert!(std::fs::read_dir(cache.path()).unwrap().next().is_none());

    // Again: nothing to transfer; and a file replaced by hand is fetched anew.
    hub.clear_log();
    std::fs::write(local.path().join("extra.bin"), b"edited").unwrap();
    let again = download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    assert_eq!(again.fetched_files, 1);
    assert_eq!(
        std::fs::read(local.path().join("extra.bin")).unwrap(),
        noise(70_000, 2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_larger_than_the_disk_is_refused_before_it_starts() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        listed_size: Some(1 << 60),
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let err = download(&client(&hub), &repo_id(), &options(cache.path()), &Quiet)
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, HubError::NoSpace { .. }), "{text}");
    assert!(text.contains("models--kimi-test--tiny/blobs"), "{text}");
    assert!(text.contains("short by"), "{text}");
    assert!(file_requests(&hub).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_transferred_a_few_at_a_time() {
    let hub = LocalHub::start(vec![demo_repo()]);
    // Slow enough that transfers overlap when they may.
    hub.set_faults(Faults {
        chunk_delay: Some(Duration::from_millis(20)),
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let mut opts = options(cache.path());
    opts.max_workers = 1;
    download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    assert_eq!(hub.most_concurrent_transfers(), 1);

    hub.clear_log();
    let cache = tempfile::tempdir().unwrap();
    let mut opts = options(cache.path());
    opts.max_workers = 3;
    download(&client(&hub), &repo_id(), &opts, &Quiet)
        .await
        .unwrap();
    let most = hub.most_concurrent_transfers();
    assert!((2..=3).contains(&most), "{most} transfers at once");
}
