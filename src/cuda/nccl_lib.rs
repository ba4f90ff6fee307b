//! Finding and loading NCCL at run time, under the names it is really installed with.
//!
//! cudarc 0.19's loader tries `libnccl.so` and `libnccl.so.{13,12,11,10,9,1}` but never
//! `libnccl.so.2`, the file that the PyPI wheels (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`) and
//! the distributions' `libnccl2` packages ship; so ringattn loads NCCL itself
//! ([`libloading`], the same loader cudarc uses) and calls it through the function pointers of
//! [`NcclLibrary`]. The C types are ringattn's own (`nccl_sys.rs`).
//!
//! Search order ([`nccl_candidates`]):
//! 1. `$RINGATTN_NCCL`, else `$NCCL_LIBRARY`: a library file, or a folder holding
//!    `libnccl.so.2` / `libnccl.so`. When set, nothing else is tried (an explicit choice that
//!    fails is an error, never a silent fallback to another NCCL).
//! 2. `libnccl.so.2`, then `libnccl.so`, through the dynamic loader (`LD_LIBRARY_PATH`, the
//!    `ldconfig` cache, the system folders).
//! 3. The folders NCCL is commonly installed in without being on the loader's path:
//!    `$NCCL_HOME/lib`, `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `$CONDA_PREFIX/lib`, the
//!    `nvidia/nccl/lib` folder of the Python environments of `$VIRTUAL_ENV`, `$CONDA_PREFIX`
//!    and the system (`/usr/local/lib/python3*/{site,dist}-packages`,
//!    `/usr/lib/python3*/{site,dist}-packages`), and `/usr/local/cuda/lib64`.
//!
//! The first candidate that loads, has every symbol ringattn calls and is NCCL 2.18 or newer
//! (`ncclCommSplit`, the non-blocking configuration) is used for the whole process. Loading
//! NCCL needs no GPU (`ncclGetVersion` works without one), which is how this is tested.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::nccl_sys as sys;

use crate::{Error, Result};

/// The oldest NCCL ringattn uses: 2.18 (`ncclCommSplit`, `ncclConfig_t.splitShare`).
pub const OLDEST_NCCL: NcclVersion = NcclVersion { major: 2, minor: 18, patch: 0 };

/// An NCCL release, decoded from `ncclGetVersion`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major (2).
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s code: `major·10000 + minor·100 + patch` from NCCL 2.9 on,
    /// `major·1000 + minor·100 + patch` before.
    ///
    /// ```
    /// use ringattn::cuda::NcclVersion;
    /// assert_eq!(NcclVersion::from_code(23203).to_string(), "2.32.3");
    /// assert_eq!(NcclVersion::from_code(2804).to_string(), "2.8.4");
    /// ```
    pub fn from_code(code: i32) -> NcclVersion {
        let c = code.max(0) as u32;
        if c >= 10000 {
            NcclVersion { major: c / 10000, minor: (c % 10000) / 100, patch: c % 100 }
        } else {
            NcclVersion { major: c / 1000, minor: (c % 1000) / 100, patch: c % 100 }
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Which NCCL this process uses: the file the loader opened and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// The library file (resolved through the loader when found by name).
    pub path: PathBuf,
    /// Its version.
    pub version: NcclVersion,
    /// Every candidate tried before it, with why it was not taken.
    pub tried: Vec<String>,
}

type Res = sys::ncclResult_t;

/// A loaded NCCL: the library (kept loaded for the process) and the functions ringattn calls.
pub(crate) struct NcclLibrary {
    _lib: libloading::Library,
    pub info: NcclInfo,
    pub get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> Res,
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, sys::ncclUniqueId, c_int, *mut sys::ncclConfig_t) -> Res,
    pub comm_get_async_error: unsafe extern "C" fn(sys::ncclComm_t, *mut Res) -> Res,
    pub comm_abort: unsafe extern "C" fn(sys::ncclComm_t) -> Res,
    pub comm_destroy: unsafe extern "C" fn(sys::ncclComm_t) -> Res,
    pub group_start: unsafe extern "C" fn() -> Res,
    pub group_end: unsafe extern "C" fn() -> Res,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        sys::ncclDataType_t,
        c_int,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Res,
    pub recv:
        unsafe extern "C" fn(*mut c_void, usize, sys::ncclDataType_t, c_int, sys::ncclComm_t, sys::cudaStream_t) -> Res,
    pub comm_split:
        unsafe extern "C" fn(sys::ncclComm_t, c_int, c_int, *mut sys::ncclComm_t, *mut sys::ncclConfig_t) -> Res,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        sys::ncclRedOp_t,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Res,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        sys::ncclDataType_t,
        c_int,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> Res,
    pub comm_user_rank: unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> Res,
    pub comm_count: unsafe extern "C" fn(sys::ncclComm_t, *mut c_int) -> Res,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary").field("info", &self.info).finish()
    }
}

impl NcclLibrary {
    /// The text of a result code (`ncclGetErrorString`).
    pub fn error_text(&self, r: Res) -> String {
        // SAFETY: ncclGetErrorString takes any code and returns a static NUL-terminated
        // string (or null).
        let p = unsafe { (self.get_error_string)(r) };
        if p.is_null() {
            return format!("{r:?}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        format!("{r:?} ({})", unsafe { CStr::from_ptr(p) }.to_string_lossy())
    }
}

/// The library names tried in a folder and through the loader, best first.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Every place NCCL is looked for, in order (see the module docs), through `var` (the
/// environment, or a test's map). Folder candidates are listed only where the folder exists;
/// bare names go through the dynamic loader.
///
/// ```
/// let c = ringattn::cuda::nccl_candidates(|_| None);
/// assert_eq!(&c[..2], ["libnccl.so.2", "libnccl.so"]);
/// let only = ringattn::cuda::nccl_candidates(|k| (k == "RINGATTN_NCCL").then(|| "/opt/nccl/libnccl.so.2".into()));
/// assert_eq!(only, ["/opt/nccl/libnccl.so.2"]);
/// ```
pub fn nccl_candidates(var: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
    let in_folder = |dir: &Path| NAMES.iter().map(|n| dir.join(n).display().to_string()).collect::<Vec<_>>();
    for key in ["RINGATTN_NCCL", "NCCL_LIBRARY"] {
        if let Some(v) = var(key) {
            let p = PathBuf::from(v.trim());
            return if p.is_dir() { in_folder(&p) } else { vec![p.display().to_string()] };
        }
    }
    let mut out: Vec<String> = NAMES.iter().map(|n| n.to_string()).collect();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (key, sub) in [("NCCL_HOME", "lib"), ("CUDA_HOME", "lib64"), ("CUDA_PATH", "lib64"), ("CONDA_PREFIX", "lib")] {
        if let Some(v) = var(key) {
            dirs.push(Path::new(&v).join(sub));
        }
    }
    let mut python_roots: Vec<PathBuf> = Vec::new();
    for key in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = var(key) {
            python_roots.extend(python_lib_dirs(&Path::new(&v).join("lib")));
        }
    }
    python_roots.extend(python_lib_dirs(Path::new("/usr/local/lib")));
    python_roots.extend(python_lib_dirs(Path::new("/usr/lib")));
    for root in python_roots {
        for packages in ["site-packages", "dist-packages"] {
            dirs.push(root.join(packages).join("nvidia/nccl/lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for d in dirs {
        if d.is_dir() {
            for c in in_folder(&d) {
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// The `python3*` folders under `lib` (sorted, newest last).
fn python_lib_dirs(lib: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(lib)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3"))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Loads the first usable NCCL of `candidates` (bare names through the dynamic loader,
/// paths as they are; a path that does not exist is skipped).
///
/// # Errors
/// [`Error::Cuda`] starting `no NCCL library found`, listing every candidate tried and why it
/// was not taken (not found, a symbol missing, older than [`OLDEST_NCCL`]), and how to
/// point ringattn at one.
pub(crate) fn load_first(candidates: &[String]) -> Result<NcclLibrary> {
    let mut tried = Vec::new();
    for c in candidates {
        let is_path = c.contains('/');
        if is_path && !Path::new(c).exists() {
            tried.push(format!("{c} (not present)"));
            continue;
        }
        match load_one(c) {
            Ok(mut lib) => {
                if lib.info.version < OLDEST_NCCL {
                    tried.push(format!(
                        "{} (NCCL {}, older than the {OLDEST_NCCL} ringattn needs)",
                        lib.info.path.display(),
                        lib.info.version
                    ));
                    continue;
                }
                lib.info.tried = tried;
                return Ok(lib);
            }
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(Error::Cuda(format!(
        "no NCCL library found; tried {}. Install NCCL (the nvidia-nccl-cu13 wheel or the distribution's \
         libnccl2 package), add its folder to LD_LIBRARY_PATH, or set RINGATTN_NCCL to the library file or its \
         folder",
        tried.join("; ")
    )))
}

/// Opens one candidate and resolves every symbol.
fn load_one(spec: &str) -> std::result::Result<NcclLibrary, String> {
    // SAFETY: loading NCCL runs its initialisers, as any use of NCCL does; the library stays
    // loaded for as long as the returned value (the process, once cached).
    let lib = unsafe { libloading::Library::new(spec) }.map_err(|e| {
        let detail = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
        loader_text(&detail)
    })?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's function of that name, whose C signature is the
            // field's type (nccl.h, as cudarc's bindings describe it).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| format!("symbol {} missing", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym!("ncclGetVersion");
    let mut code: c_int = 0;
    // SAFETY: writes one int through a valid pointer; needs no GPU.
    let r = unsafe { get_version(&mut code) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetVersion failed: {r:?}"));
    }
    let path = library_path(get_version as *const c_void).unwrap_or_else(|| PathBuf::from(spec));
    let info = NcclInfo { path, version: NcclVersion::from_code(code), tried: Vec::new() };
    Ok(NcclLibrary {
        get_unique_id: sym!("ncclGetUniqueId"),
        get_error_string: sym!("ncclGetErrorString"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_abort: sym!("ncclCommAbort"),
        comm_destroy: sym!("ncclCommDestroy"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        comm_split: sym!("ncclCommSplit"),
        all_reduce: sym!("ncclAllReduce"),
        broadcast: sym!("ncclBroadcast"),
        comm_user_rank: sym!("ncclCommUserRank"),
        comm_count: sym!("ncclCommCount"),
        info,
        _lib: lib,
    })
}

/// The loader's message without the repeated file name prefix.
fn loader_text(e: &str) -> String {
    if e.contains("cannot open shared object file") {
        "not found".into()
    } else {
        e.to_string()
    }
}

/// The file that holds the code at `addr` (`dladdr`).
fn library_path(addr: *const c_void) -> Option<PathBuf> {
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and writes `info`.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, alive while the
    // library is loaded (it is: we hold it).
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let p = PathBuf::from(name);
    Some(std::fs::canonicalize(&p).unwrap_or(p))
}

/// The process's NCCL, loaded on first use from [`nccl_candidates`] of the environment.
///
/// # Errors
/// As [`load_first`]; the same error on every later call.
pub(crate) fn nccl() -> Result<&'static NcclLibrary> {
    static LIB: OnceLock<std::result::Result<NcclLibrary, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        load_first(&nccl_candidates(|k| std::env::var(k).ok())).map_err(|e| match e {
            Error::Cuda(m) => m,
            other => other.to_string(),
        })
    })
    .as_ref()
    .map_err(|e| Error::Cuda(e.clone()))
}

/// Which NCCL this process would use (loading it if needed; no GPU is touched).
///
/// # Errors
/// [`Error::Cuda`] starting `no NCCL library found`, listing the names and paths tried.
///
/// ```
/// match ringattn::cuda::nccl_info() {
///     Ok(n) => println!("NCCL {} at {}", n.version, n.path.display()),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn nccl_info() -> Result<NcclInfo> {
    nccl().map(|l| l.info.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode() {
        assert_eq!(NcclVersion::from_code(22805), NcclVersion { major: 2, minor: 28, patch: 5 });
        assert_eq!(NcclVersion::from_code(21803), NcclVersion { major: 2, minor: 18, patch: 3 });
        assert!(NcclVersion::from_code(21703) < OLDEST_NCCL);
        assert!(NcclVersion::from_code(21800) >= OLDEST_NCCL);
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
    }

    #[test]
    fn candidates_follow_the_search_order() {
        let dir = tempfile::tempdir().unwrap();
        let cuda = dir.path().join("cuda");
        std::fs::create_dir_all(cuda.join("lib64")).unwrap();
        let venv = dir.path().join("venv");
        let wheel = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&wheel).unwrap();
        let vars = |k: &str| match k {
            "CUDA_HOME" => Some(cuda.display().to_string()),
            "VIRTUAL_ENV" => Some(venv.display().to_string()),
            "CUDA_PATH" => Some(dir.path().join("absent").display().to_string()),
            _ => None,
        };
        let c = nccl_candidates(vars);
        assert_eq!(&c[..2], ["libnccl.so.2", "libnccl.so"]);
        let pos = |p: &Path| c.iter().position(|x| x == &p.display().to_string());
        let (cuda2, wheel2) = (pos(&cuda.join("lib64/libnccl.so.2")), pos(&wheel.join("libnccl.so.2")));
        assert!(cuda2.is_some() && wheel2.is_some() && cuda2 < wheel2, "{c:?}");
        assert_eq!(pos(&cuda.join("lib64/libnccl.so")), cuda2.map(|i| i + 1));
        assert!(!c.iter().any(|x| x.contains("absent")), "absent folders are not listed: {c:?}");
        // An override is the only candidate; a folder override lists its two names.
        let file = |k: &str| (k == "NCCL_LIBRARY").then(|| "/x/libnccl.so.2.30.1".to_string());
        assert_eq!(nccl_candidates(file), ["/x/libnccl.so.2.30.1"]);
        let folder = |k: &str| (k == "RINGATTN_NCCL").then(|| wheel.display().to_string());
        assert_eq!(
            nccl_candidates(folder),
            [wheel.join("libnccl.so.2").display().to_string(), wheel.join("libnccl.so").display().to_string()]
        );
        let both = |k: &str| match k {
            "RINGATTN_NCCL" => Some("/first/libnccl.so.2".to_string()),
            "NCCL_LIBRARY" => Some("/second/libnccl.so.2".to_string()),
            _ => None,
        };
        assert_eq!(nccl_candidates(both), ["/first/libnccl.so.2"]);
    }

    #[test]
    fn nothing_loadable_is_an_error_listing_what_was_tried() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("libnccl.so.2");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        let c = vec![
            "libnccl-none-such.so.2".to_string(),
            dir.path().join("absent/libnccl.so.2").display().to_string(),
            fake.display().to_string(),
        ];
        let e = load_first(&c).unwrap_err().to_string();
        assert!(e.contains("no NCCL library found"), "{e}");
        assert!(e.contains("libnccl-none-such.so.2 (not found)"), "{e}");
        assert!(e.contains("absent/libnccl.so.2 (not present)"), "{e}");
        assert!(e.contains(&fake.display().to_string()), "{e}");
        assert!(e.contains("RINGATTN_NCCL"), "{e}");
    }

    /// The PyPI wheel's library, loaded by path from its folder, where the only file is
    /// `libnccl.so.2` (no `libnccl.so` symlink). `scripts/test.sh` installs the wheel and sets
    /// `RINGATTN_TEST_NCCL_DIR`; elsewhere the test says it was skipped.
    #[test]
    fn the_wheels_libnccl_so_2_loads_without_a_symlink() {
        let Some(dir) = std::env::var_os("RINGATTN_TEST_NCCL_DIR") else {
            eprintln!("SKIPPED: RINGATTN_TEST_NCCL_DIR is not set (scripts/test.sh sets it)");
            return;
        };
        let dir = PathBuf::from(dir);
        assert!(dir.join("libnccl.so.2").is_file(), "{}", dir.display());
        assert!(!dir.join("libnccl.so").exists(), "the wheel ships no libnccl.so symlink");
        let c = nccl_candidates(|k| (k == "RINGATTN_NCCL").then(|| dir.display().to_string()));
        let lib = load_first(&c).unwrap();
        assert_eq!(lib.info.path, std::fs::canonicalize(dir.join("libnccl.so.2")).unwrap());
        assert!(lib.info.version >= OLDEST_NCCL, "{}", lib.info.version);
        assert!(lib.error_text(sys::ncclResult_t::ncclInvalidArgument).contains("invalid"));
    }
}
