//! `tls://` and `https://` server blocks, served to real clients: DNS over TLS to `kdig +tls`,
//! DNS over HTTPS to `kdig +https` (HTTP/2, POST and GET) and `curl` (HTTP/1.1 and HTTP/2), each
//! with a certificate made at test time, and the cleartext forms CoreDNS serves without a `tls`
//! directive (plain DNS over TCP, HTTP/1.1). Answers come from a real Knot through the block's
//! cache and `forward`, and count under the block's `server` label.
//!
//! Bounds: connections to these listeners count against the TCP caps, and one that sends
//! nothing (no handshake, no request head) is closed after the idle timeout.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use hickory_proto::op::Message;
use hickory_proto::rr::RecordType;
use nodedns_integration::dot::{Pki, ServerFiles};
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Process, TempDir, client, free_port, have, http_get, nodedns_bin};

/// The name the agent's certificate is for.
const NAME: &str = "dns.nodedns.test";
const KUBERNETES: &str = "kubernetes.default.svc.cluster.local.";

/// An agent serving `.` on every transport, forwarding to a Knot.
struct Agent {
    process: Process,
    /// `dns://` (UDP and TCP).
    dns: SocketAddr,
    /// `tls://` with `tls`.
    dot: SocketAddr,
    /// `tls://` without `tls`: plain DNS over TCP.
    tcp: SocketAddr,
    /// `https://` with `tls`.
    doh: SocketAddr,
    /// `https://` without `tls`: cleartext HTTP/1.1.
    http: SocketAddr,
    metrics: SocketAddr,
    pki: Pki,
    /// The certificate the `tls` directives name.
    cert: ServerFiles,
    _dir: TempDir,
}

/// `N` loopback addresses on distinct free ports.
fn loopbacks<const N: usize>() -> [SocketAddr; N] {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < N {
        let port = free_port().unwrap();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    std::array::from_fn(|i| SocketAddr::from((Ipv4Addr::LOCALHOST, ports[i])))
}

impl Agent {
    fn start(upstream: SocketAddr, args: &[&str]) -> Agent {
        let pki = Pki::new("nodedns serving CA").unwrap();
        let files = pki.server("agent", &[NAME, "127.0.0.1"], false).unwrap();
        let [dns, dot, tcp, doh, http, metrics] = loopbacks();
        let (cert, key) = (files.cert.display(), files.key.display());
        let block = |key_text: String, extra: &str| {
            format!(
                "{key_text} {{\n    bind 127.0.0.1\n{extra}    cache 30\n    forward . {upstream}\n}}\n"
            )
        };
        let tls = format!("    tls {cert} {key}\n");
        let corefile = [
            block(
                format!(".:{}", dns.port()),
                &format!("    prometheus {metrics}\n"),
            ),
            block(format!("tls://.:{}", dot.port()), &tls),
            block(format!("tls://.:{}", tcp.port()), ""),
            block(format!("https://.:{}", doh.port()), &tls),
            block(format!("https://.:{}", http.port()), ""),
        ]
        .concat();
        let dir = TempDir::new("nodedns-serve-tls").unwrap();
        std::fs::write(dir.path().join("Corefile"), &corefile).unwrap();
        std::fs::write(dir.path().join("resolv.conf"), "nameserver 192.0.2.53\n").unwrap();
        let mut process = spawn(&dir, "nodedns", args);
        process
            .wait_output("serving DNS (UDP, TCP)", Duration::from_secs(15))
            .unwrap();
        Agent {
            process,
            dns,
            dot,
            tcp,
            doh,
            http,
            metrics,
            pki,
            cert: files,
            _dir: dir,
        }
    }

    /// `kdig` against `server` with `args`, trusting the agent's CA for TLS.
    fn kdig(&self, server: SocketAddr, args: &[&str]) -> anyhow::Result<client::DigOutput> {
        kdig_trusting(&self.pki, server, args)
    }

    /// The sum of the series whose name and labels start with `prefix`.
    fn metric(&self, prefix: &str) -> f64 {
        let (status, text) = http_get(self.metrics, "/metrics").unwrap();
        assert_eq!(status, 200);
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn requests(&self, server: &str) -> f64 {
        self.metric(&format!(
            r#"coredns_dns_requests_total{{server="{server}",zone=".",view="",proto="tcp""#
        ))
    }
}

/// `nodedns run` on the Corefile in `dir`, with `args`.
fn spawn(dir: &TempDir, name: &str, args: &[&str]) -> Process {
    let mut command = Command::new(nodedns_bin());
    command
        .arg("run")
        .arg("--conf")
        .arg(dir.path().join("Corefile"))
        .arg("--resolv-conf")
        .arg(dir.path().join("resolv.conf"))
        .arg("--no-setup")
        .args(args)
        .env_remove("NODEDNS_HANDOFF_DIR");
    Process::spawn(name, command).unwrap()
}

/// `kdig` against `server` with `args`, trusting `pki`'s CA for TLS.
fn kdig_trusting(
    pki: &Pki,
    server: SocketAddr,
    args: &[&str],
) -> anyhow::Result<client::DigOutput> {
    let ca = format!("+tls-ca={}", pki.ca_file().display());
    let hostname = format!("+tls-hostname={NAME}");
    let mut all = vec![ca.as_str(), hostname.as_str()];
    all.extend(args);
    client::kdig(server, &all)
}

fn knot_or_skip() -> Option<Knot> {
    for program in ["kdig", "curl"] {
        if !have(program) {
            eprintln!("skipped: {program} not installed (Debian packages `knot-dnsutils`, `curl`)");
            return None;
        }
    }
    knot::cluster_local_or_skip()
}

fn kubernetes_a(reply: &client::DigOutput) -> Vec<String> {
    reply
        .answers
        .iter()
        .filter(|r| r.rtype == "A")
        .map(|r| r.data.clone())
        .collect()
}

#[test]
fn dns_over_tls_is_served_with_the_blocks_certificate_through_its_cache() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let agent = Agent::start(knot.addr(), &[]);
    let session = |reply: &client::DigOutput| reply.raw.contains(";; TLS session");

    let first = agent.kdig(agent.dot, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(first.status, "NOERROR", "{}", first.raw);
    assert!(
        session(&first),
        "kdig verified the certificate: {}",
        first.raw
    );
    assert_eq!(kubernetes_a(&first), ["10.96.0.1"]);
    let at_knot = knot.queries().unwrap();
    let again = agent.kdig(agent.dot, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&again), ["10.96.0.1"]);
    assert_eq!(
        knot.queries().unwrap(),
        at_knot,
        "the second came from the cache"
    );
    let label = format!("tls://{}", agent.dot);
    assert_eq!(
        agent.requests(&label),
        2.0,
        "counted under the block's server"
    );
    assert!(agent.metric(&format!(r#"coredns_cache_hits_total{{server="{label}""#)) >= 1.0);

    // Plain DNS over TCP to the TLS port gets nothing: the first bytes are not a handshake.
    assert!(
        client::kdig(agent.dot, &["+tcp", KUBERNETES, "A"]).is_err(),
        "a plain TCP query to a DNS-over-TLS port is not answered"
    );
}

#[test]
fn a_reload_serves_a_rotated_certificate_to_new_connections() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let mut agent = Agent::start(knot.addr(), &[]);
    let reply = agent.kdig(agent.dot, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&reply), ["10.96.0.1"]);
    // A certificate from another CA, written over the files the `tls` directives name.
    let rotated = Pki::new("nodedns rotated CA").unwrap();
    let files = rotated
        .server("agent", &[NAME, "127.0.0.1"], false)
        .unwrap();
    std::fs::copy(&files.key, &agent.cert.key).unwrap();
    std::fs::copy(&files.cert, &agent.cert.cert).unwrap();
    agent
        .process
        .signal(nix::sys::signal::Signal::SIGHUP)
        .unwrap();
    agent
        .process
        .wait_output("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    for (addr, args) in [(agent.dot, &[][..]), (agent.doh, &["+https"][..])] {
        let mut all = args.to_vec();
        all.extend([KUBERNETES, "A"]);
        let reply = kdig_trusting(&rotated, addr, &all).unwrap();
        assert_eq!(kubernetes_a(&reply), ["10.96.0.1"], "{addr}: {}", reply.raw);
        assert!(
            agent.kdig(addr, &all).is_err(),
            "{addr}: the old CA no longer verifies what is served"
        );
    }
}

#[test]
fn an_upgrade_hands_the_tls_and_https_listeners_to_the_new_instance() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let handoff = TempDir::new("nodedns-serve-tls-handoff").unwrap();
    let handoff_dir = handoff.path().display().to_string();
    let args = ["--handoff-dir", handoff_dir.as_str(), "--threads", "1"];
    let mut old = Agent::start(knot.addr(), &args);
    let mut new = spawn(&old._dir, "nodedns-new", &args);
    new.wait_output("took the listening sockets over", Duration::from_secs(15))
        .unwrap();
    old.process
        .wait_output("handed the listening sockets over", Duration::from_secs(5))
        .unwrap();
    // Every socket came from the old instance: one UDP and one TCP for dns://, one listener
    // each for the others, the metrics and node-cache's metrics listeners.
    let took = new
        .output()
        .lines()
        .find(|l| l.contains("took the listening sockets over"))
        .unwrap()
        .to_owned();
    assert!(
        took.contains("inherited=8") && took.contains("bound=0"),
        "{took}"
    );
    // The old instance is gone; the new one answers on every transport.
    old.process.stop();
    let dot = old.kdig(old.dot, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&dot), ["10.96.0.1"], "{}", dot.raw);
    let doh = old.kdig(old.doh, &["+https", KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&doh), ["10.96.0.1"], "{}", doh.raw);
    let tcp = client::kdig(old.tcp, &["+tcp", KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&tcp), ["10.96.0.1"], "{}", tcp.raw);
    let (status, _) = http_get(old.http, "/dns-query").unwrap();
    assert_eq!(
        status, 400,
        "the cleartext DoH listener, served by the new instance"
    );
    assert!(new.exited().is_none(), "{}", new.output());
}

#[test]
fn a_tls_block_without_tls_serves_plain_dns_over_tcp_only() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let agent = Agent::start(knot.addr(), &[]);
    let reply = client::kdig(agent.tcp, &["+tcp", KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&reply), ["10.96.0.1"], "{}", reply.raw);
    assert_eq!(agent.requests(&format!("tls://{}", agent.tcp)), 1.0);
    // No UDP socket: CoreDNS serves a tls:// block over TCP only. And a TLS handshake gets no
    // reply: its first bytes announce a frame longer than any query.
    assert!(
        client::kdig(agent.tcp, &[KUBERNETES, "A"]).is_err(),
        "no UDP"
    );
    assert!(
        agent.kdig(agent.tcp, &["+tls", KUBERNETES, "A"]).is_err(),
        "no TLS"
    );
    // The dns:// block beside it serves UDP as always.
    let udp = client::kdig(agent.dns, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&udp), ["10.96.0.1"]);
}

#[test]
fn dns_over_https_answers_kdig_over_http2_post_and_get() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let agent = Agent::start(knot.addr(), &[]);
    for (method, arg) in [("HTTP/2-POST", "+https"), ("HTTP/2-GET", "+https-get")] {
        let reply = agent.kdig(agent.doh, &[arg, KUBERNETES, "A"]).unwrap();
        assert!(
            reply.raw.contains(&format!("({method})")) && reply.raw.contains("(status: 200)"),
            "{}",
            reply.raw
        );
        assert_eq!(kubernetes_a(&reply), ["10.96.0.1"], "{}", reply.raw);
    }
    assert_eq!(agent.requests(&format!("https://{}", agent.doh)), 2.0);
}

/// What `curl` got: its HTTP version, the status, the headers (lowercase names) and the body.
struct Fetched {
    version: String,
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Fetched {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `curl` with `args` (after the common ones) on `url`, the body written into `dir`.
fn curl(agent: &Agent, dir: &Path, url: &str, args: &[&str]) -> Fetched {
    let body = dir.join("body");
    let headers = dir.join("headers");
    let _ = std::fs::remove_file(&body);
    let output = Command::new("curl")
        .args(["-s", "--max-time", "6", "--cacert"])
        .arg(agent.pki.ca_file())
        .arg("--resolve")
        .arg(format!("{NAME}:{}:127.0.0.1", agent.doh.port()))
        .arg("-o")
        .arg(&body)
        .arg("-D")
        .arg(&headers)
        .args(["-w", "%{http_version} %{http_code}"])
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    let written = String::from_utf8_lossy(&output.stdout).into_owned();
    let (version, status) = written.split_once(' ').unwrap_or(("", ""));
    let headers = std::fs::read_to_string(&headers)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Fetched {
        version: version.to_owned(),
        status: status.parse().unwrap_or(0),
        headers,
        body: std::fs::read(&body).unwrap_or_default(),
    }
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

fn wire_query(name: &str) -> Vec<u8> {
    let mut query = client::query(name, RecordType::A);
    query.metadata.id = 0;
    query.to_vec().unwrap()
}

#[test]
fn dns_over_https_answers_curl_over_http11_and_http2_with_max_age() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let agent = Agent::start(knot.addr(), &[]);
    let dir = TempDir::new("nodedns-doh-curl").unwrap();
    let query = wire_query("ttl7.default.svc.cluster.local.");
    std::fs::write(dir.path().join("query"), &query).unwrap();
    let get = format!(
        "https://{NAME}:{}/dns-query?dns={}",
        agent.doh.port(),
        base64url(&query)
    );
    let post = format!("https://{NAME}:{}/dns-query", agent.doh.port());
    let data = format!("@{}", dir.path().join("query").display());
    let post_args = [
        "-H",
        "content-type: application/dns-message",
        "--data-binary",
        &data,
    ];
    for (version, url, extra) in [
        ("1.1", &get, &[][..]),
        ("2", &get, &[][..]),
        ("1.1", &post, &post_args[..]),
        ("2", &post, &post_args[..]),
    ] {
        let mut args = vec![if version == "2" {
            "--http2"
        } else {
            "--http1.1"
        }];
        args.extend(extra);
        let got = curl(&agent, dir.path(), url, &args);
        assert_eq!((got.version.as_str(), got.status), (version, 200), "{url}");
        assert_eq!(got.header("content-type"), Some("application/dns-message"));
        let reply = Message::from_vec(&got.body).unwrap();
        assert_eq!(client::a_addrs(&reply), [Ipv4Addr::new(10, 96, 7, 7)]);
        let ttl = client::answer_ttls(&reply)[0];
        assert_eq!(
            got.header("cache-control"),
            Some(format!("max-age={ttl}").as_str()),
            "max-age is the answer's TTL"
        );
        assert!(ttl <= 7);
    }
    // The cleartext form: HTTP/1.1 without TLS, the same answer.
    let plain = format!(
        "http://127.0.0.1:{}/dns-query?dns={}",
        agent.http.port(),
        base64url(&query)
    );
    let got = curl(&agent, dir.path(), &plain, &[]);
    assert_eq!(got.status, 200);
    let reply = Message::from_vec(&got.body).unwrap();
    assert_eq!(client::a_addrs(&reply), [Ipv4Addr::new(10, 96, 7, 7)]);
    assert_eq!(agent.requests(&format!("https://{}", agent.http)), 1.0);
}

#[test]
fn dns_over_https_refuses_what_is_not_a_dns_query() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let mut agent = Agent::start(knot.addr(), &[]);
    let dir = TempDir::new("nodedns-doh-refused").unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![0u8; 70_000]).unwrap();
    let big = format!("@{}", big.display());
    let base = format!("http://127.0.0.1:{}", agent.http.port());
    let message = "content-type: application/dns-message";
    for (status, path, args) in [
        (400, "/dns-query", &[][..]),
        (400, "/dns-query?dns=not*base64", &[][..]),
        (404, "/resolve", &[][..]),
        (405, "/dns-query", &["-X", "PUT"][..]),
        (
            415,
            "/dns-query",
            &["-H", "content-type: text/plain", "--data-binary", "x"][..],
        ),
        (
            413,
            "/dns-query",
            &["-H", message, "--data-binary", &big][..],
        ),
        (
            413,
            "/dns-query",
            &[
                "-H",
                message,
                "-H",
                "transfer-encoding: chunked",
                "--data-binary",
                &big,
            ][..],
        ),
        // A message too short for a DNS header.
        (400, "/dns-query?dns=AAAB", &[][..]),
    ] {
        let got = curl(&agent, dir.path(), &format!("{base}{path}"), args);
        assert_eq!(got.status, status, "{path} {args:?}");
    }
    assert!(agent.process.exited().is_none());
}

/// Reads until the server closes the connection; the time it took, or `None` if still open
/// after `limit`.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(started.elapsed());
            }
            Err(_) => return None,
        }
    }
}

#[test]
fn tls_and_https_connections_count_against_the_tcp_caps_and_idle_out() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let agent = Agent::start(
        knot.addr(),
        &[
            "--tcp-max-connections",
            "3",
            "--tcp-max-connections-per-client",
            "0",
            "--tcp-idle-timeout",
            "2s",
        ],
    );
    // Three silent clients: no handshake, no request head. They hold every place.
    let mut held: Vec<TcpStream> = [agent.dot, agent.doh, agent.http]
        .iter()
        .map(|addr| TcpStream::connect(addr).unwrap())
        .collect();
    // Every listener shares the cap: a fourth connection, to any of them, is closed at once.
    let refused_before = agent.metric("nodedns_tcp_refused_connections_total");
    for addr in [agent.dns, agent.http] {
        let mut extra = TcpStream::connect(addr).unwrap();
        let _ = extra.write_all(b"GET /dns-query HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            closed_within(&mut extra, Duration::from_secs(1)).is_some(),
            "{addr}: a connection beyond the cap is closed"
        );
    }
    assert!(agent.metric("nodedns_tcp_refused_connections_total") >= refused_before + 2.0);
    // The idle timeout closes each silent one, however it arrived.
    for (stream, what) in held.iter_mut().zip(["DoT", "DoH", "HTTP"]) {
        let took = closed_within(stream, Duration::from_secs(6));
        assert!(took.is_some(), "{what}: a silent client is closed");
    }
    drop(held);
    // Places given back: queries go through again.
    let reply = agent.kdig(agent.dot, &[KUBERNETES, "A"]).unwrap();
    assert_eq!(kubernetes_a(&reply), ["10.96.0.1"], "{}", reply.raw);
}
