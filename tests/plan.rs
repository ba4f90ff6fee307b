//! `ringattn plan` and `ringattn simulate` from the command line: the table, the JSON, the
//! plots, calibration files and bad input.

use std::path::Path;
use std::process::{Command, Output};

fn ringattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringattn")).args(args).output().expect("run ringattn")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn plan_prints_ranked_choices_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    let out = stdout(&ringattn(&[
        "plan",
        "--gpus",
        "512",
        "--gpus-per-node",
        "8",
        "--seq",
        "1M",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--causal",
        "--json",
        s(&json),
        "--top",
        "5",
    ]));
    // The header, five ranked rows, the recommendation, the rejected summary.
    let header = out.lines().find(|l| l.starts_with("#  strategy")).unwrap_or_else(|| panic!("no table:\n{out}"));
    for col in ["u × r", "placement", "time ms", "exposed comm ms", "volume MiB/rank", "memory GiB/rank"] {
        assert!(header.contains(col), "{header}");
    }
    let rows: Vec<&str> =
        out.lines().skip_while(|l| !l.starts_with("#  strategy")).skip(1).take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.iter().filter(|r| r.chars().next().is_some_and(|c| c.is_ascii_digit())).count(), 5, "{out}");
    let times: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.split_whitespace().find_map(|w| w.parse::<f64>().ok().filter(|_| w.contains('.'))))
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "best first: {times:?}");
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("the model predicts"), "{out}");
    assert!(flat.contains("Run it with `--strategy"), "{out}");
    assert!(flat.contains("rejected") && flat.contains("do not split evenly over the Ulysses degree"), "{out}");

    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let choices = v["plan"]["choices"].as_array().unwrap();
    assert!(choices.len() >= 5);
    let t: Vec<f64> = choices.iter().map(|c| c["time_s"].as_f64().unwrap()).collect();
    assert!(t.windows(2).all(|w| w[0] <= w[1]));
    for c in choices {
        assert_eq!(32 % c["placement"]["ulysses"].as_u64().unwrap(), 0);
        assert_eq!(c["placement"]["ulysses"].as_u64().unwrap() * c["placement"]["ring"].as_u64().unwrap(), 512);
    }
    assert!(v["plan"]["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["reason"].as_str().is_some_and(|x| !x.is_empty())));
    assert!(v["recommendation"].as_str().unwrap().contains("fastest"));
    assert_eq!(v["plan"]["job"]["seq"], 1 << 20);
}

#[test]
fn plan_takes_a_calibration_and_explicit_options_win() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench.json");
    std::fs::write(
        &bench,
        r#"{"backend":"cuda","device":"H200","dtype":"bf16","b":1,"s":32768,"h_q":32,"h_kv":8,"d":128,"causal":true,
            "results":[{"pass":"forward","median_ms":9.0,"min_ms":8.9,"tflops":456.5,"samples_ms":[9.0]},
                       {"pass":"backward","median_ms":30.0,"min_ms":29.0,"tflops":345.25,"samples_ms":[30.0]}]}"#,
    )
    .unwrap();
    let pp = dir.path().join("pingpong.json");
    std::fs::write(&pp, r#"{"link":"inter","samples":[[1000,2.005e-5],[1000000000,0.05002]]}"#).unwrap();
    let json = dir.path().join("plan.json");
    let args = ["plan", "--gpus", "16", "--seq", "256k", "--heads", "16", "--kv-heads", "4", "--head-dim", "64"];
    let mut a = args.to_vec();
    a.extend(["--calibration", s(&bench), "--calibration", s(&pp), "--intra-gbps", "123", "--json", s(&json)]);
    let out = stdout(&ringattn(&a));
    assert!(out.contains("kernel 456.5 / 345.25 TFLOP/s"), "{out}");
    assert!(out.contains("intra 123 GB/s") && out.contains("inter 20 GB/s"), "{out}");
    assert!(out.contains("calibrated: kernel rates, inter-node link"), "{out}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["plan"]["cluster"]["fwd_tflops"], 456.5);
    assert_eq!(v["plan"]["cluster"]["intra_gbps"], 123.0);
}

#[test]
fn plan_rejects_bad_input_with_a_message() {
    for (args, want) in [
        (vec!["plan", "--gpus", "8", "--seq", "1M", "--heads", "6", "--kv-heads", "4"], "not a multiple"),
        (vec!["plan", "--gpus", "0", "--seq", "1M"], "at least 1"),
        (vec!["plan", "--gpus", "8", "--seq", "lots"], "token count"),
        (vec!["plan", "--gpus", "8", "--seq", "1M", "--kernel-tflops", "1,2,3"], "FWD,BWD"),
        (vec!["plan", "--gpus", "8", "--seq", "1M", "--calibration", "/nonexistent/bench.json"], "nonexistent"),
    ] {
        let o = ringattn(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Nothing fits: a clean report, not an error.
    let out = stdout(&ringattn(&["plan", "--gpus", "8", "--seq", "4M", "--memory-gib", "0.01"]));
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("No placement") && flat.contains("memory per rank over the budget"), "{out}");
}

#[test]
fn simulate_writes_table_json_csv_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("sim");
    let out = stdout(&ringattn(&[
        "simulate",
        "--gpus",
        "8,64",
        "--seq",
        "32k,1M",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--causal",
        "--out",
        s(&out_dir),
    ]));
    let header = out.lines().find(|l| l.starts_with("gpus")).unwrap_or_else(|| panic!("no table:\n{out}"));
    for col in ["ring ms", "ulysses ms", "usp ms", "allgather ms", "best"] {
        assert!(header.contains(col), "{header}");
    }
    assert!(out.lines().any(|l| l.trim_start().starts_with("64 ") && l.contains("1M")), "{out}");

    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("simulation.json")).unwrap()).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 2 * 2 * 4);
    let csv = std::fs::read_to_string(out_dir.join("simulation.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 16);
    assert!(csv.starts_with("gpus,seq,strategy,"));
    for stem in ["time_vs_seq_8gpus", "time_vs_seq_64gpus", "time_vs_gpus_32k", "time_vs_gpus_1M", "best_vs_seq"] {
        let png = std::fs::read(out_dir.join(format!("{stem}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{stem}.png: {} bytes", png.len());
        let svg = std::fs::read_to_string(out_dir.join(format!("{stem}.svg"))).unwrap();
        let legend = if stem == "best_vs_seq" { "64 GPUs" } else { "ring" };
        assert!(svg.contains("<svg") && svg.contains("<polyline") && svg.contains(legend), "{stem}.svg");
        assert!(svg.len() > 5_000, "{stem}.svg: {} bytes", svg.len());
    }
    // Nothing but the outputs (no temporary files left).
    let names: Vec<String> =
        std::fs::read_dir(&out_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    assert_eq!(names.len(), 2 + 2 * 5);
}
