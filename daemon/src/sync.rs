//! The daemon's one way to take a lock: poisoning is ignored, because what the daemon keeps
//! behind its mutexes (the disk table, a disk's runtime state) is plain data that every
//! holder leaves consistent, and a panicked API task must not wedge the whole node.

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
