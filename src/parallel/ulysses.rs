//! Ulysses all-to-all: sequence-sharded `[b, n_r, h, d]` ⇄ head-sharded `[b, S, h/P, d]`.
//! Each rank receives exactly the kv heads its query heads use; when a contiguous range of
//! query heads does not map onto kv heads uniformly, each query head gets its own replica.

use std::time::Instant;

use crate::comm::{all_to_all_v, Communicator, Payload};
use crate::{AttentionParams, Dims, Error, Positions, Result};

use super::backend::Backend;
use super::plan::QueryHeads;
use super::seq::Shape;
use super::{concat_positions, ring, Driver, LocalData, ParallelParams, ParallelPlan, ResolvedParams, Rules, Stats};

/// Ulysses (`u = P`) and USP (`u < P`): the sequence → heads all-to-all inside each Ulysses
/// group of `u` consecutive ranks, the ring across the groups (one hop for Ulysses), and
/// back.
pub(super) struct Ulysses;

/// USP's rules (its driver is [`Ulysses`]'s): Ulysses inside groups of `u` consecutive
/// ranks, the ring across the `P/u` groups; the layout applies to the groups, and each
/// group's tokens are split contiguously among its Ulysses ranks.
pub(super) struct Usp;

impl Rules for Usp {
    const USES_MESH: bool = true;
    // Two Ulysses groups of two: the all-to-alls inside groups and the ring across them.
    const CHECK_WORLD: (usize, Option<usize>) = (4, Some(2));

    fn validate(params: &ParallelParams, world: usize, h_q: usize) -> Result<()> {
        if params.layout() == crate::Layout::Striped {
            return Err(Error::Parallel("usp works with the contiguous or zigzag layout, not striped".into()));
        }
        let u = params.usp_degree(world, h_q)?;
        if !h_q.is_multiple_of(u) {
            return Err(Error::Parallel(format!(
                "usp needs h_q divisible by the Ulysses degree: h_q = {h_q}, degree = {u}"
            )));
        }
        Ok(())
    }

    fn ulysses_degree(params: &ParallelParams, world: usize, h_q: usize) -> Result<usize> {
        params.usp_degree(world, h_q)
    }

    fn positions(params: &ParallelParams, world: usize, u: usize) -> Result<Vec<Positions>> {
        let (s, layout) = (params.seq_len, params.layout());
        let groups = layout.positions_for(&params.attention, s, world / u.max(1))?;
        if u <= 1 {
            return Ok(groups);
        }
        (0..world)
            .map(|rank| {
                let (g, i) = (rank / u, rank % u);
                let group = groups[g].to_vec();
                let n = group.len();
                let mine = &group[i * n / u..(i + 1) * n / u];
                Positions::from_list(mine)
            })
            .collect()
    }
}

/// The plan's mesh (made by [`ParallelPlan::new`] for `Ulysses` and `Usp`).
fn mesh<'p, Be: Backend>(plan: &'p ParallelPlan<'_, Be>) -> Result<&'p Mesh<Be::Buf>> {
    plan.mesh.as_ref().ok_or_else(|| Error::Parallel("internal: a Ulysses plan without its mesh".into()))
}

impl Rules for Ulysses {
    const USES_MESH: bool = true;
    const CHECK_WORLD: (usize, Option<usize>) = (2, None);

    fn validate(_params: &ParallelParams, world: usize, h_q: usize) -> Result<()> {
        if !h_q.is_multiple_of(world) {
            return Err(Error::Parallel(format!(
                "ulysses needs h_q divisible by the world size: h_q = {h_q}, world = {world}"
            )));
        }
        Ok(())
    }

    fn ulysses_degree(_params: &ParallelParams, world: usize, _h_q: usize) -> Result<usize> {
        Ok(world)
    }
}

impl Driver for Ulysses {
    fn forward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf)> {
        let (be, ap) = (&*plan.backend, &plan.resolved.params().attention);
        let m = mesh(plan)?;
        let g = m.group.as_ref();
        let a2a = Instant::now();
        let q = seq_to_heads(g, be, &x.q, m.shapes.q, &m.counts, &m.plan.q_heads)?;
        let k = seq_to_heads(g, be, &x.k, m.shapes.k, &m.counts, &m.plan.kv_heads)?;
        let v = seq_to_heads(g, be, &x.v, m.shapes.v, &m.counts, &m.plan.kv_heads)?;
        stats.waiting += a2a.elapsed();
        let merged = ring::forward(m.ring.as_ref(), be, &m.ring_inputs(x, (&q, &k, &v), plan, ap), stats)?;
        // The finish step on this rank's heads; o returns in the input dtype (rounding
        // commutes with moving values).
        let (o, lse) = plan.finish_forward(merged, QueryHeads::Listed(&m.plan.q_heads[m.me]), x.sinks.as_ref())?;
        let a2a = Instant::now();
        let o = heads_to_seq(g, be, &o, x.b, x.h_q, x.d_v, &m.counts, &m.plan.q_heads, false)?;
        let lse = lse_to_seq(g, be, &lse, x.b, x.h_q, &m.counts, &m.plan.q_heads)?;
        stats.waiting += a2a.elapsed();
        Ok((o, lse))
    }

    fn backward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        o: &Be::Buf,
        lse: &Be::Buf,
        d_o: &Be::Buf,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
        let (be, ap) = (&*plan.backend, &plan.resolved.params().attention);
        let m = mesh(plan)?;
        let g = m.group.as_ref();
        let (sh, qh, kh, c) = (m.shapes, &m.plan.q_heads, &m.plan.kv_heads, &m.counts);
        let a2a = Instant::now();
        let q = seq_to_heads(g, be, &x.q, sh.q, c, qh)?;
        let k = seq_to_heads(g, be, &x.k, sh.k, c, kh)?;
        let v = seq_to_heads(g, be, &x.v, sh.v, c, kh)?;
        let oh = seq_to_heads(g, be, o, sh.o, c, qh)?;
        let doh = seq_to_heads(g, be, d_o, sh.o, c, qh)?;
        let lh = lse_to_heads(g, be, lse, x.b, x.h_q, c, qh)?;
        stats.waiting += a2a.elapsed();
        let ri = m.ring_inputs(x, (&q, &k, &v), plan, ap);
        let (dq, dk, dv) = ring::backward(m.ring.as_ref(), be, &ri, &oh, &lh, &doh, stats)?;
        let a2a = Instant::now();
        // dq heads are written once: they travel in the input dtype; dK/dV replicas are
        // summed in f32 first.
        let dq = plan.in_dtype(dq)?;
        let dq = heads_to_seq(g, be, &dq, x.b, x.h_q, x.d_qk, c, qh, false)?;
        let dk = heads_to_seq(g, be, &dk, x.b, x.h_kv, x.d_qk, c, kh, true)?;
        let dv = heads_to_seq(g, be, &dv, x.b, x.h_kv, x.d_v, c, kh, true)?;
        stats.waiting += a2a.elapsed();
        Ok((dq, plan.in_dtype(dk)?, plan.in_dtype(dv)?))
    }
}

/// Which query and kv heads each rank of a Ulysses group computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadPlan {
    pub q_heads: Vec<Vec<usize>>,
    pub kv_heads: Vec<Vec<usize>>,
}

impl HeadPlan {
    /// # Errors
    /// [`Error::Parallel`] when `h_q` is not a multiple of the group size.
    pub fn new(h_q: usize, h_kv: usize, p: usize) -> Result<Self> {
        if !h_q.is_multiple_of(p) {
            return Err(Error::Parallel(format!(
                "Ulysses needs the query heads to divide evenly over its ranks: h_q = {h_q} is not a multiple of the Ulysses degree {p}"
            )));
        }
        let (per, g) = (h_q / p, h_q / h_kv);
        let mut q_heads = Vec::with_capacity(p);
        let mut kv_heads = Vec::with_capacity(p);
        for j in 0..p {
            let q: Vec<usize> = (j * per..(j + 1) * per).collect();
            let mut kv: Vec<usize> = q.iter().map(|h| h / g).collect();
            kv.dedup();
            let uniform = per % kv.len() == 0 && q.iter().enumerate().all(|(i, h)| kv[i / (per / kv.len())] == h / g);
            if !uniform {
                kv = q.iter().map(|h| h / g).collect(); // one replica per query head
            }
            q_heads.push(q);
            kv_heads.push(kv);
        }
        Ok(HeadPlan { q_heads, kv_heads })
    }
}

/// Sequence-sharded `[b, n_r, h, d]` → this rank's heads `heads[rank]` over the whole group
/// sequence, `[b, S, |heads[rank]|, d]` (ranks' tokens concatenated in rank order); `counts`
/// are the token counts of the ranks.
pub(crate) fn seq_to_heads<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &Be::Buf,
    sh: Shape,
    counts: &[usize],
    heads: &[Vec<usize>],
) -> Result<Be::Buf> {
    let sends = heads.iter().map(|hs| be.select_heads(x, sh, hs)).collect::<Result<Vec<_>>>()?;
    let mine = heads[comm.rank()].len();
    let lens: Vec<usize> = counts.iter().map(|&n| sh.b * n * mine * sh.d).collect();
    let got = all_to_all_v(comm, sends, &lens)?;
    be.concat_seq(&got, sh.b, heads[comm.rank()].len() * sh.d)
}

/// The inverse of [`seq_to_heads`]: `[b, S, |heads[rank]|, d]` → `[b, n_r, h, d]` (same element
/// type), where `counts` are the token counts of the ranks. With `sum` (f32 buffers), heads
/// computed by several ranks (replicas) are added in rank order; otherwise each head is
/// written once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn heads_to_seq<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    y: &Be::Buf,
    b: usize,
    h: usize,
    d: usize,
    counts: &[usize],
    heads: &[Vec<usize>],
    sum: bool,
) -> Result<Be::Buf> {
    let r = comm.rank();
    let s: usize = counts.iter().sum();
    let w = heads[r].len() * d;
    let mut off = 0;
    let mut sends = Vec::with_capacity(counts.len());
    for &n in counts {
        sends.push(be.seq_slice(y, b, s, w, off, n)?);
        off += n;
    }
    let lens: Vec<usize> = heads.iter().map(|hs| b * counts[r] * hs.len() * d).collect();
    let got = all_to_all_v(comm, sends, &lens)?;
    let sh = Shape { b, n: counts[r], h, d };
    let dtype = y.elem().dtype().ok_or_else(|| Error::InvalidArgument("heads_to_seq: a byte buffer".into()))?;
    let mut out = be.filled(sh.len(), 0.0, dtype)?;
    for (j, part) in got.iter().enumerate() {
        be.scatter_heads(&mut out, sh, &heads[j], part, !sum)?;
    }
    Ok(out)
}

/// LSE `[b, h, n_r]` → `[b, |heads[rank]|, S]` (an LSE is a `[b, 1, h, n]` buffer to the
/// head operations and `[b·k, S, 1]` to the sequence operations); `counts` are the token
/// counts of the ranks.
pub(crate) fn lse_to_heads<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    lse: &Be::Buf,
    b: usize,
    h: usize,
    counts: &[usize],
    heads: &[Vec<usize>],
) -> Result<Be::Buf> {
    let n = counts[comm.rank()];
    let sh = Shape { b, n: 1, h, d: n };
    let sends = heads.iter().map(|hs| be.select_heads(lse, sh, hs)).collect::<Result<Vec<_>>>()?;
    let mine = heads[comm.rank()].len();
    let lens: Vec<usize> = counts.iter().map(|&c| b * mine * c).collect();
    let got = all_to_all_v(comm, sends, &lens)?;
    be.concat_seq(&got, b * heads[comm.rank()].len(), 1)
}

/// LSE `[b, |heads[rank]|, S]` → `[b, h, n_r]` (each head written once).
pub(crate) fn lse_to_seq<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    lse: &Be::Buf,
    b: usize,
    h: usize,
    counts: &[usize],
    heads: &[Vec<usize>],
) -> Result<Be::Buf> {
    let r = comm.rank();
    let s: usize = counts.iter().sum();
    let rows = b * heads[r].len();
    let mut off = 0;
    let mut sends = Vec::with_capacity(counts.len());
    for &n in counts {
        sends.push(be.seq_slice(lse, rows, s, 1, off, n)?);
        off += n;
    }
    let lens: Vec<usize> = heads.iter().map(|hs| b * hs.len() * counts[r]).collect();
    let got = all_to_all_v(comm, sends, &lens)?;
    let n = counts[r];
    let mut out = be.filled(b * h * n, f32::NEG_INFINITY, crate::DType::F32)?;
    for (j, part) in got.iter().enumerate() {
        be.scatter_heads(&mut out, Shape { b, n: 1, h, d: n }, &heads[j], part, true)?;
    }
    Ok(out)
}

/// This rank's sequence-sharded buffers' shapes: q `[b, n, h_q, d_qk]`, o and d_o `[b, n, h_q,
/// d_v]`, k `[b, n, h_kv, d_qk]`, v `[b, n, h_kv, d_v]`.
#[derive(Debug, Clone, Copy)]
struct Shapes {
    q: Shape,
    o: Shape,
    k: Shape,
    v: Shape,
}

/// The `u × (P/u)` mesh of Ulysses (`u = P`) and USP: the Ulysses group of consecutive
/// ranks, the ring across groups, the head plan and this rank's token counts — made once per
/// [`ParallelPlan`].
pub(crate) struct Mesh<B: Payload> {
    group: Box<dyn Communicator<Buf = B>>,
    ring: Box<dyn Communicator<Buf = B>>,
    plan: HeadPlan,
    /// Token counts of the ranks of this rank's Ulysses group.
    counts: Vec<usize>,
    /// Positions of each ring group's tokens (its Ulysses ranks' tokens, in order).
    pub(crate) group_pos: Vec<Positions>,
    /// This rank's index in its Ulysses group.
    me: usize,
    shapes: Shapes,
}

impl<B: Payload> Mesh<B> {
    /// This rank's index in the ring across Ulysses groups (its group's).
    pub(crate) fn ring_rank(&self) -> usize {
        self.ring.rank()
    }

    /// The global ids of the query heads this rank computes (its share of its group's).
    pub(crate) fn query_heads(&self) -> &[usize] {
        &self.plan.q_heads[self.me]
    }

    /// Splits `comm` into the Ulysses groups and the rings across them (collective).
    pub(crate) fn new(comm: &dyn Communicator<Buf = B>, resolved: &ResolvedParams, dims: &Dims) -> Result<Self> {
        let (world, rank) = (comm.size(), comm.rank());
        let u = resolved.ulysses_degree();
        let pos = resolved.all_positions();
        // Colors name the group itself — its kind and the degree — so that a split cached by
        // `(color, key)` (comm::SplitCache) is the same group whenever it is asked for.
        let color = |kind: usize, index: usize| (2 * u + kind) * world + index;
        let group = comm.split(color(0, rank / u), rank % u)?;
        let ring = comm.split(color(1, rank % u), rank / u)?;
        let plan = HeadPlan::new(dims.h_q, dims.h_kv, u)?;
        let g0 = rank / u * u;
        let counts: Vec<usize> = (g0..g0 + u).map(|r| pos[r].len()).collect();
        let n = counts[rank % u];
        let group_pos = (0..world / u).map(|g| concat_positions(&pos[g * u..(g + 1) * u])).collect();
        Ok(Mesh {
            group,
            ring,
            plan,
            counts,
            group_pos,
            me: rank % u,
            shapes: Shapes {
                q: Shape { b: dims.b, n, h: dims.h_q, d: dims.d_qk },
                o: Shape { b: dims.b, n, h: dims.h_q, d: dims.d_v },
                k: Shape { b: dims.b, n, h: dims.h_kv, d: dims.d_qk },
                v: Shape { b: dims.b, n, h: dims.h_kv, d: dims.d_v },
            },
        })
    }

    /// The ring's view of this rank's head-sharded data.
    fn ring_inputs<'a, Be: Backend<Buf = B>>(
        &'a self,
        x: &LocalData<B>,
        (q, k, v): (&'a B, &'a B, &'a B),
        plan: &'a ParallelPlan<'_, Be>,
        params: &'a AttentionParams,
    ) -> ring::RingInputs<'a, B> {
        let (h_q, h_kv) = (self.plan.q_heads[self.me].len(), self.plan.kv_heads[self.me].len());
        let (d_qk, d_v) = (x.d_qk, x.d_v);
        let (pos, hops, direct) = (&self.group_pos, plan.hops, plan.direct.as_ref());
        ring::RingInputs { b: x.b, h_q, h_kv, d_qk, d_v, q, k, v, pos, hops, params, direct }
    }
}
