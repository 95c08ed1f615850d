//! Live reload, seen from outside, with the stock node-local-dns Corefile mounted the way the
//! kubelet mounts a ConfigMap (an atomic `..data` swap):
//!
//! - a new upstream for `.` takes effect within 2 s of the change, under load, with no failed
//!   query; the unchanged cluster zone keeps its cache (its names are not asked upstream again),
//!   and the changed `.` block starts with an empty one;
//! - a broken Corefile is rejected with its file and line, counted in
//!   `coredns_reload_failed_total` and the `configmap` setup errors, and the running
//!   configuration keeps serving; the next good one is applied, and a change that needs a restart
//!   is said to need one.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use nodedns_integration::client;

use crate::stock_node::{
    self, FROM_NODE_RESOLVER, FROM_SPARE_RESOLVER, LOCAL, SPARE_RESOLVER, StockNode, a_answer,
    queries,
};

/// The stock `.` block's forward, and what a reload turns it into.
const STOCK_FORWARD: &str = "forward . __PILLAR__UPSTREAM__SERVERS__";

fn forwarding_root_to_spare(corefile: &str) -> String {
    assert_eq!(corefile.matches(STOCK_FORWARD).count(), 1, "{corefile}");
    corefile.replace(STOCK_FORWARD, &format!("forward . {SPARE_RESOLVER}"))
}

const RELOAD_FAILED: &str = "coredns_reload_failed_total";
const CONFIGMAP_ERRORS: &str = "coredns_nodecache_setup_errors_total{errortype=\"configmap\"}";
/// Names of the cluster zone the load asks (cache hits after the warm-up).
const CLUSTER_NAMES: [(&str, Ipv4Addr); 2] = [
    (
        "kubernetes.default.svc.cluster.local.",
        Ipv4Addr::new(10, 96, 0, 1),
    ),
    (
        "web.default.svc.cluster.local.",
        Ipv4Addr::new(10, 96, 12, 34),
    ),
];

/// One query of the load: when it was sent and how it ended.
#[derive(Debug)]
struct Outcome {
    sent: Instant,
    name: String,
    answer: Result<Vec<Ipv4Addr>, String>,
}

/// A client asking nodedns without pause from inside the node until `stop`: a new `.` name each
/// time (a miss: it goes upstream), and cluster names in between (hits).
fn load(
    node: &StockNode,
    stop: Arc<AtomicBool>,
    id: usize,
) -> std::thread::JoinHandle<Vec<Outcome>> {
    stock_node::spawn_in_netns(&node.ns, move || {
        let server = std::net::SocketAddr::new(IpAddr::V4(LOCAL), 53);
        let mut out = Vec::new();
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let name = if n % 2 == 0 {
                CLUSTER_NAMES[n / 2 % 2].0.to_owned()
            } else {
                format!("load{id}-{n}.example.")
            };
            let sent = Instant::now();
            // A stub resolver's patience: an answer later than this is a failed lookup.
            let reply = client::udp_blocking(
                server,
                &client::query(&name, RecordType::A),
                Duration::from_secs(2),
            );
            out.push(Outcome {
                sent,
                name,
                answer: a_answer(&reply),
            });
        }
        out
    })
}

#[test]
fn a_new_upstream_applies_under_load_and_the_other_zones_keep_their_cache() {
    let _turn = crate::alone();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let stock = stock_node::stock_corefile();
    let mut node = StockNode::start(&stock).expect("node starts");
    let local = IpAddr::V4(LOCAL);

    // Warm the cluster zone's cache.
    for (name, addr) in CLUSTER_NAMES {
        assert_eq!(
            a_answer(&node.ask(local, name, RecordType::A)),
            Ok(vec![addr])
        );
    }
    let cluster_asked = queries(&node.cluster, "A");
    // And one `.` name, whose block the reload changes.
    let cached = "cached.example.";
    assert_eq!(
        a_answer(&node.ask(local, cached, RecordType::A)),
        Ok(vec![FROM_NODE_RESOLVER])
    );
    assert_eq!(queries(&node.spare, "A"), 0);

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..3).map(|id| load(&node, stop.clone(), id)).collect();
    // Steady state first: the load reaches the node's resolver.
    let resolver_asked = queries(&node.resolver, "A");
    let deadline = Instant::now() + Duration::from_secs(5);
    while queries(&node.resolver, "A") < resolver_asked + 50 {
        assert!(
            Instant::now() < deadline,
            "the load does not reach the resolver"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let changed = Instant::now();
    node.write_corefile(&forwarding_root_to_spare(&stock))
        .expect("write the ConfigMap");
    let mut applied = None;
    while Instant::now() < changed + Duration::from_secs(5) {
        if queries(&node.spare, "A") > 0 {
            applied = Some(changed.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let applied = applied.expect("the new upstream never got a query");
    // Keep the load on for a while under the new configuration.
    let spare_asked = queries(&node.spare, "A");
    let deadline = Instant::now() + Duration::from_secs(5);
    while queries(&node.spare, "A") < spare_asked + 50 {
        assert!(
            Instant::now() < deadline,
            "the load stopped reaching the new upstream"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let per_client: Vec<Vec<Outcome>> = clients
        .into_iter()
        .map(|c| c.join().expect("load client"))
        .collect();
    let outcomes: Vec<&Outcome> = per_client.iter().flatten().collect();

    eprintln!(
        "{} queries by {} clients; the new upstream's first query {applied:?} after the change",
        outcomes.len(),
        per_client.len()
    );
    assert!(
        applied <= Duration::from_secs(2),
        "the new upstream got its first query {applied:?} after the change"
    );
    // Each failure with when it was sent, relative to the change (negative: before).
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.answer.is_err())
        .map(|o| {
            let at = if o.sent >= changed {
                (o.sent - changed).as_secs_f64()
            } else {
                -(changed - o.sent).as_secs_f64()
            };
            format!("{at:+.3} s: {} → {:?}", o.name, o.answer)
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} queries failed across the reload: {failed:#?}",
        failed.len(),
        outcomes.len()
    );
    // The swap is atomic: once a client got an answer from the new upstream, every later `.`
    // name it asks is answered from there too.
    for client in &per_client {
        let mut switched = false;
        for o in client.iter().filter(|o| o.name.ends_with(".example.")) {
            switched |= o.answer == Ok(vec![FROM_SPARE_RESOLVER]);
            let want = if switched {
                FROM_SPARE_RESOLVER
            } else {
                FROM_NODE_RESOLVER
            };
            if o.answer != Ok(vec![FROM_SPARE_RESOLVER]) {
                assert_eq!(o.answer, Ok(vec![want]), "{o:?}");
            }
        }
        assert!(
            switched,
            "a client never got an answer from the new upstream"
        );
    }
    for o in outcomes
        .iter()
        .filter(|o| o.name.ends_with(".cluster.local."))
    {
        let want = CLUSTER_NAMES.iter().find(|(n, _)| *n == o.name).unwrap().1;
        assert_eq!(o.answer, Ok(vec![want]), "{o:?}");
    }

    // The cluster zone's block did not change: its cache was kept, so neither the load's hits
    // nor a query now went upstream.
    for (name, addr) in CLUSTER_NAMES {
        assert_eq!(
            a_answer(&node.ask(local, name, RecordType::A)),
            Ok(vec![addr])
        );
    }
    assert_eq!(
        queries(&node.cluster, "A"),
        cluster_asked,
        "the cluster zone's cache was dropped by a reload that did not touch it"
    );
    // The `.` block's upstream changed: it started with an empty cache, so it does not answer
    // from what the old upstream said.
    assert_eq!(
        a_answer(&node.ask(local, cached, RecordType::A)),
        Ok(vec![FROM_SPARE_RESOLVER])
    );
    assert_eq!(node.metric(RELOAD_FAILED).unwrap(), Some(0.0));
    assert!(node.output().contains("configuration reloaded"));
    assert!(node.alive());
}

#[test]
fn a_broken_corefile_is_rejected_and_the_running_one_keeps_serving() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let stock = stock_node::stock_corefile();
    let mut node = StockNode::start(&stock).expect("node starts");
    let local = IpAddr::V4(LOCAL);
    assert_eq!(node.metric(RELOAD_FAILED).unwrap(), Some(0.0));
    assert_eq!(node.metric(CONFIGMAP_ERRORS).unwrap(), Some(0.0));

    // A new upstream for `.`, and a negative cache TTL in the same block: if any of it were
    // applied, `.` would go to the spare resolver. (`cache thirty` is not broken: a cache for
    // the zone `thirty.` only, as in CoreDNS.)
    let good = forwarding_root_to_spare(&stock);
    let cache_line = good
        .lines()
        .enumerate()
        .filter(|(_, l)| l.trim() == "cache 30")
        .map(|(i, _)| i + 1)
        .last()
        .expect("the `.` block's cache line");
    let broken: String = good
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i + 1 == cache_line {
                "    cache -30\n".to_owned()
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    node.write_corefile(&broken).expect("write the ConfigMap");

    let failed = node
        .wait_metric(RELOAD_FAILED, Duration::from_secs(5), |v| v >= 1.0)
        .unwrap();
    assert_eq!(failed, 1.0, "{}", node.output());
    assert_eq!(node.metric(CONFIGMAP_ERRORS).unwrap(), Some(1.0));
    let at = format!("Corefile.base:{cache_line}:");
    assert!(
        node.output().contains(&at),
        "the error names {at}:\n{}",
        node.output()
    );

    // Still the old configuration: `.` goes to the node's resolver.
    assert!(node.alive());
    let reply = node.ask(local, "after-broken.example.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![FROM_NODE_RESOLVER]));
    assert_eq!(queries(&node.spare, "A"), 0);

    // The next good version applies; moving the metrics port as well needs a restart, and says so.
    let good = good.replace("prometheus :9253", "prometheus :9254");
    node.write_corefile(&good).expect("write the ConfigMap");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut n = 0;
    loop {
        n += 1;
        let reply = node.ask(local, &format!("after-fix-{n}.example."), RecordType::A);
        if a_answer(&reply) == Ok(vec![FROM_SPARE_RESOLVER]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fixed Corefile was not applied"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        node.wait_output("takes effect only after a restart", Duration::from_secs(2)),
        "{}",
        node.output()
    );
    // Still served where it was bound; the failure count stands.
    assert_eq!(node.metric(RELOAD_FAILED).unwrap(), Some(1.0));
    assert!(node.alive());
}
