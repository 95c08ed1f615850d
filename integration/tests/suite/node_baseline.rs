//! The simulated node without nodedns: pods resolve through kube-proxy's DNAT to CoreDNS, and
//! conntrack records every query. Without this baseline, the zero conntrack count the other
//! node tests assert would prove nothing.

use nodedns_integration::node::{self, Node, NodeOptions, ProxyMode};

const NAMES: [&str; 3] = ["kubernetes.default", "web.default", "kube-dns.kube-system"];

fn baseline(options: NodeOptions) {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(options).expect("simulated node");
    assert!(node.pod_dns_flows("udp").unwrap().is_empty());
    let before = node.coredns().queries().unwrap();

    node.resolve_all(&NAMES)
        .expect("the pod resolves through the DNAT");

    let flows = node.pod_dns_flows("udp").unwrap();
    assert!(
        !flows.is_empty(),
        "the pod's UDP/53 queries must be conntracked without nodedns"
    );
    assert!(
        node.coredns().queries().unwrap() > before,
        "CoreDNS itself answered"
    );
    assert!(!node.has_link("nodelocaldns"));
    assert_eq!(node.dns_cache_rules().unwrap(), Vec::<String>::new());
}

#[test]
fn without_nodedns_pods_resolve_through_the_dnat_and_conntrack_sees_it() {
    let _turn = crate::shared();
    baseline(NodeOptions::default());
}

#[test]
fn without_nodedns_the_nftables_kube_proxy_dnat_is_conntracked_too() {
    let _turn = crate::shared();
    baseline(NodeOptions {
        proxy: ProxyMode::Nftables,
        dual_stack: false,
    });
}

#[test]
fn without_nodedns_ipv6_queries_are_conntracked_on_a_dual_stack_node() {
    let _turn = crate::shared();
    baseline(NodeOptions {
        proxy: ProxyMode::Iptables,
        dual_stack: true,
    });
}
