//! The emulated kernels as a backend of the sequence-parallel drivers.

use super::flash::{self, BackwardBits, ForwardBits};
use super::EmuOptions;
use crate::parallel::{Backend, ForwardPartial, GradientPartial, HostMemory, Pending};
use crate::{AttentionParams, DType, Dims, Positions, Result};

/// The kernels of `cuda/flash_fwd.cu` and `cuda/flash_bwd.cu`, run by the host emulator, as a
/// [`Backend`]: buffers are host `Vec<f32>` holding values of `dtype` (bf16 or f16), which
/// each step passes to the kernels as 16-bit patterns; partial results stay f32. The drivers
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
    fn supports(&self, dims: &Dims, dtype: DType) -> Result<()> {
        flash::check_supported(dims, dtype)?;
        if dtype != self.dtype {
            return Err(crate::Error::DtypeMismatch {
                name: "q".into(),
                got: dtype.to_string(),
                expected: format!("{} (the dtype of the emu backend)", self.dtype),
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
        let bits = |x: &[f32]| flash::to_bits(x, self.dtype);
        let (qb, kb, vb) = (bits(q), bits(k), bits(v));
        let x = ForwardBits {
            dims,
            q: &qb,
            k: &kb,
            v: &vb,
            vis: &vis,
            scale: params.softmax_scale(dims.d),
            dtype: self.dtype,
            round_o: false,
        };
        Ok(Pending::ready(flash::forward_bits(&x, &self.options)?))
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
        let bits = |x: &[f32]| flash::to_bits(x, self.dtype);
        let (qb, kb, vb, dob) = (bits(q), bits(k), bits(v), bits(d_o));
        let x = BackwardBits {
            dims,
            q: &qb,
            k: &kb,
            v: &vb,
            o,
            d_o: &dob,
            lse,
            delta: Some(big_d),
            vis: &vis,
            scale: params.softmax_scale(dims.d),
            dtype: self.dtype,
            dq_mode: self.options.dq_mode,
        };
        Ok(Pending::ready(flash::backward_bits(&x, &self.options)?))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &Vec<f32>, d_o: &Vec<f32>) -> Result<Vec<f32>> {
        flash::rowsum(dims, o, &flash::to_bits(d_o, self.dtype), self.dtype, &self.options)
    }
}
