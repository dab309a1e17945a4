//! Certificates for the TLS tests, made by the `openssl` command (installed by
//! `tests/setup.sh`): real X.509 files that blkplaned and its clients load as they would an
//! operator's.

use std::path::Path;
use std::process::Command;

/// Runs `openssl ARGS` in `dir`; panics with its stderr if it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl (install the openssl package)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes, in `dir`, a self-signed CA (`CA.pem`, `CA.key`) and a certificate signed by it for
/// `name` (`NAME.pem`, `NAME.key`) with `san` as its subjectAltName (e.g.
/// `DNS:localhost,IP:127.0.0.1`). EC P-256 keys, valid for two days.
pub fn make_certs(dir: &Path, ca: &str, name: &str, san: &str) {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), format!("subjectAltName={san}\n"))
        .unwrap_or_else(|e| panic!("writing {ext}: {e}"));
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ca_subject = format!("/CN={ca}");
    let (ca_key, ca_pem) = (format!("{ca}.key"), format!("{ca}.pem"));
    let mut req = vec!["req", "-x509"];
    req.extend(ec);
    req.extend([
        "-days",
        "2",
        "-subj",
        &ca_subject,
        "-keyout",
        &ca_key,
        "-out",
        &ca_pem,
    ]);
    openssl(dir, &req);
    let subject = format!("/CN={name}");
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    let mut req = vec!["req"];
    req.extend(ec);
    req.extend(["-subj", &subject, "-keyout", &key, "-out", &csr]);
    openssl(dir, &req);
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &pem,
        ],
    );
}

/// Makes the certificates of the TLS tests in `dir`: the server's (`server.pem`, `server.key`,
/// for localhost and 127.0.0.1, signed by `server-ca`), a client's (`client.pem`,
/// `client.key`, signed by `client-ca`) and a stranger's (`stranger.pem`, `stranger.key`,
/// signed by `other-ca`, which nobody trusts).
pub fn make_test_certs(dir: &Path) {
    make_certs(dir, "server-ca", "server", "DNS:localhost,IP:127.0.0.1");
    make_certs(dir, "client-ca", "client", "DNS:blkplanectl");
    make_certs(dir, "other-ca", "stranger", "DNS:stranger");
}

/// blkplaned's options for serving `tcp:127.0.0.1:PORT` with the certificates of
/// [`make_test_certs`] in `dir`: its own, and `client-ca` for the clients'.
pub fn server_options(dir: &Path, port: u16) -> Vec<String> {
    listen_options(dir, &format!("127.0.0.1:{port}"))
}

/// blkplaned's options for serving `tcp:ENDPOINT` with the certificates of
/// [`make_test_certs`] (or ones named the same) in `dir`.
fn listen_options(dir: &Path, endpoint: &str) -> Vec<String> {
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    vec![
        "--listen".into(),
        format!("tcp:{endpoint}"),
        "--tls-cert".into(),
        file("server.pem"),
        "--tls-key".into(),
        file("server.key"),
        "--tls-client-ca".into(),
        file("client-ca.pem"),
    ]
}

/// One node's blkplaned serving its API at `endpoint` (`ADDR:PORT`) with the certificates
/// of [`make_test_certs`] in `dir` (or ones named the same), named `name`, and, with
/// `peers`, the files to reach other nodes' blkplaned (the client certificate); and the
/// blkplanectl options that reach it. Returns (blkplaned's extra options, blkplanectl's).
pub fn node_options(
    dir: &Path,
    endpoint: &str,
    name: &str,
    peers: bool,
) -> (Vec<String>, Vec<String>) {
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let mut daemon = listen_options(dir, endpoint);
    daemon.extend(["--node-name".into(), name.into()]);
    let client = [
        file("server-ca.pem"),
        file("client.pem"),
        file("client.key"),
    ];
    if peers {
        for (option, f) in ["--peer-tls-ca", "--peer-tls-cert", "--peer-tls-key"]
            .iter()
            .zip(&client)
        {
            daemon.extend([option.to_string(), f.clone()]);
        }
    }
    let mut ctl = vec!["--endpoint".to_string(), format!("tcp:{endpoint}")];
    for (option, f) in ["--tls-ca", "--tls-cert", "--tls-key"].iter().zip(&client) {
        ctl.extend([option.to_string(), f.clone()]);
    }
    (daemon, ctl)
}

/// A TCP port of 127.0.0.1 that was free a moment ago (released again, for a server to bind).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a free port of 127.0.0.1")
}
