//! Black-box tests of the `kimi-infer` binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kimi-infer"));
    c.env(
        "XDG_CACHE_HOME",
        std::env::temp_dir().join("kimi-infer-cli-tests"),
    );
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/kimi-linear")
        .join(name)
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Reads a little-endian `.npy` of f32 or f64 into f64.
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape = shape_text
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let body = &bytes[10 + hlen..];
    let data = if header.contains("'<f8'") {
        body.chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    } else {
        assert!(header.contains("'<f4'"), "{header}");
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect()
    };
    (shape, data)
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}

/// Runs `logits` on a fixture's prompt in every feed mode (whole prompt, 16-token chunks,
/// one token at a time) and checks each against its `logits.npy` at `tolerance` (relative
/// Frobenius error); returns each run's stderr.
fn logits_match_in_every_feed_mode(dir: &Path, tolerance: f64) -> Vec<String> {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap().to_string())
        .collect();
    let (want_shape, want) = read_npy(&dir.join("logits.npy"));
    let out_dir = tempfile::tempdir().unwrap();
    let mut notes = Vec::new();
    for step in [None, Some("16"), Some("1")] {
        let out = out_dir.path().join("logits.npy");
        let joined = ids.join(",");
        let mut args = vec!["logits", "--model", dir.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap(), "--ids", &joined]);
        if let Some(s) = step {
            args.extend(["--step", s]);
        }
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let (shape, got) = read_npy(&out);
        assert_eq!(shape, want_shape);
        let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        let err = (num / den).sqrt();
        assert!(err < tolerance, "step {step:?}: relative error {err:e}");
        notes.push(stderr(&o));
    }
    notes
}

#[test]
fn logits_match_reference_in_every_feed_mode() {
    logits_match_in_every_feed_mode(&fixture("hub-f32-sharded"), 1e-4);
}

#[test]
fn run_uses_the_demo_model_and_seeds_reproduce() {
    let a = run(&[
        "run",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "7",
    ]);
    assert!(a.status.success(), "{}", stderr(&a));
    assert!(stderr(&a).contains("demo model"), "{}", stderr(&a));
    assert!(!stdout(&a).trim().is_empty());
    let b = run(&[
        "run",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "7",
    ]);
    assert_eq!(stdout(&a), stdout(&b));
    let c = run(&[
        "run",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "8",
    ]);
    assert_ne!(stdout(&a), stdout(&c));
}

#[test]
fn run_chat_with_stats_and_logprobs() {
    let o = run(&[
        "run",
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi",
        "--max-tokens",
        "5",
        "--stats",
        "--logprobs",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("prompt:") && err.contains("tok/s"), "{err}");
    assert!(err.contains("logprob"), "{err}");
}

#[test]
fn run_beam_search_prints_the_best_beam_and_every_score() {
    let args = [
        "run",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
    ];
    let beams = run(&[&args[..], &["--num-beams", "3", "--length-penalty", "0.5"]].concat());
    assert!(beams.status.success(), "{}", stderr(&beams));
    let err = stderr(&beams);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("[beam ")).collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(
        lines[0].contains("score") && lines[0].contains("finish"),
        "{err}"
    );
    // One beam is greedy decoding.
    let one = run(&[&args[..], &["--num-beams", "1"]].concat());
    assert!(one.status.success(), "{}", stderr(&one));
    assert_eq!(stdout(&one), stdout(&run(&args)));
    let hot = run(&[&args[..], &["--num-beams", "2", "--temperature", "0.5"]].concat());
    assert!(!hot.status.success());
    assert!(stderr(&hot).contains("--temperature"), "{}", stderr(&hot));
}

#[test]
fn invalid_sampling_values_are_refused_in_plain_words() {
    let o = run(&["run", "--prompt", "x", "--top-p", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));
}

#[test]
fn chat_reads_turns_from_stdin() {
    use std::io::Write;
    let mut child = bin()
        .args(["chat", "--max-tokens", "4"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello\nsecond turn\n/exit\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `chat` fed `input` on stdin (greedy, so equal conversations give equal text).
fn chat_with_input(input: &str) -> Output {
    use std::io::Write;
    let mut child = bin()
        .args(["chat", "--max-tokens", "6", "--temperature", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn chat_reset_and_help_commands() {
    let once = chat_with_input("hello\n");
    assert!(once.status.success(), "{}", stderr(&once));
    // After /reset the second "hello" starts a fresh conversation: the same answer again.
    let reset = chat_with_input("hello\n/reset\nhello\n");
    assert!(reset.status.success(), "{}", stderr(&reset));
    assert_eq!(stdout(&reset), stdout(&once).repeat(2));
    assert!(stderr(&reset).contains("conversation cleared"));
    // Without it the history changes the prompt, so the output is not just repeated.
    let kept = chat_with_input("hello\nhello\n");
    assert_ne!(stdout(&kept), stdout(&once).repeat(2));

    let help = chat_with_input("/help\n/bogus\n/quit\nnever sent\n");
    assert!(help.status.success(), "{}", stderr(&help));
    let err = stderr(&help);
    for command in ["/reset", "/help", "/exit"] {
        assert!(err.contains(command), "{command} missing from help: {err}");
    }
    assert!(err.contains("unknown command `/bogus`"), "{err}");
    assert_eq!(stdout(&help), "", "a command is never sent as a message");
}

#[test]
fn inspect_reports_layers_and_json() {
    let dir = fixture("hub-bf16-irregular");
    let o = run(&["inspect", "--model", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("KMKKM") && text.contains("DDEEE"), "{text}");
    let o = run(&["inspect", "--model", dir.to_str().unwrap(), "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["num_layers"], 5);
    assert!(v["total_params"].as_u64().unwrap() > v["active_params"].as_u64().unwrap());
}

#[test]
fn inspect_works_from_config_alone() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json");
    std::fs::copy(cfg, dir.path().join("config.json")).unwrap();
    let o = run(&["inspect", "--model", dir.path().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["total_params"], 49_122_681_728u64);
    assert_eq!(v["mla_cache_bytes_per_token_bf16"], 8064);
    assert_eq!(v["kda_state_bytes_per_sequence_f32"], 40u64 << 20);
}

/// The published Kimi K3 config (`configs/`), as the README's commands use it.
fn k3_config() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs/kimi-k3.config.json")
        .to_string_lossy()
        .into_owned()
}

/// `inspect` takes a bare config.json and shows K3's components and caches (spec appendix,
/// §3.9).
#[test]
fn inspect_k3_config_file() {
    let cfg = k3_config();
    let o = run(&["inspect", "--model", &cfg]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for want in [
        "total 2.7795 T, active per token 105.36 B (104.19 B without the input embedding)",
        "1.5599 TB from config.json (bf16; routed experts mxfp4, 17,547,264 B each",
        "routed experts 1.4465 TB (896 per layer x 92 layers, 16 per token per layer); everything else 113.49 GB",
        "A_log stored as 128 values per KDA layer, 96 read",
        "attn_res",
        "27,648 B (bf16)",
        "KDA state 434.1 MB per sequence (f32) + conv windows 15.3 MB (bf16)",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let o = run(&["inspect", "--model", &cfg, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["model_type"], "kimi_k3");
    assert_eq!(v["num_layers"], 93);
    assert_eq!(v["bytes_per_expert"], 17_547_264);
    assert_eq!(v["routed_expert_bytes"], 92u64 * 896 * 17_547_264);
    assert_eq!(v["mla_cache_bytes_per_token_bf16"], 27_648);
    assert_eq!(v["kda_state_bytes_per_sequence_f32"], 434_110_464u64);
    assert_eq!(v["kda_conv_bytes_per_sequence_bf16"], 15_261_696u64);
    assert_eq!(
        v["components"]["routed_experts"]["read_bytes_per_token"],
        16u64 * 92 * 17_547_264
    );
    assert!(v["weight_bytes"].is_null());
}

/// `plan` on the published K3 config: 8 × H200 (the defaults) hold it only with host RAM,
/// nearly full (spec §6); 16 hold it in HBM; too little memory is a plain "no".
#[test]
fn plan_k3_on_h200_nodes() {
    let cfg = k3_config();
    let o = run(&["plan", "--model", &cfg]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for want in [
        "machine    8 GPUs x 141 GiB",
        "fits       yes, in GPU HBM + host RAM",
        "nearly full",
        "not in GPU HBM alone",
        "642.5 experts per layer",
        "253.5 experts per layer",
        "batch 1    16.0 routed experts per layer read",
        "batch 64   613.2 routed experts per layer read",
        "host->GPU PCIe",
        "host RAM (CPU)",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let o = run(&["plan", "--model", &cfg, "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["fits"].as_bool(), v["fits_in_gpus"].as_bool()),
        (Some(true), Some(false))
    );
    let tiers = v["tiers"].as_array().unwrap();
    assert_eq!(tiers.len(), 3);
    assert_eq!(tiers[2]["tier"], "disk");
    assert_eq!(tiers[2]["experts"], 0);
    let batches: Vec<u64> = v["rooflines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(batches, vec![1, 64]);
    let tok_s = |r: usize, sc: usize| {
        v["rooflines"][r]["scenarios"][sc]["tokens_per_s_serial"]
            .as_f64()
            .unwrap()
    };
    assert!(tok_s(1, 0) > tok_s(0, 0) && tok_s(0, 0) > 0.0);

    // The checkpoint directory works the same way; 16 GPUs hold everything.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&cfg, dir.path().join("config.json")).unwrap();
    let o = run(&[
        "plan",
        "-m",
        dir.path().to_str().unwrap(),
        "--gpus",
        "16",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["fits_in_gpus"], true);
    assert_eq!(v["tiers"][0]["experts_per_layer"], 896.0);
    assert_eq!(v["rooflines"][0]["scenarios"].as_array().unwrap().len(), 1);

    // Units, an extra batch, and a machine that is too small.
    let o = run(&[
        "plan",
        "-m",
        &cfg,
        "--ram",
        "64GB",
        "--batch",
        "8",
        "--context",
        "4096",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("fits       no: short by"), "{text}");
    assert!(text.contains("batch 8 "), "{text}");
}

/// `plan --measured` takes a real `bench` run's miss costs (the H100 run of 2026-12-05,
/// a8a5ac9: a 14.2 MB expert filled in 0.270 ms, computed by the CPU in 0.200 ms) as the
/// link's and the CPU's rates; a file of the newer format carries the expert's bytes itself;
/// a run without experts in host RAM is refused by name.
#[test]
fn plan_takes_measured_miss_costs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cfg = k3_config();
    let real = "device-results/2026-12-05-a8a5ac9-offload-miss-h100/offload-128-64-pin1-auto.json";
    // Its `model` path is relative to the repository, where the run was made.
    let o = bin()
        .current_dir(&root)
        .args(["plan", "-m", &cfg, "--measured", real, "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let link = v["measured"]["link_bytes_per_s"].as_f64().unwrap();
    let cpu = v["measured"]["cpu_expert_bytes_per_s"].as_f64().unwrap();
    assert!((link / 1e9 - 52.4).abs() < 0.1, "{link}");
    assert!((cpu / 1e9 - 70.7).abs() < 0.1, "{cpu}");
    assert!((v["machine"]["pcie_bw_gb_s"].as_f64().unwrap() - link / 1e9).abs() < 1e-9);
    let cpu_link = &v["rooflines"][0]["scenarios"][1]["links"][1];
    assert_eq!(cpu_link["link"], "host RAM (CPU)");
    assert!((cpu_link["bandwidth_bytes_per_s"].as_f64().unwrap() - cpu).abs() < 1.0);

    let dir = tempfile::tempdir().unwrap();
    let newer = dir.path().join("bench.json");
    std::fs::write(
        &newer,
        r#"{"backend": "cuda:0", "offload_miss_costs": {"fill_ms": 0.5, "cpu_first_ms": 2.0,
            "cpu_next_ms": 0.5, "expert_bytes": 17547264}}"#,
    )
    .unwrap();
    let o = run(&["plan", "-m", &cfg, "--measured", newer.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("link 35.1 GB/s per GPU, CPU experts 8.8 GB/s"),
        "{text}"
    );
    assert!(text.contains("at its measured rate"), "{text}");

    let resident = dir.path().join("resident.json");
    std::fs::write(&resident, r#"{"offload_miss_costs": null}"#).unwrap();
    let o = run(&["plan", "-m", &cfg, "--measured", resident.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("has no offload_miss_costs"),
        "{}",
        stderr(&o)
    );
    std::fs::write(&resident, "not json").unwrap();
    let o = run(&["plan", "-m", &cfg, "--measured", resident.to_str().unwrap()]);
    assert!(stderr(&o).contains("is not JSON"), "{}", stderr(&o));
}

#[test]
fn plan_refuses_bad_input_in_plain_words() {
    let cfg = k3_config();
    let o = run(&["plan", "-m", &cfg, "--gpu-mem", "12XB"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("unknown unit"), "{}", stderr(&o));
    let o = run(&["plan", "-m", &cfg, "--ram-bw", "0"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--ram-bw must be a positive"),
        "{}",
        stderr(&o)
    );
    let o = run(&["plan", "-m", "/nonexistent/kimi"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
}

/// The logits of a K3 fixture with every expert in host RAM behind one device slot
/// (misses, evictions and cold experts) equal the resident ones to f32 rounding, and the
/// start log says where the experts went.
#[test]
fn offloaded_experts_give_the_resident_logits() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let out = tempfile::tempdir().unwrap();
    let logits = |name: &str, extra: &[&str]| -> (Vec<f64>, String) {
        let path = out.path().join(name);
        let mut args = vec![
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            "1,5,9,2,7,3",
        ];
        args.extend(["--step", "1", "--out", path.to_str().unwrap()]);
        args.extend(extra);
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        (read_npy(&path).1, stderr(&o))
    };
    let (want, _) = logits("resident.npy", &[]);
    let folder = tempfile::tempdir().unwrap();
    let folder = folder.path().to_str().unwrap();
    for (extra, tier) in [
        (
            &["--offload-experts", "8", "--expert-cache-slots", "1"][..],
            "host RAM".to_string(),
        ),
        (
            &["--cpu-offload-gb", "1", "--expert-cache-gb", "0"][..],
            "host RAM".to_string(),
        ),
        (
            &["--offload-experts", "8", "--offload-folder", folder][..],
            format!("memory-mapped files in {folder}"),
        ),
        (
            &[
                "--offload-experts",
                "8",
                "--expert-cache-slots",
                "2",
                "--offload-prefetch",
                "next-layer",
            ][..],
            "host RAM".to_string(),
        ),
        (
            &[
                "--offload-experts",
                "8",
                "--expert-cache-slots",
                "2",
                "--offload-miss",
                "cpu",
                "--offload-copy-behind",
            ][..],
            "host RAM".to_string(),
        ),
    ] {
        let (got, log) = logits("tiered.npy", extra);
        assert!(
            log.contains("experts: per MoE layer 0 on cpu")
                && log.contains(&format!(" and 8 in {tier} with")),
            "{extra:?}: {log}"
        );
        let ahead = extra.contains(&"next-layer");
        assert_eq!(
            log.contains("slots also filled one MoE layer ahead, predicted"),
            ahead,
            "{extra:?}: {log}"
        );
        assert_eq!(
            log.contains("slots also filled with the CPU's cold experts after it computed them"),
            extra.contains(&"--offload-copy-behind"),
            "{extra:?}: {log}"
        );
        let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        assert!((num / den).sqrt() < 1e-5, "{extra:?}");
    }
}

/// `--tensor-parallel-size 2` (experts split inside, or whole experts per rank with
/// `--enable-expert-parallel`, their outputs summed or dispatched by all-to-all) gives the
/// logits of one rank to f32 rounding, token by token and in one pass.
#[test]
fn a_model_split_over_two_ranks_gives_the_logits_of_one() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let out = tempfile::tempdir().unwrap();
    let logits = |extra: &[&str], step: &str| -> Vec<f64> {
        let path = out.path().join("l.npy");
        let mut args = vec!["logits", "--model", dir.to_str().unwrap()];
        args.extend(["--ids", "1,5,9,2,7,3,11", "--step", step]);
        args.extend(["--out", path.to_str().unwrap()]);
        args.extend(extra);
        let o = run(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        read_npy(&path).1
    };
    // Measured counts with the hot experts in the first half of the ids: placed by load,
    // each rank gets a scattered set.
    let metrics = out.path().join("metrics.txt");
    let mut text = String::from("# TYPE kimi:moe_expert_tokens_total counter\n");
    for layer in 1..7 {
        for e in 0..8 {
            let n = if e < 4 { 100 - e } else { 1 };
            text += &format!(
                "kimi:moe_expert_tokens_total{{model_name=\"m\",layer=\"{layer}\",expert=\"{e}\"}} {n}\n"
            );
        }
    }
    std::fs::write(&metrics, text).unwrap();
    let metrics = metrics.to_str().unwrap();
    let path = out.path().join("placed.npy");
    let o = run(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        "1,2",
        "--out",
        path.to_str().unwrap(),
        "--tensor-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--expert-load",
        metrics,
    ]);
    // 394 of 398 tokens on rank 0 in id order; 199 each when placed by load.
    assert!(
        stderr(&o).contains("mean 1.98 in id order, 1.00 placed (6 layers)"),
        "{}",
        stderr(&o)
    );
    for step in ["1", "7"] {
        let want = logits(&[], step);
        for extra in [
            &["--tensor-parallel-size", "2"][..],
            &["--tensor-parallel-size", "2", "--enable-expert-parallel"][..],
            &[
                "--tensor-parallel-size",
                "2",
                "--enable-expert-parallel",
                "--expert-load",
                metrics,
            ][..],
            &[
                "--tensor-parallel-size",
                "2",
                "--enable-expert-parallel",
                "--expert-dispatch",
                "all-to-all",
                "--expert-load",
                metrics,
            ][..],
        ] {
            let got = logits(extra, step);
            let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
            let den: f64 = want.iter().map(|w| w * w).sum();
            let err = (num / den).sqrt();
            assert!(
                err < 1e-5,
                "{extra:?}, step {step}: relative error {err:.2e}"
            );
            assert!(err > 0.0, "{extra:?}: the same bits, so no split ran");
        }
    }
}

#[test]
fn parallel_flags_refuse_what_cannot_split_naming_it() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let k3 = fixtures.join("kimi-k3/k3-tiny-7l");
    let three_heads = fixtures.join("kimi-linear/hub-f32-sharded");
    for (model, extra, says) in [
        (
            &three_heads,
            &["--tensor-parallel-size", "2"][..],
            "the MLA heads (3) does not split over 2 ranks",
        ),
        (
            &k3,
            &["--tensor-parallel-size", "3"][..],
            "the KDA heads (2) does not split over 3 ranks",
        ),
        (
            &k3,
            &["--enable-expert-parallel"][..],
            "--enable-expert-parallel spreads experts over the ranks",
        ),
        (
            &k3,
            &[
                "--tensor-parallel-size",
                "2",
                "--expert-dispatch",
                "all-to-all",
            ][..],
            "--expert-dispatch all-to-all sends tokens to the ranks that own their experts: \
             give --enable-expert-parallel",
        ),
        (
            &k3,
            &["--tensor-parallel-size", "0"][..],
            "--tensor-parallel-size must be at least 1",
        ),
    ] {
        let out = tempfile::tempdir().unwrap();
        let out = out.path().join("x.npy");
        let mut args = vec!["logits", "--model", model.to_str().unwrap(), "--ids", "1,2"];
        args.extend(["--out", out.to_str().unwrap()]);
        args.extend(extra);
        let o = run(&args);
        assert!(!o.status.success(), "{extra:?}");
        let err = stderr(&o);
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn offload_flags_refuse_bad_values_naming_the_flag() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let model = dir.to_str().unwrap();
    for (extra, says) in [
        (&["--cpu-offload-gb=-1"][..], "--cpu-offload-gb must be"),
        (&["--cpu-offload-gb", "nan"][..], "--cpu-offload-gb must be"),
        (
            &["--expert-cache-slots", "2"][..],
            "give --cpu-offload-gb or --offload-experts",
        ),
        (
            &["--offload-folder", "/tmp"][..],
            "give --cpu-offload-gb or --offload-experts",
        ),
        (
            &[
                "--offload-experts",
                "2",
                "--offload-folder",
                "/nonexistent/dir",
            ][..],
            "--offload-folder: the offload folder /nonexistent/dir: cannot create a file there",
        ),
    ] {
        let out = tempfile::tempdir().unwrap();
        let out = out.path().join("x.npy");
        let mut args = vec!["logits", "--model", model, "--ids", "1,2"];
        args.extend(["--out", out.to_str().unwrap()]);
        args.extend(extra);
        let o = run(&args);
        assert!(!o.status.success(), "{extra:?}");
        let err = stderr(&o);
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn bench_writes_json() {
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("bench.json");
    let cfg = fixture("hub-bf16-irregular").join("config.json");
    let o = run(&[
        "bench",
        "--random-config",
        cfg.to_str().unwrap(),
        "--prompt-len",
        "20,9",
        "--gen-len",
        "4",
        "--repeats",
        "1",
        "--decode-batch",
        "1,3",
        "--context",
        "7",
        "--decode-steps",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["prompt_len"], 9);
    for r in runs {
        assert!(r["prefill_tokens_per_sec"].as_f64().unwrap() > 0.0);
        assert!(r["decode_tokens_per_sec"].as_f64().unwrap() > 0.0);
    }
    let batches = v["decode_batches"].as_array().unwrap();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[1]["batch"], 3);
    assert!(batches[1]["tokens_per_sec"].as_f64().unwrap() > 0.0);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
}

/// A short `bench` of random weights of config `cfg` (a 4-token prompt, 2 generated, one
/// repeat, decode batches at context 4) with `extra` flags, its JSON in `json`; it must
/// succeed.
fn small_bench(cfg: &Path, json: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["bench", "--random-config", cfg.to_str().unwrap()];
    args.extend(["--prompt-len", "4", "--gen-len", "2", "--repeats", "1"]);
    args.extend(["--context", "4", "--json", json.to_str().unwrap()]);
    args.extend(extra);
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

/// `bench` with experts in tiers copied ahead on the next layer's prediction says how many
/// were copied ahead and used, on its lines and in its JSON.
#[test]
fn bench_reports_experts_copied_ahead() {
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("bench.json");
    let cfg = fixture("hub-bf16-irregular").join("config.json");
    let o = small_bench(
        &cfg,
        &json,
        &[
            "--decode-batch",
            "1",
            "--decode-steps",
            "6",
            "--offload-experts",
            "8",
            "--expert-cache-slots",
            "2",
            "--offload-miss",
            "copy",
            "--offload-prefetch",
            "next-layer",
        ],
    );
    assert!(
        stdout(&o).contains("copied ahead per token (on the next layer's prediction"),
        "{}",
        stdout(&o)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(v["offload_prefetch"], "next-layer");
    let offload = &v["decode_batches"][0]["offload"];
    let (fills, used) = (
        offload["ahead_fills"].as_u64().unwrap(),
        offload["ahead_used"].as_u64().unwrap(),
    );
    assert!(fills > 0 && used <= fills, "{offload}");
}

/// `bench` of a model whose whole experts are spread over ranks says how evenly the routed
/// pairs fell on the ranks, and how evenly a placement made from those counts would spread
/// them.
#[test]
fn bench_over_expert_ranks_reports_their_balance() {
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("bench.json");
    let cfg = fixture("../kimi-k3/k3-tiny-7l").join("config.json");
    let o = small_bench(
        &cfg,
        &json,
        &[
            "--decode-batch",
            "1,4",
            "--decode-steps",
            "4",
            "-t",
            "2",
            "--enable-expert-parallel",
            "--routing-skew",
            "0.3",
        ],
    );
    assert!(
        stdout(&o).contains("the busiest rank's experts took"),
        "{}",
        stdout(&o)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    for b in v["decode_batches"].as_array().unwrap() {
        let r = &b["expert_ranks"];
        assert_eq!(r["world"], 2, "{b}");
        let (now, best) = (
            r["imbalance"].as_f64().unwrap(),
            r["balanced_imbalance"].as_f64().unwrap(),
        );
        assert!(now >= 1.0 && (1.0..=2.0).contains(&best), "{r}");
    }
}

/// `--routing-skew` makes the random routers prefer some experts: the most-used quarter
/// of the experts takes a larger share of the routed pairs than without it.
#[test]
fn bench_routing_skew_concentrates_the_routed_pairs() {
    let out = tempfile::tempdir().unwrap();
    let cfg = fixture("hub-bf16-irregular").join("config.json");
    let share = |skew: &str| {
        let json = out.path().join(format!("bench-{skew}.json"));
        let o = small_bench(
            &cfg,
            &json,
            &[
                "--decode-batch",
                "8",
                "--decode-steps",
                "4",
                "--routing-skew",
                skew,
            ],
        );
        assert!(
            stdout(&o).contains("most-used 10 % of experts took"),
            "{}",
            stdout(&o)
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        let top = v["decode_batches"][0]["routing_top25_share"]
            .as_f64()
            .unwrap();
        assert!(top > 0.0 && top <= 1.0, "{top}");
        top
    };
    let (plain, skewed) = (share("0"), share("3"));
    assert!(skewed > plain, "skewed {skewed} against {plain}");
    let o = run(&["bench", "--model", "x", "--routing-skew", "1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--random-config"), "{}", stderr(&o));
    let o = run(&["bench", "--random-config", "c.json", "--routing-skew=-1"]);
    assert!(stderr(&o).contains("not a skew"), "{}", stderr(&o));
}

#[test]
fn cuda_device_without_cuda_build_is_a_plain_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    let o = run(&["run", "--device", "cuda:1", "--prompt", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("without CUDA support"),
        "{}",
        stderr(&o)
    );
    let o = run(&["run", "--device", "tpu", "--prompt", "hi"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown device"), "{}", stderr(&o));
}

#[test]
fn missing_model_directory_is_a_plain_error() {
    let o = run(&[
        "logits",
        "--model",
        "/nonexistent/model",
        "--ids",
        "1,2",
        "--out",
        "/tmp/x.npy",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("/nonexistent/model") && !err.contains("panicked"),
        "{err}"
    );
}

/// Edits a fixture's config.json with `edit` and returns the error `logits` prints.
fn error_after_config_edit(edit: impl Fn(&mut Value)) -> String {
    let dir = copy_fixture("hub-bf16-irregular");
    let path = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let out = dir.path().join("l.npy");
    let o = run(&[
        "logits",
        "--model",
        dir.path().to_str().unwrap(),
        "--ids",
        "1,2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn mis_shaped_tensor_names_tensor_file_and_shapes() {
    let err = error_after_config_edit(|c| c["intermediate_size"] = Value::from(33));
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("33"), "{err}");
}

#[test]
fn missing_tensor_names_it() {
    let err = error_after_config_edit(|c| {
        c["num_hidden_layers"] = Value::from(6);
        c["linear_attn_config"]["kda_layers"]
            .as_array_mut()
            .unwrap()
            .push(Value::from(6));
    });
    assert!(err.contains("model.layers.5."), "{err}");
}

#[test]
fn unexpected_tensors_are_named() {
    let err = error_after_config_edit(|c| {
        c["num_hidden_layers"] = Value::from(4);
        c["linear_attn_config"]["full_attn_layers"] = serde_json::json!([2]);
    });
    assert!(err.contains("model.layers.4."), "{err}");
}

#[test]
fn malformed_config_is_reported() {
    let dir = copy_fixture("hub-bf16-irregular");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let o = run(&["inspect", "--model", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("config.json"), "{}", stderr(&o));
}

#[test]
fn truncated_safetensors_is_reported_with_its_file() {
    let dir = copy_fixture("hub-bf16-irregular");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let out = dir.path().join("l.npy");
    let o = run(&[
        "logits",
        "--model",
        dir.path().to_str().unwrap(),
        "--ids",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("model.safetensors") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn out_of_vocabulary_ids_are_refused() {
    let dir = fixture("hub-bf16-irregular");
    let o = run(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        "1,99999",
        "--out",
        "/tmp/never.npy",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("99999"), "{}", stderr(&o));
}

#[test]
fn every_subcommand_has_help() {
    for sub in ["run", "chat", "logits", "inspect", "plan", "bench"] {
        let o = run(&[sub, "--help"]);
        assert!(o.status.success(), "{sub}");
        assert!(stdout(&o).contains("Usage"), "{sub}");
    }
}

/// `convert` writes a llama.cpp Kimi Linear GGUF that `--model file.gguf` loads: f16 of a bf16
/// fixture is exact, so its logits match the reference as the checkpoint's do, in every feed
/// mode; without a tokenizer, text commands say so.
#[test]
fn convert_to_gguf_and_run_it() {
    let dir = fixture("hub-bf16-released-like");
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("model.gguf");
    let o = run(&[
        "convert",
        "--model",
        dir.to_str().unwrap(),
        "--to",
        "gguf",
        "--quant",
        "f16",
        "--out",
        gguf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    assert!(
        log.contains("blk.0.ssm_conv1d_q.weight") && log.contains("wrote"),
        "{log}"
    );
    assert!(log.contains("no tokenizer is written"), "{log}");
    // stderr is a pipe here: a line per tensor, no progress bar redrawn with `\r`.
    assert!(log.contains("] token_embd.weight"), "{log}");
    assert!(!log.contains('\r'), "{log}");

    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap().to_string())
        .collect();
    let (_, want) = read_npy(&dir.join("logits.npy"));
    for step in ["1000", "1"] {
        let out = tmp.path().join("logits.npy");
        let joined = ids.join(",");
        let o = run(&[
            "logits",
            "--model",
            gguf.to_str().unwrap(),
            "--ids",
            &joined,
            "--step",
            step,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (_, got) = read_npy(&out);
        let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        let err = (num / den).sqrt();
        assert!(err < 1e-4, "step {step}: relative error {err:e}");
    }

    let o = run(&["run", "--model", gguf.to_str().unwrap(), "--prompt", "hi"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("carries no tokenizer"),
        "{}",
        stderr(&o)
    );
}

/// `convert` writes a Kimi K3 checkpoint as a llama.cpp `kimi-k3` GGUF: MXFP4 experts kept,
/// bf16 elsewhere (exact for this bf16 fixture), the tiktoken vocabulary as gpt2 BPE. The
/// file's logits match the float64 reference in both feed modes, and it generates the same
/// greedy text as the checkpoint directory.
#[test]
fn convert_k3_to_gguf_and_run_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/kimi-k3/k3-tiny-7l");
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("k3.gguf");
    let o = run(&[
        "convert",
        "--model",
        dir.to_str().unwrap(),
        "--quant",
        "bf16",
        "--out",
        gguf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let log = stderr(&o);
    assert!(
        log.contains("MXFP4") && log.contains("blk.1.ffn_routed_down.weight"),
        "{log}"
    );
    assert!(log.contains("tokenizer: Kimi tiktoken vocabulary"), "{log}");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap().to_string())
        .collect();
    let joined = ids.join(",");
    let (_, want) = read_npy(&dir.join("logits.npy"));
    for step in ["1000", "1"] {
        let out = tmp.path().join("logits.npy");
        let o = run(&[
            "logits",
            "--model",
            gguf.to_str().unwrap(),
            "--ids",
            &joined,
            "--step",
            step,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (_, got) = read_npy(&out);
        let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        let err = (num / den).sqrt();
        assert!(err < 1e-4, "step {step}: relative error {err:e}");
    }
    let generate = |model: &Path| {
        let o = run(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Hello there",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(generate(&gguf), generate(&dir));
}

/// A directory exactly as transformers' save_pretrained wrote it (here its in-memory layout:
/// fused experts and convolutions) runs and converts like its hub-layout twin.
#[test]
fn save_pretrained_directory_runs_and_converts() {
    let dir = fixture("native-saved-fused-f32-short");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap().to_string())
        .collect();
    let joined = ids.join(",");
    let (_, want) = read_npy(&dir.join("logits.npy"));
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("model.gguf");
    let o = run(&[
        "convert",
        "--model",
        dir.to_str().unwrap(),
        "--to",
        "gguf",
        "--quant",
        "f32",
        "--out",
        gguf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for model in [dir.as_path(), gguf.as_path()] {
        let out = tmp.path().join("logits.npy");
        let o = run(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--ids",
            &joined,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (_, got) = read_npy(&out);
        let num: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        let err = (num / den).sqrt();
        assert!(err < 1e-4, "{}: relative error {err:e}", model.display());
    }
}

/// The demo checkpoint with its tiktoken tokenizer converts with the tokenizer, and the GGUF
/// generates the same greedy text as the directory.
#[test]
fn converted_demo_model_generates_like_the_checkpoint() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    std::fs::create_dir(&dir).unwrap();
    for (from, name) in [
        ("demo-model", "config.json"),
        ("demo-model", "model.safetensors"),
        ("demo-tokenizer", "tiktoken.model"),
        ("demo-tokenizer", "tokenizer_config.json"),
        ("demo-tokenizer", "chat_template.jinja"),
    ] {
        std::fs::copy(root.join(from).join(name), dir.join(name)).unwrap();
    }
    let gguf = tmp.path().join("demo-q8_0.gguf");
    let o = run(&[
        "convert",
        "--model",
        dir.to_str().unwrap(),
        "--quant",
        "f32",
        "--out",
        gguf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("tokenizer: Kimi tiktoken vocabulary"),
        "{}",
        stderr(&o)
    );
    let generate = |model: &Path| {
        let o = run(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Hello there",
            "--chat",
            "--max-tokens",
            "12",
            "--ignore-eos",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(generate(&gguf), generate(&dir));
}

/// `convert --random-config` writes the deterministic random weights of a config with a
/// byte-level stand-in vocabulary: f32 and bf16 files hold the same (bf16) values, so their
/// logits agree exactly, and the vocabulary lets `run` tokenize text byte by byte.
#[test]
fn convert_random_config_to_gguf() {
    let config = fixture("hub-bf16-released-like").join("config.json");
    let tmp = tempfile::tempdir().unwrap();
    let mut logits = Vec::new();
    for quant in ["f32", "bf16"] {
        let gguf = tmp.path().join(format!("random-{quant}.gguf"));
        let o = run(&[
            "convert",
            "--random-config",
            config.to_str().unwrap(),
            "--quant",
            quant,
            "--out",
            gguf.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("byte-level stand-in vocabulary"),
            "{}",
            stderr(&o)
        );
        let out = tmp.path().join(format!("logits-{quant}.npy"));
        let o = run(&[
            "logits",
            "--model",
            gguf.to_str().unwrap(),
            "--ids",
            "104,105,33,7",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let (shape, values) = read_npy(&out);
        assert_eq!(shape, [4, 256]);
        assert!(values.iter().all(|v| v.is_finite()));
        logits.push(values);

        let o = run(&[
            "run",
            "--model",
            gguf.to_str().unwrap(),
            "--prompt",
            "hi!",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--logprobs",
            "1",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stderr(&o).matches("[token ").count(), 3, "{}", stderr(&o));
    }
    assert_eq!(logits[0], logits[1]);
}

/// A missing or malformed config, or no source at all, is a clear error, not a panic.
#[test]
fn convert_random_config_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never.gguf");
    let out = out.to_str().unwrap();
    let missing = tmp.path().join("missing.json");
    let o = run(&[
        "convert",
        "--random-config",
        missing.to_str().unwrap(),
        "--out",
        out,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot read"), "{}", stderr(&o));

    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "{\"model_type\": \"kimi_linear\", \"hidden_size\": ").unwrap();
    let o = run(&[
        "convert",
        "--random-config",
        bad.to_str().unwrap(),
        "--out",
        out,
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot parse the model config"),
        "{}",
        stderr(&o)
    );
    assert!(!Path::new(out).exists());

    let o = run(&["convert", "--out", out]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--model"), "{}", stderr(&o));
}

fn k3_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/kimi-k3")
        .join(name)
}

/// A Kimi K3 checkpoint (the released layout: wrapper config, shards, MXFP4 experts, a
/// vision encoder to skip) through the binary, in every feed mode, against the float64
/// reference; the vision tensors are reported once per run.
#[test]
fn k3_logits_match_reference_in_every_feed_mode() {
    for note in logits_match_in_every_feed_mode(&k3_fixture("k3-tiny-7l"), 5e-5) {
        let count = note.matches("images are not supported yet").count();
        assert_eq!(count, 1, "{note}");
    }
}

#[test]
fn k3_run_generates_from_the_tiny_checkpoint() {
    let dir = k3_fixture("k3-tiny-5l-b2");
    let o = run(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // K3 ships no chat template: `run --chat` and `chat` render its XTML format.
    let mut args = vec!["run", "--chat", "--model", dir.to_str().unwrap()];
    args.extend(["--prompt", "Hi", "--max-tokens", "4", "--temperature", "0"]);
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    use std::io::Write;
    let mut child = bin()
        .args([
            "chat",
            "--model",
            dir.to_str().unwrap(),
            "--max-tokens",
            "4",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello\nAnd again\n/exit\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("> ").count(), 3, "{}", stderr(&o));
}

/// Copies a K3 fixture, applies `edit` to its directory, and returns what `logits` prints.
fn k3_error_after(edit: impl Fn(&Path)) -> String {
    let src = k3_fixture("k3-tiny-7l");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    edit(dir.path());
    let out = dir.path().join("l.npy");
    let o = run(&[
        "logits",
        "--model",
        dir.path().to_str().unwrap(),
        "--ids",
        "1,2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Byte range of tensor `name` in a safetensors file.
fn tensor_range(path: &Path, name: &str) -> std::ops::Range<usize> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = &header[name]["data_offsets"];
    let (a, b) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
    8 + n + a as usize..8 + n + b as usize
}

#[test]
fn k3_bad_checkpoints_name_the_file_and_tensor() {
    // A missing shard names itself.
    let err = k3_error_after(|d| {
        std::fs::remove_file(d.join("model-00001-of-00002.safetensors")).unwrap()
    });
    assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
    // An E8M0 NaN scale names the tensor, row and block.
    let err = k3_error_after(|d| {
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(d.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale";
        let file = d.join(index["weight_map"][name].as_str().unwrap());
        let range = tensor_range(&file, name);
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[range.start + 5] = 255;
        std::fs::write(&file, bytes).unwrap();
    });
    assert!(
        err.contains("experts.3.w2.weight_scale") && err.contains("255"),
        "{err}"
    );
    // A config that does not fit the stored experts names the tensor and both shapes.
    let err = k3_error_after(|d| {
        let path = d.join("config.json");
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        cfg["text_config"]["moe_intermediate_size"] = Value::from(96);
        std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    });
    // The first MoE tensor read (the shared experts, 2 x 96 rows, or a routed expert's
    // `weight_packed`) is the one named.
    assert!(
        err.contains("block_sparse_moe.")
            && err.contains("expected shape")
            && err.contains("found")
            && (err.contains("weight_packed") || err.contains("[192, 48]")),
        "{err}"
    );
}

/// `plan` on a checkpoint AutoAWQ wrote counts its routed experts as the GPU will hold them:
/// 4-bit, packed as Q4Z blocks, or with `KIMI_CUDA_PACKED_QUANT=0` widened to bf16; an
/// 8-bit checkpoint's experts widened either way (CUDA's expert kernels take 4-bit packed
/// experts only).
#[test]
fn plan_sizes_a_quantized_checkpoints_experts_as_the_gpu_holds_them() {
    let quantized = |name: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/quantized")
            .join(name)
    };
    let experts = |dir: &Path, packed: &str| -> u64 {
        let o = bin()
            .env("KIMI_CUDA_PACKED_QUANT", packed)
            .args(["plan", "-m", dir.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["routed_expert_bytes"].as_u64().unwrap()
    };
    let awq = quantized("awq-gemm");
    let widened = experts(&awq, "0");
    let values = widened as usize / 2;
    let packed = experts(&awq, "1");
    assert_eq!(
        Some(packed as usize),
        kimi_core::DType::Q4Z.storage_bytes(values),
        "{packed} bytes for {values} values"
    );
    assert!(packed * 2 < widened, "{packed} vs {widened}");
    let int8 = quantized("ct-w8a16");
    assert_eq!(experts(&int8, "1"), experts(&int8, "0"));
}
