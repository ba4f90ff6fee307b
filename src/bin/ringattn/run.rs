//! `ringattn run`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ringattn::{cpu, io, Result};

use crate::args::{ExecArgs, MaskArgs};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Input safetensors file with q, k, v and optionally do.
    #[arg(long, value_name = "IN.safetensors")]
    pub input: PathBuf,
    /// Output safetensors file (o, lse, and dq, dk, dv when do is present).
    #[arg(long, value_name = "OUT.safetensors")]
    pub output: PathBuf,
    #[command(flatten)]
    pub exec: ExecArgs,
    #[command(flatten)]
    pub mask: MaskArgs,
}

pub fn run(a: &RunArgs) -> Result<ExitCode> {
    a.exec.validate()?;
    let params = a.mask.params()?;
    let x = io::read_inputs(&a.input)?;
    let fwd = cpu::forward(&x.q, &x.k, &x.v, &params)?;
    match &x.d_o {
        None => io::write_tensors(&a.output, &[("o", &fwd.o), ("lse", &fwd.lse)])?,
        Some(d_o) => {
            let g = cpu::backward(&x.q, &x.k, &x.v, &fwd.o, &fwd.lse, d_o, &params)?;
            io::write_tensors(
                &a.output,
                &[
                    ("o", &fwd.o),
                    ("lse", &fwd.lse),
                    ("dq", &g.dq),
                    ("dk", &g.dk),
                    ("dv", &g.dv),
                ],
            )?
        }
    }
    Ok(ExitCode::SUCCESS)
}
