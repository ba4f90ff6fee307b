//! Row-wise elementwise kernels of the online softmax, compiled for AVX-512 and AVX2+FMA
//! and picked at run time (the portable build keeps its baseline target).
//!
//! `exp2` is a degree-6 polynomial on the reduced argument `f ∈ [-0.5, 0.5]` times `2^n`
//! built from the exponent bits: relative error below 1e-7, exactly 0 below 2^-126
//! (so masked entries, `-inf`, give exactly 0), NaN in gives NaN out. The epilogue of the
//! forwards' `Q·Kᵀ` takes a leaner form of it on finite arguments
//! ([`avx512::exp2_finite`]: degree 5, below 2.5e-7, no clamps).

/// `a · b + c`, fused when the caller is compiled with FMA (`FMA = true`).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Coefficients 1…6 of a polynomial for `2^f` on `f ∈ [-0.5, 0.5]` (the constant term is 1),
/// fitted for least maximum relative error (2e-9 in exact arithmetic; 1e-7 evaluated in f32
/// by Horner's rule, as a degree-7 Taylor polynomial gives with one more multiply-add), used
/// by every `exp2` of the crate's CPU paths.
pub(crate) const EXP2_POLY: [f32; 6] =
    [std::f32::consts::LN_2, 0.240_226_48, 0.055_503_324, 0.009_618_437, 0.001_339_887_5, 0.000_153_533_62];

/// Coefficients 1…5 of a degree-5 polynomial for `2^f` on `f ∈ [0, 1]` (the constant term
/// is 1), fitted the same way: 8e-8 in exact arithmetic, 1.4e-7 evaluated in f32 by Horner's
/// rule with fused multiply-adds (about two units in the last place). One multiply-add fewer
/// per 16 lanes than [`EXP2_POLY`] for [`avx512::exp2_finite`] in the epilogue of `Q·Kᵀ`,
/// where the exponentials cost as much as the products; `[0, 1]` because `vreduceps` gives
/// `x − ⌊x⌋` in one instruction and `vscalefps` applies `2^⌊x⌋` itself.
pub(crate) const EXP2_POLY5: [f32; 5] = [0.693_151_3, 0.240_164_46, 0.055_799_857, 0.009_017_113, 0.001_867_091_2];

/// `2^x` for `x <= 128`; see the module docs for accuracy. `FMA` selects fused multiply-adds,
/// which only the dispatchers compiled with the `fma` feature may ask for.
#[inline(always)]
pub(crate) fn exp2<const FMA: bool>(x: f32) -> f32 {
    // Comparisons written so that NaN passes through untouched.
    let xc = if x < -127.0 { -127.0 } else { x };
    let xc = if xc > 127.0 { 127.0 } else { xc };
    // Round to nearest with the 1.5·2^23 trick: exact for |x| < 2^22.
    const MAGIC: f32 = 12_582_912.0;
    let t = xc + MAGIC;
    let n = t - MAGIC;
    let f = xc - n;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let pow = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let [c1, c2, c3, c4, c5, c6] = EXP2_POLY;
    let p = madd::<FMA>(f, c6, c5);
    let p = madd::<FMA>(f, p, c4);
    let p = madd::<FMA>(f, p, c3);
    let p = madd::<FMA>(f, p, c2);
    let p = madd::<FMA>(f, p, c1);
    let p = madd::<FMA>(f, p, 1.0);
    let y = p * pow;
    if x < -126.0 {
        0.0
    } else {
        y
    }
}

/// `row[j] = 2^(row[j] - sub)`.
#[inline(always)]
fn exp2_sub_impl<const FMA: bool>(row: &mut [f32], sub: f32) {
    for x in row.iter_mut() {
        *x = exp2::<FMA>(*x - sub);
    }
}

/// `p[j] = p[j] * (dp[j] - dd)`: the softmax backward `dS = P ∘ (dP − D)`.
#[inline(always)]
fn softmax_grad_impl<const FMA: bool>(p: &mut [f32], dp: &[f32], dd: f32) {
    for (x, &g) in p.iter_mut().zip(dp) {
        *x *= g - dd;
    }
}

/// `p[j] = p[j] * (dp[j] - dd) * slopes[j]`: the softmax backward of capped scores,
/// `dS = P ∘ (dP − D) ∘ g` with `g` the scores' slopes by their products.
#[inline(always)]
fn softmax_grad_sloped_impl<const FMA: bool>(p: &mut [f32], dp: &[f32], dd: f32, slopes: &[f32]) {
    for ((x, &g), &t) in p.iter_mut().zip(dp).zip(slopes) {
        *x = (*x * (g - dd)) * t;
    }
}

/// `row[j] *= a`.
#[inline(always)]
fn scale_impl<const FMA: bool>(row: &mut [f32], a: f32) {
    for x in row.iter_mut() {
        *x *= a;
    }
}

/// `acc[j] += a * x[j]`.
#[inline(always)]
fn axpy_impl<const FMA: bool>(acc: &mut [f32], a: f32, x: &[f32]) {
    for (y, &v) in acc.iter_mut().zip(x) {
        *y += a * v;
    }
}

/// Sum of `a[j] * b[j]` in f32 with 16 lanes.
#[inline(always)]
fn dot_impl<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let ca = a.chunks_exact(L);
    let ra = ca.remainder();
    let cb = b.chunks_exact(L);
    let rb = cb.remainder();
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// `m[i] = max(m[i], x[i])`, NaN-propagating (once NaN, stays NaN).
#[inline(always)]
fn max_into_impl<const FMA: bool>(m: &mut [f32], x: &[f32]) {
    for (a, &v) in m.iter_mut().zip(x) {
        *a = if v > *a || v.is_nan() { v } else { *a };
    }
}

/// The NaN-propagating maximum of `x` (`-inf` when empty), with 16 lanes.
#[inline(always)]
fn row_max_impl<const FMA: bool>(x: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [f32::NEG_INFINITY; L];
    let chunks = x.chunks_exact(L);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] = if c[l] > acc[l] || c[l].is_nan() { c[l] } else { acc[l] };
        }
    }
    acc.iter().chain(rest).fold(f32::NEG_INFINITY, |m, &v| if v > m || v.is_nan() { v } else { m })
}

/// `x[i] = 2^(x[i] − sub[i])` and `sum[i] += x[i]`.
#[inline(always)]
fn exp2_sub_acc_impl<const FMA: bool>(x: &mut [f32], sub: &[f32], sum: &mut [f32]) {
    for ((v, &m), s) in x.iter_mut().zip(sub).zip(sum.iter_mut()) {
        let e = exp2::<FMA>(*v - m);
        *v = e;
        *s += e;
    }
}

/// `x[i] = 2^(x[i] − sub[i])`, `sum[i] += x[i]` and `max[i] = max(max[i], x[i])` taken
/// before the exponential. A NaN in `x` makes its `sum` NaN (what a caller checks); the
/// `max` it leaves is unspecified.
#[inline(always)]
fn exp2_sub_acc_max_impl<const FMA: bool>(x: &mut [f32], sub: &[f32], sum: &mut [f32], max: &mut [f32]) {
    for (((v, &m), s), mx) in x.iter_mut().zip(sub).zip(sum.iter_mut()).zip(max.iter_mut()) {
        let t = *v;
        *mx = if t > *mx { t } else { *mx };
        let e = exp2::<FMA>(t - m);
        *v = e;
        *s += e;
    }
}

/// `dst[c * dst_rs + r] = src[r * src_rs + c]` for `r < rows`, `c < cols`: a transpose in
/// 16 × 16 blocks, so that both sides stay within a few cache lines and pages at a time.
#[inline(always)]
fn transpose_impl<const FMA: bool>(
    src: &[f32],
    src_rs: usize,
    dst: &mut [f32],
    dst_rs: usize,
    rows: usize,
    cols: usize,
) {
    const B: usize = 16;
    if rows == 0 || cols == 0 {
        return;
    }
    assert!((rows - 1) * src_rs + cols <= src.len() && (cols - 1) * dst_rs + rows <= dst.len());
    for r0 in (0..rows).step_by(B) {
        let rn = B.min(rows - r0);
        for c0 in (0..cols).step_by(B) {
            let cn = B.min(cols - c0);
            let mut block = [[0.0f32; B]; B];
            for (r, row) in block.iter_mut().enumerate().take(rn) {
                row[..cn].copy_from_slice(&src[(r0 + r) * src_rs + c0..][..cn]);
            }
            for c in 0..cn {
                let out = &mut dst[(c0 + c) * dst_rs + r0..][..rn];
                for (r, o) in out.iter_mut().enumerate() {
                    *o = block[r][c];
                }
            }
        }
    }
}

/// Defines a public dispatcher that runs `$imp` compiled for the best instruction set the
/// processor has.
macro_rules! dispatch {
    // With a hand-written AVX-512 kernel: that on AVX512F, the generic code elsewhere.
    ($(#[$doc:meta])* $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty, avx512: $fast:path) => {
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the processor has AVX512F, all the kernel is compiled for.
                    return unsafe { $fast($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) -> $ret { $imp::<true>($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the processor has the features the function is compiled for.
                    return unsafe { v3($($arg),*) };
                }
            }
            $imp::<false>($($arg),*)
        }
    };
    ($(#[$doc:meta])* $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty) => {
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) -> $ret { $imp::<true>($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) -> $ret { $imp::<true>($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                {
                    // SAFETY: the processor has the features the function is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { v3($($arg),*) };
                }
            }
            $imp::<false>($($arg),*)
        }
    };
}

pub(crate) use dispatch;

dispatch!(
    /// `row = 2^(row - sub)`.
    exp2_sub => exp2_sub_impl(row: &mut [f32], sub: f32) -> (), avx512: avx512::exp2_sub
);
dispatch!(
    /// `p = p ∘ (dp − dd)`.
    softmax_grad => softmax_grad_impl(p: &mut [f32], dp: &[f32], dd: f32) -> ()
);
dispatch!(
    /// `p = p ∘ (dp − dd) ∘ slopes`.
    softmax_grad_sloped => softmax_grad_sloped_impl(p: &mut [f32], dp: &[f32], dd: f32, slopes: &[f32]) -> ()
);
dispatch!(
    /// `row *= a`.
    scale => scale_impl(row: &mut [f32], a: f32) -> ()
);
dispatch!(
    /// `acc += a · x`.
    axpy => axpy_impl(acc: &mut [f32], a: f32, x: &[f32]) -> ()
);
dispatch!(
    /// Elementwise NaN-propagating maximum into `m`.
    max_into => max_into_impl(m: &mut [f32], x: &[f32]) -> ()
);
dispatch!(
    /// NaN-propagating maximum of a row.
    row_max => row_max_impl(x: &[f32]) -> f32
);
dispatch!(
    /// `x = 2^(x − sub)` elementwise, adding the results into `sum`.
    exp2_sub_acc => exp2_sub_acc_impl(x: &mut [f32], sub: &[f32], sum: &mut [f32]) -> (), avx512: avx512::exp2_sub_acc
);
dispatch!(
    /// [`exp2_sub_acc`] that also takes the elementwise maximum of `x` (before the
    /// exponential) into `max`.
    exp2_sub_acc_max => exp2_sub_acc_max_impl(x: &mut [f32], sub: &[f32], sum: &mut [f32], max: &mut [f32]) -> (),
    avx512: avx512::exp2_sub_acc_max
);

/// The exponential kernels on 16 lanes at a time: [`exp2`]'s polynomial with the power of
/// two applied by `vscalefps` (about half the instructions of the portable code, which the
/// compiler vectorises with integer exponent arithmetic and selects). Same values: exactly 0
/// below 2^-126, NaN kept, the polynomial evaluated in the same order.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// The mask of the first `n` of 16 lanes.
    #[inline(always)]
    pub(crate) fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// `2^x` on 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp2(x: __m512) -> __m512 {
        // Clamp with x second, so that NaN passes through.
        let xc = _mm512_min_ps(_mm512_set1_ps(127.0), _mm512_max_ps(_mm512_set1_ps(-127.0), x));
        exp2_unclamped(xc, x)
    }

    /// `2^x` on 16 lanes of finite `x` (or NaN), for the probabilities in the epilogue of
    /// `Q·Kᵀ` (the lazy tiles of the forwards), where every instruction shows in the product's
    /// rate: `f = x − ⌊x⌋` by `vreduceps`, [`EXP2_POLY5`] on it (relative error below 2.5e-7
    /// where `2^x` is normal), `2^⌊x⌋` applied by `vscalefps` (which floors its exponent
    /// operand itself): no clamps and no masks, gradual underflow below 2^-126 (0 from -150
    /// on), `+inf` from 128 on, NaN kept; `+inf` in gives `+inf`, `-inf` gives 0. The
    /// epilogue's arguments are finite (a non-finite one makes its row's sum non-finite, and
    /// the row is computed again by the exact passes).
    ///
    /// AVX512DQ (`vreduceps`) comes with AVX512F on every processor the fused paths run on
    /// (their checks, [`super::super::products::bf16_available`] and the f32 products', ask
    /// for both).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) fn exp2_finite(x: __m512) -> __m512 {
        let [c1, c2, c3, c4, c5] = super::EXP2_POLY5;
        let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
        let mut p = _mm512_fmadd_ps(f, _mm512_set1_ps(c5), _mm512_set1_ps(c4));
        for c in [c3, c2, c1, 1.0] {
            p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, x)
    }

    /// `2^xc`, exactly 0 where `x < -126`.
    #[inline(always)]
    fn exp2_unclamped(xc: __m512, x: __m512) -> __m512 {
        let [c1, c2, c3, c4, c5, c6] = super::EXP2_POLY;
        // SAFETY: the callers are compiled with AVX512F (this is inlined into them).
        unsafe {
            // Split xc = k + f, |f| <= 1/2.
            let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
            let f = _mm512_sub_ps(xc, k);
            let mut p = _mm512_fmadd_ps(f, _mm512_set1_ps(c6), _mm512_set1_ps(c5));
            for c in [c4, c3, c2, c1, 1.0] {
                p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(c));
            }
            _mm512_maskz_scalef_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-126.0)), p, k)
        }
    }

    /// 16 lanes at `p` (the first `n` when `n < 16`, the others read as 0 and not written):
    /// full vectors by plain loads and stores, masked ones only for a row's tail.
    #[inline(always)]
    unsafe fn load(p: *const f32, n: usize) -> __m512 {
        // SAFETY: the caller's p holds n values (16 when n >= 16).
        unsafe {
            if n >= 16 {
                _mm512_loadu_ps(p)
            } else {
                _mm512_maskz_loadu_ps(lanes(n), p)
            }
        }
    }

    /// See [`load`].
    #[inline(always)]
    unsafe fn store(p: *mut f32, n: usize, v: __m512) {
        // SAFETY: as in load.
        unsafe {
            if n >= 16 {
                _mm512_storeu_ps(p, v)
            } else {
                _mm512_mask_storeu_ps(p, lanes(n), v)
            }
        }
    }

    /// `row = 2^(row − sub)`.
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp2_sub(row: &mut [f32], sub: f32) {
        let s = _mm512_set1_ps(sub);
        let n = row.len();
        for i in (0..n).step_by(16) {
            // SAFETY: lanes beyond n are neither read nor written.
            unsafe {
                let p = row.as_mut_ptr().add(i);
                store(p, n - i, exp2(_mm512_sub_ps(load(p, n - i), s)));
            }
        }
    }

    /// `x = 2^(x − sub)`, `sum += x`, elementwise over the shortest of the three.
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp2_sub_acc(x: &mut [f32], sub: &[f32], sum: &mut [f32]) {
        let n = x.len().min(sub.len()).min(sum.len());
        for i in (0..n).step_by(16) {
            let r = n - i;
            // SAFETY: lanes beyond n are neither read nor written.
            unsafe {
                let (xp, sp, up) = (x.as_mut_ptr().add(i), sum.as_mut_ptr().add(i), sub.as_ptr().add(i));
                let e = exp2(_mm512_sub_ps(load(xp, r), load(up, r)));
                store(xp, r, e);
                store(sp, r, _mm512_add_ps(load(sp, r), e));
            }
        }
    }

    /// `row = 2^(row − sub)`, returning the sum of the new values (summed per lane in
    /// order, then across the lanes).
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp2_sub_sum(row: &mut [f32], sub: f32) -> f32 {
        let (s, n) = (_mm512_set1_ps(sub), row.len());
        let mut sum = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            // SAFETY: lanes beyond n are neither read nor written (load gives them 0 and
            // the mask keeps them out of the sum).
            unsafe {
                let p = row.as_mut_ptr().add(i);
                let e = exp2(_mm512_sub_ps(load(p, n - i), s));
                store(p, n - i, e);
                sum = _mm512_mask_add_ps(sum, lanes(n - i), sum, e);
            }
        }
        _mm512_reduce_add_ps(sum)
    }

    /// `row = 2^(row − sub)`, returning the maximum of `row − sub` before the exponential
    /// (`-inf` for an empty or fully masked row; a NaN may be lost) and the sum of the new
    /// values (NaN when any is): one pass of a lazily rescaled partial tile.
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp2_sub_max_sum(row: &mut [f32], sub: f32) -> (f32, f32) {
        let (s, n) = (_mm512_set1_ps(sub), row.len());
        let (mut sum, mut max) = (_mm512_setzero_ps(), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in (0..n).step_by(16) {
            let m = lanes(n - i);
            // SAFETY: lanes beyond n are neither read nor written (and kept out of the max
            // and the sum by the mask).
            unsafe {
                let p = row.as_mut_ptr().add(i);
                let x = _mm512_sub_ps(load(p, n - i), s);
                max = _mm512_mask_max_ps(max, m, max, x);
                let e = exp2(x);
                store(p, n - i, e);
                sum = _mm512_mask_add_ps(sum, m, sum, e);
            }
        }
        (_mm512_reduce_max_ps(max), _mm512_reduce_add_ps(sum))
    }

    /// The maximum of `maxes` and the sum of `sums` (any order; NaN in a sum makes the total
    /// NaN, NaN in `maxes` may be lost): the forward's check of a lazily rescaled tile.
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn max_and_total(maxes: &[f32], sums: &[f32]) -> (f32, f32) {
        let (mut m, mut t) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_setzero_ps());
        for i in (0..maxes.len()).step_by(16) {
            // SAFETY: lanes beyond the length are read as 0 (load) or -inf (mask).
            m = unsafe {
                _mm512_mask_max_ps(m, lanes(maxes.len() - i), m, load(maxes.as_ptr().add(i), maxes.len() - i))
            };
        }
        for i in (0..sums.len()).step_by(16) {
            // SAFETY: as above (zeros add nothing).
            t = unsafe { _mm512_add_ps(t, load(sums.as_ptr().add(i), sums.len() - i)) };
        }
        (_mm512_reduce_max_ps(m), _mm512_reduce_add_ps(t))
    }

    /// `l[i] += Σ_lanes sums[16 i .. 16 i + 16]` for each `i` of `l` (`sums` holds `16 · l.len()`).
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn add_lane_sums(l: &mut [f32], sums: &[f32]) {
        for (l, row) in l.iter_mut().zip(sums.chunks_exact(16)) {
            // SAFETY: the chunk holds 16 values.
            *l += _mm512_reduce_add_ps(unsafe { _mm512_loadu_ps(row.as_ptr()) });
        }
    }

    /// [`exp2_sub_acc`] that also takes `max = max(max, x)` before the exponential (a NaN
    /// in `x` makes its sum NaN; the max it leaves is unspecified).
    ///
    /// # Safety
    /// The processor has AVX512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp2_sub_acc_max(x: &mut [f32], sub: &[f32], sum: &mut [f32], max: &mut [f32]) {
        let n = x.len().min(sub.len()).min(sum.len()).min(max.len());
        for i in (0..n).step_by(16) {
            let r = n - i;
            // SAFETY: lanes beyond n are neither read nor written.
            unsafe {
                let (xp, sp, up, mp) =
                    (x.as_mut_ptr().add(i), sum.as_mut_ptr().add(i), sub.as_ptr().add(i), max.as_mut_ptr().add(i));
                let t = load(xp, r);
                store(mp, r, _mm512_max_ps(load(mp, r), t));
                let e = exp2(_mm512_sub_ps(t, load(up, r)));
                store(xp, r, e);
                store(sp, r, _mm512_add_ps(load(sp, r), e));
            }
        }
    }
}
dispatch!(
    /// Blocked transpose of a `rows × cols` strided matrix.
    transpose => transpose_impl(src: &[f32], src_rs: usize, dst: &mut [f32], dst_rs: usize, rows: usize, cols: usize) -> ()
);
dispatch!(
    /// Dot product in f32.
    dot => dot_impl(a: &[f32], b: &[f32]) -> f32
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_is_accurate_and_exact_at_the_ends() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x < 127.0 {
            let got = exp2::<false>(x) as f64;
            let want = 2f64.powf(x as f64);
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2e-7, "worst relative error {worst}");
        assert_eq!(exp2::<false>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2::<false>(-200.0), 0.0);
        assert_eq!(exp2::<false>(0.0), 1.0);
        assert!(exp2::<false>(f32::NAN).is_nan());
    }

    #[test]
    fn transpose_matches_naive() {
        let (rows, cols, src_rs, dst_rs) = (37, 21, 25, 40);
        let src: Vec<f32> = (0..rows * src_rs).map(|x| x as f32).collect();
        let mut dst = vec![-1.0f32; cols * dst_rs];
        transpose(&src, src_rs, &mut dst, dst_rs, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(dst[c * dst_rs + r], src[r * src_rs + c]);
            }
        }
        assert_eq!(dst[rows], -1.0);
    }

    #[test]
    fn max_into_propagates_nan() {
        let mut m = vec![f32::NEG_INFINITY; 37];
        let mut x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        max_into(&mut m, &x);
        assert_eq!(m[36], 36.0);
        x[20] = f32::NAN;
        max_into(&mut m, &x);
        assert!(m[20].is_nan());
        max_into(&mut m, &[100.0; 37]);
        assert!(m[20].is_nan() && m[19] == 100.0);
    }

    #[test]
    fn row_max_propagates_nan_from_any_lane() {
        let mut x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin()).collect();
        let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(row_max(&x), want);
        assert_eq!(row_max(&[]), f32::NEG_INFINITY);
        for at in [0, 15, 16, 36] {
            let keep = x[at];
            x[at] = f32::NAN;
            assert!(row_max(&x).is_nan(), "NaN at {at}");
            x[at] = keep;
        }
    }

    #[test]
    fn avx512_exponentials_match_the_portable_code() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut x: Vec<f32> = (-1300..1300).map(|i| i as f32 * 0.1 + 0.013).collect();
        x.extend([f32::NEG_INFINITY, f32::INFINITY, f32::NAN, -126.0, -126.5, -127.5, 127.9, 0.0, -0.0, 0.5, -0.5]);
        let sub: Vec<f32> = (0..x.len()).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect();
        let (mut want, mut got) = (x.clone(), x.clone());
        let (mut want_sum, mut got_sum) = (vec![0.5f32; x.len()], vec![0.5f32; x.len()]);
        exp2_sub_acc_impl::<true>(&mut want, &sub, &mut want_sum);
        let mut got_max = vec![f32::NEG_INFINITY; x.len()];
        // SAFETY: AVX512F checked above.
        unsafe { avx512::exp2_sub_acc_max(&mut got, &sub, &mut got_sum, &mut got_max) };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        assert_eq!(bits(&got_sum), bits(&want_sum));
        for (i, (&m, &t)) in got_max.iter().zip(&x).enumerate() {
            assert!(t.is_nan() || m == t, "max of lane {i}: {m} for {t}");
        }
        for tail in [0, 1, 15, 17, 40] {
            let (mut want, mut got) = (x[..tail].to_vec(), x[..tail].to_vec());
            exp2_sub_impl::<true>(&mut want, 0.75);
            // SAFETY: as above.
            unsafe { avx512::exp2_sub(&mut got, 0.75) };
            assert_eq!(bits(&got), bits(&want), "tail {tail}");
        }
    }

    /// `exp2_finite` within 2.5e-7 of 2^x where that is normal, and one subnormal step more
    /// below (0 from -150 on), `+inf` from 128 on, NaN kept; the lazy tile's checks reduce
    /// every value, tails included.
    #[test]
    fn exp2_finite_and_the_lazy_checks() {
        if !std::arch::is_x86_feature_detected!("avx512f") || !std::arch::is_x86_feature_detected!("avx512dq") {
            return;
        }
        use std::arch::x86_64::*;
        let mut x: Vec<f32> = (-15_000..13_000).map(|i| i as f32 * 0.01 + 0.0013).collect();
        x.extend([f32::NAN, -126.0, -126.5, -127.5, -149.0, -151.0, -1e30, 127.0, 127.9, 128.5, 1e30, 0.0, -0.0]);
        let mut worst = 0.0f64;
        for chunk in x.chunks(16) {
            let mut v = [0.0f32; 16];
            v[..chunk.len()].copy_from_slice(chunk);
            let mut a = [0.0f32; 16];
            // SAFETY: AVX512F checked above; 16 values.
            unsafe { _mm512_storeu_ps(a.as_mut_ptr(), avx512::exp2_finite(_mm512_loadu_ps(v.as_ptr()))) };
            for (&x, &a) in v.iter().zip(&a) {
                let want = (x as f64).exp2();
                if x.is_nan() {
                    assert!(a.is_nan(), "2^NaN: {a}");
                } else if want >= f32::MAX as f64 {
                    assert_eq!(a, f32::INFINITY, "2^{x}");
                } else if want >= f32::MIN_POSITIVE as f64 {
                    worst = worst.max((a as f64 - want).abs() / want);
                } else {
                    let step = f32::from_bits(1) as f64;
                    assert!((a as f64 - want).abs() <= step + 2.5e-7 * want, "2^{x}: {a}");
                }
            }
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        for n in [1usize, 16, 37] {
            let maxes: Vec<f32> = (0..16 * n).map(|i| (i % 23) as f32 - 30.0).collect();
            let sums: Vec<f32> = (0..16 * n).map(|i| (i % 5) as f32).collect();
            // SAFETY: as above.
            let (m, t) = unsafe { avx512::max_and_total(&maxes[..16 * n - 3], &sums) };
            assert_eq!(m, maxes[..16 * n - 3].iter().copied().fold(f32::NEG_INFINITY, f32::max));
            assert_eq!(t, sums.iter().sum::<f32>());
            let mut bad = sums.clone();
            bad[16 * n - 1] = f32::NAN;
            // SAFETY: as above.
            assert!(unsafe { avx512::max_and_total(&maxes, &bad) }.1.is_nan());
            let mut l = vec![1.0f32; n];
            // SAFETY: as above.
            unsafe { avx512::add_lane_sums(&mut l, &sums) };
            for (i, &li) in l.iter().enumerate() {
                assert_eq!(li, 1.0 + sums[16 * i..16 * i + 16].iter().sum::<f32>());
            }
            let mut row: Vec<f32> = (0..16 * n - 5).map(|i| i as f32 * -0.7).collect();
            let want: Vec<f32> = row.iter().map(|&x| exp2::<true>(x - 0.5)).collect();
            // SAFETY: as above.
            let sum = unsafe { avx512::exp2_sub_sum(&mut row, 0.5) };
            assert_eq!(row, want);
            assert!((sum - want.iter().sum::<f32>()).abs() <= 1e-6 * sum);
        }
    }

    #[test]
    fn exp2_sub_acc_matches_scalar() {
        let mut v: Vec<f32> = (0..41).map(|i| -(i as f32) * 0.3).collect();
        let want: Vec<f64> = v.iter().map(|&x| 2f64.powf((x - 1.0) as f64)).collect();
        let mut sum = vec![1.0f32; 41];
        exp2_sub_acc(&mut v, &[1.0; 41], &mut sum);
        for i in 0..41 {
            assert!((v[i] as f64 - want[i]).abs() / want[i] < 2e-7);
            assert!((sum[i] as f64 - 1.0 - want[i]).abs() < 1e-6);
        }
    }
}
