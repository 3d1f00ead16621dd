//! Small row-wise operations: embedding lookup, RMSNorm, residual add, row and column moves.

use crate::tensor::{row_to_f32, shape_err, CpuTensor};
use kimi_ops::Result;

pub fn embedding(table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
    // The whole table is the one part of its vocabulary.
    let (vocab, _) = table.rows_cols("embedding")?;
    embedding_part(table, ids, 0, vocab)
}

/// [`kimi_ops::Backend::embedding_part`]: the rows `first..first + rows` of a vocabulary of
/// `vocab` split over ranks; other ranks' ids give zero rows.
pub fn embedding_part(
    table: &CpuTensor,
    ids: &[u32],
    first: usize,
    vocab: usize,
) -> Result<CpuTensor> {
    let (rows, d) = table.rows_cols("embedding")?;
    if first.checked_add(rows).is_none_or(|end| end > vocab) {
        return Err(shape_err(
            "embedding",
            format!("rows {first}..{first}+{rows} are not inside a vocabulary of {vocab}"),
        ));
    }
    let mut out = vec![0f32; ids.len() * d];
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            return Err(shape_err(
                "embedding",
                format!("token id {id} is outside the vocabulary of {vocab}"),
            ));
        }
        if let Some(local) = id.checked_sub(first).filter(|&l| l < rows) {
            row_to_f32(&table.storage, local * d, &mut out[t * d..(t + 1) * d]);
        }
    }
    CpuTensor::f32(&[ids.len(), d], out)
}

pub fn rms_norm(x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
    let (n, d) = x.rows_cols("rms_norm")?;
    let w = weight.f32_values();
    if w.len() != d {
        return Err(shape_err(
            "rms_norm",
            format!("x {:?}, weight {:?}", x.shape, weight.shape),
        ));
    }
    let xs = x.as_f32("rms_norm")?;
    let mut out = vec![0f32; n * d];
    for (row, o) in xs
        .chunks_exact(d.max(1))
        .zip(out.chunks_exact_mut(d.max(1)))
    {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((oi, xi), wi) in o.iter_mut().zip(row).zip(w.iter()) {
            *oi = xi * r * wi;
        }
    }
    CpuTensor::f32(&x.shape, out)
}

pub fn add_assign(x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
    if x.shape != y.shape {
        return Err(shape_err("add", format!("{:?} + {:?}", x.shape, y.shape)));
    }
    let ys = y.as_f32("add")?;
    for (a, b) in x.as_f32_mut("add")?.iter_mut().zip(ys) {
        *a += b;
    }
    Ok(())
}

pub fn select_rows(x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
    let (n, d) = x.rows_cols("select_rows")?;
    let xs = x.as_f32("select_rows")?;
    let mut out = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        if r >= n {
            return Err(shape_err("select_rows", format!("row {r} of {n}")));
        }
        out.extend_from_slice(&xs[r * d..(r + 1) * d]);
    }
    CpuTensor::f32(&[rows.len(), d], out)
}

pub fn split_cols(x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
    let (n, d) = x.rows_cols("split_cols")?;
    if widths.iter().sum::<usize>() != d {
        return Err(shape_err(
            "split_cols",
            format!("widths {widths:?} do not add up to {d}"),
        ));
    }
    let xs = x.as_f32("split_cols")?;
    let mut offset = 0;
    let mut parts = Vec::with_capacity(widths.len());
    for &w in widths {
        let mut v = Vec::with_capacity(n * w);
        for t in 0..n {
            v.extend_from_slice(&xs[t * d + offset..t * d + offset + w]);
        }
        parts.push(CpuTensor::f32(&[n, w], v)?);
        offset += w;
    }
    Ok(parts)
}

pub fn concat_cols(parts: &[&CpuTensor]) -> Result<CpuTensor> {
    let n = match parts.first() {
        Some(p) => p.rows_cols("concat_cols")?.0,
        None => return Err(shape_err("concat_cols", "nothing to concatenate".into())),
    };
    let mut dims = Vec::with_capacity(parts.len());
    for p in parts {
        let (pn, pw) = p.rows_cols("concat_cols")?;
        if pn != n {
            return Err(shape_err(
                "concat_cols",
                format!("row counts {pn} and {n} differ"),
            ));
        }
        dims.push((p.as_f32("concat_cols")?, pw));
    }
    let total: usize = dims.iter().map(|d| d.1).sum();
    let mut out = Vec::with_capacity(n * total);
    for t in 0..n {
        for (data, w) in &dims {
            out.extend_from_slice(&data[t * w..(t + 1) * w]);
        }
    }
    CpuTensor::f32(&[n, total], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two halves of a table give their rows and zeros for the other half's ids; summed
    /// they are the whole table's lookup; ids past the vocabulary are refused.
    #[test]
    fn vocabulary_parts_sum_to_the_whole_lookup() {
        let (vocab, d) = (6usize, 3usize);
        let values: Vec<f32> = (0..vocab * d).map(|i| i as f32 * 0.5 - 2.0).collect();
        let whole = CpuTensor::f32(&[vocab, d], values.clone()).unwrap();
        let ids = [5u32, 0, 3, 2, 2];
        let want = embedding(&whole, &ids).unwrap().f32_values().to_vec();
        let mut sum = vec![0f32; ids.len() * d];
        for first in [0, 3] {
            let part =
                CpuTensor::f32(&[3, d], values[first * d..(first + 3) * d].to_vec()).unwrap();
            let got = embedding_part(&part, &ids, first, vocab)
                .unwrap()
                .f32_values()
                .to_vec();
            for (t, &id) in ids.iter().enumerate() {
                let row = &got[t * d..(t + 1) * d];
                if (first..first + 3).contains(&(id as usize)) {
                    assert_eq!(row, &want[t * d..(t + 1) * d]);
                } else {
                    assert!(row.iter().all(|&v| v == 0.0));
                }
            }
            sum.iter_mut().zip(&got).for_each(|(s, g)| *s += g);
        }
        assert_eq!(sum, want);
        let part = CpuTensor::f32(&[3, d], values[..3 * d].to_vec()).unwrap();
        let err = embedding_part(&part, &[6], 0, vocab)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("token id 6 is outside the vocabulary of 6"),
            "{err}"
        );
        assert!(embedding_part(&part, &[0], 4, vocab).is_err());
    }
}
