//! Arguments shared by the subcommands: masks, execution choices, shapes.

use clap::Args;
use ringattn::{AttentionParams, Documents, Error, Mask, Result};

/// Mask and scale options.
#[derive(Args, Debug, Clone, Default)]
pub struct MaskArgs {
    /// Causal mask (keys at or before the query's position). With --window, the right side
    /// is clamped to 0.
    #[arg(long)]
    pub causal: bool,
    /// Sliding window L,R: a query sees L keys back and R ahead; -1 means unbounded.
    #[arg(long, value_name = "L,R", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Softmax scale (default 1/sqrt(d)).
    #[arg(long, allow_hyphen_values = true)]
    pub scale: Option<f32>,
    /// Packed documents: comma-separated lengths summing to the key sequence length.
    #[arg(long, value_name = "A,B,...")]
    pub seqlens: Option<String>,
}

impl MaskArgs {
    /// The attention parameters these options describe.
    pub fn params(&self) -> Result<AttentionParams> {
        let mut mask = match &self.window {
            None => Mask::None,
            Some(w) => {
                let parts: Vec<&str> = w.split(',').collect();
                let side = |s: &str| {
                    s.trim()
                        .parse::<i64>()
                        .map_err(|_| Error::Window(format!("`{w}`: `{s}` is not an integer")))
                };
                match parts[..] {
                    [l, r] => Mask::from_signed_window(side(l)?, side(r)?)?,
                    _ => return Err(Error::Window(format!("`{w}`: expected two values L,R"))),
                }
            }
        };
        if self.causal {
            mask = if self.window.is_some() {
                mask.and_causal()
            } else {
                Mask::Causal
            };
        }
        if let Some(s) = self.scale {
            if !s.is_finite() {
                return Err(Error::Scale(s));
            }
        }
        let documents = match &self.seqlens {
            None => None,
            Some(list) => Some(Documents::new(parse_list(list, "--seqlens")?)?),
        };
        Ok(AttentionParams {
            mask,
            documents,
            scale: self.scale,
        })
    }
}

/// How to execute: strategy, world size, backend.
#[derive(Args, Debug, Clone)]
pub struct ExecArgs {
    /// Parallel strategy. Available today: single (one device, no sequence parallelism).
    #[arg(long, default_value = "single")]
    pub strategy: String,
    /// Number of ranks the sequence is split over (1 for --strategy single).
    #[arg(long)]
    pub world: Option<usize>,
    /// Compute backend. Available today: cpu.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
}

impl ExecArgs {
    /// Checks the combination; errors name the offending value.
    pub fn validate(&self) -> Result<()> {
        if self.strategy != "single" {
            return Err(Error::UnknownStrategy(self.strategy.clone()));
        }
        if self.backend != "cpu" {
            return Err(Error::UnknownBackend(self.backend.clone()));
        }
        match self.world {
            None | Some(1) => Ok(()),
            Some(w) => Err(Error::InvalidArgument(format!(
                "--world {w}: strategy `single` runs on exactly one rank"
            ))),
        }
    }
}

/// Parses a comma-separated list of non-negative integers.
pub fn parse_list(s: &str, what: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| Error::InvalidArgument(format!("{what} `{s}`: `{x}` is not a non-negative integer")))
        })
        .collect()
}
