//! The conformance check every backend passes: each strategy (`Strategy::ALL`, with its
//! world size and every layout it takes) × masks and score options, forward and backward
//! over in-process ranks, against the float64 oracle; the communicator in a given message
//! order. A score option the backend does not take (its `Backend::supports` refuses it) must
//! be refused by every strategy's call, naming the option — never run without it. One table
//! here, one macro line per (backend, dtype, order) in the test files.

use ringattn::attention::ScoreSpec;
use ringattn::comm::{LocalOptions, MessageOrder};
use ringattn::parallel::{run_in_process, Backend, ParallelParams, Strategy};
use ringattn::{
    random::randn, reference, verify, AttentionParams, DType, Dims, Documents, HostBuf, Layout, Mask, Tensor,
};

/// `(strategy, world, Ulysses degree)` of the check: every strategy of the registry once, at
/// the world size its rules state exercises it (`Strategy::check_world`).
pub fn strategies() -> Vec<(Strategy, usize, Option<usize>)> {
    Strategy::ALL
        .into_iter()
        .map(|s| {
            let (world, degree) = s.check_world();
            (s, world, degree)
        })
        .collect()
}

/// The layouts `strategy` takes at its check world (those its rules accept for 77 tokens and
/// 4 query heads; on one rank every layout is the same, so the first).
pub fn layouts(strategy: Strategy) -> Vec<Layout> {
    let (world, ulysses_degree) = strategy.check_world();
    let taken: Vec<Layout> = [Layout::Contiguous, Layout::Zigzag, Layout::Striped]
        .into_iter()
        .filter(|&layout| {
            let p = ParallelParams { strategy, layout: Some(layout), ulysses_degree, ..Default::default() };
            p.resolve(world, 4, 77).is_ok()
        })
        .collect();
    taken.into_iter().take(if world == 1 { 1 } else { 3 }).collect()
}

/// Runs the whole table on `backend` with `dtype` inputs (b = 1, s = 77, 4 query heads over 2
/// kv heads, d = 16) and messages matched in `order`; panics naming the configuration that
/// fails.
pub fn check_every_strategy<Be: Backend<Buf = HostBuf>>(backend: &Be, dtype: DType, order: MessageOrder) {
    let masks = [Mask::None, Mask::Causal, Mask::Window { left: Some(20), right: Some(0) }];
    let mut cases: Vec<AttentionParams> = masks.map(|mask| AttentionParams { mask, ..Default::default() }).into();
    cases.extend(score_options());
    cases.extend(sink_options());
    let inputs = Inputs::drawn((1, 77, 4, 2), (16, 16), dtype, 11);
    sweep(backend, &inputs, &cases, 3, LocalOptions { order, ..Default::default() });
}

/// Every score option of [`ScoreSpec`] in use, on masks: soft-caps at tanh's bend (the
/// drawn scores, scaled by 1/4, are about 1) under a causal mask, and with a scale under a
/// sliding window.
pub fn score_options() -> Vec<AttentionParams> {
    vec![
        AttentionParams { mask: Mask::Causal, softcap: Some(1.5), ..Default::default() },
        AttentionParams {
            mask: Mask::Window { left: Some(20), right: Some(0) },
            scale: Some(0.6),
            softcap: Some(4.0),
            ..Default::default()
        },
    ]
}

/// Attention sinks (4 query heads: logits from below to above the rows' LSE, which is about
/// log of the keys seen) under a causal mask, with a soft-cap under a sliding window (which
/// stops the ring early), and with packed documents (causal within each).
pub fn sink_options() -> Vec<AttentionParams> {
    let sinks = Some(vec![1.0, 3.0, -2.0, 4.5]);
    vec![
        AttentionParams { mask: Mask::Causal, sinks: sinks.clone(), ..Default::default() },
        AttentionParams {
            mask: Mask::Window { left: Some(12), right: Some(0) },
            softcap: Some(1.5),
            sinks: sinks.clone(),
            ..Default::default()
        },
        AttentionParams {
            mask: Mask::Causal,
            documents: Some(Documents::new(vec![30, 5, 42]).expect("documents")),
            sinks,
            ..Default::default()
        },
    ]
}

/// Multi-head latent attention's head dims, `d_qk ≠ d_v`, on `backend` with `dtype` inputs:
/// every strategy (at the world sizes of [`strategies`]) over its contiguous and zigzag
/// layouts, causal, a sliding window and packed documents (causal within each), GQA (4 query
/// heads over 2 kv heads, b = 1, s = 61), forward and backward against the float64 oracle;
/// panics naming the configuration that fails.
pub fn check_head_dims<Be: Backend<Buf = HostBuf>>(backend: &Be, dtype: DType, heads: (usize, usize)) {
    let cases = [
        AttentionParams { mask: Mask::Causal, ..Default::default() },
        AttentionParams { mask: Mask::Window { left: Some(9), right: Some(0) }, ..Default::default() },
        AttentionParams {
            mask: Mask::Causal,
            documents: Some(Documents::new(vec![17, 30, 14]).expect("documents")),
            ..Default::default()
        },
    ];
    let inputs = Inputs::drawn((1, 61, 4, 2), heads, dtype, 21);
    sweep(backend, &inputs, &cases, 2, LocalOptions::default());
}

/// q `[b, s, h_q, d_qk]`, k `[b, s, h_kv, d_qk]`, v `[b, s, h_kv, d_v]`, d_o `[b, s, h_q, d_v]`.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

impl Inputs {
    fn drawn(
        (b, s, hq, hkv): (usize, usize, usize, usize),
        (d_qk, d_v): (usize, usize),
        dtype: DType,
        seed: u64,
    ) -> Self {
        Inputs {
            q: randn(vec![b, s, hq, d_qk], seed, dtype),
            k: randn(vec![b, s, hkv, d_qk], seed + 1, dtype),
            v: randn(vec![b, s, hkv, d_v], seed + 2, dtype),
            d_o: randn(vec![b, s, hq, d_v], seed + 3, dtype),
        }
    }
}

/// Every strategy at its check world, over the first `max_layouts` layouts it takes, × every
/// case, forward and backward on `backend`: the results' shapes, and their values against the
/// float64 oracle (computed once per case).
fn sweep<Be: Backend<Buf = HostBuf>>(
    backend: &Be,
    x: &Inputs,
    cases: &[AttentionParams],
    max_layouts: usize,
    options: LocalOptions,
) {
    let Inputs { q, k, v, d_o } = x;
    let dtype = q.dtype();
    let dims = Dims::of(q, k, v).expect("dims");
    for attention in cases {
        // An option the backend does not take: every strategy's call is refused naming it.
        let spec = ScoreSpec::of(attention, &dims);
        if let Err(refusal) = backend.supports(&dims, dtype, &spec) {
            let option = spec.modifiers().unwrap_or_else(|| panic!("{refusal} for plain scores {attention:?}"));
            for (strategy, world, ulysses_degree) in strategies() {
                let params =
                    ParallelParams { strategy, attention: attention.clone(), ulysses_degree, ..Default::default() };
                match run_in_process(world, options, backend, q, k, v, Some(d_o), &params) {
                    Ok(_) => panic!("{strategy} x{world} ran {attention:?}, which its backend refuses: {refusal}"),
                    Err(e) => {
                        assert!(e.to_string().contains(&option), "{strategy} x{world}: {e} does not name {option}")
                    }
                }
            }
            continue;
        }
        let oracle = reference::backward(q, k, v, d_o, attention).expect("oracle");
        let naive = reference::naive_rounded(q, k, v, Some(d_o), None, attention, dtype).expect("naive model");
        for (strategy, world, ulysses_degree) in strategies() {
            for layout in layouts(strategy).into_iter().take(max_layouts) {
                let params = ParallelParams {
                    strategy,
                    layout: Some(layout),
                    attention: attention.clone(),
                    ulysses_degree,
                    ..Default::default()
                };
                let what = format!(
                    "{strategy} x{world} {layout:?} {:?} documents {} softcap {:?} sinks {:?} {dtype} {:?} q {:?} v {:?}",
                    attention.mask,
                    attention.documents.is_some(),
                    attention.softcap,
                    attention.sinks,
                    options.order,
                    q.shape(),
                    v.shape()
                );
                let r = run_in_process(world, options, backend, q, k, v, Some(d_o), &params)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let g = r.gradients.as_ref().expect("gradients");
                assert_eq!(r.forward.o.shape(), d_o.shape(), "{what}");
                assert_eq!((g.dq.shape(), g.dk.shape(), g.dv.shape()), (q.shape(), k.shape(), v.shape()), "{what}");
                let report = verify::report(dtype, &r.forward, Some(g), &oracle, &naive, &Default::default());
                // o, lse, dq, dk, dv, and with sinks dsinks.
                let rows = 5 + usize::from(attention.sinks.is_some());
                assert!(report.pass() && report.rows.len() == rows, "{what}\n{}", report.table());
            }
        }
    }
}

/// One test running [`check_every_strategy`]: `conformance!(name, backend, dtype, order)`.
macro_rules! conformance {
    ($name:ident, $backend:expr, $dtype:expr, $order:expr) => {
        #[test]
        fn $name() {
            support::conformance::check_every_strategy(&$backend, $dtype, $order);
        }
    };
}
pub(crate) use conformance;
