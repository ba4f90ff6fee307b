//! How the CPU's paths turn products `q·k` into the scores their softmax takes: the one
//! place that knows the score options of [`ScoreSpec`] (a new one changes this file, not
//! the paths).
//!
//! Every path works in log2 units (its exponentials are `2^x`). A path forms a tile's
//! products with [`Scores::factor`] (a product epilogue's scale, or `matmul`'s alpha), then
//! maps each row with [`Scores::finish_row`] — nothing without a soft-cap — *before* it
//! masks the tile (masked entries are set afterwards, so a cap never reaches them). The
//! backward finishes its rows with the scores' slopes ([`Scores::finish_row_with_slopes`]) before it
//! turns them into probabilities and multiplies the probabilities by them in `dS = P ∘ g ∘ (dP − D)`.
//! A path with a fused score epilogue runs it only when [`Scores::fused`] (plain scores).

use crate::attention::ScoreSpec;

/// The scores of a call, in log2 units: `c · dot` with `c = scale · log2(e)`, or with a
/// soft-cap `cap` (natural units) `cap2 · tanh(dot · scale / cap)` with `cap2 = cap · log2(e)`
/// (the capped natural score `cap · tanh(scale · dot / cap)` times `log2(e)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scores {
    /// The products' factor: `c`, or `scale / cap` under a cap.
    factor: f32,
    /// `cap2`, under a cap.
    cap2: Option<f32>,
}

impl Scores {
    pub(crate) fn of(spec: &ScoreSpec) -> Scores {
        match spec.softcap {
            None => Scores { factor: spec.scale * std::f32::consts::LOG2_E, cap2: None },
            Some(cap) => Scores { factor: spec.scale / cap, cap2: Some(cap * std::f32::consts::LOG2_E) },
        }
    }

    /// The factor a path's score products take (their epilogue scale or `matmul` alpha).
    pub(crate) fn factor(self) -> f32 {
        self.factor
    }

    /// Whether the products times [`Scores::factor`] are the scores themselves, so that a
    /// fused epilogue (exponentials of the products as they are stored) may run.
    pub(crate) fn fused(self) -> bool {
        self.cap2.is_none()
    }

    /// Maps products already multiplied by [`Scores::factor`] to scores (in place): the
    /// identity without a cap. Call before masking.
    pub(crate) fn finish_row(self, row: &mut [f32]) {
        if let Some(cap2) = self.cap2 {
            cap_row(row, cap2);
        }
    }

    /// [`Scores::finish_row`] that also writes the derivative of each score by its plainly
    /// scaled product into `slopes`, from the products as [`Scores::factor`] left them, in
    /// the same pass: `1 − tanh²(x) = 4z/(1 + z)²` with `z = e^{−2|x|}` under a cap —
    /// accurate relative to the slope itself where tanh saturates (`1 − t²` from a rounded
    /// `t` keeps no digit there: at `t` = 0.998 a rounding of `t` is already 1.3e-5 of the
    /// slope). The scores are bit for bit [`Scores::finish_row`]'s. Without a cap every slope
    /// is 1 and nothing is written (the paths skip the slopes when [`Scores::fused`]). Masked
    /// pairs: [`Scores::mask_slopes`] after the mask.
    pub(crate) fn finish_row_with_slopes(self, row: &mut [f32], slopes: &mut [f32]) {
        if let Some(cap2) = self.cap2 {
            cap_slope_row(row, slopes, cap2);
        }
    }

    /// Zeroes the slopes of masked scores (`-inf` in `scores`, as the mask left them): their
    /// products may not have been computed (a partial tile's rows outside their reach).
    pub(crate) fn mask_slopes(self, scores: &[f32], slopes: &mut [f32]) {
        if self.cap2.is_some() {
            mask_slopes(scores, slopes);
        }
    }
}

/// scripts/fit-tanh.py's coefficients of [`tanh`]'s numerator `P(x²)`, rounded to f32 (the
/// constant term rounds to 1).
const TANH_P: [f32; 7] =
    [1.0, 0.130_817_77, 0.003_101_402_4, 1.112_585_9e-5, -2.009_907_3e-8, 5.211_397e-11, -8.303_485e-14];
/// [`tanh`]'s denominator `Q(x²)`: at least 1 (every coefficient positive).
const TANH_Q: [f32; 4] = [1.0, 0.464_151_05, 0.024_485_173, 0.000_254_232_52];

/// `tanh(x)` in f32 within a few units in the last place, branch-free (so that the row
/// kernels vectorise it): `x · P(x²) / Q(x²)` with `x` clamped to `±9.1` (beyond, tanh is 1 in
/// f32 within a fifth of a unit), `P` of degree 6 and `Q` of degree 3 in `x²` fitted by
/// `scripts/fit-tanh.py` (relative least squares, reweighted: 8e-9 relative in exact
/// arithmetic on `[0, 9.1]`; below 2.5 units in the last place evaluated in f32, checked by
/// the test below). Seven plus four multiply-adds and a division: about half the work of
/// a Taylor polynomial beside an exponential. NaN stays NaN; `±inf` gives `±1`.
#[inline(always)]
pub(crate) fn tanh<const FMA: bool>(x: f32) -> f32 {
    const P: [f32; 7] = TANH_P;
    const Q: [f32; 4] = TANH_Q;
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    // (`clamp` keeps NaN.)
    let xc = x.clamp(-9.1, 9.1);
    let x2 = xc * xc;
    let mut p = P[6];
    for &c in P[..6].iter().rev() {
        p = madd(p, x2, c);
    }
    let mut q = Q[3];
    for &c in Q[..3].iter().rev() {
        q = madd(q, x2, c);
    }
    (p * xc) / q
}

/// `row[j] = cap2 · tanh(row[j])`.
#[inline(always)]
fn cap_row_impl<const FMA: bool>(row: &mut [f32], cap2: f32) {
    for x in row.iter_mut() {
        *x = cap2 * tanh::<FMA>(*x);
    }
}

/// Below this `|x|` the slope is taken as `1 − t²` from [`tanh`]'s `t` (≤ 0.4621): `t`'s
/// 2.5 units in the last place make `t²`'s 5, which is `5ε·t²/(1 − t²)` ≤ 1.4ε of the slope.
const SMALL_PRODUCT: f32 = 0.5;

/// `slopes[j] = 1 − tanh²(x)`, then `row[j] = cap2 · tanh(x)`, for `x = row[j]`: where every
/// `|x|` of the row is at most [`SMALL_PRODUCT`] (the common case: with a cap of 30 a score
/// must pass 15 to leave it) as `1 − t²` from the same `t`; otherwise as `4z/(1 + z)²` with
/// `z = e^{−2|x|} = 2^(−2·log2 e·|x|)` (the crate's `exp2`: within a few units in the last
/// place; `z` is 0 past |x| ≈ 44, where the slope is below f32's normals anyway), accurate
/// where tanh saturates (`1 − t²` there keeps no digit: at `t` = 0.998 a rounding of `t` is
/// already 1.3e-5 of the slope). NaN stays NaN. The scores are [`cap_row`]'s bit for bit.
#[inline(always)]
fn cap_slope_row_impl<const FMA: bool>(row: &mut [f32], slopes: &mut [f32], cap2: f32) {
    // Pieces that stay in the first-level cache between the two passes (a caller may hand a
    // whole tile).
    const PIECE: usize = 512;
    let slopes = &mut slopes[..row.len()];
    for (row, slopes) in row.chunks_mut(PIECE).zip(slopes.chunks_mut(PIECE)) {
        // t into the slopes, and whether any |x| is past SMALL_PRODUCT (an integer or, which
        // vectorises; a NaN's lanes stay NaN on either side).
        let mut wide = 0u32;
        for (g, &x) in slopes.iter_mut().zip(row.iter()) {
            *g = tanh::<FMA>(x);
            wide |= (x.abs() > SMALL_PRODUCT) as u32;
        }
        if wide == 0 {
            for (x, g) in row.iter_mut().zip(slopes.iter_mut()) {
                let t = *g;
                *x = cap2 * t;
                *g = 1.0 - t * t;
            }
        } else {
            const TWO_LOG2E: f32 = 2.0 * std::f32::consts::LOG2_E;
            for (x, g) in row.iter_mut().zip(slopes.iter_mut()) {
                let (v, t) = (*x, *g);
                let z = super::simd::exp2::<FMA>(-TWO_LOG2E * v.abs());
                let one_z = 1.0 + z;
                *g = (4.0 * z) / (one_z * one_z);
                *x = cap2 * t;
            }
        }
    }
}

/// `slopes[j] = 0` where `scores[j]` is `-inf` (masked).
#[inline(always)]
fn mask_slopes_impl<const FMA: bool>(scores: &[f32], slopes: &mut [f32]) {
    for (g, &s) in slopes.iter_mut().zip(scores) {
        *g = if s == f32::NEG_INFINITY { 0.0 } else { *g };
    }
}

crate::cpu::simd::dispatch!(
    /// `row = cap2 · tanh(row)`.
    cap_row => cap_row_impl(row: &mut [f32], cap2: f32) -> ()
);
crate::cpu::simd::dispatch!(
    /// `slopes = 1 − tanh²(row)` (accurately where tanh saturates), then `row = cap2 · tanh(row)`.
    cap_slope_row => cap_slope_row_impl(row: &mut [f32], slopes: &mut [f32], cap2: f32) -> ()
);
crate::cpu::simd::dispatch!(
    /// `slopes = 0` where `scores` is `-inf`.
    mask_slopes => mask_slopes_impl(scores: &[f32], slopes: &mut [f32]) -> ()
);

#[cfg(test)]
mod tests {
    use super::*;

    /// The row kernels' tanh against f64's on a dense sweep across the branch point and into
    /// saturation, on every instruction set the processor has (the dispatchers) and the
    /// portable code: within 4 units in the last place of the result (or 1e-7 absolute near
    /// 0, where f32's own spacing is finer); NaN kept, infinities saturate.
    #[test]
    fn tanh_is_accurate_everywhere() {
        let xs: Vec<f32> = (-40_000..=40_000).map(|i| i as f32 * 2.5e-4).chain([1e-30, -3e-8, 200.0, -1e30]).collect();
        let check = |got: &[f32], what: &str| {
            for (&x, &t) in xs.iter().zip(got) {
                let want = (x as f64).tanh();
                let err = (t as f64 - want).abs();
                assert!(err <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-12, "{what}: tanh({x}) = {t}, want {want}");
            }
        };
        let mut row = xs.clone();
        cap_row(&mut row, 1.0);
        check(&row, "dispatched");
        let portable: Vec<f32> = xs.iter().map(|&x| tanh::<false>(x)).collect();
        check(&portable, "portable");
        let mut odd = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        cap_row(&mut odd, 2.0);
        assert!(odd[0].is_nan());
        assert_eq!(&odd[1..], &[2.0, -2.0]);
    }

    /// `Scores` reproduces the spec's score (in log2 units) and its slope.
    #[test]
    fn scores_follow_the_spec() {
        // Dots whose products all stay within SMALL_PRODUCT under the cap (1 − t² slopes),
        // then ones that reach saturation (the exponential form), in pieces of 1 to 1,100.
        let small: Vec<f32> = (-50..=50).map(|i| i as f32 * 0.07).collect();
        let wide: Vec<f32> = (-50..=50).map(|i| i as f32 * 0.9).collect();
        // (Up to 2.8: a bound of SMALL_PRODUCT moved past 2 puts these slopes 1e-5 off.)
        let mid: Vec<f32> = (-50..=50).map(|i| i as f32 * 0.4).collect();
        let long: Vec<f32> = (0..1100).map(|i| (i as f32 * 0.37).sin() * if i > 700 { 40.0 } else { 3.0 }).collect();
        for spec in [ScoreSpec { scale: 0.3, softcap: None }, ScoreSpec { scale: -0.7, softcap: Some(5.0) }] {
            for dots in [&small, &wide, &mid, &long, &small[..1].to_vec()] {
                let s = Scores::of(&spec);
                let mut row: Vec<f32> = dots.iter().map(|&d| d * s.factor()).collect();
                let mut slopes = vec![1.0; row.len()];
                let mut finished = row.clone();
                let products = row.clone();
                s.finish_row_with_slopes(&mut row, &mut slopes);
                s.finish_row(&mut finished);
                // The backward's scores are the forward's, bit for bit.
                let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&row), bits(&finished));
                assert_eq!(s.fused(), spec.softcap.is_none());
                for (((&d, &got), &g), &x) in dots.iter().zip(&row).zip(&slopes).zip(&products) {
                    let want = spec.score(d) * std::f32::consts::LOG2_E;
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{spec:?} dot {d}: {got} vs {want}");
                    if spec.softcap.is_some() {
                        // Relative to the slope at the f32 product (sech² magnifies x's
                        // rounding 2|x|-fold), however saturated (down to f32's normals).
                        let want = 1.0 / (x as f64).cosh().powi(2);
                        assert!(
                            (g as f64 - want).abs() <= 1e-6 * want || want < 1e-37,
                            "{spec:?} slope at {d}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The slopes' two forms agree where they meet, on every instruction set: `1 − t²` just
    /// inside `SMALL_PRODUCT` within 2 units in the last place of the exponential form's.
    #[test]
    fn the_slopes_two_forms_agree() {
        let xs: Vec<f32> = (0..64).map(|i| SMALL_PRODUCT * (1.0 - i as f32 * 1e-3)).collect();
        let (mut small, mut g_small) = (xs.clone(), vec![0.0; xs.len()]);
        cap_slope_row(&mut small, &mut g_small, 1.0);
        let mut wide = xs.clone();
        wide.push(1.0); // one product past the bound: every slope in the exponential form
        let mut g_wide = vec![0.0; wide.len()];
        cap_slope_row(&mut wide, &mut g_wide, 1.0);
        for (a, b) in g_small.iter().zip(&g_wide) {
            assert!((a - b).abs() <= 2.0 * f32::EPSILON * b, "{a} vs {b}");
        }
    }
}
