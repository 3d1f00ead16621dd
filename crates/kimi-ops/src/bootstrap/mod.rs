//! How the processes of a model split over GPUs find each other: which rank this process
//! is (the interface torchrun, Slurm and Kubernetes LeaderWorkerSet provide: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or vLLM's and SGLang's flags
//! `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`), the rendezvous that hands
//! rank 0's NCCL id to the others ([`rendezvous`]), and the byte codec of the small control
//! messages rank 0 sends its workers ([`codec`]). Tensors never pass here: they go over
//! NCCL.

pub mod codec;
pub mod rendezvous;

/// A failure to start or keep the group of rank processes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// The launch settings contradict each other or are missing.
    #[error("launch settings: {0}")]
    Settings(String),
    /// A rank did not come or answer in time.
    #[error("rendezvous timed out: {0}")]
    Timeout(String),
    /// A rank's connection ended (its process died or left).
    #[error("rank {0} closed its connection (its process ended?) while {1}")]
    PeerClosed(usize, String),
    /// A peer sent something this protocol does not allow.
    #[error("rendezvous: {0}")]
    Protocol(String),
    /// A socket failed.
    #[error("rendezvous: {0}")]
    Io(String),
}

/// torchrun's default port, which vLLM and SGLang users expect too.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launch flags (`None`: not given).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchFlags {
    /// `--nnodes`: nodes the ranks spread over (each starts `world / nnodes` ranks).
    pub nnodes: Option<usize>,
    /// `--node-rank`: this node, `0..nnodes`.
    pub node_rank: Option<usize>,
    /// `--master-addr`: where rank 0 listens for the rendezvous.
    pub master_addr: Option<String>,
    /// `--master-port`.
    pub master_port: Option<u16>,
}

/// Where rank 0 listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Master {
    /// Host name or address.
    pub addr: String,
    /// Port.
    pub port: u16,
}

/// One rank process's place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlace {
    /// `0..world`.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// This rank's GPU on its node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world: usize,
    /// Rank 0's rendezvous address.
    pub master: Master,
}

/// What this process does in a job of `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// One rank: no rendezvous.
    Single,
    /// A node's launcher: starts ranks `first..first + local` of `world`, one process per
    /// GPU (`local_rank` 0.., with `RANK`, `LOCAL_RANK`... set as [`RankPlace::env`] says).
    Launcher {
        /// The node's first rank.
        first: usize,
        /// Ranks (GPUs) on this node.
        local: usize,
        /// Ranks in the job.
        world: usize,
        /// Rank 0's rendezvous address.
        master: Master,
    },
    /// One rank process (started by a launcher: ours, torchrun, Slurm's `srun`).
    Rank(RankPlace),
}

impl RankPlace {
    /// The variables that make a started process this rank (what torchrun sets).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world.to_string()),
            ("MASTER_ADDR", self.master.addr.clone()),
            ("MASTER_PORT", self.master.port.to_string()),
        ]
    }
}

fn parse<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<T>, BootstrapError> {
    match env(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| {
            BootstrapError::Settings(format!("{name}={v:?} is not a number of the right range"))
        }),
    }
}

/// This process's role in a job of `world` ranks (`--tensor-parallel-size`), from the
/// flags and the environment `env` (a lookup, so that tests pass their own).
///
/// * `RANK` set: this process is that rank (torchrun, `srun` per GPU, or a process our
///   launcher started); `WORLD_SIZE` must equal `world`; `LOCAL_RANK` defaults to the rank
///   modulo the ranks per node. `--node-rank`, where given, must agree.
/// * else `--nnodes`/`--node-rank` (flags only: they are what LeaderWorkerSet's and
///   Slurm's scripts pass) or one node: this process launches its node's ranks.
/// * `--master-addr`/`--master-port` win over `MASTER_ADDR`/`MASTER_PORT`; the address
///   defaults to 127.0.0.1 on one node and is required on several; the port to 29500.
pub fn resolve(
    world: usize,
    flags: &LaunchFlags,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Role, BootstrapError> {
    let settings = |m: String| Err(BootstrapError::Settings(m));
    if world == 0 {
        return settings("--tensor-parallel-size must be at least 1".into());
    }
    let nnodes = flags.nnodes.unwrap_or(1);
    if nnodes == 0 || !world.is_multiple_of(nnodes) {
        return settings(format!(
            "--nnodes {nnodes}: the {world} ranks of --tensor-parallel-size do not split \
             evenly over the nodes"
        ));
    }
    let per_node = world / nnodes;
    let master = Master {
        addr: match (&flags.master_addr, env("MASTER_ADDR")) {
            (Some(a), _) => a.clone(),
            (None, Some(a)) if !a.trim().is_empty() => a.trim().to_string(),
            _ if nnodes > 1 => {
                return settings(format!(
                    "--nnodes {nnodes} needs rank 0's address: --master-addr or MASTER_ADDR"
                ))
            }
            _ => "127.0.0.1".into(),
        },
        port: match flags.master_port {
            Some(p) => p,
            None => parse(env, "MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT),
        },
    };
    if let Some(rank) = parse::<usize>(env, "RANK")? {
        let env_world = parse::<usize>(env, "WORLD_SIZE")?
            .ok_or_else(|| BootstrapError::Settings(format!("RANK={rank} without WORLD_SIZE")))?;
        if env_world != world {
            return settings(format!(
                "WORLD_SIZE={env_world} but --tensor-parallel-size {world}: start one process \
                 per rank of the model"
            ));
        }
        if rank >= world {
            return settings(format!("RANK={rank} of WORLD_SIZE={world}"));
        }
        let local_world = parse::<usize>(env, "LOCAL_WORLD_SIZE")?
            .unwrap_or(per_node)
            .max(1);
        let local_rank = parse::<usize>(env, "LOCAL_RANK")?.unwrap_or(rank % local_world);
        if let Some(node) = flags.node_rank {
            if rank / per_node != node {
                return settings(format!(
                    "RANK={rank} is on node {} of {nnodes}, not --node-rank {node}",
                    rank / per_node
                ));
            }
        }
        return Ok(Role::Rank(RankPlace {
            rank,
            world,
            local_rank,
            local_world,
            master,
        }));
    }
    if world == 1 {
        return Ok(Role::Single);
    }
    let node = match (flags.node_rank, nnodes) {
        (Some(n), _) if n >= nnodes => {
            return settings(format!("--node-rank {n} of --nnodes {nnodes}"))
        }
        (Some(n), _) => n,
        (None, 1) => 0,
        (None, _) => return settings(format!("--nnodes {nnodes} needs --node-rank")),
    };
    Ok(Role::Launcher {
        first: node * per_node,
        local: per_node,
        world,
        master,
    })
}

#[cfg(test)]
mod tests;
