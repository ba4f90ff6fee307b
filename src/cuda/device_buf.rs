//! [`DeviceBuf`]: f32 values in GPU memory as the communicators and the device backend move
//! and compute on them, and the event waits they share.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::probe::guard;
use crate::comm::Payload;
use crate::{Error, Result};

/// A buffer of f32 values in GPU memory: the [`Payload`] of the device communicators
/// ([`super::DeviceComm`], [`super::NcclComm`]) and the `Buf` of [`super::DeviceBackend`].
///
/// * **Shared storage**: an `Arc` of a cudarc [`CudaSlice<f32>`]; `clone` is cheap (no
///   device copy). Writes go through copy-on-write ([`DeviceBuf::make_mut`]): a buffer whose
///   storage is shared gets its own copy first, so a buffer handed to a send is never
///   modified under it.
/// * **Readiness**: an optional event recorded after the work that produced the contents
///   (a kernel, or the device-to-device copy of a send); a stream that uses the buffer waits
///   on it first ([`DeviceBuf::wait_on`]). cudarc's own per-allocation events order the
///   streams as well; the event here also lets a host thread wait for the contents
///   ([`DeviceBuf::wait_ready`]).
/// * **Length**: [`DeviceBuf::len`] elements; the allocation holds at least one (the driver
///   refuses empty allocations), so an empty buffer still owns a one-element slice.
///
/// ```no_run
/// use ringattn::cuda::{CudaDevice, DeviceBuf};
/// let dev = CudaDevice::new(0)?;
/// let buf = DeviceBuf::upload(dev.stream(), &[1.0, 2.0, 3.0])?;
/// let copy = buf.clone(); // shares the device memory
/// assert_eq!(copy.download(dev.stream())?, vec![1.0, 2.0, 3.0]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Clone)]
pub struct DeviceBuf {
    data: Arc<CudaSlice<f32>>,
    len: usize,
    ready: Option<Arc<CudaEvent>>,
}

impl fmt::Debug for DeviceBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuf")
            .field("len", &self.len)
            .field("capacity", &self.data.len())
            .field("shared", &(Arc::strong_count(&self.data) > 1))
            .field("ready_event", &self.ready.is_some())
            .finish()
    }
}

impl Payload for DeviceBuf {
    fn elements(&self) -> usize {
        self.len
    }

    fn elem(&self) -> crate::Elem {
        crate::Elem::F32
    }
}

impl DeviceBuf {
    /// A buffer of the first `len` elements of `slice`, ready once `ready` (when given) has
    /// completed.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `slice` holds fewer than `len` elements.
    pub fn from_slice(slice: CudaSlice<f32>, len: usize, ready: Option<CudaEvent>) -> Result<DeviceBuf> {
        if slice.len() < len {
            return Err(Error::ShapeMismatch(format!("a device buffer of {len} values in a slice of {}", slice.len())));
        }
        Ok(DeviceBuf { data: Arc::new(slice), len, ready: ready.map(Arc::new) })
    }

    /// A device copy of `host`, uploaded on `stream` (pageable memory: the call returns once
    /// the values have left `host`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation or copy fails (or there is no driver).
    pub fn upload(stream: &Arc<CudaStream>, host: &[f32]) -> Result<DeviceBuf> {
        let slice = super::buffers::upload(stream, host)?;
        DeviceBuf::from_slice(slice, host.len(), None)
    }

    /// `len` uninitialised values (at least one element allocated) on `stream`, for a kernel
    /// to write every one of them.
    pub(crate) fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<DeviceBuf> {
        // SAFETY: the caller writes the `len` values before anything reads them (stream
        // ordered); the extra element of an empty buffer is never read.
        let slice = guard("cuMemAlloc", || unsafe { stream.alloc::<f32>(len.max(1)) })?;
        DeviceBuf::from_slice(slice, len, None)
    }

    /// Number of f32 values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation (at least [`DeviceBuf::len`] elements; read only the first `len`).
    pub fn slice(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// The event after which the contents are ready, if the producer recorded one.
    pub fn ready_event(&self) -> Option<&Arc<CudaEvent>> {
        self.ready.as_ref()
    }

    /// Replaces the readiness event (a producer records it after enqueuing the writes).
    pub(crate) fn set_ready(&mut self, ready: Option<Arc<CudaEvent>>) {
        self.ready = ready;
    }

    /// Whether another `DeviceBuf` shares this storage.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.data) > 1
    }

    /// Makes `stream` wait (on the device, the host does not block) until the contents are
    /// ready.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver call fails.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        match &self.ready {
            Some(e) => guard("cuStreamWaitEvent", || stream.wait(e)),
            None => Ok(()),
        }
    }

    /// Blocks the calling thread until the contents are ready (the readiness event has
    /// completed), polling the event for at most `deadline`.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming `op` when the deadline passes; [`Error::Cuda`] when the
    /// device reports an error (a failed kernel or copy).
    pub fn wait_ready(&self, op: &str, peer: usize, deadline: Duration) -> Result<()> {
        match &self.ready {
            Some(e) => wait_event(e, op, peer, deadline),
            None => Ok(()),
        }
    }

    /// The values on the host (waits for them on `stream`, then copies synchronously).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the copy fails; errors of earlier kernels on the stream surface
    /// here.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        self.wait_on(stream)?;
        super::buffers::download(stream, &self.data, self.len)
    }

    /// The storage for writing on `stream`: first ordered after the producer's work; copied
    /// (device to device, on `stream`) when another buffer shares it, so that no other
    /// holder sees the write. The readiness event is cleared: later writes are ordered on
    /// `stream`, and other streams by cudarc's per-allocation events.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the wait, allocation or copy fails.
    pub fn make_mut(&mut self, stream: &Arc<CudaStream>) -> Result<&mut CudaSlice<f32>> {
        self.wait_on(stream)?;
        if Arc::get_mut(&mut self.data).is_none() {
            let src: &CudaSlice<f32> = &self.data;
            let copy = guard("copy-on-write (cuMemcpyDtoDAsync)", || {
                // SAFETY: every element is written by the copy below, stream ordered.
                let mut dst = unsafe { stream.alloc::<f32>(src.len()) }?;
                stream.memcpy_dtod(src, &mut dst)?;
                Ok(dst)
            })?;
            self.data = Arc::new(copy);
        }
        self.ready = None;
        Arc::get_mut(&mut self.data).ok_or_else(|| Error::Cuda("copy-on-write: the buffer is still shared".into()))
    }

    /// Device address of the values for reading on `stream` (ordered after their producer),
    /// with cudarc's guard that records the read when dropped.
    pub(crate) fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> Result<(u64, cudarc::driver::SyncOnDrop<'a>)> {
        self.wait_on(stream)?;
        Ok(self.data.device_ptr(stream))
    }
}

/// Device address of `slice` for writing on `stream`, with cudarc's guard.
pub(crate) fn write_ptr<'a, T>(
    slice: &'a mut CudaSlice<T>,
    stream: &'a CudaStream,
) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
    slice.device_ptr_mut(stream)
}

/// Polls `event` until it has completed: spins briefly, then sleeps in short steps, for at
/// most `deadline`.
///
/// # Errors
/// [`Error::Timeout`] (`op`, `peer`) on expiry; [`Error::Cuda`] when the query reports an
/// error of the work before the event.
pub(crate) fn wait_event(event: &CudaEvent, op: &str, peer: usize, deadline: Duration) -> Result<()> {
    // Queries from threads that have not used the context yet (watchdogs, drops).
    guard("binding the context", || event.context().bind_to_thread())?;
    super::health::poll_until(op, peer, deadline, || super::health::event_state(event, op), || None)
}
