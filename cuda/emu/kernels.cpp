// The merge kernel of cuda/merge.cu compiled for the host against the emulator, with its C entry point: it
// launches the kernel with the geometry the caller chose (src/emu/ computes it exactly as the
// CUDA backend does), registers the family's buffers for the bounds checks, and reports
// errors. One translation unit per family, so that they compile in parallel.
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"

#include "merge.cu"

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
