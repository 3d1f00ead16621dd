//! A model split over rank processes (`--distributed-executor-backend mp`, or ranks a
//! torchrun-style launcher starts with RANK/WORLD_SIZE), on the CPU backend: the same bits
//! as the ranks as threads; a rank that never comes, or dies, ends the job with its rank
//! named and never hangs; signals reach rank 0 through the launcher.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use support::{free_port, start, strings, Proc};

/// The binary without a launcher's variables (a test sets its own).
fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kimi-infer"));
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(v);
    }
    c
}

fn k3() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l")
}

/// The variables a torchrun-style launcher gives rank `rank` of two, meeting on `port`.
fn launched_as(rank: &str, port: &str) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn kimi_linear() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-linear/native-f32-short")
}

/// `kimi-infer logits` of the K3 fixture with `extra` flags, as raw `.npy` bytes.
fn logits(extra: &[&str], env: &[(&str, String)]) -> (Vec<u8>, String) {
    logits_of(&k3(), extra, env)
}

/// `kimi-infer logits` of `model` with `extra` flags, as raw `.npy` bytes.
fn logits_of(model: &Path, extra: &[&str], env: &[(&str, String)]) -> (Vec<u8>, String) {
    let out = tempfile::tempdir().unwrap();
    let path = out.path().join("l.npy");
    let o = bin()
        .args(["logits", "--model", model.to_str().unwrap()])
        .args(["--ids", "1,5,9,2,7,3,11", "--step", "3"])
        .args(["--out", path.to_str().unwrap()])
        .args(extra)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("binary runs");
    assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
    (std::fs::read(&path).unwrap(), stderr(&o))
}

#[test]
fn ranks_as_processes_give_the_bits_of_ranks_as_threads() {
    for (model, split) in [k3(), kimi_linear()].into_iter().flat_map(|m| {
        [
            &["-t", "2"][..],
            &["-t", "2", "--enable-expert-parallel"][..],
            &[
                "-t",
                "2",
                "--enable-expert-parallel",
                "--expert-dispatch",
                "all-to-all",
            ][..],
        ]
        .map(|s| (m.clone(), s))
    }) {
        let logits = |extra: &[&str]| logits_of(&model, extra, &[]);
        let (threads, _) = logits(split);
        let port = free_port().to_string();
        let mp = [
            split,
            &[
                "--distributed-executor-backend",
                "mp",
                "--master-port",
                &port,
            ],
        ]
        .concat();
        let (processes, log) = logits(&mp);
        let name = model.file_name().unwrap_or_default().to_string_lossy();
        assert!(
            log.contains("starting ranks 0..2 of 2 as processes"),
            "{name} {split:?}: {log}"
        );
        assert!(threads == processes, "{name} {split:?}: the logits differ");
    }
    // Started by a launcher of another kind (RANK and WORLD_SIZE per process, as torchrun
    // sets them): rank 1 by hand here, rank 0 runs the command.
    let port = free_port().to_string();
    let env = |rank: &str| launched_as(rank, &port);
    let mut rank1 = bin()
        .args(["logits", "--model", k3().to_str().unwrap()])
        .args(["--ids", "1", "--out", "/nonexistent/unused.npy", "-t", "2"])
        .envs(env("1"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("rank 1 starts");
    let (lead, log) = logits(&["-t", "2"], &env("0"));
    let (threads, _) = logits(&["-t", "2"], &[]);
    assert!(
        lead == threads,
        "torchrun-style ranks: the logits differ: {log}"
    );
    let status = wait(&mut rank1, Duration::from_secs(30)).expect("rank 1 ends with rank 0");
    assert!(status.success(), "rank 1: {status}");
}

#[test]
fn a_rank_that_never_comes_is_named_within_the_timeout() {
    let port = free_port().to_string();
    let start = Instant::now();
    let o = bin()
        .args(["logits", "--model", k3().to_str().unwrap()])
        .args(["--ids", "1,2", "--out", "/tmp/unused.npy", "-t", "2"])
        .args(["--collective-timeout", "2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", &port)
        .output()
        .expect("binary runs");
    assert!(!o.status.success());
    assert!(start.elapsed() < Duration::from_secs(30));
    let e = stderr(&o);
    assert!(
        e.contains("rank(s) 1 did not arrive at the rendezvous within 2s"),
        "{e}"
    );
    // Threads refuse what asks for processes, naming both.
    let o = bin()
        .args(["logits", "--model", k3().to_str().unwrap()])
        .args(["--ids", "1,2", "--out", "/tmp/unused.npy", "-t", "2"])
        .args(["--distributed-executor-backend", "threads"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .expect("binary runs");
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("threads") && e.contains("RANK"),
        "{e}"
    );
}

/// Waits for `child` to end, at most `limit`.
fn wait(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `serve` of the K3 fixture with `extra` flags and `env`, once it is up.
fn serve(extra: &[&str], env: &[(&str, String)]) -> Proc {
    let k3 = k3();
    let args = [
        &["serve", "--port", "0", "--served-model-name", "m"][..],
        &["--model", k3.to_str().unwrap()],
        extra,
    ]
    .concat();
    Proc::spawn_with(&strings(&args), env, "serving `")
}

/// A greedy completion's status and body.
fn complete(server: &Proc) -> (u16, String) {
    let body =
        r#"{"model":"m","prompt":[1,5,9,2,7],"max_tokens":8,"temperature":0,"ignore_eos":true}"#;
    http(server, "POST /v1/completions", body)
}

/// The completion's text in a response body.
fn text(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).expect("json");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

/// One HTTP/1.1 request (`request`: method and path) with a JSON `body`: status and body.
fn http(server: &Proc, request: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "{request} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut response = String::new();
    let _ = s.read_to_string(&mut response);
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// The rank processes a launcher started, by rank.
fn ranks_of(launcher: &Proc) -> Vec<(usize, u32)> {
    let pid = launcher.child.id();
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .filter_map(|c| {
            let env = std::fs::read(format!("/proc/{c}/environ")).ok()?;
            let rank = env
                .split(|&b| b == 0)
                .find_map(|v| v.strip_prefix(b"RANK="))
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())?;
            Some((rank, c))
        })
        .collect()
}

#[test]
fn served_by_rank_processes_the_answer_is_that_of_one_process_and_sigterm_drains() {
    let one = serve(&[], &[]);
    let (status, want) = complete(&one);
    assert_eq!(status, 200, "{want}");
    let port = free_port().to_string();
    let mut mp = serve(
        &["-t", "2", "--distributed-executor-backend", "mp"],
        &[("MASTER_PORT", port)],
    );
    let (status, got) = complete(&mp);
    assert_eq!(status, 200, "{got}\n{}", mp.log());
    assert_eq!(text(&got), text(&want));
    let ranks = ranks_of(&mp);
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    // SIGTERM to the launcher: rank 0 drains and ends the job; every process ends well.
    mp.signal("TERM");
    let status = wait(&mut mp.child, Duration::from_secs(60)).expect("the launcher ends");
    assert!(status.success(), "{status}: {}", mp.log());
    assert!(
        mp.log_with(&["shutting down"]).contains("shutting down"),
        "{}",
        mp.log()
    );
    for (rank, pid) in ranks {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "rank {rank} still runs"
        );
    }
}

#[test]
fn a_dead_rank_ends_the_job_naming_it() {
    // Our launcher: it sees rank 1 die, stops rank 0 and names rank 1.
    let port = free_port().to_string();
    let mut mp = serve(
        &["-t", "2", "--distributed-executor-backend", "mp"],
        &[("MASTER_PORT", port)],
    );
    let ranks = ranks_of(&mp);
    let rank1 = ranks.iter().find(|(r, _)| *r == 1).expect("rank 1").1;
    let killed = Command::new("kill")
        .args(["-KILL", &rank1.to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let status = wait(&mut mp.child, Duration::from_secs(30)).expect("the launcher ends");
    assert!(!status.success());
    let log = mp.log_with(&["rank 1 ended with signal: 9"]);
    assert!(log.contains("rank 1 ended with signal: 9"), "{log}");
    // Ranks of another launcher: rank 0 finds rank 1 gone at its next step, answers that
    // request with the reason, and ends.
    let port = free_port().to_string();
    let env = |rank: &str| launched_as(rank, &port);
    let k3 = k3();
    let rank1_args = ["serve", "--model", k3.to_str().unwrap(), "-t", "2"];
    let mut rank1 = start(&strings(&rank1_args), &env("1"));
    let mut rank0 = serve(&["-t", "2"], &env("0"));
    let _ = rank1.kill();
    let _ = rank1.wait();
    let (status, body) = complete(&rank0);
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("rank 1's process ended"), "{body}");
    let status = wait(&mut rank0.child, Duration::from_secs(30)).expect("rank 0 ends");
    assert!(!status.success());
    let says = "error: the model failed for good: rank 0: backend: collective aborted";
    let log = rank0.log_with(&[says]);
    assert!(log.contains(says), "{log}");
}

/// `serve --enable-eplb` over rank processes: the routed experts move between the ranks
/// while serving (said in the log, counted in `/metrics`), and the answers stay those of
/// one process. Without expert parallelism over ranks the flag is refused, naming why.
#[test]
fn served_with_eplb_the_experts_move_between_ranks_and_the_answer_stays() {
    let one = serve(&[], &[]);
    let (_, want) = complete(&one);
    let port = free_port().to_string();
    let mp = serve(
        &[
            "-t",
            "2",
            "--enable-expert-parallel",
            "--distributed-executor-backend",
            "mp",
            "--enable-eplb",
            "--eplb-step-interval",
            "2",
            "--eplb-min-gain",
            "0",
        ],
        &[("MASTER_PORT", port)],
    );
    for _ in 0..2 {
        let (status, got) = complete(&mp);
        assert_eq!(status, 200, "{got}\n{}", mp.log());
        assert_eq!(text(&got), text(&want), "{}", mp.log());
    }
    let log = mp.log_with(&["routed experts between ranks"]);
    assert!(log.contains("routed experts between ranks"), "{log}");
    let (status, metrics) = http(&mp, "GET /metrics", "");
    assert_eq!(status, 200);
    let series = |name: &str| support::metric(&metrics, &format!("{name}{{model_name=\"m\"}}"));
    assert!(
        series("kimi:moe_experts_moved_total").is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert!(series("kimi:moe_expert_rebalances_total").is_some_and(|n| n >= 1.0));
    assert!(series("kimi:moe_expert_imbalance").is_some_and(|x| x >= 1.0));

    let k3 = k3();
    let refused = bin()
        .args(["serve", "--model", k3.to_str().unwrap(), "--port", "0"])
        .arg("--enable-eplb")
        .output()
        .expect("binary runs");
    assert!(!refused.status.success());
    let e = stderr(&refused);
    assert!(e.contains("--enable-expert-parallel"), "{e}");
}
