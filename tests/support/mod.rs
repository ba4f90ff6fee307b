//! Test support: case generation and the check of a case against the oracle.
//! The tolerance rule itself lives in `ringattn::verify` (one definition for the CLI and
//! the tests); this module only applies it.
#![allow(dead_code, unused_imports, unused_macros)]

pub mod conformance;

use proptest::prelude::*;
use ringattn::{cpu, random::randn, verify, AttentionParams, DType, Mask, Positions, Segment, Tensor};

/// One generated attention problem.
#[derive(Debug, Clone)]
pub struct Case {
    pub b: usize,
    pub s_q: usize,
    pub s_k: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d: usize,
    pub dtype: DType,
    pub params: AttentionParams,
    /// Block call positions (q, k); `None` for a single-device call.
    pub positions: Option<(Positions, Positions)>,
    pub seed: u64,
    /// Tile sizes of the CPU implementation (small ones put tile edges inside the case).
    pub tiles: cpu::TileConfig,
    /// Arithmetic of the CPU implementation's products.
    pub arithmetic: cpu::Arithmetic,
}

pub struct CaseInputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub d_o: Tensor,
}

impl Case {
    pub fn inputs(&self) -> CaseInputs {
        let s = self.seed * 16;
        CaseInputs {
            q: randn(vec![self.b, self.s_q, self.h_q, self.d], s + 1, self.dtype),
            k: randn(vec![self.b, self.s_k, self.h_kv, self.d], s + 2, self.dtype),
            v: randn(vec![self.b, self.s_k, self.h_kv, self.d], s + 3, self.dtype),
            d_o: randn(vec![self.b, self.s_q, self.h_q, self.d], s + 4, self.dtype),
        }
    }

    pub fn pos(&self) -> Option<(&Positions, &Positions)> {
        self.positions.as_ref().map(|(a, b)| (a, b))
    }
}

/// Runs the CPU forward and backward on the case and checks O, LSE, dQ, dK, dV against the
/// oracle with the crate's tolerance rule. Returns the report (for messages).
pub fn check_case(case: &Case) -> verify::Report {
    let x = case.inputs();
    check_inputs(case, &x)
}

pub fn check_inputs(case: &Case, x: &CaseInputs) -> verify::Report {
    let p = &case.params;
    let cfg = cpu::CpuConfig { tiles: case.tiles, arithmetic: case.arithmetic, ..Default::default() };
    let fwd = cpu::forward_with(&x.q, &x.k, &x.v, case.pos(), p, &cfg).expect("forward");
    let grads = cpu::backward_with(&x.q, &x.k, &x.v, &fwd.o, &fwd.lse, &x.d_o, case.pos(), p, &cfg).expect("backward");
    verify::check_results(&x.q, &x.k, &x.v, Some(&x.d_o), case.pos(), p, &fwd, Some(&grads)).expect("oracle")
}

/// Proptest case count: `PROPTEST_CASES` when set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Rows `r0..r1` (along the sequence axis) of a `[b, s, h, d]` tensor.
pub fn seq_rows(t: &Tensor, r0: usize, r1: usize) -> Tensor {
    let [b, s, h, d] = t.shape().try_into().unwrap();
    let x = t.as_f32();
    let mut out = Vec::new();
    for bi in 0..b {
        out.extend_from_slice(&x[(bi * s + r0) * h * d..(bi * s + r1) * h * d]);
    }
    Tensor::from_f32(vec![b, r1 - r0, h, d], out).unwrap()
}

// Generators shared by the property tests.

pub fn side() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![Just(None), Just(Some(0)), Just(Some(1)), Just(Some(5)), Just(Some(40)), Just(Some(150))]
}

pub fn mask() -> impl Strategy<Value = Mask> {
    prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal),
        (side(), side()).prop_map(|(left, right)| Mask::Window { left, right }),
    ]
}

/// A tanh soft-cap or none: caps small enough that the scores (randn products scaled by about
/// 1/sqrt(d): about 1) reach tanh's bend, and one that leaves them nearly linear.
pub fn softcap() -> impl Strategy<Value = Option<f32>> {
    prop_oneof![2 => Just(None), 1 => Just(Some(0.7f32)), 1 => Just(Some(2.5f32)), 1 => Just(Some(30.0f32))]
}

/// Attention sinks' base logit, when drawn: below, near and above the rows' LSE (about the
/// log of the keys a row sees); [`sinks`] spreads it over the heads.
pub fn sink_level() -> impl Strategy<Value = Option<f32>> {
    prop_oneof![2 => Just(None), 1 => Just(Some(-3.0f32)), 1 => Just(Some(1.0f32)), 1 => Just(Some(6.0f32))]
}

/// `h_q` sink logits from a drawn level (`None`: no sinks): level + h / 2 for head h.
pub fn sinks(level: Option<f32>, h_q: usize) -> Option<Vec<f32>> {
    level.map(|x| (0..h_q).map(|h| x + 0.5 * h as f32).collect())
}

pub fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

/// Splits `n` tokens into 1–4 documents (some possibly empty).
pub fn doc_lengths(n: usize, cuts: &[usize]) -> Vec<usize> {
    let mut c: Vec<usize> = cuts.iter().map(|&x| x % (n + 1)).collect();
    c.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for x in c {
        out.push(x - prev);
        prev = x;
    }
    out.push(n - prev);
    out
}

/// Where a case's rows sit: block positions on both sides (a ring hop's call) or a
/// single-device call, and packed documents over them or none (see [`placement`]).
#[derive(Debug, Clone)]
pub struct Placement {
    block: bool,
    modes: (u8, u8),
    starts: (i64, i64),
    strides: (i64, i64),
    gap: i64,
    docs: bool,
    cuts: Vec<usize>,
}

prop_compose! {
    /// Block positions (one segment, strided, or two segments with a gap; at offsets up to
    /// 200) on half the cases, and 1-4 packed documents on half.
    pub fn placement()(
        block in any::<bool>(),
        q_mode in 0u8..3, k_mode in 0u8..3,
        q_start in 0i64..200, k_start in 0i64..200,
        q_stride in 1i64..4, k_stride in 1i64..4,
        gap in 0i64..100,
        docs in any::<bool>(),
        cuts in prop::collection::vec(0usize..1000, 0..4),
    ) -> Placement {
        Placement { block, modes: (q_mode, k_mode), starts: (q_start, k_start), strides: (q_stride, k_stride), gap, docs, cuts }
    }
}

impl Placement {
    /// The positions (`None`: a single-device call) and documents of a case of `s_q` queries
    /// and `s_k` keys. A single-device call with `s_q > s_k` puts queries at negative
    /// positions, outside any document: it gets none.
    pub fn apply(&self, s_q: usize, s_k: usize) -> (Option<(Positions, Positions)>, Option<ringattn::Documents>) {
        let positions = self.block.then(|| {
            (
                block_positions(s_q, self.modes.0, self.starts.0, self.strides.0, self.gap),
                block_positions(s_k, self.modes.1, self.starts.1, self.strides.1, self.gap),
            )
        });
        let documents = self.docs.then(|| {
            let total = match &positions {
                None => s_k,
                Some((qp, kp)) => (qp.iter().chain(kp.iter()).max().unwrap_or(0) + 1) as usize,
            };
            ringattn::Documents::new(doc_lengths(total, &self.cuts)).unwrap()
        });
        let documents = documents.filter(|_| positions.is_some() || s_q <= s_k);
        (positions, documents)
    }
}

/// A block's positions: one segment, a strided one, or two segments (zigzag-like).
pub fn block_positions(len: usize, mode: u8, start: i64, stride: i64, gap: i64) -> Positions {
    let segs = match mode % 3 {
        0 => vec![Segment { start, stride: 1, len }],
        1 => vec![Segment { start, stride, len }],
        _ => {
            let a = len / 2;
            vec![
                Segment { start, stride: 1, len: a },
                Segment { start: start + a as i64 + gap, stride: 1, len: len - a },
            ]
        }
    };
    Positions::from_segments(segs).unwrap()
}
