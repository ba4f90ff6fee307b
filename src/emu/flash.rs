//! The flash kernels of `cuda/flash_fwd.cu` and `cuda/flash_bwd.cu` (and with
//! [`EmuOptions::kernels`] = Hopper those of `cuda/flash_fwd_hopper.cu` and
//! `cuda/flash_bwd_hopper.cu`) run under the emulator:
//! validation, buffers in the kernels' layouts, geometry from [`crate::kernels::geometry`]
//! (the same the CUDA backend uses), launches, and the public tensor API.

use std::ffi::c_char;

use half::{bf16, f16};

use super::{check, BlockCounts, EmuLaunch, EmuOptions};
use crate::attention::{ForwardOutput, Gradients, ScoreSpec};
use crate::kernels::geometry::{self, BackwardKernel, DqAccum, DqMode, KernelFamily};
use crate::kernels::params::{
    FlashBwdHopperParams, FlashBwdParams, FlashFwdHopperParams, FlashFwdParams, FlashProblem, MaskParams,
};
use crate::kernels::tensor_map::{hopper_backward_params, hopper_forward_params, TensorMapSpec};
use crate::params::Visibility;
use crate::runner::{self, check_supported, BackwardJob, Executor, ForwardJob, MaskBounds, SideBounds};
use crate::{AttentionParams, DType, Dims, Error, Positions, Result, Tensor};

extern "C" {
    fn ringattn_emu_flash_fwd(
        p: FlashFwdParams,
        bf16: i32,
        dclass: i32,
        own_dv: i32,
        l: EmuLaunch,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_flash_fwd_hopper(
        p: *const FlashFwdHopperParams,
        bf16: i32,
        dclass: i32,
        l: EmuLaunch,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_flash_bwd_hopper(
        p: *const FlashBwdHopperParams,
        fixed: i32,
        bf16: i32,
        dclass: i32,
        l: EmuLaunch,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_flash_bwd(
        p: FlashBwdParams,
        kernel: i32,
        bf16: i32,
        dclass: i32,
        own_dv: i32,
        l: EmuLaunch,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// Name of this backend in errors.
pub(crate) const BACKEND: &str = "emu";

/// The emulator as an executor of the kernels, with its options, recording what the blocks
/// of every launch did when `counts` is set.
pub(crate) struct Emulator<'a> {
    pub opts: &'a EmuOptions,
    pub counts: Option<&'a BlockCounts>,
}

impl<'a> Emulator<'a> {
    pub(crate) fn new(opts: &'a EmuOptions) -> Self {
        Emulator { opts, counts: None }
    }

    /// The launch record of `launch`, with a block-count slot when counting.
    fn launch(&self, launch: geometry::Launch) -> Result<(EmuLaunch, Option<Vec<u64>>)> {
        let mut l = EmuLaunch::new(launch, self.opts)?;
        let slot = self.counts.map(|c| c.slot(&mut l));
        Ok((l, slot))
    }

    /// Keeps the counts of a launch that ran (see [`Emulator::launch`]).
    fn record(&self, kernel: &'static str, slot: Option<Vec<u64>>) {
        if let (Some(c), Some(v)) = (self.counts, slot) {
            c.record(kernel, v);
        }
    }
}

impl Executor for Emulator<'_> {
    const NAME: &'static str = BACKEND;

    fn forward(&self, x: &ForwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        forward_job(x, self)
    }

    fn backward(&self, x: &BackwardJob<'_>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        backward_job(x, self)
    }

    fn rowsum(&self, dims: &Dims, dtype: DType, o: &[f32], d_o: &[u16]) -> Result<Vec<f32>> {
        rowsum(*dims, o, d_o, dtype, self.opts)
    }
}

/// The mask of `vis` in the kernels' form; it borrows `vis`'s vectors and `bounds`.
fn mask_params(vis: &Visibility, bounds: &Option<MaskBounds>) -> MaskParams {
    let doc = |d: &Option<Vec<u32>>| d.as_ref().map_or(0, |v| v.as_ptr() as u64);
    let side = |pick: fn(&MaskBounds) -> &SideBounds| {
        bounds.as_ref().map_or((0, 0), |b| (pick(b).0.as_ptr() as u64, doc(&pick(b).1)))
    };
    let ((k_bounds, k_doc_bounds), (q_bounds, q_doc_bounds)) = (side(|b| &b.keys), side(|b| &b.queries));
    MaskParams {
        q_pos: vis.q_pos.as_ptr() as u64,
        k_pos: vis.k_pos.as_ptr() as u64,
        q_doc: doc(&vis.q_doc),
        k_doc: doc(&vis.k_doc),
        window_left: vis.left.unwrap_or(-1),
        window_right: vis.right.unwrap_or(-1),
        k_bounds,
        k_doc_bounds,
        q_bounds,
        q_doc_bounds,
    }
}

/// Forward of one block: f32 `(o, lse)`, unrounded unless `x.round_o`.
fn forward_job(x: &ForwardJob<'_>, emu: &Emulator<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
    let ForwardJob { dims, dtype, q, k, v, vis, spec, round_o } = *x;
    check_supported(BACKEND, &dims, dtype)?;
    let (q_rows, kv_rows) = (dims.b * dims.s_q * dims.h_q, dims.b * dims.s_k * dims.h_kv);
    let (nq, no) = (q_rows * dims.d_qk, q_rows * dims.d_v);
    let (nk, nv) = (kv_rows * dims.d_qk, kv_rows * dims.d_v);
    if q.len() != nq || k.len() != nk || v.len() != nv || vis.q_pos.len() != dims.s_q || vis.k_pos.len() != dims.s_k {
        return Err(Error::ShapeMismatch(format!("flash forward buffers disagree with {dims:?}")));
    }
    // Outputs start as NaN, so an element the kernel fails to write shows up.
    let mut o = vec![f32::NAN; no];
    let mut lse = vec![f32::NAN; dims.b * dims.h_q * dims.s_q];
    if nq == 0 {
        lse.fill(f32::NEG_INFINITY);
        return Ok((o, lse));
    }
    // 0xFFFF is NaN in bf16 and f16: unwritten elements show up.
    let mut o16 = if round_o { vec![0xFFFFu16; no] } else { Vec::new() };
    let bounds = MaskBounds::of(vis);
    let p = FlashFwdParams {
        x: FlashProblem {
            q: q.as_ptr() as u64,
            k: k.as_ptr() as u64,
            v: v.as_ptr() as u64,
            mask: mask_params(vis, &bounds),
            ..FlashProblem::new(&dims, &spec)
        },
        o: o.as_mut_ptr() as u64,
        lse: lse.as_mut_ptr() as u64,
        o16: if round_o { o16.as_mut_ptr() as u64 } else { 0 },
    };
    let mut msg = [0u8; 1024];
    let bf16 = (dtype == DType::BF16) as i32;
    if emu.opts.kernels == KernelFamily::Hopper {
        let launch = geometry::forward_hopper(&dims);
        let hp = hopper_forward_params(p, &dims, dtype, TensorMapSpec::encode_emulated)?;
        let (l, slot) = emu.launch(launch)?;
        // SAFETY: as below; the tensor maps address q, k and v with their dims.
        let code = unsafe {
            ringattn_emu_flash_fwd_hopper(
                &hp,
                bf16,
                launch.head_dim_class as i32,
                l,
                msg.as_mut_ptr().cast(),
                msg.len(),
            )
        };
        check(code, &msg, "flash_fwd_hopper")?;
        emu.record("flash_fwd_hopper", slot);
    } else {
        let launch = geometry::forward(&dims);
        let (l, slot) = emu.launch(launch)?;
        // SAFETY: every buffer holds what the params' dims address (checked above) and lives
        // for the call (the block counts' slot, two u64 per block, too); o and lse are
        // exclusively borrowed; the emulator runs synchronously.
        let code = unsafe {
            let (dclass, own_dv) = (launch.head_dim_class as i32, launch.value_dim.code());
            ringattn_emu_flash_fwd(p, bf16, dclass, own_dv, l, msg.as_mut_ptr().cast(), msg.len())
        };
        check(code, &msg, "flash_fwd")?;
        emu.record("flash_fwd", slot);
    }
    if round_o {
        o = match dtype {
            DType::F16 => o16.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
            _ => o16.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
        };
    }
    Ok((o, lse))
}

/// Backward of one key block: f32 `(dq, dk, dv)`, unrounded.
fn backward_job(x: &BackwardJob<'_>, emu: &Emulator<'_>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let f = &x.fwd;
    let dims = f.dims;
    check_supported(BACKEND, &dims, f.dtype)?;
    let (q_rows, kv_rows) = (dims.b * dims.s_q * dims.h_q, dims.b * dims.s_k * dims.h_kv);
    let (nq, no) = (q_rows * dims.d_qk, q_rows * dims.d_v);
    let (nk, nv) = (kv_rows * dims.d_qk, kv_rows * dims.d_v);
    let nst = dims.b * dims.h_q * dims.s_q;
    let lengths_ok = f.q.len() == nq
        && x.o.len() == no
        && x.d_o.len() == no
        && f.k.len() == nk
        && f.v.len() == nv
        && x.lse.len() == nst
        && x.delta.is_none_or(|d| d.len() == nst)
        && f.vis.q_pos.len() == dims.s_q
        && f.vis.k_pos.len() == dims.s_k;
    if !lengths_ok {
        return Err(Error::ShapeMismatch(format!("flash backward buffers disagree with {dims:?}")));
    }
    // dq is added into zeros (as f32, or as fixed-point integers converted after) or written
    // by the dq kernel; what is written (dq then, dk, dv) starts as NaN, so an element the
    // kernels fail to write shows up. The fixed-point dq's units start as NaN too (the rowunit
    // kernel writes every one), its K/V bounds as zeros.
    let asked =
        if emu.opts.kernels == KernelFamily::Hopper { geometry::Backward::Hopper } else { geometry::Backward::Fa2 };
    let family = geometry::backward_family(asked, &dims, &f.spec);
    let kernels = geometry::backward_on(family, &dims, x.delta.is_none(), x.dq_mode);
    let mut dq = vec![if geometry::backward_zeroing(&kernels).dq { 0.0 } else { f32::NAN }; nq];
    let mut dk = vec![f32::NAN; nk];
    let mut dq_unit = vec![f32::NAN; nst];
    let mut kv_bound = vec![0.0f32; 2 * dims.b * dims.h_kv];
    let mut dv = vec![f32::NAN; nv];
    let mut delta = match x.delta {
        Some(d) => d.to_vec(),
        None => vec![f32::NAN; nst],
    };
    if nq == 0 && nk == 0 {
        return Ok((dq, dk, dv));
    }
    let bounds = MaskBounds::of(f.vis);
    let problem = FlashProblem {
        q: f.q.as_ptr() as u64,
        k: f.k.as_ptr() as u64,
        v: f.v.as_ptr() as u64,
        mask: mask_params(f.vis, &bounds),
        ..FlashProblem::new(&dims, &f.spec)
    };
    let p = FlashBwdParams {
        o: x.o.as_ptr() as u64,
        d_o: x.d_o.as_ptr() as u64,
        lse: x.lse.as_ptr() as u64,
        delta: delta.as_mut_ptr() as u64,
        dq: dq.as_mut_ptr() as u64,
        dk: dk.as_mut_ptr() as u64,
        dv: dv.as_mut_ptr() as u64,
        dq_unit: dq_unit.as_mut_ptr() as u64,
        kv_bound: kv_bound.as_mut_ptr() as u64,
        ..FlashBwdParams::of(problem, x.dq_mode)
    };
    let bf = (f.dtype == DType::BF16) as i32;
    for (kernel, launch) in kernels {
        let (l, slot) = emu.launch(launch)?;
        let mut msg = [0u8; 1024];
        let dclass = launch.head_dim_class as i32;
        let rc = if let BackwardKernel::HopperDkDv(accum) = kernel {
            let hp = hopper_backward_params(p, &dims, f.dtype, TensorMapSpec::encode_emulated)?;
            let fixed = (accum == DqAccum::Fixed) as i32;
            // SAFETY: as below; the tensor maps address q, k, v and d_o with their dims.
            unsafe { ringattn_emu_flash_bwd_hopper(&hp, fixed, bf, dclass, l, msg.as_mut_ptr().cast(), msg.len()) }
        } else {
            // SAFETY: as in forward_job; delta, dq, dk, dv, dq_unit and kv_bound are
            // exclusively owned here.
            let (code, own_dv) = (kernel_code(kernel), launch.value_dim.code());
            unsafe { ringattn_emu_flash_bwd(p, code, bf, dclass, own_dv, l, msg.as_mut_ptr().cast(), msg.len()) }
        };
        check(rc, &msg, &format!("flash_bwd_{}", kernel.name()))?;
        emu.record(kernel.name(), slot);
    }
    Ok((dq, dk, dv))
}

/// The number of `kernel` in the emulator's entry point (`ringattn_emu_flash_bwd` in
/// `cuda/emu/kernels_bwd.cpp`).
fn kernel_code(kernel: BackwardKernel) -> i32 {
    match kernel {
        BackwardKernel::Rowsum => 0,
        BackwardKernel::KvBound => 1,
        BackwardKernel::RowUnit => 2,
        BackwardKernel::DkDv(DqAccum::Fixed) => 3,
        BackwardKernel::DkDv(DqAccum::F32) => 4,
        BackwardKernel::DqConvert => 5,
        BackwardKernel::Dq => 6,
        BackwardKernel::DkDv(DqAccum::None) => 7,
        // (its own entry point, ringattn_emu_flash_bwd_hopper)
        BackwardKernel::HopperDkDv(_) => -1,
    }
}

/// `delta = rowsum(dO∘O)` `[b, h_q, s_q]` by the rowsum kernel, from f32 `o` and 16-bit
/// `d_o`.
pub(crate) fn rowsum(dims: Dims, o: &[f32], d_o: &[u16], dtype: DType, opts: &EmuOptions) -> Result<Vec<f32>> {
    let no = dims.b * dims.s_q * dims.h_q * dims.d_v;
    let nst = dims.b * dims.h_q * dims.s_q;
    if o.len() != no || d_o.len() != no {
        return Err(Error::ShapeMismatch(format!("rowsum buffers disagree with {dims:?}")));
    }
    let mut delta = vec![f32::NAN; nst];
    if nst == 0 {
        return Ok(delta);
    }
    let p = FlashBwdParams {
        o: o.as_ptr() as u64,
        d_o: d_o.as_ptr() as u64,
        delta: delta.as_mut_ptr() as u64,
        ..FlashBwdParams::of(FlashProblem::new(&dims, &ScoreSpec::default()), DqMode::default())
    };
    let l = EmuLaunch::new(geometry::rowsum(&dims), opts)?;
    let mut msg = [0u8; 1024];
    // SAFETY: o and d_o hold the nq elements the kernel reads, delta the nst it writes; the
    // other pointers are null and not read by the rowsum kernel.
    let code = unsafe {
        ringattn_emu_flash_bwd(p, 0, (dtype == DType::BF16) as i32, 0, 0, l, msg.as_mut_ptr().cast(), msg.len())
    };
    check(code, &msg, "flash_bwd_rowsum")?;
    Ok(delta)
}

/// Single-device forward through the emulated `flash_fwd.cu` kernel: the same contract as
/// [`crate::cpu::forward`] (`o` in the input dtype, `lse` f32 `[b, h_q, s_q]`), for bf16 or
/// f16 inputs with head dimensions that are multiples of 8 up to 256. Positions default to
/// `0..s`; pass `positions` for a block at global offsets, as [`crate::cpu::forward_at`].
///
/// # Errors
/// Shape and parameter errors as the CPU path; [`Error::BackendUnsupported`] for f32 inputs
/// or an unsupported head dimension; the emulator's report if the kernel misbehaves (an
/// out-of-bounds access, a race, a divergent barrier).
///
/// ```
/// use ringattn::{emu, random::randn, AttentionParams, DType, Mask};
/// let q = randn(vec![1, 40, 2, 16], 1, DType::BF16);
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let out = emu::forward(&q, &q, &q, None, &p, &emu::EmuOptions::default())?;
/// let cpu = ringattn::cpu::forward(&q, &q, &q, &p)?;
/// let diff = out.o.to_f32_vec().iter().zip(cpu.o.to_f32_vec()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
/// assert!(diff < 0.02);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    opts: &EmuOptions,
) -> Result<ForwardOutput> {
    runner::forward_tensors(&Emulator::new(opts), q, k, v, positions, params)
}

/// Single-device backward through the emulated `flash_bwd.cu` kernels (the dk/dv kernel of
/// `flash_bwd_hopper.cu` with [`EmuOptions::kernels`] = Hopper): the contract of
/// [`crate::cpu::backward`] (gradients in the input dtype) for bf16 or f16 inputs.
///
/// # Errors
/// As [`forward`], plus shape or dtype errors for `o`, `lse` (f32 `[b, h_q, s_q]`) and
/// `d_o`.
///
/// ```
/// use ringattn::{emu, random::randn, AttentionParams, DType};
/// let x = randn(vec![1, 24, 1, 8], 3, DType::F16);
/// let (p, opts) = (AttentionParams::default(), emu::EmuOptions::default());
/// let f = emu::forward(&x, &x, &x, None, &p, &opts)?;
/// let g = emu::backward(&x, &x, &x, &f.o, &f.lse, &x, None, &p, &opts)?;
/// assert_eq!(g.dk.shape(), &[1, 24, 1, 8]);
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
    opts: &EmuOptions,
) -> Result<Gradients> {
    runner::backward_tensors(&Emulator::new(opts), q, k, v, o, lse, d_o, positions, params, opts.dq_mode)
}
