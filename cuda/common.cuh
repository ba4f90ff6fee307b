// Included first by every kernel family: the same kernel source builds for the device with
// nvcc and for the host against the emulator (cuda/emu/emu.h, when not compiled by nvcc).
#pragma once

#ifdef __CUDACC__
#define RINGATTN_UNROLL _Pragma("unroll")
#define RINGATTN_ROLLED _Pragma("unroll 1")
// Unrolled `n` times (an integral constant expression, e.g. a constexpr of the kernel).
#define RINGATTN_UNROLL_BY(n) _Pragma(RINGATTN_STR(unroll(n)))
#define RINGATTN_STR(x) #x
#else
#define RINGATTN_UNROLL  // the emulator gains nothing from unrolling
#define RINGATTN_ROLLED
#define RINGATTN_UNROLL_BY(n) (void)(n);
#endif

#ifdef __CUDACC__
// The block's dynamic shared memory, 64-byte aligned (size given at launch).
__device__ __forceinline__ unsigned char* ringattn_dynamic_smem() {
    extern __shared__ __align__(64) unsigned char ringattn_smem_[];
    return ringattn_smem_;
}
#define RINGATTN_DYNAMIC_SMEM() ringattn_dynamic_smem()

// Shared and global accesses that the emulator checks (bounds, races): plain on the device.
template <typename T>
__device__ __forceinline__ T smem_load(const T* p) {
    return *p;
}
template <typename T>
__device__ __forceinline__ void smem_store(T* p, T v) {
    *p = v;
}
template <typename T>
__device__ __forceinline__ T gmem_load(const T* p) {
    return *p;
}
template <typename T>
__device__ __forceinline__ void gmem_store(T* p, T v) {
    *p = v;
}
#else
#include "emu/emu.h"
#endif

#include "params.h"
#include "ptx.cuh"
