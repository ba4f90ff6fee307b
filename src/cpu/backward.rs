//! Tiled flash-attention backward: the task driver both arithmetic paths share ([`drive`])
//! and the f32 path's tile work.
//!
//! `D_i = Σ_c dO_ic O_ic` first. Then one task per (batch, kv head, chunk of key tiles):
//! for each key tile it accumulates `dV += Pᵀ dO` and `dK += dSᵀ Q` in registers-worth of
//! scratch over every query head of its group and every visible query tile, recomputing
//! `P = 2^(scale·log2 e·Q Kᵀ − LSE·log2 e)` and `dS = P ∘ (dO Vᵀ − D)`; `dQ += dS K` goes to
//! a per-task partial over the query rows the task's key tiles can see. The partials of one
//! kv head are summed in chunk order, so gradients
//! are bit-identical run to run whatever the thread count. The number of chunks per head
//! depends on the shape only.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::matmul::{matmul, View};
use super::simd;
use super::tiles::{call_spans, mask_rows, row_blocks, rows_finite, DisjointWriter, Output, PerThread, TileConfig};
use crate::attention::{classify, Span, TileKind};
use crate::params::Visibility;
use crate::Dims;

pub(crate) struct BackwardInputs<'a> {
    pub dims: Dims,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub lse: &'a [f32],
    pub d_o: &'a [f32],
    /// `D = rowsum(dO∘O)` `[b, h_q, s_q]` when already known (computed here otherwise).
    pub delta: Option<&'a [f32]>,
    pub vis: &'a Visibility,
    pub spec: crate::attention::ScoreSpec,
    pub tiles: TileConfig,
    /// Incremented by the number of key rows finished per (row, kv head).
    pub progress: Option<&'a AtomicU64>,
}

/// Target number of tasks per batch; chunks per kv head follow from it (shape-only).
const TASKS_PER_BATCH: usize = 16;

/// Returns `(dq, dk, dv)` in f32, layouts as q, k and v.
pub(crate) fn backward(x: &BackwardInputs) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dm = x.dims;
    let own_d;
    let delta: &[f32] = match x.delta {
        Some(dd) => dd,
        None => {
            own_d = rowsum_do_o(dm, x.o, x.d_o);
            &own_d
        }
    };

    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::F32, crate::flops::Pass::Backward);
    let tiles = Tiles { vis: x.vis, q_spans: &q_spans, k_spans: &k_spans };
    drive(dm, x.spec.scale, &tiles, dm.d_qk, x.progress, || Scratch::new(x, delta, &q_spans, bq, bk))
}

/// The tiles of a backward call: their spans and the visibility that classifies them.
pub(crate) struct Tiles<'a> {
    pub vis: &'a Visibility,
    pub q_spans: &'a [Span],
    pub k_spans: &'a [Span],
}

/// The dQ rows one task adds to: query rows `lo..lo + rows` (those its key tiles can see) of
/// every query head of its group, `[group][rows][rs]`.
pub(crate) struct DqPartial<'a> {
    data: &'a mut [f32],
    lo: usize,
    rows: usize,
    rs: usize,
}

impl DqPartial<'_> {
    /// Rows `start..start + len` of the group's query head `hl`, `[len][rs]`.
    ///
    /// # Panics
    /// When the rows lie outside the task's reach (a query tile its key tiles cannot see).
    pub(crate) fn rows(&mut self, hl: usize, start: usize, len: usize) -> &mut [f32] {
        assert!(start >= self.lo && start + len <= self.lo + self.rows, "dQ rows outside the task's reach");
        &mut self.data[(hl * self.rows + start - self.lo) * self.rs..][..len * self.rs]
    }
}

/// The work of one key tile, as [`drive`] runs it.
pub(crate) trait KeyTileWork {
    /// Computes the (unscaled) dK and dV of key tile `ks` of kv head `hk` in batch `b` over
    /// every query head of its group, adding the tile's (unscaled) dQ into `dq` (rows
    /// `dq_rs` apart, as given to [`drive`]).
    fn key_tile(&mut self, b: usize, hk: usize, ks: &Span, dq: &mut DqPartial);
    /// The last key tile's dK and dV rows with their strides (`[rows][stride]`, the first
    /// `d_qk` and `d_v` columns meaningful): `(dk, dk_stride, dv, dv_stride)`.
    fn grads(&self) -> (&[f32], usize, &[f32], usize);
}

/// Runs one task per (batch, kv head, chunk of key tiles) on rayon's pool, each with a
/// worker from `init` (one per thread per call, reused), and gathers `(dq, dk, dv)` in the
/// output element `O` (dk and dq multiplied by `scale`); the dq
/// partials of one kv head (rows `dq_rs` apart, covering the query rows the chunk's key
/// tiles can see) are summed in chunk order.
pub(crate) fn drive<W: KeyTileWork + Send, O: Output>(
    dm: Dims,
    scale: f32,
    tiles: &Tiles,
    dq_rs: usize,
    progress: Option<&AtomicU64>,
    init: impl Fn() -> W + Sync + Send,
) -> (Vec<O>, Vec<O>, Vec<O>) {
    let (d, d_v) = (dm.d_qk, dm.d_v);
    let mut dk = O::zeroed(dm.b * dm.s_k * dm.h_kv * d);
    let mut dv = O::zeroed(dm.b * dm.s_k * dm.h_kv * d_v);
    if dk.is_empty() {
        return (O::zeroed(dm.b * dm.s_q * dm.h_q * d), dk, dv);
    }
    // Every row of dq is written below (the sum of its partials, zero when none).
    let mut dq = O::for_overwrite(dm.b * dm.s_q * dm.h_q * d);
    if dq.is_empty() {
        return (dq, dk, dv);
    }
    let k_spans = tiles.k_spans;
    let heads = dm.b * dm.h_kv;
    let chunks = TASKS_PER_BATCH.div_ceil(dm.h_kv).clamp(1, k_spans.len());
    let per_chunk = k_spans.len().div_ceil(chunks);
    let chunks = k_spans.len().div_ceil(per_chunk);
    let gs = dm.group();
    let chunk_tiles = |c: usize| &k_spans[c * per_chunk..((c + 1) * per_chunk).min(k_spans.len())];
    // The query rows each chunk's key tiles can see (positions only: the same for every head).
    let reach: Vec<(usize, usize)> = (0..chunks)
        .map(|c| {
            let seen = tiles
                .q_spans
                .iter()
                .filter(|qs| chunk_tiles(c).iter().any(|ks| classify(tiles.vis, qs, ks) != TileKind::Skip));
            seen.fold((usize::MAX, 0), |(lo, hi), qs| (lo.min(qs.start), hi.max(qs.start + qs.len)))
        })
        .map(|(lo, hi)| if lo < hi { (lo, hi - lo) } else { (0, 0) })
        .collect();

    let dk_out = DisjointWriter::new(&mut dk);
    let dv_out = DisjointWriter::new(&mut dv);
    let workers = PerThread::new();
    // The partials, in buffers the calling thread kept from its last call where it has them
    // (see `reuse`), zeroed by the tasks: the products read a partial before writing it,
    // and a read of never-written pages maps the shared zero page, which each first write
    // then copies (a fault and a TLB flush per page).
    let mut partials: Vec<Vec<f32>> =
        (0..heads * chunks).map(|t| super::reuse::take(gs * reach[t % chunks].1 * dq_rs)).collect();
    partials.par_iter_mut().enumerate().for_each(|(t, dq_part)| {
        workers.with(&init, |w| {
            let (bh, c) = (t / chunks, t % chunks);
            let (b, hk) = (bh / dm.h_kv, bh % dm.h_kv);
            let (lo, rows) = reach[c];
            dq_part.fill(0.0);
            let mut dq = DqPartial { data: dq_part, lo, rows, rs: dq_rs };
            for ks in chunk_tiles(c) {
                w.key_tile(b, hk, ks, &mut dq);
                let (dk_rows, k_rs, dv_rows, v_rs) = w.grads();
                for j in 0..ks.len {
                    let row = (b * dm.s_k + ks.start + j) * dm.h_kv + hk;
                    // SAFETY: task (b, hk, chunk) alone writes key rows of its tiles for head hk.
                    let (dk_row, dv_row) = unsafe { (dk_out.range(row * d, d), dv_out.range(row * d_v, d_v)) };
                    O::store(dk_row, &dk_rows[j * k_rs..j * k_rs + d], scale);
                    O::store(dv_row, &dv_rows[j * v_rs..j * v_rs + d_v], 1.0);
                }
                if let Some(p) = progress {
                    p.fetch_add(ks.len as u64, Ordering::Relaxed);
                }
            }
        })
    });

    // Sum the partials of each kv head in chunk order and scatter into dq.
    let dq_out = DisjointWriter::new(&mut dq);
    (0..heads).into_par_iter().for_each(|bh| {
        let (b, hk) = (bh / dm.h_kv, bh % dm.h_kv);
        let parts = &partials[bh * chunks..(bh + 1) * chunks];
        let mut row = vec![0.0f32; d];
        for hl in 0..gs {
            let h = hk * gs + hl;
            for i in 0..dm.s_q {
                let at = ((b * dm.s_q + i) * dm.h_q + h) * d;
                // SAFETY: kv head (b, hk) alone writes the dq rows of its query heads.
                let out = unsafe { dq_out.range(at, d) };
                row.fill(0.0);
                for (p, &(lo, rows)) in parts.iter().zip(&reach) {
                    if (lo..lo + rows).contains(&i) {
                        simd::axpy(&mut row, 1.0, &p[(hl * rows + i - lo) * dq_rs..][..d]);
                    }
                }
                O::store(out, &row, scale);
            }
        }
    });
    partials.into_iter().for_each(super::reuse::keep);
    (dq, dk, dv)
}

/// `D = rowsum(dO ∘ O)`, layout `[b, h_q, s_q]`, from `[b, s_q, h_q, d_v]` rows of f32 or
/// bf16 (widened row by row: no f32 copy of the tensors).
pub(crate) fn rowsum_do_o<T: Copy + Sync + Into<f32>>(dm: Dims, o: &[T], d_o: &[T]) -> Vec<f32> {
    let d = dm.d_v;
    let mut delta = vec![0.0f32; dm.b * dm.h_q * dm.s_q];
    if delta.is_empty() {
        return delta;
    }
    delta.par_chunks_mut(dm.s_q).enumerate().for_each(|(bh, row)| {
        let (b, h) = (bh / dm.h_q, bh % dm.h_q);
        let (mut dor, mut or) = (vec![0.0f32; d], vec![0.0f32; d]);
        for (i, t) in row.iter_mut().enumerate() {
            let at = ((b * dm.s_q + i) * dm.h_q + h) * d;
            for ((x, y), (&a, &c)) in dor.iter_mut().zip(&mut or).zip(d_o[at..at + d].iter().zip(&o[at..at + d])) {
                (*x, *y) = (a.into(), c.into());
            }
            *t = simd::dot(&dor, &or);
        }
    });
    delta
}

struct Scratch<'a> {
    x: &'a BackwardInputs<'a>,
    delta: &'a [f32],
    q_spans: &'a [Span],
    dk: Vec<f32>,
    dv: Vec<f32>,
    p: Vec<f32>,
    dp: Vec<f32>,
    /// The scores' slopes under a soft-cap (empty without one).
    slopes: Vec<f32>,
    /// The key tile's K and V, column-major: `[d_qk][block_k]` and `[d_v][block_k]`.
    k_cm: Vec<f32>,
    v_cm: Vec<f32>,
}

impl<'a> Scratch<'a> {
    fn new(x: &'a BackwardInputs<'a>, delta: &'a [f32], q_spans: &'a [Span], bq: usize, bk: usize) -> Self {
        let (d, d_v) = (x.dims.d_qk, x.dims.d_v);
        Scratch {
            x,
            delta,
            q_spans,
            dk: vec![0.0; bk * d],
            dv: vec![0.0; bk * d_v],
            p: vec![0.0; bq * bk],
            dp: vec![0.0; bq * bk],
            slopes: if x.spec.softcap.is_some() { vec![0.0; bq * bk] } else { Vec::new() },
            k_cm: vec![0.0; bk * d],
            v_cm: vec![0.0; bk * d_v],
        }
    }
}

impl KeyTileWork for Scratch<'_> {
    fn grads(&self) -> (&[f32], usize, &[f32], usize) {
        (&self.dk, self.x.dims.d_qk, &self.dv, self.x.dims.d_v)
    }

    fn key_tile(&mut self, b: usize, hk: usize, ks: &Span, dq: &mut DqPartial) {
        let (x, delta, q_spans) = (self.x, self.delta, self.q_spans);
        let dm = x.dims;
        let (d, d_v) = (dm.d_qk, dm.d_v);
        let gs = dm.group();
        let bc = ks.len;
        let (q_rs, kv_rs, o_rs, v_rs) = (dm.h_q * d, dm.h_kv * d, dm.h_q * d_v, dm.h_kv * d_v);
        let sc = super::score::Scores::of(&x.spec);
        let k_base = &x.k[(b * dm.s_k * dm.h_kv + hk) * d..];
        let v_base = &x.v[(b * dm.s_k * dm.h_kv + hk) * d_v..];
        let k_tile = View::rows(k_base, ks.start, bc, d, kv_rs);
        // K and V of the tile column-major (keys contiguous), once per key tile: as the left
        // operands of S and dP (the product computes their transposes) they are then packed
        // by vector copies, where row-major tiles would be gathered element by element for
        // every query tile.
        simd::transpose(&k_base[ks.start * kv_rs..], kv_rs, &mut self.k_cm[..bc * d], bc, bc, d);
        simd::transpose(&v_base[ks.start * v_rs..], v_rs, &mut self.v_cm[..bc * d_v], bc, bc, d_v);
        let k_cm = View { data: &self.k_cm[..bc * d], rows: bc, cols: d, rs: 1, cs: bc };
        let v_cm = View { data: &self.v_cm[..bc * d_v], rows: bc, cols: d_v, rs: 1, cs: bc };
        let dk = &mut self.dk[..bc * d];
        let dv = &mut self.dv[..bc * d_v];
        dk.fill(0.0);
        dv.fill(0.0);
        let mut kv_finite: Option<bool> = None;
        for hl in 0..gs {
            let h = hk * gs + hl;
            let q_base = &x.q[(b * dm.s_q * dm.h_q + h) * d..];
            let do_base = &x.d_o[(b * dm.s_q * dm.h_q + h) * d_v..];
            let lse = &x.lse[(b * dm.h_q + h) * dm.s_q..][..dm.s_q];
            let dd = &delta[(b * dm.h_q + h) * dm.s_q..][..dm.s_q];
            for qs in q_spans {
                let kind = classify(x.vis, qs, ks);
                if kind == TileKind::Skip {
                    continue;
                }
                let br = qs.len;
                let q_tile = View::rows(q_base, qs.start, br, d, q_rs);
                let do_tile = View::rows(do_base, qs.start, br, d_v, o_rs);
                let p = &mut self.p[..br * bc];
                // On a partial tile each block of query rows computes only the keys it may see
                // (the rest of its rows is masked below: every pair outside its reach is
                // invisible, so P is exactly 0 there).
                let blocks = row_blocks(x.vis, qs, ks, kind);
                for (rows, keys) in &blocks {
                    let k_rows = k_cm.rows_of(keys.clone());
                    matmul(
                        &mut p[rows.start * bc + keys.start..],
                        bc,
                        q_tile.rows_of(rows.clone()),
                        k_rows.t(),
                        sc.factor(),
                        false,
                    );
                }
                // The scores (and their slopes, none without a soft-cap) from the products.
                let sloped = !sc.fused();
                if sloped {
                    sc.finish_row_with_slopes(p, &mut self.slopes[..br * bc]);
                } else {
                    sc.finish_row(p);
                }
                let mut exact = false;
                if kind == TileKind::Partial {
                    mask_rows(x.vis, p, bc, br, bc, qs.start, ks.start);
                    if sloped {
                        // Masked pairs' slopes 0, before P replaces the scores (only a partial
                        // tile masks: a capped score is never -inf otherwise).
                        sc.mask_slopes(p, &mut self.slopes[..br * bc]);
                    }
                    let kvf = *kv_finite.get_or_insert_with(|| {
                        rows_finite(k_base, ks.start, bc, d, kv_rs) && rows_finite(v_base, ks.start, bc, d_v, v_rs)
                    });
                    exact = !(kvf
                        && rows_finite(q_base, qs.start, br, d, q_rs)
                        && rows_finite(do_base, qs.start, br, d_v, o_rs));
                }
                let slopes = sloped.then(|| &self.slopes[..br * bc]);
                for i in 0..br {
                    let row = &mut p[i * bc..(i + 1) * bc];
                    let l = lse[qs.start + i];
                    if l == f32::NEG_INFINITY {
                        row.fill(0.0); // fully masked row: no gradient flows
                    } else {
                        simd::exp2_sub(row, l * std::f32::consts::LOG2_E);
                    }
                }
                let dq_tile = dq.rows(hl, qs.start, br);
                if exact {
                    let bases = Bases { q: q_base, d_o: do_base, k: k_base, v: v_base, dd };
                    exact_tile(x, qs, ks, &bases, p, slopes, dk, dv, dq_tile);
                    continue;
                }
                let dp = &mut self.dp[..br * bc];
                for (rows, keys) in &blocks {
                    let p_view = tile_block(p, (br, bc), rows, keys);
                    matmul(&mut dv[keys.start * d_v..], d_v, p_view.t(), do_tile.rows_of(rows.clone()), 1.0, true);
                    let v_rows = v_cm.rows_of(keys.clone());
                    matmul(
                        &mut dp[rows.start * bc + keys.start..],
                        bc,
                        do_tile.rows_of(rows.clone()),
                        v_rows.t(),
                        1.0,
                        false,
                    );
                    for i in rows.clone() {
                        let at = i * bc + keys.start..i * bc + keys.end;
                        match slopes {
                            None => simd::softmax_grad(&mut p[at.clone()], &dp[at], dd[qs.start + i]),
                            Some(g) => {
                                simd::softmax_grad_sloped(&mut p[at.clone()], &dp[at.clone()], dd[qs.start + i], &g[at])
                            }
                        }
                    }
                }
                for (rows, keys) in &blocks {
                    let ds = tile_block(p, (br, bc), rows, keys);
                    matmul(&mut dk[keys.start * d..], d, ds.t(), q_tile.rows_of(rows.clone()), 1.0, true);
                    matmul(&mut dq_tile[rows.start * d..], d, ds, k_tile.rows_of(keys.clone()), 1.0, true);
                }
            }
        }
    }
}

/// Rows `rows` and columns `keys` of a row-major `br × bc` tile (P, then dS).
fn tile_block<'t>(p: &'t [f32], (br, bc): (usize, usize), rows: &Range<usize>, keys: &Range<usize>) -> View<'t> {
    View { data: p, rows: br, cols: bc, rs: bc, cs: 1 }.block_of(rows.clone(), keys.clone())
}

/// Per-head input rows of a backward tile.
struct Bases<'a> {
    q: &'a [f32],
    d_o: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dd: &'a [f32],
}

/// One tile restricted to visible pairs, element by element: used only for partially masked
/// tiles holding NaN or Inf, so that masked pairs cannot leak them through `0 · NaN`.
#[allow(clippy::too_many_arguments)]
fn exact_tile(
    x: &BackwardInputs,
    qs: &Span,
    ks: &Span,
    at: &Bases,
    p: &[f32],
    slopes: Option<&[f32]>,
    dk: &mut [f32],
    dv: &mut [f32],
    dq_tile: &mut [f32],
) {
    let (d, d_v) = (x.dims.d_qk, x.dims.d_v);
    let (q_rs, kv_rs, o_rs, v_rs) = (x.dims.h_q * d, x.dims.h_kv * d, x.dims.h_q * d_v, x.dims.h_kv * d_v);
    let bc = ks.len;
    for i in 0..qs.len {
        let qi = &at.q[(qs.start + i) * q_rs..][..d];
        let doi = &at.d_o[(qs.start + i) * o_rs..][..d_v];
        for j in 0..bc {
            if !x.vis.visible(qs.start + i, ks.start + j) {
                continue;
            }
            let kj = &at.k[(ks.start + j) * kv_rs..][..d];
            let vj = &at.v[(ks.start + j) * v_rs..][..d_v];
            let pij = p[i * bc + j];
            let slope = slopes.map_or(1.0, |g| g[i * bc + j]);
            let ds = pij * (simd::dot(doi, vj) - at.dd[qs.start + i]) * slope;
            simd::axpy(&mut dv[j * d_v..(j + 1) * d_v], pij, doi);
            simd::axpy(&mut dk[j * d..(j + 1) * d], ds, qi);
            simd::axpy(&mut dq_tile[i * d..(i + 1) * d], ds, kj);
        }
    }
}
