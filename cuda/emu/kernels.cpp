// The kernels of cuda/*.cu compiled for the host against the emulator, with one C entry
// point per kernel that launches it and reports errors (called from src/emu.rs).
#include "emu/emu.h"

#include "merge.cu"

#include <cstring>

namespace {
int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) {
        std::snprintf(msg, cap, "%s", err.c_str());
    }
    return 1;
}
}  // namespace

// Same launch geometry as the CUDA backend will use: one warp per LSE row, 256 threads.
// `schedule`: 0 forward, 1 reverse, 2 seeded random fiber order (see emu::Schedule).
extern "C" int ringattn_emu_merge_f32(MergeParams p, int schedule, uint64_t seed, char* msg, size_t cap) {
    const int64_t rows = p.b * p.h * p.s;
    const unsigned threads = 256;
    const int64_t blocks = (rows * 32 + threads - 1) / threads;
    if (blocks == 0) return 0;
    std::function<void()> body = [p] { ringattn_merge_f32(p); };
    return report(emu::launch(dim3(unsigned(blocks)), dim3(threads), body, 0, emu::Schedule(schedule), seed, 0), msg,
                  cap);
}
