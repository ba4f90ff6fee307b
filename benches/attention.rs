//! Criterion benchmarks of the CPU flash attention, reported in FLOP/s of the visible
//! (query, key) pairs ([`ringattn::flops`]): forward `4·d` per pair and head (causal: s(s+1)/2
//! pairs), backward 2.5× the forward.
//!
//! `cargo bench --bench attention` — the shape of the performance target is b=1, h=8,
//! s=4096, d=64, f32; compare with `python3 ../shared/peers/torch_sdpa.py --device cpu --bwd`
//! run on the same machine at the same time.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringattn::flops::{self, Pass};
use ringattn::{cpu, random::randn, AttentionParams, DType, Dims, Mask};

fn shapes() -> Vec<(usize, usize, usize, usize, bool)> {
    // (b, s, h, d, causal)
    vec![(1, 4096, 8, 64, false), (1, 4096, 8, 64, true), (1, 2048, 8, 128, false)]
}

fn work(b: usize, s: usize, h: usize, d: usize, causal: bool, pass: Pass) -> u64 {
    let dims = Dims { b, s_q: s, s_k: s, h_q: h, h_kv: h, d_qk: d, d_v: d };
    let p = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
    let pairs = flops::visible_pairs(&dims, &p).expect("valid shape");
    flops::flops(&dims, pairs, pass) as u64
}

fn bench(c: &mut Criterion) {
    let mut fwd = c.benchmark_group("forward_flop");
    fwd.sample_size(10);
    for (b, s, h, d, causal) in shapes() {
        let q = randn(vec![b, s, h, d], 1, DType::F32);
        let k = randn(vec![b, s, h, d], 2, DType::F32);
        let v = randn(vec![b, s, h, d], 3, DType::F32);
        let p = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
        fwd.throughput(Throughput::Elements(work(b, s, h, d, causal, Pass::Forward)));
        let id = BenchmarkId::from_parameter(format!("b{b}_s{s}_h{h}_d{d}_{}", if causal { "causal" } else { "full" }));
        fwd.bench_with_input(id, &(), |bench, _| bench.iter(|| cpu::forward(&q, &k, &v, &p).unwrap()));
    }
    fwd.finish();

    let mut bwd = c.benchmark_group("backward_flop");
    bwd.sample_size(10);
    for (b, s, h, d, causal) in shapes() {
        let q = randn(vec![b, s, h, d], 1, DType::F32);
        let k = randn(vec![b, s, h, d], 2, DType::F32);
        let v = randn(vec![b, s, h, d], 3, DType::F32);
        let d_o = randn(vec![b, s, h, d], 4, DType::F32);
        let p = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
        let f = cpu::forward(&q, &k, &v, &p).unwrap();
        bwd.throughput(Throughput::Elements(work(b, s, h, d, causal, Pass::Backward)));
        let id = BenchmarkId::from_parameter(format!("b{b}_s{s}_h{h}_d{d}_{}", if causal { "causal" } else { "full" }));
        bwd.bench_with_input(id, &(), |bench, _| {
            bench.iter(|| cpu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, &p).unwrap())
        });
    }
    bwd.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
