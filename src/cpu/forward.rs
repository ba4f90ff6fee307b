//! Tiled flash-attention forward: the task driver every path shares ([`drive`]), the packed
//! K and V of the AVX-512 paths ([`PackedKeys`]) and the f32 path's portable tile work
//! ([`forward_portable`], products through `gemm`; [`super::forward_f32`] runs instead
//! where the processor has AVX512F).
//!
//! One task per (batch, query head, query tile), run by rayon. Each task keeps the running
//! row maximum `m` (in log2 units), row sum `l` and unnormalised output `acc` of its tile
//! and visits the key tiles of its kv head: `S = (scale·log2 e)·Q Kᵀ` by GEMM, the mask on
//! partial tiles, `P = 2^(S − m_new)`, rescale by `2^(m_old − m_new)`, `acc += P V` by GEMM.
//! Skipped tiles are never touched. Memory: the outputs plus `block_q × (block_k + d)` per task.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::aligned::Lines;
use super::matmul::{matmul_strided, View};
use super::products::{self as mm, Packing};
use super::simd;
use super::tiles::{call_spans, row_blocks, rows_finite, DisjointWriter, Output, PerThread, TileConfig};
use crate::attention::{classify, Span, TileKind};
use crate::flops::Pass;
use crate::params::Visibility;
use crate::Dims;

/// A forward call's inputs, `q`, `k`, `v` in the element type of its path (f32 here, bf16
/// for [`super::forward_bf16`]).
pub(crate) struct ForwardInputs<'a, T = f32> {
    pub dims: Dims,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub vis: &'a Visibility,
    pub spec: crate::attention::ScoreSpec,
    pub tiles: TileConfig,
    /// Incremented by the number of query rows finished per (row, head).
    pub progress: Option<&'a AtomicU64>,
}

/// Returns `(o [b, s_q, h_q, d_v], lse [b, h_q, s_q])` in f32: on AVX512F through the crate's
/// own products ([`super::forward_f32`]), elsewhere through `gemm` ([`forward_portable`]).
pub(crate) fn forward(x: &ForwardInputs) -> (Vec<f32>, Vec<f32>) {
    if <f32 as mm::Element>::available() {
        super::forward_f32::forward(x)
    } else {
        forward_portable(x)
    }
}

/// The f32 forward through the `gemm` crate's products: any processor.
pub(crate) fn forward_portable(x: &ForwardInputs) -> (Vec<f32>, Vec<f32>) {
    let dm = x.dims;
    let (bq, bk, q_spans, k_spans) = call_spans(x.vis, x.tiles, super::Arithmetic::F32, Pass::Forward);
    drive(dm, &q_spans, x.progress, || Scratch::new(x, &k_spans, bq, bk))
}

/// The work of one query tile, as [`drive`] runs it.
pub(crate) trait QueryTileWork {
    /// Computes the (unnormalised) output of query tile `qs` of head `h` in batch `b`.
    fn run(&mut self, b: usize, h: usize, qs: &Span);
    /// Normalises the tile's rows, writes their LSE into `lse` and returns the output rows
    /// (`[rows][rs]`, the first `d_v` columns meaningful) with their stride `rs`.
    fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize);
}

/// Runs one task per (batch, query head, query tile) on rayon's pool, each with a worker
/// from `init` (one per thread per call, reused), and gathers `(o [b, s_q, h_q, d_v], lse [b,
/// h_q, s_q])`, `o` in the output element `O`.
pub(crate) fn drive<W: QueryTileWork + Send, O: Output>(
    dm: Dims,
    q_spans: &[Span],
    progress: Option<&AtomicU64>,
    init: impl Fn() -> W + Sync + Send,
) -> (Vec<O>, Vec<f32>) {
    let mut out = Outputs::new(dm);
    drive_into(&mut out, dm, q_spans, 0..dm.b * dm.h_q, progress, init);
    (out.o, out.lse)
}

/// A forward's outputs, `o [b, s_q, h_q, d_v]` in `O` and `lse [b, h_q, s_q]`, filled by
/// [`drive_into`] one group of heads at a time (rows no task writes: `o = 0`, `lse = -inf`).
pub(crate) struct Outputs<O> {
    pub o: Vec<O>,
    pub lse: Vec<f32>,
}

impl<O: Output> Outputs<O> {
    pub(crate) fn new(dm: Dims) -> Self {
        Outputs {
            o: O::zeroed(dm.b * dm.s_q * dm.h_q * dm.d_v),
            lse: super::reuse::filled(dm.b * dm.h_q * dm.s_q, f32::NEG_INFINITY),
        }
    }
}

/// As [`drive`], for the (batch, query head) pairs `heads` (flattened `b · h_q + h`) into
/// `out`.
pub(crate) fn drive_into<W: QueryTileWork + Send, O: Output>(
    out: &mut Outputs<O>,
    dm: Dims,
    q_spans: &[Span],
    heads: Range<usize>,
    progress: Option<&AtomicU64>,
    init: impl Fn() -> W + Sync + Send,
) {
    let d = dm.d_v;
    if q_spans.is_empty() || out.o.is_empty() {
        return;
    }
    let o_out = DisjointWriter::new(&mut out.o);
    let lse_out = DisjointWriter::new(&mut out.lse);
    let n_tasks = heads.len() * q_spans.len();
    let workers = PerThread::new();
    (0..n_tasks).into_par_iter().for_each(|t| {
        workers.with(&init, |w| {
            let qt = t % q_spans.len();
            let bh = heads.start + t / q_spans.len();
            let (b, h) = (bh / dm.h_q, bh % dm.h_q);
            let qs = q_spans[qt];
            w.run(b, h, &qs);
            // SAFETY: task (b, h, qt) alone writes the range (b, h, qs.start..) of `lse` and
            // rows (b, qs.start.., h) of `o`.
            let lse_rows = unsafe { lse_out.range((b * dm.h_q + h) * dm.s_q + qs.start, qs.len) };
            let (rows, rs) = w.finish(lse_rows);
            for i in 0..qs.len {
                let at = ((b * dm.s_q + qs.start + i) * dm.h_q + h) * d;
                // SAFETY: as above.
                O::store(unsafe { o_out.range(at, d) }, &rows[i * rs..i * rs + d], 1.0);
            }
            if let Some(p) = progress {
                p.fetch_add(qs.len as u64, Ordering::Relaxed);
            }
        })
    });
}

/// The online-softmax state of one query tile of the AVX-512 forwards (f32 and bf16), per
/// query row `i < rows`: the running max `m[i]` of the scores (log2 units), the running sum
/// `l[i]` of `2^(s − m)`, the last rescale factor `alpha[i]`, and the unnormalised output,
/// row `i` at `acc[i · rs..][..d_v]`. Sized once per worker for `bq` rows.
pub(crate) struct RowState {
    /// Rows of the current query tile.
    pub rows: usize,
    /// Row stride of `acc` (the head size rounded up to 16 lanes).
    pub rs: usize,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub alpha: Vec<f32>,
    /// On whole cache lines: the AMX tiles accumulate `P·V` into it in place.
    pub acc: Lines<f32>,
}

impl RowState {
    pub fn new(bq: usize, rs: usize) -> Self {
        let acc = Lines::zeroed(bq * rs);
        RowState { rows: 0, rs, m: vec![0.0; bq], l: vec![0.0; bq], alpha: vec![0.0; bq], acc }
    }

    /// Starts a query tile of `rows` rows: no key seen (`m = -inf`, `l = 0`, `acc = 0`).
    pub fn start(&mut self, rows: usize) {
        self.rows = rows;
        self.m[..rows].fill(f32::NEG_INFINITY);
        self.l[..rows].fill(0.0);
        self.acc[..rows * self.rs].fill(0.0);
    }

    /// Row `i` after a key tile whose largest score is `t_max`: the running max becomes
    /// `max(m, t_max)` (NaN when either is), `alpha = 2^(m_old − m_new)`, `l` is rescaled by
    /// it; returns what to subtract from the tile's scores before `exp2` (`+inf` while the
    /// row has seen nothing visible, so that every entry becomes 0).
    pub fn advance(&mut self, i: usize, t_max: f32) -> f32 {
        let m_old = self.m[i];
        let m_new = if t_max.is_nan() || m_old.is_nan() { f32::NAN } else { m_old.max(t_max) };
        let (sub, alpha) =
            if m_new == f32::NEG_INFINITY { (f32::INFINITY, 1.0) } else { (m_new, (m_old - m_new).exp2()) };
        self.m[i] = m_new;
        self.alpha[i] = alpha;
        self.l[i] *= alpha;
        sub
    }

    /// Whether every row has a finite running max (the lazy paths' precondition).
    pub fn all_finite(&self) -> bool {
        self.m[..self.rows].iter().all(|m| m.is_finite())
    }

    /// The end of the query tile: each row of `acc` divided by its sum and its LSE
    /// `(m + log2 l) · ln 2` written to `lse[i]`, a row that saw no key (`m = -inf` or
    /// `l = 0`) giving `o = 0` and `lse = -inf`. Returns the rows and their stride.
    pub fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize) {
        let (rows, rs) = (self.rows, self.rs);
        let acc = &mut self.acc[..rows * rs];
        for (((&m, &l), lse), acc) in self.m.iter().zip(&self.l).zip(lse.iter_mut()).zip(acc.chunks_mut(rs)) {
            let inv = if m == f32::NEG_INFINITY || l == 0.0 {
                *lse = f32::NEG_INFINITY;
                0.0
            } else {
                *lse = (m + l.log2()) * std::f32::consts::LN_2;
                1.0 / l
            };
            simd::scale(acc, inv);
        }
        (acc, rs)
    }
}

/// The most bytes of packed K and V a forward holds at once: the (batch, kv head) pairs are
/// packed and run in groups under it (one pair at least), which bounds the packed copies
/// (and the buffers each calling thread keeps for its next call) at long sequences.
pub(crate) const PACKED_BUDGET: usize = 64 << 20;

/// Runs a forward over groups of (batch, kv head) pairs under `budget` bytes of packed K and
/// V ([`PACKED_BUDGET`] but in tests): each group's
/// K and V packed ([`PackedKeys`]), then `run(out, keys, heads)` for its (batch, query head)
/// pairs `heads` (flattened `b · h_q + h`: [`drive_into`]'s argument); returns `(o, lse)`
/// as [`drive`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn drive_packed<T: Packing, O: Output>(
    dm: Dims,
    k: &[T::Src],
    v: &[T::Src],
    k_spans: &[Span],
    bk: usize,
    budget: usize,
    run: impl FnMut(&mut Outputs<O>, &PackedKeys<T>, Range<usize>),
) -> (Vec<O>, Vec<f32>) {
    let per_pair = PackedKeys::<T>::words(dm, k_spans.len(), bk) * 4;
    let pack = |g: Range<usize>| Some(PackedKeys::<T>::new(dm, k, v, k_spans, bk, g));
    drive_groups(dm, per_pair, budget, pack, run).expect("a whole packing packs")
}

/// [`drive_packed`] with the packing given: `pack(pairs)` packs K and V of the (batch, kv
/// head) pairs `pairs`, `per_pair` bytes each; `None` (nothing returned) as soon as one
/// packing is `None`.
pub(crate) fn drive_groups<T, O: Output>(
    dm: Dims,
    per_pair: usize,
    budget: usize,
    mut pack: impl FnMut(Range<usize>) -> Option<PackedKeys<T>>,
    mut run: impl FnMut(&mut Outputs<O>, &PackedKeys<T>, Range<usize>),
) -> Option<(Vec<O>, Vec<f32>)> {
    let mut out = Outputs::new(dm);
    let pairs = dm.b * dm.h_kv;
    let group = (budget / per_pair.max(1)).clamp(1, pairs.max(1));
    for g0 in (0..pairs).step_by(group) {
        let g = g0..(g0 + group).min(pairs);
        let keys = pack(g.clone())?;
        run(&mut out, &keys, g.start * dm.group()..g.end * dm.group());
    }
    Some((out.o, out.lse))
}

/// K and V of the key tiles of a group of (batch, kv head) pairs, packed as the B operands of
/// `Q·Kᵀ` (rows as lanes, columns as steps) and `P·V` (rows as steps, columns as lanes) of
/// [`super::products`], in bf16 pairs (`u32`) or f32.
///
/// The two buffers come from, and return to, the buffers the calling thread keeps
/// ([`super::reuse`]): a call's packing then writes memory the previous call already
/// touched instead of fresh pages, whose first-touch faults cost as much as the packing
/// itself (a tenth of a causal s = 4096 forward on this project's VM).
pub(crate) struct PackedKeys<T> {
    /// `[b][h_kv][tile]` blocks of `k_len`, `[b][h_kv][tile]` blocks of `v_len`, in `u32`
    /// words (the elements' bits).
    k: Lines<u32>,
    k_len: usize,
    v: Lines<u32>,
    v_len: usize,
    tiles: usize,
    /// The first (batch, kv head) pair packed (`b · h_kv + hk`).
    first: usize,
    /// Per block: whether its K and V rows are all finite (true without a check where the
    /// path's inputs are finite: [`Packing::FINITE_INPUTS`]).
    finite: Vec<bool>,
    /// 16-lane vectors per step of K (`S`'s row length / 16) and of V.
    pub key_vectors: usize,
    pub value_vectors: usize,
    _element: std::marker::PhantomData<T>,
}

impl<T> Drop for PackedKeys<T> {
    fn drop(&mut self) {
        super::reuse::keep(std::mem::take(&mut self.k));
        super::reuse::keep(std::mem::take(&mut self.v));
    }
}

impl<T: Packing> PackedKeys<T> {
    /// Lengths of one key tile's packed K and V blocks, in elements.
    fn block_lens(dm: Dims, bk: usize) -> (usize, usize) {
        let (key_vectors, value_vectors) = (mm::odd(mm::vectors(bk)), mm::odd(mm::vectors(dm.d_v)));
        (mm::steps::<T>(dm.d_qk) * key_vectors * 16, mm::steps::<T>(bk) * value_vectors * 16)
    }

    /// Elements (4-byte words) of one (batch, kv head) pair's packed K and V.
    pub(crate) fn words(dm: Dims, tiles: usize, bk: usize) -> usize {
        let (k_len, v_len) = Self::block_lens(dm, bk);
        tiles * (k_len + v_len)
    }

    /// Packs the key tiles of the (batch, kv head) pairs `pairs` (flattened `b · h_kv + hk`).
    pub(crate) fn new(dm: Dims, k: &[T::Src], v: &[T::Src], k_spans: &[Span], bk: usize, pairs: Range<usize>) -> Self {
        let (d_qk, d_v) = (dm.d_qk, dm.d_v);
        let (key_vectors, value_vectors) = (mm::odd(mm::vectors(bk)), mm::odd(mm::vectors(d_v)));
        let (k_len, v_len) = Self::block_lens(dm, bk);
        let tiles = k_spans.len();
        let blocks = pairs.len() * tiles;
        // Every word a product reads is written by the packing first.
        let mut pk: Lines<u32> = super::reuse::take(blocks * k_len);
        let mut pv: Lines<u32> = super::reuse::take(blocks * v_len);
        let (k_rs, v_rs) = (dm.h_kv * d_qk, dm.h_kv * d_v);
        // The tile of block `blk` and the offsets of its (batch, kv head) pair's first K and V rows.
        let at = |blk: usize| {
            let (bh, t) = (pairs.start + blk / tiles, blk % tiles);
            let (b, hk) = (bh / dm.h_kv, bh % dm.h_kv);
            let row = b * dm.s_k * dm.h_kv + hk;
            (&k_spans[t], row * d_qk, row * d_v)
        };
        let mut finite = vec![true; blocks];
        if blocks > 0 {
            let pk: &mut [T] = bytemuck::cast_slice_mut(&mut pk);
            let pv: &mut [T] = bytemuck::cast_slice_mut(&mut pv);
            let blocks = pk.par_chunks_mut(k_len).zip(pv.par_chunks_mut(v_len)).zip(finite.par_iter_mut());
            blocks.enumerate().for_each(|(blk, ((dk, dv), fin))| {
                let (ks, k_at, v_at) = at(blk);
                let (k, v) = (&k[k_at + ks.start * k_rs..], &v[v_at + ks.start * v_rs..]);
                T::rows_as_lanes(k, ks.len, k_rs, d_qk, key_vectors, dk);
                T::rows_as_steps(v, ks.len, v_rs, d_v, value_vectors, dv);
                *fin =
                    T::FINITE_INPUTS || (T::rows_finite(k, ks.len, k_rs, d_qk) && T::rows_finite(v, ks.len, v_rs, d_v));
            });
        }
        let _element = std::marker::PhantomData;
        PackedKeys {
            k: pk,
            k_len,
            v: pv,
            v_len,
            tiles,
            first: pairs.start,
            finite,
            key_vectors,
            value_vectors,
            _element,
        }
    }

    /// The block of key tile `t` of kv head `hk` in batch `b` (a pair this packing holds).
    fn block(&self, dm: &Dims, b: usize, hk: usize, t: usize) -> usize {
        (b * dm.h_kv + hk - self.first) * self.tiles + t
    }

    /// Packed K and V of key tile `t` of kv head `hk` in batch `b`.
    pub(crate) fn tile(&self, dm: &Dims, b: usize, hk: usize, t: usize) -> (&[T], &[T]) {
        let blk = self.block(dm, b, hk, t);
        let (k, v): (&[T], &[T]) = (bytemuck::cast_slice(&self.k), bytemuck::cast_slice(&self.v));
        (&k[blk * self.k_len..][..self.k_len], &v[blk * self.v_len..][..self.v_len])
    }

    /// Whether K and V of key tile `t` of kv head `hk` in batch `b` are all finite.
    pub(crate) fn finite(&self, dm: &Dims, b: usize, hk: usize, t: usize) -> bool {
        self.finite[self.block(dm, b, hk, t)]
    }
}

/// Pair steps of each part of a split row of `n` values ([`PackedKeys::split`]): whole steps
/// of the tiles (16 pairs, 32 values).
pub(crate) fn split_pairs(n: usize) -> usize {
    16 * n.div_ceil(32)
}

impl PackedKeys<u32> {
    /// The key tiles of the (batch, kv head) pairs `pairs` packed from f32 `k` and `v` (shape
    /// `dm`) split into three bf16 parts each ([`super::split`]), for the f32 forward on the
    /// tiles ([`super::amx_products::Depth::split`]): K's rows as lanes over three parts of
    /// [`split_pairs`]`(d_qk)` steps (`[k0 | k1 | k2]`, each zero-padded), V's rows as steps,
    /// each key tile of `bc` keys in three parts of [`split_pairs`]`(bc)` steps (`[v0; v1; v2]`,
    /// zero steps after the keys). `None` when a value cannot be split (not finite, or past
    /// bf16's range). [`PackedKeys::tile`] then gives the split blocks.
    pub(crate) fn split(
        dm: Dims,
        k: &[f32],
        v: &[f32],
        k_spans: &[Span],
        bk: usize,
        pairs: Range<usize>,
    ) -> Option<Self> {
        let (d_qk, d_v) = (dm.d_qk, dm.d_v);
        let (key_vectors, value_vectors) = (mm::odd(mm::vectors(bk)), mm::odd(mm::vectors(d_v)));
        let (k_len, v_len) = Self::split_lens(dm, bk);
        let (k_part, tiles) = (2 * split_pairs(d_qk), k_spans.len());
        let blocks = pairs.len() * tiles;
        let mut pk: Lines<u32> = super::reuse::take(blocks * k_len);
        let mut pv: Lines<u32> = super::reuse::take(blocks * v_len);
        let (k_rs, v_rs) = (dm.h_kv * d_qk, dm.h_kv * d_v);
        let packs = pk.par_chunks_mut(k_len.max(1)).zip(pv.par_chunks_mut(v_len.max(1))).enumerate();
        // (Each task's scratch for a tile's split rows: `bk` rows of three parts.)
        let scratch = || vec![half::bf16::ZERO; bk * 3 * k_part.max(d_v)];
        let fine = packs
            .map_init(scratch, |parts, (blk, (dk, dv))| {
                let (bh, t) = (pairs.start + blk / tiles, blk % tiles);
                let ks = &k_spans[t];
                let row = (bh / dm.h_kv) * dm.s_k * dm.h_kv + bh % dm.h_kv + ks.start * dm.h_kv;
                // The tile's rows split into bf16 parts side by side, then packed as bf16 rows.
                let mut fine = super::split::split_rows(&k[row * d_qk..], ks.len, k_rs, d_qk, k_part, parts);
                u32::rows_as_lanes(parts, ks.len, 3 * k_part, 3 * k_part, key_vectors, dk);
                fine &= super::split::split_rows(&v[row * d_v..], ks.len, v_rs, d_v, d_v, parts);
                let (steps, lanes) = (split_pairs(ks.len), value_vectors * 16);
                for (j, dst) in dv.chunks_exact_mut(steps * lanes).take(3).enumerate() {
                    let (rows, zeros) = dst.split_at_mut(mm::pairs(ks.len) * lanes);
                    u32::rows_as_steps(&parts[j * d_v..], ks.len, 3 * d_v, d_v, value_vectors, rows);
                    zeros.fill(0);
                }
                fine
            })
            .all(|fine| fine);
        if !fine {
            super::reuse::keep(pk);
            super::reuse::keep(pv);
            return None;
        }
        Some(PackedKeys {
            k: pk,
            k_len,
            v: pv,
            v_len,
            tiles,
            first: pairs.start,
            finite: vec![true; blocks],
            key_vectors,
            value_vectors,
            _element: std::marker::PhantomData,
        })
    }

    /// Lengths of one key tile's split K and V blocks ([`PackedKeys::split`]), in words.
    fn split_lens(dm: Dims, bk: usize) -> (usize, usize) {
        let (key_vectors, value_vectors) = (mm::odd(mm::vectors(bk)), mm::odd(mm::vectors(dm.d_v)));
        (3 * split_pairs(dm.d_qk) * key_vectors * 16, 3 * split_pairs(bk) * value_vectors * 16)
    }

    /// Bytes of one (batch, kv head) pair's split K and V ([`PackedKeys::split`]).
    pub(crate) fn split_bytes(dm: Dims, tiles: usize, bk: usize) -> usize {
        let (k_len, v_len) = Self::split_lens(dm, bk);
        tiles * (k_len + v_len) * 4
    }
}

/// Per-task state and scratch, reused across tasks on one thread. Tiles are kept
/// column-major (query index fastest), the layout the `gemm` microkernels consume without
/// packing; every softmax step is then a contiguous loop over the tile's queries.
struct Scratch<'a> {
    x: &'a ForwardInputs<'a>,
    k_spans: &'a [Span],
    rows: usize,
    /// Running max (log2 units), running sum, per query row.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Per-tile temporaries: tile max, subtrahend, rescale factor, tile sum.
    tile_max: Vec<f32>,
    sub: Vec<f32>,
    alpha: Vec<f32>,
    tile_sum: Vec<f32>,
    /// Unnormalised output, `[block_q][d_v]` (row-major: the P·V product computes its
    /// transpose, packing V's rows by vector copies rather than P once per key tile).
    acc: Vec<f32>,
    /// The query tile, transposed: `[d_qk][block_q]`.
    qt: Vec<f32>,
    /// Scores, then probabilities, transposed: `[block_k][block_q]`.
    st: Vec<f32>,
}

impl<'a> Scratch<'a> {
    fn new(x: &'a ForwardInputs<'a>, k_spans: &'a [Span], bq: usize, bk: usize) -> Self {
        let (d_qk, d_v) = (x.dims.d_qk, x.dims.d_v);
        Scratch {
            x,
            k_spans,
            rows: 0,
            m: vec![0.0; bq],
            l: vec![0.0; bq],
            tile_max: vec![0.0; bq],
            sub: vec![0.0; bq],
            alpha: vec![0.0; bq],
            tile_sum: vec![0.0; bq],
            acc: vec![0.0; bq * d_v],
            qt: vec![0.0; bq * d_qk],
            st: vec![0.0; bq * bk],
        }
    }
}

/// How far (log2 units) a tile's scores may exceed a row's running max before the lazy
/// rescaling of [`Scratch::run`] takes the exact path: P ≤ 2^8, far from f32's range.
pub(crate) const LAZY_GROWTH: f32 = 8.0;

/// `acc += P V` for key tile `ks` (P in `st`, V's rows of the kv head from `v_base`),
/// restricted to the tile's `blocks`; on a partial tile with non-finite inputs (`exact`),
/// element by element over the visible pairs.
#[allow(clippy::too_many_arguments)]
fn pv(
    x: &ForwardInputs,
    v_base: &[f32],
    st: &[f32],
    acc: &mut [f32],
    qs: &Span,
    ks: &Span,
    blocks: &[(Range<usize>, Range<usize>)],
    exact: bool,
) {
    let br = qs.len;
    let (d, kv_rs) = (x.dims.d_v, x.dims.h_kv * x.dims.d_v);
    let st = &st[..br * ks.len];
    if exact {
        for j in 0..ks.len {
            let vj = &v_base[(ks.start + j) * kv_rs..][..d];
            for i in 0..br {
                if x.vis.visible(qs.start + i, ks.start + j) {
                    let p = st[j * br + i];
                    for (cc, &vv) in vj.iter().enumerate() {
                        acc[i * d + cc] += p * vv;
                    }
                }
            }
        }
        return;
    }
    for (rows, keys) in blocks {
        let p = View { data: st, rows: br, cols: ks.len, rs: 1, cs: br }.block_of(rows.clone(), keys.clone());
        let v_rows = View::rows(v_base, ks.start + keys.start, keys.len(), d, kv_rs);
        matmul_strided(&mut acc[rows.start * d..br * d], d, 1, p, v_rows, 1.0, true);
    }
}

impl QueryTileWork for Scratch<'_> {
    fn run(&mut self, b: usize, h: usize, qs: &Span) {
        let (x, k_spans) = (self.x, self.k_spans);
        let dm = x.dims;
        let (d, d_v) = (dm.d_qk, dm.d_v);
        let hk = dm.kv_head(h);
        let (br, q_rs, kv_rs, v_rs) = (qs.len, dm.h_q * d, dm.h_kv * d, dm.h_kv * d_v);
        self.rows = br;
        self.m[..br].fill(f32::NEG_INFINITY);
        self.l[..br].fill(0.0);
        self.acc[..br * d_v].fill(0.0);
        let sc = super::score::Scores::of(&x.spec);
        let q_base = &x.q[(b * dm.s_q * dm.h_q + h) * d..];
        let k_base = &x.k[(b * dm.s_k * dm.h_kv + hk) * d..];
        let v_base = &x.v[(b * dm.s_k * dm.h_kv + hk) * d_v..];
        simd::transpose(&q_base[qs.start * q_rs..], q_rs, &mut self.qt[..br * d], br, br, d);
        let q_tile = View { data: &self.qt[..br * d], rows: br, cols: d, rs: 1, cs: br };
        let mut q_finite: Option<bool> = None;
        for ks in k_spans {
            let kind = classify(x.vis, qs, ks);
            if kind == TileKind::Skip {
                continue;
            }
            let bc = ks.len;
            let st = &mut self.st[..br * bc];
            // On a partial tile each block of query rows computes only the keys it may see
            // (the rest of its rows is masked below: every pair outside its reach is invisible).
            let blocks = row_blocks(x.vis, qs, ks, kind);
            // S (br × bc), column-major: st[j * br + i], masked.
            let scores = |st: &mut [f32]| {
                for (rows, keys) in &blocks {
                    let q_rows = q_tile.rows_of(rows.clone());
                    let k_rows = View::rows(k_base, ks.start + keys.start, keys.len(), d, kv_rs);
                    matmul_strided(
                        &mut st[keys.start * br + rows.start..],
                        1,
                        br,
                        q_rows,
                        k_rows.t(),
                        sc.factor(),
                        false,
                    );
                }
                // The score options before the mask (entries outside a block's reach are
                // masked below whatever they hold).
                sc.finish_row(st);
                if kind == TileKind::Partial {
                    for j in 0..bc {
                        x.vis.mask_key_column(&mut st[j * br..(j + 1) * br], qs.start, ks.start + j);
                    }
                }
            };
            scores(st);
            let mut exact_pv = false;
            if kind == TileKind::Partial {
                // Masked entries must not leak NaN/Inf through 0 · NaN in the P·V product.
                let qf = *q_finite.get_or_insert_with(|| rows_finite(q_base, qs.start, br, d, q_rs));
                exact_pv = !(qf
                    && rows_finite(k_base, ks.start, bc, d, kv_rs)
                    && rows_finite(v_base, ks.start, bc, d_v, v_rs));
            }
            let tm = &mut self.tile_max[..br];
            tm.fill(f32::NEG_INFINITY);
            // Lazy rescaling: once every row has a finite running max, P = 2^(S − m) against
            // the max so far, in one pass that also takes the tile's max. Softmax is invariant
            // under the shift, so m need not be the true max as long as P stays bounded: when
            // no score exceeds its row's m by more than LAZY_GROWTH (P ≤ 2^LAZY_GROWTH), the
            // tile is done without touching m or rescaling the output. Otherwise (a new max
            // far above, or a NaN, which makes its row's sum NaN) the scores are computed
            // again and take the exact two passes.
            if self.m[..br].iter().all(|m| m.is_finite()) {
                let ts = &mut self.tile_sum[..br];
                ts.fill(0.0);
                for j in 0..bc {
                    simd::exp2_sub_acc_max(&mut st[j * br..(j + 1) * br], &self.m[..br], ts, tm);
                }
                let bounded = tm
                    .iter()
                    .zip(&self.m[..br])
                    .zip(ts.iter())
                    .all(|((&t, &m), s)| t <= m + LAZY_GROWTH && s.is_finite());
                if bounded {
                    simd::axpy(&mut self.l[..br], 1.0, ts);
                    pv(x, v_base, st, &mut self.acc, qs, ks, &blocks, exact_pv);
                    continue;
                }
                scores(st);
                tm.fill(f32::NEG_INFINITY);
            }
            for j in 0..bc {
                simd::max_into(tm, &st[j * br..(j + 1) * br]);
            }
            let rows = tm.iter().zip(&mut self.m).zip(&mut self.l).zip(&mut self.sub).zip(&mut self.alpha);
            for ((((&t, m), l), sub), alpha) in rows {
                let m_old = *m;
                let m_new = if t.is_nan() || m_old.is_nan() { f32::NAN } else { m_old.max(t) };
                // Rows with nothing visible yet: subtract +inf so every entry becomes 0.
                *sub = if m_new == f32::NEG_INFINITY { f32::INFINITY } else { m_new };
                *alpha = if m_new == f32::NEG_INFINITY { 1.0 } else { (m_old - m_new).exp2() };
                *m = m_new;
                *l *= *alpha;
            }
            for (row, &a) in self.acc[..br * d_v].chunks_exact_mut(d_v).zip(&self.alpha[..br]) {
                simd::scale(row, a);
            }
            for j in 0..bc {
                simd::exp2_sub_acc(&mut st[j * br..(j + 1) * br], &self.sub[..br], &mut self.l[..br]);
            }
            pv(x, v_base, st, &mut self.acc, qs, ks, &blocks, exact_pv);
        }
    }

    fn finish(&mut self, lse: &mut [f32]) -> (&[f32], usize) {
        let (br, d) = (self.rows, self.x.dims.d_v);
        let rows = self.m[..br].iter().zip(&self.l[..br]).zip(&mut self.alpha[..br]).zip(lse.iter_mut());
        for (((&m, &l), inv), lse) in rows {
            if m == f32::NEG_INFINITY || l == 0.0 {
                *inv = 0.0; // fully masked row: o = 0
                *lse = f32::NEG_INFINITY;
            } else {
                *inv = 1.0 / l;
                *lse = (m + l.log2()) * std::f32::consts::LN_2;
            }
        }
        for (row, &inv) in self.acc[..br * d].chunks_exact_mut(d).zip(&self.alpha[..br]) {
            simd::scale(row, inv);
        }
        (&self.acc[..br * d], d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AttentionParams;

    /// The lazy rescaling gives the exact path's results when a later key tile raises the
    /// running max far beyond the bound (its fallback), and keeps NaN where the exact path
    /// has it: against one key tile per call (the exact two passes only).
    #[test]
    fn lazy_rescaling_falls_back_on_large_growth_and_nan() {
        use crate::cpu::{forward_with, CpuConfig};
        use crate::{random::randn, DType, Tensor};
        let (s, h, d) = (600, 2, 16);
        let q = randn(vec![1, s, h, d], 1, DType::F32);
        let mut k = randn(vec![1, s, h, d], 2, DType::F32).as_f32().into_owned();
        let v = randn(vec![1, s, h, d], 3, DType::F32);
        // Keys 300.. (the second and third key tiles of 256) score up to ~40× higher.
        k[300 * h * d..].iter_mut().for_each(|x| *x *= 40.0);
        // One query row of head 1 meets a NaN key in the last tile only.
        let mut q_nan = q.as_f32().into_owned();
        q_nan[(7 * h + 1) * d] = f32::NAN;
        for (q, case) in [(q.clone(), "growth"), (Tensor::from_f32(vec![1, s, h, d], q_nan).unwrap(), "nan")] {
            let k = Tensor::from_f32(vec![1, s, h, d], k.clone()).unwrap();
            let params = AttentionParams::default();
            let run = |block_k| {
                let cfg = CpuConfig { tiles: TileConfig { block_q: 256, block_k }, ..Default::default() };
                forward_with(&q, &k, &v, None, &params, &cfg).unwrap()
            };
            let (lazy, exact) = (run(256), run(1024));
            let (lo, eo) = (lazy.o.as_f32(), exact.o.as_f32());
            for (i, (a, b)) in lo.iter().zip(eo.iter()).enumerate() {
                assert_eq!(a.is_nan(), b.is_nan(), "{case}: o[{i}]");
                assert!(a.is_nan() || (a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{case}: o[{i}] {a} vs {b}");
            }
            let (ll, el) = (lazy.lse.as_f32(), exact.lse.as_f32());
            for (i, (a, b)) in ll.iter().zip(el.iter()).enumerate() {
                assert!((a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{case}: lse[{i}]");
            }
            if case == "nan" {
                assert!(lo.iter().any(|x| x.is_nan()));
            }
        }
    }
}
