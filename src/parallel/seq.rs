//! Moving rows and heads between `[b, s, h, d]` buffers of any element type.

pub(crate) use super::backend::BufShape as Shape;

/// Concatenates along the sequence axis buffers of shapes `[b, n_i, h, d]`.
pub(crate) fn concat_seq<T: Copy>(parts: &[&[T]], b: usize, w: usize) -> Vec<T> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(total);
    for bi in 0..b {
        for p in parts {
            let n = p.len() / (b * w).max(1);
            out.extend_from_slice(&p[bi * n * w..(bi + 1) * n * w]);
        }
    }
    out
}

/// Rows `[r0, r0 + n)` along the sequence axis of a `[b, s, w]` buffer.
pub(crate) fn seq_slice<T: Copy>(x: &[T], b: usize, s: usize, w: usize, r0: usize, n: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(b * n * w);
    for bi in 0..b {
        out.extend_from_slice(&x[(bi * s + r0) * w..(bi * s + r0 + n) * w]);
    }
    out
}

/// The heads `heads` (in that order) of a `[b, n, h, d]` buffer, as `[b, n, heads.len(), d]`.
pub(crate) fn select_heads<T: Copy>(x: &[T], sh: Shape, heads: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(sh.b * sh.n * heads.len() * sh.d);
    for bn in 0..sh.b * sh.n {
        for &h in heads {
            out.extend_from_slice(&x[(bn * sh.h + h) * sh.d..][..sh.d]);
        }
    }
    out
}

/// Combines (`op(dst, src)` per element: an assignment, or an addition) `[b, n,
/// heads.len(), d]` into the heads `heads` of a `[b, n, h, d]` buffer.
pub(crate) fn scatter_heads<T: Copy>(dst: &mut [T], sh: Shape, heads: &[usize], src: &[T], op: impl Fn(&mut T, T)) {
    let k = heads.len();
    for bn in 0..sh.b * sh.n {
        for (i, &h) in heads.iter().enumerate() {
            let d = &mut dst[(bn * sh.h + h) * sh.d..][..sh.d];
            let s = &src[(bn * k + i) * sh.d..][..sh.d];
            d.iter_mut().zip(s).for_each(|(a, &b)| op(a, b));
        }
    }
}
