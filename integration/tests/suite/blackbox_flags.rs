//! node-cache's flags, seen from outside: `-quiet` leaves out the start-up listing and nothing
//! else; with `-reloadwithsignal` and no `reload` directive, a Corefile edit applies (nodedns
//! applies every edit anyway); `forward . FILE` reads the file the Corefile names, not
//! `--resolv-conf`, and follows it when it changes; `-pidfile` is written once serving and
//! removed at exit, as CoreDNS does; `-metrics-listen-address` (node-cache's 0.0.0.0:9353 by
//! default) serves the metrics beside the Corefile's `prometheus` port, as node-cache does.

use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use nodedns_integration::{Agent, TempDir, knot};

use crate::stock_node::{
    self, FROM_NODE_RESOLVER, FROM_SPARE_RESOLVER, KUBE_DNS, LOCAL, METRICS, NODE_RESOLVER,
    SPARE_RESOLVER, StockNode, a_answer,
};

const LISTING: &str = "serving DNS (UDP, TCP)";

/// Polls `output` until it contains `needle`, for up to 10 s.
fn wait_for_output(output: impl Fn() -> String, needle: &str) -> bool {
    wait_for(|| output().contains(needle))
}

/// Polls `done` until it holds, for up to 10 s.
fn wait_for(done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn quiet_leaves_out_the_listing_of_what_is_served_and_nothing_else() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let loud = Agent::start(&[knot.addr()]).expect("nodedns starts");
    let quiet = Agent::start_with(&[knot.addr()], &["-quiet"]).expect("nodedns -quiet starts");
    // Both answer (start_with returns once they do) and both come to readiness.
    for agent in [&loud, &quiet] {
        assert!(
            wait_for_output(|| agent.output(), "ready"),
            "{}",
            agent.output()
        );
    }
    assert!(loud.output().contains(LISTING), "{}", loud.output());
    assert!(!quiet.output().contains(LISTING), "{}", quiet.output());
    assert!(
        !quiet.output().contains("serving /health"),
        "{}",
        quiet.output()
    );
}

#[test]
fn pidfile_holds_the_pid_once_serving_and_is_removed_at_exit() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-pidfile").unwrap();
    let path = dir.path().join("node-cache.pid");
    // node-cache's spelling, as the stock DaemonSet passes it.
    let agent = Agent::start_with(&[knot.addr()], &["-pidfile", path.to_str().unwrap()])
        .expect("nodedns starts");
    let want = format!("{}\n", agent.pid());
    assert!(
        wait_for(|| std::fs::read_to_string(&path).is_ok_and(|text| text == want)),
        "{:?} does not hold {want:?}\n{}",
        std::fs::read_to_string(&path),
        agent.output()
    );
    let status = agent.stop().expect("nodedns exits");
    assert!(status.success(), "{status}");
    assert!(!path.exists(), "the pidfile outlives the agent");
}

#[test]
fn node_caches_metrics_address_serves_the_metrics_beside_prometheus() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    // The stock Corefile has `prometheus :9253`; the DaemonSet passes no
    // -metrics-listen-address, so node-cache's default 0.0.0.0:9353 (what Gardener scrapes).
    let node = StockNode::start(&stock_node::stock_corefile()).expect("node starts");
    let node_cache = std::net::SocketAddr::from(([127, 0, 0, 1], 9353));
    assert_eq!(example_a(&node), Ok(vec![FROM_NODE_RESOLVER]));
    let families = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("# TYPE "))
            .map(str::to_owned)
            .collect()
    };
    // The A queries (only this test asks them; the loop check's probes are HINFO).
    let requests = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("coredns_dns_requests_total{") && l.contains("type=\"A\""))
            .map(str::to_owned)
            .collect()
    };
    let prometheus = node.http_get(METRICS, "/metrics").unwrap();
    let beside = node
        .http_get(node_cache, "/metrics")
        .unwrap_or_else(|e| panic!("{e}\n{}", node.output()));
    assert!(
        beside.contains("coredns_nodecache_setup_errors_total{errortype=\"configmap\"} 0"),
        "{beside}"
    );
    assert_eq!(families(&beside), families(&prometheus), "the same metrics");
    assert!(!requests(&beside).is_empty(), "{beside}");
    assert_eq!(requests(&beside), requests(&prometheus), "the same counts");
    // Only the metrics there, as node-cache's listener serves only /metrics.
    for path in ["/health", "/ready"] {
        let err = node.http_get(node_cache, path).unwrap_err().to_string();
        assert!(err.contains(" 404 "), "{path}: {err}");
    }
}

/// `www.example.` A as the node's pods see it.
fn example_a(node: &StockNode) -> Result<Vec<std::net::Ipv4Addr>, String> {
    a_answer(&node.ask(LOCAL.into(), "www.example.", RecordType::A))
}

fn wait_for_answer(node: &StockNode, want: std::net::Ipv4Addr) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = example_a(node);
        if got == Ok(vec![want]) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("still {got:?}, not {want}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn forward_reads_the_file_the_corefile_names_and_edits_apply_without_reload() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = TempDir::new("nodedns-forward-file").unwrap();
    let named = dir.path().join("resolv.conf");
    std::fs::write(&named, format!("nameserver {SPARE_RESOLVER}\n")).unwrap();
    // No `reload`, no `cache`: every query goes to the file's server. The DaemonSet's
    // --resolv-conf names the node's resolver, which must not be asked.
    let corefile =
        |to: &str| format!(".:53 {{\n    bind {LOCAL} {KUBE_DNS}\n    forward . {to}\n}}\n");
    let mut node = StockNode::start_with(
        &corefile(&named.display().to_string()),
        &["-reloadwithsignal"],
    )
    .expect("node starts");
    assert_eq!(example_a(&node), Ok(vec![FROM_SPARE_RESOLVER]));
    let asked_before = stock_node::queries(&node.resolver, "A");

    // The named file changes (as the kubelet's copy of the node's resolv.conf may): followed.
    std::fs::write(&named, format!("nameserver {NODE_RESOLVER}\n")).unwrap();
    wait_for_answer(&node, FROM_NODE_RESOLVER).unwrap_or_else(|e| panic!("{e}\n{}", node.output()));
    assert!(stock_node::queries(&node.resolver, "A") > asked_before);

    // A Corefile edit applies without a `reload` directive (-reloadwithsignal's point).
    node.write_corefile(&corefile(&SPARE_RESOLVER.to_string()))
        .unwrap();
    wait_for_answer(&node, FROM_SPARE_RESOLVER)
        .unwrap_or_else(|e| panic!("{e}\n{}", node.output()));
    assert!(node.alive());
}
