//! Copies between host and device memory on the device's streams: slot fills in stream
//! order or ahead on a copy stream of their own, and read-backs.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use kimi_ops::Result;

use super::Device;
use crate::error::OpContext;

/// A copy stream for slot fills ahead of their layer ([`Device::copy_from_host_ahead`]) and
/// the two events that order it against the main stream.
pub(super) struct AheadCopies {
    stream: Arc<CudaStream>,
    /// Recorded on the main stream before each copy ahead, which waits for it: the work
    /// queued before (readers of the slot's old contents) comes first.
    queued: CudaEvent,
    /// Recorded on the copy stream by [`Device::await_ahead`], which the main stream waits
    /// for.
    copied: CudaEvent,
}

impl AheadCopies {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let no_timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(Self {
            stream: ctx.new_stream().op("init")?,
            queued: ctx.new_event(no_timing).op("init")?,
            copied: ctx.new_event(no_timing).op("init")?,
        })
    }
}

impl Device {
    /// Copies `bytes` to `dst` in stream order, after what the current pass has recorded so
    /// far (queued first) and before anything queued later. From page-locked memory
    /// ([`lock_host`](crate::host_lock::lock_host)) the copy runs by DMA and this returns
    /// before it is done; from pageable memory the driver has taken the bytes when this
    /// returns.
    ///
    /// # Safety
    /// `dst` points at `bytes.len()` bytes of live device memory; page-locked `bytes` stay
    /// mapped and unwritten until the stream has passed the copy.
    pub(crate) unsafe fn copy_from_host(
        &self,
        dst: u64,
        bytes: &[u8],
        op: &'static str,
    ) -> Result<()> {
        self.flush(op)?;
        self.enter(op)?;
        // SAFETY: the caller's contract.
        unsafe { self.copy_on(&self.stream, dst, bytes, op) }
    }

    /// [`Self::copy_from_host`] on the copy stream: after the work queued on the main stream
    /// so far, beside what is queued there next, until [`Self::await_ahead`].
    ///
    /// # Safety
    /// As [`Self::copy_from_host`]; besides, nothing queued on the main stream after this
    /// and before [`Self::await_ahead`] touches `dst`.
    pub(crate) unsafe fn copy_from_host_ahead(
        &self,
        dst: u64,
        bytes: &[u8],
        op: &'static str,
    ) -> Result<()> {
        let a = &self.ahead;
        self.flush(op)?;
        self.enter(op)?;
        a.queued.record(&self.stream).op(op)?;
        a.stream.wait(&a.queued).op(op)?;
        // SAFETY: the caller's contract.
        unsafe { self.copy_on(&a.stream, dst, bytes, op) }
    }

    /// The host-to-device copy of both, on `stream` (the caller has queued a recorded
    /// pass's ops and entered the device first).
    ///
    /// # Safety
    /// As [`Self::copy_from_host`], with `stream` this device's.
    unsafe fn copy_on(
        &self,
        stream: &CudaStream,
        dst: u64,
        bytes: &[u8],
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: the caller's contract; the context is current on this thread.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst,
                bytes.as_ptr().cast(),
                bytes.len(),
                stream.cu_stream(),
            )
        }
        .result()
        .op(op)
    }

    /// Work queued on the main stream after this waits for the copies ahead queued before.
    pub(crate) fn await_ahead(&self, op: &'static str) -> Result<()> {
        self.flush(op)?;
        self.enter(op)?;
        let a = &self.ahead;
        a.copied.record(&a.stream).op(op)?;
        self.stream.wait(&a.copied).op(op)
    }

    /// Copies `dst.len()` bytes from `src` to the host once all queued work is done
    /// (queuing a recorded pass's ops first).
    ///
    /// # Safety
    /// `src` points at `dst.len()` bytes of live device memory.
    pub(crate) unsafe fn read(&self, src: u64, dst: &mut [u8], op: &'static str) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.read_all(&mut [(src, dst)], op) }
    }

    /// [`Self::read`] of several regions with one wait.
    ///
    /// # Safety
    /// Each `src` points at its `dst.len()` bytes of live device memory.
    pub(crate) unsafe fn read_all(
        &self,
        parts: &mut [(u64, &mut [u8])],
        op: &'static str,
    ) -> Result<()> {
        self.flush(op)?;
        for (src, dst) in parts.iter_mut() {
            if dst.is_empty() {
                continue;
            }
            // SAFETY: the caller's contract; `dst` is writable for its length and the
            // synchronize below completes the copy before it is used.
            unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast(),
                    *src,
                    dst.len(),
                    self.stream.cu_stream(),
                )
            }
            .result()
            .op(op)?;
        }
        self.stream.synchronize().op(op)
    }
}
