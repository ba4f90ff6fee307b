//! Ulysses all-to-all: sequence-sharded `[b, n_r, h, d]` ⇄ head-sharded `[b, S, h/P, d]`.
//! Each rank receives exactly the kv heads its query heads use; when a contiguous range of
//! query heads does not map onto kv heads uniformly, each query head gets its own replica.

use crate::comm::{all_to_all_v, Communicator, Payload};
use crate::{Error, Result};

use super::backend::Backend;
use super::seq::Shape;

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
