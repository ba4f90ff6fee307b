// Kernels by name, for the stand-in CUDA driver (emulated-gpu/): each kernels*.cpp lists the
// `extern "C" __global__` entry points of its family with their params struct (size,
// alignment, and where its tensor maps sit), and ringattn_emu_launch_named (kernels.cpp) runs
// one with a params block copied as the driver copies it into the parameter space, every live
// device allocation registered for the bounds checks, and what the launch read and wrote of
// each recorded (the driver's cross-stream race detector). Mirrored in src/emu/named.rs.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct EmuNamedKernel {
    const char* name;
    uint32_t param_bytes;
    uint32_t param_align;
    // Offsets of the tensor maps (TMA operands) inside the params struct: each must land on a
    // 128-byte multiple of the parameter space (CUDA 13's CUtensorMap is alignas(128)).
    uint32_t tensor_maps;
    uint32_t tensor_map_offsets[6];
    void (*run)(const void* params);
};
static_assert(sizeof(EmuNamedKernel) == 56, "EmuNamedKernel is mirrored in Rust");

// One device allocation registered with a named launch, and what the launch did to it
// (lowest and one past the highest byte offset read and written; lo > hi: none).
struct EmuGlobal {
    uint64_t base;
    uint64_t bytes;
    uint64_t read_lo, read_hi, write_lo, write_hi;
};
static_assert(sizeof(EmuGlobal) == 48, "EmuGlobal is mirrored in Rust");

#define RINGATTN_EMU_NAMED(FN, P) \
    {#FN, uint32_t(sizeof(P)), uint32_t(alignof(P)), 0, {}, [](const void* a) { FN(*static_cast<const P*>(a)); }},
#define RINGATTN_EMU_NAMED_MAPS(FN, P, N, ...)                   \
    {#FN, uint32_t(sizeof(P)), uint32_t(alignof(P)), N, {__VA_ARGS__}, \
     [](const void* a) { FN(*static_cast<const P*>(a)); }},
#define RINGATTN_EMU_NAMED_TABLE(FAMILY, TABLE)                                                 \
    extern "C" const EmuNamedKernel* ringattn_emu_named_##FAMILY(size_t* n) {                   \
        *n = sizeof(TABLE) / sizeof(TABLE[0]);                                                  \
        return TABLE;                                                                           \
    }
