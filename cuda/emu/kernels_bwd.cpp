// The flash backward kernels of cuda/flash_bwd.cu compiled for the host against the emulator, with its C entry point: it
// launches the kernel with the geometry the caller chose (src/emu/ computes it exactly as the
// CUDA backend does), registers the family's buffers for the bounds checks, and reports
// errors. One translation unit per family, so that they compile in parallel.
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"

#include "flash_bwd.cu"

// Flash backward; `kernel`: 0 rowsum (delta), 1 dq, 2 dk and dv, 3 dk, dv and atomic dq;
// `bf16` as above; `dclass`
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
        } else if (kernel == 2) {                                                                        \
            fn = bf16 ? ringattn_flash_bwd_dkdv_bf16_d##D : ringattn_flash_bwd_dkdv_f16_d##D;          \
        } else {                                                                                         \
            fn = bf16 ? ringattn_flash_bwd_dkdvq_bf16_d##D : ringattn_flash_bwd_dkdvq_f16_d##D;        \
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
