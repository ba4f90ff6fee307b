//! `ringattn doctor`: what the binary embeds and what the machine has. Without the `cuda`
//! feature it says so; with it, it lists every embedded architecture, and finds NCCL from
//! the PyPI wheel's folder (`libnccl.so.2` only, no symlink) through `LD_LIBRARY_PATH` —
//! `scripts/test.sh` installs the wheel and sets `RINGATTN_TEST_NCCL_DIR`.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn doctor(envs: &[(&str, &str)]) -> Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ringattn"));
    cmd.args(["doctor", "--json"]);
    for var in ["RINGATTN_NCCL", "NCCL_LIBRARY", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"] {
        cmd.env_remove(var);
    }
    cmd.envs(envs.iter().copied());
    let out = cmd.output().expect("run ringattn doctor");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("doctor --json prints one JSON object")
}

#[test]
fn doctor_reports_the_build_and_the_machine() {
    let r = doctor(&[]);
    assert_eq!(r["features"]["cuda"], Value::Bool(cfg!(feature = "cuda")));
    assert_eq!(r["features"]["mpi"], Value::Bool(cfg!(feature = "mpi")));
    let problems = r["problems"].as_array().unwrap();
    if !cfg!(feature = "cuda") {
        assert_eq!(r["gpu_path_ok"], Value::Bool(false));
        assert!(problems[0].as_str().unwrap().contains("lacks the `cuda` feature"), "{problems:?}");
        assert_eq!(r["nccl"]["found"], Value::Bool(false));
        return;
    }
    if ringattn::kernels::compiled() {
        let archs: Vec<&str> =
            r["images"]["architectures"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
        assert_eq!(archs, ringattn::kernels::targets());
        assert_eq!(r["images"]["cuda_version"].as_str().unwrap(), "13.0");
    }
    if r["gpus"].as_array().unwrap().is_empty() {
        // No GPU here: the driver's absence is the problem reported, and nothing else is
        // claimed about the device.
        assert_eq!(r["gpu_path_ok"], Value::Bool(false));
        assert!(problems.iter().any(|p| p.as_str().unwrap().contains("CUDA")), "{problems:?}");
    }
    // Under a launcher: the rank-to-GPU mapping.
    let l = doctor(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "3"),
        ("MASTER_ADDR", "n0"),
        ("MASTER_PORT", "29500"),
    ]);
    assert_eq!(l["launcher"]["launcher"], "torchrun");
    assert_eq!(l["launcher"]["bootstrap_port"], 29600);
    let s = doctor(&[
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
    ]);
    assert_eq!(s["launcher"]["launcher"], "srun");
    assert_eq!(s["launcher"]["rank0_host"], "gpu07");
}

#[test]
fn doctor_finds_nccl_from_the_wheels_folder() {
    if !cfg!(feature = "cuda") {
        eprintln!("SKIPPED: NCCL is looked for only by builds with the cuda feature");
        return;
    }
    let Some(dir) = std::env::var_os("RINGATTN_TEST_NCCL_DIR").map(PathBuf::from) else {
        eprintln!("SKIPPED: RINGATTN_TEST_NCCL_DIR is not set (scripts/test.sh installs nvidia-nccl-cu13 and sets it)");
        return;
    };
    assert!(!dir.join("libnccl.so").exists(), "the wheel's folder must hold libnccl.so.2 only");
    let lib_path = dir.display().to_string();
    let r = doctor(&[("LD_LIBRARY_PATH", &lib_path)]);
    let n = &r["nccl"];
    assert_eq!(n["found"], Value::Bool(true), "{n}");
    assert_eq!(PathBuf::from(n["path"].as_str().unwrap()), std::fs::canonicalize(dir.join("libnccl.so.2")).unwrap());
    assert!(n["version"].as_str().unwrap().starts_with("2."), "{n}");
    // The override names the folder without LD_LIBRARY_PATH.
    let r = doctor(&[("RINGATTN_NCCL", &lib_path)]);
    assert_eq!(r["nccl"]["found"], Value::Bool(true), "{}", r["nccl"]);
    // An override that points nowhere is an error listing what was tried, not a fallback.
    let r = doctor(&[("RINGATTN_NCCL", "/nonexistent/libnccl.so.2"), ("LD_LIBRARY_PATH", &lib_path)]);
    assert_eq!(r["nccl"]["found"], Value::Bool(false));
    let e = r["nccl"]["error"].as_str().unwrap();
    assert!(e.contains("/nonexistent/libnccl.so.2 (not present)") && e.contains("RINGATTN_NCCL"), "{e}");
}
