//! A communicator that makes each of its splits once: what a training loop that plans every
//! batch afresh (`Strategy::Auto`, packed documents whose positions change per batch) wraps
//! its communicator in, so that a Ulysses or USP plan splits the group (`ncclCommSplit` on
//! GPUs: far dearer than a plan's handshake) only the first time a degree is chosen.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{AddFn, Communicator, Elem, Posted, RecvHandle, RecvOp, SendHandle, SendOp, Tag};
use crate::Result;

/// The sub-communicator shared by every split of the same `(color, key)`.
type Shared<B> = Arc<dyn Communicator<Buf = B>>;
/// The splits made, by `(color, key)`.
type Splits<B> = Mutex<Vec<((usize, usize), Shared<B>)>>;

/// `inner` with its splits cached by `(color, key)`: the first [`Communicator::split`] of a
/// pair is the inner (collective) split; later ones return the same sub-communicator at once,
/// its tags and counters carried on (so that calls on it never collide). Every other method is
/// the inner one's.
///
/// A `(color, key)` pair must name the same group every time it is asked for: the plans'
/// Ulysses meshes do (their colors encode the degree and whether the group is a Ulysses group
/// or a ring across them). Collective rule: the ranks must ask for the same splits in the same
/// order (as for any split); a rank whose cache answers where another's splits would wait —
/// ranks with different histories — fails at the communicator's deadline. Plans made from the same inputs on every
/// rank (`Strategy::Auto` resolves the same choice everywhere) keep it. Sub-communicators keep
/// the deadline they were made with.
///
/// ```
/// use ringattn::comm::{spmd_shared, Communicator, LocalOptions, SplitCache};
///
/// let runs = spmd_shared(4, LocalOptions::default(), |comm| {
///     let comm = SplitCache::new(comm);
///     let a = comm.split(comm.rank() / 2, comm.rank() % 2)?; // collective, once
///     let b = comm.split(comm.rank() / 2, comm.rank() % 2)?; // from the cache
///     assert_eq!((a.size(), b.rank()), (2, comm.rank() % 2));
///     Ok(comm.splits_made())
/// });
/// assert!(runs.into_iter().all(|made| made.unwrap() == 1));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct SplitCache<C: Communicator> {
    inner: C,
    splits: Splits<C::Buf>,
}

impl<C: Communicator> SplitCache<C> {
    /// `inner`, its splits made once each.
    pub fn new(inner: C) -> Self {
        SplitCache { inner, splits: Mutex::new(Vec::new()) }
    }

    /// The communicator wrapped.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// How many inner splits were made (distinct `(color, key)` pairs asked for).
    pub fn splits_made(&self) -> usize {
        self.splits.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl<C: Communicator> Communicator for SplitCache<C>
where
    C::Buf: 'static,
{
    type Buf = C::Buf;
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = Self::Buf>>> {
        let mut splits = self.splits.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, sub)) = splits.iter().find(|(k, _)| *k == (color, key)) {
            return Ok(Box::new(Arc::clone(sub)));
        }
        let sub: Shared<C::Buf> = Arc::from(self.inner.split(color, key)?);
        splits.push(((color, key), Arc::clone(&sub)));
        Ok(Box::new(sub))
    }
    fn depart(&self) {
        self.inner.depart()
    }
    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        self.inner.set_deadline(deadline)
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn deadline(&self) -> Duration {
        self.inner.deadline()
    }
    fn isend(&self, to: usize, tag: Tag, data: Self::Buf) -> Result<SendHandle> {
        self.inner.isend(to, tag, data)
    }
    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<Self::Buf>> {
        self.inner.irecv(from, tag, len, elem)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
    fn next_tag_block(&self) -> Tag {
        self.inner.next_tag_block()
    }
    fn next_collective_tag(&self) -> Tag {
        self.inner.next_collective_tag()
    }
    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn post(&self, recvs: Vec<RecvOp>, sends: Vec<SendOp<Self::Buf>>) -> Result<Posted<Self::Buf>> {
        self.inner.post(recvs, sends)
    }
    fn all_to_all_v(&self, sends: Vec<Self::Buf>, recv_lens: &[usize]) -> Result<Vec<Self::Buf>> {
        self.inner.all_to_all_v(sends, recv_lens)
    }
    fn all_gather_v(&self, data: Self::Buf, lens: &[usize]) -> Result<Vec<Self::Buf>> {
        self.inner.all_gather_v(data, lens)
    }
    fn reduce_scatter_v(&self, parts: Vec<Self::Buf>, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        self.inner.reduce_scatter_v(parts, add)
    }
    fn all_reduce(&self, data: Self::Buf, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        self.inner.all_reduce(data, add)
    }
    fn broadcast(&self, data: Self::Buf, root: usize) -> Result<Self::Buf> {
        self.inner.broadcast(data, root)
    }
}
