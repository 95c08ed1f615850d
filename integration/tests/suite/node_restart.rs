//! Crash-restarts and migration: after `kill -9` nothing is torn down, and the next start finds
//! its own rules and link and duplicates nothing; rules and a link that node-cache left behind
//! are recognised by their comments and removed.

use std::time::Duration;

use nodedns_integration::node::{self, KUBE_DNS, LOCAL_IP, Node, NodeOptions};

/// What node-cache installs for one local IP (its exact rule text, as iptables-save prints it).
fn node_cache_rules() -> String {
    let mut raw = String::new();
    let mut filter = String::new();
    for ip in [LOCAL_IP, KUBE_DNS] {
        for proto in ["tcp", "udp"] {
            let m = format!("-p {proto} -m {proto}");
            let skip = "-m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK";
            let allow = "-m comment --comment \"NodeLocal DNS Cache: allow DNS traffic\" -j ACCEPT";
            raw.push_str(&format!(
                "-I PREROUTING 1 -d {ip}/32 {m} --dport 53 {skip}\n"
            ));
            raw.push_str(&format!("-I OUTPUT 1 -s {ip}/32 {m} --sport 53 {skip}\n"));
            raw.push_str(&format!("-I OUTPUT 1 -d {ip}/32 {m} --dport 53 {skip}\n"));
            filter.push_str(&format!("-I INPUT 1 -d {ip}/32 {m} --dport 53 {allow}\n"));
            filter.push_str(&format!("-I OUTPUT 1 -s {ip}/32 {m} --sport 53 {allow}\n"));
        }
        raw.push_str(&format!(
            "-I OUTPUT 1 -d {ip}/32 -p tcp -m tcp --dport 8080 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK\n"
        ));
    }
    format!("*raw\n{raw}COMMIT\n*filter\n{filter}COMMIT\n")
}

fn node_cache_lines(rules: &[String]) -> usize {
    rules
        .iter()
        .filter(|l| l.contains("NodeLocal DNS Cache"))
        .count()
}

fn errors_in(output: &str) -> Vec<&str> {
    output
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect()
}

fn restart(first_backend: &str, second_backend: &str) {
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    // node-cache ran here before, and its link (kind dummy there; a bridge on this kernel)
    // still holds an address nodedns does not serve.
    node.node
        .run_stdin("iptables-restore", &["--noflush"], &node_cache_rules())
        .unwrap();
    assert_eq!(node_cache_lines(&node.dns_cache_rules().unwrap()), 22);
    node.node
        .run("ip", &["link", "add", "nodelocaldns", "type", "bridge"])
        .unwrap();
    node.node
        .run(
            "ip",
            &["addr", "add", "10.96.0.99/32", "dev", "nodelocaldns"],
        )
        .unwrap();

    let first = node
        .start_nodedns(&["--rules-backend", first_backend])
        .expect("nodedns starts over node-cache's leftovers");
    let ours = node.dns_cache_rules().unwrap();
    assert_eq!(
        node_cache_lines(&ours),
        0,
        "node-cache's rules are removed: {ours:#?}"
    );
    let addresses = node
        .node
        .run("ip", &["addr", "show", "nodelocaldns"])
        .unwrap();
    assert!(!addresses.contains("10.96.0.99"), "{addresses}");
    assert!(addresses.contains(&format!("{LOCAL_IP}/32")), "{addresses}");
    assert!(addresses.contains(&format!("{KUBE_DNS}/32")), "{addresses}");
    assert!(errors_in(&first.output()).is_empty(), "{}", first.output());

    first.kill9().unwrap();
    assert!(node.has_link("nodelocaldns"), "kill -9 tears nothing down");
    assert_eq!(node.dns_cache_rules().unwrap(), ours);
    // And node-cache's rules come back once more (say, an old pod still running).
    node.node
        .run_stdin("iptables-restore", &["--noflush"], &node_cache_rules())
        .unwrap();

    let mut second = node
        .start_nodedns(&["--rules-backend", second_backend])
        .expect("nodedns restarts over its own leftovers");
    let again = node.dns_cache_rules().unwrap();
    assert_eq!(node_cache_lines(&again), 0, "{again:#?}");
    if first_backend == second_backend {
        assert_eq!(again, ours, "the same rules, none duplicated");
    } else {
        // The other backend's objects are gone: only one set of rules is live.
        let iptables = again.iter().filter(|l| !l.starts_with("nft: ")).count();
        let nft = again.iter().filter(|l| l.starts_with("nft: ")).count();
        assert!(iptables == 0 || nft == 0, "{again:#?}");
    }
    // One jump per built-in chain, whatever happened before.
    let jumps = again
        .iter()
        .filter(|l| l.starts_with("iptables-nft-save: -A PREROUTING") && l.contains("NODEDNS"))
        .count();
    assert_eq!(
        jumps,
        usize::from(second_backend == "iptables"),
        "{again:#?}"
    );
    assert!(
        errors_in(&second.output()).is_empty(),
        "{}",
        second.output()
    );

    // It serves, untracked.
    node.conntrack_flush().unwrap();
    node.resolve_all(&["kubernetes.default", "web.default"])
        .unwrap();
    assert!(node.pod_dns_flows("udp").unwrap().is_empty());

    let status = second.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}");
    assert!(!node.has_link("nodelocaldns"));
    assert_eq!(node.dns_cache_rules().unwrap(), Vec::<String>::new());
}

#[test]
fn kill9_and_restart_duplicate_nothing_and_node_cache_leftovers_are_adopted() {
    let _turn = crate::shared();
    restart("iptables", "iptables");
}

#[test]
fn restart_with_nftables_backend_removes_the_iptables_chains_of_the_previous_run() {
    let _turn = crate::shared();
    restart("iptables", "nftables");
}
