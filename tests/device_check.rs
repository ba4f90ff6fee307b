//! `scripts/device-check.sh` (the one run on a lent GPU) on this build's
//! binary, on a machine without a GPU. It must never waste device minutes:
//! - a build without the `cuda` feature (or with it but without kernels: no nvcc at build
//!   time) is refused at step 0: exit 3, one `device-check: refused: ...` line,
//!   `device-check.json` with the reason, no other step, in seconds;
//! - a `cuda` build on a machine without a GPU (or driver) runs every step, each GPU step
//!   failing fast with the binary's `no CUDA ...` message (torch's: not installed / no CUDA
//!   device), writes the JSON and prints the tables: exit 4, in well under a minute.
//!
//! The test builds nothing: it runs the binary cargo built for it. Skipped (with a
//! `SKIPPED:` line) where a GPU is present (the real check takes minutes) and where bash,
//! coreutils `timeout` or python3 are missing.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_ringattn");

fn tool_works(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd).args(args).output().is_ok_and(|o| o.status.success())
}

/// A GPU is visible: device nodes, `nvidia-smi -L`, or the binary's own `doctor` listing one.
fn gpu_present() -> bool {
    if Path::new("/dev/nvidiactl").exists() || Path::new("/dev/nvidia0").exists() {
        return true;
    }
    if tool_works("nvidia-smi", &["-L"]) {
        return true;
    }
    Command::new(EXE)
        .args(["doctor", "--json"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .and_then(|v| v["gpus"].as_array().map(|g| !g.is_empty()))
        .unwrap_or(false)
}

struct Run {
    output: Output,
    text: String,
    json: Value,
    elapsed: Duration,
}

/// `bash scripts/device-check.sh --bin EXE` (quick mode) with OUT and TMPDIR in a temp dir,
/// under a 120 s `timeout` so a regression cannot hang the suite.
fn device_check(dir: &Path) -> Run {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/device-check.sh");
    let start = Instant::now();
    let output = Command::new("timeout")
        .args(["-k", "5", "120", "bash"])
        .arg(&script)
        .args(["--bin", EXE])
        .env("OUT", dir)
        .env("TMPDIR", dir)
        .env_remove("PYTHON")
        .output()
        .expect("run bash scripts/device-check.sh");
    let elapsed = start.elapsed();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    let path = dir.join("device-check.json");
    let json = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| panic!("no valid {} after the run:\n{text}", path.display()));
    Run { output, text, json, elapsed }
}

fn steps(json: &Value) -> Vec<&Value> {
    json["steps"].as_array().map(|s| s.iter().collect()).unwrap_or_default()
}

fn field<'a>(step: &'a Value, key: &str) -> &'a str {
    step[key].as_str().unwrap_or("")
}

#[test]
fn device_check_refuses_or_fails_fast_without_a_gpu() {
    if !tool_works("bash", &["-c", "true"]) || !tool_works("timeout", &["--version"]) {
        eprintln!("SKIPPED: bash or coreutils timeout missing");
        return;
    }
    if !tool_works("python3", &["-c", "import json"]) {
        eprintln!("SKIPPED: python3 missing (the device check's summary needs it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    if !cfg!(feature = "cuda") || !ringattn::kernels::compiled() {
        // Refused at step 0, whatever the machine.
        let why = if cfg!(feature = "cuda") { "embeds no CUDA kernels" } else { "without the cuda feature" };
        let r = device_check(dir.path());
        let ctx = &r.text;
        assert_eq!(r.output.status.code(), Some(3), "exit status of a refusal:\n{ctx}");
        let refused: Vec<&str> = r.text.lines().filter(|l| l.contains("refused")).collect();
        assert_eq!(refused.len(), 1, "one `refused` line:\n{ctx}");
        assert!(refused[0].starts_with("device-check: refused: "), "{ctx}");
        assert!(refused[0].contains(why) && refused[0].contains("--features cuda"), "{ctx}");
        assert_eq!(r.json["state"], "refused", "{ctx}");
        assert!(field(&r.json, "reason").contains(why), "{ctx}");
        let names: Vec<&str> = steps(&r.json).iter().map(|s| field(s, "name")).collect();
        assert!(names.iter().all(|n| n.starts_with("preflight-")), "only step 0 ran: {names:?}\n{ctx}");
        assert!(!names.contains(&"preflight-verify"), "refused before the tiny verify: {names:?}");
        assert!(r.elapsed < Duration::from_secs(20), "refused in {:?} (limit 20 s):\n{ctx}", r.elapsed);
        return;
    }
    if gpu_present() {
        eprintln!("SKIPPED: a GPU is present (the device check itself takes minutes there)");
        return;
    }
    let r = device_check(dir.path());
    let ctx = &r.text;
    assert_eq!(r.output.status.code(), Some(4), "exit status without a GPU:\n{ctx}");
    assert_eq!(r.json["state"], "done", "{ctx}");
    let no_gpu = field(&r.json, "no_gpu");
    assert!(no_gpu.starts_with("no GPU: ") && no_gpu.contains("no CUDA"), "no_gpu: {no_gpu:?}\n{ctx}");
    assert!(!r.text.contains("refused"), "{ctx}");
    let all = steps(&r.json);
    let gpu_steps: Vec<&Value> = all.iter().copied().filter(|s| s["needs_gpu"] == true).collect();
    for prefix in ["preflight-verify", "verify-d", "verify-par-", "overlap-ring-", "bench-torch", "bench-ringattn"] {
        assert!(gpu_steps.iter().any(|s| field(s, "name").starts_with(prefix)), "no {prefix} step:\n{ctx}");
    }
    for s in &gpu_steps {
        let (name, status, message) = (field(s, "name"), field(s, "status"), field(s, "message"));
        assert_ne!(status, "pass", "{name} passed without a GPU");
        let torch_ok =
            name == "bench-torch" && (message.contains("torch not installed") || message.contains("no CUDA"));
        assert!(
            status.starts_with("skipped") || message.contains("no CUDA") || torch_ok,
            "{name}: {status}: {message:?} does not say there is no CUDA device"
        );
        let secs = s["seconds"].as_f64().unwrap_or(0.0);
        assert!(secs < 30.0, "{name} took {secs} s: GPU steps must fail fast without a GPU");
    }
    for table in ["== preflight: nogpu", "== verify: 0/", "== timings", "== sequence parallelism"] {
        assert!(r.text.contains(table), "`{table}` not printed:\n{ctx}");
    }
    assert!(dir.path().join("work.tar.gz").exists(), "work.tar.gz missing");
    assert!(r.elapsed < Duration::from_secs(60), "took {:?} (limit 60 s):\n{ctx}", r.elapsed);
}
