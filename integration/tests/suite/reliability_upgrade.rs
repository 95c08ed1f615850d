//! Zero-gap upgrades (`--handoff-dir`): a second instance takes the listening sockets over from
//! the first while a client sends thousands of queries a second, and no query is lost; the
//! first exits without touching the host; a second instance that exits hands the sockets back,
//! one that dies has them taken back. On a simulated node, the rules and the link outlive the
//! first instance and go with the last.
//!
//! Real parts: the `nodedns` binary (two processes), Knot as the upstream, kernel sockets; on
//! the node, network namespaces, iptables rules and `dig` in the pod.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use nix::sys::signal::Signal;
use nodedns_integration::node::{self, KUBE_DNS, Node, NodeOptions, PodLoad};
use nodedns_integration::{PROBE_NAME, Process, TempDir, client, knot};

use crate::reliability_support::{
    self, Load, Query, Report, free_addr, runtime, spawn_agent, wait_for_line,
};

pub(crate) const TOOK_OVER: &str = "took the listening sockets over";
pub(crate) const HANDED_OVER: &str = "handed the listening sockets over";
pub(crate) const RESUMED: &str = "serving the listening sockets again";
pub(crate) const NOT_LAST: &str = "another instance serves: leaving the host networking in place";

/// Names of Knot's `cluster.local` zone (cached after their first miss), and for one query in
/// five a name never asked before (a miss that goes to Knot, which answers NXDOMAIN): the
/// hand-over happens with misses in flight.
fn mixed(tag: &'static str) -> Arc<dyn Fn(u64) -> Query + Send + Sync> {
    const HOT: &[(&str, RecordType)] = &[
        ("kubernetes.default.svc.cluster.local.", RecordType::A),
        ("kubernetes.default.svc.cluster.local.", RecordType::AAAA),
        ("web.default.svc.cluster.local.", RecordType::A),
        ("web.default.svc.cluster.local.", RecordType::AAAA),
        ("headless.default.svc.cluster.local.", RecordType::A),
        ("kube-dns.kube-system.svc.cluster.local.", RecordType::A),
        ("pod-0.headless.default.svc.cluster.local.", RecordType::A),
        ("nothere.default.svc.cluster.local.", RecordType::A),
    ];
    Arc::new(move |n| {
        if n % 5 == 4 {
            (format!("u{n}.{tag}.cluster.local."), RecordType::A)
        } else {
            let (name, rtype) = HOT[(n as usize) % HOT.len()];
            (name.to_owned(), rtype)
        }
    })
}

/// Starts `nodedns` on `listen` and returns once it answers there. (The first instance only:
/// a second one on the same address is "answering" as soon as the first is.)
pub(crate) fn start_first(
    listen: SocketAddr,
    upstream: SocketAddr,
    extra: &[&str],
) -> anyhow::Result<Process> {
    let mut process = spawn_agent("nodedns-a", listen, &[upstream], extra)?;
    let probe = client::query(PROBE_NAME, RecordType::A);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = process.exited() {
            anyhow::bail!("nodedns exited: {status}\n{}", process.output());
        }
        if client::udp_blocking(listen, &probe, Duration::from_millis(200)).is_ok() {
            return Ok(process);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("nodedns not answering:\n{}", process.output());
        }
    }
}

pub(crate) fn handoff_args(dir: &TempDir) -> Vec<String> {
    vec![
        "--handoff-dir".to_owned(),
        dir.path().display().to_string(),
        "--threads".to_owned(),
        "2".to_owned(),
    ]
}

fn assert_nothing_lost(what: &str, report: &Report, expected: u64) {
    eprintln!("{what}: {report:?}");
    assert!(
        report.sent >= expected * 98 / 100,
        "{what}: the load itself fell behind: {report:?}"
    );
    assert_eq!(
        (report.lost, report.servfail, report.wrong),
        (0, 0, 0),
        "{what}: every query answered in time: {report:#?}"
    );
}

#[test]
fn an_upgrade_under_5000_queries_a_second_loses_none() {
    let _turn = crate::alone();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-handoff").unwrap();
    let args = handoff_args(&dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let listen = free_addr();
    let mut a = start_first(listen, knot.addr(), &args).expect("instance A starts");

    let runtime = runtime();
    let started = Instant::now();
    let load = Load {
        target: listen,
        qps: 5000,
        duration: Duration::from_secs(20),
        sockets: 16,
        deadline: Duration::from_secs(2),
        query: mixed("upgrade"),
    };
    let udp = runtime.spawn(load.run());
    // One query per new TCP connection alongside, 100 a second.
    let tcp = runtime.spawn(reliability_support::tcp_load(
        listen,
        100,
        Duration::from_secs(20),
        Duration::from_secs(2),
        mixed("upgrade-tcp"),
    ));

    // A DaemonSet rollout with maxSurge: B starts beside A at 5 s...
    std::thread::sleep(Duration::from_secs(5));
    let mut b = spawn_agent("nodedns-b", listen, &[knot.addr()], &args).expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    wait_for_line("A", Duration::from_secs(5), || a.output(), HANDED_OVER).unwrap();
    // ...and A gets SIGTERM at 10 s, while B serves.
    std::thread::sleep(Duration::from_secs(10).saturating_sub(started.elapsed()));
    a.signal(Signal::SIGTERM).unwrap();
    let status = a.wait_timeout(Duration::from_secs(10)).expect("A exits");
    assert!(status.success(), "A exits 0: {status}\n{}", a.output());
    assert!(a.output().contains(NOT_LAST), "{}", a.output());
    assert!(b.exited().is_none(), "B still runs:\n{}", b.output());

    let udp = runtime.block_on(udp).unwrap();
    let tcp = runtime.block_on(tcp).unwrap();
    assert_nothing_lost("UDP", &udp, 100_000);
    assert_nothing_lost("TCP", &tcp, 2_000);
    // B serves on after the load, and exits 0 as the last instance.
    let reply = client::udp_blocking(
        listen,
        &client::query("web.default.svc.cluster.local.", RecordType::A),
        Duration::from_secs(2),
    )
    .expect("B answers");
    assert_eq!(client::a_addrs(&reply).len(), 1);
    let status = b.stop().expect("B exits");
    assert!(status.success(), "{status}\n{}", b.output());
    assert!(
        !b.output().contains(NOT_LAST),
        "B was the last:\n{}",
        b.output()
    );
}

#[test]
fn a_new_instance_that_exits_first_hands_the_sockets_back() {
    let _turn = crate::alone();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-handoff").unwrap();
    let args = handoff_args(&dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let listen = free_addr();
    let mut a = start_first(listen, knot.addr(), &args).expect("instance A starts");
    let mut b = spawn_agent("nodedns-b", listen, &[knot.addr()], &args).expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();

    // A rollback, or the new pod deleted first: B exits while A idles.
    let runtime = runtime();
    let load = Load {
        target: listen,
        qps: 2000,
        duration: Duration::from_secs(6),
        sockets: 8,
        deadline: Duration::from_secs(2),
        query: mixed("handback"),
    };
    let running = runtime.spawn(load.run());
    std::thread::sleep(Duration::from_secs(2));
    b.signal(Signal::SIGTERM).unwrap();
    let status = b.wait_timeout(Duration::from_secs(10)).expect("B exits");
    assert!(status.success(), "{status}\n{}", b.output());
    assert!(b.output().contains(NOT_LAST), "{}", b.output());
    wait_for_line("A", Duration::from_secs(5), || a.output(), RESUMED).unwrap();
    let report = runtime.block_on(running).unwrap();
    assert_nothing_lost("hand-back", &report, 12_000);

    // A serves, and is the last: it exits 0 without deferring to anyone.
    let status = a.stop().expect("A exits");
    assert!(status.success());
    let after_resume = a
        .output()
        .split(RESUMED)
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    assert!(
        !after_resume.contains(NOT_LAST),
        "A was the last:\n{}",
        a.output()
    );
}

#[test]
fn when_the_new_instance_dies_the_old_one_serves_again_and_hands_over_again() {
    let _turn = crate::alone();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-handoff").unwrap();
    let args = handoff_args(&dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let listen = free_addr();
    let mut a = start_first(listen, knot.addr(), &args).expect("instance A starts");
    let mut b = spawn_agent("nodedns-b", listen, &[knot.addr()], &args).expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();

    // B is killed outright (OOM, a node problem): A notices and serves the sockets it kept.
    b.signal(Signal::SIGKILL).unwrap();
    b.wait_timeout(Duration::from_secs(5)).expect("B dies");
    wait_for_line("A", Duration::from_secs(5), || a.output(), RESUMED).unwrap();
    let runtime = runtime();
    let load = Load {
        target: listen,
        qps: 2000,
        duration: Duration::from_secs(3),
        sockets: 8,
        deadline: Duration::from_secs(2),
        query: mixed("after-crash"),
    };
    let report = runtime.block_on(load.run());
    assert_nothing_lost("after B died", &report, 6_000);

    // The restarted B (the kubelet restarts it) takes over from A again.
    let mut c = spawn_agent("nodedns-c", listen, &[knot.addr()], &args).expect("instance C spawns");
    wait_for_line("C", Duration::from_secs(15), || c.output(), TOOK_OVER).unwrap();
    // A handed over twice (its log line comes once it stopped reading).
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.output().matches(HANDED_OVER).count() < 2 {
        assert!(
            Instant::now() < deadline,
            "A handed over twice:\n{}",
            a.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = a.stop().expect("A exits");
    assert!(status.success());
    let status = c.stop().expect("C exits");
    assert!(status.success());
}

fn sorted(mut rules: Vec<String>) -> Vec<String> {
    rules.sort();
    rules
}

#[test]
fn on_a_node_the_rules_and_link_outlive_the_old_instance_and_go_with_the_last() {
    let _turn = crate::alone();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let dir = TempDir::new("nodedns-handoff").unwrap();
    let handoff = dir.path().display().to_string();
    let args = ["--handoff-dir", handoff.as_str()];
    let mut a = node.start_nodedns(&args).expect("instance A starts");
    let rules = sorted(node.dns_cache_rules().unwrap());
    assert!(!rules.is_empty() && node.has_link("nodelocaldns"));

    let pod_load = PodLoad::start(&node, KUBE_DNS.into(), 1, 2, dir.path());
    // B starts beside A (start_nodedns returns at once: A answers), and takes over.
    let mut b = node.start_nodedns(&args).expect("instance B starts");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let status = a.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}\n{}", a.output());
    assert!(a.output().contains(NOT_LAST), "{}", a.output());
    // After A is gone, and after B's reconcile loop ran (1 s) more than once: all in place.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(sorted(node.dns_cache_rules().unwrap()), rules);
    assert!(node.has_link("nodelocaldns"));
    let load = pod_load.finish();
    assert!(load.sent >= 400, "the pod's load ran: {load:?}");
    assert_eq!(load.failed, 0, "of the queries from the pod: {load:#?}");
    node.resolve_all(&["kubernetes.default", "web"])
        .expect("pods resolve through B");

    // B is the last instance: it withdraws and tears down.
    let status = b.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}\n{}", b.output());
    assert!(!b.output().contains(NOT_LAST), "{}", b.output());
    assert_eq!(node.dns_cache_rules().unwrap(), Vec::<String>::new());
    assert!(!node.has_link("nodelocaldns"));
}
