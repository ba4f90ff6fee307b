//! The command-line contract: round trips through files, and every bad input exits non-zero
//! with a one-line message and leaves no output file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ringattn::{cpu, io, random::randn, AttentionParams, DType, Documents, Mask, Tensor};

fn ringattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringattn")).args(args).output().expect("run ringattn")
}

fn write_inputs(dir: &Path, name: &str, dt: DType, with_do: bool) -> (PathBuf, [Tensor; 4]) {
    let q = randn(vec![2, 37, 4, 16], 1, dt);
    let k = randn(vec![2, 37, 2, 16], 2, dt);
    let v = randn(vec![2, 37, 2, 16], 3, dt);
    let d_o = randn(vec![2, 37, 4, 16], 4, dt);
    let path = dir.join(name);
    let mut named = vec![("q", &q), ("k", &k), ("v", &v)];
    if with_do {
        named.push(("do", &d_o));
    }
    io::write_tensors(&path, &named).unwrap();
    (path, [q, k, v, d_o])
}

/// The outputs a run wrote to `path`: `o`, `lse`, and the gradients (`dsinks` when written).
fn outputs(path: &Path) -> (cpu::ForwardOutput, cpu::Gradients) {
    let got = io::read_tensors(path).unwrap();
    let fwd = cpu::ForwardOutput { o: got["o"].clone(), lse: got["lse"].clone() };
    let grads = cpu::Gradients {
        dq: got["dq"].clone(),
        dk: got["dk"].clone(),
        dv: got["dv"].clone(),
        dsinks: got.get("dsinks").cloned(),
    };
    (fwd, grads)
}

/// Adds a `sinks` tensor to the input file at `path`.
fn add_sinks(path: &Path, sinks: &Tensor) {
    let mut all = io::read_tensors(path).unwrap();
    all.insert("sinks".into(), sinks.clone());
    let named: Vec<(&str, &Tensor)> = all.iter().map(|(n, t)| (n.as_str(), t)).collect();
    io::write_tensors(path, &named).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Files in `dir` other than `keep`.
fn others(dir: &Path, keep: &[&Path]) -> Vec<PathBuf> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| !keep.iter().any(|k| k == p)).collect()
}

#[test]
fn run_forward_round_trip_matches_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let (input, [q, k, v, _]) = write_inputs(dir.path(), "in.safetensors", DType::BF16, false);
    let out = dir.path().join("out.safetensors");
    let r = ringattn(&["run", "--input", s(&input), "--output", s(&out), "--causal", "--window", "5,-1"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got = io::read_tensors(&out).unwrap();
    let p = AttentionParams { mask: Mask::Window { left: Some(5), right: Some(0) }, ..Default::default() };
    let want = cpu::forward(&q, &k, &v, &p).unwrap();
    assert_eq!(got["o"], want.o);
    assert_eq!(got["lse"], want.lse);
    assert_eq!(got["o"].dtype(), DType::BF16);
    assert!(!got.contains_key("dq"));
}

#[test]
fn run_with_do_writes_gradients() {
    let dir = tempfile::tempdir().unwrap();
    let (input, [q, k, v, d_o]) = write_inputs(dir.path(), "in.safetensors", DType::F32, true);
    let out = dir.path().join("out.safetensors");
    let r = ringattn(&["run", "--input", s(&input), "--output", s(&out), "--seqlens", "17,20", "--scale", "0.2"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let got = io::read_tensors(&out).unwrap();
    let p = AttentionParams {
        documents: Some(Documents::new(vec![17, 20]).unwrap()),
        scale: Some(0.2),
        ..Default::default()
    };
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    let g = cpu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, &p).unwrap();
    assert_eq!(got["dq"], g.dq);
    assert_eq!(got["dk"], g.dk);
    assert_eq!(got["dv"], g.dv);
    assert_eq!(others(dir.path(), &[&input, &out]), Vec::<PathBuf>::new(), "no temporary files left");
}

#[test]
fn bad_inputs_fail_cleanly_and_leave_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let (input, [q, ..]) = write_inputs(dir.path(), "in.safetensors", DType::F32, false);
    let bad_heads = dir.path().join("heads.safetensors");
    let k3 = randn(vec![2, 37, 3, 16], 5, DType::F32);
    io::write_tensors(&bad_heads, &[("q", &q), ("k", &k3), ("v", &k3)]).unwrap();
    let no_v = dir.path().join("nov.safetensors");
    io::write_tensors(&no_v, &[("q", &q), ("k", &q)]).unwrap();
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}").unwrap();
    let out = dir.path().join("out.safetensors");
    let missing = dir.path().join("missing.safetensors");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--input", s(&missing)], "missing.safetensors"),
        (vec!["--input", s(&junk)], "malformed"),
        (vec!["--input", s(&no_v)], "missing tensor `v`"),
        (vec!["--input", s(&bad_heads)], "h_kv = 3"),
        (vec!["--input", s(&input), "--strategy", "spiral"], "unknown strategy `spiral`"),
        (vec!["--input", s(&input), "--strategy", "usp", "--world", "2", "--layout", "striped"], "striped"),
        (vec!["--input", s(&input), "--strategy", "ring", "--layout", "diagonal"], "unknown layout `diagonal`"),
        (vec!["--input", s(&input), "--strategy", "ulysses", "--world", "3"], "h_q = 4"),
        (vec!["--input", s(&input), "--backend", "tpu"], "unknown backend `tpu`"),
        (vec!["--input", s(&input), "--backend", "emu"], "does not support f32 inputs"),
        (vec!["--input", s(&input), "--world", "4"], "--world 4"),
        (vec!["--input", s(&input), "--window", "-3,2"], "left side -3"),
        (vec!["--input", s(&input), "--window", "4"], "expected two values"),
        (vec!["--input", s(&input), "--seqlens", "10,10"], "sum to 20"),
        (vec!["--input", s(&input), "--seqlens", "10,x"], "`x`"),
    ];
    for (args, needle) in cases {
        let mut all = vec!["run", "--output", s(&out)];
        all.extend(args.iter());
        let r = ringattn(&all);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{all:?} succeeded");
        assert!(err.contains(needle), "{all:?}: `{err}` lacks `{needle}`");
        assert_eq!(err.trim_end().lines().count(), 1, "{all:?}: message is one line: {err}");
        assert!(!out.exists(), "{all:?} left an output file");
    }
    assert_eq!(others(dir.path(), &[&input, &bad_heads, &no_v, &junk]), Vec::<PathBuf>::new());
}

/// Attention sinks through the files: `sinks` `[h_q]` read from the input, `dsinks` written
/// beside the gradients; single device and every strategy of the CPU backend, and the
/// emulated kernels, against the oracle; `verify --input` takes them too; sinks of another
/// count are refused naming them, writing nothing.
#[test]
fn run_reads_sinks_and_writes_their_gradient() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let sinks = Tensor::from_f32(vec![4], vec![1.0, 3.5, -1.0, 2.0]).unwrap();
    for (dt, backend) in [(DType::F32, "cpu"), (DType::BF16, "emu")] {
        let (input, [q, k, v, d_o]) = write_inputs(dir.path(), "in.safetensors", dt, true);
        add_sinks(&input, &sinks);
        let p = AttentionParams { mask: Mask::Causal, sinks: Some(sinks.to_f32_vec()), ..Default::default() };
        let strategies: &[&[&str]] =
            &[&[], &["--strategy", "ring", "--world", "3"], &["--strategy", "ulysses", "--world", "2"]];
        for extra in strategies {
            let mut args = vec!["run", "--backend", backend, "--input", s(&input), "--output", s(&out), "--causal"];
            args.extend(extra.iter());
            let r = ringattn(&args);
            assert!(r.status.success(), "{args:?}: {}", String::from_utf8_lossy(&r.stderr));
            let (fwd, grads) = outputs(&out);
            assert_eq!(grads.dsinks.as_ref().map(|t| t.shape().to_vec()), Some(vec![4]), "{args:?}");
            let report = ringattn::verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &fwd, Some(&grads)).unwrap();
            assert!(report.pass() && report.rows.len() == 6, "{args:?}\n{}", report.table());
        }
        let r = ringattn(&["verify", "--backend", backend, "--input", s(&input), "--causal"]);
        let text = String::from_utf8_lossy(&r.stdout);
        assert!(r.status.success() && text.contains("sinks [1.0, 3.5") && text.contains("dsinks"), "{text}");
    }
    // Three sinks for four query heads.
    let (input, _) = write_inputs(dir.path(), "bad.safetensors", DType::F32, true);
    add_sinks(&input, &Tensor::from_f32(vec![3], vec![0.0; 3]).unwrap());
    std::fs::remove_file(&out).unwrap();
    for extra in [&[][..], &["--strategy", "ring", "--world", "2"][..]] {
        let mut args = vec!["run", "--input", s(&input), "--output", s(&out)];
        args.extend(extra);
        let r = ringattn(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success() && err.contains("sinks holds 3 values"), "{args:?}: {err}");
        assert!(!out.exists(), "{args:?} left an output file");
    }
}

/// `ringattn run --backend emu`: the CUDA kernels under the emulator, single device and
/// ring, forward and backward, checked against the oracle.
#[test]
fn run_on_the_emulated_kernels_matches_the_oracle() {
    let dir = tempfile::tempdir().unwrap();
    for dt in [DType::BF16, DType::F16] {
        let (input, [q, k, v, d_o]) = write_inputs(dir.path(), "in.safetensors", dt, true);
        let out = dir.path().join("out.safetensors");
        for extra in [&[][..], &["--strategy", "ring", "--world", "3"][..]] {
            let mut args = vec!["run", "--backend", "emu", "--input", s(&input), "--output", s(&out), "--causal"];
            args.extend(extra);
            let r = ringattn(&args);
            assert!(r.status.success(), "{args:?}: {}", String::from_utf8_lossy(&r.stderr));
            let (fwd, grads) = outputs(&out);
            let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
            assert_eq!(fwd.o.dtype(), dt);
            let report = ringattn::verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &fwd, Some(&grads)).unwrap();
            assert!(report.pass(), "{args:?}\n{}", report.table());
        }
    }
    let r = ringattn(&["verify", "--backend", "emu", "--shape", "1,50,2,1,32", "--window", "7,3"]);
    let text = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && text.contains("backend emu") && text.contains("BF16"), "{text}");
}

#[test]
fn parallel_strategies_round_trip_in_original_token_order() {
    let dir = tempfile::tempdir().unwrap();
    let (input, [q, k, v, d_o]) = write_inputs(dir.path(), "in.safetensors", DType::F32, true);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    let g = cpu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, &p).unwrap();
    for (strategy, world) in [("ring", "3"), ("allgather", "2"), ("ulysses", "4"), ("usp", "4")] {
        let out = dir.path().join(format!("{strategy}.safetensors"));
        let r = ringattn(&[
            "run",
            "--input",
            s(&input),
            "--output",
            s(&out),
            "--causal",
            "--strategy",
            strategy,
            "--world",
            world,
        ]);
        assert!(r.status.success(), "{strategy}: {}", String::from_utf8_lossy(&r.stderr));
        let got = io::read_tensors(&out).unwrap();
        for (name, want) in [("o", &f.o), ("lse", &f.lse), ("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)] {
            let w64: Vec<f64> = want.as_f32().iter().map(|&x| x as f64).collect();
            let e = ringattn::verify::rel_err(&got[name].to_f32_vec(), &w64);
            assert!(e < 1e-5, "{strategy} {name}: {e}");
        }
    }
}

#[test]
fn a_failed_run_keeps_an_existing_output_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    std::fs::write(&out, b"previous results").unwrap();
    let r = ringattn(&["run", "--input", s(&dir.path().join("missing")), "--output", s(&out)]);
    assert!(!r.status.success());
    assert_eq!(std::fs::read(&out).unwrap(), b"previous results");
}

#[test]
fn verify_passes_on_random_and_file_inputs() {
    let r = ringattn(&["verify", "--shape", "1,70,4,1,32", "--dtype", "f16", "--causal"]);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{stdout}");
    for name in ["o ", "lse", "dq", "dk", "dv"] {
        assert!(stdout.lines().any(|l| l.starts_with(name) && l.ends_with("pass")), "{name}: {stdout}");
    }
    let dir = tempfile::tempdir().unwrap();
    let (input, _) = write_inputs(dir.path(), "in.safetensors", DType::BF16, true);
    let json = dir.path().join("report.json");
    let r = ringattn(&["verify", "--input", s(&input), "--window", "3,3", "--json", s(&json)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stdout));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["dtype"], "BF16");
    assert_eq!(report["rows"].as_array().unwrap().len(), 5);
}

/// `--kernels hopper`: the Hopper forward under the emulator, single device and a ring (verify
/// checks it against the oracle), and bench; an unknown family, or one the cpu backend does
/// not have, fails naming it.
#[test]
fn the_kernel_family_is_chosen_on_the_command_line() {
    for strategy in [&["--strategy", "single"][..], &["--strategy", "ring", "--world", "3"][..]] {
        let mut args = vec!["verify", "--backend", "emu", "--kernels", "hopper", "--shape", "1,150,2,1,64", "--causal"];
        args.extend(strategy);
        let r = ringattn(&args);
        assert!(
            r.status.success(),
            "{strategy:?}: {}{}",
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
    }
    let r = ringattn(&[
        "bench",
        "--backend",
        "emu",
        "--kernels",
        "hopper",
        "--seq",
        "130",
        "--heads",
        "1",
        "--head-dim",
        "64",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--pass",
        "forward",
    ]);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{stdout}{}", String::from_utf8_lossy(&r.stderr));
    for (args, want) in [
        (&["verify", "--kernels", "hopper", "--shape", "1,20,1,1,16"][..], "not cpu"),
        (&["verify", "--backend", "emu", "--kernels", "fa3", "--shape", "1,20,1,1,16"][..], "--kernels `fa3`"),
    ] {
        let r = ringattn(args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success() && err.contains(want), "{args:?}: {err}");
    }
}

/// `--cpu-arithmetic`: both paths verify on bf16 inputs, single-device and on a ring; asking
/// for bf16 products on f32 inputs, or for an unknown arithmetic, fails naming the value.
#[test]
fn cpu_arithmetic_is_chosen_on_the_command_line() {
    for arithmetic in ["auto", "f32"] {
        for strategy in [&["--strategy", "single"][..], &["--strategy", "ring", "--world", "3"][..]] {
            let mut args = vec!["verify", "--shape", "1,90,4,2,48", "--dtype", "bf16", "--causal"];
            args.extend(["--cpu-arithmetic", arithmetic]);
            args.extend(strategy);
            let r = ringattn(&args);
            assert!(r.status.success(), "{arithmetic} {strategy:?}: {}", String::from_utf8_lossy(&r.stdout));
        }
    }
    let r = ringattn(&["verify", "--shape", "1,20,1,1,16", "--dtype", "f32", "--cpu-arithmetic", "bf16"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("F32"), "{err}");
    let r = ringattn(&["verify", "--shape", "1,20,1,1,16", "--cpu-arithmetic", "fp8"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("fp8"), "{err}");
}

/// `--cpu-matrix-unit`: `vector` verifies (bf16 and f32 products, single-device and on a
/// ring, the tiles left out where the processor has them); where no CPU product runs it is
/// refused, not dropped; an unknown unit is named.
#[test]
fn cpu_matrix_unit_is_chosen_on_the_command_line() {
    for strategy in [&["--strategy", "single"][..], &["--strategy", "ring", "--world", "3"][..]] {
        for dtype in [&["--dtype", "bf16"][..], &["--dtype", "f32"], &["--dtype", "bf16", "--cpu-arithmetic", "f32"]] {
            let mut args = vec!["verify", "--shape", "1,90,4,2,48", "--causal"];
            args.extend(dtype);
            args.extend(["--cpu-matrix-unit", "vector"]);
            args.extend(strategy);
            let r = ringattn(&args);
            assert!(r.status.success(), "{strategy:?} {dtype:?}: {}", String::from_utf8_lossy(&r.stdout));
        }
    }
    for refused in [&["--backend", "emu", "--cpu-matrix-unit", "vector"][..], &["--cpu-matrix-unit", "tiles"][..]] {
        let mut args = vec!["verify", "--shape", "1,20,1,1,16", "--dtype", "bf16"];
        args.extend(refused);
        let r = ringattn(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success() && (err.contains("--cpu-matrix-unit") || err.contains("`tiles`")),
            "{refused:?}: {err}"
        );
    }
}

#[test]
fn demo_runs_small() {
    let r = ringattn(&["demo", "--seq", "600", "--heads", "2", "--kv-heads", "1", "--head-dim", "32"]);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{stdout}");
    assert!(stdout.contains("TFLOP/s") && stdout.contains("demo passed"), "{stdout}");
}

#[test]
fn help_reads_well() {
    let r = ringattn(&["--help"]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success());
    for cmd in ["run", "verify", "demo"] {
        assert!(out.contains(cmd), "{out}");
    }
    let r = ringattn(&["run", "--help"]);
    assert!(String::from_utf8_lossy(&r.stdout).contains("--window <L,R>"));
}

/// `--backend cuda`: on a build without the `cuda` feature, or on a machine without a driver
/// or GPU, a one-line error and no output file; with a GPU, results that pass the oracle.
#[test]
fn run_on_the_cuda_backend_fails_cleanly_without_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let (input, [q, k, v, d_o]) = write_inputs(dir.path(), "in.safetensors", DType::BF16, true);
    let out = dir.path().join("out.safetensors");
    let r = ringattn(&["run", "--backend", "cuda", "--input", s(&input), "--output", s(&out), "--causal"]);
    let err = String::from_utf8_lossy(&r.stderr);
    if r.status.success() {
        let (fwd, grads) = outputs(&out);
        let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let report = ringattn::verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &fwd, Some(&grads)).unwrap();
        assert!(report.pass(), "{}", report.table());
        return;
    }
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(
        err.contains("this build lacks the `cuda` feature (cargo build --features cuda)")
            || err.contains("no CUDA driver found")
            || err.contains("no CUDA GPU found"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!out.exists());
    assert_eq!(others(dir.path(), &[&input]), Vec::<PathBuf>::new(), "no temporary files left");
}

/// `ringattn bench`: one line per pass and the JSON the device-check scripts read.
#[test]
fn bench_times_the_cpu_backend_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let r = ringattn(&[
        "bench",
        "--backend",
        "cpu",
        "--seq",
        "256",
        "--heads",
        "2",
        "--head-dim",
        "32",
        "--dtype",
        "f32",
        "--iters",
        "2",
        "--json",
        s(&json),
    ]);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{stdout}{}", String::from_utf8_lossy(&r.stderr));
    for pass in ["forward", "backward"] {
        assert!(stdout.lines().any(|l| l.starts_with(pass) && l.contains("ms") && l.ends_with("TFLOP/s")), "{stdout}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["backend"], "cpu");
    assert_eq!(report["device"], "cpu");
    assert_eq!(report["dtype"], "f32");
    for (key, want) in [("b", 1), ("s", 256), ("h_q", 2), ("h_kv", 2), ("d", 32)] {
        assert_eq!(report[key], want, "{key}");
    }
    assert_eq!(report["causal"], false);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.iter().map(|r| r["pass"].as_str().unwrap()).collect::<Vec<_>>(), ["forward", "backward"]);
    for r in results {
        let samples = r["samples_ms"].as_array().unwrap();
        assert_eq!(samples.len(), 2);
        let (median, min, tflops) =
            (r["median_ms"].as_f64().unwrap(), r["min_ms"].as_f64().unwrap(), r["tflops"].as_f64().unwrap());
        assert!(min > 0.0 && min <= median && tflops > 0.0, "{r}");
        assert!(samples.iter().all(|x| x.as_f64().unwrap() >= min));
    }
    assert_eq!(others(dir.path(), &[&json]), Vec::<PathBuf>::new());

    // One pass, causal, GQA; bad arguments fail with one line and write nothing.
    let r = ringattn(&[
        "bench",
        "--seq",
        "100",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--causal",
        "--pass",
        "forward",
        "--warmup",
        "0",
        "--iters",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success() && stdout.contains("causal") && !stdout.contains("backward"), "{stdout}");
    let bad = dir.path().join("bad.json");
    for (args, needle) in [
        (&["--pass", "sideways"][..], "--pass `sideways`"),
        (&["--iters", "0"][..], "--iters"),
        (&["--heads", "3", "--kv-heads", "2"][..], "h_kv = 2"),
        (&["--backend", "tpu"][..], "unknown backend `tpu`"),
        (&["--backend", "emu", "--dtype", "f32"][..], "f32"),
    ] {
        let mut all = vec!["bench", "--seq", "16", "--head-dim", "16", "--json", s(&bad)];
        all.extend(args);
        let r = ringattn(&all);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{all:?}: {err}");
        assert!(err.contains(needle), "{all:?}: `{err}` lacks `{needle}`");
        assert_eq!(err.trim_end().lines().count(), 1, "{all:?}: {err}");
        assert!(!bad.exists());
    }
}

#[test]
fn bench_sweeps_write_a_table_json_csv_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let r = ringattn(&[
        "bench",
        "--seq",
        "64,128",
        "--world",
        "1,2",
        "--strategies",
        "ring,ulysses",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--causal",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--out",
        s(&out),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let table = String::from_utf8_lossy(&r.stdout);
    assert!(table.contains("ulysses") && table.contains("hidden"), "{table}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("bench.json")).unwrap()).expect("bench.json parses");
    // 2 lengths × (single + ring + ulysses at 2 ranks)
    assert_eq!(json["records"].as_array().map(Vec::len), Some(6));
    assert_eq!(std::fs::read_to_string(out.join("bench.csv")).unwrap().lines().count(), 7);
    for f in ["throughput.png", "throughput.svg", "hidden.png", "hidden.svg"] {
        assert!(std::fs::metadata(out.join(f)).map(|m| m.len() > 1000).unwrap_or(false), "{f} missing or empty");
    }
    // A bad list is refused with the option named.
    let r = ringattn(&["bench", "--seq", "64,x", "--out", s(&out)]);
    assert!(!r.status.success() && String::from_utf8_lossy(&r.stderr).contains("--seq"));
}

#[test]
fn pingpong_measures_the_in_process_link() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("pp.json");
    let r = ringattn(&["pingpong", "--sizes", "4,4096,65536", "--reps", "3", "--json", s(&json)]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let text = std::fs::read_to_string(&json).unwrap();
    let pp = ringattn::plan::PingPong::from_json(&text).expect("the plan reads it");
    assert_eq!(pp.samples.len(), 3);
    let r = ringattn(&["pingpong", "--sizes", "5"]);
    assert!(!r.status.success() && String::from_utf8_lossy(&r.stderr).contains("multiple of 4"));
}

/// A 4-rank ring forward in bf16 sends exactly half the bytes of the same run in f32: K and V
/// travel in the input dtype (`--stats` counts every rank's bytes), and `o` comes back in it.
#[test]
fn a_bf16_ring_sends_half_the_bytes_of_an_f32_ring() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let (input, _) = write_inputs(dir.path(), &format!("in-{dt}.safetensors"), dt, true);
        let out = dir.path().join(format!("out-{dt}.safetensors"));
        let stats = dir.path().join(format!("stats-{dt}.json"));
        let args = ["run", "--input", s(&input), "--output", s(&out), "--strategy", "ring", "--world", "4"];
        let o = ringattn(&[&args[..], &["--causal", "--stats", s(&stats)]].concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        let ranks = json["ranks"].as_array().expect("ranks");
        let sum = |pass: &str| ranks.iter().map(|r| r[pass]["bytes_sent"].as_u64().expect("bytes_sent")).sum::<u64>();
        bytes.push((sum("forward"), sum("backward")));
        let outputs = io::read_tensors(&out).unwrap();
        assert_eq!(outputs["o"].dtype(), dt);
        assert_eq!(outputs["dq"].dtype(), dt);
    }
    let ((f32_fwd, f32_bwd), (bf16_fwd, bf16_bwd)) = (bytes[0], bytes[1]);
    assert!(f32_fwd > 0);
    assert_eq!(bf16_fwd * 2, f32_fwd, "forward bytes: bf16 {bf16_fwd}, f32 {f32_fwd}");
    // Backward: K/V in bf16, the dK/dV accumulators in f32 either way.
    assert!(bf16_bwd < f32_bwd, "backward bytes: bf16 {bf16_bwd}, f32 {f32_bwd}");
}

/// `ringattn run` takes a `v` whose head dim differs from `q`'s (multi-head latent
/// attention): `o` and `dv` have v's, `dq` and `dk` q's; single device and a ring, against
/// the library.
#[test]
fn run_reads_a_v_of_its_own_head_dim() {
    let dir = tempfile::tempdir().unwrap();
    let q = randn(vec![1, 40, 4, 24], 1, DType::F32);
    let k = randn(vec![1, 40, 2, 24], 2, DType::F32);
    let v = randn(vec![1, 40, 2, 16], 3, DType::F32);
    let d_o = randn(vec![1, 40, 4, 16], 4, DType::F32);
    let input = dir.path().join("mla.safetensors");
    io::write_tensors(&input, &[("q", &q), ("k", &k), ("v", &v), ("do", &d_o)]).unwrap();
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    let g = cpu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, &p).unwrap();
    for extra in [&[][..], &["--strategy", "ring", "--world", "3"][..]] {
        let out = dir.path().join("out.safetensors");
        let mut args = vec!["run", "--input", s(&input), "--output", s(&out), "--causal"];
        args.extend_from_slice(extra);
        let r = ringattn(&args);
        assert!(r.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&r.stderr));
        let got = io::read_tensors(&out).unwrap();
        assert_eq!(got["o"].shape(), [1, 40, 4, 16]);
        assert_eq!((got["dq"].shape(), got["dk"].shape(), got["dv"].shape()), (q.shape(), k.shape(), v.shape()));
        for (name, want) in [("o", &f.o), ("lse", &f.lse), ("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)] {
            let w64: Vec<f64> = want.as_f32().iter().map(|&x| x as f64).collect();
            let e = ringattn::verify::rel_err(&got[name].to_f32_vec(), &w64);
            assert!(e < 1e-5, "{extra:?} {name}: {e}");
        }
    }
}

/// `bench --docs`: packed-document batches per layout (imbalance, bytes against the pass-along
/// ring, JSON); the options it cannot honour are refused by name.
#[test]
fn bench_docs_reports_layouts_and_refuses_what_it_cannot_honour() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("docs.json");
    let args = ["bench", "--docs", "300,90,40", "--seq", "512", "--world", "2", "--causal", "--doc-seeds", "1"];
    let shape = ["--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--batch", "2", "--iters", "1", "--warmup", "0"];
    let out = ringattn(&[&args[..], &shape[..], &["--json", s(&json)]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "zigzag and balanced");
    let balanced = rows.iter().find(|r| r["layout"] == "balanced").unwrap();
    assert!(balanced["imbalance"].as_f64().unwrap() <= 1.05);
    let (sent, pass) = (balanced["bytes_sent"].as_u64().unwrap(), balanced["pass_along_bytes"].as_u64().unwrap());
    assert!(sent > 0 && sent < pass, "{sent} vs {pass}");
    for (flag, value) in [("--backend", "emu"), ("--pass", "forward"), ("--seqlens", "512")] {
        let out = ringattn(&[&args[..], &shape[..], &[flag, value]].concat());
        assert!(!out.status.success(), "{flag} {value} ran");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = ringattn(&["bench", "--comm", "mpi", "--seq", "64", "--iters", "1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--comm"));
}

#[test]
fn auto_is_resolved_per_batch_and_predicted() {
    // bench --docs with auto: one more row, the choice named, every row with the model's time.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("auto.json");
    let out = ringattn(&[
        "bench",
        "--docs",
        "300,90,40",
        "--seq",
        "512",
        "--world",
        "2",
        "--causal",
        "--doc-seeds",
        "1",
        "--heads",
        "2",
        "--head-dim",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--strategies",
        "ring,auto",
        "--json",
        s(&json),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3, "ring zigzag, ring balanced, auto");
    assert!(rows.iter().all(|r| r["predicted_s"].as_f64().unwrap() > 0.0));
    let auto = rows.iter().find(|r| r["strategy"] == "auto").unwrap();
    assert!(auto["choice"].as_str().unwrap().contains("×"), "{auto}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("auto ("));
    // --calibration belongs to --docs runs.
    let out = ringattn(&["bench", "--seq", "64", "--iters", "1", "--calibration", "x.json"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--calibration"));

    // plan --seqlens: the ranking of one batch and auto's pick.
    let out = ringattn(&[
        "plan",
        "--gpus",
        "4",
        "--seqlens",
        "6000,300,900,1200,500,3100",
        "--heads",
        "8",
        "--head-dim",
        "64",
        "--causal",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("auto: ") && text.contains("balanced") && text.contains("imbalance"), "{text}");
    // --seqlens must agree with --seq; one of them is needed.
    let out = ringattn(&["plan", "--gpus", "2", "--seqlens", "100,28", "--seq", "64"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--seqlens"));
    assert!(!ringattn(&["plan", "--gpus", "2"]).status.success());

    // simulate --docs: the zigzag and balanced rings and auto per cell.
    let out = ringattn(&[
        "simulate",
        "--docs",
        "lognormal",
        "--doc-seeds",
        "2",
        "--gpus",
        "2,4",
        "--seq",
        "8k",
        "--heads",
        "8",
        "--head-dim",
        "64",
        "--causal",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("balanced ring ms") && text.lines().filter(|l| l.trim_start().starts_with('4')).count() == 1,
        "{text}"
    );
}
