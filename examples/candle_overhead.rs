//! What the candle operation costs over the plan's own calls: forward + backward of one
//! rank's attention at `--seq` tokens (b=1, 8 heads of 64, causal, f32 by default, one rank),
//! through `ringattn::candle::ring_attention` and candle's backward against
//! `ring_attention` / `ring_attention_backward` on host buffers, in interleaved rounds;
//! medians and their ratio.
//!
//! ```text
//! cargo run --release --features candle --example candle_overhead -- --seq 4096 --rounds 5
//! ```

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use ringattn::comm::{spmd_shared, LocalOptions};
use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
use ringattn::{random::randn, ring_attention, ring_attention_backward, AttentionParams, DType, Dims, HostBuf, Mask};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ringattn::Result<()> {
    let (s, rounds, h, d) = (arg("--seq", 4096), arg("--rounds", 5), 8, 64);
    let x = randn(vec![1, s, h, d], 1, DType::F32);
    let g = randn(vec![1, s, h, d], 2, DType::F32);
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let out = spmd_shared(1, LocalOptions::default(), |comm| {
        let dims = Dims { b: 1, s_q: s, s_k: s, h_q: h, h_kv: h, d };
        let plan =
            Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
        let (xb, gb) = (HostBuf::from_tensor(&x), HostBuf::from_tensor(&g));
        let xc = Var::from_tensor(&Tensor::from_vec(x.to_f32_vec(), (1, s, h, d), &Device::Cpu)?)?;
        let gc = Tensor::from_vec(g.to_f32_vec(), (1, s, h, d), &Device::Cpu)?;
        let (mut raw, mut op) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            let (_, saved) = ring_attention(&plan, &xb, &xb, &xb)?;
            ring_attention_backward(&plan, &saved, &gb)?;
            raw.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let o = ringattn::candle::ring_attention(&plan, xc.as_tensor(), xc.as_tensor(), xc.as_tensor())?;
            let grads = (o * &gc)?.sum_all()?.backward()?;
            assert!(grads.get(xc.as_tensor()).is_some());
            op.push(t.elapsed().as_secs_f64());
        }
        Ok((median(raw), median(op)))
    });
    let (raw, op) = out.into_iter().next().expect("one rank")?;
    println!(
        "candle_overhead: s={s} b=1 h={h} d={d} causal f32, {rounds} interleaved rounds: plan calls {raw:.3} s, \
         candle op {op:.3} s (median forward+backward), overhead {:+.1}%",
        (op / raw - 1.0) * 100.0
    );
    Ok(())
}
