//! Element types: f32, bf16 and f16 (from the `half` crate). Arithmetic is always f32.

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    #[default]
    F32,
    /// bfloat16: 8 exponent bits, 7 stored mantissa bits.
    BF16,
    /// IEEE binary16.
    F16,
}

impl DType {
    /// All supported dtypes.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Unit roundoff `u = 2^-p` where `p` is the number of significand bits
    /// (24 for f32, 8 for bf16, 11 for f16): the relative error of one rounding.
    ///
    /// ```
    /// assert_eq!(ringattn::DType::BF16.unit_roundoff(), 2f64.powi(-8));
    /// ```
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 2f64.powi(-24),
            DType::BF16 => 2f64.powi(-8),
            DType::F16 => 2f64.powi(-11),
        }
    }

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Rounds an f64 to this dtype and back (round to nearest even).
    pub fn round_f64(self, x: f64) -> f64 {
        match self {
            DType::F32 => x as f32 as f64,
            DType::BF16 => bf16::from_f64(x).to_f64(),
            DType::F16 => f16::from_f64(x).to_f64(),
        }
    }

    /// The safetensors name: `F32`, `BF16` or `F16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    /// Parses `f32`, `bf16`, `f16` (any case).
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "half" => Ok(DType::F16),
            _ => Err(crate::Error::UnsupportedDtype(s.to_string())),
        }
    }
}
