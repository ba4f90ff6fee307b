//! How a process started by a launcher learns its place: rank, world size, local rank and GPU
//! ([`BootstrapEnv`]), and how the ranks share NCCL's 128-byte unique id — over TCP from rank
//! 0 ([`exchange_unique_id`]) or through any host communicator ([`broadcast_unique_id`]).
//!
//! Launchers read, first match wins (a launcher started by another — torchrun inside a Slurm
//! allocation, mpirun inside one — sets its own variables, which take precedence):
//!
//! | launcher | rank | world | local rank | rank 0's host |
//! |---|---|---|---|---|
//! | torchrun and compatible | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `MASTER_ADDR` |
//! | Open MPI's mpirun | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `MASTER_ADDR` |
//! | MPICH / Intel MPI (PMI) | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` | `MASTER_ADDR` |
//! | Slurm's srun | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `MASTER_ADDR`, else the first host of `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST` |
//!
//! Without a local-rank variable the local rank is the rank (one node, or ranks placed in
//! blocks of the node's GPU count). The GPU is **the local rank modulo the number of visible
//! devices** ([`device_ordinal`]): with every GPU visible, local rank 3 takes GPU 3; when the
//! launcher narrows `CUDA_VISIBLE_DEVICES` to one GPU per process, every process takes its
//! ordinal 0, whatever its local rank.
//!
//! The TCP bootstrap listens on **its own port**, never `MASTER_PORT` itself (torchrun's store
//! already listens there): `RINGATTN_BOOTSTRAP_PORT` when set, else `MASTER_PORT + 100`
//! (wrapped into 1024..=65535), else under Slurm `29600 + SLURM_JOB_ID mod 1000`, else
//! 29600. The server's reply carries the world size, so a rank that reaches another job's
//! server by mistake fails with a clear error instead of joining the wrong group.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::nccl::{UniqueId, UNIQUE_ID_BYTES};
use crate::comm::Communicator;
use crate::{Error, Result};

/// First bytes of the id server's reply (then the world size, u32 little-endian, then the id).
const ID_MAGIC: &[u8; 8] = b"RAIDv002";
/// Offset of the default bootstrap port from `MASTER_PORT`.
pub(crate) const BOOTSTRAP_PORT_OFFSET: u16 = 100;
/// The bootstrap port when neither `RINGATTN_BOOTSTRAP_PORT` nor `MASTER_PORT` is set.
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 29600;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Launcher {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (torchrun, torch.distributed.launch, accelerate, ...).
    #[default]
    Torchrun,
    /// `OMPI_COMM_WORLD_*` (Open MPI's mpirun).
    OpenMpi,
    /// `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID` (MPICH's and Intel MPI's Hydra).
    Pmi,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (srun).
    Slurm,
}

impl Launcher {
    /// A short name (`torchrun`, `mpirun`, `pmi`, `srun`).
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "mpirun",
            Launcher::Pmi => "pmi",
            Launcher::Slurm => "srun",
        }
    }
}

/// One rank's place in a job started by a launcher (see the module docs for the variables).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BootstrapEnv {
    /// The launcher whose variables were read.
    pub launcher: Launcher,
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// This rank's index among the ranks of its node (the GPU is this modulo the visible
    /// device count: [`device_ordinal`]).
    pub local_rank: usize,
    /// Host of rank 0, which serves the unique id; `None` when the environment names none
    /// (an error only when the TCP bootstrap needs it).
    pub master_addr: Option<String>,
    /// Port the TCP bootstrap listens on (rank 0) and connects to (the others).
    pub bootstrap_port: u16,
}

/// Parses a number from variable `name`.
fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("launcher environment: ${name} = `{v}` is not a valid number")))
}

impl BootstrapEnv {
    /// Reads the process environment.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no launcher's rank variable is set, or naming a missing
    /// or malformed variable, or a rank outside the world.
    ///
    /// ```
    /// // Outside a launcher the variables are missing: an error, not a panic.
    /// if ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"].iter().all(|v| std::env::var_os(v).is_none()) {
    ///     assert!(ringattn::cuda::BootstrapEnv::from_env().is_err());
    /// }
    /// ```
    pub fn from_env() -> Result<BootstrapEnv> {
        BootstrapEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `var` (the environment, or a test's map).
    ///
    /// # Errors
    /// As [`BootstrapEnv::from_env`].
    ///
    /// ```
    /// use ringattn::cuda::{BootstrapEnv, Launcher};
    /// let vars = [("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node0"),
    ///             ("MASTER_PORT", "29500")];
    /// let env = BootstrapEnv::from_vars(|k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string()))?;
    /// assert_eq!((env.launcher, env.rank, env.world, env.local_rank), (Launcher::Torchrun, 1, 4, 1));
    /// assert_eq!(env.bootstrap_port, 29600); // MASTER_PORT + 100: torchrun's store keeps 29500
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<BootstrapEnv> {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        // (launcher, rank, world(s), local rank)
        let table: [(Launcher, &str, &[&str], &str); 4] = [
            (Launcher::Torchrun, "RANK", &["WORLD_SIZE"], "LOCAL_RANK"),
            (Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", &["OMPI_COMM_WORLD_SIZE"], "OMPI_COMM_WORLD_LOCAL_RANK"),
            (Launcher::Pmi, "PMI_RANK", &["PMI_SIZE"], "MPI_LOCALRANKID"),
            (Launcher::Slurm, "SLURM_PROCID", &["SLURM_NTASKS", "SLURM_NPROCS"], "SLURM_LOCALID"),
        ];
        let Some(&(launcher, rank_var, world_vars, local_var)) = table.iter().find(|t| var(t.1).is_some()) else {
            return Err(Error::InvalidArgument(
                "launcher environment: none of $RANK (torchrun), $OMPI_COMM_WORLD_RANK (mpirun), $PMI_RANK \
                 (MPICH/Intel MPI) or $SLURM_PROCID (srun) is set: start the ranks with a launcher"
                    .into(),
            ));
        };
        let rank: usize = num(rank_var, &var(rank_var).unwrap_or_default())?;
        let (world_var, world) = world_vars.iter().find_map(|w| var(w).map(|v| (*w, v))).ok_or_else(|| {
            Error::InvalidArgument(format!("launcher environment: ${rank_var} is set but ${} is not", world_vars[0]))
        })?;
        let world: usize = num(world_var, &world)?;
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "launcher environment: ${rank_var} = {rank} is outside ${world_var} = {world}"
            )));
        }
        let local_rank = match var(local_var) {
            Some(v) => num(local_var, &v)?,
            None => rank,
        };
        let master_addr = var("MASTER_ADDR").or_else(|| {
            (launcher == Launcher::Slurm)
                .then(|| ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"].iter().find_map(|k| var(k)))
                .flatten()
                .and_then(|list| first_host(&list))
        });
        let bootstrap_port = bootstrap_port(&var)?;
        Ok(BootstrapEnv { launcher, rank, world, local_rank, master_addr, bootstrap_port })
    }

    /// This rank's GPU among the `visible` devices the driver reports: [`device_ordinal`].
    ///
    /// # Errors
    /// [`Error::Cuda`] when no device is visible.
    pub fn device(&self, visible: usize) -> Result<usize> {
        device_ordinal(self.local_rank, visible)
    }

    /// `host:port` of rank 0's id server.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the environment names no host for rank 0.
    pub fn server_address(&self) -> Result<String> {
        match &self.master_addr {
            Some(h) => Ok(format!("{h}:{}", self.bootstrap_port)),
            None => Err(Error::InvalidArgument(format!(
                "launcher environment ({}): $MASTER_ADDR is not set, so rank {} cannot find rank 0; set it to \
                 rank 0's host{}",
                self.launcher.name(),
                self.rank,
                if self.launcher == Launcher::OpenMpi || self.launcher == Launcher::Pmi {
                    ", or use a build with --features mpi, which bootstraps through MPI"
                } else {
                    ""
                }
            ))),
        }
    }
}

/// The TCP bootstrap's port (see the module docs).
fn bootstrap_port(var: &impl Fn(&str) -> Option<String>) -> Result<u16> {
    if let Some(v) = var("RINGATTN_BOOTSTRAP_PORT") {
        let p: u16 = num("RINGATTN_BOOTSTRAP_PORT", &v)?;
        if p == 0 {
            return Err(Error::InvalidArgument("launcher environment: $RINGATTN_BOOTSTRAP_PORT = 0".into()));
        }
        return Ok(p);
    }
    if let Some(v) = var("MASTER_PORT") {
        let p: u16 = num("MASTER_PORT", &v)?;
        let shifted = u32::from(p) + u32::from(BOOTSTRAP_PORT_OFFSET);
        return Ok(if shifted <= 65535 { shifted as u16 } else { (1024 + (shifted - 65536)) as u16 });
    }
    if let Some(job) = var("SLURM_JOB_ID").and_then(|j| j.trim().parse::<u64>().ok()) {
        return Ok(DEFAULT_BOOTSTRAP_PORT + (job % 1000) as u16);
    }
    Ok(DEFAULT_BOOTSTRAP_PORT)
}

/// The first host of a Slurm host list: `gpu-[003-004,010],login1` → `gpu-003`,
/// `node7,node8` → `node7` (tested below).
pub(crate) fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let (prefix, rest) = match list.find(['[', ',']) {
        Some(i) if list.as_bytes()[i] == b'[' => (&list[..i], &list[i + 1..]),
        Some(i) => return Some(list[..i].to_string()).filter(|h| !h.is_empty()),
        None => return Some(list.to_string()).filter(|h| !h.is_empty()),
    };
    let first = rest.split([',', ']']).next()?;
    let first = first.split('-').next()?;
    Some(format!("{prefix}{first}")).filter(|h| !h.is_empty())
}

/// The GPU of a process with local rank `local_rank` when `visible` devices are visible to
/// it: `local_rank % visible`.
///
/// # Errors
/// [`Error::Cuda`] when `visible` is 0.
///
/// ```
/// use ringattn::cuda::device_ordinal;
/// assert_eq!(device_ordinal(3, 8)?, 3);  // every GPU visible
/// assert_eq!(device_ordinal(3, 1)?, 0);  // CUDA_VISIBLE_DEVICES narrowed to one GPU per process
/// assert_eq!(device_ordinal(9, 8)?, 1);  // more ranks than GPUs: they share
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn device_ordinal(local_rank: usize, visible: usize) -> Result<usize> {
    if visible == 0 {
        return Err(Error::Cuda("no CUDA GPU is visible to this process (check CUDA_VISIBLE_DEVICES)".into()));
    }
    Ok(local_rank % visible)
}

/// Serves `id` to `clients` connections on `listener` (rank 0's side of the TCP bootstrap):
/// each connection receives an 8-byte magic, the world size (u32 little-endian) and the id,
/// then is closed.
///
/// # Errors
/// [`Error::Timeout`] when fewer than `clients` ranks connected within `deadline`;
/// [`Error::InvalidArgument`] for socket errors.
pub(crate) fn serve_unique_id(
    listener: &TcpListener,
    id: &UniqueId,
    world: usize,
    clients: usize,
    deadline: Duration,
) -> Result<()> {
    let io = |e: std::io::Error| Error::InvalidArgument(format!("NCCL bootstrap: serving the unique id: {e}"));
    listener.set_nonblocking(true).map_err(io)?;
    let mut reply = Vec::with_capacity(12 + UNIQUE_ID_BYTES);
    reply.extend_from_slice(ID_MAGIC);
    reply.extend_from_slice(&(world as u32).to_le_bytes());
    reply.extend_from_slice(id);
    let start = Instant::now();
    let mut served = 0;
    while served < clients {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(io)?;
                s.set_write_timeout(Some(deadline.max(Duration::from_millis(1)))).map_err(io)?;
                // A client that went away is its own problem (it retries or times out).
                if s.write_all(&reply).and_then(|_| s.flush()).is_ok() {
                    served += 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() >= deadline {
                    return Err(Error::Timeout {
                        op: format!("NCCL bootstrap: serving the unique id ({served} of {clients} ranks connected)"),
                        peer: 0,
                        after: deadline,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// Fetches the unique id from rank 0's server at `addr` (`host:port`), retrying the
/// connection until `deadline` (rank 0 may not be listening yet); the server must be serving
/// a group of `world` ranks.
///
/// # Errors
/// [`Error::Timeout`] when no server answered within `deadline`; [`Error::InvalidArgument`]
/// when the address does not resolve, the reply is not an id, or it is another group's (a
/// different world size).
pub(crate) fn fetch_unique_id(addr: &str, world: usize, deadline: Duration) -> Result<UniqueId> {
    let start = Instant::now();
    let mut last = String::from("no attempt");
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(Error::Timeout {
                op: format!("NCCL bootstrap: fetching the unique id from {addr} (last error: {last})"),
                peer: 0,
                after: deadline,
            });
        }
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("NCCL bootstrap: cannot resolve {addr}: {e}")))?
            .collect();
        for a in &addrs {
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
                Ok(mut s) => {
                    let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
                    let mut reply = [0u8; 12 + UNIQUE_ID_BYTES];
                    match s.read_exact(&mut reply) {
                        Ok(()) if &reply[..8] == ID_MAGIC => {
                            let theirs = u32::from_le_bytes([reply[8], reply[9], reply[10], reply[11]]) as usize;
                            if theirs != world {
                                return Err(Error::InvalidArgument(format!(
                                    "NCCL bootstrap: {addr} serves a group of {theirs} ranks, this rank belongs to \
                                     one of {world} (another job on that port? set RINGATTN_BOOTSTRAP_PORT)"
                                )));
                            }
                            let mut id = [0u8; UNIQUE_ID_BYTES];
                            id.copy_from_slice(&reply[12..]);
                            return Ok(id);
                        }
                        Ok(()) => {
                            return Err(Error::InvalidArgument(format!(
                                "NCCL bootstrap: {addr} answered something other than a ringattn unique id (another \
                                 service on that port? set RINGATTN_BOOTSTRAP_PORT)"
                            )))
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(e) => last = e.to_string(),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The TCP bootstrap of `env`: rank 0 creates the id with `make_id` and serves it on the
/// bootstrap port (all interfaces) to the other `world − 1` ranks; the others fetch it from
/// [`BootstrapEnv::server_address`], retrying until `deadline`.
///
/// # Errors
/// Those of `make_id`, [`serve_unique_id`] (including a port that cannot be bound, named
/// with the variable that moves it) and [`fetch_unique_id`].
pub(crate) fn exchange_unique_id(
    env: &BootstrapEnv,
    make_id: impl FnOnce() -> Result<UniqueId>,
    deadline: Duration,
) -> Result<UniqueId> {
    if env.rank == 0 {
        let id = make_id()?;
        if env.world > 1 {
            let listener = TcpListener::bind(("0.0.0.0", env.bootstrap_port)).map_err(|e| {
                Error::InvalidArgument(format!(
                    "NCCL bootstrap: rank 0 cannot listen on port {}: {e} (set RINGATTN_BOOTSTRAP_PORT to a free port, \
                     the same on every rank)",
                    env.bootstrap_port
                ))
            })?;
            serve_unique_id(&listener, &id, env.world, env.world - 1, deadline)?;
        }
        Ok(id)
    } else {
        fetch_unique_id(&env.server_address()?, env.world, deadline)
    }
}

/// Broadcasts the unique id from rank 0 of a host communicator (MPI, in-process ranks):
/// rank 0 creates it with `make_id` and sends its bytes (one per f32 value) to every other
/// rank. Collective over `comm`.
///
/// # Errors
/// Those of `make_id` (rank 0) and the communication; [`Error::InvalidArgument`] when a
/// received value is not a byte.
///
/// ```
/// use ringattn::comm::{spmd, LocalOptions};
/// use ringattn::cuda::broadcast_unique_id;
/// let ids = spmd(3, LocalOptions::default(), |c| broadcast_unique_id(c, || Ok([7u8; 128])));
/// for id in ids {
///     assert_eq!(id?, [7u8; 128]);
/// }
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn broadcast_unique_id(
    comm: &dyn Communicator<Buf = crate::HostBuf>,
    make_id: impl FnOnce() -> Result<UniqueId>,
) -> Result<UniqueId> {
    let tag = comm.next_collective_tag();
    if comm.rank() == 0 {
        let id = crate::HostBuf::bytes(make_id()?.to_vec());
        let sends = (1..comm.size()).map(|to| crate::comm::SendOp { to, tag, data: id.clone() }).collect();
        for s in comm.post(Vec::new(), sends)?.sends {
            s.wait()?;
        }
        Ok(id.to_control_bytes().try_into().expect("a unique id"))
    } else {
        let recv = crate::comm::RecvOp { from: 0, tag, len: UNIQUE_ID_BYTES, elem: crate::Elem::U8 };
        let got = comm.post(vec![recv], Vec::new())?.recvs.remove(0).wait()?;
        got.to_control_bytes()
            .try_into()
            .map_err(|b: Vec<u8>| Error::InvalidArgument(format!("NCCL unique id: received {} bytes", b.len())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
    }

    fn env(rank: usize, port: u16) -> BootstrapEnv {
        BootstrapEnv {
            launcher: Launcher::Torchrun,
            rank,
            world: 3,
            local_rank: rank,
            master_addr: Some("127.0.0.1".into()),
            bootstrap_port: port,
        }
    }

    #[test]
    fn torchrun_environment() {
        let full = [
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            // torchrun inside a Slurm allocation: torchrun's variables win.
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ];
        let e = BootstrapEnv::from_vars(vars(&full)).unwrap();
        assert_eq!(
            e,
            BootstrapEnv {
                launcher: Launcher::Torchrun,
                rank: 2,
                world: 4,
                local_rank: 1,
                master_addr: Some("h".into()),
                bootstrap_port: 29600
            }
        );
        // Never torchrun's own store port; an explicit port wins; wrap at the top.
        assert_ne!(e.bootstrap_port, 29500);
        let own = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500"), ("RINGATTN_BOOTSTRAP_PORT", "41000")];
        assert_eq!(BootstrapEnv::from_vars(vars(&own)).unwrap().bootstrap_port, 41000);
        let top = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "65500")];
        assert_eq!(BootstrapEnv::from_vars(vars(&top)).unwrap().bootstrap_port, 1024 + 64);
        // Clear errors.
        let err = BootstrapEnv::from_vars(vars(&full[1..5])).unwrap_err().to_string();
        assert!(err.contains("$RANK") && err.contains("$SLURM_PROCID"), "{err}");
        let no_world = [("RANK", "0")];
        assert!(BootstrapEnv::from_vars(vars(&no_world)).unwrap_err().to_string().contains("$WORLD_SIZE is not"));
        let bad = [("RANK", "x"), ("WORLD_SIZE", "4")];
        assert!(BootstrapEnv::from_vars(vars(&bad)).unwrap_err().to_string().contains("`x`"));
        let out = [("RANK", "4"), ("WORLD_SIZE", "4")];
        assert!(BootstrapEnv::from_vars(vars(&out)).unwrap_err().to_string().contains("outside"));
        let port = [("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "70000")];
        assert!(BootstrapEnv::from_vars(vars(&port)).is_err());
        // No host for rank 0: an error only when the address is needed.
        let e = BootstrapEnv::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert!(e.server_address().unwrap_err().to_string().contains("MASTER_ADDR"));
    }

    #[test]
    fn srun_environment() {
        let srun = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_NODELIST", "gpu-[003-004]"),
            ("SLURM_JOB_NODELIST", "gpu-[001-008]"),
        ];
        let e = BootstrapEnv::from_vars(vars(&srun)).unwrap();
        assert_eq!((e.launcher, e.rank, e.world, e.local_rank), (Launcher::Slurm, 5, 16, 5));
        assert_eq!(e.master_addr.as_deref(), Some("gpu-003"));
        assert_eq!(e.bootstrap_port, DEFAULT_BOOTSTRAP_PORT + 456);
        assert_eq!(e.server_address().unwrap(), format!("gpu-003:{}", DEFAULT_BOOTSTRAP_PORT + 456));
        assert_eq!(e.device(8).unwrap(), 5);
        // SLURM_NPROCS is the older name of SLURM_NTASKS; MASTER_ADDR wins over the list.
        let old = [("SLURM_PROCID", "1"), ("SLURM_NPROCS", "2"), ("MASTER_ADDR", "head"), ("SLURM_NODELIST", "n1")];
        let e = BootstrapEnv::from_vars(vars(&old)).unwrap();
        assert_eq!((e.world, e.local_rank, e.master_addr.as_deref()), (2, 1, Some("head")));
        assert_eq!(first_host("gpu-[003-004,010],login1").as_deref(), Some("gpu-003"));
        assert_eq!(first_host("node7,node8").as_deref(), Some("node7"));
        assert_eq!(first_host("a[1,3-4]b").as_deref(), Some("a1"));
        assert_eq!(first_host("single").as_deref(), Some("single"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn mpirun_and_pmi_environments() {
        let ompi = [
            ("OMPI_COMM_WORLD_RANK", "9"),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            // mpirun inside a Slurm batch step: Open MPI's variables win.
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ];
        let e = BootstrapEnv::from_vars(vars(&ompi)).unwrap();
        assert_eq!((e.launcher, e.rank, e.world, e.local_rank), (Launcher::OpenMpi, 9, 16, 1));
        assert_eq!(e.bootstrap_port, DEFAULT_BOOTSTRAP_PORT);
        assert_eq!(e.device(8).unwrap(), 1);
        let no_addr = BootstrapEnv::from_vars(vars(&ompi[..4])).unwrap();
        assert!(no_addr.server_address().unwrap_err().to_string().contains("--features mpi"));
        let pmi = [("PMI_RANK", "3"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "3")];
        let e = BootstrapEnv::from_vars(vars(&pmi)).unwrap();
        assert_eq!((e.launcher, e.rank, e.world, e.local_rank), (Launcher::Pmi, 3, 4, 3));
        // Without a local-rank variable the rank stands in for it.
        let e = BootstrapEnv::from_vars(vars(&pmi[..2])).unwrap();
        assert_eq!(e.local_rank, 3);
    }

    #[test]
    fn gpu_choice_follows_the_visible_devices() {
        // 8 GPUs visible to every process: local rank = ordinal.
        assert_eq!((0..8).map(|l| device_ordinal(l, 8).unwrap()).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        // The launcher narrowed CUDA_VISIBLE_DEVICES to one GPU per process: ordinal 0 for
        // every local rank (LOCAL_RANK 5 used to ask for GPU 5 and fail).
        let narrowed = [("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "5"), ("CUDA_VISIBLE_DEVICES", "5")];
        assert_eq!(BootstrapEnv::from_vars(vars(&narrowed)).unwrap().device(1).unwrap(), 0);
        // Two GPUs per process.
        assert_eq!(device_ordinal(3, 2).unwrap(), 1);
        assert!(device_ordinal(0, 0).unwrap_err().to_string().contains("CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn unique_id_travels_over_tcp_to_every_rank() {
        // A free port: bind, read, release (rank 0 binds it again).
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut fake = [0u8; UNIQUE_ID_BYTES];
        fake.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7 + 3) as u8);
        let deadline = Duration::from_secs(20);
        let ids: Vec<Result<UniqueId>> = std::thread::scope(|s| {
            // Clients first: they retry until rank 0 listens.
            let hs: Vec<_> = [1, 2, 0]
                .into_iter()
                .map(|r| {
                    let e = env(r, port);
                    s.spawn(move || {
                        if r == 0 {
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        exchange_unique_id(&e, || Ok(fake), deadline)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for id in ids {
            assert_eq!(id.unwrap(), fake);
        }
    }

    #[test]
    fn bootstrap_failures_are_errors_within_the_deadline() {
        // Nobody serves: the client gives up at its deadline.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let t = Instant::now();
        let e = fetch_unique_id(&format!("127.0.0.1:{port}"), 2, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        // Nobody connects: the server gives up too.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = serve_unique_id(&l, &[0; UNIQUE_ID_BYTES], 3, 2, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }) && e.to_string().contains("0 of 2"), "{e}");
        // A server that is not ours.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(&[b'x'; 12 + UNIQUE_ID_BYTES]).unwrap();
        });
        let e = fetch_unique_id(&addr.to_string(), 2, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("other than"), "{e}");
        h.join().unwrap();
        // Another job's server (a different world size) is refused.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || serve_unique_id(&l, &[1; UNIQUE_ID_BYTES], 8, 1, Duration::from_secs(5)));
        let e = fetch_unique_id(&addr.to_string(), 4, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("group of 8 ranks"), "{e}");
        h.join().unwrap().unwrap();
        // The id maker's error is rank 0's error.
        let e = exchange_unique_id(&env(0, 1), || Err(Error::Cuda("no NCCL".into())), Duration::from_secs(1));
        assert!(e.unwrap_err().to_string().contains("no NCCL"));
        // A port already taken (torchrun's store on it) is named, with the variable to move it.
        let taken = TcpListener::bind("0.0.0.0:0").unwrap();
        let e =
            exchange_unique_id(&env(0, taken.local_addr().unwrap().port()), || Ok([0; 128]), Duration::from_secs(1));
        assert!(e.unwrap_err().to_string().contains("RINGATTN_BOOTSTRAP_PORT"));
    }

    #[test]
    fn unique_id_broadcasts_over_a_host_communicator() {
        use crate::comm::{spmd, LocalOptions};
        let mut fake = [0u8; UNIQUE_ID_BYTES];
        fake.iter_mut().enumerate().for_each(|(i, b)| *b = 255 - i as u8);
        let ids = spmd(4, LocalOptions::default(), |c| broadcast_unique_id(c, || Ok(fake)));
        for id in ids {
            assert_eq!(id.unwrap(), fake);
        }
        // Rank 0 failing to make the id fails every rank (the others through the abort).
        let opts = LocalOptions { deadline: Duration::from_secs(5), ..Default::default() };
        let r = spmd(3, opts, |c| broadcast_unique_id(c, || Err(Error::Cuda("no NCCL".into()))));
        assert!(r.iter().all(|x| x.is_err()));
    }
}
