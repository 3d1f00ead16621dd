//! Serves a model (by default the committed demo model) with the OpenAI-compatible API,
//! for the Python client tests until `kimi-infer serve` exists.
//!
//! ```text
//! cargo run --release -p kimi-server --example serve_demo -- [--model DIR] [--host H]
//!     [--port P] [--api-key K]... [--served-model-name NAME] [--max-model-len N]
//! ```
//!
//! Without `--model`, `assets/demo-model` and `assets/demo-tokenizer` are copied into one
//! temporary directory.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use kimi_cpu::CpuBackend;
use kimi_engine::{EngineHandle, ServingConfig};
use kimi_model::KimiLinear;
use kimi_server::ServerConfig;
use kimi_tokenizer::Tokenizer;
use kimi_weights::Checkpoint;

struct Args {
    model: Option<PathBuf>,
    config: ServerConfig,
    max_model_len: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        model: None,
        config: ServerConfig {
            served_model_name: "kimi-demo".into(),
            ..ServerConfig::default()
        },
        max_model_len: 4096,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = Some(PathBuf::from(value()?)),
            "--host" => args.config.host = value()?,
            "--port" => args.config.port = value()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--api-key" => args.config.api_keys.push(value()?),
            "--served-model-name" => args.config.served_model_name = value()?,
            "--max-model-len" => {
                args.max_model_len = value()?
                    .parse()
                    .map_err(|e| format!("--max-model-len: {e}"))?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

fn copy_demo(into: &Path) -> std::io::Result<()> {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    for sub in ["demo-model", "demo-tokenizer"] {
        for entry in std::fs::read_dir(assets.join(sub))? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                std::fs::copy(&path, into.join(name))?;
            }
        }
    }
    Ok(())
}

async fn run(args: Args) -> Result<(), String> {
    let temp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            copy_demo(temp.path()).map_err(|e| format!("copying the demo model: {e}"))?;
            temp.path().to_path_buf()
        }
    };
    let ckpt = Checkpoint::open(&dir).map_err(|e| e.to_string())?;
    let model = KimiLinear::load(CpuBackend::new(), &ckpt).map_err(|e| e.to_string())?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).map_err(|e| e.to_string())?);
    let serving = ServingConfig {
        max_model_len: args.max_model_len,
        max_num_seqs: 64,
        max_num_batched_tokens: 8192,
        block_size: 16,
        num_blocks: (args.max_model_len * 64).div_ceil(16),
        max_waiting: 1024,
        expert_rebalance: None,
    };
    let engine = EngineHandle::spawn(model, serving).map_err(|e| e.to_string())?;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let result = kimi_server::serve(args.config, engine.clone(), tokenizer, shutdown).await;
    engine.shutdown(false);
    result.map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("serve_demo: {err}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("serve_demo: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("serve_demo: {err}");
            ExitCode::FAILURE
        }
    }
}
