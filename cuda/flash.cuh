// Shared pieces of the flash kernels (flash_fwd.cu, flash_bwd.cu; FlashAttention-2 style on
// tensor cores): element types, tile configurations, swizzled cp.async staging, mma and
// packing helpers. Per head-dim class D (the head dim rounded up: 32, 64, 96, 128, 192,
// 256) a traits struct fixes the tiles, the shared-memory layout and the register budget,
// with static asserts. Tiles live in shared memory as 16-bit rows of 16-byte chunks whose chunk
// index is XOR-swizzled by the row (so that ldmatrix's eight row addresses hit distinct
// banks); columns past the real head dim are zero-filled by cp.async.
#pragma once
#include <type_traits>

#include "common.cuh"
#include "score.cuh"

// Element types: 16-bit storage, f32 arithmetic.
struct Bf16 {
    __device__ static float to_float(uint16_t h) { return bf16_to_f32(h); }
};
struct F16 {
    __device__ static float to_float(uint16_t h) { return f16_to_f32(h); }
};

// Two adjacent f32 values read as one 8-byte shared-memory access (LDS.64).
struct alignas(8) F32x2 {
    float x, y;
};

// 16-byte vectors for the epilogues' stores.
struct alignas(16) F32x4 {
    float x, y, z, w;
};
struct alignas(16) U32x4 {
    uint32_t x, y, z, w;
};

// Swizzled-tile geometry of head-dim class D (shared by the traits below).
template <int D>
struct TileGeom {
    static constexpr int kChunks = D / 8;
    static constexpr int kRowChunks = kChunks <= 8 ? kChunks : (kChunks + 7) / 8 * 8;
    static constexpr int kSwizzle = (kChunks < 8 ? kChunks : 8) - 1;
    static constexpr int kStride = kRowChunks * 8;
    static constexpr int kRowBytes = kStride * 2;
};

// Forward tiles of head-dim class D for Q and K and DV for V and O (DV = D but for the
// pair entry points: multi-head latent attention's (192, 128)).
template <int D, int DV = D>
struct FwdTraits : TileGeom<D> {
    static_assert(D % 32 == 0 || D == 96, "head-dim classes: 32, 64, 96, 128, 192, 256");
    using G = TileGeom<D>;
    using VG = TileGeom<DV>;  // V's tiles (and O's staged rows)
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    // 16-row m-tiles per warp: two (FlashAttention-2's 128-row blocks: each K/V fragment
    // feeds twice the MMAs) at classes 32, 64 and 128 and at the pair (192, 128), one at 96
    // and above. At 128 the two m-tiles' O and S accumulators take 192 registers, so Q is
    // read from shared memory each tile (kQInRegs) and flash_fwd.cu's ptxas options keep
    // ptxas within 255 without spilling; at (192, 128) they take 160 (O of 128 columns, S of
    // 32 keys). (A (96, 64) pair of two m-tiles spilled 24 to 84 bytes on sm_80 and sm_90a,
    // Q's fragments in registers or not: its per-chunk staging of 12-chunk rows.)
    static constexpr int kRowTiles = D <= 64 || D == 128 || (D == 192 && DV == 128) ? 2 : 1;
    static constexpr int kWarpRows = 16 * kRowTiles;
    static constexpr int kBlockM = kWarpRows * kWarps;  // query rows per block
    static constexpr int kBlockN = D <= 128 ? 64 : 32;  // keys per tile
    static constexpr bool kQInRegs = D <= 96;          // Q fragments kept in registers
    static constexpr int kSmemQ = kBlockM * G::kRowBytes;
    static constexpr int kSmemK = kBlockN * G::kRowBytes;   // one K stage
    static constexpr int kSmemV = kBlockN * VG::kRowBytes;  // one V stage
    static constexpr int kSmemTiles = kSmemQ + 2 * (kSmemK + kSmemV);  // Q, K and V double-buffered
    static constexpr int kSmemBounds = kWarps * 32;                     // each warp's query bounds (masked calls)
    static constexpr int kSmem = kSmemTiles + kSmemBounds;
    static_assert(kSmem <= 99 * 1024, "fits the 99 KiB opt-in limit of every sm_80+ GPU");
    // f32 registers per thread for the O and S accumulators (+ Q fragments when kept).
    static constexpr int kAccRegs = kRowTiles * (DV / 2 + kBlockN / 2 + (kQInRegs ? D / 4 : 0));
    static_assert(kAccRegs <= 192, "accumulators leave room for addressing within 255 registers");
    static_assert(kBlockN / 2 <= 32, "one visibility bit per S element in a 32-bit mask");
};

// Element offset of chunk c of row r in a swizzled tile.
template <int kStride, int kSwizzle>
__device__ __forceinline__ int swz(int r, int c) {
    return r * kStride + ((c ^ (r & kSwizzle)) << 3);
}

// A thread's fragment row in a swizzled tile, for chunks 2j + b with b in {0, 1} fixed per
// thread (ldmatrix's address tables): 2j + b = 2j ^ b, so the swizzled chunk is 2j ^ x with x
// = b ^ (r & kSwizzle). When a row holds a power-of-two number of chunks (every class but
// 192), r kStride has no bits where (2j ^ x) << 3 has any, so the offset of pair j is one XOR
// of a single register with the constant 16 j. At 192 (24 chunks a row, the swizzle inside
// groups of 8) the XOR touches the chunk's position in its group only: the offset is the
// swizzled base XOR 16 (j % 4), four registers whatever j, plus the group's 64 (j / 4)
// elements, an immediate of the ldmatrix address (not one address register per j).
template <int kStride, int kSwizzle>
struct SwzRow {
    static constexpr int kRowChunks = kStride / 8;
    // Chunks per row a power of two (and the swizzle inside them): offsets XOR into the row's.
    static constexpr bool kXorOnly = (kRowChunks & (kRowChunks - 1)) == 0 && kSwizzle < kRowChunks;
    // Rows of whole groups of 8 chunks, swizzled inside each group.
    static constexpr bool kGrouped = kRowChunks % 8 == 0 && kSwizzle == 7;
    static_assert(kXorOnly || kGrouped, "tile rows of a power-of-two number of chunks or of whole groups of 8");
    int base, x;  // the offset of the row's chunk b (swizzled; of the row when grouped), b ^ (r & kSwizzle)
    __device__ __forceinline__ SwzRow(int r, int b)
        : base(kXorOnly ? r * kStride + ((b ^ (r & kSwizzle)) << 3) : r * kStride), x(b ^ (r & kSwizzle)) {}
    // Element offset of chunk 2j + b of the row.
    __device__ __forceinline__ int at(int j) const {
        if constexpr (kXorOnly) {
            return base ^ (j << 4);
        } else {
            return ((base | (x << 3)) ^ ((j % 4) << 4)) + ((j / 4) << 6);
        }
    }
};

// Stages rows r0 .. r0 + rows of a [b, s, h, d] 16-bit tensor (batch bi, head hi) into the
// swizzled `tile` with cp.async; rows past s and columns past d are zero-filled.
// kInteriorPath: a second copy of the chunk loop, without per-chunk tests, for threads whose
// chunks all lie inside (interior tiles): it pays in the dk/dv kernel's query stage, not in
// the forward's (where ptxas then spends more instructions per tile).
// kRereadIndex: derive this thread's offsets from a fresh read of its index (ptx.cuh
// thread_index_reread) rather than hold them across the caller's loop — for a kernel at its
// register limit (the (192, 128) dk/dv kernel with dq spilled one such offset on sm_90a);
// elsewhere the recomputation costs instructions per tile.
template <int kRows, int kChunks, int kStride, int kSwizzle, int kThreads, bool kInteriorPath = false,
          bool kRereadIndex = false>
__device__ __forceinline__ void stage_swizzled(uint16_t* tile, const uint16_t* x, int64_t bi, int64_t s, int64_t h,
                                               int64_t hi, int64_t d, int64_t r0) {
    constexpr int kTotal = kRows * kChunks;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    // sm_100 and later: a rolled loop. ptxas there keeps the unrolled chunks' operands live
    // at once and the d128 forward (at 254 registers already) spills.
    for (int c = threadIdx.x; c < kTotal; c += kThreads) {
        const int r = c / kChunks, col = c % kChunks;
        const int64_t row = r0 + r;
        const bool in = row < s && col * 8 < d;
        const uint16_t* src = in ? x + ((bi * s + row) * h + hi) * d + col * 8 : x;
        cp_async_cg16(tile + swz<kStride, kSwizzle>(r, col), src, in ? 16u : 0u);
    }
#else
    // A fixed number of chunks per thread (the launch has kThreads threads), unrolled: no
    // loop. When a thread's chunks share their column (kThreads a multiple of kChunks), one
    // source pointer advances by a fixed number of rows per chunk: an add per chunk, not an
    // address chain, and one pointer live instead of one per chunk.
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
    const int64_t row_stride = h * d;
    const uint16_t* base = x + (bi * s * h + hi) * d;
    if constexpr (kThreads % kChunks == 0) {
        constexpr int kRowStep = kThreads / kChunks;
        const int tid = int(kRereadIndex ? thread_index_reread() : threadIdx.x);
        const int col = tid % kChunks, r_first = tid / kChunks;
        // Rows of this thread still inside the sequence (none when the column is past d).
        const int64_t left = col * 8 < d ? s - r0 - r_first : 0;
        const uint16_t* src = base + (r0 + r_first) * row_stride + col * 8;
        const int64_t step = kRowStep * row_stride;
        if (kInteriorPath && left > (kIters - 1) * kRowStep) {
            RINGATTN_UNROLL
            for (int i = 0; i < kIters; ++i) {
                const int r = r_first + i * kRowStep;
                if (kRows % kRowStep != 0 && r >= kRows) break;
                cp_async_cg16(tile + swz<kStride, kSwizzle>(r, col), src, 16u);
                src += step;
            }
            return;
        }
        RINGATTN_UNROLL
        for (int i = 0; i < kIters; ++i) {
            const int r = r_first + i * kRowStep;
            if (kRows % kRowStep != 0 && r >= kRows) break;
            const bool in = i * kRowStep < left;
            cp_async_cg16(tile + swz<kStride, kSwizzle>(r, col), in ? src : x, in ? 16u : 0u);
            src += step;
        }
    } else if constexpr (kChunks % 8 == 0 && kThreads % 8 == 0 && kSwizzle == 7) {
        // Rows of whole groups of 8 chunks whose number does not divide the threads (class
        // 192: 24): a thread takes the same chunk of every group, in rows kThreads / 8 apart.
        // The swizzle stays inside a group and repeats every 8 rows, so each chunk's source and
        // destination are the thread's first plus constants (no offset per chunk held).
        constexpr int kGroups = kChunks / 8, kRowStep = kThreads / 8;
        constexpr int kSteps = (kRows + kRowStep - 1) / kRowStep;
        static_assert(kRowStep % 8 == 0, "a thread's rows share their swizzle");
        const int c8 = int(threadIdx.x) % 8, r_first = int(threadIdx.x) / 8;
        const int64_t left = s - r0 - r_first;  // rows of this thread inside the sequence
        const uint16_t* src = base + (r0 + r_first) * row_stride + c8 * 8;
        uint16_t* dst = tile + swz<kStride, kSwizzle>(r_first, c8);
        RINGATTN_UNROLL
        for (int i = 0; i < kSteps; ++i) {
            if (kRows % kRowStep != 0 && r_first + i * kRowStep >= kRows) break;
            RINGATTN_UNROLL
            for (int g = 0; g < kGroups; ++g) {
                const bool in = i * kRowStep < left && (8 * g + c8) * 8 < d;
                cp_async_cg16(dst + i * kRowStep * kStride + 64 * g, in ? src + 64 * g : x, in ? 16u : 0u);
            }
            src += kRowStep * row_stride;
        }
    } else {
        RINGATTN_UNROLL
        for (int i = 0; i < kIters; ++i) {
            const int c = int(threadIdx.x) + i * kThreads;
            if (kTotal % kThreads != 0 && c >= kTotal) break;
            const int r = c / kChunks, col = c % kChunks;
            const int64_t row = r0 + r;
            const bool in = row < s && col * 8 < d;
            const uint16_t* src = in ? base + row * row_stride + col * 8 : x;
            cp_async_cg16(tile + swz<kStride, kSwizzle>(r, col), src, in ? 16u : 0u);
        }
    }
#endif
}

// Stages consecutive tiles of kRows rows of two [b, s, h, d] 16-bit tensors of the same shape
// (K and V) into their swizzled tiles, as stage_swizzled does for each. The thread's offset is
// computed once and advanced by a tile per call; a tile wholly inside the sequence (every tile
// but the last) issues its copies without per-chunk bounds; one offset per chunk serves both
// tensors, whose pointers stay the kernel parameters'.
template <int kRows, int kChunks, int kStride, int kSwizzle, int kThreads>
struct PairStager {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    static constexpr bool kShared = false;  // sm_100+: stage_swizzled's rolled loop, per tensor
#else
    static constexpr bool kShared = kThreads % kChunks == 0;  // a thread's chunks share their column
#endif
    static constexpr int kIters = (kRows * kChunks + kThreads - 1) / kThreads;
    static constexpr int kRowStep = kShared ? kThreads / kChunks : 1;
    const uint16_t *a, *b;
    int64_t bi, s, h, hi, d;
    int64_t r0;    // first row of the next tile
    int64_t off;   // element offset of this thread's first chunk of the next tile
    int64_t step;  // elements between a thread's chunks (kRowStep rows)

    __device__ __forceinline__ PairStager(const uint16_t* a_, const uint16_t* b_, int64_t bi_, int64_t s_, int64_t h_,
                                          int64_t hi_, int64_t d_, int64_t first_row)
        : a(a_), b(b_), bi(bi_), s(s_), h(h_), hi(hi_), d(d_), r0(first_row) {
        const int col = int(threadIdx.x) % kChunks, r_first = int(threadIdx.x) / kChunks;
        off = ((bi * s + r0 + r_first) * h + hi) * d + col * 8;
        step = kRowStep * h * d;
    }

    // The next tile (rows r0 .. r0 + kRows; rows past s and columns past d zero-filled) into
    // tile_a and tile_b; then the one after it is next.
    __device__ __forceinline__ void stage_next(uint16_t* tile_a, uint16_t* tile_b) {
        if constexpr (!kShared) {
            stage_swizzled<kRows, kChunks, kStride, kSwizzle, kThreads>(tile_a, a, bi, s, h, hi, d, r0);
            stage_swizzled<kRows, kChunks, kStride, kSwizzle, kThreads>(tile_b, b, bi, s, h, hi, d, r0);
        } else {
            const int col = int(threadIdx.x) % kChunks, r_first = int(threadIdx.x) / kChunks;
            if (r0 + kRows <= s && col * 8 < d) {
                RINGATTN_UNROLL
                for (int i = 0; i < kIters; ++i) {
                    const int r = r_first + i * kRowStep;
                    if (kRows % kRowStep != 0 && r >= kRows) break;
                    const int dst = swz<kStride, kSwizzle>(r, col);
                    cp_async_cg16(tile_a + dst, a + off + i * step, 16u);
                    cp_async_cg16(tile_b + dst, b + off + i * step, 16u);
                }
            } else {
                const int64_t left = col * 8 < d ? s - r0 - r_first : 0;  // rows of this thread inside
                RINGATTN_UNROLL
                for (int i = 0; i < kIters; ++i) {
                    const int r = r_first + i * kRowStep;
                    if (kRows % kRowStep != 0 && r >= kRows) break;
                    const bool in = i * kRowStep < left;
                    const int dst = swz<kStride, kSwizzle>(r, col);
                    cp_async_cg16(tile_a + dst, in ? a + off + i * step : a, in ? 16u : 0u);
                    cp_async_cg16(tile_b + dst, in ? b + off + i * step : b, in ? 16u : 0u);
                }
            }
            static_assert(kRows % kRowStep == 0, "a tile is a whole number of chunk steps");
            off += (kRows / kRowStep) * step;
        }
        r0 += kRows;
    }
};

// PairStager's interface for K and V of their own head dims (multi-head latent attention:
// K d_qk wide in tiles of geometry KG, V d_v wide in tiles of geometry VG — K's class's for
// the _dv entry points, V's own class's for the pair ones): stage_swizzled per tensor, tile
// by tile. The pointers, lengths and head dims are read from the problem (kernel parameters,
// in constant memory) at each tile, not held in registers across the kernel's loop.
template <int kRows, typename KG, typename VG, int kThreads>
struct SplitStager {
    const FlashProblem& x;
    int bi, hi;  // batch, key/value head (32 bits: three registers in all across the loop)
    int64_t r0;  // first row of the next tile

    __device__ __forceinline__ void stage_next(uint16_t* tile_k, uint16_t* tile_v) {
        stage_swizzled<kRows, KG::kChunks, KG::kStride, KG::kSwizzle, kThreads>(tile_k, x.k, bi, x.s_k, x.h_kv, hi,
                                                                                x.d_qk, r0);
        stage_swizzled<kRows, VG::kChunks, VG::kStride, VG::kSwizzle, kThreads>(tile_v, x.v, bi, x.s_k, x.h_kv, hi,
                                                                                x.d_v, r0);
        r0 += kRows;
    }
};

// The K/V stager of a kernel for problem x (batch bi, key/value head hk, tiles of kRows keys
// from tile `first`; K in tiles of geometry KG): PairStager when V shares K's head dim (the
// entry points without kOwnDv: d_v is not read), SplitStager when V has its own (d_v; in
// tiles of geometry VG, K's class's but at the pair entry points).
// (d_k is x.d_qk as the kernel holds it: the PairStager's copy from the problem instead moved
// ptxas's allocation of the d128 forward on sm_90a into an 8-byte spill.)
template <bool kOwnDv, int kRows, typename KG, int kThreads, typename VG = KG>
__device__ __forceinline__ auto kv_stager(const FlashProblem& x, int64_t bi, int64_t hk, int64_t d_k, int first) {
    if constexpr (kOwnDv) {
        return SplitStager<kRows, KG, VG, kThreads>{x, int(bi), int(hk), int64_t(first) * kRows};
    } else {
        static_assert(VG::kStride == KG::kStride, "V shares K's tiles");
        return PairStager<kRows, KG::kChunks, KG::kStride, KG::kSwizzle, kThreads>(x.k, x.v, bi, x.s_k, x.h_kv, hk,
                                                                                   d_k, int64_t(first) * kRows);
    }
}

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    if constexpr (std::is_same<T, Bf16>::value) {
        mma_m16n8k16_bf16(d, a, b, d);
    } else {
        mma_m16n8k16_f16(d, a, b, d);
    }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same<T, Bf16>::value) {
        return pack_bf16x2(lo, hi);
    } else {
        return pack_f16x2(lo, hi);
    }
}


#ifndef DQ_BLOCK_N
#define DQ_BLOCK_N(D) ((D) <= 64 ? 64 : (D) <= 128 ? 32 : 16)
#endif
#ifndef DKDV_BLOCK_M
#define DKDV_BLOCK_M(D) ((D) <= 64 ? 64 : (D) <= 128 ? 32 : 16)
#endif

// Backward dq kernel (deterministic backward from head-dim class 192): like the forward, 4
// warps of 16 query rows; Q and dO tiles stay, K/V tiles of kBlockN keys stream through
// kStages buffers (two when they fit in 99 KiB). Q and K in tiles of class D, dO and V of
// class DV (D but at the pair entry points: MLA's (192, 128), whose tiles hold 32 keys).
template <int D, int DV = D>
struct DqTraits : TileGeom<D> {
    using G = TileGeom<D>;
    using VG = TileGeom<DV>;  // dO's and V's tiles
    static constexpr int kWarps = 4, kThreads = 128, kBlockM = 64;
    static constexpr int kBlockN = DV < D ? 32 : DQ_BLOCK_N(D);
    static constexpr int kSmemQ = kBlockM * G::kRowBytes;    // Q
    static constexpr int kSmemDo = kBlockM * VG::kRowBytes;  // dO
    static constexpr int kSmemK = kBlockN * G::kRowBytes;    // one K stage
    static constexpr int kSmemV = kBlockN * VG::kRowBytes;   // one V stage
    static constexpr int kSmemBounds = kWarps * 32;          // each warp's query bounds (masked calls)
    static constexpr int kStages = kSmemQ + kSmemDo + 2 * (kSmemK + kSmemV) + kSmemBounds <= 99 * 1024 ? 2 : 1;
    static constexpr int kSmemBoundsOffset = kSmemQ + kSmemDo + kStages * (kSmemK + kSmemV);
    static constexpr int kSmem = kSmemBoundsOffset + kSmemBounds;
    static_assert(kSmem <= 99 * 1024, "fits the 99 KiB opt-in limit of every sm_80+ GPU");
    static_assert(D / 2 + kBlockN <= 160, "dq, S and dP accumulators within the register budget");
};

// What the dk/dv kernel does with dq (cuda/flash_bwd.cu).
enum class DqAccum {
    // Nothing: the dq kernel computes it (the deterministic backward from head-dim class 192).
    kNone,
    // Adds its block's dS K in 32-bit fixed point with integer atomics: each term in its row's
    // power-of-two unit (exact), rounded to an integer and added with an integer atomic.
    // Integer addition is associative, so dq is bit-identical whatever the order of the blocks
    // (the deterministic backward up to class 128: five products).
    kFixed,
    // Adds it with f32 atomics: the order of the additions, hence dq's last bits, varies run
    // to run (DqMode::Atomic).
    kF32,
};

// Backward dk/dv kernel: 4 warps of 16 key rows (K and V tiles stay); query tiles of
// kBlockM rows (Q, dO, lse, scale delta, and with dq the rows' fixed-point units) stream
// through kStages buffers. With dq (kFixed, kF32) it also adds dS K into dq — the whole
// block's 64 keys per product, after the dk/dv products, dS^T through shared memory: one
// atomic add per dq element per key block — computing S and dP once per pair (five
// products) up to d = 128. Head dims above 128 are split in kSplits column ranges of
// kDOut columns (one block per range, S and dP computed in each; the first adds dq), so that
// the accumulators fit in registers. At 128 with dq the kernel runs unsplit at 254-255
// registers without spilling on sm_80 ... sm_120 (an earlier version spilled 4 to 32 bytes
// there, the query stage's hoisted addresses, and split the columns).
template <int D, DqAccum kAccum = DqAccum::kNone, int DV = D>
struct DkDvTraits : TileGeom<D> {
    using G = TileGeom<D>;
    using VG = TileGeom<DV>;  // V's and dO's tiles (D's but at the pair entry points: (192, 128))
    static constexpr bool kWithDq = kAccum != DqAccum::kNone;
    static constexpr int kWarps = 4, kThreads = 128, kBlockN = 64;
    static constexpr int kBlockM = DKDV_BLOCK_M(D);
    // The pairs run unsplit: dk of D columns and dv of DV (96 + 64 registers at (192, 128)).
    static constexpr int kSplits = D > 128 && DV == D ? 2 : 1;
    static constexpr int kDOut = D / kSplits;    // dk's columns per block
    static constexpr int kDvOut = DV / kSplits;  // dv's
    static constexpr int kSmemK = kBlockN * G::kRowBytes;   // K
    static constexpr int kSmemV = kBlockN * VG::kRowBytes;  // V
    // Q, dO, then f32 per query row: lse, scale delta (and the unit with dq).
    static constexpr int kRowScalars = kWithDq ? 3 : 2;
    static constexpr int kSmemStageQ = kBlockM * G::kRowBytes;  // Q's part of a stage (dO follows)
    static constexpr int kSmemStage = kBlockM * (G::kRowBytes + VG::kRowBytes) + kRowScalars * kBlockM * 4;
    // With dq: the block's dS^T (its 64 keys x the query tile, 16-bit, key-major) for the
    // block-level dq product, rows padded by 8 elements (ldmatrix.trans rows on distinct
    // banks); then one int per warp: whether it ran the tile.
    static constexpr int kDsStride = kBlockM + 8;
    static constexpr int kSmemDs = kWithDq ? kBlockN * kDsStride * 2 + kWarps * 4 : 0;
    static constexpr int kStages = kSmemK + kSmemV + 2 * kSmemStage + kSmemDs <= 99 * 1024 ? 2 : 1;
    static constexpr int kSmem = kSmemK + kSmemV + kStages * kSmemStage + kSmemDs;
    static_assert(kSmem <= 99 * 1024, "fits the 99 KiB opt-in limit of every sm_80+ GPU");
    static_assert(kDOut % 16 == 0 && kDvOut % 16 == 0, "column ranges in whole n-tile pairs");
    static_assert((kDOut + kDvOut) / 2 + kBlockM <= (DV == D ? 160 : 176),
                  "dk, dv, S and dP accumulators within the register budget");
};

// Epilogues go through shared memory (coalesced 16-byte stores) except on sm_100 and later,
// where ptxas then spills the d64 forward (8 to 28 bytes): there each thread stores its
// fragments directly (8- and 4-byte stores). The emulator runs the staged epilogue.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define RINGATTN_STAGED_EPILOGUE 0
#else
#define RINGATTN_STAGED_EPILOGUE 1
#endif

// Epilogue staging: a warp's output rows as f32 in shared memory, kStageStride floats apart
// (16-byte aligned rows; the 4 floats of padding spread the fragment stores over the banks).
template <int D>
struct StageStride {
    static constexpr int value = D + 4;
};

// Stages the accumulator fragments of a warp's kMT m-tiles (acc[mt][n][e]: row 16 mt + g +
// 8 (e / 2), column 8 n + 2 t + e % 2, times `row_scale[2 mt + e / 2]`) into `stage`.
template <int kMT, int kNT, int kStageStride>
__device__ __forceinline__ void stage_fragments(float* stage, const float (&acc)[kMT][kNT][4],
                                                const float (&row_scale)[2 * kMT]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    RINGATTN_UNROLL
    for (int r = 0; r < 2 * kMT; ++r) {
        const int mt = r / 2, e0 = 2 * (r % 2), local = 16 * mt + g + 8 * (r % 2);
        RINGATTN_UNROLL
        for (int n = 0; n < kNT; ++n) {
            smem_store(reinterpret_cast<F32x2*>(stage + local * kStageStride + n * 8 + 2 * t),
                       F32x2{acc[mt][n][e0] * row_scale[r], acc[mt][n][e0 + 1] * row_scale[r]});
        }
    }
}

// Writes a warp's kRows staged rows (`stage_fragments`) to global memory, coalesced: f32 rows
// into `out32`, or rows rounded to T into `out16` when it is set, by 16-byte stores (each lane
// a chunk of 4 f32 or 8 16-bit values; d is a multiple of 8, so chunks never straddle it).
// `row_offset(r)` is the element offset of the warp's row r in the output, or -1 for a row
// outside the call; columns past d are not written. A buffer that is not 16-byte aligned (an
// offset view) is written element by element.
template <typename T, int kRows, int D, int kStageStride, typename RowOffset>
__device__ __forceinline__ void store_staged_rows(const float* stage, int64_t d, RowOffset row_offset, float* out32,
                                                  uint16_t* out16) {
    const int lane = threadIdx.x % 32;
    // store(src, at): the chunk of kPer values staged at `src` to output element `at`.
    auto each_chunk = [&](auto per, auto&& store) {
        constexpr int kPer = decltype(per)::value, kChunks = D / kPer;
        for (int i = lane; i < kRows * kChunks; i += 32) {
            const int r = i / kChunks, c = (i % kChunks) * kPer;
            const int64_t off = row_offset(r);
            if (off >= 0 && c < d) store(stage + r * kStageStride + c, off + c);
        }
    };
    if (out16 != nullptr) {
        const bool vec = reinterpret_cast<uintptr_t>(out16) % 16 == 0;
        each_chunk(std::integral_constant<int, 8>{}, [&](const float* src, int64_t at) {
            const F32x4 a = smem_load(reinterpret_cast<const F32x4*>(src));
            const F32x4 b = smem_load(reinterpret_cast<const F32x4*>(src + 4));
            const uint32_t w[4] = {pack2<T>(a.x, a.y), pack2<T>(a.z, a.w), pack2<T>(b.x, b.y), pack2<T>(b.z, b.w)};
            if (vec) {
                gmem_store(reinterpret_cast<U32x4*>(out16 + at), U32x4{w[0], w[1], w[2], w[3]});
            } else {
                for (int k = 0; k < 8; ++k) gmem_store(out16 + at + k, uint16_t(w[k / 2] >> (16 * (k % 2))));
            }
        });
    } else {
        const bool vec = reinterpret_cast<uintptr_t>(out32) % 16 == 0;
        each_chunk(std::integral_constant<int, 4>{}, [&](const float* src, int64_t at) {
            const F32x4 a = smem_load(reinterpret_cast<const F32x4*>(src));
            if (vec) {
                gmem_store(reinterpret_cast<F32x4*>(out32 + at), a);
            } else {
                const float v[4] = {a.x, a.y, a.z, a.w};
                for (int k = 0; k < 4; ++k) gmem_store(out32 + at + k, v[k]);
            }
        });
    }
}

// The global positions and documents (0 without) of a thread's kR rows `row` of one side
// (MaskParams' q_pos/q_doc or k_pos/k_doc, `doc` null without documents); rows past `s`
// read the last row's, so that bounds over them stay supersets.
template <int kR>
__device__ __forceinline__ void row_positions(const int64_t* pos, const uint32_t* doc, const int64_t (&row)[kR],
                                              int64_t s, int64_t (&out_pos)[kR], uint32_t (&out_doc)[kR]) {
    RINGATTN_UNROLL
    for (int r = 0; r < kR; ++r) {
        const int64_t i = row[r] < s ? row[r] : s - 1;
        out_pos[r] = gmem_load(pos + i);
        out_doc[r] = doc != nullptr ? gmem_load(doc + i) : 0u;
    }
}

// Visibility bits of a thread's 16 x N accumulator fragments (bit 4n + 2r + c: n-tile n,
// row g + 8r of the warp's 16, column 2t + c), rows and columns given as global positions
// and documents; `row_ok`/`col_ok` mark rows and columns that exist.
struct MaskEval {
    const MaskParams& m;
    __device__ bool visible(int64_t pq, uint32_t dq, int64_t pk, uint32_t dk) const {
        return (m.window_left < 0 || pk >= pq - m.window_left) && (m.window_right < 0 || pk <= pq + m.window_right) &&
               dq == dk;
    }
};

// No window and no documents: every existing (query, key) pair is visible, no position is
// read.
__device__ __forceinline__ bool mask_is_none(const MaskParams& m) {
    return m.window_left < 0 && m.window_right < 0 && m.q_doc == nullptr;
}

// Tile classification from the keys' granule bounds (MaskParams::k_bounds): the bounds of a
// set of queries (a warp's, a block's) and of a tile's keys, and whether every pair between
// them is visible or none is. Masked calls use it to run fully visible tiles without the
// mask, skip fully masked ones, and bound their loops to the tiles they may see.
struct RowBounds {
    int64_t lo, hi;    // positions
    uint32_t dlo, dhi;  // documents (0 without)
};

__device__ __forceinline__ RowBounds merge_bounds(RowBounds a, const RowBounds& b) {
    a.lo = b.lo < a.lo ? b.lo : a.lo, a.hi = b.hi > a.hi ? b.hi : a.hi;
    a.dlo = b.dlo < a.dlo ? b.dlo : a.dlo, a.dhi = b.dhi > a.dhi ? b.dhi : a.dhi;
    return a;
}

// The bounds of a warp's rows: each thread holds kR rows' positions and documents.
template <int kR>
__device__ __forceinline__ RowBounds warp_row_bounds(const int64_t (&pos)[kR], const uint32_t (&doc)[kR]) {
    RowBounds b{pos[0], pos[0], doc[0], doc[0]};
    RINGATTN_UNROLL
    for (int r = 1; r < kR; ++r) b = merge_bounds(b, RowBounds{pos[r], pos[r], doc[r], doc[r]});
    RINGATTN_UNROLL
    for (int o = 1; o < 32; o <<= 1) {
        const RowBounds other{__shfl_xor_sync(0xffffffffu, b.lo, o), __shfl_xor_sync(0xffffffffu, b.hi, o),
                              __shfl_xor_sync(0xffffffffu, b.dlo, o), __shfl_xor_sync(0xffffffffu, b.dhi, o)};
        b = merge_bounds(b, other);
    }
    return b;
}

// Bounds of tile `tile` of one side (kN rows from tile * kN, clipped to s) from that side's
// granule bounds (`pos_bounds`, and `doc_bounds` or null without documents): those of the
// one or two granules it lies in (a tile smaller than a granule gets its granule's, a
// superset: still sound for both tests below).
template <int kN>
__device__ __forceinline__ RowBounds tile_bounds(const int64_t* pos_bounds, const uint32_t* doc_bounds, int64_t tile,
                                                 int64_t s) {
    static_assert((MASK_GRANULE % kN == 0 || kN % MASK_GRANULE == 0) && kN <= 2 * MASK_GRANULE,
                  "a tile lies in one or two granules");
    const int64_t r0 = tile * kN;
    const int64_t g0 = r0 / MASK_GRANULE, g1 = ((r0 + kN < s ? r0 + kN : s) - 1) / MASK_GRANULE;
    auto granule = [&](int64_t g) {
        RowBounds b{gmem_load(pos_bounds + 2 * g), gmem_load(pos_bounds + 2 * g + 1), 0u, 0u};
        if (doc_bounds != nullptr) b.dlo = gmem_load(doc_bounds + 2 * g), b.dhi = gmem_load(doc_bounds + 2 * g + 1);
        return b;
    };
    RowBounds b = granule(g0);
    if (g1 != g0) b = merge_bounds(b, granule(g1));
    return b;
}

// Bounds of key tile `tile` (kN keys) and of query tile `tile` (kN queries).
template <int kN>
__device__ __forceinline__ RowBounds tile_key_bounds(const MaskParams& m, int64_t tile, int64_t s_k) {
    return tile_bounds<kN>(m.k_bounds, m.k_doc_bounds, tile, s_k);
}
template <int kN>
__device__ __forceinline__ RowBounds tile_query_bounds(const MaskParams& m, int64_t tile, int64_t s_q) {
    return tile_bounds<kN>(m.q_bounds, m.q_doc_bounds, tile, s_q);
}

// Whether both sides' document bounds are at hand (the host sets them with the positions'
// bounds whenever there are documents; a side without them is never proven one document).
__device__ __forceinline__ bool doc_bounds_known(const MaskParams& m) {
    return m.k_doc_bounds != nullptr && m.q_doc_bounds != nullptr;
}

// Whether every (query, key) pair between the bounds is visible under the mask.
__device__ __forceinline__ bool all_visible(const MaskParams& m, const RowBounds& q, const RowBounds& k) {
    const int64_t wl = m.window_left, wr = m.window_right;
    bool all = (wl < 0 || k.lo >= q.hi - wl) && (wr < 0 || k.hi <= q.lo + wr);
    if (m.q_doc != nullptr) all = all && doc_bounds_known(m) && q.dlo == q.dhi && k.dlo == k.dhi && q.dlo == k.dlo;
    return all;
}

// Whether no (query, key) pair between the bounds is visible under the mask.
__device__ __forceinline__ bool none_visible(const MaskParams& m, const RowBounds& q, const RowBounds& k) {
    const int64_t wl = m.window_left, wr = m.window_right;
    bool none = (wl >= 0 && k.hi < q.lo - wl) || (wr >= 0 && k.lo > q.hi + wr);
    if (m.q_doc != nullptr && doc_bounds_known(m)) none = none || k.dhi < q.dlo || k.dlo > q.dhi;
    return none;
}

// How a warp treats a tile: fully visible (run without the mask), fully masked (skip), or
// neither (both false: the mask per score).
struct TileClass {
    bool full, empty;
};

// Key tile `tile` of kN keys against a warp's query bounds (forward, dq).
template <int kN>
__device__ __forceinline__ TileClass classify_tile(const MaskParams& m, const RowBounds& rows, int64_t tile,
                                                   int64_t s_k) {
    const RowBounds keys = tile_key_bounds<kN>(m, tile, s_k);
    return TileClass{all_visible(m, rows, keys), none_visible(m, rows, keys)};
}

// Query tile `tile` of kN queries against a warp's key bounds (dk/dv).
template <int kN>
__device__ __forceinline__ TileClass classify_query_tile(const MaskParams& m, const RowBounds& keys, int64_t tile,
                                                         int64_t s_q) {
    const RowBounds queries = tile_query_bounds<kN>(m, tile, s_q);
    return TileClass{all_visible(m, queries, keys), none_visible(m, queries, keys)};
}

// Which side a block's rows are: queries with key tiles streaming (forward, dq), or keys with
// query tiles streaming (dk/dv).
enum class BlockRows { Queries, Keys };

// The range [begin, end) of the tiles (of kN rows of the other side) that any row of the
// block may see: the warps' bounds merged through `scratch` (4 * kWarps int64 of shared
// memory, free until the call returns), each thread testing every kThreads-th tile. Every
// thread of the block calls it; it synchronises the block.
template <int kWarps, int kThreads, int kN, BlockRows kRows = BlockRows::Queries>
__device__ __forceinline__ void block_tile_range(const MaskParams& m, const RowBounds& warp_rows, int64_t s_other,
                                                 int64_t ntiles, int64_t* scratch, int64_t& begin, int64_t& end) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        smem_store(scratch + 4 * warp, warp_rows.lo);
        smem_store(scratch + 4 * warp + 1, warp_rows.hi);
        smem_store(scratch + 4 * warp + 2, int64_t(warp_rows.dlo));
        smem_store(scratch + 4 * warp + 3, int64_t(warp_rows.dhi));
    }
    __syncthreads();
    RowBounds rows = warp_rows;
    for (int w = 0; w < kWarps; ++w) {
        const RowBounds other{smem_load(scratch + 4 * w), smem_load(scratch + 4 * w + 1),
                              uint32_t(smem_load(scratch + 4 * w + 2)), uint32_t(smem_load(scratch + 4 * w + 3))};
        rows = merge_bounds(rows, other);
    }
    __syncthreads();  // every thread has read the bounds
    int64_t first = ntiles, last = -1;
    for (int64_t tile = threadIdx.x; tile < ntiles; tile += kThreads) {
        const bool none = kRows == BlockRows::Queries ? none_visible(m, rows, tile_key_bounds<kN>(m, tile, s_other))
                                                      : none_visible(m, tile_query_bounds<kN>(m, tile, s_other), rows);
        if (!none) {
            first = tile < first ? tile : first;
            last = tile;
        }
    }
    RINGATTN_UNROLL
    for (int o = 1; o < 32; o <<= 1) {
        const int64_t f = __shfl_xor_sync(0xffffffffu, first, o), l = __shfl_xor_sync(0xffffffffu, last, o);
        first = f < first ? f : first, last = l > last ? l : last;
    }
    if (lane == 0) {
        smem_store(scratch + 2 * warp, first);
        smem_store(scratch + 2 * warp + 1, last);
    }
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
        const int64_t f = smem_load(scratch + 2 * w), l = smem_load(scratch + 2 * w + 1);
        first = f < first ? f : first, last = l > last ? l : last;
    }
    __syncthreads();  // the scratch is free again
    begin = first;
    end = last + 1 > first ? last + 1 : first;
}

// Visibility bits of a thread's query-row fragments against kNT n-tiles of keys k0 .., for
// kMT m-tiles of 16 rows: vis[mt] bit 4n + 2r + c is n-tile n, query row g + 8r of m-tile mt
// (the thread's row 2 mt + r), key k0 + 8n + 2t + c; for rows that exist (`row_ok`) at
// positions `qpos` in documents `qdoc`. Each key's position is read once for every row;
// without window or documents (`unmasked`) no position is read.
template <int kNT, int kMT>
__device__ __forceinline__ void query_rows_visibility(const MaskParams& m, bool unmasked, const bool (&row_ok)[2 * kMT],
                                                      const int64_t (&qpos)[2 * kMT], const uint32_t (&qdoc)[2 * kMT],
                                                      int64_t k0, int64_t s_k, int t, uint32_t (&vis)[kMT]) {
    static_assert(kNT <= 8, "4 bits per n-tile in a 32-bit mask");
    const MaskEval mask{m};
    RINGATTN_UNROLL
    for (int mt = 0; mt < kMT; ++mt) vis[mt] = 0;
    RINGATTN_UNROLL
    for (int n = 0; n < kNT; ++n) {
        RINGATTN_UNROLL
        for (int c = 0; c < 2; ++c) {
            const int64_t j = k0 + n * 8 + 2 * t + c;
            if (j >= s_k) continue;
            const int64_t pk = unmasked ? 0 : gmem_load(m.k_pos + j);
            const uint32_t kd = m.k_doc != nullptr ? gmem_load(m.k_doc + j) : 0;
            RINGATTN_UNROLL
            for (int r = 0; r < 2 * kMT; ++r) {
                const bool ok = row_ok[r] && (unmasked || mask.visible(qpos[r], qdoc[r], pk, kd));
                vis[r / 2] |= uint32_t(ok) << (4 * n + 2 * (r % 2) + c);
            }
        }
    }
}

// The same for one m-tile (a thread's two rows).
template <int kNT>
__device__ __forceinline__ uint32_t query_row_visibility(const MaskParams& m, bool unmasked, const bool (&row_ok)[2],
                                                         const int64_t (&qpos)[2], const uint32_t (&qdoc)[2],
                                                         int64_t k0, int64_t s_k, int t) {
    uint32_t vis[1];
    query_rows_visibility<kNT, 1>(m, unmasked, row_ok, qpos, qdoc, k0, s_k, t, vis);
    return vis[0];
}
