//! Each convention documented in lib.rs, tested on its own.

mod support;

use support::seq_rows;

use ringattn::{cpu, random::randn, reference, AttentionParams, DType, Documents, Mask, Positions, Tensor};

fn qkv(b: usize, s_q: usize, s_k: usize, hq: usize, hkv: usize, d: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
    (
        randn(vec![b, s_q, hq, d], seed, DType::F32),
        randn(vec![b, s_k, hkv, d], seed + 1, DType::F32),
        randn(vec![b, s_k, hkv, d], seed + 2, DType::F32),
    )
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    a.as_f32().iter().zip(b.as_f32().iter()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Slices head `h` of a `[b, s, h, d]` tensor into `[b, s, 1, d]`.
fn head(t: &Tensor, h: usize) -> Tensor {
    let [b, s, hs, d] = t.shape().try_into().unwrap();
    let x = t.as_f32();
    let mut out = Vec::with_capacity(b * s * d);
    for bs in 0..b * s {
        out.extend_from_slice(&x[(bs * hs + h) * d..][..d]);
    }
    Tensor::from_f32(vec![b, s, 1, d], out).unwrap()
}

#[test]
fn gqa_query_head_uses_kv_head_i_over_group() {
    let (q, k, v) = qkv(1, 40, 40, 6, 2, 16, 1);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let full = cpu::forward(&q, &k, &v, &p).unwrap();
    for h in 0..6 {
        let kv = h / 3;
        let one = cpu::forward(&head(&q, h), &head(&k, kv), &head(&v, kv), &p).unwrap();
        assert!(max_abs_diff(&head(&full.o, h), &one.o) < 1e-6, "head {h}");
    }
}

#[test]
fn causal_is_window_unbounded_zero() {
    let (q, k, v) = qkv(2, 70, 70, 2, 1, 32, 2);
    let a = cpu::forward(&q, &k, &v, &AttentionParams { mask: Mask::Causal, ..Default::default() }).unwrap();
    let w = Mask::Window { left: None, right: Some(0) };
    let b = cpu::forward(&q, &k, &v, &AttentionParams { mask: w, ..Default::default() }).unwrap();
    assert_eq!(a, b);
}

#[test]
fn single_device_is_bottom_right_aligned() {
    // With s_q < s_k, query i sits at position i + s_k - s_q: the last query sees every key,
    // which equals a block call with explicit positions.
    let (q, k, v) = qkv(1, 5, 12, 1, 1, 8, 3);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let single = cpu::forward(&q, &k, &v, &p).unwrap();
    let block = cpu::forward_at(&q, &k, &v, &Positions::contiguous(7, 5), &Positions::contiguous(0, 12), &p).unwrap();
    assert_eq!(single, block);
    let r = reference::forward(&q, &k, &v, &p).unwrap();
    assert!(r.lse.iter().all(|x| x.is_finite()));
}

#[test]
fn fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_gradients() {
    // s_q > s_k under causal: the first s_q - s_k queries precede every key.
    let (q, k, v) = qkv(1, 10, 4, 2, 2, 16, 4);
    let d_o = randn(vec![1, 10, 2, 16], 9, DType::F32);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    let g = cpu::backward(&q, &k, &v, &f.o, &f.lse, &d_o, &p).unwrap();
    let (o, lse, dq) = (f.o.as_f32(), f.lse.as_f32(), g.dq.as_f32());
    for h in 0..2 {
        for i in 0..6 {
            assert_eq!(lse[h * 10 + i], f32::NEG_INFINITY);
            assert!(o[(i * 2 + h) * 16..][..16].iter().all(|&x| x == 0.0));
            assert!(dq[(i * 2 + h) * 16..][..16].iter().all(|&x| x == 0.0));
        }
        assert!(lse[h * 10 + 6].is_finite());
    }
}

#[test]
fn masked_positions_never_influence_outputs_even_when_nan() {
    // Causal, window and document masks: poison every key/value a query cannot see with NaN
    // and Inf; results must stay finite and equal those with ordinary values there (up to the
    // summation order of the element-wise path that tiles holding non-finite values take).
    let (s, d) = (50, 16);
    let (q, k, v) = qkv(1, s, s, 1, 1, d, 5);
    let d_o = randn(vec![1, s, 1, d], 6, DType::F32);
    let docs = Documents::new(vec![20, 30]).unwrap();
    for (mask, documents) in [
        (Mask::Causal, None),
        (Mask::Window { left: Some(3), right: Some(2) }, None),
        (Mask::None, Some(docs.clone())),
        (Mask::Causal, Some(docs)),
    ] {
        let p = AttentionParams { mask, documents, ..Default::default() };
        let base_f = cpu::forward(&q, &k, &v, &p).unwrap();
        let base_g = cpu::backward(&q, &k, &v, &base_f.o, &base_f.lse, &d_o, &p).unwrap();
        // Query 30 (in document 1): poison every key it cannot see, then compare its row.
        let i = 30;
        let (mut k2, mut v2) = (k.to_f32_vec(), v.to_f32_vec());
        let vis = |j: usize| {
            mask.allows(i as i64, j as i64)
                && p.documents.as_ref().is_none_or(|dd| dd.document_of(i as i64) == dd.document_of(j as i64))
        };
        for j in (0..s).filter(|&j| !vis(j)) {
            k2[j * d..(j + 1) * d].fill(f32::NAN);
            v2[j * d..(j + 1) * d].fill(f32::INFINITY);
        }
        let (k2, v2) =
            (Tensor::from_f32(vec![1, s, 1, d], k2).unwrap(), Tensor::from_f32(vec![1, s, 1, d], v2).unwrap());
        let f = cpu::forward(&q, &k2, &v2, &p).unwrap();
        close(&f.o.as_f32()[i * d..(i + 1) * d], &base_f.o.as_f32()[i * d..(i + 1) * d], &format!("o {mask:?}"));
        close(&f.lse.as_f32()[i..i + 1], &base_f.lse.as_f32()[i..i + 1], "lse");
        // Poison queries and output gradients of rows that cannot see key 10: its dk and dv
        // must not change.
        let j = 10;
        let (mut q3, mut do3) = (q.to_f32_vec(), d_o.to_f32_vec());
        for r in 0..s {
            let sees = mask.allows(r as i64, j as i64)
                && p.documents.as_ref().is_none_or(|dd| dd.document_of(r as i64) == dd.document_of(j as i64));
            if !sees {
                q3[r * d..(r + 1) * d].fill(f32::NAN);
                do3[r * d..(r + 1) * d].fill(f32::NAN);
            }
        }
        let (q3, do3) =
            (Tensor::from_f32(vec![1, s, 1, d], q3).unwrap(), Tensor::from_f32(vec![1, s, 1, d], do3).unwrap());
        let f3 = cpu::forward(&q3, &k, &v, &p).unwrap();
        let g3 = cpu::backward(&q3, &k, &v, &f3.o, &f3.lse, &do3, &p).unwrap();
        close(&g3.dk.as_f32()[j * d..(j + 1) * d], &base_g.dk.as_f32()[j * d..(j + 1) * d], &format!("dk {mask:?}"));
        close(&g3.dv.as_f32()[j * d..(j + 1) * d], &base_g.dv.as_f32()[j * d..(j + 1) * d], &format!("dv {mask:?}"));
    }
}

/// Finite and equal to `b` within a few f32 roundings (relative to the row's norm).
fn close(a: &[f32], b: &[f32], what: &str) {
    let norm = b.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
    for (x, y) in a.iter().zip(b) {
        assert!(x.is_finite() && (x - y).abs() <= 1e-6 * norm, "{what}: {a:?} vs {b:?}");
    }
}

#[test]
fn nan_in_a_visible_key_propagates() {
    let (q, k, v) = qkv(1, 8, 8, 1, 1, 8, 7);
    let mut v2 = v.to_f32_vec();
    v2[3 * 8] = f32::NAN;
    let v2 = Tensor::from_f32(vec![1, 8, 1, 8], v2).unwrap();
    let f = cpu::forward(&q, &k, &v2, &AttentionParams { mask: Mask::Causal, ..Default::default() }).unwrap();
    let o = f.o.as_f32();
    assert!(o[2 * 8..3 * 8].iter().all(|x| x.is_finite()), "query 2 does not see key 3");
    assert!(o[3 * 8].is_nan() && o[7 * 8].is_nan(), "queries 3.. see key 3");
}

#[test]
fn default_scale_is_inverse_sqrt_d() {
    let (q, k, v) = qkv(1, 9, 9, 1, 1, 16, 8);
    let a = cpu::forward(&q, &k, &v, &AttentionParams::default()).unwrap();
    let b = cpu::forward(&q, &k, &v, &AttentionParams { scale: Some(0.25), ..Default::default() }).unwrap();
    assert_eq!(a, b);
}

#[test]
fn lse_is_natural_log_of_visible_exponentials() {
    let (q, k, v) = qkv(1, 3, 3, 1, 1, 4, 9);
    let f = cpu::forward(&q, &k, &v, &AttentionParams { mask: Mask::Causal, ..Default::default() }).unwrap();
    let (qf, kf) = (q.to_f64_vec(), k.to_f64_vec());
    let dot = |i: usize, j: usize| (0..4).map(|c| qf[i * 4 + c] * kf[j * 4 + c]).sum::<f64>() * 0.5;
    let want = (dot(1, 0).exp() + dot(1, 1).exp()).ln();
    assert!((f.lse.as_f32()[1] as f64 - want).abs() < 1e-5);
    assert_eq!(f.lse.shape(), &[1, 1, 3]);
    assert_eq!(f.lse.dtype(), DType::F32);
}

#[test]
fn documents_equal_separate_calls() {
    let (q, k, v) = qkv(1, 30, 30, 2, 1, 16, 10);
    let p = AttentionParams {
        mask: Mask::Causal,
        documents: Some(Documents::new(vec![12, 18]).unwrap()),
        ..Default::default()
    };
    let packed = cpu::forward(&q, &k, &v, &p).unwrap();
    let c = AttentionParams { mask: Mask::Causal, ..Default::default() };
    for (r0, r1) in [(0, 12), (12, 30)] {
        let one = cpu::forward(&seq_rows(&q, r0, r1), &seq_rows(&k, r0, r1), &seq_rows(&v, r0, r1), &c).unwrap();
        assert!(max_abs_diff(&seq_rows(&packed.o, r0, r1), &one.o) < 1e-6);
    }
}

#[test]
fn global_positions_block_equals_slice_of_single_device() {
    // Queries 40..60 against keys 0..30 of a 60-token causal sequence: equals rows 40..60
    // of the single-device result restricted to those keys.
    let (q, k, v) = qkv(1, 60, 60, 1, 1, 16, 11);
    let p = AttentionParams { mask: Mask::Window { left: Some(25), right: Some(0) }, ..Default::default() };
    let (qb, kb, vb) = (seq_rows(&q, 40, 60), seq_rows(&k, 0, 30), seq_rows(&v, 0, 30));
    let block =
        cpu::forward_at(&qb, &kb, &vb, &Positions::contiguous(40, 20), &Positions::contiguous(0, 30), &p).unwrap();
    let oracle =
        reference::forward_at(&qb, &kb, &vb, &Positions::contiguous(40, 20), &Positions::contiguous(0, 30), &p)
            .unwrap();
    assert!(ringattn::verify::rel_err(&block.o.to_f32_vec(), &oracle.o) < 1e-5);
    // Queries beyond position 54 see no key in 0..30 (window of 25).
    let lse = block.lse.as_f32();
    assert!(lse[..15].iter().all(|x| x.is_finite()));
    assert!(lse[15..].iter().all(|&x| x == f32::NEG_INFINITY));
}

#[test]
fn empty_sequences_are_valid() {
    let p = AttentionParams::default();
    let (q, k, v) = qkv(2, 0, 5, 2, 1, 8, 12);
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    assert_eq!(f.o.shape(), &[2, 0, 2, 8]);
    assert_eq!(f.lse.shape(), &[2, 2, 0]);
    let (q, k, v) = qkv(1, 3, 0, 1, 1, 8, 13);
    let f = cpu::forward(&q, &k, &v, &p).unwrap();
    assert!(f.o.as_f32().iter().all(|&x| x == 0.0));
    assert!(f.lse.as_f32().iter().all(|&x| x == f32::NEG_INFINITY));
    let g = cpu::backward(&q, &k, &v, &f.o, &f.lse, &q, &p).unwrap();
    assert!(g.dq.as_f32().iter().all(|&x| x == 0.0));
    assert_eq!(g.dk.shape(), &[1, 0, 1, 8]);
}

#[test]
fn reduced_precision_outputs_keep_the_input_dtype() {
    for dt in [DType::BF16, DType::F16] {
        let q = randn(vec![1, 20, 2, 32], 1, dt);
        let f = cpu::forward(&q, &q, &q, &AttentionParams::default()).unwrap();
        assert_eq!(f.o.dtype(), dt);
        assert_eq!(f.lse.dtype(), DType::F32);
    }
}

#[test]
fn backward_is_deterministic() {
    let (q, k, v) = qkv(1, 300, 300, 4, 2, 32, 14);
    let d_o = randn(vec![1, 300, 4, 32], 15, DType::F32);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let cfg = cpu::CpuConfig { tiles: cpu::TileConfig { block_q: 16, block_k: 16 }, ..Default::default() };
    let f = cpu::forward_with(&q, &k, &v, None, &p, &cfg).unwrap();
    let g1 = cpu::backward_with(&q, &k, &v, &f.o, &f.lse, &d_o, None, &p, &cfg).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let g2 = pool.install(|| cpu::backward_with(&q, &k, &v, &f.o, &f.lse, &d_o, None, &p, &cfg).unwrap());
    assert_eq!(g1, g2);
}
