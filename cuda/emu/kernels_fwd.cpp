// The flash forward kernels of cuda/flash_fwd.cu compiled for the host against the emulator, with its C entry point: it
// launches the kernel with the geometry the caller chose (src/emu/ computes it exactly as the
// CUDA backend does), registers the family's buffers for the bounds checks, and reports
// errors. One translation unit per family, so that they compile in parallel.
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"
#include "emu/named.h"

#include "flash_fwd.cu"

// Flash forward; `bf16`: 1 for bf16 inputs, 0 for f16; `dclass` the head-dim class of the
// entry point, `own_dv` 1 for its V-of-its-own-head-dim variant (..._dv), or V's class for a
// pair entry point (..._d{D}_v{DV}), 0 otherwise (src/kernels.rs `geometry::forward`,
// `ValueDim::code`).
extern "C" int ringattn_emu_flash_fwd(FlashFwdParams p, int bf16, int dclass, int own_dv, EmuLaunch l, char* msg,
                                      size_t cap) {
    emu::LaunchConfig c = config(l);
    add_forward_globals(c, p);
    void (*kernel)(FlashFwdParams) = nullptr;
#define RINGATTN_EMU_FWD_CASE(D)                                                       \
    case D:                                                                            \
        kernel = bf16 ? ringattn_flash_fwd_bf16_d##D : ringattn_flash_fwd_f16_d##D; \
        break;
#define RINGATTN_EMU_FWD_DV_CASE(D)                                                          \
    case D:                                                                                  \
        kernel = bf16 ? ringattn_flash_fwd_bf16_d##D##_dv : ringattn_flash_fwd_f16_d##D##_dv; \
        break;
#define RINGATTN_EMU_FWD_PAIR(D, DV)                                                                \
    if (dclass == D && own_dv == DV)                                                                \
        kernel = bf16 ? ringattn_flash_fwd_bf16_d##D##_v##DV : ringattn_flash_fwd_f16_d##D##_v##DV;
    if (own_dv > 1) {
        RINGATTN_EMU_FWD_PAIR(192, 128)
        if (kernel == nullptr) {
            return report("no forward kernel for head-dim classes " + std::to_string(dclass) + " and " +
                              std::to_string(own_dv),
                          msg, cap);
        }
    } else if (own_dv) {
        switch (dclass) {
            RINGATTN_EMU_FWD_DV_CASE(96)
            RINGATTN_EMU_FWD_DV_CASE(192)
            RINGATTN_EMU_FWD_DV_CASE(256)
            default:
                return report("no forward kernel with its own d_v for head-dim class " + std::to_string(dclass), msg,
                              cap);
        }
    } else {
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
    }
#undef RINGATTN_EMU_FWD_CASE
#undef RINGATTN_EMU_FWD_DV_CASE
#undef RINGATTN_EMU_FWD_PAIR
    std::function<void()> body = [p, kernel] { kernel(p); };
    return report(emu::launch(c, body), msg, cap);
}

// Every entry point by name (emu/named.h).
#define RINGATTN_EMU_FWD_NAMED(D)                                          \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_bf16_d##D, FlashFwdParams) \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_f16_d##D, FlashFwdParams)
#define RINGATTN_EMU_FWD_DV_NAMED(D)                                            \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_bf16_d##D##_dv, FlashFwdParams) \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_f16_d##D##_dv, FlashFwdParams)
#define RINGATTN_EMU_FWD_PAIR_NAMED(D, DV)                                         \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_bf16_d##D##_v##DV, FlashFwdParams) \
    RINGATTN_EMU_NAMED(ringattn_flash_fwd_f16_d##D##_v##DV, FlashFwdParams)
static const EmuNamedKernel kNamedFwd[] = {
    RINGATTN_EMU_FWD_NAMED(32) RINGATTN_EMU_FWD_NAMED(64) RINGATTN_EMU_FWD_NAMED(96) RINGATTN_EMU_FWD_NAMED(128)
        RINGATTN_EMU_FWD_NAMED(192) RINGATTN_EMU_FWD_NAMED(256) RINGATTN_EMU_FWD_DV_NAMED(96)
            RINGATTN_EMU_FWD_DV_NAMED(192) RINGATTN_EMU_FWD_DV_NAMED(256) RINGATTN_EMU_FWD_PAIR_NAMED(192, 128)};
RINGATTN_EMU_NAMED_TABLE(flash_fwd, kNamedFwd)
