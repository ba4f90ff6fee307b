//! The training collectives of the communicator seam: `all_reduce` (sum in rank order, so
//! every rank gets bit-identical values) and `broadcast`, on in-process ranks; errors for
//! mismatched lengths and bad roots fail every rank instead of hanging.

use std::time::Duration;

use ringattn::comm::{add_host, spmd, Communicator, LocalOptions};
use ringattn::{Error, HostBuf};

fn values(rank: usize, n: usize) -> Vec<f32> {
    // Values whose sum depends on the order of addition in f32.
    (0..n).map(|i| ((rank * 7919 + i * 104_729) % 1000) as f32 * 1.000_001e-3 + (rank as f32) * 1e4).collect()
}

fn buf(v: Vec<f32>) -> HostBuf {
    v.into()
}

#[test]
fn all_reduce_sums_in_rank_order_bit_identically_on_every_rank() {
    for world in 1..=5 {
        let n = 257;
        let want: Vec<f32> = (0..n)
            .map(|i| {
                let mut acc = values(0, n)[i];
                for r in 1..world {
                    acc += values(r, n)[i];
                }
                acc
            })
            .collect();
        let got = spmd(world, LocalOptions::default(), |c| c.all_reduce(buf(values(c.rank(), n)), &add_host));
        for (rank, g) in got.into_iter().enumerate() {
            let g = g.unwrap();
            assert!(
                g.f32s().unwrap().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "world {world} rank {rank}"
            );
        }
    }
}

#[test]
fn broadcast_delivers_the_roots_buffer_to_every_rank() {
    for world in 1..=4 {
        for root in 0..world {
            let got = spmd(world, LocalOptions::default(), |c| c.broadcast(buf(values(c.rank(), 33)), root));
            for g in got {
                assert_eq!(g.unwrap(), values(root, 33), "world {world} root {root}");
            }
        }
    }
}

#[test]
fn collective_misuse_fails_every_rank_within_the_deadline() {
    let opts = LocalOptions { deadline: Duration::from_secs(5), ..Default::default() };
    // One rank contributes another length.
    let got = spmd(3, opts, |c| c.all_reduce(buf(vec![1.0; if c.rank() == 1 { 5 } else { 4 }]), &add_host));
    assert!(got.iter().all(|r| r.is_err()), "{got:?}");
    assert!(got.iter().any(|r| matches!(r, Err(Error::ShapeMismatch(_)))), "{got:?}");
    // A root outside the group is refused on every rank, before any message.
    let got = spmd(3, opts, |c| c.broadcast(buf(vec![0.0; 2]), 3));
    assert!(got.iter().all(|r| matches!(r, Err(Error::InvalidArgument(m)) if m.contains("root 3"))), "{got:?}");
    // A receiver expecting another length.
    let got = spmd(3, opts, |c| c.broadcast(buf(vec![0.0; if c.rank() == 2 { 3 } else { 2 }]), 0));
    assert!(matches!(&got[2], Err(Error::ShapeMismatch(_)) | Err(Error::PeerFailed { .. })), "{got:?}");
}
