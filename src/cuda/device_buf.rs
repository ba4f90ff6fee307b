//! [`DeviceBuf`]: typed values in GPU memory as the communicators and the device backend
//! move and compute on them, and the event waits they share.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::probe::guard;
use crate::comm::Payload;
use crate::kernels::params::device_capacity as capacity;
use crate::{Elem, Error, HostBuf, HostData, Result};

/// The device allocation behind a [`DeviceBuf`], typed by what the kernels read from it.
#[derive(Debug)]
enum Storage {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// The 16-bit patterns of bf16 or f16 values.
    Bits16(CudaSlice<u16>),
    /// Bytes (control data).
    U8(CudaSlice<u8>),
}

impl Storage {
    /// `len` uninitialised elements of `elem` (at least `device_capacity` of them).
    ///
    /// # Safety
    /// The caller writes every element it later reads.
    unsafe fn alloc(stream: &Arc<CudaStream>, elem: Elem, len: usize) -> Result<Storage> {
        let n = capacity(elem, len);
        guard("cuMemAlloc", || {
            // SAFETY: forwarded to the caller.
            Ok(match elem {
                Elem::F32 => Storage::F32(unsafe { stream.alloc::<f32>(n) }?),
                Elem::BF16 | Elem::F16 => Storage::Bits16(unsafe { stream.alloc::<u16>(n) }?),
                _ => Storage::U8(unsafe { stream.alloc::<u8>(n) }?),
            })
        })
    }

    fn elements(&self) -> usize {
        match self {
            Storage::F32(s) => s.len(),
            Storage::Bits16(s) => s.len(),
            Storage::U8(s) => s.len(),
        }
    }

    fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        match self {
            Storage::F32(s) => s.context(),
            Storage::Bits16(s) => s.context(),
            Storage::U8(s) => s.context(),
        }
    }

    fn ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        match self {
            Storage::F32(s) => s.device_ptr(stream),
            Storage::Bits16(s) => s.device_ptr(stream),
            Storage::U8(s) => s.device_ptr(stream),
        }
    }

    fn ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        match self {
            Storage::F32(s) => s.device_ptr_mut(stream),
            Storage::Bits16(s) => s.device_ptr_mut(stream),
            Storage::U8(s) => s.device_ptr_mut(stream),
        }
    }

    /// A copy of the whole allocation on `stream`.
    fn duplicate(&self, stream: &Arc<CudaStream>) -> Result<Storage> {
        guard("copy-on-write (cuMemcpyDtoDAsync)", || {
            // SAFETY (each arm): every element is written by the copy, stream ordered.
            Ok(match self {
                Storage::F32(s) => {
                    let mut d = unsafe { stream.alloc::<f32>(s.len()) }?;
                    stream.memcpy_dtod(s, &mut d)?;
                    Storage::F32(d)
                }
                Storage::Bits16(s) => {
                    let mut d = unsafe { stream.alloc::<u16>(s.len()) }?;
                    stream.memcpy_dtod(s, &mut d)?;
                    Storage::Bits16(d)
                }
                Storage::U8(s) => {
                    let mut d = unsafe { stream.alloc::<u8>(s.len()) }?;
                    stream.memcpy_dtod(s, &mut d)?;
                    Storage::U8(d)
                }
            })
        })
    }
}

/// A typed buffer in GPU memory: the [`Payload`] of the device communicators
/// ([`super::DeviceComm`], [`super::NcclComm`]) and the `Buf` of [`super::DeviceBackend`].
///
/// * **Element type** ([`DeviceBuf::elem`]): f32 (LSE, partial outputs, gradient
///   accumulators), bf16 or f16 as their 16-bit patterns (q, k, v, o and `d_o` of 16-bit
///   inputs: what the kernels read, and what travels between ranks — half the bytes of f32),
///   or bytes (control data). The communicators move the buffer's own type (NCCL's
///   `ncclFloat32`, `ncclBfloat16`, `ncclFloat16`, `ncclUint8`).
/// * **Shared storage**: an `Arc` of a cudarc [`CudaSlice`]; `clone` is cheap (no device
///   copy). Writes go through copy-on-write ([`DeviceBuf::make_mut`]): a buffer whose
///   storage is shared gets its own copy first, so a buffer handed to a send is never
///   modified under it.
/// * **Readiness**: an optional event recorded after the work that produced the contents
///   (a kernel, or the device-to-device copy of a send); a stream that uses the buffer waits
///   on it first ([`DeviceBuf::wait_on`]). cudarc's own per-allocation events order the
///   streams as well; the event here also lets a host thread wait for the contents
///   ([`DeviceBuf::wait_ready`]).
/// * **Length**: [`DeviceBuf::len`] elements; the allocation holds at least one (the driver
///   refuses empty allocations), and an even number for 16-bit values.
///
/// ```no_run
/// use ringattn::cuda::{CudaDevice, DeviceBuf};
/// use ringattn::{DType, Elem, HostBuf};
/// let dev = CudaDevice::new(0)?;
/// let buf = DeviceBuf::upload(dev.stream(), &[1.0, 2.0, 3.0])?;
/// let copy = buf.clone(); // shares the device memory
/// assert_eq!(copy.download(dev.stream())?, vec![1.0, 2.0, 3.0]);
/// // bf16 values stay 16-bit on the device.
/// let half = DeviceBuf::upload_host(dev.stream(), &HostBuf::filled(4, 1.5, DType::BF16))?;
/// assert_eq!((half.elem(), half.bytes()), (Elem::BF16, 8));
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Clone)]
pub struct DeviceBuf {
    data: Arc<Storage>,
    elem: Elem,
    len: usize,
    ready: Option<Arc<CudaEvent>>,
}

impl fmt::Debug for DeviceBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuf")
            .field("elem", &self.elem)
            .field("len", &self.len)
            .field("capacity", &self.data.elements())
            .field("shared", &(Arc::strong_count(&self.data) > 1))
            .field("ready_event", &self.ready.is_some())
            .finish()
    }
}

impl Payload for DeviceBuf {
    fn elements(&self) -> usize {
        self.len
    }

    fn elem(&self) -> Elem {
        self.elem
    }
}

impl DeviceBuf {
    /// A buffer of the first `len` f32 values of `slice`, ready once `ready` (when given)
    /// has completed.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `slice` holds fewer than `len` elements.
    pub fn from_slice(slice: CudaSlice<f32>, len: usize, ready: Option<CudaEvent>) -> Result<DeviceBuf> {
        DeviceBuf::from_storage(Storage::F32(slice), Elem::F32, len, ready)
    }

    /// A buffer of the first `len` 16-bit patterns of `slice` as `elem` ([`Elem::BF16`] or
    /// [`Elem::F16`]), ready once `ready` (when given) has completed. The data-movement
    /// kernels move 16-bit values in pairs: `slice` must hold an even number of elements
    /// (at least `len`).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `slice` holds fewer than `len` elements or an odd
    /// number; [`Error::InvalidArgument`] for an `elem` that is not 16-bit.
    pub fn from_bits(slice: CudaSlice<u16>, elem: Elem, len: usize, ready: Option<CudaEvent>) -> Result<DeviceBuf> {
        if elem.size_of() != 2 {
            return Err(Error::InvalidArgument(format!("DeviceBuf::from_bits: {elem} is not a 16-bit type")));
        }
        if !slice.len().is_multiple_of(2) {
            return Err(Error::ShapeMismatch(format!(
                "a 16-bit device buffer needs an even allocation (the kernels move pairs), not {}",
                slice.len()
            )));
        }
        DeviceBuf::from_storage(Storage::Bits16(slice), elem, len, ready)
    }

    fn from_storage(storage: Storage, elem: Elem, len: usize, ready: Option<CudaEvent>) -> Result<DeviceBuf> {
        if storage.elements() < len {
            return Err(Error::ShapeMismatch(format!(
                "a device buffer of {len} values in an allocation of {}",
                storage.elements()
            )));
        }
        Ok(DeviceBuf { data: Arc::new(storage), elem, len, ready: ready.map(Arc::new) })
    }

    /// A device copy of the f32 values `host`, uploaded on `stream` (pageable memory: the
    /// call returns once the values have left `host`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation or copy fails (or there is no driver).
    pub fn upload(stream: &Arc<CudaStream>, host: &[f32]) -> Result<DeviceBuf> {
        let slice = super::buffers::upload(stream, host)?;
        DeviceBuf::from_slice(slice, host.len(), None)
    }

    /// A device copy of `host` in its own element type (bf16 and f16 as 16-bit patterns,
    /// bytes as bytes), uploaded on `stream` as [`DeviceBuf::upload`].
    ///
    /// # Errors
    /// As [`DeviceBuf::upload`].
    pub fn upload_host(stream: &Arc<CudaStream>, host: &HostBuf) -> Result<DeviceBuf> {
        let elem = host.elem();
        match host.data() {
            HostData::F32(v) => DeviceBuf::upload(stream, v),
            HostData::U8(v) => {
                let slice = super::buffers::upload(stream, v)?;
                DeviceBuf::from_storage(Storage::U8(slice), elem, v.len(), None)
            }
            data => {
                let mut bits: Vec<u16> = bytemuck::cast_slice(data.as_bytes()).to_vec();
                bits.resize(capacity(elem, bits.len()), 0);
                let slice = super::buffers::upload(stream, &bits)?;
                DeviceBuf::from_bits(slice, elem, host.len(), None)
            }
        }
    }

    /// A new buffer holding a copy of the `len` values of `elem` at device address `src`,
    /// copied device to device on `stream` (asynchronously: the copy is ordered before any
    /// later use on `stream`; other streams wait through cudarc's events) — how a
    /// framework's device tensor (candle's CUDA storage) becomes a plan's input without a
    /// host round trip.
    ///
    /// # Safety
    /// `src` must address `len · elem.size_of()` readable bytes in `stream`'s context, left
    /// unmodified until the copy has run on `stream`.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation or the copy fails.
    pub unsafe fn copy_from_device(stream: &Arc<CudaStream>, elem: Elem, src: u64, len: usize) -> Result<DeviceBuf> {
        let mut out = DeviceBuf::alloc(stream, elem, len)?;
        if len > 0 {
            let (dst, _g) = out.write_ptr(stream)?;
            let bytes = len * elem.size_of();
            // SAFETY: `dst` holds at least `bytes` bytes (just allocated); `src` is the
            // caller's promise.
            guard("cuMemcpyDtoDAsync", || unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())
            })?;
        }
        Ok(out)
    }

    /// `len` uninitialised values of `elem` (see `kernels::params::device_capacity`) on
    /// `stream`, for a kernel to write every one of them.
    pub(crate) fn alloc(stream: &Arc<CudaStream>, elem: Elem, len: usize) -> Result<DeviceBuf> {
        // SAFETY: the caller writes the `len` values before anything reads them (stream
        // ordered); the padding elements are never read as values.
        let storage = unsafe { Storage::alloc(stream, elem, len) }?;
        DeviceBuf::from_storage(storage, elem, len, None)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn elem(&self) -> Elem {
        self.elem
    }

    /// Bytes of the values (`len · elem.size_of()`).
    pub fn bytes(&self) -> usize {
        self.len * self.elem.size_of()
    }

    /// The CUDA context of the allocation.
    pub fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        self.data.context()
    }

    /// The f32 allocation (at least [`DeviceBuf::len`] elements; read only the first `len`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of another element type.
    pub fn f32s(&self) -> Result<&CudaSlice<f32>> {
        match &*self.data {
            Storage::F32(s) => Ok(s),
            _ => Err(self.wrong_elem("f32")),
        }
    }

    /// The 16-bit allocation of a bf16 or f16 buffer (an even number of elements, at least
    /// [`DeviceBuf::len`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of another element type.
    pub fn bits(&self) -> Result<&CudaSlice<u16>> {
        match &*self.data {
            Storage::Bits16(s) => Ok(s),
            _ => Err(self.wrong_elem("bf16 or f16")),
        }
    }

    fn wrong_elem(&self, want: &str) -> Error {
        Error::InvalidArgument(format!(
            "a device buffer of {} {} values where {want} values are needed",
            self.len, self.elem
        ))
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

    /// The values on the host in the buffer's element type (waits for them on `stream`,
    /// then copies synchronously).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the copy fails; errors of earlier kernels on the stream surface
    /// here.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<HostBuf> {
        use super::buffers::download;
        self.wait_on(stream)?;
        Ok(match &*self.data {
            Storage::F32(s) => HostBuf::from(download(stream, s, self.len)?),
            Storage::U8(s) => HostBuf::bytes(download(stream, s, self.len)?),
            Storage::Bits16(s) => {
                let bits = download(stream, s, self.len)?;
                HostBuf::new(HostData::from_bytes(self.elem, bytemuck::cast_slice(&bits))?)
            }
        })
    }

    /// Makes the storage this buffer's own for writing on `stream`: first ordered after the
    /// producer's work; copied (device to device, on `stream`) when another buffer shares
    /// it, so that no other holder sees the write. The readiness event is cleared: later
    /// writes are ordered on `stream`, and other streams by cudarc's per-allocation events.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the wait, allocation or copy fails.
    pub fn make_mut(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.wait_on(stream)?;
        if Arc::get_mut(&mut self.data).is_none() {
            self.data = Arc::new(self.data.duplicate(stream)?);
        }
        self.ready = None;
        Ok(())
    }

    fn storage_mut(&mut self, stream: &Arc<CudaStream>) -> Result<&mut Storage> {
        self.make_mut(stream)?;
        Arc::get_mut(&mut self.data).ok_or_else(|| Error::Cuda("copy-on-write: the buffer is still shared".into()))
    }

    /// The f32 storage for writing on `stream` ([`DeviceBuf::make_mut`] first).
    ///
    /// # Errors
    /// As [`DeviceBuf::make_mut`]; [`Error::InvalidArgument`] for a buffer of another
    /// element type.
    pub fn f32s_mut(&mut self, stream: &Arc<CudaStream>) -> Result<&mut CudaSlice<f32>> {
        let err = self.wrong_elem("f32");
        match self.storage_mut(stream)? {
            Storage::F32(s) => Ok(s),
            _ => Err(err),
        }
    }

    /// Device address of the values for reading on `stream` (ordered after their producer),
    /// with cudarc's guard that records the read when dropped.
    pub(crate) fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> Result<(u64, cudarc::driver::SyncOnDrop<'a>)> {
        self.wait_on(stream)?;
        Ok(self.data.ptr(stream))
    }

    /// Device address of the values for writing on `stream` ([`DeviceBuf::make_mut`]
    /// first), with cudarc's guard that records the write when dropped.
    pub(crate) fn write_ptr<'a>(
        &'a mut self,
        stream: &'a Arc<CudaStream>,
    ) -> Result<(u64, cudarc::driver::SyncOnDrop<'a>)> {
        Ok(self.storage_mut(stream)?.ptr_mut(stream))
    }

    /// Device address of the values without waiting on the readiness event: for a
    /// communicator whose operation is ordered by its own waits (and which keeps the buffer
    /// alive until the operation has run).
    pub(crate) fn raw_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'a>) {
        self.data.ptr(stream)
    }
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
