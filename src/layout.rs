//! How one sequence is split across ranks: contiguous, zigzag, striped and work-balanced
//! shards of any length (no padding, no truncation), with the global positions of each rank's
//! tokens.

use std::borrow::Borrow;

use crate::{AttentionParams, Error, Positions, Result, Segment, Tensor};

/// A sequence layout over `world` ranks.
///
/// * `Contiguous`: rank `r` holds tokens `[r·s/P, (r+1)·s/P)`.
/// * `Zigzag`: the sequence is cut into `2P` chunks (`[i·s/2P, (i+1)·s/2P)`); rank `r` holds
///   chunks `r` and `2P−1−r`, which balances causal work.
/// * `Striped`: token `t` lives on rank `t mod P`.
/// * `Balanced`: chunks of the sequence placed by the dispatch solver ([`crate::dispatch`]) so
///   that every rank has the same number of tokens and of visible (query, key) pairs under the
///   call's mask and packed documents; it depends on them, so its positions come from
///   [`Layout::positions_for`] (or a plan's [`crate::parallel::ResolvedParams`]).
///
/// ```
/// use ringattn::Layout;
/// assert_eq!(Layout::Zigzag.positions(10, 2, 0)?.to_vec(), vec![0, 1, 7, 8, 9]);
/// assert_eq!(Layout::Striped.positions(10, 4, 1)?.to_vec(), vec![1, 5, 9]);
/// assert_eq!(Layout::Contiguous.positions(10, 3, 2)?.to_vec(), vec![6, 7, 8, 9]);
/// assert!(Layout::Balanced.positions(10, 2, 0).is_err()); // needs the mask and documents
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Layout {
    /// One contiguous run per rank.
    #[default]
    Contiguous,
    /// Chunks `r` and `2P−1−r` of `2P`.
    Zigzag,
    /// Token `t` on rank `t mod P`.
    Striped,
    /// Chunks balanced by visible pairs under the mask and documents ([`crate::dispatch`]).
    Balanced,
}

impl Layout {
    /// Global positions of the tokens of `rank` among `world` ranks for a sequence of `s`
    /// tokens, in the order the rank stores them.
    ///
    /// # Errors
    /// [`Error::Parallel`] for [`Layout::Balanced`], whose positions depend on the mask and
    /// documents ([`Layout::positions_for`]).
    pub fn positions(&self, s: usize, world: usize, rank: usize) -> Result<Positions> {
        let p = world.max(1);
        let cut = |i: usize, parts: usize| i * s / parts;
        let run = |a: usize, b: usize| Segment { start: a as i64, stride: 1, len: b - a };
        let segs = match self {
            Layout::Contiguous => vec![run(cut(rank, p), cut(rank + 1, p))],
            Layout::Zigzag => {
                let (a, b) = (rank, 2 * p - 1 - rank);
                vec![run(cut(a, 2 * p), cut(a + 1, 2 * p)), run(cut(b, 2 * p), cut(b + 1, 2 * p))]
            }
            Layout::Striped => {
                vec![Segment { start: rank as i64, stride: p as i64, len: s.saturating_sub(rank).div_ceil(p) }]
            }
            Layout::Balanced => {
                return Err(Error::Parallel(
                    "the balanced layout depends on the mask and documents: take its positions from \
                     Layout::positions_for or a plan's ResolvedParams"
                        .into(),
                ))
            }
        };
        Positions::from_segments(segs.into_iter().filter(|g| g.len > 0).collect())
    }

    /// Every rank's positions (indexed by rank) for a sequence of `s` tokens under `attention`'s
    /// mask and documents: [`Layout::positions`] for the fixed layouts, the dispatch solver's
    /// balanced chunks ([`crate::dispatch::balance`], default chunk) for `Balanced`.
    ///
    /// ```
    /// use ringattn::{AttentionParams, Documents, Layout, Mask};
    /// let attention = AttentionParams { mask: Mask::Causal, documents: Some(Documents::new(vec![600, 200, 200])?), ..Default::default() };
    /// let pos = Layout::Balanced.positions_for(&attention, 1000, 2)?;
    /// let work = ringattn::flops::pairs_of_positions(&attention, 1000, &pos)?;
    /// assert!(ringattn::dispatch::imbalance(&work) <= 1.05);
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Documents`] when the documents do not cover exactly `s` tokens (balanced).
    pub fn positions_for(&self, attention: &AttentionParams, s: usize, world: usize) -> Result<Vec<Positions>> {
        match self {
            Layout::Balanced => Ok(crate::dispatch::balance(attention, s, world.max(1), 0)?.positions),
            fixed => (0..world.max(1)).map(|r| fixed.positions(s, world, r)).collect(),
        }
    }

    /// The rows of `t` (`[b, s, h, d]`) that `rank` holds.
    ///
    /// # Errors
    /// [`Error::Rank`] when `t` is not 4-dimensional; [`Error::Parallel`] for
    /// [`Layout::Balanced`] (shard by a plan's positions: [`Layout::shard_rows`]).
    pub fn shard(&self, t: &Tensor, world: usize, rank: usize) -> Result<Tensor> {
        let s = dims4(t)?[1];
        Self::shard_rows(t, &self.positions(s, world, rank)?)
    }

    /// The rows of `t` (`[b, s, h, d]`) at `positions` (each in `0..s`), in that order.
    ///
    /// # Errors
    /// [`Error::Rank`] when `t` is not 4-dimensional, [`Error::Positions`] for a position
    /// outside the sequence.
    pub fn shard_rows(t: &Tensor, positions: &Positions) -> Result<Tensor> {
        let [b, s, h, d] = dims4(t)?;
        let pos = positions.to_vec();
        if let Some(p) = pos.iter().find(|&&p| p < 0 || p as usize >= s) {
            return Err(Error::Positions(format!("position {p} is outside a sequence of {s} tokens")));
        }
        let rows = (0..b).flat_map(|bi| pos.iter().map(move |&p| bi * s + p as usize));
        t.gather_rows(vec![b, pos.len(), h, d], h * d, rows)
    }

    /// Reassembles shards (indexed by rank) into the full `[b, s, h, d]` sequence.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shards do not fit the layout; [`Error::Parallel`] for
    /// [`Layout::Balanced`] ([`Layout::unshard_rows`] with the plan's positions).
    pub fn unshard(&self, shards: &[Tensor]) -> Result<Tensor> {
        let s: usize = shards.iter().map(|t| t.shape().get(1).copied().unwrap_or(0)).sum();
        let pos: Vec<Positions> =
            (0..shards.len()).map(|r| self.positions(s, shards.len(), r)).collect::<Result<_>>()?;
        Self::unshard_rows(shards, &pos)
    }

    /// Reassembles shards holding the rows at `positions[r]` into the full sequence.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shards do not fit the positions.
    pub fn unshard_rows<T: Borrow<Tensor>>(shards: &[T], positions: &[Positions]) -> Result<Tensor> {
        let first =
            shards.first().map(Borrow::borrow).ok_or_else(|| Error::InvalidArgument("unshard: no shards".into()))?;
        let [b, _, h, d] = dims4(first)?;
        let s: usize = shards.iter().map(|t| t.borrow().shape().get(1).copied().unwrap_or(0)).sum();
        let mut out = Tensor::zeros(vec![b, s, h, d], first.dtype());
        for (r, t) in shards.iter().map(Borrow::borrow).enumerate() {
            let pos = positions[r].to_vec();
            if pos.iter().any(|&p| p < 0 || p as usize >= s) {
                return Err(Error::ShapeMismatch(format!("unshard: rank {r} holds positions outside 0..{s}")));
            }
            if t.shape() != [b, pos.len(), h, d] {
                return Err(Error::ShapeMismatch(format!(
                    "unshard: rank {r} holds {:?}, the layout gives [{b}, {}, {h}, {d}]",
                    t.shape(),
                    pos.len()
                )));
            }
            out.scatter_rows(t, h * d, (0..b).flat_map(|bi| pos.iter().map(move |&p| bi * s + p as usize)));
        }
        Ok(out)
    }

    /// Reassembles per-rank LSE shards (`[b, h, s_r]`) into `[b, h, s]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shards do not fit the layout; [`Error::Parallel`] for
    /// [`Layout::Balanced`].
    pub fn unshard_lse(&self, shards: &[Tensor]) -> Result<Tensor> {
        let s: usize = shards.iter().map(|t| t.shape().get(2).copied().unwrap_or(0)).sum();
        let pos: Vec<Positions> =
            (0..shards.len()).map(|r| self.positions(s, shards.len(), r)).collect::<Result<_>>()?;
        Self::unshard_lse_rows(shards, &pos)
    }

    /// Reassembles LSE shards `[b, h, n_r]` holding `positions[r]` into `[b, h, s]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shards do not fit the positions.
    pub fn unshard_lse_rows<T: Borrow<Tensor>>(shards: &[T], positions: &[Positions]) -> Result<Tensor> {
        let first =
            shards.first().map(Borrow::borrow).ok_or_else(|| Error::InvalidArgument("unshard: no shards".into()))?;
        let [b, h] = match first.shape() {
            [b, h, _] => [*b, *h],
            other => return Err(Error::ShapeMismatch(format!("lse shard has shape {other:?}"))),
        };
        let s: usize = shards.iter().map(|t| t.borrow().shape().get(2).copied().unwrap_or(0)).sum();
        let mut out = vec![f32::NEG_INFINITY; b * h * s];
        for (r, t) in shards.iter().map(Borrow::borrow).enumerate() {
            let pos = positions[r].to_vec();
            if pos.iter().any(|&p| p < 0 || p as usize >= s) {
                return Err(Error::ShapeMismatch(format!("unshard: rank {r} holds positions outside 0..{s}")));
            }
            if t.shape() != [b, h, pos.len()] {
                return Err(Error::ShapeMismatch(format!("unshard: lse of rank {r} has shape {:?}", t.shape())));
            }
            let x = t.as_f32();
            for bh in 0..b * h {
                for (i, &p) in pos.iter().enumerate() {
                    out[bh * s + p as usize] = x[bh * pos.len() + i];
                }
            }
        }
        Tensor::from_f32(vec![b, h, s], out)
    }
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "contiguous" => Ok(Layout::Contiguous),
            "zigzag" => Ok(Layout::Zigzag),
            "striped" => Ok(Layout::Striped),
            "balanced" => Ok(Layout::Balanced),
            other => {
                Err(Error::InvalidArgument(format!("unknown layout `{other}` (contiguous, zigzag, striped, balanced)")))
            }
        }
    }
}

fn dims4(t: &Tensor) -> Result<[usize; 4]> {
    t.shape().try_into().map_err(|_| Error::Rank {
        name: "tensor",
        expected: 4,
        layout: "[b, s, h, d]",
        shape: t.shape().to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{random, DType};

    /// Shards hold the rows at their positions in the tensor's own dtype (no rounding
    /// through another type), and unsharding gives the tensor back bit for bit.
    #[test]
    fn shards_keep_the_dtype_and_unshard_restores_the_tensor() {
        let (b, s, h, d) = (2, 13, 3, 4);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = random::randn(vec![b, s, h, d], 7, dtype);
            let x = t.as_f32();
            for layout in [Layout::Contiguous, Layout::Zigzag, Layout::Striped] {
                let world = 3;
                let shards: Vec<Tensor> = (0..world).map(|r| layout.shard(&t, world, r).unwrap()).collect();
                for (r, shard) in shards.iter().enumerate() {
                    let pos = layout.positions(s, world, r).unwrap().to_vec();
                    assert_eq!(shard.dtype(), dtype);
                    assert_eq!(shard.shape(), [b, pos.len(), h, d]);
                    let want: Vec<f32> = (0..b)
                        .flat_map(|bi| pos.iter().flat_map(move |&p| (0..h * d).map(move |c| (bi, p as usize, c))))
                        .map(|(bi, p, c)| x[(bi * s + p) * h * d + c])
                        .collect();
                    assert_eq!(shard.to_f32_vec(), want, "{layout:?} rank {r} {dtype}");
                }
                assert_eq!(layout.unshard(&shards).unwrap(), t, "{layout:?} {dtype}");
            }
        }
        // Shards of mixed dtypes are assembled in the first shard's dtype.
        let t = random::randn(vec![1, 8, 1, 2], 3, DType::BF16);
        let mut shards: Vec<Tensor> = (0..2).map(|r| Layout::Zigzag.shard(&t, 2, r).unwrap()).collect();
        shards[1] = shards[1].to_dtype(DType::F32);
        assert_eq!(Layout::Zigzag.unshard(&shards).unwrap(), t);
    }
}
