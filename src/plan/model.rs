//! The cost of one placement: compute, communication (volume, time, overlap) and memory.

use serde::Serialize;

use super::{head_split, ClusterSpec, JobSpec, LinkSharing, Nesting, Placement};
use crate::parallel::Strategy;
use crate::{Error, Result};

/// The model's estimate for one placement of one attention layer. Times in seconds, sizes
/// in bytes, per rank (the busiest rank where ranks differ).
///
/// `time_s = compute_s + exposed_comm_s`, summed over the passes run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    /// The placement.
    pub placement: Placement,
    /// Predicted step time: compute plus exposed communication, seconds.
    pub time_s: f64,
    /// Attention kernel time, seconds.
    pub compute_s: f64,
    /// Time of every transfer, hidden or not, seconds.
    pub comm_s: f64,
    /// Communication not hidden behind compute (latencies included), seconds.
    pub exposed_comm_s: f64,
    /// Bytes a rank sends, all passes.
    pub bytes_sent: u64,
    /// Peak memory per rank, bytes: `(layers − 1)·saved + max(working sets of the passes)`.
    ///
    /// Saved per layer: the rank's q, k, v, o (`e`) and LSE (f32). The forward's working set
    /// adds the head-sharded q, k, v (Ulysses), the ring's K/V double buffer (current and
    /// incoming block), the f32 output accumulator and block partial with their LSEs, and
    /// the output; all-gather holds the whole K/V instead of the double buffer. The
    /// backward's adds dO, the head-sharded q, k, v, o, dO, LSE, the rowsum `D`, the f32 dQ
    /// accumulator and block gradients, the K/V double buffer and the travelling dK/dV
    /// accumulators (`e_a`, current and incoming), and the gradients; all-gather holds the
    /// whole K/V and whole dK/dV. Kernel workspace and transient copies are left out.
    pub memory_bytes: u64,
    /// Tokens per rank, `⌈N/P⌉`.
    pub tokens_per_rank: usize,
    /// Query heads a rank attends (`h/u`).
    pub q_heads_per_rank: usize,
    /// Kv heads the busiest rank holds (replicas included).
    pub kv_heads_per_rank: usize,
    /// Whether kv heads are replicated across the Ulysses group ([`super::head_split`]).
    pub kv_replicated: bool,
    /// The forward, when run.
    pub forward: Option<PassCost>,
    /// The backward, when run.
    pub backward: Option<PassCost>,
}

/// One pass of a [`Choice`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PassCost {
    /// Kernel time, seconds.
    pub compute_s: f64,
    /// Time of all transfers, seconds.
    pub comm_s: f64,
    /// Transfer time not hidden behind compute, seconds.
    pub exposed_comm_s: f64,
    /// `compute_s + exposed_comm_s`.
    pub time_s: f64,
    /// Bytes the rank sends.
    pub bytes_sent: u64,
    /// The ring's hop, when there is a ring of two or more.
    pub hop: Option<Hop>,
    /// The transfers, in order.
    pub transfers: Vec<Transfer>,
}

/// One ring hop: the overlap condition. The ring takes `compute + (hops − 1)·max(compute,
/// transfer)`; communication is hidden when `compute ≥ transfer`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hop {
    /// Hops (ring degree `r`); `r − 1` of them transfer.
    pub hops: usize,
    /// Attention of one hop's block, seconds.
    pub compute_s: f64,
    /// Latency plus bytes / bandwidth of one hop's transfer, seconds.
    pub transfer_s: f64,
    /// Whether the transfer is hidden (`compute_s >= transfer_s`).
    pub hidden: bool,
}

/// One transfer (or a ring's transfers of one kind, all hops together).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Transfer {
    /// What moves: `q seq→heads`, `o heads→seq`, `k/v ring`, `k all-gather`, ...
    pub what: String,
    /// Bytes the busiest rank sends.
    pub bytes_sent: u64,
    /// Time, seconds.
    pub seconds: f64,
    /// The part not hidden behind compute, seconds.
    pub exposed_s: f64,
}

/// The ring overlap condition of performance-anchors.md §3: a ring hop of `s` tokens per
/// block hides its K/V transfer when `s ≥ (F/B)·(e/2)·(h_kv/h)`, doubled when causal (half
/// the FLOPs per hop with zigzag). `F` is the kernel rate (TFLOP/s), `B` the link bandwidth
/// (GB/s), `e` bytes per element; latency is left out. Returns the threshold in tokens.
///
/// ```
/// use ringattn::plan::overlap_threshold;
///
/// // The anchors' table: F = 600 TF/s over NVLink at 450 GB/s, MHA: s ≥ 1.33K tokens.
/// assert!((overlap_threshold(600.0, 450.0, 2, 32, 32, false) - 1333.3).abs() < 0.1);
/// // GQA-8 needs 8× fewer tokens; 50 GB/s InfiniBand 9× more.
/// assert!((overlap_threshold(600.0, 450.0, 2, 32, 4, false) - 166.7).abs() < 0.1);
/// assert!((overlap_threshold(600.0, 50.0, 2, 32, 32, false) - 12000.0).abs() < 1e-6);
/// ```
pub fn overlap_threshold(tflops: f64, gbps: f64, dtype_bytes: usize, h: usize, h_kv: usize, causal: bool) -> f64 {
    let c = if causal { 2.0 } else { 1.0 };
    (tflops * 1e12) / (gbps * 1e9) * (dtype_bytes as f64 / 2.0) * (h_kv as f64 / h.max(1) as f64) * c
}

/// Where the members of the busiest group of one mesh dimension sit.
#[derive(Debug, Clone, Copy, Default)]
struct Links {
    /// Peers of the worst member inside its node.
    intra: usize,
    /// Peers of the worst member in other nodes.
    inter: usize,
    /// Whether some group spans more than one node (a ring over it has an inter-node hop).
    crosses: bool,
}

/// Links of the groups `{base + k·stride : k < size}` for every base.
fn group_links(per_node: usize, size: usize, stride: usize, bases: impl Iterator<Item = usize>) -> Links {
    let mut out = Links::default();
    let mut nodes = Vec::with_capacity(size);
    for base in bases {
        nodes.clear();
        nodes.extend((0..size).map(|k| (base + k * stride) / per_node));
        let mut sorted = nodes.clone();
        sorted.sort_unstable();
        for &node in &nodes {
            let same = sorted.iter().filter(|&&m| m == node).count();
            let inter = size - same;
            if inter > out.inter || (inter == out.inter && same - 1 > out.intra) {
                out = Links { intra: same - 1, inter, crosses: out.crosses };
            }
        }
        out.crosses |= sorted.first() != sorted.last();
    }
    out
}

/// The Ulysses groups' and the rings' links of a placement.
fn mesh_links(c: &ClusterSpec, p: &Placement) -> (Links, Links) {
    let (u, r, g) = (p.ulysses, p.ring, c.gpus_per_node);
    match p.nesting {
        Nesting::UlyssesInNode => (group_links(g, u, 1, (0..r).map(|k| k * u)), group_links(g, r, u, 0..u)),
        Nesting::RingInNode => (group_links(g, u, r, 0..r), group_links(g, r, 1, (0..u).map(|k| k * r))),
    }
}

/// Whether some ring of the placement spans nodes (its hops then take the inter-node link).
pub(super) fn mesh_crosses(c: &ClusterSpec, p: &Placement) -> bool {
    mesh_links(c, p).1.crosses
}

/// One point-to-point transfer of `bytes`, inside the node or across.
fn p2p_s(c: &ClusterSpec, bytes: f64, crosses: bool) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    let (gbps, lat) = if crosses { (c.inter_gbps, c.inter_latency_us) } else { (c.intra_gbps, c.intra_latency_us) };
    lat * 1e-6 + bytes / (gbps * 1e9)
}

/// One all-to-all in which the busiest rank sends (or receives) `bytes` spread evenly over
/// its peers.
fn a2a_s(c: &ClusterSpec, bytes: f64, l: Links) -> f64 {
    let peers = l.intra + l.inter;
    if peers == 0 || bytes <= 0.0 {
        return 0.0;
    }
    let lat = if l.inter > 0 { c.inter_latency_us } else { c.intra_latency_us } * 1e-6;
    let (bi, bo) = (c.intra_gbps * 1e9, c.inter_gbps * 1e9);
    let share = |k: usize| bytes * k as f64 / peers as f64;
    match c.links {
        LinkSharing::PerGpu => lat + (share(l.intra) / bi).max(share(l.inter) / bo),
        LinkSharing::PerPeer => lat + share(1) / if l.inter > 0 { bo } else { bi },
    }
}

/// Bytes of one Ulysses all-to-all of a tensor with `heads[j]` heads on rank `j` of the
/// group, `n` tokens per rank and `unit` bytes per token and head: sequence → heads
/// (`to_heads`) or back. Returns (the most any rank sends, the most any rank sends or
/// receives).
fn a2a_bytes(heads: &[usize], n: f64, unit: f64, to_heads: bool) -> (f64, f64) {
    let u = heads.len();
    let total: usize = heads.iter().sum();
    let (mut sent_max, mut busiest) = (0.0f64, 0.0f64);
    for &h in heads {
        let others = n * unit * (total - h) as f64;
        let mine = n * unit * ((u - 1) * h) as f64;
        let (sent, recv) = if to_heads { (others, mine) } else { (mine, others) };
        sent_max = sent_max.max(sent);
        busiest = busiest.max(sent.max(recv));
    }
    (sent_max, busiest)
}

/// Builds one pass.
#[derive(Default)]
struct Pass {
    compute_s: f64,
    hop: Option<Hop>,
    transfers: Vec<Transfer>,
}

impl Pass {
    fn exposed(&mut self, what: &str, bytes: f64, seconds: f64) {
        if bytes > 0.0 {
            self.transfers.push(Transfer {
                what: what.into(),
                bytes_sent: bytes.round() as u64,
                seconds,
                exposed_s: seconds,
            });
        }
    }

    /// Ulysses all-to-alls of the tensors `(name, heads per rank, bytes per token and head,
    /// to heads)`.
    fn a2a(&mut self, c: &ClusterSpec, l: Links, n: f64, list: &[(&str, &[usize], f64, bool)]) {
        for &(name, heads, unit, to_heads) in list {
            let (sent, busiest) = a2a_bytes(heads, n, unit, to_heads);
            let dir = if to_heads { "seq→heads" } else { "heads→seq" };
            self.exposed(&format!("{name} {dir}"), sent, a2a_s(c, busiest, l));
        }
    }

    /// A ring of `r` hops over blocks of `hop_compute_s` each, moving `hop_bytes` per hop.
    fn ring(&mut self, c: &ClusterSpec, what: &str, r: usize, hop_compute_s: f64, hop_bytes: f64, crosses: bool) {
        self.compute_s += r as f64 * hop_compute_s;
        if r < 2 {
            return;
        }
        let x = p2p_s(c, hop_bytes, crosses);
        let hops = (r - 1) as f64;
        self.hop = Some(Hop { hops: r, compute_s: hop_compute_s, transfer_s: x, hidden: hop_compute_s >= x });
        self.transfers.push(Transfer {
            what: what.into(),
            bytes_sent: (hops * hop_bytes).round() as u64,
            seconds: hops * x,
            exposed_s: hops * (x - hop_compute_s).max(0.0),
        });
    }

    fn finish(self) -> PassCost {
        // Folds from +0.0 (an empty f64 `sum` is -0.0).
        let comm_s = self.transfers.iter().fold(0.0, |a, t| a + t.seconds);
        let exposed_comm_s = self.transfers.iter().fold(0.0, |a, t| a + t.exposed_s);
        PassCost {
            compute_s: self.compute_s,
            comm_s,
            exposed_comm_s,
            time_s: self.compute_s + exposed_comm_s,
            bytes_sent: self.transfers.iter().map(|t| t.bytes_sent).sum(),
            hop: self.hop,
            transfers: self.transfers,
        }
    }
}

/// Estimates one placement of `job` on `cluster` (see the module documentation for the
/// formulas). Does not check the memory budget: [`super::plan`] does.
///
/// ```
/// use ringattn::plan::{evaluate, ClusterSpec, JobSpec, Passes, Placement};
///
/// // A ring of 8 inside one node, 128K non-causal tokens, MHA, forward only.
/// let cluster = ClusterSpec::default();
/// let job = JobSpec { seq: 131072, heads: 32, kv_heads: 32, causal: false, passes: Passes::Forward, ..Default::default() };
/// let c = evaluate(&cluster, &job, &Placement::ring(8))?;
/// // 2·N·h_kv·d·e·(P−1)/P bytes per rank: the anchors' 1.88 GB.
/// assert_eq!(c.bytes_sent, 2 * 131072 * 32 * 128 * 2 * 7 / 8);
/// let hop = c.forward.as_ref().unwrap().hop.unwrap();
/// assert!(hop.hidden); // 16K tokens per block ≫ the ~950-token threshold (F/B = 350 TF/s ÷ 370 GB/s)
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] for an unusable spec or a placement of another GPU count,
/// [`Error::ZeroHeads`] / [`Error::HeadRatio`] for bad heads, [`Error::Parallel`] when the
/// crate cannot run the placement: query heads not divisible by the Ulysses degree, single
/// on several GPUs, fewer tokens than ranks.
pub fn evaluate(cluster: &ClusterSpec, job: &JobSpec, p: &Placement) -> Result<Choice> {
    cluster.validate()?;
    job.validate()?;
    p.check(cluster.gpus)?;
    let world = cluster.gpus;
    if job.seq < world {
        return Err(Error::Parallel(format!("{} tokens over {world} ranks would leave ranks without tokens", job.seq)));
    }
    let (u, r) = (p.ulysses, p.ring);
    let split = head_split(job.heads, job.kv_heads, u)?;
    let (hq, kv) = (split.q_per_rank as f64, split.max_kv_per_rank() as f64);
    let n_tokens = job.seq.div_ceil(world);
    let n = n_tokens as f64;
    // Head dims of q/k (`d`) and of v/o (`dv`: multi-head latent attention's differs).
    let (b, d, dv) = (job.batch as f64, job.head_dim as f64, job.value_head_dim() as f64);
    let (e, ea, h, h_kv) = (job.dtype_bytes as f64, job.accum_bytes as f64, job.heads as f64, job.kv_heads as f64);
    let causal = if job.causal { 0.5 } else { 1.0 };
    let (f_fwd, f_bwd) = (cluster.fwd_tflops * 1e12, cluster.bwd_tflops * 1e12);
    let (ul, rl) = mesh_links(cluster, p);
    let q_heads = vec![split.q_per_rank; u];
    let kv_heads = &split.kv_per_rank;

    let (mut fwd, mut bwd) = (Pass::default(), Pass::default());
    // Memory: (forward working set, backward working set), bytes.
    // q, o, k, v (input dtype) and the LSE (f32).
    let saved = b * n * (h + h_kv) * (d + dv) * e + b * n * h * 4.0;
    let (own_q, own_kv, own_lse) = (b * n * h * d * e, b * n * h_kv * (d + dv) * e, b * n * h * 4.0);
    let own_o = b * n * h * dv * e;
    // The backward's FLOPs per forward FLOP (2.5 with equal head dims).
    let bwd_ratio = (3.0 * d + 2.0 * dv) / (d + dv);
    let mem_fwd;
    let mem_bwd;
    if p.strategy == Strategy::AllGather {
        let big_n = n * world as f64;
        let flops = 2.0 * (d + dv) * b * h * n * big_n * causal;
        // Every other rank's K and V rows (values).
        let (part_k, part_v) = ((world - 1) as f64 * b * n * h_kv * d, (world - 1) as f64 * b * n * h_kv * dv);
        let gather = |pass: &mut Pass| {
            pass.exposed("k all-gather", part_k * e, a2a_s(cluster, part_k * e, rl));
            pass.exposed("v all-gather", part_v * e, a2a_s(cluster, part_v * e, rl));
        };
        gather(&mut fwd);
        fwd.compute_s = flops / f_fwd;
        gather(&mut bwd);
        bwd.compute_s = bwd_ratio * flops / f_bwd;
        bwd.exposed("dk reduce-scatter", part_k * ea, a2a_s(cluster, part_k * ea, rl));
        bwd.exposed("dv reduce-scatter", part_v * ea, a2a_s(cluster, part_v * ea, rl));
        let whole_kv = b * big_n * h_kv * (d + dv);
        mem_fwd = own_q + own_kv + whole_kv * e + 2.0 * (b * n * h * dv * 4.0 + own_lse) + own_o + own_lse;
        mem_bwd = saved + own_q + whole_kv * (e + ea) + 2.0 * own_lse + b * n * h * d * 4.0 + own_q + own_kv;
    } else {
        // Ulysses in (u > 1), a ring of r over blocks of S = n·u tokens and h/u heads, Ulysses out.
        let s_blk = n * u as f64;
        let hop_flops = 2.0 * (d + dv) * b * hq * s_blk * s_blk * causal;
        let kv_hop = b * s_blk * kv * (d + dv) * e;
        let acc_hop = b * s_blk * kv * (d + dv) * ea;
        if u > 1 {
            // Bytes per token and head: q, k (d) and v, o, dO (dv).
            let (tok, tok_v, lse) = (b * d * e, b * dv * e, b * 4.0);
            fwd.a2a(
                cluster,
                ul,
                n,
                &[("q", &q_heads, tok, true), ("k", kv_heads, tok, true), ("v", kv_heads, tok_v, true)],
            );
            bwd.a2a(
                cluster,
                ul,
                n,
                &[
                    ("q", &q_heads, tok, true),
                    ("k", kv_heads, tok, true),
                    ("v", kv_heads, tok_v, true),
                    ("o", &q_heads, tok_v, true),
                    ("dO", &q_heads, tok_v, true),
                    ("lse", &q_heads, lse, true),
                ],
            );
        }
        fwd.ring(cluster, "k/v ring", r, hop_flops / f_fwd, kv_hop, rl.crosses);
        bwd.ring(cluster, "k/v + dk/dv ring", r, bwd_ratio * hop_flops / f_bwd, kv_hop + acc_hop, rl.crosses);
        if r > 1 {
            bwd.exposed("dk/dv return", acc_hop, p2p_s(cluster, acc_hop, rl.crosses));
        }
        if u > 1 {
            let (tok_v, grad, grad_v, lse) = (b * dv * e, b * d * ea, b * dv * ea, b * 4.0);
            fwd.a2a(cluster, ul, n, &[("o", &q_heads, tok_v, false), ("lse", &q_heads, lse, false)]);
            bwd.a2a(
                cluster,
                ul,
                n,
                &[("dq", &q_heads, grad, false), ("dk", kv_heads, grad, false), ("dv", kv_heads, grad_v, false)],
            );
        }
        // Head-sharded copies (Ulysses) of `heads` heads of width `w`.
        let sharded = |heads: f64, w: f64| if u > 1 { b * s_blk * heads * w * e } else { 0.0 };
        let (kv_bufs, acc_sets) = if r > 1 { (2.0, 2.0) } else { (0.0, 1.0) };
        let (o_acc, lse_acc) = (b * s_blk * hq * dv * 4.0, b * s_blk * hq * 4.0);
        mem_fwd = own_q
            + own_kv
            + sharded(hq, d)
            + sharded(kv, d + dv)
            + kv_bufs * kv_hop
            + 2.0 * (o_acc + lse_acc)
            + own_o
            + own_lse;
        mem_bwd = saved
            + own_q
            + sharded(hq, d + 2.0 * dv)
            + sharded(kv, d + dv)
            + if u > 1 { lse_acc } else { 0.0 }
            + lse_acc
            + o_acc
            + b * s_blk * (hq * d + kv * (d + dv)) * 4.0
            + kv_bufs * kv_hop
            + acc_sets * acc_hop
            + own_q
            + own_kv;
    }
    let forward = job.passes.forward().then(|| fwd.finish());
    let backward = job.passes.backward().then(|| bwd.finish());
    let passes = [&forward, &backward];
    let sum = |f: &dyn Fn(&PassCost) -> f64| passes.iter().filter_map(|x| x.as_ref()).map(f).fold(0.0, |a, x| a + x);
    let working = match (job.passes.forward(), job.passes.backward()) {
        (true, true) => mem_fwd.max(mem_bwd),
        (true, false) => mem_fwd,
        _ => mem_bwd,
    };
    let memory = (job.layers - 1) as f64 * saved + working;
    Ok(Choice {
        placement: *p,
        time_s: sum(&|x| x.time_s),
        compute_s: sum(&|x| x.compute_s),
        comm_s: sum(&|x| x.comm_s),
        exposed_comm_s: sum(&|x| x.exposed_comm_s),
        bytes_sent: passes.iter().filter_map(|x| x.as_ref()).map(|x| x.bytes_sent).sum(),
        memory_bytes: memory.round() as u64,
        tokens_per_rank: n_tokens,
        q_heads_per_rank: split.q_per_rank,
        kv_heads_per_rank: split.max_kv_per_rank(),
        kv_replicated: split.replicated,
        forward,
        backward,
    })
}
