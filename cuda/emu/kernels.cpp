// The kernels of cuda/*.cu compiled for the host against the emulator, with one C entry
// point per kernel family that launches it with the geometry the caller chose (src/emu/
// computes it exactly as the CUDA backend does), registers the family's buffers for the
// bounds checks, and reports errors (called from src/emu/).
#include "emu/emu.h"
#include "emu/launch.h"

#include "flash_bwd.cu"
#include "flash_fwd.cu"
#include "merge.cu"

#include <cstring>


namespace {
int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) {
        std::snprintf(msg, cap, "%s", err.c_str());
    }
    return 1;
}

emu::LaunchConfig config(const EmuLaunch& l) {
    emu::LaunchConfig c;
    c.grid = dim3(l.grid[0], l.grid[1], l.grid[2]);
    c.block = dim3(l.block);
    c.smem_bytes = l.smem_bytes;
    c.schedule = emu::Schedule(l.schedule);
    c.seed = l.seed;
    c.workers = l.workers;
    return c;
}

size_t bytes(int64_t n, size_t elem) { return size_t(n) * elem; }

void add_mask(emu::LaunchConfig& c, const MaskParams& m, int64_t s_q, int64_t s_k) {
    c.globals.push_back({m.q_pos, bytes(s_q, 8), "q_pos"});
    c.globals.push_back({m.k_pos, bytes(s_k, 8), "k_pos"});
    if (m.q_doc) c.globals.push_back({m.q_doc, bytes(s_q, 4), "q_doc"});
    if (m.k_doc) c.globals.push_back({m.k_doc, bytes(s_k, 4), "k_doc"});
}
}  // namespace

// Merge; geometry from the caller (src/kernels.rs: one warp per LSE row).
extern "C" int ringattn_emu_merge_f32(MergeParams p, EmuLaunch l, char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t o = p.b * p.s * p.h * p.d, st = p.b * p.h * p.s;
    c.globals = {{p.o_acc, bytes(o, 4), "o_acc"},
                 {p.lse_acc, bytes(st, 4), "lse_acc"},
                 {p.o_part, bytes(o, 4), "o_part"},
                 {p.lse_part, bytes(st, 4), "lse_part"}};
    std::function<void()> body = [p] { ringattn_merge_f32(p); };
    return report(emu::launch(c, body), msg, cap);
}

// Flash forward; `bf16`: 1 for bf16 inputs, 0 for f16; `dclass` the head-dim class of the
// entry point (src/kernels.rs `geometry::forward`).
extern "C" int ringattn_emu_flash_fwd(FlashFwdParams p, int bf16, int dclass, EmuLaunch l, char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t q = p.b * p.s_q * p.h_q * p.d, kv = p.b * p.s_k * p.h_kv * p.d;
    c.globals = {{p.q, bytes(q, 2), "q"}, {p.k, bytes(kv, 2), "k"},           {p.v, bytes(kv, 2), "v"},
                 {p.o, bytes(q, 4), "o"}, {p.lse, bytes(p.b * p.h_q * p.s_q, 4), "lse"}};
    if (p.o16) c.globals.push_back({p.o16, bytes(q, 2), "o16"});
    add_mask(c, p.mask, p.s_q, p.s_k);
    void (*kernel)(FlashFwdParams) = nullptr;
#define RINGATTN_EMU_FWD_CASE(D)                                                       \
    case D:                                                                            \
        kernel = bf16 ? ringattn_flash_fwd_bf16_d##D : ringattn_flash_fwd_f16_d##D; \
        break;
    switch (dclass) {
        RINGATTN_EMU_FWD_CASE(32)
        RINGATTN_EMU_FWD_CASE(64)
        RINGATTN_EMU_FWD_CASE(96)
        RINGATTN_EMU_FWD_CASE(128)
        RINGATTN_EMU_FWD_CASE(192)
        RINGATTN_EMU_FWD_CASE(256)
        default:
            return report("no forward kernel for head-dim class " + std::to_string(dclass), msg, cap);
    }
#undef RINGATTN_EMU_FWD_CASE
    std::function<void()> body = [p, kernel] { kernel(p); };
    return report(emu::launch(c, body), msg, cap);
}

// Flash backward; `kernel`: 0 rowsum (delta), 1 dq, 2 dk and dv; `bf16` as above; `dclass`
// the head-dim class of the dq and dkdv entry points.
extern "C" int ringattn_emu_flash_bwd(FlashBwdParams p, int kernel, int bf16, int dclass, EmuLaunch l, char* msg,
                                      size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t q = p.b * p.s_q * p.h_q * p.d, kv = p.b * p.s_k * p.h_kv * p.d, st = p.b * p.h_q * p.s_q;
    c.globals = {{p.q, bytes(q, 2), "q"},          {p.k, bytes(kv, 2), "k"},         {p.v, bytes(kv, 2), "v"},
                 {p.o, bytes(q, 4), "o"},          {p.d_o, bytes(q, 2), "d_o"},      {p.lse, bytes(st, 4), "lse"},
                 {p.delta, bytes(st, 4), "delta"}, {p.dq, bytes(q, 4), "dq"},        {p.dk, bytes(kv, 4), "dk"},
                 {p.dv, bytes(kv, 4), "dv"}};
    add_mask(c, p.mask, p.s_q, p.s_k);
    void (*fn)(FlashBwdParams) = nullptr;
    if (kernel == 0) {
        fn = bf16 ? ringattn_flash_bwd_rowsum_bf16 : ringattn_flash_bwd_rowsum_f16;
    } else {
#define RINGATTN_EMU_BWD_CASE(D)                                                                         \
    case D:                                                                                              \
        if (kernel == 1) {                                                                               \
            fn = bf16 ? ringattn_flash_bwd_dq_bf16_d##D : ringattn_flash_bwd_dq_f16_d##D;              \
        } else {                                                                                         \
            fn = bf16 ? ringattn_flash_bwd_dkdv_bf16_d##D : ringattn_flash_bwd_dkdv_f16_d##D;          \
        }                                                                                                \
        break;
        switch (dclass) {
            RINGATTN_EMU_BWD_CASE(32)
            RINGATTN_EMU_BWD_CASE(64)
            RINGATTN_EMU_BWD_CASE(96)
            RINGATTN_EMU_BWD_CASE(128)
            RINGATTN_EMU_BWD_CASE(192)
            RINGATTN_EMU_BWD_CASE(256)
            default:
                return report("no backward kernel for head-dim class " + std::to_string(dclass), msg, cap);
        }
#undef RINGATTN_EMU_BWD_CASE
    }
    std::function<void()> body = [p, fn] { fn(p); };
    return report(emu::launch(c, body), msg, cap);
}
