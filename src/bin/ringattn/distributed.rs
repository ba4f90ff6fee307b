//! `ringattn run --comm mpi|nccl`: the ranks are the processes of a job (mpirun, srun, or a
//! torchrun-style launcher for NCCL). Each reads only its own rows of the input file, runs
//! its part of the strategy, and rank 0 gathers the results and writes the output file
//! (atomically, as a single-process run does).
//!
//! A rank that fails aborts the whole job with a message; a handshake error, which every
//! rank finds by itself, is printed once by rank 0 and every rank exits with status 1; a
//! rank that dies is noticed by the launcher, which ends the job.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ringattn::comm::{all_gather, all_gather_v, Communicator, Payload, RecvHandle, SendHandle, Tag};
#[cfg(feature = "mpi")]
use ringattn::comm::{MpiComm, MpiOptions};
use ringattn::io::TensorFile;
use ringattn::parallel::{gather_results, Backend, Buffers, ParallelParams, ParallelPlan, Stats, Strategy};
use ringattn::{Dims, Elem, Error, HostBuf, Result};

#[cfg(feature = "mpi")]
use crate::args::BackendKind;
use crate::args::CommKind;
use crate::run::{write_rank_stats, RankStats, RunArgs};

/// A planted failure for tests of the failure paths (`--fault RANK:die:N` or
/// `RANK:stall:N`): rank RANK dies (abort, as if killed) or stops answering (sleeps) when
/// it posts its N-th send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    rank: usize,
    die: bool,
    after_sends: usize,
}

impl std::str::FromStr for Fault {
    type Err = Error;
    fn from_str(s: &str) -> Result<Fault> {
        let bad = || Error::InvalidArgument(format!("--fault `{s}`: expected RANK:die:N or RANK:stall:N"));
        let parts: Vec<&str> = s.split(':').collect();
        let [rank, kind, n] = parts[..] else { return Err(bad()) };
        let die = match kind {
            "die" => true,
            "stall" => false,
            _ => return Err(bad()),
        };
        Ok(Fault { rank: rank.parse().map_err(|_| bad())?, die, after_sends: n.parse().map_err(|_| bad())? })
    }
}

/// A communicator that carries out a [`Fault`] on its rank (and on every group split from
/// it), delegating everything else.
struct Faulty<B: Payload> {
    inner: Box<dyn Communicator<Buf = B>>,
    fault: Option<Fault>,
    sends: Arc<AtomicUsize>,
}

impl<B: Payload> Communicator for Faulty<B> {
    type Buf = B;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn deadline(&self) -> Duration {
        self.inner.deadline()
    }

    fn isend(&self, to: usize, tag: Tag, data: B) -> Result<SendHandle> {
        if let Some(f) = self.fault {
            if self.sends.fetch_add(1, Ordering::Relaxed) + 1 == f.after_sends {
                if f.die {
                    eprintln!("ringattn: planted fault: this rank dies now");
                    std::process::abort();
                }
                eprintln!("ringattn: planted fault: this rank stops answering");
                std::thread::sleep(Duration::from_secs(24 * 3600));
            }
        }
        self.inner.isend(to, tag, data)
    }

    fn irecv(&self, from: usize, tag: Tag, len: usize, elem: Elem) -> Result<RecvHandle<B>> {
        self.inner.irecv(from, tag, len, elem)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator<Buf = B>>> {
        let inner = self.inner.split(color, key)?;
        Ok(Box::new(Faulty { inner, fault: self.fault, sends: self.sends.clone() }))
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

/// `ringattn run --comm mpi|nccl`.
pub fn run(a: &RunArgs) -> Result<ExitCode> {
    let attention = a.mask.params()?;
    let params = a.exec.parallel(attention)?;
    let fault = a.fault.as_deref().map(str::parse::<Fault>).transpose()?;
    let deadline = a.exec.deadline()?;
    match a.exec.comm_kind()? {
        #[cfg(feature = "mpi")]
        CommKind::Mpi => {
            let world = MpiComm::init(MpiOptions { deadline, ..Default::default() })?;
            let fault = fault.filter(|f| f.rank == world.rank());
            let comm = Faulty { inner: Box::new(world), fault, sends: Arc::new(AtomicUsize::new(0)) };
            finish(&comm, || run_host(&comm, a, params))
        }
        #[cfg(feature = "cuda")]
        CommKind::Nccl => {
            if a.exec.backend != "cuda" {
                return Err(Error::InvalidArgument(format!(
                    "--comm nccl moves device buffers: it needs --backend cuda, not {}",
                    a.exec.backend
                )));
            }
            let (comm, device, host) = nccl_comm(deadline)?;
            let fault = fault.filter(|f| f.rank == comm.rank());
            let comm = Faulty { inner: Box::new(comm), fault, sends: Arc::new(AtomicUsize::new(0)) };
            let code = finish(&comm, || {
                let dtype = input_dtype(a)?;
                let be = ringattn::cuda::DeviceBackend::open(device, dtype)?
                    .with_step_deadline(deadline)
                    .with_kernels(a.exec.kernels()?);
                run_rank(&comm, &be, a, params)
            });
            // NCCL first, then MPI (finalised when its communicator goes). After a failure
            // the MPI job is aborted instead: MPI_Finalize waits for every rank, and a rank
            // that stopped answering would hold this one (and the launcher) forever.
            drop(comm);
            if let Err(e) = &code {
                abort_host(host.as_deref(), &e.to_string());
            }
            drop(host);
            code
        }
        other => Err(Error::InvalidArgument(format!("--comm {other:?}: not a multi-process communicator"))),
    }
}

/// Runs `work` on this rank and ends it as the contract says: success; a handshake error
/// (found by every rank) printed once and an orderly exit 1; any other error aborts the job.
fn finish<B: Payload>(comm: &Faulty<B>, work: impl FnOnce() -> Result<()>) -> Result<ExitCode> {
    let rank = comm.rank();
    match work() {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e @ Error::Handshake(_)) => {
            if rank == 0 {
                eprintln!("error: {e}");
            }
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            comm.abort(&e.to_string());
            Err(e)
        }
    }
}

/// What keeps the bootstrap communicator (MPI) alive while NCCL runs.
#[cfg(feature = "cuda")]
type KeepAlive = Option<Box<dyn std::any::Any>>;

/// Aborts the MPI job behind the NCCL communicator, if MPI bootstrapped it (`MPI_Abort`: every
/// process of the job ends; the communicator prints `reason`).
#[cfg(feature = "cuda")]
fn abort_host(host: Option<&dyn std::any::Any>, reason: &str) {
    #[cfg(feature = "mpi")]
    if let Some(mpi) = host.and_then(|h| h.downcast_ref::<MpiComm>()) {
        mpi.abort(reason);
    }
    #[cfg(not(feature = "mpi"))]
    let _ = (host, reason);
}

/// The NCCL communicator of this process and its GPU (local rank modulo the visible devices):
/// bootstrapped through MPI when the build has it and an MPI launcher started the process,
/// else over TCP from the launcher's environment (torchrun, srun, mpirun or PMI variables;
/// see `ringattn::cuda::BootstrapEnv`).
#[cfg(feature = "cuda")]
fn nccl_comm(deadline: Duration) -> Result<(ringattn::cuda::NcclComm, usize, KeepAlive)> {
    use ringattn::cuda::{probe, BootstrapEnv, NcclComm};
    let env = BootstrapEnv::from_env();
    #[cfg(feature = "mpi")]
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some() {
        let host = MpiComm::init(MpiOptions { deadline, ..Default::default() })?;
        let local = env.as_ref().map_or(host.rank(), |e| e.local_rank);
        let joined = probe()
            .and_then(|p| ringattn::cuda::device_ordinal(local, p.device_count))
            .and_then(|device| Ok((NcclComm::from_host_comm(&host, device, deadline)?, device)));
        return match joined {
            Ok((c, device)) => Ok((c, device, Some(Box::new(host)))),
            Err(e) => {
                host.abort(&e.to_string());
                Err(e)
            }
        };
    }
    let device = env?.device(probe()?.device_count)?;
    Ok((NcclComm::from_env(deadline)?, device, None))
}

/// The dtype of `q` in the input file.
#[cfg(feature = "cuda")]
fn input_dtype(a: &RunArgs) -> Result<ringattn::DType> {
    let file = TensorFile::open(&a.input)?;
    file.info("q").map(|(d, _)| d).ok_or_else(|| Error::MissingTensor { path: a.input.clone(), name: "q".into() })
}

/// A host-buffer communicator's run on the backend of --backend.
#[cfg(feature = "mpi")]
fn run_host(comm: &dyn Communicator<Buf = HostBuf>, a: &RunArgs, params: ParallelParams) -> Result<()> {
    match a.exec.backend()? {
        BackendKind::Cpu => run_rank(comm, &a.exec.cpu_backend()?, a, params),
        #[cfg(feature = "emu")]
        BackendKind::Emu => {
            let dtype = TensorFile::open(&a.input)?.info("q").map_or(ringattn::DType::BF16, |(d, _)| d);
            run_rank(comm, &ringattn::emu::EmuBackend { dtype, options: a.exec.emu_options()? }, a, params)
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let dtype = input_dtype(a)?;
            run_rank(comm, &ringattn::cuda::CudaBackend::new(0, dtype)?.with_kernels(a.exec.kernels()?), a, params)
        }
        #[allow(unreachable_patterns)]
        other => Err(Error::InvalidArgument(format!("--backend {other:?}: not in this build"))),
    }
}

/// One rank's whole job: its rows in, its part of the strategy, the results (and, with
/// --stats, the statistics) gathered to rank 0, which writes them.
fn run_rank<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    be: &Be,
    a: &RunArgs,
    mut params: ParallelParams,
) -> Result<()> {
    let (world, rank) = (comm.size(), comm.rank());
    if let Some(w) = a.exec.world {
        if w != world {
            return Err(Error::InvalidArgument(format!("--world {w}, but the job has {world} ranks")));
        }
    }
    if params.strategy == Strategy::Single && world != 1 {
        return Err(Error::InvalidArgument(format!(
            "--strategy single with a job of {world} ranks: choose {}",
            Strategy::list(&Strategy::PARALLEL)
        )));
    }
    let file = TensorFile::open(&a.input)?;
    let info = |name: &str| {
        let (dtype, shape) =
            file.info(name).ok_or_else(|| Error::MissingTensor { path: a.input.clone(), name: name.into() })?;
        match shape[..] {
            [b, s, h, d] => Ok((dtype, [b, s, h, d])),
            _ => Err(Error::ShapeMismatch(format!("{name} has shape {shape:?}; expected [b, s, h, d]"))),
        }
    };
    let (dtype, [b, s, h_q, d_qk]) = info("q")?;
    // The whole batch's shape (what --strategy auto chooses from; the plan checks every
    // rank's rows against it).
    let (_, [_, _, h_kv, _]) = info("k")?;
    let (_, [_, _, _, d_v]) = info("v")?;
    let whole = Dims { b, s_q: s, s_k: s, h_q, h_kv, d_qk, d_v };
    params.seq_len = s;
    // The input file's sinks (if any; every rank reads them whole) join the parameters.
    if file.info("sinks").is_some() {
        let x = ringattn::io::AttentionInputs::sinks_of(&file.read_whole("sinks")?)?;
        params.attention.sinks = Some(x);
    }
    // Resolved once: a configuration error found on every rank is a handshake error (printed
    // once); the plan's handshake then checks what every rank read.
    let resolved = params.resolve_for(world, &whole, dtype).map_err(|e| Error::Handshake(e.to_string()))?;
    let x = file.read_input_rows(resolved.positions(rank))?;
    let plan = ParallelPlan::new(comm, be, &resolved, &Dims::of(&x.q, &x.k, &x.v)?, x.q.dtype())?;
    let mut totals = Vec::with_capacity(a.repeat.max(1));
    let mut last = None;
    for _ in 0..a.repeat.max(1) {
        let (fwd, fs) = plan.forward_tensors(&x.q, &x.k, &x.v)?;
        let (grads, bs) = match &x.d_o {
            Some(d_o) => {
                let (g, s) = plan.backward_tensors(&x.q, &x.k, &x.v, &fwd.o, &fwd.lse, d_o)?;
                (Some(g), Some(s))
            }
            None => (None, None),
        };
        totals.push(fs.total.as_secs_f64() + bs.as_ref().map_or(0.0, |b| b.total.as_secs_f64()));
        last = Some((fwd, grads, fs, bs));
    }
    let Some((fwd, grads, fs, bs)) = last else {
        return Err(Error::InvalidArgument("--repeat must be at least 1".into()));
    };
    let ranks = match &a.stats {
        Some(_) => gather_stats(comm, be, (fs, bs), totals)?,
        None => None,
    };
    if let Some((fwd, grads)) = gather_results(comm, be, &fwd, grads.as_ref(), plan.resolved(), 0)? {
        crate::run::write_outputs(&a.output, &fwd, grads.as_ref())?;
        if let (Some(path), Some(ranks)) = (&a.stats, ranks) {
            write_rank_stats(path, &a.exec.strategy, ranks)?;
        }
    }
    Ok(())
}

/// Gathers every rank's statistics to rank 0 as JSON texts (lengths first, then the texts),
/// in the backend's buffers.
fn gather_stats<Bu: Buffers>(
    comm: &dyn Communicator<Buf = Bu::Buf>,
    be: &Bu,
    stats: (Stats, Option<Stats>),
    repeat_totals_s: Vec<f64>,
) -> Result<Option<Vec<RankStats>>> {
    let mine = RankStats {
        repeat_totals_s,
        forward: serde_json::to_value(stats.0).unwrap_or_default(),
        backward: stats.1.map(|b| serde_json::to_value(b).unwrap_or_default()),
    };
    let text = serde_json::to_vec(&mine).map_err(|e| Error::InvalidArgument(format!("stats: {e}")))?;
    let len = HostBuf::bytes((text.len() as u64).to_le_bytes().to_vec());
    let lens = all_gather(comm, be.upload(&len)?)?;
    let lens: Vec<usize> = lens
        .iter()
        .map(|l| {
            let b: [u8; 8] = be.download(l)?.to_control_bytes().try_into().unwrap_or_default();
            Ok(u64::from_le_bytes(b) as usize)
        })
        .collect::<Result<_>>()?;
    let texts = all_gather_v(comm, be.upload(&HostBuf::bytes(text))?, &lens)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    texts
        .iter()
        .map(|t| {
            let bytes = be.download(t)?.to_control_bytes();
            serde_json::from_slice(&bytes).map_err(|e| Error::InvalidArgument(format!("stats of a rank: {e}")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::Fault;

    #[test]
    fn faults_parse() {
        assert_eq!("1:die:3".parse::<Fault>().ok(), Some(Fault { rank: 1, die: true, after_sends: 3 }));
        assert!("1:explode:3".parse::<Fault>().is_err());
        assert!("x:die:3".parse::<Fault>().is_err());
    }
}
