//! Device buffers of the GPU-resident API: the mask's positions and document ids, the forward's
//! saved outputs, the gradients, the arguments of a launch, and the transfers between them
//! and the host.

use std::sync::Arc;

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, ValidAsZeroBits};

use super::probe::guard;
use super::CudaDevice;
use crate::params::Visibility;
use crate::{AttentionParams, DType, Dims, Positions, Result};

/// The visibility of one call on the device: global positions of the query rows (`q_pos`,
/// `[s_q]` i64) and key rows (`k_pos`, `[s_k]` i64), optional packed-document ids (`[s_q]`
/// and `[s_k]` u32, both or neither), and the window: key `j` is visible to query `i` iff
/// `k_pos[j] >= q_pos[i] - window_left` (when `window_left >= 0`), `k_pos[j] <= q_pos[i] +
/// window_right` (when `window_right >= 0`) and, with documents, `q_doc[i] == k_doc[j]`; a
/// negative side is unbounded (causal is `(-1, 0)`).
///
/// The buffers belong to the caller: a ring driver rewrites `k_pos` (`memcpy_htod`) as K/V
/// blocks travel instead of building a new mask per hop.
#[derive(Debug)]
pub struct DeviceMask {
    /// `[s_q]` global positions of the query rows.
    pub q_pos: CudaSlice<i64>,
    /// `[s_k]` global positions of the key rows.
    pub k_pos: CudaSlice<i64>,
    /// `[s_q]` document of each query row, with packed documents.
    pub q_doc: Option<CudaSlice<u32>>,
    /// `[s_k]` document of each key row, with packed documents.
    pub k_doc: Option<CudaSlice<u32>>,
    /// How far back a query sees; negative: unbounded.
    pub window_left: i64,
    /// How far ahead a query sees; negative: unbounded.
    pub window_right: i64,
    /// Min and max key position per granule of `kernels::params::MASK_GRANULE` keys
    /// (`[ceil(s_k / 32)][2]` i64): lets the kernels classify a tile as fully visible or
    /// fully masked without reading its positions. `None`: no classification.
    pub k_bounds: Option<CudaSlice<i64>>,
    /// Min and max key document per granule (`[ceil(s_k / 32)][2]` u32), with documents.
    pub k_doc_bounds: Option<CudaSlice<u32>>,
    /// The same per granule of queries (`[ceil(s_q / 32)][2]`; for the kernels that stream
    /// query tiles): present exactly when `k_bounds` is.
    pub q_bounds: Option<CudaSlice<i64>>,
    /// Min and max query document per granule, with documents (and `q_bounds`).
    pub q_doc_bounds: Option<CudaSlice<u32>>,
}

impl DeviceMask {
    /// Uploads the visibility of a call with `dims` under `params`: single-device positions
    /// (`pos_q(i) = i + s_k - s_q`, `pos_k(j) = j`) when `positions` is `None`, the given
    /// global positions otherwise (as [`crate::cpu::forward_at`]). Synchronous: the positions
    /// are on the device when it returns.
    ///
    /// # Errors
    /// [`crate::Error::Positions`] or [`crate::Error::Documents`] for positions or documents
    /// that disagree with `dims`, [`crate::Error::Scale`] for a non-finite scale,
    /// [`crate::Error::Cuda`] when an allocation or copy fails.
    pub fn new(
        stream: &Arc<CudaStream>,
        dims: &Dims,
        positions: Option<(&Positions, &Positions)>,
        params: &AttentionParams,
    ) -> Result<DeviceMask> {
        DeviceMask::upload(stream, &crate::attention::visibility(dims, positions, params)?)
    }

    pub(crate) fn upload(stream: &Arc<CudaStream>, vis: &Visibility) -> Result<DeviceMask> {
        let docs = |d: &Option<Vec<u32>>| d.as_deref().map(|d| upload(stream, d)).transpose();
        let bounds = crate::runner::MaskBounds::of(vis);
        let side = |side: Option<&crate::runner::SideBounds>| -> Result<_> {
            Ok(match side {
                Some((pos, doc)) => (Some(upload(stream, pos)?), docs(doc)?),
                None => (None, None),
            })
        };
        let (k_bounds, k_doc_bounds) = side(bounds.as_ref().map(|b| &b.keys))?;
        let (q_bounds, q_doc_bounds) = side(bounds.as_ref().map(|b| &b.queries))?;
        Ok(DeviceMask {
            q_pos: upload(stream, &vis.q_pos)?,
            k_pos: upload(stream, &vis.k_pos)?,
            q_doc: docs(&vis.q_doc)?,
            k_doc: docs(&vis.k_doc)?,
            window_left: vis.left.unwrap_or(-1),
            window_right: vis.right.unwrap_or(-1),
            k_bounds,
            k_doc_bounds,
            q_bounds,
            q_doc_bounds,
        })
    }
}

/// What the forward saves for the backward: `o` `[b, s_q, h_q, d]` and `lse` `[b, h_q,
/// s_q]` (natural log; `-inf` for a row that sees no key), both f32 and unrounded.
#[derive(Debug)]
pub struct SavedContext {
    /// Output, f32.
    pub o: CudaSlice<f32>,
    /// Log-sum-exp, f32.
    pub lse: CudaSlice<f32>,
}

impl SavedContext {
    /// Buffers for a forward of `dims`, filled with NaN (an element a kernel failed to write
    /// shows up in any check).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the allocation fails.
    pub fn alloc(stream: &Arc<CudaStream>, dims: &Dims) -> Result<SavedContext> {
        Ok(SavedContext { o: alloc_nan(stream, o_len(dims))?, lse: alloc_nan(stream, lse_len(dims))? })
    }
}

/// Gradients on the device, f32 and unrounded: `dq` `[b, s_q, h_q, d]`, `dk` and `dv` `[b,
/// s_k, h_kv, d]`, with the deterministic dq's workspace. A backward overwrites them (it does
/// not accumulate into them).
#[derive(Debug)]
pub struct DeviceGradients {
    /// Query gradient.
    pub dq: CudaSlice<f32>,
    /// Key gradient.
    pub dk: CudaSlice<f32>,
    /// Value gradient.
    pub dv: CudaSlice<f32>,
    /// Workspace of the fixed-point dq ([`crate::kernels::geometry::DqMode::Deterministic`]):
    /// each query row's unit (`[b, h_q, s_q]`) then `max |k|`, `max ‖v_j‖` per key head
    /// (`[b, h_kv, 2]`), f32; see [`dq_workspace_len`].
    pub dq_work: CudaSlice<f32>,
}

impl DeviceGradients {
    /// Buffers for a backward of `dims`, filled with NaN.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the allocation fails.
    pub fn alloc(stream: &Arc<CudaStream>, dims: &Dims) -> Result<DeviceGradients> {
        Ok(DeviceGradients {
            dq: alloc_nan(stream, q_len(dims))?,
            dk: alloc_nan(stream, k_len(dims))?,
            dv: alloc_nan(stream, v_len(dims))?,
            dq_work: alloc_nan(stream, dq_workspace_len(dims))?,
        })
    }
}

/// The inputs of a forward on the device: `q` `[b, s_q, h_q, d_qk]`, `k` `[b, s_k, h_kv,
/// d_qk]` and `v` `[b, s_k, h_kv, d_v]`, each as the 16-bit patterns of `dtype` ([`DType::BF16`] or [`DType::F16`]; see
/// [`super::to_bits`]), the mask, and how the scores are formed (`ScoreSpec::of(&params,
/// &dims)`: the usual scale `1/sqrt(d_qk)`). Buffers may be longer than `dims` needs; the
/// kernels address the prefix.
#[derive(Debug, Clone, Copy)]
pub struct FlashForwardArgs<'a> {
    /// Dimensions of the call.
    pub dims: Dims,
    /// Element type of `q`, `k`, `v` (and `d_o` in a backward).
    pub dtype: DType,
    /// Queries.
    pub q: &'a CudaSlice<u16>,
    /// Keys.
    pub k: &'a CudaSlice<u16>,
    /// Values.
    pub v: &'a CudaSlice<u16>,
    /// Visibility.
    pub mask: &'a DeviceMask,
    /// How the scores are formed (a finite scale): [`crate::attention::ScoreSpec::of`] the call's parameters.
    pub spec: crate::attention::ScoreSpec,
    /// Which kernel family runs a forward, and the dk/dv kernel of a backward with these
    /// arguments (see [`crate::kernels::geometry::KernelFamily`]).
    pub kernels: crate::kernels::geometry::KernelFamily,
}

/// The inputs of a backward on the device: the forward's inputs, what it saved (`o` and the
/// final `lse` of the queries over every key block), and `d_o` `[b, s_q, h_q, d_v]` (16-bit,
/// `forward.dtype`).
#[derive(Debug, Clone, Copy)]
pub struct FlashBackwardArgs<'a> {
    /// q, k, v, mask, scale and dims, as for the forward.
    pub forward: FlashForwardArgs<'a>,
    /// `o` and `lse` of the forward.
    pub saved: &'a SavedContext,
    /// Output gradient.
    pub d_o: &'a CudaSlice<u16>,
    /// How dq is computed: by its own kernel (deterministic, the default) or added with
    /// atomics by the dk/dv kernel ([`crate::kernels::geometry::DqMode`]).
    pub dq_mode: crate::kernels::geometry::DqMode,
}

/// `delta = rowsum(dO∘O)` `[b, h_q, s_q]` (f32) of a backward.
#[derive(Debug)]
pub enum Delta<'a> {
    /// Computed by the rowsum kernel into this workspace (see [`workspace_bytes`]).
    Compute(&'a mut CudaSlice<f32>),
    /// Already known (a ring computes it once per query block and reuses it at every hop).
    Given(&'a CudaSlice<f32>),
}

/// Bytes of device memory a caller provides beyond q, k, v, `d_o` and the outputs: the
/// mask's positions (`8 · (s_q + s_k)`), document ids when packed documents are used (`4 ·
/// (s_q + s_k)`, counted always: an upper bound), the backward's `delta` (`4 · b · h_q ·
/// s_q`) and the deterministic dq's workspace in [`DeviceGradients::dq_work`] (`4 ·` its
/// [`dq_workspace_len`]). The kernels allocate nothing themselves.
///
/// ```
/// use ringattn::Dims;
/// let dims = Dims { b: 1, s_q: 1024, s_k: 1024, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 };
/// let fixed_point_dq = 4 * (8 * 1024 + 2 * 8);
/// assert_eq!(ringattn::cuda::workspace_bytes(&dims), 8 * 2048 + 4 * 2048 + 4 * 8 * 1024 + fixed_point_dq);
/// ```
pub fn workspace_bytes(dims: &Dims) -> usize {
    8 * (dims.s_q + dims.s_k) + 4 * (dims.s_q + dims.s_k) + 4 * lse_len(dims) + 4 * dq_workspace_len(dims)
}

/// f32 elements of [`DeviceGradients::dq_work`]: a unit per query row and two bounds per key
/// head, `b · h_q · s_q + 2 · b · h_kv`.
pub fn dq_workspace_len(dims: &Dims) -> usize {
    lse_len(dims) + 2 * dims.b * dims.h_kv
}

/// Elements of q and dq (`[b, s_q, h_q, d_qk]`).
pub(crate) fn q_len(dims: &Dims) -> usize {
    dims.b * dims.s_q * dims.h_q * dims.d_qk
}

/// Elements of o and d_o (`[b, s_q, h_q, d_v]`).
pub(crate) fn o_len(dims: &Dims) -> usize {
    dims.b * dims.s_q * dims.h_q * dims.d_v
}

/// Elements of k and dk (`[b, s_k, h_kv, d_qk]`).
pub(crate) fn k_len(dims: &Dims) -> usize {
    dims.b * dims.s_k * dims.h_kv * dims.d_qk
}

/// Elements of v and dv (`[b, s_k, h_kv, d_v]`).
pub(crate) fn v_len(dims: &Dims) -> usize {
    dims.b * dims.s_k * dims.h_kv * dims.d_v
}

pub(crate) fn lse_len(dims: &Dims) -> usize {
    dims.b * dims.h_q * dims.s_q
}

/// A device copy of `host` (one zero element when `host` is empty: the driver refuses empty
/// allocations). Synchronous.
pub(crate) fn upload<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, host: &[T]) -> Result<CudaSlice<T>> {
    if host.is_empty() {
        return guard("cuMemAlloc", || stream.alloc_zeros::<T>(1));
    }
    guard("cuMemcpyHtoD", || stream.clone_htod(host))
}

/// The first `n` elements of `buf` on the host. Synchronous.
pub(crate) fn download<T: DeviceRepr>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>, n: usize) -> Result<Vec<T>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    // A fault of a kernel enqueued earlier on the stream (an illegal address) surfaces here.
    guard("cuMemcpyDtoH (copying results to the host; errors of earlier kernels on the stream surface here)", || {
        stream.clone_dtoh(&buf.slice(0..n))
    })
}

/// `n` f32 (at least one) filled with NaN (all bits set), in stream order.
pub(crate) fn alloc_nan(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<f32>> {
    alloc_ones(stream, n)
}

/// `n` elements (at least one) with every bit set — NaN as f32, bf16 and f16 — in stream
/// order.
fn alloc_ones<T: DeviceRepr>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the memory is uninitialised until the memset below, which is ordered before
    // any later use on `stream` (and other streams wait on the slice's write event).
    let mut buf = guard("cuMemAlloc", || unsafe { stream.alloc::<T>(n.max(1)) })?;
    let bytes = buf.len() * std::mem::size_of::<T>();
    let (ptr, record) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `bytes` bytes of the allocation just made, alive while `buf` is.
    guard("cuMemsetD8", || unsafe { result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) })?;
    drop(record);
    Ok(buf)
}

impl CudaDevice {
    /// [`DeviceMask::new`] on this device's stream.
    ///
    /// # Errors
    /// As [`DeviceMask::new`].
    pub fn mask(
        &self,
        dims: &Dims,
        positions: Option<(&Positions, &Positions)>,
        params: &AttentionParams,
    ) -> Result<DeviceMask> {
        DeviceMask::new(self.stream(), dims, positions, params)
    }

    /// A device copy of 16-bit values (q, k, v, `d_o` as [`super::to_bits`] gives them) on this
    /// device's stream. Synchronous.
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the allocation or copy fails.
    pub fn upload_bits(&self, bits: &[u16]) -> Result<CudaSlice<u16>> {
        upload(self.stream(), bits)
    }

    /// `n` f32 on this device's stream, filled with NaN (a workspace such as the backward's
    /// `delta`, [`Delta::Compute`]).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the allocation fails.
    pub fn alloc_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        alloc_nan(self.stream(), n)
    }

    /// `n` 16-bit values on this device's stream, filled with `0xFFFF` (NaN as bf16 and
    /// f16): the output of [`CudaDevice::forward16_into`].
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the allocation fails.
    pub fn alloc_bits(&self, n: usize) -> Result<CudaSlice<u16>> {
        alloc_ones(self.stream(), n)
    }

    /// The first `n` values of an f32 buffer on the host (synchronises this device's
    /// stream).
    ///
    /// # Errors
    /// [`crate::Error::Cuda`] when the copy fails; [`crate::Error::ShapeMismatch`] when
    /// `buf` holds fewer than `n`.
    pub fn download_f32(&self, buf: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        if buf.len() < n {
            return Err(crate::Error::ShapeMismatch(format!("download of {n} values from a buffer of {}", buf.len())));
        }
        download(self.stream(), buf, n)
    }
}
