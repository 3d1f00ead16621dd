//! Token choice where the logits are ([`crate::Backend::sample_rows`]): what one row asks
//! for, and [`sample_row`], the plain host definition that device kernels must match.
//!
//! The steps are those of the engine's host sampler (vLLM's order): penalties, sanitising
//! (NaN → `-inf`, `+inf` → the largest finite value), then either the argmax
//! (temperature 0) or weights `exp((logit − max) / T)` over the finite logits, top-k,
//! top-p, min-p and one draw. Ranks are by logit, ties by lowest id.
//!
//! Weights are summed as integer multiples of 2^-40, as the device kernel does, so that a
//! sum does not depend on the order it is taken in: the same logits and the same uniform
//! number give the same token on every backend, up to the device's `exp` rounding.

/// How one logits row chooses its token. Values should have passed the engine's checks
/// (temperature in `[0, 100]`, `top_p` in `(0, 1]`, `min_p` in `[0, 1]`, penalties finite).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// Softmax temperature; `0` takes the argmax.
    pub temperature: f32,
    /// Keep the `top_k` best tokens; `0` turns the filter off.
    pub top_k: u32,
    /// Keep the smallest best-first set whose weight reaches `top_p` of the total; `1` is off.
    pub top_p: f32,
    /// Keep tokens whose weight is at least `min_p` times the best one's; `0` is off.
    pub min_p: f32,
    /// Repetition penalty for every listed token (`1` is off).
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once from every token that occurs in the output.
    pub presence_penalty: f32,
    /// The draw, uniform in `[0, 1)`, from the sequence's own generator.
    pub uniform: f32,
}

impl RowSampling {
    /// Greedy choice without penalties.
    pub fn greedy() -> Self {
        RowSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            uniform: 0.0,
        }
    }
}

/// One token of a row that penalties touch: it occurs in the prompt or the output, `count`
/// times in the output. A row lists each token at most once.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenPenalty {
    /// The logits row (index into the rows being sampled).
    pub row: u32,
    /// The token id; ids outside the vocabulary are ignored.
    pub token: u32,
    /// Occurrences in the output so far.
    pub count: u32,
}

/// A weight in `[0, 1]` as an integer multiple of 2^-40.
fn fixed(weight: f32) -> u64 {
    (weight * 1_099_511_627_776.0).round_ties_even() as u64
}

/// Applies `penalties` (already filtered to this row) to `logits` in place.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &RowSampling,
    penalties: impl Iterator<Item = TokenPenalty>,
) {
    for p in penalties {
        let Some(x) = logits.get_mut(p.token as usize) else {
            continue;
        };
        let mut l = *x;
        let rep = params.repetition_penalty;
        if rep != 1.0 {
            l = if l > 0.0 { l / rep } else { l * rep };
        }
        if p.count > 0 {
            l -= p.count as f32 * params.frequency_penalty + params.presence_penalty;
        }
        *x = l;
    }
}

/// The token `params` picks from one row of already penalised `logits` (the reference
/// for device kernels; it sorts, so it is slow on large vocabularies).
pub fn sample_row(logits: &[f32], params: &RowSampling) -> u32 {
    let sanitised: Vec<f32> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x.min(f32::MAX)
            }
        })
        .collect();
    let best = crate::argmax_row(&sanitised);
    let max = sanitised
        .get(best as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    if params.temperature == 0.0 {
        return best;
    }
    let inv_t = 1.0 / params.temperature;
    let weight = |l: f32| ((l - max) * inv_t).exp();
    // Finite tokens, best first, ties by lowest id.
    let mut ranked: Vec<u32> = (0..sanitised.len() as u32)
        .filter(|&i| sanitised[i as usize] > f32::NEG_INFINITY)
        .collect();
    ranked.sort_by(|&a, &b| {
        sanitised[b as usize]
            .total_cmp(&sanitised[a as usize])
            .then(a.cmp(&b))
    });
    let k = params.top_k as usize;
    if k > 0 && k < ranked.len() {
        ranked.truncate(k);
    }
    if params.top_p < 1.0 {
        let total: u64 = ranked
            .iter()
            .map(|&i| fixed(weight(sanitised[i as usize])))
            .sum();
        let goal = ((total as f64 * f64::from(params.top_p)) as u64).max(1);
        let mut acc = 0u64;
        let mut keep = ranked.len();
        for (n, &i) in ranked.iter().enumerate() {
            acc += fixed(weight(sanitised[i as usize]));
            if acc >= goal {
                keep = n + 1;
                break;
            }
        }
        ranked.truncate(keep);
    }
    ranked.retain(|&i| weight(sanitised[i as usize]) >= params.min_p);
    ranked.sort_unstable();
    let masses: Vec<u64> = ranked
        .iter()
        .map(|&i| fixed(weight(sanitised[i as usize])))
        .collect();
    let total: u64 = masses.iter().sum();
    let target = (total as f64 * f64::from(params.uniform)) as u64;
    let mut run = 0u64;
    for (&i, &m) in ranked.iter().zip(&masses) {
        run += m;
        if run > target {
            return i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f32) -> RowSampling {
        RowSampling {
            temperature,
            top_k,
            top_p,
            min_p,
            uniform,
            ..RowSampling::greedy()
        }
    }

    #[test]
    fn greedy_and_degenerate_rows() {
        let row = [1.0, 3.0, f32::NAN, 3.0];
        assert_eq!(sample_row(&row, &RowSampling::greedy()), 1);
        assert_eq!(
            sample_row(
                &[f32::NAN, f32::NEG_INFINITY],
                &params(1.0, 0, 1.0, 0.0, 0.5)
            ),
            0
        );
        assert_eq!(
            sample_row(&[0.0, f32::INFINITY, 5.0], &RowSampling::greedy()),
            1
        );
    }

    #[test]
    fn draw_follows_id_order_and_weights() {
        // Equal logits: the uniform number walks the ids in order.
        let row = [0.0f32; 4];
        for (u, want) in [(0.0, 0), (0.3, 1), (0.6, 2), (0.99, 3)] {
            assert_eq!(sample_row(&row, &params(1.0, 0, 1.0, 0.0, u)), want);
        }
    }

    #[test]
    fn filters_keep_the_right_sets() {
        let row = [2.0, 1.0, 2.0, 0.0, -1.0];
        // top-k 2 keeps ids 0 and 2 (ties by lowest id would keep 0 first).
        for u in [0.0, 0.49, 0.51, 0.999] {
            let t = sample_row(&row, &params(1.0, 2, 1.0, 0.0, u));
            assert!(t == 0 || t == 2, "{t}");
        }
        // top-k 1 with a tie keeps the lowest id.
        assert_eq!(sample_row(&row, &params(1.0, 1, 1.0, 0.0, 0.9)), 0);
        // A tiny top-p keeps only the best token.
        assert_eq!(sample_row(&row, &params(1.0, 0, 1e-6, 0.0, 0.9)), 0);
        // min-p 0.5 keeps weights >= 0.5: ids 0 and 2 (e^-1 < 0.5).
        for u in [0.1, 0.9] {
            let t = sample_row(&row, &params(1.0, 0, 1.0, 0.5, u));
            assert!(t == 0 || t == 2, "{t}");
        }
    }

    #[test]
    fn penalties_match_the_host_sampler_rules() {
        let mut row = [2.0, -2.0, 1.0];
        let p = RowSampling {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..RowSampling::greedy()
        };
        let pens = [
            TokenPenalty {
                row: 0,
                token: 0,
                count: 0,
            },
            TokenPenalty {
                row: 0,
                token: 1,
                count: 2,
            },
            TokenPenalty {
                row: 0,
                token: 9,
                count: 1,
            },
        ];
        apply_penalties(&mut row, &p, pens.into_iter());
        assert_eq!(row, [1.0, -4.0 - 1.25, 1.0]);
    }
}
