//! [`DeviceBackend`]: the sequence-parallel drivers' [`Backend`] on device-resident buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream};

use super::buffers::{
    self, k_len, lse_len, o_len, q_len, v_len, Delta, DeviceGradients, FlashForwardArgs, SavedContext,
};
use super::device_buf::{wait_event, DeviceBuf};
use super::probe::guard;
use super::{CudaDevice, DeviceMask};
use crate::kernels::geometry::{DqMode, KernelFamily, OpsKernel};
use crate::kernels::params::{device_capacity as capacity, pair_word, words, OpsParams};
use crate::parallel::{Backend, BufShape, Buffers, ForwardPartial, GradientPartial, Pending};
use crate::{AttentionParams, DType, Dims, Elem, Error, HostBuf, Positions, Result};

/// The kernels of `cuda/` as a [`Backend`] whose buffers stay on the GPU ([`DeviceBuf`]): the
/// drivers of [`crate::parallel`] (ring, all-gather, Ulysses, USP) run unchanged, with every
/// data movement ([`Buffers`]) done by the kernels of `cuda/ops.cu` and the attention steps
/// by the flash kernels, all on this backend's own **compute stream**; nothing goes through
/// the host except the small position/head-index uploads.
///
/// * Buffers are typed: q, k, v, o and `d_o` in the input dtype (16-bit patterns — what the
///   kernels read directly and the communicators move, half the bytes of f32), partial
///   results (o and gradient accumulators, lse) in f32, unrounded. An f32 input is converted
///   on the device (`ringattn_ops_to_bf16` / `_to_f16`, round to nearest even, as
///   [`super::to_bits`]) before a step reads it.
/// * Steps are asynchronous: [`Backend::forward_block`] / [`Backend::backward_block`]
///   enqueue the kernels and return a [`Pending`] completed by polling an event recorded
///   after them (never a device-wide synchronisation), bounded by
///   [`DeviceBackend::step_deadline`]. Their outputs carry that event, so a communicator
///   may send them before the step is waited on.
/// * One backend per rank (thread): each has its own compute stream; the ranks share the
///   [`CudaDevice`] (context and modules).
/// * [`DeviceBackend::record_step_times`] brackets each step's kernels with timing events
///   on the compute stream, for [`super::run_on_device`]'s overlap measurement.
///
/// ```no_run
/// use ringattn::cuda::{CudaDevice, DeviceBackend};
/// use ringattn::parallel::Buffers;
/// use ringattn::{DType, HostBuf};
/// let be = DeviceBackend::new(CudaDevice::shared(0)?, DType::BF16)?;
/// let mut acc = be.filled(4, 1.0, DType::F32)?;
/// let x = be.upload(&HostBuf::from(vec![1.0, 2.0, 3.0, 4.0]))?;
/// be.add_into(&mut acc, &x)?;
/// assert_eq!(be.download(&acc)?, vec![2.0, 3.0, 4.0, 5.0]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct DeviceBackend {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    dtype: DType,
    dq_mode: DqMode,
    kernels: KernelFamily,
    step_deadline: Duration,
    /// Head-index lists on the device, by list (the Ulysses plans reuse a few).
    heads: Mutex<HashMap<Vec<usize>, Arc<CudaSlice<i64>>>>,
    /// Masks on the device, by the blocks' positions and the mask (a ring's hops repeat
    /// the same few every layer and step: uploaded once).
    masks: Mutex<HashMap<MaskKey, Arc<DeviceMask>>>,
    /// Timing events around each step's kernels, when recording.
    timing: Mutex<Option<Vec<(CudaEvent, CudaEvent)>>>,
    /// Skip the attention kernels (for measuring a schedule's communication alone).
    skip_compute: bool,
}

impl std::fmt::Debug for DeviceBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBackend")
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("dq_mode", &self.dq_mode)
            .field("kernels", &self.kernels)
            .field("step_deadline", &self.step_deadline)
            .finish()
    }
}

impl DeviceBackend {
    /// A backend on `device` for inputs of `dtype`, with a new compute stream.
    ///
    /// # Errors
    /// [`Error::BackendUnsupported`] for f32 (the kernels take bf16 or f16); [`Error::Cuda`]
    /// when the stream cannot be created.
    pub fn new(device: Arc<CudaDevice>, dtype: DType) -> Result<DeviceBackend> {
        if dtype == DType::F32 {
            return Err(f32_unsupported());
        }
        let stream = guard("creating a compute stream", || device.context().new_stream())?;
        DeviceBackend::on_stream(device, stream, dtype)
    }

    /// A backend that runs every kernel and data movement on the caller's `stream` (a
    /// training framework's, for example), so its work is ordered with the caller's without
    /// extra synchronisation. The stream must belong to `device`'s context.
    ///
    /// # Errors
    /// As [`DeviceBackend::new`]; [`Error::InvalidArgument`] for a stream of another context
    /// (compared by the driver's handle: a framework's own `CudaContext` of the same primary
    /// context is the same context), or of a context whose event tracking was disabled.
    pub fn on_stream(device: Arc<CudaDevice>, stream: Arc<CudaStream>, dtype: DType) -> Result<DeviceBackend> {
        if dtype == DType::F32 {
            return Err(f32_unsupported());
        }
        // By the driver's handle, not the `Arc`: a framework (candle) holds its own
        // `CudaContext` for the same primary context, and its streams are as good as ours.
        if stream.context().cu_ctx() != device.context().cu_ctx() {
            return Err(Error::InvalidArgument(
                "DeviceBackend::on_stream: the stream belongs to another CUDA context than the device's".into(),
            ));
        }
        // Device buffers are ordered across streams (compute, copy, a framework's) by cudarc's
        // per-slice events as well as by their readiness events: the emulated GPU's race
        // detector finds uploads read on the copy stream before their writes without them.
        if !stream.context().is_event_tracking() {
            return Err(Error::InvalidArgument(
                "DeviceBackend::on_stream: the stream's CUDA context has cudarc's event tracking disabled \
                 (CudaContext::disable_event_tracking); ringattn's device buffers rely on it to order their uses \
                 across streams"
                    .into(),
            ));
        }
        Ok(DeviceBackend {
            device,
            stream,
            dtype,
            dq_mode: DqMode::default(),
            kernels: KernelFamily::default(),
            step_deadline: Duration::from_secs(300),
            heads: Mutex::new(HashMap::new()),
            masks: Mutex::new(HashMap::new()),
            timing: Mutex::new(None),
            skip_compute: false,
        })
    }

    /// [`DeviceBackend::new`] on GPU `ordinal`, opened once per process
    /// ([`CudaDevice::shared`]).
    ///
    /// # Errors
    /// As [`CudaDevice::new`] (no driver, no GPU: [`Error::Cuda`]) and [`DeviceBackend::new`].
    pub fn open(ordinal: usize, dtype: DType) -> Result<DeviceBackend> {
        if dtype == DType::F32 {
            return Err(f32_unsupported());
        }
        DeviceBackend::new(CudaDevice::shared(ordinal)?, dtype)
    }

    /// Without attention: every step returns outputs of the right sizes at once (o and
    /// gradients zero, LSE −∞) and launches no attention kernel — the device twin of
    /// [`crate::parallel::NullBackend`], to time a schedule's communication alone. Data
    /// movements (merges, additions, head and sequence copies) still run.
    pub fn without_compute(mut self) -> Self {
        self.skip_compute = true;
        self
    }

    /// With the backward's dq mode (deterministic by default).
    pub fn with_dq_mode(mut self, dq_mode: DqMode) -> Self {
        self.dq_mode = dq_mode;
        self
    }

    /// With the forward's kernel family (auto by default; see [`KernelFamily`]).
    pub fn with_kernels(mut self, kernels: KernelFamily) -> Self {
        self.kernels = kernels;
        self
    }

    /// With the longest a [`Pending`] step may wait for its kernels (default 300 s).
    pub fn with_step_deadline(mut self, deadline: Duration) -> Self {
        self.step_deadline = deadline;
        self
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// This backend's compute stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Element type the kernels read.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How long a step may take before its [`Pending`] fails.
    pub fn step_deadline(&self) -> Duration {
        self.step_deadline
    }

    /// Starts (`true`) or stops recording the GPU time of each attention step (the kernels
    /// of [`Backend::forward_block`] and [`Backend::backward_block`], input conversions
    /// included) with timing events on the compute stream; starting clears earlier records.
    pub fn record_step_times(&self, on: bool) {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner()) = on.then(Vec::new);
    }

    /// The GPU milliseconds of each step recorded since [`DeviceBackend::record_step_times`]
    /// (waits for the steps' end events), in enqueue order; recording continues afresh.
    ///
    /// # Errors
    /// [`Error::Cuda`] when an event fails; [`Error::Timeout`] when a step has not finished
    /// within [`DeviceBackend::step_deadline`].
    pub fn step_times_ms(&self) -> Result<Vec<f64>> {
        let events = {
            let mut t = self.timing.lock().unwrap_or_else(|e| e.into_inner());
            match t.as_mut() {
                Some(v) => std::mem::take(v),
                None => Vec::new(),
            }
        };
        let mut out = Vec::with_capacity(events.len());
        for (start, end) in &events {
            wait_event(end, "timing a device step", 0, self.step_deadline)?;
            out.push(f64::from(guard("reading an event's time", || start.elapsed_ms(end))?));
        }
        Ok(out)
    }

    /// Records the start event of a timed step, when recording.
    fn step_start(&self) -> Result<Option<CudaEvent>> {
        if self.timing.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return Ok(None);
        }
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Some(guard("recording an event", || self.stream.record_event(flags))?))
    }

    fn step_end(&self, start: Option<CudaEvent>) -> Result<()> {
        if let Some(start) = start {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let end = guard("recording an event", || self.stream.record_event(flags))?;
            if let Some(v) = self.timing.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                v.push((start, end));
            }
        }
        Ok(())
    }

    /// An event after everything enqueued so far on the compute stream.
    fn done_event(&self) -> Result<Arc<CudaEvent>> {
        Ok(Arc::new(guard("recording an event", || self.stream.record_event(None))?))
    }

    fn launch(&self, kernel: OpsKernel, p: &OpsParams) -> Result<()> {
        self.device.launch_ops(&self.stream, kernel, p)
    }

    /// An input of a step (q, k, v, `d_o`) as the kernels read it: the 16-bit patterns of
    /// the backend's dtype — the buffer itself (shared, no work) when it holds them, converted
    /// on the compute stream otherwise (an f32 buffer).
    fn step_bits(&self, buf: &DeviceBuf) -> Result<DeviceBuf> {
        self.convert(buf, self.dtype)
    }

    /// The device list of `heads` (each `< h`), cached.
    fn head_list(&self, heads: &[usize], h: usize) -> Result<Arc<CudaSlice<i64>>> {
        if let Some(&bad) = heads.iter().find(|&&x| x >= h) {
            return Err(Error::InvalidArgument(format!("head {bad} out of range for a buffer of {h} heads")));
        }
        let mut cache = self.heads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = cache.get(heads) {
            return Ok(list.clone());
        }
        let idx: Vec<i64> = heads.iter().map(|&x| x as i64).collect();
        let list = Arc::new(buffers::upload(&self.stream, &idx)?);
        cache.insert(heads.to_vec(), list.clone());
        Ok(list)
    }
}

fn f32_unsupported() -> Error {
    Error::BackendUnsupported {
        backend: super::BACKEND,
        what: "f32 inputs (the kernels take bf16 or f16; convert the inputs, or use the cpu backend)".into(),
    }
}

fn expect_len(name: &str, buf: &DeviceBuf, want: usize) -> Result<()> {
    if buf.len() != want {
        return Err(Error::ShapeMismatch(format!("`{name}` holds {} values, expected {want}", buf.len())));
    }
    Ok(())
}

fn expect_f32(name: &str, buf: &DeviceBuf) -> Result<()> {
    if buf.elem() != Elem::F32 {
        return Err(Error::InvalidArgument(format!("`{name}` holds {} values; this operation adds f32", buf.elem())));
    }
    Ok(())
}

/// The 16-bit pattern of `value` in `dtype` (bf16 or f16).
fn bits_of(value: f32, dtype: DType) -> u16 {
    match dtype {
        DType::F16 => half::f16::from_f32(value).to_bits(),
        _ => half::bf16::from_f32(value).to_bits(),
    }
}

impl Buffers for DeviceBackend {
    type Buf = DeviceBuf;

    /// Every dtype in its own type: f32, or bf16/f16 as 16-bit patterns (what the kernels
    /// read and the communicators move).
    fn storage(&self, dtype: DType) -> Elem {
        dtype.into()
    }

    /// `host` in its own element type.
    fn upload(&self, host: &HostBuf) -> Result<DeviceBuf> {
        DeviceBuf::upload_host(&self.stream, host)
    }

    fn download(&self, buf: &DeviceBuf) -> Result<HostBuf> {
        buf.download(&self.stream)
    }

    /// `x` as `dtype` on the compute stream: narrowed to 16-bit patterns (round to nearest
    /// even, as [`super::to_bits`]), widened to f32 (exact), or `x` itself (shared) when it
    /// already is `dtype`.
    fn convert(&self, x: &DeviceBuf, dtype: DType) -> Result<DeviceBuf> {
        let want = Elem::from(dtype);
        if x.elem() == want {
            return Ok(x.clone());
        }
        let from = x.elem().dtype().ok_or_else(|| {
            Error::InvalidArgument(format!("convert: a device buffer of bytes cannot be converted to {dtype}"))
        })?;
        let wide = match OpsKernel::convert_from(from) {
            None => x.clone(),
            Some(kernel) => {
                let mut out = DeviceBuf::alloc(&self.stream, Elem::F32, x.len())?;
                {
                    let (src, _gs) = x.read_ptr(&self.stream)?;
                    let (dst, _gd) = out.write_ptr(&self.stream)?;
                    self.launch(kernel, &OpsParams::widen(dst, src, x.len()))?;
                }
                out
            }
        };
        if dtype == DType::F32 {
            return Ok(wide);
        }
        let mut out = DeviceBuf::alloc(&self.stream, want, x.len())?;
        {
            let (src, _gs) = wide.read_ptr(&self.stream)?;
            let (dst, _gd) = out.write_ptr(&self.stream)?;
            self.launch(OpsKernel::convert_to(dtype), &OpsParams::convert(dst, src, x.len()))?;
        }
        Ok(out)
    }

    /// `len` copies of `value` rounded to `dtype` (16-bit buffers are filled as pairs, their
    /// padding value included).
    fn filled(&self, len: usize, value: f32, dtype: DType) -> Result<DeviceBuf> {
        let elem = Elem::from(dtype);
        let mut out = DeviceBuf::alloc(&self.stream, elem, len)?;
        let (words, word) = match dtype {
            DType::F32 => (len, value),
            _ => (capacity(elem, len) / 2, pair_word(bits_of(value, dtype))),
        };
        {
            let (dst, _g) = out.write_ptr(&self.stream)?;
            self.launch(OpsKernel::Fill, &OpsParams::fill(dst, words, word))?;
        }
        Ok(out)
    }

    fn add_into(&self, acc: &mut DeviceBuf, x: &DeviceBuf) -> Result<()> {
        if acc.len() != x.len() {
            return Err(Error::ShapeMismatch(format!("add: {} values and {}", acc.len(), x.len())));
        }
        expect_f32("acc", acc)?;
        expect_f32("x", x)?;
        let n = x.len();
        let (src, _gs) = x.read_ptr(&self.stream)?;
        let (dst, _gd) = acc.write_ptr(&self.stream)?;
        self.launch(OpsKernel::Add, &OpsParams::add(dst, src, n))
    }

    fn merge_into(
        &self,
        o: &mut DeviceBuf,
        lse: &mut DeviceBuf,
        o_b: &DeviceBuf,
        lse_b: &DeviceBuf,
        bshd: [usize; 4],
    ) -> Result<()> {
        let [b, s, h, d] = bshd;
        expect_len("o", o, b * s * h * d)?;
        expect_len("o_part", o_b, b * s * h * d)?;
        expect_len("lse", lse, b * h * s)?;
        expect_len("lse_part", lse_b, b * h * s)?;
        o_b.wait_on(&self.stream)?;
        lse_b.wait_on(&self.stream)?;
        let (o_part, lse_part) = (o_b.f32s()?, lse_b.f32s()?);
        let o_acc = o.f32s_mut(&self.stream)?;
        let lse_acc = lse.f32s_mut(&self.stream)?;
        self.device.merge_into(&self.stream, o_acc, lse_acc, o_part, lse_part, bshd)
    }

    fn merge_sinks(&self, o: &mut DeviceBuf, lse: &mut DeviceBuf, sinks: &DeviceBuf, bshd: [usize; 4]) -> Result<()> {
        let [b, s, h, d] = bshd;
        expect_len("o", o, b * s * h * d)?;
        expect_len("lse", lse, b * h * s)?;
        expect_len("sinks", sinks, h)?;
        sinks.wait_on(&self.stream)?;
        let sinks = sinks.f32s()?;
        let o = o.f32s_mut(&self.stream)?;
        let lse = lse.f32s_mut(&self.stream)?;
        self.device.merge_sinks(&self.stream, o, lse, sinks, bshd)
    }

    fn sink_grad(&self, lse: &DeviceBuf, delta: &DeviceBuf, sinks: &DeviceBuf, bhs: [usize; 3]) -> Result<DeviceBuf> {
        let [b, h, s] = bhs;
        expect_len("lse", lse, b * h * s)?;
        expect_len("delta", delta, b * h * s)?;
        expect_len("sinks", sinks, h)?;
        for x in [lse, delta, sinks] {
            x.wait_on(&self.stream)?;
        }
        let mut out = DeviceBuf::alloc(&self.stream, Elem::F32, h)?;
        self.device.sink_grad(
            &self.stream,
            lse.f32s()?,
            delta.f32s()?,
            sinks.f32s()?,
            out.f32s_mut(&self.stream)?,
            bhs,
        )?;
        Ok(out)
    }

    fn concat_seq(&self, parts: &[DeviceBuf], b: usize, w: usize) -> Result<DeviceBuf> {
        let elem = parts.first().map_or(Elem::F32, |p| p.elem());
        if let Some(p) = parts.iter().find(|p| p.elem() != elem) {
            return Err(Error::InvalidArgument(format!("concat: parts of {elem} and {} values", p.elem())));
        }
        let row = b * w;
        let mut rows = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            if row == 0 {
                expect_len(&format!("part {i}"), p, 0)?;
                rows.push(0);
            } else if p.len() % row != 0 {
                return Err(Error::ShapeMismatch(format!(
                    "concat: part {i} holds {} values, not a whole number of [{b}, n, {w}] rows",
                    p.len()
                )));
            } else {
                rows.push(p.len() / row);
            }
        }
        let words = words(elem, w, "concat along the sequence")?;
        let total: usize = rows.iter().sum();
        let mut out = DeviceBuf::alloc(&self.stream, elem, row * total)?;
        let mut off = 0;
        for (p, &n) in parts.iter().zip(&rows) {
            if n > 0 {
                let (src, _gs) = p.read_ptr(&self.stream)?;
                let (dst, _gd) = out.write_ptr(&self.stream)?;
                let params = OpsParams::copy_rows(dst, total, off, src, n, 0).rows(b, n, words);
                self.launch(OpsKernel::CopyRows, &params)?;
            }
            off += n;
        }
        Ok(out)
    }

    fn seq_slice(&self, x: &DeviceBuf, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<DeviceBuf> {
        expect_len("x", x, b * s * w)?;
        if r0 + n > s {
            return Err(Error::ShapeMismatch(format!("rows {r0}..{} of a sequence of {s}", r0 + n)));
        }
        let words = words(x.elem(), w, "a slice along the sequence")?;
        let mut out = DeviceBuf::alloc(&self.stream, x.elem(), b * n * w)?;
        {
            let (src, _gs) = x.read_ptr(&self.stream)?;
            let (dst, _gd) = out.write_ptr(&self.stream)?;
            self.launch(OpsKernel::CopyRows, &OpsParams::copy_rows(dst, n, 0, src, s, r0).rows(b, n, words))?;
        }
        Ok(out)
    }

    fn select_heads(&self, x: &DeviceBuf, shape: BufShape, heads: &[usize]) -> Result<DeviceBuf> {
        expect_len("x", x, shape.len())?;
        let d = words(x.elem(), shape.d, "a head selection")?;
        let list = self.head_list(heads, shape.h)?;
        let rows = shape.b * shape.n;
        let mut out = DeviceBuf::alloc(&self.stream, x.elem(), rows * heads.len() * shape.d)?;
        {
            let (src, _gs) = x.read_ptr(&self.stream)?;
            let (idx, _gi) = cudarc::driver::DevicePtr::device_ptr(&*list, &self.stream);
            let (dst, _gd) = out.write_ptr(&self.stream)?;
            let p = OpsParams::heads(true, src, dst, idx, rows, shape.h, heads.len(), d, false);
            self.launch(OpsKernel::SelectHeads, &p)?;
        }
        Ok(out)
    }

    fn scatter_heads(
        &self,
        dst: &mut DeviceBuf,
        shape: BufShape,
        heads: &[usize],
        src: &DeviceBuf,
        assign: bool,
    ) -> Result<()> {
        expect_len("dst", dst, shape.len())?;
        let rows = shape.b * shape.n;
        expect_len("src", src, rows * heads.len() * shape.d)?;
        if src.elem() != dst.elem() {
            return Err(Error::InvalidArgument(format!(
                "scatter heads: {} values into a buffer of {}",
                src.elem(),
                dst.elem()
            )));
        }
        if !assign {
            expect_f32("dst", dst)?;
        }
        let d = words(dst.elem(), shape.d, "a head scatter")?;
        let list = self.head_list(heads, shape.h)?;
        let (s, _gs) = src.read_ptr(&self.stream)?;
        let (idx, _gi) = cudarc::driver::DevicePtr::device_ptr(&*list, &self.stream);
        let (dptr, _gd) = dst.write_ptr(&self.stream)?;
        let p = OpsParams::heads(false, dptr, s, idx, rows, shape.h, heads.len(), d, assign);
        self.launch(OpsKernel::ScatterHeads, &p)
    }
}

/// What a step keeps alive until its kernels have run (its 16-bit inputs, the mask).
struct StepInputs {
    _inputs: Vec<DeviceBuf>,
    _mask: Arc<DeviceMask>,
}

/// What a block's mask depends on: the positions of its queries and keys, the mask and the
/// documents (not the scale).
type MaskKey = (Positions, Positions, crate::Mask, Option<crate::Documents>);

/// Most masks a backend keeps on the device (a plan needs one per ring hop and layer shape);
/// beyond it the cache starts over.
const MASK_CACHE: usize = 1024;

impl DeviceBackend {
    /// The device mask of a block, uploaded on first use and reused after (no host transfer
    /// on later calls with the same positions).
    fn mask(
        &self,
        dims: &Dims,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Arc<DeviceMask>> {
        let key = (q_pos.clone(), k_pos.clone(), params.mask, params.documents.clone());
        if let Some(m) = self.masks.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(m.clone());
        }
        let vis = crate::attention::block_visibility(dims, q_pos, k_pos, params)?;
        let mask = Arc::new(DeviceMask::upload(&self.stream, &vis)?);
        let mut cache = self.masks.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MASK_CACHE {
            cache.clear();
        }
        cache.insert(key, mask.clone());
        Ok(mask)
    }
}

impl Backend for DeviceBackend {
    fn supports(&self, dims: &Dims, dtype: DType, _spec: &crate::attention::ScoreSpec) -> Result<()> {
        crate::runner::supports(super::BACKEND, self.dtype, dims, dtype)
    }

    fn forward_block(
        &self,
        dims: Dims,
        q: &DeviceBuf,
        k: &DeviceBuf,
        v: &DeviceBuf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<DeviceBuf>>> {
        crate::runner::check_supported(super::BACKEND, &dims, self.dtype)?;
        expect_len("q", q, q_len(&dims))?;
        expect_len("k", k, k_len(&dims))?;
        expect_len("v", v, v_len(&dims))?;
        if self.skip_compute {
            let o = self.filled(o_len(&dims), 0.0, DType::F32)?;
            return Ok(Pending::ready((o, self.filled(lse_len(&dims), f32::NEG_INFINITY, DType::F32)?)));
        }
        let mask = self.mask(&dims, q_pos, k_pos, params)?;
        let mut out = SavedContext::alloc(&self.stream, &dims)?;
        let start = self.step_start()?;
        let (q16, k16, v16) = (self.step_bits(q)?, self.step_bits(k)?, self.step_bits(v)?);
        let args = FlashForwardArgs {
            dims,
            dtype: self.dtype,
            q: q16.bits()?,
            k: k16.bits()?,
            v: v16.bits()?,
            mask: &mask,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            kernels: self.kernels,
        };
        self.device.forward_into(&self.stream, &args, &mut out)?;
        self.step_end(start)?;
        let done = self.done_event()?;
        let keep = StepInputs { _inputs: vec![q16, k16, v16], _mask: mask };
        let mut o = DeviceBuf::from_slice(out.o, o_len(&dims), None)?;
        let mut lse = DeviceBuf::from_slice(out.lse, lse_len(&dims), None)?;
        o.set_ready(Some(done.clone()));
        lse.set_ready(Some(done.clone()));
        let deadline = self.step_deadline;
        Ok(Pending::new(move || {
            wait_event(&done, "forward step on the device", 0, deadline)?;
            drop(keep);
            Ok((o, lse))
        }))
    }

    fn backward_block(
        &self,
        dims: Dims,
        q: &DeviceBuf,
        k: &DeviceBuf,
        v: &DeviceBuf,
        o: &DeviceBuf,
        lse: &DeviceBuf,
        d_o: &DeviceBuf,
        delta: &DeviceBuf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<DeviceBuf>>> {
        crate::runner::check_supported(super::BACKEND, &dims, self.dtype)?;
        expect_len("q", q, q_len(&dims))?;
        expect_len("k", k, k_len(&dims))?;
        expect_len("v", v, v_len(&dims))?;
        expect_len("o", o, o_len(&dims))?;
        expect_len("d_o", d_o, o_len(&dims))?;
        expect_len("lse", lse, lse_len(&dims))?;
        expect_len("delta", delta, lse_len(&dims))?;
        if self.skip_compute {
            let dq = self.filled(q_len(&dims), 0.0, DType::F32)?;
            return Ok(Pending::ready((
                dq,
                self.filled(k_len(&dims), 0.0, DType::F32)?,
                self.filled(v_len(&dims), 0.0, DType::F32)?,
            )));
        }
        let mask = self.mask(&dims, q_pos, k_pos, params)?;
        let mut grads = DeviceGradients::alloc(&self.stream, &dims)?;
        let start = self.step_start()?;
        let (q16, k16, v16) = (self.step_bits(q)?, self.step_bits(k)?, self.step_bits(v)?);
        let do16 = self.step_bits(d_o)?;
        for b in [lse, delta] {
            b.wait_on(&self.stream)?;
        }
        let args = FlashForwardArgs {
            dims,
            dtype: self.dtype,
            q: q16.bits()?,
            k: k16.bits()?,
            v: v16.bits()?,
            mask: &mask,
            spec: crate::attention::ScoreSpec::of(params, &dims),
            kernels: self.kernels,
        };
        // `delta` is given: the kernels do not read `o` (which may be 16-bit).
        let saved = (None, lse.f32s()?);
        let delta = Delta::Given(delta.f32s()?);
        self.device.backward_parts(&self.stream, &args, saved, do16.bits()?, self.dq_mode, delta, &mut grads)?;
        self.step_end(start)?;
        let done = self.done_event()?;
        let keep = StepInputs { _inputs: vec![q16, k16, v16, do16], _mask: mask };
        let mut out = (
            DeviceBuf::from_slice(grads.dq, q_len(&dims), None)?,
            DeviceBuf::from_slice(grads.dk, k_len(&dims), None)?,
            DeviceBuf::from_slice(grads.dv, v_len(&dims), None)?,
        );
        for b in [&mut out.0, &mut out.1, &mut out.2] {
            b.set_ready(Some(done.clone()));
        }
        let deadline = self.step_deadline;
        Ok(Pending::new(move || {
            wait_event(&done, "backward step on the device", 0, deadline)?;
            drop(keep);
            Ok(out)
        }))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, o: &DeviceBuf, d_o: &DeviceBuf) -> Result<DeviceBuf> {
        crate::runner::check_supported(super::BACKEND, &dims, self.dtype)?;
        expect_len("o", o, o_len(&dims))?;
        expect_len("d_o", d_o, o_len(&dims))?;
        if self.skip_compute {
            return self.filled(lse_len(&dims), 0.0, DType::F32);
        }
        let do16 = self.step_bits(d_o)?;
        // The rowsum kernel reads o as f32 (a 16-bit o is widened once, here).
        let o32 = self.convert(o, DType::F32)?;
        o32.wait_on(&self.stream)?;
        let n = lse_len(&dims);
        let mut delta = buffers::alloc_nan(&self.stream, n)?;
        self.device.rowsum_into(&self.stream, &dims, self.dtype, o32.f32s()?, do16.bits()?, &mut delta)?;
        DeviceBuf::from_slice(delta, n, None)
    }
}
