//! Configuration flags: nodedns's own `--long` flags, and node-cache's Go-style flags rewritten
//! to them so that the stock DaemonSet's `args:` work unchanged.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use super::values;

/// Every configuration flag. node-cache's names are accepted as aliases (and in Go's single-dash
/// form through [`normalize_args`]).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ConfigArgs {
    /// Serve DNS on ADDR:PORT (repeatable; without a Corefile). Default: every --local-ip on
    /// --dns-port, or 127.0.0.1:5353.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with_all = ["conf", "basecorefile"])]
    pub listen: Vec<SocketAddr>,

    /// Forward to ADDR[:PORT] over TCP (repeatable, port 53 by default; without a Corefile).
    /// Default: the nameservers of --resolv-conf, over UDP.
    #[arg(long, value_name = "ADDR[:PORT]", value_parser = upstream_addr,
          conflicts_with_all = ["conf", "basecorefile"])]
    pub upstream: Vec<SocketAddr>,

    /// The Corefile (node-cache `-conf`, `-corefile`). With --basecorefile (or node-cache's
    /// default /etc/coredns/Corefile.base present), the rendered template is written here.
    #[arg(long, alias = "corefile", value_name = "PATH")]
    pub conf: Option<PathBuf>,

    /// The Corefile template with `__PILLAR__` variables (node-cache `-basecorefile`).
    #[arg(long, value_name = "PATH")]
    pub basecorefile: Option<PathBuf>,

    /// Directory where the kube-dns ConfigMap is mounted (`stubDomains`, `upstreamNameservers`).
    /// In Corefile mode /etc/kube-dns is used when it exists, as node-cache does.
    #[arg(long, value_name = "DIR")]
    pub kubednscm: Option<PathBuf>,

    /// Service whose ClusterIP fills `__PILLAR__CLUSTER__DNS__`, read from the environment
    /// variable Kubernetes sets for it (`kube-dns-upstream` → KUBE_DNS_UPSTREAM_SERVICE_HOST).
    #[arg(long, value_name = "NAME", default_value = "kube-dns-upstream")]
    pub upstreamsvc: String,

    /// Node-local addresses (node-cache `-localip`): fill `__PILLAR__LOCAL__DNS__`, get put on
    /// the link and exempted from conntrack.
    #[arg(
        long = "local-ip",
        alias = "localip",
        value_name = "IP[,IP]",
        value_delimiter = ','
    )]
    pub local_ip: Vec<IpAddr>,

    /// Port of the health endpoint, for the host rules (node-cache `-health-port`); without a
    /// Corefile also where /health is served (on the first --local-ip, else 127.0.0.1).
    #[arg(long = "health-port", value_name = "PORT")]
    pub health_port: Option<u16>,

    /// Serve /health on ADDR:PORT, whatever the Corefile says.
    #[arg(long, value_name = "ADDR:PORT", value_parser = listen_addr)]
    pub health: Option<SocketAddr>,

    /// node-cache `-metrics-listen-address`: with a Corefile, /metrics is served here too,
    /// beside the `prometheus` address (default 0.0.0.0:9353, node-cache's); the metrics address
    /// when no `prometheus` directive names one. Without a Corefile: the metrics address
    /// (default 127.0.0.1:9253).
    #[arg(long = "metrics-listen-address", alias = "metrics", value_name = "ADDR:PORT",
          value_parser = listen_addr)]
    pub metrics_listen_address: Option<SocketAddr>,

    /// Write the process ID here once serving, remove it at exit (node-cache/CoreDNS `-pidfile`).
    #[arg(long, value_name = "PATH")]
    pub pidfile: Option<PathBuf>,

    /// The node's resolver configuration: default upstreams, `__PILLAR__UPSTREAM__SERVERS__`.
    #[arg(
        long = "resolv-conf",
        value_name = "PATH",
        default_value = "/etc/resolv.conf"
    )]
    pub resolv_conf: PathBuf,

    /// Cache capacity in bytes, without a Corefile (suffixes K, M, G, Ki, Mi, Gi).
    #[arg(long = "cache-size", value_name = "BYTES", default_value = "16Mi",
          value_parser = byte_size, conflicts_with_all = ["conf", "basecorefile"])]
    pub cache_size: u64,

    /// TCP connections per upstream address at most, without a Corefile (each carries one query
    /// at a time; the pool grows with concurrency up to this cap).
    #[arg(long = "upstream-max-connections", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u16).range(1..), conflicts_with_all = ["conf", "basecorefile"])]
    pub upstream_max_connections: u16,

    /// Port of server blocks whose zones name none (CoreDNS `-dns.port`).
    #[arg(long = "dns-port", value_name = "PORT", default_value_t = 53)]
    pub dns_port: u16,

    /// Tap one query in N to the Corefile's `dnstap` sinks (1: every query, as CoreDNS does).
    #[arg(long = "dnstap-sample", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub dnstap_sample: u32,

    /// node-cache `-initialdelay`: accepted, no effect (nodedns installs its rules as soon as
    /// its listeners are up).
    #[arg(long = "initial-delay", value_name = "DURATION", hide = true)]
    pub initial_delay: Option<String>,

    /// node-cache `-setupebtables`: only `false` is accepted (nodedns has no ebtables rules).
    #[arg(long = "setup-ebtables", hide = true, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value_t = false,
          action = clap::ArgAction::Set)]
    pub setup_ebtables: bool,

    /// CoreDNS's `-quiet`, which node-cache passes on: the start-up listing of the addresses
    /// served is not logged (everything else is).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub quiet: bool,

    /// node-cache `-reloadwithsignal`: node-cache then reloads its CoreDNS itself whenever it
    /// rewrites the Corefile, instead of leaving that to the `reload` directive. nodedns always
    /// does so: every change of what it reads is applied, with or without this flag.
    #[arg(long = "reload-with-signal", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value_t = false,
          action = clap::ArgAction::Set)]
    pub reload_with_signal: bool,

    /// The ndots cascade prefetch: when a pod's first search-list step
    /// (`NAME.NS.svc.CLUSTER-DOMAIN`) comes back NXDOMAIN, fetch the later steps of the standard
    /// search list for the same type at once, so they are cached or in flight when the pod asks
    /// (docs/cache.md). `--cascade-prefetch=false` turns it off.
    #[arg(long = "cascade-prefetch", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value_t = true,
          action = clap::ArgAction::Set)]
    pub cascade_prefetch: bool,
}

fn upstream_addr(s: &str) -> Result<SocketAddr, String> {
    values::host_port(s, 53)
}

fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    values::listen_addr(s)
}

fn byte_size(s: &str) -> Result<u64, String> {
    values::byte_size(s)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Takes a value: `-name value`, `-name=value`.
    Value,
    /// Boolean: `-name`, `-name=false`.
    Bool,
}

/// node-cache's (and CoreDNS's) flag names, with the nodedns flag each becomes.
const NODE_CACHE: &[(&str, &str, Kind)] = &[
    ("localip", "local-ip", Kind::Value),
    ("conf", "conf", Kind::Value),
    ("corefile", "conf", Kind::Value),
    ("basecorefile", "basecorefile", Kind::Value),
    ("kubednscm", "kubednscm", Kind::Value),
    ("upstreamsvc", "upstreamsvc", Kind::Value),
    ("health-port", "health-port", Kind::Value),
    (
        "metrics-listen-address",
        "metrics-listen-address",
        Kind::Value,
    ),
    ("pidfile", "pidfile", Kind::Value),
    ("dns.port", "dns-port", Kind::Value),
    ("initialdelay", "initial-delay", Kind::Value),
    ("setupebtables", "setup-ebtables", Kind::Bool),
    ("quiet", "quiet", Kind::Bool),
    ("reloadwithsignal", "reload-with-signal", Kind::Bool),
    // Host networking (flags defined in host.rs).
    ("setupinterface", "setup-interface", Kind::Bool),
    ("setupiptables", "setup-rules", Kind::Bool),
    ("skipteardown", "skip-teardown", Kind::Bool),
    ("interfacename", "interface-name", Kind::Value),
    // Its own flag, not --sync-interval: node-cache multiplies the value by a second.
    ("syncinterval", "syncinterval", Kind::Value),
];

/// nodedns's own long flags, which Go-style single-dash spelling may also name.
const NODEDNS: &[(&str, Kind)] = &[
    ("listen", Kind::Value),
    ("upstream", Kind::Value),
    ("local-ip", Kind::Value),
    ("health", Kind::Value),
    ("resolv-conf", Kind::Value),
    ("cache-size", Kind::Value),
    ("dns-port", Kind::Value),
    ("initial-delay", Kind::Value),
    ("setup-ebtables", Kind::Bool),
    ("quiet", Kind::Bool),
    ("reload-with-signal", Kind::Bool),
    ("cascade-prefetch", Kind::Bool),
    // Host networking (host.rs).
    ("setup-interface", Kind::Bool),
    ("setup-rules", Kind::Bool),
    ("skip-teardown", Kind::Bool),
    ("interface-name", Kind::Value),
    ("link-kind", Kind::Value),
    ("sync-interval", Kind::Value),
    ("rules-backend", Kind::Value),
    ("no-setup", Kind::Bool),
];

fn lookup(name: &str) -> Option<(&'static str, Kind)> {
    NODE_CACHE
        .iter()
        .find(|(go, _, _)| *go == name)
        .map(|&(_, long, kind)| (long, kind))
        .or_else(|| {
            NODEDNS
                .iter()
                .find(|(long, _)| *long == name)
                .map(|&(long, kind)| (long, kind))
        })
}

/// node-cache's Go-style flags (`-localip x`, `-localip=x`, `-setupinterface=false`, also
/// `--localip`) rewritten to nodedns's long flags, so the stock DaemonSet's `args:` parse.
/// Boolean flags keep their value (`-setupinterface=false` → `--setup-interface=false`; bare
/// `-skipteardown` → `--skip-teardown`), so the host flags must accept an optional `=VALUE`.
/// Unknown single-dash words are left alone so clap rejects them with its own message; the
/// first element (the program name), values of value-taking flags and everything after `--` are
/// never rewritten.
pub fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut iter = args.into_iter();
    if let Some(program) = iter.next() {
        out.push(program);
    }
    while let Some(arg) = iter.next() {
        let Some(text) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            out.push(arg);
            out.extend(iter);
            break;
        }
        let body = match text.strip_prefix("--") {
            Some(body) => body,
            None => match text.strip_prefix('-') {
                // `-h`, `-V`: clap's own short flags.
                Some(body) if body.chars().count() > 1 => body,
                _ => {
                    out.push(arg);
                    continue;
                }
            },
        };
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        let Some((long, kind)) = lookup(name) else {
            out.push(arg);
            continue;
        };
        match value {
            Some(v) => out.push(format!("--{long}={v}").into()),
            None => {
                out.push(format!("--{long}").into());
                if kind == Kind::Value {
                    if let Some(v) = iter.next() {
                        out.push(v);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        config: ConfigArgs,
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    fn strs(args: &[OsString]) -> Vec<&str> {
        args.iter().map(|a| a.to_str().unwrap()).collect()
    }

    pub(crate) fn parse(args: &[&str]) -> Result<ConfigArgs, clap::Error> {
        let mut all = vec!["nodedns"];
        all.extend_from_slice(args);
        Cli::try_parse_from(normalize_args(os(&all))).map(|c| c.config)
    }

    #[test]
    fn stock_daemonset_args_normalize_and_parse() {
        let text = include_str!("testdata/daemonset-args.json");
        let stock: Vec<String> = serde_json::from_str(text).unwrap();
        // The manifest's install step fills the placeholders (iptables mode).
        let filled: Vec<String> = stock
            .iter()
            .map(|a| {
                a.replace("__PILLAR__LOCAL__DNS__", "169.254.20.10")
                    .replace("__PILLAR__DNS__SERVER__", "10.96.0.10")
            })
            .collect();
        let filled: Vec<&str> = filled.iter().map(String::as_str).collect();
        let mut all = vec!["node-cache"];
        all.extend(&filled);
        assert_eq!(
            strs(&normalize_args(os(&all))),
            [
                "node-cache",
                "--local-ip",
                "169.254.20.10,10.96.0.10",
                "--conf",
                "/etc/Corefile",
                "--upstreamsvc",
                "kube-dns-upstream",
                "--pidfile",
                "/tmp/node-cache.pid",
            ]
        );
        let args = parse(&filled).unwrap();
        assert_eq!(
            args.local_ip,
            [
                "169.254.20.10".parse::<IpAddr>().unwrap(),
                "10.96.0.10".parse().unwrap()
            ]
        );
        assert_eq!(args.conf, Some(PathBuf::from("/etc/Corefile")));
        assert_eq!(args.upstreamsvc, "kube-dns-upstream");
        assert_eq!(args.pidfile, Some(PathBuf::from("/tmp/node-cache.pid")));
        assert_eq!(args.resolv_conf, PathBuf::from("/etc/resolv.conf"));
        assert_eq!(args.dns_port, 53);
    }

    #[test]
    fn go_style_equals_and_double_dash_forms_are_rewritten() {
        let n = normalize_args(os(&[
            "nodedns",
            "-localip=169.254.20.10",
            "--kubednscm",
            "/etc/kube-dns",
            "-health-port=8081",
            "-dns.port",
            "1053",
            "-metrics-listen-address",
            "0.0.0.0:9353",
            "-corefile=/etc/Corefile",
        ]));
        assert_eq!(
            strs(&n),
            [
                "nodedns",
                "--local-ip=169.254.20.10",
                "--kubednscm",
                "/etc/kube-dns",
                "--health-port=8081",
                "--dns-port",
                "1053",
                "--metrics-listen-address",
                "0.0.0.0:9353",
                "--conf=/etc/Corefile",
            ]
        );
        let a = parse(&strs(&n)[1..]).unwrap();
        assert_eq!(a.health_port, Some(8081));
        assert_eq!(a.dns_port, 1053);
        assert_eq!(a.kubednscm, Some(PathBuf::from("/etc/kube-dns")));
    }

    #[test]
    fn host_flags_are_rewritten_with_their_boolean_values() {
        let n = normalize_args(os(&[
            "nodedns",
            "-setupinterface=false",
            "-setupiptables=false",
            "-skipteardown",
            "-interfacename",
            "nodelocaldns",
            "-syncinterval=1m",
            "-link-kind",
            "bridge",
            "-no-setup",
        ]));
        assert_eq!(
            strs(&n),
            [
                "nodedns",
                "--setup-interface=false",
                "--setup-rules=false",
                "--skip-teardown",
                "--interface-name",
                "nodelocaldns",
                "--syncinterval=1m",
                "--link-kind",
                "bridge",
                "--no-setup",
            ]
        );
    }

    #[test]
    fn unknown_words_values_and_everything_after_double_dash_are_left_alone() {
        let n = normalize_args(os(&[
            "nodedns",
            "-bogus",
            "-h",
            "-conf",
            "-odd-path",
            "--",
            "-localip",
            "x",
        ]));
        assert_eq!(
            strs(&n),
            [
                "nodedns",
                "-bogus",
                "-h",
                "--conf",
                "-odd-path",
                "--",
                "-localip",
                "x"
            ]
        );
        let err = parse(&["-bogus"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
    }

    #[test]
    fn clap_aliases_accept_node_cache_names_with_two_dashes() {
        let a = parse(&["--localip", "10.0.0.1", "--corefile", "/c"]).unwrap();
        assert_eq!(a.local_ip, ["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(a.conf, Some(PathBuf::from("/c")));
        let a = parse(&["--metrics", "127.0.0.1:9353"]).unwrap();
        assert_eq!(
            a.metrics_listen_address,
            Some("127.0.0.1:9353".parse().unwrap())
        );
    }

    #[test]
    fn upstreams_default_to_port_53_and_sizes_take_units() {
        let a = parse(&[
            "--upstream",
            "10.0.0.1",
            "--upstream",
            "[fd00::1]:5353",
            "--cache-size",
            "32Mi",
        ])
        .unwrap();
        assert_eq!(
            a.upstream,
            [
                "10.0.0.1:53".parse::<SocketAddr>().unwrap(),
                "[fd00::1]:5353".parse().unwrap()
            ]
        );
        assert_eq!(a.cache_size, 32 << 20);
        assert_eq!(parse(&[]).unwrap().cache_size, 16 << 20);
    }

    #[test]
    fn cli_mode_flags_conflict_with_a_corefile() {
        let err = parse(&["--conf", "/etc/Corefile", "--listen", "127.0.0.1:53"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        let err = parse(&["--basecorefile", "/b", "--upstream", "10.0.0.1"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn bad_local_ip_is_rejected_by_clap() {
        let err = parse(&["-localip", "__PILLAR__LOCAL__DNS__"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn quiet_and_reloadwithsignal_are_node_caches_boolean_flags() {
        // As kubespray and the charts write them (Go's boolean forms), each alone and together.
        let n = normalize_args(os(&[
            "node-cache",
            "-quiet",
            "-reloadwithsignal=true",
            "-localip",
            "169.254.20.10",
        ]));
        assert_eq!(
            strs(&n),
            [
                "node-cache",
                "--quiet",
                "--reload-with-signal=true",
                "--local-ip",
                "169.254.20.10"
            ]
        );
        let a = parse(&strs(&n)[1..]).unwrap();
        assert!(a.quiet && a.reload_with_signal);
        let a = parse(&["-reloadwithsignal", "-quiet=false"]).unwrap();
        assert!(a.reload_with_signal && !a.quiet);
        let a = parse(&[]).unwrap();
        assert!(!a.quiet && !a.reload_with_signal);
        // A word after a boolean flag is not its value (Go's rule): here, an unknown argument.
        let err = parse(&["-quiet", "false"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        let err = parse(&["-quiet=maybe"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn setupebtables_takes_an_optional_value() {
        assert!(
            parse(&["-setupebtables=false"])
                .map(|a| !a.setup_ebtables)
                .unwrap()
        );
        assert!(parse(&["-setupebtables"]).unwrap().setup_ebtables);
    }
}
