//! Large buffers kept by the thread that used them, for its next step.
//!
//! A ring of `p` ranks calls the same steps `p` times per pass, each producing outputs and
//! packed operands of the same sizes (tens of MiB per rank at long sequence lengths). Left
//! to the allocator, every such buffer is mapped afresh and unmapped again (glibc serves
//! blocks of 32 MiB and more from `mmap`): each first write of a page is then a fault and a
//! page clearing, and each unmapping a TLB shootdown across the cores that compute. Here a
//! buffer a step is done with is [`keep`]t by the calling thread, and the next request of a
//! similar size ([`take`], [`zeroed`], [`filled`]) gets it back, its pages already mapped.
//!
//! What a thread keeps is bounded ([`MAX_KEPT_BYTES`], oldest dropped first) and freed with
//! the thread, or at once by [`release_kept_buffers`]. Small buffers (under [`MIN_BYTES`])
//! are left to the allocator, which serves those from its heap.

use std::cell::RefCell;

use super::aligned::Lines;

/// Buffers smaller than this are not kept.
pub const MIN_BYTES: usize = 64 << 10;
/// The most bytes one thread keeps.
pub const MAX_KEPT_BYTES: usize = 1 << 30;

/// The buffers of one kind one thread keeps, oldest first.
pub(crate) struct Kept<B> {
    bufs: Vec<B>,
    bytes: usize,
}

impl<B> Default for Kept<B> {
    fn default() -> Self {
        Kept { bufs: Vec::new(), bytes: 0 }
    }
}

impl<B: Reusable> Kept<B> {
    /// The smallest kept buffer that holds `len` elements with at most an eighth (plus
    /// [`MIN_BYTES`]) to spare — a buffer taken may become a caller's output — removed from
    /// the list.
    fn take_fitting(&mut self, len: usize) -> Option<B> {
        let fits = |c: usize| c >= len && c <= len + len / 8 + MIN_BYTES / std::mem::size_of::<B::Elem>().max(1);
        let (at, _) =
            self.bufs.iter().enumerate().filter(|(_, b)| fits(b.capacity())).min_by_key(|(_, b)| b.capacity())?;
        let buf = self.bufs.remove(at);
        self.bytes -= buf.bytes();
        Some(buf)
    }

    fn push(&mut self, buf: B) {
        self.bytes += buf.bytes();
        self.bufs.push(buf);
        while self.bytes > MAX_KEPT_BYTES {
            let oldest = self.bufs.remove(0);
            self.bytes -= oldest.bytes();
        }
    }
}

/// The kinds of buffers kept: `Vec<f32>` (outputs, partials: they may become a caller's
/// tensor) and [`Lines`]`<u32>` (packed bf16 pairs and f32 words, which the AMX tiles read
/// from whole cache lines).
pub(crate) trait Reusable: std::ops::DerefMut<Target = [Self::Elem]> + Sized + 'static {
    type Elem: Copy + Default;
    /// `len` zeros, freshly allocated.
    fn fresh(len: usize) -> Self;
    /// Elements held without growing.
    fn capacity(&self) -> usize;
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// `len` elements, those kept unchanged, new ones zero.
    fn set_len(&mut self, len: usize);
    /// Runs `f` on the calling thread's kept buffers of this kind (`None` while the thread
    /// is being torn down).
    fn with_kept<R>(f: impl FnOnce(&mut Kept<Self>) -> R) -> Option<R>;
}

thread_local! {
    static KEPT_F32: RefCell<Kept<Vec<f32>>> = RefCell::new(Kept::default());
    static KEPT_U32: RefCell<Kept<Lines<u32>>> = RefCell::new(Kept::default());
}

impl Reusable for Vec<f32> {
    type Elem = f32;
    fn fresh(len: usize) -> Self {
        vec![0.0; len]
    }
    fn capacity(&self) -> usize {
        Vec::capacity(self)
    }
    fn bytes(&self) -> usize {
        Vec::capacity(self) * 4
    }
    fn set_len(&mut self, len: usize) {
        self.resize(len, 0.0);
    }
    fn with_kept<R>(f: impl FnOnce(&mut Kept<Self>) -> R) -> Option<R> {
        KEPT_F32.try_with(|k| f(&mut k.borrow_mut())).ok()
    }
}

impl Reusable for Lines<u32> {
    type Elem = u32;
    fn fresh(len: usize) -> Self {
        Lines::zeroed(len)
    }
    fn capacity(&self) -> usize {
        Lines::capacity(self)
    }
    fn bytes(&self) -> usize {
        Lines::bytes(self)
    }
    fn set_len(&mut self, len: usize) {
        self.resize(len);
    }
    fn with_kept<R>(f: impl FnOnce(&mut Kept<Self>) -> R) -> Option<R> {
        KEPT_U32.try_with(|k| f(&mut k.borrow_mut())).ok()
    }
}

/// A buffer of `len` elements whose contents are unspecified (values a previous step left,
/// or zeros): for callers that write every element before reading it.
pub(crate) fn take<B: Reusable>(len: usize) -> B {
    if len * std::mem::size_of::<B::Elem>() < MIN_BYTES {
        return B::fresh(len);
    }
    match B::with_kept(|k| k.take_fitting(len)).flatten() {
        Some(mut buf) => {
            buf.set_len(len);
            buf
        }
        // Zeros from the allocator: fresh pages, cleared by the system as they are touched.
        None => B::fresh(len),
    }
}

/// `len` copies of `value`.
pub(crate) fn filled<B: Reusable>(len: usize, value: B::Elem) -> B {
    let mut buf = take::<B>(len);
    buf.fill(value);
    buf
}

/// `len` zeros (`Default::default()`).
pub(crate) fn zeroed<B: Reusable>(len: usize) -> B {
    filled(len, B::Elem::default())
}

/// Keeps `buf` for the calling thread's next request of a similar size (dropped when small,
/// or when the thread is being torn down).
pub(crate) fn keep<B: Reusable>(buf: B) {
    if buf.bytes() < MIN_BYTES {
        return;
    }
    // During thread teardown the buffer is simply dropped.
    let _ = B::with_kept(move |k| k.push(buf));
}

/// Bytes the calling thread keeps.
pub fn kept_bytes() -> usize {
    Vec::<f32>::with_kept(|k| k.bytes).unwrap_or(0) + Lines::<u32>::with_kept(|k| k.bytes).unwrap_or(0)
}

/// Frees the buffers the calling thread keeps for its next steps (see the module docs of
/// `cpu::reuse`): for a long-lived thread that is done with attention for a while. Later
/// steps simply allocate again.
///
/// ```
/// ringattn::cpu::release_kept_buffers();
/// assert_eq!(ringattn::cpu::kept_bytes(), 0);
/// ```
pub fn release_kept_buffers() {
    let _ = Vec::<f32>::with_kept(|k| *k = Kept::default());
    let _ = Lines::<u32>::with_kept(|k| *k = Kept::default());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_comes_back_for_a_similar_size_only() {
        release_kept_buffers();
        let len = MIN_BYTES; // 4 · MIN_BYTES bytes of f32
        let buf = vec![1.0f32; len];
        let at = buf.as_ptr();
        keep(buf);
        assert_eq!(kept_bytes(), len * 4);
        // Far larger than anything kept: a new buffer.
        let big = take::<Vec<f32>>(4 * len);
        assert_ne!(big.as_ptr(), at);
        // Far smaller: a new buffer too (the kept one would waste half its size).
        let small = take::<Vec<f32>>(len / 2);
        assert_ne!(small.as_ptr(), at);
        // A similar size: the kept one, resized, its pages reused.
        let z = zeroed::<Vec<f32>>(len - 5);
        assert_eq!(z.as_ptr(), at);
        assert_eq!(z.len(), len - 5);
        assert!(z.iter().all(|&x| x == 0.0));
        assert_eq!(kept_bytes(), 0);
        keep(z);
        let f = filled::<Vec<f32>>(len, -2.5);
        assert_eq!(f.as_ptr(), at);
        assert!(f.iter().all(|&x| x == -2.5));
        // Small buffers are left to the allocator; u32 buffers are kept apart from f32 ones.
        keep(vec![0.0f32; 16]);
        let mut sevens = Lines::<u32>::zeroed(len);
        sevens.fill(7);
        keep(sevens);
        assert_eq!(kept_bytes(), len * 4);
        assert_eq!(Vec::<f32>::with_kept(|k| k.bufs.len()), Some(0));
        // `take` leaves the contents as they were.
        let u = take::<Lines<u32>>(len - 3);
        assert_eq!((u.len(), u[0], u[len - 4]), (len - 3, 7, 7));
        assert_eq!(kept_bytes(), 0);
        drop(f);
    }

    #[test]
    fn what_a_thread_keeps_is_bounded_and_released() {
        release_kept_buffers();
        let len = 64 << 20; // 256 MiB of f32 each
        for _ in 0..6 {
            keep(vec![0.0f32; len]);
        }
        assert!(kept_bytes() <= MAX_KEPT_BYTES, "{} bytes kept", kept_bytes());
        assert!(kept_bytes() >= MAX_KEPT_BYTES - len * 4);
        release_kept_buffers();
        assert_eq!(kept_bytes(), 0);
    }
}
