//! The backend seam: the local attention steps the drivers run on each rank.

use crate::cpu::{self, TileConfig};
use crate::params::Visibility;
use crate::{AttentionParams, Dims, Positions, Result};

/// Local attention steps on f32 host buffers, in the crate layouts (`[b, s, h, d]` for
/// q/k/v/o and their gradients, `[b, h_q, s_q]` for the LSE). Drivers call nothing else to
/// compute, so another backend (the emulated or CUDA kernels) plugs in without touching them.
pub trait Backend: Sync {
    /// Attention of queries at `q_pos` against keys at `k_pos`: f32 `(o, lse)`, unrounded.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn forward_block(
        &self,
        dims: Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<(Vec<f32>, Vec<f32>)>;

    /// The contribution of the keys at `k_pos` to the gradients, given the final `o`, `lse`
    /// and `big_d = rowsum(dO∘O)` of the queries: f32 `(dq, dk, dv)`, unrounded.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn backward_block(
        &self,
        dims: Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        big_d: &[f32],
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>;

    /// `rowsum(dO∘O)` `[b, h_q, s_q]`.
    fn softmax_grad_rowsum(&self, dims: Dims, o: &[f32], d_o: &[f32]) -> Vec<f32>;
}

/// The CPU flash attention of [`crate::cpu`] as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Tile sizes.
    pub tiles: TileConfig,
}

impl Backend for CpuBackend {
    fn forward_block(
        &self,
        dims: Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let vis = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(cpu::forward_f32(dims, q, k, v, &vis, params, self.tiles))
    }

    fn backward_block(
        &self,
        dims: Dims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        big_d: &[f32],
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let vis: Visibility = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(cpu::backward_f32(
            dims,
            q,
            k,
            v,
            o,
            lse,
            d_o,
            Some(big_d),
            &vis,
            params,
            self.tiles,
        ))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &[f32], d_o: &[f32]) -> Vec<f32> {
        cpu::softmax_grad_rowsum(dims, o, d_o)
    }
}
