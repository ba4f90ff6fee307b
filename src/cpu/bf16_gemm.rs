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
//! Kernels are 8 rows × 32 lanes of accumulators (16 registers) with the A pairs broadcast
//! from memory, the shape that runs at the instruction's rate. Callers check
//! [`available`] once; every product checks its operands' bounds before running.

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
    #[cfg(target_arch = "x86_64")]
    for v0 in (0..n16).step_by(2) {
        let nv = (n16 - v0).min(2);
        for r0 in (0..rows).step_by(8) {
            let nr = (rows - r0).min(8);
            let blk = Block {
                a: a.data[r0 * a.rs..].as_ptr(),
                a_rs: a.rs,
                a_ps: a.ps,
                b: b.data[v0 * 16..].as_ptr(),
                b_ps: b.vectors * 16,
                k2,
                c: c[r0 * c_rs + v0 * 16..].as_mut_ptr(),
                c_rs,
            };
            let epi = match epi {
                Epilogue::Rescale(alpha) => Epilogue::Rescale(&alpha[r0..]),
                e => e,
            };
            // SAFETY: the processor has AVX512F and AVX512_BF16 (asserted); the block's
            // rows, steps and lanes lie inside the operands (bounds asserted above: rows
            // r0..r0+nr, steps 0..k2, vectors v0..v0+nv of n16).
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
                run!(1, 2, 3, 4, 5, 6, 7, 8);
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
}

/// `R` rows × `N` vectors of `C` from `k2` steps.
///
/// # Safety
/// AVX512F and AVX512_BF16 present; `a[r·a_rs + p·a_ps]`, `b[p·b_ps .. p·b_ps + 16·N]`,
/// `c[r·c_rs .. r·c_rs + 16·N]` valid for `r < R`, `p < k2`.
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
        for (n, a) in row.iter().enumerate() {
            let cp = x.c.add(r * x.c_rs + n * 16);
            let out = match epi {
                Epilogue::Set(scale) => _mm512_mul_ps(*a, _mm512_set1_ps(scale)),
                Epilogue::Add => _mm512_add_ps(_mm512_loadu_ps(cp), *a),
                Epilogue::Rescale(alpha) => _mm512_fmadd_ps(_mm512_loadu_ps(cp), _mm512_set1_ps(alpha[r]), *a),
            };
            _mm512_storeu_ps(cp, out);
        }
    }
}

/// bf16 bits of `x`, rounded to nearest even (NaN stays NaN).
pub(crate) fn round(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}


/// The pair `(row[2p], row[2p + 1])` of a row of width `d` as A/B operands hold it (zero
/// beyond `d`).
#[inline(always)]
fn pair(row: &[bf16], p: usize) -> u32 {
    let lo = row[2 * p].to_bits() as u32;
    let hi = row.get(2 * p + 1).map_or(0, |x| x.to_bits() as u32);
    lo | (hi << 16)
}

/// A operand of `rows` rows of width `d` (row `r` at `src[r · rs..]`): `dst[r · pairs(d) + p]`
/// holds elements `2p`, `2p + 1` of row `r`, the odd tail padded with zero.
pub(crate) fn pack_row_pairs(src: &[bf16], rows: usize, rs: usize, d: usize, dst: &mut [u32]) {
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

/// `dst = bf16(2^(src − sub))` (the forward's probabilities, exactly 0 where `src − sub <
/// −126`, NaN kept) and the sum of the values before rounding (the normaliser, so that the
/// LSE keeps f32 accuracy): [`super::simd::exp2`] and [`round`] in one pass.
pub(crate) fn exp2_round_row(src: &[f32], sub: f32, dst: &mut [u16]) -> f32 {
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the processor has the instructions; lengths equal (sliced above).
        return unsafe { exp2_round_row_avx512(src, sub, dst) };
    }
    let mut sum = 0.0f32;
    for (o, &x) in dst.iter_mut().zip(src) {
        let y = super::simd::exp2::<false>(x - sub);
        *o = round(y);
        sum += y;
    }
    sum
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
unsafe fn exp2_round_row_avx512(src: &[f32], sub: f32, dst: &mut [u16]) -> f32 {
    use std::arch::x86_64::*;
    let [c1, c2, c3, c4, c5, c6, c7] = super::simd::EXP2_TAYLOR.map(|c| _mm512_set1_ps(c));
    let (lo, hi, zero_below) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0), _mm512_set1_ps(-126.0));
    let subv = _mm512_set1_ps(sub);
    let n = src.len();
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
        let x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), subv);
        // Clamp with x second, so that NaN passes through; split x = k + f, |f| <= 1/2.
        let xc = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
        let f = _mm512_sub_ps(xc, k);
        let mut p = _mm512_fmadd_ps(f, c7, c6);
        for c in [c5, c4, c3, c2, c1] {
            p = _mm512_fmadd_ps(f, p, c);
        }
        p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0));
        let y = _mm512_scalef_ps(p, k);
        // Exactly 0 below 2^-126 (masked entries are -inf).
        let y = _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, zero_below), y);
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(y));
        _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), m, h);
        // Lanes past the end hold 2^(0 − sub): kept out of the sum.
        sum = _mm512_mask_add_ps(sum, m, sum, y);
        i += 16;
    }
    _mm512_reduce_add_ps(sum)
}

/// Rounds `src` to bf16 into `dst` (the backward's dS).
pub(crate) fn round_row(src: &[f32], dst: &mut [u16]) {
    let dst = &mut dst[..src.len()];
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the processor has the instructions; lengths equal (sliced above).
        unsafe { round_row_avx512(src, dst) };
        return;
    }
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = round(x);
    }
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
unsafe fn round_row_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i))));
        _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), m, h);
        i += 16;
    }
}

/// Two f32 rows rounded to bf16 and interleaved into A pairs: `dst[j]` holds `lo[j]` (low
/// half) and `hi[j]` (zero when `hi` is `None`) — rows `2i`, `2i + 1` as the pair steps of
/// an A operand read transposed (`rs = 1`, `ps = dst`'s row length).
pub(crate) fn interleave_rows(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    let dst = &mut dst[..lo.len()];
    if let Some(h) = hi {
        assert_eq!(h.len(), lo.len(), "interleaved rows differ in length");
    }
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the processor has the instructions; lengths equal (checked above).
        unsafe { interleave_rows_avx512(lo, hi, dst) };
        return;
    }
    for (j, o) in dst.iter_mut().enumerate() {
        let h = hi.map_or(0, |h| round(h[j]) as u32);
        *o = round(lo[j]) as u32 | (h << 16);
    }
}

/// # Safety
/// AVX512F and AVX512_BF16 present; `hi` (when given) and `dst` as long as `lo`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
unsafe fn interleave_rows_avx512(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    use std::arch::x86_64::*;
    let n = lo.len();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
        let round16 = |p: *const f32| -> __m512i {
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p)));
            _mm512_cvtepu16_epi32(h)
        };
        let mut pair = round16(lo.as_ptr().add(i));
        if let Some(h) = hi {
            pair = _mm512_or_si512(pair, _mm512_slli_epi32(round16(h.as_ptr().add(i)), 16));
        }
        _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(i).cast(), m, pair);
        i += 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 value of bf16 bits.
    fn widen(x: u16) -> f32 {
        f32::from_bits((x as u32) << 16)
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
            product(&mut s, c_rs, m, vectors(n), aop, bop, pairs(d), Epilogue::Set(0.5));
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
            product(&mut o, o_rs, m, vectors(d), aop, bop, pairs(n), Epilogue::Rescale(&alpha));
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

    /// The transposed read of interleaved rows: `dV = Pᵀ · dO` with P given as f32 rows.
    #[test]
    fn interleaved_rows_give_the_transposed_product() {
        if !available() {
            return;
        }
        let (rows, keys, d) = (7, 21, 18);
        let pf: Vec<f32> = values(rows * keys, 4).iter().map(|x| x.to_f32()).collect();
        let dout = values(rows * d, 5);
        let mut il = vec![0u32; pairs(rows) * keys];
        for ip in 0..pairs(rows) {
            let lo = &pf[2 * ip * keys..][..keys];
            let hi = (2 * ip + 1 < rows).then(|| &pf[(2 * ip + 1) * keys..][..keys]);
            interleave_rows(lo, hi, &mut il[ip * keys..]);
        }
        let mut bs = vec![0u32; pairs(rows) * vectors(d) * 16];
        pack_rows_as_steps(&dout, rows, d, d, vectors(d), &mut bs);
        let c_rs = vectors(d) * 16;
        let mut dv = vec![0.0f32; keys * c_rs];
        let aop = AOperand { data: &il, rs: 1, ps: keys };
        product(
            &mut dv,
            c_rs,
            keys,
            vectors(d),
            aop,
            BOperand { data: &bs, vectors: vectors(d) },
            pairs(rows),
            Epilogue::Add,
        );
        for j in 0..keys {
            for c in 0..d {
                let want: f64 = (0..rows).map(|i| pf[i * keys + j] as f64 * dout[i * d + c].to_f64()).sum();
                assert!((dv[j * c_rs + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
            }
        }
    }

    /// The fused exponential rounds to the same bf16 as `simd::exp2` then rounding, but for
    /// the rare value within an f32 ulp of a rounding boundary; exactly 0 for -inf and below
    /// 2^-126, NaN kept.
    #[test]
    fn fused_exponential_matches_exp2_then_round() {
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
    fn rounding_matches_half_and_stays_in_bounds() {
        let src: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 3.0 + 1e-3).collect();
        let mut dst = vec![0u16; 40];
        round_row(&src, &mut dst);
        for (o, &x) in dst.iter().zip(&src) {
            assert_eq!(*o, bf16::from_f32(x).to_bits());
        }
        assert_eq!(dst[37..], [0, 0, 0]);
    }
}
#[cfg(test)]
mod speed_probe {
    use super::*;
    #[test]
    #[ignore]
    fn probe() {
        let env = |k: &str, d: usize| std::env::var(k).map(|x| x.parse().unwrap()).unwrap_or(d);
        let (m, n, d) = (256usize, 256usize, env("PD", 64));
        let (kv, dv) = (env("KV", vectors(n)), env("DV", vectors(d)));
        let ap = vec![0x3f80_3f80u32; m * pairs(d)];
        let bl = vec![0x3f80_3f80u32; pairs(d) * kv * 16];
        let sr = kv * 16;
        let mut s = vec![0f32; m * sr];
        let pp = vec![0x3f80_3f80u32; m * sr / 2];
        let bs = vec![0x3f80_3f80u32; pairs(n) * dv * 16];
        let mut o = vec![0f32; m * vectors(d) * 16];
        let alpha = vec![1.0f32; m];
        let pt = vec![0x3f80_3f80u32; pairs(m) * sr];
        let mut dvv = vec![0f32; n * vectors(d) * 16];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            for _ in 0..200 {
                product(
                    &mut s,
                    sr,
                    m,
                    vectors(n),
                    AOperand { data: &ap, rs: pairs(d), ps: 1 },
                    BOperand { data: &bl, vectors: kv },
                    pairs(d),
                    Epilogue::Set(1.0),
                );
            }
            let ts = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            for _ in 0..200 {
                product(
                    &mut o,
                    vectors(d) * 16,
                    m,
                    vectors(d),
                    AOperand { data: &pp, rs: sr / 2, ps: 1 },
                    BOperand { data: &bs, vectors: dv },
                    pairs(n),
                    Epilogue::Rescale(&alpha),
                );
            }
            let tp = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            for _ in 0..200 {
                product(
                    &mut dvv,
                    vectors(d) * 16,
                    n,
                    vectors(d),
                    AOperand { data: &pt, rs: 1, ps: sr },
                    BOperand { data: &bs, vectors: dv },
                    pairs(m),
                    Epilogue::Add,
                );
            }
            let tt = t.elapsed().as_secs_f64();
            let f = 2.0 * (m * n * d * 200) as f64;
            println!("S {:.1}  PV {:.1}  PtdO {:.1} GFLOP/s", f / ts / 1e9, f / tp / 1e9, f / tt / 1e9);
        }
    }
}
