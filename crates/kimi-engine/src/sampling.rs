//! Token sampling for one sequence position: penalties, logprobs, temperature, top-k, top-p
//! and min-p, with a seeded ChaCha RNG.
//!
//! The order of the steps follows vLLM's sampler (`vllm/v1/sample/sampler.py`):
//!
//! ```text
//! logits ─► penalties ─► sanitise ─► logprobs (log_softmax of the penalised logits)
//!                                  └► temperature == 0 ? argmax
//!                                     : /temperature ─► top-k ─► top-p ─► min-p ─► draw
//! ```
//!
//! [`Sampler::sample`] never panics on bad logits: NaN counts as `-inf`, `+inf` as the
//! largest finite value, and a row with no finite logit gives token 0 with logprob `-inf`.

use std::cmp::Ordering;
use std::collections::HashMap;

use kimi_core::TokenId;
use kimi_ops::{RowSampling, TokenPenalty};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::beam::BeamParams;

/// The most alternatives a request may ask for with [`SamplingParams::logprobs`] (as OpenAI).
pub const MAX_LOGPROBS: usize = 20;

/// The most stop strings a request may give (as OpenAI's 4, with room to spare).
pub const MAX_STOP_STRINGS: usize = 16;

/// How one request wants its tokens chosen and when it wants generation to end.
///
/// Defaults are greedy decoding of at most 256 tokens with every filter and penalty off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, in `[0, 100]`. `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens. `0` turns the filter off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability is at least `top_p`,
    /// in `(0, 1]`. `1` turns the filter off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the largest probability, in
    /// `[0, 1]`. `0` turns the filter off.
    pub min_p: f32,
    /// HF/vLLM repetition penalty, `> 0`: for each token seen in prompt or output, a
    /// positive logit is divided by it and a negative one multiplied. `1` turns it off.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty, in `[-2, 2]`: subtracts `count_in_output * frequency_penalty`.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty, in `[-2, 2]`: subtracts it once from every token in the output.
    pub presence_penalty: f32,
    /// RNG seed. The same seed gives the same tokens; `None` seeds from OS entropy.
    pub seed: Option<u64>,
    /// The most tokens to generate, at least 1.
    pub max_tokens: usize,
    /// Stop strings: generation ends when one appears, and it is not returned.
    pub stop: Vec<String>,
    /// Token ids that end generation (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating past the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// `Some(n)`: return the chosen token's logprob and the `n` most likely alternatives
    /// (`n <= 20`).
    pub logprobs: Option<usize>,
    /// `Some`: beam search instead of sampling ([`crate::beam`]); the output is the best
    /// beams, reported at the end, not streamed.
    pub beam: Option<BeamParams>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            beam: None,
        }
    }
}

/// A request's sampling parameters were out of range. Goes back to the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// `field` has a value outside its allowed range; `reason` says the range and the value.
    #[error("invalid sampling parameter `{field}`: {reason}")]
    Invalid {
        /// The field of [`SamplingParams`] at fault.
        field: &'static str,
        /// Plain-words explanation naming the allowed range and the value given.
        reason: String,
    },
}

fn invalid(field: &'static str, reason: String) -> Result<(), SamplingError> {
    Err(SamplingError::Invalid { field, reason })
}

/// Checks that `value` is in `[low, high]`; NaN fails every comparison and so is rejected.
fn check_range(field: &'static str, value: f32, low: f32, high: f32) -> Result<(), SamplingError> {
    if value >= low && value <= high {
        Ok(())
    } else {
        invalid(field, format!("must be in [{low}, {high}], got {value}"))
    }
}

impl SamplingParams {
    /// Checks every field against its allowed range for a model with `vocab_size` tokens.
    ///
    /// # Errors
    ///
    /// [`SamplingError::Invalid`] for the first field found out of range (NaN included).
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        check_range("temperature", self.temperature, 0.0, 100.0)?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            invalid("top_p", format!("must be in (0, 1], got {}", self.top_p))?;
        }
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        let rep = self.repetition_penalty;
        if !(rep > 0.0 && rep.is_finite()) {
            invalid(
                "repetition_penalty",
                format!("must be a finite number > 0, got {rep}"),
            )?;
        }
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        if self.max_tokens == 0 {
            invalid("max_tokens", "must be at least 1, got 0".to_string())?;
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            invalid(
                "logprobs",
                format!("must be at most {MAX_LOGPROBS}, got {n}"),
            )?;
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            let n = self.stop.len();
            invalid(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings, got {n}"),
            )?;
        }
        if self.stop.iter().any(String::is_empty) {
            invalid("stop", "stop strings must not be empty".to_string())?;
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            let reason = format!("token id {id} is not in the vocabulary (ids 0..{vocab_size})");
            invalid("stop_token_ids", reason)?;
        }
        if let Some(beam) = &self.beam {
            beam.validate(self)?;
        }
        Ok(())
    }
}

/// The token chosen for one position and, if asked for, its most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The chosen token.
    pub token: TokenId,
    /// Log probability of `token`: `log_softmax` of the penalised logits, before temperature
    /// and filters. `-inf` when no logit was finite; NaN (not computed) under greedy
    /// sampling when [`SamplingParams::logprobs`] is `None`.
    pub logprob: f32,
    /// The `n` most likely tokens with their logprobs (same definition as `logprob`), most
    /// likely first, ties by lowest id. Empty unless [`SamplingParams::logprobs`] is `Some(n)`.
    pub top_logprobs: Vec<(TokenId, f32)>,
}

impl Sampled {
    /// A pick reported without logprobs (`logprob` NaN: not computed): greedy, or drawn
    /// on the backend.
    pub fn greedy(token: TokenId) -> Self {
        Sampled {
            token,
            logprob: f32::NAN,
            top_logprobs: Vec::new(),
        }
    }
}

/// Logits are summed in blocks of this many tokens; the block sums let an unfiltered draw
/// find its token without a second pass over the whole vocabulary.
const BLOCK_TOKENS: usize = 1024;

/// Independent accumulators in the vectorised passes (two SSE or one AVX register of `f32`).
const LANES: usize = 8;

/// One candidate token during filtering.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    id: TokenId,
    /// Penalised, sanitised logit.
    logit: f32,
    /// `exp((logit - max) / temperature)`: unnormalised probability, `1.0` for the best token.
    weight: f32,
}

/// Most likely first; ties go to the lowest id (so top-k 1 and greedy agree).
fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// Chooses tokens for one sequence. Keeps its RNG and scratch buffers across calls, so
/// one `Sampler` per sequence, reused for every step.
#[derive(Debug)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
    num_logprobs: usize,
    /// Whether the chosen token's logprob is wanted (`SamplingParams::logprobs` is set).
    /// Greedy sampling without it needs no softmax over the vocabulary: at 64 rows of a
    /// 163,840-token vocabulary that softmax took longer than the argmax by ~10M `exp`s.
    wants_logprob: bool,
    rng: ChaCha8Rng,
    /// `[vocab]` scratch, all zero between calls: marks or counts for the penalties.
    token_counts: Vec<u32>,
    /// Scratch candidate list for the filters and the top logprobs.
    candidates: Vec<Candidate>,
    /// `[vocab / BLOCK_TOKENS]` sums of `exp((logit - max) / t)` from the last pass.
    block_sums: Vec<f32>,
    /// `[TOP_P_BUCKETS]` scratch for [`top_p_cut`].
    bucket_mass: Vec<f64>,
}

impl Sampler {
    /// Builds a sampler for `params`, which should have passed [`SamplingParams::validate`];
    /// invalid values do not panic but choose unspecified tokens.
    ///
    /// With `seed: Some(s)` the RNG is ChaCha8 seeded from `s`, so the same seed and the
    /// same logits give the same tokens; with `None` it is seeded from OS entropy.
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        Sampler {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            frequency_penalty: params.frequency_penalty,
            presence_penalty: params.presence_penalty,
            num_logprobs: params.logprobs.unwrap_or(0),
            wants_logprob: params.logprobs.is_some(),
            rng,
            token_counts: Vec::new(),
            candidates: Vec::new(),
            block_sums: Vec::new(),
            bucket_mass: Vec::new(),
        }
    }

    /// Whether the request asked for logprobs (only the host sampler computes them).
    pub fn wants_logprob(&self) -> bool {
        self.wants_logprob
    }

    /// Whether this sampler just takes the argmax of the raw logits: greedy, no logprobs
    /// and no penalties. Such rows can be picked on the backend ([`kimi_ops::argmax_row`]
    /// is the same choice as [`Sampler::sample`] makes).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0
            && !self.wants_logprob
            && self.repetition_penalty == 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
    }

    /// This row's rules for a backend that samples where the logits are
    /// ([`kimi_ops::Backend::sample_rows`]), with one draw taken from this sampler's RNG, and
    /// the tokens its penalties touch appended to `penalties` as row `row`. `None` when the
    /// request wants logprobs, which only the host sampler reports.
    pub fn device_row(
        &mut self,
        prompt: &[TokenId],
        output: &[TokenId],
        row: u32,
        penalties: &mut Vec<TokenPenalty>,
    ) -> Option<RowSampling> {
        if self.wants_logprob {
            return None;
        }
        let repetition = self.repetition_penalty != 1.0;
        let additive = self.frequency_penalty != 0.0 || self.presence_penalty != 0.0;
        if repetition || additive {
            // Distinct tokens in first-seen order, with their output counts.
            let mut counts: HashMap<TokenId, usize> = HashMap::new();
            let first = penalties.len();
            let seen = if repetition { prompt } else { &[] };
            for (&token, in_output) in seen
                .iter()
                .map(|t| (t, false))
                .chain(output.iter().map(|t| (t, true)))
            {
                let index = *counts.entry(token).or_insert_with(|| {
                    penalties.push(TokenPenalty {
                        row,
                        token,
                        count: 0,
                    });
                    penalties.len() - 1 - first
                });
                if in_output {
                    penalties[first + index].count += 1;
                }
            }
        }
        Some(RowSampling {
            temperature: self.temperature,
            top_k: u32::try_from(self.top_k).unwrap_or(u32::MAX),
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            uniform: self.rng.random::<f32>(),
        })
    }

    /// Chooses the next token.
    ///
    /// `logits` are the model's logits for one position, `[vocab]`; they are modified in
    /// place as scratch (penalised and sanitised). `prompt` and `output` are the token ids
    /// so far.
    ///
    /// The returned logprobs are `log_softmax` of the *penalised* logits, taken before
    /// temperature, top-k, top-p and min-p. vLLM by default returns raw-model logprobs
    /// (before penalties); we report what the penalties made of them instead, which
    /// is what was actually sampled from at temperature 1, and it is independent of the
    /// filters, so the top alternatives are always meaningful.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        prompt: &[TokenId],
        output: &[TokenId],
    ) -> Sampled {
        self.apply_penalties(logits, prompt, output);
        let (best, max) = sanitise_and_argmax(logits);
        if max == f32::NEG_INFINITY {
            // No finite logit: nothing to sample from.
            let n = self.num_logprobs.min(logits.len());
            let top_logprobs = (0..n)
                .map(|id| (id as TokenId, f32::NEG_INFINITY))
                .collect();
            return Sampled {
                token: 0,
                logprob: f32::NEG_INFINITY,
                top_logprobs,
            };
        }
        if self.temperature == 0.0 && !self.wants_logprob {
            return Sampled::greedy(best);
        }
        // Leaves the temperature-1 block sums in `block_sums` for `draw` to reuse.
        let total = exp_block_sums(logits, max, 1.0, &mut self.block_sums);
        let ln_total = total.ln() as f32;
        let logprob = |logit: f32| (logit - max) - ln_total;
        let token = if self.temperature == 0.0 {
            best
        } else {
            self.draw(logits, max, best, total)
        };
        let mut top_logprobs = Vec::new();
        if self.num_logprobs > 0 {
            select_top(logits, self.num_logprobs, &mut self.candidates, true);
            top_logprobs.extend(self.candidates.iter().map(|c| (c.id, logprob(c.logit))));
        }
        Sampled {
            token,
            logprob: logprob(logits[token as usize]),
            top_logprobs,
        }
    }

    /// Repetition penalty over `prompt` and `output`, then frequency and presence penalties
    /// over `output`, in place (as vLLM `apply_penalties`). Ids outside `logits` are ignored.
    fn apply_penalties(&mut self, logits: &mut [f32], prompt: &[TokenId], output: &[TokenId]) {
        let vocab = logits.len();
        let rep = self.repetition_penalty;
        if rep != 1.0 {
            self.token_counts.resize(vocab, 0);
            let seen = prompt
                .iter()
                .chain(output)
                .map(|&t| t as usize)
                .filter(|&t| t < vocab);
            // Mark on first sight so a repeated token is penalised once.
            for t in seen.clone() {
                if self.token_counts[t] == 0 {
                    self.token_counts[t] = 1;
                    let x = logits[t];
                    logits[t] = if x > 0.0 { x / rep } else { x * rep };
                }
            }
            for t in seen {
                self.token_counts[t] = 0;
            }
        }
        let (freq, presence) = (self.frequency_penalty, self.presence_penalty);
        if freq != 0.0 || presence != 0.0 {
            self.token_counts.resize(vocab, 0);
            let in_vocab = || output.iter().map(|&t| t as usize).filter(|&t| t < vocab);
            for t in in_vocab() {
                self.token_counts[t] += 1;
            }
            // The second pass applies each distinct token once and restores the zeros.
            for t in in_vocab() {
                let count = std::mem::take(&mut self.token_counts[t]);
                if count > 0 {
                    logits[t] -= count as f32 * freq + presence;
                }
            }
        }
    }

    /// Temperature, top-k, top-p, min-p, then one draw from what is left.
    ///
    /// `max` is the largest logit (finite), `best` its id, and `total_t1` the sum of
    /// `exp(logit - max)` whose block sums are in `block_sums`. Never sorts the vocabulary:
    /// top-k is a one-pass selection; without top-k, top-p and min-p first keep only the
    /// tokens above a logit floor that provably holds every token they could keep, and
    /// top-p buckets its candidates instead of sorting them.
    fn draw(&mut self, logits: &[f32], max: f32, best: TokenId, total_t1: f64) -> TokenId {
        let inv_temperature = 1.0 / self.temperature;
        let top_k_on = self.top_k > 0 && self.top_k < logits.len();
        let (top_p_on, min_p_on) = (self.top_p < 1.0, self.min_p > 0.0);
        let total_for_top_p = if top_k_on {
            select_top(logits, self.top_k, &mut self.candidates, false);
            set_weights(&mut self.candidates, max, inv_temperature)
        } else {
            let total = if inv_temperature == 1.0 {
                total_t1
            } else {
                exp_block_sums(logits, max, inv_temperature, &mut self.block_sums)
            };
            if !top_p_on && !min_p_on {
                let target = self.rng.random::<f64>() * total;
                return draw_unfiltered(logits, max, inv_temperature, &self.block_sums, target)
                    .unwrap_or(best);
            }
            self.collect_above_floor(logits, max, total);
            total
        };
        let cand = &mut self.candidates;
        if top_p_on {
            let target = total_for_top_p * f64::from(self.top_p);
            top_p_cut(cand, target, &mut self.bucket_mass);
        }
        if min_p_on {
            // p / p_max == weight, whatever the normaliser, so this is exact after top-k/p.
            let min_p = self.min_p;
            cand.retain(|c| c.weight >= min_p);
        }
        let total: f64 = cand.iter().map(|c| f64::from(c.weight)).sum();
        let mut target = self.rng.random::<f64>() * total;
        for c in cand.iter() {
            target -= f64::from(c.weight);
            if target < 0.0 {
                return c.id;
            }
        }
        // Only rounding gets here; the best token is always a candidate.
        best
    }

    /// Fills `candidates` (with weights) with the tokens above a logit floor that top-p
    /// and min-p can never cut. For top-p: the tokens below it together weigh under
    /// `(1 - top_p) / 2` of `total`, so the rest already reach `top_p`. For min-p: a small
    /// margin below the exact cut, which is applied later.
    fn collect_above_floor(&mut self, logits: &[f32], max: f32, total: f64) {
        let mut floor_weight = 0.0f64;
        if self.top_p < 1.0 {
            let vocab = logits.len() as f64;
            floor_weight = f64::from(1.0 - self.top_p) * total / (2.0 * vocab);
        }
        if self.min_p > 0.0 {
            floor_weight = floor_weight.max(f64::from(self.min_p) * 0.999);
        }
        let floor = max + (floor_weight.ln() as f32) * self.temperature;
        let cand = &mut self.candidates;
        cand.clear();
        for (id, &logit) in logits.iter().enumerate() {
            if logit >= floor {
                cand.push(Candidate {
                    id: id as TokenId,
                    logit,
                    weight: 0.0,
                });
            }
        }
        set_weights(cand, max, 1.0 / self.temperature);
    }
}

/// Sets each candidate's weight to `exp((logit - max) * inv_temperature)`; returns their sum.
fn set_weights(cand: &mut [Candidate], max: f32, inv_temperature: f32) -> f64 {
    let mut total = 0.0f64;
    for c in cand.iter_mut() {
        c.weight = exp_non_positive((c.logit - max) * inv_temperature);
        total += f64::from(c.weight);
    }
    total
}

/// Buckets over the candidates' logit range for [`top_p_cut`].
const TOP_P_BUCKETS: usize = 1024;

/// Keeps the smallest set of best candidates whose weights reach `target` (at least the
/// best one), in any order. Instead of sorting, buckets the candidates by logit (bucket 0
/// holds the best): every bucket above the one where the running mass crosses `target` is
/// kept whole, and only that edge bucket is sorted.
fn top_p_cut(cand: &mut Vec<Candidate>, target: f64, bucket_mass: &mut Vec<f64>) {
    let (lo, hi) = cand
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.logit), hi.max(c.logit))
        });
    // If the range overflows, `scale` is 0 and everything lands in bucket 0, still correct.
    let scale = if hi > lo {
        (TOP_P_BUCKETS - 1) as f32 / (hi - lo)
    } else {
        0.0
    };
    // Monotone in the logit, so buckets are contiguous runs of the rank order.
    let bucket = |c: &Candidate| (((hi - c.logit) * scale) as usize).min(TOP_P_BUCKETS - 1);
    bucket_mass.clear();
    bucket_mass.resize(TOP_P_BUCKETS, 0.0);
    for c in cand.iter() {
        bucket_mass[bucket(c)] += f64::from(c.weight);
    }
    let mut cumulative = 0.0f64;
    let mut edge = TOP_P_BUCKETS - 1;
    for (b, &mass) in bucket_mass.iter().enumerate() {
        if cumulative + mass >= target {
            edge = b;
            break;
        }
        cumulative += mass;
    }
    // Buckets above the edge in front, the edge bucket after them, the rest dropped.
    cand.retain(|c| bucket(c) <= edge);
    let mut num_above = 0;
    for i in 0..cand.len() {
        if bucket(&cand[i]) < edge {
            cand.swap(num_above, i);
            num_above += 1;
        }
    }
    let edge_bucket = &mut cand[num_above..];
    edge_bucket.sort_unstable_by(by_rank);
    let mut kept = num_above;
    for c in edge_bucket.iter() {
        kept += 1;
        cumulative += f64::from(c.weight);
        if cumulative >= target {
            break;
        }
    }
    cand.truncate(kept.max(1));
}

/// Puts the `k` best finite logits into `out` (fewer if fewer are finite), ties by lowest
/// id, best first if `sorted`. One pass: a token is buffered only if it beats the current
/// k-th best, and the buffer is cut back to `k` by partial selection when it fills.
fn select_top(logits: &[f32], k: usize, out: &mut Vec<Candidate>, sorted: bool) {
    out.clear();
    let k = k.min(logits.len());
    if k == 0 {
        return;
    }
    let capacity = (2 * k).max(256);
    // A later token equal to the k-th best has a higher id, so it loses: hence `>`.
    let mut threshold = f32::NEG_INFINITY;
    for (id, &logit) in logits.iter().enumerate() {
        if logit > threshold {
            out.push(Candidate {
                id: id as TokenId,
                logit,
                weight: 0.0,
            });
            if out.len() == capacity {
                out.select_nth_unstable_by(k - 1, by_rank);
                out.truncate(k);
                threshold = out[k - 1].logit;
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, by_rank);
        out.truncate(k);
    }
    if sorted {
        out.sort_unstable_by(by_rank);
    }
}

/// Finds the token where the running sum of `exp((logit - max) * inv_temperature)` first
/// exceeds `target`, using the block sums to skip whole blocks. `None` only if rounding
/// leaves `target` at or past the end.
fn draw_unfiltered(
    logits: &[f32],
    max: f32,
    inv_temperature: f32,
    block_sums: &[f32],
    mut target: f64,
) -> Option<TokenId> {
    for (block, &sum) in block_sums.iter().enumerate() {
        if target >= f64::from(sum) {
            target -= f64::from(sum);
            continue;
        }
        let start = block * BLOCK_TOKENS;
        let end = (start + BLOCK_TOKENS).min(logits.len());
        for (id, &logit) in logits[start..end].iter().enumerate() {
            let weight = exp_non_positive((logit - max) * inv_temperature);
            target -= f64::from(weight);
            if target < 0.0 {
                return Some((start + id) as TokenId);
            }
        }
        return None;
    }
    None
}

/// Replaces NaN with `-inf` and `+inf` with `f32::MAX`, and returns the argmax (lowest id
/// on ties; 0 if nothing is finite) and the largest value.
fn sanitise_and_argmax(logits: &mut [f32]) -> (TokenId, f32) {
    // Simple map and lane loops, so that they vectorise; the argmax scan stops early.
    for x in logits.iter_mut() {
        *x = sanitise(*x);
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    let rest = chunks.remainder().iter().copied();
    let max = lanes
        .into_iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, f32::max);
    let best = logits.iter().position(|&x| x == max).unwrap_or(0);
    (best as TokenId, max)
}

/// NaN becomes `-inf` (never chosen), `+inf` the largest finite value (so softmax stays
/// finite). Written as selects so the loop vectorises.
#[inline(always)]
fn sanitise(x: f32) -> f32 {
    if x > f32::MAX {
        f32::MAX
    } else if x >= f32::NEG_INFINITY {
        x
    } else {
        f32::NEG_INFINITY
    }
}

/// Fills `sums` with per-block sums of `exp((logit - max) * inv_temperature)` over blocks of
/// [`BLOCK_TOKENS`] and returns their total. `max` is the largest logit.
fn exp_block_sums(logits: &[f32], max: f32, inv_temperature: f32, sums: &mut Vec<f32>) -> f64 {
    sums.clear();
    let mut total = 0.0f64;
    let mut weights = [0.0f32; BLOCK_TOKENS];
    for block in logits.chunks(BLOCK_TOKENS) {
        // A plain map loop vectorises where an exp inside a lane accumulation does not.
        let weights = &mut weights[..block.len()];
        for (weight, &x) in weights.iter_mut().zip(block) {
            *weight = exp_non_positive((x - max) * inv_temperature);
        }
        let mut lanes = [0.0f32; LANES];
        let mut chunks = weights.chunks_exact(LANES);
        for chunk in &mut chunks {
            for (lane, &w) in lanes.iter_mut().zip(chunk) {
                *lane += w;
            }
        }
        let sum = lanes.iter().chain(chunks.remainder()).sum::<f32>();
        sums.push(sum);
        total += f64::from(sum);
    }
    total
}

/// `exp(x)` for `x <= 0`, vectorisable (libm's `expf` is a call per element and dominated
/// the sampler's time at a 163,840-token vocabulary). Cephes `expf` range reduction and
/// polynomial, relative error about 2e-7; exactly `1.0` at 0 and `0.0` below -87 (so `-inf`
/// gives 0).
#[inline(always)]
fn exp_non_positive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer, which lands in the low bits.
    const ROUND: f32 = 12_582_912.0;
    let clamped = if x > -87.0 { x } else { -87.0 };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n built from its exponent bits; n is in [-126, 0] after the clamp.
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            seed: Some(7),
            ..SamplingParams::default()
        }
    }

    fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = logits
            .iter()
            .map(|&x| f64::from((x - max) / temperature).exp())
            .collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    /// Draws `n` tokens from fresh copies of `logits` and returns the frequency of each id.
    fn frequencies(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
        let mut sampler = Sampler::new(p);
        let mut counts = vec![0usize; logits.len()];
        let mut scratch = logits.to_vec();
        for _ in 0..n {
            scratch.copy_from_slice(logits);
            counts[sampler.sample(&mut scratch, &[], &[]).token as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    /// Deterministic pseudo-random logits in [-8, 8).
    fn random_logits(vocab: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..vocab)
            .map(|_| rng.random::<f32>() * 16.0 - 8.0)
            .collect()
    }

    fn one(p: &SamplingParams, logits: &[f32]) -> Sampled {
        Sampler::new(p).sample(&mut logits.to_vec(), &[], &[])
    }

    /// The backend's rule ([`kimi_ops::sample_row`], driven by [`Sampler::device_row`])
    /// draws from the same distribution as the host sampler: frequencies of `n` seeded host
    /// draws against `n` evenly spaced uniforms through the device rule.
    #[test]
    fn device_rules_draw_from_the_host_distribution() {
        let mut logits = random_logits(300, 11);
        for i in (0..300).step_by(37) {
            logits[i] = 5.5; // ties among the best tokens
        }
        let (prompt, output) = ([3u32, 7, 7, 40], [7u32, 9, 9, 9]);
        let cases = [
            (1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0),
            (0.7, 12, 1.0, 0.0, 1.0, 0.0, 0.0),
            (1.2, 0, 0.8, 0.0, 1.0, 0.0, 0.0),
            (1.0, 0, 1.0, 0.1, 1.0, 0.0, 0.0),
            (0.9, 30, 0.9, 0.05, 1.3, 0.4, 0.2),
        ];
        let n = 40_000;
        for (t, k, top_p, min_p, rep, freq, presence) in cases {
            let p = SamplingParams {
                temperature: t,
                top_k: k,
                top_p,
                min_p,
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: presence,
                seed: Some(5),
                ..SamplingParams::default()
            };
            let mut host = Sampler::new(&p);
            let mut device = Sampler::new(&p);
            let (mut want, mut got) = (vec![0f64; 300], vec![0f64; 300]);
            for i in 0..n {
                let mut row = logits.clone();
                want[host.sample(&mut row, &prompt, &output).token as usize] += 1.0 / n as f64;
                let mut penalties = Vec::new();
                let mut rules = device
                    .device_row(&prompt, &output, 0, &mut penalties)
                    .expect("no logprobs asked for");
                rules.uniform = (i as f32 + 0.5) / n as f32;
                let mut row = logits.clone();
                kimi_ops::sampling::apply_penalties(&mut row, &rules, penalties.into_iter());
                got[kimi_ops::sampling::sample_row(&row, &rules) as usize] += 1.0 / n as f64;
            }
            for (id, (w, g)) in want.iter().zip(&got).enumerate() {
                // Frequencies agree to sampling noise.
                assert!(
                    (w - g).abs() < 0.012,
                    "case t={t} k={k}: token {id}: {w} vs {g}"
                );
            }
        }
    }

    #[test]
    fn device_row_lists_each_penalised_token_once() {
        let p = SamplingParams {
            temperature: 1.0,
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        };
        let mut pens = vec![TokenPenalty {
            row: 0,
            token: 99,
            count: 0,
        }];
        let rules = Sampler::new(&p)
            .device_row(&[1, 2, 1], &[2, 3, 3], 1, &mut pens)
            .expect("no logprobs");
        assert_eq!(rules.repetition_penalty, 1.2);
        assert!((0.0..1.0).contains(&rules.uniform));
        let row1: Vec<(u32, u32)> = pens[1..].iter().map(|p| (p.token, p.count)).collect();
        assert_eq!(row1, [(1, 0), (2, 1), (3, 2)]);
        assert!(pens[1..].iter().all(|p| p.row == 1));
        // Without penalties nothing is listed; with logprobs the host must sample.
        let plain = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let mut none = Vec::new();
        assert!(Sampler::new(&plain)
            .device_row(&[1], &[2], 0, &mut none)
            .is_some());
        assert!(none.is_empty());
        let logprobs = SamplingParams {
            logprobs: Some(2),
            ..plain
        };
        assert!(Sampler::new(&logprobs)
            .device_row(&[1], &[2], 0, &mut none)
            .is_none());
    }

    #[test]
    fn default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.max_tokens, 256);
        p.validate(10).expect("default params are valid");
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties() {
        assert_eq!(one(&params(), &[0.1, 3.0, -1.0, 2.9]).token, 1);
        assert_eq!(one(&params(), &[1.0, 5.0, 2.0, 5.0]).token, 1);
        let logits = random_logits(163_840, 3);
        let argmax =
            (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)));
        assert_eq!(Some(one(&params(), &logits).token as usize), argmax);
    }

    #[test]
    fn same_seed_same_sequence_different_seeds_differ() {
        let logits = random_logits(1000, 1);
        let draw = |seed| {
            let p = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..params()
            };
            let mut sampler = Sampler::new(&p);
            (0..200)
                .map(|_| sampler.sample(&mut logits.clone(), &[], &[]).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn frequencies_match_softmax() {
        let logits = [1.0, 2.0, 0.5, -1.0, 1.5];
        for temperature in [1.0, 0.5, 2.0] {
            let p = SamplingParams {
                temperature,
                ..params()
            };
            let got = frequencies(&p, &logits, 20_000);
            for (g, want) in got.iter().zip(softmax(&logits, temperature)) {
                assert!(
                    (g - want).abs() < 0.015,
                    "T={temperature}: {got:?} vs {want}"
                );
            }
        }
    }

    #[test]
    fn top_k_one_equals_greedy() {
        for seed in 0..5 {
            let logits = random_logits(5000, seed);
            let greedy = one(&params(), &logits).token;
            let p = SamplingParams {
                temperature: 1.5,
                top_k: 1,
                seed: Some(seed),
                ..params()
            };
            let mut sampler = Sampler::new(&p);
            for _ in 0..20 {
                assert_eq!(sampler.sample(&mut logits.clone(), &[], &[]).token, greedy);
            }
        }
    }

    #[test]
    fn top_k_keeps_k_best_renormalised() {
        let logits = [1.0, 2.0, 0.5, -1.0, 1.5];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..params()
        };
        let got = frequencies(&p, &logits, 20_000);
        let want = softmax(&[2.0, 1.5], 1.0);
        assert!(
            (got[1] - want[0]).abs() < 0.015 && (got[4] - want[1]).abs() < 0.015,
            "{got:?}"
        );
        assert_eq!(got[0] + got[2] + got[3], 0.0);
    }

    #[test]
    fn top_p_tiny_equals_greedy() {
        for seed in 0..5 {
            let logits = random_logits(5000, seed + 10);
            let greedy = one(&params(), &logits).token;
            let p = SamplingParams {
                temperature: 1.0,
                top_p: 1e-6,
                seed: Some(seed),
                ..params()
            };
            let mut sampler = Sampler::new(&p);
            for _ in 0..20 {
                assert_eq!(sampler.sample(&mut logits.clone(), &[], &[]).token, greedy);
            }
        }
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_p() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let support = |top_p| {
            let p = SamplingParams {
                temperature: 1.0,
                top_p,
                ..params()
            };
            let f = frequencies(&p, &logits, 5000);
            f.iter().map(|&x| x > 0.0).collect::<Vec<_>>()
        };
        assert_eq!(support(0.75), [true, true, false, false]);
        assert_eq!(support(0.85), [true, true, true, false]);
        assert_eq!(support(0.5), [true, false, false, false]);
    }

    #[test]
    fn top_p_on_large_vocab_matches_full_sort() {
        // A flat 163,840 vocab: the nucleus is large and spans many buckets.
        let logits = random_logits(163_840, 5);
        let top_p = 0.3;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let probs = softmax(&logits, 1.0);
        let mut cumulative = 0.0;
        let nucleus_len = 1 + order
            .iter()
            .take_while(|&&i| {
                cumulative += probs[i];
                cumulative < top_p
            })
            .count();
        assert!(
            nucleus_len > 1000,
            "test wants a big nucleus, got {nucleus_len}"
        );
        let mut in_nucleus = vec![false; logits.len()];
        // Allow one token of slack at the edge for summation-order rounding.
        for &i in &order[..nucleus_len + 1] {
            in_nucleus[i] = true;
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_p: top_p as f32,
            ..params()
        };
        let mut sampler = Sampler::new(&p);
        for _ in 0..300 {
            let token = sampler.sample(&mut logits.clone(), &[], &[]).token as usize;
            assert!(in_nucleus[token], "token {token} is outside the nucleus");
        }
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_max() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let support = |min_p| {
            let p = SamplingParams {
                temperature: 1.0,
                min_p,
                ..params()
            };
            let f = frequencies(&p, &logits, 5000);
            f.iter().map(|&x| x > 0.0).collect::<Vec<_>>()
        };
        assert_eq!(support(0.2), [true, true, true, false]); // threshold p = 0.1
        assert_eq!(support(0.5), [true, true, false, false]); // threshold p = 0.25
        assert_eq!(support(1.0), [true, false, false, false]);
    }

    #[test]
    fn fast_exp_matches_libm() {
        assert_eq!(exp_non_positive(0.0), 1.0);
        assert_eq!(exp_non_positive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_non_positive(-87.5), 0.0);
        for i in 0..=86_900 {
            let x = -(i as f32) * 1e-3;
            let (got, want) = (exp_non_positive(x), f64::from(x).exp());
            assert!(
                ((f64::from(got) - want) / want).abs() < 5e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn select_top_matches_full_sort_with_ties() {
        // Quantised logits give many ties; ascending order refills the buffer most often.
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let shuffled: Vec<f32> = (0..20_000)
            .map(|_| (rng.random::<f32>() * 50.0).floor())
            .collect();
        let ascending: Vec<f32> = (0..20_000).map(|i| (i / 7) as f32).collect();
        let mut out = Vec::new();
        for logits in [shuffled, ascending] {
            let mut want: Vec<u32> = (0..logits.len() as u32).collect();
            want.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            for k in [1, 5, 300, 1000, 19_999, 25_000] {
                select_top(&logits, k, &mut out, true);
                let got: Vec<u32> = out.iter().map(|c| c.id).collect();
                assert_eq!(got, want[..k.min(logits.len())], "k = {k}");
            }
        }
    }

    /// The tokens a full sort in f64 would keep after top-k, top-p and min-p (plus the next
    /// one in rank, as slack for rounding at the top-p edge).
    fn reference_support(logits: &[f32], p: &SamplingParams) -> Vec<bool> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max = f64::from(logits[order[0]]);
        let t = f64::from(p.temperature);
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut kept = order.len();
        let mut cumulative = 0.0;
        for (n, w) in weights.iter().enumerate() {
            cumulative += w;
            if cumulative >= f64::from(p.top_p) * total {
                kept = (n + 2).min(order.len());
                break;
            }
        }
        let mut support = vec![false; logits.len()];
        for (&i, &w) in order[..kept].iter().zip(&weights) {
            support[i] = w >= f64::from(p.min_p) * 0.999_9;
        }
        support
    }

    #[test]
    fn filters_match_reference_on_large_vocab() {
        // Gaussian-ish logits with a few spikes, like a language model's.
        let mut logits = random_logits(163_840, 11);
        for (i, x) in logits.iter_mut().enumerate() {
            *x = *x * 0.6 + if i % 4099 == 0 { 6.0 } else { 0.0 };
        }
        let cases = [
            (0.7, 50, 1.0, 0.0),
            (1.0, 0, 0.9, 0.0),
            (1.3, 0, 1.0, 0.02),
            (0.8, 0, 0.95, 0.05),
            (1.0, 1000, 0.8, 0.1),
            (2.0, 0, 0.5, 0.0),
        ];
        for (temperature, top_k, top_p, min_p) in cases {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                ..params()
            };
            let support = reference_support(&logits, &p);
            let num_support = support.iter().filter(|&&s| s).count();
            let mut sampler = Sampler::new(&p);
            let mut seen = std::collections::HashSet::new();
            for _ in 0..150 {
                let token = sampler.sample(&mut logits.clone(), &[], &[]).token as usize;
                assert!(
                    support[token],
                    "{p:?}: token {token} is not kept by the reference"
                );
                seen.insert(token);
            }
            assert!(seen.len() > 1.min(num_support), "{p:?}: drew only {seen:?}");
        }
    }

    #[test]
    fn unfiltered_draw_over_many_blocks_matches_softmax() {
        // 10 likely tokens spread over 5 blocks, the rest negligible.
        let vocab = 5 * BLOCK_TOKENS + 17;
        let mut logits = vec![-30.0f32; vocab];
        let hot: Vec<usize> = (0..10).map(|i| i * 511 + 3).chain([vocab - 1]).collect();
        for (n, &i) in hot.iter().enumerate() {
            logits[i] = (n % 4) as f32 * 0.5;
        }
        let p = SamplingParams {
            temperature: 1.0,
            ..params()
        };
        let got = frequencies(&p, &logits, 20_000);
        let want = softmax(&logits, 1.0);
        for &i in &hot {
            assert!(
                (got[i] - want[i]).abs() < 0.015,
                "token {i}: {} vs {}",
                got[i],
                want[i]
            );
        }
    }

    fn penalised(p: &SamplingParams, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f32> {
        let mut logits = logits.to_vec();
        Sampler::new(p).apply_penalties(&mut logits, prompt, output);
        logits
    }

    #[test]
    fn repetition_penalty_divides_positive_multiplies_negative() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..params()
        };
        let logits = [4.0, -3.0, 5.0, -1.0, 6.0];
        // Token 0 from the prompt, token 1 from the output, token 0 repeated counts once;
        // id 99 is out of the vocabulary and ignored.
        let got = penalised(&p, &logits, &[0, 0, 99], &[1, 0]);
        assert_eq!(got, [2.0, -6.0, 5.0, -1.0, 6.0]);
    }

    #[test]
    fn frequency_penalty_scales_with_output_count_only() {
        let p = SamplingParams {
            frequency_penalty: 0.5,
            ..params()
        };
        let got = penalised(&p, &[1.0; 4], &[3, 3], &[0, 2, 0, 0]);
        assert_eq!(got, [1.0 - 1.5, 1.0, 0.5, 1.0]);
    }

    #[test]
    fn presence_penalty_applies_once_per_output_token() {
        let p = SamplingParams {
            presence_penalty: -0.5,
            ..params()
        };
        let got = penalised(&p, &[1.0; 4], &[3], &[0, 2, 0, 0]);
        assert_eq!(got, [1.5, 1.0, 1.5, 1.0]);
    }

    #[test]
    fn penalties_combine_and_change_the_greedy_choice() {
        let p = SamplingParams {
            repetition_penalty: 1.5,
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..params()
        };
        let got = penalised(&p, &[3.0, 2.5, 0.0], &[], &[0, 0]);
        assert_eq!(got, [3.0 / 1.5 - 0.5 - 0.5, 2.5, 0.0]);
        let mut logits = vec![3.0, 2.5, 0.0];
        assert_eq!(Sampler::new(&p).sample(&mut logits, &[], &[0, 0]).token, 1);
    }

    #[test]
    fn logprobs_are_log_softmax_of_penalised_logits() {
        let logits = [1.0, 2.0, 0.5, -1.0, 1.5];
        let p = SamplingParams {
            temperature: 0.3,
            logprobs: Some(5),
            ..params()
        };
        let s = one(&p, &logits);
        let want = softmax(&logits, 1.0);
        assert!((f64::from(s.logprob) - want[s.token as usize].ln()).abs() < 1e-5);
        let total: f64 = s
            .top_logprobs
            .iter()
            .map(|&(_, lp)| f64::from(lp).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let ids: Vec<u32> = s.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [1, 4, 0, 2, 3]);
        for &(id, lp) in &s.top_logprobs {
            assert!((f64::from(lp) - want[id as usize].ln()).abs() < 1e-5);
        }
        // Penalties are included: token 1 penalised below token 4.
        let p = SamplingParams {
            presence_penalty: 1.0,
            logprobs: Some(2),
            ..params()
        };
        let s = Sampler::new(&p).sample(&mut logits.to_vec(), &[], &[1]);
        assert_eq!(s.token, 4);
        assert_eq!(
            s.top_logprobs.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
            [4, 0]
        );
        assert!(one(&params(), &logits).top_logprobs.is_empty());
    }

    #[test]
    fn top_logprobs_ties_go_to_lowest_id() {
        let p = SamplingParams {
            logprobs: Some(3),
            ..params()
        };
        let s = one(&p, &[1.0, 2.0, 1.0, 2.0, 1.0]);
        let ids: Vec<u32> = s.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [1, 3, 0]);
    }

    #[test]
    fn nan_logits_never_win_and_never_panic() {
        let nan = f32::NAN;
        let logits = [nan, 1.0, nan, 0.5];
        for temperature in [0.0, 1.0] {
            let p = SamplingParams {
                temperature,
                top_p: 0.9,
                logprobs: Some(2),
                ..params()
            };
            let mut sampler = Sampler::new(&p);
            for _ in 0..100 {
                let s = sampler.sample(&mut logits.to_vec(), &[], &[]);
                assert!(s.token == 1 || s.token == 3);
                assert!(s.logprob.is_finite());
            }
        }
        // All NaN or -inf: token 0, logprob -inf, under every mode.
        let all_bad = [nan, f32::NEG_INFINITY, nan];
        for temperature in [0.0, 1.0] {
            let p = SamplingParams {
                temperature,
                repetition_penalty: 1.3,
                logprobs: Some(2),
                ..params()
            };
            let s = Sampler::new(&p).sample(&mut all_bad.to_vec(), &[1], &[2]);
            assert_eq!((s.token, s.logprob), (0, f32::NEG_INFINITY));
            assert_eq!(
                s.top_logprobs,
                [(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY)]
            );
        }
        // +inf is the largest finite value: it wins and its logprob is finite.
        let p = SamplingParams {
            temperature: 1.0,
            ..params()
        };
        let s = one(&p, &[0.0, f32::INFINITY, nan]);
        assert_eq!(s.token, 1);
        assert!(s.logprob.is_finite());
        assert!(one(&params(), &[]).logprob == f32::NEG_INFINITY);
    }

    #[test]
    fn validation_rejects_bad_values() {
        type Edit = fn(&mut SamplingParams);
        let cases: &[(&str, Edit)] = &[
            ("temperature", |p| p.temperature = -0.1),
            ("temperature", |p| p.temperature = 100.5),
            ("temperature", |p| p.temperature = f32::INFINITY),
            ("temperature", |p| p.temperature = f32::NAN),
            ("top_p", |p| p.top_p = 0.0),
            ("top_p", |p| p.top_p = 1.01),
            ("top_p", |p| p.top_p = f32::NAN),
            ("min_p", |p| p.min_p = -0.01),
            ("min_p", |p| p.min_p = 1.5),
            ("min_p", |p| p.min_p = f32::NAN),
            ("repetition_penalty", |p| p.repetition_penalty = 0.0),
            ("repetition_penalty", |p| p.repetition_penalty = -1.0),
            ("repetition_penalty", |p| {
                p.repetition_penalty = f32::INFINITY
            }),
            ("repetition_penalty", |p| p.repetition_penalty = f32::NAN),
            ("frequency_penalty", |p| p.frequency_penalty = 2.5),
            ("frequency_penalty", |p| p.frequency_penalty = f32::NAN),
            ("presence_penalty", |p| p.presence_penalty = -2.5),
            ("presence_penalty", |p| p.presence_penalty = f32::NAN),
            ("max_tokens", |p| p.max_tokens = 0),
            ("logprobs", |p| p.logprobs = Some(21)),
            ("stop", |p| p.stop = vec![String::new()]),
            ("stop", |p| p.stop = vec!["x".to_string(); 17]),
            ("stop_token_ids", |p| p.stop_token_ids = vec![3, 100]),
        ];
        for (field, edit) in cases {
            let mut p = SamplingParams::default();
            edit(&mut p);
            match p.validate(100) {
                Err(SamplingError::Invalid { field: got, reason }) => {
                    assert_eq!(got, *field, "{p:?}");
                    assert!(!reason.is_empty());
                }
                Ok(()) => panic!("{field} accepted in {p:?}"),
            }
        }
        let edge = SamplingParams {
            temperature: 100.0,
            top_p: 1.0,
            min_p: 1.0,
            frequency_penalty: -2.0,
            presence_penalty: 2.0,
            logprobs: Some(20),
            stop: vec!["x".to_string(); 16],
            stop_token_ids: vec![99],
            max_tokens: 1,
            ..SamplingParams::default()
        };
        edge.validate(100).expect("edge values are valid");
        let err = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        }
        .validate(100);
        let text = err.expect_err("top_p 0 is invalid").to_string();
        assert_eq!(
            text,
            "invalid sampling parameter `top_p`: must be in (0, 1], got 0"
        );
    }
}
