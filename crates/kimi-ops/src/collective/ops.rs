//! The operations of [`super::Collective`] over any [`Exchange`]: each rank deposits its
//! values, and every rank combines all deposits in rank order, so that all ranks hold the
//! same bits whichever way the deposits travelled (threads or processes).

use super::{Deposit, Exchange};
use crate::{Backend, Error, Result};

fn deposit<B: Backend>(be: &B, op: &'static str, t: &B::Tensor) -> Result<Deposit> {
    Ok(Deposit {
        op,
        shape: rows_cols(be.shape(t)),
        values: be.to_f32(t)?,
        rows_to: Vec::new(),
    })
}

/// `[rows, cols]` of a tensor shape (a vector is one row; leading dims fold into rows).
fn rows_cols(shape: &[usize]) -> [usize; 2] {
    match shape {
        [] => [1, 1],
        [n] => [1, *n],
        [.., c] => [shape[..shape.len() - 1].iter().product(), *c],
    }
}

fn same_shapes(op: &str, deposits: &[&Deposit]) -> Result<[usize; 2]> {
    let shape = deposits[0].shape;
    match deposits.iter().position(|d| d.shape != shape) {
        Some(r) => Err(Error::Shape {
            op: "collective",
            detail: format!(
                "{op}: rank 0 passed {:?} but rank {r} passed {:?}",
                shape, deposits[r].shape
            ),
        }),
        None => Ok(shape),
    }
}

pub(super) fn all_reduce_sum<B: Backend>(
    x: &impl Exchange,
    be: &B,
    t: &mut B::Tensor,
) -> Result<()> {
    const OP: &str = "all_reduce_sum";
    let shape = be.shape(t).to_vec();
    let mine = deposit(be, OP, t)?;
    let sum = x.exchange(mine, |all| {
        same_shapes(OP, all)?;
        let mut sum = all[0].values.clone();
        for d in &all[1..] {
            for (s, v) in sum.iter_mut().zip(&d.values) {
                *s += v;
            }
        }
        Ok(sum)
    })?;
    *t = be.upload_f32(&shape, &sum)?;
    Ok(())
}

pub(super) fn all_gather_cols<B: Backend>(
    x: &impl Exchange,
    be: &B,
    t: &B::Tensor,
) -> Result<B::Tensor> {
    const OP: &str = "all_gather_cols";
    let mine = deposit(be, OP, t)?;
    let (rows, out) = x.exchange(mine, |all| {
        let rows = all[0].shape[0];
        if let Some(r) = all.iter().position(|d| d.shape[0] != rows) {
            return Err(Error::Shape {
                op: "collective",
                detail: format!(
                    "{OP}: rank 0 passed {rows} rows, rank {r} {}",
                    all[r].shape[0]
                ),
            });
        }
        let mut out = Vec::with_capacity(all.iter().map(|d| d.values.len()).sum());
        for row in 0..rows {
            for d in all {
                let c = d.shape[1];
                out.extend_from_slice(&d.values[row * c..(row + 1) * c]);
            }
        }
        Ok((rows, out))
    })?;
    let cols = out.len().checked_div(rows).unwrap_or(0);
    be.upload_f32(&[rows, cols], &out)
}

pub(super) fn all_gather_rows<B: Backend>(
    x: &impl Exchange,
    be: &B,
    t: &B::Tensor,
) -> Result<B::Tensor> {
    const OP: &str = "all_gather_rows";
    let mine = deposit(be, OP, t)?;
    let (cols, out) = x.exchange(mine, |all| {
        let cols = all[0].shape[1];
        if let Some(r) = all.iter().position(|d| d.shape[1] != cols) {
            return Err(Error::Shape {
                op: "collective",
                detail: format!(
                    "{OP}: rank 0 passed {cols} columns, rank {r} {}",
                    all[r].shape[1]
                ),
            });
        }
        Ok((
            cols,
            all.iter()
                .flat_map(|d| d.values.iter().copied())
                .collect::<Vec<f32>>(),
        ))
    })?;
    let rows = out.len().checked_div(cols).unwrap_or(0);
    be.upload_f32(&[rows, cols], &out)
}

pub(super) fn reduce_scatter_rows<B: Backend>(
    x: &impl Exchange,
    be: &B,
    t: &B::Tensor,
) -> Result<B::Tensor> {
    const OP: &str = "reduce_scatter_rows";
    let (world, rank) = (x.world(), x.rank());
    let mine = deposit(be, OP, t)?;
    let (share, cols, sum) = x.exchange(mine, |all| {
        let [rows, cols] = same_shapes(OP, all)?;
        if !rows.is_multiple_of(world) {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: {rows} rows do not split over {world} ranks"),
            });
        }
        let share = rows / world;
        let range = rank * share * cols..(rank + 1) * share * cols;
        let mut sum = all[0].values[range.clone()].to_vec();
        for d in &all[1..] {
            for (s, v) in sum.iter_mut().zip(&d.values[range.clone()]) {
                *s += v;
            }
        }
        Ok((share, cols, sum))
    })?;
    be.upload_f32(&[share, cols], &sum)
}

pub(super) fn all_to_all_rows<B: Backend>(
    x: &impl Exchange,
    be: &B,
    parts: &[B::Tensor],
) -> Result<Vec<B::Tensor>> {
    const OP: &str = "all_to_all_rows";
    let world = x.world();
    if parts.len() != world {
        return Err(Error::Shape {
            op: "collective",
            detail: format!("{OP}: {} parts for {world} ranks", parts.len()),
        });
    }
    let mut values = Vec::new();
    let mut rows_to = Vec::with_capacity(world);
    let mut cols = None;
    for p in parts {
        let [r, c] = rows_cols(be.shape(p));
        if *cols.get_or_insert(c) != c && r > 0 {
            return Err(Error::Shape {
                op: "collective",
                detail: format!("{OP}: parts of {} and {c} columns", cols.unwrap_or(c)),
            });
        }
        values.extend(be.to_f32(p)?);
        rows_to.push(r);
    }
    let cols = cols.unwrap_or(0);
    let mine = Deposit {
        op: OP,
        shape: [rows_to.iter().sum(), cols],
        values,
        rows_to,
    };
    let rank = x.rank();
    let received = x.exchange(mine, |all| {
        if let Some(r) = all
            .iter()
            .position(|d| d.shape[1] != cols && d.shape[0] > 0)
        {
            return Err(Error::Shape {
                op: "collective",
                detail: format!(
                    "{OP}: rank {rank} sends {cols} columns, rank {r} {}",
                    all[r].shape[1]
                ),
            });
        }
        Ok(all
            .iter()
            .map(|d| {
                let c = d.shape[1];
                let start: usize = d.rows_to[..rank].iter().sum();
                let rows = d.rows_to[rank];
                (rows, d.values[start * c..(start + rows) * c].to_vec())
            })
            .collect::<Vec<_>>())
    })?;
    received
        .into_iter()
        .map(|(rows, v)| be.upload_f32(&[rows, cols], &v))
        .collect()
}

pub(super) fn broadcast<B: Backend>(
    x: &impl Exchange,
    be: &B,
    t: &mut B::Tensor,
    root: usize,
) -> Result<()> {
    const OP: &str = "broadcast";
    let world = x.world();
    if root >= world {
        return Err(Error::Shape {
            op: "collective",
            detail: format!("{OP}: root {root} of {world} ranks"),
        });
    }
    let shape = be.shape(t).to_vec();
    let mine = deposit(be, OP, t)?;
    let values = x.exchange(mine, |all| {
        same_shapes(OP, all)?;
        Ok(all[root].values.clone())
    })?;
    *t = be.upload_f32(&shape, &values)?;
    Ok(())
}
