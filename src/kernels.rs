//! The CUDA kernel images that `build.rs` compiled from `cuda/*.cu` and embedded: a cubin per
//! kernel family and architecture of `RINGATTN_CUDA_ARCHS`, plus PTX for newer GPUs. Empty
//! when the crate was built without nvcc. The CUDA backend loads these; the same
//! source runs on the CPU under the emulator ([`crate::emu`]).
//!
//! The images are embedded deflate-compressed (build.rs) and expanded on first use, once per
//! process.
//!
//! ```
//! for image in ringattn::kernels::images() {
//!     assert_eq!(image.bytes()?.len(), image.size);
//! }
//! # Ok::<(), ringattn::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// What an image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// An ELF cubin for one architecture (`sm_80`, `sm_90a`, ...).
    Cubin,
    /// PTX text, JIT-compiled by the driver for GPUs newer than the cubins.
    Ptx,
}

/// One compiled kernel family for one target.
#[derive(Debug, Clone, Copy)]
pub struct KernelImage {
    /// Kernel family: the `cuda/*.cu` file it came from (`merge`, ...).
    pub family: &'static str,
    /// `sm_XX` for cubins, `compute_XX` for PTX.
    pub target: &'static str,
    /// Cubin or PTX.
    pub kind: ImageKind,
    /// The image's size in bytes, expanded.
    pub size: usize,
    /// The image as embedded: a raw deflate stream ([`KernelImage::bytes`] expands it).
    pub deflated: &'static [u8],
}

impl KernelImage {
    /// The image, expanded on the first call (once per process; later calls return the same
    /// bytes).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the embedded stream does not expand to [`KernelImage::size`]
    /// bytes (a corrupt build).
    pub fn bytes(&self) -> crate::Result<&'static [u8]> {
        static EXPANDED: OnceLock<Mutex<HashMap<usize, &'static [u8]>>> = OnceLock::new();
        let key = self.deflated.as_ptr() as usize;
        let cache = EXPANDED.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(b) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(b);
        }
        let raw = miniz_oxide::inflate::decompress_to_vec_with_limit(self.deflated, self.size)
            .ok()
            .filter(|r| r.len() == self.size)
            .ok_or_else(|| {
                crate::Error::Cuda(format!(
                    "the embedded {} {} image does not expand to its {} bytes (a corrupt build)",
                    self.family, self.target, self.size
                ))
            })?;
        let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
        // Expanded once per image: the leak is bounded by the images' total size.
        Ok(*map.entry(key).or_insert_with(|| Box::leak(raw.into_boxed_slice())))
    }
}

#[cfg(has_nvcc)]
include!(concat!(env!("OUT_DIR"), "/kernel_images.rs"));

/// Without nvcc at build time there are no images.
#[cfg(not(has_nvcc))]
pub static IMAGES: &[KernelImage] = &[];

/// Without nvcc at build time there is no CUDA version.
#[cfg(not(has_nvcc))]
pub static CUDA_VERSION: Option<(i32, i32)> = None;

/// The CUDA version of the nvcc that built the images, `(13, 0)`: the driver must support at
/// least this version to load them (`None` without images).
///
/// ```
/// if ringattn::kernels::compiled() {
///     assert!(ringattn::kernels::cuda_version().is_some());
/// }
/// ```
pub fn cuda_version() -> Option<(i32, i32)> {
    CUDA_VERSION
}

/// The distinct targets of the embedded images in build order (`sm_80`, `sm_90a`, ...,
/// `compute_120`): what `ringattn doctor` lists.
pub fn targets() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for i in IMAGES {
        if !out.contains(&i.target) {
            out.push(i.target);
        }
    }
    out
}

/// Every embedded image.
pub fn images() -> &'static [KernelImage] {
    IMAGES
}

/// What the name of every device of ringattn's stand-in CUDA driver (`emulated-gpu/`, the
/// kernels run on the host emulator) contains: `ringattn doctor` and the benchmarks report
/// such a device as emulated, and no figure measured on it is a GPU figure.
pub const EMULATED_GPU_MARK: &str = "ringattn emulated-gpu";

/// Whether a device named `name` is the stand-in driver's emulated GPU.
///
/// ```
/// assert!(ringattn::kernels::is_emulated_gpu("NVIDIA H200 (ringattn emulated-gpu: kernels run on the CPU)"));
/// assert!(!ringattn::kernels::is_emulated_gpu("NVIDIA H200"));
/// ```
pub fn is_emulated_gpu(name: &str) -> bool {
    name.contains(EMULATED_GPU_MARK)
}

/// Whether this build embedded kernels (nvcc was found at build time).
pub fn compiled() -> bool {
    !IMAGES.is_empty()
}

/// Mirrors of the `#[repr(C)]` parameter structs of `cuda/params.h`.
pub mod params {
    /// `MergeParams` of `cuda/params.h` (the merge family: the merge, the sinks' merge and
    /// their gradient): pointers to `o_acc`, `lse_acc`, `o_part`, `lse_part` (device
    /// addresses), the dims `b, s, h, d`, then `sinks`, `delta`, `dsinks`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct MergeParams {
        /// `[b, s, h, d]` f32, read and written.
        pub o_acc: u64,
        /// `[b, h, s]` f32, read and written.
        pub lse_acc: u64,
        /// `[b, s, h, d]` f32.
        pub o_part: u64,
        /// `[b, h, s]` f32.
        pub lse_part: u64,
        /// Batch.
        pub b: i64,
        /// Rows.
        pub s: i64,
        /// Heads.
        pub h: i64,
        /// Head dimension.
        pub d: i64,
        /// `[h]` f32: the sinks' logits of the result's heads (`merge_sinks`, `sink_grad`).
        pub sinks: u64,
        /// `[b, h, s]` f32: `D = rowsum(dO∘O)` (`sink_grad`).
        pub delta: u64,
        /// `[h]` f32, written (`sink_grad`).
        pub dsinks: u64,
    }

    /// `MaskParams` of `cuda/params.h`: the visibility of (query `i`, key `j`) on global
    /// positions — visible iff `k_pos[j] >= q_pos[i] - window_left` (when `window_left >= 0`),
    /// `k_pos[j] <= q_pos[i] + window_right` (when `window_right >= 0`) and, with documents,
    /// `q_doc[i] == k_doc[j]`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct MaskParams {
        /// `[s_q]` i64 global positions of the query rows.
        pub q_pos: u64,
        /// `[s_k]` i64 global positions of the key rows.
        pub k_pos: u64,
        /// `[s_q]` u32 document indices, or 0 without documents.
        pub q_doc: u64,
        /// `[s_k]` u32 document indices, or 0 without documents.
        pub k_doc: u64,
        /// How far back a query sees; -1: unbounded.
        pub window_left: i64,
        /// How far ahead a query sees; -1: unbounded.
        pub window_right: i64,
        /// `[ceil(s_k / MASK_GRANULE)][2]` i64: min and max key position per granule of
        /// [`MASK_GRANULE`] keys, or 0 (no tile classification).
        pub k_bounds: u64,
        /// `[ceil(s_k / MASK_GRANULE)][2]` u32: min and max key document per granule, or 0
        /// without documents.
        pub k_doc_bounds: u64,
        /// `[ceil(s_q / MASK_GRANULE)][2]` i64: min and max query position per granule of
        /// queries (the kernels that stream query tiles), set together with `k_bounds`.
        pub q_bounds: u64,
        /// `[ceil(s_q / MASK_GRANULE)][2]` u32: min and max query document per granule, or 0
        /// without documents.
        pub q_doc_bounds: u64,
    }

    /// Keys per granule of [`MaskParams::k_bounds`] (`MASK_GRANULE` of `cuda/params.h`).
    pub const MASK_GRANULE: usize = 32;

    /// The granule bounds of a mask's keys or queries: `(k_bounds, k_doc_bounds)` (or
    /// `q_bounds`, `q_doc_bounds`) as [`MaskParams`] takes them — per granule of
    /// [`MASK_GRANULE`] rows, min and max position, and min and max document when there are
    /// documents.
    ///
    /// ```
    /// use ringattn::kernels::params::granule_bounds;
    /// let (pos, docs) = granule_bounds(&(0..40).rev().collect::<Vec<i64>>(), None);
    /// assert_eq!(pos, vec![8, 39, 0, 7]);
    /// assert!(docs.is_none());
    /// ```
    pub fn granule_bounds(pos: &[i64], doc: Option<&[u32]>) -> (Vec<i64>, Option<Vec<u32>>) {
        let pos = pos
            .chunks(MASK_GRANULE)
            .flat_map(|c| [*c.iter().min().expect("non-empty"), *c.iter().max().expect("non-empty")])
            .collect();
        let docs = doc.map(|d| {
            d.chunks(MASK_GRANULE)
                .flat_map(|c| [*c.iter().min().expect("non-empty"), *c.iter().max().expect("non-empty")])
                .collect()
        });
        (pos, docs)
    }

    /// `FlashProblem` of `cuda/params.h`: the attention problem every flash kernel reads,
    /// the first member (`x`) of [`FlashFwdParams`] and [`FlashBwdParams`] — `q` `[b, s_q,
    /// h_q, d_qk]`, `k` `[b, s_k, h_kv, d_qk]`, `v` `[b, s_k, h_kv, d_v]` as bf16 or f16
    /// bits, the visibility, the shape and the score's options. [`FlashProblem::new`] is the
    /// one constructor every backend fills it with.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct FlashProblem {
        /// Queries.
        pub q: u64,
        /// Keys.
        pub k: u64,
        /// Values.
        pub v: u64,
        /// Visibility.
        pub mask: MaskParams,
        /// Batch.
        pub b: i64,
        /// Query rows.
        pub s_q: i64,
        /// Key rows.
        pub s_k: i64,
        /// Query heads.
        pub h_q: i64,
        /// Key/value heads.
        pub h_kv: i64,
        /// Head dimension of q and k (multiple of 8, at most the entry point's class).
        pub d_qk: i64,
        /// Head dimension of v and o (multiple of 8, at most the entry point's class).
        pub d_v: i64,
        /// How the scores are formed.
        pub score: ScoreParams,
    }

    /// `ScoreParams` of `cuda/params.h`: how a flash kernel forms its scores, mirrored from
    /// [`crate::attention::ScoreSpec`] (`cuda/score.cuh` reads it): `s = scale · q·k`, then
    /// `softcap · tanh(s / softcap)` when `softcap > 0`; the `_log2` copies times `log2(e)`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct ScoreParams {
        /// Softmax scale.
        pub scale: f32,
        /// `scale · log2(e)`.
        pub scale_log2: f32,
        /// The tanh soft-cap of the scaled scores; 0: none.
        pub softcap: f32,
        /// `softcap · log2(e)`; 0: none.
        pub softcap_log2: f32,
    }

    impl ScoreParams {
        /// The kernels' form of `spec`.
        pub fn of(spec: &crate::attention::ScoreSpec) -> Self {
            let cap = spec.softcap.unwrap_or(0.0);
            ScoreParams {
                scale: spec.scale,
                scale_log2: spec.scale * std::f32::consts::LOG2_E,
                softcap: cap,
                softcap_log2: cap * std::f32::consts::LOG2_E,
            }
        }
    }

    impl FlashProblem {
        /// The shape of `dims` and the score of `spec`, every buffer null and no mask: callers
        /// fill in their addresses and mask (`FlashProblem { q, k, v, mask, ..FlashProblem::new(..) }`).
        pub fn new(dims: &crate::Dims, spec: &crate::attention::ScoreSpec) -> Self {
            let [b, s_q, s_k, h_q, h_kv, d_qk, d_v] =
                [dims.b, dims.s_q, dims.s_k, dims.h_q, dims.h_kv, dims.d_qk, dims.d_v].map(|x| x as i64);
            FlashProblem { b, s_q, s_k, h_q, h_kv, d_qk, d_v, score: ScoreParams::of(spec), ..Default::default() }
        }
    }

    /// `FlashFwdParams` of `cuda/params.h` (flash forward): the problem, and `o` `[b, s_q,
    /// h_q, d_v]` and `lse` `[b, h_q, s_q]` f32, written (or `o16`, the output in the input
    /// type, instead of `o`).
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct FlashFwdParams {
        /// The attention problem.
        pub x: FlashProblem,
        /// Output, f32.
        pub o: u64,
        /// Log-sum-exp, f32, natural log.
        pub lse: u64,
        /// When non-zero: the output in the input type (16-bit), written instead of `o`.
        pub o16: u64,
    }

    /// `FlashFwdHopperParams` of `cuda/params.h` (the sm_90a forward, `flash_fwd_hopper.cu`):
    /// the forward's params and the tensor maps of `q`, `k` and `v` (4-d views `{d, h, s, b}`
    /// with boxes of 64 columns × 1 head × the tile's rows × 1, 128-byte swizzled; see
    /// [`super::tensor_map::bshd_tile_map`]).
    #[repr(C, align(128))]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct FlashFwdHopperParams {
        /// Everything but the maps.
        pub p: FlashFwdParams,
        /// Padding: `p` to 256 bytes, so that the maps sit at 128-byte multiples of the
        /// parameter space (CUDA 13's `CUtensorMap` is `alignas(128)`).
        pub reserved: [u64; 7],
        /// Queries' map (boxes of 128 rows).
        pub q: TensorMap,
        /// Keys' map (boxes of the key tile).
        pub k: TensorMap,
        /// Values' map (boxes of the key tile).
        pub v: TensorMap,
    }

    /// `FlashBwdParams` of `cuda/params.h` (flash backward): the problem, the forward output
    /// `o` (f32), `d_o` (16-bit), the final `lse`, `delta = rowsum(dO∘O)` (f32 `[b, h_q, s_q]`,
    /// written by the rowsum kernel), the f32 gradients (`dk`, `dv` written, `dq` added into
    /// zeros) and the fixed-point dq's workspace (`dq_unit`, `kv_bound`).
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct FlashBwdParams {
        /// The attention problem.
        pub x: FlashProblem,
        /// Forward output, f32.
        pub o: u64,
        /// Output gradient.
        pub d_o: u64,
        /// Log-sum-exp of the whole key set, f32.
        pub lse: u64,
        /// `rowsum(dO∘O)`, f32.
        pub delta: u64,
        /// Query gradient, f32: written by the dq kernel, or added into the caller's zeros by
        /// the dk/dv kernel (as int32 words until `dqconvert` in fixed point).
        /// [`super::geometry::backward_zeroing`] of the kernel list says which.
        pub dq: u64,
        /// Key gradient, f32.
        pub dk: u64,
        /// Value gradient, f32.
        pub dv: u64,
        /// Fixed-point dq: `[b, h_q, s_q]` f32, one over each row's unit (a power of two),
        /// written by the rowunit kernel.
        pub dq_unit: u64,
        /// Fixed-point dq: `[b, h_kv, 2]` f32, `max |k|` and `max ‖v_j‖` per head, zeroed by
        /// the caller and raised by the kvbound kernel.
        pub kv_bound: u64,
        /// Informational: 0 in the deterministic mode
        /// ([`super::geometry::DqMode::Deterministic`]), 1 when the dk/dv kernel adds dq with
        /// f32 atomics ([`super::geometry::DqMode::Atomic`]).
        pub dq_accum: i32,
        /// Zero.
        pub reserved: i32,
    }

    impl FlashBwdParams {
        /// The problem `x` with the dq mode, every other buffer null.
        pub fn of(x: FlashProblem, dq_mode: super::geometry::DqMode) -> Self {
            FlashBwdParams { x, dq_accum: (dq_mode == super::geometry::DqMode::Atomic) as i32, ..Default::default() }
        }
    }

    /// `FlashBwdHopperParams` of `cuda/params.h` (the sm_90a backward,
    /// `flash_bwd_hopper.cu`): the backward's params and the tensor maps of `q`, `k`, `v` and
    /// `d_o` (4-d views `{d, h, s, b}` with boxes of 64 columns × 1 head × 64 query rows or the
    /// key block's rows × 1, 128-byte swizzled; see [`super::tensor_map::bshd_tile_map`]) and of
    /// `lse` and `delta` (f32 rows of 64, [`super::tensor_map::row_stats_map`]).
    #[repr(C, align(128))]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct FlashBwdHopperParams {
        /// Everything but the maps: 256 bytes, so that the maps sit at 128-byte multiples of
        /// the parameter space (CUDA 13's `CUtensorMap` is `alignas(128)`).
        pub p: FlashBwdParams,
        /// Queries' map (boxes of 64 rows).
        pub q: TensorMap,
        /// Keys' map (boxes of the key block).
        pub k: TensorMap,
        /// Values' map (boxes of the key block).
        pub v: TensorMap,
        /// Output gradient's map (boxes of 64 rows).
        pub d_o: TensorMap,
        /// `lse`'s map (f32, boxes of 64 rows).
        pub lse: TensorMap,
        /// `delta`'s map (f32, boxes of 64 rows).
        pub delta: TensorMap,
    }

    /// `OpsParams` of `cuda/params.h` (the data movements of `cuda/ops.cu`, one struct for
    /// the family): device addresses and sizes, each kernel reading the fields its
    /// constructor below sets (the others are zero). Element types: 4-byte words for `dst`
    /// and `src` (f32 values, or pairs of 16-bit values when a 16-bit buffer moves: see
    /// [`words`]), 16-bit patterns for `dst16` and `src16`, i64 for `heads`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq)]
    pub struct OpsParams {
        /// f32 output (fill, add's accumulator, copy_rows, select_heads, scatter_heads).
        pub dst: u64,
        /// f32 input (add, the conversions, copy_rows, select_heads, scatter_heads).
        pub src: u64,
        /// 16-bit output of the conversions to bf16/f16.
        pub dst16: u64,
        /// 16-bit input of the conversions from bf16/f16.
        pub src16: u64,
        /// `[k]` i64 head indices (select_heads, scatter_heads), each `< h`.
        pub heads: u64,
        /// Elements (fill, add, conversions).
        pub len: i64,
        /// copy_rows: outer count; select/scatter_heads: rows of heads (`b · n`).
        pub b: i64,
        /// copy_rows: rows copied per outer index.
        pub n: i64,
        /// copy_rows: elements per row.
        pub w: i64,
        /// copy_rows: rows per outer index of `src`.
        pub src_rows: i64,
        /// copy_rows: first row read.
        pub src_off: i64,
        /// copy_rows: rows per outer index of `dst`.
        pub dst_rows: i64,
        /// copy_rows: first row written.
        pub dst_off: i64,
        /// select/scatter_heads: heads of the full buffer.
        pub h: i64,
        /// select/scatter_heads: heads listed.
        pub k: i64,
        /// select/scatter_heads: elements per head.
        pub d: i64,
        /// fill: the value.
        pub value: f32,
        /// scatter_heads: 1 writes, 0 adds.
        pub assign: i32,
    }

    impl OpsParams {
        /// `dst[i] = value` for `i < len` (`ringattn_ops_fill_f32`).
        pub fn fill(dst: u64, len: usize, value: f32) -> Self {
            OpsParams { dst, len: len as i64, value, ..Default::default() }
        }

        /// `dst[i] += src[i]` for `i < len` (`ringattn_ops_add_f32`).
        pub fn add(dst: u64, src: u64, len: usize) -> Self {
            OpsParams { dst, src, len: len as i64, ..Default::default() }
        }

        /// `dst[i] = src[i]` rounded to a 16-bit dtype, as f32, for `i < len`
        /// (`ringattn_ops_round_bf16_f32` / `_round_f16_f32`).
        pub fn round(dst: u64, src: u64, len: usize) -> Self {
            OpsParams { dst, src, len: len as i64, ..Default::default() }
        }

        /// `dst16[i] = bits(src[i])` for `i < len` (`ringattn_ops_to_bf16` / `_to_f16`).
        pub fn convert(dst16: u64, src: u64, len: usize) -> Self {
            OpsParams { dst16, src, len: len as i64, ..Default::default() }
        }

        /// `dst[i] = value(src16[i])` for `i < len` (`ringattn_ops_from_bf16` / `_from_f16`).
        pub fn widen(dst: u64, src16: u64, len: usize) -> Self {
            OpsParams { dst, src16, len: len as i64, ..Default::default() }
        }

        /// Rows `src_off..src_off + n` of each of the `b` outer blocks of `src` (`[b,
        /// src_rows, w]`) to rows `dst_off..dst_off + n` of `dst` (`[b, dst_rows, w]`)
        /// (`ringattn_ops_copy_rows_f32`).
        pub fn copy_rows(dst: u64, dst_rows: usize, dst_off: usize, src: u64, src_rows: usize, src_off: usize) -> Self {
            OpsParams {
                dst,
                src,
                dst_rows: dst_rows as i64,
                dst_off: dst_off as i64,
                src_rows: src_rows as i64,
                src_off: src_off as i64,
                ..Default::default()
            }
        }

        /// With `b` outer blocks, `n` rows, `w` elements per row (for [`OpsParams::copy_rows`]).
        pub fn rows(self, b: usize, n: usize, w: usize) -> Self {
            OpsParams { b: b as i64, n: n as i64, w: w as i64, ..self }
        }

        /// select_heads (`full` = `src` `[rows, h, d]` → `part` = `dst` `[rows, k, d]`) or
        /// scatter_heads (`part` = `src` → `full` = `dst`, written when `assign`, else added)
        /// over the `k` head indices at `heads` (`ringattn_ops_select_heads_f32`,
        /// `ringattn_ops_scatter_heads_f32`).
        #[allow(clippy::too_many_arguments)]
        pub fn heads(
            select: bool,
            full: u64,
            part: u64,
            heads: u64,
            rows: usize,
            h: usize,
            k: usize,
            d: usize,
            assign: bool,
        ) -> Self {
            let (dst, src) = if select { (part, full) } else { (full, part) };
            OpsParams {
                dst,
                src,
                heads,
                b: rows as i64,
                h: h as i64,
                k: k as i64,
                d: d as i64,
                assign: assign as i32,
                ..Default::default()
            }
        }
    }

    /// The number of 4-byte words the data-movement kernels (fill, copy_rows, select_heads,
    /// scatter_heads with `assign`) move for `n` values of `elem`: `n` for f32, `n / 2` for
    /// bf16 and f16 (moved as pairs of values: `n` must be even — rows of `[b, s, h, d]`
    /// buffers are, the kernels' head dims being multiples of 8 — and 16-bit device
    /// allocations hold an even number of values).
    ///
    /// ```
    /// use ringattn::kernels::params::words;
    /// use ringattn::Elem;
    /// assert_eq!(words(Elem::BF16, 64, "a row").unwrap(), 32);
    /// assert!(words(Elem::F16, 3, "a row").is_err());
    /// ```
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming `what` for an odd count of 16-bit values or
    /// for bytes.
    pub fn words(elem: crate::Elem, n: usize, what: &str) -> crate::Result<usize> {
        match elem.size_of() {
            4 => Ok(n),
            2 if n.is_multiple_of(2) => Ok(n / 2),
            _ => Err(crate::Error::InvalidArgument(format!(
                "{what}: {n} {elem} values do not make whole 4-byte words for the device's data movements"
            ))),
        }
    }

    /// Elements a device allocation holds for `len` values of `elem`: at least one (the
    /// driver refuses empty allocations) and, for 16-bit values, an even number, so that the
    /// data-movement kernels may move them as pairs ([`words`]) up to the allocation's end.
    ///
    /// ```
    /// use ringattn::{kernels::params::device_capacity, Elem};
    /// assert_eq!((device_capacity(Elem::BF16, 3), device_capacity(Elem::F32, 0)), (4, 1));
    /// ```
    pub fn device_capacity(elem: crate::Elem, len: usize) -> usize {
        match elem.size_of() {
            2 => len.div_ceil(2).max(1) * 2,
            _ => len.max(1),
        }
    }

    /// The 4-byte word of two copies of a 16-bit pattern, as the fill kernel's f32 `value`
    /// (filling `n / 2` words fills `n` 16-bit values).
    pub fn pair_word(bits: u16) -> f32 {
        f32::from_bits(u32::from(bits) << 16 | u32::from(bits))
    }

    /// `TensorMap` of `cuda/params.h`: the 128-byte, 128-byte aligned operand of the bulk
    /// tensor copies — the driver's `CUtensorMap` on a GPU (`alignas(128)` in CUDA 13), the
    /// emulator's encoding of the same fields under the emulator (written by
    /// [`super::tensor_map::TensorMapSpec`]).
    #[repr(C, align(128))]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct TensorMap {
        /// The encoded words.
        pub words: [u64; 16],
    }

    // The same size and alignment as the C structs (static_asserts in cuda/params.h).
    const _: () = assert!(std::mem::size_of::<MergeParams>() == 88);
    const _: () = assert!(std::mem::size_of::<OpsParams>() == 136);
    const _: () = assert!(std::mem::align_of::<OpsParams>() == 8);
    const _: () = assert!(std::mem::align_of::<MergeParams>() == 8);
    const _: () = assert!(std::mem::size_of::<MaskParams>() == 80);
    const _: () = assert!(std::mem::size_of::<ScoreParams>() == 16);
    const _: () = assert!(std::mem::size_of::<FlashProblem>() == 176);
    const _: () = assert!(std::mem::align_of::<FlashProblem>() == 8);
    const _: () = assert!(std::mem::size_of::<FlashFwdParams>() == 200);
    const _: () = assert!(std::mem::align_of::<FlashFwdParams>() == 8);
    const _: () = assert!(std::mem::size_of::<FlashBwdParams>() == 256);
    const _: () = assert!(std::mem::align_of::<FlashBwdParams>() == 8);
    const _: () = assert!(std::mem::size_of::<TensorMap>() == 128);
    const _: () = assert!(std::mem::size_of::<FlashFwdHopperParams>() == 640);
    const _: () = assert!(std::mem::align_of::<FlashFwdHopperParams>() == 128);
    const _: () = assert!(std::mem::align_of::<TensorMap>() == 128);
    const _: () = assert!(std::mem::size_of::<FlashBwdHopperParams>() == 1024);
    const _: () = assert!(std::mem::align_of::<FlashBwdHopperParams>() == 128);
    // Every tensor map at a 128-byte multiple of the parameter space, as in cuda/params.h.
    const _: () = assert!(std::mem::offset_of!(FlashFwdHopperParams, q) == 256);
    const _: () = assert!(std::mem::offset_of!(FlashFwdHopperParams, k) == 384);
    const _: () = assert!(std::mem::offset_of!(FlashFwdHopperParams, v) == 512);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, q) == 256);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, k) == 384);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, v) == 512);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, d_o) == 640);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, lse) == 768);
    const _: () = assert!(std::mem::offset_of!(FlashBwdHopperParams, delta) == 896);
}

pub mod tensor_map;

/// Launch geometry of the flash kernels (`cuda/flash.cuh` documents the same shared-memory
/// layouts): blocks of query rows, key/value tiles ([`geometry::forward_tile`],
/// [`geometry::dkdv_tile`]) staged in shared memory as 16-bit values.
pub mod geometry {
    use crate::{Dims, Error, Result};

    /// Threads per block of the merge kernel (one warp per LSE row).
    pub const MERGE_THREADS: usize = 256;

    /// Largest head dimension of the flash kernels.
    pub const MAX_HEAD_DIM: usize = 256;

    /// Checks that the kernels handle the head dims of `dims`: each a multiple of 8 (16-byte
    /// cp.async rows) from 8 to [`MAX_HEAD_DIM`]. `d_qk` and `d_v` may differ (multi-head
    /// latent attention) when the larger is above 64: the kernels of its head-dim class
    /// ([`OWN_DV_CLASSES`]) run both, the columns past either zero-filled.
    ///
    /// # Errors
    /// [`Error::BackendUnsupported`] naming the head dim.
    pub fn check_head_dims(backend: &'static str, dims: &Dims) -> Result<()> {
        for (name, d) in [("d_qk", dims.d_qk), ("d_v", dims.d_v)] {
            if !d.is_multiple_of(8) || d == 0 || d > MAX_HEAD_DIM {
                return Err(Error::BackendUnsupported {
                    backend,
                    what: format!("head dim {name} = {d} (the kernels take multiples of 8 up to {MAX_HEAD_DIM})"),
                });
            }
        }
        if !dims.equal_head_dims() && dims.d_max() <= 64 {
            return Err(Error::BackendUnsupported {
                backend,
                what: format!(
                    "d_qk = {} with d_v = {} (unequal head dims run on the kernels when the larger is above 64; \
                     the cpu backend takes any)",
                    dims.d_qk, dims.d_v
                ),
            });
        }
        Ok(())
    }

    /// A kernel launch: grid, threads per block, dynamic shared memory, and the head-dim
    /// class of the entry point for kernels instantiated per class.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Launch {
        /// Blocks along x, y, z.
        pub grid: [usize; 3],
        /// Threads per block (x only).
        pub block: usize,
        /// Dynamic shared memory per block, bytes.
        pub smem_bytes: usize,
        /// Head-dim class `D` of the entry point (`..._d{D}`), 0 for kernels without classes.
        pub head_dim_class: usize,
        /// The entry point's variant for V (and O, dO, dV) of their own head dim `d_v`
        /// (multi-head latent attention on the FA2-class kernels; [`ValueDim`]); the Hopper
        /// kernels read V through its tensor map and need none.
        pub value_dim: ValueDim,
    }

    /// How the head dim of V (and O, dO, dV) of a kernel's entry point relates to its class.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum ValueDim {
        /// V shares the head dim of Q and K (`..._d{D}`; `d_v` is not read).
        #[default]
        Shared,
        /// V has its own head dim `d_v`, in tiles of the class `D` (`..._d{D}_dv`, the
        /// classes of [`OWN_DV_CLASSES`]; columns past `d_v` zero-filled and computed).
        Own,
        /// V has its own head dim `d_v`, in tiles of its own class `DV` (`..._d{D}_v{DV}`, the
        /// pairs of [`HEAD_DIM_PAIRS`]): O, dO and dV of `DV` columns only.
        Class(usize),
    }

    impl ValueDim {
        /// The entry point's suffix after `_d{D}`: none, `_dv` or `_v{DV}`.
        pub fn suffix(self) -> String {
            match self {
                ValueDim::Shared => String::new(),
                ValueDim::Own => "_dv".into(),
                ValueDim::Class(dv) => format!("_v{dv}"),
            }
        }

        /// The emulator's code for it (`cuda/emu/kernels_fwd.cpp`): 0 shared, 1 own, else
        /// the class of V.
        pub fn code(self) -> i32 {
            match self {
                ValueDim::Shared => 0,
                ValueDim::Own => 1,
                ValueDim::Class(dv) => dv as i32,
            }
        }
    }

    impl Launch {
        /// Whether the launch has no block (an empty problem: nothing to run).
        pub fn is_empty(&self) -> bool {
            self.grid.contains(&0)
        }
    }

    /// The dynamic shared memory every kernel stays under: the smallest opt-in limit of the
    /// sm_80+ GPUs (99 KiB on sm_86/sm_89).
    pub const SMEM_LIMIT: usize = 99 * 1024;

    /// Head-dim classes of the tensor-core kernels: the head dim rounded up to one of these
    /// (columns past it are zero-filled).
    pub const HEAD_DIM_CLASSES: [usize; 6] = [32, 64, 96, 128, 192, 256];

    /// The head-dim classes whose FA2-class kernels have a variant for V of its own head dim
    /// (`..._d{D}_dv`, [`ValueDim::Own`]): unequal head dims (`d_qk ≠ d_v`) run at the
    /// smallest of these that holds the larger one (above 64; class 128's variant would
    /// spill, so 97–128 run at 192), but for the pairs of [`HEAD_DIM_PAIRS`].
    pub const OWN_DV_CLASSES: [usize; 3] = [96, 192, 256];

    /// `(class of d_qk, class of d_v)` pairs whose FA2-class kernels have entry points of
    /// their own (`..._d{D}_v{DV}`, [`ValueDim::Class`]): multi-head latent attention's (192,
    /// 128) — forward with O of 128 columns and two 16-row m-tiles per warp
    /// (`FwdTraits<192, 128>`), dq with 32-key tiles, dk/dv unsplit (dk of 192 columns, dv of
    /// 128).
    pub const HEAD_DIM_PAIRS: [(usize, usize); 1] = [(192, 128)];

    /// `(class of Q and K, value dim)` of the FA2-class kernels for `dims`: the pair of
    /// [`HEAD_DIM_PAIRS`] that holds `d_qk` and `d_v` (`d_qk` in its class, `d_v` at most its
    /// V class), or [`fa2_head_dim`]'s class with V [`ValueDim::Own`] (unequal head dims) or
    /// [`ValueDim::Shared`].
    pub fn fa2_classes(dims: &Dims) -> (usize, ValueDim) {
        if dims.equal_head_dims() {
            return (head_dim_class(dims.d_qk), ValueDim::Shared);
        }
        let pair = HEAD_DIM_PAIRS.into_iter().find(|&(d, dv)| head_dim_class(dims.d_qk) == d && dims.d_v <= dv);
        match pair {
            Some((d, dv)) => (d, ValueDim::Class(dv)),
            None => (head_dim_class(fa2_head_dim(dims)), ValueDim::Own),
        }
    }

    /// The head dim the FA2-class kernels of `dims` are chosen by: the larger head dim, or with
    /// unequal head dims the [`OWN_DV_CLASSES`] class that holds it (its columns past the data
    /// zero-filled; [`check_head_dims`] refuses what none holds).
    pub fn fa2_head_dim(dims: &Dims) -> usize {
        let d = dims.d_max();
        match dims.equal_head_dims() {
            true => d,
            false => OWN_DV_CLASSES.into_iter().find(|&c| d <= c).unwrap_or(d),
        }
    }

    /// The class of head dimension `d` (at most [`MAX_HEAD_DIM`]).
    pub fn head_dim_class(d: usize) -> usize {
        HEAD_DIM_CLASSES.into_iter().find(|&c| d <= c).unwrap_or(MAX_HEAD_DIM)
    }

    /// Shared-memory row stride (elements) of the swizzled 16-bit tiles of class `dc`
    /// (`FwdTraits::kStride` in `cuda/flash_tc.cuh`): rows of more than 8 chunks of 16 bytes
    /// are padded to a multiple of 8 chunks.
    fn tc_stride(dc: usize) -> usize {
        let chunks = dc / 8;
        if chunks <= 8 {
            dc
        } else {
            chunks.div_ceil(8) * 64
        }
    }

    /// Keys per tile of the tensor-core forward (`FwdTraits::kBlockN`).
    fn tc_block_n(dc: usize) -> usize {
        if dc <= 128 {
            64
        } else {
            32
        }
    }

    /// Query rows per warp of the tensor-core forward (`FwdTraits::kWarpRows`) for `dims`: two
    /// 16-row m-tiles at head-dim classes 32, 64 and 128 (FlashAttention-2's layout) and at
    /// the pair (192, 128), one at 96 and above 128.
    pub fn forward_warp_rows(dims: &Dims) -> usize {
        match fa2_classes(dims) {
            (32 | 64 | 128, _) | (192, ValueDim::Class(128)) => 32,
            _ => 16,
        }
    }

    /// `(query rows, keys)` of one tile of the tensor-core forward for `dims`: 128 × 64 (4
    /// warps of 32 rows) at head-dim classes 32, 64 and 128, 64 × 64 at 96, 64 × 32 above
    /// 128, 128 × 32 at the pair (192, 128).
    pub fn forward_tile(dims: &Dims) -> (usize, usize) {
        (4 * forward_warp_rows(dims), tc_block_n(fa2_classes(dims).0))
    }

    /// `(query rows, keys)` of one tile of the dq kernel for `dims`: the block's 64 query rows
    /// against a streamed key tile of 64, 32 or 16 rows by head-dim class, 32 at the pair
    /// (192, 128).
    pub fn dq_tile(dims: &Dims) -> (usize, usize) {
        match fa2_classes(dims) {
            (_, ValueDim::Class(_)) => (64, 32),
            (dc, _) => (64, bwd_tile(dc)),
        }
    }

    /// `(query rows, keys)` of one tile of the dk/dv kernel (every [`DqAccum`]): a streamed
    /// query tile of 64, 32 or 16 rows by head-dim class against the block's 64 keys.
    pub fn dkdv_tile(d: usize) -> (usize, usize) {
        (bwd_tile(head_dim_class(d)), 64)
    }

    /// The tensor-core forward (`ringattn_flash_fwd_{bf16,f16}_d{D}`, `_d{D}_dv` or
    /// `_d{D}_v{DV}`: [`fa2_classes`]) for `dims`: 4 warps of [`forward_warp_rows`] query
    /// rows, Q staged once, K/V double-buffered (`FwdTraits<D, DV>::kSmem`).
    pub fn forward(dims: &Dims) -> Launch {
        let (dc, value_dim) = fa2_classes(dims);
        let v_stride = match value_dim {
            ValueDim::Class(dv) => tc_stride(dv),
            _ => tc_stride(dc),
        };
        let (block_m, block_n) = forward_tile(dims);
        Launch {
            grid: [dims.s_q.div_ceil(block_m), dims.h_q, dims.b],
            block: 128,
            // Q, K and V double-buffered, and each warp's query bounds (32 bytes).
            smem_bytes: block_m * tc_stride(dc) * 2 + 2 * block_n * (tc_stride(dc) + v_stride) * 2 + 4 * 32,
            head_dim_class: dc,
            value_dim,
        }
    }

    /// Head-dim class of the Hopper forward for head dim `d`: 64, 128 or 256 (columns past
    /// `d` are zero-filled by the tensor copies).
    pub fn hopper_head_dim_class(d: usize) -> usize {
        if d <= 64 {
            64
        } else if d <= 128 {
            128
        } else {
            256
        }
    }

    /// `(query rows, keys)` of one tile of the Hopper forward: 128 query rows (two consumer
    /// warpgroups of 64) against 128 keys up to class 128, 64 at 256.
    pub fn hopper_forward_tile(d: usize) -> (usize, usize) {
        (128, if hopper_head_dim_class(d) <= 128 { 128 } else { 64 })
    }

    /// The sm_90a forward (`ringattn_hopper_flash_fwd_{bf16,f16}_d{64,128,256}`) for `dims`:
    /// 384 threads (a producer warpgroup and two consumer warpgroups), Q once and K/V tiles
    /// in 4, 3 or 2 stages at classes 64, 128, 256 (`HopperFwdTraits<D>::kSmem`: tiles, the
    /// mbarriers, the block's tile-range scratch and 1024 bytes to align the base to the
    /// 128-byte swizzle's repeat).
    pub fn forward_hopper(dims: &Dims) -> Launch {
        let dc = hopper_head_dim_class(dims.d_max());
        let (block_m, block_n) = hopper_forward_tile(dims.d_max());
        // As many K/V stages as fit in 227 KiB with Q (`HopperFwdTraits::kStages`).
        let stages = match dc {
            64 => 4,
            128 => 3,
            _ => 2,
        };
        let tiles = block_m * dc * 2 + 2 * stages * block_n * dc * 2;
        Launch {
            grid: [dims.s_q.div_ceil(block_m), dims.h_q, dims.b],
            block: 384,
            smem_bytes: tiles + 8 * (1 + 3 * stages) + 4 * 12 * 8 + 1024,
            head_dim_class: dc,
            value_dim: ValueDim::Shared,
        }
    }

    /// The rowsum kernel (`ringattn_flash_bwd_rowsum_*`, delta = rowsum(dO∘O)).
    pub fn rowsum(dims: &Dims) -> Launch {
        Launch {
            grid: [(dims.b * dims.h_q * dims.s_q).div_ceil(256), 1, 1],
            block: 256,
            smem_bytes: 0,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    /// Rows of the streamed side per tile in the backward kernels (`DQ_BLOCK_N`,
    /// `DKDV_BLOCK_M` in `cuda/flash.cuh`): smaller for large heads, within 255 registers.
    fn bwd_tile(dc: usize) -> usize {
        match dc {
            0..=64 => 64,
            65..=128 => 32,
            _ => 16,
        }
    }

    /// Blocks of a grid-stride launch of `work` items, `per_block` per block per round: at
    /// least one, at most [`OPS_MAX_BLOCKS`].
    fn stride_blocks(work: usize, per_block: usize) -> usize {
        work.div_ceil(per_block).clamp(1, OPS_MAX_BLOCKS)
    }

    /// The kvbound kernel (`ringattn_flash_bwd_kvbound_*`: `max |k|`, `max ‖v_j‖` per head for
    /// the fixed-point dq): a warp per key row, 8 per block, grid stride.
    pub fn kv_bound(dims: &Dims) -> Launch {
        let rows = dims.b * dims.s_k * dims.h_kv;
        Launch {
            grid: [if rows == 0 { 0 } else { stride_blocks(rows, 8) }, 1, 1],
            block: 256,
            smem_bytes: 0,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    /// The rowunit kernel (`ringattn_flash_bwd_rowunit_*`: each query row's fixed-point unit),
    /// one thread per row as [`rowsum`].
    pub fn row_unit(dims: &Dims) -> Launch {
        rowsum(dims)
    }

    /// The dqconvert kernel (`ringattn_flash_bwd_dqconvert_*`: fixed-point dq to f32 in
    /// place): a warp per row of dq, 8 per block, grid stride.
    pub fn dq_convert(dims: &Dims) -> Launch {
        let rows = dims.b * dims.s_q * dims.h_q;
        Launch {
            grid: [if rows == 0 || dims.d_max() == 0 { 0 } else { stride_blocks(rows, 8) }, 1, 1],
            block: 256,
            smem_bytes: 0,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    /// Shared-memory row strides (elements) of the tiles of Q and K and of V and dO for the
    /// FA2-class kernels of `dims` ([`fa2_classes`]).
    fn tc_strides(dims: &Dims) -> (usize, usize) {
        match fa2_classes(dims) {
            (dc, ValueDim::Class(dv)) => (tc_stride(dc), tc_stride(dv)),
            (dc, _) => (tc_stride(dc), tc_stride(dc)),
        }
    }

    /// The tensor-core dq kernel (`ringattn_flash_bwd_dq_{bf16,f16}_d{D}`, `_dv`, `_v{DV}`;
    /// classes from 192): 4 warps of 16 query rows; Q and dO tiles stay, K/V tiles stream
    /// ([`dq_tile`]; `DqTraits<D, DV>::kSmem`).
    pub fn dq(dims: &Dims) -> Launch {
        let (dc, value_dim) = fa2_classes(dims);
        let (row, v_row) = tc_strides(dims);
        let (row, v_row) = (row * 2, v_row * 2); // bytes
        let block_n = dq_tile(dims).1;
        // Q and dO, K and V in one or two stages, and each warp's query bounds (32 bytes).
        let bounds = 4 * 32;
        let two = 64 * (row + v_row) + 2 * block_n * (row + v_row) + bounds;
        let stages = if two <= SMEM_LIMIT { 2 } else { 1 };
        Launch {
            grid: [dims.s_q.div_ceil(64), dims.h_q, dims.b],
            block: 128,
            smem_bytes: 64 * (row + v_row) + stages * block_n * (row + v_row) + bounds,
            head_dim_class: dc,
            value_dim,
        }
    }

    /// Column ranges of the dk/dv kernel for `dims` (`DkDvTraits::kSplits`, every
    /// [`DqAccum`]): blocks per 64 keys, each with its share of the head dim's columns — two
    /// above head-dim class 128 (registers for the accumulators) but at the pair (192, 128),
    /// one otherwise.
    pub fn dkdv_splits(dims: &Dims) -> usize {
        match fa2_classes(dims) {
            (_, ValueDim::Class(_)) => 1,
            (dc, _) if dc > 128 => 2,
            _ => 1,
        }
    }

    /// The tensor-core dk/dv kernel (`ringattn_flash_bwd_{dkdv,dkdvqfx,dkdvq}_{bf16,f16}_d{D}`
    /// by [`DqAccum`], `_dv`, `_v{DV}`): 4 warps of 16 key rows, one block per 64 keys and
    /// column range; query tiles stream with their lse and delta (and the dq unit in fixed
    /// point); with dq, the block's dS^T is held for its block-level dq product
    /// (`DkDvTraits<D, kAccum, DV>::kSmem`).
    pub fn dkdv(dims: &Dims, accum: DqAccum) -> Launch {
        let (dc, value_dim) = fa2_classes(dims);
        let (row, v_row) = tc_strides(dims);
        let (row, v_row) = (row * 2, v_row * 2); // bytes
        let block_m = dkdv_tile(fa2_head_dim(dims)).0;
        let kv = 64 * (row + v_row);
        let (scalars, ds) = match accum {
            DqAccum::None => (2, 0),
            // dS^T (64 keys x (query tile + 8) 16-bit values) and one flag per warp.
            DqAccum::Fixed | DqAccum::F32 => (3, 64 * (block_m + 8) * 2 + 4 * 4),
        };
        let stage = block_m * (row + v_row) + scalars * block_m * 4;
        let stages = if kv + 2 * stage + ds <= SMEM_LIMIT { 2 } else { 1 };
        Launch {
            grid: [dims.s_k.div_ceil(64) * dkdv_splits(dims), dims.h_kv, dims.b],
            block: 128,
            smem_bytes: kv + stages * stage + ds,
            head_dim_class: dc,
            value_dim,
        }
    }

    /// What the dk/dv kernel does with dq (`DqAccum` of `cuda/flash.cuh`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DqAccum {
        /// Nothing: the dq kernel writes it (`dkdv`).
        None,
        /// Adds it in 32-bit fixed point with integer atomics (`dkdvqfx`).
        Fixed,
        /// Adds it with f32 atomics (`dkdvq`).
        F32,
    }

    /// A backward kernel of `flash_bwd.cu`: the entry point is
    /// `ringattn_flash_bwd_{name}_{bf16|f16}` (with `_d{D}` for the tensor-core kernels).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BackwardKernel {
        /// `delta = rowsum(dO∘O)`.
        Rowsum,
        /// `max |k|`, `max ‖v_j‖` per head (fixed-point dq).
        KvBound,
        /// Each query row's unit (fixed-point dq).
        RowUnit,
        /// `dq` (from class 192, deterministic).
        Dq,
        /// `dk`, `dv`, and dq as the [`DqAccum`] says.
        DkDv(DqAccum),
        /// Fixed-point dq to f32, in place.
        DqConvert,
        /// The sm_90a dk/dv kernel of `flash_bwd_hopper.cu`, which adds dq as the
        /// [`DqAccum`] says (`Fixed` or `F32`): entry points
        /// `ringattn_hopper_flash_bwd_{dkdvqfx|dkdvq}_{bf16|f16}_d{64|128|256}`.
        HopperDkDv(DqAccum),
    }

    impl BackwardKernel {
        /// The entry point's middle name (`rowsum`, `kvbound`, `rowunit`, `dq`, `dkdv`,
        /// `dkdvqfx`, `dkdvq`, `dqconvert`).
        pub fn name(self) -> &'static str {
            match self {
                BackwardKernel::Rowsum => "rowsum",
                BackwardKernel::KvBound => "kvbound",
                BackwardKernel::RowUnit => "rowunit",
                BackwardKernel::Dq => "dq",
                BackwardKernel::DkDv(DqAccum::None) => "dkdv",
                BackwardKernel::DkDv(DqAccum::Fixed) => "dkdvqfx",
                BackwardKernel::DkDv(DqAccum::F32) => "dkdvq",
                BackwardKernel::DqConvert => "dqconvert",
                BackwardKernel::HopperDkDv(DqAccum::F32) => "hopper_dkdvq",
                BackwardKernel::HopperDkDv(_) => "hopper_dkdvqfx",
            }
        }

        /// The kernel family (`cuda/` file stem) holding this kernel.
        pub fn family(self) -> &'static str {
            match self {
                BackwardKernel::HopperDkDv(_) => "flash_bwd_hopper",
                _ => "flash_bwd",
            }
        }

        /// The entry point's name for `dtype` without the head-dim class suffix:
        /// `ringattn_flash_bwd_{name}_{bf16|f16}`, `ringattn_hopper_flash_bwd_{dkdvqfx|dkdvq}_…`.
        pub fn entry_base(self, dtype: crate::DType) -> String {
            let ty = if dtype == crate::DType::F16 { "f16" } else { "bf16" };
            match self {
                BackwardKernel::HopperDkDv(DqAccum::F32) => format!("ringattn_hopper_flash_bwd_dkdvq_{ty}"),
                BackwardKernel::HopperDkDv(_) => format!("ringattn_hopper_flash_bwd_dkdvqfx_{ty}"),
                k => format!("ringattn_flash_bwd_{}_{ty}", k.name()),
            }
        }

        /// Whether this kernel adds into dq (the caller zeroes dq first).
        pub fn adds_dq(self) -> bool {
            matches!(self, BackwardKernel::DkDv(DqAccum::Fixed | DqAccum::F32) | BackwardKernel::HopperDkDv(_))
        }
    }

    /// Which family of tensor-core kernels runs the forward and the backward.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum KernelFamily {
        /// The FA2 family, for now: the Hopper family, which has run under the emulator
        /// only, becomes auto's choice on compute capability 9.0 (where its sm_90a image is
        /// present and the inputs are 16-byte aligned) once it has been verified on a GPU.
        /// The emulator, which has no compute capability, runs the FA2 family.
        #[default]
        Auto,
        /// The FlashAttention-2 class kernels (`flash_fwd.cu`, mma.sync): every GPU, every
        /// shape.
        Fa2,
        /// The sm_90a kernels (`flash_fwd_hopper.cu`, `flash_bwd_hopper.cu`: wgmma, TMA,
        /// mbarriers, warp specialisation) for the forward and the backward's dk/dv/dq kernel
        /// (the small kernels around it are the FA2 family's); the emulator runs them
        /// whatever the host.
        Hopper,
    }

    impl std::str::FromStr for KernelFamily {
        type Err = crate::Error;
        fn from_str(s: &str) -> crate::Result<Self> {
            match s {
                "auto" => Ok(KernelFamily::Auto),
                "fa2" => Ok(KernelFamily::Fa2),
                "hopper" => Ok(KernelFamily::Hopper),
                _ => Err(crate::Error::InvalidArgument(format!("--kernels `{s}` (available: auto, fa2, hopper)"))),
            }
        }
    }

    /// How the backward computes dq.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum DqMode {
        /// Bit-identical run to run whatever order the blocks run in. Up to head-dim class 128
        /// the dk/dv kernel adds dq in 32-bit fixed point with integer atomics (S and dP once
        /// per pair: five products), each query row in its own power-of-two unit from a bound
        /// on `|dq|` (the kvbound and rowunit kernels before it), converted to f32 after:
        /// integer addition is associative, and the rounding error (`2^-30` of the row's
        /// bound per 64-key block) is below f32 accumulation's. From class 192 (where a dk/dv
        /// kernel splits the columns, so computes S and dP twice anyway) a dq kernel
        /// recomputes S and dP beside the dk/dv kernel: no atomics.
        #[default]
        Deterministic,
        /// The dk/dv kernel adds dq with f32 atomics at every class: no bound, conversion or
        /// dq kernel, but the order of the additions, hence the last bits of dq, varies.
        Atomic,
    }

    /// What the dk/dv kernel of a backward of head dim `d` in `mode` does with dq: adds it
    /// with f32 atomics ([`DqMode::Atomic`]), in fixed point (deterministic up to head-dim
    /// class 128), or nothing (deterministic from 192: the dq kernel writes it).
    pub fn dkdv_accum(d: usize, mode: DqMode) -> DqAccum {
        match mode {
            DqMode::Atomic => DqAccum::F32,
            DqMode::Deterministic if head_dim_class(d) <= 128 => DqAccum::Fixed,
            DqMode::Deterministic => DqAccum::None,
        }
    }

    /// The kernels of a backward, in launch order, with their launches; `with_rowsum` is
    /// false when the caller already has `delta` (the ring computes it once per query block).
    /// The caller zeroes what [`backward_zeroing`] of the list names (dq when a kernel adds
    /// into it, the K/V bounds in fixed point).
    pub fn backward(dims: &Dims, with_rowsum: bool, mode: DqMode) -> Vec<(BackwardKernel, Launch)> {
        let mut v = Vec::with_capacity(5);
        if with_rowsum {
            v.push((BackwardKernel::Rowsum, rowsum(dims)));
        }
        let accum = dkdv_accum(fa2_head_dim(dims), mode);
        match accum {
            DqAccum::F32 => {}
            DqAccum::Fixed => {
                v.push((BackwardKernel::KvBound, kv_bound(dims)));
                v.push((BackwardKernel::RowUnit, row_unit(dims)));
            }
            DqAccum::None => v.push((BackwardKernel::Dq, dq(dims))),
        }
        v.push((BackwardKernel::DkDv(accum), dkdv(dims, accum)));
        if accum == DqAccum::Fixed {
            v.push((BackwardKernel::DqConvert, dq_convert(dims)));
        }
        v
    }

    /// Keys per block of the Hopper backward (`HopperBwdTraits<D>::kBlockN`): 128 (two
    /// consumer warpgroups of 64 keys) up to class 128, 64 at 256 (the warpgroups split the
    /// columns).
    pub fn hopper_backward_block(d: usize) -> usize {
        if hopper_head_dim_class(d) <= 128 {
            128
        } else {
            64
        }
    }

    /// The sm_90a dk/dv kernel with dq (`ringattn_hopper_flash_bwd_{dkdvqfx,dkdvq}_*_d{64,128,256}`):
    /// 384 threads (a producer warpgroup and two consumers), a block per
    /// [`hopper_backward_block`] keys; K and V once, Q and dO tiles of 64 rows in 4, 3 or 2
    /// stages at classes 64, 128, 256 (with their lse and delta rows), the two warpgroups'
    /// dS^T tiles, the mbarriers, the block's tile range and its scratch, and 1024 bytes to align the base
    /// (`HopperBwdTraits<D>::kSmem`).
    pub fn dkdv_hopper(dims: &Dims) -> Launch {
        let dc = hopper_head_dim_class(dims.d_max());
        let block_n = hopper_backward_block(dims.d_max());
        let stages = match dc {
            64 => 4,
            128 => 3,
            _ => 2,
        };
        let tiles = 2 * block_n * dc * 2 + stages * 2 * 64 * dc * 2 + 2 * 64 * 64 * 2;
        // Per stage the query tile's lse and delta (64 f32 each).
        let stats = stages * 2 * 64 * 4;
        Launch {
            grid: [dims.s_k.div_ceil(block_n), dims.h_kv, dims.b],
            block: 384,
            // + the mbarriers, the tile range (two i32), the scratch of the block's tile range.
            smem_bytes: tiles + stats + 8 * (1 + 2 * stages) + 8 + 4 * 12 * 8 + 1024,
            head_dim_class: dc,
            value_dim: ValueDim::Shared,
        }
    }

    /// The kernels of a backward on the Hopper family, in launch order, with their launches:
    /// as [`backward`], with the sm_90a dk/dv kernel, which adds dq at every head-dim class
    /// (in fixed point under [`DqMode::Deterministic`], with the kvbound and rowunit kernels
    /// before it and dqconvert after; with f32 atomics under [`DqMode::Atomic`]). The caller
    /// zeroes dq (every kernel list here adds into it, [`BackwardKernel::adds_dq`]) and, in
    /// fixed point, the K/V bounds.
    pub fn backward_hopper(dims: &Dims, with_rowsum: bool, mode: DqMode) -> Vec<(BackwardKernel, Launch)> {
        let mut v = Vec::with_capacity(5);
        if with_rowsum {
            v.push((BackwardKernel::Rowsum, rowsum(dims)));
        }
        let accum = match mode {
            DqMode::Deterministic => DqAccum::Fixed,
            DqMode::Atomic => DqAccum::F32,
        };
        if accum == DqAccum::Fixed {
            v.push((BackwardKernel::KvBound, kv_bound(dims)));
            v.push((BackwardKernel::RowUnit, row_unit(dims)));
        }
        v.push((BackwardKernel::HopperDkDv(accum), dkdv_hopper(dims)));
        if accum == DqAccum::Fixed {
            v.push((BackwardKernel::DqConvert, dq_convert(dims)));
        }
        v
    }

    /// The backward family that honours `spec` when `family` is asked for: the Hopper dk/dv
    /// kernel of head-dim class 128 has no soft-capped variant (`kHopperCappedAt` in
    /// `cuda/flash_bwd_hopper.cu`: it would take the consumer past its 168 registers), so a
    /// soft-capped backward of that class runs on the FA2 family, which takes it (on sm_90a).
    ///
    /// ```
    /// use ringattn::attention::ScoreSpec;
    /// use ringattn::kernels::geometry::{backward_family, Backward};
    /// use ringattn::Dims;
    /// let dims = Dims { b: 1, s_q: 64, s_k: 64, h_q: 2, h_kv: 1, d_qk: 128, d_v: 128 };
    /// let capped = ScoreSpec { scale: 0.1, softcap: Some(30.0) };
    /// assert_eq!(backward_family(Backward::Hopper, &dims, &capped), Backward::Fa2);
    /// assert_eq!(backward_family(Backward::Hopper, &dims, &ScoreSpec { softcap: None, ..capped }), Backward::Hopper);
    /// ```
    pub fn backward_family(family: Backward, dims: &Dims, spec: &crate::attention::ScoreSpec) -> Backward {
        let capped_missing = spec.softcap.is_some() && hopper_head_dim_class(dims.d_max()) == 128;
        match family {
            Backward::Hopper if capped_missing => Backward::Fa2,
            f => f,
        }
    }

    /// Whether the FA2 backward of `dims` honours `spec` on a device of compute capability
    /// `cc`: on sm_100 and later its dk/dv kernel of head-dim class 128 has no soft-capped
    /// variant (`RINGATTN_CAPPED_AT` in `cuda/flash_bwd.cu`: beside the plain one, which holds
    /// 254-255 registers there, it spills whatever its unrolling), and no other family runs
    /// there.
    ///
    /// # Errors
    /// [`crate::Error::BackendUnsupported`] naming the soft-cap, the head-dim class and the
    /// compute capability.
    pub fn check_capped_backward(
        backend: &'static str,
        dims: &Dims,
        spec: &crate::attention::ScoreSpec,
        cc: (i32, i32),
    ) -> crate::Result<()> {
        let class = head_dim_class(fa2_head_dim(dims));
        match spec.modifiers() {
            Some(option) if spec.softcap.is_some() && cc.0 >= 10 && class == 128 => {
                Err(crate::Error::BackendUnsupported {
                    backend,
                    what: format!(
                        "{option} in the backward at head-dim class 128 on compute capability {}.{} (its kernel \
                         has no soft-capped variant there; the forward takes it, the cpu backend both)",
                        cc.0, cc.1
                    ),
                })
            }
            _ => Ok(()),
        }
    }

    /// The backward's kernels on `family` ([`backward_hopper`] or [`backward`]).
    pub fn backward_on(
        family: Backward,
        dims: &Dims,
        with_rowsum: bool,
        mode: DqMode,
    ) -> Vec<(BackwardKernel, Launch)> {
        match family {
            Backward::Fa2 => backward(dims, with_rowsum, mode),
            Backward::Hopper => backward_hopper(dims, with_rowsum, mode),
        }
    }

    /// The family a backward runs on, once [`KernelFamily`] is resolved for the device.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum Backward {
        /// `flash_bwd.cu` (mma.sync).
        #[default]
        Fa2,
        /// `flash_bwd_hopper.cu` (wgmma, TMA, mbarriers) for the dk/dv kernel, `flash_bwd.cu`
        /// for the small kernels around it.
        Hopper,
    }

    /// What the caller of a backward's kernels zeroes before they run.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub struct BackwardZeroing {
        /// dq: a kernel adds into it.
        pub dq: bool,
        /// The K/V bounds of the fixed-point dq's workspace: the kvbound kernel raises them.
        pub kv_bounds: bool,
    }

    /// What `kernels` (a [`backward`] or [`backward_hopper`] list) asks the caller to zero.
    pub fn backward_zeroing(kernels: &[(BackwardKernel, Launch)]) -> BackwardZeroing {
        BackwardZeroing {
            dq: kernels.iter().any(|(k, _)| k.adds_dq()),
            kv_bounds: kernels.iter().any(|(k, _)| *k == BackwardKernel::KvBound),
        }
    }

    /// Threads per block of the ops kernels (`cuda/ops.cu`).
    pub const OPS_THREADS: usize = 256;

    /// Most blocks of an ops launch: the kernels loop over their work items (grid stride),
    /// so a capped grid covers any size.
    pub const OPS_MAX_BLOCKS: usize = 4096;

    /// A kernel of `cuda/ops.cu`. The discriminant is the kernel's number in the emulator's
    /// entry point (`ringattn_emu_ops` in `cuda/emu/kernels.cpp`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum OpsKernel {
        /// `ringattn_ops_fill_f32`.
        Fill = 0,
        /// `ringattn_ops_add_f32`.
        Add = 1,
        /// `ringattn_ops_to_bf16`.
        ToBf16 = 2,
        /// `ringattn_ops_to_f16`.
        ToF16 = 3,
        /// `ringattn_ops_copy_rows_f32`.
        CopyRows = 4,
        /// `ringattn_ops_select_heads_f32`.
        SelectHeads = 5,
        /// `ringattn_ops_scatter_heads_f32`.
        ScatterHeads = 6,
        /// `ringattn_ops_round_bf16_f32`.
        RoundBf16 = 7,
        /// `ringattn_ops_round_f16_f32`.
        RoundF16 = 8,
        /// `ringattn_ops_from_bf16`.
        FromBf16 = 9,
        /// `ringattn_ops_from_f16`.
        FromF16 = 10,
    }

    impl OpsKernel {
        /// Every ops kernel.
        pub const ALL: [OpsKernel; 11] = [
            OpsKernel::Fill,
            OpsKernel::Add,
            OpsKernel::ToBf16,
            OpsKernel::ToF16,
            OpsKernel::CopyRows,
            OpsKernel::SelectHeads,
            OpsKernel::ScatterHeads,
            OpsKernel::RoundBf16,
            OpsKernel::RoundF16,
            OpsKernel::FromBf16,
            OpsKernel::FromF16,
        ];

        /// The entry point.
        pub fn entry(self) -> &'static str {
            match self {
                OpsKernel::Fill => "ringattn_ops_fill_f32",
                OpsKernel::Add => "ringattn_ops_add_f32",
                OpsKernel::ToBf16 => "ringattn_ops_to_bf16",
                OpsKernel::ToF16 => "ringattn_ops_to_f16",
                OpsKernel::CopyRows => "ringattn_ops_copy_rows_f32",
                OpsKernel::SelectHeads => "ringattn_ops_select_heads_f32",
                OpsKernel::ScatterHeads => "ringattn_ops_scatter_heads_f32",
                OpsKernel::RoundBf16 => "ringattn_ops_round_bf16_f32",
                OpsKernel::RoundF16 => "ringattn_ops_round_f16_f32",
                OpsKernel::FromBf16 => "ringattn_ops_from_bf16",
                OpsKernel::FromF16 => "ringattn_ops_from_f16",
            }
        }

        /// The conversion to the 16-bit patterns of `dtype` (f16 for [`crate::DType::F16`],
        /// bf16 otherwise).
        pub fn convert_to(dtype: crate::DType) -> OpsKernel {
            if dtype == crate::DType::F16 {
                OpsKernel::ToF16
            } else {
                OpsKernel::ToBf16
            }
        }

        /// The widening of the 16-bit patterns of `dtype` to f32 (`None` for f32: nothing to
        /// do).
        pub fn convert_from(dtype: crate::DType) -> Option<OpsKernel> {
            match dtype {
                crate::DType::F32 => None,
                crate::DType::BF16 => Some(OpsKernel::FromBf16),
                crate::DType::F16 => Some(OpsKernel::FromF16),
            }
        }

        /// The rounding of f32 values to `dtype`, kept as f32 (`None` for f32: nothing to do).
        pub fn round_to(dtype: crate::DType) -> Option<OpsKernel> {
            match dtype {
                crate::DType::F32 => None,
                crate::DType::BF16 => Some(OpsKernel::RoundBf16),
                crate::DType::F16 => Some(OpsKernel::RoundF16),
            }
        }

        /// Work items of a launch with `p` (one per thread per grid-stride iteration):
        /// `len` for fill, add, the conversions and roundings, `b·n·w` for copy_rows, `b·k·d` for
        /// select_heads, `b·d` for scatter_heads (each thread walks the `k` heads).
        pub fn work(self, p: &super::params::OpsParams) -> usize {
            let n = match self {
                OpsKernel::Fill
                | OpsKernel::Add
                | OpsKernel::ToBf16
                | OpsKernel::ToF16
                | OpsKernel::RoundBf16
                | OpsKernel::RoundF16
                | OpsKernel::FromBf16
                | OpsKernel::FromF16 => p.len,
                OpsKernel::CopyRows => p.b * p.n * p.w,
                OpsKernel::SelectHeads => p.b * p.k * p.d,
                OpsKernel::ScatterHeads => {
                    if p.k == 0 {
                        0
                    } else {
                        p.b * p.d
                    }
                }
            };
            n.max(0) as usize
        }
    }

    /// The launch of ops kernel `kernel` with `p`: [`OPS_THREADS`] threads per block, one
    /// work item per thread, at most [`OPS_MAX_BLOCKS`] blocks (grid stride beyond); empty
    /// when there is no work.
    pub fn ops(kernel: OpsKernel, p: &super::params::OpsParams) -> Launch {
        let work = kernel.work(p);
        Launch {
            grid: [work.div_ceil(OPS_THREADS).min(OPS_MAX_BLOCKS), 1, 1],
            block: OPS_THREADS,
            smem_bytes: 0,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    /// Threads per block of the sinks' gradient (one block per head).
    pub const SINK_GRAD_THREADS: usize = 256;

    /// The sinks' gradient (`ringattn_sink_grad_f32`) over `h` heads: one block per head,
    /// its threads striding over the head's rows, then a fixed-order tree sum in shared
    /// memory (one f32 per thread; deterministic).
    pub fn sink_grad(h: usize) -> Launch {
        Launch {
            grid: [h, 1, 1],
            block: SINK_GRAD_THREADS,
            smem_bytes: SINK_GRAD_THREADS * 4,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    /// The merge kernel (`ringattn_merge_f32`) and the sinks' merge
    /// (`ringattn_merge_sinks_f32`) for `rows` LSE rows: one warp per row.
    pub fn merge(rows: usize) -> Launch {
        Launch {
            grid: [(rows * 32).div_ceil(MERGE_THREADS), 1, 1],
            block: MERGE_THREADS,
            smem_bytes: 0,
            head_dim_class: 0,
            value_dim: ValueDim::Shared,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Unequal head dims choose their forward entry point: the (192, 128) pair's own when
        /// d_qk is in class 192 and d_v at most 128 (with its tiles: 128 query rows, V rows of
        /// 128 columns in shared memory), class `_dv` variants otherwise.
        #[test]
        fn unequal_head_dims_pick_the_pair_entry_point_where_it_holds_them() {
            let dims = |d_qk, d_v| Dims { b: 1, s_q: 300, s_k: 300, h_q: 2, h_kv: 1, d_qk, d_v };
            assert_eq!(fa2_classes(&dims(192, 128)), (192, ValueDim::Class(128)));
            assert_eq!(fa2_classes(&dims(136, 8)), (192, ValueDim::Class(128)));
            assert_eq!(fa2_classes(&dims(192, 136)), (192, ValueDim::Own));
            assert_eq!(fa2_classes(&dims(128, 64)), (192, ValueDim::Own));
            assert_eq!(fa2_classes(&dims(96, 64)), (96, ValueDim::Own));
            assert_eq!(fa2_classes(&dims(192, 192)), (192, ValueDim::Shared));
            let l = forward(&dims(192, 128));
            assert_eq!((l.grid, l.head_dim_class, l.value_dim), ([3, 2, 1], 192, ValueDim::Class(128)));
            // Q (128 rows of 384 bytes), K (2 x 32 rows of 384), V (2 x 32 rows of 256), bounds.
            assert_eq!(l.smem_bytes, 128 * 384 + 2 * 32 * 384 + 2 * 32 * 256 + 128);
            assert_eq!(forward_tile(&dims(192, 128)), (128, 32));
            assert_eq!(forward_tile(&dims(192, 136)), (64, 32));
            // The backward's: dq with 32-key tiles, dk/dv unsplit, V and dO rows of 128 columns.
            let (q, kv) = (dq(&dims(192, 128)), dkdv(&dims(192, 128), DqAccum::None));
            assert_eq!((q.value_dim, kv.value_dim), (ValueDim::Class(128), ValueDim::Class(128)));
            assert_eq!((dq_tile(&dims(192, 128)), dq_tile(&dims(192, 136))), ((64, 32), (64, 16)));
            assert_eq!((dkdv_splits(&dims(192, 128)), dkdv_splits(&dims(192, 136))), (1, 2));
            assert_eq!(q.smem_bytes, 64 * (384 + 256) + 2 * 32 * (384 + 256) + 128);
            assert_eq!(kv.grid, [5, 1, 1]);
            assert_eq!(kv.smem_bytes, 64 * (384 + 256) + 2 * (16 * (384 + 256) + 2 * 16 * 4));
            assert_eq!(ValueDim::Class(128).suffix(), "_v128");
            assert_eq!((ValueDim::Own.suffix(), ValueDim::Shared.suffix()), ("_dv".to_string(), String::new()));
        }

        /// A soft-capped backward is refused on sm_100 and later at FA2 class 128 (and only
        /// there: other classes, other devices, the plain scores, d_v of its own class), and
        /// leaves the Hopper family for the FA2 one at Hopper class 128 only.
        #[test]
        fn soft_capped_backwards_where_the_kernels_lack_the_variant() {
            use crate::attention::ScoreSpec;
            let dims = |d_qk, d_v| Dims { b: 1, s_q: 8, s_k: 8, h_q: 1, h_kv: 1, d_qk, d_v };
            let capped = ScoreSpec { scale: 0.1, softcap: Some(50.0) };
            let plain = ScoreSpec { softcap: None, ..capped };
            let refused = |d: Dims, spec: &ScoreSpec, cc| check_capped_backward("cuda", &d, spec, cc).is_err();
            assert!(refused(dims(128, 128), &capped, (10, 0)) && refused(dims(112, 112), &capped, (12, 0)));
            let e = check_capped_backward("cuda", &dims(128, 128), &capped, (10, 0)).unwrap_err().to_string();
            assert!(e.contains("softcap = 50") && e.contains("class 128") && e.contains("10.0"), "{e}");
            assert!(!e.contains("  "), "one space between words: {e}");
            assert!(!refused(dims(128, 128), &capped, (9, 0)) && !refused(dims(128, 128), &plain, (10, 0)));
            assert!(!refused(dims(64, 64), &capped, (10, 0)) && !refused(dims(256, 256), &capped, (10, 0)));
            assert!(!refused(dims(128, 96), &capped, (10, 0)), "d_v of its own: class 192");
            assert_eq!(backward_family(Backward::Hopper, &dims(128, 128), &capped), Backward::Fa2);
            assert_eq!(backward_family(Backward::Hopper, &dims(64, 64), &capped), Backward::Hopper);
            assert_eq!(backward_family(Backward::Hopper, &dims(128, 128), &plain), Backward::Hopper);
            assert_eq!(backward_family(Backward::Fa2, &dims(128, 128), &capped), Backward::Fa2);
        }

        #[test]
        fn every_kernel_fits_in_99_kib_of_shared_memory() {
            for d in (8..=MAX_HEAD_DIM).step_by(8) {
                let dims = Dims { b: 2, s_q: 100, s_k: 70, h_q: 4, h_kv: 2, d_qk: d, d_v: d };
                let adding = [dkdv(&dims, DqAccum::None), dkdv(&dims, DqAccum::Fixed), dkdv(&dims, DqAccum::F32)];
                for l in [forward(&dims), dq(&dims)].into_iter().chain(adding) {
                    assert!(l.smem_bytes <= 99 * 1024, "d = {d}: {l:?}");
                    assert!(!l.is_empty());
                }
            }
            let heads = |d_qk, d_v| Dims { b: 1, s_q: 1, s_k: 1, h_q: 1, h_kv: 1, d_qk, d_v };
            assert!(check_head_dims("emu", &heads(80, 80)).is_ok());
            let e = check_head_dims("emu", &heads(20, 20)).unwrap_err().to_string();
            assert!(e.contains("head dim d_qk = 20") && e.contains("emu"), "{e}");
            assert!(check_head_dims("emu", &heads(264, 264)).is_err());
            let e = check_head_dims("emu", &heads(64, 20)).unwrap_err().to_string();
            assert!(e.contains("d_v = 20"), "{e}");
            assert!(check_head_dims("emu", &heads(192, 128)).is_ok());
            assert!(check_head_dims("emu", &heads(64, 128)).is_ok());
            let e = check_head_dims("emu", &heads(64, 32)).unwrap_err().to_string();
            assert!(e.contains("d_qk = 64 with d_v = 32"), "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_match_the_build() {
        if cfg!(has_nvcc) {
            for family in ["flash_fwd", "flash_bwd"] {
                assert!(images().iter().any(|i| i.family == family && i.kind == ImageKind::Cubin), "{family}");
            }
            let merge: Vec<_> = images().iter().filter(|i| i.family == "merge").collect();
            assert!(merge.iter().any(|i| i.kind == ImageKind::Ptx), "PTX for newer GPUs");
            for i in &merge {
                match i.kind {
                    ImageKind::Cubin => assert_eq!(&i.bytes().unwrap()[..4], b"\x7fELF", "{} cubin", i.target),
                    ImageKind::Ptx => {
                        let text = std::str::from_utf8(i.bytes().unwrap()).unwrap();
                        assert!(text.contains(".target") && text.contains("ringattn_merge_f32"));
                    }
                }
            }
            assert!(merge.iter().filter(|i| i.kind == ImageKind::Cubin).count() >= 1);
        } else {
            assert!(images().is_empty() && !compiled());
        }
    }
}
