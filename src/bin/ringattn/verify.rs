//! `ringattn verify`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ringattn::{io, random::randn, verify, DType, Error, Result};

use crate::args::{compute, parse_list, BackendKind, ExecArgs, MaskArgs};

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Input safetensors file with q, k, v and optionally do (a seeded do is drawn when absent).
    #[arg(long, value_name = "IN.safetensors", conflicts_with_all = ["shape", "dtype"])]
    pub input: Option<PathBuf>,
    /// Shape of seeded random inputs: b,s,h_q,h_kv,d (s_q = s_k = s), and v's head dim as a
    /// sixth value when it differs from d (multi-head latent attention: 1,512,8,8,192,128)
    /// [default: 2,257,4,2,64].
    #[arg(long, value_name = "B,S,HQ,HKV,D[,DV]")]
    pub shape: Option<String>,
    /// Dtype of the random inputs: f32, bf16 or f16 [default: f32; bf16 with --backend emu or cuda].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Forward only (skip dq, dk, dv).
    #[arg(long)]
    pub forward_only: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub exec: ExecArgs,
    #[command(flatten)]
    pub mask: MaskArgs,
}

pub fn verify(a: &VerifyArgs) -> Result<ExitCode> {
    let mut params = a.mask.params()?;
    a.exec.parallel(params.clone())?;
    let (q, k, v, d_o, what) = match &a.input {
        Some(path) => {
            let x = io::read_inputs(path)?;
            // The input file's sinks (if any) join the parameters.
            params.sinks = x.sinks.clone();
            // d_o has o's shape: q's [b, s, h_q] with v's head dim.
            let o_shape = match (x.q.shape(), x.v.shape().last()) {
                ([b, s, h, _], Some(&d_v)) => vec![*b, *s, *h, d_v],
                (q, _) => q.to_vec(),
            };
            let d_o = x.d_o.unwrap_or_else(|| randn(o_shape, a.seed ^ 0xd0, x.q.dtype()));
            (x.q, x.k, x.v, d_o, path.display().to_string())
        }
        None => {
            let shape = a.shape.as_deref().unwrap_or("2,257,4,2,64");
            let dims = parse_list(shape, "--shape")?;
            let (b, s, hq, hkv, d, d_v) = match dims[..] {
                [b, s, hq, hkv, d] => (b, s, hq, hkv, d, d),
                [b, s, hq, hkv, d, d_v] => (b, s, hq, hkv, d, d_v),
                _ => return Err(Error::InvalidArgument(format!("--shape `{shape}`: expected b,s,h_q,h_kv,d[,d_v]"))),
            };
            // The CUDA kernels (emulated or on a GPU) take 16-bit inputs only.
            let default = if a.exec.backend()? == BackendKind::Cpu { "f32" } else { "bf16" };
            let dtype: DType = a.dtype.as_deref().unwrap_or(default).parse()?;
            let seed = a.seed.wrapping_mul(4);
            (
                randn(vec![b, s, hq, d], seed, dtype),
                randn(vec![b, s, hkv, d], seed + 1, dtype),
                randn(vec![b, s, hkv, d_v], seed + 2, dtype),
                randn(vec![b, s, hq, d_v], seed + 3, dtype),
                format!("random {shape} {dtype} seed {}", a.seed),
            )
        }
    };
    let d_o = (!a.forward_only).then_some(&d_o);
    let (fwd, grads) = compute(&a.exec, &params, &q, &k, &v, d_o)?;
    let report = verify::check_results(&q, &k, &v, d_o, None, &params, &fwd, grads.as_ref())?;
    let parallel = a.exec.parallel(params.clone())?;
    let running = a.exec.describe(&parallel, &ringattn::Dims::of(&q, &k, &v)?, q.dtype())?;
    println!(
        "verify: {what}, q {:?}, k {:?}, v {:?}, mask {:?}{}{}, strategy {running}, backend {}",
        q.shape(),
        k.shape(),
        v.shape(),
        params.mask,
        params.documents.as_ref().map(|d| format!(", documents {:?}", d.lengths())).unwrap_or_default(),
        params.sinks.as_ref().map(|x| format!(", sinks {x:?}")).unwrap_or_default(),
        a.exec.backend
    );
    print!("{}", report.table());
    if let Some(path) = &a.json {
        ringattn::io::write_json(path, &report)?;
    }
    if report.pass() {
        println!("all checks pass ({} dtype tolerance)", report.dtype);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("FAILED: at least one output exceeds its tolerance");
        Ok(ExitCode::from(3))
    }
}
