//! `ringattn bench`: timing of the single-device kernels of a backend, or (with
//! `--strategies`, `--world`, several `--seq` or `--out`) a sweep over strategies, world
//! sizes and sequence lengths ([`crate::sweep`]).
//!
//! FLOPs are those of the pairs the mask leaves visible ([`ringattn::flops`]: `4·d` per
//! visible pair forward, 2.5× backward), reported beside the dense count and the tiles of
//! the backend's tiling.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ringattn::flops::{self, TileShape, Tiles};
use ringattn::kernels::geometry::{self, DqMode, KernelFamily};
use ringattn::{cpu, random::randn, AttentionParams, DType, Dims, Error, Mask, Result, Tensor};
use serde::Serialize;

use crate::args::{parse_backend, BackendKind, MaskArgs};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Backend: cpu (ringattn::cpu), emu (the CUDA kernels on the host emulator: tiny shapes
    /// only) or cuda (the kernels on a GPU; needs --features cuda).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Sequence length (s_q = s_k); a comma-separated list sweeps [default: 4096; 1024,2048,4096
    /// in sweeps].
    #[arg(long)]
    pub seq: Option<String>,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Key/value heads (GQA when fewer than --heads) [default: --heads].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension (of q and k; of v too unless --head-dim-v).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Head dimension of v and o, when it differs from q and k's (multi-head latent
    /// attention: --head-dim 192 --head-dim-v 128) [default: --head-dim].
    #[arg(long)]
    pub head_dim_v: Option<usize>,
    /// Dtype: bf16, f16 or f32 (f32: cpu only; the kernels take 16-bit inputs) [default:
    /// bf16; f32 for cpu sweeps].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Causal mask (keys at or before the query's position). With --window, the right side
    /// is clamped to 0.
    #[arg(long)]
    pub causal: bool,
    /// Sliding window L,R: a query sees L keys back and R ahead; -1 means unbounded (single
    /// runs, not sweeps).
    #[arg(long, value_name = "L,R", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Packed documents: comma-separated lengths summing to --seq (single runs, not sweeps).
    #[arg(long, value_name = "A,B,...")]
    pub seqlens: Option<String>,
    /// Tanh soft-cap C of the scaled scores (single runs and sweeps).
    #[arg(long, value_name = "C")]
    pub softcap: Option<f32>,
    /// Passes to time: forward, backward (from a forward's o and lse: rowsum, dq, dk/dv) or
    /// both.
    #[arg(long, default_value = "both")]
    pub pass: String,
    /// Untimed iterations before the timed ones [default: 3; 1 per configuration in sweeps].
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Timed iterations, at least 1 [default: 10; 3 per configuration in sweeps].
    #[arg(long)]
    pub iters: Option<usize>,
    /// Sweep: strategies to run with more than one rank, comma-separated (--strategy's
    /// names; single is the one-rank baseline) [default: every strategy of more than one
    /// rank].
    #[arg(long, value_name = "LIST")]
    pub strategies: Option<String>,
    /// Sweep: world sizes, comma-separated (1 = the single-device baseline) [default: 1,2,4].
    #[arg(long, value_name = "LIST")]
    pub world: Option<String>,
    /// Sweep: token layout over ranks, contiguous, zigzag, striped or balanced [default: zigzag
    /// when causal, contiguous otherwise]; with --docs a comma-separated list [default:
    /// zigzag,balanced].
    #[arg(long)]
    pub layout: Option<String>,
    /// Sweep: folder for bench.json, bench.csv and the plots (throughput, hidden, weak
    /// scaling; PNG and SVG) [default: bench-out].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Sweep: bandwidth of the link model between in-process ranks, GB/s (0: instant, no
    /// hidden share measured) [default: 2].
    #[arg(long)]
    pub link_gbps: Option<f64>,
    /// Sweep: one-way latency of the link model, microseconds.
    #[arg(long, default_value_t = 20.0)]
    pub link_latency_us: f64,
    /// GPU ordinal of --backend cuda.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// How the cuda (and emu) backward computes dq: deterministic (bit-identical run to run:
    /// fixed point with integer atomics — on the FA2 family up to head dim 128, its own kernel
    /// from 192; on the Hopper family at every head dim) or atomic (added by the dk/dv kernel
    /// with f32 atomics).
    #[arg(long, default_value = "deterministic")]
    pub dq_mode: String,
    /// Tensor-core kernel family of the emu and cuda forward and backward: auto, fa2 or hopper (as
    /// `ringattn run --kernels`).
    #[arg(long, default_value = "auto", value_name = "auto|fa2|hopper")]
    pub kernels: String,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the results as JSON to this file (atomically).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Packed-document batches: document lengths drawn from DIST to fill --seq (lognormal:
    /// median 1500, σ 1, 128..16384; lognormal:MEDIAN:SIGMA:MIN:MAX; or a list such as
    /// 4096,1024 repeated), one batch per --doc-seeds; reports per strategy (--strategies,
    /// default ring) and layout (--layout, a list, default zigzag,balanced) the imbalance of
    /// visible pairs per rank, bytes sent, ring hops skipped and forward + backward time
    /// [default --seq: 32768; --world: 2,4,8].
    #[arg(long, value_name = "DIST")]
    pub docs: Option<String>,
    /// Batches (seeds 0..N) of --docs.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub doc_seeds: usize,
    /// Ranks of --docs: local (threads of this process, --world) or mpi (the processes of
    /// `mpirun -n P ringattn bench --comm mpi --docs ...`; a build with --features mpi).
    #[arg(long, default_value = "local")]
    pub comm: String,
    /// --docs: calibration of the cost model that predicts each configuration and resolves
    /// `auto` in --strategies (the JSON of `ringattn bench --json` for the kernel rates, a
    /// ping-pong for the link, as `plan --calibration`); repeatable, later files win
    /// [default: the model's H200 figures].
    #[arg(long, value_name = "FILE")]
    pub calibration: Vec<PathBuf>,
}

/// The timings of one pass, with the work they are divided into.
#[derive(Serialize, Debug)]
struct PassResult {
    pass: &'static str,
    median_ms: f64,
    min_ms: f64,
    /// `flops` / median time.
    tflops: f64,
    samples_ms: Vec<f64>,
    /// FLOPs of the visible pairs: `2·(d_qk + d_v)·b·h_q·visible_pairs` forward (`4·d` with equal
    /// head dims), `2·(3·d_qk + 2·d_v)·b·h_q·visible_pairs` backward (2.5× the forward).
    flops: f64,
    /// FLOPs of all `s²` pairs.
    dense_flops: f64,
    /// Visible (query, key) pairs per (batch element, query head).
    visible_pairs: u64,
    /// `[query rows, key rows]` per tile of the backend's tiling of this pass.
    tile: [usize; 2],
    /// (query tile, key tile) pairs per (batch element, query head).
    tiles_total: u64,
    /// Of which those holding at least one visible pair.
    tiles_visible: u64,
    /// FLOPs the backend's matrix products perform (`flops::executed_flops`: whole tiles,
    /// head-dim padding, the deterministic backward's recomputation); its throughput.
    executed_flops: f64,
    executed_tflops: f64,
}

/// The JSON report: the interface of the device-check scripts, keep it stable.
#[derive(Serialize, Debug)]
struct BenchReport {
    backend: String,
    device: String,
    /// The device is ringattn's emulated GPU (the stand-in driver): the timings are the CPU
    /// emulator's, not GPU figures.
    emulated: bool,
    dtype: String,
    b: usize,
    s: usize,
    h_q: usize,
    h_kv: usize,
    /// Head dim of q and k.
    d: usize,
    /// Head dim of v and o (equal to `d` but in multi-head latent attention).
    d_v: usize,
    causal: bool,
    /// `[left, right]` of --window (-1: unbounded; right clamped to 0 with --causal).
    window: Option<[i64; 2]>,
    /// Document lengths of --seqlens.
    seqlens: Option<Vec<usize>>,
    /// The tanh soft-cap of --softcap.
    softcap: Option<f32>,
    results: Vec<PassResult>,
}

impl BenchArgs {
    /// The attention parameters of a single run: its mask, documents and soft-cap (the
    /// softmax scale is the default).
    fn params(&self) -> Result<AttentionParams> {
        let mask = MaskArgs {
            causal: self.causal,
            window: self.window.clone(),
            seqlens: self.seqlens.clone(),
            softcap: self.softcap,
            ..Default::default()
        };
        mask.params()
    }
}

/// The inputs of a run.
struct Inputs {
    dims: Dims,
    dtype: DType,
    params: AttentionParams,
    dq_mode: DqMode,
    kernels: KernelFamily,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

impl From<Pass> for flops::Pass {
    fn from(p: Pass) -> Self {
        match p {
            Pass::Forward => flops::Pass::Forward,
            Pass::Backward => flops::Pass::Backward,
        }
    }
}

fn passes(s: &str) -> Result<Vec<Pass>> {
    match s {
        "forward" => Ok(vec![Pass::Forward]),
        "backward" => Ok(vec![Pass::Backward]),
        "both" => Ok(vec![Pass::Forward, Pass::Backward]),
        other => Err(Error::InvalidArgument(format!("--pass `{other}`: expected forward, backward or both"))),
    }
}

/// Median of `x` (the mean of the middle two for an even count).
pub fn median(x: &[f64]) -> f64 {
    let mut v = x.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub(crate) fn parse_dq_mode(s: &str) -> Result<DqMode> {
    match s {
        "deterministic" => Ok(DqMode::Deterministic),
        "atomic" => Ok(DqMode::Atomic),
        other => Err(Error::InvalidArgument(format!("--dq-mode `{other}`: expected deterministic or atomic"))),
    }
}

/// The tiles of `backend`'s tiling of `pass`: the CPU's [`cpu::TileConfig`], the CUDA
/// kernels' tiles (forward kernel; fused kernel of the backward) on emu and cuda.
fn tile_shape(backend: BackendKind, pass: Pass, dims: &Dims, cpu_tiles: cpu::TileConfig) -> TileShape {
    match (backend, pass) {
        (BackendKind::Cpu, _) => cpu_tiles.into(),
        (_, Pass::Forward) => TileShape::cuda_forward(dims),
        (_, Pass::Backward) => TileShape::cuda_backward(geometry::fa2_head_dim(dims)),
    }
}

/// What the header says of the mask: `full`, `causal`, `window L,R`, plus the documents.
fn describe_mask(p: &AttentionParams) -> String {
    let side = |x: Option<i64>| x.map_or("-1".to_string(), |x| x.to_string());
    let mut m = match p.mask {
        Mask::None => "full".to_string(),
        Mask::Causal => "causal".to_string(),
        Mask::Window { .. } => {
            let (l, r) = p.mask.bounds();
            format!("window {},{}", side(l), side(r))
        }
    };
    if let Some(d) = &p.documents {
        m += &format!(", {} documents", d.lengths().len());
    }
    if let Some(c) = p.softcap {
        m += &format!(", softcap {c}");
    }
    m
}

/// The work of one pass: `(flops, dense_flops, tile shape, tiles, executed flops)`.
fn work(backend: BackendKind, x: &Inputs, pass: Pass, pairs: u64) -> Result<(f64, f64, TileShape, Tiles, f64)> {
    let dims = &x.dims;
    // The cpu backend's default tiles, as the path its products take chooses them.
    let arithmetic = cpu::Arithmetic::Auto.resolve(x.dtype)?;
    let cpu_tiles = cpu::TileConfig::default().chosen(arithmetic, pass.into(), &x.params, dims.s_q, dims.s_k)?;
    let shape = match (backend, pass, x.kernels) {
        (BackendKind::Emu | BackendKind::Cuda, Pass::Forward, KernelFamily::Hopper) => {
            TileShape { block_q: 64, block_k: geometry::hopper_forward_tile(dims.d_max()).1 }
        }
        _ => tile_shape(backend, pass, dims, cpu_tiles),
    };
    let tiles = flops::tiles(dims, &x.params, shape)?;
    let executor = match backend {
        BackendKind::Cpu => flops::Executor::Cpu(cpu_tiles),
        BackendKind::Emu | BackendKind::Cuda if x.kernels == KernelFamily::Hopper => flops::Executor::Hopper(x.dq_mode),
        BackendKind::Emu | BackendKind::Cuda => flops::Executor::Kernels(x.dq_mode),
    };
    Ok((
        flops::flops(dims, pairs, pass.into()),
        flops::flops(dims, flops::dense_pairs(dims), pass.into()),
        shape,
        tiles,
        flops::executed_flops(dims, &x.params, pass.into(), executor)?,
    ))
}

pub fn bench(a: &BenchArgs) -> Result<ExitCode> {
    if let Some(docs) = &a.docs {
        return crate::docbench::run(a, docs);
    }
    if !a.calibration.is_empty() {
        return Err(Error::InvalidArgument(
            "--calibration applies to --docs runs (the model's predictions and auto)".into(),
        ));
    }
    if a.comm != "local" {
        return Err(Error::InvalidArgument(format!(
            "--comm {} applies to --docs runs; the other benches run in this process",
            a.comm
        )));
    }
    let seqs = crate::args::parse_list(a.seq.as_deref().unwrap_or("4096"), "--seq")?;
    if seqs.len() != 1 || a.strategies.is_some() || a.world.is_some() || a.out.is_some() {
        if a.window.is_some() || a.seqlens.is_some() {
            return Err(Error::InvalidArgument(
                "--window and --seqlens apply to single runs (one --seq), not sweeps".into(),
            ));
        }
        return crate::sweep::sweep(a);
    }
    let backend = parse_backend(&a.backend)?;
    let passes = passes(&a.pass)?;
    let dq_mode = parse_dq_mode(&a.dq_mode)?;
    let kernels = crate::args::kernel_family(&a.kernels, backend)?;
    let params = a.params()?;
    let dtype: DType = a.dtype.as_deref().unwrap_or("bf16").parse()?;
    let (warmup, iters) = (a.warmup.unwrap_or(3), a.iters.unwrap_or(10));
    let (b, s, hq, d) = (a.batch, seqs[0], a.heads, a.head_dim);
    let (hkv, d_v) = (a.kv_heads.unwrap_or(hq), a.head_dim_v.unwrap_or(d));
    if s == 0 || b == 0 {
        return Err(Error::InvalidArgument("--seq and --batch must be at least 1".into()));
    }
    if iters == 0 {
        return Err(Error::InvalidArgument("--iters must be at least 1".into()));
    }
    let seed = a.seed.wrapping_mul(4);
    let q = randn(vec![b, s, hq, d], seed, dtype);
    let k = randn(vec![b, s, hkv, d], seed + 1, dtype);
    let v = randn(vec![b, s, hkv, d_v], seed + 2, dtype);
    let d_o = randn(vec![b, s, hq, d_v], seed + 3, dtype);
    let dims = Dims::of(&q, &k, &v)?;
    // Counted before timing: refuses documents that disagree with --seq up front.
    let pairs = flops::visible_pairs(&dims, &params)?;
    let x = Inputs { dims, dtype, params, dq_mode, kernels, q, k, v, d_o };
    let (device, samples) = match backend {
        BackendKind::Cpu => ("cpu".to_string(), host_bench(a, &x, &passes, cpu_forward, cpu_backward)?),
        BackendKind::Emu => ("cpu".to_string(), emu_bench(a, &x, &passes)?),
        BackendKind::Cuda => cuda_bench(a, &x, &passes)?,
    };
    let Dims { b, s_q: s, h_q: hq, h_kv: hkv, d_qk: d, d_v, .. } = x.dims;
    let dtype = x.dtype;
    let dense = flops::dense_pairs(&x.dims);
    if ringattn::kernels::is_emulated_gpu(&device) {
        println!(
            "EMULATED GPU: these are timings of the CPU emulator behind ringattn's stand-in driver, not GPU figures"
        );
    }
    println!(
        "ringattn bench: {} ({device}) b={b} s={s} h_q={hq} h_kv={hkv} d_qk={d} d_v={d_v} {dtype} {}, {} warmup + {} timed iterations",
        a.backend,
        describe_mask(&x.params),
        warmup,
        iters
    );
    println!(
        "work: {pairs} of {dense} (query, key) pairs visible per (batch, head) ({:.2}%); FLOPs: 2·(d_qk + d_v)·b·h_q per visible pair{}",
        100.0 * pairs as f64 / dense.max(1) as f64,
        if passes.contains(&Pass::Backward) { " forward, 2·(3·d_qk + 2·d_v)·b·h_q backward" } else { "" }
    );
    let mut results = Vec::new();
    for (pass, samples_ms) in samples {
        let (flops, dense_flops, shape, tiles, executed_flops) = work(backend, &x, pass, pairs)?;
        let median_ms = median(&samples_ms);
        let min_ms = samples_ms.iter().copied().fold(f64::INFINITY, f64::min);
        let tflops = flops / (median_ms * 1e-3) / 1e12;
        let executed_tflops = executed_flops / (median_ms * 1e-3) / 1e12;
        println!(
            "{:<8}: median {median_ms:10.3} ms  min {min_ms:10.3} ms  {:9.3} GFLOP (dense {:.3}, executed {:.3})  tiles {}x{}: {} of {}  {tflops:9.3} TFLOP/s",
            pass.name(),
            flops / 1e9,
            dense_flops / 1e9,
            executed_flops / 1e9,
            shape.block_q,
            shape.block_k,
            tiles.visible,
            tiles.total
        );
        results.push(PassResult {
            pass: pass.name(),
            median_ms,
            min_ms,
            tflops,
            samples_ms,
            flops,
            dense_flops,
            visible_pairs: pairs,
            tile: [shape.block_q, shape.block_k],
            tiles_total: tiles.total,
            tiles_visible: tiles.visible,
            executed_flops,
            executed_tflops,
        });
    }
    if let Some(path) = &a.json {
        let report = BenchReport {
            backend: a.backend.clone(),
            emulated: ringattn::kernels::is_emulated_gpu(&device),
            device,
            dtype: dtype.to_string().to_lowercase(),
            b,
            s,
            h_q: hq,
            h_kv: hkv,
            d,
            d_v,
            causal: a.causal,
            window: a.window.is_some().then(|| {
                let (l, r) = x.params.mask.bounds();
                [l.unwrap_or(-1), r.unwrap_or(-1)]
            }),
            seqlens: x.params.documents.as_ref().map(|d| d.lengths()),
            softcap: x.params.softcap,
            results,
        };
        ringattn::io::write_json(path, &report)?;
    }
    Ok(ExitCode::SUCCESS)
}

type Samples = Vec<(Pass, Vec<f64>)>;
type Fwd = fn(&Inputs) -> Result<cpu::ForwardOutput>;
type Bwd = fn(&Inputs, &cpu::ForwardOutput) -> Result<cpu::Gradients>;

fn cpu_forward(x: &Inputs) -> Result<cpu::ForwardOutput> {
    cpu::forward(&x.q, &x.k, &x.v, &x.params)
}

fn cpu_backward(x: &Inputs, f: &cpu::ForwardOutput) -> Result<cpu::Gradients> {
    cpu::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, &x.params)
}

/// Host-clock timing of whole calls (inputs on the host, as the cpu and emu backends take
/// them).
fn host_bench(a: &BenchArgs, x: &Inputs, passes: &[Pass], fwd: Fwd, bwd: Bwd) -> Result<Samples> {
    let (warmup, iters) = (a.warmup.unwrap_or(3), a.iters.unwrap_or(10));
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<Vec<f64>> {
        for _ in 0..warmup {
            f()?;
        }
        (0..iters)
            .map(|_| {
                let t = Instant::now();
                f()?;
                Ok(t.elapsed().as_secs_f64() * 1e3)
            })
            .collect()
    };
    let mut out = Vec::new();
    for &pass in passes {
        let samples = match pass {
            Pass::Forward => time(&mut || fwd(x).map(drop))?,
            Pass::Backward => {
                let f = fwd(x)?;
                time(&mut || bwd(x, &f).map(drop))?
            }
        };
        out.push((pass, samples));
    }
    Ok(out)
}

#[cfg(feature = "emu")]
fn emu_bench(a: &BenchArgs, x: &Inputs, passes: &[Pass]) -> Result<Samples> {
    fn opts(x: &Inputs) -> ringattn::emu::EmuOptions {
        ringattn::emu::EmuOptions { workers: 0, dq_mode: x.dq_mode, kernels: x.kernels, ..Default::default() }
    }
    // The forward rounds `o` to the input dtype in the kernel's epilogue (`o16`), as the cuda
    // bench's forward does.
    fn fwd(x: &Inputs) -> Result<cpu::ForwardOutput> {
        ringattn::emu::forward(&x.q, &x.k, &x.v, None, &x.params, &opts(x))
    }
    fn bwd(x: &Inputs, f: &cpu::ForwardOutput) -> Result<cpu::Gradients> {
        ringattn::emu::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, None, &x.params, &opts(x))
    }
    host_bench(a, x, passes, fwd, bwd)
}

#[cfg(not(feature = "emu"))]
fn emu_bench(_: &BenchArgs, _: &Inputs, _: &[Pass]) -> Result<Samples> {
    unreachable!("parse_backend refuses emu without the feature")
}

/// CUDA-event timing of launches on device-resident inputs: q, k, v, dO, the mask, the
/// outputs and the workspace are allocated once, before the timed region. The timed forward
/// writes `o` in the input dtype (the kernel's 16-bit epilogue, [`CudaDevice::forward16_into`])
/// and `lse` in f32, as PyTorch's SDPA does; the backward reads the f32 `o` of a forward run
/// once before its timed region.
#[cfg(feature = "cuda")]
fn cuda_bench(a: &BenchArgs, x: &Inputs, passes: &[Pass]) -> Result<(String, Samples)> {
    use ringattn::cuda::{
        to_bits, CudaDevice, Delta, DeviceGradients, FlashBackwardArgs, FlashForwardArgs, SavedContext,
    };
    let dims = x.dims;
    if x.dtype == DType::F32 {
        return Err(Error::BackendUnsupported {
            backend: "cuda",
            what: "f32 inputs (the kernels take bf16 or f16: --dtype bf16)".into(),
        });
    }
    ringattn::kernels::geometry::check_head_dims("cuda", &dims)?;
    let dev = CudaDevice::shared(a.device)?;
    let stream = dev.stream().clone();
    let upload = |t: &Tensor| dev.upload_bits(&to_bits(&t.to_f32_vec(), x.dtype));
    let (q, k, v, d_o) = (upload(&x.q)?, upload(&x.k)?, upload(&x.v)?, upload(&x.d_o)?);
    let mask = dev.mask(&dims, None, &x.params)?;
    let args = FlashForwardArgs {
        dims,
        dtype: x.dtype,
        q: &q,
        k: &k,
        v: &v,
        mask: &mask,
        spec: ringattn::attention::ScoreSpec::of(&x.params, &dims),
        kernels: x.kernels,
    };
    let (warmup, iters) = (a.warmup.unwrap_or(3), a.iters.unwrap_or(10));
    let mut out = Vec::new();
    for &pass in passes {
        let samples = match pass {
            Pass::Forward => {
                let mut o16 = dev.alloc_bits(dims.b * dims.s_q * dims.h_q * dims.d_v)?;
                let mut lse = dev.alloc_f32(dims.b * dims.h_q * dims.s_q)?;
                dev.time_iterations(&stream, warmup, iters, || dev.forward16_into(&stream, &args, &mut o16, &mut lse))?
            }
            Pass::Backward => {
                let mut saved = SavedContext::alloc(&stream, &dims)?;
                dev.forward_into(&stream, &args, &mut saved)?;
                let bargs = FlashBackwardArgs { forward: args, saved: &saved, d_o: &d_o, dq_mode: x.dq_mode };
                let mut delta = dev.alloc_f32(dims.b * dims.h_q * dims.s_q)?;
                let mut grads = DeviceGradients::alloc(&stream, &dims)?;
                dev.time_iterations(&stream, warmup, iters, || {
                    dev.backward_into(&stream, &bargs, Delta::Compute(&mut delta), &mut grads)
                })?
            }
        };
        out.push((pass, samples));
    }
    Ok((dev.name().to_string(), out))
}

#[cfg(not(feature = "cuda"))]
fn cuda_bench(_: &BenchArgs, _: &Inputs, _: &[Pass]) -> Result<(String, Samples)> {
    unreachable!("parse_backend refuses cuda without the feature")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        b: BenchArgs,
    }

    fn inputs(args: &[&str]) -> Inputs {
        let cli = Cli::parse_from(std::iter::once("x").chain(args.iter().copied()));
        let a = &cli.b;
        let params = a.params().unwrap();
        let s: usize = a.seq.as_deref().unwrap_or("64").parse().unwrap();
        let t = |h| randn(vec![1, s, h, a.head_dim], 0, DType::BF16);
        let (q, k) = (t(a.heads), t(a.kv_heads.unwrap_or(a.heads)));
        let dims = Dims::of(&q, &k, &k).unwrap();
        let dq_mode = parse_dq_mode(&a.dq_mode).unwrap();
        Inputs {
            dims,
            dtype: DType::BF16,
            params,
            dq_mode,
            kernels: KernelFamily::Auto,
            q: q.clone(),
            k: k.clone(),
            v: k,
            d_o: q,
        }
    }

    /// The figures a bench reports: visible-pair FLOPs against the dense count, tiles of the
    /// backend's tiling, per pass.
    #[test]
    fn work_counts_the_visible_pairs_and_the_tiles_of_each_tiling() {
        let x = inputs(&["--seq", "512", "--heads", "2", "--head-dim", "64", "--causal"]);
        let pairs = flops::visible_pairs(&x.dims, &x.params).unwrap();
        assert_eq!(pairs, 512 * 513 / 2);
        // f32 inputs: the f32 forward's 128 × 256 tiles on every processor.
        let x32 =
            Inputs { dtype: DType::F32, ..inputs(&["--seq", "512", "--heads", "2", "--head-dim", "64", "--causal"]) };
        let (f, dense, shape, tiles, executed) = work(BackendKind::Cpu, &x32, Pass::Forward, pairs).unwrap();
        assert_eq!((f, dense), (4.0 * 64.0 * 2.0 * pairs as f64, 4.0 * 64.0 * 2.0 * 512.0 * 512.0));
        assert_eq!((shape.block_q, shape.block_k, tiles.total, tiles.visible), (128, 256, 8, 6));
        // Counted as if the CPU computed its 6 visible 128 x 256 tiles whole (an upper bound:
        // the partial ones run per row block over its reach).
        assert_eq!(executed, 2.0 * 6.0 * 2.0 * 128.0 * 256.0 * 64.0 * 2.0);
        // The backward's 256 × 256 tiles.
        let (_, _, shape, tiles, _) = work(BackendKind::Cpu, &x32, Pass::Backward, pairs).unwrap();
        assert_eq!((shape.block_q, shape.block_k, tiles.total, tiles.visible), (256, 256, 4, 3));
        let (fb, _, shape, tiles, executed) = work(BackendKind::Cuda, &x, Pass::Backward, pairs).unwrap();
        assert_eq!(fb, 2.5 * f);
        // d = 64: the dk/dv kernel's 64 query rows × 64 keys.
        assert_eq!((shape.block_q, shape.block_k, tiles.total, tiles.visible), (64, 64, 64, 36));
        // d = 64, deterministic: five products (the dk/dv kernel adds dq in fixed point) over
        // whole warp tiles — more than the convention's 5 over the pairs on the diagonal.
        assert!(executed > fb && executed < 7.0 / 5.0 * fb, "{executed} against {fb}");
        // d = 128, deterministic: five products as well (the dk/dv kernel, unsplit, adds dq).
        let x128 = inputs(&["--seq", "512", "--heads", "2", "--head-dim", "128", "--causal"]);
        let (fb, _, _, _, executed) = work(BackendKind::Cuda, &x128, Pass::Backward, pairs).unwrap();
        assert!(executed > fb && executed < 7.0 / 5.0 * fb, "{executed} against {fb}");
        // d = 256, deterministic: the dq kernel beside the dk/dv kernel, 7 products.
        let x256 = inputs(&["--seq", "512", "--heads", "2", "--head-dim", "256", "--causal"]);
        let (fb, _, _, _, executed) = work(BackendKind::Cuda, &x256, Pass::Backward, pairs).unwrap();
        assert!(executed > 7.0 / 5.0 * fb, "{executed} against {fb}");
        let x = inputs(&["--seq", "512", "--dq-mode", "atomic", "--head-dim", "128"]);
        let (_, _, shape, _, _) = work(BackendKind::Emu, &x, Pass::Backward, 0).unwrap();
        assert_eq!((shape.block_q, shape.block_k), (32, 64));
        // The d128 forward: 4 warps of 32 query rows × 64 keys.
        let (_, _, shape, _, _) = work(BackendKind::Emu, &x, Pass::Forward, 0).unwrap();
        assert_eq!((shape.block_q, shape.block_k), (128, 64));
    }

    #[test]
    fn masks_are_described_and_parsed_as_verify_parses_them() {
        let x = inputs(&["--seq", "100", "--window", "8,-1", "--causal", "--seqlens", "30,70"]);
        assert_eq!(x.params.mask, Mask::Window { left: Some(8), right: Some(0) });
        assert_eq!(describe_mask(&x.params), "window 8,0, 2 documents");
        assert_eq!(describe_mask(&inputs(&["--window", "-1,3"]).params), "window -1,3");
        assert_eq!(describe_mask(&inputs(&["--causal"]).params), "causal");
        assert_eq!(describe_mask(&inputs(&[]).params), "full");
        assert_eq!(describe_mask(&inputs(&["--causal", "--softcap", "30"]).params), "causal, softcap 30");
        // Documents: 30 and 70 tokens, each seeing its own last 9 keys at most.
        let want: u64 = [30u64, 70].iter().map(|&n| (0..n).map(|i| (i + 1).min(9)).sum::<u64>()).sum();
        assert_eq!(flops::visible_pairs(&x.dims, &x.params).unwrap(), want);
        assert!(parse_dq_mode("sometimes").unwrap_err().to_string().contains("--dq-mode `sometimes`"));
    }
}
