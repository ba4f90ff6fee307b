//! All-gather K/V (llama3-style): every rank gathers the whole K/V, attends its queries
//! with global positions, and the backward reduce-scatters dK/dV back to their owners.
//!
//! When the plan found that each rank sees only part of the others' rows (packed documents,
//! causal shards: [`DirectSchedule`], computed with as many hops as ranks), the gather is an
//! all-to-all of just those rows — each rank sends every other rank the runs of its K/V rows
//! that rank's queries see — and the backward returns each part's dK/dV to its owner the same
//! way, added in rank order (deterministic).

use std::time::Instant;

use super::backend::Backend;
use super::direct::{self, DirectSchedule};
use super::plan::QueryHeads;
use super::{concat_positions, Driver, LocalData, ParallelPlan, Rules, Stats};
use crate::comm::{all_gather_v, all_to_all_v, reduce_scatter_v, Communicator};
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
        let merged = forward(&*plan.comm, &*plan.backend, x, pos, plan.direct.as_ref(), ap, stats)?;
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
        let sched = plan.direct.as_ref();
        plan.grads_in_dtype(backward(&*plan.comm, &*plan.backend, x, pos, sched, ap, o, lse, d_o, stats)?)
    }
}

/// The gathered K/V (every rank's rows, or this rank's own and the others' rows it sees),
/// with their positions and the dims of this rank's block.
struct Gathered<B> {
    k: B,
    v: B,
    all: Positions,
    dims: Dims,
    /// Rows of each rank's block in `k`/`v`, in rank order (this rank's own block first in
    /// the subset gather, then the others' in rank order).
    rows: Vec<usize>,
    /// The subset gather's layout of `k`/`v`: runs of the gathered blocks in position order.
    pieces: Vec<Piece>,
}

/// A run of consecutive positions of one gathered block (0: this rank's own, then the others'
/// with rows, in rank order): `len` rows from the block's row `from`, at row `at` of the
/// gathered K/V.
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: i64,
    block: usize,
    from: usize,
    len: usize,
    at: usize,
}

/// The gathered blocks' runs in position order, so that the local attention's key tiles hold
/// neighbouring positions (the blocks' own order would put rows from far apart side by side);
/// the blocks one after another, one piece each, when they hold too many runs for that to
/// pay (a striped block: one run per row) — then `false`.
fn pieces(blocks: &[Positions]) -> (Vec<Piece>, bool) {
    let mut out = Vec::new();
    for (block, pos) in blocks.iter().enumerate() {
        let mut from = 0;
        for seg in pos.segments().iter().filter(|g| g.len > 0) {
            let runs = if seg.stride == 1 {
                vec![(seg.start, seg.len)]
            } else {
                (0..seg.len as i64).map(|i| (seg.start + i * seg.stride, 1)).collect()
            };
            for (start, len) in runs {
                match out.last_mut() {
                    Some(Piece { start: s, block: b, len: l, .. }) if *b == block && *s + *l as i64 == start => {
                        *l += len
                    }
                    _ => out.push(Piece { start, block, from, len, at: 0 }),
                }
                from += len;
            }
        }
    }
    let sorted = out.len() <= 64 * blocks.len();
    if sorted {
        out.sort_by_key(|p| (p.start, p.block));
    } else {
        // One piece per block, in the blocks' order (`start` unused).
        out = blocks
            .iter()
            .enumerate()
            .map(|(block, pos)| Piece { start: 0, block, from: 0, len: pos.len(), at: 0 })
            .collect();
    }
    let mut at = 0;
    for p in &mut out {
        p.at = at;
        at += p.len;
    }
    (out, sorted)
}

fn gather<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &LocalData<Be::Buf>,
    pos: &[Positions],
    sched: Option<&DirectSchedule>,
    stats: &mut Stats,
) -> Result<Gathered<Be::Buf>> {
    if let Some(sched) = sched {
        return gather_seen(comm, be, x, pos, sched, stats);
    }
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
    Ok(Gathered { k, v, all, dims, rows: pos.iter().map(Positions::len).collect(), pieces: Vec::new() })
}

/// The subset gather: this rank's own K/V first, then the rows of every other rank that its
/// queries see, in rank order.
fn gather_seen<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &LocalData<Be::Buf>,
    pos: &[Positions],
    sched: &DirectSchedule,
    stats: &mut Stats,
) -> Result<Gathered<Be::Buf>> {
    let start = Instant::now();
    let (p, r) = (comm.size(), comm.rank());
    let n = pos[r].len();
    let (wk, wv) = (x.h_kv * x.d_qk, x.h_kv * x.d_v);
    // Rank j sees the runs `sends_at(j − r)` of this rank's rows; this rank sees the rows
    // `receives_at(r − j)` of rank j's.
    let seen: Vec<Option<&Positions>> =
        (0..p).map(|j| if j == r { None } else { sched.receives_at((r + p - j) % p) }).collect();
    let rows: Vec<usize> = seen.iter().map(|s| s.map_or(0, Positions::len)).collect();
    let exchange = |t: &Be::Buf, w: usize| -> Result<Vec<Be::Buf>> {
        // Nothing for itself or for a rank that sees none of its rows: an empty slice of its
        // own buffer (the receiver checks the element type).
        let sends = (0..p)
            .map(|j| match sched.sends_at((j + p - r) % p) {
                runs if j != r && !runs.is_empty() => direct::gather(be, t, x.b, n, w, runs),
                _ => be.seq_slice(t, x.b, n, w, 0, 0),
            })
            .collect::<Result<Vec<_>>>()?;
        all_to_all_v(comm, sends, &rows.iter().map(|m| x.b * m * w).collect::<Vec<_>>())
    };
    let (ks, vs) = (exchange(&x.k, wk)?, exchange(&x.v, wv)?);
    stats.waiting += start.elapsed();
    // The blocks: this rank's own, then the others' it sees, in rank order.
    let others = |parts: Vec<Be::Buf>| parts.into_iter().enumerate().filter(|&(j, _)| j != r && rows[j] > 0);
    let kb: Vec<Be::Buf> = std::iter::once(x.k.clone()).chain(others(ks).map(|(_, b)| b)).collect();
    let vb: Vec<Be::Buf> = std::iter::once(x.v.clone()).chain(others(vs).map(|(_, b)| b)).collect();
    let blocks: Vec<Positions> =
        std::iter::once(pos[r].clone()).chain(seen.iter().flatten().map(|p| (*p).clone())).collect();
    // Laid out in position order.
    let (order, sorted) = pieces(&blocks);
    let arrange = |bufs: &[Be::Buf], w: usize| {
        let parts = order
            .iter()
            .map(|pc| be.seq_slice(&bufs[pc.block], x.b, blocks[pc.block].len(), w, pc.from, pc.len))
            .collect::<Result<Vec<_>>>()?;
        be.concat_seq(&parts, x.b, w)
    };
    let (k, v) = (arrange(&kb, wk)?, arrange(&vb, wv)?);
    let all = match sorted {
        true => Positions::from_segments(
            order.iter().map(|pc| crate::Segment { start: pc.start, stride: 1, len: pc.len }).collect(),
        )?,
        false => concat_positions(&blocks),
    };
    let dims = Dims { b: x.b, s_q: n, s_k: all.len(), h_q: x.h_q, h_kv: x.h_kv, d_qk: x.d_qk, d_v: x.d_v };
    let mut rows = rows;
    rows[r] = n;
    Ok(Gathered { k, v, all, dims, rows, pieces: order })
}

/// Each gathered block's rows of `grad` (`[b, s_k, w]` in the gather's position order), in the
/// block's own row order: block 0 this rank's, then the others' with rows, in rank order.
fn per_block<Be: Backend>(
    be: &Be,
    b: usize,
    grad: &Be::Buf,
    pieces: &[Piece],
    blocks: usize,
    w: usize,
) -> Result<Vec<Be::Buf>> {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let mut out = Vec::with_capacity(blocks);
    for block in 0..blocks {
        let mut mine: Vec<&Piece> = pieces.iter().filter(|p| p.block == block).collect();
        mine.sort_by_key(|p| p.from);
        out.push(match mine.len() {
            // An empty block (a rank without tokens): an empty slice of the gradient's type.
            0 => be.seq_slice(grad, b, total, w, 0, 0)?,
            _ => {
                let parts =
                    mine.iter().map(|p| be.seq_slice(grad, b, total, w, p.at, p.len)).collect::<Result<Vec<_>>>()?;
                be.concat_seq(&parts, b, w)?
            }
        });
    }
    Ok(out)
}

/// The subset gather's return: the dK (or dV) rows of `grad` (`[b, s_k, w]` f32, in
/// [`gather_seen`]'s layout) go back to their owners, which add them, in rank order, into their
/// own rows' part.
#[allow(clippy::too_many_arguments)]
fn return_seen<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    b: usize,
    grad: &Be::Buf,
    rows: &[usize],
    pieces: &[Piece],
    sched: &DirectSchedule,
    w: usize,
) -> Result<Be::Buf> {
    let (p, r) = (comm.size(), comm.rank());
    let n = rows[r];
    let count = 1 + rows.iter().enumerate().filter(|&(j, &m)| j != r && m > 0).count();
    let mut blocks = per_block(be, b, grad, pieces, count, w)?.into_iter();
    let own =
        blocks.next().ok_or_else(|| crate::Error::Parallel("internal: the all-gather lost its own block".into()))?;
    let mut sends = Vec::with_capacity(p);
    for (j, &m) in rows.iter().enumerate() {
        if j == r || m == 0 {
            sends.push(be.seq_slice(&own, b, n, w, 0, 0)?);
        } else {
            sends.push(
                blocks
                    .next()
                    .ok_or_else(|| crate::Error::Parallel(format!("internal: the all-gather lost rank {j}'s rows")))?,
            );
        }
    }
    let runs = |j: usize| sched.sends_at((j + p - r) % p);
    let recv_lens: Vec<usize> =
        (0..p).map(|j| if j == r { 0 } else { b * runs(j).iter().map(|x| x.1).sum::<usize>() * w }).collect();
    let parts = all_to_all_v(comm, sends, &recv_lens)?;
    let mut own = own;
    for (j, part) in parts.iter().enumerate() {
        if j != r && recv_lens[j] > 0 {
            be.add_into(&mut own, &direct::widen(be, part, b, n, w, runs(j))?)?;
        }
    }
    Ok(own)
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
    sched: Option<&DirectSchedule>,
    params: &AttentionParams,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf)> {
    let Gathered { k, v, all, dims, .. } = gather(comm, be, x, pos, sched, stats)?;
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
    sched: Option<&DirectSchedule>,
    params: &AttentionParams,
    o: &Be::Buf,
    lse: &Be::Buf,
    d_o: &Be::Buf,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
    let Gathered { k, v, all, dims, rows, pieces } = gather(comm, be, x, pos, sched, stats)?;
    let q_pos = &pos[comm.rank()];
    let start = Instant::now();
    let (q, o, d_o) = (be.step_input(&x.q)?, be.step_input(o)?, be.step_input(d_o)?);
    let delta = be.softmax_grad_rowsum(Dims { s_k: q_pos.len(), ..dims }, &o, &d_o)?;
    let (dq, dk_all, dv_all) =
        be.backward_block(dims, &q, &k, &v, &o, lse, &d_o, &delta, q_pos, &all, params)?.wait()?;
    stats.compute += start.elapsed();
    stats.blocks = 1;
    let start = Instant::now();
    if let Some(sched) = sched {
        let dk = return_seen(comm, be, x.b, &dk_all, &rows, &pieces, sched, x.h_kv * x.d_qk)?;
        let dv = return_seen(comm, be, x.b, &dv_all, &rows, &pieces, sched, x.h_kv * x.d_v)?;
        stats.waiting += start.elapsed();
        stats.step(Default::default(), Default::default(), crate::flops::backward_ratio(&dims) * flops(&dims));
        return Ok((dq, dk, dv));
    }
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
