//! The flags that split a model over several ranks of this process.

use clap::{Args, ValueEnum};
use kimi_model::parallel::{ExpertDispatch, ExpertSplit};

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

/// Flags of [`crate::args::ModelArgs`] for tensor and expert parallelism.
#[derive(Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Split the model over N ranks (vLLM's flag): attention heads, dense MLPs and shared
    /// experts by tensor parallelism, each rank a thread of this process meeting the others
    /// in an all-reduce per sublayer. CPU backend only for now; heads and widths must
    /// divide by N.
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
    /// Seconds a rank waits for the others in one collective before the step fails.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub collective_timeout: u64,
    /// With `--enable-expert-parallel`, place the experts so that each rank's receive about
    /// the same number of tokens, by the counts in FILE: a saved `/metrics` of `kimi-infer
    /// serve` (its `kimi:moe_expert_tokens_total` lines). Every rank still holds as many
    /// experts.
    #[arg(long, value_name = "FILE", requires = "enable_expert_parallel")]
    pub expert_load: Option<std::path::PathBuf>,
}

impl Default for ParallelArgs {
    fn default() -> Self {
        Self {
            tensor_parallel_size: 1,
            enable_expert_parallel: false,
            expert_dispatch: DispatchArg::AllReduce,
            collective_timeout: 600,
            expert_load: None,
        }
    }
}

impl ParallelArgs {
    /// `(ranks, expert split, timeout)` where the model is split; `None` for one rank.
    pub fn split(&self) -> anyhow::Result<Option<(usize, ExpertSplit, std::time::Duration)>> {
        anyhow::ensure!(
            self.tensor_parallel_size >= 1,
            "--tensor-parallel-size must be at least 1"
        );
        anyhow::ensure!(
            self.collective_timeout >= 1,
            "--collective-timeout must be at least 1 second"
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
        Ok(Some((
            self.tensor_parallel_size,
            experts,
            std::time::Duration::from_secs(self.collective_timeout),
        )))
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
