//! Finding the CUDA driver without panicking: cudarc 0.19 panics on its first driver call when
//! `libcuda` cannot be loaded, so [`probe`] checks for the library first and turns every other
//! failure (no GPU, an old driver, a missing symbol) into [`Error::Cuda`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::{result, sys, DriverError};

use crate::{Error, Result};

/// Oldest driver API the bindings are used with: cudarc's `cuda-13000` bindings call
/// `cuEventElapsedTime_v2`, added in CUDA 12.8.
const OLDEST_BINDINGS: i32 = 12080;

/// The oldest driver this build runs on, as `1000 · major + 10 · minor`: the CUDA version of
/// the nvcc that built the embedded kernels (13.0 → 13000; their cubins and PTX load on no
/// older driver), and never below what the bindings call (12.8).
///
/// ```
/// assert!(ringattn::cuda::required_driver_version() >= 12080);
/// ```
pub fn required_driver_version() -> i32 {
    let images = crate::kernels::cuda_version().map_or(0, |(major, minor)| 1000 * major + 10 * minor);
    images.max(OLDEST_BINDINGS)
}

/// The first NVIDIA driver branch that supports CUDA `v` (`1000 · major + 10 · minor`), for
/// messages: 13.0 → `R580`.
pub(crate) fn driver_branch(v: i32) -> Option<&'static str> {
    // Only releases whose first driver branch is known; others get the CUDA version alone.
    const BRANCHES: [(i32, &str); 4] = [(12080, "R570"), (12090, "R575"), (13000, "R580"), (13010, "R590")];
    BRANCHES.iter().find(|(cuda, _)| *cuda == v).map(|(_, b)| *b)
}

/// What to install for a driver older than `required`.
pub(crate) fn driver_advice(required: i32) -> String {
    match driver_branch(required) {
        Some(b) => format!("an NVIDIA driver of the {b} branch or newer (CUDA {})", version_string(required)),
        None => format!("an NVIDIA driver that supports CUDA {} or newer", version_string(required)),
    }
}

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

/// What the driver reports, before [`probe`]'s checks: its CUDA version and device count
/// even when the driver is too old for this build or no GPU is visible (`ringattn doctor`
/// shows them).
///
/// # Errors
/// [`Error::Cuda`] when libcuda cannot be loaded or initialised (the message of [`probe`]).
pub fn driver_facts() -> Result<DriverInfo> {
    facts().clone().map_err(Error::Cuda)
}

fn facts() -> &'static std::result::Result<DriverInfo, String> {
    static FACTS: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();
    FACTS.get_or_init(read_driver)
}

fn run_probe() -> std::result::Result<DriverInfo, String> {
    facts().clone().and_then(check)
}

/// The names the driver library is installed under.
const LIBCUDA: &[&str] = if cfg!(windows) { &["nvcuda.dll"] } else { &["libcuda.so.1", "libcuda.so"] };

/// Whether the driver library can be loaded (checked by ringattn itself: cudarc's own check
/// exists only when it loads libcuda at run time, not when another crate of the build links
/// it).
fn libcuda_present() -> bool {
    LIBCUDA.iter().any(|name| {
        // SAFETY: loading the driver library runs its initialisers, as any use of CUDA does;
        // the handle is closed again at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

fn read_driver() -> std::result::Result<DriverInfo, String> {
    let present = guard("loading libcuda", || Ok(libcuda_present())).map_err(|e| e.to_string())?;
    if !present {
        return Err("no CUDA driver found: the driver library (libcuda.so.1) could not be loaded; install the \
                    NVIDIA driver, or add the directory that holds libcuda.so.1 to LD_LIBRARY_PATH"
            .into());
    }
    guard("cuInit", || {
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
    .map_err(|e| e.to_string())?
}

/// The checks of [`probe`] on what the driver reported: at least one GPU, a new enough driver.
fn check(info: DriverInfo) -> std::result::Result<DriverInfo, String> {
    if info.device_count == 0 {
        return Err("no CUDA GPU found: the driver reports 0 devices".into());
    }
    let required = required_driver_version();
    if info.driver_version < required {
        return Err(old_driver_message(info.driver_version, required));
    }
    Ok(info)
}

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Ordinal among the visible devices (`CUDA_VISIBLE_DEVICES` applies).
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability `(major, minor)`: `(9, 0)` on H100/H200.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub memory_bytes: usize,
}

/// The GPUs the driver reports (no context is created).
///
/// # Errors
/// [`Error::Cuda`] without a usable driver ([`driver_facts`]), or when a query fails.
///
/// ```
/// match ringattn::cuda::gpus() {
///     Ok(list) => list.iter().for_each(|g| println!("{} {:?}", g.name, g.compute_capability)),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn gpus() -> Result<Vec<GpuInfo>> {
    let facts = driver_facts()?;
    (0..facts.device_count)
        .map(|ordinal| {
            guard("reading the device's properties", || {
                let dev = result::device::get(ordinal as i32)?;
                let name = result::device::get_name(dev)?;
                let attr = |a| {
                    // SAFETY: `dev` is a valid device handle; one int is read.
                    unsafe { result::device::get_attribute(dev, a) }
                };
                let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                // SAFETY: `dev` is a valid device handle.
                let memory_bytes = unsafe { result::device::total_mem(dev) }?;
                Ok(GpuInfo { ordinal, name, compute_capability: (major, minor), memory_bytes })
            })
        })
        .collect()
}

/// The message for a driver that supports CUDA `found`, older than `required`.
pub(crate) fn old_driver_message(found: i32, required: i32) -> String {
    format!(
        "the CUDA driver supports CUDA {}, older than the CUDA {} this build needs (its kernels were built with \
         nvcc {}): install {}",
        version_string(found),
        version_string(required),
        version_string(required),
        driver_advice(required)
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_driver_is_told_which_driver_to_install() {
        let m = old_driver_message(12040, 13000);
        assert!(m.contains("CUDA 12.4") && m.contains("CUDA 13.0") && m.contains("R580"), "{m}");
        assert!(old_driver_message(12080, 13070).contains("supports CUDA 13.7 or newer"));
        assert_eq!(driver_branch(12080), Some("R570"));
        if let Some((major, minor)) = crate::kernels::cuda_version() {
            assert_eq!(required_driver_version(), (1000 * major + 10 * minor).max(12080));
        } else {
            assert_eq!(required_driver_version(), 12080);
        }
    }
}
