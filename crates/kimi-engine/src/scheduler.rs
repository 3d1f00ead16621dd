//! The continuous-batching scheduler: waiting and running queues, the token budget of a
//! step, admission and preemption.
//!
//! As in vLLM v1 there are no phases: a sequence has `tokens` (prompt and output so far) and
//! `num_computed_tokens` (those already in its cache), and each step moves the second
//! toward the first. A running sequence with one token left is decoding; one with more is
//! in (chunked) prefill. [`Scheduler::schedule`] fills one step:
//!
//! ```text
//! budget = max_num_batched_tokens
//! 1. decode   every running sequence with 1 token left, oldest first; when its cache
//!             needs a block and none is free, preempt the newest running sequence
//! 2. prefill  running sequences with more left: min(left, budget) tokens each
//! 3. admit    waiting sequences in FIFO order while max_num_seqs, the budget and the free
//!             blocks (for all their tokens) allow; skipped in a step that preempted
//! ```
//!
//! Preemption is by recompute (vLLM's `PreemptionMode.RECOMPUTE`): the victim loses its
//! cache and blocks and goes back to the front of the waiting queue with its output kept;
//! when admitted again all its tokens are prefilled anew.
//!
//! A beam search is a group of sequences (its beams) that takes `num_beams` of the
//! `max_num_seqs` seats from the admission of its first beam until its last one leaves, so
//! forks always find a seat and a state slot. A beam waiting for its group's other rows has
//! no token left and is not scheduled.
//!
//! The scheduler advances `num_computed_tokens` when it schedules (the forward pass is
//! assumed to succeed; a failed step removes its sequences). The engine loop then appends
//! each sampled token with [`Scheduler::append_token`] or removes finished sequences.

use std::collections::{HashMap, VecDeque};

use kimi_core::TokenId;

use crate::cache_manager::{CacheManager, ForkCopy, SeqBlocks};
use crate::serving::RequestId;

/// One request's tokens and progress.
#[derive(Debug)]
pub(crate) struct Sequence {
    /// Prompt tokens followed by the output so far.
    pub(crate) tokens: Vec<TokenId>,
    /// How many of `tokens` are prompt.
    pub(crate) num_prompt_tokens: usize,
    /// Tokens already in the sequence's cache.
    pub(crate) num_computed_tokens: usize,
    blocks: SeqBlocks,
    /// The beam search it belongs to, with the group's width.
    group: Option<(RequestId, usize)>,
}

impl Sequence {
    /// The prompt and the output so far.
    pub(crate) fn prompt_and_output(&self) -> (&[TokenId], &[TokenId]) {
        self.tokens.split_at(self.num_prompt_tokens)
    }

    /// Output tokens so far.
    pub(crate) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    fn num_left(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }
}

/// The new tokens of one sequence in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Whose tokens.
    pub(crate) id: RequestId,
    /// Position of the first token in the sequence (0: its cache starts empty).
    pub(crate) start: usize,
    /// The tokens, `tokens[start..start + len]` of the sequence.
    pub(crate) tokens: Vec<TokenId>,
    /// The chunk ends the sequence's known tokens, so the next token is sampled from the
    /// logits of its last row.
    pub(crate) samples: bool,
    /// The sequence's KDA state slot.
    pub(crate) slot: u32,
    /// Blocks appended to the sequence's block table since its previous chunk (its whole
    /// table when `start` is 0).
    pub(crate) new_blocks: Vec<u32>,
}

/// What one step runs.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    /// Decodes first, then prefill chunks; segment `i` of the batch is `chunks[i]`.
    pub(crate) chunks: Vec<Chunk>,
    /// Sequences preempted by this step; their caches must be dropped.
    pub(crate) preempted: Vec<RequestId>,
}

/// Queues, budget and preemption policy. Knows nothing of the model.
#[derive(Debug)]
pub(crate) struct Scheduler {
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    cache: CacheManager,
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    /// Oldest admission first; preemption takes from the back.
    running: Vec<RequestId>,
    num_preemptions: u64,
    /// Beam groups admitted: their width in seats, and how many of their beams remain.
    groups: HashMap<RequestId, (usize, usize)>,
}

/// Where a forked beam's cache comes from.
#[derive(Debug)]
pub(crate) enum Forked {
    /// It shares its parent's cache: the runner copies what [`ForkCopy`] says, and the
    /// child's table is `block_ids`.
    Shared { copy: ForkCopy, block_ids: Vec<u32> },
    /// No cache to share or no room: it waits to be prefilled from scratch.
    Recompute,
}

impl Scheduler {
    /// A scheduler over `cache`.
    pub(crate) fn new(
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        cache: CacheManager,
    ) -> Self {
        Self {
            max_num_seqs,
            max_num_batched_tokens,
            cache,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
            groups: HashMap::new(),
        }
    }

    /// Queues a new sequence at the back of the waiting queue.
    pub(crate) fn add(&mut self, id: RequestId, prompt: Vec<TokenId>) {
        self.add_sequence(id, prompt, None);
    }

    /// Queues the first beam of a beam search `width` beams wide; its id names the group.
    pub(crate) fn add_beams(&mut self, id: RequestId, prompt: Vec<TokenId>, width: usize) {
        self.add_sequence(id, prompt, Some((id, width.max(1))));
    }

    fn add_sequence(
        &mut self,
        id: RequestId,
        prompt: Vec<TokenId>,
        group: Option<(RequestId, usize)>,
    ) {
        let seq = Sequence {
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            num_computed_tokens: 0,
            blocks: SeqBlocks::default(),
            group,
        };
        if self.seqs.insert(id, seq).is_none() {
            self.waiting.push_back(id);
        }
    }

    /// Removes a sequence wherever it is and frees its capacity. Returns it if it existed.
    pub(crate) fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.cache.free(&mut seq.blocks);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        if let Some((group, _)) = seq.group {
            if let Some(members) = self.groups.get_mut(&group).map(|g| &mut g.1) {
                *members = members.saturating_sub(1);
                if *members == 0 {
                    self.groups.remove(&group);
                }
            }
        }
        Some(seq)
    }

    /// A new beam `child`: `parent`'s tokens then `token`. It shares the parent's cache when
    /// the parent has its tokens cached and a block and slot are free; otherwise it waits
    /// to be prefilled. Returns how, or `None` when `parent` is unknown.
    pub(crate) fn fork(
        &mut self,
        parent: RequestId,
        child: RequestId,
        token: TokenId,
    ) -> Option<Forked> {
        let p = self.seqs.get(&parent)?;
        let mut tokens = p.tokens.clone();
        tokens.push(token);
        let cached = p.num_computed_tokens == p.tokens.len() && self.running.contains(&parent);
        let shared = if cached {
            self.cache.fork(&p.blocks, p.num_computed_tokens)
        } else {
            None
        };
        let mut seq = Sequence {
            tokens,
            num_prompt_tokens: p.num_prompt_tokens,
            num_computed_tokens: 0,
            blocks: SeqBlocks::default(),
            group: p.group,
        };
        if let Some((group, _)) = seq.group {
            if let Some(g) = self.groups.get_mut(&group) {
                g.1 += 1;
            }
        }
        let forked = match shared {
            Some((blocks, copy)) => {
                seq.num_computed_tokens = p.num_computed_tokens;
                let block_ids = blocks.block_ids.clone();
                seq.blocks = blocks;
                self.running.push(child);
                Forked::Shared { copy, block_ids }
            }
            None => {
                self.waiting.push_front(child);
                Forked::Recompute
            }
        };
        self.seqs.insert(child, seq);
        Some(forked)
    }

    /// Drops the cache of `id` (the runner could not fork it) so that it is prefilled anew.
    pub(crate) fn recompute(&mut self, id: RequestId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        self.cache.free(&mut seq.blocks);
        seq.num_computed_tokens = 0;
        if self.running.contains(&id) {
            self.running.retain(|&r| r != id);
            self.waiting.push_front(id);
        }
    }

    /// Seats taken: running sequences outside beam groups, plus every admitted group's
    /// width.
    fn seats_taken(&self) -> usize {
        let plain = self
            .running
            .iter()
            .filter(|id| self.seqs.get(id).is_some_and(|s| s.group.is_none()))
            .count();
        plain + self.groups.values().map(|g| g.0).sum::<usize>()
    }

    /// The sequence `id`, if it is waiting or running.
    pub(crate) fn get(&self, id: RequestId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// Appends a sampled token; the next step feeds it.
    pub(crate) fn append_token(&mut self, id: RequestId, token: TokenId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
        }
    }

    /// Every sequence, waiting or running.
    pub(crate) fn ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.seqs.keys().copied()
    }

    /// No sequence is waiting or running.
    pub(crate) fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Sequences admitted and not preempted.
    pub(crate) fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting for admission (new or preempted).
    pub(crate) fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Fraction of cache blocks in use.
    pub(crate) fn cache_usage(&self) -> f64 {
        self.cache.usage()
    }

    /// Preemptions since start.
    pub(crate) fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Plans the next step (see the module docs) and advances `num_computed_tokens` of every
    /// scheduled sequence.
    pub(crate) fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.max_num_batched_tokens;
        self.schedule_decodes(&mut plan, &mut budget);
        self.schedule_prefills(&mut plan, &mut budget);
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut plan, &mut budget);
        }
        if plan.chunks.is_empty() && !self.waiting.is_empty() {
            // Nothing can run: beams waiting for their group hold the blocks the waiting
            // sequences need. Their rows are kept, so dropping their caches loses nothing
            // but the recompute.
            self.release_idle();
            self.admit_waiting(&mut plan, &mut budget);
        }
        plan
    }

    /// Frees the cache of every running sequence with no token left (a beam waiting for
    /// its group) and queues it behind the waiting ones, to be prefilled again.
    fn release_idle(&mut self) {
        let idle: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs.get(id).is_some_and(|s| s.num_left() == 0))
            .collect();
        for id in idle {
            if let Some(seq) = self.seqs.get_mut(&id) {
                self.cache.free(&mut seq.blocks);
                seq.num_computed_tokens = 0;
            }
            self.running.retain(|&r| r != id);
            self.waiting.push_back(id);
        }
    }

    /// Step 1: one token for every running sequence that has one left, growing its block
    /// table, preempting the newest running sequences while no block is free.
    fn schedule_decodes(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            if self.seqs.get(&id).is_none_or(|s| s.num_left() != 1) {
                i += 1;
                continue;
            }
            if self.grow_or_preempt(id, plan) {
                self.schedule_chunk(id, 1, plan, budget);
                i += 1;
            }
        }
    }

    /// Makes room for one more token of `id`; false if `id` itself had to be preempted.
    fn grow_or_preempt(&mut self, id: RequestId, plan: &mut StepPlan) -> bool {
        loop {
            let Some(seq) = self.seqs.get_mut(&id) else {
                return false;
            };
            if self
                .cache
                .allocate(&mut seq.blocks, seq.num_computed_tokens + 1)
            {
                return true;
            }
            let Some(victim) = self.running.pop() else {
                return false;
            };
            self.preempt(victim, plan);
            if victim == id {
                return false;
            }
        }
    }

    fn preempt(&mut self, id: RequestId, plan: &mut StepPlan) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.cache.free(&mut seq.blocks);
            seq.num_computed_tokens = 0;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        plan.preempted.push(id);
        self.num_preemptions += 1;
    }

    /// Step 2: chunks for running sequences still in prefill. Their blocks were allocated
    /// at admission.
    fn schedule_prefills(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        for i in 0..self.running.len() {
            if *budget == 0 {
                return;
            }
            let id = self.running[i];
            let left = self.seqs.get(&id).map_or(0, Sequence::num_left);
            if left > 1 {
                self.schedule_chunk(id, left.min(*budget), plan, budget);
            }
        }
    }

    /// Step 3: admits waiting sequences in order while a sequence slot, budget and blocks
    /// for all of the next one's tokens are free.
    fn admit_waiting(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let mut i = 0;
        let mut out_of_seats = false;
        while *budget > 0 && i < self.waiting.len() {
            let id = self.waiting[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.remove(i);
                continue;
            };
            // A beam of an admitted group has its seat already; a new group needs all its
            // beams' seats.
            let seats = match seq.group {
                Some((group, _)) if self.groups.contains_key(&group) => 0,
                Some((_, width)) => width,
                None => 1,
            };
            if seats > 0 && (out_of_seats || self.seats_taken() + seats > self.max_num_seqs) {
                // Only beams that need no seat may pass it: their groups end only once
                // every beam has run.
                out_of_seats = true;
                i += 1;
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&id) else {
                return;
            };
            if !self.cache.allocate(&mut seq.blocks, seq.tokens.len()) {
                return;
            }
            if let Some((group, width)) = seq.group {
                self.groups.entry(group).or_insert((width, 1));
            }
            let left = seq.num_left();
            self.waiting.remove(i);
            self.running.push(id);
            self.schedule_chunk(id, left.min(*budget), plan, budget);
        }
    }

    fn schedule_chunk(
        &mut self,
        id: RequestId,
        len: usize,
        plan: &mut StepPlan,
        budget: &mut usize,
    ) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let start = seq.num_computed_tokens;
        seq.num_computed_tokens += len;
        *budget -= len;
        debug_assert!(
            seq.blocks.slot.is_some(),
            "invariant: running sequences hold a slot"
        );
        plan.chunks.push(Chunk {
            id,
            start,
            tokens: seq.tokens[start..start + len].to_vec(),
            samples: seq.num_computed_tokens == seq.tokens.len(),
            // A missing slot (impossible) fails the forward pass as out of the pool.
            slot: seq.blocks.slot.unwrap_or(u32::MAX),
            new_blocks: seq.blocks.take_new(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler(
        max_num_seqs: usize,
        budget: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Scheduler {
        let cache = CacheManager::new(num_blocks, block_size, max_num_seqs);
        Scheduler::new(max_num_seqs, budget, cache)
    }

    fn lens(plan: &StepPlan) -> Vec<(u64, usize, usize, bool)> {
        plan.chunks
            .iter()
            .map(|c| (c.id.0, c.start, c.tokens.len(), c.samples))
            .collect()
    }

    /// Plays the engine loop: every sampling chunk gets token 7 appended.
    fn sample_all(s: &mut Scheduler, plan: &StepPlan) {
        for c in plan.chunks.iter().filter(|c| c.samples) {
            s.append_token(c.id, 7);
        }
    }

    #[test]
    fn chunks_prefill_within_the_budget_and_decodes_first() {
        let mut s = scheduler(4, 8, 64, 4);
        s.add(RequestId(0), vec![1; 11]);
        s.add(RequestId(1), vec![1; 3]);
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(0, 0, 8, false)]);
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(0, 8, 3, true), (1, 0, 3, true)]);
        sample_all(&mut s, &plan);
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(0, 11, 1, true), (1, 3, 1, true)]);
        assert_eq!(s.num_running(), 2);
        assert_eq!(s.num_waiting(), 0);
    }

    #[test]
    fn chunks_carry_the_slot_and_only_the_new_blocks() {
        let mut s = scheduler(4, 64, 8, 4);
        s.add(RequestId(0), vec![1; 8]);
        s.add(RequestId(1), vec![1; 3]);
        let plan = s.schedule();
        let blocks = |p: &StepPlan| -> Vec<(u32, Vec<u32>)> {
            p.chunks
                .iter()
                .map(|c| (c.slot, c.new_blocks.clone()))
                .collect()
        };
        assert_eq!(blocks(&plan), vec![(0, vec![0, 1]), (1, vec![2])]);
        sample_all(&mut s, &plan);
        // The 9th token of request 0 needs a third block; request 1's 4th fits in its first.
        let plan = s.schedule();
        assert_eq!(blocks(&plan), vec![(0, vec![3]), (1, vec![])]);
        s.remove(RequestId(0));
        s.add(RequestId(2), vec![1; 17]);
        let plan = s.schedule();
        // Request 2 gets the never-used blocks first, then request 0's, and its freed slot.
        assert_eq!(blocks(&plan), vec![(0, vec![4, 5, 6, 7, 0])]);
    }

    #[test]
    fn admission_is_fifo_within_max_num_seqs_and_blocks() {
        let mut s = scheduler(2, 64, 4, 4);
        s.add(RequestId(0), vec![1; 8]);
        s.add(RequestId(1), vec![1; 12]);
        s.add(RequestId(2), vec![1; 1]);
        s.add(RequestId(3), vec![1; 1]);
        let plan = s.schedule();
        // Request 1 needs 3 blocks and 2 are free; request 2 would fit but must not jump it.
        assert_eq!(lens(&plan), vec![(0, 0, 8, true)]);
        assert_eq!(s.num_waiting(), 3);
        s.remove(RequestId(0));
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(1, 0, 12, true), (2, 0, 1, true)]);
        assert_eq!(s.num_waiting(), 1, "max_num_seqs is 2");
        assert_eq!(s.cache_usage(), 1.0);
    }

    #[test]
    fn preempts_the_newest_and_recomputes_its_output() {
        let mut s = scheduler(4, 64, 4, 4);
        s.add(RequestId(0), vec![1; 8]);
        s.add(RequestId(1), vec![1; 8]);
        let plan = s.schedule();
        sample_all(&mut s, &plan);
        assert_eq!(s.cache.num_free_blocks(), 0);
        // Both need a third block for their 9th token: the newer one is preempted.
        let plan = s.schedule();
        assert_eq!(plan.preempted, vec![RequestId(1)]);
        assert_eq!(lens(&plan), vec![(0, 8, 1, true)]);
        assert_eq!(s.num_preemptions(), 1);
        s.remove(RequestId(0));
        // Readmitted with prompt and output: 9 tokens to prefill.
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(1, 0, 9, true)]);
        let seq = s.get(RequestId(1)).expect("running");
        assert_eq!(seq.prompt_and_output().1, &[7]);
    }

    #[test]
    fn a_sequence_preempts_itself_when_it_is_the_newest() {
        let mut s = scheduler(4, 64, 4, 4);
        s.add(RequestId(0), vec![1; 8]);
        s.add(RequestId(1), vec![1; 4]);
        let plan = s.schedule();
        sample_all(&mut s, &plan);
        // Request 0 takes the last free block for its 9th token; request 1 then needs one
        // for its 5th and is itself the newest running sequence.
        let plan = s.schedule();
        assert_eq!(plan.preempted, vec![RequestId(1)]);
        assert_eq!(lens(&plan), vec![(0, 8, 1, true)]);
        assert_eq!(s.num_waiting(), 1);
        assert_eq!(s.num_running(), 1);
        assert_eq!(s.cache.num_free_blocks(), 1);
    }

    #[test]
    fn a_beam_group_holds_its_width_in_seats_and_forks_share_blocks() {
        let mut s = scheduler(4, 64, 16, 4);
        s.add_beams(RequestId(0), vec![1; 6], 3);
        s.add(RequestId(1), vec![1; 2]);
        s.add(RequestId(2), vec![1; 2]);
        let plan = s.schedule();
        // Three seats for the group and one for request 1: request 2 waits.
        assert_eq!(lens(&plan), vec![(0, 0, 6, true), (1, 0, 2, true)]);
        assert_eq!(s.num_waiting(), 1);
        let Some(Forked::Shared { copy, block_ids }) = s.fork(RequestId(0), RequestId(10), 5)
        else {
            panic!("the first beam is cached and a block and slot are free");
        };
        // Request 0 holds [0, 1] (6 tokens), request 1 [2]: the fork shares block 0 and
        // copies the partial block 1 into 3.
        assert_eq!(block_ids, vec![0, 3]);
        assert_eq!(copy.block, Some((1, 3)));
        s.append_token(RequestId(0), 7);
        s.append_token(RequestId(1), 7);
        let plan = s.schedule();
        assert_eq!(
            lens(&plan),
            vec![(0, 6, 1, true), (1, 2, 1, true), (10, 6, 1, true)]
        );
        assert_eq!(s.num_waiting(), 1, "the group still holds three seats");
        s.append_token(RequestId(1), 7);
        s.remove(RequestId(0));
        s.remove(RequestId(10));
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(1, 3, 1, true), (2, 0, 2, true)]);
    }

    #[test]
    fn a_beam_of_an_admitted_group_passes_a_request_waiting_for_a_seat() {
        let mut s = scheduler(3, 64, 16, 4);
        s.add_beams(RequestId(0), vec![1; 4], 2);
        s.add(RequestId(1), vec![1; 4]);
        s.add(RequestId(2), vec![1; 4]);
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(0, 0, 4, true), (1, 0, 4, true)]);
        // The beam lost its cache and queues behind request 2, which has no seat: the
        // group's seats are its own, so it goes first.
        s.recompute(RequestId(0));
        s.waiting = VecDeque::from([RequestId(2), RequestId(0)]);
        s.append_token(RequestId(1), 7);
        let plan = s.schedule();
        assert_eq!(lens(&plan), vec![(1, 4, 1, true), (0, 0, 4, true)]);
        assert_eq!(s.waiting, VecDeque::from([RequestId(2)]));
    }

    #[test]
    fn removing_frees_blocks_and_queues() {
        let mut s = scheduler(4, 64, 8, 4);
        s.add(RequestId(0), vec![1; 8]);
        s.add(RequestId(1), vec![1; 8]);
        s.schedule();
        assert!(s.remove(RequestId(0)).is_some());
        assert!(s.remove(RequestId(0)).is_none(), "idempotent");
        assert_eq!(s.num_running(), 1);
        assert!((s.cache_usage() - 0.25).abs() < 1e-12);
        s.remove(RequestId(1));
        assert!(s.is_idle());
        assert_eq!(s.cache_usage(), 0.0);
    }
}
