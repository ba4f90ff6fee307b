//! All-gather K/V (llama3-style): every rank gathers the whole K/V, attends its queries
//! with global positions, and the backward reduce-scatters dK/dV back to their owners.

use std::time::Instant;

use super::backend::Backend;
use super::plan::QueryHeads;
use super::{concat_positions, Driver, LocalData, ParallelPlan, Rules, Stats};
use crate::comm::{all_gather_v, reduce_scatter_v, Communicator};
use crate::{AttentionParams, Dims, Positions, Result};

/// All-gather K/V, attend locally, reduce-scatter dK/dV.
pub(super) struct AllGather;

impl Rules for AllGather {
    const CHECK_WORLD: (usize, Option<usize>) = (2, None);
}

impl Driver for AllGather {
    fn forward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf)> {
        let (pos, ap) = (plan.resolved.all_positions(), &plan.resolved.params().attention);
        let merged = forward(&*plan.comm, &*plan.backend, x, pos, ap, stats)?;
        plan.finish_forward(merged, QueryHeads::All(x.h_q), x.sinks.as_ref())
    }

    fn backward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        o: &Be::Buf,
        lse: &Be::Buf,
        d_o: &Be::Buf,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
        let (pos, ap) = (plan.resolved.all_positions(), &plan.resolved.params().attention);
        plan.grads_in_dtype(backward(&*plan.comm, &*plan.backend, x, pos, ap, o, lse, d_o, stats)?)
    }
}

/// The whole K/V, gathered, with their positions and the dims of this rank's block.
struct Gathered<B> {
    k: B,
    v: B,
    all: Positions,
    dims: Dims,
}

fn gather<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &LocalData<Be::Buf>,
    pos: &[Positions],
    stats: &mut Stats,
) -> Result<Gathered<Be::Buf>> {
    let start = Instant::now();
    let (wk, wv) = (x.h_kv * x.d_qk, x.h_kv * x.d_v);
    let lens = |w: usize| pos.iter().map(|p| x.b * p.len() * w).collect::<Vec<usize>>();
    let ks = all_gather_v(comm, x.k.clone(), &lens(wk))?;
    let vs = all_gather_v(comm, x.v.clone(), &lens(wv))?;
    stats.waiting += start.elapsed();
    let k = be.concat_seq(&ks, x.b, wk)?;
    let v = be.concat_seq(&vs, x.b, wv)?;
    let all = concat_positions(pos);
    let (s_q, s_k) = (pos[comm.rank()].len(), all.len());
    let dims = Dims { b: x.b, s_q, s_k, h_q: x.h_q, h_kv: x.h_kv, d_qk: x.d_qk, d_v: x.d_v };
    Ok(Gathered { k, v, all, dims })
}

/// Dense forward FLOPs of the local block.
fn flops(d: &Dims) -> f64 {
    crate::flops::flops(d, crate::flops::dense_pairs(d), crate::flops::Pass::Forward)
}

fn forward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &LocalData<Be::Buf>,
    pos: &[Positions],
    params: &AttentionParams,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf)> {
    let Gathered { k, v, all, dims } = gather(comm, be, x, pos, stats)?;
    let start = Instant::now();
    let q = be.step_input(&x.q)?;
    let out = be.forward_block(dims, &q, &k, &v, &pos[comm.rank()], &all, params)?.wait()?;
    stats.compute += start.elapsed();
    stats.blocks = 1;
    stats.step(Default::default(), Default::default(), flops(&dims));
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn backward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &LocalData<Be::Buf>,
    pos: &[Positions],
    params: &AttentionParams,
    o: &Be::Buf,
    lse: &Be::Buf,
    d_o: &Be::Buf,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
    let Gathered { k, v, all, dims } = gather(comm, be, x, pos, stats)?;
    let q_pos = &pos[comm.rank()];
    let start = Instant::now();
    let (q, o, d_o) = (be.step_input(&x.q)?, be.step_input(o)?, be.step_input(d_o)?);
    let delta = be.softmax_grad_rowsum(Dims { s_k: q_pos.len(), ..dims }, &o, &d_o)?;
    let (dq, dk_all, dv_all) =
        be.backward_block(dims, &q, &k, &v, &o, lse, &d_o, &delta, q_pos, &all, params)?.wait()?;
    stats.compute += start.elapsed();
    stats.blocks = 1;
    let start = Instant::now();
    let split = |t: &Be::Buf, w: usize| {
        let mut off = 0;
        pos.iter()
            .map(|p| {
                let part = be.seq_slice(t, x.b, all.len(), w, off, p.len());
                off += p.len();
                part
            })
            .collect::<Result<Vec<_>>>()
    };
    let add = |acc: &mut Be::Buf, x: &Be::Buf| be.add_into(acc, x);
    let dk = reduce_scatter_v(comm, split(&dk_all, x.h_kv * x.d_qk)?, add)?;
    let dv = reduce_scatter_v(comm, split(&dv_all, x.h_kv * x.d_v)?, add)?;
    stats.waiting += start.elapsed();
    stats.step(Default::default(), Default::default(), crate::flops::backward_ratio(&dims) * flops(&dims));
    Ok((dq, dk, dv))
}
