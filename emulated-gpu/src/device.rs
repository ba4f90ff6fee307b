//! The emulated GPU's identity and limits: an H200-class device of compute capability 9.0 by
//! default (`RINGATTN_EMU_GPU_ARCH=80|90|100` picks another; `RINGATTN_EMU_GPU_COUNT` the
//! number of devices), with the real device's attributes (cuda-driver.md §2.6).

/// What the stand-in says its devices are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Compute capability, major·10 + minor.
    pub cc: u32,
    /// `cuDeviceGetName`: says plainly that this is the emulated device.
    pub name: String,
    /// `cuDeviceTotalMem`, bytes.
    pub total_mem: u64,
}

/// The name every emulated device carries (ringattn's doctor and benchmarks look for it).
pub const EMULATED_MARK: &str = ringattn::kernels::EMULATED_GPU_MARK;

/// Devices from the environment.
pub fn devices() -> Vec<DeviceSpec> {
    let cc = std::env::var("RINGATTN_EMU_GPU_ARCH")
        .ok()
        .and_then(|v| v.trim_start_matches("sm_").parse().ok())
        .unwrap_or(90);
    let count = std::env::var("RINGATTN_EMU_GPU_COUNT").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize);
    let model = match cc {
        80..=89 => "A100-SXM4-80GB",
        100..=109 => "B200",
        _ => "H200",
    };
    (0..count)
        .map(|_| DeviceSpec {
            cc,
            name: format!("NVIDIA {model} ({EMULATED_MARK}: kernels run on the CPU)"),
            total_mem: 143_771 << 20,
        })
        .collect()
}

/// Default dynamic shared memory a launch may use without the opt-in.
pub const SMEM_DEFAULT: u32 = 49_152;
/// The opt-in limit per block on 9.0 (227 KiB); 163 KiB on 8.0.
pub fn smem_optin(cc: u32) -> u32 {
    if cc / 10 == 8 {
        166_912
    } else {
        232_448
    }
}

/// `cuDeviceGetAttribute` of `attr` on a device of capability `cc`, `None` for an attribute
/// this stand-in does not know.
pub fn attribute(attr: i32, cc: u32) -> Option<i32> {
    Some(match attr {
        1 => 1024,                // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,            // MAX_BLOCK_DIM_X / Y
        4 => 64,                  // MAX_BLOCK_DIM_Z
        5 => i32::MAX,            // MAX_GRID_DIM_X
        6 | 7 => 65_535,          // MAX_GRID_DIM_Y / Z
        8 => SMEM_DEFAULT as i32, // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65_536,              // TOTAL_CONSTANT_MEMORY
        10 => 32,                 // WARP_SIZE
        11 => 2_147_483_647,      // MAX_PITCH
        12 => 65_536,             // MAX_REGISTERS_PER_BLOCK
        13 => 1_980_000,          // CLOCK_RATE (kHz)
        14 => 512,                // TEXTURE_ALIGNMENT
        15 => 1,                  // GPU_OVERLAP
        16 => {
            if cc / 10 == 8 {
                108
            } else {
                132
            }
        } // MULTIPROCESSOR_COUNT
        17 => 0,                  // KERNEL_EXEC_TIMEOUT
        18 => 0,                  // INTEGRATED
        19 => 1,                  // CAN_MAP_HOST_MEMORY
        20 => 0,                  // COMPUTE_MODE default
        31 => 1,                  // CONCURRENT_KERNELS
        32 => 1,                  // ECC_ENABLED
        33 => 0,                  // PCI_BUS_ID
        34 => 0,                  // PCI_DEVICE_ID
        35 => 0,                  // TCC_DRIVER
        36 => 3_201_000,          // MEMORY_CLOCK_RATE (kHz)
        37 => 6_144,              // GLOBAL_MEMORY_BUS_WIDTH
        38 => 62_914_560,         // L2_CACHE_SIZE
        39 => 2_048,              // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 3,                  // ASYNC_ENGINE_COUNT
        41 => 1,                  // UNIFIED_ADDRESSING
        50 => 0,                  // PCI_DOMAIN_ID
        75 => (cc / 10) as i32,   // COMPUTE_CAPABILITY_MAJOR
        76 => (cc % 10) as i32,   // COMPUTE_CAPABILITY_MINOR
        81 => 233_472,            // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65_536,             // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 1,                  // MANAGED_MEMORY
        84 => 0,                  // MULTI_GPU_BOARD
        86 => 1,                  // HOST_NATIVE_ATOMIC_SUPPORTED
        95 => 1,                  // COOPERATIVE_LAUNCH
        97 => smem_optin(cc) as i32, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        106 => 32,                // MAX_BLOCKS_PER_MULTIPROCESSOR
        111 => 1_024,             // RESERVED_SHARED_MEMORY_PER_BLOCK
        115 => 1,                 // MEMORY_POOLS_SUPPORTED
        120 => i32::from(cc >= 90), // CLUSTER_LAUNCH
        127 => i32::from(cc >= 90), // TENSOR_MAP_ACCESS_SUPPORTED
        _ => return None,
    })
}
