// Flash attention backward (first generation: simple tiled, no tensor cores), for one block
// of keys given the final o and lse of the queries:
//   p_ij = exp(scale q_i.k_j - lse_i) for visible pairs, 0 otherwise;
//   delta_i = sum_c d_o[i][c] o[i][c];   ds_ij = p_ij (d_o_i.v_j - delta_i);
//   dv_j = sum_i p_ij d_o_i;   dk_j = scale sum_i ds_ij q_i;   dq_i = scale sum_j ds_ij k_j.
// Three kernels, none with atomics, so the gradients are bit-identical run to run:
//   ringattn_flash_bwd_rowsum_* one thread per (b, h_q, i): delta;
//   ringattn_flash_bwd_dq_*     one thread per query row, looping over key tiles;
//   ringattn_flash_bwd_dkdv_*   one thread per key row, looping over the query heads of its
//                               GQA group and over query tiles in a fixed order.
// Launch (src/kernels.rs `geometry`):
//   rowsum: grid ceil(b h_q s_q / 256), block 256, no shared memory;
//   dq:     grid (ceil(s_q / rows), h_q, b), block rows, flash_rows_bytes(rows, d, 3) +
//           flash_tiles_bytes(d);
//   dkdv:   grid (ceil(s_k / rows), h_kv, b), block rows, flash_rows_bytes(rows, d, 4) +
//           flash_tiles_bytes(d) + 2 kTile f32.
#include "flash.cuh"

// delta_i = sum_c d_o[i][c] o[i][c], one thread per row.
template <typename T>
__device__ void flash_bwd_rowsum(const FlashBwdParams& p) {
    const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // index of [b, h_q, s_q]
    if (row >= p.b * p.h_q * p.s_q) return;
    const int64_t i = row % p.s_q, hq = (row / p.s_q) % p.h_q, bi = row / (p.s_q * p.h_q);
    const int64_t base = ((bi * p.s_q + i) * p.h_q + hq) * p.d;
    float acc = 0.0f;
    for (int64_t c = 0; c < p.d; ++c) acc += T::to_float(gmem_load(p.d_o + base + c)) * gmem_load(p.o + base + c);
    gmem_store(p.delta + row, acc);
}

template <typename T>
__device__ void flash_bwd_dq(const FlashBwdParams& p) {
    const int64_t rows = blockDim.x, d = p.d, ld = d + 1;
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.h_q / p.h_kv);
    const int64_t i = int64_t(blockIdx.x) * rows + threadIdx.x;
    const bool active = i < p.s_q;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    float* qs = reinterpret_cast<float*>(smem) + threadIdx.x * ld;
    float* dos = reinterpret_cast<float*>(smem) + (rows + threadIdx.x) * ld;
    float* dqs = reinterpret_cast<float*>(smem) + (2 * rows + threadIdx.x) * ld;
    uint16_t* kt = reinterpret_cast<uint16_t*>(smem + flash_rows_bytes(rows, d, 3));
    uint16_t* vt = kt + kTile * d;

    const int64_t base = ((bi * p.s_q + (active ? i : 0)) * p.h_q + hq) * d;
    for (int64_t c = 0; c < d; ++c) {
        smem_store(qs + c, active ? T::to_float(gmem_load(p.q + base + c)) * p.scale_log2 : 0.0f);
        smem_store(dos + c, active ? T::to_float(gmem_load(p.d_o + base + c)) : 0.0f);
        smem_store(dqs + c, 0.0f);
    }
    const int64_t stat = (bi * p.h_q + hq) * p.s_q + (active ? i : 0);
    const float lse = active ? gmem_load(p.lse + stat) : -INFINITY;
    const float lse2 = lse * 1.4426950408889634f;
    const float delta = active ? gmem_load(p.delta + stat) : 0.0f;
    for (int64_t k0 = 0; k0 < p.s_k; k0 += kTile) {
        flash_stage_tile(kt, p.k, bi, p.s_k, p.h_kv, hk, d, k0);
        flash_stage_tile(vt, p.v, bi, p.s_k, p.h_kv, hk, d, k0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (active && lse != -INFINITY) {
            float s[kTile], dp[kTile];
RINGATTN_UNROLL
            for (int j = 0; j < kTile; ++j) s[j] = dp[j] = 0.0f;
            for (int64_t c = 0; c < d; ++c) {
                const float qc = smem_load(qs + c), doc = smem_load(dos + c);
RINGATTN_UNROLL
                for (int j = 0; j < kTile; ++j) {
                    s[j] += qc * T::to_float(smem_load(kt + j * d + c));
                    dp[j] += doc * T::to_float(smem_load(vt + j * d + c));
                }
            }
            uint32_t visible = 0;
RINGATTN_UNROLL
            for (int j = 0; j < kTile; ++j) {
                const bool vis = k0 + j < p.s_k && flash_visible(p.mask, i, k0 + j);
                visible |= uint32_t(vis) << j;
                s[j] = vis ? ex2_approx(s[j] - lse2) * (dp[j] - delta) : 0.0f;  // ds
            }
            if (visible != 0) {
                for (int64_t c = 0; c < d; ++c) {
                    float acc = smem_load(dqs + c);
RINGATTN_UNROLL
                    for (int j = 0; j < kTile; ++j) {
                        if (visible >> j & 1u) acc += s[j] * T::to_float(smem_load(kt + j * d + c));
                    }
                    smem_store(dqs + c, acc);
                }
            }
        }
        __syncthreads();
    }
    if (active) {
        for (int64_t c = 0; c < d; ++c) gmem_store(p.dq + base + c, smem_load(dqs + c) * p.scale);
    }
}

template <typename T>
__device__ void flash_bwd_dkdv(const FlashBwdParams& p) {
    const int64_t rows = blockDim.x, d = p.d, ld = d + 1, group = p.h_q / p.h_kv;
    const int64_t hk = blockIdx.y, bi = blockIdx.z;
    const int64_t j = int64_t(blockIdx.x) * rows + threadIdx.x;
    const bool active = j < p.s_k;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    float* ks = reinterpret_cast<float*>(smem) + threadIdx.x * ld;
    float* vs = reinterpret_cast<float*>(smem) + (rows + threadIdx.x) * ld;
    float* dks = reinterpret_cast<float*>(smem) + (2 * rows + threadIdx.x) * ld;
    float* dvs = reinterpret_cast<float*>(smem) + (3 * rows + threadIdx.x) * ld;
    uint16_t* qt = reinterpret_cast<uint16_t*>(smem + flash_rows_bytes(rows, d, 4));
    uint16_t* dot = qt + kTile * d;
    float* lse2t = reinterpret_cast<float*>(smem + flash_rows_bytes(rows, d, 4) + flash_tiles_bytes(d));
    float* deltat = lse2t + kTile;

    const int64_t base = ((bi * p.s_k + (active ? j : 0)) * p.h_kv + hk) * d;
    for (int64_t c = 0; c < d; ++c) {
        smem_store(ks + c, active ? T::to_float(gmem_load(p.k + base + c)) * p.scale_log2 : 0.0f);
        smem_store(vs + c, active ? T::to_float(gmem_load(p.v + base + c)) : 0.0f);
        smem_store(dks + c, 0.0f);
        smem_store(dvs + c, 0.0f);
    }
    for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
        for (int64_t q0 = 0; q0 < p.s_q; q0 += kTile) {
            flash_stage_tile(qt, p.q, bi, p.s_q, p.h_q, hq, d, q0);
            flash_stage_tile(dot, p.d_o, bi, p.s_q, p.h_q, hq, d, q0);
            cp_async_commit();
            for (int64_t r = threadIdx.x; r < kTile; r += rows) {
                const int64_t stat = (bi * p.h_q + hq) * p.s_q + q0 + r;
                const bool in = q0 + r < p.s_q;
                smem_store(lse2t + r, in ? gmem_load(p.lse + stat) * 1.4426950408889634f : -INFINITY);
                smem_store(deltat + r, in ? gmem_load(p.delta + stat) : 0.0f);
            }
            cp_async_wait<0>();
            __syncthreads();
            if (active) {
                float s[kTile], dp[kTile];
RINGATTN_UNROLL
                for (int r = 0; r < kTile; ++r) s[r] = dp[r] = 0.0f;
                for (int64_t c = 0; c < d; ++c) {
                    const float kc = smem_load(ks + c), vc = smem_load(vs + c);
RINGATTN_UNROLL
                    for (int r = 0; r < kTile; ++r) {
                        s[r] += kc * T::to_float(smem_load(qt + r * d + c));
                        dp[r] += vc * T::to_float(smem_load(dot + r * d + c));
                    }
                }
                uint32_t visible = 0;
RINGATTN_UNROLL
                for (int r = 0; r < kTile; ++r) {
                    const float lse2 = smem_load(lse2t + r);
                    const bool vis = q0 + r < p.s_q && lse2 != -INFINITY && flash_visible(p.mask, q0 + r, j);
                    visible |= uint32_t(vis) << r;
                    s[r] = vis ? ex2_approx(s[r] - lse2) : 0.0f;          // p
                    dp[r] = vis ? s[r] * (dp[r] - smem_load(deltat + r)) : 0.0f;  // ds
                }
                if (visible != 0) {
                    for (int64_t c = 0; c < d; ++c) {
                        float acc_v = smem_load(dvs + c), acc_k = smem_load(dks + c);
RINGATTN_UNROLL
                        for (int r = 0; r < kTile; ++r) {
                            if (visible >> r & 1u) {
                                acc_v += s[r] * T::to_float(smem_load(dot + r * d + c));
                                acc_k += dp[r] * T::to_float(smem_load(qt + r * d + c));
                            }
                        }
                        smem_store(dvs + c, acc_v);
                        smem_store(dks + c, acc_k);
                    }
                }
            }
            __syncthreads();
        }
    }
    if (active) {
        for (int64_t c = 0; c < d; ++c) {
            gmem_store(p.dk + base + c, smem_load(dks + c) * p.scale);
            gmem_store(p.dv + base + c, smem_load(dvs + c));
        }
    }
}

extern "C" __global__ void ringattn_flash_bwd_rowsum_bf16(FlashBwdParams p) { flash_bwd_rowsum<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_rowsum_f16(FlashBwdParams p) { flash_bwd_rowsum<F16>(p); }
extern "C" __global__ void ringattn_flash_bwd_dq_bf16(FlashBwdParams p) { flash_bwd_dq<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_dq_f16(FlashBwdParams p) { flash_bwd_dq<F16>(p); }
extern "C" __global__ void ringattn_flash_bwd_dkdv_bf16(FlashBwdParams p) { flash_bwd_dkdv<Bf16>(p); }
extern "C" __global__ void ringattn_flash_bwd_dkdv_f16(FlashBwdParams p) { flash_bwd_dkdv<F16>(p); }
