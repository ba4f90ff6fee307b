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

/// The inputs of an attention call read from a file: `q`, `k`, `v` and optionally `do`.
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
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(bytemuck::pod_collect_to_vec::<u8, f32>(raw)),
            Dtype::BF16 => TensorData::BF16(bytemuck::pod_collect_to_vec::<u8, bf16>(raw)),
            Dtype::F16 => TensorData::F16(bytemuck::pod_collect_to_vec::<u8, f16>(raw)),
            other => return Err(Error::UnsupportedDtype(format!("{other:?} (tensor `{name}` in {})", path.display()))),
        };
        out.insert(name, Tensor::new(shape, data)?);
    }
    Ok(out)
}

/// Reads `q`, `k`, `v` (required) and `do` (optional), which must share one dtype.
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
    Ok(AttentionInputs { q, k, v, d_o })
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
