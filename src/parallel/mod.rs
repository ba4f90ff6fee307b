//! Sequence parallelism: one sequence split over the ranks of a [`Communicator`], the exact
//! attention result and gradients computed with communication overlapped by compute.
//!
//! Strategies ([`Strategy`]): `Ring` (K/V blocks travel the ring, partials merge in f32),
//! `AllGather` (llama3-style: gather K/V, attend locally, reduce-scatter dK/dV), `Ulysses`
//! (all-to-all from sequence to head sharding and back) and `Usp` (Ulysses inside groups of
//! consecutive ranks, a ring across the groups). Any sequence length works.
//!
//! Every default (layout, sequence length, Ulysses degree) is resolved in one place,
//! [`ParallelParams::resolve`]; the [`ResolvedParams`] give each rank its tokens
//! ([`ResolvedParams::shard`], [`ResolvedParams::positions`], see [`Layout`]) and reassemble
//! the parts. A [`ParallelPlan`] is made once per rank and layer shape (one handshake; the
//! Ulysses/USP sub-communicators) and runs every later call without setup;
//! [`forward`] / [`backward`] plan on every call.
//!
//! ```
//! use ringattn::comm::{spmd, Communicator, LocalOptions};
//! use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan, Strategy};
//! use ringattn::{cpu, random::randn, verify, AttentionParams, DType, Dims, Layout, Mask};
//!
//! let (s, world) = (100, 4);
//! let q = randn(vec![1, s, 4, 16], 1, DType::F32);
//! let k = randn(vec![1, s, 2, 16], 2, DType::F32);
//! let v = randn(vec![1, s, 2, 16], 3, DType::F32);
//! let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
//! let params = ParallelParams { strategy: Strategy::Ring, layout: Some(Layout::Zigzag), attention: attention.clone(), ..Default::default() };
//! let resolved = params.resolve(world, 4, s)?;
//! // Each rank takes its shard, plans once, and runs the ring.
//! let parts = spmd(world, LocalOptions::default(), |comm| {
//!     let shard = |t: &ringattn::Tensor| resolved.shard(t, comm.rank());
//!     let (q, k, v) = (shard(&q)?, shard(&k)?, shard(&v)?);
//!     let backend = CpuBackend::default();
//!     let plan = ParallelPlan::new(comm, &backend, &params, &Dims::of(&q, &k, &v)?, q.dtype())?;
//!     let (out, _stats) = plan.forward_tensors(&q, &k, &v)?;
//!     Ok(out.o)
//! });
//! let o = resolved.unshard(&parts.into_iter().collect::<Result<Vec<_>, _>>()?)?;
//! let single = cpu::forward(&q, &k, &v, &attention)?;
//! let single64: Vec<f64> = single.o.as_f32().iter().map(|&x| x as f64).collect();
//! assert!(verify::rel_err(&o.to_f32_vec(), &single64) < 1e-5);
//! # Ok::<(), ringattn::Error>(())
//! ```

/// The strategy registry: each line declares a [`Strategy`] variant, its one name, its rules
/// (constraints, Ulysses degree, positions) and its driver (forward, backward), both in the
/// strategy's own file. From it come the enum, [`Strategy::ALL`], [`Strategy::name`],
/// `with_rules!` and `with_driver!`, the one dispatch (`with_driver!(strategy, D =>
/// D::forward(..))`). A new strategy is its file and one line here.
macro_rules! strategies {
    ($d:tt $( $(#[$attr:meta])* $variant:ident = $name:literal => $rules:ty, $driver:ty ),* $(,)?) => {
        /// How the sequence is spread over ranks. The default is the ring (on one rank it is
        /// plain attention).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        #[non_exhaustive]
        pub enum Strategy {
            $( $(#[$attr])* $variant, )*
            /// Chosen per batch of packed documents by the cost model ([`auto`]): strategy,
            /// layout and Ulysses degree, resolved by [`ParallelParams::resolve_for`] (or a
            /// plan) from the batch's documents, shape and dtype and the
            /// [`ParallelParams::auto`] model — never run as itself, and not in
            /// [`Strategy::ALL`] (the strategies that run).
            Auto,
        }

        impl Strategy {
            /// Every strategy, in the order the CLI, the planner and the tests list them.
            pub const ALL: [Strategy; [$($name),*].len()] = [$(Strategy::$variant),*];

            /// The strategies that split a sequence over more than one rank (every one but
            /// `Single`), in [`Strategy::ALL`]'s order.
            pub const PARALLEL: [Strategy; [$($name),*].len() - 1] = {
                let mut out = [Strategy::Ring; [$($name),*].len() - 1];
                let (mut i, mut j) = (0, 0);
                while i < Strategy::ALL.len() {
                    if !matches!(Strategy::ALL[i], Strategy::Single) {
                        out[j] = Strategy::ALL[i];
                        j += 1;
                    }
                    i += 1;
                }
                out
            };

            /// The one name of the strategy, as `--strategy` takes it and JSON writes it:
            /// `single`, `ring`, `allgather`, `ulysses`, `usp`, and `auto`.
            ///
            /// ```
            /// use ringattn::parallel::Strategy;
            /// for s in Strategy::ALL.into_iter().chain([Strategy::Auto]) {
            ///     assert_eq!(s.name().parse::<Strategy>()?, s);
            ///     assert_eq!(s.to_string(), s.name());
            /// }
            /// # Ok::<(), ringattn::Error>(())
            /// ```
            pub fn name(self) -> &'static str {
                match self {
                    $( Strategy::$variant => $name, )*
                    Strategy::Auto => "auto",
                }
            }

            /// The names of `strategies`, comma-separated: what help texts and errors list
            /// (from the registry, never by hand).
            ///
            /// ```
            /// use ringattn::parallel::Strategy;
            /// assert_eq!(Strategy::list(&Strategy::ALL), "single, ring, allgather, ulysses, usp");
            /// assert_eq!(Strategy::list(&Strategy::PARALLEL), "ring, allgather, ulysses, usp");
            /// ```
            pub fn list(strategies: &[Strategy]) -> String {
                strategies.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
            }
        }

        /// Runs `$body` with `$t` the rules type of strategy `$s` (`Auto`'s refuse
        /// everything: it is resolved before anything runs).
        macro_rules! with_rules {
            ($d s:expr, $d t:ident => $d body:expr) => {
                match $d s {
                    $( Strategy::$variant => {
                        type $d t = $rules;
                        $d body
                    } )*
                    Strategy::Auto => {
                        type $d t = crate::parallel::auto::Unchosen;
                        $d body
                    }
                }
            };
        }

        /// Runs `$body` with `$t` the driver type of strategy `$s`.
        macro_rules! with_driver {
            ($d s:expr, $d t:ident => $d body:expr) => {
                match $d s {
                    $( Strategy::$variant => {
                        type $d t = $driver;
                        $d body
                    } )*
                    Strategy::Auto => {
                        type $d t = crate::parallel::auto::Unchosen;
                        $d body
                    }
                }
            };
        }
    };
}

strategies! { $
    /// One rank, no sequence parallelism.
    Single = "single" => crate::parallel::ring::Single, crate::parallel::ring::Ring,
    /// Ring attention.
    #[default]
    Ring = "ring" => crate::parallel::ring::Ring, crate::parallel::ring::Ring,
    /// All-gather K/V, local attention, reduce-scatter dK/dV.
    AllGather = "allgather" => crate::parallel::allgather::AllGather, crate::parallel::allgather::AllGather,
    /// Ulysses all-to-all.
    Ulysses = "ulysses" => crate::parallel::ulysses::Ulysses, crate::parallel::ulysses::Ulysses,
    /// Ulysses within groups, ring across groups.
    Usp = "usp" => crate::parallel::ulysses::Usp, crate::parallel::ulysses::Ulysses,
}

impl Strategy {
    /// The smallest world size (and Ulysses degree, where the strategy takes one) that
    /// runs every path of the strategy — uneven shares of the sequence, more than one
    /// hop or group where it has them: what the conformance check of every backend
    /// runs each strategy with (stated by the strategy's own rules, so that a new
    /// strategy is checked without a table to extend).
    ///
    /// ```
    /// use ringattn::parallel::Strategy;
    /// assert_eq!(Strategy::Single.check_world(), (1, None));
    /// assert_eq!(Strategy::Usp.check_world(), (4, Some(2)));
    /// ```
    pub fn check_world(self) -> (usize, Option<usize>) {
        with_rules!(self, R => <R as Rules>::CHECK_WORLD)
    }
}

mod allgather;
pub mod auto;
mod backend;
mod direct;
mod plan;
mod ring;
mod seq;
mod ulysses;

use std::time::Duration;

pub use crate::cpu::CpuBackend;
pub(crate) use backend::host_partial;
pub use backend::{Backend, BufShape, Buffers, ForwardPartial, GradientPartial, HostMemory, NullBackend, Pending};
pub(crate) use direct::sent_rows;
#[cfg(feature = "candle")]
pub(crate) use plan::fnv1a;
pub use plan::{ParallelPlan, PlanSource, ResolvedParams};
pub(crate) use ring::hops_needed;
pub(crate) use ulysses::HeadPlan;

use crate::attention::{ForwardOutput, Gradients};
use crate::comm::{spmd, Communicator, LocalOptions, Payload, RecvOp, SendOp};
use crate::{AttentionParams, DType, Dims, Error, HostBuf, Layout, Mask, Positions, Result, Tensor};

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .chain([Strategy::Auto])
            .find(|x| x.name() == s)
            .ok_or_else(|| Error::UnknownStrategy(s.to_string()))
    }
}

/// Parameters of a sequence-parallel call. `Default`: ring, default layout, no mask.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParallelParams {
    /// The strategy.
    pub strategy: Strategy,
    /// The layout; `None` picks zigzag for causal or windowed masks, contiguous otherwise.
    pub layout: Option<Layout>,
    /// Mask, documents and scale, on global positions.
    pub attention: AttentionParams,
    /// Global sequence length `s` (0: the sum of the ranks' token counts, resolved by the
    /// plan's handshake).
    pub seq_len: usize,
    /// Ulysses degree of `Usp` (`None`: the largest divisor of the world size that divides
    /// `h_q`, chosen by [`ParallelParams::resolve`]).
    pub ulysses_degree: Option<usize>,
    /// What [`Strategy::Auto`] weighs when it chooses (the other strategies do not read it).
    pub auto: AutoModel,
}

/// The cost model [`Strategy::Auto`] chooses with: the cluster's kernel rates and links
/// (`gpus` and `gpus_per_node` are set from the world size at resolution; calibrate the rest
/// for the machines that run the job: [`crate::plan::Calibration`], `ringattn plan
/// calibrate`) and the passes a step runs. `Default`: the planner's default cluster, forward
/// and backward.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AutoModel {
    /// Kernel rates and links of the machines.
    pub cluster: crate::plan::ClusterSpec,
    /// What a step runs (training: both).
    pub passes: crate::plan::Passes,
}

/// What [`Strategy::Auto`] chose for a batch, as [`Stats::chosen`] reports it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Chosen {
    /// The strategy run (its name).
    pub strategy: String,
    /// The layout (its name: `contiguous`, `zigzag`, `striped`, `balanced`).
    pub layout: String,
    /// The Ulysses degree (1: none).
    pub ulysses_degree: usize,
    /// The model's predicted time of one step of the choice, seconds.
    pub predicted_s: f64,
    /// The model's predicted time of the slowest placement it weighed, seconds.
    pub worst_predicted_s: f64,
}

/// What one rank did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Ring hops run (1 for non-ring strategies). Under the ring's direct schedule, this
    /// rank's: one past its last hop with anything to send or receive (ranks may differ).
    pub hops: usize,
    /// Ring hops after the local one in which this rank sent and received nothing: past a
    /// window's early stop, and under the direct schedule the hops whose peers share no
    /// visible pair with this rank.
    pub skipped_hops: usize,
    /// Local attention blocks computed.
    pub blocks: usize,
    /// Time in local attention.
    pub compute: Duration,
    /// Time blocked waiting for communication.
    pub waiting: Duration,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Wall time of the whole call on this rank.
    pub total: Duration,
    /// Attention FLOPs of the blocks computed, counted densely per block (`4·b·h_q·d·n_q·n_k`
    /// forward, 2.5× that backward; masked pairs inside a computed block count too).
    pub flops: f64,
    /// One entry per step (ring hop; a single step for the other strategies).
    pub steps: Vec<StepStats>,
    /// Under [`Strategy::Auto`], what was chosen for the batch and the model's prediction.
    pub chosen: Option<Chosen>,
}

/// What one step (ring hop) of one rank did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepStats {
    /// Time in local attention.
    pub compute: Duration,
    /// Time blocked waiting for communication.
    pub waiting: Duration,
    /// Attention FLOPs of the step's block (0 when skipped).
    pub flops: f64,
}

impl Stats {
    /// Records a step from the totals before it.
    pub(crate) fn step(&mut self, compute0: Duration, waiting0: Duration, flops: f64) {
        self.flops += flops;
        self.steps.push(StepStats { compute: self.compute - compute0, waiting: self.waiting - waiting0, flops });
    }
}

impl ParallelParams {
    /// The layout in force.
    pub fn layout(&self) -> Layout {
        self.layout.unwrap_or(match self.attention.mask {
            Mask::None => Layout::Contiguous,
            _ => Layout::Zigzag,
        })
    }

    /// The Ulysses degree of `Usp` for `world` ranks and `h_q` query heads.
    ///
    /// # Errors
    /// [`Error::Parallel`] when the given degree does not divide the world size.
    pub fn usp_degree(&self, world: usize, h_q: usize) -> Result<usize> {
        match self.ulysses_degree {
            Some(u) if u == 0 || !world.is_multiple_of(u) => {
                Err(Error::Parallel(format!("--ulysses-degree {u} does not divide the world size {world}")))
            }
            Some(u) => Ok(u),
            None => Ok((1..=world).rev().find(|u| world.is_multiple_of(*u) && h_q.is_multiple_of(*u)).unwrap_or(1)),
        }
    }

    /// Checks the strategy, layout and world size against the heads.
    ///
    /// # Errors
    /// [`Error::Parallel`] naming the constraint that fails.
    pub fn validate(&self, world: usize, h_q: usize) -> Result<()> {
        if world == 0 {
            return Err(Error::Parallel("the world size must be at least 1".into()));
        }
        with_rules!(self.strategy, R => R::validate(self, world, h_q))
    }
}

/// Per-rank local data in the backend's buffers.
struct LocalData<B> {
    b: usize,
    h_q: usize,
    h_kv: usize,
    d_qk: usize,
    d_v: usize,
    q: B,
    k: B,
    v: B,
    /// The call's attention sinks (the forward's finish step merges them), if any.
    sinks: Option<plan::PlanSinks<B>>,
}

impl<B> LocalData<B> {
    /// The ring's view of this rank's own (sequence-sharded) data.
    fn ring_inputs<'a, Be: Backend<Buf = B>>(
        &'a self,
        pos: &'a [Positions],
        plan: &'a ParallelPlan<'_, Be>,
        params: &'a AttentionParams,
    ) -> ring::RingInputs<'a, B> {
        ring::RingInputs {
            b: self.b,
            h_q: self.h_q,
            h_kv: self.h_kv,
            d_qk: self.d_qk,
            d_v: self.d_v,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            pos,
            hops: plan.hops,
            params,
            direct: plan.direct.as_ref(),
        }
    }
}

/// The positions of several blocks one after another (a Ulysses group's tokens).
pub(crate) fn concat_positions(pos: &[Positions]) -> Positions {
    Positions::from_segments(pos.iter().flat_map(|p| p.segments().iter().copied()).collect()).expect("valid segments")
}

/// What a forward keeps for its backward: this rank's inputs, its output `o` (input dtype)
/// and `lse` (f32, `[b, h_q, n]`), as the backend's buffers. Holding it costs no copy (the
/// buffers are shared handles); each call's context is its own, so any number of layers,
/// repeated calls and recomputation (gradient checkpointing) work.
#[derive(Clone)]
pub struct SavedForward<B> {
    /// Queries `[b, n, h_q, d_qk]`.
    pub q: B,
    /// Keys `[b, n, h_kv, d_qk]`.
    pub k: B,
    /// Values `[b, n, h_kv, d_v]`.
    pub v: B,
    /// Output `[b, n, h_q, d_v]`, input dtype.
    pub o: B,
    /// Log-sum-exp `[b, h_q, n]`, f32.
    pub lse: B,
    /// The attention sinks' logits the call used, `[h_q]` f32 (with sinks: the plan's, or the
    /// call's own from [`ParallelPlan::forward_with_sinks`]); their gradient comes from these.
    pub sinks: Option<B>,
}

/// Whether a backward computes the attention sinks' gradient ([`GradientBufs::dsinks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum SinksGradient {
    /// With the other gradients (when the forward had sinks).
    #[default]
    Compute,
    /// Not: the caller takes it from [`ParallelPlan::sinks_gradient`].
    #[cfg_attr(not(feature = "candle"), allow(dead_code, reason = "the candle operation's"))]
    Skip,
}

/// Gradients of one rank's shard, as the backend's buffers in the input dtype.
#[derive(Clone)]
pub struct GradientBufs<B> {
    /// `[b, n, h_q, d_qk]`.
    pub dq: B,
    /// `[b, n, h_kv, d_qk]`.
    pub dk: B,
    /// `[b, n, h_kv, d_v]`.
    pub dv: B,
    /// `[h_q]` f32: the sinks' gradient over this rank's rows (with sinks; see
    /// [`crate::Gradients::dsinks`]).
    pub dsinks: Option<B>,
}

/// Exact attention of this rank's shard of one long sequence against the whole sequence, on
/// the backend's buffers (host memory for the CPU and emulated backends, device memory for
/// CUDA): `softmax(scale · q kᵀ + mask) v` with the mask on global positions. `q` is `[b, n,
/// h_q, d]`, `k` and `v` `[b, n, h_kv, d]` (this rank's `n` tokens, at
/// [`ParallelPlan::positions`]), in the plan's dtype; returns `o` `[b, n, h_q, d]` in that
/// dtype and the context [`ring_attention_backward`] takes. The plan fixes the strategy (the
/// ring by default; all-gather, Ulysses, USP), the layout, the mask and the communicator, and
/// was made once ([`ParallelPlan::new`]); this call is collective over its communicator and
/// does no setup and no host transfer. The same as [`ParallelPlan::forward`].
///
/// # Errors
/// [`Error::ShapeMismatch`] when the buffers are not the planned shard; communication errors
/// (every wait has the communicator's deadline; a failed peer fails every rank) and backend
/// errors.
///
/// ```
/// use ringattn::comm::{spmd, Communicator, LocalOptions};
/// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
/// use ringattn::{random::randn, ring_attention, ring_attention_backward, AttentionParams, DType, Dims, HostBuf, Mask};
///
/// let (s, world) = (64, 4);
/// let x = randn(vec![1, s, 2, 16], 1, DType::BF16);
/// let params = ParallelParams { attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let resolved = params.resolve(world, 2, s)?;
/// let grads = spmd(world, LocalOptions::default(), |comm| {
///     let shard = resolved.shard(&x, comm.rank())?; // this rank's tokens (zigzag for causal)
///     let backend = CpuBackend::default();
///     let plan = ParallelPlan::new(comm, &backend, &params, &Dims::of(&shard, &shard, &shard)?, DType::BF16)?;
///     let q = HostBuf::from_tensor(&shard);
///     let mut last = None;
///     for _layer in 0..2 {
///         let (o, saved) = ring_attention(&plan, &q, &q, &q)?; // bf16 in, bf16 out
///         assert_eq!(o.elem(), ringattn::Elem::BF16);
///         last = Some(ring_attention_backward(&plan, &saved, &o)?);
///     }
///     Ok(last.unwrap().dq.len())
/// });
/// assert!(grads.into_iter().all(|g| g.is_ok()));
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn ring_attention<Be: Backend>(
    plan: &ParallelPlan<'_, Be>,
    q: &Be::Buf,
    k: &Be::Buf,
    v: &Be::Buf,
) -> Result<(Be::Buf, SavedForward<Be::Buf>)> {
    plan.forward(q, k, v)
}

/// The backward of [`ring_attention`]: from the context of a forward and `d_o` `[b, n, h_q,
/// d]` (the loss's gradient with respect to that call's `o`, in the plan's dtype), this
/// rank's `dq` `[b, n, h_q, d]`, `dk` and `dv` `[b, n, h_kv, d]` in that dtype, exact over the
/// whole sequence (K/V gradients computed by other ranks come back to their owners).
/// Collective; no setup, no host transfer. The same as [`ParallelPlan::backward`].
///
/// # Errors
/// As [`ring_attention`].
pub fn ring_attention_backward<Be: Backend>(
    plan: &ParallelPlan<'_, Be>,
    saved: &SavedForward<Be::Buf>,
    d_o: &Be::Buf,
) -> Result<GradientBufs<Be::Buf>> {
    plan.backward(saved, d_o)
}

/// This rank's part of the forward: `o` (input dtype) and `lse` (f32) for the tokens it
/// holds, with its statistics. Collective over `comm`, whose buffers are the backend's.
/// Plans the layer on every call ([`ParallelPlan::new`]: one handshake, and the splits of
/// Ulysses/USP); code that calls attention repeatedly makes the plan once and calls
/// [`ParallelPlan::forward`] (on the backend's buffers) or
/// [`ParallelPlan::forward_tensors`].
///
/// # Errors
/// [`Error::Handshake`] when ranks disagree or one holds the wrong shard (on every rank),
/// [`Error::Parallel`] for an invalid configuration, communication errors.
pub fn forward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    backend: &Be,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &ParallelParams,
) -> Result<(ForwardOutput, Stats)> {
    let plan = ParallelPlan::new(comm, backend, params, &Dims::of(q, k, v)?, q.dtype())?;
    plan.forward_tensors(q, k, v)
}

/// This rank's part of the backward, from its shards, its `o` and `lse` (as [`forward`]
/// returned them) and its `d_o`. Collective over `comm`; plans the layer on every call, as
/// [`forward`] does ([`ParallelPlan::backward`] does not).
///
/// # Errors
/// As [`forward`].
#[allow(clippy::too_many_arguments)]
pub fn backward<Be: Backend>(
    comm: &dyn Communicator<Buf = Be::Buf>,
    backend: &Be,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    params: &ParallelParams,
) -> Result<(Gradients, Stats)> {
    let plan = ParallelPlan::new(comm, backend, params, &Dims::of(q, k, v)?, q.dtype())?;
    plan.backward_tensors(q, k, v, o, lse, d_o)
}

impl<Be: Backend> ParallelPlan<'_, Be> {
    /// This rank's part of the forward on the backend's buffers: `q` `[b, n, h_q, d_qk]`, `k`
    /// `[b, n, h_kv, d_qk]` and `v` `[b, n, h_kv, d_v]` of the planned shard, in the planned dtype (as the backend
    /// stores it, [`Buffers::storage`]). Returns `o` in the input dtype and the context of
    /// the backward. Collective over the plan's communicator; no handshake, no split, no
    /// host transfer; K/V travel in the input dtype, partial outputs merge in f32.
    /// Statistics of the call: [`ParallelPlan::last_stats`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the buffers are not the planned shard; communication
    /// and backend errors.
    pub fn forward(&self, q: &Be::Buf, k: &Be::Buf, v: &Be::Buf) -> Result<(Be::Buf, SavedForward<Be::Buf>)> {
        self.forward_sinks(q, k, v, self.sinks.clone())
    }

    /// [`ParallelPlan::forward`] with this call's attention sinks: `sinks` `[h_q]` f32 (the
    /// backend's buffer) in place of the plan's — what a training loop whose sinks are
    /// parameters passes every step (the plan's own values, fixed when it was built, serve
    /// calls without). The backward ([`ParallelPlan::backward`]) returns their gradient. Not
    /// collective beyond the forward itself.
    ///
    /// # Errors
    /// [`Error::Parallel`] when the plan was built without sinks (its parameters say whether
    /// the layer has them, so that every rank agrees); [`Error::ShapeMismatch`] or a dtype
    /// error for `sinks` that are not `[h_q]` f32; as [`ParallelPlan::forward`].
    pub fn forward_with_sinks(
        &self,
        q: &Be::Buf,
        k: &Be::Buf,
        v: &Be::Buf,
        sinks: &Be::Buf,
    ) -> Result<(Be::Buf, SavedForward<Be::Buf>)> {
        if self.sinks.is_none() {
            return Err(Error::Parallel(
                "the plan was built without attention sinks: give its AttentionParams `sinks` (any h_q values) so \
                 that every rank plans them"
                    .into(),
            ));
        }
        self.check_buf("sinks", sinks, self.dims.h_q, DType::F32)?;
        let call = self.plan_sinks(sinks.clone())?;
        self.forward_sinks(q, k, v, Some(call))
    }

    fn forward_sinks(
        &self,
        q: &Be::Buf,
        k: &Be::Buf,
        v: &Be::Buf,
        sinks: Option<plan::PlanSinks<Be::Buf>>,
    ) -> Result<(Be::Buf, SavedForward<Be::Buf>)> {
        self.measured(|stats| {
            let dims = self.dims;
            self.check_buf("q", q, dims.b * dims.s_q * dims.h_q * dims.d_qk, self.dtype)?;
            self.check_buf("k", k, dims.b * dims.s_k * dims.h_kv * dims.d_qk, self.dtype)?;
            self.check_buf("v", v, dims.b * dims.s_k * dims.h_kv * dims.d_v, self.dtype)?;
            let x = self.local(q, k, v, sinks);
            let (o, lse) = run_forward(self, &x, stats)?;
            let sinks = x.sinks.map(|s| s.all);
            let saved = SavedForward { q: x.q, k: x.k, v: x.v, o: o.clone(), lse, sinks };
            Ok((o, saved))
        })
    }

    /// This rank's part of the backward on the backend's buffers, from the context its
    /// [`ParallelPlan::forward`] returned and `d_o` (`[b, n, h_q, d_v]`, input dtype):
    /// `dq`, `dk`, `dv` in the input dtype, and with sinks their gradient over this rank's
    /// rows (`dsinks`, [`ParallelPlan::sinks_gradient`]). Collective; no handshake, no split,
    /// no host transfer.
    ///
    /// # Errors
    /// As [`ParallelPlan::forward`], for `d_o` and the saved buffers; [`Error::Parallel`] for
    /// a context whose sinks disagree with the plan's (one with, the other without).
    pub fn backward(&self, saved: &SavedForward<Be::Buf>, d_o: &Be::Buf) -> Result<GradientBufs<Be::Buf>> {
        self.backward_as(saved, d_o, SinksGradient::Compute)
    }

    /// [`ParallelPlan::backward`], with the sinks' gradient computed or left to the caller
    /// (the candle operation's sinks side computes it itself).
    pub(crate) fn backward_as(
        &self,
        saved: &SavedForward<Be::Buf>,
        d_o: &Be::Buf,
        sinks_gradient: SinksGradient,
    ) -> Result<GradientBufs<Be::Buf>> {
        self.measured(|stats| {
            let dims = self.dims;
            let (q_rows, kv_rows) = (dims.b * dims.s_q * dims.h_q, dims.b * dims.s_k * dims.h_kv);
            self.check_buf("d_o", d_o, q_rows * dims.d_v, self.dtype)?;
            self.check_buf("saved q", &saved.q, q_rows * dims.d_qk, self.dtype)?;
            self.check_buf("saved k", &saved.k, kv_rows * dims.d_qk, self.dtype)?;
            self.check_buf("saved v", &saved.v, kv_rows * dims.d_v, self.dtype)?;
            self.check_buf("saved o", &saved.o, q_rows * dims.d_v, self.dtype)?;
            self.check_buf("saved lse", &saved.lse, dims.b * dims.h_q * dims.s_q, DType::F32)?;
            if saved.sinks.is_some() != self.sinks.is_some() {
                return Err(Error::Parallel(format!(
                    "the saved forward {} sinks, the plan {}",
                    if saved.sinks.is_some() { "has" } else { "has no" },
                    if self.sinks.is_some() { "has" } else { "has none" }
                )));
            }
            let x = self.local(&saved.q, &saved.k, &saved.v, None);
            let (dq, dk, dv) = run_backward(self, &x, &saved.o, &saved.lse, d_o, stats)?;
            let dsinks = match sinks_gradient {
                SinksGradient::Compute => self.sinks_gradient(saved, d_o)?,
                SinksGradient::Skip => None,
            };
            Ok(GradientBufs { dq, dk, dv, dsinks })
        })
    }

    /// The attention sinks' gradient over this rank's rows (`[h_q]` f32, the backend's
    /// buffer) from a forward's context and `d_o`: `dσ_h = −Σ_i e^{σ_h − lse_i} · D_i`, `D =
    /// rowsum(dO∘O)` — what [`ParallelPlan::backward`] returns as `dsinks`, alone (a framework
    /// whose sinks are their own operation takes it here). `None` when the forward had no
    /// sinks. Not collective.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for `d_o` or a context of another shape; backend errors.
    pub fn sinks_gradient(&self, saved: &SavedForward<Be::Buf>, d_o: &Be::Buf) -> Result<Option<Be::Buf>> {
        let Some(sinks) = &saved.sinks else { return Ok(None) };
        let dims = self.dims;
        let q_rows = dims.b * dims.s_q * dims.h_q;
        self.check_buf("saved sinks", sinks, dims.h_q, DType::F32)?;
        self.check_buf("saved o", &saved.o, q_rows * dims.d_v, self.dtype)?;
        self.check_buf("saved lse", &saved.lse, dims.b * dims.h_q * dims.s_q, DType::F32)?;
        self.check_buf("d_o", d_o, q_rows * dims.d_v, self.dtype)?;
        self.sinks_grad(&saved.o, &saved.lse, d_o, sinks).map(Some)
    }

    /// The forward on host tensors (this rank's shard): uploaded to the backend's buffers,
    /// [`ParallelPlan::forward`], `o` (input dtype) and `lse` (f32) downloaded.
    ///
    /// # Errors
    /// As [`ParallelPlan::forward`].
    pub fn forward_tensors(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(ForwardOutput, Stats)> {
        self.check_call(q, k, v)?;
        let up = |t: &Tensor| self.upload_tensor(t);
        let (o, saved) = self.forward(&up(q)?, &up(k)?, &up(v)?)?;
        let dims = self.dims;
        // Only the LSE is kept: `o` is then this call's alone and becomes the tensor uncopied.
        let SavedForward { lse, .. } = saved;
        let out = ForwardOutput {
            o: self.take_tensor(o, dims.o_shape(), q.dtype())?,
            lse: self.take_tensor(lse, dims.lse_shape(), DType::F32)?,
        };
        Ok((out, self.last_stats()))
    }

    /// The backward on host tensors (this rank's shard, its `o` and `lse` as
    /// [`ParallelPlan::forward_tensors`] returned them, its `d_o`).
    ///
    /// # Errors
    /// As [`ParallelPlan::backward`]; [`Error::ShapeMismatch`] for `o`, `lse` or `d_o` of
    /// another shape.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_tensors(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Gradients, Stats)> {
        self.check_call(q, k, v)?;
        self.dims.expect_backward_inputs(q, o, lse, d_o)?;
        let up = |t: &Tensor| self.upload_tensor(t);
        let sinks = self.sinks.as_ref().map(|s| s.all.clone());
        let saved = SavedForward { q: up(q)?, k: up(k)?, v: up(v)?, o: up(o)?, lse: up(lse)?, sinks };
        let g = self.backward(&saved, &up(d_o)?)?;
        let dims = self.dims;
        let grads = Gradients {
            dq: self.take_tensor(g.dq, dims.q_shape(), q.dtype())?,
            dk: self.take_tensor(g.dk, dims.k_shape(), q.dtype())?,
            dv: self.take_tensor(g.dv, dims.v_shape(), q.dtype())?,
            dsinks: g.dsinks.map(|x| self.take_tensor(x, vec![dims.h_q], DType::F32)).transpose()?,
        };
        Ok((grads, self.last_stats()))
    }

    /// The statistics of the plan's last forward or backward on this rank.
    pub fn last_stats(&self) -> Stats {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A host tensor (this rank's shard) in the plan backend's buffers: what
    /// [`ParallelPlan::forward`] takes.
    ///
    /// # Errors
    /// Allocation or transfer errors.
    pub fn upload_tensor(&self, t: &Tensor) -> Result<Be::Buf> {
        self.backend.upload(&HostBuf::from_tensor(t))
    }

    /// A buffer of the plan's backend as a host tensor of `shape` in `dtype` (rounded to it
    /// when the backend holds the values wider).
    ///
    /// # Errors
    /// Transfer errors; [`Error::DataLength`] when `shape` does not hold the buffer.
    pub fn download_tensor(&self, b: &Be::Buf, shape: Vec<usize>, dtype: DType) -> Result<Tensor> {
        self.backend.download(b)?.converted(dtype).into_tensor(shape)
    }

    /// As [`ParallelPlan::download_tensor`], consuming the buffer: a host buffer no one else
    /// holds becomes the tensor without a copy.
    fn take_tensor(&self, b: Be::Buf, shape: Vec<usize>, dtype: DType) -> Result<Tensor> {
        let host = self.backend.download(&b)?;
        drop(b);
        host.into_converted(dtype).into_tensor(shape)
    }

    fn local(
        &self,
        q: &Be::Buf,
        k: &Be::Buf,
        v: &Be::Buf,
        sinks: Option<plan::PlanSinks<Be::Buf>>,
    ) -> LocalData<Be::Buf> {
        let d = self.dims;
        let (q, k, v) = (q.clone(), k.clone(), v.clone());
        LocalData { b: d.b, h_q: d.h_q, h_kv: d.h_kv, d_qk: d.d_qk, d_v: d.d_v, q, k, v, sinks }
    }

    /// Checks one buffer of a call against the plan: its length and element type.
    fn check_buf(&self, name: &str, x: &Be::Buf, len: usize, dtype: DType) -> Result<()> {
        let elem = self.backend.storage(dtype);
        if x.elements() != len || x.elem() != elem {
            return Err(Error::ShapeMismatch(format!(
                "{name}: {} {} values, the plan (rank {}, {:?}) takes {len} {elem}",
                x.elements(),
                x.elem(),
                self.comm.rank(),
                self.dims
            )));
        }
        Ok(())
    }

    /// Runs one call with fresh statistics, then records its bytes sent and wall time as the
    /// plan's last statistics.
    fn measured<T>(&self, call: impl FnOnce(&mut Stats) -> Result<T>) -> Result<T> {
        let start = std::time::Instant::now();
        let mut stats = Stats { hops: 1, chosen: self.resolved.chosen().cloned(), ..Default::default() };
        let sent0 = self.comm.bytes_sent();
        let out = call(&mut stats)?;
        stats.bytes_sent = self.comm.bytes_sent() - sent0;
        stats.total = start.elapsed();
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        Ok(out)
    }
}

/// What a strategy requires and how it places tokens, in the strategy's own file; the
/// defaults fit a strategy with no Ulysses groups over the layout's positions.
trait Rules {
    /// Whether the plan splits the communicator into the Ulysses mesh for it.
    const USES_MESH: bool = false;

    /// The smallest world size (and Ulysses degree, where the strategy takes one) that runs
    /// every path of the strategy: uneven shares of the sequence, more than one hop or group
    /// where it has them. [`Strategy::check_world`]; the conformance check runs each
    /// strategy with it on every backend.
    const CHECK_WORLD: (usize, Option<usize>);

    /// The strategy's own constraints on the world size, heads and layout.
    ///
    /// # Errors
    /// [`Error::Parallel`] naming the constraint that fails.
    fn validate(_params: &ParallelParams, _world: usize, _h_q: usize) -> Result<()> {
        Ok(())
    }

    /// The Ulysses degree the strategy runs with (1: none).
    ///
    /// # Errors
    /// As [`Driver::validate`].
    fn ulysses_degree(_params: &ParallelParams, _world: usize, _h_q: usize) -> Result<usize> {
        Ok(1)
    }

    /// Global positions of the tokens every rank holds (of a resolved `params`), indexed by
    /// rank: the layout's.
    ///
    /// # Errors
    /// As [`Layout::positions_for`].
    fn positions(params: &ParallelParams, world: usize, _ulysses: usize) -> Result<Vec<Positions>> {
        params.layout().positions_for(&params.attention, params.seq_len, world)
    }
}

/// A strategy's forward and backward over a plan, written once in the strategy's own file
/// (`ring.rs`, `allgather.rs`, `ulysses.rs`) against the [`Backend`] and [`Communicator`]
/// seams. Outputs are in the input dtype, the LSE in f32.
trait Driver {
    /// This rank's `(o, lse)`.
    fn forward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf)>;

    /// This rank's `(dq, dk, dv)` from its forward's `o` and `lse` and its `d_o`.
    fn backward<Be: Backend>(
        plan: &ParallelPlan<'_, Be>,
        x: &LocalData<Be::Buf>,
        o: &Be::Buf,
        lse: &Be::Buf,
        d_o: &Be::Buf,
        stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf, Be::Buf)>;
}

fn run_forward<Be: Backend>(
    plan: &ParallelPlan<'_, Be>,
    x: &LocalData<Be::Buf>,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf)> {
    with_driver!(plan.resolved.params().strategy, D => D::forward(plan, x, stats))
}

fn run_backward<Be: Backend>(
    plan: &ParallelPlan<'_, Be>,
    x: &LocalData<Be::Buf>,
    o: &Be::Buf,
    lse: &Be::Buf,
    d_o: &Be::Buf,
    stats: &mut Stats,
) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
    with_driver!(plan.resolved.params().strategy, D => D::backward(plan, x, o, lse, d_o, stats))
}

/// Gathers every rank's part of the results to rank `root`, which reassembles them in the
/// original token order of `resolved` (the plan's [`ParallelPlan::resolved`]):
/// what a multi-process run does before rank `root` writes the output file. Returns the
/// whole results on `root` and `None` elsewhere. The parts travel as `buffers`' buffers
/// (host vectors, or device buffers for device communicators). Collective; `grads` must be
/// given on every rank or on none.
///
/// # Errors
/// Communication errors; [`Error::ShapeMismatch`] when a part does not fit the layout.
pub fn gather_results<Bu: Buffers>(
    comm: &dyn Communicator<Buf = Bu::Buf>,
    buffers: &Bu,
    forward: &ForwardOutput,
    grads: Option<&Gradients>,
    resolved: &ResolvedParams,
    root: usize,
) -> Result<Option<(ForwardOutput, Option<Gradients>)>> {
    let (world, rank) = (comm.size(), comm.rank());
    if root >= world {
        return Err(Error::InvalidArgument(format!("gather: root {root} out of range for {world} ranks")));
    }
    if resolved.world() != world {
        return Err(Error::InvalidArgument(format!(
            "gather: the plan is for {} ranks, the communicator has {world}",
            resolved.world()
        )));
    }
    let pos = resolved.all_positions();
    let mut tensors = vec![&forward.o, &forward.lse];
    if let Some(g) = grads {
        tensors.extend([&g.dq, &g.dk, &g.dv]);
        // (The sinks' gradient, [h_q] on every rank, is summed.)
        tensors.extend(g.dsinks.as_ref());
    }
    const DSINKS: usize = 5;
    // Part shapes of rank r: rows [b, n_r, h, d]; the LSE [b, h, n_r]; dsinks [h_q].
    let shape_of = |i: usize, t: &Tensor, r: usize| -> Vec<usize> {
        let mut sh = t.shape().to_vec();
        if i != DSINKS {
            sh[if i == 1 { 2 } else { 1 }] = pos[r].len();
        }
        sh
    };
    let tag = comm.next_collective_tag();
    if rank != root {
        let sends = tensors
            .iter()
            .map(|t| Ok(SendOp { to: root, tag, data: buffers.upload(&HostBuf::from_tensor(t))? }))
            .collect::<Result<Vec<_>>>()?;
        for s in comm.post(Vec::new(), sends)?.sends {
            s.wait()?;
        }
        return Ok(None);
    }
    // Every part's receive, tensor by tensor and rank by rank (each sender's order).
    let mut recv_ops = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        for r in (0..world).filter(|&r| r != rank) {
            let len = shape_of(i, t, r).iter().product();
            recv_ops.push(RecvOp { from: r, tag, len, elem: buffers.storage(t.dtype()) });
        }
    }
    let mut recvs = comm.post(recv_ops, Vec::new())?.recvs.into_iter();
    let mut whole = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let mut parts = Vec::with_capacity(world);
        for r in 0..world {
            if r == rank {
                parts.push((*t).clone());
                continue;
            }
            let sh = shape_of(i, t, r);
            let data =
                recvs.next().ok_or_else(|| Error::InvalidArgument("gather: a receive missing".into()))?.wait()?;
            parts.push(buffers.download(&data)?.converted(t.dtype()).into_tensor(sh)?);
        }
        whole.push(match i {
            1 => Layout::unshard_lse_rows(&parts, pos)?,
            DSINKS => crate::merge::sum_dsinks(parts.iter().map(Some))?
                .ok_or_else(|| Error::InvalidArgument("gather: no sinks gradient".into()))?,
            _ => Layout::unshard_rows(&parts, pos)?,
        });
    }
    let mut it = whole.into_iter();
    let (o, lse) = (it.next(), it.next());
    let (Some(o), Some(lse)) = (o, lse) else {
        return Err(Error::InvalidArgument("gather: missing outputs".into()));
    };
    let grads = match (it.next(), it.next(), it.next()) {
        (Some(dq), Some(dk), Some(dv)) => Some(Gradients { dq, dk, dv, dsinks: it.next() }),
        _ => None,
    };
    Ok(Some((ForwardOutput { o, lse }, grads)))
}

/// Full-sequence results of an in-process run.
#[derive(Debug, Clone)]
pub struct ProcessRun {
    /// Forward outputs in the original token order.
    pub forward: ForwardOutput,
    /// Gradients in the original token order, when `d_o` was given.
    pub gradients: Option<Gradients>,
    /// Per-rank statistics (forward, backward).
    pub stats: Vec<(Stats, Option<Stats>)>,
}

/// Shards full tensors by the strategy's layout over `world` in-process ranks, runs the
/// forward (and the backward when `d_o` is given) and gathers the results in the original
/// token order: what `ringattn run --strategy ... --world N` does.
///
/// # Errors
/// The first error of any rank (every rank fails with an error when one does).
#[allow(clippy::too_many_arguments)]
pub fn run_in_process<Be: Backend>(
    world: usize,
    options: LocalOptions,
    backend: &Be,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &ParallelParams,
) -> Result<ProcessRun> {
    let dims = Dims::of(q, k, v)?;
    if dims.s_q != dims.s_k {
        return Err(Error::Parallel(format!(
            "sequence parallelism splits one sequence: q has {} tokens and k has {}",
            dims.s_q, dims.s_k
        )));
    }
    let resolved = params.resolve_for(world, &dims, q.dtype())?;
    let results = spmd::<Be::Buf, _>(world, options, |comm| {
        let shard = |t: &Tensor| resolved.shard(t, comm.rank());
        let (qs, ks, vs) = (shard(q)?, shard(k)?, shard(v)?);
        let plan = ParallelPlan::new(comm, backend, &resolved, &Dims::of(&qs, &ks, &vs)?, qs.dtype())?;
        let (f, fs) = plan.forward_tensors(&qs, &ks, &vs)?;
        let g = match d_o {
            Some(t) => Some(plan.backward_tensors(&qs, &ks, &vs, &f.o, &f.lse, &shard(t)?)?),
            None => None,
        };
        Ok((f, fs, g))
    });
    assemble(&resolved, d_o.is_some(), collect_ranks(results)?)
}

/// Every rank's result, or the first error — preferring a root cause over the peers'
/// "rank N failed" echoes.
pub(crate) fn collect_ranks<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let mut first_err = None;
    let mut parts = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Ok(x) => parts.push(x),
            Err(e) => {
                if first_err.is_none() || matches!(first_err, Some(Error::PeerFailed { .. })) {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(parts),
    }
}

/// One rank's results: forward output and statistics, and the backward's when run.
pub(crate) type RankRun = (ForwardOutput, Stats, Option<(Gradients, Stats)>);

/// The ranks' parts (indexed by rank) reassembled in the original token order.
pub(crate) fn assemble(p: &ResolvedParams, with_grads: bool, parts: Vec<RankRun>) -> Result<ProcessRun> {
    let o: Vec<&Tensor> = parts.iter().map(|x| &x.0.o).collect();
    let lse: Vec<&Tensor> = parts.iter().map(|x| &x.0.lse).collect();
    let forward = ForwardOutput { o: p.unshard(&o)?, lse: p.unshard_lse(&lse)? };
    let gradients = match parts.iter().map(|x| x.2.as_ref().map(|g| &g.0)).collect::<Option<Vec<_>>>() {
        Some(gs) if with_grads => {
            let pick = |f: &dyn Fn(&Gradients) -> &Tensor| p.unshard(&gs.iter().map(|g| f(g)).collect::<Vec<_>>());
            let dsinks = crate::merge::sum_dsinks(gs.iter().map(|g| g.dsinks.as_ref()))?;
            Some(Gradients { dq: pick(&|g| &g.dq)?, dk: pick(&|g| &g.dk)?, dv: pick(&|g| &g.dv)?, dsinks })
        }
        _ => None,
    };
    let stats = parts.into_iter().map(|x| (x.1, x.2.map(|g| g.1))).collect();
    Ok(ProcessRun { forward, gradients, stats })
}

/// The share of the communication a run hid behind compute, from its time (`run`), the time
/// with communication made instant (`compute_only`) and the time with compute skipped
/// (`comm_only`): `1 − (run − compute_only) / comm_only`, clamped to `[0, 1]`; 1 when there
/// is no communication. The one definition the library, the CLI and the GPU measurements use.
///
/// ```
/// use ringattn::parallel::hidden_share;
/// assert_eq!(hidden_share(10.0, 8.0, 4.0), 0.5); // 2 of the 4 communication seconds showed
/// assert_eq!(hidden_share(8.0, 8.0, 4.0), 1.0);
/// assert_eq!(hidden_share(13.0, 8.0, 4.0), 0.0);
/// ```
pub fn hidden_share(run: f64, compute_only: f64, comm_only: f64) -> f64 {
    if comm_only > 0.0 {
        (1.0 - (run - compute_only) / comm_only).clamp(0.0, 1.0)
    } else {
        1.0
    }
}

/// How much of the communication a schedule hides behind compute, from three runs of it:
/// as is (`run`), with communication made instant (`compute_only`) and with compute skipped
/// ([`NullBackend`], `comm_only`); times are the slowest rank's.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Overlap {
    /// Seconds of the real run.
    pub run: f64,
    /// Seconds with instant communication.
    pub compute_only: f64,
    /// Seconds with compute skipped.
    pub comm_only: f64,
    /// `1 − (run − compute_only) / comm_only`, clamped to `[0, 1]`.
    pub hidden: f64,
}

/// Measures the forward's (or, when `d_o` is given, the backward's) communication overlap
/// over `world` in-process ranks with `options` (whose link model should be set).
///
/// # Errors
/// As [`run_in_process`].
#[allow(clippy::too_many_arguments)]
pub fn measure_overlap<Be: Backend<Buf = HostBuf>>(
    world: usize,
    options: LocalOptions,
    backend: &Be,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: Option<&Tensor>,
    params: &ParallelParams,
) -> Result<Overlap> {
    fn slowest<B: Backend>(
        world: usize,
        options: LocalOptions,
        be: &B,
        run: (&Tensor, &Tensor, &Tensor, Option<&Tensor>, &ParallelParams),
    ) -> Result<f64> {
        let (q, k, v, d_o, params) = run;
        let r = run_in_process(world, options, be, q, k, v, d_o, params)?;
        Ok(r.stats
            .iter()
            .map(|(f, b)| match (d_o, b) {
                (Some(_), Some(b)) => b.total.as_secs_f64(),
                _ => f.total.as_secs_f64(),
            })
            .fold(0.0, f64::max))
    }
    let args = (q, k, v, d_o, params);
    let run = slowest(world, options, backend, args)?;
    let compute_only = slowest(world, LocalOptions { link: None, ..options }, backend, args)?;
    let comm_only = slowest(world, options, &NullBackend, args)?;
    Ok(Overlap { run, compute_only, comm_only, hidden: hidden_share(run, compute_only, comm_only) })
}
