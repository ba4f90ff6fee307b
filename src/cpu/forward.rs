//! Tiled flash-attention forward on f32 buffers.
//!
//! One task per (batch, query head, query tile), run by rayon. Each task keeps the running
//! row maximum `m` (in log2 units), row sum `l` and unnormalised output `acc` of its tile
//! and visits the key tiles of its kv head: `S = (scale·log2 e)·Q Kᵀ` by GEMM, the mask on
//! partial tiles, `P = 2^(S − m_new)`, rescale by `2^(m_old − m_new)`, `acc += P V` by GEMM.
//! Skipped tiles are never touched. Memory: the outputs plus `block_q × (block_k + d)` per task.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::matmul::{matmul, View};
use super::simd;
use super::tiles::{classify, rows_finite, spans, DisjointWriter, TileConfig, TileKind};
use crate::params::Visibility;
use crate::Dims;

pub(crate) struct ForwardInputs<'a> {
    pub dims: Dims,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub vis: &'a Visibility,
    pub scale: f32,
    pub tiles: TileConfig,
    /// Incremented by the number of query rows finished per (row, head).
    pub progress: Option<&'a AtomicU64>,
}

/// Returns `(o [b, s_q, h_q, d], lse [b, h_q, s_q])` in f32.
pub(crate) fn forward(x: &ForwardInputs) -> (Vec<f32>, Vec<f32>) {
    let dm = x.dims;
    let d = dm.d;
    let mut o = vec![0.0f32; dm.b * dm.s_q * dm.h_q * d];
    let mut lse = vec![f32::NEG_INFINITY; dm.b * dm.h_q * dm.s_q];
    if o.is_empty() && lse.is_empty() {
        return (o, lse);
    }
    let (bq, bk) = (x.tiles.block_q.max(1), x.tiles.block_k.max(1));
    let q_spans = spans(&x.vis.q_pos, x.vis.q_doc.as_deref(), bq);
    let k_spans = spans(&x.vis.k_pos, x.vis.k_doc.as_deref(), bk);
    let o_out = DisjointWriter::new(&mut o);
    let lse_out = DisjointWriter::new(&mut lse);
    let n_tasks = dm.b * dm.h_q * q_spans.len();
    (0..n_tasks).into_par_iter().for_each_init(
        || Scratch::new(bq, bk, d),
        |sc, t| {
            let qt = t % q_spans.len();
            let bh = t / q_spans.len();
            let (b, h) = (bh / dm.h_q, bh % dm.h_q);
            let qs = q_spans[qt];
            sc.run(x, b, h, &qs, &k_spans);
            // SAFETY: task (b, h, qt) alone writes rows (b, qs.start.., h) of `o` and
            // the range (b, h, qs.start..) of `lse`.
            let (o_rows, lse_rows) = unsafe {
                let lse_rows = lse_out.range((b * dm.h_q + h) * dm.s_q + qs.start, qs.len);
                let mut o_rows = Vec::with_capacity(qs.len);
                for i in 0..qs.len {
                    let at = ((b * dm.s_q + qs.start + i) * dm.h_q + h) * d;
                    o_rows.push(o_out.range(at, d));
                }
                (o_rows, lse_rows)
            };
            sc.finish(o_rows, lse_rows);
            if let Some(p) = x.progress {
                p.fetch_add(qs.len as u64, Ordering::Relaxed);
            }
        },
    );
    (o, lse)
}

/// Per-task state and scratch, reused across tasks on one thread.
struct Scratch {
    d: usize,
    rows: usize,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    s: Vec<f32>,
}

impl Scratch {
    fn new(bq: usize, bk: usize, d: usize) -> Self {
        Scratch {
            d,
            rows: 0,
            m: vec![0.0; bq],
            l: vec![0.0; bq],
            acc: vec![0.0; bq * d],
            s: vec![0.0; bq * bk],
        }
    }

    fn run(&mut self, x: &ForwardInputs, b: usize, h: usize, qs: &super::tiles::Span, k_spans: &[super::tiles::Span]) {
        let dm = x.dims;
        let d = dm.d;
        let hk = dm.kv_head(h);
        let (br, q_rs, kv_rs) = (qs.len, dm.h_q * d, dm.h_kv * d);
        self.rows = br;
        self.m[..br].fill(f32::NEG_INFINITY);
        self.l[..br].fill(0.0);
        self.acc[..br * d].fill(0.0);
        let c = x.scale * std::f32::consts::LOG2_E;
        let q_base = &x.q[(b * dm.s_q * dm.h_q + h) * d..];
        let k_base = &x.k[(b * dm.s_k * dm.h_kv + hk) * d..];
        let v_base = &x.v[(b * dm.s_k * dm.h_kv + hk) * d..];
        let q_tile = View::rows(q_base, qs.start, br, d, q_rs);
        let mut q_finite: Option<bool> = None;
        for ks in k_spans {
            let kind = classify(x.vis, qs, ks);
            if kind == TileKind::Skip {
                continue;
            }
            let bc = ks.len;
            let k_tile = View::rows(k_base, ks.start, bc, d, kv_rs);
            let v_tile = View::rows(v_base, ks.start, bc, d, kv_rs);
            let s = &mut self.s[..br * bc];
            matmul(s, bc, q_tile, k_tile.t(), c, false);
            let mut exact_pv = false;
            if kind == TileKind::Partial {
                for i in 0..br {
                    for j in 0..bc {
                        if !x.vis.visible(qs.start + i, ks.start + j) {
                            s[i * bc + j] = f32::NEG_INFINITY;
                        }
                    }
                }
                // Masked entries must not leak NaN/Inf through 0 · NaN in the P·V product.
                let qf = *q_finite.get_or_insert_with(|| rows_finite(q_base, qs.start, br, d, q_rs));
                exact_pv = !(qf
                    && rows_finite(k_base, ks.start, bc, d, kv_rs)
                    && rows_finite(v_base, ks.start, bc, d, kv_rs));
            }
            for i in 0..br {
                let row = &mut s[i * bc..(i + 1) * bc];
                let m_old = self.m[i];
                let tile_max = simd::row_max(row);
                let m_new = if tile_max.is_nan() || m_old.is_nan() { f32::NAN } else { m_old.max(tile_max) };
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0); // nothing visible yet in this row
                    continue;
                }
                let sum = simd::exp2_sub_sum(row, m_new);
                let alpha = (m_old - m_new).exp2();
                if alpha != 1.0 {
                    simd::scale(&mut self.acc[i * d..(i + 1) * d], alpha);
                }
                self.l[i] = self.l[i] * alpha + sum;
                self.m[i] = m_new;
            }
            if exact_pv {
                for i in 0..br {
                    let acc = &mut self.acc[i * d..(i + 1) * d];
                    for j in 0..bc {
                        if x.vis.visible(qs.start + i, ks.start + j) {
                            let vj = &v_base[(ks.start + j) * kv_rs..][..d];
                            simd::axpy(acc, s[i * bc + j], vj);
                        }
                    }
                }
            } else {
                let p = View { data: s, rows: br, cols: bc, rs: bc, cs: 1 };
                matmul(&mut self.acc[..br * d], d, p, v_tile, 1.0, true);
            }
        }
    }

    /// Normalises and writes the tile's output rows and LSE.
    fn finish(&self, o_rows: Vec<&mut [f32]>, lse: &mut [f32]) {
        let d = self.d;
        for (i, orow) in o_rows.into_iter().enumerate().take(self.rows) {
            let (m, l) = (self.m[i], self.l[i]);
            if m == f32::NEG_INFINITY || l == 0.0 {
                orow.fill(0.0);
                lse[i] = f32::NEG_INFINITY;
                continue;
            }
            let inv = 1.0 / l;
            for (o, a) in orow.iter_mut().zip(&self.acc[i * d..(i + 1) * d]) {
                *o = a * inv;
            }
            lse[i] = (m + l.log2()) * std::f32::consts::LN_2;
        }
    }
}
