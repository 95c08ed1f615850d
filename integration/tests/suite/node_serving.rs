//! nodedns on a simulated node: pods keep their resolv.conf (the kube-dns ClusterIP) and their
//! queries are answered by nodedns without touching conntrack, while nodedns reaches CoreDNS
//! over a handful of TCP connections. Same on an nftables kube-proxy node, in ipvs mode (pods
//! use the link-local address) and on a dual-stack node (over IPv6). Its IPv4 answers are atomic
//! datagrams (DF set, ID 0), and one too large for the pod's link still arrives, in fragments.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

use nodedns_integration::node::{self, KUBE_DNS, LOCAL_IP, Node, NodeOptions, ProxyMode};

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

/// The pod's counters of IPv4 UDP packets that arrive as atomic datagrams (RFC 6864: DF set,
/// ID 0) and of fragments, taken in prerouting before any reassembly. (The kernel's default
/// sets DF too, but with an ID from its shared table.)
const FRAGMENT_COUNTERS: &str = "table ip pod_fragments {
    counter atomic {}
    counter fragment {}
    chain prerouting {
        type filter hook prerouting priority -450; policy accept;
        ip protocol udp ip frag-off & 0x4000 != 0 ip id 0 counter name \"atomic\"
        ip frag-off & 0x3fff != 0 counter name \"fragment\"
    }
}
";

/// Packets counted so far by the pod's counter `name` ([`FRAGMENT_COUNTERS`]).
fn pod_packets(node: &Node, name: &str) -> u64 {
    let listing = node
        .pod
        .run("nft", &["list", "counter", "ip", "pod_fragments", name])
        .unwrap();
    listing
        .split_whitespace()
        .skip_while(|word| *word != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no packet count in {listing}"))
}

/// The A records of `name` that a pod's `dig` (EDNS, 1,232 bytes, no retry over TCP) gets.
fn pod_a_records(node: &Node, name: &str) -> usize {
    let out = node
        .pod
        .run(
            "dig",
            &[
                &format!("@{KUBE_DNS}"),
                "+bufsize=1232",
                "+ignore",
                "+tries=1",
                "+time=2",
                "+noall",
                "+answer",
                name,
                "A",
            ],
        )
        .unwrap_or_else(|err| panic!("{name}: {err:#}"));
    out.lines()
        .filter(|line| line.split_whitespace().nth(3) == Some("A"))
        .count()
}

#[test]
fn udp_answers_are_atomic_datagrams_and_one_too_large_for_the_link_goes_in_fragments() {
    let _turn = crate::shared();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    // 60 addresses each: answers of about 1,030 bytes, within the 1,232 a UDP answer may take.
    let mut records = String::new();
    for service in ["sixty", "sixty-more"] {
        for i in 0..60u8 {
            let _ = writeln!(
                records,
                "{service}.default.svc 30 IN A {}",
                Ipv4Addr::new(10, 200, 0, i + 1)
            );
        }
    }
    let zones = Node::standard_zones_with(&records);
    let node = Node::build_serving(NodeOptions::default(), zones).expect("simulated node");
    let agent = node.start_nodedns(&[]).expect("nodedns starts");
    node.pod
        .run_stdin("nft", &["-f", "-"], FRAGMENT_COUNTERS)
        .unwrap();

    // On the pod's 1,500-byte link, the answer leaves whole, with DF and ID 0.
    assert_eq!(pod_a_records(&node, "sixty.default.svc.cluster.local"), 60);
    assert!(
        pod_packets(&node, "atomic") >= 1,
        "the answer was an atomic datagram"
    );
    assert_eq!(pod_packets(&node, "fragment"), 0);

    // A link of 576 bytes cannot carry it with DF: the kernel refuses it, and nodedns sends it
    // again in fragments. Once from the cache, once from the upstream (a miss: its answer goes
    // out through the worker's batch of answers).
    node.node
        .run("ip", &["link", "set", "vp", "mtu", "576"])
        .unwrap();
    assert_eq!(pod_a_records(&node, "sixty.default.svc.cluster.local"), 60);
    let fragments = pod_packets(&node, "fragment");
    assert!(
        fragments >= 2,
        "{fragments} fragments: the answer came in pieces"
    );
    assert_eq!(
        pod_a_records(&node, "sixty-more.default.svc.cluster.local"),
        60
    );
    let more = pod_packets(&node, "fragment") - fragments;
    assert!(
        more >= 2,
        "{more} fragments: the upstream's answer came in pieces"
    );
    drop(agent);
}
