//! Exact flash attention on the CPU, forward and backward, for every dtype, mask and layout
//! of the crate. Tiles of `block_q` query rows meet tiles of `block_k` key rows; products run
//! on the crate's own AVX-512 kernels (`products.rs`) or through the `gemm` crate, the online
//! softmax through run-time dispatched SIMD loops, and work is spread over rayon's pool. No
//! `s_q × s_k` matrix is ever held: memory is the outputs plus tile scratch per thread (the
//! backward adds f32 partials of dQ) and, in the forward, packed copies of K and V. Large
//! buffers — packings, dQ partials and the f32 outputs a driver hands back — are kept by the
//! calling thread for its next call (`reuse`: at most 1 GiB per thread, see
//! [`kept_bytes`] and [`release_kept_buffers`]).
//!
//! Products run in the [`Arithmetic`] the call resolves to: bf16 inputs on a processor with
//! AVX512_BF16 multiply bf16 operands with f32 accumulation (the `vdpbf16ps` kernels of
//! `products.rs`, or AMX tiles where the processor has them: [`MatrixUnit`]; P and dS
//! rounded to bf16 as on the GPU); every other call widens its inputs to f32 and multiplies
//! to f32 accuracy: the forward on AMX tiles with each operand split into three bf16 parts
//! (`split.rs`; [`MatrixUnit`]), else on `products.rs`'s f32 kernels where the processor has
//! AVX512F (with the probabilities computed in the epilogue of `Q·Kᵀ`), the backward, and
//! the forward elsewhere, through `gemm`. Outputs are rounded back to the input dtype; the
//! LSE is always f32.

mod aligned;
pub mod amx;
mod amx_products;
mod arithmetic;
mod backend;
mod backward;
mod backward_bf16;
mod bf16_rows;
mod forward;
mod forward_bf16;
mod forward_f32;
mod matmul;
mod products;
pub(crate) mod reuse;
mod score;
pub(crate) mod simd;
mod split;
pub(crate) mod tiles;

use std::sync::atomic::AtomicU64;

pub use arithmetic::{Arithmetic, MatrixUnit};
pub use backend::CpuBackend;
pub use reuse::{kept_bytes, release_kept_buffers};
pub use tiles::TileConfig;

use crate::attention::visibility;
/// The results of an attention call (they live in [`crate::attention`]; named here too).
pub use crate::attention::{ForwardOutput, Gradients};

use half::bf16;

use crate::params::Visibility;
use crate::tensor::TensorData;
use crate::{AttentionParams, Dims, Positions, Result, Tensor};

/// Knobs of the CPU implementation. `Default` is what the crate's own calls use.
#[derive(Debug, Clone, Default)]
pub struct CpuConfig<'a> {
    /// Tile sizes.
    pub tiles: TileConfig,
    /// Arithmetic of the products (bf16 products for bf16 inputs where the processor has them).
    pub arithmetic: Arithmetic,
    /// The unit of the bf16 products (AMX tiles where the processor has them, by default).
    pub matrix_unit: MatrixUnit,
    /// When set, incremented as work completes: by query rows × heads in the forward,
    /// by key rows × kv heads in the backward (for progress bars).
    pub progress: Option<&'a AtomicU64>,
}

/// Single-device forward: `o = softmax(scale · q kᵀ + mask) v` per head, with
/// `pos_q(i) = i + s_k − s_q` and `pos_k(j) = j`.
///
/// # Errors
/// [`Error::Rank`](crate::Error::Rank), [`Error::ShapeMismatch`](crate::Error::ShapeMismatch), [`Error::HeadRatio`](crate::Error::HeadRatio), [`Error::ZeroHeads`](crate::Error::ZeroHeads),
/// [`Error::HeadDim`](crate::Error::HeadDim), [`Error::DtypeMismatch`](crate::Error::DtypeMismatch), [`Error::Scale`](crate::Error::Scale), [`Error::Documents`](crate::Error::Documents).
///
/// ```
/// use ringattn::{cpu, AttentionParams, Mask, Tensor};
/// let q = Tensor::from_f32(vec![1, 3, 1, 2], vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0])?;
/// let out = cpu::forward(&q, &q, &q, &AttentionParams { mask: Mask::Causal, ..Default::default() })?;
/// // The first query sees only the first key: its output is that key's value.
/// assert_eq!(&out.o.to_f32_vec()[..2], &[1.0, 0.0]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttentionParams) -> Result<ForwardOutput> {
    forward_with(q, k, v, None, params, &CpuConfig::default())
}

/// Forward of a block of queries against a block of keys at arbitrary global positions: the
/// attention of those queries over those keys alone (the step of a ring hop, for plain
/// parameters). `q_pos.len()` must be `s_q`, `k_pos.len()` must be `s_k`. With
/// [`AttentionParams::sinks`] the result is final (the sinks merged into it), not a hop's
/// partial: a caller composing hops passes parameters without sinks and merges them once at
/// the end ([`crate::merge::merge_sinks`]), as the plan's finish step does.
///
/// # Errors
/// As [`forward`], plus [`Error::Positions`](crate::Error::Positions).
///
/// ```
/// use ringattn::{cpu, AttentionParams, Mask, Positions, Tensor};
/// // Queries at positions 4..6 attend causally to keys at positions 0..2: all visible.
/// let q = Tensor::from_f32(vec![1, 2, 1, 1], vec![1.0, 2.0])?;
/// let k = Tensor::from_f32(vec![1, 2, 1, 1], vec![0.5, -0.5])?;
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let out = cpu::forward_at(&q, &k, &k, &Positions::contiguous(4, 2), &Positions::contiguous(0, 2), &p)?;
/// assert!(out.lse.to_f32_vec().iter().all(|x| x.is_finite()));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn forward_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    forward_with(q, k, v, Some((q_pos, k_pos)), params, &CpuConfig::default())
}

/// [`forward`] or [`forward_at`] (when `positions` is given) with explicit configuration.
///
/// # Errors
/// As [`forward_at`].
pub fn forward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    config: &CpuConfig,
) -> Result<ForwardOutput> {
    let dims = Dims::of(q, k, v)?;
    let vis = visibility(&dims, positions, params)?;
    params.check_heads(dims.h_q)?;
    let arithmetic = config.arithmetic.resolve(q.dtype())?;
    // (With sinks, `o` is rounded after they merge: the f32 paths below.)
    if let (Arithmetic::Bf16, Some([qb, kb, vb]), true) = (arithmetic, finite_bf16([q, k, v]), params.sinks.is_some()) {
        let (mut o, mut lse) = forward_bf16::forward::<f32>(
            config.matrix_unit,
            &forward_bf16::ForwardInputs {
                dims,
                q: qb,
                k: kb,
                v: vb,
                vis: &vis,
                spec: crate::attention::ScoreSpec::of(params, &dims),
                tiles: config.tiles,
                progress: config.progress,
            },
        );
        crate::merge::finish_with_sinks(params, &dims, &mut o, &mut lse)?;
        return Ok(ForwardOutput {
            o: Tensor::from_f32_owned(dims.o_shape(), o, q.dtype())?,
            lse: Tensor::from_f32(dims.lse_shape(), lse)?,
        });
    }
    if let (Arithmetic::Bf16, Some([q, k, v])) = (arithmetic, finite_bf16([q, k, v])) {
        let (o, lse) = forward_bf16::forward::<bf16>(
            config.matrix_unit,
            &forward_bf16::ForwardInputs {
                dims,
                q,
                k,
                v,
                vis: &vis,
                spec: crate::attention::ScoreSpec::of(params, &dims),
                tiles: config.tiles,
                progress: config.progress,
            },
        );
        return Ok(ForwardOutput {
            o: Tensor::new(dims.o_shape(), TensorData::BF16(o))?,
            lse: Tensor::from_f32(dims.lse_shape(), lse)?,
        });
    }
    let (qf, kf, vf) = (q.as_f32(), k.as_f32(), v.as_f32());
    let inputs = forward::ForwardInputs {
        dims,
        q: &qf,
        k: &kf,
        v: &vf,
        vis: &vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        tiles: config.tiles,
        progress: config.progress,
    };
    let (mut o, mut lse) = forward_f32_on(&inputs, config.matrix_unit);
    crate::merge::finish_with_sinks(params, &dims, &mut o, &mut lse)?;
    Ok(ForwardOutput {
        o: Tensor::from_f32_owned(dims.o_shape(), o, q.dtype())?,
        lse: Tensor::from_f32(dims.lse_shape(), lse)?,
    })
}

/// Single-device backward: `dq`, `dk`, `dv` from the forward's `o` and `lse` and the output
/// gradient `d_o` (shape of q), recomputing the probabilities tile by tile.
///
/// # Errors
/// As [`forward`], plus shape or dtype errors for `o`, `lse` (f32 `[b, h_q, s_q]`) and `d_o`.
///
/// ```
/// use ringattn::{cpu, AttentionParams, Tensor};
/// let x = Tensor::from_f32(vec![1, 2, 1, 1], vec![0.3, -0.7])?;
/// let p = AttentionParams::default();
/// let f = cpu::forward(&x, &x, &x, &p)?;
/// let g = cpu::backward(&x, &x, &x, &f.o, &f.lse, &x, &p)?;
/// assert_eq!(g.dk.shape(), &[1, 2, 1, 1]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    params: &AttentionParams,
) -> Result<Gradients> {
    backward_with(q, k, v, o, lse, d_o, None, params, &CpuConfig::default())
}

/// Backward of a block call at global positions (see [`forward_at`]).
///
/// # Errors
/// As [`backward`] and [`forward_at`].
#[allow(clippy::too_many_arguments)]
pub fn backward_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<Gradients> {
    backward_with(q, k, v, o, lse, d_o, Some((q_pos, k_pos)), params, &CpuConfig::default())
}

/// [`backward`] or [`backward_at`] with explicit configuration.
///
/// # Errors
/// As [`backward_at`].
#[allow(clippy::too_many_arguments)]
pub fn backward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    config: &CpuConfig,
) -> Result<Gradients> {
    let dims = Dims::of(q, k, v)?;
    dims.expect_backward_inputs(q, o, lse, d_o)?;
    params.check_heads(dims.h_q)?;
    let vis = visibility(&dims, positions, params)?;
    let arithmetic = config.arithmetic.resolve(q.dtype())?;
    if let (Arithmetic::Bf16, Some([qb, kb, vb, dob])) = (arithmetic, finite_bf16([q, k, v, d_o])) {
        let lf = lse.as_f32();
        let delta = match o.data() {
            TensorData::BF16(ob) => backward::rowsum_do_o(dims, ob, dob),
            _ => backward::rowsum_do_o(dims, &o.as_f32(), &d_o.as_f32()),
        };
        let (dq, dk, dv) = backward_bf16::backward::<bf16>(
            config.matrix_unit,
            &backward_bf16::BackwardInputs {
                dims,
                q: qb,
                k: kb,
                v: vb,
                d_o: dob,
                lse: &lf,
                delta: &delta,
                vis: &vis,
                spec: crate::attention::ScoreSpec::of(params, &dims),
                tiles: config.tiles,
                progress: config.progress,
            },
        );
        return Ok(Gradients {
            dq: Tensor::new(dims.q_shape(), TensorData::BF16(dq))?,
            dk: Tensor::new(dims.k_shape(), TensorData::BF16(dk))?,
            dv: Tensor::new(dims.v_shape(), TensorData::BF16(dv))?,
            dsinks: crate::merge::sinks_grad_of(params, &dims, o, lse, d_o)?,
        });
    }
    let (qf, kf, vf, of, lf, df) = (q.as_f32(), k.as_f32(), v.as_f32(), o.as_f32(), lse.as_f32(), d_o.as_f32());
    let (dq, dk, dv) = backward::backward(&backward::BackwardInputs {
        dims,
        q: &qf,
        k: &kf,
        v: &vf,
        o: &of,
        lse: &lf,
        d_o: &df,
        delta: None,
        vis: &vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        tiles: config.tiles,
        progress: config.progress,
    });
    Ok(Gradients {
        dq: Tensor::from_f32_owned(dims.q_shape(), dq, q.dtype())?,
        dk: Tensor::from_f32_owned(dims.k_shape(), dk, q.dtype())?,
        dv: Tensor::from_f32_owned(dims.v_shape(), dv, q.dtype())?,
        dsinks: crate::merge::sinks_grad_of(params, &dims, o, lse, d_o)?,
    })
}

/// Forward of a block on f32 buffers, returning f32 `(o, lse)` without rounding: the local
/// step of the sequence-parallel drivers (on AMX tiles where `unit` resolves to them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_f32(
    dims: Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    vis: &Visibility,
    params: &AttentionParams,
    tiles: TileConfig,
    unit: MatrixUnit,
) -> (Vec<f32>, Vec<f32>) {
    let inputs = forward::ForwardInputs {
        dims,
        q,
        k,
        v,
        vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        tiles,
        progress: None,
    };
    forward_f32_on(&inputs, unit)
}

/// The f32 forward: on AMX tiles where `unit` resolves to them (the processor has AMX-BF16
/// and Linux grants the tiles) and every input splits into three bf16 parts
/// ([`forward_bf16::forward_split`]: f32 accuracy), on the f32 products otherwise.
fn forward_f32_on(x: &forward::ForwardInputs, unit: MatrixUnit) -> (Vec<f32>, Vec<f32>) {
    if let (amx_products::Unit::Tiles(engine), true) = (unit.unit(), products::bf16_available()) {
        if let Some(out) = forward_bf16::forward_split(x, engine) {
            return out;
        }
    }
    forward::forward(x)
}

/// [`forward_f32`] on bf16 buffers with bf16 products (finite inputs, a processor with
/// AVX512_BF16: the caller checks both), on `unit`'s products.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_bf16(
    dims: Dims,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    vis: &Visibility,
    params: &AttentionParams,
    tiles: TileConfig,
    unit: MatrixUnit,
) -> (Vec<f32>, Vec<f32>) {
    forward_bf16::forward(
        unit,
        &forward_bf16::ForwardInputs {
            dims,
            q,
            k,
            v,
            vis,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            tiles,
            progress: None,
        },
    )
}

/// [`backward_f32`] on bf16 buffers with bf16 products, given the (global) `lse` and
/// `D = rowsum(dO∘O)` (as [`forward_bf16`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_bf16(
    dims: Dims,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    lse: &[f32],
    d_o: &[bf16],
    delta: &[f32],
    vis: &Visibility,
    params: &AttentionParams,
    tiles: TileConfig,
    unit: MatrixUnit,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    backward_bf16::backward(
        unit,
        &backward_bf16::BackwardInputs {
            dims,
            q,
            k,
            v,
            d_o,
            lse,
            delta,
            vis,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            tiles,
            progress: None,
        },
    )
}

/// Backward of a block on f32 buffers given the (global) `o`, `lse` and, when known, `D =
/// rowsum(dO∘O)` (`[b, h_q, s_q]`); returns f32 `(dq, dk, dv)` without rounding.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_f32(
    dims: Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    delta: Option<&[f32]>,
    vis: &Visibility,
    params: &AttentionParams,
    tiles: TileConfig,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    backward::backward(&backward::BackwardInputs {
        dims,
        q,
        k,
        v,
        o,
        lse,
        d_o,
        delta,
        vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        tiles,
        progress: None,
    })
}

/// `D = rowsum(dO ∘ O)`, `[b, h_q, s_q]`, from `[b, s_q, h_q, d]` buffers.
pub(crate) fn softmax_grad_rowsum<T: Copy + Sync + Into<f32>>(dims: Dims, o: &[T], d_o: &[T]) -> Vec<f32> {
    backward::rowsum_do_o(dims, o, d_o)
}

/// Whether every value of `x` is finite (the bf16 products' domain): in parallel chunks of
/// 64 Ki values, as the work it guards runs (one thread reading a call's inputs alone cost an
/// eighth of a two-thread causal forward at s = 4096).
pub(crate) fn bf16_finite(x: &[bf16]) -> bool {
    use rayon::prelude::*;
    x.par_chunks(1 << 16).all(bf16_rows::all_finite)
}

/// The bf16 data of `tensors` when every one is bf16 and finite (the bf16 products' domain).
fn finite_bf16<const N: usize>(tensors: [&Tensor; N]) -> Option<[&[bf16]; N]> {
    let mut out = [&[][..]; N];
    for (o, t) in out.iter_mut().zip(tensors) {
        match t.data() {
            TensorData::BF16(v) if bf16_finite(v) => *o = v,
            _ => return None,
        }
    }
    Some(out)
}
