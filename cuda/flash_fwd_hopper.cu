// Flash attention forward for Hopper (sm_90a), FlashAttention-3 style: the contract of
// flash_fwd.cu (o, lse of queries q against keys k, values v; masks on global positions;
// GQA; f32 o for ring hops or o rounded to the input type; rows with no visible key get
// o = 0, lse = -inf) on wgmma, TMA and mbarriers, with warp specialisation.
//
// A block of 384 threads owns kBlockM = 128 query rows of one (batch, query head):
// warpgroup 0 is the producer (setmaxnreg down to 24 registers; one elected thread issues
// every copy), warpgroups 1 and 2 the consumers (setmaxnreg up to 240), 64 query rows each.
// The producer loads Q once (q_full) and K and V tiles of kBlockN keys into a ring of
// kStages shared-memory stages (4, 3, 2 at classes 64, 128, 256): per stage a K and a V
// barrier that the tensor copies complete (expect-tx of the tile's bytes), and an `empty`
// barrier that the 256 consumer threads arrive on when they are done with the stage (the
// producer's first wait on a fresh stage is on parity 1). Per tile each consumer
// warpgroup: S = Q K^T by wgmma (A = its 64 Q rows and B = the K tile from shared memory,
// both K-major, 128-byte swizzled as the copies place them); the mask on global positions
// unless the tile is fully visible to the warpgroup (classified from the granule bounds);
// the online softmax on the accumulator fragments (base 2, the lazy rescaling of
// flash_fwd.cu); P packed from the fragments as the A registers of O += P V (B = the V
// tile, MN-major). Loops are bounded by the mask (the block's tile range, as flash_fwd.cu);
// inside it every tile runs (wgmmas under data-dependent branches would be serialised).
// Intra-warpgroup pipelining up to class 128: a tile's Q K^T is issued before the previous
// tile's P V, so the softmax overlaps the tensor cores' P V (O's rescale waits for it).
// Ping-pong between the consumer warpgroups: named barriers hand the turn to issue a tile's
// wgmmas from one to the other, so one's softmax overlaps the other's products.
//
// Entry points ringattn_hopper_flash_fwd_{bf16,f16}_d{64,128,256}: the head-dim class is
// the head dim rounded up to 64, 128 or 256 (src/kernels.rs `geometry::forward_hopper`, with
// the launch: grid (ceil(s_q / 128), h_q, b), 384 threads, HopperFwdTraits<D>::kSmem bytes).
// Builds for other architectures compile the entries to a trap.
//
// setmaxnreg-split: 1x24 2x240
// (the producer warpgroup at 24 registers, two consumers at 240: 64512 of the 168 x 384 the
// block gets at entry; scripts/sass-gates.sh checks that ptxas's count covers it)
#include "hopper.cuh"

template <int D>
struct HopperFwdTraits {
    static_assert(D == 64 || D == 128 || D == 256, "head-dim classes 64, 128, 256");
    static constexpr int kBlockM = 128, kThreads = 384, kWarps = 12;
    static constexpr int kBlockN = D <= 128 ? 128 : 64;
    // K/V stages: as many as fit (with Q) in 227 KiB: 4 at class 64, 3 at 128, 2 at 256.
    static constexpr int kStages = D == 64 ? 4 : D == 128 ? 3 : 2;
    static constexpr int kColBlocks = D / 64;  // 64-column (128-byte) boxes per row
    static constexpr uint32_t kQBytes = kBlockM * D * 2, kTileBytes = kBlockN * D * 2;
    // Shared memory from a 1024-byte aligned base (the 128-byte swizzle's repeat).
    static constexpr uint32_t kOffK = kQBytes;
    static constexpr uint32_t kOffV = kOffK + kStages * kTileBytes;
    static constexpr uint32_t kOffBars = kOffV + kStages * kTileBytes;  // q_full, k_full[], v_full[], empty[]
    static constexpr uint32_t kOffScratch = kOffBars + 8 * (1 + 3 * kStages);
    static constexpr uint32_t kScratch = 4 * kWarps * 8;  // block_tile_range
    static constexpr uint32_t kSmem = kOffScratch + kScratch + 1024;  // + alignment slack
    static_assert(kSmem <= 227 * 1024, "fits in Hopper's 227 KiB of shared memory per block");
};

// The block's mbarriers (HopperFwdTraits::kOffBars): Q landed, and per stage K landed, V
// landed, and the stage released by the consumers.
template <int kStages>
struct FwdBarriers {
    uint64_t *q_full, *k_full, *v_full, *empty;
    __device__ explicit FwdBarriers(unsigned char* at)
        : q_full(reinterpret_cast<uint64_t*>(at)), k_full(q_full + 1), v_full(k_full + kStages),
          empty(v_full + kStages) {}
};

template <typename T, int D>
__device__ __forceinline__ void flash_fwd_hopper_consumer(const FlashFwdHopperParams& hp, unsigned char* smem,
                                                          int t_begin, int t_end);

template <typename T, int D>
__device__ void flash_fwd_hopper(const FlashFwdHopperParams& hp) {
    using Tr = HopperFwdTraits<D>;
    constexpr int kN = Tr::kBlockN, kStages = Tr::kStages;
    const FlashFwdParams& p = hp.p;
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.x.h_q / p.x.h_kv);
    const int64_t q0 = int64_t(blockIdx.x) * Tr::kBlockM;
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    unsigned char* raw = RINGATTN_DYNAMIC_SMEM();
    unsigned char* smem = raw + (1024 - smem_u32(raw) % 1024) % 1024;
    const FwdBarriers<kStages> bars(smem + Tr::kOffBars);
    uint64_t *q_full = bars.q_full, *k_full = bars.k_full, *v_full = bars.v_full, *empty = bars.empty;

    const bool unmasked = mask_is_none(p.x.mask);
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr;

    // The tiles any row of the block may see (every thread; producer warps stand in for the
    // consumer warp of the same rank mod 8: a subset of the block's rows).
    const int cw = warp % 8;
    auto thread_rows = [&](int64_t (&row)[2]) {
        row[0] = q0 + 16 * cw + g;
        row[1] = row[0] + 8;
    };
    const int64_t ntiles64 = (p.x.s_k + 63) / 64;
    int64_t range_begin = 0, range_end = ntiles64;
    if (classify && ntiles64 > 0) {
        int64_t row[2], qpos[2];
        uint32_t qdoc[2];
        thread_rows(row);
        row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
        const RowBounds warp_rows = warp_row_bounds(qpos, qdoc);
        block_tile_range<Tr::kWarps, Tr::kThreads, 64>(p.x.mask, warp_rows, p.x.s_k, ntiles64,
                                                       reinterpret_cast<int64_t*>(smem + Tr::kOffScratch),
                                                       range_begin, range_end);
    }
    constexpr int kPer64 = kN / 64;
    const int t_begin = int(range_begin / kPer64), t_end = int((range_end + kPer64 - 1) / kPer64);

    if (threadIdx.x == 0) {
        mbarrier_init(q_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&k_full[s], 1);
            mbarrier_init(&v_full[s], 1);
            mbarrier_init(&empty[s], 256);
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warp < 4) {
        // Producer.
        setmaxnreg_dec<24>();
        // (Nothing to load when the mask leaves the block no tile: the consumers then write
        // o = 0, lse = -inf without waiting for Q.)
        if (warp == 0 && elect_one_sync() && t_begin < t_end) {
            tma_prefetch_map(&hp.q);
            tma_prefetch_map(&hp.k);
            tma_prefetch_map(&hp.v);
            mbarrier_arrive_expect_tx(q_full, Tr::kQBytes);
            for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                tma_load_4d(smem + cb * Tr::kBlockM * 128, &hp.q, q_full, 64 * cb, int32_t(hq), int32_t(q0),
                            int32_t(bi));
            }
            for (int tile = t_begin, i = 0; tile < t_end; ++tile, ++i) {
                const int stage = i % kStages;
                const uint32_t phase = uint32_t(i / kStages) & 1u;
                mbarrier_wait_parity(&empty[stage], phase ^ 1u);
                unsigned char* ks = smem + Tr::kOffK + stage * Tr::kTileBytes;
                unsigned char* vs = smem + Tr::kOffV + stage * Tr::kTileBytes;
                mbarrier_arrive_expect_tx(&k_full[stage], Tr::kTileBytes);
                for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                    tma_load_4d(ks + cb * kN * 128, &hp.k, &k_full[stage], 64 * cb, int32_t(hk), tile * kN,
                                int32_t(bi));
                }
                mbarrier_arrive_expect_tx(&v_full[stage], Tr::kTileBytes);
                for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                    tma_load_4d(vs + cb * kN * 128, &hp.v, &v_full[stage], 64 * cb, int32_t(hk), tile * kN,
                                int32_t(bi));
                }
            }
            // Outlive the consumers: wait until they have released every stage they use (the
            // deadline of this wait covers theirs, see mbarrier_wait_parity_covered).
            for (int i = t_end - t_begin; i < t_end - t_begin + kStages; ++i) {
                if (i - kStages < 0) continue;
                mbarrier_wait_parity(&empty[i % kStages], (uint32_t(i / kStages) & 1u) ^ 1u);
            }
        }
    } else {
        // Consumers (ptxas gives this branch the registers of setmaxnreg.inc only when the
        // roles are the two sides of one if/else).
        flash_fwd_hopper_consumer<T, D>(hp, smem, t_begin, t_end);
    }
}

// A consumer warpgroup: c owns query rows q0 + 64c ... + 63; this thread rows 16w + g and
// 16w + g + 8 of them.
template <typename T, int D>
__device__ __forceinline__ void flash_fwd_hopper_consumer(const FlashFwdHopperParams& hp, unsigned char* smem,
                                                          int t_begin, int t_end) {
    using Tr = HopperFwdTraits<D>;
    constexpr int kN = Tr::kBlockN, kStages = Tr::kStages, kPer64 = kN / 64;
    constexpr WgmmaInput kIn = wgmma_input<T>();
    const FlashFwdParams& p = hp.p;
    const int64_t d = p.x.d_v;  // (the output's: Q and K come through their tensor maps)
    const int64_t hq = blockIdx.y, bi = blockIdx.z;
    const int64_t q0 = int64_t(blockIdx.x) * Tr::kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const FwdBarriers<kStages> bars(smem + Tr::kOffBars);
    uint64_t *q_full = bars.q_full, *k_full = bars.k_full, *v_full = bars.v_full, *empty = bars.empty;
    const bool unmasked = mask_is_none(p.x.mask);
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr;
    setmaxnreg_inc<240>();
    const int c = warp / 4 - 1, w = warp % 4;
    int64_t row[2];
    row[0] = q0 + 64 * c + 16 * w + g;
    row[1] = row[0] + 8;
    const bool rows_in = q0 + 64 * c + 64 <= p.x.s_q;  // every row of the warpgroup exists
    int64_t qpos[2] = {0, 0};
    uint32_t qdoc[2] = {0u, 0u};
    if (!unmasked) row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
    const bool row_ok[2] = {row[0] < p.x.s_q, row[1] < p.x.s_q};
    // The warpgroup's query bounds, from the queries' granule bounds (64 rows: two granules).
    // A warpgroup past the last query row only keeps the pipeline going.
    const bool wg_live = q0 + 64 * c < p.x.s_q;
    const RowBounds wg_rows =
        classify && wg_live ? tile_query_bounds<64>(p.x.mask, (q0 + 64 * c) / 64, p.x.s_q) : RowBounds{0, 0, 0u, 0u};

    // The raw scores' sign folded (negated for a negative scale), so that the exponent takes
    // sc >= 0 and the row max commutes with it; under a soft-cap they are capped first and sc
    // is 1 (score.cuh).
    const bool negate = p.x.score.scale_log2 < 0.0f;
    const ForwardScores scores = ForwardScores::any(p.x.score);
    const float sc = scores.sc;
    const uint32_t q_base = smem_u32(smem) + uint32_t(64 * c) * 128;
    WgmmaAcc<D> o;
    for (int v = 0; v < D / 2; ++v) o[v] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    if (t_begin < t_end) mbarrier_wait_parity_covered(q_full, 0);

    // Intra-warpgroup pipelining: tile i's S = QK^T is issued before tile i-1's O += P V, so
    // the softmax of tile i waits only for the former while the tensor cores run the latter;
    // O's rescale by tile i's new base waits for that P V, and P stays in f32 (in S's
    // registers) until then: `pa` holds the packed P of the pending P V. Every tile of the
    // block's range runs (a tile the bounds show fully masked for this warpgroup runs masked):
    // wgmmas under data-dependent branches are serialised by ptxas (C7520).
    uint32_t pa[kN / 16][4];
    // Tile `tile` (the i-th) up to its softmax: S issued, then the pending P V of the
    // previous tile (when `with_pv`), S waited for, masked, exponentiated in place; returns
    // whether O must be rescaled by `alpha` (after the pending P V).
    // Ping-pong between the two consumer warpgroups: each issues a tile's wgmmas only in its
    // turn (named barrier kTurnBarrier + c: its own 128 syncs and the other warpgroup's 128
    // arrives) and hands the turn over once they are issued, so one warpgroup's softmax runs
    // while the other's wgmmas keep the tensor cores busy. Warpgroup 1 hands warpgroup 0 the
    // first turn and takes none back after its last tile: every barrier completes as often
    // as it is waited on.
    constexpr uint32_t kTurnBarrier = 1;
    const uint32_t my_turn = kTurnBarrier + uint32_t(c), other_turn = kTurnBarrier + uint32_t(1 - c);
    const int n_tiles = t_end - t_begin;
    if (c == 1 && n_tiles > 0) named_barrier_arrive(other_turn, 256);
    auto qk_softmax = [&](int tile, int i, bool with_pv, WgmmaAcc<kN>& s, float (&alpha)[2]) {
        const int stage = i % kStages;
        const uint32_t phase = uint32_t(i / kStages) & 1u;
        const int64_t k0 = int64_t(tile) * kN;
        bool full = unmasked;
        if (classify && wg_live) {
            full = true;
            RINGATTN_UNROLL
            for (int h = 0; h < kPer64; ++h) {
                if (k0 + 64 * h >= p.x.s_k) continue;
                const RowBounds keys = tile_key_bounds<64>(p.x.mask, int64_t(tile) * kPer64 + h, p.x.s_k);
                full = full && all_visible(p.x.mask, wg_rows, keys);
            }
        }
        full = full && rows_in && k0 + kN <= p.x.s_k;
        mbarrier_wait_parity_covered(&k_full[stage], phase);
        named_barrier_sync(my_turn, 256);
        // Orders the last softmax's register accesses (S, P, O's rescale) before the wgmmas.
        wgmma_fence();
        const uint32_t k_base = smem_u32(smem + Tr::kOffK + stage * Tr::kTileBytes);
        RINGATTN_UNROLL
        for (int ks = 0; ks < D / 16; ++ks) {
            wgmma_ss<kIn, WgmmaMajor::kK, WgmmaMajor::kK>(s, kmajor_desc(q_base, Tr::kBlockM * 128, ks),
                                                          kmajor_desc(k_base, kN * 128, ks),
                                                          ks == 0 ? WgmmaAccumulate::kOverwrite : WgmmaAccumulate::kAdd);
        }
        wgmma_commit_group();
        if (with_pv) {
            const int ps = (i - 1) % kStages;
            mbarrier_wait_parity_covered(&v_full[ps], uint32_t((i - 1) / kStages) & 1u);
            const uint32_t v_base = smem_u32(smem + Tr::kOffV + ps * Tr::kTileBytes);
            RINGATTN_UNROLL
            for (int ks = 0; ks < kN / 16; ++ks) {
                wgmma_rs<kIn, WgmmaMajor::kMN>(o, pa[ks], mnmajor_desc(v_base, kN * 128, ks), WgmmaAccumulate::kAdd);
            }
            wgmma_commit_group();
        }
        if (!(c == 1 && i == n_tiles - 1)) named_barrier_arrive(other_turn, 256);
        if (with_pv) {
            wgmma_wait_group<1>(s);  // S has landed; P V may still run
        } else {
            wgmma_wait_group<0>(s);
        }
        if (negate) {
            RINGATTN_UNROLL
            for (int v = 0; v < kN / 2; ++v) s[v] = -s[v];
        }
        if (scores.capped()) {  // the score options before the mask: one uniform branch per tile
            RINGATTN_UNROLL
            for (int v = 0; v < kN / 2; ++v) s[v] = scores.cap(s[v]);
        }
        // The mask: element v of the fragment is row (v >> 1) & 1, key k0 + 8 (v >> 2) + 2t +
        // (v & 1), i.e. bit v % 32 of the visibility of 64-key half v / 32.
        uint32_t vis[kPer64];
        RINGATTN_UNROLL
        for (int h = 0; h < kPer64; ++h) vis[h] = ~0u;
        if (!full) {
            RINGATTN_UNROLL
            for (int h = 0; h < kPer64; ++h) {
                vis[h] = query_row_visibility<8>(p.x.mask, unmasked, row_ok, qpos, qdoc, k0 + 64 * h, p.x.s_k, t);
            }
            RINGATTN_UNROLL
            for (int v = 0; v < kN / 2; ++v) {
                if (!(vis[v / 32] >> (v % 32) & 1u)) s[v] = -INFINITY;
            }
        }
        // Online softmax (flash_fwd.cu's, per thread: its two rows live in one quad), the
        // base moved lazily.
        float mx[2] = {-INFINITY, -INFINITY};
        RINGATTN_UNROLL
        for (int v = 0; v < kN / 2; ++v) mx[(v >> 1) & 1] = fmaxf(mx[(v >> 1) & 1], s[v]);
        constexpr float kRescaleSlack = 8.0f;
        float m_new[2];
        bool move = false;
        RINGATTN_UNROLL
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            m_new[r] = fmaxf(m[r], mx[r] * sc);
            move = move || m_new[r] > m[r] + kRescaleSlack;
        }
        if (move) {
            RINGATTN_UNROLL
            for (int r = 0; r < 2; ++r) {
                const float base = m_new[r] == -INFINITY ? 0.0f : m_new[r];  // nothing visible yet
                alpha[r] = ex2_approx(m[r] - base);                         // -inf - x gives 0
                m[r] = m_new[r];
                l[r] *= alpha[r];
            }
        }
        float nbase[2];
        RINGATTN_UNROLL
        for (int r = 0; r < 2; ++r) nbase[r] = m[r] == -INFINITY ? 0.0f : -m[r];
        RINGATTN_UNROLL
        for (int v = 0; v < kN / 2; v += 2) {
            float x = ex2_approx(fmaf(s[v], sc, nbase[(v >> 1) & 1]));
            float y = ex2_approx(fmaf(s[v + 1], sc, nbase[(v >> 1) & 1]));
            if (sc == 0.0f && !full) {
                if (!(vis[v / 32] >> (v % 32) & 1u)) x = 0.0f;
                if (!(vis[(v + 1) / 32] >> ((v + 1) % 32) & 1u)) y = 0.0f;
            }
            l[(v >> 1) & 1] += x + y;
            s[v] = x, s[v + 1] = y;
        }
        return move;
    };
    // After the pending P V: O rescaled, the stage of the previous tile released, this tile's
    // P packed (K-step ks, register r: elements 8 ks + 2r and 8 ks + 2r + 1 of the fragment).
    auto finish = [&](int i, bool with_pv, bool move, const float (&alpha)[2], WgmmaAcc<kN>& s) {
        if (with_pv) {
            wgmma_wait_group<0>(o);
            mbarrier_arrive(&empty[(i - 1) % kStages]);
        }
        if (move) {
            RINGATTN_UNROLL
            for (int v = 0; v < D / 2; ++v) o[v] *= alpha[(v >> 1) & 1];
        }
        RINGATTN_UNROLL
        for (int v = 0; v < kN / 2; v += 2) pa[v / 8][(v % 8) / 2] = pack2<T>(s[v], s[v + 1]);
    };
    // Tile i's P V, issued and waited for, then its stage released.
    auto pv_now = [&](int i) {
        const int st = i % kStages;
        mbarrier_wait_parity_covered(&v_full[st], uint32_t(i / kStages) & 1u);
        wgmma_fence();
        const uint32_t v_base = smem_u32(smem + Tr::kOffV + st * Tr::kTileBytes);
        RINGATTN_UNROLL
        for (int ks = 0; ks < kN / 16; ++ks) {
            wgmma_rs<kIn, WgmmaMajor::kMN>(o, pa[ks], mnmajor_desc(v_base, kN * 128, ks), WgmmaAccumulate::kAdd);
        }
        wgmma_commit_group();
        wgmma_wait_group<0>(o);
        mbarrier_arrive(&empty[st]);
    };
    // Class 256 runs unpipelined: its O takes 128 registers, and a second tile's S in flight
    // beside it spills.
    constexpr bool kPipelined = D <= 128;
    if (t_begin < t_end) {
        for (int tile = t_begin, i = 0; tile < t_end; ++tile, ++i) {
            const bool with_pv = kPipelined && i > 0;
            WgmmaAcc<kN> s;
            float alpha[2] = {1.0f, 1.0f};
            const bool move = qk_softmax(tile, i, with_pv, s, alpha);
            finish(i, with_pv, move, alpha, s);
            if (!kPipelined) pv_now(i);
        }
        if (kPipelined) pv_now(t_end - t_begin - 1);  // the last tile's P V
    }

    // Epilogue: row sums across the quad, o = acc / l, lse = ln 2 (m + log2 l).
    float inv[2];
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
    RINGATTN_UNROLL
    for (int v = 0; v < D / 2; v += 2) {
        const int r = (v >> 1) & 1;
        const int64_t col = 8 * (v >> 2) + 2 * t;
        if (row[r] >= p.x.s_q || col >= d) continue;
        const int64_t at = ((bi * p.x.s_q + row[r]) * p.x.h_q + hq) * d + col;
        const float x = o[v] * inv[r], y = o[v + 1] * inv[r];
        if (p.o16 != nullptr) {
            gmem_store(reinterpret_cast<uint32_t*>(p.o16 + at), pack2<T>(x, y));
        } else {
            gmem_store(p.o + at, x);
            gmem_store(p.o + at + 1, y);
        }
    }
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        if (row[r] < p.x.s_q && t == 0) {
            gmem_store(p.lse + (bi * p.x.h_q + hq) * p.x.s_q + row[r],
                       l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : -INFINITY);
        }
    }
}

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RINGATTN_FWD_HOPPER_BODY(TY, D) flash_fwd_hopper<TY, D>(p);
#else
#define RINGATTN_FWD_HOPPER_BODY(TY, D) __trap();
#endif
#define RINGATTN_FWD_HOPPER_ENTRY(TY, NAME, D)                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1)                                              \
        ringattn_hopper_flash_fwd_##NAME##_d##D(const __grid_constant__ FlashFwdHopperParams p) { \
        RINGATTN_FWD_HOPPER_BODY(TY, D)                                                               \
    }
#define RINGATTN_FWD_HOPPER_ENTRIES(D) \
    RINGATTN_FWD_HOPPER_ENTRY(Bf16, bf16, D) RINGATTN_FWD_HOPPER_ENTRY(F16, f16, D)
RINGATTN_FWD_HOPPER_ENTRIES(64)
RINGATTN_FWD_HOPPER_ENTRIES(128)
RINGATTN_FWD_HOPPER_ENTRIES(256)
