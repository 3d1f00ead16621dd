//! Round-to-nearest quantization of one matrix into compressed-tensors' `pack-quantized`
//! planes, with the rules of compressed-tensors' min-max observer, so that vLLM,
//! transformers and kimi-infer read the result the same way.

/// How [`quantize`] quantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtnOptions {
    /// Bits per code: 4 or 8.
    pub bits: u32,
    /// Input columns per scale; `None`: one scale per row (per channel).
    pub group_size: Option<usize>,
    /// Symmetric codes (no zero points).
    pub symmetric: bool,
}

/// The stored form of one quantized matrix `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    /// `weight_packed` `[rows, ⌈cols·bits/32⌉]`: code `c` of a row (`q + 2^(bits−1)`) at bit
    /// `c·bits` of the row's words.
    pub packed: Vec<i32>,
    /// `weight_scale` `[rows, groups]`, each already rounded by `round_scale` (the
    /// checkpoint's dtype).
    pub scales: Vec<f32>,
    /// `weight_zero_point` `[⌈rows·bits/32⌉, groups]` (asymmetric): the zero points
    /// `z + 2^(bits−1)` packed along the rows.
    pub zeros: Option<Vec<i32>>,
    /// Scale columns per row.
    pub groups: usize,
}

impl RtnOptions {
    /// Scale columns of a row of `cols` values, or `None` where the group does not divide it.
    pub fn groups(&self, cols: usize) -> Option<usize> {
        let g = self.group_size.unwrap_or(cols);
        (g > 0 && cols.is_multiple_of(g)).then(|| cols / g)
    }
}

/// Words of `n` fields of `bits` packed densely.
pub fn packed_words(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(32)
}

/// Quantizes `values` `[rows, cols]`; `round_scale` rounds a scale to the dtype the scales
/// are stored in (codes are computed with the stored scale, as the tools do). The group
/// must divide `cols` ([`RtnOptions::groups`]).
pub fn quantize(
    values: &[f32],
    rows: usize,
    cols: usize,
    o: RtnOptions,
    round_scale: impl Fn(f32) -> f32,
) -> PackedMatrix {
    let groups = o.groups(cols).unwrap_or(1);
    let size = cols / groups;
    let mut codes = vec![0i32; rows * cols];
    let mut params = vec![GroupParams::default(); rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            let part = &values[r * cols + g * size..r * cols + (g + 1) * size];
            let p = GroupParams::of(part, o, &round_scale);
            params[r * groups + g] = p;
            for (c, &v) in part.iter().enumerate() {
                codes[r * cols + g * size + c] = p.code(v, o);
            }
        }
    }
    pack(&codes, &params, rows, cols, o)
}

/// The scale and zero point of one group of a row, by compressed-tensors' min-max observer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GroupParams {
    /// The step between codes, as stored.
    pub scale: f32,
    /// The code of 0 (0 when symmetric).
    pub zero: i32,
}

impl GroupParams {
    /// The parameters of the values `part` (the observer's range always holds zero).
    pub fn of(part: &[f32], o: RtnOptions, round_scale: &impl Fn(f32) -> f32) -> Self {
        let (q_min, q_max) = o.code_range();
        let lo = part.iter().fold(0f32, |m, &v| m.min(v));
        let hi = part.iter().fold(0f32, |m, &v| m.max(v));
        let scale = if o.symmetric {
            hi.max(-lo) / ((q_max - q_min) as f32 / 2.0)
        } else {
            (hi - lo) / (q_max - q_min) as f32
        };
        let mut scale = round_scale(if scale > 0.0 { scale } else { f32::EPSILON });
        if scale <= 0.0 || !scale.is_finite() {
            scale = f32::EPSILON;
        }
        let zero = if o.symmetric {
            0
        } else {
            (q_min - (lo / scale).round() as i32).clamp(q_min, q_max)
        };
        Self { scale, zero }
    }

    /// The signed code of `v`.
    pub fn code(&self, v: f32, o: RtnOptions) -> i32 {
        let (q_min, q_max) = o.code_range();
        ((v / self.scale).round() as i32 + self.zero).clamp(q_min, q_max)
    }

    /// The value a code stands for.
    pub fn value(&self, code: i32) -> f32 {
        (code - self.zero) as f32 * self.scale
    }
}

impl RtnOptions {
    /// The smallest and largest signed code.
    pub fn code_range(&self) -> (i32, i32) {
        (-(1i32 << (self.bits - 1)), (1i32 << (self.bits - 1)) - 1)
    }
}

/// Packs signed codes `[rows, cols]` and their groups' parameters `[rows, groups]` into
/// compressed-tensors' planes.
pub fn pack(
    codes: &[i32],
    params: &[GroupParams],
    rows: usize,
    cols: usize,
    o: RtnOptions,
) -> PackedMatrix {
    let groups = o.groups(cols).unwrap_or(1);
    let offset = 1i32 << (o.bits - 1);
    let words = packed_words(cols, o.bits);
    let mut packed = vec![0u32; rows * words];
    for r in 0..rows {
        let row = &mut packed[r * words..(r + 1) * words];
        for (c, &q) in codes[r * cols..(r + 1) * cols].iter().enumerate() {
            set_field(row, c, o.bits, (q + offset) as u32);
        }
    }
    let zeros = (!o.symmetric).then(|| {
        let zwords = packed_words(rows, o.bits);
        let mut z = vec![0u32; zwords * groups];
        for g in 0..groups {
            let mut col = vec![0u32; zwords];
            for r in 0..rows {
                set_field(
                    &mut col,
                    r,
                    o.bits,
                    (params[r * groups + g].zero + offset) as u32,
                );
            }
            for (w, v) in col.into_iter().enumerate() {
                z[w * groups + g] = v;
            }
        }
        z.into_iter().map(|w| w as i32).collect()
    });
    PackedMatrix {
        packed: packed.into_iter().map(|w| w as i32).collect(),
        scales: params.iter().map(|p| p.scale).collect(),
        zeros,
        groups,
    }
}

/// Sets field `i` (`bits` wide) of a little-endian word stream.
fn set_field(words: &mut [u32], i: usize, bits: u32, v: u32) {
    let bit = i * bits as usize;
    let (w, off) = (bit / 32, (bit % 32) as u32);
    words[w] |= v << off;
    if off + bits > 32 {
        words[w + 1] |= v >> (32 - off);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes read back through the loader's field reader give every value within half a
    /// step of its group's scale.
    #[test]
    fn values_come_back_within_half_a_step() {
        let (rows, cols) = (9, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0 + (i % 7) as f32 * 0.01)
            .collect();
        for o in [
            RtnOptions {
                bits: 4,
                group_size: Some(32),
                symmetric: false,
            },
            RtnOptions {
                bits: 4,
                group_size: None,
                symmetric: true,
            },
            RtnOptions {
                bits: 8,
                group_size: Some(16),
                symmetric: false,
            },
            RtnOptions {
                bits: 8,
                group_size: None,
                symmetric: true,
            },
        ] {
            let m = quantize(&values, rows, cols, o, |s| s);
            let words = packed_words(cols, o.bits);
            let offset = 1i64 << (o.bits - 1);
            for r in 0..rows {
                let row: Vec<u32> = m.packed[r * words..(r + 1) * words]
                    .iter()
                    .map(|&w| w as u32)
                    .collect();
                for c in 0..cols {
                    let g = c / (cols / m.groups);
                    let s = m.scales[r * m.groups + g];
                    let z = match &m.zeros {
                        Some(z) => {
                            let zw = packed_words(rows, o.bits);
                            let col: Vec<u32> =
                                (0..zw).map(|w| z[w * m.groups + g] as u32).collect();
                            i64::from(super::super::field(&col, r, o.bits)) - offset
                        }
                        None => 0,
                    };
                    let q = i64::from(super::super::field(&row, c, o.bits)) - offset;
                    let back = (q - z) as f32 * s;
                    let v = values[r * cols + c];
                    assert!(
                        (back - v).abs() <= s * 0.5 + 1e-6,
                        "{o:?} [{r}, {c}]: {back} vs {v}"
                    );
                }
            }
        }
    }
}
