//! The kernels' loop bounds, counted: each block of the forward, dq and dk/dv kernels must
//! load exactly the tiles from the first to the last one holding a visible (query, key) pair
//! of its rows — no tile before a causal block's first key or after its diagonal, none
//! outside a window or a document — and every tile in between. The emulator counts the
//! 16-byte cp.async copies each block issues ([`BlockCounts`]); the tiles follow from the
//! kernels' staging (every staged row is `d_class / 8` copies, zero-filled or not), and the
//! expected span from the mask geometry, pair by pair. It also counts the blocks' tensor-core
//! multiply-adds, which must be the work [`flops::executed_flops`] reports for the kernels
//! (what `ringattn bench` prints beside the conventional FLOPs).

use super::flash::Emulator;
use super::{BlockCounts, EmuOptions};
use crate::flops::{self, Executor, Pass};
use crate::kernels::geometry::{self, BackwardKernel, DqMode};
use crate::kernels::params::MASK_GRANULE;
use crate::params::Visibility;
use crate::random::randn;
use crate::runner;
use crate::{AttentionParams, DType, Dims, Documents, Layout, Mask, Positions, Segment, Tensor};

/// Which side of the pairs a kernel's blocks hold (the other side streams as tiles).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Blocks {
    Queries,
    Keys,
}

/// Every (query, key) pair's visibility, `[s_q][s_k]`.
fn pairs(vis: &Visibility) -> Vec<Vec<bool>> {
    let s_k = vis.k_pos.len();
    (0..vis.q_pos.len())
        .map(|i| {
            let mut row = vec![0.0f32; s_k];
            vis.mask_query_row(&mut row, i, 0);
            row.iter().map(|x| x.is_finite()).collect()
        })
        .collect()
}

/// Per block of `block` rows of the `side` the blocks hold, the tiles of `tile` rows of the
/// other side from the first to the last one holding a visible pair (0 when none does). A
/// tile smaller than a granule of [`MASK_GRANULE`] rows counts as holding one when its
/// granule does: the kernels know the other side only by its granules' bounds.
fn expected_tiles(pairs: &[Vec<bool>], side: Blocks, block: usize, tile: usize) -> Vec<u64> {
    let (s_q, s_k) = (pairs.len(), pairs.first().map_or(0, Vec::len));
    let (rows, others) = if side == Blocks::Queries { (s_q, s_k) } else { (s_k, s_q) };
    let seen = |r: usize, o: usize| if side == Blocks::Queries { pairs[r][o] } else { pairs[o][r] };
    let span = |t: usize| {
        let lo = if tile < MASK_GRANULE { t * tile / MASK_GRANULE * MASK_GRANULE } else { t * tile };
        lo..(lo + tile.max(MASK_GRANULE)).min(others)
    };
    (0..rows.div_ceil(block))
        .map(|b| {
            let visible: Vec<usize> = (0..others.div_ceil(tile))
                .filter(|&t| (b * block..((b + 1) * block).min(rows)).any(|r| span(t).any(|o| seen(r, o))))
                .collect();
            match (visible.first(), visible.last()) {
                (Some(f), Some(l)) => (l - f + 1) as u64,
                _ => 0,
            }
        })
        .collect()
}

/// Tiles each block loaded, from its copies: `fixed` rows staged once (Q, or Q and dO, or K
/// and V), `per_tile` rows per tile, `chunks` copies per row.
fn loaded_tiles(copies: &[u64], fixed: u64, per_tile: u64, chunks: u64, what: &str) -> Vec<u64> {
    copies
        .iter()
        .enumerate()
        .map(|(b, &c)| {
            let streamed = c.checked_sub(fixed * chunks).unwrap_or_else(|| panic!("{what}: block {b}: {c} copies"));
            assert_eq!(streamed % (per_tile * chunks), 0, "{what}: block {b}: {c} copies are not whole tiles");
            streamed / (per_tile * chunks)
        })
        .collect()
}

/// One geometry: the rows' global positions, the mask, the head dim.
struct Case {
    name: &'static str,
    q_pos: Positions,
    k_pos: Positions,
    params: AttentionParams,
    d: usize,
}

/// Runs the forward and backward (both dq modes) of `c` under the emulator, counting
/// copies, and checks every block's tiles against the geometry.
fn check(c: &Case) {
    let (s_q, s_k, h) = (c.q_pos.len(), c.k_pos.len(), 2);
    let q = randn(vec![1, s_q, h, c.d], 1, DType::BF16);
    let k = randn(vec![1, s_k, h, c.d], 2, DType::BF16);
    let v = randn(vec![1, s_k, h, c.d], 3, DType::BF16);
    let d_o = randn(vec![1, s_q, h, c.d], 4, DType::BF16);
    let vis = Visibility::new(&c.params, &c.q_pos, &c.k_pos).expect("visibility");
    let pairs = pairs(&vis);
    let chunks = (geometry::head_dim_class(c.d) / 8) as u64;
    let pos = Some((&c.q_pos, &c.k_pos));
    let heads = |per_block: Vec<u64>| -> Vec<u64> { (0..h).flat_map(|_| per_block.iter().copied()).collect() };

    let counts = BlockCounts::default();
    let opts = EmuOptions::default();
    let emu = Emulator { opts: &opts, counts: Some(&counts) };
    let f = runner::forward_tensors(&emu, &q, &k, &v, pos, &c.params).expect("forward");
    let dims = Dims { b: 1, s_q, s_k, h_q: h, h_kv: h, d_qk: c.d, d_v: c.d };
    let (fm, fnk) = geometry::forward_tile(&dims);
    let fwd = counts.take();
    assert_eq!(fwd.len(), 1, "{}: one forward launch", c.name);
    let got = loaded_tiles(&fwd[0].copies, fm as u64, 2 * fnk as u64, chunks, "forward");
    assert_eq!(got, heads(expected_tiles(&pairs, Blocks::Queries, fm, fnk)), "{}: forward tiles per block", c.name);

    for mode in [DqMode::Deterministic, DqMode::Atomic] {
        let o = f.o.clone();
        runner::backward_tensors(&emu, &q, &k, &v, &o, &f.lse, &d_o, pos, &c.params, mode).expect("backward");
        for launch in counts.take() {
            let (kernel, copies) = (launch.kernel, &launch.copies);
            let got_expected = match kernel {
                "rowsum" | "kvbound" | "rowunit" | "dqconvert" => continue,
                "dq" => {
                    let (m, n) = geometry::dq_tile(&dims);
                    let got = loaded_tiles(copies, 2 * m as u64, 2 * n as u64, chunks, "dq");
                    (got, heads(expected_tiles(&pairs, Blocks::Queries, m, n)))
                }
                "dkdv" | "dkdvqfx" | "dkdvq" => {
                    let accum = geometry::dkdv_accum(c.d, mode);
                    assert_eq!(kernel, BackwardKernel::DkDv(accum).name(), "{}: {mode:?}", c.name);
                    let (m, n) = geometry::dkdv_tile(c.d);
                    let splits = geometry::dkdv_splits(&dims);
                    let got = loaded_tiles(copies, 2 * n as u64, 2 * m as u64, chunks, kernel);
                    // Query tiles of every query head of the block's GQA group (here one).
                    let per_block = expected_tiles(&pairs, Blocks::Keys, n, m);
                    let split: Vec<u64> = per_block.iter().flat_map(|&t| std::iter::repeat_n(t, splits)).collect();
                    (got, heads(split))
                }
                other => panic!("unexpected launch {other}"),
            };
            assert_eq!(got_expected.0, got_expected.1, "{}: {kernel} ({mode:?}) tiles per block", c.name);
        }
    }
}

fn causal() -> AttentionParams {
    AttentionParams { mask: Mask::Causal, ..Default::default() }
}

#[test]
fn causal_blocks_stop_at_their_diagonal() {
    for d in [64, 128] {
        let (q_pos, k_pos) = Positions::single_device(320, 320);
        check(&Case { name: "causal", q_pos, k_pos, params: causal(), d });
    }
    // Queries bottom-right aligned with more keys: every block starts at key 0.
    let (q_pos, k_pos) = Positions::single_device(130, 300);
    check(&Case { name: "causal, s_q < s_k", q_pos, k_pos, params: causal(), d: 64 });
}

#[test]
fn unmasked_blocks_visit_every_tile() {
    let (q_pos, k_pos) = Positions::single_device(150, 200);
    check(&Case { name: "no mask", q_pos, k_pos, params: AttentionParams::default(), d: 64 });
}

#[test]
fn ring_hops_of_zigzag_and_striped_shards_visit_their_visible_span() {
    let (s, world) = (1024, 4);
    for layout in [Layout::Zigzag, Layout::Striped] {
        // The diagonal hop, a hop whose keys are all earlier, and mixed ones.
        for (rq, rk) in [(1, 1), (3, 0), (0, 2), (2, 1)] {
            let q_pos = layout.positions(s, world, rq).unwrap();
            let k_pos = layout.positions(s, world, rk).unwrap();
            check(&Case { name: "ring hop", q_pos, k_pos, params: causal(), d: 64 });
        }
    }
}

#[test]
fn windows_start_at_their_left_edge() {
    let (q_pos, k_pos) = Positions::single_device(400, 400);
    let params = AttentionParams { mask: Mask::Window { left: Some(100), right: Some(0) }, ..Default::default() };
    check(&Case { name: "sliding window", q_pos, k_pos, params, d: 64 });
    // A two-sided window on a block of keys further on in the sequence.
    let q_pos = Positions::contiguous(1000, 256);
    let k_pos = Positions::from_segments(vec![Segment { start: 800, stride: 1, len: 300 }]).expect("segment");
    let params = AttentionParams { mask: Mask::Window { left: Some(90), right: Some(40) }, ..Default::default() };
    check(&Case { name: "two-sided window", q_pos, k_pos, params, d: 128 });
}

#[test]
fn packed_documents_bound_the_span() {
    let docs = Documents::new(vec![100, 250, 34, 128]).expect("documents");
    let (q_pos, k_pos) = Positions::single_device(512, 512);
    let params = AttentionParams { mask: Mask::Causal, documents: Some(docs.clone()), ..Default::default() };
    check(&Case { name: "causal documents", q_pos, k_pos, params, d: 64 });
    let (q_pos, k_pos) = Positions::single_device(512, 512);
    let params = AttentionParams { documents: Some(docs), ..Default::default() };
    check(&Case { name: "documents", q_pos, k_pos, params, d: 64 });
}

#[test]
fn copies_count_what_the_blocks_stage() {
    // Without a mask every block loads every tile: the counting itself, checked against the
    // geometry alone (a 1-block, 1-tile call; then 3 key tiles).
    let (q_pos, k_pos) = Positions::single_device(64, 64);
    let q = Tensor::zeros(vec![1, 64, 1, 64], DType::BF16);
    let counts = BlockCounts::default();
    let opts = EmuOptions::default();
    let emu = Emulator { opts: &opts, counts: Some(&counts) };
    runner::forward_tensors(&emu, &q, &q, &q, Some((&q_pos, &k_pos)), &AttentionParams::default()).expect("forward");
    let one = counts.take();
    assert_eq!((one.len(), one[0].kernel), (1, "flash_fwd"));
    // A block of 128 query rows (4 warps of 32) stages Q and one K/V tile; the 2 warps that
    // hold rows compute (S: 64 keys, P V: 64 columns) x 64 deep for their 32 rows, the 2
    // past the 64 queries skip the tile.
    assert_eq!(
        (one[0].copies.clone(), one[0].mma_macs.clone()),
        (vec![128 * 8 + 2 * 64 * 8], vec![2 * 2 * 32 * 64 * 64])
    );
    let k = Tensor::zeros(vec![1, 150, 1, 64], DType::BF16);
    let (q_pos, k_pos) = Positions::single_device(64, 150);
    runner::forward_tensors(&emu, &q, &k, &k, Some((&q_pos, &k_pos)), &AttentionParams::default()).expect("forward");
    let three = counts.take();
    assert_eq!(three[0].copies, vec![128 * 8 + 3 * 2 * 64 * 8]);
    // The last tile (keys 128..150) is partly outside the call: those warps take the masked
    // path, which computes the whole tile all the same.
    assert_eq!(three[0].mma_macs, vec![3 * 2 * 2 * 32 * 64 * 64]);
}

/// The multiply-adds the emulated kernels perform for a single-device call of `dims` under
/// `params`, per pass (forward; backward in `mode`), against [`flops::executed_flops`].
fn check_flops(name: &str, dims: Dims, params: &AttentionParams) {
    let q = randn(dims.q_shape(), 5, DType::F16);
    let k = randn(dims.k_shape(), 6, DType::F16);
    let v = randn(dims.v_shape(), 7, DType::F16);
    let d_o = randn(dims.o_shape(), 8, DType::F16);
    let counts = BlockCounts::default();
    let opts = EmuOptions::default();
    let emu = Emulator { opts: &opts, counts: Some(&counts) };
    let flops_of = |launches: Vec<super::LaunchCounts>| -> f64 {
        launches.iter().flat_map(|l| l.mma_macs.iter()).map(|&m| 2.0 * m as f64).sum()
    };
    let f = runner::forward_tensors(&emu, &q, &k, &v, None, params).expect("forward");
    let want = flops::executed_flops(&dims, params, Pass::Forward, Executor::Kernels(DqMode::Deterministic)).unwrap();
    assert_eq!(flops_of(counts.take()), want, "{name}: forward");
    for mode in [DqMode::Deterministic, DqMode::Atomic] {
        runner::backward_tensors(&emu, &q, &k, &v, &f.o, &f.lse, &d_o, None, params, mode).expect("backward");
        let want = flops::executed_flops(&dims, params, Pass::Backward, Executor::Kernels(mode)).unwrap();
        assert_eq!(flops_of(counts.take()), want, "{name}: backward ({mode:?})");
    }
}

#[test]
fn executed_flops_are_the_multiply_adds_the_kernels_perform() {
    let dims = |s_q, s_k, h_q, h_kv, d| Dims { b: 2, s_q, s_k, h_q, h_kv, d_qk: d, d_v: d };
    check_flops("unmasked", dims(100, 100, 2, 2, 64), &AttentionParams::default());
    check_flops("causal, GQA, d 48 (class 64)", dims(200, 200, 4, 2, 48), &causal());
    check_flops("causal, s_q < s_k, d 128", dims(70, 190, 1, 1, 128), &causal());
    let window = AttentionParams { mask: Mask::Window { left: Some(40), right: Some(5) }, ..Default::default() };
    check_flops("window, d 256 (two column ranges)", dims(150, 150, 1, 1, 256), &window);
    let docs = AttentionParams {
        mask: Mask::Causal,
        documents: Some(Documents::new(vec![30, 90, 40]).unwrap()),
        ..Default::default()
    };
    check_flops("documents, d 32", dims(160, 160, 2, 1, 32), &docs);
}

/// The Hopper kernels' cases: causal, unmasked with fewer queries than keys, a sliding
/// window; one per head-dim class.
fn hopper_cases() -> [(&'static str, (Positions, Positions), AttentionParams, usize); 3] {
    [
        ("causal", Positions::single_device(300, 300), causal(), 64),
        ("no mask, s_q < s_k", Positions::single_device(130, 260), AttentionParams::default(), 128),
        (
            "sliding window",
            Positions::single_device(400, 400),
            AttentionParams { mask: Mask::Window { left: Some(100), right: Some(0) }, ..Default::default() },
            256,
        ),
    ]
}

/// The Hopper forward: each block (128 query rows) loads Q once (one 64-column box per
/// column block) and the K and V tiles from the first to the last one any of its rows may
/// see (two boxes per column block per tile), nothing when it sees none; both consumer
/// warpgroups compute every tile loaded, and their wgmma multiply-adds are what
/// [`flops::executed_flops`] reports for [`Executor::Hopper`] (no documents: the loop bounds
/// are exact).
#[test]
fn the_hopper_forward_loads_its_span_and_performs_the_reported_work() {
    use crate::kernels::geometry::KernelFamily;
    for (name, (q_pos, k_pos), params, d) in hopper_cases() {
        let (s_q, s_k, h) = (q_pos.len(), k_pos.len(), 2);
        let q = randn(vec![1, s_q, h, d], 1, DType::BF16);
        let k = randn(vec![1, s_k, h, d], 2, DType::BF16);
        let counts = BlockCounts::default();
        let opts = EmuOptions { kernels: KernelFamily::Hopper, ..Default::default() };
        let emu = Emulator { opts: &opts, counts: Some(&counts) };
        runner::forward_tensors(&emu, &q, &k, &k, Some((&q_pos, &k_pos)), &params).expect("forward");
        let launch = counts.take().remove(0);
        assert_eq!(launch.kernel, "flash_fwd_hopper");
        let boxes = (geometry::hopper_head_dim_class(d) / 64) as u64;
        let (m, n) = geometry::hopper_forward_tile(d);
        let vis = Visibility::new(&params, &q_pos, &k_pos).expect("visibility");
        let want: Vec<u64> = expected_tiles(&pairs(&vis), Blocks::Queries, m, n).repeat(h);
        let got: Vec<u64> = launch.copies.iter().map(|&c| if c == 0 { 0 } else { (c - boxes) / (2 * boxes) }).collect();
        assert_eq!(got, want, "{name}: tiles per block");
        let dims = Dims { b: 1, s_q, s_k, h_q: h, h_kv: h, d_qk: d, d_v: d };
        let flops =
            flops::executed_flops(&dims, &params, Pass::Forward, Executor::Hopper(DqMode::Deterministic)).unwrap();
        let macs: u64 = launch.mma_macs.iter().sum();
        assert_eq!(2.0 * macs as f64, flops, "{name}: executed FLOPs");
    }
}

/// The Hopper backward: each block (a key block of [`geometry::hopper_backward_block`] keys)
/// loads K and V once (one box each per column block) and, for every query tile of 64 rows
/// from the first to the last one its keys may see, the Q and dO tiles (one box each per
/// column block) and the tile's lse and delta rows (one box each); nothing when its keys see
/// none. Its wgmma multiply-adds are what [`flops::executed_flops`] reports for the backward
/// on [`Executor::Hopper`] (no documents: the loop bounds are exact).
#[test]
fn the_hopper_backward_loads_its_span_and_performs_the_reported_work() {
    use crate::kernels::geometry::KernelFamily;
    for (name, (q_pos, k_pos), params, d) in hopper_cases() {
        let (s_q, s_k, h) = (q_pos.len(), k_pos.len(), 2);
        let q = randn(vec![1, s_q, h, d], 1, DType::BF16);
        let k = randn(vec![1, s_k, h, d], 2, DType::BF16);
        let counts = BlockCounts::default();
        for mode in [DqMode::Deterministic, DqMode::Atomic] {
            let opts = EmuOptions { kernels: KernelFamily::Hopper, ..Default::default() };
            let emu = Emulator { opts: &opts, counts: Some(&counts) };
            let f = runner::forward_tensors(&emu, &q, &k, &k, Some((&q_pos, &k_pos)), &params).expect("forward");
            runner::backward_tensors(&emu, &q, &k, &k, &f.o, &f.lse, &q, Some((&q_pos, &k_pos)), &params, mode)
                .expect("backward");
            let launches = counts.take();
            let launch =
                launches.iter().find(|l| l.kernel.starts_with("hopper_dkdvq")).expect("the Hopper dk/dv kernel");
            let boxes = (geometry::hopper_head_dim_class(d) / 64) as u64;
            let n = geometry::hopper_backward_block(d);
            let vis = Visibility::new(&params, &q_pos, &k_pos).expect("visibility");
            let want: Vec<u64> = expected_tiles(&pairs(&vis), Blocks::Keys, n, 64).repeat(h);
            let got: Vec<u64> =
                launch.copies.iter().map(|&c| if c == 0 { 0 } else { (c - 2 * boxes) / (2 * boxes + 2) }).collect();
            assert_eq!(got, want, "{name} ({mode:?}): query tiles per block");
            let dims = Dims { b: 1, s_q, s_k, h_q: h, h_kv: h, d_qk: d, d_v: d };
            let flops = flops::executed_flops(&dims, &params, Pass::Backward, Executor::Hopper(mode)).unwrap();
            let macs: u64 = launch.mma_macs.iter().sum();
            assert_eq!(2.0 * macs as f64, flops, "{name} ({mode:?}): executed FLOPs");
        }
    }
}
