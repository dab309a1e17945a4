//! The pace of a copy, as arithmetic on what it measured (no clock of its own, no I/O): the
//! bandwidth limit, the guest's dirty rate, whether what is left fits the switch-over, and
//! auto-converge's write limit for a guest that writes faster than the copy sends.

use std::time::Duration;

/// What is left may be sent within this much time at the copy's rate: the copy has
/// converged (the VMM's switch-over then waits for about this long on the disk).
pub const CONVERGED_WITHIN: Duration = Duration::from_millis(20);

/// Without a bandwidth limit, the rate assumed for [`CONVERGED_WITHIN`] (a local 10 Gbit/s
/// link moves more; what the copy measures replaces it after the first pass).
const UNLIMITED_RATE: u64 = 1 << 30;

/// At most this much left counts as converged, whatever the rate (a pass over one 64 KiB
/// block and its message round trip).
const CONVERGED_FLOOR: u64 = 256 * 1024;

/// Auto-converge limits the guest's writes to this fraction of the copy's rate, then halves
/// the limit at each pass that still does not converge.
const FIRST_THROTTLE_PERCENT: u64 = 50;

/// The lowest write limit auto-converge applies, bytes/s: the guest keeps making progress.
pub const MIN_THROTTLE: u64 = 1 << 20;

/// Consecutive passes in which the guest dirtied at least [`STALLING_PERCENT`] of the copy's
/// rate before auto-converge limits the guest (or limits it further).
const PASSES_BEFORE_THROTTLE: u32 = 3;

/// A guest that dirties at least this share of the copy's rate stalls the copy: each pass
/// leaves at least three quarters of what it started with (a guest below it still converges,
/// geometrically: the passes together take at most four times the first).
const STALLING_PERCENT: u64 = 75;

/// A token bucket for the bandwidth limit: how long to wait before sending more.
#[derive(Debug, Clone)]
pub struct Pacer {
    /// Bytes per second; 0: no limit.
    rate: u64,
    /// Bytes sent since `since`, counted against the limit.
    sent: u64,
    /// When the counting began (a point on the caller's clock).
    since: Duration,
}

impl Pacer {
    /// A pacer for `rate` bytes/s (0: unlimited) from time `now`.
    pub fn new(rate: u64, now: Duration) -> Pacer {
        Pacer {
            rate,
            sent: 0,
            since: now,
        }
    }

    /// The limit, bytes/s (0: none).
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Counts `bytes` sent at `now`; returns how long to wait before sending more so that
    /// the average stays within the limit.
    pub fn sent(&mut self, bytes: u64, now: Duration) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        // Restart the window now and then, so an idle spell does not bank a burst.
        let elapsed = now.saturating_sub(self.since);
        if elapsed > Duration::from_secs(1) && self.sent == 0 {
            self.since = now;
        }
        self.sent = self.sent.saturating_add(bytes);
        let due = Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
        let elapsed = now.saturating_sub(self.since);
        if due >= Duration::from_secs(2) && elapsed >= due {
            // Caught up over a long window: start a new one.
            self.since = now;
            self.sent = 0;
            return Duration::ZERO;
        }
        due.saturating_sub(elapsed)
    }
}

/// What a finished pass says about the copy's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassReport {
    /// Bytes left to send (marked blocks) right after the pass.
    pub remaining: u64,
    /// Bytes the guest marked per second during the pass.
    pub dirty_rate: u64,
    /// Bytes per second the copy sent during the pass.
    pub send_rate: u64,
}

/// Convergence and auto-converge across passes.
#[derive(Debug, Clone)]
pub struct Convergence {
    bandwidth: u64,
    /// The send rate measured last (0 before any pass).
    measured: u64,
    /// Consecutive passes that stalled (see [`STALLING_PERCENT`]).
    stalled_passes: u32,
    /// The write limit applied now (0: none).
    throttle: u64,
}

/// What to do after a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// What is left fits the switch-over.
    Converged,
    /// Another pass.
    Continue,
    /// Another pass, with the guest's writes limited to this many bytes/s (a new limit).
    Throttle(u64),
}

impl Convergence {
    /// For a copy limited to `bandwidth` bytes/s (0: none).
    pub fn new(bandwidth: u64) -> Convergence {
        Convergence {
            bandwidth,
            measured: 0,
            stalled_passes: 0,
            throttle: 0,
        }
    }

    /// The rate the copy sends at: the measured one, within the limit.
    pub fn rate(&self) -> u64 {
        let assumed = if self.measured == 0 {
            UNLIMITED_RATE
        } else {
            self.measured
        };
        if self.bandwidth == 0 {
            assumed
        } else {
            assumed.min(self.bandwidth)
        }
    }

    /// The most that may be left for the copy to count as converged.
    pub fn converged_bytes(&self) -> u64 {
        let within = (self.rate() as u128 * CONVERGED_WITHIN.as_micros() / 1_000_000) as u64;
        within.max(CONVERGED_FLOOR)
    }

    /// Whether `remaining` bytes count as converged.
    pub fn is_converged(&self, remaining: u64) -> bool {
        remaining <= self.converged_bytes()
    }

    /// The write limit applied now (0: none).
    pub fn throttle(&self) -> u64 {
        self.throttle
    }

    /// How long until the copy converges at the last pass's rates (`None`: it does not at
    /// these rates).
    pub fn eta(&self, report: &PassReport) -> Option<Duration> {
        let gain = self.rate().saturating_sub(report.dirty_rate);
        if self.is_converged(report.remaining) {
            return Some(Duration::ZERO);
        }
        if gain == 0 {
            return None;
        }
        Some(Duration::from_secs_f64(
            report.remaining.saturating_sub(self.converged_bytes()) as f64 / gain as f64,
        ))
    }

    /// Takes a finished pass into account and says what next.
    pub fn after_pass(&mut self, report: &PassReport) -> Decision {
        if report.send_rate > 0 {
            self.measured = report.send_rate;
        }
        if self.is_converged(report.remaining) {
            self.stalled_passes = 0;
            return Decision::Converged;
        }
        let stalling = u128::from(report.dirty_rate) * 100
            >= u128::from(self.rate()) * u128::from(STALLING_PERCENT);
        if !stalling {
            self.stalled_passes = 0;
            return Decision::Continue;
        }
        self.stalled_passes = self.stalled_passes.saturating_add(1);
        if self.stalled_passes < PASSES_BEFORE_THROTTLE {
            return Decision::Continue;
        }
        let next = if self.throttle == 0 {
            (u128::from(self.rate()) * u128::from(FIRST_THROTTLE_PERCENT) / 100) as u64
        } else {
            self.throttle / 2
        }
        .max(MIN_THROTTLE);
        if next == self.throttle {
            return Decision::Continue;
        }
        self.throttle = next;
        self.stalled_passes = 0;
        Decision::Throttle(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_pacer_keeps_the_average_within_the_limit() {
        let mut p = Pacer::new(10 * MIB, Duration::ZERO);
        // 1 MiB at once: due after 0.1 s.
        let wait = p.sent(MIB, Duration::ZERO);
        assert_eq!(wait, Duration::from_millis(100));
        // Sent again after the wait: another 0.1 s.
        let wait = p.sent(MIB, Duration::from_millis(100));
        assert_eq!(wait, Duration::from_millis(100));
        // Unlimited never waits.
        let mut free = Pacer::new(0, Duration::ZERO);
        assert_eq!(free.sent(u64::MAX, Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_small_remainder_converges_and_a_fast_writer_gets_throttled_step_by_step() {
        let mut c = Convergence::new(20 * MIB);
        // 20 MiB/s for 20 ms: 409.6 KiB.
        assert_eq!(c.converged_bytes(), 20 * MIB / 50);
        let pass = |remaining, dirty_rate| PassReport {
            remaining,
            dirty_rate,
            send_rate: 20 * MIB,
        };
        assert_eq!(c.after_pass(&pass(100 * 1024, 0)), Decision::Converged);
        // A guest writing 30 MiB/s: three passes, then half the copy's rate, then halves.
        for _ in 0..2 {
            assert_eq!(c.after_pass(&pass(50 * MIB, 30 * MIB)), Decision::Continue);
        }
        assert_eq!(
            c.after_pass(&pass(50 * MIB, 30 * MIB)),
            Decision::Throttle(10 * MIB)
        );
        assert_eq!(c.throttle(), 10 * MIB);
        // Dirtying half the copy's rate converges on its own: no further step.
        for _ in 0..10 {
            assert_eq!(c.after_pass(&pass(40 * MIB, 10 * MIB)), Decision::Continue);
        }
        // Still dirtying three quarters of it (small writes dirty whole blocks): halved after
        // three such passes in a row; one pass below it starts the count again.
        for _ in 0..2 {
            assert_eq!(c.after_pass(&pass(40 * MIB, 16 * MIB)), Decision::Continue);
        }
        assert_eq!(c.after_pass(&pass(40 * MIB, 10 * MIB)), Decision::Continue);
        for _ in 0..2 {
            assert_eq!(c.after_pass(&pass(40 * MIB, 16 * MIB)), Decision::Continue);
        }
        assert_eq!(
            c.after_pass(&pass(40 * MIB, 16 * MIB)),
            Decision::Throttle(5 * MIB)
        );
        // Never below the floor.
        for _ in 0..20 {
            c.after_pass(&pass(40 * MIB, 16 * MIB));
        }
        assert_eq!(c.throttle(), MIN_THROTTLE);
    }

    #[test]
    fn a_slow_writer_is_left_alone_and_the_eta_follows_the_rates() {
        let mut c = Convergence::new(20 * MIB);
        let slow = PassReport {
            remaining: 100 * MIB,
            dirty_rate: 2 * MIB,
            send_rate: 20 * MIB,
        };
        for _ in 0..10 {
            assert_eq!(c.after_pass(&slow), Decision::Continue);
        }
        let eta = c.eta(&slow).unwrap();
        // (100 MiB - 0.4 MiB) / 18 MiB/s ≈ 5.5 s.
        assert!(
            eta > Duration::from_secs(5) && eta < Duration::from_secs(6),
            "{eta:?}"
        );
        let stuck = PassReport {
            dirty_rate: 30 * MIB,
            ..slow
        };
        assert_eq!(c.eta(&stuck), None);
    }
}
