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

/// Buffers smaller than this are not kept.
pub const MIN_BYTES: usize = 64 << 10;
/// The most bytes one thread keeps.
pub const MAX_KEPT_BYTES: usize = 1 << 30;

/// The buffers one thread keeps, oldest first.
#[derive(Default)]
pub(crate) struct Kept<T> {
    bufs: Vec<Vec<T>>,
    bytes: usize,
}

impl<T> Kept<T> {
    /// The smallest kept buffer that holds `len` elements with at most an eighth (plus
    /// [`MIN_BYTES`]) to spare — a buffer taken may become a caller's output — removed from
    /// the list.
    fn take_fitting(&mut self, len: usize) -> Option<Vec<T>> {
        let fits = |c: usize| c >= len && c <= len + len / 8 + MIN_BYTES / std::mem::size_of::<T>().max(1);
        let (at, _) =
            self.bufs.iter().enumerate().filter(|(_, b)| fits(b.capacity())).min_by_key(|(_, b)| b.capacity())?;
        let buf = self.bufs.remove(at);
        self.bytes -= bytes_of(&buf);
        Some(buf)
    }

    fn push(&mut self, buf: Vec<T>) {
        self.bytes += bytes_of(&buf);
        self.bufs.push(buf);
        while self.bytes > MAX_KEPT_BYTES {
            let oldest = self.bufs.remove(0);
            self.bytes -= bytes_of(&oldest);
        }
    }
}

fn bytes_of<T>(buf: &Vec<T>) -> usize {
    buf.capacity() * std::mem::size_of::<T>()
}

/// Element types whose buffers are kept: f32 (outputs, partials) and u32 (packed bf16
/// pairs).
pub(crate) trait Reusable: Copy + Default + 'static {
    /// Runs `f` on the calling thread's kept buffers of this type (`None` while the thread
    /// is being torn down).
    fn with_kept<R>(f: impl FnOnce(&mut Kept<Self>) -> R) -> Option<R>;
}

thread_local! {
    static KEPT_F32: RefCell<Kept<f32>> = RefCell::new(Kept::default());
    static KEPT_U32: RefCell<Kept<u32>> = RefCell::new(Kept::default());
}

impl Reusable for f32 {
    fn with_kept<R>(f: impl FnOnce(&mut Kept<f32>) -> R) -> Option<R> {
        KEPT_F32.try_with(|k| f(&mut k.borrow_mut())).ok()
    }
}

impl Reusable for u32 {
    fn with_kept<R>(f: impl FnOnce(&mut Kept<u32>) -> R) -> Option<R> {
        KEPT_U32.try_with(|k| f(&mut k.borrow_mut())).ok()
    }
}

/// A buffer of `len` elements whose contents are unspecified (values a previous step left,
/// or zeros): for callers that write every element before reading it.
pub(crate) fn take<T: Reusable>(len: usize) -> Vec<T> {
    if len * std::mem::size_of::<T>() < MIN_BYTES {
        return vec![T::default(); len];
    }
    match T::with_kept(|k| k.take_fitting(len)).flatten() {
        Some(mut buf) => {
            if buf.len() >= len {
                buf.truncate(len);
            } else {
                buf.resize(len, T::default());
            }
            buf
        }
        // Zeros from the allocator: fresh pages, cleared by the system as they are touched.
        None => vec![T::default(); len],
    }
}

/// `len` copies of `value`.
pub(crate) fn filled<T: Reusable>(len: usize, value: T) -> Vec<T> {
    let mut buf = take(len);
    buf.fill(value);
    buf
}

/// `len` zeros (`T::default()`).
pub(crate) fn zeroed<T: Reusable>(len: usize) -> Vec<T> {
    if len * std::mem::size_of::<T>() < MIN_BYTES {
        return vec![T::default(); len];
    }
    match T::with_kept(|k| k.take_fitting(len)).flatten() {
        Some(mut buf) => {
            buf.clear();
            buf.resize(len, T::default());
            buf
        }
        None => vec![T::default(); len],
    }
}

/// Keeps `buf` for the calling thread's next request of a similar size (dropped when small,
/// or when the thread is being torn down).
pub(crate) fn keep<T: Reusable>(buf: Vec<T>) {
    if bytes_of(&buf) < MIN_BYTES {
        return;
    }
    // During thread teardown the buffer is simply dropped.
    let _ = T::with_kept(move |k| k.push(buf));
}

/// Bytes the calling thread keeps.
pub fn kept_bytes() -> usize {
    f32::with_kept(|k| k.bytes).unwrap_or(0) + u32::with_kept(|k| k.bytes).unwrap_or(0)
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
    let _ = f32::with_kept(|k| *k = Kept::default());
    let _ = u32::with_kept(|k| *k = Kept::default());
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
        let big = take::<f32>(4 * len);
        assert_ne!(big.as_ptr(), at);
        // Far smaller: a new buffer too (the kept one would waste half its size).
        let small = take::<f32>(len / 2);
        assert_ne!(small.as_ptr(), at);
        // A similar size: the kept one, resized, its pages reused.
        let z = zeroed::<f32>(len - 5);
        assert_eq!(z.as_ptr(), at);
        assert_eq!(z.len(), len - 5);
        assert!(z.iter().all(|&x| x == 0.0));
        assert_eq!(kept_bytes(), 0);
        keep(z);
        let f = filled::<f32>(len, -2.5);
        assert_eq!(f.as_ptr(), at);
        assert!(f.iter().all(|&x| x == -2.5));
        // Small buffers are left to the allocator; u32 buffers are kept apart from f32 ones.
        keep(vec![0.0f32; 16]);
        keep(vec![7u32; len]);
        assert_eq!(kept_bytes(), len * 4);
        assert_eq!(f32::with_kept(|k| k.bufs.len()), Some(0));
        // `take` leaves the contents as they were.
        let u = take::<u32>(len - 3);
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
