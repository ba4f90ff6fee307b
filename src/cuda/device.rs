//! One GPU: its context and stream, the kernel modules loaded for its architecture, and the
//! launches of the flash forward, backward and merge kernels on device-resident buffers.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::buffers::{
    k_len, lse_len, o_len, q_len, v_len, Delta, DeviceGradients, FlashBackwardArgs, FlashForwardArgs, SavedContext,
};
use super::images;
use super::probe::{driver_error, guard, probe, version_string, DriverInfo};
use crate::kernels::geometry::{self, BackwardKernel, DqMode, KernelFamily, Launch, OpsKernel};
use crate::kernels::params::{
    FlashBwdHopperParams, FlashBwdParams, FlashFwdHopperParams, FlashFwdParams, FlashProblem, MaskParams, MergeParams,
    OpsParams,
};
use crate::kernels::tensor_map::{hopper_backward_params, hopper_forward_params, TensorMapSpec};
use crate::kernels::{self, ImageKind, KernelImage};
use crate::{DType, Dims, Error, Result};

// SAFETY (all seven): `#[repr(C)]` structs of plain integers and floats with the size and
// alignment of their C twins in cuda/params.h (asserted in src/kernels.rs), passed by value as
// a kernel's single parameter; cuLaunchKernel copies them at launch.
unsafe impl DeviceRepr for FlashFwdParams {}
unsafe impl DeviceRepr for FlashFwdHopperParams {}
unsafe impl DeviceRepr for FlashBwdParams {}
unsafe impl DeviceRepr for FlashBwdHopperParams {}
unsafe impl DeviceRepr for MergeParams {}
unsafe impl DeviceRepr for MaskParams {}
unsafe impl DeviceRepr for OpsParams {}

/// The kernel families of `cuda/` (one module each), with an entry point checked when the
/// device opens where the family has one without a head-dim class; the others load on first
/// launch.
const FAMILIES: [(&str, Option<&str>); 6] = [
    ("flash_fwd", None),
    ("flash_fwd_hopper", None),
    ("flash_bwd", Some("ringattn_flash_bwd_rowsum_bf16")),
    ("flash_bwd_hopper", None),
    ("merge", Some("ringattn_merge_f32")),
    ("ops", Some("ringattn_ops_fill_f32")),
];

/// Whether [`KernelFamily::Auto`] picks the Hopper family on compute capability 9.0: not
/// until the Hopper kernels have been verified on a GPU (they have run under the emulator
/// only).
const HOPPER_BY_DEFAULT: bool = false;

/// Dynamic shared memory a kernel may use without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

struct Kernel {
    func: CudaFunction,
    /// The largest dynamic shared memory this function has been allowed so far
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`); only grows.
    smem_allowed: Mutex<usize>,
}

/// One GPU with the kernels of `cuda/` loaded: a CUDA context (the device's primary
/// context), a stream for the host-convenience paths, and one module per kernel family, from
/// the embedded image that suits the GPU (the cubin of its architecture, `sm_90a` on H100/H200
/// and `sm_80` on A100 and other 8.x GPUs, else the PTX, JIT-compiled by the driver).
///
/// The launch methods ([`CudaDevice::forward_into`], [`CudaDevice::backward_into`], ...)
/// take the caller's device buffers and stream and return once the kernels are enqueued;
/// nothing is copied to or from the host. Buffers allocated on other streams of the same
/// context are ordered by cudarc's events. `CudaDevice` is `Send + Sync`: threads may launch
/// on it concurrently (each on its own stream, or sharing one).
///
/// ```no_run
/// use ringattn::cuda::{to_bits, CudaDevice, FlashForwardArgs};
/// use ringattn::{random::randn, AttentionParams, DType, Dims, Mask};
///
/// let dev = CudaDevice::new(0)?;
/// let dims = Dims { b: 1, s_q: 4096, s_k: 4096, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 };
/// let x = randn(vec![1, 4096, 8, 64], 0, DType::BF16).to_f32_vec();
/// let q = dev.upload_bits(&to_bits(&x, DType::BF16))?;
/// let params = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let mask = dev.mask(&dims, None, &params)?;
/// let spec = ringattn::attention::ScoreSpec::of(&params, &dims);
/// let args = FlashForwardArgs { dims, dtype: DType::BF16, q: &q, k: &q, v: &q, mask: &mask, spec, kernels: Default::default() };
/// let saved = dev.forward(dev.stream(), &args)?; // o and lse stay on the GPU
/// let lse = dev.download_f32(&saved.lse, 8 * 4096)?;
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    smem_optin: usize,
    driver: DriverInfo,
    /// One module per family, with the image it came from.
    modules: Vec<(&'static str, Arc<CudaModule>, &'static KernelImage)>,
    /// Entry points loaded so far, by name (loaded on first launch: the flash kernels are
    /// instantiated per dtype and head-dim class).
    functions: Mutex<HashMap<String, Arc<Kernel>>>,
    loaded: Vec<String>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.cc)
            .field("driver", &self.driver.version())
            .field("images", &self.loaded)
            .finish()
    }
}

impl CudaDevice {
    /// The error a driver call of this GPU's context recorded without returning it (cudarc
    /// defers errors of drops and event records), named as this thread's rank's: the ranks
    /// of one process share the context, and whichever reads the error first reports it.
    fn deferred_errors(&self) -> Result<()> {
        self.ctx
            .check_err()
            .map_err(|e| super::health::attribute(&self.ctx, "a deferred driver call", &super::probe::driver_error(e)))
    }

    /// Opens GPU `ordinal` and loads the kernels.
    ///
    /// # Errors
    /// [`Error::Cuda`]: no driver or no GPU (see [`super::probe`]), an ordinal beyond the
    /// GPUs present, a build without kernels (nvcc was not found when the crate was
    /// compiled), no embedded image that runs on this GPU, or a driver too old for the
    /// images (the message lists what the build embedded and the driver's CUDA version).
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        let driver = probe()?;
        if ordinal >= driver.device_count {
            return Err(Error::Cuda(format!(
                "CUDA device {ordinal} does not exist: the driver reports {} GPU(s)",
                driver.device_count
            )));
        }
        if !kernels::compiled() {
            return Err(Error::Cuda(
                "this build embedded no CUDA kernels: nvcc was not found when ringattn was compiled \
                 (set NVCC or CUDA_HOME and rebuild with --features cuda; see cuda/README.md)"
                    .into(),
            ));
        }
        let ctx = guard("creating the CUDA context", || CudaContext::new(ordinal))?;
        let cc = guard("reading the compute capability", || ctx.compute_capability())?;
        let name = guard("reading the device name", || ctx.name())?;
        let smem_optin = guard("reading the shared-memory limit", || {
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        })?;
        let stream = guard("creating a stream", || ctx.new_stream())?;
        let mut dev = CudaDevice {
            ctx,
            stream,
            ordinal,
            name,
            cc,
            smem_optin: smem_optin.max(0) as usize,
            driver,
            modules: Vec::new(),
            functions: Mutex::new(HashMap::new()),
            loaded: Vec::new(),
        };
        for (family, probe_entry) in FAMILIES {
            let (module, image) = dev.load_family(family)?;
            dev.loaded.push(format!("{family}: {} {}", image.target, kind_name(image.kind)));
            dev.modules.push((family, module, image));
            if let Some(entry) = probe_entry {
                dev.kernel(family, entry)?;
            }
        }
        Ok(dev)
    }

    /// The process-wide device for `ordinal`, opened on first use and shared afterwards (the
    /// host-convenience functions and [`super::CudaBackend`] use it, so that modules are
    /// loaded, and PTX compiled, once per process).
    ///
    /// # Errors
    /// As [`CudaDevice::new`] (a failure is not cached: a later call tries again).
    pub fn shared(ordinal: usize) -> Result<Arc<CudaDevice>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
        let mut map = DEVICES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(CudaDevice::new(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// Tries each image of `family` that can run on this GPU, best first.
    fn load_family(&self, family: &str) -> Result<(Arc<CudaModule>, &'static KernelImage)> {
        let all = kernels::images();
        let (major, minor) = self.cc;
        let candidates = images::candidates(all, family, self.cc);
        let context = || {
            format!(
                "{} (compute capability {major}.{minor}, driver for CUDA {}); this build embedded {}",
                self.name,
                self.driver.version(),
                images::embedded(all, family)
            )
        };
        if candidates.is_empty() {
            return Err(Error::Cuda(format!(
                "no `{family}` kernel image runs on {}: rebuild with RINGATTN_CUDA_ARCHS=sm_{major}{minor} (or a \
                 lower architecture of the same major version)",
                context()
            )));
        }
        let mut failures = Vec::new();
        for image in candidates {
            let bytes = match image.bytes() {
                Ok(b) => b,
                Err(e) => {
                    failures.push(format!("{} {}: {e}", image.target, kind_name(image.kind)));
                    continue;
                }
            };
            let ptx = match image.kind {
                ImageKind::Cubin => Ptx::from_binary(bytes.to_vec()),
                ImageKind::Ptx => match ptx_text(bytes) {
                    Ok(text) => Ptx::from_src(text),
                    Err(e) => {
                        failures.push(format!("{} PTX: {e}", image.target));
                        continue;
                    }
                },
            };
            let what = format!("loading the {family} {} {}", image.target, kind_name(image.kind));
            match super::probe::unwind(&what, || self.ctx.load_module(ptx))? {
                Ok(module) => return Ok((module, image)),
                Err(e) => failures.push(format!("{} {}: {}", image.target, kind_name(image.kind), self.load_hint(e))),
            }
        }
        Err(Error::Cuda(format!("cannot load the `{family}` kernels on {}: {}", context(), failures.join("; "))))
    }

    fn load_hint(&self, e: cudarc::driver::DriverError) -> String {
        use sys::cudaError_enum as E;
        let old = self.driver.driver_version < 13000;
        let why = match e.0 {
            E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                "the driver is too old for this PTX (nvcc 13.0 writes PTX ISA 9.0: it needs a CUDA 13.0 driver, \
                 R580 or newer)"
                    .to_string()
            }
            E::CUDA_ERROR_NO_BINARY_FOR_GPU | E::CUDA_ERROR_INVALID_IMAGE | E::CUDA_ERROR_INVALID_PTX if old => {
                format!(
                    "the image does not load with a CUDA {} driver (the kernels were built by nvcc 13.0 and need a \
                     CUDA 13.0 driver, R580 or newer)",
                    version_string(self.driver.driver_version)
                )
            }
            E::CUDA_ERROR_NO_BINARY_FOR_GPU => "the image does not cover this GPU".to_string(),
            E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND => "the driver's PTX JIT compiler is missing".to_string(),
            _ => String::new(),
        };
        if why.is_empty() {
            driver_error(e)
        } else {
            format!("{} — {why}", driver_error(e))
        }
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's name (`NVIDIA H200`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability `(major, minor)`: `(9, 0)` on H100/H200.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The driver [`super::probe`] found.
    pub fn driver(&self) -> DriverInfo {
        self.driver
    }

    /// The image loaded per kernel family (`flash_fwd: sm_90a cubin`, ...).
    pub fn loaded_images(&self) -> &[String] {
        &self.loaded
    }

    /// The CUDA context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// This device's own stream (used by the host-convenience paths; callers may use it or
    /// their own streams of [`CudaDevice::context`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Entry point `name` of `family`'s module, loaded on first use.
    fn kernel(&self, family: &str, name: &str) -> Result<Arc<Kernel>> {
        let mut map = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(name) {
            return Ok(k.clone());
        }
        let (_, module, image) = self
            .modules
            .iter()
            .find(|m| m.0 == family)
            .ok_or_else(|| Error::Cuda(format!("kernel family {family} is not loaded")))?;
        let what = format!("loading kernel {name} from the {family} {} {}", image.target, kind_name(image.kind));
        let func = guard(&what, || module.load_function(name))?;
        let k = Arc::new(Kernel { func, smem_allowed: Mutex::new(DEFAULT_SMEM) });
        map.insert(name.to_string(), k.clone());
        Ok(k)
    }

    /// Enqueues `family`'s entry point `base` — with the `_d{D}` suffix of the launch's
    /// head-dim class, if it has one — on `stream` with `p` as its single by-value parameter.
    fn launch<P: DeviceRepr>(&self, stream: &CudaStream, family: &str, base: &str, l: Launch, p: &P) -> Result<()> {
        if l.is_empty() {
            return Ok(());
        }
        guard("making the context current", || self.ctx.bind_to_thread())?;
        let name = entry_name(base, &l);
        let name = name.as_str();
        let k = self.kernel(family, name)?;
        let fail = |report: String| Error::Kernel { kernel: name.to_string(), report };
        if l.smem_bytes > self.smem_optin {
            return Err(fail(format!(
                "needs {} bytes of shared memory per block; {} allows {}",
                l.smem_bytes, self.name, self.smem_optin
            )));
        }
        if l.smem_bytes > DEFAULT_SMEM {
            let mut allowed = k.smem_allowed.lock().unwrap_or_else(|e| e.into_inner());
            if l.smem_bytes > *allowed {
                let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                guard(&format!("allowing {name} {} bytes of shared memory", l.smem_bytes), || {
                    k.func.set_attribute(attr, l.smem_bytes as i32)
                })?;
                *allowed = l.smem_bytes;
            }
        }
        let dim = |x: usize, max: u32, what: &str| {
            u32::try_from(x)
                .ok()
                .filter(|&v| v <= max)
                .ok_or_else(|| fail(format!("{what} {x} exceeds the launch limit {max} (launch {l:?})")))
        };
        let cfg = LaunchConfig {
            grid_dim: (
                dim(l.grid[0], i32::MAX as u32, "grid.x")?,
                dim(l.grid[1], 65535, "grid.y")?,
                dim(l.grid[2], 65535, "grid.z")?,
            ),
            block_dim: (dim(l.block, 1024, "block")?, 1, 1),
            shared_mem_bytes: l.smem_bytes as u32,
        };
        let mut builder = stream.launch_builder(&k.func);
        builder.arg(p);
        // SAFETY: the entry point takes exactly one parameter, of type `P` (each caller pairs a
        // family's entry points with that family's params struct, mirrored from
        // cuda/params.h); every device address in `p` was taken from a live buffer of this
        // context holding at least what the launch's dims address (checked by the callers),
        // and the callers keep those buffers borrowed, with their event guards, until the
        // launch is enqueued.
        unsafe { builder.launch(cfg) }.map_err(|e| fail(format!("launch failed: {}", driver_error(e))))?;
        Ok(())
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if **stream.context() != *self.ctx {
            return Err(Error::Cuda(format!("the stream belongs to another context than device {}", self.ordinal)));
        }
        Ok(())
    }

    fn check_forward(&self, stream: &CudaStream, x: &FlashForwardArgs<'_>) -> Result<()> {
        self.check_stream(stream)?;
        let dims = x.dims;
        crate::runner::check_supported(super::BACKEND, &dims, x.dtype)?;
        if dims.h_kv == 0 || dims.h_q == 0 || !dims.h_q.is_multiple_of(dims.h_kv) {
            return Err(Error::HeadRatio { h_q: dims.h_q, h_kv: dims.h_kv });
        }
        if !x.spec.scale.is_finite() {
            return Err(Error::Scale(x.spec.scale));
        }
        need(self, "q", x.q, q_len(&dims))?;
        need(self, "k", x.k, k_len(&dims))?;
        need(self, "v", x.v, v_len(&dims))?;
        need(self, "mask.q_pos", &x.mask.q_pos, dims.s_q)?;
        need(self, "mask.k_pos", &x.mask.k_pos, dims.s_k)?;
        match (&x.mask.q_doc, &x.mask.k_doc) {
            (Some(qd), Some(kd)) => {
                need(self, "mask.q_doc", qd, dims.s_q)?;
                need(self, "mask.k_doc", kd, dims.s_k)?;
            }
            (None, None) => {}
            _ => {
                return Err(Error::Documents("the device mask has document ids on one side only".into()));
            }
        }
        Ok(())
    }

    /// Enqueues the flash forward (`ringattn_flash_fwd_{bf16,f16}`) on `stream`, writing
    /// every element of `out.o` `[b, s_q, h_q, d]` and `out.lse` `[b, h_q, s_q]` (f32):
    /// `o_i = Σ_j softmax_j(scale · q_i·k_j) v_j` over the keys visible to query `i`, `lse_i
    /// = ln Σ_j exp(scale · q_i·k_j)`; a row that sees no key gets `o = 0`, `lse = -inf`.
    /// `o` stays unrounded f32, what a backward and the ring's merge read;
    /// [`CudaDevice::forward16_into`] writes it in the input dtype instead. Returns once
    /// enqueued.
    ///
    /// # Errors
    /// [`Error::BackendUnsupported`] for a dtype other than bf16/f16 or a head dimension the
    /// kernels do not take (multiples of 8 up to 256); [`Error::ShapeMismatch`] for a buffer
    /// shorter than `dims` needs; [`Error::Cuda`] for buffers or a stream of another device;
    /// [`Error::Kernel`] when the launch fails.
    pub fn forward_into(
        &self,
        stream: &Arc<CudaStream>,
        args: &FlashForwardArgs<'_>,
        out: &mut SavedContext,
    ) -> Result<()> {
        self.check_forward(stream, args)?;
        let dims = args.dims;
        need(self, "o", &out.o, o_len(&dims))?;
        need(self, "lse", &out.lse, lse_len(&dims))?;
        {
            let (o, _go) = out.o.device_ptr_mut(stream);
            let (lse, _gl) = out.lse.device_ptr_mut(stream);
            self.launch_forward(stream, args, Epilogue::F32(o), lse)?;
        }
        self.deferred_errors()
    }

    /// [`CudaDevice::forward_into`] with the output in the input dtype, as PyTorch's
    /// `scaled_dot_product_attention` returns it: the kernel's epilogue rounds `o` once to
    /// `args.dtype` (round to nearest even) and writes its 16-bit patterns into `o16` `[b,
    /// s_q, h_q, d]` (no f32 `o` is written); `lse` `[b, h_q, s_q]` stays f32. Buffers come
    /// from the caller ([`CudaDevice::alloc_bits`], [`CudaDevice::alloc_f32`]): nothing is
    /// allocated. Returns once enqueued.
    ///
    /// A backward reads the f32 `o` of [`CudaDevice::forward_into`] (`delta = rowsum(dO∘O)`
    /// in f32): this is the output of an inference or of a single-device training step
    /// whose backward gets `o` elsewhere, not a [`SavedContext`].
    ///
    /// # Errors
    /// As [`CudaDevice::forward_into`], for `o16` and `lse`.
    pub fn forward16_into(
        &self,
        stream: &Arc<CudaStream>,
        args: &FlashForwardArgs<'_>,
        o16: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_forward(stream, args)?;
        let dims = args.dims;
        need(self, "o16", o16, o_len(&dims))?;
        need(self, "lse", lse, lse_len(&dims))?;
        {
            let (o16, _go) = o16.device_ptr_mut(stream);
            let (lse, _gl) = lse.device_ptr_mut(stream);
            self.launch_forward(stream, args, Epilogue::Input16(o16), lse)?;
        }
        self.deferred_errors()
    }

    /// Launches the flash forward of `args` with the output addresses of `o` and `lse`
    /// (whose event guards the caller holds until this returns).
    fn launch_forward(
        &self,
        stream: &Arc<CudaStream>,
        args: &FlashForwardArgs<'_>,
        o: Epilogue,
        lse: u64,
    ) -> Result<()> {
        let (q, _gq) = args.q.device_ptr(stream);
        let (k, _gk) = args.k.device_ptr(stream);
        let (v, _gv) = args.v.device_ptr(stream);
        let (mask, _gm) = mask_params(args.mask, stream);
        let x = FlashProblem { q, k, v, mask, ..FlashProblem::new(&args.dims, &args.spec) };
        let p = o.params(FlashFwdParams { x, lse, ..Default::default() });
        if self.hopper_family(args.kernels, &[q, k, v])? {
            let hp = hopper_forward_params(p, &args.dims, args.dtype, TensorMapSpec::encode_driver)?;
            let base = format!("ringattn_hopper_flash_fwd_{}", if args.dtype == DType::F16 { "f16" } else { "bf16" });
            return self.launch(stream, "flash_fwd_hopper", &base, geometry::forward_hopper(&args.dims), &hp);
        }
        self.launch(stream, "flash_fwd", &entry("flash_fwd", args.dtype), geometry::forward(&args.dims), &p)
    }

    /// Whether this GPU runs the Hopper kernels (compute capability 9.0, the
    /// `flash_fwd_hopper` and `flash_bwd_hopper` families loaded from their sm_90a cubins).
    pub fn has_hopper_kernels(&self) -> bool {
        self.cc == (9, 0)
            && ["flash_fwd_hopper", "flash_bwd_hopper"].iter().all(|f| {
                self.modules
                    .iter()
                    .any(|(family, _, image)| family == f && image.target == "sm_90a" && image.kind == ImageKind::Cubin)
            })
    }

    /// Whether a forward or backward asked to run on `kernels`, with the operands the tensor
    /// copies read at the device addresses `copied`, runs on the Hopper family:
    /// [`KernelFamily::Hopper`] requires [`CudaDevice::has_hopper_kernels`] (operands the
    /// copies cannot address, not 16-byte aligned, then fail with the encoder's error).
    /// [`KernelFamily::Auto`] runs the FA2 family for now: the Hopper kernels have run under
    /// the emulator only, and become the default on 9.0 once `scripts/device-check.sh` has
    /// verified them on a GPU (`HOPPER_BY_DEFAULT`).
    fn hopper_family(&self, kernels: KernelFamily, copied: &[u64]) -> Result<bool> {
        match kernels {
            KernelFamily::Fa2 => Ok(false),
            KernelFamily::Auto => {
                Ok(HOPPER_BY_DEFAULT && self.has_hopper_kernels() && copied.iter().all(|a| a % 16 == 0))
            }
            KernelFamily::Hopper if self.has_hopper_kernels() => Ok(true),
            KernelFamily::Hopper => Err(Error::BackendUnsupported {
                backend: super::BACKEND,
                what: format!(
                    "the Hopper kernels on {} (compute capability {}.{}; they need 9.0 and an sm_90a cubin in \
                     RINGATTN_CUDA_ARCHS; this build embedded, forward: {}; backward: {})",
                    self.name,
                    self.cc.0,
                    self.cc.1,
                    images::embedded(kernels::images(), "flash_fwd_hopper"),
                    images::embedded(kernels::images(), "flash_bwd_hopper")
                ),
            }),
        }
    }

    /// [`CudaDevice::forward_into`] into new buffers ([`SavedContext::alloc`], stream
    /// ordered).
    ///
    /// # Errors
    /// As [`CudaDevice::forward_into`], and [`Error::Cuda`] when the allocation fails.
    pub fn forward(&self, stream: &Arc<CudaStream>, args: &FlashForwardArgs<'_>) -> Result<SavedContext> {
        self.check_forward(stream, args)?;
        let mut out = SavedContext::alloc(stream, &args.dims)?;
        self.forward_into(stream, args, &mut out)?;
        Ok(out)
    }

    /// Enqueues the flash backward on `stream`: `delta = rowsum(dO∘O)` (the rowsum kernel,
    /// with [`Delta::Compute`]), then the kernels of [`geometry::backward`]: the dk/dv kernel
    /// (`ringattn_flash_bwd_dkdv*`: 4 warps of 16 key rows on tensor cores, the query tiles of
    /// its GQA group streamed) with dq added in fixed point under [`DqMode::Deterministic`] up
    /// to head-dim class 128 (the kvbound and rowunit kernels before it, dqconvert after;
    /// `grads.dq_work` the workspace) and with f32 atomics under [`DqMode::Atomic`]; from
    /// class 192 the deterministic mode runs the dq kernel beside it. On the Hopper family
    /// (`args.forward.kernels`, see [`KernelFamily`]) [`geometry::backward_hopper`]'s sm_90a
    /// dk/dv kernel adds dq at every class, in fixed point or with f32 atomics; its tensor maps
    /// are encoded before anything is enqueued. With `P_ij = exp(scale ·
    /// q_i·k_j − lse_i)` over visible pairs and `dS_ij = P_ij (dO_i·v_j − delta_i)`: `dv_j =
    /// Σ_i P_ij dO_i`, `dq_i = scale Σ_j dS_ij k_j`, `dk_j = scale Σ_i dS_ij q_i`. Every element
    /// of `grads` is written (f32; bit-identical run to run unless the atomic dq mode is asked
    /// for). Returns once enqueued.
    ///
    /// # Errors
    /// As [`CudaDevice::forward_into`], for every buffer of `args`, `delta` and `grads`.
    pub fn backward_into(
        &self,
        stream: &Arc<CudaStream>,
        args: &FlashBackwardArgs<'_>,
        delta: Delta<'_>,
        grads: &mut DeviceGradients,
    ) -> Result<()> {
        let saved = (Some(&args.saved.o), &args.saved.lse);
        self.backward_parts(stream, &args.forward, saved, args.d_o, args.dq_mode, delta, grads)
    }

    /// [`CudaDevice::backward_into`] with the forward's saved `o` and `lse` as separate
    /// buffers (the device backend keeps them in shared buffers, not a [`SavedContext`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_parts(
        &self,
        stream: &Arc<CudaStream>,
        x: &FlashForwardArgs<'_>,
        saved: (Option<&CudaSlice<f32>>, &CudaSlice<f32>),
        d_o: &CudaSlice<u16>,
        dq_mode: DqMode,
        delta: Delta<'_>,
        grads: &mut DeviceGradients,
    ) -> Result<()> {
        self.check_forward(stream, x)?;
        let dims = x.dims;
        geometry::check_capped_backward(super::BACKEND, &dims, &x.spec, self.cc)?;
        let (saved_o, saved_lse) = saved;
        match saved_o {
            Some(o) => need(self, "saved.o", o, o_len(&dims))?,
            None if matches!(delta, Delta::Compute(_)) => {
                return Err(crate::Error::InvalidArgument(
                    "backward: delta = rowsum(dO∘O) is computed from the saved o, which was not given".into(),
                ))
            }
            None => {}
        }
        need(self, "saved.lse", saved_lse, lse_len(&dims))?;
        need(self, "d_o", d_o, o_len(&dims))?;
        need(self, "dq", &grads.dq, q_len(&dims))?;
        need(self, "dk", &grads.dk, k_len(&dims))?;
        need(self, "dv", &grads.dv, v_len(&dims))?;
        need(self, "dq_work", &grads.dq_work, super::buffers::dq_workspace_len(&dims))?;
        let compute_delta = matches!(delta, Delta::Compute(_));
        match &delta {
            Delta::Compute(d) => need(self, "delta", &**d, lse_len(&dims))?,
            Delta::Given(d) => need(self, "delta", *d, lse_len(&dims))?,
        }
        {
            let (q, _gq) = x.q.device_ptr(stream);
            let (k, _gk) = x.k.device_ptr(stream);
            let (v, _gv) = x.v.device_ptr(stream);
            let (mask, _gm) = mask_params(x.mask, stream);
            let problem = FlashProblem { q, k, v, mask, ..FlashProblem::new(&dims, &x.spec) };
            // Without o (delta given), the kernels never read it: a null address.
            let o_ptr = saved_o.map(|o| o.device_ptr(stream));
            let o = o_ptr.as_ref().map_or(0, |(p, _)| *p);
            let (lse, _gl) = saved_lse.device_ptr(stream);
            let (d_o, _gdo) = d_o.device_ptr(stream);
            let (delta, _gd) = match delta {
                Delta::Compute(d) => d.device_ptr_mut(stream),
                Delta::Given(d) => d.device_ptr(stream),
            };
            // The Hopper kernel's tensor maps are encoded before anything is enqueued, so that a
            // map the driver refuses fails the call with nothing written (or, under auto, runs
            // the FA2 family).
            let mut family = geometry::Backward::Fa2;
            let mut hopper = None;
            let hopper_takes_it =
                geometry::backward_family(geometry::Backward::Hopper, &dims, &x.spec) == geometry::Backward::Hopper;
            if hopper_takes_it && self.hopper_family(x.kernels, &[q, k, v, d_o, lse, delta])? {
                let copied = FlashBwdParams { d_o, lse, delta, ..FlashBwdParams::of(problem, dq_mode) };
                match hopper_backward_params(copied, &dims, x.dtype, TensorMapSpec::encode_driver) {
                    Ok(hp) => (family, hopper) = (geometry::Backward::Hopper, Some(hp)),
                    Err(_) if x.kernels == KernelFamily::Auto => {}
                    Err(e) => return Err(e),
                }
            }
            let kernels = geometry::backward_on(family, &dims, compute_delta, dq_mode);
            // The dk/dv kernel adds into dq (unless the dq kernel writes it); the kvbound kernel
            // raises the K/V bounds from zero.
            let zeroing = geometry::backward_zeroing(&kernels);
            if zeroing.dq {
                guard("zeroing dq", || stream.memset_zeros(&mut grads.dq))?;
            }
            let units = lse_len(&dims);
            if zeroing.kv_bounds {
                let mut bounds = grads.dq_work.slice_mut(units..units + 2 * dims.b * dims.h_kv);
                guard("zeroing the K/V bounds", || stream.memset_zeros(&mut bounds))?;
            }
            let (dq, _gdq) = grads.dq.device_ptr_mut(stream);
            let (dk, _gdk) = grads.dk.device_ptr_mut(stream);
            let (dv, _gdv) = grads.dv.device_ptr_mut(stream);
            let (dq_unit, _gw) = grads.dq_work.device_ptr_mut(stream);
            let kv_bound = dq_unit + 4 * units as u64;
            let p = FlashBwdParams {
                o,
                d_o,
                lse,
                delta,
                dq,
                dk,
                dv,
                dq_unit,
                kv_bound,
                ..FlashBwdParams::of(problem, dq_mode)
            };
            for (kernel, launch) in kernels {
                let base = kernel.entry_base(x.dtype);
                if let (BackwardKernel::HopperDkDv(_), Some(maps)) = (kernel, hopper) {
                    self.launch(stream, kernel.family(), &base, launch, &FlashBwdHopperParams { p, ..maps })?;
                } else {
                    self.launch(stream, kernel.family(), &base, launch, &p)?;
                }
            }
        }
        self.deferred_errors()
    }

    /// [`CudaDevice::backward_into`] into new gradient buffers, computing `delta` in a new
    /// workspace (both stream ordered).
    ///
    /// # Errors
    /// As [`CudaDevice::backward_into`], and [`Error::Cuda`] when an allocation fails.
    pub fn backward(&self, stream: &Arc<CudaStream>, args: &FlashBackwardArgs<'_>) -> Result<DeviceGradients> {
        self.check_forward(stream, &args.forward)?;
        let dims = args.forward.dims;
        let mut delta = super::buffers::alloc_nan(stream, lse_len(&dims))?;
        let mut grads = DeviceGradients::alloc(stream, &dims)?;
        self.backward_into(stream, args, Delta::Compute(&mut delta), &mut grads)?;
        Ok(grads)
    }

    /// Enqueues `delta = rowsum(dO∘O)` `[b, h_q, s_q]` (f32) from the f32 `o` and 16-bit
    /// `d_o` (`[b, s_q, h_q, d]`, `dtype`): the rowsum kernel alone.
    ///
    /// # Errors
    /// As [`CudaDevice::forward_into`] for `o`, `d_o` and `delta`.
    pub fn rowsum_into(
        &self,
        stream: &Arc<CudaStream>,
        dims: &Dims,
        dtype: DType,
        o: &CudaSlice<f32>,
        d_o: &CudaSlice<u16>,
        delta: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        crate::runner::check_supported(super::BACKEND, dims, dtype)?;
        need(self, "o", o, o_len(dims))?;
        need(self, "d_o", d_o, o_len(dims))?;
        need(self, "delta", delta, lse_len(dims))?;
        {
            let (o, _go) = o.device_ptr(stream);
            let (d_o, _gdo) = d_o.device_ptr(stream);
            let (delta, _gd) = delta.device_ptr_mut(stream);
            let problem = FlashProblem::new(dims, &crate::attention::ScoreSpec::default());
            let p = FlashBwdParams { o, d_o, delta, ..FlashBwdParams::of(problem, DqMode::default()) };
            self.launch(stream, "flash_bwd", &entry("flash_bwd_rowsum", dtype), geometry::rowsum(dims), &p)?;
        }
        self.deferred_errors()
    }

    /// Enqueues the merge kernel (`ringattn_merge_f32`): merges the partial `(o_part,
    /// lse_part)` over a disjoint key set into `(o_acc, lse_acc)` as [`crate::merge::merge`]
    /// does (`o` `[b, s, h, d]`, `lse` `[b, h, s]`, f32, `-inf` safe); `bshd` is `[b, s, h,
    /// d]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a buffer shorter than `bshd` needs; [`Error::Kernel`]
    /// when the launch fails.
    pub fn merge_into(
        &self,
        stream: &Arc<CudaStream>,
        o_acc: &mut CudaSlice<f32>,
        lse_acc: &mut CudaSlice<f32>,
        o_part: &CudaSlice<f32>,
        lse_part: &CudaSlice<f32>,
        bshd: [usize; 4],
    ) -> Result<()> {
        self.check_stream(stream)?;
        let [b, s, h, d] = bshd;
        need(self, "o_acc", o_acc, b * s * h * d)?;
        need(self, "o_part", o_part, b * s * h * d)?;
        need(self, "lse_acc", lse_acc, b * h * s)?;
        need(self, "lse_part", lse_part, b * h * s)?;
        {
            let (o_acc, _g1) = o_acc.device_ptr_mut(stream);
            let (lse_acc, _g2) = lse_acc.device_ptr_mut(stream);
            let (o_part, _g3) = o_part.device_ptr(stream);
            let (lse_part, _g4) = lse_part.device_ptr(stream);
            let p = MergeParams {
                o_acc,
                lse_acc,
                o_part,
                lse_part,
                b: b as i64,
                s: s as i64,
                h: h as i64,
                d: d as i64,
                ..Default::default()
            };
            self.launch(stream, "merge", "ringattn_merge_f32", geometry::merge(b * h * s), &p)?;
        }
        self.deferred_errors()
    }

    /// Enqueues the sinks' merge (`ringattn_merge_sinks_f32`): each row of head `hi` of the
    /// finished `(o, lse)` joins a value-less partial of LSE `sinks[hi]`, as
    /// [`crate::merge::merge_sinks`] does (`o` `[b, s, h, d]`, `lse` `[b, h, s]`, `sinks`
    /// `[h]`, f32).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a buffer shorter than `bshd` needs; [`Error::Kernel`]
    /// when the launch fails.
    pub fn merge_sinks(
        &self,
        stream: &Arc<CudaStream>,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        sinks: &CudaSlice<f32>,
        bshd: [usize; 4],
    ) -> Result<()> {
        self.check_stream(stream)?;
        let [b, s, h, d] = bshd;
        need(self, "o", o, b * s * h * d)?;
        need(self, "lse", lse, b * h * s)?;
        need(self, "sinks", sinks, h)?;
        {
            let (o_acc, _g1) = o.device_ptr_mut(stream);
            let (lse_acc, _g2) = lse.device_ptr_mut(stream);
            let (sinks, _g3) = sinks.device_ptr(stream);
            let p = MergeParams {
                o_acc,
                lse_acc,
                sinks,
                b: b as i64,
                s: s as i64,
                h: h as i64,
                d: d as i64,
                ..Default::default()
            };
            self.launch(stream, "merge", "ringattn_merge_sinks_f32", geometry::merge(b * h * s), &p)?;
        }
        self.deferred_errors()
    }

    /// Enqueues the sinks' gradient (`ringattn_sink_grad_f32`): `dsinks[hi] = −Σ_{b, i}
    /// e^{sinks[hi] − lse} · delta` over the rows of head `hi` (`lse`, `delta` `[b, h, s]`,
    /// `sinks`, `dsinks` `[h]`, f32), as [`crate::merge::sink_grad`] (there in f64).
    ///
    /// # Errors
    /// As [`CudaDevice::merge_sinks`].
    pub fn sink_grad(
        &self,
        stream: &Arc<CudaStream>,
        lse: &CudaSlice<f32>,
        delta: &CudaSlice<f32>,
        sinks: &CudaSlice<f32>,
        dsinks: &mut CudaSlice<f32>,
        bhs: [usize; 3],
    ) -> Result<()> {
        self.check_stream(stream)?;
        let [b, h, s] = bhs;
        need(self, "lse", lse, b * h * s)?;
        need(self, "delta", delta, b * h * s)?;
        need(self, "sinks", sinks, h)?;
        need(self, "dsinks", dsinks, h)?;
        {
            let (lse_acc, _g1) = lse.device_ptr(stream);
            let (delta, _g2) = delta.device_ptr(stream);
            let (sinks, _g3) = sinks.device_ptr(stream);
            let (dsinks, _g4) = dsinks.device_ptr_mut(stream);
            let p = MergeParams {
                lse_acc,
                delta,
                sinks,
                dsinks,
                b: b as i64,
                s: s as i64,
                h: h as i64,
                ..Default::default()
            };
            self.launch(stream, "merge", "ringattn_sink_grad_f32", geometry::sink_grad(h), &p)?;
        }
        self.deferred_errors()
    }

    /// Enqueues ops kernel `kernel` of `cuda/ops.cu` on `stream` with `p` (whose addresses
    /// the caller took from live buffers of this context, with their event guards held
    /// until this returns) and the geometry of [`geometry::ops`]; nothing when there is no
    /// work.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the launch fails; [`Error::Cuda`] for a stream of another
    /// device.
    pub(crate) fn launch_ops(&self, stream: &Arc<CudaStream>, kernel: OpsKernel, p: &OpsParams) -> Result<()> {
        self.check_stream(stream)?;
        self.launch(stream, "ops", kernel.entry(), geometry::ops(kernel, p), p)
    }

    /// Times `step` (which enqueues work on `stream`, e.g. a [`CudaDevice::forward_into`])
    /// with CUDA events: `warmup` untimed calls, then `iters` calls each between two events
    /// recorded on `stream`; returns each call's GPU time in milliseconds. Nothing is copied
    /// to or from the host inside the timed region; the stream is synchronised once, at the
    /// end.
    ///
    /// # Errors
    /// The first error of `step`; [`Error::Cuda`] when an event fails.
    pub fn time_iterations(
        &self,
        stream: &Arc<CudaStream>,
        warmup: usize,
        iters: usize,
        mut step: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        self.check_stream(stream)?;
        for _ in 0..warmup {
            step()?;
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::with_capacity(2 * iters);
        for _ in 0..2 * iters {
            events.push(guard("creating an event", || self.ctx.new_event(flags))?);
        }
        for pair in events.chunks_exact(2) {
            guard("recording an event", || pair[0].record(stream))?;
            step()?;
            guard("recording an event", || pair[1].record(stream))?;
        }
        guard("synchronising the stream", || stream.synchronize())?;
        events
            .chunks_exact(2)
            .map(|pair| guard("reading an event's time", || pair[0].elapsed_ms(&pair[1])).map(f64::from))
            .collect()
    }
}

/// Where the forward kernel's epilogue writes `o`: [`FlashFwdParams::o`] (f32, unrounded)
/// or [`FlashFwdParams::o16`] (the input dtype); the other field stays null, which is how
/// the kernel chooses (`cuda/flash_fwd.cu` writes `o16` when it is non-null).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Epilogue {
    /// f32 `o` at this device address.
    F32(u64),
    /// 16-bit `o` in the input dtype at this device address.
    Input16(u64),
}

impl Epilogue {
    /// `p` with the output address in the field of this epilogue and the other one null.
    fn params(self, p: FlashFwdParams) -> FlashFwdParams {
        match self {
            Epilogue::F32(o) => FlashFwdParams { o, o16: 0, ..p },
            Epilogue::Input16(o16) => FlashFwdParams { o: 0, o16, ..p },
        }
    }
}

/// `ringattn_{family}_{bf16|f16}` (the launch adds the head-dim class suffix, `_d64`).
fn entry(family: &str, dtype: DType) -> String {
    format!("ringattn_{family}_{}", if dtype == DType::F16 { "f16" } else { "bf16" })
}

/// The entry point a launch of `base` calls: `base`, or `base_d{D}` for a kernel instantiated
/// per head-dim class (`base_d{D}_dv`, `base_d{D}_v{DV}`: its variants for V of its own head
/// dim, [`geometry::ValueDim`]).
fn entry_name(base: &str, l: &Launch) -> String {
    match l.head_dim_class {
        0 => base.to_string(),
        dc => format!("{base}_d{dc}{}", l.value_dim.suffix()),
    }
}

/// Every (family, entry point) that a forward and backward of `dims` launch.
#[cfg(test)]
fn entry_points(dims: &Dims, dtype: DType) -> Vec<(&'static str, String)> {
    let mut v = vec![("flash_fwd", entry_name(&entry("flash_fwd", dtype), &geometry::forward(dims)))];
    let base = if dtype == DType::F16 { "ringattn_hopper_flash_fwd_f16" } else { "ringattn_hopper_flash_fwd_bf16" };
    v.push(("flash_fwd_hopper", entry_name(base, &geometry::forward_hopper(dims))));
    let families = [geometry::Backward::Fa2, geometry::Backward::Hopper];
    for (kernel, launch) in [DqMode::Deterministic, DqMode::Atomic]
        .into_iter()
        .flat_map(|m| families.into_iter().flat_map(move |f| geometry::backward_on(f, dims, true, m)))
    {
        v.push((kernel.family(), entry_name(&kernel.entry_base(dtype), &launch)));
    }
    v.push(("merge", "ringattn_merge_f32".into()));
    v.push(("merge", "ringattn_merge_sinks_f32".into()));
    v.push(("merge", "ringattn_sink_grad_f32".into()));
    v
}

fn kind_name(kind: ImageKind) -> &'static str {
    match kind {
        ImageKind::Cubin => "cubin",
        ImageKind::Ptx => "PTX",
    }
}

/// PTX bytes as the text `cuModuleLoadData` takes (without trailing NULs; cudarc appends one).
fn ptx_text(bytes: &[u8]) -> std::result::Result<String, String> {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&bytes[..end]).map_err(|e| format!("not UTF-8 text: {e}"))?;
    if text.contains('\0') {
        return Err("holds a NUL byte".into());
    }
    Ok(text.to_string())
}

/// Checks that `buf` belongs to `dev`'s context and holds at least `n` elements.
fn need<T>(dev: &CudaDevice, name: &str, buf: &CudaSlice<T>, n: usize) -> Result<()> {
    if **buf.context() != *dev.ctx {
        return Err(Error::Cuda(format!("`{name}` was allocated on another device than {}", dev.ordinal)));
    }
    if buf.len() < n {
        return Err(Error::ShapeMismatch(format!("`{name}` holds {} elements, the call needs {n}", buf.len())));
    }
    Ok(())
}

/// The mask in the kernels' form, with the event guards of its buffers.
fn mask_params<'a>(
    m: &'a super::DeviceMask,
    stream: &'a CudaStream,
) -> (MaskParams, Vec<cudarc::driver::SyncOnDrop<'a>>) {
    let mut guards = Vec::with_capacity(8);
    // Each pointer's guard keeps the stream ordering until the launch is recorded.
    let mut ptr = |s: &'a CudaSlice<_>| {
        let (p, g) = s.device_ptr(stream);
        guards.push(g);
        p
    };
    let q_pos = ptr(&m.q_pos);
    let k_pos = ptr(&m.k_pos);
    let k_bounds = m.k_bounds.as_ref().map_or(0, &mut ptr);
    let q_bounds = m.q_bounds.as_ref().map_or(0, &mut ptr);
    let mut ptr32 = |s: &'a CudaSlice<u32>| {
        let (p, g) = s.device_ptr(stream);
        guards.push(g);
        p
    };
    let [q_doc, k_doc, k_doc_bounds, q_doc_bounds] =
        [&m.q_doc, &m.k_doc, &m.k_doc_bounds, &m.q_doc_bounds].map(|d| d.as_ref().map_or(0, &mut ptr32));
    let side = |w: i64| if w < 0 { -1 } else { w };
    let (window_left, window_right) = (side(m.window_left), side(m.window_right));
    let params = MaskParams {
        q_pos,
        k_pos,
        q_doc,
        k_doc,
        window_left,
        window_right,
        k_bounds,
        k_doc_bounds,
        q_bounds,
        q_doc_bounds,
    };
    (params, guards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epilogue_sets_one_output_field() {
        let base = FlashFwdParams { o: 7, o16: 9, lse: 3, x: Default::default() };
        let f32_out = Epilogue::F32(0x1000).params(base);
        assert_eq!((f32_out.o, f32_out.o16, f32_out.lse), (0x1000, 0, 3));
        let o16 = Epilogue::Input16(0x2000).params(base);
        assert_eq!((o16.o, o16.o16, o16.lse), (0, 0x2000, 3));
        assert_eq!(FlashFwdParams { o: 0, o16: 0, ..o16 }, FlashFwdParams { o: 0, o16: 0, ..f32_out });
    }

    #[test]
    fn ptx_text_strips_trailing_nuls() {
        assert_eq!(ptx_text(b".version 9.0\0\0").unwrap(), ".version 9.0");
        assert!(ptx_text(b"a\0b").is_err());
        assert!(ptx_text(b"\xff").is_err());
        assert_eq!(entry("flash_bwd_dq", DType::F16), "ringattn_flash_bwd_dq_f16");
        assert_eq!(entry("flash_fwd", DType::BF16), "ringattn_flash_fwd_bf16");
    }

    /// Every entry point a launch names exists in every embedded image of its family, for
    /// every head dimension and dtype the kernels take (checked without a GPU: PTX lists
    /// `.entry NAME(`, a cubin's string table holds `NAME\0`).
    #[test]
    fn every_launched_entry_point_is_in_the_images() {
        let mut checked = 0;
        // Equal head dims, and unequal ones on the `_dv` and pair (`_d192_v128`) entry points.
        let equal = (8..=geometry::MAX_HEAD_DIM).step_by(8).map(|d| (d, d));
        for (d, d_v) in equal.chain([(192, 128), (160, 96), (96, 64), (128, 64), (64, 192), (256, 128)]) {
            let dims = Dims { b: 1, s_q: 100, s_k: 70, h_q: 4, h_kv: 2, d_qk: d, d_v };
            for dtype in [DType::BF16, DType::F16] {
                for (family, name) in entry_points(&dims, dtype) {
                    for image in kernels::images().iter().filter(|i| i.family == family) {
                        let needle = match image.kind {
                            ImageKind::Ptx => format!(".entry {name}("),
                            ImageKind::Cubin => format!("{name}\0"),
                        };
                        let has =
                            |needle: &str| image.bytes().unwrap().windows(needle.len()).any(|w| w == needle.as_bytes());
                        assert!(has(&needle), "{name} (d = {d}) is missing from the {family} {} image", image.target);
                        if image.kind == ImageKind::Ptx {
                            // One by-value parameter of the params struct's size.
                            let size = match family {
                                "flash_fwd" => std::mem::size_of::<FlashFwdParams>(),
                                "flash_fwd_hopper" => std::mem::size_of::<FlashFwdHopperParams>(),
                                "flash_bwd" => std::mem::size_of::<FlashBwdParams>(),
                                "flash_bwd_hopper" => std::mem::size_of::<FlashBwdHopperParams>(),
                                _ => std::mem::size_of::<MergeParams>(),
                            };
                            assert!(has(&format!("{name}_param_0[{size}]")), "{name}: parameter of {size} bytes");
                            assert!(!has(&format!("{name}_param_1")), "{name}: one parameter");
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked > 0, kernels::compiled());
        // The ops kernels: one parameter of OpsParams' size each.
        for image in kernels::images().iter().filter(|i| i.family == "ops") {
            for k in OpsKernel::ALL {
                let name = k.entry();
                let has = |needle: &str| image.bytes().unwrap().windows(needle.len()).any(|w| w == needle.as_bytes());
                match image.kind {
                    ImageKind::Ptx => {
                        assert!(has(&format!(".entry {name}(")), "{name} in the ops PTX");
                        let size = std::mem::size_of::<OpsParams>();
                        assert!(has(&format!("{name}_param_0[{size}]")), "{name}: parameter of {size} bytes");
                        assert!(!has(&format!("{name}_param_1")), "{name}: one parameter");
                    }
                    ImageKind::Cubin => assert!(has(&format!("{name}\0")), "{name} in the {} cubin", image.target),
                }
            }
        }
        assert_eq!(kernels::images().iter().any(|i| i.family == "ops"), kernels::compiled());
    }
}
