//! A simulated Kubernetes node built from network namespaces and real kernel rules:
//!
//! ```text
//!   pod ns                    node ns (nodedns runs here: "hostNetwork")          coredns ns
//!   eth0 10.244.1.2 ──veth── vp 10.244.1.1    vd 10.244.2.1 ──veth── eth0 10.244.2.2 (knotd)
//!   resolv.conf:              kube-proxy: DNAT 10.96.0.10:53 (kube-dns)
//!     nameserver <ClusterIP>              and 10.96.0.11:53 (kube-dns-upstream) → 10.244.2.2:53
//!     search default.svc.cluster.local svc.cluster.local cluster.local; options ndots:5
//! ```
//!
//! With `dual_stack`, every link also carries IPv6 (`fd00:244:1::/64`, `fd00:244:2::/64`),
//! kube-dns has the IPv6 ClusterIP `fd00:96::10` (`fd00:96::11` upstream), and the pod's
//! resolv.conf names the IPv6 server, so its queries travel over IPv6.
//!
//! kube-proxy is imitated in the mode asked for: iptables (a `KUBE-SERVICES` nat chain, and
//! kubelet's `KUBE-IPTABLES-HINT` chain as on a real node), nftables (`table ip kube-proxy`,
//! which nodedns's auto-detection recognises), or ipvs (the same DNAT, but pods are configured
//! with the link-local address only, and nodedns binds only that). The DNAT is what makes
//! conntrack run in the node namespace at all, so a conntrack count of zero means something.
//!
//! [`Node::add_coredns_replica`] adds a second CoreDNS pod (`10.244.3.2`, in a namespace of its
//! own) and spreads both ClusterIPs over the pods as kube-proxy's iptables mode does
//! (`-m statistic --mode random`, one rule per endpoint); [`Node::set_coredns_endpoints`] and
//! [`Node::forget_udp_flows_to`] are kube-proxy's reaction to an endpoint leaving.
//!
//! `ip netns exec <pod> getent hosts <name>` is glibc's real resolver reading the pod's
//! resolv.conf. Everything is torn down on drop, in order: processes, then namespaces.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::{ExitStatus, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::Signal;

use crate::knot::{Knot, Options, Zone};
use crate::netns::{self, Netns};
use crate::{PROBE_NAME, Process};

/// The node-local address (node-cache's documented default).
pub const LOCAL_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
/// The IPv6 node-local address in dual-stack nodes (a ULA, as the node-local-dns docs advise:
/// an fe80:: address would need a zone on every client).
pub const LOCAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10);
/// The kube-dns ClusterIP.
pub const KUBE_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const KUBE_DNS6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
/// The kube-dns-upstream ClusterIP: same endpoints, not intercepted on the node.
pub const KUBE_DNS_UPSTREAM: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
pub const KUBE_DNS_UPSTREAM6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);
pub const POD_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
pub const POD_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2);
/// Where CoreDNS (Knot) runs: the kube-dns endpoint.
pub const COREDNS_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 2);
pub const COREDNS_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 2);
/// Where the second CoreDNS pod runs ([`Node::add_coredns_replica`]).
pub const COREDNS2_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 2);

/// Tools a simulated node needs; tests skip (saying which is missing) without them.
pub const TOOLS: &[&str] = &[
    "ip",
    "iptables-restore",
    "ip6tables-restore",
    "nft",
    "conntrack",
    "knotd",
    "knotc",
    "dig",
    "getent",
];

/// Why node tests cannot run here (printed by the caller as the skip reason), or `None`.
pub fn unavailable() -> Option<String> {
    netns::unavailable(TOOLS)
}

/// How kube-proxy runs on the simulated node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    Iptables,
    Nftables,
    /// Pods use the link-local address; nodedns binds only that.
    Ipvs,
}

#[derive(Debug, Clone, Copy)]
pub struct NodeOptions {
    pub proxy: ProxyMode,
    pub dual_stack: bool,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            proxy: ProxyMode::Iptables,
            dual_stack: false,
        }
    }
}

/// The simulated node. Fields drop in order: Knot stops before the namespaces go.
#[derive(Debug)]
pub struct Node {
    knot: Knot,
    replica: Option<Replica>,
    pub node: Netns,
    pub pod: Netns,
    pub coredns: Netns,
    options: NodeOptions,
}

impl Node {
    /// Builds the namespaces, links, routes, kube-proxy's rules, the pod's resolv.conf, and
    /// starts Knot in the CoreDNS namespace serving [`Node::standard_zones`]. Returns once
    /// CoreDNS answers.
    pub fn build(options: NodeOptions) -> anyhow::Result<Node> {
        Node::build_serving(options, Node::standard_zones())
    }

    /// What CoreDNS serves on a node built with [`Node::build`]: [`Knot::cluster_local`] and a
    /// root zone (names outside the cluster get NXDOMAIN).
    pub fn standard_zones() -> Vec<Zone> {
        vec![Knot::cluster_local(), root_zone()]
    }

    /// [`Node::standard_zones`] with `records` (zone-file lines, names relative to
    /// `cluster.local.`) added to cluster.local.
    pub fn standard_zones_with(records: &str) -> Vec<Zone> {
        let mut zones = Node::standard_zones();
        zones
            .iter_mut()
            .find(|z| z.origin == "cluster.local.")
            .expect("the standard zones hold cluster.local")
            .body
            .push_str(records);
        zones
    }

    /// [`Node::build`] with CoreDNS serving `zones` instead (start from
    /// [`Node::standard_zones`] to add records or zones).
    pub fn build_serving(options: NodeOptions, zones: Vec<Zone>) -> anyhow::Result<Node> {
        let prefix = netns::unique_prefix();
        let node = Netns::create(&format!("{prefix}-node"))?;
        let pod = Netns::create(&format!("{prefix}-pod"))?;
        let coredns = Netns::create(&format!("{prefix}-dns"))?;
        node.veth("vp", &pod, "eth0")?;
        node.veth("vd", &coredns, "eth0")?;

        let ip = |ns: &Netns, args: &[&str]| ns.run("ip", args).map(|_| ());
        ip(&node, &["addr", "add", "10.244.1.1/24", "dev", "vp"])?;
        ip(&node, &["addr", "add", "10.244.2.1/24", "dev", "vd"])?;
        ip(&pod, &["addr", "add", "10.244.1.2/24", "dev", "eth0"])?;
        ip(&pod, &["route", "add", "default", "via", "10.244.1.1"])?;
        ip(&coredns, &["addr", "add", "10.244.2.2/24", "dev", "eth0"])?;
        ip(&coredns, &["route", "add", "default", "via", "10.244.2.1"])?;
        // ClusterIPs need a route for locally generated traffic (nodedns → kube-dns-upstream)
        // to get as far as the OUTPUT DNAT; a real node has its default route.
        ip(
            &node,
            &["route", "add", "10.96.0.0/12", "via", "10.244.2.2"],
        )?;
        node.run("sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
        if options.dual_stack {
            ip(
                &node,
                &[
                    "-6",
                    "addr",
                    "add",
                    "fd00:244:1::1/64",
                    "dev",
                    "vp",
                    "nodad",
                ],
            )?;
            ip(
                &node,
                &[
                    "-6",
                    "addr",
                    "add",
                    "fd00:244:2::1/64",
                    "dev",
                    "vd",
                    "nodad",
                ],
            )?;
            ip(
                &pod,
                &[
                    "-6",
                    "addr",
                    "add",
                    "fd00:244:1::2/64",
                    "dev",
                    "eth0",
                    "nodad",
                ],
            )?;
            ip(
                &pod,
                &["-6", "route", "add", "default", "via", "fd00:244:1::1"],
            )?;
            ip(
                &coredns,
                &[
                    "-6",
                    "addr",
                    "add",
                    "fd00:244:2::2/64",
                    "dev",
                    "eth0",
                    "nodad",
                ],
            )?;
            ip(
                &coredns,
                &["-6", "route", "add", "default", "via", "fd00:244:2::1"],
            )?;
            ip(
                &node,
                &["-6", "route", "add", "fd00:96::/64", "via", "fd00:244:2::2"],
            )?;
            node.run("sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"])?;
        }
        install_kube_proxy(&node, options)?;

        let nameserver = match (options.proxy, options.dual_stack) {
            (ProxyMode::Ipvs, false) => IpAddr::V4(LOCAL_IP),
            (ProxyMode::Ipvs, true) => IpAddr::V6(LOCAL_IP6),
            (_, false) => IpAddr::V4(KUBE_DNS),
            (_, true) => IpAddr::V6(KUBE_DNS6),
        };
        pod.set_resolv_conf(&pod_resolv_conf(nameserver, ""))?;
        // Anything in the node namespace that resolves goes to the simulated cluster, never to
        // the machine's own resolver.
        node.set_resolv_conf(&format!("nameserver {KUBE_DNS_UPSTREAM}\n"))?;

        let mut listen = vec![SocketAddr::from((COREDNS_IP, 53))];
        if options.dual_stack {
            listen.push(SocketAddr::from((COREDNS_IP6, 53)));
        }
        let knot = Knot::start(Options {
            listen,
            netns: Some(coredns.name().to_owned()),
            zones,
        })
        .context("start Knot as CoreDNS")?;
        Ok(Node {
            knot,
            replica: None,
            node,
            pod,
            coredns,
            options,
        })
    }

    /// The Knot standing in for CoreDNS (query counters).
    pub fn coredns(&self) -> &Knot {
        &self.knot
    }

    /// Starts a second CoreDNS pod ([`COREDNS2_IP`], its own namespace and link `vd2`, the same
    /// zones as the first) and makes kube-proxy spread both ClusterIPs over the two pods at
    /// random. IPv4 and kube-proxy's iptables mode only.
    pub fn add_coredns_replica(&mut self) -> anyhow::Result<&Replica> {
        if self.options.proxy != ProxyMode::Iptables || self.options.dual_stack {
            bail!("a second CoreDNS pod needs an IPv4 node with kube-proxy in iptables mode");
        }
        if self.replica.is_some() {
            bail!("the node already has a second CoreDNS pod");
        }
        let ns = Netns::create(&format!("{}2", self.coredns.name()))?;
        self.node.veth("vd2", &ns, "eth0")?;
        self.node
            .run("ip", &["addr", "add", "10.244.3.1/24", "dev", "vd2"])?;
        ns.run("ip", &["addr", "add", "10.244.3.2/24", "dev", "eth0"])?;
        ns.run("ip", &["route", "add", "default", "via", "10.244.3.1"])?;
        let knot = Knot::start(Options {
            listen: vec![SocketAddr::from((COREDNS2_IP, 53))],
            netns: Some(ns.name().to_owned()),
            zones: Node::standard_zones(),
        })
        .context("start Knot as the second CoreDNS pod")?;
        self.set_coredns_endpoints(&[COREDNS_IP, COREDNS2_IP])?;
        Ok(self.replica.insert(Replica {
            knot: Some(knot),
            ns,
        }))
    }

    /// The second CoreDNS pod, once added.
    pub fn replica(&self) -> Option<&Replica> {
        self.replica.as_ref()
    }

    /// The second CoreDNS pod, to stop it.
    pub fn replica_mut(&mut self) -> Option<&mut Replica> {
        self.replica.as_mut()
    }

    /// Rewrites kube-proxy's service rules (iptables mode) so that both ClusterIPs lead to
    /// `endpoints`, chosen at random for each new flow, as kube-proxy writes them: with `n`
    /// endpoints, rule `i` matches with probability `1/(n-i)` (`-m statistic --mode random`)
    /// and the last one always. One `iptables-restore`, so no packet sees a half-written chain.
    pub fn set_coredns_endpoints(&self, endpoints: &[Ipv4Addr]) -> anyhow::Result<()> {
        if self.options.proxy != ProxyMode::Iptables || self.options.dual_stack {
            bail!("endpoints can be changed on an IPv4 iptables-mode node only");
        }
        let mut rules = String::from("-F KUBE-SERVICES\n");
        for svc in [KUBE_DNS, KUBE_DNS_UPSTREAM] {
            for proto in ["udp", "tcp"] {
                for (i, endpoint) in endpoints.iter().enumerate() {
                    let left = endpoints.len() - i;
                    let statistic = if left > 1 {
                        format!(
                            "-m statistic --mode random --probability {:.11} ",
                            1.0 / left as f64
                        )
                    } else {
                        String::new()
                    };
                    rules.push_str(&format!(
                        "-A KUBE-SERVICES -d {svc}/32 -p {proto} -m {proto} --dport 53 {statistic}-j DNAT --to-destination {endpoint}:53\n"
                    ));
                }
            }
        }
        self.node
            .run_stdin("iptables-restore", &["--noflush"], &iptables_nat(&rules))?;
        Ok(())
    }

    /// Deletes the node's UDP conntrack entries of both ClusterIPs that were DNATed to
    /// `endpoint`, as kube-proxy does when an endpoint leaves (TCP entries stay: established
    /// connections keep going where they went). Returns how many were deleted.
    pub fn forget_udp_flows_to(&self, endpoint: Ipv4Addr) -> anyhow::Result<u64> {
        let mut deleted = 0;
        for svc in [KUBE_DNS, KUBE_DNS_UPSTREAM] {
            let out = self.node.output(
                "conntrack",
                &[
                    "-D",
                    "-p",
                    "udp",
                    "--orig-dst",
                    &svc.to_string(),
                    "--dst-nat",
                    &endpoint.to_string(),
                ],
            )?;
            // conntrack exits 1 when nothing matched; it says how many it deleted on stderr
            // (`conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.`).
            let said = String::from_utf8_lossy(&out.stderr);
            deleted += said
                .split_once(" flow entr")
                .and_then(|(head, _)| head.rsplit(' ').next()?.parse::<u64>().ok())
                .with_context(|| format!("conntrack -D: {}", said.trim()))?;
        }
        Ok(deleted)
    }

    /// What node-cache's `-localip` would be on this node: the link-local address(es), plus
    /// the kube-dns ClusterIP(s) unless kube-proxy runs in ipvs mode.
    pub fn local_ips(&self) -> Vec<IpAddr> {
        let mut ips = vec![IpAddr::V4(LOCAL_IP)];
        if self.options.dual_stack {
            ips.push(IpAddr::V6(LOCAL_IP6));
        }
        if self.options.proxy != ProxyMode::Ipvs {
            ips.push(IpAddr::V4(KUBE_DNS));
            if self.options.dual_stack {
                ips.push(IpAddr::V6(KUBE_DNS6));
            }
        }
        ips
    }

    /// Where nodedns forwards: kube-dns-upstream, or in ipvs mode kube-dns itself (which the
    /// node does not intercept there).
    pub fn upstream(&self) -> SocketAddr {
        match self.options.proxy {
            ProxyMode::Ipvs => SocketAddr::from((KUBE_DNS, 53)),
            _ => SocketAddr::from((KUBE_DNS_UPSTREAM, 53)),
        }
    }

    /// The address pods send their queries to (their resolv.conf nameserver).
    pub fn pod_nameserver(&self) -> IpAddr {
        match (self.options.proxy, self.options.dual_stack) {
            (ProxyMode::Ipvs, false) => IpAddr::V4(LOCAL_IP),
            (ProxyMode::Ipvs, true) => IpAddr::V6(LOCAL_IP6),
            (_, false) => IpAddr::V4(KUBE_DNS),
            (_, true) => IpAddr::V6(KUBE_DNS6),
        }
    }

    /// Rewrites the pod's resolv.conf with extra `options` (e.g. `timeout:1 attempts:1`, so
    /// that a single lost packet fails a lookup instead of being retried).
    pub fn set_pod_resolver_options(&self, options: &str) -> anyhow::Result<()> {
        self.pod
            .set_resolv_conf(&pod_resolv_conf(self.pod_nameserver(), options))
    }

    /// `getent hosts <names...>` in the pod: glibc's resolver with the pod's resolv.conf.
    pub fn getent(&self, names: &[&str]) -> anyhow::Result<Output> {
        let mut args = vec!["hosts"];
        args.extend_from_slice(names);
        self.pod.output("getent", &args)
    }

    /// Looks up every name in the pod, in one `getent` run; fails naming the output if any
    /// did not resolve.
    pub fn resolve_all(&self, names: &[&str]) -> anyhow::Result<()> {
        let out = self.getent(names)?;
        if !out.status.success() {
            bail!(
                "getent hosts {} names: {} ({}) stdout:\n{}",
                names.len(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        // getent prints a line per address, under the canonical (search-expanded) name.
        let stdout = String::from_utf8_lossy(&out.stdout);
        for name in names {
            if !stdout.contains(&format!(" {name}.")) {
                bail!("{name} is missing from getent's output:\n{stdout}");
            }
        }
        Ok(())
    }

    /// Conntrack entries in the node namespace for `proto` to port 53 whose original source is
    /// the pod (IPv4 or, on dual-stack nodes, IPv6).
    pub fn pod_dns_flows(&self, proto: &str) -> anyhow::Result<Vec<String>> {
        let mut flows = Vec::new();
        let families: &[(&str, String)] = &[
            ("ipv4", format!("src={POD_IP} ")),
            ("ipv6", format!("src={POD_IP6} ")),
        ];
        for (family, src) in families {
            flows.extend(
                self.conntrack(family, proto)?
                    .into_iter()
                    .filter(|l| first_src(l).is_some_and(|s| s == src.as_str())),
            );
        }
        Ok(flows)
    }

    /// Conntrack entries in the node namespace for TCP to port 53 from the node itself (not
    /// from the pod): nodedns's upstream connections.
    pub fn node_upstream_tcp_flows(&self) -> anyhow::Result<Vec<String>> {
        let pod = [format!("src={POD_IP} "), format!("src={POD_IP6} ")];
        let mut flows = Vec::new();
        for family in ["ipv4", "ipv6"] {
            flows.extend(
                self.conntrack(family, "tcp")?
                    .into_iter()
                    .filter(|l| !pod.iter().any(|p| first_src(l) == Some(p.as_str()))),
            );
        }
        Ok(flows)
    }

    fn conntrack(&self, family: &str, proto: &str) -> anyhow::Result<Vec<String>> {
        let out = self.node.output(
            "conntrack",
            &["-L", "-f", family, "-p", proto, "--dport", "53"],
        )?;
        if !out.status.success() {
            bail!(
                "conntrack -L: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect())
    }

    /// Empties the node's conntrack table.
    pub fn conntrack_flush(&self) -> anyhow::Result<()> {
        for family in ["ipv4", "ipv6"] {
            let _ = self.node.output("conntrack", &["-F", "-f", family])?;
        }
        Ok(())
    }

    /// Whether link `name` exists in the node namespace.
    pub fn has_link(&self, name: &str) -> bool {
        self.node
            .output("ip", &["link", "show", name])
            .is_ok_and(|out| out.status.success())
    }

    /// Every rule line in the node (iptables-save and ip6tables-save in both modes, and the
    /// nft ruleset, without counters) that mentions nodedns or node-cache.
    pub fn dns_cache_rules(&self) -> anyhow::Result<Vec<String>> {
        let mut lines = Vec::new();
        for tool in [
            "iptables-nft-save",
            "ip6tables-nft-save",
            "iptables-legacy-save",
            "ip6tables-legacy-save",
        ] {
            if !crate::have(tool) {
                continue;
            }
            let text = self.node.run(tool, &[])?;
            lines.extend(
                text.lines()
                    .filter(|l| l.starts_with("-A ") || l.starts_with(':'))
                    .filter(|l| mentions_dns_cache(l))
                    .map(|l| format!("{tool}: {l}")),
            );
        }
        let nft = self.node.run("nft", &["--stateless", "list", "ruleset"])?;
        lines.extend(
            nft.lines()
                .filter(|l| mentions_dns_cache(l))
                .map(|l| format!("nft: {}", l.trim())),
        );
        Ok(lines)
    }

    /// `iptables-save` of the node (IPv4, nft mode: this machine's default).
    pub fn iptables_save(&self) -> anyhow::Result<String> {
        self.node.run("iptables-save", &[])
    }

    /// `nft list table inet nodedns`, or `None` if it does not exist.
    pub fn nodedns_nft_table(&self) -> anyhow::Result<Option<String>> {
        let out = self
            .node
            .output("nft", &["list", "table", "inet", "nodedns"])?;
        Ok(out
            .status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
    }

    /// Starts `nodedns run` in the node namespace with this node's local IPs and upstream,
    /// `--link-kind bridge` (this kernel has no dummy driver), a 1 s sync interval, and
    /// `extra`; returns once it answers on the link-local address.
    pub fn start_nodedns(&self, extra: &[&str]) -> anyhow::Result<NodeAgent> {
        let bin = crate::nodedns_bin();
        let ips: Vec<String> = self.local_ips().iter().map(IpAddr::to_string).collect();
        let mut command = self.node.command(bin.to_str().context("binary path")?);
        command
            .arg("run")
            .arg("--local-ip")
            .arg(ips.join(","))
            .arg("--upstream")
            .arg(self.upstream().to_string())
            .args(["--link-kind", "bridge", "--sync-interval", "1s"])
            .args(extra)
            .env("RUST_BACKTRACE", "1")
            .env("NO_COLOR", "1");
        let process = Process::spawn("nodedns", command).context("spawn nodedns")?;
        let mut agent = NodeAgent { process };
        agent
            .wait_answering(self, Duration::from_secs(20))
            .with_context(|| format!("nodedns output:\n{}", agent.output()))?;
        Ok(agent)
    }

    /// Starts the `nodedns` binary in the node namespace with exactly `args` (node-cache's flat
    /// command line works as it is) and returns once its output contains `ready`. For an
    /// instance beside another, which "answers" from the start.
    pub fn spawn_nodedns(
        &self,
        name: &str,
        args: &[&str],
        ready: &str,
    ) -> anyhow::Result<NodeAgent> {
        let bin = crate::nodedns_bin();
        let mut command = self.node.command(bin.to_str().context("binary path")?);
        command
            .args(args)
            .env("RUST_BACKTRACE", "1")
            .env("NO_COLOR", "1")
            .env_remove("NODEDNS_HANDOFF_DIR");
        let process = Process::spawn(name, command).context("spawn nodedns")?;
        let mut agent = NodeAgent { process };
        agent.process.wait_output(ready, Duration::from_secs(20))?;
        Ok(agent)
    }

    /// `GET <path>` over HTTP/1.0 to `addr` from the node namespace (bash's `/dev/tcp`, so no
    /// HTTP client needs to be installed); returns the body.
    pub fn http_get(&self, addr: SocketAddr, path: &str) -> anyhow::Result<String> {
        let script = format!(
            "exec 3<>/dev/tcp/{}/{} && printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3",
            addr.ip(),
            addr.port()
        );
        let response = self.node.run("bash", &["-c", &script])?;
        match response.split_once("\r\n\r\n") {
            Some((head, body)) if head.contains(" 200 ") => Ok(body.to_owned()),
            _ => bail!("GET {path} from {addr}: {response}"),
        }
    }

    /// Whether a DNS server answers (any RCODE) at `server`:53, asked from the node namespace.
    pub fn answers(&self, server: IpAddr) -> bool {
        self.node
            .output(
                "dig",
                &[
                    &format!("@{server}"),
                    "+tries=1",
                    "+time=1",
                    "+short",
                    PROBE_NAME,
                ],
            )
            .is_ok_and(|out| out.status.success())
    }

    /// `dig @<server> <name> A +short` from the pod: the addresses answered.
    pub fn dig_from_pod(&self, server: IpAddr, name: &str, rtype: &str) -> anyhow::Result<String> {
        let out = self.pod.output(
            "dig",
            &[
                &format!("@{server}"),
                "+tries=1",
                "+time=2",
                "+short",
                name,
                rtype,
            ],
        )?;
        if !out.status.success() {
            bail!(
                "dig @{server} {name} {rtype}: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

/// The second CoreDNS pod of a node ([`Node::add_coredns_replica`]): Knot in a namespace of its
/// own at [`COREDNS2_IP`]. Knot stops before the namespace goes.
#[derive(Debug)]
pub struct Replica {
    /// `None` once stopped.
    knot: Option<Knot>,
    pub ns: Netns,
}

impl Replica {
    /// Its Knot (query counters), until stopped.
    pub fn knot(&self) -> Option<&Knot> {
        self.knot.as_ref()
    }

    /// Drops every packet in and out of the pod (nftables, at a priority before anything else),
    /// as when its node dies: no FIN, no RST, no ICMP; ARP still answers, so the node keeps
    /// sending. Knot keeps running and never sees them.
    pub fn silence(&self) -> anyhow::Result<()> {
        self.ns.run_stdin(
            "nft",
            &["-f", "-"],
            "table inet silence {\n\
             \tchain in { type filter hook prerouting priority -500; policy drop; }\n\
             \tchain out { type filter hook output priority -500; policy drop; }\n\
             }\n",
        )?;
        Ok(())
    }

    /// Stops Knot (SIGTERM): it closes its connections (FIN) and exits.
    pub fn stop(&mut self) {
        if let Some(knot) = self.knot.take() {
            knot.stop();
        }
    }
}

/// nodedns running in a node namespace. SIGTERM (then SIGKILL) by PID on drop; its output is
/// printed if the test is failing.
#[derive(Debug)]
pub struct NodeAgent {
    process: Process,
}

impl NodeAgent {
    fn wait_answering(&mut self, node: &Node, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.process.exited() {
                bail!("nodedns exited during start-up: {status}");
            }
            if node.answers(IpAddr::V4(LOCAL_IP)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("nodedns did not answer on {LOCAL_IP} within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn output(&self) -> String {
        self.process.output()
    }

    pub fn alive(&mut self) -> bool {
        self.process.exited().is_none()
    }

    /// Sends SIGTERM and waits up to `limit` for the exit.
    pub fn terminate(&mut self, limit: Duration) -> anyhow::Result<ExitStatus> {
        self.process.signal(Signal::SIGTERM)?;
        self.process
            .wait_timeout(limit)
            .with_context(|| format!("nodedns still running {limit:?} after SIGTERM"))
    }

    /// `kill -9`: no teardown happens.
    pub fn kill9(mut self) -> anyhow::Result<()> {
        self.process.signal(Signal::SIGKILL)?;
        self.process
            .wait_timeout(Duration::from_secs(5))
            .context("nodedns survived SIGKILL")?;
        Ok(())
    }
}

/// A lookup loop in the pod: `dig` batches of 200 queries (cluster names, and names that do
/// not exist) against `server`, one after the other until [`PodLoad::finish`]; counts the
/// queries that got no NOERROR or NXDOMAIN answer within `dig`'s own tries.
#[derive(Debug)]
pub struct PodLoad {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    examples: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What a [`PodLoad`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodLoadReport {
    pub sent: u64,
    pub failed: u64,
    /// `dig`'s comments from the first few batches with a failure.
    pub examples: Vec<String>,
}

impl PodLoad {
    /// Starts the loop; `tries` is `dig`'s `+tries` (a stub resolver's attempts: 1 counts every
    /// lost datagram as a failure), each of `time` seconds. `dir` holds the batch file.
    pub fn start(node: &Node, server: IpAddr, tries: u8, time: u8, dir: &Path) -> PodLoad {
        let batch = dir.join(format!("batch-{server}-{tries}"));
        let mut lines = String::new();
        for i in 0..200 {
            let name = match i % 4 {
                0 => "kubernetes.default.svc.cluster.local".to_owned(),
                1 => "web.default.svc.cluster.local".to_owned(),
                2 => "kube-dns.kube-system.svc.cluster.local".to_owned(),
                _ => format!("n{i}.nothere.svc.cluster.local"),
            };
            lines.push_str(&format!("@{server} +tries={tries} +time={time} {name} A\n"));
        }
        std::fs::write(&batch, lines).expect("write the dig batch");
        let pod = node.pod.name().to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let examples = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, sent, failed, examples) =
                (stop.clone(), sent.clone(), failed.clone(), examples.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let out = std::process::Command::new("ip")
                        .args(["netns", "exec", &pod, "dig", "-f"])
                        .arg(&batch)
                        .output()
                        .expect("run dig");
                    let text = String::from_utf8_lossy(&out.stdout);
                    let good = text
                        .lines()
                        .filter(|l| l.contains("->>HEADER<<-"))
                        .filter(|l| l.contains("status: NOERROR") || l.contains("status: NXDOMAIN"))
                        .count() as u64;
                    sent.fetch_add(200, Ordering::Relaxed);
                    if good < 200 {
                        failed.fetch_add(200 - good, Ordering::Relaxed);
                        let mut examples = examples.lock().unwrap();
                        if examples.len() < 5 {
                            examples.push(
                                text.lines()
                                    .filter(|l| l.starts_with(";;"))
                                    .take(20)
                                    .collect::<Vec<_>>()
                                    .join("\n"),
                            );
                        }
                    }
                }
            })
        };
        PodLoad {
            stop,
            sent,
            failed,
            examples,
            thread: Some(thread),
        }
    }

    /// Queries sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Stops the loop (after the batch under way) and reports.
    pub fn finish(mut self) -> PodLoadReport {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the pod's lookup loop");
        }
        PodLoadReport {
            sent: self.sent.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            examples: self.examples.lock().unwrap().clone(),
        }
    }
}

impl Drop for PodLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Polls `condition` every 50 ms until it holds or `limit` passes.
pub fn wait_for(
    what: &str,
    limit: Duration,
    mut condition: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The root zone, so that names outside cluster.local get NXDOMAIN (cacheable, as from a real
/// CoreDNS forwarding to the node's resolvers) instead of REFUSED. glibc asks for the bare name
/// last (`kubernetes.default.`) when the search list fails, e.g. for AAAA.
fn root_zone() -> Zone {
    Zone {
        origin: ".".to_owned(),
        body: "@ 30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 30\n\
               @ 30 IN NS ns.dns.cluster.local.\n"
            .to_owned(),
    }
}

fn pod_resolv_conf(nameserver: IpAddr, options: &str) -> String {
    format!(
        "search default.svc.cluster.local svc.cluster.local cluster.local\n\
         nameserver {nameserver}\n\
         options ndots:5 {options}\n"
    )
}

fn mentions_dns_cache(line: &str) -> bool {
    line.contains("nodedns") || line.contains("NODEDNS") || line.contains("NodeLocal DNS Cache")
}

/// The first `src=... ` field of a conntrack line (the original direction), with its space.
fn first_src(line: &str) -> Option<&str> {
    let start = line.find("src=")?;
    let end = line[start..].find(' ')? + start + 1;
    Some(&line[start..end])
}

/// kube-proxy's part: DNAT from the ClusterIPs to the CoreDNS pod, for traffic from pods
/// (PREROUTING) and from the node itself (OUTPUT).
fn install_kube_proxy(node: &Netns, options: NodeOptions) -> anyhow::Result<()> {
    let services4 = [KUBE_DNS, KUBE_DNS_UPSTREAM];
    let services6 = [KUBE_DNS6, KUBE_DNS_UPSTREAM6];
    match options.proxy {
        ProxyMode::Iptables | ProxyMode::Ipvs => {
            let mut rules4 = String::new();
            for svc in services4 {
                for proto in ["udp", "tcp"] {
                    rules4.push_str(&format!(
                        "-A KUBE-SERVICES -d {svc}/32 -p {proto} -m {proto} --dport 53 -j DNAT --to-destination {COREDNS_IP}:53\n"
                    ));
                }
            }
            node.run_stdin("iptables-restore", &["--noflush"], &iptables_nat(&rules4))?;
            if options.dual_stack {
                let mut rules6 = String::new();
                for svc in services6 {
                    for proto in ["udp", "tcp"] {
                        rules6.push_str(&format!(
                            "-A KUBE-SERVICES -d {svc}/128 -p {proto} -m {proto} --dport 53 -j DNAT --to-destination [{COREDNS_IP6}]:53\n"
                        ));
                    }
                }
                node.run_stdin("ip6tables-restore", &["--noflush"], &iptables_nat(&rules6))?;
            }
        }
        ProxyMode::Nftables => {
            let mut script =
                nft_kube_proxy("ip", &services4.map(IpAddr::V4), &IpAddr::V4(COREDNS_IP));
            if options.dual_stack {
                script.push_str(&nft_kube_proxy(
                    "ip6",
                    &services6.map(IpAddr::V6),
                    &IpAddr::V6(COREDNS_IP6),
                ));
            }
            node.run_stdin("nft", &["-f", "-"], &script)?;
        }
    }
    Ok(())
}

fn iptables_nat(services: &str) -> String {
    format!(
        "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n\
         *nat\n:KUBE-SERVICES - [0:0]\n\
         -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         {services}COMMIT\n"
    )
}

fn nft_kube_proxy(family: &str, services: &[IpAddr], endpoint: &IpAddr) -> String {
    let target = match endpoint {
        IpAddr::V4(ip) => format!("{ip}:53"),
        IpAddr::V6(ip) => format!("[{ip}]:53"),
    };
    let mut rules = String::new();
    for svc in services {
        for proto in ["udp", "tcp"] {
            rules.push_str(&format!(
                "\t\t{family} daddr {svc} {proto} dport 53 dnat to {target}\n"
            ));
        }
    }
    format!(
        "table {family} kube-proxy {{\n\
         \tchain services {{\n{rules}\t}}\n\
         \tchain nat-prerouting {{\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t\tjump services\n\t}}\n\
         \tchain nat-output {{\n\t\ttype nat hook output priority -100; policy accept;\n\t\tjump services\n\t}}\n\
         }}\n"
    )
}
