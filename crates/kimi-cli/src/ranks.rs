//! One process per rank: what each process of a split model does before its command runs.
//!
//! ```text
//! kimi-infer serve -t 2 --distributed-executor-backend mp      (or --device cuda: mp is the default)
//!   └─ launcher: starts ranks 0..N of this node as copies of itself (RANK, LOCAL_RANK, …), waits
//!      ├─ rank 0: new process group → rendezvous (hands the group's id) → joins → loads its
//!      │          part → runs the command, every model call sent to the others (ProcessRanks)
//!      └─ rank r: rendezvous (gets the id) → joins → loads its part → serves rank 0's calls
//!                 (serve_worker) until rank 0 says the job is over
//! ```
//!
//! The group is NCCL on GPUs and shared memory between the processes on the CPU
//! ([`kimi_ops::Backend::new_process_group`]); the rendezvous and the control links are
//! `kimi_ops::bootstrap`'s. A rank started by torchrun, Slurm or LeaderWorkerSet (RANK set)
//! skips the launcher.

use std::path::PathBuf;

use anyhow::Context;
use kimi_core::DType;
use kimi_model::parallel::{serve_worker, Shard};
use kimi_model::{registry, KimiLinear};
use kimi_ops::bootstrap::{rendezvous, RankPlace};
use kimi_ops::{Backend, Collective};

use crate::args::{Command, Device, ModelArgs};
use crate::parallel::{Ranks, Split};

/// Where a command's weights come from.
#[derive(Clone, Debug)]
pub enum Weights {
    /// `--model` (a checkpoint directory).
    Model,
    /// Deterministic random weights of a config.json (`--random-config`).
    Random {
        config: PathBuf,
        dtype: DType,
        skew: f32,
    },
}

/// The model flags and weights of the commands that may run as rank processes.
fn job_of(command: &Command) -> Option<(&ModelArgs, Weights)> {
    let random = |config: &Option<PathBuf>, dtype, skew| match config {
        Some(config) => Weights::Random {
            config: config.clone(),
            dtype,
            skew,
        },
        None => Weights::Model,
    };
    match command {
        Command::Run(a) => Some((&a.model, Weights::Model)),
        Command::Chat(a) => Some((&a.model, Weights::Model)),
        Command::Logits(a) => Some((&a.model, Weights::Model)),
        Command::Perplexity(a) => Some((&a.model, Weights::Model)),
        Command::Serve(a) => Some((&a.model, random(&a.random_config, DType::BF16, 0.0))),
        Command::Bench(a) => {
            let dtype = a.random_dtype.dtype();
            Some((&a.model, random(&a.random_config, dtype, a.routing_skew)))
        }
        _ => None,
    }
}

/// Does this process's share of a job split over rank processes: starts the node's ranks
/// and waits for them, or serves rank 0 as a rank other than 0. `Ok(false)`: the command
/// runs here (one rank, rank threads, or rank 0 of processes). `threads_given`: whether
/// `--threads` set the CPU backend's threads (else CPU ranks of one node share the cores).
pub fn run_unless_rank_zero(command: &Command, threads_given: bool) -> anyhow::Result<bool> {
    let Some((args, weights)) = job_of(command) else {
        return Ok(false);
    };
    let ranks = args.parallel.ranks(args.device == Device::Cpu)?;
    if let (Ranks::Process(_, place), Device::Cpu, false) = (&ranks, args.device, threads_given) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let share = (cores / place.local_world.max(1)).max(1);
        kimi_cpu::set_num_threads(share)
            .map_err(|e| anyhow::anyhow!("cannot set the thread count: {e}"))?;
    }
    match ranks {
        Ranks::Launch(places) => {
            let program = std::env::current_exe().context("finding this program to start ranks")?;
            let argv: Vec<String> = std::env::args().skip(1).collect();
            eprintln!(
                "starting ranks {}..{} of {} as processes (rank 0 runs the command)",
                places.first().map_or(0, |p| p.rank),
                places.last().map_or(0, |p| p.rank + 1),
                places.first().map_or(0, |p| p.world),
            );
            crate::launch::run_ranks(&program, &argv, &places)?;
            Ok(true)
        }
        Ranks::Process(split, place) if place.rank > 0 => {
            crate::launch::ignore_signals();
            let mut args = args.clone();
            args.device = rank_device(args.device, &place);
            crate::load::with_backend!(args, |backend| serve_part(
                backend, &args, &weights, split, &place
            ))?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// A rank's device: GPU `B + LOCAL_RANK` for `--device cuda:B`.
fn rank_device(device: Device, place: &RankPlace) -> Device {
    match device {
        Device::Cuda(base) => Device::Cuda(base + place.local_rank),
        Device::Cpu => Device::Cpu,
    }
}

/// Rank 0's side of the group: a new process group, handed to every other rank at the
/// rendezvous, then joined. Returns the collective and the control links.
pub fn lead_group<B: Backend>(
    backend: &B,
    split: &Split,
    place: &RankPlace,
) -> anyhow::Result<(std::sync::Arc<dyn Collective<B>>, Vec<rendezvous::Link>)> {
    let id = backend
        .new_process_group(place.world)
        .context("rank 0: starting the ranks' collective")?;
    eprintln!(
        "rank 0 of {}: waiting for the other ranks on port {}",
        place.world, place.master.port
    );
    let port = place.master.port;
    // One node's ranks meet on the loopback interface only: nothing from the network can
    // pose as a rank. Several nodes' ranks need every interface.
    let addr = place.master.addr.as_str();
    let lead = match is_loopback(addr) {
        // The address the other ranks connect to (`localhost` may be ::1).
        true => std::net::TcpListener::bind((addr, port))
            .map_err(|e| anyhow::anyhow!("rank 0 cannot listen on {addr}:{port}: {e}"))
            .and_then(|l| {
                Ok(rendezvous::lead_on(
                    l,
                    place.world,
                    &id.bytes,
                    split.timeout,
                )?)
            }),
        false => Ok(rendezvous::lead(
            port,
            place.world,
            &id.bytes,
            split.timeout,
        )?),
    }
    .context("rank 0: the rendezvous of the rank processes")?;
    let comm = backend
        .join_process_group(&id.bytes, 0, place.world, split.timeout)
        .context("rank 0: joining the ranks' collective")?;
    drop(id);
    Ok((comm, lead.into_links()))
}

fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A rank other than 0: joins rank 0, loads its part and runs rank 0's calls on it until
/// rank 0 ends the job.
fn serve_part<B: Backend + 'static>(
    backend: B,
    args: &ModelArgs,
    weights: &Weights,
    split: Split,
    place: &RankPlace,
) -> anyhow::Result<()> {
    let rank = place.rank;
    let (master, port) = (&place.master.addr, place.master.port);
    let (link, id) = rendezvous::join(master, port, rank, place.world, split.timeout)
        .with_context(|| format!("rank {rank}: joining rank 0 at {master}:{port}"))?;
    let comm = backend
        .join_process_group(&id, rank, place.world, split.timeout)
        .with_context(|| format!("rank {rank}: joining the ranks' collective"))?;
    let shard = Shard {
        rank,
        world: place.world,
        experts: split.experts,
    };
    let part = load_part(backend, args, weights, &split, shard, comm.clone());
    let mut part = match part {
        Ok(p) => p,
        Err(e) => {
            comm.abort(&format!("loading its part failed: {e:#}"));
            return Err(e.context(format!("rank {rank}")));
        }
    };
    serve_worker(&mut part, comm.as_ref(), link).with_context(|| format!("rank {rank}"))
}

/// Rank `shard.rank`'s part of the model `weights` names, joined to `comm`.
fn load_part<B: Backend + 'static>(
    backend: B,
    args: &ModelArgs,
    weights: &Weights,
    split: &Split,
    shard: Shard,
    comm: std::sync::Arc<dyn Collective<B>>,
) -> anyhow::Result<KimiLinear<B>> {
    let mut options = crate::load::split_options(args, split)?;
    match weights {
        Weights::Model => {
            let path = crate::load::model_path(args)?;
            anyhow::ensure!(
                !crate::load::is_gguf(&path),
                "--tensor-parallel-size applies to checkpoint directories for now, not GGUF files"
            );
            let ckpt = kimi_weights::Checkpoint::open(&path)
                .with_context(|| format!("cannot open the model in {}", path.display()))?;
            let source = kimi_model::CheckpointSource::new(&ckpt)?;
            options.reopen = Some(crate::load::checkpoint_reopener(path.clone()));
            let part = registry::load_rank_part(
                backend,
                ckpt.config().clone(),
                &source,
                &options,
                shard,
                comm,
            );
            part.with_context(|| format!("cannot load the weights in {}", path.display()))
        }
        Weights::Random {
            config,
            dtype,
            skew,
        } => {
            let cfg = crate::load::read_config(config)?;
            let source = crate::load::random_source(*dtype, *skew);
            options.reopen = Some(crate::load::random_reopener(*dtype, *skew));
            Ok(registry::load_rank_part(
                backend, cfg, &source, &options, shard, comm,
            )?)
        }
    }
}
