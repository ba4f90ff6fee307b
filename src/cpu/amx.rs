//! Intel AMX bf16 tiles: the instruction-level twin of the operations the CPU's bf16 products
//! will run on AMX (tile load, store, zero, `TDPBF16PS`), the real instructions behind one
//! `asm!` block per micro-kernel, the run-time check of the processor and Linux's permission,
//! and the packing of a B operand into the tiles' bf16-pair layout.
//!
//! **Tiles** (palette 1): eight registers of at most 16 rows × 64 bytes, shaped by a 64-byte
//! [`TileConfig`]. `TDPBF16PS C, A, B` multiplies an `M × 2K` bf16 A (each 32-bit element a
//! pair along the inner dimension) by a `K × N` tile of bf16 pairs B (row `k`, element `n`
//! holds `(B[2k][n], B[2k+1][n])`: [`pack_b_pairs`]) into an `M × N` f32 C.
//!
//! **The twin's arithmetic** is the SDM's loop for `TDPBF16PS`: per row of C, two chains of
//! f32 fused multiply-adds, one over the even halves of the pairs and one over the odd halves,
//! each rounded to nearest even; after the inner dimension, the two chains are added and the
//! sum is added to C — every step rounded, input denormals read as zero and denormal results
//! flushed to zero; rows and columns of the destination beyond `M × N` zeroed. (An older text,
//! the intrinsics guide's, accumulates straight into C; the two round differently. On a
//! processor with AMX the tests compare the twin with the real instruction bit for bit, so
//! whichever the silicon follows is what the twin does.)
//!
//! **Linux** hands out tile state per process on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`): [`available`] checks CPUID (AMX-TILE, AMX-BF16), that the OS enabled
//! the tile state (XCR0 bits 17 and 18) and asks for the permission, once per process.
//!
//! ```
//! use ringattn::cpu::amx::{pack_b_pairs, Tile};
//! use half::bf16;
//!
//! // A: 2 × 4 bf16, B: 4 × 3 bf16; C = A·B in f32.
//! let a: Vec<bf16> = [1.0, 2.0, 3.0, 4.0, 0.5, 0.25, 0.0, -1.0].map(bf16::from_f32).to_vec();
//! let b: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32)).collect();
//! let a_tile = Tile::load_bf16(2, 4, &a, 4)?;
//! let b_tile = Tile::load_pairs(2, 3, &pack_b_pairs(&b, 4, 3), 3)?;
//! let mut c = Tile::zeroed(2, 3 * 4)?;
//! c.dpbf16ps(&a_tile, &b_tile)?;
//! assert_eq!(c.f32_row(0), vec![60.0, 70.0, 80.0]); // 1·0 + 2·3 + 3·6 + 4·9, ...
//! # Ok::<(), ringattn::Error>(())
//! ```

use half::bf16;

use crate::{Error, Result};

/// Rows of a tile register.
pub const MAX_ROWS: usize = 16;
/// Bytes per row of a tile register.
pub const MAX_COLSB: usize = 64;
/// Tile registers of palette 1.
pub const TILES: usize = 8;

/// The 64-byte operand of `LDTILECFG`: palette 1, the rows and bytes per row of each tile
/// (unused tiles 0 × 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<TileConfig>() == 64 && std::mem::align_of::<TileConfig>() == 64);

impl TileConfig {
    /// Palette 1 with tile `i` shaped `shapes[i] = (rows, bytes per row)`; the rest unused.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more than [`TILES`] tiles, more than [`MAX_ROWS`] rows,
    /// more than [`MAX_COLSB`] bytes or a row not a whole number of 32-bit elements, or a
    /// tile with rows but no bytes (or bytes but no rows).
    pub fn new(shapes: &[(usize, usize)]) -> Result<Self> {
        if shapes.len() > TILES {
            return Err(Error::InvalidArgument(format!(
                "AMX tile config: {} tiles, palette 1 has {TILES}",
                shapes.len()
            )));
        }
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for (i, &(rows, colsb)) in shapes.iter().enumerate() {
            check_shape(rows, colsb).map_err(|e| Error::InvalidArgument(format!("AMX tile {i}: {e}")))?;
            cfg.rows[i] = rows as u8;
            cfg.colsb[i] = colsb as u16;
        }
        Ok(cfg)
    }

    /// Tile `i`'s (rows, bytes per row).
    pub fn shape(&self, i: usize) -> (usize, usize) {
        (self.rows[i] as usize, self.colsb[i] as usize)
    }
}

fn check_shape(rows: usize, colsb: usize) -> std::result::Result<(), String> {
    if rows > MAX_ROWS || colsb > MAX_COLSB || !colsb.is_multiple_of(4) || (rows == 0) != (colsb == 0) {
        return Err(format!(
            "{rows} rows × {colsb} bytes: at most {MAX_ROWS} × {MAX_COLSB}, whole 32-bit elements, both or neither zero"
        ));
    }
    Ok(())
}

/// The twin of one tile register: its configured shape and its 16 × 64 bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Tile {
    rows: usize,
    colsb: usize,
    bytes: [u8; MAX_ROWS * MAX_COLSB],
}

impl std::fmt::Debug for Tile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tile({} × {} bytes)", self.rows, self.colsb)
    }
}

/// bf16 read as f32, denormals as zero (the instruction's DAZ).
fn bf16_daz(bits: u16) -> f32 {
    flush(f32::from_bits(u32::from(bits) << 16))
}

/// A denormal f32 as a zero of its sign (DAZ on inputs, FTZ on results).
fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

impl Tile {
    /// `TILEZERO` on a tile configured `rows × colsb` bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a shape [`TileConfig::new`] refuses.
    pub fn zeroed(rows: usize, colsb: usize) -> Result<Self> {
        check_shape(rows, colsb).map_err(Error::InvalidArgument)?;
        Ok(Tile { rows, colsb, bytes: [0; MAX_ROWS * MAX_COLSB] })
    }

    /// `TILELOADD`: `rows` rows of `colsb` bytes from `src`, row `r` at byte `r·stride`; the
    /// bytes past `colsb` and the rows past `rows` read as zero.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad shape or a `src` too short for the rows read.
    pub fn load(rows: usize, colsb: usize, src: &[u8], stride: usize) -> Result<Self> {
        let mut t = Tile::zeroed(rows, colsb)?;
        if rows > 0 && (rows - 1) * stride + colsb > src.len() {
            return Err(Error::InvalidArgument(format!(
                "AMX tile load: {rows} rows of {colsb} bytes at stride {stride} read past {} bytes",
                src.len()
            )));
        }
        for r in 0..rows {
            t.bytes[r * MAX_COLSB..r * MAX_COLSB + colsb].copy_from_slice(&src[r * stride..r * stride + colsb]);
        }
        Ok(t)
    }

    /// An A operand: `rows` rows of `cols` bf16 values (`cols` even: pairs along the inner
    /// dimension) from `src`, row `r` at element `r·ld`.
    ///
    /// # Errors
    /// As [`Tile::load`]; an odd `cols`.
    pub fn load_bf16(rows: usize, cols: usize, src: &[bf16], ld: usize) -> Result<Self> {
        if !cols.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!("AMX A tile: {cols} bf16 columns, not whole pairs")));
        }
        Tile::load(rows, cols * 2, bytemuck::cast_slice(src), ld * 2)
    }

    /// A B operand: `rows` rows (pairs of the inner dimension) of `cols` bf16 pairs, as
    /// [`pack_b_pairs`] lays them out, row `r` at pair `r·ld`.
    ///
    /// # Errors
    /// As [`Tile::load`].
    pub fn load_pairs(rows: usize, cols: usize, src: &[u32], ld: usize) -> Result<Self> {
        Tile::load(rows, cols * 4, bytemuck::cast_slice(src), ld * 4)
    }

    /// `TILESTORED`: the configured rows and bytes into `dst`, row `r` at byte `r·stride`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `dst` too short.
    pub fn store(&self, dst: &mut [u8], stride: usize) -> Result<()> {
        if self.rows > 0 && (self.rows - 1) * stride + self.colsb > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "AMX tile store: {} rows of {} bytes at stride {stride} write past {} bytes",
                self.rows,
                self.colsb,
                dst.len()
            )));
        }
        for r in 0..self.rows {
            dst[r * stride..r * stride + self.colsb]
                .copy_from_slice(&self.bytes[r * MAX_COLSB..r * MAX_COLSB + self.colsb]);
        }
        Ok(())
    }

    fn dword(&self, r: usize, i: usize) -> u32 {
        let at = r * MAX_COLSB + 4 * i;
        u32::from_le_bytes([self.bytes[at], self.bytes[at + 1], self.bytes[at + 2], self.bytes[at + 3]])
    }

    /// Row `r` of a tile of f32 (a C tile), its configured columns.
    pub fn f32_row(&self, r: usize) -> Vec<f32> {
        (0..self.colsb / 4).map(|i| f32::from_bits(self.dword(r, i))).collect()
    }

    /// `TDPBF16PS self, a, b`: `self[m][n] += Σ_k a[m].pair(k) · b[k].pair(n)` in the SDM's
    /// order (module documentation).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (the instruction's #UD) unless `self.rows == a.rows`,
    /// `a`'s 32-bit columns equal `b.rows` and `self.colsb == b.colsb`.
    pub fn dpbf16ps(&mut self, a: &Tile, b: &Tile) -> Result<()> {
        let (m, k, n) = (self.rows, a.colsb / 4, self.colsb / 4);
        if a.rows != m || b.rows != k || b.colsb != self.colsb {
            return Err(Error::InvalidArgument(format!(
                "TDPBF16PS shapes: C {m} × {} bytes, A {} × {} bytes, B {} × {} bytes",
                self.colsb, a.rows, a.colsb, b.rows, b.colsb
            )));
        }
        let mut out = [0u8; MAX_ROWS * MAX_COLSB];
        for row in 0..m {
            let mut even = [0f32; MAX_COLSB / 4];
            let mut odd = [0f32; MAX_COLSB / 4];
            for kk in 0..k {
                let ap = a.dword(row, kk);
                let (a0, a1) = (bf16_daz(ap as u16), bf16_daz((ap >> 16) as u16));
                for col in 0..n {
                    let bp = b.dword(kk, col);
                    even[col] = flush(a0.mul_add(bf16_daz(bp as u16), even[col]));
                    odd[col] = flush(a1.mul_add(bf16_daz((bp >> 16) as u16), odd[col]));
                }
            }
            for col in 0..n {
                let c = flush(f32::from_bits(self.dword(row, col)));
                let sum = flush(c + flush(even[col] + odd[col]));
                let at = row * MAX_COLSB + 4 * col;
                out[at..at + 4].copy_from_slice(&sum.to_bits().to_le_bytes());
            }
        }
        self.bytes = out;
        Ok(())
    }
}

/// Packs a row-major `k × n` bf16 matrix `b` into B tiles' layout: `⌈k/2⌉` rows of `n` 32-bit
/// pairs, pair `(r, j)` = `(b[2r][j], b[2r+1][j])` (low half first; an odd `k` padded with a
/// zero row).
///
/// # Panics
/// When `b` holds fewer than `k·n` values.
pub fn pack_b_pairs(b: &[bf16], k: usize, n: usize) -> Vec<u32> {
    assert!(b.len() >= k * n, "pack_b_pairs: {} values for {k} × {n}", b.len());
    let mut out = vec![0u32; k.div_ceil(2) * n];
    for r in 0..k.div_ceil(2) {
        for j in 0..n {
            let lo = b[2 * r * n + j].to_bits();
            let hi = if 2 * r + 1 < k { b[(2 * r + 1) * n + j].to_bits() } else { 0 };
            out[r * n + j] = u32::from(lo) | (u32::from(hi) << 16);
        }
    }
    out
}

/// Whether this process may run AMX bf16 tiles: the processor has AMX-TILE and AMX-BF16, the
/// OS enabled the tile state (XCR0 bits 17 and 18), and Linux granted this process the tile
/// data (`arch_prctl(ARCH_REQ_XCOMP_PERM, 18)`, asked once). False elsewhere.
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let (max, leaf1) = (__cpuid(0).eax, __cpuid(1));
    if max < 7 || leaf1.ecx & (1 << 27) == 0 {
        return false; // no leaf 7, or no OSXSAVE (XGETBV unusable)
    }
    // Leaf 7 exists (checked above).
    let leaf7 = __cpuid_count(7, 0);
    let (bf16_ok, tile_ok) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    if !(bf16_ok && tile_ok) {
        return false;
    }
    let xcr0: u64;
    // SAFETY: OSXSAVE is set, so XGETBV with ECX = 0 reads XCR0.
    unsafe {
        let (lo, hi): (u32, u32);
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags));
        xcr0 = u64::from(lo) | (u64::from(hi) << 32);
    }
    if xcr0 & (3 << 17) != 3 << 17 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    const SYS_ARCH_PRCTL: u64 = 158;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, 18) only changes this process's permitted
    // xstate; the syscall clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as i64 => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// One `TDPBF16PS` on the processor's tiles, the way the twin's [`Tile::dpbf16ps`] computes it:
/// `c` (`m × n` f32, row stride `ldc` values) += `a` (`m × 2k` bf16, row stride `lda`) · `b`
/// (`k × n` pairs, row stride `ldb`), in one `asm!` block that configures the tiles, loads,
/// multiplies, stores and releases them. `None` when [`available`] is false.
///
/// # Errors
/// [`Error::InvalidArgument`] for shapes beyond a tile or slices too short.
pub fn dpbf16ps_on_tiles(
    (m, k, n): (usize, usize, usize),
    c: &mut [f32],
    ldc: usize,
    a: &[bf16],
    lda: usize,
    b: &[u32],
    ldb: usize,
) -> Result<Option<()>> {
    let cfg = TileConfig::new(&[(m, 4 * n), (m, 4 * k), (k, 4 * n)])?;
    if !(rows_fit(c.len(), m, ldc, n) && rows_fit(a.len(), m, lda, 2 * k) && rows_fit(b.len(), k, ldb, n)) || m == 0 {
        return Err(Error::InvalidArgument(format!(
            "TDPBF16PS on tiles: {m} × {k} pairs × {n} with strides {ldc}, {lda}, {ldb} over {}, {}, {} values",
            c.len(),
            a.len(),
            b.len()
        )));
    }
    if !available() {
        return Ok(None);
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AMX is available and permitted (checked); the config is valid (checked by
    // TileConfig::new); every row the tiles read or write lies inside the slices (checked
    // above); the tiles are released before the block ends.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tileloadd tmm0, [{c} + {ldc}*1]",
            "tileloadd tmm1, [{a} + {lda}*1]",
            "tileloadd tmm2, [{b} + {ldb}*1]",
            "tdpbf16ps tmm0, tmm1, tmm2",
            "tilestored [{c} + {ldc}*1], tmm0",
            "tilerelease",
            cfg = in(reg) &cfg,
            c = in(reg) c.as_mut_ptr(),
            ldc = in(reg) ldc * 4,
            a = in(reg) a.as_ptr(),
            lda = in(reg) lda * 2,
            b = in(reg) b.as_ptr(),
            ldb = in(reg) ldb * 4,
            out("tmm0") _,
            out("tmm1") _,
            out("tmm2") _,
            options(nostack)
        );
    }
    Ok(Some(()))
}

/// Whether `rows` rows of `cols` values at row stride `ld` (at least `cols`: rows must not
/// overlap) lie inside a slice of `len` values.
fn rows_fit(len: usize, rows: usize, ld: usize, cols: usize) -> bool {
    rows == 0 || (ld >= cols && (rows - 1) * ld + cols <= len)
}

/// Rows and columns of [`block_product`]'s output block: 2 × 2 tiles of 16 × 16 f32.
pub const BLOCK: usize = 32;
/// bf16 values of the inner dimension per `TDPBF16PS` step (16 pairs: one 64-byte A row).
pub const STEP: usize = 32;

/// `c = a · b` for one 32 × 32 block, the 2 × 2 tile kernel of the AMX attention products:
/// `a` is 32 rows of `kdim` bf16 (row stride `lda` values), `b` is `kdim / 2` rows of 32 bf16
/// pairs ([`pack_b_pairs`]; row stride `ldb` pairs), `c` 32 rows of 32 f32 (row stride `ldc`),
/// overwritten. `kdim` is a multiple of [`STEP`] (pad the operands with zeros). Tiles 0–1 hold
/// A's two row halves, 2–3 B's two column halves, 4–7 the four accumulators; each step of 32
/// along the inner dimension is four tile loads and four `TDPBF16PS`.
///
/// On a processor without AMX (or without Linux's permission) the twin runs the same steps,
/// with the same result bit for bit; [`BlockEngine`] says which ran.
///
/// # Errors
/// [`Error::InvalidArgument`] for a `kdim` that is zero or not a multiple of [`STEP`], strides
/// below the rows' widths, or slices too short.
#[allow(clippy::too_many_arguments)]
pub fn block_product(
    kdim: usize,
    c: &mut [f32],
    ldc: usize,
    a: &[bf16],
    lda: usize,
    b: &[u32],
    ldb: usize,
    engine: BlockEngine,
) -> Result<BlockEngine> {
    if kdim == 0
        || !kdim.is_multiple_of(STEP)
        || !(rows_fit(c.len(), BLOCK, ldc, BLOCK)
            && rows_fit(a.len(), BLOCK, lda, kdim)
            && rows_fit(b.len(), kdim / 2, ldb, BLOCK))
    {
        return Err(Error::InvalidArgument(format!(
            "AMX block product: inner dimension {kdim} (a positive multiple of {STEP}), strides {ldc}, {lda}, {ldb} \
             over {}, {}, {} values",
            c.len(),
            a.len(),
            b.len()
        )));
    }
    if engine == BlockEngine::Tiles && available() {
        block_on_tiles(kdim, c, ldc, a, lda, b, ldb);
        return Ok(BlockEngine::Tiles);
    }
    let half = BLOCK / 2;
    let mut acc: Vec<Tile> = (0..4).map(|_| Tile::zeroed(half, 4 * half)).collect::<Result<_>>()?;
    for step in 0..kdim / STEP {
        let a_tiles = [
            Tile::load_bf16(half, STEP, &a[step * STEP..], lda)?,
            Tile::load_bf16(half, STEP, &a[half * lda + step * STEP..], lda)?,
        ];
        let b_tiles = [
            Tile::load_pairs(half, half, &b[step * half * ldb..], ldb)?,
            Tile::load_pairs(half, half, &b[step * half * ldb + half..], ldb)?,
        ];
        for (t, acc) in acc.iter_mut().enumerate() {
            acc.dpbf16ps(&a_tiles[t / 2], &b_tiles[t % 2])?;
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        let at = (t / 2) * half * ldc + (t % 2) * half;
        acc.store(bytemuck::cast_slice_mut(&mut c[at..]), ldc * 4)?;
    }
    Ok(BlockEngine::Twin)
}

/// Which engine ran a [`block_product`] (or which the caller asks for).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockEngine {
    /// The processor's tiles when [`available`], the twin otherwise.
    #[default]
    Tiles,
    /// The instruction-level twin.
    Twin,
}

/// [`block_product`] on the processor's tiles (checked by the caller: shapes and AMX).
#[allow(clippy::too_many_arguments)]
fn block_on_tiles(kdim: usize, c: &mut [f32], ldc: usize, a: &[bf16], lda: usize, b: &[u32], ldb: usize) {
    let cfg = TileConfig::new(&[(16, 64), (16, 64), (16, 64), (16, 64), (16, 64), (16, 64), (16, 64), (16, 64)])
        .expect("the full palette-1 shape");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AMX is available and permitted; every tile row read lies inside `a` and `b`
    // and every row written inside `c` (checked by block_product: 32 rows at the strides,
    // kdim/32 steps); the tiles are released before the block ends.
    unsafe {
        std::arch::asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            "2:",
            "tileloadd tmm0, [{a0} + {lda}*1]",
            "tileloadd tmm1, [{a1} + {lda}*1]",
            "tileloadd tmm2, [{b0} + {ldb}*1]",
            "tileloadd tmm3, [{b1} + {ldb}*1]",
            "tdpbf16ps tmm4, tmm0, tmm2",
            "tdpbf16ps tmm5, tmm0, tmm3",
            "tdpbf16ps tmm6, tmm1, tmm2",
            "tdpbf16ps tmm7, tmm1, tmm3",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, {bstep}",
            "add {b1}, {bstep}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c} + {ldc}*1], tmm4",
            "lea {t}, [{c} + 64]",
            "tilestored [{t} + {ldc}*1], tmm5",
            "mov {t}, {ldc}",
            "shl {t}, 4",
            "add {t}, {c}",
            "tilestored [{t} + {ldc}*1], tmm6",
            "add {t}, 64",
            "tilestored [{t} + {ldc}*1], tmm7",
            "tilerelease",
            cfg = in(reg) &cfg,
            a0 = inout(reg) a.as_ptr() => _,
            a1 = inout(reg) a.as_ptr().add(16 * lda) => _,
            b0 = inout(reg) b.as_ptr() => _,
            b1 = inout(reg) b.as_ptr().add(16) => _,
            lda = in(reg) lda * 2,
            ldb = in(reg) ldb * 4,
            bstep = in(reg) 16 * ldb * 4,
            steps = inout(reg) kdim / STEP => _,
            c = in(reg) c.as_mut_ptr(),
            ldc = in(reg) ldc * 4,
            t = out(reg) _,
            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
            options(nostack)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    fn bf(x: f32) -> bf16 {
        bf16::from_f32(x)
    }

    /// Random bf16 of varied magnitude (2^-20 .. 2^20) and sign.
    fn values(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| {
                let e: i32 = rng.random_range(-20..20);
                let m: f32 = rng.random_range(1.0..2.0);
                bf(if rng.random::<bool>() { m } else { -m } * (e as f32).exp2())
            })
            .collect()
    }

    /// C (m × n) through the twin: A (m × 2k) row-major, B (2k × n) row-major packed.
    fn twin(m: usize, k: usize, n: usize, c0: &[f32], a: &[bf16], b: &[bf16]) -> Vec<f32> {
        let packed = pack_b_pairs(b, 2 * k, n);
        let at = Tile::load_bf16(m, 2 * k, a, 2 * k).unwrap();
        let bt = Tile::load_pairs(k, n, &packed, n).unwrap();
        let mut ct = Tile::load(m, 4 * n, bytemuck::cast_slice(c0), 4 * n).unwrap();
        ct.dpbf16ps(&at, &bt).unwrap();
        let mut out = vec![0f32; m * n];
        ct.store(bytemuck::cast_slice_mut(&mut out), 4 * n).unwrap();
        out
    }

    #[test]
    fn the_twin_is_a_product_within_f32_rounding() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (m, k, n) in [(16, 16, 16), (3, 5, 7), (1, 1, 1), (16, 1, 16), (9, 16, 2)] {
            let (a, b) = (values(&mut rng, m * 2 * k), values(&mut rng, 2 * k * n));
            let c0: Vec<f32> = values(&mut rng, m * n).iter().map(|x| x.to_f32()).collect();
            let got = twin(m, k, n, &c0, &a, &b);
            for i in 0..m {
                for j in 0..n {
                    let terms: Vec<f64> =
                        (0..2 * k).map(|p| a[i * 2 * k + p].to_f64() * b[p * n + j].to_f64()).collect();
                    let exact = c0[i * n + j] as f64 + terms.iter().sum::<f64>();
                    let scale = c0[i * n + j].abs() as f64 + terms.iter().map(|t| t.abs()).sum::<f64>();
                    // 2k + 2 rounded steps at most, each within half an ulp of the running sums.
                    let bound = (2 * k + 2) as f64 * f32::EPSILON as f64 * scale;
                    assert!((got[i * n + j] as f64 - exact).abs() <= bound, "({m},{k},{n}) [{i}][{j}]");
                }
            }
        }
    }

    #[test]
    fn a_misplaced_pair_fails_the_product() {
        // The layout is what makes the product: swapping the halves of the pairs, or packing
        // B by columns, gives another matrix (what a planted packing bug would do).
        let (m, k, n) = (4, 3, 5);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (a, b) = (values(&mut rng, m * 2 * k), values(&mut rng, 2 * k * n));
        let good = twin(m, k, n, &vec![0.0; m * n], &a, &b);
        let swapped: Vec<u32> = pack_b_pairs(&b, 2 * k, n).iter().map(|p| p.rotate_left(16)).collect();
        let mut c = Tile::zeroed(m, 4 * n).unwrap();
        c.dpbf16ps(&Tile::load_bf16(m, 2 * k, &a, 2 * k).unwrap(), &Tile::load_pairs(k, n, &swapped, n).unwrap())
            .unwrap();
        assert_ne!(c.f32_row(0), good[..n].to_vec());
        // Shapes the instruction refuses.
        let mut c = Tile::zeroed(m, 4 * n).unwrap();
        let a_tile = Tile::load_bf16(m, 2 * k, &a, 2 * k).unwrap();
        assert!(c.dpbf16ps(&a_tile, &Tile::zeroed(k + 1, 4 * n).unwrap()).is_err());
        assert!(c.dpbf16ps(&Tile::zeroed(m + 1, 4 * k).unwrap(), &Tile::zeroed(k, 4 * n).unwrap()).is_err());
        assert!(TileConfig::new(&[(17, 64)]).is_err() && TileConfig::new(&[(16, 66)]).is_err());
        assert!(Tile::load(2, 8, &[0u8; 11], 4).is_err());
    }

    #[test]
    fn denormal_inputs_read_as_zero_and_results_flush() {
        let tiny = bf16::from_bits(0x0001); // the smallest bf16 denormal
        let mut c = Tile::zeroed(1, 4).unwrap();
        let a = Tile::load_bf16(1, 2, &[tiny, bf(1.0)], 2).unwrap();
        let b = Tile::load_pairs(1, 1, &pack_b_pairs(&[bf(1.0), bf(0.0)], 2, 1), 1).unwrap();
        c.dpbf16ps(&a, &b).unwrap();
        assert_eq!(c.f32_row(0)[0].to_bits(), 0);
        // 2^-100 · 2^-40 underflows past f32's normals: flushed to +0.
        let mut c = Tile::zeroed(1, 4).unwrap();
        let a = Tile::load_bf16(1, 2, &[bf(2f32.powi(-100)), bf(0.0)], 2).unwrap();
        let b = Tile::load_pairs(1, 1, &pack_b_pairs(&[bf(2f32.powi(-40)), bf(0.0)], 2, 1), 1).unwrap();
        c.dpbf16ps(&a, &b).unwrap();
        assert_eq!(c.f32_row(0)[0].to_bits(), 0);
    }

    #[test]
    fn the_block_kernel_is_the_product_on_either_engine() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for kdim in [32, 64, 128] {
            // A with a row stride wider than its rows, B packed with a wider stride too.
            let (lda, ldb, ldc) = (kdim + 8, 40, 36);
            let a = values(&mut rng, BLOCK * lda);
            let b = values(&mut rng, kdim * BLOCK);
            let mut packed = vec![0u32; kdim / 2 * ldb];
            for (r, row) in pack_b_pairs(&b, kdim, BLOCK).chunks(BLOCK).enumerate() {
                packed[r * ldb..r * ldb + BLOCK].copy_from_slice(row);
            }
            let run = |engine| {
                let mut c = vec![f32::NAN; BLOCK * ldc];
                let ran = block_product(kdim, &mut c, ldc, &a, lda, &packed, ldb, engine).unwrap();
                (c, ran)
            };
            let (twin, ran) = run(BlockEngine::Twin);
            assert_eq!(ran, BlockEngine::Twin);
            for i in 0..BLOCK {
                for j in 0..BLOCK {
                    let terms: Vec<f64> =
                        (0..kdim).map(|p| a[i * lda + p].to_f64() * b[p * BLOCK + j].to_f64()).collect();
                    let scale: f64 = terms.iter().map(|t| t.abs()).sum();
                    let err = (twin[i * ldc + j] as f64 - terms.iter().sum::<f64>()).abs();
                    assert!(err <= (kdim + 2) as f64 * f32::EPSILON as f64 * scale, "kdim {kdim} [{i}][{j}]");
                }
                // The stride's padding is left alone.
                assert!(twin[i * ldc + BLOCK..(i + 1) * ldc].iter().all(|x| x.is_nan()) || i == BLOCK - 1);
            }
            let (tiles, ran) = run(BlockEngine::Tiles);
            assert_eq!(ran == BlockEngine::Tiles, available());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&tiles), bits(&twin), "kdim {kdim}: {ran:?} against the twin");
        }
        let mut c = vec![0.0; BLOCK * BLOCK];
        let a = vec![bf(0.0); BLOCK * 48];
        assert!(block_product(48, &mut c, BLOCK, &a, 48, &[0; 24 * BLOCK], BLOCK, BlockEngine::Twin).is_err());
        assert!(block_product(32, &mut c[1..], BLOCK, &a, 48, &[0; 16 * BLOCK], BLOCK, BlockEngine::Twin).is_err());
    }

    /// On a processor with AMX: the real instruction against the twin, bit for bit, on random
    /// products, cancellations that tell the SDM's two-chain order from a single chain, and
    /// denormals. Without AMX the instruction cannot run; the twin's own tests above still do.
    #[test]
    fn the_silicon_matches_the_twin_bit_for_bit() {
        if !available() {
            eprintln!("no AMX on this processor (or no permission): the hardware comparison did not run");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        // (m, k pairs, n, C, A, B)
        type Case = (usize, usize, usize, Vec<f32>, Vec<bf16>, Vec<bf16>);
        let mut cases: Vec<Case> = Vec::new();
        for (m, k, n) in [(16, 16, 16), (5, 3, 7), (1, 1, 1), (16, 8, 4)] {
            for _ in 0..20 {
                let c0: Vec<f32> = values(&mut rng, m * n).iter().map(|x| x.to_f32()).collect();
                cases.push((m, k, n, c0, values(&mut rng, m * 2 * k), values(&mut rng, 2 * k * n)));
            }
        }
        // Cancellation: 2^24 and −2^24 in the even halves, ones in the odd halves, C = 1. The
        // SDM's two chains give 1 + (0 + 2) = 3; the intrinsics guide's single chain into C
        // (every product added to C in k order) loses the ones against 2^24 and gives 1.
        let a = vec![bf(1.0); 4];
        let b = [2f32.powi(24), 1.0, -(2f32.powi(24)), 1.0].map(bf).to_vec();
        let single_chain = (0..4).fold(1.0f32, |c, p| a[p].to_f32().mul_add(b[p].to_f32(), c));
        assert_eq!((single_chain, twin(1, 2, 1, &[1.0], &a, &b)[0]), (1.0, 3.0));
        cases.push((1, 2, 1, vec![1.0], a, b));
        // Denormal inputs, products that underflow, and a C that is denormal.
        let den = [
            bf16::from_bits(0x0001),
            bf16::from_bits(0x807f),
            bf(2f32.powi(-70)),
            bf(2f32.powi(-64)),
            bf(1.0),
            bf(-1.5),
        ];
        cases.push((1, 3, 1, vec![f32::from_bits(0x0000_0003)], den.to_vec(), den.iter().rev().copied().collect()));
        for (i, (m, k, n, c0, a, b)) in cases.into_iter().enumerate() {
            let want = twin(m, k, n, &c0, &a, &b);
            let mut got = c0.clone();
            dpbf16ps_on_tiles((m, k, n), &mut got, n, &a, 2 * k, &pack_b_pairs(&b, 2 * k, n), n).unwrap().unwrap();
            let (g, w): (Vec<u32>, Vec<u32>) =
                (got.iter().map(|x| x.to_bits()).collect(), want.iter().map(|x| x.to_bits()).collect());
            assert_eq!(g, w, "case {i} ({m} × {k} pairs × {n}): silicon {got:?}, twin {want:?}");
        }
    }
}
