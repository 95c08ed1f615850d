//! `/metrics` seen from outside: after a known sequence of queries the exposition holds exactly
//! the CoreDNS-named counters it should, with CoreDNS's labels, and parses as Prometheus text
//! with Python's `prometheus_client` (the parser Prometheus's own ecosystem uses); the `zone`
//! label follows the Corefile's blocks; the query log, the rate-limited error log, the runtime
//! log level, `nodedns top`, and the Grafana dashboard's queries are checked against a running
//! agent.
//!
//! Each test starts its own agent and waits for `/ready` (not for a DNS answer), so no query but
//! the test's own is ever counted.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nix::sys::signal::Signal;
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Process, TempDir, client, free_loopback, free_port, nodedns_bin};

/// A `nodedns run` with its DNS and admin addresses.
struct Running {
    process: Process,
    dns: SocketAddr,
    admin: SocketAddr,
}

/// `GET`/`PUT` `path` on `addr` over HTTP/1.0: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").context("no HTTP header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no HTTP status")?;
    Ok((status, body.to_owned()))
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    http(addr, "GET", path, "").unwrap_or_else(|e| panic!("GET {path}: {e:#}"))
}

/// Polls until `ok` holds (every 20 ms, at most `limit`).
fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `nodedns run ARGS` (the caller's flags, plus `--metrics-listen-address` on a free port
/// unless `admin` is given) and waits until `/health` answers, and `/ready` too if `ready`.
fn start(args: &[String], dns: SocketAddr, admin: Option<SocketAddr>, ready: bool) -> Running {
    let mut last = String::new();
    for _ in 0..3 {
        let admin = admin.unwrap_or_else(free_loopback);
        let mut command = Command::new(nodedns_bin());
        command.arg("run").args(args).env("RUST_BACKTRACE", "1");
        if !args.iter().any(|a| a == "--conf") {
            command
                .arg("--metrics-listen-address")
                .arg(admin.to_string());
        }
        let mut process = Process::spawn("nodedns", command).expect("spawn nodedns");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = process.exited() {
                last = format!("exited {status}:\n{}", process.output());
                break;
            }
            let path = if ready { "/ready" } else { "/health" };
            if matches!(http(admin, "GET", path, ""), Ok((200, _))) {
                return Running {
                    process,
                    dns,
                    admin,
                };
            }
            if Instant::now() > deadline {
                panic!(
                    "nodedns not serving {path} on {admin}:\n{}",
                    process.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if !last.contains("in use") {
            break;
        }
    }
    panic!("nodedns did not start: {last}");
}

/// An agent in plain command-line mode forwarding to `upstream`.
fn start_cli(upstream: SocketAddr, extra: &[&str], ready: bool) -> Running {
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let mut args = vec![
        "--listen".to_owned(),
        dns.to_string(),
        "--upstream".to_owned(),
        upstream.to_string(),
        "--threads".to_owned(),
        "2".to_owned(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    start(&args, dns, None, ready)
}

/// One parsed sample: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A Python with `prometheus_client` (Debian's `python3-prometheus-client` lives in the system
/// interpreter, which a pyenv shim on PATH may hide).
fn python() -> String {
    for candidate in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(candidate)
            .args(["-c", "import prometheus_client"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return candidate.to_owned();
        }
    }
    panic!("no Python with prometheus_client: apt-get install python3-prometheus-client");
}

/// Parses `text` with `prometheus_client.parser.text_string_to_metric_families` (which raises
/// on anything that is not valid text format) and returns every sample, with each family's type.
fn parse_with_python(text: &str) -> (Vec<Sample>, BTreeMap<String, String>) {
    const SCRIPT: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(sys.stdin.read()):
    print("F\t%s\t%s" % (family.name, family.type))
    for s in family.samples:
        labels = "\x1e".join("%s=%s" % kv for kv in sorted(s.labels.items()))
        print("S\t%s\t%s\t%r" % (s.name, labels, s.value))
"#;
    let mut child = Command::new(python())
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client rejected the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut samples = Vec::new();
    let mut types = BTreeMap::new();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["F", name, kind] => {
                types.insert(name.to_string(), kind.to_string());
            }
            ["S", name, labels, value] => samples.push(Sample {
                name: name.to_string(),
                labels: labels
                    .split('\x1e')
                    .filter(|l| !l.is_empty())
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
                value: value.parse().unwrap(),
            }),
            _ => panic!("unexpected parser output {line:?}"),
        }
    }
    (samples, types)
}

fn scrape(admin: SocketAddr) -> (Vec<Sample>, BTreeMap<String, String>, String) {
    let (status, text) = get(admin, "/metrics");
    assert_eq!(status, 200);
    let (samples, types) = parse_with_python(&text);
    (samples, types, text)
}

/// The samples named `name`, as (labels without `ignore`, value), sorted.
fn series(samples: &[Sample], name: &str, ignore: &[&str]) -> Vec<(Vec<(String, String)>, f64)> {
    let mut out: Vec<_> = samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| {
            let labels: Vec<(String, String)> = s
                .labels
                .iter()
                .filter(|(k, _)| !ignore.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (labels, s.value)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut l: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    l.sort();
    l
}

/// The value of the one sample `name` with exactly `pairs` among its labels (others ignored).
fn value(samples: &[Sample], name: &str, pairs: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            pairs
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .collect();
    assert!(
        found.len() <= 1,
        "{name} {pairs:?}: several samples {found:?}"
    );
    found.first().copied()
}

fn encode(message: &Message) -> Vec<u8> {
    message.to_vec().unwrap()
}

/// One UDP exchange: (query bytes, reply bytes).
async fn udp(server: SocketAddr, name: &str, rtype: RecordType) -> (usize, Vec<u8>) {
    let query = client::query(name, rtype);
    let reply = client::udp_bytes(server, &query).await.expect("UDP answer");
    (encode(&query).len(), reply)
}

/// One TCP exchange on a new connection: (query bytes, reply bytes).
async fn tcp(server: SocketAddr, name: &str, rtype: RecordType) -> (usize, Vec<u8>) {
    let query = encode(&client::query(name, rtype));
    let mut stream = tokio::net::TcpStream::connect(server).await.unwrap();
    client::write_frame(&mut stream, &query).await.unwrap();
    let reply = tokio::time::timeout(client::TIMEOUT, client::read_frame(&mut stream))
        .await
        .expect("TCP answer in time")
        .unwrap();
    (query.len(), reply)
}

fn rcode(reply: &[u8]) -> ResponseCode {
    client::decode(reply).unwrap().metadata.response_code
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_sequence_of_queries_gives_exact_coredns_counters() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = start_cli(knot.addr(), &[], true);
    let dns = agent.dns;

    // UDP: a miss then two hits (A); a NXDOMAIN miss then a hit (AAAA); a type CoreDNS folds
    // into "other" (NAPTR, NODATA, a miss). TCP: one hit.
    let mut sizes = BTreeMap::<&str, (usize, usize)>::new();
    let mut add = |proto, (q, r): (usize, Vec<u8>), want: ResponseCode| {
        assert_eq!(rcode(&r), want);
        let e = sizes.entry(proto).or_default();
        e.0 += q;
        e.1 += r.len();
    };
    let name = "ttl300.default.svc.cluster.local.";
    for _ in 0..3 {
        add(
            "udp",
            udp(dns, name, RecordType::A).await,
            ResponseCode::NoError,
        );
    }
    let missing = "missing.default.svc.cluster.local.";
    for _ in 0..2 {
        add(
            "udp",
            udp(dns, missing, RecordType::AAAA).await,
            ResponseCode::NXDomain,
        );
    }
    let web = "web.default.svc.cluster.local.";
    add(
        "udp",
        udp(dns, web, RecordType::NAPTR).await,
        ResponseCode::NoError,
    );
    add(
        "tcp",
        tcp(dns, name, RecordType::A).await,
        ResponseCode::NoError,
    );

    let (samples, types, text) = scrape(agent.admin);
    let server = format!("dns://{dns}");
    let base = [
        ("server", server.as_str()),
        ("zone", "."),
        ("view", ""),
        ("family", "1"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut all: Vec<(&str, &str)> = base.to_vec();
        all.extend_from_slice(extra);
        labels(&all)
    };
    assert_eq!(
        series(&samples, "coredns_dns_requests_total", &[]),
        [
            (with(&[("proto", "tcp"), ("type", "A")]), 1.0),
            (with(&[("proto", "udp"), ("type", "A")]), 3.0),
            (with(&[("proto", "udp"), ("type", "AAAA")]), 2.0),
            (with(&[("proto", "udp"), ("type", "other")]), 1.0),
        ],
        "{text}"
    );
    let base = [("server", server.as_str()), ("zone", "."), ("view", "")];
    let plain = |extra: &[(&'static str, &'static str)]| {
        let mut all: Vec<(&str, &str)> = base.to_vec();
        all.extend_from_slice(extra);
        labels(&all)
    };
    // CoreDNS 1.11 labels every answer of a block with `cache` as the cache plugin's.
    assert_eq!(
        series(&samples, "coredns_dns_responses_total", &[]),
        [
            (plain(&[("plugin", "cache"), ("rcode", "NOERROR")]), 5.0),
            (plain(&[("plugin", "cache"), ("rcode", "NXDOMAIN")]), 2.0),
        ]
    );
    let cache = [("server", server.as_str()), ("zones", "."), ("view", "")];
    let cache_labels = |extra: &[(&'static str, &'static str)]| {
        let mut all: Vec<(&str, &str)> = cache.to_vec();
        all.extend_from_slice(extra);
        labels(&all)
    };
    assert_eq!(
        series(&samples, "coredns_cache_hits_total", &[]),
        [
            (cache_labels(&[("type", "denial")]), 1.0),
            (cache_labels(&[("type", "success")]), 3.0),
        ]
    );
    for (name, want) in [
        ("coredns_cache_requests_total", 7.0),
        ("coredns_cache_misses_total", 3.0),
    ] {
        assert_eq!(
            series(&samples, name, &[]),
            [(cache_labels(&[]), want)],
            "{name}"
        );
    }
    assert!(series(&samples, "coredns_cache_served_stale_total", &[]).is_empty());
    assert!(series(&samples, "coredns_dns_do_requests_total", &[]).is_empty());
    // Entries: the A, the NXDOMAIN and the NODATA answers.
    assert_eq!(
        series(&samples, "coredns_cache_entries", &[]),
        [
            (cache_labels(&[("type", "denial")]), 2.0),
            (cache_labels(&[("type", "success")]), 1.0),
        ]
    );

    // Histograms: one observation per answer; the size sums are the bytes on the wire.
    let dur = &[("server", server.as_str()), ("zone", ".")];
    assert_eq!(
        value(&samples, "coredns_dns_request_duration_seconds_count", dur),
        Some(7.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_dns_request_duration_seconds_bucket",
            &[("server", server.as_str()), ("le", "+Inf")]
        ),
        Some(7.0)
    );
    for (proto, (q, r)) in &sizes {
        let l = &[("server", server.as_str()), ("proto", *proto)];
        let n = if *proto == "udp" { 6.0 } else { 1.0 };
        assert_eq!(
            value(&samples, "coredns_dns_request_size_bytes_count", l),
            Some(n)
        );
        assert_eq!(
            value(&samples, "coredns_dns_request_size_bytes_sum", l),
            Some(*q as f64)
        );
        assert_eq!(
            value(&samples, "coredns_dns_response_size_bytes_sum", l),
            Some(*r as f64)
        );
    }

    // The upstream saw exactly the three misses.
    let to = knot.addr().to_string();
    assert_eq!(
        value(&samples, "coredns_forward_requests_total", &[("to", &to)]),
        Some(3.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_proxy_request_duration_seconds_count",
            &[("to", &to), ("rcode", "NOERROR")]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_proxy_request_duration_seconds_count",
            &[("to", &to), ("rcode", "NXDOMAIN")]
        ),
        Some(1.0)
    );

    // CoreDNS's types and node-cache's metric, parsed as such.
    for (family, kind) in [
        ("coredns_dns_requests", "counter"),
        ("coredns_dns_request_duration_seconds", "histogram"),
        ("coredns_cache_entries", "gauge"),
        ("coredns_build_info", "gauge"),
        ("coredns_reload_failed", "counter"),
        ("coredns_nodecache_setup_errors", "counter"),
        ("nodedns_upstream_connections", "gauge"),
    ] {
        assert_eq!(
            types.get(family).map(String::as_str),
            Some(kind),
            "{family}"
        );
    }
    assert_eq!(
        value(&samples, "coredns_reload_failed_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_nodecache_setup_errors_total",
            &[("errortype", "iptables")]
        ),
        Some(0.0)
    );
    assert!(text.contains(
        "# HELP coredns_dns_requests_total Counter of DNS requests made per zone, protocol and family.\n"
    ));
    let doubled: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("# HELP") && l.ends_with(".."))
        .collect();
    assert!(
        doubled.is_empty(),
        "HELP texts end with one period: {doubled:?}"
    );
}

/// A zone for reverse lookups beside cluster.local, so two zones of one block get answers.
fn reverse_zone() -> knot::Zone {
    knot::Zone {
        origin: "in-addr.arpa.".to_owned(),
        body: "$TTL 30
@         30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 60
@         30 IN NS  ns.dns.cluster.local.
1.0.96.10 30 IN PTR kubernetes.default.svc.cluster.local.
"
        .to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_labels_follow_the_corefile_and_the_log_directive_logs_queries() {
    let _turn = crate::shared();
    if !nodedns_integration::have("knotd") {
        eprintln!("skipped: knotd not installed");
        return;
    }
    let knot = Knot::start(knot::Options {
        zones: vec![Knot::cluster_local(), reverse_zone()],
        ..knot::Options::default()
    })
    .expect("knotd starts");
    let port = free_port().unwrap();
    let admin = free_loopback();
    let dir = TempDir::new("nodedns-metrics").unwrap();
    let corefile = dir.path().join("Corefile");
    let upstream = knot.addr();
    std::fs::write(
        &corefile,
        format!(
            "cluster.local:{port} in-addr.arpa:{port} {{
    bind 127.0.0.1
    log
    cache 30
    forward . {upstream} {{
        force_tcp
    }}
    prometheus {admin}
}}
.:{port} {{
    bind 127.0.0.1
    errors
    cache 30
    forward . {upstream}
    prometheus {admin}
}}
"
        ),
    )
    .unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.0.1\n").unwrap();
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let args: Vec<String> = [
        "--conf",
        corefile.to_str().unwrap(),
        "--resolv-conf",
        resolv.to_str().unwrap(),
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = start(&args, dns, Some(admin), true);

    let (_, r) = udp(dns, "web.default.svc.cluster.local.", RecordType::A).await;
    assert_eq!(rcode(&r), ResponseCode::NoError);
    let (_, r) = udp(dns, "1.0.96.10.in-addr.arpa.", RecordType::PTR).await;
    assert_eq!(rcode(&r), ResponseCode::NoError);
    let (_, r) = udp(dns, "1.0.96.10.in-addr.arpa.", RecordType::PTR).await;
    assert_eq!(rcode(&r), ResponseCode::NoError);
    // Outside Knot's zones: it refuses, and so does nodedns (a reply, not cached).
    let (_, r) = udp(dns, "example.com.", RecordType::A).await;
    assert_eq!(rcode(&r), ResponseCode::Refused);

    let (samples, _, text) = scrape(admin);
    let server = format!("dns://{dns}");
    let requests: BTreeMap<String, f64> = series(&samples, "coredns_dns_requests_total", &[])
        .into_iter()
        .map(|(l, v)| {
            let zone = l.iter().find(|(k, _)| k == "zone").unwrap().1.clone();
            (zone, v)
        })
        .collect();
    assert_eq!(
        requests,
        BTreeMap::from([
            (".".to_owned(), 1.0),
            ("cluster.local.".to_owned(), 1.0),
            ("in-addr.arpa.".to_owned(), 2.0),
        ]),
        "{text}"
    );
    let zones = "cluster.local.,in-addr.arpa.";
    assert_eq!(
        value(
            &samples,
            "coredns_cache_hits_total",
            &[
                ("server", server.as_str()),
                ("zones", zones),
                ("type", "success")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_cache_misses_total",
            &[("server", server.as_str()), ("zones", zones)]
        ),
        Some(2.0)
    );
    assert_eq!(
        value(
            &samples,
            "coredns_dns_responses_total",
            &[("zone", "."), ("rcode", "REFUSED"), ("plugin", "cache")]
        ),
        Some(1.0)
    );

    // `log` is on in the first block only: its three queries are logged, the `.` one is not.
    let output = agent.process.output();
    let logged: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("nodedns::query"))
        .collect();
    assert_eq!(logged.len(), 3, "{output}");
    // Who asked, on the hit path and the miss path alike: the test's own sockets on loopback.
    assert!(
        logged
            .iter()
            .all(|l| l.contains("remote=127.0.0.1:") && !l.contains("remote=127.0.0.1:0 ")),
        "{output}"
    );
    assert!(
        logged
            .iter()
            .any(|l| l.contains("qname=web.default.svc.cluster.local.")
                && l.contains("qtype=A")
                && l.contains("rcode=\"NOERROR\"")
                && l.contains("answered_by=\"upstream\""))
    );
    assert!(
        logged
            .iter()
            .any(|l| l.contains("1.0.96.10.in-addr.arpa.") && l.contains("answered_by=\"cache\""))
    );
    assert!(!output.contains("qname=example.com."), "{output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_upstream_is_logged_once_per_interval_not_once_per_query() {
    let _turn = crate::shared();
    // Nothing listens on this port: every exchange is refused.
    let dead = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let agent = start_cli(dead, &[], false);
    assert_eq!(
        get(agent.admin, "/ready").0,
        503,
        "no upstream answered yet"
    );
    for i in 0..20 {
        let (_, r) = udp(agent.dns, &format!("n{i}.example.org."), RecordType::A).await;
        assert_eq!(rcode(&r), ResponseCode::ServFail);
    }
    let (samples, _, _) = scrape(agent.admin);
    let failures: f64 = series(&samples, "nodedns_upstream_failures_total", &[])
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(failures, 20.0);
    assert_eq!(
        value(
            &samples,
            "coredns_dns_responses_total",
            &[("rcode", "SERVFAIL"), ("plugin", "")]
        ),
        Some(20.0),
        "SERVFAIL written by the server itself has no plugin"
    );
    let output = agent.process.output();
    let lines = output
        .lines()
        .filter(|l| l.contains("upstream query failed"))
        .count();
    assert_eq!(
        lines, 1,
        "20 failures in well under 10 s log one line:\n{output}"
    );
}

#[test]
fn the_log_level_changes_at_runtime_over_http_and_by_signal() {
    let _turn = crate::shared();
    let dead = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let mut agent = start_cli(dead, &["--log-level", "warn"], false);
    let admin = agent.admin;
    assert_eq!(get(admin, "/log-level"), (200, "warn\n".to_owned()));
    let (status, body) = http(admin, "PUT", "/log-level", "info,nodedns::query=off").unwrap();
    assert_eq!((status, body.as_str()), (200, "info,nodedns::query=off\n"));
    let (status, body) = http(admin, "PUT", "/log-level", "nodedns=loud").unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("nodedns=loud"), "{body}");
    assert_eq!(get(admin, "/log-level").1, "info,nodedns::query=off\n");

    agent.process.signal(Signal::SIGUSR1).unwrap();
    wait_for("SIGUSR1 sets debug", Duration::from_secs(5), || {
        get(admin, "/log-level").1 == "debug\n"
    });
    agent.process.signal(Signal::SIGUSR2).unwrap();
    wait_for(
        "SIGUSR2 restores the start-up filter",
        Duration::from_secs(5),
        || get(admin, "/log-level").1 == "warn\n",
    );
    assert_eq!(get(admin, "/metrics").0, 200);
    assert_eq!(http(admin, "DELETE", "/metrics", "").unwrap().0, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodedns_top_shows_the_traffic_of_a_running_agent() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = start_cli(knot.addr(), &[], true);
    let dns = agent.dns;
    // Traffic during top's interval: every name once (misses) then again (hits), and NXDOMAINs.
    let traffic = tokio::spawn(async move {
        for _ in 0..4 {
            for name in ["web", "headless", "kubernetes", "nope1", "nope2"] {
                let fqdn = format!("{name}.default.svc.cluster.local.");
                udp(dns, &fqdn, RecordType::A).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let out = Command::new(nodedns_bin())
        .args([
            "top",
            "--metrics",
            &agent.admin.to_string(),
            "--interval",
            "2s",
            "--once",
        ])
        .output()
        .expect("run nodedns top");
    traffic.await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let qps: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("queries"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.trim_end_matches("/s").parse().ok())
        .unwrap_or_else(|| panic!("no queries line:\n{text}"));
    assert!(qps > 0.0, "{text}");
    for part in [
        "hit ratio",
        "NXDOMAIN",
        "types       A 100.0%",
        &knot.addr().to_string(),
    ] {
        assert!(text.contains(part), "{part:?} missing:\n{text}");
    }
    assert!(!text.contains('\x1b'), "--once does not clear the screen");
}

/// The JSON string `text` starts with (escapes kept as written; only `\"` matters here).
fn json_string(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.strip_prefix('"').unwrap_or_default().chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

/// Every metric the Grafana dashboard queries is one nodedns exports (by its `# TYPE` line,
/// after a miss and a hit so the upstream's families have series).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_exported_metrics() -> anyhow::Result<()> {
    let _turn = crate::shared();
    /// Registered by the hostnet crate, written once a reconcile pass ran (needs host setup).
    const ONLY_WITH_HOST_SETUP: &[&str] = &["nodedns_hostnet_reconcile_total"];
    let Some(knot) = knot::cluster_local_or_skip() else {
        return Ok(());
    };
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../manifests/dashboards/nodedns.json"
    );
    let dashboard = std::fs::read_to_string(path).with_context(|| path.to_owned())?;
    let agent = start_cli(knot.addr(), &[], true);
    for _ in 0..2 {
        udp(agent.dns, "web.default.svc.cluster.local.", RecordType::A).await;
    }
    let (_, text) = get(agent.admin, "/metrics");
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut used = Vec::new();
    for after in dashboard.split("\"expr\"").skip(1) {
        let expr = json_string(after.trim_start().trim_start_matches(':').trim_start());
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("coredns_") || word.starts_with("nodedns_") {
                used.push(word.to_owned());
            }
        }
    }
    if used.len() < 10 {
        bail!(
            "only {} metrics found in the dashboard's expressions",
            used.len()
        );
    }
    for name in &used {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            exported.contains(&name.as_str())
                || exported.contains(&family)
                || ONLY_WITH_HOST_SETUP.contains(&name.as_str()),
            "the dashboard queries {name}, which nodedns does not export:\n{text}"
        );
    }
    Ok(())
}
