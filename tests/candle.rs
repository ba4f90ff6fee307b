//! The candle operation (feature `candle`): several layers of ring attention and a layer
//! recomputed inside the step (gradient checkpointing) give the float64 oracle's gradients
//! through candle's backward, on 4 in-process ranks, for the ring, Ulysses and USP.
#![cfg(feature = "candle")]

use std::sync::Arc;

use candle_core::{Device, Tensor as CTensor, Var};
use ringattn::comm::{spmd_shared, Communicator, LocalOptions};
use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan, Strategy};
use ringattn::{candle as rc, random::randn, reference, verify, AttentionParams, DType, Dims, Mask, Tensor};

/// A crate tensor as a candle one (f32, CPU).
fn to_candle(t: &Tensor) -> CTensor {
    CTensor::from_vec(t.to_f32_vec(), t.shape(), &Device::Cpu).unwrap()
}

fn from_candle(t: &CTensor) -> Tensor {
    Tensor::from_f32(t.dims().to_vec(), t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).unwrap()
}

/// f64 values as an f32 tensor of `shape`.
fn f32_tensor(shape: &[usize], v: &[f64]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), v.iter().map(|&x| x as f32).collect()).unwrap()
}

/// Two layers, o1 = A(q, k, v) and o2 = A(o1, k, v), loss = Σ o2 ∘ w; layer 1 is run twice
/// (the first result dropped, as a checkpointed layer is recomputed), so three calls record
/// their own contexts. Gradients of q, k, v through candle's backward on 4 ranks against the
/// float64 oracle chained through both layers.
#[test]
fn layers_and_a_recomputed_layer_give_the_oracles_gradients() {
    let (world, b, s, hq, hkv, d) = (4, 1, 48, 4, 2, 16);
    let q = randn(vec![b, s, hq, d], 1, DType::F32);
    let k = randn(vec![b, s, hkv, d], 2, DType::F32);
    let v = randn(vec![b, s, hkv, d], 3, DType::F32);
    let w = randn(vec![b, s, hq, d], 4, DType::F32);
    let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
    // The oracle, chained: layer 2 backward gives dO1 (its dq), dK2, dV2; layer 1 the rest.
    let o1 = reference::forward(&q, &k, &v, &attention).unwrap();
    let o1t = f32_tensor(&[b, s, hq, d], &o1.o);
    let l2 = reference::backward(&o1t, &k, &v, &w, &attention).unwrap();
    let d_o1 = f32_tensor(&[b, s, hq, d], &l2.dq);
    let l1 = reference::backward(&q, &k, &v, &d_o1, &attention).unwrap();
    let dk: Vec<f64> = l1.dk.iter().zip(&l2.dk).map(|(a, b)| a + b).collect();
    let dv: Vec<f64> = l1.dv.iter().zip(&l2.dv).map(|(a, b)| a + b).collect();
    for (strategy, degree) in [(Strategy::Ring, None), (Strategy::Ulysses, None), (Strategy::Usp, Some(2))] {
        let params =
            ParallelParams { strategy, attention: attention.clone(), ulysses_degree: degree, ..Default::default() };
        let resolved = params.resolve(world, hq, s).unwrap();
        let (cq, ck, cv, cw) = (to_candle(&q), to_candle(&k), to_candle(&v), to_candle(&w));
        let parts = spmd_shared(world, LocalOptions::default(), |comm| {
            let rank = comm.rank();
            let shard = |t: &CTensor| rc::shard(&resolved, t, 1, rank);
            let (qs, ks, vs, ws) = (shard(&cq)?, shard(&ck)?, shard(&cv)?, shard(&cw)?);
            let n = qs.dim(1)?;
            let dims = Dims { b, s_q: n, s_k: n, h_q: hq, h_kv: hkv, d };
            let plan =
                Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
            let (qv, kv, vv) = (Var::from_tensor(&qs)?, Var::from_tensor(&ks)?, Var::from_tensor(&vs)?);
            let first = rc::ring_attention(&plan, qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
            drop(first); // the checkpointed layer's first forward
            let o1 = rc::ring_attention(&plan, qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
            let o2 = rc::ring_attention(&plan, &o1, kv.as_tensor(), vv.as_tensor())?;
            let grads = (o2 * ws)?.sum_all()?.backward()?;
            let get = |x: &Var| {
                grads
                    .get(x.as_tensor())
                    .map(from_candle)
                    .ok_or_else(|| ringattn::Error::InvalidArgument("no grad".into()))
            };
            Ok((get(&qv)?, get(&kv)?, get(&vv)?))
        });
        let parts: Vec<_> = parts.into_iter().map(|p| p.unwrap_or_else(|e| panic!("{strategy}: {e}"))).collect();
        let whole = |f: &dyn Fn(&(Tensor, Tensor, Tensor)) -> Tensor| {
            resolved.unshard(&parts.iter().map(f).collect::<Vec<_>>()).unwrap().to_f32_vec()
        };
        let (gq, gk, gv) = (whole(&|p| p.0.clone()), whole(&|p| p.1.clone()), whole(&|p| p.2.clone()));
        for (name, got, want) in [("dq", &gq, &l1.dq), ("dk", &gk, &dk), ("dv", &gv, &dv)] {
            let e = verify::rel_err(got, want);
            assert!(e < 1e-5, "{strategy}: {name} relative error {e:.3e}");
        }
    }
}

/// Shards and their inverse by the plan's layout, gradients summed over the group
/// bit-identically, and the refusals: another dtype than the plan's.
#[test]
fn helpers_shard_unshard_and_sum_gradients() {
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let resolved = params.resolve(4, 2, 40).unwrap();
    let tokens = CTensor::arange(0u32, 80, &Device::Cpu).unwrap().reshape((2, 40)).unwrap();
    let parts: Vec<CTensor> = (0..4).map(|r| rc::shard(&resolved, &tokens, 1, r).unwrap()).collect();
    // Zigzag: rank 0 holds the first and the last chunk.
    assert_eq!(parts[0].get(0).unwrap().to_vec1::<u32>().unwrap(), vec![0, 1, 2, 3, 4, 35, 36, 37, 38, 39]);
    let back = rc::unshard(&resolved, &parts, 1).unwrap();
    assert_eq!(back.to_vec2::<u32>().unwrap(), tokens.to_vec2::<u32>().unwrap());
    let sums = spmd_shared(3, LocalOptions::default(), |comm| {
        let a = Var::from_tensor(&CTensor::new(&[1.0f32, 2.0], &Device::Cpu)?)?;
        let b = Var::from_tensor(&CTensor::new(&[[3.0f32]], &Device::Cpu)?)?;
        let r = comm.rank() as f64;
        let loss = ((a.as_tensor() * (r + 1.0))?.sum_all()? + (b.as_tensor() * r)?.sum_all()?)?;
        let mut grads = loss.backward()?;
        rc::all_reduce_gradients(&*comm, &[a.clone(), b.clone()], &mut grads)?;
        Ok((grads.get(a.as_tensor()).unwrap().to_vec1::<f32>()?, grads.get(b.as_tensor()).unwrap().to_vec2::<f32>()?))
    });
    for s in sums {
        let (a, b) = s.unwrap();
        assert_eq!(a, vec![6.0, 6.0]); // 1 + 2 + 3
        assert_eq!(b, vec![vec![3.0]]); // 0 + 1 + 2
    }
    // A bf16 tensor on an f32 plan is refused, naming both.
    let refused = spmd_shared(1, LocalOptions::default(), |comm| {
        let x = CTensor::zeros((1, 8, 2, 8), candle_core::DType::BF16, &Device::Cpu)?;
        let dims = Dims { b: 1, s_q: 8, s_k: 8, h_q: 2, h_kv: 2, d: 8 };
        let plan = Arc::new(ParallelPlan::new_shared(
            comm,
            Arc::new(CpuBackend::default()),
            &ParallelParams::default(),
            &dims,
            DType::F32,
        )?);
        Ok(rc::ring_attention(&plan, &x, &x, &x).map(|_| ()).map_err(|e| e.to_string()))
    });
    let e = refused.into_iter().next().unwrap().unwrap().unwrap_err();
    assert!(e.contains("BF16") && e.contains("F32"), "{e}");
}

/// The three misuses that gave wrong numbers with no error now fail on every rank, each with
/// a message that names the fix: `[b, h, s, d]` tensors (candle's usual attention layout);
/// contiguous `narrow` shards under the default zigzag plan; a shard resolved with the KV head
/// count (USP's Ulysses degree 2 where the plan's is 4).
#[test]
fn the_three_misuses_fail_on_every_rank_naming_the_fix() {
    let (world, s, hq, hkv, d) = (4, 32, 4, 2, 8);
    let causal = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let usp = ParallelParams { strategy: Strategy::Usp, ..causal.clone() };
    let run = |params: &ParallelParams, misuse: usize| {
        spmd_shared(world, LocalOptions::default(), |comm| {
            let rank = comm.rank();
            let dims = Dims { b: 1, s_q: s / world, s_k: s / world, h_q: hq, h_kv: hkv, d };
            let plan =
                Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), params, &dims, DType::F32)?);
            let dev = &Device::Cpu;
            let q = CTensor::randn(0f32, 1.0, (1, s, hq, d), dev)?;
            let kv = CTensor::randn(0f32, 1.0, (1, s, hkv, d), dev)?;
            let ids = CTensor::arange(0u32, s as u32, dev)?;
            let r = match misuse {
                // [b, h, s, d]: the element count matches, the layout does not.
                0 => {
                    let (qs, ks) = (rc::shard_like(&plan, &q, 1)?, rc::shard_like(&plan, &kv, 1)?);
                    let (qt, kt) = (qs.transpose(1, 2)?.contiguous()?, ks.transpose(1, 2)?.contiguous()?);
                    rc::ring_attention(&plan, &qt, &kt, &kt)
                }
                // Contiguous chunks under the zigzag layout, with their position ids.
                1 => {
                    let n = s / world;
                    let (qn, kn, pos) =
                        (q.narrow(1, rank * n, n)?, kv.narrow(1, rank * n, n)?, ids.narrow(0, rank * n, n)?);
                    rc::ring_attention_at(&plan, &qn, &kn, &kn, &pos)
                }
                // Sharded from parameters resolved with the KV head count.
                _ => {
                    let wrong = params.clone().resolve(world, hkv, s)?;
                    let (qw, kw, pos) = (
                        rc::shard(&wrong, &q, 1, rank)?,
                        rc::shard(&wrong, &kv, 1, rank)?,
                        rc::shard(&wrong, &ids, 0, rank)?,
                    );
                    rc::ring_attention_at(&plan, &qw, &kw, &kw, &pos)
                }
            };
            Ok(r.map(|_| ()).map_err(|e| e.to_string()))
        })
    };
    for (params, misuse, needle) in
        [(&causal, 0, "transpose(1, 2) to [b, s, h, d]"), (&causal, 1, "shard_like"), (&usp, 2, "shard_like")]
    {
        let errors: Vec<String> = run(params, misuse)
            .into_iter()
            .map(|r| r.unwrap().expect_err("a misuse must fail on every rank"))
            .collect();
        // The ranks whose own shard is wrong name the fix; the others (positions checks only)
        // say that other ranks disagree.
        assert!(errors.iter().any(|e| e.contains(needle)), "misuse {misuse}: no rank names the fix: {errors:?}");
        for (rank, e) in errors.iter().enumerate() {
            let ok = e.contains(needle) || (misuse > 0 && e.contains("rank(s) of the group"));
            assert!(ok, "misuse {misuse}, rank {rank}: {e}");
        }
        if misuse == 0 {
            assert!(errors.iter().all(|e| e.contains(needle)), "each rank sees its own shape: {errors:?}");
        }
    }
}

/// A planted replica drift (one rank's parameter nudged, as a forgotten gradient all-reduce
/// leaves it) is reported on every rank; identical replicas pass.
#[test]
fn a_replica_drift_is_reported_on_every_rank() {
    let runs = spmd_shared(3, LocalOptions::default(), |comm| {
        let v = Var::from_tensor(&CTensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu)?)?;
        let add = |acc: &mut ringattn::HostBuf, x: &ringattn::HostBuf| ringattn::comm::add_host(acc, x);
        rc::check_replicas(&*comm, &add, std::slice::from_ref(&v))?;
        if comm.rank() == 2 {
            v.set(&(v.as_tensor() + 1e-6)?)?;
        }
        Ok(rc::check_replicas(&*comm, &add, &[v]).map_err(|e| e.to_string()))
    });
    for r in runs {
        let e = r.unwrap().unwrap_err();
        assert!(e.contains("drifted") && e.contains("all_reduce_gradients"), "{e}");
    }
}

/// A rank that skips the backward (its thread returns after the forward) makes its peers,
/// waiting in the backward's ring for its messages, fail at once naming it — within 5 s, not
/// at the 300 s deadline.
#[test]
fn a_rank_that_skips_backward_makes_its_peers_fail_within_5_s() {
    let t0 = std::time::Instant::now();
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let runs = spmd_shared(2, LocalOptions::default(), |comm| {
        let rank = comm.rank();
        let dims = Dims { b: 1, s_q: 16, s_k: 16, h_q: 2, h_kv: 2, d: 8 };
        let plan =
            Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
        let q = Var::from_tensor(&CTensor::randn(0f32, 1.0, (1, 16, 2, 8), &Device::Cpu)?)?;
        let o = rc::ring_attention(&plan, q.as_tensor(), q.as_tensor(), q.as_tensor())?;
        if rank == 1 {
            return Ok(None);
        }
        Ok(Some(o.sum_all()?.backward().map(|_| ()).map_err(|e| e.to_string())))
    });
    let e = runs[0].as_ref().unwrap().as_ref().unwrap().as_ref().unwrap_err();
    assert!(e.contains("rank 1 returned without sending"), "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t0.elapsed());
    assert!(runs[1].as_ref().unwrap().is_none());
}
