//! Seeded random inputs for `verify`, `demo`, tests and benchmarks.

use rand::{rngs::StdRng, RngExt, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;

use crate::tensor::TensorData;
use crate::{DType, Tensor};

/// A tensor of standard-normal values, drawn in f32 from a seeded generator and rounded
/// to `dtype`. The same `(shape, seed)` gives the same values on every machine, whatever
/// its thread count: the values come in chunks of [`RANDN_CHUNK`], each from its own
/// generator (the first seeded with `seed` itself, so a tensor of at most one chunk is the
/// plain sequence of `seed`), drawn in parallel.
///
/// ```
/// use ringattn::{random::randn, DType};
/// let a = randn(vec![2, 3], 7, DType::F32);
/// assert_eq!(a, randn(vec![2, 3], 7, DType::F32));
/// assert_ne!(a, randn(vec![2, 3], 8, DType::F32));
/// ```
pub fn randn(shape: Vec<usize>, seed: u64, dtype: DType) -> Tensor {
    /// The f32 samples of each chunk, rounded to `T` as they are drawn (no f32 copy of the
    /// whole tensor).
    fn draw<T: Copy + Default + Send>(n: usize, seed: u64, round: impl Fn(f32) -> T + Sync) -> Vec<T> {
        let mut data = vec![T::default(); n];
        data.par_chunks_mut(RANDN_CHUNK).enumerate().for_each(|(c, chunk)| {
            let mut rng = StdRng::seed_from_u64(chunk_seed(seed, c));
            chunk.iter_mut().for_each(|x| *x = round(rng.sample::<f32, _>(StandardNormal)));
        });
        data
    }
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F32 => TensorData::F32(draw(n, seed, |x| x)),
        DType::BF16 => TensorData::BF16(draw(n, seed, half::bf16::from_f32)),
        DType::F16 => TensorData::F16(draw(n, seed, half::f16::from_f32)),
    };
    Tensor::new(shape, data).expect("length matches shape by construction")
}

/// Values per generator in [`randn`] (2^20).
pub const RANDN_CHUNK: usize = 1 << 20;

/// The seed of chunk `c` of a [`randn`] tensor: `seed` for the first, a SplitMix64 mix of
/// `(seed, c)` for the others (decorrelated streams).
fn chunk_seed(seed: u64, c: usize) -> u64 {
    if c == 0 {
        return seed;
    }
    let mut z = seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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

/// A distribution of document lengths for packed-sequence batches ([`document_lengths`]).
#[derive(Debug, Clone, PartialEq)]
pub enum DocLengths {
    /// Log-normal: `exp(ln(median) + sigma·N(0, 1))` rounded, clipped to `min..=max`.
    LogNormal {
        /// The median length.
        median: f64,
        /// The standard deviation of the log-length.
        sigma: f64,
        /// Shortest document.
        min: usize,
        /// Longest document.
        max: usize,
    },
    /// These lengths in turn, repeated.
    Fixed(Vec<usize>),
}

impl Default for DocLengths {
    /// Log-normal, median 1500, σ 1, 128 ..= 16384 tokens.
    fn default() -> Self {
        DocLengths::LogNormal { median: 1500.0, sigma: 1.0, min: 128, max: 16384 }
    }
}

impl std::str::FromStr for DocLengths {
    type Err = crate::Error;
    /// `lognormal` (the default), `lognormal:MEDIAN:SIGMA:MIN:MAX`, or a comma-separated list of
    /// lengths (`fixed:` prefix optional).
    fn from_str(text: &str) -> crate::Result<Self> {
        let bad = || {
            crate::Error::InvalidArgument(format!(
                "document lengths `{text}`: lognormal, lognormal:MEDIAN:SIGMA:MIN:MAX, or a list such as 4096,1024,512"
            ))
        };
        if text == "lognormal" {
            return Ok(DocLengths::default());
        }
        if let Some(rest) = text.strip_prefix("lognormal:") {
            let f: Vec<&str> = rest.split(':').collect();
            let [median, sigma, min, max] = f.as_slice() else { return Err(bad()) };
            let (median, sigma): (f64, f64) = (median.parse().map_err(|_| bad())?, sigma.parse().map_err(|_| bad())?);
            let (min, max): (usize, usize) = (min.parse().map_err(|_| bad())?, max.parse().map_err(|_| bad())?);
            if !(median > 0.0 && median.is_finite() && sigma >= 0.0 && sigma.is_finite() && min >= 1 && min <= max) {
                return Err(bad());
            }
            return Ok(DocLengths::LogNormal { median, sigma, min, max });
        }
        let list: Vec<usize> = text
            .strip_prefix("fixed:")
            .unwrap_or(text)
            .split(',')
            .map(|x| x.trim().parse::<usize>().ok().filter(|&l| l > 0))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        Ok(DocLengths::Fixed(list))
    }
}

/// Document lengths drawn from `dist` with a seeded generator until they fill exactly `s`
/// tokens (each at least one token, the last one cut to fit): a packed batch. The same `(seed, s, dist)` gives the same
/// lengths on every machine.
///
/// ```
/// use ringattn::random::{document_lengths, DocLengths};
/// let lens = document_lengths(3, 32768, &DocLengths::default());
/// assert_eq!(lens.iter().sum::<usize>(), 32768);
/// assert_eq!(document_lengths(1, 10, &DocLengths::Fixed(vec![4, 3])), vec![4, 3, 3]);
/// assert_eq!(document_lengths(1, 3, &DocLengths::Fixed(vec![0])), vec![1, 1, 1]);
/// ```
pub fn document_lengths(seed: u64, s: usize, dist: &DocLengths) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut filled = 0;
    let mut k = 0;
    while filled < s {
        let l = match dist {
            DocLengths::LogNormal { median, sigma, min, max } => {
                let z: f64 = rng.sample(StandardNormal);
                ((median.ln() + sigma * z).exp().round() as usize).clamp(*min, *max)
            }
            DocLengths::Fixed(list) if list.is_empty() => s,
            DocLengths::Fixed(list) => list[k % list.len()],
        };
        k += 1;
        // At least one token: a zero length (a list holding 0, a log-normal clipped at 0)
        // would never fill the batch.
        let l = l.clamp(1, s - filled);
        out.push(l);
        filled += l;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn randn_is_chunked_deterministically() {
        let n = 2 * RANDN_CHUNK + 100;
        let big = randn(vec![n], 11, DType::F32).as_f32().into_owned();
        // The first chunk is the plain stream of the seed: a short tensor is its prefix.
        let small = randn(vec![1000], 11, DType::F32).as_f32().into_owned();
        assert_eq!(&big[..1000], &small[..]);
        // The same values on one thread as on the pool.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let serial = one.install(|| randn(vec![n], 11, DType::F32)).as_f32().into_owned();
        assert_eq!(big, serial);
        // Later chunks are other streams, and standard normal.
        assert_ne!(&big[..64], &big[RANDN_CHUNK..RANDN_CHUNK + 64]);
        assert_ne!(&big[RANDN_CHUNK..RANDN_CHUNK + 64], &big[2 * RANDN_CHUNK..2 * RANDN_CHUNK + 64]);
        let tail = &big[RANDN_CHUNK..2 * RANDN_CHUNK];
        let mean = tail.iter().map(|&x| x as f64).sum::<f64>() / tail.len() as f64;
        let var = tail.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / tail.len() as f64;
        assert!(mean.abs() < 5e-3 && (var - 1.0).abs() < 5e-3, "mean {mean} var {var}");
    }

    #[test]
    fn narrow_dtypes_are_the_f32_samples_rounded() {
        let n = RANDN_CHUNK + 77;
        let wide = randn(vec![n], 5, DType::F32);
        for dtype in [DType::BF16, DType::F16] {
            let narrow = randn(vec![n], 5, dtype);
            assert_eq!(narrow.dtype(), dtype);
            assert_eq!(narrow, wide.to_dtype(dtype), "{dtype}");
        }
    }
}
