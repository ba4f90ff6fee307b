//! Tiled flash-attention backward on bf16 inputs with all five products on bf16 operands
//! (`vdpbf16ps`, f32 accumulation), per key tile and visible query tile:
//! `S = Q Kᵀ`, `dP = dO Vᵀ` (f32, keys as lanes), `P = 2^(c·S − LSE·log2 e)`,
//! `dS = P ∘ (dP − D)`, then `dV += Pᵀ dO`, `dK += dSᵀ Q`, `dQ += dS K` with P and dS
//! rounded to bf16 (as the GPU kernels round them for their MMAs).
//!
//! Q and dO are read in place as A pairs along the head dimension
//! ([`super::products::RowPairs`]) and packed once per call per query tile with their rows
//! as pair steps; each worker packs its key tile (K and V with rows
//! as lanes, K with rows as pair steps). Pᵀ and dSᵀ are read from row pairs interleaved
//! while rounding. Task split, dQ partials and their fixed-order sum are those of the f32
//! path ([`super::backward::drive`]), so gradients are bit-identical run to run. Inputs must
//! be finite (the caller sends others to the f32 path).
//!
//! On AMX tiles ([`Unit::Tiles`], [`super::amx_products`]) `S`, `dP` and `dQ` read the same
//! operands; `dV` and `dK` are taken transposed, `dVᵀ += dOᵀ P` and `dKᵀ += Qᵀ dS`, so that P
//! and dS in their interleaved pairs are B operands as they stand (an A tile's rows must hold
//! their pairs side by side), with Qᵀ and dOᵀ packed once per query tile (their rows the head
//! dimension, pairs along the queries) and dKᵀ, dVᵀ transposed back once per key tile. Every
//! product then covers its whole tile (the pairs outside a block's reach have P and dS exactly
//! 0, so they add exact zeros).

use std::sync::atomic::AtomicU64;

use half::bf16;
use rayon::prelude::*;

use super::aligned::Lines;
use super::amx_products::{self as amx, Unit};
use super::backward::{drive, DqPartial, KeyTileWork, Tiles};
use super::bf16_rows as rows;
use super::products::{self as mm, AOperand, BOperand, Epilogue};
use super::score::Scores;
use super::tiles::{call_spans, mask_rows, reach, Output, ReachOf, TileConfig};
use crate::attention::{classify, Span, TileKind};
use crate::params::Visibility;
use crate::Dims;

pub(crate) struct BackwardInputs<'a> {
    pub dims: Dims,
    pub q: &'a [bf16],
    pub k: &'a [bf16],
    pub v: &'a [bf16],
    pub d_o: &'a [bf16],
    pub lse: &'a [f32],
    /// `D = rowsum(dO∘O)`, `[b, h_q, s_q]`.
    pub delta: &'a [f32],
    pub vis: &'a Visibility,
    pub spec: crate::attention::ScoreSpec,
    pub tiles: TileConfig,
    pub progress: Option<&'a AtomicU64>,
}

/// Returns `(dq, dk, dv)` in `O` (f32: unrounded; bf16: rounded), layouts as q, k and v, the
/// products on `unit`'s.
pub(crate) fn backward<O: Output>(unit: super::MatrixUnit, x: &BackwardInputs) -> (Vec<O>, Vec<O>, Vec<O>) {
    backward_on::<O>(x, unit.unit())
}

/// [`backward`] with its products on `unit`.
pub(crate) fn backward_on<O: Output>(x: &BackwardInputs, unit: Unit) -> (Vec<O>, Vec<O>, Vec<O>) {
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::Bf16, crate::flops::Pass::Backward);
    let queries = PackedQueries::new(dm, x.q, x.d_o, &q_spans, bq, unit);
    let dq_rs = mm::vectors(dm.d_qk) * 16;
    let tiles = Tiles { vis: x.vis, q_spans: &q_spans, k_spans: &k_spans };
    drive(dm, x.spec.scale, &tiles, dq_rs, x.progress, || Worker::new(x, &queries, &q_spans, bk, unit))
}

/// Q and dO of every (batch, query head): rows as A pairs, and per query tile rows as the
/// pair steps of a B operand.
struct PackedQueries<'a> {
    /// `[b][h_q][s_q][pairs(d_qk)]` and `[b][h_q][s_q][pairs(d_v)]`.
    q_rows: mm::RowPairs<'a>,
    do_rows: mm::RowPairs<'a>,
    /// `[b][h_q][tile]` blocks of `q_len` and `do_len`: Q and dO as the vector products'
    /// B operands (empty on AMX tiles, which read `q_cols`/`do_cols`).
    q_steps: Lines<u32>,
    do_steps: Lines<u32>,
    q_len: usize,
    do_len: usize,
    tiles: usize,
    /// On AMX tiles, Qᵀ and dOᵀ per query tile as A pairs: `[b][h_q][tile]` blocks of
    /// `[d_qk][cols]` and `[d_v][cols]` pairs, `cols = pairs(bq)` (empty otherwise).
    q_cols: Lines<u32>,
    do_cols: Lines<u32>,
    cols: usize,
}

impl<'a> PackedQueries<'a> {
    fn new(dm: Dims, q: &'a [bf16], d_o: &'a [bf16], q_spans: &[Span], bq: usize, unit: Unit) -> Self {
        let (d, d_v) = (dm.d_qk, dm.d_v);
        let tiles = q_spans.len();
        let (q_len, do_len) =
            (mm::pairs(bq) * mm::odd(mm::vectors(d)) * 16, mm::pairs(bq) * mm::odd(mm::vectors(d_v)) * 16);
        let heads = dm.b * dm.h_q;
        let (q_rs, o_rs) = (dm.h_q * d, dm.h_q * d_v);
        let row = |bh: usize| (bh / dm.h_q) * dm.s_q * dm.h_q + bh % dm.h_q;
        let q_rows = mm::RowPairs::new(q, [dm.b, dm.s_q, dm.h_q, d]);
        let do_rows = mm::RowPairs::new(d_o, [dm.b, dm.s_q, dm.h_q, d_v]);
        // Zeros where a tile's rows end (the padding a product reads). The vector products'
        // B operands only: the tiles read Qᵀ and dOᵀ (below) instead.
        let blocks = if matches!(unit, Unit::Vector) { heads * tiles } else { 0 };
        let mut q_steps = super::reuse::zeroed::<Lines<u32>>(blocks * q_len);
        let mut do_steps = super::reuse::zeroed::<Lines<u32>>(blocks * do_len);
        if !q_steps.is_empty() {
            q_steps.par_chunks_mut(q_len).zip(do_steps.par_chunks_mut(do_len)).enumerate().for_each(
                |(blk, (qs, ds))| {
                    let (bh, t) = (blk / tiles, blk % tiles);
                    let span = &q_spans[t];
                    let (q_at, o_at) = (row(bh) * d + span.start * q_rs, row(bh) * d_v + span.start * o_rs);
                    mm::pack_rows_as_steps(&q[q_at..], span.len, q_rs, d, mm::odd(mm::vectors(d)), qs);
                    mm::pack_rows_as_steps(&d_o[o_at..], span.len, o_rs, d_v, mm::odd(mm::vectors(d_v)), ds);
                },
            );
        }
        let cols = mm::pairs(bq);
        let (mut q_cols, mut do_cols) = (Lines::default(), Lines::default());
        if matches!(unit, Unit::Tiles(_)) && heads * tiles > 0 {
            q_cols = super::reuse::zeroed::<Lines<u32>>(heads * tiles * d * cols);
            do_cols = super::reuse::zeroed::<Lines<u32>>(heads * tiles * d_v * cols);
            q_cols.par_chunks_mut(d * cols).zip(do_cols.par_chunks_mut(d_v * cols)).enumerate().for_each(
                |(blk, (qc, dc))| {
                    let (bh, t) = (blk / tiles, blk % tiles);
                    let span = &q_spans[t];
                    let (q_at, o_at) = (row(bh) * d + span.start * q_rs, row(bh) * d_v + span.start * o_rs);
                    pack_columns(&q[q_at..], span.len, q_rs, d, cols, qc);
                    pack_columns(&d_o[o_at..], span.len, o_rs, d_v, cols, dc);
                },
            );
        }
        PackedQueries { q_rows, do_rows, q_steps, do_steps, q_len, do_len, tiles, q_cols, do_cols, cols }
    }
}

impl Drop for PackedQueries<'_> {
    fn drop(&mut self) {
        super::reuse::keep(std::mem::take(&mut self.q_steps));
        super::reuse::keep(std::mem::take(&mut self.do_steps));
        super::reuse::keep(std::mem::take(&mut self.q_cols));
        super::reuse::keep(std::mem::take(&mut self.do_cols));
    }
}

/// The transpose of `rows` rows of `d` bf16 (row `r` at `src[r · rs..]`) as A pairs: row `c`
/// of `dst` (`cols ≥ pairs(rows)` pairs apart) holds `(src[2i][c], src[2i + 1][c])` at pair
/// `i`, zero past the rows.
fn pack_columns(src: &[bf16], rows: usize, rs: usize, d: usize, cols: usize, dst: &mut [u32]) {
    let dst = &mut dst[..d * cols];
    dst.fill(0);
    for i in 0..mm::pairs(rows) {
        let lo = &src[2 * i * rs..][..d];
        let hi = (2 * i + 1 < rows).then(|| &src[(2 * i + 1) * rs..][..d]);
        for c in 0..d {
            let h = hi.map_or(0, |h| h[c].to_bits() as u32);
            dst[c * cols + i] = lo[c].to_bits() as u32 | h << 16;
        }
    }
}

/// Per-thread state of the key tiles it runs.
struct Worker<'a> {
    x: &'a BackwardInputs<'a>,
    queries: &'a PackedQueries<'a>,
    q_spans: &'a [Span],
    /// Row length of the f32 tiles (keys as lanes, a multiple of 16).
    sr: usize,
    /// The key tile: K and V with rows as lanes (B of `Q Kᵀ`, `dO Vᵀ`), K with rows as steps
    /// (B of `dS K`).
    k_lanes: Lines<u32>,
    v_lanes: Lines<u32>,
    k_steps: Lines<u32>,
    /// P, then dS, and dP: `[block_q][sr]` f32, keys as lanes.
    p: Vec<f32>,
    dp: Vec<f32>,
    /// The scores' slopes under a soft-cap, `[block_q][sr]` (empty without one).
    slopes: Vec<f32>,
    /// P and dS rounded, query rows interleaved in pairs: `[pairs(block_q)][sr]` A pairs.
    p_pairs: Lines<u32>,
    ds_pairs: Lines<u32>,
    /// dS rounded, row-major: `[block_q][ds_rs]` A pairs, `ds_rs` the key pairs rounded up
    /// to whole 64-byte lines (the tiles read its rows in place).
    ds_rows: Lines<u32>,
    ds_rs: usize,
    /// Unscaled dK and dV of the key tile, `[block_k][vectors(d_qk) · 16]` and `[block_k][vectors(d_v) · 16]`.
    dk: Vec<f32>,
    dv: Vec<f32>,
    /// Which unit runs the products; on tiles their scratch and dKᵀ, dVᵀ of the key tile,
    /// `[d_qk][sr]` and `[d_v][sr]`.
    unit: Unit,
    tiles: amx::Scratch,
    dkt: Vec<f32>,
    dvt: Vec<f32>,
}

impl<'a> Worker<'a> {
    fn new(
        x: &'a BackwardInputs<'a>,
        queries: &'a PackedQueries<'a>,
        q_spans: &'a [Span],
        bk: usize,
        unit: Unit,
    ) -> Self {
        let (d, d_v) = (x.dims.d_qk, x.dims.d_v);
        let bq = q_spans.iter().map(|s| s.len).max().unwrap_or(0);
        let (sr, gr, gr_v) = (mm::odd(mm::vectors(bk)) * 16, mm::vectors(d) * 16, mm::vectors(d_v) * 16);
        let ds_rs = (sr / 2).div_ceil(16) * 16;
        Worker {
            x,
            queries,
            q_spans,
            sr,
            k_lanes: Lines::zeroed(mm::pairs(d) * sr),
            v_lanes: Lines::zeroed(mm::pairs(d_v) * sr),
            k_steps: Lines::zeroed(mm::pairs(bk) * mm::odd(mm::vectors(d)) * 16),
            p: vec![0.0; bq * sr],
            dp: vec![0.0; bq * sr],
            slopes: if x.spec.softcap.is_some() { vec![0.0; bq * sr] } else { Vec::new() },
            p_pairs: Lines::zeroed(mm::pairs(bq) * sr),
            ds_pairs: Lines::zeroed(mm::pairs(bq) * sr),
            ds_rows: Lines::zeroed(bq * ds_rs),
            ds_rs,
            dk: vec![0.0; bk * gr],
            dv: vec![0.0; bk * gr_v],
            unit,
            tiles: amx::Scratch::default(),
            dkt: if matches!(unit, Unit::Tiles(_)) { vec![0.0; d * sr] } else { Vec::new() },
            dvt: if matches!(unit, Unit::Tiles(_)) { vec![0.0; d_v * sr] } else { Vec::new() },
        }
    }
}

impl KeyTileWork for Worker<'_> {
    fn grads(&self) -> (&[f32], usize, &[f32], usize) {
        let dims = self.x.dims;
        (&self.dk, mm::vectors(dims.d_qk) * 16, &self.dv, mm::vectors(dims.d_v) * 16)
    }

    fn key_tile(&mut self, b: usize, hk: usize, ks: &Span, dq: &mut DqPartial) {
        let (x, pq) = (self.x, self.queries);
        let dm = x.dims;
        let (d, d_v, gs, bc) = (dm.d_qk, dm.d_v, dm.group(), ks.len);
        let (dp, gv, sv) = (mm::pairs(d), mm::vectors(d), mm::odd(mm::vectors(d)));
        let (dp_v, gv_v, sv_v) = (mm::pairs(d_v), mm::vectors(d_v), mm::odd(mm::vectors(d_v)));
        let (sr, gr, gr_v) = (self.sr, gv * 16, gv_v * 16);
        let (k_rs, v_rs) = (dm.h_kv * d, dm.h_kv * d_v);
        let row0 = b * dm.s_k * dm.h_kv + hk;
        let (k0, v0) = (row0 * d + ks.start * k_rs, row0 * d_v + ks.start * v_rs);
        let key_vectors = sr / 16;
        mm::pack_rows_as_lanes(&x.k[k0..], bc, k_rs, d, key_vectors, &mut self.k_lanes);
        mm::pack_rows_as_lanes(&x.v[v0..], bc, v_rs, d_v, key_vectors, &mut self.v_lanes);
        mm::pack_rows_as_steps(&x.k[k0..], bc, k_rs, d, sv, &mut self.k_steps);
        let k_lanes = BOperand { data: &self.k_lanes, vectors: key_vectors };
        let v_lanes = BOperand { data: &self.v_lanes, vectors: key_vectors };
        let k_steps = BOperand { data: &self.k_steps, vectors: sv };
        self.dk[..bc * gr].fill(0.0);
        self.dv[..bc * gr_v].fill(0.0);
        self.dkt.fill(0.0);
        self.dvt.fill(0.0);
        let sc = Scores::of(&x.spec);
        for hl in 0..gs {
            let h = hk * gs + hl;
            let bh = b * dm.h_q + h;
            let lse = &x.lse[bh * dm.s_q..][..dm.s_q];
            let dd = &x.delta[bh * dm.s_q..][..dm.s_q];
            for (t, qs) in self.q_spans.iter().enumerate() {
                let kind = classify(x.vis, qs, ks);
                if kind == TileKind::Skip {
                    continue;
                }
                let br = qs.len;
                let qa = pq.q_rows.at(b, h, qs.start);
                let doa = pq.do_rows.at(b, h, qs.start);
                let tile = bh * pq.tiles + t;
                // (The vector products' B operands: packed only for them.)
                let q_steps = || BOperand { data: &pq.q_steps[tile * pq.q_len..][..pq.q_len], vectors: sv };
                let do_steps = || BOperand { data: &pq.do_steps[tile * pq.do_len..][..pq.do_len], vectors: sv_v };
                let kv = mm::vectors(bc);

                // On a partial tile each block of rows computes only the part it may see: key
                // ranges per block of query rows (S, dP, dQ), query ranges per block of key
                // rows (dV, dK).
                let (key_reach, query_reach) = match kind {
                    TileKind::Partial => (
                        reach(x.vis, qs, ks, mm::BLOCK_ROWS, ReachOf::QueryBlocks),
                        reach(x.vis, qs, ks, mm::BLOCK_ROWS, ReachOf::KeyBlocks),
                    ),
                    _ => (Vec::new(), Vec::new()),
                };
                let (lanes, key_steps) = (mm::Reach::lanes(&key_reach), mm::Reach::steps(&key_reach));
                let query_steps = mm::Reach::steps(&query_reach);
                let p = &mut self.p[..br * sr];
                let unit = self.unit;
                let tiles = &mut self.tiles;
                // A product on the chosen unit (the vector products limited to `reach`).
                let mut product = |c: &mut [f32], c_rs, rows, n16, a, b, k2, epi, reach| match unit {
                    Unit::Tiles(engine) => {
                        amx::product(c, c_rs, rows, n16, a, b, k2, epi, engine, tiles);
                    }
                    Unit::Vector => mm::product(c, c_rs, rows, n16, a, b, k2, epi, reach),
                };
                product(p, sr, br, kv, qa, k_lanes, dp, Epilogue::Set(sc.factor()), lanes);
                // The scores (and their slopes from the products, none without a soft-cap)
                // before the mask, the masked pairs' slopes 0 after it (only a partial tile
                // masks), before P replaces the scores.
                let sloped = !sc.fused();
                for (i, row) in p.chunks_exact_mut(sr).enumerate() {
                    if sloped {
                        sc.finish_row_with_slopes(&mut row[..bc], &mut self.slopes[i * sr..][..bc]);
                    } else {
                        sc.finish_row(&mut row[..bc]);
                    }
                }
                if kind == TileKind::Partial {
                    mask_rows(x.vis, p, sr, br, bc, qs.start, ks.start);
                    if sloped {
                        for i in 0..br {
                            sc.mask_slopes(&p[i * sr..][..bc], &mut self.slopes[i * sr..][..bc]);
                        }
                    }
                }
                // P in place and, rounded, as Pᵀ's A pairs, two query rows at a time. A row
                // whose LSE is −inf sees no key: subtracting +inf makes its P exactly 0.
                let sub = |i: usize| {
                    let l = lse.get(qs.start + i).map_or(f32::NEG_INFINITY, |&l| l);
                    if l == f32::NEG_INFINITY {
                        f32::INFINITY
                    } else {
                        l * std::f32::consts::LOG2_E
                    }
                };
                for (ip, pair) in p.chunks_mut(2 * sr).enumerate() {
                    let (lo, hi) = pair.split_at_mut(sr.min(pair.len()));
                    let hi = (2 * ip + 1 < br).then(|| &mut hi[..bc]);
                    rows::exp2_pairs(&mut lo[..bc], hi, [sub(2 * ip), sub(2 * ip + 1)], &mut self.p_pairs[ip * sr..]);
                }
                let col_block = tile * pq.cols;
                match unit {
                    Unit::Tiles(_) => {
                        // dVᵀ += dOᵀ · P, P's interleaved pairs as B (steps: query pairs).
                        let dot =
                            AOperand { data: &pq.do_cols[col_block * d_v..][..d_v * pq.cols], rs: pq.cols, ps: 1 };
                        let pb = BOperand { data: &self.p_pairs, vectors: sr / 16 };
                        product(&mut self.dvt, sr, d_v, kv, dot, pb, mm::pairs(br), Epilogue::Add, query_steps);
                    }
                    Unit::Vector => {
                        let pt = AOperand { data: &self.p_pairs, rs: 1, ps: sr };
                        let dv = &mut self.dv[..bc * gr_v];
                        product(dv, gr_v, bc, gv_v, pt, do_steps(), mm::pairs(br), Epilogue::Add, query_steps);
                    }
                }

                let dpv = &mut self.dp[..br * sr];
                product(dpv, sr, br, kv, doa, v_lanes, dp_v, Epilogue::Set(1.0), lanes);
                // dS = (P ∘ slopes) ∘ (dP − D) rounded, as dS's (row-major) and dSᵀ's (interleaved) A pairs.
                let ds_rs = self.ds_rs;
                let ds16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.ds_rows[..br * ds_rs]);
                let mut ds_rows = ds16.chunks_mut(2 * ds_rs);
                for ip in 0..mm::pairs(br) {
                    let i = 2 * ip;
                    let lo = rows::GradRow {
                        p: &p[i * sr..][..bc],
                        dp: &dpv[i * sr..][..bc],
                        d: dd[qs.start + i],
                        slopes: sloped.then(|| &self.slopes[i * sr..][..bc]),
                        ds: ds_rows.next().expect("a dS row per query"),
                    };
                    let hi = (i + 1 < br).then(|| rows::GradRow {
                        p: &p[(i + 1) * sr..][..bc],
                        dp: &dpv[(i + 1) * sr..][..bc],
                        d: dd[qs.start + i + 1],
                        slopes: sloped.then(|| &self.slopes[(i + 1) * sr..][..bc]),
                        ds: ds_rows.next().expect("a dS row per query"),
                    });
                    rows::softmax_grad_pairs(lo, hi, &mut self.ds_pairs[ip * sr..]);
                }
                if bc % 2 == 1 {
                    for i in 0..br {
                        ds16[i * 2 * ds_rs + bc] = 0; // the odd key's partner in the last pair step
                    }
                }
                match unit {
                    Unit::Tiles(_) => {
                        // dKᵀ += Qᵀ · dS, dS's interleaved pairs as B.
                        let qt = AOperand { data: &pq.q_cols[col_block * d..][..d * pq.cols], rs: pq.cols, ps: 1 };
                        let dsb = BOperand { data: &self.ds_pairs, vectors: sr / 16 };
                        product(&mut self.dkt, sr, d, kv, qt, dsb, mm::pairs(br), Epilogue::Add, query_steps);
                    }
                    Unit::Vector => {
                        let dst = AOperand { data: &self.ds_pairs, rs: 1, ps: sr };
                        let dk = &mut self.dk[..bc * gr];
                        product(dk, gr, bc, gv, dst, q_steps(), mm::pairs(br), Epilogue::Add, query_steps);
                    }
                }
                let ds = AOperand { data: &self.ds_rows, rs: ds_rs, ps: 1 };
                let dq_rows = dq.rows(hl, qs.start, br);
                product(dq_rows, gr, br, gv, ds, k_steps, mm::pairs(bc), Epilogue::Add, key_steps);
            }
        }
        if matches!(self.unit, Unit::Tiles(_)) {
            // dK and dV rows from their transposes.
            for (c, row) in self.dkt.chunks_exact(sr).enumerate() {
                for (j, &x) in row[..bc].iter().enumerate() {
                    self.dk[j * gr + c] = x;
                }
            }
            for (c, row) in self.dvt.chunks_exact(sr).enumerate() {
                for (j, &x) in row[..bc].iter().enumerate() {
                    self.dv[j * gr_v + c] = x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::amx::{self as tiles_isa, BlockEngine};
    use crate::cpu::forward_bf16;
    use crate::mask::Mask;
    use crate::{random::randn, AttentionParams, DType};

    /// `D = rowsum(dO ∘ O)`, `[b = 1, h_q, s_q]`, from `[s_q, h_q, d_v]` rows.
    fn delta_of(dims: Dims, d_o: &[bf16], o: impl Fn(usize) -> f32) -> Vec<f32> {
        let mut delta = vec![0.0f32; dims.h_q * dims.s_q];
        for i in 0..dims.s_q {
            for h in 0..dims.h_q {
                let at = (i * dims.h_q + h) * dims.d_v;
                delta[h * dims.s_q + i] = (0..dims.d_v).map(|c| d_o[at + c].to_f32() * o(at + c)).sum();
            }
        }
        delta
    }

    /// The products on AMX tiles (dV and dK transposed) against `vdpbf16ps`: on the twin
    /// everywhere with AVX512_BF16 (small shapes: GQA, a 40-wide head whose pair steps are
    /// padded, values 48 wide, odd tiles, causal and not), within the bf16 rounding of P and
    /// dS that the two products' summation orders may flip; where the processor has the
    /// tiles, the same gradients from them bit for bit.
    #[test]
    fn the_tiles_match_the_vector_products_and_their_twin() {
        if !mm::bf16_available() {
            return;
        }
        let dims = Dims { b: 1, s_q: 70, s_k: 83, h_q: 2, h_kv: 1, d_qk: 40, d_v: 48 };
        let tiles = TileConfig { block_q: 37, block_k: 45 };
        let t = |s, h, d, seed| -> Vec<bf16> {
            let f = randn(vec![dims.b, s, h, d], seed, DType::BF16).as_f32().into_owned();
            f.iter().map(|&x| bf16::from_f32(x)).collect()
        };
        let (q, k, v) = (
            t(dims.s_q, dims.h_q, dims.d_qk, 1),
            t(dims.s_k, dims.h_kv, dims.d_qk, 2),
            t(dims.s_k, dims.h_kv, dims.d_v, 3),
        );
        let d_o = t(dims.s_q, dims.h_q, dims.d_v, 4);
        for params in [AttentionParams::default(), AttentionParams { mask: Mask::Causal, ..Default::default() }] {
            let vis = Visibility::single_device(&params, dims.s_q, dims.s_k).unwrap();
            let spec = crate::attention::ScoreSpec::of(&params, &dims);
            let fwd = forward_bf16::ForwardInputs { dims, q: &q, k: &k, v: &v, vis: &vis, spec, tiles, progress: None };
            let (o, lse) = forward_bf16::forward_on::<f32>(&fwd, Unit::Vector);
            let delta = delta_of(dims, &d_o, |i| o[i]);
            let x = BackwardInputs {
                dims,
                q: &q,
                k: &k,
                v: &v,
                d_o: &d_o,
                lse: &lse,
                delta: &delta,
                vis: &vis,
                spec,
                tiles,
                progress: None,
            };
            let vector = backward_on::<f32>(&x, Unit::Vector);
            let twin = backward_on::<f32>(&x, Unit::Tiles(BlockEngine::Twin));
            for (name, a, b) in [("dq", &twin.0, &vector.0), ("dk", &twin.1, &vector.1), ("dv", &twin.2, &vector.2)] {
                let top = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x - y).abs() <= 2f32.powi(-7) * top,
                        "{:?} {name}[{i}]: tiles {x}, vector {y}",
                        params.mask
                    );
                }
            }
            if tiles_isa::available() {
                let real = backward_on::<f32>(&x, Unit::Tiles(BlockEngine::Tiles));
                let bits = |g: &(Vec<f32>, Vec<f32>, Vec<f32>)| {
                    g.0.iter().chain(&g.1).chain(&g.2).map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(bits(&real), bits(&twin), "the tiles and their twin differ");
            }
        }
    }

    /// `CpuConfig::matrix_unit` and `CpuBackend::matrix_unit` reach the products: the public
    /// forward and backward (bf16 out) and the drivers' block steps (f32 out) give the bits of
    /// `vdpbf16ps` under `Vector` and of the chosen unit (the tiles where AMX is) under `Auto`.
    #[test]
    fn the_matrix_unit_option_reaches_the_products() {
        use crate::cpu::{self, Arithmetic, CpuConfig, MatrixUnit};
        use crate::parallel::{Backend, CpuBackend};
        use crate::{HostBuf, Positions, Tensor};
        if !mm::bf16_available() {
            return;
        }
        let dims = Dims { b: 1, s_q: 96, s_k: 96, h_q: 2, h_kv: 2, d_qk: 64, d_v: 64 };
        let params = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let t = |h, seed| randn(vec![1, 96, h, 64], seed, DType::BF16);
        let (q, k, v, d_o) = (t(2, 1), t(2, 2), t(2, 3), t(2, 4));
        let raw = |x: &Tensor| -> Vec<bf16> { x.as_f32().iter().map(|&y| bf16::from_f32(y)).collect() };
        let (qb, kb, vb, dob) = (raw(&q), raw(&k), raw(&v), raw(&d_o));
        let vis = Visibility::single_device(&params, 96, 96).unwrap();
        let spec = crate::attention::ScoreSpec::of(&params, &dims);
        let tiles = TileConfig::default();
        let fwd = forward_bf16::ForwardInputs { dims, q: &qb, k: &kb, v: &vb, vis: &vis, spec, tiles, progress: None };
        let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        for (option, unit) in [(MatrixUnit::Vector, Unit::Vector), (MatrixUnit::Auto, Unit::chosen())] {
            // The public single-device calls.
            let config = CpuConfig { arithmetic: Arithmetic::Bf16, matrix_unit: option, ..Default::default() };
            let out = cpu::forward_with(&q, &k, &v, None, &params, &config).unwrap();
            let (o, lse) = forward_bf16::forward_on::<bf16>(&fwd, unit);
            assert_eq!(
                bits(&out.o.to_f32_vec()),
                bits(&o.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
                "{option:?}"
            );
            assert_eq!(bits(&out.lse.to_f32_vec()), bits(&lse), "{option:?}");
            let g = cpu::backward_with(&q, &k, &v, &out.o, &out.lse, &d_o, None, &params, &config).unwrap();
            // The drivers' block steps on the CPU backend.
            let be = CpuBackend { arithmetic: Arithmetic::Bf16, matrix_unit: option, ..Default::default() };
            let all = Positions::contiguous(0, 96);
            let up = |x: &Tensor| be.step_input(&HostBuf::from_tensor(x)).unwrap();
            let (part_o, _) =
                be.forward_block(dims, &up(&q), &up(&k), &up(&v), &all, &all, &params).unwrap().wait().unwrap();
            let (o32, _) = forward_bf16::forward_on::<f32>(&fwd, unit);
            assert_eq!(bits(&part_o.to_f32().unwrap()), bits(&o32), "{option:?} block");
            // The backward on the forward's outputs (its D from them), against backward_on.
            let o16 = raw(&out.o);
            let delta = delta_of(dims, &dob, |i| o16[i].to_f32());
            let lse = out.lse.to_f32_vec();
            let x = BackwardInputs {
                dims,
                q: &qb,
                k: &kb,
                v: &vb,
                d_o: &dob,
                lse: &lse,
                delta: &delta,
                vis: &vis,
                spec,
                tiles,
                progress: None,
            };
            let want = backward_on::<bf16>(&x, unit);
            let wide = |t: &[bf16]| t.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
            for (name, got, want) in [("dq", &g.dq, &want.0), ("dk", &g.dk, &want.1), ("dv", &g.dv, &want.2)] {
                assert_eq!(bits(&got.to_f32_vec()), bits(&wide(want)), "{option:?} {name}");
            }
            let (dq32, dk32, dv32) = backward_on::<f32>(&x, unit);
            let (lse_b, delta_b) = (HostBuf::from(lse.clone()), HostBuf::from(delta.clone()));
            let (bq, bk, bv) = be
                .backward_block(
                    dims,
                    &up(&q),
                    &up(&k),
                    &up(&v),
                    &up(&out.o),
                    &lse_b,
                    &up(&d_o),
                    &delta_b,
                    &all,
                    &all,
                    &params,
                )
                .unwrap()
                .wait()
                .unwrap();
            for (name, got, want) in [("dq", &bq, &dq32), ("dk", &bk, &dk32), ("dv", &bv, &dv32)] {
                assert_eq!(bits(&got.to_f32().unwrap()), bits(want), "{option:?} {name} block");
            }
        }
    }
}
