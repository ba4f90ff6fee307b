//! Rank threads and candle's CPU pool.
//!
//! candle 0.11 runs large element-wise CPU operations (≥ 64 Ki elements) on one process-wide
//! pool of spinning workers (`candle_core::utils::barrier_pool`, sized by
//! `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`, else every core), one caller at a time.
//! Ranks that are threads of one process all call it: they queue on its lock and spin at its
//! barrier while its workers are descheduled by the other ranks' work. Measured on a 2-core
//! Intel Xeon (`train_lm --batch 4 --seq 512`, median step): 4 rank threads 101.6 ms with the
//! pool at its default size, 64.3 ms with it empty. With the pool empty each rank runs those
//! operations inline on its own thread, and the ranks themselves keep the cores busy.

/// Before `ranks` rank threads start in this process: when `ranks > 1` and
/// `CANDLE_NUM_THREADS` is not set, sets `CANDLE_NUM_THREADS=1` and makes
/// candle create its pool now, empty (element-wise operations then run on the calling rank's
/// thread). A pool created earlier in the process (candle CPU work before the ranks started)
/// cannot be resized: it is left as it is. Returns whether candle's pool runs inline.
pub(crate) fn share_cores_among_rank_threads(ranks: usize) -> bool {
    if ranks > 1 && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Read by candle once, when its pool is first used (the line below).
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    candle_core::utils::barrier_pool().n_workers() == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranks_leave_the_pool_size_set() {
        // Other tests start ranks concurrently: only what holds after any of them is checked.
        let given = std::env::var("CANDLE_NUM_THREADS").ok();
        super::share_cores_among_rank_threads(2);
        let now = std::env::var("CANDLE_NUM_THREADS").expect("set for rank threads");
        assert!(given.is_none_or(|g| g == now), "a value the user set is kept");
    }
}
