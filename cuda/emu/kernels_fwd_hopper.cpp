// The Hopper forward kernels of cuda/flash_fwd_hopper.cu compiled for the host against the
// emulator, with its C entry point (as kernels_fwd.cpp for the FA2-class forward): the
// emulator runs the sm_90a family whatever the host; the tensor maps are the emulator's
// encoding (src/kernels/tensor_map.rs).
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"
#include "emu/named.h"

#include "flash_fwd_hopper.cu"

// `bf16`: 1 for bf16 inputs, 0 for f16; `dclass` 64, 128 or 256 (src/kernels.rs
// `geometry::forward_hopper`).
extern "C" int ringattn_emu_flash_fwd_hopper(const FlashFwdHopperParams* hp, int bf16, int dclass, EmuLaunch l,
                                             char* msg, size_t cap) {
    const FlashFwdHopperParams params = *hp;
    const FlashFwdParams& p = params.p;
    emu::LaunchConfig c = config(l);
    add_forward_globals(c, p);
    void (*kernel)(FlashFwdHopperParams) = nullptr;
#define RINGATTN_EMU_FWD_HOPPER_CASE(D)                                                              \
    case D:                                                                                          \
        kernel = bf16 ? ringattn_hopper_flash_fwd_bf16_d##D : ringattn_hopper_flash_fwd_f16_d##D; \
        break;
    switch (dclass) {
        RINGATTN_EMU_FWD_HOPPER_CASE(64)
        RINGATTN_EMU_FWD_HOPPER_CASE(128)
        RINGATTN_EMU_FWD_HOPPER_CASE(256)
        default:
            return report("no Hopper forward kernel for head-dim class " + std::to_string(dclass), msg, cap);
    }
#undef RINGATTN_EMU_FWD_HOPPER_CASE
    std::function<void()> body = [params, kernel] { kernel(params); };
    return report(emu::launch(c, body), msg, cap);
}

// Every entry point by name (emu/named.h), with where its tensor maps sit.
#define RINGATTN_EMU_FWD_HOPPER_NAMED1(NAME, D)                                                            \
    RINGATTN_EMU_NAMED_MAPS(ringattn_hopper_flash_fwd_##NAME##_d##D, FlashFwdHopperParams, 3,              \
                            uint32_t(offsetof(FlashFwdHopperParams, q)), uint32_t(offsetof(FlashFwdHopperParams, k)), \
                            uint32_t(offsetof(FlashFwdHopperParams, v)))
#define RINGATTN_EMU_FWD_HOPPER_NAMED(D) RINGATTN_EMU_FWD_HOPPER_NAMED1(bf16, D) RINGATTN_EMU_FWD_HOPPER_NAMED1(f16, D)
static const EmuNamedKernel kNamedFwdHopper[] = {RINGATTN_EMU_FWD_HOPPER_NAMED(64) RINGATTN_EMU_FWD_HOPPER_NAMED(128)
                                                     RINGATTN_EMU_FWD_HOPPER_NAMED(256)};
RINGATTN_EMU_NAMED_TABLE(flash_fwd_hopper, kNamedFwdHopper)
