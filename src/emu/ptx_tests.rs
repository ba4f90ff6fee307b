//! Tests of the PTX twins (m16n8k8, ldmatrix x1, stmatrix, conversions)
//! against the lane tables of the PTX ISA.
//!
//! The tables here are written independently from the PTX text
//! (`shared/reference/ptx-and-emulation.md` §1.1, §1.3–1.5), not from the C++ twins, and the
//! conversions are checked against the `half` crate (round to nearest even).

use super::*;
use crate::kernels::params::TensorMap;
use crate::kernels::tensor_map::{OobFill, TensorMapDType, TensorMapSpec, TensorMapSwizzle};
use crate::random::randn;
use crate::DType;
use half::{bf16, f16};

extern "C" {
    fn ringattn_emu_selftest_mma_k8(
        regs: *const u32,
        c: *const f32,
        d: *mut f32,
        bf16: i32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_selftest_ldmatrix_x1(
        tile: *const u16,
        offsets: *const u32,
        out: *mut u32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_selftest_stmatrix(
        count: i32,
        trans: i32,
        regs: *const u32,
        offsets: *const u32,
        sentinel: u16,
        image: *mut u16,
        back: *mut u32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_selftest_convert(
        x: *const f32,
        n: u32,
        bf: *mut u16,
        hf: *mut u16,
        packed: *mut u32,
        unpacked: *mut f32,
        all_bf: *mut f32,
        all_hf: *mut f32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// The emulator's message, up to its NUL.
fn text(msg: &[u8]) -> String {
    let end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
    String::from_utf8_lossy(&msg[..end]).into_owned()
}

/// Runs a self-test entry given its message buffer: `Ok` when it returns 0, else its message.
fn selftest(entry: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), String> {
    let mut msg = [0u8; 256];
    match entry(msg.as_mut_ptr().cast(), msg.len()) {
        0 => Ok(()),
        _ => Err(text(&msg)),
    }
}

/// A small deterministic generator (splitmix64) for bit patterns.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// (row, col) of a matrix element.
type At = (usize, usize);

/// The m16n8k8 fragments (PTX ISA "mma.m16n8k8", §1.3) of lane `l`, g = l/4, t = l%4: the
/// (row, col) of the low and high half of A's two registers (A is 16x8), the (k, n) of the
/// halves of B's register (B is 8x8), and the (m, n) of c0..c3 / d0..d3.
fn k8_lane_table(l: usize) -> ([[At; 2]; 2], [At; 2], [At; 4]) {
    let (g, t) = (l / 4, l % 4);
    let a = [[(g, 2 * t), (g, 2 * t + 1)], [(g + 8, 2 * t), (g + 8, 2 * t + 1)]];
    let b = [(2 * t, g), (2 * t + 1, g)];
    let c = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)];
    (a, b, c)
}

#[test]
fn k8_lane_table_matches_the_ptx_isa_and_covers_each_element_once() {
    assert_eq!(
        k8_lane_table(0),
        ([[(0, 0), (0, 1)], [(8, 0), (8, 1)]], [(0, 0), (1, 0)], [(0, 0), (0, 1), (8, 0), (8, 1)])
    );
    assert_eq!(
        k8_lane_table(31),
        ([[(7, 6), (7, 7)], [(15, 6), (15, 7)]], [(6, 7), (7, 7)], [(7, 6), (7, 7), (15, 6), (15, 7)])
    );
    assert_eq!(k8_lane_table(13).1, [(2, 3), (3, 3)]);
    let (mut a, mut b, mut c) = ([[0; 8]; 16], [[0; 8]; 8], [[0; 8]; 16]);
    for l in 0..32 {
        let (ta, tb, tc) = k8_lane_table(l);
        ta.iter().flatten().for_each(|&(r, k)| a[r][k] += 1);
        tb.iter().for_each(|&(k, n)| b[k][n] += 1);
        tc.iter().for_each(|&(m, n)| c[m][n] += 1);
    }
    assert!(a.iter().chain(&c).flatten().chain(b.iter().flatten()).all(|&n| n == 1));
}

/// Runs the m16n8k8 twin on random inputs laid out by [`k8_lane_table`] and compares every
/// lane's D with the exact product sum (f64) plus C, rounded once to f32.
fn check_mma_k8(dtype: DType, seed: u64) {
    let to_bits = |x: f32| if dtype == DType::BF16 { bf16::from_f32(x).to_bits() } else { f16::from_f32(x).to_bits() };
    let value = |b: u16| if dtype == DType::BF16 { bf16::from_bits(b).to_f64() } else { f16::from_bits(b).to_f64() };
    let a_bits: Vec<u16> = randn(vec![16 * 8], seed, DType::F32).to_f32_vec().into_iter().map(to_bits).collect();
    let b_bits: Vec<u16> = randn(vec![8 * 8], seed + 1, DType::F32).to_f32_vec().into_iter().map(to_bits).collect();
    let c_vals = randn(vec![16 * 8], seed + 2, DType::F32).to_f32_vec();
    let pack = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
    let (mut regs, mut c) = (vec![0u32; 32 * 3], vec![0f32; 32 * 4]);
    for l in 0..32 {
        let (ta, [(k0, n0), (k1, n1)], tc) = k8_lane_table(l);
        for (i, [(r0, c0), (r1, c1)]) in ta.iter().enumerate() {
            regs[l * 3 + i] = pack(a_bits[r0 * 8 + c0], a_bits[r1 * 8 + c1]);
        }
        regs[l * 3 + 2] = pack(b_bits[k0 * 8 + n0], b_bits[k1 * 8 + n1]);
        for (i, &(m, n)) in tc.iter().enumerate() {
            c[l * 4 + i] = c_vals[m * 8 + n];
        }
    }
    let (mut d, mut msg) = (vec![0f32; 32 * 4], [0u8; 512]);
    let flag = (dtype == DType::BF16) as i32;
    // SAFETY: regs holds 32 lanes × 3 registers, c and d 32 lanes × 4 floats, as the kernel uses.
    let code = unsafe {
        ringattn_emu_selftest_mma_k8(regs.as_ptr(), c.as_ptr(), d.as_mut_ptr(), flag, msg.as_mut_ptr().cast(), 512)
    };
    assert_eq!(code, 0, "{}", text(&msg));
    for l in 0..32 {
        for (i, &(m, n)) in k8_lane_table(l).2.iter().enumerate() {
            let exact: f64 = (0..8).map(|k| value(a_bits[m * 8 + k]) * value(b_bits[k * 8 + n])).sum();
            let want = (exact + c_vals[m * 8 + n] as f64) as f32;
            assert_eq!(d[l * 4 + i], want, "{dtype:?} lane {l} element {i} = D[{m}][{n}]");
        }
    }
}

#[test]
fn mma_m16n8k8_bf16_twin_follows_the_fragment_tables() {
    check_mma_k8(DType::BF16, 21);
    check_mma_k8(DType::BF16, 37);
}

#[test]
fn mma_m16n8k8_f16_twin_follows_the_fragment_tables() {
    check_mma_k8(DType::F16, 41);
    check_mma_k8(DType::F16, 57);
}

/// The ldmatrix/stmatrix fragment of lane `l` (§1.4, §1.5), for the low and high half of each
/// register: (memory row, column) within its 8x8 matrix, where memory row i is the one whose
/// address thread 8j + i supplies. Non-trans: row l/4, columns 2(l%4) + h; .trans: rows
/// 2(l%4) + h, column l/4.
fn ldsm_lane(l: usize, trans: bool) -> [At; 2] {
    if trans {
        [(2 * (l % 4), l / 4), (2 * (l % 4) + 1, l / 4)]
    } else {
        [(l / 4, 2 * (l % 4)), (l / 4, 2 * (l % 4) + 1)]
    }
}

#[test]
fn ldmatrix_x1_and_x1_trans_follow_the_ptx_table() {
    // Codes identifying each element: tile[r][c] = 16r + c, a 16x16 tile.
    let tile: Vec<u16> = (0..256).collect();
    // Rows 16-byte aligned, out of order and not contiguous; lanes 8..31 hold a misaligned
    // address (the kernel's choice) that x1 must ignore.
    let offsets: Vec<u32> = (0..8).map(|i| 16 * ((5 * i + 3) % 16) + 8 * (i % 2)).collect();
    let (mut out, mut msg) = (vec![0u32; 64], [0u8; 512]);
    // SAFETY: tile holds 256 values, offsets 8, out 32 lanes × 2 registers, as the kernel uses.
    let code = unsafe {
        ringattn_emu_selftest_ldmatrix_x1(
            tile.as_ptr(),
            offsets.as_ptr(),
            out.as_mut_ptr(),
            msg.as_mut_ptr().cast(),
            512,
        )
    };
    assert_eq!(code, 0, "{}", text(&msg));
    let code_at = |(row, col): At| tile[offsets[row] as usize + col] as u32;
    for l in 0..32 {
        for (k, trans) in [false, true].into_iter().enumerate() {
            let [lo, hi] = ldsm_lane(l, trans);
            assert_eq!(out[l * 2 + k], code_at(lo) | code_at(hi) << 16, "lane {l} trans {trans}");
        }
    }
    // Spot checks straight from the PTX text: lane 5 gets row 1, columns 2 and 3; with
    // .trans, rows 2 and 3 of column 1.
    assert_eq!(out[10], code_at((1, 2)) | code_at((1, 3)) << 16);
    assert_eq!(out[11], code_at((2, 1)) | code_at((3, 1)) << 16);
}

const SMEM_ELEMS: usize = 1024;
const SENTINEL: u16 = 0xa5a5;

struct Stored {
    code: i32,
    msg: String,
    image: Vec<u16>,
    back: Vec<u32>,
}

fn run_stmatrix(count: i32, trans: bool, regs: &[u32], offsets: &[u32]) -> Stored {
    assert!(regs.len() == 32 * 4 && offsets.len() == 32);
    assert!(offsets.iter().all(|&o| (o as usize) + 8 <= SMEM_ELEMS));
    let (mut image, mut back, mut msg) = (vec![0u16; SMEM_ELEMS], vec![0u32; 32 * 4], [0u8; 512]);
    // SAFETY: regs holds 32 × 4 registers, offsets 32 row offsets inside the kernel's 1024
    // elements of shared memory (checked above), image 1024 elements and back 32 × 4.
    let code = unsafe {
        ringattn_emu_selftest_stmatrix(
            count,
            trans as i32,
            regs.as_ptr(),
            offsets.as_ptr(),
            SENTINEL,
            image.as_mut_ptr(),
            back.as_mut_ptr(),
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    Stored { code, msg: text(&msg), image, back }
}

/// Row addresses (element offsets) of the 32 lanes: lane 8j + i supplies row i of matrix j,
/// rows 48 bytes apart in a scrambled order, matrices 512 bytes apart; lanes past `count`
/// matrices hold misaligned addresses, which stmatrix and ldmatrix must ignore.
fn stmatrix_offsets(count: usize) -> Vec<u32> {
    (0..32)
        .map(|l| {
            let (j, i) = (l / 8, l % 8);
            if j < count {
                (256 * j + 24 * ((3 * i + 1) % 8) + 8 * (j % 2)) as u32
            } else {
                3 + l as u32
            }
        })
        .collect()
}

#[test]
fn stmatrix_round_trips_with_ldmatrix_and_writes_only_its_positions() {
    let mut rng = SplitMix(5);
    for count in [1usize, 2, 4] {
        for trans in [false, true] {
            let regs: Vec<u32> = (0..32 * 4).map(|_| rng.next() as u32).collect();
            let offsets = stmatrix_offsets(count);
            let got = run_stmatrix(count as i32, trans, &regs, &offsets);
            assert_eq!(got.code, 0, "x{count} trans {trans}: {}", got.msg);
            // The documented image: the sentinel everywhere but at each lane's positions.
            let mut want = vec![SENTINEL; SMEM_ELEMS];
            let mut written = 0;
            for l in 0..32 {
                for j in 0..count {
                    let reg = regs[l * 4 + j];
                    for (h, (row, col)) in ldsm_lane(l, trans).into_iter().enumerate() {
                        want[offsets[8 * j + row] as usize + col] = (reg >> (16 * h)) as u16;
                        written += 1;
                    }
                }
            }
            assert_eq!(written, 64 * count);
            for (e, (&g, &w)) in got.image.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "x{count} trans {trans}: element {e}");
            }
            // ldmatrix of the same kind gives every lane its registers back.
            for l in 0..32 {
                assert_eq!(
                    &got.back[l * 4..l * 4 + count],
                    &regs[l * 4..l * 4 + count],
                    "x{count} trans {trans} lane {l}"
                );
            }
        }
    }
}

#[test]
fn stmatrix_trans_stores_the_transpose() {
    // Element codes 0x100·r + c in the non-trans layout: lane l's register holds matrix row
    // l/4, columns 2(l%4) and 2(l%4)+1. Stored with .trans, memory row r must read as column
    // r of that matrix.
    let mut regs = vec![0u32; 32 * 4];
    for l in 0..32 {
        let (r, c) = (l / 4, 2 * (l % 4));
        regs[l * 4] = (0x100 * r + c) as u32 | ((0x100 * r + c + 1) as u32) << 16;
    }
    let offsets = stmatrix_offsets(1);
    let got = run_stmatrix(1, true, &regs, &offsets);
    assert_eq!(got.code, 0, "{}", got.msg);
    for (mem_row, &start) in offsets[..8].iter().enumerate() {
        let row = &got.image[start as usize..start as usize + 8];
        let want: Vec<u16> = (0..8).map(|col| (0x100 * col + mem_row) as u16).collect();
        assert_eq!(row, &want[..], "memory row {mem_row}");
    }
}

#[test]
fn a_misaligned_stmatrix_address_is_reported_and_nothing_is_stored() {
    let regs = vec![0x1234_5678u32; 32 * 4];
    let mut offsets = stmatrix_offsets(4);
    offsets[13] += 4; // 8 bytes off a 16-byte boundary
    let got = run_stmatrix(4, false, &regs, &offsets);
    assert_eq!(got.code, 1);
    assert!(got.msg.contains("stmatrix: row address of lane 13 is not 16-byte aligned"), "{}", got.msg);
    assert!(got.image.iter().all(|&e| e == SENTINEL), "a faulting stmatrix stores nothing");
}

/// Inputs for the conversions: special values, both formats' rounding ties (and their
/// neighbours), every f16 subnormal tie, and random bit patterns. Starts with 1.0, 2.0.
fn conversion_inputs() -> Vec<f32> {
    let mut x = vec![1.0f32, 2.0, 0.0, -0.0, -1.5, 1.0 / 3.0];
    let bits = [
        0x0000_0001u32, // smallest f32 subnormal
        0x807f_ffff,    // largest negative f32 subnormal
        0x0080_0000,    // f32::MIN_POSITIVE
        0x7f7f_ffff,    // f32::MAX: bf16 overflow to inf
        0xff7f_ffff,
        0x7f7f_0000, // bf16 max
        0x7f7f_7fff, // just under the bf16 overflow tie
        0x7f7f_8000, // bf16 overflow tie: odd 0x7f7f rounds up to inf
        0x7f80_0000, // inf
        0xff80_0000, // -inf
        0x7fc0_0000, // quiet NaN
        0xffc0_0000,
        0x7f80_0001, // signalling NaNs whose payload would round to inf if not caught
        0xff80_0001,
        0x7fbf_ffff,
        0x7fff_ffff,
        0x477f_e000, // 65504, f16 max
        0x477f_efff, // just under the f16 overflow tie
        0x477f_f000, // 65520: f16 overflow tie, rounds to inf
        0xc77f_f000,
        0x4780_0000, // 65536
        0x3880_0000, // 2^-14, smallest f16 normal
        0x387f_e000, // 2^-14 - 2^-25: tie between 1023·2^-24 and 2^-14
        0x3380_0000, // 2^-24, smallest f16 subnormal
        0x3300_0000, // 2^-25: tie, rounds to 0
        0x3300_0001, // just above: rounds to 2^-24
        0xb300_0000,
        0x32ff_ffff,
        0x33c0_0000, // 3·2^-25: tie, rounds to 2·2^-24
        0x2f80_0000, // 2^-32
    ];
    x.extend(bits.iter().map(|&b| f32::from_bits(b)));
    // Every f16 subnormal and every tie between neighbouring ones: k·2^-25.
    x.extend((0..2050).flat_map(|k| [(k as f32) * 2f32.powi(-25), -(k as f32) * 2f32.powi(-25)]));
    let mut rng = SplitMix(77);
    for _ in 0..3000 {
        // A finite f16 and the exact midpoint to its successor, with f32 neighbours.
        let h = (rng.next() % 0x7bff) as u16;
        let (v, next) = (f16::from_bits(h).to_f64(), f16::from_bits(h + 1).to_f64());
        let mid = ((v + next) / 2.0) as f32;
        assert_eq!(mid as f64, (v + next) / 2.0, "f16 midpoints are exact in f32");
        let sign = if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 };
        for m in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1), v as f32] {
            x.push(sign * m);
        }
        // A finite bf16 tie (low 16 bits exactly 0x8000) and its neighbours.
        let b = (rng.next() as u32) & 0xff7f_0000 | 0x8000; // exponent never all ones
        x.extend([b, b - 1, b + 1].map(f32::from_bits));
    }
    // Arbitrary bit patterns (NaNs among them).
    x.extend((0..20000).map(|_| f32::from_bits(rng.next() as u32)));
    x
}

/// `got` is the RNE conversion of `x`: bit-identical to `want` (from the `half` crate), or a
/// quiet NaN (quiet bit `quiet`) when `x` is NaN.
fn same_conversion(got: u16, want: u16, x: f32, quiet: u16, what: &str) {
    if x.is_nan() {
        let exp_mask = if quiet == 0x0040 { 0x7f80 } else { 0x7c00 };
        assert!(
            got & exp_mask == exp_mask && got & quiet != 0,
            "{what}({:#010x}) = {got:#06x}: not a quiet NaN",
            x.to_bits()
        );
    } else {
        assert_eq!(got, want, "{what}({x:e} = {:#010x})", x.to_bits());
    }
}

fn same_f32(got: f32, want: f32, what: &str) {
    if want.is_nan() {
        assert!(got.is_nan() && got.is_sign_negative() == want.is_sign_negative(), "{what}: {got} vs NaN");
    } else {
        assert_eq!(got.to_bits(), want.to_bits(), "{what}: {got:e} vs {want:e}");
    }
}

#[test]
fn conversions_round_to_nearest_even_like_the_half_crate() {
    let x = conversion_inputs();
    let n = x.len();
    let (mut bf, mut hf, mut packed, mut unpacked) =
        (vec![0u16; n], vec![0u16; n], vec![0u32; 2 * n], vec![0f32; 6 * n]);
    let (mut all_bf, mut all_hf, mut msg) = (vec![0f32; 65536], vec![0f32; 65536], [0u8; 512]);
    // SAFETY: every buffer has the length the kernel addresses for n inputs (see
    // selftest_ptx.cpp): bf, hf n; packed 2n; unpacked 6n; all_bf, all_hf 65536.
    let code = unsafe {
        ringattn_emu_selftest_convert(
            x.as_ptr(),
            n as u32,
            bf.as_mut_ptr(),
            hf.as_mut_ptr(),
            packed.as_mut_ptr(),
            unpacked.as_mut_ptr(),
            all_bf.as_mut_ptr(),
            all_hf.as_mut_ptr(),
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    assert_eq!(code, 0, "{}", text(&msg));
    // Packing order (§1.1): the first (lo) argument in bits 0..15.
    assert_eq!(packed[0], 0x4000_3f80, "pack_bf16x2(1, 2)");
    assert_eq!(packed[1], 0x4000_3c00, "pack_f16x2(1, 2)");
    for i in 0..n {
        let (lo, hi) = (x[i], x[(i + 1) % n]);
        same_conversion(bf[i], bf16::from_f32(lo).to_bits(), lo, 0x0040, "f32_to_bf16_rn");
        same_conversion(hf[i], f16::from_f32(lo).to_bits(), lo, 0x0200, "f32_to_f16_rn");
        let (pb, ph) = (packed[2 * i], packed[2 * i + 1]);
        same_conversion(pb as u16, bf16::from_f32(lo).to_bits(), lo, 0x0040, "pack_bf16x2 lo");
        same_conversion((pb >> 16) as u16, bf16::from_f32(hi).to_bits(), hi, 0x0040, "pack_bf16x2 hi");
        same_conversion(ph as u16, f16::from_f32(lo).to_bits(), lo, 0x0200, "pack_f16x2 lo");
        same_conversion((ph >> 16) as u16, f16::from_f32(hi).to_bits(), hi, 0x0200, "pack_f16x2 hi");
        let u = &unpacked[6 * i..6 * i + 6];
        same_f32(u[0], bf16::from_bits(pb as u16).to_f32(), "bf16_lo");
        same_f32(u[1], bf16::from_bits((pb >> 16) as u16).to_f32(), "bf16_hi");
        same_f32(u[2], f16::from_bits(ph as u16).to_f32(), "f16_lo");
        same_f32(u[3], f16::from_bits((ph >> 16) as u16).to_f32(), "f16_hi");
        same_f32(u[4], bf16::from_bits(bf[i]).to_f32(), "bf16_to_f32");
        same_f32(u[5], f16::from_bits(hf[i]).to_f32(), "f16_to_f32");
    }
    // Every 16-bit pattern widens exactly (f16 subnormals included).
    for h in 0..=u16::MAX {
        same_f32(all_bf[h as usize], bf16::from_bits(h).to_f32(), &format!("bf16_to_f32({h:#06x})"));
        same_f32(all_hf[h as usize], f16::from_bits(h).to_f32(), &format!("f16_to_f32({h:#06x})"));
    }
    // Landmarks, spelled out.
    let find = |bits: u32| x.iter().position(|v| v.to_bits() == bits).unwrap();
    assert_eq!(hf[find(0x477f_f000)], 0x7c00, "65520 overflows f16 to inf");
    assert_eq!(hf[find(0x477f_efff)], 0x7bff, "just under 65520 stays at 65504");
    assert_eq!(hf[find(0x3300_0000)], 0x0000, "2^-25 ties to even: 0");
    assert_eq!(hf[find(0x33c0_0000)], 0x0002, "3·2^-25 ties to even: 2·2^-24");
    assert_eq!(hf[find(0x387f_e000)], 0x0400, "the subnormal/normal tie rounds to 2^-14");
    assert_eq!(bf[find(0x7f7f_8000)], 0x7f80, "bf16 overflow tie to inf");
    assert_eq!(bf[find(0x7f80_0001)], 0x7fc0, "a signalling NaN stays NaN, quieted");
    assert_eq!(bf[find(0x8000_0000)], 0x8000, "-0 keeps its sign");
    assert_eq!(hf[find(0x8000_0000)], 0x8000, "-0 keeps its sign");
}

extern "C" {
    fn ringattn_emu_selftest_movmatrix(input: *const u32, out: *mut u32, msg: *mut c_char, cap: usize) -> i32;
}

/// movmatrix.trans (PTX ISA §9.7.14.5.17, ptx-and-emulation.md §1.5): source element [r][c]
/// in lane 4r + c/2, half c%2; lane L half h receives src[2(L%4) + h][L/4].
#[test]
fn movmatrix_trans_transposes_the_quadrant_layout() {
    // Code of element [r][c] = 8r + c, packed in the source layout.
    let code = |r: usize, c: usize| (8 * r + c) as u32;
    let input: Vec<u32> = (0..32).map(|l| code(l / 4, 2 * (l % 4)) | code(l / 4, 2 * (l % 4) + 1) << 16).collect();
    let mut out = vec![0u32; 32];
    let mut msg = [0u8; 256];
    // SAFETY: both buffers hold the 32 registers of the warp.
    let rc = unsafe { ringattn_emu_selftest_movmatrix(input.as_ptr(), out.as_mut_ptr(), msg.as_mut_ptr().cast(), 256) };
    assert_eq!(rc, 0, "{}", text(&msg));
    for (l, &got) in out.iter().enumerate() {
        let want = code(2 * (l % 4), l / 4) | code(2 * (l % 4) + 1, l / 4) << 16;
        assert_eq!(got, want, "lane {l}");
        // The result is the source layout of the transposed matrix: lane 4r + c/2 holds T[r][c].
        let (r, c) = (l / 4, 2 * (l % 4));
        assert_eq!(got & 0xffff, code(c, r), "lane {l} low half is src[{c}][{r}]");
    }
}

extern "C" {
    fn ringattn_emu_selftest_mbarrier_ring(
        stages: i32,
        rounds: i32,
        fault: i32,
        schedule: i32,
        seed: u64,
        out: *mut f32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// Runs the producer/consumer ring of `cuda/emu/selftest_ptx.cpp` (`fault` plants a bug);
/// returns the consumers' sums or the emulator's error.
fn mbarrier_ring(stages: i32, rounds: i32, fault: i32, schedule: i32, seed: u64) -> Result<Vec<f32>, String> {
    let mut out = vec![f32::NAN; 96];
    // SAFETY: `out` holds the 96 consumers' sums the kernel writes.
    selftest(|msg, cap| unsafe {
        ringattn_emu_selftest_mbarrier_ring(stages, rounds, fault, schedule, seed, out.as_mut_ptr(), msg, cap)
    })?;
    Ok(out)
}

/// mbarrier phases by the rules of the PTX ISA (§9.7.13.15, hopper-ptx.md §3), written here
/// independently of the twins: a phase completes when its arrivals and its transaction
/// count are in, waits name the phase by parity (a fresh barrier's parity-1 wait returns at
/// once), and a ring of `stages` slots reuses each barrier every `stages` rounds. Every
/// consumer must see every round's value, whatever order the fibers run in.
#[test]
fn mbarrier_phases_carry_a_producer_consumer_ring_under_every_schedule() {
    for (stages, rounds) in [(1, 3), (2, 7), (3, 12)] {
        let want: Vec<f32> = (0..96).map(|c| (0..rounds).map(|r| (r * 1000 + c) as f32).sum()).collect();
        for (schedule, seed) in [(0, 0), (1, 0), (2, 7), (2, 99)] {
            let got = mbarrier_ring(stages, rounds, 0, schedule, seed).unwrap();
            assert_eq!(got, want, "{stages} stages, {rounds} rounds, schedule {schedule}/{seed}");
        }
    }
}

/// Planted bugs are reported, never hang: a transaction count short of what was announced and
/// a producer starting on the wrong parity leave waits that can never complete (a deadlock),
/// a count outside 1 ... 2^20 - 1 and a barrier used before init are misuse.
#[test]
fn mbarrier_misuse_and_impossible_waits_are_reported() {
    for (fault, expect) in [(1, "deadlock"), (2, "deadlock"), (3, "expected count 0"), (4, "before mbarrier.init")] {
        let err = mbarrier_ring(2, 5, fault, 0, 0).expect_err("a planted bug must fail");
        assert!(err.contains(expect), "fault {fault}: {err}");
    }
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn ringattn_emu_selftest_wgmma_desc(
        start: u32,
        lbo: u32,
        sbo: u32,
        swizzle: u32,
        extra: u64,
        major: i32,
        rows: u32,
        cols: u32,
        out: *mut u32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// wgmma descriptor swizzle codes (hopper-ptx.md §2: the reverse of the tensor map's enum).
const SW_NONE: u32 = 0;
const SW_128: u32 = 1;
const SW_64: u32 = 2;
const SW_32: u32 = 3;
const K_MAJOR: i32 = 0;
const MN_MAJOR: i32 = 1;

/// A wgmma operand: its descriptor's fields as `make_wgmma_desc` takes them (bytes), `extra`
/// bits ORed into the descriptor, and its major-ness.
#[derive(Clone, Copy)]
struct Operand {
    start: u32,
    lbo: u32,
    sbo: u32,
    swizzle: u32,
    extra: u64,
    major: i32,
}

impl Operand {
    fn k_major(start: u32, lbo: u32, sbo: u32, swizzle: u32) -> Self {
        Operand { start, lbo, sbo, swizzle, extra: 0, major: K_MAJOR }
    }

    /// The twin's addresses of the operand's first `rows × cols` (MN × K) elements, or its
    /// error.
    fn addresses(self, rows: u32, cols: u32) -> Result<Vec<u32>, String> {
        let Operand { start, lbo, sbo, swizzle, extra, major } = self;
        let mut out = vec![0u32; (rows * cols) as usize];
        // SAFETY: `out` holds rows × cols addresses.
        selftest(|msg, cap| unsafe {
            ringattn_emu_selftest_wgmma_desc(
                start,
                lbo,
                sbo,
                swizzle,
                extra,
                major,
                rows,
                cols,
                out.as_mut_ptr(),
                msg,
                cap,
            )
        })?;
        Ok(out)
    }
}

/// Descriptors address the tiles where a tensor-map copy puts them (written here from the
/// placement, not from the canonical layouts the twin codes): a K-major tile with rows of
/// `16 W` bytes (W = 8, 4, 2 for 128B, 64B, 32B) holds row r's 16-byte chunk c at chunk
/// `c ^ ((r · 16 W / 128) mod W)` of its row; the descriptor of K-step s starts 32 s bytes in
/// (SBO = 8 rows, LBO unused). Without swizzle, 8 × 16-byte core matrices (mi, kc) at
/// `mi · SBO + kc · LBO`. V as an MN-major 128B operand: 128 keys × 128 columns loaded as
/// two 64-column halves 16 KiB apart, each key's 128-byte row chunk-swizzled by key mod 8;
/// the descriptor of 16-key step s starts 2048 s bytes in (LBO = 16384, SBO = 1024).
#[test]
fn wgmma_descriptors_address_tiles_as_tensor_maps_place_them() {
    let base = 4096u32;
    for (swizzle, w) in [(SW_128, 8u32), (SW_64, 4), (SW_32, 2)] {
        let row_bytes = 16 * w;
        for s in 0..(8 * w / 16) {
            let got = Operand::k_major(base + 32 * s, 16, 8 * row_bytes, swizzle).addresses(64, 16).unwrap();
            for r in 0..64u32 {
                for k in 0..16u32 {
                    let col = 16 * s + k;
                    let chunk = (col / 8) ^ ((r * row_bytes / 128) % w);
                    let want = base + r * row_bytes + chunk * 16 + (col % 8) * 2;
                    assert_eq!(got[(r * 16 + k) as usize], want, "W {w} step {s} ({r}, {k})");
                }
            }
        }
    }
    // No swizzle: core matrices along K 128 bytes apart, 8-row groups 256 apart.
    let got = Operand::k_major(base, 128, 256, SW_NONE).addresses(64, 16).unwrap();
    for r in 0..64u32 {
        for k in 0..16u32 {
            let want = base + (r / 8) * 256 + (k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
            assert_eq!(got[(r * 16 + k) as usize], want, "interleaved ({r}, {k})");
        }
    }
    // V: MN-major, 128B.
    for s in 0..8u32 {
        let v = Operand { major: MN_MAJOR, ..Operand::k_major(base + 2048 * s, 16384, 1024, SW_128) };
        let got = v.addresses(128, 16).unwrap();
        for n in 0..128u32 {
            for kk in 0..16u32 {
                let key = 16 * s + kk;
                let want = base + (n / 64) * 16384 + key * 128 + (((n % 64) / 8) ^ (key % 8)) * 16 + (n % 8) * 2;
                assert_eq!(got[(n * 16 + kk) as usize], want, "V step {s} (n {n}, key {key})");
            }
        }
    }
}

/// Descriptor misuse is reported: bits outside the fields, a base offset (its semantics are
/// not confirmed: tiles stay aligned), a swizzled start past the first 128 bytes of its
/// repeat.
#[test]
fn wgmma_descriptor_misuse_is_reported() {
    let bad = |extra: u64, start: u32, swizzle: u32| {
        Operand { extra, ..Operand::k_major(start, 16, 1024, swizzle) }.addresses(8, 8)
    };
    assert!(bad(1 << 14, 0, SW_128).unwrap_err().contains("outside its fields"));
    assert!(bad(1 << 49, 0, SW_128).unwrap_err().contains("base offset"));
    assert!(bad(0, 1024 + 256, SW_128).unwrap_err().contains("past its 1024-byte repeat"));
    assert!(bad(0, 512 + 128, SW_64).unwrap_err().contains("past its 512-byte repeat"));
    assert!(bad(0, 1024 + 96, SW_128).is_ok());
    assert!(bad(0, 1024 + 256, SW_NONE).is_ok());
}

/// The twin's GEMM case (`WgmmaCase` of cuda/emu/selftest_ptx.cpp).
#[repr(C)]
struct WgmmaCase {
    image: *const u32,
    image_words: u32,
    n: u32,
    ksteps: u32,
    input: u32,
    rs: u32,
    trans_a: u32,
    trans_b: u32,
    pipelined: u32,
    overwrite_at: u32,
    a_desc: [u64; 8],
    b_desc: [u64; 8],
    a_regs: *const u32,
    c: *const f32,
    out: *mut f32,
    fault: i32,
    threads: u32,
}

extern "C" {
    fn ringattn_emu_selftest_wgmma(
        case: *const WgmmaCase,
        schedule: i32,
        seed: u64,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
    fn ringattn_emu_selftest_setmaxnreg(fault: i32, msg: *mut c_char, cap: usize) -> i32;
}

/// Planted bugs of the wgmma self-test kernel (`WgmmaFault`).
const FAULT_NO_PROXY_FENCE: i32 = 1;
const FAULT_READ_IN_FLIGHT: i32 = 2;
const FAULT_MISALIGNED: i32 = 3;
const FAULT_OVERWRITE: i32 = 4;
const FAULT_NO_WGMMA_FENCE: i32 = 5;
const FAULT_NON_UNIFORM: i32 = 6;
const FAULT_NO_WAIT: i32 = 7;
const FAULT_ACCESS_AFTER_FENCE: i32 = 8;
const FAULT_OVERWRITE_AFTER_OWN_WAIT: i32 = 9;

/// 16-byte units per row of a swizzle pattern (1 without swizzle).
fn swizzle_units(swizzle: u32) -> u32 {
    match swizzle {
        SW_128 => 8,
        SW_64 => 4,
        SW_32 => 2,
        _ => 1,
    }
}

/// A wgmma descriptor (hopper-ptx.md §2): start, LBO and SBO in 16-byte units at bits 0, 16
/// and 32, the swizzle code at bit 62.
fn descriptor(start: u32, lbo: u32, sbo: u32, swizzle: u32) -> u64 {
    u64::from(start >> 4) | (u64::from(lbo >> 4) << 16) | (u64::from(sbo >> 4) << 32) | (u64::from(swizzle) << 62)
}

/// Where an `mn × k` operand lies in shared memory from byte `base`, as a tensor-map copy
/// places swizzled tiles: K-major, blocks of 8W elements along K (each `mn` rows of 16W
/// bytes); MN-major, blocks of 8W elements along MN (each `k` rows of 16W bytes); in a row,
/// 16-byte chunk c lands at `c ^ ((row address / 128) mod W)`. Without swizzle, 8 × 8 core
/// matrices of 16-byte rows (along K for K-major, along MN for MN-major), 128 bytes apart
/// along K, `k / 8 · 128` apart along MN.
#[derive(Clone, Copy, Debug)]
struct Placement {
    major: i32,
    swizzle: u32,
    mn: u32,
    k: u32,
    base: u32,
}

impl Placement {
    /// One past the last byte (swizzled rows are 16W bytes even when K or MN is shorter).
    fn end(&self) -> u32 {
        let last = (0..self.mn).flat_map(|mn| (0..self.k).map(move |k| (mn, k))).map(|(mn, k)| self.at(mn, k)).max();
        last.map_or(self.base, |a| a + 2)
    }

    /// Byte address of element (mn, k).
    fn at(&self, mn: u32, k: u32) -> u32 {
        let w = swizzle_units(self.swizzle);
        let (e, row) = (8 * w, 16 * w);
        let swz = |row_addr: u32, chunk: u32| (chunk ^ ((row_addr / 128) % w)) * 16;
        match (self.major, self.swizzle) {
            (K_MAJOR, SW_NONE) => {
                self.base + (mn / 8) * (self.k / 8) * 128 + (k / 8) * 128 + (mn % 8) * 16 + (k % 8) * 2
            }
            (K_MAJOR, _) => {
                let r = (k / e) * (self.mn * row) + mn * row;
                self.base + r + swz(r, (k % e) / 8) + (k % 8) * 2
            }
            (_, SW_NONE) => self.base + (mn / 8) * (self.k / 8) * 128 + (k / 8) * 128 + (k % 8) * 16 + (mn % 8) * 2,
            _ => {
                let r = (mn / e) * (self.k * row) + k * row;
                self.base + r + swz(r, (mn % e) / 8) + (mn % 8) * 2
            }
        }
    }

    /// The descriptor of K-step `s` (elements 16s ... 16s + 15 along K).
    fn desc(&self, s: u32) -> u64 {
        let w = swizzle_units(self.swizzle);
        let (start, lbo, sbo) = match (self.major, self.swizzle) {
            (_, SW_NONE) => (self.base + 256 * s, 128, self.k / 8 * 128),
            (K_MAJOR, _) => (self.base + (16 * s / (8 * w)) * (self.mn * 16 * w) + (16 * s % (8 * w)) * 2, 16, 128 * w),
            _ => (self.base + 256 * w * s, self.k * 16 * w, 128 * w),
        };
        descriptor(start, lbo, sbo, self.swizzle)
    }
}

/// One GEMM of the wgmma twin: D (64 × n) = C + A (64 × 16 ksteps) · B, the operands rounded
/// to `dtype`.
#[derive(Clone, Copy, Debug)]
struct Gemm {
    n: u32,
    ksteps: u32,
    dtype: DType,
    rs: bool,
    a: (i32, u32),
    b: (i32, u32),
    with_c: bool,
    pipelined: bool,
}

/// What a GEMM run gives: the twin's D, the float64 reference and its error bound, per element.
struct GemmRun {
    got: Vec<f32>,
    want: Vec<f64>,
    bound: Vec<f64>,
}

fn round_to(dtype: DType, x: f32) -> (u16, f64) {
    match dtype {
        DType::BF16 => {
            let h = bf16::from_f32(x);
            (h.to_bits(), f64::from(h.to_f32()))
        }
        _ => {
            let h = f16::from_f32(x);
            (h.to_bits(), f64::from(h.to_f32()))
        }
    }
}

impl Gemm {
    fn run(&self, fault: i32, schedule: i32, seed: u64, tweak: impl FnOnce(&mut WgmmaCase)) -> Result<GemmRun, String> {
        let (n, kk) = (self.n as usize, 16 * self.ksteps as usize);
        let mut rng = SplitMix(seed ^ 0x5eed);
        let mut uniform = || ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
        let a: Vec<(u16, f64)> = (0..64 * kk).map(|_| round_to(self.dtype, uniform())).collect();
        let b: Vec<(u16, f64)> = (0..kk * n).map(|_| round_to(self.dtype, uniform())).collect();
        let c: Vec<f32> = (0..128 * n / 2).map(|_| uniform()).collect();
        let pa = Placement { major: self.a.0, swizzle: self.a.1, mn: 64, k: kk as u32, base: 0 };
        let b_base = pa.end().div_ceil(1024) * 1024;
        let pb = Placement { major: self.b.0, swizzle: self.b.1, mn: self.n, k: kk as u32, base: b_base };
        let mut image = vec![0u16; (pb.end().div_ceil(1024) * 512) as usize];
        for m in 0..64 {
            for k in 0..kk {
                image[(pa.at(m as u32, k as u32) / 2) as usize] = a[m * kk + k].0;
            }
        }
        for k in 0..kk {
            for j in 0..n {
                image[(pb.at(j as u32, k as u32) / 2) as usize] = b[k * n + j].0;
            }
        }
        let words: Vec<u32> = image.chunks(2).map(|p| u32::from(p[0]) | (u32::from(p[1]) << 16)).collect();
        // A fragments (PTX table, hopper-ptx.md §1.3): thread 32w + 4g + t, register i holds
        // A[16w + g + 8(i & 1)][16s + 2t + 8(i >> 1) + {0, 1}].
        let mut regs = vec![0u32; self.ksteps as usize * 128 * 4];
        for s in 0..self.ksteps as usize {
            for th in 0..128 {
                let (w, g, t) = (th / 32, (th % 32) / 4, th % 4);
                for i in 0..4 {
                    let row = 16 * w + g + 8 * (i & 1);
                    let col = 16 * s + 2 * t + 8 * (i >> 1);
                    regs[(s * 128 + th) * 4 + i] =
                        u32::from(a[row * kk + col].0) | (u32::from(a[row * kk + col + 1].0) << 16);
                }
            }
        }
        let mut out = vec![f32::NAN; 128 * n / 2];
        let mut case = WgmmaCase {
            image: words.as_ptr(),
            image_words: words.len() as u32,
            n: self.n,
            ksteps: self.ksteps,
            input: u32::from(self.dtype != DType::BF16),
            rs: u32::from(self.rs),
            trans_a: self.a.0 as u32,
            trans_b: self.b.0 as u32,
            pipelined: u32::from(self.pipelined),
            overwrite_at: pb.at(0, 0),
            a_desc: [0; 8],
            b_desc: [0; 8],
            a_regs: regs.as_ptr(),
            c: if self.with_c { c.as_ptr() } else { std::ptr::null() },
            out: out.as_mut_ptr(),
            fault,
            threads: if fault == FAULT_MISALIGNED { 256 } else { 128 },
        };
        for s in 0..self.ksteps {
            case.a_desc[s as usize] = pa.desc(s);
            case.b_desc[s as usize] = pb.desc(s);
        }
        tweak(&mut case);
        // SAFETY: every pointer of `case` covers what the kernel reads or writes (see WgmmaCase).
        selftest(|msg, cap| unsafe { ringattn_emu_selftest_wgmma(&case, schedule, seed, msg, cap) })?;
        // D fragments: thread 32w + 4g + t, element v at row 16w + g + 8((v >> 1) & 1),
        // column 8(v >> 2) + 2t + (v & 1).
        let (mut want, mut bound) = (vec![0.0; out.len()], vec![0.0; out.len()]);
        for th in 0..128 {
            let (w, g, t) = (th / 32, (th % 32) / 4, th % 4);
            for v in 0..n / 2 {
                let (row, col) = (16 * w + g + 8 * ((v >> 1) & 1), 8 * (v >> 2) + 2 * t + (v & 1));
                let c0 = if self.with_c { f64::from(c[th * n / 2 + v]) } else { 0.0 };
                let (mut sum, mut mag) = (c0, c0.abs());
                for k in 0..kk {
                    sum += a[row * kk + k].1 * b[k * n + col].1;
                    mag += (a[row * kk + k].1 * b[k * n + col].1).abs();
                }
                want[th * n / 2 + v] = sum;
                // One f32 rounding per K-step (exact products, wide sums): ksteps · 2^-24 · Σ|terms|.
                bound[th * n / 2 + v] = f64::from(self.ksteps) * f64::EPSILON.max(2f64.powi(-24)) * mag;
            }
        }
        Ok(GemmRun { got: out, want, bound })
    }
}

#[test]
fn wgmma_twin_computes_warpgroup_products_for_every_layout_form_and_type() {
    let a_layouts = [(K_MAJOR, SW_128), (K_MAJOR, SW_64), (K_MAJOR, SW_32), (K_MAJOR, SW_NONE), (MN_MAJOR, SW_128)];
    let b_layouts = [(K_MAJOR, SW_128), (K_MAJOR, SW_NONE), (MN_MAJOR, SW_128), (MN_MAJOR, SW_64), (MN_MAJOR, SW_32)];
    let mut index = 0u64;
    for n in [64u32, 128, 256] {
        for dtype in [DType::BF16, DType::F16] {
            for rs in [false, true] {
                for a in a_layouts {
                    if rs && a.0 == MN_MAJOR {
                        continue; // A from registers is always K-major
                    }
                    for b in b_layouts {
                        index += 1;
                        let gemm = Gemm {
                            n,
                            ksteps: 4,
                            dtype,
                            rs,
                            a,
                            b,
                            with_c: index.is_multiple_of(2),
                            pipelined: index.is_multiple_of(3),
                        };
                        let schedule = (index % 3) as i32;
                        let run = gemm.run(0, schedule, index, |_| {}).unwrap_or_else(|e| panic!("{gemm:?}: {e}"));
                        for (i, ((&got, &want), &bound)) in run.got.iter().zip(&run.want).zip(&run.bound).enumerate() {
                            assert!(
                                (f64::from(got) - want).abs() <= bound,
                                "{gemm:?} element {i}: {got} vs {want} (bound {bound:e})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn wgmma_twin_is_schedule_independent_and_exact_for_a_single_step() {
    // One K-step: one f32 rounding of an exact double sum, the same under every schedule.
    let gemm = Gemm {
        n: 128,
        ksteps: 1,
        dtype: DType::BF16,
        rs: true,
        a: (K_MAJOR, SW_128),
        b: (MN_MAJOR, SW_128),
        with_c: true,
        pipelined: false,
    };
    let runs: Vec<GemmRun> = (0..3).map(|s| gemm.run(0, s, 7, |_| {}).unwrap()).collect();
    for run in &runs {
        assert_eq!(run.got, runs[0].got);
        for (&got, &want) in run.got.iter().zip(&run.want) {
            assert_eq!(got, want as f32, "a single wgmma rounds once");
        }
    }
}

#[test]
fn wgmma_misuse_is_reported() {
    let gemm = Gemm {
        n: 64,
        ksteps: 2,
        dtype: DType::BF16,
        rs: false,
        a: (K_MAJOR, SW_128),
        b: (K_MAJOR, SW_128),
        with_c: true,
        pipelined: false,
    };
    let cases = [
        (FAULT_NO_PROXY_FENCE, "has not fenced since"),
        (FAULT_READ_IN_FLIGHT, "accumulator accessed while 1 wgmma(s) writing it are in flight"),
        (FAULT_MISALIGNED, "never reaches; the first is thread 64 of warpgroup 0"),
        (FAULT_OVERWRITE, "read by an in-flight wgmma was overwritten before wgmma.wait_group"),
        (FAULT_NO_WGMMA_FENCE, "without a wgmma.fence before it"),
        (FAULT_NON_UNIFORM, "the B descriptor differs between threads 0 and 37"),
        (FAULT_NO_WAIT, "exited with wgmma operations never waited for"),
        (FAULT_ACCESS_AFTER_FENCE, "accessed after its last wgmma.fence"),
        // One warp's wait does not retire the other warps' parts: a buffer refilled after it
        // alone is still read.
        (FAULT_OVERWRITE_AFTER_OWN_WAIT, "read by an in-flight wgmma was overwritten before wgmma.wait_group"),
    ];
    for (fault, expect) in cases {
        for schedule in 0..3 {
            let err = gemm.run(fault, schedule, 3, |_| {}).err().unwrap_or_else(|| panic!("fault {fault}: no error"));
            assert!(err.contains(expect), "fault {fault}, schedule {schedule}: {err}");
        }
    }
    // The bug-free kernel passes on the same inputs.
    gemm.run(0, 0, 3, |_| {}).unwrap();
    // A swizzled descriptor whose start is not where a K-step of an aligned tile can be.
    let err = gemm.run(0, 0, 3, |c| c.a_desc[1] += 256 >> 4).err().expect("bad swizzle start");
    assert!(err.contains("past its 1024-byte repeat"), "{err}");
    // A descriptor pointing past the block's shared memory.
    let err = gemm.run(0, 0, 3, |c| c.b_desc[0] += 1 << 12).err().expect("outside shared memory");
    assert!(err.contains("outside the block's"), "{err}");
    // Too few threads for a warpgroup.
    let err = gemm.run(0, 0, 3, |c| c.threads = 96).err().expect("incomplete warpgroup");
    assert!(err.contains("incomplete in a block of 96 threads"), "{err}");
}

#[test]
fn setmaxnreg_is_a_warpgroup_instruction() {
    // SAFETY: the entry writes only its message.
    selftest(|msg, cap| unsafe { ringattn_emu_selftest_setmaxnreg(0, msg, cap) }).unwrap();
    let err = selftest(|msg, cap| unsafe { ringattn_emu_selftest_setmaxnreg(1, msg, cap) }).unwrap_err();
    assert!(err.contains("never reaches"), "{err}");
    let err = selftest(|msg, cap| unsafe { ringattn_emu_selftest_setmaxnreg(2, msg, cap) }).unwrap_err();
    assert!(err.contains("different setmaxnreg"), "{err}");
}

/// A bulk tensor copy case (`TmaCase` of cuda/emu/selftest_ptx.cpp).
#[repr(C)]
struct TmaCase {
    load_map: *const TensorMap,
    store_map: *const TensorMap,
    coords: [i32; 4],
    rank: u32,
    dst_offset: u32,
    expect_bytes: u32,
    image_bytes: u32,
    image: *mut u8,
    fault: i32,
    pad: u32,
}

extern "C" {
    fn ringattn_emu_selftest_tma(case: *const TmaCase, schedule: i32, seed: u64, msg: *mut c_char, cap: usize) -> i32;
}

/// A tensor in host memory (elements of `dtype`, as raw bytes), its map and a box to copy.
struct TmaTensor {
    spec: TensorMapSpec,
    data: Vec<u8>,
}

impl TmaTensor {
    /// A packed tensor of `dims` (innermost first) with distinct nonzero element patterns.
    fn new(dtype: TensorMapDType, dims: &[u64], box_dims: &[u32], swizzle: TensorMapSwizzle, seed: u64) -> Self {
        let size = dtype.size();
        let count: u64 = dims.iter().product();
        let mut rng = SplitMix(seed);
        let mut data = vec![0u8; (count * size) as usize];
        for e in data.chunks_mut(size as usize) {
            let bits = rng.next() | 1;
            e.copy_from_slice(&bits.to_le_bytes()[..size as usize]);
        }
        let mut strides = Vec::new();
        let mut s = size * dims[0];
        for &d in &dims[1..] {
            strides.push(s);
            s *= d;
        }
        let spec = TensorMapSpec {
            dtype,
            address: data.as_ptr() as u64,
            dims: dims.to_vec(),
            strides,
            box_dims: box_dims.to_vec(),
            swizzle,
            oob_fill: OobFill::Zeros,
        };
        TmaTensor { spec, data }
    }

    /// The byte offset of the element at (global) coordinates `g`, if inside the tensor.
    fn offset(&self, g: &[i64]) -> Option<usize> {
        let mut off = 0u64;
        let mut stride = self.spec.dtype.size();
        for (d, &x) in g.iter().enumerate() {
            if x < 0 || x as u64 >= self.spec.dims[d] {
                return None;
            }
            off += x as u64 * stride;
            stride *= self.spec.dims[d];
        }
        Some(off as usize)
    }

    /// Every box element from `coords`: (dense byte offset in the box, byte offset in the
    /// tensor or None outside it).
    fn box_elements(&self, coords: &[i32]) -> Vec<(usize, Option<usize>)> {
        let size = self.spec.dtype.size() as usize;
        let b = &self.spec.box_dims;
        let mut idx = vec![0u32; b.len()];
        let mut out = Vec::new();
        for dense in 0..b.iter().map(|&x| x as usize).product::<usize>() {
            let g: Vec<i64> = idx.iter().zip(coords).map(|(&i, &c)| i64::from(c) + i64::from(i)).collect();
            out.push((dense * size, self.offset(&g)));
            for d in 0..b.len() {
                idx[d] += 1;
                if idx[d] < b[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        out
    }
}

/// Where byte `dense` of a box placed at shared offset `dst` lands (hopper-ptx.md §4.3): the
/// 16-byte chunk index XOR-ed with the 128-byte line index mod 8 / 4 / 2 (128B / 64B / 32B).
fn swizzled_offset(dst: usize, dense: usize, swizzle: TensorMapSwizzle) -> usize {
    let a = dst + dense;
    let lines = match swizzle {
        TensorMapSwizzle::None => 1,
        TensorMapSwizzle::B32 => 2,
        TensorMapSwizzle::B64 => 4,
        TensorMapSwizzle::B128 => 8,
    };
    let chunk = (a / 16) % 8;
    a - chunk * 16 + ((chunk ^ ((a / 128) % lines)) % 8) * 16
}

fn run_tma(
    t: &TmaTensor,
    store: Option<&TmaTensor>,
    coords: &[i32],
    dst_offset: u32,
    tweak: impl FnOnce(&mut TmaCase),
    schedule: i32,
) -> Result<Vec<u8>, String> {
    let load_map = t.spec.encode_emulated().map_err(|e| e.to_string())?;
    let store_map = store.map(|s| s.spec.encode_emulated().unwrap());
    let image_bytes = (dst_offset as u64 + t.spec.box_bytes()).div_ceil(1024) * 1024;
    let mut image = vec![0u8; image_bytes as usize];
    let mut c = [0i32; 4];
    c[..coords.len()].copy_from_slice(coords);
    let mut case = TmaCase {
        load_map: &load_map,
        store_map: store_map.as_ref().map_or(std::ptr::null(), |m| m as *const TensorMap),
        coords: c,
        rank: coords.len() as u32,
        dst_offset,
        expect_bytes: t.spec.box_bytes() as u32,
        image_bytes: image_bytes as u32,
        image: image.as_mut_ptr(),
        fault: 0,
        pad: 0,
    };
    tweak(&mut case);
    // SAFETY: the maps address live tensors (`t.data`, `store.data`) of their dims; `image`
    // holds image_bytes bytes.
    selftest(|msg, cap| unsafe { ringattn_emu_selftest_tma(&case, schedule, 11, msg, cap) })?;
    Ok(image)
}

#[test]
fn bulk_tensor_copies_place_boxes_as_the_ptx_describes_and_fill_outside_the_tensor() {
    use TensorMapSwizzle::*;
    // (dtype, dims, box, swizzle, coords): K/V-like boxes of every rank, boxes reaching past
    // either end of the tensor, each swizzle.
    type Case = (TensorMapDType, Vec<u64>, Vec<u32>, TensorMapSwizzle, Vec<i32>);
    let cases: Vec<Case> = vec![
        (TensorMapDType::BF16, vec![96, 50], vec![32, 16], B64, vec![80, 40]),
        (TensorMapDType::BF16, vec![96, 50], vec![32, 16], B64, vec![-16, -4]),
        (TensorMapDType::BF16, vec![64, 3, 70], vec![64, 1, 32], B128, vec![0, 2, 50]),
        (TensorMapDType::F16, vec![128, 3, 70], vec![128, 1, 8], None, vec![0, 1, 3]),
        (TensorMapDType::F16, vec![16, 5, 33], vec![16, 2, 20], B32, vec![0, 4, 20]),
        (TensorMapDType::F32, vec![32, 2, 40, 2], vec![32, 1, 16, 1], B128, vec![0, 1, 30, 1]),
    ];
    for (i, (dtype, dims, box_dims, swizzle, coords)) in cases.into_iter().enumerate() {
        let t = TmaTensor::new(dtype, &dims, &box_dims, swizzle, i as u64 + 1);
        let mut out = TmaTensor::new(dtype, &dims, &box_dims, swizzle, 0);
        out.data.fill(0);
        let stores = coords.iter().all(|&c| c >= 0);
        let dst = 1024;
        for schedule in 0..3 {
            let image = run_tma(&t, stores.then_some(&out), &coords, dst as u32, |_| {}, schedule)
                .unwrap_or_else(|e| panic!("case {i}: {e}"));
            let size = dtype.size() as usize;
            for (dense, src) in t.box_elements(&coords) {
                let at = swizzled_offset(dst, dense, swizzle);
                let want = src.map_or(vec![0u8; size], |o| t.data[o..o + size].to_vec());
                assert_eq!(&image[at..at + size], &want[..], "case {i}: box byte {dense} at shared {at}");
            }
        }
        if stores {
            // The store wrote exactly the box's elements inside the tensor.
            let inside: std::collections::HashSet<usize> =
                t.box_elements(&coords).into_iter().filter_map(|(_, o)| o).collect();
            let size = dtype.size() as usize;
            for o in (0..t.data.len()).step_by(size) {
                let want = if inside.contains(&o) { &t.data[o..o + size] } else { &[0u8; 4][..size] };
                assert_eq!(&out.data[o..o + size], want, "case {i}: stored element at byte {o}");
            }
        }
    }
}

#[test]
fn bulk_tensor_copy_misuse_is_reported() {
    let t = TmaTensor::new(TensorMapDType::BF16, &[64, 3, 70], &[64, 1, 32], TensorMapSwizzle::B128, 5);
    let mut out = TmaTensor::new(TensorMapDType::BF16, &[64, 3, 70], &[64, 1, 32], TensorMapSwizzle::B128, 0);
    out.data.fill(0);
    let coords = [0, 1, 10];
    let err = |fault: i32, tweak: &dyn Fn(&mut TmaCase), dst: u32| {
        run_tma(
            &t,
            Some(&out),
            &coords,
            dst,
            |c| {
                c.fault = fault;
                tweak(c);
            },
            0,
        )
        .err()
        .unwrap_or_else(|| panic!("fault {fault}: no error"))
    };
    let box_bytes = t.spec.box_bytes() as u32;
    let cases: Vec<(String, &str)> = vec![
        // A transaction count that does not match the box: the phase never completes.
        (err(0, &|c| c.expect_bytes = box_bytes - 16, 1024), "wait on mbarrier phases that can never complete"),
        (err(0, &|c| c.expect_bytes = box_bytes + 16, 1024), "wait on mbarrier phases that can never complete"),
        (err(1, &|_| {}, 1024), "shared load at shared offset 1064 while a bulk tensor copy to it is in flight"),
        (err(2, &|_| {}, 1024), "read by a bulk tensor store was overwritten before"),
        (err(3, &|_| {}, 1024), "that thread 9 stored with an ordinary (generic-proxy) store"),
        (err(4, &|_| {}, 1024), "lands on shared memory at offset 1036 that thread 5 stored"),
        (err(0, &|_| {}, 1024 + 64), "is not 128-byte aligned"),
        (err(0, &|_| {}, 1024 + 512), "not aligned to its 1024-byte swizzle repeat"),
        (err(0, &|c| c.rank = 2, 1024), "a 2-d copy with a tensor map of rank 3"),
        (err(0, &|c| c.coords[2] = -1, 1024), "negative start coordinate -1 in dim 2"),
    ];
    for (got, want) in cases {
        assert!(got.contains(want), "want `{want}` in: {got}");
    }
    let blank = TensorMap::default();
    let e = run_tma(&t, None, &coords, 1024, |c| c.load_map = &blank, 0).unwrap_err();
    assert!(e.contains("not encoded for the emulator"), "{e}");
}

extern "C" {
    fn ringattn_emu_selftest_named_barriers(
        rounds: i32,
        fault: i32,
        schedule: i32,
        seed: u64,
        log: *mut i32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

fn named_turns(rounds: i32, fault: i32, schedule: i32) -> Result<Vec<i32>, String> {
    let mut log = vec![0i32; 1 + 2 * rounds as usize];
    // SAFETY: `log` holds 1 + 2 rounds entries, what the kernel writes at most.
    selftest(|msg, cap| unsafe {
        ringattn_emu_selftest_named_barriers(rounds, fault, schedule, 5, log.as_mut_ptr(), msg, cap)
    })?;
    Ok(log)
}

/// Named barriers carry two groups' turns in strict alternation under every schedule (bar.sync
/// completes at its count of syncs and arrives); misuse is reported.
#[test]
fn named_barriers_alternate_two_groups_and_report_misuse() {
    for schedule in 0..3 {
        let log = named_turns(5, 0, schedule).unwrap();
        assert_eq!(log, [10, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1], "schedule {schedule}");
    }
    assert!(named_turns(3, 1, 0).unwrap_err().contains("deadlock"));
    assert!(named_turns(3, 2, 0).unwrap_err().contains("expects 256 threads"));
    assert!(named_turns(3, 3, 0).unwrap_err().contains("outside 1 ... 15"));
}

extern "C" {
    fn ringattn_emu_selftest_score_tanh(
        x: *const f32,
        n: u32,
        tanh_out: *mut f32,
        rcp_out: *mut f32,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// The kernels' soft-cap tanh (`cuda/score.cuh`, on the twins of `ex2.approx` and
/// `rcp.approx`) against f64's tanh on a dense sweep through 0, across the split form's switch
/// at |y| = 0.3 and into saturation: the short form 1 − 2/(e^{2y} + 1) within 2 units in the
/// last place of 1, absolutely (a capped score's error is the cap times this: what the softmax
/// reads); the split form within 12 units in the last place of the result (its stated bound:
/// about 10 at the switch); ±inf give ±1, NaN stays NaN. And `rcp.approx`'s twin: the
/// correctly rounded reciprocal, .ftz (subnormals in and out are zero).
#[test]
fn score_tanh_and_rcp_approx_twins_are_accurate() {
    let mut x: Vec<f32> = (-24_000..=24_000).map(|i| i as f32 * 5e-4).collect();
    x.extend([1e-30, -3e-8, 0.2999999, 0.3, 0.3000001, 95.0, -1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    x.extend((1..200).map(|i| 1.0e-4 * i as f32).flat_map(|v| [v, -v]));
    x.extend([1e-40, 3e38, -0.5]);
    let n = x.len();
    let (mut t, mut r) = (vec![0.0f32; 2 * n], vec![0.0f32; n]);
    selftest(|msg, cap| unsafe {
        ringattn_emu_selftest_score_tanh(x.as_ptr(), n as u32, t.as_mut_ptr(), r.as_mut_ptr(), msg, cap)
    })
    .unwrap();
    let (short, split) = t.split_at(n);
    for (((&xi, &ti), &si), &ri) in x.iter().zip(short).zip(split).zip(&r) {
        if xi.is_nan() {
            assert!(ti.is_nan() && si.is_nan() && ri.is_nan(), "NaN in: tanh {ti} / {si}, rcp {ri}");
            continue;
        }
        let want = (xi as f64).tanh();
        let err = (ti as f64 - want).abs();
        assert!(err <= 2.0 * f32::EPSILON as f64, "short tanh({xi}) = {ti}, want {want}");
        let err = (si as f64 - want).abs();
        assert!(err <= 12.0 * f32::EPSILON as f64 * want.abs(), "split tanh({xi}) = {si}, want {want}");
        let flushed = if xi.abs() < f32::MIN_POSITIVE { 0.0f32.copysign(xi) } else { xi };
        let mut want_r = 1.0f32 / flushed;
        if want_r.abs() < f32::MIN_POSITIVE {
            want_r = 0.0f32.copysign(want_r);
        }
        assert_eq!(ri.to_bits(), want_r.to_bits(), "rcp({xi}) = {ri}, want {want_r}");
    }
}
