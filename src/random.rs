//! Seeded random inputs for `verify`, `demo`, tests and benchmarks.

use rand::{rngs::StdRng, RngExt, SeedableRng};
use rand_distr::StandardNormal;

use crate::{DType, Tensor};

/// A tensor of standard-normal values, drawn in f32 from a seeded generator and rounded
/// to `dtype`. The same `(shape, seed)` gives the same values on every machine.
///
/// ```
/// use ringattn::{random::randn, DType};
/// let a = randn(vec![2, 3], 7, DType::F32);
/// assert_eq!(a, randn(vec![2, 3], 7, DType::F32));
/// assert_ne!(a, randn(vec![2, 3], 8, DType::F32));
/// ```
pub fn randn(shape: Vec<usize>, seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut rng = StdRng::seed_from_u64(seed);
    let data: Vec<f32> = (0..n).map(|_| rng.sample::<f32, _>(StandardNormal)).collect();
    Tensor::from_f32(shape, data).expect("length matches shape by construction").to_dtype(dtype)
}

/// `count` distinct indices in `0..n`, sorted, drawn from a seeded generator (all of them
/// when `count >= n`).
pub fn sample_indices(n: usize, count: usize, seed: u64) -> Vec<usize> {
    if count >= n {
        return (0..n).collect();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v = rand::seq::index::sample(&mut rng, n, count).into_vec();
    v.sort_unstable();
    v
}
