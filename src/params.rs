//! Attention parameters, shape validation, and the resolved visibility of a call.

use crate::{Documents, Error, Mask, Positions, Result, Tensor};

/// Largest head dimension the CPU implementation and the oracle accept.
pub const MAX_HEAD_DIM: usize = 512;

/// Options of an attention call. `Default` is no mask, no documents, scale `1/sqrt(d_qk)`,
/// no soft-cap, no sinks.
///
/// ```
/// use ringattn::{AttentionParams, Mask};
/// let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// assert_eq!(p.softmax_scale(64), 0.125);
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttentionParams {
    /// Positional mask, evaluated on global positions.
    pub mask: Mask,
    /// Packed documents (lengths summing to the global sequence length), if any.
    pub documents: Option<Documents>,
    /// Softmax scale; `None` means `1/sqrt(d_qk)` (the query/key head dim).
    pub scale: Option<f32>,
    /// Tanh soft-capping of the scaled scores (Gemma 2, Grok-1): with `cap = Some(c)`, a
    /// score `s = scale · q·k` enters the softmax as `c · tanh(s / c)`, before the mask.
    /// `c` must be finite and positive ([`crate::Error::ScoreOption`] otherwise); `None`
    /// leaves the scores as they are.
    pub softcap: Option<f32>,
    /// Learnable attention sinks (gpt-oss): one logit `σ_h` per query head (`h_q` values, in
    /// the units of the scaled scores) that joins each row's softmax denominator without a
    /// value: `o_i = Σ_j e^{s_ij} v_j / (e^{σ_h} + Σ_j e^{s_ij})`, and the LSE includes it
    /// (`lse_i = log(e^{σ_h} + Σ_j e^{s_ij})`; a row that sees no key gets `o = 0`, `lse =
    /// σ_h`). It enters once per row, after every key block is merged — under every strategy
    /// (the plan's finish step), never once per hop. Its gradient, `dσ_h = −Σ_i
    /// e^{σ_h − lse_i} · D_i` with `D_i = rowsum(dO∘O)` over the rows a call holds, is
    /// returned with the other gradients ([`crate::Gradients::dsinks`]). Values must be
    /// finite and number `h_q` ([`crate::Error::ScoreOption`], [`crate::Error::ShapeMismatch`]).
    pub sinks: Option<Vec<f32>>,
}

impl AttentionParams {
    /// The scale applied to `q·k` before the softmax, for query/key head dim `d_qk`.
    pub fn softmax_scale(&self, d_qk: usize) -> f32 {
        self.scale.unwrap_or_else(|| 1.0 / (d_qk.max(1) as f32).sqrt())
    }

    /// Checks the score options (the scale and those of [`crate::attention::ScoreSpec`]):
    /// what every call's resolution runs (`Visibility::new`), and the CLI as it parses them.
    ///
    /// # Errors
    /// [`Error::Scale`] for a scale that is not finite, [`Error::ScoreOption`] naming an
    /// option out of its range (`softcap`: finite, above 0).
    ///
    /// ```
    /// use ringattn::{AttentionParams, Error};
    /// let p = AttentionParams { softcap: Some(0.0), ..Default::default() };
    /// assert!(matches!(p.check_scores(), Err(Error::ScoreOption { option: "softcap", .. })));
    /// ```
    pub fn check_scores(&self) -> Result<()> {
        if let Some(s) = self.scale {
            if !s.is_finite() {
                return Err(Error::Scale(s));
            }
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::ScoreOption { option: "softcap", value: c, rule: "a finite number above 0" });
            }
        }
        if let Some(&x) = self.sinks.iter().flatten().find(|x| !x.is_finite()) {
            return Err(Error::ScoreOption { option: "sinks", value: x, rule: "finite" });
        }
        Ok(())
    }

    /// Checks the per-head options against the call's query head count `h_q`: the sinks
    /// must number `h_q` (with the checks of [`AttentionParams::check_scores`]).
    ///
    /// # Errors
    /// As [`AttentionParams::check_scores`]; [`Error::ShapeMismatch`] for sinks of another
    /// count.
    ///
    /// ```
    /// use ringattn::{AttentionParams, Error};
    /// let p = AttentionParams { sinks: Some(vec![0.5; 3]), ..Default::default() };
    /// assert!(p.check_heads(3).is_ok());
    /// assert!(matches!(p.check_heads(4), Err(Error::ShapeMismatch(_))));
    /// ```
    pub fn check_heads(&self, h_q: usize) -> Result<()> {
        self.check_scores()?;
        match &self.sinks {
            Some(s) if s.len() != h_q => Err(Error::ShapeMismatch(format!(
                "sinks holds {} values; the call has h_q = {h_q} query heads",
                s.len()
            ))),
            _ => Ok(()),
        }
    }
}

/// Dimensions of an attention call: q `[b, s_q, h_q, d_qk]`, k `[b, s_k, h_kv, d_qk]`, v
/// `[b, s_k, h_kv, d_v]`, and the output o `[b, s_q, h_q, d_v]`.
///
/// The query/key head dim `d_qk` and the value head dim `d_v` differ in multi-head latent
/// attention (MLA: DeepSeek-V3's 192 and 128); elsewhere they are equal.
///
/// ```
/// use ringattn::{DType, Dims, Tensor};
/// let q = Tensor::zeros(vec![1, 8, 4, 192], DType::F32);
/// let k = Tensor::zeros(vec![1, 8, 2, 192], DType::F32);
/// let v = Tensor::zeros(vec![1, 8, 2, 128], DType::F32);
/// let dims = Dims::of(&q, &k, &v).unwrap();
/// assert_eq!((dims.d_qk, dims.d_v), (192, 128));
/// assert_eq!(dims.o_shape(), vec![1, 8, 4, 128]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dims {
    /// Batch size.
    pub b: usize,
    /// Query rows.
    pub s_q: usize,
    /// Key rows.
    pub s_k: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads (`h_q % h_kv == 0`).
    pub h_kv: usize,
    /// Head dimension of q and k (the scores' inner dimension).
    pub d_qk: usize,
    /// Head dimension of v, o, d_o and dv.
    pub d_v: usize,
}

impl Dims {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.h_q / self.h_kv
    }

    /// The kv head used by query head `h`.
    pub fn kv_head(&self, h: usize) -> usize {
        h / self.group()
    }

    /// Whether q/k and v have the same head dim.
    pub fn equal_head_dims(&self) -> bool {
        self.d_qk == self.d_v
    }

    /// The larger of the two head dims (what a kernel's head-dim class must hold).
    pub fn d_max(&self) -> usize {
        self.d_qk.max(self.d_v)
    }

    /// Shape of q (and dq).
    pub fn q_shape(&self) -> Vec<usize> {
        vec![self.b, self.s_q, self.h_q, self.d_qk]
    }

    /// Shape of o and d_o.
    pub fn o_shape(&self) -> Vec<usize> {
        vec![self.b, self.s_q, self.h_q, self.d_v]
    }

    /// Shape of k (and dk).
    pub fn k_shape(&self) -> Vec<usize> {
        vec![self.b, self.s_k, self.h_kv, self.d_qk]
    }

    /// Shape of v (and dv).
    pub fn v_shape(&self) -> Vec<usize> {
        vec![self.b, self.s_k, self.h_kv, self.d_v]
    }

    /// Shape of the LSE.
    pub fn lse_shape(&self) -> Vec<usize> {
        vec![self.b, self.h_q, self.s_q]
    }

    /// Validates q, k, v and returns their dimensions (`d_v` is v's last dim).
    ///
    /// # Errors
    /// [`Error::Rank`], [`Error::ShapeMismatch`], [`Error::ZeroHeads`], [`Error::HeadRatio`],
    /// [`Error::HeadDim`] or [`Error::DtypeMismatch`].
    pub fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
        let qs = rank4("q", q, "[b, s_q, h_q, d_qk]")?;
        let ks = rank4("k", k, "[b, s_k, h_kv, d_qk]")?;
        let vs = rank4("v", v, "[b, s_k, h_kv, d_v]")?;
        same_dtype(q, &[("k", k), ("v", v)])?;
        if ks[..3] != vs[..3] {
            return Err(Error::ShapeMismatch(format!(
                "k has shape {ks:?} but v has {vs:?}: their [b, s_k, h_kv] must agree"
            )));
        }
        if qs[0] != ks[0] {
            return Err(Error::ShapeMismatch(format!("q has batch {} but k has {}", qs[0], ks[0])));
        }
        if qs[3] != ks[3] {
            return Err(Error::ShapeMismatch(format!("q has head dim {} but k has {}", qs[3], ks[3])));
        }
        let dims = Dims { b: qs[0], s_q: qs[1], h_q: qs[2], s_k: ks[1], h_kv: ks[2], d_qk: qs[3], d_v: vs[3] };
        dims.validate()?;
        Ok(dims)
    }

    /// Checks the head counts and head dims.
    ///
    /// # Errors
    /// [`Error::ZeroHeads`], [`Error::HeadRatio`] or [`Error::HeadDim`].
    pub fn validate(&self) -> Result<()> {
        if self.h_q == 0 {
            return Err(Error::ZeroHeads { name: "h_q" });
        }
        if self.h_kv == 0 {
            return Err(Error::ZeroHeads { name: "h_kv" });
        }
        if !self.h_q.is_multiple_of(self.h_kv) {
            return Err(Error::HeadRatio { h_q: self.h_q, h_kv: self.h_kv });
        }
        for (name, d) in [("d_qk", self.d_qk), ("d_v", self.d_v)] {
            if d == 0 || d > MAX_HEAD_DIM {
                return Err(Error::HeadDim { name, d, max: MAX_HEAD_DIM });
            }
        }
        Ok(())
    }

    /// Checks the forward results a backward takes: `o` and `d_o` `[b, s_q, h_q, d_v]` typed
    /// like `q`, `lse` f32 `[b, h_q, s_q]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] or [`Error::DtypeMismatch`] naming the tensor.
    pub fn expect_backward_inputs(&self, q: &Tensor, o: &Tensor, lse: &Tensor, d_o: &Tensor) -> Result<()> {
        Dims::expect("o", o, &self.o_shape(), q)?;
        Dims::expect("do", d_o, &self.o_shape(), q)?;
        if lse.dtype() != crate::DType::F32 {
            return Err(Error::DtypeMismatch {
                name: "lse".into(),
                got: lse.dtype().to_string(),
                expected: "F32".into(),
            });
        }
        if lse.shape() != self.lse_shape() {
            return Err(Error::ShapeMismatch(format!(
                "`lse` has shape {:?}, expected {:?}",
                lse.shape(),
                self.lse_shape()
            )));
        }
        Ok(())
    }

    /// Checks that a tensor has exactly `shape` and the dtype of `like`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] or [`Error::DtypeMismatch`].
    pub fn expect(name: &'static str, t: &Tensor, shape: &[usize], like: &Tensor) -> Result<()> {
        if t.shape() != shape {
            return Err(Error::ShapeMismatch(format!("`{name}` has shape {:?}, expected {shape:?}", t.shape())));
        }
        same_dtype(like, &[(name, t)])
    }
}

fn rank4(name: &'static str, t: &Tensor, layout: &'static str) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(t.shape()).map_err(|_| Error::Rank { name, expected: 4, layout, shape: t.shape().to_vec() })
}

fn same_dtype(like: &Tensor, others: &[(&str, &Tensor)]) -> Result<()> {
    for (name, t) in others {
        if t.dtype() != like.dtype() {
            return Err(Error::DtypeMismatch {
                name: name.to_string(),
                got: t.dtype().to_string(),
                expected: like.dtype().to_string(),
            });
        }
    }
    Ok(())
}

/// Everything needed to decide visibility of every (query row, key row) pair of one call:
/// per-row global positions and document indices, and the window bounds.
#[derive(Debug, Clone)]
pub(crate) struct Visibility {
    pub q_pos: Vec<i64>,
    pub k_pos: Vec<i64>,
    /// Document index per query / key row (`None` without documents).
    pub q_doc: Option<Vec<u32>>,
    pub k_doc: Option<Vec<u32>>,
    pub left: Option<i64>,
    pub right: Option<i64>,
}

impl Visibility {
    /// Resolves positions and documents for rows of a call.
    pub fn new(params: &AttentionParams, q_pos: &Positions, k_pos: &Positions) -> Result<Self> {
        params.check_scores()?;
        let (left, right) = params.mask.bounds();
        let q_pos = q_pos.to_vec();
        let k_pos = k_pos.to_vec();
        let (q_doc, k_doc) = match &params.documents {
            None => (None, None),
            Some(docs) => (Some(doc_ids(docs, &q_pos, "query")?), Some(doc_ids(docs, &k_pos, "key")?)),
        };
        let mut vis = Visibility { q_pos, k_pos, q_doc, k_doc, left, right };
        // A call whose every pair is visible (a ring hop wholly after its keys, one document)
        // runs unmasked: no window, no documents, so that no backend evaluates a mask.
        if vis.every_pair_visible() {
            (vis.left, vis.right, vis.q_doc, vis.k_doc) = (None, None, None, None);
        }
        Ok(vis)
    }

    /// Whether every (query, key) pair is visible: the window holds between the extreme
    /// positions, and with documents every row lies in the same one. False without rows.
    pub fn every_pair_visible(&self) -> bool {
        let extremes = |p: &[i64]| Some((*p.iter().min()?, *p.iter().max()?));
        let (Some((q_lo, q_hi)), Some((k_lo, k_hi))) = (extremes(&self.q_pos), extremes(&self.k_pos)) else {
            return false;
        };
        // Visible iff pq - left <= pk <= pq + right.
        let left_ok = self.left.is_none_or(|l| k_lo >= q_hi.saturating_sub(l));
        let right_ok = self.right.is_none_or(|r| k_hi <= q_lo.saturating_add(r));
        let one_doc = match (&self.q_doc, &self.k_doc) {
            (Some(qd), Some(kd)) => qd.iter().chain(kd).all(|&d| d == qd[0]),
            _ => true,
        };
        left_ok && right_ok && one_doc
    }

    /// For a single-device call: also checks that the documents cover exactly `s_k` tokens.
    pub fn single_device(params: &AttentionParams, s_q: usize, s_k: usize) -> Result<Self> {
        if let Some(docs) = &params.documents {
            if docs.total_len() != s_k as u64 {
                return Err(Error::Documents(format!(
                    "lengths {:?} sum to {} but the key sequence has {s_k} tokens",
                    docs.lengths(),
                    docs.total_len()
                )));
            }
        }
        let (qp, kp) = Positions::single_device(s_q, s_k);
        Self::new(params, &qp, &kp)
    }

    /// Sets `out[i] = -inf` for every query row `q0 + i` that cannot see key row `j`
    /// (one column of a column-major score tile).
    #[inline]
    pub fn mask_key_column(&self, out: &mut [f32], q0: usize, j: usize) {
        let pk = self.k_pos[j];
        // visible iff pk - right <= pq <= pk + left
        let lo = self.right.map_or(i64::MIN, |r| pk.saturating_sub(r));
        let hi = self.left.map_or(i64::MAX, |l| pk.saturating_add(l));
        let qp = &self.q_pos[q0..q0 + out.len()];
        match (&self.q_doc, &self.k_doc) {
            (Some(qd), Some(kd)) => {
                let kd = kd[j];
                for ((o, &p), &dq) in out.iter_mut().zip(qp).zip(&qd[q0..]) {
                    if !(p >= lo && p <= hi && dq == kd) {
                        *o = f32::NEG_INFINITY;
                    }
                }
            }
            _ => {
                for (o, &p) in out.iter_mut().zip(qp) {
                    if !(p >= lo && p <= hi) {
                        *o = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Sets `out[j] = -inf` for every key row `k0 + j` that query row `i` cannot see
    /// (one row of a row-major score tile). Always inlined, so that callers compiled for
    /// wider vectors (`cpu::tiles::mask_rows`) vectorise its comparisons.
    #[inline(always)]
    pub fn mask_query_row(&self, out: &mut [f32], i: usize, k0: usize) {
        let pq = self.q_pos[i];
        // visible iff pq - left <= pk <= pq + right
        let lo = self.left.map_or(i64::MIN, |l| pq.saturating_sub(l));
        let hi = self.right.map_or(i64::MAX, |r| pq.saturating_add(r));
        let kp = &self.k_pos[k0..k0 + out.len()];
        match (&self.q_doc, &self.k_doc) {
            (Some(qd), Some(kd)) => {
                let qd = qd[i];
                for ((o, &p), &dk) in out.iter_mut().zip(kp).zip(&kd[k0..]) {
                    if !(p >= lo && p <= hi && dk == qd) {
                        *o = f32::NEG_INFINITY;
                    }
                }
            }
            _ => {
                for (o, &p) in out.iter_mut().zip(kp) {
                    if !(p >= lo && p <= hi) {
                        *o = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Whether key row `j` is visible to query row `i`.
    #[inline]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let (pq, pk) = (self.q_pos[i], self.k_pos[j]);
        self.left.is_none_or(|l| pk >= pq - l)
            && self.right.is_none_or(|r| pk <= pq + r)
            && match (&self.q_doc, &self.k_doc) {
                (Some(a), Some(b)) => a[i] == b[j],
                _ => true,
            }
    }
}

fn doc_ids(docs: &Documents, pos: &[i64], side: &str) -> Result<Vec<u32>> {
    pos.iter()
        .map(|&p| {
            docs.document_of(p).map(|d| d as u32).ok_or_else(|| {
                Error::Documents(format!(
                    "{side} position {p} lies outside the documents, which cover 0..{}",
                    docs.total_len()
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Documents, Mask};

    fn causal() -> AttentionParams {
        AttentionParams { mask: Mask::Causal, ..Default::default() }
    }

    #[test]
    fn a_call_whose_every_pair_is_visible_runs_unmasked() {
        // A ring hop whose keys all precede its queries: no window left to evaluate.
        let v = Visibility::new(&causal(), &Positions::contiguous(100, 20), &Positions::contiguous(40, 60)).unwrap();
        assert_eq!((v.left, v.right), (None, None));
        // The last key at the first query's position: still every pair.
        let v = Visibility::new(&causal(), &Positions::contiguous(100, 20), &Positions::contiguous(41, 60)).unwrap();
        assert_eq!((v.left, v.right), (None, None));
        // One key after the first query: the mask stays.
        let v = Visibility::new(&causal(), &Positions::contiguous(100, 20), &Positions::contiguous(42, 60)).unwrap();
        assert_eq!((v.left, v.right), (None, Some(0)));
        // A window: the farthest pair decides.
        let w = AttentionParams { mask: Mask::Window { left: Some(30), right: Some(0) }, ..Default::default() };
        let v = Visibility::new(&w, &Positions::contiguous(100, 10), &Positions::contiguous(79, 21)).unwrap();
        assert_eq!((v.left, v.right), (None, None));
        let v = Visibility::new(&w, &Positions::contiguous(100, 10), &Positions::contiguous(78, 21)).unwrap();
        assert_eq!((v.left, v.right), (Some(30), Some(0)));
        // Documents: dropped only when every row lies in one.
        let docs = Documents::new(vec![50, 150]).unwrap();
        let p = AttentionParams { documents: Some(docs), ..causal() };
        let v = Visibility::new(&p, &Positions::contiguous(120, 20), &Positions::contiguous(60, 50)).unwrap();
        assert!(v.q_doc.is_none() && v.k_doc.is_none() && v.right.is_none());
        let v = Visibility::new(&p, &Positions::contiguous(120, 20), &Positions::contiguous(40, 50)).unwrap();
        assert!(v.q_doc.is_some() && v.k_doc.is_some() && v.right == Some(0));
        // No rows: nothing to decide.
        let v = Visibility::new(&causal(), &Positions::contiguous(0, 0), &Positions::contiguous(0, 5)).unwrap();
        assert_eq!(v.right, Some(0));
    }
}
