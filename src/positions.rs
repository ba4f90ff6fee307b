//! Global token positions of a block of queries or keys.
//!
//! A block of rows (queries or keys) may come from anywhere in the global sequence. Its
//! positions are a list of `(start, stride, len)` segments, concatenated in order: a
//! contiguous shard is one segment of stride 1, a striped shard (token `t` on rank
//! `t mod P`) one segment of stride `P`, a zigzag shard two segments. Masks and document
//! boundaries are evaluated on these global positions, which is what lets one local
//! attention step serve every ring hop.

use crate::{Error, Result};

/// One arithmetic run of positions: `start, start + stride, …` (`len` of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// First position (may be negative: a single-device call with `s_q > s_k` places the
    /// first queries before key 0).
    pub start: i64,
    /// Distance between consecutive positions; at least 1.
    pub stride: i64,
    /// Number of positions.
    pub len: usize,
}

/// The global positions of the rows of a block: segments concatenated in order.
///
/// ```
/// use ringattn::Positions;
/// // Zigzag shard of rank 1 among P = 2 ranks of a 16-token sequence: chunks 1 and 2.
/// let p = Positions::from_segments(vec![
///     ringattn::Segment { start: 4, stride: 1, len: 4 },
///     ringattn::Segment { start: 8, stride: 1, len: 4 },
/// ])?;
/// assert_eq!(p.len(), 8);
/// assert_eq!(p.to_vec()[4], 8);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Positions {
    segments: Vec<Segment>,
}

impl Positions {
    /// `len` consecutive positions from `start`.
    pub fn contiguous(start: i64, len: usize) -> Self {
        Positions { segments: vec![Segment { start, stride: 1, len }] }
    }

    /// `len` positions `start, start + stride, …`.
    ///
    /// # Errors
    /// [`Error::Positions`] when `stride < 1`.
    pub fn strided(start: i64, stride: i64, len: usize) -> Result<Self> {
        Self::from_segments(vec![Segment { start, stride, len }])
    }

    /// Positions from explicit segments.
    ///
    /// # Errors
    /// [`Error::Positions`] when a stride is below 1 or a position overflows `i64`.
    pub fn from_segments(segments: Vec<Segment>) -> Result<Self> {
        for (i, s) in segments.iter().enumerate() {
            if s.stride < 1 {
                return Err(Error::Positions(format!(
                    "segment {i} has stride {}; strides must be at least 1",
                    s.stride
                )));
            }
            let last = (s.len as i64)
                .checked_sub(1)
                .and_then(|n| n.checked_mul(s.stride))
                .and_then(|n| n.checked_add(s.start));
            if s.len > 0 && last.is_none() {
                return Err(Error::Positions(format!("segment {i} ({s:?}) overflows i64")));
            }
        }
        Ok(Positions { segments })
    }

    /// Positions listed one by one, in the order the block stores them, held as runs of
    /// consecutive positions (a listed block that is a few runs costs a few segments).
    ///
    /// ```
    /// use ringattn::{Positions, Segment};
    /// let p = Positions::from_list(&[4, 5, 6, 0, 1, 9])?;
    /// assert_eq!(p.segments().len(), 3);
    /// assert_eq!(p.to_vec(), vec![4, 5, 6, 0, 1, 9]);
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Positions`] as [`Positions::from_segments`].
    pub fn from_list(positions: &[i64]) -> Result<Self> {
        let mut segments: Vec<Segment> = Vec::new();
        for &x in positions {
            match segments.last_mut() {
                Some(g) if g.start.checked_add(g.len as i64) == Some(x) => g.len += 1,
                _ => segments.push(Segment { start: x, stride: 1, len: 1 }),
            }
        }
        Self::from_segments(segments)
    }

    /// Positions of a single-device call: queries are bottom-right aligned with the keys,
    /// `pos_q(i) = i + (s_k - s_q)` and `pos_k(j) = j`. Returns `(q_positions, k_positions)`.
    pub fn single_device(s_q: usize, s_k: usize) -> (Self, Self) {
        (Self::contiguous(s_k as i64 - s_q as i64, s_q), Self::contiguous(0, s_k))
    }

    /// The segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Number of positions.
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Iterates over the positions in row order.
    pub fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.segments.iter().flat_map(|s| (0..s.len as i64).map(move |i| s.start + i * s.stride))
    }

    /// The positions as a vector.
    pub fn to_vec(&self) -> Vec<i64> {
        self.iter().collect()
    }
}
