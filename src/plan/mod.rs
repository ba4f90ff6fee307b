//! An analytic cost model of sequence-parallel attention, a planner that ranks every way of
//! splitting one job over a cluster, and a simulator of step time over cluster and sequence
//! sizes.
//!
//! The model follows what the crate's drivers ([`crate::parallel`]) do, layer by layer and
//! rank by rank, with the communication volumes of `performance-anchors.md` §3. Notation:
//! `N` global tokens, `P` GPUs, `n = ⌈N/P⌉` tokens per rank, `b` batch, `h` query heads,
//! `h_kv` kv heads, `d` head dim, `e` bytes per element of the activations, `e_a` bytes of
//! the gradient accumulators (f32 in the crate), `c = 1/2` for causal masks (1 otherwise).
//!
//! * **Compute.** Attention forward FLOPs `4·b·h·N²·d·c`, backward 2.5× that (the crate's
//!   and flash-attention's convention), split evenly over the ranks: causal rings use the
//!   zigzag layout (the crate's default), which gives every ring hop half a dense block.
//!   Time = FLOPs / the kernel's achieved rate ([`ClusterSpec::fwd_tflops`],
//!   [`ClusterSpec::bwd_tflops`]).
//! * **Ring** (`r` ranks): `r` hops; each of the first `r − 1` sends the K/V block it holds,
//!   `2·b·S·h_kv'·d·e` bytes, to the next rank while attending to it (`S` tokens per block,
//!   `h_kv'` kv heads per rank), so a rank sends `2·N·h_kv·d·e·(P−1)/P` per forward (pure
//!   ring). A hop takes `max(compute, latency + bytes/bandwidth)`: communication is hidden
//!   when the hop's compute is the longer ([`overlap_threshold`]). The backward circulates
//!   K/V again with each block's dK/dV accumulators (`2·b·S·h_kv'·d·e_a`) one hop behind,
//!   and returns the accumulators to their owner at the end (exposed).
//! * **Ulysses** (`u` ranks): all-to-alls from sequence to head sharding of q, k, v and back
//!   of o (and the LSE, 4 bytes per token and head), each moving `(u−1)/u` of the rank's
//!   part: `(u−1)·n·d·e·(2h + 2h_kv)/u` bytes per rank for the four of the forward, with
//!   kv heads replicated as [`head_split`] describes. They are exposed (the layer's
//!   attention needs them). The crate's backward re-sends q, k, v, o with dO and the LSE and
//!   returns dQ, dK, dV (`e_a`).
//! * **USP** (`u × r = P`): Ulysses inside groups of `u`, a ring of `r` groups across them,
//!   each on its own links ([`Nesting`] says which dimension is inside a node).
//! * **All-gather** (llama3-style): all-gather of K and V (`(P−1)·n·h_kv·d·e` each), the
//!   local attention of the rank's queries to the whole sequence, and in the backward a
//!   second gather with reduce-scatters of dK and dV; all exposed.
//! * **Links.** A transfer takes `latency + bytes / bandwidth` with the intra-node
//!   (NVLink) or inter-node (InfiniBand) figures of [`ClusterSpec`]; an all-to-all whose
//!   peers are partly inside the node and partly outside splits its bytes over both and
//!   takes the slower share ([`LinkSharing`]).
//! * **Memory** per rank: the saved tensors of every layer, plus the larger working set of
//!   the passes run ([`Choice::memory_bytes`]).
//!
//! ```
//! use ringattn::plan::{plan, ClusterSpec, JobSpec};
//!
//! // 1M tokens on 64 H200-class GPUs (8 per node), 32 query and 8 kv heads, d = 128.
//! let cluster = ClusterSpec { gpus: 64, ..Default::default() };
//! let job = JobSpec { seq: 1 << 20, heads: 32, kv_heads: 8, head_dim: 128, ..Default::default() };
//! let p = plan(&cluster, &job)?;
//! let best = &p.choices[0];
//! assert!(p.choices.windows(2).all(|w| w[0].time_s <= w[1].time_s));
//! assert!(best.memory_bytes as f64 <= cluster.memory_gib * (1u64 << 30) as f64);
//! println!("{}: {:.1} ms", best.placement.label(), best.time_s * 1e3);
//! # Ok::<(), ringattn::Error>(())
//! ```

mod calibrate;
mod documents;
mod heads;
mod model;
mod simulate;

use serde::{Deserialize, Serialize, Serializer};

use crate::parallel::Strategy;
use crate::{Error, Result};

pub use calibrate::{Calibration, LinkFit, LinkKind, PingPong, PingPongSample};
pub use documents::{evaluate_batch, layout_name, plan_batch, BatchChoice, BatchPlan, BATCH_LAYOUTS};
pub use heads::{head_split, HeadSplit};
pub use model::{evaluate, overlap_threshold, Choice, Hop, PassCost, Transfer};
pub use simulate::{simulate, SimRow, Simulation};

/// Default intra-node bandwidth, GB/s per GPU and direction: about 370 GB/s achieved
/// point-to-point over NVLink4 (performance-anchors.md §3, "about 370 GB/s achieved p2p",
/// an assumption there; the spec is 450 GB/s each way).
pub const DEFAULT_INTRA_GBPS: f64 = 370.0;
/// Default inter-node bandwidth, GB/s per GPU and direction: one InfiniBand NDR 400 Gb/s
/// NIC per GPU (performance-anchors.md §3, "IB NDR 400 Gb/s = 50 GB/s per NIC").
pub const DEFAULT_INTER_GBPS: f64 = 50.0;
/// Default intra-node latency per message, µs (an assumption: small-message NCCL
/// point-to-point inside a node; not in the anchors). Calibrate with a [`PingPong`].
pub const DEFAULT_INTRA_LATENCY_US: f64 = 5.0;
/// Default inter-node latency per message, µs (an assumption, as for the intra-node one).
pub const DEFAULT_INTER_LATENCY_US: f64 = 10.0;
/// Default achieved forward kernel rate, TFLOP/s per GPU: the middle of the 330–370 TF/s
/// expected of an FA2-style kernel at d = 128 on an H200 (performance-anchors.md §5).
/// Calibrate from `ringattn bench --json` ([`Calibration`]).
pub const DEFAULT_FWD_TFLOPS: f64 = 350.0;
/// Default achieved backward kernel rate, TFLOP/s per GPU (backward FLOPs = 2.5× forward):
/// FA2's backward at d = 128, 291–322 TF/s on an H100 (performance-anchors.md §1c).
pub const DEFAULT_BWD_TFLOPS: f64 = 300.0;
/// Default memory per GPU for attention, GiB: an H200 shows about 139 GiB
/// (141 GB HBM3e). Lower it by what weights, optimiser state and other activations need.
pub const DEFAULT_MEMORY_GIB: f64 = 139.0;

/// The machines: how many GPUs, how they are grouped in nodes, how fast they compute and
/// talk. `Default`: 8 H200-class GPUs in one node (the `DEFAULT_*` constants).
///
/// Bandwidths are GB/s (10⁹ bytes per second) per GPU and direction, latencies µs per
/// message, kernel rates TFLOP/s (10¹² FLOP/s) per GPU as achieved by the local attention
/// kernel on the FLOPs of [`JobSpec`] (causal halved), memory GiB (2³⁰ bytes) per GPU.
///
/// ```
/// use ringattn::plan::ClusterSpec;
///
/// let c = ClusterSpec { gpus: 512, gpus_per_node: 8, ..Default::default() };
/// assert_eq!(c.nodes(), 64);
/// assert_eq!((c.intra_gbps, c.inter_gbps), (370.0, 50.0));
/// c.validate()?;
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// GPUs (ranks) the sequence is split over.
    pub gpus: usize,
    /// GPUs per node; ranks `k·G .. (k+1)·G` share node `k`.
    pub gpus_per_node: usize,
    /// Intra-node bandwidth, GB/s per GPU and direction.
    pub intra_gbps: f64,
    /// Inter-node bandwidth, GB/s per GPU and direction.
    pub inter_gbps: f64,
    /// Intra-node latency per message, µs.
    pub intra_latency_us: f64,
    /// Inter-node latency per message, µs.
    pub inter_latency_us: f64,
    /// Achieved forward attention rate per GPU, TFLOP/s.
    pub fwd_tflops: f64,
    /// Achieved backward attention rate per GPU, TFLOP/s (on 2.5× the forward FLOPs).
    pub bwd_tflops: f64,
    /// Memory per GPU the attention may use, GiB.
    pub memory_gib: f64,
    /// How concurrent messages of one rank share its links.
    pub links: LinkSharing,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            gpus: 8,
            gpus_per_node: 8,
            intra_gbps: DEFAULT_INTRA_GBPS,
            inter_gbps: DEFAULT_INTER_GBPS,
            intra_latency_us: DEFAULT_INTRA_LATENCY_US,
            inter_latency_us: DEFAULT_INTER_LATENCY_US,
            fwd_tflops: DEFAULT_FWD_TFLOPS,
            bwd_tflops: DEFAULT_BWD_TFLOPS,
            memory_gib: DEFAULT_MEMORY_GIB,
            links: LinkSharing::PerGpu,
        }
    }
}

/// How one rank's concurrent messages (the peers of an all-to-all) share bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkSharing {
    /// The bandwidth is the GPU's (an NVSwitch port, one NIC): an all-to-all moving `B`
    /// bytes to peers inside the node and `B'` outside takes
    /// `latency + max(B / intra, B' / inter)`.
    #[default]
    PerGpu,
    /// Every ordered pair of ranks has its own link of the full bandwidth (the in-process
    /// [`crate::comm::LinkModel`]): an all-to-all takes the time of its largest message.
    PerPeer,
}

impl ClusterSpec {
    /// Nodes in use, `⌈gpus / gpus_per_node⌉`.
    pub fn nodes(&self) -> usize {
        self.gpus.div_ceil(self.gpus_per_node.max(1))
    }

    /// The memory budget in bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gib * GIB
    }

    /// Checks that every figure is usable.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field that is zero, negative or not
    /// finite.
    pub fn validate(&self) -> Result<()> {
        if self.gpus == 0 || self.gpus_per_node == 0 {
            return Err(Error::InvalidArgument(format!(
                "cluster: gpus = {} and gpus_per_node = {} must be at least 1",
                self.gpus, self.gpus_per_node
            )));
        }
        let positive = [
            ("intra_gbps", self.intra_gbps),
            ("inter_gbps", self.inter_gbps),
            ("fwd_tflops", self.fwd_tflops),
            ("bwd_tflops", self.bwd_tflops),
            ("memory_gib", self.memory_gib),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidArgument(format!("cluster: {name} must be positive and finite, got {v}")));
            }
        }
        for (name, v) in [("intra_latency_us", self.intra_latency_us), ("inter_latency_us", self.inter_latency_us)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::InvalidArgument(format!("cluster: {name} must be finite and >= 0, got {v}")));
            }
        }
        Ok(())
    }
}

/// Bytes in a GiB.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Which passes a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Passes {
    /// Forward only (inference, prefill).
    Forward,
    /// Backward only (from a saved forward).
    Backward,
    /// Forward and backward (training).
    #[default]
    Both,
}

impl Passes {
    /// Whether the forward runs.
    pub fn forward(self) -> bool {
        self != Passes::Backward
    }

    /// Whether the backward runs.
    pub fn backward(self) -> bool {
        self != Passes::Forward
    }
}

impl std::str::FromStr for Passes {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "forward" => Ok(Passes::Forward),
            "backward" => Ok(Passes::Backward),
            "both" => Ok(Passes::Both),
            other => Err(Error::InvalidArgument(format!("passes `{other}`: expected forward, backward or both"))),
        }
    }
}

/// One attention layer's job. `Default`: 1M (2²⁰) causal tokens, batch 1, 32 query and
/// 8 kv heads of dimension 128 (Llama-3-8B's attention), bf16 (2 bytes) with f32 (4 bytes)
/// gradient accumulators, forward and backward, one layer.
///
/// ```
/// use ringattn::plan::JobSpec;
///
/// let job = JobSpec { seq: 131072, causal: false, ..Default::default() };
/// // 4·b·h·N²·d forward FLOPs, not halved without a causal mask.
/// assert_eq!(job.forward_flops(), 4.0 * 32.0 * 131072f64.powi(2) * 128.0);
/// job.validate()?;
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Global sequence length `N`, tokens.
    pub seq: usize,
    /// Batch size `b` (sequences of `N` tokens each).
    pub batch: usize,
    /// Query heads `h`.
    pub heads: usize,
    /// Key/value heads `h_kv` (a divisor of `h`; GQA when fewer).
    pub kv_heads: usize,
    /// Head dimension `d` of q and k (and of v unless `head_dim_v`).
    pub head_dim: usize,
    /// Head dimension of v and o when it differs from q and k's (multi-head latent
    /// attention, e.g. 128 beside `head_dim` 192); `None`: `head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim_v: Option<usize>,
    /// Bytes per element of q, k, v, o and dO, `e` (2 for bf16/f16, 4 for f32; the crate's
    /// host communicators move f32).
    pub dtype_bytes: usize,
    /// Bytes per element of the gradient accumulators (dQ, dK, dV) that travel, `e_a`
    /// (4: the crate accumulates in f32).
    pub accum_bytes: usize,
    /// Causal mask (FLOPs halved; zigzag layout for rings).
    pub causal: bool,
    /// Forward, backward or both.
    pub passes: Passes,
    /// Layers whose saved tensors (q, k, v, o, LSE) stay in memory for the backward (1: only
    /// the layer being planned).
    pub layers: usize,
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            seq: 1 << 20,
            batch: 1,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            head_dim_v: None,
            dtype_bytes: 2,
            accum_bytes: 4,
            causal: true,
            passes: Passes::Both,
            layers: 1,
        }
    }
}

impl JobSpec {
    /// The head dim of v and o: `head_dim_v`, or `head_dim`.
    pub fn value_head_dim(&self) -> usize {
        self.head_dim_v.unwrap_or(self.head_dim)
    }

    /// Forward FLOPs of the whole layer, `2·b·h·N²·(d + d_v)` (`4·b·h·N²·d` with equal head
    /// dims), halved when causal.
    pub fn forward_flops(&self) -> f64 {
        let c = if self.causal { 0.5 } else { 1.0 };
        2.0 * (self.batch * self.heads) as f64
            * (self.head_dim + self.value_head_dim()) as f64
            * (self.seq as f64).powi(2)
            * c
    }

    /// Checks the shape.
    ///
    /// # Errors
    /// [`Error::ZeroHeads`], [`Error::HeadRatio`] (`h % h_kv != 0`) or
    /// [`Error::InvalidArgument`] naming a zero length, batch, head dim or layer count, or
    /// an element size outside 1..=8 bytes.
    pub fn validate(&self) -> Result<()> {
        if self.heads == 0 {
            return Err(Error::ZeroHeads { name: "h_q" });
        }
        if self.kv_heads == 0 {
            return Err(Error::ZeroHeads { name: "h_kv" });
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::HeadRatio { h_q: self.heads, h_kv: self.kv_heads });
        }
        for (name, v) in [
            ("seq", self.seq),
            ("batch", self.batch),
            ("head_dim", self.head_dim),
            ("head_dim_v", self.value_head_dim()),
            ("layers", self.layers),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!("job: {name} must be at least 1")));
            }
        }
        for (name, v) in [("dtype_bytes", self.dtype_bytes), ("accum_bytes", self.accum_bytes)] {
            if !(1..=8).contains(&v) {
                return Err(Error::InvalidArgument(format!("job: {name} must be 1..=8 bytes, got {v}")));
            }
        }
        Ok(())
    }
}

/// Which dimension of a USP mesh sits on consecutive ranks, hence inside a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Nesting {
    /// Ulysses groups on consecutive ranks (inside a node when `u` divides the GPUs per
    /// node), the ring across them: the crate's USP layout (rank = `g·u + i` for ring
    /// position `g` and Ulysses position `i`).
    #[default]
    UlyssesInNode,
    /// Ring groups on consecutive ranks, the Ulysses groups across nodes (rank = `i·r + g`).
    /// The crate numbers USP ranks the other way: run it with ranks reordered by the
    /// launcher (for example `mpirun --map-by node` with `u` nodes, or a rankfile).
    RingInNode,
}

/// One way to split a job: the strategy, its Ulysses degree `u` and ring degree `r`
/// (`u·r` = GPUs) and, for USP, which of the two is inside nodes.
///
/// Ring is `u = 1`, Ulysses `r = 1`, all-gather `u = 1` with `r` the ranks the sequence is
/// split over.
///
/// ```
/// use ringattn::plan::{Nesting, Placement};
///
/// let p = Placement::usp(8, 16, Nesting::UlyssesInNode);
/// assert_eq!(p.gpus(), 128);
/// assert_eq!(p.label(), "usp 8×16 ulysses-in-node");
/// assert_eq!(p.command_hint(), "--strategy usp --ulysses-degree 8");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Placement {
    /// The strategy (`single`, `ring`, `allgather`, `ulysses` or `usp`).
    #[serde(serialize_with = "serialize_strategy")]
    pub strategy: Strategy,
    /// Ulysses degree `u` (1 for ring, all-gather and single).
    pub ulysses: usize,
    /// Ring degree `r` (1 for Ulysses and single; the number of ranks for all-gather).
    pub ring: usize,
    /// Which dimension is inside nodes (matters for USP across nodes only).
    pub nesting: Nesting,
}

fn serialize_strategy<S: Serializer>(s: &Strategy, ser: S) -> std::result::Result<S::Ok, S::Error> {
    ser.serialize_str(s.name())
}

impl Placement {
    /// One GPU.
    pub fn single() -> Self {
        Placement { strategy: Strategy::Single, ulysses: 1, ring: 1, nesting: Nesting::UlyssesInNode }
    }

    /// A ring of `p` ranks.
    pub fn ring(p: usize) -> Self {
        Placement { strategy: Strategy::Ring, ulysses: 1, ring: p, nesting: Nesting::UlyssesInNode }
    }

    /// Ulysses over `p` ranks.
    pub fn ulysses(p: usize) -> Self {
        Placement { strategy: Strategy::Ulysses, ulysses: p, ring: 1, nesting: Nesting::UlyssesInNode }
    }

    /// All-gather K/V over `p` ranks.
    pub fn all_gather(p: usize) -> Self {
        Placement { strategy: Strategy::AllGather, ulysses: 1, ring: p, nesting: Nesting::UlyssesInNode }
    }

    /// USP: Ulysses groups of `u`, a ring of `r` groups.
    pub fn usp(u: usize, r: usize, nesting: Nesting) -> Self {
        Placement { strategy: Strategy::Usp, ulysses: u, ring: r, nesting }
    }

    /// GPUs the placement uses, `u·r`.
    pub fn gpus(&self) -> usize {
        self.ulysses * self.ring
    }

    /// A short label: the strategy, `u×r` and, for USP, the nesting.
    pub fn label(&self) -> String {
        match self.strategy {
            Strategy::Usp => format!(
                "usp {}×{} {}",
                self.ulysses,
                self.ring,
                match self.nesting {
                    Nesting::UlyssesInNode => "ulysses-in-node",
                    Nesting::RingInNode => "ring-in-node",
                }
            ),
            s => format!("{} {}×{}", s.name(), self.ulysses, self.ring),
        }
    }

    /// The `ringattn run` options that select this placement.
    pub fn command_hint(&self) -> String {
        match self.strategy {
            Strategy::Usp => format!("--strategy usp --ulysses-degree {}", self.ulysses),
            s => format!("--strategy {}", s.name()),
        }
    }

    /// Checks that the shape fits the strategy and uses `gpus` ranks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the mismatch.
    pub fn check(&self, gpus: usize) -> Result<()> {
        let (u, r) = (self.ulysses, self.ring);
        let shape_ok = match self.strategy {
            Strategy::Single => u == 1 && r == 1,
            Strategy::Ring | Strategy::AllGather => u == 1 && r >= 1,
            Strategy::Ulysses => r == 1 && u >= 1,
            Strategy::Usp => u >= 1 && r >= 1,
            // (A placement is a strategy that runs; auto chooses among them.)
            Strategy::Auto => false,
        };
        if !shape_ok || u * r != gpus {
            return Err(Error::InvalidArgument(format!(
                "placement {} does not describe {gpus} GPUs (u·r must equal the GPUs; ring and all-gather have u = 1, ulysses r = 1)",
                self.label()
            )));
        }
        Ok(())
    }
}

/// Every placement of `gpus` ranks, `gpus_per_node` to a node: single for one GPU;
/// otherwise ring, all-gather, Ulysses and USP for every `u` dividing `gpus` with
/// `1 < u < gpus`, in both nestings when the job spans nodes (one otherwise: they are the
/// same). Whether each can run is [`evaluate`]'s and [`plan`]'s business.
///
/// ```
/// use ringattn::plan::placements;
///
/// // 8 GPUs in one node: ring, all-gather, ulysses, usp 2×4 and 4×2.
/// assert_eq!(placements(8, 8).len(), 5);
/// // Across two nodes each USP split comes in both nestings.
/// assert_eq!(placements(16, 8).len(), 3 + 2 * 3);
/// ```
pub fn placements(gpus: usize, gpus_per_node: usize) -> Vec<Placement> {
    if gpus <= 1 {
        return vec![Placement::single()];
    }
    let mut out = vec![Placement::ring(gpus), Placement::all_gather(gpus), Placement::ulysses(gpus)];
    for u in (2..gpus).filter(|u| gpus.is_multiple_of(*u)) {
        out.push(Placement::usp(u, gpus / u, Nesting::UlyssesInNode));
        if gpus > gpus_per_node {
            out.push(Placement::usp(u, gpus / u, Nesting::RingInNode));
        }
    }
    out
}

/// A placement the planner set aside, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    /// The placement.
    pub placement: Placement,
    /// Why it cannot run: the heads do not split, or it needs more memory than the budget.
    pub reason: String,
    /// Its estimate, when one could be made (memory over budget).
    pub estimate: Option<Choice>,
}

/// The planner's answer: the valid choices, fastest first, and the rejected placements.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The cluster planned for.
    pub cluster: ClusterSpec,
    /// The job planned for.
    pub job: JobSpec,
    /// Valid choices ranked by predicted step time, best first (ties: the crate's own
    /// nesting, then less memory, then less traffic).
    pub choices: Vec<Choice>,
    /// Placements that cannot run, with the reason.
    pub rejected: Vec<Rejected>,
}

/// Ranks every placement of `job` on `cluster` ([`placements`]) by predicted step time.
/// Placements whose heads do not split the way the crate needs (`h % u != 0`) or whose
/// memory per rank exceeds [`ClusterSpec::memory_gib`] go to [`Plan::rejected`] with the
/// reason, so every entry of [`Plan::choices`] can run.
///
/// ```
/// use ringattn::plan::{plan, ClusterSpec, JobSpec};
///
/// let cluster = ClusterSpec { gpus: 16, gpus_per_node: 8, ..Default::default() };
/// // 4 query heads cannot be split over 8 or 16 Ulysses ranks.
/// let job = JobSpec { seq: 1 << 18, heads: 4, kv_heads: 4, ..Default::default() };
/// let p = plan(&cluster, &job)?;
/// assert!(p.choices.iter().all(|c| c.placement.ulysses <= 4));
/// assert!(p.rejected.iter().any(|r| r.placement.ulysses == 16 && r.reason.contains("not a multiple")));
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`], [`Error::ZeroHeads`] or [`Error::HeadRatio`] for an unusable
/// cluster or job.
pub fn plan(cluster: &ClusterSpec, job: &JobSpec) -> Result<Plan> {
    cluster.validate()?;
    job.validate()?;
    let mut choices = Vec::new();
    let mut rejected = Vec::new();
    for placement in placements(cluster.gpus, cluster.gpus_per_node) {
        match evaluate(cluster, job, &placement) {
            Ok(c) if c.memory_bytes as f64 > cluster.memory_bytes() => rejected.push(Rejected {
                placement,
                reason: format!(
                    "needs {:.2} GiB per rank, over the {:.2} GiB budget",
                    c.memory_bytes as f64 / GIB,
                    cluster.memory_gib
                ),
                estimate: Some(c),
            }),
            Ok(c) => choices.push(c),
            Err(Error::Parallel(reason)) => rejected.push(Rejected { placement, reason, estimate: None }),
            Err(e) => return Err(e),
        }
    }
    choices.sort_by(|a, b| {
        a.time_s
            .total_cmp(&b.time_s)
            .then((a.placement.nesting != Nesting::UlyssesInNode).cmp(&(b.placement.nesting != Nesting::UlyssesInNode)))
            .then(a.memory_bytes.cmp(&b.memory_bytes))
            .then(a.bytes_sent.cmp(&b.bytes_sent))
    });
    Ok(Plan { cluster: cluster.clone(), job: job.clone(), choices, rejected })
}

impl Plan {
    /// The best choice, if any placement is valid.
    pub fn best(&self) -> Option<&Choice> {
        self.choices.first()
    }

    /// The fastest valid choice of a strategy.
    pub fn best_of(&self, strategy: Strategy) -> Option<&Choice> {
        self.choices.iter().find(|c| c.placement.strategy == strategy)
    }

    /// A plain-language paragraph: the best choice, why, how it compares with the pure
    /// strategies, how to run it, and what was rejected.
    pub fn recommendation(&self) -> String {
        let (c, j) = (&self.cluster, &self.job);
        let what = match j.passes {
            Passes::Forward => "forward",
            Passes::Backward => "backward",
            Passes::Both => "forward + backward",
        };
        let Some(best) = self.best() else {
            let reasons: Vec<&str> = self.rejected.iter().map(|r| r.reason.as_str()).take(2).collect();
            return format!(
                "No placement of {} tokens on {} GPUs can run: {}. Add GPUs, raise the memory budget or shorten the sequence.",
                j.seq,
                c.gpus,
                reasons.join("; ")
            );
        };
        let mut s = format!(
            "For {} tokens ({} query / {} kv heads, d = {}{}) on {} GPU{} ({} node{} of {}), the model predicts {} is fastest: {:.2} ms per attention layer ({what}), of which {:.2} ms kernel time and {:.2} ms exposed communication, sending {:.1} MiB and holding {:.2} GiB per rank.",
            j.seq,
            j.heads,
            j.kv_heads,
            j.head_dim,
            if j.causal { ", causal" } else { "" },
            c.gpus,
            if c.gpus == 1 { "" } else { "s" },
            c.nodes(),
            if c.nodes() == 1 { "" } else { "s" },
            c.gpus_per_node,
            best.placement.label(),
            best.time_s * 1e3,
            best.compute_s * 1e3,
            best.exposed_comm_s * 1e3,
            best.bytes_sent as f64 / MIB,
            best.memory_bytes as f64 / GIB,
        );
        if let Some(h) = best.forward.as_ref().or(best.backward.as_ref()).and_then(|p| p.hop.as_ref()) {
            s += &if h.hidden {
                format!(
                    " Its ring hops are compute-bound: each hop's {:.3} ms of attention hides the {:.3} ms transfer of the next K/V block.",
                    h.compute_s * 1e3,
                    h.transfer_s * 1e3
                )
            } else {
                format!(
                    " Its ring hops are communication-bound: each K/V transfer takes {:.3} ms against {:.3} ms of attention, so longer sequences per rank would hide it.",
                    h.transfer_s * 1e3,
                    h.compute_s * 1e3
                )
            };
        }
        if best.placement.ulysses > 1 {
            let a2a: f64 = [&best.forward, &best.backward]
                .iter()
                .filter_map(|p| p.as_ref())
                .flat_map(|p| p.transfers.iter())
                .filter(|t| t.what.contains("→"))
                .map(|t| t.seconds)
                .sum();
            s += &format!(
                " Its Ulysses all-to-alls ({:.3} ms, not overlapped) stay {}.",
                a2a * 1e3,
                if best.placement.ulysses <= c.gpus_per_node && best.placement.nesting == Nesting::UlyssesInNode {
                    "inside nodes"
                } else {
                    "partly across nodes"
                }
            );
        }
        // A near-tie that moves much less data is the safer bet when bandwidth is uncertain.
        let frugal = self
            .choices
            .iter()
            .filter(|o| o.time_s <= best.time_s * 1.02 && (o.bytes_sent as f64) < 0.75 * best.bytes_sent as f64)
            .min_by_key(|o| o.bytes_sent);
        if let Some(o) = frugal {
            s += &format!(
                " {} is within {:.1}% and sends {:.1}× less per rank, the safer choice if the links are slower than assumed.",
                o.placement.label(),
                (o.time_s / best.time_s - 1.0) * 100.0,
                best.bytes_sent as f64 / o.bytes_sent.max(1) as f64
            );
        }
        let mut others = Vec::new();
        for st in [Strategy::Ring, Strategy::Ulysses, Strategy::Usp, Strategy::AllGather] {
            if st == best.placement.strategy || c.gpus == 1 {
                continue;
            }
            if let Some(o) = self.best_of(st) {
                others.push(format!("{} {:.2}× slower", o.placement.label(), o.time_s / best.time_s));
            } else {
                others.push(format!("{} not possible", st.name()));
            }
        }
        if !others.is_empty() {
            s += &format!(" The best of each other strategy: {}.", others.join(", "));
        }
        s += &format!(" Run it with `{}`", best.placement.command_hint());
        if best.placement.nesting == Nesting::RingInNode {
            s += " and ranks ordered so that each ring lies inside a node (for example `mpirun --map-by node`)";
        }
        s += ".";
        if !self.rejected.is_empty() {
            s += &format!(
                " {} placement{} rejected (see below).",
                self.rejected.len(),
                if self.rejected.len() == 1 { " was" } else { "s were" }
            );
        }
        s
    }
}

/// Bytes in a MiB.
pub(crate) const MIB: f64 = (1u64 << 20) as f64;

#[cfg(test)]
mod tests;
