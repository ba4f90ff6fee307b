//! Tiled flash-attention forward on bf16 inputs with bf16 products (`vdpbf16ps`, f32
//! accumulation): `S = (scale·log2 e)·Q Kᵀ` and `O += P V` with `P = 2^(S − m)` rounded to
//! bf16 (as the GPU kernels round it for their MMA); the online softmax in f32.
//!
//! K and V are packed once per call, per group of (batch, kv head) pairs under a memory
//! budget (K with its rows as lanes, V with its rows as the pair steps, per key tile; see
//! [`super::forward::PackedKeys`]), Q read in place as A pairs
//! ([`super::products::RowPairs`]); each task (batch, query head, query tile) keeps `S`
//! row-major (keys as lanes), so the softmax runs
//! along rows and the P·V product reads P as it was written. Inputs must be finite (the
//! caller sends others to the f32 path, which keeps masked NaN out of visible rows).
//!
//! Lazy rescaling as in [`super::forward_f32`]: once every row of the task has a running
//! max, a fully visible tile (key count a multiple of 16) takes its probabilities against it
//! in the epilogue of `Q·Kᵀ` (S never stored, P written rounded to bf16: from registers with
//! `vdpbf16ps`, [`mm::product_exp2_bf16`]; from each staged 32 × 32 block on AMX tiles,
//! [`amx::product_exp2_bf16`]) and adds `P·V` without rescaling the output;
//! when a score exceeds its row's max by more than [`LAZY_GROWTH`] (or a sum is not finite)
//! the tile takes the exact passes (S, row maxima, new max, rescale, P). With `vdpbf16ps`
//! the first tile of each task and partially masked tiles take them too. On AMX tiles every
//! tile is lazy: a partial tile (or one with padding lanes) masks the lanes its rows do not
//! see in the epilogue ([`visible_lanes`]; blocks of 32 × 32 that see nothing are not
//! multiplied), and a task's first tile takes its row maxima from the products alone
//! ([`amx::product_maxima`], S not stored) before its probabilities against them; the
//! tiles' epilogue takes no maxima (the lane sums bound the growth) and `P·V` is summed into
//! the output's rows in the tiles ([`amx::accumulate`]).
//!
//! The same worker runs the f32 forward on the tiles ([`forward_split`]): Q, K, V and P as
//! three bf16 parts each ([`super::split`]), every product over the parts' six pairs
//! ([`amx::Depth::split`]) — f32 accuracy at the tiles' rate.

use std::sync::atomic::{AtomicBool, Ordering};

use super::aligned::Lines;
use super::amx::BlockEngine;
use super::amx_products::{self as amx, Depth, PRows, Unit};
use super::bf16_rows as rows;
use super::forward::{
    drive_groups, drive_into, drive_packed, split_pairs, PackedKeys, QueryTileWork, RowState, LAZY_GROWTH,
    PACKED_BUDGET,
};
use super::products::{self as mm, AOperand, BOperand, Epilogue};
use super::score::Scores;
use super::simd;
use super::split;
use super::tiles::{call_spans, mask_rows, reach, visible_lanes, Output, ReachOf};
use crate::attention::{classify, Span, TileKind};
use half::bf16;

/// The bf16 path's inputs.
pub(crate) type ForwardInputs<'a> = super::forward::ForwardInputs<'a, bf16>;

/// Returns `(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])`, `o` in `O` (f32: unrounded, the
/// drivers' partial results; bf16: rounded, a final output) and `lse` in f32, the products on
/// `unit`'s.
pub(crate) fn forward<O: Output>(unit: super::MatrixUnit, x: &ForwardInputs) -> (Vec<O>, Vec<f32>) {
    forward_on::<O>(x, unit.unit())
}

/// [`forward`] with its products on `unit`.
pub(crate) fn forward_on<O: Output>(x: &ForwardInputs, unit: Unit) -> (Vec<O>, Vec<f32>) {
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::Bf16, crate::flops::Pass::Forward);
    let queries = Queries::Pairs(mm::RowPairs::new(x.q, [dm.b, dm.s_q, dm.h_q, dm.d_qk]));
    drive_packed(dm, x.k, x.v, &k_spans, bk, PACKED_BUDGET, |out, keys: &PackedKeys<u32>, heads| {
        drive_into(out, dm, &q_spans, heads, x.progress, || Worker::new(x, keys, &queries, &k_spans, bq, unit))
    })
}

/// The f32 forward with its products on AMX tiles (`engine`: the processor's or the twin):
/// `q`, `k` and `v` split into three bf16 parts each ([`split`]: Q per query tile, K and V as
/// they are packed, [`PackedKeys::split`]), `S = Q·Kᵀ` and `P·V` (P split in the epilogue)
/// as six bf16 products of the parts summed in the tiles ([`amx::Depth::split`]); the online
/// softmax as on bf16 inputs. Returns f32 `(o, lse)` as [`super::forward::forward`] (within
/// f32 rounding of it), or `None` when an input cannot be split (not finite, or beyond
/// bf16's range: about `3.39e38`) and the f32 products must run.
///
/// # Panics
/// On a processor without AVX512_BF16 (the epilogues' instructions).
pub(crate) fn forward_split(
    x: &super::forward::ForwardInputs<f32>,
    engine: BlockEngine,
) -> Option<(Vec<f32>, Vec<f32>)> {
    let dm = x.dims;
    // What the tiles see: Q's and K's rows as three parts of whole steps each.
    let wide = crate::Dims { d_qk: 3 * 2 * split_pairs(dm.d_qk), ..dm };
    let xs = ForwardInputs {
        dims: wide,
        q: &[],
        k: &[],
        v: &[],
        vis: x.vis,
        spec: x.spec,
        tiles: x.tiles,
        progress: x.progress,
    };
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::Bf16, crate::flops::Pass::Forward);
    // A value that cannot split (checked as each is split: K and V as they are packed, Q per
    // query tile) sends the whole call to the f32 products, its outputs dropped.
    let unsplit = AtomicBool::new(false);
    let queries = Queries::Split { q: x.q, d: dm.d_qk, unsplit: &unsplit };
    let per_pair = PackedKeys::split_bytes(dm, k_spans.len(), bk);
    let pack = |pairs| PackedKeys::split(dm, x.k, x.v, &k_spans, bk, pairs);
    let out = drive_groups(wide, per_pair, PACKED_BUDGET, pack, |out, keys, heads| {
        let unit = Unit::Tiles(engine);
        drive_into(out, wide, &q_spans, heads, x.progress, || Worker::new(&xs, keys, &queries, &k_spans, bq, unit))
    });
    out.filter(|_| !unsplit.load(Ordering::Relaxed))
}

/// The queries as the tiles read them.
enum Queries<'a> {
    /// bf16 queries as A pairs.
    Pairs(mm::RowPairs<'a>),
    /// f32 queries `[b, s_q, h_q, d]`, split into three bf16 parts per query tile (the
    /// forward's rows of P split likewise: [`PRows::Split`]); `unsplit` set when a value
    /// cannot split (the call's outputs are then dropped).
    Split { q: &'a [f32], d: usize, unsplit: &'a AtomicBool },
}

/// Per-thread state of the query tiles it runs.
struct Worker<'a> {
    x: &'a ForwardInputs<'a>,
    keys: &'a PackedKeys<u32>,
    /// The queries.
    queries: &'a Queries<'a>,
    k_spans: &'a [Span],
    /// The query tile's running max, sum, rescale factors and unnormalised output.
    st: RowState,
    /// Scores, then probabilities, `[block_q][sr]` (keys as lanes).
    s: Vec<f32>,
    /// The probabilities in bf16 as A pairs, `[block_q][p_rs]`.
    p: Lines<u32>,
    /// Running row maxima of `s` per lane, `[block_q][16]` ([`mm::product_max`]), and of a
    /// lazily rescaled tile's shifted scores with their sums ([`mm::product_exp2_bf16`]).
    maxes: Vec<f32>,
    sums: Vec<f32>,
    /// On tiles, the lanes of a masked tile its rows see, `[block_q][key_vectors]` bits
    /// ([`visible_lanes`]).
    visible: Vec<u16>,
    /// How the scores are formed.
    scores: Scores,
    /// Pairs between rows of `p`: `sr / 2`, or on tiles the key pairs rounded up to whole
    /// 64-byte lines, an odd number of them (so that a tile's 16 rows spread over the first-
    /// level cache's sets).
    p_rs: usize,
    /// Which unit runs the products, and the tiles' scratch.
    unit: Unit,
    /// How P's rows are written: rounded, or split for split values (the f32 forward).
    rows_of_p: PRows,
    tiles: amx::Scratch,
    /// On tiles, the query tile's rows as A pairs side by side (`[block_q][q_rs]`, `q_rs`
    /// the head's pairs rounded up to whole lines): Q's own rows lie `h_q · d` apart, a
    /// stride that meets a few cache sets.
    q_tile: Lines<u32>,
    q_rs: usize,
}

impl<'a> Worker<'a> {
    fn new(
        x: &'a ForwardInputs<'a>,
        keys: &'a PackedKeys<u32>,
        queries: &'a Queries<'a>,
        k_spans: &'a [Span],
        bq: usize,
        unit: Unit,
    ) -> Self {
        let d = x.dims.d_v;
        let sr = keys.key_vectors * 16;
        let lines = |pairs: usize| pairs.div_ceil(16);
        let rows_of_p = match queries {
            Queries::Pairs(_) => PRows::Rounded,
            Queries::Split { .. } => PRows::Split,
        };
        assert!(rows_of_p == PRows::Rounded || matches!(unit, Unit::Tiles(_)), "split operands run on the tiles");
        let p_rs = match (unit, rows_of_p) {
            (Unit::Tiles(_), PRows::Rounded) => (lines(sr / 2) | 1) * 16,
            // Three parts of the widest tile's keys (each at most `sr + 16` lanes).
            (Unit::Tiles(_), PRows::Split) => (lines(3 * (sr + 16) / 2) | 1) * 16,
            (Unit::Vector, _) => sr / 2,
        };
        let q_rs = lines(mm::pairs(x.dims.d_qk)) * 16;
        let q_tile = Lines::zeroed(if matches!(unit, Unit::Tiles(_)) { bq * q_rs } else { 0 });
        Worker {
            x,
            keys,
            queries,
            k_spans,
            st: RowState::new(bq, mm::vectors(d) * 16),
            s: vec![0.0; bq * sr],
            p: Lines::zeroed(bq * p_rs),
            maxes: vec![0.0; bq * 16],
            sums: vec![0.0; bq * 16],
            visible: vec![0; if matches!(unit, Unit::Tiles(_)) { bq * keys.key_vectors } else { 0 }],
            scores: Scores::of(&x.spec),
            p_rs,
            unit,
            rows_of_p,
            tiles: amx::Scratch::default(),
            q_tile,
            q_rs,
        }
    }

    /// A tile lazily rescaled: P against the running max `m` in the product's epilogue,
    /// rounded to bf16 into `p` — a fully visible tile without padding lanes, or on tiles
    /// with `masked` any tile, the lanes its rows do not see (`visible`, filled by
    /// [`Worker::see`]) masked in the epilogue. Returns whether every shifted score stayed
    /// within [`LAZY_GROWTH`] (on tiles: every lane sum within `2^LAZY_GROWTH`, which bounds
    /// each score as strictly or more) and every sum finite (then `l` has the tile's sums
    /// and `p` its P, and the output needs no rescale); otherwise nothing but `p` changed and
    /// the tile takes the exact passes.
    #[allow(clippy::too_many_arguments)]
    fn lazy(&mut self, br: usize, n16: usize, qa: AOperand, kop: BOperand, dp: usize, c: f32, masked: bool) -> bool {
        let depth = self.score_depth(dp);
        let visible = masked.then(|| &self.visible[..br * n16]);
        let (maxes, sums) = (&mut self.maxes[..16 * br], &mut self.sums[..16 * br]);
        sums.fill(0.0);
        let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.p[..br * self.p_rs]);
        let m = &self.st.m[..br];
        // P's rows in bf16 lanes (`p_rs` counts pairs).
        let p_rs = 2 * self.p_rs;
        // The largest shifted score, or on tiles (no maxima there) the log2 of the largest
        // lane sum: every 2^x is at most its lane's sum, so this bounds the growth as the
        // maxima do — more strictly (many scores grown a little also fail it).
        let (x_max, total) = match self.unit {
            Unit::Tiles(engine) => {
                let tiles = &mut self.tiles;
                let how = (visible, self.rows_of_p);
                amx::product_exp2_bf16(p16, p_rs, br, n16, qa, kop, depth, c, m, sums, how, engine, tiles);
                // SAFETY: `product_exp2_bf16` above asserted AVX512_BF16, which comes with AVX512F.
                let (sum_max, total) = unsafe { simd::avx512::max_and_total(sums, sums) };
                (sum_max.log2(), total)
            }
            Unit::Vector => {
                assert!(visible.is_none(), "the vector products' epilogue masks no lanes");
                maxes.fill(f32::NEG_INFINITY);
                mm::product_exp2_bf16(p16, p_rs, br, n16, qa, kop, dp, c, m, maxes, sums);
                // SAFETY: as above.
                unsafe { simd::avx512::max_and_total(maxes, sums) }
            }
        };
        let bounded = x_max <= LAZY_GROWTH && total.is_finite();
        if bounded {
            // SAFETY: as above.
            unsafe { simd::avx512::add_lane_sums(&mut self.st.l[..br], sums) };
        }
        bounded
    }

    /// The depth of `S = Q·Kᵀ` on the tiles over `dp` pairs of Q's rows: three parts of a
    /// third each for split operands.
    fn score_depth(&self, dp: usize) -> Depth {
        match self.rows_of_p {
            PRows::Rounded => dp.into(),
            PRows::Split => Depth::split(dp / 3),
        }
    }

    /// The lanes of key tile `ks` that the rows of query tile `qs` see, into `visible`.
    fn see(&mut self, qs: &Span, ks: &Span) {
        let seen = &mut self.visible[..qs.len * mm::vectors(ks.len)];
        visible_lanes(self.x.vis, qs, ks, &mut self.s, seen);
    }

    /// On tiles, before [`Worker::lazy`] where some row has no running max yet (a query
    /// tile's first visible key tile): the tile's row maxima from the products alone
    /// ([`amx::product_maxima`], the scores not stored), and the running maxima advanced to
    /// them (`l` rescaled, `alpha` set for the output) when every row then has a finite one.
    /// Returns the rows' previous `(m, l)` when it advanced them (to be put back if the lazy
    /// pass fails), `None` when it changed nothing (a row sees no key yet, or a score is not
    /// finite): then the tile takes the exact passes.
    #[allow(clippy::too_many_arguments)]
    fn prime(
        &mut self,
        br: usize,
        n16: usize,
        qa: AOperand,
        kop: BOperand,
        dp: usize,
        c: f32,
        masked: bool,
    ) -> Option<(Vec<f32>, Vec<f32>)> {
        let Unit::Tiles(engine) = self.unit else { return None };
        // (The maxima only set the running max, to which the probabilities are taken: split
        // operands' leading parts estimate them within the lazy bound's margin.)
        let depth = self.score_depth(dp).leading();
        let visible = masked.then(|| &self.visible[..br * n16]);
        let maxes = &mut self.maxes[..16 * br];
        amx::product_maxima(br, n16, qa, kop, depth, c, maxes, visible, engine, &mut self.tiles);
        let t_max: Vec<f32> = maxes.chunks_exact(16).map(simd::row_max).collect();
        if !t_max.iter().zip(&self.st.m[..br]).all(|(&t, &m)| m.max(t).is_finite()) {
            return None;
        }
        let before = (self.st.m[..br].to_vec(), self.st.l[..br].to_vec());
        for (i, &t) in t_max.iter().enumerate() {
            self.st.advance(i, t);
        }
        Some(before)
    }

    /// The exact passes of key tile `ks` (of `kind`; `whole`: fully visible without padding
    /// lanes) for query tile `qs`: S = `c`·Q·Kᵀ (masked), its row maxima, the new running max
    /// and rescale factors, P against it rounded to bf16 into `p`.
    #[allow(clippy::too_many_arguments)]
    fn exact(
        &mut self,
        qs: &Span,
        ks: &Span,
        kind: TileKind,
        whole: bool,
        qa: AOperand,
        kop: BOperand,
        c: f32,
        key_reach: &[std::ops::Range<usize>],
    ) {
        let x = self.x;
        let (br, bc, dp, sr) = (qs.len, ks.len, mm::pairs(x.dims.d_qk), kop.vectors * 16);
        let depth = self.score_depth(dp);
        let s = &mut self.s[..br * sr];
        if let Unit::Tiles(engine) = self.unit {
            // Every lane of the tile (those outside a block's reach are masked below); a
            // whole tile's row maxima as it is stored.
            if whole {
                amx::product_max(
                    s,
                    sr,
                    br,
                    mm::vectors(bc),
                    qa,
                    kop,
                    depth,
                    c,
                    &mut self.maxes,
                    engine,
                    &mut self.tiles,
                );
            } else {
                amx::product(s, sr, br, mm::vectors(bc), qa, kop, depth, Epilogue::Set(c), engine, &mut self.tiles);
                for row in s.chunks_exact_mut(sr) {
                    self.scores.finish_row(&mut row[..bc]);
                }
            }
        } else if whole {
            let maxes = &mut self.maxes[..16 * br];
            maxes.fill(f32::NEG_INFINITY);
            mm::product_max(s, sr, br, mm::vectors(bc), qa, kop, dp, c, maxes);
        } else {
            let lanes = mm::Reach::lanes(key_reach);
            mm::product(s, sr, br, mm::vectors(bc), qa, kop, dp, Epilogue::Set(c), lanes);
            // The score options before the mask (lanes outside a block's reach are masked below).
            for row in s.chunks_exact_mut(sr) {
                self.scores.finish_row(&mut row[..bc]);
            }
        }
        if kind == TileKind::Partial {
            mask_rows(x.vis, s, sr, br, bc, qs.start, ks.start);
        }
        let p_rs = self.p_rs;
        let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.p[..br * p_rs]);
        for i in 0..br {
            let row = &mut s[i * sr..][..bc];
            let t_max = simd::row_max(if whole { &self.maxes[16 * i..][..16] } else { row });
            let sub = self.st.advance(i, t_max);
            if self.rows_of_p == PRows::Split {
                let part = 2 * split_pairs(bc);
                self.st.l[i] += rows::exp2_split_row(row, sub, &mut p16[i * 2 * p_rs..][..3 * part], part);
                continue;
            }
            let prow = &mut p16[i * 2 * p_rs..][..bc + bc % 2];
            // The normaliser sums the probabilities before rounding (f32-accurate LSE).
            self.st.l[i] += rows::exp2_round_row(row, sub, prow);
            if bc % 2 == 1 {
                prow[bc] = 0; // the odd key's partner in the last pair step
            }
        }
    }
}

impl QueryTileWork for Worker<'_> {
    fn run(&mut self, b: usize, h: usize, qs: &Span) {
        let (x, keys) = (self.x, self.keys);
        let dm = x.dims;
        let (d, d_v) = (dm.d_qk, dm.d_v);
        let hk = dm.kv_head(h);
        let (br, dp, or) = (qs.len, mm::pairs(d), mm::vectors(d_v) * 16);
        self.st.start(br);
        let c = self.scores.factor();
        // (Held out of `self` while the tile's products borrow it.)
        let mut q_tile = std::mem::take(&mut self.q_tile);
        let q_rs = self.q_rs;
        let qa = match self.queries {
            Queries::Pairs(pairs) if matches!(self.unit, Unit::Tiles(_)) => {
                // Q's rows side by side (the padding pairs zero).
                let qa = pairs.at(b, h, qs.start);
                for (i, row) in q_tile.chunks_exact_mut(q_rs).take(br).enumerate() {
                    row[..dp].copy_from_slice(&qa.data[i * qa.rs..][..dp]);
                    row[dp..].fill(0);
                }
                AOperand { data: &q_tile, rs: q_rs, ps: 1 }
            }
            Queries::Pairs(pairs) => pairs.at(b, h, qs.start),
            &Queries::Split { q, d: dq, unsplit } => {
                // Q's rows split into their three parts side by side, each zero-padded to
                // whole steps; a value that cannot split ends the tile (and the call's use).
                let width = 2 * (dp / 3);
                let mut fine = true;
                let row_of = |i: usize| ((b * dm.s_q + qs.start + i) * dm.h_q + h) * dq;
                for (i, row) in q_tile.chunks_exact_mut(q_rs).take(br).enumerate() {
                    // (Rows lie `h_q · d` apart: asked for ahead, as the packing does.)
                    split::prefetch_row(q, row_of(i + 8), dq);
                    let src = &q[row_of(i)..][..dq];
                    let bits: &mut [u16] = bytemuck::cast_slice_mut(row);
                    let (p0, rest) = bits.split_at_mut(width);
                    let (p1, rest) = rest.split_at_mut(width);
                    let (p2, pad) = rest.split_at_mut(width);
                    fine &= split::split_row(src, p0, p1, p2);
                    for part in [p0, p1, p2] {
                        part[dq..].fill(0);
                    }
                    pad.fill(0);
                }
                if !fine {
                    unsplit.store(true, Ordering::Relaxed);
                    self.q_tile = q_tile;
                    return;
                }
                AOperand { data: &q_tile, rs: q_rs, ps: 1 }
            }
        };
        for (t, ks) in self.k_spans.iter().enumerate() {
            let kind = classify(x.vis, qs, ks);
            if kind == TileKind::Skip {
                continue;
            }
            let bc = ks.len;
            let (kt, vt) = keys.tile(&dm, b, hk, t);
            let kop = BOperand { data: kt, vectors: keys.key_vectors };
            // On a partial tile each block of query rows computes only the keys it may see.
            let key_reach = match kind {
                TileKind::Partial => reach(x.vis, qs, ks, mm::BLOCK_ROWS, ReachOf::QueryBlocks),
                _ => Vec::new(),
            };
            // A fully visible tile without padding lanes, once every row has a running max:
            // P in the product's epilogue against it, the output not rescaled. On tiles a
            // partial tile (or one with padding lanes) too, its hidden lanes masked there.
            // A query tile's first key tile on tiles: its maxima first ([`Worker::prime`]),
            // then lazily against them, the output rescaled.
            let (fused, n16) = (self.scores.fused(), mm::vectors(bc));
            let whole = kind == TileKind::Full && bc % 16 == 0 && fused;
            let masked = !whole && fused && matches!(self.unit, Unit::Tiles(_));
            let mut lazy = false;
            let mut primed = None;
            if whole || masked {
                if masked {
                    self.see(qs, ks);
                }
                if !self.st.all_finite() {
                    primed = self.prime(br, n16, qa, kop, dp, c, masked);
                }
                lazy = self.st.all_finite() && self.lazy(br, n16, qa, kop, dp, c, masked);
            }
            if !lazy {
                if let Some((m, l)) = primed.take() {
                    // The exact passes start from the running state before the maxima.
                    self.st.m[..br].copy_from_slice(&m);
                    self.st.l[..br].copy_from_slice(&l);
                }
                self.exact(qs, ks, kind, whole, qa, kop, c, &key_reach);
            }
            let pa = AOperand { data: &self.p, rs: self.p_rs, ps: 1 };
            let vop = BOperand { data: vt, vectors: keys.value_vectors };
            let epi = if lazy && primed.is_none() { Epilogue::Add } else { Epilogue::Rescale(&self.st.alpha[..br]) };
            let acc = &mut self.st.acc[..br * or];
            match self.unit {
                Unit::Tiles(engine) => {
                    let k2 = match self.rows_of_p {
                        PRows::Rounded => Depth::from(mm::pairs(bc)),
                        PRows::Split => Depth::split(split_pairs(bc)),
                    };
                    let (n16, tiles) = (mm::vectors(d_v), &mut self.tiles);
                    if matches!(epi, Epilogue::Add) {
                        amx::accumulate(acc, or, br, n16, pa, vop, k2, engine, tiles);
                    } else {
                        amx::product(acc, or, br, n16, pa, vop, k2, epi, engine, tiles);
                    }
                }
                Unit::Vector => {
                    let pv_steps = mm::Reach::steps(&key_reach);
                    mm::product(acc, or, br, mm::vectors(d_v), pa, vop, mm::pairs(bc), epi, pv_steps);
                }
            }
        }
        self.q_tile = q_tile;
    }

    fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize) {
        self.st.finish(lse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::amx::{self as tiles_isa, BlockEngine};
    use crate::cpu::tiles::TileConfig;
    use crate::mask::Mask;
    use crate::params::Visibility;
    use crate::{random::randn, AttentionParams, DType, Dims};

    /// This path (lazily rescaled tiles with P in the product's epilogue, the exact passes
    /// on the first tile of each query tile, on partial tiles and where scores grow past
    /// `LAZY_GROWTH`) against the f32 path on the same bf16 values: the products are exact
    /// in both, so LSE agrees to f32 rounding, and O differs only by P's rounding to bf16
    /// (relative error at most 2^-8 per probability: |ΔO| ≤ 2^-8 · max|v| per element).
    #[test]
    fn matches_the_f32_path_within_the_rounding_of_p() {
        if !mm::bf16_available() {
            return;
        }
        let dims = Dims { b: 2, s_q: 200, s_k: 300, h_q: 4, h_kv: 2, d_qk: 64, d_v: 64 };
        let tiles = TileConfig { block_q: 48, block_k: 64 };
        check_against_f32(dims, tiles, Unit::Vector);
        check_against_f32(dims, tiles, Unit::Tiles(BlockEngine::Tiles));
    }

    /// The products on AMX tiles: on the twin everywhere (small shapes: edge row blocks, odd
    /// pair steps of a 40-wide head, 37- and 48-key tiles, a value width of 48), and where the
    /// processor has the tiles, the same outputs from them bit for bit.
    #[test]
    fn the_tiles_match_the_f32_path_and_their_twin() {
        if !mm::bf16_available() {
            return;
        }
        // An odd key tile (lazily rescaled past the first with its padding lanes masked in
        // the epilogue), then whole tiles of 48 keys (an odd vector count's last column block
        // half wide); the causal and windowed masks' partial tiles masked there too.
        for (s_k, block_k) in [(111, 37), (192, 48)] {
            let dims = Dims { b: 1, s_q: 70, s_k, h_q: 2, h_kv: 1, d_qk: 40, d_v: 48 };
            let tiles = TileConfig { block_q: 48, block_k };
            let twin = check_against_f32(dims, tiles, Unit::Tiles(BlockEngine::Twin));
            if tiles_isa::available() {
                assert_eq!(twin, check_against_f32(dims, tiles, Unit::Tiles(BlockEngine::Tiles)));
            }
        }
    }

    /// The f32 forward on the tiles (three bf16 parts per operand, [`forward_split`]) against
    /// the float64 oracle under the f32 rule — bf16 products alone miss it by far — on the
    /// twin everywhere and, where the processor has the tiles, the same bits from them: full,
    /// causal, a window both ways inside packed documents, keys whose scores grow past the
    /// lazy bound (the exact passes) and a soft-cap (every tile exact); odd key tiles and head
    /// sizes, padded rows.
    #[test]
    fn the_split_f32_forward_meets_the_f32_bound() {
        if !mm::bf16_available() {
            return;
        }
        let cases = [
            (
                Dims { b: 1, s_q: 70, s_k: 111, h_q: 2, h_kv: 1, d_qk: 40, d_v: 48 },
                TileConfig { block_q: 48, block_k: 37 },
            ),
            (
                Dims { b: 2, s_q: 96, s_k: 192, h_q: 2, h_kv: 2, d_qk: 64, d_v: 64 },
                TileConfig { block_q: 64, block_k: 64 },
            ),
        ];
        for (dims, tiles) in cases {
            let (q, k, v) = (
                randn(vec![dims.b, dims.s_q, dims.h_q, dims.d_qk], 11, DType::F32),
                randn(vec![dims.b, dims.s_k, dims.h_kv, dims.d_qk], 12, DType::F32),
                randn(vec![dims.b, dims.s_k, dims.h_kv, dims.d_v], 13, DType::F32),
            );
            let mut grown = k.as_f32().into_owned();
            for x in &mut grown[50 * dims.h_kv * dims.d_qk..] {
                *x *= 40.0;
            }
            let grown = crate::Tensor::from_f32(k.shape().to_vec(), grown).unwrap();
            let third = dims.s_k / 3;
            let windowed = AttentionParams {
                mask: Mask::Window { left: Some(37), right: Some(5) },
                documents: Some(crate::Documents::new(vec![third, 1, dims.s_k - third - 1]).unwrap()),
                ..Default::default()
            };
            let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
            // A soft-cap: scores formed in a row pass, every tile through the exact passes.
            let capped = AttentionParams { mask: Mask::Causal, softcap: Some(2.0), ..Default::default() };
            for (params, k) in [
                (AttentionParams::default(), &k),
                (causal, &k),
                (AttentionParams::default(), &grown),
                (windowed, &k),
                (capped, &k),
            ] {
                let vis = Visibility::single_device(&params, dims.s_q, dims.s_k).unwrap();
                let (qf, kf, vf) = (q.as_f32(), k.as_f32(), v.as_f32());
                let x = f32_inputs(dims, [&qf, &kf, &vf], &vis, &params, tiles);
                let (o, lse) = forward_split(&x, BlockEngine::Twin).expect("finite inputs split");
                let fwd = crate::cpu::ForwardOutput {
                    o: crate::Tensor::from_f32(dims.o_shape(), o.clone()).unwrap(),
                    lse: crate::Tensor::from_f32(dims.lse_shape(), lse.clone()).unwrap(),
                };
                let report = crate::verify::check_results(&q, k, &v, None, None, &params, &fwd, None).unwrap();
                assert!(report.pass(), "{dims:?} {:?}\n{}", params.mask, report.table());
                if tiles_isa::available() {
                    let (o_t, lse_t) = forward_split(&x, BlockEngine::Tiles).unwrap();
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&o), bits(&o_t), "{:?}: the tiles and the twin differ", params.mask);
                    assert_eq!(bits(&lse), bits(&lse_t));
                }
            }
        }
    }

    /// Inputs that cannot be split (not finite, or past bf16's range) are left to the f32
    /// products: `None`, nothing computed.
    #[test]
    fn inputs_that_cannot_split_are_refused() {
        let dims = Dims { b: 1, s_q: 2, s_k: 2, h_q: 1, h_kv: 1, d_qk: 2, d_v: 2 };
        let params = AttentionParams::default();
        let vis = Visibility::single_device(&params, 2, 2).unwrap();
        let fine = [0.5f32, -1.0, 2.0, 0.25];
        for (bad, at) in [(f32::NAN, 0), (f32::INFINITY, 1), (f32::MAX, 2), (-3.4e38, 1)] {
            let mut qkv = [fine; 3];
            qkv[at][3] = bad;
            let x = f32_inputs(dims, [&qkv[0], &qkv[1], &qkv[2]], &vis, &params, TileConfig::default());
            assert!(forward_split(&x, BlockEngine::Twin).is_none(), "{bad} in input {at}");
        }
        // Every value within bf16's range splits.
        let edge = [3.38e38f32, -3.38e38, 1e-40, 0.0];
        let x = f32_inputs(dims, [&fine, &edge, &edge], &vis, &params, TileConfig::default());
        assert!(forward_split(&x, BlockEngine::Twin).is_some());
    }

    /// The f32 path's inputs of a single-device call of `params`.
    fn f32_inputs<'a>(
        dims: Dims,
        [q, k, v]: [&'a [f32]; 3],
        vis: &'a Visibility,
        params: &AttentionParams,
        tiles: TileConfig,
    ) -> super::super::forward::ForwardInputs<'a> {
        let spec = crate::attention::ScoreSpec::of(params, &dims);
        super::super::forward::ForwardInputs { dims, q, k, v, vis, spec, tiles, progress: None }
    }

    /// The check of [`matches_the_f32_path_within_the_rounding_of_p`] on `unit`; returns the
    /// outputs' bits.
    fn check_against_f32(dims: Dims, tiles: TileConfig, unit: Unit) -> Vec<Vec<u32>> {
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let t = |s, h, d, seed| -> Vec<bf16> {
            let f = randn(vec![dims.b, s, h, d], seed, DType::BF16).as_f32().into_owned();
            f.iter().map(|&x| bf16::from_f32(x)).collect()
        };
        let (q, k, v) = (
            t(dims.s_q, dims.h_q, dims.d_qk, 1),
            t(dims.s_k, dims.h_kv, dims.d_qk, 2),
            t(dims.s_k, dims.h_kv, dims.d_v, 3),
        );
        // Keys 50.. of batch 0 score up to 40× higher: lazy tiles fall back to the exact passes.
        let mut grown = k.clone();
        for x in &mut grown[50 * dims.h_kv * dims.d_qk..dims.s_k * dims.h_kv * dims.d_qk] {
            *x = bf16::from_f32(x.to_f32() * 40.0);
        }
        // A window both ways inside packed documents (one of a single key): partial tiles
        // of every shape, and rows that see nothing of a tile.
        let third = dims.s_k / 3;
        let windowed = AttentionParams {
            mask: Mask::Window { left: Some(37), right: Some(5) },
            documents: Some(crate::Documents::new(vec![third, 1, dims.s_k - third - 1]).unwrap()),
            ..Default::default()
        };
        let mut bits = Vec::new();
        for (params, k) in
            [(AttentionParams::default(), &k), (causal, &k), (AttentionParams::default(), &grown), (windowed, &k)]
        {
            let vis = Visibility::single_device(&params, dims.s_q, dims.s_k).unwrap();
            let wide = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            let (qf, kf, vf) = (wide(&q), wide(k), wide(&v));
            let spec = crate::attention::ScoreSpec::of(&params, &dims);
            let x = ForwardInputs { dims, q: &q, k, v: &v, vis: &vis, spec, tiles, progress: None };
            let xf = f32_inputs(dims, [&qf, &kf, &vf], &vis, &params, tiles);
            let ((o, lse), (o_ref, lse_ref)) = (forward_on::<f32>(&x, unit), super::super::forward_f32::forward(&xf));
            let v_max = vf.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (i, (&a, &b)) in lse.iter().zip(&lse_ref).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{unit:?} {:?} lse[{i}] {a} vs {b}", params.mask);
            }
            for (i, (&a, &b)) in o.iter().zip(&o_ref).enumerate() {
                assert!((a - b).abs() <= 2f32.powi(-8) * v_max, "{unit:?} {:?} o[{i}] {a} vs {b}", params.mask);
            }
            bits.push(o.iter().chain(&lse).map(|x| x.to_bits()).collect());
        }
        bits
    }
}
