//! Which arithmetic the CPU's products use, chosen per call from the input dtype and the
//! processor.

use crate::{DType, Error, Result};

use super::products;

/// The arithmetic of the CPU's matrix products (`Q·Kᵀ`, `P·V` and the backward's five).
/// Softmax statistics, accumulations and outputs are f32 either way; outputs are rounded to
/// the input dtype at the end.
///
/// ```
/// use ringattn::{cpu::Arithmetic, DType};
/// // f32 and f16 inputs always take the f32 path; bf16 takes bf16 products where the
/// // processor has them.
/// assert_eq!(Arithmetic::Auto.resolve(DType::F16)?, Arithmetic::F32);
/// let bf16 = Arithmetic::Auto.resolve(DType::BF16)?;
/// assert_eq!(bf16 == Arithmetic::Bf16, Arithmetic::bf16_available());
/// // Asking for bf16 products on f32 inputs is an error, not a silent rounding.
/// assert!(Arithmetic::Bf16.resolve(DType::F32).is_err());
/// assert_eq!("f32".parse::<Arithmetic>()?, Arithmetic::F32);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arithmetic {
    /// [`Arithmetic::Bf16`] for bf16 inputs on a processor with AVX512_BF16,
    /// [`Arithmetic::F32`] otherwise.
    #[default]
    Auto,
    /// Inputs widened to f32, products in f32 (FMA): any dtype, any processor.
    F32,
    /// bf16 operands, f32 accumulation (`vdpbf16ps`, or `TDPBF16PS` on AMX tiles where the
    /// processor has AMX-BF16 and Linux grants the tile state): bf16 inputs only. The probabilities
    /// (and in the backward `dS`) are rounded to bf16 before their products, as the GPU
    /// kernels do. Calls whose inputs hold NaN or infinities run the f32 path instead, which
    /// keeps masked non-finite values out of visible rows exactly.
    Bf16,
}

impl std::str::FromStr for Arithmetic {
    type Err = Error;

    /// `auto`, `f32` or `bf16` (the CLI's `--cpu-arithmetic`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Arithmetic::Auto),
            "f32" => Ok(Arithmetic::F32),
            "bf16" => Ok(Arithmetic::Bf16),
            other => Err(Error::InvalidArgument(format!("CPU arithmetic `{other}`: expected auto, f32 or bf16"))),
        }
    }
}

impl Arithmetic {
    /// Whether this processor has the bf16 products (x86-64 with AVX512F and AVX512_BF16).
    pub fn bf16_available() -> bool {
        products::bf16_available()
    }

    /// The arithmetic a call on `dtype` inputs runs: [`Arithmetic::F32`] or
    /// [`Arithmetic::Bf16`].
    ///
    /// # Errors
    /// [`Error::BackendUnsupported`] for [`Arithmetic::Bf16`] on inputs other than bf16 or on
    /// a processor without AVX512_BF16.
    pub fn resolve(self, dtype: DType) -> Result<Arithmetic> {
        match self {
            Arithmetic::F32 => Ok(Arithmetic::F32),
            Arithmetic::Auto if dtype == DType::BF16 && Self::bf16_available() => Ok(Arithmetic::Bf16),
            Arithmetic::Auto => Ok(Arithmetic::F32),
            Arithmetic::Bf16 if dtype != DType::BF16 => Err(Error::BackendUnsupported {
                backend: "cpu",
                what: format!("bf16 products (Arithmetic::Bf16) on {dtype:?} inputs; they need BF16 inputs"),
            }),
            Arithmetic::Bf16 if !Self::bf16_available() => Err(Error::BackendUnsupported {
                backend: "cpu",
                what: "bf16 products (Arithmetic::Bf16) on this processor: it lacks AVX512_BF16".into(),
            }),
            Arithmetic::Bf16 => Ok(Arithmetic::Bf16),
        }
    }
}

/// Which unit runs the CPU's matrix products: the bf16 products of [`Arithmetic::Bf16`], and
/// the f32 forward's.
///
/// On AMX tiles the f32 forward (f32 inputs, or [`Arithmetic::F32`]) splits each operand
/// into three bf16 parts (`x = x0 + x1 + x2` exactly) and sums the six part products above
/// `2^-24` in the tiles' f32 accumulators — f32 accuracy (the float64 oracle's f32 bound;
/// measured at or under the naive f32 error), the tiles' throughput — where every input splits
/// (finite, within bf16's range: about `3.39e38`; others take the f32 vector products). The
/// f32 backward runs on the vector units.
///
/// ```
/// use ringattn::cpu::MatrixUnit;
/// assert_eq!("vector".parse::<MatrixUnit>()?, MatrixUnit::Vector);
/// assert_eq!(MatrixUnit::default(), MatrixUnit::Auto);
/// assert!("tiles".parse::<MatrixUnit>().is_err());
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatrixUnit {
    /// AMX tiles (`TDPBF16PS`) where the processor has AMX-BF16 and Linux grants the tile
    /// state ([`super::amx::available`]) — bf16 products, and the f32 forward's as bf16
    /// parts —, the vector units (`vdpbf16ps`, f32 FMA) otherwise.
    #[default]
    Auto,
    /// The vector units only, never the tiles: the same bits on every AVX-512 processor, AMX
    /// or not (the tiles sum a product's pairs in another order, and the f32 forward's parts
    /// differ in rounding from f32 FMA).
    Vector,
}

impl std::str::FromStr for MatrixUnit {
    type Err = Error;

    /// `auto` or `vector` (the CLI's `--cpu-matrix-unit`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(MatrixUnit::Auto),
            "vector" => Ok(MatrixUnit::Vector),
            other => Err(Error::InvalidArgument(format!("CPU matrix unit `{other}`: expected auto or vector"))),
        }
    }
}

impl MatrixUnit {
    /// The unit the bf16 path runs its products on.
    pub(crate) fn unit(self) -> super::amx_products::Unit {
        match self {
            MatrixUnit::Auto => super::amx_products::Unit::chosen(),
            MatrixUnit::Vector => super::amx_products::Unit::Vector,
        }
    }
}
