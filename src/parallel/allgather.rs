//! All-gather K/V (llama3-style): every rank gathers the whole K/V, attends its queries
//! with global positions, and the backward reduce-scatters dK/dV back to their owners.

use std::time::Instant;

use super::backend::Backend;
use super::seq::{concat_seq, seq_slice};
use super::{concat_positions, LocalData, Stats};
use crate::comm::{all_gather_v, reduce_scatter_v, Communicator};
use crate::{AttentionParams, Dims, Positions, Result};

fn gather_kv(comm: &dyn Communicator, x: &LocalData, stats: &mut Stats) -> Result<(Vec<f32>, Vec<f32>)> {
    let start = Instant::now();
    let w = x.h_kv * x.d;
    let ks = all_gather_v(comm, x.k.clone())?;
    let vs = all_gather_v(comm, x.v.clone())?;
    stats.waiting += start.elapsed();
    let k = concat_seq(&ks.iter().map(Vec::as_slice).collect::<Vec<_>>(), x.b, w);
    let v = concat_seq(&vs.iter().map(Vec::as_slice).collect::<Vec<_>>(), x.b, w);
    Ok((k, v))
}

pub(super) fn forward(
    comm: &dyn Communicator,
    be: &dyn Backend,
    x: &LocalData,
    pos: &[Positions],
    params: &AttentionParams,
    stats: &mut Stats,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (k, v) = gather_kv(comm, x, stats)?;
    let all = concat_positions(pos);
    let q_pos = &pos[comm.rank()];
    let dims = Dims {
        b: x.b,
        s_q: q_pos.len(),
        s_k: all.len(),
        h_q: x.h_q,
        h_kv: x.h_kv,
        d: x.d,
    };
    let start = Instant::now();
    let out = be.forward_block(dims, &x.q, &k, &v, q_pos, &all, params)?.wait()?;
    stats.compute += start.elapsed();
    stats.blocks = 1;
    stats.step(
        Default::default(),
        Default::default(),
        4.0 * (x.b * x.h_q * x.d) as f64 * (q_pos.len() * all.len()) as f64,
    );
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    comm: &dyn Communicator,
    be: &dyn Backend,
    x: &LocalData,
    pos: &[Positions],
    params: &AttentionParams,
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    stats: &mut Stats,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (k, v) = gather_kv(comm, x, stats)?;
    let all = concat_positions(pos);
    let q_pos = &pos[comm.rank()];
    let dims = Dims {
        b: x.b,
        s_q: q_pos.len(),
        s_k: all.len(),
        h_q: x.h_q,
        h_kv: x.h_kv,
        d: x.d,
    };
    let start = Instant::now();
    let big_d = be.softmax_grad_rowsum(
        Dims {
            s_k: q_pos.len(),
            ..dims
        },
        o,
        d_o,
    );
    let (dq, dk_all, dv_all) = be
        .backward_block(dims, &x.q, &k, &v, o, lse, d_o, &big_d, q_pos, &all, params)?
        .wait()?;
    stats.compute += start.elapsed();
    stats.blocks = 1;
    let start = Instant::now();
    let w = x.h_kv * x.d;
    let split = |t: &[f32]| {
        let mut off = 0;
        pos.iter()
            .map(|p| {
                let part = seq_slice(t, x.b, all.len(), w, off, p.len());
                off += p.len();
                part
            })
            .collect::<Vec<_>>()
    };
    let dk = reduce_scatter_v(comm, split(&dk_all))?;
    let dv = reduce_scatter_v(comm, split(&dv_all))?;
    stats.waiting += start.elapsed();
    stats.step(
        Default::default(),
        Default::default(),
        10.0 * (x.b * x.h_q * x.d) as f64 * (q_pos.len() * all.len()) as f64,
    );
    Ok((dq, dk, dv))
}
