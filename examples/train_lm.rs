//! A tiny causal language model trained with candle, its attention replaced by ringattn's
//! sequence-parallel attention over `--world` ranks (threads here, or the processes of an MPI
//! job with `--comm mpi`). Two layers, d_model 64, GQA 4 query / 2 kv heads of 16, learned
//! positions looked up at each rank's global positions, AdamW. The task is synthetic and
//! learnable: next-token prediction on a fixed random chain in which each token has two
//! possible successors. With `--compare-single` the same model (same
//! initial values, same batches) is also trained on one rank with plain candle attention, and
//! the JSON reports both loss curves, their largest difference, the step-1 gradient's relative
//! error and whether the ranks' replicas stayed bit-identical.
//!
//! On a GPU (`--features candle,cuda`), `--backend cuda` keeps the model and the attention on
//! the device: candle's CUDA tensors, ringattn's kernels on candle's stream, gradients
//! summed on the device — with `--comm local` the ranks are threads sharing GPU 0 (device
//! buffers exchanged by copies), with `--comm nccl` the processes of a launcher's job, one
//! GPU each.
//!
//! ```text
//! cargo run --release --features candle --example train_lm -- --world 4 --strategy ring \
//!     --steps 60 --seq 512 --compare-single --json out.json
//! mpirun -n 4 target/release/examples/train_lm --comm mpi --strategy ulysses --steps 20
//! cargo run --release --features candle,cuda --example train_lm -- --backend cuda --dtype bf16 \
//!     --world 4 --compare-single
//! torchrun --nproc-per-node 8 target/release/examples/train_lm --backend cuda --comm nccl --dtype bf16
//! ```

use std::sync::Arc;

use candle_core::{DType as CDType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::Parser;
use ringattn::candle::prelude::*;
use ringattn::parallel::Backend;
use ringattn::{candle as rc, DType};

/// The system allocator, counting the bytes live and their peak (what gradient checkpointing
/// saves shows in the peak; the process's resident size hides it behind the allocator's
/// caches).
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(live, Relaxed);
        std::alloc::System.alloc(l)
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        std::alloc::System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The command line's charts (line_chart: PNG and SVG, the font the crate carries).
#[path = "../src/bin/ringattn/plot.rs"]
#[allow(dead_code)]
mod plot;

const VOCAB: usize = 32;
const MODEL: usize = 64;
const HEADS_Q: usize = 4;
const HEADS_KV: usize = 2;
const HEAD_DIM: usize = 16;
const LAYERS: usize = 2;

/// Train a tiny causal LM with ringattn's attention over several ranks.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Ranks the sequence is split over (with --comm mpi: the job's size).
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// A strategy of more than one rank (ringattn's names: ring, allgather, ...).
    #[arg(long, default_value = "ring")]
    strategy: Strategy,
    /// contiguous, zigzag or striped [default: zigzag, the mask is causal].
    #[arg(long)]
    layout: Option<String>,
    /// Optimiser steps.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Tokens per sequence (the whole sequence, split over the ranks).
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Gradient checkpointing: each layer keeps only its input and output and is recomputed
    /// (its ring attention included) in the backward.
    #[arg(long)]
    checkpoint: bool,
    /// cpu, emu (the CUDA kernels under the host emulator: bf16, slow) or cuda (the model and
    /// the attention on the GPU; a build with --features candle,cuda; --dtype bf16 or f16).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// local (ranks as threads; with --backend cuda sharing GPU 0), mpi (the processes of an
    /// MPI job; a build with --features mpi) or nccl (--backend cuda: the processes of a
    /// launcher's job, one GPU each).
    #[arg(long, default_value = "local")]
    comm: String,
    /// Attention dtype: f32 or bf16 (parameters stay f32).
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the initial values and the data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Learnable attention sinks: one logit per query head and layer in each row's softmax
    /// denominator (gpt-oss style), trained with the model.
    #[arg(long)]
    sinks: bool,
    /// Tanh soft-capping of the attention scores at this cap (Gemma 2 style: 50).
    #[arg(long, value_name = "CAP")]
    softcap: Option<f32>,
    /// Also train the same model with plain attention on one rank and compare.
    #[arg(long)]
    compare_single: bool,
    /// Write the losses and the comparison as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Draw the loss curve(s) to STEM.png and STEM.svg.
    #[arg(long, value_name = "STEM")]
    plot: Option<std::path::PathBuf>,
}

fn fail(e: impl std::fmt::Display) -> ringattn::Error {
    ringattn::Error::InvalidArgument(e.to_string())
}

/// Deterministic initial values of every parameter (the same on every rank and in the
/// single-rank run), in a fixed order, on `device`: embeddings, the layers' weights, the
/// output projection, then (with `sinks`) each layer's sink logits `[HEADS_Q]`.
fn parameters(seed: u64, seq: usize, sinks: bool, device: &Device) -> candle_core::Result<Vec<Var>> {
    let mut shapes: Vec<Vec<usize>> = vec![vec![VOCAB, MODEL], vec![seq, MODEL]];
    for _ in 0..LAYERS {
        shapes.extend([
            vec![MODEL, HEADS_Q * HEAD_DIM],
            vec![MODEL, HEADS_KV * HEAD_DIM],
            vec![MODEL, HEADS_KV * HEAD_DIM],
            vec![HEADS_Q * HEAD_DIM, MODEL],
            vec![MODEL, 2 * MODEL],
            vec![2 * MODEL, MODEL],
        ]);
    }
    shapes.push(vec![MODEL, VOCAB]);
    if sinks {
        shapes.extend((0..LAYERS).map(|_| vec![HEADS_Q]));
    }
    shapes
        .iter()
        .enumerate()
        .map(|(i, sh)| {
            let t = ringattn::random::randn(sh.clone(), seed * 1000 + i as u64, DType::F32);
            let scale = 1.0 / (sh[0] as f64).sqrt();
            Var::from_tensor(
                &(Tensor::from_vec(t.to_f32_vec(), sh.as_slice(), &Device::Cpu)? * scale)?.to_device(device)?,
            )
        })
        .collect()
}

/// One step's batch: tokens `[b, seq]` of a fixed random process, and their targets (the
/// next token; the last position's is the first token). Each token is followed by one of its
/// two successors (fixed for the run by `seed`), chosen at random: the loss can fall from
/// about ln 32 towards ln 2. On `device`.
fn batch(seed: u64, step: usize, b: usize, seq: usize, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let draw = |n: usize, salt: u64| -> Vec<usize> {
        let x = ringattn::random::randn(vec![n], seed.wrapping_mul(31) ^ salt, DType::F32);
        x.to_f32_vec().iter().map(|v| (v.abs() * 1000.0) as usize).collect()
    };
    let successors = draw(2 * VOCAB, 1);
    let (mut tokens, mut targets) = (Vec::with_capacity(b * seq), Vec::with_capacity(b * seq));
    for row in 0..b {
        let r = draw(seq + 1, (step as u64 + 2) * 0x9e37 + row as u64 * 0x51);
        let mut tok = r[0] % VOCAB;
        let first = tokens.len();
        for t in 0..seq {
            tokens.push(tok as u32);
            tok = successors[2 * tok + r[t + 1] % 2] % VOCAB;
        }
        targets.extend((0..seq).map(|t| tokens[first + (t + 1) % seq]));
    }
    Ok((Tensor::from_vec(tokens, (b, seq), device)?, Tensor::from_vec(targets, (b, seq), device)?))
}

/// `x / rms(x)` over the last axis (differentiable).
fn rms_norm(x: &Tensor) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + 1e-6)?.sqrt()?)
}

/// Plain causal attention with GQA, for the single-rank reference: `[1, s, h, d]`; scores
/// soft-capped at `softcap` (`cap · tanh(s / cap)`), and with `sinks` `[h]` one more logit
/// per head in each row's softmax (its column dropped after).
fn plain_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&Tensor>,
    softcap: Option<f32>,
) -> candle_core::Result<Tensor> {
    let (b, s, h, d) = q.dims4()?;
    let g = h / k.dim(2)?;
    let rep = |t: &Tensor| -> candle_core::Result<Tensor> {
        let (b, s, hk, d) = t.dims4()?;
        t.unsqueeze(3)?.expand((b, s, hk, g, d))?.reshape((b, s, hk * g, d))?.transpose(1, 2)?.contiguous()
    };
    let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, rep(k)?, rep(v)?);
    let mut scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    if let Some(cap) = softcap {
        scores = ((scores / f64::from(cap))?.tanh()? * f64::from(cap))?;
    }
    let mask: Vec<f32> = (0..s * s).map(|i| if i % s > i / s { -1e30 } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (s, s), q.device())?;
    let mut scores = scores.broadcast_add(&mask)?;
    if let Some(sk) = sinks {
        let column = sk.reshape((1, h, 1, 1))?.broadcast_as((b, h, s, 1))?.to_dtype(scores.dtype())?;
        scores = Tensor::cat(&[&scores, &column], D::Minus1)?;
    }
    let p = candle_nn::ops::softmax(&scores, D::Minus1)?.narrow(D::Minus1, 0, s)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, s, h, d))
}

/// An attention (ring or plain) as the layers call it: `[b, n, h, d]` in and out, with the
/// layer's sinks when the model has them.
type Attend = Arc<dyn Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor> + Send + Sync>;

/// One transformer layer over `x` `[b, n, MODEL]`: attention and MLP, pre-norm, residual.
/// `w`: its six weights, then its sinks when the model has them.
fn layer(x: &Tensor, w: &[Var], attend: &Attend) -> candle_core::Result<Tensor> {
    let (b, n, _) = x.dims3()?;
    let h = rms_norm(x)?;
    let q = h.broadcast_matmul(w[0].as_tensor())?.reshape((b, n, HEADS_Q, HEAD_DIM))?;
    let k = h.broadcast_matmul(w[1].as_tensor())?.reshape((b, n, HEADS_KV, HEAD_DIM))?;
    let v = h.broadcast_matmul(w[2].as_tensor())?.reshape((b, n, HEADS_KV, HEAD_DIM))?;
    let o = attend(&q, &k, &v, w.get(6).map(Var::as_tensor))?.reshape((b, n, HEADS_Q * HEAD_DIM))?;
    let x = (x + o.broadcast_matmul(w[3].as_tensor())?)?;
    let h = rms_norm(&x)?;
    x + h.broadcast_matmul(w[4].as_tensor())?.gelu()?.broadcast_matmul(w[5].as_tensor())?
}

/// The model's loss contribution of one rank's tokens: Σ −log p(target) / `total` tokens.
/// `pos` are the global positions of the tokens; with `checkpoint` each layer keeps only its
/// input and output, recomputed in the backward (its weights' gradients gathered there).
fn loss(
    p: &[Var],
    tokens: &Tensor,
    targets: &Tensor,
    pos: &Tensor,
    total: usize,
    attend: &Attend,
    checkpoint: Option<&rc::Checkpoint>,
) -> candle_core::Result<Tensor> {
    let (b, n) = tokens.dims2()?;
    let emb = p[0].as_tensor().embedding(&tokens.flatten_all()?)?.reshape((b, n, MODEL))?;
    let mut x = emb.broadcast_add(&p[1].as_tensor().embedding(pos)?)?;
    let out = 2 + 6 * LAYERS; // the output projection; the sinks follow it
    for l in 0..LAYERS {
        let mut w = p[2 + 6 * l..8 + 6 * l].to_vec();
        w.extend(p.get(out + 1 + l).cloned());
        x = match checkpoint {
            Some(ck) => {
                let (wl, at) = (w.clone(), attend.clone());
                ck.apply(&x, &w, move |x| layer(x, &wl, &at))? // [cp]
            }
            None => layer(&x, &w, attend)?,
        };
    }
    let logits = rms_norm(&x)?.broadcast_matmul(p[out].as_tensor())?.reshape((b * n, VOCAB))?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let picked = logp.gather(&targets.reshape((b * n, 1))?, 1)?;
    picked.sum_all()? * (-1.0 / total as f64)
}

/// All gradients of `vars` flattened in order (f32).
fn flat_grads(vars: &[Var], grads: &candle_core::backprop::GradStore) -> candle_core::Result<Vec<f32>> {
    let mut out = Vec::new();
    for v in vars {
        match grads.get(v.as_tensor()) {
            Some(g) => out.extend(g.flatten_all()?.to_vec1::<f32>()?),
            None => out.extend(std::iter::repeat_n(0.0, v.elem_count())),
        }
    }
    Ok(out)
}

fn adamw(vars: &[Var], lr: f64) -> candle_core::Result<AdamW> {
    AdamW::new(vars.to_vec(), ParamsAdamW { lr, weight_decay: 0.0, ..Default::default() })
}

/// The single-rank run with plain attention: losses and the step-1 gradients.
fn train_single(a: &Args) -> candle_core::Result<(Vec<f64>, Vec<f32>)> {
    let vars = parameters(a.seed, a.seq, a.sinks, &Device::Cpu)?;
    let mut opt = adamw(&vars, a.lr)?;
    let pos = Tensor::arange(0u32, a.seq as u32, &Device::Cpu)?;
    let softcap = a.softcap;
    let plain: Attend = Arc::new(move |q: &Tensor, k: &Tensor, v: &Tensor, sinks: Option<&Tensor>| {
        plain_attention(q, k, v, sinks, softcap)
    });
    let (mut losses, mut first) = (Vec::new(), Vec::new());
    for step in 0..a.steps {
        let (tokens, targets) = batch(a.seed, step, a.batch, a.seq, &Device::Cpu)?;
        let l = loss(&vars, &tokens, &targets, &pos, a.batch * a.seq, &plain, None)?;
        let grads = l.backward()?;
        if step == 0 {
            first = flat_grads(&vars, &grads)?;
        }
        opt.step(&grads)?;
        losses.push(l.to_scalar::<f32>()? as f64);
    }
    Ok((losses, first))
}

/// What one rank of the parallel run reports.
struct RankRun {
    losses: Vec<f64>,
    first_grads: Vec<f32>,
    replicas_identical: bool,
    /// Wall time of each step, seconds.
    step_times: Vec<f64>,
    /// The most bytes live on the heap right after a step's forward.
    heap_after_forward: usize,
}

/// One rank of the parallel run on `comm`, attention on `backend`, the model on `device`
/// (the CPU for host backends; the GPU, with device buffers, for the CUDA backend). The
/// lines that exist because of ringattn end in `// [cp]` (counted by tests/candle.rs).
fn train_rank<Be>(
    a: &Args,
    comm: Arc<dyn Communicator<Buf = Be::Buf>>,
    backend: Be,
    device: &Device,
    params: &ParallelParams,
    progress: Option<&indicatif::ProgressBar>,
) -> ringattn::Result<RankRun>
where
    Be: Backend + Send + Sync + 'static,
    Be::Buf: rc::CandleBuf,
{
    let cdt = match a.dtype {
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        _ => CDType::F32,
    };
    let cp = Arc::new(ContextParallel::new(comm, backend, params.clone(), HEADS_Q)?); // [cp]
    let pos = cp.position_ids(a.seq, device)?; // [cp]
    let (cpa, posa) = (cp.clone(), pos.clone()); // [cp]
    let attend: Attend = Arc::new(move |q: &Tensor, k: &Tensor, v: &Tensor, sinks: Option<&Tensor>| {
        let (q, k, v) = (q.to_dtype(cdt)?, k.to_dtype(cdt)?, v.to_dtype(cdt)?);
        match sinks {
            Some(s) => cpa.attention_with_sinks_at(&q, &k, &v, s, &posa)?.to_dtype(CDType::F32), // [cp]
            None => cpa.attention_at(&q, &k, &v, &posa)?.to_dtype(CDType::F32),                  // [cp]
        }
    });
    let checkpoint = a.checkpoint.then(rc::Checkpoint::new); // [cp]
    let vars = parameters(a.seed, a.seq, a.sinks, device)?;
    let mut opt = adamw(&vars, a.lr)?;
    let (mut losses, mut first_grads, mut step_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut kept = 0usize;
    for step in 0..a.steps {
        let t0 = std::time::Instant::now();
        let (tokens, targets) = batch(a.seed, step, a.batch, a.seq, device)?;
        let (tokens, targets) = (cp.shard(&tokens, 1)?, cp.shard(&targets, 1)?); // [cp]
        let l = loss(&vars, &tokens, &targets, &pos, a.batch * a.seq, &attend, checkpoint.as_ref())?;
        // What the graph keeps for the backward (the process's live heap; exact with one rank).
        kept = kept.max(LIVE.load(std::sync::atomic::Ordering::Relaxed));
        let mut grads = l.backward()?;
        if let Some(ck) = &checkpoint {
            ck.merge_into(&mut grads)?; // [cp]
        }
        cp.all_reduce_gradients(&vars, &mut grads)?; // [cp]
        if step == 0 {
            first_grads = flat_grads(&vars, &grads)?;
        }
        opt.step(&grads)?;
        let total = f64::from(cp.all_reduce_sum(&l.reshape(1)?)?.to_vec1::<f32>()?[0]); // [cp]
        step_times.push(t0.elapsed().as_secs_f64());
        losses.push(total);
        if let Some(pb) = progress {
            pb.set_message(format!("loss {total:.4}"));
            pb.inc(1);
        }
    }
    let replicas_identical = cp.replicas_identical(&vars)?; // [cp]
    Ok(RankRun { losses, first_grads, replicas_identical, step_times, heap_after_forward: kept })
}

/// Rank 0's report of an in-process run, or the first rank's error.
fn rank0(results: Vec<ringattn::Result<RankRun>>) -> ringattn::Result<Option<RankRun>> {
    let mut ranks = Vec::with_capacity(results.len());
    for r in results {
        ranks.push(r?);
    }
    Ok(ranks.into_iter().next())
}

/// The parallel run on in-process ranks or on this MPI process; rank 0's report.
fn train_parallel(a: &Args, params: &ParallelParams) -> ringattn::Result<Option<RankRun>> {
    let pb = indicatif::ProgressBar::new(a.steps as u64)
        .with_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}").map_err(fail)?);
    if a.backend == "cuda" {
        return train_parallel_cuda(a, params, &pb);
    }
    let run = |comm: Arc<dyn Communicator<Buf = ringattn::HostBuf>>| -> ringattn::Result<RankRun> {
        let bar = (comm.rank() == 0).then_some(&pb);
        match a.backend.as_str() {
            "cpu" => train_rank(a, comm, CpuBackend::default(), &Device::Cpu, params, bar),
            "emu" => {
                let be = ringattn::emu::EmuBackend { dtype: a.dtype, ..Default::default() };
                train_rank(a, comm, be, &Device::Cpu, params, bar)
            }
            other => Err(fail(format!("--backend {other}: cpu, emu or cuda"))),
        }
    };
    let out = match a.comm.as_str() {
        "local" => rank0(spmd_shared(a.world, LocalOptions::default(), run))?, // [cp]
        #[cfg(feature = "mpi")]
        "mpi" => {
            let comm = ringattn::comm::MpiComm::init(ringattn::comm::MpiOptions::default())?;
            let rank = comm.rank();
            let r = run(Arc::new(comm))?;
            (rank == 0).then_some(r)
        }
        other => {
            return Err(fail(format!(
                "--comm {other}: local, or mpi in a build with --features mpi (nccl: --backend cuda)"
            )))
        }
    };
    pb.finish();
    Ok(out)
}

/// `--backend cuda`: the model on the GPU as candle CUDA tensors, the attention through the
/// device backend on candle's stream, device buffers between the ranks.
#[cfg(feature = "cuda")]
fn train_parallel_cuda(
    a: &Args,
    params: &ParallelParams,
    pb: &indicatif::ProgressBar,
) -> ringattn::Result<Option<RankRun>> {
    use ringattn::cuda::{CudaDevice, DeviceBackend, DeviceBuf};
    use std::time::Duration;
    if !matches!(a.dtype, DType::BF16 | DType::F16) {
        return Err(fail(format!("--backend cuda computes on bf16 or f16 (--dtype bf16), not {}", a.dtype)));
    }
    // One rank on GPU `ordinal`: candle's device, and ringattn's backend on candle's stream.
    let rank_on = |ordinal: usize, comm: Arc<dyn Communicator<Buf = DeviceBuf>>| -> ringattn::Result<RankRun> {
        let device = Device::new_cuda(ordinal).map_err(fail)?;
        let stream = device.as_cuda_device().map_err(fail)?.cuda_stream();
        let backend = DeviceBackend::on_stream(CudaDevice::shared(ordinal)?, stream, a.dtype)?;
        let bar = (comm.rank() == 0).then_some(pb);
        train_rank(a, comm, backend, &device, params, bar)
    };
    let out = match a.comm.as_str() {
        "local" => {
            let members = ringattn::cuda::DeviceComm::group(a.world, LocalOptions::default(), &CudaDevice::shared(0)?)?;
            rank0(ringattn::comm::spmd_owned(members, |comm| rank_on(0, comm)))?
        }
        "nccl" => {
            let env = ringattn::cuda::BootstrapEnv::from_env()?;
            let ordinal = ringattn::cuda::device_ordinal(env.local_rank, ringattn::cuda::probe()?.device_count)?;
            let comm = ringattn::cuda::NcclComm::from_env(Duration::from_secs(300))?;
            let rank = comm.rank();
            let r = rank_on(ordinal, Arc::new(comm))?;
            (rank == 0).then_some(r)
        }
        other => return Err(fail(format!("--comm {other} with --backend cuda: local (ranks sharing GPU 0) or nccl"))),
    };
    pb.finish();
    Ok(out)
}

#[cfg(not(feature = "cuda"))]
fn train_parallel_cuda(_: &Args, _: &ParallelParams, _: &indicatif::ProgressBar) -> ringattn::Result<Option<RankRun>> {
    Err(fail("--backend cuda: this build lacks the `cuda` feature (cargo build --release --features candle,cuda)"))
}

/// The peak of the bytes live on the heap over the run (all ranks of the process), MiB.
fn peak_heap_mib() -> f64 {
    PEAK.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1 << 20) as f64
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn main() -> ringattn::Result<()> {
    let a = Args::parse();
    let candle_threads_env = std::env::var("CANDLE_NUM_THREADS").ok();
    let layout = a.layout.as_deref().map(str::parse::<SeqLayout>).transpose()?;
    // (With sinks, the plan's values are placeholders: each call passes the layer's.)
    let sinks = a.sinks.then(|| vec![0.0; HEADS_Q]);
    let attention = AttentionParams { mask: Mask::Causal, softcap: a.softcap, sinks, ..Default::default() }; // [cp]
    let params = ParallelParams { strategy: a.strategy, layout, attention, ..Default::default() }; // [cp]
    let world = match a.comm.as_str() {
        "mpi" => std::env::var("OMPI_COMM_WORLD_SIZE").ok().and_then(|s| s.parse().ok()).unwrap_or(a.world),
        #[cfg(feature = "cuda")]
        "nccl" => ringattn::cuda::BootstrapEnv::from_env()?.world,
        _ => a.world,
    };
    let Some(run) = train_parallel(&a, &params)? else { return Ok(()) };
    // The single-rank reference runs once, on the reporting rank.
    let single = if a.compare_single { Some(train_single(&a)?) } else { None };
    let (first, last) = (run.losses[0], run.losses[run.losses.len() - 1]);
    // The median step after the first (which plans and warms up).
    let mut later: Vec<f64> = run.step_times.iter().skip(1).copied().collect();
    later.sort_by(f64::total_cmp);
    let step_ms = later.get(later.len() / 2).map_or(f64::NAN, |t| t * 1e3);
    println!(
        "train_lm: {} x{world} {:?} {} steps, batch {} x seq {}: loss {first:.4} -> {last:.4}; replicas identical: {}; \
         median step {step_ms:.1} ms; heap after the forward {:.0} MiB, peak {:.0} MiB",
        a.strategy,
        params.layout(),
        a.steps,
        a.batch,
        a.seq,
        run.replicas_identical,
        run.heap_after_forward as f64 / (1 << 20) as f64,
        peak_heap_mib()
    );
    let mut json = serde_json::json!({
        "strategy": a.strategy.to_string(),
        "world": world,
        "layout": format!("{:?}", params.layout()).to_lowercase(),
        "dtype": a.dtype.to_string(),
        "backend": a.backend,
        "steps": a.steps,
        "seq": a.seq,
        "batch": a.batch,
        "median_step_ms": step_ms,
        "checkpoint": a.checkpoint,
        "peak_heap_mib": peak_heap_mib(),
        "heap_after_forward_mib": run.heap_after_forward as f64 / (1 << 20) as f64,
        "candle_num_threads_env": candle_threads_env,
        "sinks": a.sinks,
        "softcap": a.softcap,
        "losses": run.losses,
        "replicas_identical": run.replicas_identical,
    });
    let curve = |l: &[f64]| l.iter().enumerate().map(|(i, &y)| ((i + 1) as f64, y)).collect::<Vec<_>>();
    let mut series = vec![(format!("{} over {world} ranks", a.strategy), curve(&run.losses))];
    if let Some((single_losses, _)) = &single {
        series.push(("one rank, plain candle attention".to_string(), curve(single_losses)));
    }
    if let Some((single_losses, single_grads)) = single {
        let diff = run.losses.iter().zip(&single_losses).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        let grad_err = rel_err(&run.first_grads, &single_grads);
        println!("against one rank with plain attention: max |loss diff| {diff:.3e}, step-1 gradient relative error {grad_err:.3e}");
        if a.sinks {
            // The sinks are the last parameters: their step-1 gradients alone.
            let tail = |g: &[f32]| g[g.len() - LAYERS * HEADS_Q..].to_vec();
            let sinks_err = rel_err(&tail(&run.first_grads), &tail(&single_grads));
            println!("the sinks' step-1 gradient relative error {sinks_err:.3e}");
            json["step1_sinks_grad_rel_err"] = serde_json::json!(sinks_err);
        }
        json["single_losses"] = serde_json::json!(single_losses);
        json["max_abs_loss_diff"] = serde_json::json!(diff);
        json["step1_grad_rel_err"] = serde_json::json!(grad_err);
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json).map_err(fail)?).map_err(fail)?;
    }
    if let Some(stem) = &a.plot {
        let title = format!("train_lm: loss per step ({} tokens, {:?})", a.seq, params.layout());
        for f in plot::line_chart(stem, &title, "step", "loss", &series, false, false)? {
            println!("wrote {}", f.display());
        }
    }
    Ok(())
}
