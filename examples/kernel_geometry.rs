//! The launch geometry of every tensor-core kernel, one JSON object per line, for
//! `scripts/kernel-budget.py` (blocks per SM and tiles per loop iteration need the threads,
//! dynamic shared memory and tile shape of each head-dim class, which only the Rust side of
//! the kernel/host line knows): `cargo run --example kernel_geometry`.

use ringattn::kernels::geometry::{self, DqAccum, ValueDim, HEAD_DIM_CLASSES};
use ringattn::Dims;

fn main() {
    // Every class with equal head dims, then multi-head latent attention's pairs: on the pair
    // entry points (`_d192_v128`) and the `_dv` ones ((96, 64); (128, 64) at class 192). "d"
    // is the entry point's class, "v_class" V's.
    let equal = HEAD_DIM_CLASSES.map(|d| (d, d));
    for (d_qk, d_v) in equal.into_iter().chain([(192, 128), (96, 64), (128, 64)]) {
        let dims = Dims { b: 1, s_q: 4096, s_k: 4096, h_q: 1, h_kv: 1, d_qk, d_v };
        let (fm, fn_) = geometry::forward_tile(&dims);
        let (km, kn) = geometry::dkdv_tile(geometry::fa2_head_dim(&dims));
        let (qm, qn) = geometry::dq_tile(&dims);
        let rows = [
            ("flash_fwd", geometry::forward(&dims), fm, fn_),
            ("flash_bwd_dq", geometry::dq(&dims), qm, qn),
            ("flash_bwd_dkdv", geometry::dkdv(&dims, DqAccum::None), kn, km),
            ("flash_bwd_dkdvqfx", geometry::dkdv(&dims, DqAccum::Fixed), kn, km),
            ("flash_bwd_dkdvq", geometry::dkdv(&dims, DqAccum::F32), kn, km),
        ];
        // (family, launch, rows the block keeps, rows of each streamed tile)
        for (family, launch, rows, streamed) in rows {
            println!(
                "{{\"family\":\"{family}\",\"d\":{},\"d_v\":{d_v},\"own_dv\":{},\"v_class\":{},\"threads\":{},\"smem_bytes\":{},\"block_rows\":{rows},\"tile_rows\":{streamed}}}",
                launch.head_dim_class,
                launch.value_dim != ValueDim::Shared,
                match launch.value_dim {
                    ValueDim::Class(dv) => dv,
                    _ => launch.head_dim_class,
                },
                launch.block,
                launch.smem_bytes
            );
        }
    }
}
