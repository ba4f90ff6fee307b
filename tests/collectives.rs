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

/// Receives posted in another order than the peer's sends: matched by tag this works (as
/// under MPI); in per-peer order (NCCL's) the first receive meets the wrong message and both
/// modes' contract is checked: an `Error::MessageOrder` naming both tags, not a wrong result.
#[test]
fn per_peer_order_finds_receives_posted_out_of_the_senders_order() {
    use ringattn::comm::{MessageOrder, RecvOp, SendOp};
    use ringattn::Elem;
    let run = |order| {
        spmd(2, LocalOptions { order, deadline: Duration::from_secs(5), ..Default::default() }, |c| {
            if c.rank() == 0 {
                let sends = vec![
                    SendOp { to: 1, tag: 1, data: buf(vec![1.0]) },
                    SendOp { to: 1, tag: 2, data: buf(vec![2.0]) },
                ];
                for s in c.post(Vec::new(), sends)?.sends {
                    s.wait()?;
                }
                return Ok(vec![]);
            }
            // Rank 1 posts the receive of tag 2 first.
            let recv = |tag| RecvOp { from: 0, tag, len: 1, elem: Elem::F32 };
            let posted = c.post(vec![recv(2), recv(1)], Vec::new())?;
            posted.recvs.into_iter().map(|r| r.wait().map(|b| b.f32s().unwrap()[0])).collect::<Result<Vec<_>, _>>()
        })
    };
    let by_tag = run(MessageOrder::Tag);
    assert_eq!(by_tag[1].as_ref().unwrap(), &vec![2.0, 1.0]);
    let fifo = run(MessageOrder::PerPeerFifo);
    let e = fifo[1].as_ref().unwrap_err();
    assert!(matches!(e, Error::MessageOrder(_)), "{e}");
    let m = e.to_string();
    assert!(m.contains("message tag 2") && m.contains("message tag 1") && m.contains("rank 0"), "{m}");
}

/// The collectives in per-peer order give the same values as matched by tag.
#[test]
fn collectives_agree_in_both_message_orders() {
    use ringattn::comm::MessageOrder;
    for order in [MessageOrder::Tag, MessageOrder::PerPeerFifo] {
        let opts = LocalOptions { order, ..Default::default() };
        let got = spmd(4, opts, |c| {
            let sum = c.all_reduce(buf(values(c.rank(), 9)), &add_host)?;
            let b = c.broadcast(buf(values(c.rank(), 5)), 3)?;
            let g = ringattn::comm::all_gather(c, buf(vec![c.rank() as f32]))?;
            Ok((sum, b, g))
        });
        for g in got {
            let (sum, b, g) = g.unwrap();
            let want: Vec<f32> = (0..9).map(|i| (0..4).fold(0.0, |a, r| a + values(r, 9)[i])).collect();
            assert_eq!(sum, want, "{order:?}");
            assert_eq!(b, values(3, 5), "{order:?}");
            assert_eq!(g, (0..4).map(|r| buf(vec![r as f32])).collect::<Vec<_>>(), "{order:?}");
        }
    }
}

/// Tag blocks: the same on every rank, a fresh one per call, multiples of `TAG_BLOCK` below
/// the collective range — and collectives between them keep every rank's numbering in step.
#[test]
fn tag_blocks_are_fresh_and_agree_across_ranks() {
    use ringattn::comm::{COLLECTIVE_TAG, TAG_BLOCK};
    let got = spmd(3, LocalOptions::default(), |comm| {
        let a = comm.next_tag_block();
        let sum = comm.all_reduce(HostBuf::from(vec![1.0f32]), &add_host)?;
        let b = comm.next_tag_block();
        Ok((a, b, sum.f32s()?[0]))
    });
    let got: Vec<_> = got.into_iter().map(|r| r.unwrap()).collect();
    for &(a, b, sum) in &got {
        assert_eq!((a, b, sum), (got[0].0, got[0].1, 3.0));
        assert!(a != b && a % TAG_BLOCK == 0 && b % TAG_BLOCK == 0 && b + TAG_BLOCK <= COLLECTIVE_TAG);
    }
}

/// `set_deadline`: a rank's receive that nobody answers fails after the deadline set on it
/// (not the group's), a communicator split from it afterwards inherits it, and zero is
/// refused.
#[test]
fn a_deadline_set_on_a_rank_bounds_its_waits_and_its_splits() {
    use std::time::Instant;
    let comms = ringattn::comm::LocalComm::<ringattn::HostBuf>::group(2, LocalOptions::default());
    let short = Duration::from_millis(200);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    assert!(c.set_deadline(Duration::ZERO).is_err());
                    c.set_deadline(short).unwrap();
                    let sub = c.split(0, c.rank()).unwrap();
                    assert_eq!(sub.deadline(), short);
                    if c.rank() == 1 {
                        return None;
                    }
                    let t0 = Instant::now();
                    let r = c.irecv(1, 7, 1, ringattn::Elem::F32).unwrap().wait();
                    Some((r.map(|_| ()), t0.elapsed()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let (r, took) = results[0].as_ref().unwrap();
    assert!(matches!(r, Err(ringattn::Error::Timeout { .. })), "{r:?}");
    assert!(*took >= short && *took < Duration::from_secs(5), "{took:?}");
}
