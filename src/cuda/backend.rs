//! The CUDA kernels as a backend of the sequence-parallel drivers, over host buffers.

use std::sync::Arc;

use super::{device, to_bits, CudaDevice, HostBackward, HostForward};
use crate::parallel::{Backend, ForwardPartial, GradientPartial, HostMemory, Pending};
use crate::{AttentionParams, DType, Dims, Error, Positions, Result};

/// The kernels of `cuda/flash_fwd.cu` and `cuda/flash_bwd.cu` on a GPU as a [`Backend`], so
/// every strategy (ring, all-gather, Ulysses, USP over in-process ranks) runs on them: buffers
/// are host `Vec<f32>` holding values of `dtype` (bf16 or f16), which each step converts to
/// 16-bit patterns, uploads, computes on the device's stream and downloads (partial results
/// stay f32). Ranks share the GPU. This measures correctness, not speed: device-resident
/// buffers and communication come with the NCCL communicator (issue 6). The drivers refuse
/// other dtypes, and head dimensions the kernels do not take, with
/// [`Error::BackendUnsupported`] on every rank.
///
/// ```no_run
/// use ringattn::comm::LocalOptions;
/// use ringattn::parallel::{run_in_process, ParallelParams, Strategy};
/// use ringattn::{cuda::CudaBackend, random::randn, DType};
/// let q = randn(vec![1, 4096, 8, 64], 5, DType::BF16);
/// let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
/// let backend = CudaBackend::new(0, DType::BF16)?;
/// let run = run_in_process(4, LocalOptions::default(), &backend, &q, &q, &q, None, &params)?;
/// assert_eq!(run.forward.o.shape(), &[1, 4096, 8, 64]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct CudaBackend {
    device: Arc<CudaDevice>,
    dtype: DType,
}

impl CudaBackend {
    /// The backend on GPU `device` (opened once per process, [`CudaDevice::shared`]) for
    /// inputs of `dtype`.
    ///
    /// # Errors
    /// [`Error::BackendUnsupported`] for f32; as [`CudaDevice::new`] otherwise (no driver,
    /// no GPU, no kernel image for it).
    pub fn new(device: usize, dtype: DType) -> Result<CudaBackend> {
        if dtype == DType::F32 {
            return Err(Error::BackendUnsupported {
                backend: super::BACKEND,
                what: "f32 inputs (the kernels take bf16 or f16; convert the inputs, or use the cpu backend)".into(),
            });
        }
        Ok(CudaBackend { device: CudaDevice::shared(device)?, dtype })
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Element type the kernels read.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl HostMemory for CudaBackend {}

impl Backend for CudaBackend {
    fn supports(&self, dims: &Dims, dtype: DType) -> Result<()> {
        device::check_supported(dims, dtype)?;
        if dtype != self.dtype {
            return Err(Error::DtypeMismatch {
                name: "q".into(),
                got: dtype.to_string(),
                expected: format!("{} (the dtype of the cuda backend)", self.dtype),
            });
        }
        Ok(())
    }

    fn forward_block(
        &self,
        dims: Dims,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<Vec<f32>>>> {
        let vis = crate::cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        let bits = |x: &[f32]| to_bits(x, self.dtype);
        let (qb, kb, vb) = (bits(q), bits(k), bits(v));
        let x = HostForward {
            dims,
            dtype: self.dtype,
            q: &qb,
            k: &kb,
            v: &vb,
            vis: &vis,
            scale: params.softmax_scale(dims.d),
        };
        Ok(Pending::ready(self.device.forward_host(&x)?))
    }

    fn backward_block(
        &self,
        dims: Dims,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        o: &Vec<f32>,
        lse: &Vec<f32>,
        d_o: &Vec<f32>,
        big_d: &Vec<f32>,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<Vec<f32>>>> {
        let vis = crate::cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        let bits = |x: &[f32]| to_bits(x, self.dtype);
        let (qb, kb, vb, dob) = (bits(q), bits(k), bits(v), bits(d_o));
        let x = HostBackward {
            fwd: HostForward {
                dims,
                dtype: self.dtype,
                q: &qb,
                k: &kb,
                v: &vb,
                vis: &vis,
                scale: params.softmax_scale(dims.d),
            },
            o,
            lse,
            d_o: &dob,
            delta: Some(big_d),
        };
        Ok(Pending::ready(self.device.backward_host(&x)?))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &Vec<f32>, d_o: &Vec<f32>) -> Result<Vec<f32>> {
        self.device.rowsum_host(&dims, self.dtype, o, &to_bits(d_o, self.dtype))
    }
}
