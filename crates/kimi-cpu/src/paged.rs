//! Rows of a paged cache pool `[num_blocks, block_size, width]` (see `kimi_ops::PagedSeq`).

use kimi_ops::PagedSeq;

/// One sequence's rows of a pool (of f32, or of f16 bit patterns), read through its block
/// table.
#[derive(Clone, Copy)]
pub(crate) struct PagedRows<'a, T = f32> {
    pool: &'a [T],
    table: &'a [u32],
    block_size: usize,
    width: usize,
}

impl<'a, T> PagedRows<'a, T> {
    /// `pool` is the whole `[num_blocks, block_size, width]` pool; the table was checked by
    /// `kimi_ops::check_paged`.
    pub(crate) fn new(pool: &'a [T], seq: &PagedSeq<'a>, block_size: usize, width: usize) -> Self {
        Self {
            pool,
            table: seq.block_table,
            block_size,
            width,
        }
    }

    /// The rows of the sequence's tokens `0..count` in order, block by block (no division
    /// per row: attention reads every cached row once per head and step).
    pub(crate) fn first(&self, count: usize) -> impl Iterator<Item = &'a [T]> + use<'a, T> {
        let width = self.width;
        self.runs(count)
            .flat_map(move |(run, rows)| run.chunks_exact(width).take(rows))
    }

    /// The rows of the tokens `0..count` as runs of consecutive rows, one per cache block:
    /// `(the pool from the run's first row on, rows in the run)`, rows `width` apart.
    pub(crate) fn runs(&self, count: usize) -> impl Iterator<Item = (&'a [T], usize)> + use<'a, T> {
        let (pool, width, block_size) = (self.pool, self.width, self.block_size);
        self.table
            .iter()
            .zip((0..count).step_by(block_size.max(1)))
            .map(move |(&b, first)| {
                let start = b as usize * block_size * width;
                (
                    &pool[start..start + block_size * width],
                    block_size.min(count - first),
                )
            })
    }

    /// Values per row.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// The row of the sequence's token `i`.
    #[inline]
    pub(crate) fn row(&self, i: usize) -> &'a [T] {
        let start = row_offset(self.table, self.block_size, self.width, i);
        &self.pool[start..start + self.width]
    }
}

/// Writes `rows` (whole rows of `width`) at the sequence's positions `first ..`, each
/// value as `convert` stores it.
pub(crate) fn write_rows<T>(
    pool: &mut [T],
    seq: &PagedSeq<'_>,
    block_size: usize,
    width: usize,
    rows: &[f32],
    convert: impl Fn(f32) -> T,
) {
    for (j, src) in rows.chunks_exact(width.max(1)).enumerate() {
        let start = row_offset(seq.block_table, block_size, width, seq.num_cached + j);
        for (d, &v) in pool[start..start + width].iter_mut().zip(src) {
            *d = convert(v);
        }
    }
}

#[inline]
fn row_offset(table: &[u32], block_size: usize, width: usize, i: usize) -> usize {
    (table[i / block_size] as usize * block_size + i % block_size) * width
}
