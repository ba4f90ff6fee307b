// Kernels that exercise the emulator itself (not part of the library's kernels): the
// ordering of __syncthreads and the reports of planted bugs. Driven by src/emu.rs tests.
#include "emu/emu.h"

#include <string>

namespace {

// Every thread writes its index, waits at the barrier, then reads its neighbour's slot:
// correct only if the barrier orders all writes before all reads.
__global__ void barrier_order(float* buf, float* out) {
    const unsigned i = threadIdx.x;
    buf[i] = float(i);
    __syncthreads();
    out[i] = buf[(i + 1) % blockDim.x];
}

// Half the block waits at a barrier the other half never reaches.
__global__ void divergent_barrier(float* out) {
    if (threadIdx.x < blockDim.x / 2) {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}

int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) std::snprintf(msg, cap, "%s", err.c_str());
    return 1;
}

}  // namespace

// which = 0: barrier_order over one block of `n` threads (buf, out hold n floats);
// which = 1: divergent_barrier.
extern "C" int ringattn_emu_selftest(int which, unsigned n, float* buf, float* out, char* msg, size_t cap) {
    std::function<void()> body;
    if (which == 0) {
        body = [=] { barrier_order(buf, out); };
    } else {
        body = [=] { divergent_barrier(out); };
    }
    return report(emu::launch(dim3(1), dim3(n), body), msg, cap);
}
