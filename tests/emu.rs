//! The CUDA kernels of `cuda/` run by the host emulator against the float64 oracle: forward
//! and backward, every mask, documents, GQA, block positions at global offsets, bf16 and f16,
//! head dims 8–256, with bit-identical results under the three fiber schedules; and the emu
//! backend under every parallel strategy.
#![cfg(feature = "emu")]

mod support;

use proptest::prelude::*;
use ringattn::comm::{LocalOptions, MessageOrder};
use ringattn::cpu::{ForwardOutput, Gradients};
use ringattn::emu::{self, EmuBackend, EmuOptions, Schedule};
use ringattn::kernels::geometry::DqMode;
use ringattn::parallel::{run_in_process, ParallelParams, Strategy};
use ringattn::{random::randn, verify, AttentionParams, DType, Error, Mask, Tensor};
use support::{mask, placement, sink_level, sinks, softcap, Case};

/// Lengths around the kernels' 32-row inner tiles and their 16/32/64-row blocks.
const LENGTHS: &[usize] = &[1, 2, 7, 16, 31, 32, 33, 63, 64, 65, 97, 130, 200];
const HEAD_DIMS: &[usize] = &[8, 16, 32, 64, 80, 128, 176, 256];
/// Upper bound on b·h_q·s_q·s_k·d so that the emulator and the oracle stay fast.
const WORK_CAP: usize = 2_500_000;

fn run(case: &Case, schedule: Schedule, dq_mode: DqMode) -> (ForwardOutput, Gradients) {
    let x = case.inputs();
    let opts = EmuOptions { schedule, workers: 1, dq_mode, ..Default::default() };
    let f = emu::forward(&x.q, &x.k, &x.v, case.pos(), &case.params, &opts).expect("emulated forward");
    let g = emu::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, case.pos(), &case.params, &opts)
        .expect("emulated backward");
    (f, g)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_f32().iter().map(|x| x.to_bits()).collect()
}

prop_compose! {
    fn case()(
        b in 1usize..=2,
        s_q in prop::sample::select(LENGTHS),
        s_k in prop::sample::select(LENGTHS),
        same_len in any::<bool>(),
        ratio in prop::sample::select(&[1usize, 2, 4][..]),
        h_kv in 1usize..=2,
        d in prop::sample::select(HEAD_DIMS),
        bf16 in any::<bool>(),
        mask in mask(),
        placement in placement(),
        scale in prop_oneof![Just(None), Just(Some(0.3f32)), Just(Some(-0.2f32))],
        softcap in softcap(),
        sink_level in sink_level(),
        seed in 0u64..1_000_000,
    ) -> Case {
        let s_k = if same_len { s_q } else { s_k };
        let (mut b, mut h_kv, mut s_q, mut s_k) = (b, h_kv, s_q, s_k);
        let work = |b: usize, h_kv: usize, s_q: usize, s_k: usize| b * h_kv * ratio * s_q * s_k * d;
        if work(b, h_kv, s_q, s_k) > WORK_CAP { b = 1; h_kv = 1; }
        while work(b, h_kv, s_q, s_k) > WORK_CAP { s_q = s_q.div_ceil(2); s_k = s_k.div_ceil(2); }
        let (positions, documents) = placement.apply(s_q, s_k);
        Case {
            b, s_q, s_k, h_q: h_kv * ratio, h_kv, d,
            dtype: if bf16 { DType::BF16 } else { DType::F16 },
            params: AttentionParams { mask, documents, scale, softcap, sinks: sinks(sink_level, h_kv * ratio) },
            positions, seed, tiles: Default::default(), arithmetic: Default::default(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(24)))]

    /// Forward and backward (dq deterministic or by atomics) against the oracle; the same
    /// bits under reverse and random fiber orders for everything whose result does not depend
    /// on the order of atomics (all but dq in atomic mode), so any difference is a race.
    #[test]
    fn emulated_kernels_match_the_oracle_under_every_schedule(
        case in case(),
        sched_seed in any::<u64>(),
        atomic in any::<bool>(),
    ) {
        let x = case.inputs();
        let mode = if atomic { DqMode::Atomic } else { DqMode::Deterministic };
        let (f, g) = run(&case, Schedule::Forward, mode);
        let report = verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), case.pos(), &case.params, &f, Some(&g))
            .unwrap();
        prop_assert!(report.pass(), "{mode:?} {case:?}\n{}", report.table());
        for schedule in [Schedule::Reverse, Schedule::Random(sched_seed)] {
            let (f2, g2) = run(&case, schedule, mode);
            for (name, a, b) in [("o", &f.o, &f2.o), ("lse", &f.lse, &f2.lse), ("dq", &g.dq, &g2.dq),
                                 ("dk", &g.dk, &g2.dk), ("dv", &g.dv, &g2.dv)] {
                if name == "dq" && atomic {
                    continue;
                }
                prop_assert!(bits(a) == bits(b), "{name} differs under {schedule:?}: {case:?}");
            }
        }
    }
}

#[test]
fn row_maxima_that_keep_rising_rescale_the_running_output() {
    // The forward moves a row's softmax base only when the row max passes it by more than 2^8
    // (lazy rescaling): keys whose norms grow along the sequence make the max jump by more
    // than that from tile to tile (both paths run: a settled max, then a jump), causal or not,
    // with scores of either sign.
    for (d, dtype, scale) in [(64, DType::BF16, None), (128, DType::F16, Some(-0.3f32)), (32, DType::BF16, Some(0.5))] {
        let (s_q, s_k) = (150, 300);
        let q = randn(vec![1, s_q, 2, d], 11, dtype);
        let k = randn(vec![1, s_k, 1, d], 12, DType::F32).to_f32_vec();
        let grown: Vec<f32> = k.iter().enumerate().map(|(i, &x)| x * (1.0 + (i / d) as f32 / 24.0)).collect();
        let k = Tensor::from_f32_as(vec![1, s_k, 1, d], grown, dtype).unwrap();
        let v = randn(vec![1, s_k, 1, d], 13, dtype);
        let d_o = randn(vec![1, s_q, 2, d], 14, dtype);
        for mask in [Mask::None, Mask::Causal] {
            let params = AttentionParams { mask, scale, ..Default::default() };
            let opts = EmuOptions::default();
            let f = emu::forward(&q, &k, &v, None, &params, &opts).unwrap();
            let g = emu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, None, &params, &opts).unwrap();
            let report = verify::check_results(&q, &k, &v, Some(&d_o), None, &params, &f, Some(&g)).unwrap();
            assert!(report.pass(), "d = {d} {dtype:?} {mask:?} scale {scale:?}\n{}", report.table());
        }
    }
}

#[test]
fn deterministic_dq_keeps_each_rows_precision_and_its_bits_on_worker_threads() {
    // The fixed-point dq gives each query row its own unit from a bound on |dq|: rows of dO
    // spanning 2^-60 .. 2^20 in magnitude all keep the atomic f32 mode's result to within a
    // 16-bit rounding of either (one unit per head or per call would zero the small rows).
    // Blocks on several OS threads add in varying orders: the same bits, every time.
    // (Head-dim classes 64 and 128: both add dq in fixed point.)
    let (s_q, s_k, h) = (97, 160, 2);
    for (dtype, mask, d) in
        [(DType::BF16, Mask::None, 64), (DType::F16, Mask::Causal, 64), (DType::BF16, Mask::Causal, 128)]
    {
        let q = randn(vec![1, s_q, h, d], 21, dtype);
        let k = randn(vec![1, s_k, 1, d], 22, dtype);
        let v = randn(vec![1, s_k, 1, d], 23, dtype);
        let base = randn(vec![1, s_q, h, d], 24, DType::F32).to_f32_vec();
        let row_exp = |i: usize| -60 + (80 * i / s_q) as i32;
        let scaled: Vec<f32> = base.iter().enumerate().map(|(x, &y)| y * 2f32.powi(row_exp(x / (h * d)))).collect();
        // f16 (normal from 2^-14, largest 65504) and its dq: rows spanning 2^-8 .. 2^8.
        let scaled = if dtype == DType::F16 {
            base.iter().enumerate().map(|(x, &y)| y * 2f32.powi(-8 + (16 * (x / (h * d)) / s_q) as i32)).collect()
        } else {
            scaled
        };
        let d_o = Tensor::from_f32_as(vec![1, s_q, h, d], scaled, dtype).unwrap();
        let params = AttentionParams { mask, ..Default::default() };
        let opts = |workers, dq_mode| EmuOptions { workers, dq_mode, ..Default::default() };
        let f = emu::forward(&q, &k, &v, None, &params, &opts(1, DqMode::Deterministic)).unwrap();
        let grads =
            |workers, mode| emu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, None, &params, &opts(workers, mode)).unwrap();
        let det = grads(1, DqMode::Deterministic);
        let atomic = grads(1, DqMode::Atomic);
        let report = verify::check_results(&q, &k, &v, Some(&d_o), None, &params, &f, Some(&det)).unwrap();
        assert!(report.pass(), "{dtype:?} {mask:?} d{d}\n{}", report.table());
        let ulp = if dtype == DType::BF16 { 2f32.powi(-8) } else { 2f32.powi(-11) };
        let (a, b) = (det.dq.to_f32_vec(), atomic.dq.to_f32_vec());
        let mut nonzero = 0;
        for (row, (x, y)) in a.chunks(d).zip(b.chunks(d)).enumerate() {
            let top = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            // (A causal first query sees one key: dS = P (dP - delta) = 0.)
            nonzero += usize::from(top > 0.0);
            let worst = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(worst <= 2.0 * ulp * top, "{dtype:?} {mask:?} d{d} row {row}: |det - atomic| {worst:e} of {top:e}");
        }
        assert!(nonzero >= (s_q - 1) * h, "{dtype:?} {mask:?}: {nonzero} rows of dq are not zero");
        for workers in [2, 3, 3] {
            assert_eq!(bits(&grads(workers, DqMode::Deterministic).dq), bits(&det.dq), "{workers} workers");
        }
    }
}

#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    // Queries before every key under a causal mask see nothing.
    let q = randn(vec![1, 5, 1, 16], 1, DType::BF16);
    let k = randn(vec![1, 5, 1, 16], 2, DType::BF16);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let (qp, kp) = (ringattn::Positions::contiguous(0, 5), ringattn::Positions::contiguous(3, 5));
    let f = emu::forward(&q, &k, &k, Some((&qp, &kp)), &p, &EmuOptions::default()).unwrap();
    let lse = f.lse.to_f32_vec();
    assert_eq!(&lse[..3], &[f32::NEG_INFINITY; 3]);
    assert!(lse[3..].iter().all(|x| x.is_finite()));
    assert!(f.o.to_f32_vec()[..3 * 16].iter().all(|&x| x == 0.0));
    let g = emu::backward(&q, &k, &k, &f.o, &f.lse, &q, Some((&qp, &kp)), &p, &EmuOptions::default()).unwrap();
    assert!(g.dq.to_f32_vec()[..3 * 16].iter().all(|&x| x == 0.0));
}

#[test]
fn unsupported_inputs_get_clear_errors() {
    let opts = EmuOptions::default();
    let p = AttentionParams::default();
    let x = randn(vec![1, 8, 1, 16], 1, DType::F32);
    let e = emu::forward(&x, &x, &x, None, &p, &opts).unwrap_err();
    assert!(matches!(e, Error::BackendUnsupported { .. }) && e.to_string().contains("f32"), "{e}");
    let x = randn(vec![1, 8, 1, 20], 1, DType::BF16);
    let e = emu::forward(&x, &x, &x, None, &p, &opts).unwrap_err();
    assert!(e.to_string().contains("head dim d_qk = 20"), "{e}");
    let x = randn(vec![1, 8, 1, 264], 1, DType::BF16);
    assert!(emu::forward(&x, &x, &x, None, &p, &opts).is_err());
}

#[test]
fn blocks_spread_over_worker_threads_give_the_same_bits() {
    let q = randn(vec![2, 97, 4, 32], 7, DType::F16);
    let k = randn(vec![2, 97, 2, 32], 8, DType::F16);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let one = emu::forward(&q, &k, &k, None, &p, &EmuOptions { workers: 1, ..Default::default() }).unwrap();
    let many = emu::forward(&q, &k, &k, None, &p, &EmuOptions { workers: 3, ..Default::default() }).unwrap();
    assert_eq!(bits(&one.o), bits(&many.o));
    assert_eq!(bits(&one.lse), bits(&many.lse));
}

// Every strategy, layout and mask on the emulated kernels over in-process ranks, forward and
// backward, against the oracle: messages in NCCL's per-peer order (deterministic dq), and
// matched by tag (atomic dq).
support::conformance::conformance!(
    every_strategy_runs_on_the_emulated_kernels,
    EmuBackend { dtype: DType::BF16, options: EmuOptions { workers: 1, ..Default::default() } },
    DType::BF16,
    MessageOrder::PerPeerFifo
);
support::conformance::conformance!(
    every_strategy_runs_on_the_emulated_kernels_with_atomic_dq,
    EmuBackend {
        dtype: DType::BF16,
        options: EmuOptions { workers: 1, dq_mode: DqMode::Atomic, ..Default::default() }
    },
    DType::BF16,
    MessageOrder::Tag
);

#[test]
fn the_emu_backend_refuses_f32_on_every_rank() {
    let x = randn(vec![1, 16, 2, 16], 1, DType::F32);
    let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
    let e = run_in_process(2, LocalOptions::default(), &EmuBackend::default(), &x, &x, &x, None, &params).unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
}
