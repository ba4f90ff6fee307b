//! Sequence-parallel strategies against the float64 oracle: every strategy and valid layout,
//! world sizes 1–8, uneven lengths, GQA, masks; forward and backward.

mod support;

use proptest::prelude::*;
use ringattn::comm::LocalOptions;
use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy as Strat};
use ringattn::{random::randn, reference, verify, AttentionParams, DType, Documents, Layout, Mask};

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
    let attention = AttentionParams {
        mask: c.mask,
        documents: c.docs.clone().map(|d| Documents::new(d).unwrap()),
        scale: None,
    };
    let params = ParallelParams {
        strategy: c.strategy,
        layout: Some(c.layout),
        attention: attention.clone(),
        seq_len: c.s,
        ulysses_degree: c.ulysses_degree,
    };
    let run = run_in_process(
        c.world,
        LocalOptions::default(),
        &CpuBackend::default(),
        &q,
        &k,
        &v,
        Some(&d_o),
        &params,
    )?;
    let oracle = reference::backward(&q, &k, &v, &d_o, &attention)?;
    let naive = reference::naive_rounded(&q, &k, &v, Some(&d_o), None, &attention, c.dtype)?;
    Ok(verify::report(
        c.dtype,
        &run.forward,
        run.gradients.as_ref(),
        &oracle,
        &naive,
        &verify::Tolerance::default(),
    ))
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
