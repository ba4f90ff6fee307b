// Tile configurations and shared pieces of the tensor-core flash kernels (FlashAttention-2
// style): per head-dimension class D (the head dim rounded up: 32, 64, 96, 128, 192, 256)
// a traits struct fixes the tiles, the shared-memory layout and the register budget, with
// static asserts. Tiles live in shared memory as 16-bit rows of 16-byte chunks whose chunk
// index is XOR-swizzled by the row (so that ldmatrix's eight row addresses hit distinct
// banks); columns past the real head dim are zero-filled by cp.async.
#pragma once
#include <type_traits>

#include "flash.cuh"

template <int D>
struct FwdTraits {
    static_assert(D % 32 == 0 || D == 96, "head-dim classes: 32, 64, 96, 128, 192, 256");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBlockM = 16 * kWarps;          // query rows per block, 16 per warp
    static constexpr int kBlockN = D <= 128 ? 64 : 32;   // keys per tile
    static constexpr int kChunks = D / 8;                // 16-byte chunks per row
    static constexpr int kRowChunks = kChunks <= 8 ? kChunks : (kChunks + 7) / 8 * 8;
    static constexpr int kSwizzle = (kChunks < 8 ? kChunks : 8) - 1;
    static constexpr int kStride = kRowChunks * 8;       // elements per shared row
    static constexpr bool kQInRegs = D <= 128;           // Q fragments kept in registers
    static constexpr int kSmemQ = kBlockM * kStride * 2;
    static constexpr int kSmemKV = kBlockN * kStride * 2;  // one K or V stage
    static constexpr int kSmem = kSmemQ + 4 * kSmemKV;     // Q, K and V double-buffered
    static_assert(kSmem <= 99 * 1024, "fits the 99 KiB opt-in limit of every sm_80+ GPU");
    // f32 registers per thread for the O and S accumulators (+ Q fragments when kept).
    static constexpr int kAccRegs = D / 2 + kBlockN / 2 + (kQInRegs ? D / 4 : 0);
    static_assert(kAccRegs <= 176, "accumulators leave room for addressing within 255 registers");
    static_assert(kBlockN / 2 <= 32, "one visibility bit per S element in a 32-bit mask");
};

// Element offset of chunk c of row r in a swizzled tile.
template <int kStride, int kSwizzle>
__device__ __forceinline__ int swz(int r, int c) {
    return r * kStride + ((c ^ (r & kSwizzle)) << 3);
}

// Stages rows r0 .. r0 + rows of a [b, s, h, d] 16-bit tensor (batch bi, head hi) into the
// swizzled `tile` with cp.async; rows past s and columns past d are zero-filled.
template <int kRows, int kChunks, int kStride, int kSwizzle, int kThreads>
__device__ __forceinline__ void stage_swizzled(uint16_t* tile, const uint16_t* x, int64_t bi, int64_t s, int64_t h,
                                               int64_t hi, int64_t d, int64_t r0) {
    for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
        const int r = c / kChunks, col = c % kChunks;
        const int64_t row = r0 + r;
        const bool in = row < s && col * 8 < d;
        const uint16_t* src = in ? x + ((bi * s + row) * h + hi) * d + col * 8 : x;
        cp_async_cg16(tile + swz<kStride, kSwizzle>(r, col), src, in ? 16u : 0u);
    }
}

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    if constexpr (std::is_same<T, Bf16>::value) {
        mma_m16n8k16_bf16(d, a, b, d);
    } else {
        mma_m16n8k16_f16(d, a, b, d);
    }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same<T, Bf16>::value) {
        return pack_bf16x2(lo, hi);
    } else {
        return pack_f16x2(lo, hi);
    }
}
