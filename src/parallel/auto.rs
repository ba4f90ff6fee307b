//! The per-batch choice of strategy, layout and Ulysses degree (what `--strategy auto` runs):
//! the cost model over the batch's documents ([`crate::plan::plan_batch`]) ranks every
//! strategy × layout from the tokens each rank would hold, and the fastest is resolved into
//! [`ParallelParams`]. A pure function of its inputs: every rank that asks with the same batch
//! gets the same choice, with no communication.

use super::{Backend, Driver, LocalData, ParallelParams, ParallelPlan, Rules, Stats};
use crate::plan::{plan_batch, BatchChoice, BatchPlan, ClusterSpec, JobSpec, Passes};
use crate::{AttentionParams, DType, Dims, Error, Mask, Positions, Result};

/// `Strategy::Auto`'s rules and driver before it is resolved: everything that would place
/// tokens or run refuses (resolution — [`ParallelParams::resolve_for`], or a plan — replaces
/// it with what the model chose, so no path runs it); its validation is the choice's own.
pub(crate) struct Unchosen;

fn unchosen<T>() -> Result<T> {
    Err(Error::Parallel(
        "strategy auto runs what it chooses per batch: resolve the parameters with \
         ParallelParams::resolve_for (or plan with them) first"
            .into(),
    ))
}

impl Rules for Unchosen {
    const CHECK_WORLD: (usize, Option<usize>) = (2, None);

    fn ulysses_degree(_params: &ParallelParams, _world: usize, _h_q: usize) -> Result<usize> {
        unchosen()
    }

    fn positions(_params: &ParallelParams, _world: usize, _ulysses: usize) -> Result<Vec<Positions>> {
        unchosen()
    }
}

impl Driver for Unchosen {
    fn forward<Be: Backend>(
        _plan: &ParallelPlan<'_, Be>,
        _x: &LocalData<Be::Buf>,
        _stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf)> {
        unchosen()
    }

    fn backward<Be: Backend>(
        _plan: &ParallelPlan<'_, Be>,
        _x: &LocalData<Be::Buf>,
        _o: &Be::Buf,
        _lse: &Be::Buf,
        _d_o: &Be::Buf,
        _stats: &mut Stats,
    ) -> Result<(Be::Buf, Be::Buf, Be::Buf)> {
        unchosen()
    }
}

/// What [`choose`] resolved: the parameters to run, the model's estimate of them, and the
/// whole ranking it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoChoice {
    /// The strategy, layout and Ulysses degree to run, with the caller's attention options.
    pub params: ParallelParams,
    /// The model's estimate of that choice (predicted time, imbalance, bytes).
    pub predicted: BatchChoice,
    /// Every strategy × layout the model weighed, fastest first.
    pub ranking: BatchPlan,
}

/// Chooses the strategy, layout and Ulysses degree for one batch of packed documents over
/// `cluster.gpus` ranks: `dims` is the whole batch's shape (`s_q = s_k` = its tokens; heads and
/// head dims as the call's), `dtype` the inputs' element type, `passes` what the step runs,
/// `attention` the call's options (causal or no mask, with the batch's documents; sinks,
/// soft-cap and scale pass through unchanged). The cluster's kernel rates and links decide
/// how compute is traded for bytes: calibrate them ([`crate::plan::Calibration`]) for the
/// machines that run the job.
///
/// ```
/// use ringattn::parallel::auto::choose;
/// use ringattn::plan::{ClusterSpec, Passes};
/// use ringattn::{AttentionParams, DType, Dims, Documents, Mask};
///
/// let docs = vec![6000, 300, 900, 1200, 500, 3100];
/// let s = docs.iter().sum();
/// let attention = AttentionParams { mask: Mask::Causal, documents: Some(Documents::new(docs)?), ..Default::default() };
/// let dims = Dims { b: 1, s_q: s, s_k: s, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 };
/// let cluster = ClusterSpec { gpus: 4, ..Default::default() };
/// let auto = choose(&attention, &dims, DType::BF16, Passes::Both, &cluster)?;
/// assert_eq!(auto.params.attention, attention);
/// assert_eq!(auto.ranking.best(), Some(&auto.predicted));
/// println!("{} {:?}: {:.3} ms", auto.params.strategy, auto.params.layout, auto.predicted.time_s * 1e3);
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// [`Error::Parallel`] when the batch has no documents, its mask is a window (the model
/// weighs causal or unmasked documents), `s_q ≠ s_k`, or no placement can run;
/// [`Error::Documents`] when the documents do not cover the batch; the model's errors for an
/// unusable cluster or shape.
pub fn choose(
    attention: &AttentionParams,
    dims: &Dims,
    dtype: DType,
    passes: Passes,
    cluster: &ClusterSpec,
) -> Result<AutoChoice> {
    let refuse = |why: String| Err(Error::Parallel(format!("strategy auto: {why}")));
    let Some(docs) = &attention.documents else {
        return refuse("chooses per batch of packed documents; this call has none (choose a strategy)".into());
    };
    let causal = match attention.mask {
        Mask::Causal => true,
        Mask::None => false,
        Mask::Window { .. } => {
            return refuse(format!("the cost model weighs causal or unmasked documents, not {:?}", attention.mask))
        }
    };
    if dims.s_q != dims.s_k {
        return refuse(format!("self-attention only: s_q = {} but s_k = {}", dims.s_q, dims.s_k));
    }
    let job = JobSpec {
        seq: dims.s_q,
        batch: dims.b,
        heads: dims.h_q,
        kv_heads: dims.h_kv,
        head_dim: dims.d_qk,
        head_dim_v: (dims.d_v != dims.d_qk).then_some(dims.d_v),
        dtype_bytes: dtype.size_of(),
        accum_bytes: 4,
        causal,
        passes,
        layers: 1,
    };
    let ranking = plan_batch(cluster, &job, &docs.lengths())?;
    let Some(best) = ranking.best().cloned() else {
        let why: Vec<&str> = ranking.rejected.iter().map(|r| r.reason.as_str()).take(2).collect();
        return refuse(format!("no placement over {} ranks can run: {}", cluster.gpus, why.join("; ")));
    };
    Ok(AutoChoice { params: best.params(attention), predicted: best, ranking })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::Strategy;
    use crate::random::{document_lengths, DocLengths};
    use crate::{Documents, Layout};

    fn batch(seed: u64, s: usize) -> AttentionParams {
        let docs = Documents::new(document_lengths(seed, s, &DocLengths::default())).unwrap();
        AttentionParams { mask: Mask::Causal, documents: Some(docs), ..Default::default() }
    }

    fn dims(s: usize) -> Dims {
        Dims { b: 1, s_q: s, s_k: s, h_q: 8, h_kv: 8, d_qk: 64, d_v: 64 }
    }

    #[test]
    fn the_choice_is_the_fastest_and_runs() {
        for seed in 0..3 {
            let a = batch(seed, 16384);
            let cluster = ClusterSpec { gpus: 4, ..Default::default() };
            let auto = choose(&a, &dims(16384), DType::BF16, Passes::Both, &cluster).unwrap();
            assert!(auto.ranking.choices.iter().all(|c| c.time_s >= auto.predicted.time_s));
            // The choice resolves into a runnable configuration: its positions cover the batch.
            let r = auto.params.resolve(4, 8, 16384).unwrap();
            let mut all: Vec<i64> = r.all_positions().iter().flat_map(|p| p.to_vec()).collect();
            all.sort_unstable();
            assert_eq!(all, (0..16384).collect::<Vec<_>>());
            // The same answer every time it is asked (every rank asks).
            assert_eq!(choose(&a, &dims(16384), DType::BF16, Passes::Both, &cluster).unwrap(), auto);
        }
    }

    #[test]
    fn imbalance_moves_the_choice_off_zigzag_where_compute_dominates() {
        // Slow kernels against fast links: the balanced layout's extra bytes cost nothing.
        let cluster = ClusterSpec { gpus: 4, fwd_tflops: 1.0, bwd_tflops: 1.0, ..Default::default() };
        let auto = choose(&batch(0, 32768), &dims(32768), DType::BF16, Passes::Both, &cluster).unwrap();
        let zigzag = auto.ranking.find(Strategy::Ring, Layout::Zigzag).unwrap();
        assert!(zigzag.imbalance > 1.3, "{}", zigzag.imbalance);
        assert!(auto.predicted.imbalance < 1.05, "{:?}", auto.predicted);
        assert!(auto.predicted.time_s * 1.2 < zigzag.time_s);
    }

    #[test]
    fn what_the_model_cannot_weigh_is_refused() {
        let cluster = ClusterSpec { gpus: 2, ..Default::default() };
        let plain = AttentionParams { mask: Mask::Causal, ..Default::default() };
        let e = choose(&plain, &dims(1024), DType::BF16, Passes::Both, &cluster).unwrap_err();
        assert!(e.to_string().contains("packed documents"), "{e}");
        let window = AttentionParams { mask: Mask::Window { left: Some(64), right: Some(0) }, ..batch(0, 1024) };
        let e = choose(&window, &dims(1024), DType::BF16, Passes::Both, &cluster).unwrap_err();
        assert!(e.to_string().contains("Window"), "{e}");
        let e = choose(&batch(0, 1024), &dims(2048), DType::BF16, Passes::Both, &cluster).unwrap_err();
        assert!(matches!(e, Error::Documents(_)), "{e}");
    }
}
