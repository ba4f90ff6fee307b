//! f32 operands as three bf16 parts, so that the bf16 matrix units multiply f32 values to f32
//! accuracy: every finite `x` whose first part does not overflow is `x0 + x1 + x2` exactly
//! (`x0 = bf16(x)`, `x1 = bf16(x − x0)`, `x2 = bf16(x − x0 − x1)`, each difference exact in
//! f32, round to nearest even: 8 + 8 + 8 significant bits cover f32's 24), and a product
//! `x·y` is the six part products of weight `2^-16` and above (`|x1| ≤ 2^-8 |x0|`,
//! `|x2| ≤ 2^-8 |x1|`: the three left out, `x1·y2 + x2·y1 + x2·y2`, are at most about
//! `2^-23 |x0·y0|` together, and of either sign).
//!
//! A dot product `Σ x·y` over `n` terms becomes six bf16 dot products of `n` terms summed in
//! one accumulator: each side's rows hold their three parts side by side (`[x0 | x1 | x2]`,
//! each part padded to whole steps of the tiles) and the products take the parts in the
//! pairs of [`A_PARTS`] and [`B_PARTS`] — `x2·y0, x1·y1, x0·y2, x1·y0, x0·y1, x0·y0`, the small
//! ones first, while the f32 accumulator is small, and the `x0·y0` of every term last
//! ([`super::amx_products::Depth::split`]). Each bf16 pair product
//! is exact in f32 and the tiles round every sum to f32 (the twin: [`super::amx`]), so the
//! result carries the rounding of an f32 dot product in the tiles' order, plus at most about
//! `2^-23 Σ|x·y|` from the split.
//!
//! The tiles flush subnormal bf16 inputs: a part below `2^-126` counts as zero, an absolute
//! error below `2^-126 |y|` per term.

/// The parts of the A side (queries, probabilities) in the six products, in order.
pub(crate) const A_PARTS: [usize; 6] = [2, 1, 0, 1, 0, 0];
/// The parts of the B side (keys, values), paired with [`A_PARTS`] product by product.
pub(crate) const B_PARTS: [usize; 6] = [0, 1, 2, 0, 1, 0];

/// The bits of `bf16(x)`, rounded to nearest even, for `x` not NaN (an `x` at or past bf16's
/// largest finite value's rounding boundary becomes infinity).
#[inline(always)]
pub(crate) fn round_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The bf16 value of `bits` as f32 (exact).
#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `[x0, x1, x2]` of `x` (module documentation), as bits; `x0` is infinite or NaN exactly
/// when `x` cannot be split (not finite, or past bf16's range).
#[inline(always)]
pub(crate) fn split(x: f32) -> [u16; 3] {
    let x0 = round_bits(x);
    let r = x - widen(x0);
    let x1 = round_bits(r);
    let x2 = round_bits(r - widen(x1));
    [x0, x1, x2]
}

/// Whether bf16 `bits` is finite.
#[inline(always)]
fn finite_bits(bits: u16) -> bool {
    bits & 0x7f80 != 0x7f80
}

super::simd::dispatch!(
    /// `p0[i], p1[i], p2[i]` = [`split`]`(x[i])`; whether every value could be split (compiled
    /// for the widest vectors the processor has: every f32 forward on the tiles splits its
    /// inputs).
    split_row => split_row_impl(x: &[f32], p0: &mut [u16], p1: &mut [u16], p2: &mut [u16]) -> bool
);

#[inline(always)]
fn split_row_impl<const WIDE: bool>(x: &[f32], p0: &mut [u16], p1: &mut [u16], p2: &mut [u16]) -> bool {
    let n = x.len();
    let (p0, p1, p2) = (&mut p0[..n], &mut p1[..n], &mut p2[..n]);
    let mut fine = true;
    for i in 0..n {
        let s = split(x[i]);
        (p0[i], p1[i], p2[i]) = (s[0], s[1], s[2]);
        fine &= finite_bits(s[0]);
    }
    fine
}

/// Asks the memory for `x[at..at + n]` ahead of its use (nothing past `x`'s end).
#[inline(always)]
pub(crate) fn prefetch_row(x: &[f32], at: usize, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if at + n <= x.len() {
        for i in (0..n).step_by(16) {
            // SAFETY: a prefetch reads nothing architecturally; the address lies inside `x`.
            unsafe { std::arch::x86_64::_mm_prefetch(x.as_ptr().add(at + i).cast(), std::arch::x86_64::_MM_HINT_T0) };
        }
    }
}

/// Rows ahead whose values [`split_rows`] asks the memory for: rows of K and V lie `h_kv · d`
/// apart, a stride that leaves each row's read waiting on memory.
const PREFETCH_ROWS: usize = 8;

/// `rows` rows of `d` values (row `r` at `src[r · rs..]`) split into their bf16 parts: row
/// `r` of `dst` is `[x0 | x1 | x2]`, each part `width` values (zero after `d`). Whether every
/// value could be split.
pub(crate) fn split_rows(src: &[f32], rows: usize, rs: usize, d: usize, width: usize, dst: &mut [half::bf16]) -> bool {
    let mut fine = true;
    for (r, out) in dst.chunks_exact_mut(3 * width).take(rows).enumerate() {
        prefetch_row(src, (r + PREFETCH_ROWS) * rs, d);
        let bits: &mut [u16] = bytemuck::cast_slice_mut(out);
        let (p0, rest) = bits.split_at_mut(width);
        let (p1, p2) = rest.split_at_mut(width);
        fine &= split_row(&src[r * rs..][..d], p0, p1, p2);
        if width > d {
            for part in [p0, p1, p2] {
                part[d..].fill(0);
            }
        }
    }
    fine
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every finite f32 within bf16's range is its three parts' sum exactly.
        #[test]
        fn three_parts_sum_to_the_value(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            let s = split(x);
            if finite_bits(s[0]) {
                // (Below 2^-110 the last part may fall under bf16's subnormals' precision.)
                let sum = widen(s[0]) as f64 + widen(s[1]) as f64 + widen(s[2]) as f64;
                if x.abs() >= 2f32.powi(-100) {
                    prop_assert_eq!(sum, x as f64);
                    // Each part at most half an ulp of the one before it.
                    prop_assert!(widen(s[1]).abs() <= widen(s[0]).abs() * 2f32.powi(-8));
                    prop_assert!(widen(s[2]).abs() <= widen(s[1]).abs() * 2f32.powi(-8));
                } else {
                    prop_assert!((sum - x as f64).abs() <= 2f64.powi(-126));
                }
            } else {
                prop_assert!(!x.is_finite() || x.abs() > 3.38e38);
            }
        }
    }

    /// The six part products pair as the module says, and their sum is the f32 product
    /// within 2^-24 of it.
    #[test]
    fn the_six_products_are_the_product() {
        let (x, y) = (1.234_567_8f32, -0.987_654_3f32);
        let (sx, sy) = (split(x), split(y));
        let terms: Vec<f64> =
            A_PARTS.iter().zip(B_PARTS).map(|(&a, b)| widen(sx[a]) as f64 * widen(sy[b]) as f64).collect();
        // Small terms first.
        assert!(terms[0].abs() < terms[3].abs() && terms[3].abs() < terms[5].abs());
        let exact = x as f64 * y as f64;
        assert!((terms.iter().sum::<f64>() - exact).abs() <= 2f64.powi(-24) * exact.abs());
        let pairs: Vec<(usize, usize)> = A_PARTS.iter().copied().zip(B_PARTS).collect();
        for a in 0..3 {
            for b in 0..3 {
                assert_eq!(pairs.contains(&(a, b)), a + b <= 2, "the part pair ({a}, {b})");
            }
        }
    }

    #[test]
    fn rows_split_into_parts_and_refuse_what_cannot_split() {
        let x = [1.0f32 + 2f32.powi(-10) + 2f32.powi(-20), 3.0, -0.5, 7.25, 1e-3];
        let (mut p0, mut p1, mut p2) = ([0u16; 5], [0u16; 5], [0u16; 5]);
        assert!(split_row(&x, &mut p0, &mut p1, &mut p2));
        for (i, &v) in x.iter().enumerate() {
            assert_eq!([p0[i], p1[i], p2[i]], split(v), "value {i}");
        }
        assert_eq!((widen(p0[3]), p1[3], p2[3]), (7.25, 0, 0));
        for bad in [f32::NAN, f32::INFINITY, f32::MAX, -3.4e38] {
            assert!(!split_row(&[1.0, bad], &mut p0, &mut p1, &mut p2), "{bad}");
        }
        assert!(split_row(&[3.0e38, -3.0e38, 0.0, 1e-40], &mut p0, &mut p1, &mut p2));
    }
}
