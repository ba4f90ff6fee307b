//! Checks the training collectives of an MPI job across its ranks — `all_reduce` (the sum in
//! rank order, bit-identical on every rank), `broadcast` from every root, uneven
//! `all_gather_v` and `all_to_all_v`, in f32, bf16 and bytes — and that a rank contributing a
//! wrong length fails every rank with the same error instead of hanging. Prints one line per
//! check on rank 0; exits non-zero on the first failure.
//!
//! ```text
//! cargo build --release --features mpi --example collectives
//! mpirun -n 4 target/release/examples/collectives
//! ```

use std::process::ExitCode;

#[cfg(feature = "mpi")]
fn main() -> ExitCode {
    match checks::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("collectives: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn main() -> ExitCode {
    eprintln!("collectives: build with --features mpi and run under mpirun");
    ExitCode::FAILURE
}

#[cfg(feature = "mpi")]
mod checks {
    use std::time::Instant;

    use ringattn::comm::{add_host, all_gather_v, all_to_all_v, Communicator, MpiComm, MpiOptions};
    use ringattn::{DType, Error, HostBuf, HostData, Result};

    /// Values whose f32 sum depends on the order of addition.
    fn values(rank: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((rank * 7919 + i * 104_729) % 1000) as f32 * 1.000_001e-3 + rank as f32 * 1e4).collect()
    }

    fn fail(what: &str) -> Error {
        Error::InvalidArgument(format!("check failed: {what}"))
    }

    pub fn run() -> Result<()> {
        let comm = MpiComm::init(MpiOptions::default())?;
        let (p, r) = (comm.size(), comm.rank());
        let say = |line: String| {
            if r == 0 {
                println!("{line}");
            }
        };
        // all_reduce: rank-order sums, identical bits everywhere.
        for n in [1usize, 1000, 1 << 18] {
            let start = Instant::now();
            let got = comm.all_reduce(HostBuf::from(values(r, n)), &add_host)?;
            let secs = start.elapsed().as_secs_f64();
            let parts: Vec<Vec<f32>> = (0..p).map(|j| values(j, n)).collect();
            let want: Vec<f32> = (0..n).map(|i| (1..p).fold(parts[0][i], |acc, j| acc + parts[j][i])).collect();
            let got = got.f32s()?;
            if got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(fail(&format!("all_reduce of {n} values on rank {r}")));
            }
            say(format!("ok all_reduce f32 x{n}: bit-identical rank-order sum ({:.3} ms)", secs * 1e3));
        }
        // broadcast from every root, in every element type.
        for root in 0..p {
            for dtype in [DType::F32, DType::BF16] {
                let mine = HostBuf::from(values(r, 333)).converted(dtype);
                let got = comm.broadcast(mine, root)?;
                if got != HostBuf::from(values(root, 333)).converted(dtype) {
                    return Err(fail(&format!("broadcast {dtype} from {root} on rank {r}")));
                }
            }
            let got = comm.broadcast(HostBuf::bytes(vec![r as u8; 7]), root)?;
            if got.data() != &HostData::U8(vec![root as u8; 7]) {
                return Err(fail(&format!("broadcast bytes from {root} on rank {r}")));
            }
        }
        say(format!("ok broadcast from each of {p} roots: f32, bf16, bytes"));
        // Uneven all-gather and all-to-all in bf16.
        let lens: Vec<usize> = (0..p).map(|j| 3 * j + 1).collect();
        let gathered = all_gather_v(&comm, HostBuf::from(values(r, lens[r])).converted(DType::BF16), &lens)?;
        for (j, g) in gathered.iter().enumerate() {
            if *g != HostBuf::from(values(j, lens[j])).converted(DType::BF16) {
                return Err(fail(&format!("all_gather_v part {j} on rank {r}")));
            }
        }
        say("ok all_gather_v bf16, uneven lengths".into());
        let sends: Vec<HostBuf> = (0..p).map(|j| HostBuf::from(values(r * p + j, r + j + 1))).collect();
        let recv_lens: Vec<usize> = (0..p).map(|j| j + r + 1).collect();
        let got = all_to_all_v(&comm, sends, &recv_lens)?;
        for (j, g) in got.iter().enumerate() {
            if *g != values(j * p + r, j + r + 1) {
                return Err(fail(&format!("all_to_all_v part from {j} on rank {r}")));
            }
        }
        say("ok all_to_all_v f32, uneven lengths".into());
        // One-sided: each rank sends only to the ranks after it, so rank 0 receives nothing
        // (an all-gather of only the rows a causal rank sees); large messages, twice in a row.
        for n in [3usize, 1 << 20] {
            for _ in 0..2 {
                let sends: Vec<HostBuf> =
                    (0..p).map(|j| HostBuf::from(values(r * p + j, if j > r { n } else { 0 }))).collect();
                let recv_lens: Vec<usize> = (0..p).map(|j| if j < r { n } else { 0 }).collect();
                let got = all_to_all_v(&comm, sends, &recv_lens)?;
                for (j, g) in got.iter().enumerate() {
                    if *g != values(j * p + r, recv_lens[j]) {
                        return Err(fail(&format!("one-sided all_to_all_v part from {j} on rank {r}")));
                    }
                }
            }
            say(format!("ok all_to_all_v f32 x{n}, one-sided (rank 0 receives nothing, the last rank sends nothing)"));
        }
        // A rank contributing nothing to an all-gather.
        let lens: Vec<usize> = (0..p).map(|j| if j == 0 { 0 } else { 1 << 18 }).collect();
        let gathered = all_gather_v(&comm, HostBuf::from(values(r, lens[r])), &lens)?;
        if gathered.iter().enumerate().any(|(j, g)| *g != values(j, lens[j])) {
            return Err(fail(&format!("all_gather_v with an empty part on rank {r}")));
        }
        say("ok all_gather_v f32, rank 0 contributing nothing".into());
        // A rank expecting another length: every rank gets the same error, nobody hangs.
        let n = if r == p - 1 { 5 } else { 4 };
        match comm.broadcast(HostBuf::from(vec![0.0; n]), 0) {
            Err(Error::ShapeMismatch(m)) if p == 1 || m.contains(&format!("rank {}", p - 1)) => {}
            Ok(_) if p == 1 => {}
            other => return Err(fail(&format!("a length mismatch on rank {r} gave {other:?}"))),
        }
        say("ok a length mismatch is the same error on every rank".into());
        // The communicator is still usable after the refused call.
        let after = comm.all_reduce(HostBuf::from(vec![1.0]), &add_host)?;
        if after != vec![p as f32] {
            return Err(fail("all_reduce after a refused call"));
        }
        say(format!("ok {p} ranks"));
        Ok(())
    }
}
