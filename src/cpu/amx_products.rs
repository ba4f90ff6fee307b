//! The bf16 path's matrix products on AMX tiles: [`product`] computes what
//! [`super::products::product`] computes — `C[rows][16·n16] (op)= A · B` over `k2` pair steps,
//! its operands in the same layouts ([`AOperand`], [`BOperand`]), the same [`Epilogue`]s —
//! with `TDPBF16PS` in place of `vdpbf16ps`.
//!
//! The product runs in blocks of 32 × 32 (2 × 2 tiles of 16 × 16 f32 in tiles 4–7, A's two
//! row halves in tiles 0–1, B's two column halves in tiles 2–3), 16 pair steps (one 64-byte A
//! row) per `TDPBF16PS`, each step's loads interleaved with the multiplies that wait for them;
//! every tile is configured 16 rows × 64 bytes once per call, and column blocks run outside
//! row blocks (a block of B stays in the first-level cache while A passes it). A block's
//! raw `A·B` is stored into a 32 × 32 scratch and the epilogue applied from there into `C`, so
//! that blocks on `C`'s edges write only `C`'s rows and lanes ([`product_exp2_bf16`]: the bf16
//! forward's probabilities as the epilogue, no `C`, the scores never stored). Operands are read
//! in place where a block can: A rows contiguous in pairs (`ps = 1`), `k2` a multiple of 16 and B's
//! vectors even; otherwise they are first copied, zero-padded, into the caller's [`Scratch`]
//! (a query tile's last rows, an odd head dimension's pairs, an odd key tile). A `TDPBF16PS`
//! accumulates in another order than `vdpbf16ps` (two chains per instruction, then C: the
//! twin's module [`super::amx`]), so the two products agree to f32 rounding, not bit for bit.
//!
//! [`BlockEngine::Tiles`] runs the processor's tiles when [`amx::available`], the
//! instruction-level twin otherwise (and always under [`BlockEngine::Twin`]): the same steps
//! on [`amx::Tile`], bit for bit the same result, so that the tile code is tested on every
//! processor.

use super::aligned::{on_line, Lines, LINE};
use super::amx::{self, BlockEngine, Tile};
use super::products::{AOperand, BOperand, Epilogue};

/// Which unit runs the bf16 path's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// `vdpbf16ps` ([`super::products`]).
    Vector,
    /// AMX tiles ([`product`]) on this engine.
    Tiles(BlockEngine),
}

impl Unit {
    /// The tiles where the processor has them and Linux permits them, `vdpbf16ps` otherwise.
    pub(crate) fn chosen() -> Unit {
        if amx::available() {
            Unit::Tiles(BlockEngine::Tiles)
        } else {
            Unit::Vector
        }
    }
}

/// How [`product_exp2_bf16`] writes the probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum PRows {
    /// Each rounded to bf16: row `r` at `p[r · p_rs..][..16 · n16]`.
    #[default]
    Rounded,
    /// Each split into three bf16 parts by truncation (exactly their sum:
    /// [`super::bf16_rows::truncated_parts`]), part `j` of row `r` at `p[r · p_rs + j ·
    /// part..][..16 · n16]` with `part` = [`split_lanes`]`(n16)` (a padding vector after an odd
    /// count zeroed): the A side of the f32 forward's `P·V` ([`Depth::split`]).
    Split,
}

/// Lanes of each part of a split row over `n16` vectors: whole 16-pair steps of the tiles.
pub(crate) fn split_lanes(n16: usize) -> usize {
    32 * n16.div_ceil(2)
}

/// The inner dimension of a product on the tiles, in pair steps of A's rows and B's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Depth {
    /// Pairs the operands span.
    pairs: usize,
    /// How they are multiplied.
    parts: Parts,
}

/// How a [`Depth`]'s pairs are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parts {
    /// In order.
    Whole,
    /// Each operand holds three parts of `steps` whole steps (16 pairs) each
    /// ([`super::split`]), multiplied part by part in the six pairs of
    /// [`super::split::A_PARTS`] and [`super::split::B_PARTS`] into one accumulator.
    Split(usize),
    /// Operands of three parts as above, of which only the leading parts' product `x0·y0`
    /// is taken.
    Leading(usize),
}

impl From<usize> for Depth {
    /// `pairs` pair steps, multiplied in order.
    fn from(pairs: usize) -> Depth {
        Depth { pairs, parts: Parts::Whole }
    }
}

impl Depth {
    /// Three parts of `part` pairs each (a multiple of 16: whole steps) on each side, their
    /// six products summed small ones first: f32 products from bf16 parts.
    ///
    /// # Panics
    /// When `part` is not a multiple of 16.
    pub(crate) fn split(part: usize) -> Depth {
        assert!(part.is_multiple_of(STEP), "a split depth of {part} pairs: parts are whole steps of {STEP}");
        Depth { pairs: 3 * part, parts: Parts::Split(part / STEP) }
    }

    /// Operands as [`Depth::split`], only their leading parts multiplied (`x0·y0`: bf16
    /// products of the values rounded to bf16) — an estimate within about `2^-8` of each
    /// product's magnitude, for what needs no more (a first tile's row maxima).
    ///
    /// # Panics
    /// As [`Depth::split`].
    pub(crate) fn leading(self) -> Depth {
        match self.parts {
            Parts::Split(steps) | Parts::Leading(steps) => Depth { parts: Parts::Leading(steps), ..self },
            Parts::Whole => self,
        }
    }
}

/// Pairs of the inner dimension per `TDPBF16PS` (one 64-byte row of an A tile).
const STEP: usize = 16;
/// Rows and lanes of a block: 2 × 2 tiles of 16 × 16.
const BLOCK: usize = 32;
/// Rows of a tile.
const HALF: usize = 16;

/// The buffers a thread's products copy edge operands into and stage blocks in, kept between
/// calls (the hot path allocates only when a shape grows).
#[derive(Default)]
pub(crate) struct Scratch {
    /// A, zero-padded: 32 rows (the last row block) or every row, `steps · 16` pairs each.
    a: Lines<u32>,
    /// B, zero-padded: `steps · 16` steps of an even number of vectors.
    b: Lines<u32>,
    /// One block's raw `A·B`, 32 × 32 f32.
    c: Lines<f32>,
}

/// A run of blocks' operand: `data[at + r · stride + i]` is row `r`'s element `i`.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [u32],
    at: usize,
    stride: usize,
}

/// `C (op)= A · B` on tiles (module documentation): `rows` rows of `C` at stride `c_rs`,
/// `n16` vectors of 16 lanes, `k2` pair steps. Returns the engine that ran.
///
/// # Panics
/// When an operand or `C` is too short for the shape, `c_rs < 16 · n16`, or a
/// [`Epilogue::Rescale`] holds fewer than `rows` factors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: impl Into<Depth>,
    epi: Epilogue,
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    run(c, c_rs, rows, n16, a, b, k2.into(), Finish::Epilogue(epi), engine, scratch)
}

/// [`product`] with [`Epilogue::Add`], the sums formed in the tiles: each whole 32 × 32 block
/// of `C` is loaded into the accumulator tiles, the products added there in the tiles' order,
/// and stored back (no staged block, no vector pass); blocks on `C`'s edges as [`product`].
/// The bf16 forward's `O += P·V` on a lazily rescaled tile. (A separate function, so that a
/// call's rounding never depends on where its buffers happen to lie.)
///
/// # Panics
/// As [`product`]; `C` not starting on a 64-byte line or `c_rs` not whole lines (the tiles
/// load its rows: [`super::aligned`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: impl Into<Depth>,
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    assert!(on_line(c.as_ptr()) && (c_rs * 4).is_multiple_of(LINE), "AMX accumulate: C off whole cache lines");
    run(c, c_rs, rows, n16, a, b, k2.into(), Finish::Accumulate, engine, scratch)
}

/// [`product`] with [`Epilogue::Set`]`(scale)` that also takes the running maximum of each
/// row's values per lane as it stores them: `maxes[r · 16 + l]` = the largest of row `r`'s
/// lanes `l` of every vector (NaN once one is NaN; the caller reduces the 16 lanes, as after
/// [`super::products::product_max`]). Every lane of the `n16` vectors counts, so `C`'s rows
/// must hold no padding lanes.
///
/// # Panics
/// As [`product`]; `maxes` shorter than `16 · rows`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_max(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: impl Into<Depth>,
    scale: f32,
    maxes: &mut [f32],
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    assert!(maxes.len() >= 16 * rows, "AMX product: {} lane maxima for {rows} rows", maxes.len());
    maxes[..16 * rows].fill(f32::NEG_INFINITY);
    run(c, c_rs, rows, n16, a, b, k2.into(), Finish::SetMax(scale, maxes), engine, scratch)
}

/// The bf16 forward's lazily rescaled probabilities in the product's epilogue, as
/// [`super::products::product_exp2_bf16`] computes them from its registers: from each block's
/// raw `A·B` staged in the first-level cache, the shifted score `x = scale · (A·B) − sub[r]`
/// (one rounding), `2^x` ([`super::simd::avx512::exp2_finite`]) rounded to bf16 into `p` (row
/// `r` at `p[r · p_rs..][..16 · n16]`, keys in order: the A pairs of `P·V`) and the sum of
/// the unrounded `2^x` per lane into `sums[r · 16..]` (added to what it holds). No `C`: the
/// scores are never stored. Unlike the vector product, no maxima: every `2^x` is at most its
/// lane's sum, so the caller bounds the growth of the scores by the sums (one instruction
/// fewer per 16 scores, in an epilogue bound by its vector instructions).
///
/// With [`PRows::Split`], each `2^x` is written as its three bf16 parts, part `j` of row `r`
/// at `p[r · p_rs + j · split_lanes(n16)..]` (`p_rs ≥ 3 · split_lanes(n16)`), for the f32
/// forward on the tiles.
///
/// With `visible`, lane `l` of vector `j` of row `r` is seen only where bit `l` of
/// `visible[r · n16 + j]` is set: the others' `x` is `-inf` (P 0, no share in the sums), and
/// a block of 32 × 32 that sees nothing is not multiplied at all (its P zeros).
///
/// # Panics
/// As [`product`], with `p` in place of `C`; `sub` shorter than `rows`, `sums` shorter than
/// `16 · rows`, `visible` shorter than `rows · n16`; a processor without AVX512_BF16 (the
/// bf16 path's own condition).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_exp2_bf16(
    p: &mut [u16],
    p_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: impl Into<Depth>,
    scale: f32,
    sub: &[f32],
    sums: &mut [f32],
    (visible, rows_of_p): (Option<&[u16]>, PRows),
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    assert!(super::products::bf16_available(), "AMX product: the probabilities' epilogue needs AVX512_BF16");
    assert!(visible.is_none_or(|v| v.len() >= rows * n16), "AMX product: visible lanes too short");
    let width = if rows_of_p == PRows::Split { 3 * split_lanes(n16) } else { 16 * n16 };
    assert!(rows == 0 || (p_rs >= width && (rows - 1) * p_rs + width <= p.len()), "AMX product: P too short");
    assert!(sub.len() >= rows && sums.len() >= 16 * rows, "AMX product: row state too short");
    let finish = Finish::Exp2Bf16(Probabilities { scale, sub, p, p_rs, sums, visible, n16, rows_of_p });
    run(&mut [], 0, rows, n16, a, b, k2.into(), finish, engine, scratch)
}

/// Where [`product_exp2_bf16`]'s epilogue reads and writes.
struct Probabilities<'a> {
    scale: f32,
    sub: &'a [f32],
    p: &'a mut [u16],
    p_rs: usize,
    sums: &'a mut [f32],
    /// The visible lanes, `[rows][n16]` bits (none: every lane).
    visible: Option<&'a [u16]>,
    n16: usize,
    rows_of_p: PRows,
}

/// The maxima of a tile's scaled scores without the scores: `maxes[r · 16 + l]` = the largest
/// `scale · (A·B)` of row `r`'s lanes `l` of every vector (`-inf` where none), the lanes that
/// `visible` does not set (as in [`product_exp2_bf16`]) left out and blocks that see nothing
/// not multiplied; no `C`. For the first key tile of a query tile, whose running maxima this
/// gives before [`product_exp2_bf16`] takes its probabilities against them. NaN scores (from
/// overflowing products) may be missed: the probabilities' sums show them.
///
/// # Panics
/// As [`product_exp2_bf16`] without `p`, `sub` and `sums`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_maxima(
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: impl Into<Depth>,
    scale: f32,
    maxes: &mut [f32],
    visible: Option<&[u16]>,
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    assert!(super::products::bf16_available(), "AMX product: the maxima's epilogue needs AVX-512");
    assert!(maxes.len() >= 16 * rows, "AMX product: {} lane maxima for {rows} rows", maxes.len());
    assert!(visible.is_none_or(|v| v.len() >= rows * n16), "AMX product: visible lanes too short");
    maxes[..16 * rows].fill(f32::NEG_INFINITY);
    let finish = Finish::Maxima(Maxima { scale, maxes, visible, n16 });
    run(&mut [], 0, rows, n16, a, b, k2.into(), finish, engine, scratch)
}

/// Where [`product_maxima`]'s epilogue writes.
struct Maxima<'a> {
    scale: f32,
    maxes: &'a mut [f32],
    visible: Option<&'a [u16]>,
    n16: usize,
}

/// Whether any lane of rows `r0..r0 + nr`, lanes `32 · cb..` (`nv` of them) is visible.
fn block_seen(visible: Option<&[u16]>, n16: usize, r0: usize, nr: usize, cb: usize, nv: usize) -> bool {
    visible.is_none_or(|vis| (r0..r0 + nr).any(|r| vis[r * n16 + 2 * cb..][..nv / 16].iter().any(|&m| m != 0)))
}

/// What a block's raw `A·B` becomes in `C`.
enum Finish<'a, 'm> {
    Epilogue(Epilogue<'a>),
    /// `C = scale · A·B`, and the rows' maxima.
    SetMax(f32, &'m mut [f32]),
    /// No `C`: the probabilities of [`product_exp2_bf16`].
    Exp2Bf16(Probabilities<'m>),
    /// No `C`: the maxima of [`product_maxima`].
    Maxima(Maxima<'m>),
    /// `C += A·B` accumulated in the tiles ([`accumulate`]).
    Accumulate,
}

/// [`product`] and [`product_max`]: the checks, the padded operands and the engine.
#[allow(clippy::too_many_arguments)]
fn run(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    depth: Depth,
    finish: Finish,
    engine: BlockEngine,
    scratch: &mut Scratch,
) -> BlockEngine {
    let k2 = depth.pairs;
    if rows == 0 || n16 == 0 {
        return engine_of(engine);
    }
    if !matches!(finish, Finish::Exp2Bf16(_) | Finish::Maxima(_)) {
        assert!(c_rs >= 16 * n16 && (rows - 1) * c_rs + 16 * n16 <= c.len(), "AMX product: C too short");
    }
    assert!(
        k2 == 0 || (rows - 1) * a.rs + (k2 - 1) * a.ps < a.data.len(),
        "AMX product: A too short for {rows} rows of {k2} steps"
    );
    assert!(
        k2 == 0 || ((k2 - 1) * b.vectors + n16) * 16 <= b.data.len() && b.vectors >= n16,
        "AMX product: B too short for {k2} steps of {n16} vectors"
    );
    if let Finish::Epilogue(Epilogue::Rescale(alpha)) = finish {
        assert!(alpha.len() >= rows, "AMX product: {} rescale factors for {rows} rows", alpha.len());
    }
    let steps = k2.div_ceil(STEP);
    let kp = steps * STEP;
    scratch.c.resize(BLOCK * BLOCK);
    let Scratch { a: a_pad, b: b_pad, c: block } = scratch;
    // B: in place when whole steps and whole column blocks on whole lines, else copied
    // zero-padded.
    let n32 = n16.div_ceil(2);
    // (A tile row that straddles two cache lines loads several times slower: see
    // `super::aligned`; operands off the lines are copied onto them.)
    let lined = |data: &[u32], stride: usize| on_line(data.as_ptr()) && (stride * 4).is_multiple_of(LINE);
    let b_in = if kp == k2 && n16.is_multiple_of(2) && lined(b.data, b.vectors * 16) {
        Strided { data: b.data, at: 0, stride: b.vectors * 16 }
    } else {
        let stride = 2 * n32 * 16;
        grow(b_pad, kp * stride);
        for p in 0..kp {
            let row = &mut b_pad[p * stride..(p + 1) * stride];
            if p < k2 {
                let src = &b.data[p * b.vectors * 16..][..n16 * 16];
                row[..n16 * 16].copy_from_slice(src);
                row[n16 * 16..].fill(0);
            } else {
                row.fill(0);
            }
        }
        Strided { data: b_pad, at: 0, stride }
    };
    // A: in place when rows of whole steps on whole lines; the last row block (and every row
    // when the steps are not whole, not contiguous or not on lines) copied zero-padded.
    let whole_a = a.ps == 1 && kp == k2 && lined(a.data, a.rs);
    let full_blocks = if whole_a { rows / BLOCK } else { 0 };
    let padded_rows = (rows - full_blocks * BLOCK).div_ceil(BLOCK) * BLOCK;
    grow(a_pad, padded_rows * kp);
    for r in 0..padded_rows {
        let row = &mut a_pad[r * kp..(r + 1) * kp];
        let src_row = full_blocks * BLOCK + r;
        if src_row < rows {
            for (p, x) in row[..k2].iter_mut().enumerate() {
                *x = a.data[src_row * a.rs + p * a.ps];
            }
            row[k2..].fill(0);
        } else {
            row.fill(0);
        }
    }
    let ran = engine_of(engine);
    let ops = Operands { a, a_pad, full_blocks, kp, b_in, steps, parts: depth.parts };
    match ran {
        BlockEngine::Tiles => {
            let _tiles = TilesInUse::configure();
            // SAFETY: the tiles are available (engine_of) and configured (`_tiles`); the
            // operands were checked above (see `blocks`).
            unsafe { blocks_on_tiles(c, c_rs, rows, n16, &ops, finish, block) }
        }
        BlockEngine::Twin => blocks(c, c_rs, rows, n16, &ops, finish, block, &mut OnTwin::new()),
    }
    ran
}

/// A call's operands as its blocks read them.
struct Operands<'a> {
    a: AOperand<'a, u32>,
    a_pad: &'a [u32],
    /// Row blocks of A read in place (the rest from `a_pad`).
    full_blocks: usize,
    /// Pairs per padded A row, `16 · steps`.
    kp: usize,
    b_in: Strided<'a>,
    steps: usize,
    /// How the steps are multiplied ([`Depth`]).
    parts: Parts,
}

/// A block's products onto zero, or (`from`: `C`, the block's offset and `C`'s row stride)
/// onto the block of `C`: A's row block `a` and B's column block `b` over the call's steps —
/// in order, or for split operands part by part in the pairs of [`super::split::A_PARTS`]
/// and [`super::split::B_PARTS`].
#[inline(always)]
fn start_block(kernel: &mut impl Kernel, ops: &Operands, a: Strided, b: Strided, from: Option<(&[f32], usize, usize)>) {
    let ps = match ops.parts {
        Parts::Split(ps) => ps,
        // The leading parts lie first in each operand.
        Parts::Whole | Parts::Leading(_) => {
            let steps = if let Parts::Leading(ps) = ops.parts { ps } else { ops.steps };
            match from {
                None => kernel.start(steps, a, b),
                Some((c, at, c_rs)) => kernel.start_from(c, at, c_rs, steps, a, b),
            }
            return;
        }
    };
    let pairs = super::split::A_PARTS.iter().zip(&super::split::B_PARTS);
    for (j, (&pa, &pb)) in pairs.enumerate() {
        let a_j = Strided { at: a.at + pa * ps * STEP, ..a };
        let b_j = Strided { at: b.at + pb * ps * STEP * b.stride, ..b };
        match (j, from) {
            (0, None) => kernel.start(ps, a_j, b_j),
            (0, Some((c, at, c_rs))) => kernel.start_from(c, at, c_rs, ps, a_j, b_j),
            _ => kernel.more(ps, a_j, b_j),
        }
    }
}

/// [`blocks`] on the processor's tiles, its epilogues compiled for AVX-512 (every processor
/// with AMX has it).
///
/// # Safety
/// AMX available and the tiles configured 16 × 64 bytes each; the operands checked by [`run`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocks_on_tiles(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    ops: &Operands,
    finish: Finish,
    block: &mut [f32],
) {
    // SAFETY: the tiles are configured (the caller's contract).
    let mut kernel = unsafe { OnTiles::configured() };
    blocks(c, c_rs, rows, n16, ops, finish, block, &mut kernel)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn blocks_on_tiles(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    ops: &Operands,
    finish: Finish,
    block: &mut [f32],
) {
    blocks(c, c_rs, rows, n16, ops, finish, block, &mut OnTwin::new())
}

/// How the blocks' raw `A·B` are formed: [`Kernel::start`] issues a block's multiplies into
/// the four accumulators, [`Kernel::store`] writes them out as 32 × 32 f32. (Running the
/// previous block's epilogue between the two, so that the tiles multiply while the vector
/// units work, measured no faster on an Intel Xeon, family 6 model 207.)
trait Kernel {
    /// `acc = A · B` over `steps` steps of 16 pairs (zero when `steps` is 0): `a` 32 rows of
    /// `16 · steps` pairs from `a.at` at `a.stride`, `b` `16 · steps` rows of 32 lanes from
    /// `b.at` at `b.stride`.
    ///
    /// # Panics
    /// When an operand is too short for that.
    fn start(&mut self, steps: usize, a: Strided, b: Strided);
    /// The last started block's `A·B` into `c[..32 · 32]` (rows of 32).
    fn store(&mut self, c: &mut [f32]);
    /// [`Kernel::start`] from the block of `C` at `c[at..]` (32 rows of 32 at `c_rs`) in
    /// place of zero: `acc = C + A · B`, in the tiles' order of accumulation.
    fn start_from(&mut self, c: &[f32], at: usize, c_rs: usize, steps: usize, a: Strided, b: Strided);
    /// The last started block's accumulators into the block of `C` at `c[at..]`.
    fn store_to(&mut self, c: &mut [f32], at: usize, c_rs: usize);
    /// More products onto the last started block: `acc += A · B` as in [`Kernel::start`].
    fn more(&mut self, steps: usize, a: Strided, b: Strided);
}

/// Whether `c` holds a block of 32 rows of 32 at `at`, row stride `c_rs`.
fn c_block_fits(c: &[f32], at: usize, c_rs: usize) -> bool {
    c_rs >= BLOCK && at + (BLOCK - 1) * c_rs + BLOCK <= c.len()
}

/// Whether `a` and `b` hold a block of `steps` steps (see [`Kernel::start`]).
fn block_fits(steps: usize, a: Strided, b: Strided) -> bool {
    steps == 0
        || (a.at + (BLOCK - 1) * a.stride + steps * STEP <= a.data.len()
            && b.at + (steps * STEP - 1) * b.stride + BLOCK <= b.data.len())
}

/// [`Kernel`] on the instruction-level twin: the same tile loads and `TDPBF16PS` order as
/// [`OnTiles`], bit for bit the same result.
struct OnTwin {
    acc: Vec<Tile>,
}

impl OnTwin {
    fn new() -> OnTwin {
        OnTwin { acc: (0..4).map(|_| Tile::zeroed(HALF, 4 * HALF).expect("a 16 × 64-byte tile")).collect() }
    }

    /// The multiplies of [`Kernel::start`] onto the accumulators as they are.
    fn multiply(&mut self, steps: usize, a: Strided, b: Strided) {
        assert!(block_fits(steps, a, b), "AMX block: an operand too short");
        let tile = |x: Strided, at: usize| {
            Tile::load_pairs(HALF, HALF, &x.data[x.at + at..], x.stride).expect("a block's operand lies inside it")
        };
        for s in 0..steps {
            let a_tiles = [tile(a, s * STEP), tile(a, HALF * a.stride + s * STEP)];
            let b_tiles = [tile(b, s * STEP * b.stride), tile(b, s * STEP * b.stride + HALF)];
            for (t, acc) in self.acc.iter_mut().enumerate() {
                acc.dpbf16ps(&a_tiles[t / 2], &b_tiles[t % 2]).expect("tile shapes agree");
            }
        }
    }
}

impl Kernel for OnTwin {
    fn start(&mut self, steps: usize, a: Strided, b: Strided) {
        *self = OnTwin::new();
        self.multiply(steps, a, b);
    }

    fn store(&mut self, c: &mut [f32]) {
        self.store_to(c, 0, BLOCK);
    }

    fn start_from(&mut self, c: &[f32], at: usize, c_rs: usize, steps: usize, a: Strided, b: Strided) {
        assert!(c_block_fits(c, at, c_rs), "AMX block: C too short");
        let bits: &[u32] = bytemuck::cast_slice(c);
        for (t, acc) in self.acc.iter_mut().enumerate() {
            let from = at + (t / 2) * HALF * c_rs + (t % 2) * HALF;
            *acc = Tile::load_pairs(HALF, HALF, &bits[from..], c_rs).expect("the block holds its tiles");
        }
        self.multiply(steps, a, b);
    }

    fn more(&mut self, steps: usize, a: Strided, b: Strided) {
        self.multiply(steps, a, b);
    }

    fn store_to(&mut self, c: &mut [f32], at: usize, c_rs: usize) {
        assert!(c_block_fits(c, at, c_rs), "AMX block: C too short");
        for (t, acc) in self.acc.iter().enumerate() {
            let to = at + (t / 2) * HALF * c_rs + (t % 2) * HALF;
            acc.store(bytemuck::cast_slice_mut(&mut c[to..]), c_rs * 4).expect("the block holds its tiles");
        }
    }
}

/// Every 32 × 32 block of `C`: its raw `A·B` by `kernel` into `block`, then the finish into
/// `C`'s rows and lanes of the block.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn blocks(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    ops: &Operands,
    mut finish: Finish,
    block: &mut [f32],
    kernel: &mut impl Kernel,
) {
    let block = &mut block[..BLOCK * BLOCK];
    let (a, kp) = (ops.a, ops.kp);
    // Column blocks outer: a block of B (16 · steps rows of 128 bytes) stays in the first-
    // level cache while every row block of A passes it.
    for cb in 0..n16.div_ceil(2) {
        let b_blk = Strided { at: ops.b_in.at + cb * BLOCK, ..ops.b_in };
        for rb in 0..rows.div_ceil(BLOCK) {
            let a_in = if rb < ops.full_blocks {
                Strided { data: a.data, at: rb * BLOCK * a.rs, stride: a.rs }
            } else {
                Strided { data: ops.a_pad, at: (rb - ops.full_blocks) * BLOCK * kp, stride: kp }
            };
            let r0 = rb * BLOCK;
            let nr = (rows - r0).min(BLOCK);
            let nv = (n16 - 2 * cb).min(2) * 16;
            if let Finish::Maxima(x) = &mut finish {
                if block_seen(x.visible, x.n16, r0, nr, cb, nv) {
                    start_block(kernel, ops, a_in, b_blk, None);
                    kernel.store(block);
                    // SAFETY: AVX512F and AVX512BW (with AVX512_BF16, asserted by
                    // product_maxima); the rows and lanes lie inside the row state.
                    unsafe { maxima_avx512(block, nr, nv, x, r0, cb) };
                }
                continue;
            }
            if let Finish::Exp2Bf16(x) = &mut finish {
                let at = r0 * x.p_rs + cb * BLOCK;
                if !block_seen(x.visible, x.n16, r0, nr, cb, nv) {
                    // Nothing of the block is seen: its probabilities are 0.
                    // (A split part's padding vector too: its parts are whole blocks.)
                    let (copies, part, width) =
                        if x.rows_of_p == PRows::Split { (3, split_lanes(x.n16), BLOCK) } else { (1, 0, nv) };
                    for i in 0..nr {
                        for j in 0..copies {
                            x.p[at + i * x.p_rs + j * part..][..width].fill(0);
                        }
                    }
                    continue;
                }
                start_block(kernel, ops, a_in, b_blk, None);
                kernel.store(block);
                // SAFETY: AVX512F, AVX512DQ and AVX512_BF16 asserted by product_exp2_bf16; the
                // rows and lanes lie inside `p` and the row state (checked there).
                unsafe {
                    match (x.visible.is_some(), x.rows_of_p) {
                        (true, PRows::Rounded) => probabilities_avx512::<true, false>(block, nr, nv, x, r0, at, cb),
                        (false, PRows::Rounded) => probabilities_avx512::<false, false>(block, nr, nv, x, r0, at, cb),
                        (true, PRows::Split) => probabilities_avx512::<true, true>(block, nr, nv, x, r0, at, cb),
                        (false, PRows::Split) => probabilities_avx512::<false, true>(block, nr, nv, x, r0, at, cb),
                    }
                };
                continue;
            }
            let at = r0 * c_rs + cb * BLOCK;
            if matches!(finish, Finish::Accumulate) && nr == BLOCK && nv == BLOCK {
                // A whole block of C on lines: the tiles accumulate into it in place.
                start_block(kernel, ops, a_in, b_blk, Some((&*c, at, c_rs)));
                kernel.store_to(c, at, c_rs);
                continue;
            }
            start_block(kernel, ops, a_in, b_blk, None);
            kernel.store(block);
            for i in 0..nr {
                let out = &mut c[(r0 + i) * c_rs + cb * BLOCK..][..nv];
                let raw = &block[i * BLOCK..][..nv];
                match finish {
                    Finish::Epilogue(Epilogue::Set(s)) => out.iter_mut().zip(raw).for_each(|(o, &x)| *o = s * x),
                    Finish::Epilogue(Epilogue::Add) | Finish::Accumulate => {
                        out.iter_mut().zip(raw).for_each(|(o, &x)| *o += x)
                    }
                    Finish::Epilogue(Epilogue::Rescale(alpha)) => {
                        let f = alpha[r0 + i];
                        out.iter_mut().zip(raw).for_each(|(o, &x)| *o = f * *o + x)
                    }
                    Finish::Exp2Bf16(_) | Finish::Maxima(_) => unreachable!("taken above"),
                    Finish::SetMax(s, ref mut maxes) => {
                        // Per lane (so that it vectorises; `nv` is whole vectors), a NaN
                        // making its lane NaN for good.
                        let row: &mut [f32; 16] = (&mut maxes[(r0 + i) * 16..][..16]).try_into().expect("16 lanes");
                        let mut lanes = *row;
                        for (o16, r16) in out.chunks_exact_mut(16).zip(raw.chunks_exact(16)) {
                            let o16: &mut [f32; 16] = o16.try_into().expect("16 lanes");
                            let r16: &[f32; 16] = r16.try_into().expect("16 lanes");
                            for l in 0..16 {
                                let y = s * r16[l];
                                o16[l] = y;
                                lanes[l] = if y > lanes[l] || y.is_nan() { y } else { lanes[l] };
                            }
                        }
                        *row = lanes;
                    }
                }
            }
        }
    }
}

/// [`product_exp2_bf16`]'s epilogue for one block: rows `r0..r0 + nr` of `x`, `nv` lanes
/// (16 or 32) of the staged raw `A·B` in `block` (rows of 32), the probabilities stored from
/// `x.p[at..]`; `MASKED`: the lanes `x.visible` does not set (column block `cb`) are `-inf`;
/// `SPLIT`: [`PRows::Split`].
///
/// # Safety
/// AVX512F, AVX512DQ and AVX512_BF16 present; `nv` a multiple of 16 no larger than 32; the rows and
/// lanes inside `x`'s buffers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16,avx512vl")]
unsafe fn probabilities_avx512<const MASKED: bool, const SPLIT: bool>(
    block: &[f32],
    nr: usize,
    nv: usize,
    x: &mut Probabilities,
    r0: usize,
    at: usize,
    cb: usize,
) {
    use std::arch::x86_64::*;
    let scale = _mm512_set1_ps(x.scale);
    let hidden = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in 0..nr {
        let r = r0 + i;
        let sub = _mm512_set1_ps(x.sub[r]);
        let seen = if MASKED { &x.visible.unwrap_or_default()[r * x.n16 + 2 * cb..][..nv / 16] } else { &[][..] };
        let mut row_sum = _mm512_setzero_ps();
        // 16 lanes: the shifted score in one rounding (as the vector product's epilogue forms
        // it), 2^x and its sum.
        let mut lanes = |v: usize| {
            // SAFETY: 16 values of the block's row i (the caller's contract).
            let raw = unsafe { _mm512_loadu_ps(block.as_ptr().add(i * BLOCK + v)) };
            let mut shifted = _mm512_fmsub_ps(raw, scale, sub);
            if MASKED {
                shifted = _mm512_mask_blend_ps(seen[v / 16], hidden, shifted);
            }
            let y = super::simd::avx512::exp2_finite(shifted);
            row_sum = _mm512_add_ps(row_sum, y);
            y
        };
        let out = x.p.as_mut_ptr().wrapping_add(at + i * x.p_rs);
        if SPLIT {
            // A half block (the last of an odd vector count) zeroes the padding vector of
            // each part: the part's 32 lanes are a whole step of the tiles.
            let part = split_lanes(x.n16);
            let (lo, hi) = if nv == BLOCK { (lanes(0), lanes(16)) } else { (lanes(0), _mm512_setzero_ps()) };
            let (lo, hi) = (super::bf16_rows::truncated_parts(lo), super::bf16_rows::truncated_parts(hi));
            for (j, (lo, hi)) in lo.into_iter().zip(hi).enumerate() {
                // Each part exact in bf16: the rounding only packs it.
                let packed = _mm512_cvtne2ps_pbh(hi, lo);
                // SAFETY: 32 lanes of part j of P's row r (the caller's contract: the part's
                // width is whole blocks).
                unsafe {
                    _mm512_storeu_si512(
                        out.wrapping_add(j * part).cast(),
                        std::mem::transmute::<__m512bh, __m512i>(packed),
                    )
                };
            }
        } else if nv == BLOCK {
            // Both vectors rounded by one instruction, stored as one line of 32 keys.
            let (lo, hi) = (lanes(0), lanes(16));
            // SAFETY: 32 values of P's row r (the caller's contract).
            unsafe {
                _mm512_storeu_si512(out.cast(), std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)))
            };
        } else {
            let rounded = _mm512_cvtneps_pbh(lanes(0));
            // SAFETY: 16 values of P's row r (the caller's contract).
            unsafe { _mm256_storeu_si256(out.cast(), std::mem::transmute::<__m256bh, __m256i>(rounded)) };
        }
        let sp = &mut x.sums[r * 16..][..16];
        // SAFETY: 16 values.
        unsafe { _mm512_storeu_ps(sp.as_mut_ptr(), _mm512_add_ps(_mm512_loadu_ps(sp.as_ptr()), row_sum)) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn probabilities_avx512<const MASKED: bool, const SPLIT: bool>(
    _: &[f32],
    _: usize,
    _: usize,
    _: &mut Probabilities,
    _: usize,
    _: usize,
    _: usize,
) {
    unreachable!("the bf16 path runs only where AVX512_BF16 is")
}

/// [`product_maxima`]'s epilogue for one block: rows `r0..r0 + nr`, `nv` lanes (16 or 32) of
/// the staged raw `A·B` in `block` (rows of 32), column block `cb`.
///
/// # Safety
/// AVX512F and AVX512BW present; `nv` a multiple of 16 no larger than 32; the rows inside
/// `x`'s buffers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn maxima_avx512(block: &[f32], nr: usize, nv: usize, x: &mut Maxima, r0: usize, cb: usize) {
    use std::arch::x86_64::*;
    let (scale, hidden) = (_mm512_set1_ps(x.scale), _mm512_set1_ps(f32::NEG_INFINITY));
    for i in 0..nr {
        let r = r0 + i;
        let mp = &mut x.maxes[r * 16..][..16];
        // SAFETY: 16 values of `mp` and of the block's row i (the caller's contract).
        let mut row_max = unsafe { _mm512_loadu_ps(mp.as_ptr()) };
        for v in (0..nv).step_by(16) {
            // SAFETY: as above.
            let mut y = _mm512_mul_ps(unsafe { _mm512_loadu_ps(block.as_ptr().add(i * BLOCK + v)) }, scale);
            if let Some(vis) = x.visible {
                y = _mm512_mask_blend_ps(vis[r * x.n16 + 2 * cb + v / 16], hidden, y);
            }
            row_max = _mm512_max_ps(row_max, y);
        }
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(mp.as_mut_ptr(), row_max) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn maxima_avx512(_: &[f32], _: usize, _: usize, _: &mut Maxima, _: usize, _: usize) {
    unreachable!("the bf16 path runs only where AVX512_BF16 is")
}

/// `v` grown to `n` (never shrunk: the buffers keep their largest size).
fn grow(v: &mut Lines<u32>, n: usize) {
    if v.len() < n {
        v.resize(n);
    }
}

/// The engine a call runs: the tiles only when asked for and [`amx::available`].
fn engine_of(engine: BlockEngine) -> BlockEngine {
    match engine {
        BlockEngine::Tiles if amx::available() => BlockEngine::Tiles,
        _ => BlockEngine::Twin,
    }
}

/// The tiles configured 8 × (16 rows × 64 bytes) for the life of the value, released when it
/// drops (also on a panic).
struct TilesInUse;

impl TilesInUse {
    fn configure() -> TilesInUse {
        let cfg = amx::TileConfig::new(&[(HALF, 64); amx::TILES]).expect("the full palette-1 shape");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: called only when `amx::available()` (the processor has the tiles and Linux
        // permits them); the config is valid (checked by `TileConfig::new`).
        unsafe {
            std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) &cfg, options(nostack, readonly));
        }
        let _ = cfg;
        TilesInUse
    }
}

impl Drop for TilesInUse {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tiles were configured by `configure` on this thread.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// [`Kernel`] on the processor's tiles: A's row halves in tiles 0–1, B's column halves in
/// 2–3, the accumulators in 4–7 (which keep a started block until [`Kernel::store`]).
#[cfg(target_arch = "x86_64")]
struct OnTiles {
    /// Only [`OnTiles::configured`] makes one.
    _configured: (),
}

#[cfg(target_arch = "x86_64")]
impl OnTiles {
    /// # Safety
    /// AMX available and the tiles configured 16 rows × 64 bytes each ([`TilesInUse`]) on this
    /// thread for as long as the value is used.
    unsafe fn configured() -> OnTiles {
        OnTiles { _configured: () }
    }

    /// The multiplies of [`Kernel::start`] onto tiles 4–7 as they are.
    fn multiply(&mut self, steps: usize, a: Strided, b: Strided) {
        assert!(block_fits(steps, a, b), "AMX block: an operand too short");
        let (a0, b0) = (a.data.as_ptr().wrapping_add(a.at), b.data.as_ptr().wrapping_add(b.at));
        // SAFETY: the tiles are configured (`configured`'s contract); every row the loads read
        // lies inside the operands (asserted above: 32 rows of A, 16 · steps rows of B, 64
        // bytes each from the block's start). The accumulators stay in tiles 4–7, which no
        // compiled code touches, until `store`.
        unsafe {
            std::arch::asm!(
                "test {steps}, {steps}",
                "jz 3f",
                "2:",
                "tileloadd tmm0, [{a0} + {lda}*1]",
                "tileloadd tmm2, [{b0} + {ldb}*1]",
                "tdpbf16ps tmm4, tmm0, tmm2",
                "tileloadd tmm3, [{b1} + {ldb}*1]",
                "tdpbf16ps tmm5, tmm0, tmm3",
                "tileloadd tmm1, [{a1} + {lda}*1]",
                "tdpbf16ps tmm6, tmm1, tmm2",
                "tdpbf16ps tmm7, tmm1, tmm3",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, {bstep}",
                "add {b1}, {bstep}",
                "dec {steps}",
                "jnz 2b",
                "3:",
                a0 = inout(reg) a0 => _,
                a1 = inout(reg) a0.wrapping_add(HALF * a.stride) => _,
                b0 = inout(reg) b0 => _,
                b1 = inout(reg) b0.wrapping_add(HALF) => _,
                lda = in(reg) a.stride * 4,
                ldb = in(reg) b.stride * 4,
                bstep = in(reg) STEP * b.stride * 4,
                steps = inout(reg) steps => _,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack, readonly)
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel for OnTiles {
    fn start(&mut self, steps: usize, a: Strided, b: Strided) {
        // SAFETY: the tiles are configured (`configured`'s contract).
        unsafe {
            std::arch::asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack, nomem)
            );
        }
        self.multiply(steps, a, b);
    }

    fn store(&mut self, c: &mut [f32]) {
        self.store_to(c, 0, BLOCK);
    }

    fn more(&mut self, steps: usize, a: Strided, b: Strided) {
        self.multiply(steps, a, b);
    }

    fn start_from(&mut self, c: &[f32], at: usize, c_rs: usize, steps: usize, a: Strided, b: Strided) {
        assert!(c_block_fits(c, at, c_rs), "AMX block: C too short");
        let c0 = c.as_ptr().wrapping_add(at);
        // SAFETY: the tiles are configured; the four 16 × 16 f32 tiles lie inside `c`'s 32
        // rows of 128 bytes from `at` (asserted above).
        unsafe {
            std::arch::asm!(
                "tileloadd tmm4, [{c0} + {ld}*1]",
                "tileloadd tmm5, [{c0} + {ld}*1 + 64]",
                "tileloadd tmm6, [{c1} + {ld}*1]",
                "tileloadd tmm7, [{c1} + {ld}*1 + 64]",
                c0 = in(reg) c0,
                c1 = in(reg) c0.wrapping_add(HALF * c_rs),
                ld = in(reg) c_rs * 4,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack, readonly)
            );
        }
        self.multiply(steps, a, b);
    }

    fn store_to(&mut self, c: &mut [f32], at: usize, c_rs: usize) {
        assert!(c_block_fits(c, at, c_rs), "AMX block: C too short");
        let c0 = c.as_mut_ptr().wrapping_add(at);
        // SAFETY: the tiles are configured; the four 16 × 16 f32 tiles land inside `c`'s 32
        // rows of 128 bytes from `at` (asserted above).
        unsafe {
            std::arch::asm!(
                "tilestored [{c0} + {ld}*1], tmm4",
                "tilestored [{c0} + {ld}*1 + 64], tmm5",
                "tilestored [{c1} + {ld}*1], tmm6",
                "tilestored [{c1} + {ld}*1 + 64], tmm7",
                c0 = in(reg) c0,
                c1 = in(reg) c0.wrapping_add(HALF * c_rs),
                ld = in(reg) c_rs * 4,
                options(nostack)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::products::{self as mm};
    use super::*;
    use rand::{RngExt, SeedableRng};

    /// Random bf16 pairs of moderate magnitude (exact products; sums rounded in f32).
    fn pairs(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                let lo = half::bf16::from_f32(rng.random_range(-2.0f32..2.0)).to_bits() as u32;
                let hi = half::bf16::from_f32(rng.random_range(-2.0f32..2.0)).to_bits() as u32;
                lo | hi << 16
            })
            .collect()
    }

    fn widen(x: u32, hi: bool) -> f64 {
        f32::from_bits(if hi { x & 0xffff_0000 } else { x << 16 }) as f64
    }

    /// Every epilogue, edge shape (rows and vectors not whole blocks, odd pair steps,
    /// interleaved A rows) and engine against f64: within the f32 rounding of the sums.
    /// Where the processor has the tiles, the tiles and the twin agree bit for bit, and
    /// where it has `vdpbf16ps` the vector products agree to rounding.
    #[test]
    fn products_match_f64_on_every_edge() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(43);
        // (rows, n16, k2, vectors of B, A interleaved)
        for &(rows, n16, k2, bv, interleaved) in &[
            (32, 2, 16, 2, false),
            (64, 4, 32, 5, false),
            (45, 3, 40, 3, false),
            (7, 1, 5, 1, false),
            (33, 5, 17, 7, true),
            (128, 4, 128, 5, false),
            (20, 2, 0, 2, false),
        ] {
            let a_rs = if interleaved { 1 } else { k2 + 3 };
            let a_ps = if interleaved { rows } else { 1 };
            let a_data = pairs(&mut rng, if interleaved { k2 * rows } else { rows * a_rs });
            let b_data = pairs(&mut rng, k2 * bv * 16);
            let a = AOperand { data: &a_data, rs: a_rs, ps: a_ps };
            let b = BOperand { data: &b_data, vectors: bv };
            let c_rs = n16 * 16 + 16;
            let want = |r: usize, l: usize| -> f64 {
                (0..k2)
                    .map(|p| {
                        let (x, y) = (a_data[r * a_rs + p * a_ps], b_data[(p * bv) * 16 + l]);
                        widen(x, false) * widen(y, false) + widen(x, true) * widen(y, true)
                    })
                    .sum()
            };
            let magnitude = |r: usize, l: usize| -> f64 {
                (0..k2)
                    .map(|p| {
                        let (x, y) = (a_data[r * a_rs + p * a_ps], b_data[(p * bv) * 16 + l]);
                        (widen(x, false) * widen(y, false)).abs() + (widen(x, true) * widen(y, true)).abs()
                    })
                    .sum()
            };
            let c0: Vec<f32> = (0..rows * c_rs).map(|i| (i % 7) as f32 - 3.0).collect();
            let alpha: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 * 0.01).collect();
            for epi in [Epilogue::Set(0.75), Epilogue::Add, Epilogue::Rescale(&alpha)] {
                let mut outs = Vec::new();
                for engine in [BlockEngine::Twin, BlockEngine::Tiles] {
                    let mut c = c0.clone();
                    let mut scratch = Scratch::default();
                    let ran = product(&mut c, c_rs, rows, n16, a, b, k2, epi, engine, &mut scratch);
                    assert!(engine == BlockEngine::Tiles || ran == BlockEngine::Twin);
                    for r in 0..rows {
                        for l in 0..c_rs {
                            let (got, old) = (c[r * c_rs + l] as f64, c0[r * c_rs + l] as f64);
                            if l >= n16 * 16 {
                                assert_eq!(got, old, "lane {l} past the product written");
                                continue;
                            }
                            let (ab, mag) = (want(r, l), magnitude(r, l));
                            let (expect, scale) = match epi {
                                Epilogue::Set(s) => (s as f64 * ab, s as f64 * mag),
                                Epilogue::Add => (old + ab, old.abs() + mag),
                                Epilogue::Rescale(al) => (al[r] as f64 * old + ab, (al[r] as f64 * old).abs() + mag),
                            };
                            let bound = (2.0 * k2 as f64 + 4.0) * f32::EPSILON as f64 * scale + 1e-30;
                            assert!(
                                (got - expect).abs() <= bound,
                                "{rows}×{n16}×{k2} {engine:?} c[{r}][{l}] = {got}, want {expect} (bound {bound})"
                            );
                        }
                    }
                    outs.push(c);
                }
                let bits = |c: &[f32]| c.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&outs[0]), bits(&outs[1]), "the tiles and the twin differ");
                if matches!(epi, Epilogue::Add) {
                    // The same sums formed in the tiles, C on lines: within the same bound,
                    // the twin and the tiles bit for bit.
                    let mut sums = Vec::new();
                    for engine in [BlockEngine::Twin, BlockEngine::Tiles] {
                        let mut c = Lines::<f32>::zeroed(c0.len());
                        c.copy_from_slice(&c0);
                        accumulate(&mut c, c_rs, rows, n16, a, b, k2, engine, &mut Scratch::default());
                        for r in 0..rows {
                            for l in 0..n16 * 16 {
                                let (got, old) = (c[r * c_rs + l] as f64, c0[r * c_rs + l] as f64);
                                let bound =
                                    (2.0 * k2 as f64 + 4.0) * f32::EPSILON as f64 * (old.abs() + magnitude(r, l));
                                assert!((got - old - want(r, l)).abs() <= bound + 1e-30, "accumulate c[{r}][{l}]");
                            }
                        }
                        sums.push(bits(&c));
                    }
                    assert_eq!(sums[0], sums[1], "the tiles and the twin accumulate differently");
                }
                if mm::bf16_available() {
                    let mut c = c0.clone();
                    mm::product(&mut c, c_rs, rows, n16, a, b, k2, epi, mm::Reach::All);
                    for (x, y) in c.iter().zip(&outs[0]) {
                        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "vdpbf16ps {x} vs tiles {y}");
                    }
                }
            }
        }
    }

    /// A planted mistake in the operands' layout shows: B's steps read one vector off, or
    /// A's rows swapped in a block, change the result far beyond rounding.
    #[test]
    fn a_shifted_operand_is_caught() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (rows, n16, k2) = (32, 2, 16);
        let a_data = pairs(&mut rng, rows * k2);
        let b_data = pairs(&mut rng, (k2 + 1) * 3 * 16);
        let run = |b: BOperand| {
            let mut c = vec![0.0; rows * 32];
            product(
                &mut c,
                32,
                rows,
                n16,
                AOperand { data: &a_data, rs: k2, ps: 1 },
                b,
                k2,
                Epilogue::Set(1.0),
                BlockEngine::Twin,
                &mut Scratch::default(),
            );
            c
        };
        let right = run(BOperand { data: &b_data, vectors: 2 });
        let wrong = run(BOperand { data: &b_data[16..], vectors: 2 });
        assert!(right.iter().zip(&wrong).any(|(x, y)| (x - y).abs() > 0.1));
    }
}
