//! Beam search requests in the engine loop.
//!
//! Every running beam is a sequence of the continuous batch, scheduled like any other; the
//! first beam has the request's id, forks get ids of their own (`beam_owner` maps them
//! back). A beam's logits row waits in its group until every beam of the group has one
//! (a preempted beam may take a few steps longer); then [`BeamSearch::step`] picks the next
//! beams:
//!
//! ```text
//! old beams  A  B  C            next beams  A+x  A+y  C+z
//!   B has no child        ─► its sequence is removed (blocks and slot freed)
//!   A+y is A's 2nd child  ─► a fork of A: shares A's full blocks, copies its partial block
//!                             and KDA state (or, lacking room, is prefilled anew)
//!   A+x, C+z first child  ─► A and C take the token in place
//! ```

use std::collections::HashMap;

use kimi_core::TokenId;
use kimi_ops::Backend;

use super::{send, End, EngineLoop};
use crate::beam::{BeamParams, BeamSearch};
use crate::sampling::SamplingParams;
use crate::scheduler::Forked;
use crate::serving::{Event, RequestId};
use crate::FinishReason;

/// Forked beams get ids from here up, apart from the handle's.
pub(super) const FIRST_FORK_ID: u64 = 1 << 63;

/// One beam search request's beams.
pub(super) struct BeamGroup {
    pub(super) search: BeamSearch,
    /// The sequence of each running beam, in the search's beam order.
    pub(super) members: Vec<RequestId>,
    /// Logits rows that arrived since the last beam step, by sequence.
    rows: HashMap<RequestId, Vec<f32>>,
    pub(super) prompt_len: usize,
}

impl BeamGroup {
    /// The group of request `id`: stop ids are `stop_token_ids` and, unless `ignore_eos`,
    /// the end-of-sequence ids; outputs end at `max_tokens` or the context.
    pub(super) fn new(
        id: RequestId,
        params: &SamplingParams,
        beam: BeamParams,
        eos_ids: &[TokenId],
        prompt_len: usize,
        max_model_len: usize,
    ) -> Self {
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(eos_ids);
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let max_tokens = params
            .max_tokens
            .min(max_model_len.saturating_sub(prompt_len));
        Self {
            search: BeamSearch::new(beam, stop_ids, max_tokens),
            members: vec![id],
            rows: HashMap::new(),
            prompt_len,
        }
    }

    fn is_ready(&self) -> bool {
        self.members.iter().all(|m| self.rows.contains_key(m))
    }
}

impl<B: Backend> EngineLoop<B> {
    /// The request a sequence belongs to (itself unless it is a forked beam).
    pub(super) fn owner(&self, id: RequestId) -> RequestId {
        self.beam_owner.get(&id).copied().unwrap_or(id)
    }

    /// Keeps the logits row of a beam for its group's next step; false if `id` is not a
    /// beam.
    pub(super) fn take_beam_row(&mut self, id: RequestId, row: &[f32]) -> bool {
        let group = self.owner(id);
        let Some(beams) = self.live.get_mut(&group).and_then(|l| l.beam.as_mut()) else {
            return false;
        };
        beams.rows.insert(id, row.to_vec());
        true
    }

    /// Steps every beam group whose beams all have their rows, in request order.
    pub(super) fn advance_beams(&mut self) {
        let mut ready: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.beam.as_ref().is_some_and(BeamGroup::is_ready))
            .map(|(&id, _)| id)
            .collect();
        ready.sort_unstable();
        for group in ready {
            if let Err(end) = self.beam_step(group) {
                self.finish(group, end);
            }
        }
    }

    /// One beam step of `group`; `Err` says how the request ends.
    fn beam_step(&mut self, group: RequestId) -> Result<(), End> {
        let Some(live) = self.live.get_mut(&group) else {
            return Ok(());
        };
        let Some(beams) = live.beam.as_mut() else {
            return Ok(());
        };
        if !live.started {
            live.started = true;
            self.totals.prompt_tokens_total += beams.prompt_len as u64;
            let queued_secs = live.queued_secs.unwrap_or(0.0);
            send(&live.events, Event::Started { queued_secs })?;
        }
        let rows: Vec<Vec<f32>> = beams
            .members
            .iter()
            .map(|m| beams.rows.remove(m).unwrap_or_default())
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let next = beams.search.step(&refs);
        if beams.search.is_done() {
            return Err(End::Finished(FinishReason::Stop));
        }
        let old = std::mem::take(&mut beams.members);
        self.totals.generation_tokens_total += next.len() as u64;
        let mut children = vec![0usize; old.len()];
        for n in &next {
            children[n.parent] += 1;
        }
        for (&member, _) in old.iter().zip(&children).filter(|(_, &c)| c == 0) {
            self.scheduler.remove(member);
            self.runner.release(member);
            self.beam_owner.remove(&member);
        }
        // Forks copy their parent's tokens and cache before the parent takes its own token.
        let mut members = Vec::with_capacity(next.len());
        let mut in_place = Vec::new();
        let mut has_first_child = vec![false; old.len()];
        for n in &next {
            let parent = old[n.parent];
            if !std::mem::replace(&mut has_first_child[n.parent], true) {
                members.push(parent);
                in_place.push((parent, n.token));
                continue;
            }
            let child = RequestId(self.next_fork_id);
            self.next_fork_id += 1;
            self.beam_owner.insert(child, group);
            members.push(child);
            match self.scheduler.fork(parent, child, n.token) {
                Some(Forked::Shared { copy, block_ids }) => {
                    if self.runner.fork(parent, child, &copy, block_ids).is_err() {
                        // E.g. a backend without `copy_block`: prefill the fork instead.
                        self.runner.release(child);
                        self.scheduler.recompute(child);
                    }
                }
                Some(Forked::Recompute) => {}
                None => {
                    return Err(End::Error(format!(
                        "internal error: beam {} of request {} has no sequence",
                        parent.0, group.0
                    )))
                }
            }
        }
        for (parent, token) in in_place {
            self.scheduler.append_token(parent, token);
        }
        if let Some(beams) = self.live.get_mut(&group).and_then(|l| l.beam.as_mut()) {
            beams.members = members;
        }
        Ok(())
    }

    /// Removes every sequence of beam request `group` from the scheduler and the runner.
    pub(super) fn remove_beams(&mut self, group: RequestId) {
        let forks: Vec<RequestId> = self
            .beam_owner
            .iter()
            .filter(|(_, &g)| g == group)
            .map(|(&id, _)| id)
            .collect();
        for id in forks {
            self.beam_owner.remove(&id);
            self.scheduler.remove(id);
            self.runner.release(id);
        }
    }

    /// The last events of a beam request that ended as `reason`: its best beams, then
    /// `Finished` (only `Finished` when it was cancelled).
    pub(super) fn beam_results(beams: &BeamGroup, reason: FinishReason) -> Vec<Event> {
        if reason == FinishReason::Cancelled {
            return vec![Event::Finished {
                reason,
                prompt_tokens: beams.prompt_len,
                completion_tokens: 0,
            }];
        }
        let results = beams.search.results();
        let completion_tokens = results.iter().map(|b| b.tokens.len()).sum();
        let reason = results.first().map_or(FinishReason::Length, |b| b.finish);
        vec![
            Event::Beams(results),
            Event::Finished {
                reason,
                prompt_tokens: beams.prompt_len,
                completion_tokens,
            },
        ]
    }
}
