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

// Warp sum by butterfly (__shfl_xor_sync), a broadcast from lane 3, a shift down by one
// and a ballot of odd lanes: out[i] = sum, out[n+i] = broadcast, out[2n+i] = down,
// out[3n+i] = ballot (as float).
__global__ void warp_ops(float* out) {
    const unsigned i = threadIdx.x;
    const unsigned n = blockDim.x;
    float v = float(i);
    for (int m = 16; m > 0; m /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, m);
    }
    out[i] = v;
    out[n + i] = __shfl_sync(0xffffffffu, float(i), 3);
    out[2 * n + i] = __shfl_down_sync(0xffffffffu, float(i), 1);
    out[3 * n + i] = float(__ballot_sync(0xffffffffu, i % 2));
}

// Block-wide reduction through dynamic shared memory: out[0] (by atomics over blocks) sums
// every thread's index; out[1 + blockIdx.x] is the block's first shared slot read before any
// write (the poison, NaN).
__global__ void smem_reduce(float* out) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    if (threadIdx.x == 0) out[1 + blockIdx.x] = sm[0];
    __syncthreads();
    sm[threadIdx.x] = float(threadIdx.x);
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) sm[threadIdx.x] += sm[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(&out[0], sm[0]);
}

int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) std::snprintf(msg, cap, "%s", err.c_str());
    return 1;
}

}  // namespace

// which = 0: barrier_order over one block of `n` threads (buf, out hold n floats);
// which = 1: divergent_barrier; which = 2: warp_ops (out holds 4n floats);
// which = 3: smem_reduce over 3 blocks of n threads (n a power of two; out holds 4 floats).
extern "C" int ringattn_emu_selftest(int which, unsigned n, float* buf, float* out, char* msg, size_t cap) {
    std::function<void()> body;
    if (which == 0) {
        body = [=] { barrier_order(buf, out); };
    } else if (which == 1) {
        body = [=] { divergent_barrier(out); };
    } else if (which == 2) {
        body = [=] { warp_ops(out); };
    } else {
        out[0] = 0.0f;
        body = [=] { smem_reduce(out); };
        return report(emu::launch(dim3(3), dim3(n), body, n * sizeof(float)), msg, cap);
    }
    return report(emu::launch(dim3(1), dim3(n), body), msg, cap);
}

#include "ptx.cuh"

namespace {
// One warp: lane L takes its registers from regs[L] (a0..a3, b0, b1 as u32) and c[L][0..3],
// runs the mma and writes d[L][0..3]. The caller lays out the fragments (by the PTX tables).
__global__ void mma_lanes(const uint32_t* regs, const float* c, float* d, int bf16) {
    const unsigned L = threadIdx.x;
    const uint32_t a[4] = {regs[L * 6 + 0], regs[L * 6 + 1], regs[L * 6 + 2], regs[L * 6 + 3]};
    const uint32_t b[2] = {regs[L * 6 + 4], regs[L * 6 + 5]};
    float out[4];
    if (bf16) {
        mma_m16n8k16_bf16(out, a, b, &c[L * 4]);
    } else {
        mma_m16n8k16_f16(out, a, b, &c[L * 4]);
    }
    for (int i = 0; i < 4; ++i) d[L * 4 + i] = out[i];
}
}  // namespace

extern "C" int ringattn_emu_selftest_mma(const uint32_t* regs, const float* c, float* d, int bf16, char* msg,
                                         size_t cap) {
    std::function<void()> body = [=] { mma_lanes(regs, c, d, bf16); };
    return report(emu::launch(dim3(1), dim3(32), body), msg, cap);
}

namespace {
// One warp, a 16x16 row-major b16 tile `tile` copied to shared memory:
// A-operand composition: ldmatrix_x4 with lane L pointing to row L%16, column 8(L/16);
// V composition: ldmatrix_x2_trans with lane L pointing to row L%16 (columns 0..7).
// out[L*6 + 0..3] = the x4 registers, out[L*6 + 4..5] = the x2.trans registers.
__global__ void ldmatrix_lanes(const uint16_t* tile, uint32_t* out) {
    uint16_t* sm = reinterpret_cast<uint16_t*>(RINGATTN_DYNAMIC_SMEM());
    const unsigned L = threadIdx.x;
    for (unsigned i = L; i < 256; i += 32) sm[i] = tile[i];
    __syncwarp();
    uint32_t a[4], v[2];
    ldmatrix_x4(a, sm + (L % 16) * 16 + 8 * (L / 16));
    ldmatrix_x2_trans(v, sm + (L % 16) * 16);
    for (int i = 0; i < 4; ++i) out[L * 6 + i] = a[i];
    out[L * 6 + 4] = v[0];
    out[L * 6 + 5] = v[1];
}
}  // namespace

extern "C" int ringattn_emu_selftest_ldmatrix(const uint16_t* tile, uint32_t* out, char* msg, size_t cap) {
    std::function<void()> body = [=] { ldmatrix_lanes(tile, out); };
    return report(emu::launch(dim3(1), dim3(32), body, 512), msg, cap);
}

namespace {
// One warp. Each lane copies two 16-byte pieces of `src` into shared memory in two groups
// (the second a partial copy of 8 bytes, zero-filled), reading its destination before and
// between the waits. out[L*12 + 0..3]: first piece seen before any wait (poison);
// [4..7]: first piece after wait<1>; [8..11]: second piece after wait<0>. ex[L] = 2^(L - 20)
// through ex2_approx.
__global__ void cp_async_lanes(const float* src, float* out, float* ex) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    const unsigned L = threadIdx.x;
    float* first = sm + L * 8;
    float* second = sm + L * 8 + 4;
    cp_async_cg16(first, src + L * 8, 16);
    cp_async_commit();
    cp_async_cg16(second, src + L * 8 + 4, 8);
    cp_async_commit();
    for (int i = 0; i < 4; ++i) out[L * 12 + i] = first[i];
    cp_async_wait<1>();
    for (int i = 0; i < 4; ++i) out[L * 12 + 4 + i] = first[i];
    cp_async_wait<0>();
    for (int i = 0; i < 4; ++i) out[L * 12 + 8 + i] = second[i];
    ex[L] = ex2_approx(float(int(L) - 20));
}

// A thread that issues a cp.async and never waits for it.
__global__ void cp_async_unwaited(const float* src) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    cp_async_cg16(sm + threadIdx.x * 4, src + threadIdx.x * 4, 16);
    cp_async_commit();
}
}  // namespace

extern "C" int ringattn_emu_selftest_cp_async(int unwaited, const float* src, float* out, float* ex, char* msg,
                                             size_t cap) {
    std::function<void()> body;
    if (unwaited) {
        body = [=] { cp_async_unwaited(src); };
    } else {
        body = [=] { cp_async_lanes(src, out, ex); };
    }
    return report(emu::launch(dim3(1), dim3(32), body, 32 * 8 * sizeof(float)), msg, cap);
}

namespace {
// barrier_order with the barrier forgotten: its result depends on the schedule.
__global__ void missing_barrier(float* buf, float* out) {
    const unsigned i = threadIdx.x;
    buf[i] = float(i);
    out[i] = buf[(i + 1) % blockDim.x];
}
}  // namespace

extern "C" int ringattn_emu_selftest_missing_barrier(int schedule, uint64_t seed, unsigned n, float* buf, float* out,
                                                    char* msg, size_t cap) {
    std::function<void()> body = [=] { missing_barrier(buf, out); };
    return report(emu::launch(dim3(1), dim3(n), body, 0, emu::Schedule(schedule), seed), msg, cap);
}

namespace {
// Planted bugs for the emulator's checks (and their fixed twins, which must run clean).
// Neighbour exchange through instrumented shared memory, with or without the barrier.
__global__ void exchange(float* out, bool barrier) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    smem_store(sm + threadIdx.x, float(threadIdx.x));
    if (barrier) __syncthreads();
    out[threadIdx.x] = smem_load(sm + (threadIdx.x + 1) % blockDim.x);
}

// A tile loop that forgets the barrier after the reads: the next tile's cp.async overwrites
// rows other threads may still read (write after read).
__global__ void tile_loop(const float* src, float* out, bool second_barrier) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    float acc = 0.0f;
    for (int t = 0; t < 2; ++t) {
        cp_async_cg16(sm + 4 * threadIdx.x, src + 128 * t + 4 * threadIdx.x, 16);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        acc += smem_load(sm + 4 * ((threadIdx.x + 1) % blockDim.x));
        if (second_barrier) __syncthreads();
    }
    out[threadIdx.x] = acc;
}

// cp.async reading 16 bytes past the end of `src` (the last thread), or writing past the end
// of shared memory.
__global__ void cp_async_out_of_bounds(const float* src, bool past_smem) {
    float* sm = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    const unsigned shift = past_smem ? 0u : 1u;
    float* dst = sm + 4 * (threadIdx.x + (past_smem ? 1u : 0u));
    cp_async_cg16(dst, src + 4 * (threadIdx.x + shift), 16);
    cp_async_commit();
    cp_async_wait<0>();
}
}  // namespace

// which: 0 exchange with its barrier (clean), 1 exchange without (race), 2 tile loop with
// both barriers (clean), 3 tile loop without the second (race), 4 cp.async past the end of
// its source buffer, 5 cp.async past the end of shared memory. One block of 32 threads.
extern "C" int ringattn_emu_selftest_checks(int which, int schedule, char* msg, size_t cap) {
    alignas(16) static thread_local float src[256];
    alignas(16) static thread_local float out[32];
    for (int i = 0; i < 256; ++i) src[i] = float(i);
    emu::LaunchConfig c;
    c.grid = dim3(1);
    c.block = dim3(32);
    c.schedule = emu::Schedule(schedule);
    c.smem_bytes = 32 * 4 * sizeof(float);
    std::function<void()> body;
    switch (which) {
        case 0:
        case 1:
            body = [which] { exchange(out, which == 0); };
            break;
        case 2:
        case 3:
            body = [which] { tile_loop(src, out, which == 2); };
            break;
        default:
            // The source is the first 128 floats only: thread 31 of case 4 reads past them.
            c.globals = {{src, 128 * sizeof(float), "src"}, {out, sizeof out, "out"}};
            body = [which] { cp_async_out_of_bounds(src, which == 5); };
            break;
    }
    return report(emu::launch(c, body), msg, cap);
}
