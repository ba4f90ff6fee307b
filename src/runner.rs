//! The host side of the `cuda/` kernels, shared by the executors that run them (the host
//! emulator, [`crate::emu`], and a GPU, `crate::cuda`): jobs in the kernels' form (16-bit
//! inputs, f32 statistics, resolved visibility), the checks of what the kernels take, and —
//! written once over any [`Executor`] — the tensor-level entry points and the steps of the
//! [`crate::parallel::Backend`] seam.

use std::borrow::Cow;

use half::{bf16, f16};

use crate::attention::{ForwardOutput, Gradients};
use crate::kernels::geometry::{self, DqMode};
use crate::params::Visibility;
use crate::{AttentionParams, DType, Dims, Error, HostBuf, HostData, Positions, Result, Tensor, TensorData};

/// One forward as the kernels take it: q `[b, s_q, h_q, d]`, k and v `[b, s_k, h_kv, d]` as
/// 16-bit patterns of `dtype`, the visibility of their rows.
#[derive(Clone, Copy)]
pub(crate) struct ForwardJob<'a> {
    pub dims: Dims,
    pub dtype: DType,
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub vis: &'a Visibility,
    pub spec: crate::attention::ScoreSpec,
    /// Let the kernel round `o` to `dtype` (it is then exactly representable in `dtype`).
    pub round_o: bool,
}

/// One backward: the forward's inputs, its f32 `o` and `lse`, the 16-bit `d_o`.
#[derive(Clone, Copy)]
pub(crate) struct BackwardJob<'a> {
    pub fwd: ForwardJob<'a>,
    pub o: &'a [f32],
    pub lse: &'a [f32],
    pub d_o: &'a [u16],
    /// `rowsum(dO∘O)` when known; computed by the rowsum kernel otherwise.
    pub delta: Option<&'a [f32]>,
    pub dq_mode: DqMode,
}

/// Something that runs the kernels of `cuda/` on host buffers (uploading and downloading as
/// it needs): f32 results, unrounded unless a job asks otherwise.
pub(crate) trait Executor: Sync {
    /// Name in errors (`emu`, `cuda`).
    const NAME: &'static str;
    /// Forward: `(o, lse)`.
    fn forward(&self, x: &ForwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>)>;
    /// Backward: `(dq, dk, dv)`.
    fn backward(&self, x: &BackwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>;
    /// `rowsum(dO∘O)` `[b, h_q, s_q]` from f32 `o` and 16-bit `d_o`.
    fn rowsum(&self, dims: &Dims, dtype: DType, o: &[f32], d_o: &[u16]) -> Result<Vec<f32>>;
}

/// What the kernels take: bf16 or f16 inputs (f32 is refused rather than converted, which
/// would silently change the precision asked for) and head dims that are multiples of 8 up
/// to 256.
///
/// # Errors
/// [`Error::BackendUnsupported`] naming the value and `backend`.
pub(crate) fn check_supported(backend: &'static str, dims: &Dims, dtype: DType) -> Result<()> {
    if dtype == DType::F32 {
        return Err(Error::BackendUnsupported {
            backend,
            what: "f32 inputs (the kernels take bf16 or f16; convert the inputs, or use the cpu backend)".into(),
        });
    }
    geometry::check_head_dims(backend, dims)
}

/// Values as the 16-bit patterns of `dtype` (bf16 or f16), rounding to nearest even: the
/// element type of the kernels' q, k, v and `d_o`.
///
/// ```
/// # #[cfg(feature = "cuda")] {
/// use ringattn::{cuda::to_bits, DType};
/// assert_eq!(to_bits(&[1.0, -2.0], DType::BF16), vec![0x3f80, 0xc000]);
/// assert_eq!(to_bits(&[1.0], DType::F16), vec![0x3c00]);
/// # }
/// ```
pub fn to_bits(x: &[f32], dtype: DType) -> Vec<u16> {
    match dtype {
        DType::F16 => x.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
        _ => x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
    }
}

/// The 16-bit patterns of a tensor (borrowed when it holds bf16 or f16).
pub(crate) fn tensor_bits(t: &Tensor) -> Cow<'_, [u16]> {
    match t.data() {
        TensorData::BF16(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        TensorData::F16(v) => Cow::Borrowed(bytemuck::cast_slice(v)),
        TensorData::F32(v) => Cow::Owned(to_bits(v, t.dtype())),
    }
}

/// One side's granule bounds: min and max position per granule, and per granule min and max
/// document with documents (`kernels::params::granule_bounds`).
pub(crate) type SideBounds = (Vec<i64>, Option<Vec<u32>>);

/// The granule bounds the kernels classify tiles with (MaskParams `k_bounds`, `k_doc_bounds`,
/// `q_bounds`, `q_doc_bounds`): both sides' or none — `None` when a side has no rows.
pub(crate) struct MaskBounds {
    pub keys: SideBounds,
    pub queries: SideBounds,
}

impl MaskBounds {
    pub(crate) fn of(vis: &Visibility) -> Option<MaskBounds> {
        use crate::kernels::params::granule_bounds;
        if vis.k_pos.is_empty() || vis.q_pos.is_empty() {
            return None;
        }
        Some(MaskBounds {
            keys: granule_bounds(&vis.k_pos, vis.k_doc.as_deref()),
            queries: granule_bounds(&vis.q_pos, vis.q_doc.as_deref()),
        })
    }
}

/// The tensor-level forward of `cpu::forward` / `cpu::forward_at` on executor `e`.
pub(crate) fn forward_tensors<E: Executor>(
    e: &E,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    let dims = Dims::of(q, k, v)?;
    check_supported(E::NAME, &dims, q.dtype())?;
    params.check_heads(dims.h_q)?;
    let vis = crate::attention::visibility(&dims, positions, params)?;
    let (qb, kb, vb) = (tensor_bits(q), tensor_bits(k), tensor_bits(v));
    let x = ForwardJob {
        dims,
        dtype: q.dtype(),
        q: &qb,
        k: &kb,
        v: &vb,
        vis: &vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        // (With sinks, `o` is rounded after they merge.)
        round_o: params.sinks.is_none(),
    };
    let (mut o, mut lse) = e.forward(&x)?;
    crate::merge::finish_with_sinks(params, &dims, &mut o, &mut lse)?;
    Ok(ForwardOutput {
        o: Tensor::from_f32_owned(dims.o_shape(), o, q.dtype())?,
        lse: Tensor::from_f32(dims.lse_shape(), lse)?,
    })
}

/// The tensor-level backward of `cpu::backward` / `cpu::backward_at` on executor `e`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_tensors<E: Executor>(
    e: &E,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    dq_mode: DqMode,
) -> Result<Gradients> {
    let dims = Dims::of(q, k, v)?;
    check_supported(E::NAME, &dims, q.dtype())?;
    dims.expect_backward_inputs(q, o, lse, d_o)?;
    params.check_heads(dims.h_q)?;
    let vis = crate::attention::visibility(&dims, positions, params)?;
    let (qb, kb, vb, dob) = (tensor_bits(q), tensor_bits(k), tensor_bits(v), tensor_bits(d_o));
    let (of, lf) = (o.as_f32(), lse.as_f32());
    let x = BackwardJob {
        fwd: ForwardJob {
            dims,
            dtype: q.dtype(),
            q: &qb,
            k: &kb,
            v: &vb,
            vis: &vis,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            round_o: false,
        },
        o: &of,
        lse: &lf,
        d_o: &dob,
        delta: None,
        dq_mode,
    };
    let (dq, dk, dv) = e.backward(&x)?;
    Ok(Gradients {
        dq: Tensor::from_f32_owned(dims.q_shape(), dq, q.dtype())?,
        dk: Tensor::from_f32_owned(dims.k_shape(), dk, q.dtype())?,
        dv: Tensor::from_f32_owned(dims.v_shape(), dv, q.dtype())?,
        dsinks: crate::merge::sinks_grad_of(params, &dims, o, lse, d_o)?,
    })
}

/// `Backend::supports` of a kernel backend for inputs of `dtype` (its own is `own`). Both
/// kernel families honour every score option of [`crate::attention::ScoreSpec`]
/// (`cuda/score.cuh`).
///
/// # Errors
/// As [`check_supported`]; [`Error::DtypeMismatch`] when `dtype` is not `own`.
pub(crate) fn supports(backend: &'static str, own: DType, dims: &Dims, dtype: DType) -> Result<()> {
    check_supported(backend, dims, dtype)?;
    if dtype != own {
        return Err(Error::DtypeMismatch {
            name: "q".into(),
            got: dtype.to_string(),
            expected: format!("{own} (the dtype of the {backend} backend)"),
        });
    }
    Ok(())
}

/// The 16-bit patterns of `dtype` of a host buffer: borrowed when it holds `dtype`,
/// rounded from any other element type.
///
/// # Errors
/// [`Error::InvalidArgument`] for bytes.
fn buf_bits(x: &HostBuf, dtype: DType) -> Result<Cow<'_, [u16]>> {
    Ok(match (x.data(), dtype) {
        (HostData::BF16(v), DType::BF16) => Cow::Borrowed(bytemuck::cast_slice(v)),
        (HostData::F16(v), DType::F16) => Cow::Borrowed(bytemuck::cast_slice(v)),
        _ => Cow::Owned(to_bits(&x.to_f32()?, dtype)),
    })
}

/// `Backend::forward_block` of a kernel backend: host buffers holding `dtype` values (read
/// in place when they are `dtype`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_block<E: Executor>(
    e: &E,
    dtype: DType,
    dims: Dims,
    q: &HostBuf,
    k: &HostBuf,
    v: &HostBuf,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<(HostBuf, HostBuf)> {
    let vis = crate::attention::block_visibility(&dims, q_pos, k_pos, params)?;
    let (qb, kb, vb) = (buf_bits(q, dtype)?, buf_bits(k, dtype)?, buf_bits(v, dtype)?);
    let (o, lse) = e.forward(&ForwardJob {
        dims,
        dtype,
        q: &qb,
        k: &kb,
        v: &vb,
        vis: &vis,
        spec: crate::attention::ScoreSpec::of(params, &dims),
        round_o: false,
    })?;
    Ok((o.into(), lse.into()))
}

/// The buffers of one `Backend::backward_block` step (host buffers holding `dtype` values,
/// except the f32 statistics).
pub(crate) struct BlockBackward<'a> {
    pub dims: Dims,
    pub q: &'a HostBuf,
    pub k: &'a HostBuf,
    pub v: &'a HostBuf,
    pub o: &'a HostBuf,
    pub lse: &'a HostBuf,
    pub d_o: &'a HostBuf,
    pub delta: &'a HostBuf,
    pub q_pos: &'a Positions,
    pub k_pos: &'a Positions,
    pub params: &'a AttentionParams,
}

/// `Backend::backward_block` of a kernel backend.
pub(crate) fn backward_block<E: Executor>(
    e: &E,
    dtype: DType,
    dq_mode: DqMode,
    x: &BlockBackward<'_>,
) -> Result<(HostBuf, HostBuf, HostBuf)> {
    let dims = x.dims;
    let vis = crate::attention::block_visibility(&dims, x.q_pos, x.k_pos, x.params)?;
    let (qb, kb, vb) = (buf_bits(x.q, dtype)?, buf_bits(x.k, dtype)?, buf_bits(x.v, dtype)?);
    let (dob, o) = (buf_bits(x.d_o, dtype)?, x.o.to_f32()?);
    let (dq, dk, dv) = e.backward(&BackwardJob {
        fwd: ForwardJob {
            dims,
            dtype,
            q: &qb,
            k: &kb,
            v: &vb,
            vis: &vis,
            spec: crate::attention::ScoreSpec::of(x.params, &dims),
            round_o: false,
        },
        o: &o,
        lse: x.lse.f32s()?,
        d_o: &dob,
        delta: Some(x.delta.f32s()?),
        dq_mode,
    })?;
    Ok((dq.into(), dk.into(), dv.into()))
}

/// `Backend::softmax_grad_rowsum` of a kernel backend.
pub(crate) fn rowsum_block<E: Executor>(
    e: &E,
    dtype: DType,
    dims: Dims,
    o: &HostBuf,
    d_o: &HostBuf,
) -> Result<HostBuf> {
    Ok(e.rowsum(&dims, dtype, &o.to_f32()?, &buf_bits(d_o, dtype)?)?.into())
}
