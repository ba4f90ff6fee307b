//! Tiled flash-attention forward of the f32 path on AVX-512: the products are the crate's
//! own f32 kernels ([`super::products`]), with the probabilities computed in the epilogue
//! of `Q·Kᵀ` while the scores are still in registers.
//!
//! K and V are packed once per call, per group of (batch, kv head) pairs under a memory
//! budget ([`PackedKeys`], [`super::forward::drive_packed`]), Q read in place; each task (batch,
//! query head, query tile) keeps `S` row-major (keys as lanes) and P in its place. Lazy
//! rescaling: once every row of the task has a finite running max `m`, a tile's
//! probabilities are taken against it (softmax is invariant under the shift, so `m` need not
//! be the true max while P stays bounded) — on a fully visible tile in the product's
//! epilogue ([`super::products::product_exp2`]), on a partially masked one (or one whose key
//! count is not a multiple of 16) in one pass per masked row — and the tile is done without
//! touching `m` or rescaling the output. When a score exceeds its row's `m` by more than
//! [`LAZY_GROWTH`] (or a sum is not finite: NaN or overflow) the tile is computed again and
//! takes the exact passes (row maxima, new `m`, rescale factors, P), as the first tile of
//! each task does. The same results as [`super::forward::forward_portable`] within f32
//! rounding; NaN and infinities behave alike (masked non-finite values stay out of visible
//! rows: a partial tile with non-finite inputs adds `P·V` pair by visible pair).

use std::ops::Range;

use super::forward::{
    drive_into, drive_packed, ForwardInputs, PackedKeys, QueryTileWork, RowState, LAZY_GROWTH, PACKED_BUDGET,
};
use super::products::{self as mm, AOperand, BOperand, Epilogue};
use super::score::Scores;
use super::simd;
use super::tiles::{call_spans, mask_rows, reach, rows_finite, ReachOf};
use crate::attention::{classify, Span, TileKind};
use crate::flops::Pass;

/// Returns `(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])` in f32.
///
/// # Panics
/// When the processor lacks AVX512F (the caller checks [`mm::Element::available`]).
pub(crate) fn forward(x: &ForwardInputs) -> (Vec<f32>, Vec<f32>) {
    forward_packing(x, PACKED_BUDGET)
}

/// [`forward`] with K and V packed in groups of (batch, kv head) pairs under `budget` bytes.
fn forward_packing(x: &ForwardInputs, budget: usize) -> (Vec<f32>, Vec<f32>) {
    assert!(<f32 as mm::Element>::available(), "the f32 AVX-512 forward on a processor without AVX512F and AVX512DQ");
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::F32, Pass::Forward);
    drive_packed(dm, x.k, x.v, &k_spans, bk, budget, |out, keys, heads| {
        drive_into(out, dm, &q_spans, heads, x.progress, || Worker::new(x, keys, &k_spans, bq))
    })
}

/// Per-thread state of the query tiles it runs.
struct Worker<'a> {
    x: &'a ForwardInputs<'a>,
    keys: &'a PackedKeys<f32>,
    k_spans: &'a [Span],
    /// The query tile's running max, sum, rescale factors and unnormalised output.
    st: RowState,
    /// Scores, then probabilities, `[block_q][sr]` (keys as lanes).
    s: Vec<f32>,
    /// Per-lane row maxima and sums of a lazily rescaled tile, `[block_q][16]`.
    maxes: Vec<f32>,
    sums: Vec<f32>,
}

impl<'a> Worker<'a> {
    fn new(x: &'a ForwardInputs<'a>, keys: &'a PackedKeys<f32>, k_spans: &'a [Span], bq: usize) -> Self {
        let d = x.dims.d_v;
        let sr = keys.key_vectors * 16;
        Worker {
            x,
            keys,
            k_spans,
            st: RowState::new(bq, mm::vectors(d) * 16),
            s: vec![0.0; bq * sr],
            maxes: vec![0.0; bq * 16],
            sums: vec![0.0; bq * 16],
        }
    }

    /// A fully visible tile, lazily rescaled: P against the running max in the product's
    /// epilogue. Returns whether every score stayed within [`LAZY_GROWTH`] of its row's max
    /// and every sum finite (then `l` has the tile's sums and `s` its P); otherwise nothing
    /// but `s` changed.
    fn lazy_whole(&mut self, t: &Tile) -> bool {
        let br = t.qs.len;
        let (maxes, sums) = (&mut self.maxes[..16 * br], &mut self.sums[..16 * br]);
        maxes.fill(f32::NEG_INFINITY);
        sums.fill(0.0);
        let (s, sr, n16) = (&mut self.s[..br * t.sr], t.sr, mm::vectors(t.ks.len));
        mm::product_exp2(s, sr, br, n16, t.qa, t.kop, t.d, t.scores.factor(), &self.st.m[..br], maxes, sums);
        // SAFETY: this worker runs only where AVX512F is (asserted in `forward`).
        let (x_max, total) = unsafe { simd::avx512::max_and_total(maxes, sums) };
        let bounded = x_max <= LAZY_GROWTH && total.is_finite();
        if bounded {
            // SAFETY: as above.
            unsafe { simd::avx512::add_lane_sums(&mut self.st.l[..br], sums) };
        }
        bounded
    }

    /// A partially masked tile, lazily rescaled: the masked scores, then P against the
    /// running max in one pass per row that also takes its max and sum. The same outcome as
    /// [`Worker::lazy_whole`].
    fn lazy_partial(&mut self, t: &Tile, key_reach: &[Range<usize>]) -> bool {
        let br = t.qs.len;
        self.scores(t, key_reach);
        let (mut bounded, bc) = (true, t.ks.len);
        for i in 0..br {
            let row = &mut self.s[i * t.sr..][..bc];
            // SAFETY: as in `lazy_whole`.
            let (x_max, sum) = unsafe { simd::avx512::exp2_sub_max_sum(row, self.st.m[i]) };
            self.sums[i] = sum;
            // A row that sees no key of the tile has x_max = -inf and sum 0.
            bounded &= x_max <= LAZY_GROWTH && sum.is_finite();
        }
        if bounded {
            simd::axpy(&mut self.st.l[..br], 1.0, &self.sums[..br]);
        }
        bounded
    }

    /// The masked scores `S` of the tile into `s` (row-major, keys as lanes): on a partial
    /// tile each block of query rows computes only the keys it may see.
    fn scores(&mut self, t: &Tile, key_reach: &[Range<usize>]) {
        let (br, bc, vis) = (t.qs.len, t.ks.len, self.x.vis);
        let s = &mut self.s[..br * t.sr];
        let reach = mm::Reach::lanes(key_reach);
        mm::product(s, t.sr, br, mm::vectors(bc), t.qa, t.kop, t.d, Epilogue::Set(t.scores.factor()), reach);
        // The score options before the mask (lanes outside a block's reach are masked below).
        for row in s.chunks_exact_mut(t.sr) {
            t.scores.finish_row(&mut row[..bc]);
        }
        if t.kind == TileKind::Partial {
            mask_rows(vis, s, t.sr, br, bc, t.qs.start, t.ks.start);
        }
    }

    /// The exact passes: the tile's row maxima, the new running max, the rescale factors,
    /// P against the new max. A fully visible tile takes its maxima in the product's
    /// epilogue.
    fn exact(&mut self, t: &Tile, key_reach: &[Range<usize>]) {
        let (br, bc) = (t.qs.len, t.ks.len);
        let whole = t.kind == TileKind::Full && bc % 16 == 0 && t.scores.fused();
        if whole {
            let maxes = &mut self.maxes[..16 * br];
            maxes.fill(f32::NEG_INFINITY);
            let s = &mut self.s[..br * t.sr];
            mm::product_max(s, t.sr, br, mm::vectors(bc), t.qa, t.kop, t.d, t.scores.factor(), maxes);
        } else {
            self.scores(t, key_reach);
        }
        for i in 0..br {
            let row = &mut self.s[i * t.sr..][..bc];
            // A NaN score may be lost from the fused maxima, but its row's sum, LSE and
            // output are NaN either way.
            let t_max = simd::row_max(if whole { &self.maxes[16 * i..][..16] } else { row });
            let sub = self.st.advance(i, t_max);
            // SAFETY: this worker runs only where AVX512F is (asserted in `forward`).
            self.st.l[i] += unsafe { simd::avx512::exp2_sub_sum(row, sub) };
        }
    }

    /// `acc = alpha ∘ acc + P V` (`rescale`) or `acc += P V`. On a partial tile with
    /// non-finite inputs (`exact_pv`) the visible pairs are added one by one, so that masked
    /// entries cannot leak NaN/Inf through 0 · NaN.
    fn add_pv(&mut self, t: &Tile, key_reach: &[Range<usize>], rescale: bool, exact_pv: bool) {
        let (br, bc, d, or) = (t.qs.len, t.ks.len, t.d_v, t.or);
        let acc = &mut self.st.acc[..br * or];
        if exact_pv {
            let (kv_rs, vis) = (self.x.dims.h_kv * d, self.x.vis);
            for i in 0..br {
                let (acc_row, p_row) = (&mut acc[i * or..][..d], &self.s[i * t.sr..][..bc]);
                if rescale {
                    simd::scale(acc_row, self.st.alpha[i]);
                }
                for (j, &p) in p_row.iter().enumerate() {
                    if vis.visible(t.qs.start + i, t.ks.start + j) {
                        simd::axpy(acc_row, p, &t.v_base[(t.ks.start + j) * kv_rs..][..d]);
                    }
                }
            }
        } else {
            let pa = AOperand { data: &self.s[..], rs: t.sr, ps: 1 };
            let epi = if rescale { Epilogue::Rescale(&self.st.alpha[..br]) } else { Epilogue::Add };
            mm::product(acc, or, br, mm::vectors(d), pa, t.vop, bc, epi, mm::Reach::steps(key_reach));
        }
    }
}

/// One (query tile, key tile) pair's operands and shapes.
struct Tile<'a> {
    kind: TileKind,
    qs: &'a Span,
    ks: &'a Span,
    /// Q in place, packed K and V of the key tile, V's rows in place (for exact P·V).
    qa: AOperand<'a, f32>,
    kop: BOperand<'a, f32>,
    vop: BOperand<'a, f32>,
    v_base: &'a [f32],
    /// Head sizes (q/k and v), `S`'s and the output's row lengths, how the scores are formed.
    d: usize,
    d_v: usize,
    sr: usize,
    or: usize,
    scores: Scores,
}

impl QueryTileWork for Worker<'_> {
    fn run(&mut self, b: usize, h: usize, qs: &Span) {
        let (x, keys) = (self.x, self.keys);
        let dm = x.dims;
        let (d, d_v) = (dm.d_qk, dm.d_v);
        let hk = dm.kv_head(h);
        let (br, or) = (qs.len, mm::vectors(d_v) * 16);
        let q_rs = dm.h_q * d;
        self.st.start(br);
        let q_base = &x.q[(b * dm.s_q * dm.h_q + h) * d..];
        let mut q_finite: Option<bool> = None;
        for (ti, ks) in self.k_spans.iter().enumerate() {
            let kind = classify(x.vis, qs, ks);
            if kind == TileKind::Skip {
                continue;
            }
            let (kt, vt) = keys.tile(&dm, b, hk, ti);
            let t = Tile {
                kind,
                qs,
                ks,
                qa: AOperand { data: &q_base[qs.start * q_rs..], rs: q_rs, ps: 1 },
                kop: BOperand { data: kt, vectors: keys.key_vectors },
                vop: BOperand { data: vt, vectors: keys.value_vectors },
                v_base: &x.v[(b * dm.s_k * dm.h_kv + hk) * d_v..],
                d,
                d_v,
                sr: keys.key_vectors * 16,
                or,
                scores: Scores::of(&x.spec),
            };
            let key_reach = match kind {
                TileKind::Partial => reach(x.vis, qs, ks, mm::BLOCK_ROWS, ReachOf::QueryBlocks),
                _ => Vec::new(),
            };
            // Masked entries must not leak NaN/Inf through 0 · NaN in the P·V product.
            let exact_pv = kind == TileKind::Partial && {
                let qf = *q_finite.get_or_insert_with(|| rows_finite(q_base, qs.start, br, d, q_rs));
                !(qf && keys.finite(&dm, b, hk, ti))
            };
            if self.st.all_finite() {
                let lazy = match kind {
                    TileKind::Full if ks.len % 16 == 0 && t.scores.fused() => self.lazy_whole(&t),
                    _ => self.lazy_partial(&t, &key_reach),
                };
                if lazy {
                    self.add_pv(&t, &key_reach, false, exact_pv);
                    continue;
                }
            }
            self.exact(&t, &key_reach);
            self.add_pv(&t, &key_reach, true, exact_pv);
        }
    }

    fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize) {
        self.st.finish(lse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::tiles::TileConfig;
    use crate::mask::{Documents, Mask};
    use crate::params::Visibility;
    use crate::{random::randn, AttentionParams, DType, Dims};

    /// This path against the portable one (`gemm` products, the same online softmax) on one
    /// call: O and LSE within f32 rounding, NaN where the portable path has NaN.
    fn check(dims: Dims, params: &AttentionParams, tiles: TileConfig, poison: impl Fn(&mut [f32], &mut [f32])) {
        check_packing(dims, params, tiles, poison, PACKED_BUDGET)
    }

    /// [`check`] with K and V packed in groups under `budget` bytes.
    fn check_packing(
        dims: Dims,
        params: &AttentionParams,
        tiles: TileConfig,
        poison: impl Fn(&mut [f32], &mut [f32]),
        budget: usize,
    ) {
        let t = |s, h, seed| randn(vec![dims.b, s, h, dims.d_qk], seed, DType::F32).as_f32().into_owned();
        let (q, mut k, mut v) = (t(dims.s_q, dims.h_q, 1), t(dims.s_k, dims.h_kv, 2), t(dims.s_k, dims.h_kv, 3));
        poison(&mut k, &mut v);
        let vis = Visibility::single_device(params, dims.s_q, dims.s_k).unwrap();
        let x = ForwardInputs {
            dims,
            q: &q,
            k: &k,
            v: &v,
            vis: &vis,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            tiles,
            progress: None,
        };
        let ((o, lse), (o_ref, lse_ref)) = (forward_packing(&x, budget), super::super::forward::forward_portable(&x));
        let case = format!("{dims:?} {:?} {tiles:?}", params.mask);
        for (what, got, want) in [("o", &o, &o_ref), ("lse", &lse, &lse_ref)] {
            for (i, (&a, &b)) in got.iter().zip(want.iter()).enumerate() {
                assert_eq!(a.is_nan(), b.is_nan(), "{case}: {what}[{i}] {a} vs {b}");
                assert!(
                    a.is_nan() || a == b || (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                    "{case}: {what}[{i}] {a} vs {b}"
                );
            }
        }
    }

    /// Every kind of tile: fully visible ones in the lazy epilogue (and their fallback when
    /// later keys score far higher), partial ones under causal, window and document masks,
    /// key tiles of lengths not a multiple of 16, odd head sizes, grouped heads, rows that see
    /// nothing, and NaN/inf in keys and values that masks hide or rows see.
    #[test]
    fn matches_the_portable_path_on_every_kind_of_tile() {
        if !<f32 as mm::Element>::available() {
            return;
        }
        let dims = |s_q, s_k, h_q, h_kv, d| Dims { b: 2, s_q, s_k, h_q, h_kv, d_qk: d, d_v: d };
        let none = |_: &mut [f32], _: &mut [f32]| {};
        let tiles = |block_q, block_k| TileConfig { block_q, block_k };
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let window = AttentionParams { mask: Mask::Window { left: Some(37), right: Some(5) }, ..Default::default() };
        let docs = AttentionParams {
            mask: Mask::Causal,
            documents: Some(Documents::new(vec![70, 1, 129]).unwrap()),
            ..Default::default()
        };
        check(dims(200, 200, 4, 2, 64), &AttentionParams::default(), tiles(48, 64), none);
        check(dims(200, 200, 4, 2, 64), &causal, tiles(48, 64), none);
        check(dims(137, 300, 2, 1, 40), &causal, tiles(40, 48), none);
        check(dims(200, 200, 2, 2, 33), &window, tiles(24, 32), none);
        check(dims(200, 200, 2, 1, 16), &docs, tiles(36, 64), none);
        check(dims(100, 100, 1, 1, 80), &AttentionParams::default(), tiles(0, 0), none);
        // K and V packed one (batch, kv head) pair of the 6 at a time, and four at a time
        // (the last group short; a pair holds 5 key tiles of 2 · 64 steps × 5 vectors of 16
        // lanes, 4 bytes each): every pair's tiles in their place.
        for budget in [1, 4 * (5 * 2 * 64 * 5 * 16 * 4)] {
            check_packing(dims(200, 300, 6, 3, 64), &causal, tiles(48, 64), none, budget);
        }
        // Keys 150.. score up to 40× higher: the lazy tiles fall back to the exact passes.
        let growth = |k: &mut [f32], _: &mut [f32]| k[150 * 2 * 64..].iter_mut().for_each(|x| *x *= 40.0);
        check(dims(200, 200, 2, 2, 64), &AttentionParams::default(), tiles(48, 64), growth);
        // A NaN key and an infinite value under a causal mask: hidden from the earlier rows.
        let nan = |k: &mut [f32], v: &mut [f32]| {
            k[(130 * 2 + 1) * 64 + 3] = f32::NAN;
            v[(90 * 2) * 64 + 7] = f32::INFINITY;
        };
        check(dims(200, 200, 2, 2, 64), &causal, tiles(48, 64), nan);
        check(dims(200, 200, 2, 2, 64), &AttentionParams::default(), tiles(48, 64), nan);
    }
}
