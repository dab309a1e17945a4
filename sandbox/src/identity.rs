//! Running a disk's processes as a configured unprivileged user (`--run-as`).
//!
//! The model is QEMU's `-run-with user=`: a frontend started by root opens its image, binds
//! its sockets and forks its iothread spawner with the few capabilities that needs, then
//! switches every thread to the configured uid, gid and supplementary groups, which empties
//! its capability sets (the image is opened with that user's file-system ids already, see
//! [`open_as`]); the spawner does the same before it serves, so iothreads start as
//! that user. What the processes opened before the switch stays usable through its
//! descriptor, and nothing after it opens a path (the seccomp filters forbid `open`).

use std::fmt;
use std::io;
use std::str::FromStr;

use crate::caps;
use crate::SandboxError;

/// Most supplementary groups a [`RunAs`] may name (far below the kernel's NGROUPS_MAX; a
/// disk needs its image's group or the `kernel.io_uring_group`, not hundreds).
pub const MAX_GROUPS: usize = 32;

/// The identity a disk's processes switch to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    /// User id; never 0 (root), never `u32::MAX` (which `setresuid` reads as "unchanged").
    pub uid: u32,
    /// Primary group id; never `u32::MAX`.
    pub gid: u32,
    /// Supplementary groups (at most [`MAX_GROUPS`]); the process has no other.
    pub groups: Vec<u32>,
}

/// Why a [`RunAs`] is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunAsError {
    /// Not of the form `UID:GID[:GROUP,...]`.
    #[error("{0:?} is not UID:GID or UID:GID:GROUP,GROUP,... (numeric ids)")]
    Syntax(String),
    /// uid 0.
    #[error("uid 0 is root: leave the user unset to run as the launcher's own user")]
    Root,
    /// `u32::MAX` as an id.
    #[error("{0} is not a valid id (it means \"unchanged\" to the kernel)")]
    Unchanged(&'static str),
    /// Too many supplementary groups.
    #[error("{0} supplementary groups; at most {MAX_GROUPS} are allowed")]
    TooManyGroups(usize),
}

impl RunAs {
    /// Checks the rules in the field docs.
    pub fn new(uid: u32, gid: u32, groups: Vec<u32>) -> Result<Self, RunAsError> {
        if uid == 0 {
            return Err(RunAsError::Root);
        }
        if uid == u32::MAX {
            return Err(RunAsError::Unchanged("uid"));
        }
        if gid == u32::MAX {
            return Err(RunAsError::Unchanged("gid"));
        }
        if groups.contains(&u32::MAX) {
            return Err(RunAsError::Unchanged("group"));
        }
        if groups.len() > MAX_GROUPS {
            return Err(RunAsError::TooManyGroups(groups.len()));
        }
        Ok(Self { uid, gid, groups })
    }
}

impl FromStr for RunAs {
    type Err = RunAsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let syntax = || RunAsError::Syntax(s.to_string());
        let mut parts = s.split(':');
        let uid = parts
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(syntax)?;
        let gid = parts
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(syntax)?;
        let groups = match parts.next() {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .map(|g| g.parse().map_err(|_| syntax()))
                .collect::<Result<_, _>>()?,
        };
        if parts.next().is_some() {
            return Err(syntax());
        }
        Self::new(uid, gid, groups)
    }
}

impl fmt::Display for RunAs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)?;
        for (i, g) in self.groups.iter().enumerate() {
            write!(f, "{}{g}", if i == 0 { ':' } else { ',' })?;
        }
        Ok(())
    }
}

/// Start-up of a process that will [`switch_identity`] later: empties the bounding and
/// ambient sets and sets `no_new_privs`, like [`crate::drop_capabilities`], but keeps in the
/// effective and permitted sets the four capabilities start-up and the switch need —
/// CAP_DAC_OVERRIDE (open an image owned by the disk's user, bind in a root-owned
/// directory), CAP_CHOWN (hand the vhost-user socket to that user), CAP_SETGID and
/// CAP_SETUID (the switch). Call it first thing in `main`, before any thread starts.
pub fn keep_only_identity_capabilities() -> Result<(), SandboxError> {
    caps::drop_all_but(&[
        caps::CAP_CHOWN,
        caps::CAP_DAC_OVERRIDE,
        caps::CAP_SETGID,
        caps::CAP_SETUID,
    ])
}

/// Runs `open` with the file-system identity of `run_as` — its uid, gid and supplementary
/// groups — and then returns to root's. Files are opened as the disk's user would open them,
/// so that a path swapped for a symlink or hard link by someone who can write to its
/// directory cannot make a root process open a file that user may not. The file-system ids
/// are the calling thread's own: call this while the process has one thread. The groups stay
/// (the later [`switch_identity`] sets the same ones).
pub fn open_as<T>(run_as: &RunAs, open: impl FnOnce() -> T) -> Result<T, SandboxError> {
    let failed = |what: &'static str| SandboxError::Identity {
        what,
        source: io::Error::last_os_error(),
    };
    // SAFETY: setgroups reads `len` group ids from a live slice.
    if unsafe { libc::setgroups(run_as.groups.len(), run_as.groups.as_ptr()) } < 0 {
        return Err(failed("setgroups"));
    }
    // setfsuid and setfsgid return the previous id and report no error: each is called again
    // with an invalid id, which changes nothing and returns the current one.
    // SAFETY: setfsgid and setfsuid take plain ids and change only this thread's.
    let switched = unsafe {
        libc::setfsgid(run_as.gid);
        libc::setfsuid(run_as.uid);
        libc::setfsgid(u32::MAX) as u32 == run_as.gid
            && libc::setfsuid(u32::MAX) as u32 == run_as.uid
    };
    let result = switched.then(open);
    // SAFETY: as above; back to root's ids, which gives back the file capabilities the
    // change of fsuid took from the effective set.
    let restored = unsafe {
        libc::setfsuid(0);
        libc::setfsgid(0);
        libc::setfsuid(u32::MAX) == 0 && libc::setfsgid(u32::MAX) == 0
    };
    match (result, restored) {
        (Some(value), true) => Ok(value),
        (None, _) => Err(SandboxError::Identity {
            what: "setfsuid",
            source: io::Error::other("the file-system ids did not change"),
        }),
        (Some(_), false) => Err(SandboxError::Identity {
            what: "setfsuid",
            source: io::Error::other("the file-system ids did not return to root's"),
        }),
    }
}

/// Switches every thread of the process to `run_as`: supplementary groups, gid, then uid.
/// glibc applies each change to every thread of the process (and aborts the process if a
/// thread could not follow). Leaving uid 0 for good empties the capability sets. The calling
/// thread's ids, groups and capabilities are checked afterwards; any difference is an error.
pub fn switch_identity(run_as: &RunAs) -> Result<(), SandboxError> {
    let failed = |what: &'static str| SandboxError::Identity {
        what,
        source: io::Error::last_os_error(),
    };
    // SAFETY: setgroups reads `len` group ids from a live slice.
    if unsafe { libc::setgroups(run_as.groups.len(), run_as.groups.as_ptr()) } < 0 {
        return Err(failed("setgroups"));
    }
    // SAFETY: setresgid and setresuid take plain ids; glibc makes every thread follow.
    if unsafe { libc::setresgid(run_as.gid, run_as.gid, run_as.gid) } < 0 {
        return Err(failed("setresgid"));
    }
    // SAFETY: as above.
    if unsafe { libc::setresuid(run_as.uid, run_as.uid, run_as.uid) } < 0 {
        return Err(failed("setresuid"));
    }
    let mismatch = |what: &'static str| SandboxError::Identity {
        what,
        source: io::Error::other("the switch did not take effect"),
    };
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: getresuid writes three ids through valid pointers.
    if unsafe { libc::getresuid(&mut r, &mut e, &mut s) } < 0 || [r, e, s] != [run_as.uid; 3] {
        return Err(mismatch("uid"));
    }
    // SAFETY: getresgid writes three ids through valid pointers.
    if unsafe { libc::getresgid(&mut r, &mut e, &mut s) } < 0 || [r, e, s] != [run_as.gid; 3] {
        return Err(mismatch("gid"));
    }
    let mut groups = [0u32; MAX_GROUPS + 1];
    // SAFETY: getgroups writes at most `groups.len()` ids into the live array.
    let count = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    let mut have: Vec<u32> = usize::try_from(count)
        .ok()
        .and_then(|n| groups.get(..n))
        .ok_or_else(|| mismatch("groups"))?
        .to_vec();
    let mut want = run_as.groups.clone();
    have.sort_unstable();
    have.dedup();
    want.sort_unstable();
    want.dedup();
    if have != want {
        return Err(mismatch("groups"));
    }
    if caps::any_left()? {
        return Err(mismatch("capabilities"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_user_group_and_groups() {
        let plain: RunAs = "107:107".parse().unwrap();
        assert_eq!(plain, RunAs::new(107, 107, vec![]).unwrap());
        assert_eq!(plain.to_string(), "107:107");
        let with_groups: RunAs = "1000:100:36,995".parse().unwrap();
        assert_eq!(with_groups.groups, vec![36, 995]);
        assert_eq!(with_groups.to_string(), "1000:100:36,995");
    }

    #[test]
    fn refuses_root_unchanged_ids_and_bad_syntax() {
        assert_eq!("0:0".parse::<RunAs>(), Err(RunAsError::Root));
        assert_eq!(
            "4294967295:1".parse::<RunAs>(),
            Err(RunAsError::Unchanged("uid"))
        );
        assert_eq!(
            "1:4294967295".parse::<RunAs>(),
            Err(RunAsError::Unchanged("gid"))
        );
        assert_eq!(
            "1:1:4294967295".parse::<RunAs>(),
            Err(RunAsError::Unchanged("group"))
        );
        let many = (0..=MAX_GROUPS).map(|g| g.to_string()).collect::<Vec<_>>();
        assert_eq!(
            format!("1:1:{}", many.join(",")).parse::<RunAs>(),
            Err(RunAsError::TooManyGroups(MAX_GROUPS + 1))
        );
        for bad in [
            "", "107", "107:", ":107", "a:b", "1:1:", "1:1:2,", "1:1:2:3", "-1:1",
        ] {
            assert!(
                matches!(bad.parse::<RunAs>(), Err(RunAsError::Syntax(_))),
                "{bad:?}"
            );
        }
    }
}
