//! Matrix products on bf16 operands with f32 accumulation, on AVX512_BF16's `vdpbf16ps`
//! (two bf16 products per f32 lane per instruction), and the packings they read.
//!
//! A product `C[rows][16·n16] (op)= A · B` runs over `k2` *pair steps*: step `p` multiplies
//! the pair `(A[r][2p], A[r][2p+1])` with the pair `(B[2p][c], B[2p+1][c])` and adds both
//! products into the f32 lane `c` (`vdpbf16ps`: bf16 × bf16 products are exact in f32; the
//! two additions round to nearest, denormal inputs and results count as zero).
//!
//! Operands:
//! - A ([`AOperand`]): one `u32` per (row, step) holding the pair as two bf16 (low half the
//!   even element), at `data[r · rs + p · ps]` — row-major rows with pairs along the row
//!   (`ps = 1`), or two rows interleaved element-wise (`rs = 1`, `ps` = the row length);
//! - B ([`BOperand`]): `vectors` groups of 16 lanes per step, step after step, one `u32`
//!   pair per lane: element `(2p + e, 16·v + l)` is half `e` of `data[(p · vectors + v) · 16 + l]`.
//!
//! Kernels are 12 rows × 32 lanes of accumulators (24 of the 32 vector registers) with the
//! A pairs broadcast from memory: on the 2-vCPU AVX-512 EPYC this project measures on, 12 × 2
//! vectors ran the products up to 10% faster than 8 × 2 (one thread, best of 7 runs; 8 × 3,
//! 6 × 4 and 16 × 1 no better). On partially masked tiles a [`Reach`] limits each row block to the
//! lanes or steps that hold its visible pairs. Callers check [`available`] once; every
//! product checks its operands' bounds before running.

use half::bf16;

/// Whether this processor runs the bf16 products (AVX512F and AVX512_BF16).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
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
pub(crate) struct AOperand<'a> {
    pub data: &'a [u32],
    /// Distance between rows, in pairs.
    pub rs: usize,
    /// Distance between steps, in pairs.
    pub ps: usize,
}

/// The B operand of a product (see the module docs).
#[derive(Clone, Copy)]
pub(crate) struct BOperand<'a> {
    pub data: &'a [u32],
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
    /// Row block `i` adds only the pair steps that meet elements `ranges[i]` of the inner
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

    /// The steps (of `k2`) that row block `blk` (index) runs on the strip of vectors from `v0`.
    fn block_steps(self, blk: usize, v0: usize, k2: usize) -> std::ops::Range<usize> {
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
                    (r.start / 2).min(k2)..pairs(r.end).min(k2)
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

/// `C (op)= A · B` over `k2` pair steps for `rows` rows and the first `n16` vectors of B;
/// `C` row `r` is `c[r · c_rs..][..16 · n16]`.
///
/// # Panics
/// When an operand is too short for the product, or [`available`] is false (a caller bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand,
    b: BOperand,
    k2: usize,
    epi: Epilogue,
    reach: Reach,
) {
    product_into(c, c_rs, rows, n16, a, b, k2, epi, reach, None)
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
pub(crate) fn product_max(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand,
    b: BOperand,
    k2: usize,
    scale: f32,
    maxes: &mut [f32],
) {
    assert!(maxes.len() >= 16 * rows, "row maxima out of bounds");
    product_into(c, c_rs, rows, n16, a, b, k2, Epilogue::Set(scale), Reach::All, Some(maxes))
}

#[allow(clippy::too_many_arguments)]
fn product_into(
    c: &mut [f32],
    c_rs: usize,
    rows: usize,
    n16: usize,
    a: AOperand,
    b: BOperand,
    k2: usize,
    epi: Epilogue,
    reach: Reach,
    mut maxes: Option<&mut [f32]>,
) {
    if rows == 0 || n16 == 0 {
        return;
    }
    assert!(available(), "bf16 products need AVX512_BF16");
    assert!(n16 <= b.vectors, "product wider than its B operand");
    assert!((rows - 1) * c_rs + 16 * n16 <= c.len(), "product output out of bounds");
    if k2 > 0 {
        assert!((rows - 1) * a.rs + (k2 - 1) * a.ps < a.data.len(), "A operand out of bounds");
        assert!(k2 * b.vectors * 16 <= b.data.len(), "B operand out of bounds");
    }
    if let Epilogue::Rescale(alpha) = epi {
        assert!(alpha.len() >= rows, "rescale factors out of bounds");
    }
    if let Reach::Lanes(r) | Reach::Steps(r) = reach {
        assert!(r.len() >= rows.div_ceil(BLOCK_ROWS), "reach of {} row blocks for {rows} rows", r.len());
    }
    #[cfg(target_arch = "x86_64")]
    for v0 in (0..n16).step_by(BLOCK_VECTORS) {
        let nv = (n16 - v0).min(BLOCK_VECTORS);
        for r0 in (0..rows).step_by(BLOCK_ROWS) {
            let nr = (rows - r0).min(BLOCK_ROWS);
            let steps = reach.block_steps(r0 / BLOCK_ROWS, v0, k2);
            let blk = Block {
                a: a.data[r0 * a.rs + steps.start * a.ps..].as_ptr(),
                a_rs: a.rs,
                a_ps: a.ps,
                b: b.data[steps.start * b.vectors * 16 + v0 * 16..].as_ptr(),
                b_ps: b.vectors * 16,
                k2: steps.len(),
                c: c[r0 * c_rs + v0 * 16..].as_mut_ptr(),
                c_rs,
                maxes: maxes.as_deref_mut().map_or(std::ptr::null_mut(), |m| m[r0 * 16..].as_mut_ptr()),
            };
            let epi = match epi {
                Epilogue::Rescale(alpha) => Epilogue::Rescale(&alpha[r0..]),
                e => e,
            };
            // SAFETY: the processor has AVX512F and AVX512_BF16 (asserted); the block's
            // rows, steps and lanes lie inside the operands (bounds asserted above: rows
            // r0..r0+nr, steps within 0..k2, vectors v0..v0+nv of n16; maxes 16 per row).
            unsafe {
                macro_rules! run {
                    ($($r:literal),*) => {
                        match (nr, nv) {
                            $(($r, 2) => block::<$r, 2>(&blk, epi),
                              ($r, _) => block::<$r, 1>(&blk, epi),)*
                            _ => unreachable!("row block of {nr}"),
                        }
                    };
                }
                run!(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12);
            }
        }
    }
}

/// One register block's pointers (see [`block`]).
#[cfg(target_arch = "x86_64")]
struct Block {
    a: *const u32,
    a_rs: usize,
    a_ps: usize,
    b: *const u32,
    b_ps: usize,
    k2: usize,
    c: *mut f32,
    c_rs: usize,
    /// 16 running maxima per row (`Epilogue::Set` only), or null.
    maxes: *mut f32,
}

/// `R` rows × `N` vectors of `C` from `k2` steps.
///
/// # Safety
/// AVX512F and AVX512_BF16 present; `a[r·a_rs + p·a_ps]`, `b[p·b_ps .. p·b_ps + 16·N]`,
/// `c[r·c_rs .. r·c_rs + 16·N]` valid for `r < R`, `p < k2`; `maxes` null or valid for
/// `16·R` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block<const R: usize, const N: usize>(x: &Block, epi: Epilogue) {
    use std::arch::x86_64::*;
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
    for (r, row) in acc.iter().enumerate() {
        let mut out = [_mm512_setzero_ps(); N];
        for (n, a) in row.iter().enumerate() {
            let cp = x.c.add(r * x.c_rs + n * 16);
            out[n] = match epi {
                Epilogue::Set(scale) => _mm512_mul_ps(*a, _mm512_set1_ps(scale)),
                Epilogue::Add => _mm512_add_ps(_mm512_loadu_ps(cp), *a),
                Epilogue::Rescale(alpha) => _mm512_fmadd_ps(_mm512_loadu_ps(cp), _mm512_set1_ps(alpha[r]), *a),
            };
            _mm512_storeu_ps(cp, out[n]);
        }
        if !x.maxes.is_null() {
            let mp = x.maxes.add(r * 16);
            let row_max = out.iter().fold(_mm512_loadu_ps(mp), |m, &o| _mm512_max_ps(m, o));
            _mm512_storeu_ps(mp, row_max);
        }
    }
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

/// B operand with the `rows` rows as lanes and their `d` columns as the pair steps (the keys
/// of `S = Q·Kᵀ`): `vectors ≥ vectors(rows)` vectors per step, pads zero. `dst` must hold
/// `pairs(d) · vectors · 16` pairs.
pub(crate) fn pack_rows_as_lanes(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) {
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

/// B operand with the `rows` rows as the pair steps and their `d` columns as lanes (the
/// values of `O = P·V`): `vectors ≥ vectors(d)` vectors per step, pads zero. `dst` must hold
/// `pairs(rows) · vectors · 16` pairs.
pub(crate) fn pack_rows_as_steps(src: &[bf16], rows: usize, rs: usize, d: usize, vectors: usize, dst: &mut [u32]) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        if !available() {
            return;
        }
        for &(m, n, d) in &[(1, 1, 1), (3, 17, 5), (8, 32, 64), (13, 47, 80), (19, 64, 33)] {
            let a = values(m * d, 1);
            let bm = values(n * d, 2);
            let mut ap = vec![0u32; m * pairs(d)];
            pack_row_pairs(&a, m, d, d, &mut ap);
            // S[m][n] = A[m][d] · B[n][d]ᵀ
            let mut bl = vec![0u32; pairs(d) * vectors(n) * 16];
            pack_rows_as_lanes(&bm, n, d, d, vectors(n), &mut bl);
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
        if !available() {
            return;
        }
        for &(m, n, d) in &[(1, 16, 3), (13, 48, 64), (25, 96, 33)] {
            let (a, bm) = (values(m * d, 4), values(n * d, 5));
            let mut ap = vec![0u32; m * pairs(d)];
            pack_row_pairs(&a, m, d, d, &mut ap);
            let mut bl = vec![0u32; pairs(d) * vectors(n) * 16];
            pack_rows_as_lanes(&bm, n, d, d, vectors(n), &mut bl);
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

    #[test]
    fn reach_limits_each_row_block() {
        if !available() {
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
