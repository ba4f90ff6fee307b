//! Multi-head latent attention's head dims (`d_qk ≠ d_v`: DeepSeek-V3's 192/128, and 96/64)
//! against the float64 oracle on the CPU — f32 and bf16 inputs, both CPU arithmetics, tile
//! edges inside the sequence — and under every strategy; and the kernel backends' refusal,
//! typed and on every rank, until their kernels take the pair.

mod support;

use ringattn::comm::LocalOptions;
use ringattn::parallel::{run_in_process, CpuBackend, ParallelParams, Strategy};
use ringattn::{
    cpu, random::randn, reference, verify, AttentionParams, DType, Dims, Documents, Error, Mask, Positions, Tensor,
};

const PAIRS: [(usize, usize); 2] = [(192, 128), (96, 64)];

fn inputs(b: usize, s: usize, hq: usize, hkv: usize, (d_qk, d_v): (usize, usize), dtype: DType) -> [Tensor; 4] {
    [
        randn(vec![b, s, hq, d_qk], 1, dtype),
        randn(vec![b, s, hkv, d_qk], 2, dtype),
        randn(vec![b, s, hkv, d_v], 3, dtype),
        randn(vec![b, s, hq, d_v], 4, dtype),
    ]
}

fn masks() -> Vec<AttentionParams> {
    vec![
        AttentionParams::default(),
        AttentionParams { mask: Mask::Causal, ..Default::default() },
        AttentionParams { mask: Mask::Window { left: Some(23), right: Some(4) }, ..Default::default() },
        AttentionParams {
            mask: Mask::Causal,
            documents: Some(Documents::new(vec![40, 71, 19]).unwrap()),
            ..Default::default()
        },
    ]
}

#[test]
fn single_device_cpu_matches_the_oracle() {
    let tiles = [cpu::TileConfig::default(), cpu::TileConfig { block_q: 24, block_k: 40 }];
    for pair in PAIRS {
        for dtype in [DType::F32, DType::BF16] {
            let [q, k, v, d_o] = inputs(2, 130, 4, 2, pair, dtype);
            let arithmetics = match dtype {
                DType::BF16 => vec![cpu::Arithmetic::Auto, cpu::Arithmetic::F32],
                _ => vec![cpu::Arithmetic::Auto],
            };
            for arithmetic in arithmetics {
                for t in tiles {
                    for p in masks() {
                        let cfg = cpu::CpuConfig { tiles: t, arithmetic, ..Default::default() };
                        let what = format!("{pair:?} {dtype} {arithmetic:?} {t:?} {p:?}");
                        let fwd = cpu::forward_with(&q, &k, &v, None, &p, &cfg).expect(&what);
                        assert_eq!(fwd.o.shape(), [2, 130, 4, pair.1], "{what}");
                        let g = cpu::backward_with(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, None, &p, &cfg).expect(&what);
                        let r = verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &fwd, Some(&g)).unwrap();
                        assert!(r.pass(), "{what}\n{}", r.table());
                    }
                }
            }
        }
    }
}

#[test]
fn a_block_of_a_longer_sequence_matches_the_oracle() {
    // Query rows at 100.. against keys at 40..: the ring's later hops.
    let (qp, kp) = (Positions::contiguous(100, 50), Positions::contiguous(40, 90));
    let p = AttentionParams { mask: Mask::Window { left: Some(70), right: Some(0) }, ..Default::default() };
    for pair in PAIRS {
        for dtype in [DType::F32, DType::BF16] {
            let q = randn(vec![1, 50, 2, pair.0], 5, dtype);
            let k = randn(vec![1, 90, 1, pair.0], 6, dtype);
            let v = randn(vec![1, 90, 1, pair.1], 7, dtype);
            let d_o = randn(vec![1, 50, 2, pair.1], 8, dtype);
            let cfg = cpu::CpuConfig::default();
            let fwd = cpu::forward_with(&q, &k, &v, Some((&qp, &kp)), &p, &cfg).unwrap();
            let g = cpu::backward_with(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, Some((&qp, &kp)), &p, &cfg).unwrap();
            let r = verify::check_results(&q, &k, &v, Some(&d_o), Some((&qp, &kp)), &p, &fwd, Some(&g)).unwrap();
            assert!(r.pass(), "{pair:?} {dtype}\n{}", r.table());
        }
    }
}

#[test]
fn every_strategy_on_the_cpu_matches_the_oracle() {
    for pair in PAIRS {
        for dtype in [DType::F32, DType::BF16] {
            support::conformance::check_head_dims(&CpuBackend::default(), dtype, pair);
        }
    }
}

/// TransformerEngine's context-parallel MLA configurations (`test_attention_with_cp.py`,
/// cp_3_0..cp_3_3: b 2, s 4096, d_qk 192, d_v 128; 128 heads causal, 12 heads full, causal
/// with a (512, 0) window, a (512, 512) window), scaled to s 256 with the windows (and the
/// 128 heads to 8) by the same factor, the head dims kept; TransformerEngine runs them over
/// KV P2P only (2 and 4 GPUs), here every strategy over 2 and 4 ranks, f32 and bf16, on the
/// CPU against the float64 oracle.
pub fn transformer_engine_configurations() -> Vec<(&'static str, usize, AttentionParams)> {
    let window = |left, right| Mask::Window { left: Some(left), right: Some(right) };
    vec![
        ("cp_3_0", 8, AttentionParams { mask: Mask::Causal, ..Default::default() }),
        ("cp_3_1", 12, AttentionParams::default()),
        ("cp_3_2", 12, AttentionParams { mask: window(32, 0), ..Default::default() }),
        ("cp_3_3", 12, AttentionParams { mask: window(32, 32), ..Default::default() }),
    ]
}

#[test]
fn transformer_engines_mla_configurations_scaled_pass_on_every_strategy() {
    let (b, s) = (2, 256);
    for (name, h, attention) in transformer_engine_configurations() {
        for dtype in [DType::F32, DType::BF16] {
            let [q, k, v, d_o] = inputs(b, s, h, h, (192, 128), dtype);
            // The oracle and the naive model once per inputs, every run against them.
            let oracle = reference::backward(&q, &k, &v, &d_o, &attention).unwrap();
            let naive = reference::naive_rounded(&q, &k, &v, Some(&d_o), None, &attention, dtype).unwrap();
            for (strategy, world, degree) in [
                (Strategy::Ring, 2, None),
                (Strategy::AllGather, 2, None),
                (Strategy::Ulysses, 2, None),
                (Strategy::Usp, 4, Some(2)),
                (Strategy::Ring, 4, None),
            ] {
                let params = ParallelParams {
                    strategy,
                    attention: attention.clone(),
                    seq_len: s,
                    ulysses_degree: degree,
                    ..Default::default()
                };
                let what = format!("{name} {dtype} {strategy} x{world}");
                let run = run_in_process(
                    world,
                    LocalOptions::default(),
                    &CpuBackend::default(),
                    &q,
                    &k,
                    &v,
                    Some(&d_o),
                    &params,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                let r =
                    verify::report(dtype, &run.forward, run.gradients.as_ref(), &oracle, &naive, &Default::default());
                assert!(r.pass() && r.rows.len() == 5, "{what}\n{}", r.table());
            }
        }
    }
}

#[test]
fn the_flops_count_both_head_dims() {
    let dims = Dims { b: 1, s_q: 10, s_k: 10, h_q: 1, h_kv: 1, d_qk: 192, d_v: 128 };
    let fwd = ringattn::flops::flops(&dims, 100, ringattn::flops::Pass::Forward);
    assert_eq!(fwd, 100.0 * 2.0 * (192.0 + 128.0));
    let bwd = ringattn::flops::flops(&dims, 100, ringattn::flops::Pass::Backward);
    assert_eq!(bwd, 100.0 * 2.0 * (3.0 * 192.0 + 2.0 * 128.0));
    let equal = Dims { d_qk: 64, d_v: 64, ..dims };
    assert_eq!(ringattn::flops::backward_ratio(&equal), ringattn::flops::BACKWARD_FACTOR);
}

#[test]
fn shapes_that_disagree_are_refused_naming_the_tensor() {
    let f = DType::F32;
    let q = randn(vec![1, 8, 2, 192], 1, f);
    // v's [b, s, h] must be k's.
    let e = cpu::forward(&q, &randn(vec![1, 8, 2, 192], 2, f), &randn(vec![1, 8, 1, 128], 3, f), &Default::default())
        .unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch(m) if m.contains("[b, s_k, h_kv]")), "{e}");
    // d_o must be [b, s, h_q, d_v], not q's shape.
    let (k, v) = (randn(vec![1, 8, 2, 192], 2, f), randn(vec![1, 8, 2, 128], 3, f));
    let fwd = cpu::forward(&q, &k, &v, &Default::default()).unwrap();
    let e =
        cpu::backward(&q, &k, &v, &fwd.o, &fwd.lse, &randn(vec![1, 8, 2, 192], 4, f), &Default::default()).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch(m) if m.contains("`do`") && m.contains("128")), "{e}");
}

#[test]
fn parallel_shapes_follow_v() {
    // The plan checks each buffer against its own head dim: a q-shaped o is refused.
    let [q, k, v, d_o] = inputs(1, 32, 2, 2, (96, 64), DType::F32);
    let params = ParallelParams { strategy: Strategy::Ring, seq_len: 32, ..Default::default() };
    let run =
        run_in_process(2, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&d_o), &params).unwrap();
    assert_eq!(run.forward.o.shape(), [1, 32, 2, 64]);
    let wrong = randn(vec![1, 32, 2, 96], 9, DType::F32);
    let e = run_in_process(2, LocalOptions::default(), &CpuBackend::default(), &q, &k, &v, Some(&wrong), &params)
        .unwrap_err();
    assert!(e.to_string().contains("do") || e.to_string().contains("d_o"), "{e}");
}

/// The emulated kernels (both families; deterministic and atomic dq) run the pair at the
/// larger head dim's class, V and O at their own width: forward and backward against the
/// oracle, bf16 and f16, single device and a block of a longer sequence.
#[cfg(feature = "emu")]
mod kernels {
    use super::*;
    use ringattn::emu::{self, EmuBackend, EmuOptions};
    use ringattn::kernels::geometry::{DqMode, KernelFamily};

    fn options() -> Vec<EmuOptions> {
        let o = |kernels, dq_mode| EmuOptions { workers: 1, kernels, dq_mode, ..Default::default() };
        vec![
            o(KernelFamily::Fa2, DqMode::Deterministic),
            o(KernelFamily::Fa2, DqMode::Atomic),
            o(KernelFamily::Hopper, DqMode::Deterministic),
        ]
    }

    #[test]
    fn single_device_matches_the_oracle() {
        let params = [
            AttentionParams { mask: Mask::Causal, ..Default::default() },
            AttentionParams {
                mask: Mask::Window { left: Some(20), right: Some(0) },
                documents: Some(Documents::new(vec![30, 40]).unwrap()),
                ..Default::default()
            },
        ];
        // (128, 64): a larger head dim of 97..=128 runs at class 192's `_dv` kernels; (160,
        // 96): the (192, 128) pair's kernels with columns past both head dims zero-filled.
        for pair in PAIRS.into_iter().chain([(128, 64), (160, 96)]) {
            for (dtype, opts) in
                [DType::BF16, DType::F16].into_iter().flat_map(|t| options().into_iter().map(move |o| (t, o)))
            {
                for p in &params {
                    let [q, k, v, d_o] = inputs(1, 70, 2, 1, pair, dtype);
                    let what = format!("{pair:?} {dtype} {:?} {:?} {p:?}", opts.kernels, opts.dq_mode);
                    let fwd = emu::forward(&q, &k, &v, None, p, &opts).expect(&what);
                    assert_eq!(fwd.o.shape(), [1, 70, 2, pair.1], "{what}");
                    let g = emu::backward(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, None, p, &opts).expect(&what);
                    let r = verify::check_results(&q, &k, &v, Some(&d_o), None, p, &fwd, Some(&g)).unwrap();
                    assert!(r.pass(), "{what}\n{}", r.table());
                }
            }
        }
    }

    /// The (192, 128) pair's own kernels with a soft-cap (their capped variants), a window and
    /// GQA, in both dq modes, against the oracle.
    #[test]
    fn the_pair_kernels_take_the_soft_cap() {
        let p = AttentionParams {
            mask: Mask::Window { left: Some(40), right: Some(3) },
            softcap: Some(1.5),
            ..Default::default()
        };
        for opts in options().into_iter().filter(|o| o.kernels == KernelFamily::Fa2) {
            let [q, k, v, d_o] = inputs(1, 90, 4, 2, (192, 128), DType::BF16);
            let what = format!("{:?}", opts.dq_mode);
            let fwd = emu::forward(&q, &k, &v, None, &p, &opts).expect(&what);
            let g = emu::backward(&q, &k, &v, &fwd.o, &fwd.lse, &d_o, None, &p, &opts).expect(&what);
            let r = verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &fwd, Some(&g)).unwrap();
            assert!(r.pass(), "{what}\n{}", r.table());
        }
    }

    #[test]
    fn pairs_no_kernel_holds_are_refused_on_every_rank() {
        // The larger head dim at most 64: no `_dv` class; refused, typed, naming both dims.
        let [q, k, v, _] = inputs(1, 16, 2, 2, (64, 32), DType::BF16);
        let e = emu::forward(&q, &k, &v, None, &Default::default(), &EmuOptions::default()).unwrap_err();
        assert!(matches!(&e, Error::BackendUnsupported { .. }) && e.to_string().contains("d_v = 32"), "{e}");
        let params = ParallelParams { strategy: Strategy::Ring, seq_len: 16, ..Default::default() };
        let backend = EmuBackend { dtype: DType::BF16, options: EmuOptions::default() };
        let runs = ringattn::comm::spmd(2, LocalOptions::default(), |comm| {
            let dims = Dims { b: 1, s_q: 8, s_k: 8, h_q: 2, h_kv: 2, d_qk: 64, d_v: 32 };
            ringattn::parallel::ParallelPlan::new(comm, &backend, &params, &dims, DType::BF16).map(|_| ())
        });
        for r in runs {
            let e = r.unwrap_err();
            assert!(e.to_string().contains("d_qk = 64 with d_v = 32"), "{e}");
        }
    }

    #[test]
    fn every_strategy_on_the_emulated_kernels_matches_the_oracle() {
        let backend = |kernels| EmuBackend {
            dtype: DType::BF16,
            options: EmuOptions { workers: 1, kernels, ..Default::default() },
        };
        for family in [KernelFamily::Fa2, KernelFamily::Hopper] {
            for pair in PAIRS {
                support::conformance::check_head_dims(&backend(family), DType::BF16, pair);
            }
        }
    }
}
