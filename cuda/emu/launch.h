// The launch record the Rust side passes to the emulated entry points of kernels.cpp:
// geometry (computed in Rust, as the CUDA backend does) and emulator options. Mirrored in
// src/emu/mod.rs (`EmuLaunch`).
#pragma once
#include <stdint.h>

struct EmuLaunch {
    uint32_t grid[3];
    uint32_t block;
    uint64_t smem_bytes;
    int32_t schedule;  // 0 forward, 1 reverse, 2 seeded random fiber order (emu::Schedule)
    uint32_t workers;  // OS threads for blocks, 0: one per core
    uint64_t seed;
};
static_assert(sizeof(EmuLaunch) == 40, "EmuLaunch is mirrored in Rust");
