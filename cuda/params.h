// Parameter structs of the kernel families, one per family, passed by value to the kernels.
// Each is mirrored once in Rust (#[repr(C)]) with size and alignment asserts; change both
// together. Plain C layout: 8-byte pointers and 64-bit integers only, no padding.
#pragma once
#include <stddef.h>
#include <stdint.h>

// merge.cu: combine partial (O, LSE) over disjoint key sets, in place into the accumulator;
// merge attention sinks (a value-less partial of LSE sinks[h] per row) into a finished
// result; the sinks' gradient. o layout [b, s, h, d] (f32), lse layout [b, h, s] (f32,
// natural log, -inf = no key). Each kernel reads the fields its comment names.
struct MergeParams {
    float* o_acc;        // [b, s, h, d], read and written (merge, merge_sinks)
    float* lse_acc;      // [b, h, s], read and written (merge, merge_sinks); read (sink_grad)
    const float* o_part; // [b, s, h, d] (merge)
    const float* lse_part; // [b, h, s] (merge)
    int64_t b;
    int64_t s;
    int64_t h;
    int64_t d;
    const float* sinks;  // [h]: the sinks' logits of the result's heads (merge_sinks, sink_grad)
    const float* delta;  // [b, h, s]: D = rowsum(dO∘O) (sink_grad)
    float* dsinks;       // [h], written (sink_grad)
};

static_assert(sizeof(MergeParams) == 88, "MergeParams is mirrored in Rust: 4 pointers + 4 int64 + 3 pointers");
static_assert(alignof(MergeParams) == 8, "MergeParams alignment");

// A tensor map (the operand of the bulk tensor copies, TMA): 128 bytes, 128-byte aligned (CUDA
// 13's cuda.h declares CUtensorMap alignas(128); a kernel parameter's map must sit at a
// 128-byte multiple of the parameter space, so every params struct places its maps there).
// On the device the driver's CUtensorMap (cuTensorMapEncodeTiled); in the emulator its own
// encoding of the same fields (src/kernels/tensor_map.rs writes both; ptx.cuh reads the
// emulator's). Kernels take it inside their params struct, passed as a __grid_constant__.
struct alignas(128) TensorMap {
    uint64_t words[16];
};

static_assert(sizeof(TensorMap) == 128, "TensorMap is mirrored in Rust: 16 words");
static_assert(alignof(TensorMap) == 128, "TensorMap alignment (CUDA 13 CUtensorMap's)");

// Visibility of (query row i, key row j), evaluated per pair on global positions, the rule of
// src/mask.rs: visible iff k_pos[j] >= q_pos[i] - window_left (when window_left >= 0),
// k_pos[j] <= q_pos[i] + window_right (when window_right >= 0) and, with documents,
// q_doc[i] == k_doc[j]. Causal is window_left = -1, window_right = 0.
struct MaskParams {
    const int64_t* q_pos;   // [s_q] global position of each query row
    const int64_t* k_pos;   // [s_k] global position of each key row
    const uint32_t* q_doc;  // [s_q] document index, or null without documents
    const uint32_t* k_doc;  // [s_k] document index, or null without documents
    int64_t window_left;    // -1: unbounded
    int64_t window_right;   // -1: unbounded
    // Per granule of MASK_GRANULE keys (the last one partial): min and max key position
    // ([ceil(s_k / MASK_GRANULE)][2] int64), and min and max key document ([..][2] uint32,
    // null without documents), so that a kernel classifies a tile as fully visible or fully
    // masked without reading its positions. k_bounds may be null: no classification.
    const int64_t* k_bounds;
    const uint32_t* k_doc_bounds;
    // The same per granule of MASK_GRANULE queries ([ceil(s_q / MASK_GRANULE)][2]), for the
    // kernels that stream query tiles (dk/dv). Set together with k_bounds, or both null.
    const int64_t* q_bounds;
    const uint32_t* q_doc_bounds;
};

#define MASK_GRANULE 32

static_assert(sizeof(MaskParams) == 80, "MaskParams is mirrored in Rust: 8 pointers + 2 int64");

// How a flash kernel forms its scores from the products q.k (src/attention.rs ScoreSpec,
// filled by FlashProblem::new in src/kernels.rs; cuda/score.cuh is the device code that reads
// it): s = scale * q.k, then softcap * tanh(s / softcap) when softcap > 0. The kernels work in
// log2 units (their exponentials are 2^x), hence the _log2 copies (times log2(e)).
struct ScoreParams {
    float scale;         // softmax scale (applied to q.k)
    float scale_log2;    // scale * log2(e)
    float softcap;       // tanh soft-cap of the scaled scores; 0: none
    float softcap_log2;  // softcap * log2(e); 0: none
};

static_assert(sizeof(ScoreParams) == 16, "ScoreParams is mirrored in Rust: 4 f32");

// The attention problem of a flash kernel call: the first member of the forward's and the
// backward's params of both kernel families, so that what every flash kernel reads — the
// 16-bit inputs, the visibility, the shape, the score's options — is declared once (a score
// option added here reaches every kernel; src/kernels.rs `FlashProblem::new` fills it, the
// one constructor every backend calls). q, k, v hold bf16 or f16 bits (the entry point names
// the type). h_q % h_kv == 0; d_qk and d_v: multiples of 8 up to the entry point's head-dim
// class (columns past either are zero-filled in shared memory, so the class of the larger
// serves both: multi-head latent attention's d_qk 192, d_v 128 runs at class 192).
struct FlashProblem {
    const uint16_t* q;  // [b, s_q, h_q, d_qk]
    const uint16_t* k;  // [b, s_k, h_kv, d_qk]
    const uint16_t* v;  // [b, s_k, h_kv, d_v]
    MaskParams mask;
    int64_t b, s_q, s_k, h_q, h_kv, d_qk, d_v;
    ScoreParams score;
};

static_assert(sizeof(FlashProblem) == 176, "FlashProblem is mirrored in Rust: 3 pointers, the mask, 7 int64, the score");
static_assert(alignof(FlashProblem) == 8, "FlashProblem alignment");

// flash_fwd.cu: o, lse of the problem's queries against its keys and values. o and lse are
// f32 and unrounded, so that ring hops merge in f32, or o goes to o16 rounded to the input
// type (the single-device training path). Rows with no visible key get o = 0, lse = -inf.
struct FlashFwdParams {
    FlashProblem x;
    float* o;       // [b, s_q, h_q, d_v] f32, written (unless o16 is set)
    float* lse;     // [b, h_q, s_q] written, natural log
    uint16_t* o16;  // [b, s_q, h_q, d_v] in the input type, written instead of o when non-null
};

static_assert(sizeof(FlashFwdParams) == 200, "FlashFwdParams is mirrored in Rust");
static_assert(alignof(FlashFwdParams) == 8, "FlashFwdParams alignment");

// flash_fwd_hopper.cu (sm_90a): the forward's params plus the tensor maps of q, k and v
// ([b, s, h, d] as 4-d maps: dims {d, h, s, b}, boxes of 64 columns x 1 head x kBlockM
// (q) or kBlockN (k, v) rows x 1, 128-byte swizzle). Passed as a __grid_constant__.
struct FlashFwdHopperParams {
    FlashFwdParams p;
    uint64_t reserved[7];  // pads p to 256 bytes: the maps are 128-byte aligned
    TensorMap q, k, v;
};

static_assert(sizeof(FlashFwdHopperParams) == 640, "FlashFwdHopperParams is mirrored in Rust");
static_assert(alignof(FlashFwdHopperParams) == 128, "FlashFwdHopperParams alignment");
static_assert(offsetof(FlashFwdHopperParams, q) == 256 && offsetof(FlashFwdHopperParams, k) == 384 &&
                  offsetof(FlashFwdHopperParams, v) == 512,
              "FlashFwdHopperParams: maps at 128-byte multiples, mirrored in Rust");

// flash_bwd.cu: the gradients of one block of keys given the final o, lse of the queries.
// delta = rowsum(d_o * o) (ringattn_flash_bwd_rowsum writes it from o and d_o); dk, dv are f32
// and unrounded, written (not accumulated); dq is added into zeros by the fused kernel — as
// fixed-point integers (dq_accum 0, deterministic: the dqconvert kernel turns them into f32 in
// place) or as f32 (dq_accum 1, atomic).
struct FlashBwdParams {
    FlashProblem x;
    const float* o;       // [b, s_q, h_q, d_v] the forward output (read by the rowsum kernel)
    const uint16_t* d_o;  // [b, s_q, h_q, d_v]
    const float* lse;     // [b, h_q, s_q] of the whole key set
    float* delta;         // [b, h_q, s_q] written by the rowsum kernel, read by the others
    float* dq;            // [b, s_q, h_q, d_qk] zeroed by the caller, added to
    float* dk;            // [b, s_k, h_kv, d_qk] written
    float* dv;            // [b, s_k, h_kv, d_v] written
    float* dq_unit;       // [b, h_q, s_q] fixed-point dq: 1 / each row's unit, a power of two
    float* kv_bound;      // [b, h_kv, 2] fixed-point dq: max |k_jc| and max ||v_j||, zeroed by the caller
    int32_t dq_accum;     // informational: 0 fixed point (DqAccum::kFixed), 1 f32 atomics (kF32)
    int32_t reserved;
};

static_assert(sizeof(FlashBwdParams) == 256, "FlashBwdParams is mirrored in Rust");
static_assert(alignof(FlashBwdParams) == 8, "FlashBwdParams alignment");

// flash_bwd_hopper.cu (sm_90a): the backward's params plus the tensor maps of q, k, v and d_o
// (as FlashFwdHopperParams': boxes of 64 columns x 1 head x 64 query rows (q, d_o) or the key
// block's rows (k, v) x 1, 128-byte swizzle) and of lse and delta (f32 [b, h_q, s_q] as 2-d
// maps {b h_q s_q, 1}: boxes of 64 x 1, no swizzle). Passed as a __grid_constant__.
struct FlashBwdHopperParams {
    FlashBwdParams p;  // 256 bytes: the maps that follow are 128-byte aligned
    TensorMap q, k, v, d_o, lse, delta;
};

static_assert(sizeof(FlashBwdHopperParams) == 1024, "FlashBwdHopperParams is mirrored in Rust");
static_assert(alignof(FlashBwdHopperParams) == 128, "FlashBwdHopperParams alignment");
static_assert(offsetof(FlashBwdHopperParams, q) == 256 && offsetof(FlashBwdHopperParams, k) == 384 &&
                  offsetof(FlashBwdHopperParams, v) == 512 && offsetof(FlashBwdHopperParams, d_o) == 640 &&
                  offsetof(FlashBwdHopperParams, lse) == 768 && offsetof(FlashBwdHopperParams, delta) == 896,
              "FlashBwdHopperParams: maps at 128-byte multiples, mirrored in Rust");

// ops.cu: the data movements of the sequence-parallel drivers on device buffers (the
// `Buffers` operations of src/parallel/backend.rs) and the f32 <-> bf16/f16 conversions. One
// struct for the family; each kernel reads the fields its comment in ops.cu names and
// ignores the others (zero them). dst/src are 4-byte words: f32 values, or pairs of 16-bit
// values for the movements of 16-bit buffers (fill, copy_rows, select/scatter_heads).
struct OpsParams {
    float* dst;             // fill, add (acc), copy_rows, select_heads, scatter_heads: written
    const float* src;       // add (x), to_bf16/to_f16, copy_rows, select_heads, scatter_heads
    uint16_t* dst16;        // to_bf16/to_f16: the 16-bit patterns, written
    const uint16_t* src16;  // from_bf16/from_f16: the 16-bit patterns read
    const int64_t* heads;   // select_heads/scatter_heads: [k] head indices (each < h)
    int64_t len;            // fill, add, the conversions: elements
    int64_t b;              // copy_rows: outer count; select/scatter_heads: b * n (rows of heads)
    int64_t n;              // copy_rows: rows copied per outer index
    int64_t w;              // copy_rows: elements per row
    int64_t src_rows;       // copy_rows: rows per outer index of src
    int64_t src_off;        // copy_rows: first row read
    int64_t dst_rows;       // copy_rows: rows per outer index of dst
    int64_t dst_off;        // copy_rows: first row written
    int64_t h;              // select/scatter_heads: heads of the full buffer
    int64_t k;              // select/scatter_heads: heads listed
    int64_t d;              // select/scatter_heads: elements per head
    float value;            // fill
    int32_t assign;         // scatter_heads: 1 writes, 0 adds
};

static_assert(sizeof(OpsParams) == 136, "OpsParams is mirrored in Rust: 5 pointers + 11 int64 + f32 + i32");
static_assert(alignof(OpsParams) == 8, "OpsParams alignment");
