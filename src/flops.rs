//! The work of a single-device attention call: the (query, key) pairs its mask leaves
//! visible, the FLOPs they cost, and the tiles of a tiled kernel that hold any of them.
//!
//! Conventions (those of `ringattn bench`, its sweeps and `demo`):
//!
//! * **Visible pairs** are counted per (batch element, query head): the mask depends on
//!   positions and documents only, so every head of every batch element sees the same
//!   pairs. A single-device call places query `i` at `pos_q(i) = i + s_k − s_q` and key `j`
//!   at `pos_k(j) = j` (bottom-right aligned); key `j` is visible to query `i` iff
//!   `pos_q(i) − left ≤ pos_k(j) ≤ pos_q(i) + right` (an unbounded side drops its bound) and,
//!   with packed documents, both lie in the same document — the predicate of
//!   [`crate::Mask`] and [`crate::Documents`]. Causal with `s_q = s_k = s` has `s(s+1)/2`.
//! * **FLOPs**: the forward costs `2·(d_qk + d_v)` per visible pair (`q·k` over `d_qk` and
//!   `p·v` over `d_v`, one multiply-add = 2 FLOPs each; `4·d` with equal head dims),
//!   `2·(d_qk + d_v)·b·h_q·pairs` in all; the backward `2·(3·d_qk + 2·d_v)` per pair, with
//!   equal head dims [`BACKWARD_FACTOR`] = 2.5× the forward (five products per pair: `S` recomputed, `dP =
//!   dO·vᵀ`, `dv`, `dq`, `dk`), the flash-attention convention. The softmax's exponentials,
//!   masking and rescaling are not counted. **Dense** FLOPs count all `s_q·s_k` pairs (what a
//!   kernel skipping nothing computes; `4·b·h·s²·d`, the figure other benchmarks halve when
//!   causal).
//! * **Tiles**: a tiled kernel covers the `⌈s_q/block_q⌉ × ⌈s_k/block_k⌉` (query tile, key
//!   tile) grid per (batch element, query head) ([`TileShape`]); the *visible* tiles hold at
//!   least one visible pair, the least a kernel that skips empty tiles must compute.
//! * **Executed FLOPs** ([`executed_flops`]): what an executor's matrix products really
//!   perform — every product it runs over the whole tiles it computes, with the CUDA kernels'
//!   head-dim padding and, where the backward computes `S` and `dP` twice (the dq kernel
//!   beside the dk/dv kernel, or two column ranges: from head-dim class 192), 7 products
//!   where the convention counts 5. `ringattn bench`
//!   prints both; the emulator's count of the kernels' multiply-adds checks this one.
//!
//! Every count is closed-form per query tile or per document (`O(s_q/block_q + documents)`),
//! never `O(s²)`: lengths of millions are counted in microseconds.
//!
//! ```
//! use ringattn::flops::{self, Pass, TileShape};
//! use ringattn::{AttentionParams, Dims, Documents, Mask};
//!
//! let dims = Dims { b: 2, s_q: 4096, s_k: 4096, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 };
//! let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
//! let pairs = flops::visible_pairs(&dims, &causal)?;
//! assert_eq!(pairs, 4096 * 4097 / 2);
//! assert_eq!(flops::flops(&dims, pairs, Pass::Forward), 4.0 * 64.0 * 2.0 * 8.0 * pairs as f64);
//! assert_eq!(flops::flops(&dims, pairs, Pass::Backward), 2.5 * flops::flops(&dims, pairs, Pass::Forward));
//!
//! // A window of 128 keys back (and the query itself), two documents.
//! let window = AttentionParams {
//!     mask: Mask::Window { left: Some(128), right: Some(0) },
//!     documents: Some(Documents::new(vec![1000, 3096])?),
//!     ..Default::default()
//! };
//! assert!(flops::visible_pairs(&dims, &window)? < 4096 * 129);
//!
//! // The CPU's 256 × 256 tiles: 16 × 16, of which the diagonal and the lower triangle.
//! let tiles = flops::tiles(&dims, &causal, TileShape { block_q: 256, block_k: 256 })?;
//! assert_eq!((tiles.total, tiles.visible), (256, 16 * 17 / 2));
//! # Ok::<(), ringattn::Error>(())
//! ```

use crate::cpu::TileConfig;
use crate::kernels::geometry::{self, DqAccum, DqMode};
use crate::{AttentionParams, Dims, Error, Positions, Result, Segment};

/// FLOPs of the forward per visible pair and head-dimension element: `q·k` and `p·v`, 2
/// FLOPs per multiply-add each.
pub const FORWARD_FLOPS_PER_PAIR_DIM: f64 = 4.0;

/// The backward's FLOPs as a multiple of the forward's with equal head dims (the
/// flash-attention convention); [`backward_ratio`] for any pair.
pub const BACKWARD_FACTOR: f64 = 2.5;

/// A pass whose FLOPs are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pass {
    /// `2·(d_qk + d_v)` FLOPs per visible pair (`4·d` with equal head dims).
    #[default]
    Forward,
    /// `2·(3·d_qk + 2·d_v)` FLOPs per visible pair: `S` recomputed, `dP = dO·Vᵀ`, `dV`, `dK`,
    /// `dQ` ([`BACKWARD_FACTOR`] × the forward with equal head dims).
    Backward,
}

impl Pass {
    /// FLOPs of the pass per visible (query, key) pair of one head of `dims`.
    ///
    /// ```
    /// use ringattn::flops::Pass;
    /// use ringattn::Dims;
    /// let mla = Dims { b: 1, s_q: 1, s_k: 1, h_q: 1, h_kv: 1, d_qk: 192, d_v: 128 };
    /// assert_eq!(Pass::Forward.flops_per_pair(&mla), 2.0 * (192.0 + 128.0));
    /// assert_eq!(Pass::Backward.flops_per_pair(&mla), 2.0 * (3.0 * 192.0 + 2.0 * 128.0));
    /// ```
    pub fn flops_per_pair(self, dims: &Dims) -> f64 {
        let (qk, v) = (dims.d_qk as f64, dims.d_v as f64);
        match self {
            Pass::Forward => 2.0 * (qk + v),
            Pass::Backward => 2.0 * (3.0 * qk + 2.0 * v),
        }
    }
}

/// The backward's FLOPs as a multiple of the forward's for the head dims of `dims`:
/// [`BACKWARD_FACTOR`] when `d_qk = d_v`.
pub fn backward_ratio(dims: &Dims) -> f64 {
    Pass::Backward.flops_per_pair(dims) / Pass::Forward.flops_per_pair(dims)
}

/// Visible (query, key) pairs of one (batch element, query head) of a single-device call of
/// `dims` under `params` (positions `pos_q(i) = i + s_k − s_q`, `pos_k(j) = j`); see the
/// [module](self) for the predicate. At most `s_q·s_k`.
///
/// ```
/// use ringattn::{flops::visible_pairs, AttentionParams, Dims, Mask};
/// let dims = |s_q, s_k| Dims { b: 1, s_q, s_k, h_q: 1, h_kv: 1, d_qk: 8, d_v: 8 };
/// let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// assert_eq!(visible_pairs(&dims(4, 4), &causal)?, 10);
/// // Two queries at positions 2 and 3 (bottom-right aligned) see 3 and 4 keys.
/// assert_eq!(visible_pairs(&dims(2, 4), &causal)?, 7);
/// // Windows: 2 back, 1 ahead, clipped at both ends of the sequence.
/// let w = AttentionParams { mask: Mask::Window { left: Some(2), right: Some(1) }, ..Default::default() };
/// assert_eq!(visible_pairs(&dims(5, 5), &w)?, 2 + 3 + 4 + 4 + 3);
/// assert_eq!(visible_pairs(&dims(3, 5), &AttentionParams::default())?, 15);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::Documents`] when the documents do not cover exactly the `s_k` keys, or when
/// `s_q > s_k` puts queries before the first document — the errors of the call itself.
pub fn visible_pairs(dims: &Dims, params: &AttentionParams) -> Result<u64> {
    let band = Band::new(dims, params)?;
    Ok(saturate(band.pairs(0, dims.s_q as i128)))
}

/// Visible (query, key) pairs of the queries at global positions `p` of each of `positions`
/// (every position in `0..s`), in self-attention over a sequence of `s` tokens (keys `0..s`)
/// under `params` — the work of a rank that holds those queries, per (batch element, query
/// head). Closed form per run of consecutive positions: O(segments + documents touched), not
/// per pair.
///
/// ```
/// use ringattn::{flops, AttentionParams, Documents, Mask, Positions};
/// let causal = AttentionParams { mask: Mask::Causal, documents: Some(Documents::new(vec![4, 4])?), ..Default::default() };
/// // Rank 0 holds positions 0..2 and 4..6: 1 + 2 keys in the first document, 1 + 2 in the second.
/// let p = Positions::from_segments(vec![
///     ringattn::Segment { start: 0, stride: 1, len: 2 },
///     ringattn::Segment { start: 4, stride: 1, len: 2 },
/// ])?;
/// assert_eq!(flops::pairs_of_positions(&causal, 8, &[p])?, vec![6]);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::Documents`] when the documents do not cover exactly `s` tokens;
/// [`Error::Positions`] for a position outside `0..s`.
pub fn pairs_of_positions(params: &AttentionParams, s: usize, positions: &[Positions]) -> Result<Vec<u64>> {
    let dims = Dims { b: 1, s_q: s, s_k: s, h_q: 1, h_kv: 1, d_qk: 1, d_v: 1 };
    let band = Band::new(&dims, params)?;
    positions
        .iter()
        .map(|pos| {
            let mut n = 0i128;
            for seg in pos.segments().iter().filter(|g| g.len > 0) {
                let last = seg.start + seg.stride * (seg.len as i64 - 1);
                if seg.start < 0 || last >= s as i64 {
                    return Err(Error::Positions(format!(
                        "positions {}..={last} reach outside a sequence of {s} tokens",
                        seg.start
                    )));
                }
                if seg.stride == 1 {
                    n += band.pairs(i128::from(seg.start), i128::from(last) + 1);
                } else {
                    for p in (0..seg.len as i64).map(|i| i128::from(seg.start + i * seg.stride)) {
                        n += band.pairs(p, p + 1);
                    }
                }
            }
            Ok(saturate(n))
        })
        .collect()
}

/// Visible (query, key) pairs between blocks of one sequence of `s` tokens: entry `[i][j]` counts
/// the pairs of the queries at `positions[i]` with the keys at `positions[j]`, per (batch
/// element, query head) — the work of rank `i` on rank `j`'s K/V block in a ring, the matrix
/// the cost model ([`crate::plan`]) reads per hop. Row sums equal [`pairs_of_positions`] when
/// the blocks cover the sequence once. Closed form per (query run, document, key run) for runs
/// of consecutive positions; a strided key segment is counted per query position (O(1) each).
///
/// ```
/// use ringattn::{flops, AttentionParams, Layout, Mask};
/// let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let pos = Layout::Contiguous.positions_for(&causal, 8, 2)?;
/// // Rank 0 holds 0..4, rank 1 4..8: 10 pairs inside each block, 16 from rank 1 to rank 0's keys.
/// assert_eq!(flops::pair_matrix(&causal, 8, &pos)?, vec![vec![10, 0], vec![16, 10]]);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::Documents`] when the documents do not cover exactly `s` tokens;
/// [`Error::Positions`] for a position outside `0..s`.
pub fn pair_matrix(params: &AttentionParams, s: usize, positions: &[Positions]) -> Result<Vec<Vec<u64>>> {
    let dims = Dims { b: 1, s_q: s, s_k: s, h_q: 1, h_kv: 1, d_qk: 1, d_v: 1 };
    let band = Band::new(&dims, params)?;
    let p = positions.len();
    let blocks: Vec<Vec<Segment>> = positions.iter().map(as_runs).collect();
    // Every block's key runs `(first, last, owner)` (stride 1) and strided segments.
    let mut runs: Vec<(i128, i128, usize)> = Vec::new();
    let mut strided: Vec<(i128, i128, i128, usize)> = Vec::new();
    for (j, segs) in blocks.iter().enumerate() {
        for seg in segs.iter().filter(|g| g.len > 0) {
            let last = seg.start + seg.stride * (seg.len as i64 - 1);
            if seg.start.min(last) < 0 || seg.start.max(last) >= s as i64 {
                return Err(Error::Positions(format!(
                    "positions {}..={last} reach outside a sequence of {s} tokens",
                    seg.start
                )));
            }
            match seg.stride {
                1 => runs.push((i128::from(seg.start), i128::from(last), j)),
                stride => strided.push((i128::from(seg.start), i128::from(stride), seg.len as i128, j)),
            }
        }
    }
    runs.sort_unstable();
    // The largest run end up to each run (runs may overlap): the first run that can reach `lo`.
    let reach: Vec<i128> = runs
        .iter()
        .scan(i128::MIN, |m, r| {
            *m = (*m).max(r.1);
            Some(*m)
        })
        .collect();
    let mut out = vec![vec![0i128; p]; p];
    for (i, segs) in blocks.iter().enumerate() {
        let row = &mut out[i];
        // Queries `q0..=q1` (consecutive positions).
        let mut add = |q0: i128, q1: i128| {
            band.regions(q0, q1, |p0, p1, k0, k1| {
                if p0 > p1 {
                    return;
                }
                let lo = band.left.map_or(k0, |l| k0.max(p0 - l));
                let hi = band.right.map_or(k1, |r| k1.min(p1 + r));
                if lo > hi {
                    return;
                }
                let first = reach.partition_point(|&e| e < lo);
                for &(a, b, j) in runs[first..].iter().take_while(|r| r.0 <= hi) {
                    row[j] += band_pairs(p0, p1, k0.max(a), k1.min(b), band.left, band.right);
                }
                for &(start, stride, len, j) in &strided {
                    for q in p0..=p1 {
                        let a = band.left.map_or(k0, |l| k0.max(q - l));
                        let b = band.right.map_or(k1, |r| k1.min(q + r));
                        row[j] += count_in_progression(start, stride, len, a, b);
                    }
                }
            });
        };
        for seg in segs.iter().filter(|g| g.len > 0) {
            let last = seg.start + seg.stride * (seg.len as i64 - 1);
            if seg.stride == 1 {
                add(i128::from(seg.start), i128::from(last));
            } else {
                for x in (0..seg.len as i64).map(|k| i128::from(seg.start + k * seg.stride)) {
                    add(x, x);
                }
            }
        }
    }
    Ok(out.into_iter().map(|row| row.into_iter().map(saturate).collect()).collect())
}

/// A block's positions as runs of consecutive positions where they form few of them (the
/// counts do not depend on the order a block stores its tokens: a Ulysses group's members
/// interleaved are a few runs together), its own segments otherwise (a striped block).
fn as_runs(pos: &Positions) -> Vec<Segment> {
    let segs = pos.segments();
    if segs.iter().all(|g| g.stride == 1 || g.len <= 1) {
        return segs.to_vec();
    }
    let mut all = pos.to_vec();
    all.sort_unstable();
    let mut runs: Vec<Segment> = Vec::new();
    for x in all {
        match runs.last_mut() {
            Some(g) if g.start + g.len as i64 == x => g.len += 1,
            _ => runs.push(Segment { start: x, stride: 1, len: 1 }),
        }
        if runs.len() > 4 * segs.len() + 16 {
            return segs.to_vec();
        }
    }
    runs
}

/// Terms of `start + k·stride` (`k < len`, `stride ≠ 0`) within `a..=b`.
fn count_in_progression(start: i128, stride: i128, len: i128, a: i128, b: i128) -> i128 {
    if a > b || len <= 0 {
        return 0;
    }
    // Indices k with a ≤ start + k·stride ≤ b, for either sign of the stride.
    let (lo, hi) = if stride > 0 { (a - start, b - start) } else { (start - b, start - a) };
    let st = stride.abs();
    let k0 = if lo <= 0 { 0 } else { (lo + st - 1) / st };
    let k1 = if hi < 0 { -1 } else { (hi / st).min(len - 1) };
    (k1 - k0 + 1).max(0)
}

/// All `s_q·s_k` pairs of one (batch element, query head): what a kernel that skips nothing
/// computes.
pub fn dense_pairs(dims: &Dims) -> u64 {
    (dims.s_q as u64).saturating_mul(dims.s_k as u64)
}

/// FLOPs of `pass` over `pairs` (query, key) pairs per (batch element, query head):
/// [`Pass::flops_per_pair`]` · b·h_q·pairs` (`4·d·b·h_q·pairs` for the forward with equal head
/// dims, [`BACKWARD_FACTOR`] times that for the backward).
pub fn flops(dims: &Dims, pairs: u64, pass: Pass) -> f64 {
    pass.flops_per_pair(dims) * (dims.b * dims.h_q) as f64 * pairs as f64
}

/// The tiles of a tiled kernel: `block_q` query rows × `block_k` key rows each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileShape {
    /// Query rows per tile (at least 1; 0 counts as 1).
    pub block_q: usize,
    /// Key rows per tile (at least 1; 0 counts as 1).
    pub block_k: usize,
}

impl From<TileConfig> for TileShape {
    /// The CPU's tiles ([`TileConfig`], used by its forward and backward alike).
    fn from(t: TileConfig) -> Self {
        TileShape { block_q: t.block_q, block_k: t.block_k }
    }
}

impl TileShape {
    /// The tiles of the CUDA forward kernel for `dims`: 128 query rows (4 warps of 32) × 64
    /// keys at head-dim classes 32, 64 and 128, 64 (4 × 16) × 64 at 96, 64 × 32 above, 128 ×
    /// 32 at the pair (192, 128) (`FwdTraits::kBlockM`, `kBlockN` in `cuda/flash.cuh`;
    /// [`geometry::forward_tile`]).
    pub fn cuda_forward(dims: &Dims) -> TileShape {
        let (block_q, block_k) = geometry::forward_tile(dims);
        TileShape { block_q, block_k }
    }

    /// The tiles of the CUDA backward's dk/dv kernel (which runs in both [`DqMode`]s): 64
    /// keys per block × a streamed query tile of 64, 32 or 16 rows by head-dim class
    /// (`DkDvTraits` in `cuda/flash.cuh`; [`geometry::dkdv`]).
    pub fn cuda_backward(d: usize) -> TileShape {
        let (block_q, block_k) = geometry::dkdv_tile(d);
        TileShape { block_q, block_k }
    }
}

/// Tiles per (batch element, query head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tiles {
    /// Every (query tile, key tile): `⌈s_q/block_q⌉ · ⌈s_k/block_k⌉`.
    pub total: u64,
    /// Those holding at least one visible pair.
    pub visible: u64,
    /// The (query, key) pairs of the visible tiles, visible or not (tiles at the end of a
    /// sequence clipped to it): what a kernel that computes whole tiles computes.
    pub visible_area: u64,
    /// Per query tile, the key tiles from its first to its last visible one (a kernel
    /// whose loop is bounded by them and skips no tile inside runs these).
    pub spanned: u64,
}

/// Per key tile of `shape`, the query tiles from its first to its last visible one, summed
/// over the key tiles (per batch element and query head): what a kernel whose blocks own key
/// tiles and stream the query tiles their keys may see runs (the Hopper backward).
///
/// ```
/// use ringattn::flops::{key_tile_spans, TileShape};
/// use ringattn::{AttentionParams, Dims, Mask};
/// let dims = Dims { b: 1, s_q: 256, s_k: 256, h_q: 1, h_kv: 1, d_qk: 64, d_v: 64 };
/// let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// // Key tile j of 64 is seen by query tiles j ... 3.
/// assert_eq!(key_tile_spans(&dims, &causal, TileShape { block_q: 64, block_k: 64 })?, 4 + 3 + 2 + 1);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// As [`visible_pairs`].
pub fn key_tile_spans(dims: &Dims, params: &AttentionParams, shape: TileShape) -> Result<u64> {
    let band = Band::new(dims, params)?;
    let (bq, bk) = (shape.block_q.max(1), shape.block_k.max(1));
    let q_tiles = dims.s_q.div_ceil(bq);
    // (first, last) query tile seeing each key tile.
    let mut seen: Vec<Option<(usize, usize)>> = vec![None; dims.s_k.div_ceil(bk)];
    for t in 0..q_tiles {
        let r0 = (t * bq) as i128;
        let r1 = ((t + 1) * bq).min(dims.s_q) as i128;
        band.key_spans(r0, r1, |lo, hi| {
            for kt in (lo / bk as i128)..=(hi / bk as i128) {
                let e = &mut seen[kt as usize];
                *e = Some(e.map_or((t, t), |(f, _)| (f, t)));
            }
        });
    }
    Ok(seen.iter().flatten().map(|&(f, l)| (l - f + 1) as u64).sum())
}

/// The (query tile, key tile) pairs of a single-device call of `dims` under `params` in
/// tiles of `shape`, and how many hold a visible pair.
///
/// ```
/// use ringattn::flops::{tiles, TileShape};
/// use ringattn::{AttentionParams, Dims, Mask};
/// let dims = Dims { b: 1, s_q: 256, s_k: 256, h_q: 1, h_kv: 1, d_qk: 64, d_v: 64 };
/// let w = AttentionParams { mask: Mask::Window { left: Some(10), right: Some(0) }, ..Default::default() };
/// let t = tiles(&dims, &w, TileShape { block_q: 64, block_k: 64 })?;
/// // The 4 diagonal tiles and the 3 below them that the first rows of each tile reach back to.
/// assert_eq!((t.total, t.visible), (16, 7));
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// As [`visible_pairs`].
pub fn tiles(dims: &Dims, params: &AttentionParams, shape: TileShape) -> Result<Tiles> {
    let band = Band::new(dims, params)?;
    let (bq, bk) = (shape.block_q.max(1), shape.block_k.max(1));
    let (q_tiles, k_tiles) = (dims.s_q.div_ceil(bq), dims.s_k.div_ceil(bk));
    let (bk, s_k) = (bk as i128, dims.s_k as i128);
    let (mut visible, mut area, mut spanned): (u64, i128, u64) = (0, 0, 0);
    for t in 0..q_tiles {
        let r0 = (t * bq) as i128;
        let r1 = ((t + 1) * bq).min(dims.s_q) as i128;
        // Key spans arrive disjoint and in increasing order; count the key tiles they touch
        // once each.
        let (mut last, mut first_seen): (i128, Option<i128>) = (-1, None);
        band.key_spans(r0, r1, |lo, hi| {
            let (first, end) = ((lo / bk).max(last + 1), hi / bk);
            if end >= first {
                visible += (end - first + 1) as u64;
                // Keys of tiles first..=end, the last one clipped to the sequence.
                area += (r1 - r0) * (((end + 1) * bk).min(s_k) - first * bk);
                first_seen.get_or_insert(first);
                last = end;
            }
        });
        if let Some(f) = first_seen {
            spanned += (last - f + 1) as u64;
        }
    }
    let total = (q_tiles as u64).saturating_mul(k_tiles as u64);
    Ok(Tiles { total, visible, visible_area: saturate(area), spanned })
}

/// What runs a pass, for [`executed_flops`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executor {
    /// The CPU backend with these tiles.
    Cpu(TileConfig),
    /// The CUDA kernels (on a GPU or under the emulator); the backward in this dq mode.
    Kernels(DqMode),
    /// The Hopper family (`flash_fwd_hopper.cu`, `flash_bwd_hopper.cu`); the backward in this
    /// dq mode (the same products either way).
    Hopper(DqMode),
}

/// FLOPs (2 per multiply-add) that `exec`'s matrix products perform for `pass` of a
/// single-device call — the work the hardware does, as opposed to [`flops`]' convention
/// (visible pairs only, 5 products backward):
///
/// * [`Executor::Cpu`]: the forward's 2 products (`S = QKᵀ`, `PV`) and the backward's 5 (`S`,
///   `dP = dO Vᵀ`, `dV`, `dK`, `dQ`), `2·d` FLOPs per pair each, over every pair of the visible
///   CPU tiles (clipped to the sequence). Both paths multiply only the part of a partially
///   visible tile that each block of rows can see (12 rows bf16, 64 rows f32): an upper
///   bound there.
/// * [`Executor::Kernels`]: whole warp tiles of tensor-core products at the head-dim class `D`
///   (`d` rounded up), over every warp tile holding a visible pair (the others are skipped):
///   forward, a warp's query rows ([`geometry::forward_warp_rows`]: 32, 16 at class 96 and above 128
///   but for the pair (192, 128)) × a key tile, `S` and `PV`; dk/dv kernel, a query tile × 16
///   keys, `Sᵀ` and `dPᵀ` whole in each of its column ranges, `dV` and `dK` over all columns
///   once; when it adds dq (atomic mode; deterministic up to class 128) `dQ` once per query
///   tile × 64-key block holding a visible pair (the block's product), else the dq kernel's 16
///   query rows × a key tile, `S`, `dP` and `dQ`. Products with V or dO (`PV`, `dPᵀ`, `dV`,
///   `dP`) at V's class on the pair's kernels ([`geometry::fa2_classes`]), the others at `D`.
///   Tile shapes from [`geometry`].
/// * [`Executor::Hopper`]: the forward by block (128 query rows: both consumer warpgroups)
///   × every key tile ([`geometry::hopper_forward_tile`]) from the block's first to its last
///   visible one, `S` and `PV` at the Hopper class (64, 128, 256); the backward by key block
///   ([`geometry::hopper_backward_block`] keys) × every 64-row query tile from the block's
///   first to its last visible one ([`key_tile_spans`]), five products (`Sᵀ`, `dPᵀ`, `dV`,
///   `dK`, `dQ`; seven at class 256, where both consumer warpgroups compute `Sᵀ` and `dPᵀ`).
///   With documents the kernels bound their loops by the documents' bounds and may run a few
///   more tiles, so these are then lower bounds.
///
/// ```
/// use ringattn::flops::{executed_flops, flops, visible_pairs, Executor, Pass};
/// use ringattn::kernels::geometry::DqMode;
/// use ringattn::{AttentionParams, Dims};
/// let dims = Dims { b: 1, s_q: 256, s_k: 256, h_q: 1, h_kv: 1, d_qk: 64, d_v: 64 };
/// let p = AttentionParams::default();
/// let pairs = visible_pairs(&dims, &p)?;
/// // Unmasked, whole tiles: the forward executes exactly the convention's FLOPs...
/// assert_eq!(executed_flops(&dims, &p, Pass::Forward, Executor::Kernels(DqMode::Deterministic))?, flops(&dims, pairs, Pass::Forward));
/// // ... and so does the backward: five products, S and dP once per pair.
/// let bwd = executed_flops(&dims, &p, Pass::Backward, Executor::Kernels(DqMode::Deterministic))?;
/// assert_eq!(bwd, flops(&dims, pairs, Pass::Backward));
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// As [`visible_pairs`].
pub fn executed_flops(dims: &Dims, params: &AttentionParams, pass: Pass, exec: Executor) -> Result<f64> {
    let heads = (dims.b * dims.h_q) as f64;
    let warp_tiles = |block_q: usize, block_k: usize| -> Result<f64> {
        Ok(tiles(dims, params, TileShape { block_q, block_k })?.visible as f64)
    };
    let macs = match exec {
        Executor::Cpu(t) => {
            // Multiply-adds per pair of the products: the FLOPs' half.
            tiles(dims, params, t.into())?.visible_area as f64 * pass.flops_per_pair(dims) / 2.0
        }
        Executor::Hopper(_) if pass == Pass::Forward => {
            let dc = geometry::hopper_head_dim_class(dims.d_max()) as f64;
            let (m, n) = geometry::hopper_forward_tile(dims.d_max());
            let spanned = tiles(dims, params, TileShape { block_q: m, block_k: n })?.spanned as f64;
            spanned * 2.0 * (m * n) as f64 * dc
        }
        Executor::Hopper(_) => {
            let dc = geometry::hopper_head_dim_class(dims.d_max());
            let n = geometry::hopper_backward_block(dims.d_max());
            let spanned = key_tile_spans(dims, params, TileShape { block_q: 64, block_k: n })? as f64;
            let products = if dc <= 128 { 5.0 } else { 7.0 };
            spanned * products * (64 * n * dc) as f64
        }
        Executor::Kernels(mode) => {
            let dc = geometry::head_dim_class(geometry::fa2_head_dim(dims)) as f64;
            // Products with V or dO at V's class (the pair entry points' own), the others at
            // Q and K's.
            let dvc = match geometry::fa2_classes(dims) {
                (_, geometry::ValueDim::Class(dv)) => dv as f64,
                _ => dc,
            };
            match pass {
                Pass::Forward => {
                    let (_, n) = geometry::forward_tile(dims);
                    let rows = geometry::forward_warp_rows(dims);
                    warp_tiles(rows, n)? * (rows * n) as f64 * (dc + dvc)
                }
                Pass::Backward => {
                    let (m, _) = geometry::dkdv_tile(geometry::fa2_head_dim(dims));
                    let accum = geometry::dkdv_accum(geometry::fa2_head_dim(dims), mode);
                    let splits = geometry::dkdv_splits(dims) as f64;
                    // S^T and dP^T in each column range, dV and dK once.
                    let per_tile = (16 * m) as f64 * (splits + 1.0) * (dc + dvc);
                    let dq = if accum == DqAccum::None {
                        // S, dP and dQ.
                        let (_, n) = geometry::dq_tile(dims);
                        warp_tiles(16, n)? * (16 * n) as f64 * (2.0 * dc + dvc)
                    } else {
                        // dQ by the block: its 64 keys x the query tile, where a warp ran it.
                        warp_tiles(m, 64)? * (m * 64) as f64 * dc
                    };
                    warp_tiles(m, 16)? * per_tile + dq
                }
            }
        }
    };
    Ok(2.0 * macs * heads)
}

/// The visibility of a single-device call in closed form: query row `i` at position `i +
/// off`, keys at `0..s_k`, window sides, document boundaries.
struct Band {
    off: i128,
    s_k: i128,
    left: Option<i128>,
    right: Option<i128>,
    /// Cumulative document ends (one past each document's last position), with documents.
    ends: Option<Vec<i128>>,
}

impl Band {
    /// The band of `dims` under `params`, refusing the documents the call itself refuses
    /// (those of `Visibility::single_device`).
    fn new(dims: &Dims, params: &AttentionParams) -> Result<Band> {
        let ends = match &params.documents {
            None => None,
            Some(docs) => {
                if docs.total_len() != dims.s_k as u64 {
                    return Err(Error::Documents(format!(
                        "lengths {:?} sum to {} but the key sequence has {} tokens",
                        docs.lengths(),
                        docs.total_len(),
                        dims.s_k
                    )));
                }
                if dims.s_q > dims.s_k {
                    return Err(Error::Documents(format!(
                        "query position {} lies outside the documents, which cover 0..{}",
                        dims.s_k as i128 - dims.s_q as i128,
                        dims.s_k
                    )));
                }
                let mut acc = 0i128;
                Some(
                    docs.lengths()
                        .into_iter()
                        .map(|l| {
                            acc += l as i128;
                            acc
                        })
                        .collect(),
                )
            }
        };
        let (left, right) = params.mask.bounds();
        Ok(Band {
            off: dims.s_k as i128 - dims.s_q as i128,
            s_k: dims.s_k as i128,
            left: left.map(i128::from),
            right: right.map(i128::from),
            ends,
        })
    }

    /// Calls `f(p_lo, p_hi, k_lo, k_hi)` for each region of query positions `p_lo..=p_hi`
    /// (within `pa..=pb`) whose keys lie in `k_lo..=k_hi`: one region without documents, one
    /// per document otherwise, in increasing order.
    fn regions(&self, pa: i128, pb: i128, mut f: impl FnMut(i128, i128, i128, i128)) {
        match &self.ends {
            None => f(pa, pb, 0, self.s_k - 1),
            Some(ends) => {
                // The first document ending after `pa`.
                let mut i = ends.partition_point(|&e| e <= pa);
                while i < ends.len() {
                    let start = if i == 0 { 0 } else { ends[i - 1] };
                    if start > pb {
                        break;
                    }
                    let end = ends[i] - 1;
                    if start <= end {
                        f(pa.max(start), pb.min(end), start, end);
                    }
                    i += 1;
                }
            }
        }
    }

    /// Visible pairs of query rows `r0..r1`.
    fn pairs(&self, r0: i128, r1: i128) -> i128 {
        let mut n = 0;
        self.regions(r0 + self.off, r1 - 1 + self.off, |p0, p1, k0, k1| {
            n += band_pairs(p0, p1, k0, k1, self.left, self.right);
        });
        n
    }

    /// Calls `f(lo, hi)` with the keys `lo..=hi` visible to some query of rows `r0..r1`, one
    /// span per region, disjoint and in increasing order. Within a region every query sees
    /// an interval of keys sliding with its position, so the union over the region's queries
    /// `p0..=p1` is one interval: `[p0 − left, p1 + right]` clipped to the region's keys.
    fn key_spans(&self, r0: i128, r1: i128, mut f: impl FnMut(i128, i128)) {
        self.regions(r0 + self.off, r1 - 1 + self.off, |p0, p1, k0, k1| {
            if p0 > p1 {
                return;
            }
            let lo = self.left.map_or(k0, |l| k0.max(p0 - l));
            let hi = self.right.map_or(k1, |r| k1.min(p1 + r));
            if lo <= hi {
                f(lo, hi);
            }
        });
    }
}

/// Pairs `(p, k)` with `p ∈ p0..=p1`, `k ∈ k0..=k1` and `−left ≤ k − p ≤ right` (`None`: that
/// side unbounded); 0 when either range is empty.
fn band_pairs(p0: i128, p1: i128, k0: i128, k1: i128, left: Option<i128>, right: Option<i128>) -> i128 {
    if p1 < p0 || k1 < k0 {
        return 0;
    }
    let n = k1 - k0 + 1;
    // Pairs with k − p ≤ c: for each p, the keys k0..=min(k1, p + c), i.e. clamp(p + c − k0 + 1,
    // 0, n) of them, summed over consecutive p.
    let at_most = |c: i128| sum_clamped(p0 + c - k0 + 1, p1 + c - k0 + 1, n);
    let upper = right.map_or((p1 - p0 + 1) * n, at_most);
    let lower = left.map_or(0, |l| at_most(-l - 1));
    upper - lower
}

/// `Σ_{t = x0..=x1} clamp(t, 0, n)` for `x0 ≤ x1`, `n ≥ 0`, in closed form.
fn sum_clamped(x0: i128, x1: i128, n: i128) -> i128 {
    // prefix(m) = Σ_{t = 0..m} clamp(t, 0, n) for m ≥ 0.
    let prefix = |m: i128| -> i128 {
        let m = m.max(0);
        if m <= n + 1 {
            m * (m - 1) / 2
        } else {
            n * (n + 1) / 2 + (m - n - 1) * n
        }
    };
    prefix(x1 + 1) - prefix(x0)
}

fn saturate(x: i128) -> u64 {
    u64::try_from(x.max(0)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Visibility;
    use crate::{Documents, Mask};
    use proptest::prelude::*;

    fn dims(s_q: usize, s_k: usize) -> Dims {
        Dims { b: 1, s_q, s_k, h_q: 1, h_kv: 1, d_qk: 64, d_v: 64 }
    }

    /// The O(s²) count through the predicate the kernels and the CPU mask with.
    fn brute(s_q: usize, s_k: usize, params: &AttentionParams, shape: TileShape) -> Result<(u64, Tiles)> {
        let vis = Visibility::single_device(params, s_q, s_k)?;
        let (bq, bk) = (shape.block_q.max(1), shape.block_k.max(1));
        let mut pairs = 0;
        let mut tile_seen = vec![vec![false; s_k.div_ceil(bk)]; s_q.div_ceil(bq)];
        let extent = |i: usize, b: usize, s: usize| (s - i * b).min(b) as u64;
        for i in 0..s_q {
            for j in 0..s_k {
                if vis.visible(i, j) {
                    pairs += 1;
                    tile_seen[i / bq][j / bk] = true;
                }
            }
        }
        let total = (s_q.div_ceil(bq) * s_k.div_ceil(bk)) as u64;
        let visible = tile_seen.iter().flatten().filter(|&&x| x).count() as u64;
        let mut visible_area = 0;
        for (ti, row) in tile_seen.iter().enumerate() {
            for (tj, _) in row.iter().enumerate().filter(|(_, &seen)| seen) {
                visible_area += extent(ti, bq, s_q) * extent(tj, bk, s_k);
            }
        }
        let spanned = tile_seen
            .iter()
            .map(|row| match (row.iter().position(|&x| x), row.iter().rposition(|&x| x)) {
                (Some(f), Some(l)) => (l - f + 1) as u64,
                _ => 0,
            })
            .sum();
        Ok((pairs, Tiles { total, visible, visible_area, spanned }))
    }

    fn check(s_q: usize, s_k: usize, params: &AttentionParams, shape: TileShape) {
        let d = dims(s_q, s_k);
        match brute(s_q, s_k, params, shape) {
            Ok((pairs, t)) => {
                assert_eq!(visible_pairs(&d, params).unwrap(), pairs, "pairs: s_q {s_q} s_k {s_k} {params:?}");
                assert_eq!(tiles(&d, params, shape).unwrap(), t, "tiles: s_q {s_q} s_k {s_k} {params:?} {shape:?}");
            }
            Err(e) => {
                let ours = visible_pairs(&d, params).unwrap_err();
                assert_eq!(std::mem::discriminant(&ours), std::mem::discriminant(&e), "{ours} vs {e}");
                assert!(tiles(&d, params, shape).is_err());
            }
        }
    }

    fn window(left: Option<u64>, right: Option<u64>) -> Mask {
        Mask::Window { left, right }
    }

    fn masks() -> Vec<Mask> {
        let mut m = vec![Mask::None, Mask::Causal];
        for l in [None, Some(0), Some(1), Some(3), Some(17)] {
            for r in [None, Some(0), Some(2), Some(5)] {
                m.push(window(l, r));
            }
        }
        m.push(window(Some(u64::MAX), Some(u64::MAX)));
        m
    }

    #[test]
    fn matches_the_brute_force_count_on_small_shapes() {
        let shapes = [TileShape { block_q: 4, block_k: 4 }, TileShape { block_q: 3, block_k: 5 }];
        for (s_q, s_k) in [(0, 0), (0, 5), (5, 0), (1, 1), (7, 7), (16, 16), (5, 13), (13, 5), (1, 20), (20, 1)] {
            for mask in masks() {
                let docs: Vec<Option<Vec<usize>>> = vec![
                    None,
                    Some(vec![s_k]),
                    Some(vec![s_k / 2, s_k - s_k / 2]),
                    Some(vec![0, s_k / 3, 0, s_k - s_k / 3, 0]),
                    Some(vec![1; s_k.max(1)]),
                ];
                for d in docs {
                    let documents = d.map(|l| Documents::new(l).unwrap());
                    let params = AttentionParams { mask, documents, ..Default::default() };
                    for shape in shapes {
                        check(s_q, s_k, &params, shape);
                    }
                }
            }
        }
    }

    #[test]
    fn closed_forms() {
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        for s in [1usize, 2, 100, 4096, 1 << 20] {
            assert_eq!(visible_pairs(&dims(s, s), &causal).unwrap(), (s * (s + 1) / 2) as u64);
            assert_eq!(visible_pairs(&dims(s, s), &AttentionParams::default()).unwrap(), (s * s) as u64);
        }
        // s_q < s_k, causal: query i at i + s_k − s_q sees i + s_k − s_q + 1 keys.
        let (sq, sk) = (1000u64, 3000u64);
        let want: u64 = (0..sq).map(|i| i + sk - sq + 1).sum();
        assert_eq!(visible_pairs(&dims(sq as usize, sk as usize), &causal).unwrap(), want);
        // s_q > s_k, causal: the first s_q − s_k queries see nothing.
        assert_eq!(visible_pairs(&dims(3000, 1000), &causal).unwrap(), 1000 * 1001 / 2);
        // A sliding window of w keys back on a million tokens.
        let (s, w) = (1u64 << 20, 4096u64);
        let sw = AttentionParams { mask: window(Some(w), Some(0)), ..Default::default() };
        let want = w * (w + 1) / 2 + (s - w) * (w + 1);
        assert_eq!(visible_pairs(&dims(s as usize, s as usize), &sw).unwrap(), want);
        // Documents: the sum of each document's causal triangle.
        let docs = AttentionParams { documents: Some(Documents::new(vec![3, 0, 5, 1]).unwrap()), ..causal.clone() };
        assert_eq!(visible_pairs(&dims(9, 9), &docs).unwrap(), 6 + 15 + 1);
        // Dense counts and FLOPs.
        let d = Dims { b: 2, s_q: 10, s_k: 20, h_q: 4, h_kv: 2, d_qk: 32, d_v: 32 };
        assert_eq!(dense_pairs(&d), 200);
        assert_eq!(flops(&d, 100, Pass::Forward), 4.0 * 32.0 * 8.0 * 100.0);
        assert_eq!(flops(&d, 100, Pass::Backward), 2.5 * 4.0 * 32.0 * 8.0 * 100.0);
    }

    #[test]
    fn long_sequences_count_fast() {
        // A million tokens in 256 × 64 tiles and a million one-token documents: O(s / tile +
        // documents), not O(s²).
        let s = 1usize << 20;
        let t = std::time::Instant::now();
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let tl = tiles(&dims(s, s), &causal, TileShape { block_q: 256, block_k: 64 }).unwrap();
        assert_eq!(tl.total, (s / 256 * s / 64) as u64);
        // Query tile t covers keys 0..256(t+1): 4(t+1) key tiles.
        assert_eq!(tl.visible, (1..=(s / 256) as u64).map(|t| 4 * t).sum::<u64>());
        let docs = AttentionParams { documents: Some(Documents::new(vec![1; s]).unwrap()), ..causal };
        assert_eq!(visible_pairs(&dims(s, s), &docs).unwrap(), s as u64);
        assert_eq!(tiles(&dims(s, s), &docs, TileShape { block_q: 64, block_k: 64 }).unwrap().visible, (s / 64) as u64);
        assert!(t.elapsed().as_secs_f64() < 5.0, "{:?}", t.elapsed());
    }

    #[test]
    fn errors_match_the_call() {
        let docs = AttentionParams { documents: Some(Documents::new(vec![3, 4]).unwrap()), ..Default::default() };
        assert!(matches!(visible_pairs(&dims(7, 8), &docs), Err(Error::Documents(_))));
        assert!(matches!(visible_pairs(&dims(8, 7), &docs), Err(Error::Documents(_))));
        assert!(Visibility::single_device(&docs, 8, 7).is_err());
        assert_eq!(visible_pairs(&dims(7, 7), &docs).unwrap(), 9 + 16);
    }

    /// The CUDA tile shapes agree with the launch geometry of `kernels::geometry`: grids, and
    /// the shared memory their rows take (`FwdTraits::kSmem`, `DkDvTraits::kSmem`).
    #[test]
    fn cuda_tiles_match_the_kernel_geometry() {
        let stride = |dc: usize| if dc / 8 <= 8 { dc } else { (dc / 8).div_ceil(8) * 64 };
        for d in (8..=geometry::MAX_HEAD_DIM).step_by(8) {
            let dims = Dims { b: 2, s_q: 1000, s_k: 700, h_q: 4, h_kv: 2, d_qk: d, d_v: d };
            let dc = geometry::head_dim_class(d);
            let row = 2 * stride(dc);
            let f = TileShape::cuda_forward(&dims);
            let l = geometry::forward(&dims);
            assert_eq!(l.grid[0], dims.s_q.div_ceil(f.block_q), "d = {d}");
            // Q, K and V double-buffered, each warp's query bounds (4 x 32 bytes).
            assert_eq!(l.smem_bytes, f.block_q * row + 4 * f.block_k * row + 4 * 32, "d = {d}");
            let b = TileShape::cuda_backward(d);
            for accum in [DqAccum::None, DqAccum::Fixed, DqAccum::F32] {
                let l = geometry::dkdv(&dims, accum);
                let splits = l.grid[0] / dims.s_k.div_ceil(b.block_k);
                assert!(splits == 1 || splits == 2, "d = {d} {accum:?}");
                assert_eq!(l.grid[0], dims.s_k.div_ceil(b.block_k) * splits, "d = {d} {accum:?}");
                // Q and dO, lse and scale delta per query row; with dq also each row's unit,
                // the block's dS^T for its dq product and 4 warp flags.
                let with_dq = accum != DqAccum::None;
                let scalars = if with_dq { 12 } else { 8 };
                let (kv, stage) = (b.block_k * row, 2 * b.block_q * row + scalars * b.block_q);
                let ds = if with_dq { b.block_k * (b.block_q + 8) * 2 + 16 } else { 0 };
                assert!(
                    l.smem_bytes == 2 * kv + stage + ds || l.smem_bytes == 2 * kv + 2 * stage + ds,
                    "d = {d} {accum:?}"
                );
            }
        }
        let cpu = TileShape::from(TileConfig::default().resolved(crate::cpu::Arithmetic::F32, Pass::Backward));
        assert_eq!((cpu.block_q, cpu.block_k), (256, 256));
    }

    fn arb_mask() -> impl Strategy<Value = Mask> {
        let side = prop_oneof![Just(None), (0u64..12).prop_map(Some)];
        prop_oneof![Just(Mask::None), Just(Mask::Causal), (side.clone(), side).prop_map(|(l, r)| window(l, r))]
    }

    /// Blocks of a shuffled sequence: consecutive runs, some of them strided.
    fn arb_blocks(s: usize, seed: u64, blocks: usize) -> Vec<Positions> {
        use rand::{seq::SliceRandom, SeedableRng};
        let mut order: Vec<usize> = (0..s).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let mut out: Vec<Vec<i64>> = vec![Vec::new(); blocks];
        for (k, &x) in order.iter().enumerate() {
            out[k % blocks].push(x as i64);
        }
        out.into_iter()
            .map(|mut v| {
                v.sort_unstable();
                let mut segs: Vec<crate::Segment> = Vec::new();
                for x in v {
                    match segs.last_mut() {
                        Some(g) if g.len == 1 && x - g.start <= 3 => {
                            g.stride = x - g.start;
                            g.len = 2;
                        }
                        Some(g) if g.start + g.stride * g.len as i64 == x => g.len += 1,
                        _ => segs.push(crate::Segment { start: x, stride: 1, len: 1 }),
                    }
                }
                Positions::from_segments(segs).unwrap()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn any_mask_documents_and_tiles(
            s_q in 0usize..40,
            s_k in 0usize..40,
            mask in arb_mask(),
            cuts in proptest::collection::vec(0usize..40, 0..5),
            use_docs in any::<bool>(),
            bq in 1usize..9,
            bk in 1usize..9,
        ) {
            let documents = use_docs.then(|| {
                let mut c: Vec<usize> = cuts.iter().map(|&x| x % (s_k + 1)).collect();
                c.push(0);
                c.push(s_k);
                c.sort_unstable();
                Documents::new(c.windows(2).map(|w| w[1] - w[0]).collect()).unwrap()
            });
            let params = AttentionParams { mask, documents, ..Default::default() };
            check(s_q, s_k, &params, TileShape { block_q: bq, block_k: bk });
        }

        #[test]
        fn pair_matrix_counts_every_pair_once(
            s in 1usize..48,
            mask in arb_mask(),
            cuts in proptest::collection::vec(0usize..48, 0..5),
            use_docs in any::<bool>(),
            blocks in 1usize..5,
            seed in any::<u64>(),
        ) {
            let documents = use_docs.then(|| {
                let mut c: Vec<usize> = cuts.iter().map(|&x| x % (s + 1)).collect();
                c.push(0);
                c.push(s);
                c.sort_unstable();
                Documents::new(c.windows(2).map(|w| w[1] - w[0]).collect()).unwrap()
            });
            let params = AttentionParams { mask, documents, ..Default::default() };
            let pos = arb_blocks(s, seed, blocks);
            let vis = Visibility::single_device(&params, s, s).unwrap();
            let m = pair_matrix(&params, s, &pos).unwrap();
            for (i, qi) in pos.iter().enumerate() {
                for (j, kj) in pos.iter().enumerate() {
                    let brute = qi.iter().map(|q| kj.iter().filter(|&k| vis.visible(q as usize, k as usize)).count() as u64).sum::<u64>();
                    prop_assert_eq!(m[i][j], brute, "block {} on {}: {:?} {:?}", i, j, qi, kj);
                }
            }
            let rows: Vec<u64> = m.iter().map(|r| r.iter().sum()).collect();
            prop_assert_eq!(rows, pairs_of_positions(&params, s, &pos).unwrap());
        }
    }
}
