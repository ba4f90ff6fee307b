//! The CPU's choice of arithmetic: bf16 products for bf16 inputs where the processor has
//! them, the f32 path otherwise or when asked, each checked against the oracle, and the
//! dispatch itself (which path ran, refusals, the fallback for non-finite inputs).

use ringattn::cpu::{self, Arithmetic, CpuConfig, TileConfig};
use ringattn::{random::randn, verify, AttentionParams, DType, Error, Mask, Tensor};

fn config(arithmetic: Arithmetic) -> CpuConfig<'static> {
    CpuConfig { tiles: TileConfig { block_q: 48, block_k: 40 }, arithmetic, ..Default::default() }
}

struct Run {
    fwd: cpu::ForwardOutput,
    grads: cpu::Gradients,
}

fn run(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, p: &AttentionParams, a: Arithmetic) -> Run {
    let cfg = config(a);
    let fwd = cpu::forward_with(q, k, v, None, p, &cfg).unwrap();
    let grads = cpu::backward_with(q, k, v, &fwd.o, &fwd.lse, d_o, None, p, &cfg).unwrap();
    Run { fwd, grads }
}

fn inputs(s: usize, d: usize, seed: u64) -> [Tensor; 4] {
    let t = |i: u64, h: usize| randn(vec![2, s, h, d], seed * 8 + i, DType::BF16);
    [t(1, 4), t(2, 2), t(3, 2), t(4, 4)]
}

/// Both paths pass the oracle on the same bf16 inputs (GQA, causal, odd head dim and tile
/// edges), and on a processor with AVX512_BF16 the default really is the bf16 path: its
/// results differ from the fallback's (P and dS rounded to bf16), while each stays within
/// the bound.
#[test]
fn the_fallback_and_the_bf16_products_agree_within_the_bound() {
    for (d, mask) in [(64, Mask::Causal), (37, Mask::None), (128, Mask::Window { left: Some(20), right: Some(3) })] {
        let [q, k, v, d_o] = inputs(101, d, d as u64);
        let p = AttentionParams { mask, ..Default::default() };
        let auto = run(&q, &k, &v, &d_o, &p, Arithmetic::Auto);
        let fallback = run(&q, &k, &v, &d_o, &p, Arithmetic::F32);
        for (name, r) in [("auto", &auto), ("f32", &fallback)] {
            let report =
                verify::check_results(&q, &k, &v, Some(&d_o), None, &p, &r.fwd, Some(&r.grads)).expect("oracle");
            assert!(report.pass(), "{name} d={d} {mask:?}\n{}", report.table());
        }
        assert_eq!(auto.fwd.o.dtype(), DType::BF16);
        assert_eq!(auto.grads.dq.dtype(), DType::BF16);
        let same = auto.fwd.o == fallback.fwd.o && auto.grads == fallback.grads;
        assert_eq!(
            !same,
            Arithmetic::bf16_available(),
            "d={d}: the default ran the {} path",
            if same { "f32" } else { "bf16" }
        );
    }
}

#[test]
fn bf16_products_are_refused_where_they_cannot_run() {
    let x = randn(vec![1, 8, 1, 16], 1, DType::F32);
    let p = AttentionParams::default();
    for dtype in [DType::F32, DType::F16] {
        let x = x.to_dtype(dtype);
        match cpu::forward_with(&x, &x, &x, None, &p, &config(Arithmetic::Bf16)) {
            Err(Error::BackendUnsupported { what, .. }) => assert!(what.contains(&format!("{dtype:?}")), "{what}"),
            other => panic!("{dtype:?}: {other:?}"),
        }
        assert!(Arithmetic::Bf16.resolve(dtype).is_err());
        assert_eq!(Arithmetic::Auto.resolve(dtype).unwrap(), Arithmetic::F32);
    }
    let xb = x.to_dtype(DType::BF16);
    let forced = cpu::forward_with(&xb, &xb, &xb, None, &p, &config(Arithmetic::Bf16));
    assert_eq!(forced.is_ok(), Arithmetic::bf16_available());
}

/// Inputs holding NaN or Inf (here in keys and values no query may see) take the f32 path,
/// which keeps them out of visible rows: the results equal the forced fallback's bit for bit.
#[test]
fn non_finite_inputs_take_the_f32_path() {
    let [q, k, v, d_o] = inputs(64, 32, 9);
    let poison = |t: &Tensor, at: usize, x: f32| {
        let mut f = t.to_f32_vec();
        f[at] = x;
        Tensor::from_f32(t.shape().to_vec(), f).unwrap().to_dtype(DType::BF16)
    };
    // Key 63 of kv head 0 in batch 0: seen by no causal query but the last.
    let last_key = 63 * 2 * 32;
    let (k, v) = (poison(&k, last_key, f32::NAN), poison(&v, last_key + 1, f32::INFINITY));
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let auto = run(&q, &k, &v, &d_o, &p, Arithmetic::Auto);
    let fallback = run(&q, &k, &v, &d_o, &p, Arithmetic::F32);
    // Bits, not values: the last query's row is NaN (it sees key 63).
    let bits = |r: &Run| {
        let g = &r.grads;
        [&r.fwd.o, &r.fwd.lse, &g.dq, &g.dk, &g.dv].map(|t| t.as_bytes().to_vec())
    };
    assert!(bits(&auto) == bits(&fallback));
    assert!(auto.fwd.o.to_f32_vec()[63 * 4 * 32..].iter().any(|x| x.is_nan()));
    let o = auto.fwd.o.to_f32_vec();
    assert!(o[..63 * 4 * 32].iter().all(|x| x.is_finite()), "a query before key 63 saw its NaN");
}

/// The bf16 backward sums its dQ partials in a fixed order: bit-identical on 1 and 2 threads.
#[test]
fn bf16_backward_is_deterministic_across_thread_counts() {
    let [q, k, v, d_o] = inputs(300, 64, 3);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let a = run(&q, &k, &v, &d_o, &p, Arithmetic::Auto);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let b = pool.install(|| run(&q, &k, &v, &d_o, &p, Arithmetic::Auto));
    assert!(a.grads == b.grads && a.fwd.o == b.fwd.o);
}
