//! MPI's own collectives behind [`MpiComm`]'s overrides of the [`Communicator`] collectives:
//! `MPI_Ialltoallv`, `MPI_Iallgatherv` and `MPI_Ibcast`, nonblocking and polled to the
//! deadline. Before the data, one small `MPI_Iallgatherv` gives every rank every rank's sizes
//! and expectations, so all ranks reach the same verdict: a mismatch is the same error on
//! every rank (never a truncated buffer or a hang), and a buffer too large for MPI's `int`
//! counts sends every rank down the portable path together.

use std::os::raw::{c_int, c_void};
use std::time::{Duration, Instant};

use ::mpi::ffi;

use super::mpi_comm::{check, locked, MpiComm};
use super::{Communicator, Payload};
use crate::{Elem, Error, HostBuf, HostData, Result};

/// A count MPI takes (`int`), or `None` when too large.
fn count(n: usize) -> Option<c_int> {
    c_int::try_from(n).ok()
}

/// Exclusive prefix sums (MPI displacements), or `None` when one is too large.
fn displacements(counts: &[usize]) -> Option<Vec<c_int>> {
    let mut off = 0usize;
    counts
        .iter()
        .map(|&c| {
            let d = count(off);
            off += c;
            d
        })
        .collect()
}

fn elem_code(e: Elem) -> u64 {
    match e {
        Elem::F32 => 0,
        Elem::BF16 => 1,
        Elem::F16 => 2,
        _ => 3,
    }
}

fn elem_of(code: u64) -> Result<Elem> {
    Ok(match code {
        0 => Elem::F32,
        1 => Elem::BF16,
        2 => Elem::F16,
        3 => Elem::U8,
        c => return Err(Error::Mpi(format!("a size record with element type code {c}"))),
    })
}

/// Little-endian u64 words.
fn words(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn unwords(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

/// Splits received bytes into buffers of `elem` with `lens[j]` elements each.
fn split(bytes: &[u8], elem: Elem, lens: &[usize]) -> Result<Vec<HostBuf>> {
    let mut off = 0;
    lens.iter()
        .map(|&n| {
            let b = n * elem.size_of();
            let part = HostData::from_bytes(elem, &bytes[off..off + b])?;
            off += b;
            Ok(HostBuf::new(part))
        })
        .collect()
}

impl MpiComm {
    /// Polls the nonblocking collective `req` until it completes or the deadline passes.
    /// `keep` holds the memory MPI uses and is returned on completion; if the deadline
    /// passes it is leaked (MPI may still write it) and the job must end.
    fn complete<T>(&self, op: &str, mut req: ffi::MPI_Request, keep: T) -> Result<T> {
        let deadline = self.deadline();
        let give_up = Instant::now() + deadline;
        let spin_until = Instant::now() + Duration::from_millis(1);
        let mut nap = Duration::from_micros(20);
        loop {
            let mut flag: c_int = 0;
            // SAFETY: `req` is a live request of this process whose buffers `keep` owns;
            // MPI_Status is plain data.
            let code = locked(|| unsafe {
                let mut status: ffi::MPI_Status = std::mem::zeroed();
                ffi::MPI_Test(&mut req, &mut flag, &mut status)
            });
            if code != 0 {
                std::mem::forget(keep);
                return Err(Error::Mpi(format!("{op}: MPI_Test failed with MPI error code {code}")));
            }
            if flag != 0 {
                return Ok(keep);
            }
            if Instant::now() >= give_up {
                std::mem::forget(keep);
                return Err(Error::Mpi(format!(
                    "{op} did not complete within {deadline:?}: a rank of the group is missing or stuck"
                )));
            }
            if Instant::now() < spin_until {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Runs one nonblocking collective of bytes into a fresh buffer of `total` bytes:
    /// `start(send, recv, request)` posts it; `send` and `ints` (the counts and displacements
    /// MPI reads) are owned here until the collective completes (leaked with the buffer if
    /// the deadline passes, since MPI may still use them).
    fn collective_bytes(
        &self,
        op: &str,
        name: &str,
        send: Vec<u8>,
        ints: Vec<Vec<c_int>>,
        total: usize,
        start: impl FnOnce(&[u8], &[Vec<c_int>], *mut c_void, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<Vec<u8>> {
        let mut recv = vec![0u8; total.max(1)];
        // An empty Vec's pointer is dangling, 0x1 — Open MPI's MPI_IN_PLACE: a rank sending
        // nothing would turn the collective in place (and hang its peers). One byte keeps the
        // pointer real; the counts say what is read.
        let send = if send.is_empty() { vec![0u8] } else { send };
        let mut req = self.null_request();
        let code = locked(|| start(&send, &ints, recv.as_mut_ptr().cast::<c_void>(), &mut req));
        check(code, name)?;
        let (mut recv, _, _) = self.complete(op, req, (recv, send, ints))?;
        recv.truncate(total);
        Ok(recv)
    }

    /// `MPI_Iallgatherv` of bytes: rank `j` contributes `counts[j]` bytes (this rank `send`).
    /// `None` when a count or the total exceeds MPI's `int`.
    fn allgatherv_bytes(&self, op: &str, send: Vec<u8>, counts: &[usize]) -> Result<Option<Vec<u8>>> {
        let total: usize = counts.iter().sum();
        let (Some(c), Some(d), Some(_), Some(mine)) = (
            counts.iter().map(|&n| count(n)).collect::<Option<Vec<_>>>(),
            displacements(counts),
            count(total),
            count(send.len()),
        ) else {
            return Ok(None);
        };
        let got = self.collective_bytes(op, "MPI_Iallgatherv", send, vec![c, d], total, |send, ints, recv, req| {
            // SAFETY: `send`, the counts and displacements and `recv` are owned by
            // `collective_bytes` until the request completes; the counts fit `recv`.
            unsafe {
                ffi::MPI_Iallgatherv(
                    send.as_ptr().cast::<c_void>(),
                    mine,
                    ffi::RSMPI_UINT8_T,
                    recv,
                    ints[0].as_ptr(),
                    ints[1].as_ptr(),
                    ffi::RSMPI_UINT8_T,
                    self.raw_comm(),
                    req,
                )
            }
        })?;
        Ok(Some(got))
    }

    /// `MPI_Ialltoallv` of bytes. `None` when a count or displacement exceeds MPI's `int`.
    fn alltoallv_bytes(
        &self,
        op: &str,
        send: Vec<u8>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Option<Vec<u8>>> {
        let total: usize = recv_counts.iter().sum();
        let ints = |v: &[usize]| v.iter().map(|&n| count(n)).collect::<Option<Vec<_>>>();
        let (Some(sc), Some(sd), Some(rc), Some(rd), Some(_), Some(_)) = (
            ints(send_counts),
            displacements(send_counts),
            ints(recv_counts),
            displacements(recv_counts),
            count(total),
            count(send.len()),
        ) else {
            return Ok(None);
        };
        let got =
            self.collective_bytes(op, "MPI_Ialltoallv", send, vec![sc, sd, rc, rd], total, |send, i, recv, req| {
                // SAFETY: as in `allgatherv_bytes`: every array outlives the request.
                unsafe {
                    ffi::MPI_Ialltoallv(
                        send.as_ptr().cast::<c_void>(),
                        i[0].as_ptr(),
                        i[1].as_ptr(),
                        ffi::RSMPI_UINT8_T,
                        recv,
                        i[2].as_ptr(),
                        i[3].as_ptr(),
                        ffi::RSMPI_UINT8_T,
                        self.raw_comm(),
                        req,
                    )
                }
            })?;
        Ok(Some(got))
    }

    /// Every rank's record of `words` u64 words (the same count everywhere).
    fn records(&self, op: &str, mine: &[u64]) -> Result<Vec<Vec<u64>>> {
        let n = mine.len() * 8;
        let got = self
            .allgatherv_bytes(op, words(mine), &vec![n; self.size()])?
            .ok_or_else(|| Error::Mpi(format!("{op}: size records too large for MPI")))?;
        Ok(got.chunks_exact(n.max(1)).map(unwords).collect())
    }

    /// Native all-to-all; `None` sends every rank to the portable path.
    pub(super) fn native_all_to_all_v(&self, sends: &[HostBuf], recv_lens: &[usize]) -> Result<Option<Vec<HostBuf>>> {
        let (p, r) = (self.size(), self.rank());
        // Record: what this rank sends to each rank (elements, type), then what it expects
        // from each.
        let mut mine: Vec<u64> = sends.iter().flat_map(|b| [b.elements() as u64, elem_code(b.elem())]).collect();
        mine.extend(recv_lens.iter().map(|&n| n as u64));
        let all = self.records("all_to_all_v (sizes)", &mine)?;
        let elem0 = all[0][1];
        for (i, rec) in all.iter().enumerate() {
            for (j, want) in all.iter().enumerate() {
                let (sent, elem, expected) = (rec[2 * j], rec[2 * j + 1], want[2 * p + i]);
                if sent != expected || elem != elem0 {
                    return Err(Error::ShapeMismatch(format!(
                        "all_to_all_v: rank {i} sends {sent} {} values to rank {j}, which expects {expected} {}",
                        elem_of(elem)?,
                        elem_of(elem0)?
                    )));
                }
            }
        }
        let elem = sends[r].elem();
        let size = elem.size_of();
        let send: Vec<u8> = sends.iter().flat_map(|b| b.data().as_bytes().iter().copied()).collect();
        let send_counts: Vec<usize> = sends.iter().map(|b| b.elements() * size).collect();
        let recv_counts: Vec<usize> = recv_lens.iter().map(|&n| n * size).collect();
        // Every rank decides alike: any rank's total beyond MPI's int takes everyone to the
        // portable path.
        let too_big = all.iter().any(|rec| {
            let sent: u64 = (0..p).map(|j| rec[2 * j] * elem.size_of() as u64).sum();
            let got: u64 = rec[2 * p..].iter().map(|&n| n * elem.size_of() as u64).sum();
            sent > c_int::MAX as u64 || got > c_int::MAX as u64
        });
        if too_big {
            return Ok(None);
        }
        let got = self
            .alltoallv_bytes("all_to_all_v", send, &send_counts, &recv_counts)?
            .ok_or_else(|| Error::Mpi("all_to_all_v: counts too large for MPI".into()))?;
        split(&got, elem, recv_lens).map(Some)
    }

    /// Native all-gather; `None` sends every rank to the portable path.
    pub(super) fn native_all_gather_v(&self, data: &HostBuf, lens: &[usize]) -> Result<Option<Vec<HostBuf>>> {
        let p = self.size();
        // Record: this rank's elements and type, then the lengths it expects of everyone.
        let mut mine = vec![data.elements() as u64, elem_code(data.elem())];
        mine.extend(lens.iter().map(|&n| n as u64));
        let all = self.records("all_gather_v (sizes)", &mine)?;
        for (i, rec) in all.iter().enumerate() {
            if rec[1] != all[0][1] {
                return Err(Error::ShapeMismatch(format!(
                    "all_gather_v: rank {i} contributes {} values, rank 0 {}",
                    elem_of(rec[1])?,
                    elem_of(all[0][1])?
                )));
            }
            for (j, want) in all.iter().enumerate() {
                if want.len() != 2 + p || want[2 + i] != rec[0] {
                    return Err(Error::ShapeMismatch(format!(
                        "all_gather_v: rank {i} contributes {} values; rank {j} expects {}",
                        rec[0],
                        want.get(2 + i).copied().unwrap_or(0)
                    )));
                }
            }
        }
        let elem = data.elem();
        let counts: Vec<usize> = lens.iter().map(|&n| n * elem.size_of()).collect();
        let Some(got) = self.allgatherv_bytes("all_gather_v", data.data().as_bytes().to_vec(), &counts)? else {
            return Ok(None);
        };
        split(&got, elem, lens).map(Some)
    }

    /// Native broadcast; `None` sends every rank to the portable path.
    pub(super) fn native_broadcast(&self, data: &HostBuf, root: usize) -> Result<Option<HostBuf>> {
        let all = self.records("broadcast (sizes)", &[data.elements() as u64, elem_code(data.elem())])?;
        if let Some((i, rec)) = all.iter().enumerate().find(|(_, rec)| **rec != all[root]) {
            return Err(Error::ShapeMismatch(format!(
                "broadcast: rank {i} expects {} {} values, the root (rank {root}) has {} {}",
                rec[0],
                elem_of(rec[1])?,
                all[root][0],
                elem_of(all[root][1])?
            )));
        }
        let mut bytes = data.data().as_bytes().to_vec();
        let Some(n) = count(bytes.len()) else { return Ok(None) };
        let Some(root_c) = count(root) else { return Ok(None) };
        bytes.push(0); // a valid pointer for an empty buffer
        let mut req = self.null_request();
        // SAFETY: `bytes` outlives the request (kept by `complete`); `n` bytes fit it.
        let code = locked(|| unsafe {
            ffi::MPI_Ibcast(
                bytes.as_mut_ptr().cast::<c_void>(),
                n,
                ffi::RSMPI_UINT8_T,
                root_c,
                self.raw_comm(),
                &mut req,
            )
        });
        check(code, "MPI_Ibcast")?;
        let mut bytes = self.complete("broadcast", req, bytes)?;
        bytes.truncate(n as usize);
        Ok(Some(HostBuf::new(HostData::from_bytes(data.elem(), &bytes)?)))
    }
}
