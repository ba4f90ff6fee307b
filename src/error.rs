//! The crate's one error type.

use std::path::PathBuf;

/// Every failure the crate reports. Each variant names the offending value so that a
/// message alone tells the caller what to fix; nothing in the crate panics on bad input.
/// `Debug` prints the message (what `main() -> Result` and `unwrap` show).
///
/// Through candle (feature `candle`), an error of the crate travels inside candle's error
/// (`candle_core::Error::WrappedContext`, context `"ringattn"`): `Error::from` a candle error
/// recovers it as it was (`Timeout`, `PeerFailed`, `Handshake`, … matchable), and
/// `ringattn::candle::find_error` finds it by reference.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has the wrong number of dimensions.
    #[error("tensor `{name}` must have rank {expected} ({layout}), got shape {shape:?}")]
    Rank {
        /// Tensor name (`q`, `k`, `v`, `o`, `lse`, `do`).
        name: &'static str,
        /// Expected rank.
        expected: usize,
        /// Expected layout, e.g. `[b, s_q, h_q, d]`.
        layout: &'static str,
        /// Shape received.
        shape: Vec<usize>,
    },
    /// Two tensors disagree on a dimension they must share.
    #[error("shape mismatch: {0}")]
    ShapeMismatch(String),
    /// Query heads are not a multiple of key/value heads (GQA needs `h_q % h_kv == 0`).
    #[error("query heads h_q = {h_q} is not a multiple of key/value heads h_kv = {h_kv}")]
    HeadRatio {
        /// Query heads.
        h_q: usize,
        /// Key/value heads.
        h_kv: usize,
    },
    /// A head count of zero.
    #[error("head count must be at least 1, got {name} = 0")]
    ZeroHeads {
        /// `h_q` or `h_kv`.
        name: &'static str,
    },
    /// The head dimension is zero or above what the backend supports.
    #[error("head dim {name} = {d} is not supported (supported: 1..={max})")]
    HeadDim {
        /// `d_qk` or `d_v`.
        name: &'static str,
        /// Head dimension received.
        d: usize,
        /// Largest supported head dimension.
        max: usize,
    },
    /// A sliding-window side is not a valid value.
    #[error("invalid window {0}")]
    Window(String),
    /// The softmax scale is not a finite number.
    #[error("softmax scale must be finite, got {0}")]
    Scale(f32),
    /// A score option of the parameters (`softcap`, …) is out of its range.
    #[error("score option `{option}` must be {rule}, got {value}")]
    ScoreOption {
        /// The option's name in [`crate::AttentionParams`].
        option: &'static str,
        /// The value received.
        value: f32,
        /// What the option must be.
        rule: &'static str,
    },
    /// Tensors that must share one dtype do not.
    #[error("dtype mismatch: `{name}` is {got}, expected {expected} (the dtype of `q`)")]
    DtypeMismatch {
        /// Tensor name.
        name: String,
        /// Its dtype.
        got: String,
        /// The dtype required.
        expected: String,
    },
    /// A backend cannot run this configuration (the CPU backend can).
    #[error("backend `{backend}` does not support {what}")]
    BackendUnsupported {
        /// The backend.
        backend: &'static str,
        /// What it does not support, with the offending value.
        what: String,
    },
    /// A kernel misbehaved (the emulator's report: out-of-bounds access, shared-memory race,
    /// divergent barrier, deadlock) or failed to launch.
    #[error("kernel {kernel}: {report}")]
    Kernel {
        /// The kernel.
        kernel: String,
        /// What went wrong, with block and thread.
        report: String,
    },
    /// The CUDA backend (feature `cuda`) cannot run: no driver library, no GPU, a driver too
    /// old for the embedded kernels, a build without kernels, or a driver call that failed
    /// (allocation, copy, launch), with the call and the driver's error code.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A dtype the crate does not handle.
    #[error("unsupported dtype {0} (supported: F32, BF16, F16)")]
    UnsupportedDtype(String),
    /// A data buffer whose length does not match its shape.
    #[error("tensor data holds {len} elements but shape {shape:?} needs {expected}")]
    DataLength {
        /// Elements held.
        len: usize,
        /// Shape claimed.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
    },
    /// Packed-document lengths that do not describe the sequence.
    #[error("invalid document lengths: {0}")]
    Documents(String),
    /// Position segments that are malformed or disagree with the tensors.
    #[error("invalid positions: {0}")]
    Positions(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A file is not a well-formed safetensors file.
    #[error("{path}: malformed safetensors file: {detail}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A required tensor is absent from an input file.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
    },
    /// An unknown or not-yet-available parallel strategy.
    #[error(
        "unknown strategy `{0}` (available: {available}, auto)",
        available = crate::parallel::Strategy::list(&crate::parallel::Strategy::ALL)
    )]
    UnknownStrategy(String),
    /// An unknown or not-yet-available backend.
    #[error("unknown backend `{0}` (available: cpu, emu, cuda)")]
    UnknownBackend(String),
    /// A wait on a peer passed its deadline.
    #[error("timed out after {after:?} waiting for {op} with rank {peer}")]
    Timeout {
        /// The operation (`recv`, `send`, `all_to_all`, ...), with its tag.
        op: String,
        /// The peer rank waited on.
        peer: usize,
        /// The deadline that expired.
        after: std::time::Duration,
    },
    /// Another rank failed; this rank stops instead of waiting for it.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The rank that failed first.
        rank: usize,
        /// Its error message.
        reason: String,
    },
    /// An MPI call failed, or MPI cannot be used as asked (feature `mpi`).
    #[error("MPI: {0}")]
    Mpi(String),
    /// Two ranks disagree on the order of their messages: the n-th receive a rank posted for
    /// a peer met the peer's n-th send to it with another tag (the per-peer order contract of
    /// [`crate::comm::Communicator`], checked by `LocalComm` in [`crate::comm::MessageOrder::PerPeerFifo`]).
    #[error("message order: {0}")]
    MessageOrder(String),
    /// Ranks disagree on the configuration of a collective call.
    #[error("handshake mismatch: {0}")]
    Handshake(String),
    /// A strategy cannot run this configuration (layout, heads, world size).
    #[error("invalid parallel configuration: {0}")]
    Parallel(String),
    /// A tensor map (the bulk tensor copies' operand) that the driver's rules reject, naming
    /// the field and its value.
    #[error("tensor map: {0}")]
    TensorMap(String),
    /// Any other invalid argument, with a message naming it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An error of candle (feature `candle`), as text.
    #[cfg(feature = "candle")]
    #[error("candle: {0}")]
    Candle(String),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The crate's error that a candle error carries (see [`Error`]), or candle's own error as
/// [`Error::Candle`] text (without a backtrace).
#[cfg(feature = "candle")]
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        use candle_core::Error as C;
        match e {
            C::WithBacktrace { inner, .. } => Error::from(*inner),
            C::WithPath { inner, path } => match Error::from(*inner) {
                Error::Candle(text) => Error::Candle(format!("{}: {text}", path.display())),
                ours => ours,
            },
            C::Context { inner, context } => match Error::from(*inner) {
                Error::Candle(text) => Error::Candle(format!("{context}: {text}")),
                ours => ours,
            },
            C::WrappedContext { wrapped, context } => match wrapped.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(other) => Error::Candle(format!("{other}: {context}")),
            },
            other => Error::Candle(other.to_string()),
        }
    }
}

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
