//! The driver's result codes (`CUresult` of `cuda.h`) this stand-in returns, their names and
//! texts, and the detail of the last failure of each code (so that an error message says what
//! the emulated GPU saw, not only "invalid argument").

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Mutex, OnceLock};

/// `CUresult`.
pub type CuResult = i32;

pub const SUCCESS: CuResult = 0;
pub const INVALID_VALUE: CuResult = 1;
pub const OUT_OF_MEMORY: CuResult = 2;
pub const NOT_INITIALIZED: CuResult = 3;
pub const INVALID_DEVICE: CuResult = 101;
pub const INVALID_IMAGE: CuResult = 200;
pub const INVALID_CONTEXT: CuResult = 201;
pub const NO_BINARY_FOR_GPU: CuResult = 209;
pub const INVALID_PTX: CuResult = 218;
pub const UNSUPPORTED_PTX_VERSION: CuResult = 222;
pub const INVALID_HANDLE: CuResult = 400;
pub const NOT_FOUND: CuResult = 500;
pub const NOT_READY: CuResult = 600;
pub const ILLEGAL_ADDRESS: CuResult = 700;
pub const LAUNCH_OUT_OF_RESOURCES: CuResult = 701;
pub const MISALIGNED_ADDRESS: CuResult = 716;
pub const LAUNCH_FAILED: CuResult = 719;
pub const NOT_SUPPORTED: CuResult = 801;

/// Name and text of `code` (as `cuGetErrorName` / `cuGetErrorString`), `None` for a code this
/// stand-in does not know.
pub fn describe(code: CuResult) -> Option<(&'static str, &'static str)> {
    Some(match code {
        SUCCESS => ("CUDA_SUCCESS", "no error"),
        INVALID_VALUE => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        OUT_OF_MEMORY => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        NOT_INITIALIZED => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        INVALID_DEVICE => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        INVALID_IMAGE => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        INVALID_CONTEXT => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        NO_BINARY_FOR_GPU => {
            ("CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device")
        }
        INVALID_PTX => ("CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
        UNSUPPORTED_PTX_VERSION => {
            ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain.")
        }
        INVALID_HANDLE => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        NOT_FOUND => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        NOT_READY => ("CUDA_ERROR_NOT_READY", "device not ready"),
        ILLEGAL_ADDRESS => ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
        LAUNCH_OUT_OF_RESOURCES => ("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"),
        MISALIGNED_ADDRESS => ("CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
        LAUNCH_FAILED => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
        NOT_SUPPORTED => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        _ => return None,
    })
}

/// Whether `code` leaves the context unusable (every later call returns it).
pub fn is_sticky(code: CuResult) -> bool {
    matches!(code, ILLEGAL_ADDRESS | MISALIGNED_ADDRESS | LAUNCH_FAILED)
}

/// An error: its code and what the emulated GPU saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: CuResult,
    pub detail: String,
}

impl Failure {
    pub fn new(code: CuResult, detail: impl Into<String>) -> Self {
        Failure { code, detail: detail.into() }
    }
}

fn details() -> &'static Mutex<HashMap<CuResult, String>> {
    static D: OnceLock<Mutex<HashMap<CuResult, String>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Records `f` as the detail of its code (the text `cuGetErrorString` gives from now on) and
/// prints it on stderr, once per distinct message. Returns the code.
pub fn report(f: &Failure) -> CuResult {
    let mut d = details().lock().unwrap_or_else(|e| e.into_inner());
    if d.get(&f.code) != Some(&f.detail) {
        eprintln!("emulated-gpu: {}: {}", describe(f.code).map_or("CUDA_ERROR", |n| n.0), f.detail);
        d.insert(f.code, f.detail.clone());
    }
    f.code
}

/// `cuGetErrorString`'s text for `code`: the driver's text, with the detail of its last
/// failure appended. The strings live as long as the process (one per distinct message).
pub fn text(code: CuResult) -> Option<*const c_char> {
    static LEAKED: OnceLock<Mutex<HashMap<String, &'static CString>>> = OnceLock::new();
    let (_, base) = describe(code)?;
    let detail = details().lock().unwrap_or_else(|e| e.into_inner()).get(&code).cloned();
    let full = match detail {
        Some(d) => format!("{base} (emulated GPU: {d})"),
        None => base.to_string(),
    };
    let mut map = LEAKED.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner());
    let s = map
        .entry(full.clone())
        .or_insert_with(|| Box::leak(Box::new(CString::new(full.replace('\0', " ")).unwrap_or_default())));
    Some(s.as_ptr())
}

/// `cuGetErrorName`'s name for `code`, a static C string.
pub fn name(code: CuResult) -> Option<*const c_char> {
    static NAMES: OnceLock<Mutex<HashMap<CuResult, &'static CString>>> = OnceLock::new();
    let (n, _) = describe(code)?;
    let mut map = NAMES.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner());
    Some(map.entry(code).or_insert_with(|| Box::leak(Box::new(CString::new(n).unwrap_or_default()))).as_ptr())
}
