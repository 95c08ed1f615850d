//! The plugins before the cache, seen from outside, on the stock node (its Knot servers for the
//! cluster DNS and the node's resolver): `loadbalance` rotates the addresses of every answer,
//! hits included, without asking the cluster DNS again; `bufsize` cuts what an EDNS client
//! advertises, hits included, and the answer's OPT says so; `dns64` answers AAAA from the A
//! answer, both cached; a block without them answers as before.

use std::collections::BTreeSet;

use crate::stock_node::{self, StockNode, queries};

/// The stock Corefile with `bufsize 512` and `loadbalance` in the cluster.local block.
fn corefile() -> String {
    stock_node::stock_corefile().replacen(
        "    cache {\n",
        "    bufsize 512\n    loadbalance\n    cache {\n",
        1,
    )
}

/// `dig` from inside the node: its whole output.
fn dig(node: &StockNode, args: &[&str]) -> String {
    let mut all = vec!["+tries=1", "+time=2"];
    all.extend_from_slice(args);
    node.ns.run("dig", &all).expect("dig runs")
}

/// The addresses of a dig answer, in the order served.
fn addresses(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| !l.starts_with(';'))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            (words.len() == 5 && words[3] == "A").then(|| words[4].to_owned())
        })
        .collect()
}

#[test]
fn loadbalance_rotates_hits_and_bufsize_lowers_the_edns_size() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let node = StockNode::start(&corefile()).expect("node starts");
    let name = "headless.default.svc.cluster.local";
    let cluster_before = queries(&node.cluster, "A");

    let mut firsts = BTreeSet::new();
    for _ in 0..12 {
        // dig picks a random ID per query: the rotation follows it.
        let out = dig(&node, &["@169.254.20.10", "+bufsize=1232", name, "A"]);
        assert!(out.contains("status: NOERROR"), "{out}");
        assert!(out.contains("udp: 512"), "bufsize's size in the OPT: {out}");
        let served = addresses(&out);
        let mut set = served.clone();
        set.sort();
        assert_eq!(set, ["10.244.1.11", "10.244.1.12", "10.244.1.13"], "{out}");
        firsts.insert(served[0].clone());
    }
    assert!(
        firsts.len() >= 2,
        "always the same first address: {firsts:?}"
    );
    assert_eq!(
        queries(&node.cluster, "A"),
        cluster_before + 1,
        "one upstream query, then hits, rotated too"
    );

    // A client advertising less than bufsize's size keeps its own (no OPT change needed); one
    // without OPT gets none.
    let out = dig(&node, &["@169.254.20.10", "+noedns", name, "A"]);
    assert!(!out.contains("EDNS:"), "{out}");
    assert_eq!(addresses(&out).len(), 3, "{out}");

    // The `.` block has neither: nodedns's own size, and the answer as it is.
    let out = dig(
        &node,
        &["@169.254.20.10", "+bufsize=1232", "www.example", "A"],
    );
    assert!(out.contains("udp: 1232"), "{out}");
}

/// The records of type `rtype` in a dig answer: (TTL, data), in the order served.
fn records(out: &str, rtype: &str) -> Vec<(u32, String)> {
    out.lines()
        .filter(|l| !l.starts_with(';'))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            (words.len() == 5 && words[3] == rtype)
                .then(|| (words[1].parse().expect("a TTL"), words[4].to_owned()))
        })
        .collect()
}

/// The header flags dig shows (`qr rd ...`).
fn flags(out: &str) -> Vec<String> {
    out.lines()
        .find_map(|l| l.strip_prefix(";; flags: "))
        .and_then(|l| l.split(';').next())
        .map(|f| f.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// `dns64` (a /64 prefix, `allow_ipv4`: the node's clients come over IPv4) in the cluster.local
/// block, against the cluster's Knot: a name with only an A record gets an AAAA record with the
/// address where RFC 6052 puts it under a /64, not authoritative, its TTL the NODATA's SOA TTL
/// as the block's cache serves it (`denial 9984 5`); asked again, it is made from the two
/// cached answers without a query upstream. A name with AAAA records keeps them; the `.` block,
/// without `dns64`, answers AAAA as before.
#[test]
fn dns64_synthesizes_from_the_cached_answers_and_passes_real_aaaa_records() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let corefile = stock_node::stock_corefile().replacen(
        "    cache {\n",
        "    dns64 {\n        prefix 2001:db8:122:344::/64\n        allow_ipv4\n    }\n    cache {\n",
        1,
    );
    let node = StockNode::start(&corefile).expect("node starts");
    let (a_before, aaaa_before) = (queries(&node.cluster, "A"), queries(&node.cluster, "AAAA"));
    let name = "kubernetes.default.svc.cluster.local";
    for round in 0..2 {
        let out = dig(&node, &["@169.254.20.10", name, "AAAA"]);
        assert!(out.contains("status: NOERROR"), "{out}");
        let got = records(&out, "AAAA");
        assert_eq!(got.len(), 1, "round {round}: {out}");
        // 10.96.0.1 in bytes 9 to 12, byte 8 (the u octet) zero.
        assert_eq!(got[0].1, "2001:db8:122:344:a:6000:100:0", "{out}");
        assert!(got[0].0 <= 5, "the SOA TTL under `denial 9984 5`: {out}");
        assert!(
            !flags(&out).contains(&"aa".to_owned()),
            "synthesized: {out}"
        );
    }
    assert_eq!(
        (queries(&node.cluster, "A"), queries(&node.cluster, "AAAA")),
        (a_before + 1, aaaa_before + 1),
        "each question asked upstream once, then both answered from the cache"
    );
    let translated = "coredns_dns64_requests_translated_total{server=\"dns://169.254.20.10:53\"}";
    assert_eq!(
        node.metric(translated).unwrap(),
        Some(2.0),
        "CoreDNS's counter"
    );
    let responses = node.http_get(stock_node::METRICS, "/metrics").unwrap();
    assert!(
        responses
            .lines()
            .any(|l| l.starts_with("coredns_dns_responses_total{")
                && l.contains("plugin=\"dns64\"")
                && l.ends_with(" 2")),
        "the answers counted as dns64's: {responses}"
    );

    let out = dig(
        &node,
        &["@169.254.20.10", "web.default.svc.cluster.local", "AAAA"],
    );
    let got: Vec<String> = records(&out, "AAAA").into_iter().map(|r| r.1).collect();
    assert_eq!(
        got,
        ["fd00:10:96::1234"],
        "a real AAAA record passes: {out}"
    );

    let out = dig(&node, &["@169.254.20.10", "www.example", "AAAA"]);
    assert!(out.contains("status: NOERROR"), "{out}");
    assert!(
        !out.contains("2001:db8:122:344"),
        "the `.` block has no dns64: {out}"
    );
}
