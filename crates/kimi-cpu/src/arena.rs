//! Weight buffers packed into a few large mappings in transparent huge pages.
//!
//! Decode streams every weight once per token. With 4 KiB pages the TLB misses on every
//! page and the hardware prefetchers stop at every page boundary. The kernel (THP in
//! `madvise` mode, as on this project's machines) serves 2 MiB pages only to whole, aligned
//! 2 MiB ranges that ask for them, so a tensor allocated on its own gets none unless it is
//! several MiB long, and most tensors of a small model are not. Weights are therefore
//! carved, 64-byte aligned, out of shared 2 MiB-aligned anonymous mappings advised with
//! `MADV_HUGEPAGE`. Where no mapping can be made a buffer is a plain `Vec`.
//!
//! Space is handed out by a bump pointer and never reused: a mapping is returned to the
//! kernel when the last buffer carved from it is dropped (a model's weights die together).
//! Only weights come from here; buffers that are allocated again and again (key/value
//! pools, activations) stay on the heap.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// Element types a mapping may hold: plain values whose all-zero bytes are a valid zero.
/// (Public but unnameable outside the crate: a sealed bound of public impls.)
pub trait Plain: Copy + Default + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for f32 {}

/// A fixed-length buffer of weights: in a huge-page mapping where one could be had, else
/// on the heap. Derefs to a slice; a clone is a deep copy.
pub struct WeightBuf<T>(Repr<T>);

enum Repr<T> {
    Heap(Vec<T>),
    #[cfg(target_os = "linux")]
    Mapped {
        ptr: std::ptr::NonNull<T>,
        len: usize,
        // Keeps the mapping alive; no other buffer covers `ptr..ptr + len`.
        map: std::sync::Arc<map::Mapping>,
    },
}

// SAFETY: a mapped buffer owns its values exclusively, as a `Vec` does (its range is carved
// once and never handed out again; the shared `Mapping` is only kept alive, never read).
unsafe impl<T: Send> Send for WeightBuf<T> {}
// SAFETY: as for `Send`: shared access goes only through `&[T]`.
unsafe impl<T: Sync> Sync for WeightBuf<T> {}

/// `len` zeros on the heap, or `None` where the allocator refuses: cache pools are sized
/// by flags, and a size too large must be an error, not an aborted process.
pub(crate) fn try_zeroed_vec<T: Plain>(len: usize) -> Option<Vec<T>> {
    if len == 0 || std::mem::size_of::<T>() == 0 {
        return Some(vec![T::default(); len]);
    }
    let layout = std::alloc::Layout::array::<T>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (`len > 0` and `T` is not zero-sized).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `len` `T`s, the one a
    // `Vec<T>` of capacity `len` frees with, and its `len` values are zero bytes, which are
    // a valid zero `T` (`Plain`).
    Some(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

impl<T: Plain> WeightBuf<T> {
    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self::try_zeroed(len).unwrap_or_else(|| Self(Repr::Heap(vec![T::default(); len])))
    }

    /// `len` zeros, or `None` where neither a mapping nor the heap can hold them.
    pub(crate) fn try_zeroed(len: usize) -> Option<Self> {
        #[cfg(target_os = "linux")]
        if let Some((ptr, map)) = map::carve(len.saturating_mul(std::mem::size_of::<T>())) {
            // Anonymous mappings are zero-filled, and zero bytes are a zero `T` (`Plain`).
            return Some(Self(Repr::Mapped {
                ptr: ptr.cast(),
                len,
                map,
            }));
        }
        try_zeroed_vec(len).map(|v| Self(Repr::Heap(v)))
    }

    /// `len` values taken from `values` (zeros after it ends).
    pub(crate) fn from_values(len: usize, values: impl Iterator<Item = T>) -> Self {
        let mut buf = Self::zeroed(len);
        for (dst, v) in buf.iter_mut().zip(values) {
            *dst = v;
        }
        buf
    }
}

impl<T: Plain> WeightBuf<T> {
    /// `values` (exactly `len` of them expected; zeros after they end) in `file` where one
    /// is given, else as [`Self::from_values`].
    pub(crate) fn try_from_values_in(
        len: usize,
        values: impl Iterator<Item = T>,
        file: Option<&crate::weight_file::WeightFile>,
    ) -> kimi_ops::Result<Self> {
        let Some(file) = file else {
            return Ok(Self::from_values(len, values));
        };
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            kimi_ops::Error::out_of_memory("a weight in the offload folder", None, 1)
        })?;
        #[cfg(target_os = "linux")]
        let mut buf = Self(file.carve(bytes)?.into_repr(len));
        #[cfg(not(target_os = "linux"))]
        let mut buf: Self = match file.carve(bytes)? {};
        for (dst, v) in buf.iter_mut().zip(values) {
            *dst = v;
        }
        Ok(buf)
    }
}

impl<T> WeightBuf<T> {
    /// True where the values lie in a huge-page mapping.
    pub(crate) fn is_mapped(&self) -> bool {
        !matches!(self.0, Repr::Heap(_))
    }

    /// The whole anonymous mapping this buffer was carved from, as `(start, len)`: memory a
    /// device backend may page-lock as one region so that copies out of any buffer in it
    /// run by DMA. `None` for heap buffers (their pages are shared with unrelated data) and
    /// for file mappings (locking them would read the whole file into RAM).
    pub(crate) fn lockable_region(&self) -> Option<(usize, usize)> {
        match &self.0 {
            Repr::Heap(_) => None,
            #[cfg(target_os = "linux")]
            Repr::Mapped { map, .. } => {
                (!map.is_file()).then(|| (map.ptr().as_ptr() as usize, map.len()))
            }
        }
    }
}

impl<T> From<Vec<T>> for WeightBuf<T> {
    fn from(v: Vec<T>) -> Self {
        Self(Repr::Heap(v))
    }
}

impl<T> FromIterator<T> for WeightBuf<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self(Repr::Heap(iter.into_iter().collect()))
    }
}

impl<T> Deref for WeightBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Heap(v) => v,
            // SAFETY: `ptr` points at `len` initialized values owned by this buffer, kept
            // mapped by `map`.
            #[cfg(target_os = "linux")]
            Repr::Mapped { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
        }
    }
}

impl<T> DerefMut for WeightBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Repr::Heap(v) => v,
            // SAFETY: as in `deref`, and `&mut self` makes this the only access.
            #[cfg(target_os = "linux")]
            Repr::Mapped { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
        }
    }
}

impl<T: Plain> Clone for WeightBuf<T> {
    fn clone(&self) -> Self {
        Self::from_values(self.len(), self.iter().copied())
    }
}

impl<T> fmt::Debug for WeightBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightBuf")
            .field("len", &self.len())
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

/// A range carved out of a mapping for one buffer: its start and the mapping it keeps alive.
#[cfg(target_os = "linux")]
pub(crate) struct Carved {
    pub(crate) ptr: std::ptr::NonNull<u8>,
    pub(crate) map: std::sync::Arc<map::Mapping>,
}

#[cfg(target_os = "linux")]
impl Carved {
    /// The buffer of `len` `T`s at the range's start (the carver made it large enough and
    /// `ALIGN`-aligned, and no other buffer covers it).
    fn into_repr<T>(self, len: usize) -> Repr<T> {
        Repr::Mapped {
            ptr: self.ptr.cast(),
            len,
            map: self.map,
        }
    }
}

#[cfg(target_os = "linux")]
pub(crate) use map::{Mapping, ALIGN};

#[cfg(target_os = "linux")]
mod map {
    use std::ptr::NonNull;
    use std::sync::{Arc, Mutex, PoisonError, Weak};

    /// A huge page: mappings start on one and are whole numbers of them.
    pub(super) const HUGE: usize = 2 << 20;
    /// Alignment of every buffer inside a mapping (a cache line, and AVX-512 loads).
    pub(crate) const ALIGN: usize = 64;
    /// Size of a shared mapping. Pages never touched cost nothing, so a half-used last one
    /// wastes at most the rest of one huge page of memory.
    pub(super) const CHUNK: usize = 32 * HUGE;

    /// An anonymous read-write mapping, unmapped on drop.
    pub(crate) struct Mapping {
        ptr: NonNull<u8>,
        len: usize,
        /// A shared mapping of a file (the disk tier), not anonymous memory.
        file: bool,
    }

    // SAFETY: only an address range; the buffers carved from it do the reading and writing.
    unsafe impl Send for Mapping {}
    // SAFETY: as for `Send`.
    unsafe impl Sync for Mapping {}

    impl Mapping {
        /// `len` bytes (a multiple of `HUGE`) starting on a huge page, advised to be served
        /// in huge pages. `None` where the kernel refuses the mapping.
        fn new(len: usize) -> Option<Self> {
            // Over-map by one huge page, then unmap the unaligned head and the tail.
            let span = len.checked_add(HUGE)?;
            // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    span,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return None;
            }
            let head = (base as usize).next_multiple_of(HUGE) - base as usize;
            let start = base.cast::<u8>().wrapping_add(head);
            // SAFETY: both ranges lie inside the mapping just made and outside `start..+len`.
            // Failure leaves them mapped (only address space), so the results are ignored.
            unsafe {
                if head > 0 {
                    libc::munmap(base, head);
                }
                libc::munmap(start.add(len).cast(), HUGE - head);
                // Only a hint: where it fails (no THP in the kernel) the memory is still
                // ordinary memory, no worse than the heap's.
                libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
            }
            Some(Self {
                ptr: NonNull::new(start)?,
                len,
                file: false,
            })
        }
    }

    impl Mapping {
        /// The first `len` bytes of the file `fd`, mapped shared and read-write: stores go to
        /// the file (through the page cache), and the kernel may drop clean pages and read
        /// them back. The caller keeps `fd` only as long as it likes; the mapping keeps the
        /// file alive.
        pub(crate) fn shared_file(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> Option<Self> {
            use std::os::fd::AsRawFd;
            // SAFETY: a fresh shared mapping of a file this process opened read-write; no
            // existing memory is affected.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return None;
            }
            Some(Self {
                ptr: NonNull::new(base.cast())?,
                len,
                file: true,
            })
        }

        /// Whether this maps a file (see [`Mapping::shared_file`]).
        pub(crate) fn is_file(&self) -> bool {
            self.file
        }

        /// Start of the mapping.
        pub(crate) fn ptr(&self) -> NonNull<u8> {
            self.ptr
        }

        /// Length in bytes.
        pub(crate) fn len(&self) -> usize {
            self.len
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the range was mapped by `new` and no buffer into it remains (each
            // holds an `Arc` of this mapping).
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            }
        }
    }

    /// The shared mapping being filled and how many of its bytes are taken. Weak, so that
    /// the mapping goes when the buffers carved from it do.
    struct Cursor {
        map: Weak<Mapping>,
        used: usize,
    }

    static CURSOR: Mutex<Cursor> = Mutex::new(Cursor {
        map: Weak::new(),
        used: 0,
    });

    /// `bytes` bytes, `ALIGN`-aligned and zero, in a huge-page mapping; `None` for an empty
    /// buffer or where no mapping can be made.
    pub(super) fn carve(bytes: usize) -> Option<(NonNull<u8>, Arc<Mapping>)> {
        if bytes == 0 {
            return None;
        }
        let mut cur = CURSOR.lock().unwrap_or_else(PoisonError::into_inner);
        let at = cur.used.next_multiple_of(ALIGN);
        if let Some(map) = cur.map.upgrade() {
            if at.checked_add(bytes).is_some_and(|end| end <= map.len) {
                cur.used = at + bytes;
                // SAFETY: `at + bytes <= map.len`, so the pointer stays inside the mapping.
                let ptr = unsafe { map.ptr.add(at) };
                return Some((ptr, map));
            }
        }
        let size = bytes.checked_next_multiple_of(HUGE)?;
        if size > CHUNK {
            // A tensor larger than a chunk gets a mapping of its own; the open chunk stays
            // open for the smaller ones.
            let map = Arc::new(Mapping::new(size)?);
            return Some((map.ptr, map));
        }
        let map = Arc::new(Mapping::new(CHUNK)?);
        *cur = Cursor {
            map: Arc::downgrade(&map),
            used: bytes,
        };
        Some((map.ptr, map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_disjoint_and_keep_their_values() {
        let lens = [1usize, 63, 64, 1000, 4097, 3 << 20, 100];
        let bufs: Vec<WeightBuf<u16>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| WeightBuf::from_values(n, (0..n).map(|j| (i * 31 + j) as u16)))
            .collect();
        for (i, (b, &n)) in bufs.iter().zip(&lens).enumerate() {
            assert_eq!(b.len(), n);
            assert!(b.iter().enumerate().all(|(j, &v)| v == (i * 31 + j) as u16));
            #[cfg(target_os = "linux")]
            {
                assert!(b.is_mapped());
                assert_eq!(b.as_ptr() as usize % 64, 0);
            }
        }
        // No two ranges overlap.
        let mut spans: Vec<(usize, usize)> = bufs
            .iter()
            .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + 2 * b.len()))
            .collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
        let copy = bufs[3].clone();
        assert_eq!(&copy[..], &bufs[3][..]);
        assert_ne!(copy.as_ptr(), bufs[3].as_ptr());
    }

    #[test]
    fn a_buffer_larger_than_a_chunk_gets_its_own_huge_page_aligned_mapping() {
        #[cfg(target_os = "linux")]
        {
            let n = map::CHUNK + 5;
            let mut b = WeightBuf::<u8>::zeroed(n);
            assert!(b.is_mapped());
            assert_eq!(b.as_ptr() as usize % map::HUGE, 0);
            assert!(b.iter().all(|&v| v == 0));
            b[n - 1] = 7;
            assert_eq!(b[n - 1], 7);
        }
    }

    #[test]
    fn empty_buffers_and_vecs_stay_on_the_heap() {
        let e = WeightBuf::<f32>::zeroed(0);
        assert!(e.is_empty() && !e.is_mapped());
        let v: WeightBuf<u8> = vec![1, 2, 3].into();
        assert!(!v.is_mapped());
        assert_eq!(&v[..], &[1, 2, 3]);
    }
}
