//! The multi-process GPU paths on the emulated GPU (emulated-gpu/: the stand-in libcuda.so.1
//! and libnccl.so.2 of this repository, whose kernels run on the host emulator): `ringattn run
//! --comm nccl --backend cuda` over 2 and 4 processes under mpirun and under a torchrun-style
//! environment, against the float64 oracle; an NCCL peer that never posts its matching call
//! ends the job in ringattn's own deadline error, within the deadline, never a hang.
//!
//! Runs where `RINGATTN_EMULATED_GPU_LIB` names the folder of the stand-in's libraries
//! (`scripts/test.sh` sets it to what `scripts/with-emulated-gpu` builds); skipped, visibly,
//! elsewhere.
#![cfg(all(feature = "cuda", feature = "mpi"))]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ringattn::cpu::{ForwardOutput, Gradients};
use ringattn::{io, random::randn, verify, AttentionParams, DType, Mask, Tensor};

fn stand_in(test: &str) -> Option<PathBuf> {
    match std::env::var_os("RINGATTN_EMULATED_GPU_LIB") {
        Some(p) if Path::new(&p).join("libcuda.so.1").exists() => Some(PathBuf::from(p)),
        _ => {
            eprintln!("SKIPPED {test}: RINGATTN_EMULATED_GPU_LIB does not name the stand-in's folder (scripts/test.sh sets it)");
            None
        }
    }
}

fn library_path(lib: &Path) -> String {
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", lib.display()),
        _ => lib.display().to_string(),
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// q, k, v, do in bf16 (the kernels' input), 75 tokens (uneven over 2 and 4 ranks), GQA 4:2.
fn inputs(dir: &Path) -> (PathBuf, [Tensor; 4]) {
    let q = randn(vec![1, 75, 4, 32], 21, DType::BF16);
    let k = randn(vec![1, 75, 2, 32], 22, DType::BF16);
    let v = randn(vec![1, 75, 2, 32], 23, DType::BF16);
    let d_o = randn(vec![1, 75, 4, 32], 24, DType::BF16);
    let path = dir.join("in.safetensors");
    io::write_tensors(&path, &[("q", &q), ("k", &k), ("v", &v), ("do", &d_o)]).expect("write inputs");
    (path, [q, k, v, d_o])
}

fn check(out: &Path, x: &[Tensor; 4], causal: bool, what: &str) {
    let mut t = io::read_tensors(out).unwrap_or_else(|e| panic!("{what}: read outputs: {e}"));
    let mut take = |n: &str| t.remove(n).unwrap_or_else(|| panic!("{what}: output lacks {n}"));
    let f = ForwardOutput { o: take("o"), lse: take("lse") };
    let g = Gradients { dq: take("dq"), dk: take("dk"), dv: take("dv"), dsinks: t.remove("dsinks") };
    let attention = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
    let [q, k, v, d_o] = x;
    let report = verify::check_results(q, k, v, Some(d_o), None, &attention, &f, Some(&g)).expect("oracle check");
    assert!(report.pass(), "{what}:\n{}", report.table());
}

fn mpirun(lib: &Path, ranks: usize, args: &[&str]) -> Output {
    let launcher = std::env::var("RINGATTN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    Command::new(&launcher)
        .args(["-n", &ranks.to_string(), "-x", "LD_LIBRARY_PATH", env!("CARGO_BIN_EXE_ringattn")])
        .args(args)
        .env("LD_LIBRARY_PATH", library_path(lib))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot start `{launcher}` ({e}): install Open MPI (scripts/test.sh does)"))
}

/// `ringattn run --comm nccl --backend cuda --strategy STRATEGY --timeout SECS` on `input`
/// into `out`, then `extra`.
fn nccl_run<'a>(
    strategy: &'a str,
    timeout: &'a str,
    input: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec!["run", "--comm", "nccl", "--backend", "cuda", "--strategy", strategy, "--timeout", timeout];
    args.extend(["--input", s(input), "--output", s(out)]);
    args.extend(extra);
    args
}

#[test]
fn nccl_over_two_and_four_processes_matches_the_oracle() {
    let Some(lib) = stand_in("nccl_over_two_and_four_processes_matches_the_oracle") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, x) = inputs(dir.path());
    for (ranks, strategy, extra, causal) in [
        (2, "ring", &[][..], true),
        (4, "ring", &[][..], false),
        (4, "allgather", &[][..], true),
        (4, "ulysses", &[][..], true),
        (4, "usp", &["--ulysses-degree", "2"][..], true),
    ] {
        let out = dir.path().join(format!("out-{ranks}-{strategy}.safetensors"));
        let mut args = nccl_run(strategy, "120", &input, &out, extra);
        if causal {
            args.push("--causal");
        }
        let r = mpirun(&lib, ranks, &args);
        let what = format!("{strategy} over {ranks} processes (NCCL)");
        assert!(r.status.success(), "{what}: {}", text(&r));
        check(&out, &x, causal, &what);
    }
}

/// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), the
/// processes started by hand as torchrun starts them; the unique id over ringattn's TCP
/// bootstrap.
#[test]
fn a_torchrun_style_launch_runs_over_nccl() {
    let Some(lib) = stand_in("a_torchrun_style_launch_runs_over_nccl") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, x) = inputs(dir.path());
    let out = dir.path().join("out.safetensors");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap();
    let world = 2;
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_ringattn"))
                .args(nccl_run("ring", "120", &input, &out, &["--causal"]))
                .env("LD_LIBRARY_PATH", library_path(&lib))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RINGATTN_BOOTSTRAP_PORT", (port + 1).to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    for (rank, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().expect("wait for a rank");
        assert!(o.status.success(), "rank {rank}: {}", text(&o));
    }
    check(&out, &x, true, "ring over 2 torchrun-style processes");
}

/// A rank that stops answering (`--fault 1:stall:3`: from its third send on it posts nothing):
/// the others end in ringattn's deadline error within the deadline (5 s here), the job exits
/// non-zero and writes no output.
#[test]
fn an_nccl_peer_that_never_posts_ends_in_the_deadline_error() {
    let Some(lib) = stand_in("an_nccl_peer_that_never_posts_ends_in_the_deadline_error") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let (input, _) = inputs(dir.path());
    let out = dir.path().join("out.safetensors");
    let t0 = Instant::now();
    let r = mpirun(&lib, 2, &nccl_run("ring", "5", &input, &out, &["--fault", "1:stall:3"]));
    let took = t0.elapsed();
    let log = text(&r);
    assert!(!r.status.success(), "a stalled rank must fail the job: {log}");
    assert!(took < Duration::from_secs(60), "the job took {took:?}: the deadline is 5 s\n{log}");
    assert!(log.contains("timed out after 5s"), "ringattn's deadline error: {log}");
    assert!(!out.exists(), "no output from a failed job");
}
