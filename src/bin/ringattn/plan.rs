//! `ringattn plan` and `ringattn simulate`: the analytic cost model of `ringattn::plan` from
//! the command line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use ringattn::parallel::Strategy;
use ringattn::plan::{self, Calibration, Choice, ClusterSpec, JobSpec, LinkSharing, Plan, Rejected, Simulation};
use ringattn::{DType, Error, Result};
use serde::Serialize;

use crate::plot::line_chart;

/// The cluster and job options shared by `plan` and `simulate`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GPUs per node: ranks k·G .. (k+1)·G share node k.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// Key/value heads (GQA when fewer than --heads) [default: --heads].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension (of q and k; of v too unless --head-dim-v).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Head dimension of v and o, when it differs from q and k's (multi-head latent
    /// attention: --head-dim 192 --head-dim-v 128) [default: --head-dim].
    #[arg(long)]
    pub head_dim_v: Option<usize>,
    /// Batch size (sequences of --seq tokens each).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Element type of q, k, v, o: bf16 or f16 (2 bytes), f32 (4 bytes: what the crate's
    /// host communicators move).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Causal mask (FLOPs halved; zigzag layout for rings).
    #[arg(long)]
    pub causal: bool,
    /// Passes per step: forward, backward or both.
    #[arg(long, default_value = "both")]
    pub pass: String,
    /// Layers whose saved q, k, v, o, LSE stay in memory for the backward.
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Intra-node bandwidth, GB/s per GPU and direction [default: 370, achieved NVLink4,
    /// or the calibration's].
    #[arg(long, value_name = "GB/s")]
    pub intra_gbps: Option<f64>,
    /// Inter-node bandwidth, GB/s per GPU and direction [default: 50, one IB NDR NIC per
    /// GPU, or the calibration's].
    #[arg(long, value_name = "GB/s")]
    pub inter_gbps: Option<f64>,
    /// Intra-node latency per message, µs [default: 5, or the calibration's].
    #[arg(long, value_name = "US")]
    pub intra_latency_us: Option<f64>,
    /// Inter-node latency per message, µs [default: 10, or the calibration's].
    #[arg(long, value_name = "US")]
    pub inter_latency_us: Option<f64>,
    /// Achieved attention kernel rate per GPU, TFLOP/s: one value for forward and
    /// backward, or FWD,BWD [default: 350,300, or the calibration's].
    #[arg(long, value_name = "FWD[,BWD]")]
    pub kernel_tflops: Option<String>,
    /// Memory per GPU the attention may use, GiB [default: 139, an H200].
    #[arg(long, value_name = "GIB")]
    pub memory_gib: Option<f64>,
    /// Every pair of ranks has its own link of the full bandwidth (the in-process link
    /// model), instead of a GPU's bandwidth being shared by its concurrent messages.
    #[arg(long)]
    pub per_peer_links: bool,
    /// Calibration file: the JSON of `ringattn bench --json` (kernel rates) or a ping-pong
    /// {"link": "intra"|"inter", "samples": [{"bytes", "seconds"}, ...]} (latency and
    /// bandwidth by least squares). Repeatable; later files win, explicit options win over
    /// files.
    #[arg(long, value_name = "FILE")]
    pub calibration: Vec<PathBuf>,
}

/// `ringattn plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// GPUs the sequence is split over.
    #[arg(long)]
    pub gpus: usize,
    /// Global sequence length, tokens (suffixes k = 1024, M = 1024²: 128k, 1M); with
    /// --seqlens, their sum [required otherwise].
    #[arg(long, value_parser = parse_tokens, required_unless_present = "seqlens")]
    pub seq: Option<usize>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub docs: DocArgs,
    /// Also write the plan (every choice with its transfers, the rejected placements and
    /// the recommendation) as JSON to this file (atomically).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Choices to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
}

/// Packed documents for `plan`: the model then weighs every layout per batch.
#[derive(Args, Debug, Clone, Default)]
pub struct DocArgs {
    /// Packed documents, causal each with --causal: `lognormal` (median 1500, σ 1, 128–16384
    /// tokens), `lognormal:MEDIAN:SIGMA:MIN:MAX`, or a list of lengths repeated to fill
    /// --seq; one batch per --doc-seeds. The model then ranks every strategy × layout per
    /// batch from the tokens each rank holds (its imbalance, the direct ring's bytes) and
    /// names what `--strategy auto` runs.
    #[arg(long, value_name = "DIST", conflicts_with = "seqlens")]
    pub docs: Option<String>,
    /// Batches drawn from --docs (seeds 0..N).
    #[arg(long, default_value_t = 1, requires = "docs")]
    pub doc_seeds: u64,
    /// One batch of documents of these lengths, tokens (they set --seq).
    #[arg(long, value_name = "L,L,...")]
    pub seqlens: Option<String>,
}

impl DocArgs {
    /// The batches `(seed, lengths)` of `s` tokens, or none without documents.
    fn batches(&self, seq: Option<usize>) -> Result<Vec<(Option<u64>, Vec<usize>)>> {
        if let Some(list) = &self.seqlens {
            let lens = parse_counts(list, "--seqlens")?;
            let total: usize = lens.iter().sum();
            if let Some(s) = seq.filter(|&s| s != total) {
                return Err(Error::InvalidArgument(format!("--seqlens sum to {total} tokens, --seq says {s}")));
            }
            return Ok(vec![(None, lens)]);
        }
        match (&self.docs, seq) {
            (Some(d), Some(s)) => {
                let dist: ringattn::random::DocLengths = d.parse()?;
                Ok((0..self.doc_seeds.max(1))
                    .map(|seed| (Some(seed), ringattn::random::document_lengths(seed, s, &dist)))
                    .collect())
            }
            _ => Ok(Vec::new()),
        }
    }
}

/// `ringattn simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// GPU counts [default: 8,16,32,64,128,256,512,1024].
    #[arg(long, value_name = "N,N,...")]
    pub gpus: Option<String>,
    /// Sequence lengths, tokens, with optional k/M suffixes [default: 32k,64k,...,4M].
    #[arg(long, value_name = "S,S,...")]
    pub seq: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Packed documents (log-normal form or a list, as `plan --docs`): instead of the grid of
    /// strategies, each GPU count × length is simulated on --doc-seeds batches, the ring
    /// with the zigzag layout against the balanced one and against the per-batch choice
    /// (`--strategy auto`), means over the batches.
    #[arg(long, value_name = "DIST")]
    pub docs: Option<String>,
    /// Batches per cell with --docs (seeds 0..N).
    #[arg(long, default_value_t = 5, requires = "docs")]
    pub doc_seeds: u64,
    /// Directory for simulation.json, simulation.csv and the plots (PNG and SVG): step time
    /// against sequence length per GPU count, against GPU count per sequence length, and the
    /// best strategy's time for every GPU count.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// A token count: an integer with an optional `k` (×1024) or `M` (×1024²) suffix.
pub fn parse_tokens(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{s}` is not a token count (an integer, optionally with k or M)"))
}

fn parse_counts(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| parse_tokens(x).map_err(|e| Error::InvalidArgument(format!("{what}: {e}"))))
        .collect::<Result<Vec<_>>>()
        .and_then(|v| {
            if v.is_empty() || v.contains(&0) {
                Err(Error::InvalidArgument(format!("{what} `{s}`: values must be at least 1")))
            } else {
                Ok(v)
            }
        })
}

impl ModelArgs {
    /// The cluster (defaults, then calibration files, then explicit options), the job
    /// template (its `seq` set by the caller) and the calibration applied.
    fn specs(&self, gpus: usize) -> Result<(ClusterSpec, JobSpec, Option<Calibration>)> {
        let mut cluster = ClusterSpec { gpus, gpus_per_node: self.gpus_per_node, ..Default::default() };
        let mut cal: Option<Calibration> = None;
        for path in &self.calibration {
            let c = Calibration::load(path)?;
            cal.get_or_insert_with(Calibration::default).merge(&c);
        }
        if let Some(c) = &cal {
            c.apply(&mut cluster);
        }
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut cluster.intra_gbps, self.intra_gbps);
        set(&mut cluster.inter_gbps, self.inter_gbps);
        set(&mut cluster.intra_latency_us, self.intra_latency_us);
        set(&mut cluster.inter_latency_us, self.inter_latency_us);
        set(&mut cluster.memory_gib, self.memory_gib);
        if let Some(k) = &self.kernel_tflops {
            let vals: Vec<f64> =
                k.split(',')
                    .map(|x| x.trim().parse::<f64>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| Error::InvalidArgument(format!("--kernel-tflops `{k}`: expected FWD or FWD,BWD")))?;
            match vals[..] {
                [f] => (cluster.fwd_tflops, cluster.bwd_tflops) = (f, f),
                [f, b] => (cluster.fwd_tflops, cluster.bwd_tflops) = (f, b),
                _ => return Err(Error::InvalidArgument(format!("--kernel-tflops `{k}`: expected FWD or FWD,BWD"))),
            }
        }
        if self.per_peer_links {
            cluster.links = LinkSharing::PerPeer;
        }
        let dtype: DType = self.dtype.parse()?;
        let job = JobSpec {
            seq: 1,
            batch: self.batch,
            heads: self.heads,
            kv_heads: self.kv_heads.unwrap_or(self.heads),
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v.filter(|&v| v != self.head_dim),
            dtype_bytes: dtype.size_of(),
            accum_bytes: 4,
            causal: self.causal,
            passes: self.pass.parse()?,
            layers: self.layers,
        };
        cluster.validate()?;
        job.validate()?;
        Ok((cluster, job, cal))
    }
}

/// Two lines describing the job and the cluster; `grid` leaves out the sequence length and
/// GPU count (which `simulate` varies).
fn describe(c: &ClusterSpec, j: &JobSpec, cal: Option<&Calibration>, grid: bool) -> String {
    let passes = match j.passes {
        plan::Passes::Forward => "forward",
        plan::Passes::Backward => "backward",
        plan::Passes::Both => "forward + backward",
    };
    let tokens = if grid { "N".to_string() } else { j.seq.to_string() };
    let gpus = if grid {
        format!("{} GPUs per node", c.gpus_per_node)
    } else {
        format!(
            "{} GPU{} ({} node{} of {})",
            c.gpus,
            if c.gpus == 1 { "" } else { "s" },
            c.nodes(),
            if c.nodes() == 1 { "" } else { "s" },
            c.gpus_per_node
        )
    };
    let mut s = format!(
        "job: {tokens} tokens × batch {}, {} query / {} kv heads, d = {}{}, {} bytes/element, {}, {passes}\n\
         cluster: {gpus}, intra {} GB/s + {} µs, inter {} GB/s + {} µs, kernel {} / {} TFLOP/s (fwd / bwd), {} GiB per GPU{}",
        j.batch,
        j.heads,
        j.kv_heads,
        j.head_dim,
        j.head_dim_v.map_or(String::new(), |v| format!(", d_v = {v}")),
        j.dtype_bytes,
        if j.causal { "causal" } else { "no mask" },
        fmt_num(c.intra_gbps),
        fmt_num(c.intra_latency_us),
        fmt_num(c.inter_gbps),
        fmt_num(c.inter_latency_us),
        fmt_num(c.fwd_tflops),
        fmt_num(c.bwd_tflops),
        fmt_num(c.memory_gib),
        if c.links == LinkSharing::PerPeer { ", per-peer links" } else { "" },
    );
    if let Some(cal) = cal {
        let mut what = Vec::new();
        if cal.fwd_tflops.is_some() || cal.bwd_tflops.is_some() {
            what.push("kernel rates");
        }
        if cal.intra.is_some() {
            what.push("intra-node link");
        }
        if cal.inter.is_some() {
            what.push("inter-node link");
        }
        s += &format!("\ncalibrated: {} (explicit options override)", what.join(", "));
    }
    s
}

/// A number without trailing zeros, at most 3 decimals.
fn fmt_num(x: f64) -> String {
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for w in text.split_whitespace() {
        let len = w.chars().count();
        if line > 0 && line + 1 + len > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(w);
        line += len;
    }
    out
}

fn placement_cells(c: &Choice) -> [String; 3] {
    let p = &c.placement;
    let nesting = match (p.strategy, p.nesting) {
        (Strategy::Usp, plan::Nesting::UlyssesInNode) => "ulysses in node",
        (Strategy::Usp, plan::Nesting::RingInNode) => "ring in node",
        _ => "-",
    };
    [p.strategy.name().to_string(), format!("{} × {}", p.ulysses, p.ring), nesting.to_string()]
}

fn choices_table(choices: &[Choice]) -> String {
    let header = [
        "#",
        "strategy",
        "u × r",
        "placement",
        "time ms",
        "compute ms",
        "exposed comm ms",
        "volume MiB/rank",
        "memory GiB/rank",
    ];
    let rows: Vec<Vec<String>> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let [s, ur, pl] = placement_cells(c);
            vec![
                (i + 1).to_string(),
                s,
                ur,
                pl,
                format!("{:.3}", c.time_s * 1e3),
                format!("{:.3}", c.compute_s * 1e3),
                format!("{:.3}", c.exposed_comm_s * 1e3),
                format!("{:.1}", c.bytes_sent as f64 / MIB),
                format!("{:.2}", c.memory_bytes as f64 / GIB),
            ]
        })
        .collect();
    table(&header, &rows, 4)
}

/// Aligns `rows` under `header`; the first `left` columns left-aligned, the rest right.
fn table(header: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i].saturating_sub(c.chars().count());
                if i < left {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(header.to_vec()) + "\n";
    for r in rows {
        out += &line(r.iter().map(String::as_str).collect());
        out.push('\n');
    }
    out
}

/// The rejected placements grouped by kind of reason.
fn rejected_summary(rejected: &[Rejected], heads: usize) -> String {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in rejected {
        let label = r.placement.label();
        let (key, item) = if r.reason.contains("not a multiple of the Ulysses degree") {
            (format!("{heads} query heads do not split evenly over the Ulysses degree"), label)
        } else if let Some(e) = r.estimate.as_ref().filter(|_| r.reason.contains("budget")) {
            ("memory per rank over the budget".to_string(), format!("{label} ({:.2} GiB)", e.memory_bytes as f64 / GIB))
        } else {
            (r.reason.clone(), label)
        };
        groups.entry(key).or_default().push(item);
    }
    let mut s = format!("rejected {} placement{}:\n", rejected.len(), if rejected.len() == 1 { "" } else { "s" });
    for (k, v) in groups {
        s += &format!("  {k}: {}\n", v.join(", "));
    }
    s
}

#[derive(Serialize)]
struct PlanReport<'a> {
    plan: &'a Plan,
    recommendation: String,
    calibration: Option<&'a Calibration>,
}

/// One batch's plan in `plan --docs` and its JSON.
#[derive(Serialize)]
struct BatchReport {
    seed: Option<u64>,
    plan: plan::BatchPlan,
}

fn batch_table(p: &plan::BatchPlan, top: usize) -> String {
    let header =
        ["#", "strategy", "u × r", "layout", "time ms", "compute ms", "wait ms", "imbalance", "MiB sent", "exchange"];
    let rows: Vec<Vec<String>> = p
        .choices
        .iter()
        .take(top)
        .enumerate()
        .map(|(i, c)| {
            vec![
                (i + 1).to_string(),
                c.placement.strategy.name().to_string(),
                format!("{} × {}", c.placement.ulysses, c.placement.ring),
                plan::layout_name(c.layout),
                format!("{:.3}", c.time_s * 1e3),
                format!("{:.3}", c.compute_s * 1e3),
                format!("{:.3}", c.wait_s * 1e3),
                format!("{:.3}", c.imbalance),
                format!("{:.1}", c.bytes_sent as f64 / MIB),
                match (c.placement.strategy, c.direct) {
                    (Strategy::Ulysses, _) => "all-to-all".into(),
                    (Strategy::AllGather, true) => "seen rows".into(),
                    (Strategy::AllGather, false) => "all rows".into(),
                    (_, true) => "direct ring".into(),
                    (_, false) => "pass-along ring".into(),
                },
            ]
        })
        .collect();
    table(&header, &rows, 4)
}

/// `plan --docs` / `--seqlens`: every strategy × layout per batch.
fn plan_documents(a: &PlanArgs, batches: Vec<(Option<u64>, Vec<usize>)>) -> Result<ExitCode> {
    let seq = batches[0].1.iter().sum();
    let (cluster, mut job, cal) = a.model.specs(a.gpus)?;
    job.seq = seq;
    println!("ringattn plan: per attention layer, packed documents, predicted by the analytic model per batch");
    println!("{}", describe(&cluster, &job, cal.as_ref(), false));
    println!(
        "time: the slowest rank's end of each pass; wait: time less the busiest rank's attention; MiB sent: all ranks\n"
    );
    let mut reports = Vec::new();
    for (seed, lens) in batches {
        let p = plan::plan_batch(&cluster, &job, &lens)?;
        let what = seed.map_or(String::new(), |s| format!("seed {s}, "));
        println!("batch: {what}{} documents (longest {})", lens.len(), lens.iter().max().unwrap_or(&0));
        print!("{}", batch_table(&p, a.top));
        match p.best() {
            Some(best) => {
                let vs = |st: Strategy, l: ringattn::Layout| {
                    p.find(st, l).map_or(String::new(), |c| {
                        format!(", {:.2}× the {} ({:.3} ms)", c.time_s / best.time_s, c.label(), c.time_s * 1e3)
                    })
                };
                println!(
                    "auto: {} ({:.3} ms; `{} --layout {}`){}{}\n",
                    best.label(),
                    best.time_s * 1e3,
                    best.placement.command_hint(),
                    plan::layout_name(best.layout),
                    vs(Strategy::Ring, ringattn::Layout::Zigzag),
                    vs(Strategy::Ring, ringattn::Layout::Balanced),
                );
            }
            None => println!("no valid placement\n"),
        }
        if !p.rejected.is_empty() {
            print!("{}", rejected_summary(&p.rejected, job.heads));
        }
        reports.push(BatchReport { seed, plan: p });
    }
    if let Some(path) = &a.json {
        ringattn::io::write_json(path, &reports)?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn plan(a: &PlanArgs) -> Result<ExitCode> {
    let batches = a.docs.batches(a.seq)?;
    if !batches.is_empty() {
        return plan_documents(a, batches);
    }
    let (cluster, mut job, cal) = a.model.specs(a.gpus)?;
    job.seq = a.seq.ok_or_else(|| Error::InvalidArgument("--seq is required without --seqlens".into()))?;
    let p = plan::plan(&cluster, &job)?;
    println!("ringattn plan: per attention layer and rank, predicted by the analytic model");
    println!("{}\n", describe(&cluster, &job, cal.as_ref(), false));
    let shown = &p.choices[..p.choices.len().min(a.top)];
    if shown.is_empty() {
        println!("no valid placement\n");
    } else {
        print!("{}", choices_table(shown));
        if p.choices.len() > shown.len() {
            println!("({} more valid placements; --top {} shows them)", p.choices.len() - shown.len(), p.choices.len());
        }
        println!();
    }
    let rec = p.recommendation();
    println!("{}\n", wrap(&rec, 100));
    if !p.rejected.is_empty() {
        print!("{}", rejected_summary(&p.rejected, job.heads));
    }
    if let Some(path) = &a.json {
        ringattn::io::write_json(path, &PlanReport { plan: &p, recommendation: rec, calibration: cal.as_ref() })?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

const SIM_STRATEGIES: [Strategy; 4] = [Strategy::Ring, Strategy::Ulysses, Strategy::Usp, Strategy::AllGather];

fn sim_table(sim: &Simulation) -> String {
    let header = ["gpus", "seq", "ring ms", "ulysses ms", "usp ms", "usp u × r", "allgather ms", "best"];
    let mut rows = Vec::new();
    for &g in &sim.gpus {
        for &s in &sim.seqs {
            let cell = |st: Strategy| sim.cell(g, s).find(|r| r.strategy == st);
            let ms = |st: Strategy| match cell(st) {
                Some(r) => match (r.time_s, &r.note) {
                    (Some(t), _) => format!("{:.3}", t * 1e3),
                    (None, Some(n)) if n.contains("GiB") => "oom".into(),
                    (None, Some(n)) if n.contains("Ulysses degree") => "heads".into(),
                    _ => "-".into(),
                },
                None => "-".into(),
            };
            let usp = cell(Strategy::Usp)
                .and_then(|r| r.placement)
                .map_or("-".to_string(), |p| format!("{} × {}", p.ulysses, p.ring));
            let best = sim.cell(g, s).find(|r| r.best).map_or("none".to_string(), |r| {
                let name = r.strategy.name();
                match r.placement {
                    Some(p) if p.strategy == Strategy::Usp => format!("{name} {}×{}", p.ulysses, p.ring),
                    _ => name.to_string(),
                }
            });
            let mut row = vec![g.to_string(), crate::plot::tick(s as f64)];
            if g == 1 {
                row.extend([ms(Strategy::Single), "-".into(), "-".into(), "-".into(), "-".into()]);
            } else {
                row.extend([
                    ms(SIM_STRATEGIES[0]),
                    ms(SIM_STRATEGIES[1]),
                    ms(SIM_STRATEGIES[2]),
                    usp,
                    ms(SIM_STRATEGIES[3]),
                ]);
            }
            row.push(best);
            rows.push(row);
        }
    }
    table(&header, &rows, 0)
}

/// File-name form of a token count: `32k`, `1M`, or the number.
fn seq_name(s: usize) -> String {
    crate::plot::tick(s as f64)
}

fn write_outputs(sim: &Simulation, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    let mut files = Vec::new();
    let json = dir.join("simulation.json");
    ringattn::io::write_json(&json, sim)?;
    files.push(json);
    let csv = dir.join("simulation.csv");
    ringattn::io::write_atomic(&csv, sim.to_csv().as_bytes())?;
    files.push(csv);
    let job = &sim.job;
    let what = format!(
        "{} q / {} kv heads, d = {}{}",
        job.heads,
        job.kv_heads,
        job.head_dim,
        if job.causal { ", causal" } else { "" }
    );
    for &g in &sim.gpus {
        files.extend(line_chart(
            &dir.join(format!("time_vs_seq_{g}gpus")),
            &format!("Predicted step time on {g} GPUs ({what})"),
            "sequence length (tokens)",
            "time per layer (ms)",
            &sim.series_vs_seq(g),
            true,
            true,
        )?);
    }
    for &s in &sim.seqs {
        files.extend(line_chart(
            &dir.join(format!("time_vs_gpus_{}", seq_name(s))),
            &format!("Predicted step time for {} tokens ({what})", seq_name(s)),
            "GPUs",
            "time per layer (ms)",
            &sim.series_vs_gpus(s),
            true,
            true,
        )?);
    }
    files.extend(line_chart(
        &dir.join("best_vs_seq"),
        &format!("Best strategy's predicted step time ({what})"),
        "sequence length (tokens)",
        "time per layer (ms)",
        &sim.best_vs_seq(),
        true,
        true,
    )?);
    Ok(files)
}

pub fn simulate(a: &SimulateArgs) -> Result<ExitCode> {
    let gpus = match &a.gpus {
        Some(s) => parse_counts(s, "--gpus")?,
        None => Simulation::default_gpus(),
    };
    let seqs = match &a.seq {
        Some(s) => parse_counts(s, "--seq")?,
        None => Simulation::default_seqs(),
    };
    if let Some(docs) = &a.docs {
        return simulate_documents(a, docs, &gpus, &seqs);
    }
    let (cluster, job, cal) = a.model.specs(gpus[0])?;
    let sim = plan::simulate(&cluster, &job, &gpus, &seqs)?;
    println!("ringattn simulate: predicted time per attention layer (ms), best placement of each strategy");
    println!("{}\n", describe(&cluster, &job, cal.as_ref(), true));
    print!("{}", sim_table(&sim));
    println!("(oom: over the memory budget; heads: the query heads do not split over the Ulysses degree)");
    if let Some(dir) = &a.out {
        let files = write_outputs(&sim, dir)?;
        println!("wrote {} files to {}", files.len(), dir.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// One cell of `simulate --docs`: means over the batches.
#[derive(Serialize)]
struct DocSimRow {
    gpus: usize,
    seq: usize,
    seeds: u64,
    zigzag_ring_ms: Vec<f64>,
    balanced_ring_ms: Vec<f64>,
    auto_ms: Vec<f64>,
    auto_choice: Vec<String>,
    zigzag_imbalance: Vec<f64>,
    balanced_imbalance: Vec<f64>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn simulate_documents(a: &SimulateArgs, docs: &str, gpus: &[usize], seqs: &[usize]) -> Result<ExitCode> {
    let dist: ringattn::random::DocLengths = docs.parse()?;
    let (mut cluster, mut job, cal) = a.model.specs(gpus[0])?;
    println!("ringattn simulate --docs {docs}: predicted time per attention layer, {} batches per cell", a.doc_seeds);
    println!("{}\n", describe(&cluster, &job, cal.as_ref(), true));
    let header = [
        "gpus",
        "seq",
        "zigzag ring ms",
        "imbalance",
        "balanced ring ms",
        "imbalance",
        "speedup",
        "auto ms",
        "auto speedup",
        "auto's choices",
    ];
    let total = (gpus.len() * seqs.len()) as u64 * a.doc_seeds;
    let (rows, out) = crate::progress::with_progress("batches", total, |done| -> Result<_> {
        let mut rows = Vec::new();
        let mut out = Vec::new();
        for &g in gpus {
            cluster.gpus = g;
            for &s in seqs {
                job.seq = s;
                let mut r = DocSimRow {
                    gpus: g,
                    seq: s,
                    seeds: a.doc_seeds,
                    zigzag_ring_ms: vec![],
                    balanced_ring_ms: vec![],
                    auto_ms: vec![],
                    auto_choice: vec![],
                    zigzag_imbalance: vec![],
                    balanced_imbalance: vec![],
                };
                for seed in 0..a.doc_seeds {
                    let lens = ringattn::random::document_lengths(seed, s, &dist);
                    let p = plan::plan_batch(&cluster, &job, &lens)?;
                    let pick = |st, l| {
                        p.find(st, l).ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "{g} GPUs, {s} tokens: the {st} strategy cannot run this job"
                            ))
                        })
                    };
                    let z = pick(Strategy::Ring, ringattn::Layout::Zigzag)?;
                    let b = pick(Strategy::Ring, ringattn::Layout::Balanced)?;
                    let best = p.best().expect("the ring is valid");
                    r.zigzag_ring_ms.push(z.time_s * 1e3);
                    r.balanced_ring_ms.push(b.time_s * 1e3);
                    r.auto_ms.push(best.time_s * 1e3);
                    r.auto_choice.push(best.label());
                    r.zigzag_imbalance.push(z.imbalance);
                    r.balanced_imbalance.push(b.imbalance);
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let ratio = |x: &[f64]| mean(&r.zigzag_ring_ms.iter().zip(x).map(|(z, y)| z / y).collect::<Vec<_>>());
                let mut choices: Vec<String> = r.auto_choice.clone();
                choices.sort();
                choices.dedup();
                rows.push(vec![
                    g.to_string(),
                    crate::plot::tick(s as f64),
                    format!("{:.3}", mean(&r.zigzag_ring_ms)),
                    format!("{:.2}", mean(&r.zigzag_imbalance)),
                    format!("{:.3}", mean(&r.balanced_ring_ms)),
                    format!("{:.3}", mean(&r.balanced_imbalance)),
                    format!("{:.2}×", ratio(&r.balanced_ring_ms)),
                    format!("{:.3}", mean(&r.auto_ms)),
                    format!("{:.2}×", ratio(&r.auto_ms)),
                    choices.join("; "),
                ]);
                out.push(r);
            }
        }
        Ok((rows, out))
    })?;
    print!("{}", table(&header, &rows, 0));
    println!("(means over the batches; speedups: the zigzag ring's time over the other's, per batch, then averaged)");
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
        let path = dir.join("simulation-docs.json");
        ringattn::io::write_json(&path, &out)?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts() {
        assert_eq!(parse_tokens("1M"), Ok(1 << 20));
        assert_eq!(parse_tokens("128k"), Ok(131072));
        assert_eq!(parse_tokens("4096"), Ok(4096));
        assert!(parse_tokens("1.5M").is_err());
        assert!(parse_tokens("x").is_err());
        assert!(parse_counts("8,0", "--gpus").is_err());
    }

    #[test]
    fn wrapping_and_tables() {
        assert_eq!(wrap("aa bb cc", 5), "aa bb\ncc");
        let t = table(&["a", "bb"], &[vec!["xyz".into(), "1".into()]], 1);
        assert_eq!(t, "a    bb\nxyz   1\n");
    }
}
