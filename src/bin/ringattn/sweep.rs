//! `ringattn bench` sweeps: sequence lengths × strategies × world sizes on one backend, with
//! time, TFLOP/s per rank, communication hidden %, bytes sent and peak memory per rank; a
//! table, JSON, CSV and plots (PNG and SVG) in the output folder.
//!
//! In-process ranks (cpu, emu) exchange through a link model (`--link-gbps`,
//! `--link-latency-us`); the hidden share follows the definition of
//! [`ringattn::parallel::measure_overlap`]: `1 − (run − compute_only) / comm_only`, from the
//! run itself, the run with instant communication and the run with compute skipped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use ringattn::comm::{LinkModel, LocalOptions};
use ringattn::parallel::{run_in_process, Backend, CpuBackend, NullBackend, ParallelParams, Strategy};
use ringattn::{memory, random::randn, AttentionParams, DType, Error, HostBuf, Mask, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::args::{parse_backend, parse_list, BackendKind};
use crate::bench::{median, BenchArgs};

/// One measured configuration. Times are the slowest rank's, in seconds; per-rank figures
/// are means over ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepRecord {
    /// The strategy's name (`Strategy::name`).
    pub strategy: String,
    /// Ranks.
    pub world: usize,
    /// Global sequence length.
    pub seq: usize,
    /// Tokens per rank (`seq / world`, rounded down).
    pub tokens_per_rank: usize,
    /// Passes timed: `forward` or `forward+backward`.
    pub passes: String,
    /// Median over the timed iterations of the slowest rank's time.
    pub seconds: f64,
    /// Every timed iteration.
    pub samples_s: Vec<f64>,
    /// Attention FLOPs of the visible pairs ([`ringattn::flops`]: forward 4·d·b·h_q per
    /// visible pair, s(s+1)/2 of them when causal; backward 2.5×) per rank per second.
    pub tflops_per_rank: f64,
    /// Share of the communication hidden behind compute (`null` on one rank or without a
    /// link model).
    pub hidden: Option<f64>,
    /// Median time with instant communication.
    pub compute_only_s: Option<f64>,
    /// Median time with compute skipped.
    pub comm_only_s: Option<f64>,
    /// Bytes each rank sent (mean over ranks).
    pub bytes_per_rank: f64,
    /// Peak heap bytes beyond the inputs during the run, divided by the ranks (in-process
    /// ranks share one heap); `null` on cuda, whose buffers live in device memory.
    pub peak_bytes_per_rank: Option<f64>,
}

/// The link model of in-process ranks in a report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// Bandwidth, GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// One-way latency, microseconds.
    pub latency_us: f64,
}

/// What `bench --out DIR` writes to `DIR/bench.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    /// Backend name.
    pub backend: String,
    /// Device description.
    pub device: String,
    /// Compute threads of the process.
    pub threads: usize,
    /// Batch, heads, kv heads, head dim.
    pub b: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Head dimension.
    pub d: usize,
    /// Input dtype.
    pub dtype: String,
    /// Causal mask.
    pub causal: bool,
    /// The tanh soft-cap of the scores, if any.
    #[serde(default)]
    pub softcap: Option<f32>,
    /// Link model of the in-process ranks.
    pub link: Option<LinkSpec>,
    /// One entry per configuration.
    pub records: Vec<SweepRecord>,
}

/// The configurations of a sweep: (strategy, world, seq), single-rank runs once per seq.
fn configurations(a: &BenchArgs) -> Result<Vec<(Strategy, usize, usize)>> {
    let seqs = parse_list(a.seq.as_deref().unwrap_or("1024,2048,4096"), "--seq")?;
    let worlds = parse_list(a.world.as_deref().unwrap_or("1,2,4"), "--world")?;
    let strategies: Vec<Strategy> = a
        .strategies
        .as_deref()
        .unwrap_or("ring,allgather,ulysses,usp")
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_>>()?;
    if seqs.is_empty() || seqs.contains(&0) || worlds.contains(&0) {
        return Err(Error::InvalidArgument("--seq and --world values must be at least 1".into()));
    }
    if strategies.contains(&Strategy::Auto) {
        return Err(Error::InvalidArgument(
            "--strategies auto: auto chooses per batch of packed documents, which a sweep over lengths has none of; \
             bench it with --docs (auto beside the fixed strategies)"
                .into(),
        ));
    }
    let mut out = Vec::new();
    for &s in &seqs {
        if worlds.contains(&1) || strategies.contains(&Strategy::Single) {
            out.push((Strategy::Single, 1, s));
        }
        for &w in worlds.iter().filter(|&&w| w > 1) {
            for &st in strategies.iter().filter(|&&st| st != Strategy::Single) {
                out.push((st, w, s));
            }
        }
    }
    Ok(out)
}

/// Inputs of one sequence length.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

fn inputs(a: &BenchArgs, s: usize, dtype: DType) -> Inputs {
    let (b, hq, d) = (a.batch, a.heads, a.head_dim);
    let hkv = a.kv_heads.unwrap_or(hq);
    let seed = a.seed.wrapping_mul(4);
    Inputs {
        q: randn(vec![b, s, hq, d], seed, dtype),
        k: randn(vec![b, s, hkv, d], seed + 1, dtype),
        v: randn(vec![b, s, hkv, d], seed + 2, dtype),
        d_o: randn(vec![b, s, hq, d], seed + 3, dtype),
    }
}

/// Attention FLOPs of one run at length `s` under `params` ([`ringattn::flops`]): the
/// forward's `4·d·b·h_q` per visible pair; the backward adds 2.5× that.
fn job_flops(a: &BenchArgs, params: &AttentionParams, s: usize, backward: bool) -> Result<f64> {
    use ringattn::flops::{flops, visible_pairs, Pass};
    let h_kv = a.kv_heads.unwrap_or(a.heads);
    let dims = ringattn::Dims { b: a.batch, s_q: s, s_k: s, h_q: a.heads, h_kv, d_qk: a.head_dim, d_v: a.head_dim };
    let pairs = visible_pairs(&dims, params)?;
    Ok(flops(&dims, pairs, Pass::Forward) + if backward { flops(&dims, pairs, Pass::Backward) } else { 0.0 })
}

/// Runs `f` `warmup` times, then `iters` times, returning the timed results.
fn repeat<T>(warmup: usize, iters: usize, mut f: impl FnMut() -> Result<T>) -> Result<Vec<T>> {
    for _ in 0..warmup {
        f()?;
    }
    (0..iters).map(|_| f()).collect()
}

/// One timed parallel run: slowest rank's seconds, mean bytes sent per rank.
fn parallel_once<Be: Backend<Buf = HostBuf>>(
    world: usize,
    options: LocalOptions,
    be: &Be,
    x: &Inputs,
    backward: bool,
    params: &ParallelParams,
) -> Result<(f64, f64)> {
    let d_o = backward.then_some(&x.d_o);
    let r = run_in_process(world, options, be, &x.q, &x.k, &x.v, d_o, params)?;
    let secs = r
        .stats
        .iter()
        .map(|(f, b)| f.total.as_secs_f64() + b.as_ref().map_or(0.0, |b| b.total.as_secs_f64()))
        .fold(0.0, f64::max);
    let bytes = r.stats.iter().map(|(f, b)| f.bytes_sent + b.as_ref().map_or(0, |b| b.bytes_sent)).sum::<u64>();
    Ok((secs, bytes as f64 / world as f64))
}

/// Times one configuration on a host-buffer backend.
#[allow(clippy::too_many_arguments)]
fn measure<Be: Backend<Buf = HostBuf>>(
    a: &BenchArgs,
    be: &Be,
    x: &Inputs,
    strategy: Strategy,
    world: usize,
    link: Option<LinkModel>,
    params: &AttentionParams,
    backward: bool,
) -> Result<SweepRecord> {
    let (warmup, iters) = (a.warmup.unwrap_or(1), a.iters.unwrap_or(3).max(1));
    let s = x.q.shape()[1];
    let base = memory::current_bytes();
    memory::reset_peak();
    let (samples, bytes, compute_only, comm_only) = if strategy == Strategy::Single {
        let samples = repeat(warmup, iters, || -> Result<f64> {
            let t = Instant::now();
            let fwd = be_single_forward(be, x, params)?;
            if backward {
                be_single_backward(be, x, &fwd, params)?;
            }
            Ok(t.elapsed().as_secs_f64())
        })?;
        (samples, 0.0, None, None)
    } else {
        let layout = a.layout.as_deref().map(str::parse).transpose()?;
        let pp = ParallelParams { strategy, layout, attention: params.clone(), seq_len: s, ..Default::default() };
        let options = LocalOptions { deadline: Duration::from_secs(3600), link, ..Default::default() };
        let runs = repeat(warmup, iters, || parallel_once(world, options, be, x, backward, &pp))?;
        let samples: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let bytes = runs.first().map_or(0.0, |r| r.1);
        match link {
            Some(_) => {
                let instant = LocalOptions { link: None, ..options };
                let c = repeat(0, iters, || parallel_once(world, instant, be, x, backward, &pp).map(|r| r.0))?;
                let n =
                    repeat(0, iters, || parallel_once(world, options, &NullBackend, x, backward, &pp).map(|r| r.0))?;
                (samples, bytes, Some(median(&c)), Some(median(&n)))
            }
            None => (samples, bytes, None, None),
        }
    };
    let peak = memory::peak_bytes().saturating_sub(base) as f64 / world as f64;
    let seconds = median(&samples);
    let flops = job_flops(a, params, s, backward)?;
    let hidden = match (compute_only, comm_only) {
        (Some(c), Some(n)) if n > 0.0 => Some(ringattn::parallel::hidden_share(seconds, c, n)),
        _ => None,
    };
    Ok(SweepRecord {
        strategy: strategy.to_string(),
        world,
        seq: s,
        tokens_per_rank: s / world,
        passes: if backward { "forward+backward".into() } else { "forward".into() },
        seconds,
        samples_s: samples,
        tflops_per_rank: flops / world as f64 / seconds / 1e12,
        hidden,
        compute_only_s: compute_only,
        comm_only_s: comm_only,
        bytes_per_rank: bytes,
        peak_bytes_per_rank: Some(peak),
    })
}

/// Times one configuration on the GPU: ranks as threads sharing it, buffers resident, sends
/// as device copies; hidden share from the runs with instant communication and without
/// attention kernels ([`ringattn::cuda::measure_device_overlap`]). One rank runs the same
/// code (its ring has one hop and no communication).
#[cfg(feature = "cuda")]
fn measure_device(
    a: &BenchArgs,
    x: &Inputs,
    strategy: Strategy,
    world: usize,
    params: &AttentionParams,
    backward: bool,
) -> Result<SweepRecord> {
    use ringattn::cuda::{measure_device_overlap, DeviceRunOptions};
    let s = x.q.shape()[1];
    let strategy = if strategy == Strategy::Single { Strategy::Ring } else { strategy };
    let layout = a.layout.as_deref().map(str::parse).transpose()?;
    let pp = ParallelParams { strategy, layout, attention: params.clone(), seq_len: s, ..Default::default() };
    let options = LocalOptions { deadline: Duration::from_secs(600), ..Default::default() };
    let run = DeviceRunOptions {
        device: a.device,
        kernels: crate::args::kernel_family(&a.kernels, crate::args::BackendKind::Cuda)?,
        dq_mode: crate::bench::parse_dq_mode(&a.dq_mode)?,
        ..Default::default()
    };
    let iters = a.iters.unwrap_or(3).max(1);
    let mut samples = Vec::with_capacity(iters);
    let (mut comp, mut comm, mut bytes) = (Vec::new(), Vec::new(), 0.0);
    for _ in 0..iters {
        let o = measure_device_overlap(world, options, &run, &x.q, &x.k, &x.v, backward.then_some(&x.d_o), &pp)?;
        let passes = [Some(&o.forward), o.backward.as_ref()];
        let sum = |f: &dyn Fn(&ringattn::cuda::PassTiming) -> f64| passes.iter().flatten().map(|p| f(p)).sum::<f64>();
        samples.push(sum(&|p| p.max_wall_ms) / 1e3);
        comp.push(sum(&|p| p.compute_only_ms.unwrap_or(0.0)) / 1e3);
        comm.push(sum(&|p| p.comm_only_ms.unwrap_or(0.0)) / 1e3);
        bytes = o.bytes_sent.iter().sum::<u64>() as f64 / world as f64;
    }
    let seconds = median(&samples);
    let (c, n) = (median(&comp), median(&comm));
    let flops = job_flops(a, params, s, backward)?;
    Ok(SweepRecord {
        strategy: if world == 1 { Strategy::Single.to_string() } else { strategy.to_string() },
        world,
        seq: s,
        tokens_per_rank: s / world,
        passes: if backward { "forward+backward".into() } else { "forward".into() },
        seconds,
        samples_s: samples,
        tflops_per_rank: flops / world as f64 / seconds / 1e12,
        hidden: (world > 1 && n > 0.0).then(|| ringattn::parallel::hidden_share(seconds, c, n)),
        compute_only_s: Some(c),
        comm_only_s: Some(n),
        bytes_per_rank: bytes,
        peak_bytes_per_rank: None,
    })
}

/// A single-device forward through the backend's block step (the same code as its ranks).
fn be_single_forward<Be: Backend<Buf = HostBuf>>(
    be: &Be,
    x: &Inputs,
    params: &AttentionParams,
) -> Result<(HostBuf, HostBuf)> {
    let dims = ringattn::Dims::of(&x.q, &x.k, &x.v)?;
    let (qp, kp) = ringattn::Positions::single_device(dims.s_q, dims.s_k);
    let up = |t: &Tensor| be.upload(&HostBuf::from_tensor(t));
    let (q, k, v) = (up(&x.q)?, up(&x.k)?, up(&x.v)?);
    be.forward_block(dims, &q, &k, &v, &qp, &kp, params)?.wait()
}

fn be_single_backward<Be: Backend<Buf = HostBuf>>(
    be: &Be,
    x: &Inputs,
    fwd: &(HostBuf, HostBuf),
    params: &AttentionParams,
) -> Result<()> {
    let dims = ringattn::Dims::of(&x.q, &x.k, &x.v)?;
    let (qp, kp) = ringattn::Positions::single_device(dims.s_q, dims.s_k);
    let up = |t: &Tensor| be.upload(&HostBuf::from_tensor(t));
    let (q, k, v, d_o) = (up(&x.q)?, up(&x.k)?, up(&x.v)?, up(&x.d_o)?);
    let delta = be.softmax_grad_rowsum(dims, &fwd.0, &d_o)?;
    be.backward_block(dims, &q, &k, &v, &fwd.0, &fwd.1, &d_o, &delta, &qp, &kp, params)?.wait().map(drop)
}

/// `ringattn bench` in sweep mode.
pub fn sweep(a: &BenchArgs) -> Result<std::process::ExitCode> {
    let backend = parse_backend(&a.backend)?;
    let dtype: DType =
        a.dtype.as_deref().unwrap_or(if backend == BackendKind::Cpu { "f32" } else { "bf16" }).parse()?;
    let backward = match a.pass.as_str() {
        "forward" => false,
        "both" => true,
        other => {
            return Err(Error::InvalidArgument(format!(
                "--pass `{other}`: sweeps time forward or both (forward+backward)"
            )))
        }
    };
    let configs = configurations(a)?;
    // A GPU sweep on a machine that cannot run it fails now, before any input is drawn.
    #[cfg(feature = "cuda")]
    if backend == BackendKind::Cuda {
        ringattn::cuda::probe()?;
    }
    let link = match a.link_gbps {
        Some(g) if g <= 0.0 => None,
        g => {
            let gbps = g.unwrap_or(2.0);
            if !gbps.is_finite() || !a.link_latency_us.is_finite() || a.link_latency_us < 0.0 {
                return Err(Error::InvalidArgument(format!(
                    "--link-gbps {gbps} / --link-latency-us {}: must be finite, the latency non-negative",
                    a.link_latency_us
                )));
            }
            Some(LinkSpec { gbps, latency_us: a.link_latency_us })
        }
    };
    let model =
        link.map(|l| LinkModel { bandwidth: l.gbps * 1e9, latency: Duration::from_secs_f64(l.latency_us * 1e-6) });
    let out_dir = a.out.clone().unwrap_or_else(|| PathBuf::from("bench-out"));
    std::fs::create_dir_all(&out_dir).map_err(|source| Error::Io { path: out_dir.clone(), source })?;
    let params = AttentionParams {
        mask: if a.causal { Mask::Causal } else { Mask::None },
        softcap: a.softcap,
        ..Default::default()
    };
    params.check_scores()?;
    println!(
        "ringattn bench sweep: {} backend, {} threads, b={} h_q={} h_kv={} d={} {dtype} {}, {} configurations, link {}",
        a.backend,
        rayon::current_num_threads(),
        a.batch,
        a.heads,
        a.kv_heads.unwrap_or(a.heads),
        a.head_dim,
        if a.causal { "causal" } else { "full" },
        configs.len(),
        link.map_or("none (instant)".to_string(), |l| format!("{} GB/s, {} µs", l.gbps, l.latency_us)),
    );
    let bar = ProgressBar::new(configs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta} {msg}")
            .map_err(|e| Error::InvalidArgument(format!("progress template: {e}")))?
            .progress_chars("=> "),
    );
    bar.set_prefix("bench");
    let mut records = Vec::with_capacity(configs.len());
    let mut cached: Option<(usize, Inputs)> = None;
    for (strategy, world, s) in configs {
        bar.set_message(format!("{strategy:?} x{world} s={s}"));
        if cached.as_ref().is_none_or(|c| c.0 != s) {
            cached = Some((s, inputs(a, s, dtype)));
        }
        let x = &cached.as_ref().ok_or_else(|| Error::InvalidArgument("inputs".into()))?.1;
        let rec = match backend {
            BackendKind::Cpu => measure(a, &CpuBackend::default(), x, strategy, world, model, &params, backward)?,
            #[cfg(feature = "emu")]
            BackendKind::Emu => {
                let options = ringattn::emu::EmuOptions {
                    kernels: crate::args::kernel_family(&a.kernels, backend)?,
                    dq_mode: crate::bench::parse_dq_mode(&a.dq_mode)?,
                    ..Default::default()
                };
                let be = ringattn::emu::EmuBackend { dtype, options };
                measure(a, &be, x, strategy, world, model, &params, backward)?
            }
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => measure_device(a, x, strategy, world, &params, backward)?,
            #[allow(unreachable_patterns)]
            other => return Err(Error::InvalidArgument(format!("--backend {other:?}: not in this build"))),
        };
        records.push(rec);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let report = SweepReport {
        backend: a.backend.clone(),
        device: if backend == BackendKind::Cuda { format!("GPU {}", a.device) } else { "cpu".into() },
        threads: rayon::current_num_threads(),
        b: a.batch,
        h_q: a.heads,
        h_kv: a.kv_heads.unwrap_or(a.heads),
        d: a.head_dim,
        dtype: dtype.to_string().to_lowercase(),
        causal: a.causal,
        softcap: a.softcap,
        link,
        records,
    };
    print!("{}", table(&report));
    let files = write_outputs(&out_dir, &report)?;
    println!("wrote {}", files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "));
    Ok(std::process::ExitCode::SUCCESS)
}

/// The aligned table of a report.
pub fn table(r: &SweepReport) -> String {
    let mut t = format!(
        "{:<10} {:>5} {:>9} {:>11} {:>12} {:>8} {:>12} {:>12}\n",
        "strategy", "world", "seq", "time ms", "TFLOP/s/rank", "hidden", "MiB sent/rk", "peak MiB/rk"
    );
    for x in &r.records {
        t += &format!(
            "{:<10} {:>5} {:>9} {:>11.2} {:>12.4} {:>8} {:>12.2} {:>12}\n",
            x.strategy,
            x.world,
            x.seq,
            x.seconds * 1e3,
            x.tflops_per_rank,
            x.hidden.map_or("-".to_string(), |h| format!("{:.1}%", h * 100.0)),
            x.bytes_per_rank / (1u64 << 20) as f64,
            x.peak_bytes_per_rank.map_or("-".to_string(), |p| format!("{:.1}", p / (1u64 << 20) as f64)),
        );
    }
    t
}

/// The CSV of a report (one row per record).
pub fn csv(r: &SweepReport) -> String {
    let mut t = String::from(
        "strategy,world,seq,tokens_per_rank,passes,seconds,tflops_per_rank,hidden,compute_only_s,comm_only_s,bytes_per_rank,peak_bytes_per_rank\n",
    );
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v}"));
    for x in &r.records {
        t += &format!(
            "{},{},{},{},{},{},{},{},{},{},{},{}\n",
            x.strategy,
            x.world,
            x.seq,
            x.tokens_per_rank,
            x.passes,
            x.seconds,
            x.tflops_per_rank,
            opt(x.hidden),
            opt(x.compute_only_s),
            opt(x.comm_only_s),
            x.bytes_per_rank,
            opt(x.peak_bytes_per_rank)
        );
    }
    t
}

/// Writes bench.json, bench.csv and the plots into `dir`; returns the files written.
pub fn write_outputs(dir: &Path, r: &SweepReport) -> Result<Vec<PathBuf>> {
    let json = dir.join("bench.json");
    ringattn::io::write_json(&json, r)?;
    let csv_path = dir.join("bench.csv");
    ringattn::io::write_atomic(&csv_path, csv(r).as_bytes())?;
    let mut files = vec![json, csv_path];
    let max_world = r.records.iter().map(|x| x.world).max().unwrap_or(1);
    // Series per strategy at the largest world size (and the single-rank baseline).
    let series_of = |f: &dyn Fn(&SweepRecord) -> Option<f64>, worlds: &[usize]| -> Vec<(String, Vec<(f64, f64)>)> {
        let mut names: Vec<(String, usize)> = Vec::new();
        for x in &r.records {
            let key = (x.strategy.clone(), x.world);
            if worlds.contains(&x.world) && !names.contains(&key) {
                names.push(key);
            }
        }
        names
            .into_iter()
            .map(|(st, w)| {
                let pts = r
                    .records
                    .iter()
                    .filter(|x| x.strategy == st && x.world == w)
                    .filter_map(|x| f(x).map(|y| (x.seq as f64, y)))
                    .collect();
                (format!("{st} ×{w}"), pts)
            })
            .filter(|(_, pts): &(String, Vec<(f64, f64)>)| !pts.is_empty())
            .collect()
    };
    let label = format!(
        "{}, b={} h={}/{} d={} {}{}",
        r.backend,
        r.b,
        r.h_q,
        r.h_kv,
        r.d,
        r.dtype,
        if r.causal { " causal" } else { "" }
    );
    let throughput = series_of(&|x| Some(x.tflops_per_rank), &[1, max_world]);
    files.extend(crate::plot::line_chart(
        &dir.join("throughput"),
        &format!("Throughput per rank ({label})"),
        "sequence length (tokens)",
        "TFLOP/s per rank",
        &throughput,
        true,
        false,
    )?);
    let hidden = series_of(&|x| x.hidden.map(|h| h * 100.0), &[max_world]);
    if !hidden.is_empty() {
        files.extend(crate::plot::line_chart(
            &dir.join("hidden"),
            &format!("Communication hidden ({label})"),
            "sequence length (tokens)",
            "communication hidden (%)",
            &hidden,
            true,
            false,
        )?);
    }
    // Weak scaling: the tokens-per-rank value measured at the most world sizes.
    let mut best: Option<(usize, usize)> = None;
    for x in &r.records {
        let n = r
            .records
            .iter()
            .filter(|y| y.tokens_per_rank == x.tokens_per_rank && y.seq == y.tokens_per_rank * y.world)
            .map(|y| y.world)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        if n >= 2 && best.is_none_or(|b| n > b.1) {
            best = Some((x.tokens_per_rank, n));
        }
    }
    if let Some((tpr, _)) = best {
        let mut strategies: Vec<String> = Vec::new();
        for x in &r.records {
            if !strategies.contains(&x.strategy) && x.strategy != "single" {
                strategies.push(x.strategy.clone());
            }
        }
        let weak: Vec<(String, Vec<(f64, f64)>)> = strategies
            .iter()
            .map(|st| {
                let pts = r
                    .records
                    .iter()
                    .filter(|y| y.tokens_per_rank == tpr && y.seq == tpr * y.world)
                    .filter(|y| &y.strategy == st || y.strategy == "single")
                    .map(|y| (y.world as f64, y.seconds * 1e3))
                    .collect();
                (st.clone(), pts)
            })
            .collect();
        files.extend(crate::plot::line_chart(
            &dir.join("weak-scaling"),
            &format!("Weak scaling, {tpr} tokens per rank ({label})"),
            "ranks",
            "time (ms)",
            &weak,
            true,
            true,
        )?);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_schema_round_trips() {
        let r = SweepReport {
            backend: "cpu".into(),
            device: "cpu".into(),
            threads: 2,
            b: 1,
            h_q: 4,
            h_kv: 2,
            d: 32,
            dtype: "f32".into(),
            causal: true,
            softcap: Some(30.0),
            link: Some(LinkSpec { gbps: 2.0, latency_us: 20.0 }),
            records: vec![SweepRecord {
                strategy: "ring".into(),
                world: 2,
                seq: 1024,
                tokens_per_rank: 512,
                passes: "forward+backward".into(),
                seconds: 0.5,
                samples_s: vec![0.5, 0.6],
                tflops_per_rank: 0.01,
                hidden: Some(0.9),
                compute_only_s: Some(0.45),
                comm_only_s: Some(0.5),
                bytes_per_rank: 1e6,
                peak_bytes_per_rank: Some(2e6),
            }],
        };
        let text = serde_json::to_string(&r).expect("serialise");
        let back: SweepReport = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, r);
        assert_eq!(csv(&r).lines().count(), 2);
        assert!(table(&r).contains("90.0%"));
    }

    #[test]
    fn configurations_run_one_rank_once_per_length() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            b: BenchArgs,
        }
        let cli = Cli::parse_from(["x", "--seq", "256,512", "--world", "1,2", "--strategies", "ring,ulysses"]);
        let c = configurations(&cli.b).expect("valid");
        assert_eq!(c.len(), 2 * (1 + 2));
        assert_eq!(c[0], (Strategy::Single, 1, 256));
    }
}
