// Flash attention backward for Hopper (sm_90a) on wgmma, TMA and mbarriers: the contract of
// flash_bwd.cu's fused dk/dv kernel (dk, dv of one block of keys written in f32, dq added
// into zeros in fixed point or with f32 atomics; masks on global positions, GQA) with
//   p_ij = exp(scale q_i.k_j - lse_i) for visible pairs, 0 otherwise;
//   ds_ij = p_ij (d_o_i.v_j - delta_i) (delta from the rowsum kernel);
//   dv_j = sum_i p_ij d_o_i;   dk_j = scale sum_i ds_ij q_i;   dq_i = scale sum_j ds_ij k_j.
// The kvbound, rowunit and dqconvert kernels of flash_bwd.cu serve it unchanged (fixed-point
// dq: see the bound there; a 64-key sum per consumer warpgroup and query tile keeps the
// rounding error at half a unit per 64 keys).
//
// A block of 384 threads owns kBlockN keys of one (batch, key head): warpgroup 0 is the
// producer (setmaxnreg down to 24; one elected thread issues every copy), warpgroups 1 and 2
// the consumers (setmaxnreg up to 240). The producer loads K and V once (kv_full) and then,
// for every query head of the GQA group and every query tile of kBlockM = 64 rows the block
// may see (the loop bounded by the mask, as flash_bwd.cu), the Q and dO tiles into a ring of
// kStages stages (full: the copies' bytes; empty: the 256 consumer threads' arrivals).
// Consumer warpgroup c owns 64 keys and kWgCols columns of dk/dv: up to class 128 keys 64c
// ... 64c + 63 of a 128-key block and every column; at class 256 all 64 keys of the block and
// columns 128c ... 128c + 127 (dk, dv of 64 x 256 per warpgroup would not fit in registers;
// S and dP are computed by both warpgroups). Per query tile:
//   S^T = K Q^T and dP^T = V dO^T by wgmma (A = the warpgroup's K/V rows, B = the Q/dO tile,
//     both K-major, 128-byte swizzled as the copies place them);
//   P^T and dS^T (times the softmax scale) on the accumulator fragments, the mask on global
//     positions unless the tile is fully visible to the warpgroup (from the granule bounds);
//   dV += P^T dO and dK += dS^T Q by wgmma with A from registers (the fragments packed) and B
//     the tile, MN-major;
//   dS^T stored to the warpgroup's shared tile (128-byte swizzled, keys x queries: dS as an
//     MN-major A), fenced for the async proxy, then dQ = dS K in 64-column chunks (B = the
//     warpgroup's K rows, MN-major), each chunk added to dq with one atomic per element (in
//     its row's fixed-point unit, or as f32).
// Not yet here (FlashAttention-3's further steps): overlap between the two consumer
// warpgroups' softmax and products, and dq reduced through shared memory with bulk copies.
//
// Entry points ringattn_hopper_flash_bwd_dkdvq{fx,}_{bf16,f16}_d{64,128,256} (fx: fixed
// point, the deterministic default; without: f32 atomics): the head-dim class is the head dim
// rounded up to 64, 128 or 256 (src/kernels.rs `geometry::dkdv_hopper` launches them: grid
// (ceil(s_k / kBlockN), h_kv, b), 384 threads, HopperBwdTraits<D>::kSmem bytes). Builds for
// other architectures compile the entries to a trap.
//
// setmaxnreg-split: 1x24 2x240
// (the producer warpgroup at 24 registers, two consumers at 240: 64512 of the 168 x 384 the
// block gets at entry; scripts/sass-gates.sh checks that ptxas's count covers it)
#include "hopper.cuh"

template <int D>
struct HopperBwdTraits {
    static_assert(D == 64 || D == 128 || D == 256, "head-dim classes 64, 128, 256");
    static constexpr int kBlockM = 64, kThreads = 384, kWarps = 12;
    static constexpr int kBlockN = D <= 128 ? 128 : 64;
    // Columns of dk/dv per consumer warpgroup, and where warpgroup c's keys and columns start.
    static constexpr int kWgCols = D <= 128 ? D : 128;
    __device__ static constexpr int key_offset(int c) { return D <= 128 ? 64 * c : 0; }
    __device__ static constexpr int col_offset(int c) { return D <= 128 ? 0 : 128 * c; }
    // Q/dO stages: as many as fit with K, V and the dS tiles in 227 KiB.
    static constexpr int kStages = D == 64 ? 4 : D == 128 ? 3 : 2;
    static constexpr int kColBlocks = D / 64;  // 64-column (128-byte) boxes per row
    static constexpr uint32_t kTileBytes = kBlockM * D * 2, kKVBytes = kBlockN * D * 2;
    static constexpr uint32_t kDsBytes = 64 * kBlockM * 2;  // a warpgroup's dS^T: 64 keys x 64 queries
    // Shared memory from a 1024-byte aligned base (the 128-byte swizzle's repeat).
    static constexpr uint32_t kOffV = kKVBytes;
    static constexpr uint32_t kOffStages = 2 * kKVBytes;  // per stage: Q, then dO
    static constexpr uint32_t kOffDs = kOffStages + kStages * 2 * kTileBytes;
    // Per stage the query tile's lse and delta (64 f32 each, copied with Q and dO).
    static constexpr uint32_t kOffStats = kOffDs + 2 * kDsBytes;
    static constexpr uint32_t kStatsBytes = 2 * kBlockM * 4;
    static constexpr uint32_t kOffBars = kOffStats + kStages * kStatsBytes;  // kv_full, full[], empty[]
    static constexpr uint32_t kOffRange = kOffBars + 8 * (1 + 2 * kStages);  // the query tiles' range
    static constexpr uint32_t kOffScratch = kOffRange + 8;
    static constexpr uint32_t kScratch = 4 * kWarps * 8;  // block_tile_range
    static constexpr uint32_t kSmem = kOffScratch + kScratch + 1024;  // + alignment slack
    static_assert(kSmem <= 227 * 1024, "fits in Hopper's 227 KiB of shared memory per block");
};

// The block's mbarriers (HopperBwdTraits::kOffBars): K and V landed, and per stage Q and dO
// landed, and the stage released by the consumers.
template <int kStages>
struct BwdBarriers {
    uint64_t *kv_full, *full, *empty;
    __device__ explicit BwdBarriers(unsigned char* at)
        : kv_full(reinterpret_cast<uint64_t*>(at)), full(kv_full + 1), empty(full + kStages) {}
};

// Step `it` of a block: query head `head` of the GQA group, query tile `qtile`, advanced
// tile by tile (a division per step costs more than this).
struct HopperBwdStep {
    int head, qtile;
};

template <typename T, int D, DqAccum kAccum>
__device__ __forceinline__ void flash_bwd_hopper_consumer(const FlashBwdHopperParams& hp, unsigned char* smem);

// Whether the consumer of class D has the soft-capped variant (score.cuh): every class but 128,
// in the emulator too (src/kernels.rs `geometry::backward_family` sends a soft-capped backward
// of class 128 to the FA2 family). A launch that asks for it anyway fails.
template <int D>
constexpr bool kHopperCappedAt = D != 128;
#ifdef __CUDACC__
#define RINGATTN_HOPPER_CAPPED_MISSING() __trap()
#else
#define RINGATTN_HOPPER_CAPPED_MISSING() ::emu::fail("a soft-capped Hopper backward of class 128 (it runs on the FA2 family)")
#endif
template <int D>
__device__ __forceinline__ void flash_bwd_hopper_producer(const FlashBwdHopperParams& hp, unsigned char* smem);

// The block's range of query tiles (computed before the roles split, kept in shared memory:
// what stays live across the split must fit the producer's 24 registers).
template <int D>
__device__ __forceinline__ void bwd_tile_range(unsigned char* smem, int& begin, int& end) {
    const int32_t* range = reinterpret_cast<const int32_t*>(smem + HopperBwdTraits<D>::kOffRange);
    begin = smem_load(range);
    end = smem_load(range + 1);
}

template <typename T, int D, DqAccum kAccum>
__device__ void flash_bwd_hopper(const FlashBwdHopperParams& hp) {
    using Tr = HopperBwdTraits<D>;
    constexpr int kStages = Tr::kStages;
    const FlashBwdParams& p = hp.p;
    const int64_t k0 = int64_t(blockIdx.x) * Tr::kBlockN;
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    unsigned char* raw = RINGATTN_DYNAMIC_SMEM();
    unsigned char* smem = raw + (1024 - smem_u32(raw) % 1024) % 1024;
    const BwdBarriers<kStages> bars(smem + Tr::kOffBars);

    const bool unmasked = mask_is_none(p.x.mask);
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr && p.x.mask.q_bounds != nullptr;
    // The query tiles any key of the block may see (every thread; warp w stands for the 16
    // keys 16 (w mod kBlockN / 16) ...: a subset of the block's keys).
    const int64_t qtiles = (p.x.s_q + Tr::kBlockM - 1) / Tr::kBlockM;
    int64_t range_begin = 0, range_end = qtiles;
    if (classify && qtiles > 0) {
        const int64_t row[2] = {k0 + 16 * (warp % (Tr::kBlockN / 16)) + g, k0 + 16 * (warp % (Tr::kBlockN / 16)) + g + 8};
        int64_t kpos[2];
        uint32_t kdoc[2];
        row_positions(p.x.mask.k_pos, p.x.mask.k_doc, row, p.x.s_k, kpos, kdoc);
        block_tile_range<Tr::kWarps, Tr::kThreads, Tr::kBlockM, BlockRows::Keys>(
            p.x.mask, warp_row_bounds(kpos, kdoc), p.x.s_q, qtiles, reinterpret_cast<int64_t*>(smem + Tr::kOffScratch),
            range_begin, range_end);
    }

    if (threadIdx.x == 0) {
        int32_t* range = reinterpret_cast<int32_t*>(smem + Tr::kOffRange);
        smem_store(range, int32_t(range_begin));
        smem_store(range + 1, int32_t(range_end));
        mbarrier_init(bars.kv_full, 1);
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&bars.full[s], 1);
            mbarrier_init(&bars.empty[s], 256);
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warp < 4) {
        flash_bwd_hopper_producer<D>(hp, smem);
    } else {
        // Consumers (ptxas gives this branch the registers of setmaxnreg.inc only when the
        // roles are the two sides of one if/else).
        flash_bwd_hopper_consumer<T, D, kAccum>(hp, smem);
    }
}

// The producer warpgroup: one elected thread loads K and V, then the Q and dO tiles of every
// step into the stage ring.
template <int D>
__device__ __forceinline__ void flash_bwd_hopper_producer(const FlashBwdHopperParams& hp, unsigned char* smem) {
    using Tr = HopperBwdTraits<D>;
    constexpr int kStages = Tr::kStages;
    setmaxnreg_dec<24>();
    const FlashBwdParams& p = hp.p;
    const int64_t hk = blockIdx.y, bi = blockIdx.z, group = p.x.h_q / p.x.h_kv;
    const int64_t k0 = int64_t(blockIdx.x) * Tr::kBlockN;
    const BwdBarriers<kStages> bars(smem + Tr::kOffBars);
    int qt_begin, qt_end;
    bwd_tile_range<D>(smem, qt_begin, qt_end);
    {
        const int steps = int(group) * (qt_end - qt_begin);
        // (Nothing to load when the mask leaves the block no query tile: the consumers then
        // write dk = dv = 0 without waiting.)
        if (threadIdx.x / 32 == 0 && elect_one_sync() && steps > 0) {
            tma_prefetch_map(&hp.q);
            tma_prefetch_map(&hp.k);
            tma_prefetch_map(&hp.v);
            tma_prefetch_map(&hp.d_o);
            tma_prefetch_map(&hp.lse);
            tma_prefetch_map(&hp.delta);
            mbarrier_arrive_expect_tx(bars.kv_full, 2 * Tr::kKVBytes);
            for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                tma_load_4d(smem + cb * Tr::kBlockN * 128, &hp.k, bars.kv_full, 64 * cb, int32_t(hk), int32_t(k0),
                            int32_t(bi));
                tma_load_4d(smem + Tr::kOffV + cb * Tr::kBlockN * 128, &hp.v, bars.kv_full, 64 * cb, int32_t(hk),
                            int32_t(k0), int32_t(bi));
            }
            HopperBwdStep step{0, qt_begin};
            for (int i = 0; i < steps; ++i) {
                const int stage = i % kStages;
                mbarrier_wait_parity(&bars.empty[stage], (uint32_t(i / kStages) & 1u) ^ 1u);
                unsigned char* qs = smem + Tr::kOffStages + stage * 2 * Tr::kTileBytes;
                unsigned char* dos = qs + Tr::kTileBytes;
                const int32_t hq = int32_t(hk * group + step.head), q0 = step.qtile * Tr::kBlockM;
                mbarrier_arrive_expect_tx(&bars.full[stage], 2 * Tr::kTileBytes + Tr::kStatsBytes);
                // The rows' lse and delta: 64 values from row (b, hq, q0) of [b, h_q, s_q].
                const int32_t row = int32_t((bi * p.x.h_q + hq) * p.x.s_q + q0);
                float* stats = reinterpret_cast<float*>(smem + Tr::kOffStats + stage * Tr::kStatsBytes);
                tma_load_2d(stats, &hp.lse, &bars.full[stage], row, 0);
                tma_load_2d(stats + Tr::kBlockM, &hp.delta, &bars.full[stage], row, 0);
                for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
                    tma_load_4d(qs + cb * Tr::kBlockM * 128, &hp.q, &bars.full[stage], 64 * cb, hq, q0, int32_t(bi));
                    tma_load_4d(dos + cb * Tr::kBlockM * 128, &hp.d_o, &bars.full[stage], 64 * cb, hq, q0,
                                int32_t(bi));
                }
                step = step.qtile + 1 < qt_end ? HopperBwdStep{step.head, step.qtile + 1}
                                               : HopperBwdStep{step.head + 1, qt_begin};
            }
            // Outlive the consumers: wait until they have released every stage they use (the
            // deadline of this wait covers theirs, see mbarrier_wait_parity_covered).
            for (int i = steps; i < steps + kStages; ++i) {
                if (i - kStages < 0) continue;
                mbarrier_wait_parity(&bars.empty[i % kStages], (uint32_t(i / kStages) & 1u) ^ 1u);
            }
        }
    }
}

// A consumer warpgroup c: keys k0 + key_offset(c) + 16w + g (+ 8) of its 64 are this thread's
// rows of S^T, dP^T, dK and dV; columns col_offset(c) ... of dK and dV are its.
template <typename T, int D, DqAccum kAccum>
__device__ __forceinline__ void flash_bwd_hopper_consumer(const FlashBwdHopperParams& hp, unsigned char* smem) {
    using Tr = HopperBwdTraits<D>;
    constexpr int kStages = Tr::kStages, kM = Tr::kBlockM, kCols = Tr::kWgCols;
    constexpr WgmmaInput kIn = wgmma_input<T>();
    constexpr bool kFixed = kAccum == DqAccum::kFixed;
    const FlashBwdParams& p = hp.p;
    const int64_t d = p.x.d_qk, group = p.x.h_q / p.x.h_kv;  // dq, dk (p.x.d_v: dv; the inputs through their maps)
    const BackwardScores scores = BackwardScores::of(p.x.score);
    const int64_t hk = blockIdx.y, bi = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const BwdBarriers<kStages> bars(smem + Tr::kOffBars);
    setmaxnreg_inc<240>();
    int qt_begin, qt_end;
    bwd_tile_range<D>(smem, qt_begin, qt_end);
    const int c = warp / 4 - 1, w = warp % 4;
    const int key_off = Tr::key_offset(c), col_off = Tr::col_offset(c);
    const int64_t kw0 = int64_t(blockIdx.x) * Tr::kBlockN + key_off;  // the warpgroup's first key
    int64_t krow[2];
    krow[0] = kw0 + 16 * w + g;
    krow[1] = krow[0] + 8;
    const bool unmasked = mask_is_none(p.x.mask);
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr && p.x.mask.q_bounds != nullptr;
    const bool keys_in = kw0 + 64 <= p.x.s_k;  // every key of the warpgroup exists
    const bool wg_live = kw0 < p.x.s_k;
    const MaskEval mask{p.x.mask};
    // (The keys' bounds and positions are read again where a tile needs them: kept across the
    // loop they cost registers that dk and dv need.)

    const uint32_t k_base = smem_u32(smem) + uint32_t(key_off) * 128;
    const uint32_t v_base = smem_u32(smem + Tr::kOffV) + uint32_t(key_off) * 128;
    unsigned char* ds_tile = smem + Tr::kOffDs + c * Tr::kDsBytes;
    const uint32_t ds_base = smem_u32(ds_tile);
    // The warpgroup's own barrier (ids 1, 2): its 128 threads.
    const uint32_t wg_barrier = 1 + uint32_t(c);

    WgmmaAcc<kCols> dk, dv;
    RINGATTN_UNROLL
    for (int v = 0; v < kCols / 2; ++v) dk[v] = dv[v] = 0.0f;

    const int steps = int(group) * (qt_end - qt_begin);
    if (steps > 0) mbarrier_wait_parity_covered(bars.kv_full, 0);
    HopperBwdStep step{0, qt_begin};
    for (int i = 0; i < steps; ++i) {
        const int stage = i % kStages;
        const int64_t hq = hk * group + step.head, q0 = int64_t(step.qtile) * kM;
        const uint32_t q_base = smem_u32(smem + Tr::kOffStages + stage * 2 * Tr::kTileBytes);
        const uint32_t do_base = q_base + Tr::kTileBytes;
        // Fully visible to the warpgroup's keys (all inside the call): no mask.
        bool full = unmasked;
        if (classify && wg_live) {
            full = all_visible(p.x.mask, tile_query_bounds<kM>(p.x.mask, step.qtile, p.x.s_q),
                               tile_key_bounds<64>(p.x.mask, kw0 / 64, p.x.s_k));
        }
        full = full && keys_in && q0 + kM <= p.x.s_q;

        // The tile's lse and delta, copied with it (rows past the call hold another head's or
        // zeros: they are masked). Read as pairs from shared memory: 32 global loads per
        // thread would be hoisted by ptxas above the products, into the registers dk and dv
        // need.
        const int64_t st0 = (bi * p.x.h_q + hq) * p.x.s_q;
        const float* stats = reinterpret_cast<const float*>(smem + Tr::kOffStats + stage * Tr::kStatsBytes);
        mbarrier_wait_parity_covered(&bars.full[stage], uint32_t(i / kStages) & 1u);
        // S^T = K Q^T and dP^T = V dO^T.
        WgmmaAcc<kM> s, dp;
        wgmma_fence();
        RINGATTN_UNROLL
        for (int ks = 0; ks < D / 16; ++ks) {
            const WgmmaAccumulate acc = ks == 0 ? WgmmaAccumulate::kOverwrite : WgmmaAccumulate::kAdd;
            wgmma_ss<kIn, WgmmaMajor::kK, WgmmaMajor::kK>(s, kmajor_desc(k_base, Tr::kBlockN * 128, ks),
                                                          kmajor_desc(q_base, kM * 128, ks), acc);
            wgmma_ss<kIn, WgmmaMajor::kK, WgmmaMajor::kK>(dp, kmajor_desc(v_base, Tr::kBlockN * 128, ks),
                                                          kmajor_desc(do_base, kM * 128, ks), acc);
        }
        wgmma_commit_group();

        // While they run: the visibility of the fragments (element v: key row (v >> 1) & 1,
        // query column 8 (v >> 2) + 2t + (v & 1)), for tiles that are not fully visible.
        uint32_t vis = ~0u;
        if (!full) {
            vis = 0;
            int64_t kpos[2] = {0, 0};
            uint32_t kdoc[2] = {0u, 0u};
            if (!unmasked) row_positions(p.x.mask.k_pos, p.x.mask.k_doc, krow, p.x.s_k, kpos, kdoc);
            RINGATTN_UNROLL
            for (int j = 0; j < kM / 8; ++j) {
                RINGATTN_UNROLL
                for (int e = 0; e < 2; ++e) {
                    const int64_t qi = q0 + 8 * j + 2 * t + e;
                    if (qi >= p.x.s_q || smem_load(stats + 8 * j + 2 * t + e) == -INFINITY) continue;
                    const int64_t pq = unmasked ? 0 : gmem_load(p.x.mask.q_pos + qi);
                    const uint32_t qd = p.x.mask.q_doc != nullptr ? gmem_load(p.x.mask.q_doc + qi) : 0u;
                    RINGATTN_UNROLL
                    for (int r = 0; r < 2; ++r) {
                        const bool ok = krow[r] < p.x.s_k && (unmasked || mask.visible(pq, qd, kpos[r], kdoc[r]));
                        vis |= uint32_t(ok) << (4 * j + 2 * r + e);
                    }
                }
            }
        }
        wgmma_wait_group<0>(s, dp);

        // P^T in s, scale dS^T in dp (the softmax scale folded in once per score, so that
        // neither dk's epilogue nor dq's atomics multiply by it; the scores' slopes under a
        // soft-cap: score.cuh). Masked pairs (queries past the call among them) give 0
        // whatever their exponential.
        auto probabilities = [&](auto variant) {
            constexpr bool kCapped = decltype(variant)::value;
            RINGATTN_UNROLL
            for (int j = 0; j < kM / 8; ++j) {
                const F32x2 lse2 = smem_load(reinterpret_cast<const F32x2*>(stats + 8 * j + 2 * t));
                const F32x2 delta2 = smem_load(reinterpret_cast<const F32x2*>(stats + kM + 8 * j + 2 * t));
                RINGATTN_UNROLL
                for (int e = 0; e < 2; ++e) {
                    const float off = scores.template offset<kCapped>((e ? lse2.y : lse2.x) * 1.4426950408889634f);
                    const float delta = (e ? delta2.y : delta2.x) * p.x.score.scale;
                    RINGATTN_UNROLL
                    for (int r = 0; r < 2; ++r) {
                        const int v = 4 * j + 2 * r + e;
                        float slope;
                        const float pv = scores.template prob<kCapped>(scores.template prepare<kCapped>(s[v]), off, slope);
                        const float dsv = (pv * slope) * fmaf(dp[v], p.x.score.scale, -delta);
                        const bool keep = (vis >> v) & 1u;
                        s[v] = keep ? pv : 0.0f;
                        dp[v] = keep ? dsv : 0.0f;
                    }
                }
            }
        };
        // The soft-capped variant (score.cuh) behind one uniform branch per tile, except at class
        // 128, where it takes the consumer past its 168 registers (4 bytes spilled): the host runs
        // a soft-capped backward of that class on the FA2 family (src/kernels.rs
        // `geometry::backward_family`), and the consumer traps on one at its end.
        if constexpr (kHopperCappedAt<D>) {
            scores.dispatch(probabilities);
        } else {
            probabilities(ScoreVariant<false>{});
        }
        // The A fragments of P^T and dS^T (K-step ks of 16 queries, register r: elements 8 ks +
        // 2r and 8 ks + 2r + 1).
        uint32_t pa[kM / 16][4], sa[kM / 16][4];
        RINGATTN_UNROLL
        for (int v = 0; v < kM / 2; v += 2) {
            pa[v / 8][(v % 8) / 2] = pack2<T>(s[v], s[v + 1]);
            sa[v / 8][(v % 8) / 2] = pack2<T>(dp[v], dp[v + 1]);
        }
        // dS^T into the warpgroup's tile: key row kr = 16w + g + 8r is the tile's 128-byte row
        // kr, query pair 8j + 2t its 16-byte chunk j (swizzled: j ^ (kr mod 8)), word t. The
        // previous tile's dq products read it: every thread of the warpgroup is past their wait.
        // (Stored before dK's wgmma takes sa as its A: the registers of an in-flight wgmma's A
        // must not be accessed, reads included, until it is waited for.)
        named_barrier_sync(wg_barrier, 128);
        RINGATTN_UNROLL
        for (int v = 0; v < kM / 2; v += 2) {
            const int kr = 16 * w + g + 8 * ((v >> 1) & 1);
            uint32_t* at = reinterpret_cast<uint32_t*>(ds_tile + kr * 128 + (((v >> 2) ^ (kr & 7)) << 4)) + t;
            smem_store(at, sa[v / 8][(v % 8) / 2]);
        }
        fence_proxy_async();
        // dV += P^T dO and dK += dS^T Q over the warpgroup's columns (B MN-major).
        const uint32_t col_bytes = uint32_t(col_off / 64) * kM * 128;
        wgmma_fence();
        RINGATTN_UNROLL
        for (int ks = 0; ks < kM / 16; ++ks) {
            wgmma_rs<kIn, WgmmaMajor::kMN>(dv, pa[ks], mnmajor_desc(do_base + col_bytes, kM * 128, ks),
                                           WgmmaAccumulate::kAdd);
            wgmma_rs<kIn, WgmmaMajor::kMN>(dk, sa[ks], mnmajor_desc(q_base + col_bytes, kM * 128, ks),
                                           WgmmaAccumulate::kAdd);
        }
        wgmma_commit_group();
        // Every thread's dS^T is in (for dq's products below).
        named_barrier_sync(wg_barrier, 128);
        // dV and dK's products (the last readers of the stage, and of the A registers) are
        // done: the stage goes back to the producer, and P^T and dS^T's registers are free for
        // dq's accumulator.
        wgmma_wait_group<0>(dk, dv);
        mbarrier_arrive(&bars.empty[stage]);

        // dq (64 queries x the warpgroup's columns) += dS K over its 64 keys, 64 columns at a
        // time: A = dS (MN-major: the tile's rows are keys), B = K's rows of the warpgroup.
        float unit[2] = {1.0f, 1.0f};
        int64_t qrow[2];
        qrow[0] = q0 + 16 * w + g;
        qrow[1] = qrow[0] + 8;
        if constexpr (kFixed) {
            RINGATTN_UNROLL
            for (int r = 0; r < 2; ++r) unit[r] = qrow[r] < p.x.s_q ? gmem_load(p.dq_unit + st0 + qrow[r]) : 0.0f;
        }
        const bool whole = q0 + kM <= p.x.s_q && d == D;
        // This thread's two dq rows at column 2t (the elements are constant offsets from them).
        float* dq_row[2];
        RINGATTN_UNROLL
        for (int r = 0; r < 2; ++r) dq_row[r] = p.dq + ((bi * p.x.s_q + qrow[r]) * p.x.h_q + hq) * d + 2 * t;
        RINGATTN_UNROLL
        for (int chunk = 0; chunk < kCols / 64; ++chunk) {
            const int col0 = col_off + 64 * chunk;
            WgmmaAcc<64> dq;
            wgmma_fence();
            RINGATTN_UNROLL
            for (int ks = 0; ks < 64 / 16; ++ks) {
                wgmma_ss<kIn, WgmmaMajor::kMN, WgmmaMajor::kMN>(
                    dq, mnmajor_desc(ds_base, kM * 128, ks),
                    mnmajor_desc(k_base + uint32_t(col0 / 64) * Tr::kBlockN * 128, Tr::kBlockN * 128, ks),
                    ks == 0 ? WgmmaAccumulate::kOverwrite : WgmmaAccumulate::kAdd);
            }
            wgmma_commit_group();
            wgmma_wait_group<0>(dq);
            // One atomic per element: element v is query row (v >> 1) & 1, column col0 + 8 (v >>
            // 2) + 2t + (v & 1). In fixed point the term in its row's unit (exact: a power of
            // two) rounded to an integer, added with an integer atomic (associative: the order
            // of the blocks does not matter).
            RINGATTN_UNROLL
            for (int v = 0; v < 32; ++v) {
                const int r = (v >> 1) & 1;
                const int64_t col = col0 + 8 * (v >> 2) + 2 * t + (v & 1);
                if (!whole && (qrow[r] >= p.x.s_q || col >= d || dq[v] == 0.0f)) continue;
                float* at = dq_row[r] + (col0 + 8 * (v >> 2) + (v & 1));
                if constexpr (kFixed) {
                    atomicAdd(reinterpret_cast<int*>(at), __float2int_rn(dq[v] * unit[r]));
                } else {
                    atomicAdd(at, dq[v]);
                }
            }
        }
        step = step.qtile + 1 < qt_end ? HopperBwdStep{step.head, step.qtile + 1} : HopperBwdStep{step.head + 1, qt_begin};
    }

    // Epilogue: dk (scale dS^T Q already) and dv (the sum of prob()'s values, times
    // prob_unscale(): score.cuh), f32, written; keys past the call and columns past d_qk (dk) or
    // d_v (dv) are not.
    const float dv_unscale = scores.prob_unscale();
    RINGATTN_UNROLL
    for (int v = 0; v < kCols / 2; v += 2) {
        const int r = (v >> 1) & 1;
        const int64_t col = col_off + 8 * (v >> 2) + 2 * t;
        if (krow[r] >= p.x.s_k) continue;
        const int64_t row = (bi * p.x.s_k + krow[r]) * p.x.h_kv + hk;
        if (col < d) {
            gmem_store(p.dk + row * d + col, dk[v]);
            gmem_store(p.dk + row * d + col + 1, dk[v + 1]);
        }
        if (col < p.x.d_v) {
            gmem_store(p.dv + row * p.x.d_v + col, dv[v] * dv_unscale);
            gmem_store(p.dv + row * p.x.d_v + col + 1, dv[v + 1] * dv_unscale);
        }
    }
    if constexpr (!kHopperCappedAt<D>) {
        if (scores.capped()) RINGATTN_HOPPER_CAPPED_MISSING();
    }
}

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RINGATTN_BWD_HOPPER_BODY(TY, D, ACCUM) flash_bwd_hopper<TY, D, DqAccum::ACCUM>(p);
#else
#define RINGATTN_BWD_HOPPER_BODY(TY, D, ACCUM) __trap();
#endif
#define RINGATTN_BWD_HOPPER_ENTRY(TY, NAME, D, KIND, ACCUM)                                                \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                    \
        ringattn_hopper_flash_bwd_##KIND##_##NAME##_d##D(const __grid_constant__ FlashBwdHopperParams p) { \
        RINGATTN_BWD_HOPPER_BODY(TY, D, ACCUM)                                                              \
    }
#define RINGATTN_BWD_HOPPER_ENTRIES(D)                                                                    \
    RINGATTN_BWD_HOPPER_ENTRY(Bf16, bf16, D, dkdvqfx, kFixed) RINGATTN_BWD_HOPPER_ENTRY(F16, f16, D, dkdvqfx, kFixed) \
    RINGATTN_BWD_HOPPER_ENTRY(Bf16, bf16, D, dkdvq, kF32) RINGATTN_BWD_HOPPER_ENTRY(F16, f16, D, dkdvq, kF32)
RINGATTN_BWD_HOPPER_ENTRIES(64)
RINGATTN_BWD_HOPPER_ENTRIES(128)
RINGATTN_BWD_HOPPER_ENTRIES(256)
