//! `/ready` and `/health` seen from outside: readiness waits for the upstream (liveness does
//! not), and turns false the moment SIGTERM arrives, while the UDP listener still answers for
//! the drain period, so Kubernetes and Cilium stop sending before the listeners close.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use nix::sys::signal::Signal;
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Process, client, free_loopback, free_port, nodedns_bin};

/// `GET path` over HTTP/1.0: (status, body), or `None` when nothing answers.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

fn status(addr: SocketAddr, path: &str) -> Option<u16> {
    get(addr, path).map(|(s, _)| s)
}

/// `nodedns run` in command-line mode on free loopback ports, forwarding to `upstream`; returns
/// once `/health` answers (before any DNS query is sent).
fn start(upstream: SocketAddr, extra: &[&str]) -> (Process, SocketAddr, SocketAddr) {
    for _ in 0..3 {
        let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
        let admin = free_loopback();
        let mut command = Command::new(nodedns_bin());
        command
            .arg("run")
            .args(["--listen", &dns.to_string()])
            .args(["--upstream", &upstream.to_string()])
            .args(["--metrics-listen-address", &admin.to_string()])
            .args(["--threads", "2"])
            .args(extra);
        let mut process = Process::spawn("nodedns", command).expect("spawn nodedns");
        let deadline = Instant::now() + Duration::from_secs(15);
        while process.exited().is_none() && Instant::now() < deadline {
            if status(admin, "/health") == Some(200) {
                return (process, dns, admin);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = process.output();
        assert!(
            output.contains("in use"),
            "nodedns did not start:\n{output}"
        );
    }
    panic!("no free ports for nodedns");
}

/// Polls `ok` every 5 ms for at most `limit`; the time it first held.
fn when(limit: Duration, mut ok: impl FnMut() -> bool) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    loop {
        if ok() {
            return Some(Instant::now());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn answers(dns: SocketAddr, name: &str) -> Option<ResponseCode> {
    client::udp_blocking(
        dns,
        &client::query(name, RecordType::A),
        Duration::from_millis(300),
    )
    .ok()
    .map(|reply| reply.metadata.response_code)
}

#[test]
fn ready_turns_false_on_sigterm_before_the_udp_listener_stops_answering() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let (mut agent, dns, admin) = start(knot.addr(), &["--drain", "3s"]);
    when(Duration::from_secs(10), || {
        status(admin, "/ready") == Some(200)
    })
    .expect("ready once the upstream answered");
    let name = "web.default.svc.cluster.local.";
    assert_eq!(answers(dns, name), Some(ResponseCode::NoError));

    let term = Instant::now();
    agent.signal(Signal::SIGTERM).expect("SIGTERM");
    let unready = when(Duration::from_secs(1), || {
        status(admin, "/ready") == Some(503)
    })
    .expect("/ready is 503 within a second of SIGTERM");
    assert_eq!(
        get(admin, "/ready").map(|(_, body)| body),
        Some("shutting down\n".to_owned())
    );

    // Not ready, still answering: a cached name and a new one (through the upstream).
    assert_eq!(answers(dns, name), Some(ResponseCode::NoError));
    assert_eq!(
        answers(dns, "kubernetes.default.svc.cluster.local."),
        Some(ResponseCode::NoError)
    );
    assert_eq!(
        status(admin, "/ready"),
        Some(503),
        "readiness never comes back"
    );
    assert_eq!(status(admin, "/health"), Some(200), "draining is alive");

    // Then the listener closes; the last answer came after readiness went false.
    let mut last_answer = None;
    let stopped = when(Duration::from_secs(10), || match answers(dns, name) {
        Some(_) => {
            last_answer = Some(Instant::now());
            false
        }
        None => true,
    })
    .expect("the UDP listener stops answering after the drain");
    let last_answer = last_answer.expect("answers during the drain");
    assert!(unready < last_answer && last_answer < stopped);
    assert!(
        stopped - term >= Duration::from_millis(2500),
        "answered for the whole drain (3 s), stopped after {:?}",
        stopped - term
    );
    let status = agent.wait_timeout(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status}");
}

#[test]
fn ready_waits_for_the_upstream_while_health_answers_at_once() {
    let _turn = crate::shared();
    if !nodedns_integration::have("knotd") {
        eprintln!("skipped: knotd not installed");
        return;
    }
    // The upstream's port, with nothing on it yet.
    let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let (_agent, _dns, admin) = start(upstream, &[]);
    let deadline = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < deadline {
        assert_eq!(get(admin, "/ready"), Some((503, "not ready\n".to_owned())));
        assert_eq!(status(admin, "/health"), Some(200));
        std::thread::sleep(Duration::from_millis(100));
    }
    let _knot = Knot::start(knot::Options {
        listen: vec![upstream],
        zones: vec![Knot::cluster_local()],
        ..knot::Options::default()
    })
    .expect("knotd starts on the upstream's port");
    when(Duration::from_secs(10), || {
        status(admin, "/ready") == Some(200)
    })
    .expect("ready once the upstream answers");
}
