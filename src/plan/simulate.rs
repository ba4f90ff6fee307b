//! Predicted step time per strategy over a grid of GPU counts and sequence lengths.

use serde::Serialize;

use super::{plan, ClusterSpec, JobSpec, Placement, GIB};
use crate::parallel::Strategy;
use crate::Result;

/// One cell of a [`Simulation`]: the best placement of one strategy for one GPU count and
/// sequence length, or why there is none.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimRow {
    /// GPUs.
    pub gpus: usize,
    /// Sequence length, tokens.
    pub seq: usize,
    /// The strategy.
    #[serde(serialize_with = "super::serialize_strategy")]
    pub strategy: Strategy,
    /// Its fastest valid placement (for USP: the best `u × r` and nesting).
    pub placement: Option<Placement>,
    /// Predicted step time, seconds.
    pub time_s: Option<f64>,
    /// Exposed communication, seconds.
    pub exposed_comm_s: Option<f64>,
    /// Bytes sent per rank.
    pub bytes_sent: Option<u64>,
    /// Memory per rank, bytes.
    pub memory_bytes: Option<u64>,
    /// Whether it is the fastest strategy of its cell.
    pub best: bool,
    /// Why no placement is valid, when none is.
    pub note: Option<String>,
}

/// Predicted step time of every strategy on a grid of GPU counts × sequence lengths.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Simulation {
    /// The cluster (its `gpus` is replaced by each count of the grid).
    pub cluster: ClusterSpec,
    /// The job (its `seq` is replaced by each length of the grid).
    pub job: JobSpec,
    /// GPU counts.
    pub gpus: Vec<usize>,
    /// Sequence lengths, tokens.
    pub seqs: Vec<usize>,
    /// One row per (GPU count, sequence length, strategy), in that order.
    pub rows: Vec<SimRow>,
}

/// The strategies simulated, in table order.
const STRATEGIES: [Strategy; 4] = [Strategy::Ring, Strategy::Ulysses, Strategy::Usp, Strategy::AllGather];

/// Plans `job` on `cluster` for every GPU count of `gpus` and length of `seqs`, keeping the
/// best placement of each strategy ([`super::plan`]).
///
/// ```
/// use ringattn::plan::{simulate, ClusterSpec, JobSpec, Simulation};
///
/// let sim = simulate(&ClusterSpec::default(), &JobSpec::default(), &[8, 16], &[32768, 65536])?;
/// assert_eq!(sim.rows.len(), 2 * 2 * 4);
/// // Per strategy, step time grows with the sequence.
/// let ring = &sim.series_vs_seq(8)[0];
/// assert_eq!(ring.0, "ring");
/// assert!(ring.1[0].1 < ring.1[1].1);
/// assert_eq!(Simulation::default_gpus().last(), Some(&1024));
/// # Ok::<(), ringattn::Error>(())
/// ```
///
/// # Errors
/// As [`super::plan`].
pub fn simulate(cluster: &ClusterSpec, job: &JobSpec, gpus: &[usize], seqs: &[usize]) -> Result<Simulation> {
    let mut rows = Vec::with_capacity(gpus.len() * seqs.len() * STRATEGIES.len());
    for &g in gpus {
        for &s in seqs {
            let c = ClusterSpec { gpus: g, ..cluster.clone() };
            let j = JobSpec { seq: s, ..job.clone() };
            let p = plan(&c, &j)?;
            let best = p.best().map(|b| b.placement.strategy);
            let list: &[Strategy] = if g == 1 { &[Strategy::Single] } else { &STRATEGIES };
            for &st in list {
                let row = match p.best_of(st) {
                    Some(ch) => SimRow {
                        gpus: g,
                        seq: s,
                        strategy: st,
                        placement: Some(ch.placement),
                        time_s: Some(ch.time_s),
                        exposed_comm_s: Some(ch.exposed_comm_s),
                        bytes_sent: Some(ch.bytes_sent),
                        memory_bytes: Some(ch.memory_bytes),
                        best: best == Some(st),
                        note: None,
                    },
                    None => {
                        let reasons: Vec<&str> = p
                            .rejected
                            .iter()
                            .filter(|r| r.placement.strategy == st)
                            .map(|r| r.reason.as_str())
                            .collect();
                        let note = reasons
                            .iter()
                            .find(|r| r.contains("GiB"))
                            .or(reasons.first())
                            .map_or_else(|| "no placement".to_string(), |r| r.to_string());
                        SimRow {
                            gpus: g,
                            seq: s,
                            strategy: st,
                            placement: None,
                            time_s: None,
                            exposed_comm_s: None,
                            bytes_sent: None,
                            memory_bytes: None,
                            best: false,
                            note: Some(note),
                        }
                    }
                };
                rows.push(row);
            }
        }
    }
    Ok(Simulation { cluster: cluster.clone(), job: job.clone(), gpus: gpus.to_vec(), seqs: seqs.to_vec(), rows })
}

impl Simulation {
    /// The default GPU counts: 8, 16, ..., 1024.
    pub fn default_gpus() -> Vec<usize> {
        (3..=10).map(|k| 1usize << k).collect()
    }

    /// The default sequence lengths: 32K, 64K, ..., 4M tokens (2¹⁵ .. 2²²).
    pub fn default_seqs() -> Vec<usize> {
        (15..=22).map(|k| 1usize << k).collect()
    }

    /// The rows of one cell.
    pub fn cell(&self, gpus: usize, seq: usize) -> impl Iterator<Item = &SimRow> {
        self.rows.iter().filter(move |r| r.gpus == gpus && r.seq == seq)
    }

    fn series(&self, keep: impl Fn(&SimRow) -> Option<f64>) -> Vec<(String, Vec<(f64, f64)>)> {
        let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for r in &self.rows {
            let (Some(x), Some(t)) = (keep(r), r.time_s) else { continue };
            let name = r.strategy.name();
            match out.iter_mut().find(|s| s.0 == name) {
                Some(s) => s.1.push((x, t * 1e3)),
                None => out.push((name.to_string(), vec![(x, t * 1e3)])),
            }
        }
        out
    }

    /// Step time (ms) against sequence length per strategy, for `gpus` GPUs.
    pub fn series_vs_seq(&self, gpus: usize) -> Vec<(String, Vec<(f64, f64)>)> {
        self.series(|r| (r.gpus == gpus).then_some(r.seq as f64))
    }

    /// Step time (ms) against GPU count per strategy, for `seq` tokens.
    pub fn series_vs_gpus(&self, seq: usize) -> Vec<(String, Vec<(f64, f64)>)> {
        self.series(|r| (r.seq == seq).then_some(r.gpus as f64))
    }

    /// The best strategy's step time (ms) against sequence length, one series per GPU
    /// count.
    pub fn best_vs_seq(&self) -> Vec<(String, Vec<(f64, f64)>)> {
        self.gpus
            .iter()
            .map(|&g| {
                let pts = self
                    .rows
                    .iter()
                    .filter(|r| r.gpus == g && r.best)
                    .filter_map(|r| r.time_s.map(|t| (r.seq as f64, t * 1e3)))
                    .collect();
                (format!("{g} GPUs"), pts)
            })
            .collect()
    }

    /// The rows as CSV: `gpus,seq,strategy,ulysses,ring,nesting,time_ms,exposed_comm_ms,
    /// bytes_sent,memory_gib,best,note` (empty fields where a strategy has no valid
    /// placement).
    pub fn to_csv(&self) -> String {
        let mut s = String::from(
            "gpus,seq,strategy,ulysses,ring,nesting,time_ms,exposed_comm_ms,bytes_sent,memory_gib,best,note\n",
        );
        let opt = |x: Option<String>| x.unwrap_or_default();
        for r in &self.rows {
            let p = r.placement.as_ref();
            let nesting = p.map(|p| match p.nesting {
                super::Nesting::UlyssesInNode => "ulysses-in-node".to_string(),
                super::Nesting::RingInNode => "ring-in-node".to_string(),
            });
            s += &format!(
                "{},{},{},{},{},{},{},{},{},{},{},{}\n",
                r.gpus,
                r.seq,
                r.strategy.name(),
                opt(p.map(|p| p.ulysses.to_string())),
                opt(p.map(|p| p.ring.to_string())),
                opt(nesting),
                opt(r.time_s.map(|t| format!("{:.6}", t * 1e3))),
                opt(r.exposed_comm_s.map(|t| format!("{:.6}", t * 1e3))),
                opt(r.bytes_sent.map(|b| b.to_string())),
                opt(r.memory_bytes.map(|m| format!("{:.4}", m as f64 / GIB))),
                r.best,
                opt(r.note.as_ref().map(|n| format!("\"{}\"", n.replace('"', "'")))),
            );
        }
        s
    }
}
