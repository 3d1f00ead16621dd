//! Beam search (Hugging Face's `num_beams`, `length_penalty`, `early_stopping`).
//!
//! [`BeamParams`] ride in [`SamplingParams::beam`](crate::sampling::SamplingParams::beam).
//! [`BeamSearch`] is the rule alone, over log-probability rows: the serving engine keeps
//! every live beam as a sequence of the continuous batch, hands it each beam's row once all
//! of them have one, and forks or drops sequences as the returned [`NextBeam`]s say.
//!
//! One step, with `k = num_beams` and `c = max(2, 1 + stop ids) * k` candidates:
//!
//! ```text
//! beam b (cumulative logprob s_b) ─► log_softmax(row_b) ─► its c best tokens, s_b + lp
//! all beams' candidates, best first (ties: lower beam, then lower token)
//!   stop token ranked < k   ─► a finished hypothesis (the stop token is not output)
//!   any other token         ─► a next beam, until k of them
//! hypothesis score = cumulative logprob / generated_len ^ length_penalty
//!   (generated_len counts the output with its stop token)
//! ```
//!
//! The search ends when `early_stopping` and `k` hypotheses are finished; without it, when
//! no running beam can still beat the worst kept hypothesis (HF's `is_done`); or at
//! `max_tokens`, where the running beams become hypotheses too. The `num_return` best
//! hypotheses are the result.

use std::cmp::Ordering;

use kimi_core::TokenId;

use crate::sampling::{Sampled, SamplingError, SamplingParams};
use crate::FinishReason;

/// The most beams one request may ask for (vLLM's and OpenAI's limit on `n`).
pub const MAX_BEAMS: usize = 128;

/// How a request searches instead of sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct BeamParams {
    /// Beams kept at each step (beam width), at least 1.
    pub num_beams: usize,
    /// Best hypotheses returned, `1..=num_beams`.
    pub num_return: usize,
    /// Exponent of the generated length that divides a hypothesis's cumulative logprob:
    /// above 0 favours longer outputs, below 0 shorter ones.
    pub length_penalty: f32,
    /// Stop as soon as `num_beams` hypotheses are finished (HF `early_stopping=True`);
    /// otherwise once none of the running beams can beat them.
    pub early_stopping: bool,
}

impl Default for BeamParams {
    fn default() -> Self {
        Self {
            num_beams: 1,
            num_return: 1,
            length_penalty: 1.0,
            early_stopping: false,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Result<(), SamplingError> {
    Err(SamplingError::Invalid {
        field,
        reason: reason.into(),
    })
}

impl BeamParams {
    /// Checks the beam fields and that `params` asks for nothing beam search ignores:
    /// beams are ranked by log probability, so temperature, the sampling filters and the
    /// penalties must keep their neutral values, as vLLM requires.
    pub(crate) fn validate(&self, params: &SamplingParams) -> Result<(), SamplingError> {
        if self.num_beams == 0 || self.num_beams > MAX_BEAMS {
            invalid(
                "num_beams",
                format!("must be in [1, {MAX_BEAMS}], got {}", self.num_beams),
            )?;
        }
        if self.num_return == 0 || self.num_return > self.num_beams {
            invalid(
                "num_return",
                format!(
                    "must be in [1, num_beams = {}], got {}",
                    self.num_beams, self.num_return
                ),
            )?;
        }
        if !self.length_penalty.is_finite() {
            invalid(
                "length_penalty",
                format!("must be a finite number, got {}", self.length_penalty),
            )?;
        }
        let neutral = [
            ("temperature", params.temperature == 0.0, "0"),
            ("top_k", params.top_k == 0, "-1 or 0 (off)"),
            ("top_p", params.top_p == 1.0, "1"),
            ("min_p", params.min_p == 0.0, "0"),
            ("repetition_penalty", params.repetition_penalty == 1.0, "1"),
            ("frequency_penalty", params.frequency_penalty == 0.0, "0"),
            ("presence_penalty", params.presence_penalty == 0.0, "0"),
        ];
        if let Some((field, _, want)) = neutral.iter().find(|(_, ok, _)| !ok) {
            invalid(
                field,
                format!("must be {want} with beam search, which ranks beams by log probability"),
            )?;
        }
        if params.logprobs.is_some_and(|n| n > 0) {
            invalid(
                "logprobs",
                "beam search reports each token's logprob but no alternatives; ask for 0",
            )?;
        }
        Ok(())
    }
}

/// One finished beam.
#[derive(Clone, Debug, PartialEq)]
pub struct BeamOutput {
    /// Output tokens (without the stop token), each with its logprob.
    pub tokens: Vec<Sampled>,
    /// Sum of the output's logprobs, the stop token's included when it ended on one.
    pub cumulative_logprob: f64,
    /// `cumulative_logprob / generated_len ^ length_penalty`: what the beams are ranked by.
    pub score: f64,
    /// [`FinishReason::Stop`] when it ended on a stop token, else [`FinishReason::Length`].
    pub finish: FinishReason,
}

/// Where a next beam comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NextBeam {
    /// Index of its parent among the beams before the step.
    pub(crate) parent: usize,
    /// The token it appends.
    pub(crate) token: TokenId,
}

/// A running beam.
#[derive(Clone, Debug)]
struct Beam {
    tokens: Vec<TokenId>,
    logprobs: Vec<f32>,
    cumulative: f64,
}

/// One candidate continuation.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    score: f64,
    beam: usize,
    token: TokenId,
    logprob: f32,
}

/// Best first; ties go to the lower beam, then the lower token id.
fn by_score(a: &Candidate, b: &Candidate) -> Ordering {
    b.score
        .partial_cmp(&a.score)
        .unwrap_or(Ordering::Equal)
        .then(a.beam.cmp(&b.beam))
        .then(a.token.cmp(&b.token))
}

/// One request's beams and finished hypotheses.
#[derive(Debug)]
pub(crate) struct BeamSearch {
    params: BeamParams,
    stop_ids: Vec<TokenId>,
    max_tokens: usize,
    beams: Vec<Beam>,
    /// At most `num_beams`, in no order.
    finished: Vec<BeamOutput>,
    done: bool,
}

impl BeamSearch {
    /// A search from one empty beam; `stop_ids` end a beam, `max_tokens` (at least 1) bounds
    /// every output.
    pub(crate) fn new(params: BeamParams, stop_ids: Vec<TokenId>, max_tokens: usize) -> Self {
        Self {
            params,
            stop_ids,
            max_tokens: max_tokens.max(1),
            beams: vec![Beam {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                cumulative: 0.0,
            }],
            finished: Vec::new(),
            done: false,
        }
    }

    /// Whether the search has ended (see [`BeamSearch::results`]).
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// One step: `rows[b]` is the logits row after running beam `b`'s tokens. Returns the
    /// next beams in order (empty once the search is done).
    pub(crate) fn step(&mut self, rows: &[&[f32]]) -> Vec<NextBeam> {
        if self.done || rows.len() != self.beams.len() {
            self.done = true;
            return Vec::new();
        }
        let k = self.params.num_beams;
        let num_candidates = (1 + self.stop_ids.len()).max(2) * k;
        let mut candidates = Vec::with_capacity(num_candidates * rows.len());
        for (b, row) in rows.iter().enumerate() {
            candidates.extend(best_tokens(row, num_candidates).into_iter().map(
                |(token, logprob)| Candidate {
                    score: self.beams[b].cumulative + f64::from(logprob),
                    beam: b,
                    token,
                    logprob,
                },
            ));
        }
        candidates.sort_by(by_score);
        candidates.truncate(num_candidates);
        let generated_len = self.beams[0].tokens.len() + 1;
        let mut next = Vec::with_capacity(k);
        for (rank, c) in candidates.iter().enumerate() {
            if self.stop_ids.contains(&c.token) {
                if rank < k {
                    let beam = &self.beams[c.beam];
                    let mut logprobs = beam.logprobs.clone();
                    logprobs.push(c.logprob);
                    self.add(&beam.tokens.clone(), &logprobs, c.score, generated_len);
                }
            } else {
                next.push(*c);
            }
            if next.len() == k {
                break;
            }
        }
        let best = candidates.first().map_or(f64::NEG_INFINITY, |c| c.score);
        if next.is_empty() || self.enough_finished(best, generated_len) {
            self.done = true;
            return Vec::new();
        }
        self.beams = next
            .iter()
            .map(|c| {
                let parent = &self.beams[c.beam];
                let mut beam = parent.clone();
                beam.tokens.push(c.token);
                beam.logprobs.push(c.logprob);
                beam.cumulative = c.score;
                beam
            })
            .collect();
        if generated_len >= self.max_tokens {
            for beam in std::mem::take(&mut self.beams) {
                let logprobs = beam.logprobs.clone();
                self.add(&beam.tokens, &logprobs, beam.cumulative, generated_len);
            }
            self.done = true;
            return Vec::new();
        }
        next.iter()
            .map(|c| NextBeam {
                parent: c.beam,
                token: c.token,
            })
            .collect()
    }

    /// HF's `BeamHypotheses.add`: keeps the `num_beams` best.
    fn add(&mut self, tokens: &[TokenId], logprobs: &[f32], cumulative: f64, len: usize) {
        let score = cumulative / (len as f64).powf(f64::from(self.params.length_penalty));
        let finish = if logprobs.len() > tokens.len() {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        let worst = self.worst();
        if self.finished.len() >= self.params.num_beams && score <= worst.map_or(f64::MAX, |w| w.1)
        {
            return;
        }
        self.finished.push(BeamOutput {
            tokens: tokens
                .iter()
                .zip(logprobs)
                .map(|(&token, &logprob)| Sampled {
                    token,
                    logprob,
                    top_logprobs: Vec::new(),
                })
                .collect(),
            cumulative_logprob: cumulative,
            score,
            finish,
        });
        if self.finished.len() > self.params.num_beams {
            if let Some((i, _)) = self.worst() {
                self.finished.remove(i);
            }
        }
    }

    /// Index and score of the worst kept hypothesis (the earliest added among equals).
    fn worst(&self) -> Option<(usize, f64)> {
        self.finished
            .iter()
            .enumerate()
            .map(|(i, h)| (i, h.score))
            .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(Ordering::Equal))
    }

    /// HF's `is_done` after a step whose best candidate scored `best` at `len` tokens.
    fn enough_finished(&self, best: f64, len: usize) -> bool {
        if self.finished.len() < self.params.num_beams {
            return false;
        }
        if self.params.early_stopping {
            return true;
        }
        let highest_attainable = best / (len as f64).powf(f64::from(self.params.length_penalty));
        self.worst().is_some_and(|(_, w)| w >= highest_attainable)
    }

    /// The `num_return` best hypotheses, best first (the earlier found among equals).
    pub(crate) fn results(&self) -> Vec<BeamOutput> {
        let mut all = self.finished.clone();
        all.sort_by(|a, b| b.score.partial_cmp(&a.score).unwrap_or(Ordering::Equal));
        all.truncate(self.params.num_return);
        all
    }
}

/// The `n` most likely tokens of a logits row with their logprobs (`log_softmax` of the
/// row), most likely first, ties by lower id. Non-finite logits never rank above finite
/// ones.
pub(crate) fn best_tokens(row: &[f32], n: usize) -> Vec<(TokenId, f32)> {
    let finite = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let max = row
        .iter()
        .copied()
        .map(finite)
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Vec::new();
    }
    let sum: f64 = row.iter().map(|&x| f64::from(finite(x) - max).exp()).sum();
    let log_total = max + sum.ln() as f32;
    let mut ids: Vec<TokenId> = (0..row.len() as TokenId).collect();
    let rank = |a: &TokenId, b: &TokenId| {
        finite(row[*b as usize])
            .partial_cmp(&finite(row[*a as usize]))
            .unwrap_or(Ordering::Equal)
            .then(a.cmp(b))
    };
    let n = n.min(ids.len());
    if n < ids.len() {
        ids.select_nth_unstable_by(n, rank);
        ids.truncate(n);
    }
    ids.sort_by(rank);
    ids.into_iter()
        .map(|id| (id, finite(row[id as usize]) - log_total))
        .filter(|(_, lp)| lp.is_finite())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(num_beams: usize, early_stopping: bool) -> BeamParams {
        BeamParams {
            num_beams,
            num_return: num_beams,
            length_penalty: 1.0,
            early_stopping,
        }
    }

    fn row(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn best_tokens_are_log_softmax_ranked_with_ties_by_id() {
        let r = row(&[0.1, 0.4, 0.1, 0.4]);
        let best = best_tokens(&r, 3);
        let ids: Vec<u32> = best.iter().map(|b| b.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert!((best[0].1 - 0.4f32.ln()).abs() < 1e-6);
        assert!(best_tokens(&[f32::NAN, f32::NEG_INFINITY], 2).is_empty());
    }

    #[test]
    fn a_stop_token_finishes_a_hypothesis_and_frees_its_place() {
        // Vocab: 0 is the stop token. Step 1 from the empty beam: 0 (p .5), 1 (.3), 2 (.2).
        let mut s = BeamSearch::new(params(2, true), vec![0], 10);
        let next = s.step(&[&row(&[0.5, 0.3, 0.2])]);
        assert_eq!(
            next,
            vec![
                NextBeam {
                    parent: 0,
                    token: 1
                },
                NextBeam {
                    parent: 0,
                    token: 2
                }
            ]
        );
        assert_eq!(s.finished.len(), 1, "the stop token ranked first");
        assert!((s.finished[0].score - 0.5f64.ln()).abs() < 1e-6);
        // Step 2: both beams stop for sure; early stopping ends the search with 2 found.
        let stop = row(&[1.0 - 2e-9, 1e-9, 1e-9]);
        assert!(s.step(&[&stop, &stop]).is_empty());
        assert!(s.is_done());
        let results = s.results();
        assert_eq!(results.len(), 2, "the worst of three hypotheses is dropped");
        // log(.3) over two generated tokens (the stop token counts) beats log(.5) over one.
        assert_eq!(results[0].tokens[0].token, 1);
        assert_eq!(results[0].finish, FinishReason::Stop);
        assert!((results[0].score - 0.3f64.ln() / 2.0).abs() < 1e-6);
        assert!(results[1].tokens.is_empty());
        assert!((results[1].score - 0.5f64.ln()).abs() < 1e-6);
    }

    #[test]
    fn max_tokens_turns_running_beams_into_hypotheses() {
        let mut s = BeamSearch::new(params(2, false), vec![], 1);
        assert!(s.step(&[&row(&[0.6, 0.3, 0.1])]).is_empty());
        let results = s.results();
        let tokens: Vec<u32> = results.iter().map(|r| r.tokens[0].token).collect();
        assert_eq!(tokens, vec![0, 1]);
        assert!(results.iter().all(|r| r.finish == FinishReason::Length));
    }

    #[test]
    fn early_stopping_ends_once_num_beams_are_found_and_its_absence_waits() {
        let run = |early_stopping| {
            let mut s = BeamSearch::new(params(2, early_stopping), vec![0], 5);
            // Step 1: the stop token ranks first (a hypothesis of log .4), beams [1] and [2].
            assert_eq!(s.step(&[&row(&[0.4, 0.35, 0.25])]).len(), 2);
            assert!(!s.is_done(), "one hypothesis of two");
            // Step 2: beam [1] stops at log(.35 * .5) / 2, better than log .4; a running beam
            // at the best candidate's score could still beat log .4 over 2 tokens.
            let r = row(&[0.5, 0.49, 0.01]);
            let next = s.step(&[&r, &r]);
            (s.is_done(), next.len())
        };
        assert_eq!(run(true), (true, 0));
        assert_eq!(run(false), (false, 2));
    }

    #[test]
    fn validation_names_the_field() {
        let beam = |b: BeamParams| SamplingParams {
            beam: Some(b),
            ..SamplingParams::default()
        };
        let field = |p: SamplingParams| match p.validate(10) {
            Err(SamplingError::Invalid { field, .. }) => field,
            Ok(()) => "ok",
        };
        assert_eq!(field(beam(params(2, false))), "ok");
        assert_eq!(field(beam(params(0, false))), "num_beams");
        let more = BeamParams {
            num_return: 3,
            ..params(2, false)
        };
        assert_eq!(field(beam(more)), "num_return");
        let hot = SamplingParams {
            temperature: 0.7,
            ..beam(params(2, false))
        };
        assert_eq!(field(hot), "temperature");
        let nan = BeamParams {
            length_penalty: f32::NAN,
            ..params(2, false)
        };
        assert_eq!(field(beam(nan)), "length_penalty");
    }
}
