//! Device buffers. Outside a recorded pass they come from the driver's stream-ordered pool;
//! inside one (see `graph.rs`) from the pass arena, so that the same pass gets the same
//! addresses every time and its CUDA graph can be replayed as captured.
//!
//! ```text
//!  arena: |<- block ->|<- block ->|<-- free (reused by size) -->|<-- never used -->|
//!         base                                                   top               base+cap
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::graph;

/// Arena blocks start on this boundary (the kernels' 16-byte vector loads, and more).
const ARENA_ALIGN: usize = 256;

/// A device buffer and who frees it.
pub(crate) struct DevBuf {
    ptr: u64,
    len: usize,
    home: Home,
}

enum Home {
    /// The stream-ordered pool; `None` once handed over on drop.
    Pool(Option<CudaSlice<u8>>),
    /// A block of the pass arena, returned to it on drop.
    Arena(Arc<Arena>),
}

impl DevBuf {
    pub(crate) fn from_pool(slice: CudaSlice<u8>) -> Self {
        // Event tracking is off (see `Device::new`), so the guard records nothing.
        let ptr = slice.device_ptr(slice.stream()).0;
        let len = slice.len();
        Self {
            ptr,
            len,
            home: Home::Pool(Some(slice)),
        }
    }

    /// The device address of the first byte.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Capacity in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        match &mut self.home {
            // A pool buffer dropped while a pass is being recorded may still be read by the
            // recorded (not yet queued) work: the recorder keeps it until that is queued.
            Home::Pool(slice) => {
                if let Some(s) = slice.take() {
                    graph::release_pool_buffer(s);
                }
            }
            Home::Arena(arena) => arena.release(self.ptr, self.len),
        }
    }
}

/// A fixed device region handed out in blocks during recorded passes. Blocks freed during
/// a pass are reused by later allocations of the same size in that pass (the recorded work
/// runs in order on one stream, so a reused block is never read after it is rewritten);
/// between passes the whole arena is reused once nothing from the last pass is alive.
pub(crate) struct Arena {
    base: u64,
    cap: usize,
    state: Mutex<ArenaState>,
    _mem: CudaSlice<u8>,
}

#[derive(Default)]
struct ArenaState {
    top: usize,
    free: HashMap<usize, Vec<u64>>,
    live: usize,
}

impl Arena {
    pub(crate) fn new(mem: CudaSlice<u8>) -> Self {
        let base = mem.device_ptr(mem.stream()).0;
        Self {
            base,
            cap: mem.len(),
            state: Mutex::new(ArenaState::default()),
            _mem: mem,
        }
    }

    /// Starts a pass: `false` (and no reset) while a block of an earlier pass is alive.
    pub(crate) fn reset(&self) -> bool {
        let Ok(mut s) = self.state.lock() else {
            return false;
        };
        if s.live != 0 {
            return false;
        }
        s.top = 0;
        s.free.clear();
        true
    }

    /// A block of at least `bytes`, or `None` when the arena is full.
    pub(crate) fn take(self: &Arc<Self>, bytes: usize) -> Option<DevBuf> {
        let len = bytes.max(1).next_multiple_of(ARENA_ALIGN);
        let mut s = self.state.lock().ok()?;
        let ptr = match s.free.get_mut(&len).and_then(Vec::pop) {
            Some(p) => p,
            None if s.top + len <= self.cap => {
                let p = self.base + s.top as u64;
                s.top += len;
                p
            }
            None => return None,
        };
        s.live += 1;
        Some(DevBuf {
            ptr,
            len,
            home: Home::Arena(self.clone()),
        })
    }

    fn release(&self, ptr: u64, len: usize) {
        if let Ok(mut s) = self.state.lock() {
            s.live -= 1;
            s.free.entry(len).or_default().push(ptr);
        }
    }
}
