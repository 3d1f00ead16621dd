//! Host memory page-locked for DMA: the regions an expert host store lends to device
//! slots, locked once per process however many banks and GPUs copy from them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use kimi_ops::Result;

use crate::error::OpContext;

/// Host regions page-locked in this process, by start address: `(length, holders)`. Locks
/// are portable (every context sees them), so backends on several GPUs share one.
static HOST_LOCKS: Mutex<Option<HashMap<usize, (usize, usize)>>> = Mutex::new(None);

/// Keeps a host region page-locked; the last holder unlocks it.
struct HostLock {
    ctx: Arc<CudaContext>,
    start: usize,
    /// What keeps the region mapped; dropped after the unlock.
    _owner: Arc<dyn Send + Sync>,
}

/// Page-locks `region` for DMA (`cuMemHostRegister`, portable), or shares the lock already
/// held on exactly that region; the lock keeps `owner` (which keeps the region mapped and
/// unwritten) alive. `None` (with a warning naming the region) where the driver refuses:
/// copies then stage through pageable memory.
pub(crate) fn lock_host(
    ctx: &Arc<CudaContext>,
    region: kimi_ops::HostRegion,
    owner: Arc<dyn Send + Sync>,
) -> Result<Option<kimi_ops::LockedRegion>> {
    use cudarc::driver::sys;
    let kimi_ops::HostRegion { start, len } = region;
    let mut locks = HOST_LOCKS
        .lock()
        .map_err(|_| kimi_ops::Error::Device("the host lock table is poisoned".into()))?;
    let locks = locks.get_or_insert_with(HashMap::new);
    match locks.get_mut(&start) {
        Some((held, holders)) if *held == len => *holders += 1,
        Some((held, _)) => {
            tracing::warn!(
                "host memory at {start:#x} is page-locked as {held} bytes, not {len}: \
                 expert copies from it stage through pageable memory"
            );
            return Ok(None);
        }
        None => {
            ctx.bind_to_thread().op("lock host memory")?;
            // SAFETY: registration only pins pages (the driver refuses a range that is not
            // mapped); `owner` keeps the range mapped until this lock unregisters it.
            let rc = unsafe {
                sys::cuMemHostRegister_v2(
                    start as *mut std::ffi::c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if let Err(e) = rc.result() {
                tracing::warn!(
                    "could not page-lock {len} bytes of host memory at {start:#x} ({e}): \
                     expert copies from it stage through pageable memory"
                );
                return Ok(None);
            }
            locks.insert(start, (len, 1));
        }
    }
    Ok(Some(Box::new(HostLock {
        ctx: ctx.clone(),
        start,
        _owner: owner,
    })))
}

impl Drop for HostLock {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        let Ok(mut locks) = HOST_LOCKS.lock() else {
            return;
        };
        let Some(locks) = locks.as_mut() else {
            return;
        };
        let last = match locks.get_mut(&self.start) {
            Some((_, holders)) => {
                *holders -= 1;
                *holders == 0
            }
            None => false,
        };
        if last {
            locks.remove(&self.start);
            // Copies out of the region may still be queued: let them finish first.
            if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
                // SAFETY: the region was locked by `lock_host` and is still mapped (`_owner`
                // is dropped after this); no copy from it is pending.
                unsafe {
                    let _ = sys::cuMemHostUnregister(self.start as *mut std::ffi::c_void);
                }
            }
        }
    }
}
