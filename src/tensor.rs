//! A host tensor: a shape and a contiguous row-major buffer of one dtype.

use std::borrow::Cow;

use half::{bf16, f16};

use crate::{DType, Error, Result};

/// The typed storage of a [`Tensor`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum TensorData {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
}

/// A contiguous, row-major host tensor (the last dimension varies fastest).
///
/// ```
/// use ringattn::{DType, Tensor};
/// let t = Tensor::from_f32(vec![2, 3], (0..6).map(|x| x as f32).collect())?;
/// let h = t.to_dtype(DType::BF16);
/// assert_eq!(h.dtype(), DType::BF16);
/// assert_eq!(h.shape(), &[2, 3]);
/// assert_eq!(h.to_f32_vec()[5], 5.0);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl Tensor {
    /// Builds a tensor from its shape and data.
    ///
    /// # Errors
    /// [`Error::DataLength`] when the data length is not the product of the shape.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Self> {
        let expected: usize = shape.iter().product();
        let len = match &data {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
        };
        if len != expected {
            return Err(Error::DataLength { len, shape, expected });
        }
        Ok(Tensor { shape, data })
    }

    /// Builds an f32 tensor. Errors as [`Tensor::new`].
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        Self::new(shape, TensorData::F32(data))
    }

    /// Rounds f32 values to `dtype` (round to nearest even) and builds a tensor.
    /// Errors as [`Tensor::new`].
    pub fn from_f32_as(shape: Vec<usize>, data: Vec<f32>, dtype: DType) -> Result<Self> {
        Self::from_f32(shape, data).map(|t| t.to_dtype(dtype))
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>, dtype: DType) -> Self {
        let n = shape.iter().product();
        let data = match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::BF16 => TensorData::BF16(vec![bf16::ZERO; n]),
            DType::F16 => TensorData::F16(vec![f16::ZERO; n]),
        };
        Tensor { shape, data }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element count.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
        }
    }

    /// The typed storage.
    pub fn data(&self) -> &TensorData {
        &self.data
    }

    /// The storage as raw little-endian bytes (the safetensors payload).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            TensorData::F32(v) => bytemuck::cast_slice(v),
            TensorData::BF16(v) => bytemuck::cast_slice(v),
            TensorData::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Rows `rows` of this tensor, in that order, as a tensor of `shape` in the same dtype (no
    /// conversion): row `r` is elements `r·width .. (r+1)·width`.
    ///
    /// # Errors
    /// [`Error::DataLength`] when `shape` does not hold the gathered elements. A row out of
    /// range panics: the callers check their rows first.
    pub(crate) fn gather_rows(
        &self,
        shape: Vec<usize>,
        width: usize,
        rows: impl Iterator<Item = usize>,
    ) -> Result<Tensor> {
        fn gather<T: Copy>(x: &[T], n: usize, width: usize, rows: impl Iterator<Item = usize>) -> Vec<T> {
            let mut out = Vec::with_capacity(n);
            for r in rows {
                out.extend_from_slice(&x[r * width..][..width]);
            }
            out
        }
        let n = shape.iter().product();
        let data = match &self.data {
            TensorData::F32(x) => TensorData::F32(gather(x, n, width, rows)),
            TensorData::BF16(x) => TensorData::BF16(gather(x, n, width, rows)),
            TensorData::F16(x) => TensorData::F16(gather(x, n, width, rows)),
        };
        Tensor::new(shape, data)
    }

    /// Writes the rows of `src`, in order, over rows `rows` of this tensor (rows of `width`
    /// elements, as in [`Tensor::gather_rows`]); `src` is converted to this tensor's dtype
    /// only when the two differ. A row out of range panics: the callers check their rows.
    pub(crate) fn scatter_rows(&mut self, src: &Tensor, width: usize, rows: impl Iterator<Item = usize>) {
        fn scatter<T: Copy>(out: &mut [T], x: &[T], width: usize, rows: impl Iterator<Item = usize>) {
            for (row, r) in x.chunks_exact(width).zip(rows) {
                out[r * width..][..width].copy_from_slice(row);
            }
        }
        let converted;
        let src = if src.dtype() == self.dtype() {
            src
        } else {
            converted = src.to_dtype(self.dtype());
            &converted
        };
        match (&mut self.data, &src.data) {
            (TensorData::F32(o), TensorData::F32(x)) => scatter(o, x, width, rows),
            (TensorData::BF16(o), TensorData::BF16(x)) => scatter(o, x, width, rows),
            (TensorData::F16(o), TensorData::F16(x)) => scatter(o, x, width, rows),
            _ => unreachable!("src was converted to this tensor's dtype"),
        }
    }

    /// The values as f32, borrowed when the tensor already is f32 (exact widening otherwise).
    pub fn as_f32(&self) -> Cow<'_, [f32]> {
        match &self.data {
            TensorData::F32(v) => Cow::Borrowed(v),
            TensorData::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            TensorData::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// The values as an owned f32 vector.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.as_f32().into_owned()
    }

    /// The values as f64 (exact).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.as_f32().iter().map(|&x| x as f64).collect()
    }

    /// Converts to `dtype`, rounding to nearest even when narrowing.
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        let f = self.as_f32();
        Tensor { shape: self.shape.clone(), data: f32_to_data(&f, dtype) }
    }

    /// Builds a tensor of `dtype` from f32 values computed elsewhere (rounding when narrowing).
    /// Errors as [`Tensor::new`].
    pub(crate) fn from_f32_slice(shape: Vec<usize>, data: &[f32], dtype: DType) -> Result<Self> {
        Self::new(shape, f32_to_data(data, dtype))
    }

    /// Takes an f32 buffer and converts it to `dtype` (no copy when `dtype` is f32).
    pub(crate) fn from_f32_owned(shape: Vec<usize>, data: Vec<f32>, dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Self::from_f32(shape, data),
            _ => Self::from_f32_slice(shape, &data, dtype),
        }
    }
}

fn f32_to_data(f: &[f32], dtype: DType) -> TensorData {
    match dtype {
        DType::F32 => TensorData::F32(f.to_vec()),
        DType::BF16 => TensorData::BF16(f.iter().map(|&x| bf16::from_f32(x)).collect()),
        DType::F16 => TensorData::F16(f.iter().map(|&x| f16::from_f32(x)).collect()),
    }
}
