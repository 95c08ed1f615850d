//! SIGTERM: nodedns withdraws the ClusterIP rules first (new queries go through kube-proxy to
//! CoreDNS), keeps answering what already arrived, then removes the remaining rules and the
//! link. A lookup loop in the pod runs through the whole switch, with one try per query and a
//! 1 s timeout, so a single lost query would fail a lookup.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nodedns_integration::node::{self, Node, NodeOptions, ProxyMode, wait_for};

/// One lookup: when it started, whether it resolved, what getent said.
type Lookup = (Instant, bool, String);

/// Looks up a name in the pod, one getent run after the other, until `stop`.
fn lookup_loop(node: &Node, stop: &AtomicBool, done: &Mutex<Vec<Lookup>>) {
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let (ok, said) = match node.getent(&["kubernetes.default"]) {
            Ok(out) => (
                out.status.success(),
                format!(
                    "{} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout).trim()
                ),
            ),
            Err(e) => (false, format!("{e:#}")),
        };
        done.lock().unwrap().push((started, ok, said));
    }
}

/// Lookups that started at or after `since`.
fn started_since(done: &Mutex<Vec<Lookup>>, since: Instant) -> usize {
    done.lock().unwrap().iter().filter(|l| l.0 >= since).count()
}

fn shutdown_never_fails_a_lookup(options: NodeOptions, backend: &str) {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(options).expect("simulated node");
    node.set_pod_resolver_options("timeout:1 attempts:1")
        .unwrap();
    let mut agent = node
        .start_nodedns(&["--rules-backend", backend])
        .expect("nodedns starts");
    assert!(node.has_link("nodelocaldns"));
    assert!(!node.dns_cache_rules().unwrap().is_empty());

    let stop = AtomicBool::new(false);
    let done = Mutex::new(Vec::new());
    let limit = Duration::from_secs(30);
    let (signalled, exited) = std::thread::scope(|scope| {
        let looping = scope.spawn(|| lookup_loop(&node, &stop, &done));
        let started = Instant::now();
        // The loop runs against nodedns first...
        let warm = wait_for("lookups before SIGTERM", limit, || {
            started_since(&done, started) >= 10
        });
        let signalled = Instant::now();
        let status = warm.and_then(|()| agent.terminate(Duration::from_secs(15)));
        let exited = Instant::now();
        // ...and keeps running after nodedns is gone, through the DNAT.
        let after = wait_for("lookups after exit", limit, || {
            started_since(&done, exited) >= 10
        });
        stop.store(true, Ordering::Relaxed);
        looping.join().expect("lookup loop");
        let status = status.expect("nodedns exits after SIGTERM");
        assert!(status.success(), "nodedns exit status {status}");
        after.unwrap();
        (signalled, exited)
    });

    let lookups = done.into_inner().unwrap();
    let before = lookups.iter().filter(|l| l.0 < signalled).count();
    let during = lookups
        .iter()
        .filter(|l| l.0 >= signalled && l.0 < exited)
        .count();
    let after = lookups.iter().filter(|l| l.0 >= exited).count();
    eprintln!("lookups: {before} before SIGTERM, {during} during shutdown, {after} after exit");
    let failed: Vec<&Lookup> = lookups.iter().filter(|l| !l.1).collect();
    assert!(
        failed.is_empty(),
        "{} of {} lookups failed ({before} before SIGTERM, {during} during shutdown, {after} after): {failed:#?}",
        failed.len(),
        lookups.len()
    );

    assert!(!node.has_link("nodelocaldns"), "the link is removed");
    assert_eq!(
        node.dns_cache_rules().unwrap(),
        Vec::<String>::new(),
        "every rule is removed"
    );
    // What answers now is CoreDNS, through the DNAT, conntracked as before nodedns.
    node.conntrack_flush().unwrap();
    let queries = node.coredns().queries().unwrap();
    node.resolve_all(&["kubernetes.default", "web.default"])
        .unwrap();
    assert!(node.coredns().queries().unwrap() > queries);
    assert!(!node.pod_dns_flows("udp").unwrap().is_empty());
}

#[test]
fn sigterm_with_iptables_backend_hands_pods_back_to_coredns_without_a_failed_lookup() {
    let _turn = crate::shared();
    shutdown_never_fails_a_lookup(NodeOptions::default(), "iptables");
}

#[test]
fn sigterm_with_nftables_backend_hands_pods_back_to_coredns_without_a_failed_lookup() {
    let _turn = crate::shared();
    shutdown_never_fails_a_lookup(
        NodeOptions {
            proxy: ProxyMode::Nftables,
            dual_stack: false,
        },
        "nftables",
    );
}

#[test]
fn skip_teardown_leaves_the_link_and_rules_in_place() {
    let _turn = crate::shared();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let mut agent = node
        .start_nodedns(&["--rules-backend", "iptables", "--skip-teardown"])
        .expect("nodedns starts");
    let rules = node.dns_cache_rules().unwrap();
    let status = agent.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}");
    assert!(node.has_link("nodelocaldns"));
    assert_eq!(node.dns_cache_rules().unwrap(), rules);
    // A later run (here: with teardown) takes them over and removes them.
    let mut again = node
        .start_nodedns(&["--rules-backend", "iptables"])
        .expect("nodedns starts over its leftovers");
    assert_eq!(node.dns_cache_rules().unwrap(), rules, "no duplicates");
    again.terminate(Duration::from_secs(15)).unwrap();
    assert!(!node.has_link("nodelocaldns"));
    assert_eq!(node.dns_cache_rules().unwrap(), Vec::<String>::new());
}
