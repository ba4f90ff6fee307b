//! The checks of `cuLaunchKernel` and `cuFuncSetAttribute`, as the real driver makes them:
//! grid and block limits, the kernel's `__launch_bounds__`, registers, dynamic shared memory
//! against the function's limit (48 KiB unless raised), the parameter sizes the image declares
//! against the emulator's params struct, and every tensor map's place in the parameter space
//! (a 128-byte multiple of constant bank 0: CUDA 13's `CUtensorMap` is `alignas(128)`).

use ringattn::emu::named::NamedKernel;

use crate::codes::{Failure, INVALID_VALUE, LAUNCH_OUT_OF_RESOURCES, MISALIGNED_ADDRESS, NOT_SUPPORTED};
use crate::device::{smem_optin, SMEM_DEFAULT};
use crate::image::KernelInfo;

/// A launch's geometry as `cuLaunchKernel` receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem: u32,
}

/// The default `MAX_DYNAMIC_SHARED_SIZE_BYTES` of a kernel: 48 KiB less its static memory.
pub fn default_max_dynamic(info: &KernelInfo) -> u32 {
    SMEM_DEFAULT.saturating_sub(info.static_smem)
}

/// `cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, value)`: at most the opt-in limit less
/// the static memory.
pub fn check_max_dynamic(info: &KernelInfo, value: i32, cc: u32) -> Result<u32, Failure> {
    let limit = smem_optin(cc).saturating_sub(info.static_smem);
    if value < 0 || value as u32 > limit {
        return Err(Failure::new(
            INVALID_VALUE,
            format!(
                "cuFuncSetAttribute({}, MAX_DYNAMIC_SHARED_SIZE_BYTES, {value}): at most {limit} bytes on this device \
                 ({} opt-in less {} static)",
                info.name,
                smem_optin(cc),
                info.static_smem
            ),
        ));
    }
    Ok(value as u32)
}

/// Checks a launch of `info` (the image's view) run as `kernel` (the emulator's) with
/// `max_dynamic` the function's current dynamic shared-memory limit.
pub fn check(info: &KernelInfo, kernel: &NamedKernel, g: Geometry, max_dynamic: u32) -> Result<(), Failure> {
    let name = &info.name;
    let invalid = |what: String| Err(Failure::new(INVALID_VALUE, format!("cuLaunchKernel({name}): {what}")));
    let [gx, gy, gz] = g.grid;
    let [bx, by, bz] = g.block;
    if gx == 0 || gy == 0 || gz == 0 || gx > i32::MAX as u32 || gy > 65_535 || gz > 65_535 {
        return invalid(format!("grid {gx} x {gy} x {gz} outside 1 ... 2^31-1 x 65535 x 65535"));
    }
    if bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 {
        return invalid(format!("block {bx} x {by} x {bz} outside 1 ... 1024 x 1024 x 64"));
    }
    let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
    if threads > 1024 {
        return invalid(format!("block of {threads} threads (at most 1024)"));
    }
    if let Some(bound) = info.max_threads {
        if threads > u64::from(bound) {
            return invalid(format!("block of {threads} threads exceeds the kernel's __launch_bounds__ ({bound})"));
        }
    }
    if info.registers > 0 {
        let regs = u64::from(info.registers.div_ceil(8) * 8) * threads.div_ceil(32) * 32;
        if regs > 65_536 {
            return Err(Failure::new(
                LAUNCH_OUT_OF_RESOURCES,
                format!(
                    "cuLaunchKernel({name}): {threads} threads x {} registers exceed the 65536 of a block",
                    info.registers
                ),
            ));
        }
    }
    if g.smem > max_dynamic {
        return invalid(format!(
            "{} bytes of dynamic shared memory, the kernel's limit is {max_dynamic} (48 KiB unless raised with \
             cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES))",
            g.smem
        ));
    }
    if by != 1 || bz != 1 {
        return Err(Failure::new(
            NOT_SUPPORTED,
            format!("cuLaunchKernel({name}): the emulator runs one-dimensional blocks"),
        ));
    }
    let [p] = info.params.as_slice() else {
        return Err(Failure::new(
            NOT_SUPPORTED,
            format!(
                "cuLaunchKernel({name}): {} parameters; the emulated kernels take one params struct",
                info.params.len()
            ),
        ));
    };
    if p.size as usize != kernel.param_bytes {
        return invalid(format!(
            "the image declares a {}-byte parameter, the emulator's params struct has {} bytes (cuda/params.h and the \
             image disagree)",
            p.size, kernel.param_bytes
        ));
    }
    for &off in &kernel.tensor_map_offsets {
        let at = info.param_base as usize + p.offset as usize + off;
        if !at.is_multiple_of(128) {
            return Err(Failure::new(
                MISALIGNED_ADDRESS,
                format!(
                    "cuLaunchKernel({name}): the tensor map at byte {off} of the parameter sits at constant-bank offset \
                     {at:#x}, not a multiple of 128 (CUtensorMap is alignas(128) in CUDA 13)"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::Param;

    fn hopper_fwd(offset: u32) -> (KernelInfo, &'static NamedKernel) {
        let k = ringattn::emu::named::find("ringattn_hopper_flash_fwd_bf16_d64").expect("the Hopper forward");
        let info = KernelInfo {
            name: k.name.into(),
            params: vec![Param { ordinal: 0, offset, size: k.param_bytes as u32 }],
            param_base: 0x210,
            max_threads: Some(384),
            registers: 168,
            static_smem: 0,
        };
        (info, k)
    }

    const G: Geometry = Geometry { grid: [4, 2, 1], block: [384, 1, 1], smem: 40_000 };

    #[test]
    fn a_tensor_map_off_a_128_byte_multiple_fails_the_launch() {
        let (info, k) = hopper_fwd(0x70);
        check(&info, k, G, 49_152).expect("maps at 0x210 + 0x70 + 256·i: aligned");
        // The parameter 64 bytes further: each map 64-byte but not 128-byte aligned.
        let (info, k) = hopper_fwd(0xb0);
        let e = check(&info, k, G, 49_152).unwrap_err();
        assert_eq!(e.code, MISALIGNED_ADDRESS, "{e:?}");
        assert!(e.detail.contains("not a multiple of 128"), "{}", e.detail);
    }

    #[test]
    fn dynamic_shared_memory_beyond_48_kib_needs_the_opt_in() {
        let (info, k) = hopper_fwd(0x70);
        let big = Geometry { smem: 100 << 10, ..G };
        let e = check(&info, k, big, default_max_dynamic(&info)).unwrap_err();
        assert_eq!(e.code, INVALID_VALUE);
        assert!(e.detail.contains("102400 bytes of dynamic shared memory"), "{}", e.detail);
        let raised = check_max_dynamic(&info, 100 << 10, 90).unwrap();
        check(&info, k, big, raised).expect("after the opt-in");
        assert!(check_max_dynamic(&info, 240 << 10, 90).is_err(), "beyond 227 KiB");
    }

    #[test]
    fn limits_of_the_grid_block_and_registers() {
        let (info, k) = hopper_fwd(0x70);
        for (grid, block) in [([1, 65_536, 1], [384, 1, 1]), ([0, 1, 1], [384, 1, 1]), ([1, 1, 1], [512, 1, 1])] {
            assert_eq!(check(&info, k, Geometry { grid, block, smem: 0 }, 49_152).unwrap_err().code, INVALID_VALUE);
        }
        let mut heavy = info.clone();
        (heavy.registers, heavy.max_threads) = (255, None);
        let e = check(&heavy, k, Geometry { grid: [1, 1, 1], block: [384, 1, 1], smem: 0 }, 49_152).unwrap_err();
        assert_eq!(e.code, LAUNCH_OUT_OF_RESOURCES);
        let mut wrong = info;
        wrong.params[0].size = 576;
        assert!(check(&wrong, k, G, 49_152).unwrap_err().detail.contains("disagree"));
    }
}
