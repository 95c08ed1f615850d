//! A real DNS-over-TLS server: Debian's `unbound`, serving TLS on a loopback port
//! (`tls-service-key`, `tls-service-pem`) and forwarding every query to a given server (a test's
//! Knot), with certificates made at test time ([`Pki`], rcgen).
//!
//! Counters come from `unbound-control stats_noreset` over a Unix control socket
//! (`num.query.tls`, `num.query.tls.resume`); open connections from `ss`.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};

use crate::{Process, TempDir, free_port, wait_until};

/// A certificate authority made for one test, and the files of what it signs.
pub struct Pki {
    dir: TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A server certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Pki {
    /// A new CA named `name` (its certificate written as `<name>.pem`).
    pub fn new(name: &str) -> anyhow::Result<Pki> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let pki = Pki {
            dir: TempDir::new("nodedns-pki")?,
            ca,
        };
        std::fs::write(pki.ca_file(), pki.ca.pem())?;
        Ok(pki)
    }

    /// The CA's certificate (what `tls CA` names).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A server certificate for `sans` (DNS names or IP addresses), valid now, or expired
    /// since 2000 when `expired`; written as `<file>.pem` and `<file>.key`.
    pub fn server(&self, file: &str, sans: &[&str], expired: bool) -> anyhow::Result<ServerFiles> {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(sans)?;
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        if expired {
            params.not_before = date_time_ymd(1999, 1, 1);
            params.not_after = date_time_ymd(2000, 1, 1);
        }
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        let files = ServerFiles {
            cert: self.dir.path().join(format!("{file}.pem")),
            key: self.dir.path().join(format!("{file}.key")),
        };
        std::fs::write(&files.cert, cert.pem())?;
        std::fs::write(&files.key, key.serialize_pem())?;
        Ok(files)
    }
}

/// A running `unbound` serving DNS over TLS on [`Unbound::addr`] only. Stopped (SIGTERM by PID)
/// on drop.
#[derive(Debug)]
pub struct Unbound {
    // Declared before `_dir` so the process stops before its directory is removed.
    process: Process,
    addr: SocketAddr,
    conf: PathBuf,
    /// Its configuration, certificates' copies, control socket: removed after it stopped.
    _dir: TempDir,
}

/// Starts unbound, or returns `None` after printing why when it is not installed (so the
/// calling test passes as skipped).
pub fn unbound_or_skip(forward_to: SocketAddr, server: &ServerFiles) -> Option<Unbound> {
    if !crate::have("unbound") || !crate::have("unbound-control") {
        eprintln!("skipped: unbound/unbound-control not installed (Debian package `unbound`)");
        return None;
    }
    Some(Unbound::start(forward_to, server).expect("unbound starts"))
}

impl Unbound {
    /// Serves TLS on a free loopback port with `server`'s certificate, forwarding to
    /// `forward_to`; returns once its control socket answers and the port accepts connections.
    pub fn start(forward_to: SocketAddr, server: &ServerFiles) -> anyhow::Result<Unbound> {
        let mut last = None;
        // A free port can be taken between choosing and binding it: retry with new ones.
        for _ in 0..3 {
            match Unbound::try_start(forward_to, server) {
                Ok(unbound) => return Ok(unbound),
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("unbound did not start")))
    }

    fn try_start(forward_to: SocketAddr, server: &ServerFiles) -> anyhow::Result<Unbound> {
        let dir = TempDir::new("nodedns-unbound")?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        // Session tickets need a key: 80 random bytes, as unbound.conf(5) asks.
        let tickets = dir.path().join("tickets.key");
        std::fs::write(&tickets, rand::random::<[u8; 80]>())?;
        let conf = dir.path().join("unbound.conf");
        std::fs::write(
            &conf,
            config(dir.path(), addr, forward_to, server, &tickets),
        )?;
        let mut command = Command::new("unbound");
        command.arg("-d").arg("-c").arg(&conf);
        let process = Process::spawn("unbound", command).context("spawn unbound")?;
        let mut unbound = Unbound {
            process,
            addr,
            conf,
            _dir: dir,
        };
        let process = &mut unbound.process;
        let (conf, addr) = (unbound.conf.clone(), unbound.addr);
        wait_until(
            "unbound",
            Duration::from_secs(10),
            || match process.exited() {
                Some(status) => bail!("unbound exited during start-up: {status}"),
                None => Ok(()),
            },
            || {
                control(&conf, "status").is_ok()
                    && std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                        .is_ok()
            },
        )
        .with_context(|| format!("unbound log:\n{}", unbound.process.output()))?;
        Ok(unbound)
    }

    /// The address it serves DNS over TLS on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its log so far.
    pub fn output(&self) -> String {
        self.process.output()
    }

    /// Every counter of `unbound-control stats_noreset`, as `(name, value)`.
    pub fn stats(&self) -> anyhow::Result<Vec<(String, u64)>> {
        let text = control(&self.conf, "stats_noreset")?;
        Ok(text
            .lines()
            .filter_map(|line| {
                let (key, value) = line.split_once('=')?;
                // Counters are integers; a few (times, averages) are not and are skipped.
                Some((key.to_owned(), value.trim().parse().ok()?))
            })
            .collect())
    }

    /// One counter (0 when unbound does not report it).
    pub fn stat(&self, name: &str) -> anyhow::Result<u64> {
        Ok(self
            .stats()?
            .into_iter()
            .find(|(k, _)| k == name)
            .map_or(0, |(_, v)| v))
    }

    /// Queries that arrived over TLS.
    pub fn tls_queries(&self) -> anyhow::Result<u64> {
        self.stat("num.query.tls")
    }

    /// TCP connections to its port established right now (`ss`).
    pub fn connections(&self) -> anyhow::Result<usize> {
        established(self.addr)
    }
}

/// TCP connections to `addr` established right now, counted with `ss` on the server's side.
pub fn established(addr: SocketAddr) -> anyhow::Result<usize> {
    let output = Command::new("ss")
        .args(["-Htn", "state", "established"])
        .arg(format!("( sport = :{} )", addr.port()))
        .output()
        .context("run ss")?;
    if !output.status.success() {
        bail!("ss failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let local = addr.to_string();
    Ok(text
        .lines()
        .filter(|line| line.split_whitespace().nth(2) == Some(local.as_str()))
        .count())
}

fn control(conf: &Path, command: &str) -> anyhow::Result<String> {
    let output = Command::new("unbound-control")
        .arg("-c")
        .arg(conf)
        .arg(command)
        .output()
        .context("run unbound-control")?;
    if !output.status.success() {
        bail!(
            "unbound-control {command} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn config(
    dir: &Path,
    addr: SocketAddr,
    forward_to: SocketAddr,
    server: &ServerFiles,
    tickets: &Path,
) -> String {
    let d = dir.display();
    let mut conf = String::new();
    let _ = write!(
        conf,
        r#"server:
    interface: {ip}@{port}
    tls-port: {port}
    tls-service-pem: "{cert}"
    tls-service-key: "{key}"
    tls-session-ticket-keys: "{tickets}"
    port: {port}
    do-udp: no
    do-ip6: no
    num-threads: 1
    do-daemonize: no
    chroot: ""
    username: ""
    directory: "{d}"
    pidfile: "{d}/unbound.pid"
    use-syslog: no
    logfile: ""
    verbosity: 1
    access-control: 127.0.0.0/8 allow
    do-not-query-localhost: no
    module-config: "iterator"
    qname-minimisation: no
    extended-statistics: yes
    statistics-cumulative: yes
    tcp-idle-timeout: 30000

forward-zone:
    name: "."
    forward-addr: {fip}@{fport}

remote-control:
    control-enable: yes
    control-interface: "{d}/control.sock"
    control-use-cert: no
"#,
        ip = addr.ip(),
        port = addr.port(),
        cert = server.cert.display(),
        key = server.key.display(),
        tickets = tickets.display(),
        fip = forward_to.ip(),
        fport = forward_to.port(),
    );
    conf
}
