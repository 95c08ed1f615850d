//! `forward . tls://...` against a real DNS-over-TLS server: unbound (`tls-service-key`) on a
//! loopback port, forwarding to the test's Knot, with a CA and certificates made at test time.
//!
//! Answers flow over few, reused TLS connections (counted at the server: unbound's TLS query
//! counter and `ss`; and resumed sessions), and every certificate that must not be trusted (from
//! another CA, expired, for another name) and a plain DNS server on the port gives SERVFAIL and
//! a counted failure, and never reaches the server with a query.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::dot::{self, Pki, Unbound};
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Process, TempDir, client, free_port, http_get, spawn_with_corefile_and};

/// The name the upstream's certificate is for, and what `tls_servername` says.
const NAME: &str = "dns.nodedns.test";

/// `nodedns run --conf` on a Corefile that forwards `.` to `upstream` over TLS with `options`
/// in the forward's block, with `prometheus` on a port of its own.
struct Agent {
    process: Process,
    dns: SocketAddr,
    metrics: SocketAddr,
    _dir: TempDir,
}

impl Agent {
    fn start(upstream: SocketAddr, options: &str) -> Agent {
        let dir = TempDir::new("nodedns-tls").unwrap();
        let port = free_port().unwrap();
        let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
        let corefile = format!(
            ".:{port} {{
    bind 127.0.0.1
    errors
    prometheus {metrics}
    forward . tls://{upstream} {{
{options}
    }}
}}
"
        );
        // One UDP worker: each worker's runtime keeps connections of its own, and the counts
        // below are one runtime's.
        let (mut process, _) = spawn_with_corefile_and(&dir, &corefile, &["--threads", "1"]);
        process
            .wait_output("serving DNS", Duration::from_secs(15))
            .unwrap();
        Agent {
            process,
            dns,
            metrics,
            _dir: dir,
        }
    }

    fn ask(&self, name: &str) -> Message {
        client::udp_blocking(
            self.dns,
            &client::query(name, RecordType::A),
            Duration::from_secs(5),
        )
        .unwrap_or_else(|e| panic!("{name}: {e:#}\n{}", self.process.output()))
    }

    /// The value of the series whose name and labels start with `prefix` (summed over the
    /// rest of their labels), 0 when there is none.
    fn metric(&self, prefix: &str) -> f64 {
        let (status, text) = http_get(self.metrics, "/metrics").unwrap();
        assert_eq!(status, 200);
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn handshakes(&self, upstream: SocketAddr, result: &str) -> f64 {
        self.metric(&format!(
            r#"nodedns_upstream_tls_handshakes_total{{to="{upstream}",result="{result}"}}"#
        ))
    }
}

/// The options of a forward to [`NAME`] whose certificate `pki` signed.
fn trusting(pki: &Pki) -> String {
    format!(
        "        tls {}\n        tls_servername {NAME}",
        pki.ca_file().display()
    )
}

fn knot_or_skip() -> Option<Knot> {
    if !nodedns_integration::have("ss") {
        eprintln!("skipped: ss not installed (Debian package `iproute2`)");
        return None;
    }
    knot::cluster_local_or_skip()
}

fn unbound(knot: &Knot, pki: &Pki, file: &str, sans: &[&str], expired: bool) -> Option<Unbound> {
    let server = pki.server(file, sans, expired).unwrap();
    dot::unbound_or_skip(knot.addr(), &server)
}

#[test]
fn misses_are_answered_over_few_reused_tls_connections() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let pki = Pki::new("nodedns test CA").unwrap();
    let Some(dot) = unbound(&knot, &pki, "server", &[NAME], false) else {
        return;
    };
    let agent = Agent::start(
        dot.addr(),
        &format!("{}\n        expire 1s", trusting(&pki)),
    );

    let reply = agent.ask("kubernetes.default.svc.cluster.local.");
    assert_eq!(
        client::a_addrs(&reply),
        [Ipv4Addr::new(10, 96, 0, 1)],
        "{reply:?}"
    );
    let before = dot.tls_queries().unwrap();
    for i in 0..50 {
        let reply = agent.ask(&format!("n{i}.tls-miss.cluster.local."));
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain, "n{i}");
    }
    assert_eq!(
        dot.tls_queries().unwrap() - before,
        50,
        "each miss reached unbound over TLS"
    );
    // One pooled connection open at the server, once it has seen the close of the start-up
    // health probe's connection of its own (it may count it a moment longer).
    let settled = Instant::now() + Duration::from_secs(5);
    while dot.connections().unwrap() > 1 && Instant::now() < settled {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        dot.connections().unwrap(),
        1,
        "one pooled connection, open at the server"
    );
    let to = format!(
        r#"proxy_name="forward",to="{}",proto="tcp-tls""#,
        dot.addr()
    );
    let opened = agent.metric(&format!("coredns_proxy_conn_cache_misses_total{{{to}}}"));
    let reused = agent.metric(&format!("coredns_proxy_conn_cache_hits_total{{{to}}}"));
    assert!(
        opened <= 2.0 && reused >= 49.0,
        "opened {opened}, reused {reused}"
    );
    assert_eq!(agent.handshakes(dot.addr(), "failed"), 0.0);

    // Idle for longer than `expire`: the next miss opens a new connection, which resumes the
    // session instead of a full handshake.
    let deadline = Instant::now() + Duration::from_secs(10);
    while dot.connections().unwrap() > 0 {
        assert!(
            Instant::now() < deadline,
            "the idle connection was not closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let resumed = dot.stat("num.query.tls.resume").unwrap();
    let reply = agent.ask("after-idle.tls-miss.cluster.local.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
    assert!(agent.handshakes(dot.addr(), "resumed") >= 1.0);
    assert!(
        dot.stat("num.query.tls.resume").unwrap() > resumed,
        "unbound saw the resumed session"
    );
}

/// What every untrusted upstream must give: SERVFAIL (never an answer), counted as an upstream
/// failure and a failed handshake, health checks failing too, and no query reaching the server.
fn assert_refused(agent: &Agent, upstream: SocketAddr, queries_at_server: impl Fn() -> u64) {
    let before = queries_at_server();
    for name in [
        "kubernetes.default.svc.cluster.local.",
        "web.default.svc.cluster.local.",
    ] {
        let reply = agent.ask(name);
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::ServFail,
            "{name}: {reply:?}"
        );
        assert!(reply.answers.is_empty());
    }
    assert!(
        agent.metric(r#"nodedns_upstream_failures_total{zones=".""#) >= 2.0,
        "counted as failed upstream queries"
    );
    assert!(agent.handshakes(upstream, "failed") >= 2.0);
    assert_eq!(agent.handshakes(upstream, "full"), 0.0);
    assert_eq!(agent.handshakes(upstream, "resumed"), 0.0);
    // Marked down: health checks (over TLS) keep failing.
    let failures = format!(
        r#"coredns_proxy_healthcheck_failures_total{{proxy_name="forward",to="{upstream}"}}"#
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.metric(&failures) < 1.0 {
        assert!(Instant::now() < deadline, "no failed health check");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(queries_at_server(), before, "no query reached the server");
}

fn refused_by_certificate(sans: &[&str], expired: bool, signer: Option<&Pki>) {
    let Some(knot) = knot_or_skip() else { return };
    let trusted = Pki::new("nodedns test CA").unwrap();
    let signer = signer.unwrap_or(&trusted);
    let Some(dot) = unbound(&knot, signer, "server", sans, expired) else {
        return;
    };
    let agent = Agent::start(dot.addr(), &trusting(&trusted));
    assert_refused(&agent, dot.addr(), || dot.tls_queries().unwrap());
    assert!(
        agent.process.output().contains("TLS handshake failed"),
        "the reason is logged:\n{}",
        agent.process.output()
    );
}

#[test]
fn a_certificate_from_another_ca_gives_servfail() {
    let _turn = crate::shared();
    let other = Pki::new("some other CA").unwrap();
    refused_by_certificate(&[NAME], false, Some(&other));
}

#[test]
fn an_expired_certificate_gives_servfail() {
    let _turn = crate::shared();
    refused_by_certificate(&[NAME], true, None);
}

#[test]
fn a_certificate_for_another_name_gives_servfail() {
    let _turn = crate::shared();
    refused_by_certificate(&["other.nodedns.test", "127.0.0.1"], false, None);
}

#[test]
fn a_plain_dns_server_on_the_tls_port_gives_servfail() {
    let _turn = crate::shared();
    let Some(knot) = knot_or_skip() else { return };
    let pki = Pki::new("nodedns test CA").unwrap();
    // Knot speaks DNS over TCP on its port: it reads the ClientHello as the start of a DNS
    // message whose rest never comes, and closes the connection after its I/O timeout.
    let agent = Agent::start(knot.addr(), &trusting(&pki));
    assert_refused(&agent, knot.addr(), || knot.tcp_queries().unwrap());
}

#[test]
fn a_forward_without_tls_options_verifies_against_the_system_cas() {
    let _turn = crate::shared();
    // A certificate the system does not trust, for the address itself: refused, so the
    // system's CAs (not "anything") are what a bare tls:// trusts.
    let Some(knot) = knot_or_skip() else { return };
    let pki = Pki::new("nodedns test CA").unwrap();
    let Some(dot) = unbound(&knot, &pki, "server", &["127.0.0.1"], false) else {
        return;
    };
    let agent = Agent::start(dot.addr(), "");
    assert_refused(&agent, dot.addr(), || dot.tls_queries().unwrap());

    // The same certificate with its CA named: the address is the verified name.
    let agent = Agent::start(
        dot.addr(),
        &format!("        tls {}", pki.ca_file().display()),
    );
    let reply = agent.ask("web.default.svc.cluster.local.");
    assert_eq!(client::a_addrs(&reply), [Ipv4Addr::new(10, 96, 12, 34)]);
    assert!(Path::new(&pki.ca_file()).exists());
}
