//! The flags that split a model over several ranks of this process.

use clap::{Args, ValueEnum};
use kimi_model::parallel::{ExpertDispatch, ExpertSplit};
use kimi_ops::bootstrap::{resolve, LaunchFlags, Role};

/// `--expert-dispatch`: how expert parallelism combines the routed experts' outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum DispatchArg {
    /// Every rank runs the whole batch through its experts; one all-reduce sums them.
    #[default]
    AllReduce,
    /// Each rank sends its share of the tokens to the ranks owning their experts and
    /// gathers the weighted outputs back (all-to-all, as DeepEP).
    AllToAll,
}

impl From<DispatchArg> for ExpertDispatch {
    fn from(a: DispatchArg) -> Self {
        match a {
            DispatchArg::AllReduce => Self::AllReduce,
            DispatchArg::AllToAll => Self::AllToAll,
        }
    }
}

/// `--distributed-executor-backend`: how the ranks of `--tensor-parallel-size` run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ExecutorArg {
    /// Threads of this process on the CPU; one process per GPU on GPUs.
    #[default]
    Auto,
    /// Threads of this process (CPU backend).
    Threads,
    /// One process per rank (per GPU), as vLLM's `mp`: started by this command on one node,
    /// or by a launcher that sets `RANK`/`WORLD_SIZE` (torchrun, Slurm, LeaderWorkerSet).
    Mp,
}

/// How the ranks of a split model run: their number, how the experts split, and the
/// collectives' deadline.
#[derive(Clone, Copy, Debug)]
pub struct Split {
    pub world: usize,
    pub experts: ExpertSplit,
    pub timeout: std::time::Duration,
}

/// What this process does for the model's ranks.
#[derive(Clone, Debug)]
pub enum Ranks {
    /// The whole model.
    One,
    /// Every rank, each a thread.
    Threads(Split),
    /// Starts the node's rank processes (copies of this command) and waits for them.
    Launch(Vec<kimi_ops::bootstrap::RankPlace>),
    /// One rank process: rank 0 runs the command, the others serve their parts to it.
    Process(Split, kimi_ops::bootstrap::RankPlace),
}

/// Flags of [`crate::args::ModelArgs`] for tensor and expert parallelism.
#[derive(Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Split the model over N ranks (vLLM's flag): attention heads, dense MLPs and shared
    /// experts by tensor parallelism, the ranks meeting in an all-reduce per sublayer (NCCL
    /// on GPUs). Heads and widths must divide by N. See --distributed-executor-backend.
    #[arg(
        long,
        short = 't',
        visible_alias = "tp",
        value_name = "N",
        default_value_t = 1
    )]
    pub tensor_parallel_size: usize,
    /// With `--tensor-parallel-size N`, give each rank whole routed experts (N-th of each
    /// layer's) instead of splitting every expert's width (vLLM's flag).
    #[arg(long)]
    pub enable_expert_parallel: bool,
    /// With `--enable-expert-parallel`, how the experts' outputs meet (vLLM's
    /// `--all2all-backend`): `all-reduce` runs every token through every rank's experts and
    /// sums the partial outputs; `all-to-all` sends each token only to the ranks owning its
    /// experts and gathers the outputs back.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = DispatchArg::AllReduce)]
    pub expert_dispatch: DispatchArg,
    /// How the ranks run (vLLM's flag): `mp`, one process per rank, each on GPU
    /// `cuda:B+LOCAL_RANK` for `--device cuda:B` (this command starts them on one node;
    /// torchrun-style launchers set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    /// instead); `threads`, threads of this process (CPU backend); `auto`: threads on the
    /// CPU, processes on GPUs.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = ExecutorArg::Auto)]
    pub distributed_executor_backend: ExecutorArg,
    /// Seconds a rank waits for the others in one collective before the step fails.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub collective_timeout: u64,
    /// With `--enable-expert-parallel`, place the experts so that each rank's receive about
    /// the same number of tokens, by the counts in FILE: a saved `/metrics` of `kimi-infer
    /// serve` (its `kimi:moe_expert_tokens_total` lines). Every rank still holds as many
    /// experts.
    #[arg(long, value_name = "FILE", requires = "enable_expert_parallel")]
    pub expert_load: Option<std::path::PathBuf>,
    /// Nodes the ranks of `--tensor-parallel-size` spread over, one process per GPU (vLLM's
    /// and SGLang's flag; torchrun's `RANK`/`WORLD_SIZE` per process say the same).
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,
    /// This node, `0..--nnodes` (node 0 holds rank 0, which serves the API).
    #[arg(long, value_name = "R")]
    pub node_rank: Option<usize>,
    /// Rank 0's address for the rendezvous of the rank processes (else `MASTER_ADDR`, else
    /// 127.0.0.1 on one node).
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// Rank 0's rendezvous port (else `MASTER_PORT`, else 29500).
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
}

impl Default for ParallelArgs {
    fn default() -> Self {
        Self {
            tensor_parallel_size: 1,
            enable_expert_parallel: false,
            expert_dispatch: DispatchArg::AllReduce,
            distributed_executor_backend: ExecutorArg::Auto,
            collective_timeout: 600,
            expert_load: None,
            nnodes: None,
            node_rank: None,
            master_addr: None,
            master_port: None,
        }
    }
}

impl ParallelArgs {
    /// The launch flags of the rank processes.
    pub fn launch_flags(&self) -> LaunchFlags {
        LaunchFlags {
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        }
    }

    /// What this process is among the rank processes of `--tensor-parallel-size`, from the
    /// flags and torchrun's variables (`kimi_ops::bootstrap::resolve`).
    pub fn role(&self) -> anyhow::Result<Role> {
        let env = |k: &str| std::env::var(k).ok();
        Ok(resolve(
            self.tensor_parallel_size,
            &self.launch_flags(),
            &env,
        )?)
    }

    /// What this process does for the model's ranks, on the CPU backend or not (`on_cpu`).
    pub fn ranks(&self, on_cpu: bool) -> anyhow::Result<Ranks> {
        let launched = std::env::var_os("RANK").is_some_and(|r| !r.is_empty());
        let processes = match self.distributed_executor_backend {
            ExecutorArg::Mp => true,
            ExecutorArg::Threads => false,
            ExecutorArg::Auto => !on_cpu,
        } || launched
            || self.launch_flags() != LaunchFlags::default();
        if processes && self.distributed_executor_backend == ExecutorArg::Threads {
            anyhow::bail!(
                "--distributed-executor-backend threads runs the ranks in this process, but \
                 {} asks for one process per rank",
                match launched {
                    true => "RANK (a launcher's variable)",
                    false => "--nnodes/--node-rank/--master-addr/--master-port",
                }
            );
        }
        let Some(split) = self.split()? else {
            return Ok(Ranks::One);
        };
        if !processes {
            anyhow::ensure!(
                on_cpu,
                "the ranks of --tensor-parallel-size run as threads on the CPU backend only: \
                 on GPUs give --distributed-executor-backend mp (the default there)"
            );
            return Ok(Ranks::Threads(split));
        }
        Ok(match self.role()? {
            Role::Single => Ranks::One,
            Role::Launcher {
                first,
                local,
                world,
                master,
            } => Ranks::Launch(crate::launch::node_places(first, local, world, &master)),
            Role::Rank(place) => Ranks::Process(split, place),
        })
    }

    /// The split `--tensor-parallel-size` asks for; `None` for one rank.
    fn split(&self) -> anyhow::Result<Option<Split>> {
        anyhow::ensure!(
            self.tensor_parallel_size >= 1,
            "--tensor-parallel-size must be at least 1"
        );
        anyhow::ensure!(
            (1..=7 * 86400).contains(&self.collective_timeout),
            "--collective-timeout must be between 1 second and 7 days"
        );
        anyhow::ensure!(
            self.expert_dispatch == DispatchArg::AllReduce || self.enable_expert_parallel,
            "--expert-dispatch all-to-all sends tokens to the ranks that own their experts: \
             give --enable-expert-parallel (and --tensor-parallel-size N > 1)"
        );
        if self.tensor_parallel_size == 1 {
            anyhow::ensure!(
                !self.enable_expert_parallel,
                "--enable-expert-parallel spreads experts over the ranks of \
                 --tensor-parallel-size N: give N > 1"
            );
            return Ok(None);
        }
        let experts = match self.enable_expert_parallel {
            true => ExpertSplit::Experts,
            false => ExpertSplit::Tensor,
        };
        Ok(Some(Split {
            world: self.tensor_parallel_size,
            experts,
            timeout: std::time::Duration::from_secs(self.collective_timeout),
        }))
    }
}

/// The expert placement `--expert-load` asks for over `world` ranks, said once with the
/// balance it buys (largest rank's tokens over the mean, averaged over the layers).
pub fn placement(
    args: &ParallelArgs,
    world: usize,
) -> anyhow::Result<Option<std::sync::Arc<kimi_model::parallel::ExpertPlacement>>> {
    use anyhow::Context;
    use kimi_model::parallel::{loads_from_metrics, ExpertPlacement};
    let Some(path) = &args.expert_load else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--expert-load: cannot read {}", path.display()))?;
    let loads =
        loads_from_metrics(&text).with_context(|| format!("--expert-load {}", path.display()))?;
    anyhow::ensure!(
        !loads.is_empty(),
        "--expert-load {}: no kimi:moe_expert_tokens_total lines",
        path.display()
    );
    let placement = ExpertPlacement::balanced(&loads, world)
        .with_context(|| format!("--expert-load {}", path.display()))?;
    let mean = |m: std::collections::BTreeMap<usize, f64>| m.values().sum::<f64>() / m.len() as f64;
    let before = mean(
        ExpertPlacement::default()
            .with_world(world)
            .imbalance(&loads),
    );
    let after = mean(placement.imbalance(&loads));
    eprintln!(
        "experts: placed over {world} ranks by the counts in {}: largest rank's tokens over \
         the mean {before:.2} in id order, {after:.2} placed ({} layers)",
        path.display(),
        loads.len()
    );
    Ok(Some(std::sync::Arc::new(placement)))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::args::{Cli, Command};

    fn serve(args: &[&str]) -> super::ParallelArgs {
        let argv = [&["kimi-infer", "serve", "--model", "m"], args].concat();
        match Cli::try_parse_from(argv).expect("parses").command {
            Command::Serve(s) => s.model.parallel,
            _ => panic!("serve"),
        }
    }

    #[test]
    fn launch_flags_parse_as_vllm_spells_them() {
        let p = serve(&[
            "--tensor-parallel-size",
            "16",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "leader",
            "--master-port",
            "29501",
        ]);
        let f = p.launch_flags();
        assert_eq!(f.nnodes, Some(2));
        assert_eq!(f.node_rank, Some(1));
        assert_eq!(f.master_addr.as_deref(), Some("leader"));
        assert_eq!(f.master_port, Some(29501));
        // Node 1 of 2 launches ranks 8..16.
        match p.ranks(true).expect("a launch") {
            super::Ranks::Launch(places) => {
                let ranks: Vec<usize> = places.iter().map(|p| p.rank).collect();
                assert_eq!(ranks, (8..16).collect::<Vec<_>>());
                assert!(places.iter().all(|p| p.master.addr == "leader"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ranks_are_threads_on_the_cpu_and_processes_on_gpus_unless_told() {
        let p = serve(&["-t", "2"]);
        assert!(matches!(p.ranks(true), Ok(super::Ranks::Threads(s)) if s.world == 2));
        assert!(matches!(p.ranks(false), Ok(super::Ranks::Launch(ref v)) if v.len() == 2));
        let p = serve(&["-t", "2", "--distributed-executor-backend", "mp"]);
        assert!(matches!(p.ranks(true), Ok(super::Ranks::Launch(ref v)) if v.len() == 2));
        let p = serve(&["-t", "2", "--distributed-executor-backend", "threads"]);
        let e = p.ranks(false).expect_err("threads on a GPU").to_string();
        assert!(e.contains("--distributed-executor-backend mp"), "{e}");
        let p = serve(&["-t", "1", "--distributed-executor-backend", "mp"]);
        assert!(matches!(p.ranks(false), Ok(super::Ranks::One)));
        assert_eq!(
            p.launch_flags(),
            kimi_ops::bootstrap::LaunchFlags::default()
        );
    }
}
