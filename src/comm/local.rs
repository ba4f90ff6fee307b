//! In-process ranks: [`LocalComm`] and the SPMD helper [`spmd`].

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Communicator, Payload, RecvHandle, SendHandle, Tag, COLLECTIVE_TAG};
use crate::{Elem, Error, HostBuf, Result};

/// A model of the link between two ranks: a message of `n` bytes occupies the link for
/// `n / bandwidth` and arrives `latency` after it leaves. Messages on one directed link queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Bytes per second.
    pub bandwidth: f64,
    /// One-way latency.
    pub latency: Duration,
}

/// How a [`LocalComm`] matches a receive with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MessageOrder {
    /// The oldest message from the peer with the receive's tag (as MPI matches).
    #[default]
    Tag,
    /// The peer's sends to this rank in the order it posted them, against this rank's
    /// receives from the peer in the order it posted them, the tags checked: the n-th
    /// receive takes the n-th message, and a tag that differs is an
    /// [`Error::MessageOrder`]. This is how NCCL matches (by issue order, tags unseen); a CPU
    /// run in this mode finds what would go wrong there. Code correct in this mode is
    /// correct under tag matching too.
    PerPeerFifo,
}

/// Options of a [`LocalComm`] group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalOptions {
    /// Deadline of every wait.
    pub deadline: Duration,
    /// Link model; `None` delivers at once.
    pub link: Option<LinkModel>,
    /// Compute threads of each rank ([`spmd`] runs each rank inside its own rayon pool of
    /// this size); `None` shares the global pool among all ranks. Giving P ranks `cores / P`
    /// threads each keeps ranks from lending each other cores, which matters when measuring
    /// overlap on a small machine.
    pub threads_per_rank: Option<usize>,
    /// How receives match messages.
    pub order: MessageOrder,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions {
            deadline: Duration::from_secs(300),
            link: None,
            threads_per_rank: None,
            order: MessageOrder::Tag,
        }
    }
}

/// The failure shared by a root group and everything split from it.
#[derive(Default)]
struct Failure {
    first: Mutex<Option<(usize, String)>>,
    /// Global ranks whose thread has returned ([`Communicator::depart`]).
    departed: Mutex<Vec<usize>>,
}

impl Failure {
    fn get(&self) -> Option<(usize, String)> {
        self.first.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn departed(&self, global_rank: usize) -> bool {
        self.departed.lock().unwrap_or_else(|e| e.into_inner()).contains(&global_rank)
    }
}

struct Message<B> {
    deliver_at: Instant,
    /// The tag the sender gave (checked against the receive's in per-peer order).
    tag: Tag,
    data: B,
}

/// Messages waiting per (source rank, key), in arrival order: the key is the tag, or under
/// [`MessageOrder::PerPeerFifo`] the message's number among the source's sends to this rank.
type Queues<B> = HashMap<(usize, u64), VecDeque<Message<B>>>;

/// Sub-groups being formed, with how many members have joined.
type Forming<B> = HashMap<SplitKey, (Arc<Group<B>>, usize)>;

struct Mailbox<B> {
    queue: Mutex<Queues<B>>,
    ready: Condvar,
}

impl<B> Default for Mailbox<B> {
    fn default() -> Self {
        Mailbox { queue: Mutex::new(HashMap::new()), ready: Condvar::new() }
    }
}

struct Group<B> {
    size: usize,
    /// Global (root) rank of each member, for error messages.
    global: Vec<usize>,
    mailboxes: Vec<Mailbox<B>>,
    /// When each directed link (src, dst) is next free.
    link_free: Mutex<Vec<Instant>>,
    options: LocalOptions,
    failure: Arc<Failure>,
    /// Per-root-rank bytes sent.
    bytes: Arc<Vec<AtomicU64>>,
    /// Sub-groups being formed by `split`, with how many members have joined; an entry is
    /// removed once all have, so repeated splits do not accumulate.
    splits: Mutex<Forming<B>>,
    /// Host-vector side group for `split` metadata.
    meta: Mutex<Option<Arc<Group<HostBuf>>>>,
}

/// `(split sequence number, color)`: identifies one sub-group being formed.
type SplitKey = (u64, usize);

impl<B> Group<B> {
    fn new(global: Vec<usize>, options: LocalOptions, failure: Arc<Failure>, bytes: Arc<Vec<AtomicU64>>) -> Self {
        let size = global.len();
        Group {
            size,
            global,
            mailboxes: (0..size).map(|_| Mailbox::default()).collect(),
            link_free: Mutex::new(vec![Instant::now(); size * size]),
            options,
            failure,
            bytes,
            splits: Mutex::new(HashMap::new()),
            meta: Mutex::new(None),
        }
    }
}

/// One rank of a group of in-process ranks (threads).
///
/// ```
/// use ringattn::comm::{all_gather_v, spmd, Communicator, LocalOptions};
/// use ringattn::HostBuf;
/// let out = spmd(3, LocalOptions::default(), |c| all_gather_v(c, HostBuf::from(vec![c.rank() as f32]), &[1, 1, 1]));
/// for r in out {
///     assert_eq!(r?, vec![vec![0.0], vec![1.0], vec![2.0]]);
/// }
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct LocalComm<B = HostBuf> {
    rank: usize,
    group: Arc<Group<B>>,
    collectives: AtomicU64,
    splits: AtomicU64,
    /// Per peer: sends posted to it, receives posted from it (per-peer order numbers).
    sent: Mutex<Vec<u64>>,
    posted: Mutex<Vec<u64>>,
    /// This rank's deadline (the group's, until [`Communicator::set_deadline`]).
    deadline: super::DeadlineCell,
}

impl<B: Payload> LocalComm<B> {
    /// Creates the `size` ranks of a new group.
    pub fn group(size: usize, options: LocalOptions) -> Vec<LocalComm<B>> {
        let bytes = Arc::new((0..size).map(|_| AtomicU64::new(0)).collect());
        let g = Arc::new(Group::new((0..size).collect(), options, Arc::new(Failure::default()), bytes));
        (0..size).map(|rank| LocalComm::member(rank, g.clone())).collect()
    }

    fn member(rank: usize, group: Arc<Group<B>>) -> Self {
        let n = group.size;
        LocalComm {
            rank,
            collectives: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            sent: Mutex::new(vec![0; n]),
            posted: Mutex::new(vec![0; n]),
            deadline: super::DeadlineCell::new(group.options.deadline),
            group,
        }
    }

    /// The matching key of the next send to (`sent`) or receive from `peer` with `tag`, and
    /// advances the per-peer count.
    fn next_key(&self, counts: &Mutex<Vec<u64>>, peer: usize, tag: Tag) -> u64 {
        let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = c[peer];
        c[peer] += 1;
        match self.group.options.order {
            MessageOrder::Tag => tag,
            MessageOrder::PerPeerFifo => n,
        }
    }

    /// Range check only: a failed group is reported by the waits, after they have looked for
    /// the message, so that data already sent before a peer failed is still delivered (every
    /// rank of a failed handshake then reports the same error).
    fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
        if peer >= self.group.size {
            return Err(Error::InvalidArgument(format!(
                "{op}: rank {peer} out of range for {} ranks",
                self.group.size
            )));
        }
        Ok(())
    }
}

impl<B: Payload> Communicator for LocalComm<B> {
    type Buf = B;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn deadline(&self) -> Duration {
        self.deadline.get()
    }

    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        self.deadline.set(deadline)
    }

    fn isend(&self, to: usize, tag: Tag, data: B) -> Result<SendHandle> {
        self.check_peer(to, "send")?;
        let g = &self.group;
        let bytes = data.bytes();
        g.bytes[g.global[self.rank]].fetch_add(bytes, Ordering::Relaxed);
        let now = Instant::now();
        let deliver_at = match g.options.link {
            None => now,
            Some(link) => {
                let mut free = g.link_free.lock().unwrap_or_else(|e| e.into_inner());
                let slot = &mut free[self.rank * g.size + to];
                let start = (*slot).max(now);
                *slot = start + Duration::from_secs_f64(bytes as f64 / link.bandwidth.max(1.0));
                *slot + link.latency
            }
        };
        let key = self.next_key(&self.sent, to, tag);
        let mb = &g.mailboxes[to];
        mb.queue.lock().unwrap_or_else(|e| e.into_inner()).entry((self.rank, key)).or_default().push_back(Message {
            deliver_at,
            tag,
            data,
        });
        mb.ready.notify_all();
        Ok(SendHandle::done())
    }

    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<B>> {
        self.check_peer(from, "recv")?;
        let key = self.next_key(&self.posted, from, tag);
        let g = self.group.clone();
        let me = self.rank;
        let deadline = self.deadline();
        Ok(RecvHandle::new(move || {
            let give_up = Instant::now() + deadline;
            let mb = &g.mailboxes[me];
            let mut q = mb.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let now = Instant::now();
                let mut wake = give_up;
                let mut pending = false;
                if let Some(list) = q.get_mut(&(from, key)) {
                    match list.front().map(|m| m.deliver_at) {
                        Some(at) if at <= now => {
                            if let Some(m) = list.pop_front() {
                                if list.is_empty() {
                                    q.remove(&(from, key));
                                }
                                if m.tag != tag {
                                    return Err(Error::MessageOrder(format!(
                                        "receive #{key} from rank {} was posted for {}, but that rank's send \
                                         #{key} to rank {} is {}",
                                        g.global[from],
                                        super::describe_tag(tag),
                                        g.global[me],
                                        super::describe_tag(m.tag)
                                    )));
                                }
                                if m.data.elements() != len || m.data.elem() != elem {
                                    return Err(Error::ShapeMismatch(format!(
                                        "recv ({}) from rank {}: {} {} values, expected {len} {elem}",
                                        super::describe_tag(tag),
                                        g.global[from],
                                        m.data.elements(),
                                        m.data.elem()
                                    )));
                                }
                                return Ok(m.data);
                            }
                        }
                        Some(at) => {
                            pending = true;
                            wake = wake.min(at);
                        }
                        None => {}
                    }
                }
                if let Some((rank, reason)) = g.failure.get() {
                    return Err(Error::PeerFailed { rank, reason });
                }
                // Its thread returned and the message is not here: it never will be.
                if !pending && g.failure.departed(g.global[from]) {
                    return Err(Error::PeerFailed {
                        rank: g.global[from],
                        reason: format!(
                            "rank {} returned without sending {} to rank {}: every rank must run the same \
                             collectives (each forward, backward and gradient all-reduce its peers run)",
                            g.global[from],
                            super::describe_tag(tag),
                            g.global[me]
                        ),
                    });
                }
                if now >= give_up {
                    return Err(Error::Timeout {
                        op: format!("recv ({})", super::describe_tag(tag)),
                        peer: g.global[from],
                        after: deadline,
                    });
                }
                // Poll the failure flag at least every 10 ms.
                let wait = (wake - now).min(Duration::from_millis(10));
                q = mb.ready.wait_timeout(q, wait).unwrap_or_else(|e| e.into_inner()).0;
            }
        }))
    }

    fn depart(&self) {
        let me = self.group.global[self.rank];
        let mut d = self.group.failure.departed.lock().unwrap_or_else(|e| e.into_inner());
        if !d.contains(&me) {
            d.push(me);
        }
        drop(d);
        for mb in &self.group.mailboxes {
            mb.ready.notify_all();
        }
    }

    fn abort(&self, reason: &str) {
        let mut first = self.group.failure.first.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some((self.group.global[self.rank], reason.to_string()));
        }
        drop(first);
        for mb in &self.group.mailboxes {
            mb.ready.notify_all();
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = B>>> {
        // Exchange (color, key) through a side group of host vectors sharing this group's
        // failure state, so that any payload type can split.
        let meta = self.meta()?;
        let all = super::split_members(&meta, color, key)?;
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let mut members: Vec<(usize, usize)> =
            all.iter().enumerate().filter(|(_, ck)| ck.0 == color).map(|(r, ck)| (ck.1, r)).collect();
        members.sort_unstable();
        let my_index = members.iter().position(|&(_, r)| r == self.rank).unwrap_or(0);
        let global: Vec<usize> = members.iter().map(|&(_, r)| self.group.global[r]).collect();
        let sub = {
            let mut reg = self.group.splits.lock().unwrap_or_else(|e| e.into_inner());
            let entry = reg.entry((seq, color)).or_insert_with(|| {
                let g = Group::new(
                    global.clone(),
                    self.group.options,
                    self.group.failure.clone(),
                    self.group.bytes.clone(),
                );
                (Arc::new(g), 0)
            });
            entry.1 += 1;
            let sub = entry.0.clone();
            if entry.1 == global.len() {
                reg.remove(&(seq, color));
            }
            sub
        };
        let child = LocalComm::member(my_index, sub);
        child.deadline.set(self.deadline())?;
        Ok(Box::new(child))
    }

    fn next_collective_tag(&self) -> Tag {
        COLLECTIVE_TAG + self.collectives.fetch_add(1, Ordering::Relaxed)
    }

    fn bytes_sent(&self) -> u64 {
        self.group.bytes[self.group.global[self.rank]].load(Ordering::Relaxed)
    }
}

impl<B: Payload> LocalComm<B> {
    /// A host-buffer communicator over the same ranks, deadline and failure state, for the
    /// metadata of `split`. Every member gets the same side group, created by the first.
    fn meta(&self) -> Result<LocalComm<HostBuf>> {
        let g = &self.group;
        let mut slot = g.meta.lock().unwrap_or_else(|e| e.into_inner());
        let mg = slot
            .get_or_insert_with(|| {
                Arc::new(Group::new(
                    g.global.clone(),
                    g.options,
                    g.failure.clone(),
                    Arc::new((0..g.bytes.len()).map(|_| AtomicU64::new(0)).collect()),
                ))
            })
            .clone();
        drop(slot);
        let c = LocalComm::member(self.rank, mg);
        c.collectives.store(self.splits.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(c)
    }
}

/// Runs `f` on `world` in-process ranks (one thread each) and returns every rank's result,
/// indexed by rank. A rank whose closure errors or panics aborts the group, so the others
/// fail promptly with [`Error::PeerFailed`] instead of waiting for it (except for
/// [`Error::Handshake`], which every rank finds by itself).
pub fn spmd<B: Payload, T: Send>(
    world: usize,
    options: LocalOptions,
    f: impl Fn(&LocalComm<B>) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    run_each(&LocalComm::<B>::group(world, options), options.threads_per_rank, f)
}

/// [`spmd`] with each rank's communicator handed over as an owned `Arc` (what a `'static`
/// operation of a training framework can keep, e.g. through
/// [`crate::parallel::ParallelPlan::new_shared`]): one thread per rank; a rank that errors or
/// panics aborts the group, so the others fail promptly instead of waiting.
///
/// ```
/// use std::sync::Arc;
/// use ringattn::comm::{spmd_shared, Communicator, LocalOptions};
/// let sizes = spmd_shared(3, LocalOptions::default(), |comm: Arc<dyn Communicator<Buf = ringattn::HostBuf>>| {
///     let kept = comm.clone(); // e.g. moved into an operation that outlives this call
///     Ok(kept.size())
/// });
/// assert!(sizes.into_iter().all(|s| s.ok() == Some(3)));
/// ```
pub fn spmd_shared<T: Send>(
    world: usize,
    options: LocalOptions,
    f: impl Fn(Arc<dyn Communicator<Buf = HostBuf>>) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let comms: Vec<Arc<LocalComm<HostBuf>>> = LocalComm::group(world, options).into_iter().map(Arc::new).collect();
    run_each(&comms, options.threads_per_rank, |c| f(c.clone()))
}

/// [`spmd_shared`] over the members of any group (a `cuda::DeviceComm` group of
/// ranks sharing one GPU, or any other [`Communicator`]): one thread per rank, each handed
/// its own member as an owned `Arc`; a rank whose closure errors or panics aborts the group,
/// so the others fail promptly instead of waiting. Results are indexed by position in
/// `members`.
///
/// ```
/// use std::sync::Arc;
/// use ringattn::comm::{spmd_owned, Communicator, LocalComm, LocalOptions};
/// let members = LocalComm::<ringattn::HostBuf>::group(2, LocalOptions::default());
/// let ranks = spmd_owned(members, |comm: Arc<dyn Communicator<Buf = ringattn::HostBuf>>| Ok(comm.rank()));
/// assert_eq!(ranks.into_iter().map(|r| r.unwrap()).collect::<Vec<_>>(), vec![0, 1]);
/// ```
pub fn spmd_owned<C, T: Send>(
    members: Vec<C>,
    f: impl Fn(Arc<dyn Communicator<Buf = C::Buf>>) -> Result<T> + Sync,
) -> Vec<Result<T>>
where
    C: Communicator + Send + Sync + 'static,
{
    let comms: Vec<Arc<C>> = members.into_iter().map(Arc::new).collect();
    run_each(&comms, None, |c| f(c.clone()))
}

/// The SPMD core of [`spmd`] over any communicators of one group, one thread each (in a
/// rayon pool of `threads_per_rank` threads when given): a rank that errors or panics
/// aborts the group (handshake errors excepted: every rank finds them).
pub(crate) fn run_each<C: Communicator + Sync, T: Send>(
    comms: &[C],
    threads_per_rank: Option<usize>,
    f: impl Fn(&C) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    // Ranks as threads: candle's one CPU pool per process would make them queue.
    #[cfg(feature = "candle")]
    crate::candle::share_cores_among_rank_threads(comms.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let f = &f;
                scope.spawn(move || {
                    let run = || match threads_per_rank {
                        None => f(c),
                        Some(n) => rayon::ThreadPoolBuilder::new()
                            .num_threads(n.max(1))
                            .build()
                            .map_err(|e| Error::InvalidArgument(format!("rank {}: thread pool: {e}", c.rank())))?
                            .install(|| f(c)),
                    };
                    let r = catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|panic| {
                        let msg = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "panic".into());
                        Err(Error::InvalidArgument(format!("rank {} panicked: {msg}", c.rank())))
                    });
                    // A handshake error is found by every rank from the same gathered data, so
                    // it needs no abort (which could cut a slower rank's gather short).
                    match &r {
                        Err(e) if !matches!(e, Error::PeerFailed { .. } | Error::Handshake(_)) => {
                            c.abort(&e.to_string())
                        }
                        Err(_) => {}
                        // Done: a peer still waiting for this rank fails at once.
                        Ok(_) => c.depart(),
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("rank thread died".into()))))
            .collect()
    })
}
