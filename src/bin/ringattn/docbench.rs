//! `ringattn bench --docs DIST`: packed-document batches over ranks. For each seeded batch
//! (`--doc-seeds`), each strategy (`--strategies`) and layout (`--layout`, a list), at each
//! world size: the layout's imbalance (max over mean of the ranks' visible (query, key)
//! pairs: [`ringattn::flops::pairs_of_positions`]), and, forward + backward through one plan
//! per configuration, the bytes every rank sent, the ring hops skipped and the wall time
//! (the slowest rank's, median of the timed rounds; configurations interleaved round by
//! round, so drift hits all alike). Ranks are threads of this process (`--comm local`:
//! they share the cores, so wall time shows no balance) or the processes of an MPI job
//! (`mpirun -n P ringattn bench --comm mpi ...`, a build with `--features mpi`; one compute
//! thread each with RAYON_NUM_THREADS=1). Shape and score options as the other benches
//! (--batch, --heads, --kv-heads, --head-dim(-v), --dtype, --causal, --window, --softcap;
//! --link-gbps models the in-process links); what this mode cannot honour (another backend,
//! one pass, --seqlens) is refused. `auto` among --strategies runs, per batch, what
//! `ringattn::parallel::auto::choose` picks under the cost model (calibrated by
//! --calibration), and every configuration carries the model's prediction beside its
//! measurement; the summary compares auto with the best and worst fixed configuration of the
//! batch. JSON with `--json`, a plot with `--out`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ringattn::comm::{all_gather, barrier, spmd, Communicator, LinkModel, LocalOptions};
use ringattn::parallel::auto::choose;
use ringattn::parallel::{CpuBackend, ParallelParams, ParallelPlan, Strategy};
use ringattn::plan::{
    evaluate_batch, layout_name, Calibration, ClusterSpec, JobSpec, LinkSharing, Nesting, Passes, Placement,
};
use ringattn::random::{document_lengths, randn, DocLengths};
use ringattn::{dispatch, flops, DType, Dims, Documents, Error, HostBuf, Layout, Mask, Result};
use serde::Serialize;

use crate::bench::BenchArgs;

/// One configuration of one batch.
#[derive(Serialize, Debug, Clone)]
pub struct DocRow {
    /// The batch's seed.
    pub seed: u64,
    /// Documents in the batch.
    pub documents: usize,
    /// Ranks.
    pub world: usize,
    /// Strategy name.
    pub strategy: String,
    /// Layout name.
    pub layout: String,
    /// Max over mean of the ranks' visible pairs.
    pub imbalance: f64,
    /// Visible pairs of each rank's queries (per batch element and head).
    pub work: Vec<u64>,
    /// Bytes sent by all ranks, forward + backward.
    pub bytes_sent: u64,
    /// What the pass-along ring (every K/V block to every rank, as without documents) sends
    /// over the same shards, forward + backward: [`pass_along_bytes`] (ring rows only).
    pub pass_along_bytes: Option<u64>,
    /// Ring hops skipped, summed over ranks (forward).
    pub skipped_hops: usize,
    /// Forward + backward seconds of each timed round (the slowest rank's).
    pub seconds: Vec<f64>,
    /// Each rank's seconds in local attention (forward + backward, last round).
    pub compute_s: Vec<f64>,
    /// Each rank's seconds blocked on communication (forward + backward, last round).
    pub waiting_s: Vec<f64>,
    /// Median of `seconds`.
    pub median_s: f64,
    /// The cost model's forward + backward time of this configuration (calibrated by
    /// --calibration), when it weighs this mask.
    pub predicted_s: Option<f64>,
    /// For `auto`: what it chose (`strategy u×r layout`).
    pub choice: Option<String>,
}

/// A `--strategies` entry: a strategy run with every --layout, or `auto`, resolved per batch.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pick {
    Fixed(Strategy),
    Auto,
}

/// The run's settings, resolved from the bench arguments.
struct Setup {
    dist: DocLengths,
    seeds: Vec<u64>,
    s: usize,
    b: usize,
    h_q: usize,
    h_kv: usize,
    d: usize,
    d_v: usize,
    dtype: DType,
    /// The mask and score options (documents set per batch).
    attention: ringattn::AttentionParams,
    picks: Vec<Pick>,
    layouts: Vec<Layout>,
    /// The cost model's cluster (its `gpus` set per world size).
    cluster: ClusterSpec,
    warmup: usize,
    iters: usize,
    /// The link model of in-process ranks (`--link-gbps`; none: instant).
    link: Option<LinkModel>,
}

impl Setup {
    /// The settings of `--docs DIST`; options this mode cannot honour are refused by name.
    fn of(a: &BenchArgs, docs: &str) -> Result<Setup> {
        let refuse = |what: &str| Err(Error::InvalidArgument(format!("--docs: {what}")));
        if a.backend != "cpu" {
            return refuse(&format!("runs the cpu backend, not --backend {}", a.backend));
        }
        if a.pass != "both" {
            return refuse(&format!("times forward + backward, not --pass {}", a.pass));
        }
        if a.seqlens.is_some() {
            return refuse("draws the documents itself: --seqlens does not apply");
        }
        if a.comm != "local" && a.link_gbps.is_some() {
            return refuse("--link-gbps models in-process links: not with --comm mpi");
        }
        let dist: DocLengths = docs.parse()?;
        let s = match &a.seq {
            None => 32768,
            Some(list) => list
                .trim()
                .parse()
                .map_err(|_| Error::InvalidArgument(format!("--seq `{list}`: one length with --docs")))?,
        };
        let mask_args = crate::args::MaskArgs {
            causal: a.causal,
            window: a.window.clone(),
            softcap: a.softcap,
            ..Default::default()
        };
        let attention = mask_args.params()?;
        let names = |list: &Option<String>, default: &str| -> Vec<String> {
            list.as_deref()
                .unwrap_or(default)
                .split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect()
        };
        let picks = names(&a.strategies, "ring")
            .iter()
            .map(|n| match n.as_str() {
                "auto" => Ok(Pick::Auto),
                n => n.parse::<Strategy>().map(Pick::Fixed),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut cluster = ClusterSpec { links: LinkSharing::PerPeer, ..Default::default() };
        for path in &a.calibration {
            Calibration::load(path)?.apply(&mut cluster);
        }
        let layouts =
            names(&a.layout, "zigzag,balanced").iter().map(|n| n.parse::<Layout>()).collect::<Result<Vec<_>>>()?;
        let dtype = match a.dtype.as_deref() {
            None => DType::BF16,
            Some(d) => d.parse()?,
        };
        let link = match a.link_gbps {
            Some(g) if g > 0.0 && g.is_finite() && a.link_latency_us.is_finite() && a.link_latency_us >= 0.0 => {
                Some(LinkModel { bandwidth: g * 1e9, latency: Duration::from_secs_f64(a.link_latency_us * 1e-6) })
            }
            Some(0.0) | None => None,
            Some(g) => {
                return refuse(&format!("--link-gbps {g} / --link-latency-us {}: finite, positive", a.link_latency_us))
            }
        };
        Ok(Setup {
            dist,
            seeds: (0..a.doc_seeds as u64).collect(),
            s,
            b: a.batch,
            h_q: a.heads,
            h_kv: a.kv_heads.unwrap_or(a.heads),
            d: a.head_dim,
            d_v: a.head_dim_v.unwrap_or(a.head_dim),
            dtype,
            attention,
            picks,
            layouts,
            cluster,
            warmup: a.warmup.unwrap_or(1),
            iters: a.iters.unwrap_or(3).max(1),
            link,
        })
    }
}

/// Every configuration of every batch on this rank of `comm` (collective); rank 0's rows hold
/// the gathered figures.
fn rank_rows(comm: &dyn Communicator<Buf = HostBuf>, st: &Setup) -> Result<Vec<DocRow>> {
    let (world, rank) = (comm.size(), comm.rank());
    let be = CpuBackend::default();
    let mut rows = Vec::new();
    for &seed in &st.seeds {
        let lens = document_lengths(seed, st.s, &st.dist);
        let attention =
            ringattn::AttentionParams { documents: Some(Documents::new(lens.clone())?), ..st.attention.clone() };
        let draw = |h: usize, d: usize, i: u64| randn(vec![st.b, st.s, h, d], 1000 * seed + i, st.dtype);
        let (q, k, v, d_o) =
            (draw(st.h_q, st.d, 1), draw(st.h_kv, st.d, 2), draw(st.h_kv, st.d_v, 3), draw(st.h_q, st.d_v, 4));
        struct Config<'c> {
            row: DocRow,
            plan: ParallelPlan<'c, CpuBackend>,
            bufs: [HostBuf; 4],
        }
        let cluster = ClusterSpec { gpus: world, gpus_per_node: world, ..st.cluster.clone() };
        let job = JobSpec {
            seq: st.s,
            batch: st.b,
            heads: st.h_q,
            kv_heads: st.h_kv,
            head_dim: st.d,
            head_dim_v: (st.d_v != st.d).then_some(st.d_v),
            dtype_bytes: st.dtype.size_of(),
            accum_bytes: 4,
            causal: attention.mask == Mask::Causal,
            passes: Passes::Both,
            layers: 1,
        };
        // The model weighs causal or unmasked documents.
        let modelled = matches!(attention.mask, Mask::Causal | Mask::None);
        let whole = Dims { b: st.b, s_q: st.s, s_k: st.s, h_q: st.h_q, h_kv: st.h_kv, d_qk: st.d, d_v: st.d_v };
        // (parameters, the model's estimate, auto's choice)
        let mut runs: Vec<(ParallelParams, Option<f64>, Option<String>)> = Vec::new();
        for &pick in &st.picks {
            match pick {
                Pick::Auto => {
                    let auto = choose(&attention, &whole, st.dtype, Passes::Both, &cluster)?;
                    let params = ParallelParams { seq_len: st.s, ..auto.params };
                    runs.push((params, Some(auto.predicted.time_s), Some(auto.predicted.label())));
                }
                Pick::Fixed(strategy) => {
                    for &layout in &st.layouts {
                        let params = ParallelParams {
                            strategy,
                            layout: Some(layout),
                            attention: attention.clone(),
                            seq_len: st.s,
                            ..Default::default()
                        };
                        let resolved = params.resolve(world, st.h_q, st.s)?;
                        let u = resolved.ulysses_degree();
                        let placement = match strategy {
                            Strategy::Ring => Some(Placement::ring(world)),
                            Strategy::AllGather => Some(Placement::all_gather(world)),
                            Strategy::Ulysses => Some(Placement::ulysses(world)),
                            Strategy::Usp => Some(Placement::usp(u, world / u, Nesting::UlyssesInNode)),
                            _ => None,
                        };
                        let predicted = match placement.filter(|_| modelled && world > 1) {
                            Some(p) => Some(evaluate_batch(&cluster, &job, &lens, layout, &p)?.time_s),
                            None => None,
                        };
                        runs.push((params, predicted, None));
                    }
                }
            }
        }
        let mut configs = Vec::new();
        for (params, predicted_s, choice) in runs {
            {
                let (strategy, layout) = (params.strategy, params.layout());
                let resolved = params.resolve(world, st.h_q, st.s)?;
                let work = flops::pairs_of_positions(&attention, st.s, resolved.all_positions())?;
                let n = resolved.positions(rank).len();
                let dims = Dims { b: st.b, s_q: n, s_k: n, h_q: st.h_q, h_kv: st.h_kv, d_qk: st.d, d_v: st.d_v };
                let plan = ParallelPlan::new(comm, &be, &resolved, &dims, st.dtype)?;
                let up = |t: &ringattn::Tensor| plan.upload_tensor(&resolved.shard(t, rank)?);
                let bufs = [up(&q)?, up(&k)?, up(&v)?, up(&d_o)?];
                let row = DocRow {
                    seed,
                    documents: lens.len(),
                    world,
                    strategy: if choice.is_some() { "auto".into() } else { strategy.name().to_string() },
                    layout: layout_name(layout),
                    imbalance: dispatch::imbalance(&work),
                    work,
                    bytes_sent: 0,
                    pass_along_bytes: (strategy == Strategy::Ring)
                        .then(|| st.b as u64 * pass_along_bytes(st.s, st.h_kv, st.d, st.d_v, st.dtype, world)),
                    skipped_hops: 0,
                    seconds: Vec::new(),
                    compute_s: Vec::new(),
                    waiting_s: Vec::new(),
                    median_s: 0.0,
                    predicted_s,
                    choice,
                };
                configs.push(Config { row, plan, bufs });
            }
        }
        for round in 0..st.warmup + st.iters {
            for c in configs.iter_mut() {
                barrier(comm, HostBuf::from(vec![0.0f32]))?;
                let start = Instant::now();
                let [q, k, v, d_o] = &c.bufs;
                let (_, saved) = c.plan.forward(q, k, v)?;
                let fwd = c.plan.last_stats();
                c.plan.backward(&saved, d_o)?;
                let bwd = c.plan.last_stats();
                let mine = start.elapsed().as_secs_f64();
                // Every rank's seconds, bytes, skipped hops, compute and waiting.
                let mine = HostBuf::from(vec![
                    mine as f32,
                    (fwd.bytes_sent + bwd.bytes_sent) as f32,
                    fwd.skipped_hops as f32,
                    (fwd.compute + bwd.compute).as_secs_f32(),
                    (fwd.waiting + bwd.waiting).as_secs_f32(),
                ]);
                let all: Vec<f32> = all_gather(comm, mine)?
                    .iter()
                    .map(|b| b.f32s().map(<[f32]>::to_vec))
                    .collect::<Result<Vec<_>>>()?
                    .concat();
                if round >= st.warmup {
                    let per = |j: usize| all.iter().skip(j).step_by(5).copied();
                    c.row.seconds.push(per(0).fold(0.0f32, f32::max) as f64);
                    c.row.bytes_sent = per(1).map(|x| x as u64).sum();
                    c.row.skipped_hops = per(2).map(|x| x as usize).sum();
                    c.row.compute_s = per(3).map(f64::from).collect();
                    c.row.waiting_s = per(4).map(f64::from).collect();
                }
            }
        }
        for mut c in configs {
            let mut sorted = c.row.seconds.clone();
            sorted.sort_by(f64::total_cmp);
            c.row.median_s = sorted[sorted.len() / 2];
            rows.push(c.row);
        }
    }
    Ok(rows)
}

/// Bytes the pass-along ring of `world` ranks sends over a sequence of `s` tokens (K/V of
/// `h_kv` heads, head dims `d_qk` and `d_v`, in `dtype`), forward + backward, when every hop
/// runs: each of the `P − 1` exchanges moves every rank's K and V block (all `s` rows in
/// total) forward and again backward, plus the blocks' f32 dK/dV accumulators, and the final
/// return of the accumulators to their owners: `s·h_kv·(d_qk + d_v)·(2·e·(P − 1) + 4·P)` with
/// `e` the dtype's bytes (`P` = 1: nothing).
pub fn pass_along_bytes(s: usize, h_kv: usize, d_qk: usize, d_v: usize, dtype: DType, world: usize) -> u64 {
    if world < 2 {
        return 0;
    }
    let e = dtype.size_of() as u64;
    let p = world as u64;
    (s * h_kv * (d_qk + d_v)) as u64 * (2 * e * (p - 1) + 4 * (p - 1) + 4)
}

/// `ringattn bench --docs DIST`.
pub fn run(a: &BenchArgs, docs: &str) -> Result<ExitCode> {
    let st = Setup::of(a, docs)?;
    let rows = match a.comm.as_str() {
        "local" => {
            let worlds = crate::args::parse_list(a.world.as_deref().unwrap_or("2,4,8"), "--world")?;
            let mut rows = Vec::new();
            for world in worlds {
                let options = LocalOptions { link: st.link, ..Default::default() };
                let mut per_rank = spmd(world, options, |comm| rank_rows(comm, &st));
                rows.extend(per_rank.swap_remove(0)?);
            }
            rows
        }
        #[cfg(feature = "mpi")]
        "mpi" => {
            let comm = ringattn::comm::MpiComm::init(ringattn::comm::MpiOptions::default())?;
            if let Some(w) = a.world.as_deref().filter(|w| w.trim() != comm.size().to_string()) {
                return Err(Error::InvalidArgument(format!(
                    "--world {w}: the MPI job has {} processes (--comm mpi runs its own size)",
                    comm.size()
                )));
            }
            let rows = rank_rows(&comm, &st)?;
            if comm.rank() != 0 {
                return Ok(ExitCode::SUCCESS);
            }
            rows
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "--comm `{other}` for --docs: local, or mpi (a build with --features mpi)"
            )))
        }
    };
    print_table(&rows);
    if let Some(path) = &a.json {
        ringattn::io::write_json(path, &rows)?;
    }
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
        // Imbalance per batch, one line per (strategy, layout, world).
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for r in &rows {
            let name = format!("{} {} P={}", r.strategy, r.layout, r.world);
            match series.iter_mut().find(|(n, _)| *n == name) {
                Some((_, pts)) => pts.push((r.seed as f64, r.imbalance)),
                None => series.push((name, vec![(r.seed as f64, r.imbalance)])),
            }
        }
        let title = format!("Visible pairs per rank, max / mean ({} tokens)", st.s);
        for f in
            crate::plot::line_chart(&dir.join("balance"), &title, "batch (seed)", "imbalance", &series, false, false)?
        {
            println!("wrote {}", f.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(rows: &[DocRow]) {
    println!(
        "seed docs world strategy   layout      imbalance  MB sent  of pass-along  skipped  median ms  model ms  compute ms (ranks)"
    );
    for r in rows {
        let of_pass =
            r.pass_along_bytes.map_or("—".to_string(), |p| format!("{:.2}", r.bytes_sent as f64 / p as f64));
        println!(
            "{:>4} {:>4} {:>5} {:<10} {:<10} {:>10.3} {:>8.2} {:>14} {:>8} {:>10.1} {:>9}  {}{}",
            r.seed,
            r.documents,
            r.world,
            r.strategy,
            r.layout,
            r.imbalance,
            r.bytes_sent as f64 / 1e6,
            of_pass,
            r.skipped_hops,
            r.median_s * 1e3,
            r.predicted_s.map_or("—".to_string(), |p| format!("{:.1}", p * 1e3)),
            r.compute_s.iter().map(|c| format!("{:.0}", c * 1e3)).collect::<Vec<_>>().join(" "),
            r.choice.as_ref().map_or(String::new(), |c| format!("  (auto: {c})")),
        );
    }
    // Auto against the fixed configurations of the same batch and world, measured.
    for auto in rows.iter().filter(|r| r.choice.is_some()) {
        let fixed: Vec<&DocRow> =
            rows.iter().filter(|r| r.choice.is_none() && r.seed == auto.seed && r.world == auto.world).collect();
        let (Some(best), Some(worst)) = (
            fixed.iter().min_by(|a, b| a.median_s.total_cmp(&b.median_s)),
            fixed.iter().max_by(|a, b| a.median_s.total_cmp(&b.median_s)),
        ) else {
            continue;
        };
        println!(
            "seed {} world {}: auto ({}) {:.1} ms = {:.3}× the best fixed ({} {}, {:.1} ms); the worst {} {} {:.1} ms",
            auto.seed,
            auto.world,
            auto.choice.as_deref().unwrap_or(""),
            auto.median_s * 1e3,
            auto.median_s / best.median_s,
            best.strategy,
            best.layout,
            best.median_s * 1e3,
            worst.strategy,
            worst.layout,
            worst.median_s * 1e3,
        );
    }
    // The model's predictions against the measurements.
    let errs: Vec<f64> = rows.iter().filter_map(|r| r.predicted_s.map(|p| (p / r.median_s - 1.0) * 100.0)).collect();
    if !errs.is_empty() {
        let mean_abs = errs.iter().map(|e| e.abs()).sum::<f64>() / errs.len() as f64;
        let worst = errs.iter().copied().fold(0.0f64, |a, e| if e.abs() > a.abs() { e } else { a });
        println!(
            "model vs measured: mean |error| {mean_abs:.1}%, worst {worst:+.1}% over {} configurations",
            errs.len()
        );
    }
}
