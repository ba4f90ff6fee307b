//! `ringattn`: run, verify and demo exact long-context attention from the command line.

mod args;
mod bench;
mod demo;
#[cfg(any(feature = "mpi", feature = "cuda"))]
mod distributed;
mod docbench;
mod doctor;
mod pingpong;
mod plan;
mod plot;
mod progress;
mod run;
mod sweep;
mod validate;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: ringattn::memory::CountingAllocator = ringattn::memory::CountingAllocator;

/// Exact long-context attention: flash attention with a float64 oracle to check it.
#[derive(Parser)]
#[command(
    name = "ringattn",
    version,
    about = "Exact long-context attention: flash attention forward and backward, checked against a float64 oracle",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run attention on tensors from a safetensors file and write the results to another.
    ///
    /// IN holds `q` [b, s_q, h_q, d], `k` and `v` [b, s_k, h_kv, d], and optionally `do`
    /// (shape of q), all F32, BF16 or F16. OUT receives `o` (input dtype) and `lse` (F32,
    /// [b, h_q, s_q]), plus `dq`, `dk`, `dv` when `do` is present. OUT is written atomically:
    /// on any error no file is left.
    Run(run::RunArgs),
    /// Check results against the float64 oracle and print a table of relative errors.
    ///
    /// Uses the tensors of --input, or seeded random ones of --shape. Exits with status 3
    /// when a check fails.
    Verify(verify::VerifyArgs),
    /// Forward and backward on a long causal sequence, with time, TFLOP/s, peak memory and
    /// a spot check of sampled rows against the oracle.
    Demo(demo::DemoArgs),
    /// Time the single-device kernels of a backend: median and minimum milliseconds and
    /// TFLOP/s per pass, from the FLOPs of the pairs the mask leaves visible.
    ///
    /// FLOPs: forward 2·(d_qk + d_v) per visible (query, key) pair (4·d with one head dim),
    /// times b·h_q (s(s+1)/2 pairs per head when causal; windows and --seqlens documents
    /// counted exactly); backward 2·(3·d_qk + 2·d_v) (2.5× the forward with one head dim). Reported beside them: the dense FLOPs (all s² pairs), the visible pairs per
    /// (batch, head), and the tiles of the backend's tiling (cpu: the tiles its path chooses,
    /// `cpu::TileConfig::chosen`: f32 128×256 forward and 256×256 backward, bf16 128×512 with
    /// the forward's key tiles 256 where over a quarter of the visible ones would take its
    /// exact passes; emu and cuda: the forward kernel's and the dk/dv kernel's) per (batch,
    /// head), total and holding a visible pair.
    ///
    /// cuda times device-resident inputs with CUDA events (no host copies in the timed
    /// region); its forward writes o in the input dtype (16-bit) and lse in f32, as PyTorch's
    /// scaled_dot_product_attention does. cpu and emu time whole calls with the host clock.
    Bench(bench::BenchArgs),
    /// Rank every way to split one attention layer over a cluster (ring, Ulysses, USP
    /// degrees and placements, all-gather) by the analytic model's predicted step time, with
    /// communication volume, exposed communication and memory per rank, and recommend one.
    Plan(plan::PlanArgs),
    /// Predicted step time of each strategy over GPU counts and sequence lengths: a table,
    /// and with --out, JSON, CSV and plots (PNG, SVG).
    Simulate(plan::SimulateArgs),
    /// Measure the link between ranks 0 and 1: one-way time of messages of several sizes,
    /// fitted to latency + bytes / bandwidth (`mpirun -n 2 ringattn pingpong --comm mpi`);
    /// its JSON calibrates `plan --calibration`.
    Pingpong(pingpong::PingPongArgs),
    /// What this binary and machine have for the GPU paths: embedded kernel architectures,
    /// CUDA driver version, GPUs with their compute capability and the image each would load,
    /// NCCL (library path and version, or the names and paths tried), MPI, and the launcher's
    /// rank/GPU mapping; the problems that would stop a GPU run, listed.
    ///
    /// Exit status 0 whenever the report was produced; `--json` for scripts (`gpu_path_ok`).
    Doctor(doctor::DoctorArgs),
    /// Check the planner's cost model against measured MPI runs: calibrate from a ping-pong
    /// and single-rank kernel runs, run each configuration under mpirun, print predicted
    /// against measured (needs a build with --features mpi and Open MPI).
    Validate(validate::ValidateArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(&a),
        Command::Verify(a) => verify::verify(&a),
        Command::Demo(a) => demo::demo(&a),
        Command::Bench(a) => bench::bench(&a),
        Command::Plan(a) => plan::plan(&a),
        Command::Simulate(a) => plan::simulate(&a),
        Command::Pingpong(a) => pingpong::pingpong(&a),
        Command::Validate(a) => validate::validate(&a),
        Command::Doctor(a) => doctor::doctor(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
