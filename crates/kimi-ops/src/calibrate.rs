//! Calibration taps: how a quantizer (`kimi-infer quantize --method gptq|awq`) learns what
//! each linear weight multiplies. While a tap is installed on a thread ([`with_tap`]), the
//! model's loader names every weight it uploads ([`InputTap::weight`]) and a backend that
//! supports taps (the CPU backend) shows the tap each activation matrix before it multiplies
//! a weight ([`InputTap::input`]), on the thread that runs the forward pass. Weights are
//! identified by the address of their stored bytes ([`weight_key`]). Without a tap nothing
//! is recorded and the cost is one thread-local read per product.

use std::cell::RefCell;
use std::sync::Arc;

use crate::HostTensor;

/// What a quantizer records.
pub trait InputTap: Send + Sync {
    /// A weight was uploaded: `key` identifies its storage; `parts` are the checkpoint
    /// tensors stacked by rows in it (full stored names and their rows), in order.
    fn weight(&self, key: usize, parts: &[(String, usize)]);
    /// `x` (`n` rows of `k` values, row-major) is about to multiply the weight `key`.
    fn input(&self, key: usize, x: &[f32], n: usize, k: usize);
}

thread_local! {
    static TAP: RefCell<Option<Arc<dyn InputTap>>> = const { RefCell::new(None) };
}

/// Runs `f` with `tap` installed on this thread (restoring the previous one after).
pub fn with_tap<R>(tap: Arc<dyn InputTap>, f: impl FnOnce() -> R) -> R {
    let previous = TAP.with(|t| t.borrow_mut().replace(tap));
    struct Restore(Option<Arc<dyn InputTap>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            TAP.with(|t| *t.borrow_mut() = previous);
        }
    }
    let _restore = Restore(previous);
    f()
}

/// The tap installed on this thread, if any.
pub fn tap() -> Option<Arc<dyn InputTap>> {
    TAP.with(|t| t.borrow().clone())
}

/// The key of a weight whose stored bytes a host backend shows.
pub fn weight_key(stored: &HostTensor<'_>) -> usize {
    stored.bytes.as_ptr() as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Log(Mutex<Vec<usize>>);
    impl InputTap for Log {
        fn weight(&self, key: usize, _: &[(String, usize)]) {
            self.0.lock().unwrap().push(key);
        }
        fn input(&self, key: usize, _: &[f32], _: usize, _: usize) {
            self.0.lock().unwrap().push(key + 1000);
        }
    }

    #[test]
    fn a_tap_is_seen_inside_and_gone_after() {
        let log = Arc::new(Log::default());
        assert!(tap().is_none());
        with_tap(log.clone(), || {
            let t = tap().expect("installed");
            t.weight(1, &[]);
            t.input(1, &[], 0, 0);
        });
        assert!(tap().is_none());
        assert_eq!(*log.0.lock().unwrap(), vec![1, 1001]);
    }
}
