//! Models by name, end to end: `kimi-infer download` from a local server speaking the hub's
//! API (kimi_hub::testing::LocalHub) and `--model org/name` resolved through the cache;
//! and the official `huggingface_hub` (pinned, in target/hub-venv: scripts/setup_hub_venv.sh)
//! reading our cache and writing one we load.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kimi_hub::testing::{Faults, HostedRepo, LocalHub};

const REPO: &str = "kimi-test/demo-model";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The demo checkpoint and its tokenizer as a hub repository (weights in LFS).
fn demo_repo() -> HostedRepo {
    let read = |p: &str| std::fs::read(workspace().join(p)).unwrap();
    HostedRepo::new(REPO)
        .file("config.json", read("assets/demo-model/config.json"))
        .lfs_file(
            "model.safetensors",
            read("assets/demo-model/model.safetensors"),
        )
        .file(
            "tiktoken.model",
            read("assets/demo-tokenizer/tiktoken.model"),
        )
        .file(
            "tokenizer_config.json",
            read("assets/demo-tokenizer/tokenizer_config.json"),
        )
        .file(
            "chat_template.jinja",
            read("assets/demo-tokenizer/chat_template.jinja"),
        )
        .file("README.md", b"# demo\n".to_vec())
}

/// The binary with a hub environment of its own: endpoint, cache, no token.
fn bin(hub: &LocalHub, cache: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kimi-infer"));
    c.env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HUGGING_FACE_HUB_TOKEN");
    c
}

fn run(mut c: Command) -> Output {
    c.output().expect("kimi-infer runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn download_then_run_by_name() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["download", REPO]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    let snapshot = PathBuf::from(text(&out.stdout).trim());
    let commit = demo_repo().commit();
    assert_eq!(
        snapshot,
        cache
            .path()
            .join("models--kimi-test--demo-model/snapshots")
            .join(&commit)
    );
    assert!(
        text(&out.stderr).contains("6 files"),
        "{}",
        text(&out.stderr)
    );

    // Offline, by name: inspect and run load the cached snapshot.
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.env("HF_HUB_OFFLINE", "1")
            .args(["inspect", "--json", "--model", REPO]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("kimi_linear"),
        "{}",
        text(&out.stdout)
    );
    assert!(text(&out.stderr).contains(&commit), "{}", text(&out.stderr));
    hub.clear_log();
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.env("HF_HUB_OFFLINE", "1").args([
            "run",
            "--model",
            &format!("{REPO}@main"),
            "-p",
            "hello",
            "--max-tokens",
            "3",
        ]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(hub.log().is_empty(), "resolution went to the network");

    // A selective download of another revision name is refused by name.
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["download", REPO, "--revision", "v9", "--include", "*.json"]);
        c
    });
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("revision `v9` not found"), "{err}");
    assert_eq!(err.matches("error:").count(), 1, "{err}");
}

#[test]
fn an_uncached_name_says_how_to_get_it_and_download_opts_in() {
    let hub = LocalHub::start(vec![demo_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["inspect", "--model", REPO]);
        c
    });
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("kimi-infer download") && err.contains(REPO),
        "{err}"
    );
    assert!(
        hub.log().is_empty(),
        "resolution without --download went to the network"
    );

    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["inspect", "--model", REPO, "--download"]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("kimi_linear") || text(&out.stdout).contains("Kimi"));

    // A path that does not exist and is no repository name is reported as a path.
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["inspect", "--model", "no/such/dir/model.gguf"]);
        c
    });
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_corrupted_download_fails_and_leaves_nothing_to_load() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        corruptions: 100,
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["download", REPO]);
        c
    });
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("model.safetensors") && err.contains("corrupted"),
        "{err}"
    );
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["inspect", "--model", REPO]);
        c
    });
    assert_eq!(out.status.code(), Some(1), "a corrupted snapshot resolved");
}

/// The pinned `huggingface_hub`'s Python (target/hub-venv, or KIMI_HUB_PYTHON), or `None`
/// when scripts/setup_hub_venv.sh could not install it because PyPI was unreachable: the
/// test is then skipped with a warning (the script fails on any other problem).
fn hf_python() -> Option<PathBuf> {
    let python = std::env::var_os("KIMI_HUB_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/hub-venv/bin/python"));
    let works = Command::new(&python)
        .args(["-c", "import huggingface_hub"])
        .output()
        .is_ok_and(|o| o.status.success());
    if works {
        return Some(python);
    }
    eprintln!(
        "WARNING: huggingface_hub is not installed in {} (scripts/setup_hub_venv.sh): the \
         compatibility test with it is skipped",
        python.display()
    );
    None
}

fn hf(python: &Path, hub: &LocalHub, args: &[&str]) -> serde_json::Value {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(python)
        .arg(workspace().join("tests/hub/hf_compat.py"))
        .args(args)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", home.path())
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "hf_compat.py {args:?}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    serde_json::from_str(text(&out.stdout).trim().lines().last().unwrap_or("")).unwrap()
}

#[test]
fn huggingface_hub_and_kimi_infer_share_the_cache() {
    let Some(python) = hf_python() else { return };
    let hub = LocalHub::start(vec![demo_repo()]);

    // huggingface_hub downloads; kimi-infer finds and loads it, offline.
    let theirs = tempfile::tempdir().unwrap();
    let got = hf(
        &python,
        &hub,
        &["fetch", theirs.path().to_str().unwrap(), REPO],
    );
    eprintln!("huggingface_hub {}", got["version"]);
    let out = run({
        let mut c = bin(&hub, theirs.path());
        c.env("HF_HUB_OFFLINE", "1").args([
            "run",
            "--model",
            REPO,
            "-p",
            "hello",
            "--max-tokens",
            "3",
        ]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(got["path"].as_str().unwrap()),
        "{}",
        text(&out.stderr)
    );

    // kimi-infer downloads; huggingface_hub finds every file offline, and its checksum
    // verification agrees with the hub's listing.
    let ours = tempfile::tempdir().unwrap();
    let out = run({
        let mut c = bin(&hub, ours.path());
        c.args(["download", REPO]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    let snapshot = text(&out.stdout).trim().to_string();
    let found = hf(
        &python,
        &hub,
        &["find", ours.path().to_str().unwrap(), REPO],
    );
    assert_eq!(
        found["snapshot"].as_str(),
        Some(snapshot.as_str()),
        "{found}"
    );
    assert_eq!(
        found["config"].as_str(),
        Some(format!("{snapshot}/config.json").as_str())
    );
    assert_eq!(
        found["weights"].as_str(),
        Some(format!("{snapshot}/model.safetensors").as_str())
    );
    assert_eq!(
        found["config_text"].as_str().unwrap().as_bytes(),
        std::fs::read(workspace().join("assets/demo-model/config.json")).unwrap()
    );
    assert_eq!(found["checked"], 6, "{found}");
    assert_eq!(found["mismatches"], serde_json::json!([]), "{found}");
    assert_eq!(found["missing"], serde_json::json!([]), "{found}");
    assert_eq!(found["scan_warnings"], serde_json::json!([]), "{found}");
    assert_eq!(found["scan_repos"][0][0], REPO, "{found}");
    assert_eq!(found["scan_repos"][0][1], 6, "{found}");

    // Online, huggingface_hub reuses our blobs and transfers no file.
    hub.clear_log();
    hf(
        &python,
        &hub,
        &["refresh", ours.path().to_str().unwrap(), REPO],
    );
    let bodies: Vec<_> = hub
        .log()
        .into_iter()
        .filter(|l| l.method == "GET" && (l.server == "cdn" || l.uri.contains("/resolve/")))
        .collect();
    assert!(bodies.is_empty(), "{bodies:?}");

    // Same for a --local-dir download: its metadata is huggingface_hub's.
    let local = tempfile::tempdir().unwrap();
    let out = run({
        let mut c = bin(&hub, ours.path());
        c.args([
            "download",
            REPO,
            "--local-dir",
            local.path().to_str().unwrap(),
        ]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    hub.clear_log();
    hf(
        &python,
        &hub,
        &["local-dir", local.path().to_str().unwrap(), REPO],
    );
    let bodies: Vec<_> = hub
        .log()
        .into_iter()
        .filter(|l| l.method == "GET" && (l.server == "cdn" || l.uri.contains("/resolve/")))
        .collect();
    assert!(bodies.is_empty(), "{bodies:?}");
}

#[test]
fn a_killed_download_resumes_where_it_stopped() {
    let hub = LocalHub::start(vec![demo_repo()]);
    hub.set_faults(Faults {
        only: Some("model.safetensors".into()),
        chunk_delay: Some(std::time::Duration::from_millis(40)),
        ..Faults::default()
    });
    let cache = tempfile::tempdir().unwrap();
    let weights = std::fs::read(workspace().join("assets/demo-model/model.safetensors")).unwrap();
    let partial = cache
        .path()
        .join("models--kimi-test--demo-model/blobs")
        .join(format!("{}.incomplete", kimi_hub::sha256_hex(&weights)));
    let mut child = bin(&hub, cache.path())
        .args(["download", REPO])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while std::fs::metadata(&partial).map_or(0, |m| m.len()) < 200_000 {
        assert!(
            start.elapsed().as_secs() < 60,
            "the download never got going"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept < weights.len() as u64);

    hub.set_faults(Faults::default());
    hub.clear_log();
    let out = run({
        let mut c = bin(&hub, cache.path());
        c.args(["download", REPO]);
        c
    });
    assert!(out.status.success(), "{}", text(&out.stderr));
    let snapshot = PathBuf::from(text(&out.stdout).trim());
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        weights
    );
    let ranges: Vec<_> = hub
        .log()
        .into_iter()
        .filter(|l| l.server == "cdn")
        .map(|l| l.range)
        .collect();
    assert_eq!(ranges, vec![Some(format!("bytes={kept}-"))]);
    assert!(!partial.exists());
}
