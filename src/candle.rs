//! candle integration (feature `candle`): [`ring_attention`] on candle tensors with
//! autograd, and what a training loop over ranks needs around it — shards of token, target and
//! position tensors by the plan's layout ([`shard`], [`unshard`]), the sum of replicated
//! parameters' gradients over the group ([`all_reduce_gradients`]), and rank threads that own
//! their communicator ([`crate::comm::spmd_shared`]).
//!
//! Tensors are candle's `[b, s, h, d]` (the crate's layout), this rank's tokens at the plan's
//! positions. Storage: CPU (f32, bf16, f16) on the host backends (CPU, emulated kernels).
//! CUDA storage is refused with an error for now: the device path needs 16-bit device
//! buffers, which the plan does not have yet.
//!
//! Each call records its own operation in candle's graph, which keeps that call's saved
//! context (o, LSE, inputs) until the graph is dropped: any number of layers, repeated calls
//! in a step, and a layer's forward recomputed inside the backward (gradient checkpointing)
//! each find their own. The backward is collective like the forward: every rank runs
//! `backward()` on graphs of the same shape (candle visits the operations in the same order).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, DType as CDType, Device, Layout, Shape, Tensor, Var};
use half::{bf16, f16};

use crate::comm::{add_host, Communicator};
use crate::parallel::{Backend, ParallelPlan, ResolvedParams, SavedForward};
use crate::{DType, Error, HostBuf, HostData};

/// A `'static` plan over host buffers, as [`ring_attention`] takes it
/// ([`ParallelPlan::new_shared`] in an `Arc`).
pub type SharedPlan<Be> = Arc<ParallelPlan<'static, Be>>;

fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

fn msg(m: String) -> candle_core::Error {
    candle_core::Error::Msg(m)
}

/// The crate's dtype of a candle dtype.
fn dtype_of(d: CDType) -> candle_core::Result<DType> {
    match d {
        CDType::F32 => Ok(DType::F32),
        CDType::BF16 => Ok(DType::BF16),
        CDType::F16 => Ok(DType::F16),
        other => Err(msg(format!("ringattn: attention takes f32, bf16 or f16 tensors, not {other:?}"))),
    }
}

/// The values of a CPU storage under a contiguous layout.
fn host_buf(s: &CpuStorage, l: &Layout) -> candle_core::Result<HostBuf> {
    let (a, b) = l.contiguous_offsets().ok_or_else(|| msg("ringattn: a non-contiguous input".into()))?;
    Ok(HostBuf::new(match s {
        CpuStorage::F32(v) => HostData::F32(v[a..b].to_vec()),
        CpuStorage::BF16(v) => HostData::BF16(v[a..b].to_vec()),
        CpuStorage::F16(v) => HostData::F16(v[a..b].to_vec()),
        _ => return Err(msg("ringattn: attention takes f32, bf16 or f16 tensors".into())),
    }))
}

/// The values of a host buffer as a CPU storage.
fn storage(b: HostBuf) -> candle_core::Result<CpuStorage> {
    Ok(match b.into_data() {
        HostData::F32(v) => CpuStorage::F32(v),
        HostData::BF16(v) => CpuStorage::BF16(v),
        HostData::F16(v) => CpuStorage::F16(v),
        other => return Err(msg(format!("ringattn: a {} buffer is not a tensor", other.elem()))),
    })
}

/// The values of a CPU tensor as a host buffer of `dtype`.
fn tensor_buf(t: &Tensor, dtype: DType) -> candle_core::Result<HostBuf> {
    let t = t.to_dtype(match dtype {
        DType::F32 => CDType::F32,
        DType::BF16 => CDType::BF16,
        _ => CDType::F16,
    })?;
    let flat = t.flatten_all()?;
    Ok(HostBuf::new(match dtype {
        DType::F32 => HostData::F32(flat.to_vec1::<f32>()?),
        DType::BF16 => HostData::BF16(flat.to_vec1::<bf16>()?),
        _ => HostData::F16(flat.to_vec1::<f16>()?),
    }))
}

/// A host buffer as a CPU tensor of `shape`.
fn buf_tensor(b: HostBuf, shape: &Shape) -> candle_core::Result<Tensor> {
    match b.into_data() {
        HostData::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        HostData::BF16(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        HostData::F16(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        other => Err(msg(format!("ringattn: a {} buffer is not a tensor", other.elem()))),
    }
}

/// One call's operation in candle's graph: the plan, and the context its forward saved for
/// its backward.
struct RingAttention<Be: Backend<Buf = HostBuf> + 'static> {
    plan: SharedPlan<Be>,
    saved: Mutex<Option<SavedForward<HostBuf>>>,
}

impl<Be: Backend<Buf = HostBuf> + Send + Sync + 'static> CustomOp3 for RingAttention<Be> {
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
        let (q, k, v) = (host_buf(s1, l1)?, host_buf(s2, l2)?, host_buf(s3, l3)?);
        let (o, saved) = self.plan.forward(&q, &k, &v).map_err(wrap)?;
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        Ok((storage(o)?, l1.shape().clone()))
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
        let d_o = tensor_buf(grad_res, self.plan.dtype())?;
        let g = self.plan.backward(&saved, &d_o).map_err(wrap)?;
        Ok((Some(buf_tensor(g.dq, q.shape())?), Some(buf_tensor(g.dk, k.shape())?), Some(buf_tensor(g.dv, v.shape())?)))
    }
}

/// Exact attention of this rank's shard against the whole sequence, as a candle operation
/// with autograd: `q` `[b, n, h_q, d]`, `k` and `v` `[b, n, h_kv, d]` (this rank's `n` tokens,
/// at the plan's positions), in the plan's dtype, on the CPU; returns `o` `[b, n, h_q, d]` in
/// that dtype. Collective over the plan's communicator, forward and backward (see the
/// module docs). Non-contiguous inputs are made contiguous first (differentiably).
///
/// # Errors
/// candle errors, and wrapped [`Error`]s: a dtype other than the plan's, shapes other than
/// the planned shard, CUDA tensors (not yet), communication errors.
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
///     let dims = Dims { b: 1, s_q: n, s_k: n, h_q: 2, h_kv: 2, d: 8 };
///     let plan = Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
///     let q = Var::from_tensor(&mine)?;
///     let o = ringattn::candle::ring_attention(&plan, q.as_tensor(), &mine, &mine)?;
///     let grads = o.sum_all()?.backward()?;
///     Ok(grads.get(q.as_tensor()).is_some())
/// });
/// assert!(results.into_iter().all(|r| r.ok() == Some(true)));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn ring_attention<Be: Backend<Buf = HostBuf> + Send + Sync + 'static>(
    plan: &SharedPlan<Be>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> candle_core::Result<Tensor> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if !t.device().is_cpu() {
            return Err(msg(format!(
                "ringattn: `{name}` is on {:?}; the candle operation takes CPU tensors (CUDA storage needs 16-bit \
                 device buffers, not written yet)",
                t.device()
            )));
        }
        let dt = dtype_of(t.dtype())?;
        if dt != plan.dtype() {
            return Err(msg(format!("ringattn: `{name}` is {dt}, the plan is for {}", plan.dtype())));
        }
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    q.apply_op3(&k, &v, RingAttention { plan: plan.clone(), saved: Mutex::new(None) })
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
    t.index_select(&index(&pos)?.to_device(t.device())?, dim)
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
/// every rank passes the same vars in the same order.
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
    let mut flat = Vec::new();
    let mut sizes = Vec::with_capacity(vars.len());
    for v in vars {
        let n = v.elem_count();
        match grads.get(v.as_tensor()) {
            Some(g) => flat.extend(g.to_dtype(CDType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => flat.extend(std::iter::repeat_n(0.0, n)),
        }
        sizes.push(n);
    }
    let sum = comm.all_reduce(HostBuf::from(flat), &add_host).map_err(wrap)?;
    let sum = sum.f32s().map_err(wrap)?;
    let mut off = 0;
    for (v, n) in vars.iter().zip(sizes) {
        let g = Tensor::from_slice(&sum[off..off + n], v.shape(), &Device::Cpu)?.to_dtype(v.dtype())?;
        grads.insert(v.as_tensor(), g.to_device(v.device())?);
        off += n;
    }
    Ok(())
}
