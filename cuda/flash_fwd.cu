// Flash attention forward on tensor cores (FlashAttention-2 style). For query rows i and
// visible key rows j: s_ij = scale q_i.k_j, lse_i = log sum_j exp(s_ij),
// o_i = sum_j exp(s_ij - lse_i) v_j.
//
// A block owns kBlockM query rows of one (batch, query head); each of its 4 warps owns
// kWarpRows: 32 (two 16-row m-tiles, FlashAttention-2's 128-row blocks) at head-dim classes
// 32, 64 and 128, 16 at 96 and above. K/V tiles of kBlockN keys are double-buffered in shared
// memory by cp.async (the next tile loads while this one computes). Per tile, each warp: evaluates the mask on
// global positions for its kWarpRows x kBlockN scores (a warp whose scores are all masked
// skips the tile); S = Q K^T with mma.sync m16n8k16 on ldmatrix fragments (each K fragment
// feeds every m-tile); the online softmax on the accumulator fragments (base 2, the row max
// of the raw scores by quad shuffles, scale·log2 e folded into one FFMA per score, the base
// moved lazily — only when the max passes it by more than 2^8 — row sums kept per thread
// and reduced once at the end); P, rounded to the input type, reused
// from registers as the A operand of O += P V, with V fragments by ldmatrix.trans. GQA: the
// query head h reads key/value head h / (h_q / h_kv). Output: f32 o and lse (unrounded, so
// ring hops merge in f32), or o rounded to the input type into o16 when it is set; rows
// with no visible key get o = 0, lse = -inf.
//
// Entry points ringattn_flash_fwd_{bf16,f16}_d{32,64,96,128,192,256} (and _d{96,192,256}_dv,
// _d192_v128 for V of its own head dim, below): the head-dim class is the head dim rounded up (src/kernels.rs `geometry::forward` picks it, with the launch:
// grid (ceil(s_q / kBlockM), h_q, b), 128 threads, FwdTraits<D>::kSmem bytes).
//
// Build: at class 128 the accumulators take 192 of the 255 registers; under ptxas's default
// register-usage level (5) its scheduler computes fragment addresses early and spilled on
// some architecture for every loop shape tried (8 to 108 bytes; sm_80 with this one), at
// level 3 it fits on sm_80, sm_90a, sm_100 and sm_120 (checked by the SASS gates). The line
// below is read by build.rs and scripts/sass-gates.sh:
// ptxas-options: --register-usage-level=3
//
// Note: as in FlashAttention, a masked key whose value row holds NaN or Inf inside a tile
// that is partly visible to a warp reaches P V as 0 * NaN; the CPU path isolates such
// values, these kernels do not.
#include "flash.cuh"

// kOwnDv: V and O have their own head dim p.x.d_v (multi-head latent attention; the entry
// points ..._d{D}_dv, V in tiles of class DV = D, and ..._d{D}_v{DV}, V in tiles of its own
// class DV); otherwise p.x.d_qk serves Q, K, V and O and p.x.d_v is not read.
// kCapped: the soft-capped variant (score.cuh); kPerTile: both variants behind a uniform
// branch per tile instead (kCapped then unused).
template <typename T, int D, int DV, bool kOwnDv, bool kCapped, bool kPerTile>
__device__ void flash_fwd_tc(const FlashFwdParams& p) {
    static_assert(kOwnDv || DV == D, "V of its own class only with its own head dim");
    using Tr = FwdTraits<D, DV>;
    using VG = typename Tr::VG;
    constexpr int kN = Tr::kBlockN, kNT = kN / 8, kOT = DV / 8;  // S n-tiles, O n-tiles
    constexpr int kMT = Tr::kRowTiles, kR = 2 * kMT;  // m-tiles per warp, rows per thread
    constexpr int kStride = Tr::kStride, kSwizzle = Tr::kSwizzle;
    // Unrolled up to class 128 and with two m-tiles (Q fragments in registers need it; from
    // shared memory at 128, the unrolled loop is the one ptxas schedules without spilling);
    // rolled above with one (live ranges).
    constexpr int kUnrollK = D <= 128 || kMT == 2 ? D / 16 : 1;
    const int64_t d = p.x.d_qk;
    auto d_v = [&]() -> int64_t { return kOwnDv ? p.x.d_v : d; };  // (read where used)
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.x.h_q / p.x.h_kv);
    const int64_t q0 = int64_t(blockIdx.x) * Tr::kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // The warp's first query row, recomputed where needed (not a register across the loop).
    auto first_row = [&] { return int64_t(blockIdx.x) * Tr::kBlockM + warp * Tr::kWarpRows; };
    const bool rows_in = first_row() + Tr::kWarpRows <= p.x.s_q;  // every row of the warp exists
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem + Tr::kSmemQ);  // [2][kN][kStride]
    uint16_t* vs = ks + 2 * kN * kStride;                            // [2][kN][VG::kStride]

    // This thread's query rows: g and g + 8 of each of the warp's m-tiles (row 2 mt + r is
    // first_row() + 16 mt + g + 8 r); their positions and documents (read again on masked tiles rather
    // than held in registers across the loop).
    auto thread_rows = [&](int64_t (&row)[kR]) {
        RINGATTN_UNROLL
        for (int r = 0; r < kR; ++r) row[r] = first_row() + 16 * (r / 2) + g + 8 * (r % 2);
    };

    // No window and no documents: every existing pair is visible, no position is read.
    const bool unmasked = mask_is_none(p.x.mask);

    // Masked calls classify each tile from the keys' granule bounds (flash.cuh RowBounds):
    // fully visible to the warp (run unmasked), fully masked (skipped), or mixed (the mask
    // evaluated per score). The warp's query bounds, once (rows past s_q repeat the last
    // row's: the bounds stay a superset, and a fully visible tile needs every row in range).
    // The warp's bounds wait in shared memory (registers are what the accumulators need).
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr;
    RowBounds* bounds_slot = reinterpret_cast<RowBounds*>(smem + Tr::kSmemTiles) + warp;
    RowBounds warp_rows{0, 0, 0u, 0u};
    if (classify) {
        int64_t row[kR], qpos[kR];
        uint32_t qdoc[kR];
        thread_rows(row);
        row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
        warp_rows = warp_row_bounds(qpos, qdoc);
        if (lane == 0) smem_store(bounds_slot, warp_rows);
    }

    // Loop bounds (masked calls): from the first to the last tile any warp of the block may
    // see — tiles outside are neither loaded nor waited on (a causal block stops at its
    // diagonal, a window starts at its left edge). The K buffer (not staged yet) is scratch.
    // Tile indices fit in 32 bits: s_k < 2^31 kN (2^36 keys and more hold terabytes).
    const int64_t ntiles = (p.x.s_k + kN - 1) / kN;
    int64_t range_begin = 0, range_end = ntiles;
    if (classify && ntiles > 0) {
        block_tile_range<Tr::kWarps, Tr::kThreads, kN>(p.x.mask, warp_rows, p.x.s_k, ntiles,
                                                       reinterpret_cast<int64_t*>(ks), range_begin, range_end);
    }
    const int t_begin = int(range_begin), t_end = int(range_end);

    stage_swizzled<Tr::kBlockM, Tr::kChunks, kStride, kSwizzle, Tr::kThreads>(qs, p.x.q, bi, p.x.s_q, p.x.h_q, hq, d, q0);
    cp_async_commit();
    // K/V tiles t_begin, t_begin + 1, ... in turn.
    auto stager = kv_stager<kOwnDv, kN, TileGeom<D>, Tr::kThreads, VG>(p.x, bi, hk, d, t_begin);
    auto stage_kv = [&](int buf) { stager.stage_next(ks + buf * kN * kStride, vs + buf * kN * VG::kStride); };
    if (t_begin < t_end) stage_kv(0);
    cp_async_commit();

    // The softmax scale folded into one FFMA per score: exp2(s sc - m sc) with sc >= 0. A
    // negative scale negates Q instead (exact in 16 bits: s sc = (-s)(-sc)), once per block.
    // Under a soft-cap the raw scores are capped first and sc is 1 (score.cuh).
    const bool negate_q = p.x.score.scale_log2 < 0.0f;
    const ForwardScores scores = kPerTile ? ForwardScores::any(p.x.score) : ForwardScores::of<kCapped>(p.x.score);
    const float sc = scores.sc;

    // Fragment rows (flash.cuh SwzRow; the swizzle depends on the row modulo 8, so whole
    // 8-row steps add a constant): K rows for S = Q K^T (k chunks 2kk, 2kk + 1), V rows for
    // O += P V (column chunks 2j, 2j + 1), Q rows (when read from shared memory each tile).
    const SwzRow<kStride, kSwizzle> krow((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<VG::kStride, VG::kSwizzle> vrow((lane / 8) % 2 * 8 + lane % 8, lane / 16);
    const SwzRow<kStride, kSwizzle> qrow(warp * Tr::kWarpRows + lane % 16, lane / 16);

    float acc[kMT][kOT][4];
    RINGATTN_UNROLL
    for (int mt = 0; mt < kMT; ++mt) {
        RINGATTN_UNROLL
        for (int n = 0; n < kOT; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
    }
    // Per row: the base of the exponentials (scaled, base 2; -inf until a score is visible;
    // its negation and the slack of the lazy rescaling below are derived from it per tile),
    // this thread's share of the row sum.
    float m[kR], l[kR];
    RINGATTN_UNROLL
    for (int r = 0; r < kR; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    uint32_t qf[Tr::kQInRegs ? kMT : 1][Tr::kQInRegs ? D / 16 : 1][4];

    if (t_begin < t_end) {
        // Q (the first group) has landed.
        cp_async_wait<1>();
        __syncthreads();
        if (negate_q) {
            uint32_t* q32 = reinterpret_cast<uint32_t*>(qs);
            for (int i = threadIdx.x; i < Tr::kBlockM * kStride / 2; i += Tr::kThreads) {
                smem_store(q32 + i, smem_load(q32 + i) ^ 0x80008000u);
            }
            __syncthreads();
        }
        if constexpr (Tr::kQInRegs) {
            // Q fragments into registers once, before the loop.
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) {
                RINGATTN_UNROLL
                for (int kk = 0; kk < D / 16; ++kk) {
                    ldmatrix_x4(qf[mt][kk], qs + qrow.at(kk) + 16 * mt * kStride);
                }
            }
        }
    }

    int buf = 0;
    for (int tile = t_begin; tile < t_end; ++tile, buf ^= 1) {
        if (tile + 1 < t_end) stage_kv(buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // Q and this tile have landed; the next one may still be in flight
        __syncthreads();
        const uint16_t* kt = ks + buf * kN * kStride;
        const uint16_t* vt = vs + buf * kN * VG::kStride;
        // Visibility of this thread's scores: vis[mt] bit 4n + e for n-tile n, element e (rows
        // g, g, g + 8, g + 8 of m-tile mt; columns 2t, 2t + 1). A tile fully visible to the
        // warp (every row of the warp and every key of the tile inside the call; no mask, or
        // the bounds say so) runs without evaluating the mask or selecting scores (kFull); a
        // fully masked one is skipped.
        const int64_t k0 = int64_t(tile) * kN;
        // Warp-uniform (the MMAs below are warp-wide): the warp's rows, the tile's keys.
        const bool in_range = rows_in && k0 + kN <= p.x.s_k;
        const TileClass cls =
            classify ? classify_tile<kN>(p.x.mask, smem_load(bounds_slot), tile, p.x.s_k) : TileClass{unmasked, false};
        uint32_t vis[kMT];
        // One copy of the tile's code (a second one, specialised for masked tiles, costs the
        // registers the accumulators need): `masked` branches around the mask's selects.
        auto run_tile = [&](bool masked) {
            float s[kMT][kNT][4];
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) {
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
            }
            RINGATTN_UNROLL_BY(kUnrollK)
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[kMT][4];
                RINGATTN_UNROLL
                for (int mt = 0; mt < kMT; ++mt) {
                    if constexpr (Tr::kQInRegs) {
                        a[mt][0] = qf[mt][kk][0], a[mt][1] = qf[mt][kk][1];
                        a[mt][2] = qf[mt][kk][2], a[mt][3] = qf[mt][kk][3];
                    } else {
                        ldmatrix_x4(a[mt], qs + qrow.at(kk) + 16 * mt * kStride);
                    }
                }
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; n += 2) {
                    uint32_t b[4];  // K rows n*8 .. n*8 + 15, k chunks 2kk, 2kk + 1
                    ldmatrix_x4(b, kt + krow.at(kk) + n * 8 * kStride);
                    RINGATTN_UNROLL
                    for (int mt = 0; mt < kMT; ++mt) {
                        mma_16816<T>(s[mt][n], a[mt], b);
                        mma_16816<T>(s[mt][n + 1], a[mt], b + 2);
                    }
                }
            }
            // Online softmax on the fragments (row 2 mt + r: elements 2r, 2r + 1 of m-tile
            // mt), on the raw scores: the row max commutes with the scale (sc >= 0).
            auto for_masked = [&](auto&& f) {  // f(score) for each score the mask hides
                RINGATTN_UNROLL
                for (int mt = 0; mt < kMT; ++mt) {
                    RINGATTN_UNROLL
                    for (int n = 0; n < kNT; ++n) {
                        RINGATTN_UNROLL
                        for (int e = 0; e < 4; ++e) {
                            if (!(vis[mt] >> (4 * n + e) & 1u)) f(s[mt][n][e]);
                        }
                    }
                }
            };
            // The score options before the mask (score.cuh): the soft-capped variant's.
            if (kPerTile ? scores.capped() : kCapped) {
                RINGATTN_UNROLL
                for (int mt = 0; mt < kMT; ++mt) {
                    RINGATTN_UNROLL
                    for (int n = 0; n < kNT; ++n) {
                        RINGATTN_UNROLL
                        for (int e = 0; e < 4; ++e) s[mt][n][e] = scores.template cap<kernel_tanh<D>()>(s[mt][n][e]);
                    }
                }
            }
            if (masked) for_masked([](float& x) { x = -INFINITY; });
            float mt_max[kR];
            RINGATTN_UNROLL
            for (int r = 0; r < kR; ++r) mt_max[r] = -INFINITY;
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) {
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) mt_max[2 * mt + e / 2] = fmaxf(mt_max[2 * mt + e / 2], s[mt][n][e]);
                }
            }
            // Lazy rescaling: a row's base (the max its exponentials are taken against) moves
            // only when the row max passes it by more than kRescaleSlack (log2 units), so P <=
            // 2^kRescaleSlack and, once the max has settled, a tile rescales nothing. When any
            // row of the warp must move, every row takes its exact max (O and l rescaled by
            // alpha); lse = m + log2 l holds for any base.
            constexpr float kRescaleSlack = 8.0f;
            float m_new[kR];
            bool move = false;
            RINGATTN_UNROLL
            for (int r = 0; r < kR; ++r) {
                mt_max[r] = fmaxf(mt_max[r], __shfl_xor_sync(0xffffffffu, mt_max[r], 1));
                mt_max[r] = fmaxf(mt_max[r], __shfl_xor_sync(0xffffffffu, mt_max[r], 2));
                // -inf (nothing visible in the row yet) times sc stays -inf (or NaN for sc = 0,
                // which fmaxf ignores); a first visible score always moves a -inf base.
                m_new[r] = fmaxf(m[r], mt_max[r] * sc);
                move = move || m_new[r] > m[r] + kRescaleSlack;
            }
            if (__ballot_sync(0xffffffffu, move) != 0) {
                RINGATTN_UNROLL
                for (int r = 0; r < kR; ++r) {
                    const float base = m_new[r] == -INFINITY ? 0.0f : m_new[r];  // nothing visible yet
                    const float alpha = ex2_approx(m[r] - base);                // -inf - x gives 0
                    m[r] = m_new[r];
                    l[r] *= alpha;
                    const int mt = r / 2, e0 = 2 * (r % 2);
                    RINGATTN_UNROLL
                    for (int n = 0; n < kOT; ++n) acc[mt][n][e0] *= alpha, acc[mt][n][e0 + 1] *= alpha;
                }
            }
            float nbase[kR];  // the negated base (0 while nothing is visible)
            RINGATTN_UNROLL
            for (int r = 0; r < kR; ++r) nbase[r] = m[r] == -INFINITY ? 0.0f : -m[r];
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) {
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) s[mt][n][e] = ex2_approx(fmaf(s[mt][n][e], sc, nbase[2 * mt + e / 2]));
                }
            }
            // A masked score is -inf: its exp2 is 0, except for sc = 0 (-inf * 0 is NaN).
            if (masked && sc == 0.0f) for_masked([](float& x) { x = 0.0f; });
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) {
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) l[2 * mt + e / 2] += s[mt][n][e];
                }
            }
            // O += P V: P from registers (two S n-tiles make one A operand of 16 keys).
            RINGATTN_UNROLL
            for (int kk = 0; kk < kN / 16; ++kk) {
                uint32_t a[kMT][4];
                RINGATTN_UNROLL
                for (int mt = 0; mt < kMT; ++mt) {
                    a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
                RINGATTN_UNROLL
                for (int n = 0; n < kOT; n += 2) {
                    uint32_t b[4];  // V rows kk*16 .. +15 (keys), columns n*8 .. n*8 + 15
                    ldmatrix_x4_trans(b, vt + vrow.at(n / 2) + kk * 16 * VG::kStride);
                    RINGATTN_UNROLL
                    for (int mt = 0; mt < kMT; ++mt) {
                        mma_16816<T>(acc[mt][n], a[mt], b);
                        mma_16816<T>(acc[mt][n + 1], a[mt], b + 2);
                    }
                }
            }
        };
        bool go = in_range && cls.full, masked = false;
        if (!go && !cls.empty) {
            int64_t row[kR], qpos[kR] = {};
            uint32_t qdoc[kR] = {};
            bool row_ok[kR];
            thread_rows(row);
            if (!unmasked) row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
            RINGATTN_UNROLL
            for (int r = 0; r < kR; ++r) row_ok[r] = row[r] < p.x.s_q;
            query_rows_visibility<kNT, kMT>(p.x.mask, unmasked, row_ok, qpos, qdoc, k0, p.x.s_k, t, vis);
            uint32_t any = 0;
            RINGATTN_UNROLL
            for (int mt = 0; mt < kMT; ++mt) any |= vis[mt];
            masked = true;
            go = __ballot_sync(0xffffffffu, any != 0) != 0;
        }
        if (go) run_tile(masked);
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    cp_async_wait<0>();

    // Epilogue: row sums across the quad, then o = acc / l and lse = ln 2 (m + log2 l). O goes
    // through shared memory (Q and the K/V buffers, free once every warp is past the loop) so
    // that each row leaves in 16-byte stores.
    __syncthreads();
    float inv[kR];
    RINGATTN_UNROLL
    for (int r = 0; r < kR; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
    int64_t row[kR];
    thread_rows(row);
#if RINGATTN_STAGED_EPILOGUE
    constexpr int kStageStride = StageStride<DV>::value;
    static_assert(Tr::kWarps * Tr::kWarpRows * kStageStride * 4 <= Tr::kSmemTiles,
                  "the output rows fit where Q, K and V were");
    float* stage = reinterpret_cast<float*>(smem) + warp * Tr::kWarpRows * kStageStride;
    stage_fragments<kMT, kOT, kStageStride>(stage, acc, inv);
    __syncthreads();  // (a warp reads only its own rows; the block barrier is what the emulator's race check sees)
    const int64_t w0 = first_row();
    store_staged_rows<T, Tr::kWarpRows, DV, kStageStride>(
        stage, d_v(),
        [&](int r) { return w0 + r < p.x.s_q ? ((bi * p.x.s_q + w0 + r) * p.x.h_q + hq) * d_v() : int64_t(-1); }, p.o,
        p.o16);
#else
    RINGATTN_UNROLL
    for (int r = 0; r < kR; ++r) {
        if (row[r] >= p.x.s_q) continue;
        const int mt = r / 2, e0 = 2 * (r % 2);
        const int64_t base = ((bi * p.x.s_q + row[r]) * p.x.h_q + hq) * d_v();
        RINGATTN_UNROLL
        for (int n = 0; n < kOT; ++n) {
            const int64_t c = n * 8 + 2 * t;
            if (c >= d_v()) continue;
            const float x = acc[mt][n][e0] * inv[r], y = acc[mt][n][e0 + 1] * inv[r];
            if (p.o16 != nullptr) {
                gmem_store(reinterpret_cast<uint32_t*>(p.o16 + base + c), pack2<T>(x, y));
            } else {
                gmem_store(p.o + base + c, x);
                gmem_store(p.o + base + c + 1, y);
            }
        }
    }
#endif
    RINGATTN_UNROLL
    for (int r = 0; r < kR; ++r) {
        if (row[r] < p.x.s_q && t == 0) {
            gmem_store(p.lse + (bi * p.x.h_q + hq) * p.x.s_q + row[r],
                       l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY);
        }
    }
}

// Each forward in two variants behind one entry point: plain scores, or soft-capped ones
// (score.cuh). Class 96 instantiates each variant on its own, chosen once per launch (a
// per-tile branch between them moved its plain instructions per HMMA by 5-6%); the others
// branch per tile (two instantiations push classes 64 and 128, at 255 registers, into spills
// of 40-88 bytes, and move class 192's rolled loop by 6%; the branch leaves the plain SASS of
// 32, 64, 128 and 256 as it was, and class 192's within 1.1%).
template <typename T, int D, int DV, bool kOwnDv>
__device__ __forceinline__ void flash_fwd(const FlashFwdParams& p) {
    if constexpr (D == 96) {
        if (p.x.score.softcap_log2 > 0.0f) {
            flash_fwd_tc<T, D, DV, kOwnDv, true, false>(p);
        } else {
            flash_fwd_tc<T, D, DV, kOwnDv, false, false>(p);
        }
    } else {
        flash_fwd_tc<T, D, DV, kOwnDv, false, true>(p);
    }
}

#define RINGATTN_FWD_ENTRY(TY, NAME, D) \
    extern "C" __global__ void __launch_bounds__(128) ringattn_flash_fwd_##NAME##_d##D(FlashFwdParams p) { \
        flash_fwd<TY, D, D, false>(p); \
    }
#define RINGATTN_FWD_ENTRIES(D) RINGATTN_FWD_ENTRY(Bf16, bf16, D) RINGATTN_FWD_ENTRY(F16, f16, D)
// V and O of their own head dim (src/kernels.rs `geometry::OWN_DV_CLASSES`), in tiles of the
// class D...
#define RINGATTN_FWD_DV_ENTRY(TY, NAME, D) \
    extern "C" __global__ void __launch_bounds__(128) ringattn_flash_fwd_##NAME##_d##D##_dv(FlashFwdParams p) { \
        flash_fwd<TY, D, D, true>(p); \
    }
#define RINGATTN_FWD_DV_ENTRIES(D) RINGATTN_FWD_DV_ENTRY(Bf16, bf16, D) RINGATTN_FWD_DV_ENTRY(F16, f16, D)
// ... or of their own class DV (src/kernels.rs `geometry::HEAD_DIM_PAIRS`).
#define RINGATTN_FWD_PAIR_ENTRY(TY, NAME, D, DV) \
    extern "C" __global__ void __launch_bounds__(128) ringattn_flash_fwd_##NAME##_d##D##_v##DV(FlashFwdParams p) { \
        flash_fwd<TY, D, DV, true>(p); \
    }
#define RINGATTN_FWD_PAIR_ENTRIES(D, DV) RINGATTN_FWD_PAIR_ENTRY(Bf16, bf16, D, DV) RINGATTN_FWD_PAIR_ENTRY(F16, f16, D, DV)
RINGATTN_FWD_ENTRIES(32)
RINGATTN_FWD_ENTRIES(64)
RINGATTN_FWD_ENTRIES(96)
RINGATTN_FWD_ENTRIES(128)
RINGATTN_FWD_ENTRIES(192)
RINGATTN_FWD_ENTRIES(256)
RINGATTN_FWD_DV_ENTRIES(96)
RINGATTN_FWD_DV_ENTRIES(192)
RINGATTN_FWD_DV_ENTRIES(256)
RINGATTN_FWD_PAIR_ENTRIES(192, 128)
