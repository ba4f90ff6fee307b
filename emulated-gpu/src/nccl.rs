//! The stand-in NCCL (`libnccl.so.2`: the same library as the driver, so that NCCL's work
//! items run in the driver's stream queues): communicators across the processes of one
//! machine and across threads, over loopback TCP.
//!
//! * **Bootstrap**: `ncclGetUniqueId` starts this process's node (a listener on 127.0.0.1 and
//!   a reader thread per connection) and a rendezvous for the id; the 128-byte id carries a
//!   magic, the node's port and a random key. `ncclCommInitRankConfig` registers the rank
//!   with the rendezvous and, once all `nranks` have, learns every rank's node: non-blocking
//!   (`ncclInProgress` until `ncclCommGetAsyncError` reports success), as ringattn configures
//!   it.
//! * **Work**: `ncclSend`/`ncclRecv` (in order per peer), `ncclAllReduce` (summed in rank
//!   order: the same bits on every rank) and `ncclBroadcast`, for u8, i32, f16, bf16 and f32;
//!   inside `ncclGroupStart`/`ncclGroupEnd` each communicator's calls become one operation on
//!   the stream, whose sends go out before it waits for its receives (as one NCCL kernel
//!   progresses them together). The operation reads and writes device memory when the stream
//!   reaches it, and reports its accesses to the race detector.
//! * **Failure**: a receive whose peer never sends waits until the communicator is aborted
//!   (`ncclCommAbort`: ringattn's watchdog at its deadline), then completes with the
//!   communicator's asynchronous error set; a message of the wrong size is an error naming
//!   both sizes. `ncclCommSplit` is collective and non-blocking, as NCCL's.
//!
//! The exported functions' safety contract is NCCL's own (`nccl.h`): valid out-pointers,
//! buffers of `count` elements on the communicator's device; each is documented there, not
//! repeated per function.

#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::codes::Failure;
use crate::runtime::{current, driver, find_alloc, OpKind};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;

/// The version this stand-in reports (2.28.0: the configuration layout ringattn passes).
pub const VERSION_CODE: c_int = 22800;

const MAGIC: &[u8; 8] = b"RAEMUNCL";

/// Message kinds on the wire.
const REGISTER: u8 = 1;
const TABLE: u8 = 2;
const DATA: u8 = 3;
const COLLECTIVE: u8 = 4;
const SPLIT: u8 = 5;

/// Where a message goes: (communicator key, kind, source rank, destination rank). A
/// registration is addressed from [`ANY`].
type Key = (u64, u8, u32, u32);
const ANY: u32 = u32::MAX;

/// This process's node: its listener's address, its outgoing connections, its mailboxes.
struct Node {
    addr: SocketAddr,
    conns: Mutex<HashMap<SocketAddr, TcpStream>>,
    boxes: Mutex<HashMap<Key, VecDeque<Vec<u8>>>>,
    arrived: Condvar,
}

fn node() -> Result<&'static Node, Failure> {
    static NODE: OnceLock<Result<&'static Node, String>> = OnceLock::new();
    NODE.get_or_init(|| {
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| format!("NCCL bootstrap: listen on loopback: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let node: &'static Node = Box::leak(Box::new(Node {
            addr,
            conns: Mutex::new(HashMap::new()),
            boxes: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("emulated-nccl-listener".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let _ = conn.set_nodelay(true);
                    let _ = std::thread::Builder::new()
                        .name("emulated-nccl-reader".into())
                        .spawn(move || read_frames(node, conn));
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(node)
    })
    .clone()
    .map_err(|e| Failure::new(SYSTEM_ERROR, e))
}

/// Reads frames from one connection into the mailboxes until it closes.
fn read_frames(node: &'static Node, mut conn: TcpStream) {
    let mut head = [0u8; 25];
    while conn.read_exact(&mut head).is_ok() {
        let key = u64::from_le_bytes(head[0..8].try_into().unwrap_or_default());
        let kind = head[8];
        let src = u32::from_le_bytes(head[9..13].try_into().unwrap_or_default());
        let dst = u32::from_le_bytes(head[13..17].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(head[17..25].try_into().unwrap_or_default()) as usize;
        let mut body = vec![0u8; len];
        if conn.read_exact(&mut body).is_err() {
            return;
        }
        node.boxes.lock().unwrap_or_else(|e| e.into_inner()).entry((key, kind, src, dst)).or_default().push_back(body);
        node.arrived.notify_all();
    }
}

/// Sends one message to the node at `to`.
fn post(to: SocketAddr, key: Key, body: &[u8]) -> Result<(), Failure> {
    let n = node()?;
    let mut conns = n.conns.lock().unwrap_or_else(|e| e.into_inner());
    let c = match conns.entry(to) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let c = TcpStream::connect(to)
                .map_err(|e| Failure::new(REMOTE_ERROR, format!("NCCL: connect to {to}: {e}")))?;
            let _ = c.set_nodelay(true);
            v.insert(c)
        }
    };
    let mut frame = Vec::with_capacity(25 + body.len());
    frame.extend_from_slice(&key.0.to_le_bytes());
    frame.push(key.1);
    frame.extend_from_slice(&key.2.to_le_bytes());
    frame.extend_from_slice(&key.3.to_le_bytes());
    frame.extend_from_slice(&(body.len() as u64).to_le_bytes());
    frame.extend_from_slice(body);
    c.write_all(&frame).map_err(|e| {
        conns.remove(&to);
        Failure::new(REMOTE_ERROR, format!("NCCL: send to {to}: {e}"))
    })
}

/// Takes the next message for `key`, waiting until one arrives or `stop` says to give up.
fn take(key: Key, stop: &dyn Fn() -> bool) -> Result<Vec<u8>, Failure> {
    let n = node()?;
    let mut boxes = n.boxes.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(m) = boxes.get_mut(&key).and_then(|q| q.pop_front()) {
            return Ok(m);
        }
        if stop() {
            return Err(Failure::new(REMOTE_ERROR, "NCCL: the communicator was aborted while waiting for a peer"));
        }
        boxes = n.arrived.wait_timeout(boxes, Duration::from_millis(20)).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// One communicator.
pub struct Comm {
    key: u64,
    /// This rank and the size (known at creation, or once a split's exchange completes).
    rank_: AtomicU32,
    nranks_: AtomicU32,
    /// Every rank's node, once initialised.
    peers: Mutex<Vec<SocketAddr>>,
    /// `ncclCommGetAsyncError`'s answer.
    state: Mutex<NcclResult>,
    detail: Mutex<String>,
    aborted: AtomicBool,
    /// Per peer: sequence numbers of point-to-point messages are implicit (FIFO per key);
    /// collectives and splits count their own.
    collectives: AtomicU64,
    splits: AtomicU64,
}

impl Comm {
    fn rank(&self) -> u32 {
        self.rank_.load(Ordering::Acquire)
    }

    fn nranks(&self) -> u32 {
        self.nranks_.load(Ordering::Acquire)
    }

    fn fail(&self, code: NcclResult, detail: String) {
        eprintln!("emulated-nccl: rank {}: {detail}", self.rank());
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s == SUCCESS || *s == IN_PROGRESS {
            *s = code;
        }
        *self.detail.lock().unwrap_or_else(|e| e.into_inner()) = detail;
    }

    fn peer(&self, r: u32) -> Result<SocketAddr, Failure> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).get(r as usize).copied().ok_or_else(|| {
            Failure::new(INVALID_ARGUMENT, format!("NCCL: peer {r} outside a communicator of {}", self.nranks()))
        })
    }

    fn stopped(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }
}

fn comms() -> &'static Mutex<HashMap<u64, Arc<Comm>>> {
    static C: OnceLock<Mutex<HashMap<u64, Arc<Comm>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

fn comm_of(h: *mut c_void) -> Result<Arc<Comm>, Failure> {
    comms()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(h as u64))
        .cloned()
        .ok_or_else(|| Failure::new(INVALID_ARGUMENT, format!("NCCL: {:#x} is not a communicator", h as u64)))
}

fn new_handle(c: Arc<Comm>) -> *mut c_void {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let h = 0xA_0000_0000 | (NEXT.fetch_add(1, Ordering::Relaxed) << 4);
    comms().lock().unwrap_or_else(|e| e.into_inner()).insert(h, c);
    h as *mut c_void
}

fn random_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// The rendezvous of an id: collects `nranks` registrations, then sends every rank the table.
fn serve_rendezvous(key: u64) {
    let _ = std::thread::Builder::new().name("emulated-nccl-rendezvous".into()).spawn(move || {
        let never = || false;
        let first = match take((key, REGISTER, ANY, 0), &never) {
            Ok(m) => m,
            Err(_) => return,
        };
        let nranks = u32::from_le_bytes(first[4..8].try_into().unwrap_or_default()) as usize;
        let mut regs = vec![first];
        while regs.len() < nranks {
            match take((key, REGISTER, ANY, 0), &never) {
                Ok(m) => regs.push(m),
                Err(_) => return,
            }
        }
        let mut table = vec![String::new(); nranks];
        for r in &regs {
            let rank = u32::from_le_bytes(r[0..4].try_into().unwrap_or_default()) as usize;
            if let Some(slot) = table.get_mut(rank) {
                *slot = String::from_utf8_lossy(&r[8..]).into_owned();
            }
        }
        let body = table.join("\n").into_bytes();
        for (rank, addr) in table.iter().enumerate() {
            if let Ok(a) = addr.parse::<SocketAddr>() {
                let _ = post(a, (key, TABLE, 0, rank as u32), &body);
            }
        }
    });
}

// ---- reductions ----

/// The data types [`reduce_into`] sums: int32, float16, float32, bfloat16.
const REDUCIBLE: [c_int; 4] = [2, 6, 7, 9];

fn reduce_into(acc: &mut [u8], x: &[u8], dtype: c_int, op: c_int) -> Result<(), Failure> {
    fn apply<T: Copy>(
        acc: &mut [u8],
        x: &[u8],
        size: usize,
        load: impl Fn(&[u8]) -> T,
        store: impl Fn(T, &mut [u8]),
        f: impl Fn(T, T) -> T,
    ) {
        for (a, b) in acc.chunks_exact_mut(size).zip(x.chunks_exact(size)) {
            let v = f(load(a), load(b));
            store(v, a);
        }
    }
    let f32op = |a: f32, b: f32| match op {
        0 => a + b,
        1 => a * b,
        2 => a.max(b),
        _ => a.min(b),
    };
    match dtype {
        7 => apply(
            acc,
            x,
            4,
            |b| f32::from_le_bytes(b.try_into().unwrap_or_default()),
            |v, b| b.copy_from_slice(&v.to_le_bytes()),
            f32op,
        ),
        9 => apply(
            acc,
            x,
            2,
            |b| half::bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32(),
            |v, b| b.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            f32op,
        ),
        6 => apply(
            acc,
            x,
            2,
            |b| half::f16::from_le_bytes(b.try_into().unwrap_or_default()).to_f32(),
            |v, b| b.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            f32op,
        ),
        2 => apply(
            acc,
            x,
            4,
            |b| i32::from_le_bytes(b.try_into().unwrap_or_default()),
            |v, b| b.copy_from_slice(&v.to_le_bytes()),
            |a, b| match op {
                0 => a.wrapping_add(b),
                1 => a.wrapping_mul(b),
                2 => a.max(b),
                _ => a.min(b),
            },
        ),
        d => return Err(Failure::new(INVALID_ARGUMENT, format!("NCCL reduction of data type {d} is not emulated"))),
    }
    Ok(())
}

fn type_size(dtype: c_int) -> Option<usize> {
    match dtype {
        0 | 1 => Some(1),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        6 | 9 => Some(2),
        _ => None,
    }
}

// ---- work on the streams ----

/// One call of a group.
#[derive(Debug, Clone)]
pub enum Call {
    Send { ptr: u64, bytes: usize, peer: u32 },
    Recv { ptr: u64, bytes: usize, peer: u32 },
    AllReduce { send: u64, recv: u64, bytes: usize, dtype: c_int, op: c_int, seq: u64 },
    Broadcast { send: u64, recv: u64, bytes: usize, root: u32, seq: u64 },
}

/// A group of one communicator's calls: one operation on its stream.
pub struct Group {
    pub comm: Arc<Comm>,
    pub calls: Vec<Call>,
}

impl Group {
    /// The device ranges the group reads (false) and writes (true).
    pub fn ranges(&self) -> Vec<(u64, usize, bool)> {
        let mut out = Vec::new();
        for c in &self.calls {
            match *c {
                Call::Send { ptr, bytes, .. } => out.push((ptr, bytes, false)),
                Call::Recv { ptr, bytes, .. } => out.push((ptr, bytes, true)),
                Call::AllReduce { send, recv, bytes, .. } | Call::Broadcast { send, recv, bytes, .. } => {
                    out.push((send, bytes, false));
                    out.push((recv, bytes, true));
                }
            }
        }
        out
    }

    /// Runs the group (on its stream's worker): sends first, then every receive. A failure
    /// becomes the communicator's asynchronous error; the operation completes either way.
    pub fn run(&self) {
        if let Err(f) = self.try_run() {
            self.comm.fail(f.code, f.detail);
        }
    }

    fn try_run(&self) -> Result<(), Failure> {
        let c = &self.comm;
        if c.stopped() {
            return Err(Failure::new(REMOTE_ERROR, "NCCL: work on an aborted communicator".to_string()));
        }
        let read = |ptr: u64, n: usize| -> Vec<u8> {
            // SAFETY: the range was checked to be live device memory when the call was made;
            // frees are stream ordered behind this operation.
            unsafe { std::slice::from_raw_parts(ptr as *const u8, n) }.to_vec()
        };
        let write = |ptr: u64, data: &[u8]| {
            // SAFETY: as above, for writing.
            unsafe { std::ptr::copy(data.as_ptr(), ptr as *mut u8, data.len()) }
        };
        for call in &self.calls {
            match *call {
                Call::Send { ptr, bytes, peer } => {
                    post(c.peer(peer)?, (c.key, DATA, c.rank(), peer), &read(ptr, bytes))?
                }
                Call::AllReduce { send, bytes, seq, .. } => {
                    let data = read(send, bytes);
                    for r in (0..c.nranks()).filter(|&r| r != c.rank()) {
                        post(c.peer(r)?, (c.key ^ seq.rotate_left(17), COLLECTIVE, c.rank(), r), &data)?;
                    }
                }
                Call::Broadcast { send, bytes, root, seq, .. } if root == c.rank() => {
                    let data = read(send, bytes);
                    for r in (0..c.nranks()).filter(|&r| r != c.rank()) {
                        post(c.peer(r)?, (c.key ^ seq.rotate_left(17), COLLECTIVE, c.rank(), r), &data)?;
                    }
                }
                _ => {}
            }
        }
        let stop = || c.stopped();
        for call in &self.calls {
            match *call {
                Call::Recv { ptr, bytes, peer } => {
                    let m = take((c.key, DATA, peer, c.rank()), &stop)?;
                    if m.len() != bytes {
                        return Err(Failure::new(
                            INVALID_USAGE,
                            format!(
                                "NCCL: rank {} received {} bytes from rank {peer}, its ncclRecv posted {bytes}",
                                c.rank(),
                                m.len()
                            ),
                        ));
                    }
                    write(ptr, &m);
                }
                Call::AllReduce { send, recv, bytes, dtype, op, seq } => {
                    // Summed in rank order on every rank: the same bits everywhere.
                    let own = read(send, bytes);
                    let mut acc: Option<Vec<u8>> = None;
                    for r in 0..c.nranks() {
                        let part = if r == c.rank() {
                            own.clone()
                        } else {
                            take((c.key ^ seq.rotate_left(17), COLLECTIVE, r, c.rank()), &stop)?
                        };
                        if part.len() != bytes {
                            return Err(Failure::new(
                                INVALID_USAGE,
                                format!(
                                    "NCCL all-reduce: rank {r} contributed {} bytes, rank {} {bytes}",
                                    part.len(),
                                    c.rank()
                                ),
                            ));
                        }
                        match acc.as_mut() {
                            None => acc = Some(part),
                            Some(a) => reduce_into(a, &part, dtype, op)?,
                        }
                    }
                    write(recv, &acc.unwrap_or_default());
                }
                Call::Broadcast { send, recv, bytes, root, seq } => {
                    let data = if root == c.rank() {
                        read(send, bytes)
                    } else {
                        take((c.key ^ seq.rotate_left(17), COLLECTIVE, root, c.rank()), &stop)?
                    };
                    if data.len() != bytes {
                        return Err(Failure::new(
                            INVALID_USAGE,
                            format!("NCCL broadcast: {} bytes from the root, {bytes} expected", data.len()),
                        ));
                    }
                    write(recv, &data);
                }
                Call::Send { .. } => {}
            }
        }
        Ok(())
    }
}

/// A call waiting for its group's end: its communicator and stream.
type Pending = (Arc<Comm>, u64, Call);

thread_local! {
    /// Calls of the thread's open group (`ncclGroupStart` depth and the calls so far, with
    /// the stream each was issued on).
    static GROUP: std::cell::RefCell<(u32, Vec<Pending>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}

/// Hands calls to their streams: one operation per (communicator, stream).
fn submit(calls: Vec<Pending>) -> Result<(), Failure> {
    let d = driver();
    let mut st = d.lock();
    let mut groups: Vec<(Arc<Comm>, u64, Vec<Call>)> = Vec::new();
    for (comm, stream, call) in calls {
        match groups.iter_mut().find(|g| Arc::ptr_eq(&g.0, &comm) && g.1 == stream) {
            Some(g) => g.2.push(call),
            None => groups.push((comm, stream, vec![call])),
        }
    }
    for (comm, stream, calls) in groups {
        // The stream's own context when this thread has none current (a created stream names
        // its context).
        let ctx = match (current(), d.stream_context(&st, stream)) {
            (_, Some(c)) | (Some(c), None) => c,
            (None, None) => return Err(Failure::new(INVALID_USAGE, "NCCL: no CUDA context is current on this thread")),
        };
        if let Some(f) = st.sticky.get(&ctx) {
            return Err(f.clone());
        }
        let sid = d.stream_of(&mut st, ctx, stream)?;
        let group = Group { comm, calls };
        for (p, n, _) in group.ranges() {
            if n > 0 && find_alloc(&st, p, n as u64).is_none_or(|(_, a)| a.host) {
                return Err(Failure::new(
                    INVALID_ARGUMENT,
                    format!("NCCL: {p:#x} (+{n} bytes) is not live device memory"),
                ));
            }
        }
        let label = format!(
            "NCCL group of {} calls (rank {} of {})",
            group.calls.len(),
            group.comm.rank(),
            group.comm.nranks()
        );
        d.enqueue(&mut st, sid, label, OpKind::Nccl(Box::new(group)));
    }
    Ok(())
}

fn issue(comm: *mut c_void, stream: *mut c_void, make: impl FnOnce(&Comm) -> Result<Call, Failure>) -> NcclResult {
    nccl_entry(|| {
        let c = comm_of(comm)?;
        if !ready(&c, "NCCL") {
            return Err(Failure::new(INVALID_ARGUMENT, "NCCL: communicator used before its initialisation completed"));
        }
        let call = make(&c)?;
        let grouped = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.0 > 0 {
                g.1.push((c.clone(), stream as u64, call.clone()));
                true
            } else {
                false
            }
        });
        if grouped {
            Ok(())
        } else {
            submit(vec![(c, stream as u64, call)])
        }
    })
}

/// Whether `c` may be used: NCCL refuses every call on a communicator whose initialisation or
/// split is still in progress (said on stderr, as NCCL_DEBUG=WARN would).
fn ready(c: &Comm, what: &str) -> bool {
    let busy = *c.state.lock().unwrap_or_else(|e| e.into_inner()) == IN_PROGRESS;
    if busy {
        eprintln!(
            "emulated-nccl: {what}: attempt to use a communicator before the previous operation returned ncclSuccess"
        );
    }
    !busy
}

fn nccl_entry(f: impl FnOnce() -> Result<(), Failure>) -> NcclResult {
    nccl_entry_code(|| f().map(|()| SUCCESS))
}

/// As [`nccl_entry`], for a call whose success may be `ncclInProgress`.
fn nccl_entry_code(f: impl FnOnce() -> Result<NcclResult, Failure>) -> NcclResult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("emulated-nccl: {}", e.detail);
            if e.code > 7 {
                // A driver error (a sticky CUDA error, no context, ...).
                UNHANDLED_CUDA_ERROR
            } else {
                e.code
            }
        }
        Err(_) => INTERNAL_ERROR,
    }
}

fn bytes_of(count: usize, dtype: c_int) -> Result<usize, Failure> {
    type_size(dtype)
        .map(|s| s * count)
        .ok_or_else(|| Failure::new(INVALID_ARGUMENT, format!("NCCL data type {dtype} is not one of NCCL's")))
}

fn check_peer(c: &Comm, peer: c_int) -> Result<u32, Failure> {
    u32::try_from(peer).ok().filter(|&p| p < c.nranks()).ok_or_else(|| {
        Failure::new(INVALID_ARGUMENT, format!("NCCL: peer {peer} outside a communicator of {}", c.nranks()))
    })
}

// ---- the exported entry points ----

#[repr(C)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    match unsafe { v.as_mut() } {
        Some(v) => {
            *v = VERSION_CODE;
            SUCCESS
        }
        None => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    let s: &'static std::ffi::CStr = match r {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => c"internal error - please report this issue to the NCCL developers",
        INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    nccl_entry(|| {
        let id = unsafe { id.as_mut() }.ok_or_else(|| Failure::new(INVALID_ARGUMENT, "ncclGetUniqueId: null"))?;
        let n = node()?;
        let key = random_key();
        let mut raw = [0u8; 128];
        raw[..8].copy_from_slice(MAGIC);
        raw[8..16].copy_from_slice(&key.to_le_bytes());
        let addr = n.addr.to_string();
        raw[16] = addr.len() as u8;
        raw[17..17 + addr.len()].copy_from_slice(addr.as_bytes());
        serve_rendezvous(key);
        for (d, s) in id.internal.iter_mut().zip(raw) {
            *d = s as c_char;
        }
        Ok(())
    })
}

/// `ncclConfig_t`'s prefix this stand-in reads.
#[repr(C)]
pub struct ConfigPrefix {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *const ConfigPrefix,
) -> NcclResult {
    nccl_entry_code(|| {
        let out = unsafe { comm.as_mut() }
            .ok_or_else(|| Failure::new(INVALID_ARGUMENT, "ncclCommInitRankConfig: null comm"))?;
        if let Some(cfg) = unsafe { config.as_ref() } {
            if cfg.magic != 0xcafe_beef {
                return Err(Failure::new(
                    INVALID_ARGUMENT,
                    "ncclCommInitRankConfig: the config was not initialised with NCCL_CONFIG_INITIALIZER",
                ));
            }
        }
        if nranks < 1 || rank < 0 || rank >= nranks {
            return Err(Failure::new(INVALID_ARGUMENT, format!("ncclCommInitRankConfig: rank {rank} of {nranks}")));
        }
        if current().is_none() {
            return Err(Failure::new(
                INVALID_USAGE,
                "ncclCommInitRankConfig: no CUDA context is current on this thread",
            ));
        }
        // NCCL's rule: the config's `blocking` (default 1), overridden by NCCL_COMM_BLOCKING.
        let blocking = match std::env::var("NCCL_COMM_BLOCKING").ok().and_then(|v| v.parse::<i32>().ok()) {
            Some(b) => b != 0,
            None => unsafe { config.as_ref() }.is_none_or(|c| c.blocking != 0),
        };
        let raw: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        if &raw[..8] != MAGIC {
            return Err(Failure::new(
                INVALID_ARGUMENT,
                "ncclCommInitRankConfig: not an id of this NCCL (ncclGetUniqueId)",
            ));
        }
        let key = u64::from_le_bytes(raw[8..16].try_into().unwrap_or_default());
        let root: SocketAddr = String::from_utf8_lossy(&raw[17..17 + raw[16] as usize])
            .parse()
            .map_err(|_| Failure::new(INVALID_ARGUMENT, "ncclCommInitRankConfig: a corrupt unique id"))?;
        let c = Arc::new(Comm {
            key,
            rank_: AtomicU32::new(rank as u32),
            nranks_: AtomicU32::new(nranks as u32),
            peers: Mutex::new(Vec::new()),
            state: Mutex::new(IN_PROGRESS),
            detail: Mutex::new(String::new()),
            aborted: AtomicBool::new(false),
            collectives: AtomicU64::new(0),
            splits: AtomicU64::new(0),
        });
        *out = new_handle(c.clone());
        let waiter = c.clone();
        let me = node()?.addr.to_string();
        std::thread::Builder::new()
            .name("emulated-nccl-init".into())
            .spawn(move || {
                let mut body = (rank as u32).to_le_bytes().to_vec();
                body.extend_from_slice(&(nranks as u32).to_le_bytes());
                body.extend_from_slice(me.as_bytes());
                let r = post(root, (key, REGISTER, ANY, 0), &body)
                    .and_then(|()| take((key, TABLE, 0, rank as u32), &|| c.stopped()));
                match r {
                    Ok(table) => {
                        let peers: Vec<SocketAddr> =
                            String::from_utf8_lossy(&table).lines().filter_map(|l| l.parse().ok()).collect();
                        *c.peers.lock().unwrap_or_else(|e| e.into_inner()) = peers;
                        let mut s = c.state.lock().unwrap_or_else(|e| e.into_inner());
                        if *s == IN_PROGRESS {
                            *s = SUCCESS;
                        }
                    }
                    Err(f) => c.fail(f.code, f.detail),
                }
            })
            .map_err(|e| Failure::new(SYSTEM_ERROR, e.to_string()))?;
        if !blocking {
            // The rendezvous completes in the background; ncclCommGetAsyncError tells when.
            return Ok(IN_PROGRESS);
        }
        loop {
            let state = *waiter.state.lock().unwrap_or_else(|e| e.into_inner());
            if state != IN_PROGRESS {
                return Ok(state);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: *mut c_void, state: *mut NcclResult) -> NcclResult {
    match (comm_of(comm), unsafe { state.as_mut() }) {
        (Ok(c), Some(s)) => {
            *s = *c.state.lock().unwrap_or_else(|e| e.into_inner());
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> NcclResult {
    match comms().lock().unwrap_or_else(|e| e.into_inner()).remove(&(comm as u64)) {
        Some(c) => {
            c.aborted.store(true, Ordering::Relaxed);
            SUCCESS
        }
        None => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> NcclResult {
    unsafe { ncclCommAbort(comm) }
}

/// Writes `get(comm)` into `*out` for a communicator that is ready (`ncclCommCount`,
/// `ncclCommUserRank`).
fn comm_query(comm: *mut c_void, out: *mut c_int, what: &str, get: fn(&Comm) -> u32) -> NcclResult {
    // SAFETY: a caller's out-pointer, valid for one write when not null.
    match (comm_of(comm), unsafe { out.as_mut() }) {
        (Ok(c), Some(o)) if ready(&c, what) => {
            *o = get(&c) as c_int;
            SUCCESS
        }
        _ => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, n: *mut c_int) -> NcclResult {
    comm_query(comm, n, "ncclCommCount", Comm::nranks)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, r: *mut c_int) -> NcclResult {
    comm_query(comm, r, "ncclCommUserRank", Comm::rank)
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP.with(|g| g.borrow_mut().0 += 1);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupEnd() -> NcclResult {
    let calls = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 == 0 {
            return None;
        }
        g.0 -= 1;
        Some(if g.0 == 0 { std::mem::take(&mut g.1) } else { Vec::new() })
    });
    match calls {
        None => INVALID_USAGE,
        Some(c) if c.is_empty() => SUCCESS,
        Some(c) => nccl_entry(|| submit(c)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    issue(comm, stream, |c| {
        Ok(Call::Send { ptr: buf as u64, bytes: bytes_of(count, dtype)?, peer: check_peer(c, peer)? })
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    issue(comm, stream, |c| {
        Ok(Call::Recv { ptr: buf as u64, bytes: bytes_of(count, dtype)?, peer: check_peer(c, peer)? })
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    issue(comm, stream, |c| {
        if !(0..=3).contains(&op) {
            return Err(Failure::new(INVALID_ARGUMENT, format!("ncclAllReduce: reduction {op} is not emulated")));
        }
        if !REDUCIBLE.contains(&dtype) {
            // Refused when the call is made, not found later on the stream.
            return Err(Failure::new(
                INVALID_ARGUMENT,
                format!("ncclAllReduce: data type {dtype} is not emulated (int32, float16, float32, bfloat16 are)"),
            ));
        }
        let seq = c.collectives.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(Call::AllReduce { send: send as u64, recv: recv as u64, bytes: bytes_of(count, dtype)?, dtype, op, seq })
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    issue(comm, stream, |c| {
        let root = check_peer(c, root)?;
        let seq = c.collectives.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(Call::Broadcast { send: send as u64, recv: recv as u64, bytes: bytes_of(count, dtype)?, root, seq })
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: *mut c_void,
    color: c_int,
    key: c_int,
    newcomm: *mut *mut c_void,
    _config: *const ConfigPrefix,
) -> NcclResult {
    nccl_entry(|| {
        let parent = comm_of(comm)?;
        let out =
            unsafe { newcomm.as_mut() }.ok_or_else(|| Failure::new(INVALID_ARGUMENT, "ncclCommSplit: null newcomm"))?;
        let split = parent.splits.fetch_add(1, Ordering::Relaxed) + 1;
        let tag = parent.key ^ (0x5A17_0000_0000_0000 | split);
        // Non-blocking, as NCCL's: the call returns at once with the new communicator in
        // progress (NULL for NCCL_SPLIT_NOCOLOR); every rank learns every rank's (color, key)
        // over the parent in the background, and the child's rank, size and peers are set
        // before its state leaves IN_PROGRESS (no call may use it before then).
        let child = (color >= 0).then(|| {
            Arc::new(Comm {
                key: tag ^ (color as u64).rotate_left(29),
                rank_: AtomicU32::new(0),
                nranks_: AtomicU32::new(0),
                peers: Mutex::new(Vec::new()),
                state: Mutex::new(IN_PROGRESS),
                detail: Mutex::new(String::new()),
                aborted: AtomicBool::new(false),
                collectives: AtomicU64::new(0),
                splits: AtomicU64::new(0),
            })
        });
        *out = match &child {
            Some(c) => new_handle(c.clone()),
            None => std::ptr::null_mut(),
        };
        let exchange = move || -> Result<Option<(u32, u32, Vec<SocketAddr>)>, Failure> {
            let mine = [color.to_le_bytes(), key.to_le_bytes()].concat();
            for r in (0..parent.nranks()).filter(|&r| r != parent.rank()) {
                post(parent.peer(r)?, (tag, SPLIT, parent.rank(), r), &mine)?;
            }
            let mut all = vec![(color, key, parent.rank())];
            for r in (0..parent.nranks()).filter(|&r| r != parent.rank()) {
                let m = take((tag, SPLIT, r, parent.rank()), &|| parent.stopped())?;
                let c = i32::from_le_bytes(m[0..4].try_into().unwrap_or_default());
                let k = i32::from_le_bytes(m[4..8].try_into().unwrap_or_default());
                all.push((c, k, r));
            }
            if color < 0 {
                return Ok(None);
            }
            let mut members: Vec<(i32, u32)> = all.iter().filter(|m| m.0 == color).map(|m| (m.1, m.2)).collect();
            members.sort();
            let peers = parent.peers.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let rank = members.iter().position(|m| m.1 == parent.rank()).unwrap_or(0) as u32;
            Ok(Some((rank, members.len() as u32, members.iter().map(|m| peers[m.1 as usize]).collect())))
        };
        std::thread::Builder::new()
            .name("emulated-nccl-split".into())
            .spawn(move || match (exchange(), child) {
                (Ok(Some((rank, n, peers))), Some(c)) => {
                    c.rank_.store(rank, Ordering::Release);
                    c.nranks_.store(n, Ordering::Release);
                    *c.peers.lock().unwrap_or_else(|e| e.into_inner()) = peers;
                    let mut s = c.state.lock().unwrap_or_else(|e| e.into_inner());
                    if *s == IN_PROGRESS {
                        *s = SUCCESS;
                    }
                }
                (Err(f), Some(c)) => c.fail(f.code, f.detail),
                _ => {}
            })
            .map_err(|e| Failure::new(SYSTEM_ERROR, e.to_string()))?;
        Ok(())
    })
}
