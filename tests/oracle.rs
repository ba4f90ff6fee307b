//! The CPU flash attention against the float64 oracle, over generated shapes, masks,
//! positions, documents and dtypes.

mod support;

use proptest::prelude::*;
use ringattn::{cpu::Arithmetic, AttentionParams, DType};
use support::{check_case, dtype, mask, placement, sink_level, sinks, softcap, Case};

/// Sequence lengths: 1, primes, and non-multiples of every tile size around the tile edges.
const LENGTHS: &[usize] = &[1, 2, 3, 7, 13, 31, 63, 64, 65, 97, 127, 128, 129, 191, 256, 257, 300];
/// (block_q, block_k): odd and small sizes put tile edges inside every case; the default too.
const TILES: &[(usize, usize)] = &[(7, 13), (16, 32), (64, 48), (256, 256)];
const HEAD_DIMS: &[usize] = &[16, 32, 64, 80, 128, 256];
/// Upper bound on b·h_q·s_q·s_k·d so that the f64 oracle stays fast.
const WORK_CAP: usize = 12_000_000;

prop_compose! {
    /// A case in the given dtypes, computed with the given arithmetic.
    fn case_with(dtype: BoxedStrategy<DType>, arithmetic: Arithmetic)(
        b in 1usize..=3,
        s_q in prop::sample::select(LENGTHS),
        s_k in prop::sample::select(LENGTHS),
        same_len in any::<bool>(),
        ratio in prop::sample::select(&[1usize, 2, 4][..]),
        h_kv in 1usize..=2,
        d in prop::sample::select(HEAD_DIMS),
        dtype in dtype,
        mask in mask(),
        placement in placement(),
        scale in prop_oneof![Just(None), Just(Some(0.3f32)), Just(Some(-0.2f32))],
        softcap in softcap(),
        sink_level in sink_level(),
        seed in 0u64..1_000_000,
        tiles in prop::sample::select(TILES),
    ) -> Case {
        let s_k = if same_len { s_q } else { s_k };
        let (mut b, mut h_kv, mut s_q, mut s_k) = (b, h_kv, s_q, s_k);
        // Keep the f64 oracle fast: shrink the problem deterministically when it is too big.
        let work = |b: usize, h_kv: usize, s_q: usize, s_k: usize| b * h_kv * ratio * s_q * s_k * d;
        if work(b, h_kv, s_q, s_k) > WORK_CAP { b = 1; h_kv = 1; }
        while work(b, h_kv, s_q, s_k) > WORK_CAP { s_q = s_q.div_ceil(2); s_k = s_k.div_ceil(2); }
        let (positions, documents) = placement.apply(s_q, s_k);
        Case {
            b, s_q, s_k, h_q: h_kv * ratio, h_kv, d, dtype,
            params: AttentionParams { mask, documents, scale, softcap, sinks: sinks(sink_level, h_kv * ratio) },
            positions, seed, tiles: ringattn::cpu::TileConfig { block_q: tiles.0, block_k: tiles.1 }, arithmetic,
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    case_with(dtype().boxed(), Arithmetic::Auto)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(64)))]

    /// Every dtype with the default arithmetic (bf16 products for bf16 inputs where the
    /// processor has them).
    #[test]
    fn cpu_flash_matches_oracle(case in case()) {
        let report = check_case(&case);
        prop_assert!(report.pass(), "{case:?}\n{}", report.table());
    }

    /// bf16 inputs through the fallback: widened to f32, f32 products.
    #[test]
    fn cpu_f32_arithmetic_on_bf16_inputs_matches_oracle(case in case_with(Just(DType::BF16).boxed(), Arithmetic::F32)) {
        let report = check_case(&case);
        prop_assert!(report.pass(), "{case:?}\n{}", report.table());
    }

    /// bf16 inputs through the bf16 products, asked for explicitly (skipped on processors
    /// without AVX512_BF16, where asking is an error: see `tests/conventions.rs`).
    #[test]
    fn cpu_bf16_arithmetic_matches_oracle(case in case_with(Just(DType::BF16).boxed(), Arithmetic::Bf16)) {
        if !Arithmetic::bf16_available() {
            return Ok(());
        }
        let report = check_case(&case);
        prop_assert!(report.pass(), "{case:?}\n{}", report.table());
    }
}
