// Standalone check of the emulator and the host-compiled kernels under sanitizers:
//   scripts/test.sh compiles this file with cuda/emu/kernels*.cpp and selftest*.cpp under
//   -fsanitize=address,undefined (-I cuda) and runs it.
// Exits non-zero on the first failed check.
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include "emu/launch.h"
#include "params.h"

extern "C" int ringattn_emu_selftest(int which, unsigned n, float* buf, float* out, char* msg, size_t cap);
extern "C" int ringattn_emu_selftest_checks(int which, int schedule, char* msg, size_t cap);

extern "C" int ringattn_emu_merge_f32(MergeParams p, EmuLaunch l, char* msg, size_t cap);
extern "C" int ringattn_emu_flash_fwd(FlashFwdParams p, int bf16, int dclass, int own_dv, EmuLaunch l, char* msg,
                                      size_t cap);
extern "C" int ringattn_emu_flash_fwd_hopper(const FlashFwdHopperParams* hp, int bf16, int dclass, EmuLaunch l,
                                             char* msg, size_t cap);
extern "C" int ringattn_emu_flash_bwd(FlashBwdParams p, int kernel, int bf16, int dclass, int own_dv, EmuLaunch l,
                                      char* msg, size_t cap);
extern "C" int ringattn_emu_flash_bwd_hopper(const FlashBwdHopperParams* hp, int fixed, int bf16, int dclass,
                                             EmuLaunch l, char* msg, size_t cap);

// bf16 bits of x (truncation is enough for test inputs) and back.
static uint16_t to_bf16(float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return uint16_t(b >> 16);
}
static float from_bf16(uint16_t h) {
    const uint32_t b = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

// The emulator's encoding of a bf16 [b, s, h, d] tensor's map with boxes of 64 columns x 1 x
// `rows` x 1, 128-byte swizzled (src/kernels/tensor_map.rs `bshd_tile_map`, encode_emulated).
static TensorMap emu_bshd_map(const void* addr, int64_t b, int64_t s, int64_t h, int64_t d, uint32_t rows) {
    TensorMap m{};
    m.words[0] = 0x5241544Du | (uint64_t(9) << 32) | (uint64_t(4) << 40) | (uint64_t(3) << 44);
    m.words[1] = uint64_t(reinterpret_cast<uintptr_t>(addr));
    const uint64_t dims[4] = {uint64_t(d), uint64_t(h), uint64_t(s), uint64_t(b)};
    for (int i = 0; i < 4; ++i) m.words[2 + i] = dims[i];
    m.words[7] = uint64_t(d) * 2, m.words[8] = uint64_t(h * d) * 2, m.words[9] = uint64_t(s * h * d) * 2;
    m.words[11] = 64 | (uint64_t(1) << 12) | (uint64_t(rows) << 24) | (uint64_t(1) << 36);
    return m;
}

// The emulator's map of n f32 row statistics as the Hopper backward copies them: 2-d {n, 1},
// boxes of 64 x 1, no swizzle (src/kernels/tensor_map.rs `row_stats_map`).
static TensorMap emu_rows_map(const float* addr, int64_t n) {
    TensorMap m{};
    m.words[0] = 0x5241544Du | (uint64_t(7) << 32) | (uint64_t(2) << 40);
    m.words[1] = uint64_t(reinterpret_cast<uintptr_t>(addr));
    m.words[2] = uint64_t(n), m.words[3] = 1;
    m.words[7] = (uint64_t(n) * 4 + 15) / 16 * 16;
    m.words[11] = 64 | (uint64_t(1) << 12);
    return m;
}

static int failures = 0;

static void check(bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) ++failures;
}

int main() {
    char msg[512] = {0};
    {
        // Merge: equal weights average the two sides; -inf sides contribute nothing.
        const int64_t b = 1, s = 5, h = 2, d = 40;
        std::vector<float> oa(b * s * h * d, 1.0f), ob(b * s * h * d, 3.0f), la(b * h * s, 0.0f), lb(b * h * s, 0.0f);
        la[1] = -INFINITY;
        lb[2] = -INFINITY;
        lb[3] = -INFINITY;
        la[3] = -INFINITY;
        MergeParams p{oa.data(), la.data(), ob.data(), lb.data(), b, s, h, d};
        const EmuLaunch l{{unsigned((b * h * s * 32 + 255) / 256), 1, 1}, 256, 0, 2, 0, 7, nullptr};
        const int code = ringattn_emu_merge_f32(p, l, msg, sizeof msg);
        check(code == 0, "merge launches");
        // lse index 0 is (b0, h0, s0): row s0, head h0 in o.
        check(oa[0] == 2.0f, "merge averages equal weights");
        check(oa[(1 * h + 0) * d] == 3.0f, "merge takes the only visible side");
        check(oa[(2 * h + 0) * d] == 1.0f, "merge keeps the accumulator when the part saw nothing");
        check(oa[(3 * h + 0) * d] == 0.0f && std::isinf(la[3]), "merge of two empty sides gives 0 and -inf");
    }
    for (int which = 0; which < 4; ++which) {
        const unsigned n = 64;
        std::vector<float> buf(n, 0.0f), out(4 * n, -1.0f);
        const int code = ringattn_emu_selftest(which, n, buf.data(), out.data(), msg, sizeof msg);
        const bool expect_error = which == 1;  // the planted divergent barrier
        char what[64];
        std::snprintf(what, sizeof what, "selftest %d %s", which, expect_error ? "reports its bug" : "runs clean");
        check(expect_error ? code == 1 : code == 0, what);
    }
    for (int which = 0; which < 6; ++which) {
        const int code = ringattn_emu_selftest_checks(which, 2, msg, sizeof msg);
        const bool expect_error = which % 2 == 1 || which == 4;
        char what[64];
        std::snprintf(what, sizeof what, "planted check %d %s", which, expect_error ? "reports its bug" : "runs clean");
        check(expect_error ? code == 1 : code == 0, what);
    }
    {
        // Flash forward and backward on a small causal GQA case: forward against a naive
        // double-precision attention, backward runs clean and writes every gradient.
        const int64_t b = 1, s = 45, hq = 2, hkv = 1, d = 16;
        std::vector<uint16_t> q(b * s * hq * d), k(b * s * hkv * d), v(b * s * hkv * d), dout(q.size());
        for (size_t i = 0; i < q.size(); ++i) q[i] = to_bf16(std::sin(0.37f * i)), dout[i] = to_bf16(std::cos(0.11f * i));
        for (size_t i = 0; i < k.size(); ++i) k[i] = to_bf16(std::cos(0.23f * i)), v[i] = to_bf16(std::sin(0.71f * i));
        std::vector<int64_t> pos(s);
        for (int64_t i = 0; i < s; ++i) pos[i] = i;
        std::vector<float> o(q.size(), NAN), lse(b * hq * s, NAN);
        const float scale = 0.25f;
        MaskParams m{pos.data(), pos.data(), nullptr, nullptr, -1, 0, nullptr, nullptr, nullptr, nullptr};
        const FlashProblem problem{q.data(), k.data(), v.data(), m, b, s, s, hq, hkv, d, d,
                                   ScoreParams{scale, scale * 1.4426950408889634f, 0.0f, 0.0f}};
        FlashFwdParams fp{problem, o.data(), lse.data(), nullptr};
        // The tensor-core forward, head-dim class 32 (d = 16 zero-padded): 4 warps of 32 rows,
        // 64-key tiles double-buffered, each warp's query bounds (src/kernels.rs
        // `geometry::forward`).
        EmuLaunch fl{{unsigned((s + 127) / 128), unsigned(hq), unsigned(b)}, 128, 128 * 32 * 2 + 4 * 64 * 32 * 2 + 4 * 32,
                     2, 2, 9, nullptr};
        check(ringattn_emu_flash_fwd(fp, 1, 32, 0, fl, msg, sizeof msg) == 0, "flash forward runs clean");
        // The largest difference of (o, lse) from a naive double-precision attention.
        auto worst_error = [&] {
            double worst = 0.0;
        for (int64_t h = 0; h < hq; ++h) {
            for (int64_t i = 0; i < s; ++i) {
                double mx = -INFINITY, sum = 0.0;
                std::vector<double> p(s, 0.0), acc(d, 0.0);
                for (int64_t j = 0; j <= i; ++j) {
                    double dot = 0.0;
                    for (int64_t c = 0; c < d; ++c) dot += from_bf16(q[(i * hq + h) * d + c]) * from_bf16(k[j * d + c]);
                    p[j] = dot * scale;
                    mx = std::max(mx, p[j]);
                }
                for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
                for (int64_t j = 0; j <= i; ++j) {
                    for (int64_t c = 0; c < d; ++c) acc[c] += std::exp(p[j] - mx) / sum * from_bf16(v[j * d + c]);
                }
                for (int64_t c = 0; c < d; ++c) worst = std::max(worst, std::fabs(acc[c] - o[(i * hq + h) * d + c]));
                worst = std::max(worst, std::fabs(mx + std::log(sum) - lse[h * s + i]));
            }
        }
        return worst;
        };
        // P is rounded to bf16 for the P V product (as on tensor cores): a few bf16 ulps.
        double worst = worst_error();
        std::printf("     flash forward: largest difference from naive attention %.3g\n", worst);
        check(worst < 5e-3, "flash forward matches a naive attention");
        {
            // The Hopper forward (wgmma, TMA, mbarriers; class 64 with d = 16 zero-filled by
            // the copies): 384 threads, Q and 4 K/V stages of 128 x 64, 13 mbarriers, the
            // tile-range scratch, 1024 bytes of alignment (src/kernels.rs `geometry::forward_hopper`).
            std::vector<float> o2(q.size(), NAN), lse2(lse.size(), NAN);
            std::swap(o, o2), std::swap(lse, lse2);
            FlashFwdHopperParams hp{};
            hp.p = fp;
            hp.p.o = o.data(), hp.p.lse = lse.data();
            hp.q = emu_bshd_map(q.data(), b, s, hq, d, 128);
            hp.k = emu_bshd_map(k.data(), b, s, hkv, d, 128);
            hp.v = emu_bshd_map(v.data(), b, s, hkv, d, 128);
            EmuLaunch hl{{unsigned((s + 127) / 128), unsigned(hq), unsigned(b)}, 384,
                         128 * 64 * 2 + 2 * 4 * 128 * 64 * 2 + 8 * 13 + 4 * 12 * 8 + 1024, 2, 2, 9, nullptr};
            check(ringattn_emu_flash_fwd_hopper(&hp, 1, 64, hl, msg, sizeof msg) == 0, "Hopper forward runs clean");
            const double hw = worst_error();
            std::printf("     Hopper forward: largest difference from naive attention %.3g\n", hw);
            check(hw < 5e-3, "Hopper forward matches a naive attention");
            std::swap(o, o2), std::swap(lse, lse2);
        }
        // The deterministic backward of head-dim class 32: dq added in fixed point into zeros,
        // the K/V bounds raised from zeros.
        std::vector<float> delta(lse.size(), NAN), dq(q.size(), 0.0f), dk(k.size(), NAN), dv(v.size(), NAN);
        std::vector<float> unit(lse.size(), NAN), kv_bound(2 * b * hkv, 0.0f);
        FlashBwdParams bp{problem,   o.data(),  dout.data(), lse.data(),      delta.data(), dq.data(),
                          dk.data(), dv.data(), unit.data(), kv_bound.data(), 0,            0};
        // Launches as src/kernels.rs `geometry::backward` gives them for head-dim class 32:
        // rowsum, kvbound, rowunit, the dk/dv kernel with fixed-point dq, dqconvert.
        const unsigned rows = unsigned((b * hq * s + 255) / 256);
        EmuLaunch rl{{rows, 1, 1}, 256, 0, 1, 1, 0, nullptr};
        bool ok = ringattn_emu_flash_bwd(bp, 0, 1, 0, 0, rl, msg, sizeof msg) == 0;
        EmuLaunch bl{{unsigned((b * s * hkv + 7) / 8), 1, 1}, 256, 0, 2, 2, 9, nullptr};
        ok = ok && ringattn_emu_flash_bwd(bp, 1, 1, 0, 0, bl, msg, sizeof msg) == 0;
        ok = ok && ringattn_emu_flash_bwd(bp, 2, 1, 0, 0, rl, msg, sizeof msg) == 0;
        // 64 keys per block; Q, dO and 3 f32 per query row (64-row tiles) twice; dS^T and flags.
        EmuLaunch kl{{unsigned((s + 63) / 64), unsigned(hkv), unsigned(b)}, 128,
                     2 * 64 * 64 + 2 * (2 * 64 * 64 + 3 * 64 * 4) + 64 * 72 * 2 + 16, 2, 2, 9, nullptr};
        ok = ok && ringattn_emu_flash_bwd(bp, 3, 1, 32, 0, kl, msg, sizeof msg) == 0;
        EmuLaunch cl{{unsigned((b * s * hq + 7) / 8), 1, 1}, 256, 0, 2, 2, 9, nullptr};
        ok = ok && ringattn_emu_flash_bwd(bp, 5, 1, 0, 0, cl, msg, sizeof msg) == 0;
        check(ok, "flash backward runs clean");
        bool finite = true;
        for (const std::vector<float>* g : {&delta, &dq, &dk, &dv, &unit}) {
            for (float x : *g) finite = finite && std::isfinite(x);
        }
        check(finite, "flash backward writes every gradient");
        {
            // The Hopper backward's dk/dv/dq kernel (wgmma, TMA, mbarriers; class 64, d = 16
            // zero-filled) on the same inputs, delta and dq units, fixed point, then dqconvert:
            // the FA2 kernels' gradients up to rounding. Shared memory (src/kernels.rs
            // `geometry::dkdv_hopper`): K and V of 128 keys, 4 stages of Q, dO (64 rows) and
            // their lse/delta rows, two dS^T tiles, 9 mbarriers, the tile range, its scratch,
            // 1024 bytes of alignment.
            std::vector<float> dq2(q.size(), 0.0f), dk2(k.size(), NAN), dv2(v.size(), NAN);
            FlashBwdHopperParams hb{};
            hb.p = bp;
            hb.p.dq = dq2.data(), hb.p.dk = dk2.data(), hb.p.dv = dv2.data();
            hb.q = emu_bshd_map(q.data(), b, s, hq, d, 64);
            hb.k = emu_bshd_map(k.data(), b, s, hkv, d, 128);
            hb.v = emu_bshd_map(v.data(), b, s, hkv, d, 128);
            hb.d_o = emu_bshd_map(dout.data(), b, s, hq, d, 64);
            hb.lse = emu_rows_map(lse.data(), b * hq * s);
            hb.delta = emu_rows_map(delta.data(), b * hq * s);
            EmuLaunch hbl{{unsigned((s + 127) / 128), unsigned(hkv), unsigned(b)}, 384,
                          2 * 128 * 64 * 2 + 4 * 2 * 64 * 64 * 2 + 2 * 64 * 64 * 2 + 4 * 512 + 8 * 9 + 8 + 4 * 12 * 8 +
                              1024,
                          2, 2, 9, nullptr};
            bool hok = ringattn_emu_flash_bwd_hopper(&hb, 1, 1, 64, hbl, msg, sizeof msg) == 0;
            FlashBwdParams conv = bp;
            conv.dq = dq2.data();
            hok = hok && ringattn_emu_flash_bwd(conv, 5, 1, 0, 0, cl, msg, sizeof msg) == 0;
            check(hok, "Hopper backward runs clean");
            double worst = 0.0, scale_g = 0.0;
            const std::pair<const std::vector<float>*, const std::vector<float>*> pairs[] = {
                {&dq, &dq2}, {&dk, &dk2}, {&dv, &dv2}};
            for (const auto& pr : pairs) {
                for (size_t i = 0; i < pr.first->size(); ++i) {
                    const double diff = std::fabs(double((*pr.first)[i]) - double((*pr.second)[i]));
                    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);  // unwritten: NaN
                    scale_g = std::max(scale_g, double(std::fabs((*pr.first)[i])));
                }
            }
            std::printf("     Hopper backward: largest difference from the FA2 backward %.3g (gradients up to %.3g)\n",
                        worst, scale_g);
            check(worst <= 1e-2 * scale_g, "Hopper backward matches the FA2 backward");
        }
    }
    std::printf("%d failure(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
