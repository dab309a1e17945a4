//! The clock both processes of a disk read: `CLOCK_MONOTONIC` in nanoseconds, the same clock
//! as `std::time::Instant` on Linux, so a time the iothread stamps a completion with and a time
//! the frontend took the request off the avail ring can be subtracted.

/// Nanoseconds of `CLOCK_MONOTONIC` (through the vDSO: no system call on the request path).
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `now`; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_ns_agrees_with_instant() {
        let before = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let after = monotonic_ns();
        assert!(after >= before + 2_000_000, "{before} {after}");
    }
}
