//! A CoreDNS pod that vanishes under load, on a simulated node with two CoreDNS pods behind the
//! kube-dns and kube-dns-upstream ClusterIPs (kube-proxy's iptables mode: each new flow goes to
//! either pod at random, `-m statistic --mode random --probability 0.5`). nodedns forwards to
//! kube-dns-upstream over its pool of TCP connections, so some of them lead to each pod, and so
//! does every new one, until kube-proxy takes the endpoint out.
//!
//! A pod sends 800 queries a second, each for a name never asked before (every one a miss, each
//! one a TCP exchange with CoreDNS), and records each query's latency and outcome. Then:
//!
//! - **silent**: the second CoreDNS pod's traffic is dropped in its namespace, as when its node
//!   dies (no FIN, no RST, no ICMP); 1 s later its endpoint leaves the DNAT rules and its UDP
//!   conntrack entries are deleted, as kube-proxy does. Every query must be answered, none later
//!   than 250 ms.
//! - **graceful**: the endpoint leaves the DNAT rules first, then its Knot exits (FIN on every
//!   connection). Every query must be answered, none later than 250 ms.
//!
//! The summary line of each run (`failover[...]`) is what docs/reliability.md quotes.

use std::collections::HashMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nix::sched::CloneFlags;
use nodedns_integration::client;
use nodedns_integration::node::{self, COREDNS2_IP, KUBE_DNS, Node, NodeOptions};
use tokio::net::UdpSocket;

const QPS: u32 = 800;
/// Steady load before the event, and after it.
const BEFORE: Duration = Duration::from_secs(2);
const AFTER: Duration = Duration::from_secs(4);
/// How long kube-proxy takes to see the pod gone and rewrite its rules.
const KUBE_PROXY_DELAY: Duration = Duration::from_secs(1);
/// The goal: no answer later than this.
const WORST: Duration = Duration::from_millis(250);
/// A query with no answer this long after it was sent is lost (glibc's timeout).
const LOST_AFTER: Duration = Duration::from_secs(5);
/// Client sockets the load is spread over (IDs are per socket).
const SOCKETS: usize = 4;

/// What happened to one query.
#[derive(Debug, Clone)]
struct Outcome {
    /// When it was sent, since the load began.
    sent: Duration,
    /// The reply's RCODE (`None`: it answered another question) and how long it took, or
    /// `None`: no reply within [`LOST_AFTER`].
    reply: Option<(Option<ResponseCode>, Duration)>,
}

#[derive(Debug, Default)]
struct Summary {
    sent: usize,
    answered: usize,
    servfail: usize,
    other: usize,
    lost: usize,
    worst: Duration,
    over_goal: usize,
    /// The slowest queries: (sent since the event, latency or none, RCODE).
    slowest: Vec<(f64, Option<Duration>, Option<ResponseCode>)>,
}

impl Summary {
    fn of(outcomes: &[Outcome], event: Duration) -> Summary {
        let mut s = Summary {
            sent: outcomes.len(),
            ..Summary::default()
        };
        for o in outcomes {
            match o.reply {
                Some((Some(ResponseCode::NoError | ResponseCode::NXDomain), _)) => s.answered += 1,
                Some((Some(ResponseCode::ServFail), _)) => s.servfail += 1,
                Some(_) => s.other += 1,
                None => s.lost += 1,
            }
            let latency = o.reply.map_or(LOST_AFTER, |(_, l)| l);
            s.worst = s.worst.max(latency);
            if latency > WORST {
                s.over_goal += 1;
            }
        }
        let mut slow: Vec<&Outcome> = outcomes.iter().collect();
        slow.sort_by_key(|o| std::cmp::Reverse(o.reply.map_or(LOST_AFTER, |(_, l)| l)));
        s.slowest = slow
            .iter()
            .take(8)
            .map(|o| {
                (
                    o.sent.as_secs_f64() - event.as_secs_f64(),
                    o.reply.map(|r| r.1),
                    o.reply.and_then(|r| r.0),
                )
            })
            .collect();
        s
    }

    fn failures(&self) -> usize {
        self.servfail + self.other + self.lost
    }

    fn line(&self, case: &str) -> String {
        format!(
            "failover[{case}]: sent {}, answered {}, failed {} (SERVFAIL {}, other {}, lost {}), \
             worst {:.1} ms, over {} ms: {}",
            self.sent,
            self.answered,
            self.failures(),
            self.servfail,
            self.other,
            self.lost,
            self.worst.as_secs_f64() * 1000.0,
            WORST.as_millis(),
            self.over_goal
        )
    }
}

/// Moves the calling thread (only it) into network namespace `ns`.
fn enter(ns: &str) {
    let path = Path::new("/run/netns").join(ns);
    let file = File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {}: {e}", path.display()));
}

struct Pending {
    index: usize,
    sent: Instant,
    name: String,
}

/// Sends [`QPS`] unique-name queries a second to `server` from inside `pod` for `duration`,
/// calling `timeline` on this thread meanwhile (it gets the load's start), then waits for the
/// last answers. Returns every query's outcome, in the order sent.
fn load(
    pod: &str,
    server: SocketAddr,
    duration: Duration,
    tag: &'static str,
    timeline: impl FnOnce(Instant),
) -> Vec<Outcome> {
    let total = (duration.as_secs_f64() * f64::from(QPS)) as usize;
    let start = Instant::now() + Duration::from_millis(100);
    std::thread::scope(|scope| {
        let generator = scope.spawn(|| {
            enter(pod);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(generate(server, start, total, tag))
        });
        std::thread::sleep(start.saturating_duration_since(Instant::now()));
        timeline(start);
        generator.join().expect("load generator")
    })
}

async fn generate(server: SocketAddr, start: Instant, total: usize, tag: &str) -> Vec<Outcome> {
    let outcomes: Arc<Mutex<Vec<Outcome>>> = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut sockets = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..SOCKETS {
        let socket = Arc::new(
            UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                .await
                .expect("client socket"),
        );
        let pending: Arc<Mutex<HashMap<u16, Pending>>> = Arc::default();
        receivers.push(tokio::spawn(receive(
            socket.clone(),
            pending.clone(),
            outcomes.clone(),
        )));
        sockets.push((socket, pending));
    }
    let period = Duration::from_secs(1) / QPS;
    let mut id: u16 = rand::random();
    for i in 0..total {
        tokio::time::sleep_until((start + period * i as u32).into()).await;
        let (socket, pending) = &sockets[i % SOCKETS];
        id = id.wrapping_add(1);
        let name = format!("u{i}.{tag}.cluster.local.");
        let mut query = client::query(&name, RecordType::A);
        query.metadata.id = id;
        let bytes = query.to_vec().expect("encode");
        let index = {
            let mut outcomes = outcomes.lock().unwrap();
            outcomes.push(Outcome {
                sent: start.elapsed(),
                reply: None,
            });
            outcomes.len() - 1
        };
        let previous = pending.lock().unwrap().insert(
            id,
            Pending {
                index,
                sent: Instant::now(),
                name,
            },
        );
        assert!(previous.is_none(), "ID {id} reused while pending");
        // A send that fails is a query lost, as a datagram the network dropped.
        let _ = socket.send_to(&bytes, server).await;
    }
    // The last answers: everything pending is answered or lost within LOST_AFTER.
    let last = Instant::now();
    loop {
        let waiting = sockets
            .iter()
            .any(|(_, pending)| !pending.lock().unwrap().is_empty());
        if !waiting || last.elapsed() > LOST_AFTER {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for receiver in receivers {
        receiver.abort();
    }
    let outcomes = outcomes.lock().unwrap();
    outcomes.clone()
}

async fn receive(
    socket: Arc<UdpSocket>,
    pending: Arc<Mutex<HashMap<u16, Pending>>>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
) {
    let mut buf = vec![0u8; 65535];
    loop {
        let Ok((n, _)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        let at = Instant::now();
        let Ok(reply) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let Some(query) = pending.lock().unwrap().remove(&reply.metadata.id) else {
            continue;
        };
        let latency = at - query.sent;
        if latency > LOST_AFTER {
            continue;
        }
        let answers_it = reply
            .queries
            .first()
            .is_some_and(|q| q.name().to_ascii().eq_ignore_ascii_case(&query.name));
        let rcode = answers_it.then_some(reply.metadata.response_code);
        outcomes.lock().unwrap()[query.index].reply = Some((rcode, latency));
    }
}

/// A node with two CoreDNS pods and nodedns serving: every test's start (`None`: skipped).
fn two_coredns_pods() -> Option<(Node, node::NodeAgent)> {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let mut node = Node::build(NodeOptions::default()).expect("simulated node");
    node.add_coredns_replica().expect("second CoreDNS pod");
    let agent = node.start_nodedns(&[]).expect("nodedns starts");
    Some((node, agent))
}

fn report(case: &str, outcomes: &[Outcome], event: Duration, node: &Node) -> Summary {
    let summary = Summary::of(outcomes, event);
    eprintln!("{}", summary.line(case));
    eprintln!(
        "failover[{case}]: slowest (sent s after the event, latency, RCODE): {:?}",
        summary.slowest
    );
    let first = node.coredns().queries().unwrap_or(0);
    let second = node
        .replica()
        .and_then(|r| r.knot())
        .and_then(|k| k.queries().ok());
    eprintln!("failover[{case}]: queries seen by CoreDNS pods: {first}, {second:?}");
    let metrics = node
        .http_get(SocketAddr::from((Ipv4Addr::LOCALHOST, 9253)), "/metrics")
        .unwrap_or_default();
    let upstream: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            [
                "nodedns_upstream_hedges_total",
                "nodedns_upstream_retries_total",
                "nodedns_upstream_connects_total",
                "nodedns_upstream_connection_resets_total",
                "coredns_proxy_healthcheck_failures_total",
            ]
            .iter()
            .any(|m| l.starts_with(m))
        })
        .collect();
    eprintln!("failover[{case}]: nodedns: {upstream:?}");
    summary
}

fn assert_goal(case: &str, summary: &Summary) {
    assert_eq!(
        summary.failures(),
        0,
        "{}: every query answered",
        summary.line(case)
    );
    assert!(
        summary.worst <= WORST,
        "{}: no answer later than {WORST:?}",
        summary.line(case)
    );
    assert!(
        summary.sent >= (BEFORE + AFTER).as_secs() as usize * QPS as usize * 98 / 100,
        "{}: the load fell behind",
        summary.line(case)
    );
}

#[test]
fn a_coredns_pod_that_goes_silent_costs_no_query() {
    let _turn = crate::alone();
    let Some((node, agent)) = two_coredns_pods() else {
        return;
    };
    let server = SocketAddr::from((KUBE_DNS, 53));
    let pod = node.pod.name().to_owned();
    let outcomes = load(&pod, server, BEFORE + AFTER, "silent", |start| {
        std::thread::sleep((start + BEFORE).saturating_duration_since(Instant::now()));
        node.replica().unwrap().silence().expect("silence the pod");
        std::thread::sleep(KUBE_PROXY_DELAY);
        node.set_coredns_endpoints(&[node::COREDNS_IP])
            .expect("endpoint removed");
        let deleted = node.forget_udp_flows_to(COREDNS2_IP).expect("conntrack -D");
        eprintln!("failover[silent]: kube-proxy deleted {deleted} UDP conntrack entries");
    });
    let summary = report("silent", &outcomes, BEFORE, &node);
    drop(agent);
    assert_goal("silent", &summary);
}

#[test]
fn a_coredns_pod_that_leaves_gracefully_costs_no_query() {
    let _turn = crate::alone();
    let Some((mut node, agent)) = two_coredns_pods() else {
        return;
    };
    let server = SocketAddr::from((KUBE_DNS, 53));
    let pod = node.pod.name().to_owned();
    let outcomes = load(&pod, server, BEFORE + AFTER, "graceful", |start| {
        std::thread::sleep((start + BEFORE).saturating_duration_since(Instant::now()));
        node.set_coredns_endpoints(&[node::COREDNS_IP])
            .expect("endpoint removed");
        node.forget_udp_flows_to(COREDNS2_IP).expect("conntrack -D");
        // CoreDNS's lameduck: it keeps answering a moment after it left the endpoints.
        std::thread::sleep(KUBE_PROXY_DELAY);
        node.replica_mut().unwrap().stop();
    });
    let summary = report("graceful", &outcomes, BEFORE, &node);
    drop(agent);
    assert_goal("graceful", &summary);
}
