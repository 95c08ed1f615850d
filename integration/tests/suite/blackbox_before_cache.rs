//! The plugins before the cache, seen from outside, on the stock node (its Knot servers for the
//! cluster DNS and the node's resolver): `loadbalance` rotates the addresses of every answer,
//! hits included, without asking the cluster DNS again; `bufsize` cuts what an EDNS client
//! advertises, hits included, and the answer's OPT says so; a block without them answers as
//! before.

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
