//! Buffers that start on a 64-byte cache line, for the operands of the AMX tiles.
//!
//! A `TILELOADD` or `TILESTORED` whose rows straddle two cache lines runs several times
//! slower than one whose rows each lie in one line: measured on the Intel Xeon this project
//! is built on (family 6 model 207), a 16 × 64-byte tile load took about 42 cycles from a
//! buffer 16 bytes off a line against 6.6 from an aligned one, and the products of the bf16
//! forward lost half their rate to it. `Vec<u32>` gives no such alignment (the allocator's
//! 16 bytes; large blocks come from `mmap` 16 bytes past a page), so the buffers the tiles
//! read and write are [`Lines`]: whole lines, viewed as a slice of their elements. With row
//! strides that are whole lines (the packings pad them so), every tile row then lies in one
//! line.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Bytes of a cache line.
pub(crate) const LINE: usize = 64;

/// One cache line of bytes, aligned as one.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

// SAFETY: 64 bytes with no padding (the size equals the alignment), every bit pattern valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

/// `len` elements of `T` from the start of a run of whole cache lines (module docs); a
/// slice of `T` through `Deref`. Grows and shrinks like a `Vec` (new elements are zero);
/// its capacity is kept.
pub(crate) struct Lines<T> {
    lines: Vec<Line>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: bytemuck::Pod> Lines<T> {
    const PER_LINE: usize = {
        assert!(LINE.is_multiple_of(std::mem::size_of::<T>()) && std::mem::align_of::<T>() <= LINE);
        LINE / std::mem::size_of::<T>()
    };

    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        Lines { lines: vec![Line([0; LINE]); len.div_ceil(Self::PER_LINE)], len, _element: PhantomData }
    }

    /// Elements the lines hold without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.lines.capacity() * Self::PER_LINE
    }

    /// `len` elements: those kept keep their values, new ones are zero (and so are the rest
    /// of the last line's).
    pub(crate) fn resize(&mut self, len: usize) {
        if len < self.len {
            // The dropped elements of the line that stays become zero, as a `Vec` that grew
            // again would have them.
            let end = len.div_ceil(Self::PER_LINE) * Self::PER_LINE;
            let all: &mut [T] = bytemuck::cast_slice_mut(&mut self.lines);
            let end = end.min(all.len());
            all[len..end].fill(T::zeroed());
        }
        self.lines.resize(len.div_ceil(Self::PER_LINE), Line([0; LINE]));
        self.len = len;
    }

    /// Bytes held (the capacity in lines).
    pub(crate) fn bytes(&self) -> usize {
        self.lines.capacity() * LINE
    }
}

impl<T: bytemuck::Pod> Default for Lines<T> {
    fn default() -> Self {
        Lines::zeroed(0)
    }
}

impl<T: bytemuck::Pod> Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl<T: bytemuck::Pod> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

impl<T: bytemuck::Pod + std::fmt::Debug> std::fmt::Debug for Lines<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Whether `p` lies on the start of a cache line.
pub(crate) fn on_line<T>(p: *const T) -> bool {
    (p as usize).is_multiple_of(LINE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_on_a_line_and_grow_with_zeros() {
        let mut b = Lines::<u32>::zeroed(5);
        assert!(on_line(b.as_ptr()));
        assert_eq!(&b[..], &[0; 5]);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32 + 1);
        b.resize(3);
        assert_eq!(&b[..], &[1, 2, 3]);
        b.resize(40);
        assert!(on_line(b.as_ptr()));
        assert_eq!(&b[..5], &[1, 2, 3, 0, 0]);
        assert!(b[3..].iter().all(|&x| x == 0));
        assert!(b.capacity() >= 40 && b.bytes() >= 160);
        let h = Lines::<u16>::zeroed(33);
        assert_eq!((h.len(), on_line(h.as_ptr())), (33, true));
    }
}
