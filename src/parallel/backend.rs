//! The backend seam: the local attention steps the drivers run on each rank.

use super::seq;
use crate::comm::Payload;
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
pub type ForwardPartial<B> = (B, B);
/// `(dq, dk, dv)` of a backward step.
pub type GradientPartial<B> = (B, B, B);

/// The shape `[b, n, h, d]` of a buffer the data-movement operations address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufShape {
    /// Batch.
    pub b: usize,
    /// Tokens.
    pub n: usize,
    /// Heads.
    pub h: usize,
    /// Elements per head.
    pub d: usize,
}

impl BufShape {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.b * self.n * self.h * self.d
    }

    /// Whether the shape holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The memory side of a backend: its buffer type and the few data movements the strategies
/// need, in the crate layouts (`[b, s, h, d]` for q/k/v/o and their gradients, `[b, h_q,
/// s_q]` for the LSE, f32 values). Backends that keep their data in host vectors get it from
/// [`HostMemory`].
pub trait Buffers: Sync {
    /// The buffers this backend computes on (and its communicator moves).
    type Buf: Payload;

    /// A buffer holding `host`.
    ///
    /// # Errors
    /// Allocation or transfer errors.
    fn upload(&self, host: &[f32]) -> Result<Self::Buf>;
    /// The values of `buf` on the host.
    ///
    /// # Errors
    /// Transfer errors.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// A buffer of `len` copies of `value`.
    ///
    /// # Errors
    /// Allocation errors.
    fn filled(&self, len: usize, value: f32) -> Result<Self::Buf>;
    /// `acc += x` element-wise.
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for unequal lengths.
    fn add_into(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// Merges the partial `(o, lse)` into the accumulator (see [`crate::merge`]); `bshd` is
    /// `[b, s, h, d]` of `o`.
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for lengths that disagree with `bshd`.
    fn merge_into(
        &self,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        o_b: &Self::Buf,
        lse_b: &Self::Buf,
        bshd: [usize; 4],
    ) -> Result<()>;
    /// Concatenates `[b, n_i, w]` buffers along the middle axis.
    ///
    /// # Errors
    /// Allocation errors.
    fn concat_seq(&self, parts: &[Self::Buf], b: usize, w: usize) -> Result<Self::Buf>;
    /// Rows `r0..r0 + n` of the middle axis of a `[b, s, w]` buffer.
    ///
    /// # Errors
    /// Allocation errors.
    fn seq_slice(&self, x: &Self::Buf, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<Self::Buf>;
    /// The heads `heads` of a `shape` buffer, as `[b, n, heads.len(), d]`.
    ///
    /// # Errors
    /// Allocation errors.
    fn select_heads(&self, x: &Self::Buf, shape: BufShape, heads: &[usize]) -> Result<Self::Buf>;
    /// Writes (`assign`) or adds `src` (`[b, n, heads.len(), d]`) into the heads `heads` of
    /// the `shape` buffer `dst`.
    ///
    /// # Errors
    /// Launch errors.
    fn scatter_heads(
        &self,
        dst: &mut Self::Buf,
        shape: BufShape,
        heads: &[usize],
        src: &Self::Buf,
        assign: bool,
    ) -> Result<()>;
}

/// A compute backend of the drivers: its [`Buffers`] and the local attention steps. Drivers
/// call nothing else, so another backend (the emulated or CUDA kernels, with device buffers)
/// plugs in without touching them. Steps are asynchronous: each returns a [`Pending`] handle.
pub trait Backend: Buffers {
    /// Checks that this backend computes on `dtype` inputs of `dims` (called by the drivers
    /// before any step, so that every rank reports the same error). The CPU backend takes
    /// everything.
    ///
    /// # Errors
    /// [`crate::Error::BackendUnsupported`] or a dtype error naming the offending value.
    fn supports(&self, _dims: &Dims, _dtype: crate::DType) -> Result<()> {
        Ok(())
    }

    /// Attention of queries at `q_pos` against keys at `k_pos`: f32 `(o, lse)`, unrounded.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn forward_block(
        &self,
        dims: Dims,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<Self::Buf>>>;

    /// The contribution of the keys at `k_pos` to the gradients, given the final `o`, `lse`
    /// and `big_d = rowsum(dO∘O)` of the queries: f32 `(dq, dk, dv)`, unrounded.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn backward_block(
        &self,
        dims: Dims,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &Self::Buf,
        lse: &Self::Buf,
        d_o: &Self::Buf,
        big_d: &Self::Buf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<Self::Buf>>>;

    /// `rowsum(dO∘O)` `[b, h_q, s_q]`.
    ///
    /// # Errors
    /// Launch errors.
    fn softmax_grad_rowsum(&self, dims: Dims, o: &Self::Buf, d_o: &Self::Buf) -> Result<Self::Buf>;
}

/// The CPU flash attention of [`crate::cpu`] as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Tile sizes.
    pub tiles: TileConfig,
}

/// Marker of backends whose buffers are host `Vec<f32>`: they get [`Buffers`] from the
/// implementation below and only write the compute steps.
pub trait HostMemory: Sync {}

impl<T: HostMemory> Buffers for T {
    type Buf = Vec<f32>;

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }

    fn filled(&self, len: usize, value: f32) -> Result<Vec<f32>> {
        Ok(vec![value; len])
    }

    fn add_into(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        crate::comm::add_host(acc, x)
    }

    fn merge_into(
        &self,
        o: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        o_b: &Vec<f32>,
        lse_b: &Vec<f32>,
        bshd: [usize; 4],
    ) -> Result<()> {
        crate::merge::merge_into(o, lse, o_b, lse_b, bshd)
    }

    fn concat_seq(&self, parts: &[Vec<f32>], b: usize, w: usize) -> Result<Vec<f32>> {
        Ok(seq::concat_seq(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>(), b, w))
    }

    fn seq_slice(&self, x: &Vec<f32>, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<Vec<f32>> {
        Ok(seq::seq_slice(x, b, s, w, r0, n))
    }

    fn select_heads(&self, x: &Vec<f32>, shape: BufShape, heads: &[usize]) -> Result<Vec<f32>> {
        Ok(seq::select_heads(x, shape, heads))
    }

    fn scatter_heads(
        &self,
        dst: &mut Vec<f32>,
        shape: BufShape,
        heads: &[usize],
        src: &Vec<f32>,
        assign: bool,
    ) -> Result<()> {
        seq::scatter_heads(dst, shape, heads, src, assign);
        Ok(())
    }
}

impl HostMemory for CpuBackend {}

impl Backend for CpuBackend {
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
        let vis = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(Pending::ready(cpu::forward_f32(dims, q, k, v, &vis, params, self.tiles)))
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
        let vis: Visibility = cpu::block_visibility(&dims, q_pos, k_pos, params)?;
        Ok(Pending::ready(cpu::backward_f32(dims, q, k, v, o, lse, d_o, Some(big_d), &vis, params, self.tiles)))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &Vec<f32>, d_o: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(cpu::softmax_grad_rowsum(dims, o, d_o))
    }
}

/// A backend that computes nothing: outputs of the right sizes (zeros, LSE = −inf) at once.
/// It runs a schedule's communication alone, to measure how much of it compute hides
/// ([`super::measure_overlap`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullBackend;

impl HostMemory for NullBackend {}

impl Backend for NullBackend {
    fn forward_block(
        &self,
        dims: Dims,
        _q: &Vec<f32>,
        _k: &Vec<f32>,
        _v: &Vec<f32>,
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<Vec<f32>>>> {
        let o = vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d];
        Ok(Pending::ready((o, vec![f32::NEG_INFINITY; dims.b * dims.h_q * dims.s_q])))
    }

    fn backward_block(
        &self,
        dims: Dims,
        _q: &Vec<f32>,
        _k: &Vec<f32>,
        _v: &Vec<f32>,
        _o: &Vec<f32>,
        _lse: &Vec<f32>,
        _d_o: &Vec<f32>,
        _big_d: &Vec<f32>,
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<Vec<f32>>>> {
        let kv = dims.b * dims.s_k * dims.h_kv * dims.d;
        Ok(Pending::ready((vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d], vec![0.0; kv], vec![0.0; kv])))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, _o: &Vec<f32>, _d_o: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(vec![0.0; dims.b * dims.h_q * dims.s_q])
    }
}
