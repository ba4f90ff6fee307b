//! Masks on global positions: none, causal, sliding window, and packed documents.
//!
//! Key at global position `pk` is visible to the query at global position `pq` iff
//! `pk >= pq - left` (when `left` is bounded), `pk <= pq + right` (when `right` is
//! bounded) and, when documents are given, both positions lie in the same document.

use crate::{Error, Result};

/// The positional part of the mask.
///
/// `Causal` is exactly `Window { left: None, right: Some(0) }`.
///
/// ```
/// use ringattn::Mask;
/// assert_eq!(Mask::Causal.bounds(), Mask::Window { left: None, right: Some(0) }.bounds());
/// assert!(Mask::Causal.allows(5, 5) && !Mask::Causal.allows(5, 6));
/// assert!(Mask::Window { left: Some(2), right: Some(1) }.allows(10, 8));
/// assert!(!Mask::Window { left: Some(2), right: Some(1) }.allows(10, 7));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mask {
    /// Every key is visible.
    #[default]
    None,
    /// Keys at or before the query's position.
    Causal,
    /// Keys within `left` positions before and `right` after the query; `None` = unbounded.
    Window {
        /// How far back a query sees (`None`: unbounded).
        left: Option<u64>,
        /// How far ahead a query sees (`None`: unbounded).
        right: Option<u64>,
    },
}

impl Mask {
    /// `(left, right)` bounds, `None` meaning unbounded, as signed distances.
    pub fn bounds(&self) -> (Option<i64>, Option<i64>) {
        let clamp = |x: u64| x.min(i64::MAX as u64 / 4) as i64;
        match *self {
            Mask::None => (None, None),
            Mask::Causal => (None, Some(0)),
            Mask::Window { left, right } => (left.map(clamp), right.map(clamp)),
        }
    }

    /// The mask that applies both `self` and causality (right side clamped to 0).
    pub fn and_causal(self) -> Mask {
        let (left, _) = self.bounds();
        match left {
            None => Mask::Causal,
            Some(l) => Mask::Window { left: Some(l as u64), right: Some(0) },
        }
    }

    /// Builds a window from signed sides where `-1` means unbounded, the convention of
    /// `--window L,R`.
    ///
    /// # Errors
    /// [`Error::Window`] for a side below -1.
    pub fn from_signed_window(left: i64, right: i64) -> Result<Mask> {
        let side = |x: i64, name: &str| -> Result<Option<u64>> {
            match x {
                -1 => Ok(None),
                x if x >= 0 => Ok(Some(x as u64)),
                x => Err(Error::Window(format!("{name} side {x}: use -1 for unbounded or a value >= 0"))),
            }
        };
        Ok(Mask::Window { left: side(left, "left")?, right: side(right, "right")? })
    }

    /// Whether a key at `pk` is visible to a query at `pq` under the positional mask alone.
    #[inline]
    pub fn allows(&self, pq: i64, pk: i64) -> bool {
        let (l, r) = self.bounds();
        l.is_none_or(|l| pk >= pq - l) && r.is_none_or(|r| pk <= pq + r)
    }
}

/// Packed documents: consecutive global positions grouped into documents of the given
/// lengths (the differences of `cu_seqlens`). Tokens attend only within their document.
///
/// ```
/// use ringattn::Documents;
/// let d = Documents::new(vec![3, 0, 2])?;
/// assert_eq!(d.total_len(), 5);
/// assert_eq!(d.document_of(2), Some(0));
/// assert_eq!(d.document_of(3), Some(2));
/// assert_eq!(d.document_of(5), None);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Documents {
    /// Cumulative ends: `ends[i]` is one past the last position of document `i`.
    ends: Vec<u64>,
}

impl Documents {
    /// Documents from their lengths, in order from position 0. Zero lengths are allowed.
    ///
    /// # Errors
    /// [`Error::Documents`] when the list is empty or the total overflows.
    pub fn new(lengths: Vec<usize>) -> Result<Self> {
        if lengths.is_empty() {
            return Err(Error::Documents("the list of document lengths is empty".into()));
        }
        let mut ends = Vec::with_capacity(lengths.len());
        let mut acc = 0u64;
        for &l in &lengths {
            acc = acc
                .checked_add(l as u64)
                .filter(|&a| a <= i64::MAX as u64)
                .ok_or_else(|| Error::Documents(format!("lengths {lengths:?} overflow")))?;
            ends.push(acc);
        }
        Ok(Documents { ends })
    }

    /// Sum of the lengths: the global sequence length these documents describe.
    pub fn total_len(&self) -> u64 {
        *self.ends.last().unwrap_or(&0)
    }

    /// The document lengths.
    pub fn lengths(&self) -> Vec<usize> {
        let mut prev = 0;
        self.ends
            .iter()
            .map(|&e| {
                let l = (e - prev) as usize;
                prev = e;
                l
            })
            .collect()
    }

    /// Index of the document holding global position `pos`, or `None` outside `0..total_len`.
    pub fn document_of(&self, pos: i64) -> Option<usize> {
        if pos < 0 || pos as u64 >= self.total_len() {
            return None;
        }
        Some(self.ends.partition_point(|&e| e <= pos as u64))
    }
}
