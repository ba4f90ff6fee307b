//! The backend seam: the local attention steps the drivers run on each rank.

use super::seq;
use crate::buf::HostData;
use crate::comm::Payload;
use crate::{AttentionParams, DType, Dims, Error, HostBuf, Positions, Result};

/// A local step in flight: [`Backend`] calls enqueue work and return one; `wait` returns the
/// result. The CPU backend computes at once, so its steps are born complete; a device
/// backend completes them on its streams, and the drivers overlap them with communication
/// the same way.
pub struct Pending<T>(Box<dyn FnOnce() -> Result<T> + Send>);

impl<T: Send + 'static> Pending<T> {
    /// A step that is already complete.
    pub fn ready(value: T) -> Self {
        Pending(Box::new(move || Ok(value)))
    }

    /// A step completed by `f`.
    pub fn new(f: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Pending(Box::new(f))
    }

    /// Waits for the result.
    ///
    /// # Errors
    /// The step's error.
    pub fn wait(self) -> Result<T> {
        (self.0)()
    }
}

/// `(o, lse)` of a forward step.
pub type ForwardPartial<B> = (B, B);
/// `(dq, dk, dv)` of a backward step.
pub type GradientPartial<B> = (B, B, B);

/// The shape `[b, n, h, d]` of a buffer the data-movement operations address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufShape {
    /// Batch.
    pub b: usize,
    /// Tokens.
    pub n: usize,
    /// Heads.
    pub h: usize,
    /// Elements per head.
    pub d: usize,
}

impl BufShape {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.b * self.n * self.h * self.d
    }

    /// Whether the shape holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The memory side of a backend: its buffer type and the few data movements the strategies
/// need, in the crate layouts (`[b, s, h, d]` for q/k/v/o and their gradients, `[b, h_q,
/// s_q]` for the LSE). Buffers are typed ([`crate::Elem`]): q, k, v, o and `d_o` keep the
/// input dtype, accumulators and the LSE are f32. Backends that keep their data in host
/// memory ([`HostBuf`]) get it from [`HostMemory`].
pub trait Buffers: Sync {
    /// The buffers this backend computes on (and its communicator moves).
    type Buf: Payload;

    /// The element type this backend stores values of `dtype` in: `dtype` itself for every
    /// backend of the crate (a backend that holds some dtype wider overrides it).
    fn storage(&self, dtype: DType) -> crate::Elem {
        dtype.into()
    }
    /// A buffer holding `host`'s values (host backends share it: no copy).
    ///
    /// # Errors
    /// Allocation or transfer errors.
    fn upload(&self, host: &HostBuf) -> Result<Self::Buf>;
    /// The values of `buf` on the host.
    ///
    /// # Errors
    /// Transfer errors.
    fn download(&self, buf: &Self::Buf) -> Result<HostBuf>;
    /// A buffer of `len` copies of `value` as `dtype`.
    ///
    /// # Errors
    /// Allocation errors.
    fn filled(&self, len: usize, value: f32, dtype: DType) -> Result<Self::Buf>;
    /// `x`'s values as `dtype` (rounded to nearest even when narrowing; `x` itself, shared,
    /// when it already is). A backend that holds a dtype wider rounds where the values
    /// leave it.
    ///
    /// # Errors
    /// Allocation errors.
    fn convert(&self, x: &Self::Buf, dtype: DType) -> Result<Self::Buf>;
    /// `acc += x` element-wise (f32 buffers).
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for unequal lengths.
    fn add_into(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// Merges the partial `(o, lse)` into the accumulator (see [`crate::merge`]; f32
    /// buffers); `bshd` is `[b, s, h, d]` of `o`.
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for lengths that disagree with `bshd`.
    fn merge_into(
        &self,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        o_b: &Self::Buf,
        lse_b: &Self::Buf,
        bshd: [usize; 4],
    ) -> Result<()>;
    /// Merges attention sinks into a finished f32 result (see [`crate::merge::merge_sinks`]):
    /// `sinks` holds the logits of the result's `h` heads in its order; `bshd` is `[b, s, h,
    /// d]` of `o`.
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for lengths that disagree with `bshd`.
    fn merge_sinks(&self, o: &mut Self::Buf, lse: &mut Self::Buf, sinks: &Self::Buf, bshd: [usize; 4]) -> Result<()>;
    /// The sinks' gradient `[h]` f32 from a finished result's `lse` and `delta` (`[b, h, s]`
    /// f32) and the `sinks` of its heads (see [`crate::merge::sink_grad`]).
    ///
    /// # Errors
    /// [`crate::Error::ShapeMismatch`] for lengths that disagree with `bhs`.
    fn sink_grad(&self, lse: &Self::Buf, delta: &Self::Buf, sinks: &Self::Buf, bhs: [usize; 3]) -> Result<Self::Buf>;
    /// Concatenates `[b, n_i, w]` buffers (one element type) along the middle axis.
    ///
    /// # Errors
    /// Allocation errors; [`crate::Error::InvalidArgument`] for mixed element types.
    fn concat_seq(&self, parts: &[Self::Buf], b: usize, w: usize) -> Result<Self::Buf>;
    /// Rows `r0..r0 + n` of the middle axis of a `[b, s, w]` buffer.
    ///
    /// # Errors
    /// Allocation errors.
    fn seq_slice(&self, x: &Self::Buf, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<Self::Buf>;
    /// The heads `heads` of a `shape` buffer, as `[b, n, heads.len(), d]`.
    ///
    /// # Errors
    /// Allocation errors.
    fn select_heads(&self, x: &Self::Buf, shape: BufShape, heads: &[usize]) -> Result<Self::Buf>;
    /// Writes (`assign`; any element type) or adds (f32) `src` (`[b, n, heads.len(), d]`)
    /// into the heads `heads` of the `shape` buffer `dst`.
    ///
    /// # Errors
    /// Launch errors; [`crate::Error::InvalidArgument`] for element types that disagree.
    fn scatter_heads(
        &self,
        dst: &mut Self::Buf,
        shape: BufShape,
        heads: &[usize],
        src: &Self::Buf,
        assign: bool,
    ) -> Result<()>;
}

/// A compute backend of the drivers: its [`Buffers`] and the local attention steps. Drivers
/// call nothing else, so another backend (the emulated or CUDA kernels, with device buffers)
/// plugs in without touching them. Steps are asynchronous: each returns a [`Pending`] handle.
pub trait Backend: Buffers {
    /// Checks that this backend computes on `dtype` inputs of `dims` with scores formed as
    /// `spec` says (called by the drivers before any step, so that every rank reports the
    /// same error: an option a backend cannot honour is refused, never dropped). The CPU
    /// backend takes everything.
    ///
    /// # Errors
    /// [`crate::Error::BackendUnsupported`] or a dtype error naming the offending value.
    fn supports(&self, _dims: &Dims, _dtype: crate::DType, _spec: &crate::attention::ScoreSpec) -> Result<()> {
        Ok(())
    }

    /// An input of the steps (q, k, v, o or `d_o`, in the input dtype) in the form this
    /// backend's steps read it best: the drivers call it once per call for the buffers that
    /// stay on the rank (q, o, `d_o`), so a conversion the steps would otherwise repeat on
    /// every ring hop happens once. The default keeps the buffer as it is; the CPU backend
    /// widens to f32.
    ///
    /// # Errors
    /// Allocation errors.
    fn step_input(&self, x: &Self::Buf) -> Result<Self::Buf> {
        Ok(x.clone())
    }

    /// Attention of queries at `q_pos` against keys at `k_pos`: f32 `(o, lse)`, unrounded.
    /// `q`, `k` and `v` hold the input dtype (or what [`Backend::step_input`] made of it).
    /// A partial over these keys: per-row options after the merge (`params.sinks`) are not
    /// the step's — the plan's finish step merges them once ([`Buffers::merge_sinks`]);
    /// a backend ignores them here.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn forward_block(
        &self,
        dims: Dims,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<Self::Buf>>>;

    /// The contribution of the keys at `k_pos` to the gradients, given the final `o`, `lse`
    /// and `delta = rowsum(dO∘O)` of the queries: f32 `(dq, dk, dv)`, unrounded.
    ///
    /// # Errors
    /// Invalid positions or parameters.
    #[allow(clippy::too_many_arguments)]
    fn backward_block(
        &self,
        dims: Dims,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &Self::Buf,
        lse: &Self::Buf,
        d_o: &Self::Buf,
        delta: &Self::Buf,
        q_pos: &Positions,
        k_pos: &Positions,
        params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<Self::Buf>>>;

    /// `rowsum(dO∘O)` `[b, h_q, s_q]`.
    ///
    /// # Errors
    /// Launch errors.
    fn softmax_grad_rowsum(&self, dims: Dims, o: &Self::Buf, d_o: &Self::Buf) -> Result<Self::Buf>;

    /// Hands back a step's output the driver is done with (merged or added into its
    /// accumulator), so that the next step may write into it instead of new memory. The
    /// default drops it; the CPU backend keeps large unshared f32 buffers for the calling
    /// thread's next step ([`crate::cpu::kept_bytes`]).
    fn recycle(&self, spent: Self::Buf) {
        drop(spent);
    }
}

/// Marker of backends whose buffers are [`HostBuf`]s: they get [`Buffers`] from the
/// implementation below and only write the compute steps.
pub trait HostMemory: Sync {}

/// The vectors of two buffers of one element type as `$a`, `$b` in `$body`.
macro_rules! same_elem {
    ($x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            (HostData::F32($a), HostData::F32($b)) => $body,
            (HostData::BF16($a), HostData::BF16($b)) => $body,
            (HostData::F16($a), HostData::F16($b)) => $body,
            (HostData::U8($a), HostData::U8($b)) => $body,
            (x, y) => return Err(mixed(x.elem(), y.elem())),
        }
    };
}

fn mixed(a: crate::Elem, b: crate::Elem) -> Error {
    Error::InvalidArgument(format!("buffers of one element type were expected, got {a} and {b}"))
}

impl<T: HostMemory> Buffers for T {
    type Buf = HostBuf;

    fn upload(&self, host: &HostBuf) -> Result<HostBuf> {
        Ok(host.clone())
    }

    fn download(&self, buf: &HostBuf) -> Result<HostBuf> {
        Ok(buf.clone())
    }

    fn filled(&self, len: usize, value: f32, dtype: DType) -> Result<HostBuf> {
        Ok(HostBuf::filled(len, value, dtype))
    }

    fn convert(&self, x: &HostBuf, dtype: DType) -> Result<HostBuf> {
        Ok(x.converted(dtype))
    }

    fn add_into(&self, acc: &mut HostBuf, x: &HostBuf) -> Result<()> {
        crate::comm::add_host(acc, x)
    }

    fn merge_into(
        &self,
        o: &mut HostBuf,
        lse: &mut HostBuf,
        o_b: &HostBuf,
        lse_b: &HostBuf,
        bshd: [usize; 4],
    ) -> Result<()> {
        crate::merge::merge_into(o.f32s_mut()?, lse.f32s_mut()?, o_b.f32s()?, lse_b.f32s()?, bshd)
    }

    fn merge_sinks(&self, o: &mut HostBuf, lse: &mut HostBuf, sinks: &HostBuf, bshd: [usize; 4]) -> Result<()> {
        crate::merge::merge_sinks(o.f32s_mut()?, lse.f32s_mut()?, sinks.f32s()?, bshd)
    }

    fn sink_grad(&self, lse: &HostBuf, delta: &HostBuf, sinks: &HostBuf, bhs: [usize; 3]) -> Result<HostBuf> {
        Ok(crate::merge::sink_grad(lse.f32s()?, delta.f32s()?, sinks.f32s()?, bhs)?.into())
    }

    fn concat_seq(&self, parts: &[HostBuf], b: usize, w: usize) -> Result<HostBuf> {
        let Some(first) = parts.first() else { return Ok(HostBuf::from(Vec::new())) };
        macro_rules! concat {
            ($variant:ident) => {{
                let slices = parts
                    .iter()
                    .map(|p| match p.data() {
                        HostData::$variant(v) => Ok(v.as_slice()),
                        d => Err(mixed(first.elem(), d.elem())),
                    })
                    .collect::<Result<Vec<_>>>()?;
                HostData::$variant(seq::concat_seq(&slices, b, w))
            }};
        }
        Ok(HostBuf::new(match first.data() {
            HostData::F32(_) => concat!(F32),
            HostData::BF16(_) => concat!(BF16),
            HostData::F16(_) => concat!(F16),
            HostData::U8(_) => concat!(U8),
        }))
    }

    fn seq_slice(&self, x: &HostBuf, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<HostBuf> {
        Ok(HostBuf::new(match x.data() {
            HostData::F32(v) => HostData::F32(seq::seq_slice(v, b, s, w, r0, n)),
            HostData::BF16(v) => HostData::BF16(seq::seq_slice(v, b, s, w, r0, n)),
            HostData::F16(v) => HostData::F16(seq::seq_slice(v, b, s, w, r0, n)),
            HostData::U8(v) => HostData::U8(seq::seq_slice(v, b, s, w, r0, n)),
        }))
    }

    fn select_heads(&self, x: &HostBuf, shape: BufShape, heads: &[usize]) -> Result<HostBuf> {
        Ok(HostBuf::new(match x.data() {
            HostData::F32(v) => HostData::F32(seq::select_heads(v, shape, heads)),
            HostData::BF16(v) => HostData::BF16(seq::select_heads(v, shape, heads)),
            HostData::F16(v) => HostData::F16(seq::select_heads(v, shape, heads)),
            HostData::U8(v) => HostData::U8(seq::select_heads(v, shape, heads)),
        }))
    }

    fn scatter_heads(
        &self,
        dst: &mut HostBuf,
        shape: BufShape,
        heads: &[usize],
        src: &HostBuf,
        assign: bool,
    ) -> Result<()> {
        if !assign {
            let src = src.f32s()?;
            seq::scatter_heads(dst.f32s_mut()?, shape, heads, src, |a, b| *a += b);
            return Ok(());
        }
        same_elem!(dst.make_mut(), src.data(), d, s => seq::scatter_heads(d, shape, heads, s, |a, b| *a = b));
        Ok(())
    }
}

/// An f32 step result as host buffers.
pub(crate) fn host_partial((a, b): (Vec<f32>, Vec<f32>)) -> ForwardPartial<HostBuf> {
    (a.into(), b.into())
}

/// A backend that computes nothing: outputs of the right sizes (zeros, LSE = −inf) at once.
/// It runs a schedule's communication alone, to measure how much of it compute hides
/// ([`super::measure_overlap`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullBackend;

impl HostMemory for NullBackend {}

impl Backend for NullBackend {
    fn forward_block(
        &self,
        dims: Dims,
        _q: &HostBuf,
        _k: &HostBuf,
        _v: &HostBuf,
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<ForwardPartial<HostBuf>>> {
        let o = vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d_v];
        Ok(Pending::ready(host_partial((o, vec![f32::NEG_INFINITY; dims.b * dims.h_q * dims.s_q]))))
    }

    fn backward_block(
        &self,
        dims: Dims,
        _q: &HostBuf,
        _k: &HostBuf,
        _v: &HostBuf,
        _o: &HostBuf,
        _lse: &HostBuf,
        _d_o: &HostBuf,
        _big_d: &HostBuf,
        _q_pos: &Positions,
        _k_pos: &Positions,
        _params: &AttentionParams,
    ) -> Result<Pending<GradientPartial<HostBuf>>> {
        let kv = dims.b * dims.s_k * dims.h_kv;
        let dq = vec![0.0; dims.b * dims.s_q * dims.h_q * dims.d_qk];
        Ok(Pending::ready((dq.into(), vec![0.0; kv * dims.d_qk].into(), vec![0.0; kv * dims.d_v].into())))
    }

    fn softmax_grad_rowsum(&self, dims: Dims, _o: &HostBuf, _d_o: &HostBuf) -> Result<HostBuf> {
        Ok(vec![0.0; dims.b * dims.h_q * dims.s_q].into())
    }
}
