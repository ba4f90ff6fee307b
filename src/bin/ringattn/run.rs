//! `ringattn run`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ringattn::parallel::{run_in_process, CpuBackend};
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
    let params = a.mask.params()?;
    let parallel = a.exec.parallel(params.clone())?;
    let x = io::read_inputs(&a.input)?;
    let (fwd, grads) = if a.exec.is_single() {
        let fwd = cpu::forward(&x.q, &x.k, &x.v, &params)?;
        let grads = match &x.d_o {
            Some(d_o) => Some(cpu::backward(&x.q, &x.k, &x.v, &fwd.o, &fwd.lse, d_o, &params)?),
            None => None,
        };
        (fwd, grads)
    } else {
        let backend = CpuBackend::default();
        let options = a.exec.local_options()?;
        let r = run_in_process(a.exec.world, options, &backend, &x.q, &x.k, &x.v, x.d_o.as_ref(), &parallel)?;
        (r.forward, r.gradients)
    };
    match grads {
        None => io::write_tensors(&a.output, &[("o", &fwd.o), ("lse", &fwd.lse)])?,
        Some(g) => io::write_tensors(
            &a.output,
            &[("o", &fwd.o), ("lse", &fwd.lse), ("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv)],
        )?,
    }
    Ok(ExitCode::SUCCESS)
}
