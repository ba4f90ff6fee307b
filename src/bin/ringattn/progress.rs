//! Progress bars for long work, fed by the counters of `ringattn::cpu::CpuConfig`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Runs `work` with a progress counter while a bar labelled `label` follows it up to
/// `total`. The bar draws on stderr only when it is a terminal.
pub fn with_progress<T: Send>(label: &str, total: u64, work: impl FnOnce(&AtomicU64) -> T + Send) -> T {
    let counter = AtomicU64::new(0);
    let bar = ProgressBar::new(total.max(1));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:40}] {percent:>3}% {elapsed_precise} eta {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_string());
    let result = std::thread::scope(|scope| {
        let handle = scope.spawn(|| work(&counter));
        while !handle.is_finished() {
            bar.set_position(counter.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
        handle.join()
    });
    bar.finish_and_clear();
    match result {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
