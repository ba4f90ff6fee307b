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

use super::bf16_rows as rows;
use super::forward::{drive_into, drive_packed, PackedKeys, QueryTileWork, RowState, PACKED_BUDGET};
use super::products::{self as mm, AOperand, BOperand, Epilogue};
use super::simd;
use super::tiles::{call_spans, classify, mask_rows, reach, Output, ReachOf, Span, TileKind};
use half::bf16;

/// The bf16 path's inputs.
pub(crate) type ForwardInputs<'a> = super::forward::ForwardInputs<'a, bf16>;

/// Returns `(o [b, s_q, h_q, d], lse [b, h_q, s_q])`, `o` in `O` (f32: unrounded, the
/// drivers' partial results; bf16: rounded, a final output) and `lse` in f32.
pub(crate) fn forward<O: Output>(x: &ForwardInputs) -> (Vec<O>, Vec<f32>) {
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::Bf16, crate::flops::Pass::Forward);
    let queries = mm::RowPairs::new(x.q, [dm.b, dm.s_q, dm.h_q, dm.d]);
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
    /// Running row maxima of `s` per lane, `[block_q][16]` ([`mm::product_max`]).
    maxes: Vec<f32>,
}

impl<'a> Worker<'a> {
    fn new(
        x: &'a ForwardInputs<'a>,
        keys: &'a PackedKeys<u32>,
        queries: &'a mm::RowPairs<'a>,
        k_spans: &'a [Span],
        bq: usize,
    ) -> Self {
        let d = x.dims.d;
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
        }
    }
}

impl QueryTileWork for Worker<'_> {
    fn run(&mut self, b: usize, h: usize, qs: &Span) {
        let (x, keys) = (self.x, self.keys);
        let dm = x.dims;
        let d = dm.d;
        let hk = dm.kv_head(h);
        let (br, dp, sr, or) = (qs.len, mm::pairs(d), keys.key_vectors * 16, mm::vectors(d) * 16);
        self.st.start(br);
        let c = x.scale * std::f32::consts::LOG2_E;
        let qa = self.queries.at(b, h, qs.start);
        for (t, ks) in self.k_spans.iter().enumerate() {
            let kind = classify(x.vis, qs, ks);
            if kind == TileKind::Skip {
                continue;
            }
            let bc = ks.len;
            let (kt, vt) = keys.tile(&dm, b, hk, t);
            let s = &mut self.s[..br * sr];
            let kop = BOperand { data: kt, vectors: keys.key_vectors };
            // On a partial tile each block of query rows computes only the keys it may see.
            let key_reach = match kind {
                TileKind::Partial => reach(x.vis, qs, ks, mm::BLOCK_ROWS, ReachOf::QueryBlocks),
                _ => Vec::new(),
            };
            // A fully visible tile without padding lanes takes its row maxima as S is stored.
            let fused_max = kind == TileKind::Full && bc % 16 == 0;
            if fused_max {
                let maxes = &mut self.maxes[..16 * br];
                maxes.fill(f32::NEG_INFINITY);
                mm::product_max(s, sr, br, mm::vectors(bc), qa, kop, dp, c, maxes);
            } else {
                let lanes = mm::Reach::lanes(&key_reach);
                mm::product(s, sr, br, mm::vectors(bc), qa, kop, dp, Epilogue::Set(c), lanes);
            }
            if kind == TileKind::Partial {
                mask_rows(x.vis, s, sr, br, bc, qs.start, ks.start);
            }
            let p16: &mut [u16] = bytemuck::cast_slice_mut(&mut self.p[..br * sr / 2]);
            for i in 0..br {
                let row = &mut s[i * sr..][..bc];
                let t_max = simd::row_max(if fused_max { &self.maxes[16 * i..][..16] } else { row });
                let sub = self.st.advance(i, t_max);
                let prow = &mut p16[i * sr..][..sr];
                // The normaliser sums the probabilities before rounding (f32-accurate LSE).
                self.st.l[i] += rows::exp2_round_row(row, sub, prow);
                if bc % 2 == 1 {
                    prow[bc] = 0; // the odd key's partner in the last pair step
                }
            }
            let pa = AOperand { data: &self.p, rs: sr / 2, ps: 1 };
            let vop = BOperand { data: vt, vectors: keys.value_vectors };
            let alpha = Epilogue::Rescale(&self.st.alpha[..br]);
            mm::product(
                &mut self.st.acc[..br * or],
                or,
                br,
                mm::vectors(d),
                pa,
                vop,
                mm::pairs(bc),
                alpha,
                mm::Reach::steps(&key_reach),
            );
        }
    }

    fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize) {
        self.st.finish(lse)
    }
}
