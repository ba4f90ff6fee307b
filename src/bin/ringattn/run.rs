//! `ringattn run`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use ringattn::cpu::{ForwardOutput, Gradients};
use ringattn::{io, AttentionParams, Result};

use ringattn::parallel::Stats;

use crate::args::{compute, run_parallel, CommKind, ExecArgs, MaskArgs};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Input safetensors file with q, k, v and optionally do.
    #[arg(long, value_name = "IN.safetensors")]
    pub input: PathBuf,
    /// Output safetensors file (o, lse, and dq, dk, dv when do is present).
    #[arg(long, value_name = "OUT.safetensors")]
    pub output: PathBuf,
    #[command(flatten)]
    pub exec: ExecArgs,
    #[command(flatten)]
    pub mask: MaskArgs,
    /// Also write each rank's statistics (time in compute and waiting, blocks, bytes sent,
    /// FLOPs, per step; forward and backward) as JSON to this file (parallel strategies).
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// With --comm mpi or nccl: run the forward (and backward) this many times in the same
    /// processes (the outputs are the last run's; --stats records every run's time), to time
    /// warm runs.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Test hook of --comm mpi|nccl: RANK:die:N or RANK:stall:N makes that rank die or stop
    /// answering at its N-th send.
    #[cfg(any(feature = "mpi", feature = "cuda"))]
    #[arg(long, hide = true)]
    pub fault: Option<String>,
}

pub fn run(a: &RunArgs) -> Result<ExitCode> {
    let params = a.mask.params()?;
    a.exec.parallel(params.clone())?;
    if a.exec.comm_kind()? != CommKind::Local {
        #[cfg(any(feature = "mpi", feature = "cuda"))]
        return crate::distributed::run(a);
    }
    let x = io::read_inputs(&a.input)?;
    // The input file's sinks (if any) join the parameters.
    let params = AttentionParams { sinks: x.sinks.clone(), ..params };
    let (fwd, grads) = match &a.stats {
        Some(path) if !a.exec.is_single() => {
            let mut parallel = a.exec.parallel(params.clone())?;
            parallel.seq_len = x.q.shape().get(1).copied().unwrap_or(0);
            let r = run_parallel(&a.exec, &x.q, &x.k, &x.v, x.d_o.as_ref(), &parallel)?;
            write_stats(path, &a.exec.strategy, r.stats)?;
            (r.forward, r.gradients)
        }
        _ => compute(&a.exec, &params, &x.q, &x.k, &x.v, x.d_o.as_ref())?,
    };
    write_outputs(&a.output, &fwd, grads.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// The statistics of one rank: forward and (when run) backward.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct RankStats {
    /// Forward.
    pub forward: serde_json::Value,
    /// Backward, when run.
    pub backward: Option<serde_json::Value>,
    /// Seconds of forward + backward of every repetition (`--repeat`), in order.
    #[serde(default)]
    pub repeat_totals_s: Vec<f64>,
}

/// `{"strategy", "world", "ranks": [{"forward": Stats, "backward": Stats | null}, ...]}`.
pub fn write_stats(path: &Path, strategy: &str, stats: Vec<(Stats, Option<Stats>)>) -> Result<()> {
    let ranks: Vec<RankStats> = stats
        .into_iter()
        .map(|(f, b)| RankStats {
            repeat_totals_s: vec![f.total.as_secs_f64() + b.as_ref().map_or(0.0, |b| b.total.as_secs_f64())],
            forward: serde_json::to_value(f).unwrap_or_default(),
            backward: b.map(|b| serde_json::to_value(b).unwrap_or_default()),
        })
        .collect();
    write_rank_stats(path, strategy, ranks)
}

/// Writes already serialised per-rank statistics (see [`write_stats`]).
pub fn write_rank_stats(path: &Path, strategy: &str, ranks: Vec<RankStats>) -> Result<()> {
    let world = ranks.len();
    io::write_json(path, &serde_json::json!({ "strategy": strategy, "world": world, "ranks": ranks }))
}

/// Writes `o`, `lse` and, when present, `dq`, `dk`, `dv` and `dsinks` to `path`
/// (atomically).
pub fn write_outputs(path: &Path, fwd: &ForwardOutput, grads: Option<&Gradients>) -> Result<()> {
    let mut tensors = vec![("o", &fwd.o), ("lse", &fwd.lse)];
    if let Some(g) = grads {
        tensors.extend([("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)]);
        if let Some(ds) = &g.dsinks {
            tensors.push(("dsinks", ds));
        }
    }
    io::write_tensors(path, &tensors)
}
