//! One core's bf16 product rate on AMX tiles: `ringattn::cpu::amx::block_product` (one
//! 32 × 32 f32 block per call: tile config, 2 × 2 tiles, one `TDPBF16PS` step per 32 of the
//! inner dimension, store, release) over an inner dimension of 64 (an attention score block at
//! head dim 64) and 1024 (a GEMM), against the same arithmetic on the instruction-level twin.
//! The rate counts 2 FLOPs per multiply-add; the processor is printed with the figures.
//!
//! ```text
//! cargo run --release --example amx_throughput
//! ```

use std::time::Instant;

use half::bf16;
use ringattn::cpu::amx::{available, block_product, pack_b_pairs, BlockEngine, BLOCK};

fn main() {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown processor".into());
    println!("{cpu}; AMX tiles available to this process: {}", available());
    for kdim in [64usize, 1024] {
        let a: Vec<bf16> = (0..BLOCK * kdim).map(|i| bf16::from_f32(((i * 37) % 101) as f32 / 101.0 - 0.5)).collect();
        let b: Vec<bf16> = (0..kdim * BLOCK).map(|i| bf16::from_f32(((i * 53) % 97) as f32 / 97.0 - 0.5)).collect();
        let packed = pack_b_pairs(&b, kdim, BLOCK);
        let mut c = vec![0f32; BLOCK * BLOCK];
        for engine in [BlockEngine::Tiles, BlockEngine::Twin] {
            let flops = 2.0 * (BLOCK * BLOCK * kdim) as f64;
            // About 0.3 s of work per figure, median of 5.
            let calls = if engine == BlockEngine::Twin { 20 } else { (3e10 / flops) as usize }.max(1);
            let mut rates = Vec::new();
            let mut ran = engine;
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..calls {
                    ran = block_product(kdim, &mut c, BLOCK, &a, kdim, &packed, BLOCK, engine).expect("valid shapes");
                }
                rates.push(flops * calls as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            rates.sort_by(f64::total_cmp);
            println!("inner dimension {kdim:>4}: {ran:?} {:>9.1} GFLOP/s (median of 5, {calls} blocks each)", rates[2]);
        }
    }
}
