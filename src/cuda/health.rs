//! Completion polls that surface CUDA errors, and which rank a CUDA error belongs to.
//!
//! * [`event_state`] queries an event and tells *complete*, *pending* or *failed* apart
//!   (cudarc's `CudaEvent::is_complete` answers `false` to all but the first, so a loop on it
//!   spins until its deadline after a sticky fault). [`poll_until`] is the one polling loop
//!   of every wait on the GPU (device copies, NCCL groups, dropping a communicator): it ends
//!   at the first error, at completion, when the group has failed, or at the deadline.
//! * **Attribution.** Ranks that are threads of one process share one CUDA context per GPU,
//!   and a context keeps one sticky error: after a fault every rank's next call fails with
//!   the same code, and cudarc's deferred error slot is emptied by whichever rank reads it
//!   first. [`attribute`] names the rank whose thread observed the error ([`as_rank`] marks
//!   a rank's thread) and records the first failure of each context, so that every later
//!   error of that context says where it was first seen.

use std::cell::Cell;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, DriverError};

use super::probe::{driver_error, unwind};
use crate::{Error, Result};

thread_local! {
    static RANK: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `f` with this thread marked as rank `rank` (errors observed inside name it).
pub(crate) fn as_rank<T>(rank: usize, f: impl FnOnce() -> T) -> T {
    let before = RANK.with(|r| r.replace(Some(rank)));
    let out = f();
    RANK.with(|r| r.set(before));
    out
}

/// The rank this thread works for, if marked.
pub(crate) fn current_rank() -> Option<usize> {
    RANK.with(Cell::get)
}

/// First failure seen per context (keyed by the `CUcontext` address).
static FIRST_FAILURE: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

/// Turns a CUDA error observed during `op` into [`Error::Cuda`] naming this thread's rank;
/// the first failure of `ctx` is recorded, and later ones say where it was first seen.
pub(crate) fn attribute(ctx: &CudaContext, op: &str, error: &str) -> Error {
    attribute_key(ctx.cu_ctx() as usize, op, error)
}

fn attribute_key(key: usize, op: &str, error: &str) -> Error {
    let who = match current_rank() {
        Some(r) => format!("rank {r}: {op}"),
        None => op.to_string(),
    };
    let here = format!("{who}: {error}");
    let mut first = FIRST_FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    match first.iter().find(|(k, _)| *k == key) {
        Some((_, f)) if *f != here => Error::Cuda(format!(
            "{here} (this GPU's context had already failed, first seen as \"{f}\"; ranks that share a context see \
             each other's errors)"
        )),
        Some(_) => Error::Cuda(here),
        None => {
            first.push((key, here.clone()));
            Error::Cuda(here)
        }
    }
}

/// Where an asynchronous piece of GPU work stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Finished without error.
    Complete,
    /// Still queued or running.
    Pending,
}

/// Queries `event` (`cuEventQuery`): complete, pending, or the error of the work before it
/// (attributed as [`attribute`] does, naming `op`). The calling thread must have the
/// event's context bound.
pub(crate) fn event_state(event: &CudaEvent, op: &str) -> Result<Progress> {
    // SAFETY: the event is alive (borrowed) and belongs to a live context.
    let q = unwind("cuEventQuery", || unsafe { result::event::query(event.cu_event()) })?;
    classify(q).map_err(|e| attribute(event.context(), op, &format!("the device reported {}", driver_error(e))))
}

fn classify(q: std::result::Result<(), DriverError>) -> std::result::Result<Progress, DriverError> {
    match q {
        Ok(()) => Ok(Progress::Complete),
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(Progress::Pending),
        Err(e) => Err(e),
    }
}

/// Polls `poll` until it reports completion: spins briefly, then sleeps in short steps.
/// Ends early with `poll`'s error, or with `failed()`'s (the group failed elsewhere), and
/// with [`Error::Timeout`] naming `op` and `peer` once `deadline` has passed.
pub(crate) fn poll_until(
    op: &str,
    peer: usize,
    deadline: Duration,
    mut poll: impl FnMut() -> Result<Progress>,
    failed: impl Fn() -> Option<Error>,
) -> Result<()> {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        if let Some(e) = failed() {
            return Err(e);
        }
        if poll()? == Progress::Complete {
            return Ok(());
        }
        if start.elapsed() >= deadline {
            return Err(Error::Timeout { op: op.to_string(), peer, after: deadline });
        }
        polls += 1;
        if polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn sticky() -> DriverError {
        DriverError(sys::cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS)
    }

    #[test]
    fn queries_tell_complete_pending_and_failed_apart() {
        assert_eq!(classify(Ok(())).unwrap(), Progress::Complete);
        let pending = classify(Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_READY))).unwrap();
        assert_eq!(pending, Progress::Pending);
        assert_eq!(classify(Err(sticky())).unwrap_err().0, sticky().0);
    }

    /// The wait of an NCCL receive (and of a device copy, and of a communicator's drop) on a
    /// group whose event fails with a sticky error after a few polls: it ends with that
    /// error at once, not when the 60 s deadline expires (a poll that took errors for
    /// "not complete", like `CudaEvent::is_complete`, spun the whole deadline).
    #[test]
    fn a_sticky_error_ends_the_wait_within_seconds() {
        let polls = AtomicUsize::new(0);
        let start = Instant::now();
        let r = poll_until(
            "NCCL recv (ring K/V)",
            3,
            Duration::from_secs(60),
            || match polls.fetch_add(1, Ordering::Relaxed) {
                0..=999 => Ok(Progress::Pending),
                _ => Err(attribute_key(0xdead, "NCCL recv (ring K/V) from rank 3", "CUDA_ERROR_ILLEGAL_ADDRESS")),
            },
            || None,
        );
        let e = r.unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        assert!(e.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && e.contains("from rank 3"), "{e}");
        // A group failed elsewhere (the watchdog, a peer's abort) ends it too.
        let r =
            poll_until("x", 0, Duration::from_secs(60), || Ok(Progress::Pending), || Some(Error::Cuda("gone".into())));
        assert_eq!(r.unwrap_err().to_string(), Error::Cuda("gone".into()).to_string());
        // Without an error, the deadline.
        let t = Instant::now();
        let r = poll_until("recv", 1, Duration::from_millis(50), || Ok(Progress::Pending), || None);
        assert!(matches!(r, Err(Error::Timeout { peer: 1, .. })) && t.elapsed() < Duration::from_secs(5));
        assert!(poll_until("x", 0, Duration::ZERO, || Ok(Progress::Complete), || None).is_ok());
    }

    #[test]
    fn errors_name_the_rank_and_where_the_context_first_failed() {
        let key = 0xbeef;
        let first =
            std::thread::spawn(move || as_rank(2, || attribute_key(key, "forward step", "CUDA_ERROR_LAUNCH_FAILED")))
                .join()
                .unwrap()
                .to_string();
        assert!(first.contains("rank 2: forward step: CUDA_ERROR_LAUNCH_FAILED"), "{first}");
        assert!(!first.contains("already failed"), "{first}");
        let later = as_rank(0, || attribute_key(key, "recv (device copy)", "CUDA_ERROR_LAUNCH_FAILED")).to_string();
        assert!(later.contains("rank 0: recv (device copy): CUDA_ERROR_LAUNCH_FAILED"), "{later}");
        assert!(later.contains("first seen as \"rank 2: forward step"), "{later}");
        assert_eq!(current_rank(), None, "the mark is undone");
    }
}
