//! The CUDA kernels as a backend of the sequence-parallel drivers, over host buffers.

use std::sync::Arc;

use super::CudaDevice;
use crate::kernels::geometry::{DqMode, KernelFamily};
use crate::parallel::{Backend, ForwardPartial, GradientPartial, HostMemory, Pending};
use crate::runner::{self, BlockBackward};
use crate::{AttentionParams, DType, Dims, Error, HostBuf, Positions, Result};

/// The kernels of `cuda/flash_fwd.cu` and `cuda/flash_bwd.cu` on a GPU as a [`Backend`], so
/// every strategy (ring, all-gather, Ulysses, USP over in-process ranks) runs on them: buffers
/// are host [`crate::HostBuf`]s holding `dtype` (bf16 or f16) values, which each step
/// uploads as they are, computes on the device's stream and downloads (partial results
/// stay f32). Ranks share the GPU. This measures correctness, not speed: device-resident
/// buffers and communication come with the NCCL communicator. The drivers refuse
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
    kernels: KernelFamily,
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
        Ok(CudaBackend { device: CudaDevice::shared(device)?, dtype, kernels: KernelFamily::default() })
    }

    /// With the kernel family of every step's forward and backward (auto by default; see
    /// [`KernelFamily`]).
    pub fn with_kernels(mut self, kernels: KernelFamily) -> Self {
        self.kernels = kernels;
        self
    }

    /// The kernel family the steps run on.
    pub fn kernels(&self) -> KernelFamily {
        self.kernels
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
    fn supports(&self, dims: &Dims, dtype: DType, _spec: &crate::attention::ScoreSpec) -> Result<()> {
        runner::supports(super::BACKEND, self.dtype, dims, dtype)
    }

    fn forward_block(
        &self,
        dims: Dims,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<HostBuf>>> {
        let e = super::WithKernels(&self.device, self.kernels);
        Ok(Pending::ready(runner::forward_block(&e, self.dtype, dims, q, k, v, q_pos, k_pos, params)?))
    }

    fn backward_block(
        &self,
        dims: Dims,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        o: &HostBuf,
        lse: &HostBuf,
        d_o: &HostBuf,
        delta: &HostBuf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<HostBuf>>> {
        let x = BlockBackward { dims, q, k, v, o, lse, d_o, delta, q_pos, k_pos, params };
        let e = super::WithKernels(&self.device, self.kernels);
        Ok(Pending::ready(runner::backward_block(&e, self.dtype, DqMode::default(), &x)?))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &HostBuf, d_o: &HostBuf) -> Result<HostBuf> {
        runner::rowsum_block(&super::WithKernels(&self.device, self.kernels), self.dtype, dims, o, d_o)
    }
}
