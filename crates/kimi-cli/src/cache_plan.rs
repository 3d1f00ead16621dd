//! Sizing `serve`'s cache pool: never more than the configuration can use
//! (`--max-num-seqs` sequences of `--max-model-len` tokens), never more than the memory
//! budget, every product of flags checked so that a huge value is an error naming it
//! rather than an overflow or an aborting allocation.

use anyhow::{bail, Context};

use crate::memory::HostMemory;

/// Both backends keep cache values in at most 4 bytes (f32; the CPU's int8 mode uses f16).
const BYTES_PER_VALUE: u64 = 4;

/// `--gpu-memory-utilization` when not given: vLLM's on a GPU; on the CPU half of what the
/// process may take, leaving the rest to the page cache that holds the mapped weights, the
/// request buffers and whatever else runs on the host.
pub const DEFAULT_GPU_UTILIZATION: f64 = 0.9;
/// See [`DEFAULT_GPU_UTILIZATION`].
pub const DEFAULT_CPU_UTILIZATION: f64 = 0.5;

/// The most sequences one engine schedules.
pub const MAX_NUM_SEQS: usize = 1 << 20;

/// What the plan is made from.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub max_num_batched_tokens: usize,
    /// Cache values each token adds (over the block-pooled layers).
    pub values_per_token: u64,
    /// Cache values of one state slot (KDA layers).
    pub values_per_slot: u64,
}

/// Where the memory for the pool comes from.
#[derive(Clone, Copy, Debug)]
pub enum Budget {
    /// A GPU: free and total bytes after the weights, and one step's workspace if measured.
    Device {
        free: u64,
        total: u64,
        utilization: f64,
        workspace: Option<u64>,
    },
    /// Host RAM: `usable` bytes; `fixed` from `--kv-cache-memory-bytes`.
    Host {
        memory: HostMemory,
        utilization: f64,
        fixed: Option<u64>,
    },
}

/// The pool to allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachePlan {
    pub num_blocks: usize,
    /// Blocks and state slots, in bytes.
    pub pool_bytes: u64,
    /// Blocks one full-length sequence needs.
    pub blocks_per_seq: usize,
    /// Whether the pool holds `max_num_seqs` full-length sequences.
    pub holds_all: bool,
}

impl Shape {
    /// Checks the flags that size the pool.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.max_num_seqs == 0 {
            bail!("--max-num-seqs must be at least 1");
        }
        // Per-sequence bookkeeping (state slots, free lists) is sized by it.
        if self.max_num_seqs > MAX_NUM_SEQS {
            bail!(
                "--max-num-seqs {} is more than {MAX_NUM_SEQS}",
                self.max_num_seqs
            );
        }
        if self.block_size == 0 {
            bail!("--block-size must be at least 1");
        }
        if self.max_num_batched_tokens == 0 {
            bail!("--max-num-batched-tokens must be at least 1");
        }
        if self.max_model_len < 2 {
            bail!(
                "--max-model-len must be at least 2 (a prompt token and a generated one), got {}",
                self.max_model_len
            );
        }
        Ok(())
    }

    fn block_bytes(&self) -> anyhow::Result<u64> {
        (self.block_size as u64)
            .checked_mul(self.values_per_token)
            .and_then(|v| v.checked_mul(BYTES_PER_VALUE))
            .map(|b| b.max(1))
            .with_context(|| format!("--block-size {} is too large", self.block_size))
    }

    fn state_bytes(&self) -> anyhow::Result<u64> {
        (self.max_num_seqs as u64)
            .checked_mul(self.values_per_slot)
            .and_then(|v| v.checked_mul(BYTES_PER_VALUE))
            .with_context(|| format!("--max-num-seqs {} is too large", self.max_num_seqs))
    }

    /// Bytes of a pool of `num_blocks` blocks and the state slots.
    pub fn pool_bytes(&self, num_blocks: usize) -> anyhow::Result<u64> {
        (num_blocks as u64)
            .checked_mul(self.block_bytes()?)
            .and_then(|b| b.checked_add(self.state_bytes().ok()?))
            .with_context(|| {
                format!(
                    "a pool of {num_blocks} blocks of {} tokens is too large",
                    self.block_size
                )
            })
    }
}

/// The pool for `--num-gpu-blocks-override`: exactly that, if the memory left holds it.
pub fn fixed(shape: &Shape, num_blocks: usize, room: Option<u64>) -> anyhow::Result<CachePlan> {
    shape.validate()?;
    let blocks_per_seq = shape.max_model_len.div_ceil(shape.block_size);
    if num_blocks < blocks_per_seq {
        bail!(
            "--num-gpu-blocks-override {num_blocks} holds less than one {}-token sequence \
             ({blocks_per_seq} blocks of {})",
            shape.max_model_len,
            shape.block_size
        );
    }
    let pool_bytes = shape
        .pool_bytes(num_blocks)
        .context("--num-gpu-blocks-override")?;
    if let Some(room) = room.filter(|&room| pool_bytes > room) {
        bail!(
            "--num-gpu-blocks-override {num_blocks} needs a {} cache pool, but only {} of \
             memory is left",
            gib(pool_bytes),
            gib(room)
        );
    }
    Ok(CachePlan {
        num_blocks,
        pool_bytes,
        blocks_per_seq,
        holds_all: num_blocks / blocks_per_seq >= shape.max_num_seqs,
    })
}

/// The pool that fits `budget`, capped at what the configuration can use.
pub fn plan(shape: &Shape, budget: Budget) -> anyhow::Result<CachePlan> {
    shape.validate()?;
    let blocks_per_seq = shape.max_model_len.div_ceil(shape.block_size);
    let wanted = shape
        .max_num_seqs
        .checked_mul(blocks_per_seq)
        .with_context(|| {
            format!(
                "--max-num-seqs {} × --max-model-len {} is too large",
                shape.max_num_seqs, shape.max_model_len
            )
        })?;
    let block_bytes = shape.block_bytes()?;
    let state_bytes = shape.state_bytes()?;
    let (budget_bytes, what) = match budget {
        Budget::Device {
            free,
            total,
            utilization,
            workspace,
        } => {
            let used = total.saturating_sub(free);
            let workspace =
                workspace.unwrap_or((shape.max_num_batched_tokens as u64).saturating_mul(64 << 10));
            let bytes = ((total as f64 * utilization) as u64)
                .saturating_sub(used)
                .saturating_sub(workspace);
            (
                bytes,
                format!("--gpu-memory-utilization {utilization} of the GPU"),
            )
        }
        Budget::Host {
            fixed: Some(bytes), ..
        } => (bytes, format!("--kv-cache-memory-bytes {bytes}")),
        Budget::Host {
            memory,
            utilization,
            fixed: None,
        } => match memory.usable() {
            Some(usable) => (
                (usable as f64 * utilization) as u64,
                format!(
                    "--gpu-memory-utilization {utilization} of {}",
                    memory.describe()
                ),
            ),
            // Nothing says how much memory there is: take what the configuration asks.
            None => (u64::MAX, String::new()),
        },
    };
    let blocks = budget_bytes.saturating_sub(state_bytes) / block_bytes;
    let num_blocks = usize::try_from(blocks).unwrap_or(usize::MAX).min(wanted);
    if num_blocks < blocks_per_seq {
        let one = shape.pool_bytes(blocks_per_seq).unwrap_or(u64::MAX);
        bail!(
            "not enough memory for the cache of one {}-token sequence: it needs {}, and \
             {what} leaves {}; lower --max-model-len or --max-num-seqs",
            shape.max_model_len,
            gib(one),
            gib(budget_bytes)
        );
    }
    Ok(CachePlan {
        num_blocks,
        pool_bytes: shape.pool_bytes(num_blocks)?,
        blocks_per_seq,
        holds_all: num_blocks == wanted,
    })
}

/// "1.25 GiB".
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// "93.8 MiB" below a GiB, else as [`gib`].
pub fn size(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        gib(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::CgroupMemory;

    fn shape() -> Shape {
        Shape {
            block_size: 16,
            max_num_seqs: 64,
            max_model_len: 8192,
            max_num_batched_tokens: 2048,
            // SmolLM2-135M: 30 layers × K and V × 3 heads × 64.
            values_per_token: 11_520,
            values_per_slot: 0,
        }
    }

    fn host(available: u64, cgroup: Option<(u64, u64)>) -> Budget {
        Budget::Host {
            memory: HostMemory {
                available: Some(available),
                cgroup: cgroup.map(|(limit, working_set)| CgroupMemory { limit, working_set }),
            },
            utilization: DEFAULT_CPU_UTILIZATION,
            fixed: None,
        }
    }

    #[test]
    fn the_pool_is_what_the_configuration_uses_when_it_fits() {
        let mut s = shape();
        s.max_num_seqs = 4;
        s.max_model_len = 2048;
        let p = plan(&s, host(20 << 30, None)).expect("fits");
        assert_eq!(p.num_blocks, 4 * 128);
        assert!(p.holds_all);
        assert_eq!(p.pool_bytes, 4 * 2048 * 11_520 * 4);
    }

    #[test]
    fn the_cgroup_limit_bounds_the_pool_not_the_host() {
        // A 20 GiB host, a container limited to 4 GiB of which 1 GiB is in use.
        let p = plan(&shape(), host(20 << 30, Some((4 << 30, 1 << 30)))).expect("fits");
        assert!(!p.holds_all);
        assert!(p.pool_bytes <= (3 << 30) / 2, "{}", gib(p.pool_bytes));
        let whole_host = plan(&shape(), host(20 << 30, None)).expect("fits");
        assert!(whole_host.pool_bytes <= 10 << 30);
        assert!(whole_host.pool_bytes > p.pool_bytes);
    }

    #[test]
    fn too_little_memory_names_the_sizes_and_flags() {
        let err = plan(&shape(), host(64 << 20, None)).expect_err("too small");
        let text = format!("{err:#}");
        assert!(text.contains("8192-token sequence"), "{text}");
        assert!(text.contains("--gpu-memory-utilization"), "{text}");
        assert!(text.contains("--max-model-len"), "{text}");
    }

    #[test]
    fn zero_and_huge_flags_are_named() {
        let mut s = shape();
        s.max_num_seqs = 0;
        let err = plan(&s, host(20 << 30, None)).expect_err("zero");
        assert_eq!(format!("{err:#}"), "--max-num-seqs must be at least 1");
        let mut s = shape();
        s.max_num_seqs = usize::MAX / 2;
        let err = plan(&s, host(20 << 30, None)).expect_err("too many");
        assert!(format!("{err:#}").contains("--max-num-seqs"), "{err:#}");
        let mut s = shape();
        s.max_num_seqs = MAX_NUM_SEQS;
        s.max_model_len = usize::MAX / 4;
        let err = plan(&s, host(20 << 30, None)).expect_err("overflow");
        assert!(format!("{err:#}").contains("is too large"), "{err:#}");
        let err = fixed(&shape(), usize::MAX, Some(20 << 30)).expect_err("huge");
        assert!(
            format!("{err:#}").contains("--num-gpu-blocks-override"),
            "{err:#}"
        );
        let err = fixed(&shape(), 100_000_000, Some(20 << 30)).expect_err("too big");
        let text = format!("{err:#}");
        assert!(
            text.contains("--num-gpu-blocks-override 100000000 needs a"),
            "{text}"
        );
        assert!(fixed(&shape(), 1024, Some(20 << 30)).is_ok());
    }

    #[test]
    fn a_fixed_budget_and_a_device() {
        let fixed_budget = Budget::Host {
            memory: HostMemory {
                available: Some(20 << 30),
                cgroup: None,
            },
            utilization: DEFAULT_CPU_UTILIZATION,
            fixed: Some(1 << 30),
        };
        let p = plan(&shape(), fixed_budget).expect("fits");
        assert!(p.pool_bytes <= 1 << 30 && p.pool_bytes > (1 << 30) - (1 << 20));
        let device = Budget::Device {
            free: 100 << 30,
            total: 140 << 30,
            utilization: 0.9,
            workspace: Some(1 << 30),
        };
        let p = plan(&shape(), device).expect("fits");
        assert!(p.holds_all);
    }
}
