//! The stand-in driver's rules, called as cudarc calls them (in process, through the exported
//! entry points): the planted faults each must catch, and the behaviour each must keep.
//! Every test works on its own emulated device, so that one test's sticky error never reaches
//! another's context.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::Once;

use ringattn::kernels::{images, ImageKind};
use ringattn_emulated_cuda::api::*;
use ringattn_emulated_cuda::codes::{
    ILLEGAL_ADDRESS, INVALID_VALUE, LAUNCH_FAILED, NOT_FOUND, NO_BINARY_FOR_GPU, SUCCESS,
};

type Ptr = *mut c_void;

/// cuInit with 8 emulated devices, then device `dev`'s primary context made current.
fn on_device(dev: i32) {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        std::env::set_var("RINGATTN_EMU_GPU_COUNT", "8");
        assert_eq!(unsafe { cuInit(0) }, SUCCESS);
    });
    let mut ctx: Ptr = null_mut();
    unsafe {
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, dev), SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), SUCCESS);
    }
}

fn text(code: i32) -> String {
    let mut s = std::ptr::null();
    unsafe {
        cuGetErrorString(code, &mut s);
        CStr::from_ptr(s).to_string_lossy().into_owned()
    }
}

fn stream() -> Ptr {
    let mut s: Ptr = null_mut();
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, SUCCESS);
    s
}

fn alloc(bytes: usize) -> u64 {
    let mut p = 0u64;
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, bytes) }, SUCCESS);
    p
}

/// The embedded image of `family` for `target`, expanded.
fn image(family: &str, target: &str) -> Option<&'static [u8]> {
    images().iter().find(|i| i.family == family && i.target == target).map(|i| i.bytes().expect("the image expands"))
}

fn load(bytes: &[u8]) -> Result<Ptr, i32> {
    let mut m: Ptr = null_mut();
    // PTX is handed over NUL-terminated, as cudarc hands it.
    let mut owned = bytes.to_vec();
    owned.push(0);
    match unsafe { cuModuleLoadData(&mut m, owned.as_ptr().cast()) } {
        SUCCESS => Ok(m),
        e => Err(e),
    }
}

/// A ring step: the compute stream writes a block, the copy stream sends it to the next rank.
/// With the event wait between them, fine; without it, the driver reports a cross-stream race
/// naming both operations and both streams, and the context's later calls fail.
#[test]
fn a_ring_step_without_its_event_wait_is_a_cross_stream_race() {
    on_device(1);
    let (compute, copy) = (stream(), stream());
    let n = 4096usize;
    let (block, sent) = (alloc(4 * n), alloc(4 * n));
    let mut ev: Ptr = null_mut();
    unsafe {
        assert_eq!(cuEventCreate(&mut ev, 2), SUCCESS);
        // Ordered: the send waits for the block's event.
        assert_eq!(cuMemsetD32Async(block, 1.0f32.to_bits(), n, compute), SUCCESS);
        assert_eq!(cuEventRecord(ev, compute), SUCCESS);
        assert_eq!(cuStreamWaitEvent(copy, ev, 0), SUCCESS);
        assert_eq!(cuMemcpyDtoDAsync_v2(sent, block, 4 * n, copy), SUCCESS);
        assert_eq!(cuCtxSynchronize(), SUCCESS);
        let mut host = vec![0f32; n];
        assert_eq!(cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), sent, 4 * n), SUCCESS);
        assert!(host.iter().all(|&x| x == 1.0));
        // The planted fault: the next block's send without the wait.
        assert_eq!(cuMemsetD32Async(block, 2.0f32.to_bits(), n, compute), SUCCESS);
        assert_eq!(cuMemcpyDtoDAsync_v2(sent, block, 4 * n, copy), SUCCESS);
        let e = cuCtxSynchronize();
        assert_eq!(e, LAUNCH_FAILED, "{}", text(e));
        let msg = text(e);
        assert!(msg.contains("cross-stream race"), "{msg}");
        assert!(msg.contains("cuMemsetD32Async") && msg.contains("cuMemcpyDtoDAsync"), "names both operations: {msg}");
        assert_eq!(msg.matches("(non-blocking").count(), 2, "names both streams: {msg}");
        // Sticky: the context's later work fails the same way.
        let mut p = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut p, 256), LAUNCH_FAILED);
    }
}

/// A kernel the sm_90a image lacks fails to load, naming it; images for other architectures
/// do not load on the emulated 9.0.
#[test]
fn a_kernel_missing_from_the_sm_90a_image_fails_to_load_naming_it() {
    on_device(2);
    let Some(fwd) = image("flash_fwd", "sm_90a") else {
        eprintln!("SKIPPED: this build embedded no kernels (nvcc was not found)");
        return;
    };
    let m = load(fwd).expect("the sm_90a forward loads on 9.0");
    let mut f: Ptr = null_mut();
    let ok = c"ringattn_flash_fwd_bf16_d64";
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, ok.as_ptr()) }, SUCCESS);
    // A kernel of another family: the emulator has it, this image does not.
    let missing = c"ringattn_flash_bwd_dq_bf16_d192";
    let e = unsafe { cuModuleGetFunction(&mut f, m, missing.as_ptr()) };
    assert_eq!(e, NOT_FOUND);
    let msg = text(e);
    assert!(msg.contains("ringattn_flash_bwd_dq_bf16_d192") && msg.contains("sm_90"), "{msg}");
    let sm80 = image("flash_fwd", "sm_80").expect("an sm_80 image beside the sm_90a one");
    assert_eq!(load(sm80).unwrap_err(), NO_BINARY_FOR_GPU, "an sm_80 cubin does not run on 9.0");
    if let Some(ptx) = images().iter().find(|i| i.family == "merge" && i.kind == ImageKind::Ptx) {
        let bytes = ptx.bytes().expect("PTX expands");
        assert_eq!(load(bytes).unwrap_err(), NO_BINARY_FOR_GPU, "{} PTX is newer than 9.0", ptx.target);
    }
}

/// More than 48 KiB of dynamic shared memory needs the function's opt-in, up to 227 KiB.
#[test]
fn a_launch_needing_100_kib_of_shared_memory_without_the_opt_in_fails() {
    on_device(3);
    let Some(fwd) = image("flash_fwd", "sm_90a") else {
        eprintln!("SKIPPED: this build embedded no kernels");
        return;
    };
    let m = load(fwd).unwrap();
    let mut f: Ptr = null_mut();
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, c"ringattn_flash_fwd_bf16_d64".as_ptr()) }, SUCCESS);
    let mut params = [0u8; std::mem::size_of::<ringattn::kernels::params::FlashFwdParams>()];
    let mut arg: [*mut c_void; 1] = [params.as_mut_ptr().cast()];
    let s = stream();
    let launch = |smem: u32, arg: &mut [*mut c_void; 1]| unsafe {
        cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, smem, s, arg.as_mut_ptr(), null_mut())
    };
    let e = launch(100 << 10, &mut arg);
    assert_eq!(e, INVALID_VALUE);
    assert!(text(e).contains("102400 bytes of dynamic shared memory"), "{}", text(e));
    unsafe {
        let mut limit = 0;
        assert_eq!(cuFuncGetAttribute(&mut limit, 8, f), SUCCESS);
        assert!(limit <= 48 << 10, "{limit}");
        assert_eq!(cuFuncSetAttribute(f, 8, 240 << 10), INVALID_VALUE, "beyond the 227 KiB opt-in");
        assert_eq!(cuFuncSetAttribute(f, 8, 100 << 10), SUCCESS);
        assert_eq!(cuFuncGetAttribute(&mut limit, 8, f), SUCCESS);
        assert_eq!(limit, 100 << 10);
        // Too many threads for the kernel's __launch_bounds__(128).
        assert_eq!(cuLaunchKernel(f, 1, 1, 1, 256, 1, 1, 0, s, arg.as_mut_ptr(), null_mut()), INVALID_VALUE);
    }
}

/// A kernel writing past its buffer: `CUDA_ERROR_ILLEGAL_ADDRESS`, sticky for the context.
#[test]
fn an_out_of_bounds_write_is_a_sticky_illegal_address() {
    on_device(4);
    let Some(ops) = image("ops", "sm_90a") else {
        eprintln!("SKIPPED: this build embedded no kernels");
        return;
    };
    let m = load(ops).unwrap();
    let mut f: Ptr = null_mut();
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, c"ringattn_ops_fill_f32".as_ptr()) }, SUCCESS);
    let buf = alloc(1024);
    let s = stream();
    let fill = |len: i64| {
        let mut p = ringattn::kernels::params::OpsParams { dst: buf, len, value: 3.0, ..Default::default() };
        let mut arg: [*mut c_void; 1] = [(&mut p as *mut ringattn::kernels::params::OpsParams).cast()];
        unsafe { cuLaunchKernel(f, 2, 1, 1, 256, 1, 1, 0, s, arg.as_mut_ptr(), null_mut()) }
    };
    assert_eq!(fill(256), SUCCESS);
    assert_eq!(unsafe { cuStreamSynchronize(s) }, SUCCESS);
    let mut host = vec![0f32; 256];
    assert_eq!(unsafe { cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), buf, 1024) }, SUCCESS);
    assert!(host.iter().all(|&x| x == 3.0), "the kernel ran");
    // 512 floats into 1 KiB: the launch is accepted, the fault surfaces later.
    assert_eq!(fill(512), SUCCESS);
    let e = unsafe { cuStreamSynchronize(s) };
    assert_eq!(e, ILLEGAL_ADDRESS, "{}", text(e));
    assert!(text(e).contains("outside every buffer"), "{}", text(e));
    let mut p = 0u64;
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, 256) }, ILLEGAL_ADDRESS, "sticky");
}

/// cuTensorMapEncodeTiled refuses what the driver refuses.
#[test]
fn tensor_maps_follow_the_drivers_rules() {
    on_device(5);
    #[repr(C, align(128))]
    struct Map([u64; 32]);
    let mut m = Map([0; 32]);
    let buf = alloc(64 * 64 * 2);
    let dims = [64u64, 64];
    let strides = [128u64];
    let es = [1u32, 1];
    let enc = |map: *mut [u64; 16], boxes: [u32; 2], addr: u64, swizzle: i32| unsafe {
        cuTensorMapEncodeTiled(
            map,
            9,
            2,
            addr as Ptr,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            es.as_ptr(),
            0,
            swizzle,
            2,
            0,
        )
    };
    let base = m.0.as_mut_ptr().cast::<[u64; 16]>();
    assert_eq!(enc(base, [64, 64], buf, 3), SUCCESS);
    assert_eq!(m.0[0] & 0xFFFF_FFFF, 0x5241_544D, "the emulator's encoding");
    // A map that is not 64-byte aligned; a box over 256; a row wider than the swizzle span;
    // an address that is not 16-byte aligned.
    assert_eq!(enc(unsafe { m.0.as_mut_ptr().add(1) }.cast(), [64, 64], buf, 3), INVALID_VALUE);
    assert_eq!(enc(base, [64, 512], buf, 3), INVALID_VALUE);
    assert_eq!(enc(base, [128, 64], buf, 3), INVALID_VALUE);
    assert_eq!(enc(base, [64, 64], buf + 8, 3), INVALID_VALUE);
}

/// Freeing memory that another stream's queued work still reads, with nothing ordering the
/// two, is reported: as a cross-stream race when the read runs first (a free is a write of
/// the whole allocation, in stream order), as an access to freed memory naming the free when
/// the free runs first.
#[test]
fn freeing_memory_another_stream_still_reads_is_reported() {
    on_device(6);
    let (a, b) = (stream(), stream());
    let n = 1 << 16;
    let (src, dst) = (alloc(n), alloc(n));
    unsafe {
        assert_eq!(cuMemsetD8Async(src, 7, n, a), SUCCESS);
        assert_eq!(cuStreamSynchronize(a), SUCCESS);
        // Stream a reads src; stream b frees it without waiting for a.
        assert_eq!(cuMemcpyDtoDAsync_v2(dst, src, n, a), SUCCESS);
        assert_eq!(cuMemFreeAsync(src, b), SUCCESS);
        let e = cuCtxSynchronize();
        let msg = text(e);
        let race = e == LAUNCH_FAILED && msg.contains("cross-stream race");
        let freed = e == ILLEGAL_ADDRESS && msg.contains("not live memory (freed by cuMemFreeAsync");
        assert!((race || freed) && msg.contains("cuMemFreeAsync"), "{e}: {msg}");
    }
}

/// A fatbin (what nvcc's `-fatbin` writes): the entry that runs on 9.0 is picked among
/// others; a compressed entry is refused with a clear error rather than misread.
#[test]
fn a_fatbin_loads_the_entry_for_the_device() {
    on_device(7);
    let (Some(sm80), Some(sm90)) = (image("ops", "sm_80"), image("ops", "sm_90a")) else {
        eprintln!("SKIPPED: this build embedded no kernels");
        return;
    };
    // Entry header (64 bytes): kind 2 (ELF) @0, version @2, header size @4, payload size @8,
    // compressed size @16, sm @28, flags @40 (0x2000 LZ4), uncompressed size @56.
    let entry = |payload: &[u8], sm: u32, flags: u64| {
        let mut h = vec![0u8; 64];
        h[0..2].copy_from_slice(&2u16.to_le_bytes());
        h[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
        h[4..8].copy_from_slice(&64u32.to_le_bytes());
        h[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        h[28..32].copy_from_slice(&sm.to_le_bytes());
        h[40..48].copy_from_slice(&(flags | 0x11).to_le_bytes());
        h[56..64].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h.extend_from_slice(payload);
        h
    };
    let fatbin = |entries: Vec<Vec<u8>>| {
        let body: Vec<u8> = entries.concat();
        let mut f = Vec::new();
        f.extend_from_slice(&0xBA55_ED50u32.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(&(body.len() as u64).to_le_bytes());
        f.extend_from_slice(&body);
        f
    };
    let m = load(&fatbin(vec![entry(sm80, 80, 0), entry(sm90, 90, 0)])).expect("the sm_90 entry loads");
    let mut f: Ptr = null_mut();
    assert_eq!(unsafe { cuModuleGetFunction(&mut f, m, c"ringattn_ops_fill_f32".as_ptr()) }, SUCCESS);
    assert_eq!(load(&fatbin(vec![entry(sm80, 80, 0)])).unwrap_err(), NO_BINARY_FOR_GPU, "only an sm_80 entry");
    let e = load(&fatbin(vec![entry(sm90, 90, 0x2000)])).unwrap_err();
    assert!(text(e).contains("compressed"), "{}", text(e));
}
