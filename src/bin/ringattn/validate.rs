//! `ringattn validate`: checks the planner's cost model against measured multi-process runs.
//!
//! 1. Calibrates from micro-measurements only: the link from a ping-pong between two MPI
//!    processes (`ringattn pingpong --comm mpi`), the kernel rates from single-rank runs
//!    (`ringattn bench`, one process, at the shape each strategy's local step computes).
//! 2. Runs each configuration as an MPI job (`ringattn run --comm mpi --stats --repeat`),
//!    forward and backward, a warm-up run and then the timed ones in the same processes, and
//!    takes the slowest rank's time (median of the timed runs).
//! 3. Predicts each with `ringattn::plan::evaluate` and reports the relative error, as a
//!    table (text and Markdown), JSON, CSV and a plot.
//!
//! Ranks run `threads` compute threads each; when the ranks' threads outnumber the cores,
//! the model's per-rank kernel rate is the measured single-rank rate times
//! `cores / (ranks·threads)` — a fact of the machine, not a fitted parameter.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Args;
use ringattn::parallel::Strategy;
use ringattn::plan::{evaluate, Calibration, ClusterSpec, JobSpec, LinkSharing, Nesting, Passes, PingPong, Placement};
use ringattn::{io, random::randn, DType, Error, Result};
use serde::Serialize;

use crate::bench::median;

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// The MPI launcher.
    #[arg(long, default_value = "mpirun")]
    pub mpirun: String,
    /// Configurations STRATEGY:RANKS:SEQ[:causal], comma-separated (STRATEGY: a --strategy
    /// of more than one rank; uspU for USP with Ulysses degree U).
    #[arg(
        long,
        default_value = "ring:2:4096:causal,ring:2:8192:causal,ulysses:2:4096:causal,allgather:2:4096:causal,ring:2:4096,ulysses:2:8192,ring:4:8192:causal,usp2:4:8192:causal"
    )]
    pub configs: String,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Key/value heads [default: --heads].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Timed runs per configuration, after one warm-up run in the same processes (the median
    /// is kept).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Cores of the machine [default: what the OS reports].
    #[arg(long)]
    pub cores: Option<usize>,
    /// Folder for validation.json, validation.csv, validation.md, the plot and the
    /// measurements.
    #[arg(long, value_name = "DIR", default_value = "validation-out")]
    pub out: PathBuf,
}

/// One configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Config {
    strategy: Strategy,
    ulysses: usize,
    ranks: usize,
    seq: usize,
    causal: bool,
}

impl Config {
    fn parse(s: &str) -> Result<Config> {
        let bad = || Error::InvalidArgument(format!("--configs entry `{s}`: expected STRATEGY:RANKS:SEQ[:causal]"));
        let parts: Vec<&str> = s.trim().split(':').collect();
        if parts.len() < 3 || parts.len() > 4 || (parts.len() == 4 && parts[3] != "causal") {
            return Err(bad());
        }
        let ranks: usize = parts[1].parse().map_err(|_| bad())?;
        let seq: usize = parts[2].parse().map_err(|_| bad())?;
        // `usp` carries its Ulysses degree (`usp2`); every other name is Strategy's own.
        let (strategy, ulysses) = match parts[0].strip_prefix(Strategy::Usp.name()) {
            Some(u) => (Strategy::Usp, u.parse().map_err(|_| bad())?),
            None => match parts[0].parse::<Strategy>().map_err(|_| bad())? {
                Strategy::Single | Strategy::Auto => return Err(bad()),
                Strategy::Ulysses => (Strategy::Ulysses, ranks),
                s => (s, 1),
            },
        };
        if ranks < 2 || seq < ranks || ulysses == 0 || !ranks.is_multiple_of(ulysses) {
            return Err(bad());
        }
        Ok(Config { strategy, ulysses, ranks, seq, causal: parts.len() == 4 })
    }

    fn name(&self) -> String {
        let st = match self.strategy {
            Strategy::Usp => format!("usp{}x{}", self.ulysses, self.ranks / self.ulysses),
            other => other.to_string(),
        };
        format!("{st} P={} s={}{}", self.ranks, self.seq, if self.causal { " causal" } else { "" })
    }

    fn placement(&self) -> Placement {
        match self.strategy {
            Strategy::Ring => Placement::ring(self.ranks),
            Strategy::Ulysses => Placement::ulysses(self.ranks),
            Strategy::AllGather => Placement::all_gather(self.ranks),
            _ => Placement::usp(self.ulysses, self.ranks / self.ulysses, Nesting::UlyssesInNode),
        }
    }
}

/// One row of the validation table.
#[derive(Debug, Clone, Serialize)]
struct Row {
    config: String,
    strategy: String,
    ranks: usize,
    seq: usize,
    causal: bool,
    measured_ms: f64,
    samples_ms: Vec<f64>,
    predicted_ms: f64,
    predicted_compute_ms: f64,
    predicted_exposed_comm_ms: f64,
    /// `(predicted − measured) / measured`.
    error: f64,
    kernel_fwd_tflops: f64,
    kernel_bwd_tflops: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    cores: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    link_latency_us: f64,
    link_gbps: f64,
    rows: Vec<Row>,
    max_abs_error: f64,
}

fn exe() -> Result<PathBuf> {
    std::env::current_exe().map_err(|e| Error::InvalidArgument(format!("cannot find the ringattn executable: {e}")))
}

/// Runs a command with `threads` compute threads per process; an error names it.
fn run(cmd: &mut Command, threads: usize) -> Result<()> {
    let out = cmd
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .map_err(|e| Error::InvalidArgument(format!("cannot start {cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(Error::InvalidArgument(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The kernel rates (forward, backward TFLOP/s) of one process with `threads` threads at
/// the shape and mask of a strategy's local step (causal rates count the halved FLOPs).
#[allow(clippy::too_many_arguments)]
fn kernel_rates(
    dir: &Path,
    seq: usize,
    heads: usize,
    kv: usize,
    d: usize,
    causal: bool,
    threads: usize,
) -> Result<(f64, f64)> {
    let json = dir.join(format!("kernel-s{seq}-h{heads}{}.json", if causal { "-causal" } else { "" }));
    if !json.exists() {
        let mut cmd = Command::new(exe()?);
        cmd.args(["bench", "--backend", "cpu", "--dtype", "f32", "--pass", "both", "--warmup", "1", "--iters", "5"]);
        cmd.args(["--seq", &seq.to_string(), "--heads", &heads.to_string(), "--kv-heads", &kv.to_string()]);
        cmd.args(["--head-dim", &d.to_string(), "--json", &s(&json)]);
        if causal {
            cmd.arg("--causal");
        }
        run(&mut cmd, threads)?;
    }
    let cal = Calibration::load(&json)?;
    match (cal.fwd_tflops, cal.bwd_tflops) {
        (Some(f), Some(b)) => Ok((f, b)),
        _ => Err(Error::InvalidArgument(format!("{}: no forward and backward rates", json.display()))),
    }
}

pub fn validate(a: &ValidateArgs) -> Result<ExitCode> {
    let configs: Vec<Config> = a.configs.split(',').map(Config::parse).collect::<Result<_>>()?;
    let cores = a.cores.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let (h, kv, d) = (a.heads, a.kv_heads.unwrap_or(a.heads), a.head_dim);
    let dir = &a.out;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
    // 1. The link: a ping-pong between two processes.
    let pp_json = dir.join("pingpong.json");
    run(
        Command::new(&a.mpirun).args(["-n", "2"]).arg(exe()?).args([
            "pingpong",
            "--comm",
            "mpi",
            "--json",
            &s(&pp_json),
        ]),
        1,
    )?;
    let text = std::fs::read_to_string(&pp_json).map_err(|source| Error::Io { path: pp_json.clone(), source })?;
    let link = PingPong::from_json(&text)?.fit()?;
    println!(
        "link (ping-pong, 2 processes): latency {:.2} µs, bandwidth {:.3} GB/s",
        link.latency_s * 1e6,
        link.bandwidth_gbps
    );
    let mut rows = Vec::new();
    for c in &configs {
        let threads = (cores / c.ranks).max(1);
        let share = (cores as f64 / (c.ranks * threads) as f64).min(1.0);
        // 2. The kernel at the local step's shape and mask: ring hops attend s/P tokens to s/P
        // (a causal zigzag hop is half visible, as a causal block is); Ulysses (and
        // all-gather, same FLOPs) s tokens on h/u heads; USP s/r tokens on h/u heads.
        let r = c.ranks / c.ulysses;
        let (ks, kh) = match c.strategy {
            Strategy::Ring => (c.seq / c.ranks, h),
            Strategy::AllGather => (c.seq, (h / c.ranks).max(1)),
            _ => (c.seq / r, (h / c.ulysses).max(1)),
        };
        let (f, b) = kernel_rates(dir, ks, kh, kv.min(kh).max(1), d, c.causal, threads)?;
        // 3. The measured runs.
        let input = dir.join(format!("in-s{}.safetensors", c.seq));
        if !input.exists() {
            let t = |h: usize, seed| randn(vec![1, c.seq, h, d], seed, DType::F32);
            io::write_tensors(&input, &[("q", &t(h, 1)), ("k", &t(kv, 2)), ("v", &t(kv, 3)), ("do", &t(h, 4))])?;
        }
        // One job per configuration, its first run a warm-up: the rest are timed.
        let stats = dir.join(format!("stats-{}.json", c.name().replace([' ', '='], "_")));
        let out = dir.join("out.safetensors");
        let mut cmd = Command::new(&a.mpirun);
        cmd.args(["-n", &c.ranks.to_string()]).arg(exe()?);
        let st = c.strategy.to_string();
        cmd.args(["run", "--comm", "mpi", "--strategy", &st, "--input", &s(&input), "--output", &s(&out)]);
        cmd.args(["--stats", &s(&stats), "--repeat", &(a.repeats.max(1) + 1).to_string()]);
        if c.strategy == Strategy::Usp {
            cmd.args(["--ulysses-degree", &c.ulysses.to_string()]);
        }
        if c.causal {
            cmd.arg("--causal");
        }
        run(&mut cmd, threads)?;
        let samples = slowest_rank_ms(&stats)?;
        let measured = median(&samples);
        // 4. The prediction.
        let cluster = ClusterSpec {
            gpus: c.ranks,
            gpus_per_node: c.ranks,
            intra_gbps: link.bandwidth_gbps,
            inter_gbps: link.bandwidth_gbps,
            intra_latency_us: link.latency_s * 1e6,
            inter_latency_us: link.latency_s * 1e6,
            fwd_tflops: f * share,
            bwd_tflops: b * share,
            memory_gib: 1e6,
            links: LinkSharing::PerGpu,
        };
        let job = JobSpec {
            seq: c.seq,
            batch: 1,
            heads: h,
            kv_heads: kv,
            head_dim: d,
            head_dim_v: None,
            dtype_bytes: 4,
            accum_bytes: 4,
            causal: c.causal,
            passes: Passes::Both,
            layers: 1,
        };
        let p = evaluate(&cluster, &job, &c.placement())?;
        let predicted = p.time_s * 1e3;
        let row = Row {
            config: c.name(),
            strategy: c.strategy.to_string(),
            ranks: c.ranks,
            seq: c.seq,
            causal: c.causal,
            measured_ms: measured,
            samples_ms: samples,
            predicted_ms: predicted,
            predicted_compute_ms: p.compute_s * 1e3,
            predicted_exposed_comm_ms: p.exposed_comm_s * 1e3,
            error: (predicted - measured) / measured,
            kernel_fwd_tflops: f * share,
            kernel_bwd_tflops: b * share,
        };
        println!(
            "{:<34} measured {:9.1} ms  predicted {:9.1} ms  error {:+6.1}%",
            row.config,
            row.measured_ms,
            row.predicted_ms,
            row.error * 100.0
        );
        rows.push(row);
    }
    let max_abs_error = rows.iter().map(|r| r.error.abs()).fold(0.0, f64::max);
    let report = Report {
        cores,
        heads: h,
        kv_heads: kv,
        head_dim: d,
        link_latency_us: link.latency_s * 1e6,
        link_gbps: link.bandwidth_gbps,
        rows,
        max_abs_error,
    };
    io::write_json(&dir.join("validation.json"), &report)?;
    io::write_atomic(&dir.join("validation.md"), markdown(&report).as_bytes())?;
    let mut csv = String::from("config,ranks,seq,causal,measured_ms,predicted_ms,error\n");
    for r in &report.rows {
        csv += &format!(
            "{},{},{},{},{},{},{}\n",
            r.config, r.ranks, r.seq, r.causal, r.measured_ms, r.predicted_ms, r.error
        );
    }
    io::write_atomic(&dir.join("validation.csv"), csv.as_bytes())?;
    plot(dir, &report)?;
    print!("{}", markdown(&report));
    let within = report.rows.iter().filter(|r| r.error.abs() <= 0.25).count();
    println!("{within} of {} configurations within 25%", report.rows.len());
    Ok(ExitCode::SUCCESS)
}

/// The slowest rank's forward + backward milliseconds of each timed repetition (the first,
/// a warm-up, left out) from a `run --stats --repeat` file.
fn slowest_rank_ms(path: &Path) -> Result<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })?;
    let bad = |d: &str| Error::Format { path: path.to_path_buf(), detail: d.into() };
    let ranks = v.get("ranks").and_then(|r| r.as_array()).ok_or_else(|| bad("no `ranks`"))?;
    let per_rank: Vec<Vec<f64>> = ranks
        .iter()
        .map(|r| {
            r.get("repeat_totals_s")
                .and_then(|t| t.as_array())
                .map(|t| t.iter().filter_map(|x| x.as_f64()).collect())
                .ok_or_else(|| bad("a rank without `repeat_totals_s`"))
        })
        .collect::<Result<_>>()?;
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    if n < 2 {
        return Err(bad("fewer than two repetitions"));
    }
    Ok((1..n).map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max) * 1e3).collect())
}

fn markdown(r: &Report) -> String {
    let mut t = format!(
        "Calibration: ping-pong latency {:.2} µs, bandwidth {:.2} GB/s; kernel rates from single-rank runs; {} cores.\n\n",
        r.link_latency_us, r.link_gbps, r.cores
    );
    t += "| configuration | measured ms | predicted ms | of which exposed comm ms | error |\n|---|---:|---:|---:|---:|\n";
    for x in &r.rows {
        t += &format!(
            "| {} | {:.1} | {:.1} | {:.1} | {:+.1}% |\n",
            x.config,
            x.measured_ms,
            x.predicted_ms,
            x.predicted_exposed_comm_ms,
            x.error * 100.0
        );
    }
    t += &format!("\nLargest error: {:.1}%.\n", r.max_abs_error * 100.0);
    t
}

fn plot(dir: &Path, r: &Report) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let hi = r.rows.iter().map(|x| x.measured_ms.max(x.predicted_ms)).fold(1.0, f64::max) * 1.1;
    let lo = r.rows.iter().map(|x| x.measured_ms.min(x.predicted_ms)).fold(f64::INFINITY, f64::min) * 0.9;
    series.push(("predicted = measured".into(), vec![(lo, lo), (hi, hi)]));
    series.push(("+25%".into(), vec![(lo, lo * 1.25), (hi / 1.25, hi)]));
    series.push(("−25%".into(), vec![(lo / 0.75, lo), (hi, hi * 0.75)]));
    let mut names: Vec<String> = r.rows.iter().map(|x| x.strategy.clone()).collect();
    names.sort();
    names.dedup();
    for n in names {
        let mut pts: Vec<(f64, f64)> =
            r.rows.iter().filter(|x| x.strategy == n).map(|x| (x.measured_ms, x.predicted_ms)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push((n, pts));
    }
    crate::plot::line_chart(
        &dir.join("validation"),
        "Cost model vs measured MPI runs (forward + backward)",
        "measured (ms)",
        "predicted (ms)",
        &series,
        true,
        true,
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::Config;

    #[test]
    fn configurations_parse() {
        let c = Config::parse("usp2:4:8192:causal").expect("valid");
        assert_eq!((c.ulysses, c.ranks, c.seq, c.causal), (2, 4, 8192, true));
        assert!(Config::parse("ring:1:100").is_err());
        assert!(Config::parse("usp3:4:100").is_err());
        assert!(Config::parse("ring:2:100:full").is_err());
    }
}
