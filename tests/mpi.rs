//! Multi-process runs under `mpirun` (feature `mpi`): `ringattn run --comm mpi` with 4 ranks
//! (oversubscribed on small machines) for every strategy, forward and backward, on an
//! uneven sequence length, against the float64 oracle and against the same strategy over
//! in-process ranks; a rank that dies or stops answering ends the job within the deadline
//! with a non-zero exit and a message naming what failed, and leaves no output file.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use ringattn::comm::LocalOptions;
use ringattn::cpu::{ForwardOutput, Gradients};
use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy};
use ringattn::{io, random::randn, verify, AttentionParams, DType, Mask, Tensor};

/// `mpirun -n {ranks} ringattn {args}`, allowed to run as root and oversubscribed.
fn mpirun(ranks: usize, args: &[&str]) -> Output {
    let launcher = std::env::var("RINGATTN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    Command::new(&launcher)
        .args(["-n", &ranks.to_string(), env!("CARGO_BIN_EXE_ringattn")])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot start `{launcher}` ({e}): install Open MPI (scripts/test.sh does)"))
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// q, k, v, do of an uneven length (37 tokens over 4 ranks), GQA 4:2.
fn inputs(dir: &Path, dtype: DType) -> (PathBuf, [Tensor; 4]) {
    let q = randn(vec![2, 37, 4, 16], 11, dtype);
    let k = randn(vec![2, 37, 2, 16], 12, dtype);
    let v = randn(vec![2, 37, 2, 16], 13, dtype);
    let d_o = randn(vec![2, 37, 4, 16], 14, dtype);
    let path = dir.join(format!("in-{dtype}.safetensors"));
    io::write_tensors(&path, &[("q", &q), ("k", &k), ("v", &v), ("do", &d_o)]).expect("write inputs");
    (path, [q, k, v, d_o])
}

fn outputs(path: &Path) -> (ForwardOutput, Gradients) {
    let mut t = io::read_tensors(path).expect("read outputs");
    let mut take = |n: &str| t.remove(n).unwrap_or_else(|| panic!("output lacks {n}"));
    let f = ForwardOutput { o: take("o"), lse: take("lse") };
    let g = Gradients { dq: take("dq"), dk: take("dk"), dv: take("dv"), dsinks: t.remove("dsinks") };
    (f, g)
}

#[test]
fn every_strategy_over_four_processes_matches_the_oracle_and_the_in_process_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, [q, k, v, d_o]) = inputs(dir.path(), DType::F32);
    let cases: &[(&str, Option<usize>, bool)] = &[
        ("ring", None, true),
        ("ring", None, false),
        ("allgather", None, true),
        ("ulysses", None, false),
        ("ulysses", None, true),
        ("usp", Some(2), true),
    ];
    for &(strategy, degree, causal) in cases {
        let out = dir.path().join(format!("out-{strategy}-{causal}.safetensors"));
        let mut args = vec!["run", "--comm", "mpi", "--strategy", strategy, "--input", s(&input), "--output", s(&out)];
        let deg = degree.map(|d| d.to_string());
        if let Some(d) = &deg {
            args.extend(["--ulysses-degree", d]);
        }
        if causal {
            args.push("--causal");
        }
        let r = mpirun(4, &args);
        assert!(r.status.success(), "{strategy} causal={causal}: {}", text(&r));
        let (fwd, grads) = outputs(&out);
        assert!(grads.dsinks.is_none(), "{strategy}: no sinks given, no dsinks written");
        let attention = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
        let report =
            verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &fwd, Some(&grads)).expect("oracle check");
        assert!(report.pass(), "{strategy} causal={causal}:\n{}", report.table());
        // The same strategy over in-process ranks gives the same bits.
        let params = ParallelParams {
            strategy: strategy.parse::<Strategy>().expect("strategy"),
            attention,
            ulysses_degree: degree,
            ..Default::default()
        };
        let local = run_in_process(4, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)
            .expect("in-process run");
        let lg = local.gradients.expect("gradients");
        assert_eq!(fwd.o, local.forward.o, "{strategy}: o differs from the in-process run");
        assert_eq!(fwd.lse, local.forward.lse, "{strategy}: lse differs");
        assert_eq!((grads.dq, grads.dk, grads.dv), (lg.dq, lg.dk, lg.dv), "{strategy}: gradients differ");
    }
}

/// `--strategy auto` over four processes: every rank resolves the same choice from the
/// batch's documents (no exchange), the result matches the oracle and the in-process run bit
/// for bit, and every rank's statistics name the choice.
#[test]
fn auto_over_four_processes_chooses_alike_and_matches_the_oracle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, [q, k, v, d_o]) = inputs(dir.path(), DType::F32);
    let (out, stats) = (dir.path().join("out-auto.safetensors"), dir.path().join("stats-auto.json"));
    let r = mpirun(
        4,
        &[
            "run",
            "--comm",
            "mpi",
            "--strategy",
            "auto",
            "--causal",
            "--seqlens",
            "20,5,12",
            "--input",
            s(&input),
            "--output",
            s(&out),
            "--stats",
            s(&stats),
        ],
    );
    assert!(r.status.success(), "{}", text(&r));
    let (fwd, grads) = outputs(&out);
    let attention = AttentionParams {
        mask: Mask::Causal,
        documents: Some(ringattn::Documents::new(vec![20, 5, 12]).expect("documents")),
        ..Default::default()
    };
    let report =
        verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &fwd, Some(&grads)).expect("oracle check");
    assert!(report.pass(), "auto:\n{}", report.table());
    let params = ParallelParams { strategy: Strategy::Auto, attention, ..Default::default() };
    let local = run_in_process(4, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)
        .expect("in-process run");
    assert_eq!(fwd.o, local.forward.o, "o differs from the in-process run");
    let chosen = serde_json::to_value(local.stats[0].0.chosen.as_ref().expect("in-process choice")).expect("json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
    let ranks = json["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 4);
    for r in ranks {
        assert_eq!(r["forward"]["chosen"], chosen, "{r}");
        assert_eq!(r["backward"]["chosen"], chosen, "{r}");
    }
}

/// Attention sinks read from the input file by every process: the output and gradients
/// against the oracle, the sinks' gradient gathered (summed over the ranks) to rank 0's
/// file, and the same bits as the in-process run, under the ring and Ulysses.
#[test]
fn sinks_over_four_processes_match_the_oracle_and_the_in_process_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, [q, k, v, d_o]) = inputs(dir.path(), DType::F32);
    let sinks = Tensor::from_f32(vec![4], vec![1.0, 3.5, -1.0, 2.0]).expect("sinks");
    io::write_tensors(&input, &[("q", &q), ("k", &k), ("v", &v), ("do", &d_o), ("sinks", &sinks)]).expect("write");
    let attention = AttentionParams { mask: Mask::Causal, sinks: Some(sinks.to_f32_vec()), ..Default::default() };
    for strategy in ["ring", "ulysses"] {
        let out = dir.path().join(format!("out-sinks-{strategy}.safetensors"));
        let args =
            ["run", "--comm", "mpi", "--strategy", strategy, "--causal", "--input", s(&input), "--output", s(&out)];
        let r = mpirun(4, &args);
        assert!(r.status.success(), "{strategy}: {}", text(&r));
        let (fwd, grads) = outputs(&out);
        let report =
            verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &fwd, Some(&grads)).expect("oracle check");
        assert!(report.pass() && report.rows.len() == 6, "{strategy}:\n{}", report.table());
        let params = ParallelParams {
            strategy: strategy.parse::<Strategy>().expect("strategy"),
            attention: attention.clone(),
            ..Default::default()
        };
        let local = run_in_process(4, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)
            .expect("in-process run");
        let lg = local.gradients.expect("gradients");
        assert_eq!(fwd.o, local.forward.o, "{strategy}: o differs from the in-process run");
        assert_eq!(grads.dsinks, lg.dsinks, "{strategy}: the sinks' gradient differs");
    }
}

#[test]
fn the_emulated_kernels_run_across_processes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, [q, k, v, d_o]) = inputs(dir.path(), DType::BF16);
    let out = dir.path().join("out.safetensors");
    let r = mpirun(
        3,
        &[
            "run",
            "--comm",
            "mpi",
            "--backend",
            "emu",
            "--strategy",
            "ring",
            "--causal",
            "--input",
            s(&input),
            "--output",
            s(&out),
        ],
    );
    assert!(r.status.success(), "{}", text(&r));
    let (fwd, grads) = outputs(&out);
    let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let report =
        verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &fwd, Some(&grads)).expect("oracle check");
    assert!(report.pass(), "{}", report.table());
}

/// Runs a ring with a planted fault and checks the job ends promptly, with a non-zero exit,
/// a message containing every `needles` entry, and no output file.
fn failing_run(fault: &str, timeout: &str, needles: &[&str], within: Duration) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, _) = inputs(dir.path(), DType::F32);
    let out = dir.path().join("out.safetensors");
    let start = Instant::now();
    let r = mpirun(
        4,
        &[
            "run",
            "--comm",
            "mpi",
            "--strategy",
            "ring",
            "--causal",
            "--timeout",
            timeout,
            "--fault",
            fault,
            "--input",
            s(&input),
            "--output",
            s(&out),
        ],
    );
    let took = start.elapsed();
    let msg = text(&r);
    assert!(!r.status.success(), "the job succeeded despite fault {fault}: {msg}");
    assert!(took < within, "fault {fault}: the job took {took:?} to end (limit {within:?}): {msg}");
    for n in needles {
        assert!(msg.contains(n), "fault {fault}: the message lacks `{n}`: {msg}");
    }
    assert!(!out.exists(), "fault {fault}: an output file was left");
}

#[test]
fn a_rank_killed_mid_run_ends_the_job_promptly() {
    // Rank 1 dies at its 5th send (inside the forward ring); the launcher notices and ends
    // the job long before the 120 s deadline.
    failing_run("1:die:5", "120", &["rank 1", "signal"], Duration::from_secs(60));
}

#[test]
fn a_rank_that_stops_answering_is_named_when_the_deadline_expires() {
    // Rank 2 stops at its 5th send; its peers' waits expire after 3 s and abort the job
    // naming rank 2 and the operation.
    failing_run(
        "2:stall:5",
        "3",
        &["timed out after 3s", "with rank 2", "aborts the MPI job"],
        Duration::from_secs(60),
    );
}

#[test]
fn a_world_size_that_disagrees_with_the_job_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, _) = inputs(dir.path(), DType::F32);
    let out = dir.path().join("out.safetensors");
    let r = mpirun(
        2,
        &["run", "--comm", "mpi", "--strategy", "ring", "--world", "3", "--input", s(&input), "--output", s(&out)],
    );
    assert!(!r.status.success());
    assert!(text(&r).contains("--world 3, but the job has 2 ranks"), "{}", text(&r));
    assert!(!out.exists());
}

/// The collectives' check (examples/collectives.rs, MPI's native collectives behind the
/// Communicator trait) on 4 processes: rank-order sums bit-identical everywhere, every root,
/// uneven gathers and all-to-alls, a length mismatch the same error on every rank.
#[test]
fn the_collectives_hold_across_four_processes() {
    let example = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent().map(|d| d.join("examples").join("collectives")))
        .filter(|p| p.exists())
        .expect("examples/collectives is built first: `cargo build --features mpi --example collectives` (scripts/test.sh does)");
    let launcher = std::env::var("RINGATTN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let r = Command::new(&launcher)
        .args(["-n", "4", s(&example)])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .expect("run mpirun");
    let out = text(&r);
    assert!(r.status.success(), "{out}");
    for needle in ["ok all_reduce f32 x262144", "ok broadcast from each of 4 roots", "ok all_to_all_v", "ok 4 ranks"] {
        assert!(out.contains(needle), "missing `{needle}` in\n{out}");
    }
}
