//! [`DeviceComm`]: P ranks as P threads sharing one GPU, moving [`DeviceBuf`]s with
//! device-to-device copies on a copy stream per rank; and [`run_on_device`], the drivers of
//! [`crate::parallel`] on it with [`DeviceBackend`].

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaStream};

use super::device_buf::{wait_event, DeviceBuf};
use super::probe::guard;
use super::{CudaDevice, DeviceBackend};
use crate::attention::{ForwardOutput, Gradients};
use crate::comm::{Communicator, LocalComm, LocalOptions, RecvHandle, SendHandle, Tag};
use crate::kernels::geometry::DqMode;
use crate::parallel::{self, Buffers, ParallelParams, ParallelPlan, ProcessRun, Stats};
use crate::{DType, Dims, Error, HostBuf, Result, Tensor};

/// One rank of a group of in-process ranks (threads) sharing one GPU, moving [`DeviceBuf`]s:
/// the device-resident twin of [`LocalComm`] (NCCL refuses two ranks on one GPU, so this
/// one is our own).
///
/// * **Sends** copy the buffer device to device on this rank's **copy stream** (its own
///   stream, distinct from any compute stream): the copy waits for the buffer's producer
///   (its readiness event and cudarc's per-allocation events), and an event recorded after
///   it travels with the copy, so the receiver's streams wait for the data without the
///   host blocking. A send's handle completes once the copy has run (the source stays
///   alive until then, even if the handle is dropped).
/// * **Matching, mailboxes, deadlines, failure propagation, splits, the link model and the
///   byte counts** are those of [`LocalComm`] (wrapped, over `DeviceBuf` payloads): every
///   wait has the group's deadline ([`Error::Timeout`]), an aborted group fails every wait
///   with [`Error::PeerFailed`], and a receive of another length than announced fails with
///   [`Error::ShapeMismatch`].
///
/// ```no_run
/// use ringattn::comm::{Communicator, LocalOptions};
/// use ringattn::cuda::{CudaDevice, DeviceBackend, DeviceComm};
/// use ringattn::parallel::Buffers;
/// use ringattn::{DType, Elem, HostBuf};
/// let dev = CudaDevice::shared(0)?;
/// let comms = DeviceComm::group(2, LocalOptions::default(), &dev)?;
/// std::thread::scope(|s| {
///     for c in &comms {
///         let dev = dev.clone();
///         s.spawn(move || -> ringattn::Result<()> {
///             let be = DeviceBackend::new(dev, DType::BF16)?;
///             let peer = 1 - c.rank();
///             let recv = c.irecv(peer, 0, 3, Elem::F32)?;
///             c.isend(peer, 0, be.upload(&HostBuf::from(vec![c.rank() as f32; 3]))?)?.wait()?;
///             assert_eq!(be.download(&recv.wait()?)?, vec![peer as f32; 3]);
///             Ok(())
///         });
///     }
/// });
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct DeviceComm {
    inner: Box<dyn Communicator<Buf = DeviceBuf>>,
    copy: Arc<CudaStream>,
    device: Arc<CudaDevice>,
    /// Whether sends copy (false: the receiver gets the sender's buffer itself, i.e.
    /// instant communication, for measuring a schedule's compute alone).
    copies: bool,
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("rank", &self.inner.rank())
            .field("size", &self.inner.size())
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl DeviceComm {
    /// The `size` ranks of a new group on `device`, each with its own copy stream; give
    /// one to each rank's thread.
    ///
    /// # Errors
    /// [`Error::Cuda`] when a stream cannot be created.
    pub fn group(size: usize, options: LocalOptions, device: &Arc<CudaDevice>) -> Result<Vec<DeviceComm>> {
        LocalComm::<DeviceBuf>::group(size, options)
            .into_iter()
            .map(|c| {
                let copy = guard("creating a copy stream", || device.context().new_stream())?;
                Ok(DeviceComm { inner: Box::new(c), copy, device: device.clone(), copies: true })
            })
            .collect()
    }

    /// [`DeviceComm::group`] on GPU `ordinal` ([`CudaDevice::shared`]).
    ///
    /// # Errors
    /// As [`CudaDevice::new`] (no driver or GPU: [`Error::Cuda`]) and [`DeviceComm::group`].
    pub fn open(size: usize, options: LocalOptions, ordinal: usize) -> Result<Vec<DeviceComm>> {
        DeviceComm::group(size, options, &CudaDevice::shared(ordinal)?)
    }

    /// The same ranks with instant communication: a send hands the receiver the sender's
    /// buffer (ordered by its readiness event) instead of copying it.
    pub fn without_copies(mut self) -> Self {
        self.copies = false;
        self
    }

    /// This rank's copy stream.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Copies the first `data.len()` values of `data` into a new buffer on the copy stream,
    /// returning it with the event recorded after the copy.
    fn copy_out(&self, data: &DeviceBuf) -> Result<(DeviceBuf, Arc<CudaEvent>)> {
        if **data.context() != **self.device.context() {
            return Err(Error::Cuda(format!(
                "send: the buffer was allocated on another device than {}",
                self.device.ordinal()
            )));
        }
        let n = data.len();
        let s = &self.copy;
        data.wait_on(s)?;
        let mut buf = DeviceBuf::alloc(s, data.elem(), n)?;
        if n > 0 {
            let (src, _gs) = data.read_ptr(s)?;
            let (dst, _gd) = buf.write_ptr(s)?;
            // SAFETY: both addresses hold at least `data.bytes()` bytes of live allocations
            // (the source is kept alive by the send until the copy has run); ordered on `s`.
            guard("send: cuMemcpyDtoDAsync on the copy stream", || unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, data.bytes(), s.cu_stream())
            })?;
        }
        let done = Arc::new(guard("recording an event", || s.record_event(None))?);
        buf.set_ready(Some(done.clone()));
        Ok((buf, done))
    }
}

/// A send in flight: keeps the source alive until the copy has run, also when its handle is
/// dropped unwaited.
struct InFlight {
    done: Arc<CudaEvent>,
    _src: DeviceBuf,
    peer: usize,
    deadline: Duration,
    waited: bool,
}

impl InFlight {
    fn wait(&mut self) -> Result<()> {
        wait_event(&self.done, "send (device copy)", self.peer, self.deadline)?;
        self.waited = true;
        Ok(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.waited {
            // Errors were (or will be) reported by the waits; this only keeps the source alive.
            let _ = wait_event(&self.done, "send (device copy)", self.peer, self.deadline);
        }
    }
}

impl Communicator for DeviceComm {
    type Buf = DeviceBuf;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn deadline(&self) -> Duration {
        self.inner.deadline()
    }

    fn set_deadline(&self, deadline: Duration) -> Result<()> {
        self.inner.set_deadline(deadline)
    }

    fn isend(&self, to: usize, tag: Tag, data: DeviceBuf) -> Result<SendHandle> {
        if to >= self.size() {
            return Err(Error::InvalidArgument(format!("send: rank {to} out of range for {} ranks", self.size())));
        }
        if !self.copies {
            return self.inner.isend(to, tag, data);
        }
        let (copy, done) = self.copy_out(&data)?;
        let mut flight = InFlight { done, _src: data, peer: to, deadline: self.deadline(), waited: false };
        let handle = self.inner.isend(to, tag, copy)?;
        Ok(SendHandle::new(move || {
            handle.wait()?;
            flight.wait()
        }))
    }

    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: crate::Elem) -> Result<RecvHandle<DeviceBuf>> {
        self.inner.irecv(from, tag, len, elem)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    fn depart(&self) {
        self.inner.depart()
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = DeviceBuf>>> {
        let inner = self.inner.split(color, key)?;
        Ok(Box::new(DeviceComm { inner, copy: self.copy.clone(), device: self.device.clone(), copies: self.copies }))
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
}

/// Options of [`run_on_device`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceRunOptions {
    /// GPU ordinal shared by every rank.
    pub device: usize,
    /// How the backward computes dq.
    pub dq_mode: DqMode,
    /// Which kernel family runs the forward and the backward.
    pub kernels: crate::kernels::geometry::KernelFamily,
    /// What runs: everything, or compute or communication alone (for overlap measurements).
    pub mode: DeviceRunMode,
}

/// What a device run executes ([`DeviceRunOptions::mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRunMode {
    /// The schedule as it is.
    #[default]
    Full,
    /// Instant communication: sends hand buffers over without copying
    /// ([`DeviceComm::without_copies`]).
    ComputeOnly,
    /// No attention kernels ([`DeviceBackend::without_compute`]); outputs are meaningless.
    CommOnly,
}

/// Timing of one pass (forward or backward) of [`measure_device_overlap`]. Every time is in
/// milliseconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PassTiming {
    /// Host wall time of the pass on each rank (the driver's call, from the handshake to its
    /// outputs on the host, i.e. after the final synchronisation).
    pub wall_ms: Vec<f64>,
    /// GPU time of each rank's attention steps (the kernels of every `forward_block` /
    /// `backward_block`, between timing events on its compute stream), summed.
    pub compute_ms: Vec<f64>,
    /// Steps each rank computed.
    pub steps: Vec<usize>,
    /// The slowest rank's wall time.
    pub max_wall_ms: f64,
    /// The largest per-rank step sum.
    pub max_compute_ms: f64,
    /// `max_wall_ms − max_compute_ms`: time of the slowest rank not covered by its own
    /// attention kernels (communication not hidden, merges and additions, launches, the
    /// handshake, uploads and downloads).
    pub exposed_ms: f64,
    /// `max_compute_ms / max_wall_ms` (1 when communication and the rest hide entirely).
    pub compute_fraction: f64,
    /// The slowest rank's wall time with instant communication ([`DeviceRunMode::ComputeOnly`]).
    pub compute_only_ms: Option<f64>,
    /// The slowest rank's wall time without attention kernels ([`DeviceRunMode::CommOnly`]).
    pub comm_only_ms: Option<f64>,
    /// Share of the communication hidden behind compute, as [`crate::parallel::Overlap`]
    /// defines it: `1 − (max_wall_ms − compute_only_ms) / comm_only_ms`, clamped to [0, 1].
    pub hidden: Option<f64>,
}

impl PassTiming {
    fn new(ranks: &[(Duration, Vec<f64>)]) -> PassTiming {
        let wall_ms: Vec<f64> = ranks.iter().map(|r| r.0.as_secs_f64() * 1e3).collect();
        let compute_ms: Vec<f64> = ranks.iter().map(|r| r.1.iter().sum()).collect();
        let max_wall_ms = wall_ms.iter().copied().fold(0.0, f64::max);
        let max_compute_ms = compute_ms.iter().copied().fold(0.0, f64::max);
        PassTiming {
            steps: ranks.iter().map(|r| r.1.len()).collect(),
            exposed_ms: (max_wall_ms - max_compute_ms).max(0.0),
            compute_fraction: if max_wall_ms > 0.0 { (max_compute_ms / max_wall_ms).min(1.0) } else { 1.0 },
            compute_only_ms: None,
            comm_only_ms: None,
            hidden: None,
            wall_ms,
            compute_ms,
            max_wall_ms,
            max_compute_ms,
        }
    }
}

/// The overlap of a sequence-parallel schedule on one GPU ([`measure_device_overlap`]):
/// each pass's wall time against the GPU time of its attention kernels. The ranks share the
/// GPU, so their kernels also contend with each other; compare `compute_ms` summed over
/// ranks with a single rank's wall time to see that.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceOverlap {
    /// Strategy measured.
    pub strategy: String,
    /// Ranks.
    pub world: usize,
    /// The forward.
    pub forward: PassTiming,
    /// The backward, when `d_o` was given.
    pub backward: Option<PassTiming>,
    /// Bytes each rank sent in the measured run (both passes).
    pub bytes_sent: Vec<u64>,
}

/// What one rank returns: forward output and stats, backward, step times of both passes.
type RankResult = (ForwardOutput, Stats, Option<(Gradients, Stats)>, Vec<f64>, Vec<f64>);

/// Shards full tensors by the strategy's layout over `world` ranks (threads) sharing GPU
/// `run.device`, runs the forward (and the backward when `d_o` is given) with a
/// [`DeviceBackend`] per rank (its own compute stream) and a [`DeviceComm`] (copies on a
/// copy stream per rank), and gathers the results in the original token order: the
/// device-resident twin of [`crate::parallel::run_in_process`]. Inputs are uploaded once
/// per rank; everything between stays on the GPU; outputs are downloaded at the end.
///
/// # Errors
/// [`Error::BackendUnsupported`] for f32 inputs or a head dimension the kernels do not take;
/// [`Error::Cuda`] without a driver or GPU; otherwise the first error of any rank (every rank
/// fails with an error when one does: a failing rank aborts the group).
///
/// ```no_run
/// use ringattn::comm::LocalOptions;
/// use ringattn::cuda::{run_on_device, DeviceRunOptions};
/// use ringattn::parallel::{ParallelParams, Strategy};
/// use ringattn::{random::randn, DType};
/// let q = randn(vec![1, 4096, 8, 64], 5, DType::BF16);
/// let params = ParallelParams { strategy: Strategy::Ring, ..Default::default() };
/// let run = run_on_device(4, LocalOptions::default(), &DeviceRunOptions::default(), &q, &q, &q, None, &params)?;
/// assert_eq!(run.forward.o.shape(), &[1, 4096, 8, 64]);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn run_on_device(
    world: usize,
    options: LocalOptions,
    run: &DeviceRunOptions,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &ParallelParams,
) -> Result<ProcessRun> {
    run_ranks(world, options, run, q, k, v, d_o, params, false).map(|(r, _)| r)
}

/// Runs [`run_on_device`] four times — a warm-up that loads the kernels, a measured run with
/// every attention step bracketed by timing events, a run with instant communication and a
/// run without attention kernels — and returns, per pass, the host wall time of each rank
/// against the GPU time of its attention kernels, and the share of the communication hidden
/// behind compute as [`crate::parallel::Overlap`] defines it.
///
/// # Errors
/// As [`run_on_device`].
///
/// ```no_run
/// use ringattn::comm::LocalOptions;
/// use ringattn::cuda::{measure_device_overlap, DeviceRunOptions};
/// use ringattn::parallel::{ParallelParams, Strategy};
/// use ringattn::{random::randn, DType, Mask};
/// let x = randn(vec![1, 16384, 8, 128], 1, DType::BF16);
/// let params = ParallelParams { strategy: Strategy::Ring, attention: ringattn::AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let o = measure_device_overlap(4, LocalOptions::default(), &DeviceRunOptions::default(), &x, &x, &x, Some(&x), &params)?;
/// println!("{}", serde_json::to_string_pretty(&o).unwrap());
/// # Ok::<(), ringattn::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn measure_device_overlap(
    world: usize,
    options: LocalOptions,
    run: &DeviceRunOptions,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &ParallelParams,
) -> Result<DeviceOverlap> {
    let full = DeviceRunOptions { mode: DeviceRunMode::Full, ..*run };
    run_ranks(world, options, &full, q, k, v, d_o, params, false)?;
    let (measured, timing) = run_ranks(world, options, &full, q, k, v, d_o, params, true)?;
    let bytes_sent =
        measured.stats.iter().map(|(f, b)| f.bytes_sent + b.as_ref().map_or(0, |b| b.bytes_sent)).collect();
    let slowest = |t: &[(Duration, Vec<f64>)]| t.iter().map(|r| r.0.as_secs_f64() * 1e3).fold(0.0, f64::max);
    let mode = |mode| DeviceRunOptions { mode, ..*run };
    let (_, compute_only) = run_ranks(world, options, &mode(DeviceRunMode::ComputeOnly), q, k, v, d_o, params, false)?;
    let (_, comm_only) = run_ranks(world, options, &mode(DeviceRunMode::CommOnly), q, k, v, d_o, params, false)?;
    let pass = |t: &[(Duration, Vec<f64>)], c: &[(Duration, Vec<f64>)], n: &[(Duration, Vec<f64>)]| {
        let mut p = PassTiming::new(t);
        let (c, n) = (slowest(c), slowest(n));
        p.compute_only_ms = Some(c);
        p.comm_only_ms = Some(n);
        p.hidden = Some(parallel::hidden_share(p.max_wall_ms, c, n));
        p
    };
    let (fwd, bwd) = timing;
    Ok(DeviceOverlap {
        strategy: params.strategy.to_string(),
        world,
        forward: pass(&fwd, &compute_only.0, &comm_only.0),
        backward: d_o.map(|_| pass(&bwd, &compute_only.1, &comm_only.1)),
        bytes_sent,
    })
}

/// Per rank: (wall time, step times) of the forward, and of the backward.
type Timings = (Vec<(Duration, Vec<f64>)>, Vec<(Duration, Vec<f64>)>);

#[allow(clippy::too_many_arguments)]
fn run_ranks(
    world: usize,
    options: LocalOptions,
    run: &DeviceRunOptions,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &ParallelParams,
    timed: bool,
) -> Result<(ProcessRun, Timings)> {
    let dims = Dims::of(q, k, v)?;
    if dims.s_q != dims.s_k {
        return Err(Error::Parallel(format!(
            "sequence parallelism splits one sequence: q has {} tokens and k has {}",
            dims.s_q, dims.s_k
        )));
    }
    crate::runner::check_supported(super::BACKEND, &dims, q.dtype())?;
    let resolved = params.resolve_for(world, &dims, q.dtype())?;
    let device = CudaDevice::shared(run.device)?;
    let mut comms = DeviceComm::group(world, options, &device)?;
    if run.mode == DeviceRunMode::ComputeOnly {
        comms = comms.into_iter().map(DeviceComm::without_copies).collect();
    }
    let backends = (0..world)
        .map(|_| {
            let be = DeviceBackend::new(device.clone(), q.dtype())?.with_dq_mode(run.dq_mode).with_kernels(run.kernels);
            Ok(if run.mode == DeviceRunMode::CommOnly { be.without_compute() } else { be })
        })
        .collect::<Result<Vec<_>>>()?;
    let rank_fn = |comm: &DeviceComm, be: &DeviceBackend| -> Result<RankResult> {
        // Shards go to the device before, and results come back after, the timed calls: the
        // plan runs on device buffers with no host transfer.
        let up = |t: &Tensor| be.upload(&HostBuf::from_tensor(&resolved.shard(t, comm.rank())?));
        let (qb, kb, vb) = (up(q)?, up(k)?, up(v)?);
        let dob = d_o.map(up).transpose()?;
        let n = resolved.positions(comm.rank()).len();
        let dims = Dims { s_q: n, s_k: n, ..dims };
        let plan = ParallelPlan::new(comm, be, &resolved, &dims, q.dtype())?;
        let finished = |bufs: &[&DeviceBuf], start: std::time::Instant| -> Result<Duration> {
            for b in bufs {
                b.wait_ready("the call's results", comm.rank(), options.deadline)?;
            }
            Ok(start.elapsed())
        };
        be.record_step_times(timed);
        let start = std::time::Instant::now();
        let (o, saved) = plan.forward(&qb, &kb, &vb)?;
        let mut fs = plan.last_stats();
        fs.total = finished(&[&o, &saved.lse], start)?;
        let fwd_steps = be.step_times_ms()?;
        let g = match &dob {
            Some(d) => {
                let start = std::time::Instant::now();
                let g = plan.backward(&saved, d)?;
                let mut bs = plan.last_stats();
                bs.total = finished(&[&g.dq, &g.dk, &g.dv], start)?;
                Some((g, bs))
            }
            None => None,
        };
        let bwd_steps = be.step_times_ms()?;
        be.record_step_times(false);
        let dtype = q.dtype();
        let f = ForwardOutput {
            o: plan.download_tensor(&o, dims.o_shape(), dtype)?,
            lse: plan.download_tensor(&saved.lse, dims.lse_shape(), DType::F32)?,
        };
        let g = match g {
            Some((g, bs)) => Some((
                Gradients {
                    dq: plan.download_tensor(&g.dq, dims.q_shape(), dtype)?,
                    dk: plan.download_tensor(&g.dk, dims.k_shape(), dtype)?,
                    dv: plan.download_tensor(&g.dv, dims.v_shape(), dtype)?,
                    dsinks: g
                        .dsinks
                        .as_ref()
                        .map(|x| plan.download_tensor(x, vec![dims.h_q], DType::F32))
                        .transpose()?,
                },
                bs,
            )),
            None => None,
        };
        Ok((f, fs, g, fwd_steps, bwd_steps))
    };
    let results = crate::comm::run_each(&comms, None, |c| {
        // CUDA errors observed on this thread name the rank (the ranks share one context).
        super::health::as_rank(c.rank(), || rank_fn(c, &backends[c.rank()]))
    });
    let parts = parallel::collect_ranks(results)?;
    let timings = (
        parts.iter().map(|x| (x.1.total, x.3.clone())).collect(),
        parts.iter().map(|x| (x.2.as_ref().map_or(Duration::ZERO, |g| g.1.total), x.4.clone())).collect(),
    );
    let runs = parts.into_iter().map(|x| (x.0, x.1, x.2)).collect();
    Ok((parallel::assemble(&resolved, d_o.is_some(), runs)?, timings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_timing_takes_the_slowest_rank() {
        let t = PassTiming::new(&[
            (Duration::from_millis(10), vec![2.0, 3.0]),
            (Duration::from_millis(12), vec![4.0, 4.0, 1.0]),
        ]);
        assert_eq!(t.steps, vec![2, 3]);
        assert_eq!(t.max_compute_ms, 9.0);
        assert!((t.max_wall_ms - 12.0).abs() < 1e-9);
        assert!((t.exposed_ms - 3.0).abs() < 1e-9);
        assert!((t.compute_fraction - 0.75).abs() < 1e-9);
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains("\"compute_fraction\":0.75"), "{json}");
    }
}
