// The merge family (MergeParams). Merge of partial attention results over disjoint key sets
// (the combine step of a ring hop):
//   m = max(lse_a, lse_b); w_x = exp(lse_x - m); lse = m + log(w_a + w_b);
//   o = (w_a o_a + w_b o_b) / (w_a + w_b)
// A side with lse = -inf contributes nothing (its o is never read, so NaN there cannot leak);
// two such sides give lse = -inf, o = 0. Same semantics as src/merge.rs.
//
// One warp per (batch, head, row); lanes stride over the head dimension.
#include "common.cuh"

// The row of a merge-family thread: one warp per (batch, head, row); `lse` indexes the LSE
// layout [b, h, s], `o` the row's first element in [b, s, h, d]; lse < 0 past the last row.
struct MergeRow {
    int64_t lse, o, head;
    int lane;
};
__device__ __forceinline__ MergeRow merge_row(const MergeParams& p) {
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= p.b * p.h * p.s) {
        return MergeRow{-1, 0, 0, lane};
    }
    const int64_t si = warp % p.s;
    const int64_t hi = (warp / p.s) % p.h;
    const int64_t bi = warp / (p.s * p.h);
    return MergeRow{warp, ((bi * p.s + si) * p.h + hi) * p.d, hi, lane};
}

extern "C" __global__ void ringattn_merge_f32(MergeParams p) {
    const MergeRow r = merge_row(p);
    if (r.lse < 0) {
        return;
    }
    const int64_t warp = r.lse;
    const int lane = r.lane;
    const float la = p.lse_acc[warp];
    const float lb = p.lse_part[warp];
    const float m = fmaxf(la, lb);
    float* o = p.o_acc + r.o;
    const float* ob = p.o_part + r.o;
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

// Attention sinks merged into a finished result: each row of head hi joins a value-less
// partial of LSE sinks[hi] (finite): lse' = log(e^lse + e^sink), o' = e^(lse - lse') o; a
// row that saw no key (lse = -inf) gets o = 0, lse = sinks[hi]. Same arithmetic as
// src/merge.rs merge_sinks. One warp per (batch, head, row), as the merge.
extern "C" __global__ void ringattn_merge_sinks_f32(MergeParams p) {
    const MergeRow r = merge_row(p);
    if (r.lse < 0) {
        return;
    }
    const int64_t warp = r.lse;
    const int lane = r.lane;
    const float la = p.lse_acc[warp];
    const float lb = p.sinks[r.head];
    const float m = fmaxf(la, lb);
    const float wa = expf(la - m);
    const float wb = expf(lb - m);
    const float sum = wa + wb;
    const float ca = wa / sum;
    float* o = p.o_acc + r.o;
    for (int64_t c = lane; c < p.d; c += 32) {
        o[c] = ca == 0.0f ? 0.0f : ca * o[c];
    }
    __syncwarp();
    if (lane == 0) {
        p.lse_acc[warp] = m + logf(sum);
    }
}

// The sinks' gradient: dsinks[hi] = -sum over (batch, row) of e^(sinks[hi] - lse) * delta,
// from the final lse (sinks included) and delta = rowsum(dO∘O), both [b, h, s]. One block of
// kSinkThreads per head: each thread sums its strided rows in order, then a fixed-order tree
// in (dynamic, kSinkThreads floats) shared memory: the same bits on every run.
constexpr int kSinkThreads = 256;
extern "C" __global__ void __launch_bounds__(kSinkThreads) ringattn_sink_grad_f32(MergeParams p) {
    float* part = reinterpret_cast<float*>(RINGATTN_DYNAMIC_SMEM());
    const int64_t hi = blockIdx.x;
    const float sigma = p.sinks[hi];
    float acc = 0.0f;
    for (int64_t bi = 0; bi < p.b; ++bi) {
        const int64_t at = (bi * p.h + hi) * p.s;
        for (int64_t si = threadIdx.x; si < p.s; si += kSinkThreads) {
            acc += expf(sigma - p.lse_acc[at + si]) * p.delta[at + si];
        }
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = kSinkThreads / 2; half > 0; half /= 2) {
        if (int(threadIdx.x) < half) {
            part[threadIdx.x] += part[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        p.dsinks[hi] = -part[0];
    }
}
