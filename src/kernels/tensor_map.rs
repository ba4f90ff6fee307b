//! Tensor maps: the operand of the bulk tensor copies (TMA) of the Hopper kernels.
//!
//! A [`TensorMapSpec`] names a tiled view of a tensor in global memory — data type, base
//! address, dims (innermost first, in elements), the byte strides of dims 1.., the box a copy
//! moves, its shared-memory swizzle and the fill of elements outside the tensor — and is
//! validated once against the driver's rules (`cuTensorMapEncodeTiled`,
//! `../shared/reference/hopper-ptx.md` §4.2), so that both encoders see the same accepted
//! input: [`TensorMapSpec::encode_emulated`] writes the emulator's encoding (read by the
//! twins in `cuda/ptx.cuh`), `TensorMapSpec::encode_driver` (feature `cuda`) the driver's.
//!
//! ```
//! use ringattn::kernels::tensor_map::{TensorMapDType, TensorMapSpec, TensorMapSwizzle};
//!
//! // K of layout [b = 1, s = 1000, h_kv = 2, d = 64] in bf16: boxes of 64 columns x 128
//! // keys of one head, 128-byte swizzled.
//! let (s, h, d) = (1000u64, 2u64, 64u64);
//! let spec = TensorMapSpec {
//!     dtype: TensorMapDType::BF16,
//!     address: 0x7f00_0000_0000,
//!     dims: vec![d, h, s],
//!     strides: vec![d * 2, h * d * 2],
//!     box_dims: vec![64, 1, 128],
//!     swizzle: TensorMapSwizzle::B128,
//!     ..Default::default()
//! };
//! assert_eq!(spec.box_bytes(), 64 * 128 * 2);
//! let map = spec.encode_emulated()?;
//! assert_eq!(map.words[2..5], [64, 2, 1000]);
//! // A box row wider than the swizzle span is refused, naming it.
//! let wide = TensorMapSpec { box_dims: vec![128, 1, 64], ..spec };
//! assert!(wide.validate().unwrap_err().to_string().contains("128-byte swizzle"));
//! # Ok::<(), ringattn::Error>(())
//! ```

use super::geometry;
use super::params::{FlashBwdHopperParams, FlashBwdParams, FlashFwdHopperParams, FlashFwdParams, TensorMap};
use crate::{DType, Dims, Error, Result};

/// Element type of a tensor map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TensorMapDType {
    /// bfloat16 (`CU_TENSOR_MAP_DATA_TYPE_BFLOAT16`).
    #[default]
    BF16,
    /// IEEE half (`CU_TENSOR_MAP_DATA_TYPE_FLOAT16`).
    F16,
    /// f32 (`CU_TENSOR_MAP_DATA_TYPE_FLOAT32`).
    F32,
}

impl TensorMapDType {
    /// The driver's `CUtensorMapDataType` value.
    pub fn code(self) -> u32 {
        match self {
            TensorMapDType::BF16 => 9,
            TensorMapDType::F16 => 6,
            TensorMapDType::F32 => 7,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            TensorMapDType::F32 => 4,
            _ => 2,
        }
    }
}

/// Shared-memory swizzle of the boxes a tensor map copies: 16-byte chunks XOR-ed by the
/// absolute shared address (`../shared/reference/hopper-ptx.md` §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TensorMapSwizzle {
    /// No swizzle.
    None,
    /// 32-byte span (pattern repeats every 256 bytes).
    B32,
    /// 64-byte span (every 512 bytes).
    B64,
    /// 128-byte span (every 1024 bytes): what wgmma operands of 64 bf16 columns use.
    #[default]
    B128,
}

impl TensorMapSwizzle {
    /// The driver's `CUtensorMapSwizzle` value.
    pub fn code(self) -> u32 {
        match self {
            TensorMapSwizzle::None => 0,
            TensorMapSwizzle::B32 => 1,
            TensorMapSwizzle::B64 => 2,
            TensorMapSwizzle::B128 => 3,
        }
    }

    /// The widest box row (bytes) the swizzle allows, `None` for no limit.
    pub fn span(self) -> Option<u64> {
        match self {
            TensorMapSwizzle::None => None,
            TensorMapSwizzle::B32 => Some(32),
            TensorMapSwizzle::B64 => Some(64),
            TensorMapSwizzle::B128 => Some(128),
        }
    }
}

/// What a load writes for box elements outside the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OobFill {
    /// Zeros (`CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`).
    #[default]
    Zeros,
    /// NaN (`..._NAN_REQUEST_ZERO_FMA`; float types only).
    Nan,
}

/// A tiled view of a tensor for the bulk tensor copies; see the module documentation.
/// Interleave is none, element strides 1, L2 promotion 128 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorMapSpec {
    /// Element type.
    pub dtype: TensorMapDType,
    /// Global address of element (0, 0, ...): 16-byte aligned (a host address under the
    /// emulator, a device address on a GPU).
    pub address: u64,
    /// Extent of each dim in elements, innermost first (rank = `dims.len()`, 1 ... 5), each
    /// 1 ... 2^32.
    pub dims: Vec<u64>,
    /// Byte stride of dims 1 ... rank - 1 (dim 0 is contiguous): multiples of 16, < 2^40.
    pub strides: Vec<u64>,
    /// Elements per dim of the box one copy moves: 1 ... 256 each; the innermost row
    /// (`box_dims[0]` elements) a multiple of 16 bytes and at most the swizzle span.
    pub box_dims: Vec<u32>,
    /// Shared-memory swizzle of the box.
    pub swizzle: TensorMapSwizzle,
    /// Fill of elements outside the tensor.
    pub oob_fill: OobFill,
}

fn invalid(msg: String) -> Error {
    Error::TensorMap(msg)
}

impl TensorMapSpec {
    /// The rank (number of dims).
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Bytes one copy moves (the whole box, elements outside the tensor included): what the
    /// mbarrier's expect-tx must announce.
    pub fn box_bytes(&self) -> u64 {
        self.box_dims.iter().map(|&b| u64::from(b)).product::<u64>() * self.dtype.size()
    }

    /// Checks the driver's rules; [`Error::TensorMap`] names the first field that breaks one.
    pub fn validate(&self) -> Result<()> {
        let rank = self.rank();
        if !(1..=5).contains(&rank) {
            return Err(invalid(format!("rank {rank} outside 1 ... 5 (dims {:?})", self.dims)));
        }
        if self.strides.len() != rank - 1 {
            return Err(invalid(format!(
                "{} strides for rank {rank} (one per dim after the first)",
                self.strides.len()
            )));
        }
        if self.box_dims.len() != rank {
            return Err(invalid(format!("{} box dims for rank {rank}", self.box_dims.len())));
        }
        if !self.address.is_multiple_of(16) {
            return Err(invalid(format!("global address {:#x} is not 16-byte aligned", self.address)));
        }
        for (i, &d) in self.dims.iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return Err(invalid(format!("dim {i} = {d} outside 1 ... 2^32")));
            }
        }
        for (i, &s) in self.strides.iter().enumerate() {
            if !s.is_multiple_of(16) || s >= 1 << 40 {
                return Err(invalid(format!(
                    "stride of dim {} = {s} bytes: must be a multiple of 16 below 2^40",
                    i + 1
                )));
            }
        }
        for (i, &b) in self.box_dims.iter().enumerate() {
            if !(1..=256).contains(&b) {
                return Err(invalid(format!("box dim {i} = {b} outside 1 ... 256")));
            }
        }
        let row = u64::from(self.box_dims[0]) * self.dtype.size();
        if !row.is_multiple_of(16) {
            return Err(invalid(format!("box row of {row} bytes is not a multiple of 16")));
        }
        if let Some(span) = self.swizzle.span() {
            if row > span {
                return Err(invalid(format!(
                    "box row of {row} bytes exceeds the {span}-byte swizzle span (box dim 0 = {})",
                    self.box_dims[0]
                )));
            }
        }
        Ok(())
    }

    /// The emulator's encoding (`cuda/ptx.cuh`, bulk tensor copy twins): word 0 the magic
    /// `0x5241544D`, data type, rank, swizzle and fill; word 1 the address; words 2-6 the
    /// dims; 7-10 the strides; 11 the box dims (12 bits each).
    pub fn encode_emulated(&self) -> Result<TensorMap> {
        self.validate()?;
        let mut w = [0u64; 16];
        let fill = match self.oob_fill {
            OobFill::Zeros => 0u64,
            OobFill::Nan => 1,
        };
        w[0] = 0x5241_544D
            | u64::from(self.dtype.code()) << 32
            | (self.rank() as u64) << 40
            | u64::from(self.swizzle.code()) << 44
            | fill << 48;
        w[1] = self.address;
        w[2..2 + self.rank()].copy_from_slice(&self.dims);
        w[7..7 + self.strides.len()].copy_from_slice(&self.strides);
        w[11] = self.box_dims.iter().enumerate().map(|(i, &b)| u64::from(b) << (12 * i)).fold(0, |a, b| a | b);
        Ok(TensorMap { words: w })
    }

    /// The driver's encoding (`cuTensorMapEncodeTiled`), for kernels on a GPU; the driver's
    /// refusal comes back as [`Error::TensorMap`] with its status.
    #[cfg(feature = "cuda")]
    pub fn encode_driver(&self) -> Result<TensorMap> {
        use cudarc::driver::sys;
        self.validate()?;
        let dtype = match self.dtype {
            TensorMapDType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            TensorMapDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TensorMapDType::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        let swizzle = match self.swizzle {
            TensorMapSwizzle::None => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            TensorMapSwizzle::B32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
            TensorMapSwizzle::B64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            TensorMapSwizzle::B128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        };
        let fill = match self.oob_fill {
            OobFill::Zeros => sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            OobFill::Nan => sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA,
        };
        let element_strides = vec![1u32; self.rank()];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: the arrays hold `rank` dims and box dims, `rank - 1` strides and `rank`
        // element strides (validated above); `map` is a 128-byte aligned CUtensorMap the call
        // writes. The address is only recorded, not dereferenced.
        let status = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                dtype,
                self.rank() as u32,
                self.address as *mut std::ffi::c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.box_dims.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                fill,
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(invalid(format!("cuTensorMapEncodeTiled refused {self:?}: {status:?}")));
        }
        Ok(TensorMap { words: map.opaque })
    }
}

/// The map of a `[b, s, h, d]` 16-bit tensor at `address` as the flash kernels copy it: a
/// 4-d view `{d, h, s, b}` (innermost first) whose boxes are 64 columns (128 bytes,
/// 128-byte swizzled) × 1 head × `rows` rows × 1 batch; a kernel copies `ceil(d / 64)` boxes
/// side by side for a tile of `rows` rows (columns past `d` and rows past `s` arrive as zeros).
pub fn bshd_tile_map(
    dtype: TensorMapDType,
    address: u64,
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    rows: u32,
) -> TensorMapSpec {
    let e = dtype.size();
    let (b, s, h, d) = (b as u64, s as u64, h as u64, d as u64);
    TensorMapSpec {
        dtype,
        address,
        dims: vec![d, h, s, b],
        strides: vec![d * e, h * d * e, s * h * d * e],
        box_dims: vec![64, 1, rows, 1],
        swizzle: TensorMapSwizzle::B128,
        oob_fill: OobFill::Zeros,
    }
}

/// The Hopper forward's params: `p` (whose `q`, `k`, `v` addresses and dims they describe)
/// with the maps of q, k and v as the kernel copies them ([`bshd_tile_map`]; tiles of
/// [`geometry::hopper_forward_tile`]), each encoded by `encode` (the driver's encoder on a GPU,
/// [`TensorMapSpec::encode_emulated`] under the emulator). A side without rows gets a one-row
/// map, never read.
///
/// # Errors
/// [`Error::TensorMap`] from the encoder (an address that is not 16-byte aligned, for
/// example).
pub fn hopper_forward_params(
    p: FlashFwdParams,
    dims: &Dims,
    dtype: DType,
    encode: impl Fn(&TensorMapSpec) -> Result<TensorMap>,
) -> Result<FlashFwdHopperParams> {
    let t = if dtype == DType::F16 { TensorMapDType::F16 } else { TensorMapDType::BF16 };
    let (block_m, block_n) = geometry::hopper_forward_tile(dims.d_max());
    let map = |addr: u64, s: usize, h: usize, d: usize, rows: usize| {
        encode(&bshd_tile_map(t, addr, dims.b, s.max(1), h, d, rows as u32))
    };
    Ok(FlashFwdHopperParams {
        p,
        reserved: [0; 7],
        q: map(p.x.q, dims.s_q, dims.h_q, dims.d_qk, block_m)?,
        k: map(p.x.k, dims.s_k, dims.h_kv, dims.d_qk, block_n)?,
        v: map(p.x.v, dims.s_k, dims.h_kv, dims.d_v, block_n)?,
    })
}

/// The Hopper backward's params: `p` (whose `q`, `k`, `v`, `d_o` addresses and dims they
/// describe) with the maps of q and d_o (boxes of 64 query rows) and of k and v (boxes of
/// [`geometry::hopper_backward_block`] keys) as `flash_bwd_hopper.cu` copies them, each
/// encoded by `encode` as in [`hopper_forward_params`].
///
/// # Errors
/// As [`hopper_forward_params`].
pub fn hopper_backward_params(
    p: FlashBwdParams,
    dims: &Dims,
    dtype: DType,
    encode: impl Fn(&TensorMapSpec) -> Result<TensorMap>,
) -> Result<FlashBwdHopperParams> {
    let t = if dtype == DType::F16 { TensorMapDType::F16 } else { TensorMapDType::BF16 };
    let block_n = geometry::hopper_backward_block(dims.d_max());
    let map = |addr: u64, s: usize, h: usize, d: usize, rows: usize| {
        encode(&bshd_tile_map(t, addr, dims.b, s.max(1), h, d, rows as u32))
    };
    Ok(FlashBwdHopperParams {
        p,
        q: map(p.x.q, dims.s_q, dims.h_q, dims.d_qk, 64)?,
        k: map(p.x.k, dims.s_k, dims.h_kv, dims.d_qk, block_n)?,
        v: map(p.x.v, dims.s_k, dims.h_kv, dims.d_v, block_n)?,
        d_o: map(p.d_o, dims.s_q, dims.h_q, dims.d_v, 64)?,
        lse: encode(&row_stats_map(p.lse, dims)?)?,
        delta: encode(&row_stats_map(p.delta, dims)?)?,
    })
}

/// The map of an f32 `[b, h_q, s_q]` row statistic (`lse`, `delta`) at `address` as the
/// Hopper backward copies it: the `b · h_q · s_q` values as a 2-d view `{n, 1}` (the second dim
/// only makes the copy 2-d; its stride is never taken) with boxes of 64 × 1, unswizzled. A
/// box of the last rows of a head runs on into the next head's (the kernel masks rows past
/// `s_q`); past the end it reads zeros.
///
/// # Errors
/// [`Error::TensorMap`] when `b · h_q · s_q` does not fit the copies' 32-bit coordinates.
pub fn row_stats_map(address: u64, dims: &Dims) -> Result<TensorMapSpec> {
    let n = (dims.b * dims.h_q * dims.s_q).max(1) as u64;
    if n >= 1 << 31 {
        return Err(invalid(format!("{n} rows of lse/delta exceed the tensor copies' 2^31 coordinates")));
    }
    Ok(TensorMapSpec {
        dtype: TensorMapDType::F32,
        address,
        dims: vec![n, 1],
        strides: vec![(4 * n).next_multiple_of(16)],
        box_dims: vec![64, 1],
        swizzle: TensorMapSwizzle::None,
        oob_fill: OobFill::Zeros,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TensorMapSpec {
        TensorMapSpec {
            dtype: TensorMapDType::BF16,
            address: 4096,
            dims: vec![128, 8, 300],
            strides: vec![256, 2048],
            box_dims: vec![64, 1, 64],
            swizzle: TensorMapSwizzle::B128,
            oob_fill: OobFill::Zeros,
        }
    }

    #[test]
    fn the_drivers_rules_are_checked_naming_the_field() {
        spec().validate().unwrap();
        let cases: Vec<(TensorMapSpec, &str)> = vec![
            (TensorMapSpec { dims: vec![], strides: vec![], box_dims: vec![], ..spec() }, "rank 0"),
            (TensorMapSpec { strides: vec![256], ..spec() }, "1 strides for rank 3"),
            (TensorMapSpec { box_dims: vec![64, 1], ..spec() }, "2 box dims"),
            (TensorMapSpec { address: 4100, ..spec() }, "not 16-byte aligned"),
            (TensorMapSpec { dims: vec![128, 0, 300], ..spec() }, "dim 1 = 0"),
            (TensorMapSpec { strides: vec![250, 2048], ..spec() }, "stride of dim 1 = 250"),
            (TensorMapSpec { box_dims: vec![64, 1, 257], ..spec() }, "box dim 2 = 257"),
            (TensorMapSpec { box_dims: vec![4, 1, 64], ..spec() }, "8 bytes is not a multiple of 16"),
            (TensorMapSpec { box_dims: vec![128, 1, 64], ..spec() }, "256 bytes exceeds the 128-byte"),
            (
                TensorMapSpec { box_dims: vec![64, 1, 64], swizzle: TensorMapSwizzle::B64, ..spec() },
                "exceeds the 64-byte",
            ),
        ];
        for (bad, want) in cases {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{bad:?}: {err}");
            assert!(bad.encode_emulated().is_err());
        }
        TensorMapSpec { box_dims: vec![128, 1, 64], swizzle: TensorMapSwizzle::None, ..spec() }.validate().unwrap();
    }

    #[test]
    fn the_emulated_encoding_holds_every_field() {
        let m = spec().encode_emulated().unwrap();
        assert_eq!(m.words[0], 0x5241_544D | 9 << 32 | 3 << 40 | 3 << 44);
        assert_eq!(m.words[1], 4096);
        assert_eq!(&m.words[2..7], &[128, 8, 300, 0, 0]);
        assert_eq!(&m.words[7..11], &[256, 2048, 0, 0]);
        assert_eq!(m.words[11], 64 | 1 << 12 | 64 << 24);
        assert_eq!(spec().box_bytes(), 64 * 64 * 2);
    }
}
