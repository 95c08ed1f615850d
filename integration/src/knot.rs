//! A real Knot DNS server (`knotd`, authoritative) standing in for CoreDNS.
//!
//! Contract (other tests code against it):
//!
//! ```text
//! pub struct Zone { pub origin: String, pub body: String }       // zone file text after $ORIGIN
//! pub struct Options { pub listen: Vec<SocketAddr>, pub netns: Option<String>, pub zones: Vec<Zone> }
//! pub struct Knot { .. }                                          // killed (by PID) on drop
//! impl Knot {
//!     pub fn start(options: Options) -> anyhow::Result<Knot>;     // returns once it answers
//!     pub fn cluster_local() -> Zone;                             // a standard cluster.local test zone
//!     pub fn queries(&self) -> anyhow::Result<u64>;               // queries it has received (mod-stats)
//!     pub fn tcp_queries(&self) -> anyhow::Result<u64>;
//!     pub fn stop(self);
//! }
//! ```
//!
//! Each server gets its own temporary directory (configuration, zone files, run directory,
//! database, control socket), so any number run at once. Query counters come from Knot's
//! `mod-stats` module, loaded globally and read with `knotc stats` over the control socket (a
//! filesystem socket, so it works whatever network namespace `knotd` runs in).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;

use crate::{Process, TempDir, client, free_port, wait_until};

/// One zone: its origin (`cluster.local.`; a missing final dot is added) and the zone file text
/// that follows the `$ORIGIN` line Knot is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone {
    pub origin: String,
    pub body: String,
}

/// How to run a Knot server.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Addresses to serve UDP and TCP on. Empty means one free port on 127.0.0.1. A port of 0
    /// means a free loopback port outside a namespace, and 53 inside one (a fresh namespace has
    /// every port free).
    pub listen: Vec<SocketAddr>,
    /// Run `knotd` under `ip netns exec <netns>`; the listen addresses must exist there.
    pub netns: Option<String>,
    pub zones: Vec<Zone>,
}

/// A running `knotd`. Stopped (SIGTERM by PID, then SIGKILL) on drop; its log is printed if the
/// test is failing.
#[derive(Debug)]
pub struct Knot {
    // Declared before `dir` so the process stops before its directory is removed.
    process: Process,
    listen: Vec<SocketAddr>,
    socket: PathBuf,
    dir: TempDir,
}

/// The TTL of the SOA record of [`Knot::cluster_local`]; its MINIMUM is 60, so the negative TTL
/// (RFC 2308 §5: min of the two) is this.
pub const NEGATIVE_TTL: u32 = 30;
/// Number of A records of `big.default.svc.cluster.local.`: about 1 kB as a reply, more than
/// 512 bytes and less than 1232.
pub const BIG_RECORDS: u8 = 60;
/// Number of 200-character TXT strings at `huge.default.svc.cluster.local.`: over 2 kB as a
/// reply, more than any UDP limit nodedns advertises.
pub const HUGE_STRINGS: usize = 12;

impl Knot {
    /// Writes the configuration and zone files, starts `knotd`, and returns once it answers an
    /// SOA query for every zone on every listen address (or fails after 10 s, with its log).
    pub fn start(options: Options) -> anyhow::Result<Knot> {
        // Only ports the harness chose itself are worth retrying with new ones.
        let explicit = options.netns.is_some()
            || (!options.listen.is_empty() && options.listen.iter().all(|a| a.port() != 0));
        let mut last = None;
        // A free port can be taken between choosing and binding it: retry with new ones.
        for _ in 0..3 {
            match Knot::try_start(&options) {
                Ok(knot) => return Ok(knot),
                Err(error) if !explicit => last = Some(error),
                Err(error) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("knotd did not start")))
    }

    fn try_start(options: &Options) -> anyhow::Result<Knot> {
        let dir = TempDir::new("nodedns-knot")?;
        let listen = resolve_listen(options)?;
        let socket = dir.path().join("knot.sock");
        let conf = dir.path().join("knot.conf");
        std::fs::create_dir_all(dir.path().join("db"))?;
        std::fs::write(&conf, config(dir.path(), &listen, &options.zones))?;
        for zone in &options.zones {
            std::fs::write(
                dir.path().join(zone_file(&zone.origin)),
                format!("$ORIGIN {}\n{}\n", fqdn(&zone.origin), zone.body),
            )?;
        }

        let mut command = match &options.netns {
            Some(ns) => {
                // `ip netns exec` execs the program in place, so the PID is knotd's own.
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "knotd"]);
                c
            }
            None => Command::new("knotd"),
        };
        command.arg("-c").arg(&conf);
        let process = Process::spawn("knotd", command).context("spawn knotd")?;
        let mut knot = Knot {
            process,
            listen,
            socket,
            dir,
        };
        knot.wait_answering(options)
            .with_context(|| format!("knotd log:\n{}", knot.process.output()))?;
        Ok(knot)
    }

    fn wait_answering(&mut self, options: &Options) -> anyhow::Result<()> {
        let listen = self.listen.clone();
        let socket = self.socket.clone();
        let process = &mut self.process;
        wait_until(
            "knotd",
            Duration::from_secs(10),
            || match process.exited() {
                Some(status) => bail!("knotd exited during start-up: {status}"),
                None => Ok(()),
            },
            || {
                // knotd binds its control socket once its server has started. A query sent
                // before then can go unanswered (knotd 3.2 in a fresh network namespace: the
                // first query is lost), and kdig waits a second at least before it gives up.
                socket.exists()
                    && listen.iter().all(|addr| {
                        options
                            .zones
                            .iter()
                            .all(|zone| answers_soa(options.netns.as_deref(), *addr, &zone.origin))
                    })
            },
        )
    }

    /// The addresses it serves on (ports resolved).
    pub fn listen(&self) -> &[SocketAddr] {
        &self.listen
    }

    /// The first address it serves on.
    pub fn addr(&self) -> SocketAddr {
        self.listen[0]
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The directory holding its configuration and zone files.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Its log so far.
    pub fn output(&self) -> String {
        self.process.output()
    }

    /// Queries received so far over any transport (`mod-stats` request-protocol counters).
    pub fn queries(&self) -> anyhow::Result<u64> {
        Ok(self
            .stats()?
            .iter()
            .filter(|(key, _)| key.starts_with("mod-stats.request-protocol["))
            .map(|(_, n)| n)
            .sum())
    }

    /// Queries received so far over TCP.
    pub fn tcp_queries(&self) -> anyhow::Result<u64> {
        Ok(self
            .stats()?
            .iter()
            .filter(|(key, _)| {
                key == "mod-stats.request-protocol[tcp4]"
                    || key == "mod-stats.request-protocol[tcp6]"
            })
            .map(|(_, n)| n)
            .sum())
    }

    /// Queries received so far with QTYPE `rtype` (`"A"`, `"AAAA"`, `"NS"`, ...): lets a test
    /// count its own queries apart from, say, an agent's `. NS` health checks.
    pub fn queries_of_type(&self, rtype: &str) -> anyhow::Result<u64> {
        let key = format!("mod-stats.query-type[{rtype}]");
        Ok(self
            .stats()?
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, n)| n)
            .sum())
    }

    /// Every counter `knotc stats` reports, as `(name, value)`. Knot omits counters that are 0.
    pub fn stats(&self) -> anyhow::Result<Vec<(String, u64)>> {
        let output = Command::new("knotc")
            .arg("-s")
            .arg(&self.socket)
            .arg("stats")
            .output()
            .context("run knotc")?;
        if !output.status.success() {
            bail!(
                "knotc stats failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let text = String::from_utf8_lossy(&output.stdout);
        Ok(text
            .lines()
            .filter_map(|line| {
                let (key, value) = line.split_once(" = ")?;
                Some((key.trim().to_owned(), value.trim().parse().ok()?))
            })
            .collect())
    }

    /// Stops `knotd` (SIGTERM, then SIGKILL after 5 s).
    pub fn stop(mut self) {
        self.process.stop();
    }

    /// A `cluster.local.` zone shaped like what CoreDNS's kubernetes plugin serves:
    ///
    /// - SOA with TTL 30 and MINIMUM 60 (negative TTL [`NEGATIVE_TTL`] = 30); NS `ns.dns`.
    /// - `kubernetes.default.svc` A 10.96.0.1 (TTL 30; no AAAA: NODATA).
    /// - `kube-dns.kube-system.svc` A 10.96.0.10, and SRV `_dns._udp` / `_dns-tcp._tcp` for it.
    /// - `web.default.svc` A 10.96.12.34 and AAAA fd00:10:96::1234.
    /// - `headless.default.svc`: A 10.244.1.11, .12, .13 and AAAA fd00:10:244:1::11, ::12, ::13;
    ///   `pod-{0,1,2}.headless.default.svc` A each; `_http._tcp.headless.default.svc` SRV to each.
    /// - TTL probes: `ttl1.default.svc` A 10.96.1.1 TTL 1 (below the 5 s floor),
    ///   `ttl7.default.svc` A 10.96.7.7 TTL 7, `ttl300.default.svc` A 10.96.3.0 TTL 300,
    ///   `ttl86400.default.svc` A 10.96.86.4 TTL 86400 (above the 1 h cap).
    /// - `big.default.svc`: [`BIG_RECORDS`] A records 10.244.2.1 upwards (reply ≈ 1 kB).
    /// - `huge.default.svc`: one TXT record of [`HUGE_STRINGS`] strings of 200 characters (reply
    ///   over 2 kB).
    pub fn cluster_local() -> Zone {
        let mut body = String::from(
            "$TTL 30
@                                      30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 60
@                                      30 IN NS  ns.dns
ns.dns                                 30 IN A   10.96.0.10
kubernetes.default.svc                 30 IN A   10.96.0.1
kube-dns.kube-system.svc               30 IN A   10.96.0.10
_dns._udp.kube-dns.kube-system.svc     30 IN SRV 0 100 53 kube-dns.kube-system.svc
_dns-tcp._tcp.kube-dns.kube-system.svc 30 IN SRV 0 100 53 kube-dns.kube-system.svc
web.default.svc                        30 IN A    10.96.12.34
web.default.svc                        30 IN AAAA fd00:10:96::1234
headless.default.svc                   30 IN A    10.244.1.11
headless.default.svc                   30 IN A    10.244.1.12
headless.default.svc                   30 IN A    10.244.1.13
headless.default.svc                   30 IN AAAA fd00:10:244:1::11
headless.default.svc                   30 IN AAAA fd00:10:244:1::12
headless.default.svc                   30 IN AAAA fd00:10:244:1::13
pod-0.headless.default.svc             30 IN A    10.244.1.11
pod-1.headless.default.svc             30 IN A    10.244.1.12
pod-2.headless.default.svc             30 IN A    10.244.1.13
_http._tcp.headless.default.svc        30 IN SRV 0 33 80 pod-0.headless.default.svc
_http._tcp.headless.default.svc        30 IN SRV 0 33 80 pod-1.headless.default.svc
_http._tcp.headless.default.svc        30 IN SRV 0 33 80 pod-2.headless.default.svc
ttl1.default.svc                        1 IN A    10.96.1.1
ttl7.default.svc                        7 IN A    10.96.7.7
ttl300.default.svc                    300 IN A    10.96.3.0
ttl86400.default.svc                86400 IN A    10.96.86.4
",
        );
        for i in 1..=BIG_RECORDS {
            let _ = writeln!(body, "big.default.svc 30 IN A 10.244.2.{i}");
        }
        let strings: Vec<String> = (0..HUGE_STRINGS)
            .map(|i| {
                let c = char::from(b'a' + (i % 26) as u8);
                format!("\"{}\"", c.to_string().repeat(200))
            })
            .collect();
        let _ = writeln!(body, "huge.default.svc 30 IN TXT {}", strings.join(" "));
        Zone {
            origin: "cluster.local.".to_owned(),
            body,
        }
    }
}

/// Starts a Knot serving [`Knot::cluster_local`] on a free loopback port, or returns `None`
/// after printing why when `knotd` is not installed (so the calling test passes as skipped).
/// Panics if `knotd` is installed but does not start.
pub fn cluster_local_or_skip() -> Option<Knot> {
    if !crate::have("knotd") || !crate::have("knotc") {
        eprintln!("skipped: knotd/knotc not installed (Debian package `knot`)");
        return None;
    }
    let options = Options {
        zones: vec![Knot::cluster_local()],
        ..Options::default()
    };
    Some(Knot::start(options).expect("knotd starts"))
}

fn fqdn(name: &str) -> String {
    if name.ends_with('.') {
        name.to_owned()
    } else {
        format!("{name}.")
    }
}

fn zone_file(origin: &str) -> String {
    let name = fqdn(origin);
    let name = name.trim_end_matches('.');
    if name.is_empty() {
        "root.zone".to_owned()
    } else {
        format!("{name}.zone")
    }
}

fn resolve_listen(options: &Options) -> anyhow::Result<Vec<SocketAddr>> {
    if options.listen.is_empty() {
        return Ok(vec![SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?))]);
    }
    options
        .listen
        .iter()
        .map(|addr| {
            if addr.port() != 0 {
                Ok(*addr)
            } else if options.netns.is_some() {
                Ok(SocketAddr::new(addr.ip(), 53))
            } else {
                Ok(SocketAddr::new(addr.ip(), free_port()?))
            }
        })
        .collect()
}

/// Knot's address syntax: `ADDR@PORT`.
fn knot_addr(addr: &SocketAddr) -> String {
    match addr.ip() {
        IpAddr::V4(ip) => format!("{ip}@{}", addr.port()),
        IpAddr::V6(ip) => format!("{ip}@{}", addr.port()),
    }
}

fn config(dir: &std::path::Path, listen: &[SocketAddr], zones: &[Zone]) -> String {
    let d = dir.display();
    let listen: Vec<String> = listen.iter().map(knot_addr).collect();
    let mut conf = format!(
        r#"server:
    rundir: "{d}"
    pidfile: "{d}/knot.pid"
    listen: [ {listen} ]
    # CoreDNS closes an idle TCP connection after 10 s; so does Knot by default. Said here so
    # the harness does not depend on the default.
    tcp-idle-timeout: 10
    background-workers: 1

log:
  - target: stderr
    any: info

database:
    storage: "{d}/db"

control:
    listen: "{d}/knot.sock"

mod-stats:
  - id: counters
    request-protocol: on
    server-operation: on
    response-code: on
    query-type: on

# Any client may transfer a zone (AXFR, IXFR): this Knot serves tests only, and the transfer
# tests need a server that answers them.
acl:
  - id: transfer
    address: [ 0.0.0.0/0, ::/0 ]
    action: transfer

template:
  - id: default
    storage: "{d}"
    global-module: mod-stats/counters
    acl: transfer

zone:
"#,
        listen = listen.join(", ")
    );
    for zone in zones {
        let _ = writeln!(
            conf,
            "  - domain: \"{}\"\n    file: \"{}\"",
            fqdn(&zone.origin),
            zone_file(&zone.origin)
        );
    }
    conf
}

/// Whether the server at `addr` answers an SOA query for `origin` authoritatively.
fn answers_soa(netns: Option<&str>, addr: SocketAddr, origin: &str) -> bool {
    let origin = fqdn(origin);
    match netns {
        None => {
            let query = client::query(&origin, RecordType::SOA);
            client::udp_blocking(addr, &query, Duration::from_millis(200)).is_ok_and(|reply| {
                reply.metadata.response_code == ResponseCode::NoError
                    && reply.metadata.authoritative
            })
        }
        Some(ns) => client::kdig_in(Some(ns), addr, &[origin.as_str(), "SOA", "+time=1"])
            .is_ok_and(|out| out.status == "NOERROR" && out.has_flag("aa")),
    }
}
