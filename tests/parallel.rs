//! Sequence-parallel strategies against the float64 oracle: every strategy and valid layout,
//! world sizes 1–8, uneven lengths, GQA, masks; forward and backward.

mod support;

use proptest::prelude::*;
use ringattn::comm::LocalOptions;
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
    mask: Mask,
    docs: Option<Vec<usize>>,
    dtype: DType,
    ulysses_degree: Option<usize>,
    seed: u64,
}

fn check(c: &PCase) -> Result<verify::Report, ringattn::Error> {
    let q = randn(vec![c.b, c.s, c.h_q, c.d], c.seed, c.dtype);
    let k = randn(vec![c.b, c.s, c.h_kv, c.d], c.seed + 1, c.dtype);
    let v = randn(vec![c.b, c.s, c.h_kv, c.d], c.seed + 2, c.dtype);
    let d_o = randn(vec![c.b, c.s, c.h_q, c.d], c.seed + 3, c.dtype);
    let attention =
        AttentionParams { mask: c.mask, documents: c.docs.clone().map(|d| Documents::new(d).unwrap()), scale: None };
    let params = ParallelParams {
        strategy: c.strategy,
        layout: Some(c.layout),
        attention: attention.clone(),
        seq_len: c.s,
        ulysses_degree: c.ulysses_degree,
    };
    let run =
        run_in_process(c.world, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)?;
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
        mask in prop_oneof![
            Just(Mask::None),
            Just(Mask::Causal),
            (0u64..20, 0u64..5).prop_map(|(l, r)| Mask::Window { left: Some(l), right: Some(r) }),
            (0u64..20).prop_map(|l| Mask::Window { left: Some(l), right: Some(0) }),
        ],
        docs in any::<bool>(),
        cut in 0usize..90,
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        seed in 0u64..10_000,
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
        PCase { world, strategy, layout, b, s, h_q, h_kv, d, mask, docs, dtype, ulysses_degree: None, seed }
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(48)))]

    #[test]
    fn strategies_match_the_oracle(c in pcase()) {
        let report = check(&c).map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
        prop_assert!(report.pass(), "{c:?}\n{}", report.table());
    }
}

#[test]
fn every_strategy_and_layout_on_one_case() {
    for (strategy, layout) in [
        (Strat::Ring, Layout::Contiguous),
        (Strat::Ring, Layout::Zigzag),
        (Strat::Ring, Layout::Striped),
        (Strat::AllGather, Layout::Zigzag),
        (Strat::Ulysses, Layout::Striped),
        (Strat::Usp, Layout::Zigzag),
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
            mask: Mask::Causal,
            docs: None,
            dtype: DType::F32,
            ulysses_degree: Some(2),
            seed: 5,
        };
        let r = check(&c).unwrap();
        assert!(r.pass(), "{c:?}\n{}", r.table());
    }
}

mod faults {
    use std::time::{Duration, Instant};

    use ringattn::comm::{spmd, Communicator, LocalOptions};
    use ringattn::parallel::{self, CpuBackend, ParallelParams, Strategy};
    use ringattn::{random::randn, AttentionParams, DType, Error, Layout, Mask, Tensor};

    fn shards(s: usize, world: usize, rank: usize, p: &ParallelParams) -> (Tensor, Tensor, Tensor) {
        let pos = p.positions(world, rank);
        let sh = |t: &Tensor| Layout::shard_rows(t, &pos).unwrap();
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
        let out = spmd::<Vec<f32>, _>(2, opts, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(600));
                return Ok(());
            }
            c.irecv(1, 7, 4)?.wait().map(|_| ())
        });
        let e = out[0].as_ref().unwrap_err();
        assert!(matches!(e, Error::Timeout { peer: 1, .. }), "{e}");
        assert!(e.to_string().contains("rank 1") && e.to_string().contains("tag 7"), "{e}");
    }

    #[test]
    fn a_message_of_the_wrong_length_is_an_error_naming_the_peer() {
        let out = spmd::<Vec<f32>, _>(2, LocalOptions::default(), |c| {
            if c.rank() == 1 {
                return c.isend(0, 3, vec![1.0; 5])?.wait();
            }
            c.irecv(1, 3, 4)?.wait().map(|_| ())
        });
        let e = out[0].as_ref().unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch(_)), "{e}");
        assert!(e.to_string().contains("rank 1") && e.to_string().contains("5 values, expected 4"), "{e}");
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
    use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy};
    use ringattn::{random::randn, reference, verify, AttentionParams, DType, Layout, Mask};

    /// Causal attention work (visible pairs) per rank, max over mean.
    fn imbalance(layout: Layout, s: usize, world: usize) -> f64 {
        let work: Vec<f64> =
            (0..world).map(|r| layout.positions(s, world, r).iter().map(|q| (q + 1) as f64).sum()).collect();
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

    #[test]
    fn a_window_stops_the_ring_early() {
        let (s, world) = (400, 4);
        let q = randn(vec![1, s, 2, 8], 1, DType::F32);
        let k = randn(vec![1, s, 2, 8], 2, DType::F32);
        let run = |mask: Mask| {
            let p = ParallelParams {
                strategy: Strategy::Ring,
                layout: Some(Layout::Contiguous),
                attention: AttentionParams { mask, ..Default::default() },
                seq_len: s,
                ulysses_degree: None,
            };
            run_in_process(world, LocalOptions::default(), &CpuBackend::default(), &q, &k, &k, None, &p).unwrap()
        };
        let full = run(Mask::Causal);
        let window = run(Mask::Window { left: Some(50), right: Some(0) });
        let sent = |r: &ringattn::parallel::ProcessRun| r.stats.iter().map(|x| x.0.bytes_sent).sum::<u64>();
        assert_eq!(full.stats[0].0.hops, 4);
        assert_eq!(window.stats[0].0.hops, 2, "a 50-token window over 100-token shards needs one hop back");
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
            q: &Vec<f32>,
            k: &Vec<f32>,
            v: &Vec<f32>,
            q_pos: &Positions,
            k_pos: &Positions,
            params: &AttentionParams,
        ) -> Result<Pending<ForwardPartial<Vec<f32>>>> {
            self.fwd.fetch_add(visible(params.mask, q_pos, k_pos) * (dims.b * dims.h_q) as u64, Ordering::Relaxed);
            self.inner.forward_block(dims, q, k, v, q_pos, k_pos, params)
        }

        fn backward_block(
            &self,
            dims: Dims,
            q: &Vec<f32>,
            k: &Vec<f32>,
            v: &Vec<f32>,
            o: &Vec<f32>,
            lse: &Vec<f32>,
            d_o: &Vec<f32>,
            big_d: &Vec<f32>,
            q_pos: &Positions,
            k_pos: &Positions,
            params: &AttentionParams,
        ) -> Result<Pending<GradientPartial<Vec<f32>>>> {
            self.bwd.fetch_add(visible(params.mask, q_pos, k_pos) * (dims.b * dims.h_q) as u64, Ordering::Relaxed);
            self.inner.backward_block(dims, q, k, v, o, lse, d_o, big_d, q_pos, k_pos, params)
        }

        fn softmax_grad_rowsum(&self, dims: Dims, o: &Vec<f32>, d_o: &Vec<f32>) -> Result<Vec<f32>> {
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
            let got = all_gather(sub.as_ref(), vec![c.rank() as f32])?;
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
    let out = spmd::<Vec<f32>, _>(3, opts, |_| Ok(rayon::current_num_threads()));
    assert!(out.into_iter().all(|r| r.unwrap() == 1));
}
