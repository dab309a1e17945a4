//! Bounded adaptive polling, QEMU's `poll-max-ns` model: before a worker sleeps with requests
//! in flight it may watch its avail rings (guest memory, no system call) for a while, because
//! a request the driver queues within that window then costs no sleep and wake-up. The
//! window adapts to what waiting has cost lately: it grows (from 4 µs, doubling) while the
//! wait was longer than the window but within the bound, and drops to zero when a wait was
//! longer than the bound (polling would not have caught it), so that a disk whose I/O is slow,
//! or that is idle, does not poll at all. This type only does the arithmetic; the worker's loop
//! measures and spins.

use std::time::Duration;

/// Where a window grows from, as in QEMU (`aio_poll`'s 4 µs).
const INITIAL_WINDOW: Duration = Duration::from_micros(4);

/// The adaptive window of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptivePoll {
    max: Duration,
    window: Duration,
}

impl AdaptivePoll {
    /// A window bounded by `max` (zero disables polling), starting closed.
    pub fn new(max: Duration) -> Self {
        Self {
            max,
            window: Duration::ZERO,
        }
    }

    /// How long to poll before the next sleep.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Records how long the last wait lasted (polling and sleeping together) until there was
    /// something to do.
    pub fn record(&mut self, waited: Duration) {
        if waited <= self.window {
            // Polling caught it: keep the window.
        } else if waited > self.max {
            // Longer than polling may ever wait: polling only burns CPU for such waits.
            self.window = Duration::ZERO;
        } else {
            let grown = if self.window.is_zero() {
                INITIAL_WINDOW
            } else {
                self.window.saturating_mul(2)
            };
            self.window = grown.min(self.max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn disabled_never_opens() {
        let mut p = AdaptivePoll::new(Duration::ZERO);
        for waited in [US, 3 * US, 100 * US] {
            p.record(waited);
            assert_eq!(p.window(), Duration::ZERO);
        }
    }

    #[test]
    fn grows_towards_the_bound_and_stays_while_it_catches() {
        let mut p = AdaptivePoll::new(50 * US);
        assert_eq!(p.window(), Duration::ZERO);
        // Waits of 30 µs: 4, 8, 16, 32 µs, then polling catches them.
        for want in [4, 8, 16, 32, 32, 32] {
            p.record(30 * US);
            assert_eq!(p.window(), want * US);
        }
        // Longer waits within the bound grow it up to the bound, never past.
        p.record(49 * US);
        assert_eq!(p.window(), 50 * US);
        p.record(50 * US);
        assert_eq!(p.window(), 50 * US);
    }

    #[test]
    fn a_wait_past_the_bound_closes_it() {
        let mut p = AdaptivePoll::new(50 * US);
        for _ in 0..5 {
            p.record(20 * US);
        }
        assert!(p.window() > Duration::ZERO);
        p.record(51 * US);
        assert_eq!(p.window(), Duration::ZERO);
        // An idle disk's waits are seconds long: it stays closed.
        p.record(Duration::from_secs(10));
        assert_eq!(p.window(), Duration::ZERO);
    }
}
