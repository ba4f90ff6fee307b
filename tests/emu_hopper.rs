//! The Hopper (sm_90a) kernels of `cuda/flash_fwd_hopper.cu` and `cuda/flash_bwd_hopper.cu` —
//! wgmma, TMA, mbarriers, warp specialisation — run by the host emulator against the float64
//! oracle: every mask, documents, GQA, block positions at global offsets, bf16 and f16, head
//! dims around the classes 64, 128 and 256, lengths around their 64/128-row tiles, with the
//! same bits under the three fiber schedules (dq too, where it is deterministic).
#![cfg(feature = "emu")]

mod support;

use proptest::prelude::*;
use ringattn::cpu::{ForwardOutput, Gradients};
use ringattn::emu::{self, EmuOptions, Schedule};
use ringattn::kernels::geometry::{DqMode, KernelFamily};
use ringattn::{random::randn, verify, AttentionParams, DType, Mask, Tensor};
use support::{mask, placement, sink_level, sinks, softcap, Case};

/// Lengths around the kernel's 64-row consumer tiles and 64/128-key tiles.
const LENGTHS: &[usize] = &[1, 7, 63, 64, 65, 127, 128, 129, 200];
const HEAD_DIMS: &[usize] = &[8, 64, 80, 128, 136, 256];
/// Upper bound on b·h_q·s_q·s_k·d so that the emulator and the oracle stay fast.
const WORK_CAP: usize = 1_500_000;

fn forward(case: &Case, schedule: Schedule) -> ForwardOutput {
    let x = case.inputs();
    let opts = EmuOptions { schedule, workers: 1, kernels: KernelFamily::Hopper, ..Default::default() };
    emu::forward(&x.q, &x.k, &x.v, case.pos(), &case.params, &opts).expect("emulated Hopper forward")
}

fn backward(case: &Case, f: &ForwardOutput, schedule: Schedule, dq_mode: DqMode) -> Gradients {
    let x = case.inputs();
    let opts = EmuOptions { schedule, workers: 1, kernels: KernelFamily::Hopper, dq_mode };
    emu::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, case.pos(), &case.params, &opts)
        .expect("emulated Hopper backward")
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_f32().iter().map(|x| x.to_bits()).collect()
}

fn check(case: &Case, f: &ForwardOutput) -> verify::Report {
    let x = case.inputs();
    verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), case.pos(), &case.params, f, None).unwrap()
}

prop_compose! {
    fn case()(
        s_q in prop::sample::select(LENGTHS),
        s_k in prop::sample::select(LENGTHS),
        same_len in any::<bool>(),
        ratio in prop::sample::select(&[1usize, 2][..]),
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
        let (mut s_q, mut s_k) = (s_q, s_k);
        while ratio * s_q * s_k * d > WORK_CAP { s_q = s_q.div_ceil(2); s_k = s_k.div_ceil(2); }
        let (positions, documents) = placement.apply(s_q, s_k);
        Case {
            b: 1, s_q, s_k, h_q: ratio, h_kv: 1, d,
            dtype: if bf16 { DType::BF16 } else { DType::F16 },
            params: AttentionParams { mask, documents, scale, softcap, sinks: sinks(sink_level, ratio) },
            positions, seed, tiles: Default::default(), arithmetic: Default::default(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(12)))]

    /// The forward against the oracle, and the same bits under reverse and random fiber
    /// orders (any difference is a race between the producer and the consumers).
    #[test]
    fn the_hopper_backward_matches_the_oracle_under_every_schedule(
        case in case(),
        sched_seed in any::<u64>(),
        atomic in any::<bool>(),
    ) {
        let x = case.inputs();
        let mode = if atomic { DqMode::Atomic } else { DqMode::Deterministic };
        let f = forward(&case, Schedule::Forward);
        let g = backward(&case, &f, Schedule::Forward, mode);
        let report = verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), case.pos(), &case.params, &f, Some(&g))
            .unwrap();
        prop_assert!(report.pass(), "{mode:?} {case:?}\n{}", report.table());
        for schedule in [Schedule::Reverse, Schedule::Random(sched_seed)] {
            let g2 = backward(&case, &f, schedule, mode);
            for (name, a, b) in [("dq", &g.dq, &g2.dq), ("dk", &g.dk, &g2.dk), ("dv", &g.dv, &g2.dv)] {
                if name == "dq" && atomic {
                    continue;
                }
                prop_assert!(bits(a) == bits(b), "{name} differs under {schedule:?}: {case:?}");
            }
        }
    }

    #[test]
    fn the_hopper_forward_matches_the_oracle_under_every_schedule(case in case(), sched_seed in any::<u64>()) {
        let f = forward(&case, Schedule::Forward);
        let report = check(&case, &f);
        prop_assert!(report.pass(), "{case:?}\n{}", report.table());
        for schedule in [Schedule::Reverse, Schedule::Random(sched_seed)] {
            let f2 = forward(&case, schedule);
            prop_assert!(bits(&f.o) == bits(&f2.o) && bits(&f.lse) == bits(&f2.lse), "differs under {schedule:?}: {case:?}");
        }
    }
}

/// Each head-dim class, causal, several key tiles (the stage ring wraps), GQA and batch, forward
/// and backward.
#[test]
fn every_head_dim_class_runs_causal_with_gqa_over_several_tiles() {
    for (d, dtype) in [(64, DType::BF16), (128, DType::F16), (256, DType::BF16)] {
        let case = Case {
            b: 2,
            s_q: 300,
            s_k: 300,
            h_q: 2,
            h_kv: 1,
            d,
            dtype,
            params: AttentionParams { mask: Mask::Causal, ..Default::default() },
            positions: None,
            seed: d as u64,
            tiles: Default::default(),
            arithmetic: Default::default(),
        };
        let f = forward(&case, Schedule::Random(d as u64));
        let g = backward(&case, &f, Schedule::Random(d as u64 + 1), DqMode::Deterministic);
        let x = case.inputs();
        let report =
            verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), case.pos(), &case.params, &f, Some(&g)).unwrap();
        assert!(report.pass(), "d {d}\n{}", report.table());
    }
}

/// The same results as the FA2-class forward within the oracle's bound, and rounded output.
#[test]
fn rounded_output_and_the_fa2_family_agree() {
    let q = randn(vec![1, 150, 2, 64], 1, DType::BF16);
    let k = randn(vec![1, 150, 1, 64], 2, DType::BF16);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let hopper = EmuOptions { kernels: KernelFamily::Hopper, ..Default::default() };
    let a = emu::forward(&q, &k, &k, None, &p, &hopper).unwrap();
    let b = emu::forward(&q, &k, &k, None, &p, &EmuOptions::default()).unwrap();
    assert_eq!(a.o.dtype(), DType::BF16);
    let diff = a.o.to_f32_vec().iter().zip(b.o.to_f32_vec()).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff < 0.02, "hopper vs fa2: {diff}");
}

// Every strategy, layout and mask with the Hopper kernels, forward and backward, over
// in-process ranks, against the oracle.
support::conformance::conformance!(
    every_strategy_runs_with_the_hopper_kernels,
    ringattn::emu::EmuBackend {
        dtype: DType::BF16,
        options: EmuOptions { workers: 1, kernels: KernelFamily::Hopper, ..Default::default() }
    },
    DType::BF16,
    ringattn::comm::MessageOrder::PerPeerFifo
);
