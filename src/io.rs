//! safetensors input and output, through the `safetensors` crate.
//!
//! Outputs are written to a temporary file beside the destination and renamed into place,
//! so a failed run never leaves a partial file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::{DType, Error, Result, Tensor, TensorData};

/// The inputs of an attention call read from a file: `q`, `k`, `v` and optionally `do` and
/// `sinks`.
#[derive(Debug, Clone)]
pub struct AttentionInputs {
    /// Queries `[b, s_q, h_q, d]`.
    pub q: Tensor,
    /// Keys `[b, s_k, h_kv, d]`.
    pub k: Tensor,
    /// Values `[b, s_k, h_kv, d]`.
    pub v: Tensor,
    /// Output gradient `[b, s_q, h_q, d]`, when present.
    pub d_o: Option<Tensor>,
    /// Attention sinks' logits `[h_q]` (any float dtype, read as f32), when the file has a
    /// tensor `sinks` ([`crate::AttentionParams::sinks`]; their gradient is written as
    /// `dsinks`).
    pub sinks: Option<Vec<f32>>,
}

/// The crate's dtype of a stored tensor.
fn dtype_of(d: Dtype, name: &str, path: &Path) -> Result<DType> {
    match d {
        Dtype::F32 => Ok(DType::F32),
        Dtype::BF16 => Ok(DType::BF16),
        Dtype::F16 => Ok(DType::F16),
        other => Err(Error::UnsupportedDtype(format!("{other:?} (tensor `{name}` in {})", path.display()))),
    }
}

/// Little-endian `bytes` as tensor data of `dtype`.
fn tensor_data(dtype: DType, bytes: &[u8]) -> TensorData {
    match dtype {
        DType::F32 => TensorData::F32(bytemuck::pod_collect_to_vec::<u8, f32>(bytes)),
        DType::BF16 => TensorData::BF16(bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)),
        DType::F16 => TensorData::F16(bytemuck::pod_collect_to_vec::<u8, f16>(bytes)),
    }
}

impl AttentionInputs {
    /// The logits of a stored `sinks` tensor, which must be one-dimensional (`[h_q]`).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for another rank.
    pub fn sinks_of(t: &Tensor) -> Result<Vec<f32>> {
        if t.shape().len() != 1 {
            return Err(Error::ShapeMismatch(format!("sinks has shape {:?}; expected [h_q]", t.shape())));
        }
        Ok(t.as_f32().into_owned())
    }

    /// The inputs, once `k`, `v` and `do` are found to share the dtype of `q` and `sinks` to
    /// be one-dimensional.
    fn checked(q: Tensor, k: Tensor, v: Tensor, d_o: Option<Tensor>, sinks: Option<Tensor>) -> Result<AttentionInputs> {
        let sinks = sinks.as_ref().map(AttentionInputs::sinks_of).transpose()?;
        for (name, t) in [("k", Some(&k)), ("v", Some(&v)), ("do", d_o.as_ref())] {
            if let Some(t) = t {
                if t.dtype() != q.dtype() {
                    return Err(Error::DtypeMismatch {
                        name: name.to_string(),
                        got: t.dtype().to_string(),
                        expected: q.dtype().to_string(),
                    });
                }
            }
        }
        Ok(AttentionInputs { q, k, v, d_o, sinks })
    }
}

/// Reads every tensor of a safetensors file.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read, [`Error::Format`] when it is not valid
/// safetensors, [`Error::UnsupportedDtype`] for a tensor that is not F32, BF16 or F16.
pub fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let dtype = dtype_of(view.dtype(), &name, path)?;
        out.insert(name, Tensor::new(shape, tensor_data(dtype, view.data()))?);
    }
    Ok(out)
}

/// Reads `q`, `k`, `v` (required) and `do` (optional), which must share one dtype, and
/// `sinks` (optional, `[h_q]`).
///
/// # Errors
/// As [`read_tensors`], plus [`Error::MissingTensor`] and [`Error::DtypeMismatch`].
pub fn read_inputs(path: &Path) -> Result<AttentionInputs> {
    let mut all = read_tensors(path)?;
    let mut take = |name: &str| {
        all.remove(name).ok_or_else(|| Error::MissingTensor { path: path.to_path_buf(), name: name.to_string() })
    };
    let (q, k, v) = (take("q")?, take("k")?, take("v")?);
    let d_o = take("do").ok();
    let sinks = take("sinks").ok();
    AttentionInputs::checked(q, k, v, d_o, sinks)
}

/// A safetensors file opened for reading parts of tensors: the header is parsed and checked
/// at once, tensor data is read on demand (each rank of a multi-process run reads only the
/// rows it holds, never the whole file).
///
/// ```
/// use ringattn::{io, Positions, Tensor};
/// let dir = std::env::temp_dir().join(format!("ringattn-doc-rows-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// let path = dir.join("x.safetensors");
/// // [b = 1, s = 4, 2] with rows 0..4
/// let t = Tensor::from_f32(vec![1, 4, 2], vec![0., 0., 1., 1., 2., 2., 3., 3.])?;
/// io::write_tensors(&path, &[("x", &t)])?;
/// let f = io::TensorFile::open(&path)?;
/// let rows = f.read_rows("x", &Positions::strided(1, 2, 2)?)?; // rows 1 and 3
/// assert_eq!(rows.as_f32().to_vec(), vec![1., 1., 3., 3.]);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    file: std::fs::File,
    /// Byte offset of the data section.
    data_start: u64,
    /// Name → where and what each tensor is.
    tensors: BTreeMap<String, StoredTensor>,
}

/// A tensor of a [`TensorFile`]: dtype, shape and byte offsets within the data section.
#[derive(Debug)]
struct StoredTensor {
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
}

impl TensorFile {
    /// Opens `path` and reads its header.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read, [`Error::Format`] when the header is not valid
    /// safetensors or disagrees with the file's length, [`Error::UnsupportedDtype`] for a
    /// tensor that is not F32, BF16 or F16.
    pub fn open(path: &Path) -> Result<TensorFile> {
        use std::io::Read;
        let io_err = |source| Error::Io { path: path.to_path_buf(), source };
        let format = |detail: String| Error::Format { path: path.to_path_buf(), detail };
        let mut file = std::fs::File::open(path).map_err(io_err)?;
        let file_len = file.metadata().map_err(io_err)?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|_| format("shorter than a safetensors header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > 100_000_000 || 8 + n > file_len {
            return Err(format(format!("header length {n} does not fit a file of {file_len} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io_err)?;
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(&header).map_err(|e| format(format!("invalid header: {e}")))?;
        let data_start = 8 + n;
        let data_len = file_len - data_start;
        let mut tensors = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let dtype = dtype_of(info.dtype, &name, path)?;
            let (a, b) = info.data_offsets;
            let want = info.shape.iter().product::<usize>() * dtype.size_of();
            if b < a || b - a != want || b as u64 > data_len {
                return Err(format(format!(
                    "tensor `{name}`: bytes {a}..{b} do not hold shape {:?} of {dtype} in a data section of {data_len} bytes",
                    info.shape
                )));
            }
            tensors.insert(name, StoredTensor { dtype, shape: info.shape.clone(), start: a });
        }
        Ok(TensorFile { path: path.to_path_buf(), file, data_start, tensors })
    }

    /// The dtype and shape of tensor `name`, if present.
    pub fn info(&self, name: &str) -> Option<(DType, &[usize])> {
        self.tensors.get(name).map(|t| (t.dtype, t.shape.as_slice()))
    }

    /// Rows `positions` of axis 1 of the tensor `name` of shape `[b, s, …]`: a tensor
    /// `[b, positions.len(), …]`. Runs of consecutive rows are read with one read each.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::ShapeMismatch`] for a tensor of rank below 2 or a
    /// position outside `0..s`, [`Error::Io`] on a read error.
    pub fn read_rows(&self, name: &str, positions: &crate::Positions) -> Result<Tensor> {
        use std::os::unix::fs::FileExt;
        let StoredTensor { dtype, shape, start: off } = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.to_string() })?;
        if shape.len() < 2 {
            return Err(Error::ShapeMismatch(format!("tensor `{name}` has shape {shape:?}; rows need [b, s, ...]")));
        }
        let (b, s) = (shape[0], shape[1]);
        let row = shape[2..].iter().product::<usize>() * dtype.size_of();
        for seg in positions.segments() {
            let last = seg.start + seg.stride * (seg.len as i64 - 1).max(0);
            if seg.len > 0 && (seg.start < 0 || last >= s as i64) {
                return Err(Error::ShapeMismatch(format!(
                    "tensor `{name}` has {s} rows; positions {}..={last} are outside",
                    seg.start
                )));
            }
        }
        let n = positions.len();
        let mut bytes = vec![0u8; b * n * row];
        let mut at = 0;
        for bi in 0..b {
            for seg in positions.segments() {
                // One read per run of consecutive rows.
                let runs: Vec<(i64, usize)> = if seg.stride == 1 {
                    vec![(seg.start, seg.len)]
                } else {
                    (0..seg.len as i64).map(|i| (seg.start + i * seg.stride, 1)).collect()
                };
                for (first, count) in runs {
                    let src = self.data_start + (*off + (bi * s + first as usize) * row) as u64;
                    let dst = &mut bytes[at..at + count * row];
                    self.file
                        .read_exact_at(dst, src)
                        .map_err(|source| Error::Io { path: self.path.clone(), source })?;
                    at += count * row;
                }
            }
        }
        let mut out_shape = shape.clone();
        out_shape[1] = n;
        Tensor::new(out_shape, tensor_data(*dtype, &bytes))
    }

    /// The whole tensor `name` (e.g. `sinks`, which every rank holds whole).
    ///
    /// # Errors
    /// [`Error::MissingTensor`]; [`Error::Io`] on a read error.
    pub fn read_whole(&self, name: &str) -> Result<Tensor> {
        use std::os::unix::fs::FileExt;
        let StoredTensor { dtype, shape, start } = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.to_string() })?;
        let mut bytes = vec![0u8; shape.iter().product::<usize>() * dtype.size_of()];
        self.file
            .read_exact_at(&mut bytes, self.data_start + *start as u64)
            .map_err(|source| Error::Io { path: self.path.clone(), source })?;
        Tensor::new(shape.clone(), tensor_data(*dtype, &bytes))
    }

    /// The rows `positions` of `q`, `k`, `v` and (when present) `do`, which must share one
    /// dtype, and `sinks` whole: what one rank of a sequence-parallel run holds.
    ///
    /// # Errors
    /// As [`TensorFile::read_rows`], plus [`Error::DtypeMismatch`].
    pub fn read_input_rows(&self, positions: &crate::Positions) -> Result<AttentionInputs> {
        let q = self.read_rows("q", positions)?;
        let k = self.read_rows("k", positions)?;
        let v = self.read_rows("v", positions)?;
        let d_o = if self.tensors.contains_key("do") { Some(self.read_rows("do", positions)?) } else { None };
        let sinks = if self.tensors.contains_key("sinks") { Some(self.read_whole("sinks")?) } else { None };
        AttentionInputs::checked(q, k, v, d_o, sinks)
    }
}

/// Writes named tensors to `path` atomically (temporary file, then rename).
///
/// # Errors
/// [`Error::Io`] when the directory is not writable, [`Error::Format`] when serialisation fails.
///
/// ```
/// use ringattn::{io, Tensor};
/// let dir = std::env::temp_dir().join(format!("ringattn-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// let path = dir.join("x.safetensors");
/// let t = Tensor::from_f32(vec![2], vec![1.0, 2.0])?;
/// io::write_tensors(&path, &[("x", &t)])?;
/// assert_eq!(io::read_tensors(&path)?["x"], t);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn write_tensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let dtype = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::BF16 => Dtype::BF16,
                DType::F16 => Dtype::F16,
            };
            safetensors::tensor::TensorView::new(dtype, t.shape().to_vec(), t.as_bytes())
                .map(|v| (name.to_string(), v))
                .map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })?;
    write_atomic(path, &bytes)
}

/// Writes `bytes` to `path` through a temporary file beside it and a rename: readers see the
/// old file or the whole new one, and a failure leaves no partial file.
///
/// # Errors
/// [`Error::Io`] when the directory is not writable or the disk is full.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        Error::Io { path: path.to_path_buf(), source }
    })
}

/// Writes a value as pretty JSON to `path`, atomically (see [`write_atomic`]).
///
/// # Errors
/// As [`write_atomic`], plus [`Error::Format`] when serialisation fails.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let json = serde_json::to_vec_pretty(value)
        .map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })?;
    write_atomic(path, &json)
}

fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}
