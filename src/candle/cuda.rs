//! CUDA tensors (features `candle` + `cuda`, which turns on candle-core's `cuda`): candle's
//! CUDA storage as the device backend's [`DeviceBuf`]s. Each input is copied once, device to
//! device on candle's stream, into a buffer of its own dtype (bf16 and f16 stay 16-bit);
//! outputs and gradients are copied into storage candle allocates on its stream. Nothing goes
//! through the host; the plan's backend should run on candle's stream
//! (`DeviceBackend::on_stream(device, candle_device.cuda_stream(), dtype)`), so the copies
//! and the kernels are ordered with candle's own work without synchronisation.

use candle_core::cuda_backend::cudarc::driver::{result, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CpuStorage, CudaStorage, Layout};
use half::{bf16, f16};

use super::storage::CandleBuf;
use super::{msg, wrap};
use crate::cuda::DeviceBuf;
use crate::Elem;

fn driver(what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    msg(format!("ringattn: {what}: {e}"))
}

impl CandleBuf for DeviceBuf {
    fn from_cpu(_: &CpuStorage, _: &Layout) -> candle_core::Result<DeviceBuf> {
        Err(msg("ringattn: a CPU tensor for a plan over device buffers; CPU tensors take a plan over a host backend \
             (CpuBackend, the emulated kernels)"
            .into()))
    }

    fn into_cpu(self) -> candle_core::Result<CpuStorage> {
        Err(msg("ringattn: device buffers cannot become CPU storage".into()))
    }

    fn from_cuda(s: &CudaStorage, l: &Layout) -> candle_core::Result<DeviceBuf> {
        let (a, b) = l.contiguous_offsets().ok_or_else(|| msg("ringattn: a non-contiguous input".into()))?;
        let stream = s.device.cuda_stream();
        let n = b - a;
        let (elem, (base, guard)) = match &s.slice {
            CudaStorageSlice::BF16(x) => (Elem::BF16, x.device_ptr(&stream)),
            CudaStorageSlice::F16(x) => (Elem::F16, x.device_ptr(&stream)),
            CudaStorageSlice::F32(x) => (Elem::F32, x.device_ptr(&stream)),
            _ => return Err(msg("ringattn: attention takes f32, bf16 or f16 tensors".into())),
        };
        let src = base + (a * elem.size_of()) as u64;
        // SAFETY: `src` addresses the layout's `n` contiguous values inside the storage, read
        // on candle's stream while `guard` (and the storage's read lock) is held.
        let out = unsafe { DeviceBuf::copy_from_device(&stream, elem, src, n) }.map_err(wrap);
        drop(guard);
        out
    }

    fn into_cuda(self, like: &CudaStorage) -> candle_core::Result<CudaStorage> {
        let dev = &like.device;
        let stream = dev.cuda_stream();
        self.wait_on(&stream).map_err(wrap)?;
        let n = self.len();
        let bytes = self.bytes();
        // SAFETY: every element of the new slice is written by the copy below (stream ordered
        // on candle's stream) before candle reads it.
        macro_rules! copy_into {
            ($t:ty) => {{
                let mut out = unsafe { dev.alloc::<$t>(n.max(1)) }?;
                if bytes > 0 {
                    let (src, _gs) = self.read_ptr(&stream).map_err(wrap)?;
                    let (dst, _gd) = out.device_ptr_mut(&stream);
                    // SAFETY: both ranges hold `bytes` bytes of live allocations on this
                    // context; ordered on candle's stream.
                    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
                        .map_err(|e| driver("copying an output into candle's storage", e))?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        Ok(match self.elem() {
            Elem::BF16 => copy_into!(bf16),
            Elem::F16 => copy_into!(f16),
            Elem::F32 => copy_into!(f32),
            other => return Err(msg(format!("ringattn: a {other} buffer is not a tensor"))),
        })
    }
}
