//! Median forward and backward time and GFLOP/s of the CPU implementation on one shape,
//! printed in the format of `../shared/peers/torch_sdpa.py` for side-by-side comparison.
//!
//! `cargo run --release --example throughput -- [b,s,hq,hkv,d] [causal|full] [reps] [block_q,block_k|default]
//! [f32|bf16|f16]` — the inputs in the given element type (f32 by default).

use std::time::Instant;

use ringattn::{cpu, random::randn, AttentionParams, DType, Mask};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let shape: Vec<usize> =
        args.get(1).map(String::as_str).unwrap_or("1,4096,8,8,64").split(',').map(|x| x.parse().unwrap()).collect();
    let causal = args.get(2).map(|s| s == "causal").unwrap_or(false);
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    let tiles = args
        .get(4)
        .filter(|s| s.as_str() != "default")
        .map(|s| {
            let v: Vec<usize> = s.split(',').map(|x| x.parse().unwrap()).collect();
            cpu::TileConfig { block_q: v[0], block_k: v[1] }
        })
        .unwrap_or_default();
    let dtype = match args.get(5).map(String::as_str).unwrap_or("f32") {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => panic!("dtype `{other}`: expected f32, bf16 or f16"),
    };
    let [b, s, hq, hkv, d] = shape[..] else { panic!("shape is b,s,hq,hkv,d") };
    let q = randn(vec![b, s, hq, d], 1, dtype);
    let k = randn(vec![b, s, hkv, d], 2, dtype);
    let v = randn(vec![b, s, hkv, d], 3, dtype);
    let d_o = randn(vec![b, s, hq, d], 4, dtype);
    let params = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
    let cfg = cpu::CpuConfig { tiles, ..Default::default() };
    let flops = 4.0 * (b * hq * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let fwd = cpu::forward_with(&q, &k, &v, None, &params, &cfg).unwrap();
    let tf = median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(cpu::forward_with(&q, &k, &v, None, &params, &cfg).unwrap());
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let tb = median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(
                    cpu::backward_with(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, None, &params, &cfg).unwrap(),
                );
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    println!(
        "ringattn cpu b={b} s={s} hq={hq} hkv={hkv} d={d} causal={causal} dtype={dtype:?} tiles={}x{}: fwd {:.2} ms {:.1} GFLOP/s  bwd {:.2} ms {:.1} GFLOP/s",
        tiles.block_q,
        tiles.block_k,
        tf * 1e3,
        flops / tf / 1e9,
        tb * 1e3,
        2.5 * flops / tb / 1e9
    );
}
