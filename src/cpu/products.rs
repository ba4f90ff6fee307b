//! Matrix products with f32 accumulation on AVX-512, and the packings they read: bf16
//! operands on AVX512_BF16's `vdpbf16ps` (two bf16 products per f32 lane per instruction) and
//! f32 operands on `vfmadd231ps`.
//!
//! A product `C[rows][16·n16] (op)= A · B` runs over `k2` *steps* of its inner dimension.
//! The operands' [`Element`] says what a step is:
//! - bf16 pairs (`u32`): step `p` multiplies the pair `(A[r][2p], A[r][2p+1])` with the pair
//!   `(B[2p][c], B[2p+1][c])` and adds both products into the f32 lane `c` (`vdpbf16ps`:
//!   bf16 × bf16 products are exact in f32; the two additions round to nearest, denormal
//!   inputs and results count as zero);
//! - `f32`: step `p` adds `A[r][p] · B[p][c]` into lane `c` with one rounding (FMA).
//!
//! Operands:
//! - A ([`AOperand`]): one element per (row, step) at `data[r · rs + p · ps]` — row-major rows
//!   (`ps = 1`), or, for bf16 pairs, two rows interleaved element-wise (`rs = 1`, `ps` = the
//!   row length); a pair holds two bf16, the low half the even element;
//! - B ([`BOperand`]): `vectors` groups of 16 lanes per step, step after step: lane `l` of
//!   vector `v` at step `p` is `data[(p · vectors + v) · 16 + l]`.
//!
//! Kernels are 12 rows × 32 lanes of accumulators (24 of the 32 vector registers) with the
//! A elements broadcast from memory: on the 2-vCPU AVX-512 EPYC this project measures on, 12 × 2
//! vectors ran the bf16 products up to 10% faster than 8 × 2 (one thread, best of 7 runs;
//! 8 × 3, 6 × 4 and 16 × 1 no better), and the f32 products of the forward's tiles 3–5%
//! faster than the `gemm` crate's (which packs its operands on every call). On partially
//! masked tiles a [`Reach`] limits each row block to the lanes or steps that hold its visible
//! pairs. Callers check [`Element::available`] once; every product checks its operands'
//! bounds before running.

use half::bf16;

/// The element of a product's operands: `u32` (a pair of bf16) or `f32`.
pub(crate) trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// Elements of the inner dimension one step multiplies (2 for bf16 pairs).
    const PER_STEP: usize;
    /// Whether this processor runs the products on this element.
    fn available() -> bool;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for f32 {}
}

impl Element for u32 {
    const PER_STEP: usize = 2;
    fn available() -> bool {
        bf16_available()
    }
}

impl Element for f32 {
    const PER_STEP: usize = 1;
    fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// Whether this processor runs the bf16 products (AVX512F and AVX512_BF16, with AVX512DQ,
/// AVX512BW and AVX512VL, which every processor with AVX512_BF16 has: the exponentials'
/// `vreduceps`, the row kernels' 16-bit stores).
pub(crate) fn bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `ceil(n / 2)`: pair steps over `n` elements.
pub(crate) fn pairs(n: usize) -> usize {
    n.div_ceil(2)
}

/// `ceil(n / 16)`: 16-lane vectors over `n` elements.
pub(crate) fn vectors(n: usize) -> usize {
    n.div_ceil(16)
}

/// `vectors` made odd (one more when even): the vectors per row or step that buffers are
/// laid out with, so that successive rows and steps, an odd number of cache lines apart,
/// spread over the L1 cache's sets instead of meeting in a few (1 KiB strides alias).
pub(crate) fn odd(vectors: usize) -> usize {
    vectors | 1
}

/// The A operand of a product (see the module docs).
#[derive(Clone, Copy)]
pub(crate) struct AOperand<'a, T = u32> {
    pub data: &'a [T],
    /// Distance between rows, in elements.
    pub rs: usize,
    /// Distance between steps, in elements.
    pub ps: usize,
}

/// The B operand of a product (see the module docs).
#[derive(Clone, Copy)]
pub(crate) struct BOperand<'a, T = u32> {
    pub data: &'a [T],
    /// 16-lane vectors per step.
    pub vectors: usize,
}

/// Rows of a register block: 12 rows × 2 vectors = 24 accumulators of the 32 registers.
/// [`Reach`] ranges are given per block of this many rows.
pub(crate) const BLOCK_ROWS: usize = 12;

/// 16-lane vectors of a register block (a strip of 32 lanes of `C`).
const BLOCK_VECTORS: usize = 2;

/// Which part of a product each block of [`BLOCK_ROWS`] rows computes: on partially masked
/// tiles, the part that holds every visible pair, the rest being exactly zero (P or dS) or
/// masked afterwards (scores).
#[derive(Clone, Copy)]
pub(crate) enum Reach<'a> {
    /// The whole product.
    All,
    /// Row block `i` computes only the 32-lane strips that meet elements `ranges[i]` of C's
    /// rows; its other strips run no step (the epilogue of an empty sum: zeros for
    /// [`Epilogue::Set`], which a caller then masks).
    Lanes(&'a [std::ops::Range<usize>]),
    /// Row block `i` adds only the steps that meet elements `ranges[i]` of the inner
    /// dimension (the others multiply exact zeros).
    Steps(&'a [std::ops::Range<usize>]),
}

impl<'a> Reach<'a> {
    /// [`Reach::Lanes`] over `ranges`, or [`Reach::All`] when there are none (a tile without
    /// a mask).
    pub(crate) fn lanes(ranges: &'a [std::ops::Range<usize>]) -> Self {
        if ranges.is_empty() {
            Reach::All
        } else {
            Reach::Lanes(ranges)
        }
    }

    /// [`Reach::Steps`] over `ranges`, or [`Reach::All`] when there are none.
    pub(crate) fn steps(ranges: &'a [std::ops::Range<usize>]) -> Self {
        if ranges.is_empty() {
            Reach::All
        } else {
            Reach::Steps(ranges)
        }
    }

    /// The steps (of `k2`, each `per_step` elements) that row block `blk` (index) runs on
    /// the strip of vectors from `v0`.
    fn block_steps(self, blk: usize, v0: usize, k2: usize, per_step: usize) -> std::ops::Range<usize> {
        match self {
            Reach::All => 0..k2,
            Reach::Lanes(r) => {
                let r = &r[blk];
                if r.start < r.end && r.start < 16 * (v0 + BLOCK_VECTORS) && r.end > 16 * v0 {
                    0..k2
                } else {
                    0..0
                }
            }
            Reach::Steps(r) => {
                let r = &r[blk];
                if r.start < r.end {
                    (r.start / per_step).min(k2)..r.end.div_ceil(per_step).min(k2)
                } else {
                    0..0
                }
            }
        }
    }
}

/// What a product does with `C`.
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    /// `C = scale · A·B`.
    Set(f32),
    /// `C += A·B`.
    Add,
    /// `C = alpha[r] · C + A·B`: the online softmax's rescale of the output rows.
    Rescale(&'a [f32]),
}

/// What [`product_into`]'s epilogue does besides [`Epilogue::Set`]'s store.
#[derive(Clone, Copy)]
enum SetExtra {
    /// Nothing.
    None,
    /// Running row maxima of the stored values ([`product_max`]).
    Max,
    /// Stores `2^(value − sub[r])` instead, with running maxima of the values and running
    /// sums of the stored exponentials ([`product_exp2`]).
    Exp2,
    /// As `Exp2`, the exponentials stored rounded to bf16 elsewhere than `C`
    /// ([`product_exp2_bf16`]).
    Exp2Bf16,
}

/// `C (op)= A · B` over `k2` steps for `rows` rows and the first `n16` vectors of B;
/// `C` row `r` is `c[r · c_rs..][..16 · n16]`.
///
/// # Panics
/// When an operand is too short for the product, or the processor lacks the element's
/// instructions ([`Element::available`] false: a caller bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product<T: Element>(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<T>,
    b: BOperand<T>,
    k2: usize,
    epi: Epilogue,
    reach: Reach,
) {
    let shape = Shape { c_rs, rows, n16, k2 };
    product_into(c, shape, a, b, epi, reach, Rows::default())
}

/// `C = scale · A·B` as [`product`] with [`Epilogue::Set`] over the whole product, also
/// taking the running maximum of each row of `C` as it is stored: `maxes[r · 16 + l] =
/// max(maxes[r · 16 + l], C[r][16 v + l])` over the row's vectors `v` (the caller reduces
/// the 16 lanes). This spares the softmax a pass over `C`; every lane of the `n16` vectors
/// counts, so `C`'s rows must hold no padding.
///
/// # Panics
/// As [`product`], and when `maxes` holds fewer than `16 · rows` values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_max<T: Element>(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<T>,
    b: BOperand<T>,
    k2: usize,
    scale: f32,
    maxes: &mut [f32],
) {
    let shape = Shape { c_rs, rows, n16, k2 };
    let extra = Rows { maxes: Some(maxes), ..Default::default() };
    product_into(c, shape, a, b, Epilogue::Set(scale), Reach::All, extra)
}

/// The scores' exponentials in the product's epilogue (the forward's probabilities against
/// a running max `sub`): with `x = scale · (A·B)[r][c] − sub[r]` (one rounding), stores
/// `C[r][c] = 2^x` and keeps per row and lane `maxes[r · 16 + l] = max(maxes[r · 16 + l], x)`
/// and `sums[r · 16 + l] += C[r][c]` over the row's vectors (the caller reduces the 16
/// lanes). `2^` is [`super::simd::avx512::exp2_finite`]: a non-finite `x` (from non-finite
/// operands) makes its sum NaN, while its maximum may be lost. As in [`product_max`], every
/// lane of the `n16` vectors counts, so `C`'s rows must hold no padding.
///
/// # Panics
/// As [`product`], and when `sub` holds fewer than `rows` values or `maxes` or `sums` fewer
/// than `16 · rows`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_exp2<T: Element>(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<T>,
    b: BOperand<T>,
    k2: usize,
    scale: f32,
    sub: &[f32],
    maxes: &mut [f32],
    sums: &mut [f32],
) {
    let shape = Shape { c_rs, rows, n16, k2 };
    let extra = Rows { sub: Some(sub), maxes: Some(maxes), sums: Some(sums), probs: None };
    product_into(c, shape, a, b, Epilogue::Set(scale), Reach::All, extra)
}

/// [`product_exp2`] on bf16 pairs with the probabilities stored rounded to bf16 (nearest
/// even) into `p` (row `r` at `p[r · p_rs..][..16 · n16]`, keys in order: the A pairs of the
/// `P·V` product that follows) instead of f32 into a `C`: the bf16 forward's probabilities
/// against a running max `sub`, with `maxes` and `sums` (of the values before rounding, so
/// that the normaliser keeps f32 accuracy) as in [`product_exp2`].
///
/// # Panics
/// As [`product_exp2`], with `p` in place of `C`, and when the processor lacks AVX512_BF16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_exp2_bf16(
    p: &mut [u16],
    p_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand<u32>,
    b: BOperand<u32>,
    k2: usize,
    scale: f32,
    sub: &[f32],
    maxes: &mut [f32],
    sums: &mut [f32],
) {
    let shape = Shape { c_rs: 0, rows, n16, k2 };
    let extra = Rows { sub: Some(sub), maxes: Some(maxes), sums: Some(sums), probs: Some((p, p_rs)) };
    product_into(&mut [], shape, a, b, Epilogue::Set(scale), Reach::All, extra)
}

/// A product's extent: `rows` rows of `C` (stride `c_rs`), `n16` vectors, `k2` steps.
#[derive(Clone, Copy)]
struct Shape {
    c_rs: usize,
    rows: usize,
    n16: usize,
    k2: usize,
}

/// Per-row outputs and inputs of a [`Epilogue::Set`] epilogue (see [`SetExtra`]).
#[derive(Default)]
struct Rows<'a, 'b> {
    sub: Option<&'b [f32]>,
    maxes: Option<&'a mut [f32]>,
    sums: Option<&'a mut [f32]>,
    /// bf16 probabilities stored in place of `C`, with their row stride ([`product_exp2_bf16`]).
    probs: Option<(&'a mut [u16], usize)>,
}

fn product_into<T: Element>(
    c: &mut [f32],
    shape: Shape,
    a: AOperand<T>,
    b: BOperand<T>,
    epi: Epilogue,
    reach: Reach,
    mut rows_io: Rows,
) {
    let Shape { c_rs, rows, n16, k2 } = shape;
    if rows == 0 || n16 == 0 {
        return;
    }
    assert!(T::available(), "products on this element need AVX-512 instructions this processor lacks");
    assert!(n16 <= b.vectors, "product wider than its B operand");
    let probs_rs = rows_io.probs.as_ref().map(|(p, rs)| {
        assert!((rows - 1) * rs + 16 * n16 <= p.len(), "probabilities out of bounds");
        *rs
    });
    if probs_rs.is_none() {
        assert!((rows - 1) * c_rs + 16 * n16 <= c.len(), "product output out of bounds");
    }
    if k2 > 0 {
        assert!((rows - 1) * a.rs + (k2 - 1) * a.ps < a.data.len(), "A operand out of bounds");
        assert!((k2 - 1) * b.vectors * 16 + 16 * n16 <= b.data.len(), "B operand out of bounds");
    }
    if let Epilogue::Rescale(alpha) = epi {
        assert!(alpha.len() >= rows, "rescale factors out of bounds");
    }
    if let Reach::Lanes(r) | Reach::Steps(r) = reach {
        assert!(r.len() >= rows.div_ceil(BLOCK_ROWS), "reach of {} row blocks for {rows} rows", r.len());
    }
    let extra = match (&rows_io.sub, &rows_io.maxes, &rows_io.sums, probs_rs) {
        (None, None, None, None) => SetExtra::None,
        (None, Some(_), None, None) => SetExtra::Max,
        (Some(_), Some(_), Some(_), None) => SetExtra::Exp2,
        (Some(_), Some(_), Some(_), Some(_)) if T::PER_STEP == 2 => SetExtra::Exp2Bf16,
        _ => unreachable!("epilogue rows of no product"),
    };
    if let Some(s) = rows_io.sub {
        assert!(s.len() >= rows, "subtrahends out of bounds");
    }
    for v in [rows_io.maxes.as_deref(), rows_io.sums.as_deref()].into_iter().flatten() {
        assert!(v.len() >= 16 * rows, "row maxima or sums out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    for v0 in (0..n16).step_by(BLOCK_VECTORS) {
        let nv = (n16 - v0).min(BLOCK_VECTORS);
        let mut r0 = 0;
        while r0 < rows {
            // With the whole product in reach, the strip's full row blocks run in one call
            // (one dispatch, the kernel's loop over them); otherwise one block per call.
            let (nr, count) = match reach {
                Reach::All if rows - r0 >= BLOCK_ROWS => (BLOCK_ROWS, (rows - r0) / BLOCK_ROWS),
                _ => ((rows - r0).min(BLOCK_ROWS), 1),
            };
            let steps = reach.block_steps(r0 / BLOCK_ROWS, v0, k2, T::PER_STEP);
            let row_ptr = |v: &mut Option<&mut [f32]>| {
                v.as_deref_mut().map_or(std::ptr::null_mut(), |m| m[r0 * 16..].as_mut_ptr())
            };
            let (c_ptr, p_ptr) = match &mut rows_io.probs {
                Some((p, rs)) => (std::ptr::null_mut(), p[r0 * *rs + v0 * 16..].as_mut_ptr()),
                None => (c[r0 * c_rs + v0 * 16..].as_mut_ptr(), std::ptr::null_mut()),
            };
            let blk = Block {
                a: a.data[r0 * a.rs + steps.start * a.ps..].as_ptr(),
                a_rs: a.rs,
                a_ps: a.ps,
                b: b.data[steps.start * b.vectors * 16 + v0 * 16..].as_ptr(),
                b_ps: b.vectors * 16,
                k2: steps.len(),
                c: c_ptr,
                c_rs,
                p: p_ptr,
                p_rs: probs_rs.unwrap_or(0),
                sub: rows_io.sub.map_or(std::ptr::null(), |s| s[r0..].as_ptr()),
                maxes: row_ptr(&mut rows_io.maxes),
                sums: row_ptr(&mut rows_io.sums),
                count,
            };
            let epi = match epi {
                Epilogue::Rescale(alpha) => Epilogue::Rescale(&alpha[r0..]),
                e => e,
            };
            // SAFETY: the processor has the element's instructions (asserted); the blocks'
            // rows, steps and lanes lie inside the operands (bounds asserted above: rows
            // r0..r0+nr·count ≤ rows, steps within 0..k2, vectors v0..v0+nv of n16; sub one
            // per row, maxes and sums 16 per row). `T` is u32 or f32 (sealed), the pointers'
            // types.
            unsafe {
                macro_rules! run {
                    ($kernel:ident, $e:ident, $($r:literal),*) => {
                        match (nr, nv) {
                            $(($r, 2) => $kernel::<$r, 2, { $e }>(&blk.cast(), epi),
                              ($r, _) => $kernel::<$r, 1, { $e }>(&blk.cast(), epi),)*
                            _ => unreachable!("row block of {nr}"),
                        }
                    };
                }
                // One kernel per extra: the epilogue decides nothing per vector, and the
                // accumulators stay in registers through it.
                match (T::PER_STEP, extra) {
                    (2, SetExtra::None) => run!(block_bf16, EXTRA_NONE, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (2, SetExtra::Max) => run!(block_bf16, EXTRA_MAX, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (2, SetExtra::Exp2) => run!(block_bf16, EXTRA_EXP2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (2, SetExtra::Exp2Bf16) => {
                        run!(block_bf16, EXTRA_EXP2_BF16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
                    }
                    (_, SetExtra::None) => run!(block_f32, EXTRA_NONE, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (_, SetExtra::Max) => run!(block_f32, EXTRA_MAX, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (_, SetExtra::Exp2) => run!(block_f32, EXTRA_EXP2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                    (_, SetExtra::Exp2Bf16) => unreachable!("bf16 probabilities of an f32 product"),
                }
            }
            r0 += nr * count;
        }
    }
}

/// One register block's pointers (see [`block_bf16`]).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Block<T> {
    a: *const T,
    a_rs: usize,
    a_ps: usize,
    b: *const T,
    b_ps: usize,
    k2: usize,
    c: *mut f32,
    c_rs: usize,
    /// The bf16 probabilities in place of `c` ([`SetExtra::Exp2Bf16`]), or null.
    p: *mut u16,
    p_rs: usize,
    /// One subtrahend per row ([`SetExtra::Exp2`]), or null.
    sub: *const f32,
    /// 16 running maxima, sums per row, or null.
    maxes: *mut f32,
    sums: *mut f32,
    /// Consecutive blocks of `R` rows to run (each `R` rows further down every row pointer).
    count: usize,
}

#[cfg(target_arch = "x86_64")]
impl<T> Block<T> {
    /// The block `rows` rows further down (one block of it), with its epilogue.
    #[inline(always)]
    fn down<'e>(&self, rows: usize, epi: Epilogue<'e>) -> (Block<T>, Epilogue<'e>) {
        let epi = match epi {
            Epilogue::Rescale(alpha) => Epilogue::Rescale(&alpha[rows..]),
            e => e,
        };
        let block = Block {
            a: self.a.wrapping_add(rows * self.a_rs),
            c: self.c.wrapping_add(rows * self.c_rs),
            p: self.p.wrapping_add(rows * self.p_rs),
            sub: self.sub.wrapping_add(rows),
            maxes: self.maxes.wrapping_add(16 * rows),
            sums: self.sums.wrapping_add(16 * rows),
            count: 1,
            ..*self
        };
        (block, epi)
    }

    /// The same block with its operand pointers read as `U` (the caller's element type).
    fn cast<U>(&self) -> Block<U> {
        Block {
            a: self.a.cast(),
            a_rs: self.a_rs,
            a_ps: self.a_ps,
            b: self.b.cast(),
            b_ps: self.b_ps,
            k2: self.k2,
            c: self.c,
            c_rs: self.c_rs,
            p: self.p,
            p_rs: self.p_rs,
            sub: self.sub,
            maxes: self.maxes,
            sums: self.sums,
            count: self.count,
        }
    }
}

/// `count` blocks of `R` rows × `N` vectors of `C`, one below the other, from `k2` bf16 pair
/// steps each.
///
/// # Safety
/// AVX512F, AVX512DQ and AVX512_BF16 present; `a[r·a_rs + p·a_ps]`, `b[p·b_ps .. p·b_ps + 16·N]`,
/// `c[r·c_rs .. r·c_rs + 16·N]` valid for `r < R·count`, `p < k2`; `sub` null or valid for
/// `R·count` values, `maxes` and `sums` null or valid for `16·R·count`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn block_bf16<const R: usize, const N: usize, const E: u8>(x0: &Block<u32>, epi0: Epilogue) {
    use std::arch::x86_64::*;
    for blk in 0..x0.count {
        let (block, epi) = x0.down(blk * R, epi0);
        let x = &block;
        if x.k2 == 0 {
            empty_block::<_, R, N, E>(x, epi);
            continue;
        }
        // At least one step: every accumulator is written in registers before the epilogue
        // reads them (no zeroed copy on the stack).
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for p in 0..x.k2 {
            let bp = x.b.add(p * x.b_ps);
            let mut bv = [_mm512_setzero_si512(); N];
            for (n, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(bp.add(n * 16).cast());
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.a.add(r * x.a_rs + p * x.a_ps) as i32));
                for (n, a) in row.iter_mut().enumerate() {
                    *a = _mm512_dpbf16_ps(*a, av, std::mem::transmute::<__m512i, __m512bh>(bv[n]));
                }
            }
        }
        epilogue::<_, R, N, E>(x, epi, &acc);
    }
}

/// `count` blocks of `R` rows × `N` vectors of `C` from `k2` f32 steps each.
///
/// # Safety
/// AVX512F and AVX512DQ present; otherwise as [`block_bf16`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn block_f32<const R: usize, const N: usize, const E: u8>(x0: &Block<f32>, epi0: Epilogue) {
    use std::arch::x86_64::*;
    for blk in 0..x0.count {
        let (block, epi) = x0.down(blk * R, epi0);
        let x = &block;
        if x.k2 == 0 {
            empty_block::<_, R, N, E>(x, epi);
            continue;
        }
        // At least one step: every accumulator is written in registers before the epilogue
        // reads them (no zeroed copy on the stack).
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for p in 0..x.k2 {
            let bp = x.b.add(p * x.b_ps);
            let mut bv = [_mm512_setzero_ps(); N];
            for (n, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(bp.add(n * 16));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*x.a.add(r * x.a_rs + p * x.a_ps));
                for (n, a) in row.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(av, bv[n], *a);
                }
            }
        }
        epilogue::<_, R, N, E>(x, epi, &acc);
    }
}

/// The scale of an [`Epilogue::Set`] (1 otherwise).
#[inline(always)]
fn scale_of(epi: Epilogue) -> f32 {
    match epi {
        Epilogue::Set(scale) => scale,
        _ => 1.0,
    }
}

/// The epilogue of a block with no steps (all products 0): kept out of the kernels, so that
/// their accumulators need no zeroed copy in memory for this case.
///
/// # Safety
/// As [`block_f32`].
#[cfg(target_arch = "x86_64")]
#[cold]
#[inline(never)]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn empty_block<T, const R: usize, const N: usize, const E: u8>(x: &Block<T>, epi: Epilogue) {
    epilogue::<T, R, N, E>(x, epi, &[[std::arch::x86_64::_mm512_setzero_ps(); N]; R]);
}

/// [`SetExtra`] as a constant of the kernels ([`block_bf16`], [`block_f32`], [`epilogue`]).
const EXTRA_NONE: u8 = 0;
const EXTRA_MAX: u8 = 1;
const EXTRA_EXP2: u8 = 2;
const EXTRA_EXP2_BF16: u8 = 3;

/// Stores a register block's accumulators into `C` as `epi` says, with the extra `E`.
///
/// # Safety
/// AVX512F and AVX512DQ present (the callers' target features: this is inlined into them); pointers as
/// in [`block_bf16`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn epilogue<T, const R: usize, const N: usize, const E: u8>(
    x: &Block<T>,
    epi: Epilogue,
    acc: &[[std::arch::x86_64::__m512; N]; R],
) {
    use std::arch::x86_64::*;
    macro_rules! one_row {
        ($r:expr) => {
            if $r < R {
                let r: usize = $r;
                let row = &acc[r];
                // Running maximum and sum over the row's vectors, in registers.
                let (mut row_max, mut row_sum) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_setzero_ps());
                for (n, a) in row.iter().enumerate() {
                    // Null (and not read or written) when the probabilities go to `p`.
                    let cp = x.c.wrapping_add(r * x.c_rs + n * 16);
                    let mut out = match epi {
                        Epilogue::Set(scale) => _mm512_mul_ps(*a, _mm512_set1_ps(scale)),
                        Epilogue::Add => _mm512_add_ps(_mm512_loadu_ps(cp), *a),
                        Epilogue::Rescale(alpha) => _mm512_fmadd_ps(_mm512_loadu_ps(cp), _mm512_set1_ps(alpha[r]), *a),
                    };
                    if E == EXTRA_MAX {
                        row_max = _mm512_max_ps(row_max, out);
                    } else if E == EXTRA_EXP2 || E == EXTRA_EXP2_BF16 {
                        // The shifted score in one rounding; the maxima keep it, not the score.
                        let shifted = _mm512_fmsub_ps(*a, _mm512_set1_ps(scale_of(epi)), _mm512_set1_ps(*x.sub.add(r)));
                        row_max = _mm512_max_ps(row_max, shifted);
                        out = super::simd::avx512::exp2_finite(shifted);
                        row_sum = _mm512_add_ps(row_sum, out);
                    }
                    if E == EXTRA_EXP2_BF16 {
                        // 16 probabilities rounded to bf16, keys in order: 8 A pairs of P·V.
                        let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(out));
                        _mm256_storeu_si256(x.p.add(r * x.p_rs + n * 16).cast(), rounded);
                    } else {
                        _mm512_storeu_ps(cp, out);
                    }
                }
                if E != EXTRA_NONE {
                    let mp = x.maxes.add(r * 16);
                    _mm512_storeu_ps(mp, _mm512_max_ps(_mm512_loadu_ps(mp), row_max));
                }
                if E == EXTRA_EXP2 || E == EXTRA_EXP2_BF16 {
                    let sp = x.sums.add(r * 16);
                    _mm512_storeu_ps(sp, _mm512_add_ps(_mm512_loadu_ps(sp), row_sum));
                }
            }
        };
    }
    if E == EXTRA_EXP2 || E == EXTRA_EXP2_BF16 {
        // The exponentials' constants and temporaries leave too few registers to keep every
        // accumulator through an unrolled epilogue: row by row in a loop.
        for r in 0..R {
            one_row!(r);
        }
        return;
    }
    // Unrolled: the accumulators stay in registers (no copy to the stack and back).
    one_row!(0);
    one_row!(1);
    one_row!(2);
    one_row!(3);
    one_row!(4);
    one_row!(5);
    one_row!(6);
    one_row!(7);
    one_row!(8);
    one_row!(9);
    one_row!(10);
    one_row!(11);
}

/// The pair `(row[2p], row[2p + 1])` of a row of width `d` as A/B operands hold it (zero
/// beyond `d`).
#[inline(always)]
fn pair(row: &[bf16], p: usize) -> u32 {
    let lo = row[2 * p].to_bits() as u32;
    let hi = row.get(2 * p + 1).map_or(0, |x| x.to_bits() as u32);
    lo | (hi << 16)
}

/// Rows of a `[b, s, h, d]` bf16 tensor as A pairs along `d`: the tensor itself when `d`
/// is even and its data 4-byte aligned (no copy), else a packed copy `[b][h][s][pairs(d)]`.
pub(crate) struct RowPairs<'a> {
    data: std::borrow::Cow<'a, [u32]>,
    /// Pairs between rows.
    pub rs: usize,
    shape: [usize; 4],
}

impl<'a> RowPairs<'a> {
    pub(crate) fn new(x: &'a [bf16], shape: [usize; 4]) -> Self {
        let [b, s, h, d] = shape;
        if d % 2 == 0 && cfg!(target_endian = "little") {
            if let Ok(pairs) = bytemuck::try_cast_slice::<bf16, u32>(x) {
                return RowPairs { data: pairs.into(), rs: h * d / 2, shape };
            }
        }
        let dp = pairs(d);
        let mut out = vec![0u32; b * h * s * dp];
        for (bh, dst) in out.chunks_mut((s * dp).max(1)).enumerate().take(b * h) {
            pack_row_pairs(&x[((bh / h) * s * h + bh % h) * d..], s, h * d, d, dst);
        }
        RowPairs { data: out.into(), rs: dp, shape }
    }

    /// The A operand whose row 0 is row `i` of head `hh` in batch `bi`.
    pub(crate) fn at(&self, bi: usize, hh: usize, i: usize) -> AOperand<'_> {
        let [_, s, h, d] = self.shape;
        let at = match self.data {
            std::borrow::Cow::Borrowed(_) => ((bi * s + i) * h + hh) * d / 2,
            std::borrow::Cow::Owned(_) => ((bi * h + hh) * s + i) * pairs(d),
        };
        AOperand { data: &self.data[at..], rs: self.rs, ps: 1 }
    }
}

/// A operand of `rows` rows of width `d` (row `r` at `src[r · rs..]`): `dst[r · pairs(d) + p]`
/// holds elements `2p`, `2p + 1` of row `r`, the odd tail padded with zero.
fn pack_row_pairs(src: &[bf16], rows: usize, rs: usize, d: usize, dst: &mut [u32]) {
    let dp = pairs(d);
    for r in 0..rows {
        let row = &src[r * rs..][..d];
        let out = &mut dst[r * dp..][..dp];
        if cfg!(target_endian = "little") {
            // A pair is the two elements' bytes in order: a copy.
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
            bytes[..2 * d].copy_from_slice(bytemuck::cast_slice(row));
            if d % 2 == 1 {
                out[dp - 1] &= 0xffff;
            }
        } else {
            for (p, o) in out.iter_mut().enumerate() {
                *o = pair(row, p);
            }
        }
    }
}

super::simd::dispatch!(
    /// B operand with the `rows` rows as lanes and their `d` columns as the pair steps (the keys
    /// of `S = Q·Kᵀ`): `vectors ≥ vectors(rows)` vectors per step, pads zero. `dst` must hold
    /// `pairs(d) · vectors · 16` pairs.
    ///
    /// Compiled for the widest vectors the processor has (a call packs every key tile).
    pack_rows_as_lanes => pack_rows_as_lanes_impl(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) -> ()
);

#[inline(always)]
fn pack_rows_as_lanes_impl<const WIDE: bool>(
    src: &[bf16],
    rows: usize,
    rs: usize,
    d: usize,
    vectors: usize,
    dst: &mut [u32],
) {
    assert!(rows <= vectors * 16, "{rows} rows in {vectors} vectors of lanes");
    let lanes = vectors * 16;
    let dst = &mut dst[..pairs(d) * lanes];
    // Sixteen rows at a time: their pairs are read down the rows, written 16 lanes at once.
    for j0 in (0..rows).step_by(16) {
        let n = (rows - j0).min(16);
        let block: [&[bf16]; 16] = std::array::from_fn(|j| if j < n { &src[(j0 + j) * rs..][..d] } else { &[] });
        for (p, out) in dst.chunks_exact_mut(lanes).enumerate() {
            for (o, row) in out[j0..j0 + n].iter_mut().zip(&block) {
                *o = pair(row, p);
            }
        }
    }
    for out in dst.chunks_exact_mut(lanes) {
        out[rows..].fill(0);
    }
}

super::simd::dispatch!(
    /// B operand with the `rows` rows as the pair steps and their `d` columns as lanes (the
    /// values of `O = P·V`): `vectors ≥ vectors(d)` vectors per step, pads zero. `dst` must hold
    /// `pairs(rows) · vectors · 16` pairs.
    ///
    /// Compiled for the widest vectors the processor has (a call packs every key tile).
    pack_rows_as_steps => pack_rows_as_steps_impl(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) -> ()
);

#[inline(always)]
fn pack_rows_as_steps_impl<const WIDE: bool>(
    src: &[bf16],
    rows: usize,
    rs: usize,
    d: usize,
    vectors: usize,
    dst: &mut [u32],
) {
    assert!(d <= vectors * 16, "{d} columns in {vectors} vectors of lanes");
    let lanes = vectors * 16;
    for (i, out) in dst[..pairs(rows) * lanes].chunks_exact_mut(lanes).enumerate() {
        let lo = &src[2 * i * rs..][..d];
        let (body, pad) = out.split_at_mut(d);
        if 2 * i + 1 < rows {
            let hi = &src[(2 * i + 1) * rs..][..d];
            for ((o, a), b) in body.iter_mut().zip(lo).zip(hi) {
                *o = a.to_bits() as u32 | ((b.to_bits() as u32) << 16);
            }
        } else {
            for (o, a) in body.iter_mut().zip(lo) {
                *o = a.to_bits() as u32;
            }
        }
        pad.fill(0);
    }
}

/// Elements whose B operands are packed from rows of a `[b, s, h, d]` tensor of `Src`
/// (bf16 pairs from bf16, f32 from f32).
pub(crate) trait Packing: Element + Default + bytemuck::Pod {
    /// The tensor's element.
    type Src: Copy + Sync;
    /// B operand with the `rows` rows (row `r` at `src[r · rs..][..d]`) as lanes and their
    /// `d` columns as steps (the keys of `S = Q·Kᵀ`): `vectors ≥ vectors(rows)` vectors per
    /// step, pads zero; `dst` holds `steps(d) · vectors · 16` elements.
    fn rows_as_lanes(src: &[Self::Src], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [Self]);
    /// B operand with the `rows` rows as steps and their `d` columns as lanes (the values of
    /// `O = P·V`): `vectors ≥ vectors(d)` vectors per step, pads zero; `dst` holds
    /// `steps(rows) · vectors · 16` elements.
    fn rows_as_steps(src: &[Self::Src], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [Self]);
    /// Whether the `rows` rows (row `r` at `src[r · rs..][..d]`) are all finite.
    fn rows_finite(src: &[Self::Src], rows: usize, rs: usize, d: usize) -> bool;
    /// Whether the inputs of this packing are finite by the precondition of its path (the
    /// bf16 path runs only on finite inputs, checked once per call by `cpu::bf16_finite`),
    /// so that the packing need not check them again.
    const FINITE_INPUTS: bool;
}

/// Steps over `n` elements of the inner dimension.
pub(crate) fn steps<T: Element>(n: usize) -> usize {
    n.div_ceil(T::PER_STEP)
}

impl Packing for u32 {
    type Src = bf16;
    const FINITE_INPUTS: bool = true;
    fn rows_as_lanes(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) {
        pack_rows_as_lanes(src, rows, rs, d, vectors, dst)
    }
    fn rows_as_steps(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) {
        pack_rows_as_steps(src, rows, rs, d, vectors, dst)
    }
    fn rows_finite(src: &[bf16], rows: usize, rs: usize, d: usize) -> bool {
        (0..rows).all(|r| super::bf16_rows::all_finite(&src[r * rs..][..d]))
    }
}

impl Packing for f32 {
    type Src = f32;
    const FINITE_INPUTS: bool = false;
    fn rows_as_lanes(src: &[f32], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [f32]) {
        assert!(rows <= vectors * 16, "{rows} rows in {vectors} vectors of lanes");
        let lanes = vectors * 16;
        let dst = &mut dst[..d * lanes];
        super::simd::transpose(src, rs, dst, lanes, rows, d);
        for out in dst.chunks_exact_mut(lanes) {
            out[rows..].fill(0.0);
        }
    }
    fn rows_as_steps(src: &[f32], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [f32]) {
        assert!(d <= vectors * 16, "{d} columns in {vectors} vectors of lanes");
        let lanes = vectors * 16;
        for (j, out) in dst[..rows * lanes].chunks_exact_mut(lanes).enumerate() {
            let (body, pad) = out.split_at_mut(d);
            body.copy_from_slice(&src[j * rs..][..d]);
            pad.fill(0.0);
        }
    }
    fn rows_finite(src: &[f32], rows: usize, rs: usize, d: usize) -> bool {
        super::tiles::rows_finite(src, 0, rows, d, rs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The bf16 operands of `S[m][n] = A[m][d] · B[n][d]ᵀ`: A as row pairs, B with its rows
    /// as lanes.
    fn score_operands(a: &[bf16], bm: &[bf16], m: usize, n: usize, d: usize) -> (Vec<u32>, Vec<u32>) {
        let mut ap = vec![0u32; m * pairs(d)];
        pack_row_pairs(a, m, d, d, &mut ap);
        let mut bl = vec![0u32; pairs(d) * vectors(n) * 16];
        pack_rows_as_lanes(bm, n, d, d, vectors(n), &mut bl);
        (ap, bl)
    }

    /// Row `i`'s lanes after an exponential epilogue over the shifted scores `x` (f64) that
    /// started from maxima of -inf (1e6 in lane 5 of row 0) and sums of 0.25: each lane's
    /// maximum of its scores and sum of their exponentials on top.
    fn check_lanes(i: usize, x: &[f64], maxes: &[f32], sums: &[f32]) {
        for l in 0..16 {
            let lane = (l..x.len()).step_by(16);
            let want_max = lane.clone().map(|j| x[j]).fold(f64::NEG_INFINITY, f64::max);
            let want_max = if i == 0 && l == 5 { 1e6 } else { want_max };
            let want_sum = 0.25 + lane.map(|j| x[j].exp2()).sum::<f64>();
            let (gm, gs) = (maxes[16 * i + l] as f64, sums[16 * i + l] as f64);
            assert!((gm - want_max).abs() <= 1e-5 * (1.0 + want_max.abs()), "max [{i}][{l}] {gm} vs {want_max}");
            assert!((gs - want_sum).abs() <= 1e-5 * want_sum, "sum [{i}][{l}] {gs} vs {want_sum}");
        }
    }

    /// A small deterministic generator of bf16-representable values.
    fn values(n: usize, seed: u32) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                bf16::from_f32(((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 4.0)
            })
            .collect()
    }

    /// `S = A·Bᵀ` (rows of B as lanes) and `O = A·B` (rows of B as steps) against f64 sums of
    /// the same bf16 values, for shapes with odd widths and every row/vector tail.
    #[test]
    fn products_match_f64_on_every_tail() {
        if !bf16_available() {
            return;
        }
        for &(m, n, d) in &[(1, 1, 1), (3, 17, 5), (8, 32, 64), (13, 47, 80), (19, 64, 33), (37, 33, 20)] {
            let a = values(m * d, 1);
            let bm = values(n * d, 2);
            // S[m][n] = A[m][d] · B[n][d]ᵀ
            let (ap, bl) = score_operands(&a, &bm, m, n, d);
            let c_rs = vectors(n) * 16;
            let mut s = vec![f32::NAN; m * c_rs];
            let aop = AOperand { data: &ap, rs: pairs(d), ps: 1 };
            let bop = BOperand { data: &bl, vectors: vectors(n) };
            product(&mut s, c_rs, m, vectors(n), aop, bop, pairs(d), Epilogue::Set(0.5), Reach::All);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..d).map(|c| a[i * d + c].to_f64() * bm[j * d + c].to_f64()).sum::<f64>() * 0.5;
                    let got = s[i * c_rs + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "S ({m},{n},{d}) [{i}][{j}] {got} vs {want}"
                    );
                }
            }
            // O[m][d] = alpha ∘ O + P[m][n] · B[n][d], P = A restricted to n columns of pairs.
            let p = values(m * n, 3);
            let mut pp = vec![0u32; m * pairs(n)];
            pack_row_pairs(&p, m, n, n, &mut pp);
            let mut bs = vec![0u32; pairs(n) * vectors(d) * 16];
            pack_rows_as_steps(&bm, n, d, d, vectors(d), &mut bs);
            let o_rs = vectors(d) * 16;
            let mut o = vec![1.0f32; m * o_rs];
            let alpha: Vec<f32> = (0..m).map(|i| i as f32 * 0.25).collect();
            let aop = AOperand { data: &pp, rs: pairs(n), ps: 1 };
            let bop = BOperand { data: &bs, vectors: vectors(d) };
            product(&mut o, o_rs, m, vectors(d), aop, bop, pairs(n), Epilogue::Rescale(&alpha), Reach::All);
            for i in 0..m {
                for c in 0..d {
                    let want: f64 =
                        alpha[i] as f64 + (0..n).map(|j| p[i * n + j].to_f64() * bm[j * d + c].to_f64()).sum::<f64>();
                    let got = o[i * o_rs + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "O ({m},{n},{d}) [{i}][{c}] {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A product limited by its reach: with the inner dimension zero outside each row
    /// block's step range, [`Reach::Steps`] gives the whole product's bits; [`Reach::Lanes`]
    /// computes the strips meeting each block's range and writes zeros (Set) elsewhere.
    /// `product_max` stores what `product` stores and the lanes' running maxima: their
    /// maximum is the row's, and maxima already held (from other strips or tiles) are kept.
    #[test]
    fn product_max_takes_row_maxima_as_it_stores() {
        if !bf16_available() {
            return;
        }
        for &(m, n, d) in &[(1, 16, 3), (13, 48, 64), (25, 96, 33)] {
            let (a, bm) = (values(m * d, 4), values(n * d, 5));
            let (ap, bl) = score_operands(&a, &bm, m, n, d);
            let aop = AOperand { data: &ap, rs: pairs(d), ps: 1 };
            let bop = BOperand { data: &bl, vectors: vectors(n) };
            let c_rs = vectors(n) * 16;
            let (mut want, mut got) = (vec![0.0f32; m * c_rs], vec![0.0f32; m * c_rs]);
            product(&mut want, c_rs, m, vectors(n), aop, bop, pairs(d), Epilogue::Set(0.7), Reach::All);
            // Row 0 starts from a maximum above every score: it must stay.
            let mut maxes = vec![f32::NEG_INFINITY; 16 * m];
            maxes[3] = 1e6;
            product_max(&mut got, c_rs, m, vectors(n), aop, bop, pairs(d), 0.7, &mut maxes);
            assert_eq!(got, want);
            for i in 0..m {
                let row_max = want[i * c_rs..][..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lanes_max = maxes[16 * i..][..16].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(lanes_max, if i == 0 { 1e6 } else { row_max }, "row {i} of ({m},{n},{d})");
            }
        }
    }

    /// The f32 products against f64 sums of the same values on every tail: `S = A·Bᵀ` with
    /// B's rows as lanes, `O = alpha ∘ O + P·B` with B's rows as steps, and the exponential
    /// epilogue: `2^(scale·(A·B) − sub)` stored, its per-lane maxima (of the shifted scores)
    /// and sums kept on top of what they held.
    #[test]
    fn f32_products_and_the_exponential_epilogue_match_f64() {
        if !<f32 as Element>::available() {
            return;
        }
        let f32s = |n, seed| values(n, seed).iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        for &(m, n, d) in &[(1, 16, 1), (3, 17, 5), (13, 48, 64), (25, 96, 33), (12, 32, 80)] {
            let (a, bm) = (f32s(m * d, 7), f32s(n * d, 8));
            let mut bl = vec![0f32; d * vectors(n) * 16];
            f32::rows_as_lanes(&bm, n, d, d, vectors(n), &mut bl);
            let c_rs = vectors(n) * 16;
            let aop = AOperand { data: &a[..], rs: d, ps: 1 };
            let bop = BOperand { data: &bl[..], vectors: vectors(n) };
            let dot = |i: usize, j: usize| (0..d).map(|c| a[i * d + c] as f64 * bm[j * d + c] as f64).sum::<f64>();
            let mut s = vec![f32::NAN; m * c_rs];
            product(&mut s, c_rs, m, vectors(n), aop, bop, d, Epilogue::Set(0.5), Reach::All);
            for i in 0..m {
                for j in 0..n {
                    let (got, want) = (s[i * c_rs + j] as f64, 0.5 * dot(i, j));
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "S ({m},{n},{d}) [{i}][{j}] {got} vs {want}"
                    );
                }
            }
            if n % 16 == 0 {
                let sub: Vec<f32> = (0..m).map(|i| i as f32 * 0.1 - 0.5).collect();
                let (mut maxes, mut sums) = (vec![f32::NEG_INFINITY; 16 * m], vec![0.25f32; 16 * m]);
                maxes[5] = 1e6;
                let mut e = vec![f32::NAN; m * c_rs];
                product_exp2(&mut e, c_rs, m, vectors(n), aop, bop, d, 0.5, &sub, &mut maxes, &mut sums);
                for i in 0..m {
                    let x: Vec<f64> = (0..n).map(|j| 0.5 * dot(i, j) - sub[i] as f64).collect();
                    for (j, &xj) in x.iter().enumerate() {
                        let (got, want) = (e[i * c_rs + j] as f64, xj.exp2());
                        assert!((got - want).abs() <= 2e-6 * want, "exp ({m},{n},{d}) [{i}][{j}] {got} vs {want}");
                    }
                    check_lanes(i, &x, &maxes, &sums);
                }
            }
            // O[m][d] = alpha ∘ O + P[m][n] · B[n][d] over n f32 steps.
            let p = f32s(m * n, 9);
            let mut bs = vec![0f32; n * vectors(d) * 16];
            f32::rows_as_steps(&bm, n, d, d, vectors(d), &mut bs);
            let o_rs = vectors(d) * 16;
            let mut o = vec![1.0f32; m * o_rs];
            let alpha: Vec<f32> = (0..m).map(|i| i as f32 * 0.25).collect();
            let pop = AOperand { data: &p[..], rs: n, ps: 1 };
            let bop = BOperand { data: &bs[..], vectors: vectors(d) };
            product(&mut o, o_rs, m, vectors(d), pop, bop, n, Epilogue::Rescale(&alpha), Reach::All);
            for i in 0..m {
                for c in 0..d {
                    let want =
                        alpha[i] as f64 + (0..n).map(|j| p[i * n + j] as f64 * bm[j * d + c] as f64).sum::<f64>();
                    let got = o[i * o_rs + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "O ({m},{n},{d}) [{i}][{c}] {got} vs {want}"
                    );
                }
            }
        }
    }

    /// `product_exp2_bf16` stores `2^(scale·(A·B) − sub)` rounded to bf16 (nearest even) in
    /// `p` at its row stride, writes nothing else of `p`, and keeps the lanes' maxima of the
    /// shifted scores and sums of the unrounded values on top of what they held.
    #[test]
    fn bf16_exponential_epilogue_rounds_into_p() {
        if !bf16_available() {
            return;
        }
        for &(m, n, d) in &[(1, 16, 2), (13, 48, 64), (25, 32, 33)] {
            let (a, bm) = (values(m * d, 17), values(n * d, 18));
            let (ap, bl) = score_operands(&a, &bm, m, n, d);
            let aop = AOperand { data: &ap, rs: pairs(d), ps: 1 };
            let bop = BOperand { data: &bl, vectors: vectors(n) };
            let sub: Vec<f32> = (0..m).map(|i| i as f32 * 0.1 - 0.5).collect();
            let (mut maxes, mut sums) = (vec![f32::NEG_INFINITY; 16 * m], vec![0.25f32; 16 * m]);
            maxes[5] = 1e6;
            // Rows 16 lanes longer than the product: those lanes must keep their sentinel.
            let p_rs = n + 16;
            let mut p = vec![0xffffu16; m * p_rs];
            product_exp2_bf16(&mut p, p_rs, m, vectors(n), aop, bop, pairs(d), 0.5, &sub, &mut maxes, &mut sums);
            let dot = |i: usize, j: usize| (0..d).map(|c| a[i * d + c].to_f64() * bm[j * d + c].to_f64()).sum::<f64>();
            for i in 0..m {
                let x: Vec<f64> = (0..n).map(|j| 0.5 * dot(i, j) - sub[i] as f64).collect();
                for (j, &xj) in x.iter().enumerate() {
                    let (got, want) = (bf16::from_bits(p[i * p_rs + j]).to_f64(), xj.exp2());
                    // Half a bf16 ulp (at most 2^-8 relative) on top of the f32 exponential.
                    assert!(
                        (got - want).abs() <= (2f64.powi(-8) + 2e-6) * want,
                        "P ({m},{n},{d}) [{i}][{j}] {got} vs {want}"
                    );
                }
                assert!(p[i * p_rs + n..][..16].iter().all(|&b| b == 0xffff), "P ({m},{n},{d}) row {i} written past n");
                check_lanes(i, &x, &maxes, &sums);
            }
        }
    }

    #[test]
    fn reach_limits_each_row_block() {
        if !bf16_available() {
            return;
        }
        let (m, n, k) = (29usize, 70usize, 37usize);
        let blocks = m.div_ceil(BLOCK_ROWS);
        let ranges: Vec<std::ops::Range<usize>> = (0..blocks).map(|i| [3..20, 0..0, 17..37][i % 3].clone()).collect();
        let mut a = values(m * k, 5);
        for (r, row) in a.chunks_mut(k).enumerate() {
            let keep = &ranges[r / BLOCK_ROWS];
            // Zero outside the block's range, rounded out to whole pair steps.
            for (c, x) in row.iter_mut().enumerate() {
                if keep.is_empty() || c < keep.start / 2 * 2 || c >= pairs(keep.end) * 2 {
                    *x = bf16::ZERO;
                }
            }
        }
        let bm = values(k * n, 6);
        let mut ap = vec![0u32; m * pairs(k)];
        pack_row_pairs(&a, m, k, k, &mut ap);
        let mut bs = vec![0u32; pairs(k) * vectors(n) * 16];
        pack_rows_as_steps(&bm, k, n, n, vectors(n), &mut bs);
        let c_rs = vectors(n) * 16;
        let aop = AOperand { data: &ap, rs: pairs(k), ps: 1 };
        let bop = BOperand { data: &bs, vectors: vectors(n) };
        let run = |reach| {
            let mut c = vec![7.0f32; m * c_rs];
            product(&mut c, c_rs, m, vectors(n), aop, bop, pairs(k), Epilogue::Set(1.0), reach);
            c
        };
        let full = run(Reach::All);
        assert_eq!(run(Reach::Steps(&ranges)), full);
        let lanes = run(Reach::Lanes(&ranges));
        for r in 0..m {
            let keep = &ranges[r / BLOCK_ROWS];
            for c in 0..vectors(n) * 16 {
                let strip = c / 32 * 32..c / 32 * 32 + 32;
                let met = !keep.is_empty() && keep.start < strip.end && keep.end > strip.start;
                let want = if met { full[r * c_rs + c] } else { 0.0 };
                assert_eq!(lanes[r * c_rs + c], want, "row {r} lane {c}");
            }
        }
    }
}
