//! Merging partial attention results computed over disjoint key sets.
//!
//! With `(o_a, lse_a)` over keys A and `(o_b, lse_b)` over keys B (A ∩ B = ∅), attention over
//! A ∪ B is `lse = log(e^lse_a + e^lse_b)` and `o = e^(lse_a − lse) o_a + e^(lse_b − lse) o_b`.
//! Computed as `m = max(lse_a, lse_b)`, `lse = m + log(e^(lse_a−m) + e^(lse_b−m))`, which is
//! stable for any magnitudes; a side with `lse = -inf` (no visible key) contributes nothing,
//! and two such sides give `lse = -inf`, `o = 0`.

use crate::{Error, Result, Tensor};

/// Merges `(o_b, lse_b)` into the accumulator `(o_a, lse_a)` in place, all f32.
/// `o` layout `[b, s, h, d]`, `lse` layout `[b, h, s]` (`rows = b·s·h` rows of `d`).
///
/// # Errors
/// [`Error::ShapeMismatch`] when the buffer lengths disagree with `(b, s, h, d)`.
///
/// ```
/// use ringattn::merge::merge_into;
/// // Two halves of the keys, each with one key of value 1.0 and 3.0 and equal score.
/// let (mut o, mut lse) = (vec![1.0f32], vec![0.0f32]);
/// merge_into(&mut o, &mut lse, &[3.0], &[0.0], [1, 1, 1, 1])?;
/// assert_eq!(o[0], 2.0);
/// assert!((lse[0] - 2f32.ln()).abs() < 1e-7);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn merge_into(o_a: &mut [f32], lse_a: &mut [f32], o_b: &[f32], lse_b: &[f32], bshd: [usize; 4]) -> Result<()> {
    check_lengths(o_a, lse_a, o_b, lse_b, bshd)?;
    let [b, s, h, d] = bshd;
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                let li = (bi * h + hi) * s + si;
                let (la, lb) = (lse_a[li], lse_b[li]);
                let m = la.max(lb);
                let at = ((bi * s + si) * h + hi) * d;
                let oa = &mut o_a[at..at + d];
                if m == f32::NEG_INFINITY {
                    oa.fill(0.0);
                    continue;
                }
                let (wa, wb) = ((la - m).exp(), (lb - m).exp());
                let sum = wa + wb;
                let (ca, cb) = (wa / sum, wb / sum);
                for (x, &y) in oa.iter_mut().zip(&o_b[at..at + d]) {
                    // A side with weight exactly 0 must not inject NaN from its (unused) values.
                    *x = if cb == 0.0 {
                        *x
                    } else if ca == 0.0 {
                        y
                    } else {
                        ca * *x + cb * y
                    };
                }
                lse_a[li] = m + sum.ln();
            }
        }
    }
    Ok(())
}

/// Merges attention sinks into a finished result: each row of head `hi` joins a value-less
/// partial of LSE `sinks[hi]` — `lse = log(e^lse + e^σ)`, `o = e^(lse_old − lse) o` (a row
/// that saw no key gets `o = 0`, `lse = σ`). All f32; `o` `[b, s, h, d]`, `lse` `[b, h, s]`,
/// `sinks` `[h]` (the logits of the result's heads, in its order). The same arithmetic as
/// the merge kernel's sink mode (`cuda/merge.cu`, `ringattn_merge_sinks_f32`).
///
/// # Errors
/// [`Error::ShapeMismatch`] when a length disagrees with `bshd`.
///
/// ```
/// use ringattn::merge::merge_sinks;
/// // One key of value 2.0 and score 0 beside a sink of logit 0: half the weight each.
/// let (mut o, mut lse) = (vec![2.0f32], vec![0.0f32]);
/// merge_sinks(&mut o, &mut lse, &[0.0], [1, 1, 1, 1])?;
/// assert_eq!(o[0], 1.0);
/// assert!((lse[0] - 2f32.ln()).abs() < 1e-7);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn merge_sinks(o: &mut [f32], lse: &mut [f32], sinks: &[f32], bshd: [usize; 4]) -> Result<()> {
    check_merge_sinks(o.len(), lse.len(), sinks.len(), bshd)?;
    let [b, s, h, d] = bshd;
    for bi in 0..b {
        for (hi, &sigma) in sinks.iter().enumerate() {
            for si in 0..s {
                let li = (bi * h + hi) * s + si;
                let la = lse[li];
                let m = la.max(sigma);
                let (wa, wb) = ((la - m).exp(), (sigma - m).exp());
                let sum = wa + wb;
                let ca = wa / sum;
                let at = ((bi * s + si) * h + hi) * d;
                // (A row that saw no key has weight 0: its o, zero already, stays 0.)
                o[at..at + d].iter_mut().for_each(|x| *x = if ca == 0.0 { 0.0 } else { ca * *x });
                lse[li] = m + sum.ln();
            }
        }
    }
    Ok(())
}

/// The sinks' gradient over the rows of a finished result: `dσ_h = −Σ_{b, i} e^{σ_h −
/// lse_bhi} · D_bhi` for each head `h` (f32 `[h]`, summed in f64), from the final `lse`
/// (the sinks included) and `delta` (`D = rowsum(dO∘O)`), both `[b, h, s]` f32. The same
/// sum as the merge family's `ringattn_sink_grad_f32` (there in f32, by blocks).
///
/// # Errors
/// [`Error::ShapeMismatch`] when a length disagrees with `bhs`.
///
/// ```
/// use ringattn::merge::sink_grad;
/// // One row whose lse equals the sink's logit: e^0 · D = D, negated.
/// let ds = sink_grad(&[0.5], &[2.0], &[0.5], [1, 1, 1])?;
/// assert_eq!(ds, vec![-2.0]);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn sink_grad(lse: &[f32], delta: &[f32], sinks: &[f32], bhs: [usize; 3]) -> Result<Vec<f32>> {
    check_sink_grad(lse.len(), delta.len(), sinks.len(), bhs)?;
    let [b, h, s] = bhs;
    Ok(sinks
        .iter()
        .enumerate()
        .map(|(hi, &sigma)| {
            let mut sum = 0.0f64;
            for bi in 0..b {
                let at = (bi * h + hi) * s;
                for (&l, &dl) in lse[at..at + s].iter().zip(&delta[at..at + s]) {
                    sum += (f64::from(sigma) - f64::from(l)).exp() * f64::from(dl);
                }
            }
            -sum as f32
        })
        .collect())
}

/// The whole sequence's sinks gradient from the ranks' (each over its own rows): their sum
/// (what a gradient all-reduce gives), in f32 `[h_q]`; `None` when the ranks hold none.
///
/// # Errors
/// [`Error::ShapeMismatch`] when some ranks hold one and others not, or their lengths differ.
pub fn sum_dsinks<'a>(parts: impl Iterator<Item = Option<&'a Tensor>>) -> Result<Option<Tensor>> {
    let parts: Vec<Option<&Tensor>> = parts.collect();
    if parts.iter().all(Option::is_none) {
        return Ok(None);
    }
    let mut sum: Vec<f64> = Vec::new();
    for (r, part) in parts.iter().enumerate() {
        let Some(t) = part else {
            return Err(Error::ShapeMismatch(format!("rank {r} returned no sinks gradient beside ranks that did")));
        };
        let v = t.as_f32();
        if sum.is_empty() {
            sum = vec![0.0; v.len()];
        }
        if v.len() != sum.len() {
            return Err(Error::ShapeMismatch(format!(
                "rank {r}'s sinks gradient holds {} values, not {}",
                v.len(),
                sum.len()
            )));
        }
        sum.iter_mut().zip(v.iter()).for_each(|(s, &x)| *s += f64::from(x));
    }
    let n = sum.len();
    Tensor::from_f32(vec![n], sum.into_iter().map(|x| x as f32).collect()).map(Some)
}

/// The sinks of `params` merged into a single-device (or block) call's finished f32 result
/// (`o` `[b, s_q, h_q, d_v]`, `lse` `[b, h_q, s_q]`), before the output's rounding: what
/// the tensor-level entry points of every backend run after their kernels (which checked
/// the sinks with [`crate::AttentionParams::check_heads`] first). Nothing without sinks.
///
/// # Errors
/// As [`merge_sinks`].
pub(crate) fn finish_with_sinks(
    params: &crate::AttentionParams,
    dims: &crate::Dims,
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    match &params.sinks {
        Some(sinks) => merge_sinks(o, lse, sinks, [dims.b, dims.s_q, dims.h_q, dims.d_v]),
        None => Ok(()),
    }
}

/// The sinks' gradient `[h_q]` f32 of a single-device (or block) call from its final `o`,
/// `lse` (sinks included) and `d_o` (`D = rowsum(dO∘O)` in f32); `None` without sinks (the
/// entry points checked them with [`crate::AttentionParams::check_heads`]).
///
/// # Errors
/// As [`sink_grad`].
pub(crate) fn sinks_grad_of(
    params: &crate::AttentionParams,
    dims: &crate::Dims,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
) -> Result<Option<Tensor>> {
    let Some(sinks) = &params.sinks else { return Ok(None) };
    let delta = crate::cpu::softmax_grad_rowsum(*dims, &o.as_f32(), &d_o.as_f32());
    let ds = sink_grad(&lse.as_f32(), &delta, sinks, [dims.b, dims.h_q, dims.s_q])?;
    Tensor::from_f32(vec![dims.h_q], ds).map(Some)
}

/// Checks the lengths of [`merge_sinks`]' buffers (`o`, `lse`, `sinks`) against `bshd`.
pub(crate) fn check_merge_sinks(o: usize, lse: usize, sinks: usize, bshd: [usize; 4]) -> Result<()> {
    let [b, s, h, d] = bshd;
    check_sink_lengths(&[("o", o, b * s * h * d), ("lse", lse, b * h * s), ("sinks", sinks, h)])
}

/// Checks the lengths of [`sink_grad`]'s buffers (`lse`, `delta`, `sinks`) against `bhs`.
pub(crate) fn check_sink_grad(lse: usize, delta: usize, sinks: usize, bhs: [usize; 3]) -> Result<()> {
    let [b, h, s] = bhs;
    check_sink_lengths(&[("lse", lse, b * h * s), ("delta", delta, b * h * s), ("sinks", sinks, h)])
}

fn check_sink_lengths(buffers: &[(&str, usize, usize)]) -> Result<()> {
    match buffers.iter().find(|(_, len, want)| len != want) {
        Some((name, len, want)) => {
            Err(Error::ShapeMismatch(format!("sinks: `{name}` holds {len} values, expected {want}")))
        }
        None => Ok(()),
    }
}

/// Checks that the four merge buffers fit `[b, s, h, d]` (o) and `[b, h, s]` (lse).
pub(crate) fn check_lengths(o_a: &[f32], lse_a: &[f32], o_b: &[f32], lse_b: &[f32], bshd: [usize; 4]) -> Result<()> {
    let [b, s, h, d] = bshd;
    let n = b * s * h;
    for (name, len, want) in
        [("o_a", o_a.len(), n * d), ("o_b", o_b.len(), n * d), ("lse_a", lse_a.len(), n), ("lse_b", lse_b.len(), n)]
    {
        if len != want {
            return Err(Error::ShapeMismatch(format!("merge: `{name}` holds {len} values, expected {want}")));
        }
    }
    Ok(())
}

/// Merges two forward results over disjoint key sets into the exact result over their union,
/// in f32 (the output keeps `o_a`'s dtype).
///
/// # Errors
/// [`Error::ShapeMismatch`] or [`Error::DtypeMismatch`] when the parts disagree.
pub fn merge(a: &crate::cpu::ForwardOutput, b: &crate::cpu::ForwardOutput) -> Result<crate::cpu::ForwardOutput> {
    let shape = a.o.shape().to_vec();
    if shape.len() != 4 || b.o.shape() != shape.as_slice() || a.lse.shape() != b.lse.shape() {
        return Err(Error::ShapeMismatch(format!(
            "merge: o {:?} / {:?}, lse {:?} / {:?}",
            a.o.shape(),
            b.o.shape(),
            a.lse.shape(),
            b.lse.shape()
        )));
    }
    if a.o.dtype() != b.o.dtype() {
        return Err(Error::DtypeMismatch {
            name: "o".into(),
            got: b.o.dtype().to_string(),
            expected: a.o.dtype().to_string(),
        });
    }
    let mut o = a.o.to_f32_vec();
    let mut lse = a.lse.to_f32_vec();
    merge_into(&mut o, &mut lse, &b.o.as_f32(), &b.lse.as_f32(), [shape[0], shape[1], shape[2], shape[3]])?;
    Ok(crate::cpu::ForwardOutput {
        o: Tensor::from_f32_owned(shape, o, a.o.dtype())?,
        lse: Tensor::from_f32(a.lse.shape().to_vec(), lse)?,
    })
}
