//! [`CandleBuf`]: the buffers of a plan's backend as candle storages — host buffers
//! ([`HostBuf`]) for CPU tensors, device buffers (`cuda::DeviceBuf`, with the `cuda`
//! feature) for CUDA tensors — and the moves between tensors and buffers the operation
//! needs.

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CudaStorage, DType as CDType, Layout, Shape, Storage, Tensor};

use super::msg;
use crate::comm::Payload;
use crate::{DType, HostBuf, HostData};

/// A backend's buffer type as candle storage: what [`super::ring_attention`] needs to run a
/// plan on candle tensors. Implemented for [`HostBuf`] (CPU tensors: the CPU backend and
/// the emulated kernels) and, with the `cuda` feature, for `cuda::DeviceBuf` (CUDA tensors:
/// the device backend on candle's stream). A storage of the other kind is refused with an
/// error naming both.
pub trait CandleBuf: Payload + Sized + Send + Sync + 'static {
    /// The values of a CPU storage under a contiguous layout.
    ///
    /// # Errors
    /// A non-contiguous layout, a dtype other than f32/bf16/f16, or a buffer type that does
    /// not live in host memory.
    fn from_cpu(s: &CpuStorage, l: &Layout) -> candle_core::Result<Self>;

    /// The buffer as a CPU storage (contiguous, offset 0).
    ///
    /// # Errors
    /// A buffer type that does not live in host memory.
    fn into_cpu(self) -> candle_core::Result<CpuStorage>;

    /// The values of a CUDA storage under a contiguous layout.
    ///
    /// # Errors
    /// As [`CandleBuf::from_cpu`], for buffers that do not live in device memory.
    fn from_cuda(s: &CudaStorage, l: &Layout) -> candle_core::Result<Self>;

    /// The buffer as a CUDA storage on the device (and stream) of `like`.
    ///
    /// # Errors
    /// As [`CandleBuf::into_cpu`], for buffers that do not live in device memory.
    fn into_cuda(self, like: &CudaStorage) -> candle_core::Result<CudaStorage>;
}

impl CandleBuf for HostBuf {
    fn from_cpu(s: &CpuStorage, l: &Layout) -> candle_core::Result<HostBuf> {
        let (a, b) = l.contiguous_offsets().ok_or_else(|| msg("ringattn: a non-contiguous input".into()))?;
        Ok(HostBuf::new(match s {
            CpuStorage::F32(v) => HostData::F32(v[a..b].to_vec()),
            CpuStorage::BF16(v) => HostData::BF16(v[a..b].to_vec()),
            CpuStorage::F16(v) => HostData::F16(v[a..b].to_vec()),
            _ => return Err(msg("ringattn: attention takes f32, bf16 or f16 tensors".into())),
        }))
    }

    fn into_cpu(self) -> candle_core::Result<CpuStorage> {
        Ok(match self.into_data() {
            HostData::F32(v) => CpuStorage::F32(v),
            HostData::BF16(v) => CpuStorage::BF16(v),
            HostData::F16(v) => CpuStorage::F16(v),
            other => return Err(msg(format!("ringattn: a {} buffer is not a tensor", other.elem()))),
        })
    }

    fn from_cuda(_: &CudaStorage, _: &Layout) -> candle_core::Result<HostBuf> {
        Err(msg("ringattn: a CUDA tensor for a plan over host buffers; CUDA tensors take a plan over \
             `cuda::DeviceBackend` on candle's stream (features `candle` + `cuda`)"
            .into()))
    }

    fn into_cuda(self, _: &CudaStorage) -> candle_core::Result<CudaStorage> {
        Err(msg("ringattn: host buffers cannot become CUDA storage".into()))
    }
}

/// candle's dtype of a crate dtype.
pub(super) fn candle_dtype(d: DType) -> CDType {
    match d {
        DType::F32 => CDType::F32,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
    }
}

/// A tensor's values in `dtype` as a buffer (converted by candle, on the tensor's device).
pub(super) fn tensor_buf<B: CandleBuf>(t: &Tensor, dtype: DType) -> candle_core::Result<B> {
    let t = t.to_dtype(candle_dtype(dtype))?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => B::from_cpu(s, layout),
        Storage::Cuda(s) => B::from_cuda(s, layout),
        Storage::Metal(_) => Err(msg("ringattn: Metal tensors are not supported".into())),
    }
}

/// A buffer as a tensor of `shape` on the device of `like` (no graph: a gradient or an
/// output).
pub(super) fn buf_tensor<B: CandleBuf>(b: B, shape: &Shape, like: &Tensor) -> candle_core::Result<Tensor> {
    let storage = {
        let (st, _) = like.storage_and_layout();
        match &*st {
            Storage::Cpu(_) => Storage::Cpu(b.into_cpu()?),
            Storage::Cuda(s) => Storage::Cuda(b.into_cuda(s)?),
            Storage::Metal(_) => return Err(msg("ringattn: Metal tensors are not supported".into())),
        }
    };
    Ok(Tensor::from_storage(storage, shape.clone(), BackpropOp::none(), false))
}
