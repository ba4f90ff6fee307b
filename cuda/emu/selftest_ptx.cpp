// Test kernels for the PTX twins of ptx.cuh (m16n8k8, ldmatrix x1,
// stmatrix, bf16/f16 conversions). Driven by src/emu/ptx_tests.rs.
#include "emu/emu.h"
#include "ptx.cuh"
#include "score.cuh"

#include <string>

namespace {

int report(const std::string& err, char* msg, size_t cap) {
    if (err.empty()) return 0;
    if (msg && cap) std::snprintf(msg, cap, "%s", err.c_str());
    return 1;
}

// One warp: lane L takes its registers from regs[L*3 ..] (a0, a1, b) and c[L*4 ..], runs
// m16n8k8 and writes d[L*4 ..]. The caller lays out the fragments (by the PTX tables).
__global__ void mma_k8_lanes(const uint32_t* regs, const float* c, float* d, int bf16) {
    const unsigned L = threadIdx.x;
    const uint32_t a[2] = {regs[L * 3 + 0], regs[L * 3 + 1]};
    float out[4];
    if (bf16) {
        mma_m16n8k8_bf16(out, a, regs[L * 3 + 2], &c[L * 4]);
    } else {
        mma_m16n8k8_f16(out, a, regs[L * 3 + 2], &c[L * 4]);
    }
    for (int i = 0; i < 4; ++i) d[L * 4 + i] = out[i];
}

// One warp; `tile` (256 b16 values) is copied to shared memory. Lanes 0-7 point to the
// elements at offsets[0..7] (16-byte aligned rows); the other lanes point one element past
// the start, a misaligned address that x1 must ignore. out[L*2] = ldmatrix_x1,
// out[L*2+1] = ldmatrix_x1_trans.
__global__ void ldmatrix_x1_lanes(const uint16_t* tile, const uint32_t* offsets, uint32_t* out) {
    uint16_t* sm = reinterpret_cast<uint16_t*>(RINGATTN_DYNAMIC_SMEM());
    const unsigned L = threadIdx.x;
    for (unsigned i = L; i < 256; i += 32) sm[i] = tile[i];
    __syncwarp();
    const uint16_t* row = L < 8 ? sm + offsets[L] : sm + 1;
    uint32_t r, rt;
    ldmatrix_x1(r, row);
    ldmatrix_x1_trans(rt, row);
    out[L * 2] = r;
    out[L * 2 + 1] = rt;
}

constexpr unsigned kStmatrixElems = 1024;  // b16 elements of shared memory (2 KiB)

// One warp. Shared memory (kStmatrixElems b16) is filled with `sentinel`; lane L points to
// the element at offsets[L] and stores regs[L*4 .. L*4+count) with stmatrix x`count`
// (.trans if `trans`), then loads them back with the matching ldmatrix into back[L*4 ..].
// image receives the whole shared memory after the store.
__global__ void stmatrix_lanes(int count, int trans, const uint32_t* regs, const uint32_t* offsets, uint16_t sentinel,
                               uint16_t* image, uint32_t* back) {
    uint16_t* sm = reinterpret_cast<uint16_t*>(RINGATTN_DYNAMIC_SMEM());
    const unsigned L = threadIdx.x;
    for (unsigned i = L; i < kStmatrixElems; i += 32) sm[i] = sentinel;
    __syncwarp();
    uint16_t* row = sm + offsets[L];
    const uint32_t r[4] = {regs[L * 4], regs[L * 4 + 1], regs[L * 4 + 2], regs[L * 4 + 3]};
    uint32_t b[4] = {0, 0, 0, 0};
    if (count == 1) {
        trans ? stmatrix_x1_trans(row, r[0]) : stmatrix_x1(row, r[0]);
        __syncwarp();
        trans ? ldmatrix_x1_trans(b[0], row) : ldmatrix_x1(b[0], row);
    } else if (count == 2) {
        trans ? stmatrix_x2_trans(row, r) : stmatrix_x2(row, r);
        __syncwarp();
        trans ? ldmatrix_x2_trans(b, row) : ldmatrix_x2(b, row);
    } else {
        trans ? stmatrix_x4_trans(row, r) : stmatrix_x4(row, r);
        __syncwarp();
        trans ? ldmatrix_x4_trans(b, row) : ldmatrix_x4(b, row);
    }
    __syncwarp();
    for (unsigned i = L; i < kStmatrixElems; i += 32) image[i] = sm[i];
    for (int i = 0; i < 4; ++i) back[L * 4 + i] = b[i];
}

// One warp over n inputs x (element i by lane i % 32):
//   bf[i] = f32_to_bf16_rn(x[i]), hf[i] = f32_to_f16_rn(x[i]),
//   packed[2i] = pack_bf16x2(x[i], x[i+1]), packed[2i+1] = pack_f16x2(x[i], x[i+1])
//     (x[n] taken as x[0]),
//   unpacked[6i ..] = bf16_lo, bf16_hi of packed[2i], f16_lo, f16_hi of packed[2i+1],
//     bf16_to_f32(bf[i]), f16_to_f32(hf[i]);
// and, for every 16-bit pattern h, all_bf[h] = bf16_to_f32(h), all_hf[h] = f16_to_f32(h).
__global__ void convert_lanes(const float* x, unsigned n, uint16_t* bf, uint16_t* hf, uint32_t* packed,
                              float* unpacked, float* all_bf, float* all_hf) {
    const unsigned L = threadIdx.x;
    for (unsigned i = L; i < n; i += 32) {
        const float lo = x[i], hi = x[(i + 1) % n];
        bf[i] = f32_to_bf16_rn(lo);
        hf[i] = f32_to_f16_rn(lo);
        const uint32_t pb = pack_bf16x2(lo, hi), ph = pack_f16x2(lo, hi);
        packed[2 * i] = pb;
        packed[2 * i + 1] = ph;
        float* u = unpacked + 6 * size_t(i);
        u[0] = bf16_lo(pb);
        u[1] = bf16_hi(pb);
        u[2] = f16_lo(ph);
        u[3] = f16_hi(ph);
        u[4] = bf16_to_f32(bf[i]);
        u[5] = f16_to_f32(hf[i]);
    }
    for (unsigned h = L; h < 65536; h += 32) {
        all_bf[h] = bf16_to_f32(uint16_t(h));
        all_hf[h] = f16_to_f32(uint16_t(h));
    }
}

}  // namespace

// regs: 32 lanes × (a0, a1, b); c, d: 32 lanes × 4 floats; bf16 != 0 for bf16 inputs.
extern "C" int ringattn_emu_selftest_mma_k8(const uint32_t* regs, const float* c, float* d, int bf16, char* msg,
                                            size_t cap) {
    std::function<void()> body = [=] { mma_k8_lanes(regs, c, d, bf16); };
    return report(emu::launch(dim3(1), dim3(32), body), msg, cap);
}

// tile: 256 b16 values; offsets: 8 element offsets (multiples of 8, < 256 - 8); out: 64 u32.
extern "C" int ringattn_emu_selftest_ldmatrix_x1(const uint16_t* tile, const uint32_t* offsets, uint32_t* out,
                                                 char* msg, size_t cap) {
    std::function<void()> body = [=] { ldmatrix_x1_lanes(tile, offsets, out); };
    return report(emu::launch(dim3(1), dim3(32), body, 512), msg, cap);
}

// count: 1, 2 or 4; regs: 32 × 4 u32; offsets: 32 element offsets (< 1024 - 8); image: 1024
// b16; back: 32 × 4 u32.
extern "C" int ringattn_emu_selftest_stmatrix(int count, int trans, const uint32_t* regs, const uint32_t* offsets,
                                              uint16_t sentinel, uint16_t* image, uint32_t* back, char* msg,
                                              size_t cap) {
    std::function<void()> body = [=] { stmatrix_lanes(count, trans, regs, offsets, sentinel, image, back); };
    return report(emu::launch(dim3(1), dim3(32), body, kStmatrixElems * 2), msg, cap);
}

// x: n floats; bf, hf: n b16; packed: 2n u32; unpacked: 6n floats; all_bf, all_hf: 65536 floats.
extern "C" int ringattn_emu_selftest_convert(const float* x, unsigned n, uint16_t* bf, uint16_t* hf, uint32_t* packed,
                                             float* unpacked, float* all_bf, float* all_hf, char* msg, size_t cap) {
    std::function<void()> body = [=] { convert_lanes(x, n, bf, hf, packed, unpacked, all_bf, all_hf); };
    return report(emu::launch(dim3(1), dim3(32), body), msg, cap);
}

namespace {
// One warp: the soft-cap's tanh (score.cuh, on the twins of ex2.approx and rcp.approx) of n
// values in both forms (kShort into tanh_out[0..n), kSplit into tanh_out[n..2n)) and
// rcp.approx of them, lane L taking every 32nd.
__global__ void score_tanh_lanes(const float* x, unsigned n, float* tanh_out, float* rcp_out) {
    for (unsigned i = threadIdx.x; i < n; i += 32) {
        tanh_out[i] = score_tanh<TanhForm::kShort>(x[i]);
        tanh_out[n + i] = score_tanh<TanhForm::kSplit>(x[i]);
        rcp_out[i] = rcp_approx(x[i]);
    }
}
}  // namespace

extern "C" int ringattn_emu_selftest_score_tanh(const float* x, unsigned n, float* tanh_out, float* rcp_out, char* msg,
                                                size_t cap) {
    std::function<void()> body = [=] { score_tanh_lanes(x, n, tanh_out, rcp_out); };
    return report(emu::launch(dim3(1), dim3(32), body), msg, cap);
}

namespace {
// One warp: out[L] = movmatrix_trans(in[L]).
__global__ void movmatrix_lanes(const uint32_t* in, uint32_t* out) {
    out[threadIdx.x] = movmatrix_trans(in[threadIdx.x]);
}
}  // namespace

// in, out: 32 registers (one per lane).
extern "C" int ringattn_emu_selftest_movmatrix(const uint32_t* in, uint32_t* out, char* msg, size_t cap) {
    std::function<void()> body = [=] { movmatrix_lanes(in, out); };
    return report(emu::launch(dim3(1), dim3(32), body), msg, cap);
}

namespace {
// The mbarrier protocol of a producer/consumer ring, the shape of a warp-specialised kernel:
// 128 threads; warp 0 produces `rounds` slots of kSlotFloats values into `stages` buffers,
// one elected lane writing each slot, announcing it with arrive.expect_tx and delivering it
// with complete_tx (as an asynchronous copy would); warps 1-3 (96 consumers) wait for each
// slot (`full`, parity of its round through the ring), read their value and free the slot
// (`empty`, 96 arrivals). The producer's first wait on a fresh `empty` uses parity 1.
// out[c] = the sum of consumer c's values. `fault` plants one bug: 1 delivers 4 bytes fewer
// than announced, 2 starts the producer on parity 0, 3 initialises with count 0, 4 uses the
// barriers without initialising them.
constexpr int kSlotFloats = 96;

__global__ void mbarrier_ring(int stages, int rounds, int fault, float* out) {
    unsigned char* sm = RINGATTN_DYNAMIC_SMEM();
    uint64_t* full = reinterpret_cast<uint64_t*>(sm);
    uint64_t* empty = full + stages;
    float* data = reinterpret_cast<float*>(empty + stages);
    const unsigned tid = threadIdx.x, warp = tid / 32;
    if (tid == 0 && fault != 4) {
        for (int s = 0; s < stages; ++s) {
            mbarrier_init(&full[s], fault == 3 ? 0 : 1);
            mbarrier_init(&empty[s], kSlotFloats);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    const uint32_t bytes = kSlotFloats * 4;
    if (warp == 0) {
        const bool leader = elect_one_sync();
        for (int r = 0; r < rounds; ++r) {
            const int s = r % stages;
            const uint32_t parity = uint32_t(r / stages) & 1u;
            if (!leader) continue;
            mbarrier_wait_parity(&empty[s], parity ^ (fault == 2 ? 0u : 1u));
            for (int i = 0; i < kSlotFloats; ++i) data[s * kSlotFloats + i] = float(r * 1000 + i);
            mbarrier_arrive_expect_tx(&full[s], bytes);
            mbarrier_complete_tx(&full[s], fault == 1 ? bytes - 4 : bytes);
        }
    } else {
        const unsigned c = tid - 32;
        float acc = 0.0f;
        for (int r = 0; r < rounds; ++r) {
            const int s = r % stages;
            mbarrier_wait_parity(&full[s], uint32_t(r / stages) & 1u);
            acc += data[s * kSlotFloats + c];
            mbarrier_arrive(&empty[s]);
        }
        out[c] = acc;
    }
}
}  // namespace

// out: 96 floats; schedule 0 forward, 1 reverse, 2 random (seed).
extern "C" int ringattn_emu_selftest_mbarrier_ring(int stages, int rounds, int fault, int schedule, uint64_t seed,
                                                   float* out, char* msg, size_t cap) {
    std::function<void()> body = [=] { mbarrier_ring(stages, rounds, fault, out); };
    const size_t smem = size_t(stages) * (16 + kSlotFloats * 4);
    return report(emu::launch(dim3(1), dim3(128), body, smem, emu::Schedule(schedule), seed), msg, cap);
}

// out[mn * cols + k] = the shared byte address of element (mn, k) of the wgmma operand whose
// descriptor is make_wgmma_desc(start, lbo, sbo, swizzle) | extra (extra plants bad bits),
// major 0 K-major, 1 MN-major.
extern "C" int ringattn_emu_selftest_wgmma_desc(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t swizzle,
                                                uint64_t extra, int major, uint32_t rows, uint32_t cols, uint32_t* out,
                                                char* msg, size_t cap) {
    std::function<void()> body = [=] {
        const uint64_t desc = make_wgmma_desc(start, lbo, sbo, WgmmaSwizzle(swizzle)) | extra;
        for (uint32_t mn = 0; mn < rows; ++mn) {
            for (uint32_t k = 0; k < cols; ++k) {
                out[mn * cols + k] = emu::wgmma_desc_address(desc, WgmmaMajor(major), mn, k);
            }
        }
    };
    return report(emu::launch(dim3(1), dim3(1), body), msg, cap);
}

namespace {
// A warpgroup GEMM on the wgmma twins: D (64 x n) = C + A (64 x 16 ksteps) · B, K-step s
// reading A and B through a_desc[s] / b_desc[s] (or A from a_regs in the RS form) in a shared
// memory image the caller laid out. Mirrored in src/emu/ptx_tests.rs.
struct WgmmaCase {
    const uint32_t* image;  // the shared-memory image, image_words words
    uint32_t image_words;
    uint32_t n;       // 64, 128 or 256
    uint32_t ksteps;  // 1 ... 8
    uint32_t input;   // WgmmaInput
    uint32_t rs;      // 1: A from a_regs
    uint32_t trans_a, trans_b;  // WgmmaMajor
    uint32_t pipelined;         // 1: one group per K-step, waiting with wait_group<1>
    uint32_t overwrite_at;      // fault 4: the shared byte offset overwritten while in flight
    uint64_t a_desc[8], b_desc[8];
    const uint32_t* a_regs;  // [ksteps][128][4]
    const float* c;          // [128][n/2]; null: the first K-step overwrites
    float* out;              // [128][n/2]
    int32_t fault;           // see ringattn_emu_selftest_wgmma
    uint32_t threads;        // block size
};

// Planted bugs.
enum WgmmaFault : int32_t {
    kFaultNone = 0,
    kFaultNoProxyFence = 1,     // the image's writers skip fence.proxy.async
    kFaultReadInFlight = 2,     // an accumulator read before wgmma.wait_group
    kFaultMisaligned = 3,       // warps 2-5 of a 256-thread block act as the warpgroup
    kFaultOverwrite = 4,        // a shared word under an in-flight wgmma is stored to
    kFaultNoWgmmaFence = 5,     // no wgmma.fence before the first wgmma
    kFaultNonUniformDesc = 6,   // one thread's B descriptor differs
    kFaultNoWait = 7,           // the thread exits with its group in flight
    kFaultFenceAfterAccess = 8, // the accumulator written after the wgmma.fence
    kFaultOverwriteAfterOwnWait = 9,  // thread 0 waits for the group, then stores to a shared
                                      // word under it while the other warps have not waited
};

template <int N, WgmmaInput In, WgmmaMajor TA, WgmmaMajor TB>
void wgmma_gemm(const WgmmaCase& c) {
    unsigned char* sm = RINGATTN_DYNAMIC_SMEM();
    const unsigned tid = threadIdx.x;
    for (unsigned i = tid; i < c.image_words; i += c.threads) {
        smem_store(reinterpret_cast<uint32_t*>(sm) + i, c.image[i]);
    }
    if (c.fault != kFaultNoProxyFence) fence_proxy_async();
    __syncthreads();
    const unsigned first = c.fault == kFaultMisaligned ? 64 : 0;
    if (tid < first || tid >= first + 128) return;
    const unsigned th = tid - first;
    WgmmaAcc<N> acc;
    for (int v = 0; v < N / 2; ++v) acc[v] = c.c ? c.c[th * (N / 2) + v] : __uint_as_float(0xFFFFFFFFu);
    if (c.fault != kFaultNoWgmmaFence) wgmma_fence();
    if (c.fault == kFaultFenceAfterAccess) acc[0] = 0.0f;
    for (uint32_t s = 0; s < c.ksteps; ++s) {
        const WgmmaAccumulate mode = s == 0 && c.c == nullptr ? WgmmaAccumulate::kOverwrite : WgmmaAccumulate::kAdd;
        const uint64_t b_desc = c.b_desc[s] + (c.fault == kFaultNonUniformDesc && th == 37 ? 1 : 0);
        if (c.rs) {
            wgmma_rs<In, TB>(acc, c.a_regs + (size_t(s) * 128 + th) * 4, b_desc, mode);
        } else {
            wgmma_ss<In, TA, TB>(acc, c.a_desc[s], b_desc, mode);
        }
        if (c.fault == kFaultReadInFlight && s == 0) c.out[th * (N / 2)] = acc[0];
        if (c.fault == kFaultOverwrite && s == 0 && th == 0) {
            smem_store(reinterpret_cast<uint16_t*>(sm + c.overwrite_at), uint16_t(0x3F80));
        }
        if (c.pipelined) {
            wgmma_commit_group();
            wgmma_wait_group<1>(acc);
        }
    }
    wgmma_commit_group();
    if (c.fault == kFaultNoWait) return;
    if (c.fault == kFaultOverwriteAfterOwnWait) {
        // Its own wait does not cover the other warps' parts of the wgmma: they wait after it.
        if (th == 0) {
            wgmma_wait_group<0>(acc);
            smem_store(reinterpret_cast<uint16_t*>(sm + c.overwrite_at), uint16_t(0x3F80));
            named_barrier_arrive(1, 128);
        } else {
            named_barrier_sync(1, 128);
        }
    }
    wgmma_wait_group<0>(acc);
    for (int v = 0; v < N / 2; ++v) c.out[th * (N / 2) + v] = acc[v];
}

template <int N>
void wgmma_gemm_n(const WgmmaCase& c) {
    const bool bf = c.input == uint32_t(WgmmaInput::kBF16);
    const bool ka = c.trans_a == 0, kb = c.trans_b == 0;
    constexpr WgmmaMajor K = WgmmaMajor::kK, MN = WgmmaMajor::kMN;
    constexpr WgmmaInput B = WgmmaInput::kBF16, F = WgmmaInput::kF16;
    if (bf) {
        ka ? (kb ? wgmma_gemm<N, B, K, K>(c) : wgmma_gemm<N, B, K, MN>(c))
           : (kb ? wgmma_gemm<N, B, MN, K>(c) : wgmma_gemm<N, B, MN, MN>(c));
    } else {
        ka ? (kb ? wgmma_gemm<N, F, K, K>(c) : wgmma_gemm<N, F, K, MN>(c))
           : (kb ? wgmma_gemm<N, F, MN, K>(c) : wgmma_gemm<N, F, MN, MN>(c));
    }
}
}  // namespace

// Runs the WgmmaCase GEMM in one block of c.threads threads with image_words * 4 bytes of
// shared memory; schedule 0 forward, 1 reverse, 2 random (seed).
extern "C" int ringattn_emu_selftest_wgmma(const WgmmaCase* c, int schedule, uint64_t seed, char* msg, size_t cap) {
    const WgmmaCase cc = *c;
    if (cc.ksteps < 1 || cc.ksteps > 8) return report("ksteps outside 1 ... 8", msg, cap);
    std::function<void()> body = [cc] {
        if (cc.n == 64) wgmma_gemm_n<64>(cc);
        if (cc.n == 128) wgmma_gemm_n<128>(cc);
        if (cc.n == 256) wgmma_gemm_n<256>(cc);
    };
    return report(emu::launch(dim3(1), dim3(cc.threads), body, size_t(cc.image_words) * 4, emu::Schedule(schedule), seed),
                  msg, cap);
}

namespace {
// Three warpgroups in producer/consumer roles: warpgroup 0 gives registers back
// (setmaxnreg.dec 40), 1 and 2 take them (setmaxnreg.inc 232). fault 1: only warps 0-1 of
// warpgroup 0 execute its setmaxnreg; 2: warp 3 of warpgroup 0 executes .inc instead.
__global__ void setmaxnreg_roles(int fault) {
    const unsigned warp = threadIdx.x / 32;
    if (warp < 4) {
        if (fault == 1 && warp >= 2) return;
        if (fault == 2 && warp == 3) {
            setmaxnreg_inc<40>();
        } else {
            setmaxnreg_dec<40>();
        }
    } else {
        setmaxnreg_inc<232>();
    }
}
}  // namespace

extern "C" int ringattn_emu_selftest_setmaxnreg(int fault, char* msg, size_t cap) {
    std::function<void()> body = [=] { setmaxnreg_roles(fault); };
    return report(emu::launch(dim3(1), dim3(384), body), msg, cap);
}

namespace {
// Bulk tensor copies through the emulator's tensor maps: one elected thread of a 128-thread
// block loads the box at `coords` of `load_map` into shared memory at `dst_offset`
// (arrive.expect_tx of `expect_bytes`, then the copy completing on an mbarrier); every thread
// waits on the phase; `image` receives the whole shared memory (image_bytes); then the box is
// stored back through `store_map` (if any) at `coords`, committed and waited for. Planted bugs
// (fault): 1 the issuing thread reads the box before waiting on the mbarrier;
// 2 the store's source is overwritten before wait_group.read; 3 the store's source was
// written with ordinary stores and no fence.proxy.async; 4 the load lands on shared memory
// stored with ordinary stores that were not fenced.
struct TmaCase {
    const TensorMap* load_map;
    const TensorMap* store_map;
    int32_t coords[4];
    uint32_t rank;
    uint32_t dst_offset;
    uint32_t expect_bytes;
    uint32_t image_bytes;
    unsigned char* image;
    int32_t fault;
    uint32_t pad;
};

void tma_roundtrip(const TmaCase& c) {
    unsigned char* sm = RINGATTN_DYNAMIC_SMEM();
    uint64_t* bar = reinterpret_cast<uint64_t*>(sm);
    unsigned char* dst = sm + c.dst_offset;
    const unsigned tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(bar, 1);
        fence_mbarrier_init();
    }
    if (c.fault == 4 && tid == 5) smem_store(reinterpret_cast<uint32_t*>(dst) + 3, 7u);
    __syncthreads();
    const bool leader = tid < 32 && elect_one_sync();
    if (leader) {
        mbarrier_arrive_expect_tx(bar, c.expect_bytes);
        const int32_t* x = c.coords;
        if (c.rank == 2) tma_load_2d(dst, c.load_map, bar, x[0], x[1]);
        if (c.rank == 3) tma_load_3d(dst, c.load_map, bar, x[0], x[1], x[2]);
        if (c.rank == 4) tma_load_4d(dst, c.load_map, bar, x[0], x[1], x[2], x[3]);
    }
    if (c.fault == 1 && leader) (void)smem_load(reinterpret_cast<const uint32_t*>(dst) + 10);
    mbarrier_wait_parity(bar, 0);
    for (unsigned i = tid; i < c.image_bytes; i += 128) c.image[i] = sm[i];
    if (c.fault == 3 && tid == 9) smem_store(reinterpret_cast<uint32_t*>(dst) + 1, smem_load(reinterpret_cast<uint32_t*>(dst) + 1));
    __syncthreads();
    if (leader && c.store_map != nullptr) {
        const int32_t* x = c.coords;
        if (c.rank == 2) tma_store_2d(c.store_map, dst, x[0], x[1]);
        if (c.rank == 3) tma_store_3d(c.store_map, dst, x[0], x[1], x[2]);
        if (c.rank == 4) tma_store_4d(c.store_map, dst, x[0], x[1], x[2], x[3]);
        tma_store_commit();
        if (c.fault == 2) dst[0] ^= 1;
        tma_store_wait_read<0>();
    }
}
}  // namespace

// Runs a TmaCase in one block of 128 threads with image_bytes of shared memory; schedule 0
// forward, 1 reverse, 2 random (seed).
extern "C" int ringattn_emu_selftest_tma(const TmaCase* c, int schedule, uint64_t seed, char* msg, size_t cap) {
    const TmaCase cc = *c;
    std::function<void()> body = [cc] { tma_roundtrip(cc); };
    return report(emu::launch(dim3(1), dim3(128), body, cc.image_bytes, emu::Schedule(schedule), seed), msg, cap);
}

namespace {
// Two groups of 128 threads take turns through named barriers 1 and 2 (the consumers'
// ping-pong): group c waits on barrier 1 + c (256 threads: its own syncs and the other
// group's arrives), its first thread appends c to `log`, then it arrives on the other
// group's barrier; group 1 arrives on group 0's first, and neither arrives after its last
// turn. log[0] counts the entries. fault 1: group 1 skips its first arrive (deadlock);
// 2: group 1 names 192 threads; 3: barrier id 0.
__global__ void named_turns(int rounds, int fault, int* log) {
    const int c = int(threadIdx.x / 128);
    const uint32_t mine = fault == 3 ? 0u : 1u + uint32_t(c), other = 2u - uint32_t(c);
    const uint32_t n = fault == 2 && c == 1 ? 192u : 256u;
    if (c == 1 && fault != 1) named_barrier_arrive(other, n);
    for (int r = 0; r < rounds; ++r) {
        named_barrier_sync(mine, n);
        if (threadIdx.x % 128 == 0) log[1 + log[0]++] = c;
        if (!(c == 1 && r == rounds - 1)) named_barrier_arrive(other, n);
    }
}
}  // namespace

// log: 1 + 2 rounds ints; schedule 0 forward, 1 reverse, 2 random (seed).
extern "C" int ringattn_emu_selftest_named_barriers(int rounds, int fault, int schedule, uint64_t seed, int* log,
                                                    char* msg, size_t cap) {
    std::function<void()> body = [=] { named_turns(rounds, fault, log); };
    return report(emu::launch(dim3(1), dim3(256), body, 0, emu::Schedule(schedule), seed), msg, cap);
}
