//! The ring's zero-redundant schedule: at hop `t` rank `r` sends its own K/V rows — only those
//! that rank `r + t`'s queries see at least one pair in, widened to whole windows of its rows
//! ([`window`]: so that the receiver's key tiles do not mix rows from far apart) — straight to
//! `r + t`, and receives from `r − t` the rows of `r − t` it sees; a hop with nothing visible
//! either way posts nothing.
//! The backward sends each block's dK/dV partials (f32, the same rows) straight back to the
//! block's owner, which adds them into its own accumulators in hop order (deterministic).
//!
//! Same hop order and merge order as the pass-along ring (`ring.rs`), so the two schedules are
//! interchangeable; the plan picks this one when it moves fewer bytes ([`DirectSchedule::better`]
//! : packed documents, above all under the balanced layout, where most rank pairs share few
//! or no visible pairs), computed once from every rank's positions.

use std::time::Instant;

use super::backend::Backend;
use super::ring::{wait_pair, RingInputs};
use super::Stats;
use crate::comm::{Communicator, Payload, Posted, RecvHandle, RecvOp, SendHandle, SendOp, Tag};
use crate::{AttentionParams, DType, Elem, Error, Positions, Result, Segment};

/// Tag offsets in the call's tag block: K of hop t is `KV_TAG + 2t`, V `+ 1`; the dK/dV
/// partials of hop t `PART_TAG + 2t`, `+ 1`.
const KV_TAG: Tag = 0;
const PART_TAG: Tag = 1 << 18;

/// Local row runs `(first row, rows)` of a block, ascending and disjoint.
pub(super) type Runs = Vec<(usize, usize)>;

/// One rank's direct schedule over a ring of `P` ranks.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DirectSchedule {
    /// Per hop `t` (index 0 unused): the rows of this rank's own K/V that rank `r + t` sees.
    send: Vec<Runs>,
    /// Per hop `t`: the positions of the rows of rank `r − t` that this rank sees (`None`: none).
    recv: Vec<Option<Positions>>,
}

impl DirectSchedule {
    /// The schedule of ring rank `rank` given every ring rank's positions, or `None` when the
    /// pass-along ring of `hops` hops moves no more bytes (every rank's K/V rows counted once
    /// per hop they travel; the same verdict on every rank).
    ///
    /// # Errors
    /// [`Error::Documents`] when a position lies outside the documents.
    pub(crate) fn better(
        params: &AttentionParams,
        pos: &[Positions],
        rank: usize,
        hops: usize,
    ) -> Result<Option<Self>> {
        let p = pos.len();
        if p < 2 {
            return Ok(None);
        }
        let seen = seen_keys(params, pos)?;
        let need = |to: usize, from: usize| aligned(runs_within(&pos[from], &seen[to]), pos[from].len());
        if !takes_direct(&rows_between(pos, &seen), pos, hops) {
            return Ok(None);
        }
        let send = (0..p).map(|t| if t == 0 { Vec::new() } else { need((rank + t) % p, rank) }).collect();
        let recv = (0..p)
            .map(|t| {
                let from = (rank + p - t) % p;
                let runs = if t == 0 { Vec::new() } else { need(rank, from) };
                (!runs.is_empty()).then(|| positions_of(&pos[from], &runs))
            })
            .collect();
        Ok(Some(DirectSchedule { send, recv }))
    }

    /// The runs of this rank's own rows that rank `r + t` sees (empty at `t = 0`).
    pub(super) fn sends_at(&self, t: usize) -> &Runs {
        &self.send[t]
    }

    /// The positions of the rows of rank `r − t` that this rank sees (`None`: none, or `t = 0`).
    pub(super) fn receives_at(&self, t: usize) -> Option<&Positions> {
        self.recv[t].as_ref()
    }

    /// Whether this rank sends or receives at hop `t`.
    fn active(&self, t: usize) -> bool {
        !self.send[t].is_empty() || self.recv[t].is_some()
    }

    /// Hops this rank runs: one past its last active hop (the local hop: 1).
    fn extent(&self) -> usize {
        (1..self.send.len()).rev().find(|&t| self.active(t)).map_or(1, |t| t + 1)
    }

    /// Hops after the local one in which this rank sends and receives nothing.
    fn idle_hops(&self) -> usize {
        (1..self.send.len()).filter(|&t| !self.active(t)).count()
    }
}

/// Every rank's visible key intervals ([`visible_keys`]).
fn seen_keys(params: &AttentionParams, pos: &[Positions]) -> Result<Vec<Vec<(i64, i64)>>> {
    pos.iter().map(|q| visible_keys(params, q)).collect()
}

/// Rows of rank `from`'s block that the direct schedule sends to rank `to`, as `[to][from]`
/// (the diagonal 0: a rank's own block does not travel).
fn rows_between(pos: &[Positions], seen: &[Vec<(i64, i64)>]) -> Vec<Vec<usize>> {
    let p = pos.len();
    (0..p)
        .map(|to| {
            (0..p)
                .map(|from| {
                    if from == to {
                        return 0;
                    }
                    aligned(runs_within(&pos[from], &seen[to]), pos[from].len()).iter().map(|r| r.1).sum()
                })
                .collect()
        })
        .collect()
}

/// Whether the direct schedule moves fewer rows, over all ranks, than the pass-along ring of
/// `hops` hops, which sends at each of its hops but the last the block it holds.
fn takes_direct(rows: &[Vec<usize>], pos: &[Positions], hops: usize) -> bool {
    let p = pos.len();
    let pass: usize =
        (0..p).map(|r| (0..hops.saturating_sub(1)).map(|t| pos[(r + p - t) % p].len()).sum::<usize>()).sum();
    let direct: usize = rows.iter().flatten().sum();
    direct < pass
}

/// The cost model's view of a ring over blocks at `pos` ([`crate::plan`]): the rows the direct
/// schedule would send, `[to][from]`, and whether the plan takes it over the pass-along ring of
/// `hops` hops (the verdict of [`DirectSchedule::better`]).
///
/// # Errors
/// [`Error::Documents`] when a position lies outside the documents.
pub(crate) fn sent_rows(params: &AttentionParams, pos: &[Positions], hops: usize) -> Result<(Vec<Vec<usize>>, bool)> {
    if pos.len() < 2 {
        return Ok((vec![vec![0; pos.len()]; pos.len()], false));
    }
    let rows = rows_between(pos, &seen_keys(params, pos)?);
    let direct = takes_direct(&rows, pos, hops);
    Ok((rows, direct))
}

/// The key intervals (inclusive, ascending, disjoint) that queries at `q` see at least one
/// pair in: per run of consecutive queries within one document, `[q0 − left, q1 + right]`
/// clipped to the document (the mask's sides; a missing side: the document's end).
fn visible_keys(params: &AttentionParams, q: &Positions) -> Result<Vec<(i64, i64)>> {
    let (left, right) = params.mask.bounds();
    // Each document's first position and one past its last.
    let bounds: Option<Vec<(i64, i64)>> = params.documents.as_ref().map(|docs| {
        let mut at = 0i64;
        docs.lengths()
            .into_iter()
            .map(|l| {
                at += l as i64;
                (at - l as i64, at)
            })
            .collect()
    });
    let mut out: Vec<(i64, i64)> = Vec::new();
    let mut add = |q0: i64, q1: i64| -> Result<()> {
        let mut a = q0;
        while a <= q1 {
            // The document holding `a`, inclusive (no documents: one unbounded).
            let (ds, de) = match (&params.documents, &bounds) {
                (Some(docs), Some(b)) => {
                    let d = docs.document_of(a).ok_or_else(|| {
                        Error::Documents(format!("position {a} lies outside the documents (0..{})", docs.total_len()))
                    })?;
                    (b[d].0, b[d].1 - 1)
                }
                _ => (i64::MIN, i64::MAX),
            };
            let b = q1.min(de);
            let lo = left.map_or(ds, |l| ds.max(a.saturating_sub(l)));
            let hi = right.map_or(de, |r| de.min(b.saturating_add(r)));
            if lo <= hi {
                out.push((lo, hi));
            }
            a = b + 1;
        }
        Ok(())
    };
    for seg in q.segments().iter().filter(|s| s.len > 0) {
        if seg.stride == 1 {
            add(seg.start, seg.start + seg.len as i64 - 1)?;
        } else {
            for i in 0..seg.len as i64 {
                let x = seg.start + i * seg.stride;
                add(x, x)?;
            }
        }
    }
    out.sort_unstable();
    let mut merged: Vec<(i64, i64)> = Vec::with_capacity(out.len());
    for (a, b) in out {
        match merged.last_mut() {
            Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    Ok(merged)
}

/// The local rows of a block at `k` whose positions lie in `seen` (inclusive, ascending,
/// disjoint intervals), as runs.
fn runs_within(k: &Positions, seen: &[(i64, i64)]) -> Runs {
    let mut runs: Runs = Vec::new();
    let mut push = |a: usize, n: usize| match runs.last_mut() {
        Some(last) if last.0 + last.1 == a => last.1 += n,
        _ if n > 0 => runs.push((a, n)),
        _ => {}
    };
    let mut base = 0usize;
    for seg in k.segments() {
        if seg.len > 0 {
            let last = seg.start + seg.stride * (seg.len as i64 - 1);
            // The intervals that reach this segment's span.
            let first = seen.partition_point(|&(_, hi)| hi < seg.start);
            for &(lo, hi) in seen[first..].iter().take_while(|&&(lo, _)| lo <= last) {
                // Indices i with lo <= start + i·stride <= hi.
                let i0 = if lo <= seg.start { 0 } else { (lo - seg.start + seg.stride - 1) / seg.stride };
                let i1 = ((hi.min(last) - seg.start) / seg.stride).min(seg.len as i64 - 1);
                if i0 <= i1 {
                    push(base + i0 as usize, (i1 - i0 + 1) as usize);
                }
            }
        }
        base += seg.len;
    }
    runs
}

/// Sent runs are widened to whole windows of the sender's rows (clipped to the block), so that
/// the receiver's key tiles (up to 512 rows on the CPU, 64–128 in the kernels) each hold rows of
/// one window of the sender's — as its own tiles do — instead of straddling rows that lay far
/// apart (a tile over unrelated documents runs masked). The extra rows hold no visible pair:
/// they cost bytes, not results. The window: 512 rows, or a sixteenth of a smaller block (a
/// power of two, from 64); blocks under 1024 rows are sent row-exact.
fn window(n: usize) -> usize {
    if n < 1024 {
        return 1;
    }
    1 << (n / 16).min(512).ilog2()
}

/// `runs` widened to whole [`window`]s of a block of `n` rows, merged.
fn aligned(runs: Runs, n: usize) -> Runs {
    let w = window(n);
    let mut out: Runs = Vec::with_capacity(runs.len());
    for (a, m) in runs {
        let (lo, hi) = (a - a % w, (a + m).div_ceil(w).saturating_mul(w).min(n));
        match out.last_mut() {
            Some(last) if last.0 + last.1 >= lo => last.1 = hi.max(last.0 + last.1) - last.0,
            _ => out.push((lo, hi - lo)),
        }
    }
    out
}

/// The positions of the rows `runs` of a block at `k`.
fn positions_of(k: &Positions, runs: &Runs) -> Positions {
    let all = k.to_vec();
    let mut segs: Vec<Segment> = Vec::new();
    for &(a, n) in runs {
        for &x in &all[a..a + n] {
            match segs.last_mut() {
                Some(s) if s.start + s.len as i64 == x => s.len += 1,
                _ => segs.push(Segment { start: x, stride: 1, len: 1 }),
            }
        }
    }
    Positions::from_segments(segs).expect("stride-1 segments of valid positions")
}

/// The rows `runs` of a `[b, n, w]` buffer (the buffer itself when they are all of it).
pub(super) fn gather<Be: Backend>(be: &Be, x: &Be::Buf, b: usize, n: usize, w: usize, runs: &Runs) -> Result<Be::Buf> {
    if runs.len() == 1 && runs[0] == (0, n) {
        return Ok(x.clone());
    }
    let parts = runs.iter().map(|&(a, m)| be.seq_slice(x, b, n, w, a, m)).collect::<Result<Vec<_>>>()?;
    be.concat_seq(&parts, b, w)
}

/// A partial over the rows `runs` of a `[b, n, w]` f32 buffer, widened to all `n` rows (zeros
/// elsewhere).
pub(super) fn widen<Be: Backend>(
    be: &Be,
    part: &Be::Buf,
    b: usize,
    n: usize,
    w: usize,
    runs: &Runs,
) -> Result<Be::Buf> {
    let rows: usize = runs.iter().map(|r| r.1).sum();
    let mut parts = Vec::with_capacity(2 * runs.len() + 1);
    let (mut at, mut from) = (0usize, 0usize);
    for &(a, m) in runs {
        if a > at {
            parts.push(be.filled(b * (a - at) * w, 0.0, DType::F32)?);
        }
        parts.push(be.seq_slice(part, b, rows, w, from, m)?);
        at = a + m;
        from += m;
    }
    if n > at {
        parts.push(be.filled(b * (n - at) * w, 0.0, DType::F32)?);
    }
    be.concat_seq(&parts, b, w)
}

/// A posted hop: its sends and, when this rank receives, the pair's receives.
struct Hop<B> {
    sends: Vec<SendHandle>,
    recvs: Option<(RecvHandle<B>, RecvHandle<B>)>,
}

impl<B: Payload> Hop<B> {
    fn wait_sends(self) -> Result<Option<(RecvHandle<B>, RecvHandle<B>)>> {
        for s in self.sends {
            s.wait()?;
        }
        Ok(self.recvs)
    }
}

/// Posts a pair (K and V, or dK and dV) to `to` (if any) and the receive of a pair of
/// `want` values from `from` (if any), as one batch.
fn post_pair<B: Payload>(
    comm: &dyn Communicator<Buf = B>,
    tag: Tag,
    send: Option<(usize, B, B)>,
    recv: Option<(usize, [usize; 2], Elem)>,
) -> Result<Hop<B>> {
    let recvs = match recv {
        Some((from, want, elem)) => {
            vec![RecvOp { from, tag, len: want[0], elem }, RecvOp { from, tag: tag + 1, len: want[1], elem }]
        }
        None => Vec::new(),
    };
    let sends = match send {
        Some((to, a, b)) => vec![SendOp { to, tag, data: a }, SendOp { to, tag: tag + 1, data: b }],
        None => Vec::new(),
    };
    if recvs.is_empty() && sends.is_empty() {
        return Ok(Hop { sends: Vec::new(), recvs: None });
    }
    let Posted { recvs, sends } = comm.post(recvs, sends)?;
    let mut recvs = recvs.into_iter();
    let pair = match (recvs.next(), recvs.next()) {
        (Some(a), Some(b)) => Some((a, b)),
        (None, None) => None,
        _ => return Err(Error::InvalidArgument("internal: half of a posted pair".into())),
    };
    Ok(Hop { sends, recvs: pair })
}

/// The view of one rank's schedule at hop `t`: peers and sizes.
struct At<'a, B> {
    x: &'a RingInputs<'a, B>,
    sched: &'a DirectSchedule,
    p: usize,
    r: usize,
}

impl<B> At<'_, B> {
    /// K and V lengths of `rows` rows.
    fn kv_len(&self, rows: usize) -> [usize; 2] {
        let n = self.x.b * rows * self.x.h_kv;
        [n * self.x.d_qk, n * self.x.d_v]
    }

    fn to(&self, t: usize) -> usize {
        (self.r + t) % self.p
    }

    fn from(&self, t: usize) -> usize {
        (self.r + self.p - t) % self.p
    }

    /// Posts hop `t`'s K/V exchange (nothing past the last hop).
    fn post_kv<Be: Backend<Buf = B>>(
        &self,
        comm: &dyn Communicator<Buf = B>,
        be: &Be,
        base: Tag,
        t: usize,
    ) -> Result<Hop<B>>
    where
        B: Payload,
    {
        if t >= self.sched.extent() {
            return Ok(Hop { sends: Vec::new(), recvs: None });
        }
        let x = self.x;
        let n = x.pos[self.r].len();
        let runs = &self.sched.send[t];
        let send = if runs.is_empty() {
            None
        } else {
            let k = gather(be, x.k, x.b, n, x.h_kv * x.d_qk, runs)?;
            let v = gather(be, x.v, x.b, n, x.h_kv * x.d_v, runs)?;
            Some((self.to(t), k, v))
        };
        let recv = self.sched.recv[t].as_ref().map(|pos| (self.from(t), self.kv_len(pos.len()), x.k.elem()));
        post_pair(comm, base + KV_TAG + 2 * t as Tag, send, recv)
    }

    /// Hop `t`'s block (K, V and their positions), when this rank's queries see any pair in
    /// it: its own at hop 0; later, what `posted` (hop `t`'s exchange) receives — replaced
    /// first by hop `t + 1`'s exchange, so that it travels while this block is computed.
    #[allow(clippy::type_complexity)]
    fn block<Be: Backend<Buf = B>>(
        &self,
        comm: &dyn Communicator<Buf = B>,
        be: &Be,
        base: Tag,
        t: usize,
        posted: &mut Hop<B>,
    ) -> Result<Option<(B, B, Positions)>>
    where
        B: Payload,
    {
        let x = self.x;
        if t == 0 {
            let own = &x.pos[self.r];
            let seen = super::ring::block_visible(x.params, own, own)?;
            return Ok(seen.then(|| (x.k.clone(), x.v.clone(), own.clone())));
        }
        let hop = std::mem::replace(posted, self.post_kv(comm, be, base, t + 1)?);
        // Received rows hold a visible pair by construction.
        match (hop.wait_sends()?, &self.sched.recv[t]) {
            (Some(pair), Some(pos)) => {
                let (k, v) = wait_pair(pair, self.kv_len(pos.len()), "K/V rows", self.from(t))?;
                Ok(Some((k, v, pos.clone())))
            }
            _ => Ok(None),
        }
    }
}

/// The direct schedule's forward: this rank's merged `(o, lse)` in f32.
pub(crate) fn forward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &RingInputs<Be::Buf>,
    sched: &DirectSchedule,
    base: Tag,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf)> {
    let (p, r) = (comm.size(), comm.rank());
    let at = At { x, sched, p, r };
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = sched.extent();
    stats.hops = hops;
    stats.skipped_hops = sched.idle_hops();
    let q = be.step_input(x.q)?;
    let mut merged: Option<(Be::Buf, Be::Buf)> = None;
    let mut posted = at.post_kv(comm, be, base, 1)?;
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let start = Instant::now();
        let block = at.block(comm, be, base, t, &mut posted)?;
        stats.waiting += start.elapsed();
        match block {
            Some((k, v, k_pos)) => {
                let start = Instant::now();
                let dims = x.dims(n, k_pos.len());
                x.merge_partial(
                    be,
                    &mut merged,
                    be.forward_block(dims, &q, &k, &v, q_pos, &k_pos, x.params)?.wait()?,
                    n,
                )?;
                stats.compute += start.elapsed();
                stats.blocks += 1;
                stats.step(c0, w0, x.block_flops(n, k_pos.len()));
            }
            None => stats.step(c0, w0, 0.0),
        }
    }
    posted.wait_sends()?;
    x.merged_or_empty(be, merged, n)
}

/// The direct schedule's backward: this rank's `(dq, dk, dv)` in f32 from its final `o`, `lse`
/// and `d_o`. The partials of this rank's K/V rows come back from the ranks that used them and
/// are added in hop order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &RingInputs<Be::Buf>,
    sched: &DirectSchedule,
    base: Tag,
    (o, lse, d_o): (&Be::Buf, &Be::Buf, &Be::Buf),
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
    let (p, r) = (comm.size(), comm.rank());
    let at = At { x, sched, p, r };
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = sched.extent();
    stats.hops = hops;
    stats.skipped_hops = sched.idle_hops();
    let (q, o, d_o) = (be.step_input(x.q)?, be.step_input(o)?, be.step_input(d_o)?);
    let delta = be.softmax_grad_rowsum(x.dims(n, n), &o, &d_o)?;
    let (wk, wv) = (x.h_kv * x.d_qk, x.h_kv * x.d_v);
    let mut dq: Option<Be::Buf> = None;
    let mut own: Option<(Be::Buf, Be::Buf)> = None;
    let mut partials: Vec<(usize, Hop<Be::Buf>)> = Vec::new();
    let mut posted = at.post_kv(comm, be, base, 1)?;
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let start = Instant::now();
        let block = at.block(comm, be, base, t, &mut posted)?;
        stats.waiting += start.elapsed();
        let start = Instant::now();
        let mut flops = 0.0;
        let mut part: Option<(Be::Buf, Be::Buf)> = None;
        if let Some((k, v, k_pos)) = block {
            let dims = x.dims(n, k_pos.len());
            let (gq, gk, gv) =
                be.backward_block(dims, &q, &k, &v, &o, lse, &d_o, &delta, q_pos, &k_pos, x.params)?.wait()?;
            super::ring::accumulate(be, &mut dq, gq)?;
            stats.blocks += 1;
            flops = crate::flops::backward_ratio(&dims) * x.block_flops(n, k_pos.len());
            if t == 0 {
                own = Some((gk, gv));
            } else {
                part = Some((gk, gv));
            }
        }
        stats.compute += start.elapsed();
        if t > 0 {
            // The partials of hop t: ours of rank r − t's rows back to it, and those of our rows
            // that rank r + t used, from it.
            let send = part.map(|(a, b)| (at.from(t), a, b));
            let mine = &sched.send[t];
            let recv = (!mine.is_empty()).then(|| {
                let rows: usize = mine.iter().map(|r| r.1).sum();
                (at.to(t), at.kv_len(rows), Elem::F32)
            });
            partials.push((t, post_pair(comm, base + PART_TAG + 2 * t as Tag, send, recv)?));
        }
        stats.step(c0, w0, flops);
    }
    posted.wait_sends()?;
    let start = Instant::now();
    let (mut dk, mut dv) = match own {
        Some(pair) => pair,
        None => (be.filled(x.b * n * wk, 0.0, DType::F32)?, be.filled(x.b * n * wv, 0.0, DType::F32)?),
    };
    for (t, hop) in partials {
        if let Some(pair) = hop.wait_sends()? {
            let runs = &sched.send[t];
            let rows: usize = runs.iter().map(|r| r.1).sum();
            let (pk, pv) = wait_pair(pair, at.kv_len(rows), "dK/dV partials", at.to(t))?;
            be.add_into(&mut dk, &widen(be, &pk, x.b, n, wk, runs)?)?;
            be.add_into(&mut dv, &widen(be, &pv, x.b, n, wv, runs)?)?;
        }
    }
    stats.waiting += start.elapsed();
    let dq = match dq {
        Some(dq) => dq,
        None => be.filled(x.dq_len(n), 0.0, DType::F32)?,
    };
    Ok((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Documents, Layout, Mask};

    /// Aligned runs cover the exact ones with whole windows (clipped at the block's end).
    #[test]
    fn aligned_runs_cover_whole_windows() {
        let n = 20000; // windows of 512
        assert_eq!(aligned(vec![(3, 2), (600, 10), (1030, 1)], n), vec![(0, 1536)]);
        assert_eq!(aligned(vec![(3, 2), (1100, 10)], n), vec![(0, 512), (1024, 512)]);
        assert_eq!(aligned(vec![(19990, 5)], n), vec![(19968, 32)]);
        assert_eq!(aligned(vec![(70, 3)], 2000), vec![(64, 64)]); // windows of 64
        assert_eq!(aligned(vec![(70, 3)], 1000), vec![(70, 3)]); // row-exact
        assert_eq!(aligned(vec![(2, 1)], 10), vec![(2, 1)]);
        assert_eq!(aligned(Vec::new(), 10), Vec::new());
    }

    /// The rows with a visible pair, row by row (before alignment).
    #[test]
    fn sent_rows_are_exactly_the_visible_ones() {
        let docs = Documents::new(vec![40, 7, 90, 3, 60]).unwrap();
        let s = 200;
        for mask in [Mask::Causal, Mask::None, Mask::Window { left: Some(5), right: Some(2) }] {
            for with_docs in [true, false] {
                let params = AttentionParams { mask, documents: with_docs.then(|| docs.clone()), ..Default::default() };
                for layout in [Layout::Zigzag, Layout::Striped, Layout::Balanced, Layout::Contiguous] {
                    let pos = layout.positions_for(&params, s, 3).unwrap();
                    for to in 0..3 {
                        let seen = visible_keys(&params, &pos[to]).unwrap();
                        for from in 0..3 {
                            let runs = runs_within(&pos[from], &seen);
                            let got: Vec<i64> = positions_of(&pos[from], &runs).to_vec();
                            let want: Vec<i64> = pos[from]
                                .iter()
                                .filter(|&k| {
                                    pos[to].iter().any(|q| {
                                        let same = params
                                            .documents
                                            .as_ref()
                                            .is_none_or(|d| d.document_of(q) == d.document_of(k));
                                        same && mask.allows(q, k)
                                    })
                                })
                                .collect();
                            assert_eq!(got, want, "{mask:?} docs {with_docs} {layout:?} {from}→{to}");
                        }
                    }
                }
            }
        }
    }
}
