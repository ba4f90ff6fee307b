//! Criterion benchmarks of ring and Ulysses attention over in-process ranks joined by a link
//! model, reporting throughput (attention FLOP/s of the whole job; divide by the world size
//! for per rank) and, printed once per configuration, the communication hidden by compute.
//!
//! `cargo bench --bench parallel`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringattn::comm::{LinkModel, LocalOptions};
use ringattn::parallel::{measure_overlap, run_in_process, CpuBackend, ParallelParams, Strategy};
use ringattn::{random::randn, AttentionParams, DType, Layout, Mask};

fn bench(c: &mut Criterion) {
    let (s, h, d, world) = (8192, 8, 64, 4);
    let q = randn(vec![1, s, h, d], 1, DType::F32);
    let k = randn(vec![1, s, h, d], 2, DType::F32);
    let v = randn(vec![1, s, h, d], 3, DType::F32);
    // About half the compute time of a ring hop per K/V transfer on the development machine.
    let link = LinkModel { bandwidth: 200e6, latency: Duration::from_micros(20) };
    let flops = (4 * h * s * s * d / 2) as u64;
    let mut g = c.benchmark_group("parallel_forward_flop");
    g.sample_size(10);
    g.throughput(Throughput::Elements(flops));
    for strategy in [Strategy::Ring, Strategy::Ulysses] {
        let params = ParallelParams {
            strategy,
            layout: Some(Layout::Zigzag),
            attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
            seq_len: s,
            ..Default::default()
        };
        // Only under `cargo bench` (not when `cargo test` runs the bench once as a test).
        if std::env::args().any(|a| a == "--bench") {
            let options = LocalOptions { link: Some(link), ..Default::default() };
            let o = measure_overlap(world, options, &CpuBackend::default(), &q, &k, &v, None, &params).unwrap();
            println!(
                "{strategy:?} P={world} s={s}: run {:.3} s, compute only {:.3} s, comm only {:.3} s, hidden {:.1}%",
                o.run,
                o.compute_only,
                o.comm_only,
                100.0 * o.hidden
            );
        }
        let options = LocalOptions { link: Some(link), ..Default::default() };
        g.bench_with_input(
            BenchmarkId::new(format!("{strategy:?}"), format!("P{world}_s{s}_h{h}_d{d}")),
            &(),
            |b, _| {
                b.iter(|| run_in_process(world, options, &CpuBackend::default(), &q, &k, &v, None, &params).unwrap())
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
