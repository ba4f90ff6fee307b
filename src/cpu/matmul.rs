//! Strided f32 matrix products through the `gemm` crate, with bounds checked up front.

/// A read-only strided matrix view: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// Rows `r0..r0+rows` of a row-major matrix whose rows are `rs` apart (columns contiguous).
    pub fn rows(data: &'a [f32], r0: usize, rows: usize, cols: usize, rs: usize) -> Self {
        View { data: &data[r0 * rs..], rows, cols, rs, cs: 1 }
    }

    /// Rows `rows` of the view (no copy).
    pub fn rows_of(self, rows: std::ops::Range<usize>) -> Self {
        View { data: &self.data[rows.start * self.rs..], rows: rows.len(), ..self }
    }

    /// The block of rows `rows` and columns `cols` of the view (no copy).
    pub fn block_of(self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Self {
        View {
            data: &self.data[rows.start * self.rs + cols.start * self.cs..],
            rows: rows.len(),
            cols: cols.len(),
            ..self
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        View { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// `dst = beta · lhs · rhs` (or `dst += beta · lhs · rhs` when `accumulate`), where `dst`
/// is row-major `[lhs.rows, rhs.cols]` with row stride `dst_rs`. Single-threaded: callers
/// parallelise over tiles.
pub(crate) fn matmul(dst: &mut [f32], dst_rs: usize, lhs: View, rhs: View, beta: f32, accumulate: bool) {
    matmul_strided(dst, dst_rs, 1, lhs, rhs, beta, accumulate)
}

/// As [`matmul`] with `dst` element `(r, c)` at `r * dst_rs + c * dst_cs`. The `gemm`
/// microkernels are column-major: a column-major `dst` and `lhs` (`rs = 1`) avoid packing.
pub(crate) fn matmul_strided(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    lhs: View,
    rhs: View,
    beta: f32,
    accumulate: bool,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(k, rhs.rows, "inner dimensions differ");
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_rs + (n - 1) * dst_cs < dst.len(), "destination out of bounds");
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[r * dst_rs + c * dst_cs] = 0.0;
                }
            }
        }
        return;
    }
    lhs.check();
    rhs.check();
    // SAFETY: every element the product touches lies inside the slices (checked above);
    // `dst` is exclusively borrowed and does not alias the shared inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
