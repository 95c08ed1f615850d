//! The corpus: NodeLocal DNSCache configurations that installers, charts and users really run
//! (`integration/testdata/corpus/`, its README says where each comes from), each loaded by
//! `nodedns run --check-config` with the DaemonSet's own arguments and then served on a node of
//! its own, where every query of the case's `expect` file must get the answer node-cache gave.
//!
//! A case is a directory: `case` (where it comes from, the node's addresses, the pod's
//! environment), `args` (the node-cache container's arguments, one per line), `etc/` (the files
//! the pod sees under `/etc`: the ConfigMaps as mounted) and `expect` (the queries, and what
//! node-cache 1.23.1 — CoreDNS 1.10.0 — answered). The node is a network namespace holding the
//! case's local addresses, where the agent runs; the network beyond it is a second namespace,
//! reached through a veth pair, where Knot serves the cluster DNS at the case's cluster
//! addresses, the node's resolver at 10.0.0.2 (the node's resolv.conf), a second resolver at
//! 10.0.0.4 and external zones at 10.0.0.53 and 10.0.0.54, and where nothing listens on
//! 10.0.0.99. Paths under `/etc/` and `/tmp/` (in the arguments and in the mounted files) move
//! into the case's temporary directory, as the pod's volume mounts would place them;
//! `/etc/resolv.conf` stays (inside the namespace it is the node's).
//!
//! The answers are node-cache's, recorded by this same harness: with
//! `NODEDNS_CORPUS_REFERENCE=<node-cache binary>` each test runs that binary instead of nodedns
//! and rewrites the case's `expect` file with what it answered.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::stock_node::in_netns;
use anyhow::{Context, bail};
use hickory_proto::op::{Edns, Message, MessageType};
use hickory_proto::rr::{Record, RecordType};
use nodedns_integration::knot::{Knot, Options, Zone};
use nodedns_integration::netns::{self, Netns};
use nodedns_integration::{Process, TempDir, client, nodedns_bin};

/// The node's resolver: the namespace's resolv.conf names it.
const RESOLVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
/// A second resolver, for configurations that name upstream servers of their own.
const SPARE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 4);
/// The servers of external zones (`example.com`, stub domains, ...): one Knot on both.
const EXTERNAL: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 0, 0, 53), Ipv4Addr::new(10, 0, 0, 54)];
/// An address on the node where nothing listens.
const DEAD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 99);
/// The zones the external servers serve, each `* A 192.0.2.53`.
const EXTERNAL_ZONES: &[&str] = &[
    "example.com.",
    "example.io.",
    "mycompany.local.",
    "mydomain.tld.",
    "website.tld.",
    "acme.local.",
    "global.",
    "my.domain.",
];
/// The source port of every query: `whoami` puts it in its answer.
const CLIENT_PORT: u16 = 40053;
/// How long one query or HTTP request may take: beyond the agent's own deadline for a query
/// (4.5 s), so a failure shows as the agent's answer (SERVFAIL), not as no reply.
const PATIENCE: Duration = Duration::from_secs(6);
/// Environment variable naming the reference binary (node-cache) to record answers from.
const REFERENCE: &str = "NODEDNS_CORPUS_REFERENCE";

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/corpus")
}

macro_rules! corpus {
    (
        cases { $($test:ident => $dir:literal,)* }
        gaps { $($gap:ident => $gap_dir:literal: $why:literal,)* }
    ) => {
        $(
            #[test]
            fn $test() {
                let _turn = crate::shared();
                run_case($dir, None);
            }
        )*
        $(
            /// A case nodedns does not answer as node-cache does yet (issue 11): the test
            /// fails once it does, so that the case moves to the others.
            #[test]
            fn $gap() {
                let _turn = crate::shared();
                run_case($gap_dir, Some($why));
            }
        )*
        /// Every case directory, in the order of the tests above.
        const CASES: &[&str] = &[$($dir,)* $($gap_dir),*];
    };
}

corpus! {
    cases {
        k8s_addon_iptables => "k8s-addon-iptables",
        k8s_addon_ipvs => "k8s-addon-ipvs",
        k8s_addon_kube_dns_configmap => "k8s-addon-kube-dns-configmap",
        rke1_v115 => "rke1-v115",
        rke1_v121 => "rke1-v121",
        rke2 => "rke2",
        rke2_extra_cluster_domains => "rke2-extra-cluster-domains",
        rke2_ipvs => "rke2-ipvs",
        rke2_cilium_lrp => "rke2-cilium-lrp",
        kubespray => "kubespray",
        kubespray_2018 => "kubespray-2018",
        kubespray_external_zones_rewrite => "kubespray-external-zones-rewrite",
        kubespray_secondary_primary => "kubespray-secondary-primary",
        kubespray_secondary => "kubespray-secondary",
        kubespray_forward_options => "kubespray-forward-options",
        kubespray_old_dns_domains => "kubespray-old-dns-domains",
        kubespray_metrics_host_ip => "kubespray-metrics-host-ip",
        kubespray_additional_configs => "kubespray-additional-configs",
        kops => "kops",
        kops_ipvs => "kops-ipvs",
        kops_forward_to_kube_dns => "kops-forward-to-kube-dns",
        deliveryhero => "deliveryhero",
        deliveryhero_issue_670 => "deliveryhero-issue-670",
        lablabs => "lablabs",
        lablabs_cilium => "lablabs-cilium",
        kubeasz_iptables => "kubeasz-iptables",
        kubeasz_ipvs => "kubeasz-ipvs",
        kubeone => "kubeone",
        kubeone_cilium => "kubeone-cilium",
        kubeone_2021 => "kubeone-2021",
        aks_xenit => "aks-xenit",
        aks_xenit_cilium => "aks-xenit-cilium",
        aks_xenit_coredns_upstream => "aks-xenit-coredns-upstream",
        cilium_lrp_example => "cilium-lrp-example",
        variation_file => "variation-file",
        variation_forward_tls => "variation-forward-tls",
        variation_prefetch_duration => "variation-prefetch-duration",
        variation_quiet_flag => "variation-quiet-flag",
        variation_reloadwithsignal_flag => "variation-reloadwithsignal-flag",
        variation_timeouts => "variation-timeouts",
        gardener => "gardener",
        gardener_ipv6 => "gardener-ipv6",
        variation_cache_disable => "variation-cache-disable",
        variation_cache_keepttl => "variation-cache-keepttl",
        variation_cache_zones => "variation-cache-zones",
        variation_debug => "variation-debug",
        variation_errors_consolidate => "variation-errors-consolidate",
        variation_import_snippet => "variation-import-snippet",
        variation_trace => "variation-trace",
        variation_zones_different_ports => "variation-zones-different-ports",
        variation_bufsize => "variation-bufsize",
        variation_loadbalance => "variation-loadbalance",
        kubespray_etchosts => "kubespray-etchosts",
        deliveryhero_logging_no_ipv6 => "deliveryhero-logging-no-ipv6",
        deliveryhero_prefetch_serve_stale => "deliveryhero-prefetch-serve-stale",
        lablabs_hosts_template => "lablabs-hosts-template",
        gardener_custom => "gardener-custom",
        variation_bind_interface => "variation-bind-interface",
        variation_forward_health_check_options => "variation-forward-health-check-options",
        variation_hosts => "variation-hosts",
        variation_log_format_classes => "variation-log-format-classes",
        variation_prometheus_per_block => "variation-prometheus-per-block",
        variation_reload_per_block => "variation-reload-per-block",
        variation_serve_stale_verify => "variation-serve-stale-verify",
        variation_template_nxdomain => "variation-template-nxdomain",
        variation_whoami => "variation-whoami",
        kubekey_v3 => "kubekey-v3",
        kubekey_v4 => "kubekey-v4",
        issue_dns_525_rewrite => "issue-dns-525-rewrite",
        variation_rewrite_answer_auto => "variation-rewrite-answer-auto",
        variation_rewrite_type_edns0 => "variation-rewrite-type-edns0",
        kubespray_external_zones => "kubespray-external-zones",
        variation_tls_server_block => "variation-tls-server-block",
        kops_ipv6 => "kops-ipv6",
        variation_dns64 => "variation-dns64",
        variation_forward_next => "variation-forward-next",
        variation_forward_two_lines => "variation-forward-two-lines",
    }
    gaps {
        variation_pprof => "variation-pprof": "pprof: node-cache serves Go profiles, nodedns nothing (by design)",
    }
}

#[test]
fn every_corpus_directory_has_a_test() {
    let mut dirs: Vec<String> = std::fs::read_dir(corpus_dir())
        .expect("read the corpus directory")
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().join("case").is_file())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    let mut listed: Vec<String> = CASES.iter().map(|s| (*s).to_owned()).collect();
    listed.sort();
    assert_eq!(
        dirs, listed,
        "corpus directories and the tests in corpus.rs differ"
    );
}

/// Runs one case: against nodedns (the test), or against the reference binary (recording).
/// A case with a known `gap` must still differ from node-cache's answers.
fn run_case(name: &str, gap: Option<&str>) {
    if let Some(why) = netns::unavailable(&["ip", "knotd", "knotc"]) {
        eprintln!("skipped: {why}");
        return;
    }
    let case = Case::load(name).unwrap_or_else(|e| panic!("corpus case {name}: {e:#}"));
    let Some(reference) = std::env::var_os(REFERENCE) else {
        return match (check(&case), gap) {
            (Err(e), None) => panic!("{e:#}"),
            (Err(e), Some(why)) => eprintln!("corpus case {name}: known gap ({why}):\n{e:#}"),
            (Ok(()), Some(why)) => panic!(
                "corpus case {name} now gets node-cache's answers (its gap was: {why}): \
                 move it from `gaps` to `cases` in corpus.rs"
            ),
            (Ok(()), None) => {}
        };
    };
    if let Err(e) = record(&case, Path::new(&reference)) {
        panic!("{e:#}");
    }
}

/// One case directory, parsed.
#[derive(Debug)]
struct Case {
    name: String,
    dir: PathBuf,
    source: String,
    /// Addresses the agent serves on (`bind`, `-localip`): put on the node's loopback.
    local: Vec<IpAddr>,
    /// Where the cluster DNS answers (the kube-dns-upstream or kube-dns ClusterIP).
    cluster: Vec<IpAddr>,
    /// The pod's environment (Service variables, `fieldRef`s).
    env: Vec<(String, String)>,
    /// Corefile lines (`newer-line`) and arguments (`newer-arg`) newer than the reference
    /// node-cache: it is recorded without them.
    newer_lines: Vec<String>,
    newer_args: Vec<String>,
    /// The container's arguments, as in the DaemonSet.
    args: Vec<String>,
    expect: Expect,
}

/// The `expect` file: whether node-cache loads the configuration, and the checks.
#[derive(Debug)]
struct Expect {
    header: Vec<String>,
    loads: Loads,
    checks: Vec<Check>,
}

#[derive(Debug, Clone, PartialEq)]
enum Loads {
    Yes,
    /// node-cache exits at start with this message.
    No(String),
}

#[derive(Debug)]
struct Check {
    /// Line of the `query`/`http` line in `expect`.
    line: usize,
    what: Probe,
    /// Text after `;`: what the check exercises, echoed in failures.
    note: String,
    /// node-cache's result; `None` before the first recording.
    want: Option<Observed>,
}

#[derive(Debug, Clone)]
enum Probe {
    Query {
        server: SocketAddr,
        name: String,
        rtype: RecordType,
        transport: Transport,
        edns: bool,
    },
    Http {
        addr: SocketAddr,
        path: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
    Tls,
}

impl Transport {
    /// The port a query line means when it names none.
    fn default_port(self) -> u16 {
        if self == Transport::Tls { 853 } else { 53 }
    }
}

/// What came back, in the `expect` file's words (one line each).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    lines: Vec<String>,
}

impl Case {
    fn load(name: &str) -> anyhow::Result<Case> {
        let dir = corpus_dir().join(name);
        let meta = read(&dir.join("case"))?;
        let mut case = Case {
            name: name.to_owned(),
            dir: dir.clone(),
            source: String::new(),
            local: Vec::new(),
            cluster: Vec::new(),
            env: Vec::new(),
            newer_lines: Vec::new(),
            newer_args: Vec::new(),
            args: Vec::new(),
            expect: Expect::parse(&read(&dir.join("expect"))?)
                .with_context(|| format!("{}", dir.join("expect").display()))?,
        };
        for (n, line) in meta.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line
                .split_once(':')
                .with_context(|| format!("case:{}: `key: value` expected", n + 1))?;
            let value = value.trim();
            let addrs = |v: &str| -> anyhow::Result<Vec<IpAddr>> {
                v.split_whitespace()
                    .map(|a| a.parse().with_context(|| format!("case:{}: {a}", n + 1)))
                    .collect()
            };
            match key.trim() {
                "source" => case.source = value.to_owned(),
                "local" => case.local = addrs(value)?,
                "cluster" => case.cluster = addrs(value)?,
                "env" => {
                    let (k, v) = value
                        .split_once('=')
                        .with_context(|| format!("case:{}: env NAME=VALUE", n + 1))?;
                    case.env.push((k.to_owned(), v.to_owned()));
                }
                "newer-line" => case.newer_lines.push(value.to_owned()),
                "newer-arg" => case.newer_args.push(value.to_owned()),
                other => bail!("case:{}: unknown key `{other}`", n + 1),
            }
        }
        case.args = read(&dir.join("args"))?
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
        Ok(case)
    }
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))
}

impl Expect {
    fn parse(text: &str) -> anyhow::Result<Expect> {
        let mut expect = Expect {
            header: Vec::new(),
            loads: Loads::Yes,
            checks: Vec::new(),
        };
        let mut seen_loads = false;
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            if raw.starts_with('#') {
                if expect.checks.is_empty() && !seen_loads {
                    expect.header.push(raw.to_owned());
                }
                continue;
            }
            if raw.trim().is_empty() {
                continue;
            }
            if let Some(result) = raw.strip_prefix("  ") {
                let check = expect
                    .checks
                    .last_mut()
                    .with_context(|| format!("line {n}: a result line before any check"))?;
                check
                    .want
                    .get_or_insert_with(|| Observed { lines: Vec::new() })
                    .lines
                    .push(result.trim().to_owned());
                continue;
            }
            let (body, note) = match raw.split_once(';') {
                Some((b, note)) => (b.trim(), note.trim().to_owned()),
                None => (raw.trim(), String::new()),
            };
            let words: Vec<&str> = body.split_whitespace().collect();
            match words.as_slice() {
                ["loads"] => {
                    expect.loads = Loads::Yes;
                    seen_loads = true;
                }
                ["rejects:", ..] => {
                    expect.loads = Loads::No(body["rejects:".len()..].trim().to_owned());
                    seen_loads = true;
                }
                ["query", server, name, rtype, options @ ..] => {
                    let mut transport = Transport::Udp;
                    let mut edns = false;
                    for option in options {
                        match *option {
                            "tcp" => transport = Transport::Tcp,
                            "tls" => transport = Transport::Tls,
                            "edns" => edns = true,
                            other => bail!("line {n}: unknown query option `{other}`"),
                        }
                    }
                    let default_port = transport.default_port();
                    expect.checks.push(Check {
                        line: n,
                        what: Probe::Query {
                            server: socket_addr(server, default_port)
                                .with_context(|| format!("line {n}"))?,
                            name: (*name).to_owned(),
                            rtype: RecordType::from_str(rtype)
                                .map_err(|e| anyhow::anyhow!("line {n}: {rtype}: {e}"))?,
                            transport,
                            edns,
                        },
                        note,
                        want: None,
                    });
                }
                ["http", addr, path] => expect.checks.push(Check {
                    line: n,
                    what: Probe::Http {
                        addr: socket_addr(addr, 80).with_context(|| format!("line {n}"))?,
                        path: (*path).to_owned(),
                    },
                    note,
                    want: None,
                }),
                _ => bail!("line {n}: not a check: {raw}"),
            }
        }
        Ok(expect)
    }

    /// The file again under `header`, with `loads` and `observed` (one per check) as the
    /// recorded results.
    fn render(&self, header: &[String], loads: &Loads, observed: &[Option<Observed>]) -> String {
        let mut out = String::new();
        for line in header {
            let _ = writeln!(out, "{line}");
        }
        match loads {
            Loads::Yes => out.push_str("loads\n"),
            Loads::No(why) => {
                let _ = writeln!(out, "rejects: {why}");
            }
        }
        for (check, seen) in self.checks.iter().zip(observed) {
            out.push('\n');
            let _ = write!(out, "{}", check.what);
            if !check.note.is_empty() {
                let _ = write!(out, " ; {}", check.note);
            }
            out.push('\n');
            for line in seen.iter().flat_map(|seen| &seen.lines) {
                let _ = writeln!(out, "  {line}");
            }
        }
        out
    }
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::Query {
                server,
                name,
                rtype,
                transport,
                edns,
            } => {
                let default_port = transport.default_port();
                let server = if server.port() == default_port {
                    server.ip().to_string()
                } else {
                    server.to_string()
                };
                write!(f, "query {server} {name} {rtype}")?;
                match transport {
                    Transport::Udp => {}
                    Transport::Tcp => write!(f, " tcp")?,
                    Transport::Tls => write!(f, " tls")?,
                }
                if *edns {
                    write!(f, " edns")?;
                }
                Ok(())
            }
            Probe::Http { addr, path } => write!(f, "http {addr} {path}"),
        }
    }
}

/// `ADDR`, `ADDR:PORT`, `[V6]:PORT` or a bare IPv6 address.
fn socket_addr(text: &str, default_port: u16) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let ip: IpAddr = text
        .parse()
        .with_context(|| format!("`{text}` is not an address"))?;
    Ok(SocketAddr::new(ip, default_port))
}

/// The node of one case, and the network beyond it: the agent runs in `ns`, which holds the local
/// addresses (a wildcard `bind` there sees only them, as on a node); the servers run in `net`,
/// which holds the upstream addresses, reached through a veth pair. Fields drop in order: the
/// agent and the servers stop before the directories and the namespaces go.
struct Node {
    agent: Option<Process>,
    servers: Vec<Knot>,
    /// Where the pod's `/etc/...` and `/tmp/...` paths are.
    root: TempDir,
    ns: Netns,
    net: Netns,
}

/// The veth pair between the node and the network: IPv4 and IPv6 addresses of each end.
const LINK_NODE: (&str, &str) = ("192.168.255.1", "fd99::1");
const LINK_NET: (&str, &str) = ("192.168.255.2", "fd99::2");

impl Node {
    /// The namespaces with the case's addresses, the mounted files, and no servers yet.
    fn prepare(case: &Case) -> anyhow::Result<Node> {
        let prefix = netns::unique_prefix();
        let ns = Netns::create(&format!("{prefix}-node"))?;
        let net = Netns::create(&format!("{prefix}-net"))?;
        // The clients' fixed source port is inside the ephemeral range: without this, the
        // kernel may give it to one of the agent's upstream sockets, and the next query's bind
        // fails.
        ns.run(
            "sh",
            &[
                "-c",
                &format!("echo {CLIENT_PORT} > /proc/sys/net/ipv4/ip_local_reserved_ports"),
            ],
        )?;
        ns.veth("up0", &net, "dn0")?;
        ns.run(
            "ip",
            &["addr", "add", &format!("{}/30", LINK_NODE.0), "dev", "up0"],
        )?;
        ns.run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/64", LINK_NODE.1),
                "dev",
                "up0",
                "nodad",
            ],
        )?;
        net.run(
            "ip",
            &["addr", "add", &format!("{}/30", LINK_NET.0), "dev", "dn0"],
        )?;
        net.run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/64", LINK_NET.1),
                "dev",
                "dn0",
                "nodad",
            ],
        )?;
        net.run("ip", &["route", "add", "default", "via", LINK_NODE.0])?;
        net.run("ip", &["-6", "route", "add", "default", "via", LINK_NODE.1])?;
        let mut upstream: Vec<IpAddr> = vec![RESOLVER.into(), SPARE.into(), DEAD.into()];
        upstream.extend(EXTERNAL.iter().map(|ip| IpAddr::V4(*ip)));
        upstream.extend(&case.cluster);
        for ip in dedup(&upstream) {
            add_on_lo(&net, ip)?;
            let via = if ip.is_ipv4() { LINK_NET.0 } else { LINK_NET.1 };
            ns.run("ip", &["route", "add", &host_prefix(ip), "via", via])?;
        }
        for ip in dedup(&case.local) {
            add_on_lo(&ns, ip)?;
        }
        ns.set_resolv_conf(&format!("nameserver {RESOLVER}\n"))?;
        let root = TempDir::new(&format!("nodedns-corpus-{}", case.name))?;
        copy_mounted(&case.dir.join("etc"), &root.path().join("etc"), root.path())?;
        std::fs::create_dir_all(root.path().join("tmp"))?;
        Ok(Node {
            agent: None,
            servers: Vec::new(),
            root,
            ns,
            net,
        })
    }

    /// Starts the cluster DNS, the resolvers and the external servers.
    fn start_servers(&mut self, case: &Case) -> anyhow::Result<()> {
        let zones = corpus_dir().join("zones");
        let zone = |origin: &str, file: &str| -> anyhow::Result<Zone> {
            Ok(Zone {
                origin: origin.to_owned(),
                body: read(&zones.join(file))?,
            })
        };
        let mut cluster_local = Knot::cluster_local();
        cluster_local
            .body
            .push_str(&read(&zones.join("cluster.local.extra"))?);
        let cluster_zones = vec![
            cluster_local,
            zone("in-addr.arpa.", "in-addr.arpa.zone")?,
            zone("ip6.arpa.", "ip6.arpa.zone")?,
            zone("k8s.cluster.", "k8s.cluster.zone")?,
            zone("example1.com.", "old-domain.zone")?,
            zone("example2.com.", "old-domain.zone")?,
        ];
        let on = |ips: &[IpAddr]| ips.iter().map(|ip| SocketAddr::new(*ip, 53)).collect();
        // The external servers also answer every other name (`* A 192.0.2.53`): configurations
        // that forward `.` to two upstreams get the same answer whichever they pick.
        let mut external_zones = EXTERNAL_ZONES
            .iter()
            .map(|origin| zone(origin, "external.zone"))
            .collect::<anyhow::Result<Vec<_>>>()?;
        external_zones.push(zone(".", "external.zone")?);
        let plan: Vec<(Vec<SocketAddr>, Vec<Zone>)> = vec![
            (on(&case.cluster), cluster_zones),
            (on(&[RESOLVER.into()]), vec![zone(".", "resolver.zone")?]),
            (on(&[SPARE.into()]), vec![zone(".", "spare.zone")?]),
            (on(&EXTERNAL.map(IpAddr::V4)), external_zones),
        ];
        for (listen, zones) in plan {
            if listen.is_empty() {
                continue;
            }
            self.servers.push(Knot::start(Options {
                listen,
                netns: Some(self.net.name().to_owned()),
                zones,
            })?);
        }
        Ok(())
    }

    /// Paths of the pod moved under the case's directory.
    fn map(&self, text: &str) -> String {
        move_paths(text, self.root.path())
    }

    /// The container's arguments with the pod's paths moved, and node-cache's defaults that
    /// name pod paths made explicit (its template, its output, the kube-dns ConfigMap), each only
    /// where the pod would have the file.
    fn args(&self, case: &Case) -> Vec<String> {
        let mut args: Vec<String> = case.args.iter().map(|a| self.map(a)).collect();
        let has = |flag: &str| {
            case.args.iter().any(|a| {
                let name = a.trim_start_matches('-');
                name == flag || name.starts_with(&format!("{flag}="))
            })
        };
        let root = self.root.path();
        if !has("basecorefile") && root.join("etc/coredns/Corefile.base").exists() {
            args.push("-basecorefile".to_owned());
            args.push(root.join("etc/coredns/Corefile.base").display().to_string());
        }
        if !has("conf") && !has("corefile") {
            args.push("-conf".to_owned());
            args.push(root.join("etc/Corefile").display().to_string());
        }
        if !has("kubednscm") && root.join("etc/kube-dns").is_dir() {
            args.push("-kubednscm".to_owned());
            args.push(root.join("etc/kube-dns").display().to_string());
        }
        args
    }

    /// [`Node::args`] for serving here: node-cache's host set-up flags replaced by "none" (the
    /// namespace already has the addresses; the rules are not the subject).
    fn serving_args(&self, case: &Case) -> Vec<String> {
        let host_flags = ["setupinterface", "setupiptables", "skipteardown"];
        let mut args: Vec<String> = self
            .args(case)
            .into_iter()
            .filter(|a| {
                let name = a.trim_start_matches('-');
                let name = name.split('=').next().unwrap_or(name);
                !host_flags.contains(&name)
            })
            .collect();
        args.extend(
            [
                "-setupinterface=false",
                "-setupiptables=false",
                "-skipteardown",
            ]
            .map(String::from),
        );
        args
    }

    fn command(&self, case: &Case, program: &Path, args: &[String]) -> Command {
        let mut command = self.ns.command(&program.display().to_string());
        command
            .args(args)
            .env_remove("NODEDNS_HANDOFF_DIR")
            .env("RUST_BACKTRACE", "1");
        for (k, v) in &case.env {
            command.env(k, v);
        }
        command
    }

    /// Starts `program` and waits until it answers on the first query's address, or exits.
    /// `Ok(None)` when it is serving; `Ok(Some(output))` when it exited first.
    fn serve(
        &mut self,
        case: &Case,
        program: &Path,
        drop: &[String],
    ) -> anyhow::Result<Option<String>> {
        let mut args = self.serving_args(case);
        args.retain(|a| !drop.contains(a));
        let command = self.command(case, program, &args);
        let mut agent = Process::spawn("agent", command)
            .with_context(|| format!("spawn {}", program.display()))?;
        let probe_at = case.expect.checks.iter().find_map(|c| match c.what {
            Probe::Query {
                server,
                transport: Transport::Udp | Transport::Tcp,
                ..
            } => Some(server),
            _ => None,
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if agent.exited().is_some() {
                let output = agent.output();
                self.agent = Some(agent);
                return Ok(Some(output));
            }
            let answering = match probe_at {
                Some(server) => in_netns(&self.ns, || {
                    let query = client::query("corpus-probe.invalid.", RecordType::TXT);
                    client::udp_blocking(server, &query, Duration::from_millis(300)).is_ok()
                }),
                None => true,
            };
            if answering {
                self.agent = Some(agent);
                return Ok(None);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} does not answer on {probe_at:?} after 20 s:\n{}",
                    program.display(),
                    agent.output()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs every check of the case, in order.
    fn observe(&self, case: &Case) -> Vec<Observed> {
        case.expect
            .checks
            .iter()
            .map(|check| match &check.what {
                Probe::Query {
                    server,
                    name,
                    rtype,
                    transport,
                    edns,
                } => match transport {
                    Transport::Tls => self.ask_tls(*server, name, *rtype),
                    _ => in_netns(&self.ns, || ask(*server, name, *rtype, *transport, *edns)),
                },
                Probe::Http { addr, path } => in_netns(&self.ns, || http_status(*addr, path)),
            })
            .collect()
    }

    fn ask_tls(&self, server: SocketAddr, name: &str, rtype: RecordType) -> Observed {
        let rtype = rtype.to_string();
        let args = [
            name,
            rtype.as_str(),
            "+tls",
            "+time=3",
            "+retry=0",
            "+noedns",
        ];
        match client::kdig_in(Some(self.ns.name()), server, &args) {
            Ok(out) if !out.status.is_empty() => {
                let mut lines = vec![format!("rcode {}", out.status)];
                let mut flags: Vec<String> = out.flags.clone();
                flags.sort();
                lines.push(format!("flags {}", flags.join(" ")));
                let mut answer: Vec<String> = out
                    .answers
                    .iter()
                    .map(|r| {
                        format!(
                            "answer {} {} {} {} {}",
                            r.name, r.ttl, r.class, r.rtype, r.data
                        )
                    })
                    .collect();
                answer.sort();
                lines.extend(answer);
                Observed { lines }
            }
            _ => Observed {
                lines: vec!["no reply".to_owned()],
            },
        }
    }

    fn output(&self) -> String {
        self.agent.as_ref().map(Process::output).unwrap_or_default()
    }

    /// `text` (an agent's messages) with this node's paths shown as the case's files in the
    /// repository, so that a `file:line` points at the file to look at.
    fn map_back(&self, text: &str, case: &Case) -> String {
        let testdata = format!("integration/testdata/corpus/{}/", case.name);
        text.replace(&format!("{}/", self.root.path().display()), &testdata)
    }
}

fn dedup(ips: &[IpAddr]) -> Vec<IpAddr> {
    let set: BTreeSet<IpAddr> = ips.iter().copied().collect();
    set.into_iter().collect()
}

fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}/32"),
        IpAddr::V6(v6) => format!("{v6}/128"),
    }
}

/// `ip addr add IP/32 dev lo` in `ns` (IPv6: `/128 ... nodad`, usable at once).
fn add_on_lo(ns: &Netns, ip: IpAddr) -> anyhow::Result<()> {
    let prefix = host_prefix(ip);
    let mut args = vec!["addr", "add", prefix.as_str(), "dev", "lo"];
    if ip.is_ipv6() {
        args.push("nodad");
    }
    ns.run("ip", &args)?;
    Ok(())
}

/// Copies the mounted files, moving the pod's paths inside them under `root`.
fn copy_mounted(from: &Path, to: &Path, root: &Path) -> anyhow::Result<()> {
    if !from.exists() {
        return Ok(());
    }
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_mounted(&entry.path(), &target, root)?;
        } else if entry.file_name() != ".keep" {
            let text = read(&entry.path())?;
            std::fs::write(&target, move_paths(&text, root))?;
        }
    }
    Ok(())
}

/// Removes, from every file under `dir`, the lines whose text is one of `lines`.
fn drop_lines(dir: &Path, lines: &[String]) -> anyhow::Result<()> {
    if lines.is_empty() || !dir.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            drop_lines(&path, lines)?;
            continue;
        }
        let text = read(&path)?;
        let kept: String = text
            .lines()
            .filter(|l| !lines.iter().any(|d| l.trim() == d))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, kept)?;
    }
    Ok(())
}

/// `/etc/...` and `/tmp/...` (not `/etc/resolv.conf`) moved under `root`.
fn move_paths(text: &str, root: &Path) -> String {
    let root = root.display().to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = ["/etc/", "/tmp/"].iter().filter_map(|p| rest.find(p)).min() {
        // Only a path's start: not `/etc/` inside a longer word such as `x/etc/`.
        let starts_path = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| c.is_whitespace() || c == '=' || c == '"');
        out.push_str(&rest[..at]);
        if starts_path && !rest[at..].starts_with("/etc/resolv.conf") {
            out.push_str(&root);
        }
        out.push_str(&rest[at..at + 5]);
        rest = &rest[at + 5..];
    }
    out.push_str(rest);
    out
}

/// One query from [`CLIENT_PORT`], the reply in the `expect` file's words.
fn ask(
    server: SocketAddr,
    name: &str,
    rtype: RecordType,
    transport: Transport,
    edns: bool,
) -> Observed {
    let mut query = client::query(name, rtype);
    if edns {
        let mut opt = Edns::new();
        opt.set_max_payload(1232);
        query.set_edns(opt);
    }
    let reply = match transport {
        Transport::Tcp => tcp_exchange(server, &query),
        _ => udp_exchange(server, &query),
    };
    match reply {
        Ok(reply) => describe(&reply),
        Err(err) => {
            // Shown with the test's output when the case fails: a bind error, a timeout and a
            // reset all read `no reply` in the comparison.
            eprintln!("{transport:?} query {name} {rtype} to {server}: {err:#}");
            Observed {
                lines: vec!["no reply".to_owned()],
            }
        }
    }
}

fn udp_exchange(server: SocketAddr, query: &Message) -> anyhow::Result<Message> {
    let local: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, CLIENT_PORT).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, CLIENT_PORT).into()
    };
    let socket = bind_client_port(local)?;
    socket.set_read_timeout(Some(PATIENCE))?;
    socket.send_to(&query.to_vec()?, server)?;
    let mut buf = vec![0; 65535];
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        let (n, from) = socket.recv_from(&mut buf)?;
        if from != server {
            continue;
        }
        let reply = client::decode(&buf[..n])?;
        if reply.metadata.id == query.metadata.id
            && reply.metadata.message_type == MessageType::Response
        {
            return Ok(reply);
        }
    }
    bail!("no reply from {server}")
}

/// Binds the clients' fixed port. The previous query's socket, closed just before, may still be
/// open for a moment in a child that another test's thread forked and that has not yet reached
/// `exec` (which closes it): the port is then in use until it does.
fn bind_client_port(local: SocketAddr) -> std::io::Result<UdpSocket> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match UdpSocket::bind(local) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            bound => return bound,
        }
    }
}

fn tcp_exchange(server: SocketAddr, query: &Message) -> anyhow::Result<Message> {
    let mut stream = TcpStream::connect_timeout(&server, PATIENCE)?;
    stream.set_read_timeout(Some(PATIENCE))?;
    let bytes = query.to_vec()?;
    let mut framed = u16::try_from(bytes.len())?.to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed)?;
    let mut len = [0; 2];
    stream.read_exact(&mut len)?;
    let mut reply = vec![0; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut reply)?;
    client::decode(&reply)
}

/// A reply as `rcode`, `flags`, and one line per record of each section, sorted (order within a
/// section is not compared: `loadbalance` and upstreams shuffle it).
fn describe(reply: &Message) -> Observed {
    let m = &reply.metadata;
    let mut lines = vec![format!("rcode {}", rcode_name(m.response_code))];
    let flags: Vec<&str> = [
        (m.authoritative, "aa"),
        (m.truncation, "tc"),
        (m.recursion_desired, "rd"),
        (m.recursion_available, "ra"),
        (m.authentic_data, "ad"),
        (m.checking_disabled, "cd"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, name)| *name)
    .collect();
    lines.push(format!("flags {}", flags.join(" ")).trim_end().to_owned());
    let section = |name: &str, records: &[Record]| {
        let mut out: Vec<String> = records.iter().map(|r| format!("{name} {r}")).collect();
        out.sort();
        out
    };
    lines.extend(section("answer", &reply.answers));
    lines.extend(section("authority", &reply.authorities));
    lines.extend(section("additional", &reply.additionals));
    if let Some(edns) = &reply.edns {
        lines.push(format!("edns udp {}", edns.max_payload()));
    }
    Observed { lines }
}

/// The mnemonic of RFC 1035 and RFC 6895 (`NOERROR`, `NXDOMAIN`, ...).
fn rcode_name(code: hickory_proto::op::ResponseCode) -> String {
    format!("{code:?}").to_ascii_uppercase()
}

/// `GET path`: `status N`, or `no reply` when nothing accepts the connection within
/// [`PATIENCE`] (endpoints may come up a moment after DNS does).
fn http_status(addr: SocketAddr, path: &str) -> Observed {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match nodedns_integration::http_get(addr, path) {
            Ok((status, _)) => {
                return Observed {
                    lines: vec![format!("status {status}")],
                };
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(_) => {
                return Observed {
                    lines: vec!["no reply".to_owned()],
                };
            }
        }
    }
}

/// The test: nodedns loads the case where node-cache does (and refuses it where node-cache
/// does), then answers every query as node-cache did.
fn check(case: &Case) -> anyhow::Result<()> {
    let mut node = Node::prepare(case)?;
    let origin = format!(
        "corpus case `{}` (integration/testdata/corpus/{}, from {})",
        case.name, case.name, case.source
    );
    let args = node.args(case);
    let mut command = node.command(case, &nodedns_bin(), &[]);
    command.arg("run").arg("--check-config").args(&args);
    let out = command.output().context("run nodedns --check-config")?;
    let said = node.map_back(
        &format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        case,
    );
    match (&case.expect.loads, out.status.success()) {
        (Loads::Yes, true) => {}
        (Loads::Yes, false) => bail!(
            "{origin}: node-cache loads it, `nodedns run --check-config` refuses it ({}):\n{said}\
             arguments: {}",
            out.status,
            case.args.join(" ")
        ),
        (Loads::No(why), true) => bail!(
            "{origin}: node-cache refuses it ({why}), `nodedns run --check-config` accepts it:\n{said}"
        ),
        (Loads::No(_), false) => return Ok(()),
    }

    node.start_servers(case)?;
    let nodedns = nodedns_bin();
    if let Some(output) = node.serve(case, &nodedns, &[])? {
        bail!(
            "{origin}: nodedns exits at start although --check-config accepted the \
             configuration:\n{}",
            node.map_back(&output, case)
        );
    }
    let seen = node.observe(case);
    let mut wrong = String::new();
    for (check, seen) in case.expect.checks.iter().zip(&seen) {
        let Some(want) = &check.want else {
            bail!(
                "{origin}: expect:{}: `{}` has no recorded answer (record it from node-cache: \
                 {REFERENCE}=<node-cache binary>)",
                check.line,
                check.what
            );
        };
        if want != seen {
            let _ = writeln!(
                wrong,
                "expect:{}: {}{}\n  node-cache:\n{}  nodedns:\n{}",
                check.line,
                check.what,
                if check.note.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", check.note)
                },
                indent(&want.lines),
                indent(&seen.lines)
            );
        }
    }
    if !wrong.is_empty() {
        bail!(
            "{origin}: nodedns answers differently from node-cache:\n{wrong}nodedns output:\n{}",
            node.map_back(&node.output(), case)
        );
    }
    Ok(())
}

fn indent(lines: &[String]) -> String {
    lines.iter().map(|l| format!("    {l}\n")).collect()
}

/// How a recorded `expect` file names what the reference ran without.
const NEWER_NOTE: &str = "# Newer than node-cache 1.23.1, so recorded without:";

/// Recording: runs the reference binary on the case and rewrites its `expect` file.
fn record(case: &Case, reference: &Path) -> anyhow::Result<()> {
    let mut node = Node::prepare(case)?;
    drop_lines(&node.root.path().join("etc"), &case.newer_lines)?;
    node.start_servers(case)?;
    let exited = node.serve(case, reference, &case.newer_args)?;
    let (loads, observed) = match exited {
        Some(output) => {
            let output = node.map_back(&output, case);
            // The last line where CoreDNS says why it stops (node-cache's own errors about its
            // sync loops may come later), else the last error, else the last line.
            let fatal = [
                "plugin/",
                "Error during parsing",
                "no action found",
                "panic",
                "Listen:",
            ];
            let why = output
                .lines()
                .rev()
                .find(|l| fatal.iter().any(|f| l.contains(f)))
                .or_else(|| output.lines().rev().find(|l| l.contains("ERROR")))
                .or_else(|| output.lines().rev().find(|l| !l.trim().is_empty()))
                .unwrap_or("exited")
                .trim()
                .to_owned();
            (Loads::No(why), vec![None; case.expect.checks.len()])
        }
        None => (
            Loads::Yes,
            node.observe(case).into_iter().map(Some).collect(),
        ),
    };
    // Say what the reference ran without, when some of the case is newer than it.
    let newer: Vec<&str> = case
        .newer_lines
        .iter()
        .chain(&case.newer_args)
        .map(String::as_str)
        .collect();
    let mut header: Vec<String> = case
        .expect
        .header
        .iter()
        .filter(|l| !l.starts_with(NEWER_NOTE))
        .cloned()
        .collect();
    if !newer.is_empty() {
        header.push(format!("{NEWER_NOTE} {}", newer.join(", ")));
    }
    let text = case.expect.render(&header, &loads, &observed);
    std::fs::write(case.dir.join("expect"), text)?;
    eprintln!(
        "recorded {} from {}:\n{}",
        case.name,
        reference.display(),
        node.map_back(&node.output(), case)
    );
    Ok(())
}
