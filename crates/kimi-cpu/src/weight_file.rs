//! Weights kept in files on disk instead of anonymous memory: the disk tier of offloaded
//! experts (`--offload-folder`).
//!
//! Buffers are carved, 64-byte aligned, out of unnamed files in one directory (`O_TMPFILE`:
//! nothing is left behind when the process ends, however it ends), each mapped shared and
//! read-write. Loading writes a weight once through its mapping; afterwards the kernel's page
//! cache keeps what fits in RAM and reads the rest back from the file when a kernel touches
//! it, as llama.cpp's memory-mapped models do. Every file's blocks are reserved up front
//! (`posix_fallocate`), so a full disk is an error at load naming the directory, never a
//! `SIGBUS` when a dirty page is written back later.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(target_os = "linux")]
use std::sync::{Arc, Mutex, PoisonError, Weak};

use kimi_ops::{Error, Result};

/// Bytes of one file: buffers are carved from it until it is full. Larger buffers get a
/// file of their own.
#[cfg(target_os = "linux")]
const FILE_CHUNK: usize = 256 << 20;

/// A directory whose unnamed files hold weights.
pub struct WeightFile {
    dir: PathBuf,
    bytes: AtomicU64,
    #[cfg(target_os = "linux")]
    cursor: Mutex<Cursor>,
}

/// The file being filled and how many of its bytes are taken (weak: the file goes when the
/// buffers carved from it do).
#[cfg(target_os = "linux")]
struct Cursor {
    map: Weak<crate::arena::Mapping>,
    used: usize,
}

impl WeightFile {
    /// Weights in unnamed files under `dir`, which must be a writable directory on a
    /// filesystem that supports them (ext4, xfs, btrfs, tmpfs). The error names `dir`.
    pub fn new(dir: &Path) -> std::result::Result<Self, String> {
        let file = Self {
            dir: dir.to_path_buf(),
            bytes: AtomicU64::new(0),
            #[cfg(target_os = "linux")]
            cursor: Mutex::new(Cursor {
                map: Weak::new(),
                used: 0,
            }),
        };
        // Fail now, naming the directory, rather than at the first weight.
        #[cfg(target_os = "linux")]
        drop(file.open_unnamed(0)?);
        #[cfg(not(target_os = "linux"))]
        return Err(format!(
            "the offload folder {}: not supported on this operating system",
            file.dir.display()
        ));
        #[cfg(target_os = "linux")]
        Ok(file)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of weights carved so far (alignment excluded).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// An unnamed file of `len` bytes, its blocks reserved; the error says why not, naming
    /// the folder.
    #[cfg(target_os = "linux")]
    fn open_unnamed(&self, len: usize) -> std::result::Result<std::fs::File, String> {
        use std::ffi::CString;
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;

        let where_ = || format!("the offload folder {}", self.dir.display());
        let path = CString::new(self.dir.as_os_str().as_bytes())
            .map_err(|_| format!("{}: the path holds a NUL byte", where_()))?;
        // SAFETY: `path` is a NUL-terminated string that outlives the call; the returned
        // descriptor, if any, is owned by the `File` made from it below.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!("{}: cannot create a file there: {e}", where_()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        if len > 0 {
            let size = libc::off_t::try_from(len)
                .map_err(|_| format!("{}: a file of {len} bytes", where_()))?;
            // SAFETY: `file` is open read-write; the call only allocates its blocks.
            let rc =
                unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, size) };
            if rc != 0 {
                let e = std::io::Error::from_raw_os_error(rc);
                let free = free_bytes(&self.dir)
                    .map(|b| format!(" ({:.2} GiB free)", b as f64 / (1u64 << 30) as f64))
                    .unwrap_or_default();
                return Err(format!(
                    "{}: cannot reserve {:.2} GiB more for offloaded weights{free}: {e}",
                    where_(),
                    len as f64 / (1u64 << 30) as f64
                ));
            }
        }
        Ok(file)
    }

    /// `bytes` bytes (more than zero), `ALIGN`-aligned, in a file of this directory.
    #[cfg(target_os = "linux")]
    pub(crate) fn carve(&self, bytes: usize) -> Result<crate::arena::Carved> {
        use crate::arena::{Carved, Mapping, ALIGN};
        use std::os::fd::AsFd;

        let map_file = |len: usize| -> Result<Arc<Mapping>> {
            let file = self.open_unnamed(len).map_err(Error::Device)?;
            Mapping::shared_file(file.as_fd(), len)
                .map(Arc::new)
                .ok_or_else(|| {
                    Error::Device(format!(
                        "the offload folder {}: cannot map a file of {len} bytes: {}",
                        self.dir.display(),
                        std::io::Error::last_os_error()
                    ))
                })
        };
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let mut cur = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        let at = cur.used.next_multiple_of(ALIGN);
        if let Some(map) = cur.map.upgrade() {
            if at.checked_add(bytes).is_some_and(|end| end <= map.len()) {
                cur.used = at + bytes;
                // SAFETY: `at + bytes <= map.len()`, so the pointer stays inside the mapping.
                let ptr = unsafe { map.ptr().add(at) };
                return Ok(Carved { ptr, map });
            }
        }
        if bytes > FILE_CHUNK {
            let map = map_file(bytes)?;
            return Ok(Carved {
                ptr: map.ptr(),
                map,
            });
        }
        let map = map_file(FILE_CHUNK)?;
        *cur = Cursor {
            map: Arc::downgrade(&map),
            used: bytes,
        };
        Ok(Carved {
            ptr: map.ptr(),
            map,
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn carve(&self, _bytes: usize) -> Result<std::convert::Infallible> {
        Err(Error::Unsupported("an offload folder".into()))
    }
}

impl fmt::Debug for WeightFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightFile")
            .field("dir", &self.dir)
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// Bytes free for an unprivileged user on the filesystem of `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: `statvfs` is plain old data; zeroed is a valid value to be overwritten.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is a valid out-pointer for the call.
        if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
            return None;
        }
        #[allow(clippy::unnecessary_cast)] // the field types differ between targets
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::WeightBuf;

    #[test]
    fn buffers_in_files_keep_their_values_and_leave_no_file_behind() {
        let dir = std::env::temp_dir().join(format!("kimi-weight-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = WeightFile::new(&dir).unwrap();
        let lens = [1usize, 63, 1000, 3 << 20, FILE_CHUNK / 2 + 1, 7];
        let bufs: Vec<WeightBuf<u16>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                WeightBuf::try_from_values_in(n, (0..n).map(|j| (i * 31 + j) as u16), Some(&file))
                    .unwrap()
            })
            .collect();
        for (i, (b, &n)) in bufs.iter().zip(&lens).enumerate() {
            assert_eq!(b.len(), n);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert!(b.iter().enumerate().all(|(j, &v)| v == (i * 31 + j) as u16));
        }
        let mut spans: Vec<(usize, usize)> = bufs
            .iter()
            .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + 2 * b.len()))
            .collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
        let total: usize = lens.iter().map(|n| 2 * n).sum();
        assert_eq!(file.bytes(), total as u64);
        // Larger than a file's chunk: a file of its own.
        let big =
            WeightBuf::<u8>::try_from_values_in(FILE_CHUNK + 5, std::iter::repeat(9), Some(&file))
                .unwrap();
        assert!(big.iter().all(|&v| v == 9));
        // Unnamed files: nothing to see in the directory.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        drop(bufs);
        drop(big);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_missing_folder_or_a_size_beyond_the_disk_is_an_error_naming_the_folder() {
        let missing = Path::new("/nonexistent/kimi-offload");
        let e = WeightFile::new(missing).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/kimi-offload"), "{e}");
        let file = WeightFile::new(&std::env::temp_dir()).unwrap();
        let e = match file.carve(1 << 62) {
            Ok(_) => panic!("4 EiB reserved"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(&std::env::temp_dir().display().to_string()) && e.contains("GiB"),
            "{e}"
        );
    }
}
