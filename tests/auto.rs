//! `Strategy::Auto`: the strategy, layout and Ulysses degree chosen per batch of packed
//! documents by the cost model, resolved before anything runs — exact against the float64
//! oracle whatever it chose, the same choice on every rank and reported in every rank's
//! statistics, and refused (never run as something else) where it cannot choose.

mod support;

use proptest::prelude::*;
use ringattn::comm::{spmd, Communicator, LocalOptions};
use ringattn::parallel::{run_in_process, AutoModel, CpuBackend, ParallelParams, ParallelPlan, Strategy};
use ringattn::plan::{ClusterSpec, Passes};
use ringattn::{random::randn, verify, AttentionParams, DType, Dims, Documents, Error, Mask};

fn auto_params(attention: AttentionParams, auto: AutoModel) -> ParallelParams {
    ParallelParams { strategy: Strategy::Auto, attention, auto, ..Default::default() }
}

/// A cluster whose links are fast or slow against its kernels, so that the model's choice
/// moves between strategies and layouts from case to case.
fn model(slow_links: bool, passes: Passes) -> AutoModel {
    let mut cluster = ClusterSpec::default();
    if slow_links {
        (cluster.intra_gbps, cluster.inter_gbps) = (2.0, 2.0);
        (cluster.intra_latency_us, cluster.inter_latency_us) = (30.0, 30.0);
    }
    AutoModel { cluster, passes }
}

prop_compose! {
    /// A packed batch: 2–4 ranks, 1–6 documents (empty ones too), causal or full, GQA,
    /// soft-cap and sinks sometimes, f32 or bf16.
    fn auto_case()(
        world in 2usize..=4,
        lengths in prop::collection::vec(0usize..48, 1..7),
        causal in any::<bool>(),
        kv in prop::sample::select(&[1usize, 2, 4][..]),
        group in prop::sample::select(&[1usize, 2][..]),
        softcap in prop_oneof![3 => Just(None), 1 => Just(Some(3.0f32))],
        sink_level in support::sink_level(),
        bf16 in any::<bool>(),
        slow in any::<bool>(),
        seed in 0u64..10_000,
    ) -> (usize, Vec<usize>, Mask, usize, usize, Option<f32>, Option<f32>, DType, bool, u64) {
        // At least one token per rank (the model places whole tokens).
        let mut lengths = lengths;
        let s: usize = lengths.iter().sum();
        if s < world { lengths.push(world - s); }
        let mask = if causal { Mask::Causal } else { Mask::None };
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        (world, lengths, mask, 4 * group, kv, softcap, sink_level, dtype, slow, seed)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(48)))]

    /// Whatever the model chose, forward and backward match the float64 oracle, and every
    /// rank's forward and backward statistics name the same choice — the one
    /// `ParallelParams::resolve_for` gives for the batch.
    #[test]
    fn auto_runs_its_choice_exactly_on_every_batch(
        (world, lengths, mask, h_q, h_kv, softcap, sink_level, dtype, slow, seed) in auto_case(),
    ) {
        let s: usize = lengths.iter().sum();
        let d = 16;
        let attention = AttentionParams {
            mask,
            documents: Some(Documents::new(lengths.clone()).unwrap()),
            softcap,
            sinks: support::sinks(sink_level, h_q),
            ..Default::default()
        };
        let params = auto_params(attention.clone(), model(slow, Passes::Both));
        let q = randn(vec![1, s, h_q, d], seed, dtype);
        let k = randn(vec![1, s, h_kv, d], seed + 1, dtype);
        let v = randn(vec![1, s, h_kv, d], seed + 2, dtype);
        let d_o = randn(vec![1, s, h_q, d], seed + 3, dtype);
        let dims = Dims::of(&q, &k, &v).unwrap();
        let resolved = params.resolve_for(world, &dims, dtype).unwrap();
        let chosen = resolved.chosen().expect("auto reports its choice").clone();
        prop_assert_eq!(&chosen.strategy, resolved.params().strategy.name());
        prop_assert!(resolved.params().strategy != Strategy::Auto);
        prop_assert!(chosen.predicted_s > 0.0 && chosen.predicted_s <= chosen.worst_predicted_s);
        let run = run_in_process(world, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params)
            .unwrap();
        let report = verify::check_results(&q, &k, &v, Some(&d_o), None, &attention, &run.forward, run.gradients.as_ref())
            .unwrap();
        prop_assert!(report.pass(), "{chosen:?} {lengths:?}\n{}", report.table());
        prop_assert_eq!(run.stats.len(), world);
        for (fwd, bwd) in &run.stats {
            prop_assert_eq!(fwd.chosen.as_ref(), Some(&chosen));
            prop_assert_eq!(bwd.as_ref().and_then(|b| b.chosen.as_ref()), Some(&chosen));
        }
    }
}

/// Over many batches the model does not always pick the same thing: the test above then runs
/// more than one strategy or layout through `Auto`.
#[test]
fn auto_chooses_differently_for_different_batches() {
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..40u64 {
        for slow in [false, true] {
            let s = 4096;
            let lengths = ringattn::random::document_lengths(seed, s, &Default::default());
            let attention = AttentionParams {
                mask: Mask::Causal,
                documents: Some(Documents::new(lengths).unwrap()),
                ..Default::default()
            };
            let params = auto_params(attention, model(slow, Passes::Both));
            let dims = Dims { b: 1, s_q: s, s_k: s, h_q: 8, h_kv: [1, 8][seed as usize % 2], d_qk: 64, d_v: 64 };
            let r = params.resolve_for(4, &dims, DType::BF16).unwrap();
            let c = r.chosen().unwrap();
            seen.insert((c.strategy.clone(), c.layout.clone()));
        }
    }
    assert!(seen.len() >= 2, "one choice for every batch: {seen:?}");
}

/// A plan made from `Auto` parameters (not resolved by the caller) resolves them in its
/// handshake — the same choice on every rank — and reports it in its statistics.
#[test]
fn a_plan_resolves_auto_itself() {
    let (world, s, h) = (4, 120, 4);
    let lengths = vec![70, 10, 25, 15];
    let attention =
        AttentionParams { mask: Mask::Causal, documents: Some(Documents::new(lengths).unwrap()), ..Default::default() };
    let params = ParallelParams { seq_len: s, ..auto_params(attention.clone(), AutoModel::default()) };
    let x = randn(vec![1, s, h, 16], 7, DType::F32);
    let whole = Dims::of(&x, &x, &x).unwrap();
    let resolved = params.resolve_for(world, &whole, DType::F32).unwrap();
    let outs = spmd(world, LocalOptions::default(), |comm| {
        let shard = resolved.shard(&x, comm.rank())?;
        let be = CpuBackend::default();
        let plan = ParallelPlan::new(comm, &be, &params, &Dims::of(&shard, &shard, &shard)?, DType::F32)?;
        assert_eq!(plan.resolved().params().strategy, resolved.params().strategy);
        let (out, stats) = plan.forward_tensors(&shard, &shard, &shard)?;
        Ok((out.o, stats.chosen))
    });
    let mut parts = Vec::new();
    for r in outs {
        let (o, chosen) = r.unwrap();
        assert_eq!(chosen.as_ref(), resolved.chosen());
        parts.push(o);
    }
    let o = resolved.unshard(&parts).unwrap();
    let single = ringattn::cpu::forward(&x, &x, &x, &attention).unwrap();
    let want: Vec<f64> = single.o.as_f32().iter().map(|&v| v as f64).collect();
    assert!(verify::rel_err(&o.to_f32_vec(), &want) < 1e-5);
}

/// Where the model cannot choose, `Auto` is an error naming why — on every rank of a plan —
/// never a run of some default strategy.
#[test]
fn auto_refuses_what_it_cannot_choose() {
    let x = randn(vec![1, 64, 4, 16], 1, DType::F32);
    let dims = Dims::of(&x, &x, &x).unwrap();
    let docs = || Some(Documents::new(vec![40, 24]).unwrap());
    let refused = |attention: AttentionParams| {
        auto_params(attention, AutoModel::default()).resolve_for(2, &dims, DType::F32).unwrap_err().to_string()
    };
    // No documents: nothing to choose from.
    let e = refused(AttentionParams { mask: Mask::Causal, ..Default::default() });
    assert!(e.contains("documents"), "{e}");
    // A window: the model weighs causal or unmasked documents.
    let e = refused(AttentionParams {
        mask: Mask::Window { left: Some(8), right: Some(0) },
        documents: docs(),
        ..Default::default()
    });
    assert!(e.contains("Window"), "{e}");
    // `resolve` alone lacks the shape and dtype: it names the call that has them.
    let p = auto_params(
        AttentionParams { mask: Mask::Causal, documents: docs(), ..Default::default() },
        Default::default(),
    );
    let e = p.resolve(2, 4, 64).unwrap_err().to_string();
    assert!(e.contains("resolve_for"), "{e}");
    // A run without documents fails on every rank, with the model's reason.
    let no_docs = auto_params(AttentionParams { mask: Mask::Causal, ..Default::default() }, AutoModel::default());
    let e = run_in_process(2, LocalOptions::default(), &CpuBackend::default(), &x, &x, &x, None, &no_docs).unwrap_err();
    assert!(e.to_string().contains("documents"), "{e}");
    let results = spmd(2, LocalOptions::default(), |comm| {
        let be = CpuBackend::default();
        let half = randn(vec![1, 32, 4, 16], 2, DType::F32);
        ParallelPlan::new(comm, &be, &no_docs, &Dims::of(&half, &half, &half)?, DType::F32).map(|_| ())
    });
    for r in results {
        match r {
            Err(Error::Handshake(e)) => assert!(e.contains("documents"), "{e}"),
            other => panic!("every rank fails the handshake: {other:?}"),
        }
    }
    // What auto chooses cannot also be given: neither is dropped nor overrules the choice.
    for given in [
        ParallelParams { layout: Some(ringattn::Layout::Zigzag), ..p.clone() },
        ParallelParams { ulysses_degree: Some(2), ..p.clone() },
    ] {
        let e = given.resolve_for(2, &dims, DType::F32).unwrap_err().to_string();
        assert!(e.contains("auto chooses"), "{e}");
    }
    // An unknown name lists auto beside the strategies.
    let e = "autox".parse::<Strategy>().unwrap_err().to_string();
    assert!(e.contains("auto"), "{e}");
}

/// A plan per batch over a `SplitCache`: the Ulysses/USP mesh splits the group the first time
/// a degree is used and reuses the sub-communicators after (two splits — group and ring — for
/// three batches), every batch exact against the float64 oracle.
#[test]
fn plans_per_batch_split_the_group_once_per_degree() {
    use ringattn::comm::{spmd_shared, SplitCache};
    let (world, s, h) = (4, 96, 4);
    let batches = [vec![50, 30, 16], vec![10, 70, 16], vec![96]];
    let x = randn(vec![1, s, h, 16], 9, DType::F32);
    let runs = spmd_shared(world, LocalOptions::default(), |comm| {
        let comm = SplitCache::new(comm);
        let be = CpuBackend::default();
        let mut outs = Vec::new();
        for lengths in &batches {
            let attention = AttentionParams {
                mask: Mask::Causal,
                documents: Some(Documents::new(lengths.clone())?),
                ..Default::default()
            };
            let params = ParallelParams {
                strategy: Strategy::Usp,
                ulysses_degree: Some(2),
                layout: Some(ringattn::Layout::Balanced),
                attention,
                ..Default::default()
            };
            let resolved = params.resolve(world, h, s)?;
            let shard = resolved.shard(&x, comm.rank())?;
            let plan = ParallelPlan::new(&comm, &be, &resolved, &Dims::of(&shard, &shard, &shard)?, DType::F32)?;
            outs.push(plan.forward_tensors(&shard, &shard, &shard)?.0.o);
        }
        Ok((comm.splits_made(), outs))
    });
    let mut parts: Vec<Vec<ringattn::Tensor>> = vec![Vec::new(); batches.len()];
    for r in runs {
        let (made, outs) = r.unwrap();
        assert_eq!(made, 2, "the group and the ring, split once");
        for (i, o) in outs.into_iter().enumerate() {
            parts[i].push(o);
        }
    }
    for (lengths, parts) in batches.iter().zip(parts) {
        let attention = AttentionParams {
            mask: Mask::Causal,
            documents: Some(Documents::new(lengths.clone()).unwrap()),
            ..Default::default()
        };
        let params = ParallelParams {
            strategy: Strategy::Usp,
            ulysses_degree: Some(2),
            layout: Some(ringattn::Layout::Balanced),
            attention: attention.clone(),
            ..Default::default()
        };
        let o = params.resolve(world, h, s).unwrap().unshard(&parts).unwrap();
        let single = ringattn::cpu::forward(&x, &x, &x, &attention).unwrap();
        let want: Vec<f64> = single.o.as_f32().iter().map(|&v| v as f64).collect();
        assert!(verify::rel_err(&o.to_f32_vec(), &want) < 1e-5, "{lengths:?}");
    }
}
