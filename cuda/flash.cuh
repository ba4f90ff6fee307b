// Shared pieces of the flash attention kernels (flash_fwd.cu, flash_bwd.cu): element types,
// the visibility rule, K/V tile loads with cp.async, and the shared-memory layouts that the
// launchers mirror (src/kernels.rs, `kernels::geometry`).
//
// This first generation is a simple tiled kernel without tensor cores: one CUDA thread owns
// one query row (forward, dq) or one key row (dk, dv), keeps its row and its f32 accumulators
// in shared memory (rows padded by one float against bank conflicts), and loops over tiles of
// 32 rows of the other side, staged in shared memory as 16-bit values by cp.async.
#pragma once
#include "common.cuh"

// Rows of the other side per inner tile (the per-thread score arrays are this long).
constexpr int kTile = 32;

// Element types: 16-bit storage, f32 arithmetic.
struct Bf16 {
    __device__ static float to_float(uint16_t h) { return bf16_to_f32(h); }
};
struct F16 {
    __device__ static float to_float(uint16_t h) { return f16_to_f32(h); }
};

// Whether key row j is visible to query row i (see MaskParams).
__device__ __forceinline__ bool flash_visible(const MaskParams& m, int64_t i, int64_t j) {
    const int64_t pq = gmem_load(m.q_pos + i);
    const int64_t pk = gmem_load(m.k_pos + j);
    if (m.window_left >= 0 && pk < pq - m.window_left) return false;
    if (m.window_right >= 0 && pk > pq + m.window_right) return false;
    if (m.q_doc != nullptr && gmem_load(m.q_doc + i) != gmem_load(m.k_doc + j)) return false;
    return true;
}

// Rounds a byte offset up to 16 (cp.async and ldmatrix need 16-byte aligned rows).
__device__ __host__ __forceinline__ int64_t flash_align16(int64_t x) { return (x + 15) / 16 * 16; }

// Stages rows r0 .. r0 + kTile of a [b, s, h, d] 16-bit tensor (batch bi, head hi) into
// `tile` ([kTile][d], row-major, 16-byte aligned) with cp.async, 16 bytes per copy; rows past
// s are zero-filled. The caller commits and waits.
__device__ __forceinline__ void flash_stage_tile(uint16_t* tile, const uint16_t* x, int64_t bi, int64_t s, int64_t h,
                                                 int64_t hi, int64_t d, int64_t r0) {
    const int64_t chunks = d / 8;
    for (int64_t c = threadIdx.x; c < kTile * chunks; c += blockDim.x) {
        const int64_t r = c / chunks, col = (c % chunks) * 8;
        const int64_t row = r0 + r;
        const int64_t src_row = row < s ? row : s - 1;  // a valid address even when nothing is read
        cp_async_cg16(tile + r * d + col, x + ((bi * s + src_row) * h + hi) * d + col, row < s ? 16u : 0u);
    }
}

// Shared-memory layouts, in bytes, for `rows` threads per block and head dimension d (the
// launchers compute the same; src/kernels.rs tests the mirror):
//   forward:  q, o accumulators [rows][d+1] f32, then K and V tiles [kTile][d] 16-bit;
//   dq:       q, d_o, dq accumulators [rows][d+1] f32, then K and V tiles;
//   dk, dv:   k, v, dk, dv accumulators [rows][d+1] f32, then q and d_o tiles [kTile][d]
//             16-bit, then lse*log2(e) and delta of the tile's rows [kTile] f32.
__device__ __host__ __forceinline__ int64_t flash_rows_bytes(int64_t rows, int64_t d, int64_t n) {
    return flash_align16(n * rows * (d + 1) * 4);
}
__device__ __host__ __forceinline__ int64_t flash_tiles_bytes(int64_t d) { return 2 * kTile * d * 2; }
