//! Tile geometry: which (query tile, key tile) pairs are skipped, fully visible, or
//! need the per-element mask, decided from the tiles' global position and document ranges.

use std::ops::Range;

use super::Arithmetic;
use crate::attention::{classify, spans, Span, TileKind};
use crate::flops::Pass;
use crate::params::Visibility;

/// Tile sizes of the CPU implementation. A size of 0 (the `Default`) means the tuned size of
/// the path and pass the call runs: 128 × 256 for the f32 forward, 256 × 256 for the f32
/// backward, 128 × 512 for bf16 products (tuned on the 2-vCPU AVX-512 EPYC machines the
/// crate is developed on, s = 4096: 128 × 512 ran the bf16 path up to 10% faster than
/// 256 × 256, and the f32 path 2–5% slower; the f32 forward on its own products (AVX-512)
/// ran 96–144 query rows 4–5% faster than 256 or 512 without a mask and within the noise
/// of them under a causal one; 512 rows had been 5% faster on the `gemm` crate's products,
/// which the backward and processors without AVX-512 use). The bf16 forward, which rescales
/// lazily, runs its automatic key tiles at 256 rows instead of 512 where more than a quarter
/// of the visible tiles of 512 would take the exact passes (each query tile's first visible
/// key tile and the partially masked ones: causal or windowed masks at moderate lengths;
/// causal s = 4096: 7–12% faster; unmasked: 512 stays ~5% faster).
///
/// ```
/// use ringattn::cpu::{Arithmetic, TileConfig};
/// use ringattn::flops::Pass;
/// let auto = TileConfig::default();
/// assert_eq!(auto.resolved(Arithmetic::Bf16, Pass::Backward), TileConfig { block_q: 128, block_k: 512 });
/// assert_eq!(auto.resolved(Arithmetic::F32, Pass::Forward), TileConfig { block_q: 128, block_k: 256 });
/// let mine = TileConfig { block_q: 64, block_k: 0 };
/// assert_eq!(mine.resolved(Arithmetic::F32, Pass::Backward), TileConfig { block_q: 64, block_k: 256 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TileConfig {
    /// Query rows per tile (0: the path's tuned size).
    pub block_q: usize,
    /// Key rows per tile (0: the path's tuned size).
    pub block_k: usize,
}

impl TileConfig {
    /// The sizes a `pass` with products in `arithmetic` runs with: each 0 replaced by that
    /// path's tuned size ([`Arithmetic::Auto`] counts as f32).
    pub fn resolved(self, arithmetic: Arithmetic, pass: Pass) -> TileConfig {
        let (q, k) = match (arithmetic, pass) {
            (Arithmetic::Bf16, _) => (128, 512),
            (Arithmetic::F32 | Arithmetic::Auto, Pass::Forward) => (128, 256),
            (Arithmetic::F32 | Arithmetic::Auto, Pass::Backward) => (256, 256),
        };
        let or = |x: usize, tuned: usize| if x == 0 { tuned } else { x };
        TileConfig { block_q: or(self.block_q, q), block_k: or(self.block_k, k) }
    }

    /// The sizes a single-device call of `pass` with products in `arithmetic` on `s_q`
    /// queries and `s_k` keys under `params` runs with: [`TileConfig::resolved`], except that
    /// the bf16 forward's automatic key tiles are 256 rows where more than a quarter of the
    /// visible tiles of 512 would take its exact passes (see the type's docs).
    ///
    /// # Errors
    /// As [`crate::cpu::forward`] for `params` that do not fit the lengths
    /// ([`crate::Error::Documents`]).
    ///
    /// ```
    /// use ringattn::cpu::{Arithmetic, TileConfig};
    /// use ringattn::{flops::Pass, AttentionParams, Mask};
    /// let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
    /// let auto = TileConfig::default();
    /// let at = |s| auto.chosen(Arithmetic::Bf16, Pass::Forward, &causal, s, s);
    /// assert_eq!(at(4096)?, TileConfig { block_q: 128, block_k: 256 });
    /// assert_eq!(at(32768)?, TileConfig { block_q: 128, block_k: 512 });
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    pub fn chosen(
        self,
        arithmetic: Arithmetic,
        pass: Pass,
        params: &crate::AttentionParams,
        s_q: usize,
        s_k: usize,
    ) -> crate::Result<TileConfig> {
        let vis = Visibility::single_device(params, s_q, s_k)?;
        let (block_q, block_k, _, _) = call_spans(&vis, self, arithmetic, pass);
        Ok(TileConfig { block_q, block_k })
    }
}

/// The query and key tiles of a `pass` with products in `arithmetic`: `(block_q, block_k,
/// query spans, key spans)` (sizes [`TileConfig::resolved`]).
pub(crate) fn call_spans(
    vis: &Visibility,
    tiles: TileConfig,
    arithmetic: Arithmetic,
    pass: Pass,
) -> (usize, usize, Vec<Span>, Vec<Span>) {
    let resolved = tiles.resolved(arithmetic, pass);
    let (bq, mut bk) = (resolved.block_q, resolved.block_k);
    let q_spans = spans(&vis.q_pos, vis.q_doc.as_deref(), bq);
    let mut k_spans = spans(&vis.k_pos, vis.k_doc.as_deref(), bk);
    let lazy_bf16 = arithmetic == Arithmetic::Bf16 && pass == Pass::Forward;
    if lazy_bf16 && tiles.block_k == 0 && exact_share(vis, &q_spans, &k_spans) > EXACT_SHARE_MOST {
        bk = SHORT_KEY_TILE;
        k_spans = spans(&vis.k_pos, vis.k_doc.as_deref(), bk);
    }
    (bq, bk, q_spans, k_spans)
}

/// The largest share of visible tile pairs a lazily rescaling forward takes through its
/// exact passes with long key tiles before it runs [`SHORT_KEY_TILE`] instead.
const EXACT_SHARE_MOST: f64 = 0.25;
/// The key tile of such a forward ([`call_spans`]).
const SHORT_KEY_TILE: usize = 256;

/// The share of the visible (query tile, key tile) pairs that a lazily rescaling forward
/// computes by its exact passes: each query tile's first visible key tile and every
/// partially masked one (0 when nothing is visible).
fn exact_share(vis: &Visibility, q_spans: &[Span], k_spans: &[Span]) -> f64 {
    let (mut visible, mut exact) = (0usize, 0usize);
    for qs in q_spans {
        let mut first = true;
        for ks in k_spans {
            let kind = classify(vis, qs, ks);
            if kind != TileKind::Skip {
                visible += 1;
                exact += usize::from(first || kind == TileKind::Partial);
                first = false;
            }
        }
    }
    if visible == 0 {
        0.0
    } else {
        exact as f64 / visible as f64
    }
}

/// Which rows a [`reach`] gives ranges for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReachOf {
    /// For each block of query rows, the key rows its visible pairs lie in.
    QueryBlocks,
    /// For each block of key rows, the query rows its visible pairs lie in.
    KeyBlocks,
}

/// Rows of the tile covered by `span`, in sub-spans of `block` rows (starts absolute).
fn sub_spans(pos: &[i64], doc: Option<&[u32]>, span: &Span, block: usize) -> Vec<Span> {
    let rows = span.start..span.start + span.len;
    let mut out = spans(&pos[rows.clone()], doc.map(|d| &d[rows]), block);
    for s in &mut out {
        s.start += span.start;
    }
    out
}

/// Where the visible pairs of tile pair (`qs`, `ks`) lie: per block of `rows` rows of one
/// side (`of`), the range of the other side's rows (tile-local, at 16-row granularity)
/// outside which no pair is visible — empty when the block sees nothing. Conservative as
/// [`classify`] is: every visible pair lies inside.
pub(crate) fn reach(vis: &Visibility, qs: &Span, ks: &Span, rows: usize, of: ReachOf) -> Vec<std::ops::Range<usize>> {
    let (q_block, k_block) = match of {
        ReachOf::QueryBlocks => (rows, 16),
        ReachOf::KeyBlocks => (16, rows),
    };
    let q_sub = sub_spans(&vis.q_pos, vis.q_doc.as_deref(), qs, q_block);
    let k_sub = sub_spans(&vis.k_pos, vis.k_doc.as_deref(), ks, k_block);
    let range = |seen: &mut dyn Iterator<Item = &Span>, base: usize| {
        let (lo, hi) = seen.fold((usize::MAX, 0), |(lo, hi), s| (lo.min(s.start), hi.max(s.start + s.len)));
        if lo < hi {
            lo - base..hi - base
        } else {
            0..0
        }
    };
    match of {
        ReachOf::QueryBlocks => q_sub
            .iter()
            .map(|q| range(&mut k_sub.iter().filter(|k| classify(vis, q, k) != TileKind::Skip), ks.start))
            .collect(),
        ReachOf::KeyBlocks => k_sub
            .iter()
            .map(|k| range(&mut q_sub.iter().filter(|q| classify(vis, q, k) != TileKind::Skip), qs.start))
            .collect(),
    }
}

/// Query rows per block of a partially masked tile's products (the f32 microkernel's
/// height on AVX-512).
pub(crate) const ROW_BLOCK: usize = 64;

/// The products of one tile as (query rows, key rows) blocks, relative to the tile: the whole
/// tile when it is fully visible; on a partial tile each [`ROW_BLOCK`] of query rows with the
/// key rows its visible pairs lie in ([`reach`]), blocks that see nothing left out.
pub(crate) fn row_blocks(vis: &Visibility, qs: &Span, ks: &Span, kind: TileKind) -> Vec<(Range<usize>, Range<usize>)> {
    if kind != TileKind::Partial {
        return vec![(0..qs.len, 0..ks.len)];
    }
    let keys = reach(vis, qs, ks, ROW_BLOCK, ReachOf::QueryBlocks);
    keys.into_iter()
        .enumerate()
        .map(|(r, k)| (r * ROW_BLOCK..((r + 1) * ROW_BLOCK).min(qs.len), k))
        .filter(|(_, k)| !k.is_empty())
        .collect()
}

/// [`Visibility::mask_query_row`] on rows `q0..q0 + rows` of a score tile (row `i` at
/// `s[i · sr..][..bc]`, its keys from `k0`): masked entries become `-inf`. Compiled for
/// AVX-512 where the processor has it (the positions' 64-bit comparisons vectorise: the
/// scalar form cost 2–3% of a causal forward or backward).
pub(crate) fn mask_rows(vis: &Visibility, s: &mut [f32], sr: usize, rows: usize, bc: usize, q0: usize, k0: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        /// # Safety
        /// The processor has AVX512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(vis: &Visibility, s: &mut [f32], sr: usize, rows: usize, bc: usize, q0: usize, k0: usize) {
            for i in 0..rows {
                vis.mask_query_row(&mut s[i * sr..][..bc], q0 + i, k0);
            }
        }
        // SAFETY: AVX512F detected just above.
        return unsafe { wide(vis, s, sr, rows, bc, q0, k0) };
    }
    for i in 0..rows {
        vis.mask_query_row(&mut s[i * sr..][..bc], q0 + i, k0);
    }
}

super::simd::dispatch!(
    /// The keys the rows of query tile `qs` see of key tile `ks`, as lane bits: with
    /// `n16 = ⌈ks.len / 16⌉`, bit `l` of `out[i · n16 + j]` is set where key `16 · j + l`
    /// (below `ks.len`) is visible to row `qs.start + i` ([`Visibility::mask_query_row`]);
    /// lanes from `ks.len` to `16 · n16` are never set. Blocks of 32 rows × 32 keys are
    /// classified first ([`classify`]): only rows of a partially visible block are masked key
    /// by key. `row` is scratch of at least 32 values. Compiled for the widest vectors the
    /// processor has.
    visible_lanes => visible_lanes_impl(vis: &Visibility, qs: &Span, ks: &Span, row: &mut [f32], out: &mut [u16]) -> ()
);

#[inline(always)]
fn visible_lanes_impl<const WIDE: bool>(vis: &Visibility, qs: &Span, ks: &Span, row: &mut [f32], out: &mut [u16]) {
    const B: usize = 32;
    let (rows, bc, n16, q0, k0) = (qs.len, ks.len, ks.len.div_ceil(16), qs.start, ks.start);
    let q_blocks = spans(&vis.q_pos[q0..q0 + rows], vis.q_doc.as_deref().map(|d| &d[q0..q0 + rows]), B);
    let k_blocks = spans(&vis.k_pos[k0..k0 + bc], vis.k_doc.as_deref().map(|d| &d[k0..k0 + bc]), B);
    let out = &mut out[..rows * n16];
    out.fill(0);
    let row = &mut row[..B];
    for qb in &q_blocks {
        for kb in &k_blocks {
            let (j0, nj) = (kb.start / 16, kb.len.div_ceil(16));
            match classify(vis, qb, kb) {
                TileKind::Skip => {}
                TileKind::Full => {
                    for i in qb.start..qb.start + qb.len {
                        for (j, bits) in out[i * n16 + j0..][..nj].iter_mut().enumerate() {
                            let n = kb.len - 16 * j;
                            *bits = if n >= 16 { u16::MAX } else { (1 << n) - 1 };
                        }
                    }
                }
                TileKind::Partial => {
                    for i in qb.start..qb.start + qb.len {
                        let keys = &mut row[..kb.len];
                        keys.fill(0.0);
                        vis.mask_query_row(keys, q0 + i, k0 + kb.start);
                        for (bits, lanes) in out[i * n16 + j0..][..nj].iter_mut().zip(keys.chunks(16)) {
                            *bits = lanes
                                .iter()
                                .enumerate()
                                .fold(0u16, |b, (l, &x)| b | u16::from(x != f32::NEG_INFINITY) << l);
                        }
                    }
                }
            }
        }
    }
}

/// Whether every element of `rows` rows of width `d` (row stride `rs`) is finite.
pub(crate) fn rows_finite(data: &[f32], r0: usize, rows: usize, d: usize, rs: usize) -> bool {
    // A fold without early exit per row, so that it vectorises.
    (r0..r0 + rows).all(|r| data[r * rs..r * rs + d].iter().fold(true, |ok, x| ok & x.is_finite()))
}

/// A buffer that parallel tasks write in disjoint ranges.
pub(crate) struct DisjointWriter<'a, T = f32> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: the writer hands out `&mut` sub-slices only through `range`, whose contract
// requires disjoint ranges across concurrent callers; the elements are Send.
unsafe impl<T: Send> Send for DisjointWriter<'_, T> {}
unsafe impl<T: Send> Sync for DisjointWriter<'_, T> {}

/// The element a driver writes its outputs in: f32 (the drivers' partial results) or bf16
/// (the bf16 path's final outputs, rounded as they are written: no f32 copy of the outputs).
pub(crate) trait Output: Copy + Default + Send + Sync {
    /// `dst[..src.len()] = scale · src` (the product in f32), rounded to this type; `dst` at
    /// least as long as `src`, nothing past it written.
    fn store(dst: &mut [Self], src: &[f32], scale: f32);
    /// `len` zeros (f32: in a buffer the calling thread kept, see [`super::reuse`]).
    fn zeroed(len: usize) -> Vec<Self> {
        vec![Self::default(); len]
    }
    /// `len` elements of unspecified value, for buffers written in full before being read.
    fn for_overwrite(len: usize) -> Vec<Self> {
        Self::zeroed(len)
    }
}

impl Output for f32 {
    fn store(dst: &mut [f32], src: &[f32], scale: f32) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s * scale;
        }
    }

    fn zeroed(len: usize) -> Vec<f32> {
        super::reuse::zeroed(len)
    }

    fn for_overwrite(len: usize) -> Vec<f32> {
        super::reuse::take(len)
    }
}

impl Output for half::bf16 {
    fn store(dst: &mut [half::bf16], src: &[f32], scale: f32) {
        super::bf16_rows::round_row_scaled(src, scale, bytemuck::cast_slice_mut(dst));
    }
}

impl<'a, T> DisjointWriter<'a, T> {
    pub fn new(buf: &'a mut [T]) -> Self {
        DisjointWriter { ptr: buf.as_mut_ptr(), len: buf.len(), _borrow: std::marker::PhantomData }
    }

    /// The elements `start..start + len`.
    ///
    /// # Safety
    /// No two live slices obtained from this writer may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "disjoint writer range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// One worker per rayon thread for the tasks of one call, made on first use and reused by
/// every later task of that thread (rayon's `*_init` adaptors make one per job split, each
/// allocating and freeing its scratch). A task must not wait on rayon work while it holds its
/// worker: a task stolen meanwhile by the same thread would wait for the same slot.
pub(crate) struct PerThread<W> {
    slots: Vec<std::sync::Mutex<Option<W>>>,
}

impl<W> PerThread<W> {
    pub(crate) fn new() -> Self {
        PerThread { slots: (0..rayon::current_num_threads().max(1)).map(|_| std::sync::Mutex::new(None)).collect() }
    }

    /// Runs `f` on the current thread's worker (made by `init` when it has none yet).
    pub(crate) fn with<R>(&self, init: impl FnOnce() -> W, f: impl FnOnce(&mut W) -> R) -> R {
        let at = rayon::current_thread_index().unwrap_or(0) % self.slots.len();
        // A slot is only ever contended when tasks run outside this pool (then it serialises
        // them); a panicking task's worker holds no invariant the next task relies on.
        let mut slot = self.slots[at].lock().unwrap_or_else(|e| e.into_inner());
        f(slot.get_or_insert_with(init))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttentionParams, Documents, Mask, Positions};

    /// The bf16 forward's automatic key tiles shorten to 256 rows where more than a quarter of
    /// the visible tiles of 512 would take the exact passes (causal s = 4096: 60 of 144), and
    /// keep 512 otherwise (no mask s = 4096: 32 of 256; causal s = 32768: 508 of 8320); sizes
    /// the caller chose, the f32 path and the backward are left as resolved.
    #[test]
    fn bf16_forward_key_tiles_follow_the_exact_share() {
        let vis = |mask, s| Visibility::single_device(&AttentionParams { mask, ..Default::default() }, s, s).unwrap();
        let bk = |v: &Visibility, tiles, arithmetic, pass| call_spans(v, tiles, arithmetic, pass).1;
        let auto = TileConfig::default();
        let causal = vis(Mask::Causal, 4096);
        let (_, _, q, k) =
            call_spans(&causal, TileConfig { block_q: 128, block_k: 512 }, Arithmetic::Bf16, Pass::Forward);
        assert_eq!(exact_share(&causal, &q, &k), 60.0 / 144.0);
        assert_eq!(bk(&causal, auto, Arithmetic::Bf16, Pass::Forward), 256);
        assert_eq!(bk(&vis(Mask::None, 4096), auto, Arithmetic::Bf16, Pass::Forward), 512);
        assert_eq!(bk(&vis(Mask::Causal, 32768), auto, Arithmetic::Bf16, Pass::Forward), 512);
        let mine = TileConfig { block_q: 0, block_k: 512 };
        assert_eq!(bk(&causal, mine, Arithmetic::Bf16, Pass::Forward), 512);
        assert_eq!(bk(&causal, auto, Arithmetic::Bf16, Pass::Backward), 512);
        assert_eq!(bk(&causal, auto, Arithmetic::F32, Pass::Forward), 256);
        assert_eq!(bk(&vis(Mask::Causal, 0), auto, Arithmetic::Bf16, Pass::Forward), 512);
    }

    /// Every visible pair of a partial tile lies inside its reach, in both orientations and at
    /// every block size; and the reach is narrower than the tile somewhere (it can fail).
    #[test]
    fn reach_holds_every_visible_pair() {
        let masks = [
            Mask::Causal,
            Mask::Window { left: Some(37), right: Some(5) },
            Mask::Window { left: Some(3), right: None },
        ];
        let placements = [
            (Positions::contiguous(0, 200), Positions::contiguous(0, 200)),
            (Positions::strided(1, 2, 100).unwrap(), Positions::strided(0, 2, 100).unwrap()),
            (Positions::contiguous(150, 50), Positions::contiguous(0, 200)),
        ];
        let (mut narrowed, mut checked) = (0, 0);
        for mask in masks {
            for documents in [None, Some(Documents::new(vec![50, 13, 137]).unwrap())] {
                for (qp, kp) in &placements {
                    let params = AttentionParams { mask, documents: documents.clone(), ..Default::default() };
                    let vis = Visibility::new(&params, qp, kp).unwrap();
                    for (bq, bk, rows) in [(64, 48, 12), (7, 13, 4), (256, 256, 12), (33, 100, 12)] {
                        let (_, _, q_spans, k_spans) =
                            call_spans(&vis, TileConfig { block_q: bq, block_k: bk }, Arithmetic::F32, Pass::Forward);
                        for qs in &q_spans {
                            for ks in &k_spans {
                                if classify(&vis, qs, ks) != TileKind::Partial {
                                    continue;
                                }
                                let by_q = reach(&vis, qs, ks, rows, ReachOf::QueryBlocks);
                                let by_k = reach(&vis, qs, ks, rows, ReachOf::KeyBlocks);
                                assert_eq!((by_q.len(), by_k.len()), (qs.len.div_ceil(rows), ks.len.div_ceil(rows)));
                                for i in 0..qs.len {
                                    for j in 0..ks.len {
                                        if vis.visible(qs.start + i, ks.start + j) {
                                            assert!(by_q[i / rows].contains(&j), "{mask:?} key {j} of query {i}");
                                            assert!(by_k[j / rows].contains(&i), "{mask:?} query {i} of key {j}");
                                        }
                                    }
                                }
                                checked += 1;
                                narrowed += by_q.iter().filter(|r| r.len() < ks.len).count();
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100 && narrowed > 100, "{checked} partial tiles, {narrowed} narrowed blocks");
    }

    /// Tasks reuse their thread's worker: at most one is made per thread, and every task runs.
    #[test]
    fn per_thread_makes_one_worker_per_thread() {
        use rayon::prelude::*;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let made = AtomicUsize::new(0);
        let workers = PerThread::new();
        let init = || {
            made.fetch_add(1, Ordering::Relaxed);
            0usize
        };
        let sum: usize = (0..10_000usize)
            .into_par_iter()
            .map(|i| {
                workers.with(init, |w| {
                    *w += 1;
                    i
                })
            })
            .sum();
        assert_eq!(sum, 10_000 * 9_999 / 2);
        let made = made.into_inner();
        assert!((1..=rayon::current_num_threads()).contains(&made), "{made} workers");
        let runs: usize = workers.slots.into_iter().map(|s| s.into_inner().unwrap().unwrap_or(0)).sum();
        assert_eq!(runs, 10_000);
    }

    /// A causal diagonal tile splits into row blocks that see keys up to their last row; a
    /// fully visible tile is one block; on every partial tile each visible pair lies in the
    /// block of its query row (windows and documents too).
    /// The lane bits of every tile of several masks (tiles of 70 × 45 keys: blocks of 32
    /// classified full, skipped and partial, a last vector half used) against the pair's own
    /// visibility; the lanes past the keys never set.
    #[test]
    fn visible_lanes_are_the_visible_pairs() {
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        for params in [
            causal.clone(),
            AttentionParams { mask: Mask::Window { left: Some(40), right: Some(3) }, ..Default::default() },
            AttentionParams { documents: Some(Documents::new(vec![70, 1, 99, 130]).unwrap()), ..causal.clone() },
        ] {
            let vis = Visibility::single_device(&params, 250, 300).unwrap();
            let (q_spans, k_spans) =
                (spans(&vis.q_pos, vis.q_doc.as_deref(), 70), spans(&vis.k_pos, vis.k_doc.as_deref(), 45));
            let mut row = vec![0.0; 64];
            for qs in &q_spans {
                for ks in &k_spans {
                    let n16 = ks.len.div_ceil(16);
                    let mut bits = vec![0xffff; qs.len * n16];
                    visible_lanes(&vis, qs, ks, &mut row, &mut bits);
                    for i in 0..qs.len {
                        for j in 0..16 * n16 {
                            let set = bits[i * n16 + j / 16] >> (j % 16) & 1 == 1;
                            let want = j < ks.len && vis.visible(qs.start + i, ks.start + j);
                            assert_eq!(set, want, "{params:?}: pair ({i}, {j}) of tile {qs:?} × {ks:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn row_blocks_limit_partial_tiles_to_their_reach() {
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let vis = Visibility::single_device(&causal, 300, 300).unwrap();
        let (_, _, q_spans, k_spans) =
            call_spans(&vis, TileConfig { block_q: 256, block_k: 256 }, Arithmetic::F32, Pass::Forward);
        let tile = |qt: usize, kt: usize| {
            let (qs, ks) = (&q_spans[qt], &k_spans[kt]);
            row_blocks(&vis, qs, ks, classify(&vis, qs, ks))
        };
        let quarters: Vec<_> = (1..=4).map(|r| ((r - 1) * 64..r * 64, 0..r * 64)).collect();
        assert_eq!(tile(0, 0), quarters);
        assert_eq!(tile(1, 0), vec![(0..44, 0..256)]);
        assert_eq!(tile(1, 1), vec![(0..44, 0..44)]);

        for params in [
            AttentionParams { mask: Mask::Window { left: Some(90), right: Some(3) }, ..Default::default() },
            AttentionParams { documents: Some(Documents::new(vec![70, 100, 130]).unwrap()), ..causal.clone() },
        ] {
            let vis = Visibility::single_device(&params, 300, 300).unwrap();
            let (_, _, q_spans, k_spans) =
                call_spans(&vis, TileConfig { block_q: 256, block_k: 256 }, Arithmetic::F32, Pass::Forward);
            for qs in &q_spans {
                for ks in &k_spans {
                    let kind = classify(&vis, qs, ks);
                    let blocks = row_blocks(&vis, qs, ks, kind);
                    for i in 0..qs.len {
                        for j in 0..ks.len {
                            if vis.visible(qs.start + i, ks.start + j) {
                                let inside = blocks.iter().any(|(r, k)| r.contains(&i) && k.contains(&j));
                                assert!(inside, "{params:?}: pair ({i}, {j}) of tile {qs:?} × {ks:?}");
                            }
                        }
                    }
                    let rows: usize = blocks.iter().map(|(r, _)| r.len()).sum();
                    assert!(rows <= qs.len && blocks.windows(2).all(|w| w[0].0.end <= w[1].0.start));
                }
            }
        }
    }
}
