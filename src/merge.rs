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
