// Merge of partial attention results over disjoint key sets (the combine step of a ring hop):
//   m = max(lse_a, lse_b); w_x = exp(lse_x - m); lse = m + log(w_a + w_b);
//   o = (w_a o_a + w_b o_b) / (w_a + w_b)
// A side with lse = -inf contributes nothing (its o is never read, so NaN there cannot leak);
// two such sides give lse = -inf, o = 0. Same semantics as src/merge.rs.
//
// One warp per (batch, head, row); lanes stride over the head dimension.
#include "common.cuh"

extern "C" __global__ void ringattn_merge_f32(MergeParams p) {
    const int64_t rows = p.b * p.h * p.s;
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= rows) {
        return;
    }
    // warp indexes the LSE layout [b, h, s].
    const int64_t si = warp % p.s;
    const int64_t hi = (warp / p.s) % p.h;
    const int64_t bi = warp / (p.s * p.h);
    const float la = p.lse_acc[warp];
    const float lb = p.lse_part[warp];
    const float m = fmaxf(la, lb);
    float* o = p.o_acc + ((bi * p.s + si) * p.h + hi) * p.d;
    const float* ob = p.o_part + ((bi * p.s + si) * p.h + hi) * p.d;
    if (m == -INFINITY) {
        for (int64_t c = lane; c < p.d; c += 32) {
            o[c] = 0.0f;
        }
        return;
    }
    const float wa = expf(la - m);
    const float wb = expf(lb - m);
    const float inv = 1.0f / (wa + wb);
    const float ca = wa * inv;
    const float cb = wb * inv;
    for (int64_t c = lane; c < p.d; c += 32) {
        const float x = o[c];
        const float y = ob[c];
        o[c] = cb == 0.0f ? x : (ca == 0.0f ? y : ca * x + cb * y);
    }
    // Every lane has read lse_acc[warp] above; one writes the merged value.
    __syncwarp();
    if (lane == 0) {
        p.lse_acc[warp] = m + logf(wa + wb);
    }
}
