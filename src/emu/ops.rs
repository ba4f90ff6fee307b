//! The data movements of `cuda/ops.cu` under the emulator against the host semantics of the
//! drivers' `Buffers` operations (the `HostMemory` implementation, i.e. `parallel/seq.rs`):
//! the device backend composes the same kernels with the same [`OpsParams`] constructors.

use std::ffi::c_char;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{check, EmuLaunch, EmuOptions, Schedule};
use crate::kernels::geometry::{self, Launch, OpsKernel};
use crate::kernels::params::{pair_word, words, OpsParams};
use crate::parallel::{BufShape, Buffers, CpuBackend};
use crate::random::randn;
use crate::{DType, Elem, HostBuf, Result};

extern "C" {
    fn ringattn_emu_ops(kernel: i32, p: OpsParams, l: EmuLaunch, msg: *mut c_char, cap: usize) -> i32;
}

/// Launches `kernel` with `p` under the emulator: the device geometry, or `grid` blocks of
/// `block` threads (to exercise the grid-stride loops with few threads).
fn launch(kernel: OpsKernel, p: OpsParams, small: Option<(usize, usize)>, schedule: Schedule) -> Result<()> {
    let mut l: Launch = geometry::ops(kernel, &p);
    if l.is_empty() {
        return Ok(());
    }
    if let Some((grid, block)) = small {
        l.grid = [grid, 1, 1];
        l.block = block;
    }
    let l = EmuLaunch::new(l, &EmuOptions { schedule, ..Default::default() })?;
    let mut msg = [0u8; 512];
    // SAFETY: every test below passes addresses of live host buffers holding at least what
    // `p` addresses (the emulator registers exactly those ranges and reports any access
    // outside them); the launch is synchronous.
    let code = unsafe { ringattn_emu_ops(kernel as i32, p, l, msg.as_mut_ptr().cast(), msg.len()) };
    check(code, &msg, kernel.entry())
}

fn addr(x: &[f32]) -> u64 {
    x.as_ptr() as u64
}

fn addr_mut(x: &mut [f32]) -> u64 {
    x.as_mut_ptr() as u64
}

/// The emulated twin of the device backend's compositions.
struct Emu {
    small: Option<(usize, usize)>,
    schedule: Schedule,
}

impl Emu {
    fn run(&self, kernel: OpsKernel, p: OpsParams) {
        launch(kernel, p, self.small, self.schedule).unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
    }

    fn filled(&self, len: usize, value: f32) -> Vec<f32> {
        let mut out = vec![f32::NAN; len];
        self.run(OpsKernel::Fill, OpsParams::fill(addr_mut(&mut out), len, value));
        out
    }

    fn add_into(&self, acc: &mut [f32], x: &[f32]) {
        assert_eq!(acc.len(), x.len());
        self.run(OpsKernel::Add, OpsParams::add(addr_mut(acc), addr(x), x.len()));
    }

    fn convert(&self, x: &[f32], dtype: DType) -> Vec<u16> {
        let mut out = vec![0xdeadu16; x.len()];
        self.run(OpsKernel::convert_to(dtype), OpsParams::convert(out.as_mut_ptr() as u64, addr(x), x.len()));
        out
    }

    fn round(&self, x: &[f32], dtype: DType) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len()];
        match OpsKernel::round_to(dtype) {
            Some(k) => self.run(k, OpsParams::round(addr_mut(&mut out), addr(x), x.len())),
            None => out.copy_from_slice(x),
        }
        out
    }

    fn concat_seq(&self, parts: &[Vec<f32>], b: usize, w: usize) -> Vec<f32> {
        let rows: Vec<usize> = parts.iter().map(|p| p.len() / (b * w)).collect();
        let total: usize = rows.iter().sum();
        let mut out = vec![f32::NAN; b * total * w];
        let mut off = 0;
        for (p, &n) in parts.iter().zip(&rows) {
            let params = OpsParams::copy_rows(addr_mut(&mut out), total, off, addr(p), n, 0).rows(b, n, w);
            self.run(OpsKernel::CopyRows, params);
            off += n;
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn seq_slice(&self, x: &[f32], b: usize, s: usize, w: usize, r0: usize, n: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; b * n * w];
        self.run(OpsKernel::CopyRows, OpsParams::copy_rows(addr_mut(&mut out), n, 0, addr(x), s, r0).rows(b, n, w));
        out
    }

    fn select_heads(&self, x: &[f32], sh: BufShape, heads: &[usize]) -> Vec<f32> {
        let idx: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
        let mut out = vec![f32::NAN; sh.b * sh.n * heads.len() * sh.d];
        let p = OpsParams::heads(
            true,
            addr(x),
            addr_mut(&mut out),
            idx.as_ptr() as u64,
            sh.b * sh.n,
            sh.h,
            heads.len(),
            sh.d,
            false,
        );
        self.run(OpsKernel::SelectHeads, p);
        out
    }

    fn scatter_heads(&self, dst: &mut [f32], sh: BufShape, heads: &[usize], src: &[f32], assign: bool) {
        let idx: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
        let p = OpsParams::heads(
            false,
            addr_mut(dst),
            addr(src),
            idx.as_ptr() as u64,
            sh.b * sh.n,
            sh.h,
            heads.len(),
            sh.d,
            assign,
        );
        self.run(OpsKernel::ScatterHeads, p);
    }
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn vals(n: usize, seed: u64) -> Vec<f32> {
    randn(vec![n.max(1)], seed, DType::F32).to_f32_vec()[..n].to_vec()
}

/// Every configuration the ops run under: the device geometry, and few threads (grid
/// stride) under reversed and random fiber orders.
fn emus() -> [Emu; 3] {
    [
        Emu { small: None, schedule: Schedule::Forward },
        Emu { small: Some((2, 32)), schedule: Schedule::Reverse },
        Emu { small: Some((1, 7)), schedule: Schedule::Random(5) },
    ]
}

/// A host buffer of f32 values.
fn hb(x: &[f32]) -> HostBuf {
    x.to_vec().into()
}

fn hbs(x: &[Vec<f32>]) -> Vec<HostBuf> {
    x.iter().map(|v| hb(v)).collect()
}

/// The f32 values of a host operation's result.
fn hv(b: Result<HostBuf>) -> Vec<f32> {
    b.expect("host operation").f32s().expect("f32 values").to_vec()
}

#[test]
fn fill_and_add_match_the_host() {
    let host = CpuBackend::default();
    for e in emus() {
        for (len, value) in [(1, 2.5f32), (1023, -3.25), (0, 1.0), (777, f32::NEG_INFINITY)] {
            assert!(bits_eq(&e.filled(len, value), &hv(host.filled(len, value, DType::F32))), "fill {len}");
        }
        let (a, x) = (vals(1031, 1), vals(1031, 2));
        let (mut got, mut want) = (a.clone(), hb(&a));
        e.add_into(&mut got, &x);
        host.add_into(&mut want, &hb(&x)).unwrap();
        assert!(bits_eq(&got, &hv(Ok(want))));
    }
}

#[test]
fn conversions_round_like_the_half_crate() {
    let mut x = vals(517, 3);
    x.iter_mut().enumerate().for_each(|(i, v)| *v *= [1.0, 1e-5, 1e4, 1e-8, 7e4][i % 5]);
    // Specials, boundaries and exact halfway cases of both formats.
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        65504.0,
        65520.0,
        65519.99,
        6.0e-8,
        2.98e-8,
        5.96e-8,
        6.1e-5,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3f80_8001),
        -1.0e30,
    ]);
    for dtype in [DType::BF16, DType::F16] {
        let want = crate::runner::to_bits(&x, dtype);
        // The values of those bits, widened by the half crate (the host's `convert`).
        let want_round = HostBuf::from(x.clone()).converted(dtype).to_f32().unwrap().into_owned();
        for e in emus() {
            let got = e.convert(&x, dtype);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{dtype}: {} ({:#010x}): {g:#06x} vs {w:#06x}", x[i], x[i].to_bits());
            }
            let got = e.round(&x, dtype);
            for (i, (g, w)) in got.iter().zip(&want_round).enumerate() {
                let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                assert!(same, "round {dtype}: {} -> {g} ({:#010x}) vs {w} ({:#010x})", x[i], g.to_bits(), w.to_bits());
            }
        }
    }
}

#[test]
fn concat_and_slice_along_the_sequence_match_the_host() {
    let host = CpuBackend::default();
    let (b, w) = (3, 7);
    let parts: Vec<Vec<f32>> =
        [3usize, 0, 5, 1].iter().enumerate().map(|(i, n)| vals(b * n * w, 10 + i as u64)).collect();
    let x = vals(2 * 11 * 5, 20);
    for e in emus() {
        assert!(bits_eq(&e.concat_seq(&parts, b, w), &hv(host.concat_seq(&hbs(&parts), b, w))));
        // An LSE as the Ulysses drivers see it: [b·k, S, 1].
        let lse_parts = vec![vals(6 * 2, 30), vals(6 * 3, 31)];
        assert!(bits_eq(&e.concat_seq(&lse_parts, 6, 1), &hv(host.concat_seq(&hbs(&lse_parts), 6, 1))));
        for (r0, n) in [(3, 6), (0, 11), (10, 1), (11, 0), (4, 0)] {
            let got = e.seq_slice(&x, 2, 11, 5, r0, n);
            assert!(bits_eq(&got, &hv(host.seq_slice(&hb(&x), 2, 11, 5, r0, n))), "slice {r0}+{n}");
        }
    }
}

#[test]
fn select_and_scatter_heads_match_the_host() {
    let host = CpuBackend::default();
    // Odd shapes; head lists with repeats (the replicas of uneven GQA) and in any order; an
    // LSE as a [b, 1, h, n] buffer.
    let shapes = [BufShape { b: 2, n: 3, h: 5, d: 3 }, BufShape { b: 1, n: 1, h: 4, d: 13 }];
    let lists: [&[usize]; 5] = [&[3, 0, 0, 2], &[1], &[3, 2, 1, 0], &[], &[2, 2, 2]];
    for e in emus() {
        for (si, sh) in shapes.iter().enumerate() {
            let x = vals(sh.len(), 40 + si as u64);
            for heads in lists {
                let part_shape = BufShape { h: heads.len(), ..*sh };
                let want = hv(host.select_heads(&hb(&x), *sh, heads));
                assert!(bits_eq(&e.select_heads(&x, *sh, heads), &want), "select {heads:?}");
                let src = vals(part_shape.len(), 50);
                for assign in [true, false] {
                    let (mut got, mut want) = (x.clone(), hb(&x));
                    e.scatter_heads(&mut got, *sh, heads, &src, assign);
                    host.scatter_heads(&mut want, *sh, heads, &hb(&src), assign).unwrap();
                    assert!(bits_eq(&got, &hv(Ok(want))), "scatter {heads:?} assign {assign}");
                }
            }
        }
    }
}

#[test]
fn out_of_range_accesses_are_reported() {
    // A head index past the buffer: the emulator names the access instead of reading it.
    let x = vec![0.0f32; 12];
    let mut out = vec![0.0f32; 3];
    let idx = [7i64];
    let p = OpsParams::heads(true, addr(&x), addr_mut(&mut out), idx.as_ptr() as u64, 1, 4, 1, 3, false);
    let e = launch(OpsKernel::SelectHeads, p, None, Schedule::Forward).unwrap_err().to_string();
    assert!(e.contains("outside every buffer") && e.contains("ringattn_ops_select_heads_f32"), "{e}");
    for k in OpsKernel::ALL {
        assert!(k.entry().starts_with("ringattn_ops_"));
        assert_eq!(geometry::ops(k, &OpsParams::default()).grid[0], 0, "{k:?}: no work, no launch");
    }
    let big = OpsParams::fill(0, 1 << 30, 0.0);
    assert_eq!(geometry::ops(OpsKernel::Fill, &big).grid[0], geometry::OPS_MAX_BLOCKS);
}

/// The drivers over the emulated device: every data movement of a strategy through the
/// ops.cu kernels (composed as `cuda::DeviceBackend` composes them: typed buffers, 16-bit
/// values moved as pairs of values in 4-byte words, [`words`], 16-bit allocations padded to
/// an even count), the attention steps through the emulated flash kernels. Buffers are host
/// memory standing in for device memory, each in its own element type as on the device;
/// host↔device transfers and the sizes of the buffers the device allocates are counted.
struct EmuDevice {
    ops: Emu,
    flash: super::EmuBackend,
    /// Uploads and downloads so far.
    transfers: AtomicUsize,
    /// Elements of every buffer the device allocated so far.
    allocations: Mutex<Vec<usize>>,
}

/// A device allocation of the emulated device: `len` values of `elem` in a zeroed byte
/// vector of the device's capacity (16-bit: an even count), as 4-byte words.
struct Alloc {
    words: Vec<u32>,
    elem: Elem,
    len: usize,
}

impl Alloc {
    fn new(elem: Elem, len: usize) -> Alloc {
        let cap = crate::kernels::params::device_capacity(elem, len);
        Alloc { words: vec![0xffff_ffff; (cap * elem.size_of()).div_ceil(4)], elem, len }
    }

    fn addr(&mut self) -> u64 {
        self.words.as_mut_ptr() as u64
    }

    fn into_buf(self) -> HostBuf {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words);
        HostBuf::new(
            crate::HostData::from_bytes(self.elem, &bytes[..self.len * self.elem.size_of()]).expect("whole values"),
        )
    }
}

fn read_addr(b: &HostBuf) -> u64 {
    b.data().as_bytes().as_ptr() as u64
}

impl EmuDevice {
    fn new(ops: Emu, flash: super::EmuBackend) -> Self {
        EmuDevice { ops, flash, transfers: AtomicUsize::new(0), allocations: Mutex::new(Vec::new()) }
    }

    fn alloc(&self, elem: Elem, len: usize) -> Alloc {
        self.allocations.lock().unwrap().push(len);
        Alloc::new(elem, len)
    }

    fn record(&self, len: usize) {
        self.allocations.lock().unwrap().push(len);
    }

    /// Transfers and the largest allocation since the last call; resets both.
    fn take_counts(&self) -> (usize, usize) {
        let largest = self.allocations.lock().unwrap().drain(..).max().unwrap_or(0);
        (self.transfers.swap(0, Ordering::Relaxed), largest)
    }
}

impl Buffers for EmuDevice {
    type Buf = HostBuf;

    fn upload(&self, host: &HostBuf) -> Result<HostBuf> {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        Ok(HostBuf::new(host.data().clone()))
    }

    fn download(&self, buf: &HostBuf) -> Result<HostBuf> {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        Ok(buf.clone())
    }

    fn filled(&self, len: usize, value: f32, dtype: DType) -> Result<HostBuf> {
        let mut out = self.alloc(dtype.into(), len);
        let (n, word) = match dtype {
            DType::F32 => (len, value),
            DType::BF16 => (out.words.len(), pair_word(half::bf16::from_f32(value).to_bits())),
            DType::F16 => (out.words.len(), pair_word(half::f16::from_f32(value).to_bits())),
        };
        self.ops.run(OpsKernel::Fill, OpsParams::fill(out.addr(), n, word));
        Ok(out.into_buf())
    }

    fn convert(&self, x: &HostBuf, dtype: DType) -> Result<HostBuf> {
        if x.elem() == Elem::from(dtype) {
            return Ok(x.clone());
        }
        let from = x.elem().dtype().expect("a tensor dtype");
        let wide = match OpsKernel::convert_from(from) {
            None => x.clone(),
            Some(kernel) => {
                let mut out = self.alloc(Elem::F32, x.len());
                self.ops.run(kernel, OpsParams::widen(out.addr(), read_addr(x), x.len()));
                out.into_buf()
            }
        };
        if dtype == DType::F32 {
            return Ok(wide);
        }
        let mut out = self.alloc(dtype.into(), x.len());
        self.ops.run(OpsKernel::convert_to(dtype), OpsParams::convert(out.addr(), read_addr(&wide), x.len()));
        Ok(out.into_buf())
    }

    fn add_into(&self, acc: &mut HostBuf, x: &HostBuf) -> Result<()> {
        self.ops.add_into(acc.f32s_mut()?, x.f32s()?);
        Ok(())
    }

    fn merge_into(
        &self,
        o: &mut HostBuf,
        lse: &mut HostBuf,
        o_b: &HostBuf,
        lse_b: &HostBuf,
        bshd: [usize; 4],
    ) -> Result<()> {
        // The merge kernel has its own emulated tests; the host merge keeps the comparison
        // below bit for bit.
        crate::merge::merge_into(o.f32s_mut()?, lse.f32s_mut()?, o_b.f32s()?, lse_b.f32s()?, bshd)
    }

    fn merge_sinks(&self, o: &mut HostBuf, lse: &mut HostBuf, sinks: &HostBuf, bshd: [usize; 4]) -> Result<()> {
        // The sinks' kernels run here (the emulated device's only use of them besides their
        // test against the host functions).
        crate::emu::merge_sinks_f32(o.f32s_mut()?, lse.f32s_mut()?, sinks.f32s()?, bshd)
    }

    fn sink_grad(&self, lse: &HostBuf, delta: &HostBuf, sinks: &HostBuf, bhs: [usize; 3]) -> Result<HostBuf> {
        Ok(crate::emu::sink_grad_f32(lse.f32s()?, delta.f32s()?, sinks.f32s()?, bhs)?.into())
    }

    fn concat_seq(&self, parts: &[HostBuf], b: usize, w: usize) -> Result<HostBuf> {
        let elem = parts.first().map_or(Elem::F32, HostBuf::elem);
        let rows: Vec<usize> = parts.iter().map(|p| p.len() / (b * w)).collect();
        let total: usize = rows.iter().sum();
        let words = words(elem, w, "concat")?;
        let mut out = self.alloc(elem, b * total * w);
        let mut off = 0;
        for (p, &n) in parts.iter().zip(&rows) {
            let params = OpsParams::copy_rows(out.addr(), total, off, read_addr(p), n, 0).rows(b, n, words);
            self.ops.run(OpsKernel::CopyRows, params);
            off += n;
        }
        Ok(out.into_buf())
    }

    fn seq_slice(&self, x: &HostBuf, b: usize, s: usize, w: usize, r0: usize, n: usize) -> Result<HostBuf> {
        let words = words(x.elem(), w, "slice")?;
        let mut out = self.alloc(x.elem(), b * n * w);
        let params = OpsParams::copy_rows(out.addr(), n, 0, read_addr(x), s, r0).rows(b, n, words);
        self.ops.run(OpsKernel::CopyRows, params);
        Ok(out.into_buf())
    }

    fn select_heads(&self, x: &HostBuf, sh: BufShape, heads: &[usize]) -> Result<HostBuf> {
        let d = words(x.elem(), sh.d, "select heads")?;
        let idx: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
        let mut out = self.alloc(x.elem(), sh.b * sh.n * heads.len() * sh.d);
        let rows = sh.b * sh.n;
        let p =
            OpsParams::heads(true, read_addr(x), out.addr(), idx.as_ptr() as u64, rows, sh.h, heads.len(), d, false);
        self.ops.run(OpsKernel::SelectHeads, p);
        Ok(out.into_buf())
    }

    fn scatter_heads(
        &self,
        dst: &mut HostBuf,
        sh: BufShape,
        heads: &[usize],
        src: &HostBuf,
        assign: bool,
    ) -> Result<()> {
        assert_eq!(dst.elem(), src.elem());
        if !assign {
            dst.f32s()?;
        }
        let d = words(dst.elem(), sh.d, "scatter heads")?;
        let idx: Vec<i64> = heads.iter().map(|&h| h as i64).collect();
        let dst_addr = dst.make_mut().as_bytes_mut().as_mut_ptr() as u64;
        let rows = sh.b * sh.n;
        let p =
            OpsParams::heads(false, dst_addr, read_addr(src), idx.as_ptr() as u64, rows, sh.h, heads.len(), d, assign);
        self.ops.run(OpsKernel::ScatterHeads, p);
        Ok(())
    }
}

impl crate::parallel::Backend for EmuDevice {
    fn supports(&self, dims: &crate::Dims, dtype: DType, spec: &crate::attention::ScoreSpec) -> Result<()> {
        self.flash.supports(dims, dtype, spec)
    }

    fn forward_block(
        &self,
        dims: crate::Dims,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        q_pos: &crate::Positions,
        k_pos: &crate::Positions,
        params: &crate::AttentionParams,
    ) -> Result<crate::parallel::Pending<crate::parallel::ForwardPartial<HostBuf>>> {
        let (o, lse) = self.flash.forward_block(dims, q, k, v, q_pos, k_pos, params)?.wait()?;
        self.record(o.len());
        self.record(lse.len());
        Ok(crate::parallel::Pending::ready((o, lse)))
    }

    fn backward_block(
        &self,
        dims: crate::Dims,
        q: &HostBuf,
        k: &HostBuf,
        v: &HostBuf,
        o: &HostBuf,
        lse: &HostBuf,
        d_o: &HostBuf,
        delta: &HostBuf,
        q_pos: &crate::Positions,
        k_pos: &crate::Positions,
        params: &crate::AttentionParams,
    ) -> Result<crate::parallel::Pending<crate::parallel::GradientPartial<HostBuf>>> {
        let g = self.flash.backward_block(dims, q, k, v, o, lse, d_o, delta, q_pos, k_pos, params)?.wait()?;
        [&g.0, &g.1, &g.2].iter().for_each(|x| self.record(x.len()));
        Ok(crate::parallel::Pending::ready(g))
    }

    fn softmax_grad_rowsum(&self, dims: crate::Dims, o: &HostBuf, d_o: &HostBuf) -> Result<HostBuf> {
        let d = self.flash.softmax_grad_rowsum(dims, o, d_o)?;
        self.record(d.len());
        Ok(d)
    }
}

/// 16-bit buffers on the emulated device, composed as the device backend composes them
/// (pairs of values in 4-byte words, padded allocations): fill, both conversions (the
/// widening exact for every 16-bit pattern tried, NaN payloads included), sequence and head
/// movements — equal, bit for bit, to the host's typed operations; rows of an odd number of
/// 16-bit values are refused, not moved wrongly.
#[test]
fn sixteen_bit_buffers_move_as_pairs_like_the_host() {
    let host = CpuBackend::default();
    let flash = super::EmuBackend::default();
    for (i, e) in emus().into_iter().enumerate() {
        let dev = EmuDevice::new(e, flash);
        for dtype in [DType::BF16, DType::F16] {
            let elem = Elem::from(dtype);
            let t = |n: usize, seed: u64| HostBuf::from(vals(n, seed)).converted(dtype);
            for len in [0, 1, 7, 64] {
                let got = dev.filled(len, -1.3, dtype).unwrap();
                assert_eq!(got, host.filled(len, -1.3, dtype).unwrap(), "{dtype} fill {len}");
                assert_eq!(got.elem(), elem);
            }
            // Widening: every 5th pattern (odd count: a padded allocation) and the specials.
            let mut pats: Vec<u16> = (0..=u16::MAX).step_by(5 + i).collect();
            pats.extend([0x7fff, 0xffff, 0x7c01, 0x7f81, 0x8000, 0x0001]);
            let bits = HostBuf::new(crate::HostData::from_bytes(elem, bytemuck::cast_slice(&pats)).unwrap());
            let wide = dev.convert(&bits, DType::F32).unwrap();
            let want = bits.converted(DType::F32);
            assert!(bits_eq(wide.f32s().unwrap(), want.f32s().unwrap()), "{dtype}: widening");
            let back = dev.convert(&wide, dtype).unwrap();
            assert_eq!(back.data().as_bytes(), want.converted(dtype).data().as_bytes(), "{dtype}: narrowing back");
            // Sequence movements: [b, n, w] with w even.
            let (b, w) = (3, 6);
            let parts: Vec<HostBuf> = [3usize, 0, 5, 1].iter().map(|&n| t(b * n * w, 10 + n as u64)).collect();
            let got = dev.concat_seq(&parts, b, w).unwrap();
            assert_eq!(got, host.concat_seq(&parts, b, w).unwrap(), "{dtype} concat");
            let x = t(2 * 11 * w, 20);
            for (r0, n) in [(3, 6), (0, 11), (10, 1), (11, 0)] {
                let got = dev.seq_slice(&x, 2, 11, w, r0, n).unwrap();
                assert_eq!(got, host.seq_slice(&x, 2, 11, w, r0, n).unwrap(), "{dtype} slice {r0}+{n}");
            }
            assert!(dev.seq_slice(&t(2 * 4 * 3, 21), 2, 4, 3, 1, 2).is_err(), "odd rows of 16-bit values");
            // Head movements: d even, lists with repeats.
            let sh = BufShape { b: 2, n: 3, h: 5, d: 8 };
            let x = t(sh.len(), 40);
            for heads in [&[3usize, 0, 0, 2][..], &[1], &[], &[4, 3, 2, 1, 0]] {
                let got = dev.select_heads(&x, sh, heads).unwrap();
                assert_eq!(got, host.select_heads(&x, sh, heads).unwrap(), "{dtype} select {heads:?}");
                let src = t(sh.b * sh.n * heads.len() * sh.d, 50);
                let (mut got, mut want) = (x.clone(), x.clone());
                dev.scatter_heads(&mut got, sh, heads, &src, true).unwrap();
                host.scatter_heads(&mut want, sh, heads, &src, true).unwrap();
                assert_eq!(got, want, "{dtype} scatter {heads:?}");
            }
        }
    }
}

/// Every strategy on the emulated device (data movements by the ops kernels, attention by
/// the flash kernels), forward and backward on an uneven length with GQA: the oracle check
/// passes and the results equal, bit for bit, those of the host data movements.
#[test]
fn every_strategy_runs_on_the_emulated_device() {
    use crate::comm::LocalOptions;
    use crate::parallel::{run_in_process, ParallelParams, Strategy};
    use crate::{verify, AttentionParams, Mask};
    let (b, s, hq, hkv, d) = (1, 45, 4, 2, 16);
    let dtype = DType::BF16;
    let q = randn(vec![b, s, hq, d], 21, dtype);
    let k = randn(vec![b, s, hkv, d], 22, dtype);
    let v = randn(vec![b, s, hkv, d], 23, dtype);
    let d_o = randn(vec![b, s, hq, d], 24, dtype);
    let flash = super::EmuBackend { dtype, options: EmuOptions { workers: 1, ..Default::default() } };
    let device = EmuDevice::new(Emu { small: Some((3, 64)), schedule: Schedule::Reverse }, flash);
    for (strategy, world, degree) in [
        (Strategy::Ring, 3, None),
        (Strategy::AllGather, 2, None),
        (Strategy::Ulysses, 4, None),
        (Strategy::Usp, 4, Some(2)),
    ] {
        let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let params =
            ParallelParams { strategy, attention: attention.clone(), ulysses_degree: degree, ..Default::default() };
        let opts = LocalOptions::default();
        let got = run_in_process(world, opts, &device, &q, &k, &v, Some(&d_o), &params)
            .unwrap_or_else(|e| panic!("{strategy:?} x{world}: {e}"));
        let report =
            verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &got.forward, got.gradients.as_ref())
                .expect("oracle check");
        assert!(report.pass(), "{strategy:?} x{world}\n{}", report.table());
        let host = run_in_process(world, opts, &flash, &q, &k, &v, Some(&d_o), &params).expect("host run");
        assert_eq!(got.forward.o, host.forward.o, "{strategy:?}: o");
        assert_eq!(got.forward.lse, host.forward.lse, "{strategy:?}: lse");
        let (g, h) = (got.gradients.expect("grads"), host.gradients.expect("grads"));
        assert_eq!((g.dq, g.dk, g.dv), (h.dq, h.dk, h.dv), "{strategy:?}: gradients");
    }
}

/// After setup (the plan made, the shards uploaded), a forward and a backward on the
/// emulated device move nothing between host and device and allocate no buffer larger than a
/// shard's q: no full-sequence buffer (all-gather, which gathers the whole K/V by design, is
/// left out). The results equal those of the host buffers bit for bit, in the input dtype,
/// and the forward sends the host run's bytes (16-bit on the wire).
#[test]
fn plan_calls_on_the_emulated_device_stay_on_the_device() {
    use crate::comm::{spmd, Communicator, LocalOptions};
    use crate::parallel::{ParallelParams, ParallelPlan, Strategy};
    use crate::{AttentionParams, Dims, Mask, Tensor};
    let (b, s, hq, hkv, d) = (1, 48, 4, 2, 16);
    let dtype = DType::BF16;
    let q = randn(vec![b, s, hq, d], 31, dtype);
    let k = randn(vec![b, s, hkv, d], 32, dtype);
    let v = randn(vec![b, s, hkv, d], 33, dtype);
    let d_o = randn(vec![b, s, hq, d], 34, dtype);
    let flash = super::EmuBackend { dtype, options: EmuOptions { workers: 1, ..Default::default() } };
    for (strategy, degree) in [(Strategy::Ring, None), (Strategy::Ulysses, None), (Strategy::Usp, Some(2))] {
        let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let params = ParallelParams { strategy, attention, ulysses_degree: degree, ..Default::default() };
        let resolved = params.resolve(4, hq, s).unwrap();
        let shard_q = b * (0..4).map(|r| resolved.positions(r).len()).max().unwrap() * hq * d;
        let results = spmd(4, LocalOptions::default(), |comm| {
            let dev = EmuDevice::new(Emu { small: Some((2, 32)), schedule: Schedule::Forward }, flash);
            let shard = |t: &Tensor| resolved.shard(t, comm.rank());
            let (qs, ks, vs, dos) = (shard(&q)?, shard(&k)?, shard(&v)?, shard(&d_o)?);
            let plan = ParallelPlan::new(comm, &dev, &params, &Dims::of(&qs, &ks, &vs)?, dtype)?;
            let bufs = [&qs, &ks, &vs, &dos].map(|t| plan.upload_tensor(t));
            let [qb, kb, vb, dob] = bufs.map(|b| b.expect("upload"));
            dev.take_counts();
            let (o, saved) = plan.forward(&qb, &kb, &vb)?;
            let sent = plan.last_stats().bytes_sent;
            let g = plan.backward(&saved, &dob)?;
            let (transfers, largest) = dev.take_counts();
            // The same calls on host buffers (16-bit values as they are).
            let host = ParallelPlan::new(comm, &flash, &params, &Dims::of(&qs, &ks, &vs)?, dtype)?;
            let hb = [&qs, &ks, &vs, &dos].map(HostBuf::from_tensor);
            let (ho, hsaved) = host.forward(&hb[0], &hb[1], &hb[2])?;
            let host_sent = host.last_stats().bytes_sent;
            let hg = host.backward(&hsaved, &hb[3])?;
            // Typed on the device as on the host: the outputs in the input dtype, bit for bit.
            let equal = o == ho && saved.lse == hsaved.lse && g.dq == hg.dq && g.dk == hg.dk && g.dv == hg.dv;
            Ok((transfers, largest, equal && o.elem() == Elem::from(dtype), (sent, host_sent)))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (transfers, largest, equal, (sent, host_sent)) = r.unwrap_or_else(|e| panic!("{strategy}: {e}"));
            // 16-bit q, k, v on the device's wire: the host run's bytes, not f32's double.
            assert!(
                sent > 0 && sent == host_sent,
                "{strategy} rank {rank}: forward bytes {sent} on the device, {host_sent} on the host"
            );
            assert_eq!(transfers, 0, "{strategy} rank {rank}: host-device transfers inside the calls");
            assert!(largest > 0 && largest <= shard_q, "{strategy} rank {rank}: a buffer of {largest} > {shard_q}");
            assert!(equal, "{strategy} rank {rank}: results differ from the host buffers'");
        }
    }
}

/// The training collectives on the emulated device: all_reduce adds with the emulated add
/// kernel (rank order, bit-identical on every rank and to the host sum), broadcast delivers
/// the root's buffer; in both message orders.
#[test]
fn collectives_run_on_the_emulated_device() {
    use crate::comm::{add_host, spmd, Communicator, LocalOptions, MessageOrder};
    let flash = super::EmuBackend::default();
    for order in [MessageOrder::Tag, MessageOrder::PerPeerFifo] {
        let got = spmd(3, LocalOptions { order, ..Default::default() }, |comm| {
            let dev = EmuDevice::new(Emu { small: Some((2, 32)), schedule: Schedule::Reverse }, flash);
            let mine = dev.upload(&HostBuf::from(vals(1000, 60 + comm.rank() as u64)))?;
            let sum = comm.all_reduce(mine.clone(), &|a, x| dev.add_into(a, x))?;
            let host = comm.all_reduce(HostBuf::from(vals(1000, 60 + comm.rank() as u64)), &add_host)?;
            let root = comm.broadcast(mine, 1)?;
            Ok((dev.download(&sum)?, host, dev.download(&root)?))
        });
        for g in got {
            let (sum, host, root) = g.unwrap();
            assert!(bits_eq(sum.f32s().unwrap(), host.f32s().unwrap()), "{order:?}");
            assert!(bits_eq(root.f32s().unwrap(), &vals(1000, 61)), "{order:?}");
        }
    }
}
