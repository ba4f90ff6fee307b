//! The attention problem as every backend and driver shares it, independent of any of them:
//! what a call gives back ([`ForwardOutput`], [`Gradients`]), how its scores are formed
//! ([`ScoreSpec`]), and, inside the crate, the
//! visibility of a call's positions under its mask (`visibility`, `block_visibility`) and
//! the tile geometry the CPU and the ring's hop schedule classify with (`Span`, `spans`,
//! `TileKind`, `classify`).

use crate::params::Visibility;
use crate::{AttentionParams, Dims, Error, Positions, Result, Tensor};

/// Forward outputs: `o` `[b, s_q, h_q, d_v]` in the input dtype and `lse` `[b, h_q, s_q]`
/// in f32 (natural log; `-inf` for rows that see no key).
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// Attention output.
    pub o: Tensor,
    /// Log-sum-exp of the scaled scores.
    pub lse: Tensor,
}

/// Gradients, in the input dtype: `dq` like q, `dk` like k, `dv` like v; with attention
/// sinks ([`AttentionParams::sinks`]) also theirs, `dsinks` `[h_q]` f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// Gradient of q.
    pub dq: Tensor,
    /// Gradient of k.
    pub dk: Tensor,
    /// Gradient of v.
    pub dv: Tensor,
    /// Gradient of the sinks, `[h_q]` f32, over the query rows the call holds (a rank of a
    /// parallel call: its own rows; the sum over the ranks is the whole sequence's, what a
    /// training loop's gradient all-reduce takes). `None` without sinks.
    pub dsinks: Option<Tensor>,
}

/// How a call forms its scores from `q·k`, resolved once from its [`AttentionParams`] and
/// head dims: what every backend's tiles take (the CPU's paths through `cpu::score`, the
/// kernels' `FlashProblem`, built by `kernels::params::FlashProblem::new`, through
/// `cuda/score.cuh`). A score option joins it here, so that it reaches every backend through
/// one field.
///
/// The score of a pair is `s = scale · q·k`, then `softcap · tanh(s / softcap)` with a
/// soft-cap; the mask applies after. Its derivative by `q·k` is `scale` (times `1 − tanh²`
/// with a soft-cap).
///
/// ```
/// use ringattn::attention::ScoreSpec;
/// use ringattn::{AttentionParams, Dims};
/// let dims = Dims { b: 1, s_q: 1, s_k: 1, h_q: 1, h_kv: 1, d_qk: 64, d_v: 32 };
/// let capped = AttentionParams { softcap: Some(30.0), ..Default::default() };
/// let spec = ScoreSpec::of(&capped, &dims);
/// assert_eq!((spec.scale, spec.softcap), (0.125, Some(30.0)));
/// assert!((spec.score(240.0) - 30.0 * 1f32.tanh()).abs() < 1e-5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ScoreSpec {
    /// The factor applied to `q·k` before the softmax.
    pub scale: f32,
    /// The tanh soft-cap of the scaled scores, if any (finite, positive: validated with the
    /// parameters).
    pub softcap: Option<f32>,
}

impl ScoreSpec {
    /// The spec of a call of `dims` under `params` (scale `1/sqrt(d_qk)` unless given).
    pub fn of(params: &AttentionParams, dims: &Dims) -> ScoreSpec {
        ScoreSpec { scale: params.softmax_scale(dims.d_qk), softcap: params.softcap }
    }

    /// The score of a product `q·k` (natural units), as the definition above says, in f32.
    pub fn score(&self, dot: f32) -> f32 {
        let s = self.scale * dot;
        match self.softcap {
            Some(c) => c * (s / c).tanh(),
            None => s,
        }
    }

    /// The options a backend's kernels must honour beyond the scale, by name and value, for
    /// a refusal's message: `None` when the scores are plain scaled products.
    pub fn modifiers(&self) -> Option<String> {
        self.softcap.map(|c| format!("soft-capping (softcap = {c})"))
    }
}

/// The visibility of a call: single-device positions when `positions` is `None`, else the
/// block's global positions (validated against the dims).
pub(crate) fn visibility(
    dims: &Dims,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
) -> Result<Visibility> {
    match positions {
        None => Visibility::single_device(params, dims.s_q, dims.s_k),
        Some((qp, kp)) => block_visibility(dims, qp, kp, params),
    }
}

/// Validates block positions against the dims and resolves visibility.
pub(crate) fn block_visibility(
    dims: &Dims,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<Visibility> {
    if q_pos.len() != dims.s_q {
        return Err(Error::Positions(format!("{} query positions for s_q = {}", q_pos.len(), dims.s_q)));
    }
    if k_pos.len() != dims.s_k {
        return Err(Error::Positions(format!("{} key positions for s_k = {}", k_pos.len(), dims.s_k)));
    }
    Visibility::new(params, q_pos, k_pos)
}

/// Range of global positions and document indices of one tile's rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub start: usize,
    pub len: usize,
    pub(crate) pos_min: i64,
    pub(crate) pos_max: i64,
    pub(crate) doc_min: u32,
    pub(crate) doc_max: u32,
}

/// How a (query tile, key tile) pair is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileKind {
    /// No pair is visible: not computed at all.
    Skip,
    /// Every pair is visible: no mask applied.
    Full,
    /// Some pairs are visible: the per-element mask is applied.
    Partial,
}

/// Splits `pos` into tiles of `block` rows and records each tile's ranges.
pub(crate) fn spans(pos: &[i64], doc: Option<&[u32]>, block: usize) -> Vec<Span> {
    (0..pos.len())
        .step_by(block.max(1))
        .map(|start| {
            let len = block.min(pos.len() - start);
            let p = &pos[start..start + len];
            let (doc_min, doc_max) = match doc {
                Some(d) => {
                    let d = &d[start..start + len];
                    (*d.iter().min().unwrap_or(&0), *d.iter().max().unwrap_or(&0))
                }
                None => (0, 0),
            };
            Span {
                start,
                len,
                pos_min: *p.iter().min().unwrap_or(&0),
                pos_max: *p.iter().max().unwrap_or(&0),
                doc_min,
                doc_max,
            }
        })
        .collect()
}

/// Classifies a pair of tiles. `Skip` and `Full` are exact claims; `Partial` is the
/// conservative remainder.
pub(crate) fn classify(vis: &Visibility, q: &Span, k: &Span) -> TileKind {
    let right_out = vis.right.is_some_and(|r| k.pos_min > q.pos_max.saturating_add(r));
    let left_out = vis.left.is_some_and(|l| k.pos_max < q.pos_min.saturating_sub(l));
    let docs_apart = vis.q_doc.is_some() && (k.doc_max < q.doc_min || k.doc_min > q.doc_max);
    if right_out || left_out || docs_apart {
        return TileKind::Skip;
    }
    let right_in = vis.right.is_none_or(|r| k.pos_max <= q.pos_min.saturating_add(r));
    let left_in = vis.left.is_none_or(|l| k.pos_min >= q.pos_max.saturating_sub(l));
    let one_doc = vis.q_doc.is_none() || (q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min);
    if right_in && left_in && one_doc {
        TileKind::Full
    } else {
        TileKind::Partial
    }
}
