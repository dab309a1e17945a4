//! Two "nodes" on one machine for tests of what crosses a network: two network namespaces of
//! this test's own, joined by a veth pair, each with one address; removed on drop. Programs
//! run in a node with `ip netns exec` (which execs them: the pid is theirs). Needs root and
//! iproute2 (`tests/setup.sh`).

use std::ffi::OsStr;
use std::process::Command;

/// The two nodes' addresses, on the veth pair between them (only inside the namespaces).
pub const ADDRESSES: [&str; 2] = ["10.231.0.1", "10.231.0.2"];

/// Two network namespaces joined by a veth pair.
pub struct TwoNodes {
    names: [String; 2],
    /// Each node's end of the veth pair.
    links: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip {args:?}: {e} (install iproute2: tests/setup.sh)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl TwoNodes {
    /// Creates the namespaces `bp<pid><tag>a` and `…b`, the veth pair, the addresses and
    /// loopback in each.
    pub fn new(tag: &str) -> Result<TwoNodes, String> {
        let pid = std::process::id();
        // Interface names are global to the machine until moved, and at most 15 bytes: the
        // pid and a number per pair of this process.
        static PAIRS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nodes = TwoNodes {
            names: [format!("bp{pid}{tag}a"), format!("bp{pid}{tag}b")],
            links: [format!("v{pid}.{n}a"), format!("v{pid}.{n}b")],
        };
        let [a, b] = &nodes.names;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        let [va, vb] = &nodes.links;
        ip(&[
            "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b,
        ])?;
        for (ns, dev, addr) in [(a, va, ADDRESSES[0]), (b, vb, ADDRESSES[1])] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(nodes)
    }

    /// The namespace of node `i` (0 or 1).
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// Cuts the network between the nodes (`false`: node `i`'s end of the veth pair goes
    /// down, as an unplugged cable: its peer sees no carrier and nothing crosses) or restores
    /// it (`true`).
    pub fn connect(&self, i: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&["-n", self.name(i), "link", "set", &self.links[i], state])?;
        if up {
            // What the nodes learnt while the cable was out (an address that did not answer)
            // would fail their next connections for a while.
            for node in 0..2 {
                ip(&["-n", self.name(node), "neigh", "flush", "all"])?;
            }
        }
        Ok(())
    }

    /// Waits until a TCP connection from node `from` to `address`:`port` succeeds (the network
    /// is back and something listens), at most `timeout`.
    pub fn wait_reachable(
        &self,
        from: usize,
        address: &str,
        port: u16,
        timeout: std::time::Duration,
    ) -> Result<(), String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let reached = self
                .command(from, "bash")
                .args(["-c", &format!("exec 3<>/dev/tcp/{address}/{port}")])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if reached {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(format!(
                    "node {from} did not reach {address}:{port} within {timeout:?}"
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// `program` to run in node `i`.
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        in_netns(self.name(i), program)
    }
}

/// `program` to run in network namespace `ns` (`ip netns exec NS PROGRAM`).
pub fn in_netns(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).arg(program);
    cmd
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        // Removing a namespace removes its end of the veth pair, and with it the other end.
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}
