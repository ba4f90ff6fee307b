//! The resolved plan of a sequence-parallel layer: every default resolved in one place
//! ([`ParallelParams::resolve`] → [`ResolvedParams`]: layout, sequence length, Ulysses
//! degree, every rank's positions), then, collectively, one handshake and the Ulysses/USP
//! sub-communicators ([`ParallelPlan::new`]); its [`ParallelPlan::forward`] and
//! [`ParallelPlan::backward`] then run without either, layer after layer, step after step.
//!
//! Positions, sharding and reassembly come only from a [`ResolvedParams`], so a rank cannot
//! shard its tokens by one Ulysses degree while the drivers compute with another.

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use super::ulysses::Mesh;
use super::{Rules, Stats, Strategy};
use crate::comm::{all_gather, Communicator, Payload};
use crate::parallel::{Backend, ParallelParams};
use crate::{DType, Dims, Error, HostBuf, Layout, Positions, Result, Tensor};

/// [`ParallelParams`] with every default resolved for a world size, a query-head count and a
/// sequence length, validated: the layout is set, `seq_len` is the global length, and the
/// Ulysses degree is set for `Usp` (and is the world size for `Ulysses`). Positions, shards
/// and reassembly of every rank come from here.
///
/// ```
/// use ringattn::parallel::{ParallelParams, Strategy};
/// use ringattn::{AttentionParams, Mask};
/// let params = ParallelParams { strategy: Strategy::Usp, attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let r = params.resolve(4, 4, 64)?; // 4 ranks, 4 query heads, 64 tokens
/// assert_eq!(r.ulysses_degree(), 4);   // the largest divisor of the world that divides h_q
/// assert_eq!((0..4).map(|rank| r.positions(rank).len()).sum::<usize>(), 64);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedParams {
    params: ParallelParams,
    world: usize,
    ulysses: usize,
    positions: Vec<Positions>,
    /// What [`Strategy::Auto`] chose, when the parameters asked for it.
    chosen: Option<super::Chosen>,
}

impl ParallelParams {
    /// Resolves every default for `world` ranks, `h_q` query heads and a global sequence of
    /// `seq_len` tokens (used when `self.seq_len` is 0; when both are set they must agree),
    /// and validates the result.
    ///
    /// # Errors
    /// [`Error::Parallel`] naming the constraint that fails (as [`ParallelParams::validate`],
    /// or two different sequence lengths).
    pub fn resolve(&self, world: usize, h_q: usize, seq_len: usize) -> Result<ResolvedParams> {
        if self.strategy == Strategy::Auto {
            return Err(Error::Parallel(
                "strategy auto chooses from the batch's whole shape and dtype: resolve it with \
                 ParallelParams::resolve_for(world, &dims, dtype)"
                    .into(),
            ));
        }
        self.validate(world, h_q)?;
        let mut p = self.clone();
        p.seq_len = match (self.seq_len, seq_len) {
            (0, s) | (s, 0) => s,
            (a, b) if a == b => a,
            (a, b) => {
                return Err(Error::Parallel(format!("the sequence has {b} tokens, but seq_len says {a}")));
            }
        };
        p.layout = Some(self.layout());
        let ulysses = with_rules!(p.strategy, R => R::ulysses_degree(&p, world, h_q))?;
        if p.strategy == Strategy::Usp {
            p.ulysses_degree = Some(ulysses);
        }
        let positions = with_rules!(p.strategy, R => R::positions(&p, world, ulysses))?;
        Ok(ResolvedParams { params: p, world, ulysses, positions, chosen: None })
    }

    /// [`ParallelParams::resolve`] for a batch of shape `dims` (the whole batch: `s_q = s_k` =
    /// its tokens; heads and head dims as the call's) in `dtype`: the same for every strategy
    /// but [`Strategy::Auto`], which chooses here (the cost model over the batch's documents,
    /// [`super::auto::choose`], with [`ParallelParams::auto`]'s cluster over `world` ranks)
    /// the strategy, layout and Ulysses degree to run — a pure function of its inputs, the
    /// same on every rank — and resolves that; [`ResolvedParams::chosen`] then says what was
    /// chosen and the predicted time.
    ///
    /// ```
    /// use ringattn::parallel::{ParallelParams, Strategy};
    /// use ringattn::{AttentionParams, DType, Dims, Documents, Mask};
    ///
    /// let docs = Documents::new(vec![3000, 200, 700, 100])?;
    /// let attention = AttentionParams { mask: Mask::Causal, documents: Some(docs), ..Default::default() };
    /// let params = ParallelParams { strategy: Strategy::Auto, attention, ..Default::default() };
    /// let dims = Dims { b: 1, s_q: 4000, s_k: 4000, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 };
    /// let r = params.resolve_for(4, &dims, DType::BF16)?;
    /// assert_ne!(r.params().strategy, Strategy::Auto); // what runs
    /// let chosen = r.chosen().expect("auto chose");
    /// assert_eq!(chosen.strategy, r.params().strategy.name());
    /// assert!(chosen.predicted_s > 0.0 && chosen.predicted_s <= chosen.worst_predicted_s);
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`ParallelParams::resolve`]; under `Auto` also [`super::auto::choose`]'s (no
    /// documents, a window mask, `s_q ≠ s_k`, no placement that runs), and [`Error::Parallel`]
    /// for a layout or Ulysses degree given beside it (what it chooses) or a `seq_len` other
    /// than `dims.s_q`.
    pub fn resolve_for(&self, world: usize, dims: &Dims, dtype: DType) -> Result<ResolvedParams> {
        if self.strategy != Strategy::Auto {
            return self.resolve(world, dims.h_q, dims.s_q);
        }
        if world == 0 {
            return Err(Error::Parallel("the world size must be at least 1".into()));
        }
        // What auto chooses is not also given (it would be dropped, or overrule the choice).
        if let Some(layout) = self.layout {
            return Err(Error::Parallel(format!(
                "strategy auto chooses the layout per batch; it was also given as {layout:?} (leave it unset, or \
                 choose the strategy)"
            )));
        }
        if let Some(u) = self.ulysses_degree {
            return Err(Error::Parallel(format!(
                "strategy auto chooses the Ulysses degree per batch; it was also given as {u} (leave it unset, or \
                 choose the strategy)"
            )));
        }
        if self.seq_len != 0 && self.seq_len != dims.s_q {
            return Err(Error::Parallel(format!(
                "the batch has {} tokens, but seq_len says {}",
                dims.s_q, self.seq_len
            )));
        }
        let mut cluster = self.auto.cluster.clone();
        cluster.gpus = world;
        cluster.gpus_per_node = cluster.gpus_per_node.clamp(1, world);
        let pick = super::auto::choose(&self.attention, dims, dtype, self.auto.passes, &cluster)?;
        let worst = pick.ranking.choices.iter().map(|c| c.time_s).fold(pick.predicted.time_s, f64::max);
        let run = ParallelParams { seq_len: self.seq_len, auto: self.auto.clone(), ..pick.params };
        let mut resolved = run.resolve(world, dims.h_q, dims.s_q)?;
        resolved.chosen = Some(super::Chosen {
            strategy: run.strategy.name().to_string(),
            layout: crate::plan::layout_name(run.layout()),
            ulysses_degree: resolved.ulysses,
            predicted_s: pick.predicted.time_s,
            worst_predicted_s: worst,
        });
        Ok(resolved)
    }
}

impl ResolvedParams {
    /// The parameters with every default resolved.
    pub fn params(&self) -> &ParallelParams {
        &self.params
    }

    /// What [`Strategy::Auto`] chose (strategy, layout, Ulysses degree, the model's predicted
    /// time), when the parameters asked for it ([`ParallelParams::resolve_for`]).
    pub fn chosen(&self) -> Option<&super::Chosen> {
        self.chosen.as_ref()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The Ulysses degree: the world size under `Ulysses`, the resolved degree under `Usp`, 1
    /// otherwise.
    pub fn ulysses_degree(&self) -> usize {
        self.ulysses
    }

    /// The layout in force.
    pub fn layout(&self) -> Layout {
        self.params.layout()
    }

    /// Global positions of the tokens `rank` holds (`rank < world`).
    pub fn positions(&self, rank: usize) -> &Positions {
        &self.positions[rank]
    }

    /// Every rank's positions, indexed by rank.
    pub fn all_positions(&self) -> &[Positions] {
        &self.positions
    }

    /// The rows of `rank` of a full `[b, s, h, d]` tensor.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `t` does not hold the whole sequence.
    pub fn shard(&self, t: &Tensor, rank: usize) -> Result<Tensor> {
        if t.shape().get(1) != Some(&self.params.seq_len) {
            return Err(Error::ShapeMismatch(format!(
                "sharding a tensor of shape {:?}: the plan's sequence has {} tokens",
                t.shape(),
                self.params.seq_len
            )));
        }
        Layout::shard_rows(t, &self.positions[rank])
    }

    /// Reassembles per-rank `[b, n_r, h, d]` parts (indexed by rank) into the full sequence.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the parts do not fit.
    pub fn unshard<T: std::borrow::Borrow<Tensor>>(&self, parts: &[T]) -> Result<Tensor> {
        self.check_parts(parts.len())?;
        Layout::unshard_rows(parts, &self.positions)
    }

    /// Reassembles per-rank LSE parts `[b, h, n_r]` into `[b, h, s]`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the parts do not fit.
    pub fn unshard_lse<T: std::borrow::Borrow<Tensor>>(&self, parts: &[T]) -> Result<Tensor> {
        self.check_parts(parts.len())?;
        Layout::unshard_lse_rows(parts, &self.positions)
    }

    fn check_parts(&self, n: usize) -> Result<()> {
        if n != self.world {
            return Err(Error::ShapeMismatch(format!("{n} parts for a plan of {} ranks", self.world)));
        }
        Ok(())
    }
}

/// Bytes of the text part of a handshake record (longer texts are cut; the hash covers the
/// whole text).
const HANDSHAKE_TEXT: usize = 1024;
/// Bytes of a handshake record: status, s_q, s_k, hash, text length, text.
const HANDSHAKE_RECORD: usize = 1 + 8 + 8 + 8 + 2 + HANDSHAKE_TEXT;

/// FNV-1a, 64 bits: stable across processes and builds (ranks of an MPI job hash alike).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// One rank's handshake record, as bytes.
struct Record {
    ok: bool,
    s_q: u64,
    s_k: u64,
    hash: u64,
    text: String,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HANDSHAKE_RECORD);
        out.push(u8::from(self.ok));
        out.extend_from_slice(&self.s_q.to_le_bytes());
        out.extend_from_slice(&self.s_k.to_le_bytes());
        out.extend_from_slice(&self.hash.to_le_bytes());
        let mut text: Vec<u8> = self.text.as_bytes().iter().copied().take(HANDSHAKE_TEXT).collect();
        // Cut on a character boundary.
        while std::str::from_utf8(&text).is_err() {
            text.pop();
        }
        out.extend_from_slice(&(text.len() as u16).to_le_bytes());
        out.extend_from_slice(&text);
        out.resize(HANDSHAKE_RECORD, 0);
        out
    }

    fn decode(b: &[u8]) -> Result<Record> {
        if b.len() != HANDSHAKE_RECORD {
            return Err(Error::Handshake(format!("a handshake record of {} bytes", b.len())));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let n = usize::from(u16::from_le_bytes([b[25], b[26]])).min(HANDSHAKE_TEXT);
        Ok(Record {
            ok: b[0] == 1,
            s_q: u64_at(1),
            s_k: u64_at(9),
            hash: u64_at(17),
            text: String::from_utf8_lossy(&b[27..27 + n]).into_owned(),
        })
    }
}

/// A sequence-parallel layer, planned once for this rank of `comm` and reused for every
/// call: the communicator and backend it runs on (borrowed, [`ParallelPlan::new`], or shared,
/// [`ParallelPlan::new_shared`]), the resolved parameters and every rank's positions
/// ([`ResolvedParams`]), this rank's shard shape and dtype, the ring's hop count, and for
/// `Ulysses`/`Usp` the Ulysses group and the ring across groups (split once). Creating it is
/// collective (one handshake); its [`ParallelPlan::forward`] and [`ParallelPlan::backward`]
/// (on the backend's buffers; [`crate::ring_attention`] is the same call) and their Tensor
/// wrappers issue no handshake and no split.
///
/// ```
/// use ringattn::comm::{spmd, Communicator, LocalOptions};
/// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan, Strategy};
/// use ringattn::{cpu, random::randn, verify, AttentionParams, DType, Dims, Mask};
///
/// let (s, world) = (100, 4);
/// let q = randn(vec![1, s, 4, 16], 1, DType::F32);
/// let kv = randn(vec![1, s, 2, 16], 2, DType::F32);
/// let attention = AttentionParams { mask: Mask::Causal, ..Default::default() };
/// let params = ParallelParams { strategy: Strategy::Usp, attention: attention.clone(), ..Default::default() };
/// let resolved = params.resolve(world, 4, s)?;
/// let parts = spmd(world, LocalOptions::default(), |comm| {
///     let rank = comm.rank();
///     let (qs, kvs) = (resolved.shard(&q, rank)?, resolved.shard(&kv, rank)?);
///     let backend = CpuBackend::default();
///     let plan = ParallelPlan::new(comm, &backend, &params, &Dims::of(&qs, &kvs, &kvs)?, DType::F32)?;
///     let (out, _) = plan.forward_tensors(&qs, &kvs, &kvs)?; // layer 1
///     let (out, _) = plan.forward_tensors(&qs, &kvs, &kvs)?; // layer 2: no setup
///     Ok(out.o)
/// });
/// let o = resolved.unshard(&parts.into_iter().collect::<Result<Vec<_>, _>>()?)?;
/// let single = cpu::forward(&q, &kv, &kv, &attention)?;
/// let single64: Vec<f64> = single.o.as_f32().iter().map(|&x| x as f64).collect();
/// assert!(verify::rel_err(&o.to_f32_vec(), &single64) < 1e-5);
/// # Ok::<(), ringattn::Error>(())
/// ```
pub struct ParallelPlan<'c, Be: Backend> {
    pub(super) comm: Held<'c, dyn Communicator<Buf = Be::Buf> + 'c>,
    pub(super) backend: Held<'c, Be>,
    pub(super) resolved: ResolvedParams,
    pub(super) dims: Dims,
    pub(super) dtype: DType,
    pub(super) mesh: Option<Mesh<Be::Buf>>,
    /// Hops of the ring (of the ring across Ulysses groups for Ulysses/USP), from the
    /// positions, once.
    pub(super) hops: usize,
    /// The ring's zero-redundant schedule for this rank, when it moves fewer bytes than the
    /// pass-along ring ([`super::direct::DirectSchedule::better`]), from the positions, once;
    /// under the all-gather, the rows each rank gathers from each other (only those it sees).
    pub(super) direct: Option<super::direct::DirectSchedule>,
    pub(super) last: Mutex<Stats>,
    /// The attention sinks in the backend's buffers (f32), when the parameters have them.
    pub(super) sinks: Option<PlanSinks<Be::Buf>>,
}

/// A plan's attention sinks, uploaded once: every query head's logits (the ranks' results of
/// the sequence-sharded strategies and the sinks' gradient), and, under Ulysses, this rank's
/// heads' (its head-sharded result), with their ids.
#[derive(Clone)]
pub(super) struct PlanSinks<B> {
    pub(super) all: B,
    listed: Option<(Vec<usize>, B)>,
}

/// What a plan runs on: borrowed for the plan's lifetime ([`ParallelPlan::new`]), or shared
/// through an `Arc` ([`ParallelPlan::new_shared`]: a `'static` plan a training framework's
/// operation can own).
pub(super) enum Held<'c, T: ?Sized> {
    Borrowed(&'c T),
    Shared(Arc<T>),
}

impl<T: ?Sized> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Held::Borrowed(t) => t,
            Held::Shared(t) => t,
        }
    }
}

impl<Be: Backend> std::fmt::Debug for ParallelPlan<'_, Be> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelPlan")
            .field("rank", &self.comm.rank())
            .field("resolved", &self.resolved)
            .field("dims", &self.dims)
            .field("dtype", &self.dtype)
            .finish()
    }
}

/// What a plan is made from: the parameters, resolved by the plan (the global length is
/// `seq_len`, or the sum of the ranks' token counts when 0), or parameters resolved already
/// ([`ParallelParams::resolve`]) — the same [`ResolvedParams`] the caller shards its tensors
/// with, so that the shards and the plan cannot disagree (the recommended form).
#[derive(Debug, Clone, Copy)]
pub enum PlanSource<'a> {
    /// Parameters the plan resolves for the communicator's world, the shard's `h_q` and the
    /// global length.
    Params(&'a ParallelParams),
    /// Parameters resolved by the caller; their world size must be the communicator's.
    Resolved(&'a ResolvedParams),
}

impl<'a> From<&'a ParallelParams> for PlanSource<'a> {
    fn from(p: &'a ParallelParams) -> Self {
        PlanSource::Params(p)
    }
}

impl<'a> From<&'a ResolvedParams> for PlanSource<'a> {
    fn from(r: &'a ResolvedParams) -> Self {
        PlanSource::Resolved(r)
    }
}

impl PlanSource<'_> {
    fn params(&self) -> &ParallelParams {
        match self {
            PlanSource::Params(p) => p,
            PlanSource::Resolved(r) => r.params(),
        }
    }
}

/// FNV-1a of every rank's positions, in rank order (the handshake compares it).
fn positions_hash(resolved: &ResolvedParams) -> u64 {
    let mut bytes = Vec::new();
    for (r, pos) in resolved.all_positions().iter().enumerate() {
        bytes.extend_from_slice(&(r as u64).to_le_bytes());
        for p in pos.iter() {
            bytes.extend_from_slice(&(p as u64).to_le_bytes());
        }
    }
    fnv1a(&bytes)
}

impl<Be: Backend> ParallelPlan<'static, Be> {
    /// [`ParallelPlan::new`] on a communicator and backend the plan shares ownership of: a
    /// `'static` plan that an operation of a training framework (which must be `'static`)
    /// can hold, e.g. in an `Arc`. Collective, as `new`.
    ///
    /// # Errors
    /// As [`ParallelPlan::new`].
    pub fn new_shared<'p>(
        comm: Arc<dyn Communicator<Buf = Be::Buf>>,
        backend: Arc<Be>,
        source: impl Into<PlanSource<'p>>,
        dims: &Dims,
        dtype: DType,
    ) -> Result<Self> {
        Self::build(Held::Shared(comm), Held::Shared(backend), source.into(), dims, dtype)
    }
}

impl<'c, Be: Backend> ParallelPlan<'c, Be> {
    /// Plans for this rank of `comm`, whose shard has the local shape `dims` (`s_q = s_k` =
    /// its token count) in `dtype`, from `source`: a [`ResolvedParams`] (the one the caller
    /// shards with: recommended) or [`ParallelParams`] resolved here. Collective: one
    /// handshake compares a hash of every rank's whole configuration (its `Debug` text:
    /// every field, derived, none listed by hand) and of every rank's resolved positions,
    /// and checks every rank's token count against its positions, so that all ranks succeed
    /// or all fail with the same error. `Ulysses` and `Usp` split `comm` here, once.
    ///
    /// # Errors
    /// [`Error::Handshake`] (on every rank) when ranks disagree, a rank holds the wrong number
    /// of tokens, a [`ResolvedParams`] was resolved for another world size, or one rank's
    /// configuration is invalid (naming the rank and its error); communication errors.
    pub fn new<'p>(
        comm: &'c dyn Communicator<Buf = Be::Buf>,
        backend: &'c Be,
        source: impl Into<PlanSource<'p>>,
        dims: &Dims,
        dtype: DType,
    ) -> Result<Self> {
        Self::build(Held::Borrowed(comm), Held::Borrowed(backend), source.into(), dims, dtype)
    }

    fn build(
        comm: Held<'c, dyn Communicator<Buf = Be::Buf> + 'c>,
        backend: Held<'c, Be>,
        source: PlanSource<'_>,
        dims: &Dims,
        dtype: DType,
    ) -> Result<Self> {
        let world = comm.size();
        let params = source.params();
        // The whole batch's shape for a global length (what `Strategy::Auto` chooses from).
        let whole = |seq: usize| Dims { s_q: seq, s_k: seq, ..*dims };
        let spec = crate::attention::ScoreSpec::of(&params.attention, dims);
        let local: Result<String> = backend.supports(dims, dtype, &spec).and_then(|_| {
            params.validate(world, dims.h_q)?;
            params.attention.check_heads(dims.h_q)?;
            // Every rank's positions where they are known before the token counts are.
            let resolved = match source {
                PlanSource::Resolved(r) if r.world() != world => {
                    return Err(Error::Parallel(format!(
                        "the parameters were resolved for {} ranks, the communicator has {world}",
                        r.world()
                    )))
                }
                PlanSource::Resolved(r) => Some(r.clone()),
                PlanSource::Params(p) if p.seq_len > 0 => Some(p.resolve_for(world, &whole(p.seq_len), dtype)?),
                PlanSource::Params(_) => None,
            };
            let positions = resolved.as_ref().map_or(0, positions_hash);
            // Everything but this rank's token counts, which the record carries apart.
            Ok(format!(
                "{params:?} b={} h_q={} h_kv={} d_qk={} d_v={} {dtype} {} positions#{positions:016x}",
                dims.b,
                dims.h_q,
                dims.h_kv,
                dims.d_qk,
                dims.d_v,
                std::any::type_name::<Be>()
            ))
        });
        let mine = match &local {
            Ok(text) => Record {
                ok: true,
                s_q: dims.s_q as u64,
                s_k: dims.s_k as u64,
                hash: fnv1a(text.as_bytes()),
                text: text.clone(),
            },
            Err(e) => Record { ok: false, s_q: 0, s_k: 0, hash: 0, text: e.to_string() },
        };
        let gathered = all_gather(&*comm, backend.upload(&HostBuf::bytes(mine.encode()))?)?;
        let mut records = Vec::with_capacity(world);
        for buf in &gathered {
            records.push(Record::decode(&backend.download(buf)?.to_control_bytes())?);
        }
        // Every rank reaches the same verdict from the same records.
        if let Some((i, r)) = records.iter().enumerate().find(|(_, r)| !r.ok) {
            return Err(Error::Handshake(format!("rank {i}: {}", r.text)));
        }
        if let Some((i, r)) = records.iter().enumerate().find(|(_, r)| r.hash != records[0].hash) {
            return Err(Error::Handshake(format!("rank {i} has `{}` but rank 0 has `{}`", r.text, records[0].text)));
        }
        // The global length: as given, else the sum of the ranks' token counts (then checked
        // rank by rank against the positions, naming the rank that holds the wrong count).
        let total = records.iter().map(|r| r.s_q).sum::<u64>() as usize;
        let resolved = match source {
            PlanSource::Resolved(r) => r.clone(),
            PlanSource::Params(p) => {
                let seq_len = if p.seq_len > 0 { p.seq_len } else { total };
                p.resolve_for(world, &whole(seq_len), dtype).map_err(|e| Error::Handshake(e.to_string()))?
            }
        };
        for (i, r) in records.iter().enumerate() {
            let want = resolved.positions(i).len() as u64;
            if r.s_q != want || r.s_k != want {
                return Err(Error::Handshake(format!(
                    "rank {i} holds {} query and {} key tokens; the {:?} layout of {} tokens over {world} ranks gives \
                     it {want}",
                    r.s_q,
                    r.s_k,
                    resolved.layout(),
                    resolved.params().seq_len
                )));
            }
        }
        let uses_mesh = with_rules!(resolved.params().strategy, R => R::USES_MESH);
        let mesh = if uses_mesh { Some(Mesh::new(&*comm, &resolved, dims)?) } else { None };
        let ring_pos = mesh.as_ref().map_or(resolved.all_positions(), |m| &m.group_pos);
        let hops = super::ring::hops_needed(&resolved.params().attention, ring_pos)?;
        let ring_rank = mesh.as_ref().map_or(comm.rank(), Mesh::ring_rank);
        // The ring's schedule; the all-gather's subset of rows, when it moves fewer bytes than
        // gathering every block to every rank (a ring of `world` hops moves as much).
        let direct = match resolved.params().strategy {
            Strategy::AllGather => super::direct::DirectSchedule::better(
                &resolved.params().attention,
                ring_pos,
                ring_rank,
                ring_pos.len(),
            )?,
            _ => super::direct::DirectSchedule::better(&resolved.params().attention, ring_pos, ring_rank, hops)?,
        };
        let sinks = match &resolved.params().attention.sinks {
            Some(all) => Some(backend.upload(&HostBuf::from(all.clone()))?),
            None => None,
        };
        let mut plan = ParallelPlan {
            comm,
            backend,
            resolved,
            dims: *dims,
            dtype,
            mesh,
            hops,
            direct,
            last: Mutex::new(Stats::default()),
            sinks: None,
        };
        plan.sinks = sinks.map(|all| plan.plan_sinks(all)).transpose()?;
        Ok(plan)
    }

    /// The sinks of a call from every head's logits `all` (`[h_q]` f32): with this rank's
    /// heads' under Ulysses (selected on the backend, in its order).
    pub(super) fn plan_sinks(&self, all: Be::Buf) -> Result<PlanSinks<Be::Buf>> {
        let listed = match &self.mesh {
            Some(m) => {
                let heads = m.query_heads().to_vec();
                let shape = crate::parallel::BufShape { b: 1, n: 1, h: self.dims.h_q, d: 1 };
                let mine = self.backend.select_heads(&all, shape, &heads)?;
                Some((heads, mine))
            }
            None => None,
        };
        Ok(PlanSinks { all, listed })
    }

    /// The resolved parameters and every rank's positions.
    pub fn resolved(&self) -> &ResolvedParams {
        &self.resolved
    }

    /// This rank's global token positions.
    pub fn positions(&self) -> &Positions {
        self.resolved.positions(self.comm.rank())
    }

    /// This rank's shard shape.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// The communicator the plan runs on.
    pub fn comm(&self) -> &dyn Communicator<Buf = Be::Buf> {
        &*self.comm
    }

    /// The backend the plan computes on.
    pub fn backend(&self) -> &Be {
        &self.backend
    }

    /// The dtype of the inputs and outputs.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The forward's finish step, where every driver hands its merged result over: this
    /// rank's f32 `o` `[b, n, heads, d_v]` and `lse` `[b, heads, n]` over every key, for the
    /// query heads `heads` (their global ids: all of them, or a Ulysses rank's), returned as
    /// the output in the input dtype and the LSE. The one place that sees each query row's
    /// final (o, lse) with its heads' ids, once: what acts once per row after the merge
    /// (attention sinks, output transforms) belongs here, not in the drivers' hops.
    /// Attention sinks merge here, once per row: each row of head `h` joins a value-less
    /// partial of LSE `σ_h` ([`Buffers::merge_sinks`]), before the output's rounding.
    pub(super) fn finish_forward(
        &self,
        (mut o, mut lse): (Be::Buf, Be::Buf),
        heads: QueryHeads<'_>,
        sinks: Option<&PlanSinks<Be::Buf>>,
    ) -> Result<(Be::Buf, Be::Buf)> {
        if let Some(sinks) = sinks {
            let (count, logits) = match heads {
                QueryHeads::All(h) => (h, &sinks.all),
                QueryHeads::Listed(ids) => match &sinks.listed {
                    Some((mine, buf)) if mine == ids => (ids.len(), buf),
                    _ => {
                        return Err(Error::Parallel(format!(
                            "the finish step got query heads {ids:?}, not the plan's for this rank"
                        )))
                    }
                },
            };
            let (b, d_v) = (self.dims.b, self.dims.d_v);
            let rows = lse.elements() / (b * count).max(1);
            self.backend.merge_sinks(&mut o, &mut lse, logits, [b, rows, count, d_v])?;
        }
        Ok((self.in_dtype(o)?, lse))
    }

    /// The sinks' gradient over this rank's rows (`[h_q]` f32), from its final `o` and `lse`
    /// (the sinks included) and `d_o`, in the sequence-sharded layout every strategy hands
    /// back: `dσ_h = −Σ_i e^{σ_h − lse_i} · D_i`, `D = rowsum(dO∘O)`, for the call's `sinks`.
    pub(super) fn sinks_grad(&self, o: &Be::Buf, lse: &Be::Buf, d_o: &Be::Buf, sinks: &Be::Buf) -> Result<Be::Buf> {
        let dims = self.dims;
        let delta = self.backend.softmax_grad_rowsum(dims, o, d_o)?;
        self.backend.sink_grad(lse, &delta, sinks, [dims.b, dims.h_q, dims.s_q])
    }

    /// A driver's f32 result in the input dtype (as the backend stores it); the f32 buffer
    /// goes back to the backend ([`Backend::recycle`]: kept unless the result shares it).
    pub(super) fn in_dtype(&self, x: Be::Buf) -> Result<Be::Buf> {
        let out = self.backend.convert(&x, self.dtype)?;
        self.backend.recycle(x);
        Ok(out)
    }

    /// A driver's f32 gradients in the input dtype.
    pub(super) fn grads_in_dtype(
        &self,
        (dq, dk, dv): (Be::Buf, Be::Buf, Be::Buf),
    ) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
        Ok((self.in_dtype(dq)?, self.in_dtype(dk)?, self.in_dtype(dv)?))
    }

    /// Checks the position ids the caller gave this rank's tokens (`ids[i]`: the global
    /// position of its `i`-th token, as it sharded them — the ids a model looks up rotary or
    /// learned positions with) against the plan's layout. Shards cut otherwise than the plan
    /// (contiguous chunks under the zigzag layout, parameters resolved for another head
    /// count) have the right shapes and the wrong tokens: this is where they are caught.
    /// Collective (one all-gather of a byte per rank), so every rank gets the verdict; once
    /// per batch is enough (the layers share the positions).
    ///
    /// # Errors
    /// [`Error::Positions`] on every rank when any rank's ids differ from its positions: the
    /// rank at fault names its first differing token, the others name the ranks at fault;
    /// communication errors.
    ///
    /// ```
    /// use ringattn::comm::{spmd, Communicator, LocalOptions};
    /// use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan};
    /// use ringattn::{AttentionParams, DType, Dims, Mask};
    /// let params = ParallelParams { attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
    /// let resolved = params.resolve(2, 2, 16)?;
    /// let verdicts = spmd(2, LocalOptions::default(), |comm| {
    ///     let backend = CpuBackend::default();
    ///     let dims = Dims { b: 1, s_q: 8, s_k: 8, h_q: 2, h_kv: 2, d_qk: 8, d_v: 8 };
    ///     let plan = ParallelPlan::new(comm, &backend, &resolved, &dims, DType::F32)?;
    ///     let mine: Vec<u64> = resolved.positions(comm.rank()).iter().map(|p| p as u64).collect();
    ///     plan.check_positions(&mine)?; // the layout's own shard
    ///     let narrowed: Vec<u64> = (8 * comm.rank() as u64..8 * comm.rank() as u64 + 8).collect();
    ///     Ok(plan.check_positions(&narrowed).is_err()) // contiguous chunks under zigzag
    /// });
    /// assert!(verdicts.into_iter().all(|v| v.unwrap()));
    /// # Ok::<(), ringattn::Error>(())
    /// ```
    pub fn check_positions(&self, ids: &[u64]) -> Result<()> {
        let mine = self.position_mismatch(ids);
        let flag = self.backend.upload(&HostBuf::bytes(vec![u8::from(mine.is_err())]))?;
        let gathered = all_gather(&*self.comm, flag)?;
        let mut wrong = Vec::new();
        for (r, b) in gathered.iter().enumerate() {
            if self.backend.download(b)?.to_control_bytes().first() == Some(&1) {
                wrong.push(r);
            }
        }
        mine?;
        if wrong.is_empty() {
            return Ok(());
        }
        Err(Error::Positions(format!(
            "rank(s) {wrong:?} of the group hold tokens at other positions than the {:?} layout's (this rank's \
             match; their errors name the token)",
            self.resolved.layout()
        )))
    }

    /// [`ParallelPlan::check_positions`] on this rank alone (not collective): the error that
    /// names the first token whose id differs from the plan's position, if any.
    pub(crate) fn position_mismatch(&self, ids: &[u64]) -> Result<()> {
        let want = self.positions();
        if ids.len() != want.len() {
            Err(Error::Positions(format!(
                "rank {}: {} position ids for a shard of {} tokens",
                self.comm.rank(),
                ids.len(),
                want.len()
            )))
        } else {
            match want.iter().zip(ids).position(|(w, &g)| w as u64 != g) {
                None => Ok(()),
                Some(i) => Err(Error::Positions(format!(
                    "rank {}: token {i} of this shard is at position {}, the plan ({:?} layout) puts position {} \
                     there (shard the tensors with the plan's layout: ContextParallel::shard, ResolvedParams::shard \
                     or ringattn::candle::shard_like)",
                    self.comm.rank(),
                    ids[i],
                    self.resolved.layout(),
                    want.iter().nth(i).unwrap_or(0)
                ))),
            }
        }
    }

    /// Checks that a call's tensors are the shard the plan was made for.
    pub(super) fn check_call(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let dims = Dims::of(q, k, v)?;
        if dims != self.dims || q.dtype() != self.dtype {
            return Err(Error::ShapeMismatch(format!(
                "the plan was made for {:?} in {}, the call has {dims:?} in {}",
                self.dims,
                self.dtype,
                q.dtype()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let r = Record { ok: true, s_q: 1 << 40, s_k: 7, hash: u64::MAX - 3, text: "é".repeat(600) };
        let b = r.encode();
        assert_eq!(b.len(), HANDSHAKE_RECORD);
        let back = Record::decode(&b).unwrap();
        assert_eq!((back.ok, back.s_q, back.s_k, back.hash), (true, 1 << 40, 7, u64::MAX - 3));
        assert!(back.text.len() <= HANDSHAKE_TEXT && back.text.chars().all(|c| c == 'é'));
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
    }

    #[test]
    fn resolution_fills_every_default() {
        let p = ParallelParams { strategy: Strategy::Usp, ..Default::default() };
        let r = p.resolve(8, 4, 1000).unwrap();
        assert_eq!((r.ulysses_degree(), r.params().ulysses_degree, r.params().seq_len), (4, Some(4), 1000));
        assert_eq!(r.params().layout, Some(Layout::Contiguous));
        assert_eq!(r.all_positions().iter().map(|p| p.len()).sum::<usize>(), 1000);
        let e = ParallelParams { seq_len: 10, ..p.clone() }.resolve(8, 4, 12).unwrap_err();
        assert!(e.to_string().contains("12 tokens"), "{e}");
        assert_eq!(
            ParallelParams { strategy: Strategy::Ulysses, ..Default::default() }
                .resolve(4, 8, 9)
                .unwrap()
                .ulysses_degree(),
            4
        );
    }
}

/// The query heads a driver's result holds, by their global ids (what the forward's finish
/// step, [`ParallelPlan::finish_forward`], applies per-head options with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QueryHeads<'a> {
    /// Every query head, `0..h_q` (ring, all-gather: sequence-sharded results).
    All(usize),
    /// These heads, in this order (a Ulysses rank's head-sharded result).
    Listed(&'a [usize]),
}
