//! The cost model over one batch of packed documents, and the per-batch choice of strategy,
//! layout and Ulysses degree built on it (`Strategy::Auto`'s resolution).
//!
//! The dense model ([`super::evaluate`]) spreads the FLOPs evenly over the ranks; with packed
//! documents the work of a rank depends on which tokens it holds. Here every rank's positions
//! come from the strategy's own rules for the layout (as the drivers resolve them), and:
//!
//! * **Attention work** per ring hop from the matrix of visible pairs between blocks
//!   ([`crate::flops::pair_matrix`]): rank (or Ulysses group) `g` at hop `t` attends the
//!   block of `g − t` on `h/u` query heads, `W[g][g − t]·b·(h/u)·2·(d + d_v)` FLOPs forward
//!   (`2·(3d + 2d_v)` per pair backward) at the cluster's kernel rates.
//! * **Ring transfers** as the plan runs them: the pass-along ring (the block a rank holds
//!   goes to the next rank, with the travelling dK/dV accumulators in the backward, returned
//!   to their owner at the end) or the direct schedule (only the rows the receiver sees, sent
//!   by their owner; dK/dV partials straight back), whichever the plan takes
//!   (the drivers' own verdict and row counts).
//! * **The all-gather** gathers only the rows each rank sees when the plan finds that cheaper
//!   (the same verdict, over as many hops as ranks): an all-to-all as long as the busiest
//!   rank's part, exposed.
//! * **A timeline, not an average**: each rank starts hop `t` when it has finished hop `t − 1`
//!   and the hop's block has arrived; a block is sent when its sender starts the hop before
//!   (the drivers post one hop ahead) and takes `latency + bytes / bandwidth`. A pass ends when
//!   the slowest rank ends (and, backward, its dK/dV came home). The Ulysses all-to-alls and
//!   the all-gather's collectives are as the dense model has them (exposed); the all-gather's
//!   ranks each attend their queries to the whole sequence.
//! * **Memory** as the dense model.
//!
//! [`plan_batch`] ranks every placement × layout ([`BATCH_LAYOUTS`]); its best is the choice
//! `Strategy::Auto` stands for. Everything is a pure function of its inputs: every rank that
//! asks gets the same answer.
//!
//! ```
//! use ringattn::plan::{evaluate_batch, ClusterSpec, JobSpec, Placement};
//! use ringattn::Layout;
//!
//! // 8 documents of mixed lengths, causal each, over 4 GPUs.
//! let docs = vec![4096, 512, 1024, 256, 8192, 768, 1280, 640];
//! let job = JobSpec { seq: docs.iter().sum(), heads: 8, kv_heads: 8, head_dim: 64, ..Default::default() };
//! let cluster = ClusterSpec { gpus: 4, ..Default::default() };
//! let zigzag = evaluate_batch(&cluster, &job, &docs, Layout::Zigzag, &Placement::ring(4))?;
//! let balanced = evaluate_batch(&cluster, &job, &docs, Layout::Balanced, &Placement::ring(4))?;
//! assert!(balanced.imbalance < 1.05 && zigzag.imbalance > balanced.imbalance);
//! assert!(balanced.compute_s < zigzag.compute_s);
//! # Ok::<(), ringattn::Error>(())
//! ```

use serde::{Serialize, Serializer};

use super::model::mesh_crosses;
use super::{evaluate, placements, ClusterSpec, JobSpec, Nesting, Placement, Rejected, GIB};
use crate::parallel::{ParallelParams, Strategy};
use crate::{flops, AttentionParams, Documents, Error, Layout, Mask, Positions, Result};

/// The layouts [`plan_batch`] weighs for every strategy that runs a ring or an all-gather
/// (Ulysses gathers the whole sequence per head: its layout changes nothing but the
/// all-to-alls' partners, and it is weighed with the default one).
pub const BATCH_LAYOUTS: [Layout; 3] = [Layout::Zigzag, Layout::Balanced, Layout::Contiguous];

/// The model's estimate for one placement and layout of one batch of documents. Times in
/// seconds of one attention layer, the passes of [`JobSpec::passes`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchChoice {
    /// The placement.
    pub placement: Placement,
    /// The layout.
    #[serde(serialize_with = "serialize_layout")]
    pub layout: Layout,
    /// Predicted time: the slowest rank's end of every pass, summed over the passes.
    pub time_s: f64,
    /// The busiest rank's attention time.
    pub compute_s: f64,
    /// `time_s − compute_s`: what the busiest rank waits (communication not hidden, and the
    /// wait for slower ranks).
    pub wait_s: f64,
    /// Max over mean of the ranks' attention work.
    pub imbalance: f64,
    /// Bytes all ranks send, all passes.
    pub bytes_sent: u64,
    /// Whether the ring runs the direct schedule, or the all-gather gathers, only what each
    /// rank sees.
    pub direct: bool,
    /// Peak memory per rank, bytes (the dense model's).
    pub memory_bytes: u64,
}

fn serialize_layout<S: Serializer>(l: &Layout, ser: S) -> std::result::Result<S::Ok, S::Error> {
    ser.serialize_str(&layout_name(*l))
}

/// The layout's `--layout` name.
pub fn layout_name(l: Layout) -> String {
    format!("{l:?}").to_lowercase()
}

impl BatchChoice {
    /// `strategy u×r layout`, e.g. `ring 1×4 balanced`.
    pub fn label(&self) -> String {
        format!("{} {}", self.placement.label(), layout_name(self.layout))
    }

    /// The parallel parameters that run this choice: strategy, layout, Ulysses degree.
    pub fn params(&self, attention: &AttentionParams) -> ParallelParams {
        ParallelParams {
            strategy: self.placement.strategy,
            layout: Some(self.layout),
            attention: attention.clone(),
            seq_len: 0,
            ulysses_degree: (self.placement.strategy == Strategy::Usp).then_some(self.placement.ulysses),
            auto: Default::default(),
        }
    }
}

/// The attention of a batch: causal per document when the job is causal, no mask otherwise.
fn batch_attention(job: &JobSpec, lengths: &[usize]) -> Result<AttentionParams> {
    let total: usize = lengths.iter().sum();
    if total != job.seq {
        return Err(Error::Documents(format!("document lengths sum to {total} but the job has {} tokens", job.seq)));
    }
    Ok(AttentionParams {
        mask: if job.causal { Mask::Causal } else { Mask::None },
        documents: Some(Documents::new(lengths.to_vec())?),
        ..Default::default()
    })
}

/// One ring (or one Ulysses group's view of it) over blocks at `pos`.
struct RingModel<'a> {
    cluster: &'a ClusterSpec,
    crosses: bool,
    /// Visible pairs between the blocks, `[queries][keys]`.
    pairs: Vec<Vec<u64>>,
    /// Rows of each block.
    len: Vec<usize>,
    /// Rows the direct schedule sends, `[to][from]`, when the plan takes it.
    direct: Option<Vec<Vec<usize>>>,
    /// Hops of the pass-along ring.
    hops: usize,
}

/// One pass's outcome.
struct PassTime {
    /// End of the pass, the slowest rank.
    end_s: f64,
    /// Each rank's attention seconds.
    compute_s: Vec<f64>,
    /// Bytes all ranks send.
    bytes: f64,
}

impl RingModel<'_> {
    fn transfer(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let (gbps, lat) = if self.crosses {
            (self.cluster.inter_gbps, self.cluster.inter_latency_us)
        } else {
            (self.cluster.intra_gbps, self.cluster.intra_latency_us)
        };
        lat * 1e-6 + bytes / (gbps * 1e9)
    }

    /// The pass over `hops` hops: `sec_per_pair` attention seconds per visible pair,
    /// `kv_row` bytes per K/V row travelling, `acc_row` bytes per dK/dV row (backward; 0
    /// forward).
    fn pass(&self, sec_per_pair: f64, kv_row: f64, acc_row: f64) -> PassTime {
        let r = self.len.len();
        let hops = match self.direct {
            Some(_) => r,
            None => self.hops.max(1),
        };
        let src = |g: usize, t: usize| (g + r - t % r) % r;
        let mut start = vec![0.0f64; r];
        let mut end = vec![0.0f64; r];
        let mut compute = vec![0.0f64; r];
        // When each rank's dK/dV partials have all come home (backward).
        let mut home = vec![0.0f64; r];
        let mut bytes = 0.0;
        let mut prev_start = vec![0.0f64; r];
        for t in 0..hops {
            for g in 0..r {
                let from = src(g, t);
                let c = self.pairs[g][from] as f64 * sec_per_pair;
                let (arrival, rows) = if t == 0 {
                    (0.0, 0)
                } else {
                    match &self.direct {
                        // The owner sends the rows `g` sees when it starts hop `t − 1`.
                        Some(rows) => {
                            let n = rows[g][from];
                            let at = if n > 0 { prev_start[from] + self.transfer(n as f64 * kv_row) } else { 0.0 };
                            (at, n)
                        }
                        // The previous rank forwards the block it held at hop `t − 1`.
                        None => {
                            let n = self.len[from];
                            (prev_start[src(g, 1)] + self.transfer(n as f64 * (kv_row + acc_row)), n)
                        }
                    }
                };
                let s = if t == 0 { 0.0 } else { end[g].max(arrival) };
                start[g] = s;
                end[g] = s + c;
                compute[g] += c;
                if t > 0 {
                    bytes += rows as f64 * (kv_row + acc_row);
                    if acc_row > 0.0 && self.direct.is_some() && rows > 0 {
                        // The partials of `from`'s rows go straight back.
                        home[from] = home[from].max(end[g] + self.transfer(rows as f64 * acc_row));
                    }
                }
            }
            prev_start.clone_from(&start);
        }
        if acc_row > 0.0 && self.direct.is_none() && hops > 1 {
            // The accumulators of the block each rank holds last return to their owner.
            for (g, &e) in end.iter().enumerate() {
                let owner = src(g, hops - 1);
                let n = self.len[owner] as f64;
                home[owner] = home[owner].max(e + self.transfer(n * acc_row));
                bytes += n * acc_row;
            }
        }
        let end_s = end.iter().zip(&home).map(|(e, h)| e.max(*h)).fold(0.0, f64::max);
        PassTime { end_s, compute_s: compute, bytes }
    }
}

/// Estimates one placement and layout of a batch of documents of `lengths` tokens each
/// (summing to `job.seq`; causal within each document when `job.causal`), as the module
/// documentation describes.
///
/// # Errors
/// [`Error::Documents`] when the lengths do not sum to `job.seq`; [`Error::Parallel`] when
/// the crate cannot run the placement or layout (heads that do not split, fewer tokens than
/// ranks); the errors of [`evaluate`] for an unusable cluster or job.
pub fn evaluate_batch(
    cluster: &ClusterSpec,
    job: &JobSpec,
    lengths: &[usize],
    layout: Layout,
    placement: &Placement,
) -> Result<BatchChoice> {
    let dense = evaluate(cluster, job, placement)?;
    let attention = batch_attention(job, lengths)?;
    let world = cluster.gpus;
    let (u, r) = (placement.ulysses, placement.ring);
    let probe = BatchChoice {
        placement: *placement,
        layout,
        time_s: 0.0,
        compute_s: 0.0,
        wait_s: 0.0,
        imbalance: 1.0,
        bytes_sent: 0,
        direct: false,
        memory_bytes: dense.memory_bytes,
    };
    let resolved = probe.params(&attention).resolve(world, job.heads, job.seq)?;
    let pos = resolved.all_positions();
    // Each ring position's tokens: a Ulysses group's members' together (the mesh's order:
    // rank g·u + i).
    let blocks: Vec<Positions> = match placement.strategy {
        Strategy::AllGather => pos.to_vec(),
        _ => (0..r).map(|g| crate::parallel::concat_positions(&pos[g * u..(g + 1) * u])).collect(),
    };
    let pairs = flops::pair_matrix(&attention, job.seq, &blocks)?;
    let (b, d, dv) = (job.batch as f64, job.head_dim as f64, job.value_head_dim() as f64);
    let q_heads = dense.q_heads_per_rank as f64;
    let kv = dense.kv_heads_per_rank as f64;
    let fwd_pair = 2.0 * (d + dv) * b * q_heads / (cluster.fwd_tflops * 1e12);
    let bwd_pair = 2.0 * (3.0 * d + 2.0 * dv) * b * q_heads / (cluster.bwd_tflops * 1e12);
    let (e, ea) = (job.dtype_bytes as f64, job.accum_bytes as f64);
    let kv_row = b * kv * (d + dv) * e;
    let acc_row = b * kv * (d + dv) * ea;
    // The collectives outside the ring (Ulysses all-to-alls, the all-gather's), exposed.
    let ring_transfer = |what: &str| what.contains("ring") || what == "dk/dv return";
    let outside = |p: &Option<super::PassCost>| -> (f64, u64) {
        p.as_ref().map_or((0.0, 0), |p| {
            p.transfers
                .iter()
                .filter(|t| !ring_transfer(&t.what))
                .fold((0.0, 0), |(s, n), t| (s + t.exposed_s, n + t.bytes_sent))
        })
    };
    // The all-gather's subset of rows (as the plan decides it: a ring of `world` hops).
    let subset = match placement.strategy {
        Strategy::AllGather => Some(crate::parallel::sent_rows(&attention, &blocks, world)?).filter(|x| x.1),
        _ => None,
    };
    let (mut time, mut bytes) = (0.0, 0u64);
    for pass in [&dense.forward, &dense.backward] {
        let (t, b) = outside(pass);
        if subset.is_none() {
            (time, bytes) = (time + t, bytes + b * world as u64);
        }
    }
    let mut compute = vec![0.0f64; blocks.len()];
    let mut direct = false;
    if let Some((rows, _)) = &subset {
        // An all-to-all of the rows each rank sees (K and V), twice with the backward, whose
        // dK/dV partials go back the same way: each exposed, as long as the busiest rank's
        // sending or receiving (per-GPU links) or its largest message (per-peer links).
        direct = true;
        let crosses = cluster.gpus > cluster.gpus_per_node;
        let (gbps, lat) = if crosses {
            (cluster.inter_gbps, cluster.inter_latency_us)
        } else {
            (cluster.intra_gbps, cluster.intra_latency_us)
        };
        let a2a = |unit: f64| -> f64 {
            let mut worst = 0.0f64;
            for (r, mine) in rows.iter().enumerate() {
                let sent: Vec<f64> = rows.iter().map(|to| to[r] as f64 * unit).collect();
                let recv: Vec<f64> = mine.iter().map(|&n| n as f64 * unit).collect();
                let busy = match cluster.links {
                    super::LinkSharing::PerGpu => sent.iter().sum::<f64>().max(recv.iter().sum()),
                    super::LinkSharing::PerPeer => sent.iter().chain(&recv).copied().fold(0.0, f64::max),
                };
                worst = worst.max(busy);
            }
            if worst > 0.0 {
                lat * 1e-6 + worst / (gbps * 1e9)
            } else {
                0.0
            }
        };
        let all_rows: usize = rows.iter().flatten().sum();
        if job.passes.forward() {
            time += a2a(kv_row);
            bytes += (all_rows as f64 * kv_row).round() as u64;
        }
        if job.passes.backward() {
            time += a2a(kv_row) + a2a(acc_row);
            bytes += (all_rows as f64 * (kv_row + acc_row)).round() as u64;
        }
    }
    if placement.strategy == Strategy::AllGather {
        // Each rank attends its queries to every key: one step.
        for (g, row) in pairs.iter().enumerate() {
            let w: u64 = row.iter().sum();
            let mut c = 0.0;
            if job.passes.forward() {
                c += w as f64 * fwd_pair;
            }
            if job.passes.backward() {
                c += w as f64 * bwd_pair;
            }
            compute[g] = c;
        }
        time += compute.iter().copied().fold(0.0, f64::max);
    } else {
        let hops = crate::parallel::hops_needed(&attention, &blocks)?;
        let (rows, takes_direct) = crate::parallel::sent_rows(&attention, &blocks, hops)?;
        direct = takes_direct;
        let ring = RingModel {
            cluster,
            crosses: mesh_crosses(cluster, placement),
            pairs,
            len: blocks.iter().map(Positions::len).collect(),
            direct: takes_direct.then_some(rows),
            hops,
        };
        // A group's members each send their share of its rows: bytes per member.
        let share = 1.0 / u as f64;
        for (run, per_pair, acc) in [(job.passes.forward(), fwd_pair, 0.0), (job.passes.backward(), bwd_pair, acc_row)]
        {
            if !run {
                continue;
            }
            let p = ring.pass(per_pair, kv_row * share, acc * share);
            time += p.end_s;
            bytes += (p.bytes * u as f64).round() as u64;
            for (c, x) in compute.iter_mut().zip(&p.compute_s) {
                *c += x;
            }
        }
    }
    let busiest = compute.iter().copied().fold(0.0, f64::max);
    let mean = compute.iter().sum::<f64>() / compute.len().max(1) as f64;
    Ok(BatchChoice {
        time_s: time,
        compute_s: busiest,
        wait_s: time - busiest,
        imbalance: if mean > 0.0 { busiest / mean } else { 1.0 },
        bytes_sent: bytes,
        direct,
        ..probe
    })
}

/// The ranked estimates of one batch ([`plan_batch`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchPlan {
    /// The cluster planned for.
    pub cluster: ClusterSpec,
    /// The job planned for (its `seq` the batch's tokens).
    pub job: JobSpec,
    /// The documents' lengths.
    pub lengths: Vec<usize>,
    /// Valid choices, fastest first (ties: the order of [`placements`] × [`BATCH_LAYOUTS`]).
    pub choices: Vec<BatchChoice>,
    /// Placements that cannot run, with the reason.
    pub rejected: Vec<Rejected>,
}

impl BatchPlan {
    /// The fastest choice: what `Strategy::Auto` runs.
    pub fn best(&self) -> Option<&BatchChoice> {
        self.choices.first()
    }

    /// The estimate of one placement's strategy and layout, if valid.
    pub fn find(&self, strategy: Strategy, layout: Layout) -> Option<&BatchChoice> {
        self.choices.iter().find(|c| c.placement.strategy == strategy && c.layout == layout)
    }
}

/// Ranks every placement of `cluster` ([`placements`]) with every layout of [`BATCH_LAYOUTS`]
/// (Ulysses with its default layout) for one batch of documents, by predicted time.
/// Placements that cannot run, or need more memory than the budget, go to `rejected`.
/// Deterministic: the same inputs give the same ranking on every rank.
///
/// ```
/// use ringattn::plan::{plan_batch, ClusterSpec, JobSpec};
///
/// let docs = vec![6000, 300, 900, 1200, 500];
/// let job = JobSpec { seq: docs.iter().sum(), heads: 8, kv_heads: 8, head_dim: 64, ..Default::default() };
/// let p = plan_batch(&ClusterSpec { gpus: 4, ..Default::default() }, &job, &docs)?;
/// let best = p.best().unwrap();
/// assert!(p.choices.iter().all(|c| c.time_s >= best.time_s));
/// println!("auto: {} ({:.3} ms)", best.label(), best.time_s * 1e3);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::Documents`] when the lengths do not sum to `job.seq`; [`Error::InvalidArgument`],
/// [`Error::ZeroHeads`] or [`Error::HeadRatio`] for an unusable cluster or job.
pub fn plan_batch(cluster: &ClusterSpec, job: &JobSpec, lengths: &[usize]) -> Result<BatchPlan> {
    cluster.validate()?;
    job.validate()?;
    batch_attention(job, lengths)?;
    let mut choices = Vec::new();
    let mut rejected = Vec::new();
    for placement in placements(cluster.gpus, cluster.gpus_per_node) {
        // The mesh's numbering is UlyssesInNode; the other nesting is the same batch on
        // reordered ranks, weighed by the dense model's links only.
        let layouts: &[Layout] = match placement.strategy {
            Strategy::Ulysses | Strategy::Single => &[Layout::Zigzag],
            _ => &BATCH_LAYOUTS,
        };
        for &layout in layouts {
            match evaluate_batch(cluster, job, lengths, layout, &placement) {
                Ok(c) if c.memory_bytes as f64 > cluster.memory_bytes() => {
                    rejected.push(Rejected {
                        placement,
                        reason: format!(
                            "needs {:.2} GiB per rank, over the {:.2} GiB budget",
                            c.memory_bytes as f64 / GIB,
                            cluster.memory_gib
                        ),
                        estimate: None,
                    });
                    break;
                }
                Ok(c) => choices.push(c),
                Err(Error::Parallel(reason)) => {
                    rejected.push(Rejected { placement, reason, estimate: None });
                    break;
                }
                Err(e) => return Err(e),
            }
        }
    }
    // Stable: ties keep the candidates' order.
    choices.sort_by(|a, b| {
        a.time_s
            .total_cmp(&b.time_s)
            .then((a.placement.nesting != Nesting::UlyssesInNode).cmp(&(b.placement.nesting != Nesting::UlyssesInNode)))
    });
    Ok(BatchPlan { cluster: cluster.clone(), job: job.clone(), lengths: lengths.to_vec(), choices, rejected })
}
