//! `ringattn run`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ringattn::{io, Result};

use crate::args::{compute, ExecArgs, MaskArgs};

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
    let params = a.mask.params()?;
    a.exec.parallel(params.clone())?;
    let x = io::read_inputs(&a.input)?;
    let (fwd, grads) = compute(&a.exec, &params, &x.q, &x.k, &x.v, x.d_o.as_ref())?;
    match grads {
        None => io::write_tensors(&a.output, &[("o", &fwd.o), ("lse", &fwd.lse)])?,
        Some(g) => io::write_tensors(
            &a.output,
            &[("o", &fwd.o), ("lse", &fwd.lse), ("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)],
        )?,
    }
    Ok(ExitCode::SUCCESS)
}
