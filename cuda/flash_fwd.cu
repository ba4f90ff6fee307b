// Flash attention forward on tensor cores (FlashAttention-2 style). For query rows i and
// visible key rows j: s_ij = scale q_i.k_j, lse_i = log sum_j exp(s_ij),
// o_i = sum_j exp(s_ij - lse_i) v_j.
//
// A block owns kBlockM = 64 query rows of one (batch, query head); each of its 4 warps owns
// 16 rows. K/V tiles of kBlockN keys are double-buffered in shared memory by cp.async (the
// next tile loads while this one computes). Per tile, each warp: evaluates the mask on
// global positions for its 16 x kBlockN scores (a warp whose scores are all masked skips
// the tile); S = Q K^T with mma.sync m16n8k16 on ldmatrix fragments; the online softmax on
// the accumulator fragments (base 2, scale·log2 e folded in, row max by quad shuffles, row
// sums kept per thread and reduced once at the end); P, rounded to the input type, reused
// from registers as the A operand of O += P V, with V fragments by ldmatrix.trans. GQA: the
// query head h reads key/value head h / (h_q / h_kv). Output: f32 o and lse (unrounded, so
// ring hops merge in f32), or o rounded to the input type into o16 when it is set; rows
// with no visible key get o = 0, lse = -inf.
//
// Entry points ringattn_flash_fwd_{bf16,f16}_d{32,64,96,128,192,256}: the head-dim class
// is the head dim rounded up (src/kernels.rs `geometry::forward` picks it, with the launch:
// grid (ceil(s_q / 64), h_q, b), 128 threads, FwdTraits<D>::kSmem bytes).
//
// Note: as in FlashAttention, a masked key whose value row holds NaN or Inf inside a tile
// that is partly visible to a warp reaches P V as 0 * NaN; the CPU path isolates such
// values, these kernels do not.
#include "flash.cuh"

template <typename T, int D>
__device__ void flash_fwd_tc(const FlashFwdParams& p) {
    using Tr = FwdTraits<D>;
    constexpr int kN = Tr::kBlockN, kNT = kN / 8, kDT = D / 8;
    // Q fragments in registers need the loop unrolled; otherwise keep it rolled (live ranges).
    constexpr int kUnrollK = Tr::kQInRegs ? D / 16 : 1;
    const int64_t d = p.d;
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.h_q / p.h_kv);
    const int64_t q0 = int64_t(blockIdx.x) * Tr::kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem + Tr::kSmemQ);  // [2][kN][kStride]
    uint16_t* vs = ks + 2 * kN * Tr::kStride;                        // [2][kN][kStride]

    // This thread's two query rows (g and g + 8 of the warp's 16): positions and documents.
    const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    int64_t qpos[2];
    uint32_t qdoc[2];
    row_positions(p.mask.q_pos, p.mask.q_doc, row, p.s_q, qpos, qdoc);

    // No window and no documents: every existing pair is visible, no position is read.
    const bool unmasked = p.mask.window_left < 0 && p.mask.window_right < 0 && p.mask.q_doc == nullptr;

    // Masked calls classify each tile from the keys' granule bounds (flash.cuh RowBounds):
    // fully visible to the warp (run unmasked), fully masked (skipped), or mixed (the mask
    // evaluated per score). The warp's query bounds, once (rows past s_q repeat the last
    // row's: the bounds stay a superset, and a fully visible tile needs every row in range).
    const bool classify = !unmasked && p.mask.k_bounds != nullptr;
    const RowBounds warp_rows = classify ? warp_row_bounds(qpos, qdoc) : RowBounds{0, 0, 0u, 0u};

    // Loop bounds (masked calls): from the first to the last tile any warp of the block may
    // see — tiles outside are neither loaded nor waited on (a causal block stops at its
    // diagonal, a window starts at its left edge). The K buffer (not staged yet) is scratch.
    const int64_t ntiles = (p.s_k + kN - 1) / kN;
    int64_t t_begin = 0, t_end = ntiles;
    if (classify && ntiles > 0) {
        block_tile_range<Tr::kWarps, Tr::kThreads, kN>(p.mask, warp_rows, p.s_k, ntiles,
                                                       reinterpret_cast<int64_t*>(ks), t_begin, t_end);
    }

    stage_swizzled<Tr::kBlockM, Tr::kChunks, Tr::kStride, Tr::kSwizzle, Tr::kThreads>(qs, p.q, bi, p.s_q, p.h_q, hq, d,
                                                                                      q0);
    cp_async_commit();
    auto stage_kv = [&](int buf, int64_t k0) {
        stage_swizzled<kN, Tr::kChunks, Tr::kStride, Tr::kSwizzle, Tr::kThreads>(ks + buf * kN * Tr::kStride, p.k, bi,
                                                                                p.s_k, p.h_kv, hk, d, k0);
        stage_swizzled<kN, Tr::kChunks, Tr::kStride, Tr::kSwizzle, Tr::kThreads>(vs + buf * kN * Tr::kStride, p.v, bi,
                                                                                p.s_k, p.h_kv, hk, d, k0);
    };
    if (t_begin < t_end) stage_kv(0, t_begin * kN);
    cp_async_commit();

    float acc[kDT][4];
    RINGATTN_UNROLL
    for (int n = 0; n < kDT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t qf[Tr::kQInRegs ? D / 16 : 1][4];

    if (Tr::kQInRegs && t_begin < t_end) {
        // Q fragments into registers once, before the loop: Q (the first group) has landed.
        cp_async_wait<1>();
        __syncthreads();
        RINGATTN_UNROLL
        for (int kk = 0; kk < D / 16; ++kk) {
            ldmatrix_x4(qf[Tr::kQInRegs ? kk : 0],
                        qs + swz<Tr::kStride, Tr::kSwizzle>(warp * 16 + lane % 16, 2 * kk + lane / 16));
        }
    }

    int buf = 0;
    for (int64_t tile = t_begin; tile < t_end; ++tile, buf ^= 1) {
        if (tile + 1 < t_end) stage_kv(buf ^ 1, (tile + 1) * kN);
        cp_async_commit();
        cp_async_wait<1>();  // Q and this tile have landed; the next one may still be in flight
        __syncthreads();
        const uint16_t* kt = ks + buf * kN * Tr::kStride;
        const uint16_t* vt = vs + buf * kN * Tr::kStride;
        // Visibility of this thread's scores: bit 4n + e for n-tile n, element e (rows g, g,
        // g + 8, g + 8; columns 2t, 2t + 1). A tile fully visible to the warp (every row of the
        // warp and every key of the tile inside the call; no mask, or the bounds say so) runs
        // without evaluating the mask or selecting scores (kFull); a fully masked one is
        // skipped.
        const int64_t k0 = tile * kN;
        const bool row_ok[2] = {row[0] < p.s_q, row[1] < p.s_q};
        // Warp-uniform (the MMAs below are warp-wide): the warp's 16 rows, the tile's keys.
        const bool in_range = q0 + warp * 16 + 16 <= p.s_q && k0 + kN <= p.s_k;
        const TileClass cls =
            classify ? classify_tile<kN>(p.mask, warp_rows, tile, p.s_k) : TileClass{unmasked, false};
        uint32_t vis = 0;
        auto run_tile = [&](auto full_tile) {
            constexpr bool kFull = decltype(full_tile)::value;
            float s[kNT][4];
            RINGATTN_UNROLL
            for (int n = 0; n < kNT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            RINGATTN_UNROLL_BY(kUnrollK)
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4];
                if (Tr::kQInRegs) {
                    a[0] = qf[Tr::kQInRegs ? kk : 0][0], a[1] = qf[Tr::kQInRegs ? kk : 0][1];
                    a[2] = qf[Tr::kQInRegs ? kk : 0][2], a[3] = qf[Tr::kQInRegs ? kk : 0][3];
                } else {
                    ldmatrix_x4(a, qs + swz<Tr::kStride, Tr::kSwizzle>(warp * 16 + lane % 16, 2 * kk + lane / 16));
                }
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; n += 2) {
                    uint32_t b[4];  // K rows n*8 .. n*8 + 15, k chunks 2kk, 2kk + 1
                    ldmatrix_x4(b, kt + swz<Tr::kStride, Tr::kSwizzle>(n * 8 + (lane / 16) * 8 + lane % 8,
                                                                       2 * kk + (lane / 8) % 2));
                    mma_16816<T>(s[n], a, b);
                    mma_16816<T>(s[n + 1], a, b + 2);
                }
            }
            // Online softmax on the fragments (rows g: elements 0, 1; g + 8: elements 2, 3).
            float mt[2] = {-INFINITY, -INFINITY};
            RINGATTN_UNROLL
            for (int n = 0; n < kNT; ++n) {
                RINGATTN_UNROLL
                for (int e = 0; e < 4; ++e) {
                    s[n][e] = (kFull || (vis >> (4 * n + e) & 1u)) ? s[n][e] * p.scale_log2 : -INFINITY;
                    mt[e / 2] = fmaxf(mt[e / 2], s[n][e]);
                }
            }
            float alpha[2], base[2];
            RINGATTN_UNROLL
            for (int r = 0; r < 2; ++r) {
                mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
                mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
                const float m_new = fmaxf(m[r], mt[r]);
                base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
                alpha[r] = ex2_approx(m[r] - base[r]);         // -inf - x gives 0
                m[r] = m_new;
                l[r] *= alpha[r];
            }
            RINGATTN_UNROLL
            for (int n = 0; n < kNT; ++n) {
                RINGATTN_UNROLL
                for (int e = 0; e < 4; ++e) {
                    s[n][e] = ex2_approx(s[n][e] - base[e / 2]);
                    l[e / 2] += s[n][e];
                }
            }
            RINGATTN_UNROLL
            for (int n = 0; n < kDT; ++n) {
                acc[n][0] *= alpha[0], acc[n][1] *= alpha[0], acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
            }
            // O += P V: P from registers (two S n-tiles make one A operand of 16 keys).
            RINGATTN_UNROLL
            for (int kk = 0; kk < kN / 16; ++kk) {
                const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                       pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                RINGATTN_UNROLL
                for (int n = 0; n < kDT; n += 2) {
                    uint32_t b[4];  // V rows kk*16 .. +15 (keys), columns n*8 .. n*8 + 15
                    ldmatrix_x4_trans(b, vt + swz<Tr::kStride, Tr::kSwizzle>(kk * 16 + (lane / 8) % 2 * 8 + lane % 8,
                                                                             n + lane / 16));
                    mma_16816<T>(acc[n], a, b);
                    mma_16816<T>(acc[n + 1], a, b + 2);
                }
            }
        };
        if (in_range && cls.full) {
            run_tile(std::true_type{});
        } else if (!cls.empty) {
            vis = query_row_visibility<kNT>(p.mask, unmasked, row_ok, qpos, qdoc, k0, p.s_k, t);
            if (__ballot_sync(0xffffffffu, vis != 0) != 0) run_tile(std::false_type{});
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    cp_async_wait<0>();

    // Epilogue: row sums across the quad, then o = acc / l and lse = ln 2 (m + log2 l).
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        if (row[r] >= p.s_q) continue;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int64_t base = ((bi * p.s_q + row[r]) * p.h_q + hq) * d;
        RINGATTN_UNROLL
        for (int n = 0; n < kDT; ++n) {
            const int64_t c = n * 8 + 2 * t;
            if (c >= d) continue;
            const float x = acc[n][2 * r] * inv, y = acc[n][2 * r + 1] * inv;
            if (p.o16 != nullptr) {
                gmem_store(reinterpret_cast<uint32_t*>(p.o16 + base + c), pack2<T>(x, y));
            } else {
                gmem_store(p.o + base + c, x);
                gmem_store(p.o + base + c + 1, y);
            }
        }
        if (t == 0) {
            gmem_store(p.lse + (bi * p.h_q + hq) * p.s_q + row[r],
                       l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY);
        }
    }
}

#define RINGATTN_FWD_ENTRY(TY, NAME, D) \
    extern "C" __global__ void __launch_bounds__(128) ringattn_flash_fwd_##NAME##_d##D(FlashFwdParams p) { \
        flash_fwd_tc<TY, D>(p); \
    }
#define RINGATTN_FWD_ENTRIES(D) RINGATTN_FWD_ENTRY(Bf16, bf16, D) RINGATTN_FWD_ENTRY(F16, f16, D)
RINGATTN_FWD_ENTRIES(32)
RINGATTN_FWD_ENTRIES(64)
RINGATTN_FWD_ENTRIES(96)
RINGATTN_FWD_ENTRIES(128)
RINGATTN_FWD_ENTRIES(192)
RINGATTN_FWD_ENTRIES(256)
