//! Communication hidden by compute in ring attention over in-process ranks with a link model.
//!
//! `cargo run --release --example overlap -- [s] [world] [MB/s] [heads] [strategy] [threads per rank]`
//! (defaults: 16384 4 100 8 ring shared; causal, zigzag, d=64, f32). With a thread count,
//! each rank computes on its own pool of that size instead of sharing the machine's.

use std::time::Duration;

use ringattn::comm::{LinkModel, LocalOptions};
use ringattn::parallel::{measure_overlap, CpuBackend, ParallelParams};
use ringattn::{random::randn, AttentionParams, DType, Layout, Mask};

fn main() -> Result<(), ringattn::Error> {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let s: usize = arg(1, "16384").parse().unwrap();
    let world: usize = arg(2, "4").parse().unwrap();
    let mbps: f64 = arg(3, "100").parse().unwrap();
    let h: usize = arg(4, "8").parse().unwrap();
    let strategy = arg(5, "ring").parse()?;
    let threads_per_rank = a.get(6).map(|t| t.parse::<usize>().unwrap());
    let d = 64;
    let q = randn(vec![1, s, h, d], 1, DType::F32);
    let k = randn(vec![1, s, h, d], 2, DType::F32);
    let v = randn(vec![1, s, h, d], 3, DType::F32);
    let params = ParallelParams {
        strategy,
        layout: Some(Layout::Zigzag),
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        seq_len: s,
        ..Default::default()
    };
    let link = LinkModel { bandwidth: mbps * 1e6, latency: Duration::from_micros(20) };
    let hop_bytes = 2.0 * (s / world) as f64 * (h * d * 4) as f64;
    let options = LocalOptions { link: Some(link), threads_per_rank, ..Default::default() };
    let o = measure_overlap(world, options, &CpuBackend::default(), &q, &k, &v, None, &params)?;
    println!(
        "{strategy:?} forward s={s} P={world} h={h} d={d} causal zigzag, threads per rank {threads_per_rank:?}, link {mbps} MB/s ({:.3} s per K/V hop): \
run {:.3} s, compute only {:.3} s, communication only {:.3} s, hidden {:.1}%",
        hop_bytes / (mbps * 1e6),
        o.run,
        o.compute_only,
        o.comm_only,
        100.0 * o.hidden
    );
    Ok(())
}
