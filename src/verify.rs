//! Checking results against the float64 oracle: the one tolerance rule of the crate, used by
//! `ringattn verify`, the demo and the test suite alike.
//!
//! **Rule.** For each output `x` with oracle value `r`, the error must satisfy
//! `‖x − r‖ ≤ 2 · ‖n − r‖ + c · (u(dtype) · (‖r‖ + ‖m_O‖) + u(f32) · ‖m‖)`, where `n` is the output of
//! [`crate::reference::naive_rounded`] (naive attention storing every intermediate in the
//! dtype and accumulating in f32) on the same inputs, `u` the unit roundoff,
//! `c` = [`Tolerance::roundoff_factor`] and `m` the oracle's condition magnitudes
//! ([`crate::reference::Reference::o_mag`]: the sum of absolute values of the terms of each
//! output, the classic forward-error scale) and `m_O` the part of `m` that flows through the
//! stored forward output (`dq` and `dk` only: the backward reads `O` in the storage dtype;
//! [`crate::reference::Reference::dq_mag_o`]). The first term is flash-attention's rule ("at
//! most twice the error of a naive implementation in the same precision"); the second is a
//! floor of `c` roundings for inputs where the naive error happens to vanish (a gradient that
//! cancels to exactly 0, a single key): one rounding of the output to the dtype and one of
//! the f32 arithmetic on each term. Reports show everything relative to `‖r‖` (absolute when
//! `‖r‖ = 0`).
//! The LSE is f32 whatever the input dtype: its floor is `c · u(f32) · (‖r‖ + ‖m‖)`; its `-inf`
//! entries (rows that see no key) must match the oracle's exactly, and only finite entries
//! enter the norms. A NaN in the result where the oracle has none fails.

use crate::reference::{self, Reference};
use crate::{cpu, AttentionParams, DType, Error, Result, Tensor};

/// The constants of the tolerance rule. `Default` is the crate's rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Multiple of the naive implementation's error allowed (2).
    pub naive_factor: f64,
    /// Number of roundings allowed as a floor (4).
    pub roundoff_factor: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance { naive_factor: 2.0, roundoff_factor: 4.0 }
    }
}

impl Tolerance {
    /// The allowed absolute error norm for a quantity of norm `norm` stored in `dtype`,
    /// whose naive implementation is off by `naive_err` (a norm) and whose condition
    /// magnitude has norm `magnitude`.
    /// `magnitude_o` is the norm of the part of the magnitude that flows through stored
    /// dtype values (0 for forward outputs).
    pub fn bound(&self, naive_err: f64, norm: f64, magnitude: f64, magnitude_o: f64, dtype: DType) -> f64 {
        self.naive_factor * naive_err
            + self.roundoff_factor
                * (dtype.unit_roundoff() * (norm + magnitude_o) + DType::F32.unit_roundoff() * magnitude)
    }
}

/// One row of a verification report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Comparison {
    /// Quantity name: `o`, `lse`, `dq`, `dk`, `dv`, `dsinks`.
    pub name: String,
    /// Relative error against the oracle.
    pub rel_err: f64,
    /// Relative error of the naive same-precision implementation.
    pub naive_rel_err: f64,
    /// The allowed relative error.
    pub bound: f64,
    /// Positions where exactly one of result and oracle is `-inf` (LSE only).
    pub inf_mismatches: usize,
    /// Whether the check holds.
    pub pass: bool,
}

/// `‖x − r‖₂ / ‖r‖₂` over the given pairs (`‖x‖₂` when `‖r‖₂ = 0`); NaN when `x` holds NaN.
///
/// ```
/// let e = ringattn::verify::rel_err(&[1.0, 2.0], &[1.0, 2.0]);
/// assert_eq!(e, 0.0);
/// ```
pub fn rel_err(x: &[f32], r: &[f64]) -> f64 {
    let (diff, norm) = norms(x.iter().map(|&a| a as f64).zip(r.iter().copied()));
    relative(diff, norm)
}

/// `(‖x − r‖, ‖r‖)` over the pairs.
fn norms(pairs: impl Iterator<Item = (f64, f64)>) -> (f64, f64) {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (a, b) in pairs {
        num += (a - b) * (a - b);
        den += b * b;
    }
    (num.sqrt(), den.sqrt())
}

fn relative(x: f64, norm: f64) -> f64 {
    if norm > 0.0 {
        x / norm
    } else {
        x
    }
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Compares an output tensor stored in `dtype` with the oracle under the rule; `magnitude`
/// is the oracle's condition magnitude of that output and `magnitude_o` its part through the
/// stored forward output (empty for forward outputs).
#[allow(clippy::too_many_arguments)]
pub fn compare(
    name: &str,
    ours: &[f32],
    oracle: &[f64],
    naive: &[f64],
    magnitude: &[f64],
    magnitude_o: &[f64],
    dtype: DType,
    tol: &Tolerance,
) -> Comparison {
    let (err, r) = norms(ours.iter().map(|&a| a as f64).zip(oracle.iter().copied()));
    let (naive_err, _) = norms(naive.iter().copied().zip(oracle.iter().copied()));
    let bound = tol.bound(naive_err, r, norm(magnitude), norm(magnitude_o), dtype);
    Comparison {
        name: name.to_string(),
        rel_err: relative(err, r),
        naive_rel_err: relative(naive_err, r),
        bound: relative(bound, r),
        inf_mismatches: 0,
        // A result of another length (another shape) fails, whatever its elements.
        pass: err <= bound && ours.len() == oracle.len(),
    }
}

/// Compares an LSE (f32) with the oracle: `-inf` entries must match exactly, finite ones by
/// relative norm; `magnitude` is the oracle's `lse_mag`.
pub fn compare_lse(ours: &[f32], oracle: &[f64], naive: &[f64], magnitude: &[f64], tol: &Tolerance) -> Comparison {
    let ninf = f64::NEG_INFINITY;
    let inf_mismatches = ours.iter().zip(oracle).filter(|(&a, &b)| (a == f32::NEG_INFINITY) != (b == ninf)).count();
    let finite = |x: f64, r: f64| x != ninf && r != ninf;
    let (err, r) = norms(ours.iter().map(|&a| a as f64).zip(oracle.iter().copied()).filter(|&(a, r)| finite(a, r)));
    let (naive_err, _) = norms(naive.iter().copied().zip(oracle.iter().copied()).filter(|&(a, r)| finite(a, r)));
    let bound = tol.bound(naive_err, r, norm(magnitude), 0.0, DType::F32);
    Comparison {
        name: "lse".into(),
        rel_err: relative(err, r),
        naive_rel_err: relative(naive_err, r),
        bound: relative(bound, r),
        inf_mismatches,
        pass: inf_mismatches == 0 && err <= bound && ours.len() == oracle.len(),
    }
}

/// A verification of one configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Input dtype.
    pub dtype: String,
    /// One comparison per output.
    pub rows: Vec<Comparison>,
}

impl Report {
    /// Whether every comparison passes.
    pub fn pass(&self) -> bool {
        self.rows.iter().all(|r| r.pass)
    }

    /// The report as an aligned text table.
    pub fn table(&self) -> String {
        let mut s = format!("{:<5} {:>12} {:>12} {:>12} {:>6}\n", "out", "rel.err", "naive.err", "bound", "result");
        for r in &self.rows {
            let verdict = if r.pass { "pass" } else { "FAIL" };
            let extra =
                if r.inf_mismatches > 0 { format!("  ({} -inf mismatches)", r.inf_mismatches) } else { String::new() };
            s += &format!(
                "{:<5} {:>12.3e} {:>12.3e} {:>12.3e} {:>6}{extra}\n",
                r.name, r.rel_err, r.naive_rel_err, r.bound, verdict
            );
        }
        s
    }
}

/// Builds the report of given results (forward `o`, `lse`; gradients when `grads` is
/// given) against the oracle and the naive reference of the same inputs.
pub fn report(
    dtype: DType,
    fwd: &cpu::ForwardOutput,
    grads: Option<&cpu::Gradients>,
    oracle: &Reference,
    naive: &Reference,
    tol: &Tolerance,
) -> Report {
    let mut rows = vec![
        compare("o", &fwd.o.as_f32(), &oracle.o, &naive.o, &oracle.o_mag, &[], dtype, tol),
        compare_lse(&fwd.lse.as_f32(), &oracle.lse, &naive.lse, &oracle.lse_mag, tol),
    ];
    if let Some(g) = grads {
        rows.push(compare("dq", &g.dq.as_f32(), &oracle.dq, &naive.dq, &oracle.dq_mag, &oracle.dq_mag_o, dtype, tol));
        rows.push(compare("dk", &g.dk.as_f32(), &oracle.dk, &naive.dk, &oracle.dk_mag, &oracle.dk_mag_o, dtype, tol));
        rows.push(compare("dv", &g.dv.as_f32(), &oracle.dv, &naive.dv, &oracle.dv_mag, &[], dtype, tol));
        // With sinks, their gradient (f32; a result without one fails: empty against h_q).
        if !oracle.dsinks.is_empty() || g.dsinks.is_some() {
            let ours = g.dsinks.as_ref().map(|t| t.as_f32().into_owned()).unwrap_or_default();
            let (mag, mag_o) = (&oracle.dsinks_mag, &oracle.dsinks_mag_o);
            rows.push(compare("dsinks", &ours, &oracle.dsinks, &naive.dsinks, mag, mag_o, dtype, tol));
        }
    }
    Report { dtype: dtype.to_string(), rows }
}

/// Runs the CPU implementation (forward, and backward when `d_o` is given) on a
/// single-device call and checks it against the oracle under the default rule.
///
/// # Errors
/// Any error of [`cpu::forward`] or [`cpu::backward`].
///
/// ```
/// use ringattn::{random::randn, verify, AttentionParams, DType, Mask};
/// let (q, k, v, d_o) = (
///     randn(vec![1, 33, 2, 16], 1, DType::BF16),
///     randn(vec![1, 33, 1, 16], 2, DType::BF16),
///     randn(vec![1, 33, 1, 16], 3, DType::BF16),
///     randn(vec![1, 33, 2, 16], 4, DType::BF16),
/// );
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let report = verify::verify_cpu(&q, &k, &v, Some(&d_o), &p)?;
/// assert!(report.pass(), "{}", report.table());
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn verify_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &AttentionParams,
) -> Result<Report> {
    let fwd = cpu::forward(q, k, v, params)?;
    let grads = match d_o {
        Some(g) => Some(cpu::backward(q, k, v, &fwd.o, &fwd.lse, g, params)?),
        None => None,
    };
    check_results(q, k, v, d_o, None, params, &fwd, grads.as_ref())
}

/// Checks results computed by any path (CPU, a parallel strategy, a kernel) for the inputs
/// `q`, `k`, `v` (and `d_o` when `grads` is given) of a single-device call, or of a block call
/// at `positions`, against the oracle under the default rule.
///
/// # Errors
/// As [`reference::backward`] / [`reference::backward_at`].
#[allow(clippy::too_many_arguments)]
pub fn check_results(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    positions: Option<(&crate::Positions, &crate::Positions)>,
    params: &AttentionParams,
    fwd: &cpu::ForwardOutput,
    grads: Option<&cpu::Gradients>,
) -> Result<Report> {
    let oracle = match (d_o, positions) {
        (Some(g), None) => reference::backward(q, k, v, g, params)?,
        (Some(g), Some((qp, kp))) => reference::backward_at(q, k, v, g, qp, kp, params)?,
        (None, None) => reference::forward(q, k, v, params)?,
        (None, Some((qp, kp))) => reference::forward_at(q, k, v, qp, kp, params)?,
    };
    let naive = reference::naive_rounded(q, k, v, d_o, positions, params, q.dtype())?;
    Ok(report(q.dtype(), fwd, grads, &oracle, &naive, &Tolerance::default()))
}

/// Checks the rows `rows` of a single-device result (`o`, `lse`, and `dq` when `d_o` and
/// `grads` are given) against the oracle computed for those rows only, under the default
/// rule: the spot check for sequences too long for a full oracle.
///
/// # Errors
/// As [`reference::rows`]; [`Error::ShapeMismatch`] when `fwd` or `grads` do not have the
/// shapes of q (`o`, `dq`) and `[b, h_q, s_q]` (`lse`).
#[allow(clippy::too_many_arguments)]
pub fn check_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &AttentionParams,
    fwd: &cpu::ForwardOutput,
    grads: Option<&cpu::Gradients>,
    rows: &[usize],
) -> Result<Report> {
    let dtype = q.dtype();
    let (oracle, naive) = reference::rows_and_naive(q, k, v, d_o, params, rows)?;
    let dims = crate::Dims::of(q, k, v)?;
    let lse_shape = [dims.b, dims.h_q, dims.s_q];
    let o_shape = dims.o_shape();
    let given = [
        ("o", fwd.o.shape(), &o_shape[..]),
        ("dq", grads.map_or(q.shape(), |g| g.dq.shape()), q.shape()),
        ("lse", fwd.lse.shape(), &lse_shape[..]),
    ];
    for (name, shape, want) in given {
        if shape != want {
            return Err(Error::ShapeMismatch(format!("check_rows: `{name}` has shape {shape:?}, expected {want:?}")));
        }
    }
    let pick = |t: &Tensor, d: usize| select_rows(t, dims.b, dims.s_q, dims.h_q * d, rows);
    let lse = fwd.lse.as_f32();
    let lse_rows: Vec<f32> = (0..dims.b * dims.h_q)
        .flat_map(|bh| rows.iter().map(move |&r| (bh, r)))
        .map(|(bh, r)| lse[bh * dims.s_q + r])
        .collect();
    let tol = Tolerance::default();
    let mut out = vec![
        compare("o", &pick(&fwd.o, dims.d_v)?, &oracle.o, &naive.o, &oracle.o_mag, &[], dtype, &tol),
        compare_lse(&lse_rows, &oracle.lse, &naive.lse, &oracle.lse_mag, &tol),
    ];
    if let (Some(g), Some(_)) = (grads, d_o) {
        out.push(compare(
            "dq",
            &pick(&g.dq, dims.d_qk)?,
            &oracle.dq,
            &naive.dq,
            &oracle.dq_mag,
            &oracle.dq_mag_o,
            dtype,
            &tol,
        ));
    }
    Ok(Report { dtype: dtype.to_string(), rows: out })
}

/// Rows `rows` of a `[b, s, width]` tensor, as `[b, rows.len(), width]` f32 values (the rows
/// gathered in the tensor's dtype, then widened: no full-size copy).
fn select_rows(x: &Tensor, b: usize, s: usize, width: usize, rows: &[usize]) -> Result<Vec<f32>> {
    let at = (0..b).flat_map(|bi| rows.iter().map(move |&r| bi * s + r));
    Ok(x.gather_rows(vec![b * rows.len() * width], width, at)?.as_f32().into_owned())
}
