//! [`NcclComm`]: a [`Communicator`] of [`DeviceBuf`]s over NCCL (one rank per GPU, any
//! number of processes and nodes), through the functions of the NCCL that
//! [`super::nccl_lib`] loaded (its real names: `libnccl.so.2` first) and cudarc's
//! C types (`nccl_sys.rs`). The unique id reaches the ranks through [`super::bootstrap`].
//!
//! Nothing here has run on a GPU with NCCL in this repository's CI (no GPU there): the
//! library-free parts (loading NCCL from the PyPI wheel, environment parsing, the TCP id
//! exchange, the id broadcast over a host communicator, the completion polls, clean failure
//! without libcuda/libnccl) are tested; the NCCL calls are written against NCCL 2.30's
//! documented non-blocking API.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::nccl_sys as sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::bootstrap::{broadcast_unique_id, exchange_unique_id, BootstrapEnv};
use super::device_buf::DeviceBuf;
use super::health::{as_rank, event_state, poll_until, Progress};
use super::nccl_lib::{nccl, NcclLibrary};
use super::probe::{guard, probe, unwind};
use crate::comm::{Communicator, RecvHandle, SendHandle, Tag, COLLECTIVE_TAG};
use crate::{Error, Result};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// An NCCL unique id as bytes: created by rank 0 (`ncclGetUniqueId`), given to every rank
/// before [`NcclComm::init`].
pub type UniqueId = [u8; UNIQUE_ID_BYTES];

/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;
/// The config struct version the bindings describe (`ncclConfig_v22800`: NCCL 2.28).
const CONFIG_VERSION: u32 = 22800;

/// Checks that NCCL loads ([`nccl_lib::nccl`]: its real names, the override variables and
/// the usual folders).
fn nccl_present() -> Result<()> {
    nccl().map(|_| ())
}

/// Creates a unique id (`ncclGetUniqueId`): what rank 0 of a bootstrap calls.
///
/// # Errors
/// [`Error::Cuda`] without libcuda/libnccl, or when NCCL fails.
///
/// ```
/// // Without NCCL (or a GPU) this is an error, never a panic.
/// if let Err(e) = ringattn::cuda::new_unique_id() {
///     assert!(e.to_string().contains("CUDA") || e.to_string().contains("NCCL"), "{e}");
/// }
/// ```
pub fn new_unique_id() -> Result<UniqueId> {
    probe()?;
    let lib = nccl()?;
    let mut raw = sys::ncclUniqueId { internal: [0 as c_char; UNIQUE_ID_BYTES] };
    // SAFETY: ncclGetUniqueId writes one ncclUniqueId through the pointer, which is valid.
    nccl_call("ncclGetUniqueId", || unsafe { (lib.get_unique_id)(&mut raw) })?;
    let mut id = [0u8; UNIQUE_ID_BYTES];
    for (b, &c) in id.iter_mut().zip(raw.internal.iter()) {
        *b = c as u8;
    }
    Ok(id)
}

/// The text of an NCCL result code.
/// NCCL's type of a buffer's elements.
fn nccl_type(elem: crate::Elem) -> sys::ncclDataType_t {
    match elem {
        crate::Elem::BF16 => sys::ncclDataType_t::ncclBfloat16,
        crate::Elem::F16 => sys::ncclDataType_t::ncclFloat16,
        crate::Elem::U8 => sys::ncclDataType_t::ncclUint8,
        _ => sys::ncclDataType_t::ncclFloat32,
    }
}

fn nccl_text(r: sys::ncclResult_t) -> String {
    nccl().map_or_else(|_| format!("{r:?}"), |lib| lib.error_text(r))
}

/// Runs an NCCL call, turning a failure (or a panic of the bindings) into [`Error::Cuda`];
/// returns whether the call is still in progress (non-blocking communicators).
fn nccl_call(what: &str, f: impl FnOnce() -> sys::ncclResult_t) -> Result<bool> {
    let r = unwind(what, f)?;
    match r {
        sys::ncclResult_t::ncclSuccess => Ok(false),
        sys::ncclResult_t::ncclInProgress => Ok(true),
        e => Err(Error::Cuda(format!("NCCL {what}: {}", nccl_text(e)))),
    }
}

/// A raw communicator handle (NCCL allows its use from any thread; calls on it are
/// serialised by [`Inner::comm`]'s lock).
struct RawComm(sys::ncclComm_t);

// SAFETY: an ncclComm_t is an opaque handle NCCL allows any host thread to use; every call
// through it here holds the `Inner::comm` mutex, so none are concurrent.
unsafe impl Send for RawComm {}

/// How a group failed (shared by a root communicator and its splits).
#[derive(Clone)]
enum Failure {
    /// A rank called `abort`.
    Aborted { rank: usize, reason: String },
    /// NCCL reported an error (watchdog).
    Nccl(String),
    /// An operation did not complete within the deadline (watchdog).
    Timeout { op: String, peer: usize, after: Duration },
}

impl Failure {
    fn error(&self) -> Error {
        match self.clone() {
            Failure::Aborted { rank, reason } => Error::PeerFailed { rank, reason },
            Failure::Nccl(m) => Error::Cuda(m),
            Failure::Timeout { op, peer, after } => Error::Timeout { op, peer, after },
        }
    }
}

/// State shared by a root communicator and everything split from it.
#[derive(Default)]
struct Root {
    failure: Mutex<Option<Failure>>,
    members: Mutex<Vec<Weak<Inner>>>,
    bytes: AtomicU64,
}

impl Root {
    fn failure(&self) -> Option<Failure> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the first failure and aborts every member's NCCL communicator.
    fn fail(&self, f: Failure) {
        {
            let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(f);
            }
        }
        let members: Vec<_> = self.members.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for m in members.iter().filter_map(Weak::upgrade) {
            m.abort_comm();
        }
    }
}

/// A posted operation's completion.
#[derive(Clone)]
enum Slot {
    /// Not yet handed to NCCL.
    Posted,
    /// In a group whose end event is this.
    Flushed(Arc<CudaEvent>),
}

enum Kind {
    Send(DeviceBuf),
    Recv(DeviceBuf),
    /// `ncclAllReduce` (sum) of the first buffer into the second.
    AllReduce(DeviceBuf, DeviceBuf),
    /// `ncclBroadcast` in place from the root.
    Broadcast(DeviceBuf, usize),
}

impl Kind {
    /// The buffers the operation uses (kept alive until its group has run).
    fn into_bufs(self) -> Vec<DeviceBuf> {
        match self {
            Kind::Send(b) | Kind::Recv(b) | Kind::Broadcast(b, _) => vec![b],
            Kind::AllReduce(a, b) => vec![a, b],
        }
    }
}

struct Op {
    peer: usize,
    tag: Tag,
    kind: Kind,
    slot: Arc<Mutex<Slot>>,
}

/// A flushed group: its end event, when it was enqueued, the buffers it uses (kept alive
/// until it has run), and a description for a timeout.
struct Flight {
    done: Arc<CudaEvent>,
    at: Instant,
    _bufs: Vec<DeviceBuf>,
    what: (String, usize),
}

#[derive(Default)]
struct State {
    pending: Vec<Op>,
    flights: Vec<Flight>,
}

struct Inner {
    lib: &'static NcclLibrary,
    comm: Mutex<Option<RawComm>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
    root: Arc<Root>,
    /// This communicator's deadline (inherited by its splits; [`Communicator::set_deadline`]).
    deadline: crate::comm::DeadlineCell,
    /// This rank in the root group (errors name it).
    global_rank: usize,
    stop: AtomicBool,
}

impl Inner {
    /// `ncclCommAbort`, once; later calls find no communicator.
    fn abort_comm(&self) {
        let taken = self.comm.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(c) = taken {
            let _ = guard("binding the context", || self.ctx.bind_to_thread());
            // SAFETY: `c` is a live communicator taken out of the lock: nothing else uses it.
            let _ = nccl_call("ncclCommAbort", || unsafe { (self.lib.comm_abort)(c.0) });
        }
    }

    /// Where a piece of this communicator's work stands; a CUDA error is an error (named as
    /// this rank's), never "not complete".
    fn event_state(&self, event: &CudaEvent, op: &str) -> Result<Progress> {
        as_rank(self.global_rank, || event_state(event, op))
    }

    fn flight_state(&self, f: &Flight) -> Result<Progress> {
        self.event_state(&f.done, &f.what.0)
    }

    /// Runs `f` with the communicator (bound context), or the group's failure.
    fn with_comm<T>(&self, f: impl FnOnce(sys::ncclComm_t) -> Result<T>) -> Result<T> {
        if let Some(fail) = self.root.failure() {
            return Err(fail.error());
        }
        let lock = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        match lock.as_ref() {
            Some(c) => {
                guard("binding the context", || self.ctx.bind_to_thread())?;
                f(c.0)
            }
            None => {
                Err(self.root.failure().map_or_else(|| Error::Cuda("NCCL communicator closed".into()), |f| f.error()))
            }
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
    fn settle(&self, what: &str) -> Result<()> {
        settle_with(self.deadline.get(), what, || self.with_comm(|c| in_progress(self.lib, c, what)))
    }

    /// Hands every posted operation to NCCL as one group on the stream and records its end
    /// event; the operations' slots point at it.
    fn flush(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Drop the buffers of groups that have run; a group whose event reports an error
        // fails the whole group (the device is unusable: nothing waits for its deadline).
        let mut failed = None;
        st.flights.retain(|f| match self.flight_state(f) {
            Ok(Progress::Complete) => false,
            Ok(Progress::Pending) => true,
            Err(e) => {
                failed.get_or_insert(e);
                true
            }
        });
        if let Some(e) = failed {
            self.root.fail(Failure::Nccl(e.to_string()));
            return Err(e);
        }
        if st.pending.is_empty() {
            return Ok(());
        }
        let ops = std::mem::take(&mut st.pending);
        let result = self.enqueue(&ops);
        let done = match result {
            Ok(done) => done,
            Err(e) => {
                self.root.fail(Failure::Nccl(e.to_string()));
                return Err(e);
            }
        };
        let first = ops.first().map(|o| (o.tag, o.peer)).unwrap_or((0, 0));
        let what = format!(
            "NCCL group of {} sends and receives, the first ({}) with rank {}",
            ops.len(),
            crate::comm::describe_tag(first.0),
            first.1
        );
        let mut bufs = Vec::with_capacity(ops.len());
        for op in ops {
            *op.slot.lock().unwrap_or_else(|e| e.into_inner()) = Slot::Flushed(done.clone());
            bufs.extend(op.kind.into_bufs());
        }
        st.flights.push(Flight { done, at: Instant::now(), _bufs: bufs, what: (what, first.1) });
        Ok(())
    }

    fn enqueue(&self, ops: &[Op]) -> Result<Arc<CudaEvent>> {
        let s = &self.stream;
        for op in ops {
            match &op.kind {
                Kind::Send(b) | Kind::AllReduce(b, _) | Kind::Broadcast(b, _) => b.wait_on(s)?,
                Kind::Recv(_) => {}
            }
        }
        let raw = s.cu_stream() as sys::cudaStream_t;
        self.with_comm(|c| {
            let lib = self.lib;
            nccl_call("ncclGroupStart", || unsafe { (lib.group_start)() })?;
            let mut posted = Ok(());
            for op in ops {
                let peer = op.peer as c_int;
                let r = match &op.kind {
                    Kind::Send(b) if !b.is_empty() => {
                        let (p, _g) = b.raw_ptr(s);
                        // SAFETY: `p` addresses `b.len()` values of `b.elem()` of a live buffer
                        // (kept alive by the flight until the group has run); the stream
                        // belongs to the communicator's device.
                        nccl_call("ncclSend", || unsafe {
                            (lib.send)(p as *const _, b.len(), nccl_type(b.elem()), peer, c, raw)
                        })
                    }
                    Kind::Recv(b) if !b.is_empty() => {
                        // The buffer was allocated on this stream for this receive; its
                        // handle gives it out only after the group's event, carried as its
                        // readiness event (every use waits on that), so the address is
                        // taken without cudarc's write tracking.
                        let (p, _g) = b.raw_ptr(s);
                        // SAFETY: as for the send; `p` holds `b.len()` values to be written.
                        nccl_call("ncclRecv", || unsafe {
                            (lib.recv)(p as *mut _, b.len(), nccl_type(b.elem()), peer, c, raw)
                        })
                    }
                    Kind::AllReduce(x, out) if !x.is_empty() => {
                        let (src, _gs) = x.raw_ptr(s);
                        let (dst, _gd) = out.raw_ptr(s);
                        // SAFETY: `src` and `dst` address `x.len()` values of `x.elem()` of
                        // live buffers (kept alive by the flight); `out` was allocated for
                        // this operation.
                        nccl_call("ncclAllReduce", || unsafe {
                            (lib.all_reduce)(
                                src as *const _,
                                dst as *mut _,
                                x.len(),
                                nccl_type(x.elem()),
                                sys::ncclRedOp_t::ncclSum,
                                c,
                                raw,
                            )
                        })
                    }
                    Kind::Broadcast(b, root) if !b.is_empty() => {
                        let (p, _g) = b.raw_ptr(s);
                        // SAFETY: in place: `p` addresses `b.len()` values of a live buffer
                        // that only this operation uses.
                        nccl_call("ncclBroadcast", || unsafe {
                            (lib.broadcast)(
                                p as *const _,
                                p as *mut _,
                                b.len(),
                                nccl_type(b.elem()),
                                *root as c_int,
                                c,
                                raw,
                            )
                        })
                    }
                    _ => Ok(false),
                };
                if let Err(e) = r {
                    posted = Err(e);
                    break;
                }
            }
            let end = nccl_call("ncclGroupEnd", || unsafe { (lib.group_end)() });
            posted?;
            end.map(|_| ())
        })?;
        self.settle("group of sends and receives")?;
        Ok(Arc::new(guard("recording an event", || s.record_event(None))?))
    }
}

/// Whether communicator `c` is still in progress (`ncclCommGetAsyncError`); its error, if it
/// has one, naming `what`.
fn in_progress(lib: &NcclLibrary, c: sys::ncclComm_t, what: &str) -> Result<bool> {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `c` is a live communicator of the caller's; one result is written.
    nccl_call("ncclCommGetAsyncError", || unsafe { (lib.comm_get_async_error)(c, &mut state) })?;
    match state {
        sys::ncclResult_t::ncclSuccess => Ok(false),
        sys::ncclResult_t::ncclInProgress => Ok(true),
        e => Err(Error::Cuda(format!("NCCL {what}: {}", nccl_text(e)))),
    }
}

/// Polls `busy` until it says the communicator is no longer in progress, for at most
/// `deadline`.
fn settle_with(deadline: Duration, what: &str, mut busy: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    while busy()? {
        if start.elapsed() >= deadline {
            return Err(Error::Timeout { op: format!("NCCL {what}"), peer: 0, after: deadline });
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

/// Watches a communicator: polls `ncclCommGetAsyncError` and the age of the flushed groups
/// every 10 ms; on an NCCL error or a group older than the deadline it fails the root group
/// (which aborts every NCCL communicator of it), so that every wait returns an error.
fn watchdog(inner: Weak<Inner>) {
    if let Some(me) = inner.upgrade() {
        // Event queries below need the context current on this thread.
        let _ = guard("binding the context", || me.ctx.bind_to_thread());
    }
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let Some(me) = inner.upgrade() else { return };
        if me.stop.load(Ordering::Relaxed) || me.root.failure().is_some() {
            return;
        }
        let status = me.with_comm(|c| {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `c` is live under the lock; one result is written.
            nccl_call("ncclCommGetAsyncError", || unsafe { (me.lib.comm_get_async_error)(c, &mut state) })?;
            Ok(state)
        });
        match status {
            Ok(sys::ncclResult_t::ncclSuccess) | Ok(sys::ncclResult_t::ncclInProgress) => {}
            Ok(e) => {
                me.root.fail(Failure::Nccl(format!(
                    "NCCL reported an error on rank {}: {}",
                    me.global_rank,
                    nccl_text(e)
                )));
                return;
            }
            Err(e) => {
                me.root.fail(Failure::Nccl(e.to_string()));
                return;
            }
        }
        // A group whose event reports a CUDA error fails the group now; one older than the
        // deadline fails it as a timeout.
        let verdict = {
            let st = me.state.lock().unwrap_or_else(|e| e.into_inner());
            st.flights.iter().find_map(|f| match me.flight_state(f) {
                Err(e) => Some(Err(e)),
                Ok(Progress::Pending) if f.at.elapsed() > me.deadline.get() => Some(Ok(f.what.clone())),
                Ok(_) => None,
            })
        };
        if let Some(Err(e)) = verdict {
            me.root.fail(Failure::Nccl(e.to_string()));
            return;
        }
        if let Some(Ok((op, peer))) = verdict {
            me.root.fail(Failure::Timeout { op, peer, after: me.deadline.get() });
            return;
        }
    }
}

/// One rank of a group over NCCL, moving [`DeviceBuf`]s between GPUs (one rank per GPU; any
/// number of processes and nodes).
///
/// * **Initialisation** is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`,
///   `ncclCommGetAsyncError` polled until success or the deadline): a rank whose peers never
///   come fails with [`Error::Timeout`] instead of hanging. The unique id comes from the
///   launcher's environment ([`NcclComm::from_env`], TCP from rank 0) or from any host
///   communicator ([`NcclComm::from_host_comm`], e.g. MPI).
/// * **Point-to-point**: [`Communicator::isend`] / [`Communicator::irecv`] only post; the
///   first wait of a receive hands every posted operation to NCCL as one group
///   (`ncclGroupStart` / `ncclSend` / `ncclRecv` / `ncclGroupEnd`) on the communicator's own
///   stream — NCCL matches sends and receives in issue order per peer (tags are only named
///   in errors; both sides must post in the same order, as the drivers do), and grouping
///   keeps a send from waiting for a receive queued behind it. A receive completes when
///   the group's event has (polled, bounded by the deadline) and its buffer carries that
///   event. A send's wait returns once posted: the buffer is captured (a [`DeviceBuf`] is
///   never written while shared) and kept alive until its group has run.
/// * **Failure**: a watchdog thread polls `ncclCommGetAsyncError` and the age of the flushed
///   groups; on an NCCL error or a group older than the deadline it aborts
///   (`ncclCommAbort`) every communicator of the group and its splits, so every wait
///   returns an error ([`Error::Cuda`] naming NCCL's error, [`Error::Timeout`]); a rank's
///   [`Communicator::abort`] does the same locally, and its peers see their operations fail
///   or time out.
/// * **Split**: `ncclCommSplit` (non-blocking, collective).
///
/// The receive length must equal what the peer sends: NCCL cannot check it.
///
/// ```no_run
/// // torchrun --nproc-per-node 8 ... (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
/// use std::time::Duration;
/// use ringattn::comm::{all_gather, Communicator};
/// use ringattn::cuda::{DeviceBuf, NcclComm};
/// let comm = NcclComm::from_env(Duration::from_secs(120))?;
/// let mine = DeviceBuf::upload(comm.stream(), &[comm.rank() as f32])?;
/// let all = all_gather(&comm, mine)?;
/// assert_eq!(all.len(), comm.size());
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct NcclComm {
    inner: Arc<Inner>,
    rank: usize,
    size: usize,
    collectives: AtomicU64,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

fn config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

impl NcclComm {
    /// Rank `rank` of `world` on GPU `device` (its primary context), joining the group of
    /// `id`. Every wait of the communicator, and its initialisation, is bounded by
    /// `deadline`.
    ///
    /// # Errors
    /// [`Error::Cuda`] without libcuda, a GPU or libnccl (checked before any NCCL call), or
    /// when NCCL fails; [`Error::Timeout`] when the other ranks do not join within
    /// `deadline`; [`Error::InvalidArgument`] for a rank outside the world.
    ///
    /// ```
    /// use std::time::Duration;
    /// // No GPU or NCCL here: an error, not a panic.
    /// let r = ringattn::cuda::NcclComm::init(0, 1, [0; 128], 0, Duration::from_secs(1));
    /// if let Err(e) = r {
    ///     println!("{e}");
    /// }
    /// ```
    pub fn init(rank: usize, world: usize, id: UniqueId, device: usize, deadline: Duration) -> Result<NcclComm> {
        if rank >= world {
            return Err(Error::InvalidArgument(format!("NCCL: rank {rank} outside a world of {world}")));
        }
        let dev = super::CudaDevice::shared(device)?;
        let lib = nccl()?;
        let ctx = dev.context().clone();
        let stream = guard("creating the NCCL stream", || ctx.new_stream())?;
        let mut raw = sys::ncclUniqueId { internal: [0 as c_char; UNIQUE_ID_BYTES] };
        for (c, &b) in raw.internal.iter_mut().zip(id.iter()) {
            *c = b as c_char;
        }
        guard("binding the context", || ctx.bind_to_thread())?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        // SAFETY: `comm` and `cfg` are valid for the call; NCCL copies the config.
        let started = nccl_call("ncclCommInitRankConfig", || unsafe {
            (lib.comm_init_rank_config)(&mut comm, world as c_int, raw, rank as c_int, &mut cfg)
        });
        if let Err(e) = started {
            if !comm.is_null() {
                // SAFETY: a communicator NCCL returned despite the error, owned here.
                let _ = nccl_call("ncclCommAbort", || unsafe { (lib.comm_abort)(comm) });
            }
            return Err(e);
        }
        let root = Arc::new(Root::default());
        NcclComm::start(lib, comm, ctx, stream, root, rank, world, rank, deadline, "initialisation")
    }

    /// Wraps a communicator being initialised: waits for it (deadline), then starts its
    /// watchdog. On failure the communicator is aborted.
    #[allow(clippy::too_many_arguments)]
    fn start(
        lib: &'static NcclLibrary,
        comm: sys::ncclComm_t,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        root: Arc<Root>,
        rank: usize,
        size: usize,
        global_rank: usize,
        deadline: Duration,
        what: &str,
    ) -> Result<NcclComm> {
        if comm.is_null() {
            return Err(Error::Cuda(format!("NCCL {what}: no communicator was created")));
        }
        let inner = Arc::new(Inner {
            lib,
            comm: Mutex::new(Some(RawComm(comm))),
            ctx,
            stream,
            state: Mutex::new(State::default()),
            root: root.clone(),
            deadline: crate::comm::DeadlineCell::new(deadline),
            global_rank,
            stop: AtomicBool::new(false),
        });
        if let Err(e) = inner.settle(what) {
            inner.abort_comm();
            return Err(e);
        }
        root.members.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&inner));
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name(format!("nccl-watchdog-{global_rank}"))
            .spawn(move || watchdog(weak))
            .map_err(|e| Error::Cuda(format!("NCCL: cannot start the watchdog thread: {e}")))?;
        Ok(NcclComm { inner, rank, size, collectives: AtomicU64::new(0) })
    }

    /// The communicator of a rank started by a launcher (torchrun, srun, mpirun, PMI):
    /// reads [`BootstrapEnv::from_env`], gets the unique id over TCP from rank 0 on the
    /// bootstrap port and joins on GPU `local rank mod visible devices`
    /// ([`super::device_ordinal`]).
    ///
    /// # Errors
    /// As [`BootstrapEnv::from_env`] and [`NcclComm::init`]; the unique id exchange fails on
    /// a port that cannot be bound (named with the variable that moves it) or a peer that
    /// never answers.
    pub fn from_env(deadline: Duration) -> Result<NcclComm> {
        let env = BootstrapEnv::from_env()?;
        // Fail before the exchange when this rank cannot use NCCL at all.
        let device = env.device(probe()?.device_count)?;
        nccl_present()?;
        let id = exchange_unique_id(&env, new_unique_id, deadline)?;
        NcclComm::init(env.rank, env.world, id, device, deadline)
    }

    /// The communicator over the ranks of a host communicator (MPI, ...): the unique id is
    /// broadcast through it ([`broadcast_unique_id`]); this rank joins on GPU `device`.
    /// Collective over `host`.
    ///
    /// # Errors
    /// As [`broadcast_unique_id`] and [`NcclComm::init`].
    pub fn from_host_comm(
        host: &dyn Communicator<Buf = crate::HostBuf>,
        device: usize,
        deadline: Duration,
    ) -> Result<NcclComm> {
        let id = broadcast_unique_id(host, new_unique_id)?;
        NcclComm::init(host.rank(), host.size(), id, device, deadline)
    }

    /// The stream NCCL runs on (upload buffers to send on it, or on any stream of the same
    /// context).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Hands every posted operation to NCCL now (receives do it on their first wait).
    ///
    /// # Errors
    /// NCCL errors, or the group's failure.
    pub fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    /// Checks that every rank passes `len` elements to a collective (NCCL cannot: unequal
    /// counts would hang or corrupt): one small exchange, the same error on every rank.
    fn agree_on_length(&self, op: &str, len: usize) -> Result<()> {
        let stream = &self.inner.stream;
        let mine = DeviceBuf::upload_host(stream, &crate::HostBuf::bytes((len as u64).to_le_bytes().to_vec()))?;
        let all = crate::comm::exchange(self, vec![mine; self.size], &vec![8; self.size])?;
        let mut lens = Vec::with_capacity(self.size);
        for b in &all {
            let record = b.download(stream)?;
            lens.push(u64::from_le_bytes(
                record.data().as_bytes().try_into().map_err(|_| Error::Cuda(format!("{op}: a bad size record")))?,
            ));
        }
        match lens.iter().position(|&n| n != lens[0]) {
            Some(i) => Err(Error::ShapeMismatch(format!(
                "NCCL {op}: rank {i} passes {} values, rank 0 passes {}",
                lens[i], lens[0]
            ))),
            None => Ok(()),
        }
    }

    /// Posts one collective operation, hands it to NCCL at once and returns its group's end
    /// event.
    fn collective(&self, kind: Kind) -> Result<Arc<CudaEvent>> {
        let tag = self.next_collective_tag();
        let slot = self.post(0, tag, kind)?;
        self.inner.flush()?;
        let state = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match state {
            Slot::Flushed(event) => Ok(event),
            Slot::Posted => Err(Error::Cuda("internal: a flushed collective without its event".into())),
        }
    }

    fn post(&self, peer: usize, tag: Tag, kind: Kind) -> Result<Arc<Mutex<Slot>>> {
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!("NCCL: rank {peer} out of range for {} ranks", self.size)));
        }
        if let Some(f) = self.inner.root.failure() {
            return Err(f.error());
        }
        let slot = Arc::new(Mutex::new(Slot::Posted));
        let op = Op { peer, tag, kind, slot: slot.clone() };
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner()).pending.push(op);
        Ok(slot)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::Relaxed);
        // Hand over what is still posted, let the groups run (bounded), then release the
        // communicator; anything unfinished is aborted instead. Errors cannot be returned
        // here: they were (or will be) reported by the waits.
        let _ = inner.flush();
        let _ = guard("binding the context", || inner.ctx.bind_to_thread());
        // A CUDA error (a dead device) ends the wait at once: the communicator is aborted.
        let all_ran = || {
            let st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            for f in &st.flights {
                if inner.flight_state(f)? == Progress::Pending {
                    return Ok(Progress::Pending);
                }
            }
            Ok(Progress::Complete)
        };
        let failed = || inner.root.failure().map(|f| f.error());
        let finished = poll_until("closing the NCCL communicator", 0, inner.deadline.get(), all_ran, failed).is_ok();
        if !finished {
            inner.abort_comm();
            return;
        }
        let taken = inner.comm.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(c) = taken {
            let _ = guard("binding the context", || inner.ctx.bind_to_thread());
            // SAFETY: `c` is live and no longer reachable by anyone else.
            let destroyed = nccl_call("ncclCommDestroy", || unsafe { (inner.lib.comm_destroy)(c.0) });
            if destroyed.is_err() {
                // SAFETY: as above; abort releases what destroy could not.
                let _ = nccl_call("ncclCommAbort", || unsafe { (inner.lib.comm_abort)(c.0) });
            }
        }
    }
}

impl Communicator for NcclComm {
    type Buf = DeviceBuf;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn deadline(&self) -> Duration {
        self.inner.deadline.get()
    }

    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        self.inner.deadline.set(deadline)
    }

    fn isend(&self, to: usize, tag: Tag, data: DeviceBuf) -> Result<SendHandle> {
        let bytes = data.bytes() as u64;
        self.post(to, tag, Kind::Send(data))?;
        self.inner.root.bytes.fetch_add(bytes, Ordering::Relaxed);
        let inner = self.inner.clone();
        Ok(SendHandle::new(move || match inner.root.failure() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }))
    }

    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: crate::Elem) -> Result<RecvHandle<DeviceBuf>> {
        let buf = DeviceBuf::alloc(&self.inner.stream, elem, len)?;
        let slot = self.post(from, tag, Kind::Recv(buf.clone()))?;
        let inner = self.inner.clone();
        Ok(RecvHandle::new(move || {
            let op = format!("NCCL recv ({}) from rank {from}", crate::comm::describe_tag(tag));
            guard("binding the context", || inner.ctx.bind_to_thread())?;
            let mut done = None;
            let poll = || {
                let state = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
                match state {
                    Slot::Posted => inner.flush().map(|_| Progress::Pending),
                    Slot::Flushed(event) => {
                        let p = inner.event_state(&event, &op)?;
                        if p == Progress::Complete {
                            done = Some(event);
                        }
                        Ok(p)
                    }
                }
            };
            let failed = || inner.root.failure().map(|f| f.error());
            match poll_until(&op, from, inner.deadline.get(), poll, failed) {
                Ok(()) => {
                    let mut buf = buf;
                    buf.set_ready(done);
                    Ok(buf)
                }
                Err(Error::Timeout { op, peer, after }) => {
                    inner.root.fail(Failure::Timeout { op: op.clone(), peer, after });
                    Err(Error::Timeout { op, peer, after })
                }
                Err(e) => {
                    inner.root.fail(Failure::Nccl(e.to_string()));
                    Err(e)
                }
            }
        }))
    }

    fn abort(&self, reason: &str) {
        self.inner.root.fail(Failure::Aborted { rank: self.inner.global_rank, reason: reason.to_string() });
    }

    /// `ncclAllReduce` (sum), after one small exchange that checks every rank's length. The
    /// sum is NCCL's: in a fixed order for a given configuration and identical on every
    /// rank (not necessarily rank order). Asynchronous: the result's readiness event is the
    /// operation's. `add` is not used.
    fn all_reduce(&self, data: DeviceBuf, _add: &crate::comm::AddFn<'_, DeviceBuf>) -> Result<DeviceBuf> {
        self.agree_on_length("all_reduce", data.len())?;
        if data.elem() == crate::Elem::U8 {
            return Err(Error::InvalidArgument("NCCL all_reduce: a sum of bytes".into()));
        }
        let bytes = data.bytes() as u64;
        let mut out = DeviceBuf::alloc(&self.inner.stream, data.elem(), data.len())?;
        let done = self.collective(Kind::AllReduce(data, out.clone()))?;
        let p = self.size as u64;
        self.inner.root.bytes.fetch_add(2 * bytes * (p - 1) / p.max(1), Ordering::Relaxed);
        out.set_ready(Some(done));
        Ok(out)
    }

    /// `ncclBroadcast` in place, after one small exchange that checks every rank's length.
    /// Asynchronous: the result's readiness event is the operation's.
    fn broadcast(&self, data: DeviceBuf, root: usize) -> Result<DeviceBuf> {
        if root >= self.size {
            return Err(Error::InvalidArgument(format!("broadcast: root {root} out of range for {} ranks", self.size)));
        }
        self.agree_on_length("broadcast", data.len())?;
        let mut data = data;
        // Written in place: first make the storage this buffer's own (copy-on-write).
        data.make_mut(&self.inner.stream)?;
        let done = self.collective(Kind::Broadcast(data.clone(), root))?;
        if self.rank == root {
            self.inner.root.bytes.fetch_add(data.bytes() as u64 * (self.size as u64 - 1), Ordering::Relaxed);
        }
        data.set_ready(Some(done));
        Ok(data)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = DeviceBuf>>> {
        // Operations posted before the split belong to the parent: hand them over first.
        self.inner.flush()?;
        let mut newcomm: sys::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        let (color, key) = (
            c_int::try_from(color).map_err(|_| Error::InvalidArgument(format!("NCCL split: color {color}")))?,
            c_int::try_from(key).map_err(|_| Error::InvalidArgument(format!("NCCL split: key {key}")))?,
        );
        let lib = self.inner.lib;
        self.inner.with_comm(|c| {
            // SAFETY: `c` is live under the lock; `newcomm` and `cfg` are valid for the call.
            nccl_call("ncclCommSplit", || unsafe { (lib.comm_split)(c, color, key, &mut newcomm, &mut cfg) })
                .map(|_| ())
        })?;
        self.inner.settle("split")?;
        let ctx = self.inner.ctx.clone();
        let stream = guard("creating the NCCL stream", || ctx.new_stream())?;
        // The sub-communicator's rank and size.
        let (mut r, mut n): (c_int, c_int) = (0, 0);
        if newcomm.is_null() {
            return Err(Error::Cuda("NCCL split: no communicator was created".into()));
        }
        // The new communicator completes on its own (a non-blocking split): it is settled
        // before its rank and size are asked, which NCCL refuses while it is in progress
        // (found on the emulated GPU: the parent's state says nothing of the child's).
        let settled = settle_with(self.inner.deadline.get(), "split", || in_progress(lib, newcomm, "split"));
        // SAFETY: `newcomm` is live (split completed); one int written each.
        let queried = settled
            .and_then(|()| nccl_call("ncclCommUserRank", || unsafe { (lib.comm_user_rank)(newcomm, &mut r) }))
            .and_then(|_| nccl_call("ncclCommCount", || unsafe { (lib.comm_count)(newcomm, &mut n) }));
        if let Err(e) = queried {
            // SAFETY: `newcomm` is live and owned here.
            let _ = nccl_call("ncclCommAbort", || unsafe { (lib.comm_abort)(newcomm) });
            return Err(e);
        }
        let sub = NcclComm::start(
            lib,
            newcomm,
            ctx,
            stream,
            self.inner.root.clone(),
            r.max(0) as usize,
            n.max(0) as usize,
            self.inner.global_rank,
            self.inner.deadline.get(),
            "split",
        )?;
        Ok(Box::new(sub))
    }

    fn next_collective_tag(&self) -> Tag {
        COLLECTIVE_TAG + self.collectives.fetch_add(1, Ordering::Relaxed)
    }

    fn bytes_sent(&self) -> u64 {
        self.inner.root.bytes.load(Ordering::Relaxed)
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_nccl_or_a_gpu_everything_is_an_error() {
        if crate::cuda::probe().is_ok() && nccl_present().is_ok() {
            eprintln!("SKIPPED: a GPU and NCCL are present");
            return;
        }
        assert!(new_unique_id().is_err());
        let e = NcclComm::init(0, 1, [0; UNIQUE_ID_BYTES], 0, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::Cuda(_)), "{e}");
        assert!(NcclComm::init(3, 2, [0; UNIQUE_ID_BYTES], 0, Duration::from_secs(1)).is_err());
        let r = crate::comm::spmd(2, Default::default(), |c| NcclComm::from_host_comm(c, 0, Duration::from_secs(1)));
        assert!(r.iter().all(|x| x.is_err()));
        let size = std::mem::size_of::<sys::ncclConfig_t>();
        assert_eq!(config().size, size);
        assert_eq!(config().blocking, 0);
    }
}
