//! Calibration of the model from measurements: kernel rates from `ringattn bench --json`,
//! link latency and bandwidth from a ping-pong.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ClusterSpec;
use crate::{Error, Result};

/// Which link a measurement is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Between GPUs of one node (NVLink; shared memory for processes on one host).
    #[default]
    Intra,
    /// Between nodes (InfiniBand).
    Inter,
}

/// One ping-pong sample: a message of `bytes` took `seconds` one way (half the round trip).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PingPongSample {
    /// Message size, bytes.
    pub bytes: f64,
    /// One-way time, seconds.
    pub seconds: f64,
}

/// A ping-pong measurement of one link: one-way times of messages of several sizes, fitted
/// to `t = latency + bytes / bandwidth` by least squares ([`PingPong::fit`]).
///
/// As JSON: `{"link": "intra", "samples": [{"bytes": 1024, "seconds": 6.1e-6}, ...]}`
/// (`link` optional, intra by default; a sample may also be a `[bytes, seconds]` pair, or
/// give `ms` or `us` instead of `seconds`).
///
/// ```
/// use ringattn::plan::{LinkKind, PingPong, PingPongSample};
///
/// // 10 µs + bytes / 25 GB/s, measured exactly.
/// let samples = [1e3, 1e5, 1e7].map(|b| PingPongSample { bytes: b, seconds: 10e-6 + b / 25e9 }).to_vec();
/// let fit = PingPong { link: LinkKind::Inter, samples }.fit()?;
/// assert!((fit.latency_s - 10e-6).abs() < 1e-12 && (fit.bandwidth_gbps - 25.0).abs() < 1e-9);
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PingPong {
    /// The link measured.
    #[serde(default)]
    pub link: LinkKind,
    /// The samples.
    pub samples: Vec<PingPongSample>,
}

/// A fitted link: `t = latency_s + bytes / (bandwidth_gbps·10⁹)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkFit {
    /// The link.
    pub link: LinkKind,
    /// Latency per message, seconds.
    pub latency_s: f64,
    /// Bandwidth, GB/s.
    pub bandwidth_gbps: f64,
    /// Samples fitted.
    pub samples: usize,
    /// Coefficient of determination of the fit (1: exact).
    pub r2: f64,
}

impl PingPong {
    /// Least-squares fit of `t = α + β·bytes`: `β = cov(bytes, t) / var(bytes)`,
    /// `α = mean(t) − β·mean(bytes)`; bandwidth `1/β`. A negative intercept (noise at small
    /// sizes) is clamped to zero latency and `β` refitted through the origin,
    /// `β = Σ bytes·t / Σ bytes²`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] with fewer than two distinct sizes, a negative, zero-size
    /// or non-finite sample, or times that do not grow with size (no positive bandwidth).
    pub fn fit(&self) -> Result<LinkFit> {
        let s = &self.samples;
        if let Some(bad) =
            s.iter().find(|x| !(x.bytes.is_finite() && x.seconds.is_finite()) || x.bytes < 0.0 || x.seconds < 0.0)
        {
            return Err(Error::InvalidArgument(format!(
                "ping-pong: sample of {} bytes in {} s is not a finite non-negative measurement",
                bad.bytes, bad.seconds
            )));
        }
        let m = s.len() as f64;
        let (mx, my) = (s.iter().map(|x| x.bytes).sum::<f64>() / m, s.iter().map(|x| x.seconds).sum::<f64>() / m);
        let sxx: f64 = s.iter().map(|x| (x.bytes - mx).powi(2)).sum();
        let sxy: f64 = s.iter().map(|x| (x.bytes - mx) * (x.seconds - my)).sum();
        if s.len() < 2 || sxx <= 0.0 {
            return Err(Error::InvalidArgument(format!(
                "ping-pong: {} sample(s); the fit needs at least two distinct message sizes",
                s.len()
            )));
        }
        let mut beta = sxy / sxx;
        let mut alpha = my - beta * mx;
        if alpha < 0.0 {
            alpha = 0.0;
            beta =
                s.iter().map(|x| x.bytes * x.seconds).sum::<f64>() / s.iter().map(|x| x.bytes * x.bytes).sum::<f64>();
        }
        if !(beta.is_finite() && beta > 0.0) {
            return Err(Error::InvalidArgument(
                "ping-pong: times do not grow with message size; no bandwidth can be fitted".into(),
            ));
        }
        let ss_tot: f64 = s.iter().map(|x| (x.seconds - my).powi(2)).sum();
        let ss_res: f64 = s.iter().map(|x| (x.seconds - alpha - beta * x.bytes).powi(2)).sum();
        let r2 = if ss_tot > 0.0 { 1.0 - ss_res / ss_tot } else { 1.0 };
        Ok(LinkFit { link: self.link, latency_s: alpha, bandwidth_gbps: 1.0 / beta / 1e9, samples: s.len(), r2 })
    }

    /// Reads a ping-pong from its JSON (see [`PingPong`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is missing or malformed.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::InvalidArgument(format!("ping-pong JSON: {e}")))?;
        ping_pong_of(&v)?.ok_or_else(|| Error::InvalidArgument("ping-pong JSON: no `samples` array".into()))
    }
}

/// What measurements say about a cluster: kernel rates and fitted links. Fields left `None`
/// keep the cluster's values ([`Calibration::apply`]).
///
/// Read from the JSON `ringattn bench --json` writes — `{"backend", "b", "s", "h_q", "d",
/// "causal", "results": [{"pass": "forward", "median_ms", "tflops", ...}, ...]}` — or from
/// a ping-pong ([`PingPong`]). The bench parsing is tolerant: the top level may be one
/// report, an array of reports, or an object holding such an array under any key; a report
/// holds `results` or (a sweep's) `records`, whose entries may carry their own `seq`/`s`,
/// `world`, `b`, `h_q`, `d` (else the report's); a pass (`pass` or `passes`) is
/// `forward`/`fwd`, `backward`/`bwd` or `forward+backward`/`both`; a result without
/// `tflops` (or `tflops_per_rank`) has it computed from `median_ms` (or `ms`, or `seconds`)
/// and the shape (`4·b·h_q·s²·d`, halved when causal, 2.5× for the backward); a backward
/// rate is also derived from a forward+backward time and a forward time of the same
/// problem, `2.5·F / (t_both − t_fwd)`; entries of several ranks (`world` > 1) are skipped,
/// since only a single rank measures the kernel alone; of several usable results of one
/// pass, the one of the largest problem (`b·h_q·s²·d`) is taken, as long sequences reach
/// the kernel's steady rate. Unknown fields are ignored.
///
/// ```
/// use ringattn::plan::{Calibration, ClusterSpec};
///
/// let bench = r#"{"backend": "cuda", "device": "H200", "dtype": "bf16", "b": 1, "s": 16384,
///   "h_q": 32, "h_kv": 8, "d": 128, "causal": true,
///   "results": [{"pass": "forward", "median_ms": 4.4, "min_ms": 4.3, "tflops": 500.0, "samples_ms": [4.4]},
///               {"pass": "backward", "median_ms": 13.0, "min_ms": 12.9, "tflops": 420.0, "samples_ms": [13.0]}]}"#;
/// let cal = Calibration::from_json(bench)?;
/// let mut cluster = ClusterSpec::default();
/// cal.apply(&mut cluster);
/// assert_eq!((cluster.fwd_tflops, cluster.bwd_tflops), (500.0, 420.0));
/// # Ok::<(), ringattn::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Calibration {
    /// Forward kernel rate, TFLOP/s.
    pub fwd_tflops: Option<f64>,
    /// Backward kernel rate, TFLOP/s.
    pub bwd_tflops: Option<f64>,
    /// The intra-node link.
    pub intra: Option<LinkFit>,
    /// The inter-node link.
    pub inter: Option<LinkFit>,
}

impl Calibration {
    /// Reads a calibration from JSON text: a ping-pong (an object with `samples`) or bench
    /// report(s) (see [`Calibration`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the text is not JSON or holds no usable measurement.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::InvalidArgument(format!("calibration JSON: {e}")))?;
        if let Some(pp) = ping_pong_of(&v)? {
            let fit = pp.fit()?;
            return Ok(match fit.link {
                LinkKind::Intra => Calibration { intra: Some(fit), ..Default::default() },
                LinkKind::Inter => Calibration { inter: Some(fit), ..Default::default() },
            });
        }
        let mut reports = Vec::new();
        collect_reports(&v, &mut reports, 0);
        let mut best: [Option<(f64, f64)>; 2] = [None, None]; // (work, tflops) per pass
        let mut keep = |pass: usize, work: f64, tflops: f64| {
            if tflops.is_finite() && tflops > 0.0 && best[pass].is_none_or(|(bw, _)| work > bw) {
                best[pass] = Some((work, tflops));
            }
        };
        for rep in reports {
            let get = |item: &Value, k: &str| item.get(k).or_else(|| rep.get(k)).and_then(Value::as_f64);
            let causal = rep.get("causal").and_then(Value::as_bool).unwrap_or(false);
            // Forward and forward+backward seconds of single-rank sweep records, by work.
            let mut fwd_s: Vec<(f64, f64, f64)> = Vec::new(); // (work, forward FLOPs, seconds)
            let mut both_s: Vec<(f64, f64, f64)> = Vec::new();
            let items = rep.get("results").or_else(|| rep.get("records")).and_then(Value::as_array);
            for r in items.into_iter().flatten() {
                if get(r, "world").is_some_and(|w| w > 1.0) {
                    continue;
                }
                let work = match (get(r, "b"), get(r, "seq").or_else(|| get(r, "s")), get(r, "h_q"), get(r, "d")) {
                    (Some(b), Some(s), Some(h), Some(d)) => Some(b * s * s * h * d),
                    _ => None,
                };
                let pass = match r.get("pass").or_else(|| r.get("passes")).and_then(Value::as_str) {
                    Some("forward" | "fwd") => 0,
                    Some("backward" | "bwd") => 1,
                    Some("forward+backward" | "both") => 2,
                    _ => continue,
                };
                let seconds = r
                    .get("median_ms")
                    .or_else(|| r.get("ms"))
                    .and_then(Value::as_f64)
                    .map(|ms| ms * 1e-3)
                    .or_else(|| r.get("seconds").and_then(Value::as_f64));
                let fwd_flops =
                    work.map(|w| crate::flops::FORWARD_FLOPS_PER_PAIR_DIM * w * if causal { 0.5 } else { 1.0 });
                if let (Some(t), Some(f), Some(w)) = (seconds.filter(|&t| t > 0.0), fwd_flops, work) {
                    match pass {
                        0 => fwd_s.push((w, f, t)),
                        2 => both_s.push((w, f, t)),
                        _ => {}
                    }
                }
                if pass == 2 {
                    continue;
                }
                let rate = r.get("tflops").or_else(|| r.get("tflops_per_rank")).and_then(Value::as_f64);
                let tflops = match (rate, seconds, fwd_flops) {
                    (Some(t), _, _) => t,
                    (None, Some(t), Some(f)) if t > 0.0 => f * if pass == 1 { 2.5 } else { 1.0 } / t / 1e12,
                    _ => continue,
                };
                keep(pass, work.unwrap_or(0.0), tflops);
            }
            // A backward rate from a forward+backward time less the forward time of the same
            // problem: 2.5·F / (t_both − t_fwd).
            for &(w, f, tb) in &both_s {
                if let Some(&(_, _, tf)) = fwd_s.iter().find(|x| x.1 == f) {
                    if tb > tf {
                        keep(1, w, 2.5 * f / (tb - tf) / 1e12);
                    }
                }
            }
        }
        let cal =
            Calibration { fwd_tflops: best[0].map(|x| x.1), bwd_tflops: best[1].map(|x| x.1), ..Default::default() };
        if cal.fwd_tflops.is_none() && cal.bwd_tflops.is_none() {
            return Err(Error::InvalidArgument(
                "calibration JSON: no ping-pong `samples` and no single-rank bench result with `pass` and `tflops` (or `median_ms` and the shape)".into(),
            ));
        }
        Ok(cal)
    }

    /// Reads a calibration file (see [`Calibration::from_json`]).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, [`Error::Format`] naming it when it holds
    /// no usable measurement.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Self::from_json(&text).map_err(|e| Error::Format { path: path.to_path_buf(), detail: e.to_string() })
    }

    /// Combines two calibrations; `other`'s values win where both have one.
    pub fn merge(&mut self, other: &Calibration) {
        self.fwd_tflops = other.fwd_tflops.or(self.fwd_tflops);
        self.bwd_tflops = other.bwd_tflops.or(self.bwd_tflops);
        self.intra = other.intra.or(self.intra);
        self.inter = other.inter.or(self.inter);
    }

    /// Sets the cluster's kernel rates, bandwidths and latencies to the measured ones.
    pub fn apply(&self, cluster: &mut ClusterSpec) {
        if let Some(t) = self.fwd_tflops {
            cluster.fwd_tflops = t;
        }
        if let Some(t) = self.bwd_tflops {
            cluster.bwd_tflops = t;
        }
        if let Some(l) = self.intra {
            cluster.intra_gbps = l.bandwidth_gbps;
            cluster.intra_latency_us = l.latency_s * 1e6;
        }
        if let Some(l) = self.inter {
            cluster.inter_gbps = l.bandwidth_gbps;
            cluster.inter_latency_us = l.latency_s * 1e6;
        }
    }
}

/// Objects holding a `results` (or `records`) array, searched through arrays and object
/// values (a few levels deep).
fn collect_reports<'a>(v: &'a Value, out: &mut Vec<&'a Value>, depth: usize) {
    if depth > 4 {
        return;
    }
    match v {
        Value::Object(m) if m.get("results").or_else(|| m.get("records")).is_some_and(Value::is_array) => out.push(v),
        Value::Object(m) => m.values().for_each(|x| collect_reports(x, out, depth + 1)),
        Value::Array(a) => a.iter().for_each(|x| collect_reports(x, out, depth + 1)),
        _ => {}
    }
}

/// A ping-pong, when `v` is an object with a `samples` array.
fn ping_pong_of(v: &Value) -> Result<Option<PingPong>> {
    let Some(samples) = v.get("samples").and_then(Value::as_array) else { return Ok(None) };
    let link = match v.get("link").and_then(Value::as_str) {
        None | Some("intra") => LinkKind::Intra,
        Some("inter") => LinkKind::Inter,
        Some(other) => {
            return Err(Error::InvalidArgument(format!("ping-pong: link `{other}`: expected intra or inter")));
        }
    };
    let mut out = Vec::with_capacity(samples.len());
    for (i, s) in samples.iter().enumerate() {
        let pair = match s {
            Value::Array(a) if a.len() == 2 => a[0].as_f64().zip(a[1].as_f64()),
            Value::Object(_) => {
                let secs = s
                    .get("seconds")
                    .and_then(Value::as_f64)
                    .or_else(|| s.get("ms").and_then(Value::as_f64).map(|x| x * 1e-3))
                    .or_else(|| s.get("us").and_then(Value::as_f64).map(|x| x * 1e-6));
                s.get("bytes").and_then(Value::as_f64).zip(secs)
            }
            _ => None,
        };
        let Some((bytes, seconds)) = pair else {
            return Err(Error::InvalidArgument(format!(
                "ping-pong: sample {i} is not {{\"bytes\", \"seconds\"|\"ms\"|\"us\"}} or [bytes, seconds]"
            )));
        };
        out.push(PingPongSample { bytes, seconds });
    }
    Ok(Some(PingPong { link, samples: out }))
}
