//! Arguments shared by the subcommands: masks, execution choices, shapes.

use clap::Args;
use ringattn::comm::LocalOptions;
use ringattn::cpu::{self, ForwardOutput, Gradients};
use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy};
use ringattn::{AttentionParams, Documents, Error, Layout, Mask, Result, Tensor};

/// Mask and scale options.
#[derive(Args, Debug, Clone, Default)]
pub struct MaskArgs {
    /// Causal mask (keys at or before the query's position). With --window, the right side
    /// is clamped to 0.
    #[arg(long)]
    pub causal: bool,
    /// Sliding window L,R: a query sees L keys back and R ahead; -1 means unbounded.
    #[arg(long, value_name = "L,R", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Softmax scale (default 1/sqrt(d)).
    #[arg(long, allow_hyphen_values = true)]
    pub scale: Option<f32>,
    /// Packed documents: comma-separated lengths summing to the key sequence length.
    #[arg(long, value_name = "A,B,...")]
    pub seqlens: Option<String>,
}

impl MaskArgs {
    /// The attention parameters these options describe.
    pub fn params(&self) -> Result<AttentionParams> {
        let mut mask = match &self.window {
            None => Mask::None,
            Some(w) => {
                let parts: Vec<&str> = w.split(',').collect();
                let side = |s: &str| {
                    s.trim().parse::<i64>().map_err(|_| Error::Window(format!("`{w}`: `{s}` is not an integer")))
                };
                match parts[..] {
                    [l, r] => Mask::from_signed_window(side(l)?, side(r)?)?,
                    _ => return Err(Error::Window(format!("`{w}`: expected two values L,R"))),
                }
            }
        };
        if self.causal {
            mask = if self.window.is_some() { mask.and_causal() } else { Mask::Causal };
        }
        if let Some(s) = self.scale {
            if !s.is_finite() {
                return Err(Error::Scale(s));
            }
        }
        let documents = match &self.seqlens {
            None => None,
            Some(list) => Some(Documents::new(parse_list(list, "--seqlens")?)?),
        };
        Ok(AttentionParams { mask, documents, scale: self.scale })
    }
}

/// How to execute: strategy, layout, world size, backend.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    /// Parallel strategy: single, ring, allgather, ulysses or usp (ranks run as threads of
    /// this process).
    #[arg(long, default_value = "single")]
    pub strategy: String,
    /// Number of ranks the sequence is split over.
    #[arg(long, default_value_t = 1)]
    pub world: usize,
    /// How tokens are spread over ranks: contiguous, zigzag or striped [default: zigzag for
    /// causal or windowed masks, contiguous otherwise].
    #[arg(long)]
    pub layout: Option<String>,
    /// Ulysses degree of --strategy usp [default: the largest divisor of --world that divides
    /// the query heads].
    #[arg(long)]
    pub ulysses_degree: Option<usize>,
    /// Compute backend: cpu (the CPU flash attention, every dtype), emu (the CUDA kernels of
    /// cuda/ run by the host emulator; bf16 and f16 inputs, head dims that are multiples of 8
    /// up to 256, small shapes: it is a correctness tool, not a fast path) or cuda (the same
    /// kernels on GPU 0; needs a build with --features cuda, an NVIDIA driver and a GPU).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Seconds any rank may wait on another before the run fails with an error naming both.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub timeout: f64,
}

impl ExecArgs {
    /// Options of the in-process ranks.
    pub fn local_options(&self) -> Result<LocalOptions> {
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "--timeout {}: must be a positive number of seconds",
                self.timeout
            )));
        }
        Ok(LocalOptions { deadline: std::time::Duration::from_secs_f64(self.timeout), ..Default::default() })
    }

    /// The backend named by --backend.
    pub fn backend(&self) -> Result<BackendKind> {
        parse_backend(&self.backend)
    }

    /// The parallel parameters these options describe (sequence length filled in later).
    pub fn parallel(&self, attention: AttentionParams) -> Result<ParallelParams> {
        self.backend()?;
        let strategy: Strategy = self.strategy.parse()?;
        let layout = self.layout.as_deref().map(str::parse::<Layout>).transpose()?;
        if strategy == Strategy::Single && self.world != 1 {
            return Err(Error::InvalidArgument(format!(
                "--world {}: strategy `single` runs on exactly one rank",
                self.world
            )));
        }
        if self.ulysses_degree.is_some() && strategy != Strategy::Usp {
            return Err(Error::InvalidArgument("--ulysses-degree applies to --strategy usp only".into()));
        }
        Ok(ParallelParams { strategy, layout, attention, seq_len: 0, ulysses_degree: self.ulysses_degree })
    }

    /// Whether this is a plain single-device run.
    pub fn is_single(&self) -> bool {
        self.strategy == "single"
    }
}

/// The compute backends of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU flash attention.
    Cpu,
    /// The CUDA kernels under the host emulator.
    Emu,
    /// The CUDA kernels on a GPU (feature `cuda`).
    Cuda,
}

/// The backend named `name` (`--backend`), refusing those this build lacks.
pub fn parse_backend(name: &str) -> Result<BackendKind> {
    match name {
        "cpu" => Ok(BackendKind::Cpu),
        "emu" if cfg!(feature = "emu") => Ok(BackendKind::Emu),
        "emu" => Err(Error::InvalidArgument("--backend emu: this build lacks the `emu` feature".into())),
        "cuda" if cfg!(feature = "cuda") => Ok(BackendKind::Cuda),
        "cuda" => Err(Error::InvalidArgument(
            "--backend cuda: this build lacks the `cuda` feature (cargo build --features cuda)".into(),
        )),
        other => Err(Error::UnknownBackend(other.to_string())),
    }
}

/// Forward (and backward when `d_o` is given) of full tensors as `exec` says: one device or
/// in-process ranks, on the chosen backend.
pub fn compute(
    exec: &ExecArgs,
    params: &AttentionParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
) -> Result<(ForwardOutput, Option<Gradients>)> {
    let parallel = exec.parallel(params.clone())?;
    match (exec.backend()?, exec.is_single()) {
        (BackendKind::Cpu, true) => {
            let fwd = cpu::forward(q, k, v, params)?;
            let grads = d_o.map(|g| cpu::backward(q, k, v, &fwd.o, &fwd.lse, g, params)).transpose()?;
            Ok((fwd, grads))
        }
        (BackendKind::Cpu, false) => {
            let r = run_in_process(exec.world, exec.local_options()?, &CpuBackend::default(), q, k, v, d_o, &parallel)?;
            Ok((r.forward, r.gradients))
        }
        #[cfg(feature = "emu")]
        (BackendKind::Emu, true) => {
            let opts = ringattn::emu::EmuOptions { workers: 0, ..Default::default() };
            let fwd = ringattn::emu::forward(q, k, v, None, params, &opts)?;
            let grads =
                d_o.map(|g| ringattn::emu::backward(q, k, v, &fwd.o, &fwd.lse, g, None, params, &opts)).transpose()?;
            Ok((fwd, grads))
        }
        #[cfg(feature = "emu")]
        (BackendKind::Emu, false) => {
            let backend = ringattn::emu::EmuBackend { dtype: q.dtype(), ..Default::default() };
            let r = run_in_process(exec.world, exec.local_options()?, &backend, q, k, v, d_o, &parallel)?;
            Ok((r.forward, r.gradients))
        }
        #[cfg(not(feature = "emu"))]
        (BackendKind::Emu, _) => unreachable!("backend() refuses emu without the feature"),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, true) => {
            let opts = ringattn::cuda::CudaOptions::default();
            let fwd = ringattn::cuda::forward(q, k, v, None, params, &opts)?;
            let grads =
                d_o.map(|g| ringattn::cuda::backward(q, k, v, &fwd.o, &fwd.lse, g, None, params, &opts)).transpose()?;
            Ok((fwd, grads))
        }
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, false) => {
            let backend = ringattn::cuda::CudaBackend::new(0, q.dtype())?;
            let r = run_in_process(exec.world, exec.local_options()?, &backend, q, k, v, d_o, &parallel)?;
            Ok((r.forward, r.gradients))
        }
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => unreachable!("backend() refuses cuda without the feature"),
    }
}

/// Parses a comma-separated list of non-negative integers.
pub fn parse_list(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| Error::InvalidArgument(format!("{what} `{s}`: `{x}` is not a non-negative integer")))
        })
        .collect()
}
