// Standalone check of the emulator and the host-compiled kernels under sanitizers:
//   g++ -std=c++17 -g -fsanitize=address,undefined -I cuda cuda/emu/harness.cpp \
//       cuda/emu/kernels.cpp cuda/emu/selftest.cpp -pthread -o target/emu-harness && target/emu-harness
// (scripts/test.sh runs it). Exits non-zero on the first failed check.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "params.h"

extern "C" int ringattn_emu_merge_f32(MergeParams p, int schedule, uint64_t seed, char* msg, size_t cap);
extern "C" int ringattn_emu_selftest(int which, unsigned n, float* buf, float* out, char* msg, size_t cap);

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
        const int code = ringattn_emu_merge_f32(p, 2, 7, msg, sizeof msg);
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
    std::printf("%d failure(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
