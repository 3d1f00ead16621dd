//! Rows of a paged cache pool `[num_blocks, block_size, width]` (see `kimi_ops::PagedSeq`).

use kimi_ops::PagedSeq;

/// One sequence's rows of a pool, read through its block table.
#[derive(Clone, Copy)]
pub(crate) struct PagedRows<'a> {
    pool: &'a [f32],
    table: &'a [u32],
    block_size: usize,
    width: usize,
}

impl<'a> PagedRows<'a> {
    /// `pool` is the whole `[num_blocks, block_size, width]` pool; the table was checked by
    /// `kimi_ops::check_paged`.
    pub(crate) fn new(
        pool: &'a [f32],
        seq: &PagedSeq<'a>,
        block_size: usize,
        width: usize,
    ) -> Self {
        Self {
            pool,
            table: seq.block_table,
            block_size,
            width,
        }
    }

    /// The row of the sequence's token `i`.
    #[inline]
    pub(crate) fn row(&self, i: usize) -> &'a [f32] {
        let start = row_offset(self.table, self.block_size, self.width, i);
        &self.pool[start..start + self.width]
    }
}

/// Writes `rows` (whole rows of `width`) at the sequence's positions `first ..`.
pub(crate) fn write_rows(
    pool: &mut [f32],
    seq: &PagedSeq<'_>,
    block_size: usize,
    width: usize,
    rows: &[f32],
) {
    for (j, src) in rows.chunks_exact(width.max(1)).enumerate() {
        let start = row_offset(seq.block_table, block_size, width, seq.num_cached + j);
        pool[start..start + width].copy_from_slice(src);
    }
}

#[inline]
fn row_offset(table: &[u32], block_size: usize, width: usize, i: usize) -> usize {
    (table[i / block_size] as usize * block_size + i % block_size) * width
}
