// Flash attention forward (first generation: simple tiled, no tensor cores). For query rows
// i and visible key rows j: s_ij = scale q_i.k_j, lse_i = log sum_j exp(s_ij),
// o_i = sum_j exp(s_ij - lse_i) v_j, with the online softmax over key tiles (in base 2, the
// scale times log2(e) folded into q). Masks from global positions, GQA (query head h reads
// key/value head h / (h_q / h_kv)), f32 accumulation, unrounded f32 o and lse out; rows with
// no visible key give o = 0, lse = -inf.
//
// Launch: grid (ceil(s_q / rows), h_q, b), block (rows), dynamic shared memory
// flash_rows_bytes(rows, d, 2) + flash_tiles_bytes(d) (src/kernels.rs `geometry`).
#include "flash.cuh"

template <typename T>
__device__ void flash_fwd(const FlashFwdParams& p) {
    const int64_t rows = blockDim.x, d = p.d, ld = d + 1;
    const int64_t hq = blockIdx.y, bi = blockIdx.z, hk = hq / (p.h_q / p.h_kv);
    const int64_t i = int64_t(blockIdx.x) * rows + threadIdx.x;
    const bool active = i < p.s_q;
    unsigned char* smem = RINGATTN_DYNAMIC_SMEM();
    float* qs = reinterpret_cast<float*>(smem) + threadIdx.x * ld;
    float* os = reinterpret_cast<float*>(smem) + (rows + threadIdx.x) * ld;
    uint16_t* kt = reinterpret_cast<uint16_t*>(smem + flash_rows_bytes(rows, d, 2));
    uint16_t* vt = kt + kTile * d;

    const uint16_t* qrow = p.q + ((bi * p.s_q + (active ? i : 0)) * p.h_q + hq) * d;
    for (int64_t c = 0; c < d; ++c) {
        smem_store(qs + c, active ? T::to_float(gmem_load(qrow + c)) * p.scale_log2 : 0.0f);
        smem_store(os + c, 0.0f);
    }
    float m = -INFINITY, l = 0.0f;  // running max (base 2) and sum
    for (int64_t k0 = 0; k0 < p.s_k; k0 += kTile) {
        flash_stage_tile(kt, p.k, bi, p.s_k, p.h_kv, hk, d, k0);
        flash_stage_tile(vt, p.v, bi, p.s_k, p.h_kv, hk, d, k0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (active) {
            float s[kTile];
RINGATTN_UNROLL
            for (int j = 0; j < kTile; ++j) s[j] = 0.0f;
            for (int64_t c = 0; c < d; ++c) {
                const float qc = smem_load(qs + c);
RINGATTN_UNROLL
                for (int j = 0; j < kTile; ++j) s[j] += qc * T::to_float(smem_load(kt + j * d + c));
            }
            uint32_t visible = 0;
            float mt = -INFINITY;
RINGATTN_UNROLL
            for (int j = 0; j < kTile; ++j) {
                if (k0 + j < p.s_k && flash_visible(p.mask, i, k0 + j)) {
                    visible |= 1u << j;
                    mt = fmaxf(mt, s[j]);
                }
            }
            if (visible != 0) {
                const float m_new = fmaxf(m, mt);
                const float alpha = m == -INFINITY ? 0.0f : ex2_approx(m - m_new);
                l *= alpha;
RINGATTN_UNROLL
                for (int j = 0; j < kTile; ++j) {
                    s[j] = (visible >> j & 1u) ? ex2_approx(s[j] - m_new) : 0.0f;
                    l += s[j];
                }
                for (int64_t c = 0; c < d; ++c) {
                    float acc = smem_load(os + c) * alpha;
RINGATTN_UNROLL
                    for (int j = 0; j < kTile; ++j) {
                        if (visible >> j & 1u) acc += s[j] * T::to_float(smem_load(vt + j * d + c));
                    }
                    smem_store(os + c, acc);
                }
                m = m_new;
            }
        }
        __syncthreads();
    }
    if (active) {
        float* orow = p.o + ((bi * p.s_q + i) * p.h_q + hq) * d;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t c = 0; c < d; ++c) gmem_store(orow + c, smem_load(os + c) * inv);
        // lse = ln(2) (m + log2 l)
        gmem_store(p.lse + (bi * p.h_q + hq) * p.s_q + i, l > 0.0f ? (m + log2f(l)) * 0.6931471805599453f : -INFINITY);
    }
}

extern "C" __global__ void ringattn_flash_fwd_bf16(FlashFwdParams p) { flash_fwd<Bf16>(p); }
extern "C" __global__ void ringattn_flash_fwd_f16(FlashFwdParams p) { flash_fwd<F16>(p); }
