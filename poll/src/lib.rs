//! Bounded adaptive polling, QEMU's `poll-max-ns` model, for both of blkplane's processes:
//! before a thread sleeps it may watch shared memory (no system call) for a while, because
//! work that arrives within that window then costs no sleep and wake-up. The frontend's
//! workers watch their avail rings for the driver's next request; an iothread with nothing at
//! the device watches its submission queue for the frontend's next slot.
//!
//! The window adapts to what waiting has cost lately: it grows (from 4 µs, doubling) while
//! the wait was longer than the window but within the bound, and drops to zero when a wait
//! was longer than the bound (polling would not have caught it), so that a disk whose I/O is
//! slow, or that is idle, does not poll at all. [`AdaptivePoll`] only does that arithmetic;
//! [`spin_until`] is the spin, which gives the CPU away between looks: on a machine with few
//! CPUs the thread that produces the awaited work (the client, the other process) may need
//! the very CPU the poller holds.

// Tests may panic on what they set up themselves.
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]
#![warn(missing_docs)]

use std::time::{Duration, Instant};

/// Where a window grows from, as in QEMU (`aio_poll`'s 4 µs).
const INITIAL_WINDOW: Duration = Duration::from_micros(4);

/// The adaptive window of one polling thread.
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

    /// Whether polling may ever happen (the bound is not zero).
    pub fn enabled(&self) -> bool {
        !self.max.is_zero()
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

/// Looks at `ready` until it says yes (returns true) or `window` has passed since `start`
/// (returns false), yielding the CPU to any other runnable thread between looks. A yield
/// with nobody else to run returns at once, so alone on its CPU this is a plain spin; with
/// the client or the other blkplane process waiting for that CPU, they run, which is what
/// makes the awaited work arrive (measured in BENCHMARKS.md: without it, a spinning poller
/// on a 2-vCPU machine delayed the very work it waited for).
pub fn spin_until(start: Instant, window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= window {
            return false;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn disabled_never_opens() {
        let mut p = AdaptivePoll::new(Duration::ZERO);
        assert!(!p.enabled());
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
    fn the_spin_ends_when_ready_or_when_the_window_has_passed() {
        let start = Instant::now();
        assert!(spin_until(start, Duration::ZERO, || true), "ready at once");
        let mut looks = 0;
        assert!(spin_until(start, Duration::from_secs(10), || {
            looks += 1;
            looks == 3
        }));
        assert_eq!(looks, 3);
        let start = Instant::now();
        assert!(!spin_until(start, 200 * US, || false));
        assert!(start.elapsed() >= 200 * US);
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
