//! [`ContextParallel`]: a context-parallel group as a training loop holds it — the one source
//! of shards, position ids and plans, the attention call that takes its shapes and dtype from
//! the tensors, and the group's sums (gradients, metrics, the replica check).

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor, Var};

use super::{all_reduce_gradients_with, all_reduce_sum, check_replicas, dtype_of, replicas_identical, wrap};
use super::{host_ids, ring_attention, shard, unshard, CandleBuf, SharedPlan};
use crate::comm::{all_gather, Communicator};
use crate::parallel::{fnv1a, Backend, ParallelParams, ParallelPlan, ResolvedParams};
use crate::{DType, Dims, Error, HostBuf};

/// Options of a [`ContextParallel`] group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOptions {
    /// Every attention call must bring the position ids of its tokens
    /// ([`ContextParallel::attention_at`]); [`ContextParallel::attention`] is refused. On by
    /// default in debug builds (`cfg!(debug_assertions)`).
    pub require_positions: bool,
    /// Plans kept, one per distinct (global length, batch, heads, head dim, dtype); the
    /// least recently used is dropped beyond this. At least 1.
    pub max_plans: usize,
    /// How long any wait of this rank's attention calls and sums may block before it fails
    /// with [`Error::Timeout`] ([`Communicator::set_deadline`] on the group's communicator;
    /// the Ulysses/USP sub-groups of plans made afterwards inherit it). `None` keeps the
    /// communicator's.
    pub deadline: Option<std::time::Duration>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions { require_positions: cfg!(debug_assertions), max_plans: 8, deadline: None }
    }
}

/// What identifies a plan: the global length and this call's shapes and dtype (identical on
/// every rank, from the call's metadata exchange).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PlanKey {
    seq_len: usize,
    b: usize,
    h_q: usize,
    h_kv: usize,
    d_qk: usize,
    d_v: usize,
    dtype: DType,
}

/// The sequence-parallel attention of one group of ranks for a candle training loop: made
/// once per rank (not collective) from the communicator, the backend, the parameters and the
/// layers' query-head count; then everything the loop needs goes through it, so that shards,
/// positions and plans cannot disagree:
///
/// - [`ContextParallel::shard`] / [`ContextParallel::unshard`] / [`ContextParallel::position_ids`]:
///   this rank's part of whole-sequence tensors, by the parameters resolved for their length;
/// - [`ContextParallel::attention_at`] (and [`ContextParallel::attention`] without position
///   ids): exact attention with autograd, its plan taken from the tensors — batch, token
///   count, heads, head dim and dtype — planned collectively on first use of a shape and kept
///   (a short last batch or a new length just works);
/// - [`ContextParallel::all_reduce_gradients`], [`ContextParallel::all_reduce_sum`],
///   [`ContextParallel::check_replicas`]: the group's sums, added on the backend.
///
/// Each attention call starts with one small exchange of every rank's call (shapes, dtype, a
/// hash of its position ids; ~100 bytes per rank) so that every rank picks the same plan and
/// a misuse on any rank — a `[b, h, s, d]` tensor, shards in another layout or of another
/// length — fails the call on every rank with an error naming the fix, never a wrong number.
///
/// Ranks as threads of one process ([`crate::comm::spmd_shared`]) set candle's CPU pool to
/// run inline (`CANDLE_NUM_THREADS=1`, unless set): the ranks share the cores instead of
/// queueing on candle's one process-wide pool.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use ringattn::candle::prelude::*;
///
/// let params = ParallelParams { attention: AttentionParams { mask: Mask::Causal, ..Default::default() }, ..Default::default() };
/// let x = Tensor::randn(0f32, 1.0, (2, 32, 4, 8), &Device::Cpu)?; // [b, s, h, d], the whole sequence
/// let runs = spmd_shared(2, LocalOptions::default(), |comm| {
///     let cp = ContextParallel::new(comm, CpuBackend::default(), params.clone(), 4)?;
///     let (mine, pos) = (cp.shard(&x, 1)?, cp.position_ids(32, &Device::Cpu)?);
///     let q = Var::from_tensor(&mine)?;
///     let o = cp.attention_at(q.as_tensor(), &mine, &mine, &pos)?; // [2, 16, 4, 8]
///     let grads = o.sum_all()?.backward()?;
///     let short = cp.shard(&x.narrow(1, 0, 20)?, 1)?; // a shorter sequence: planned on first use
///     cp.attention_at(&short, &short, &short, &cp.position_ids(20, &Device::Cpu)?)?;
///     Ok(grads.get(q.as_tensor()).map(|g| g.dims().to_vec()))
/// });
/// for r in runs {
///     assert_eq!(r?, Some(vec![2, 16, 4, 8]));
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ContextParallel<Be: Backend + 'static> {
    comm: Arc<dyn Communicator<Buf = Be::Buf>>,
    backend: Arc<Be>,
    params: ParallelParams,
    h_q: usize,
    options: GroupOptions,
    /// Resolved parameters by global length (least recently used first).
    resolved: Mutex<Vec<(usize, Arc<ResolvedParams>)>>,
    /// Plans by key (least recently used first).
    plans: Mutex<Vec<(PlanKey, SharedPlan<Be>)>>,
}

impl<Be: Backend + 'static> std::fmt::Debug for ContextParallel<Be> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.size())
            .field("params", &self.params)
            .field("h_q", &self.h_q)
            .field("options", &self.options)
            .finish()
    }
}

/// The value kept under `key` in `cache` (a least-recently-used list: a hit moves to the
/// end), or the one `make` gives, kept; beyond `max` entries the oldest is dropped. The same
/// calls leave the same cache on every rank.
fn recent<K: PartialEq, V: Clone>(
    cache: &mut Vec<(K, V)>,
    max: usize,
    key: K,
    make: impl FnOnce() -> crate::Result<V>,
) -> crate::Result<V> {
    if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
        let entry = cache.remove(i);
        let value = entry.1.clone();
        cache.push(entry);
        return Ok(value);
    }
    let value = make()?;
    cache.push((key, value.clone()));
    if cache.len() > max {
        cache.remove(0);
    }
    Ok(value)
}

/// Bytes of the text of a call record (an error message, cut).
const CALL_TEXT: usize = 256;
/// A call record: ok, b, n, h_q, h_kv, d_qk, d_v, dtype, has positions, positions hash, text
/// length, text.
const CALL_RECORD: usize = 1 + 9 * 8 + 2 + CALL_TEXT;

/// One rank's attention call as the others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CallRecord {
    /// The call passed this rank's own checks; otherwise `text` says why not.
    ok: bool,
    /// `[b, n, h_q, h_kv, d_qk, d_v]`.
    dims: [u64; 6],
    dtype: u64,
    /// Position ids given, and their hash.
    positions: Option<u64>,
    text: String,
}

impl CallRecord {
    fn refused(text: String) -> Self {
        CallRecord { ok: false, dims: [0; 6], dtype: 0, positions: None, text }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CALL_RECORD);
        out.push(u8::from(self.ok));
        for x in self.dims.iter().chain([&self.dtype, &u64::from(self.positions.is_some())]) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&self.positions.unwrap_or(0).to_le_bytes());
        let mut text: Vec<u8> = self.text.bytes().take(CALL_TEXT).collect();
        while std::str::from_utf8(&text).is_err() {
            text.pop();
        }
        out.extend_from_slice(&(text.len() as u16).to_le_bytes());
        out.extend_from_slice(&text);
        out.resize(CALL_RECORD, 0);
        out
    }

    fn decode(b: &[u8]) -> crate::Result<Self> {
        if b.len() != CALL_RECORD {
            return Err(Error::Handshake(format!("a call record of {} bytes", b.len())));
        }
        let at = |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().expect("8 bytes"));
        let n = usize::from(u16::from_le_bytes([b[73], b[74]])).min(CALL_TEXT);
        Ok(CallRecord {
            ok: b[0] == 1,
            dims: [at(0), at(1), at(2), at(3), at(4), at(5)],
            dtype: at(6),
            positions: (at(7) == 1).then(|| at(8)),
            text: String::from_utf8_lossy(&b[75..75 + n]).into_owned(),
        })
    }
}

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
    }
}

fn code_dtype(c: u64) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16].into_iter().find(|&d| dtype_code(d) == c)
}

/// FNV-1a of positions as little-endian u64s.
fn hash_positions(p: impl Iterator<Item = u64>) -> u64 {
    fnv1a(&p.flat_map(u64::to_le_bytes).collect::<Vec<u8>>())
}

/// `[b, n, h, d]` of a tensor named `name`, or a shape error that names the layout.
fn dims4(name: &str, t: &Tensor) -> crate::Result<[usize; 4]> {
    <[usize; 4]>::try_from(t.dims()).map_err(|_| {
        Error::ShapeMismatch(format!("`{name}` has shape {:?}; attention takes [b, s, h, d] tensors", t.dims()))
    })
}

impl<Be> ContextParallel<Be>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: CandleBuf,
{
    /// The group of this rank of `comm`, computing on `backend`, for attention layers with
    /// `h_q` query heads (the Ulysses degree, and hence the shards under `Usp`, depend on
    /// it). Not collective; validates `params` for the world size and `h_q`.
    ///
    /// # Errors
    /// [`Error::Parallel`] when `params` cannot run on this world size with `h_q` heads, and
    /// for [`crate::parallel::Strategy::Auto`]: the group shards by sequence length alone,
    /// before it sees a call's shape (resolve the choice per batch with
    /// [`ParallelParams::resolve_for`] and give the group what it chose).
    pub fn new(
        comm: Arc<dyn Communicator<Buf = Be::Buf>>,
        backend: Be,
        params: ParallelParams,
        h_q: usize,
    ) -> crate::Result<Self> {
        if params.strategy == crate::parallel::Strategy::Auto {
            return Err(Error::Parallel(
                "ContextParallel runs a fixed strategy: it shards by sequence length before it sees a call's shape; \
                 choose per batch with ParallelParams::resolve_for(world, &dims, dtype) and build the group with \
                 the parameters it resolved"
                    .into(),
            ));
        }
        params.validate(comm.size(), h_q)?;
        Ok(ContextParallel {
            comm,
            backend: Arc::new(backend),
            params,
            h_q,
            options: GroupOptions::default(),
            resolved: Mutex::new(Vec::new()),
            plans: Mutex::new(Vec::new()),
        })
    }

    /// The group with `options` (before its first attention call: plans made earlier keep
    /// the deadline they were made with).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `max_plans` 0 or a zero deadline, and a communicator
    /// whose deadline cannot change.
    pub fn with_options(mut self, options: GroupOptions) -> crate::Result<Self> {
        if options.max_plans == 0 {
            return Err(Error::InvalidArgument("GroupOptions::max_plans must be at least 1".into()));
        }
        if let Some(d) = options.deadline {
            self.comm.set_deadline(d)?;
        }
        self.options = options;
        Ok(self)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.comm.size()
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator<Buf = Be::Buf>> {
        &self.comm
    }

    /// The backend.
    pub fn backend(&self) -> &Be {
        &self.backend
    }

    /// The parameters resolved for a global sequence of `seq_len` tokens (kept: the last
    /// `max_plans` lengths).
    ///
    /// # Errors
    /// As [`ParallelParams::resolve`].
    pub fn resolved(&self, seq_len: usize) -> crate::Result<Arc<ResolvedParams>> {
        let mut cache = self.resolved.lock().unwrap_or_else(|e| e.into_inner());
        recent(&mut cache, self.options.max_plans, seq_len, || {
            Ok(Arc::new(self.params.resolve(self.world(), self.h_q, seq_len)?))
        })
    }

    /// This rank's part of a whole-sequence tensor: its rows along `dim` (1 for `[b, s, …]`
    /// activations, tokens and targets; 0 for `[s]` position ids), by the parameters
    /// resolved for that length. Differentiable.
    ///
    /// # Errors
    /// candle errors (a `dim` out of range); the resolution's.
    pub fn shard(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        let resolved = self.resolved(t.dim(dim)?).map_err(wrap)?;
        shard(&resolved, t, dim, self.rank())
    }

    /// The inverse of [`ContextParallel::shard`]: every rank's part (indexed by rank)
    /// reassembled in token order along `dim`.
    ///
    /// # Errors
    /// candle errors; parts that do not fit the layout.
    pub fn unshard(&self, parts: &[Tensor], dim: usize) -> candle_core::Result<Tensor> {
        let mut s = 0;
        for p in parts {
            s += p.dim(dim)?;
        }
        let resolved = self.resolved(s).map_err(wrap)?;
        unshard(&resolved, parts, dim)
    }

    /// This rank's position ids (`[n]` u32 on `device`) in a sequence of `seq_len` tokens:
    /// what rotary or learned position embeddings look up, and what
    /// [`ContextParallel::attention_at`] checks.
    ///
    /// # Errors
    /// The resolution's; candle errors.
    pub fn position_ids(&self, seq_len: usize, device: &Device) -> candle_core::Result<Tensor> {
        let ids = u32::try_from(seq_len)
            .map_err(|_| wrap(Error::InvalidArgument(format!("{seq_len} tokens: position ids are u32"))))?;
        self.shard(&Tensor::arange(0u32, ids, device)?, 0)
    }

    /// Exact attention of this rank's shard against the whole sequence, with autograd:
    /// `q` `[b, n, h_q, d_qk]`, `k` `[b, n, h_kv, d_qk]`, `v` `[b, n, h_kv, d_v]` (this rank's
    /// `n` tokens at the layout's positions) in f32, bf16 or f16; returns `o` `[b, n, h_q,
    /// d_v]`. `positions`
    /// (`[n]`, any integer dtype) are the position ids of the tokens; they are compared with
    /// the layout's. The plan comes from the tensors (the global length is the sum of every
    /// rank's `n`), made collectively on first use of a shape. Collective, forward and
    /// backward, like [`super::ring_attention`].
    ///
    /// # Errors
    /// On every rank when any rank's call is wrong: [`Error::ShapeMismatch`] (naming the
    /// `[b, h, s, d]` transpose when that is the mistake), [`Error::Positions`] (naming the
    /// first differing token and `shard`), [`Error::DtypeMismatch`], [`Error::Handshake`]
    /// (ranks whose calls disagree); communication errors. All wrapped in candle's error
    /// (`ringattn::Error::from` recovers them).
    pub fn attention_at(&self, q: &Tensor, k: &Tensor, v: &Tensor, positions: &Tensor) -> candle_core::Result<Tensor> {
        self.attend(q, k, v, Some(positions), None)
    }

    /// [`ContextParallel::attention_at`] without position ids: shapes, dtypes and every
    /// rank's token count are checked, the tokens' positions are not (a shard in another
    /// layout of the same length goes unnoticed). Refused when
    /// [`GroupOptions::require_positions`] is on (debug builds by default).
    ///
    /// # Errors
    /// As [`ContextParallel::attention_at`]; [`Error::Positions`] in the strict mode.
    pub fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        self.attend(q, k, v, None, None)
    }

    /// [`ContextParallel::attention_at`] with learnable attention sinks (`[h_q]` f32, e.g. a
    /// `Var`), as [`super::ring_attention_with_sinks`]: the group's parameters must have
    /// sinks (any values: the call's replace them); their gradient over this rank's rows
    /// joins the others' in [`ContextParallel::all_reduce_gradients`].
    ///
    /// # Errors
    /// As [`ContextParallel::attention_at`] and [`super::ring_attention_with_sinks`].
    pub fn attention_with_sinks_at(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: &Tensor,
        positions: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.attend(q, k, v, Some(positions), Some(sinks))
    }

    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        positions: Option<&Tensor>,
        sinks: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let checked = self.record(q, k, v, positions);
        let mine = match &checked {
            Ok((r, _)) => r.clone(),
            Err(e) => CallRecord::refused(super::find_error(e).map_or_else(|| e.to_string(), |ours| ours.to_string())),
        };
        let records = self.exchange(&mine).map_err(wrap)?;
        // This rank's own refusal, as it was (typed); the others learn it from the records.
        let (_, ids) = checked?;
        let plan = self.agree(&records).map_err(wrap)?;
        if let Some(ids) = ids {
            if records[self.rank()].positions.is_none_or(|h| h != self.expected_hash(&plan, self.rank())) {
                // This rank's own ids are wrong: name the first differing token.
                plan.position_mismatch(&ids).map_err(wrap)?;
                return Err(wrap(Error::Positions(format!(
                    "rank {}: the hash of the position ids differs from the layout's",
                    self.rank()
                ))));
            }
        }
        match sinks {
            Some(s) => super::ring_attention_with_sinks(&plan, q, k, v, s),
            None => ring_attention(&plan, q, k, v),
        }
    }

    /// This rank's call, checked locally, and its position ids (on the host).
    fn record(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        positions: Option<&Tensor>,
    ) -> candle_core::Result<(CallRecord, Option<Vec<u64>>)> {
        let checked = || -> candle_core::Result<(CallRecord, Option<Vec<u64>>)> {
            let [b, n, h_q, d] = dims4("q", q).map_err(wrap)?;
            let [kb, kn, h_kv, kd] = dims4("k", k).map_err(wrap)?;
            let [vb, vn, vh, d_v] = dims4("v", v).map_err(wrap)?;
            if h_q != self.h_q {
                let hint =
                    if n == self.h_q { "; it looks like [b, h, s, d]: transpose(1, 2) to [b, s, h, d]" } else { "" };
                return Err(wrap(Error::ShapeMismatch(format!(
                    "`q` has shape {:?}: the group was made for {} query heads in [b, s, h, d]{hint}",
                    q.dims(),
                    self.h_q
                ))));
            }
            if [kb, kn, kd] != [b, n, d] || [vb, vn, vh] != [b, n, h_kv] {
                let hint = if k.dims().len() == 4 && k.dim(1)? == h_kv && k.dim(2)? == n {
                    "; it looks like [b, h, s, d]: transpose(1, 2) to [b, s, h, d]"
                } else {
                    ""
                };
                return Err(wrap(Error::ShapeMismatch(format!(
                    "`q` {:?}, `k` {:?} and `v` {:?} must be [b, s, h_q, d_qk], [b, s, h_kv, d_qk], [b, s, h_kv, d_v]{hint}",
                    q.dims(),
                    k.dims(),
                    v.dims()
                ))));
            }
            let dtype = dtype_of(q.dtype())?;
            for (name, t) in [("k", k), ("v", v)] {
                if t.dtype() != q.dtype() {
                    return Err(wrap(Error::DtypeMismatch {
                        name: name.into(),
                        got: format!("{:?}", t.dtype()),
                        expected: format!("{:?}", q.dtype()),
                    }));
                }
            }
            let ids = match positions {
                None if self.options.require_positions => {
                    return Err(wrap(Error::Positions(
                        "this group requires the tokens' position ids (GroupOptions::require_positions, on in \
                         debug builds): call attention_at(q, k, v, &positions) with the ids from \
                         ContextParallel::position_ids"
                            .into(),
                    )))
                }
                None => None,
                Some(p) => {
                    if p.dims() != [n] {
                        return Err(wrap(Error::ShapeMismatch(format!(
                            "positions of shape {:?}, the shard holds [{n}] tokens",
                            p.dims()
                        ))));
                    }
                    Some(host_ids(p)?)
                }
            };
            let positions = ids.as_ref().map(|ids| hash_positions(ids.iter().copied()));
            let dims = [b, n, h_q, h_kv, d, d_v].map(|x| x as u64);
            Ok((CallRecord { ok: true, dims, dtype: dtype_code(dtype), positions, text: String::new() }, ids))
        };
        checked()
    }

    /// Every rank's call record (one all-gather).
    fn exchange(&self, mine: &CallRecord) -> crate::Result<Vec<CallRecord>> {
        let gathered = all_gather(&*self.comm, self.backend.upload(&HostBuf::bytes(mine.encode()))?)?;
        gathered.iter().map(|b| CallRecord::decode(&self.backend.download(b)?.to_control_bytes())).collect()
    }

    /// The verdict every rank reaches from the same records: the plan, or the same error.
    fn agree(&self, records: &[CallRecord]) -> crate::Result<SharedPlan<Be>> {
        let me = self.rank();
        if let Some((r, rec)) = records.iter().enumerate().find(|(_, r)| !r.ok) {
            return Err(Error::Parallel(format!("rank {r} refused its attention call: {}", rec.text)));
        }
        let first = &records[0];
        let same = |r: &CallRecord| {
            [r.dims[0], r.dims[2], r.dims[3], r.dims[4], r.dims[5], r.dtype]
                == [first.dims[0], first.dims[2], first.dims[3], first.dims[4], first.dims[5], first.dtype]
        };
        if let Some((r, rec)) = records.iter().enumerate().find(|(_, r)| !same(r)) {
            return Err(Error::Handshake(format!(
                "rank {r} calls attention with [b, n, h_q, h_kv, d_qk, d_v] = {:?} in {:?}, rank 0 with {:?} in {:?}",
                rec.dims,
                code_dtype(rec.dtype),
                first.dims,
                code_dtype(first.dtype)
            )));
        }
        let [b, _, h_q, h_kv, d_qk, d_v] = first.dims.map(|x| x as usize);
        let dtype = code_dtype(first.dtype).ok_or_else(|| Error::Handshake(format!("dtype code {}", first.dtype)))?;
        let seq_len = records.iter().map(|r| r.dims[1] as usize).sum();
        let key = PlanKey { seq_len, b, h_q, h_kv, d_qk, d_v, dtype };
        let plan = self.plan(key, records[me].dims[1] as usize)?;
        // Position ids: the same verdict everywhere; the rank at fault names its token.
        let wrong: Vec<usize> = records
            .iter()
            .enumerate()
            .filter(|(r, rec)| rec.positions.is_some_and(|h| h != self.expected_hash(&plan, *r)))
            .map(|(r, _)| r)
            .collect();
        if !wrong.is_empty() && !wrong.contains(&me) {
            return Err(Error::Positions(format!(
                "rank(s) {wrong:?} of the group hold tokens at other positions than the {:?} layout's (this rank's \
                 match; their errors name the token; shard with ContextParallel::shard)",
                plan.resolved().layout()
            )));
        }
        Ok(plan)
    }

    /// The hash of `rank`'s positions in `plan`.
    fn expected_hash(&self, plan: &SharedPlan<Be>, rank: usize) -> u64 {
        hash_positions(plan.resolved().positions(rank).iter().map(|p| p as u64))
    }

    /// The plan of `key` (this rank holding `n` tokens): kept, or made now (collectively:
    /// every rank misses together, the keys and the caches being the same everywhere).
    fn plan(&self, key: PlanKey, n: usize) -> crate::Result<SharedPlan<Be>> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        recent(&mut plans, self.options.max_plans, key, || {
            let resolved = self.resolved(key.seq_len)?;
            let dims = Dims { b: key.b, s_q: n, s_k: n, h_q: key.h_q, h_kv: key.h_kv, d_qk: key.d_qk, d_v: key.d_v };
            let backend = self.backend.clone();
            Ok(Arc::new(ParallelPlan::new_shared(self.comm.clone(), backend, &*resolved, &dims, key.dtype)?))
        })
    }

    /// The plans kept, least recently used first: (global length, this rank's shard dims).
    pub fn plans(&self) -> Vec<(usize, Dims)> {
        let plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.iter().map(|(k, p)| (k.seq_len, *p.dims())).collect()
    }

    /// [`super::all_reduce_gradients`] over the group, added on the backend.
    ///
    /// # Errors
    /// As [`super::all_reduce_gradients_with`].
    pub fn all_reduce_gradients(
        &self,
        vars: &[Var],
        grads: &mut candle_core::backprop::GradStore,
    ) -> candle_core::Result<()> {
        let add = |acc: &mut Be::Buf, x: &Be::Buf| self.backend.add_into(acc, x);
        all_reduce_gradients_with(&*self.comm, &add, vars, grads)
    }

    /// [`super::all_reduce_sum`] over the group (a loss or metric summed over the ranks).
    ///
    /// # Errors
    /// As [`super::all_reduce_sum`].
    pub fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let add = |acc: &mut Be::Buf, x: &Be::Buf| self.backend.add_into(acc, x);
        all_reduce_sum(&*self.comm, &add, t)
    }

    /// [`super::replicas_identical`] over the group.
    ///
    /// # Errors
    /// As [`super::replicas_identical`].
    pub fn replicas_identical(&self, vars: &[Var]) -> candle_core::Result<bool> {
        let add = |acc: &mut Be::Buf, x: &Be::Buf| self.backend.add_into(acc, x);
        replicas_identical(&*self.comm, &add, vars)
    }

    /// [`super::check_replicas`] over the group: an error on every rank when the replicas
    /// have drifted (call it every N steps).
    ///
    /// # Errors
    /// As [`super::check_replicas`].
    pub fn check_replicas(&self, vars: &[Var]) -> candle_core::Result<()> {
        let add = |acc: &mut Be::Buf, x: &Be::Buf| self.backend.add_into(acc, x);
        check_replicas(&*self.comm, &add, vars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_records_round_trip() {
        let r = CallRecord {
            ok: true,
            dims: [4, 128, 8, 2, 192, 128],
            dtype: 2,
            positions: Some(u64::MAX - 5),
            text: "é".repeat(200),
        };
        let back = CallRecord::decode(&r.encode()).unwrap();
        assert_eq!((back.ok, back.dims, back.dtype, back.positions), (true, r.dims, 2, r.positions));
        assert!(back.text.len() <= CALL_TEXT && back.text.chars().all(|c| c == 'é'));
        let none = CallRecord::refused("no".into());
        assert_eq!(CallRecord::decode(&none.encode()).unwrap(), none);
        assert_eq!(code_dtype(dtype_code(DType::F16)), Some(DType::F16));
        assert_ne!(hash_positions([0, 1].into_iter()), hash_positions([1, 0].into_iter()));
    }
}
