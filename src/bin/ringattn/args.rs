//! Arguments shared by the subcommands: masks, execution choices, shapes.

use clap::Args;
use ringattn::comm::LocalOptions;
use ringattn::cpu::{self, ForwardOutput, Gradients};
use ringattn::kernels::geometry::KernelFamily;
use ringattn::parallel::{run_in_process, AutoModel, CpuBackend, ParallelParams, ProcessRun, Strategy};
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
    /// Tanh soft-cap C of the scaled scores (Gemma 2: 50): a score s enters the softmax as
    /// C·tanh(s/C). A backend that cannot honour it refuses the call.
    #[arg(long, value_name = "C")]
    pub softcap: Option<f32>,
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
        let documents = match &self.seqlens {
            None => None,
            Some(list) => Some(Documents::new(parse_list(list, "--seqlens")?)?),
        };
        let params = AttentionParams { mask, documents, scale: self.scale, softcap: self.softcap, sinks: None };
        params.check_scores()?;
        Ok(params)
    }
}

/// How to execute: strategy, layout, world size, backend.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    #[arg(
        long,
        default_value = "single",
        help = format!(
            "Parallel strategy: {}, or auto (chosen per batch of --seqlens documents by the cost model: strategy, \
             layout and Ulysses degree; the choice and its predicted time are in the statistics)",
            Strategy::list(&Strategy::ALL)
        )
    )]
    pub strategy: String,
    /// Calibration files for --strategy auto's cost model (`ringattn pingpong --json` and
    /// `ringattn bench --json` reports, as `ringattn plan --calibration` takes them) [default:
    /// the planner's default cluster].
    #[arg(long, value_name = "FILE")]
    pub calibration: Vec<std::path::PathBuf>,
    /// Number of ranks the sequence is split over [default: 1, or the MPI job's size with
    /// --comm mpi, which it must equal when given].
    #[arg(long)]
    pub world: Option<usize>,
    /// How ranks communicate: local (ranks are threads of this process), mpi (ranks are the
    /// processes of an MPI job: `mpirun -n P ringattn run --comm mpi ...`; a build with
    /// --features mpi) or nccl (one process per GPU, --backend cuda, device buffers through
    /// NCCL; launched by torchrun, srun or mpirun: the rank and GPU come from RANK /
    /// SLURM_PROCID / OMPI_COMM_WORLD_RANK and the local rank modulo the visible GPUs; the
    /// NCCL id from MPI (--features mpi) or over TCP from MASTER_ADDR on
    /// RINGATTN_BOOTSTRAP_PORT, default MASTER_PORT + 100). With mpi and nccl each rank reads
    /// only its own rows of --input and rank 0 writes --output.
    #[arg(long, default_value = "local")]
    pub comm: String,
    /// How tokens are spread over ranks: contiguous, zigzag, striped or balanced (chunks placed
    /// so that every rank has as many tokens and visible (query, key) pairs as the others under
    /// the mask and --seqlens documents) [default: zigzag for causal or windowed masks,
    /// contiguous otherwise].
    #[arg(long)]
    pub layout: Option<String>,
    /// Ulysses degree of --strategy usp [default: the largest divisor of --world that divides
    /// the query heads].
    #[arg(long)]
    pub ulysses_degree: Option<usize>,
    /// Compute backend: cpu (the CPU flash attention, every dtype), emu (the CUDA kernels of
    /// cuda/ run by the host emulator; bf16 and f16 inputs, head dims that are multiples of 8
    /// up to 256, small shapes: it is a correctness tool, not a fast path) or cuda (the same
    /// kernels on GPU 0; needs a build with --features cuda, an NVIDIA driver and a GPU;
    /// in-process ranks then share the GPU, their buffers resident on it).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Arithmetic of the cpu backend's products: auto (bf16 products with f32 accumulation
    /// for bf16 inputs where the processor has AVX512_BF16 — on AMX tiles where it has
    /// AMX-BF16 —, f32 otherwise), f32 (inputs
    /// widened to f32: the fallback, on any processor) or bf16 (bf16 inputs only; an error
    /// elsewhere).
    #[arg(long, default_value = "auto", value_name = "auto|f32|bf16")]
    pub cpu_arithmetic: String,
    /// Unit of the cpu backend's matrix products: auto (AMX tiles where the processor has
    /// AMX-BF16 and Linux grants them — bf16 products, and the f32 forward's products as
    /// three bf16 parts per operand, f32-accurate — vector units otherwise) or vector
    /// (vdpbf16ps and f32 FMA only: the same bits on every AVX-512 processor, AMX or not).
    #[arg(long, default_value = "auto", value_name = "auto|vector")]
    pub cpu_matrix_unit: String,
    /// Tensor-core kernel family of the emu and cuda backends, forward and backward: auto (the
    /// FA2 family until the Hopper kernels have been verified on a GPU), fa2 (mma.sync, every
    /// GPU) or hopper (wgmma, TMA and warp specialisation: H100/H200 with an sm_90a build; the
    /// emulator runs it whatever the host).
    #[arg(long, default_value = "auto", value_name = "auto|fa2|hopper")]
    pub kernels: String,
    /// Seconds any rank may wait on another before the run fails with an error naming both.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub timeout: f64,
}

impl ExecArgs {
    /// The deadline of every wait (--timeout).
    pub fn deadline(&self) -> Result<std::time::Duration> {
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "--timeout {}: must be a positive number of seconds",
                self.timeout
            )));
        }
        Ok(std::time::Duration::from_secs_f64(self.timeout))
    }

    /// Options of the in-process ranks.
    pub fn local_options(&self) -> Result<LocalOptions> {
        Ok(LocalOptions { deadline: self.deadline()?, ..Default::default() })
    }

    /// The number of in-process ranks (--world, default 1).
    pub fn world(&self) -> usize {
        self.world.unwrap_or(1)
    }

    /// The communicator named by --comm, refusing those this build lacks.
    pub fn comm_kind(&self) -> Result<CommKind> {
        match self.comm.as_str() {
            "local" => Ok(CommKind::Local),
            "mpi" if cfg!(feature = "mpi") => Ok(CommKind::Mpi),
            "mpi" => Err(Error::InvalidArgument(
                "--comm mpi: this build lacks the `mpi` feature (cargo build --release --features mpi)".into(),
            )),
            "nccl" if cfg!(feature = "cuda") => Ok(CommKind::Nccl),
            "nccl" => Err(Error::InvalidArgument(
                "--comm nccl: this build lacks the `cuda` feature (cargo build --release --features cuda)".into(),
            )),
            other => Err(Error::InvalidArgument(format!("--comm `{other}`: expected local, mpi or nccl"))),
        }
    }

    /// The backend named by --backend.
    pub fn backend(&self) -> Result<BackendKind> {
        parse_backend(&self.backend)
    }

    /// The kernel family of --kernels, checked against --backend.
    pub fn kernels(&self) -> Result<KernelFamily> {
        kernel_family(&self.kernels, self.backend()?)
    }

    /// The emulator's options: every core, --kernels.
    #[cfg(feature = "emu")]
    pub fn emu_options(&self) -> Result<ringattn::emu::EmuOptions> {
        Ok(ringattn::emu::EmuOptions { workers: 0, kernels: self.kernels()?, ..Default::default() })
    }

    /// The cpu backend's arithmetic (--cpu-arithmetic).
    pub fn arithmetic(&self) -> Result<cpu::Arithmetic> {
        self.cpu_arithmetic.parse()
    }

    /// The unit of the cpu backend's matrix products (--cpu-matrix-unit).
    ///
    /// # Errors
    /// An unknown name, and `vector` where no CPU product runs (another backend than cpu):
    /// the option would be dropped.
    pub fn matrix_unit(&self) -> Result<cpu::MatrixUnit> {
        let unit: cpu::MatrixUnit = self.cpu_matrix_unit.parse()?;
        if unit != cpu::MatrixUnit::Auto && self.backend()? != BackendKind::Cpu {
            return Err(Error::InvalidArgument(format!(
                "--cpu-matrix-unit {}: the {} backend has no CPU products",
                self.cpu_matrix_unit, self.backend
            )));
        }
        Ok(unit)
    }

    /// The cpu backend of the parallel drivers, with --cpu-arithmetic and --cpu-matrix-unit.
    pub fn cpu_backend(&self) -> Result<CpuBackend> {
        Ok(CpuBackend { arithmetic: self.arithmetic()?, matrix_unit: self.matrix_unit()?, ..Default::default() })
    }

    /// The cpu backend's configuration, with --cpu-arithmetic, --cpu-matrix-unit and an
    /// optional progress counter.
    pub fn cpu_config<'a>(&self, progress: Option<&'a std::sync::atomic::AtomicU64>) -> Result<cpu::CpuConfig<'a>> {
        Ok(cpu::CpuConfig {
            arithmetic: self.arithmetic()?,
            matrix_unit: self.matrix_unit()?,
            progress,
            ..Default::default()
        })
    }

    /// The parallel parameters these options describe (sequence length filled in later).
    pub fn parallel(&self, attention: AttentionParams) -> Result<ParallelParams> {
        self.backend()?;
        self.arithmetic()?;
        self.matrix_unit()?;
        self.kernels()?;
        self.comm_kind()?;
        let strategy: Strategy = self.strategy.parse()?;
        let layout = self.layout.as_deref().map(str::parse::<Layout>).transpose()?;
        if strategy == Strategy::Single && self.world.is_some_and(|w| w != 1) {
            return Err(Error::InvalidArgument(format!(
                "--world {}: strategy `single` runs on exactly one rank",
                self.world()
            )));
        }
        if self.ulysses_degree.is_some() && strategy != Strategy::Usp {
            return Err(Error::InvalidArgument("--ulysses-degree applies to --strategy usp only".into()));
        }
        if !self.calibration.is_empty() && strategy != Strategy::Auto {
            return Err(Error::InvalidArgument("--calibration applies to --strategy auto only".into()));
        }
        let mut auto = AutoModel::default();
        for path in &self.calibration {
            ringattn::plan::Calibration::load(path)?.apply(&mut auto.cluster);
        }
        Ok(ParallelParams { strategy, layout, attention, seq_len: 0, ulysses_degree: self.ulysses_degree, auto })
    }

    /// What runs, for a report line: `ring x4, Zigzag layout`, or under --strategy auto what
    /// it chose for this batch (`auto x4: ring, balanced layout, Ulysses degree 1, predicted
    /// 1.234 ms`).
    pub fn describe(&self, parallel: &ParallelParams, dims: &ringattn::Dims, dtype: ringattn::DType) -> Result<String> {
        let world = self.world();
        if parallel.strategy != Strategy::Auto {
            return Ok(format!("{} x{world}, {:?} layout", parallel.strategy, parallel.layout()));
        }
        let resolved = parallel.resolve_for(world, dims, dtype)?;
        let c = resolved.chosen().expect("auto resolves to a choice");
        Ok(format!(
            "auto x{world}: {}, {} layout, Ulysses degree {}, predicted {:.3} ms",
            c.strategy,
            c.layout,
            c.ulysses_degree,
            c.predicted_s * 1e3
        ))
    }

    /// Whether this is a plain single-device run.
    pub fn is_single(&self) -> bool {
        self.strategy == "single"
    }
}

/// The communicators of the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommKind {
    /// Ranks as threads of this process.
    Local,
    /// Ranks as the processes of an MPI job (feature `mpi`).
    Mpi,
    /// Ranks as processes with one GPU each, exchanging through NCCL (feature `cuda`).
    Nccl,
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

/// The kernel family `name` (--kernels) for `backend`: the cpu backend has none to choose
/// (auto only).
pub fn kernel_family(name: &str, backend: BackendKind) -> Result<KernelFamily> {
    let family: KernelFamily = name.parse()?;
    if backend == BackendKind::Cpu && family != KernelFamily::Auto {
        return Err(Error::InvalidArgument(format!(
            "--kernels {name}: selects the tensor-core kernels of --backend emu or cuda, not cpu"
        )));
    }
    Ok(family)
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
    if !exec.is_single() {
        let mut parallel = exec.parallel(params.clone())?;
        parallel.seq_len = q.shape().get(1).copied().unwrap_or(0);
        let r = run_parallel(exec, q, k, v, d_o, &parallel)?;
        return Ok((r.forward, r.gradients));
    }
    let fwd = forward_single(exec, params, q, k, v)?;
    let grads = d_o.map(|g| backward_single(exec, params, q, k, v, &fwd, g)).transpose()?;
    Ok((fwd, grads))
}

/// The single-device forward on the chosen backend.
pub fn forward_single(
    exec: &ExecArgs,
    params: &AttentionParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<ForwardOutput> {
    match exec.backend()? {
        BackendKind::Cpu => cpu::forward_with(q, k, v, None, params, &exec.cpu_config(None)?),
        #[cfg(feature = "emu")]
        BackendKind::Emu => ringattn::emu::forward(q, k, v, None, params, &exec.emu_options()?),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let opts = ringattn::cuda::CudaOptions { kernels: exec.kernels()?, ..Default::default() };
            ringattn::cuda::forward(q, k, v, None, params, &opts)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::InvalidArgument(format!("--backend {other:?}: not in this build"))),
    }
}

/// The single-device backward of `fwd` on the chosen backend.
pub fn backward_single(
    exec: &ExecArgs,
    params: &AttentionParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &ForwardOutput,
    d_o: &Tensor,
) -> Result<Gradients> {
    let (o, lse) = (&fwd.o, &fwd.lse);
    match exec.backend()? {
        BackendKind::Cpu => cpu::backward_with(q, k, v, o, lse, d_o, None, params, &exec.cpu_config(None)?),
        #[cfg(feature = "emu")]
        BackendKind::Emu => ringattn::emu::backward(q, k, v, o, lse, d_o, None, params, &exec.emu_options()?),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let opts = ringattn::cuda::CudaOptions { kernels: exec.kernels()?, ..Default::default() };
            ringattn::cuda::backward(q, k, v, o, lse, d_o, None, params, &opts)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::InvalidArgument(format!("--backend {other:?}: not in this build"))),
    }
}

/// The full tensors sharded over `exec.world()` in-process ranks running `parallel` on the
/// chosen backend, results gathered in the original token order.
pub fn run_parallel(
    exec: &ExecArgs,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    parallel: &ParallelParams,
) -> Result<ProcessRun> {
    let (world, options) = (exec.world(), exec.local_options()?);
    match exec.backend()? {
        BackendKind::Cpu => run_in_process(world, options, &exec.cpu_backend()?, q, k, v, d_o, parallel),
        #[cfg(feature = "emu")]
        BackendKind::Emu => {
            let emu = ringattn::emu::EmuOptions { kernels: exec.kernels()?, ..Default::default() };
            let backend = ringattn::emu::EmuBackend { dtype: q.dtype(), options: emu };
            run_in_process(world, options, &backend, q, k, v, d_o, parallel)
        }
        // Device-resident: every rank's buffers on GPU 0, exchanges by device copies.
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let run = ringattn::cuda::DeviceRunOptions { kernels: exec.kernels()?, ..Default::default() };
            ringattn::cuda::run_on_device(world, options, &run, q, k, v, d_o, parallel)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::InvalidArgument(format!("--backend {other:?}: not in this build"))),
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
