//! Two nodedns DaemonSets on one node, at the same addresses, so that one serves while the other
//! restarts: kubespray's `nodelocaldns` and `nodelocaldns-second` (node-cache's flat command
//! line with `-skipteardown`, each Corefile with its own `health` and `prometheus` ports), and
//! nodedns's own manifest applied twice (each DaemonSet with its own `--handoff-dir`). Both
//! processes' sockets share each address's `SO_REUSEPORT` group; a pod's lookup loop sees no
//! failure while either is restarted or killed; the rules stay as they were, and neither
//! instance rewrites what the other wrote; the last one to go does what node-cache does.
//!
//! Real parts: the `nodedns` binary (two processes at a time), Knot as CoreDNS behind
//! kube-proxy's DNAT, kernel sockets and rules in network namespaces, `dig` in the pod.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use nodedns_integration::node::{
    self, KUBE_DNS, LOCAL_IP, Node, NodeAgent, NodeOptions, PodLoad, PodLoadReport, ProxyMode,
    wait_for,
};
use nodedns_integration::{Process, TempDir, nodedns_bin};

const SERVING: &str = "serving DNS";
const NOT_LAST: &str = "another instance serves: leaving the host networking in place";
const STEPPED_ASIDE: &str = "another instance serves these addresses too";
/// What a reconcile pass logs when it had to put something back: with two instances writing
/// the same rules, neither ever has to.
const REPAIRED: &str = "host networking restored";

/// kubespray's Corefile (`nodelocaldns-config.yml.j2`, its defaults) for one of the two
/// DaemonSets: the same zones and upstreams, its own `prometheus` and `health` ports.
fn kubespray_corefile(upstream: IpAddr, prometheus: u16, health: u16) -> String {
    let block = |zone: &str, cache: &str, forward: &str, extra: &str| {
        format!(
            "{zone}:53 {{\n    errors\n    {cache}\n    reload\n    loop\n    bind {LOCAL_IP}\n    \
             {forward}\n    prometheus :{prometheus}\n{extra}}}\n"
        )
    };
    let tcp = format!("forward . {upstream} {{\n        force_tcp\n    }}");
    [
        block(
            "cluster.local",
            "cache {\n        success 9984 30\n        denial 9984 5\n    }",
            &tcp,
            &format!("    health {LOCAL_IP}:{health}\n"),
        ),
        block("in-addr.arpa", "cache 30", &tcp, ""),
        block("ip6.arpa", "cache 30", &tcp, ""),
        // kubespray's upstreamForwardTarget without upstream_dns_servers.
        block(".", "cache 30", "forward . /etc/resolv.conf", ""),
    ]
    .concat()
}

/// kubespray's `args:` for both DaemonSets (`-skipteardown` on the first too once the second is
/// enabled), plus what this kernel needs (no dummy driver) and the lablabs chart's
/// `-syncinterval 1ns` (1 s to node-cache), so that each reconciles every second.
fn kubespray_args(corefile: &Path, resolv_conf: &Path) -> Vec<String> {
    [
        // nodedns's own flag, naming a file the Corefile does not: `forward . /etc/resolv.conf`
        // still reads /etc/resolv.conf (the node namespace's), as CoreDNS does.
        "--resolv-conf",
        &resolv_conf.display().to_string(),
        "-localip",
        &LOCAL_IP.to_string(),
        "-conf",
        &corefile.display().to_string(),
        "-upstreamsvc",
        "coredns",
        "-skipteardown",
        "-syncinterval",
        "1ns",
        "--link-kind",
        "bridge",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn sorted(mut rules: Vec<String>) -> Vec<String> {
    rules.sort();
    rules
}

/// DNS requests an instance counted (`coredns_dns_requests_total`, all series), on its
/// `prometheus` port.
fn requests(node: &Node, port: u16) -> f64 {
    let Ok(text) = node.http_get(SocketAddr::from((LOCAL_IP, port)), "/metrics") else {
        return 0.0;
    };
    text.lines()
        .filter(|l| l.starts_with("coredns_dns_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[track_caller]
fn assert_no_failure(what: &str, report: &PodLoadReport) {
    eprintln!("{what}: {} queries, {} failed", report.sent, report.failed);
    assert!(report.sent >= 400, "{what}: the pod's loop ran: {report:?}");
    assert_eq!(report.failed, 0, "{what}: {report:#?}");
}

/// After a few reconcile passes (each instance runs one a second): the pod's loop saw no
/// failure, the rules are as they were, and neither instance had to put anything back.
#[track_caller]
fn assert_settled(
    what: &str,
    node: &Node,
    load: PodLoad,
    rules: &[String],
    agents: [&NodeAgent; 2],
) {
    std::thread::sleep(Duration::from_secs(3));
    assert_no_failure(what, &load.finish());
    assert_eq!(sorted(node.dns_cache_rules().unwrap()), rules);
    for agent in agents {
        assert!(
            !agent.output().contains(REPAIRED),
            "{what}:\n{}",
            agent.output()
        );
    }
}

#[track_caller]
fn assert_exits_leaving_the_host(what: &str, agent: &mut NodeAgent) {
    let status = agent.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{what}: {status}\n{}", agent.output());
    let output = agent.output();
    assert!(output.contains(STEPPED_ASIDE), "{what}:\n{output}");
    assert!(output.contains(NOT_LAST), "{what}:\n{output}");
}

#[test]
fn kubesprays_second_daemonset_keeps_the_node_answering_while_either_restarts() {
    let _turn = crate::alone();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    // kubespray sets kubelet's clusterDNS to the node-local address: ipvs mode here.
    let node = Node::build(NodeOptions {
        proxy: ProxyMode::Ipvs,
        dual_stack: false,
    })
    .expect("simulated node");
    let dir = TempDir::new("nodedns-second").unwrap();
    let upstream = node.upstream().ip();
    let primary = dir.path().join("Corefile");
    let secondary = dir.path().join("Corefile-second");
    std::fs::write(&primary, kubespray_corefile(upstream, 9253, 9254)).unwrap();
    std::fs::write(&secondary, kubespray_corefile(upstream, 9255, 9256)).unwrap();
    // A resolver nothing can reach from the node (it has no default route).
    let resolv_conf = dir.path().join("resolv.conf");
    std::fs::write(&resolv_conf, "nameserver 192.0.2.53\n").unwrap();
    let first_args = kubespray_args(&primary, &resolv_conf);
    let second_args = kubespray_args(&secondary, &resolv_conf);
    let start = |name: &str, args: &[String]| {
        node.spawn_nodedns(name, &strs(args), SERVING)
            .unwrap_or_else(|e| panic!("{name} starts: {e:#}"))
    };

    let mut first = start("first", &first_args);
    wait_for("the first answers", Duration::from_secs(10), || {
        node.answers(LOCAL_IP.into())
    })
    .unwrap();
    let rules = sorted(node.dns_cache_rules().unwrap());
    assert!(!rules.is_empty() && node.has_link("nodelocaldns"));
    assert!(
        first.output().contains(
            "-syncinterval 1ns: node-cache multiplies this flag by one second, so it means 1s"
        ),
        "{}",
        first.output()
    );
    // `.` goes to /etc/resolv.conf's server (kube-dns-upstream, whose Knot has the root zone):
    // NXDOMAIN, not the SERVFAIL that --resolv-conf's unreachable server would give.
    let out = node
        .pod
        .output(
            "dig",
            &[
                &format!("@{LOCAL_IP}"),
                "+tries=1",
                "+time=3",
                "www.example.",
                "A",
            ],
        )
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("status: NXDOMAIN"), "{out}");
    // `-syncinterval 1ns` is a check every second: a rule removed behind its back is back soon.
    node.node
        .run("iptables", &["-t", "raw", "-F", "NODEDNS-PREROUTING"])
        .unwrap();
    assert_ne!(sorted(node.dns_cache_rules().unwrap()), rules);
    wait_for("the rules restored", Duration::from_secs(3), || {
        node.dns_cache_rules().is_ok_and(|r| sorted(r) == rules)
    })
    .unwrap();
    assert!(first.output().contains(REPAIRED), "{}", first.output());
    let mut second = start("second", &second_args);

    // Both serve: the kernel spreads the pod's queries over the two processes' sockets.
    let load = PodLoad::start(&node, LOCAL_IP.into(), 1, 2, dir.path());
    wait_for("both count queries", Duration::from_secs(20), || {
        requests(&node, 9253) > 0.0 && requests(&node, 9255) > 0.0
    })
    .unwrap();
    for health in [9254, 9256] {
        let addr = SocketAddr::from((LOCAL_IP, health));
        assert_eq!(node.http_get(addr, "/health").unwrap().trim(), "OK");
    }

    // A pod restart, as the kubelet does it (the preStop's `kill -9 1` cannot kill a PID 1 from
    // inside its namespace; SIGTERM follows the sleep): one at a time, each comes back.
    assert_exits_leaving_the_host("the first, restarting", &mut first);
    assert_eq!(sorted(node.dns_cache_rules().unwrap()), rules);
    assert!(node.has_link("nodelocaldns"));
    first = start("first", &first_args);
    assert_exits_leaving_the_host("the second, restarting", &mut second);
    second = start("second", &second_args);
    assert_settled(
        "restarts (SIGTERM), one try per query",
        &node,
        load,
        &rules,
        [&first, &second],
    );

    // A crash: kill -9, nothing handed over. What was queued on the dead sockets is lost, so
    // the lookup loop retries once, as every stub resolver does.
    let load = PodLoad::start(&node, LOCAL_IP.into(), 2, 1, dir.path());
    wait_for("the loop runs", Duration::from_secs(10), || {
        load.sent() >= 200
    })
    .unwrap();
    first.kill9().unwrap();
    let mut first = start("first", &first_args);
    second.kill9().unwrap();
    let mut second = start("second", &second_args);
    assert_settled(
        "crashes (SIGKILL), two tries per query",
        &node,
        load,
        &rules,
        [&first, &second],
    );

    // Both go. With -skipteardown, node-cache leaves the link and the rules on the node, the
    // last one too; so does nodedns.
    assert_exits_leaving_the_host("the first, leaving", &mut first);
    let status = second.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}\n{}", second.output());
    assert!(
        !second.output().contains(STEPPED_ASIDE),
        "{}",
        second.output()
    );
    assert!(
        second
            .output()
            .contains("--skip-teardown: leaving the link and rules in place"),
        "{}",
        second.output()
    );
    assert_eq!(sorted(node.dns_cache_rules().unwrap()), rules);
    assert!(node.has_link("nodelocaldns"));
}

/// `nodedns run` as nodedns's manifest runs it on this node (CLI flags in place of its
/// Corefile), with `extra`.
fn manifest_args(node: &Node, extra: &[&str]) -> Vec<String> {
    let ips: Vec<String> = node.local_ips().iter().map(IpAddr::to_string).collect();
    let mut args: Vec<String> = [
        "run",
        "--local-ip",
        &ips.join(","),
        "--upstream",
        &node.upstream().to_string(),
        "--health-port",
        "8080",
        "--link-kind",
        "bridge",
        "--sync-interval",
        "1s",
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args
}

#[test]
fn two_daemonsets_with_their_own_handoff_dirs_share_the_node_and_the_last_tears_down() {
    let _turn = crate::alone();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let dir = TempDir::new("nodedns-siblings").unwrap();
    let (dir_a, dir_b) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&dir_a, &dir_b] {
        std::fs::create_dir(d).unwrap();
    }
    let args_a = manifest_args(&node, &["--handoff-dir", dir_a.to_str().unwrap()]);
    let args_b = manifest_args(&node, &["--handoff-dir", dir_b.to_str().unwrap()]);
    let start = |name: &str, args: &[String], ready: &str| {
        node.spawn_nodedns(name, &strs(args), ready)
            .unwrap_or_else(|e| panic!("{name} starts: {e:#}"))
    };
    let mut a = start("a", &args_a, SERVING);
    wait_for("A answers", Duration::from_secs(10), || {
        node.answers(KUBE_DNS.into())
    })
    .unwrap();
    let rules = sorted(node.dns_cache_rules().unwrap());
    let mut b = start("b", &args_b, SERVING);
    assert!(
        !b.output().contains("took the listening sockets over"),
        "B has a hand-over directory of its own: it binds beside A\n{}",
        b.output()
    );
    let health = SocketAddr::from((LOCAL_IP, 8080));

    let load = PodLoad::start(&node, KUBE_DNS.into(), 1, 2, dir.path());
    wait_for("the loop runs", Duration::from_secs(10), || {
        load.sent() >= 200
    })
    .unwrap();
    // DaemonSet A is upgraded (its new pod takes the sockets over from its old one), while B
    // serves beside them.
    let mut a2 = start("a2", &args_a, "took the listening sockets over");
    let status = a.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}\n{}", a.output());
    assert!(a.output().contains(NOT_LAST), "{}", a.output());
    // Both bind the same health port (SO_REUSEPORT): whichever is there answers the probe.
    assert_eq!(node.http_get(health, "/health").unwrap().trim(), "OK");
    // DaemonSet B restarts: A2 answers meanwhile.
    assert_exits_leaving_the_host("B, restarting", &mut b);
    assert_eq!(node.http_get(health, "/health").unwrap().trim(), "OK");
    let mut b2 = start("b2", &args_b, SERVING);
    assert_settled(
        "an upgrade of A and a restart of B",
        &node,
        load,
        &rules,
        [&a2, &b2],
    );

    // B goes for good: A2 keeps the host networking. Then A2, the last, tears it down.
    assert_exits_leaving_the_host("B, leaving", &mut b2);
    assert_eq!(sorted(node.dns_cache_rules().unwrap()), rules);
    assert!(node.answers(KUBE_DNS.into()));
    let status = a2.terminate(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}\n{}", a2.output());
    assert!(!a2.output().contains(NOT_LAST), "{}", a2.output());
    assert_eq!(node.dns_cache_rules().unwrap(), Vec::<String>::new());
    assert!(!node.has_link("nodelocaldns"));
}

#[test]
fn a_second_instance_of_another_user_cannot_share_the_address_and_says_why() {
    let _turn = crate::shared();
    if let Some(reason) = node::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let node = Node::build(NodeOptions::default()).expect("simulated node");
    let _first = node
        .start_nodedns(&[])
        .expect("the first instance, as root");
    // Port 53 for anyone, so that only the owner of the socket stands in the way.
    node.node
        .run("sysctl", &["-qw", "net.ipv4.ip_unprivileged_port_start=0"])
        .unwrap();
    let mut command = node.node.command("setpriv");
    command
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(nodedns_bin())
        .args(["run", "--no-setup", "--listen", &format!("{LOCAL_IP}:53")])
        .args(["--upstream", &node.upstream().to_string()])
        .env_remove("NODEDNS_HANDOFF_DIR");
    let mut second = Process::spawn("nobody", command).unwrap();
    let status = second
        .wait_timeout(Duration::from_secs(10))
        .expect("the second exits");
    assert!(!status.success(), "{status}");
    let output = second.output();
    assert!(
        output.contains(&format!("bind UDP {LOCAL_IP}:53")) && output.contains("per effective UID"),
        "{output}"
    );
    assert!(node.answers(LOCAL_IP.into()), "the first still serves");
}
