//! The steps rank 0 hands every other rank ([`RankJob`]), what a rank does with one
//! ([`run_job`], the same for rank threads and rank processes), and their byte form for the
//! control link between processes: token ids, segments, block tables, slots and sampling
//! settings, never tensors (those meet in the collectives).

use kimi_ops::bootstrap::codec::{Reader, Writer};
use kimi_ops::bootstrap::BootstrapError;
use kimi_ops::{Backend, KdaMode, MlaMode, RowSampling, Segment, TokenPenalty};

use super::ExpertPlacement;
use crate::cache::{CachePool, SeqCache};
use crate::forward::{Batch, CausalLm, ForwardOptions, RowPicks};
use crate::{KimiLinear, ModelError, Result};
use std::sync::Arc;

/// What a rank is asked to do (every rank does the same with its part of the model).
#[derive(Clone, Debug)]
pub enum RankJob {
    /// Make its pool: `num_blocks` blocks of `block_size` tokens and `num_slots` slots.
    Pool {
        /// Blocks.
        num_blocks: usize,
        /// Tokens per block.
        block_size: usize,
        /// KDA state slots.
        num_slots: usize,
    },
    /// Make its pool for one sequence of up to `max_tokens` tokens.
    Single {
        /// Tokens the sequence may reach.
        max_tokens: usize,
    },
    /// Run a pass over its pool.
    Forward {
        /// The batch (the same on every rank).
        batch: Batch,
        /// The sequences' caches before the pass.
        seqs: Vec<SeqCache>,
        /// Kernel forms.
        opts: ForwardOptions,
    },
    /// Copy a state slot (and a block) within its pool, as [`CachePool::fork_state`].
    Fork {
        /// `(from, to)` slots.
        slots: (u32, u32),
        /// `(from, to)` blocks.
        block: Option<(u32, u32)>,
    },
    /// Read the experts this placement gives the rank (nothing in use changes yet).
    StageExperts(Arc<ExpertPlacement>),
    /// Put the staged placement in use.
    CommitExperts,
    /// Drop the staged placement.
    DiscardExperts,
}

impl RankJob {
    /// Whether the ranks meet in collectives while running the job, so that one rank's
    /// failure must abort the others' waits (a placement's jobs are each rank's alone).
    pub fn meets_in_collectives(&self) -> bool {
        !matches!(
            self,
            Self::StageExperts(_) | Self::CommitExperts | Self::DiscardExperts
        )
    }

    /// [`RankJob::meets_in_collectives`] of an encoded job, read from its kind alone (for
    /// a message that does not decode: rank 0 sent a job of that kind).
    pub fn encoded_meets_in_collectives(bytes: &[u8]) -> bool {
        !matches!(
            bytes.first(),
            Some(&(STAGE_EXPERTS | COMMIT_EXPERTS | DISCARD_EXPERTS))
        )
    }
}

/// Runs `job` on a rank's part and pool (made by the first `Pool`/`Single` job).
pub fn run_job<B: Backend>(
    model: &mut KimiLinear<B>,
    pool: &mut Option<CachePool<B>>,
    job: RankJob,
) -> Result<()> {
    match job {
        RankJob::Pool {
            num_blocks,
            block_size,
            num_slots,
        } => model
            .new_pool(num_blocks, block_size, num_slots)
            .map(|p| *pool = Some(p)),
        RankJob::Single { max_tokens } => {
            model.single_cache(max_tokens).map(|(p, _)| *pool = Some(p))
        }
        RankJob::Forward {
            batch,
            mut seqs,
            opts,
        } => match pool.as_mut() {
            Some(pool) => {
                let mut refs: Vec<&mut SeqCache> = seqs.iter_mut().collect();
                model.forward(&batch, pool, &mut refs, opts).map(drop)
            }
            None => Err(ModelError::Input("a pass before the pool was made".into())),
        },
        RankJob::Fork { slots, block } => match pool.as_mut() {
            Some(pool) => pool.fork_state(model.backend(), slots, block),
            None => Err(ModelError::Input("a fork before the pool was made".into())),
        },
        RankJob::StageExperts(placement) => model.stage_expert_ranks(placement),
        RankJob::CommitExperts => model.commit_expert_ranks(),
        RankJob::DiscardExperts => {
            model.discard_staged_expert_ranks();
            Ok(())
        }
    }
}

const POOL: u8 = 1;
const SINGLE: u8 = 2;
const FORWARD: u8 = 3;
const FORK: u8 = 4;
/// The most ranks a placement job may name (bounds what a message makes a rank allocate).
const MAX_RANKS: usize = 1 << 16;
const STAGE_EXPERTS: u8 = 5;
const COMMIT_EXPERTS: u8 = 6;
const DISCARD_EXPERTS: u8 = 7;

fn kda_code(m: KdaMode) -> u8 {
    match m {
        KdaMode::Auto => 0,
        KdaMode::Recurrent => 1,
        KdaMode::Chunked => 2,
    }
}

fn mla_code(m: MlaMode) -> u8 {
    match m {
        MlaMode::Auto => 0,
        MlaMode::Expanded => 1,
        MlaMode::Absorbed => 2,
    }
}

fn pair(w: &mut Writer, p: Option<(u32, u32)>) {
    match p {
        Some((a, b)) => w.bool(true).u32(a).u32(b),
        None => w.bool(false),
    };
}

impl RankJob {
    /// The job as a control message.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Self::Pool {
                num_blocks,
                block_size,
                num_slots,
            } => {
                w.u8(POOL)
                    .usize(*num_blocks)
                    .usize(*block_size)
                    .usize(*num_slots);
            }
            Self::Single { max_tokens } => {
                w.u8(SINGLE).usize(*max_tokens);
            }
            Self::Forward { batch, seqs, opts } => {
                w.u8(FORWARD)
                    .u32s(&batch.tokens)
                    .usize(batch.segments.len());
                for s in &batch.segments {
                    w.usize(s.start).usize(s.len);
                }
                w.usize(batch.logits_rows.len());
                batch.logits_rows.iter().for_each(|&r| {
                    w.usize(r);
                });
                match &batch.sampling {
                    None => {
                        w.bool(false);
                    }
                    Some(p) => {
                        w.bool(true).usize(p.rows.len());
                        for r in &p.rows {
                            w.f32(r.temperature).u32(r.top_k).f32(r.top_p).f32(r.min_p);
                            w.f32(r.repetition_penalty)
                                .f32(r.frequency_penalty)
                                .f32(r.presence_penalty)
                                .f32(r.uniform);
                        }
                        w.usize(p.penalties.len());
                        for t in &p.penalties {
                            w.u32(t.row).u32(t.token).u32(t.count);
                        }
                    }
                }
                w.usize(seqs.len());
                for s in seqs {
                    w.u32s(&s.block_table).u32(s.slot).usize(s.num_tokens);
                }
                w.u8(kda_code(opts.kda_mode))
                    .u8(mla_code(opts.mla_mode))
                    .bool(opts.greedy_ids);
            }
            Self::Fork { slots, block } => {
                w.u8(FORK);
                pair(&mut w, Some(*slots));
                pair(&mut w, *block);
            }
            Self::StageExperts(p) => {
                w.u8(STAGE_EXPERTS).usize(p.world());
                let layers: Vec<(usize, &[usize])> = p.layers().collect();
                w.usize(layers.len());
                for (layer, owners) in layers {
                    let owners: Vec<u32> = owners.iter().map(|&o| o as u32).collect();
                    w.usize(layer).u32s(&owners);
                }
            }
            Self::CommitExperts => {
                w.u8(COMMIT_EXPERTS);
            }
            Self::DiscardExperts => {
                w.u8(DISCARD_EXPERTS);
            }
        }
        w.finish()
    }

    /// A job from [`RankJob::encode`]'s bytes.
    pub fn decode(bytes: &[u8]) -> std::result::Result<Self, BootstrapError> {
        let mut r = Reader::new(bytes, "rank job");
        let job = match r.u8()? {
            POOL => Self::Pool {
                num_blocks: r.usize()?,
                block_size: r.usize()?,
                num_slots: r.usize()?,
            },
            SINGLE => Self::Single {
                max_tokens: r.usize()?,
            },
            FORWARD => {
                let tokens = r.u32s()?;
                let segments = (0..r.count(16)?)
                    .map(|_| {
                        Ok(Segment {
                            start: r.usize()?,
                            len: r.usize()?,
                        })
                    })
                    .collect::<std::result::Result<_, BootstrapError>>()?;
                let logits_rows = (0..r.count(8)?)
                    .map(|_| r.usize())
                    .collect::<std::result::Result<_, _>>()?;
                let sampling = match r.bool()? {
                    false => None,
                    true => {
                        let rows = (0..r.count(32)?)
                            .map(|_| {
                                Ok(RowSampling {
                                    temperature: r.f32()?,
                                    top_k: r.u32()?,
                                    top_p: r.f32()?,
                                    min_p: r.f32()?,
                                    repetition_penalty: r.f32()?,
                                    frequency_penalty: r.f32()?,
                                    presence_penalty: r.f32()?,
                                    uniform: r.f32()?,
                                })
                            })
                            .collect::<std::result::Result<_, BootstrapError>>()?;
                        let penalties = (0..r.count(12)?)
                            .map(|_| {
                                Ok(TokenPenalty {
                                    row: r.u32()?,
                                    token: r.u32()?,
                                    count: r.u32()?,
                                })
                            })
                            .collect::<std::result::Result<_, BootstrapError>>()?;
                        Some(RowPicks { rows, penalties })
                    }
                };
                let seqs = (0..r.count(20)?)
                    .map(|_| {
                        Ok(SeqCache {
                            block_table: r.u32s()?,
                            slot: r.u32()?,
                            num_tokens: r.usize()?,
                        })
                    })
                    .collect::<std::result::Result<_, BootstrapError>>()?;
                let kda_mode = match r.u8()? {
                    0 => KdaMode::Auto,
                    1 => KdaMode::Recurrent,
                    2 => KdaMode::Chunked,
                    m => return Err(r.bad(format!("KDA mode {m}"))),
                };
                let mla_mode = match r.u8()? {
                    0 => MlaMode::Auto,
                    1 => MlaMode::Expanded,
                    2 => MlaMode::Absorbed,
                    m => return Err(r.bad(format!("MLA mode {m}"))),
                };
                Self::Forward {
                    batch: Batch {
                        tokens,
                        segments,
                        logits_rows,
                        sampling,
                    },
                    seqs,
                    opts: ForwardOptions {
                        kda_mode,
                        mla_mode,
                        greedy_ids: r.bool()?,
                    },
                }
            }
            FORK => {
                let slots =
                    read_pair(&mut r)?.ok_or_else(|| r.bad("a fork without slots".into()))?;
                Self::Fork {
                    slots,
                    block: read_pair(&mut r)?,
                }
            }
            STAGE_EXPERTS => {
                let world = r.usize()?;
                if world == 0 || world > MAX_RANKS {
                    return Err(r.bad(format!("an expert placement over {world} ranks")));
                }
                let mut owners = std::collections::BTreeMap::new();
                for _ in 0..r.count(16)? {
                    let layer = r.usize()?;
                    let o = r.u32s()?;
                    owners.insert(layer, o.into_iter().map(|x| x as usize).collect());
                }
                let p = ExpertPlacement::from_owners(world, owners)
                    .map_err(|e| r.bad(e.to_string()))?;
                Self::StageExperts(Arc::new(p))
            }
            COMMIT_EXPERTS => Self::CommitExperts,
            DISCARD_EXPERTS => Self::DiscardExperts,
            k => return Err(r.bad(format!("job kind {k}"))),
        };
        r.end()?;
        Ok(job)
    }
}

fn read_pair(r: &mut Reader<'_>) -> std::result::Result<Option<(u32, u32)>, BootstrapError> {
    Ok(match r.bool()? {
        true => Some((r.u32()?, r.u32()?)),
        false => None,
    })
}

/// A rank's answer to a job as a control message: empty for done, else the error's text.
pub fn encode_reply(result: &std::result::Result<(), String>) -> Vec<u8> {
    let mut w = Writer::new();
    match result {
        Ok(()) => w.bool(true),
        Err(e) => w.bool(false).str(e),
    };
    w.finish()
}

/// A reply from [`encode_reply`]'s bytes.
pub fn decode_reply(
    bytes: &[u8],
) -> std::result::Result<std::result::Result<(), String>, BootstrapError> {
    let mut r = Reader::new(bytes, "rank reply");
    let out = match r.bool()? {
        true => Ok(()),
        false => Err(r.str()?),
    };
    r.end()?;
    Ok(out)
}
