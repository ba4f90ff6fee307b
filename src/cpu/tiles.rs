//! Tile geometry: which (query tile, key tile) pairs are skipped, fully visible, or
//! need the per-element mask, decided from the tiles' global position and document ranges.

use crate::params::Visibility;

/// Tile sizes of the CPU implementation. `Default` is tuned for the 2-core AVX-512
/// machines the crate is developed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileConfig {
    /// Query rows per tile.
    pub block_q: usize,
    /// Key rows per tile.
    pub block_k: usize,
}

impl Default for TileConfig {
    fn default() -> Self {
        TileConfig { block_q: 256, block_k: 256 }
    }
}

/// Range of global positions and document indices of one tile's rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub start: usize,
    pub len: usize,
    pos_min: i64,
    pos_max: i64,
    doc_min: u32,
    doc_max: u32,
}

/// How a (query tile, key tile) pair is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileKind {
    /// No pair is visible: not computed at all.
    Skip,
    /// Every pair is visible: no mask applied.
    Full,
    /// Some pairs are visible: the per-element mask is applied.
    Partial,
}

/// The query and key tiles of a call: `(block_q, block_k, query spans, key spans)` (block
/// sizes at least 1).
pub(crate) fn call_spans(vis: &Visibility, tiles: TileConfig) -> (usize, usize, Vec<Span>, Vec<Span>) {
    let (bq, bk) = (tiles.block_q.max(1), tiles.block_k.max(1));
    (bq, bk, spans(&vis.q_pos, vis.q_doc.as_deref(), bq), spans(&vis.k_pos, vis.k_doc.as_deref(), bk))
}

/// Splits `pos` into tiles of `block` rows and records each tile's ranges.
pub(crate) fn spans(pos: &[i64], doc: Option<&[u32]>, block: usize) -> Vec<Span> {
    (0..pos.len())
        .step_by(block.max(1))
        .map(|start| {
            let len = block.min(pos.len() - start);
            let p = &pos[start..start + len];
            let (doc_min, doc_max) = match doc {
                Some(d) => {
                    let d = &d[start..start + len];
                    (*d.iter().min().unwrap_or(&0), *d.iter().max().unwrap_or(&0))
                }
                None => (0, 0),
            };
            Span {
                start,
                len,
                pos_min: *p.iter().min().unwrap_or(&0),
                pos_max: *p.iter().max().unwrap_or(&0),
                doc_min,
                doc_max,
            }
        })
        .collect()
}

/// Classifies a pair of tiles. `Skip` and `Full` are exact claims; `Partial` is the
/// conservative remainder.
pub(crate) fn classify(vis: &Visibility, q: &Span, k: &Span) -> TileKind {
    let right_out = vis.right.is_some_and(|r| k.pos_min > q.pos_max.saturating_add(r));
    let left_out = vis.left.is_some_and(|l| k.pos_max < q.pos_min.saturating_sub(l));
    let docs_apart = vis.q_doc.is_some() && (k.doc_max < q.doc_min || k.doc_min > q.doc_max);
    if right_out || left_out || docs_apart {
        return TileKind::Skip;
    }
    let right_in = vis.right.is_none_or(|r| k.pos_max <= q.pos_min.saturating_add(r));
    let left_in = vis.left.is_none_or(|l| k.pos_min >= q.pos_max.saturating_sub(l));
    let one_doc = vis.q_doc.is_none() || (q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min);
    if right_in && left_in && one_doc {
        TileKind::Full
    } else {
        TileKind::Partial
    }
}

/// Whether every element of `rows` rows of width `d` (row stride `rs`) is finite.
pub(crate) fn rows_finite(data: &[f32], r0: usize, rows: usize, d: usize, rs: usize) -> bool {
    (r0..r0 + rows).all(|r| data[r * rs..r * rs + d].iter().all(|x| x.is_finite()))
}

/// A buffer that parallel tasks write in disjoint ranges.
pub(crate) struct DisjointWriter<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the writer hands out `&mut` sub-slices only through `range`, whose contract
// requires disjoint ranges across concurrent callers; f32 is Send.
unsafe impl Send for DisjointWriter<'_> {}
unsafe impl Sync for DisjointWriter<'_> {}

impl<'a> DisjointWriter<'a> {
    pub fn new(buf: &'a mut [f32]) -> Self {
        DisjointWriter { ptr: buf.as_mut_ptr(), len: buf.len(), _borrow: std::marker::PhantomData }
    }

    /// The elements `start..start + len`.
    ///
    /// # Safety
    /// No two live slices obtained from this writer may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "disjoint writer range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
