//! The CUDA backend (feature `cuda`): the kernels of `cuda/` (flash forward, flash backward,
//! merge) launched on a GPU through cudarc's driver API, with `libcuda` loaded at run time —
//! a build with the feature runs everywhere, and reports a machine without a driver or GPU
//! as [`Error::Cuda`] instead of panicking ([`probe`]).
//!
//! Four levels:
//!
//! * **GPU-resident** — [`CudaDevice`]: [`CudaDevice::forward_into`] /
//!   [`CudaDevice::backward_into`] enqueue the kernels on the caller's stream over the
//!   caller's device buffers ([`FlashForwardArgs`], [`FlashBackwardArgs`], [`DeviceMask`],
//!   [`SavedContext`], [`DeviceGradients`]; q, k, v and `d_o` as 16-bit patterns in
//!   `CudaSlice<u16>`, everything else f32), with no host copies; [`workspace_bytes`] says
//!   what else the caller allocates; [`CudaDevice::time_iterations`] times launches with
//!   CUDA events (`ringattn bench --backend cuda`).
//! * **Host tensors** — [`forward`] and [`backward`]: the contract of `emu::forward`
//!   / [`crate::cpu::forward`] (outputs rounded to the input dtype; `lse` f32), each call
//!   uploading, launching and downloading.
//! * **Every strategy, host buffers** — [`CudaBackend`], a [`crate::parallel::Backend`] over
//!   host buffers: each step uploads, launches and downloads, so ring, all-gather, Ulysses
//!   and USP run on the GPU unchanged (`ringattn run --backend cuda`).
//! * **Every strategy, device-resident** — [`DeviceBackend`] (buffers are [`DeviceBuf`]s;
//!   the drivers' data movements run as the kernels of `cuda/ops.cu`, the steps on a
//!   compute stream per rank, completed by events) with a device communicator:
//!   [`DeviceComm`] (ranks as threads sharing one GPU, device-to-device copies on a copy
//!   stream per rank; [`run_on_device`], [`measure_device_overlap`]) or [`NcclComm`] (one
//!   rank per GPU over NCCL, any number of processes; unique id from the launcher's
//!   environment over TCP, [`BootstrapEnv`], or from a host communicator,
//!   [`broadcast_unique_id`]).
//!
//! What the kernels take: bf16 or f16 inputs (f32 is refused with
//! [`Error::BackendUnsupported`]: converting silently would change the precision asked for),
//! head dimensions that are multiples of 8 up to 256, every mask, packed documents and
//! global-position blocks; arithmetic and accumulation in f32; the backward is deterministic
//! by default (dq added in 32-bit fixed point with integer atomics up to head-dim class 128,
//! a dq kernel from 192: bit-identical run to run), or adds dq with f32 atomics under
//! `DqMode::Atomic` (one add per dq element per 64-key block).
//!
//! The embedded image is chosen per GPU ([`image_for`]): the cubin of its architecture
//! (`sm_80` on A100 and, binary compatible, the other 8.x GPUs; `sm_90a` on H100/H200;
//! `sm_100` on B200/B300; `sm_120` on RTX 50), else the PTX of the newest, JIT-compiled by the
//! driver. The images come from nvcc 13.0: the driver must support CUDA 13.0 (R580 or newer,
//! [`required_driver_version`]).
//!
//! Launched processes find their rank and GPU from torchrun, srun, mpirun or PMI variables
//! ([`BootstrapEnv`], GPU = local rank mod visible devices); NCCL is loaded under its real
//! names ([`nccl_candidates`], [`nccl_info`]); waits on the GPU end at the first CUDA error,
//! naming the rank that saw it.
//!
//! ```
//! use ringattn::{cuda, random::randn, AttentionParams, DType};
//! let q = randn(vec![1, 64, 2, 32], 0, DType::BF16);
//! match cuda::forward(&q, &q, &q, None, &AttentionParams::default(), &cuda::CudaOptions::default()) {
//!     Ok(out) => assert_eq!(out.o.shape(), &[1, 64, 2, 32]),
//!     Err(e) => assert!(e.to_string().contains("CUDA"), "{e}"), // no GPU on this machine
//! }
//! ```

mod backend;
mod bootstrap;
mod buffers;
mod device;
mod device_backend;
mod device_buf;
mod device_comm;
mod health;
mod images;
mod nccl;
mod nccl_lib;
mod nccl_sys;
mod probe;

pub use crate::runner::to_bits;
pub use backend::CudaBackend;
pub use bootstrap::{broadcast_unique_id, device_ordinal, BootstrapEnv, Launcher};
pub use buffers::{
    dq_workspace_len, workspace_bytes, Delta, DeviceGradients, DeviceMask, FlashBackwardArgs, FlashForwardArgs,
    SavedContext,
};
/// cudarc's context, stream and buffer types, as the GPU-resident API takes them (cudarc
/// 0.19).
pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
pub use device::CudaDevice;
pub use device_backend::DeviceBackend;
pub use device_buf::DeviceBuf;
pub use device_comm::{
    measure_device_overlap, run_on_device, DeviceComm, DeviceOverlap, DeviceRunMode, DeviceRunOptions, PassTiming,
};
pub use images::image_for;
pub use nccl::{new_unique_id, NcclComm, UniqueId, UNIQUE_ID_BYTES};
pub use nccl_lib::{nccl_candidates, nccl_info, NcclInfo, NcclVersion, OLDEST_NCCL};
pub use probe::{driver_facts, gpus, probe, required_driver_version, DriverInfo, GpuInfo};

use crate::attention::{ForwardOutput, Gradients};
use crate::kernels::geometry::KernelFamily;
use crate::runner::{self, BackwardJob, Executor, ForwardJob};
use crate::{AttentionParams, DType, Dims, Error, Positions, Result, Tensor};

/// Name of this backend in errors.
pub(crate) const BACKEND: &str = "cuda";

/// Options of the host-tensor functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaOptions {
    /// GPU ordinal (`CUDA_VISIBLE_DEVICES` applies).
    pub device: usize,
    /// How the backward computes dq (deterministic by default).
    pub dq_mode: crate::kernels::geometry::DqMode,
    /// Which kernel family runs the forward and the backward (see [`KernelFamily`]; auto runs
    /// the FA2 family until the Hopper kernels have been verified on a GPU).
    pub kernels: KernelFamily,
}

impl Executor for CudaDevice {
    const NAME: &'static str = BACKEND;

    fn forward(&self, x: &ForwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        self.forward_host(x, KernelFamily::Auto)
    }

    fn backward(&self, x: &BackwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        self.backward_host(x, KernelFamily::Auto)
    }

    fn rowsum(&self, dims: &Dims, dtype: DType, o: &[f32], d_o: &[u16]) -> Result<Vec<f32>> {
        self.rowsum_host(dims, dtype, o, d_o)
    }
}

/// A device with the kernel family of the forward and the backward chosen
/// ([`CudaOptions::kernels`]).
pub(crate) struct WithKernels<'a>(pub(crate) &'a CudaDevice, pub(crate) KernelFamily);

impl Executor for WithKernels<'_> {
    const NAME: &'static str = BACKEND;

    fn forward(&self, x: &ForwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        self.0.forward_host(x, self.1)
    }

    fn backward(&self, x: &BackwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        self.0.backward_host(x, self.1)
    }

    fn rowsum(&self, dims: &Dims, dtype: DType, o: &[f32], d_o: &[u16]) -> Result<Vec<f32>> {
        self.0.rowsum_host(dims, dtype, o, d_o)
    }
}

fn host_len<T>(name: &str, x: &[T], n: usize) -> Result<()> {
    if x.len() != n {
        return Err(Error::ShapeMismatch(format!("cuda: `{name}` holds {} elements, expected {n}", x.len())));
    }
    Ok(())
}

impl CudaDevice {
    /// Forward of host buffers on this device's stream: upload, launch, download; f32 `(o,
    /// lse)`, unrounded unless `x.round_o` (then `o` holds values of `x.dtype`, rounded to
    /// nearest even after the download, as the emulator's kernel epilogue rounds them).
    pub(crate) fn forward_host(&self, x: &ForwardJob<'_>, kernels: KernelFamily) -> Result<(Vec<f32>, Vec<f32>)> {
        let dims = x.dims;
        runner::check_supported(BACKEND, &dims, x.dtype)?;
        host_len("q", x.q, buffers::q_len(&dims))?;
        host_len("k", x.k, buffers::k_len(&dims))?;
        host_len("v", x.v, buffers::v_len(&dims))?;
        let s = self.stream();
        let (q, k, v) = (self.upload_bits(x.q)?, self.upload_bits(x.k)?, self.upload_bits(x.v)?);
        let mask = DeviceMask::upload(s, x.vis)?;
        let args = FlashForwardArgs { dims, dtype: x.dtype, q: &q, k: &k, v: &v, mask: &mask, spec: x.spec, kernels };
        let saved = self.forward(s, &args)?;
        let mut o = buffers::download(s, &saved.o, buffers::o_len(&dims))?;
        if x.round_o {
            o = crate::HostBuf::from(o).converted(x.dtype).to_f32()?.into_owned();
        }
        Ok((o, buffers::download(s, &saved.lse, buffers::lse_len(&dims))?))
    }

    /// Backward of host buffers on the kernel family `kernels`: f32 `(dq, dk, dv)`, unrounded.
    pub(crate) fn backward_host(
        &self,
        x: &BackwardJob<'_>,
        kernels: KernelFamily,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let f = &x.fwd;
        let dims = f.dims;
        runner::check_supported(BACKEND, &dims, f.dtype)?;
        let (nq, no, nst) = (buffers::q_len(&dims), buffers::o_len(&dims), buffers::lse_len(&dims));
        host_len("q", f.q, nq)?;
        host_len("k", f.k, buffers::k_len(&dims))?;
        host_len("v", f.v, buffers::v_len(&dims))?;
        host_len("o", x.o, no)?;
        host_len("lse", x.lse, nst)?;
        host_len("do", x.d_o, no)?;
        if let Some(d) = x.delta {
            host_len("delta", d, nst)?;
        }
        let s = self.stream();
        let (q, k, v, d_o) =
            (self.upload_bits(f.q)?, self.upload_bits(f.k)?, self.upload_bits(f.v)?, self.upload_bits(x.d_o)?);
        let saved = SavedContext { o: buffers::upload(s, x.o)?, lse: buffers::upload(s, x.lse)? };
        let mask = DeviceMask::upload(s, f.vis)?;
        let args = FlashBackwardArgs {
            forward: FlashForwardArgs { dims, dtype: f.dtype, q: &q, k: &k, v: &v, mask: &mask, spec: f.spec, kernels },
            saved: &saved,
            d_o: &d_o,
            dq_mode: x.dq_mode,
        };
        let mut grads = DeviceGradients::alloc(s, &dims)?;
        match x.delta {
            Some(d) => {
                let d = buffers::upload(s, d)?;
                self.backward_into(s, &args, Delta::Given(&d), &mut grads)?;
            }
            None => {
                let mut d = buffers::alloc_nan(s, nst)?;
                self.backward_into(s, &args, Delta::Compute(&mut d), &mut grads)?;
            }
        }
        Ok((
            buffers::download(s, &grads.dq, nq)?,
            buffers::download(s, &grads.dk, buffers::k_len(&dims))?,
            buffers::download(s, &grads.dv, buffers::v_len(&dims))?,
        ))
    }

    /// `rowsum(dO∘O)` of host buffers.
    pub(crate) fn rowsum_host(&self, dims: &Dims, dtype: DType, o: &[f32], d_o: &[u16]) -> Result<Vec<f32>> {
        runner::check_supported(BACKEND, dims, dtype)?;
        host_len("o", o, buffers::o_len(dims))?;
        host_len("do", d_o, buffers::o_len(dims))?;
        let s = self.stream();
        let (o, d_o) = (buffers::upload(s, o)?, self.upload_bits(d_o)?);
        let n = buffers::lse_len(dims);
        let mut delta = buffers::alloc_nan(s, n)?;
        self.rowsum_into(s, dims, dtype, &o, &d_o, &mut delta)?;
        buffers::download(s, &delta, n)
    }
}

/// Single-device forward on GPU `opts.device`: the contract of [`crate::cpu::forward`] (`o`
/// `[b, s_q, h_q, d]` in the input dtype, `lse` f32 `[b, h_q, s_q]`) for bf16 or f16 inputs
/// with head dimensions that are multiples of 8 up to 256. Positions default to
/// single-device (bottom-right aligned); pass `positions` for a block at global offsets, as
/// [`crate::cpu::forward_at`]. Each call uploads the inputs, launches, and downloads the
/// outputs (the device and its kernels are opened once per process:
/// [`CudaDevice::shared`]).
///
/// # Errors
/// Shape and parameter errors as the CPU path (checked before the GPU is touched);
/// [`Error::BackendUnsupported`] for f32 inputs or an unsupported head dimension;
/// [`Error::Cuda`] when there is no driver or GPU (`no CUDA driver found` / `no CUDA GPU
/// found`), no kernel image for this GPU, or a driver call fails; [`Error::Kernel`] when a
/// launch fails.
///
/// ```no_run
/// use ringattn::{cuda, random::randn, verify, AttentionParams, DType, Mask};
/// let q = randn(vec![1, 1000, 8, 64], 1, DType::BF16);
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let out = cuda::forward(&q, &q, &q, None, &p, &cuda::CudaOptions::default())?;
/// let report = verify::check_results(&q, &q, &q, None, None, &p, &out, None)?;
/// assert!(report.pass(), "{}", report.table());
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    opts: &CudaOptions,
) -> Result<ForwardOutput> {
    // Validate before touching the GPU, so that bad input gets its own error on any machine.
    let dims = Dims::of(q, k, v)?;
    runner::check_supported(BACKEND, &dims, q.dtype())?;
    params.check_heads(dims.h_q)?;
    crate::attention::visibility(&dims, positions, params)?;
    let dev = CudaDevice::shared(opts.device)?;
    runner::forward_tensors(&WithKernels(&dev, opts.kernels), q, k, v, positions, params)
}

/// Single-device backward on GPU `opts.device`: the contract of [`crate::cpu::backward`]
/// (`dq`, `dk`, `dv` in the input dtype) for bf16 or f16 inputs, given the forward's `o`
/// (input dtype, as [`forward`] returns it) and `lse` (f32 `[b, h_q, s_q]`).
///
/// # Errors
/// As [`forward`], plus shape or dtype errors for `o`, `lse` and `d_o`.
///
/// ```no_run
/// use ringattn::{cuda, random::randn, AttentionParams, DType};
/// let x = randn(vec![1, 256, 4, 64], 3, DType::F16);
/// let (p, opts) = (AttentionParams::default(), cuda::CudaOptions::default());
/// let f = cuda::forward(&x, &x, &x, None, &p, &opts)?;
/// let g = cuda::backward(&x, &x, &x, &f.o, &f.lse, &x, None, &p, &opts)?;
/// assert_eq!(g.dk.shape(), &[1, 256, 4, 64]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    opts: &CudaOptions,
) -> Result<Gradients> {
    let dims = Dims::of(q, k, v)?;
    runner::check_supported(BACKEND, &dims, q.dtype())?;
    dims.expect_backward_inputs(q, o, lse, d_o)?;
    params.check_heads(dims.h_q)?;
    crate::attention::visibility(&dims, positions, params)?;
    let dev = CudaDevice::shared(opts.device)?;
    runner::backward_tensors(&WithKernels(&dev, opts.kernels), q, k, v, o, lse, d_o, positions, params, opts.dq_mode)
}
