//! Reconcile (`--sync-interval 1s` here): whatever disappears or moves is put back within the
//! interval: a deleted rule, a rule inserted above our jump, the whole nft table, the link.

use std::time::Duration;

use nodedns_integration::node::{self, Node, NodeOptions, wait_for};

/// The interval is 1 s; allow a few for a loaded machine.
const WITHIN: Duration = Duration::from_secs(5);

/// Where the agent serves /metrics, inside the node namespace.
const METRICS: &str = "127.0.0.1:9353";

const OUR_RULE: &str = "-d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"nodedns: skip conntrack\" -j NOTRACK";

fn raw_prerouting(node: &Node) -> Vec<String> {
    node.node
        .run("iptables", &["-t", "raw", "-S", "PREROUTING"])
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("-A "))
        .map(str::to_owned)
        .collect()
}

fn skip_unless_available() -> bool {
    match node::unavailable() {
        Some(reason) => {
            eprintln!("skipped: {reason}");
            false
        }
        None => true,
    }
}

#[test]
fn iptables_rules_deleted_or_outranked_are_restored_within_the_interval() {
    let _turn = crate::shared();
    if !skip_unless_available() {
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let _agent = node
        .start_nodedns(&[
            "--rules-backend",
            "iptables",
            "--metrics-listen-address",
            METRICS,
        ])
        .expect("nodedns starts");
    let rules = node.dns_cache_rules().unwrap();

    // One of our rules deleted.
    let args: Vec<&str> = ["-t", "raw", "-D", "NODEDNS-PREROUTING"]
        .into_iter()
        .chain(shell_words(OUR_RULE))
        .collect();
    node.node.run("iptables", &args).unwrap();
    assert_ne!(node.dns_cache_rules().unwrap(), rules);
    wait_for("the deleted rule is restored", WITHIN, || {
        node.dns_cache_rules().unwrap() == rules
    })
    .unwrap();

    // A rule inserted above our jump (ACCEPT ends the raw table: our NOTRACK would be skipped).
    node.node
        .run(
            "iptables",
            &["-t", "raw", "-I", "PREROUTING", "1", "-j", "ACCEPT"],
        )
        .unwrap();
    assert_eq!(raw_prerouting(&node)[0], "-A PREROUTING -j ACCEPT");
    wait_for("our jump is first again", WITHIN, || {
        raw_prerouting(&node)[0].ends_with("-j NODEDNS-PREROUTING")
    })
    .unwrap();
    let chain = raw_prerouting(&node);
    assert_eq!(chain.len(), 2, "the other rule stays, below: {chain:#?}");
    assert_eq!(chain[1], "-A PREROUTING -j ACCEPT");
    assert_eq!(
        chain
            .iter()
            .filter(|l| l.ends_with("-j NODEDNS-PREROUTING"))
            .count(),
        1
    );

    // The link deleted: re-created with every address.
    node.node
        .run("ip", &["link", "del", "nodelocaldns"])
        .unwrap();
    wait_for("the link is back with its addresses", WITHIN, || {
        node.node
            .run("ip", &["-4", "addr", "show", "nodelocaldns"])
            .is_ok_and(|a| a.contains("169.254.20.10/32") && a.contains("10.96.0.10/32"))
    })
    .unwrap();
    node.resolve_all(&["kubernetes.default"]).unwrap();

    // Each repair is counted by kind as it is made; nothing failed. A pass is counted once it is
    // over, and the one that put the link back may still be checking the rules: waited for.
    let repaired = "nodedns_hostnet_reconcile_total{result=\"repaired\"}";
    let mut metrics = String::new();
    wait_for("three repairing passes counted", WITHIN, || {
        metrics = node.http_get(METRICS.parse().unwrap(), "/metrics").unwrap();
        counter(&metrics, repaired) >= 3
    })
    .unwrap_or_else(|e| panic!("{e}: {metrics}"));
    for what in ["rules", "jump", "link", "address"] {
        assert!(
            counter(
                &metrics,
                &format!("nodedns_hostnet_repairs_total{{what=\"{what}\"}}")
            ) >= 1,
            "{what}: {metrics}"
        );
    }
    for errortype in [
        "iptables",
        "iptables_lock",
        "interface_add",
        "interface_check",
    ] {
        let series = format!("coredns_nodecache_setup_errors_total{{errortype=\"{errortype}\"}}");
        assert_eq!(counter(&metrics, &series), 0, "{series}");
    }
}

/// The value of one series in Prometheus text output; panics if the series is absent.
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in:\n{metrics}"))
}

#[test]
fn nftables_rules_and_table_deleted_are_restored_within_the_interval() {
    let _turn = crate::shared();
    if !skip_unless_available() {
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let _agent = node
        .start_nodedns(&["--rules-backend", "nftables"])
        .expect("nodedns starts");
    let table = node
        .nodedns_nft_table()
        .unwrap()
        .expect("table inet nodedns");

    // One rule deleted, by its handle.
    let listing = node
        .node
        .run(
            "nft",
            &["-a", "list", "chain", "inet", "nodedns", "raw-prerouting"],
        )
        .unwrap();
    let handle = listing
        .lines()
        .find(|l| l.contains("ip daddr 10.96.0.10 udp dport 53"))
        .and_then(|l| l.rsplit("# handle ").next())
        .map(|h| h.trim().to_owned())
        .expect("rule handle");
    node.node
        .run(
            "nft",
            &[
                "delete",
                "rule",
                "inet",
                "nodedns",
                "raw-prerouting",
                "handle",
                &handle,
            ],
        )
        .unwrap();
    assert_ne!(node.nodedns_nft_table().unwrap().as_ref(), Some(&table));
    wait_for("the deleted rule is restored", WITHIN, || {
        node.nodedns_nft_table().unwrap().as_ref() == Some(&table)
    })
    .unwrap();

    // The whole table deleted.
    node.node
        .run("nft", &["delete", "table", "inet", "nodedns"])
        .unwrap();
    wait_for("the table is restored", WITHIN, || {
        node.nodedns_nft_table().unwrap().as_ref() == Some(&table)
    })
    .unwrap();
    node.conntrack_flush().unwrap();
    node.resolve_all(&["kubernetes.default"]).unwrap();
    assert!(node.pod_dns_flows("udp").unwrap().is_empty());
}

/// Splits a rule spec on spaces, keeping double-quoted parts whole (without the quotes).
fn shell_words(spec: &str) -> Vec<&str> {
    let mut words = Vec::new();
    let mut rest = spec.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').unwrap_or(quoted.len());
            words.push(&quoted[..end]);
            rest = quoted.get(end + 1..).unwrap_or("").trim_start();
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            words.push(&rest[..end]);
            rest = rest[end..].trim_start();
        }
    }
    words
}
