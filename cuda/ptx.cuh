// Every inline-PTX wrapper of the kernels, each with its emulated twin: the device path under
// nvcc (`__CUDACC__`), the emulator's otherwise. No other file holds PTX. Fragment layouts
// follow the PTX ISA tables (../shared/reference/ptx-and-emulation.md §1).
#pragma once
#include <stdint.h>

#ifdef __CUDACC__

// D = A·B + C for one warp: A 16x16 (row), B 16x8 (col), bf16 inputs, f32 accumulate.
// Lane L (g = L/4, t = L%4): a[0] = {A[g][2t], A[g][2t+1]}, a[1] = {A[g+8][2t], A[g+8][2t+1]},
// a[2] = {A[g][2t+8], A[g][2t+9]}, a[3] = {A[g+8][2t+8], A[g+8][2t+9]} (low half first);
// b[0] = {B[2t][g], B[2t+1][g]}, b[1] = {B[2t+8][g], B[2t+9][g]};
// c, d = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}.
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                  const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// The same with f16 inputs.
__device__ __forceinline__ void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                 const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// ldmatrix: loads 8x8 b16 matrices from shared memory. Threads 8j..8j+7 supply the 16-byte
// aligned row addresses of matrix j (x1: j = 0; x2: j < 2; x4: j < 4). Without .trans lane L
// receives in r[j] row L/4, columns 2(L%4) and 2(L%4)+1 of matrix j (low half first); with
// .trans it receives the elements at rows 2(L%4) and 2(L%4)+1, column L/4.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_u32(row)));
}

// cp.async.cg: copies 16 bytes global -> shared asynchronously, reading only `src_bytes`
// (0..16) and zero-filling the rest. commit_group closes this thread's pending copies into a
// group; wait_group<N> returns when at most N of its groups are pending. The data is visible
// to other threads only after a barrier.
__device__ __forceinline__ void cp_async_cg16(void* dst_smem, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst_smem)), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x with ex2.approx (at most 2 ulp; -inf gives +0).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#else  // the emulated twins

namespace emu {

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float f16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);  // zero or subnormal
        if (sign) f = -f;
        return f;
    }
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);  // inf / nan
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    std::memcpy(&f, &bits, 4);
    return f;
}

// Products of bf16 or f16 values are exact in f64; they are summed in f64, C added, and the
// result rounded once to f32 (PTX leaves the accumulation order unspecified).
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bool bf16) {
    const auto a01 = warp_allgather(uint64_t(a[0]) | (uint64_t(a[1]) << 32));
    const auto a23 = warp_allgather(uint64_t(a[2]) | (uint64_t(a[3]) << 32));
    const auto b01 = warp_allgather(uint64_t(b[0]) | (uint64_t(b[1]) << 32));
    auto cvt = [bf16](uint32_t reg, int half) {
        const uint16_t h = uint16_t(half ? reg >> 16 : reg & 0xffffu);
        return double(bf16 ? bf16_to_float(h) : f16_to_float(h));
    };
    double A[16][16], B[16][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        const unsigned g = lane >> 2, t = lane & 3;
        const uint32_t r[4] = {uint32_t(a01[lane]), uint32_t(a01[lane] >> 32), uint32_t(a23[lane]),
                               uint32_t(a23[lane] >> 32)};
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = cvt(r[0], h);
            A[g + 8][2 * t + h] = cvt(r[1], h);
            A[g][2 * t + 8 + h] = cvt(r[2], h);
            A[g + 8][2 * t + 8 + h] = cvt(r[3], h);
            B[2 * t + h][g] = cvt(uint32_t(b01[lane]), h);
            B[2 * t + 8 + h][g] = cvt(uint32_t(b01[lane] >> 32), h);
        }
    }
    const unsigned lane = lane_id(), g = lane >> 2, t = lane & 3;
    const unsigned rows[4] = {g, g, g + 8, g + 8};
    const unsigned cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        double acc = 0.0;
        for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
        d[i] = float(acc + double(c[i]));
    }
}

// ldmatrix twin: the warp publishes its row addresses, then each lane gathers its halves.
inline void ldmatrix(uint32_t* r, int count, bool trans, const void* row) {
    const auto addr = warp_allgather(reinterpret_cast<uintptr_t>(row));
    const unsigned lane = lane_id();
    for (int j = 0; j < count; ++j) {
        for (int i = 0; i < 8; ++i) {
            if (addr[8 * j + i] % 16 != 0) {
                fail("ldmatrix: row address of lane " + std::to_string(8 * j + i) + " is not 16-byte aligned");
            }
        }
        uint16_t h[2];
        for (int half = 0; half < 2; ++half) {
            unsigned mrow, mcol;
            if (trans) {
                mrow = 2 * (lane % 4) + half;
                mcol = lane / 4;
            } else {
                mrow = lane / 4;
                mcol = 2 * (lane % 4) + half;
            }
            std::memcpy(&h[half], reinterpret_cast<const unsigned char*>(addr[8 * j + mrow]) + 2 * mcol, 2);
        }
        r[j] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
    }
}

// cp.async twin: the copy is recorded and its destination poisoned at issue; it happens when
// wait_group retires its group, as a write by the issuing thread.
inline void cp_async(void* dst, const void* src, unsigned src_bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
        fail("cp.async: 16-byte copy with an address that is not 16-byte aligned");
        return;
    }
    if (src_bytes > 16) {
        fail("cp.async: src-size " + std::to_string(src_bytes) + " exceeds the 16-byte copy");
        return;
    }
    std::memset(dst, 0xFF, 16);
    current->uncommitted.push_back(AsyncCopy{dst, src, src_bytes, 16 - src_bytes});
}

inline void cp_async_commit_group() {
    Thread* t = current;
    t->groups.push_back(std::move(t->uncommitted));
    t->uncommitted.clear();
}

inline void cp_async_wait_group(int n) {
    Thread* t = current;
    while (t->groups.size() > size_t(n)) {
        for (const AsyncCopy& c : t->groups.front()) {
            std::memcpy(c.dst, c.src, c.bytes);
            std::memset(static_cast<unsigned char*>(c.dst) + c.bytes, 0, c.zero_fill);
        }
        t->groups.erase(t->groups.begin());
    }
}

}  // namespace emu

inline void cp_async_cg16(void* dst_smem, const void* src, unsigned src_bytes) {
    ::emu::cp_async(dst_smem, src, src_bytes);
}
inline void cp_async_commit() { ::emu::cp_async_commit_group(); }
template <int N>
inline void cp_async_wait() {
    ::emu::cp_async_wait_group(N);
}

// ex2.approx twin: the correctly rounded 2^x (within the instruction's 2 ulp), -inf -> +0,
// subnormal results flushed to zero as .ftz does.
inline float ex2_approx(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline void ldmatrix_x4(uint32_t r[4], const void* row) { ::emu::ldmatrix(r, 4, false, row); }
inline void ldmatrix_x2(uint32_t r[2], const void* row) { ::emu::ldmatrix(r, 2, false, row); }
inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) { ::emu::ldmatrix(r, 4, true, row); }
inline void ldmatrix_x2_trans(uint32_t r[2], const void* row) { ::emu::ldmatrix(r, 2, true, row); }

inline void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ::emu::mma_m16n8k16(d, a, b, c, true);
}

inline void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ::emu::mma_m16n8k16(d, a, b, c, false);
}

#endif
