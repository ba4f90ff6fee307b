//! The communication seam: a [`Communicator`] moves typed buffers ([`Payload`]: [`HostBuf`]
//! here, device memory for device communicators) between ranks with non-blocking
//! point-to-point operations whose handles are waited on with a deadline. Its collectives
//! ([`Communicator::all_to_all_v`], [`Communicator::all_gather_v`],
//! [`Communicator::all_reduce`], [`Communicator::broadcast`]; the free functions
//! [`all_to_all_v`], [`all_gather_v`], [`all_gather`], [`reduce_scatter_v`] and [`barrier`]
//! call them) have portable versions built from point-to-point batches, which a transport
//! overrides with its native ones (MPI does). [`LocalComm`] runs P ranks as P threads of one
//! process.
//!
//! Every wait has a deadline: on expiry it returns [`crate::Error::Timeout`] naming the peer
//! and the operation. A rank that fails calls [`Communicator::abort`] (the SPMD helper
//! [`spmd`] does it for errors and panics), after which every wait of every rank returns
//! [`crate::Error::PeerFailed`] instead of waiting.

mod local;
#[cfg(feature = "mpi")]
mod mpi_collectives;
#[cfg(feature = "mpi")]
mod mpi_comm;
mod split_cache;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(feature = "cuda")]
pub(crate) use local::run_each;
pub use local::{spmd, spmd_owned, spmd_shared, LinkModel, LocalComm, LocalOptions, MessageOrder};
#[cfg(feature = "mpi")]
pub use mpi_comm::{MpiComm, MpiOptions};
pub use split_cache::SplitCache;

use crate::{Elem, HostBuf, Result};

/// A communicator's deadline, changeable while it is in use ([`Communicator::set_deadline`]):
/// waits read it when they are posted.
#[derive(Debug)]
pub(crate) struct DeadlineCell(AtomicU64);

impl DeadlineCell {
    pub(crate) fn new(d: Duration) -> Self {
        DeadlineCell(AtomicU64::new(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)))
    }

    pub(crate) fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    /// # Errors
    /// [`crate::Error::InvalidArgument`] for zero.
    pub(crate) fn set(&self, d: Duration) -> Result<()> {
        if d.is_zero() {
            return Err(crate::Error::InvalidArgument("a communicator's deadline must be above zero".into()));
        }
        self.0.store(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        Ok(())
    }
}

/// A message tag. Point-to-point tags chosen by drivers must stay below [`COLLECTIVE_TAG`].
pub type Tag = u64;

/// What a communicator moves: a buffer of typed elements in some memory ([`HostBuf`] on the
/// host; a device buffer for device communicators). Its size on the wire is
/// `elements() · elem().size_of()` bytes.
pub trait Payload: Clone + Send + Sync + 'static {
    /// Number of elements.
    fn elements(&self) -> usize;
    /// The element type.
    fn elem(&self) -> Elem;
    /// Bytes on the wire.
    fn bytes(&self) -> u64 {
        (self.elements() * self.elem().size_of()) as u64
    }
}

impl Payload for HostBuf {
    fn elements(&self) -> usize {
        self.len()
    }

    fn elem(&self) -> Elem {
        HostBuf::elem(self)
    }
}

/// Tags at or above this are reserved for collectives.
pub const COLLECTIVE_TAG: Tag = 1 << 62;

/// Point-to-point tags in one block of [`Communicator::next_tag_block`]: a driver's call
/// tags its messages `block + offset`, `offset < TAG_BLOCK`.
pub const TAG_BLOCK: Tag = 1 << 20;

/// A tag as error messages name it: `message tag N` or `collective #N`.
pub(crate) fn describe_tag(tag: Tag) -> String {
    if tag >= COLLECTIVE_TAG {
        format!("collective #{}", tag - COLLECTIVE_TAG)
    } else {
        format!("message tag {tag}")
    }
}

/// A posted send; waiting returns once the buffer has been handed over.
pub struct SendHandle(Box<dyn FnOnce() -> Result<()> + Send>);

impl SendHandle {
    /// A send that is already complete.
    pub fn done() -> Self {
        SendHandle(Box::new(|| Ok(())))
    }

    /// A send completed by `f`.
    pub fn new(f: impl FnOnce() -> Result<()> + Send + 'static) -> Self {
        SendHandle(Box::new(f))
    }

    /// Waits for completion (bounded by the communicator's deadline).
    pub fn wait(self) -> Result<()> {
        (self.0)()
    }
}

/// A posted receive; waiting returns the message.
pub struct RecvHandle<B = HostBuf>(Box<dyn FnOnce() -> Result<B> + Send>);

impl<B> RecvHandle<B> {
    /// A receive completed by `f`.
    pub fn new(f: impl FnOnce() -> Result<B> + Send + 'static) -> Self {
        RecvHandle(Box::new(f))
    }

    /// Waits for the message (bounded by the communicator's deadline).
    pub fn wait(self) -> Result<B> {
        (self.0)()
    }
}

/// A send of a batch ([`Communicator::post`]).
pub struct SendOp<B> {
    /// Destination rank.
    pub to: usize,
    /// Tag (an assertion: both sides must agree).
    pub tag: Tag,
    /// The buffer.
    pub data: B,
}

/// A receive of a batch ([`Communicator::post`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvOp {
    /// Source rank.
    pub from: usize,
    /// Tag (an assertion: both sides must agree).
    pub tag: Tag,
    /// Elements expected.
    pub len: usize,
    /// Element type expected.
    pub elem: Elem,
}

/// The handles of a posted batch, in the order of its operations.
pub struct Posted<B> {
    /// One per receive.
    pub recvs: Vec<RecvHandle<B>>,
    /// One per send.
    pub sends: Vec<SendHandle>,
}

/// How a reduction adds `x` into `acc` (a backend's addition for device buffers, [`add_host`]
/// for host buffers).
pub type AddFn<'a, B> = dyn Fn(&mut B, &B) -> Result<()> + 'a;

/// A group of ranks exchanging typed buffers.
///
/// **The order contract**, the same for every transport: between two ranks, the n-th
/// receive one posts for the other takes the n-th message the other sent to it (sends and
/// receives of a rank to one peer are matched in the order they were posted; tags are
/// assertions that both sides agree). This is how NCCL matches; MPI and [`LocalComm`] match
/// by tag, which pairs messages identically whenever the contract holds, and `LocalComm`
/// checks the contract itself in [`MessageOrder::PerPeerFifo`]. A step posts its sends and
/// receives together with [`Communicator::post`], which hands them to the transport at once;
/// no caller needs to flush.
///
/// Collective operations (the free functions of this module and [`Communicator::split`])
/// must be called by every rank of the group in the same order.
pub trait Communicator: Send + Sync {
    /// The buffers this communicator moves.
    type Buf: Payload;
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// How long any wait may block before it fails with [`crate::Error::Timeout`].
    fn deadline(&self) -> Duration;
    /// Sets how long this rank's waits posted from now on may block (every transport of the
    /// crate; communicators split from this one later inherit it; the other ranks keep
    /// theirs). Not collective.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for a zero deadline, or a communicator whose deadline
    /// is fixed at its creation (the default).
    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        Err(crate::Error::InvalidArgument(format!(
            "this communicator's deadline ({deadline:?} asked) is fixed at its creation ({:?})",
            self.deadline()
        )))
    }
    /// Posts a send of `data` to rank `to` with `tag`; returns at once.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for a rank out of range, [`crate::Error::PeerFailed`]
    /// when the group has failed.
    fn isend(&self, to: usize, tag: Tag, data: Self::Buf) -> Result<SendHandle>;
    /// Posts a receive of the next message from rank `from` with `tag`, which must hold `len`
    /// elements of type `elem` (the receiver always knows both: NCCL and MPI post receives
    /// into buffers of that size); returns at once.
    ///
    /// # Errors
    /// As [`Communicator::isend`], and [`crate::Error::InvalidArgument`] for an element type
    /// the communicator does not move; the wait fails with [`crate::Error::ShapeMismatch`]
    /// naming the peer and tag when the message holds another number or type of elements.
    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<Self::Buf>>;
    /// Marks the whole group (and every group split from the same root) as failed, so that
    /// every pending and future wait returns [`crate::Error::PeerFailed`] naming this rank.
    fn abort(&self, reason: &str);
    /// Says this rank is done with the group (its thread returned): a peer waiting for a
    /// message this rank never sent fails at once with [`crate::Error::PeerFailed`] ("returned
    /// without ..."), not at its deadline — a rank that skips a backward or a gradient
    /// all-reduce its peers run. Messages it did send are still received. In-process ranks
    /// implement it (`spmd` and its variants call it when a rank's function returns); the
    /// default does nothing (an MPI or NCCL process that exits ends its job by itself).
    fn depart(&self) {}
    /// Splits into sub-communicators: ranks passing the same `color` form one group, ordered
    /// by `(key, rank)`. Collective.
    ///
    /// # Errors
    /// Communication errors of the underlying exchange.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = Self::Buf>>>;
    /// The tag of this rank's next collective call (identical across ranks when collectives
    /// are called in the same order).
    fn next_collective_tag(&self) -> Tag;
    /// The first tag of a fresh block of [`TAG_BLOCK`] point-to-point tags, for one call of
    /// a driver (a ring forward or backward): the same on every rank when calls are made in
    /// the same order (as collectives are), so no message of one call can match another
    /// call's receive, and errors name the call's own tags. Blocks stay below
    /// [`COLLECTIVE_TAG`]; a transport with fewer tags folds them (MPI: modulo its
    /// point-to-point range, many calls apart). The default numbers blocks with the
    /// collective counter ([`Communicator::next_collective_tag`]).
    fn next_tag_block(&self) -> Tag {
        let n = self.next_collective_tag() - COLLECTIVE_TAG;
        (n % (COLLECTIVE_TAG / TAG_BLOCK)) * TAG_BLOCK
    }
    /// Bytes this rank has sent so far through this communicator and its splits' root.
    fn bytes_sent(&self) -> u64;
    /// Hands every posted operation to the transport now: the hook of transports that post
    /// lazily (NCCL groups its operations until a receive is waited on), which
    /// [`Communicator::post`] calls; for the others it does nothing. Callers use `post`.
    ///
    /// # Errors
    /// Transport errors, or the group's failure.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Posts one step's receives, then its sends (each in the given order, which is the
    /// per-peer order of the contract above), and hands them all to the transport (NCCL: one
    /// group). Returns at once; wait on the handles.
    ///
    /// # Errors
    /// As [`Communicator::isend`] and [`Communicator::irecv`]; transport errors.
    ///
    /// ```
    /// use ringattn::comm::{spmd, Communicator, LocalOptions, RecvOp, SendOp};
    /// use ringattn::{Elem, HostBuf};
    /// let got = spmd(2, LocalOptions::default(), |c| {
    ///     let peer = 1 - c.rank();
    ///     let recv = RecvOp { from: peer, tag: 0, len: 1, elem: Elem::F32 };
    ///     let send = SendOp { to: peer, tag: 0, data: HostBuf::from(vec![c.rank() as f32]) };
    ///     let posted = c.post(vec![recv], vec![send])?;
    ///     posted.sends.into_iter().try_for_each(|s| s.wait())?;
    ///     posted.recvs.into_iter().next().unwrap().wait()
    /// });
    /// assert_eq!(got[0].as_ref().unwrap(), &vec![1.0]);
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    fn post(&self, recvs: Vec<RecvOp>, sends: Vec<SendOp<Self::Buf>>) -> Result<Posted<Self::Buf>> {
        let recvs = recvs.into_iter().map(|r| self.irecv(r.from, r.tag, r.len, r.elem)).collect::<Result<Vec<_>>>()?;
        let sends = sends.into_iter().map(|s| self.isend(s.to, s.tag, s.data)).collect::<Result<Vec<_>>>()?;
        self.flush()?;
        Ok(Posted { recvs, sends })
    }

    /// Every rank sends `sends[j]` to rank `j` and gets what each rank sent it, indexed by
    /// source; rank `j`'s message holds `recv_lens[j]` elements of the element type of
    /// `sends`. Collective. The portable version is one batch of point-to-point messages
    /// ([`Communicator::post`]); MPI overrides it with `MPI_Ialltoallv`. See
    /// [`all_to_all_v`].
    ///
    /// # Errors
    /// As [`all_to_all_v`].
    fn all_to_all_v(&self, sends: Vec<Self::Buf>, recv_lens: &[usize]) -> Result<Vec<Self::Buf>> {
        exchange(self, sends, recv_lens)
    }

    /// Every rank's `data`, indexed by rank; rank `j`'s holds `lens[j]` elements. Collective.
    /// The portable version sends `data` to every rank; MPI overrides it with
    /// `MPI_Iallgatherv`.
    ///
    /// # Errors
    /// As [`all_to_all_v`].
    fn all_gather_v(&self, data: Self::Buf, lens: &[usize]) -> Result<Vec<Self::Buf>> {
        self.all_to_all_v(vec![data; self.size()], lens)
    }

    /// Rank `j` gets the element-wise sum over all ranks of their `parts[j]` (equal lengths
    /// on every rank), added in rank order by `add`. Collective. The portable version is an
    /// all-to-all ([`Communicator::all_to_all_v`], native on MPI) and rank-order sums.
    ///
    /// # Errors
    /// As [`reduce_scatter_v`].
    fn reduce_scatter_v(&self, parts: Vec<Self::Buf>, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        let own = parts.get(self.rank()).map_or(0, Payload::elements);
        let lens = vec![own; self.size()];
        let mut got = self.all_to_all_v(parts, &lens)?.into_iter();
        let mut sum = got.next().ok_or_else(|| crate::Error::InvalidArgument("reduce_scatter_v: no ranks".into()))?;
        for g in got {
            add(&mut sum, &g)?;
        }
        Ok(sum)
    }

    /// The element-wise sum of every rank's `data` (equal lengths), on every rank: what the
    /// gradients of replicated parameters need. `add(acc, x)` adds `x` into `acc` (a
    /// backend's addition for device buffers, [`add_host`] for host buffers). Every rank gets
    /// bit-identical values (replicas stay identical), summed in a fixed order: the portable
    /// version (and MPI's, over `MPI_Iallgatherv`) adds in rank order; NCCL's `ncclAllReduce`
    /// uses its own fixed order. Collective.
    ///
    /// # Errors
    /// Communication errors; [`crate::Error::ShapeMismatch`] when a rank contributes another
    /// length; those of `add`.
    ///
    /// ```
    /// use ringattn::comm::{add_host, spmd, Communicator, LocalOptions};
    /// let sums = spmd(3, LocalOptions::default(), |c| c.all_reduce(ringattn::HostBuf::from(vec![c.rank() as f32, 1.0]), &add_host));
    /// for s in sums {
    ///     assert_eq!(s?, vec![3.0, 3.0]);
    /// }
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    fn all_reduce(&self, data: Self::Buf, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        let lens = vec![data.elements(); self.size()];
        let mut parts = self.all_gather_v(data, &lens)?.into_iter();
        let mut sum = parts.next().ok_or_else(|| crate::Error::InvalidArgument("all_reduce: no ranks".into()))?;
        for p in parts {
            add(&mut sum, &p)?;
        }
        Ok(sum)
    }

    /// Rank `root`'s `data` on every rank; the other ranks pass a buffer of the same length
    /// (its values are not read), which states the length they expect. Collective. The
    /// portable version sends from the root to every rank; a transport may override it.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] for a root out of range; communication errors;
    /// [`crate::Error::ShapeMismatch`] when the root's buffer has another length.
    ///
    /// ```
    /// use ringattn::comm::{spmd, Communicator, LocalOptions};
    /// let got = spmd(4, LocalOptions::default(), |c| c.broadcast(ringattn::HostBuf::from(vec![c.rank() as f32; 2]), 2));
    /// for g in got {
    ///     assert_eq!(g?, vec![2.0, 2.0]);
    /// }
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    fn broadcast(&self, data: Self::Buf, root: usize) -> Result<Self::Buf> {
        broadcast_p2p(self, data, root)
    }
}

/// A shared communicator is a communicator: what an owner of an `Arc` (a training
/// framework's `'static` operation, a rank thread of [`spmd_shared`]) passes where one is
/// expected. Every method, overridden collectives included, is the inner one's.
impl<C: Communicator + ?Sized> Communicator for std::sync::Arc<C> {
    type Buf = C::Buf;
    fn depart(&self) {
        (**self).depart()
    }
    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        (**self).set_deadline(deadline)
    }
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn deadline(&self) -> Duration {
        (**self).deadline()
    }
    fn isend(&self, to: usize, tag: Tag, data: Self::Buf) -> Result<SendHandle> {
        (**self).isend(to, tag, data)
    }
    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<Self::Buf>> {
        (**self).irecv(from, tag, len, elem)
    }
    fn abort(&self, reason: &str) {
        (**self).abort(reason)
    }
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = Self::Buf>>> {
        (**self).split(color, key)
    }
    fn next_tag_block(&self) -> Tag {
        (**self).next_tag_block()
    }

    fn next_collective_tag(&self) -> Tag {
        (**self).next_collective_tag()
    }
    fn bytes_sent(&self) -> u64 {
        (**self).bytes_sent()
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn post(&self, recvs: Vec<RecvOp>, sends: Vec<SendOp<Self::Buf>>) -> Result<Posted<Self::Buf>> {
        (**self).post(recvs, sends)
    }
    fn all_to_all_v(&self, sends: Vec<Self::Buf>, recv_lens: &[usize]) -> Result<Vec<Self::Buf>> {
        (**self).all_to_all_v(sends, recv_lens)
    }
    fn all_gather_v(&self, data: Self::Buf, lens: &[usize]) -> Result<Vec<Self::Buf>> {
        (**self).all_gather_v(data, lens)
    }
    fn reduce_scatter_v(&self, parts: Vec<Self::Buf>, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        (**self).reduce_scatter_v(parts, add)
    }
    fn all_reduce(&self, data: Self::Buf, add: &AddFn<'_, Self::Buf>) -> Result<Self::Buf> {
        (**self).all_reduce(data, add)
    }
    fn broadcast(&self, data: Self::Buf, root: usize) -> Result<Self::Buf> {
        (**self).broadcast(data, root)
    }
}

/// Every rank sends `sends[j]` to rank `j` (lengths may differ: uneven all-to-all; the element
/// type is the same everywhere) and returns what each rank sent to it, indexed by source
/// rank; rank `j`'s message holds `recv_lens[j]` elements.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] when `sends.len()` or `recv_lens.len()` is not the
/// group size or this rank's own buffer disagrees with `recv_lens[rank]`;
/// [`crate::Error::ShapeMismatch`] when a message has another length; communication errors.
pub fn all_to_all_v<B: Payload>(
    comm: &dyn Communicator<Buf = B>,
    sends: Vec<B>,
    recv_lens: &[usize],
) -> Result<Vec<B>> {
    comm.all_to_all_v(sends, recv_lens)
}

/// The portable broadcast: the root sends to every rank.
pub(crate) fn broadcast_p2p<C: Communicator + ?Sized>(comm: &C, data: C::Buf, root: usize) -> Result<C::Buf> {
    let (p, r) = (comm.size(), comm.rank());
    if root >= p {
        return Err(crate::Error::InvalidArgument(format!("broadcast: root {root} out of range for {p} ranks")));
    }
    let tag = comm.next_collective_tag();
    if r != root {
        let recv = RecvOp { from: root, tag, len: data.elements(), elem: data.elem() };
        return comm.post(vec![recv], Vec::new())?.recvs.remove(0).wait();
    }
    let sends = (0..p).filter(|&j| j != root).map(|to| SendOp { to, tag, data: data.clone() }).collect();
    for s in comm.post(Vec::new(), sends)?.sends {
        s.wait()?;
    }
    Ok(data)
}

/// Checks the arguments of an all-to-all on this rank: one buffer and one length per rank,
/// and this rank's own buffer of the length it expects.
///
/// # Errors
/// [`crate::Error::InvalidArgument`] naming the disagreement.
pub(crate) fn check_all_to_all<B: Payload>(p: usize, r: usize, sends: &[B], recv_lens: &[usize]) -> Result<()> {
    if sends.len() != p || recv_lens.len() != p {
        return Err(crate::Error::InvalidArgument(format!(
            "all_to_all_v: {} buffers and {} receive lengths for {p} ranks",
            sends.len(),
            recv_lens.len()
        )));
    }
    if sends[r].elements() != recv_lens[r] {
        return Err(crate::Error::InvalidArgument(format!(
            "all_to_all_v: rank {r} keeps {} values of its own but expects {}",
            sends[r].elements(),
            recv_lens[r]
        )));
    }
    Ok(())
}

/// The portable all-to-all: one batch of point-to-point messages.
pub(crate) fn exchange<C: Communicator + ?Sized>(
    comm: &C,
    sends: Vec<C::Buf>,
    recv_lens: &[usize],
) -> Result<Vec<C::Buf>> {
    let (p, r) = (comm.size(), comm.rank());
    check_all_to_all(p, r, &sends, recv_lens)?;
    let tag = comm.next_collective_tag();
    let elem = sends[r].elem();
    let recv_ops = (0..p).filter(|&j| j != r).map(|from| RecvOp { from, tag, len: recv_lens[from], elem }).collect();
    let mut own = None;
    let mut send_ops = Vec::with_capacity(p);
    for (to, data) in sends.into_iter().enumerate() {
        if to == r {
            own = Some(data);
        } else {
            send_ops.push(SendOp { to, tag, data });
        }
    }
    let posted = comm.post(recv_ops, send_ops)?;
    let mut recvs = posted.recvs.into_iter();
    let mut out = Vec::with_capacity(p);
    for j in 0..p {
        out.push(if j == r {
            own.take().ok_or_else(|| crate::Error::InvalidArgument("all_to_all_v: own buffer missing".into()))?
        } else {
            recvs
                .next()
                .ok_or_else(|| crate::Error::InvalidArgument("all_to_all_v: a receive missing".into()))?
                .wait()?
        });
    }
    for h in posted.sends {
        h.wait()?;
    }
    Ok(out)
}

/// Every rank contributes `data`; returns every rank's contribution, indexed by rank; rank
/// `j`'s holds `lens[j]` elements.
///
/// # Errors
/// As [`all_to_all_v`].
pub fn all_gather_v<B: Payload>(comm: &dyn Communicator<Buf = B>, data: B, lens: &[usize]) -> Result<Vec<B>> {
    comm.all_gather_v(data, lens)
}

/// [`all_gather_v`] of equal-length contributions.
///
/// # Errors
/// As [`all_to_all_v`] (a rank contributing another length fails with
/// [`crate::Error::ShapeMismatch`]).
pub fn all_gather<B: Payload>(comm: &dyn Communicator<Buf = B>, data: B) -> Result<Vec<B>> {
    let lens = vec![data.elements(); comm.size()];
    all_gather_v(comm, data, &lens)
}

/// Rank `j` receives the sum over all ranks `i` of `parts[j]` of rank `i`, added in rank
/// order (so the result is deterministic) by `add(acc, x)`, which adds `x` into `acc` (a
/// backend's addition for device buffers). `parts[j]` has the same length on every rank.
///
/// # Errors
/// Communication errors, or those of `add` (unequal lengths).
pub fn reduce_scatter_v<B: Payload>(
    comm: &dyn Communicator<Buf = B>,
    parts: Vec<B>,
    add: impl Fn(&mut B, &B) -> Result<()>,
) -> Result<B> {
    comm.reduce_scatter_v(parts, &add)
}

/// Adds f32 host buffers element-wise (the `add` of [`reduce_scatter_v`] and
/// [`Communicator::all_reduce`] for [`HostBuf`]).
///
/// # Errors
/// [`crate::Error::ShapeMismatch`] for unequal lengths; [`crate::Error::InvalidArgument`]
/// for buffers that are not f32.
pub fn add_host(acc: &mut HostBuf, x: &HostBuf) -> Result<()> {
    let x = x.f32s()?;
    let acc = acc.f32s_mut()?;
    if acc.len() != x.len() {
        return Err(crate::Error::ShapeMismatch(format!("add: {} values and {}", acc.len(), x.len())));
    }
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    Ok(())
}

/// Every rank's `(color, key)` of a [`Communicator::split`], indexed by rank, exchanged as
/// bytes over a host communicator.
///
/// # Errors
/// Communication errors.
pub(crate) fn split_members(
    comm: &dyn Communicator<Buf = HostBuf>,
    color: usize,
    key: usize,
) -> Result<Vec<(usize, usize)>> {
    let mut mine = (color as u64).to_le_bytes().to_vec();
    mine.extend_from_slice(&(key as u64).to_le_bytes());
    let all = all_gather(comm, HostBuf::bytes(mine))?;
    all.iter()
        .map(|b| match b.data() {
            crate::HostData::U8(v) if v.len() == 16 => {
                let at = |i: usize| u64::from_le_bytes(v[i..i + 8].try_into().expect("8 bytes")) as usize;
                Ok((at(0), at(8)))
            }
            _ => Err(crate::Error::Handshake(format!("split: a member sent {b:?} instead of its color and key"))),
        })
        .collect()
}

/// Returns once every rank has entered (`token`: any small buffer of the same length on
/// every rank, e.g. an empty one).
///
/// # Errors
/// Communication errors.
pub fn barrier<B: Payload>(comm: &dyn Communicator<Buf = B>, token: B) -> Result<()> {
    all_gather(comm, token).map(|_| ())
}
