//! A stand-in CUDA driver (`libcuda.so.1`) backed by ringattn's kernel emulator: the crate's
//! real GPU host path — cudarc, `ringattn::cuda`, the device backend and its communicators —
//! runs on the CPU, against a driver as strict as the real one where it matters:
//!
//! * **Streams run asynchronously**, a worker thread each: host code that forgets a
//!   synchronisation reads stale data or races. Ordering is tracked with vector clocks
//!   (event waits, the legacy stream's barriers, host synchronisations); two accesses to the
//!   same bytes on different streams, one a write, with nothing ordering them are reported
//!   as a **cross-stream race** naming both operations, and become the context's sticky
//!   error (as the real GPU's corrupted results would be an error once found).
//! * **Limits**: the device reports an H200's attributes (compute capability 9.0, 132 SMs,
//!   48 KiB default and 227 KiB opt-in dynamic shared memory, grid y/z ≤ 65535, 64 Ki
//!   registers per block); `cuLaunchKernel` refuses what the real driver refuses (grid and
//!   block limits, `__launch_bounds__`, registers, shared memory beyond the function's limit),
//!   and checks every tensor map's place in the parameter space (a 128-byte multiple).
//! * **Images**: `cuModuleLoadData` reads cubins (ELF: architecture, kernels, parameter
//!   layout from `.nv.info`), PTX and fatbins, and refuses what does not run on the emulated
//!   architecture; a kernel runs as the emulator's entry of the same name (its parameter
//!   size checked against the emulator's params struct).
//! * **Errors are sticky** per context, as on the real driver: a kernel's out-of-bounds
//!   access (the emulator's checks, against the allocations its parameters point into)
//!   becomes `CUDA_ERROR_ILLEGAL_ADDRESS` for every later call. `cuGetErrorString` carries
//!   what the emulated GPU saw.
//!
//! * **NCCL** ([`nccl`]): the same library answers as `libnccl.so.2` (so that NCCL's work
//!   runs in the driver's stream queues): communicators across processes and threads over
//!   loopback TCP, point-to-point calls in groups, all-reduce and broadcast, non-blocking
//!   initialisation and split, abort.
//!
//! `scripts/with-emulated-gpu CMD ...` builds this library and runs CMD with it first on the
//! library path; `RINGATTN_EMU_GPU_LOG=FILE` logs every module load and kernel launch (name,
//! geometry, stream). Device names carry [`device::EMULATED_MARK`], so that `ringattn
//! doctor` and the benchmarks say plainly that the GPU is emulated: no figure measured here is
//! a GPU figure.

pub mod api;
pub mod codes;
pub mod device;
pub mod image;
pub mod launch;
pub mod nccl;
pub mod race;
pub mod runtime;
