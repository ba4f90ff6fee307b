// The launch record the Rust side passes to the emulated entry points (kernels*.cpp):
// geometry (computed in Rust, as the CUDA backend does) and emulator options, mirrored in
// src/emu/mod.rs (`EmuLaunch`); and the entry points' shared helpers (only where the
// emulator is included: define RINGATTN_EMU_ENTRY_HELPERS first).
#pragma once
#include <stdint.h>

struct EmuLaunch {
    uint32_t grid[3];
    uint32_t block;
    uint64_t smem_bytes;
    int32_t schedule;  // 0 forward, 1 reverse, 2 seeded random fiber order (emu::Schedule)
    uint32_t workers;  // OS threads for blocks, 0: one per core
    uint64_t seed;
    uint64_t* block_counts;  // null, or per block: cp.async copies, mma multiply-adds (emu::LaunchConfig)
};
static_assert(sizeof(EmuLaunch) == 48, "EmuLaunch is mirrored in Rust");

#ifdef RINGATTN_EMU_ENTRY_HELPERS
#include <cstdio>
#include <string>

#include "params.h"

namespace emu_entry {
inline int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) {
        std::snprintf(msg, cap, "%s", err.c_str());
    }
    return 1;
}

inline emu::LaunchConfig config(const EmuLaunch& l) {
    emu::LaunchConfig c;
    c.grid = dim3(l.grid[0], l.grid[1], l.grid[2]);
    c.block = dim3(l.block);
    c.smem_bytes = l.smem_bytes;
    c.schedule = emu::Schedule(l.schedule);
    c.seed = l.seed;
    c.workers = l.workers;
    c.block_counts = l.block_counts;
    return c;
}

inline size_t bytes(int64_t n, size_t elem) { return size_t(n) * elem; }

inline void add_mask(emu::LaunchConfig& c, const MaskParams& m, int64_t s_q, int64_t s_k) {
    c.globals.push_back({m.q_pos, bytes(s_q, 8), "q_pos"});
    c.globals.push_back({m.k_pos, bytes(s_k, 8), "k_pos"});
    if (m.q_doc) c.globals.push_back({m.q_doc, bytes(s_q, 4), "q_doc"});
    if (m.k_doc) c.globals.push_back({m.k_doc, bytes(s_k, 4), "k_doc"});
    const int64_t granules = (s_k + MASK_GRANULE - 1) / MASK_GRANULE;
    if (m.k_bounds && granules > 0) c.globals.push_back({m.k_bounds, bytes(2 * granules, 8), "k_bounds"});
    if (m.k_doc_bounds && granules > 0) c.globals.push_back({m.k_doc_bounds, bytes(2 * granules, 4), "k_doc_bounds"});
    const int64_t q_granules = (s_q + MASK_GRANULE - 1) / MASK_GRANULE;
    if (m.q_bounds && q_granules > 0) c.globals.push_back({m.q_bounds, bytes(2 * q_granules, 8), "q_bounds"});
    if (m.q_doc_bounds && q_granules > 0) c.globals.push_back({m.q_doc_bounds, bytes(2 * q_granules, 4), "q_doc_bounds"});
}

// The buffers a flash forward (either family) reads and writes, and its mask's.
inline void add_forward_globals(emu::LaunchConfig& c, const FlashFwdParams& p) {
    const int64_t q_rows = p.x.b * p.x.s_q * p.x.h_q, kv_rows = p.x.b * p.x.s_k * p.x.h_kv;
    const int64_t q = q_rows * p.x.d_qk, o = q_rows * p.x.d_v, k = kv_rows * p.x.d_qk, v = kv_rows * p.x.d_v;
    c.globals = {{p.x.q, bytes(q, 2), "q"}, {p.x.k, bytes(k, 2), "k"},           {p.x.v, bytes(v, 2), "v"},
                 {p.o, bytes(o, 4), "o"}, {p.lse, bytes(p.x.b * p.x.h_q * p.x.s_q, 4), "lse"}};
    if (p.o16) c.globals.push_back({p.o16, bytes(o, 2), "o16"});
    add_mask(c, p.x.mask, p.x.s_q, p.x.s_k);
}
}  // namespace emu_entry
using namespace emu_entry;
#endif
