//! Ulysses all-to-all: sequence-sharded `[b, n_r, h, d]` ⇄ head-sharded `[b, S, h/P, d]`.
//! Each rank receives exactly the kv heads its query heads use; when a contiguous range of
//! query heads does not map onto kv heads uniformly, each query head gets its own replica.

use crate::comm::{all_to_all_v, Communicator};
use crate::{Error, Result};

use super::seq::{concat_seq, scatter_heads, select_heads, select_lse_heads, seq_slice, Shape};

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
        if h_q % p != 0 {
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
/// sequence, `[b, S, |heads[rank]|, d]` (ranks' tokens concatenated in rank order).
pub(crate) fn seq_to_heads(comm: &dyn Communicator, x: &[f32], sh: Shape, heads: &[Vec<usize>]) -> Result<Vec<f32>> {
    let sends = heads.iter().map(|hs| select_heads(x, sh, hs)).collect();
    let got = all_to_all_v(comm, sends)?;
    let parts: Vec<&[f32]> = got.iter().map(Vec::as_slice).collect();
    Ok(concat_seq(&parts, sh.b, heads[comm.rank()].len() * sh.d))
}

/// The inverse of [`seq_to_heads`]: `[b, S, |heads[rank]|, d]` → `[b, n_r, h, d]`, where
/// `counts` are the token counts of the ranks. With `sum`, heads computed by several ranks
/// (replicas) are added in rank order; otherwise each head is written once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn heads_to_seq(
    comm: &dyn Communicator,
    y: &[f32],
    b: usize,
    h: usize,
    d: usize,
    counts: &[usize],
    heads: &[Vec<usize>],
    sum: bool,
) -> Result<Vec<f32>> {
    let r = comm.rank();
    let s: usize = counts.iter().sum();
    let w = heads[r].len() * d;
    let mut off = 0;
    let mut sends = Vec::with_capacity(counts.len());
    for &n in counts {
        sends.push(seq_slice(y, b, s, w, off, n));
        off += n;
    }
    let got = all_to_all_v(comm, sends)?;
    let sh = Shape { b, n: counts[r], h, d };
    let mut out = vec![0.0f32; sh.len()];
    for (j, part) in got.iter().enumerate() {
        scatter_heads(&mut out, sh, &heads[j], part, !sum);
    }
    Ok(out)
}

/// LSE `[b, h, n_r]` → `[b, |heads[rank]|, S]`.
pub(crate) fn lse_to_heads(
    comm: &dyn Communicator,
    lse: &[f32],
    b: usize,
    h: usize,
    n: usize,
    heads: &[Vec<usize>],
) -> Result<Vec<f32>> {
    let sends = heads.iter().map(|hs| select_lse_heads(lse, b, h, n, hs)).collect();
    let got = all_to_all_v(comm, sends)?;
    let k = heads[comm.rank()].len();
    let mut out = Vec::with_capacity(got.iter().map(Vec::len).sum());
    for bh in 0..b * k {
        for part in &got {
            let ni = part.len() / (b * k).max(1);
            out.extend_from_slice(&part[bh * ni..(bh + 1) * ni]);
        }
    }
    Ok(out)
}

/// LSE `[b, |heads[rank]|, S]` → `[b, h, n_r]` (each head written once).
pub(crate) fn lse_to_seq(
    comm: &dyn Communicator,
    lse: &[f32],
    b: usize,
    h: usize,
    counts: &[usize],
    heads: &[Vec<usize>],
) -> Result<Vec<f32>> {
    let r = comm.rank();
    let s: usize = counts.iter().sum();
    let k = heads[r].len();
    let mut off = 0;
    let mut sends = Vec::with_capacity(counts.len());
    for &n in counts {
        let mut part = Vec::with_capacity(b * k * n);
        for bh in 0..b * k {
            part.extend_from_slice(&lse[bh * s + off..bh * s + off + n]);
        }
        sends.push(part);
        off += n;
    }
    let got = all_to_all_v(comm, sends)?;
    let n = counts[r];
    let mut out = vec![f32::NEG_INFINITY; b * h * n];
    for (j, part) in got.iter().enumerate() {
        let kj = heads[j].len();
        for bi in 0..b {
            for (i, &hh) in heads[j].iter().enumerate() {
                out[(bi * h + hh) * n..][..n].copy_from_slice(&part[(bi * kj + i) * n..][..n]);
            }
        }
    }
    Ok(out)
}
