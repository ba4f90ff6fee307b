//! The exported driver entry points (`cuda.h` ABI names), each a thin shell: arguments
//! checked as the driver checks them, the work handed to [`crate::runtime`], failures turned
//! into their `CUresult` (with the detail kept for `cuGetErrorString`). No panic crosses the
//! C boundary.

#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use ringattn::emu::named::{self, NamedLaunch};
use ringattn::kernels::tensor_map::{OobFill, TensorMapDType, TensorMapSpec, TensorMapSwizzle};

use crate::codes::{
    self, CuResult, Failure, INVALID_HANDLE, INVALID_VALUE, NOT_FOUND, NOT_READY, NOT_SUPPORTED, SUCCESS,
};
use crate::device;
use crate::image;
use crate::launch::{self, Geometry};
use crate::runtime::{
    current, driver, find_alloc, set_current, Driver, Event, Function, Module, OpKind, Source, State, StreamKind,
    CONTEXT_TAG, EVENT_TAG, FUNCTION_TAG, MODULE_TAG, STREAM_TAG,
};

type Ptr = *mut c_void;

/// Runs `f`, mapping its failure (or a panic) to a `CUresult`.
fn entry(what: &str, f: impl FnOnce() -> Result<(), Failure>) -> CuResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(fail)) => codes::report(&fail),
        Err(_) => codes::report(&Failure::new(codes::LAUNCH_FAILED, format!("{what}: the emulated driver panicked"))),
    }
}

fn out<T>(p: *mut T, what: &str) -> Result<&'static mut T, Failure> {
    // SAFETY: a non-null out-pointer of the caller's, valid for one write.
    unsafe { p.as_mut() }.ok_or_else(|| Failure::new(INVALID_VALUE, format!("{what}: null pointer")))
}

fn init_check(st: &State) -> Result<(), Failure> {
    if st.initialized {
        Ok(())
    } else {
        Err(Failure::new(codes::NOT_INITIALIZED, "cuInit was not called"))
    }
}

fn device_of(st: &State, dev: c_int) -> Result<usize, Failure> {
    init_check(st)?;
    usize::try_from(dev).ok().filter(|&d| d < st.devices.len()).ok_or_else(|| {
        Failure::new(codes::INVALID_DEVICE, format!("device {dev} (this machine has {})", st.devices.len()))
    })
}

// ---- initialisation, devices, contexts ----

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CuResult {
    entry("cuInit", || {
        if flags != 0 {
            return Err(Failure::new(INVALID_VALUE, format!("cuInit({flags}): flags must be 0")));
        }
        driver().init();
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CuResult {
    entry("cuDriverGetVersion", || {
        *out(v, "cuDriverGetVersion")? = 13000;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CuResult {
    entry("cuDeviceGetCount", || {
        let st = driver().lock();
        init_check(&st)?;
        *out(n, "cuDeviceGetCount")? = st.devices.len() as c_int;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> CuResult {
    entry("cuDeviceGet", || {
        let st = driver().lock();
        device_of(&st, ordinal)?;
        *out(d, "cuDeviceGet")? = ordinal;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    entry("cuDeviceGetName", || {
        let st = driver().lock();
        let d = device_of(&st, dev)?;
        if name.is_null() || len <= 0 {
            return Err(Failure::new(INVALID_VALUE, "cuDeviceGetName: no buffer"));
        }
        let bytes = st.devices[d].name.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CuResult {
    entry("cuDeviceGetAttribute", || {
        let st = driver().lock();
        let d = device_of(&st, dev)?;
        let value = device::attribute(attr, st.devices[d].cc)
            .ok_or_else(|| Failure::new(INVALID_VALUE, format!("device attribute {attr} is not emulated")))?;
        *out(v, "cuDeviceGetAttribute")? = value;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    entry("cuDeviceTotalMem", || {
        let st = driver().lock();
        let d = device_of(&st, dev)?;
        *out(bytes, "cuDeviceTotalMem")? = st.devices[d].total_mem as usize;
        Ok(())
    })
}

unsafe fn uuid(u: *mut [u8; 16], dev: c_int) -> CuResult {
    entry("cuDeviceGetUuid", || {
        let st = driver().lock();
        let d = device_of(&st, dev)?;
        let mut id = *b"ringattn-emu-gpu";
        id[15] = d as u8;
        *out(u, "cuDeviceGetUuid")? = id;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(u: *mut [u8; 16], dev: c_int) -> CuResult {
    unsafe { uuid(u, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(u: *mut [u8; 16], dev: c_int) -> CuResult {
    unsafe { uuid(u, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Ptr, dev: c_int) -> CuResult {
    entry("cuDevicePrimaryCtxRetain", || {
        let st = driver().lock();
        let d = device_of(&st, dev)?;
        *out(ctx, "cuDevicePrimaryCtxRetain")? = (CONTEXT_TAG | (d as u64) << 4) as Ptr;
        Ok(())
    })
}

fn context_of(st: &State, ctx: Ptr) -> Result<usize, Failure> {
    init_check(st)?;
    let h = ctx as u64;
    let d = ((h & 0xFFFF_FFFF) >> 4) as usize;
    if h & 0xF_0000_0000 != CONTEXT_TAG || d >= st.devices.len() {
        return Err(Failure::new(codes::INVALID_CONTEXT, format!("context handle {h:#x}")));
    }
    Ok(d)
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CuResult {
    entry("cuDevicePrimaryCtxRelease", || {
        // The primary context lives as long as the process (nothing is torn down).
        device_of(&driver().lock(), dev).map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Ptr) -> CuResult {
    entry("cuCtxGetCurrent", || {
        let st = driver().lock();
        init_check(&st)?;
        *out(ctx, "cuCtxGetCurrent")? =
            current().map_or(std::ptr::null_mut(), |d| (CONTEXT_TAG | (d as u64) << 4) as Ptr);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Ptr) -> CuResult {
    entry("cuCtxSetCurrent", || {
        let st = driver().lock();
        if ctx.is_null() {
            set_current(None);
            return Ok(());
        }
        let d = context_of(&st, ctx)?;
        set_current(Some(d));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Ptr) -> CuResult {
    unsafe { cuCtxSetCurrent(ctx) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Ptr) -> CuResult {
    entry("cuCtxPopCurrent", || {
        if !ctx.is_null() {
            *out(ctx, "cuCtxPopCurrent")? =
                current().map_or(std::ptr::null_mut(), |d| (CONTEXT_TAG | (d as u64) << 4) as Ptr);
        }
        set_current(None);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CuResult {
    entry("cuCtxGetDevice", || {
        let st = driver().lock();
        let ctx = driver().context(&st)?;
        *out(dev, "cuCtxGetDevice")? = ctx as c_int;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CuResult {
    entry("cuCtxSynchronize", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        st = d.synchronize_context(st, ctx);
        d.context(&st).map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> CuResult {
    entry("cuCtxGetStreamPriorityRange", || {
        if !least.is_null() {
            *out(least, "least")? = 0;
        }
        if !greatest.is_null() {
            *out(greatest, "greatest")? = -5;
        }
        Ok(())
    })
}

/// Writes the static string `text` gives for `code` into `*s` (NULL and `INVALID_VALUE` for a
/// code the driver does not know), as `cuGetErrorString` / `cuGetErrorName` do.
fn error_text(code: CuResult, s: *mut *const c_char, text: fn(CuResult) -> Option<*const c_char>) -> CuResult {
    // SAFETY: a caller's out-pointer, valid for one write when not null.
    let Some(s) = (unsafe { s.as_mut() }) else { return INVALID_VALUE };
    match text(code) {
        Some(t) => {
            *s = t;
            SUCCESS
        }
        None => {
            *s = std::ptr::null();
            INVALID_VALUE
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, s: *mut *const c_char) -> CuResult {
    error_text(code, s, codes::text)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, s: *mut *const c_char) -> CuResult {
    error_text(code, s, codes::name)
}

// ---- memory ----

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    entry("cuMemGetInfo", || {
        let st = driver().lock();
        let ctx = driver().context(&st)?;
        let used: u64 = st.allocs.values().filter(|a| !a.host).map(|a| a.bytes).sum();
        let t = st.devices[ctx].total_mem;
        *out(free, "cuMemGetInfo")? = t.saturating_sub(used) as usize;
        *out(total, "cuMemGetInfo")? = t as usize;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CuResult {
    entry("cuMemAlloc", || {
        let d = driver();
        let mut st = d.lock();
        d.context(&st)?;
        if bytes == 0 {
            return Err(Failure::new(INVALID_VALUE, "cuMemAlloc of 0 bytes"));
        }
        let p = d.alloc(&mut st, bytes as u64, false)?;
        *out(dptr, "cuMemAlloc")? = p;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: Ptr) -> CuResult {
    entry("cuMemAllocAsync", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, stream as u64)?;
        let p = d.alloc(&mut st, bytes as u64, false)?;
        d.enqueue(&mut st, sid, format!("cuMemAllocAsync {bytes} bytes at {p:#x}"), OpKind::AllocReady { ptr: p });
        *out(dptr, "cuMemAllocAsync")? = p;
        Ok(())
    })
}

fn free_on(d: &'static Driver, st: &mut State, ptr: u64, sid: usize, what: &str) -> Result<u64, Failure> {
    match st.allocs.get(&ptr) {
        Some(a) if !a.host => {}
        _ => {
            return Err(Failure::new(
                INVALID_VALUE,
                format!("{what}({ptr:#x}): not the start of a live device allocation"),
            ))
        }
    }
    Ok(d.enqueue(st, sid, format!("{what} {ptr:#x}"), OpKind::Free { ptr }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> CuResult {
    entry("cuMemFree", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        // Synchronous: on the legacy stream, waited for.
        let sid = st.legacy[ctx];
        let seq = free_on(d, &mut st, ptr, sid, "cuMemFree")?;
        let clock = st.streams[sid].clock.clone();
        drop(d.wait_host(st, sid, seq, &clock));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: u64, stream: Ptr) -> CuResult {
    entry("cuMemFreeAsync", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, stream as u64)?;
        free_on(d, &mut st, ptr, sid, "cuMemFreeAsync").map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(p: *mut Ptr, bytes: usize, _flags: c_uint) -> CuResult {
    entry("cuMemHostAlloc", || {
        let d = driver();
        let mut st = d.lock();
        d.context(&st)?;
        let a = d.alloc(&mut st, bytes as u64, true)?;
        *out(p, "cuMemHostAlloc")? = a as Ptr;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(p: *mut Ptr, bytes: usize) -> CuResult {
    unsafe { cuMemHostAlloc(p, bytes, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: Ptr) -> CuResult {
    entry("cuMemFreeHost", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let ptr = p as u64;
        match st.allocs.get(&ptr) {
            Some(a) if a.host => {}
            _ => return Err(Failure::new(INVALID_VALUE, format!("cuMemFreeHost({ptr:#x}): not pinned host memory"))),
        }
        st = d.synchronize_context(st, ctx);
        let sid = st.legacy[ctx];
        let seq = d.enqueue(&mut st, sid, format!("cuMemFreeHost {ptr:#x}"), OpKind::Free { ptr });
        let clock = st.streams[sid].clock.clone();
        drop(d.wait_host(st, sid, seq, &clock));
        Ok(())
    })
}

/// The stream of an `*Async` call's handle, or the legacy stream for the synchronous form.
fn stream_or_legacy(d: &'static Driver, st: &mut State, ctx: usize, stream: Option<Ptr>) -> Result<usize, Failure> {
    match stream {
        Some(s) => d.stream_of(st, ctx, s as u64),
        None => Ok(st.legacy[ctx]),
    }
}

/// The device range `[p, p + n)` must lie in one live device allocation.
fn device_range(st: &State, p: u64, n: usize, what: &str) -> Result<(), Failure> {
    match find_alloc(st, p, n as u64) {
        Some((_, a)) if !a.host => Ok(()),
        _ => Err(Failure::new(
            INVALID_VALUE,
            format!("{what}: {p:#x} (+{n} bytes) is not within a live device allocation"),
        )),
    }
}

fn pinned(st: &State, p: u64, n: usize) -> bool {
    find_alloc(st, p, n as u64).is_some_and(|(_, a)| a.host)
}

fn htod(stream: Option<Ptr>, dst: u64, src: *const c_void, n: usize, what: &str) -> CuResult {
    entry(what, || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        device_range(&st, dst, n, what)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(Failure::new(INVALID_VALUE, format!("{what}: null source")));
        }
        let sid = stream_or_legacy(d, &mut st, ctx, stream)?;
        let source = if pinned(&st, src as u64, n) {
            Source::Memory(src as u64)
        } else {
            // Pageable memory is staged at the call (the caller may reuse it on return).
            // SAFETY: the caller's source holds `n` bytes.
            Source::Snapshot(unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) }.to_vec())
        };
        let seq = d.enqueue(
            &mut st,
            sid,
            format!("{what} {n} bytes to {dst:#x}"),
            OpKind::Copy { dst, dst_host: false, src: source, len: n as u64 },
        );
        if stream.is_none() {
            let clock = st.streams[sid].clock.clone();
            drop(d.wait_host(st, sid, seq, &clock));
        }
        Ok(())
    })
}

fn dtoh(stream: Option<Ptr>, dst: *mut c_void, src: u64, n: usize, what: &str) -> CuResult {
    entry(what, || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        device_range(&st, src, n, what)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(Failure::new(INVALID_VALUE, format!("{what}: null destination")));
        }
        let sid = stream_or_legacy(d, &mut st, ctx, stream)?;
        let is_pinned = pinned(&st, dst as u64, n);
        let seq = d.enqueue(
            &mut st,
            sid,
            format!("{what} {n} bytes from {src:#x}"),
            OpKind::Copy { dst: dst as u64, dst_host: true, src: Source::Memory(src), len: n as u64 },
        );
        // Into pageable memory the copy is complete on return (the driver stages it).
        if stream.is_none() || !is_pinned {
            let clock = st.streams[sid].clock.clone();
            st = d.wait_host(st, sid, seq, &clock);
            d.context(&st)?;
        }
        Ok(())
    })
}

fn dtod(stream: Option<Ptr>, dst: u64, src: u64, n: usize, what: &str) -> CuResult {
    entry(what, || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        device_range(&st, src, n, what)?;
        device_range(&st, dst, n, what)?;
        if n == 0 {
            return Ok(());
        }
        let sid = stream_or_legacy(d, &mut st, ctx, stream)?;
        d.enqueue(
            &mut st,
            sid,
            format!("{what} {n} bytes {src:#x} -> {dst:#x}"),
            OpKind::Copy { dst, dst_host: false, src: Source::Memory(src), len: n as u64 },
        );
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CuResult {
    htod(None, dst, src, n, "cuMemcpyHtoD")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: Ptr) -> CuResult {
    htod(Some(s), dst, src, n, "cuMemcpyHtoDAsync")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> CuResult {
    dtoh(None, dst, src, n, "cuMemcpyDtoH")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, n: usize, s: Ptr) -> CuResult {
    dtoh(Some(s), dst, src, n, "cuMemcpyDtoHAsync")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, n: usize) -> CuResult {
    dtod(None, dst, src, n, "cuMemcpyDtoD")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: Ptr) -> CuResult {
    dtod(Some(s), dst, src, n, "cuMemcpyDtoDAsync")
}

fn memset(stream: Option<Ptr>, dst: u64, value: u32, elem: u8, count: usize, what: &str) -> CuResult {
    entry(what, || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        device_range(&st, dst, count * elem as usize, what)?;
        if elem == 4 && !dst.is_multiple_of(4) {
            return Err(Failure::new(INVALID_VALUE, format!("{what}: {dst:#x} is not 4-byte aligned")));
        }
        if count == 0 {
            return Ok(());
        }
        let sid = stream_or_legacy(d, &mut st, ctx, stream)?;
        let seq = d.enqueue(
            &mut st,
            sid,
            format!("{what} {count} x {elem} bytes at {dst:#x}"),
            OpKind::Set { dst, value, elem, count: count as u64 },
        );
        if stream.is_none() {
            let clock = st.streams[sid].clock.clone();
            drop(d.wait_host(st, sid, seq, &clock));
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, v: u8, n: usize) -> CuResult {
    memset(None, dst, u32::from(v), 1, n, "cuMemsetD8")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, v: u8, n: usize, s: Ptr) -> CuResult {
    memset(Some(s), dst, u32::from(v), 1, n, "cuMemsetD8Async")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, v: u32, n: usize) -> CuResult {
    memset(None, dst, v, 4, n, "cuMemsetD32")
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(dst: u64, v: u32, n: usize, s: Ptr) -> CuResult {
    memset(Some(s), dst, v, 4, n, "cuMemsetD32Async")
}

// ---- streams and events ----

fn create_stream(p: *mut Ptr, flags: c_uint) -> CuResult {
    entry("cuStreamCreate", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        if flags > 1 {
            return Err(Failure::new(INVALID_VALUE, format!("cuStreamCreate flags {flags}")));
        }
        let kind = if flags == 1 { StreamKind::NonBlocking } else { StreamKind::Blocking };
        let id = d.new_stream_locked(&mut st, ctx, kind);
        *out(p, "cuStreamCreate")? = (STREAM_TAG | (id as u64) << 4) as Ptr;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(p: *mut Ptr, flags: c_uint) -> CuResult {
    create_stream(p, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(p: *mut Ptr, flags: c_uint, _priority: c_int) -> CuResult {
    create_stream(p, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: Ptr) -> CuResult {
    entry("cuStreamDestroy", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = current().ok_or_else(|| Failure::new(codes::INVALID_CONTEXT, "cuStreamDestroy: no context"))?;
        let sid = d.stream_of(&mut st, ctx, s as u64)?;
        if st.streams[sid].kind == StreamKind::Legacy || s as u64 == 2 {
            return Err(Failure::new(INVALID_HANDLE, "cuStreamDestroy of a default stream"));
        }
        // Its queued work still runs; the worker ends once the queue is empty.
        st.streams[sid].destroyed = true;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: Ptr) -> CuResult {
    entry("cuStreamSynchronize", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, s as u64)?;
        st = d.synchronize_stream(st, sid);
        d.context(&st).map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: Ptr) -> CuResult {
    let mut code = SUCCESS;
    let r = entry("cuStreamQuery", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, s as u64)?;
        if st.streams[sid].completed < st.streams[sid].enqueued {
            code = NOT_READY;
        } else {
            let c = st.streams[sid].clock.clone();
            crate::race::join(&mut st.host_clock, &c);
        }
        Ok(())
    });
    if r == SUCCESS {
        code
    } else {
        r
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: Ptr, ev: Ptr, flags: c_uint) -> CuResult {
    entry("cuStreamWaitEvent", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        if flags != 0 {
            return Err(Failure::new(INVALID_VALUE, format!("cuStreamWaitEvent flags {flags} (0 outside capture)")));
        }
        let sid = d.stream_of(&mut st, ctx, s as u64)?;
        let e = st
            .events
            .get(&(ev as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, format!("event {:#x}", ev as u64)))?;
        if let Some((_, _, clock)) = &e.recorded {
            let clock = clock.clone();
            crate::race::join(&mut st.streams[sid].clock, &clock);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(p: *mut Ptr, flags: c_uint) -> CuResult {
    entry("cuEventCreate", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        if flags & !0x7 != 0 || (flags & 4 != 0 && flags & 2 == 0) {
            return Err(Failure::new(INVALID_VALUE, format!("cuEventCreate flags {flags:#x}")));
        }
        let h = Driver::handle(&mut st, EVENT_TAG);
        st.events.insert(h, Event { ctx, timing: flags & 2 == 0, recorded: None, time: Arc::new(Mutex::new(None)) });
        *out(p, "cuEventCreate")? = h as Ptr;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(ev: Ptr) -> CuResult {
    entry("cuEventDestroy", || {
        let mut st = driver().lock();
        st.events
            .remove(&(ev as u64))
            .map(|_| ())
            .ok_or_else(|| Failure::new(INVALID_HANDLE, format!("event {:#x}", ev as u64)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(ev: Ptr, s: Ptr) -> CuResult {
    entry("cuEventRecord", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, s as u64)?;
        let (ectx, time) = match st.events.get(&(ev as u64)) {
            Some(e) => (e.ctx, e.time.clone()),
            None => return Err(Failure::new(INVALID_HANDLE, format!("event {:#x}", ev as u64))),
        };
        if ectx != ctx {
            return Err(Failure::new(
                INVALID_HANDLE,
                "cuEventRecord: the event and the stream belong to different contexts",
            ));
        }
        *time.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let seq = d.enqueue(&mut st, sid, format!("event record {:#x}", ev as u64), OpKind::Marker { time });
        let clock = st.streams[sid].clock.clone();
        if let Some(e) = st.events.get_mut(&(ev as u64)) {
            e.recorded = Some((sid, seq, clock));
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(ev: Ptr) -> CuResult {
    let d = driver();
    let mut st = d.lock();
    if let Some(f) = current().and_then(|c| st.sticky.get(&c)) {
        return codes::report(&f.clone());
    }
    d.query_event(&mut st, ev as u64)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(ev: Ptr) -> CuResult {
    entry("cuEventSynchronize", || {
        let d = driver();
        let mut st = d.lock();
        let rec = st
            .events
            .get(&(ev as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, format!("event {:#x}", ev as u64)))?
            .recorded
            .clone();
        if let Some((sid, seq, clock)) = rec {
            st = d.wait_guard(st, sid, seq);
            crate::race::join(&mut st.host_clock, &clock);
        }
        match current().and_then(|c| st.sticky.get(&c)) {
            Some(f) => Err(f.clone()),
            None => Ok(()),
        }
    })
}

fn elapsed(ms: *mut f32, a: Ptr, b: Ptr) -> CuResult {
    let mut code = SUCCESS;
    let r = entry("cuEventElapsedTime", || {
        let st = driver().lock();
        let get = |e: Ptr| {
            st.events.get(&(e as u64)).ok_or_else(|| Failure::new(INVALID_HANDLE, "cuEventElapsedTime: not an event"))
        };
        let (ea, eb) = (get(a)?, get(b)?);
        if !ea.timing || !eb.timing || ea.recorded.is_none() || eb.recorded.is_none() {
            return Err(Failure::new(INVALID_HANDLE, "cuEventElapsedTime: an event without timing, or never recorded"));
        }
        let (ta, tb) =
            (*ea.time.lock().unwrap_or_else(|e| e.into_inner()), *eb.time.lock().unwrap_or_else(|e| e.into_inner()));
        match (ta, tb) {
            (Some(ta), Some(tb)) => {
                let v = if tb >= ta { (tb - ta).as_secs_f64() * 1e3 } else { -((ta - tb).as_secs_f64() * 1e3) };
                *out(ms, "cuEventElapsedTime")? = v as f32;
            }
            _ => code = NOT_READY,
        }
        Ok(())
    });
    if r == SUCCESS {
        code
    } else {
        r
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, a: Ptr, b: Ptr) -> CuResult {
    elapsed(ms, a, b)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, a: Ptr, b: Ptr) -> CuResult {
    elapsed(ms, a, b)
}

// ---- modules, functions, launches ----

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut Ptr, img: *const c_void) -> CuResult {
    entry("cuModuleLoadData", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let cc = st.devices[ctx].cc;
        // SAFETY: the caller passes a whole image (the driver's contract).
        let image = unsafe { image::load(img.cast(), cc) }?;
        let h = Driver::handle(&mut st, MODULE_TAG);
        d.log(&format!("load {} ({} kernels)", image.target, image.kernels.len()));
        st.modules.insert(h, Module { ctx, target: image.target, kernels: image.kernels });
        *out(m, "cuModuleLoadData")? = h as Ptr;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: Ptr) -> CuResult {
    entry("cuModuleUnload", || {
        let mut st = driver().lock();
        let h = m as u64;
        st.modules.remove(&h).ok_or_else(|| Failure::new(INVALID_HANDLE, format!("module {h:#x}")))?;
        st.functions.retain(|_, f| f.module != h as usize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut Ptr, m: Ptr, name: *const c_char) -> CuResult {
    entry("cuModuleGetFunction", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        if name.is_null() {
            return Err(Failure::new(INVALID_VALUE, "cuModuleGetFunction: null name"));
        }
        // SAFETY: a NUL-terminated name of the caller's.
        let n = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        let module = st
            .modules
            .get(&(m as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, format!("module {:#x}", m as u64)))?;
        if module.ctx != ctx {
            return Err(Failure::new(
                codes::INVALID_CONTEXT,
                format!("module {:#x} was loaded in another context", m as u64),
            ));
        }
        let info = module.kernels.get(&n).cloned().ok_or_else(|| {
            Failure::new(
                NOT_FOUND,
                format!("no kernel `{n}` in the {} image ({} kernels)", module.target, module.kernels.len()),
            )
        })?;
        let kernel = named::find(&n).ok_or_else(|| {
            Failure::new(
                NOT_SUPPORTED,
                format!("`{n}` is in the image but the emulator has no kernel of that name (cuda/emu/named.h tables)"),
            )
        })?;
        let h = Driver::handle(&mut st, FUNCTION_TAG);
        let max_dynamic_smem = launch::default_max_dynamic(&info);
        st.functions.insert(h, Function { module: m as usize, info, kernel, max_dynamic_smem });
        *out(f, "cuModuleGetFunction")? = h as Ptr;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(f: Ptr, attr: c_int, value: c_int) -> CuResult {
    entry("cuFuncSetAttribute", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let cc = st.devices[ctx].cc;
        let func = st
            .functions
            .get_mut(&(f as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, "cuFuncSetAttribute: not a function"))?;
        match attr {
            8 => func.max_dynamic_smem = launch::check_max_dynamic(&func.info, value, cc)?,
            9 if (-1..=100).contains(&value) => {}
            _ => {
                return Err(Failure::new(
                    INVALID_VALUE,
                    format!("cuFuncSetAttribute: attribute {attr} = {value} cannot be set"),
                ))
            }
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: Ptr) -> CuResult {
    entry("cuFuncGetAttribute", || {
        let st = driver().lock();
        let func = st
            .functions
            .get(&(f as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, "cuFuncGetAttribute: not a function"))?;
        let i = &func.info;
        let value = match attr {
            0 => i.max_threads.unwrap_or(1024) as c_int,
            1 => i.static_smem as c_int,
            2 | 3 => 0,
            4 => i.registers as c_int,
            5 | 6 => 90,
            8 => func.max_dynamic_smem as c_int,
            _ => return Err(Failure::new(INVALID_VALUE, format!("cuFuncGetAttribute: attribute {attr}"))),
        };
        *out(v, "cuFuncGetAttribute")? = value;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetCacheConfig(_f: Ptr, _config: c_int) -> CuResult {
    SUCCESS
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Ptr,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    smem: c_uint,
    stream: Ptr,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    entry("cuLaunchKernel", || {
        let d = driver();
        let mut st = d.lock();
        let ctx = d.context(&st)?;
        let sid = d.stream_of(&mut st, ctx, stream as u64)?;
        let func = st
            .functions
            .get(&(f as u64))
            .ok_or_else(|| Failure::new(INVALID_HANDLE, "cuLaunchKernel: not a function"))?;
        if !extra.is_null() {
            return Err(Failure::new(NOT_SUPPORTED, "cuLaunchKernel: `extra` parameter buffers are not emulated"));
        }
        let g = Geometry { grid: [gx, gy, gz], block: [bx, by, bz], smem };
        launch::check(&func.info, func.kernel, g, func.max_dynamic_smem)?;
        let p = func.info.params[0];
        if params.is_null() {
            return Err(Failure::new(INVALID_VALUE, "cuLaunchKernel: null kernelParams for a kernel with a parameter"));
        }
        // SAFETY: kernelParams[0] points at the parameter's `p.size` bytes (the driver's
        // contract); they are copied now, as the driver copies them.
        let bytes = unsafe {
            let v = *params;
            if v.is_null() {
                return Err(Failure::new(INVALID_VALUE, "cuLaunchKernel: kernelParams[0] is null"));
            }
            std::slice::from_raw_parts(v.cast::<u8>(), p.size as usize).to_vec()
        };
        let kernel = func.kernel;
        let label = format!("launch {} grid={gx},{gy},{gz} block={bx} smem={smem}", kernel.name);
        d.log(&format!("{label} on {}", st.streams[sid].label));
        let launch = NamedLaunch { grid: [gx, gy, gz], block: bx, smem_bytes: u64::from(smem), workers: 0 };
        d.enqueue(&mut st, sid, label, OpKind::Launch { kernel, params: bytes, launch });
        Ok(())
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuTensorMapEncodeTiled(
    map: *mut [u64; 16],
    dtype: c_int,
    rank: c_uint,
    address: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    box_dims: *const u32,
    element_strides: *const u32,
    interleave: c_int,
    swizzle: c_int,
    l2: c_int,
    oob: c_int,
) -> CuResult {
    entry("cuTensorMapEncodeTiled", || {
        let invalid = |what: String| Err(Failure::new(INVALID_VALUE, format!("cuTensorMapEncodeTiled: {what}")));
        if map.is_null() || !(map as usize).is_multiple_of(64) {
            return invalid(format!("the tensor map at {map:p} is not 64-byte aligned"));
        }
        if !(1..=5).contains(&rank)
            || dims.is_null()
            || box_dims.is_null()
            || element_strides.is_null()
            || (rank > 1 && strides.is_null())
        {
            return invalid(format!("rank {rank} or a null array"));
        }
        let r = rank as usize;
        // SAFETY: the arrays hold `rank` (strides: `rank - 1`) entries (the driver's contract).
        let (dims, strides, boxes, es) = unsafe {
            (
                std::slice::from_raw_parts(dims, r).to_vec(),
                if r > 1 { std::slice::from_raw_parts(strides, r - 1).to_vec() } else { Vec::new() },
                std::slice::from_raw_parts(box_dims, r).to_vec(),
                std::slice::from_raw_parts(element_strides, r).to_vec(),
            )
        };
        if es.iter().any(|&e| !(1..=8).contains(&e)) {
            return invalid(format!("element strides {es:?} outside 1 ... 8"));
        }
        if es.iter().skip(1).any(|&e| e != 1) {
            return Err(Failure::new(
                NOT_SUPPORTED,
                format!("cuTensorMapEncodeTiled: element strides {es:?}: the emulator copies dense boxes"),
            ));
        }
        if interleave != 0 {
            return Err(Failure::new(NOT_SUPPORTED, "cuTensorMapEncodeTiled: interleaved layouts are not emulated"));
        }
        if !(0..=3).contains(&l2) {
            return invalid(format!("L2 promotion {l2}"));
        }
        let dtype = match dtype {
            9 => TensorMapDType::BF16,
            6 => TensorMapDType::F16,
            7 => TensorMapDType::F32,
            d if (0..=15).contains(&d) => {
                return Err(Failure::new(
                    NOT_SUPPORTED,
                    format!("cuTensorMapEncodeTiled: data type {d} is not emulated"),
                ))
            }
            d => return invalid(format!("data type {d}")),
        };
        let swizzle = match swizzle {
            0 => TensorMapSwizzle::None,
            1 => TensorMapSwizzle::B32,
            2 => TensorMapSwizzle::B64,
            3 => TensorMapSwizzle::B128,
            s => return invalid(format!("swizzle {s}")),
        };
        let oob_fill = match (oob, dtype) {
            (0, _) => OobFill::Zeros,
            (1, _) => OobFill::Nan,
            (o, _) => return invalid(format!("OOB fill {o}")),
        };
        let spec = TensorMapSpec { dtype, address: address as u64, dims, strides, box_dims: boxes, swizzle, oob_fill };
        let encoded =
            spec.encode_emulated().map_err(|e| Failure::new(INVALID_VALUE, format!("cuTensorMapEncodeTiled: {e}")))?;
        *out(map, "cuTensorMapEncodeTiled")? = encoded.words;
        Ok(())
    })
}
