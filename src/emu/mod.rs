//! The CUDA kernels of `cuda/*.cu`, compiled for the host against the emulator of
//! `cuda/emu/` (feature `emu`) and run on the CPU. Each function validates its buffers,
//! launches the kernel with the geometry the CUDA backend uses, and returns the emulator's
//! report (out-of-bounds accesses, shared-memory races, divergent barriers, deadlocks,
//! unwaited cp.async copies) as an error.
//!
//! * [`forward`] and [`backward`]: single-device attention through `flash_fwd.cu` and
//!   `flash_bwd.cu` (bf16 and f16 inputs; f32 is refused with
//!   [`Error::BackendUnsupported`]: the kernels compute on 16-bit inputs, and converting
//!   silently would change the precision the caller asked for).
//! * [`EmuBackend`]: the same kernels as a [`crate::parallel::Backend`], so every strategy
//!   runs on them (`ringattn run --backend emu`).
//! * [`merge_f32`]: the merge kernel.

use std::ffi::c_char;

use crate::kernels::geometry::Launch;
use crate::kernels::params::MergeParams;
use crate::{Error, Result};

mod backend;
mod flash;
pub mod named;
#[cfg(test)]
mod ops;
#[cfg(test)]
mod tile_counts;

pub use backend::EmuBackend;
pub use flash::{backward, forward};

/// Options of the emulated launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EmuOptions {
    /// Fiber order within each block.
    pub schedule: Schedule,
    /// OS threads the blocks of a launch are spread over; 0: one per core.
    pub workers: usize,
    /// How the backward computes dq (deterministic by default).
    pub dq_mode: crate::kernels::geometry::DqMode,
    /// Which kernel family runs the forward and the backward ([`KernelFamily::Auto`]: the FA2
    /// family here).
    ///
    /// [`KernelFamily::Auto`]: crate::kernels::geometry::KernelFamily::Auto
    pub kernels: crate::kernels::geometry::KernelFamily,
}

/// Launch geometry and emulator options, mirrored from `cuda/emu/launch.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct EmuLaunch {
    pub grid: [u32; 3],
    pub block: u32,
    pub smem_bytes: u64,
    pub schedule: i32,
    pub workers: u32,
    pub seed: u64,
    /// Null, or `[blocks][2]` u64: each block's cp.async copies and mma multiply-adds (see
    /// [`BlockCounts`]).
    pub block_counts: u64,
}

const _: () = assert!(std::mem::size_of::<EmuLaunch>() == 48);

impl EmuLaunch {
    /// A launch of `grid` blocks of `block` threads with `smem` bytes of dynamic shared
    /// memory under `opts`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a dimension beyond `u32`.
    pub(crate) fn new(l: Launch, opts: &EmuOptions) -> Result<Self> {
        let Launch { grid, block, smem_bytes: smem, .. } = l;
        let dim = |x: usize| {
            u32::try_from(x).map_err(|_| Error::InvalidArgument(format!("grid dimension {x} exceeds the launch limit")))
        };
        let (schedule, seed) = opts.schedule.code();
        Ok(EmuLaunch {
            grid: [dim(grid[0])?, dim(grid[1])?, dim(grid[2])?],
            block: dim(block)?,
            smem_bytes: smem as u64,
            schedule,
            workers: opts.workers as u32,
            seed,
            block_counts: 0,
        })
    }

    /// Blocks of the launch.
    fn blocks(&self) -> usize {
        self.grid.iter().map(|&g| g as usize).product()
    }
}

/// What one launch's blocks did (linear block index `x + grid_x (y + grid_y z)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaunchCounts {
    /// The kernel (`flash_fwd`, or a [`crate::kernels::geometry::BackwardKernel`]'s name).
    pub kernel: &'static str,
    /// 16-byte cp.async copies issued per block: the tiles its loop bounds made it load.
    pub copies: Vec<u64>,
    /// Tensor-core multiply-adds per block (16 · 8 · K per warp-wide mma).
    pub mma_macs: Vec<u64>,
}

/// Per kernel launch, what each block of the grid did ([`LaunchCounts`]), recorded by an
/// [`flash::Emulator`] that holds one: the loop-bound tests compare the copies with the tiles
/// a mask's geometry says each block must visit, the FLOP test the multiply-adds with
/// [`crate::flops::executed_flops`].
#[derive(Debug, Default)]
pub(crate) struct BlockCounts(std::sync::Mutex<Vec<LaunchCounts>>);

impl BlockCounts {
    /// A zeroed record (`[blocks][2]`) for the blocks of `l`, and `l` pointing at it;
    /// `record` stores it under `kernel` once the launch has run.
    fn slot(&self, l: &mut EmuLaunch) -> Vec<u64> {
        let mut v = vec![0u64; 2 * l.blocks()];
        l.block_counts = v.as_mut_ptr() as u64;
        v
    }

    fn record(&self, kernel: &'static str, counts: Vec<u64>) {
        let copies = counts.iter().step_by(2).copied().collect();
        let mma_macs = counts.iter().skip(1).step_by(2).copied().collect();
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(LaunchCounts { kernel, copies, mma_macs });
    }

    /// The records so far, in launch order, and cleared.
    #[cfg(test)]
    pub(crate) fn take(&self) -> Vec<LaunchCounts> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

extern "C" {
    fn ringattn_emu_merge_f32(p: MergeParams, l: EmuLaunch, msg: *mut c_char, cap: usize) -> i32;
    fn ringattn_emu_merge_sinks_f32(p: MergeParams, l: EmuLaunch, msg: *mut c_char, cap: usize) -> i32;
    fn ringattn_emu_sink_grad_f32(p: MergeParams, l: EmuLaunch, msg: *mut c_char, cap: usize) -> i32;
}

/// The order in which the emulator resumes a block's CUDA threads. Kernels whose results do
/// not depend on the order of atomics give bit-identical results under every schedule; a
/// missing barrier shows up as a difference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Thread 0 first.
    #[default]
    Forward,
    /// The last thread first.
    Reverse,
    /// A fresh seeded permutation every round.
    Random(u64),
}

impl Schedule {
    fn code(self) -> (i32, u64) {
        match self {
            Schedule::Forward => (0, 0),
            Schedule::Reverse => (1, 0),
            Schedule::Random(seed) => (2, seed),
        }
    }
}

fn check(code: i32, msg: &[u8], kernel: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
    Err(Error::Kernel { kernel: kernel.to_string(), report: String::from_utf8_lossy(&msg[..end]).into_owned() })
}

/// [`crate::merge::merge_into`] run by the `merge.cu` kernel under the emulator: merges the
/// partial `(o_b, lse_b)` into `(o_a, lse_a)` (`o` `[b, s, h, d]`, `lse` `[b, h, s]`, f32).
///
/// # Errors
/// [`Error::ShapeMismatch`] for buffer lengths that disagree with `bshd`; the emulator's
/// report when the kernel misbehaves.
///
/// ```
/// let (mut o, mut lse) = (vec![1.0f32; 4], vec![0.0f32; 2]);
/// ringattn::emu::merge_f32(&mut o, &mut lse, &[3.0; 4], &[0.0; 2], [1, 2, 1, 2])?;
/// assert_eq!(o, vec![2.0; 4]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn merge_f32(o_a: &mut [f32], lse_a: &mut [f32], o_b: &[f32], lse_b: &[f32], bshd: [usize; 4]) -> Result<()> {
    merge_f32_with(o_a, lse_a, o_b, lse_b, bshd, Schedule::Forward)
}

/// [`merge_f32`] under a given [`Schedule`].
///
/// # Errors
/// As [`merge_f32`].
pub fn merge_f32_with(
    o_a: &mut [f32],
    lse_a: &mut [f32],
    o_b: &[f32],
    lse_b: &[f32],
    bshd: [usize; 4],
    schedule: Schedule,
) -> Result<()> {
    crate::merge::check_lengths(o_a, lse_a, o_b, lse_b, bshd)?;
    let [b, s, h, d] = bshd;
    let p = MergeParams {
        o_acc: o_a.as_mut_ptr() as u64,
        lse_acc: lse_a.as_mut_ptr() as u64,
        o_part: o_b.as_ptr() as u64,
        lse_part: lse_b.as_ptr() as u64,
        b: b as i64,
        s: s as i64,
        h: h as i64,
        d: d as i64,
        ..Default::default()
    };
    // SAFETY: the four buffers have the lengths the kernel addresses (checked above), live for
    // the call, and `o_a`/`lse_a` are exclusively borrowed; the emulator runs synchronously.
    unsafe {
        run_merge_family(ringattn_emu_merge_f32, "merge", p, crate::kernels::geometry::merge(b * h * s), schedule)
    }
}

/// An emulator entry of the merge family (`cuda/emu/kernels.cpp`).
type MergeEntry = unsafe extern "C" fn(MergeParams, EmuLaunch, *mut c_char, usize) -> i32;

/// Runs `entry` with `p` on `launch` under `schedule` (nothing for an empty launch); the
/// emulator's report as [`Error::Kernel`] naming `kernel`.
///
/// # Safety
/// Every address in `p` is live for the call, covers what the kernel addresses for `p`'s
/// dims, and what the kernel writes is exclusively borrowed by the caller.
unsafe fn run_merge_family(
    entry: MergeEntry,
    kernel: &str,
    p: MergeParams,
    launch: crate::kernels::geometry::Launch,
    schedule: Schedule,
) -> Result<()> {
    if launch.is_empty() {
        return Ok(());
    }
    let l = EmuLaunch::new(launch, &EmuOptions { schedule, workers: 0, ..Default::default() })?;
    let mut msg = [0u8; 512];
    // SAFETY: the caller's contract; the emulator runs synchronously.
    let code = unsafe { entry(p, l, msg.as_mut_ptr().cast(), msg.len()) };
    check(code, &msg, kernel)
}

/// [`crate::merge::merge_sinks`] run by the merge family's `ringattn_merge_sinks_f32` under
/// the emulator (`o` `[b, s, h, d]`, `lse` `[b, h, s]`, `sinks` `[h]`, f32).
///
/// # Errors
/// As [`crate::merge::merge_sinks`]; the emulator's report when the kernel misbehaves.
///
/// ```
/// let (mut o, mut lse) = (vec![2.0f32; 2], vec![0.0f32; 1]);
/// ringattn::emu::merge_sinks_f32(&mut o, &mut lse, &[0.0], [1, 1, 1, 2])?;
/// assert_eq!(o, vec![1.0; 2]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn merge_sinks_f32(o: &mut [f32], lse: &mut [f32], sinks: &[f32], bshd: [usize; 4]) -> Result<()> {
    crate::merge::check_merge_sinks(o.len(), lse.len(), sinks.len(), bshd)?;
    let [b, s, h, d] = bshd;
    let p = MergeParams {
        o_acc: o.as_mut_ptr() as u64,
        lse_acc: lse.as_mut_ptr() as u64,
        sinks: sinks.as_ptr() as u64,
        b: b as i64,
        s: s as i64,
        h: h as i64,
        d: d as i64,
        ..Default::default()
    };
    let launch = crate::kernels::geometry::merge(b * h * s);
    // SAFETY: the buffers have the lengths the kernel addresses (checked above), live for the
    // call, `o`/`lse` exclusively borrowed.
    unsafe { run_merge_family(ringattn_emu_merge_sinks_f32, "merge_sinks", p, launch, Schedule::Forward) }
}

/// [`crate::merge::sink_grad`] run by the merge family's `ringattn_sink_grad_f32` under the
/// emulator (`lse`, `delta` `[b, h, s]`, `sinks` `[h]`, f32): `dsinks` `[h]`.
///
/// # Errors
/// As [`crate::merge::sink_grad`]; the emulator's report when the kernel misbehaves.
pub fn sink_grad_f32(lse: &[f32], delta: &[f32], sinks: &[f32], bhs: [usize; 3]) -> Result<Vec<f32>> {
    crate::merge::check_sink_grad(lse.len(), delta.len(), sinks.len(), bhs)?;
    let [b, h, s] = bhs;
    let mut dsinks = vec![0.0f32; h];
    let p = MergeParams {
        lse_acc: lse.as_ptr() as u64,
        sinks: sinks.as_ptr() as u64,
        delta: delta.as_ptr() as u64,
        dsinks: dsinks.as_mut_ptr() as u64,
        b: b as i64,
        s: s as i64,
        h: h as i64,
        ..Default::default()
    };
    let launch = crate::kernels::geometry::sink_grad(h);
    // SAFETY: as merge_sinks_f32, `dsinks` this function's own; the kernel only reads `lse`
    // (through a mutable-typed field).
    unsafe { run_merge_family(ringattn_emu_sink_grad_f32, "sink_grad", p, launch, Schedule::Forward)? };
    Ok(dsinks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::randn;
    use crate::DType;

    /// The sinks' kernels against the host functions: the merge bit for bit (the same f32
    /// operations), the gradient within f32 summation error of the f64 sum; rows that saw no
    /// key get `o = 0`, `lse = σ`.
    #[test]
    fn sink_kernels_match_the_host_functions() {
        let (b, s, h, d) = (2, 300, 3, 40);
        let o = randn(vec![b * s * h * d], 1, DType::F32).to_f32_vec();
        let mut lse = randn(vec![b * h * s], 2, DType::F32).to_f32_vec();
        for i in (0..lse.len()).step_by(7) {
            lse[i] = f32::NEG_INFINITY;
        }
        let sinks = [0.5f32, -1.0, 2.0];
        let (mut o_host, mut lse_host) = (o.clone(), lse.clone());
        crate::merge::merge_sinks(&mut o_host, &mut lse_host, &sinks, [b, s, h, d]).unwrap();
        let (mut o_emu, mut lse_emu) = (o.clone(), lse.clone());
        merge_sinks_f32(&mut o_emu, &mut lse_emu, &sinks, [b, s, h, d]).unwrap();
        assert!(o_emu.iter().zip(&o_host).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(lse_emu.iter().zip(&lse_host).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(lse_host[0], sinks[0]);
        assert!(o_host[..d].iter().all(|&x| x == 0.0));
        let delta = randn(vec![b * h * s], 3, DType::F32).to_f32_vec();
        let want = crate::merge::sink_grad(&lse_host, &delta, &sinks, [b, h, s]).unwrap();
        let got = sink_grad_f32(&lse_host, &delta, &sinks, [b, h, s]).unwrap();
        for (hi, (g, w)) in got.iter().zip(&want).enumerate() {
            // |error| <= (rows) u_f32 Σ|terms|
            let at = |bi: usize| (bi * h + hi) * s;
            let mass: f64 = (0..b)
                .flat_map(|bi| (at(bi)..at(bi) + s).map(|i| ((sinks[hi] - lse_host[i]).exp() * delta[i]).abs() as f64))
                .sum();
            let bound = 2.0 * (s as f64) * f64::from(f32::EPSILON) * mass;
            assert!((f64::from(*g) - f64::from(*w)).abs() <= bound, "head {hi}: {g} vs {w} (bound {bound})");
            assert_ne!(*w, 0.0);
        }
        assert!(sink_grad_f32(&lse_host, &delta, &sinks[..2], [b, h, s]).is_err());
    }

    #[test]
    fn merge_kernel_matches_the_host_merge() {
        let (b, s, h, d) = (2, 37, 3, 40);
        let o_a = randn(vec![b * s * h * d], 1, DType::F32).to_f32_vec();
        let o_b = randn(vec![b * s * h * d], 2, DType::F32).to_f32_vec();
        let mut lse_a = randn(vec![b * h * s], 3, DType::F32).to_f32_vec();
        let mut lse_b = randn(vec![b * h * s], 4, DType::F32).to_f32_vec();
        // Rows where one side, or both, saw no key.
        for i in (0..lse_a.len()).step_by(7) {
            lse_a[i] = f32::NEG_INFINITY;
        }
        for i in (0..lse_b.len()).step_by(5) {
            lse_b[i] = f32::NEG_INFINITY;
        }
        let (mut o1, mut l1) = (o_a.clone(), lse_a.clone());
        crate::merge::merge_into(&mut o1, &mut l1, &o_b, &lse_b, [b, s, h, d]).unwrap();
        let (o_a_copy, lse_a_copy) = (o_a.clone(), lse_a.clone());
        let (mut o2, mut l2) = (o_a, lse_a);
        merge_f32(&mut o2, &mut l2, &o_b, &lse_b, [b, s, h, d]).unwrap();
        for (x, y) in o1.iter().zip(&o2).chain(l1.iter().zip(&l2)) {
            assert!(x == y || (x - y).abs() <= 2e-6 * x.abs().max(1.0), "{x} vs {y}");
        }
        assert!(l2.contains(&f32::NEG_INFINITY));
        // Bit-identical under every schedule.
        for schedule in [Schedule::Reverse, Schedule::Random(1), Schedule::Random(99)] {
            let (mut o3, mut l3) = (o_a_copy.clone(), lse_a_copy.clone());
            merge_f32_with(&mut o3, &mut l3, &o_b, &lse_b, [b, s, h, d], schedule).unwrap();
            assert!(o3.iter().zip(&o2).all(|(x, y)| x.to_bits() == y.to_bits()), "{schedule:?}");
            assert!(l3.iter().zip(&l2).all(|(x, y)| x.to_bits() == y.to_bits()), "{schedule:?}");
        }
    }

    extern "C" {
        fn ringattn_emu_selftest(which: i32, n: u32, buf: *mut f32, out: *mut f32, msg: *mut c_char, cap: usize)
            -> i32;
    }

    fn selftest(which: i32, n: u32) -> (i32, Vec<f32>, String) {
        let (mut buf, mut out, mut msg) = (vec![0.0f32; n as usize], vec![-1.0f32; 4 * n as usize], [0u8; 512]);
        // SAFETY: both buffers hold `n` floats, the kernel's whole range.
        let code = unsafe {
            ringattn_emu_selftest(which, n, buf.as_mut_ptr(), out.as_mut_ptr(), msg.as_mut_ptr().cast(), msg.len())
        };
        let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
        (code, out, String::from_utf8_lossy(&msg[..end]).into_owned())
    }

    #[test]
    fn syncthreads_orders_every_write_before_every_read() {
        let (code, out, msg) = selftest(0, 96);
        assert_eq!(code, 0, "{msg}");
        let want: Vec<f32> = (0..96).map(|i| ((i + 1) % 96) as f32).collect();
        assert_eq!(&out[..96], &want[..]);
    }

    #[test]
    fn shared_memory_is_poisoned_per_block_and_atomics_add_up() {
        let n = 128u32;
        let (code, out, msg) = selftest(3, n);
        assert_eq!(code, 0, "{msg}");
        let block_sum: u32 = (0..n).sum();
        assert_eq!(out[0], (3 * block_sum) as f32);
        assert!(out[1..4].iter().all(|x| x.is_nan()), "reads before writes see the poison: {:?}", &out[1..4]);
    }

    #[test]
    fn warp_shuffles_and_ballot_follow_cuda() {
        let n = 64usize;
        let (code, out, msg) = selftest(2, n as u32);
        assert_eq!(code, 0, "{msg}");
        for i in 0..n {
            let w0 = i / 32 * 32;
            let warp_sum: usize = (w0..w0 + 32).sum();
            assert_eq!(out[i], warp_sum as f32, "xor-sum lane {i}");
            assert_eq!(out[n + i], (w0 + 3) as f32, "broadcast lane {i}");
            let down = if i % 32 == 31 { i } else { i + 1 };
            assert_eq!(out[2 * n + i], down as f32, "shfl_down lane {i}");
            assert_eq!(out[3 * n + i], 0xaaaa_aaaau32 as f32, "ballot lane {i}");
        }
    }

    #[test]
    fn a_divergent_barrier_is_reported() {
        let (code, _, msg) = selftest(1, 64);
        assert_eq!(code, 1);
        assert!(msg.contains("divergent __syncthreads"), "{msg}");
    }

    extern "C" {
        fn ringattn_emu_selftest_mma(
            regs: *const u32,
            c: *const f32,
            d: *mut f32,
            bf16: i32,
            msg: *mut c_char,
            cap: usize,
        ) -> i32;
    }

    /// The m16n8k16 fragment tables of the PTX ISA, written here independently of the C++
    /// twin: for lane `l`, the (row, col) of each half of each A register, each half of each
    /// B register (as (k, n)), and each C/D element.
    /// (row, col) positions.
    type At = (usize, usize);

    fn lane_table(l: usize) -> ([[At; 2]; 4], [[At; 2]; 2], [At; 4]) {
        let (g, t) = (l / 4, l % 4);
        let a = [
            [(g, 2 * t), (g, 2 * t + 1)],
            [(g + 8, 2 * t), (g + 8, 2 * t + 1)],
            [(g, 2 * t + 8), (g, 2 * t + 9)],
            [(g + 8, 2 * t + 8), (g + 8, 2 * t + 9)],
        ];
        let b = [[(2 * t, g), (2 * t + 1, g)], [(2 * t + 8, g), (2 * t + 9, g)]];
        let c = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)];
        (a, b, c)
    }

    #[test]
    fn lane_table_matches_the_ptx_isa_rows() {
        // Rows copied from the table in ptx-and-emulation.md §1.2 (lanes 0, 5, 13, 31).
        assert_eq!(lane_table(0).0, [[(0, 0), (0, 1)], [(8, 0), (8, 1)], [(0, 8), (0, 9)], [(8, 8), (8, 9)]]);
        assert_eq!(lane_table(5).1, [[(2, 1), (3, 1)], [(10, 1), (11, 1)]]);
        assert_eq!(lane_table(13).2, [(3, 2), (3, 3), (11, 2), (11, 3)]);
        assert_eq!(lane_table(31).0[3], [(15, 14), (15, 15)]);
        assert_eq!(lane_table(31).1, [[(6, 7), (7, 7)], [(14, 7), (15, 7)]]);
    }

    fn check_mma(dtype: crate::DType) {
        use half::{bf16, f16};
        let to_bits = |x: f32| -> u16 {
            match dtype {
                crate::DType::BF16 => bf16::from_f32(x).to_bits(),
                _ => f16::from_f32(x).to_bits(),
            }
        };
        let from_bits = |b: u16| -> f64 {
            match dtype {
                crate::DType::BF16 => bf16::from_bits(b).to_f64(),
                _ => f16::from_bits(b).to_f64(),
            }
        };
        let a_vals = randn(vec![16 * 16], 11, crate::DType::F32).to_f32_vec();
        let b_vals = randn(vec![16 * 8], 12, crate::DType::F32).to_f32_vec();
        let c_vals = randn(vec![16 * 8], 13, crate::DType::F32).to_f32_vec();
        let a_bits: Vec<u16> = a_vals.iter().map(|&x| to_bits(x)).collect();
        let b_bits: Vec<u16> = b_vals.iter().map(|&x| to_bits(x)).collect();
        let pack = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
        let mut regs = vec![0u32; 32 * 6];
        let mut c = vec![0f32; 32 * 4];
        for l in 0..32 {
            let (ta, tb, tc) = lane_table(l);
            for (i, [(r0, c0), (r1, c1)]) in ta.iter().enumerate() {
                regs[l * 6 + i] = pack(a_bits[r0 * 16 + c0], a_bits[r1 * 16 + c1]);
            }
            for (i, [(k0, n0), (k1, n1)]) in tb.iter().enumerate() {
                regs[l * 6 + 4 + i] = pack(b_bits[k0 * 8 + n0], b_bits[k1 * 8 + n1]);
            }
            for (i, &(m, n)) in tc.iter().enumerate() {
                c[l * 4 + i] = c_vals[m * 8 + n];
            }
        }
        let mut d = vec![0f32; 32 * 4];
        let mut msg = [0u8; 512];
        let flag = (dtype == crate::DType::BF16) as i32;
        // SAFETY: regs, c and d hold 32 lanes' worth of values, as the kernel reads and writes.
        let code = unsafe {
            ringattn_emu_selftest_mma(regs.as_ptr(), c.as_ptr(), d.as_mut_ptr(), flag, msg.as_mut_ptr().cast(), 512)
        };
        assert_eq!(code, 0);
        for l in 0..32 {
            for (i, &(m, n)) in lane_table(l).2.iter().enumerate() {
                let exact: f64 = (0..16).map(|k| from_bits(a_bits[m * 16 + k]) * from_bits(b_bits[k * 8 + n])).sum();
                let want = (exact + c_vals[m * 8 + n] as f64) as f32;
                assert_eq!(d[l * 4 + i], want, "{dtype:?} lane {l} element {i} = D[{m}][{n}]");
            }
        }
    }

    #[test]
    fn mma_m16n8k16_twin_follows_the_fragment_tables() {
        check_mma(crate::DType::BF16);
        check_mma(crate::DType::F16);
    }

    extern "C" {
        fn ringattn_emu_selftest_ldmatrix(tile: *const u16, out: *mut u32, msg: *mut c_char, cap: usize) -> i32;
    }

    #[test]
    fn ldmatrix_twins_compose_into_mma_fragments() {
        // Codes identifying each element: tile[r][c] = 16r + c.
        let tile: Vec<u16> = (0..256).collect();
        let mut out = vec![0u32; 32 * 6];
        let mut msg = [0u8; 512];
        // SAFETY: tile holds 256 values and out 32 lanes × 6 registers, as the kernel uses.
        let code =
            unsafe { ringattn_emu_selftest_ldmatrix(tile.as_ptr(), out.as_mut_ptr(), msg.as_mut_ptr().cast(), 512) };
        assert_eq!(code, 0);
        let code_of = |(r, c): At| (16 * r + c) as u32;
        for l in 0..32 {
            let (a, b, _) = lane_table(l);
            // ldmatrix.x4 over a row-major 16x16 tile yields the A fragments of m16n8k16.
            for (i, [lo, hi]) in a.iter().enumerate() {
                assert_eq!(out[l * 6 + i], code_of(*lo) | code_of(*hi) << 16, "A.R{i} lane {l}");
            }
            // ldmatrix.x2.trans over V stored [k][n] yields the B fragments (k, n) for n < 8.
            for (i, [lo, hi]) in b.iter().enumerate() {
                assert_eq!(out[l * 6 + 4 + i], code_of(*lo) | code_of(*hi) << 16, "B.R{i} lane {l}");
            }
        }
    }

    extern "C" {
        fn ringattn_emu_selftest_cp_async(
            unwaited: i32,
            src: *const f32,
            out: *mut f32,
            ex: *mut f32,
            msg: *mut c_char,
            cap: usize,
        ) -> i32;
    }

    /// A 16-byte aligned buffer of 256 floats (the kernel copies 16-byte pieces).
    #[repr(C, align(16))]
    struct Aligned([f32; 256]);

    #[test]
    fn cp_async_groups_retire_in_order_and_ex2_is_exact() {
        let src = Aligned(std::array::from_fn(|i| i as f32 + 0.5));
        let (mut out, mut ex, mut msg) = (vec![0f32; 32 * 12], vec![0f32; 32], [0u8; 512]);
        // SAFETY: src holds 32 lanes × 8 floats, out 32 × 12, ex 32, as the kernel uses.
        let code = unsafe {
            ringattn_emu_selftest_cp_async(
                0,
                src.0.as_ptr(),
                out.as_mut_ptr(),
                ex.as_mut_ptr(),
                msg.as_mut_ptr().cast(),
                512,
            )
        };
        assert_eq!(code, 0);
        for l in 0..32 {
            let o = &out[l * 12..(l + 1) * 12];
            assert!(o[..4].iter().all(|x| x.is_nan()), "lane {l}: destination poisoned before the wait");
            assert_eq!(&o[4..8], &src.0[l * 8..l * 8 + 4], "lane {l}: first group after wait<1>");
            assert_eq!(&o[8..10], &src.0[l * 8 + 4..l * 8 + 6], "lane {l}: 8 bytes read");
            assert_eq!(&o[10..12], &[0.0, 0.0], "lane {l}: the rest zero-filled");
            assert_eq!(ex[l], 2f32.powi(l as i32 - 20));
        }
    }

    #[test]
    fn an_unwaited_cp_async_is_reported() {
        let src = Aligned([1.0; 256]);
        let mut msg = [0u8; 512];
        // SAFETY: src holds the 32 × 4 floats the kernel reads; out and ex are unused.
        let code = unsafe {
            ringattn_emu_selftest_cp_async(
                1,
                src.0.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                msg.as_mut_ptr().cast(),
                512,
            )
        };
        let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
        let text = String::from_utf8_lossy(&msg[..end]);
        assert_eq!(code, 1);
        assert!(text.contains("never waited"), "{text}");
    }

    extern "C" {
        fn ringattn_emu_selftest_missing_barrier(
            schedule: i32,
            seed: u64,
            n: u32,
            buf: *mut f32,
            out: *mut f32,
            msg: *mut c_char,
            cap: usize,
        ) -> i32;
    }

    #[test]
    fn schedule_perturbation_exposes_a_missing_barrier() {
        let run = |schedule: Schedule| {
            let (mode, seed) = schedule.code();
            let (mut buf, mut out, mut msg) = (vec![0f32; 64], vec![0f32; 64], [0u8; 256]);
            // SAFETY: buf and out hold the 64 floats the one-block kernel touches.
            let code = unsafe {
                ringattn_emu_selftest_missing_barrier(
                    mode,
                    seed,
                    64,
                    buf.as_mut_ptr(),
                    out.as_mut_ptr(),
                    msg.as_mut_ptr().cast(),
                    msg.len(),
                )
            };
            assert_eq!(code, 0);
            out
        };
        let forward = run(Schedule::Forward);
        assert_ne!(forward, run(Schedule::Reverse), "the race is visible");
        assert_ne!(forward, run(Schedule::Random(3)));
    }

    extern "C" {
        fn ringattn_emu_selftest_checks(which: i32, schedule: i32, msg: *mut c_char, cap: usize) -> i32;
    }

    /// Runs planted-bug kernel `which` of `selftest.cpp`; returns the emulator's report.
    fn planted(which: i32, schedule: Schedule) -> Option<String> {
        let mut msg = [0u8; 512];
        // SAFETY: the kernel uses its own buffers; msg holds 512 bytes.
        let code = unsafe { ringattn_emu_selftest_checks(which, schedule.code().0, msg.as_mut_ptr().cast(), 512) };
        let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
        (code != 0).then(|| String::from_utf8_lossy(&msg[..end]).into_owned())
    }

    #[test]
    fn the_race_shadow_reports_missing_barriers_and_passes_their_fixes() {
        for schedule in [Schedule::Forward, Schedule::Reverse, Schedule::Random(5)] {
            assert_eq!(planted(0, schedule), None, "exchange with its barrier");
            assert_eq!(planted(2, schedule), None, "tile loop with both barriers");
            let race = planted(1, schedule).expect("missing barrier reported");
            assert!(race.contains("shared-memory race"), "{race}");
            let war = planted(3, schedule).expect("missing second barrier reported");
            assert!(war.contains("shared-memory race"), "{war}");
            if schedule == Schedule::Forward {
                // Thread 0 reads thread 1's row, then thread 1 issues the next tile's copy.
                assert!(war.contains("(write after read) in cp.async (issue)"), "{war}");
            }
        }
    }

    #[test]
    fn out_of_bounds_cp_async_is_reported_with_the_buffer() {
        let src = planted(4, Schedule::Forward).expect("source overrun reported");
        assert!(src.contains("thread 31") && src.contains("cp.async source") && src.contains("`src`"), "{src}");
        assert!(src.contains("offset 512"), "{src}");
        let dst = planted(5, Schedule::Forward).expect("shared overrun reported");
        assert!(dst.contains("cp.async destination") && dst.contains("512 bytes of dynamic shared memory"), "{dst}");
    }

    #[test]
    fn merge_kernel_rejects_bad_lengths() {
        let e = merge_f32(&mut [0.0; 3], &mut [0.0; 1], &[0.0; 4], &[0.0; 1], [1, 1, 1, 4]).unwrap_err();
        assert!(e.to_string().contains("o_a"), "{e}");
    }
}

#[cfg(test)]
mod ptx_tests;
