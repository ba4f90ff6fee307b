// How the flash kernels turn a raw product q.k into the score their softmax takes, in log2
// units (their exponentials are 2^x): the one place of the device code that knows the score
// options of ScoreParams (cuda/params.h; src/attention.rs ScoreSpec defines them,
// src/cpu/score.rs is the CPU's counterpart of this file). An option added to ScoreParams is
// honoured here; the kernels call these helpers and know no option by name.
//
// The score of a raw product x is x * scale_log2, or under a soft-cap c (natural units,
// c2 = c * log2(e)) c2 * tanh(x * scale_log2 / c2). Both are monotonic in x * |scale_log2|, so
// a row's maximum commutes with the map: the forwards fold a negative scale into the sign of
// their operands and take the maximum of the raw products.
#pragma once

#include "common.cuh"

// 1 / (2^z + 1) on ex2.approx and rcp.approx (2 ulp and 1 ulp): the one piece of the
// soft-cap's tanh, tanh(y) = 1 - 2 / (2^(2 y log2 e) + 1). +inf gives 0, -inf 1, NaN NaN.
__device__ __forceinline__ float rcp_ex2_plus_one(float z) { return rcp_approx(ex2_approx(z) + 1.0f); }

// 2 log2(e): tanh(y) = 1 - 2 * rcp_ex2_plus_one(kTanhLog2 * y).
constexpr float kTanhLog2 = 2.8853900817779268f;

// The two forms of the soft-cap's tanh a kernel may take, both within the capped scores' bound:
//  * kShort: tanh(y) = 1 - 2 / (2^(2 y log2 e) + 1) — two chained MUFU and three FP32 ops —
//    within about 3e-7 of tanh(y) absolutely at every y (relatively coarse near 0, where the
//    result is small). A capped score c2 * tanh(y) is then off by c2 * 3e-7 at most: the
//    rounding of one f32 score of the cap's size, a relative error of about 1e-5 in its
//    probability, far below the 16-bit probabilities' 2^-9 — the softmax and the backward's
//    slope 1 - tanh^2 read absolute error.
//  * kSplit: below |y| = 0.3 the odd Taylor polynomial to y^9 (truncation below 5e-8
//    relative), kShort above (at most about 10 ulp relative at the switch): eight more
//    instructions per score, yet ptxas allocates some kernels at the register limit without
//    spilling with it where kShort spills: kernel_tanh picks it for them.
// Both: +-inf give +-1, NaN gives NaN. A single MUFU.TANH (tanh.approx, relative error 2^-11)
// would move every capped score by up to 2^-11 of itself, the same way for neighbouring
// scores: beyond the f32 LSE's bound.
enum class TanhForm { kShort, kSplit };

// tanh(z / (2 log2 e)) in the form F (z: tanh's argument doubled, in log2 units).
template <TanhForm F>
__device__ __forceinline__ float tanh_log2(float z) {
    const float short_form = fmaf(-2.0f, rcp_ex2_plus_one(z), 1.0f);
    if constexpr (F == TanhForm::kShort) {
        return short_form;
    } else {
        const float y = z * (1.0f / kTanhLog2);
        const float y2 = y * y;
        float poly = fmaf(y2, 62.0f / 2835.0f, -17.0f / 315.0f);
        poly = fmaf(poly, y2, 2.0f / 15.0f);
        poly = fmaf(poly, y2, -1.0f / 3.0f);
        const float small = fmaf(poly * y2, y, y);
        return fabsf(y) < 0.3f ? small : short_form;
    }
}

// The form of the forward whose head-dim class is D: kSplit where kShort spills (sm_90a: class
// 192, which spills with kSplit on sm_80), kShort elsewhere and in the emulator (which tests
// kSplit through the self-test of score_tanh). (The backwards take no tanh: BackwardScores.)
template <int D>
__device__ __forceinline__ constexpr TanhForm kernel_tanh() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
    return D == 192 ? TanhForm::kSplit : TanhForm::kShort;
#else
    return TanhForm::kShort;
#endif
}

// tanh(y) in the form F (the self-test's entry).
template <TanhForm F>
__device__ __forceinline__ float score_tanh(float y) {
    return tanh_log2<F>(kTanhLog2 * y);
}

// The forwards' scores: the kernels take x -> x * sc (sc >= 0: the scale's sign folded into Q
// or the raw scores) in the exponent's multiply-add; under a soft-cap the raw scores of a tile
// are capped in place first (cap(), before the mask) and sc is 1. The FA2 backward and the FA2
// forward of class 96 are instantiated once per variant (each their own code, so that the plain
// SASS stays as it was); the other forwards and the Hopper backward branch per tile (where two
// instantiations would spill).
struct ForwardScores {
    float sc;    // the factor of the exponent's multiply-add
    float pre;   // capped: 2 log2(e) |scale_log2| / softcap_log2 (tanh's argument, doubled, log2)
    float cap2;  // softcap_log2; 0: plain scores

    // The scores of a kernel's variant: soft-capped (kCapped, the parameters have a cap) or plain.
    template <bool kCapped>
    __device__ __forceinline__ static ForwardScores of(const ScoreParams& s) {
        const float sc = s.scale_log2 < 0.0f ? -s.scale_log2 : s.scale_log2;
        if constexpr (kCapped) {
            return ForwardScores{1.0f, kTanhLog2 * sc / s.softcap_log2, s.softcap_log2};
        } else {
            return ForwardScores{sc, 0.0f, 0.0f};
        }
    }

    // Whether the tile's raw scores go through cap() before the mask (the per-tile branch).
    __device__ __forceinline__ bool capped() const { return cap2 > 0.0f; }

    // The scores of the parameters, either variant (the kernels that branch per tile).
    __device__ __forceinline__ static ForwardScores any(const ScoreParams& s) {
        const float sc = fabsf(s.scale_log2);
        if (s.softcap_log2 > 0.0f) return ForwardScores{1.0f, kTanhLog2 * sc / s.softcap_log2, s.softcap_log2};
        return ForwardScores{sc, 0.0f, 0.0f};
    }

    // A raw (sign-folded) product's capped score, log2 units, with the tanh of form F (kShort:
    // c2 - 2 c2 / (2^z + 1), one multiply-add).
    template <TanhForm F = TanhForm::kShort>
    __device__ __forceinline__ float cap(float x) const {
        if constexpr (F == TanhForm::kShort) {
            return fmaf(-2.0f * cap2, rcp_ex2_plus_one(x * pre), cap2);
        } else {
            return cap2 * tanh_log2<F>(x * pre);
        }
    }
};

// A compile-time flag as a type (the tag of a generic lambda's variant): the backwards are
// instantiated for the plain scores (kCapped false: every slope is 1 and costs nothing) and the
// soft-capped ones, chosen on BackwardScores::capped().
template <bool kCapped>
struct ScoreVariant {
    static constexpr bool value = kCapped;
};

// The backwards' scores: the probability of a raw product against its query's log2 LSE, and the
// score's slope by the plainly scaled product (1 - tanh^2 under a soft-cap, 1 otherwise), which
// the kernels multiply into dS. It reads the kernel's parameters in place (their constant bank:
// no register for the plain scores' scale).
//
// Under a soft-cap the kernels carry r = 1 / (2^z + 1) (tanh = 1 - 2r, prepare()) rather than
// tanh itself: the score c2 (1 - 2r) - lse2 is then one multiply-add on a per-query offset
// c2 + 2 - lse2 (offset()), and the slope 1 - tanh^2 = 4 r (1 - r) one more. The factor 4 is
// moved into the probability: prob() returns kProbScale P (4 P, a power of two: exact) and the
// slope over kProbScale, so that their product, dS's factor, is P's times the slope's as they
// stand; a kernel that feeds prob()'s value to dV multiplies dV by prob_unscale() once, in its
// epilogue. Plain scores: kProbScale 1, slope 1 (folded away).
struct BackwardScores {
    const ScoreParams& s;
    float pre;  // capped: 2 log2(e) scale_log2 / softcap_log2 (dead code in the plain variant)

    // The factor of P in prob()'s value.
    template <bool kCapped>
    static constexpr float kProbScale = kCapped ? 4.0f : 1.0f;

    __device__ __forceinline__ static BackwardScores of(const ScoreParams& s) {
        return BackwardScores{s, s.softcap_log2 > 0.0f ? kTanhLog2 * s.scale_log2 / s.softcap_log2 : 0.0f};
    }

    __device__ __forceinline__ bool capped() const { return s.softcap_log2 > 0.0f; }

    // The factor that turns a dV summed from prob()'s values into dV (1 / kProbScale; the
    // kernels that branch per tile read it from the parameters).
    __device__ __forceinline__ float prob_unscale() const { return capped() ? 1.0f / kProbScale<true> : 1.0f; }

    // A raw product prepared for prob(), in place in the kernels' score registers (a pass of its
    // own, so that its temporaries are dead before the probabilities' pass): under a soft-cap
    // r = (1 - tanh(y)) / 2 = 1 / (2^(2 y log2 e) + 1) of the scaled product y (kShort's pieces:
    // within about 1.5e-7 of r absolutely), x itself otherwise.
    template <bool kCapped>
    __device__ __forceinline__ float prepare(float x) const {
        if constexpr (kCapped) {
            return rcp_ex2_plus_one(x * pre);
        } else {
            return x;
        }
    }

    // The per-query term of prob()'s exponent, from the query's log2 LSE: -lse2, or under a
    // soft-cap c2 + log2(kProbScale) - lse2 (an LSE of -inf gives +inf either way).
    template <bool kCapped>
    __device__ __forceinline__ float offset(float lse2) const {
        if constexpr (kCapped) {
            return (s.softcap_log2 + 2.0f) - lse2;
        } else {
            return -lse2;
        }
    }

    // kProbScale P = 2^(score - lse2 + log2 kProbScale) of a prepared product `y`, `off` its
    // query's offset(); `slope` gets the score's slope over kProbScale (kCapped false: 1,
    // folded away).
    template <bool kCapped>
    __device__ __forceinline__ float prob(float y, float off, float& slope) const {
        if constexpr (kCapped) {
            slope = fmaf(-y, y, y);
            return ex2_approx(fmaf(-2.0f * s.softcap_log2, y, off));
        } else {
            slope = 1.0f;
            return ex2_approx(fmaf(y, s.scale_log2, off));
        }
    }

    // Runs body(ScoreVariant<capped()>{}): a tile's loop instantiated for both variants behind
    // one uniform branch per tile (flash_bwd_hopper.cu; the FA2 backward instantiates whole
    // kernels instead, its registers being at their limit).
    template <typename Body>
    __device__ __forceinline__ void dispatch(Body&& body) const {
        if (capped()) {
            body(ScoreVariant<true>{});
        } else {
            body(ScoreVariant<false>{});
        }
    }
};
