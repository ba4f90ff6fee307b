//! Ring attention: K/V blocks travel around the ring while each rank attends its queries to
//! the block it holds; (O, LSE) partials merge in f32. The backward sends K/V ahead the same
//! way, with each block's dK/dV accumulators (f32) following it one hop behind.

use std::time::Instant;

use super::backend::Backend;
use super::direct::{self, DirectSchedule};
use super::plan::QueryHeads;
use super::{Driver, LocalData, ParallelParams, ParallelPlan, Rules, Stats};
use crate::attention::{classify, spans, TileKind};
use crate::comm::{Communicator, Payload, Posted, RecvHandle, RecvOp, SendHandle, SendOp, Tag};
use crate::params::Visibility;
use crate::{AttentionParams, DType, Dims, Elem, Error, Positions, Result};

/// Tags, as offsets in the call's tag block ([`Communicator::next_tag_block`]): K of hop t
/// is `KV_TAG + 2t`, V is `KV_TAG + 2t + 1`; likewise for the dK/dV accumulators and the
/// final return of each block's accumulators. A block holds [`crate::comm::TAG_BLOCK`] tags:
/// rings of up to `ACC_TAG / 2` ranks.
const KV_TAG: Tag = 0;
const ACC_TAG: Tag = 1 << 18;
const FINAL_TAG: Tag = 2 << 18;
const _: () = assert!(FINAL_TAG + 2 <= crate::comm::TAG_BLOCK);

/// The first tag of this call's block, after checking that the ring's tags fit in it.
fn tag_block<B: Payload>(comm: &dyn Communicator<Buf = B>) -> Result<Tag> {
    if 2 * comm.size() as Tag > ACC_TAG {
        return Err(Error::Parallel(format!("a ring of {} ranks (at most {})", comm.size(), ACC_TAG / 2)));
    }
    Ok(comm.next_tag_block())
}

/// The ring over all ranks (one rank: plain attention).
pub(super) struct Ring;

/// One rank, no sequence parallelism: the ring on a world of one.
pub(super) struct Single;

impl Rules for Single {
    const CHECK_WORLD: (usize, Option<usize>) = (1, None);

    fn validate(_params: &ParallelParams, world: usize, _h_q: usize) -> Result<()> {
        if world != 1 {
            return Err(Error::Parallel(format!("strategy single runs on one rank, not {world}")));
        }
        Ok(())
    }
}

impl Rules for Ring {
    // Three ranks: a hop between neighbours that are not each other's only peer.
    const CHECK_WORLD: (usize, Option<usize>) = (3, None);
}

impl Driver for Ring {
    fn forward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf)> {
        let inputs = x.ring_inputs(plan.resolved.all_positions(), plan, &plan.resolved.params().attention);
        let merged = forward(&*plan.comm, &*plan.backend, &inputs, stats)?;
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
        let inputs = x.ring_inputs(plan.resolved.all_positions(), plan, &plan.resolved.params().attention);
        plan.grads_in_dtype(backward(&*plan.comm, &*plan.backend, &inputs, o, lse, d_o, stats)?)
    }
}

/// The local data of one ring rank. Every rank's queries and keys are the same tokens, at
/// positions `pos[rank]`.
pub(crate) struct RingInputs<'a, B> {
    pub b: usize,
    pub h_q: usize,
    pub h_kv: usize,
    /// Head dims of q/k and of v/o.
    pub d_qk: usize,
    pub d_v: usize,
    pub q: &'a B,
    pub k: &'a B,
    pub v: &'a B,
    /// Positions of the tokens of every ring rank.
    pub pos: &'a [Positions],
    /// Hops the ring runs ([`hops_needed`], computed once by the plan).
    pub hops: usize,
    pub params: &'a AttentionParams,
    /// The zero-redundant schedule, when the plan chose it (`direct.rs`).
    pub direct: Option<&'a DirectSchedule>,
}

impl<B> RingInputs<'_, B> {
    pub(super) fn dims(&self, s_q: usize, s_k: usize) -> Dims {
        Dims { b: self.b, s_q, s_k, h_q: self.h_q, h_kv: self.h_kv, d_qk: self.d_qk, d_v: self.d_v }
    }

    /// Dense forward FLOPs of one block.
    pub(super) fn block_flops(&self, n_q: usize, n_k: usize) -> f64 {
        let dims = self.dims(n_q, n_k);
        crate::flops::flops(&dims, crate::flops::dense_pairs(&dims), crate::flops::Pass::Forward)
    }

    /// Lengths of rank `rank`'s K and V blocks (and of their gradients).
    pub(super) fn kv_len(&self, rank: usize) -> [usize; 2] {
        let rows = self.b * self.pos[rank].len() * self.h_kv;
        [rows * self.d_qk, rows * self.d_v]
    }

    /// Length of this rank's `o` (f32 `[b, n, h_q, d_v]`) for `n` query rows.
    pub(super) fn o_len(&self, n: usize) -> usize {
        self.b * n * self.h_q * self.d_v
    }

    /// Length of this rank's `dq` (f32 `[b, n, h_q, d_qk]`) for `n` query rows.
    pub(super) fn dq_len(&self, n: usize) -> usize {
        self.b * n * self.h_q * self.d_qk
    }

    /// Merges a block's `(o, lse)` partial over `n` query rows into the running result (the
    /// first partial taken as it is).
    pub(super) fn merge_partial<Be: Backend<Buf = B>>(
        &self,
        be: &Be,
        merged: &mut Option<(B, B)>,
        (ob, lb): (B, B),
        n: usize,
    ) -> Result<()> {
        match merged {
            None => *merged = Some((ob, lb)),
            Some((o, lse)) => {
                be.merge_into(o, lse, &ob, &lb, [self.b, n, self.h_q, self.d_v])?;
                be.recycle(ob);
                be.recycle(lb);
            }
        }
        Ok(())
    }

    /// The merged `(o, lse)` over `n` query rows, or, when no block was visible to any query
    /// of the rank, o = 0 and lse = -inf.
    pub(super) fn merged_or_empty<Be: Backend<Buf = B>>(
        &self,
        be: &Be,
        merged: Option<(B, B)>,
        n: usize,
    ) -> Result<(B, B)> {
        match merged {
            Some(partial) => Ok(partial),
            None => Ok((
                be.filled(self.o_len(n), 0.0, DType::F32)?,
                be.filled(self.b * self.h_q * n, f32::NEG_INFINITY, DType::F32)?,
            )),
        }
    }
}

/// Adds `x` into the accumulator `acc` (the first `x` taken as it is).
pub(super) fn accumulate<Be: Backend>(be: &Be, acc: &mut Option<Be::Buf>, x: Be::Buf) -> Result<()> {
    match acc {
        None => *acc = Some(x),
        Some(a) => {
            be.add_into(a, &x)?;
            be.recycle(x);
        }
    }
    Ok(())
}

/// Whether any query at `qp` may see any key at `kp` (false only when provably none does),
/// from the positions' segments: O(segments²), not per row. Without documents it is exact
/// when each pair of segments shares a stride (or one of them is a single position) — the
/// contiguous, zigzag and striped layouts — and conservative otherwise (it may answer
/// "visible" for a block whose pairs all fall between the window's bounds). With packed
/// documents the rows' documents decide (per row).
pub(crate) fn block_visible(params: &AttentionParams, qp: &Positions, kp: &Positions) -> Result<bool> {
    if qp.is_empty() || kp.is_empty() {
        return Ok(false);
    }
    if params.documents.is_some() {
        let vis = Visibility::new(params, qp, kp)?;
        let q = spans(&vis.q_pos, vis.q_doc.as_deref(), usize::MAX)[0];
        let k = spans(&vis.k_pos, vis.k_doc.as_deref(), usize::MAX)[0];
        return Ok(classify(&vis, &q, &k) != TileKind::Skip);
    }
    if let Some(scale) = params.scale.filter(|x| !x.is_finite()) {
        return Err(Error::Scale(scale));
    }
    // Key j is visible to query i iff pk - pq lies in [-left, right] (a missing side:
    // unbounded).
    let (left, right) = params.mask.bounds();
    let (lo, hi) = (left.map_or(i64::MIN, |l| -l), right.unwrap_or(i64::MAX));
    for qs in qp.segments().iter().filter(|s| s.len > 0) {
        for ks in kp.segments().iter().filter(|s| s.len > 0) {
            if differences_meet(qs, ks, lo, hi) {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Whether some `pk - pq` (`pq` in segment `q`, `pk` in `k`, both non-empty) may lie in
/// `[lo, hi]`: exact when the differences form one arithmetic run (a shared stride, or a
/// single position on one side), an interval test otherwise.
fn differences_meet(q: &crate::Segment, k: &crate::Segment, lo: i64, hi: i64) -> bool {
    let last = |s: &crate::Segment| s.start.saturating_add(s.stride.saturating_mul(s.len as i64 - 1));
    let d0 = k.start.saturating_sub(q.start);
    // The differences d0 + step·m, m in [m_lo, m_hi].
    let run = match (q.len, k.len) {
        (1, _) => Some((k.stride, 0, k.len as i64 - 1)),
        (_, 1) => Some((q.stride, -(q.len as i64 - 1), 0)),
        _ if q.stride == k.stride => Some((k.stride, -(q.len as i64 - 1), k.len as i64 - 1)),
        _ => None,
    };
    match run {
        Some((step, m_lo, m_hi)) => {
            // The first m whose difference reaches `lo`, then whether it is within reach of
            // `hi` (i128: no overflow at the unbounded sides).
            let (d0, step, lo, hi) = (i128::from(d0), i128::from(step.max(1)), i128::from(lo), i128::from(hi));
            let m = (lo - d0).div_euclid(step) + i128::from((lo - d0).rem_euclid(step) != 0);
            let m = m.max(i128::from(m_lo));
            m <= i128::from(m_hi) && d0 + step * m <= hi
        }
        None => {
            let (min, max) = (k.start.saturating_sub(last(q)), last(k).saturating_sub(q.start));
            max >= lo && min <= hi
        }
    }
}

/// Number of hops the ring needs: one past the last hop at which any rank sees any key of
/// the block it holds (a sliding window stops the ring early). Identical on every rank.
pub(crate) fn hops_needed(params: &AttentionParams, pos: &[Positions]) -> Result<usize> {
    let p = pos.len();
    let mut hops = 1;
    for t in 1..p {
        for r in 0..p {
            if block_visible(params, &pos[r], &pos[(r + p - t) % p])? {
                hops = hops.max(t + 1);
            }
        }
    }
    Ok(hops)
}

fn check_len<B: Payload>(got: &B, want: usize, what: &str, peer: usize) -> Result<()> {
    if got.elements() != want {
        return Err(Error::ShapeMismatch(format!(
            "{what} from rank {peer}: {} values, expected {want}",
            got.elements()
        )));
    }
    Ok(())
}

/// Receives of a pair of buffers (K and V, or dK and dV).
type RecvPair<B> = (RecvHandle<B>, RecvHandle<B>);

/// Posts, as one batch, the receive of the next pair from `from` and the send of a pair of
/// buffers to `to` (handed over: a sender that keeps no handle lets an in-process receiver
/// add into the buffer without a copy). `want` holds the lengths of the incoming pair's
/// buffers (K and V, or dK and dV: `d_qk` and `d_v` wide), whose element type is the
/// outgoing pair's.
fn exchange<B: Payload>(
    comm: &dyn Communicator<Buf = B>,
    to: usize,
    from: usize,
    tag: Tag,
    pair: (B, B),
    want: [usize; 2],
) -> Result<Exchange<B>> {
    let elem = pair.0.elem();
    let recvs = vec![RecvOp { from, tag, len: want[0], elem }, RecvOp { from, tag: tag + 1, len: want[1], elem }];
    let sends = vec![SendOp { to, tag, data: pair.0 }, SendOp { to, tag: tag + 1, data: pair.1 }];
    let Posted { recvs, sends } = comm.post(recvs, sends)?;
    match (<[_; 2]>::try_from(sends), <[_; 2]>::try_from(recvs)) {
        (Ok([sk, sv]), Ok([rk, rv])) => Ok(Exchange { sends: [sk, sv], recvs: (rk, rv) }),
        _ => Err(Error::InvalidArgument("internal: a posted pair without its handles".into())),
    }
}

/// Posts hop `t`'s exchange of K/V blocks (the held pair to `to`, the next from `from`, of
/// `want` values); none after the last hop. The blocks are shared, not copied.
fn post_kv<B: Payload>(
    comm: &dyn Communicator<Buf = B>,
    [to, from]: [usize; 2],
    base: Tag,
    t: usize,
    hops: usize,
    (k, v): (&B, &B),
    want: [usize; 2],
) -> Result<Option<Exchange<B>>> {
    if t + 1 >= hops {
        return Ok(None);
    }
    exchange(comm, to, from, base + KV_TAG + 2 * t as Tag, (k.clone(), v.clone()), want).map(Some)
}

/// A posted [`exchange`]: its sends and the receives of the next pair.
struct Exchange<B> {
    sends: [SendHandle; 2],
    recvs: RecvPair<B>,
}

/// Waits for a posted exchange (if any) and checks that the received buffers hold `want`
/// values; returns the received pair.
fn finish_exchange<B: Payload>(
    posted: Option<Exchange<B>>,
    want: [usize; 2],
    what: &str,
    peer: usize,
) -> Result<Option<(B, B)>> {
    let Some(Exchange { sends, recvs }) = posted else { return Ok(None) };
    for s in sends {
        s.wait()?;
    }
    wait_pair(recvs, want, what, peer).map(Some)
}

/// Waits for a pair of receives from `peer` and checks that they hold `want` values.
pub(super) fn wait_pair<B: Payload>(
    (rk, rv): RecvPair<B>,
    want: [usize; 2],
    what: &str,
    peer: usize,
) -> Result<(B, B)> {
    let (a, b) = (rk.wait()?, rv.wait()?);
    check_len(&a, want[0], what, peer)?;
    check_len(&b, want[1], what, peer)?;
    Ok((a, b))
}

/// Ring forward: returns this rank's `(o, lse)` in f32.
pub(crate) fn forward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &RingInputs<Be::Buf>,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf)> {
    let (p, r) = (comm.size(), comm.rank());
    let base = tag_block(comm)?;
    if let Some(sched) = x.direct {
        return direct::forward(comm, be, x, sched, base, stats);
    }
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = x.hops;
    stats.hops = hops;
    stats.skipped_hops = p - hops;
    // q stays: converted to what the steps read once, not per hop.
    let q = be.step_input(x.q)?;
    // The merged (o, lse): the first block's partial as it is, then merged into.
    let mut merged: Option<(Be::Buf, Be::Buf)> = None;
    let (mut cur_k, mut cur_v) = (x.k.clone(), x.v.clone());
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let src = (r + p - t) % p;
        let incoming_len = x.kv_len((src + p - 1) % p);
        let posted = post_kv(comm, [next, prev], base, t, hops, (&cur_k, &cur_v), incoming_len)?;
        // Enqueue this hop's block, then wait for the next K/V while it runs.
        let k_pos = &x.pos[src];
        let start = Instant::now();
        let step = if block_visible(x.params, q_pos, k_pos)? {
            Some(be.forward_block(x.dims(n, k_pos.len()), &q, &cur_k, &cur_v, q_pos, k_pos, x.params)?)
        } else {
            None
        };
        stats.compute += start.elapsed();
        let start = Instant::now();
        let incoming = finish_exchange(posted, incoming_len, "K/V block", prev)?;
        stats.waiting += start.elapsed();
        if let Some(step) = step {
            let start = Instant::now();
            x.merge_partial(be, &mut merged, step.wait()?, n)?;
            stats.compute += start.elapsed();
            stats.blocks += 1;
            stats.step(c0, w0, x.block_flops(n, k_pos.len()));
        } else {
            stats.step(c0, w0, 0.0);
        }
        if let Some((k, v)) = incoming {
            (cur_k, cur_v) = (k, v);
        }
    }
    x.merged_or_empty(be, merged, n)
}

/// Ring backward: given this rank's final `o`, `lse` (f32) and `d_o`, returns its `(dq, dk,
/// dv)` in f32. dQ accumulates locally; each K/V block's dK/dV accumulate in f32 as they
/// travel with it and return to the block's owner at the end.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    x: &RingInputs<Be::Buf>,
    o: &Be::Buf,
    lse: &Be::Buf,
    d_o: &Be::Buf,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
    let (p, r) = (comm.size(), comm.rank());
    let base = tag_block(comm)?;
    if let Some(sched) = x.direct {
        return direct::backward(comm, be, x, sched, base, (o, lse, d_o), stats);
    }
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = x.hops;
    stats.hops = hops;
    stats.skipped_hops = p - hops;
    // What stays on this rank is converted to what the steps read once, not per hop.
    let (q, o, d_o) = (be.step_input(x.q)?, be.step_input(o)?, be.step_input(d_o)?);
    let delta = be.softmax_grad_rowsum(x.dims(n, n), &o, &d_o)?;
    // dQ and the held block's dK/dV accumulators: the first partial as it is, then added
    // into (zeros where no block contributed).
    let mut dq: Option<Be::Buf> = None;
    let (mut cur_k, mut cur_v) = (x.k.clone(), x.v.clone());
    let zeros = |[k_len, v_len]: [usize; 2]| -> Result<(Be::Buf, Be::Buf)> {
        Ok((be.filled(k_len, 0.0, DType::F32)?, be.filled(v_len, 0.0, DType::F32)?))
    };
    let mut acc: Option<(Be::Buf, Be::Buf)> = None;
    let mut acc_recv: Option<RecvPair<Be::Buf>> = None;
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let src = (r + p - t) % p;
        let incoming_len = x.kv_len((src + p - 1) % p);
        let posted = post_kv(comm, [next, prev], base, t, hops, (&cur_k, &cur_v), incoming_len)?;
        let k_pos = &x.pos[src];
        let kl = x.kv_len(src);
        let start = Instant::now();
        let grads = if block_visible(x.params, q_pos, k_pos)? {
            let dims = x.dims(n, k_pos.len());
            let (gq, gk, gv) =
                be.backward_block(dims, &q, &cur_k, &cur_v, &o, lse, &d_o, &delta, q_pos, k_pos, x.params)?.wait()?;
            accumulate(be, &mut dq, gq)?;
            stats.blocks += 1;
            Some((gk, gv))
        } else {
            None
        };
        stats.compute += start.elapsed();
        let step_flops = match grads {
            Some(_) => crate::flops::backward_ratio(&x.dims(n, k_pos.len())) * x.block_flops(n, k_pos.len()),
            None => 0.0,
        };
        let start = Instant::now();
        // The accumulators of this block arrive from the previous rank (none at hop 0).
        if let Some(pair) = acc_recv.take() {
            acc = Some(wait_pair(pair, kl, "dK/dV accumulators", prev)?);
        }
        if let Some((dk, dv)) = grads {
            match &mut acc {
                None => acc = Some((dk, dv)),
                Some((ak, av)) => {
                    be.add_into(ak, &dk)?;
                    be.add_into(av, &dv)?;
                    be.recycle(dk);
                    be.recycle(dv);
                }
            }
        }
        if t + 1 < hops {
            let tag = base + ACC_TAG + 2 * t as Tag;
            let held = match acc.take() {
                Some(pair) => pair,
                None => zeros(kl)?,
            };
            // The next block's accumulators are the size of the next block.
            let Exchange { sends, recvs } = exchange(comm, next, prev, tag, held, incoming_len)?;
            for s in sends {
                s.wait()?;
            }
            acc_recv = Some(recvs);
        }
        if let Some((k, v)) = finish_exchange(posted, incoming_len, "K/V block", prev)? {
            (cur_k, cur_v) = (k, v);
        }
        stats.waiting += start.elapsed();
        stats.step(c0, w0, step_flops);
    }
    // After the last hop this rank holds the accumulators of block (r − hops + 1): send them
    // to their owner and receive its own from the rank holding them.
    let holder_of_mine = (r + hops - 1) % p;
    let owner_of_held = (r + p - (hops - 1) % p) % p;
    let acc = match acc {
        Some(pair) => pair,
        None => zeros(x.kv_len(owner_of_held))?,
    };
    let dq = match dq {
        Some(dq) => dq,
        None => be.filled(x.dq_len(n), 0.0, DType::F32)?,
    };
    let (dk, dv) = if holder_of_mine == r {
        acc
    } else {
        let [k_len, v_len] = x.kv_len(r);
        let recv = |tag, len| RecvOp { from: holder_of_mine, tag, len, elem: Elem::F32 };
        let send = |tag, data| SendOp { to: owner_of_held, tag, data };
        let posted = comm.post(
            vec![recv(base + FINAL_TAG, k_len), recv(base + FINAL_TAG + 1, v_len)],
            vec![send(base + FINAL_TAG, acc.0), send(base + FINAL_TAG + 1, acc.1)],
        )?;
        for s in posted.sends {
            s.wait()?;
        }
        let mut recvs = posted.recvs.into_iter();
        let (Some(rk), Some(rv)) = (recvs.next(), recvs.next()) else {
            return Err(Error::InvalidArgument("internal: the final receives were not posted".into()));
        };
        let (dk, dv) = (rk.wait()?, rv.wait()?);
        check_len(&dk, k_len, "final dK", holder_of_mine)?;
        check_len(&dv, v_len, "final dV", holder_of_mine)?;
        (dk, dv)
    };
    Ok((dq, dk, dv))
}

#[cfg(test)]
mod visibility_tests {
    use super::block_visible;
    use crate::{AttentionParams, Mask, Positions, Segment};

    /// Whether any pair is visible, row by row.
    fn brute(mask: Mask, q: &Positions, k: &Positions) -> bool {
        let (left, right) = mask.bounds();
        q.iter().any(|pq| k.iter().any(|pk| left.is_none_or(|l| pk >= pq - l) && right.is_none_or(|r| pk <= pq + r)))
    }

    /// The segment test against the rows on random blocks: equal when every pair of
    /// segments shares a stride (or is a single position), never "invisible" for a visible
    /// block otherwise.
    #[test]
    fn segment_visibility_matches_the_rows() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window { left: Some(3), right: Some(0) },
            Mask::Window { left: Some(0), right: Some(5) },
            Mask::Window { left: Some(7), right: Some(2) },
            Mask::Window { left: None, right: Some(4) },
        ];
        for round in 0..4000 {
            let shared = round % 2 == 0;
            let stride = 1 + next(4) as i64;
            let mut block = |n: u64| {
                let segments = (0..1 + next(n))
                    .map(|_| Segment {
                        start: next(60) as i64 - 10,
                        stride: if shared { stride } else { 1 + next(5) as i64 },
                        len: next(6) as usize,
                    })
                    .collect();
                Positions::from_segments(segments).expect("positions")
            };
            let (q, k) = (block(3), block(3));
            for mask in masks {
                let params = AttentionParams { mask, ..Default::default() };
                let got = block_visible(&params, &q, &k).expect("visibility");
                let want = brute(mask, &q, &k);
                if shared {
                    assert_eq!(got, want, "{mask:?}\nq {q:?}\nk {k:?}");
                } else {
                    assert!(got || !want, "a visible block called invisible: {mask:?}\nq {q:?}\nk {k:?}");
                }
            }
        }
    }
}
