//! candle integration (feature `candle`). A training loop holds a [`ContextParallel`] per
//! rank (`use ringattn::candle::prelude::*`): shards and position ids by the layout, the
//! attention with autograd planned from the tensors, the group's sums and the replica check,
//! every misuse refused on every rank. [`Checkpoint`] recomputes blocks in the backward.
//! Below it: [`ring_attention`] on a plan made by hand, and the helpers around it — shards of
//! token, target and position tensors by a resolved layout ([`shard`], [`unshard`]), the sum of
//! replicated parameters' gradients over the group ([`all_reduce_gradients`]), and rank threads
//! that own their communicator ([`crate::comm::spmd_shared`]). Errors are the crate's
//! [`Error`] inside candle's ([`find_error`]).
//!
//! Tensors are candle's `[b, s, h, d]` (the crate's layout), this rank's tokens at the plan's
//! positions. Storage ([`CandleBuf`]): CPU tensors (f32, bf16, f16) on a plan over a host
//! backend (CPU, emulated kernels); CUDA tensors (bf16, f16) on a plan over
//! `cuda::DeviceBackend` with the `cuda` feature (which turns on candle-core's `cuda`): the
//! inputs copied device to device on candle's stream into the plan's typed device buffers,
//! the ring/Ulysses steps and their communication on the device, the output and gradients
//! copied into candle's storage — no host round trip.
//!
//! Each call records its own operation in candle's graph, which keeps that call's saved
//! context (o, LSE, inputs) until the graph is dropped: any number of layers, repeated calls
//! in a step, and a layer's forward recomputed inside the backward (gradient checkpointing)
//! each find their own. The backward is collective like the forward: every rank runs
//! `backward()` on graphs of the same shape (candle visits the operations in the same order).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType as CDType, Device, Layout, Shape, Tensor, Var};

use crate::comm::{add_host, Communicator};
use crate::parallel::{Backend, ParallelPlan, ResolvedParams, SavedForward};
use crate::{DType, Error, HostBuf};

mod checkpoint;
#[cfg(feature = "cuda")]
mod cuda;
mod group;
mod storage;
mod threads;

pub use checkpoint::Checkpoint;
pub use group::{ContextParallel, GroupOptions};
pub use storage::CandleBuf;
pub(crate) use threads::share_cores_among_rank_threads;

/// What a candle training loop uses, with no name that clashes with candle's (`DType`,
/// `Layout`, `Tensor` stay candle's): `use ringattn::candle::prelude::*;`.
pub mod prelude {
    pub use super::{find_error, Checkpoint, ContextParallel, GroupOptions};
    pub use crate::comm::{spmd_owned, spmd_shared, Communicator, LocalOptions};
    pub use crate::parallel::{CpuBackend, ParallelParams, Strategy};
    pub use crate::{AttentionParams, Layout as SeqLayout, Mask};
}
use storage::{buf_tensor, tensor_buf};

/// A `'static` plan, as [`ring_attention`] takes it ([`ParallelPlan::new_shared`] in an
/// `Arc`).
pub type SharedPlan<Be> = Arc<ParallelPlan<'static, Be>>;

/// The crate's error inside candle's, downcastable ([`find_error`], `ringattn::Error::from`),
/// with no backtrace text.
fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::WrappedContext { wrapped: Box::new(e), context: "ringattn".into() }
}

/// An invalid argument as candle's error (a wrapped [`Error::InvalidArgument`]).
fn msg(m: String) -> candle_core::Error {
    wrap(Error::InvalidArgument(m.trim_start_matches("ringattn: ").to_string()))
}

/// The crate's [`Error`] that a candle error carries, through candle's context, path and
/// backtrace layers; `None` for candle's own errors. `ringattn::Error::from(e)` takes it by
/// value.
///
/// ```
/// use ringattn::candle::find_error;
/// let e = ringattn::candle::all_reduce_sum(
///     &ringattn::comm::LocalComm::<ringattn::HostBuf>::group(1, Default::default())[0],
///     &ringattn::comm::add_host,
///     &candle_core::Tensor::new(&[1u32], &candle_core::Device::Cpu).unwrap(),
/// )
/// .unwrap_err();
/// assert!(matches!(find_error(&e), Some(ringattn::Error::InvalidArgument(_))));
/// ```
pub fn find_error(e: &candle_core::Error) -> Option<&Error> {
    use candle_core::Error as C;
    match e {
        C::WithBacktrace { inner, .. } | C::WithPath { inner, .. } | C::Context { inner, .. } => find_error(inner),
        C::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<Error>(),
        _ => None,
    }
}

/// The crate's dtype of a candle dtype.
fn dtype_of(d: CDType) -> candle_core::Result<DType> {
    match d {
        CDType::F32 => Ok(DType::F32),
        CDType::BF16 => Ok(DType::BF16),
        CDType::F16 => Ok(DType::F16),
        other => Err(wrap(Error::UnsupportedDtype(format!("{other:?}")))),
    }
}

/// One call's operation in candle's graph: the plan, and the context its forward saved for
/// its backward.
struct RingAttention<Be: Backend + 'static> {
    plan: SharedPlan<Be>,
    /// Shared, not cloned, by the backward (a second backward of the same graph finds it too)
    /// and by the call's [`SinkGradient`], when it has sinks.
    saved: Saved<Be::Buf>,
    /// The call's attention sinks (`[h_q]` f32), when given ([`ring_attention_with_sinks`]).
    sinks: Option<Be::Buf>,
}

/// A call's saved forward context, shared between its operations.
type Saved<B> = Arc<Mutex<Option<Arc<SavedForward<B>>>>>;

/// The sinks' side of a call with attention sinks ([`ring_attention_with_sinks`]): `o' =
/// op(o, sinks)` is `o` itself in the forward (the sinks merged into it already); its
/// backward hands `d_o` on to the attention unchanged and gives the sinks their gradient from
/// the attention's saved context ([`ParallelPlan::sinks_gradient`]). With the sinks held
/// fixed inside the attention's own backward, the two gradients are the call's.
struct SinkGradient<Be: Backend + 'static> {
    plan: SharedPlan<Be>,
    saved: Saved<Be::Buf>,
}

impl<Be> CustomOp2 for SinkGradient<Be>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    fn name(&self) -> &'static str {
        "ringattn-attention-sinks"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((s1.try_clone(l1)?, l1.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((s1.try_clone(l1)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _o: &Tensor,
        sinks: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let saved = saved.ok_or_else(|| msg("ringattn: a backward without its forward".into()))?;
        let d_o: Be::Buf = tensor_buf(grad_res, self.plan.dtype())?;
        let ds = self.plan.sinks_gradient(&saved, &d_o).map_err(wrap)?;
        let ds = ds.ok_or_else(|| msg("ringattn: the call saved no sinks".into()))?;
        Ok((Some(grad_res.clone()), Some(buf_tensor(ds, sinks.shape(), sinks)?)))
    }
}

impl<Be> RingAttention<Be>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    fn forward(&self, q: Be::Buf, k: Be::Buf, v: Be::Buf) -> candle_core::Result<Be::Buf> {
        let (o, saved) = match &self.sinks {
            Some(s) => self.plan.forward_with_sinks(&q, &k, &v, s),
            None => self.plan.forward(&q, &k, &v),
        }
        .map_err(wrap)?;
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(saved));
        Ok(o)
    }
}

impl<Be> CustomOp3 for RingAttention<Be>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    fn name(&self) -> &'static str {
        "ringattn-ring-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let b = |s, l| <Be::Buf as CandleBuf>::from_cpu(s, l);
        let o = self.forward(b(s1, l1)?, b(s2, l2)?, b(s3, l3)?)?;
        Ok((o.into_cpu()?, o_shape(l1, l3)))
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let b = |s, l| <Be::Buf as CandleBuf>::from_cuda(s, l);
        let o = self.forward(b(s1, l1)?, b(s2, l2)?, b(s3, l3)?)?;
        Ok((o.into_cuda(s1)?, o_shape(l1, l3)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let saved = saved.ok_or_else(|| msg("ringattn: a backward without its forward".into()))?;
        let d_o: Be::Buf = tensor_buf(grad_res, self.plan.dtype())?;
        // (With sinks, their gradient is the SinkGradient operation's.)
        let g = self.plan.backward_as(&saved, &d_o, crate::parallel::SinksGradient::Skip).map_err(wrap)?;
        let t = |b, like: &Tensor| buf_tensor(b, like.shape(), like).map(Some);
        Ok((t(g.dq, q)?, t(g.dk, k)?, t(g.dv, v)?))
    }
}

/// The output's shape: q's `[b, n, h_q]` with v's head dim.
fn o_shape(q: &Layout, v: &Layout) -> Shape {
    let mut dims = q.shape().dims().to_vec();
    if let (Some(last), Some(&d_v)) = (dims.last_mut(), v.shape().dims().last()) {
        *last = d_v;
    }
    Shape::from(dims)
}

/// Exact attention of this rank's shard against the whole sequence, as a candle operation
/// with autograd: `q` `[b, n, h_q, d_qk]`, `k` `[b, n, h_kv, d_qk]` and `v` `[b, n, h_kv, d_v]`
/// (this rank's `n` tokens, at the plan's positions), in the plan's dtype, on the plan's kind
/// of device (CPU tensors for a host backend, CUDA tensors for `cuda::DeviceBackend`); returns
/// `o` `[b, n, h_q, d_v]`
/// in that dtype on the same device. Collective over the plan's communicator, forward and backward (see the
/// module docs). Non-contiguous inputs are made contiguous first (differentiably).
///
/// Shapes are checked dimension by dimension against the plan's shard (a tensor in candle's
/// usual `[b, h, s, d]` attention layout is named as such, with the transpose that fixes
/// it); the tokens' positions are not visible here: [`ring_attention_at`] checks them too.
///
/// # Errors
/// candle errors, and wrapped [`Error`]s: a dtype other than the plan's, shapes other than
/// the planned shard ([`Error::ShapeMismatch`] naming both), tensors on another kind of device than the plan's buffers
/// ([`CandleBuf`]), communication errors.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, Tensor, Var};
/// use ringattn::comm::{spmd_shared, LocalOptions};
/// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
/// use ringattn::{AttentionParams, DType, Dims, Mask};
///
/// let (world, s) = (2, 32);
/// let params = ParallelParams { attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let resolved = params.resolve(world, 2, s)?;
/// let x = Tensor::randn(0f32, 1.0, (1, s, 2, 8), &Device::Cpu)?;
/// let results = spmd_shared(world, LocalOptions::default(), |comm| {
///     let mine = ringattn::candle::shard(&resolved, &x, 1, comm.rank())?;
///     let n = mine.dim(1)?;
///     let dims = Dims { b: 1, s_q: n, s_k: n, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
///     let plan = Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
///     let q = Var::from_tensor(&mine)?;
///     let o = ringattn::candle::ring_attention(&plan, q.as_tensor(), &mine, &mine)?;
///     let grads = o.sum_all()?.backward()?;
///     Ok(grads.get(q.as_tensor()).is_some())
/// });
/// assert!(results.into_iter().all(|r| r.ok() == Some(true)));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn ring_attention<Be>(plan: &SharedPlan<Be>, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    let (q, k, v) = checked_inputs(plan, q, k, v)?;
    q.apply_op3(&k, &v, RingAttention { plan: plan.clone(), saved: Saved::default(), sinks: None })
}

/// The checks of [`ring_attention`]'s inputs (devices, dtypes, shapes), then the inputs
/// contiguous.
fn checked_inputs<Be>(
    plan: &SharedPlan<Be>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<(Tensor, Tensor, Tensor)>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    for (name, t) in [("k", k), ("v", v)] {
        if !t.device().same_device(q.device()) {
            return Err(msg(format!("ringattn: `{name}` is on {:?}, `q` on {:?}", t.device(), q.device())));
        }
    }
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        let dt = dtype_of(t.dtype())?;
        if dt != plan.dtype() {
            return Err(wrap(Error::DtypeMismatch {
                name: name.into(),
                got: dt.to_string(),
                expected: format!("{} (the plan's)", plan.dtype()),
            }));
        }
    }
    let dims = plan.dims();
    check_shape("q", q, [dims.b, dims.s_q, dims.h_q, dims.d_qk])?;
    check_shape("k", k, [dims.b, dims.s_k, dims.h_kv, dims.d_qk])?;
    check_shape("v", v, [dims.b, dims.s_k, dims.h_kv, dims.d_v])?;
    Ok((q.contiguous()?, k.contiguous()?, v.contiguous()?))
}

/// [`ring_attention`] with learnable attention sinks: `sinks` `[h_q]` f32 (a `Var`, say),
/// on the inputs' device, merged once into every row's softmax denominator
/// ([`crate::AttentionParams::sinks`]); its gradient (over this rank's rows: the training
/// loop's all-reduce of replicated parameters sums it) flows to `sinks`. The plan must have
/// been built with sinks (any values: the call's replace them), so that every rank plans
/// them.
///
/// # Errors
/// As [`ring_attention`]; a wrapped [`Error::ShapeMismatch`] or [`Error::DtypeMismatch`] for
/// sinks that are not `[h_q]` f32, [`Error::Parallel`] for a plan without sinks.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType as CDType, Device, Tensor, Var};
/// use ringattn::comm::{spmd_shared, LocalOptions};
/// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
/// use ringattn::{AttentionParams, DType, Dims, Mask};
///
/// let attention = AttentionParams { mask: Mask::Causal, sinks: Some(vec![0.0; 2]), ..Default::default() };
/// let params = ParallelParams { attention, ..Default::default() };
/// let resolved = params.resolve(2, 2, 32)?;
/// let x = Tensor::randn(0f32, 1.0, (1, 32, 2, 8), &Device::Cpu)?;
/// let grads = spmd_shared(2, LocalOptions::default(), |comm| {
///     let mine = ringattn::candle::shard(&resolved, &x, 1, comm.rank())?;
///     let dims = Dims { b: 1, s_q: 16, s_k: 16, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
///     let plan = Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
///     let sinks = Var::from_tensor(&Tensor::new(&[1.0f32, -0.5], &Device::Cpu)?)?;
///     let o = ringattn::candle::ring_attention_with_sinks(&plan, &mine, &mine, &mine, sinks.as_tensor())?;
///     let grads = o.sum_all()?.backward()?;
///     Ok(grads.get(sinks.as_tensor()).map(|g| g.dims().to_vec()))
/// });
/// assert!(grads.into_iter().all(|g| g.ok().flatten() == Some(vec![2])));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn ring_attention_with_sinks<Be>(
    plan: &SharedPlan<Be>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
) -> candle_core::Result<Tensor>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    if !sinks.device().same_device(q.device()) {
        return Err(msg(format!("ringattn: `sinks` is on {:?}, `q` on {:?}", sinks.device(), q.device())));
    }
    if sinks.dtype() != CDType::F32 {
        return Err(wrap(Error::DtypeMismatch {
            name: "sinks".into(),
            got: format!("{:?}", sinks.dtype()),
            expected: "f32".into(),
        }));
    }
    if sinks.dims() != [plan.dims().h_q] {
        return Err(wrap(Error::ShapeMismatch(format!(
            "`sinks` has shape {:?}; the plan has {} query heads: [h_q]",
            sinks.dims(),
            plan.dims().h_q
        ))));
    }
    // The attention, then the sinks' operation, sharing the call's context.
    let (q, k, v) = checked_inputs(plan, q, k, v)?;
    let saved = Saved::default();
    let op = RingAttention { plan: plan.clone(), saved: saved.clone(), sinks: Some(tensor_buf(sinks, DType::F32)?) };
    let o = q.apply_op3(&k, &v, op)?;
    o.apply_op2(sinks, SinkGradient { plan: plan.clone(), saved })
}

/// [`ring_attention`] that also checks the global positions of this rank's tokens: `positions`
/// (`[n]`, any integer dtype, on any device) are the position ids the caller gave its shard
/// (the tensor a model needs anyway for rotary or learned positions), compared with the
/// plan's. Sharding that disagrees with the plan's layout — `narrow` (contiguous chunks) under
/// a zigzag plan, or a shard from parameters resolved otherwise than the plan's — has the
/// right shapes and the wrong tokens: this is where it is caught.
///
/// Collective: one small all-gather of every rank's verdict first
/// ([`ParallelPlan::check_positions`]), so that a disagreement on any rank fails the call on
/// every rank.
///
/// # Errors
/// As [`ring_attention`]; a wrapped [`Error::Positions`] naming the first token whose position
/// differs from the plan's (and the plan's layout) when they disagree (on the other ranks:
/// which ranks disagree), and a shape error when `positions` is not `[n]`.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, Tensor};
/// use ringattn::comm::{spmd_shared, LocalOptions};
/// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
/// use ringattn::{candle as rc, AttentionParams, DType, Dims, Mask};
/// let params = ParallelParams { attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let runs = spmd_shared(2, LocalOptions::default(), |comm| {
///     let rank = comm.rank();
///     let dims = Dims { b: 1, s_q: 8, s_k: 8, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
///     let plan = Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
///     let x = Tensor::ones((1, 16, 2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
///     let ids = Tensor::arange(0u32, 16, &Device::Cpu).unwrap();
///     // Right: shard the data and the position ids through the plan.
///     let (xs, pos) = (rc::shard_like(&plan, &x, 1).unwrap(), rc::shard_like(&plan, &ids, 0).unwrap());
///     assert!(rc::ring_attention_at(&plan, &xs, &xs, &xs, &pos).is_ok());
///     // Wrong: contiguous chunks under the (default, causal) zigzag layout.
///     let (xn, wrong) = (x.narrow(1, 8 * rank, 8).unwrap(), ids.narrow(0, 8 * rank, 8).unwrap());
///     Ok(rc::ring_attention_at(&plan, &xn, &xn, &xn, &wrong).map_err(|e| e.to_string()))
/// });
/// for r in runs {
///     let e = r.unwrap().unwrap_err();
///     assert!(e.contains("position"), "{e}");
/// }
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn ring_attention_at<Be>(
    plan: &SharedPlan<Be>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
) -> candle_core::Result<Tensor>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    // Every rank learns whether any rank's shard disagrees (ParallelPlan::check_positions:
    // one small all-gather), so that a mismatch fails the call on every rank, not on some
    // while the others wait in the ring.
    let ids = if positions.dims().len() == 1 { host_ids(positions)? } else { Vec::new() };
    let verdict = plan.check_positions(&ids);
    if positions.dims().len() != 1 {
        return Err(wrap(Error::ShapeMismatch(format!(
            "ringattn: positions of shape {:?}, this rank holds [{}] tokens",
            positions.dims(),
            plan.positions().len()
        ))));
    }
    verdict.map_err(wrap)?;
    ring_attention(plan, q, k, v)
}

/// The position ids of a `[n]` tensor (any integer dtype, on any device), on the host.
fn host_ids(positions: &Tensor) -> candle_core::Result<Vec<u64>> {
    let ids: Vec<i64> = positions.to_dtype(CDType::I64)?.to_device(&Device::Cpu)?.to_vec1()?;
    Ok(ids.into_iter().map(|x| x as u64).collect())
}

/// The shape check of [`ring_attention`]: `t` must be `want` (`[b, n, h, d]`); a tensor laid
/// out `[b, h, n, d]` (candle's usual attention layout) is named as such.
fn check_shape(name: &str, t: &Tensor, want: [usize; 4]) -> candle_core::Result<()> {
    let got = t.dims();
    if got == want {
        return Ok(());
    }
    let [b, n, h, d] = want;
    let hint = if got == [b, h, n, d] && h != n {
        "; it looks like [b, h, s, d]: transpose(1, 2) to [b, s, h, d]"
    } else {
        ""
    };
    Err(wrap(Error::ShapeMismatch(format!(
        "ringattn: `{name}` has shape {got:?}, the plan's shard is [b, s, h, d] = {want:?}{hint}"
    ))))
}

/// [`shard`] with the plan's own resolved parameters (the one source of this rank's tokens):
/// this rank's rows of a whole-sequence tensor along `dim`.
///
/// # Errors
/// As [`shard`].
pub fn shard_like<Be: Backend>(
    plan: &ParallelPlan<'static, Be>,
    t: &Tensor,
    dim: usize,
) -> candle_core::Result<Tensor> {
    shard(plan.resolved(), t, dim, plan.comm().rank())
}

/// The positions of `rank` as a candle index.
fn index(positions: &[u64]) -> candle_core::Result<Tensor> {
    let idx: Vec<u32> = positions
        .iter()
        .map(|&p| u32::try_from(p).map_err(|_| msg(format!("ringattn: position {p} beyond u32 indices"))))
        .collect::<candle_core::Result<_>>()?;
    let n = idx.len();
    Tensor::from_vec(idx, n, &Device::Cpu)
}

/// This rank's part of a whole-sequence tensor: the rows along dimension `dim` (the sequence
/// axis: 1 for `[b, s, …]` activations, tokens and targets, 0 for `[s]` position ids) at
/// the plan's positions of `rank`, in the plan's order. Differentiable (an index select).
///
/// # Errors
/// candle errors (a `dim` out of range, a sequence length other than the plan's).
pub fn shard(resolved: &ResolvedParams, t: &Tensor, dim: usize, rank: usize) -> candle_core::Result<Tensor> {
    let s = resolved.params().seq_len;
    if t.dim(dim)? != s {
        return Err(msg(format!("ringattn: dimension {dim} of {:?} is not the plan's {s} tokens", t.shape())));
    }
    let pos: Vec<u64> = resolved.positions(rank).iter().map(|p| p as u64).collect();
    t.contiguous()?.index_select(&index(&pos)?.to_device(t.device())?, dim)
}

/// The inverse of [`shard`]: every rank's part (indexed by rank) reassembled in token order
/// along `dim`.
///
/// # Errors
/// candle errors; a number of parts other than the plan's world size.
pub fn unshard(resolved: &ResolvedParams, parts: &[Tensor], dim: usize) -> candle_core::Result<Tensor> {
    if parts.len() != resolved.world() {
        return Err(msg(format!("ringattn: {} parts for a plan of {} ranks", parts.len(), resolved.world())));
    }
    let all = Tensor::cat(parts, dim)?;
    // Where each global position sits in the concatenation.
    let mut slot = vec![0u64; resolved.params().seq_len];
    let mut i = 0u64;
    for r in 0..resolved.world() {
        for p in resolved.positions(r).iter() {
            slot[p as usize] = i;
            i += 1;
        }
    }
    all.index_select(&index(&slot)?.to_device(all.device())?, dim)
}

/// Sums the gradients of `vars` (replicated parameters) over the group, in place in `grads`:
/// one all-reduce of all of them flattened in `vars` order (in f32, summed in a fixed order,
/// so every rank gets bit-identical gradients and the replicas stay identical). A var
/// without a gradient on this rank contributes zeros and gets the group's sum. Collective:
/// every rank passes the same vars in the same order. CPU tensors over a host communicator;
/// [`all_reduce_gradients_with`] for any buffer type (CUDA tensors over NCCL).
///
/// With the loss of each rank a sum over its own tokens divided by the whole sequence's
/// token count, the sum is the gradient of the whole sequence's mean loss.
///
/// # Errors
/// Communication errors (wrapped); candle errors.
pub fn all_reduce_gradients(
    comm: &dyn Communicator<Buf = HostBuf>,
    vars: &[Var],
    grads: &mut candle_core::backprop::GradStore,
) -> candle_core::Result<()> {
    all_reduce_gradients_with(comm, &add_host, vars, grads)
}

/// [`all_reduce_gradients`] over a communicator of any [`CandleBuf`] buffer type, adding
/// with `add` (a backend's [`crate::parallel::Buffers::add_into`]; communicators with a
/// native all-reduce, NCCL's, use their own): the gradients are flattened into one f32
/// tensor on their device, moved into one buffer, summed over the group and split back —
/// on the GPU for CUDA tensors with a device communicator, no host round trip.
///
/// # Errors
/// As [`all_reduce_gradients`]; vars on different devices.
pub fn all_reduce_gradients_with<B: CandleBuf>(
    comm: &dyn Communicator<Buf = B>,
    add: &crate::comm::AddFn<'_, B>,
    vars: &[Var],
    grads: &mut candle_core::backprop::GradStore,
) -> candle_core::Result<()> {
    let Some(first) = vars.first() else { return Ok(()) };
    let device = first.device().clone();
    let mut parts = Vec::with_capacity(vars.len());
    for v in vars {
        parts.push(match grads.get(v.as_tensor()) {
            Some(g) => g.to_dtype(CDType::F32)?.flatten_all()?,
            None => Tensor::zeros(v.elem_count(), CDType::F32, &device)?,
        });
    }
    let sum = all_reduce_sum(comm, add, &Tensor::cat(&parts, 0)?)?;
    let mut off = 0;
    for v in vars {
        let n = v.elem_count();
        let g = sum.narrow(0, off, n)?.reshape(v.shape())?.to_dtype(v.dtype())?;
        grads.insert(v.as_tensor(), g);
        off += n;
    }
    Ok(())
}

/// Whether every rank's `vars` are bit-identical — data-parallel replicas after the same
/// steps, as context parallelism leaves them when every step's gradients are summed over the
/// group ([`all_reduce_gradients`]): each rank hashes its own values (FNV-1a over the f32
/// bits, in order), and the group sums each hash byte `x` and `x²` (exact integers in f32),
/// so that `world·Σx² = (Σx)²` holds for every byte only when all ranks agree. Collective over
/// `comm` (one all-reduce of 16 values on the vars' device); `add` as for
/// [`all_reduce_sum`]. A training loop calls it (or [`check_replicas`]) every N steps:
/// replicas drift, silently, when a gradient all-reduce is forgotten.
///
/// # Errors
/// candle errors; communication errors.
pub fn replicas_identical<B: CandleBuf>(
    comm: &dyn Communicator<Buf = B>,
    add: &crate::comm::AddFn<'_, B>,
    vars: &[Var],
) -> candle_core::Result<bool> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in vars {
        for x in v.flatten_all()?.to_dtype(CDType::F32)?.to_vec1::<f32>()? {
            h = (h ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let bytes = h.to_le_bytes().map(f32::from);
    let both: Vec<f32> = bytes.iter().copied().chain(bytes.iter().map(|x| x * x)).collect();
    let device = vars.first().map_or(Device::Cpu, |v| v.device().clone());
    let sums = all_reduce_sum(comm, add, &Tensor::from_vec(both, 16, &device)?)?.to_vec1::<f32>()?;
    let world = comm.size() as f64;
    Ok((0..8).all(|i| world * f64::from(sums[8 + i]) == f64::from(sums[i]).powi(2)))
}

/// [`replicas_identical`] as an error on every rank when the replicas differ (a wrapped
/// [`Error::Parallel`] that names the likely cause).
///
/// # Errors
/// As [`replicas_identical`], and the drift.
pub fn check_replicas<B: CandleBuf>(
    comm: &dyn Communicator<Buf = B>,
    add: &crate::comm::AddFn<'_, B>,
    vars: &[Var],
) -> candle_core::Result<()> {
    if replicas_identical(comm, add, vars)? {
        return Ok(());
    }
    Err(wrap(Error::Parallel(format!(
        "the {} ranks' parameters are not bit-identical: the replicas have drifted (is every step's gradient \
         summed over the group with ringattn::candle::all_reduce_gradients before the optimiser step?)",
        comm.size()
    ))))
}

/// The sum over the group of every rank's `t` (any shape, f32, on the device its buffers
/// live on: CPU tensors with a host communicator, CUDA tensors with a device one): every
/// rank gets the same f32 tensor of `t`'s shape, summed in rank order
/// ([`Communicator::all_reduce`]) — a loss or metric summed over the ranks without a host
/// round trip. `add` adds two buffers (a backend's
/// [`crate::parallel::Buffers::add_into`], or [`crate::comm::add_host`]).
///
/// # Errors
/// Communication errors (wrapped); a `t` that is not f32 or not contiguous.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, Tensor};
/// use ringattn::comm::{add_host, spmd_shared, Communicator, LocalOptions};
/// let sums = spmd_shared(3, LocalOptions::default(), |comm: Arc<dyn Communicator<Buf = ringattn::HostBuf>>| {
///     let mine = Tensor::new(&[comm.rank() as f32, 1.0], &Device::Cpu).map_err(|e| ringattn::Error::InvalidArgument(e.to_string()))?;
///     let sum = ringattn::candle::all_reduce_sum(&*comm, &add_host, &mine)
///         .map_err(|e| ringattn::Error::InvalidArgument(e.to_string()))?;
///     Ok(sum.to_vec1::<f32>().map_err(|e| ringattn::Error::InvalidArgument(e.to_string()))?)
/// });
/// assert!(sums.into_iter().all(|s| s.unwrap() == vec![3.0, 3.0]));
/// ```
pub fn all_reduce_sum<B: CandleBuf>(
    comm: &dyn Communicator<Buf = B>,
    add: &crate::comm::AddFn<'_, B>,
    t: &Tensor,
) -> candle_core::Result<Tensor> {
    if t.dtype() != CDType::F32 {
        return Err(msg(format!("ringattn: all_reduce_sum takes f32 tensors, not {:?}", t.dtype())));
    }
    let sum = comm.all_reduce(tensor_buf(t, DType::F32)?, add).map_err(wrap)?;
    buf_tensor(sum, t.shape(), t)
}
