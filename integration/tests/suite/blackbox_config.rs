//! The configuration, seen from outside: nodedns run with the stock node-local-dns Corefile and
//! DaemonSet arguments routes every zone to the upstream the file names, over the transport it
//! names; a kube-dns stub domain goes to its own server; the `loop` directive finds a forwarding
//! loop at start and stops the agent with what to fix, and finds none where there is none;
//! `--check-config` prints the warnings a start would log and where nodedns's defaults differ
//! from node-cache's for the file checked.
//!
//! Upstream query counts (Knot's `mod-stats`, by query type) prove where a query went.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::{
    Agent, Process, TempDir, client, free_port, have, http_get, nodedns_bin, spawn_with_corefile,
};

use crate::stock_node::{
    self, FROM_NODE_RESOLVER, HEALTH, KUBE_DNS, LOCAL, StockNode, a_answer, queries, udp_queries,
};

#[test]
fn stock_corefile_routes_each_zone_to_its_upstream() {
    let _turn = crate::shared();
    if let Some(why) = stock_node::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut node = StockNode::start(&stock_node::stock_corefile()).expect("node starts");
    let (local, kube_dns) = (IpAddr::V4(LOCAL), IpAddr::V4(KUBE_DNS));

    // cluster.local → the cluster DNS (kube-dns-upstream), over TCP (`force_tcp`).
    let cluster_before = queries(&node.cluster, "A");
    let resolver_before = queries(&node.resolver, "A");
    let reply = node.ask(
        local,
        "kubernetes.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 0, 1)]));
    assert_eq!(queries(&node.cluster, "A"), cluster_before + 1);
    // Also served on the kube-dns ClusterIP (bound through -localip), from the same cache.
    let reply = node.ask(
        kube_dns,
        "kubernetes.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 0, 1)]));
    assert_eq!(
        queries(&node.cluster, "A"),
        cluster_before + 1,
        "a hit, whichever local address"
    );

    // in-addr.arpa → the cluster DNS as well.
    let ptr_before = queries(&node.cluster, "PTR");
    let reply = node
        .ask(local, "10.0.96.10.in-addr.arpa.", RecordType::PTR)
        .expect("PTR answer");
    let targets: Vec<String> = reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::PTR(ptr) => Some(ptr.0.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(targets, ["kube-dns.kube-system.svc.cluster.local."]);
    assert_eq!(queries(&node.cluster, "PTR"), ptr_before + 1);

    // `.` → the node's resolver (__PILLAR__UPSTREAM__SERVERS__: its resolv.conf), over UDP.
    let resolver_udp = udp_queries(&node.resolver);
    let reply = node.ask(local, "www.example.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![FROM_NODE_RESOLVER]));
    assert_eq!(queries(&node.resolver, "A"), resolver_before + 1);
    assert!(
        udp_queries(&node.resolver) > resolver_udp,
        "a plain forward prefers UDP"
    );
    assert_eq!(
        queries(&node.cluster, "A"),
        cluster_before + 1,
        "not the cluster DNS"
    );

    // The kube-dns stub domain → its own server.
    let stub_before = queries(&node.stub, "A");
    let reply = node.ask(kube_dns, "www.acme.local.", RecordType::A);
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(192, 0, 2, 53)]));
    assert_eq!(queries(&node.stub, "A"), stub_before + 1);
    assert_eq!(queries(&node.resolver, "A"), resolver_before + 1);

    // Everything the cluster DNS received came over TCP: queries, health checks, loop probes.
    assert_eq!(
        udp_queries(&node.cluster),
        node.cluster_udp_before,
        "force_tcp"
    );

    // node-cache's rendered Corefile, where -conf says.
    let rendered = std::fs::read_to_string(&node.rendered).expect("rendered Corefile written");
    assert!(
        rendered.contains("forward . 10.96.0.11 {"),
        "__PILLAR__CLUSTER__DNS__ from KUBE_DNS_UPSTREAM_SERVICE_HOST:\n{rendered}"
    );
    assert!(!rendered.contains("__PILLAR__"), "{rendered}");

    // The stock `health` and `prometheus` addresses serve.
    node.http_get(HEALTH, "/health").expect("health endpoint");
    assert_eq!(
        node.metric("coredns_reload_failed_total").unwrap(),
        Some(0.0)
    );

    // Every block has `loop`: each is probed, none loops, and the agent stays.
    assert!(
        node.wait_output("loop check: no forwarding loop", Duration::from_secs(40)),
        "the loop check did not finish"
    );
    assert!(node.alive(), "{}", node.output());
    assert!(!node.output().contains("forwarding loop detected"));
}

#[test]
fn check_config_prints_the_warnings_and_where_the_defaults_differ_from_node_cache() {
    let _turn = crate::shared();
    let dir = TempDir::new("nodedns-check-config").unwrap();
    let path = dir.path().join("Corefile");
    // Line 3: a cache that writes prefetch (its DURATION behind an unset variable, a warning)
    // but not serve_stale; line 8: a forward without max_concurrent or expire. Line 14: a cache
    // without either; line 16: a forward that writes both.
    let corefile = "\
cluster.local:53 {
    errors
    cache {
        success 9984 30
        denial 9984 5
        prefetch 2 {$NODEDNS_TEST_UNSET}1m
    }
    forward . 10.96.0.11 {
        force_tcp
    }
}
.:53 {
    errors
    cache 30
    bind 169.254.20.10
    forward . 192.0.2.53 {
        max_concurrent 100
        expire 8s
    }
}
";
    std::fs::write(&path, corefile).unwrap();
    let resolv_conf = dir.path().join("resolv.conf");
    std::fs::write(&resolv_conf, "nameserver 192.0.2.53\n").unwrap();
    let output = Command::new(nodedns_bin())
        .arg("run")
        .arg("--check-config")
        .arg("--conf")
        .arg(&path)
        .arg("--resolv-conf")
        .arg(&resolv_conf)
        .args(["-localip", "169.254.20.10", "-syncinterval", "1ns"])
        .output()
        .expect("nodedns runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{}\n{stdout}\n{stderr}",
        output.status
    );
    let file = path.display();
    let line_of = |start: &str| -> String {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{stdout}"))
            .to_owned()
    };
    assert!(stdout.contains("cluster.local. on"), "{stdout}");

    // The warnings a start would log: the Corefile's and the flags'.
    let warnings = stdout.find("warnings:").expect("a warnings section");
    let differences = stdout
        .find("differences from node-cache:")
        .expect("a differences section");
    assert!(warnings < differences, "{stdout}");
    let prefetch_warning = line_of(&format!(
        "{file}:6: environment variable NODEDNS_TEST_UNSET"
    ));
    assert!(stdout.find(&prefetch_warning) < Some(differences));
    line_of("-syncinterval 1ns: node-cache multiplies this flag by one second, so it means 1s");

    // Where nodedns's defaults differ, each with the lines it applies to.
    let at = |lines: &[usize]| {
        let at: Vec<String> = lines.iter().map(|l| format!("{file}:{l}")).collect();
        format!("({})", at.join(", "))
    };
    assert!(
        line_of("cache: prefetch is on").ends_with(&at(&[14])),
        "{stdout}"
    );
    assert!(
        line_of("cache: serve_stale is on").ends_with(&at(&[3, 14])),
        "{stdout}"
    );
    assert!(
        line_of("cache: sized in bytes").ends_with(&at(&[3, 14])),
        "{stdout}"
    );
    assert!(
        line_of("forward: at most 1000 queries in flight").ends_with(&at(&[8])),
        "{stdout}"
    );
    assert!(
        line_of("the ndots cascade prefetch is on").ends_with(&at(&[1])),
        "{stdout}"
    );
    assert!(
        line_of("forward: idle upstream connections").ends_with(&at(&[8])),
        "{stdout}"
    );
}

/// The Corefile of an agent on 127.0.0.1:`port` that checks for loops and forwards `.` to
/// `upstream`, with the `extra` directives.
fn looping_corefile(port: u16, upstream: SocketAddr, extra: &str) -> String {
    format!(".:{port} {{\n    bind 127.0.0.1\n    loop\n{extra}    forward . {upstream}\n}}\n")
}

/// Starts the agent of [`looping_corefile`] and returns its output once it exited (at most
/// 40 s: the check retries for up to 30 s), asserting that it served first and then exited with
/// status 1 and the verdict.
fn assert_loop_stops_the_agent(dir: &TempDir, port: u16, forwarder: SocketAddr) {
    let (mut agent, _) = spawn_with_corefile(dir, &looping_corefile(port, forwarder, ""));
    let status = agent
        .wait_timeout(Duration::from_secs(40))
        .unwrap_or_else(|| panic!("still running with a loop:\n{}", agent.output()));
    let output = agent.output();
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(output.contains("serving DNS"), "{output}");
    let verdict = format!(
        "forwarding loop detected: zone `.` forwards to {forwarder}, which forwards back to nodedns"
    );
    assert!(output.contains(&verdict), "{output}");
    assert!(output.contains("Fix the upstream"), "{output}");
}

#[test]
fn a_loop_through_another_nodedns_stops_the_agent_with_what_to_fix() {
    let _turn = crate::shared();
    // The other agent forwards everything back to this one's port; it merges identical queries
    // in flight, so the probe returns a second time only when the check sends it again.
    let dir = TempDir::new("nodedns-loop").unwrap();
    let port = free_port().unwrap();
    let back = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let forwarder = Agent::start(&[back]).expect("forwarder starts");
    assert_loop_stops_the_agent(&dir, port, forwarder.addr());
}

#[test]
fn a_reload_into_a_loop_is_undone_and_the_previous_upstream_serves_again() {
    let _turn = crate::shared();
    let Some(knot) = nodedns_integration::knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-loop-reload").unwrap();
    let port = free_port().unwrap();
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let prometheus = format!("    prometheus {admin}\n");
    let corefile = |upstream| looping_corefile(port, upstream, &prometheus);
    let (mut agent, path) = spawn_with_corefile(&dir, &corefile(knot.addr()));
    let limit = Duration::from_secs(40);
    agent
        .wait_output("loop check: no forwarding loop", limit)
        .unwrap();

    // The new file forwards `.` to another agent that forwards everything back here.
    let forwarder = Agent::start(&[dns]).expect("forwarder starts");
    std::fs::write(&path, corefile(forwarder.addr())).unwrap();
    agent.wait_output("configuration reloaded", limit).unwrap();
    agent.wait_output("The reload is undone", limit).unwrap();
    let output = agent.output();
    let verdict = format!(
        "forwarding loop detected: zone `.` forwards to {}, which forwards back to nodedns",
        forwarder.addr()
    );
    assert!(output.contains(&verdict), "{output}");
    assert!(agent.exited().is_none(), "{output}");

    // Knot answers again, through this agent, a name nobody asked before (not from a cache).
    let reply = client::udp_blocking(
        dns,
        &client::query("kubernetes.default.svc.cluster.local.", RecordType::A),
        Duration::from_secs(3),
    );
    assert_eq!(a_answer(&reply), Ok(vec![Ipv4Addr::new(10, 96, 0, 1)]));
    let (status, metrics) = http_get(admin, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("\ncoredns_reload_failed_total 1\n"),
        "counted as a refused reload:\n{metrics}"
    );
}

#[test]
fn a_loop_through_dnsmasq_stops_the_agent_with_what_to_fix() {
    let _turn = crate::shared();
    if !have("dnsmasq") {
        eprintln!("skipped: dnsmasq not installed (Debian package `dnsmasq-base`)");
        return;
    }
    let dir = TempDir::new("nodedns-loop").unwrap();
    let port = free_port().unwrap();
    let forwarder_port = free_port().unwrap();
    let mut command = Command::new("dnsmasq");
    command.args([
        "--keep-in-foreground",
        "--no-daemon",
        "--no-resolv",
        "--no-hosts",
        "--bind-interfaces",
        "--listen-address=127.0.0.1",
        "--user=root",
        "--pid-file=",
        &format!("--port={forwarder_port}"),
        &format!("--server=127.0.0.1#{port}"),
    ]);
    let _dnsmasq = Process::spawn("dnsmasq", command).expect("spawn dnsmasq");
    assert_loop_stops_the_agent(
        &dir,
        port,
        SocketAddr::from((Ipv4Addr::LOCALHOST, forwarder_port)),
    );
}
