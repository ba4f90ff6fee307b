//! Ranks as processes: [`MpiComm`], a [`Communicator`] of [`HostBuf`]s over MPI
//! (feature `mpi`), for the CPU backend across processes and nodes.
//!
//! The `mpi` crate initialises MPI and finalises it; the transfers use the raw calls it
//! re-exports (`MPI_Isend`, `MPI_Irecv`, `MPI_Test`), because the crate's requests are
//! scoped to a borrow of their buffer, whereas a [`Communicator`] hands out owned handles
//! whose waits poll up to a deadline. Every request owns its buffer until MPI has finished
//! with it, so dropping a handle early never frees memory MPI still writes.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ::mpi::ffi;

use super::{Communicator, Payload, RecvHandle, SendHandle, Tag, COLLECTIVE_TAG};
use crate::{Elem, Error, HostBuf, HostData, Result};

/// MPI tags below this carry point-to-point tags (folded modulo it); collective tags map
/// above it.
const P2P_TAG_LIMIT: Tag = 1 << 24;
/// Largest number of bytes per MPI message (counts are C ints); longer buffers travel as
/// several messages with the same tag, which MPI delivers in order.
const CHUNK: usize = 1 << 30;

/// Every MPI call of this module holds this lock, so the module is correct whatever thread
/// level the library provides (at least `MPI_THREAD_SERIALIZED` is required).
static MPI_LOCK: Mutex<()> = Mutex::new(());

pub(super) fn locked<T>(f: impl FnOnce() -> T) -> T {
    let _guard = MPI_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    f()
}

pub(super) fn check(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Mpi(format!("{what} failed with MPI error code {code}")))
    }
}

/// An MPI handle (a pointer in Open MPI) that may move between threads: every use goes
/// through [`MPI_LOCK`].
#[derive(Clone, Copy)]
struct Handle<T>(T);
// SAFETY: MPI handles are opaque identifiers valid in every thread of the process; all calls
// using them are serialised by MPI_LOCK.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

/// Options of [`MpiComm::init`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MpiOptions {
    /// Deadline of every wait.
    pub deadline: Duration,
    /// How often the background thread drives pending transfers (MPI moves large messages
    /// only inside MPI calls, so without it a rank busy computing would stall its peers).
    pub progress_interval: Duration,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions { deadline: Duration::from_secs(300), progress_interval: Duration::from_micros(500) }
    }
}

/// One posted transfer: its MPI requests (one per chunk) and the buffer they read or write.
struct Request {
    state: Mutex<RequestState>,
    done: AtomicBool,
}

/// The memory of a transfer: a send's buffer (shared, never written while it is in flight:
/// writers of a [`HostBuf`] copy a shared one first) or a receive's bytes.
enum Transfer {
    Send(HostBuf),
    Recv(Vec<u8>),
}

struct RequestState {
    /// Pending requests (completed ones are `MPI_REQUEST_NULL` after `MPI_Test`).
    raw: Vec<Handle<ffi::MPI_Request>>,
    /// Chunk lengths in bytes, for the receive-size check.
    chunk_lens: Vec<usize>,
    buf: Transfer,
    error: Option<Error>,
    /// Whether a receive (its counts are checked).
    recv: bool,
}

impl Request {
    /// Tests every pending request once; returns whether all are complete.
    fn test(&self) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = true;
        for i in 0..st.raw.len() {
            // SAFETY: reading an extern constant of the MPI shim.
            let null = unsafe { ffi::RSMPI_REQUEST_NULL };
            if st.raw[i].0 == null {
                continue;
            }
            let mut flag: c_int = 0;
            // SAFETY: MPI_Status is plain data; MPI_Test fills it.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let mut req = st.raw[i].0;
            // SAFETY: `req` is a live request of this process; the buffer it uses is owned by
            // `st.buf` and outlives it.
            let code = locked(|| unsafe { ffi::MPI_Test(&mut req, &mut flag, &mut status) });
            st.raw[i] = Handle(req);
            if code != 0 || (st.recv && flag != 0 && status.MPI_ERROR != 0) {
                st.error.get_or_insert(Error::Mpi(format!(
                    "MPI_Test failed with MPI error code {} (a message longer than the receive?)",
                    if code != 0 { code } else { status.MPI_ERROR }
                )));
                st.raw[i] = Handle(null);
                continue;
            }
            if flag == 0 {
                all = false;
                continue;
            }
            if st.recv {
                let mut count: c_int = 0;
                // SAFETY: `status` was filled by the completed MPI_Test; RSMPI_UINT8_T is the
                // shim's MPI_UINT8_T.
                let code = locked(|| unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) });
                if code != 0 || count as usize != st.chunk_lens[i] {
                    let want = st.chunk_lens[i];
                    st.error.get_or_insert(Error::ShapeMismatch(format!(
                        "message chunk of {count} bytes, expected {want}"
                    )));
                }
            }
        }
        if all {
            self.done.store(true, Ordering::Release);
        }
        all
    }
}

/// The transfers the progress thread drives.
#[derive(Default)]
struct Progress {
    pending: Mutex<Vec<Arc<Request>>>,
}

impl Progress {
    fn add(&self, r: &Arc<Request>) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).push(r.clone());
    }

    /// Tests every pending transfer once and forgets the completed ones; returns how many
    /// remain.
    fn drive(&self) -> usize {
        let list: Vec<Arc<Request>> = self.pending.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for r in &list {
            r.test();
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|r| !r.done.load(Ordering::Acquire));
        pending.len()
    }
}

/// What every communicator of one process shares: MPI's lifetime, the deadline, the byte
/// count and the transfers in flight.
struct Root {
    /// Finalises MPI when dropped (after every sub-communicator has freed its handle).
    universe: Mutex<Option<::mpi::environment::Universe>>,
    /// This process's deadline (`options.deadline` until [`Communicator::set_deadline`]; one
    /// process is one rank, so every communicator of it shares it).
    deadline: super::DeadlineCell,
    bytes: AtomicU64,
    world_rank: usize,
    tag_ub: u64,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
}

impl Drop for Root {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Let outstanding transfers finish (bounded by the deadline). MPI_Finalize with
        // transfers still pending could wait forever: then the process leaves without it and
        // the launcher ends the job with an error instead.
        let give_up = Instant::now() + self.deadline.get();
        while self.progress.drive() > 0 {
            if Instant::now() >= give_up {
                eprintln!("ringattn: rank {}: transfers still pending at exit; MPI not finalised", self.world_rank);
                if let Some(u) = self.universe.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    std::mem::forget(u);
                }
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let u = self.universe.lock().unwrap_or_else(|e| e.into_inner()).take();
        locked(|| drop(u));
    }
}

/// One rank of an MPI job, as a [`Communicator`] of [`HostBuf`]s (sent as their bytes).
///
/// Launch with `mpirun -n P program` (or `srun`); [`MpiComm::init`] initialises MPI once per
/// process and returns the world communicator; [`Communicator::split`] makes sub-groups
/// (Ulysses groups, rings). Waits poll `MPI_Test` up to the deadline and then fail with
/// [`Error::Timeout`] naming the peer and the operation; a background thread drives
/// transfers while the rank computes. [`Communicator::abort`] ends the whole job through
/// `MPI_Abort` (a rank cannot tell other processes it failed any other way): a rank that
/// fails must call it, as `ringattn run --comm mpi` does, so that its peers do not wait out
/// their deadlines; a rank that dies is noticed by the launcher, which ends the job. MPI is
/// finalised when the last communicator is dropped.
///
/// ```no_run
/// use ringattn::comm::{all_gather, Communicator, MpiComm, MpiOptions};
/// // Run under `mpirun -n 4`.
/// let world = MpiComm::init(MpiOptions::default())?;
/// let all = all_gather(&world, vec![world.rank() as f32].into())?;
/// assert_eq!(all.len(), world.size());
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct MpiComm {
    root: Arc<Root>,
    /// This communicator's own MPI communicator (a duplicate of the world's, or a split).
    comm: Handle<ffi::MPI_Comm>,
    rank: usize,
    size: usize,
    /// World rank of each member, for messages.
    global: Vec<usize>,
    collectives: AtomicU64,
}

impl MpiComm {
    /// Initialises MPI (thread level at least serialised) and returns the world communicator
    /// of this process. Without a launcher the process is a job of one rank.
    ///
    /// # Errors
    /// [`Error::Mpi`] when MPI was already initialised in this process, when the library
    /// provides less than `MPI_THREAD_SERIALIZED`, or when a call fails.
    pub fn init(options: MpiOptions) -> Result<MpiComm> {
        use ::mpi::environment::Threading;
        let (universe, level) = ::mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Mpi("MPI is already initialised in this process (call MpiComm::init once)".into()))?;
        if !matches!(level, Threading::Serialized | Threading::Multiple) {
            return Err(Error::Mpi(format!(
                "the MPI library provides thread level {level:?}; ringattn needs Serialized"
            )));
        }
        // SAFETY: MPI is initialised; the shim's constants are valid; every out-pointer is a
        // local.
        let (comm, rank, size, tag_ub) = locked(|| unsafe {
            let mut comm: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
            check(ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut comm), "MPI_Comm_dup")?;
            check(ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN), "MPI_Comm_set_errhandler")?;
            let (mut rank, mut size) = (0, 0);
            check(ffi::MPI_Comm_rank(comm, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(comm, &mut size), "MPI_Comm_size")?;
            let mut value: *mut c_int = std::ptr::null_mut();
            let mut flag: c_int = 0;
            check(
                ffi::MPI_Comm_get_attr(
                    ffi::RSMPI_COMM_WORLD,
                    ffi::MPI_TAG_UB as c_int,
                    (&mut value as *mut *mut c_int).cast::<c_void>(),
                    &mut flag,
                ),
                "MPI_Comm_get_attr(MPI_TAG_UB)",
            )?;
            let tag_ub = if flag != 0 && !value.is_null() { *value as u64 } else { 32767 };
            Ok::<_, Error>((Handle(comm), rank as usize, size as usize, tag_ub))
        })?;
        if tag_ub < 2 * P2P_TAG_LIMIT {
            return Err(Error::Mpi(format!("MPI_TAG_UB is {tag_ub}; ringattn needs at least {}", 2 * P2P_TAG_LIMIT)));
        }
        let progress = Arc::new(Progress::default());
        let stop = Arc::new(AtomicBool::new(false));
        spawn_progress(Arc::downgrade(&progress), stop.clone(), options.progress_interval);
        let root = Arc::new(Root {
            universe: Mutex::new(Some(universe)),
            deadline: super::DeadlineCell::new(options.deadline),
            bytes: AtomicU64::new(0),
            world_rank: rank,
            tag_ub,
            progress,
            stop,
        });
        Ok(MpiComm { root, comm, rank, size, global: (0..size).collect(), collectives: AtomicU64::new(0) })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn world_rank(&self) -> usize {
        self.root.world_rank
    }

    /// This communicator's MPI handle (for the native collectives).
    pub(super) fn raw_comm(&self) -> ffi::MPI_Comm {
        self.comm.0
    }

    /// `MPI_REQUEST_NULL`.
    pub(super) fn null_request(&self) -> ffi::MPI_Request {
        // SAFETY: reading an extern constant of the MPI shim.
        unsafe { ffi::RSMPI_REQUEST_NULL }
    }

    /// Counts `bytes` as sent by this rank.
    pub(super) fn count_sent(&self, bytes: u64) {
        self.root.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn mpi_tag(&self, tag: Tag, op: &str) -> Result<c_int> {
        // Point-to-point tags fold into MPI's range: tag blocks (`next_tag_block`) of calls
        // P2P_TAG_LIMIT / TAG_BLOCK apart share MPI tags, long after their messages are
        // matched (a call completes its messages before the next starts).
        let t = if tag >= COLLECTIVE_TAG {
            P2P_TAG_LIMIT + (tag - COLLECTIVE_TAG) % (self.root.tag_ub - P2P_TAG_LIMIT)
        } else {
            tag % P2P_TAG_LIMIT
        };
        c_int::try_from(t).map_err(|_| Error::InvalidArgument(format!("{op}: tag {tag} maps outside MPI's tags")))
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<()> {
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!("{op}: rank {peer} out of range for {} ranks", self.size)));
        }
        Ok(())
    }

    /// Waits for `req` up to the deadline.
    fn wait(root: &Arc<Root>, req: &Request, op: String, peer: usize) -> Result<()> {
        let deadline = root.deadline.get();
        let give_up = Instant::now() + deadline;
        // Spin (yielding the core) for the first millisecond — a message between processes
        // of one host arrives in microseconds — then sleep, longer and longer up to 1 ms.
        let spin_until = Instant::now() + Duration::from_millis(1);
        let mut nap = Duration::from_micros(20);
        loop {
            if req.test() {
                let mut st = req.state.lock().unwrap_or_else(|e| e.into_inner());
                return match st.error.take() {
                    None => Ok(()),
                    Some(Error::ShapeMismatch(m)) => Err(Error::ShapeMismatch(format!("{op} from rank {peer}: {m}"))),
                    Some(e) => Err(Error::Mpi(format!("{op} with rank {peer}: {e}"))),
                };
            }
            if Instant::now() >= give_up {
                return Err(Error::Timeout { op, peer, after: deadline });
            }
            if Instant::now() < spin_until {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Posts the bytes of `buf` in chunks: sends, or receives into a receive's bytes.
    fn post(&self, peer: usize, tag: c_int, buf: Transfer) -> Result<Arc<Request>> {
        let (recv, len) = match &buf {
            Transfer::Send(b) => (false, b.data().as_bytes().len()),
            Transfer::Recv(b) => (true, b.len()),
        };
        let chunk_lens: Vec<usize> =
            if len == 0 { vec![0] } else { (0..len).step_by(CHUNK).map(|s| CHUNK.min(len - s)).collect() };
        let req = Arc::new(Request {
            state: Mutex::new(RequestState { raw: Vec::new(), chunk_lens: chunk_lens.clone(), buf, error: None, recv }),
            done: AtomicBool::new(false),
        });
        {
            let mut st = req.state.lock().unwrap_or_else(|e| e.into_inner());
            let mut off = 0;
            for &n in &chunk_lens {
                // SAFETY: the pointer stays valid: `st.buf` is never resized or written while
                // requests are pending (a send's shared buffer is immutable; writers copy it)
                // and is owned by `req`, which lives (in the progress list at least) until MPI
                // has completed them. MPI only reads a send's memory.
                let ptr = unsafe {
                    match &mut st.buf {
                        Transfer::Send(b) => b.data().as_bytes().as_ptr().cast_mut().add(off),
                        Transfer::Recv(b) => b.as_mut_ptr().add(off),
                    }
                };
                // SAFETY: reading an extern constant of the MPI shim.
                let mut raw = unsafe { ffi::RSMPI_REQUEST_NULL };
                let code = locked(|| unsafe {
                    if recv {
                        ffi::MPI_Irecv(
                            ptr.cast::<c_void>(),
                            n as c_int,
                            ffi::RSMPI_UINT8_T,
                            peer as c_int,
                            tag,
                            self.comm.0,
                            &mut raw,
                        )
                    } else {
                        ffi::MPI_Isend(
                            ptr.cast::<c_void>(),
                            n as c_int,
                            ffi::RSMPI_UINT8_T,
                            peer as c_int,
                            tag,
                            self.comm.0,
                            &mut raw,
                        )
                    }
                });
                check(code, if recv { "MPI_Irecv" } else { "MPI_Isend" })?;
                st.raw.push(Handle(raw));
                off += n;
            }
        }
        self.root.progress.add(&req);
        Ok(req)
    }
}

/// Drives pending transfers every `interval` until `stop` (or the list is gone).
fn spawn_progress(progress: Weak<Progress>, stop: Arc<AtomicBool>, interval: Duration) {
    let spawned = std::thread::Builder::new().name("ringattn-mpi-progress".into()).spawn(move || {
        while !stop.load(Ordering::Acquire) {
            match progress.upgrade() {
                Some(p) => {
                    p.drive();
                }
                None => return,
            }
            std::thread::sleep(interval);
        }
    });
    // Without the thread, transfers still progress inside the waits.
    drop(spawned);
}

impl Communicator for MpiComm {
    type Buf = HostBuf;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn deadline(&self) -> Duration {
        self.root.deadline.get()
    }

    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        self.root.deadline.set(deadline)
    }

    fn isend(&self, to: usize, tag: Tag, data: HostBuf) -> Result<SendHandle> {
        self.check_peer(to, "send")?;
        let t = self.mpi_tag(tag, "send")?;
        self.root.bytes.fetch_add(data.bytes(), Ordering::Relaxed);
        let req = self.post(to, t, Transfer::Send(data))?;
        let (root, peer) = (self.root.clone(), self.global[to]);
        Ok(SendHandle::new(move || MpiComm::wait(&root, &req, format!("send ({})", super::describe_tag(tag)), peer)))
    }

    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<HostBuf>> {
        self.check_peer(from, "recv")?;
        let t = self.mpi_tag(tag, "recv")?;
        let req = self.post(from, t, Transfer::Recv(vec![0; len * elem.size_of()]))?;
        let (root, peer) = (self.root.clone(), self.global[from]);
        Ok(RecvHandle::new(move || {
            MpiComm::wait(&root, &req, format!("recv ({})", super::describe_tag(tag)), peer)?;
            let mut st = req.state.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut st.buf, Transfer::Recv(Vec::new())) {
                Transfer::Recv(bytes) => Ok(HostBuf::new(HostData::from_bytes(elem, &bytes)?)),
                Transfer::Send(_) => Err(Error::Mpi("internal: a receive holding a send".into())),
            }
        }))
    }

    fn abort(&self, reason: &str) {
        // One write, so that the lines of several ranks do not interleave.
        let line = format!("ringattn: rank {} aborts the MPI job: {reason}\n", self.root.world_rank);
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        // SAFETY: MPI is initialised (this communicator exists).
        locked(|| unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) });
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = HostBuf>>> {
        // A deadline-bounded exchange first: once every rank has arrived, the blocking
        // MPI_Comm_split cannot wait on a missing peer.
        let all = super::split_members(self, color, key)?;
        let mut members: Vec<(usize, usize)> =
            all.iter().enumerate().filter(|(_, ck)| ck.0 == color).map(|(r, ck)| (ck.1, r)).collect();
        members.sort_unstable();
        let rank = members.iter().position(|&(_, r)| r == self.rank).unwrap_or(0);
        let global: Vec<usize> = members.iter().map(|&(_, r)| self.global[r]).collect();
        let (c, k) = (c_int::try_from(color), c_int::try_from(key));
        let (Ok(c), Ok(k)) = (c, k) else {
            return Err(Error::InvalidArgument(format!("split: color {color} or key {key} too large for MPI")));
        };
        // SAFETY: `self.comm` is a live communicator; out-pointers are locals.
        let comm = locked(|| unsafe {
            let mut comm: ffi::MPI_Comm = ffi::RSMPI_COMM_NULL;
            check(ffi::MPI_Comm_split(self.comm.0, c, k, &mut comm), "MPI_Comm_split")?;
            check(ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN), "MPI_Comm_set_errhandler")?;
            Ok::<_, Error>(Handle(comm))
        })?;
        Ok(Box::new(MpiComm {
            root: self.root.clone(),
            comm,
            rank,
            size: global.len(),
            global,
            collectives: AtomicU64::new(0),
        }))
    }

    fn next_collective_tag(&self) -> Tag {
        COLLECTIVE_TAG + self.collectives.fetch_add(1, Ordering::Relaxed)
    }

    fn bytes_sent(&self) -> u64 {
        self.root.bytes.load(Ordering::Relaxed)
    }

    /// `MPI_Ialltoallv` (after one small exchange of every rank's sizes); the portable batch
    /// of messages when a count exceeds MPI's `int`.
    fn all_to_all_v(&self, sends: Vec<HostBuf>, recv_lens: &[usize]) -> Result<Vec<HostBuf>> {
        super::check_all_to_all(self.size, self.rank, &sends, recv_lens)?;
        match self.native_all_to_all_v(&sends, recv_lens)? {
            Some(got) => {
                let own = sends[self.rank].bytes();
                self.count_sent(sends.iter().map(Payload::bytes).sum::<u64>() - own);
                Ok(got)
            }
            None => super::exchange(self, sends, recv_lens),
        }
    }

    /// `MPI_Iallgatherv` (after one small exchange of every rank's sizes); the portable
    /// version when a count exceeds MPI's `int`.
    fn all_gather_v(&self, data: HostBuf, lens: &[usize]) -> Result<Vec<HostBuf>> {
        match self.native_all_gather_v(&data, lens)? {
            Some(got) => {
                self.count_sent(data.bytes() * (self.size as u64 - 1));
                Ok(got)
            }
            None => super::exchange(self, vec![data; self.size], lens),
        }
    }

    /// `MPI_Ibcast` (after one small exchange of every rank's size); the portable version
    /// when the buffer exceeds MPI's `int` count.
    fn broadcast(&self, data: HostBuf, root: usize) -> Result<HostBuf> {
        if root >= self.size {
            return Err(Error::InvalidArgument(format!("broadcast: root {root} out of range for {} ranks", self.size)));
        }
        match self.native_broadcast(&data, root)? {
            Some(got) => {
                if self.rank == root {
                    self.count_sent(data.bytes() * (self.size as u64 - 1));
                }
                Ok(got)
            }
            None => super::broadcast_p2p(self, data, root),
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let mut c = self.comm.0;
        // SAFETY: this communicator created `c`; pending transfers on it keep it alive in MPI
        // until they complete (MPI_Comm_free only marks it for deallocation).
        locked(|| unsafe { ffi::MPI_Comm_free(&mut c) });
    }
}
