//! The C types of NCCL's API that ringattn passes to the library it loads itself
//! ([`super::nccl_lib`]), as `nccl.h` (2.28 and later) lays them out. Declared here rather
//! than taken from cudarc's `nccl` feature, which makes the final link require `libnccl.so`
//! whenever another crate in the build (candle with CUDA) asks cudarc for
//! `dynamic-linking`. Results, data types and operations are C enums: they are declared as
//! transparent integers (a library may return a value this file does not name).
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclComm_t`: an opaque communicator handle.
pub type ncclComm_t = *mut c_void;

/// `cudaStream_t`: the driver API's stream handle (the same object).
pub type cudaStream_t = cudarc::driver::sys::CUstream;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclUniqueId {
    /// The bytes.
    pub internal: [c_char; 128],
}

/// `ncclResult_t`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ncclResult_t(pub c_uint);

// Every value of the C enum, named (errors are reported by value).
#[allow(dead_code)]
impl ncclResult_t {
    pub const ncclSuccess: ncclResult_t = ncclResult_t(0);
    pub const ncclUnhandledCudaError: ncclResult_t = ncclResult_t(1);
    pub const ncclSystemError: ncclResult_t = ncclResult_t(2);
    pub const ncclInternalError: ncclResult_t = ncclResult_t(3);
    pub const ncclInvalidArgument: ncclResult_t = ncclResult_t(4);
    pub const ncclInvalidUsage: ncclResult_t = ncclResult_t(5);
    pub const ncclRemoteError: ncclResult_t = ncclResult_t(6);
    pub const ncclInProgress: ncclResult_t = ncclResult_t(7);
}

/// `ncclDataType_t`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ncclDataType_t(pub c_uint);

// The types ringattn's buffers can hold.
impl ncclDataType_t {
    pub const ncclUint8: ncclDataType_t = ncclDataType_t(1);
    pub const ncclFloat16: ncclDataType_t = ncclDataType_t(6);
    pub const ncclFloat32: ncclDataType_t = ncclDataType_t(7);
    pub const ncclBfloat16: ncclDataType_t = ncclDataType_t(9);
}

/// `ncclRedOp_t`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ncclRedOp_t(pub c_uint);

impl ncclRedOp_t {
    pub const ncclSum: ncclRedOp_t = ncclRedOp_t(0);
}

/// `ncclConfig_t` as NCCL 2.28+ declares it; `size` and `version` tell the library which
/// fields a caller knows (older libraries read the prefix they know).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
}
