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

/// This rank's shards of q, k, v and the loss weights (along the sequence) and its plan
/// (CPU backend, f32) for `params` resolved as `resolved`.
fn rank_plan(
    comm: Arc<dyn Communicator<Buf = ringattn::HostBuf>>,
    resolved: &ringattn::parallel::ResolvedParams,
    params: &ParallelParams,
    [q, k, v, w]: [&CTensor; 4],
) -> ringattn::Result<([CTensor; 4], Arc<ParallelPlan<'static, CpuBackend>>)> {
    let rank = comm.rank();
    let shard = |t: &CTensor| rc::shard(resolved, t, 1, rank);
    let shards = [shard(q)?, shard(k)?, shard(v)?, shard(w)?];
    let [b, n, h_q, d_qk] = shards[0].dims4().map(|(b, n, h, d)| [b, n, h, d])?;
    let (h_kv, d_v) = (shards[1].dim(2)?, shards[2].dim(3)?);
    let dims = Dims { b, s_q: n, s_k: n, h_q, h_kv, d_qk, d_v };
    let plan = Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), params, &dims, DType::F32)?);
    Ok((shards, plan))
}

/// Two layers, o1 = A(q, k, v) and o2 = A(o1, k, v), loss = Σ o2 ∘ w; layer 1 is run twice
/// (the first result dropped, as a checkpointed layer is recomputed), so three calls record
/// their own contexts. Gradients of q, k, v through candle's backward on 4 ranks against the
/// float64 oracle chained through both layers, with plain and soft-capped scores and packed
/// documents under the balanced layout.
#[test]
fn layers_and_a_recomputed_layer_give_the_oracles_gradients() {
    let (world, b, s, hq, hkv, d) = (4, 1, 48, 4, 2, 16);
    let q = randn(vec![b, s, hq, d], 1, DType::F32);
    let k = randn(vec![b, s, hkv, d], 2, DType::F32);
    let v = randn(vec![b, s, hkv, d], 3, DType::F32);
    let w = randn(vec![b, s, hq, d], 4, DType::F32);
    let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
    // Plain scores and soft-capped ones (the cap at tanh's bend: the drawn scores are about 1),
    // and packed documents under the balanced layout (the ring's zero-redundant schedule).
    let documents =
        AttentionParams { documents: Some(ringattn::Documents::new(vec![20, 5, 23]).unwrap()), ..causal.clone() };
    for (attention, layout) in [
        (causal.clone(), None),
        (AttentionParams { softcap: Some(2.0), ..causal }, None),
        (documents, Some(ringattn::Layout::Balanced)),
    ] {
        // The oracle, chained: layer 2 backward gives dO1 (its dq), dK2, dV2; layer 1 the rest.
        let o1 = reference::forward(&q, &k, &v, &attention).unwrap();
        let o1t = f32_tensor(&[b, s, hq, d], &o1.o);
        let l2 = reference::backward(&o1t, &k, &v, &w, &attention).unwrap();
        let d_o1 = f32_tensor(&[b, s, hq, d], &l2.dq);
        let l1 = reference::backward(&q, &k, &v, &d_o1, &attention).unwrap();
        let dk: Vec<f64> = l1.dk.iter().zip(&l2.dk).map(|(a, b)| a + b).collect();
        let dv: Vec<f64> = l1.dv.iter().zip(&l2.dv).map(|(a, b)| a + b).collect();
        for (strategy, degree) in [(Strategy::Ring, None), (Strategy::Ulysses, None), (Strategy::Usp, Some(2))] {
            let params = ParallelParams {
                strategy,
                layout,
                attention: attention.clone(),
                ulysses_degree: degree,
                ..Default::default()
            };
            let resolved = params.resolve(world, hq, s).unwrap();
            let (cq, ck, cv, cw) = (to_candle(&q), to_candle(&k), to_candle(&v), to_candle(&w));
            let parts = spmd_shared(world, LocalOptions::default(), |comm| {
                let ([qs, ks, vs, ws], plan) = rank_plan(comm, &resolved, &params, [&cq, &ck, &cv, &cw])?;
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
                assert!(
                    e < 1e-5,
                    "{strategy} {layout:?} softcap {:?}: {name} relative error {e:.3e}",
                    attention.softcap
                );
            }
        }
    }
}

/// Learnable sinks through candle ([`rc::ring_attention_with_sinks`]) on 4 ranks: the
/// output and the gradients of q, k, v and the sinks (each rank's over its rows, summed here
/// as the training loop's all-reduce does) against the float64 oracle with the call's sinks
/// (the plan was built with others), for the ring, Ulysses and USP, plain and soft-capped;
/// sinks of another shape and a plan without sinks are refused.
#[test]
fn learnable_sinks_get_the_oracles_gradient() {
    let (world, b, s, hq, hkv, d) = (4, 1, 48, 4, 2, 16);
    let q = randn(vec![b, s, hq, d], 1, DType::F32);
    let k = randn(vec![b, s, hkv, d], 2, DType::F32);
    let v = randn(vec![b, s, hkv, d], 3, DType::F32);
    let w = randn(vec![b, s, hq, d], 4, DType::F32);
    let call = vec![1.5f32, -0.5, 3.0, 0.25];
    for softcap in [None, Some(2.0f32)] {
        let attention =
            AttentionParams { mask: Mask::Causal, softcap, sinks: Some(call.clone()), ..Default::default() };
        let oracle = reference::backward(&q, &k, &v, &w, &attention).unwrap();
        for (strategy, degree) in [(Strategy::Ring, None), (Strategy::Ulysses, None), (Strategy::Usp, Some(2))] {
            let planned = AttentionParams { sinks: Some(vec![0.0; hq]), ..attention.clone() };
            let params = ParallelParams { strategy, attention: planned, ulysses_degree: degree, ..Default::default() };
            let resolved = params.resolve(world, hq, s).unwrap();
            let (cq, ck, cv, cw) = (to_candle(&q), to_candle(&k), to_candle(&v), to_candle(&w));
            let parts = spmd_shared(world, LocalOptions::default(), |comm| {
                let ([qs, ks, vs, ws], plan) = rank_plan(comm, &resolved, &params, [&cq, &ck, &cv, &cw])?;
                let qv = Var::from_tensor(&qs)?;
                let sinks = Var::from_tensor(&CTensor::new(call.as_slice(), &Device::Cpu)?)?;
                let bad = CTensor::new(&call[..3], &Device::Cpu)?;
                let refused = rc::ring_attention_with_sinks(&plan, qv.as_tensor(), &ks, &vs, &bad).is_err();
                let o = rc::ring_attention_with_sinks(&plan, qv.as_tensor(), &ks, &vs, sinks.as_tensor())?;
                let grads = (o.clone() * ws)?.sum_all()?.backward()?;
                let get = |x: &Var| {
                    grads
                        .get(x.as_tensor())
                        .map(from_candle)
                        .ok_or_else(|| ringattn::Error::InvalidArgument("no grad".into()))
                };
                Ok((from_candle(&o), get(&qv)?, get(&sinks)?, refused))
            });
            let parts: Vec<_> = parts.into_iter().map(|p| p.unwrap_or_else(|e| panic!("{strategy}: {e}"))).collect();
            assert!(parts.iter().all(|p| p.3), "{strategy}: sinks of 3 values for 4 heads refused");
            let whole = |pick: usize| {
                let picked: Vec<Tensor> =
                    parts.iter().map(|p| if pick == 0 { p.0.clone() } else { p.1.clone() }).collect();
                resolved.unshard(&picked).unwrap().to_f32_vec()
            };
            let (o, gq) = (whole(0), whole(1));
            let dsinks: Vec<f32> = (0..hq).map(|h| parts.iter().map(|p| p.2.to_f32_vec()[h]).sum()).collect();
            for (name, got, want) in
                [("o", &o, &oracle.o), ("dq", &gq, &oracle.dq), ("dsinks", &dsinks, &oracle.dsinks)]
            {
                let e = verify::rel_err(got, want);
                assert!(e < 1e-5, "{strategy} softcap {softcap:?}: {name} relative error {e:.3e}");
            }
        }
    }
    // A plan without sinks refuses a call's sinks (on every rank).
    let refusals = spmd_shared(2, LocalOptions::default(), |comm| {
        let dims = Dims { b, s_q: 8, s_k: 8, h_q: hq, h_kv: hkv, d_qk: d, d_v: d };
        let params = ParallelParams { seq_len: 16, ..Default::default() };
        let plan =
            Arc::new(ParallelPlan::new_shared(comm, Arc::new(CpuBackend::default()), &params, &dims, DType::F32)?);
        let x = CTensor::zeros((b, 8, hq, d), candle_core::DType::F32, &Device::Cpu)?;
        let kv = CTensor::zeros((b, 8, hkv, d), candle_core::DType::F32, &Device::Cpu)?;
        let sinks = CTensor::zeros(hq, candle_core::DType::F32, &Device::Cpu)?;
        Ok(rc::ring_attention_with_sinks(&plan, &x, &kv, &kv, &sinks).map_err(|e| e.to_string()).err())
    });
    for r in refusals {
        let e = r.unwrap().expect("refused");
        assert!(e.contains("without attention sinks"), "{e}");
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
        let dims = Dims { b: 1, s_q: 8, s_k: 8, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
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

/// The misuse tests' shape: 4 ranks, 32 tokens, 4 query and 2 kv heads of 8.
const MISUSE_SHAPE: (usize, usize, usize, usize, usize) = (4, 32, 4, 2, 8);

/// The misuse tests' parameters: causal (zigzag, the ring) and the same under USP.
fn misuse_params() -> (ParallelParams, ParallelParams) {
    let causal = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let usp = ParallelParams { strategy: Strategy::Usp, ..causal.clone() };
    (causal, usp)
}

/// This rank's part of whole-sequence tensors (`[b, s, …]` activations and `[s]` position
/// ids, the same wrong cut for all three) as a user cuts it by mistake: misuse 1, contiguous
/// chunks (`narrow`) under the zigzag layout; misuse 2, parameters resolved with the kv head
/// count instead of the query heads'.
fn wrongly_sharded(
    params: &ParallelParams,
    misuse: usize,
    rank: usize,
    t: [&CTensor; 3],
) -> candle_core::Result<[CTensor; 3]> {
    let (world, s, _, hkv, _) = MISUSE_SHAPE;
    let dim = |i: usize| if i == 2 { 0 } else { 1 };
    if misuse == 1 {
        let n = s / world;
        return Ok([0, 1, 2].map(|i| t[i].narrow(dim(i), rank * n, n).unwrap()));
    }
    let wrong = params.clone().resolve(world, hkv, s).map_err(candle_core::Error::wrap)?;
    Ok([0, 1, 2].map(|i| rc::shard(&wrong, t[i], dim(i), rank).unwrap()))
}

/// The three misuses that gave wrong numbers with no error now fail on every rank, each with
/// a message that names the fix: `[b, h, s, d]` tensors (candle's usual attention layout);
/// contiguous `narrow` shards under the default zigzag plan; a shard resolved with the KV head
/// count (USP's Ulysses degree 2 where the plan's is 4).
#[test]
fn the_three_misuses_fail_on_every_rank_naming_the_fix() {
    let (world, s, hq, hkv, d) = MISUSE_SHAPE;
    let (causal, usp) = misuse_params();
    let run = |params: &ParallelParams, misuse: usize| {
        spmd_shared(world, LocalOptions::default(), |comm| {
            let rank = comm.rank();
            let dims = Dims { b: 1, s_q: s / world, s_k: s / world, h_q: hq, h_kv: hkv, d_qk: d, d_v: d };
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
                _ => {
                    let [qw, kw, pos] = wrongly_sharded(params, misuse, rank, [&q, &kv, &ids])?;
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
            let ok = e.contains(needle) || (misuse > 0 && e.contains("of the group hold tokens at other positions"));
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
        let dims = Dims { b: 1, s_q: 16, s_k: 16, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
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

/// The group's attention against the float64 oracle on the whole sequence: f32, GQA 4/2,
/// causal, 4 ranks, every strategy, and plans that follow the batch — batch 2 of 32 tokens,
/// then a short batch of 1, then an uneven length (30 tokens over 4 ranks) — each planned on
/// first use (three plans kept) and exact.
#[test]
fn the_group_plans_from_the_tensors_and_follows_the_batch() {
    use rc::prelude::*;
    let (world, hq, hkv, d) = (4, 4, 2, 8);
    let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
    for strategy in [Strategy::Ring, Strategy::AllGather, Strategy::Ulysses, Strategy::Usp] {
        let params = ParallelParams { strategy, attention: attention.clone(), ..Default::default() };
        let shapes = [(2, 32), (1, 32), (1, 30)];
        let wholes: Vec<_> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(b, s))| {
                let seed = 10 * i as u64;
                (
                    randn(vec![b, s, hq, d], seed + 1, DType::F32),
                    randn(vec![b, s, hkv, d], seed + 2, DType::F32),
                    randn(vec![b, s, hkv, d], seed + 3, DType::F32),
                )
            })
            .collect();
        let runs = spmd_shared(world, LocalOptions::default(), |comm| {
            let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), hq)?;
            let mut outs = Vec::new();
            for (q, k, v) in &wholes {
                let s = q.shape()[1];
                let (q, k, v) = (cp.shard(&to_candle(q), 1)?, cp.shard(&to_candle(k), 1)?, cp.shard(&to_candle(v), 1)?);
                let o = cp.attention_at(&q, &k, &v, &cp.position_ids(s, &Device::Cpu)?)?;
                outs.push(o);
            }
            let plans = cp.plans().len();
            Ok((outs, plans))
        });
        let mut per_rank = Vec::new();
        for r in runs {
            let (outs, plans) = r.unwrap();
            assert_eq!(plans, 3, "{strategy:?}: one plan per shape");
            per_rank.push(outs);
        }
        for (i, (q, k, v)) in wholes.iter().enumerate() {
            let parts: Vec<CTensor> = per_rank.iter().map(|outs| outs[i].clone()).collect();
            let group = {
                let cp_params = params.resolve(world, hq, q.shape()[1]).unwrap();
                rc::unshard(&cp_params, &parts, 1).unwrap()
            };
            let oracle = reference::forward(q, k, v, &attention).unwrap();
            let err = verify::rel_err(&from_candle(&group).to_f32_vec(), &oracle.o);
            assert!(err < 1e-5, "{strategy:?}, shape {:?}: relative error {err}", q.shape());
        }
    }
}

/// Through the group, the three misuses fail on every rank, the rank at fault naming the fix:
/// a `[b, h, s, d]` tensor, contiguous chunks under the zigzag layout, and a shard from
/// parameters resolved with the KV head count; a call without position ids is refused in
/// the strict mode, on every rank; the errors are the crate's, typed, through candle.
#[test]
fn the_group_refuses_misuses_on_every_rank_with_typed_errors() {
    use rc::prelude::*;
    let (world, s, hq, hkv, d) = MISUSE_SHAPE;
    let (causal, usp) = misuse_params();
    let run = |params: &ParallelParams, misuse: usize| {
        spmd_shared(world, LocalOptions::default(), |comm| {
            let rank = comm.rank();
            let strict = GroupOptions { require_positions: true, ..Default::default() };
            let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), hq)?.with_options(strict)?;
            let dev = &Device::Cpu;
            let q = CTensor::randn(0f32, 1.0, (1, s, hq, d), dev)?;
            let kv = CTensor::randn(0f32, 1.0, (1, s, hkv, d), dev)?;
            let ids = CTensor::arange(0u32, s as u32, dev)?;
            let pos = cp.position_ids(s, dev)?;
            let r = match misuse {
                0 => {
                    let (qs, ks) = (cp.shard(&q, 1)?, cp.shard(&kv, 1)?);
                    let (qt, kt) = (qs.transpose(1, 2)?.contiguous()?, ks.transpose(1, 2)?.contiguous()?);
                    cp.attention_at(&qt, &kt, &kt, &pos)
                }
                1 | 2 => {
                    let [qw, kw, pw] = wrongly_sharded(params, misuse, rank, [&q, &kv, &ids])?;
                    cp.attention_at(&qw, &kw, &kw, &pw)
                }
                _ => {
                    let (qs, ks) = (cp.shard(&q, 1)?, cp.shard(&kv, 1)?);
                    cp.attention(&qs, &ks, &ks)
                }
            };
            let e = r.expect_err("a misuse must fail");
            let typed = rc::find_error(&e).map(|t| format!("{t}"));
            Ok((e.to_string(), typed, ringattn::Error::from(e)))
        })
    };
    for (params, misuse, needle) in [
        (&causal, 0, "transpose(1, 2) to [b, s, h, d]"),
        (&causal, 1, "shard"),
        (&usp, 2, "shard"),
        (&causal, 3, "require_positions"),
    ] {
        let errors: Vec<_> = run(params, misuse).into_iter().map(|r| r.unwrap()).collect();
        assert!(errors.iter().any(|(e, ..)| e.contains(needle)), "misuse {misuse}: no rank names the fix: {errors:?}");
        for (rank, (text, typed, recovered)) in errors.iter().enumerate() {
            assert!(typed.is_some(), "misuse {misuse}, rank {rank}: not a ringattn error: {text}");
            assert!(!text.contains("stack backtrace") && !text.contains("at /rustc"), "a backtrace in {text}");
            let ok = match misuse {
                0 => matches!(recovered, ringattn::Error::ShapeMismatch(_)) && text.contains(needle),
                3 => matches!(recovered, ringattn::Error::Positions(_) | ringattn::Error::Parallel(_)),
                _ => matches!(recovered, ringattn::Error::Positions(_)),
            };
            assert!(ok, "misuse {misuse}, rank {rank}: {recovered:?} / {text}");
        }
    }
}

/// A rank that skips the backward makes its peers fail with the typed `PeerFailed` naming it,
/// recovered from candle's error.
#[test]
fn a_peer_failure_arrives_typed_through_candle() {
    use rc::prelude::*;
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let runs = spmd_shared(2, LocalOptions::default(), |comm| {
        let rank = comm.rank();
        let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), 2)?;
        let x = Var::from_tensor(&cp.shard(&CTensor::randn(0f32, 1.0, (1, 32, 2, 8), &Device::Cpu)?, 1)?)?;
        let o = cp.attention_at(x.as_tensor(), x.as_tensor(), x.as_tensor(), &cp.position_ids(32, &Device::Cpu)?)?;
        if rank == 1 {
            return Ok(None);
        }
        Ok(Some(o.sum_all()?.backward().map(|_| ()).map_err(ringattn::Error::from)))
    });
    match runs[0].as_ref().unwrap().as_ref().unwrap() {
        Err(ringattn::Error::PeerFailed { rank: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// The lines of examples/train_lm.rs that exist because of ringattn (marked `// [cp]`) are
/// at most 15.
#[test]
fn the_training_example_needs_at_most_15_lines_of_ringattn() {
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/train_lm.rs")).unwrap();
    let n = src.lines().filter(|l| l.trim_end().ends_with("// [cp]")).count();
    assert!((5..=15).contains(&n), "{n} marked lines");
}

/// Gradient checkpointing in the pattern a user writes: two blocks `x + A(xWq, xWk, xWv)Wo`
/// over the group's attention on 4 ranks (ring and Ulysses), each block run through
/// `Checkpoint::apply` (recomputed inside candle's backward, its attention again collective)
/// against the same blocks kept in the graph: the same loss and the same gradients of the
/// input and of every weight; and an input that is plain data still gives the weights theirs.
#[test]
fn checkpointed_blocks_give_the_gradients_of_kept_blocks() {
    use rc::prelude::*;
    let (world, s, h, d) = (4, 32, 4, 8);
    let m = h * d;
    for strategy in [Strategy::Ring, Strategy::Ulysses] {
        let params = ParallelParams {
            strategy,
            attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
            ..Default::default()
        };
        let runs = spmd_shared(world, LocalOptions::default(), |comm| {
            let cp = Arc::new(ContextParallel::new(comm, CpuBackend::default(), params.clone(), h)?);
            let dev = &Device::Cpu;
            let pos = cp.position_ids(s, dev)?;
            let weights: Vec<Var> = (0..4)
                .map(|i| Var::from_tensor(&((randn_c(&[m, m], 100 + i)? * 0.2)?)))
                .collect::<candle_core::Result<_>>()?;
            let x_all = randn_c(&[1, s, m], 7)?;
            let g_all = randn_c(&[1, s, m], 8)?;
            let (x0, g) = (cp.shard(&x_all, 1)?, cp.shard(&g_all, 1)?);
            let block = {
                let (cp, pos, w) = (cp.clone(), pos.clone(), weights.clone());
                move |x: &CTensor| -> candle_core::Result<CTensor> {
                    let n = x.dim(1)?;
                    let proj = |w: &Var| x.broadcast_matmul(w.as_tensor())?.reshape((1, n, h, d));
                    let o = cp.attention_at(&proj(&w[0])?, &proj(&w[1])?, &proj(&w[2])?, &pos)?;
                    x + o.reshape((1, n, m))?.broadcast_matmul(w[3].as_tensor())?
                }
            };
            let mut results = Vec::new();
            for (checkpointed, data_input) in [(false, false), (true, false), (true, true)] {
                let x = Var::from_tensor(&x0)?;
                let input = if data_input { x0.clone() } else { x.as_tensor().clone() };
                let ck = Checkpoint::new();
                let mut y = input;
                for _ in 0..2 {
                    y = if checkpointed { ck.apply(&y, &weights, block.clone())? } else { block(&y)? };
                }
                let loss = (y * &g)?.sum_all()?;
                let mut grads = loss.backward()?;
                ck.merge_into(&mut grads)?;
                if checkpointed {
                    // The gradients a recomputation hands back record no operations: they do
                    // not keep the recomputed block's graph (its activations) alive.
                    for t in weights.iter().map(|w| w.as_tensor()).chain([x.as_tensor()]) {
                        assert!(grads.get(t).is_none_or(|g| !g.track_op()), "a gradient keeps a graph");
                    }
                }
                cp.all_reduce_gradients(&weights, &mut grads)?;
                let mut flat = Vec::new();
                for w in &weights {
                    flat.extend(grads.get(w.as_tensor()).expect("a weight gradient").flatten_all()?.to_vec1::<f32>()?);
                }
                let dx = grads.get(x.as_tensor()).map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                results.push((loss.to_scalar::<f32>()?, flat, dx));
            }
            Ok(results)
        });
        for r in runs {
            let results = r.unwrap();
            let (loss, dw, dx) = &results[0];
            for (i, (l, w, x)) in results.iter().enumerate().skip(1) {
                assert!((l - loss).abs() <= 1e-6 * loss.abs().max(1.0), "{strategy:?} run {i}: loss {l} vs {loss}");
                let err = verify::rel_err(w, &dw.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
                assert!(err < 1e-5, "{strategy:?} run {i}: weight gradients differ by {err}");
                if i == 1 {
                    let want: Vec<f64> = dx.as_ref().unwrap().iter().map(|&v| f64::from(v)).collect();
                    let e = verify::rel_err(x.as_ref().expect("dx"), &want);
                    assert!(e < 1e-5, "{strategy:?}: input gradients differ by {e}");
                }
            }
        }
    }
}

/// A seeded normal f32 candle tensor.
fn randn_c(shape: &[usize], seed: u64) -> candle_core::Result<CTensor> {
    CTensor::from_vec(randn(shape.to_vec(), seed, DType::F32).to_f32_vec(), shape, &Device::Cpu)
}

/// The group's deadline: a rank that stalls (neither calls nor returns) makes its peer's
/// attention call fail with the typed `Timeout` after the group's 300 ms, not the
/// communicator's 300 s.
#[test]
fn the_groups_deadline_bounds_every_wait() {
    use rc::prelude::*;
    let params = ParallelParams {
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let runs = spmd_shared(2, LocalOptions::default(), |comm| {
        let rank = comm.rank();
        let options = GroupOptions { deadline: Some(std::time::Duration::from_millis(300)), ..Default::default() };
        let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), 2)?.with_options(options)?;
        if rank == 1 {
            std::thread::sleep(std::time::Duration::from_secs(1));
            return Ok(None);
        }
        let x = cp.shard(&CTensor::randn(0f32, 1.0, (1, 16, 2, 8), &Device::Cpu)?, 1)?;
        let r = cp.attention_at(&x, &x, &x, &cp.position_ids(16, &Device::Cpu)?);
        Ok(Some((r.map(|_| ()).map_err(ringattn::Error::from), t0.elapsed())))
    });
    let (r, took) = runs[0].as_ref().unwrap().as_ref().unwrap();
    assert!(matches!(r, Err(ringattn::Error::Timeout { .. })), "{r:?}");
    assert!(*took < std::time::Duration::from_millis(1500), "took {took:?}");
}

/// Multi-head latent attention's head dims (`d_qk` 24, `d_v` 16) through the group: `o` has
/// v's head dim, and candle's backward gives the oracle's gradients of q, k and v on 4
/// ranks, for the ring, all-gather, Ulysses and USP.
#[test]
fn unequal_head_dims_through_the_group_give_the_oracles_gradients() {
    use rc::prelude::*;
    let (world, b, s, hq, hkv, d_qk, d_v) = (4, 2, 40, 4, 2, 24, 16);
    let q = randn(vec![b, s, hq, d_qk], 31, DType::F32);
    let k = randn(vec![b, s, hkv, d_qk], 32, DType::F32);
    let v = randn(vec![b, s, hkv, d_v], 33, DType::F32);
    let w = randn(vec![b, s, hq, d_v], 34, DType::F32);
    let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let oracle = reference::backward(&q, &k, &v, &w, &attention).unwrap();
    for strategy in [Strategy::Ring, Strategy::AllGather, Strategy::Ulysses, Strategy::Usp] {
        let params = ParallelParams { strategy, attention: attention.clone(), ..Default::default() };
        let parts = spmd_shared(world, LocalOptions::default(), |comm| {
            let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), hq)?;
            let shard = |t: &Tensor| cp.shard(&to_candle(t), 1);
            let (qv, kv, vv) =
                (Var::from_tensor(&shard(&q)?)?, Var::from_tensor(&shard(&k)?)?, Var::from_tensor(&shard(&v)?)?);
            let o =
                cp.attention_at(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &cp.position_ids(s, &Device::Cpu)?)?;
            let grads = (o.clone() * shard(&w)?)?.sum_all()?.backward()?;
            let get = |x: &Var| {
                grads.get(x.as_tensor()).cloned().ok_or_else(|| ringattn::Error::InvalidArgument("no grad".into()))
            };
            Ok([o, get(&qv)?, get(&kv)?, get(&vv)?])
        });
        let parts: Vec<_> = parts.into_iter().map(|p| p.unwrap_or_else(|e| panic!("{strategy}: {e}"))).collect();
        let resolved = params.resolve(world, hq, s).unwrap();
        for (i, (name, want)) in
            [("o", &oracle.o), ("dq", &oracle.dq), ("dk", &oracle.dk), ("dv", &oracle.dv)].into_iter().enumerate()
        {
            let whole = rc::unshard(&resolved, &parts.iter().map(|p| p[i].clone()).collect::<Vec<_>>(), 1).unwrap();
            let got = from_candle(&whole).to_f32_vec();
            assert_eq!(got.len(), want.len(), "{strategy}: {name} length");
            let e = verify::rel_err(&got, want);
            assert!(e < 1e-5, "{strategy}: {name} relative error {e:.3e}");
        }
    }
}

/// `ContextParallel` shards by length before it sees a call's shape, so it cannot resolve
/// `Strategy::Auto` per batch: it refuses it when built (never runs another strategy instead).
#[test]
fn context_parallel_refuses_auto() {
    let docs = ringattn::Documents::new(vec![10, 6]).unwrap();
    let params = ParallelParams {
        strategy: Strategy::Auto,
        attention: AttentionParams { mask: Mask::Causal, documents: Some(docs), ..Default::default() },
        ..Default::default()
    };
    let results = spmd_shared(2, LocalOptions::default(), |comm| {
        Ok(rc::ContextParallel::new(comm, CpuBackend::default(), params.clone(), 2)
            .map(|_| ())
            .map_err(|e| e.to_string()))
    });
    for r in results {
        let e = r.unwrap().unwrap_err();
        assert!(e.contains("resolve_for"), "{e}");
    }
}
