//! What one wake-up costs on this machine: two threads bounce an eventfd ping-pong, pinned to
//! different CPUs or to the same one. Every hop between blkplane's processes (client →
//! frontend → iothread and back) is such a wake-up when the peer sleeps, so this is the unit
//! its latency at low queue depth is made of.

use std::io;
use std::time::Instant;

use crate::target::CpuList;

/// The cost of one thread waking another through an eventfd.
#[derive(Debug, Clone, Copy)]
pub struct HopCost {
    /// Wall-clock time from one thread's write to the other running, µs.
    pub latency_us: f64,
    /// CPU time both threads spend per hop, µs.
    pub cpu_us: f64,
}

fn eventfd() -> io::Result<i32> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(fd)
    }
}

fn signal(fd: i32) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a local buffer to an eventfd we own.
    unsafe { libc::write(fd, one.as_ptr().cast(), 8) };
}

fn wait(fd: i32) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a local buffer from an eventfd we own.
    unsafe { libc::read(fd, buf.as_mut_ptr().cast(), 8) };
}

fn thread_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we pass.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut usage);
        usage
    };
    let seconds = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Bounces `round_trips` round trips between a thread on `first` and one on `second`.
pub fn measure(first: usize, second: usize, round_trips: u32) -> io::Result<HopCost> {
    let (ping, pong) = (eventfd()?, eventfd()?);
    let pin = |cpu: usize| -> io::Result<()> {
        CpuList::parse(&cpu.to_string())
            .map_err(io::Error::other)?
            .pin_current_thread()
    };
    let result = std::thread::scope(|scope| -> io::Result<HopCost> {
        let echo = scope.spawn(move || -> io::Result<f64> {
            pin(second)?;
            let start = thread_cpu_seconds();
            for _ in 0..round_trips {
                wait(ping);
                signal(pong);
            }
            Ok(thread_cpu_seconds() - start)
        });
        let main = scope.spawn(move || -> io::Result<(f64, f64)> {
            pin(first)?;
            // Warm up: both threads running and pinned before timing.
            std::thread::sleep(std::time::Duration::from_millis(20));
            let start = Instant::now();
            let cpu = thread_cpu_seconds();
            for _ in 0..round_trips {
                signal(ping);
                wait(pong);
            }
            Ok((start.elapsed().as_secs_f64(), thread_cpu_seconds() - cpu))
        });
        let (wall, cpu_main) = main.join().map_err(|_| io::Error::other("ping thread"))??;
        let cpu_echo = echo.join().map_err(|_| io::Error::other("echo thread"))??;
        let hops = 2.0 * f64::from(round_trips);
        Ok(HopCost {
            latency_us: wall / hops * 1e6,
            cpu_us: (cpu_main + cpu_echo) / hops * 1e6,
        })
    });
    // SAFETY: closing the two eventfds created above, used by nobody any more.
    unsafe {
        libc::close(ping);
        libc::close(pong);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ping_pong_costs_something() {
        let cost = measure(0, 0, 200).unwrap();
        assert!(
            cost.latency_us > 0.0 && cost.latency_us < 100_000.0,
            "{cost:?}"
        );
    }
}
