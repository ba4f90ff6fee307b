//! The float64 oracle: naive attention, forward and backward, with the crate's conventions.
//!
//! Every quantity is computed in f64 from the (exactly widened) inputs, row by row: a query
//! row's scores against its visible keys, the softmax, the output, and the gradients. No
//! `s_q × s_k` matrix is ever stored, so any subset of rows of a long sequence can be
//! checked ([`rows`]). A score is `s = scale · q·k`, soft-capped to `cap · tanh(s / cap)`
//! when [`AttentionParams::softcap`] is set (its gradient then carries the slope
//! `1 − tanh²(s / cap)`, and so do the magnitudes below).
//!
//! [`naive_rounded`] is the same computation with every intermediate rounded to a storage
//! dtype, the way an unfused low-precision implementation would run it; its error against
//! the oracle calibrates the tolerances of [`crate::verify`].

use rayon::prelude::*;

use std::borrow::Cow;

use crate::params::Visibility;
use crate::{AttentionParams, DType, Dims, Positions, Result, Tensor};

/// Outputs of the oracle. Layouts as in the crate: `o` `[b, s_q, h_q, d_v]`, `dq` `[b, s_q, h_q,
/// d_qk]`, `lse` `[b, h_q, s_q]` (natural log, `-inf` for fully masked rows), `dk` `[b, s_k,
/// h_kv, d_qk]`, `dv` `[b, s_k, h_kv, d_v]`.
/// The gradient fields are empty after a forward-only call.
#[derive(Debug, Clone, Default)]
pub struct Reference {
    /// Dimensions of the call.
    pub dims: Dims,
    /// Attention output.
    pub o: Vec<f64>,
    /// Log-sum-exp of the scaled scores per query row.
    pub lse: Vec<f64>,
    /// Gradient of q.
    pub dq: Vec<f64>,
    /// Gradient of k.
    pub dk: Vec<f64>,
    /// Gradient of v.
    pub dv: Vec<f64>,
    /// Condition magnitudes, same layouts as the outputs: the typical size of the change of
    /// each output when every term that makes it up carries an independent relative error
    /// `u`, divided by `u` — the root sum of squares of the terms: `sqrt(Σ_j (w_ij v_jc)²)`
    /// for `o`, `sqrt(Σ_j (scale · w_ij (|dP_ij| + |D_i|) k_jc)²)` for `dq`, and so on, with
    /// `w_ij = P_ij (1 + e_ij)` where `e_ij = |scale| Σ_c |q_ic k_jc| + |s_ij| + |lse_i|` is the
    /// scale of the rounding error of the exponent's argument (an error there moves `P_ij` by
    /// `P_ij` times itself). The tolerance floor of [`crate::verify`] scales with these.
    pub o_mag: Vec<f64>,
    /// Magnitude of the LSE: `sqrt(Σ_j (P_ij (|scale| Σ_c |q_ic k_jc| + |s_ij|))²)`.
    pub lse_mag: Vec<f64>,
    /// Magnitudes of `dq` terms.
    pub dq_mag: Vec<f64>,
    /// Magnitudes of `dk` terms.
    pub dk_mag: Vec<f64>,
    /// Magnitudes of `dv` terms.
    pub dv_mag: Vec<f64>,
    /// The part of the `dq` magnitude that flows through the stored forward output `O`: a
    /// backward reads `O` in the storage dtype, which moves `D_i = Σ_c dO_ic O_ic` by about
    /// `u · D'_i` with `D'_i = sqrt(Σ_c (dO_ic O_ic)²)`, and `dq_i` by that times
    /// `scale · Σ_j P_ij k_j`: so `D'_i · |scale · Σ_j P_ij k_jc|`.
    pub dq_mag_o: Vec<f64>,
    /// The same for `dk`: `sqrt(Σ_i (scale · P_ij D'_i q_ic)²)`.
    pub dk_mag_o: Vec<f64>,
    /// Gradient of the sinks `[h_q]` over the computed rows (empty without sinks or
    /// gradients): `dσ_h = −Σ_{b, i} P^σ_bhi D_bhi` with the sink's share `P^σ = e^{σ − lse}`.
    pub dsinks: Vec<f64>,
    /// Magnitude of `dsinks` terms: `sqrt(Σ (P^σ (|D| (1 + |σ| + |lse|) + D_mag))²)`, with
    /// `D_mag = sqrt(Σ_j (w_ij dP_ij)²)` the magnitude of `D` itself.
    pub dsinks_mag: Vec<f64>,
    /// The part through the stored `O`: `sqrt(Σ (P^σ D')²)` (`D'` as for `dq_mag_o`).
    pub dsinks_mag_o: Vec<f64>,
}

/// Oracle forward of a single-device call.
///
/// # Errors
/// As [`crate::cpu::forward`]: shape, dtype, head-dim, scale and document errors.
///
/// ```
/// use ringattn::{reference, AttentionParams, Tensor};
/// let q = Tensor::from_f32(vec![1, 2, 1, 2], vec![1.0, 0.0, 0.0, 1.0])?;
/// let r = reference::forward(&q, &q, &q, &AttentionParams::default())?;
/// // Row 0 scores 1·scale against key 0 and 0 against key 1 (scale = 1/sqrt(2) in f32).
/// assert!((r.lse[0] - ((0.5f64.sqrt()).exp() + 1.0).ln()).abs() < 1e-7);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, params: &AttentionParams) -> Result<Reference> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    let vis = Visibility::single_device(params, dims.s_q, dims.s_k)?;
    Ok(run(&Inputs::new(dims, q, k, v, None, all_rows(dims.s_q))?, params, &vis, None, Grads::None))
}

/// Oracle forward of a block of queries against a block of keys at arbitrary global
/// positions (`q_pos.len() == s_q`, `k_pos.len() == s_k`).
///
/// # Errors
/// As [`forward`], plus [`crate::Error::Positions`] when a position count mismatches.
pub fn forward_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<Reference> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    let vis = crate::attention::block_visibility(&dims, q_pos, k_pos, params)?;
    Ok(run(&Inputs::new(dims, q, k, v, None, all_rows(dims.s_q))?, params, &vis, None, Grads::None))
}

/// Oracle forward and backward of a single-device call (`o`, `lse`, `dq`, `dk`, `dv`).
///
/// # Errors
/// As [`forward`], plus a shape or dtype error for `d_o`.
pub fn backward(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, params: &AttentionParams) -> Result<Reference> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    Dims::expect("do", d_o, &dims.o_shape(), q)?;
    let vis = Visibility::single_device(params, dims.s_q, dims.s_k)?;
    Ok(run(&Inputs::new(dims, q, k, v, Some(d_o), all_rows(dims.s_q))?, params, &vis, None, Grads::All))
}

/// Oracle backward of a block call at global positions (see [`forward_at`]).
///
/// # Errors
/// As [`forward_at`] and [`backward`].
pub fn backward_at(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    q_pos: &Positions,
    k_pos: &Positions,
    params: &AttentionParams,
) -> Result<Reference> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    Dims::expect("do", d_o, &dims.o_shape(), q)?;
    let vis = crate::attention::block_visibility(&dims, q_pos, k_pos, params)?;
    Ok(run(&Inputs::new(dims, q, k, v, Some(d_o), all_rows(dims.s_q))?, params, &vis, None, Grads::All))
}

/// `o`, `lse` and (when `d_o` is given) `dq` for the query rows `rows` only of a
/// single-device call; `dk`, `dv` stay empty. Row `i` needs nothing but its own scores:
/// `dq_i = scale · Σ_j P_ij (dP_ij − D_i) k_j`, so this costs `O(rows · s_k · d)` and checks
/// any rows of a long sequence. Outputs are laid out with `rows.len()` in place of `s_q`.
/// With `round = Some(dtype)` it is the naive model of [`naive_rounded`] on those rows.
///
/// # Errors
/// As [`backward`], plus [`crate::Error::InvalidArgument`] for a row out of range.
///
/// ```
/// use ringattn::{random::randn, reference, AttentionParams, DType, Mask};
/// let x = randn(vec![1, 1000, 1, 8], 1, DType::F32);
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let r = reference::rows(&x, &x, &x, None, &p, &[0, 999], None)?;
/// assert_eq!(r.lse.len(), 2);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &AttentionParams,
    rows: &[usize],
    round: Option<DType>,
) -> Result<Reference> {
    let (inputs, vis, grads) = rows_inputs(q, k, v, d_o, params, rows)?;
    Ok(run(&inputs, params, &vis, round, grads))
}

/// [`rows`] twice over one conversion of the inputs: the oracle (`round = None`) and the
/// naive model in the inputs' dtype, as [`crate::verify::check_rows`] compares them.
pub(crate) fn rows_and_naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &AttentionParams,
    rows: &[usize],
) -> Result<(Reference, Reference)> {
    let (inputs, vis, grads) = rows_inputs(q, k, v, d_o, params, rows)?;
    let oracle = run(&inputs, params, &vis, None, grads);
    let naive = run(&inputs, params, &vis, Some(q.dtype()), grads);
    Ok((oracle, naive))
}

/// The validated inputs of a run over `rows` of a single-device call ([`rows`]).
fn rows_inputs<'a>(
    q: &Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    d_o: Option<&Tensor>,
    params: &AttentionParams,
    rows: &[usize],
) -> Result<(Inputs<'a>, Visibility, Grads)> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    if let Some(t) = d_o {
        Dims::expect("do", t, &dims.o_shape(), q)?;
    }
    check_rows(rows, dims.s_q)?;
    let vis = Visibility::single_device(params, dims.s_q, dims.s_k)?;
    let grads = if d_o.is_some() { Grads::QueryRows } else { Grads::None };
    Ok((Inputs::new(dims, q, k, v, d_o, rows.to_vec())?, vis, grads))
}

/// The same computation (single-device, or a block call when `positions` is given) with
/// every intermediate rounded to `dtype`: scores, probabilities,
/// output, `dP`, `dS` and each gradient, each product accumulated exactly and then rounded
/// (what an unfused implementation storing intermediates in `dtype` does). Its error against
/// the oracle is the yardstick of the tolerance rule in [`crate::verify`].
///
/// # Errors
/// As [`backward`] (or [`forward`] when `d_o` is `None`).
pub fn naive_rounded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    positions: Option<(&Positions, &Positions)>,
    params: &AttentionParams,
    dtype: DType,
) -> Result<Reference> {
    let dims = Dims::of(q, k, v)?;
    params.check_heads(dims.h_q)?;
    if let Some(t) = d_o {
        Dims::expect("do", t, &dims.o_shape(), q)?;
    }
    let vis = match positions {
        None => Visibility::single_device(params, dims.s_q, dims.s_k)?,
        Some((qp, kp)) => crate::attention::block_visibility(&dims, qp, kp, params)?,
    };
    let inputs = Inputs::new(dims, q, k, v, d_o, all_rows(dims.s_q))?;
    let grads = if d_o.is_some() { Grads::All } else { Grads::None };
    Ok(run(&inputs, params, &vis, Some(dtype), grads))
}

/// The inputs of one oracle run: the query and `dO` rows that are computed, widened to f64
/// and laid out `[b, rows.len(), h_q, d]`; every key and value row as f32 (the exact value of
/// any input dtype, borrowed when the tensors are f32), widened where it is read. A check of
/// a few rows of a long sequence so converts no more than those rows of Q and dO.
struct Inputs<'a> {
    dims: Dims,
    q: Vec<f64>,
    k: Cow<'a, [f32]>,
    v: Cow<'a, [f32]>,
    d_o: Vec<f64>,
    /// The query rows computed.
    rows: Vec<usize>,
}

impl<'a> Inputs<'a> {
    fn new(
        dims: Dims,
        q: &Tensor,
        k: &'a Tensor,
        v: &'a Tensor,
        d_o: Option<&Tensor>,
        rows: Vec<usize>,
    ) -> Result<Self> {
        // The rows in the tensor's dtype first, then widened: no full-size copy.
        let gather = |t: &Tensor, d: usize| -> Result<Vec<f64>> {
            let width = dims.h_q * d;
            let at = (0..dims.b).flat_map(|b| rows.iter().map(move |&i| b * dims.s_q + i));
            let picked = t.gather_rows(vec![dims.b * rows.len() * width], width, at)?;
            Ok(picked.as_f32().iter().map(|&x| f64::from(x)).collect())
        };
        let q = gather(q, dims.d_qk)?;
        let d_o = d_o.map(|t| gather(t, dims.d_v)).transpose()?.unwrap_or_default();
        Ok(Inputs { dims, q, k: k.as_f32(), v: v.as_f32(), d_o, rows })
    }
}

/// `out[t] = Σ_c term(a[c], row(keys[t])[c])` for every key, each sum folded in order of `c`
/// and passed through `acc` after every addition — exactly one fold per key, with the
/// chains of eight keys interleaved (a single fold is bound by the latency of its additions).
fn dots_into<'k>(
    a: &[f64],
    keys: &[usize],
    row: impl Fn(usize) -> &'k [f32],
    term: impl Fn(f64, f64) -> f64,
    acc: impl Fn(f64) -> f64,
    out: &mut Vec<f64>,
) {
    const N: usize = 8;
    out.clear();
    for chunk in keys.chunks(N) {
        let rows: [&[f32]; N] = std::array::from_fn(|t| row(chunk[t.min(chunk.len() - 1)]));
        let mut sums = [0.0f64; N];
        for (c, &x) in a.iter().enumerate() {
            for (sum, r) in sums.iter_mut().zip(&rows) {
                *sum = acc(*sum + term(x, r[c] as f64));
            }
        }
        out.extend_from_slice(&sums[..chunk.len()]);
    }
}

fn all_rows(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn check_rows(rows: &[usize], s_q: usize) -> Result<()> {
    match rows.iter().find(|&&r| r >= s_q) {
        Some(r) => Err(crate::Error::InvalidArgument(format!("row {r} is out of range for s_q = {s_q}"))),
        None => Ok(()),
    }
}

/// Per-(batch, query head) results, assembled into the crate layouts afterwards.
struct HeadResult {
    /// The sinks' gradient over this head's rows, and its two magnitudes squared.
    dsink: [f64; 3],
    o: Vec<f64>,
    lse: Vec<f64>,
    lse_mag: Vec<f64>,
    dq: Vec<f64>,
    /// dK, dV contributions of this query head, `[s_k, d_qk]` and `[s_k, d_v]`.
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// Magnitudes, laid out as the four above, then the dq, dk parts through O.
    mag: [Vec<f64>; 6],
}

/// Which gradients [`run`] computes besides the forward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Grads {
    /// Forward only.
    None,
    /// dQ of the given rows only: no dK/dV, whose key-length buffers (and the updates of
    /// every visible key per row) would dominate a check of a few rows of a long sequence.
    QueryRows,
    /// dQ of the given rows and their dK/dV contributions (all rows: the full oracle).
    All,
}

fn run(x: &Inputs, params: &AttentionParams, vis: &Visibility, round: Option<DType>, grads: Grads) -> Reference {
    let rows = &x.rows[..];
    let with_grad = grads != Grads::None;
    let key_grads = grads == Grads::All;
    let dm = x.dims;
    let (d, e) = (dm.d_qk, dm.d_v); // q/k and v/o head dims
    let scale = params.softmax_scale(d) as f64;
    let softcap = params.softcap.map(f64::from);
    let sinks = params.sinks.as_deref();
    let rnd = |t: f64| match round {
        Some(dt) => dt.round_f64(t),
        None => t,
    };
    // The naive model accumulates in f32 (as unfused implementations do for every dtype);
    // the oracle in f64.
    let acc = |t: f64| if round.is_some() { t as f32 as f64 } else { t };
    // Query and dO rows by their place `r` in `rows` (see `Inputs`).
    let n_rows = rows.len();
    let q_row = |b: usize, r: usize, h: usize| &x.q[((b * n_rows + r) * dm.h_q + h) * d..][..d];
    let do_row = |b: usize, r: usize, h: usize| &x.d_o[((b * n_rows + r) * dm.h_q + h) * e..][..e];
    let k_row = |b: usize, j: usize, h: usize| &x.k[((b * dm.s_k + j) * dm.h_kv + h) * d..][..d];
    let v_row = |b: usize, j: usize, h: usize| &x.v[((b * dm.s_k + j) * dm.h_kv + h) * e..][..e];

    let heads: Vec<HeadResult> = (0..dm.b * dm.h_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.h_q, bh % dm.h_q);
            let hk = dm.kv_head(h);
            let n = rows.len();
            // The sink's logit of this head: one more term of each row's denominator.
            let sigma = sinks.map(|x| f64::from(x[h]));
            let mut res = HeadResult {
                dsink: [0.0; 3],
                o: vec![0.0; n * e],
                lse: vec![f64::NEG_INFINITY; n],
                lse_mag: vec![0.0; n],
                dq: if with_grad { vec![0.0; n * d] } else { vec![] },
                dk: if key_grads { vec![0.0; dm.s_k * d] } else { vec![] },
                dv: if key_grads { vec![0.0; dm.s_k * e] } else { vec![] },
                mag: [
                    vec![0.0; n * e],
                    vec![0.0; n * d],
                    if key_grads { vec![0.0; dm.s_k * d] } else { vec![] },
                    if key_grads { vec![0.0; dm.s_k * e] } else { vec![] },
                    vec![0.0; n * d],
                    if key_grads { vec![0.0; dm.s_k * d] } else { vec![] },
                ],
            };
            let [o_mag, dq_mag, dk_mag, dv_mag, dq_mag_o, dk_mag_o] = &mut res.mag;
            let mut keys: Vec<usize> = Vec::with_capacity(dm.s_k);
            let mut s: Vec<f64> = Vec::with_capacity(dm.s_k);
            let mut w: Vec<f64> = Vec::with_capacity(dm.s_k);
            let mut ex: Vec<f64> = Vec::with_capacity(dm.s_k);
            let mut absdot: Vec<f64> = Vec::with_capacity(dm.s_k);
            let mut dp: Vec<f64> = Vec::with_capacity(dm.s_k);
            // Per visible key, the score's derivative by its scaled product: 1 − tanh² under
            // a soft-cap, else 1.
            let mut slope: Vec<f64> = Vec::with_capacity(dm.s_k);
            for (r, &i) in rows.iter().enumerate() {
                keys.clear();
                keys.extend((0..dm.s_k).filter(|&j| vis.visible(i, j)));
                if keys.is_empty() {
                    // Fully masked row: o = 0, lse = -inf (σ with a sink: then D = 0 adds
                    // nothing to its gradient), zero gradients.
                    if let Some(sg) = sigma {
                        res.lse[r] = if round.is_some() { sg as f32 as f64 } else { sg };
                    }
                    continue;
                }
                let qi = q_row(b, r, h);
                dots_into(qi, &keys, |j| k_row(b, j, hk), |x, y| x * y, acc, &mut s);
                s.iter_mut().for_each(|t| *t = rnd(rnd(*t) * scale));
                slope.clear();
                match softcap {
                    None => slope.resize(s.len(), 1.0),
                    Some(cap) => {
                        for t in s.iter_mut() {
                            let th = (*t / cap).tanh();
                            slope.push(1.0 - th * th);
                            *t = rnd(cap * th);
                        }
                    }
                }
                // NaN propagates through the max (a NaN score makes the whole row NaN).
                let m = if s.iter().any(|t| t.is_nan()) {
                    f64::NAN
                } else {
                    s.iter().copied().fold(sigma.unwrap_or(f64::NEG_INFINITY), f64::max)
                };
                ex.clear();
                ex.extend(s.iter().map(|&t| (t - m).exp()));
                // The sink's term joins the denominator (it has no value).
                let sink_ex = sigma.map_or(0.0, |sg| (sg - m).exp());
                let sum: f64 = acc(ex.iter().fold(0.0, |a, &e| acc(a + e)) + sink_ex);
                let lse = m + sum.ln();
                res.lse[r] = match round {
                    Some(_) => lse as f32 as f64,
                    None => lse,
                };
                // Exponent error scales and magnitude weights (from the exact probabilities).
                w.clear();
                let mut lse_mag = 0.0;
                dots_into(qi, &keys, |j| k_row(b, j, hk), |x, y| (x * y).abs(), |t| t, &mut absdot);
                for (((&t, &e), &absdot), &g) in s.iter().zip(&ex).zip(&absdot).zip(&slope) {
                    let p = e / sum;
                    let e = scale.abs() * absdot * g + t.abs();
                    lse_mag += (p * e) * (p * e);
                    w.push(p * (1.0 + e + lse.abs()));
                }
                res.lse_mag[r] = lse_mag.sqrt();
                // probabilities (rounded to the storage dtype in the naive model)
                for (t, &e) in s.iter_mut().zip(&ex) {
                    *t = rnd(e / sum);
                }
                let o = &mut res.o[r * e..(r + 1) * e];
                let om = &mut o_mag[r * e..(r + 1) * e];
                for ((&j, &p), &wj) in keys.iter().zip(&s).zip(&w) {
                    for ((oc, mc), &vc) in o.iter_mut().zip(om.iter_mut()).zip(v_row(b, j, hk)) {
                        let vc = vc as f64;
                        *oc = acc(*oc + p * vc);
                        *mc += (wj * vc) * (wj * vc);
                    }
                }
                o.iter_mut().for_each(|t| *t = rnd(*t));
                if !with_grad {
                    continue;
                }
                let doi = do_row(b, r, h);
                dots_into(doi, &keys, |j| v_row(b, j, hk), |x, y| x * y, acc, &mut dp);
                dp.iter_mut().for_each(|t| *t = rnd(*t));
                let delta: f64 = s.iter().zip(&dp).fold(0.0, |a, (p, g)| acc(a + p * g));
                if let Some(sg) = sigma {
                    // The sink's share of the row and its gradient term; magnitudes as above.
                    let p_sink = (sg - lse).exp();
                    res.dsink[0] = acc(res.dsink[0] - rnd(p_sink) * delta);
                    let delta_mag: f64 = w.iter().zip(&dp).map(|(wj, g)| (wj * g) * (wj * g)).sum::<f64>().sqrt();
                    let m1 = p_sink * (delta.abs() * (1.0 + sg.abs() + lse.abs()) + delta_mag);
                    res.dsink[1] += m1 * m1;
                    let o_row = &res.o[r * e..(r + 1) * e];
                    let d_rss2: f64 = o_row.iter().zip(do_row(b, r, h)).map(|(a, b)| (a * b) * (a * b)).sum();
                    res.dsink[2] += p_sink * p_sink * d_rss2;
                }
                let dq = &mut res.dq[r * d..(r + 1) * d];
                let dqm = &mut dq_mag[r * d..(r + 1) * d];
                let dqmo = &mut dq_mag_o[r * d..(r + 1) * d];
                let o_row = &res.o[r * e..(r + 1) * e];
                let d_rss: f64 = o_row.iter().zip(doi).map(|(a, b)| (a * b) * (a * b)).sum::<f64>().sqrt();
                for ((((&j, &p), &g), &wj), &sl) in keys.iter().zip(&s).zip(&dp).zip(&w).zip(&slope) {
                    let ds = rnd(rnd(p * (g - delta)) * (scale * sl));
                    let ds_mag = (wj * (g.abs() + delta.abs()) * scale * sl).abs();
                    let ds_mag_o = p * d_rss * scale * sl;
                    let kj = k_row(b, j, hk);
                    for c in 0..d {
                        let kc = kj[c] as f64;
                        dq[c] = acc(dq[c] + ds * kc);
                        dqm[c] += (ds_mag * kc) * (ds_mag * kc);
                        dqmo[c] += ds_mag_o * kc; // coherent over j: abs taken at the end
                    }
                    if !key_grads {
                        continue;
                    }
                    let (dkj, dkm) = (&mut res.dk[j * d..(j + 1) * d], &mut dk_mag[j * d..(j + 1) * d]);
                    let dkmo = &mut dk_mag_o[j * d..(j + 1) * d];
                    for c in 0..d {
                        dkj[c] = acc(dkj[c] + ds * qi[c]);
                        dkm[c] += (ds_mag * qi[c]) * (ds_mag * qi[c]);
                        dkmo[c] += (ds_mag_o * qi[c]) * (ds_mag_o * qi[c]);
                    }
                    let (dvj, dvm) = (&mut res.dv[j * e..(j + 1) * e], &mut dv_mag[j * e..(j + 1) * e]);
                    for c in 0..e {
                        dvj[c] = acc(dvj[c] + p * doi[c]);
                        dvm[c] += (wj * doi[c]) * (wj * doi[c]);
                    }
                }
                dq.iter_mut().for_each(|t| *t = rnd(*t));
            }
            res
        })
        .collect();

    // Assemble into the crate layouts.
    let n = rows.len();
    let mut out = Reference {
        dims: Dims { s_q: n, ..dm },
        o: vec![0.0; dm.b * n * dm.h_q * e],
        lse: vec![0.0; dm.b * dm.h_q * n],
        lse_mag: vec![0.0; dm.b * dm.h_q * n],
        ..Default::default()
    };
    out.o_mag = vec![0.0; out.o.len()];
    if with_grad {
        out.dq = vec![0.0; dm.b * n * dm.h_q * d];
        out.dq_mag = vec![0.0; out.dq.len()];
        out.dq_mag_o = vec![0.0; out.dq.len()];
    }
    if key_grads {
        out.dk = vec![0.0; dm.b * dm.s_k * dm.h_kv * d];
        out.dv = vec![0.0; dm.b * dm.s_k * dm.h_kv * e];
        out.dk_mag = vec![0.0; out.dk.len()];
        out.dv_mag = vec![0.0; out.dv.len()];
        out.dk_mag_o = vec![0.0; out.dk.len()];
    }
    for (bh, hr) in heads.iter().enumerate() {
        let (b, h) = (bh / dm.h_q, bh % dm.h_q);
        let hk = dm.kv_head(h);
        out.lse[(b * dm.h_q + h) * n..][..n].copy_from_slice(&hr.lse);
        out.lse_mag[(b * dm.h_q + h) * n..][..n].copy_from_slice(&hr.lse_mag);
        for r in 0..n {
            let at = ((b * n + r) * dm.h_q + h) * e;
            out.o[at..at + e].copy_from_slice(&hr.o[r * e..(r + 1) * e]);
            out.o_mag[at..at + e].copy_from_slice(&hr.mag[0][r * e..(r + 1) * e]);
            if with_grad {
                let at = ((b * n + r) * dm.h_q + h) * d;
                out.dq[at..at + d].copy_from_slice(&hr.dq[r * d..(r + 1) * d]);
                out.dq_mag[at..at + d].copy_from_slice(&hr.mag[1][r * d..(r + 1) * d]);
                out.dq_mag_o[at..at + d].copy_from_slice(&hr.mag[4][r * d..(r + 1) * d]);
            }
        }
        if key_grads {
            for j in 0..dm.s_k {
                let at = ((b * dm.s_k + j) * dm.h_kv + hk) * d;
                for c in 0..d {
                    out.dk[at + c] += hr.dk[j * d + c];
                    out.dk_mag[at + c] += hr.mag[2][j * d + c];
                    out.dk_mag_o[at + c] += hr.mag[5][j * d + c];
                }
                let at = ((b * dm.s_k + j) * dm.h_kv + hk) * e;
                for c in 0..e {
                    out.dv[at + c] += hr.dv[j * e + c];
                    out.dv_mag[at + c] += hr.mag[3][j * e + c];
                }
            }
        }
    }
    if with_grad && sinks.is_some() {
        out.dsinks = vec![0.0; dm.h_q];
        out.dsinks_mag = vec![0.0; dm.h_q];
        out.dsinks_mag_o = vec![0.0; dm.h_q];
        for (bh, hr) in heads.iter().enumerate() {
            let h = bh % dm.h_q;
            out.dsinks[h] = acc(out.dsinks[h] + hr.dsink[0]);
            out.dsinks_mag[h] += hr.dsink[1];
            out.dsinks_mag_o[h] += hr.dsink[2];
        }
    }
    for m in [
        &mut out.o_mag,
        &mut out.dq_mag,
        &mut out.dk_mag,
        &mut out.dv_mag,
        &mut out.dk_mag_o,
        &mut out.dsinks_mag,
        &mut out.dsinks_mag_o,
    ] {
        m.iter_mut().for_each(|x| *x = x.sqrt());
    }
    out.dq_mag_o.iter_mut().for_each(|x| *x = x.abs());
    if let Some(dt) = round {
        if key_grads {
            out.dk.iter_mut().for_each(|t| *t = dt.round_f64(*t));
            out.dv.iter_mut().for_each(|t| *t = dt.round_f64(*t));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{random, Mask};

    /// Selected rows of a `[b, s, h, d]` (or `[b, h, s]` for `lse`) oracle output.
    fn pick(full: &[f64], b: usize, s: usize, width: usize, rows: &[usize]) -> Vec<f64> {
        (0..b).flat_map(|bi| rows.iter().flat_map(move |&r| full[(bi * s + r) * width..][..width].to_vec())).collect()
    }

    /// `rows` (and `rows_and_naive`) compute exactly what the full oracle and the naive model
    /// compute for those rows: the same numbers, bit for bit, for rows in any order.
    #[test]
    fn rows_are_the_full_runs_rows() {
        let (b, s, hq, hkv, d) = (2, 37, 4, 2, 8);
        for dtype in [DType::F32, DType::BF16] {
            let q = random::randn(vec![b, s, hq, d], 1, dtype);
            let k = random::randn(vec![b, s, hkv, d], 2, dtype);
            let v = random::randn(vec![b, s, hkv, d], 3, dtype);
            let d_o = random::randn(vec![b, s, hq, d], 4, dtype);
            let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
            let picked = [36, 0, 17, 5, 17];
            let full = backward(&q, &k, &v, &d_o, &p).unwrap();
            let naive_full = naive_rounded(&q, &k, &v, Some(&d_o), None, &p, dtype).unwrap();
            let (oracle, naive) = rows_and_naive(&q, &k, &v, Some(&d_o), &p, &picked).unwrap();
            assert_eq!(rows(&q, &k, &v, Some(&d_o), &p, &picked, None).unwrap().o, oracle.o);
            for (part, whole) in [(&oracle, &full), (&naive, &naive_full)] {
                let w = hq * d;
                assert_eq!(part.o, pick(&whole.o, b, s, w, &picked));
                assert_eq!(part.dq, pick(&whole.dq, b, s, w, &picked));
                assert_eq!(part.o_mag, pick(&whole.o_mag, b, s, w, &picked));
                assert_eq!(part.dq_mag, pick(&whole.dq_mag, b, s, w, &picked));
                assert_eq!(part.lse, pick(&whole.lse, b * hq, s, 1, &picked));
                assert_eq!(part.lse_mag, pick(&whole.lse_mag, b * hq, s, 1, &picked));
            }
            assert_ne!(oracle.o, naive.o, "the naive model rounds");
        }
    }

    /// The oracle's gradients against central finite differences of its forward, for the
    /// loss `L = Σ dO ∘ O`: plain, soft-capped (the slope `1 − tanh²`; a small cap so that
    /// scores sit on tanh's bend), under a sliding window, with grouped heads and `d_v ≠ d_qk`.
    #[test]
    fn gradients_match_finite_differences() {
        let (b, s, hq, hkv, d, dv) = (1, 9, 2, 1, 6, 4);
        let q = random::randn(vec![b, s, hq, d], 11, DType::F32);
        let k = random::randn(vec![b, s, hkv, d], 12, DType::F32);
        let v = random::randn(vec![b, s, hkv, dv], 13, DType::F32);
        let d_o = random::randn(vec![b, s, hq, dv], 14, DType::F32);
        let window = Mask::Window { left: Some(4), right: Some(2) };
        let sinks = Some(vec![0.7f32, -0.4]);
        for (softcap, scale, sinks) in [
            (None, None, None),
            (Some(0.8f32), Some(1.5f32), None),
            (Some(3.0), None, None),
            (None, None, sinks.clone()),
            (Some(0.8), Some(1.5), sinks),
        ] {
            let p = AttentionParams { mask: window, softcap, scale, sinks, ..Default::default() };
            let grads = backward(&q, &k, &v, &d_o, &p).unwrap();
            let dov = d_o.as_f32();
            let loss_with = |q: &Tensor, k: &Tensor, v: &Tensor, p: &AttentionParams| -> f64 {
                let o = forward(q, k, v, p).unwrap().o;
                o.iter().zip(dov.iter()).map(|(&o, &g)| o * g as f64).sum()
            };
            let loss = |q: &Tensor, k: &Tensor, v: &Tensor| loss_with(q, k, v, &p);
            // dσ against central differences of the oracle's loss.
            if let Some(sg) = &p.sinks {
                assert_eq!(grads.dsinks.len(), hq);
                for h in 0..hq {
                    let moved = |step: f32| {
                        let mut x = sg.clone();
                        x[h] += step;
                        (f64::from(x[h]) - f64::from(sg[h]), AttentionParams { sinks: Some(x), ..p.clone() })
                    };
                    let ((hp, pp), (hm, pm)) = (moved(1e-3), moved(-1e-3));
                    let fd = (loss_with(&q, &k, &v, &pp) - loss_with(&q, &k, &v, &pm)) / (hp - hm);
                    let want = grads.dsinks[h];
                    assert!(want.abs() > 1e-3, "a sink gradient worth testing: {want}");
                    assert!((fd - want).abs() <= 1e-4 * (1.0 + want.abs()), "dsinks[{h}]: {fd} vs {want}");
                }
            } else {
                assert!(grads.dsinks.is_empty());
            }
            let which = [("q", &q, &grads.dq), ("k", &k, &grads.dk), ("v", &v, &grads.dv)];
            for (wi, (name, x, want)) in which.into_iter().enumerate() {
                let base = x.as_f32().into_owned();
                for i in (0..base.len()).step_by(5) {
                    let at = |h: f32| {
                        let mut y = base.clone();
                        y[i] += h;
                        (y[i] as f64 - base[i] as f64, Tensor::from_f32(x.shape().to_vec(), y).unwrap())
                    };
                    let ((hp, xp), (hm, xm)) = (at(1e-3), at(-1e-3));
                    let f = |t: &Tensor| match wi {
                        0 => loss(t, &k, &v),
                        1 => loss(&q, t, &v),
                        _ => loss(&q, &k, t),
                    };
                    let fd = (f(&xp) - f(&xm)) / (hp - hm);
                    assert!(
                        (fd - want[i]).abs() <= 1e-4 * (1.0 + want[i].abs()),
                        "{softcap:?} d{name}[{i}]: {fd} vs {}",
                        want[i]
                    );
                }
            }
        }
    }
}
