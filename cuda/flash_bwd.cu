// Flash attention backward on tensor cores (FlashAttention-2 style), for one block of keys
// given the final o and lse of the queries:
//   p_ij = exp(scale q_i.k_j - lse_i) for visible pairs, 0 otherwise;
//   delta_i = sum_c d_o[i][c] o[i][c];   ds_ij = p_ij (d_o_i.v_j - delta_i);
//   dv_j = sum_i p_ij d_o_i;   dk_j = scale sum_i ds_ij q_i;   dq_i = scale sum_j ds_ij k_j.
// The kernels (src/kernels.rs `geometry::backward` picks and launches them):
//   ringattn_flash_bwd_rowsum_{bf16,f16}        one thread per (b, h_q, i): delta;
//   ringattn_flash_bwd_dkdv{,qfx,q}_{bf16,f16}_d{D}  a block per 64 key rows (4 warps x 16)
//       and column range, streaming the query tiles of every query head of its GQA group in a
//       fixed order: S^T = K Q^T and dP^T = V dO^T, then dv += P^T dO and dk += dS^T Q; the
//       qfx and q variants also add dq += dS K for the block's 64 keys (dS^T through shared
//       memory: one atomic add per dq element per key block), in fixed point (qfx) or with
//       f32 atomics (q);
//   (the tensor-core kernels also as _d{D}_dv and _d192_v128: V, dO and dV of their own head
//   dim, in tiles of the class D or of their own class 128, dk/dv then unsplit)
//   ringattn_flash_bwd_dq_{bf16,f16}_d{D}       a block per 64 query rows (4 warps x 16),
//       streaming K/V tiles: S = Q K^T and dP = dO V^T on mma.sync, P and dS on the
//       fragments, dq += dS K with dS reused from registers and K by ldmatrix.trans;
//   ringattn_flash_bwd_kvbound_{bf16,f16}       a warp per key row: kv_bound = (max |k_jc|,
//       max ||v_j||) per (b, h_kv) by unsigned atomicMax on the f32 bits (into zeros);
//   ringattn_flash_bwd_rowunit_{bf16,f16}       one thread per (b, h_q, i): dq_unit;
//   ringattn_flash_bwd_dqconvert_{bf16,f16}     a warp per dq row: fixed point to f32, in place.
// The deterministic backward (the default, bit-identical run to run): up to head-dim class
// 128, kvbound, rowunit, dkdvqfx and dqconvert — S and dP once per pair, five products; from
// 192, where the dk/dv kernel with dq must split its columns (so computes S and dP twice
// anyway), dq beside dkdv: seven products either way, and the pair issues fewer instructions
// per HMMA (docs/kernel-budget.md). The atomic mode: dkdvq at every class.
// Fixed-point dq: every term of row i is bounded, |scale ds_ij k_jc| <= p_ij r_i with
//   r_i = |scale| max|k| (||d_o_i|| max||v|| + |delta_i|),
// and sum_j p_ij <= 1 (lse covers the whole key set), so |dq_ic| <= r_i. With the unit
// 2^(ceil(log2 r_i) - 29) (dq_unit holds its inverse), each 64-key sum of the block's dq
// product is taken in units of its row (times a power of two: exact), rounded to an integer
// and added with an integer atomic. Integer addition is associative, so dq is bit-identical
// whatever order the blocks run in; it stays below 2^29 (1 + rounding) + (key blocks) / 2 <
// 2^31 in magnitude, and its error below (key blocks) / 2 units, i.e. 2^-30 r_i per key
// block: finer than f32 accumulation's. A non-finite r_i gives a NaN unit and a NaN dq row.
// Masked calls bound both loops from the granule bounds (MaskParams k_bounds, q_bounds):
// the dq kernel visits the key tiles and the dk/dv kernel the query tiles that a row of the
// block may see; tiles fully visible to a warp run without the mask, fully masked ones are
// skipped (flash.cuh TileClass). P and dS (times the softmax scale in the dk/dv kernel) are
// rounded to the input type as mma operands.
// Launch: rowsum and rowunit grid ceil(b h_q s_q / 256) x 256 threads; kvbound and
// dqconvert a warp per row, min(ceil(rows / 8), 4096) x 256; dq grid (ceil(s_q / 64), h_q,
// b) x 128, DqTraits<D>::kSmem; dkdv* grid (ceil(s_k / 64) kSplits, h_kv, b) x 128,
// DkDvTraits<D, kAccum>::kSmem.
#include "flash.cuh"


// delta_i = sum_c d_o[i][c] o[i][c], one thread per row.
template <typename T>
__device__ void flash_bwd_rowsum(const FlashBwdParams& p) {
    const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // index of [b, h_q, s_q]
    if (row >= p.x.b * p.x.h_q * p.x.s_q) return;
    const int64_t i = row % p.x.s_q, hq = (row / p.x.s_q) % p.x.h_q, bi = row / (p.x.s_q * p.x.h_q);
    const int64_t base = ((bi * p.x.s_q + i) * p.x.h_q + hq) * p.x.d_v;
    float acc = 0.0f;
    for (int64_t c = 0; c < p.x.d_v; ++c) acc += T::to_float(gmem_load(p.d_o + base + c)) * gmem_load(p.o + base + c);
    gmem_store(p.delta + row, acc);
}

// kv_bound[2 (b h_kv + hk)] = max_{j,c} |k_jc| and [.. + 1] = max_j ||v_j|| over the call's
// keys of head hk, a warp per key row. Non-negative f32 values order as their bits (and NaN
// above +inf, so a NaN propagates): unsigned atomicMax into the caller's zeros.
template <typename T>
__device__ void flash_bwd_kvbound(const FlashBwdParams& p) {
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), rows = p.x.b * p.x.s_k * p.x.h_kv;
    for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
        float kmax = 0.0f, v2 = 0.0f;
        for (int64_t c = lane; c < p.x.d_qk; c += 32) {
            const float kc = fabsf(T::to_float(gmem_load(p.x.k + r * p.x.d_qk + c)));
            kmax = kc > kmax || kc != kc ? kc : kmax;
        }
        for (int64_t c = lane; c < p.x.d_v; c += 32) {
            const float vc = T::to_float(gmem_load(p.x.v + r * p.x.d_v + c));
            v2 = fmaf(vc, vc, v2);
        }
        RINGATTN_UNROLL
        for (int o = 16; o > 0; o /= 2) {
            const float ko = __shfl_xor_sync(0xffffffffu, kmax, o);
            kmax = ko > kmax || ko != ko ? ko : kmax;
            v2 += __shfl_xor_sync(0xffffffffu, v2, o);
        }
        if (lane == 0) {
            const int64_t hk = r % p.x.h_kv, bi = r / (p.x.s_k * p.x.h_kv);
            unsigned* slot = reinterpret_cast<unsigned*>(p.kv_bound + 2 * (bi * p.x.h_kv + hk));
            atomicMax(slot, __float_as_uint(kmax));
            atomicMax(slot + 1, __float_as_uint(sqrtf(v2)));
        }
    }
}

// dq_unit[(b, h_q, i)] = 2^(29 - ceil(log2 r_i)), r_i = scale max|k| (||d_o_i|| max||v|| +
// |delta_i|) (the header's bound on |dq_ic|): 1 where r_i = 0 (the row's dq terms are zero),
// 2^127 below 2^-98, NaN where r_i is not finite. One thread per row.
template <typename T>
__device__ void flash_bwd_rowunit(const FlashBwdParams& p) {
    const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // index of [b, h_q, s_q]
    if (row >= p.x.b * p.x.h_q * p.x.s_q) return;
    const int64_t i = row % p.x.s_q, hq = (row / p.x.s_q) % p.x.h_q, bi = row / (p.x.s_q * p.x.h_q);
    const int64_t hk = hq / (p.x.h_q / p.x.h_kv);
    const int64_t base = ((bi * p.x.s_q + i) * p.x.h_q + hq) * p.x.d_v;
    float n2 = 0.0f;
    for (int64_t c = 0; c < p.x.d_v; ++c) {
        const float x = T::to_float(gmem_load(p.d_o + base + c));
        n2 = fmaf(x, x, n2);
    }
    const float kmax = gmem_load(p.kv_bound + 2 * (bi * p.x.h_kv + hk));
    const float vmax = gmem_load(p.kv_bound + 2 * (bi * p.x.h_kv + hk) + 1);
    const float r = fabsf(p.x.score.scale) * kmax * fmaf(sqrtf(n2), vmax, fabsf(gmem_load(p.delta + row)));
    float unit = 1.0f;
    if (!(r < INFINITY)) {
        unit = NAN;  // NaN or +inf
    } else if (r > 0.0f) {
        int e = 0;
        frexpf(r, &e);  // r < 2^e
        unit = __uint_as_float(unsigned(127 + (e < -98 ? 127 : 29 - e)) << 23);
    }
    gmem_store(p.dq_unit + row, unit);
}

// Fixed-point dq (int32 words in the f32 buffer) to f32 in place: dq_ic / dq_unit_i (exact
// division by a power of two; NaN where the unit is NaN). A warp per row of [b, s_q, h_q].
__device__ void flash_bwd_dqconvert(const FlashBwdParams& p) {
    const int lane = threadIdx.x % 32;
    const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), rows = p.x.b * p.x.s_q * p.x.h_q;
    for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
        const int64_t hq = r % p.x.h_q, i = (r / p.x.h_q) % p.x.s_q, bi = r / (p.x.h_q * p.x.s_q);
        const float unit = gmem_load(p.dq_unit + (bi * p.x.h_q + hq) * p.x.s_q + i);
        for (int64_t c = lane; c < p.x.d_qk; c += 32) {
            float* at = p.dq + r * p.x.d_qk + c;
            gmem_store(at, float(int(__float_as_uint(gmem_load(at)))) / unit);
        }
    }
}

// kOwnDv (here and in the dk/dv kernel): V, dO and dV of their own head dim p.x.d_v (the entry
// points ..._d{D}_dv); otherwise p.x.d_qk serves every tensor and p.x.d_v is not read.
template <typename T, int D, int DV, bool kOwnDv, bool kCapped>
__device__ void flash_bwd_dq_tc(const FlashBwdParams& p) {
    static_assert(kOwnDv || DV == D, "V of its own class only with its own head dim");
    using Tr = DqTraits<D, DV>;
    using VG = typename Tr::VG;
    constexpr int kN = Tr::kBlockN, kNT = kN / 8, kDT = D / 8, S = Tr::kStride, W = Tr::kSwizzle;
    constexpr int SV = VG::kStride;
    static_assert(D >= 192, "the dq kernel serves the deterministic backward from head-dim class 192");
    // Rolled (the largest heads: shorter live ranges), but for the pairs: unrolled.
    constexpr int kUnrollK = DV < D ? D / 16 : 1;
    const int64_t d = p.x.d_qk;                                     // q, k, dq
    auto d_v = [&]() -> int64_t { return kOwnDv ? p.x.d_v : d; };  // v, d_o
    const BackwardScores scores = BackwardScores::of(p.x.score);
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.x.h_q / p.x.h_kv);
    const int64_t q0 = int64_t(blockIdx.x) * Tr::kBlockM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
    uint16_t* dos = qs + Tr::kBlockM * S;       // [kBlockM][SV]
    uint16_t* ks = dos + Tr::kBlockM * SV;      // [kStages][kN][S]
    uint16_t* vs = ks + Tr::kStages * kN * S;   // [kStages][kN][SV]
    RowBounds* bounds_slot = reinterpret_cast<RowBounds*>(smem + Tr::kSmemBoundsOffset) + warp;

    stage_swizzled<Tr::kBlockM, Tr::kChunks, S, W, Tr::kThreads>(qs, p.x.q, bi, p.x.s_q, p.x.h_q, hq, d, q0);
    stage_swizzled<Tr::kBlockM, VG::kChunks, SV, VG::kSwizzle, Tr::kThreads>(dos, p.d_o, bi, p.x.s_q, p.x.h_q, hq, d_v(),
                                                                          q0);
    cp_async_commit();
    // Tile indices fit in 32 bits: s_k < 2^31 kN (2^35 keys and more hold terabytes).
    const int64_t ntiles = (p.x.s_k + kN - 1) / kN;

    // This thread's two query rows (g and g + 8 of the warp's 16), recomputed where needed.
    auto thread_rows = [&](int64_t (&row)[2]) {
        row[0] = q0 + warp * 16 + g;
        row[1] = row[0] + 8;
    };
    float lse2[2], delta[2];
    {
        int64_t row[2];
        thread_rows(row);
        for (int r = 0; r < 2; ++r) {
            const bool in = row[r] < p.x.s_q;
            const int64_t i = in ? row[r] : p.x.s_q - 1;
            const int64_t st = (bi * p.x.h_q + hq) * p.x.s_q + i;
            lse2[r] = in ? gmem_load(p.lse + st) * 1.4426950408889634f : -INFINITY;
            delta[r] = in ? gmem_load(p.delta + st) : 0.0f;
        }
    }
    // No window and no documents: every existing pair is visible, no position is read.
    const bool unmasked = mask_is_none(p.x.mask);
    // Masked calls classify tiles from the keys' granule bounds and bound the loop to the
    // tiles the block may see, as the forward does (the K buffer, not staged yet, is
    // scratch); the warp's query bounds wait in shared memory, the rows' positions are read
    // again on masked tiles (registers are what the accumulators need).
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr;
    int64_t range_begin = 0, range_end = ntiles;
    if (classify) {
        int64_t row[2], qpos[2];
        uint32_t qdoc[2];
        thread_rows(row);
        row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
        const RowBounds warp_rows = warp_row_bounds(qpos, qdoc);
        if (lane == 0) smem_store(bounds_slot, warp_rows);
        if (ntiles > 0) {
            block_tile_range<Tr::kWarps, Tr::kThreads, kN>(p.x.mask, warp_rows, p.x.s_k, ntiles,
                                                           reinterpret_cast<int64_t*>(ks), range_begin, range_end);
        }
    }
    const int t_begin = int(range_begin), t_end = int(range_end);
    const bool rows_in = q0 + warp * 16 + 16 <= p.x.s_q;  // every row of the warp exists

    // K/V tiles t_begin, t_begin + 1, ... in turn.
    auto stager = kv_stager<kOwnDv, kN, TileGeom<D>, Tr::kThreads, VG>(p.x, bi, hk, d, t_begin);
    auto stage_kv = [&](int buf) { stager.stage_next(ks + buf * kN * S, vs + buf * kN * SV); };

    // Fragment rows (flash.cuh SwzRow): Q and dO rows (k chunks 2kk, 2kk + 1), K and V rows
    // for S and dP, K rows for dq += dS K (column chunks 2j, 2j + 1, by ldmatrix.trans).
    const SwzRow<S, W> qrow(warp * 16 + lane % 16, lane / 16);
    const SwzRow<SV, VG::kSwizzle> dorow(warp * 16 + lane % 16, lane / 16);
    const SwzRow<S, W> krow((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<SV, VG::kSwizzle> vrow((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<S, W> ktrow((lane / 8) % 2 * 8 + lane % 8, lane / 16);

    float acc[kDT][4];
    RINGATTN_UNROLL
    for (int n = 0; n < kDT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    // The pairs stage the first K/V tile before the loop (as the dk/dv kernel).
    constexpr bool kFirstBefore = DV != D && Tr::kStages == 2;
    if (kFirstBefore && t_begin < t_end) stage_kv(0);
    for (int tile = t_begin; tile < t_end; ++tile) {
        const int buf = Tr::kStages == 2 ? (tile - t_begin) & 1 : 0;
        if (Tr::kStages == 2) {
            if (!kFirstBefore && tile == t_begin) stage_kv(0);
            cp_async_commit();
            if (tile + 1 < t_end) stage_kv(buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            stage_kv(0);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t* kt = ks + buf * kN * S;
        const uint16_t* vt = vs + buf * kN * SV;
        const int64_t k0 = int64_t(tile) * kN;
        // Warp-uniform: a tile fully visible to the warp's 16 rows (all inside the call) runs
        // without the mask; a fully masked one is skipped; else the mask per score.
        const bool in_range = rows_in && k0 + kN <= p.x.s_k;
        const TileClass cls =
            classify ? classify_tile<kN>(p.x.mask, smem_load(bounds_slot), tile, p.x.s_k) : TileClass{unmasked, false};
        uint32_t vis = 0;
        // One copy of the tile's code (a second one, specialised for masked tiles, costs the
        // registers the accumulators need): `masked` branches around the mask's selects.
        auto run_tile = [&](bool masked) {
            float s[kNT][4], dp[kNT][4];
            RINGATTN_UNROLL
            for (int n = 0; n < kNT; ++n) {
                RINGATTN_UNROLL
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            }
            // S = Q K^T over D / 16 steps, dP = dO V^T over DV / 16 (the first ones).
            RINGATTN_UNROLL_BY(kUnrollK)
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4];
                ldmatrix_x4(a, qs + qrow.at(kk));
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; n += 2) {
                    uint32_t b[4];
                    ldmatrix_x4(b, kt + krow.at(kk) + n * 8 * S);
                    mma_16816<T>(s[n], a, b);
                    mma_16816<T>(s[n + 1], a, b + 2);
                }
                if (DV == D || kk < DV / 16) {
                    uint32_t ad[4];
                    ldmatrix_x4(ad, dos + dorow.at(kk));
                    RINGATTN_UNROLL
                    for (int n = 0; n < kNT; n += 2) {
                        uint32_t bv[4];
                        ldmatrix_x4(bv, vt + vrow.at(kk) + n * 8 * SV);
                        mma_16816<T>(dp[n], ad, bv);
                        mma_16816<T>(dp[n + 1], ad, bv + 2);
                    }
                }
            }
            // dS = P (dP - delta) (times the scores' slopes under a soft-cap: score.cuh), in place
            // of s; masked scores give 0.
            {
                if constexpr (kCapped) {
                    RINGATTN_UNROLL
                    for (int n = 0; n < kNT; ++n) {
                        RINGATTN_UNROLL
                        for (int e = 0; e < 4; ++e) s[n][e] = scores.template prepare<kCapped>(s[n][e]);
                    }
                }
                const float off[2] = {scores.template offset<kCapped>(lse2[0]), scores.template offset<kCapped>(lse2[1])};
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) {
                        float slope;
                        const float pv = scores.template prob<kCapped>(s[n][e], off[e / 2], slope);
                        s[n][e] = (pv * slope) * (dp[n][e] - delta[e / 2]);
                    }
                }
            }
            if (masked) {
                RINGATTN_UNROLL
                for (int n = 0; n < kNT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) {
                        if (!(vis >> (4 * n + e) & 1u)) s[n][e] = 0.0f;
                    }
                }
            }
            // dq += dS K: dS from registers, K [key][d] by ldmatrix.trans.
            RINGATTN_UNROLL
            for (int kk = 0; kk < kN / 16; ++kk) {
                const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                       pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                RINGATTN_UNROLL
                for (int n = 0; n < kDT; n += 2) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, kt + ktrow.at(n / 2) + kk * 16 * S);
                    mma_16816<T>(acc[n], a, b);
                    mma_16816<T>(acc[n + 1], a, b + 2);
                }
            }
        };
        bool go = in_range && cls.full, masked = false;
        if (!go && !cls.empty) {
            int64_t row[2], qpos[2] = {};
            uint32_t qdoc[2] = {};
            thread_rows(row);
            if (!unmasked) row_positions(p.x.mask.q_pos, p.x.mask.q_doc, row, p.x.s_q, qpos, qdoc);
            const bool row_ok[2] = {lse2[0] != -INFINITY, lse2[1] != -INFINITY};
            vis = query_row_visibility<kNT>(p.x.mask, unmasked, row_ok, qpos, qdoc, k0, p.x.s_k, t);
            masked = true;
            go = __ballot_sync(0xffffffffu, vis != 0) != 0;
        }
        if (go) run_tile(masked);
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    cp_async_wait<0>();
#if RINGATTN_STAGED_EPILOGUE
    // dq = scale acc through shared memory (Q, dO and the K/V buffers, free once every warp is
    // past the loop), each row leaving in 16-byte stores.
    __syncthreads();
    constexpr int kStageStride = StageStride<D>::value;
    static_assert(Tr::kWarps * 16 * kStageStride * 4 <= Tr::kSmemBoundsOffset, "the dq rows fit where the tiles were");
    float* stage = reinterpret_cast<float*>(smem) + warp * 16 * kStageStride;
    const float scale2[2] = {p.x.score.scale, p.x.score.scale};
    stage_fragments<1, kDT, kStageStride>(stage, reinterpret_cast<const float(&)[1][kDT][4]>(acc), scale2);
    __syncthreads();  // (a warp reads only its own rows; the block barrier is what the emulator's race check sees)
    const int64_t w0 = q0 + warp * 16;
    store_staged_rows<T, 16, D, kStageStride>(
        stage, d,
        [&](int r) { return w0 + r < p.x.s_q ? ((bi * p.x.s_q + w0 + r) * p.x.h_q + hq) * d : int64_t(-1); }, p.dq,
        static_cast<uint16_t*>(nullptr));
#else
    int64_t row[2];
    thread_rows(row);
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        if (row[r] >= p.x.s_q) continue;
        float* out = p.dq + ((bi * p.x.s_q + row[r]) * p.x.h_q + hq) * d;
        RINGATTN_UNROLL
        for (int n = 0; n < kDT; ++n) {
            const int64_t c = n * 8 + 2 * t;
            if (c < d) {
                gmem_store(out + c, acc[n][2 * r] * p.x.score.scale);
                gmem_store(out + c + 1, acc[n][2 * r + 1] * p.x.score.scale);
            }
        }
    }
#endif
}

// The soft-capped variant of the dk/dv kernels (score.cuh) on sm_100 and later: its S^T/dP^T
// loop rolled (unrolled, it spills 8 to 56 bytes at d64 beside the plain variant), and none at
// class 128, where it spills whatever its unrolling (the plain kernel holds 254-255 registers
// there): the host refuses the soft-cap for the FA2 backward of that class on those
// architectures (src/kernels.rs `geometry::capped_backward`), and the entry point traps
// rather than run it without the cap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define RINGATTN_CAPPED_ROLLED true
#define RINGATTN_CAPPED_AT(D) ((D) != 128)
#define RINGATTN_CAPPED_MISSING() __trap()
#else
#define RINGATTN_CAPPED_ROLLED false
#define RINGATTN_CAPPED_AT(D) true
#define RINGATTN_CAPPED_MISSING() ((void)0)  // the emulator has every variant
#endif

// The dk/dv kernel's S^T/dP^T loop at d128: unrolled by RINGATTN_DKDV_UNROLL_D128 of its 8
// steps — all of them since the tile code exists once (no spills on sm_80 ... sm_120; 5.9 ->
// 5.1 instructions per HMMA on sm_90a, no inner loop); override with -D to experiment.
#ifndef RINGATTN_DKDV_UNROLL_D128
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define RINGATTN_DKDV_UNROLL_D128 4  // sm_100 and later: fully unrolled, ptxas spills 8 bytes
#else
#define RINGATTN_DKDV_UNROLL_D128 8
#endif
#endif

template <typename T, int D, int DV, DqAccum kAccum, bool kOwnDv, bool kCapped>
__device__ void flash_bwd_dkdv_tc(const FlashBwdParams& p) {
    static_assert(kOwnDv || DV == D, "V of its own class only with its own head dim");
    using Tr = DkDvTraits<D, kAccum, DV>;
    using VG = typename Tr::VG;
    constexpr bool kFixed = kAccum == DqAccum::kFixed, kWithDq = Tr::kWithDq;
    constexpr int kM = Tr::kBlockM, kMT = kM / 8, kOT = Tr::kDOut / 8, S = Tr::kStride, W = Tr::kSwizzle;
    constexpr int kVT = Tr::kDvOut / 8, SV = VG::kStride, WV = VG::kSwizzle;  // dv's n-tiles, V's and dO's tiles
    // Rolled for the largest heads (shorter live ranges), but for the pairs; at d128 by
    // RINGATTN_DKDV_UNROLL_D128. The soft-capped variant rolled on sm_100 and later, where
    // unrolled it spills (24 to 56 bytes at d64 and d128, beside the plain variant in the same
    // entry point).
    constexpr int kUnrollK = kCapped && RINGATTN_CAPPED_ROLLED ? 1
                             : DV < D                      ? D / 16
                             : D >= 192 || D == 96         ? 1
                             : D == 128                    ? RINGATTN_DKDV_UNROLL_D128
                                                           : D / 16;
    const int64_t d = p.x.d_qk, group = p.x.h_q / p.x.h_kv;           // q, k, dq, dk
    auto d_v = [&]() -> int64_t { return kOwnDv ? p.x.d_v : d; };  // v, d_o, dv
    const BackwardScores scores = BackwardScores::of(p.x.score);
    const int64_t hk = blockIdx.y, bi = blockIdx.z;
    const int split = int(blockIdx.x % Tr::kSplits);
    const int64_t k0 = int64_t(blockIdx.x / Tr::kSplits) * Tr::kBlockN;
    const int c0 = split * (Tr::kDOut / 8);  // first chunk of this block's column range
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    uint16_t* ks = reinterpret_cast<uint16_t*>(smem);
    uint16_t* vs = ks + Tr::kBlockN * S;  // [kBlockN][SV]
    unsigned char* stages = smem + Tr::kSmemK + Tr::kSmemV;
    auto q_tile = [&](int buf) { return reinterpret_cast<uint16_t*>(stages + buf * Tr::kSmemStage); };
    auto do_tile = [&](int buf) { return q_tile(buf) + kM * S; };  // [kM][SV]
    auto offset_tile = [&](int buf) {
        return reinterpret_cast<float*>(stages + buf * Tr::kSmemStage + kM * (Tr::kRowBytes + VG::kRowBytes));
    };
    auto delta_tile = [&](int buf) { return offset_tile(buf) + kM; };
    auto unit_tile = [&](int buf) { return offset_tile(buf) + 2 * kM; };

    // This thread's two key rows (g and g + 8 of the warp's 16), their positions and
    // documents: held across the loop, but for the pairs (their accumulators take 176
    // registers), which read them again where the mask needs them.
    constexpr bool kHoldKeys = DV == D;
    const int64_t krow[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
    int64_t held_kpos[2] = {};
    uint32_t held_kdoc[2] = {};
    if (kHoldKeys) row_positions(p.x.mask.k_pos, p.x.mask.k_doc, krow, p.x.s_k, held_kpos, held_kdoc);
    auto key_positions = [&](int64_t (&kpos)[2], uint32_t (&kdoc)[2]) {
        if constexpr (kHoldKeys) {
            kpos[0] = held_kpos[0], kpos[1] = held_kpos[1], kdoc[0] = held_kdoc[0], kdoc[1] = held_kdoc[1];
        } else {
            row_positions(p.x.mask.k_pos, p.x.mask.k_doc, krow, p.x.s_k, kpos, kdoc);
        }
    };
    const MaskEval mask{p.x.mask};
    // No window and no documents: every existing pair is visible, no position is read.
    const bool unmasked = mask_is_none(p.x.mask);

    // Masked calls classify each query tile from the queries' granule bounds against the
    // warp's 16 keys (fully visible: unmasked; fully masked: skipped; else the mask per
    // score) and bound the loop to the query tiles any key of the block may see: a causal
    // block starts at its diagonal, a window stops at its right edge. The stage buffers (not
    // staged yet) are scratch.
    // The warp's key bounds are kept for head dims up to 32 and recomputed per tile from
    // kpos/kdoc (live anyway) above: d64 and d128 sit at the register limit (sm_90a spills).
    const bool classify = !unmasked && p.x.mask.k_bounds != nullptr && p.x.mask.q_bounds != nullptr;
    constexpr bool kKeepBounds = D <= 32;
    auto key_bounds = [&] {
        int64_t kpos[2];
        uint32_t kdoc[2];
        key_positions(kpos, kdoc);
        return warp_row_bounds(kpos, kdoc);
    };
    const RowBounds kept_keys = kKeepBounds && classify ? key_bounds() : RowBounds{0, 0, 0u, 0u};
    auto warp_keys = [&] { return kKeepBounds ? kept_keys : key_bounds(); };
    const int64_t qtiles = (p.x.s_q + kM - 1) / kM;
    int64_t qt_begin = 0, qt_end = qtiles;
    if (classify && qtiles > 0) {
        block_tile_range<Tr::kWarps, Tr::kThreads, kM, BlockRows::Keys>(
            p.x.mask, warp_keys(), p.x.s_q, qtiles, reinterpret_cast<int64_t*>(stages), qt_begin, qt_end);
    }

    stage_swizzled<Tr::kBlockN, Tr::kChunks, S, W, Tr::kThreads>(ks, p.x.k, bi, p.x.s_k, p.x.h_kv, hk, d, k0);
    stage_swizzled<Tr::kBlockN, VG::kChunks, SV, WV, Tr::kThreads>(vs, p.x.v, bi, p.x.s_k, p.x.h_kv, hk, d_v(), k0);
    cp_async_commit();
    // Step `it` covers query head hk * group + it / nq and query tile qt_begin + it % nq,
    // advanced step by step: a division per tile (64-bit: a subroutine call; 32-bit: about 50
    // instructions) costs more than the tile's bookkeeping. (32-bit: heads and tiles fit.)
    const int64_t nq = qt_end - qt_begin, steps = group * nq;
    struct Step {
        int head, qtile;  // head within the GQA group, query tile
    };
    const int qt_first = int(qt_begin), qt_last = int(qt_end) - 1;
    auto advance = [&](Step x) { return x.qtile < qt_last ? Step{x.head, x.qtile + 1} : Step{x.head + 1, qt_first}; };
    // (The pair with dq, at 255 registers, re-reads the thread index in each stage.)
    constexpr bool kReread = DV != D && kWithDq;
    auto stage_q = [&](int buf, Step x) {
        const int64_t hq = hk * group + x.head, q0 = int64_t(x.qtile) * kM;
        stage_swizzled<kM, Tr::kChunks, S, W, Tr::kThreads, true, kReread>(q_tile(buf), p.x.q, bi, p.x.s_q, p.x.h_q,
                                                                           hq, d, q0);
        stage_swizzled<kM, VG::kChunks, SV, WV, Tr::kThreads, true, kReread>(do_tile(buf), p.d_o, bi, p.x.s_q,
                                                                             p.x.h_q, hq, d_v(), q0);
        for (int r = threadIdx.x; r < kM; r += Tr::kThreads) {
            const bool in = q0 + r < p.x.s_q;
            const int64_t st = (bi * p.x.h_q + hq) * p.x.s_q + (in ? q0 + r : 0);
            // The queries' exponent offsets (score.cuh; -lse2 for plain scores), once per query.
            const float lse2 = in ? gmem_load(p.lse + st) * 1.4426950408889634f : -INFINITY;
            smem_store(offset_tile(buf) + r, scores.template offset<kCapped>(lse2));
            smem_store(delta_tile(buf) + r, in ? gmem_load(p.delta + st) * p.x.score.scale : 0.0f);  // scale delta
            if (kFixed) smem_store(unit_tile(buf) + r, in ? gmem_load(p.dq_unit + st) : 0.0f);
        }
    };

    // dq: dS^T (the block's 64 keys x the query tile) in shared memory, each warp its 16 key
    // rows; then dq (query tile x D) += scale dS K over all 64 keys, the warps splitting the
    // (16-row tile, 8-column n-tile) pairs, dS by ldmatrix.trans from its key-major rows and K
    // by ldmatrix.trans: one atomic add per dq element per key block (not one per warp).
    uint16_t* ds_s = reinterpret_cast<uint16_t*>(stages + Tr::kStages * Tr::kSmemStage);
    int* ran = reinterpret_cast<int*>(ds_s + Tr::kBlockN * Tr::kDsStride);
    auto store_ds = [&](const float (&ds)[kMT][4]) {
        RINGATTN_UNROLL
        for (int n = 0; n < kMT; ++n) {
            uint32_t* row = reinterpret_cast<uint32_t*>(ds_s + (warp * 16 + g) * Tr::kDsStride + n * 8 + 2 * t);
            smem_store(row, pack2<T>(ds[n][0], ds[n][1]));
            smem_store(row + 4 * Tr::kDsStride, pack2<T>(ds[n][2], ds[n][3]));  // key row g + 8
        }
    };
    // One dq term of a row whose unit is `unit`: an f32 atomic add, or in fixed point the term
    // in the row's units (times a power of two: exact, the same bits as scaling dS before its
    // rounding) rounded to an integer and added to the word with an integer atomic
    // (associative: the order of the blocks does not matter).
    auto red_dq = [&](float* at, float x, float unit) {
        if constexpr (kFixed) {
            atomicAdd(reinterpret_cast<int*>(at), __float2int_rn(x * unit));
        } else {
            (void)unit;
            atomicAdd(at, x);
        }
    };
    auto block_dq_as = [&](int64_t hq, int64_t q0, const float* units, auto whole_tile, bool whole_rt) {
        constexpr bool whole = decltype(whole_tile)::value;
        constexpr int kRT = kM / 16, kNTD = D / 8, kJ = kNTD / Tr::kWarps;
        static_assert(!kWithDq || kNTD % Tr::kWarps == 0, "the warps share the dq tile's n-tiles evenly");
        // This warp's pieces: n-tiles warp + 4 j of every 16-row tile rt, in chunks of up to 4
        // n-tiles that share the A (dS) fragment of each key step.
        // Rows of whole groups of 8 chunks (class 192: 24 n-tiles, six per warp): pairs, so
        // that every K fragment below starts at an even j (one offset register, see kfrag).
        constexpr bool kGroupedRows = (S / 8) % 8 == 0 && ((S / 8) & (S / 8 - 1)) != 0 && W == 7;
        constexpr int kChunk = kJ <= 4 ? kJ : kJ % 4 == 0 ? 4 : kGroupedRows && kJ % 2 == 0 ? 2 : 3;
        static_assert(!kWithDq || kJ % kChunk == 0, "whole chunks");
        // A whole tile (every row inside the call, d the class) adds without per-element tests
        // (adding 0 changes nothing; a test and branch per element cost more than the add),
        // from one pointer per row (rows g and g + 8 of each 16-row tile) and this thread's
        // first column: the warp's n-tiles are constant offsets from it.
        const int64_t row_step = p.x.h_q * d;
        float* dq_rows = p.dq + ((bi * p.x.s_q + q0 + g) * p.x.h_q + hq) * d + warp * 8 + 2 * t;
        // Rows g and g + 8 of 16-row tile rt: their units (fixed point).
        auto row_unit = [&](int rt, int half) {
            return kFixed ? smem_load(units + rt * 16 + g + 8 * half) : 1.0f;
        };
        // Pieces (rt, n-tile warp + 4 j).
        auto add = [&](const float (&c)[4], int rt, int j) {
            const int n = warp + Tr::kWarps * j;
            const float u[2] = {row_unit(rt, 0), row_unit(rt, 1)};
            if (whole || whole_rt) {
                float* lo = dq_rows + (rt * 16) * row_step;
                float* hi = lo + 8 * row_step;
                red_dq(lo + Tr::kWarps * 8 * j, c[0], u[0]);
                red_dq(lo + Tr::kWarps * 8 * j + 1, c[1], u[0]);
                red_dq(hi + Tr::kWarps * 8 * j, c[2], u[1]);
                red_dq(hi + Tr::kWarps * 8 * j + 1, c[3], u[1]);
                return;
            }
            RINGATTN_UNROLL
            for (int e = 0; e < 4; ++e) {
                const int64_t i = q0 + rt * 16 + g + 8 * (e / 2);
                const int64_t col = int64_t(n) * 8 + 2 * t + (e & 1);
                if (i < p.x.s_q && col < d && c[e] != 0.0f) {
                    red_dq(p.dq + ((bi * p.x.s_q + i) * p.x.h_q + hq) * d + col, c[e], u[e / 2]);
                }
            }
        };
        // K fragment rows kk*16 + lane % 16 at n-tile warp + 4 (j + lane / 16) (lanes 16.. address
        // the second n-tile of an x4 load; x2 loads ignore them). Where a row holds a power of
        // two of chunks and every pair starts at an even j, the swizzled chunk is one XOR of a
        // per-thread constant: (warp | 4 m) ^ s = (warp ^ s) ^ 4 m, and 4 (j + h) = 4 j ^ 4 h.
        // In rows of whole groups of 8 chunks (class 192) with j even, chunk warp + 4 (j + h)
        // is chunk (warp | 4 h) of group j / 2, swizzled inside it: the same constant plus 32 j.
        constexpr bool kXorB = ((S / 8) & (S / 8 - 1)) == 0 && (kChunk % 2 == 0 || kChunk == kJ);
        constexpr bool kGroupB = kGroupedRows && kChunk % 2 == 0;
        const int kb = (lane % 16) * S + ((warp ^ (lane & W) ^ (4 * (lane / 16))) << 3);
        auto kfrag = [&](int kk, int j) {
            const uint16_t* row = ks + kk * 16 * S;
            if constexpr (kXorB) {
                row += kb ^ (32 * j);
            } else if constexpr (kGroupB) {
                row += kb + 32 * j;
            } else {
                row += swz<S, W>(lane % 16, warp + Tr::kWarps * (j + lane / 16));
            }
            return row;
        };
        // dS fragment rows: queries rt*16.. x keys kk*16.., from its key-major rows (transposed).
        auto ds_frag = [&](int kk, int rt) {
            return ds_s + (kk * 16 + (lane / 16) * 8 + lane % 8) * Tr::kDsStride + rt * 16 + (lane / 8) % 2 * 8;
        };
        if constexpr (kJ == 1 && kRT > 1) {
            // One n-tile per warp: its K fragment of each key step serves every row tile.
            float c[kRT][4] = {};
            RINGATTN_UNROLL
            for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
                uint32_t b[2];
                ldmatrix_x2_trans(b, kfrag(kk, 0));
                RINGATTN_UNROLL
                for (int rt = 0; rt < kRT; ++rt) {
                    uint32_t a[4];
                    ldmatrix_x4_trans(a, ds_frag(kk, rt));
                    mma_16816<T>(c[rt], a, b);
                }
            }
            RINGATTN_UNROLL
            for (int rt = 0; rt < kRT; ++rt) add(c[rt], rt, 0);
            return;
        }
        RINGATTN_UNROLL
        for (int rt = 0; rt < kRT; ++rt) {
            RINGATTN_UNROLL
            for (int j0 = 0; j0 < kJ; j0 += kChunk) {
                float c[kChunk][4] = {};
                RINGATTN_UNROLL
                for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
                    uint32_t a[4];
                    ldmatrix_x4_trans(a, ds_frag(kk, rt));
                    RINGATTN_UNROLL
                    for (int jj = 0; jj < kChunk; jj += 2) {
                        if (jj + 1 < kChunk) {  // two n-tiles in one ldmatrix: lanes 16.. address the second
                            uint32_t b[4];
                            ldmatrix_x4_trans(b, kfrag(kk, j0 + jj));
                            mma_16816<T>(c[jj], a, b);
                            mma_16816<T>(c[jj + 1], a, b + 2);
                        } else {
                            uint32_t b[2];
                            ldmatrix_x2_trans(b, kfrag(kk, j0 + jj));
                            mma_16816<T>(c[jj], a, b);
                        }
                    }
                }
                RINGATTN_UNROLL
                for (int jj = 0; jj < kChunk; ++jj) add(c[jj], rt, j0 + jj);
            }
        }
    };
    // Up to class 128 one branch per tile between two copies of the product (a whole tile's
    // without tests); above, one copy that branches per add (sm_120 spilled d256 with two).
    auto block_dq = [&](int64_t hq, int64_t q0, const float* units) {
        const bool whole_tile = q0 + kM <= p.x.s_q && d == D;
        if constexpr (D <= 128) {
            if (whole_tile) {
                block_dq_as(hq, q0, units, std::true_type{}, true);
                return;
            }
        }
        block_dq_as(hq, q0, units, std::false_type{}, whole_tile);
    };

    // The pairs' fragment rows (flash.cuh SwzRow): K and V rows as S^T's and dP^T's A operands,
    // Q and dO rows as their B operands and (transposed) as dv's and dk's.
    const SwzRow<S, W> krow_a(warp * 16 + lane % 16, lane / 16), qrow_b((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<SV, WV> vrow_a(warp * 16 + lane % 16, lane / 16), dorow_b((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    const SwzRow<S, W> qrow_t((lane / 8) % 2 * 8 + lane % 8, lane / 16);
    const SwzRow<SV, WV> dorow_t((lane / 8) % 2 * 8 + lane % 8, lane / 16);
    static_assert(DV == D || Tr::kSplits == 1, "the pairs run unsplit");

    float dk[kOT][4], dv[kVT][4];
    RINGATTN_UNROLL
    for (int n = 0; n < kOT; ++n) {
        RINGATTN_UNROLL
        for (int e = 0; e < 4; ++e) dk[n][e] = 0.0f;
    }
    RINGATTN_UNROLL
    for (int n = 0; n < kVT; ++n) {
        RINGATTN_UNROLL
        for (int e = 0; e < 4; ++e) dv[n][e] = 0.0f;
    }

    Step step{0, qt_first};
    // The pairs stage the first query tile before the loop (its code then is no branch of the
    // loop's), but for the one with dq on sm_100 and later (there ptxas then spills 8 bytes);
    // the others in the loop's first step (moving it shifts ptxas's allocation of kernels at
    // 254-255 registers).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    constexpr bool kFirstBefore = DV != D && !kWithDq && Tr::kStages == 2;
#else
    constexpr bool kFirstBefore = DV != D && Tr::kStages == 2;
#endif
    if (kFirstBefore && steps > 0) stage_q(0, step);
    for (int64_t it = 0; it < steps; ++it) {
        const int buf = Tr::kStages == 2 ? int(it & 1) : 0;
        const Step next = advance(step);
        if (Tr::kStages == 2) {
            if (!kFirstBefore && it == 0) stage_q(0, step);
            cp_async_commit();
            if (it + 1 < steps) stage_q(buf ^ 1, next);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            stage_q(0, step);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t* qt = q_tile(buf);
        const uint16_t* dot = do_tile(buf);
        const float* lt = offset_tile(buf);
        const float* dt = delta_tile(buf);
        const int64_t qtile = step.qtile, hq = hk * group + step.head, q0 = qtile * kM;
        // Warp-uniform: a query tile fully visible to the warp's 16 keys (all inside the call)
        // runs without the mask (kFull: its queries see a key, so their lse is finite); a fully
        // masked one is skipped; else the mask per score.
        const bool in_range = k0 + warp * 16 + 16 <= p.x.s_k && q0 + kM <= p.x.s_q;
        const TileClass cls =
            classify ? classify_query_tile<kM>(p.x.mask, warp_keys(), qtile, p.x.s_q) : TileClass{unmasked, false};
        uint32_t vis = 0;
        // One copy of the tile's code (a second one, specialised for fully visible tiles, costs
        // the registers the accumulators need): `masked` branches around the mask's selects.
        auto run_tile = [&](bool masked) {
            float s[kMT][4], dp[kMT][4];
            RINGATTN_UNROLL
            for (int n = 0; n < kMT; ++n) {
                RINGATTN_UNROLL
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            }
            // S^T = K Q^T (kS, over D / 16 steps) and dP^T = V dO^T (kDp, over DV / 16: the
            // first ones), in one loop when both.
            auto products = [&](auto with_s, auto with_dp) {
                constexpr bool kS = decltype(with_s)::value, kDp = decltype(with_dp)::value;
                RINGATTN_UNROLL_BY(kUnrollK)
                for (int kk = 0; kk < (kS ? D : DV) / 16; ++kk) {
                    const bool dp_step = kDp && (DV == D || kk < DV / 16);
                    uint32_t a[4], av[4];
                    if constexpr (DV != D) {  // (the pairs: fragment offsets from SwzRow's few registers)
                        if constexpr (kS) ldmatrix_x4(a, ks + krow_a.at(kk));
                        if (dp_step) ldmatrix_x4(av, vs + vrow_a.at(kk));
                    } else {
                        if constexpr (kS) ldmatrix_x4(a, ks + swz<S, W>(warp * 16 + lane % 16, 2 * kk + lane / 16));
                        if (dp_step) ldmatrix_x4(av, vs + swz<SV, WV>(warp * 16 + lane % 16, 2 * kk + lane / 16));
                    }
                    RINGATTN_UNROLL
                    for (int n = 0; n < kMT; n += 2) {
                        uint32_t b[4], bd[4];
                        const int r = n * 8 + (lane / 16) * 8 + lane % 8, c = 2 * kk + (lane / 8) % 2;
                        if constexpr (DV != D) {
                            if constexpr (kS) ldmatrix_x4(b, qt + qrow_b.at(kk) + n * 8 * S);
                            if (dp_step) ldmatrix_x4(bd, dot + dorow_b.at(kk) + n * 8 * SV);
                        } else {
                            if constexpr (kS) ldmatrix_x4(b, qt + swz<S, W>(r, c));
                            if (dp_step) ldmatrix_x4(bd, dot + swz<SV, WV>(r, c));
                        }
                        if constexpr (kS) {
                            mma_16816<T>(s[n], a, b);
                            mma_16816<T>(s[n + 1], a, b + 2);
                        }
                        if (dp_step) {
                            mma_16816<T>(dp[n], av, bd);
                            mma_16816<T>(dp[n + 1], av, bd + 2);
                        }
                    }
                }
            };
            // P^T in s, scale dS^T in dp (the softmax scale folded in here, once per score, so
            // that neither dk's epilogue nor dq's atomic adds multiply by it); the columns' exponent offsets
            // and scale delta as pairs (columns 2t, 2t + 1). Under a soft-cap (score.cuh) S^T is
            // prepared before dP^T exists (its registers free for the tanh), and dS^T takes the
            // scores' slopes.
            {
                if constexpr (kCapped) {
                    products(ScoreVariant<true>{}, ScoreVariant<false>{});
                    RINGATTN_UNROLL
                    for (int n = 0; n < kMT; ++n) {
                        RINGATTN_UNROLL
                        for (int e = 0; e < 4; ++e) s[n][e] = scores.template prepare<kCapped>(s[n][e]);
                    }
                    products(ScoreVariant<false>{}, ScoreVariant<true>{});
                } else {
                    products(ScoreVariant<true>{}, ScoreVariant<true>{});
                }
                RINGATTN_UNROLL
                for (int n = 0; n < kMT; ++n) {
                    const F32x2 l2 = smem_load(reinterpret_cast<const F32x2*>(lt + n * 8 + 2 * t));
                    const F32x2 d2 = smem_load(reinterpret_cast<const F32x2*>(dt + n * 8 + 2 * t));
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) {
                        const float off_c = (e & 1) ? l2.y : l2.x, delta_c = (e & 1) ? d2.y : d2.x;
                        float slope;
                        const float pv = scores.template prob<kCapped>(s[n][e], off_c, slope);
                        dp[n][e] = (pv * slope) * fmaf(dp[n][e], p.x.score.scale, -delta_c);
                        s[n][e] = pv;
                    }
                }
            }
            // Masked pairs (whatever their exponential gave: a query past the call has lse -inf)
            // contribute nothing.
            if (masked) {
                RINGATTN_UNROLL
                for (int n = 0; n < kMT; ++n) {
                    RINGATTN_UNROLL
                    for (int e = 0; e < 4; ++e) {
                        if (!(vis >> (4 * n + e) & 1u)) s[n][e] = dp[n][e] = 0.0f;
                    }
                }
            }
            // dv += P^T dO and dk += dS^T Q over this block's columns; dO and Q by ldmatrix.trans.
            RINGATTN_UNROLL
            for (int kk = 0; kk < kM / 16; ++kk) {
                const uint32_t ap[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                        pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                const uint32_t as[4] = {pack2<T>(dp[2 * kk][0], dp[2 * kk][1]), pack2<T>(dp[2 * kk][2], dp[2 * kk][3]),
                                        pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                        pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
                RINGATTN_UNROLL
                for (int n = 0; n < (kOT > kVT ? kOT : kVT); n += 2) {
                    uint32_t bd[4], bq[4];
                    const int r = kk * 16 + (lane / 8) % 2 * 8 + lane % 8, c = c0 + n + lane / 16;
                    if constexpr (DV == D) {
                        ldmatrix_x4_trans(bd, dot + swz<S, W>(r, c));
                        ldmatrix_x4_trans(bq, qt + swz<S, W>(r, c));
                        mma_16816<T>(dv[n], ap, bd);
                        mma_16816<T>(dv[n + 1], ap, bd + 2);
                        mma_16816<T>(dk[n], as, bq);
                        mma_16816<T>(dk[n + 1], as, bq + 2);
                    } else {
                        // dv's n-tiles are dk's first ones (c0 = 0: the pairs run unsplit).
                        (void)r, (void)c;
                        if (n < kVT) {
                            ldmatrix_x4_trans(bd, dot + dorow_t.at(n / 2) + kk * 16 * SV);
                            mma_16816<T>(dv[n], ap, bd);
                            mma_16816<T>(dv[n + 1], ap, bd + 2);
                        }
                        ldmatrix_x4_trans(bq, qt + qrow_t.at(n / 2) + kk * 16 * S);
                        mma_16816<T>(dk[n], as, bq);
                        mma_16816<T>(dk[n + 1], as, bq + 2);
                    }
                }
            }
            // This warp's dS^T rows (rounded as mma operands) into shared memory for the block's
            // dq product below.
            if (kWithDq && split == 0) store_ds(dp);
        };
        // Fully visible tiles without the mask's selects, the others with them: one call site.
        bool go = in_range && cls.full, masked = false;
        {
            if (!go && !cls.empty) {
                // Visibility of S^T fragments: rows are keys, columns queries.
                int64_t kpos[2];
                uint32_t kdoc[2];
                key_positions(kpos, kdoc);
                RINGATTN_UNROLL
                for (int n = 0; n < kMT; ++n) {
                    RINGATTN_UNROLL
                    for (int c = 0; c < 2; ++c) {
                        const int col = n * 8 + 2 * t + c;
                        const int64_t i = q0 + col;
                        if (i >= p.x.s_q || smem_load(lt + col) == INFINITY) continue;  // (lse -inf)
                        const int64_t pq = unmasked ? 0 : gmem_load(p.x.mask.q_pos + i);
                        const uint32_t qd = p.x.mask.q_doc != nullptr ? gmem_load(p.x.mask.q_doc + i) : 0;
                        RINGATTN_UNROLL
                        for (int r = 0; r < 2; ++r) {
                            const bool ok = krow[r] < p.x.s_k && (unmasked || mask.visible(pq, qd, kpos[r], kdoc[r]));
                            vis |= uint32_t(ok) << (4 * n + 2 * r + c);
                        }
                    }
                }
                masked = true;
                go = __ballot_sync(0xffffffffu, vis != 0) != 0;
            }
            if (go) run_tile(masked);
        }
        if (kWithDq && split == 0) {
            if (!go) {  // a skipped warp's keys add nothing
                const float zero[kMT][4] = {};
                store_ds(zero);
            }
            if (lane == 0) smem_store(ran + warp, int(go));
            __syncthreads();  // the block's dS^T is in
            // Only when a warp ran the tile (the block's 64 keys see one of its queries).
            bool any = false;
            RINGATTN_UNROLL
            for (int w = 0; w < Tr::kWarps; ++w) any = any || smem_load(ran + w) != 0;
            if (any) block_dq(hq, q0, unit_tile(buf));
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
        step = next;
    }
    cp_async_wait<0>();
#if RINGATTN_STAGED_EPILOGUE
    // dk (the accumulator, scaled already) and dv through shared memory (the tiles are free
    // once every warp is past the loop), one after the other, each row leaving in 16-byte stores.
    constexpr int kStageStride = StageStride<Tr::kDOut>::value;
    static_assert(Tr::kWarps * 16 * kStageStride * 4 <= Tr::kSmem, "a warp's dk or dv rows fit where the tiles were");
    float* stage = reinterpret_cast<float*>(smem) + warp * 16 * kStageStride;
    const int64_t col0 = int64_t(c0) * 8, w0 = k0 + warp * 16;
    // Offsets of the key rows in dk (`dh` = d_qk) or dv (d_v).
    auto key_rows = [&](int64_t dh) {
        return [&, dh](int r) {
            return w0 + r < p.x.s_k ? ((bi * p.x.s_k + w0 + r) * p.x.h_kv + hk) * dh + col0 : int64_t(-1);
        };
    };
    const float one2[2] = {1.0f, 1.0f};  // (dk holds scale dS^T Q already)
    // dv summed prob()'s values: kProbScale P (score.cuh).
    constexpr float kDvUnscale = 1.0f / BackwardScores::kProbScale<kCapped>;
    const float dv_unscale2[2] = {kDvUnscale, kDvUnscale};
    __syncthreads();
    stage_fragments<1, kOT, kStageStride>(stage, reinterpret_cast<const float(&)[1][kOT][4]>(dk), one2);
    __syncthreads();  // (a warp reads only its own rows; the block barrier is what the emulator's race check sees)
    store_staged_rows<T, 16, Tr::kDOut, kStageStride>(stage, d - col0, key_rows(d), p.dk,
                                                      static_cast<uint16_t*>(nullptr));
    __syncthreads();
    stage_fragments<1, kVT, kStageStride>(stage, reinterpret_cast<const float(&)[1][kVT][4]>(dv), dv_unscale2);
    __syncthreads();
    store_staged_rows<T, 16, Tr::kDvOut, kStageStride>(stage, d_v() - col0, key_rows(d_v()), p.dv,
                                                       static_cast<uint16_t*>(nullptr));
#else
    RINGATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
        if (krow[r] >= p.x.s_k) continue;
        const int64_t row = (bi * p.x.s_k + krow[r]) * p.x.h_kv + hk;
        RINGATTN_UNROLL
        for (int n = 0; n < kOT; ++n) {
            const int64_t c = int64_t(c0 + n) * 8 + 2 * t;
            if (c < d) {
                gmem_store(p.dk + row * d + c, dk[n][2 * r]);
                gmem_store(p.dk + row * d + c + 1, dk[n][2 * r + 1]);
            }
            if (n < kVT && c < d_v()) {
                constexpr float kDvUnscale = 1.0f / BackwardScores::kProbScale<kCapped>;  // (score.cuh)
                gmem_store(p.dv + row * d_v() + c, dv[n < kVT ? n : 0][2 * r] * kDvUnscale);
                gmem_store(p.dv + row * d_v() + c + 1, dv[n < kVT ? n : 0][2 * r + 1] * kDvUnscale);
            }
        }
    }
#endif
}

extern "C" __global__ void ringattn_flash_bwd_rowsum_bf16(FlashBwdParams p) { flash_bwd_rowsum<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_rowsum_f16(FlashBwdParams p) { flash_bwd_rowsum<F16>(p); }

extern "C" __global__ void ringattn_flash_bwd_kvbound_bf16(FlashBwdParams p) { flash_bwd_kvbound<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_kvbound_f16(FlashBwdParams p) { flash_bwd_kvbound<F16>(p); }
extern "C" __global__ void ringattn_flash_bwd_rowunit_bf16(FlashBwdParams p) { flash_bwd_rowunit<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_rowunit_f16(FlashBwdParams p) { flash_bwd_rowunit<F16>(p); }
// (One conversion, named per input type like its neighbours.)
extern "C" __global__ void ringattn_flash_bwd_dqconvert_bf16(FlashBwdParams p) { flash_bwd_dqconvert(p); }
extern "C" __global__ void ringattn_flash_bwd_dqconvert_f16(FlashBwdParams p) { flash_bwd_dqconvert(p); }

// Each backward kernel in two variants behind one entry point, chosen once per launch: plain
// scores, or soft-capped ones (score.cuh) — each its own code, so that neither perturbs the
// other's registers (the plain kernels sit at 255 registers on several architectures, where a
// per-tile branch between the two tips ptxas into spills).
template <typename T, int D, int DV, DqAccum kAccum, bool kOwnDv>
__device__ __forceinline__ void flash_bwd_dkdv(const FlashBwdParams& p) {
    if constexpr (RINGATTN_CAPPED_AT(D)) {
        if (BackwardScores::of(p.x.score).capped()) {
            flash_bwd_dkdv_tc<T, D, DV, kAccum, kOwnDv, true>(p);
        } else {
            flash_bwd_dkdv_tc<T, D, DV, kAccum, kOwnDv, false>(p);
        }
    } else {
        // No soft-capped variant here (refused on the host): a launch with a cap fails rather
        // than return gradients without it (checked after the plain kernel, which a branch
        // around it would push past 255 registers).
        flash_bwd_dkdv_tc<T, D, DV, kAccum, kOwnDv, false>(p);
        if (BackwardScores::of(p.x.score).capped()) RINGATTN_CAPPED_MISSING();
    }
}
template <typename T, int D, int DV, bool kOwnDv>
__device__ __forceinline__ void flash_bwd_dq(const FlashBwdParams& p) {
    if (BackwardScores::of(p.x.score).capped()) {
        flash_bwd_dq_tc<T, D, DV, kOwnDv, true>(p);
    } else {
        flash_bwd_dq_tc<T, D, DV, kOwnDv, false>(p);
    }
}

// Which kernels each head-dim class has (src/kernels.rs `geometry::backward` launches them):
// the deterministic backward runs the fused fixed-point dkdvqfx up to class 128 (five
// products) and from 192 the dq kernel beside dkdv (the fused kernel splits the columns there,
// seven products either way, and the pair issues fewer instructions per HMMA); the atomic
// mode runs dkdvq at every class. dkdv[q[fx]]: `__launch_bounds__(128, 1)` with dq (one block
// per SM is enough; with (128) alone ptxas holds it at 168 registers and spills). dq: (128, 2):
// with (128) alone ptxas aims at 3 blocks per SM (168 registers) and spills 16 bytes at d64.
// OWN_DV: the kernels of V, dO and dV of their own head dim (suffix _dv, V in tiles of the
// class D; src/kernels.rs `geometry::OWN_DV_CLASSES`), or in tiles of their own class DV
// (suffix _v{DV}; `geometry::HEAD_DIM_PAIRS`).
#define RINGATTN_BWD_ATOMIC(TY, NAME, D, DV, OWN_DV, SFX)                                                 \
    extern "C" __global__ void __launch_bounds__(128, 1)                                                  \
        ringattn_flash_bwd_dkdvq_##NAME##_d##D##SFX(FlashBwdParams p) {                                   \
        flash_bwd_dkdv<TY, D, DV, DqAccum::kF32, OWN_DV>(p);                                               \
    }
#define RINGATTN_BWD_FIXED(TY, NAME, D, DV, OWN_DV, SFX)                                                  \
    extern "C" __global__ void __launch_bounds__(128, 1)                                                  \
        ringattn_flash_bwd_dkdvqfx_##NAME##_d##D##SFX(FlashBwdParams p) {                                 \
        flash_bwd_dkdv<TY, D, DV, DqAccum::kFixed, OWN_DV>(p);                                             \
    }
#define RINGATTN_BWD_SEPARATE(TY, NAME, D, DV, OWN_DV, SFX)                                                              \
    extern "C" __global__ void __launch_bounds__(128, 2) ringattn_flash_bwd_dq_##NAME##_d##D##SFX(FlashBwdParams p) { \
        flash_bwd_dq<TY, D, DV, OWN_DV>(p);                                                                              \
    }                                                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) ringattn_flash_bwd_dkdv_##NAME##_d##D##SFX(FlashBwdParams p) { \
        flash_bwd_dkdv<TY, D, DV, DqAccum::kNone, OWN_DV>(p);                                                            \
    }
#define RINGATTN_BWD_BOTH(KIND, D) \
    RINGATTN_BWD_##KIND(Bf16, bf16, D, D, false, ) RINGATTN_BWD_##KIND(F16, f16, D, D, false, )
#define RINGATTN_BWD_BOTH_DV(KIND, D) \
    RINGATTN_BWD_##KIND(Bf16, bf16, D, D, true, _dv) RINGATTN_BWD_##KIND(F16, f16, D, D, true, _dv)
#define RINGATTN_BWD_BOTH_PAIR(KIND, D, DV) \
    RINGATTN_BWD_##KIND(Bf16, bf16, D, DV, true, _v##DV) RINGATTN_BWD_##KIND(F16, f16, D, DV, true, _v##DV)
RINGATTN_BWD_BOTH(ATOMIC, 32)
RINGATTN_BWD_BOTH(ATOMIC, 64)
RINGATTN_BWD_BOTH(ATOMIC, 96)
RINGATTN_BWD_BOTH(ATOMIC, 128)
RINGATTN_BWD_BOTH(ATOMIC, 192)
RINGATTN_BWD_BOTH(ATOMIC, 256)
RINGATTN_BWD_BOTH(FIXED, 32)
RINGATTN_BWD_BOTH(FIXED, 64)
RINGATTN_BWD_BOTH(FIXED, 96)
RINGATTN_BWD_BOTH(FIXED, 128)
RINGATTN_BWD_BOTH(SEPARATE, 192)
RINGATTN_BWD_BOTH(SEPARATE, 256)
RINGATTN_BWD_BOTH_DV(ATOMIC, 96)
RINGATTN_BWD_BOTH_DV(ATOMIC, 192)
RINGATTN_BWD_BOTH_DV(ATOMIC, 256)
RINGATTN_BWD_BOTH_DV(FIXED, 96)
RINGATTN_BWD_BOTH_DV(SEPARATE, 192)
RINGATTN_BWD_BOTH_DV(SEPARATE, 256)
RINGATTN_BWD_BOTH_PAIR(ATOMIC, 192, 128)
RINGATTN_BWD_BOTH_PAIR(SEPARATE, 192, 128)
