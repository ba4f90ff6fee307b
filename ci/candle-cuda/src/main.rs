//! Both crates' CUDA types in one program: candle's device and stream, ringattn's device
//! backend on candle's stream, and `ringattn::candle::ring_attention` on CUDA tensors (two
//! ranks as threads on one GPU), forward and backward, checked against candle's own
//! attention on the whole sequence. Built by scripts/check-candle-cuda.sh; run it where a GPU
//! is (`cargo run --manifest-path ci/candle-cuda/Cargo.toml`).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ringattn::comm::{Communicator, LocalOptions};
use ringattn::cuda::{CudaDevice, DeviceBackend, DeviceComm};
use ringattn::parallel::{ParallelParams, ParallelPlan};
use ringattn::{AttentionParams, Dims, Mask};

/// Causal attention of `[b, s, h, d]` tensors with candle's operations.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let (_, s, _, d) = q.dims4()?;
    let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let mask: Vec<f32> = (0..s * s).map(|i| if i % s <= i / s { 0.0 } else { f32::NEG_INFINITY }).collect();
    let mask = Tensor::from_vec(mask, (s, s), q.device())?;
    let p = softmax_last(&scores.broadcast_add(&mask)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

/// A differentiable softmax over the last dimension.
fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let m = x.max_keepdim(candle_core::D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(candle_core::D::Minus1)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::new_cuda(0)?;
    let stream = device.as_cuda_device()?.cuda_stream();
    let gpu = CudaDevice::shared(0)?;
    let (world, s, h, d) = (2, 256, 4, 64);
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let resolved = params.resolve(world, h, s)?;
    let x = Tensor::randn(0f32, 1.0, (1, s, h, d), &device)?.to_dtype(DType::BF16)?;
    let comms = DeviceComm::group(world, LocalOptions::default(), &gpu)?;
    let outs: Vec<Result<(Tensor, Tensor), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (gpu, stream, params, resolved, x) = (&gpu, &stream, &params, &resolved, &x);
                scope.spawn(move || -> Result<(Tensor, Tensor), Box<dyn std::error::Error + Send + Sync>> {
                    let rank = comm.rank();
                    let mine = ringattn::candle::shard(resolved, x, 1, rank)?;
                    let n = mine.dim(1)?;
                    let dims = Dims { b: 1, s_q: n, s_k: n, h_q: h, h_kv: h, d_qk: d, d_v: d };
                    let backend = DeviceBackend::on_stream(gpu.clone(), stream.clone(), ringattn::DType::BF16)?;
                    let comm: Arc<dyn Communicator<Buf = ringattn::cuda::DeviceBuf>> = Arc::new(comm);
                    let plan = Arc::new(ParallelPlan::new_shared(
                        comm,
                        Arc::new(backend),
                        params,
                        &dims,
                        ringattn::DType::BF16,
                    )?);
                    let q = Var::from_tensor(&mine)?;
                    let o = ringattn::candle::ring_attention(&plan, q.as_tensor(), &mine, &mine)?;
                    let grads = o.to_dtype(DType::F32)?.sum_all()?.backward()?;
                    let dq = grads.get(q.as_tensor()).ok_or("no gradient for q")?.clone();
                    Ok((o, dq))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread").map_err(|e| e.to_string())).collect()
    });
    let mut os = Vec::new();
    for r in outs {
        os.push(r?.0);
    }
    let o = ringattn::candle::unshard(&resolved, &os, 1)?.to_dtype(DType::F32)?;
    let x32 = x.to_dtype(DType::F32)?;
    let want = reference(&x32, &x32, &x32)?;
    let err = (o - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("ring attention on CUDA tensors over {world} ranks: max |o - reference| = {err:.3e}");
    if err > 0.05 {
        return Err(format!("o differs from the reference by {err}").into());
    }
    Ok(())
}
