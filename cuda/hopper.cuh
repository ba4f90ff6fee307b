// Shared pieces of the Hopper (sm_90a) kernels, flash_fwd_hopper.cu and flash_bwd_hopper.cu:
// the wgmma descriptors of the 128-byte swizzled tiles the tensor copies place, and the
// wgmma input type of an element type.
#pragma once
#include "flash.cuh"

// The descriptor of a 128-byte swizzled operand: a tile of rows of 64 16-bit columns in
// 128-byte rows, `col_blocks` of them `block_bytes` apart (a tensor copy's boxes), from a
// 1024-byte aligned base (the swizzle's repeat).
// K-major (the contiguous columns are the K dimension: Q, K as operands of Q K^T): K-step s
// (columns 16s ...) starts in column block 16s / 64, 32 (16s % 64) bytes in; SBO 1024 (8
// rows). MN-major (the rows are the K dimension: V as B of P V, dO and Q as B of the
// backward's P^T dO and dS^T Q, K as B and dS^T as A of dS K): K-step s (rows 16s ...) starts
// 16s rows in; LBO the column blocks' distance, SBO 1024.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t base, uint32_t block_bytes, int s) {
    return make_wgmma_desc(base + uint32_t(16 * s / 64) * block_bytes + uint32_t(16 * s % 64) * 2, 16, 1024,
                           WgmmaSwizzle::k128B);
}
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t base, uint32_t block_bytes, int s) {
    return make_wgmma_desc(base + uint32_t(s) * 16 * 128, block_bytes, 1024, WgmmaSwizzle::k128B);
}

template <typename T>
__host__ __device__ constexpr WgmmaInput wgmma_input() {
    return std::is_same<T, Bf16>::value ? WgmmaInput::kBF16 : WgmmaInput::kF16;
}
