// The Hopper backward kernels of cuda/flash_bwd_hopper.cu compiled for the host against the
// emulator, with their C entry point (as kernels_fwd_hopper.cpp for the Hopper forward): the
// emulator runs the sm_90a family whatever the host; the tensor maps are the emulator's
// encoding (src/kernels/tensor_map.rs). The kvbound, rowunit, rowsum and dqconvert kernels
// around it are flash_bwd.cu's (kernels_bwd.cpp).
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"
#include "emu/named.h"

#include "flash_bwd_hopper.cu"

// `fixed`: 1 for fixed-point dq (dkdvqfx), 0 for f32 atomics (dkdvq); `bf16`: 1 for bf16
// inputs, 0 for f16; `dclass` 64, 128 or 256 (src/kernels.rs `geometry::dkdv_hopper`).
extern "C" int ringattn_emu_flash_bwd_hopper(const FlashBwdHopperParams* hp, int fixed, int bf16, int dclass,
                                             EmuLaunch l, char* msg, size_t cap) {
    const FlashBwdHopperParams params = *hp;
    const FlashBwdParams& p = params.p;
    emu::LaunchConfig c = config(l);
    const int64_t q_rows = p.x.b * p.x.s_q * p.x.h_q, kv_rows = p.x.b * p.x.s_k * p.x.h_kv, st = p.x.b * p.x.h_q * p.x.s_q;
    const int64_t q = q_rows * p.x.d_qk, o = q_rows * p.x.d_v, k = kv_rows * p.x.d_qk, v = kv_rows * p.x.d_v;
    c.globals = {{p.x.q, bytes(q, 2), "q"},           {p.x.k, bytes(k, 2), "k"},          {p.x.v, bytes(v, 2), "v"},
                 {p.d_o, bytes(o, 2), "d_o"},       {p.lse, bytes(st, 4), "lse"},     {p.delta, bytes(st, 4), "delta"},
                 {p.dq, bytes(q, 4), "dq"},         {p.dk, bytes(k, 4), "dk"},        {p.dv, bytes(v, 4), "dv"},
                 {p.dq_unit, bytes(st, 4), "dq_unit"}};
    add_mask(c, p.x.mask, p.x.s_q, p.x.s_k);
    void (*kernel)(FlashBwdHopperParams) = nullptr;
#define RINGATTN_EMU_BWD_HOPPER_CASE(D)                                                                          \
    case D:                                                                                                      \
        if (fixed) {                                                                                             \
            kernel = bf16 ? ringattn_hopper_flash_bwd_dkdvqfx_bf16_d##D : ringattn_hopper_flash_bwd_dkdvqfx_f16_d##D; \
        } else {                                                                                                 \
            kernel = bf16 ? ringattn_hopper_flash_bwd_dkdvq_bf16_d##D : ringattn_hopper_flash_bwd_dkdvq_f16_d##D;     \
        }                                                                                                        \
        break;
    switch (dclass) {
        RINGATTN_EMU_BWD_HOPPER_CASE(64)
        RINGATTN_EMU_BWD_HOPPER_CASE(128)
        RINGATTN_EMU_BWD_HOPPER_CASE(256)
        default:
            return report("no Hopper backward kernel for head-dim class " + std::to_string(dclass), msg, cap);
    }
#undef RINGATTN_EMU_BWD_HOPPER_CASE
    std::function<void()> body = [params, kernel] { kernel(params); };
    return report(emu::launch(c, body), msg, cap);
}

// Every entry point by name (emu/named.h), with where its tensor maps sit.
#define RINGATTN_EMU_BWD_HOPPER_NAMED1(KIND, NAME, D)                                                      \
    RINGATTN_EMU_NAMED_MAPS(ringattn_hopper_flash_bwd_##KIND##_##NAME##_d##D, FlashBwdHopperParams, 6,     \
                            uint32_t(offsetof(FlashBwdHopperParams, q)), uint32_t(offsetof(FlashBwdHopperParams, k)), \
                            uint32_t(offsetof(FlashBwdHopperParams, v)), uint32_t(offsetof(FlashBwdHopperParams, d_o)), \
                            uint32_t(offsetof(FlashBwdHopperParams, lse)), uint32_t(offsetof(FlashBwdHopperParams, delta)))
#define RINGATTN_EMU_BWD_HOPPER_NAMED(D)                                                                   \
    RINGATTN_EMU_BWD_HOPPER_NAMED1(dkdvqfx, bf16, D) RINGATTN_EMU_BWD_HOPPER_NAMED1(dkdvqfx, f16, D)        \
        RINGATTN_EMU_BWD_HOPPER_NAMED1(dkdvq, bf16, D) RINGATTN_EMU_BWD_HOPPER_NAMED1(dkdvq, f16, D)
static const EmuNamedKernel kNamedBwdHopper[] = {RINGATTN_EMU_BWD_HOPPER_NAMED(64) RINGATTN_EMU_BWD_HOPPER_NAMED(128)
                                                     RINGATTN_EMU_BWD_HOPPER_NAMED(256)};
RINGATTN_EMU_NAMED_TABLE(flash_bwd_hopper, kNamedBwdHopper)
