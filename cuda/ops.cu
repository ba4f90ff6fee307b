// The data movements of the sequence-parallel drivers on device buffers: the `Buffers`
// operations of src/parallel/backend.rs (host twins in src/parallel/seq.rs) and the
// conversions between f32 and bf16/f16. The movements are written on 4-byte words; 16-bit
// buffers (even allocations, rows of an even number of values) move as pairs of values
// (src/kernels.rs `params::words`). Every kernel is a grid-stride loop over its work
// items with 64-bit indices (any grid covers any size; src/kernels.rs `geometry::ops` caps
// the grid), one work item per thread per iteration; no shared memory, no atomics, so the
// results do not depend on the schedule.
//
// Work items (OpsParams fields in brackets):
//   fill           dst[i] = value                                       i < len
//   add            dst[i] += src[i]                                     i < len
//   to_bf16/f16    dst16[i] = bits(src[i]), round to nearest even       i < len
//   round_bf16/f16 dst[i] = src[i] rounded to bf16/f16 (nearest even), as f32   i < len
//   from_bf16/f16  dst[i] = value of src16[i] (exact; NaNs quieted)     i < len
//   copy_rows      dst[(o*dst_rows + dst_off + r)*w + c] =
//                  src[(o*src_rows + src_off + r)*w + c]                o < b, r < n, c < w
//   select_heads   dst[(m*k + j)*d + c] = src[(m*h + heads[j])*d + c]   m < b, j < k, c < d
//   scatter_heads  for j in 0..k in order: dst[(m*h + heads[j])*d + c] (=|+=) src[(m*k + j)*d + c]
//                                                                       m < b, c < d
// scatter_heads gives each (m, c) to one thread that walks the heads in list order, so a
// head listed twice is written (or added to) in that order, as on the host.
#include "common.cuh"

namespace ringattn_ops {

__device__ __forceinline__ int64_t first_item() {
    return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t stride_items() {
    return int64_t(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ uint32_t f32_bits(float x) {
#ifdef __CUDACC__
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return u;
#endif
}

// f32 → bf16 bits, round to nearest even; NaN stays NaN (quiet bit set, upper payload kept).
// The `half` crate's conversion (src/runner.rs `to_bits`), bit for bit.
__device__ __forceinline__ uint16_t to_bf16_bits(float v) {
    const uint32_t x = f32_bits(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return uint16_t((x >> 16) | 0x0040u);
    }
    const uint32_t round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
        return uint16_t((x >> 16) + 1);
    }
    return uint16_t(x >> 16);
}

// f32 → f16 bits, round to nearest even, overflow to ±inf, subnormals rounded; NaN stays NaN
// (quiet bit set, upper payload kept). The `half` crate's conversion, bit for bit.
__device__ __forceinline__ uint16_t to_f16_bits(float v) {
    const uint32_t x = f32_bits(v);
    const uint32_t sign = x & 0x80000000u;
    const uint32_t exp = x & 0x7f800000u;
    const uint32_t man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        const uint32_t nan_bit = man == 0 ? 0u : 0x0200u;
        return uint16_t((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    const uint32_t half_sign = sign >> 16;
    const int32_t half_exp = int32_t(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) {
        return uint16_t(half_sign | 0x7c00u);
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return uint16_t(half_sign);
        }
        const uint32_t m = man | 0x00800000u;
        uint32_t half_man = m >> (14 - half_exp);
        const uint32_t round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) {
            half_man += 1;
        }
        return uint16_t(half_sign | half_man);
    }
    const uint32_t bits = half_sign | (uint32_t(half_exp) << 10) | (man >> 13);
    const uint32_t round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) {
        return uint16_t(bits + 1);
    }
    return uint16_t(bits);
}

__device__ __forceinline__ float f32_from_bits(uint32_t u) {
#ifdef __CUDACC__
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

// bf16 bits → f32 (exact).
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
    return f32_from_bits(uint32_t(h) << 16);
}

// f16 bits → f32 (exact: normals, subnormals, ±0, ±inf, NaN with its payload).
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) {
        return f32_from_bits(sign | 0x7f800000u | (man << 13));
    }
    if (exp == 0) {
        // ±man · 2^-24, exact in f32.
        const float v = float(man) * 5.9604644775390625e-08f;
        return sign != 0 ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace ringattn_ops

using namespace ringattn_ops;

// dst[i] = value for i < len.
extern "C" __global__ void ringattn_ops_fill_f32(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst + i, p.value);
    }
}

// dst[i] += src[i] for i < len.
extern "C" __global__ void ringattn_ops_add_f32(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst + i, gmem_load(p.dst + i) + gmem_load(p.src + i));
    }
}

// dst16[i] = bf16 bits of src[i] for i < len.
extern "C" __global__ void ringattn_ops_to_bf16(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst16 + i, to_bf16_bits(gmem_load(p.src + i)));
    }
}

// dst16[i] = f16 bits of src[i] for i < len.
extern "C" __global__ void ringattn_ops_to_f16(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst16 + i, to_f16_bits(gmem_load(p.src + i)));
    }
}

// dst[i] = src[i] rounded to bf16, kept as f32, for i < len.
extern "C" __global__ void ringattn_ops_round_bf16_f32(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst + i, bf16_bits_to_f32(to_bf16_bits(gmem_load(p.src + i))));
    }
}

// dst[i] = src[i] rounded to f16, kept as f32, for i < len.
extern "C" __global__ void ringattn_ops_round_f16_f32(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        gmem_store(p.dst + i, f16_bits_to_f32(to_f16_bits(gmem_load(p.src + i))));
    }
}

// dst[i] = the f32 value of the bf16 bits src16[i] for i < len; a NaN gets its quiet bit, as
// the `half` crate widens (the host's conversion), bit for bit.
extern "C" __global__ void ringattn_ops_from_bf16(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        uint16_t h = gmem_load(p.src16 + i);
        if ((h & 0x7fffu) > 0x7f80u) h = uint16_t(h | 0x0040u);
        gmem_store(p.dst + i, bf16_bits_to_f32(h));
    }
}

// dst[i] = the f32 value of the f16 bits src16[i] for i < len; a NaN gets its quiet bit, as
// the `half` crate widens, bit for bit.
extern "C" __global__ void ringattn_ops_from_f16(OpsParams p) {
    for (int64_t i = first_item(); i < p.len; i += stride_items()) {
        uint16_t h = gmem_load(p.src16 + i);
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0) h = uint16_t(h | 0x0200u);
        gmem_store(p.dst + i, f16_bits_to_f32(h));
    }
}

// Rows src_off.. of each of the b outer blocks of src ([b, src_rows, w]) to rows dst_off.. of
// dst ([b, dst_rows, w]), n rows each.
extern "C" __global__ void ringattn_ops_copy_rows_f32(OpsParams p) {
    const int64_t total = p.b * p.n * p.w;
    for (int64_t i = first_item(); i < total; i += stride_items()) {
        const int64_t c = i % p.w;
        const int64_t r = (i / p.w) % p.n;
        const int64_t o = i / (p.w * p.n);
        const float x = gmem_load(p.src + ((o * p.src_rows + p.src_off + r) * p.w + c));
        gmem_store(p.dst + ((o * p.dst_rows + p.dst_off + r) * p.w + c), x);
    }
}

// The heads `heads` of src ([b, h, d] rows) into dst ([b, k, d]).
extern "C" __global__ void ringattn_ops_select_heads_f32(OpsParams p) {
    const int64_t total = p.b * p.k * p.d;
    for (int64_t i = first_item(); i < total; i += stride_items()) {
        const int64_t c = i % p.d;
        const int64_t j = (i / p.d) % p.k;
        const int64_t m = i / (p.d * p.k);
        const int64_t head = gmem_load(p.heads + j);
        gmem_store(p.dst + i, gmem_load(p.src + ((m * p.h + head) * p.d + c)));
    }
}

// src ([b, k, d]) written (assign) or added into the heads `heads` of dst ([b, h, d]), the
// heads in list order.
extern "C" __global__ void ringattn_ops_scatter_heads_f32(OpsParams p) {
    const int64_t total = p.b * p.d;
    for (int64_t i = first_item(); i < total; i += stride_items()) {
        const int64_t c = i % p.d;
        const int64_t m = i / p.d;
        for (int64_t j = 0; j < p.k; ++j) {
            const int64_t head = gmem_load(p.heads + j);
            float* at = p.dst + ((m * p.h + head) * p.d + c);
            const float x = gmem_load(p.src + ((m * p.k + j) * p.d + c));
            gmem_store(at, p.assign ? x : gmem_load(at) + x);
        }
    }
}
