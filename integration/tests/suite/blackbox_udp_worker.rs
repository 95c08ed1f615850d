//! How a UDP worker waits for datagrams: blocked in `recvmmsg`, its socket in no epoll set,
//! while none of its misses is in flight (the cheapest wait: a registered socket costs every
//! datagram an epoll callback); registered with its own runtime's reactor while one is, so that
//! one wait covers the next datagrams and the upstream's reply; and back to the blocking wait
//! once its misses are answered.
//!
//! Read from /proc: the agent's UDP socket descriptors (`/proc/PID/net/udp` and `fd/`), and the
//! descriptors each of its epoll instances watches (the `tfd:` lines of `/proc/PID/fdinfo/`).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use nodedns_integration::client;
use nodedns_integration::scripted::{Action, Scripted};
use nodedns_integration::{Agent, PROBE_NAME};

/// How long the upstream holds the answer to a name under `slow.`.
const HELD: Duration = Duration::from_millis(800);

/// The descriptors of process `pid`'s UDP sockets bound to `port`.
fn udp_fds(pid: u32, port: u16) -> Vec<u32> {
    let mut inodes = HashSet::new();
    for table in ["udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) {
                if let Some(inode) = fields.get(9) {
                    inodes.insert(format!("socket:[{inode}]"));
                }
            }
        }
    }
    let mut fds = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the agent's fds") {
        let entry = entry.expect("fd entry");
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if inodes.contains(target.to_string_lossy().as_ref()) {
            fds.push(
                entry
                    .file_name()
                    .to_string_lossy()
                    .parse()
                    .expect("fd number"),
            );
        }
    }
    fds
}

/// The descriptors some epoll instance of process `pid` watches.
fn watched(pid: u32) -> HashSet<u32> {
    let mut fds = HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("the agent's fdinfo") {
        let text = std::fs::read_to_string(entry.expect("fdinfo entry").path()).unwrap_or_default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("tfd:") {
                if let Some(fd) = rest.split_whitespace().next().and_then(|f| f.parse().ok()) {
                    fds.insert(fd);
                }
            }
        }
    }
    fds
}

/// Whether the agent's UDP socket on `addr` is registered with a reactor (through any of its
/// descriptors: the listeners keep one, the worker serves another).
fn registered(agent: &Agent, addr: SocketAddr) -> bool {
    let sockets = udp_fds(agent.pid(), addr.port());
    assert!(!sockets.is_empty(), "the agent's UDP socket");
    let watched = watched(agent.pid());
    sockets.iter().any(|fd| watched.contains(fd))
}

/// Asks the cached probe name until the agent's socket is off the reactor (each answered batch
/// lets the worker look at its linger), `limit` at most; whether it got there.
fn hits_until_unregistered(agent: &Agent, limit: Duration) -> bool {
    let query = client::query(PROBE_NAME, RecordType::A);
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        client::udp_blocking(agent.addr(), &query, Duration::from_secs(2)).expect("a hit");
        if !registered(agent, agent.addr()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    false
}

#[test]
fn a_worker_waits_on_its_reactor_only_while_a_miss_is_in_flight() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| {
        if client::qname(query).ends_with(".slow.") {
            Action::a(std::net::Ipv4Addr::new(192, 0, 2, 7), 60).after(HELD)
        } else {
            Action::NxDomain {
                soa_ttl: 30,
                minimum: 60,
            }
        }
    })
    .unwrap();
    let agent = Agent::start_with(&[upstream.addr()], &["--threads", "1"]).unwrap();
    // The start-up probe was a miss; once answered, hits bring the worker back to blocking.
    assert!(
        hits_until_unregistered(&agent, Duration::from_secs(3)),
        "the worker left the reactor after its misses were answered"
    );
    // Hits alone never register it.
    let query = client::query(PROBE_NAME, RecordType::A);
    for _ in 0..200 {
        client::udp_blocking(agent.addr(), &query, Duration::from_secs(2)).expect("a hit");
    }
    assert!(
        !registered(&agent, agent.addr()),
        "hits alone stay blocking"
    );

    // A miss held upstream: the worker waits on its reactor until the answer comes.
    let addr = agent.addr();
    let miss = std::thread::spawn(move || {
        let query = client::query("held.slow.", RecordType::A);
        client::udp_blocking(addr, &query, Duration::from_secs(4)).expect("the held miss")
    });
    assert!(
        upstream.wait_queries_for("held.slow.", 1, Duration::from_secs(2)),
        "the miss reached the upstream"
    );
    assert!(
        registered(&agent, addr),
        "registered while the miss is in flight"
    );
    // The worker still answers hits meanwhile, from the reactor's wait.
    client::udp_blocking(addr, &query, Duration::from_secs(1)).expect("a hit during the miss");
    assert!(registered(&agent, addr), "still registered");
    let answer = miss.join().unwrap();
    assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
    assert_eq!(
        client::a_addrs(&answer),
        [std::net::Ipv4Addr::new(192, 0, 2, 7)]
    );

    assert!(
        hits_until_unregistered(&agent, Duration::from_secs(3)),
        "back to the blocking wait once the miss was answered"
    );
}
