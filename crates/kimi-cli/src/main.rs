//! `kimi-infer`: run, chat with, inspect, plan and benchmark Kimi models.
// No unsafe code but the launcher's process calls (`launch::os`).
#![deny(unsafe_code)]

mod access_args;
mod agent;
mod args;
mod beam_run;
mod bench;
mod cache_plan;
mod convert;
mod convert_hf;
mod demo;
mod gateway;
mod hub;
mod inspect;
mod kld;
mod launch;
mod load;
mod logging;
mod logits;
mod memory;
mod npy;
mod offload;
mod parallel;
mod perplexity;
mod plan;
mod progress;
mod quantize;
mod ranks;
mod run;
mod serve;

use clap::Parser;

use args::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve(_) | Command::Gateway(_));
    let filter = agent::log_filter(&cli.command).unwrap_or(logging::default_filter(serving));
    logging::init(cli.log_format, filter);
    if let Some(threads) = cli.threads {
        if let Err(e) = cpu_threads(threads) {
            eprintln!("error: {}", report(&e));
            std::process::exit(2);
        }
    }
    // A launcher of rank processes, or a rank other than 0, does its share and ends here.
    let result = match ranks::run_unless_rank_zero(&cli.command, cli.threads.is_some()) {
        Ok(false) => run_command(cli.command),
        done => done.map(|_| ()),
    };
    if let Err(e) = result {
        eprintln!("error: {}", report(&e));
        std::process::exit(1);
    }
}

fn run_command(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => run::chat(a),
        Command::Logits(a) => logits::logits(a),
        Command::Perplexity(a) => perplexity::perplexity(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Plan(a) => plan::plan(a),
        Command::Bench(a) => bench::bench(a),
        Command::Serve(a) => serve::serve(a),
        Command::Gateway(a) => gateway::gateway(a),
        Command::Convert(a) => convert::convert(a),
        Command::Quantize(a) => quantize::quantize(a),
        Command::Download(a) => hub::download(a),
        Command::Agent(a) => agent::agent(a),
    }
}

/// The error and its causes joined by `: `, each said once: a library error that already
/// quotes its cause in its message (`{path}: {source}`) also returns it as its source, and
/// anyhow's `{:#}` would print it twice.
fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn cpu_threads(n: usize) -> anyhow::Result<()> {
    anyhow::ensure!(n > 0, "--threads must be at least 1");
    kimi_cpu::set_num_threads(n).map_err(|e| anyhow::anyhow!("cannot set the thread count: {e}"))
}

#[cfg(test)]
mod tests {
    use super::report;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Quoting {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let err = anyhow::Error::new(Quoting {
            path: "/m/config.json",
            source: io,
        })
        .context("cannot open the model in /m");
        assert_eq!(
            report(&err),
            "cannot open the model in /m: /m/config.json: no such file"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(report(&plain), "outer: inner");
    }
}
