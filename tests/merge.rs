//! Merging partial results over disjoint key sets equals attention over all keys.

mod support;

use support::seq_rows;

use proptest::prelude::*;
use ringattn::{cpu, merge, random::randn, verify, AttentionParams, DType, Mask, Positions};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(support::cases(48)))]

    /// Split the keys at arbitrary cut points, attend each part at its global positions, merge
    /// in any order: the result equals single-device attention over all keys.
    #[test]
    fn merging_any_split_equals_full_attention(
        s in 1usize..120,
        cuts in prop::collection::vec(0usize..120, 0..4),
        causal in any::<bool>(),
        reverse in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let (b, h, d) = (2, 2, 16);
        let q = randn(vec![b, s, h, d], seed, DType::F32);
        let k = randn(vec![b, s, h, d], seed + 1, DType::F32);
        let v = randn(vec![b, s, h, d], seed + 2, DType::F32);
        let p = AttentionParams { mask: if causal { Mask::Causal } else { Mask::None }, ..Default::default() };
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (s + 1)).chain([0, s]).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut parts: Vec<cpu::ForwardOutput> = bounds
            .windows(2)
            .map(|w| {
                let (kb, vb) = (seq_rows(&k, w[0], w[1]), seq_rows(&v, w[0], w[1]));
                cpu::forward_at(&q, &kb, &vb, &Positions::contiguous(0, s), &Positions::contiguous(w[0] as i64, w[1] - w[0]), &p).unwrap()
            })
            .collect();
        if reverse { parts.reverse(); }
        let mut acc = parts[0].clone();
        for part in &parts[1..] {
            acc = merge::merge(&acc, part).unwrap();
        }
        let full = cpu::forward(&q, &k, &v, &p).unwrap();
        let full64: Vec<f64> = full.o.as_f32().iter().map(|&x| x as f64).collect();
        prop_assert!(verify::rel_err(&acc.o.to_f32_vec(), &full64) < 2e-6);
        let lse64: Vec<f64> = full.lse.as_f32().iter().map(|&x| x as f64).collect();
        prop_assert!(verify::rel_err(&acc.lse.to_f32_vec(), &lse64) < 2e-6);
    }
}

#[test]
fn merge_with_empty_sides_is_stable() {
    // (o, lse) = (x, -inf) on one side contributes nothing, even with NaN values in its o.
    let (mut o, mut lse) = (vec![1.0f32, 2.0], vec![0.5f32]);
    merge::merge_into(&mut o, &mut lse, &[f32::NAN, f32::NAN], &[f32::NEG_INFINITY], [1, 1, 1, 2]).unwrap();
    assert_eq!((o, lse), (vec![1.0, 2.0], vec![0.5]));
    let (mut o, mut lse) = (vec![f32::NAN], vec![f32::NEG_INFINITY]);
    merge::merge_into(&mut o, &mut lse, &[3.0], &[-2.0], [1, 1, 1, 1]).unwrap();
    assert_eq!((o, lse), (vec![3.0], vec![-2.0]));
    let (mut o, mut lse) = (vec![5.0], vec![f32::NEG_INFINITY]);
    merge::merge_into(&mut o, &mut lse, &[7.0], &[f32::NEG_INFINITY], [1, 1, 1, 1]).unwrap();
    assert_eq!((o, lse), (vec![0.0], vec![f32::NEG_INFINITY]));
    // Huge and tiny LSEs do not overflow.
    let (mut o, mut lse) = (vec![1.0], vec![1e30]);
    merge::merge_into(&mut o, &mut lse, &[2.0], &[-1e30], [1, 1, 1, 1]).unwrap();
    assert_eq!((o, lse), (vec![1.0], vec![1e30]));
}

#[test]
fn merge_rejects_mismatched_lengths() {
    let (mut o, mut lse) = (vec![1.0f32; 4], vec![0.0f32; 2]);
    let e = merge::merge_into(&mut o, &mut lse, &[1.0; 3], &[0.0; 2], [1, 2, 1, 2]).unwrap_err();
    assert!(e.to_string().contains("o_b"), "{e}");
}
