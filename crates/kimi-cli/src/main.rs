//! `kimi-infer`: run, chat with, inspect, plan and benchmark Kimi models.
#![forbid(unsafe_code)]

mod args;
mod bench;
mod convert;
mod demo;
mod inspect;
mod load;
mod logits;
mod npy;
mod plan;
mod run;
mod serve;

use clap::Parser;

use args::{Cli, Command};

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KIMI_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(threads) = cli.threads {
        if let Err(e) = cpu_threads(threads) {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => run::chat(a),
        Command::Logits(a) => logits::logits(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Plan(a) => plan::plan(a),
        Command::Bench(a) => bench::bench(a),
        Command::Serve(a) => serve::serve(a),
        Command::Convert(a) => convert::convert(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn cpu_threads(n: usize) -> anyhow::Result<()> {
    anyhow::ensure!(n > 0, "--threads must be at least 1");
    kimi_cpu::set_num_threads(n).map_err(|e| anyhow::anyhow!("cannot set the thread count: {e}"))
}
