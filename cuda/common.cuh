// Included first by every kernel family: the same kernel source builds for the device with
// nvcc and for the host against the emulator (cuda/emu/emu.h, when not compiled by nvcc).
#pragma once

#ifdef __CUDACC__
// The block's dynamic shared memory, 64-byte aligned (size given at launch).
__device__ __forceinline__ unsigned char* ringattn_dynamic_smem() {
    extern __shared__ __align__(64) unsigned char ringattn_smem_[];
    return ringattn_smem_;
}
#define RINGATTN_DYNAMIC_SMEM() ringattn_dynamic_smem()
#else
#include "emu/emu.h"
#endif

#include "params.h"
#include "ptx.cuh"
