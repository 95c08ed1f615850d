//! The ndots cascade prefetch on a simulated node: a pod (glibc's `getent`, the stock
//! resolv.conf: `search default.svc.cluster.local svc.cluster.local cluster.local`, `ndots:5`)
//! looks names up through nodedns, which forwards to a Knot standing in for CoreDNS through a
//! relay that adds the latency a real cluster has (this kernel has no netem): [`CLUSTER_DELAY`]
//! for names under cluster.local (CoreDNS answers those itself) and [`EXTERNAL_DELAY`] for the
//! others (CoreDNS forwards them).
//!
//! With the prefetch on, the first step's NXDOMAIN starts the later steps at once: every name of
//! the cascade reaches the upstream exactly once and the pod's own queries for the later steps
//! find them in flight or cached (`used`). A name that exists at the second step costs the two
//! steps after it (`wasted`), and one that exists at the first step costs nothing. The tests
//! print the timings of cold lookups with the prefetch on and off, and of the last step alone.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::Message;
use nodedns_integration::TempDir;
use nodedns_integration::knot::{Knot, Zone};
use nodedns_integration::node::{
    self, COREDNS_IP, KUBE_DNS, LOCAL_IP, Node, NodeAgent, NodeOptions,
};

use crate::stock_node::spawn_in_netns;

/// What the relay adds to a query for a name under cluster.local.
const CLUSTER_DELAY: Duration = Duration::from_millis(1);
/// What it adds to any other query: the cluster's own, plus CoreDNS's forwarding to the
/// outside.
const EXTERNAL_DELAY: Duration = Duration::from_millis(21);
/// Where the agent serves /metrics (`prometheus :9253`), from the node namespace.
const METRICS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9253);
/// Cold lookups timed per case.
const ROUNDS: usize = 15;

/// One query the relay passed on.
#[derive(Debug, Clone)]
struct Seen {
    /// Lowercase, absolute.
    name: String,
    rtype: String,
    arrived: Instant,
    /// When Knot's answer went back (`None`: not yet, or never).
    answered: Option<Instant>,
}

/// A UDP relay in the node namespace in front of the CoreDNS pod's Knot: each query waits its
/// delay, goes to Knot, and Knot's answer goes back. It records what it passed on.
struct Relay {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    fn start(node: &Node, to: SocketAddr) -> Relay {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (bound_tx, bound) = std::sync::mpsc::channel();
        let (log, stopping) = (seen.clone(), stop.clone());
        let thread = spawn_in_netns(&node.node, move || {
            let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").expect("relay socket"));
            socket
                .set_read_timeout(Some(Duration::from_millis(20)))
                .unwrap();
            bound_tx.send(socket.local_addr().unwrap()).unwrap();
            let mut buf = [0u8; 4096];
            while !stopping.load(Ordering::Relaxed) {
                let Ok((n, peer)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let query = buf[..n].to_vec();
                let Ok(message) = Message::from_vec(&query) else {
                    continue;
                };
                let Some(question) = message.queries.first() else {
                    continue;
                };
                let name = question.name().to_ascii().to_ascii_lowercase();
                let delay = if name.ends_with(".cluster.local.") {
                    CLUSTER_DELAY
                } else {
                    EXTERNAL_DELAY
                };
                let at = {
                    let mut log = log.lock().unwrap();
                    log.push(Seen {
                        name,
                        rtype: question.query_type().to_string(),
                        arrived: Instant::now(),
                        answered: None,
                    });
                    log.len() - 1
                };
                let (socket, log) = (socket.clone(), log.clone());
                // Threads started here live in the node namespace too.
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    let upstream = UdpSocket::bind("0.0.0.0:0").expect("relay upstream socket");
                    upstream
                        .set_read_timeout(Some(Duration::from_secs(2)))
                        .unwrap();
                    let mut buf = [0u8; 4096];
                    if upstream.send_to(&query, to).is_ok() {
                        if let Ok(n) = upstream.recv(&mut buf) {
                            // Stamped before it leaves: whatever it causes arrives later.
                            let when = Instant::now();
                            let _ = socket.send_to(&buf[..n], peer);
                            log.lock().unwrap()[at].answered = Some(when);
                        }
                    }
                });
            }
        });
        let addr = bound.recv().expect("the relay bound its socket");
        Relay {
            addr,
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// For each query passed on so far, whether it started a new fetch of its name and type:
    /// every earlier query for them had been answered when it arrived. A query that arrived
    /// while another for the same question was still out is the upstream client's hedge or
    /// retry of one fetch (the agent's upstream pool hedges an exchange that outlasts its
    /// usual round trip, which a busy machine makes happen now and then), not a fetch of its own.
    fn fetches(&self) -> Vec<(Seen, bool)> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .enumerate()
            .map(|(i, s)| {
                let earlier = seen[..i]
                    .iter()
                    .filter(|e| e.name == s.name && e.rtype == s.rtype);
                let new = earlier
                    .into_iter()
                    .all(|e| e.answered.is_some_and(|a| a <= s.arrived));
                (s.clone(), new)
            })
            .collect()
    }

    /// What the relay saw of the names ending in `name`, in order, with times from the first.
    fn story(&self, name: &str) -> String {
        let fetches = self.fetches();
        let mine: Vec<&(Seen, bool)> = fetches
            .iter()
            .filter(|(s, _)| s.name.contains(name))
            .collect();
        let Some(t0) = mine.first().map(|(s, _)| s.arrived) else {
            return String::new();
        };
        let at = |t: Instant| millis(t.saturating_duration_since(t0));
        mine.iter()
            .map(|(s, new)| {
                format!(
                    "{:8.2} ms {} {} answered {} {}\n",
                    at(s.arrived),
                    s.name,
                    s.rtype,
                    s.answered
                        .map_or("never".to_owned(), |a| format!("{:.2} ms", at(a))),
                    if *new {
                        "(a fetch)"
                    } else {
                        "(hedge or retry)"
                    }
                )
            })
            .collect()
    }

    /// Fetches of `name` (absolute, lowercase) and `rtype` the upstream saw.
    fn count(&self, name: &str, rtype: &str) -> usize {
        self.fetches()
            .iter()
            .filter(|(s, new)| *new && s.name == name && s.rtype == rtype)
            .count()
    }

    /// Fetches the upstream saw so far, every name and type.
    fn total(&self) -> usize {
        self.fetches().iter().filter(|(_, new)| *new).count()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// CoreDNS's zones: cluster.local, `example.com` (every name has an A and an AAAA record), and
/// a root zone so other names get NXDOMAIN. TTLs of 5 s, the cache's floor, so that the
/// prefetched entries nobody asks for expire (and are judged wasted) within the test.
fn zones() -> Vec<Zone> {
    vec![
        Knot::cluster_local(),
        Zone {
            origin: "example.com.".to_owned(),
            body: "@ 5 IN SOA ns.example.com. hostmaster.example.com. 1 7200 1800 86400 5\n\
                   @ 5 IN NS ns\n\
                   ns 5 IN A 192.0.2.53\n\
                   * 5 IN A 192.0.2.80\n\
                   * 5 IN AAAA 2001:db8::80\n"
                .to_owned(),
        },
        Zone {
            origin: ".".to_owned(),
            body:
                "@ 5 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 5\n\
                   @ 5 IN NS ns.dns.cluster.local.\n"
                    .to_owned(),
        },
    ]
}

/// node-local-dns's blocks for the cluster domain and `.` (the stock caches), both forwarding
/// to the relay.
fn corefile(relay: SocketAddr) -> String {
    let bind = format!("bind {LOCAL_IP} {KUBE_DNS}");
    format!(
        "cluster.local:53 {{\n    errors\n    cache {{\n        success 9984 30\n        \
         denial 9984 5\n    }}\n    {bind}\n    forward . {relay}\n    prometheus :9253\n}}\n\
         .:53 {{\n    errors\n    cache 30\n    {bind}\n    forward . {relay}\n    \
         prometheus :9253\n}}\n"
    )
}

/// Starts nodedns on the node with `corefile` and the prefetch `on` or off; returns once it
/// answers on the kube-dns ClusterIP and is ready.
fn start(node: &Node, corefile: &Path, on: bool) -> NodeAgent {
    let switch = format!("--cascade-prefetch={on}");
    let ips = format!("{LOCAL_IP},{KUBE_DNS}");
    let args = [
        "run",
        "--local-ip",
        &ips,
        "--conf",
        corefile.to_str().unwrap(),
        "--link-kind",
        "bridge",
        "--sync-interval",
        "1s",
        &switch,
    ];
    let agent = node
        .spawn_nodedns("nodedns", &args, "serving DNS")
        .unwrap_or_else(|e| panic!("nodedns starts: {e:#}"));
    node::wait_for("nodedns answers", Duration::from_secs(20), || {
        node.answers(KUBE_DNS.into())
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", agent.output()));
    // Readiness probes each block's upstream (`. NS`, through the relay): until it is ready,
    // those probes may still reach the relay and be counted with a test's queries.
    node::wait_for("nodedns ready", Duration::from_secs(20), || {
        node.http_get(METRICS, "/ready").is_ok()
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", agent.output()));
    agent
}

/// `getent hosts name` in the pod: how long it took; panics unless it resolved.
fn lookup(node: &Node, name: &str) -> Duration {
    let started = Instant::now();
    let out = node.getent(&[name]).expect("getent runs");
    let took = started.elapsed();
    assert!(
        out.status.success() && !out.stdout.is_empty(),
        "getent hosts {name}: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

/// `nodedns_cascade_prefetches_total{outcome="…"}`.
fn cascade(node: &Node, outcome: &str) -> u64 {
    let text = node.http_get(METRICS, "/metrics").expect("/metrics");
    let series = format!("nodedns_cascade_prefetches_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

/// Hedges the agent's upstream pool sent so far, every upstream.
fn hedges(node: &Node) -> usize {
    let text = node.http_get(METRICS, "/metrics").expect("/metrics");
    text.lines()
        .filter(|l| l.starts_with("nodedns_upstream_hedges_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as usize
}

/// Waits until the prefetches started so far are all judged (used or wasted).
fn judged(node: &Node, limit: Duration) -> (u64, u64, u64) {
    let mut last = (0, 0, 0);
    node::wait_for("every started prefetch judged", limit, || {
        last = (
            cascade(node, "started"),
            cascade(node, "used"),
            cascade(node, "wasted"),
        );
        last.0 == last.1 + last.2
    })
    .unwrap_or_else(|e| panic!("{e:#}: started, used, wasted = {last:?}"));
    last
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Median and range of `times`, in ms, for the test's output.
fn summary(times: &[Duration]) -> String {
    let mut ms: Vec<f64> = times.iter().copied().map(millis).collect();
    ms.sort_by(f64::total_cmp);
    format!(
        "median {:.1} ms (min {:.1}, max {:.1}, n={})",
        ms[ms.len() / 2],
        ms[0],
        ms[ms.len() - 1],
        ms.len()
    )
}

struct Case {
    node: Node,
    relay: Relay,
    _dir: TempDir,
    corefile: std::path::PathBuf,
}

fn case() -> Option<Case> {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return None;
    }
    let node = Node::build_serving(NodeOptions::default(), zones()).expect("simulated node");
    let relay = Relay::start(&node, SocketAddr::from((COREDNS_IP, 53)));
    let dir = TempDir::new("nodedns-cascade").unwrap();
    let corefile = dir.path().join("Corefile");
    std::fs::write(&corefile, self::corefile(relay.addr)).unwrap();
    Some(Case {
        node,
        relay,
        _dir: dir,
        corefile,
    })
}

/// The four names glibc asks for `name` under the stock search list, in order.
fn cascade_of(name: &str) -> [String; 4] {
    [
        format!("{name}.default.svc.cluster.local."),
        format!("{name}.svc.cluster.local."),
        format!("{name}.cluster.local."),
        format!("{name}."),
    ]
}

/// A pod's first lookup of an external name: with the prefetch, every step is fetched from the
/// upstream once and the pod's later steps are served by the prefetch (used, none wasted);
/// without it, nothing is prefetched. Two nodes, one with the prefetch and one without, take
/// turns (so both see the same machine load), and the timings of their cold lookups and of the
/// last step alone are printed.
#[test]
fn a_first_step_nxdomain_prefetches_the_later_steps_the_pod_then_asks() {
    let _turn = crate::alone();
    let (Some(with), Some(without)) = (case(), case()) else {
        return;
    };
    let cases = [(&with, true), (&without, false)];
    let agents: Vec<NodeAgent> = cases
        .iter()
        .map(|(case, on)| start(&case.node, &case.corefile, *on))
        .collect();
    let mut times: Vec<(Vec<Duration>, Vec<Duration>)> = vec![Default::default(); 2];
    for round in 0..ROUNDS {
        for (i, (case, on)) in cases.iter().enumerate() {
            let mode = if *on { "on" } else { "off" };
            let name = format!("api{round}.example.com");
            times[i].0.push(lookup(&case.node, &name));
            // getent asks AAAA (gethostbyname2 AF_INET6) and finds it at the last step.
            for step in cascade_of(&name) {
                assert_eq!(
                    case.relay.count(&step, "AAAA"),
                    1,
                    "prefetch {mode}: {step} AAAA was fetched from the upstream once\n{}\n{}",
                    case.relay.story(&name),
                    agents[i].output()
                );
            }
            times[i]
                .1
                .push(lookup(&case.node, &format!("last{round}.example.com.")));
        }
    }
    let (started, used, wasted) = judged(&with.node, Duration::from_secs(10));
    assert_eq!(
        (started, used, wasted),
        (3 * ROUNDS as u64, 3 * ROUNDS as u64, 0),
        "three later steps per lookup, each asked by the pod while in flight or fresh"
    );
    assert_eq!(cascade(&with.node, "skipped"), 0);
    assert_eq!(cascade(&without.node, "started"), 0, "off: no prefetch");
    let (median, min) = (
        |t: &[Duration]| {
            let mut t = t.to_vec();
            t.sort();
            millis(t[t.len() / 2])
        },
        |t: &[Duration]| millis(t.iter().copied().min().unwrap_or_default()),
    );
    for ((_, on), (cascades, alone)) in cases.iter().zip(&times) {
        println!(
            "cascade prefetch {}: first `getent hosts apiN.example.com` {}; the last step \
             alone (`getent hosts lastN.example.com.`) {}; ratio of the medians {:.2}, of the \
             minima {:.2}",
            if *on { "on" } else { "off" },
            summary(cascades),
            summary(alone),
            median(cascades) / median(alone),
            min(cascades) / min(alone)
        );
    }
}

/// What the prefetch costs when the pod stops early: a name that exists at the second step
/// (`web.default` → `web.default.svc.cluster.local`) leaves the two later steps unasked
/// (wasted: two extra upstream queries); one that exists at the first step (`headless` →
/// `headless.default.svc.cluster.local`) starts nothing.
#[test]
fn a_name_found_early_costs_the_steps_after_it_and_nothing_at_the_first() {
    let _turn = crate::alone();
    let Some(case) = case() else { return };
    let node = &case.node;
    for on in [true, false] {
        let agent = start(node, &case.corefile, on);
        let mode = if on { "on" } else { "off" };
        let before = case.relay.total();
        let hedged = hedges(node);
        lookup(node, "web.default");
        // A hedge that reaches the relay just after the answer it doubles looks like a fetch of
        // its own there; the agent counts it, so it is taken off.
        let late_hedges = hedges(node) - hedged;
        let second_step = case.relay.total() - before;
        let steps = cascade_of("web.default");
        let before = case.relay.total();
        lookup(node, "headless");
        let first_step = case.relay.total() - before;
        assert_eq!(
            first_step, 1,
            "prefetch {mode}: `headless` is found at once"
        );
        if on {
            let (started, used, wasted) = judged(node, Duration::from_secs(15));
            assert_eq!(
                (started, used, wasted),
                (3, 1, 2),
                "web.default: the second step used, the third and fourth wasted"
            );
            for step in &steps {
                assert_eq!(case.relay.count(step, "AAAA"), 1, "{step}");
            }
            assert_eq!(second_step, 4, "two extra upstream queries");
        } else {
            assert!(
                (2..=2 + late_hedges).contains(&second_step),
                "off: the pod's two steps only ({second_step} fetches, {late_hedges} hedges)"
            );
            assert_eq!(cascade(node, "started"), 0);
        }
        println!(
            "cascade prefetch {mode}: `getent hosts web.default` (found at the second step) \
             sent {second_step} upstream queries; `getent hosts headless` (found at the first) \
             {first_step}"
        );
        drop(agent);
    }
}
