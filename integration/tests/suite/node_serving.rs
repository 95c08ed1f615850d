//! nodedns on a simulated node: pods keep their resolv.conf (the kube-dns ClusterIP) and their
//! queries are answered by nodedns without touching conntrack, while nodedns reaches CoreDNS
//! over a handful of TCP connections. Same on an nftables kube-proxy node, in ipvs mode (pods
//! use the link-local address) and on a dual-stack node (over IPv6).

use std::net::IpAddr;

use nodedns_integration::node::{self, LOCAL_IP, Node, NodeOptions, ProxyMode};

/// Names a pod looks up, as short names expanded through the search list (ndots:5): each
/// lookup is several queries (AAAA and A, NXDOMAIN for the first search suffixes).
const NAMES: [&str; 5] = [
    "kubernetes.default",
    "web.default",
    "kube-dns.kube-system",
    "headless.default",
    "pod-0.headless.default",
];
const LOOKUPS: usize = 1000;
/// "A handful": nodedns's connections to CoreDNS, whatever the query count.
const MAX_UPSTREAM_FLOWS: usize = 8;

fn serves_pods_untracked(options: NodeOptions, backend: &str) {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(options).expect("simulated node");
    let agent = node
        .start_nodedns(&["--rules-backend", backend])
        .expect("nodedns starts");

    // The rules are where the backend says, named after nodedns.
    let nft = node.nodedns_nft_table().unwrap();
    let iptables = node.dns_cache_rules().unwrap();
    let nftables =
        backend == "nftables" || (backend == "auto" && options.proxy == ProxyMode::Nftables);
    match nftables {
        true => {
            let table = nft.expect("table inet nodedns");
            assert!(
                table.contains("notrack comment \"nodedns: skip conntrack\""),
                "{table}"
            );
            assert!(
                iptables.iter().all(|l| l.starts_with("nft: ")),
                "{iptables:#?}"
            );
        }
        false => {
            assert!(nft.is_none(), "no nft table with the iptables backend");
            assert!(
                iptables.iter().any(|l| l.contains("-j NODEDNS-PREROUTING")),
                "{iptables:#?}"
            );
        }
    }

    node.conntrack_flush().unwrap();
    let before = node.coredns().queries().unwrap();
    let before_tcp = node.coredns().tcp_queries().unwrap();

    // Both addresses pods may use are answered.
    let expected = "10.96.0.1";
    let nameserver = node.pod_nameserver();
    assert_eq!(
        node.dig_from_pod(nameserver, "kubernetes.default.svc.cluster.local.", "A")
            .unwrap(),
        expected
    );
    assert_eq!(
        node.dig_from_pod(
            IpAddr::V4(LOCAL_IP),
            "kubernetes.default.svc.cluster.local.",
            "A"
        )
        .unwrap(),
        expected
    );

    // 1000 lookups through glibc's resolver.
    let names: Vec<&str> = NAMES.iter().copied().cycle().take(LOOKUPS).collect();
    for batch in names.chunks(100) {
        node.resolve_all(batch).expect("every lookup resolves");
    }

    let flows = node.pod_dns_flows("udp").unwrap();
    assert!(
        flows.is_empty(),
        "pod DNS traffic must not be conntracked: {flows:#?}"
    );
    assert!(node.pod_dns_flows("tcp").unwrap().is_empty());
    let upstream = node.node_upstream_tcp_flows().unwrap();
    assert!(
        !upstream.is_empty() && upstream.len() <= MAX_UPSTREAM_FLOWS,
        "nodedns reaches CoreDNS over a handful of TCP flows: {upstream:#?}"
    );
    // CoreDNS saw only TCP from nodedns, and only the cache misses.
    let queries = node.coredns().queries().unwrap() - before;
    let tcp = node.coredns().tcp_queries().unwrap() - before_tcp;
    assert_eq!(queries, tcp, "no UDP query reached CoreDNS");
    assert!(
        queries < 100,
        "{queries} upstream queries for {LOOKUPS} lookups: the cache answers the rest"
    );
    drop(agent);
}

#[test]
fn iptables_backend_answers_pods_without_conntrack() {
    let _turn = crate::shared();
    serves_pods_untracked(NodeOptions::default(), "iptables");
}

#[test]
fn nftables_backend_answers_pods_without_conntrack() {
    let _turn = crate::shared();
    serves_pods_untracked(
        NodeOptions {
            proxy: ProxyMode::Nftables,
            dual_stack: false,
        },
        "nftables",
    );
}

#[test]
fn auto_backend_on_an_nftables_kube_proxy_node_picks_nftables() {
    let _turn = crate::shared();
    serves_pods_untracked(
        NodeOptions {
            proxy: ProxyMode::Nftables,
            dual_stack: false,
        },
        "auto",
    );
}

#[test]
fn ipvs_mode_serves_the_link_local_address_only() {
    let _turn = crate::shared();
    serves_pods_untracked(
        NodeOptions {
            proxy: ProxyMode::Ipvs,
            dual_stack: false,
        },
        "iptables",
    );
}

#[test]
fn dual_stack_node_answers_pods_over_ipv6_without_conntrack() {
    let _turn = crate::shared();
    for backend in ["iptables", "nftables"] {
        serves_pods_untracked(
            NodeOptions {
                proxy: ProxyMode::Iptables,
                dual_stack: true,
            },
            backend,
        );
    }
}
