//! Finding the CUDA driver without panicking: cudarc 0.19 panics on its first driver call when
//! `libcuda` cannot be loaded, so [`probe`] checks for the library first and turns every other
//! failure (no GPU, an old driver, a missing symbol) into [`Error::Cuda`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::{result, sys, DriverError};

use crate::{Error, Result};

/// Oldest driver API the bindings are used with: cudarc's `cuda-13000` bindings call
/// `cuEventElapsedTime_v2`, added in CUDA 12.8. The kernels themselves (nvcc 13.0 cubins, PTX
/// ISA 9.0) need a CUDA 13.0 driver; an older one fails at module load with a message saying
/// so.
const OLDEST_DRIVER: i32 = 12080;

/// What [`probe`] found: a loadable driver and at least one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as `1000 · major + 10 · minor` (13000 for 13.0).
    pub driver_version: i32,
    /// GPUs the driver reports (at least 1).
    pub device_count: usize,
}

impl DriverInfo {
    /// The driver's CUDA version as `major.minor`.
    pub fn version(&self) -> String {
        version_string(self.driver_version)
    }
}

pub(crate) fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Checks, once per process, that the CUDA driver library loads, initialises and reports at
/// least one GPU. Every entry point of [`crate::cuda`] calls it first, so none of them
/// panics on a machine without CUDA.
///
/// # Errors
/// [`Error::Cuda`] whose message starts with `no CUDA driver found` (libcuda cannot be
/// loaded) or `no CUDA GPU found` (the driver reports no device), or names the driver call
/// that failed (a driver older than CUDA 12.8, a driver that fails to initialise).
///
/// ```
/// match ringattn::cuda::probe() {
///     Ok(info) => println!("CUDA {} driver, {} GPU(s)", info.version(), info.device_count),
///     Err(e) => println!("no GPU here: {e}"),
/// }
/// ```
pub fn probe() -> Result<DriverInfo> {
    static PROBE: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();
    PROBE.get_or_init(run_probe).clone().map_err(Error::Cuda)
}

fn run_probe() -> std::result::Result<DriverInfo, String> {
    // SAFETY: `is_culib_present` dlopens each candidate name of libcuda and closes it again;
    // loading the driver library runs its initialisers, as any use of CUDA does.
    let present = guard("loading libcuda", || Ok(unsafe { sys::is_culib_present() })).map_err(|e| e.to_string())?;
    if !present {
        return Err("no CUDA driver found: the driver library (libcuda.so.1) could not be loaded; install the \
                    NVIDIA driver, or add the directory that holds libcuda.so.1 to LD_LIBRARY_PATH"
            .into());
    }
    let info = guard("cuInit", || {
        if let Err(e) = result::init() {
            return Ok(Err(match e.0 {
                sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => {
                    "no CUDA GPU found: the driver reports no device (CUDA_ERROR_NO_DEVICE)".to_string()
                }
                _ => format!("the CUDA driver failed to initialise: {}", driver_error(e)),
            }));
        }
        let mut version = 0;
        // SAFETY: cuDriverGetVersion writes one int through the pointer, which is valid.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
        let count = result::device::get_count()?;
        Ok(Ok(DriverInfo { driver_version: version, device_count: count.max(0) as usize }))
    })
    .map_err(|e| e.to_string())??;
    if info.device_count == 0 {
        return Err("no CUDA GPU found: the driver reports 0 devices".into());
    }
    if info.driver_version < OLDEST_DRIVER {
        return Err(format!(
            "the CUDA driver supports CUDA {}, older than the {} this build needs (the kernels were built \
             with nvcc 13.0: update to a CUDA 13.0 driver, R580 or newer)",
            info.version(),
            version_string(OLDEST_DRIVER)
        ));
    }
    Ok(info)
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub(crate) fn driver_error(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// Runs driver calls `f`, turning a driver error into [`Error::Cuda`] naming `what`, and a
/// panic of cudarc (a library or symbol it could not load) into the same error instead of
/// unwinding through the caller.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, DriverError>) -> Result<T> {
    unwind(what, f)?.map_err(|e| Error::Cuda(format!("{what}: {}", driver_error(e))))
}

/// Runs `f`, turning a panic of cudarc into [`Error::Cuda`] naming `what`.
pub(crate) fn unwind<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Error::Cuda(format!("{what}: the driver library could not be used: {msg}"))
    })
}
