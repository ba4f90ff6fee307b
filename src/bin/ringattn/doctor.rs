//! `ringattn doctor`: what this binary and this machine have for the GPU paths — the
//! embedded kernel images, the CUDA driver, the GPUs and the image each would load, NCCL,
//! MPI and the launcher's environment — so that a user (and the device check's first step)
//! sees at once why a GPU path would fail.

use std::process::ExitCode;

use clap::Args;
use ringattn::Result;
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print the report as one JSON object instead of text.
    ///
    /// Keys: version, features {cuda, emu, mpi}, images {cuda_version, architectures,
    /// families, bytes (expanded), embedded_bytes (compressed, in the binary)}, driver {found, version, required, ok, error}, gpus [{ordinal, name,
    /// compute_capability, memory_mib, image, ok, problem}], nccl {found, path, version,
    /// tried, error}, mpi {compiled}, launcher {...} or null, gpu_path_ok, problems [...],
    /// emulated_gpu (the driver is ringattn's stand-in, `scripts/with-emulated-gpu`: kernels
    /// run on the CPU; gpus[].emulated per device).
    #[arg(long)]
    pub json: bool,
}

/// Runs the checks; exit status 0 whenever the report was produced (read `gpu_path_ok`).
pub fn doctor(a: &DoctorArgs) -> Result<ExitCode> {
    let report = collect();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        print_text(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn features() -> Value {
    json!({"cuda": cfg!(feature = "cuda"), "emu": cfg!(feature = "emu"), "mpi": cfg!(feature = "mpi")})
}

fn images() -> Value {
    let mut families: Vec<&str> = ringattn::kernels::images().iter().map(|i| i.family).collect();
    families.sort_unstable();
    families.dedup();
    json!({
        "cuda_version": ringattn::kernels::cuda_version().map(|(a, b)| format!("{a}.{b}")),
        "architectures": ringattn::kernels::targets(),
        "families": families,
        "bytes": ringattn::kernels::images().iter().map(|i| i.size).sum::<usize>(),
        "embedded_bytes": ringattn::kernels::images().iter().map(|i| i.deflated.len()).sum::<usize>(),
    })
}

/// The whole report as JSON.
fn collect() -> Value {
    let mut problems: Vec<String> = Vec::new();
    if !ringattn::kernels::compiled() {
        problems.push("this build embedded no CUDA kernels (nvcc was not found when it was built)".into());
    }
    let (driver, gpus, nccl, launcher) = gpu_side(&mut problems);
    let gpu_path_ok = problems.is_empty();
    let emulated = gpus.as_array().is_some_and(|g| g.iter().any(|g| g["emulated"] == Value::Bool(true)));
    json!({
        "emulated_gpu": emulated,
        "version": env!("CARGO_PKG_VERSION"),
        "features": features(),
        "images": images(),
        "driver": driver,
        "gpus": gpus,
        "nccl": nccl,
        "mpi": {"compiled": cfg!(feature = "mpi")},
        "launcher": launcher,
        "gpu_path_ok": gpu_path_ok,
        "problems": problems,
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu_side(problems: &mut Vec<String>) -> (Value, Value, Value, Value) {
    let missing = "this build lacks the `cuda` feature (cargo build --release --features cuda)";
    problems.insert(0, missing.to_string());
    (
        json!({"found": false, "version": null, "required": null, "ok": false, "error": missing}),
        json!([]),
        json!({"found": false, "path": null, "version": null, "tried": [], "error": missing}),
        Value::Null,
    )
}

#[cfg(feature = "cuda")]
fn gpu_side(problems: &mut Vec<String>) -> (Value, Value, Value, Value) {
    use ringattn::cuda;
    let required = cuda::required_driver_version();
    let version = |v: i32| format!("{}.{}", v / 1000, (v % 1000) / 10);
    let driver = match cuda::driver_facts() {
        Ok(f) => {
            let ok = f.driver_version >= required;
            let error = cuda::probe().err().map(|e| e.to_string());
            if let Some(e) = &error {
                problems.push(e.clone());
            }
            json!({"found": true, "version": version(f.driver_version), "required": version(required),
                   "ok": ok, "error": error})
        }
        Err(e) => {
            problems.push(e.to_string());
            json!({"found": false, "version": null, "required": version(required), "ok": false,
                   "error": e.to_string()})
        }
    };
    let gpus = match cuda::gpus() {
        Ok(list) => list
            .iter()
            .map(|g| {
                let (image, problem) = match cuda::image_for(g.compute_capability) {
                    Ok(i) => (Some(i), None),
                    Err(e) => {
                        problems.push(format!("GPU {} ({}): {e}", g.ordinal, g.name));
                        (None, Some(e.to_string()))
                    }
                };
                json!({
                    "ordinal": g.ordinal,
                    "name": g.name,
                    "emulated": ringattn::kernels::is_emulated_gpu(&g.name),
                    "compute_capability": format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
                    "memory_mib": g.memory_bytes >> 20,
                    "image": image,
                    "ok": problem.is_none(),
                    "problem": problem,
                })
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    // NCCL is reported, not required: single-GPU runs and ranks sharing a GPU work without.
    let nccl = match cuda::nccl_info() {
        Ok(n) => json!({"found": true, "path": n.path, "version": n.version.to_string(), "tried": n.tried,
                        "error": null}),
        Err(e) => json!({"found": false, "path": null, "version": null,
                         "tried": cuda::nccl_candidates(|k| std::env::var(k).ok()), "error": e.to_string()}),
    };
    let launcher = match cuda::BootstrapEnv::from_env() {
        Ok(env) => {
            let visible = cuda::driver_facts().map(|f| f.device_count).unwrap_or(0);
            json!({
                "launcher": env.launcher.name(),
                "rank": env.rank,
                "world": env.world,
                "local_rank": env.local_rank,
                "gpu": env.device(visible).ok(),
                "rank0_host": env.master_addr,
                "bootstrap_port": env.bootstrap_port,
            })
        }
        Err(_) => Value::Null,
    };
    (driver, Value::Array(gpus), nccl, launcher)
}

fn print_text(r: &Value) {
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let f = &r["features"];
    println!("ringattn {} doctor", s(&r["version"]));
    println!("features   cuda {}  emu {}  mpi {}", s(&f["cuda"]), s(&f["emu"]), s(&f["mpi"]));
    let im = &r["images"];
    let archs: Vec<String> = im["architectures"].as_array().map(|a| a.iter().map(s).collect()).unwrap_or_default();
    println!(
        "kernels    {} (nvcc {}, {:.1} MiB; {:.1} MiB compressed in the binary)",
        if archs.is_empty() { "none".to_string() } else { archs.join(", ") },
        s(&im["cuda_version"]),
        im["bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        im["embedded_bytes"].as_f64().unwrap_or(0.0) / 1048576.0
    );
    let d = &r["driver"];
    if d["found"] == Value::Bool(true) {
        println!("driver     CUDA {} (this build needs {}): {}", s(&d["version"]), s(&d["required"]), ok(&d["ok"]));
        if r["emulated_gpu"] == Value::Bool(true) {
            println!(
                "           EMULATED: ringattn's stand-in driver (emulated-gpu/, scripts/with-emulated-gpu): the kernels \
                 run on the CPU under the emulator; no figure measured here is a GPU figure"
            );
        }
    } else {
        println!("driver     {}", s(&d["error"]));
    }
    for g in r["gpus"].as_array().into_iter().flatten() {
        println!(
            "gpu {}      {} (compute {}, {} MiB): {}",
            s(&g["ordinal"]),
            s(&g["name"]),
            s(&g["compute_capability"]),
            s(&g["memory_mib"]),
            if g["ok"] == Value::Bool(true) { format!("loads {}", s(&g["image"])) } else { s(&g["problem"]) }
        );
    }
    let n = &r["nccl"];
    if n["found"] == Value::Bool(true) {
        println!("nccl       {} at {}", s(&n["version"]), s(&n["path"]));
    } else {
        println!("nccl       not found: {}", s(&n["error"]));
    }
    println!(
        "mpi        {}",
        if r["mpi"]["compiled"] == Value::Bool(true) { "compiled in" } else { "not in this build" }
    );
    let l = &r["launcher"];
    if !l.is_null() {
        println!(
            "launcher   {}: rank {} of {}, local rank {} → GPU {}, rank 0 at {}:{}",
            s(&l["launcher"]),
            s(&l["rank"]),
            s(&l["world"]),
            s(&l["local_rank"]),
            s(&l["gpu"]),
            s(&l["rank0_host"]),
            s(&l["bootstrap_port"])
        );
    }
    let problems = r["problems"].as_array().cloned().unwrap_or_default();
    if problems.is_empty() {
        println!("GPU path: ready");
    } else {
        println!("GPU path: not ready");
        for p in problems {
            println!("  - {}", s(&p));
        }
    }
}

fn ok(v: &Value) -> &'static str {
    if v == &Value::Bool(true) {
        "ok"
    } else {
        "TOO OLD"
    }
}
