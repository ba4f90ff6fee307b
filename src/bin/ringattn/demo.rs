//! `ringattn demo`: the main job on the default backend, measured and spot-checked.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ringattn::parallel;
use ringattn::{cpu, memory, random, verify, AttentionParams, DType, Error, Mask, Result, Tensor};
use serde::Serialize;

use crate::args::{backward_single, forward_single, run_parallel, BackendKind, ExecArgs};
use crate::progress::with_progress;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Sequence length [default: 32768; 512 with --backend emu, whose emulated kernels are
    /// a few hundred times slower than the cpu backend].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
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
    /// Dtype: f32, bf16 or f16 [default: f32 on cpu; bf16 on emu and cuda, whose kernels
    /// take 16-bit inputs].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Full (bidirectional) attention instead of causal.
    #[arg(long)]
    pub no_causal: bool,
    /// Skip the backward pass.
    #[arg(long)]
    pub forward_only: bool,
    /// Query rows to check against the float64 oracle.
    #[arg(long, default_value_t = 16)]
    pub check_rows: usize,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub exec: ExecArgs,
}

#[derive(Serialize)]
struct Phase {
    seconds: f64,
    tflops: f64,
    /// Peak bytes allocated during the phase beyond what was live before it.
    peak_extra_bytes: usize,
    /// Of which the phase's outputs.
    output_bytes: usize,
}

#[derive(Serialize)]
struct DemoReport {
    /// `[b, s, h_q, h_kv, d_qk]`.
    shape: [usize; 5],
    /// v's head dim (`d_qk` but in multi-head latent attention).
    d_v: usize,
    dtype: String,
    causal: bool,
    threads: usize,
    forward: Phase,
    backward: Option<Phase>,
    process_peak_rss_bytes: Option<u64>,
    checked_rows: Vec<usize>,
    check: verify::Report,
    /// Per-rank statistics of a parallel run (forward, backward).
    ranks: Vec<(parallel::Stats, Option<parallel::Stats>)>,
}

/// The query rows the demo checks against the oracle: the first, the last and a seeded sample.
fn check_rows(s: usize, a: &DemoArgs) -> Vec<usize> {
    let mut rows = random::sample_indices(s, a.check_rows.saturating_sub(2), a.seed ^ 0x5eed);
    rows.extend([0, s - 1]);
    rows.sort_unstable();
    rows.dedup();
    rows
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

pub fn demo(a: &DemoArgs) -> Result<ExitCode> {
    let backend = a.exec.backend()?;
    let on_cpu = backend == BackendKind::Cpu;
    let dtype: DType = a.dtype.as_deref().unwrap_or(if on_cpu { "f32" } else { "bf16" }).parse()?;
    let s = a.seq.unwrap_or(if backend == BackendKind::Emu { 512 } else { 32768 });
    let (b, hq, d) = (a.batch, a.heads, a.head_dim);
    let (hkv, d_v) = (a.kv_heads.unwrap_or(hq), a.head_dim_v.unwrap_or(d));
    if s == 0 || b == 0 {
        return Err(Error::InvalidArgument("--seq and --batch must be at least 1".into()));
    }
    let causal = !a.no_causal;
    let params = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
    println!(
        "ringattn demo: {} backend, {} threads; b={b} s={s} h_q={hq} h_kv={hkv} d_qk={d} d_v={d_v} {dtype} {}",
        a.exec.backend,
        rayon::current_num_threads(),
        if causal { "causal" } else { "full" }
    );
    let q = random::randn(vec![b, s, hq, d], a.seed * 4, dtype);
    let k = random::randn(vec![b, s, hkv, d], a.seed * 4 + 1, dtype);
    let v = random::randn(vec![b, s, hkv, d_v], a.seed * 4 + 2, dtype);
    let d_o = random::randn(vec![b, s, hq, d_v], a.seed * 4 + 3, dtype);
    let dims = ringattn::Dims::of(&q, &k, &v)?;
    // Forward FLOPs of the visible pairs (s(s+1)/2 when causal); the backward is
    // flops::backward_ratio × that (2.5 with equal head dims).
    let flops = ringattn::flops::flops(&dims, ringattn::flops::visible_pairs(&dims, &params)?, Default::default());

    let (forward, backward, fwd, grads, ranks) = if !a.exec.is_single() {
        let mut pp = a.exec.parallel(params.clone())?;
        pp.seq_len = s;
        println!("strategy {} (in-process ranks)", a.exec.describe(&pp, &dims, dtype)?);
        let base = memory::current_bytes();
        memory::reset_peak();
        let t = Instant::now();
        let d_o_opt = (!a.forward_only).then_some(&d_o);
        let run = run_parallel(&a.exec, &q, &k, &v, d_o_opt, &pp)?;
        let secs = t.elapsed().as_secs_f64();
        let work = flops * if a.forward_only { 1.0 } else { 1.0 + ringattn::flops::backward_ratio(&dims) };
        println!(
            "forward{}: {secs:8.3} s  {:7.3} TFLOP/s (whole run)",
            if a.forward_only { "" } else { " + backward" },
            work / secs / 1e12
        );
        println!(
            "{:>4} {:>5} {:>7} {:>10} {:>10} {:>12}",
            "rank", "pass", "blocks", "compute s", "waiting s", "sent MiB"
        );
        for (r, (f, b)) in run.stats.iter().enumerate() {
            for (name, st) in [("fwd", Some(f)), ("bwd", b.as_ref())] {
                if let Some(st) = st {
                    println!(
                        "{r:>4} {name:>5} {:>7} {:>10.3} {:>10.3} {:>12.1}",
                        st.blocks,
                        st.compute.as_secs_f64(),
                        st.waiting.as_secs_f64(),
                        mib(st.bytes_sent as usize)
                    );
                }
            }
        }
        // One phase for the whole run (forward and, unless --forward-only, backward), memory
        // measured across all ranks together.
        let out = &run.forward;
        let grad_bytes = run.gradients.as_ref().map_or(0, |g| g.dq.len() + g.dk.len() + g.dv.len());
        let phase = Phase {
            seconds: secs,
            tflops: work / secs / 1e12,
            peak_extra_bytes: memory::peak_bytes().saturating_sub(base),
            output_bytes: (out.o.len() + grad_bytes) * dtype.size_of() + out.lse.len() * 4,
        };
        (phase, None, run.forward, run.gradients, run.stats)
    } else if on_cpu {
        single(a, &q, &k, &v, &d_o, &params, flops)?
    } else {
        single_kernels(a, &q, &k, &v, &d_o, &params, flops)?
    };
    let rows = check_rows(s, a);
    let check = verify::check_rows(&q, &k, &v, grads.as_ref().map(|_| &d_o), &params, &fwd, grads.as_ref(), &rows)?;
    println!("check of {} sampled query rows against the float64 oracle:", rows.len());
    print!("{}", check.table());
    let pass = check.pass();
    let report = DemoReport {
        shape: [b, s, hq, hkv, d],
        d_v,
        dtype: dtype.to_string(),
        causal,
        threads: rayon::current_num_threads(),
        forward,
        backward,
        process_peak_rss_bytes: memory::os_peak_rss(),
        checked_rows: rows,
        check,
        ranks,
    };
    if let Some(path) = &a.json {
        ringattn::io::write_json(path, &report)?;
    }
    if pass {
        println!("demo passed");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("demo FAILED: sampled rows disagree with the oracle");
        Ok(ExitCode::from(3))
    }
}

/// The single-device forward (and backward) with progress bars and memory accounting.
fn single(
    a: &DemoArgs,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    params: &AttentionParams,
    flops: f64,
) -> Result<Outcome> {
    let [b, s, hq, _] = q.shape().try_into().map_err(|_| Error::InvalidArgument("q must be 4-D".into()))?;
    let hkv = k.shape()[2];
    let dtype = q.dtype();
    let base = memory::current_bytes();
    memory::reset_peak();
    let t = Instant::now();
    let fwd = with_progress("forward", (b * hq * s) as u64, |p| {
        cpu::forward_with(q, k, v, None, params, &a.exec.cpu_config(Some(p))?)
    })?;
    let secs = t.elapsed().as_secs_f64();
    let out_bytes = fwd.o.len() * dtype.size_of() + fwd.lse.len() * 4;
    let forward = Phase {
        seconds: secs,
        tflops: flops / secs / 1e12,
        peak_extra_bytes: memory::peak_bytes().saturating_sub(base),
        output_bytes: out_bytes,
    };
    println!(
        "forward : {:8.3} s  {:7.3} TFLOP/s  peak memory beyond inputs {:8.1} MiB (outputs {:.1} MiB)",
        forward.seconds,
        forward.tflops,
        mib(forward.peak_extra_bytes),
        mib(forward.output_bytes)
    );

    let mut backward = None;
    let mut grads = None;
    if !a.forward_only {
        let base = memory::current_bytes();
        memory::reset_peak();
        let t = Instant::now();
        let g = with_progress("backward", (b * hkv * s) as u64, |p| {
            let cfg = a.exec.cpu_config(Some(p))?;
            cpu::backward_with(q, k, v, &fwd.o, &fwd.lse, d_o, None, params, &cfg)
        })?;
        let secs = t.elapsed().as_secs_f64();
        let phase = Phase {
            seconds: secs,
            tflops: ringattn::flops::backward_ratio(&ringattn::Dims::of(q, k, v)?) * flops / secs / 1e12,
            peak_extra_bytes: memory::peak_bytes().saturating_sub(base),
            output_bytes: (g.dq.len() + g.dk.len() + g.dv.len()) * dtype.size_of(),
        };
        println!(
            "backward: {:8.3} s  {:7.3} TFLOP/s  peak memory beyond inputs {:8.1} MiB (outputs {:.1} MiB)",
            phase.seconds,
            phase.tflops,
            mib(phase.peak_extra_bytes),
            mib(phase.output_bytes)
        );
        backward = Some(phase);
        grads = Some(g);
    }

    Ok((forward, backward, fwd, grads, Vec::new()))
}

/// The single-device forward (and backward) on the emulated or GPU kernels, timed as whole
/// calls (host copies included; `ringattn bench` times the kernels alone).
fn single_kernels(
    a: &DemoArgs,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    params: &AttentionParams,
    flops: f64,
) -> Result<Outcome> {
    let bytes = |ts: &[&Tensor]| ts.iter().map(|t| t.len() * t.dtype().size_of()).sum::<usize>();
    let t = Instant::now();
    let fwd = forward_single(&a.exec, params, q, k, v)?;
    let secs = t.elapsed().as_secs_f64();
    let forward = Phase {
        seconds: secs,
        tflops: flops / secs / 1e12,
        peak_extra_bytes: 0,
        output_bytes: bytes(&[&fwd.o, &fwd.lse]),
    };
    println!("forward : {:8.3} s  {:7.3} TFLOP/s (whole call, host copies included)", forward.seconds, forward.tflops);
    if a.forward_only {
        return Ok((forward, None, fwd, None, Vec::new()));
    }
    let t = Instant::now();
    let g = backward_single(&a.exec, params, q, k, v, &fwd, d_o)?;
    let secs = t.elapsed().as_secs_f64();
    let backward = Phase {
        seconds: secs,
        tflops: ringattn::flops::backward_ratio(&ringattn::Dims::of(q, k, v)?) * flops / secs / 1e12,
        peak_extra_bytes: 0,
        output_bytes: bytes(&[&g.dq, &g.dk, &g.dv]),
    };
    println!(
        "backward: {:8.3} s  {:7.3} TFLOP/s (whole call, host copies included)",
        backward.seconds, backward.tflops
    );
    Ok((forward, Some(backward), fwd, Some(g), Vec::new()))
}

/// Forward phase, backward phase, outputs, gradients, per-rank statistics.
type Outcome =
    (Phase, Option<Phase>, cpu::ForwardOutput, Option<cpu::Gradients>, Vec<(parallel::Stats, Option<parallel::Stats>)>);
