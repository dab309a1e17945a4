//! Dropping capabilities: the bounding set (so that no `execve` can give any back), the
//! ambient set, then the process's own sets. A blkplane process started as root keeps root's
//! uid but none of root's powers over files and processes it does not own.

use std::io;

use crate::SandboxError;

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit capability sets in two 32-bit words.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn failed(what: &'static str) -> SandboxError {
    SandboxError::Capabilities {
        what,
        source: io::Error::last_os_error(),
    }
}

fn drop_bounding_set() -> Result<(), SandboxError> {
    for cap in 0..=libc::c_ulong::from(u8::MAX) {
        // SAFETY: PR_CAPBSET_READ takes a capability number and no pointer.
        let present = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) };
        if present < 0 {
            // EINVAL: past the last capability this kernel knows.
            break;
        }
        // SAFETY: PR_CAPBSET_DROP takes a capability number and no pointer.
        if present == 1 && unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } < 0 {
            let error = failed("PR_CAPBSET_DROP");
            // EPERM: no CAP_SETPCAP, so no capability at all to drop here.
            return match &error {
                SandboxError::Capabilities { source, .. }
                    if source.raw_os_error() == Some(libc::EPERM) =>
                {
                    Ok(())
                }
                _ => Err(error),
            };
        }
    }
    Ok(())
}

/// Capability numbers of <linux/capability.h> (the libc crate has none).
pub(crate) const CAP_CHOWN: u32 = 0;
/// See [`CAP_CHOWN`].
pub(crate) const CAP_DAC_OVERRIDE: u32 = 1;
/// See [`CAP_CHOWN`].
pub(crate) const CAP_SETGID: u32 = 6;
/// See [`CAP_CHOWN`].
pub(crate) const CAP_SETUID: u32 = 7;

/// Drops every capability of the calling process and sets `no_new_privs`. The bounding and
/// ambient sets are the process's, but the effective, permitted and inheritable sets are each
/// thread's own: call this first thing in `main`, before any thread starts (threads inherit
/// the empty sets).
pub fn drop_capabilities() -> Result<(), SandboxError> {
    drop_all_but(&[])
}

/// [`drop_capabilities`], except that `keep` stays in the effective and permitted sets (if it
/// was there).
pub(crate) fn drop_all_but(keep: &[u32]) -> Result<(), SandboxError> {
    // Dropping from the bounding set needs CAP_SETPCAP. A process without it (an unprivileged
    // uid, as in the Helm chart) cannot empty its bounding set, nor does it need to: it has no
    // capability to lose, and `no_new_privs` (below) keeps execve from granting any.
    drop_bounding_set()?;
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointer.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    if rc < 0 {
        return Err(failed("PR_CAP_AMBIENT_CLEAR_ALL"));
    }
    let current = capget()?;
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    for &cap in keep {
        // Word cap / 32, bit cap % 32 (version 3 has two words: capabilities 0 to 63).
        let word = usize::try_from(cap / 32).unwrap_or(usize::MAX);
        let (Some(kept), Some(now)) = (data.get_mut(word), current.get(word)) else {
            continue;
        };
        let bit = 1u32 << (cap % 32);
        kept.permitted |= now.permitted & bit;
        kept.effective |= now.permitted & bit;
    }
    // SAFETY: capset reads a version-3 header and two data words, which is what we pass.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } < 0 {
        return Err(failed("capset"));
    }
    // SAFETY: PR_SET_NO_NEW_PRIVS takes no pointer. Set here too, not only by the seccomp
    // installation, so that a process that only drops capabilities cannot regain any through a
    // set-uid binary either.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } < 0 {
        return Err(failed("PR_SET_NO_NEW_PRIVS"));
    }
    Ok(())
}

/// Whether the calling thread has any capability left in its effective, permitted or
/// inheritable set.
pub(crate) fn any_left() -> Result<bool, SandboxError> {
    Ok(capget()?
        .iter()
        .any(|d| d.effective | d.permitted | d.inheritable != 0))
}

/// The calling thread's capability sets.
fn capget() -> Result<[CapData; 2], SandboxError> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes a version-3 header's two data words, which is what we pass.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } < 0 {
        return Err(failed("capget"));
    }
    Ok(data)
}
