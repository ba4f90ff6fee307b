//! The backend seam: the local attention steps the drivers run on each rank.

use crate::cpu::{self, TileConfig};
use crate::params::Visibility;
use crate::{AttentionParams, Dims, Positions, Result};

/// A local step in flight: [`Backend`] calls enqueue work and return one; `wait` returns the
/// result. The CPU backend computes at once, so its steps are born complete; a device
/// backend completes them on its streams, and the drivers overlap them with communication
/// the same way.
pub struct Pending<T>(Box<dyn FnOnce() -> Result<T> + Send>);

impl<T: Send + 'static> Pending<T> {
    /// A step that is already complete.
    pub fn ready(value: T) -> Self {
        Pending(Box::new(move || Ok(value)))
    }

    /// A step completed by `f`.
    pub fn new(f: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Pending(Box::new(f))
    }

    /// Waits for the result.
    ///
    /// # Errors
    /// The step's error.
    pub fn wait(self) -> Result<T> {
        (self.0)()
    }
}

/// `(o, lse)` of a forward step.
pub type ForwardPartial = (Vec<f32>, Vec<f32>);
/// `(dq, dk, dv)` of a backward step.
pub type GradientPartial = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Local attention steps on f32 host buffers, in the crate layouts (`[b, s, h, d]` for
/// q/k/v/o and their gradients, `[b, h_q, s_q]` for the LSE). Drivers call nothing else to
/// compute, so another backend (the emulated or CUDA kernels) plugs in without touching them.
/// Steps are asynchronous: each returns a [`Pending`] handle.
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
    ) -> Result<Pending<ForwardPartial>>;

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
    ) -> Result<Pending<GradientPartial>>;

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
    ) -> Result<Pending<ForwardPartial>> {
        let vis = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(Pending::ready(cpu::forward_f32(dims, q, k, v, &vis, params, self.tiles)))
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
    ) -> Result<Pending<GradientPartial>> {
        let vis: Visibility = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(Pending::ready(cpu::backward_f32(dims, q, k, v, o, lse, d_o, Some(big_d), &vis, params, self.tiles)))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &[f32], d_o: &[f32]) -> Vec<f32> {
        cpu::softmax_grad_rowsum(dims, o, d_o)
    }
}

/// A backend that computes nothing: outputs of the right sizes (zeros, LSE = −inf) at once.
/// It runs a schedule's communication alone, to measure how much of it compute hides
/// ([`super::measure_overlap`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullBackend;

impl Backend for NullBackend {
    fn forward_block(
        &self,
        dims: Dims,
        _q: &[f32],
        _k: &[f32],
        _v: &[f32],
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial>> {
        Ok(Pending::ready((
            vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d],
            vec![f32::NEG_INFINITY; dims.b * dims.h_q * dims.s_q],
        )))
    }

    fn backward_block(
        &self,
        dims: Dims,
        _q: &[f32],
        _k: &[f32],
        _v: &[f32],
        _o: &[f32],
        _lse: &[f32],
        _d_o: &[f32],
        _big_d: &[f32],
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<GradientPartial>> {
        let kv = dims.b * dims.s_k * dims.h_kv * dims.d;
        Ok(Pending::ready((vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d], vec![0.0; kv], vec![0.0; kv])))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, _o: &[f32], _d_o: &[f32]) -> Vec<f32> {
        vec![0.0; dims.b * dims.h_q * dims.s_q]
    }
}
