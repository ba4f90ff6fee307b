//! Vector clocks over streams and each allocation's access history: the cross-stream race
//! detector. An access is ordered after an earlier one on another stream when its operation's
//! clock has reached the earlier operation's sequence number on that stream (an event wait, a
//! legacy-stream barrier or a host synchronisation in between). Two accesses to overlapping
//! bytes, at least one a write, on different streams and unordered, are a race.

/// Joins `b` into `a` (element-wise maximum).
pub fn join(a: &mut Vec<u64>, b: &[u64]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, &y) in a.iter_mut().zip(b) {
        *x = (*x).max(y);
    }
}

/// One access of an operation to an allocation: byte offsets `[lo, hi)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub stream: usize,
    pub seq: u64,
    pub lo: u64,
    pub hi: u64,
    pub write: bool,
    /// What the operation was (`launch ringattn_ops_add_f32`, `cuMemcpyDtoDAsync 4096 bytes`).
    pub label: String,
}

/// Most recent accesses kept per allocation (older ones are dropped: a race with them goes
/// unseen, never a false report).
const KEEP: usize = 256;

/// The accesses to one allocation that later ones must be ordered after.
#[derive(Debug, Default)]
pub struct History {
    entries: Vec<Access>,
}

fn ordered(clock: &[u64], earlier: &Access) -> bool {
    clock.get(earlier.stream).copied().unwrap_or(0) >= earlier.seq
}

impl History {
    /// The earlier access `a` (made by an operation with `clock`) races with, if any.
    pub fn check(&self, a: &Access, clock: &[u64]) -> Option<&Access> {
        self.entries
            .iter()
            .find(|e| e.stream != a.stream && (e.write || a.write) && e.lo < a.hi && a.lo < e.hi && !ordered(clock, e))
    }

    /// Records `a`; a write drops the accesses it covers and is ordered after.
    pub fn record(&mut self, a: Access, clock: &[u64]) {
        if a.write {
            self.entries.retain(|e| !(ordered(clock, e) && a.lo <= e.lo && e.hi <= a.hi));
        }
        self.entries.push(a);
        if self.entries.len() > KEEP {
            self.entries.remove(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(stream: usize, seq: u64, lo: u64, hi: u64, write: bool) -> Access {
        Access { stream, seq, lo, hi, write, label: format!("op {stream}.{seq}") }
    }

    #[test]
    fn unordered_write_then_read_on_another_stream_races() {
        let mut h = History::default();
        h.record(acc(1, 3, 0, 64, true), &[0, 3]);
        // Stream 2's clock has not reached stream 1's third operation.
        assert!(h.check(&acc(2, 1, 32, 48, false), &[0, 2, 1]).is_some());
        // After an event wait it has.
        assert!(h.check(&acc(2, 1, 32, 48, false), &[0, 3, 1]).is_none());
        // Disjoint bytes never race; two reads never race.
        assert!(h.check(&acc(2, 1, 64, 128, true), &[0, 0, 1]).is_none());
        let mut r = History::default();
        r.record(acc(1, 1, 0, 64, false), &[0, 1]);
        assert!(r.check(&acc(2, 1, 0, 64, false), &[0, 0, 1]).is_none());
        assert!(r.check(&acc(2, 1, 0, 64, true), &[0, 0, 1]).is_some());
    }

    #[test]
    fn same_stream_accesses_are_ordered() {
        let mut h = History::default();
        h.record(acc(1, 1, 0, 64, true), &[0, 1]);
        assert!(h.check(&acc(1, 2, 0, 64, true), &[0, 2]).is_none());
    }
}
