// Parameter structs of the kernel families, one per family, passed by value to the kernels.
// Each is mirrored once in Rust (#[repr(C)]) with size and alignment asserts; change both
// together. Plain C layout: 8-byte pointers and 64-bit integers only, no padding.
#pragma once
#include <stdint.h>

// merge.cu: combine partial (O, LSE) over disjoint key sets, in place into the accumulator.
// o layout [b, s, h, d] (f32), lse layout [b, h, s] (f32, natural log, -inf = no key).
struct MergeParams {
    float* o_acc;        // [b, s, h, d], read and written
    float* lse_acc;      // [b, h, s], read and written
    const float* o_part; // [b, s, h, d]
    const float* lse_part; // [b, h, s]
    int64_t b;
    int64_t s;
    int64_t h;
    int64_t d;
};

static_assert(sizeof(MergeParams) == 64, "MergeParams is mirrored in Rust: 4 pointers + 4 int64");
static_assert(alignof(MergeParams) == 8, "MergeParams alignment");
