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
//! in the epilogue of `Q·Kᵀ` ([`mm::product_exp2_bf16`]: S never stored, P written rounded
//! to bf16 while the scores are in registers) and adds `P·V` without rescaling the output;
//! when a score exceeds its row's max by more than [`LAZY_GROWTH`] (or a sum is not finite)
//! the tile takes the exact passes (S, row maxima, new max, rescale, P), as the first tile
//! of each task and partially masked tiles do.

use super::bf16_rows as rows;
use super::forward::{drive_into, drive_packed, PackedKeys, QueryTileWork, RowState, LAZY_GROWTH, PACKED_BUDGET};
use super::products::{self as mm, AOperand, BOperand, Epilogue};
use super::score::Scores;
use super::simd;
use super::tiles::{call_spans, mask_rows, reach, Output, ReachOf};
use crate::attention::{classify, Span, TileKind};
use half::bf16;

/// The bf16 path's inputs.
pub(crate) type ForwardInputs<'a> = super::forward::ForwardInputs<'a, bf16>;

/// Returns `(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])`, `o` in `O` (f32: unrounded, the
/// drivers' partial results; bf16: rounded, a final output) and `lse` in f32.
pub(crate) fn forward<O: Output>(x: &ForwardInputs) -> (Vec<O>, Vec<f32>) {
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::Bf16, crate::flops::Pass::Forward);
    let queries = mm::RowPairs::new(x.q, [dm.b, dm.s_q, dm.h_q, dm.d_qk]);
    drive_packed(dm, x.k, x.v, &k_spans, bk, PACKED_BUDGET, |out, keys: &PackedKeys<u32>, heads| {
        drive_into(out, dm, &q_spans, heads, x.progress, || Worker::new(x, keys, &queries, &k_spans, bq))
    })
}

/// Per-thread state of the query tiles it runs.
struct Worker<'a> {
    x: &'a ForwardInputs<'a>,
    keys: &'a PackedKeys<u32>,
    /// The queries as A pairs.
    queries: &'a mm::RowPairs<'a>,
    k_spans: &'a [Span],
    /// The query tile's running max, sum, rescale factors and unnormalised output.
    st: RowState,
    /// Scores, then probabilities, `[block_q][sr]` (keys as lanes).
    s: Vec<f32>,
    /// The probabilities in bf16 as A pairs, `[block_q][sr / 2]`.
    p: Vec<u32>,
    /// Running row maxima of `s` per lane, `[block_q][16]` ([`mm::product_max`]), and of a
    /// lazily rescaled tile's shifted scores with their sums ([`mm::product_exp2_bf16`]).
    maxes: Vec<f32>,
    sums: Vec<f32>,
    /// How the scores are formed.
    scores: Scores,
}

impl<'a> Worker<'a> {
    fn new(
        x: &'a ForwardInputs<'a>,
        keys: &'a PackedKeys<u32>,
        queries: &'a mm::RowPairs<'a>,
        k_spans: &'a [Span],
        bq: usize,
    ) -> Self {
        let d = x.dims.d_v;
        let sr = keys.key_vectors * 16;
        Worker {
            x,
            keys,
            queries,
            k_spans,
            st: RowState::new(bq, mm::vectors(d) * 16),
            s: vec![0.0; bq * sr],
            p: vec![0; bq * sr / 2],
            maxes: vec![0.0; bq * 16],
            sums: vec![0.0; bq * 16],
            scores: Scores::of(&x.spec),
        }
    }

    /// A fully visible tile (no padding lanes) lazily rescaled: P against the running max
    /// `m` in the product's epilogue, rounded to bf16 into `p`. Returns whether every shifted
    /// score stayed within [`LAZY_GROWTH`] and every sum finite (then `l` has the tile's
    /// sums and `p` its P, and the output needs no rescale); otherwise nothing but `p`
    /// changed and the tile takes the exact passes.
    #[allow(clippy::too_many_arguments)]
    fn lazy_whole(&mut self, br: usize, sr: usize, n16: usize, qa: AOperand, kop: BOperand, dp: usize, c: f32) -> bool {
        let (maxes, sums) = (&mut self.maxes[..16 * br], &mut self.sums[..16 * br]);
        maxes.fill(f32::NEG_INFINITY);
        sums.fill(0.0);
        let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.p[..br * sr / 2]);
        mm::product_exp2_bf16(p16, sr, br, n16, qa, kop, dp, c, &self.st.m[..br], maxes, sums);
        // SAFETY: `product_exp2_bf16` above asserted AVX512_BF16, which comes with AVX512F.
        let (x_max, total) = unsafe { simd::avx512::max_and_total(maxes, sums) };
        let bounded = x_max <= LAZY_GROWTH && total.is_finite();
        if bounded {
            // SAFETY: as above.
            unsafe { simd::avx512::add_lane_sums(&mut self.st.l[..br], sums) };
        }
        bounded
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
        let s = &mut self.s[..br * sr];
        if whole {
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
        let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.p[..br * sr / 2]);
        for i in 0..br {
            let row = &mut s[i * sr..][..bc];
            let t_max = simd::row_max(if whole { &self.maxes[16 * i..][..16] } else { row });
            let sub = self.st.advance(i, t_max);
            let prow = &mut p16[i * sr..][..sr];
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
        let (br, dp, sr, or) = (qs.len, mm::pairs(d), keys.key_vectors * 16, mm::vectors(d_v) * 16);
        self.st.start(br);
        let c = self.scores.factor();
        let qa = self.queries.at(b, h, qs.start);
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
            // P in the product's epilogue against it, the output not rescaled.
            let whole = kind == TileKind::Full && bc % 16 == 0 && self.scores.fused();
            let lazy = whole && self.st.all_finite() && self.lazy_whole(br, sr, mm::vectors(bc), qa, kop, dp, c);
            if !lazy {
                self.exact(qs, ks, kind, whole, qa, kop, c, &key_reach);
            }
            let pa = AOperand { data: &self.p, rs: sr / 2, ps: 1 };
            let vop = BOperand { data: vt, vectors: keys.value_vectors };
            let epi = if lazy { Epilogue::Add } else { Epilogue::Rescale(&self.st.alpha[..br]) };
            let pv_steps = mm::Reach::steps(&key_reach);
            mm::product(&mut self.st.acc[..br * or], or, br, mm::vectors(d_v), pa, vop, mm::pairs(bc), epi, pv_steps);
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
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let t = |s, h, seed| -> Vec<bf16> {
            let f = randn(vec![dims.b, s, h, dims.d_qk], seed, DType::BF16).as_f32().into_owned();
            f.iter().map(|&x| bf16::from_f32(x)).collect()
        };
        let (q, k, v) = (t(dims.s_q, dims.h_q, 1), t(dims.s_k, dims.h_kv, 2), t(dims.s_k, dims.h_kv, 3));
        // Keys 150.. of batch 0 score up to 40× higher: lazy tiles fall back to the exact passes.
        let mut grown = k.clone();
        for x in &mut grown[150 * dims.h_kv * dims.d_qk..dims.s_k * dims.h_kv * dims.d_qk] {
            *x = bf16::from_f32(x.to_f32() * 40.0);
        }
        for (params, k) in [(AttentionParams::default(), &k), (causal, &k), (AttentionParams::default(), &grown)] {
            let vis = Visibility::single_device(&params, dims.s_q, dims.s_k).unwrap();
            let wide = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
            let (qf, kf, vf) = (wide(&q), wide(k), wide(&v));
            let spec = crate::attention::ScoreSpec::of(&params, &dims);
            let x = ForwardInputs { dims, q: &q, k, v: &v, vis: &vis, spec, tiles, progress: None };
            let xf = super::super::forward::ForwardInputs {
                dims,
                q: &qf,
                k: &kf,
                v: &vf,
                vis: &vis,
                spec,
                tiles,
                progress: None,
            };
            let ((o, lse), (o_ref, lse_ref)) = (forward::<f32>(&x), super::super::forward_f32::forward(&xf));
            let v_max = vf.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (i, (&a, &b)) in lse.iter().zip(&lse_ref).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{:?} lse[{i}] {a} vs {b}", params.mask);
            }
            for (i, (&a, &b)) in o.iter().zip(&o_ref).enumerate() {
                assert!((a - b).abs() <= 2f32.powi(-8) * v_max, "{:?} o[{i}] {a} vs {b}", params.mask);
            }
        }
    }
}
