//! The model against hand-computed volumes and times, the planner's validity, calibration.

use proptest::prelude::*;

use super::*;

/// 128K tokens on 8 GPUs of one node, d = 128, bf16, forward only, no latency.
fn anchors_case(h: usize, h_kv: usize) -> (ClusterSpec, JobSpec) {
    let cluster = ClusterSpec { intra_latency_us: 0.0, inter_latency_us: 0.0, ..Default::default() };
    let job = JobSpec {
        seq: 131072,
        heads: h,
        kv_heads: h_kv,
        head_dim: 128,
        causal: false,
        passes: Passes::Forward,
        ..Default::default()
    };
    (cluster, job)
}

fn transfer<'a>(p: &'a PassCost, what: &str) -> &'a Transfer {
    p.transfers.iter().find(|t| t.what == what).unwrap_or_else(|| panic!("no transfer {what} in {:?}", p.transfers))
}

#[test]
fn ulysses_volume_is_four_all_to_alls_of_the_anchors() {
    // (P−1)/P · s·d·e·(2h + 2h_kv), s = N/P: 0.47 GB for MHA, 0.29 GB for GQA-4.
    for (h, h_kv, want) in [(32usize, 32usize, 469_762_048u64), (32, 8, 293_601_280)] {
        let (c, j) = anchors_case(h, h_kv);
        let ch = evaluate(&c, &j, &Placement::ulysses(8)).unwrap();
        let f = ch.forward.as_ref().unwrap();
        let s = 131072 / 8;
        let per_head = (7 * s * 128 * 2 / 8) as u64; // (P−1)/P · s · d · e for one head
        assert_eq!(transfer(f, "q seq→heads").bytes_sent, per_head * h as u64);
        assert_eq!(transfer(f, "k seq→heads").bytes_sent, per_head * h_kv as u64);
        assert_eq!(transfer(f, "v seq→heads").bytes_sent, per_head * h_kv as u64);
        assert_eq!(transfer(f, "o heads→seq").bytes_sent, per_head * h as u64);
        let four: u64 = ["q seq→heads", "k seq→heads", "v seq→heads", "o heads→seq"]
            .iter()
            .map(|w| transfer(f, w).bytes_sent)
            .sum();
        assert_eq!(four, want);
        // The crate also returns the LSE: 4 bytes per token and head.
        let lse = (7 * s * (h / 8) * 4) as u64;
        assert_eq!(transfer(f, "lse heads→seq").bytes_sent, lse);
        assert_eq!(ch.bytes_sent, want + lse);
        // All exposed; each takes bytes / bandwidth (no latency here).
        assert!(f.transfers.iter().all(|t| t.exposed_s == t.seconds));
        let q = transfer(f, "q seq→heads");
        assert!((q.seconds - q.bytes_sent as f64 / 370e9).abs() < 1e-15);
        assert!((f.time_s - f.compute_s - f.comm_s).abs() < 1e-12);
    }
}

#[test]
fn ring_volume_is_two_n_hkv_d_e_per_rank() {
    for (h, h_kv, want) in [(32usize, 32usize, 1_879_048_192u64), (32, 8, 469_762_048)] {
        let (c, mut j) = anchors_case(h, h_kv);
        let ch = evaluate(&c, &j, &Placement::ring(8)).unwrap();
        // 2·N·h_kv·d·e·(P−1)/P: 1.88 GB MHA, 0.47 GB GQA-4 (the anchors' table).
        assert_eq!(ch.bytes_sent, (2 * 131072 * h_kv * 128 * 2 * 7 / 8) as u64);
        assert_eq!(ch.bytes_sent, want);
        let ag = evaluate(&c, &j, &Placement::all_gather(8)).unwrap();
        assert_eq!(ag.bytes_sent, want, "all-gather moves what the ring moves");
        // Backward: K/V again and the f32 dK/dV accumulators each hop, then their return.
        j.passes = Passes::Backward;
        let b = evaluate(&c, &j, &Placement::ring(8)).unwrap();
        let kv_hop = (2 * 16384 * h_kv * 128 * 2) as u64;
        let acc_hop = (2 * 16384 * h_kv * 128 * 4) as u64;
        assert_eq!(b.bytes_sent, 7 * (kv_hop + acc_hop) + acc_hop);
        let ag = evaluate(&c, &j, &Placement::all_gather(8)).unwrap();
        assert_eq!(ag.bytes_sent, 7 * kv_hop + 7 * acc_hop, "gather K/V again, reduce-scatter dK/dV");
    }
}

#[test]
fn usp_combines_both_on_its_subgroups() {
    // u = 4, r = 2 over 8 GPUs: a2a over u, (u−1)/u · s·d·e·(2h+2h_kv); ring over r,
    // 2·N·h_kv·d·e·(r−1)/(r·u).
    let (c, j) = anchors_case(32, 8);
    let ch = evaluate(&c, &j, &Placement::usp(4, 2, Nesting::UlyssesInNode)).unwrap();
    let f = ch.forward.as_ref().unwrap();
    let s = 16384;
    let a2a: u64 =
        ["q seq→heads", "k seq→heads", "v seq→heads", "o heads→seq"].iter().map(|w| transfer(f, w).bytes_sent).sum();
    assert_eq!(a2a, (3 * s * 128 * 2 * (2 * 32 + 2 * 8) / 4) as u64);
    assert_eq!(transfer(f, "k/v ring").bytes_sent, (2 * 131072 * 8 * 128 * 2 / (2 * 4)) as u64);
    let hop = f.hop.unwrap();
    assert_eq!(hop.hops, 2);
    // The hop's block: S = N/r tokens, h/u heads; its transfer: 2·S·(h_kv/u)·d·e.
    let flops = 4.0 * 8.0 * 65536f64.powi(2) * 128.0;
    assert!((hop.compute_s - flops / 350e12).abs() < 1e-12);
    assert!((hop.transfer_s - (2.0 * 65536.0 * 2.0 * 128.0 * 2.0) / 370e9).abs() < 1e-15);
}

#[test]
fn replicated_kv_heads_cost_what_the_crate_sends() {
    // 8 kv heads over a Ulysses group of 16: each rank holds one (replicated) kv head.
    let cluster = ClusterSpec { gpus: 16, ..Default::default() };
    let job = JobSpec { seq: 1 << 16, heads: 32, kv_heads: 8, passes: Passes::Forward, ..Default::default() };
    let ch = evaluate(&cluster, &job, &Placement::ulysses(16)).unwrap();
    assert!(ch.kv_replicated);
    assert_eq!((ch.q_heads_per_rank, ch.kv_heads_per_rank), (2, 1));
    let f = ch.forward.as_ref().unwrap();
    let n = (1 << 16) / 16;
    assert_eq!(transfer(f, "k seq→heads").bytes_sent, (15 * n * 128 * 2) as u64);
    // 32 heads do not split over 64 ranks: the crate refuses, so does the model.
    let c64 = ClusterSpec { gpus: 64, ..Default::default() };
    assert!(matches!(evaluate(&c64, &job, &Placement::ulysses(64)), Err(Error::Parallel(_))));
}

#[test]
fn overlap_condition_on_a_hand_computed_case() {
    // F = 600 TF/s, B = 450 GB/s, MHA h = 32, d = 128, e = 2: threshold 1333 tokens.
    let c = ClusterSpec { fwd_tflops: 600.0, intra_gbps: 450.0, intra_latency_us: 0.0, ..Default::default() };
    let threshold = overlap_threshold(600.0, 450.0, 2, 32, 32, false);
    assert!((threshold - 4000.0 / 3.0).abs() < 1e-9);
    for (s_blk, hidden) in [(1024usize, false), (2048, true)] {
        let j = JobSpec {
            seq: 8 * s_blk,
            heads: 32,
            kv_heads: 32,
            causal: false,
            passes: Passes::Forward,
            ..Default::default()
        };
        let f = evaluate(&c, &j, &Placement::ring(8)).unwrap().forward.unwrap();
        let hop = f.hop.unwrap();
        let compute = 4.0 * (s_blk * s_blk * 32 * 128) as f64 / 600e12;
        let xfer = (2 * s_blk * 32 * 128 * 2) as f64 / 450e9;
        assert!((hop.compute_s - compute).abs() < 1e-15 && (hop.transfer_s - xfer).abs() < 1e-15);
        assert_eq!(hop.hidden, hidden);
        // r hops of compute, plus what the transfers of the r − 1 others do not hide.
        let want = 8.0 * compute + 7.0 * (xfer - compute).max(0.0);
        assert!((f.time_s - want).abs() < 1e-12, "{} vs {want}", f.time_s);
        assert_eq!(f.exposed_comm_s == 0.0, hidden);
    }
    // Causal halves the compute per hop (zigzag): 2048 tokens are no longer enough.
    let j =
        JobSpec { seq: 8 * 2048, heads: 32, kv_heads: 32, causal: true, passes: Passes::Forward, ..Default::default() };
    assert!(!evaluate(&c, &j, &Placement::ring(8)).unwrap().forward.unwrap().hop.unwrap().hidden);
}

#[test]
fn nesting_decides_which_links_carry_what() {
    // 128 GPUs, 8 per node, USP 8×16: Ulysses inside nodes (NVLink a2a, IB ring) or the
    // reverse (IB a2a, a ring of 16 over two nodes, also IB).
    let c = ClusterSpec { gpus: 128, intra_latency_us: 0.0, inter_latency_us: 0.0, ..Default::default() };
    let j = JobSpec { seq: 1 << 20, passes: Passes::Forward, ..Default::default() };
    let a = evaluate(&c, &j, &Placement::usp(8, 16, Nesting::UlyssesInNode)).unwrap().forward.unwrap();
    let q = transfer(&a, "q seq→heads");
    assert!((q.seconds - q.bytes_sent as f64 / 370e9).abs() < 1e-15);
    let hop = a.hop.unwrap();
    let kv_hop = 2.0 * (1 << 20) as f64 / 16.0 * 1.0 * 128.0 * 2.0;
    assert!((hop.transfer_s - kv_hop / 50e9).abs() < 1e-15);
    let b = evaluate(&c, &j, &Placement::usp(8, 16, Nesting::RingInNode)).unwrap().forward.unwrap();
    let q = transfer(&b, "q seq→heads");
    assert!((q.seconds - q.bytes_sent as f64 / 50e9).abs() < 1e-15, "all 7 peers in other nodes");
    // USP 2×64 with rings inside nodes would still cross: a ring of 64 spans 8 nodes.
    let r = evaluate(&c, &j, &Placement::usp(2, 64, Nesting::RingInNode)).unwrap().forward.unwrap();
    assert!((r.hop.unwrap().transfer_s - 2.0 * 16384.0 * 4.0 * 128.0 * 2.0 / 50e9).abs() < 1e-15);
    // Mixed all-to-all: Ulysses of 16 over 2 nodes, 7 peers inside, 8 outside: the IB share dominates.
    let c16 = ClusterSpec { gpus: 16, ..c.clone() };
    let u = evaluate(&c16, &j, &Placement::ulysses(16)).unwrap().forward.unwrap();
    let q = transfer(&u, "q seq→heads");
    assert!((q.seconds - q.bytes_sent as f64 * 8.0 / 15.0 / 50e9).abs() < 1e-15);
}

#[test]
fn per_peer_links_take_the_largest_message() {
    let c = ClusterSpec { links: LinkSharing::PerPeer, intra_latency_us: 0.0, ..Default::default() };
    let (_, j) = anchors_case(32, 32);
    let f = evaluate(&c, &j, &Placement::ulysses(8)).unwrap().forward.unwrap();
    let q = transfer(&f, "q seq→heads");
    assert!((q.seconds - q.bytes_sent as f64 / 7.0 / 370e9).abs() < 1e-15);
}

#[test]
fn memory_counts_the_ring_buffers_and_the_gathered_kv() {
    let (c, j) = anchors_case(32, 8);
    let ring = evaluate(&c, &j, &Placement::ring(8)).unwrap();
    let ag = evaluate(&c, &j, &Placement::all_gather(8)).unwrap();
    let (n, e, d) = (16384.0, 2.0, 128.0);
    // Forward: own q, k, v; the K/V double buffer; f32 o accumulator + block partial and
    // their LSEs; the output o and LSE.
    let want = n * 32.0 * d * e
        + 2.0 * n * 8.0 * d * e
        + 2.0 * (2.0 * n * 8.0 * d * e)
        + 2.0 * (n * 32.0 * d * 4.0 + n * 32.0 * 4.0)
        + n * 32.0 * d * e
        + n * 32.0 * 4.0;
    assert_eq!(ring.memory_bytes, want as u64);
    // All-gather holds the whole K/V: 8× the rank's share.
    assert!(ag.memory_bytes > ring.memory_bytes);
    let whole = 2.0 * 131072.0 * 8.0 * d * e;
    assert!(ag.memory_bytes as f64 >= whole);
    // More layers keep more saved tensors.
    let j3 = JobSpec { layers: 3, ..j.clone() };
    let saved = n * (2.0 * 32.0 + 2.0 * 8.0) * d * e + n * 32.0 * 4.0;
    assert_eq!(evaluate(&c, &j3, &Placement::ring(8)).unwrap().memory_bytes, (want + 2.0 * saved) as u64);
}

#[test]
fn passes_add_up() {
    let c = ClusterSpec { gpus: 16, ..Default::default() };
    let both = JobSpec::default();
    let p = Placement::usp(4, 4, Nesting::UlyssesInNode);
    let b = evaluate(&c, &both, &p).unwrap();
    let f = evaluate(&c, &JobSpec { passes: Passes::Forward, ..both.clone() }, &p).unwrap();
    let k = evaluate(&c, &JobSpec { passes: Passes::Backward, ..both.clone() }, &p).unwrap();
    assert!((b.time_s - f.time_s - k.time_s).abs() < 1e-12);
    assert_eq!(b.bytes_sent, f.bytes_sent + k.bytes_sent);
    // Backward compute: 2.5× the FLOPs at the backward rate.
    let fc = f.forward.as_ref().unwrap().compute_s;
    assert!((k.compute_s - fc * 2.5 * 350.0 / 300.0).abs() < 1e-12);
    // Compute alone is the whole layer's FLOPs over P GPUs (zigzag balances causal).
    let flops = both.forward_flops() / 16.0;
    assert!((fc - flops / 350e12).abs() / fc < 1e-12);
}

#[test]
fn placements_and_the_planners_contract() {
    assert_eq!(placements(1, 8), vec![Placement::single()]);
    let c = ClusterSpec { gpus: 64, ..Default::default() };
    let p = plan(&c, &JobSpec::default()).unwrap();
    assert_eq!(p.choices.len() + p.rejected.len(), placements(64, 8).len());
    let best = p.best().unwrap();
    let text = p.recommendation();
    assert!(text.contains(&best.placement.label()), "{text}");
    assert!(text.contains(&best.placement.command_hint()), "{text}");
    // A budget nothing fits in: everything rejected with the memory reason.
    let tiny = ClusterSpec { memory_gib: 1e-3, ..c };
    let p = plan(&tiny, &JobSpec::default()).unwrap();
    assert!(p.choices.is_empty());
    assert!(p.rejected.iter().all(|r| (r.reason.contains("GiB") && r.estimate.is_some())
        || (r.reason.contains("Ulysses degree") && r.placement.ulysses == 64)));
    assert!(p.recommendation().starts_with("No placement"));
    // Bad specs are errors, not rejections.
    assert!(matches!(
        plan(&ClusterSpec { gpus: 0, ..Default::default() }, &JobSpec::default()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        plan(&ClusterSpec::default(), &JobSpec { heads: 6, kv_heads: 4, ..Default::default() }),
        Err(Error::HeadRatio { .. })
    ));
    assert!(matches!(
        evaluate(&ClusterSpec::default(), &JobSpec::default(), &Placement::ring(4)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn ulysses_wins_inside_a_node_and_rings_hide_across_nodes() {
    // Long sequence inside one node: Ulysses' volume is smaller, and 128K tokens per
    // rank hide the ring too; both beat all-gather's exposed gather.
    let p = plan(&ClusterSpec::default(), &JobSpec::default()).unwrap();
    let ag = p.best_of(crate::parallel::Strategy::AllGather).unwrap().time_s;
    assert!(p.best().unwrap().time_s < ag);
    // Many nodes, short sequence per rank: the best keeps its all-to-alls inside nodes.
    let c = ClusterSpec { gpus: 512, ..Default::default() };
    let p = plan(&c, &JobSpec { seq: 1 << 20, ..Default::default() }).unwrap();
    let best = p.best().unwrap();
    assert!(best.placement.ulysses <= 8 || best.placement.nesting == Nesting::RingInNode, "{:?}", best.placement);
}

#[test]
fn calibration_reads_the_bench_schema() {
    // The fields `ringattn bench --json` writes (src/bin/ringattn/bench.rs).
    #[derive(serde::Serialize)]
    struct PassResult {
        pass: &'static str,
        median_ms: f64,
        min_ms: f64,
        tflops: f64,
        samples_ms: Vec<f64>,
    }
    #[derive(serde::Serialize)]
    struct BenchReport {
        backend: String,
        device: String,
        dtype: String,
        b: usize,
        s: usize,
        h_q: usize,
        h_kv: usize,
        d: usize,
        causal: bool,
        results: Vec<PassResult>,
    }
    let report = |s: usize, fwd: f64, bwd: f64| BenchReport {
        backend: "cuda".into(),
        device: "NVIDIA H200".into(),
        dtype: "bf16".into(),
        b: 1,
        s,
        h_q: 16,
        h_kv: 16,
        d: 128,
        causal: true,
        results: vec![
            PassResult { pass: "forward", median_ms: 1.0, min_ms: 0.9, tflops: fwd, samples_ms: vec![1.0] },
            PassResult { pass: "backward", median_ms: 2.0, min_ms: 1.9, tflops: bwd, samples_ms: vec![2.0] },
        ],
    };
    let one = serde_json::to_string(&report(8192, 321.5, 250.25)).unwrap();
    let cal = Calibration::from_json(&one).unwrap();
    assert_eq!((cal.fwd_tflops, cal.bwd_tflops), (Some(321.5), Some(250.25)));
    // Several reports: the largest problem wins.
    let many =
        serde_json::to_string(&vec![report(4096, 1.0, 1.0), report(16384, 2.0, 3.0), report(8192, 4.0, 5.0)]).unwrap();
    let cal = Calibration::from_json(&many).unwrap();
    assert_eq!((cal.fwd_tflops, cal.bwd_tflops), (Some(2.0), Some(3.0)));
    // Wrapped, with extra fields, without `tflops` (computed from median_ms and the shape),
    // multi-rank runs skipped.
    let text = r#"{"version": 2, "runs": [
        {"world": 4, "b": 1, "s": 65536, "h_q": 8, "d": 64, "results": [{"pass": "forward", "tflops": 999.0}]},
        {"b": 2, "s": 1024, "h_q": 4, "d": 64, "causal": false, "extra": [1, 2],
         "results": [{"pass": "fwd", "median_ms": 2.0}, {"pass": "other", "tflops": 5.0}]}]}"#;
    let cal = Calibration::from_json(text).unwrap();
    let want = 4.0 * 2.0 * 4.0 * 1024.0 * 1024.0 * 64.0 / 2e-3 / 1e12;
    assert!((cal.fwd_tflops.unwrap() - want).abs() < 1e-12);
    assert_eq!(cal.bwd_tflops, None);
    let mut c = ClusterSpec::default();
    cal.apply(&mut c);
    assert_eq!((c.fwd_tflops, c.bwd_tflops), (want, DEFAULT_BWD_TFLOPS));
    // A sweep (`bench --out`): single-rank records; the backward rate from the
    // forward+backward time less the forward time.
    let sweep = r#"{"backend": "cpu", "b": 1, "h_q": 4, "h_kv": 4, "d": 64, "causal": false, "records": [
        {"strategy": "single", "world": 1, "seq": 2048, "passes": "forward", "seconds": 0.5, "tflops_per_rank": 0.25},
        {"strategy": "single", "world": 1, "seq": 2048, "passes": "forward+backward", "seconds": 2.0, "tflops_per_rank": 0.2},
        {"strategy": "ring", "world": 2, "seq": 4096, "passes": "forward", "seconds": 0.1, "tflops_per_rank": 9.0}]}"#;
    let cal = Calibration::from_json(sweep).unwrap();
    let fwd_flops = 4.0 * 4.0 * 2048.0 * 2048.0 * 64.0;
    assert_eq!(cal.fwd_tflops, Some(0.25));
    assert!((cal.bwd_tflops.unwrap() - 2.5 * fwd_flops / 1.5 / 1e12).abs() < 1e-12);
    // Nothing usable, not JSON: errors naming the problem.
    assert!(matches!(Calibration::from_json(r#"{"results": []}"#), Err(Error::InvalidArgument(_))));
    assert!(matches!(Calibration::from_json("not json"), Err(Error::InvalidArgument(_))));
}

#[test]
fn ping_pong_round_trip_and_fit() {
    let truth = |b: f64| 7e-6 + b / 40e9;
    let pp = PingPong {
        link: LinkKind::Inter,
        samples: [8.0, 4096.0, 1e6, 6.4e7].iter().map(|&b| PingPongSample { bytes: b, seconds: truth(b) }).collect(),
    };
    let text = serde_json::to_string(&pp).unwrap();
    // serde_json's default float parsing may differ in the last bit.
    let back = PingPong::from_json(&text).unwrap();
    assert_eq!((back.link, back.samples.len()), (pp.link, pp.samples.len()));
    for (a, b) in back.samples.iter().zip(&pp.samples) {
        assert!(a.bytes == b.bytes && (a.seconds - b.seconds).abs() <= 1e-15 * b.seconds);
    }
    let cal = Calibration::from_json(&text).unwrap();
    let fit = cal.inter.unwrap();
    assert!((fit.latency_s - 7e-6).abs() < 1e-12 && (fit.bandwidth_gbps - 40.0).abs() < 1e-6 && fit.r2 > 0.999_999);
    let mut c = ClusterSpec::default();
    cal.apply(&mut c);
    assert!((c.inter_gbps - 40.0).abs() < 1e-6 && (c.inter_latency_us - 7.0).abs() < 1e-6);
    assert_eq!(c.intra_gbps, DEFAULT_INTRA_GBPS);
    // Pairs and milliseconds; intra by default.
    let cal = Calibration::from_json(r#"{"samples": [[1000, 2e-6], [1001000, 0.0010020]]}"#).unwrap();
    let fit = cal.intra.unwrap();
    assert!((fit.bandwidth_gbps - 1.0).abs() < 1e-9 && (fit.latency_s - 1e-6).abs() < 1e-12);
    let ms = PingPong::from_json(
        r#"{"link": "intra", "samples": [{"bytes": 0, "ms": 0.001}, {"bytes": 1e9, "ms": 100.001}]}"#,
    )
    .unwrap()
    .fit()
    .unwrap();
    assert!((ms.bandwidth_gbps - 10.0).abs() < 1e-9);
    // Noise below zero latency: clamped, slope through the origin.
    let neg = PingPong {
        link: LinkKind::Intra,
        samples: vec![PingPongSample { bytes: 1e6, seconds: 0.9e-4 }, PingPongSample { bytes: 2e6, seconds: 2.1e-4 }],
    };
    let fit = neg.fit().unwrap();
    assert_eq!(fit.latency_s, 0.0);
    assert!(fit.bandwidth_gbps > 9.0 && fit.bandwidth_gbps < 11.0);
    // Unfittable: one size, shrinking times, bad values.
    let one = PingPong { link: LinkKind::Intra, samples: vec![PingPongSample { bytes: 1.0, seconds: 1.0 }; 3] };
    assert!(one.fit().is_err());
    let shrinking = PingPong {
        link: LinkKind::Intra,
        samples: vec![PingPongSample { bytes: 1.0, seconds: 2.0 }, PingPongSample { bytes: 2.0, seconds: 1.0 }],
    };
    assert!(shrinking.fit().is_err());
    assert!(PingPong::from_json(r#"{"samples": [{"bytes": 1}]}"#).is_err());
    assert!(PingPong::from_json(r#"{"link": "wan", "samples": []}"#).is_err());
}

#[test]
fn simulation_table_and_csv() {
    let sim = simulate(&ClusterSpec::default(), &JobSpec::default(), &[1, 8, 64], &[1 << 15, 1 << 20]).unwrap();
    assert_eq!(sim.rows.len(), 2 + 2 * 4 * 2);
    for g in [1, 8, 64] {
        for s in [1 << 15, 1 << 20] {
            assert_eq!(sim.cell(g, s).filter(|r| r.best).count(), 1, "one best per cell");
        }
    }
    let csv = sim.to_csv();
    assert_eq!(csv.lines().count(), 1 + sim.rows.len());
    assert!(csv.lines().all(|l| l.split(',').count() >= 12));
    assert_eq!(sim.best_vs_seq().len(), 3);
    let json = serde_json::to_value(&sim).unwrap();
    assert_eq!(json["rows"][2]["strategy"], "ring");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the specs, every proposed choice can run: its heads split over its Ulysses
    /// degree, it fits the memory budget, it uses the cluster's GPUs; choices come sorted and
    /// every placement is either chosen or rejected with a reason.
    #[test]
    fn planner_never_proposes_an_invalid_split(
        gpus in prop::sample::select(vec![1usize, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128]),
        per_node in prop::sample::select(vec![1usize, 2, 4, 8]),
        h_kv in 1usize..=16,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        seq_log in 4u32..=22,
        memory_gib in 0.001f64..200.0,
        causal in any::<bool>(),
        passes in prop::sample::select(vec![Passes::Forward, Passes::Backward, Passes::Both]),
        d in prop::sample::select(vec![64usize, 128]),
    ) {
        let cluster = ClusterSpec { gpus, gpus_per_node: per_node, memory_gib, ..Default::default() };
        let job = JobSpec { seq: 1 << seq_log, heads: h_kv * group, kv_heads: h_kv, head_dim: d, causal, passes, ..Default::default() };
        let p = plan(&cluster, &job).unwrap();
        prop_assert_eq!(p.choices.len() + p.rejected.len(), placements(gpus, per_node).len());
        for c in &p.choices {
            prop_assert_eq!(c.placement.gpus(), gpus);
            prop_assert_eq!(job.heads % c.placement.ulysses, 0);
            prop_assert!(c.memory_bytes as f64 <= memory_gib * GIB);
            prop_assert!(c.time_s.is_finite() && c.time_s > 0.0);
            prop_assert!(c.exposed_comm_s <= c.comm_s + 1e-12);
            prop_assert!((c.time_s - c.compute_s - c.exposed_comm_s).abs() <= 1e-9 * c.time_s);
        }
        prop_assert!(p.choices.windows(2).all(|w| w[0].time_s <= w[1].time_s));
        for r in &p.rejected {
            prop_assert!(!r.reason.is_empty());
            let heads_ok = job.heads.is_multiple_of(r.placement.ulysses);
            let over = r.estimate.as_ref().is_some_and(|e| e.memory_bytes as f64 > memory_gib * GIB);
            prop_assert!(!heads_ok || over || (1usize << seq_log) < gpus, "{:?}: {}", r.placement, r.reason);
        }
    }
}

/// Multi-head latent attention's head dims in the model: a ring moves K and V of `d_qk +
/// d_v` values per token and head (so (192, 128) moves what (160, 160) does, and the forward
/// costs the same FLOPs), while Ulysses moves q and k by `d_qk` and v, o by `d_v`, and the
/// backward costs `2·(3·d_qk + 2·d_v)` per pair.
#[test]
fn unequal_head_dims_move_and_cost_by_their_own_widths() {
    let c = ClusterSpec { gpus: 8, intra_latency_us: 0.0, inter_latency_us: 0.0, ..Default::default() };
    let job =
        |d, d_v| JobSpec { seq: 1 << 16, heads: 16, kv_heads: 16, head_dim: d, head_dim_v: d_v, ..Default::default() };
    let (mla, even) = (job(192, Some(128)), job(160, None));
    assert_eq!(mla.forward_flops(), even.forward_flops());
    mla.validate().unwrap();
    let ring = Placement::ring(8);
    let (a, b) = (evaluate(&c, &mla, &ring).unwrap(), evaluate(&c, &even, &ring).unwrap());
    let (fa, fb) = (a.forward.as_ref().unwrap(), b.forward.as_ref().unwrap());
    assert_eq!(fa.bytes_sent, fb.bytes_sent, "the ring moves K and V together");
    assert!((fa.compute_s - fb.compute_s).abs() <= 1e-12 * fb.compute_s);
    let (ba, bb) = (a.backward.as_ref().unwrap(), b.backward.as_ref().unwrap());
    // Backward FLOPs: 2·(3·192 + 2·128) = 1664 per pair against 2·5·160 = 1600.
    assert!((ba.compute_s / bb.compute_s - 1664.0 / 1600.0).abs() < 1e-9, "{} {}", ba.compute_s, bb.compute_s);
    // Ulysses: q and k by 192, v and o by 128 in the forward's all-to-alls (and the same
    // LSE): between the equal jobs of 128 and 192.
    let u = Placement::ulysses(8);
    let sent = |j: &JobSpec| evaluate(&c, j, &u).unwrap().forward.unwrap().bytes_sent;
    let (lo, mid, hi) = (sent(&job(128, None)), sent(&mla), sent(&job(192, None)));
    assert!(lo < mid && mid < hi, "{lo} {mid} {hi}");
    assert!(a.memory_bytes != b.memory_bytes);
}

mod documents {
    use super::super::{evaluate, evaluate_batch, plan_batch, ClusterSpec, JobSpec, Passes, Placement};
    use crate::parallel::Strategy;
    use crate::Layout;

    fn job(seq: usize) -> JobSpec {
        JobSpec { seq, heads: 8, kv_heads: 8, head_dim: 64, ..Default::default() }
    }

    #[test]
    fn one_document_costs_what_the_dense_model_says() {
        // One causal document over zigzag shards: every rank does N²/(2P) pairs, as the
        // dense model spreads them; the batch model counts N(N+1)/2 exactly.
        let (s, p) = (8192, 4);
        let cluster = ClusterSpec { gpus: p, ..Default::default() };
        for passes in [Passes::Forward, Passes::Both] {
            let j = JobSpec { passes, ..job(s) };
            let dense = evaluate(&cluster, &j, &Placement::ring(p)).unwrap();
            let batch = evaluate_batch(&cluster, &j, &[s], Layout::Zigzag, &Placement::ring(p)).unwrap();
            assert!((batch.compute_s / dense.compute_s - 1.0).abs() < 1e-3, "{batch:?} vs {dense:?}");
            assert!((batch.imbalance - 1.0).abs() < 1e-3);
            // Compute-bound hops: communication hides; the pass ends with the compute.
            assert!(batch.time_s >= batch.compute_s);
            assert!(batch.time_s < dense.time_s * 1.05, "{} vs {}", batch.time_s, dense.time_s);
        }
    }

    #[test]
    fn ulysses_is_balanced_whatever_the_documents() {
        let docs = [9000, 200, 300, 400, 100, 2000, 1000, 1000, 2000, 368];
        let s: usize = docs.iter().sum();
        let cluster = ClusterSpec { gpus: 4, ..Default::default() };
        let u = evaluate_batch(&cluster, &job(s), &docs, Layout::Zigzag, &Placement::ulysses(4)).unwrap();
        assert!((u.imbalance - 1.0).abs() < 1e-12);
        let z = evaluate_batch(&cluster, &job(s), &docs, Layout::Zigzag, &Placement::ring(4)).unwrap();
        assert!(z.imbalance > 1.2, "{}", z.imbalance);
        // The whole batch's attention, split four ways by heads.
        assert!((u.compute_s * 4.0 / (z.compute_s * 4.0 / z.imbalance) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn communication_bound_hops_show_in_the_time() {
        // Slow links: the balanced ring's extra bytes cost more than its balance saves.
        let docs = [4096usize; 4];
        let s = 16384;
        let slow = ClusterSpec { gpus: 4, intra_gbps: 0.5, ..Default::default() };
        let c = evaluate_batch(&slow, &job(s), &docs, Layout::Contiguous, &Placement::ring(4)).unwrap();
        // Contiguous shards of four whole documents: no rank sees another's keys.
        assert_eq!(c.bytes_sent, 0);
        assert!((c.time_s / c.compute_s - 1.0).abs() < 1e-9);
        let z = evaluate_batch(&slow, &job(s), &docs, Layout::Zigzag, &Placement::ring(4)).unwrap();
        assert!(z.bytes_sent > 0 && z.time_s > z.compute_s * 2.0, "{z:?}");
        let p = plan_batch(&slow, &job(s), &docs).unwrap();
        let best = p.best().unwrap();
        // The ring over whole documents (the balanced layout keeps them whole too).
        assert_eq!((best.placement.strategy, best.bytes_sent, best.time_s), (Strategy::Ring, 0, c.time_s), "{best:?}");
    }

    #[test]
    fn lengths_must_fill_the_job() {
        let cluster = ClusterSpec { gpus: 2, ..Default::default() };
        assert!(evaluate_batch(&cluster, &job(100), &[50, 40], Layout::Zigzag, &Placement::ring(2)).is_err());
        assert!(plan_batch(&cluster, &job(100), &[50, 40]).is_err());
    }
}
