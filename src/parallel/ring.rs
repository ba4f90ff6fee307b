//! Ring attention: K/V blocks travel around the ring while each rank attends its queries to
//! the block it holds; (O, LSE) partials merge in f32. The backward sends K/V ahead the same
//! way, with each block's dK/dV accumulators (f32) following it one hop behind.

use std::time::Instant;

use super::backend::Backend;
use super::Stats;
use crate::comm::{Communicator, Tag};
use crate::cpu::tiles::{classify, spans, TileKind};
use crate::params::Visibility;
use crate::{merge, AttentionParams, Dims, Error, Positions, Result};

const KV_TAG: Tag = 0;
const ACC_TAG: Tag = 1 << 20;
const FINAL_TAG: Tag = 2 << 20;

/// The local data of one ring rank. Every rank's queries and keys are the same tokens, at
/// positions `pos[rank]`.
pub(crate) struct RingInputs<'a> {
    pub b: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Positions of the tokens of every ring rank.
    pub pos: &'a [Positions],
    pub params: &'a AttentionParams,
}

impl RingInputs<'_> {
    fn dims(&self, s_q: usize, s_k: usize) -> Dims {
        Dims { b: self.b, s_q, s_k, h_q: self.h_q, h_kv: self.h_kv, d: self.d }
    }

    /// Dense forward FLOPs of one block.
    fn block_flops(&self, n_q: usize, n_k: usize) -> f64 {
        4.0 * (self.b * self.h_q * self.d) as f64 * n_q as f64 * n_k as f64
    }

    fn kv_len(&self, rank: usize) -> usize {
        self.b * self.pos[rank].len() * self.h_kv * self.d
    }
}

/// Whether any query at `qp` may see any key at `kp` (false only when provably none does).
pub(crate) fn block_visible(params: &AttentionParams, qp: &Positions, kp: &Positions) -> Result<bool> {
    if qp.is_empty() || kp.is_empty() {
        return Ok(false);
    }
    let vis = Visibility::new(params, qp, kp)?;
    let q = spans(&vis.q_pos, vis.q_doc.as_deref(), usize::MAX)[0];
    let k = spans(&vis.k_pos, vis.k_doc.as_deref(), usize::MAX)[0];
    Ok(classify(&vis, &q, &k) != TileKind::Skip)
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

fn check_len(got: &[f32], want: usize, what: &str, peer: usize) -> Result<()> {
    if got.len() != want {
        return Err(Error::ShapeMismatch(format!("{what} from rank {peer}: {} values, expected {want}", got.len())));
    }
    Ok(())
}

/// Ring forward: returns this rank's `(o, lse)` in f32.
pub(crate) fn forward(
    comm: &dyn Communicator,
    be: &dyn Backend,
    x: &RingInputs,
    stats: &mut Stats,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (p, r) = (comm.size(), comm.rank());
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = hops_needed(x.params, x.pos)?;
    stats.hops = hops;
    let mut o = vec![0.0f32; x.b * n * x.h_q * x.d];
    let mut lse = vec![f32::NEG_INFINITY; x.b * x.h_q * n];
    let mut cur: Vec<f32> = [x.k, x.v].concat();
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let src = (r + p - t) % p;
        let (send, recv) = if t + 1 < hops {
            (Some(comm.isend(next, KV_TAG + t as Tag, cur.clone())?), Some(comm.irecv(prev, KV_TAG + t as Tag)?))
        } else {
            (None, None)
        };
        // Enqueue this hop's block, then wait for the next K/V while it runs.
        let k_pos = &x.pos[src];
        let kl = x.kv_len(src);
        let start = Instant::now();
        let step = if block_visible(x.params, q_pos, k_pos)? {
            let dims = x.dims(n, k_pos.len());
            Some(be.forward_block(dims, x.q, &cur[..kl], &cur[kl..], q_pos, k_pos, x.params)?)
        } else {
            None
        };
        stats.compute += start.elapsed();
        let start = Instant::now();
        if let Some(h) = send {
            h.wait()?;
        }
        let incoming = match recv {
            Some(h) => {
                let got = h.wait()?;
                check_len(&got, 2 * x.kv_len((src + p - 1) % p), "K/V block", prev)?;
                Some(got)
            }
            None => None,
        };
        stats.waiting += start.elapsed();
        if let Some(step) = step {
            let start = Instant::now();
            let (ob, lb) = step.wait()?;
            merge::merge_into(&mut o, &mut lse, &ob, &lb, [x.b, n, x.h_q, x.d])?;
            stats.compute += start.elapsed();
            stats.blocks += 1;
            stats.step(c0, w0, x.block_flops(n, k_pos.len()));
        } else {
            stats.step(c0, w0, 0.0);
        }
        if let Some(next_kv) = incoming {
            cur = next_kv;
        }
    }
    Ok((o, lse))
}

/// Ring backward: given this rank's final `o`, `lse` (f32) and `d_o`, returns its `(dq, dk,
/// dv)` in f32. dQ accumulates locally; each K/V block's dK/dV accumulate in f32 as they
/// travel with it and return to the block's owner at the end.
pub(crate) fn backward(
    comm: &dyn Communicator,
    be: &dyn Backend,
    x: &RingInputs,
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    stats: &mut Stats,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (p, r) = (comm.size(), comm.rank());
    let q_pos = &x.pos[r];
    let n = q_pos.len();
    let hops = hops_needed(x.params, x.pos)?;
    stats.hops = hops;
    let big_d = be.softmax_grad_rowsum(x.dims(n, n), o, d_o);
    let mut dq = vec![0.0f32; x.b * n * x.h_q * x.d];
    let mut cur: Vec<f32> = [x.k, x.v].concat();
    let mut acc: Vec<f32> = vec![0.0; cur.len()];
    let mut acc_recv = None;
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    for t in 0..hops {
        let (c0, w0) = (stats.compute, stats.waiting);
        let src = (r + p - t) % p;
        let (send, recv) = if t + 1 < hops {
            (Some(comm.isend(next, KV_TAG + t as Tag, cur.clone())?), Some(comm.irecv(prev, KV_TAG + t as Tag)?))
        } else {
            (None, None)
        };
        let k_pos = &x.pos[src];
        let kl = x.kv_len(src);
        let start = Instant::now();
        let step = if block_visible(x.params, q_pos, k_pos)? {
            let (cur_k, cur_v) = cur.split_at(kl);
            let dims = x.dims(n, k_pos.len());
            Some(be.backward_block(dims, x.q, cur_k, cur_v, o, lse, d_o, &big_d, q_pos, k_pos, x.params)?)
        } else {
            None
        };
        let grads = match step {
            Some(step) => {
                let g = step.wait()?;
                for (a, b) in dq.iter_mut().zip(&g.0) {
                    *a += b;
                }
                stats.blocks += 1;
                Some(g)
            }
            None => None,
        };
        stats.compute += start.elapsed();
        let step_flops = if grads.is_some() { 2.5 * x.block_flops(n, k_pos.len()) } else { 0.0 };
        let start = Instant::now();
        // The accumulators of this block arrive from the previous rank (none at hop 0).
        if let Some(h) = acc_recv.take() {
            let h: crate::comm::RecvHandle = h;
            acc = h.wait()?;
            check_len(&acc, 2 * kl, "dK/dV accumulators", prev)?;
        }
        if let Some((_, dk, dv)) = grads {
            for (a, b) in acc[..kl].iter_mut().zip(&dk) {
                *a += b;
            }
            for (a, b) in acc[kl..].iter_mut().zip(&dv) {
                *a += b;
            }
        }
        if t + 1 < hops {
            comm.isend(next, ACC_TAG + t as Tag, std::mem::take(&mut acc))?.wait()?;
            acc_recv = Some(comm.irecv(prev, ACC_TAG + t as Tag)?);
        }
        if let Some(h) = send {
            h.wait()?;
        }
        if let Some(h) = recv {
            cur = h.wait()?;
            check_len(&cur, 2 * x.kv_len((src + p - 1) % p), "K/V block", prev)?;
        }
        stats.waiting += start.elapsed();
        stats.step(c0, w0, step_flops);
    }
    // After the last hop this rank holds the accumulators of block (r − hops + 1): send them
    // to their owner and receive its own from the rank holding them.
    let holder_of_mine = (r + hops - 1) % p;
    let owner_of_held = (r + p - (hops - 1) % p) % p;
    let mine = if holder_of_mine == r {
        acc
    } else {
        let h = comm.irecv(holder_of_mine, FINAL_TAG)?;
        comm.isend(owner_of_held, FINAL_TAG, acc)?.wait()?;
        let got = h.wait()?;
        check_len(&got, 2 * x.kv_len(r), "final dK/dV", holder_of_mine)?;
        got
    };
    let kl = x.kv_len(r);
    Ok((dq, mine[..kl].to_vec(), mine[kl..].to_vec()))
}
