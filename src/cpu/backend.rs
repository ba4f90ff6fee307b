//! [`CpuBackend`]: the CPU flash attention as a [`Backend`] of the parallel drivers — host
//! buffers ([`HostMemory`]), steps born complete, bf16 steps where the processor has
//! bf16 products, large f32 buffers kept for the thread's next step.

use half::bf16;

use crate::buf::{Elem, HostData};
use crate::cpu::{self, TileConfig};
use crate::parallel::{host_partial, Backend, ForwardPartial, GradientPartial, HostMemory, Pending};
use crate::params::Visibility;
use crate::{AttentionParams, DType, Dims, HostBuf, Positions, Result};

/// The CPU flash attention of [`crate::cpu`] as a [`Backend`] (also `parallel::CpuBackend`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Tile sizes.
    pub tiles: TileConfig,
    /// Arithmetic of the products ([`cpu::Arithmetic`]): by default bf16 products for bf16
    /// inputs where the processor has them, whose steps then read q, k, v and `d_o` as bf16
    /// (K/V travel the ring in bf16 either way).
    pub arithmetic: cpu::Arithmetic,
    /// The unit of the bf16 products ([`cpu::MatrixUnit`]: AMX tiles where the processor has
    /// them, by default).
    pub matrix_unit: cpu::MatrixUnit,
}

impl HostMemory for CpuBackend {}

impl CpuBackend {
    /// The bf16 data of `bufs` when this backend's arithmetic resolves to bf16 products for
    /// them and they are finite (the bf16 steps' domain), else `None` (the f32 steps).
    fn bf16_steps<'a, const N: usize>(&self, bufs: [&'a HostBuf; N]) -> Result<Option<[&'a [bf16]; N]>> {
        if self.arithmetic.resolve(DType::BF16)? != cpu::Arithmetic::Bf16 {
            return Ok(None);
        }
        let mut out = [&[][..]; N];
        for (o, b) in out.iter_mut().zip(bufs) {
            match b.data() {
                HostData::BF16(v) if cpu::bf16_finite(v) => *o = v,
                _ => return Ok(None),
            }
        }
        Ok(Some(out))
    }
}

impl Backend for CpuBackend {
    fn step_input(&self, x: &HostBuf) -> Result<HostBuf> {
        // bf16 inputs stay bf16 for the bf16 steps; everything else is widened once.
        let keep = x.elem() == Elem::BF16 && self.arithmetic.resolve(DType::BF16)? == cpu::Arithmetic::Bf16;
        Ok(if keep { x.clone() } else { x.converted(DType::F32) })
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
        let vis = crate::attention::block_visibility(&dims, q_pos, k_pos, params)?;
        if let Some([q, k, v]) = self.bf16_steps([q, k, v])? {
            return Ok(Pending::ready(host_partial(cpu::forward_bf16(
                dims,
                q,
                k,
                v,
                &vis,
                params,
                self.tiles,
                self.matrix_unit,
            ))));
        }
        let (q, k, v) = (q.to_f32()?, k.to_f32()?, v.to_f32()?);
        Ok(Pending::ready(host_partial(cpu::forward_f32(dims, &q, &k, &v, &vis, params, self.tiles, self.matrix_unit))))
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
        let vis: Visibility = crate::attention::block_visibility(&dims, q_pos, k_pos, params)?;
        if let Some([q, k, v, d_o]) = self.bf16_steps([q, k, v, d_o])? {
            let (lse, delta) = (lse.f32s()?, delta.f32s()?);
            let (dq, dk, dv) =
                cpu::backward_bf16(dims, q, k, v, lse, d_o, delta, &vis, params, self.tiles, self.matrix_unit);
            return Ok(Pending::ready((dq.into(), dk.into(), dv.into())));
        }
        let (q, k, v, o, d_o) = (q.to_f32()?, k.to_f32()?, v.to_f32()?, o.to_f32()?, d_o.to_f32()?);
        let (dq, dk, dv) =
            cpu::backward_f32(dims, &q, &k, &v, &o, lse.f32s()?, &d_o, Some(delta.f32s()?), &vis, params, self.tiles);
        Ok(Pending::ready((dq.into(), dk.into(), dv.into())))
    }

    fn recycle(&self, spent: HostBuf) {
        if let Some(HostData::F32(v)) = spent.into_unshared() {
            cpu::reuse::keep(v);
        }
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &HostBuf, d_o: &HostBuf) -> Result<HostBuf> {
        Ok(match (o.data(), d_o.data()) {
            (HostData::BF16(ob), HostData::BF16(dob)) => cpu::softmax_grad_rowsum(dims, ob, dob),
            _ => cpu::softmax_grad_rowsum(dims, &o.to_f32()?, &d_o.to_f32()?),
        }
        .into())
    }
}
