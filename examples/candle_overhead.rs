//! What the candle operation costs over the plan's own calls: forward + backward of one
//! rank's attention at `--seq` tokens (b=1, 8 heads of 64, causal, f32 by default, one rank;
//! the output's gradient all ones, as candle's `o.backward()` seeds it),
//! through `ringattn::candle::ring_attention` and candle's backward against
//! `ring_attention` / `ring_attention_backward` on host buffers, and through the group's
//! `ContextParallel::attention_at` (its per-call exchange and position check included), in
//! interleaved rounds; medians and their ratios.
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

/// An operation that does no attention: `o = q` (one copy), its backward hands `do` to q, k
/// and v. What candle itself costs around any three-input operation of this size: the
/// output's gradient seeded with ones, and per input a zeroed gradient plus an add.
struct Null;

impl candle_core::CustomOp3 for Null {
    fn name(&self) -> &'static str {
        "null"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((s1.try_clone(l1)?, l1.shape().clone()))
    }

    #[allow(clippy::type_complexity)]
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(g.clone()), Some(g.clone()), Some(g.clone())))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ringattn::Result<()> {
    let (s, rounds, h, d) = (arg("--seq", 4096), arg("--rounds", 5), 8, 64);
    let x = randn(vec![1, s, h, d], 1, DType::F32);
    // candle's backward of `o` seeds its gradient with ones: the plan's calls get the same.
    let g = ringattn::Tensor::from_f32(vec![1, s, h, d], vec![1.0; s * h * d])?;
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let out = spmd_shared(1, LocalOptions::default(), |comm| {
        let dims = Dims { b: 1, s_q: s, s_k: s, h_q: h, h_kv: h, d_qk: d, d_v: d };
        let plan = Arc::new(ParallelPlan::new_shared(
            comm.clone(),
            Arc::new(CpuBackend::default()),
            &params,
            &dims,
            DType::F32,
        )?);
        let (xb, gb) = (HostBuf::from_tensor(&x), HostBuf::from_tensor(&g));
        // q, k and v as three variables (one variable used thrice would add its gradients).
        let var = || Var::from_tensor(&Tensor::from_vec(x.to_f32_vec(), (1, s, h, d), &Device::Cpu)?);
        let (qc, kc, vc) = (var()?, var()?, var()?);
        let cp = ringattn::candle::ContextParallel::new(comm.clone(), CpuBackend::default(), params.clone(), h)?;
        let pos = cp.position_ids(s, &Device::Cpu)?;
        let (mut raw, mut op, mut group, mut null) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            let (_, saved) = ring_attention(&plan, &xb, &xb, &xb)?;
            ring_attention_backward(&plan, &saved, &gb)?;
            raw.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let o = ringattn::candle::ring_attention(&plan, qc.as_tensor(), kc.as_tensor(), vc.as_tensor())?;
            let grads = o.backward()?;
            assert!(grads.get(qc.as_tensor()).is_some());
            op.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let o = cp.attention_at(qc.as_tensor(), kc.as_tensor(), vc.as_tensor(), &pos)?;
            let grads = o.backward()?;
            assert!(grads.get(qc.as_tensor()).is_some());
            group.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let o = qc.as_tensor().apply_op3(kc.as_tensor(), vc.as_tensor(), Null)?;
            assert!(o.backward()?.get(qc.as_tensor()).is_some());
            null.push(t.elapsed().as_secs_f64());
        }
        Ok((median(raw), median(op), median(group), median(null)))
    });
    let (raw, op, group, null) = out.into_iter().next().expect("one rank")?;
    println!(
        "candle_overhead: s={s} b=1 h={h} d={d} causal f32, {rounds} interleaved rounds: plan calls {raw:.3} s, \
         candle op {op:.3} s (overhead {:+.1}%), group {group:.3} s (overhead {:+.1}%), medians of forward+backward; \
         candle's own cost around any 3-input operation of this size (a null operation) {:.1} ms = {:.1}%",
        (op / raw - 1.0) * 100.0,
        (group / raw - 1.0) * 100.0,
        null * 1e3,
        null / raw * 100.0
    );
    Ok(())
}
