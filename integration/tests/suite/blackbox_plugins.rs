//! The plugins after the cache, seen from outside, on the stock node (its Knot servers for the
//! cluster DNS and the node's resolver): `hosts` answers before `forward` and its answers go
//! through the block's cache (TTLs capped by `cache 30`), falls through to the upstream for
//! names it does not know, answers NOERROR with nothing for a known name without the asked type,
//! rereads its file when it changes, and serves glibc's search-list expansions (`getent`, the
//! pod's resolv.conf); `template` answers AAAA with NODATA; `whoami` answers
//! with the client's own address and port; what no plugin takes gets SERVFAIL, as node-cache
//! gives it.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::TempDir;

use crate::stock_node::{self, FROM_NODE_RESOLVER, KUBE_DNS, LOCAL, StockNode, a_answer, queries};

/// The stock Corefile with `hosts` in the cluster.local block (a file of pod names) and in the
/// `.` block (a file and inline entries, `ttl 60`, polled every second), both with
/// `fallthrough`; and two blocks of their own: `whoami` alone on port 1053, and a block whose
/// `forward` takes only a subzone.
fn corefile(cluster_hosts: &str, node_hosts: &str) -> String {
    let stock = stock_node::stock_corefile();
    let cluster = stock.replacen(
        "    cache {\n",
        &format!("    hosts {cluster_hosts} cluster.local {{\n        fallthrough\n    }}\n    cache {{\n"),
        1,
    );
    let (head, dot) = cluster.split_at(cluster.rfind(".:53 {").unwrap());
    let dot = dot.replacen(
        "    cache 30\n",
        &format!(
            "    hosts {node_hosts} {{\n        10.96.99.99 extra.example\n        fd00:10:96::9999 extra.example\n        ttl 60\n        reload 1s\n        fallthrough\n    }}\n    cache 30\n"
        ),
        1,
    );
    format!(
        "{head}{dot}.:1053 {{\n    bind {LOCAL}\n    whoami\n}}\nother.test:53 {{\n    bind {LOCAL} {KUBE_DNS}\n    forward sub.other.test {}\n}}\n",
        stock_node::NODE_RESOLVER
    )
}

/// `dig` from inside the node, without recursion asked (node-cache's answers are compared that
/// way in the corpus): its whole output.
fn dig(node: &StockNode, args: &[&str]) -> String {
    let mut all = vec!["+norec", "+tries=1", "+time=2"];
    all.extend_from_slice(args);
    node.ns.run("dig", &all).expect("dig runs")
}

/// The record lines of a dig answer (`name ttl class type data`, whitespace collapsed).
fn records(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| !l.starts_with(';') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

#[test]
fn hosts_answers_through_the_cache_before_forward_and_falls_through_to_it() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = TempDir::new("nodedns-hosts").unwrap();
    let (cluster_file, node_file) = (dir.path().join("pods"), dir.path().join("hosts"));
    std::fs::write(
        &cluster_file,
        "10.96.50.50 db.default.svc.cluster.local\n10.96.50.51 kubernetes.example.org # outside its zone\n",
    )
    .unwrap();
    std::fs::write(&node_file, "# the node's\n192.168.0.100 api.example.com\n").unwrap();
    let text = corefile(cluster_file.to_str().unwrap(), node_file.to_str().unwrap());
    let node = StockNode::start(&text).expect("node starts");
    let local = IpAddr::V4(LOCAL);
    let resolver_before = queries(&node.resolver, "A");
    let cluster_before = queries(&node.cluster, "A");

    // An inline entry: `ttl 60` under `cache 30` is served as 30 (the cache's cap), AA, owner
    // lowercased, and the node's resolver is never asked.
    let out = dig(&node, &["@169.254.20.10", "EXTRA.example", "A"]);
    assert!(
        out.contains("status: NOERROR") && out.contains("flags: qr aa;"),
        "{out}"
    );
    assert_eq!(
        records(&out),
        ["extra.example. 30 IN A 10.96.99.99"],
        "{out}"
    );
    let out = dig(&node, &["@169.254.20.10", "extra.example", "AAAA"]);
    assert_eq!(
        records(&out),
        ["extra.example. 30 IN AAAA fd00:10:96::9999"],
        "{out}"
    );
    // From the file.
    let reply = node.ask(local, "api.example.com.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(192, 168, 0, 100)]));
    // Known name, no record of the type: NOERROR, nothing, no SOA (fallthrough or not).
    let out = dig(&node, &["@169.254.20.10", "extra.example", "MX"]);
    assert!(
        out.contains("status: NOERROR") && out.contains("ANSWER: 0, AUTHORITY: 0"),
        "{out}"
    );
    assert_eq!(
        queries(&node.resolver, "A"),
        resolver_before,
        "hosts answered all of these"
    );
    assert_eq!(queries(&node.resolver, "MX"), 0);

    // Unknown to hosts: `fallthrough` hands it to `forward`.
    let reply = node.ask(local, "www.example.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![FROM_NODE_RESOLVER]));
    assert_eq!(queries(&node.resolver, "A"), resolver_before + 1);

    // The cluster.local block: its hosts file answers pod names, its upstream the rest; the
    // entry outside the plugin's zones is dropped.
    let reply = node.ask(local, "db.default.svc.cluster.local.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 50, 50)]));
    assert_eq!(queries(&node.cluster, "A"), cluster_before);
    let reply = node.ask(
        local,
        "kubernetes.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 0, 1)]));
    assert_eq!(queries(&node.cluster, "A"), cluster_before + 1);

    // glibc with the pod's search list: `db` is found as db.default.svc.cluster.local (hosts in
    // the cluster.local block), `extra.example` after its expansions went NXDOMAIN upstream (the
    // cluster.local block's hosts falls through) as the absolute name (hosts in `.`).
    node.ns
        .set_resolv_conf(&format!(
            "nameserver {LOCAL}\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
        ))
        .unwrap();
    let out = node
        .ns
        .run("getent", &["ahostsv4", "db"])
        .expect("getent db");
    assert!(out.starts_with("10.96.50.50 "), "{out}");
    let out = node
        .ns
        .run("getent", &["ahostsv4", "extra.example"])
        .expect("getent extra.example");
    assert!(out.starts_with("10.96.99.99 "), "{out}");

    // The file changes: the next poll (1 s) rereads it, and the new entry answers. (Asked
    // before that, the name would be the resolver's NXDOMAIN, cached: the cache comes first.)
    std::fs::write(
        &node_file,
        "# the node's\n192.168.0.100 api.example.com\n192.168.0.200 late.example.com\n",
    )
    .unwrap();
    assert!(
        node.wait_output("hosts: file reloaded", Duration::from_secs(10)),
        "{}",
        node.output()
    );
    let reply = node.ask(local, "late.example.com.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(192, 168, 0, 200)]));
    // Entries of both blocks: `.` has 2 inline + 2 file names and their 4 PTR names, the
    // cluster.local block 1 name and its PTR name.
    let entries = node
        .wait_metric("coredns_hosts_entries", Duration::from_secs(5), |v| {
            v == 10.0
        })
        .unwrap();
    assert_eq!(entries, 10.0, "{}", node.output());
}

#[test]
fn whoami_answers_with_the_client_and_what_no_plugin_takes_is_servfail() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = TempDir::new("nodedns-whoami").unwrap();
    let file = dir.path().join("hosts");
    std::fs::write(&file, "").unwrap();
    let node = StockNode::start(&corefile(file.to_str().unwrap(), file.to_str().unwrap()))
        .expect("node starts");

    // whoami: NOERROR, AA, nothing in the answer; the client's address and port in the
    // additional section, TTL 0.
    let out = dig(
        &node,
        &[
            "@169.254.20.10",
            "-p",
            "1053",
            "-b",
            "169.254.20.10#40053",
            "anything.example",
            "A",
        ],
    );
    assert!(
        out.contains("status: NOERROR") && out.contains("flags: qr aa;"),
        "{out}"
    );
    assert!(out.contains("ANSWER: 0,"), "{out}");
    let mut additional = records(&out);
    additional.sort();
    assert_eq!(
        additional,
        [
            "_udp.anything.example. 0 IN SRV 0 0 40053 .",
            "anything.example. 0 IN A 169.254.20.10",
        ],
        "{out}"
    );
    // Over TCP the service label says so.
    let out = dig(
        &node,
        &[
            "@169.254.20.10",
            "-p",
            "1053",
            "+tcp",
            "-b",
            "169.254.20.10",
            "x.example",
            "A",
        ],
    );
    assert!(out.contains("_tcp.x.example."), "{out}");

    // A name the block's `forward` does not take, with no other plugin: SERVFAIL, as
    // node-cache answers it (CoreDNS's end of the chain), not REFUSED.
    let reply = node
        .ask(IpAddr::V4(LOCAL), "www.other.test.", RecordType::A)
        .expect("an answer");
    assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
    assert!(!reply.metadata.authoritative);
    // And hosts with an empty file falls through to the resolver.
    let reply = node.ask(IpAddr::V4(LOCAL), "www.example.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![FROM_NODE_RESOLVER]));
    // A PTR for an inline entry's address: in the stock layout the in-addr.arpa block has no
    // hosts, so the cluster DNS answers it (NXDOMAIN there), never the `.` block's hosts.
    let reply = node
        .ask(
            IpAddr::V4(LOCAL),
            "99.99.96.10.in-addr.arpa.",
            RecordType::PTR,
        )
        .expect("an answer");
    assert!(
        !reply
            .answers
            .iter()
            .any(|r| matches!(&r.data, RData::PTR(p) if p.0.to_string() == "extra.example.")),
        "{reply:?}"
    );
}

/// The lablabs and deliveryhero charts' `noIPv6Lookups`: `template IN AAAA { rcode NOERROR }`
/// answers every AAAA of the block NOERROR with nothing (AA, no SOA) without asking the cluster
/// DNS (each time: the cache keeps no denial without an SOA); A queries go on to `forward`.
#[test]
fn a_template_answers_aaaa_with_nodata_and_a_goes_on() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let text = stock_node::stock_corefile().replacen(
        "    cache {\n",
        "    template IN AAAA {\n        rcode NOERROR\n    }\n    cache {\n",
        1,
    );
    let node = StockNode::start(&text).expect("node starts");
    let aaaa_before = queries(&node.cluster, "AAAA");
    for _ in 0..2 {
        let out = dig(
            &node,
            &[
                "@169.254.20.10",
                "kubernetes.default.svc.cluster.local",
                "AAAA",
            ],
        );
        assert!(
            out.contains("status: NOERROR") && out.contains("flags: qr aa;"),
            "{out}"
        );
        assert!(out.contains("ANSWER: 0, AUTHORITY: 0"), "{out}");
    }
    assert_eq!(
        queries(&node.cluster, "AAAA"),
        aaaa_before,
        "never asked upstream"
    );
    let reply = node.ask(
        IpAddr::V4(LOCAL),
        "kubernetes.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 0, 1)]));
}
