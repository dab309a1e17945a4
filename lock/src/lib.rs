//! blkplane's one way to take a lock: poisoning is ignored. What blkplane's processes keep
//! behind a `std::sync::Mutex` — blkplaned's disk table and a disk's runtime state, a
//! frontend's device state, its iothread links and status strings — is plain data that every
//! holder leaves consistent at each step, and a thread that panicked (a bug, logged by the
//! panic hook) must not wedge every other thread of the process behind a poisoned mutex: the
//! data is taken over as the last holder left it, and whatever comes next (the next message,
//! the next poll, a disconnect) deals with it.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data over from a holder that panicked.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_taken_over() {
        let m = Mutex::new(1);
        let _ = std::panic::catch_unwind(|| {
            let _held = m.lock().unwrap();
            panic!("holder panics");
        });
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
