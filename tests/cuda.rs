//! The CUDA backend (feature `cuda`). Without a driver or GPU (this project's machines): every
//! entry point fails with an error that says so, never a panic. With a GPU (detected at run
//! time by `cuda::probe`): the kernels against the float64 oracle — forward and backward,
//! every mask, documents, GQA, block positions at global offsets, bf16 and f16, head dims
//! 8–256, lengths around the tile edges — bit-identical reruns, the device-resident API, and
//! every strategy on `CudaBackend`. The GPU checks print a note and return when there is no
//! GPU: they are skipped, visibly, not passed.
#![cfg(feature = "cuda")]

mod support;

use ringattn::comm::LocalOptions;
use ringattn::cuda::{self, CudaBackend, CudaDevice, CudaOptions, Delta, DeviceGradients, FlashForwardArgs};
use ringattn::parallel::{run_in_process, ParallelParams, Strategy};
use ringattn::{random::randn, verify, AttentionParams, DType, Dims, Documents, Error, Mask, Positions, Tensor};
use support::{block_positions, Case};

/// Whether a GPU is present; prints why the test is skipped otherwise.
fn gpu(test: &str) -> bool {
    match cuda::probe() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED {test}: needs a GPU ({e})");
            false
        }
    }
}

/// The sequence length of a strategy sweep: `on_gpu` on a GPU, a quarter of it on the emulated
/// GPU (which runs the kernels on the CPU: there these tests prove the host path — buffers,
/// streams, events, copies between ranks — while tests/emu.rs sweeps the kernels' numerics
/// on the emulator itself).
fn sweep_len(on_gpu: usize) -> usize {
    let emulated = CudaDevice::shared(0).is_ok_and(|d| ringattn::kernels::is_emulated_gpu(d.name()));
    if emulated {
        on_gpu / 4
    } else {
        on_gpu
    }
}

fn is_no_gpu(e: &Error) -> bool {
    let m = e.to_string();
    matches!(e, Error::Cuda(_)) && (m.contains("no CUDA driver found") || m.contains("no CUDA GPU found"))
}

#[test]
fn without_a_gpu_every_entry_point_fails_cleanly() {
    if cuda::probe().is_ok() {
        eprintln!("SKIPPED without_a_gpu_every_entry_point_fails_cleanly: this machine has a GPU");
        return;
    }
    let x = randn(vec![1, 16, 2, 32], 1, DType::BF16);
    let (p, opts) = (AttentionParams::default(), CudaOptions::default());
    let e = cuda::probe().unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    assert_eq!(e.to_string(), cuda::probe().unwrap_err().to_string(), "the probe is cached");
    let e = cuda::forward(&x, &x, &x, None, &p, &opts).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    assert_eq!(e.to_string().lines().count(), 1, "one line: {e}");
    let lse = Tensor::from_f32(vec![1, 2, 16], vec![0.0; 32]).unwrap();
    let e = cuda::backward(&x, &x, &x, &x, &lse, &x, None, &p, &opts).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = CudaDevice::new(0).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = CudaDevice::shared(3).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = CudaBackend::new(0, DType::BF16).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
}

/// Bad inputs are refused before the GPU is touched, with the same errors as the emulator.
#[test]
fn unsupported_inputs_get_clear_errors_on_any_machine() {
    let (p, opts) = (AttentionParams::default(), CudaOptions::default());
    let x = randn(vec![1, 8, 1, 16], 1, DType::F32);
    let e = cuda::forward(&x, &x, &x, None, &p, &opts).unwrap_err();
    assert!(matches!(e, Error::BackendUnsupported { backend: "cuda", .. }) && e.to_string().contains("f32"), "{e}");
    let e = CudaBackend::new(0, DType::F32).unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
    let x = randn(vec![1, 8, 1, 20], 1, DType::BF16);
    let e = cuda::forward(&x, &x, &x, None, &p, &opts).unwrap_err();
    assert!(e.to_string().contains("head dim d_qk = 20"), "{e}");
    let x = randn(vec![1, 8, 1, 264], 1, DType::F16);
    assert!(cuda::forward(&x, &x, &x, None, &p, &opts).unwrap_err().to_string().contains("head dim d_qk = 264"));
    let q = randn(vec![1, 8, 3, 16], 1, DType::BF16);
    let k = randn(vec![1, 8, 2, 16], 1, DType::BF16);
    assert!(matches!(cuda::forward(&q, &k, &k, None, &p, &opts).unwrap_err(), Error::HeadRatio { .. }));
    let docs = AttentionParams { documents: Some(Documents::new(vec![3, 3]).unwrap()), ..Default::default() };
    let x = randn(vec![1, 8, 1, 16], 1, DType::BF16);
    assert!(matches!(cuda::forward(&x, &x, &x, None, &docs, &opts).unwrap_err(), Error::Documents(_)));
}

#[test]
fn workspace_and_bit_patterns() {
    let dims = Dims { b: 2, s_q: 10, s_k: 30, h_q: 4, h_kv: 2, d_qk: 64, d_v: 64 };
    // Positions and document ids, delta, and the fixed-point dq's units and K/V bounds.
    assert_eq!(cuda::dq_workspace_len(&dims), 2 * 4 * 10 + 2 * 2 * 2);
    assert_eq!(cuda::workspace_bytes(&dims), 12 * 40 + 4 * 2 * 4 * 10 + 4 * (2 * 4 * 10 + 2 * 2 * 2));
    let x = randn(vec![100], 3, DType::F32).to_f32_vec();
    let b = cuda::to_bits(&x, DType::BF16);
    let back: Vec<f32> = b.iter().map(|&u| half::bf16::from_bits(u).to_f32()).collect();
    assert_eq!(back, Tensor::from_f32(vec![100], x).unwrap().to_dtype(DType::BF16).to_f32_vec());
}

#[allow(clippy::too_many_arguments)]
fn case(b: usize, s_q: usize, s_k: usize, h_kv: usize, ratio: usize, d: usize, dtype: DType, mask: Mask) -> Case {
    Case {
        b,
        s_q,
        s_k,
        h_q: h_kv * ratio,
        h_kv,
        d,
        dtype,
        params: AttentionParams { mask, ..Default::default() },
        positions: None,
        seed: (b * 7 + s_q * 13 + s_k * 17 + d) as u64,
        tiles: Default::default(),
        arithmetic: Default::default(),
    }
}

fn run_case(c: &Case) -> (ringattn::cpu::ForwardOutput, ringattn::cpu::Gradients) {
    let x = c.inputs();
    let opts = CudaOptions::default();
    let f = cuda::forward(&x.q, &x.k, &x.v, c.pos(), &c.params, &opts).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let g = cuda::backward(&x.q, &x.k, &x.v, &f.o, &f.lse, &x.d_o, c.pos(), &c.params, &opts)
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    (f, g)
}

fn check(c: &Case) {
    let x = c.inputs();
    let (f, g) = run_case(c);
    let report =
        verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), c.pos(), &c.params, &f, Some(&g)).expect("oracle");
    assert!(report.pass(), "{c:?}\n{}", report.table());
}

/// Each `(strategy, world)` under each mask, run by `run` (in-process ranks on the host or
/// device-resident ranks), forward and backward against the float64 oracle — it and the
/// naive rounded model computed once per mask.
fn check_strategies(
    [q, k, v, d_o]: [&Tensor; 4],
    masks: &[Mask],
    strategies: &[(Strategy, usize)],
    run: impl Fn(usize, &ParallelParams) -> Result<ringattn::parallel::ProcessRun, Error>,
) {
    // The masks, then a soft-capped case (the kernels' capped variants through this path),
    // then sinks (the merge family's sink kernels at the finish step and the gradient).
    let cases = masks.iter().map(|&mask| AttentionParams { mask, ..Default::default() });
    let h_q = q.shape()[2];
    let sinks = AttentionParams {
        mask: Mask::Causal,
        sinks: Some((0..h_q).map(|h| 1.0 + 1.5 * h as f32).collect()),
        ..Default::default()
    };
    for attention in cases.chain(support::conformance::score_options().into_iter().take(1)).chain([sinks]) {
        let mask = attention.mask;
        let oracle = ringattn::reference::backward(q, k, v, d_o, &attention).unwrap();
        let naive = ringattn::reference::naive_rounded(q, k, v, Some(d_o), None, &attention, q.dtype()).unwrap();
        for &(strategy, world) in strategies {
            let params = ParallelParams { strategy, attention: attention.clone(), ..Default::default() };
            let r = run(world, &params).unwrap_or_else(|e| panic!("{strategy:?} x{world}: {e}"));
            let report =
                verify::report(q.dtype(), &r.forward, r.gradients.as_ref(), &oracle, &naive, &Default::default());
            let what =
                format!("{strategy:?} x{world} {mask:?} softcap {:?} sinks {:?}", attention.softcap, attention.sinks);
            let rows = 5 + usize::from(attention.sinks.is_some());
            assert!(report.pass() && report.rows.len() == rows, "{what}\n{}", report.table());
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_f32().iter().map(|x| x.to_bits()).collect()
}

/// Forward and backward against the oracle over lengths around the tile edges, head dims
/// 8–256 (shared memory beyond the 48 KiB default from d = 128), GQA, every mask kind, both
/// dtypes.
#[test]
fn kernels_match_the_oracle_on_the_gpu() {
    if !gpu("kernels_match_the_oracle_on_the_gpu") {
        return;
    }
    let dev = CudaDevice::shared(0).unwrap();
    eprintln!("{dev:?}");
    let masks = [
        Mask::None,
        Mask::Causal,
        Mask::Window { left: Some(5), right: Some(3) },
        Mask::Window { left: None, right: Some(0) },
        Mask::Window { left: Some(40), right: None },
    ];
    let mut n = 0;
    for (i, &(s_q, s_k)) in [(1, 1), (31, 31), (33, 65), (64, 64), (97, 130), (200, 33), (257, 257)].iter().enumerate()
    {
        for (j, &d) in [8, 16, 32, 64, 80, 128, 256].iter().enumerate() {
            let dtype = if (i + j) % 2 == 0 { DType::BF16 } else { DType::F16 };
            let mask = masks[(i + j) % masks.len()];
            let (ratio, h_kv, b) = ([1, 2, 4][(i + 2 * j) % 3], 1 + (i % 2), 1 + (j % 2));
            check(&case(b, s_q, s_k, h_kv, ratio, d, dtype, mask));
            n += 1;
        }
    }
    // Packed documents and fully masked rows.
    let mut c = case(2, 90, 90, 2, 2, 64, DType::BF16, Mask::Causal);
    c.params.documents = Some(Documents::new(vec![10, 0, 45, 35]).unwrap());
    check(&c);
    // Block positions at global offsets: strided, two segments (zigzag), queries before keys.
    for (mode_q, mode_k, q0, k0) in [(0, 0, 128, 0), (1, 2, 3, 50), (2, 1, 0, 300), (2, 2, 40, 40)] {
        let mut c = case(1, 70, 45, 2, 2, 64, DType::F16, Mask::Causal);
        c.positions = Some((block_positions(70, mode_q, q0, 2, 17), block_positions(45, mode_k, k0, 3, 9)));
        check(&c);
        c.params.mask = Mask::Window { left: Some(30), right: Some(10) };
        check(&c);
    }
    eprintln!("{} cases passed on {}", n + 9, dev.name());
}

#[test]
fn reruns_are_bit_identical_and_empty_key_sets_are_fully_masked() {
    if !gpu("reruns_are_bit_identical_and_empty_key_sets_are_fully_masked") {
        return;
    }
    let c = case(2, 300, 300, 2, 4, 128, DType::BF16, Mask::Causal);
    let (f1, g1) = run_case(&c);
    let (f2, g2) = run_case(&c);
    for (name, a, b) in [
        ("o", &f1.o, &f2.o),
        ("lse", &f1.lse, &f2.lse),
        ("dq", &g1.dq, &g2.dq),
        ("dk", &g1.dk, &g2.dk),
        ("dv", &g1.dv, &g2.dv),
    ] {
        assert!(bits(a) == bits(b), "{name} differs between two runs");
    }
    // Queries before every key under a causal mask see nothing; s_k = 0 likewise.
    let q = randn(vec![1, 5, 1, 16], 1, DType::BF16);
    let k = randn(vec![1, 5, 1, 16], 2, DType::BF16);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let (qp, kp) = (Positions::contiguous(0, 5), Positions::contiguous(3, 5));
    let opts = CudaOptions::default();
    let f = cuda::forward(&q, &k, &k, Some((&qp, &kp)), &p, &opts).unwrap();
    let lse = f.lse.to_f32_vec();
    assert_eq!(&lse[..3], &[f32::NEG_INFINITY; 3]);
    assert!(lse[3..].iter().all(|x| x.is_finite()));
    assert!(f.o.to_f32_vec()[..3 * 16].iter().all(|&x| x == 0.0));
    let g = cuda::backward(&q, &k, &k, &f.o, &f.lse, &q, Some((&qp, &kp)), &p, &opts).unwrap();
    assert!(g.dq.to_f32_vec()[..3 * 16].iter().all(|&x| x == 0.0));
    let none = randn(vec![1, 0, 1, 16], 3, DType::BF16);
    let f = cuda::forward(&q, &none, &none, None, &AttentionParams::default(), &opts).unwrap();
    assert!(f.lse.to_f32_vec().iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(f.o.to_f32_vec().iter().all(|&x| x == 0.0));
}

/// The device-resident API: outputs fully written (they start as NaN), what the host path
/// returns, `Delta::Given` equal to `Delta::Compute`, short buffers refused, event timing.
#[test]
fn the_device_resident_api_matches_the_host_path() {
    if !gpu("the_device_resident_api_matches_the_host_path") {
        return;
    }
    let dev = CudaDevice::shared(0).unwrap();
    let stream = dev.stream().clone();
    let c = case(1, 513, 513, 2, 4, 64, DType::BF16, Mask::Causal);
    let x = c.inputs();
    let dims = Dims::of(&x.q, &x.k, &x.v).unwrap();
    let up = |t: &Tensor| dev.upload_bits(&cuda::to_bits(&t.to_f32_vec(), DType::BF16)).unwrap();
    let (q, k, v, d_o) = (up(&x.q), up(&x.k), up(&x.v), up(&x.d_o));
    let mask = dev.mask(&dims, None, &c.params).unwrap();
    let args = FlashForwardArgs {
        dims,
        dtype: DType::BF16,
        q: &q,
        k: &k,
        v: &v,
        mask: &mask,
        spec: ringattn::attention::ScoreSpec::of(&c.params, &dims),
        kernels: Default::default(),
    };
    let saved = dev.forward(&stream, &args).unwrap();
    let o = dev.download_f32(&saved.o, dims.b * dims.s_q * dims.h_q * dims.d_v).unwrap();
    let lse = dev.download_f32(&saved.lse, dims.b * dims.h_q * dims.s_q).unwrap();
    assert!(o.iter().chain(&lse).all(|x| !x.is_nan()), "every output element written");
    let host = cuda::forward(&x.q, &x.k, &x.v, None, &c.params, &CudaOptions::default()).unwrap();
    assert_eq!(lse, host.lse.to_f32_vec());
    let bargs =
        ringattn::cuda::FlashBackwardArgs { forward: args, saved: &saved, d_o: &d_o, dq_mode: Default::default() };
    let grads = dev.backward(&stream, &bargs).unwrap();
    let mut delta = dev.alloc_f32(dims.b * dims.h_q * dims.s_q).unwrap();
    dev.rowsum_into(&stream, &dims, DType::BF16, &saved.o, &d_o, &mut delta).unwrap();
    let mut given = DeviceGradients::alloc(&stream, &dims).unwrap();
    dev.backward_into(&stream, &bargs, Delta::Given(&delta), &mut given).unwrap();
    let n_kv = dims.b * dims.s_k * dims.h_kv * dims.d_qk; // d_qk = d_v here
    for (a, b) in [(&grads.dk, &given.dk), (&grads.dv, &given.dv)] {
        let (a, b) = (dev.download_f32(a, n_kv).unwrap(), dev.download_f32(b, n_kv).unwrap());
        assert!(a.iter().all(|x| !x.is_nan()));
        assert_eq!(a, b);
    }
    // A short buffer is refused.
    let short = dev.upload_bits(&[0u16; 16]).unwrap();
    let bad = FlashForwardArgs { q: &short, ..args };
    let e = dev.forward(&stream, &bad).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch(_)) && e.to_string().contains("`q`"), "{e}");
    // Event timing: one positive sample per iteration.
    let mut out = ringattn::cuda::SavedContext::alloc(&stream, &dims).unwrap();
    let t = dev.time_iterations(&stream, 1, 3, || dev.forward_into(&stream, &args, &mut out)).unwrap();
    assert_eq!(t.len(), 3);
    assert!(t.iter().all(|&ms| ms > 0.0 && ms.is_finite()), "{t:?}");
}

/// Every strategy with 1–4 in-process ranks sharing the GPU, forward and backward, against
/// the oracle.
#[test]
fn every_strategy_runs_on_the_gpu() {
    if !gpu("every_strategy_runs_on_the_gpu") {
        return;
    }
    let (b, s, hq, hkv, d) = (1, sweep_len(777), 4, 2, 64);
    let dtype = DType::BF16;
    let q = randn(vec![b, s, hq, d], 11, dtype);
    let k = randn(vec![b, s, hkv, d], 12, dtype);
    let v = randn(vec![b, s, hkv, d], 13, dtype);
    let d_o = randn(vec![b, s, hq, d], 14, dtype);
    let backend = CudaBackend::new(0, dtype).unwrap();
    let strategies = [
        (Strategy::Single, 1),
        (Strategy::Ring, 3),
        (Strategy::AllGather, 2),
        (Strategy::Ulysses, 2),
        (Strategy::Usp, 4),
    ];
    check_strategies([&q, &k, &v, &d_o], &[Mask::None, Mask::Causal], &strategies, |world, params| {
        run_in_process(world, LocalOptions::default(), &backend, &q, &k, &v, Some(&d_o), params)
    });
    let x = randn(vec![1, 16, 2, 16], 1, DType::F16);
    let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
    let e = run_in_process(2, LocalOptions::default(), &backend, &x, &x, &x, None, &params).unwrap_err();
    assert!(e.to_string().contains("F16"), "{e}");
}

/// The device-resident drivers: constructors fail cleanly without a GPU.
#[test]
fn without_a_gpu_the_device_resident_api_fails_cleanly() {
    if cuda::probe().is_ok() {
        eprintln!("SKIPPED without_a_gpu_the_device_resident_api_fails_cleanly: this machine has a GPU");
        return;
    }
    let e = cuda::DeviceBackend::open(0, DType::BF16).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = cuda::DeviceComm::open(2, LocalOptions::default(), 0).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let x = randn(vec![1, 64, 2, 32], 1, DType::BF16);
    let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
    let run = cuda::DeviceRunOptions::default();
    let e = cuda::run_on_device(2, LocalOptions::default(), &run, &x, &x, &x, Some(&x), &params).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = cuda::measure_device_overlap(2, LocalOptions::default(), &run, &x, &x, &x, None, &params).unwrap_err();
    assert!(is_no_gpu(&e), "{e}");
    let e = cuda::NcclComm::init(0, 1, [0; 128], 0, std::time::Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, Error::Cuda(_)), "{e}");
    assert!(cuda::new_unique_id().is_err());
    // Inputs the kernels do not take are refused before the GPU is looked for.
    let f = randn(vec![1, 64, 2, 32], 1, DType::F32);
    let e = cuda::run_on_device(2, LocalOptions::default(), &run, &f, &f, &f, None, &params).unwrap_err();
    assert!(matches!(e, Error::BackendUnsupported { .. }), "{e}");
    assert!(matches!(cuda::DeviceBackend::open(0, DType::F32).unwrap_err(), Error::BackendUnsupported { .. }));
}

/// Every strategy on device-resident buffers (DeviceBackend + DeviceComm), forward and
/// backward, against the oracle; and the overlap measurement's shape.
#[test]
fn every_strategy_runs_device_resident() {
    if !gpu("every_strategy_runs_device_resident") {
        return;
    }
    let (b, s, hq, hkv, d) = (1, sweep_len(777), 6, 3, 64);
    let dtype = DType::BF16;
    let q = randn(vec![b, s, hq, d], 21, dtype);
    let k = randn(vec![b, s, hkv, d], 22, dtype);
    let v = randn(vec![b, s, hkv, d], 23, dtype);
    let d_o = randn(vec![b, s, hq, d], 24, dtype);
    let run = cuda::DeviceRunOptions::default();
    let masks = [Mask::None, Mask::Causal, Mask::Window { left: Some(100), right: Some(0) }];
    let strategies = [
        (Strategy::Single, 1),
        (Strategy::Ring, 3),
        (Strategy::AllGather, 2),
        (Strategy::Ulysses, 2),
        (Strategy::Ulysses, 3),
        (Strategy::Usp, 4),
    ];
    check_strategies([&q, &k, &v, &d_o], &masks, &strategies, |world, params| {
        cuda::run_on_device(world, LocalOptions::default(), &run, &q, &k, &v, Some(&d_o), params)
    });
    let params = ParallelParams {
        strategy: Strategy::Ring,
        attention: AttentionParams { mask: Mask::Causal, ..Default::default() },
        ..Default::default()
    };
    let o = cuda::measure_device_overlap(3, LocalOptions::default(), &run, &q, &k, &v, Some(&d_o), &params).unwrap();
    assert_eq!(o.forward.steps.len(), 3);
    assert!(o.forward.max_compute_ms > 0.0 && o.forward.max_wall_ms > 0.0, "{o:?}");
    assert!(o.backward.as_ref().is_some_and(|b| b.steps.iter().all(|&n| n >= 1)), "{o:?}");
    eprintln!("{}", serde_json::to_string(&o).unwrap());
}

/// NCCL's native collectives behind the Communicator trait (one rank: the paths run on the
/// GPU; more ranks need more GPUs): all_reduce and broadcast give the values back, in
/// place of the portable versions, and a wrong root is refused.
#[test]
fn nccl_native_collectives_run_on_the_gpu() {
    if !gpu("nccl_native_collectives_run_on_the_gpu") {
        return;
    }
    if let Err(e) = cuda::nccl_info() {
        eprintln!("SKIPPED nccl_native_collectives_run_on_the_gpu: no NCCL library ({e})");
        return;
    }
    use ringattn::comm::Communicator;
    use ringattn::parallel::Buffers;
    let deadline = std::time::Duration::from_secs(60);
    let comm = cuda::NcclComm::init(0, 1, cuda::new_unique_id().unwrap(), 0, deadline).unwrap();
    let be = cuda::DeviceBackend::open(0, DType::BF16).unwrap();
    let x = be.upload(&ringattn::HostBuf::from(vec![1.5, -2.0, 3.25])).unwrap();
    let sum = comm.all_reduce(x.clone(), &|a, b| be.add_into(a, b)).unwrap();
    assert_eq!(be.download(&sum).unwrap(), vec![1.5, -2.0, 3.25]);
    let b = comm.broadcast(x, 0).unwrap();
    assert_eq!(be.download(&b).unwrap(), vec![1.5, -2.0, 3.25]);
    assert!(comm.broadcast(b, 1).is_err());
}

/// Typed device buffers: bf16 values stay 16-bit on the device (conversions both ways equal
/// the host's, the data movements move them as pairs), and a device-resident ring sends
/// exactly the bytes of the host run in bf16 — half those of f32 on the wire.
#[test]
fn sixteen_bit_values_stay_sixteen_bit_on_the_device() {
    if !gpu("sixteen_bit_values_stay_sixteen_bit_on_the_device") {
        return;
    }
    use ringattn::parallel::{BufShape, Buffers, CpuBackend};
    use ringattn::{Elem, HostBuf};
    let be = cuda::DeviceBackend::open(0, DType::BF16).unwrap();
    let host = CpuBackend::default();
    let x = HostBuf::from_tensor(&randn(vec![2, 5, 3, 8], 3, DType::BF16));
    let dx = be.upload(&x).unwrap();
    assert_eq!((dx.elem(), dx.bytes()), (Elem::BF16, x.len() * 2));
    assert_eq!(be.download(&dx).unwrap(), x);
    let wide = be.convert(&dx, DType::F32).unwrap();
    assert_eq!(be.download(&wide).unwrap(), x.converted(DType::F32));
    assert_eq!(be.download(&be.convert(&wide, DType::F16).unwrap()).unwrap(), x.converted(DType::F16));
    let sh = BufShape { b: 2, n: 5, h: 3, d: 8 };
    let heads = [2, 0, 2];
    let sel = be.select_heads(&dx, sh, &heads).unwrap();
    assert_eq!(be.download(&sel).unwrap(), host.select_heads(&x, sh, &heads).unwrap());
    let got = be.download(&be.seq_slice(&dx, 2, 5, 24, 1, 3).unwrap()).unwrap();
    assert_eq!(got, host.seq_slice(&x, 2, 5, 24, 1, 3).unwrap());
    assert_eq!(be.download(&be.filled(5, 0.3, DType::BF16).unwrap()).unwrap(), HostBuf::filled(5, 0.3, DType::BF16));

    let (s, hq, d) = (512, 4, 64);
    let q = randn(vec![1, s, hq, d], 41, DType::BF16);
    let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
    let run = cuda::DeviceRunOptions::default();
    let dev = cuda::run_on_device(4, LocalOptions::default(), &run, &q, &q, &q, None, &params).unwrap();
    let on_host =
        ringattn::parallel::run_in_process(4, LocalOptions::default(), &host, &q, &q, &q, None, &params).unwrap();
    for (r, (a, b)) in dev.stats.iter().zip(&on_host.stats).enumerate() {
        assert_eq!(a.0.bytes_sent, b.0.bytes_sent, "rank {r}: forward bytes on the device vs the host");
    }
}

/// A framework's own `CudaContext` of the same GPU (candle holds one beside ringattn's: two
/// `Arc`s of one primary context) is the same context: its streams are accepted, a stream of
/// a context whose event tracking is off is refused with an error that says why.
#[test]
fn a_frameworks_handle_to_the_same_context_is_the_same_context() {
    if !gpu("a_frameworks_handle_to_the_same_context_is_the_same_context") {
        return;
    }
    let device = CudaDevice::shared(0).unwrap();
    let theirs = cuda::CudaContext::new(0).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&theirs, device.context()), "two handles, as candle and ringattn hold them");
    let stream = theirs.new_stream().unwrap();
    let backend = cuda::DeviceBackend::on_stream(device.clone(), stream, DType::BF16).unwrap();
    // The backend works on the framework's stream: data up and back.
    use ringattn::parallel::Buffers;
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let buf = backend.upload(&ringattn::HostBuf::from(values.clone())).unwrap();
    assert_eq!(backend.download(&buf).unwrap().to_f32().unwrap().into_owned(), values);
    drop(backend);
    let untracked = cuda::CudaContext::new(0).unwrap();
    // SAFETY: nothing runs on this handle; the refusal is the point.
    unsafe { untracked.disable_event_tracking() };
    let e = cuda::DeviceBackend::on_stream(device, untracked.new_stream().unwrap(), DType::BF16).unwrap_err();
    assert!(e.to_string().contains("event tracking"), "{e}");
}
