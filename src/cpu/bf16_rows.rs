//! Row kernels of the bf16 path (AVX-512): the probabilities and softmax gradients computed
//! from f32 score rows and rounded to bf16 straight into the A operands of
//! [`super::products::product`], one pass per row or pair of rows.
//!
//! `exp2` here is [`super::simd::avx512::exp2`]: [`super::simd::exp2`]'s polynomial with
//! the power of two applied by `vscalefps`, exactly 0 below 2^-126 (masked entries are −inf),
//! NaN kept. Rounding is to
//! nearest even (`vcvtneps2bf16`). Every kernel needs [`super::products::bf16_available`]
//! (asserted), as the bf16 path runs only where it holds.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::products::bf16_available as available;

#[cfg(target_arch = "x86_64")]
use super::simd::avx512::{exp2, lanes};

/// 16 lanes rounded to bf16, packed in 256 bits (one store, no widening).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn round16(x: __m512) -> __m256i {
    // SAFETY: a 256-bit vector reinterpreted as another 256-bit vector.
    unsafe { std::mem::transmute(_mm512_cvtneps_pbh(x)) }
}

/// 16 lanes rounded to bf16, each in the low half of a 32-bit lane.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn round32(x: __m512) -> __m512i {
    _mm512_cvtepu16_epi32(round16(x))
}

super::simd::dispatch!(
    /// Whether every value is finite (exponent bits not all ones), without early exit so that
    /// it vectorises (compiled for the widest vectors the processor has: the bf16 path checks
    /// its inputs on every call).
    all_finite => all_finite_impl(x: &[half::bf16]) -> bool
);

#[inline(always)]
fn all_finite_impl<const WIDE: bool>(x: &[half::bf16]) -> bool {
    x.iter().fold(true, |ok, v| ok & (v.to_bits() & 0x7f80 != 0x7f80))
}

/// `dst = bf16(2^(src − sub))` (the forward's probabilities) and the sum of the values
/// before rounding (the normaliser, so that the LSE keeps f32 accuracy).
pub(crate) fn exp2_round_row(src: &[f32], sub: f32, dst: &mut [u16]) -> f32 {
    assert!(available(), "bf16 row kernels need AVX512_BF16");
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has the instructions (asserted); lengths equal (sliced above).
    unsafe {
        exp2_round_row_avx512(src, sub, dst)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 row kernels on a processor without AVX512_BF16 ({sub})")
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl,avx512bw")]
unsafe fn exp2_round_row_avx512(src: &[f32], sub: f32, dst: &mut [u16]) -> f32 {
    let subv = _mm512_set1_ps(sub);
    let mut sum = _mm512_setzero_ps();
    for i in (0..src.len()).step_by(16) {
        let m = lanes(src.len() - i);
        let y = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), subv));
        _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), m, round16(y));
        // Lanes past the end hold 2^(0 − sub): kept out of the sum.
        sum = _mm512_mask_add_ps(sum, m, sum, y);
    }
    _mm512_reduce_add_ps(sum)
}

/// The three bf16 parts of non-negative (or any) f32 lanes by truncation: `p0` = `x`'s high
/// 16 bits, `p1` those of `x − p0`, `p2 = x − p0 − p1` (whose low 16 bits are zero: `x` has 24
/// significant bits), so that `x = p0 + p1 + p2` exactly; each as f32 lanes that bf16 holds
/// exactly (the bf16 path's split probabilities, [`super::split`]).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) fn truncated_parts(x: __m512) -> [__m512; 3] {
    let high = _mm512_castsi512_ps(_mm512_set1_epi32(0xffff_0000u32 as i32));
    let p0 = _mm512_and_ps(x, high);
    let r = _mm512_sub_ps(x, p0);
    let p1 = _mm512_and_ps(r, high);
    [p0, p1, _mm512_sub_ps(r, p1)]
}

/// [`exp2_round_row`] for the f32 forward on the tiles: `y = 2^(src − sub)` split into its
/// three bf16 parts ([`truncated_parts`]), part `j` at `dst[j · part..][..src.len()]` and zeros
/// from `src.len()` to `part` in each (the padding pairs of a split key tile); returns the sum
/// of `y`.
///
/// # Panics
/// When `part < src.len()` or `dst` is shorter than `3 · part`.
pub(crate) fn exp2_split_row(src: &[f32], sub: f32, dst: &mut [u16], part: usize) -> f32 {
    assert!(available(), "bf16 row kernels need AVX512_BF16");
    assert!(part >= src.len() && dst.len() >= 3 * part, "split P row: {} lanes for parts of {part}", dst.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has the instructions (asserted); lengths checked above.
    unsafe {
        exp2_split_row_avx512(src, sub, &mut dst[..3 * part], part)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 row kernels on a processor without AVX512_BF16 ({sub})")
}

/// # Safety
/// AVX512F, AVX512DQ and AVX512_BF16 present; `part ≥ src.len()`, `dst.len() == 3 · part`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16,avx512vl,avx512bw")]
unsafe fn exp2_split_row_avx512(src: &[f32], sub: f32, dst: &mut [u16], part: usize) -> f32 {
    let subv = _mm512_set1_ps(sub);
    let mut sum = _mm512_setzero_ps();
    for row in dst.chunks_exact_mut(part) {
        row[src.len()..].fill(0);
    }
    for i in (0..src.len()).step_by(16) {
        let m = lanes(src.len() - i);
        let y = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), subv));
        for (j, p) in truncated_parts(y).into_iter().enumerate() {
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(j * part + i).cast(), m, round16(p));
        }
        sum = _mm512_mask_add_ps(sum, m, sum, y);
    }
    _mm512_reduce_add_ps(sum)
}

/// `dst = bf16(scale · src)` (the product rounded to f32 first), rounded to nearest even:
/// the bf16 path's outputs. `dst` at least as long as `src`.
pub(crate) fn round_row_scaled(src: &[f32], scale: f32, dst: &mut [u16]) {
    assert!(available(), "bf16 row kernels need AVX512_BF16");
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has the instructions (asserted); lengths equal (sliced above).
    unsafe {
        round_row_scaled_avx512(src, scale, dst)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 row kernels on a processor without AVX512_BF16 ({scale})")
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl,avx512bw")]
unsafe fn round_row_scaled_avx512(src: &[f32], scale: f32, dst: &mut [u16]) {
    let sv = _mm512_set1_ps(scale);
    for i in (0..src.len()).step_by(16) {
        let m = lanes(src.len() - i);
        let x = round16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), sv));
        _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), m, x);
    }
}

/// The backward's probabilities for query rows `2i` and `2i + 1`: `row = 2^(row − sub)` in
/// place (f32, for dS) for `lo` and, when given, `hi`; the two rows rounded and interleaved
/// into `pairs` (`pairs[j]` = `lo[j]` low half, `hi[j]` or 0 high half): Pᵀ as an A
/// operand read with `rs = 1`.
pub(crate) fn exp2_pairs(lo: &mut [f32], hi: Option<&mut [f32]>, sub: [f32; 2], pairs: &mut [u32]) {
    assert!(available(), "bf16 row kernels need AVX512_BF16");
    let n = lo.len();
    assert!(hi.as_ref().is_none_or(|h| h.len() == n), "paired rows differ in length");
    let pairs = &mut pairs[..n];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has the instructions (asserted); lengths equal (checked above).
    unsafe {
        exp2_pairs_avx512(lo, hi, sub, pairs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 row kernels on a processor without AVX512_BF16 ({sub:?})")
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `hi` (when given) and `pairs` as long as `lo`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
unsafe fn exp2_pairs_avx512(lo: &mut [f32], mut hi: Option<&mut [f32]>, sub: [f32; 2], pairs: &mut [u32]) {
    let (s0, s1) = (_mm512_set1_ps(sub[0]), _mm512_set1_ps(sub[1]));
    for i in (0..lo.len()).step_by(16) {
        let m = lanes(lo.len() - i);
        let at = lo.as_mut_ptr().add(i);
        let y0 = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, at), s0));
        _mm512_mask_storeu_ps(at, m, y0);
        let mut pair = round32(y0);
        if let Some(h) = hi.as_deref_mut() {
            let at = h.as_mut_ptr().add(i);
            let y1 = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, at), s1));
            _mm512_mask_storeu_ps(at, m, y1);
            pair = _mm512_or_si512(pair, _mm512_slli_epi32::<16>(round32(y1)));
        }
        _mm512_mask_storeu_epi32(pairs.as_mut_ptr().add(i).cast(), m, pair);
    }
}

/// One query row's inputs to [`softmax_grad_pairs`]: `P`, `dP`, `D` and where the rounded
/// dS row goes.
pub(crate) struct GradRow<'a> {
    pub p: &'a [f32],
    pub dp: &'a [f32],
    pub d: f32,
    /// The scores' slopes by their products (a soft-cap), multiplied into P first.
    pub slopes: Option<&'a [f32]>,
    pub ds: &'a mut [u16],
}

/// The backward's `dS = P ∘ (dP − D)` (`(P ∘ g) ∘ (dP − D)` with a row's slopes `g`) for query rows `2i` and `2i + 1` (`hi` absent: zero),
/// rounded to bf16 into each row's `ds` (dS as an A operand, pairs along keys) and
/// interleaved into `pairs` (dSᵀ as an A operand read with `rs = 1`).
pub(crate) fn softmax_grad_pairs(lo: GradRow, hi: Option<GradRow>, pairs: &mut [u32]) {
    assert!(available(), "bf16 row kernels need AVX512_BF16");
    let n = lo.p.len();
    let fits =
        |r: &GradRow| r.p.len() == n && r.dp.len() >= n && r.ds.len() >= n && r.slopes.is_none_or(|g| g.len() >= n);
    assert!(fits(&lo) && hi.as_ref().is_none_or(fits), "paired rows differ in length");
    let pairs = &mut pairs[..n];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the processor has the instructions (asserted); lengths checked above.
    unsafe {
        softmax_grad_pairs_avx512(lo, hi, pairs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("bf16 row kernels on a processor without AVX512_BF16 ({})", lo.d)
}

/// # Safety
/// AVX512F and AVX512_BF16 present; every slice of the rows at least as long as `lo.p`,
/// `pairs` as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
unsafe fn softmax_grad_pairs_avx512(lo: GradRow, mut hi: Option<GradRow>, pairs: &mut [u32]) {
    let n = lo.p.len();
    // dS of 16 lanes of a row, rounded and stored into its ds row; returned in low halves.
    let grad = |r: &mut GradRow, i: usize, m: __mmask16| -> __m512i {
        let mut p = _mm512_maskz_loadu_ps(m, r.p.as_ptr().add(i));
        if let Some(g) = r.slopes {
            p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, g.as_ptr().add(i)));
        }
        let dp = _mm512_maskz_loadu_ps(m, r.dp.as_ptr().add(i));
        let ds = round32(_mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_set1_ps(r.d))));
        _mm512_mask_cvtepi32_storeu_epi16(r.ds.as_mut_ptr().add(i).cast(), m, ds);
        ds
    };
    let mut lo = lo;
    for i in (0..n).step_by(16) {
        let m = lanes(n - i);
        let mut pair = grad(&mut lo, i, m);
        if let Some(h) = hi.as_mut() {
            pair = _mm512_or_si512(pair, _mm512_slli_epi32::<16>(grad(h, i, m)));
        }
        _mm512_mask_storeu_epi32(pairs.as_mut_ptr().add(i).cast(), m, pair);
    }
}

#[cfg(test)]
mod tests {
    use super::super::products::{self as mm, AOperand, BOperand, Epilogue};
    use super::*;
    use half::bf16;

    fn round(x: f32) -> u16 {
        bf16::from_f32(x).to_bits()
    }

    fn widen(x: u16) -> f32 {
        f32::from_bits((x as u32) << 16)
    }

    /// The exponential rounds to the same bf16 as `simd::exp2` then rounding, but for the rare
    /// value within an f32 ulp of a rounding boundary; exactly 0 for −inf and below 2^-126,
    /// NaN kept; the sum covers exactly the row, before rounding.
    #[test]
    fn exponential_matches_exp2_then_round() {
        if !available() {
            return;
        }
        let mut src: Vec<f32> = (0..4000).map(|i| -130.0 + i as f32 * 0.0337).collect();
        src.extend([f32::NEG_INFINITY, -126.5, -125.9, 0.0, 1.0, 126.9, f32::NAN]);
        let mut dst = vec![0u16; src.len()];
        let sum = exp2_round_row(&src, 0.5, &mut dst);
        let mut off = 0;
        for (&o, &x) in dst.iter().zip(&src) {
            let want = round(crate::cpu::simd::exp2::<false>(x - 0.5));
            if x.is_nan() {
                assert!(widen(o).is_nan());
            } else if o != want {
                off += 1;
                assert!((o as i32 - want as i32).abs() == 1, "2^({x} - 0.5): {o:#x} vs {want:#x}");
            }
        }
        assert!(off <= 8, "{off} values off by one bf16 ulp");
        assert_eq!(dst[4000], 0);
        assert_eq!(dst[4001], 0);
        assert!(sum.is_nan());
        // Sums of every tail length, from values near 1 (where a stray lane would show).
        for n in 1..40 {
            let row: Vec<f32> = (0..n).map(|i| -(i as f32) * 0.1).collect();
            let s = exp2_round_row(&row, 3.0, &mut dst) as f64;
            let want: f64 = row.iter().map(|&x| 2f64.powf(x as f64 - 3.0)).sum();
            assert!((s - want).abs() <= 1e-6 * want, "n = {n}: {s} vs {want}");
        }
    }

    #[test]
    fn output_rounding_and_finiteness_match_half() {
        if !available() {
            return;
        }
        let src: Vec<f32> = (0..70_001).map(|i| (i as f32 * 0.37).sin() * 3.0e3 + 1e-3).collect();
        // As the drivers store outputs (`tiles::Output`): scaled in f32, then rounded.
        for scale in [1.0f32, 0.37] {
            let mut out = vec![bf16::ZERO; src.len() + 1];
            <bf16 as crate::cpu::tiles::Output>::store(&mut out, &src, scale);
            assert!(out.iter().zip(&src).all(|(o, &x)| *o == bf16::from_f32(x * scale)), "scale {scale}");
            assert_eq!(out[src.len()], bf16::ZERO, "written past the row");
        }
        let mut out = vec![bf16::ZERO; src.len()];
        <bf16 as crate::cpu::tiles::Output>::store(&mut out, &src, 1.0);
        assert!(all_finite(&out));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut v = out.clone();
            v[69_999] = bf16::from_f32(bad);
            assert!(!all_finite(&v));
        }
    }

    /// Row pairs: the f32 results in place, the rounded pairs interleaved, nothing written
    /// past the rows; an absent second row reads as zero.
    #[test]
    fn pair_kernels_match_their_scalar_definitions() {
        if !available() {
            return;
        }
        for n in [1, 15, 16, 37] {
            let row = |k: f32| (0..n).map(|j| ((j as f32 + k) * 0.37).sin() * 3.0).collect::<Vec<f32>>();
            let (mut lo, mut hi) = (row(0.0), row(5.0));
            let (lo0, hi0) = (lo.clone(), hi.clone());
            let mut pairs = vec![7u32; n + 3];
            exp2_pairs(&mut lo, Some(&mut hi), [0.5, -1.0], &mut pairs);
            for j in 0..n {
                let (a, b) = (2f64.powf(lo0[j] as f64 - 0.5), 2f64.powf(hi0[j] as f64 + 1.0));
                assert!((lo[j] as f64 - a).abs() <= 1e-6 * a && (hi[j] as f64 - b).abs() <= 1e-6 * b);
                assert_eq!(pairs[j], round(lo[j]) as u32 | (round(hi[j]) as u32) << 16);
            }
            assert_eq!(pairs[n..], [7, 7, 7]);
            exp2_pairs(&mut lo, None, [0.0, 0.0], &mut pairs);
            assert!((0..n).all(|j| pairs[j] >> 16 == 0));

            let (p0, p1, dp0, dp1) = (row(1.0), row(2.0), row(3.0), row(4.0));
            let g1: Vec<f32> = row(6.0).iter().map(|x| x.abs() * 0.3).collect();
            let (mut ds0, mut ds1) = (vec![9u16; n + 2], vec![9u16; n + 2]);
            let lo = GradRow { p: &p0, dp: &dp0, d: 0.25, slopes: None, ds: &mut ds0 };
            let hi = GradRow { p: &p1, dp: &dp1, d: -0.5, slopes: Some(&g1), ds: &mut ds1 };
            softmax_grad_pairs(lo, Some(hi), &mut pairs);
            for j in 0..n {
                let (a, b) = (round(p0[j] * (dp0[j] - 0.25)), round((p1[j] * g1[j]) * (dp1[j] + 0.5)));
                assert_eq!((ds0[j], ds1[j]), (a, b));
                assert_eq!(pairs[j], a as u32 | (b as u32) << 16);
            }
            assert_eq!((ds0[n..].to_vec(), ds1[n..].to_vec()), (vec![9, 9], vec![9, 9]));
        }
    }

    /// The transposed read of interleaved rows: `dV = Pᵀ · dO` with P from row pairs.
    #[test]
    fn interleaved_rows_give_the_transposed_product() {
        if !available() {
            return;
        }
        let (rows, keys, d) = (7, 21, 18);
        let src: Vec<Vec<f32>> =
            (0..rows).map(|i| (0..keys).map(|j| ((i * keys + j) as f32 * 0.61).cos() * 2.0).collect()).collect();
        let dout: Vec<bf16> = (0..rows * d).map(|x| bf16::from_f32((x as f32 * 0.23).sin())).collect();
        let mut p = src.clone();
        let mut il = vec![0u32; mm::pairs(rows) * keys];
        for (ip, chunk) in p.chunks_mut(2).enumerate() {
            let (lo, hi) = chunk.split_at_mut(1);
            exp2_pairs(&mut lo[0], hi.first_mut().map(|h| &mut h[..]), [0.0; 2], &mut il[ip * keys..]);
        }
        let mut bs = vec![0u32; mm::pairs(rows) * mm::vectors(d) * 16];
        mm::pack_rows_as_steps(&dout, rows, d, d, mm::vectors(d), &mut bs);
        let c_rs = mm::vectors(d) * 16;
        let mut dv = vec![0.0f32; keys * c_rs];
        let aop = AOperand { data: &il, rs: 1, ps: keys };
        let bop = BOperand { data: &bs, vectors: mm::vectors(d) };
        mm::product(&mut dv, c_rs, keys, mm::vectors(d), aop, bop, mm::pairs(rows), Epilogue::Add, mm::Reach::All);
        for j in 0..keys {
            for c in 0..d {
                let want: f64 = (0..rows).map(|i| widen(round(p[i][j])) as f64 * dout[i * d + c].to_f64()).sum();
                assert!((dv[j * c_rs + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
            }
        }
    }
}
