//! [`HostBuf`]: typed values in host memory, shared copy-on-write: what the host backends
//! compute on and the host communicators move, and [`Elem`], the element type of anything a
//! communicator moves (the tensor dtypes and bytes for control data).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::{DType, Error, Result, Tensor, TensorData};

/// The element type of a buffer a communicator moves: a tensor [`DType`] or raw bytes
/// (control data: handshakes, split metadata).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Elem {
    /// f32 values (LSE, partial outputs and gradient accumulators, f32 tensors).
    F32,
    /// bf16 values.
    BF16,
    /// f16 values.
    F16,
    /// Bytes.
    U8,
}

impl Elem {
    /// Bytes per element.
    ///
    /// ```
    /// use ringattn::{DType, Elem};
    /// assert_eq!(Elem::from(DType::BF16).size_of(), 2);
    /// assert_eq!(Elem::U8.size_of(), 1);
    /// ```
    pub fn size_of(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::BF16 | Elem::F16 => 2,
            Elem::U8 => 1,
        }
    }

    /// The tensor dtype, `None` for bytes.
    pub fn dtype(self) -> Option<DType> {
        match self {
            Elem::F32 => Some(DType::F32),
            Elem::BF16 => Some(DType::BF16),
            Elem::F16 => Some(DType::F16),
            Elem::U8 => None,
        }
    }
}

impl From<DType> for Elem {
    fn from(d: DType) -> Self {
        match d {
            DType::F32 => Elem::F32,
            DType::BF16 => Elem::BF16,
            DType::F16 => Elem::F16,
        }
    }
}

impl fmt::Display for Elem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype() {
            Some(d) => d.fmt(f),
            None => f.write_str("U8"),
        }
    }
}

/// The typed storage of a [`HostBuf`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HostData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
    /// Bytes.
    U8(Vec<u8>),
}

/// Applies `$body` to the vector inside a [`HostData`] of any element type.
macro_rules! each_elem {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            HostData::F32($v) => $body,
            HostData::BF16($v) => $body,
            HostData::F16($v) => $body,
            HostData::U8($v) => $body,
        }
    };
}

impl HostData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        each_elem!(self, v => v.len())
    }

    /// Whether there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn elem(&self) -> Elem {
        match self {
            HostData::F32(_) => Elem::F32,
            HostData::BF16(_) => Elem::BF16,
            HostData::F16(_) => Elem::F16,
            HostData::U8(_) => Elem::U8,
        }
    }

    /// The elements as little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        each_elem!(self, v => bytemuck::cast_slice(v))
    }

    /// The elements as little-endian bytes, for writing (an emulated device's kernels).
    #[cfg(all(test, feature = "emu"))]
    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        each_elem!(self, v => bytemuck::cast_slice_mut(v))
    }

    /// `len` elements of type `elem` from little-endian bytes (`bytes.len() = len ·
    /// elem.size_of()`; any alignment).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the byte count disagrees.
    pub fn from_bytes(elem: Elem, bytes: &[u8]) -> Result<HostData> {
        if !bytes.len().is_multiple_of(elem.size_of()) {
            return Err(Error::ShapeMismatch(format!("{} bytes are not whole {elem} values", bytes.len())));
        }
        Ok(match elem {
            Elem::F32 => HostData::F32(bytemuck::pod_collect_to_vec(bytes)),
            Elem::BF16 => HostData::BF16(bytemuck::pod_collect_to_vec(bytes)),
            Elem::F16 => HostData::F16(bytemuck::pod_collect_to_vec(bytes)),
            Elem::U8 => HostData::U8(bytes.to_vec()),
        })
    }
}

/// Values of one element type in host memory, shared: `clone` is cheap (no copy), and a
/// write to a shared buffer copies it first ([`HostBuf::make_mut`]), so a buffer handed to a
/// send or kept for the backward is never changed under its holder. The `Buf` of the host
/// backends (CPU, the emulated kernels) and the payload of the host communicators
/// ([`crate::comm::LocalComm`], `MpiComm`).
///
/// ```
/// use ringattn::{DType, Elem, HostBuf};
/// let x = HostBuf::from(vec![1.0f32, 2.5]);
/// let y = x.converted(DType::BF16);
/// assert_eq!((y.elem(), y.len()), (Elem::BF16, 2));
/// assert_eq!(y.to_f32()?.as_ref(), &[1.0, 2.5]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct HostBuf(Arc<HostData>);

impl fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.0 {
            HostData::F32(v) => f.debug_tuple("HostBuf::F32").field(v).finish(),
            d => f.debug_struct("HostBuf").field("elem", &d.elem()).field("len", &d.len()).finish(),
        }
    }
}

impl From<Vec<f32>> for HostBuf {
    fn from(v: Vec<f32>) -> Self {
        HostBuf::new(HostData::F32(v))
    }
}

impl From<HostData> for HostBuf {
    fn from(d: HostData) -> Self {
        HostBuf::new(d)
    }
}

/// Equal when the buffer holds exactly these f32 values.
impl PartialEq<Vec<f32>> for HostBuf {
    fn eq(&self, other: &Vec<f32>) -> bool {
        matches!(&*self.0, HostData::F32(v) if v == other)
    }
}

impl HostBuf {
    /// Wraps `data`.
    pub fn new(data: HostData) -> Self {
        HostBuf(Arc::new(data))
    }

    /// A buffer of bytes (control data).
    pub fn bytes(b: Vec<u8>) -> Self {
        HostBuf::new(HostData::U8(b))
    }

    /// `len` copies of `value` as `dtype`.
    pub fn filled(len: usize, value: f32, dtype: DType) -> Self {
        HostBuf::new(match dtype {
            DType::F32 => HostData::F32(vec![value; len]),
            DType::BF16 => HostData::BF16(vec![bf16::from_f32(value); len]),
            DType::F16 => HostData::F16(vec![f16::from_f32(value); len]),
        })
    }

    /// A copy of a tensor's values (its shape is dropped).
    pub fn from_tensor(t: &Tensor) -> Self {
        HostBuf::new(match t.data() {
            TensorData::F32(v) => HostData::F32(v.clone()),
            TensorData::BF16(v) => HostData::BF16(v.clone()),
            TensorData::F16(v) => HostData::F16(v.clone()),
        })
    }

    /// The values as a tensor of `shape` (no copy when the buffer is not shared).
    ///
    /// # Errors
    /// [`Error::DataLength`] when the shape does not hold the buffer's length;
    /// [`Error::InvalidArgument`] for bytes.
    pub fn into_tensor(self, shape: Vec<usize>) -> Result<Tensor> {
        let data = match self.into_data() {
            HostData::F32(v) => TensorData::F32(v),
            HostData::BF16(v) => TensorData::BF16(v),
            HostData::F16(v) => TensorData::F16(v),
            HostData::U8(_) => return Err(Error::InvalidArgument("a byte buffer is not a tensor".into())),
        };
        Tensor::new(shape, data)
    }

    /// The storage, taken (no copy when the buffer is not shared).
    pub fn into_data(self) -> HostData {
        Arc::try_unwrap(self.0).unwrap_or_else(|shared| (*shared).clone())
    }

    /// The storage when no other handle shares it, else `None` (the handle dropped).
    pub fn into_unshared(self) -> Option<HostData> {
        Arc::try_unwrap(self.0).ok()
    }

    /// The storage.
    pub fn data(&self) -> &HostData {
        &self.0
    }

    /// The storage for writing; copied first when shared (copy-on-write).
    pub fn make_mut(&mut self) -> &mut HostData {
        Arc::make_mut(&mut self.0)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no element.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The element type.
    pub fn elem(&self) -> Elem {
        self.0.elem()
    }

    /// The f32 values (f32 buffers only: accumulators, LSE).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the element type otherwise.
    pub fn f32s(&self) -> Result<&[f32]> {
        match &*self.0 {
            HostData::F32(v) => Ok(v),
            d => Err(Error::InvalidArgument(format!("an f32 buffer was expected, this one holds {}", d.elem()))),
        }
    }

    /// The f32 values for writing (copy-on-write).
    ///
    /// # Errors
    /// As [`HostBuf::f32s`].
    pub fn f32s_mut(&mut self) -> Result<&mut Vec<f32>> {
        match self.make_mut() {
            HostData::F32(v) => Ok(v),
            d => Err(Error::InvalidArgument(format!("an f32 buffer was expected, this one holds {}", d.elem()))),
        }
    }

    /// The values as f32: borrowed for f32 buffers, widened (exactly) for 16-bit ones.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bytes.
    pub fn to_f32(&self) -> Result<Cow<'_, [f32]>> {
        Ok(match &*self.0 {
            HostData::F32(v) => Cow::Borrowed(v),
            HostData::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            HostData::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            HostData::U8(_) => return Err(Error::InvalidArgument("byte buffers hold no values".into())),
        })
    }

    /// As [`HostBuf::converted`], consuming the buffer: itself when it already holds `dtype`
    /// (so that an unshared buffer stays unshared).
    pub fn into_converted(self, dtype: DType) -> HostBuf {
        if self.elem() == Elem::from(dtype) || self.elem() == Elem::U8 {
            return self;
        }
        self.converted(dtype)
    }

    /// The values as `dtype` (rounded to nearest even when narrowing; the same buffer, shared,
    /// when it already is `dtype`). Bytes are returned unchanged.
    pub fn converted(&self, dtype: DType) -> HostBuf {
        if self.elem() == Elem::from(dtype) || self.elem() == Elem::U8 {
            return self.clone();
        }
        let f = self.to_f32().unwrap_or_default();
        HostBuf::new(match dtype {
            DType::F32 => HostData::F32(f.into_owned()),
            DType::BF16 => HostData::BF16(f.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => HostData::F16(f.iter().map(|&x| f16::from_f32(x)).collect()),
        })
    }

    /// The bytes of a byte buffer; the values of another, each as one byte (what a device
    /// communicator that moves only f32 gives back for control data).
    pub fn to_control_bytes(&self) -> Vec<u8> {
        match &*self.0 {
            HostData::U8(v) => v.clone(),
            _ => self.to_f32().map(|f| f.iter().map(|&x| x as u8).collect()).unwrap_or_default(),
        }
    }
}
