//! Sequence-parallel strategies against the float64 oracle: every strategy and valid layout,
//! world sizes 1–8, uneven lengths, GQA, masks; forward and backward.

mod support;

use proptest::prelude::*;
use ringattn::comm::{LocalOptions, MessageOrder};
use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy as Strat};
use ringattn::{random::randn, verify, AttentionParams, DType, Documents, Layout, Mask};

#[derive(Debug, Clone)]
struct PCase {
    world: usize,
    strategy: Strat,
    layout: Layout,
    b: usize,
    s: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    /// v's head dim (multi-head latent attention when it differs from `d`).
    d_v: usize,
    mask: Mask,
    docs: Option<Vec<usize>>,
    /// The tanh soft-cap of the scores, if any.
    softcap: Option<f32>,
    /// The attention sinks' base logit, if any (spread over the heads).
    sink_level: Option<f32>,
    dtype: DType,
    ulysses_degree: Option<usize>,
    seed: u64,
    order: MessageOrder,
}

fn check(c: &PCase) -> Result<verify::Report, ringattn::Error> {
    let q = randn(vec![c.b, c.s, c.h_q, c.d], c.seed, c.dtype);
    let k = randn(vec![c.b, c.s, c.h_kv, c.d], c.seed + 1, c.dtype);
    let v = randn(vec![c.b, c.s, c.h_kv, c.d_v], c.seed + 2, c.dtype);
    let d_o = randn(vec![c.b, c.s, c.h_q, c.d_v], c.seed + 3, c.dtype);
    let attention = AttentionParams {
        mask: c.mask,
        documents: c.docs.clone().map(|d| Documents::new(d).unwrap()),
        softcap: c.softcap,
        sinks: support::sinks(c.sink_level, c.h_q),
        ..Default::default()
    };
    let params = ParallelParams {
        strategy: c.strategy,
        layout: Some(c.layout),
        attention: attention.clone(),
        seq_len: c.s,
        ulysses_degree: c.ulysses_degree,
        ..Default::default()
    };
    let options = LocalOptions { order: c.order, ..Default::default() };
    let run = run_in_process(c.world, options, &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)?;
    verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &run.forward, run.gradients.as_ref())
}

fn strategy_layout() -> impl Strategy<Value = (Strat, Layout)> {
    prop_oneof![
        Just((Strat::Ring, Layout::Contiguous)),
        Just((Strat::Ring, Layout::Zigzag)),
        Just((Strat::Ring, Layout::Striped)),
        Just((Strat::AllGather, Layout::Contiguous)),
        Just((Strat::AllGather, Layout::Zigzag)),
        Just((Strat::AllGather, Layout::Striped)),
        Just((Strat::Ulysses, Layout::Contiguous)),
        Just((Strat::Ulysses, Layout::Zigzag)),
        Just((Strat::Ulysses, Layout::Striped)),
        Just((Strat::Usp, Layout::Contiguous)),
        Just((Strat::Usp, Layout::Zigzag)),
        Just((Strat::Ring, Layout::Balanced)),
        Just((Strat::AllGather, Layout::Balanced)),
        Just((Strat::Ulysses, Layout::Balanced)),
        Just((Strat::Usp, Layout::Balanced)),
    ]
}

prop_compose! {
    fn pcase()(
        world in 1usize..=8,
        (strategy, layout) in strategy_layout(),
        b in 1usize..=2,
        s in 1usize..90,
        kv_choice in 0usize..4,
        d in prop::sample::select(&[8usize, 16, 32][..]),
        d_v in prop::sample::select(&[0usize, 0, 8, 24][..]),
        mask in prop_oneof![
            Just(Mask::None),
            Just(Mask::Causal),
            (0u64..20, 0u64..5).prop_map(|(l, r)| Mask::Window { left: Some(l), right: Some(r) }),
            (0u64..20).prop_map(|l| Mask::Window { left: Some(l), right: Some(0) }),
        ],
        docs in any::<bool>(),
        softcap in prop_oneof![2 => Just(None), 1 => Just(Some(0.8f32)), 1 => Just(Some(3.0f32))],
        sink_level in support::sink_level(),
        cut in 0usize..90,
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        seed in 0u64..10_000,
        fifo in any::<bool>(),
    ) -> PCase {
        // h_kv in {1, 3, 2P, P} with h_q a multiple of both h_kv and (for Ulysses) P.
        let h_kv = [1, 3, 2 * world, world][kv_choice];
        let h_q = match strategy {
            Strat::Ulysses | Strat::Usp => {
                let l = lcm(h_kv, world);
                if l > 24 { h_kv } else { l }
            }
            _ => h_kv * [1, 2][seed as usize % 2],
        };
        let strategy = if matches!(strategy, Strat::Ulysses) && h_q % world != 0 { Strat::Ring } else { strategy };
        let docs = docs.then(|| { let c = cut % (s + 1); vec![c, s - c] });
        let order = if fifo { MessageOrder::PerPeerFifo } else { MessageOrder::Tag };
        // d_v 0: equal head dims.
        let d_v = if d_v == 0 { d } else { d_v };
        PCase { world, strategy, layout, b, s, h_q, h_kv, d, d_v, mask, docs, softcap, sink_level, dtype, ulysses_degree: None, seed, order }
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

prop_compose! {
    /// Packed document batches under the balanced layout: 2–4 ranks, 1–7 documents of random
    /// lengths (empty ones too), causal, full or windowed, every strategy, GQA, f32 or bf16,
    /// either message order. Ring plans here take the zero-redundant schedule wherever it moves
    /// fewer bytes.
    fn balanced_case()(
        world in 2usize..=4,
        strategy in prop_oneof![Just(Strat::Ring), Just(Strat::AllGather), Just(Strat::Ulysses), Just(Strat::Usp)],
        lengths in prop::collection::vec(0usize..40, 1..8),
        mask in prop_oneof![
            2 => Just(Mask::Causal),
            1 => Just(Mask::None),
            1 => (0u64..12).prop_map(|l| Mask::Window { left: Some(l), right: Some(0) }),
            1 => (0u64..12, 0u64..4).prop_map(|(l, r)| Mask::Window { left: Some(l), right: Some(r) }),
        ],
        softcap in prop_oneof![3 => Just(None), 1 => Just(Some(3.0f32))],
        sink_level in support::sink_level(),
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        seed in 0u64..10_000,
        fifo in any::<bool>(),
    ) -> PCase {
        let s = lengths.iter().sum::<usize>().max(1);
        let docs = if lengths.iter().sum::<usize>() == 0 { vec![1] } else { lengths };
        let h_kv = [1, 2][seed as usize % 2];
        let h_q = 4 * world;
        let order = if fifo { MessageOrder::PerPeerFifo } else { MessageOrder::Tag };
        PCase { world, strategy, layout: Layout::Balanced, b: 1, s, h_q, h_kv, d: 16, d_v: 16, mask, docs: Some(docs), softcap, sink_level, dtype, ulysses_degree: None, seed, order }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(48)))]

    #[test]
    fn strategies_match_the_oracle(c in pcase()) {
        let report = check(&c).map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
        prop_assert!(report.pass(), "{c:?}\n{}", report.table());
    }

    #[test]
    fn balanced_document_batches_match_the_oracle(c in balanced_case()) {
        let report = check(&c).map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
        prop_assert!(report.pass(), "{c:?}\n{}", report.table());
    }
}

support::conformance::conformance!(cpu_every_strategy_tag_order, CpuBackend::default(), DType::F32, MessageOrder::Tag);
support::conformance::conformance!(
    cpu_every_strategy_per_peer_order,
    CpuBackend::default(),
    DType::BF16,
    MessageOrder::PerPeerFifo
);

#[test]
fn every_strategy_and_layout_on_one_case() {
    for (strategy, layout) in [
        (Strat::Ring, Layout::Contiguous),
        (Strat::Ring, Layout::Zigzag),
        (Strat::Ring, Layout::Striped),
        (Strat::AllGather, Layout::Zigzag),
        (Strat::Ulysses, Layout::Striped),
        (Strat::Usp, Layout::Zigzag),
        (Strat::Ring, Layout::Balanced),
        (Strat::AllGather, Layout::Balanced),
        (Strat::Usp, Layout::Balanced),
    ] {
        let c = PCase {
            world: 4,
            strategy,
            layout,
            b: 2,
            s: 77,
            h_q: 8,
            h_kv: 2,
            d: 16,
            d_v: 16,
            mask: Mask::Causal,
            docs: None,
            softcap: None,
            sink_level: None,
            dtype: DType::F32,
            ulysses_degree: Some(2),
            seed: 5,
            order: MessageOrder::PerPeerFifo,
        };
        let r = check(&c).unwrap();
        assert!(r.pass(), "{c:?}\n{}", r.table());
    }
}

/// Rings with ranks that hold no token (s < world), which compute no block: their (empty)
/// partials and accumulators are made by the driver instead of taken from a first computed
/// block; and rings that documents stop after one hop.
#[test]
fn ranks_without_tokens_or_visible_blocks_match_the_oracle() {
    for (s, world, docs) in [(3, 4, None), (1, 8, None), (6, 3, Some(vec![2, 2, 2])), (9, 3, Some(vec![3, 0, 6]))] {
        for (mask, dtype) in [(Mask::Causal, DType::F32), (Mask::None, DType::BF16)] {
            let c = PCase {
                world,
                strategy: Strat::Ring,
                layout: Layout::Contiguous,
                b: 1,
                s,
                h_q: 2,
                h_kv: 1,
                d: 16,
                // Ranks without tokens hold empty K and V blocks of their own widths.
                d_v: 8,
                mask,
                docs: docs.clone(),
                softcap: Some(2.0),
                // (Ranks without tokens merge no sink and add nothing to their gradient.)
                sink_level: Some(1.0),
                dtype,
                ulysses_degree: None,
                seed: 11,
                order: MessageOrder::Tag,
            };
            let r = check(&c).unwrap();
            assert!(r.pass(), "{c:?}\n{}", r.table());
        }
    }
}

/// Sinks given per call ([`ParallelPlan::forward_with_sinks`], what a training loop with
/// learnable sinks does) on a plan built with other values: the output, LSE and gradients
/// (dσ summed over the ranks) are those of the call's sinks, under ring and Ulysses; a plan
/// built without sinks refuses them on every rank.
#[test]
fn sinks_given_per_call_replace_the_plans() {
    use ringattn::comm::{spmd, Communicator};
    use ringattn::parallel::ParallelPlan;
    use ringattn::{reference, Dims, HostBuf, Tensor};
    let (b, s, h_q, h_kv, d) = (1, 40, 4, 2, 16);
    let q = randn(vec![b, s, h_q, d], 1, DType::F32);
    let k = randn(vec![b, s, h_kv, d], 2, DType::F32);
    let v = randn(vec![b, s, h_kv, d], 3, DType::F32);
    let d_o = randn(vec![b, s, h_q, d], 4, DType::F32);
    let call = vec![2.0f32, -1.0, 3.5, 0.5];
    let want = AttentionParams { mask: Mask::Causal, sinks: Some(call.clone()), ..Default::default() };
    let oracle = reference::backward(&q, &k, &v, &d_o, &want).unwrap();
    for strategy in [Strat::Ring, Strat::Ulysses] {
        let planned = AttentionParams { sinks: Some(vec![0.0; h_q]), ..want.clone() };
        let params = ParallelParams { strategy, attention: planned, ..Default::default() };
        let resolved = params.resolve(2, h_q, s).unwrap();
        let parts = spmd(2, LocalOptions::default(), |comm| {
            let backend = CpuBackend::default();
            let rank = comm.rank();
            let mine = |t: &Tensor| resolved.shard(t, rank).unwrap();
            let (qs, ks, vs, dos) = (mine(&q), mine(&k), mine(&v), mine(&d_o));
            let n = qs.shape()[1];
            let dims = Dims { b, s_q: n, s_k: n, h_q, h_kv, d_qk: d, d_v: d };
            let plan = ParallelPlan::new(comm, &backend, &resolved, &dims, DType::F32)?;
            let up = |t: &Tensor| plan.upload_tensor(t).unwrap();
            let sinks = backend_sinks(&call);
            let (o, saved) = plan.forward_with_sinks(&up(&qs), &up(&ks), &up(&vs), &sinks)?;
            let g = plan.backward(&saved, &up(&dos))?;
            let take = |x: &HostBuf, shape: Vec<usize>, dt| plan.download_tensor(x, shape, dt).unwrap();
            Ok((
                take(&o, dims.o_shape(), DType::F32),
                take(&saved.lse, dims.lse_shape(), DType::F32),
                take(&g.dq, dims.q_shape(), DType::F32),
                take(g.dsinks.as_ref().expect("dsinks"), vec![h_q], DType::F32),
            ))
        });
        let parts: Vec<_> = parts.into_iter().map(|r| r.unwrap()).collect();
        let o = resolved.unshard(&parts.iter().map(|p| &p.0).collect::<Vec<_>>()).unwrap();
        let lse = resolved.unshard_lse(&parts.iter().map(|p| &p.1).collect::<Vec<_>>()).unwrap();
        let dq = resolved.unshard(&parts.iter().map(|p| &p.2).collect::<Vec<_>>()).unwrap();
        let close = |x: &[f32], r: &[f64], what: &str| {
            let err = verify::rel_err(x, r);
            assert!(err < 1e-5, "{strategy} {what}: relative error {err}");
        };
        close(&o.as_f32(), &oracle.o, "o");
        close(&lse.as_f32(), &oracle.lse, "lse");
        close(&dq.as_f32(), &oracle.dq, "dq");
        let dsinks: Vec<f32> = (0..h_q).map(|h| parts.iter().map(|p| p.3.as_f32()[h]).sum()).collect();
        close(&dsinks, &oracle.dsinks, "dsinks");
    }
    // Without sinks in the plan, a call's sinks are refused on every rank.
    let refusals = spmd(2, LocalOptions::default(), |comm| {
        let backend = CpuBackend::default();
        let dims = Dims { b, s_q: s / 2, s_k: s / 2, h_q, h_kv, d_qk: d, d_v: d };
        let params = ParallelParams { strategy: Strat::Ring, seq_len: s, ..Default::default() };
        let plan = ParallelPlan::new(comm, &backend, &params, &dims, DType::F32)?;
        let x = plan.upload_tensor(&Tensor::zeros(vec![b, s / 2, h_q, d], DType::F32))?;
        let kv = plan.upload_tensor(&Tensor::zeros(vec![b, s / 2, h_kv, d], DType::F32))?;
        Ok(plan.forward_with_sinks(&x, &kv, &kv, &backend_sinks(&call)).err().map(|e| e.to_string()))
    });
    for r in refusals {
        let e = r.unwrap().expect("refused");
        assert!(e.contains("without attention sinks"), "{e}");
    }
}

fn backend_sinks(x: &[f32]) -> ringattn::HostBuf {
    ringattn::HostBuf::from(x.to_vec())
}

mod faults {
    use std::time::{Duration, Instant};

    use ringattn::comm::{spmd, Communicator, LocalOptions};
    use ringattn::parallel::{self, CpuBackend, ParallelParams, Strategy};
    use ringattn::{random::randn, AttentionParams, DType, Error, Layout, Mask, Tensor};

    fn shards(s: usize, world: usize, rank: usize, p: &ParallelParams) -> (Tensor, Tensor, Tensor) {
        let resolved = p.resolve(world, 4, s).unwrap();
        let sh = |t: &Tensor| resolved.shard(t, rank).unwrap();
        (
            sh(&randn(vec![1, s, 4, 8], 1, DType::F32)),
            sh(&randn(vec![1, s, 2, 8], 2, DType::F32)),
            sh(&randn(vec![1, s, 2, 8], 3, DType::F32)),
        )
    }

    fn ring(s: usize) -> ParallelParams {
        ParallelParams { strategy: Strategy::Ring, seq_len: s, ..Default::default() }
    }

    #[test]
    fn a_failing_rank_fails_its_peers_promptly() {
        let p = ring(64);
        let opts = LocalOptions { deadline: Duration::from_secs(30), ..Default::default() };
        let start = Instant::now();
        let out = spmd(4, opts, |c| {
            if c.rank() == 2 {
                return Err(Error::InvalidArgument("rank 2 gives up".into()));
            }
            let (q, k, v) = shards(64, 4, c.rank(), &p);
            parallel::forward(c, &CpuBackend::default(), &q, &k, &v, &p).map(|_| ())
        });
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
        for (r, res) in out.iter().enumerate() {
            let e = res.as_ref().unwrap_err();
            if r != 2 {
                assert!(matches!(e, Error::PeerFailed { rank: 2, .. }), "rank {r}: {e}");
                assert!(e.to_string().contains("rank 2 gives up"), "{e}");
            }
        }
    }

    #[test]
    fn a_panicking_rank_fails_its_peers() {
        let p = ring(64);
        let out = spmd(3, LocalOptions::default(), |c| {
            if c.rank() == 0 {
                panic!("boom");
            }
            let (q, k, v) = shards(64, 3, c.rank(), &p);
            parallel::forward(c, &CpuBackend::default(), &q, &k, &v, &p).map(|_| ())
        });
        assert!(out[0].as_ref().unwrap_err().to_string().contains("boom"));
        for res in &out[1..] {
            assert!(matches!(res, Err(Error::PeerFailed { rank: 0, .. })));
        }
    }

    #[test]
    fn a_silent_peer_times_out_naming_it() {
        let opts = LocalOptions { deadline: Duration::from_millis(200), ..Default::default() };
        let out = spmd::<ringattn::HostBuf, _>(2, opts, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(600));
                return Ok(());
            }
            c.irecv(1, 7, 4, ringattn::Elem::F32)?.wait().map(|_| ())
        });
        let e = out[0].as_ref().unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: 1, .. }), "{e}");
        assert!(e.to_string().contains("rank 1") && e.to_string().contains("tag 7"), "{e}");
    }

    #[test]
    fn a_message_of_the_wrong_length_is_an_error_naming_the_peer() {
        let out = spmd::<ringattn::HostBuf, _>(2, LocalOptions::default(), |c| {
            if c.rank() == 1 {
                return c.isend(0, 3, ringattn::HostBuf::from(vec![1.0; 5]))?.wait();
            }
            c.irecv(1, 3, 4, ringattn::Elem::F32)?.wait().map(|_| ())
        });
        let e = out[0].as_ref().unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch(_)), "{e}");
        assert!(e.to_string().contains("rank 1") && e.to_string().contains("5 F32 values, expected 4 F32"), "{e}");
        // The same length in another element type is refused too.
        let out = spmd::<ringattn::HostBuf, _>(2, LocalOptions::default(), |c| {
            if c.rank() == 1 {
                return c.isend(0, 3, ringattn::HostBuf::filled(4, 1.0, DType::BF16))?.wait();
            }
            c.irecv(1, 3, 4, ringattn::Elem::F32)?.wait().map(|_| ())
        });
        let e = out[0].as_ref().unwrap_err();
        assert!(e.to_string().contains("4 BF16 values, expected 4 F32"), "{e}");
    }

    #[test]
    fn a_handshake_mismatch_fails_everyone_with_one_message() {
        let out = spmd(3, LocalOptions::default(), |c| {
            let mut p = ring(30);
            if c.rank() == 1 {
                p.attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
                p.layout = Some(Layout::Contiguous);
            }
            let (q, k, v) = shards(30, 3, c.rank(), &p);
            parallel::forward(c, &CpuBackend::default(), &q, &k, &v, &p).map(|_| ())
        });
        let msgs: Vec<String> = out.iter().map(|r| r.as_ref().unwrap_err().to_string()).collect();
        assert!(msgs[0].contains("handshake") && msgs[0].contains("rank 1"), "{}", msgs[0]);
        assert!(msgs.iter().all(|m| m == &msgs[0]), "{msgs:?}");
    }

    #[test]
    fn a_wrong_shard_fails_everyone() {
        let p = ring(30);
        let out = spmd(2, LocalOptions::default(), |c| {
            // Rank 0 cuts its shard as if the sequence had 32 tokens.
            let (q, k, v) = if c.rank() == 0 { shards(32, 2, 0, &ring(32)) } else { shards(30, 2, 1, &p) };
            parallel::forward(c, &CpuBackend::default(), &q, &k, &v, &p).map(|_| ())
        });
        for r in &out {
            let e = r.as_ref().unwrap_err();
            assert!(matches!(e, Error::Handshake(_)) && e.to_string().contains("rank 0 holds 16"), "{e}");
        }
    }

    #[test]
    fn ulysses_with_indivisible_heads_errors_cleanly() {
        let p = ParallelParams { strategy: Strategy::Ulysses, seq_len: 30, ..Default::default() };
        let e = p.validate(3, 4).unwrap_err();
        assert!(matches!(e, Error::Parallel(_)) && e.to_string().contains("h_q = 4"), "{e}");
        let q = randn(vec![1, 30, 4, 8], 1, DType::F32);
        let k = randn(vec![1, 30, 2, 8], 1, DType::F32);
        let r = parallel::run_in_process(3, LocalOptions::default(), &CpuBackend::default(), &q, &k, &k, None, &p);
        assert!(matches!(r, Err(Error::Parallel(_))));
        let usp = ParallelParams { strategy: Strategy::Usp, layout: Some(Layout::Striped), ..Default::default() };
        assert!(usp.validate(4, 8).unwrap_err().to_string().contains("striped"));
    }
}

mod schedules {
    use ringattn::comm::LocalOptions;
    use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, ProcessRun, Strategy};
    use ringattn::{random::randn, reference, verify, AttentionParams, DType, Layout, Mask, Tensor};

    /// The ring over `world` in-process ranks on the CPU: forward, and backward with `d_o`.
    fn ring(
        world: usize,
        layout: Layout,
        attention: &AttentionParams,
        [q, k, v]: [&Tensor; 3],
        d_o: Option<&Tensor>,
    ) -> ProcessRun {
        let p = ParallelParams {
            strategy: Strategy::Ring,
            layout: Some(layout),
            attention: attention.clone(),
            seq_len: q.shape()[1],
            ulysses_degree: None,
            ..Default::default()
        };
        run_in_process(world, LocalOptions::default(), &CpuBackend::default(), q, k, v, d_o, &p).unwrap()
    }

    /// Bytes all ranks sent, forward and backward.
    fn bytes_sent(r: &ProcessRun) -> u64 {
        r.stats.iter().map(|(f, b)| f.bytes_sent + b.as_ref().map_or(0, |b| b.bytes_sent)).sum()
    }

    /// A run's outputs and gradients against the oracle.
    fn assert_exact(r: &ProcessRun, [q, k, v, d_o]: [&Tensor; 4], attention: &AttentionParams, what: &str) {
        let report =
            verify::check_results(q, k, v, Some(d_o), None, attention, &r.forward, r.gradients.as_ref()).unwrap();
        assert!(report.pass(), "{what}\n{}", report.table());
    }

    /// Causal attention work (visible pairs) per rank, max over mean.
    fn imbalance(layout: Layout, s: usize, world: usize) -> f64 {
        let work: Vec<f64> =
            (0..world).map(|r| layout.positions(s, world, r).unwrap().iter().map(|q| (q + 1) as f64).sum()).collect();
        let mean = work.iter().sum::<f64>() / world as f64;
        work.iter().cloned().fold(0.0, f64::max) / mean
    }

    #[test]
    fn zigzag_and_striped_balance_causal_work() {
        for world in [2, 4, 8] {
            for s in [16384, 10007] {
                assert!(imbalance(Layout::Zigzag, s, world) <= 1.15, "zigzag P={world} s={s}");
                assert!(imbalance(Layout::Striped, s, world) <= 1.15, "striped P={world} s={s}");
            }
            assert!(imbalance(Layout::Contiguous, 16384, world) > 1.15, "contiguous is the unbalanced one");
        }
    }

    /// Packed documents under the balanced layout: the ring takes the zero-redundant schedule
    /// (each rank's K/V rows sent only to the ranks that see them) and moves at most 0.6 of the
    /// pass-along zigzag ring's bytes forward and backward (0.29–0.57 on these batches), and
    /// stays exact.
    #[test]
    fn balanced_documents_send_only_what_is_seen() {
        use ringattn::random::{document_lengths, DocLengths};
        let (s, world) = (2048, 4);
        let dist = DocLengths::LogNormal { median: 190.0, sigma: 1.0, min: 16, max: 1024 };
        for seed in 0..5 {
            let docs = document_lengths(seed, s, &dist);
            let attention = AttentionParams {
                mask: Mask::Causal,
                documents: Some(ringattn::Documents::new(docs.clone()).unwrap()),
                ..Default::default()
            };
            let (q, k, v, d_o) = (
                randn(vec![1, s, 2, 8], seed, DType::F32),
                randn(vec![1, s, 1, 8], seed + 1, DType::F32),
                randn(vec![1, s, 1, 8], seed + 2, DType::F32),
                randn(vec![1, s, 2, 8], seed + 3, DType::F32),
            );
            let balanced = ring(world, Layout::Balanced, &attention, [&q, &k, &v], Some(&d_o));
            // The pass-along zigzag ring moves every block to every rank: its bytes are those of
            // the same shapes without a mask or documents, where every block is seen.
            let passing = ring(world, Layout::Zigzag, &AttentionParams::default(), [&q, &k, &v], Some(&d_o));
            let ratio = bytes_sent(&balanced) as f64 / bytes_sent(&passing) as f64;
            assert!(
                ratio <= 0.6,
                "seed {seed} (documents {docs:?}): balanced sends {ratio:.2} of the zigzag ring's bytes"
            );
            assert!(balanced.stats.iter().all(|(f, _)| f.flops > 0.0));
            assert_exact(&balanced, [&q, &k, &v, &d_o], &attention, &format!("seed {seed}"));
        }
    }

    /// The all-gather with packed documents gathers only the rows each rank sees (an
    /// all-to-all of them; dK/dV returned the same way): fewer bytes than gathering every
    /// block — a causal sequence without documents too — and exact, forward and backward,
    /// under every layout.
    #[test]
    fn the_all_gather_gathers_only_what_is_seen() {
        use ringattn::random::{document_lengths, DocLengths};
        let (s, world) = (1536, 3);
        let docs = document_lengths(5, s, &DocLengths::LogNormal { median: 150.0, sigma: 1.0, min: 8, max: 900 });
        let (q, k, v, d_o) = (
            randn(vec![2, s, 2, 8], 11, DType::BF16),
            randn(vec![2, s, 1, 8], 12, DType::BF16),
            randn(vec![2, s, 1, 8], 13, DType::BF16),
            randn(vec![2, s, 2, 8], 14, DType::BF16),
        );
        let run = |layout: Layout, attention: &AttentionParams| {
            let p = ParallelParams {
                strategy: Strategy::AllGather,
                layout: Some(layout),
                attention: attention.clone(),
                seq_len: s,
                ulysses_degree: None,
                ..Default::default()
            };
            run_in_process(world, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &p).unwrap()
        };
        let whole = bytes_sent(&run(Layout::Zigzag, &AttentionParams::default()));
        let packed = AttentionParams {
            mask: Mask::Causal,
            documents: Some(ringattn::Documents::new(docs).unwrap()),
            ..Default::default()
        };
        let causal = AttentionParams { mask: Mask::Causal, ..Default::default() };
        for (attention, what, most) in [(&packed, "documents", 0.6), (&causal, "causal", 0.75)] {
            for layout in [Layout::Balanced, Layout::Zigzag, Layout::Contiguous] {
                if layout == Layout::Balanced && attention.documents.is_none() {
                    continue;
                }
                let r = run(layout, attention);
                let ratio = bytes_sent(&r) as f64 / whole as f64;
                assert!(ratio <= most, "{what} {layout:?}: {ratio:.2} of the whole gather's bytes");
                assert_exact(&r, [&q, &k, &v, &d_o], attention, &format!("{what} {layout:?}"));
            }
        }
    }

    /// The direct schedule's whole-window sends (blocks of 1,024 rows and more: here 2,048 rows
    /// per rank, windows of 128) with two batch elements, packed documents and a window, under
    /// the balanced and zigzag layouts, forward and backward against the oracle.
    #[test]
    fn windowed_sends_with_batches_match_the_oracle() {
        use ringattn::random::{document_lengths, DocLengths};
        let (s, world) = (4096, 2);
        let docs = document_lengths(7, s, &DocLengths::LogNormal { median: 700.0, sigma: 1.0, min: 32, max: 3000 });
        let draw = |h: usize, seed: u64| randn(vec![2, s, h, 8], seed, DType::F32);
        let (q, k, v, d_o) = (draw(2, 1), draw(1, 2), draw(1, 3), draw(2, 4));
        for mask in [Mask::Causal, Mask::Window { left: Some(300), right: Some(0) }] {
            let attention = AttentionParams {
                mask,
                documents: Some(ringattn::Documents::new(docs.clone()).unwrap()),
                ..Default::default()
            };
            for layout in [Layout::Balanced, Layout::Zigzag] {
                let run = ring(world, layout, &attention, [&q, &k, &v], Some(&d_o));
                assert_exact(&run, [&q, &k, &v, &d_o], &attention, &format!("{mask:?} {layout:?}"));
                // The direct schedule ran: fewer bytes than the pass-along ring's
                // s·h_kv·(d_qk + d_v)·(2e(P − 1) + 4P) (f32: e = 4), times the batch.
                let sent = bytes_sent(&run);
                assert!(sent < 2 * (s * 16 * (8 + 8)) as u64, "{mask:?} {layout:?}: {sent} bytes");
            }
        }
    }

    #[test]
    fn a_window_stops_the_ring_early() {
        let (s, world) = (400, 4);
        let q = randn(vec![1, s, 2, 8], 1, DType::F32);
        let k = randn(vec![1, s, 2, 8], 2, DType::F32);
        let run = |mask: Mask| {
            ring(world, Layout::Contiguous, &AttentionParams { mask, ..Default::default() }, [&q, &k, &k], None)
        };
        let full = run(Mask::Causal);
        let window = run(Mask::Window { left: Some(50), right: Some(0) });
        let sent = bytes_sent;
        assert_eq!(full.stats[0].0.hops, 4);
        assert_eq!(window.stats[0].0.hops, 2, "a 50-token window over 100-token shards needs one hop back");
        assert_eq!(window.stats[0].0.skipped_hops, 2);
        assert!(sent(&window) * 3 <= sent(&full) + 1000, "{} vs {}", sent(&window), sent(&full));
        // And it is still exact.
        let p = AttentionParams { mask: Mask::Window { left: Some(50), right: Some(0) }, ..Default::default() };
        let oracle = reference::forward(&q, &k, &k, &p).unwrap();
        assert!(verify::rel_err(&window.forward.o.to_f32_vec(), &oracle.o) < 1e-5);
    }

    #[test]
    fn bf16_error_does_not_grow_with_ranks() {
        let (s, hq) = (256, 8);
        let q = randn(vec![1, s, hq, 32], 1, DType::BF16);
        let k = randn(vec![1, s, 2, 32], 2, DType::BF16);
        let v = randn(vec![1, s, 2, 32], 3, DType::BF16);
        let d_o = randn(vec![1, s, hq, 32], 4, DType::BF16);
        let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let oracle = reference::backward(&q, &k, &v, &d_o, &attention).unwrap();
        let errs = |world: usize| {
            let p = ParallelParams {
                strategy: Strategy::Ring,
                attention: attention.clone(),
                seq_len: s,
                ..Default::default()
            };
            let r = run_in_process(world, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &p)
                .unwrap();
            let g = r.gradients.unwrap();
            [
                verify::rel_err(&r.forward.o.to_f32_vec(), &oracle.o),
                verify::rel_err(&g.dq.to_f32_vec(), &oracle.dq),
                verify::rel_err(&g.dk.to_f32_vec(), &oracle.dk),
                verify::rel_err(&g.dv.to_f32_vec(), &oracle.dv),
            ]
        };
        let (one, eight) = (errs(1), errs(8));
        for i in 0..4 {
            assert!(eight[i] <= 1.5 * one[i], "output {i}: P=8 {} vs P=1 {}", eight[i], one[i]);
        }
    }
}

mod exactly_once {
    use std::sync::atomic::{AtomicU64, Ordering};

    use ringattn::comm::LocalOptions;
    use ringattn::parallel::{
        run_in_process, Backend, CpuBackend, ForwardPartial, GradientPartial, HostMemory, ParallelParams, Pending,
        Strategy,
    };
    use ringattn::{random::randn, AttentionParams, DType, Dims, Layout, Mask, Positions, Result};

    /// Counts the visible (query, key, head) triples of every block it computes.
    #[derive(Default)]
    struct Counting {
        inner: CpuBackend,
        fwd: AtomicU64,
        bwd: AtomicU64,
    }

    fn visible(mask: Mask, qp: &Positions, kp: &Positions) -> u64 {
        let kv = kp.to_vec();
        qp.iter().map(|q| kv.iter().filter(|&&k| mask.allows(q, k)).count() as u64).sum()
    }

    impl HostMemory for Counting {}

    impl Backend for Counting {
        fn forward_block(
            &self,
            dims: Dims,
            q: &ringattn::HostBuf,
            k: &ringattn::HostBuf,
            v: &ringattn::HostBuf,
            q_pos: &Positions,
            k_pos: &Positions,
            params: &AttentionParams,
        ) -> Result<Pending<ForwardPartial<ringattn::HostBuf>>> {
            self.fwd.fetch_add(visible(params.mask, q_pos, k_pos) * (dims.b * dims.h_q) as u64, Ordering::Relaxed);
            self.inner.forward_block(dims, q, k, v, q_pos, k_pos, params)
        }

        fn backward_block(
            &self,
            dims: Dims,
            q: &ringattn::HostBuf,
            k: &ringattn::HostBuf,
            v: &ringattn::HostBuf,
            o: &ringattn::HostBuf,
            lse: &ringattn::HostBuf,
            d_o: &ringattn::HostBuf,
            big_d: &ringattn::HostBuf,
            q_pos: &Positions,
            k_pos: &Positions,
            params: &AttentionParams,
        ) -> Result<Pending<GradientPartial<ringattn::HostBuf>>> {
            self.bwd.fetch_add(visible(params.mask, q_pos, k_pos) * (dims.b * dims.h_q) as u64, Ordering::Relaxed);
            self.inner.backward_block(dims, q, k, v, o, lse, d_o, big_d, q_pos, k_pos, params)
        }

        fn step_input(&self, x: &ringattn::HostBuf) -> Result<ringattn::HostBuf> {
            self.inner.step_input(x)
        }

        fn softmax_grad_rowsum(
            &self,
            dims: Dims,
            o: &ringattn::HostBuf,
            d_o: &ringattn::HostBuf,
        ) -> Result<ringattn::HostBuf> {
            self.inner.softmax_grad_rowsum(dims, o, d_o)
        }
    }

    #[test]
    fn every_visible_pair_is_computed_exactly_once() {
        let (b, s, h_q, h_kv) = (2, 53, 4, 2);
        let q = randn(vec![b, s, h_q, 8], 1, DType::F32);
        let k = randn(vec![b, s, h_kv, 8], 2, DType::F32);
        let d_o = randn(vec![b, s, h_q, 8], 3, DType::F32);
        for mask in [Mask::None, Mask::Causal, Mask::Window { left: Some(7), right: Some(2) }] {
            let all = Positions::contiguous(0, s);
            let total = visible(mask, &all, &all) * (b * h_q) as u64;
            for world in [1, 2, 3, 4] {
                for (strategy, layout) in [
                    (Strategy::Ring, Layout::Contiguous),
                    (Strategy::Ring, Layout::Zigzag),
                    (Strategy::Ring, Layout::Striped),
                    (Strategy::AllGather, Layout::Striped),
                    (Strategy::Ulysses, Layout::Zigzag),
                    (Strategy::Usp, Layout::Zigzag),
                ] {
                    if matches!(strategy, Strategy::Ulysses) && h_q % world != 0 {
                        continue;
                    }
                    let be = Counting::default();
                    let p = ParallelParams {
                        strategy,
                        layout: Some(layout),
                        attention: AttentionParams { mask, ..Default::default() },
                        seq_len: s,
                        ulysses_degree: None,
                        ..Default::default()
                    };
                    run_in_process(world, LocalOptions::default(), &be, &q, &k, &k, Some(&d_o), &p).unwrap();
                    let what = format!("{strategy:?} {layout:?} P={world} {mask:?}");
                    assert_eq!(be.fwd.load(Ordering::Relaxed), total, "forward {what}");
                    assert_eq!(be.bwd.load(Ordering::Relaxed), total, "backward {what}");
                }
            }
        }
    }
}

#[test]
fn repeated_splits_form_correct_groups() {
    use ringattn::comm::{all_gather, spmd, Communicator, LocalOptions};
    // 200 successive splits of 4 ranks into 2 groups: each split's sub-groups have the right
    // size and exchange data without mixing with earlier splits.
    let out = spmd(4, LocalOptions::default(), |c| {
        for _ in 0..200 {
            let sub = c.split(c.rank() % 2, c.rank())?;
            assert_eq!(sub.size(), 2);
            let got = all_gather(sub.as_ref(), ringattn::HostBuf::from(vec![c.rank() as f32]))?;
            assert_eq!(got.len(), 2);
        }
        Ok(())
    });
    assert!(out.iter().all(|r| r.is_ok()));
}

#[test]
fn each_rank_can_have_its_own_thread_pool() {
    use ringattn::comm::{spmd, LocalOptions};
    let opts = LocalOptions { threads_per_rank: Some(1), ..Default::default() };
    let out = spmd::<ringattn::HostBuf, _>(3, opts, |_| Ok(rayon::current_num_threads()));
    assert!(out.into_iter().all(|r| r.unwrap() == 1));
}

/// The per-rank API through a resolved plan: every strategy with every defaulted field
/// (layout, Ulysses degree, sequence length) gives single-device attention — the USP
/// regression (a rank sharding by an unresolved degree of 1 while the drivers computed with
/// 4 returned output with relative error 0.67) cannot recur, since positions come only from
/// `ResolvedParams`; one handshake catches any mismatch; calls after setup issue no
/// handshake and no split.
mod resolved_plan {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use ringattn::comm::{spmd, Communicator, LocalOptions, RecvHandle, SendHandle, Tag};
    use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan, Strategy};
    use ringattn::{random::randn, reference, verify, AttentionParams, DType, Dims, Error, Mask, Result, Tensor};

    /// A communicator that counts the collective calls and splits made on it.
    struct Counting<'a> {
        inner: &'a dyn Communicator<Buf = ringattn::HostBuf>,
        collectives: AtomicUsize,
        splits: AtomicUsize,
    }

    impl<'a> Counting<'a> {
        fn new(inner: &'a dyn Communicator<Buf = ringattn::HostBuf>) -> Self {
            Counting { inner, collectives: AtomicUsize::new(0), splits: AtomicUsize::new(0) }
        }
        fn counts(&self) -> (usize, usize) {
            (self.collectives.load(Ordering::Relaxed), self.splits.load(Ordering::Relaxed))
        }
    }

    impl Communicator for Counting<'_> {
        type Buf = ringattn::HostBuf;
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn deadline(&self) -> Duration {
            self.inner.deadline()
        }
        fn isend(&self, to: usize, tag: Tag, data: ringattn::HostBuf) -> Result<SendHandle> {
            self.inner.isend(to, tag, data)
        }
        fn irecv(
            &self,
            from: usize,
            tag: Tag,
            len: usize,
            elem: ringattn::Elem,
        ) -> Result<RecvHandle<ringattn::HostBuf>> {
            self.inner.irecv(from, tag, len, elem)
        }
        fn abort(&self, reason: &str) {
            self.inner.abort(reason)
        }
        fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = ringattn::HostBuf>>> {
            self.splits.fetch_add(1, Ordering::Relaxed);
            self.inner.split(color, key)
        }
        fn next_collective_tag(&self) -> Tag {
            self.collectives.fetch_add(1, Ordering::Relaxed);
            self.inner.next_collective_tag()
        }
        /// A tag block is no communication: not counted.
        fn next_tag_block(&self) -> Tag {
            self.inner.next_tag_block()
        }
        fn bytes_sent(&self) -> u64 {
            self.inner.bytes_sent()
        }
    }

    #[test]
    fn every_strategy_with_every_default_matches_single_device_attention() {
        let (world, s) = (4, 64);
        let q = randn(vec![1, s, 4, 16], 11, DType::F32);
        let k = randn(vec![1, s, 2, 16], 12, DType::F32);
        let v = randn(vec![1, s, 2, 16], 13, DType::F32);
        let d_o = randn(vec![1, s, 4, 16], 14, DType::F32);
        let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let oracle = reference::backward(&q, &k, &v, &d_o, &attention).unwrap();
        let fwd = reference::forward(&q, &k, &v, &attention).unwrap();
        for strategy in [Strategy::Ring, Strategy::AllGather, Strategy::Ulysses, Strategy::Usp] {
            // Everything defaulted (layout, Ulysses degree, seq_len), then each given.
            let defaulted = ParallelParams { strategy, attention: attention.clone(), ..Default::default() };
            let given = ParallelParams {
                seq_len: s,
                layout: Some(defaulted.layout()),
                ulysses_degree: (strategy == Strategy::Usp).then_some(2),
                ..defaulted.clone()
            };
            for params in [defaulted, given] {
                let resolved = params.resolve(world, 4, s).unwrap();
                let parts = spmd(world, LocalOptions::default(), |comm| {
                    let be = CpuBackend::default();
                    let sh = |t: &Tensor| resolved.shard(t, comm.rank());
                    let (qs, ks, vs, dos) = (sh(&q)?, sh(&k)?, sh(&v)?, sh(&d_o)?);
                    // Each rank plans from the parameters as given: the plan resolves the same
                    // defaults (seq_len from the ranks' token counts).
                    let plan = ParallelPlan::new(comm, &be, &params, &Dims::of(&qs, &ks, &vs)?, DType::F32)?;
                    assert_eq!(plan.resolved(), &resolved);
                    let (f, _) = plan.forward_tensors(&qs, &ks, &vs)?;
                    let (g, _) = plan.backward_tensors(&qs, &ks, &vs, &f.o, &f.lse, &dos)?;
                    Ok((f.o, g))
                });
                let parts: Vec<(Tensor, ringattn::cpu::Gradients)> = parts.into_iter().collect::<Result<_>>().unwrap();
                let whole = |f: &dyn Fn(&(Tensor, ringattn::cpu::Gradients)) -> Tensor| {
                    resolved.unshard(&parts.iter().map(f).collect::<Vec<_>>()).unwrap().to_f32_vec()
                };
                let err = |x: Vec<f32>, want: &[f64]| verify::rel_err(&x, want);
                let what = format!("{strategy:?} {params:?}");
                assert!(err(whole(&|p| p.0.clone()), &fwd.o) < 1e-5, "o: {what}");
                assert!(err(whole(&|p| p.1.dq.clone()), &oracle.dq) < 1e-5, "dq: {what}");
                assert!(err(whole(&|p| p.1.dk.clone()), &oracle.dk) < 1e-5, "dk: {what}");
                assert!(err(whole(&|p| p.1.dv.clone()), &oracle.dv) < 1e-5, "dv: {what}");
            }
        }
    }

    #[test]
    fn calls_after_setup_issue_no_handshake_and_no_split() {
        let (world, s) = (4, 48);
        let q = randn(vec![1, s, 4, 8], 1, DType::F32);
        let kv = randn(vec![1, s, 4, 8], 2, DType::F32);
        for strategy in [Strategy::Ring, Strategy::AllGather, Strategy::Ulysses, Strategy::Usp] {
            let params = ParallelParams { strategy, ..Default::default() };
            let resolved = params.resolve(world, 4, s).unwrap();
            let counts = spmd(world, LocalOptions::default(), |comm| {
                let counting = Counting::new(comm);
                let be = CpuBackend::default();
                let (qs, kvs) = (resolved.shard(&q, comm.rank())?, resolved.shard(&kv, comm.rank())?);
                let plan = ParallelPlan::new(&counting, &be, &params, &Dims::of(&qs, &kvs, &kvs)?, DType::F32)?;
                let setup = counting.counts();
                for _ in 0..3 {
                    let (f, _) = plan.forward_tensors(&qs, &kvs, &kvs)?;
                    plan.backward_tensors(&qs, &kvs, &kvs, &f.o, &f.lse, &qs)?;
                }
                let after = counting.counts();
                Ok((setup, (after.0 - setup.0, after.1 - setup.1)))
            });
            for c in counts {
                let (setup, calls) = c.unwrap();
                let splits = if matches!(strategy, Strategy::Ulysses | Strategy::Usp) { 2 } else { 0 };
                assert_eq!(setup, (1, splits), "{strategy:?}: one handshake (a collective) and the mesh's splits");
                // Three forwards and backwards: no split, and no collective beyond the
                // strategy's own data movement (all-gather's gather and reduce-scatter).
                // (All-gather: K and V gathered forward; gathered again and dK, dV
                // reduce-scattered backward.)
                let data_collectives = if strategy == Strategy::AllGather { 3 * (2 + 4) } else { 0 };
                assert_eq!(calls, (data_collectives, 0), "{strategy:?}");
            }
        }
    }

    #[test]
    fn any_mismatch_fails_every_rank_in_the_one_handshake() {
        let (world, s) = (4, 32);
        let q = randn(vec![1, s, 4, 8], 1, DType::F32);
        let run = |tweak: &(dyn Fn(usize, &mut ParallelParams) + Sync), short: Option<usize>| {
            let base = ParallelParams { strategy: Strategy::Usp, ..Default::default() };
            let resolved = base.resolve(world, 4, s).unwrap();
            spmd(world, LocalOptions { deadline: Duration::from_secs(10), ..Default::default() }, |comm| {
                let mut p = base.clone();
                tweak(comm.rank(), &mut p);
                let mut qs = resolved.shard(&q, comm.rank())?;
                if short == Some(comm.rank()) {
                    qs = ringattn::Layout::shard_rows(&qs, &ringattn::Positions::contiguous(0, qs.shape()[1] - 1))?;
                }
                ParallelPlan::new(comm, &CpuBackend::default(), &p, &Dims::of(&qs, &qs, &qs)?, DType::F32).map(|_| ())
            })
        };
        let expect = |results: Vec<Result<()>>, needle: &str| {
            for r in results {
                match r {
                    Err(Error::Handshake(m)) => assert!(m.contains(needle), "{m}"),
                    other => panic!("expected a handshake error naming `{needle}`, got {other:?}"),
                }
            }
        };
        // A field no one listed by hand: the scale, the mask, the Ulysses degree.
        expect(run(&|r, p| p.attention.scale = (r == 2).then_some(0.5), None), "rank 2");
        expect(run(&|r, p| p.attention.mask = if r == 3 { Mask::Causal } else { Mask::None }, None), "rank 3");
        expect(run(&|r, p| p.ulysses_degree = (r == 1).then_some(2), None), "rank 1");
        // A rank holding the wrong number of tokens: named when the length is given; without
        // it the ranks' counts define the length, and every rank's share is then off.
        expect(run(&|_, p| p.seq_len = s, Some(1)), "rank 1 holds 7");
        expect(run(&|_, _| {}, Some(1)), "holds");
        // An invalid configuration on one rank is that rank's error, on every rank.
        expect(run(&|r, p| p.ulysses_degree = (r == 0).then_some(3), None), "rank 0: ");
    }
}
