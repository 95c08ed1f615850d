//! The admin server against clients that hold connections, send half a request, ask the health
//! address for what it does not serve, change the log level without being the agent's user, or
//! leave the agent without descriptors. The bounds are docs/reliability.md's: 5 s for a request
//! head (idle keep-alive included), 32 connections per address with the oldest closed to make
//! room, accept errors backed off (5 ms doubling to 1 s) and logged once per 10 s.
//!
//! Real parts: the `nodedns` binary, kernel sockets, `prlimit` and `setpriv` (util-linux), `bash`'s
//! `/dev/tcp` as a client of another user.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use nodedns_integration::{Process, free_loopback, free_port, have, http_get, nodedns_bin};

use crate::reliability_support;

/// The admin server's bounds (crates/agent/src/admin.rs), as the documentation states them.
const TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 32;
/// Scheduling slack on a shared 2-core machine, on top of a stated time-out.
const SLACK: Duration = Duration::from_secs(2);

/// `nodedns run` on loopback with /health on its own address and /metrics on another, forwarding
/// to a port nothing listens on (the admin server is what is tested). `wrapper` runs it
/// (`prlimit ...`).
struct Admin {
    process: Process,
    dns: SocketAddr,
    health: SocketAddr,
    metrics: SocketAddr,
}

fn start(wrapper: &[&str], extra: &[&str]) -> Admin {
    let dead = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    for _ in 0..3 {
        let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
        let (health, metrics) = (free_loopback(), free_loopback());
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(nodedns_bin());
                command
            }
            None => Command::new(nodedns_bin()),
        };
        command
            .arg("run")
            .args(["--listen", &dns.to_string()])
            .args(["--upstream", &dead.to_string()])
            .args(["--health", &health.to_string()])
            .args(["--metrics-listen-address", &metrics.to_string()])
            .args(["--threads", "2"])
            .args(extra)
            .env("NO_COLOR", "1");
        let mut process = Process::spawn("nodedns", command).expect("spawn nodedns");
        let deadline = Instant::now() + Duration::from_secs(15);
        while process.exited().is_none() && Instant::now() < deadline {
            if matches!(http_get(health, "/health"), Ok((200, _))) {
                return Admin {
                    process,
                    dns,
                    health,
                    metrics,
                };
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

/// Reads until the agent closes `stream` (EOF or reset); how long that took from `since`, or
/// `None` if it is still open after `limit`.
fn closed_within(stream: &mut TcpStream, since: Instant, limit: Duration) -> Option<Duration> {
    let mut buf = [0u8; 4096];
    loop {
        let left = limit.checked_sub(since.elapsed())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return Some(since.elapsed()),
            Ok(_) => {}
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if since.elapsed() >= limit {
                    return None;
                }
            }
            Err(_) => return Some(since.elapsed()),
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| dir.count())
        .unwrap_or(0)
}

/// User plus system CPU time the process used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .unwrap_or(100);
    Duration::from_millis(ticks * 1000 / per_second)
}

/// The sum of every sample of metric `name` in a Prometheus text (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    reliability_support::metric(text, name).unwrap_or(0.0)
}

#[test]
fn an_idle_connection_and_an_idle_keep_alive_are_closed_within_the_timeout() {
    let _turn = crate::alone();
    let agent = start(&[], &[]);
    let since = Instant::now();
    let mut idle = TcpStream::connect(agent.health).unwrap();
    let mut kept = TcpStream::connect(agent.health).unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: nodedns\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 17];
    kept.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200 OK\r\n", "served before idling");
    let idle_for = closed_within(&mut idle, since, TIMEOUT + SLACK);
    let kept_for = closed_within(&mut kept, since, TIMEOUT + SLACK);
    eprintln!("idle closed after {idle_for:?}, keep-alive after {kept_for:?}");
    assert!(
        idle_for.is_some(),
        "a connection that never sent a byte is still open after {:?}",
        TIMEOUT + SLACK
    );
    assert!(
        kept_for.is_some(),
        "an idle keep-alive connection is still open"
    );
    // Counted once hyper has let go of the connection, a moment after the client saw it close.
    let deadline = Instant::now() + SLACK;
    loop {
        let scraped = http_get(agent.metrics, "/metrics").unwrap().1;
        if metric(&scraped, "nodedns_admin_connections_closed_total") >= 2.0 {
            break;
        }
        assert!(Instant::now() < deadline, "not counted:\n{scraped}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_connection_dripping_half_a_request_head_is_closed_within_the_timeout() {
    let _turn = crate::alone();
    let agent = start(&[], &[]);
    let since = Instant::now();
    let mut stream = TcpStream::connect(agent.health).unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: no")
        .unwrap();
    // One more byte a second: every read makes progress, the head is never complete.
    let dripping = {
        let mut stream = stream.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..20 {
                std::thread::sleep(Duration::from_secs(1));
                if stream.write_all(b"d").is_err() {
                    return;
                }
            }
        })
    };
    let took = closed_within(&mut stream, since, TIMEOUT + SLACK);
    eprintln!("half a head: closed after {took:?}");
    assert!(took.is_some(), "half a request head still open");
    drop(stream);
    dripping.join().unwrap();
}

#[test]
fn the_connection_cap_holds_and_the_health_endpoint_keeps_answering() {
    let _turn = crate::alone();
    let agent = start(&[], &[]);
    let pid = agent.process.pid();
    let before = open_fds(pid);
    let since = Instant::now();
    // Far more idle connections than the cap, opened faster than any time-out.
    let held: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(agent.health).unwrap())
        .collect();
    // Every probe is answered at once, with the held connections still open on this side.
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let asked = Instant::now();
        let (status, body) = http_get(agent.health, "/health").unwrap();
        slowest = slowest.max(asked.elapsed());
        assert_eq!((status, body.as_str()), (200, "OK"));
    }
    let during = open_fds(pid);
    assert!(
        since.elapsed() < TIMEOUT,
        "measured before the time-out could close anything"
    );
    eprintln!(
        "descriptors: {before} before, {during} with 200 connections held; slowest /health {slowest:?}"
    );
    assert!(slowest < Duration::from_secs(1), "/health took {slowest:?}");
    assert!(
        during <= before + MAX_CONNECTIONS + 2,
        "the agent holds {} descriptors more than before 200 connections (cap {MAX_CONNECTIONS})",
        during - before
    );
    let scraped = http_get(agent.metrics, "/metrics").unwrap().1;
    let closed = metric(&scraped, "nodedns_admin_connections_closed_total");
    assert!(closed >= (200 - MAX_CONNECTIONS) as f64, "closed {closed}");
    drop(held);
}

#[test]
fn each_address_serves_only_what_it_is_for() {
    let _turn = crate::shared();
    let agent = start(&[], &[]);
    let status = |addr, path| http_get(addr, path).unwrap().0;
    // The health address: /health only, as CoreDNS's health plugin (node-cache's health port).
    assert_eq!(status(agent.health, "/health"), 200);
    for path in ["/metrics", "/log-level", "/ready", "/", "/health/x"] {
        assert_eq!(
            status(agent.health, path),
            404,
            "{path} on the health address"
        );
    }
    // The metrics address: /metrics and /log-level, and /ready (no address of its own here),
    // not /health (it has one).
    assert_eq!(status(agent.metrics, "/metrics"), 200);
    assert_eq!(status(agent.metrics, "/log-level"), 200);
    assert_ne!(status(agent.metrics, "/ready"), 404);
    assert_eq!(status(agent.metrics, "/health"), 404);
}

/// `PUT /log-level` with `filter`, sent by `bash`'s `/dev/tcp` run as `uid`: the status line.
fn put_log_level_as(uid: u32, addr: SocketAddr, filter: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/{}/{}; printf 'PUT /log-level HTTP/1.0\\r\\nContent-Length: {}\\r\\n\\r\\n{}' >&3; head -n 1 <&3",
        addr.ip(),
        addr.port(),
        filter.len(),
        filter
    );
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "--",
            "bash",
            "-c",
            &script,
        ])
        .output()
        .expect("run setpriv");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn only_the_agents_own_user_may_change_the_log_level_from_loopback() {
    let _turn = crate::shared();
    if !have("setpriv") || !have("bash") || !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root, setpriv and bash");
        return;
    }
    let agent = start(&[], &["--log-level", "warn"]);
    // Another user on the same loopback (any hostNetwork pod): refused, nothing changes.
    let status = put_log_level_as(65534, agent.metrics, "trace");
    assert!(status.contains(" 403 "), "nobody: {status:?}");
    assert_eq!(http_get(agent.metrics, "/log-level").unwrap().1, "warn\n");
    // The agent's own user (root here): accepted.
    let status = put_log_level_as(0, agent.metrics, "info");
    assert!(status.contains(" 200 "), "root: {status:?}");
    assert_eq!(http_get(agent.metrics, "/log-level").unwrap().1, "info\n");
}

#[test]
fn accept_errors_at_a_low_descriptor_limit_back_off_instead_of_spinning() {
    let _turn = crate::alone();
    if !have("prlimit") {
        eprintln!("skipped: needs prlimit (util-linux)");
        return;
    }
    let agent = start(
        &["prlimit", "--nofile=256:256", "--"],
        // Caps above what the descriptors allow (the defaults are derived from the limit and
        // would keep descriptors free), so that DNS clients can take every descriptor.
        &[
            "--tcp-max-connections",
            "1024",
            "--tcp-max-connections-per-client",
            "0",
            "--tcp-idle-timeout",
            "60s",
        ],
    );
    let pid = agent.process.pid();
    // Idle DNS connections take every descriptor the agent has left.
    let dns: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(agent.dns).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while open_fds(pid) < 256 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(open_fds(pid) >= 250, "the agent is out of descriptors");
    // Idle admin connections wait in the listen queue: every accept fails with EMFILE.
    let admin: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(agent.health).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let lines = |text: &str| text.matches("admin accept failed").count();
    let (cpu, logged) = (cpu_time(pid), lines(&agent.process.output()));
    let window = Duration::from_secs(5);
    std::thread::sleep(window);
    let used = cpu_time(pid) - cpu;
    let output = agent.process.output();
    let logged = lines(&output) - logged;
    eprintln!("in {window:?} out of descriptors: {used:?} of CPU, {logged} admin accept lines");
    assert!(
        used < Duration::from_millis(500),
        "the agent used {used:?} of CPU in {window:?}"
    );
    assert!(logged <= 1, "{logged} lines in {window:?}");
    assert!(
        output.contains("admin accept failed"),
        "the failure is logged:\n{}",
        &output[output.len().saturating_sub(4000)..]
    );
    // Descriptors back: the agent serves again, and counted what failed.
    drop(dns);
    drop(admin);
    let deadline = Instant::now() + Duration::from_secs(10);
    let scraped = loop {
        if let Ok((200, text)) = http_get(agent.metrics, "/metrics") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no /metrics after descriptors came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(metric(&scraped, "nodedns_admin_accept_errors_total") >= 1.0);
    assert_eq!(http_get(agent.health, "/health").unwrap().0, 200);
}
