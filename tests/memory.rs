//! The CPU forward never materialises an s × s matrix: its memory beyond inputs and outputs
//! is a transposed copy of v plus tile scratch, whatever the sequence length.

use ringattn::{cpu, memory, random::randn, AttentionParams, DType, Mask};

#[global_allocator]
static ALLOCATOR: memory::CountingAllocator = memory::CountingAllocator;

#[test]
fn forward_memory_is_linear_in_sequence_length() {
    let (b, s, h, d) = (1, 8192, 2, 64);
    let q = randn(vec![b, s, h, d], 1, DType::F32);
    let k = randn(vec![b, s, h, d], 2, DType::F32);
    let v = randn(vec![b, s, h, d], 3, DType::F32);
    let p = AttentionParams { mask: Mask::Causal, ..Default::default() };
    let base = memory::current_bytes();
    memory::reset_peak();
    let out = cpu::forward(&q, &k, &v, &p).unwrap();
    let extra = memory::peak_bytes() - base;
    let outputs = out.o.len() * 4 + out.lse.len() * 4;
    let v_bytes = v.len() * 4;
    // Allowance: the transposed v, plus 4 MiB of tile scratch per thread — on AMX tiles, where
    // the f32 forward packs K and V as three bf16 parts each (6 bytes a value, on odd vector
    // counts and whole tile steps), under twice their f32 size instead of v.
    let packed = if cpu::amx::available() { 2 * (k.len() + v.len()) * 4 } else { v_bytes };
    let allowed = packed + rayon::current_num_threads() * (4 << 20);
    assert!(extra - outputs <= allowed, "{} bytes beyond outputs, allowed {allowed}", extra - outputs);
    // One s × s f32 score matrix per head would be this much:
    assert!(extra - outputs < s * s * 4 / 8);
}
