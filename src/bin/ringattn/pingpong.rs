//! `ringattn pingpong`: one-way message time between ranks 0 and 1 for several sizes (half
//! the median round trip), the link measurement that calibrates `ringattn plan`
//! (`ringattn::plan::PingPong`). Ranks above 1 wait at the final barrier.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ringattn::comm::{barrier, spmd, Communicator, LocalOptions};
use ringattn::plan::{LinkKind, PingPong, PingPongSample};
use ringattn::{Elem, Error, HostBuf, Result};

use crate::args::parse_list;

#[derive(Args, Debug)]
pub struct PingPongArgs {
    /// How ranks communicate: local (two threads of this process) or mpi (run under
    /// `mpirun -n 2`; needs a build with --features mpi).
    #[arg(long, default_value = "local")]
    pub comm: String,
    /// Message sizes in bytes, comma-separated (multiples of 4).
    #[arg(long, default_value = "4,4096,65536,1048576,4194304,16777216")]
    pub sizes: String,
    /// Round trips per size (after one untimed).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Seconds any wait may take.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// The link measured, for the JSON: intra (inside a node) or inter (between nodes).
    #[arg(long, default_value = "intra")]
    pub link: String,
    /// Also write `{"link", "samples": [{"bytes", "seconds"}], "fit": {...} | null}` to this
    /// file (no fit when the times do not grow with the size).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Rank 0's one-way times (median of `reps` round trips, halved); `None` on other ranks.
fn measure(
    comm: &dyn Communicator<Buf = HostBuf>,
    sizes: &[usize],
    reps: usize,
) -> Result<Option<Vec<PingPongSample>>> {
    if comm.size() < 2 {
        return Err(Error::InvalidArgument("pingpong needs at least two ranks".into()));
    }
    let mut out = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        let n = bytes / 4;
        let tag = i as u64 * 2;
        let mut times = Vec::with_capacity(reps);
        for rep in 0..=reps {
            match comm.rank() {
                0 => {
                    let t = Instant::now();
                    let r = comm.irecv(1, tag + 1, n, Elem::F32)?;
                    comm.isend(1, tag, HostBuf::from(vec![1.0; n]))?.wait()?;
                    r.wait()?;
                    if rep > 0 {
                        times.push(t.elapsed().as_secs_f64() / 2.0);
                    }
                }
                1 => {
                    let got = comm.irecv(0, tag, n, Elem::F32)?.wait()?;
                    comm.isend(0, tag + 1, got)?.wait()?;
                }
                _ => {}
            }
        }
        if comm.rank() == 0 {
            out.push(PingPongSample { bytes: bytes as f64, seconds: crate::bench::median(&times) });
        }
    }
    barrier(comm, HostBuf::bytes(Vec::new()))?;
    Ok((comm.rank() == 0).then_some(out))
}

pub fn pingpong(a: &PingPongArgs) -> Result<ExitCode> {
    let sizes = parse_list(&a.sizes, "--sizes")?;
    if let Some(bad) = sizes.iter().find(|&&b| b % 4 != 0) {
        return Err(Error::InvalidArgument(format!("--sizes: {bad} bytes is not a multiple of 4 (f32 messages)")));
    }
    if a.reps == 0 {
        return Err(Error::InvalidArgument("--reps must be at least 1".into()));
    }
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        return Err(Error::InvalidArgument(format!("--timeout {}: must be a positive number of seconds", a.timeout)));
    }
    let link = match a.link.as_str() {
        "intra" => LinkKind::Intra,
        "inter" => LinkKind::Inter,
        other => return Err(Error::InvalidArgument(format!("--link `{other}`: expected intra or inter"))),
    };
    let deadline = std::time::Duration::from_secs_f64(a.timeout);
    let samples = match a.comm.as_str() {
        "local" => {
            spmd::<HostBuf, _>(2, LocalOptions { deadline, ..Default::default() }, |c| measure(c, &sizes, a.reps))
                .into_iter()
                .next()
                .ok_or_else(|| Error::InvalidArgument("no rank 0".into()))??
        }
        #[cfg(feature = "mpi")]
        "mpi" => {
            let comm = ringattn::comm::MpiComm::init(ringattn::comm::MpiOptions { deadline, ..Default::default() })?;
            match measure(&comm, &sizes, a.reps) {
                Ok(s) => s,
                Err(e) => {
                    comm.abort(&e.to_string());
                    return Err(e);
                }
            }
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "--comm `{other}`: expected local{}",
                if cfg!(feature = "mpi") { " or mpi" } else { " (mpi needs a build with --features mpi)" }
            )))
        }
    };
    let Some(samples) = samples else { return Ok(ExitCode::SUCCESS) };
    let pp = PingPong { link, samples };
    println!("{:>12} {:>12} {:>10}", "bytes", "one-way µs", "GB/s");
    for s in &pp.samples {
        println!("{:>12} {:>12.2} {:>10.3}", s.bytes, s.seconds * 1e6, s.bytes / s.seconds.max(1e-12) / 1e9);
    }
    // In-process ranks hand buffers over without copying, so their times need not grow with
    // the size: then there is no bandwidth to fit, which is a finding, not a failure.
    let fit = match pp.fit() {
        Ok(fit) => {
            println!(
                "fit: latency {:.2} µs, bandwidth {:.3} GB/s (r² {:.4})",
                fit.latency_s * 1e6,
                fit.bandwidth_gbps,
                fit.r2
            );
            Some(fit)
        }
        Err(e) => {
            println!("fit: none ({e})");
            None
        }
    };
    if let Some(path) = &a.json {
        #[derive(serde::Serialize)]
        struct Out<'a> {
            #[serde(flatten)]
            pp: &'a PingPong,
            fit: Option<ringattn::plan::LinkFit>,
        }
        ringattn::io::write_json(path, &Out { pp: &pp, fit })?;
    }
    Ok(ExitCode::SUCCESS)
}
