// Every inline-PTX wrapper of the kernels, each with its emulated twin: the device path under
// nvcc (`__CUDACC__`), the emulator's otherwise. No other file holds PTX. Fragment layouts
// follow the PTX ISA tables (../shared/reference/ptx-and-emulation.md §1).
#pragma once
#include <stdint.h>

#include "params.h"

// wgmma shared-memory matrix descriptors (PTX §9.7.15.5.1.2; hopper-ptx.md §2), on both
// paths: bits 0-13 the start address, 16-29 its leading-dimension byte offset (LBO), 32-45
// the stride-dimension byte offset (SBO), each as (bytes & 0x3FFFF) >> 4; bits 49-51 the
// base offset (0 here: swizzled tiles are kept aligned to their swizzle repeat); bits 62-63
// the swizzle. The swizzle code is the reverse of the tensor map's enum.
enum class WgmmaSwizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// 16-byte units in one row of the swizzle pattern (W): 1 without swizzle (a core matrix row),
// 8, 4, 2 for 128B, 64B, 32B; the pattern repeats every 8 rows (128 W bytes).
__host__ __device__ constexpr uint32_t wgmma_swizzle_units(WgmmaSwizzle s) {
    return s == WgmmaSwizzle::kNone ? 1u : s == WgmmaSwizzle::k128B ? 8u : s == WgmmaSwizzle::k64B ? 4u : 2u;
}

// The element type of a wgmma's A and B operands (the accumulator is f32).
enum class WgmmaInput : uint32_t { kBF16 = 0, kF16 = 1 };

// Which dimension of a wgmma operand read through a descriptor is contiguous in shared
// memory: K (K-major, imm-trans 0) or M/N (imm-trans 1). A from registers is K-major.
enum class WgmmaMajor : int { kK = 0, kMN = 1 };

// scale-d: whether a wgmma adds A·B to the accumulator (kAdd) or overwrites it (kOverwrite:
// the old value is not read, so a fresh accumulator needs no zeroing).
enum class WgmmaAccumulate : uint32_t { kOverwrite = 0, kAdd = 1 };

// The descriptor of a matrix at shared address `smem_addr` (smem_u32 of its first byte).
__host__ __device__ inline uint64_t make_wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                    WgmmaSwizzle swizzle) {
    return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
           (uint64_t((sbo_bytes & 0x3FFFFu) >> 4) << 32) | (uint64_t(swizzle) << 62);
}

#ifdef __CUDACC__

// D = A·B + C for one warp: A 16x16 (row), B 16x8 (col), bf16 inputs, f32 accumulate.
// Lane L (g = L/4, t = L%4): a[0] = {A[g][2t], A[g][2t+1]}, a[1] = {A[g+8][2t], A[g+8][2t+1]},
// a[2] = {A[g][2t+8], A[g][2t+9]}, a[3] = {A[g+8][2t+8], A[g+8][2t+9]} (low half first);
// b[0] = {B[2t][g], B[2t+1][g]}, b[1] = {B[2t+8][g], B[2t+9][g]};
// c, d = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}.
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                  const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// The same with f16 inputs.
__device__ __forceinline__ void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                 const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// D = A·B + C for one warp: A 16x8 (row), B 8x8 (col), bf16 inputs, f32 accumulate.
// Lane L (g = L/4, t = L%4): a[0] = {A[g][2t], A[g][2t+1]}, a[1] = {A[g+8][2t], A[g+8][2t+1]}
// (low half first); b = {B[2t][g], B[2t+1][g]}; c, d as m16n8k16:
// {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}.
__device__ __forceinline__ void mma_m16n8k8_bf16(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// The same with f16 inputs.
__device__ __forceinline__ void mma_m16n8k8_f16(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// ldmatrix: loads 8x8 b16 matrices from shared memory. Threads 8j..8j+7 supply the 16-byte
// aligned row addresses of matrix j (x1: j = 0; x2: j < 2; x4: j < 4). Without .trans lane L
// receives in r[j] row L/4, columns 2(L%4) and 2(L%4)+1 of matrix j (low half first); with
// .trans it receives the elements at rows 2(L%4) and 2(L%4)+1, column L/4.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x1(uint32_t& r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r) : "r"(smem_u32(row)));
}

__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t& r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r) : "r"(smem_u32(row)));
}

// stmatrix (sm_90+): the inverse of ldmatrix, with the same address table: threads 8j..8j+7
// supply the 16-byte aligned row addresses of matrix j (x1: j = 0; x2: j < 2; x4: j < 4), and
// lane L's r[j] holds row L/4, columns 2(L%4) and 2(L%4)+1 of matrix j (low half first); with
// .trans it holds the elements at rows 2(L%4) and 2(L%4)+1, column L/4.
// Device builds for sm_80 have no stmatrix: these are templates whose body fails a
// static_assert there, so an sm_80 build breaks only if a kernel uses them; kernels must guard
// every use with `#if __CUDA_ARCH__ >= 900` (the emulator has them all).
template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x1(void* row, uint32_t r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r)
                 : "memory");
#endif
}

template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x2(void* row, const uint32_t r[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1,%2};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r[0]), "r"(r[1])
                 : "memory");
#endif
}

template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x4(void* row, const uint32_t r[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
}

template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x1_trans(void* row, uint32_t r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r)
                 : "memory");
#endif
}

template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x2_trans(void* row, const uint32_t r[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1,%2};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r[0]), "r"(r[1])
                 : "memory");
#endif
}

template <bool Enable = true>
__device__ __forceinline__ void stmatrix_x4_trans(void* row, const uint32_t r[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!Enable, "stmatrix needs sm_90: guard its use with #if __CUDA_ARCH__ >= 900");
#else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :
                 : "r"(smem_u32(row)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
}

// cp.async.cg: copies 16 bytes global -> shared asynchronously, reading only `src_bytes`
// (0..16) and zero-filling the rest. commit_group closes this thread's pending copies into a
// group; wait_group<N> returns when at most N of its groups are pending. The data is visible
// to other threads only after a barrier.
__device__ __forceinline__ void cp_async_cg16(void* dst_smem, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst_smem)), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x with ex2.approx (at most 2 ulp; -inf gives +0).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 1/x with rcp.approx (at most 1 ulp; subnormal inputs and results flushed to zero: 1/+-0 and
// 1/subnormal give +-inf, 1/+-inf gives +-0).
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// bf16/f16 conversions, round to nearest even. A packed .bf16x2/.f16x2 register holds the
// lower-numbered element (`lo`, the one at the lower address) in bits 0..15. PTX cvt puts its
// FIRST source in the UPPER half, hence the (hi, lo) operand order.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The halves of a packed register as f32 (exact): lo = bits 0..15, hi = bits 16..31.
__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float f16_lo(uint32_t x) { return f16_to_f32(uint16_t(x & 0xffffu)); }
__device__ __forceinline__ float f16_hi(uint32_t x) { return f16_to_f32(uint16_t(x >> 16)); }

// Single 16-bit elements (bit patterns), for loads and stores of one element.
__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16_rn(float x) {
    uint16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ uint16_t f32_to_f16_rn(float x) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

// movmatrix.trans (sm_75+): transposes an 8x8 b16 matrix held by the warp in the layout of
// one m16n8 accumulator quadrant packed to 16 bits: source element [r][c] sits in lane
// 4r + c/2, half c%2; lane L receives in half h the element src[2(L%4) + h][L/4].
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

// Named barriers (bar.sync / bar.arrive, hopper-ptx.md §5): barrier `id` (1 ... 15; 0 is
// __syncthreads') completes when `threads` threads (a multiple of 32) have arrived; sync
// arrives and waits for the completion, arrive only arrives. They order the participants'
// own memory accesses, not in-flight wgmma or copies.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The thread's index in the block (x), read afresh from %tid.x: a volatile read is neither
// merged with other reads nor hoisted, so offsets derived from it are recomputed where used
// (two instructions) instead of held in a register across a loop by a kernel at its
// register limit.
__device__ __forceinline__ unsigned thread_index_reread() {
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    return tid;
}

// ---- Hopper (sm_90): mbarrier, election (../shared/reference/hopper-ptx.md §3, §5) ----
//
// An mbarrier is an 8-byte, 8-byte aligned object in shared memory with a current phase,
// a pending and an expected arrival count (1 ... 2^20 - 1) and a transaction count
// (-(2^20 - 1) ... 2^20 - 1). A phase completes when its pending arrivals and its
// transaction count both reach zero: the phase advances and the pending count resets to the
// expected one. Waits name the phase by its parity: waiting on parity P returns once the
// phase of parity P has completed, i.e. when the current phase's parity differs from P (on a
// fresh barrier, parity 1 returns at once: a producer's first wait on an empty slot).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

// mbarrier.init: phase 0, `count` expected arrivals, no transactions. The barrier must not
// be live; other threads may use it after a block barrier (fence_mbarrier_init first).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Orders this thread's earlier mbarrier.init before the block barrier that publishes them.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival (release, CTA scope).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar))
                 : "memory");
}

// expect-tx(bytes) then one arrival: the producer's announcement of an asynchronous copy of
// `bytes` that completes on this barrier.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                     smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

// complete-tx(bytes): what an asynchronous copy does when `bytes` of it land (issued by hand
// only to simulate one).
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// Whether the phase of parity `parity` has completed (acquire, CTA scope); may suspend the
// thread for a while first, so callers loop.
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits for the phase of parity `parity` to complete. Never hangs: after
// RINGATTN_MBARRIER_DEADLINE_NS of the global timer (10 s) the thread traps, which fails the
// launch with an error the host reports.
#ifndef RINGATTN_MBARRIER_DEADLINE_NS
#define RINGATTN_MBARRIER_DEADLINE_NS 10000000000ull
#endif
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
    if (mbarrier_try_wait_parity(bar, parity)) return;
    const uint64_t start = global_timer_ns();
    while (!mbarrier_try_wait_parity(bar, parity)) {
        if (global_timer_ns() - start > RINGATTN_MBARRIER_DEADLINE_NS) __trap();
    }
}

// The same without a deadline of its own, for waits that another thread of the block covers:
// a thread that outlives this one (a producer's final wait on every stage, which has the
// deadline) traps, and a trap ends the whole launch. A deadline in the consumers' loop would
// cost them registers: ptxas then keeps the warp-specialised branch at the kernel's entry
// register count instead of its setmaxnreg budget.
// The loop is inside one asm block (labels are local to its braces), so the compiler sees
// straight-line code: a C++ loop here is a divergent path before the wgmmas that follow,
// which ptxas then serialises (warning C7520).
__device__ __forceinline__ void mbarrier_wait_parity_covered(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(
            smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// elect.sync: true in exactly one lane of `mask` (every lane of the mask must call it).
__device__ __forceinline__ bool elect_one_sync(uint32_t mask = 0xffffffffu) {
    uint32_t elected;
    asm volatile("{\n.reg .pred p;\nelect.sync _|p, %1;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(elected) : "r"(mask));
    return elected != 0;
}

#endif  // sm_90

// ---- Hopper (sm_90a): wgmma, setmaxnreg; sm_90: fence.proxy.async (hopper-ptx.md §1, §5) ----
//
// A warpgroup (4 consecutive warps from a warp rank that is a multiple of 4; all 128 threads
// execute each wgmma) computes D (64 x N, f32) = A (64 x 16) · B (16 x N) (+ D) per
// wgmma.mma_async, asynchronously: issue with wgmma_fence() first (it orders the threads'
// earlier register accesses before the wgmma), commit the issued ones as a group, and read
// the accumulators only after wgmma_wait_group has retired that group. Fragment of thread
// (warp w of the warpgroup, lane = 4g + t), element v of the accumulator (v < N/2):
//   row 16w + g + 8((v >> 1) & 1), column 8(v >> 2) + 2t + (v & 1);
// A from registers (a[0..3], two 16-bit values each, low half first): a[i] holds
//   A[16w + g + 8(i & 1)][2t + 8(i >> 1) + {0, 1}],
// i.e. the accumulator layout of columns 16s ... 16s + 15 packed in pairs (P = softmax(S) is
// fed back without shuffles). B (and A in the SS form) come from shared memory through
// descriptors (make_wgmma_desc).
// Device builds for other architectures have none of these but fence_proxy_async: like
// stmatrix, they are templates that fail a static_assert there, so kernels guard their use.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
// (`dependent_true` is a template-dependent expression that is true: the assertion fires only
// where the template is used.)
#define RINGATTN_WGMMA_UNAVAILABLE(dependent_true) \
    static_assert(!(dependent_true), "wgmma and setmaxnreg need sm_90a: guard their use with __CUDA_ARCH_FEAT_SM90_ALL")
#else
#define RINGATTN_WGMMA_UNAVAILABLE(dependent_true)
#endif

// One warpgroup's accumulator fragment for N columns: N/2 f32 registers per thread in the
// layout above. Kernels index it with compile-time constants (reg_ is the wrappers' own).
template <int N>
struct WgmmaAcc {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma wrappers exist for N = 64, 128, 256");
    float reg_[N / 2];
    __device__ __forceinline__ float& operator[](int i) { return reg_[i]; }
    __device__ __forceinline__ float operator[](int i) const { return reg_[i]; }
};

#define RINGATTN_WGMMA_REGS_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RINGATTN_WGMMA_REGS_64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RINGATTN_WGMMA_REGS_128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"


#define RINGATTN_F8(v, i)                                                                                    \
    "+f"(v[i]), "+f"(v[i + 1]), "+f"(v[i + 2]), "+f"(v[i + 3]), "+f"(v[i + 4]), "+f"(v[i + 5]), "+f"(v[i + 6]), \
        "+f"(v[i + 7])
#define RINGATTN_F32(v, i) RINGATTN_F8(v, i), RINGATTN_F8(v, i + 8), RINGATTN_F8(v, i + 16), RINGATTN_F8(v, i + 24)
#define RINGATTN_F_32(v) RINGATTN_F32(v, 0)
#define RINGATTN_F_64(v) RINGATTN_F32(v, 0), RINGATTN_F32(v, 32)
#define RINGATTN_F_128(v) RINGATTN_F32(v, 0), RINGATTN_F32(v, 32), RINGATTN_F32(v, 64), RINGATTN_F32(v, 96)

// The SS and RS forms for one shape and type: REGS the accumulators' operand list, then the
// operand numbers of the descriptors / A registers, scale-d and the transposes.
#define RINGATTN_WGMMA_SS_ASM(N, TY, R, A, B, S, TA, TB)                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N             \
                 "k16.f32." TY "." TY " {" RINGATTN_WGMMA_REGS_##R "}, %" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB \
                 ";\n}\n"                                                                                       \
                 : RINGATTN_F_##R(d.reg_)                                                                       \
                 : "l"(a_desc), "l"(b_desc), "r"(uint32_t(accumulate)), "n"(int(TransA)), "n"(int(TransB))     \
                 : "memory")
#define RINGATTN_WGMMA_RS_ASM(N, TY, R, A0, A1, A2, A3, B, S, TB)                                             \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N           \
                 "k16.f32." TY "." TY " {" RINGATTN_WGMMA_REGS_##R "}, {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3  \
                 "}, %" #B ", p, 1, 1, %" #TB ";\n}\n"                                                        \
                 : RINGATTN_F_##R(d.reg_)                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(uint32_t(accumulate)),       \
                   "n"(int(TransB))                                                                           \
                 : "memory")

// wgmma.fence.sync.aligned: before the first wgmma, and between any access to accumulator or
// A-fragment registers and a wgmma that uses them.
template <bool Enable = true>
__device__ __forceinline__ void wgmma_fence() {
    RINGATTN_WGMMA_UNAVAILABLE(Enable);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// D (+)= A · B, A (64 x 16) and B (16 x N) in shared memory through their descriptors,
// TransA/TransB their major dimension.
template <WgmmaInput In, WgmmaMajor TransA, WgmmaMajor TransB, int N>
__device__ __forceinline__ void wgmma_ss(WgmmaAcc<N>& d, uint64_t a_desc, uint64_t b_desc,
                                         WgmmaAccumulate accumulate) {
    RINGATTN_WGMMA_UNAVAILABLE(N > 0);
    if constexpr (In == WgmmaInput::kBF16) {
        if constexpr (N == 64) RINGATTN_WGMMA_SS_ASM(64, "bf16", 32, 32, 33, 34, 35, 36);
        if constexpr (N == 128) RINGATTN_WGMMA_SS_ASM(128, "bf16", 64, 64, 65, 66, 67, 68);
        if constexpr (N == 256) RINGATTN_WGMMA_SS_ASM(256, "bf16", 128, 128, 129, 130, 131, 132);
    } else {
        if constexpr (N == 64) RINGATTN_WGMMA_SS_ASM(64, "f16", 32, 32, 33, 34, 35, 36);
        if constexpr (N == 128) RINGATTN_WGMMA_SS_ASM(128, "f16", 64, 64, 65, 66, 67, 68);
        if constexpr (N == 256) RINGATTN_WGMMA_SS_ASM(256, "f16", 128, 128, 129, 130, 131, 132);
    }
}

// D (+)= A · B, A from this thread's four registers (the fragment above, K-major), B in shared
// memory through its descriptor.
template <WgmmaInput In, WgmmaMajor TransB, int N>
__device__ __forceinline__ void wgmma_rs(WgmmaAcc<N>& d, const uint32_t a[4], uint64_t b_desc,
                                         WgmmaAccumulate accumulate) {
    RINGATTN_WGMMA_UNAVAILABLE(N > 0);
    if constexpr (In == WgmmaInput::kBF16) {
        if constexpr (N == 64) RINGATTN_WGMMA_RS_ASM(64, "bf16", 32, 32, 33, 34, 35, 36, 37, 38);
        if constexpr (N == 128) RINGATTN_WGMMA_RS_ASM(128, "bf16", 64, 64, 65, 66, 67, 68, 69, 70);
        if constexpr (N == 256) RINGATTN_WGMMA_RS_ASM(256, "bf16", 128, 128, 129, 130, 131, 132, 133, 134);
    } else {
        if constexpr (N == 64) RINGATTN_WGMMA_RS_ASM(64, "f16", 32, 32, 33, 34, 35, 36, 37, 38);
        if constexpr (N == 128) RINGATTN_WGMMA_RS_ASM(128, "f16", 64, 64, 65, 66, 67, 68, 69, 70);
        if constexpr (N == 256) RINGATTN_WGMMA_RS_ASM(256, "f16", 128, 128, 129, 130, 131, 132, 133, 134);
    }
}

// wgmma.commit_group: the thread's uncommitted wgmmas become one group (possibly empty).
template <bool Enable = true>
__device__ __forceinline__ void wgmma_commit_group() {
    RINGATTN_WGMMA_UNAVAILABLE(Enable);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// wgmma.wait_group Pending: waits until at most `Pending` of the latest groups are in flight,
// then ties `accs` (the accumulators the retired groups wrote) to the wait so that the
// compiler cannot move their reads above it.
template <int Pending, int... Ns>
__device__ __forceinline__ void wgmma_wait_group(WgmmaAcc<Ns>&... accs) {
    RINGATTN_WGMMA_UNAVAILABLE(Pending >= 0);
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
    (
        [&] {
#pragma unroll
            for (int i = 0; i < int(sizeof(accs.reg_) / sizeof(float)); ++i) asm volatile("" : "+f"(accs.reg_[i])::"memory");
        }(),
        ...);
}

// setmaxnreg.inc / .dec (sm_90a): the warpgroup's register budget per thread becomes Regs
// (24 ... 256, a multiple of 8); every warp of the warpgroup executes it. The kernel needs a
// register cap at entry (__launch_bounds__(threads, 1)), or ptxas ignores it (C7508).
template <uint32_t Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(Regs >= 24 && Regs <= 256 && Regs % 8 == 0, "setmaxnreg: 24 ... 256, a multiple of 8");
    RINGATTN_WGMMA_UNAVAILABLE(Regs > 0);
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <uint32_t Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(Regs >= 24 && Regs <= 256 && Regs % 8 == 0, "setmaxnreg: 24 ... 256, a multiple of 8");
    RINGATTN_WGMMA_UNAVAILABLE(Regs > 0);
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// fence.proxy.async.shared::cta: orders this thread's earlier ordinary shared-memory stores
// (st.shared, stmatrix) before later reads of them by the async proxy (wgmma, bulk copies);
// each writing thread executes it before the barrier that publishes the data.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

// ---- Hopper (sm_90): bulk tensor copies, TMA (hopper-ptx.md §4) ----
//
// tma_load_Nd (N = 2, 3, 4): copies the box of the tensor map `map` whose first element is at
// coordinates (c0, c1, ...) (c0 innermost, in elements; may lie outside the tensor: those
// elements are filled with zeros) into shared memory at `dst` (128-byte aligned; the box
// dense, dim 0 fastest, 16-byte chunks swizzled by the map's mode on the absolute shared
// address), and completes its bytes (the whole box, filled elements included) as
// transactions on the mbarrier `bar`: the issuing thread announces them first with
// mbarrier_arrive_expect_tx. tma_store_Nd copies a box from shared memory to the tensor
// (elements outside it are not written); tma_store_commit groups the thread's stores and
// tma_store_wait_read<N> waits until at most N groups still read their shared source.
// Shared memory written by ordinary stores needs fence_proxy_async before a store reads it.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                                            int32_t c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                                            int32_t c2, int32_t c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, const void* src, int32_t c0, int32_t c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, const void* src, int32_t c0, int32_t c1,
                                             int32_t c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src, int32_t c0, int32_t c1,
                                             int32_t c2, int32_t c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
}
// Fetches the map into the cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif  // sm_90

#else  // the emulated twins

namespace emu {

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float f16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);  // zero or subnormal
        if (sign) f = -f;
        return f;
    }
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);  // inf / nan
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    std::memcpy(&f, &bits, 4);
    return f;
}

// mma.m16n8k16 / m16n8k8 twin (K = 16 or 8, f32 accumulate). The warp gathers its K/4 A and
// K/8 B registers (two per 64-bit word), rebuilds A (16xK) and B (Kx8) from the fragment
// tables (A register i: row g + 8(i%2), cols 2t + 8(i/2) + {0,1}; B register i: rows
// 2t + 8i + {0,1}, col g), and each lane computes its four D elements. Products of bf16 or
// f16 values are exact in f64; they are summed in f64, C added, and the result rounded once
// to f32 (PTX leaves the accumulation order unspecified).
template <int K>
inline void mma_m16n8(float d[4], const uint32_t* a, const uint32_t* b, const float c[4], bool bf16) {
    static_assert(K == 8 || K == 16, "m16n8k8 or m16n8k16");
    constexpr int NA = K / 4, NB = K / 8, NR = NA + NB;
    uint32_t mine[NR + 1] = {};
    for (int i = 0; i < NA; ++i) mine[i] = a[i];
    for (int i = 0; i < NB; ++i) mine[NA + i] = b[i];
    std::array<uint64_t, 32> words[(NR + 1) / 2];
    for (int w = 0; w < (NR + 1) / 2; ++w) {
        words[w] = warp_allgather(uint64_t(mine[2 * w]) | (uint64_t(mine[2 * w + 1]) << 32));
    }
    auto cvt = [bf16](uint32_t reg, int half) {
        const uint16_t h = uint16_t(half ? reg >> 16 : reg & 0xffffu);
        return double(bf16 ? bf16_to_float(h) : f16_to_float(h));
    };
    auto reg = [&](unsigned src, int i) { return uint32_t(words[i / 2][src] >> (32 * (i % 2))); };
    // This lane's D elements need A rows g and g + 8 (held by lanes 4g..4g+3) and B columns
    // 2t and 2t + 1 (held by lanes 4n..4n+3 for n = 2t, 2t + 1).
    const unsigned lane = lane_id(), g = lane >> 2, t = lane & 3;
    current->block->mma_macs += 16 * 8 * K / 32;  // this lane's share of the warp's 16 x 8 x K
    double Ar[2][K], Bc[2][K];
    for (unsigned q = 0; q < 4; ++q) {
        for (int h = 0; h < 2; ++h) {
            for (int i = 0; i < NA; ++i) Ar[i % 2][2 * q + 8 * (i / 2) + h] = cvt(reg(4 * g + q, i), h);
            for (unsigned cn = 0; cn < 2; ++cn) {
                for (int i = 0; i < NB; ++i) Bc[cn][2 * q + 8 * i + h] = cvt(reg(4 * (2 * t + cn) + q, NA + i), h);
            }
        }
    }
    for (int i = 0; i < 4; ++i) {
        double acc = 0.0;
        for (int k = 0; k < K; ++k) acc += Ar[i / 2][k] * Bc[i % 2][k];
        d[i] = float(acc + double(c[i]));
    }
}

// Whether the 8·count row addresses of a warp's ldmatrix/stmatrix lie in shared memory;
// reports the first that does not. The lane that supplied a row is recorded in the race
// shadow as the one that reads (or writes) it.
inline bool matrix_rows_ok(const std::array<uint64_t, 32>& addr, int count, const void* own, bool write,
                           const char* what) {
    for (int i = 0; i < 8 * count; ++i) {
        if (!check_shared(reinterpret_cast<const void*>(addr[i]), 16, what)) return false;
    }
    if (lane_id() < unsigned(8 * count)) shadow_access(own, 16, write, what);
    return true;
}

// ldmatrix twin: the warp publishes its row addresses, then each lane gathers its halves.
inline void ldmatrix(uint32_t* r, int count, bool trans, const void* row) {
    const auto addr = warp_allgather(reinterpret_cast<uintptr_t>(row));
    const unsigned lane = lane_id();
    for (int j = 0; j < count; ++j) r[j] = 0;
    for (int i = 0; i < 8 * count; ++i) {
        if (addr[i] % 16 != 0) {
            fail("ldmatrix: row address of lane " + std::to_string(i) + " is not 16-byte aligned");
            return;
        }
    }
    if (!matrix_rows_ok(addr, count, row, false, "ldmatrix")) return;
    for (int j = 0; j < count; ++j) {
        uint16_t h[2];
        for (int half = 0; half < 2; ++half) {
            unsigned mrow, mcol;
            if (trans) {
                mrow = 2 * (lane % 4) + half;
                mcol = lane / 4;
            } else {
                mrow = lane / 4;
                mcol = 2 * (lane % 4) + half;
            }
            std::memcpy(&h[half], reinterpret_cast<const unsigned char*>(addr[8 * j + mrow]) + 2 * mcol, 2);
        }
        r[j] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
    }
}

// stmatrix twin, the inverse of ldmatrix: the warp publishes its row addresses (checked for
// 16-byte alignment; a misaligned one fails the launch and nothing is stored), then each lane
// stores the halves of its own registers into the rows other lanes supplied.
inline void stmatrix(const uint32_t* r, int count, bool trans, void* row) {
    const auto addr = warp_allgather(reinterpret_cast<uintptr_t>(row));
    for (int i = 0; i < 8 * count; ++i) {
        if (addr[i] % 16 != 0) {
            fail("stmatrix: row address of lane " + std::to_string(i) + " is not 16-byte aligned");
            return;
        }
    }
    if (!matrix_rows_ok(addr, count, row, true, "stmatrix")) return;
    const unsigned lane = lane_id();
    for (int j = 0; j < count; ++j) {
        for (int half = 0; half < 2; ++half) {
            unsigned mrow, mcol;
            if (trans) {
                mrow = 2 * (lane % 4) + half;
                mcol = lane / 4;
            } else {
                mrow = lane / 4;
                mcol = 2 * (lane % 4) + half;
            }
            const uint16_t h = uint16_t(half ? r[j] >> 16 : r[j] & 0xffffu);
            unsigned char* dst = reinterpret_cast<unsigned char*>(addr[8 * j + mrow]) + 2 * mcol;
            proxy_generic_write(dst, 2);
            std::memcpy(dst, &h, 2);
        }
    }
}

// f32 -> bf16 / f16 bit patterns, round to nearest even; NaN stays NaN (quiet bit set, sign and
// leading payload kept), overflow gives inf, f16 subnormals are rounded exactly.
inline uint16_t f32_to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline uint16_t f32_to_f16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    const uint32_t ax = bits & 0x7fffffffu;
    if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
    if (ax >= 0x38800000u) {  // |x| >= 2^-14: normal (or overflow to inf)
        const uint32_t r = ax - (112u << 23);  // rebias the exponent from 127 to 15
        const uint32_t h = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
        return uint16_t(sign | (h < 0x7c00u ? h : 0x7c00u));
    }
    const uint32_t e = ax >> 23;
    if (e < 102) return sign;  // |x| < 2^-25: rounds to zero
    // Subnormal: |x| / 2^-24 = mant · 2^(e - 126), rounded to an integer (0x400 is the
    // smallest normal, which the encoding handles by itself).
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const unsigned shift = 126 - e;  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return uint16_t(sign | q);
}

// cp.async twin: the destination is checked to lie in shared memory and the source in a
// buffer of the launch; the copy is recorded and its destination poisoned at issue; it
// happens when wait_group retires its group. Both count as writes by the issuing thread in
// the race shadow.
inline void cp_async(void* dst, const void* src, unsigned src_bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
        fail("cp.async: 16-byte copy with an address that is not 16-byte aligned");
        return;
    }
    if (src_bytes > 16) {
        fail("cp.async: src-size " + std::to_string(src_bytes) + " exceeds the 16-byte copy");
        return;
    }
    if (!check_shared(dst, 16, "cp.async destination")) return;
    if (src_bytes > 0 && !check_global(src, src_bytes, "cp.async source")) return;
    shadow_access(dst, 16, true, "cp.async (issue)");
    ++current->block->async_copies;
    std::memset(dst, 0xFF, 16);
    current->uncommitted.push_back(AsyncCopy{dst, src, src_bytes, 16 - src_bytes});
}

inline void cp_async_commit_group() {
    Thread* t = current;
    t->groups.push_back(std::move(t->uncommitted));
    t->uncommitted.clear();
}

inline void cp_async_wait_group(int n) {
    Thread* t = current;
    while (t->groups.size() > size_t(n)) {
        for (const AsyncCopy& c : t->groups.front()) {
            shadow_access(c.dst, 16, true, "cp.async (completion)");
            std::memcpy(c.dst, c.src, c.bytes);
            std::memset(static_cast<unsigned char*>(c.dst) + c.bytes, 0, c.zero_fill);
        }
        t->groups.erase(t->groups.begin());
    }
}

}  // namespace emu

inline void cp_async_cg16(void* dst_smem, const void* src, unsigned src_bytes) {
    ::emu::cp_async(dst_smem, src, src_bytes);
}
inline void cp_async_commit() { ::emu::cp_async_commit_group(); }
template <int N>
inline void cp_async_wait() {
    ::emu::cp_async_wait_group(N);
}

// mbarrier twins. The 8 bytes hold the state (hopper-ptx.md §3): bits 0..19 the pending
// arrivals, 20..39 the expected ones, 40..60 the transaction count (21-bit two's complement),
// 61 the current phase's parity; bits 62 and 63 are zero in a live barrier, so the 0xFF
// poison of fresh shared memory (and a zeroed word: no expected arrivals) reads as "not
// initialised". Operations are atomic (the fibers of a block run one at a time) and bypass
// the race shadow (they synchronise). Misuse is reported: an object outside shared memory or
// not 8-byte aligned, use before init, counts or transaction counts outside their ranges.
// Waits suspend the fiber until the phase completes (a valid try_wait: it may block until
// completion); a wait that can never complete is reported as a deadlock by the scheduler.
namespace emu {
constexpr uint64_t kMbarField = (1ull << 20) - 1;

struct MbarState {
    uint32_t pending, expected, parity;
    int32_t tx;
};

inline bool mbar_load(const uint64_t* bar, const char* what, MbarState& st) {
    if (reinterpret_cast<uintptr_t>(bar) % 8 != 0) {
        fail(std::string(what) + ": mbarrier not 8-byte aligned");
        return false;
    }
    if (!check_shared(bar, 8, what)) return false;
    uint64_t v;
    std::memcpy(&v, bar, 8);
    st.pending = uint32_t(v & kMbarField);
    st.expected = uint32_t((v >> 20) & kMbarField);
    const uint32_t tx = uint32_t((v >> 40) & ((1ull << 21) - 1));
    st.tx = tx & (1u << 20) ? int32_t(tx) - (1 << 21) : int32_t(tx);
    st.parity = uint32_t(v >> 61) & 1u;
    if ((v >> 62) != 0 || st.expected == 0) {
        fail(std::string(what) + ": mbarrier used before mbarrier.init (or overwritten)");
        return false;
    }
    return true;
}

inline void mbar_store(uint64_t* bar, const MbarState& st) {
    const uint64_t v = uint64_t(st.pending) | (uint64_t(st.expected) << 20) |
                       ((uint64_t(uint32_t(st.tx)) & ((1ull << 21) - 1)) << 40) | (uint64_t(st.parity) << 61);
    std::memcpy(bar, &v, 8);
}

// Completes the phase when its arrivals and transactions are all in.
inline void mbar_settle(MbarState& st) {
    if (st.pending == 0 && st.tx == 0) {
        st.parity ^= 1u;
        st.pending = st.expected;
    }
}

// tx += delta, checked against the valid range.
inline bool mbar_add_tx(MbarState& st, int64_t delta, const char* what) {
    const int64_t tx = int64_t(st.tx) + delta;
    if (tx > int64_t(kMbarField) || tx < -int64_t(kMbarField)) {
        fail(std::string(what) + ": mbarrier transaction count " + std::to_string(tx) + " outside +-(2^20 - 1)");
        return false;
    }
    st.tx = int32_t(tx);
    return true;
}

// complete-tx(bytes): the transactions of a phase land.
inline void mbar_complete_tx(uint64_t* bar, uint32_t bytes, const char* what) {
    MbarState st;
    if (!mbar_load(bar, what, st)) return;
    if (!mbar_add_tx(st, -int64_t(bytes), what)) return;
    mbar_settle(st);
    mbar_store(bar, st);
}

inline void mbar_arrive(uint64_t* bar, uint32_t tx, const char* what) {
    MbarState st;
    if (!mbar_load(bar, what, st)) return;
    if (tx > kMbarField) {
        fail(std::string(what) + ": expect-tx of " + std::to_string(tx) + " bytes exceeds 2^20 - 1");
        return;
    }
    if (!mbar_add_tx(st, tx, what)) return;
    st.pending -= 1;  // >= 1 in a live phase: it resets to expected >= 1 on completion
    mbar_settle(st);
    mbar_store(bar, st);
}
}  // namespace emu

inline void mbarrier_init(uint64_t* bar, uint32_t count) {
    if (reinterpret_cast<uintptr_t>(bar) % 8 != 0) {
        ::emu::fail("mbarrier.init: mbarrier not 8-byte aligned");
        return;
    }
    if (!::emu::check_shared(bar, 8, "mbarrier.init")) return;
    if (count == 0 || count > ::emu::kMbarField) {
        ::emu::fail("mbarrier.init: expected count " + std::to_string(count) + " outside 1 ... 2^20 - 1");
        return;
    }
    ::emu::mbar_store(bar, ::emu::MbarState{count, count, 0, 0});
}
inline void fence_mbarrier_init() {}
inline void mbarrier_arrive(uint64_t* bar) { ::emu::mbar_arrive(bar, 0, "mbarrier.arrive"); }
inline void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    ::emu::mbar_arrive(bar, bytes, "mbarrier.arrive.expect_tx");
}
inline void mbarrier_complete_tx(uint64_t* bar, uint32_t bytes) {
    ::emu::mbar_complete_tx(bar, bytes, "mbarrier.complete_tx");
}
inline bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    ::emu::MbarState st;
    if (!::emu::mbar_load(bar, "mbarrier.try_wait.parity", st)) return true;  // reported; do not hang
    if (st.parity != (parity & 1u)) return true;
    ::emu::Thread* t = ::emu::current;
    t->mbar = bar;
    t->mbar_parity = parity & 1u;
    ::emu::yield(::emu::Wait::Mbarrier);
    return true;
}
inline void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) { mbarrier_try_wait_parity(bar, parity); }
inline void mbarrier_wait_parity_covered(uint64_t* bar, uint32_t parity) { mbarrier_try_wait_parity(bar, parity); }

inline unsigned thread_index_reread() { return threadIdx.x; }
inline void named_barrier_sync(uint32_t id, uint32_t threads) { ::emu::named_barrier(id, threads, true, "bar.sync"); }
inline void named_barrier_arrive(uint32_t id, uint32_t threads) {
    ::emu::named_barrier(id, threads, false, "bar.arrive");
}

// elect.sync twin: the lowest lane of `mask` is elected (PTX leaves which one unspecified);
// every lane of the mask must call it (a warp collective, like __ballot_sync).
inline bool elect_one_sync(uint32_t mask = 0xffffffffu) {
    const unsigned lane = ::emu::lane_id();
    const unsigned callers = __ballot_sync(mask, 1);
    if ((callers & mask) != mask) {
        ::emu::fail("elect.sync: not every lane of the member mask called it");
    }
    return (mask >> lane & 1u) && lane == unsigned(__builtin_ctz(mask));
}

namespace emu {

// The shared-window byte address of 16-bit element (mn, k) of the matrix a wgmma descriptor
// describes, from the canonical layouts (hopper-ptx.md §2, in bytes; T = 8 elements = 16 B,
// W = wgmma_swizzle_units):
//   K-major, no swizzle   ((8,m),(8,2k)) : ((16, SBO), (2, LBO))     8x16 B core matrices
//   K-major, swizzled     ((8,m),(8W))   : ((16W, SBO), 2)
//   MN-major, no swizzle  ((8,m),(8,k))  : ((2, SBO), (16, LBO))
//   MN-major, swizzled    ((8,W,m),(8,k)): ((2, 16, LBO), (16W, SBO))
// then, swizzled, the 16-byte chunk bits [4, 4 + log2 W) XORed with bits [7, 7 + log2 W).
// Misuse is reported (returns UINT32_MAX): bits outside the fields, a non-zero base offset,
// a swizzled start more than 128 B past its 1024/512/256-byte repeat (only K-step offsets
// may be added to an aligned tile's start).
inline uint32_t wgmma_desc_address(uint64_t desc, WgmmaMajor major, uint32_t mn, uint32_t k) {
    const uint64_t fields = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (7ull << 49) | (3ull << 62);
    if (desc & ~fields) {
        fail("wgmma descriptor: bits set outside its fields");
        return UINT32_MAX;
    }
    const uint32_t start = uint32_t(desc & 0x3FFF) << 4, lbo = uint32_t((desc >> 16) & 0x3FFF) << 4;
    const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFF) << 4, base = uint32_t((desc >> 49) & 7);
    const WgmmaSwizzle sw = WgmmaSwizzle(uint32_t(desc >> 62));
    const uint32_t w = wgmma_swizzle_units(sw);
    if (base != 0) {
        fail("wgmma descriptor: base offset " + std::to_string(base) + " (keep swizzled tiles aligned to their repeat)");
        return UINT32_MAX;
    }
    if (sw != WgmmaSwizzle::kNone && start % (128 * w) >= 128) {
        fail("wgmma descriptor: swizzled start " + std::to_string(start) + " is " + std::to_string(start % (128 * w)) +
             " bytes past its " + std::to_string(128 * w) + "-byte repeat (at most a K-step, < 128, may be added)");
        return UINT32_MAX;
    }
    uint32_t off;
    if (major == WgmmaMajor::kK) {
        off = sw == WgmmaSwizzle::kNone ? (mn % 8) * 16 + (mn / 8) * sbo + (k / 8) * lbo + (k % 8) * 2
                                        : (mn % 8) * 16 * w + (mn / 8) * sbo + k * 2;
    } else {
        off = sw == WgmmaSwizzle::kNone
                  ? (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo
                  : (mn % 8) * 2 + ((mn / 8) % w) * 16 + (mn / (8 * w)) * lbo + (k % 8) * 16 * w + (k / 8) * sbo;
    }
    const uint32_t a = start + off;
    return a ^ (((a >> 7) & (w - 1)) << 4);
}
}  // namespace emu

// ---- wgmma, setmaxnreg, fence.proxy.async twins ----
//
// A wgmma is a warpgroup rendezvous (emu::warpgroup_gather): all 128 threads of an aligned
// warpgroup must issue it with the same shape, type, transposes, scale-d and descriptors
// (reported otherwise; a warpgroup whose other warps never come is a deadlock naming it).
// The first thread past the rendezvous reads the operands: A and B through the descriptors
// (wgmma_desc_address: swizzle and layout misuse reported; every element inside the block's
// shared memory; none stored by a thread that has not executed fence.proxy.async since), or A
// from the warpgroup's registers. Each thread's accumulator fragment is then in flight: its
// registers hold NaN and any access through WgmmaAcc::operator[] is reported until
// wgmma_wait_group retires the group (after a scheduler round: the other fibers run while it
// completes), which computes the fragment (exact products summed in double, the old D added,
// rounded once to f32); the last of the 128 threads to retire it reports a write to the shared
// memory the wgmma read since issue (a buffer released for refilling before every warp has
// waited). Further wgmmas may chain on an in-flight accumulator of the same shape (PTX
// orders them). wgmma.fence is checked: a wgmma needs one since the thread last accessed the
// accumulator. Not modelled: changes to A-fragment registers in flight (their values are
// taken at issue), the proxy fence for accumulator-to-shared stores read back by wgmma in the
// same thread without a barrier.
namespace emu {
constexpr uint32_t kWgmmaPoison = 0x7FC0DEADu;  // a quiet NaN

// Reports an access to an accumulator fragment whose wgmma is in flight; marks the access for
// the wgmma.fence check.
inline void wgmma_acc_access(uint32_t in_flight, uint64_t& touched) {
    Thread* t = current;
    if (t == nullptr) return;
    touched = t->acc_seq;
    if (in_flight != 0) {
        fail("wgmma accumulator accessed while " + std::to_string(in_flight) +
             " wgmma(s) writing it are in flight: wgmma.wait_group must retire them first");
    }
}
}  // namespace emu

template <int N>
struct WgmmaAcc {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma wrappers exist for N = 64, 128, 256");
    float reg_[N / 2];
    // Emulator only: the fragment the in-flight wgmmas build, how many are in flight, and the
    // thread's access number of the last access (Thread::acc_seq).
    float value_[N / 2];
    uint32_t in_flight_ = 0;
    mutable uint64_t touched_ = 0;
    float& operator[](int i) {
        ::emu::wgmma_acc_access(in_flight_, touched_);
        return reg_[i];
    }
    float operator[](int i) const {
        ::emu::wgmma_acc_access(in_flight_, touched_);
        return reg_[i];
    }
};

namespace emu {
// The shared-window address of p (smem_u32 on the device): its offset in the block's arena.
inline uint32_t smem_offset_of(const void* p) {
    Block* b = current->block;
    return uint32_t(static_cast<const unsigned char*>(p) - (b->smem.data() + b->smem_offset));
}

// Reads the 16-bit element at shared address `addr` for an async-proxy reader, recording it
// in `op`; false (reported) outside shared memory or unfenced.
inline bool wgmma_read(WgmmaOp& op, uint32_t addr, bool bf16, double& out, const char* what) {
    if (addr == UINT32_MAX) return false;  // descriptor misuse, reported
    Block* b = current->block;
    const unsigned char* p = b->smem.data() + b->smem_offset + addr;
    if (!check_shared(p, 2, what)) return false;
    if (!proxy_fenced(addr, what)) return false;
    uint16_t h;
    std::memcpy(&h, p, 2);
    out = double(bf16 ? bf16_to_float(h) : f16_to_float(h));
    op.smem_at.push_back(addr);
    op.smem_was.push_back(h);
    return true;
}

// Builds the op of a warpgroup's rendezvous: `slots` are the 128 records (see wgmma_issue).
inline std::shared_ptr<const WgmmaOp> wgmma_build(const WarpgroupSlot* slots, bool rs, uint32_t n, bool bf16,
                                                  WgmmaMajor ta, WgmmaMajor tb, bool scale_d) {
    auto op = std::make_shared<WgmmaOp>();
    op->n = n;
    op->scale_d = scale_d;
    op->a.assign(64 * 16, 0.0);
    op->b.assign(16 * size_t(n), 0.0);
    const uint64_t a_desc = slots[0].words[1], b_desc = slots[0].words[2];
    if (rs) {
        for (unsigned th = 0; th < 128; ++th) {
            const unsigned w = th / 32, g = (th % 32) / 4, t = th % 4;
            for (unsigned i = 0; i < 4; ++i) {
                const uint32_t r = uint32_t(slots[th].words[3 + i / 2] >> (32 * (i % 2)));
                for (unsigned h = 0; h < 2; ++h) {
                    const uint16_t bits = uint16_t(h ? r >> 16 : r & 0xffffu);
                    const unsigned row = 16 * w + g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1) + h;
                    op->a[row * 16 + col] = double(bf16 ? bf16_to_float(bits) : f16_to_float(bits));
                }
            }
        }
    } else {
        for (uint32_t m = 0; m < 64; ++m) {
            for (uint32_t k = 0; k < 16; ++k) {
                if (!wgmma_read(*op, wgmma_desc_address(a_desc, ta, m, k), bf16, op->a[m * 16 + k], "wgmma (A operand)"))
                    return op;
            }
        }
    }
    for (uint32_t k = 0; k < 16; ++k) {
        for (uint32_t c = 0; c < n; ++c) {
            if (!wgmma_read(*op, wgmma_desc_address(b_desc, tb, c, k), bf16, op->b[k * n + c], "wgmma (B operand)"))
                return op;
        }
    }
    return op;
}

// wgmma.mma_async: the checks and rendezvous above; `a_regs` is null in the SS form.
inline void wgmma_issue(float* visible, float* value, uint32_t* in_flight, uint64_t touched, uint32_t n,
                        WgmmaInput in, WgmmaMajor ta, WgmmaMajor tb, uint64_t a_desc, uint64_t b_desc,
                        const uint32_t* a_regs, WgmmaAccumulate accumulate) {
    Thread* t = current;
    const bool rs = a_regs != nullptr;
    if (t->fence_mark == 0) {
        fail("wgmma issued without a wgmma.fence before it (needed before the first wgmma)");
    } else if (touched > t->fence_mark) {
        fail("wgmma uses an accumulator this thread accessed after its last wgmma.fence: wgmma.fence must "
             "separate register accesses from the wgmma that uses the registers");
    }
    WarpgroupSlot mine{};
    mine.words[0] = (rs ? 2u : 1u) | (uint64_t(n) << 8) | (uint64_t(in) << 20) | (uint64_t(ta) << 24) |
                    (uint64_t(tb) << 26) | (uint64_t(accumulate) << 28);
    mine.words[1] = rs ? 0 : a_desc;
    mine.words[2] = b_desc;
    if (rs) {
        mine.words[3] = uint64_t(a_regs[0]) | (uint64_t(a_regs[1]) << 32);
        mine.words[4] = uint64_t(a_regs[2]) | (uint64_t(a_regs[3]) << 32);
    }
    const WarpgroupSlot* slots = warpgroup_gather(mine, "wgmma.mma_async");
    if (slots == nullptr) return;
    for (unsigned i = 0; i < 128; ++i) {
        const char* what = slots[i].words[0] != mine.words[0] ? "shape, type, form, transposes or scale-d"
                           : slots[i].words[1] != mine.words[1] ? "A descriptor"
                           : slots[i].words[2] != mine.words[2] ? "B descriptor"
                                                                : nullptr;
        if (what != nullptr) {
            fail(std::string("wgmma.mma_async: the ") + what + " differs between threads " +
                 std::to_string(t->linear & ~127u) + " and " + std::to_string((t->linear & ~127u) + i) +
                 " of the warpgroup (it must be the same in all 128)");
            return;
        }
    }
    Block* b = t->block;
    auto& cur = b->wg_current[t->linear / 128];
    if (cur.first != t->wg_ops || cur.second == nullptr) {
        cur = {t->wg_ops, wgmma_build(slots, rs, n, in == WgmmaInput::kBF16, ta, tb,
                                      accumulate == WgmmaAccumulate::kAdd)};
        b->mma_macs += 64ull * n * 16;
    }
    if (*in_flight == 0) {
        std::memcpy(value, visible, sizeof(float) * n / 2);
        for (uint32_t i = 0; i < n / 2; ++i) std::memcpy(&visible[i], &kWgmmaPoison, 4);
    }
    ++*in_flight;
    t->wgmma_uncommitted.push_back(WgmmaPending{cur.second, visible, value, in_flight});
}

// Completes one op for this thread: the fragment, and when the last of the warpgroup's 128
// threads retires it (until then some warp's part may still read its operands), the
// shared-memory check.
inline void wgmma_retire(const WgmmaPending& p) {
    WgmmaOp& op = const_cast<WgmmaOp&>(*p.op);
    if (++op.retired == 128) {
        const unsigned char* base = current->block->smem.data() + current->block->smem_offset;
        for (size_t i = 0; i < op.smem_at.size(); ++i) {
            uint16_t now;
            std::memcpy(&now, base + op.smem_at[i], 2);
            if (now != op.smem_was[i]) {
                fail("shared memory at offset " + std::to_string(op.smem_at[i]) +
                     " read by an in-flight wgmma was overwritten before wgmma.wait_group retired it");
                break;
            }
        }
    }
    const unsigned th = current->linear % 128, w = th / 32, g = (th % 32) / 4, t = th % 4;
    for (uint32_t v = 0; v < op.n / 2; ++v) {
        const unsigned row = 16 * w + g + 8 * ((v >> 1) & 1), col = 8 * (v >> 2) + 2 * t + (v & 1);
        double acc = 0.0;
        for (unsigned k = 0; k < 16; ++k) acc += op.a[row * 16 + k] * op.b[k * op.n + col];
        p.value[v] = float(acc + (op.scale_d ? double(p.value[v]) : 0.0));
    }
    if (--*p.in_flight == 0) std::memcpy(p.visible, p.value, sizeof(float) * op.n / 2);
}
}  // namespace emu

inline uint32_t smem_u32(const void* p) { return ::emu::smem_offset_of(p); }

template <bool Enable = true>
inline void wgmma_fence() {
    ::emu::Thread* t = ::emu::current;
    t->fence_mark = t->acc_seq++;
}

template <WgmmaInput In, WgmmaMajor TransA, WgmmaMajor TransB, int N>
inline void wgmma_ss(WgmmaAcc<N>& d, uint64_t a_desc, uint64_t b_desc, WgmmaAccumulate accumulate) {
    ::emu::wgmma_issue(d.reg_, d.value_, &d.in_flight_, d.touched_, N, In, TransA, TransB, a_desc, b_desc, nullptr,
                       accumulate);
}

template <WgmmaInput In, WgmmaMajor TransB, int N>
inline void wgmma_rs(WgmmaAcc<N>& d, const uint32_t a[4], uint64_t b_desc, WgmmaAccumulate accumulate) {
    ::emu::wgmma_issue(d.reg_, d.value_, &d.in_flight_, d.touched_, N, In, WgmmaMajor::kK, TransB, 0, b_desc, a,
                       accumulate);
}

template <bool Enable = true>
inline void wgmma_commit_group() {
    ::emu::Thread* t = ::emu::current;
    t->wgmma_groups.push_back(std::move(t->wgmma_uncommitted));
    t->wgmma_uncommitted.clear();
}

template <int Pending, int... Ns>
inline void wgmma_wait_group(WgmmaAcc<Ns>&...) {
    static_assert(Pending >= 0, "wgmma.wait_group: a non-negative immediate");
    ::emu::Thread* t = ::emu::current;
    // The groups complete some time after issue: the other fibers run first (a round), so
    // that whatever they do meanwhile — a tensor copy refilling a buffer released before the
    // wait, a store — meets the last retirement's check of the operands read.
    if (t->wgmma_groups.size() > size_t(Pending)) ::emu::yield(::emu::Wait::None);
    while (t->wgmma_groups.size() > size_t(Pending)) {
        for (const ::emu::WgmmaPending& p : t->wgmma_groups.front()) ::emu::wgmma_retire(p);
        t->wgmma_groups.erase(t->wgmma_groups.begin());
    }
}

namespace emu {
// setmaxnreg twin: a warpgroup rendezvous (all 128 threads, the same instruction); the
// register budget itself has no effect here.
inline void setmaxnreg(uint32_t regs, bool inc) {
    WarpgroupSlot mine{};
    mine.words[0] = 0x100u | (inc ? 1u : 0u) | (uint64_t(regs) << 16);
    const WarpgroupSlot* slots = warpgroup_gather(mine, inc ? "setmaxnreg.inc" : "setmaxnreg.dec");
    if (slots == nullptr) return;
    for (unsigned i = 0; i < 128; ++i) {
        if (slots[i].words[0] != mine.words[0]) {
            fail("setmaxnreg: threads of one warpgroup execute different setmaxnreg instructions at the same point");
            return;
        }
    }
}
}  // namespace emu

template <uint32_t Regs>
inline void setmaxnreg_inc() {
    static_assert(Regs >= 24 && Regs <= 256 && Regs % 8 == 0, "setmaxnreg: 24 ... 256, a multiple of 8");
    ::emu::setmaxnreg(Regs, true);
}
template <uint32_t Regs>
inline void setmaxnreg_dec() {
    static_assert(Regs >= 24 && Regs <= 256 && Regs % 8 == 0, "setmaxnreg: 24 ... 256, a multiple of 8");
    ::emu::setmaxnreg(Regs, false);
}

// fence.proxy.async twin: this thread's earlier generic stores become visible to async-proxy
// readers (see emu::proxy_fenced).
inline void fence_proxy_async() { ++::emu::current->proxy_gen; }

// ---- bulk tensor copy (TMA) twins ----
//
// The map is the emulator's encoding (src/kernels/tensor_map.rs, TensorMapSpec::encode_emulated):
// word 0 the magic 0x5241544D in bits 0-31, the data type (CUtensorMapDataType) in 32-39,
// the rank in 40-43, the swizzle (CUtensorMapSwizzle: 0 none, 1 32B, 2 64B, 3 128B) in
// 44-47, the out-of-bounds fill (0 zeros, 1 NaN) in 48-51; word 1 the global address; words
// 2-6 the dims (elements); words 7-10 the byte strides of dims 1-4; word 11 the box dims,
// 12 bits each. A load poisons its destination and marks it in flight at issue; it lands (the
// copy, then complete-tx of the box's bytes on the mbarrier) at the end of a scheduler round
// (later under the random schedule), so reading the destination without waiting on the
// mbarrier is reported (shared loads and async-proxy reads of words in flight), and so is a
// load landing on words stored with ordinary stores that their writer has not fenced. A
// store reads its shared source at issue (async proxy: checked like a wgmma operand) and
// writes the tensor then, clipping elements outside it; a write to the source before
// tma_store_wait_read retires it is reported.
namespace emu {
struct TensorMapView {
    uint32_t dtype, rank, swizzle, oob, elem;
    uint64_t address;
    uint64_t dims[5], strides[5];  // strides in bytes, strides[0] = elem
    uint32_t box[5];
    uint64_t box_bytes;
};

inline bool tensor_map_view(const TensorMap* map, TensorMapView& v, const char* what) {
    const uint64_t w0 = map->words[0];
    if (uint32_t(w0) != 0x5241544Du) {
        fail(std::string(what) + ": the tensor map was not encoded for the emulator "
                                 "(TensorMapSpec::encode_emulated)");
        return false;
    }
    v.dtype = uint32_t(w0 >> 32) & 0xFF;
    v.rank = uint32_t(w0 >> 40) & 0xF;
    v.swizzle = uint32_t(w0 >> 44) & 0xF;
    v.oob = uint32_t(w0 >> 48) & 0xF;
    v.elem = v.dtype == 7 ? 4 : 2;  // FLOAT32, else BFLOAT16 (9) / FLOAT16 (6)
    v.address = map->words[1];
    v.box_bytes = v.elem;
    for (uint32_t d = 0; d < 5; ++d) {
        v.dims[d] = d < v.rank ? map->words[2 + d] : 1;
        v.strides[d] = d == 0 ? v.elem : d < v.rank ? map->words[6 + d] : 0;
        v.box[d] = d < v.rank ? uint32_t(map->words[11] >> (12 * d)) & 0xFFF : 1;
        v.box_bytes *= v.box[d];
    }
    return true;
}

// The shared offset where byte `dense` of a box starting at shared offset `dst` lands: the
// 16-byte chunk bits [4, 4 + b) XOR-ed with the absolute address bits [7, 7 + b), b = 3, 2, 1
// for 128B, 64B, 32B (hopper-ptx.md §4.3).
inline uint32_t tma_swizzled(uint32_t dst, uint64_t dense, uint32_t swizzle) {
    const uint32_t a = dst + uint32_t(dense);
    const uint32_t mask = swizzle == 3 ? 7u : swizzle == 2 ? 3u : swizzle == 1 ? 1u : 0u;
    return a ^ (((a >> 7) & mask) << 4);
}

// Visits the box's elements: f(dense byte offset, global element address or null when outside
// the tensor).
template <typename F>
inline void tma_box_for_each(const TensorMapView& v, const int32_t* c, F f) {
    uint64_t dense = 0;
    for (uint32_t i4 = 0; i4 < v.box[4]; ++i4)
        for (uint32_t i3 = 0; i3 < v.box[3]; ++i3)
            for (uint32_t i2 = 0; i2 < v.box[2]; ++i2)
                for (uint32_t i1 = 0; i1 < v.box[1]; ++i1)
                    for (uint32_t i0 = 0; i0 < v.box[0]; ++i0, dense += v.elem) {
                        const uint32_t idx[5] = {i0, i1, i2, i3, i4};
                        bool inside = true;
                        uint64_t addr = v.address;
                        for (uint32_t d = 0; d < 5; ++d) {
                            const int64_t g = int64_t(d < v.rank ? c[d] : 0) + idx[d];
                            inside = inside && g >= 0 && uint64_t(g) < v.dims[d];
                            addr += uint64_t(g) * v.strides[d];
                        }
                        f(dense, inside ? reinterpret_cast<unsigned char*>(addr) : nullptr);
                    }
}

inline bool tma_shared_box(const void* smem, const TensorMapView& v, const char* what) {
    if (smem_offset_of(smem) % 128 != 0) {
        fail(std::string(what) + ": shared address " + std::to_string(smem_offset_of(smem)) +
             " is not 128-byte aligned");
        return false;
    }
    if (v.swizzle != 0) {
        const uint32_t repeat = 256u << (v.swizzle - 1);
        if (smem_offset_of(smem) % repeat != 0) {
            fail(std::string(what) + ": a swizzled box at shared offset " + std::to_string(smem_offset_of(smem)) +
                 " is not aligned to its " + std::to_string(repeat) +
                 "-byte swizzle repeat (wgmma descriptors and the kernels' addressing assume it)");
            return false;
        }
    }
    return check_shared(smem, size_t(v.box_bytes), what);
}

// The operands of an n-d copy: the map decoded into `v`, its rank n, the shared box placed
// as tma_shared_box requires; false (reported) otherwise.
inline bool tma_operands(const TensorMap* map, const void* smem, uint32_t n, const char* what, TensorMapView& v) {
    if (!tensor_map_view(map, v, what)) return false;
    if (v.rank != n) {
        fail(std::string(what) + ": a " + std::to_string(n) + "-d copy with a tensor map of rank " +
             std::to_string(v.rank));
        return false;
    }
    return tma_shared_box(smem, v, what);
}

inline void tma_load(void* dst, const TensorMap* map, uint64_t* bar, const int32_t* c, uint32_t n) {
    const char* what = "cp.async.bulk.tensor (load)";
    TensorMapView v;
    if (!tma_operands(map, dst, n, what, v)) return;
    MbarState st;
    if (!mbar_load(bar, what, st)) return;
    Block* b = current->block;
    const uint32_t off = smem_offset_of(dst);
    for (uint64_t w = off / 4; w < (off + v.box_bytes) / 4; ++w) {
        if (!proxy_fenced(4 * w, what, "lands on")) return;
    }
    std::memset(dst, 0xFF, size_t(v.box_bytes));
    for (uint64_t w = off / 4; w < (off + v.box_bytes) / 4; ++w) ++b->proxy[w].bulk_pending;
    ++b->async_copies;
    std::array<int32_t, 5> coords{};
    for (uint32_t d = 0; d < n; ++d) coords[d] = c[d];
    b->bulk_loads.push_back(BulkLoad{current->linear, [v, coords, off, bar, what] {
        Block* blk = current->block;
        unsigned char* base = blk->smem.data() + blk->smem_offset;
        for (uint64_t w = off / 4; w < (off + v.box_bytes) / 4; ++w) --blk->proxy[w].bulk_pending;
        tma_box_for_each(v, coords.data(), [&](uint64_t dense, const unsigned char* src) {
            unsigned char* to = base + tma_swizzled(off, dense, v.swizzle);
            if (src == nullptr) {
                if (v.oob == 1) {
                    const uint32_t nan32 = 0x7FC00000u;
                    const uint16_t nan16 = v.dtype == 9 ? 0x7FC0 : 0x7E00;
                    v.elem == 4 ? std::memcpy(to, &nan32, 4) : std::memcpy(to, &nan16, 2);
                } else {
                    std::memset(to, 0, v.elem);
                }
            } else if (check_global(src, v.elem, what)) {
                std::memcpy(to, src, v.elem);
            }
        });
        mbar_complete_tx(bar, uint32_t(v.box_bytes), what);
    }});
}

inline void tma_store(const TensorMap* map, const void* src, const int32_t* c, uint32_t n) {
    const char* what = "cp.async.bulk.tensor (store)";
    TensorMapView v;
    if (!tma_operands(map, src, n, what, v)) return;
    for (uint32_t d = 0; d < n; ++d) {
        if (c[d] < 0) {
            fail(std::string(what) + ": negative start coordinate " + std::to_string(c[d]) + " in dim " +
                 std::to_string(d) + " (stores need non-negative coordinates)");
            return;
        }
    }
    const uint32_t off = smem_offset_of(src);
    for (uint64_t w = off / 4; w < (off + v.box_bytes) / 4; ++w) {
        if (!proxy_fenced(4 * w, what)) return;
    }
    const unsigned char* base = current->block->smem.data() + current->block->smem_offset;
    tma_box_for_each(v, c, [&](uint64_t dense, unsigned char* dst) {
        if (dst != nullptr && check_global(dst, v.elem, what, true)) {
            std::memcpy(dst, base + tma_swizzled(off, dense, v.swizzle), v.elem);
        }
    });
    current->bulk_uncommitted.push_back(
        BulkStoreSource{off, std::vector<unsigned char>(base + off, base + off + v.box_bytes)});
}
}  // namespace emu

inline void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1) {
    const int32_t c[2] = {c0, c1};
    ::emu::tma_load(dst, map, bar, c, 2);
}
inline void tma_load_3d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1, int32_t c2) {
    const int32_t c[3] = {c0, c1, c2};
    ::emu::tma_load(dst, map, bar, c, 3);
}
inline void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int32_t c0, int32_t c1, int32_t c2,
                        int32_t c3) {
    const int32_t c[4] = {c0, c1, c2, c3};
    ::emu::tma_load(dst, map, bar, c, 4);
}
inline void tma_store_2d(const TensorMap* map, const void* src, int32_t c0, int32_t c1) {
    const int32_t c[2] = {c0, c1};
    ::emu::tma_store(map, src, c, 2);
}
inline void tma_store_3d(const TensorMap* map, const void* src, int32_t c0, int32_t c1, int32_t c2) {
    const int32_t c[3] = {c0, c1, c2};
    ::emu::tma_store(map, src, c, 3);
}
inline void tma_store_4d(const TensorMap* map, const void* src, int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
    const int32_t c[4] = {c0, c1, c2, c3};
    ::emu::tma_store(map, src, c, 4);
}
inline void tma_store_commit() {
    ::emu::Thread* t = ::emu::current;
    t->bulk_groups.push_back(std::move(t->bulk_uncommitted));
    t->bulk_uncommitted.clear();
}
template <int Pending>
inline void tma_store_wait_read() {
    ::emu::Thread* t = ::emu::current;
    const unsigned char* base = t->block->smem.data() + t->block->smem_offset;
    while (t->bulk_groups.size() > size_t(Pending)) {
        for (const ::emu::BulkStoreSource& src : t->bulk_groups.front()) {
            if (std::memcmp(base + src.offset, src.bytes.data(), src.bytes.size()) != 0) {
                ::emu::fail("shared memory at offset " + std::to_string(src.offset) +
                            " read by a bulk tensor store was overwritten before cp.async.bulk.wait_group.read "
                            "retired it");
            }
        }
        t->bulk_groups.erase(t->bulk_groups.begin());
    }
}
inline void tma_prefetch_map(const TensorMap*) {}

// ex2.approx twin: the correctly rounded 2^x (within the instruction's 2 ulp), -inf -> +0,
// subnormal results flushed to zero as .ftz does.
inline float ex2_approx(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// rcp.approx.ftz twin: the correctly rounded 1/x (within the instruction's 1 ulp), subnormal
// inputs and results flushed to zero as .ftz does.
inline float rcp_approx(float x) {
    if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
    const float y = 1.0f / x;
    return std::fpclassify(y) == FP_SUBNORMAL ? std::copysign(0.0f, y) : y;
}

inline void ldmatrix_x4(uint32_t r[4], const void* row) { ::emu::ldmatrix(r, 4, false, row); }
inline void ldmatrix_x2(uint32_t r[2], const void* row) { ::emu::ldmatrix(r, 2, false, row); }
inline void ldmatrix_x1(uint32_t& r, const void* row) { ::emu::ldmatrix(&r, 1, false, row); }
inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) { ::emu::ldmatrix(r, 4, true, row); }
inline void ldmatrix_x2_trans(uint32_t r[2], const void* row) { ::emu::ldmatrix(r, 2, true, row); }
inline void ldmatrix_x1_trans(uint32_t& r, const void* row) { ::emu::ldmatrix(&r, 1, true, row); }

// The emulator has stmatrix whatever the architecture a kernel targets.
inline void stmatrix_x4(void* row, const uint32_t r[4]) { ::emu::stmatrix(r, 4, false, row); }
inline void stmatrix_x2(void* row, const uint32_t r[2]) { ::emu::stmatrix(r, 2, false, row); }
inline void stmatrix_x1(void* row, uint32_t r) { ::emu::stmatrix(&r, 1, false, row); }
inline void stmatrix_x4_trans(void* row, const uint32_t r[4]) { ::emu::stmatrix(r, 4, true, row); }
inline void stmatrix_x2_trans(void* row, const uint32_t r[2]) { ::emu::stmatrix(r, 2, true, row); }
inline void stmatrix_x1_trans(void* row, uint32_t r) { ::emu::stmatrix(&r, 1, true, row); }

inline void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ::emu::mma_m16n8<16>(d, a, b, c, true);
}

inline void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ::emu::mma_m16n8<16>(d, a, b, c, false);
}

inline void mma_m16n8k8_bf16(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    ::emu::mma_m16n8<8>(d, a, &b, c, true);
}

inline void mma_m16n8k8_f16(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    ::emu::mma_m16n8<8>(d, a, &b, c, false);
}

inline uint16_t f32_to_bf16_rn(float x) { return ::emu::f32_to_bf16(x); }
inline uint16_t f32_to_f16_rn(float x) { return ::emu::f32_to_f16(x); }
inline float bf16_to_f32(uint16_t h) { return ::emu::bf16_to_float(h); }
inline float f16_to_f32(uint16_t h) { return ::emu::f16_to_float(h); }

inline uint32_t pack_bf16x2(float lo, float hi) {
    return uint32_t(::emu::f32_to_bf16(lo)) | (uint32_t(::emu::f32_to_bf16(hi)) << 16);
}
inline uint32_t pack_f16x2(float lo, float hi) {
    return uint32_t(::emu::f32_to_f16(lo)) | (uint32_t(::emu::f32_to_f16(hi)) << 16);
}
inline float bf16_lo(uint32_t x) { return ::emu::bf16_to_float(uint16_t(x & 0xffffu)); }
inline float bf16_hi(uint32_t x) { return ::emu::bf16_to_float(uint16_t(x >> 16)); }
inline float f16_lo(uint32_t x) { return ::emu::f16_to_float(uint16_t(x & 0xffffu)); }
inline float f16_hi(uint32_t x) { return ::emu::f16_to_float(uint16_t(x >> 16)); }

// movmatrix.trans twin: the warp publishes its registers; lane L takes, for half h, the
// element at row 2(L%4) + h, column L/4 of the source (held by lane 4 row + col/2).
inline uint32_t movmatrix_trans(uint32_t a) {
    const auto all = ::emu::warp_allgather(a);
    const unsigned lane = ::emu::lane_id();
    uint32_t out = 0;
    for (unsigned h = 0; h < 2; ++h) {
        const unsigned row = 2 * (lane % 4) + h, col = lane / 4;
        const uint32_t src = uint32_t(all[4 * row + col / 2]);
        const uint32_t half = (col % 2) ? src >> 16 : src & 0xffffu;
        out |= half << (16 * h);
    }
    return out;
}

#endif
