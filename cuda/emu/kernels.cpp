// The merge kernel of cuda/merge.cu and the data movements of cuda/ops.cu compiled for the host against the emulator, with
// their C entry points: each launches its kernel with the geometry the caller chose (src/emu/
// and src/kernels.rs compute it exactly as the CUDA backend does), registers the family's
// buffers for the bounds checks, and reports errors. One translation unit per big family,
// so that they compile in parallel; the two small families share this one.
#include "emu/emu.h"
#define RINGATTN_EMU_ENTRY_HELPERS
#include "emu/launch.h"
#include "emu/named.h"

#include "merge.cu"
#include "ops.cu"

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

// The sinks' merge (geometry as the merge's) and gradient (one block per head).
extern "C" int ringattn_emu_merge_sinks_f32(MergeParams p, EmuLaunch l, char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t o = p.b * p.s * p.h * p.d, st = p.b * p.h * p.s;
    c.globals = {{p.o_acc, bytes(o, 4), "o_acc"}, {p.lse_acc, bytes(st, 4), "lse_acc"}, {p.sinks, bytes(p.h, 4), "sinks"}};
    std::function<void()> body = [p] { ringattn_merge_sinks_f32(p); };
    return report(emu::launch(c, body), msg, cap);
}
extern "C" int ringattn_emu_sink_grad_f32(MergeParams p, EmuLaunch l, char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    const int64_t st = p.b * p.h * p.s;
    c.globals = {{p.lse_acc, bytes(st, 4), "lse"},
                 {p.delta, bytes(st, 4), "delta"},
                 {p.sinks, bytes(p.h, 4), "sinks"},
                 {p.dsinks, bytes(p.h, 4), "dsinks"}};
    std::function<void()> body = [p] { ringattn_sink_grad_f32(p); };
    return report(emu::launch(c, body), msg, cap);
}

// The ops kernels; `kernel` numbers them as src/kernels.rs `geometry::OpsKernel` (0 fill,
// 1 add, 2 to_bf16, 3 to_f16, 4 copy_rows, 5 select_heads, 6 scatter_heads, 7 round_bf16,
// 8 round_f16, 9 from_bf16, 10 from_f16). Registers
// exactly the buffers the kernel addresses, with the sizes its fields give.
extern "C" int ringattn_emu_ops(int kernel, OpsParams p, EmuLaunch l, char* msg, size_t cap) {
    emu::LaunchConfig c = config(l);
    void (*fn)(OpsParams) = nullptr;
    switch (kernel) {
        case 0:
            fn = ringattn_ops_fill_f32;
            c.globals = {{p.dst, bytes(p.len, 4), "dst"}};
            break;
        case 1:
            fn = ringattn_ops_add_f32;
            c.globals = {{p.dst, bytes(p.len, 4), "dst"}, {p.src, bytes(p.len, 4), "src"}};
            break;
        case 2:
        case 3:
            fn = kernel == 2 ? ringattn_ops_to_bf16 : ringattn_ops_to_f16;
            c.globals = {{p.src, bytes(p.len, 4), "src"}, {p.dst16, bytes(p.len, 2), "dst16"}};
            break;
        case 4:
            fn = ringattn_ops_copy_rows_f32;
            c.globals = {{p.src, bytes(p.b * p.src_rows * p.w, 4), "src"},
                         {p.dst, bytes(p.b * p.dst_rows * p.w, 4), "dst"}};
            break;
        case 5:
        case 6: {
            fn = kernel == 5 ? ringattn_ops_select_heads_f32 : ringattn_ops_scatter_heads_f32;
            const int64_t full = p.b * p.h * p.d, part = p.b * p.k * p.d;
            c.globals = {{p.heads, bytes(p.k, 8), "heads"},
                         {kernel == 5 ? static_cast<const void*>(p.src) : p.dst, bytes(full, 4), "full"},
                         {kernel == 5 ? static_cast<const void*>(p.dst) : p.src, bytes(part, 4), "part"}};
            break;
        }
        case 7:
        case 8:
            fn = kernel == 7 ? ringattn_ops_round_bf16_f32 : ringattn_ops_round_f16_f32;
            c.globals = {{p.src, bytes(p.len, 4), "src"}, {p.dst, bytes(p.len, 4), "dst"}};
            break;
        case 9:
        case 10:
            fn = kernel == 9 ? ringattn_ops_from_bf16 : ringattn_ops_from_f16;
            c.globals = {{p.src16, bytes(p.len, 2), "src16"}, {p.dst, bytes(p.len, 4), "dst"}};
            break;
        default:
            return report("no ops kernel " + std::to_string(kernel), msg, cap);
    }
    std::function<void()> body = [p, fn] { fn(p); };
    return report(emu::launch(c, body), msg, cap);
}

// Every entry point of merge.cu and ops.cu by name (emu/named.h).
static const EmuNamedKernel kNamedMerge[] = {RINGATTN_EMU_NAMED(ringattn_merge_f32, MergeParams)
                                                 RINGATTN_EMU_NAMED(ringattn_merge_sinks_f32, MergeParams)
                                                     RINGATTN_EMU_NAMED(ringattn_sink_grad_f32, MergeParams)};
RINGATTN_EMU_NAMED_TABLE(merge, kNamedMerge)
static const EmuNamedKernel kNamedOps[] = {
    RINGATTN_EMU_NAMED(ringattn_ops_fill_f32, OpsParams) RINGATTN_EMU_NAMED(ringattn_ops_add_f32, OpsParams)
        RINGATTN_EMU_NAMED(ringattn_ops_to_bf16, OpsParams) RINGATTN_EMU_NAMED(ringattn_ops_to_f16, OpsParams)
            RINGATTN_EMU_NAMED(ringattn_ops_round_bf16_f32, OpsParams)
                RINGATTN_EMU_NAMED(ringattn_ops_round_f16_f32, OpsParams)
                    RINGATTN_EMU_NAMED(ringattn_ops_from_bf16, OpsParams)
                        RINGATTN_EMU_NAMED(ringattn_ops_from_f16, OpsParams)
                            RINGATTN_EMU_NAMED(ringattn_ops_copy_rows_f32, OpsParams)
                                RINGATTN_EMU_NAMED(ringattn_ops_select_heads_f32, OpsParams)
                                    RINGATTN_EMU_NAMED(ringattn_ops_scatter_heads_f32, OpsParams)};
RINGATTN_EMU_NAMED_TABLE(ops, kNamedOps)

// Runs the named kernel `k` as the stand-in driver launches it: `params` (k->param_bytes bytes,
// the kernel's parameter space) copied into a 128-byte aligned block, the geometry of `l`, and
// `globals` (every live device allocation) registered for the bounds checks, each given back
// with the byte ranges the launch read and wrote.
extern "C" int ringattn_emu_launch_named(const EmuNamedKernel* k, const void* params, EmuLaunch l, EmuGlobal* globals,
                                         size_t nglobals, char* msg, size_t cap) {
    struct alignas(128) Chunk {
        unsigned char b[128];
    };
    std::vector<Chunk> block((k->param_bytes + 127) / 128 + 1);
    std::memcpy(block.data(), params, k->param_bytes);
    emu::LaunchConfig c = config(l);
    std::vector<emu::Access> access(nglobals);
    for (size_t i = 0; i < nglobals; ++i) {
        c.globals.push_back({reinterpret_cast<const void*>(globals[i].base), size_t(globals[i].bytes),
                             "device allocation", &access[i]});
    }
    const void* data = block.data();
    void (*run)(const void*) = k->run;
    std::function<void()> body = [data, run] { run(data); };
    const std::string err = emu::launch(c, body);
    for (size_t i = 0; i < nglobals; ++i) {
        globals[i].read_lo = access[i].read_lo.load();
        globals[i].read_hi = access[i].read_hi.load();
        globals[i].write_lo = access[i].write_lo.load();
        globals[i].write_hi = access[i].write_hi.load();
    }
    return report(err, msg, cap);
}
