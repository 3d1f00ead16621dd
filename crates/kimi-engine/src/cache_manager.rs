//! Cache capacity: MLA latent rows in fixed-size blocks, and one KDA state slot per running
//! sequence.
//!
//! Kimi Linear keeps two kinds of per-sequence state. MLA layers keep one latent row per
//! token, so their cache grows with the sequence; it is counted in blocks of `block_size`
//! tokens handed out from a free list, as vLLM's `BlockPool` and nano-vllm's `BlockManager`
//! do. KDA layers keep a recurrent state of fixed size, one "slot" per sequence whatever its
//! length (vLLM's `MambaSpec`).
//!
//! ```text
//! block pool: num_blocks = 8, block_size = 4            KDA state slots: 3
//! +----+----+----+----+----+----+----+----+             +----+----+----+
//! | b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7 |             | s0 | s1 | s2 |
//! +----+----+----+----+----+----+----+----+             +----+----+----+
//!   A    A    A    B    B
//!
//! seq A, 10 tokens: block table [b0, b1, b2]  slot s0   token i is row i % 4 of block i / 4;
//! seq B,  5 tokens: block table [b3, b4]      slot s1   b2 holds 2 rows, b4 holds 1
//! free blocks: [b5, b6, b7]                   free slots: [s2]
//!
//! A grows to 13 tokens: 13 > 3 * 4, so it takes b5 from the free list -> [b0, b1, b2, b5]
//! ```
//!
//! The ids index real storage: the model runner's `CachePool` holds, per MLA layer, one
//! pre-allocated `[num_blocks, block_size, r + rope]` pool (per Llama layer a key and a
//! value pool) and, per KDA layer, `num_slots` state slots. The backend reads and writes a
//! sequence's rows through its block table, so freeing a sequence here is all it takes to
//! reuse its memory.
//!
//! Beam search forks sequences ([`CacheManager::fork`]): the child shares the parent's
//! full blocks, which nobody writes again (a sequence only writes rows past its tokens),
//! so each block counts its holders and returns to the free list with the last one. The
//! partial last block would be written by both, so the child gets a copy of it (copy on
//! write, done at the fork), and a slot of its own for a copy of the KDA state.
//!
//! ```text
//! parent, 10 tokens: [b0, b1, b2]  slot s0      fork ─► child: [b0, b1, b5] slot s1
//!                     full  full  2 rows                     copy b2 → b5, s0 → s1
//! ```

use std::collections::VecDeque;

/// Index of an MLA cache block.
pub(crate) type BlockId = u32;

/// The capacity one sequence holds: its block table and its KDA state slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct SeqBlocks {
    /// Blocks in token order: token `i` lives in `block_ids[i / block_size]`.
    pub(crate) block_ids: Vec<BlockId>,
    /// KDA state slot, held while the sequence is running.
    pub(crate) slot: Option<u32>,
    /// Leading `block_ids` already sent to the model runner.
    num_sent: usize,
}

impl SeqBlocks {
    /// Blocks added since the last call (all of them after a free).
    pub(crate) fn take_new(&mut self) -> Vec<BlockId> {
        let new = self.block_ids[self.num_sent..].to_vec();
        self.num_sent = self.block_ids.len();
        new
    }
}

/// Hands out blocks and slots, and takes them back.
#[derive(Debug)]
pub(crate) struct CacheManager {
    block_size: usize,
    num_blocks: usize,
    /// Free blocks, reused oldest-freed first.
    free_blocks: VecDeque<BlockId>,
    /// Free KDA state slots.
    free_slots: Vec<u32>,
    /// Sequences holding each block.
    holders: Vec<u32>,
}

/// What a fork must copy in the cache pool before the child runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ForkCopy {
    /// The parent's partial last block and the child's copy of it.
    pub(crate) block: Option<(BlockId, BlockId)>,
    /// The parent's KDA state slot and the child's.
    pub(crate) slots: (u32, u32),
}

impl CacheManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens and `num_slots` state slots.
    pub(crate) fn new(num_blocks: usize, block_size: usize, num_slots: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            num_blocks,
            free_blocks: (0..num_blocks as BlockId).collect(),
            free_slots: (0..num_slots as u32).rev().collect(),
            holders: vec![0; num_blocks],
        }
    }

    /// Blocks that hold `num_tokens` tokens.
    pub(crate) fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Grows `seq` to hold `num_tokens` tokens, taking a slot if it has none. Returns false,
    /// changing nothing, when the free blocks or slots do not suffice.
    pub(crate) fn allocate(&mut self, seq: &mut SeqBlocks, num_tokens: usize) -> bool {
        let missing = self
            .blocks_for(num_tokens)
            .saturating_sub(seq.block_ids.len());
        let needs_slot = seq.slot.is_none();
        if missing > self.free_blocks.len() || (needs_slot && self.free_slots.is_empty()) {
            return false;
        }
        if needs_slot {
            seq.slot = self.free_slots.pop();
        }
        let new: Vec<BlockId> = self.free_blocks.drain(..missing).collect();
        for &b in &new {
            self.holders[b as usize] = 1;
        }
        seq.block_ids.extend(new);
        true
    }

    /// A child of `parent`, which holds `num_tokens` tokens in its cache: it shares the
    /// full blocks and gets a new block for the partial last one, and a slot; both copies
    /// are returned for the model runner to make. `None`, changing nothing, when no slot or
    /// block is free.
    pub(crate) fn fork(
        &mut self,
        parent: &SeqBlocks,
        num_tokens: usize,
    ) -> Option<(SeqBlocks, ForkCopy)> {
        let parent_slot = parent.slot?;
        let full = num_tokens / self.block_size;
        let partial = !num_tokens.is_multiple_of(self.block_size);
        if parent.block_ids.len() < full + usize::from(partial)
            || (partial && self.free_blocks.is_empty())
        {
            return None;
        }
        let slot = self.free_slots.pop()?;
        let mut block_ids = parent.block_ids[..full].to_vec();
        for &b in &block_ids {
            self.holders[b as usize] += 1;
        }
        let mut block = None;
        if partial {
            let dst = self.free_blocks.pop_front()?;
            self.holders[dst as usize] = 1;
            block_ids.push(dst);
            block = Some((parent.block_ids[full], dst));
        }
        let child = SeqBlocks {
            num_sent: block_ids.len(),
            block_ids,
            slot: Some(slot),
        };
        let copy = ForkCopy {
            block,
            slots: (parent_slot, slot),
        };
        Some((child, copy))
    }

    /// Lets go of every block and the slot of `seq`; a block no one else holds returns to
    /// the free list.
    pub(crate) fn free(&mut self, seq: &mut SeqBlocks) {
        for b in seq.block_ids.drain(..) {
            let holders = &mut self.holders[b as usize];
            *holders = holders.saturating_sub(1);
            if *holders == 0 {
                self.free_blocks.push_back(b);
            }
        }
        seq.num_sent = 0;
        if let Some(slot) = seq.slot.take() {
            self.free_slots.push(slot);
        }
    }

    /// Blocks not held by any sequence.
    #[cfg(test)]
    pub(crate) fn num_free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    /// Fraction of blocks in use, 0..1.
    pub(crate) fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        (self.num_blocks - self.free_blocks.len()) as f64 / self.num_blocks as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_block_by_block_and_frees_everything() {
        let mut cm = CacheManager::new(8, 4, 3);
        let mut a = SeqBlocks::default();
        assert!(cm.allocate(&mut a, 10));
        assert_eq!(a.block_ids, vec![0, 1, 2]);
        assert_eq!(a.slot, Some(0));
        assert!(cm.allocate(&mut a, 12), "12 tokens still fit in 3 blocks");
        assert_eq!(a.block_ids.len(), 3);
        assert!(cm.allocate(&mut a, 13));
        assert_eq!(a.block_ids, vec![0, 1, 2, 3]);
        assert_eq!(cm.num_free_blocks(), 4);
        assert!((cm.usage() - 0.5).abs() < 1e-12);
        cm.free(&mut a);
        assert_eq!(a, SeqBlocks::default());
        assert_eq!(cm.num_free_blocks(), 8);
        assert_eq!(cm.usage(), 0.0);
    }

    #[test]
    fn new_blocks_are_sent_once_and_again_after_a_free() {
        let mut cm = CacheManager::new(8, 4, 2);
        let mut a = SeqBlocks::default();
        assert!(cm.allocate(&mut a, 5));
        assert_eq!(a.take_new(), vec![0, 1]);
        assert!(cm.allocate(&mut a, 8));
        assert_eq!(a.take_new(), Vec::<BlockId>::new());
        assert!(cm.allocate(&mut a, 9));
        assert_eq!(a.take_new(), vec![2]);
        let mut b = SeqBlocks::default();
        assert!(cm.allocate(&mut b, 4));
        cm.free(&mut a);
        // Freed blocks are reused oldest-freed first, after the never-used ones.
        assert!(cm.allocate(&mut a, 20));
        assert_eq!(a.take_new(), vec![4, 5, 6, 7, 0]);
    }

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        let mut cm = CacheManager::new(8, 4, 3);
        let mut parent = SeqBlocks::default();
        assert!(cm.allocate(&mut parent, 10));
        parent.take_new();
        let (mut child, copy) = cm.fork(&parent, 10).expect("a block and a slot are free");
        assert_eq!(child.block_ids, vec![0, 1, 3]);
        assert_eq!(copy.block, Some((2, 3)));
        assert_eq!(copy.slots, (0, 1));
        assert!(
            child.take_new().is_empty(),
            "the fork hands the runner its table"
        );
        let (mut aligned, copy) = cm.fork(&parent, 8).expect("free");
        assert_eq!((aligned.block_ids.clone(), copy.block), (vec![0, 1], None));
        assert!(cm.fork(&parent, 8).is_none(), "no slot left");
        cm.free(&mut parent);
        cm.free(&mut aligned);
        assert_eq!(
            cm.num_free_blocks(),
            5,
            "blocks 0 and 1 are still the child's"
        );
        cm.free(&mut child);
        assert_eq!(cm.num_free_blocks(), 8);
        assert_eq!(cm.usage(), 0.0);
    }

    #[test]
    fn refuses_without_changing_anything() {
        let mut cm = CacheManager::new(4, 4, 2);
        let mut a = SeqBlocks::default();
        assert!(cm.allocate(&mut a, 12));
        let mut b = SeqBlocks::default();
        assert!(!cm.allocate(&mut b, 8), "needs 2 blocks, 1 is free");
        assert_eq!(b, SeqBlocks::default());
        assert!(cm.allocate(&mut b, 4));
        let mut c = SeqBlocks::default();
        assert!(!cm.allocate(&mut c, 0), "no slot left");
        assert_eq!(cm.num_free_blocks(), 0);
    }
}
