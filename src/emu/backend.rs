//! The emulated kernels as a backend of the sequence-parallel drivers.

use super::flash::{Emulator, BACKEND};
use super::EmuOptions;
use crate::parallel::{Backend, ForwardPartial, GradientPartial, HostMemory, Pending};
use crate::runner::{self, BlockBackward};
use crate::{AttentionParams, DType, Dims, HostBuf, Positions, Result};

/// The kernels of `cuda/flash_fwd.cu` and `cuda/flash_bwd.cu`, run by the host emulator, as a
/// [`Backend`]: buffers are host [`crate::HostBuf`]s holding `dtype` (bf16 or f16) values,
/// which each step passes to the kernels in place; partial results stay f32. The drivers
/// refuse other dtypes, and head dimensions the kernels do not take, with
/// [`crate::Error::BackendUnsupported`] on every rank.
///
/// ```
/// use ringattn::comm::LocalOptions;
/// use ringattn::parallel::{run_in_process, ParallelParams, Strategy};
/// use ringattn::{emu::EmuBackend, random::randn, DType};
/// let q = randn(vec![1, 48, 2, 16], 5, DType::BF16);
/// let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
/// let backend = EmuBackend { dtype: DType::BF16, ..Default::default() };
/// let run = run_in_process(2, LocalOptions::default(), &backend, &q, &q, &q, None, &params)?;
/// assert_eq!(run.forward.o.shape(), &[1, 48, 2, 16]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmuBackend {
    /// Element type the kernels read: [`DType::BF16`] or [`DType::F16`].
    pub dtype: DType,
    /// Emulator options.
    pub options: EmuOptions,
}

impl Default for EmuBackend {
    fn default() -> Self {
        EmuBackend { dtype: DType::BF16, options: EmuOptions::default() }
    }
}

impl HostMemory for EmuBackend {}

impl Backend for EmuBackend {
    fn supports(&self, dims: &Dims, dtype: DType, _spec: &crate::attention::ScoreSpec) -> Result<()> {
        runner::supports(BACKEND, self.dtype, dims, dtype)
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
        let e = Emulator::new(&self.options);
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
        let e = Emulator::new(&self.options);
        Ok(Pending::ready(runner::backward_block(&e, self.dtype, self.options.dq_mode, &x)?))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &HostBuf, d_o: &HostBuf) -> Result<HostBuf> {
        runner::rowsum_block(&Emulator::new(&self.options), self.dtype, dims, o, d_o)
    }
}
