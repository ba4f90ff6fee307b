//! # ringattn
//!
//! Exact attention for long sequences: flash-attention (tiled, online softmax, never an
//! `s × s` matrix) forward and backward, a float64 oracle to check it against, and ring,
//! all-gather, Ulysses and USP drivers that split one sequence across ranks ([`parallel`],
//! over a [`comm::Communicator`]: threads, MPI processes, GPUs through NCCL). It runs on the
//! CPU ([`cpu`]), on the host emulator of its CUDA kernels (feature `emu`) and, with the
//! `cuda` feature, on NVIDIA GPUs (`cuda`: the kernels of `cuda/` through cudarc, loaded at
//! run time).
//!
//! In training code each rank makes a [`parallel::ParallelPlan`] once and calls
//! [`ring_attention`] / [`ring_attention_backward`] layer after layer on its backend's buffers
//! ([`HostBuf`] on the host, device buffers on GPUs) in the input dtype; with the `candle`
//! feature, `candle::ring_attention` is the same call on candle tensors with autograd.
//!
//! ## Conventions
//!
//! * **Layout BSHD, contiguous.** q and o are `[b, s_q, h_q, d]`; k and v `[b, s_k, h_kv, d]`.
//! * **GQA.** `h_q % h_kv == 0`; query head `i` uses kv head `i / (h_q / h_kv)`.
//! * **Masks on global positions.** Key `j` is visible to query `i` iff
//!   `pos_k(j) >= pos_q(i) - left` and `pos_k(j) <= pos_q(i) + right` ([`Mask`]; `None`
//!   sides are unbounded, causal is `(unbounded, 0)`). A single-device call uses
//!   `pos_q(i) = i + (s_k - s_q)` and `pos_k(j) = j` (bottom-right aligned, like
//!   flash-attention when `s_q != s_k`); a block call ([`cpu::forward_at`]) takes each side's
//!   positions as `(start, stride, len)` segments ([`Positions`]).
//! * **Packed documents.** [`Documents`] (lengths summing to the global length) restrict
//!   visibility to the query's own document.
//! * **Masked pairs never matter**: a masked key's values, even NaN or Inf, never reach a
//!   query's output, and a masked pair contributes nothing to any gradient.
//! * **Scale** defaults to `1/sqrt(d)` ([`AttentionParams::scale`]).
//! * **LSE** `[b, h_q, s_q]`, f32, natural log of `Σ_j exp(scale · q·k_j)` over visible keys.
//! * **Fully masked rows** give `lse = -inf`, `o = 0` and zero gradients.
//! * **Dtypes** f32, bf16, f16 in and out ([`DType`]); arithmetic and accumulation in f32.
//! * **Empty sequences** (`s_q = 0` or `s_k = 0`) are valid and give empty (or, for `s_k = 0`,
//!   fully masked) outputs.
//! * **NaN and Inf** in visible inputs propagate as IEEE arithmetic does: a NaN in a key a
//!   query sees makes that query's output NaN.
//! * **Errors** are one enum, [`Error`]; bad input never panics.
//!
//! ## Example
//!
//! ```
//! use ringattn::{cpu, random::randn, reference, verify, AttentionParams, DType, Mask};
//!
//! let (b, s, h_q, h_kv, d) = (1, 100, 4, 2, 32);
//! let q = randn(vec![b, s, h_q, d], 1, DType::F32);
//! let k = randn(vec![b, s, h_kv, d], 2, DType::F32);
//! let v = randn(vec![b, s, h_kv, d], 3, DType::F32);
//! let params = AttentionParams { mask: Mask::Causal, ..Default::default() };
//!
//! let out = cpu::forward(&q, &k, &v, &params)?;
//! let oracle = reference::forward(&q, &k, &v, &params)?;
//! assert!(verify::rel_err(&out.o.to_f32_vec(), &oracle.o) < 1e-5);
//! # Ok::<(), ringattn::Error>(())
//! ```

#![warn(missing_docs)]

pub mod attention;
mod buf;
#[cfg(feature = "candle")]
pub mod candle;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dispatch;
mod dtype;
#[cfg(feature = "emu")]
pub mod emu;
mod error;
pub mod flops;
pub mod io;
pub mod kernels;
mod layout;
mod mask;
pub mod memory;
pub mod merge;
pub mod parallel;
mod params;
pub mod plan;
mod positions;
pub mod random;
pub mod reference;
#[cfg(any(feature = "emu", feature = "cuda"))]
mod runner;
mod tensor;
pub mod verify;

pub use attention::{ForwardOutput, Gradients};
pub use buf::{Elem, HostBuf, HostData};
pub use dtype::DType;
pub use error::{Error, Result};
pub use layout::Layout;
pub use mask::{Documents, Mask};
pub use parallel::{ring_attention, ring_attention_backward};
pub use params::{AttentionParams, Dims, MAX_HEAD_DIM};
pub use positions::{Positions, Segment};
pub use tensor::{Tensor, TensorData};

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
