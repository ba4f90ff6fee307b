// The flash backward kernels of cuda/flash_bwd.cu compiled for the host against the emulator, with its C entry point: it
// launches the kernel with the geometry the caller chose (src/emu/ computes it exactly as the
// CUDA backend does), registers the family's buffers for the bounds checks, and reports
// errors. One translation unit per family, so that they compile in parallel.
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"
#include "emu/named.h"

#include "flash_bwd.cu"

// Flash backward; `kernel`: 0 rowsum (delta), 1 kvbound, 2 rowunit, 3 dk/dv with fixed-point
// dq (classes up to 128), 4 dk/dv with f32 atomic dq, 5 dqconvert, 6 dq (classes from 192), 7
// dk/dv alone (classes from 192) (src/emu/flash.rs `kernel_code`); `bf16` as above; `dclass`
// the head-dim class of the entry points instantiated per class, `own_dv` 1 for their
// V-of-its-own-head-dim variants (..._dv), V's class for the pair ones (..._d{D}_v{DV}), 0
// otherwise (src/kernels.rs `ValueDim::code`).
extern "C" int ringattn_emu_flash_bwd(FlashBwdParams p, int kernel, int bf16, int dclass, int own_dv, EmuLaunch l,
                                      char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t q_rows = p.x.b * p.x.s_q * p.x.h_q, kv_rows = p.x.b * p.x.s_k * p.x.h_kv, st = p.x.b * p.x.h_q * p.x.s_q;
    const int64_t q = q_rows * p.x.d_qk, o = q_rows * p.x.d_v, k = kv_rows * p.x.d_qk, v = kv_rows * p.x.d_v;
    c.globals = {{p.x.q, bytes(q, 2), "q"},
                 {p.x.k, bytes(k, 2), "k"},
                 {p.x.v, bytes(v, 2), "v"},
                 {p.o, bytes(o, 4), "o"},
                 {p.d_o, bytes(o, 2), "d_o"},
                 {p.lse, bytes(st, 4), "lse"},
                 {p.delta, bytes(st, 4), "delta"},
                 {p.dq, bytes(q, 4), "dq"},
                 {p.dk, bytes(k, 4), "dk"},
                 {p.dv, bytes(v, 4), "dv"},
                 {p.dq_unit, bytes(st, 4), "dq_unit"},
                 {p.kv_bound, bytes(2 * p.x.b * p.x.h_kv, 4), "kv_bound"}};
    add_mask(c, p.x.mask, p.x.s_q, p.x.s_k);
    void (*fn)(FlashBwdParams) = nullptr;
    switch (kernel) {
        case 0:
            fn = bf16 ? ringattn_flash_bwd_rowsum_bf16 : ringattn_flash_bwd_rowsum_f16;
            break;
        case 1:
            fn = bf16 ? ringattn_flash_bwd_kvbound_bf16 : ringattn_flash_bwd_kvbound_f16;
            break;
        case 2:
            fn = bf16 ? ringattn_flash_bwd_rowunit_bf16 : ringattn_flash_bwd_rowunit_f16;
            break;
        case 5:
            fn = bf16 ? ringattn_flash_bwd_dqconvert_bf16 : ringattn_flash_bwd_dqconvert_f16;
            break;
        case 3:
        case 4:
        case 6:
        case 7:
// Kernel CODE's entry point NAME at head-dim class D, when that is the one asked for (and
// its _dv variant when that is).
#define RINGATTN_EMU_PICK(CODE, NAME, D)                                                                        \
    if (kernel == CODE && !own_dv) fn = bf16 ? ringattn_flash_bwd_##NAME##_bf16_d##D : ringattn_flash_bwd_##NAME##_f16_d##D
#define RINGATTN_EMU_PICK_DV(CODE, NAME, D) \
    if (kernel == CODE && own_dv == 1)      \
    fn = bf16 ? ringattn_flash_bwd_##NAME##_bf16_d##D##_dv : ringattn_flash_bwd_##NAME##_f16_d##D##_dv
#define RINGATTN_EMU_PICK_PAIR(CODE, NAME, D, DV) \
    if (kernel == CODE && own_dv == DV)           \
    fn = bf16 ? ringattn_flash_bwd_##NAME##_bf16_d##D##_v##DV : ringattn_flash_bwd_##NAME##_f16_d##D##_v##DV
// Up to class 128: the dk/dv kernels that add dq; from 192 also the dq kernel and plain dk/dv.
#define RINGATTN_EMU_FIXED_CLASS(D)      \
    case D:                              \
        RINGATTN_EMU_PICK(3, dkdvqfx, D); \
        RINGATTN_EMU_PICK(4, dkdvq, D);   \
        break;
#define RINGATTN_EMU_FIXED_CLASS_DV(D)      \
    case D:                                 \
        RINGATTN_EMU_PICK(3, dkdvqfx, D);    \
        RINGATTN_EMU_PICK(4, dkdvq, D);      \
        RINGATTN_EMU_PICK_DV(3, dkdvqfx, D); \
        RINGATTN_EMU_PICK_DV(4, dkdvq, D);   \
        break;
#define RINGATTN_EMU_SEPARATE_PICKS(D) \
    RINGATTN_EMU_PICK(4, dkdvq, D);     \
    RINGATTN_EMU_PICK(6, dq, D);        \
    RINGATTN_EMU_PICK(7, dkdv, D);      \
    RINGATTN_EMU_PICK_DV(4, dkdvq, D);  \
    RINGATTN_EMU_PICK_DV(6, dq, D);     \
    RINGATTN_EMU_PICK_DV(7, dkdv, D)
#define RINGATTN_EMU_SEPARATE_CLASS(D) \
    case D:                            \
        RINGATTN_EMU_SEPARATE_PICKS(D); \
        break;
// ... and with a pair's (V of its own class DV).
#define RINGATTN_EMU_PAIR_CLASS(D, DV)           \
    case D:                                      \
        RINGATTN_EMU_SEPARATE_PICKS(D);          \
        RINGATTN_EMU_PICK_PAIR(4, dkdvq, D, DV); \
        RINGATTN_EMU_PICK_PAIR(6, dq, D, DV);    \
        RINGATTN_EMU_PICK_PAIR(7, dkdv, D, DV);  \
        break;
            switch (dclass) {
                RINGATTN_EMU_FIXED_CLASS(32)
                RINGATTN_EMU_FIXED_CLASS(64)
                RINGATTN_EMU_FIXED_CLASS_DV(96)
                RINGATTN_EMU_FIXED_CLASS(128)
                RINGATTN_EMU_PAIR_CLASS(192, 128)
                RINGATTN_EMU_SEPARATE_CLASS(256)
                default:
                    break;
            }
#undef RINGATTN_EMU_FIXED_CLASS
#undef RINGATTN_EMU_FIXED_CLASS_DV
#undef RINGATTN_EMU_SEPARATE_CLASS
#undef RINGATTN_EMU_SEPARATE_PICKS
#undef RINGATTN_EMU_PAIR_CLASS
#undef RINGATTN_EMU_PICK_PAIR
#undef RINGATTN_EMU_PICK
#undef RINGATTN_EMU_PICK_DV
            if (fn == nullptr) {
                return report("no backward kernel " + std::to_string(kernel) + " for head-dim class " +
                                  std::to_string(dclass) +
                                  (own_dv == 1   ? " with its own d_v"
                                   : own_dv > 1 ? " with V of class " + std::to_string(own_dv)
                                                : ""),
                              msg, cap);
            }
            break;
        default:
            return report("no backward kernel number " + std::to_string(kernel), msg, cap);
    }
    std::function<void()> body = [p, fn] { fn(p); };
    return report(emu::launch(c, body), msg, cap);
}

// Every entry point by name (emu/named.h).
#define RINGATTN_EMU_BWD_NAMED2(KIND, D)                                          \
    RINGATTN_EMU_NAMED(ringattn_flash_bwd_##KIND##_bf16_d##D, FlashBwdParams) \
    RINGATTN_EMU_NAMED(ringattn_flash_bwd_##KIND##_f16_d##D, FlashBwdParams)
#define RINGATTN_EMU_BWD_SMALL(KIND)                                          \
    RINGATTN_EMU_NAMED(ringattn_flash_bwd_##KIND##_bf16, FlashBwdParams) \
    RINGATTN_EMU_NAMED(ringattn_flash_bwd_##KIND##_f16, FlashBwdParams)
static const EmuNamedKernel kNamedBwd[] = {
    RINGATTN_EMU_BWD_SMALL(rowsum) RINGATTN_EMU_BWD_SMALL(kvbound) RINGATTN_EMU_BWD_SMALL(rowunit)
        RINGATTN_EMU_BWD_SMALL(dqconvert) RINGATTN_EMU_BWD_NAMED2(dkdvq, 32) RINGATTN_EMU_BWD_NAMED2(dkdvq, 64)
            RINGATTN_EMU_BWD_NAMED2(dkdvq, 96) RINGATTN_EMU_BWD_NAMED2(dkdvq, 128) RINGATTN_EMU_BWD_NAMED2(dkdvq, 192)
                RINGATTN_EMU_BWD_NAMED2(dkdvq, 256) RINGATTN_EMU_BWD_NAMED2(dkdvqfx, 32)
                    RINGATTN_EMU_BWD_NAMED2(dkdvqfx, 64) RINGATTN_EMU_BWD_NAMED2(dkdvqfx, 96)
                        RINGATTN_EMU_BWD_NAMED2(dkdvqfx, 128) RINGATTN_EMU_BWD_NAMED2(dq, 192)
                            RINGATTN_EMU_BWD_NAMED2(dq, 256) RINGATTN_EMU_BWD_NAMED2(dkdv, 192)
                                RINGATTN_EMU_BWD_NAMED2(dkdv, 256) RINGATTN_EMU_BWD_NAMED2(dkdvq, 96_dv)
                                    RINGATTN_EMU_BWD_NAMED2(dkdvq, 192_dv) RINGATTN_EMU_BWD_NAMED2(dkdvq, 256_dv)
                                        RINGATTN_EMU_BWD_NAMED2(dkdvqfx, 96_dv) RINGATTN_EMU_BWD_NAMED2(dq, 192_dv)
                                                RINGATTN_EMU_BWD_NAMED2(dq, 256_dv) RINGATTN_EMU_BWD_NAMED2(dkdv, 192_dv)
                                                    RINGATTN_EMU_BWD_NAMED2(dkdv, 256_dv)
                                                        RINGATTN_EMU_BWD_NAMED2(dkdvq, 192_v128)
                                                            RINGATTN_EMU_BWD_NAMED2(dq, 192_v128)
                                                                RINGATTN_EMU_BWD_NAMED2(dkdv, 192_v128)};
RINGATTN_EMU_NAMED_TABLE(flash_bwd, kNamedBwd)
