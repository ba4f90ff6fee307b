//! How a Ulysses group splits the heads: the drivers' head plan (`parallel::HeadPlan`), counted.

use serde::Serialize;

use crate::{Error, Result};

/// The heads each rank of a Ulysses group of `u` ranks attends after the sequence → heads
/// all-to-all, as the crate's Ulysses and USP drivers split them.
///
/// Rank `j` takes the query heads `j·h_q/u .. (j+1)·h_q/u` (so `h_q` must be a multiple of
/// `u`) and the kv heads those query heads use (query head `i` uses kv head
/// `i / (h_q/h_kv)`). When that range of query heads does not map onto its kv heads
/// uniformly — for example `h_kv < u`, where several ranks share one kv head — each query
/// head gets its own kv replica: the rank then holds `h_q/u` kv heads, and the replicas'
/// gradients are summed on the way back.
///
/// ```
/// use ringattn::plan::head_split;
///
/// // 32 query heads, 8 kv heads over 4 ranks: 8 query and 2 kv heads each.
/// let s = head_split(32, 8, 4)?;
/// assert_eq!((s.q_per_rank, s.kv_per_rank.clone(), s.replicated), (8, vec![2; 4], false));
/// // 8 kv heads over 16 ranks: two query heads share one kv head, each rank holds a copy.
/// let s = head_split(32, 8, 16)?;
/// assert_eq!((s.q_per_rank, s.max_kv_per_rank(), s.replicated), (2, 1, true));
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeadSplit {
    /// Query heads per rank, `h_q / u`.
    pub q_per_rank: usize,
    /// Kv heads held by each rank of the group (replicas included), indexed by rank.
    pub kv_per_rank: Vec<usize>,
    /// Whether some kv head is held by more than one rank (`Σ kv_per_rank > h_kv`).
    pub replicated: bool,
}

impl HeadSplit {
    /// The most kv heads any rank holds (the busiest rank's share).
    pub fn max_kv_per_rank(&self) -> usize {
        self.kv_per_rank.iter().copied().max().unwrap_or(0)
    }
}

/// Splits `h_q` query heads and `h_kv` kv heads over a Ulysses group of `u` ranks; see
/// [`HeadSplit`]. `u = 1` (no Ulysses) keeps every head on the rank.
///
/// # Errors
/// [`Error::ZeroHeads`] for a zero head count, [`Error::HeadRatio`] when `h_q % h_kv != 0`,
/// [`Error::Parallel`] when `u` is zero or `h_q` is not a multiple of `u` (what the crate's
/// drivers refuse).
pub fn head_split(h_q: usize, h_kv: usize, u: usize) -> Result<HeadSplit> {
    if h_q == 0 {
        return Err(Error::ZeroHeads { name: "h_q" });
    }
    if h_kv == 0 {
        return Err(Error::ZeroHeads { name: "h_kv" });
    }
    if !h_q.is_multiple_of(h_kv) {
        return Err(Error::HeadRatio { h_q, h_kv });
    }
    if u == 0 {
        return Err(Error::Parallel("the Ulysses degree must be at least 1".into()));
    }
    // The drivers' own head plan: one coding of the split.
    let plan = crate::parallel::HeadPlan::new(h_q, h_kv, u)?;
    let per = h_q / u;
    let kv_per_rank: Vec<usize> = plan.kv_heads.iter().map(Vec::len).collect();
    let replicated = kv_per_rank.iter().sum::<usize>() > h_kv;
    Ok(HeadSplit { q_per_rank: per, kv_per_rank, replicated })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_match_hand_counts() {
        assert_eq!(head_split(32, 32, 8).unwrap().kv_per_rank, vec![4; 8]);
        assert_eq!(head_split(32, 8, 8).unwrap().kv_per_rank, vec![1; 8]);
        let s = head_split(4, 1, 4).unwrap();
        assert_eq!((s.kv_per_rank, s.replicated), (vec![1; 4], true));
        // 6 query heads in groups of 3 over 3 ranks: rank 1 holds query heads 2, 3 -> kv 0, 1.
        let s = head_split(6, 2, 3).unwrap();
        assert_eq!(s.kv_per_rank, vec![1, 2, 1]);
        assert!(s.replicated);
        assert!(matches!(head_split(32, 8, 64), Err(Error::Parallel(_))));
        assert!(matches!(head_split(6, 4, 1), Err(Error::HeadRatio { .. })));
    }
}
