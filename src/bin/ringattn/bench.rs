//! `ringattn bench`: timing of the single-device kernels of a backend, or (with
//! `--strategies`, `--world`, several `--seq` or `--out`) a sweep over strategies, world
//! sizes and sequence lengths ([`crate::sweep`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ringattn::{cpu, random::randn, AttentionParams, DType, Dims, Error, Mask, Result, Tensor};
use serde::Serialize;

use crate::args::{parse_backend, BackendKind};

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
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Dtype: bf16, f16 or f32 (f32: cpu only; the kernels take 16-bit inputs) [default:
    /// bf16; f32 for cpu sweeps].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Causal mask (FLOPs halved).
    #[arg(long)]
    pub causal: bool,
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
    /// Sweep: strategies to run with more than one rank, comma-separated (ring, allgather,
    /// ulysses, usp; single is the one-rank baseline) [default: all four].
    #[arg(long, value_name = "LIST")]
    pub strategies: Option<String>,
    /// Sweep: world sizes, comma-separated (1 = the single-device baseline) [default: 1,2,4].
    #[arg(long, value_name = "LIST")]
    pub world: Option<String>,
    /// Sweep: token layout over ranks, contiguous, zigzag or striped [default: zigzag when
    /// causal, contiguous otherwise].
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
    /// How the cuda backward computes dq: deterministic (its own kernel) or atomic (added by
    /// the dk/dv kernel with f32 atomics).
    #[arg(long, default_value = "deterministic")]
    pub dq_mode: String,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the results as JSON to this file (atomically).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// The timings of one pass.
#[derive(Serialize, Debug)]
struct PassResult {
    pass: &'static str,
    median_ms: f64,
    min_ms: f64,
    tflops: f64,
    samples_ms: Vec<f64>,
}

/// The JSON report: the interface of the device-check scripts, keep it stable.
#[derive(Serialize, Debug)]
struct BenchReport {
    backend: String,
    device: String,
    dtype: String,
    b: usize,
    s: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    causal: bool,
    results: Vec<PassResult>,
}

/// The inputs of a run.
struct Inputs {
    dims: Dims,
    dtype: DType,
    params: AttentionParams,
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

pub fn bench(a: &BenchArgs) -> Result<ExitCode> {
    let seqs = crate::args::parse_list(a.seq.as_deref().unwrap_or("4096"), "--seq")?;
    if seqs.len() != 1 || a.strategies.is_some() || a.world.is_some() || a.out.is_some() {
        return crate::sweep::sweep(a);
    }
    let backend = parse_backend(&a.backend)?;
    let passes = passes(&a.pass)?;
    let dtype: DType = a.dtype.as_deref().unwrap_or("bf16").parse()?;
    let (warmup, iters) = (a.warmup.unwrap_or(3), a.iters.unwrap_or(10));
    let (b, s, hq, d) = (a.batch, seqs[0], a.heads, a.head_dim);
    let hkv = a.kv_heads.unwrap_or(hq);
    if s == 0 || b == 0 {
        return Err(Error::InvalidArgument("--seq and --batch must be at least 1".into()));
    }
    if iters == 0 {
        return Err(Error::InvalidArgument("--iters must be at least 1".into()));
    }
    let seed = a.seed.wrapping_mul(4);
    let q = randn(vec![b, s, hq, d], seed, dtype);
    let k = randn(vec![b, s, hkv, d], seed + 1, dtype);
    let v = randn(vec![b, s, hkv, d], seed + 2, dtype);
    let d_o = randn(vec![b, s, hq, d], seed + 3, dtype);
    let dims = Dims::of(&q, &k, &v)?;
    let params = AttentionParams { mask: if a.causal { Mask::Causal } else { Mask::None }, ..Default::default() };
    let x = Inputs { dims, dtype, params, q, k, v, d_o };
    let (device, samples) = match backend {
        BackendKind::Cpu => ("cpu".to_string(), host_bench(a, &x, &passes, cpu_forward, cpu_backward)?),
        BackendKind::Emu => ("cpu".to_string(), emu_bench(a, &x, &passes)?),
        BackendKind::Cuda => cuda_bench(a, &x, &passes)?,
    };
    let Dims { b, s_q: s, h_q: hq, h_kv: hkv, d, .. } = x.dims;
    let dtype = x.dtype;
    let flops_fwd = 4.0 * (b * hq) as f64 * (s as f64) * (s as f64) * d as f64 / if a.causal { 2.0 } else { 1.0 };
    println!(
        "ringattn bench: {} ({device}) b={b} s={s} h_q={hq} h_kv={hkv} d={d} {dtype} {}, {} warmup + {} timed iterations",
        a.backend,
        if a.causal { "causal" } else { "full" },
        warmup,
        iters
    );
    let mut results = Vec::new();
    for (pass, samples_ms) in samples {
        let flops = if pass == Pass::Forward { flops_fwd } else { 2.5 * flops_fwd };
        let median_ms = median(&samples_ms);
        let min_ms = samples_ms.iter().copied().fold(f64::INFINITY, f64::min);
        let tflops = flops / (median_ms * 1e-3) / 1e12;
        println!("{:<8}: median {median_ms:10.3} ms  min {min_ms:10.3} ms  {tflops:9.3} TFLOP/s", pass.name());
        results.push(PassResult { pass: pass.name(), median_ms, min_ms, tflops, samples_ms });
    }
    if let Some(path) = &a.json {
        let report = BenchReport {
            backend: a.backend.clone(),
            device,
            dtype: dtype.to_string().to_lowercase(),
            b,
            s,
            h_q: hq,
            h_kv: hkv,
            d,
            causal: a.causal,
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
    fn opts() -> ringattn::emu::EmuOptions {
        ringattn::emu::EmuOptions { workers: 0, ..Default::default() }
    }
    fn fwd(x: &Inputs) -> Result<cpu::ForwardOutput> {
        ringattn::emu::forward(&x.q, &x.k, &x.v, None, &x.params, &opts())
    }
    fn bwd(x: &Inputs, f: &cpu::ForwardOutput) -> Result<cpu::Gradients> {
        ringattn::emu::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, None, &x.params, &opts())
    }
    host_bench(a, x, passes, fwd, bwd)
}

#[cfg(not(feature = "emu"))]
fn emu_bench(_: &BenchArgs, _: &Inputs, _: &[Pass]) -> Result<Samples> {
    unreachable!("parse_backend refuses emu without the feature")
}

/// CUDA-event timing of launches on device-resident inputs: q, k, v, dO, the mask, the
/// outputs and the workspace are allocated once, before the timed region.
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
    ringattn::kernels::geometry::check_head_dim("cuda", dims.d)?;
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
        scale: x.params.softmax_scale(dims.d),
    };
    let mut saved = SavedContext::alloc(&stream, &dims)?;
    let mut out = Vec::new();
    for &pass in passes {
        let samples = match pass {
            Pass::Forward => dev.time_iterations(&stream, a.warmup.unwrap_or(3), a.iters.unwrap_or(10), || {
                dev.forward_into(&stream, &args, &mut saved)
            })?,
            Pass::Backward => {
                dev.forward_into(&stream, &args, &mut saved)?;
                let dq_mode = match a.dq_mode.as_str() {
                    "deterministic" => ringattn::kernels::geometry::DqMode::Deterministic,
                    "atomic" => ringattn::kernels::geometry::DqMode::Atomic,
                    other => {
                        return Err(Error::InvalidArgument(format!(
                            "--dq-mode `{other}`: expected deterministic or atomic"
                        )))
                    }
                };
                let bargs = FlashBackwardArgs { forward: args, saved: &saved, d_o: &d_o, dq_mode };
                let mut delta = dev.alloc_f32(dims.b * dims.h_q * dims.s_q)?;
                let mut grads = DeviceGradients::alloc(&stream, &dims)?;
                dev.time_iterations(&stream, a.warmup.unwrap_or(3), a.iters.unwrap_or(10), || {
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
