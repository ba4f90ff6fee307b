//! The kernels of `cuda/*.cu` by their entry-point names, run on the emulator as a CUDA
//! driver launches them: the interface of the stand-in driver (`emulated-gpu/`, a
//! `libcuda.so.1` that runs the crate's real GPU host path on the CPU). Each entry lists its
//! params struct's size and alignment and where its tensor maps sit (`cuda/emu/named.h`);
//! [`launch_named`] copies a params block into a 128-byte aligned parameter space, registers
//! the given device allocations for the emulator's bounds checks, runs the kernel and reports,
//! per allocation, the byte ranges the launch read and wrote.
//!
//! ```
//! let k = ringattn::emu::named::find("ringattn_merge_f32").expect("merge is a kernel");
//! assert_eq!((k.family, k.param_bytes), ("merge", 88));
//! assert!(ringattn::emu::named::find("no_such_kernel").is_none());
//! ```

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use super::{check, EmuLaunch};
use crate::{Error, Result};

/// `EmuNamedKernel` of `cuda/emu/named.h`.
#[repr(C)]
#[derive(Debug)]
struct RawKernel {
    name: *const c_char,
    param_bytes: u32,
    param_align: u32,
    tensor_maps: u32,
    tensor_map_offsets: [u32; 6],
    run: *const c_void,
}
const _: () = assert!(std::mem::size_of::<RawKernel>() == 56);

/// `EmuGlobal` of `cuda/emu/named.h`: one device allocation of a launch and what it did there.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GlobalAccess {
    /// Address of the allocation (a host address: the emulated device memory).
    pub base: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// Lowest byte offset read (above `read_hi` when nothing was read).
    pub read_lo: u64,
    /// One past the highest byte offset read.
    pub read_hi: u64,
    /// Lowest byte offset written (above `write_hi` when nothing was written).
    pub write_lo: u64,
    /// One past the highest byte offset written.
    pub write_hi: u64,
}
const _: () = assert!(std::mem::size_of::<GlobalAccess>() == 48);

impl GlobalAccess {
    /// The allocation `[base, base + bytes)`, nothing recorded yet.
    pub fn new(base: u64, bytes: u64) -> Self {
        GlobalAccess { base, bytes, ..Default::default() }
    }

    /// The byte range `[lo, hi)` (offsets into the allocation) the launch read, if any.
    pub fn read(&self) -> Option<(u64, u64)> {
        (self.read_lo < self.read_hi).then_some((self.read_lo, self.read_hi))
    }

    /// The byte range the launch wrote, if any.
    pub fn written(&self) -> Option<(u64, u64)> {
        (self.write_lo < self.write_hi).then_some((self.write_lo, self.write_hi))
    }
}

extern "C" {
    fn ringattn_emu_named_flash_fwd(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_named_flash_bwd(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_named_flash_fwd_hopper(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_named_flash_bwd_hopper(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_named_merge(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_named_ops(n: *mut usize) -> *const RawKernel;
    fn ringattn_emu_launch_named(
        k: *const RawKernel,
        params: *const c_void,
        l: EmuLaunch,
        globals: *mut GlobalAccess,
        n: usize,
        msg: *mut c_char,
        cap: usize,
    ) -> i32;
}

/// One kernel entry point as the emulator runs it.
#[derive(Debug)]
pub struct NamedKernel {
    /// The `extern "C"` name, as in the cubins (`ringattn_flash_fwd_bf16_d64`).
    pub name: &'static str,
    /// Its family: the `cuda/*.cu` file (`flash_fwd`, `ops`, ...).
    pub family: &'static str,
    /// Bytes of its one parameter (the params struct).
    pub param_bytes: usize,
    /// Alignment of the params struct.
    pub param_align: usize,
    /// Offsets of the tensor maps inside the params struct (empty but for the Hopper family).
    pub tensor_map_offsets: Vec<usize>,
    raw: *const RawKernel,
}

// SAFETY: `raw` points into a static table of the emulator library, never written.
unsafe impl Send for NamedKernel {}
// SAFETY: as above.
unsafe impl Sync for NamedKernel {}

/// Every kernel entry point of `cuda/*.cu`.
pub fn kernels() -> &'static [NamedKernel] {
    static ALL: OnceLock<Vec<NamedKernel>> = OnceLock::new();
    ALL.get_or_init(|| {
        type Table = unsafe extern "C" fn(*mut usize) -> *const RawKernel;
        let tables: [(&'static str, Table); 6] = [
            ("flash_fwd", ringattn_emu_named_flash_fwd),
            ("flash_bwd", ringattn_emu_named_flash_bwd),
            ("flash_fwd_hopper", ringattn_emu_named_flash_fwd_hopper),
            ("flash_bwd_hopper", ringattn_emu_named_flash_bwd_hopper),
            ("merge", ringattn_emu_named_merge),
            ("ops", ringattn_emu_named_ops),
        ];
        let mut out = Vec::new();
        for (family, table) in tables {
            let mut n = 0usize;
            // SAFETY: the table functions return a static array and its length.
            let base = unsafe { table(&mut n) };
            for i in 0..n {
                // SAFETY: `i < n` entries of a static array; names are static C strings.
                let raw = unsafe { &*base.add(i) };
                let name = unsafe { CStr::from_ptr(raw.name) }.to_str().unwrap_or("?");
                let maps = raw.tensor_maps.min(6) as usize;
                out.push(NamedKernel {
                    name,
                    family,
                    param_bytes: raw.param_bytes as usize,
                    param_align: raw.param_align as usize,
                    tensor_map_offsets: raw.tensor_map_offsets[..maps].iter().map(|&o| o as usize).collect(),
                    raw,
                });
            }
        }
        out
    })
}

/// The kernel named `name`, if `cuda/*.cu` defines it.
pub fn find(name: &str) -> Option<&'static NamedKernel> {
    kernels().iter().find(|k| k.name == name)
}

/// Geometry of a named launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NamedLaunch {
    /// Blocks per grid dimension.
    pub grid: [u32; 3],
    /// Threads per block (one-dimensional: every kernel of the crate uses `threadIdx.x`).
    pub block: u32,
    /// Dynamic shared memory per block, bytes.
    pub smem_bytes: u64,
    /// OS threads the blocks are spread over (0: one per core).
    pub workers: u32,
}

/// Runs `k` with `params` (its parameter space: at least [`NamedKernel::param_bytes`] bytes)
/// over `globals`, the device allocations it may touch; each entry of `globals` comes back
/// with the byte ranges the launch read and wrote there.
///
/// # Errors
/// [`Error::InvalidArgument`] for a params block shorter than the kernel's parameter;
/// [`Error::Kernel`] with the emulator's report for anything the kernel did wrong (an access
/// outside every allocation, a race in shared memory, a deadlock, ...).
///
/// # Safety
/// Every entry of `globals` must be live memory of its stated size for the whole call, and
/// the addresses inside `params` must point into them (the kernel's accesses are checked
/// against `globals`, not against the process's memory).
pub unsafe fn launch_named(k: &NamedKernel, params: &[u8], l: NamedLaunch, globals: &mut [GlobalAccess]) -> Result<()> {
    if params.len() < k.param_bytes {
        return Err(Error::InvalidArgument(format!(
            "{}: {} bytes of parameters, the kernel takes {}",
            k.name,
            params.len(),
            k.param_bytes
        )));
    }
    let launch = EmuLaunch {
        grid: l.grid,
        block: l.block,
        smem_bytes: l.smem_bytes,
        schedule: 0,
        workers: l.workers,
        seed: 0,
        block_counts: 0,
    };
    let mut msg = [0u8; 1024];
    // SAFETY: `k.raw` is a static table entry; `params` holds the kernel's parameter bytes;
    // `globals` is a live array of `globals.len()` entries the call fills in; the caller
    // vouches (this function's contract) that every allocation in it is live memory.
    let code = unsafe {
        ringattn_emu_launch_named(
            k.raw,
            params.as_ptr().cast(),
            launch,
            globals.as_mut_ptr(),
            globals.len(),
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    check(code, &msg, k.name)
}
