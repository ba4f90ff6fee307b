//! The driver's state and its asynchronous work: contexts, allocations, streams (a worker
//! thread each, so that host code which forgets a synchronisation really races), events,
//! modules and functions; the sticky error per context; the launch log.
//!
//! Ordering is tracked with vector clocks over streams: each operation carries the clock of
//! its stream at enqueue time, joined with what the stream waited for (`cuStreamWaitEvent`,
//! the legacy stream's implicit barriers) and with what the host has observed complete
//! (synchronisations, event queries). A worker runs an operation only when every stream has
//! completed what its clock names. After it runs, each byte range it read or wrote is checked
//! against the earlier accesses to the same allocation ([`crate::race`]): a conflicting
//! access on another stream that the clock does not order is a cross-stream race, reported
//! naming both operations, and it becomes the context's sticky error.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use ringattn::emu::named::{self, GlobalAccess, NamedKernel, NamedLaunch};

use crate::codes::{self, CuResult, Failure, ILLEGAL_ADDRESS, INVALID_HANDLE, INVALID_VALUE, LAUNCH_FAILED, NOT_READY};
use crate::device::{self, DeviceSpec};
use crate::image::KernelInfo;
use crate::race::{join, Access, History};

/// Alignment of every allocation (the driver guarantees at least 256 bytes).
pub const ALLOC_ALIGN: usize = 256;

/// A memory allocation: device memory, or pinned host memory (`cuMemHostAlloc`).
#[derive(Debug)]
pub struct Alloc {
    pub bytes: u64,
    pub host: bool,
    layout: std::alloc::Layout,
    pub history: History,
}

/// How a stream orders with the legacy stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The legacy default stream (handle 0 or `CU_STREAM_LEGACY`): waits for every blocking
    /// stream, and they wait for it.
    Legacy,
    /// Created without `CU_STREAM_NON_BLOCKING`, or the per-thread default stream.
    Blocking,
    /// `CU_STREAM_NON_BLOCKING` (cudarc's streams): no implicit ordering.
    NonBlocking,
}

/// What one queued operation does.
pub enum OpKind {
    /// Copies `len` bytes to `dst` (device memory, or host memory when `dst_host`) from a
    /// source.
    Copy { dst: u64, dst_host: bool, src: Source, len: u64 },
    /// Sets `count` elements of `elem` bytes (1 or 4) at `dst` to `value`.
    Set { dst: u64, value: u32, elem: u8, count: u64 },
    /// Runs a kernel.
    Launch { kernel: &'static NamedKernel, params: Vec<u8>, launch: NamedLaunch },
    /// Frees an allocation (in stream order).
    Free { ptr: u64 },
    /// An asynchronous allocation becoming usable in stream order.
    AllocReady { ptr: u64 },
    /// An event's point in the stream (records the time when it runs).
    Marker { time: Arc<Mutex<Option<Instant>>> },
    /// A group of NCCL calls of one communicator.
    Nccl(Box<crate::nccl::Group>),
}

/// A copy's source.
pub enum Source {
    /// Device or pinned host memory, read when the copy runs.
    Memory(u64),
    /// Pageable host memory, copied when the call was made.
    Snapshot(Vec<u8>),
}

struct Op {
    seq: u64,
    clock: Vec<u64>,
    label: String,
    kind: OpKind,
}

/// A stream's state.
pub struct Stream {
    pub ctx: usize,
    pub kind: StreamKind,
    pub clock: Vec<u64>,
    pub enqueued: u64,
    pub completed: u64,
    queue: VecDeque<Op>,
    /// An operation popped from the queue is running.
    running: bool,
    pub destroyed: bool,
    /// For messages: `stream 3 (non-blocking, created by thread 'rank-1')`.
    pub label: String,
}

/// An event: where it was last recorded.
pub struct Event {
    pub ctx: usize,
    pub timing: bool,
    /// (stream, sequence number, clock) of the last record.
    pub recorded: Option<(usize, u64, Vec<u64>)>,
    pub time: Arc<Mutex<Option<Instant>>>,
}

/// A loaded module's kernels.
pub struct Module {
    pub ctx: usize,
    pub target: String,
    pub kernels: HashMap<String, KernelInfo>,
}

/// A kernel handle.
pub struct Function {
    pub module: usize,
    pub info: KernelInfo,
    pub kernel: &'static NamedKernel,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    pub max_dynamic_smem: u32,
}

/// Everything behind the driver's lock.
pub struct State {
    pub initialized: bool,
    pub devices: Vec<DeviceSpec>,
    pub allocs: BTreeMap<u64, Alloc>,
    quarantine: Vec<(u64, std::alloc::Layout)>,
    quarantine_bytes: u64,
    /// The most recent frees: (address, bytes, what freed it), for messages about accesses
    /// to freed memory.
    freed: VecDeque<(u64, u64, String)>,
    pub streams: Vec<Stream>,
    /// The legacy stream of each context (device).
    pub legacy: Vec<usize>,
    pub events: HashMap<u64, Event>,
    pub modules: HashMap<u64, Module>,
    pub functions: HashMap<u64, Function>,
    next_handle: u64,
    /// What the host has seen complete.
    pub host_clock: Vec<u64>,
    /// The first sticky error of each context.
    pub sticky: HashMap<usize, Failure>,
    /// Per-thread default streams: (thread, context) → stream.
    per_thread: HashMap<(std::thread::ThreadId, usize), usize>,
}

/// The driver: its state and the condition every wait uses.
pub struct Driver {
    state: Mutex<State>,
    changed: Condvar,
    log: Mutex<Option<std::fs::File>>,
}

/// Handle tags: the high bits of a handle say what it is.
pub const STREAM_TAG: u64 = 0x5_0000_0000;
pub const EVENT_TAG: u64 = 0x6_0000_0000;
pub const MODULE_TAG: u64 = 0x7_0000_0000;
pub const FUNCTION_TAG: u64 = 0x8_0000_0000;
pub const CONTEXT_TAG: u64 = 0x9_0000_0000;

/// The process's driver.
pub fn driver() -> &'static Driver {
    static D: OnceLock<Driver> = OnceLock::new();
    D.get_or_init(|| {
        let log = std::env::var_os("RINGATTN_EMU_GPU_LOG")
            .and_then(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).ok());
        Driver {
            state: Mutex::new(State {
                initialized: false,
                devices: Vec::new(),
                allocs: BTreeMap::new(),
                quarantine: Vec::new(),
                quarantine_bytes: 0,
                freed: VecDeque::new(),
                streams: Vec::new(),
                legacy: Vec::new(),
                events: HashMap::new(),
                modules: HashMap::new(),
                functions: HashMap::new(),
                next_handle: 1,
                host_clock: Vec::new(),
                sticky: HashMap::new(),
                per_thread: HashMap::new(),
            }),
            changed: Condvar::new(),
            log: Mutex::new(log),
        }
    })
}

thread_local! {
    /// The thread's current context (device ordinal + 1; 0: none).
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The calling thread's current context, if any.
pub fn current() -> Option<usize> {
    CURRENT.with(|c| c.get().checked_sub(1))
}

/// Makes `ctx` (or none) current on the calling thread.
pub fn set_current(ctx: Option<usize>) {
    CURRENT.with(|c| c.set(ctx.map_or(0, |x| x + 1)));
}

impl Driver {
    /// The state, locked (a poisoned lock is taken over: a panic elsewhere must not wedge
    /// every later call).
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `cuInit`: the devices and their legacy streams.
    pub fn init(&'static self) {
        let mut st = self.lock();
        if st.initialized {
            return;
        }
        st.devices = device::devices();
        for ctx in 0..st.devices.len() {
            let id = self.new_stream_locked(&mut st, ctx, StreamKind::Legacy);
            st.legacy.push(id);
        }
        st.initialized = true;
    }

    /// A new stream of `ctx` with its worker.
    pub fn new_stream_locked(&'static self, st: &mut State, ctx: usize, kind: StreamKind) -> usize {
        let id = st.streams.len();
        let thread = std::thread::current();
        let creator = thread.name().unwrap_or("unnamed");
        let label = match kind {
            StreamKind::Legacy => format!("stream {id} (the legacy default stream of device {ctx})"),
            StreamKind::Blocking => format!("stream {id} (blocking, created by thread '{creator}')"),
            StreamKind::NonBlocking => format!("stream {id} (non-blocking, created by thread '{creator}')"),
        };
        st.streams.push(Stream {
            ctx,
            kind,
            clock: Vec::new(),
            enqueued: 0,
            completed: 0,
            queue: VecDeque::new(),
            running: false,
            destroyed: false,
            label,
        });
        std::thread::Builder::new()
            .name(format!("emulated-gpu-stream-{id}"))
            .spawn(move || self.worker(id))
            .expect("spawn a stream worker");
        id
    }

    /// A fresh handle value with `tag`.
    pub fn handle(st: &mut State, tag: u64) -> u64 {
        st.next_handle += 1;
        tag | (st.next_handle << 4)
    }

    /// The per-thread default stream of `ctx` for the calling thread.
    pub fn per_thread_stream(&'static self, st: &mut State, ctx: usize) -> usize {
        let key = (std::thread::current().id(), ctx);
        if let Some(&s) = st.per_thread.get(&key) {
            return s;
        }
        let s = self.new_stream_locked(st, ctx, StreamKind::Blocking);
        st.per_thread.insert(key, s);
        s
    }

    /// Enqueues `kind` on stream `sid`; returns its sequence number.
    pub fn enqueue(&self, st: &mut State, sid: usize, label: String, kind: OpKind) -> u64 {
        let mut clock = st.streams[sid].clock.clone();
        join(&mut clock, &st.host_clock);
        let ctx = st.streams[sid].ctx;
        match st.streams[sid].kind {
            StreamKind::Legacy => {
                for (t, s) in st.streams.iter().enumerate() {
                    if t != sid && s.ctx == ctx && s.kind == StreamKind::Blocking && !s.destroyed {
                        join(&mut clock, &s.clock);
                    }
                }
            }
            StreamKind::Blocking => {
                let l = st.legacy[ctx];
                let lc = st.streams[l].clock.clone();
                join(&mut clock, &lc);
            }
            StreamKind::NonBlocking => {}
        }
        let s = &mut st.streams[sid];
        s.enqueued += 1;
        let seq = s.enqueued;
        if clock.len() <= sid {
            clock.resize(sid + 1, 0);
        }
        clock[sid] = seq;
        s.clock = clock.clone();
        s.queue.push_back(Op { seq, clock, label, kind });
        self.changed.notify_all();
        seq
    }

    /// Logs one line to `RINGATTN_EMU_GPU_LOG`, if set.
    pub fn log(&self, line: &str) {
        if let Some(f) = self.log.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            let _ = writeln!(f, "{line}");
        }
    }

    /// The stream worker: runs `sid`'s operations in order, each once every stream has
    /// completed what its clock names.
    fn worker(&'static self, sid: usize) {
        loop {
            let (op, ctx) = {
                let mut st = self.lock();
                loop {
                    let ready = st.streams[sid]
                        .queue
                        .front()
                        .map(|op| op.clock.iter().enumerate().all(|(t, &c)| t == sid || st.streams[t].completed >= c));
                    match ready {
                        Some(true) => break,
                        None if st.streams[sid].destroyed => return,
                        _ => st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
                    }
                }
                let ctx = st.streams[sid].ctx;
                st.streams[sid].running = true;
                (st.streams[sid].queue.pop_front().expect("a ready operation"), ctx)
            };
            let failed = self.lock().sticky.contains_key(&ctx);
            let result = if failed { Ok(Vec::new()) } else { self.run(&op) };
            let mut st = self.lock();
            match result {
                Ok(accesses) => {
                    if let Err(f) = self.check_races(&mut st, sid, &op, &accesses) {
                        st.sticky.entry(ctx).or_insert_with(|| {
                            codes::report(&f);
                            f
                        });
                    }
                }
                Err(f) => {
                    st.sticky.entry(ctx).or_insert_with(|| {
                        codes::report(&f);
                        f
                    });
                }
            }
            st.streams[sid].running = false;
            if let OpKind::Free { ptr } = op.kind {
                let what = format!("{} on {}", op.label, st.streams[sid].label);
                self.retire(&mut st, ptr, what);
            }
            st.streams[sid].completed = op.seq;
            self.changed.notify_all();
        }
    }

    /// Runs one operation; returns the accesses it made: (allocation base, access).
    fn run(&self, op: &Op) -> Result<Vec<(u64, Access)>, Failure> {
        let access = |base: u64, lo: u64, hi: u64, write: bool| {
            (base, Access { stream: 0, seq: op.seq, lo, hi, write, label: op.label.clone() })
        };
        match &op.kind {
            OpKind::Copy { dst, dst_host, src, len } => {
                let mut out = Vec::new();
                let st = self.lock();
                if let Some((base, _)) = find_alloc(&st, *dst, *len) {
                    out.push(access(base, dst - base, dst - base + len, true));
                } else if !dst_host {
                    return Err(Failure::new(
                        ILLEGAL_ADDRESS,
                        format!(
                            "{}: destination {dst:#x} (+{len} bytes) is not live memory{}",
                            op.label,
                            freed_by(&st, *dst)
                        ),
                    ));
                }
                match src {
                    Source::Memory(s) => {
                        match find_alloc(&st, *s, *len) {
                            Some((base, _)) => out.push(access(base, s - base, s - base + len, false)),
                            None => {
                                return Err(Failure::new(
                                    ILLEGAL_ADDRESS,
                                    format!(
                                        "{}: source {s:#x} (+{len} bytes) is not live memory{}",
                                        op.label,
                                        freed_by(&st, *s)
                                    ),
                                ))
                            }
                        }
                        drop(st);
                        // SAFETY: both ranges are live (checked above; frees are stream-ordered
                        // and retired memory is quarantined until every stream is idle).
                        unsafe { std::ptr::copy(*s as *const u8, *dst as *mut u8, *len as usize) };
                    }
                    Source::Snapshot(bytes) => {
                        drop(st);
                        // SAFETY: the destination range is live (checked above).
                        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *dst as *mut u8, bytes.len()) };
                    }
                }
                Ok(out)
            }
            OpKind::Set { dst, value, elem, count } => {
                let len = count * u64::from(*elem);
                let st = self.lock();
                let Some((base, _)) = find_alloc(&st, *dst, len) else {
                    return Err(Failure::new(
                        ILLEGAL_ADDRESS,
                        format!("{}: {dst:#x} (+{len} bytes) is not live memory{}", op.label, freed_by(&st, *dst)),
                    ));
                };
                drop(st);
                // SAFETY: the range is live (checked above).
                unsafe {
                    if *elem == 1 {
                        std::ptr::write_bytes(*dst as *mut u8, *value as u8, len as usize);
                    } else {
                        let p = *dst as *mut u32;
                        for i in 0..*count as usize {
                            p.add(i).write_unaligned(*value);
                        }
                    }
                }
                Ok(vec![access(base, dst - base, dst - base + len, true)])
            }
            OpKind::Launch { kernel, params, launch } => {
                // The allocations the kernel can reach: those its parameters point into (a
                // kernel reaches global memory only through them).
                let mut globals: Vec<GlobalAccess> = {
                    let st = self.lock();
                    let mut bases: Vec<(u64, u64)> = Vec::new();
                    for w in params.chunks_exact(8) {
                        let v = u64::from_le_bytes(w.try_into().unwrap_or_default());
                        if let Some((base, a)) = find_alloc(&st, v, 0) {
                            if !bases.iter().any(|b| b.0 == base) {
                                bases.push((base, a.bytes));
                            }
                        }
                    }
                    bases.into_iter().map(|(b, n)| GlobalAccess::new(b, n)).collect()
                };
                // SAFETY: every entry of `globals` is a live allocation (frees are stream
                // ordered and quarantined until every stream is idle).
                let r = unsafe { named::launch_named(kernel, params, *launch, &mut globals) };
                if let Err(e) = r {
                    let text = e.to_string();
                    let code = if text.contains("outside every buffer") { ILLEGAL_ADDRESS } else { LAUNCH_FAILED };
                    return Err(Failure::new(code, format!("{}: {text}", op.label)));
                }
                let mut out = Vec::new();
                for g in globals {
                    if let Some((lo, hi)) = g.read() {
                        out.push(access(g.base, lo, hi, false));
                    }
                    if let Some((lo, hi)) = g.written() {
                        out.push(access(g.base, lo, hi, true));
                    }
                }
                Ok(out)
            }
            OpKind::Free { ptr } => {
                let st = self.lock();
                let Some(a) = st.allocs.get(ptr) else {
                    return Err(Failure::new(ILLEGAL_ADDRESS, format!("{}: {ptr:#x} was already freed", op.label)));
                };
                Ok(vec![access(*ptr, 0, a.bytes.max(1), true)])
            }
            OpKind::AllocReady { ptr } => {
                let st = self.lock();
                let n = st.allocs.get(ptr).map_or(1, |a| a.bytes.max(1));
                Ok(vec![access(*ptr, 0, n, true)])
            }
            OpKind::Marker { time } => {
                *time.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                Ok(Vec::new())
            }
            OpKind::Nccl(group) => {
                group.run();
                let st = self.lock();
                let mut out = Vec::new();
                for (p, n, write) in group.ranges() {
                    if let Some((base, _)) = find_alloc(&st, p, n as u64) {
                        out.push(access(base, p - base, p - base + n as u64, write));
                    }
                }
                Ok(out)
            }
        }
    }

    /// Checks the accesses of `op` (run on `sid`) against each allocation's history, then
    /// records them.
    fn check_races(&self, st: &mut State, sid: usize, op: &Op, accesses: &[(u64, Access)]) -> Result<(), Failure> {
        let labels: Vec<String> = st.streams.iter().map(|s| s.label.clone()).collect();
        let mut first = None;
        for (base, a) in accesses {
            let mut a = a.clone();
            a.stream = sid;
            if let Some(alloc) = st.allocs.get_mut(base) {
                if let Some(other) = alloc.history.check(&a, &op.clock) {
                    if first.is_none() {
                        first = Some(Failure::new(
                            LAUNCH_FAILED,
                            format!(
                                "cross-stream race on the allocation at {base:#x} ({} bytes): {} {} bytes {}..{} on {} \
                                 is not ordered after {} {} bytes {}..{} on {} (no event wait or synchronisation \
                                 between them)",
                                alloc.bytes,
                                a.label,
                                if a.write { "writes" } else { "reads" },
                                a.lo,
                                a.hi,
                                labels[sid],
                                other.label,
                                if other.write { "which writes" } else { "which reads" },
                                other.lo,
                                other.hi,
                                labels[other.stream]
                            ),
                        ));
                    }
                }
                alloc.history.record(a, &op.clock);
            } else if first.is_none() {
                // Live when the operation started (else it failed there) and gone now: a free on
                // another stream, not ordered after it, retired the allocation while it ran.
                first = Some(Failure::new(
                    ILLEGAL_ADDRESS,
                    format!(
                        "{}: {} {base:#x} bytes {}..{} on {}, which is not live memory{} (freed while it ran, \
                         with no event wait or synchronisation between the two)",
                        a.label,
                        if a.write { "writes" } else { "reads" },
                        a.lo,
                        a.hi,
                        labels[sid],
                        freed_by(st, base + a.lo),
                    ),
                ));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Takes a freed allocation out of the live table into quarantine; releases the
    /// quarantine once it is large and every stream is idle.
    fn retire(&self, st: &mut State, ptr: u64, what: String) {
        if let Some(a) = st.allocs.remove(&ptr) {
            st.quarantine_bytes += a.bytes;
            st.quarantine.push((ptr, a.layout));
            st.freed.push_back((ptr, a.bytes, what));
            if st.freed.len() > 4096 {
                st.freed.pop_front();
            }
        }
        // Idle: nothing queued or running anywhere (the freeing operation itself has finished).
        let idle = st.streams.iter().all(|s| s.queue.is_empty() && !s.running);
        if st.quarantine_bytes > 256 << 20 && idle {
            for (p, layout) in st.quarantine.drain(..) {
                // SAFETY: allocated with this layout by `alloc`, out of the live table, and no
                // stream has work left that could touch it.
                unsafe { std::alloc::dealloc(p as *mut u8, layout) };
            }
            st.quarantine_bytes = 0;
        }
    }

    /// A new allocation of `bytes` (host: pinned host memory), filled with 0xFF bytes (NaN
    /// as f32: reading memory nobody wrote shows).
    pub fn alloc(&self, st: &mut State, bytes: u64, host: bool) -> Result<u64, Failure> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1) as usize, ALLOC_ALIGN)
            .map_err(|_| Failure::new(INVALID_VALUE, format!("allocation of {bytes} bytes")))?;
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(Failure::new(codes::OUT_OF_MEMORY, format!("{bytes} bytes: the host is out of memory")));
        }
        // SAFETY: `p` holds `layout.size()` bytes.
        unsafe { std::ptr::write_bytes(p, if host { 0 } else { 0xFF }, layout.size()) };
        st.allocs.insert(p as u64, Alloc { bytes, host, layout, history: History::default() });
        Ok(p as u64)
    }

    /// The current context's sticky error, or `INVALID_CONTEXT` without one current.
    pub fn context(&self, st: &State) -> Result<usize, Failure> {
        if !st.initialized {
            return Err(Failure::new(codes::NOT_INITIALIZED, "cuInit was not called"));
        }
        let ctx =
            current().ok_or_else(|| Failure::new(codes::INVALID_CONTEXT, "no context is current on this thread"))?;
        if let Some(f) = st.sticky.get(&ctx) {
            return Err(f.clone());
        }
        Ok(ctx)
    }

    /// The stream a handle names in `ctx`.
    pub fn stream_of(&'static self, st: &mut State, ctx: usize, handle: u64) -> Result<usize, Failure> {
        match handle {
            0 | 1 => Ok(st.legacy[ctx]),
            2 => Ok(self.per_thread_stream(st, ctx)),
            h if h >> 32 == STREAM_TAG >> 32 => {
                let id = ((h & 0xFFFF_FFFF) >> 4) as usize;
                match st.streams.get(id) {
                    Some(s) if !s.destroyed && s.ctx == ctx => Ok(id),
                    Some(s) if s.ctx != ctx => {
                        Err(Failure::new(INVALID_HANDLE, format!("{} belongs to another context", s.label)))
                    }
                    _ => Err(Failure::new(INVALID_HANDLE, format!("stream handle {h:#x} is not a live stream"))),
                }
            }
            h => Err(Failure::new(INVALID_HANDLE, format!("stream handle {h:#x} is not a stream"))),
        }
    }

    /// The context of a created stream's handle (`None` for the default streams' handles).
    pub fn stream_context(&self, st: &State, handle: u64) -> Option<usize> {
        if handle >> 32 != STREAM_TAG >> 32 {
            return None;
        }
        st.streams.get(((handle & 0xFFFF_FFFF) >> 4) as usize).map(|s| s.ctx)
    }

    /// Blocks until every stream of `ctx` has completed its work; the host has seen it all.
    pub fn synchronize_context<'a>(&self, mut st: MutexGuard<'a, State>, ctx: usize) -> MutexGuard<'a, State> {
        let ids: Vec<usize> = (0..st.streams.len()).filter(|&i| st.streams[i].ctx == ctx).collect();
        for id in ids {
            st = self.synchronize_stream(st, id);
        }
        st
    }

    /// Blocks until stream `sid` has completed its work; the host has seen it.
    pub fn synchronize_stream<'a>(&self, st: MutexGuard<'a, State>, sid: usize) -> MutexGuard<'a, State> {
        let target = st.streams[sid].enqueued;
        let clock = st.streams[sid].clock.clone();
        self.wait_host(st, sid, target, &clock)
    }

    /// A synchronous call's wait: until `sid` has completed `seq`, which the host has then
    /// seen (its clock, taken when it was enqueued, joins the host's).
    pub fn wait_host<'a>(
        &self,
        st: MutexGuard<'a, State>,
        sid: usize,
        seq: u64,
        clock: &[u64],
    ) -> MutexGuard<'a, State> {
        let mut st = self.wait_guard(st, sid, seq);
        join(&mut st.host_clock, clock);
        st
    }

    /// Waits (releasing the lock) until `sid` has completed `seq`.
    pub fn wait_guard<'a>(&self, st: MutexGuard<'a, State>, sid: usize, seq: u64) -> MutexGuard<'a, State> {
        self.changed.wait_while(st, |st| st.streams[sid].completed < seq).unwrap_or_else(|e| e.into_inner())
    }

    /// An event's state: `SUCCESS` when its work is done (the host has then seen it),
    /// `NOT_READY` otherwise.
    pub fn query_event(&self, st: &mut State, ev: u64) -> CuResult {
        let Some(e) = st.events.get(&ev) else { return INVALID_HANDLE };
        match &e.recorded {
            None => codes::SUCCESS,
            Some((sid, seq, clock)) => {
                if st.streams[*sid].completed >= *seq {
                    let clock = clock.clone();
                    join(&mut st.host_clock, &clock);
                    codes::SUCCESS
                } else {
                    NOT_READY
                }
            }
        }
    }
}

/// What freed the memory at `addr`, if a recent free did: for the error of an access to it.
pub fn freed_by(st: &State, addr: u64) -> String {
    st.freed
        .iter()
        .rev()
        .find(|(p, n, _)| addr >= *p && addr < p + (*n).max(1))
        .map_or(String::new(), |(_, _, what)| format!(" (freed by {what})"))
}

/// The live allocation holding `[addr, addr + len)`: (base, allocation).
pub fn find_alloc(st: &State, addr: u64, len: u64) -> Option<(u64, &Alloc)> {
    let (&base, a) = st.allocs.range(..=addr).next_back()?;
    (addr >= base && addr + len <= base + a.bytes.max(1) && (len > 0 || addr < base + a.bytes.max(1)))
        .then_some((base, a))
}
