//! Configuration: what the agent serves, where, and how.
//!
//! Two sources produce the same [`Config`]: nodedns's own flags (`--listen`, `--upstream`: one
//! server block for `.`), and node-cache's inputs, unchanged (the node-local-dns Corefile with its
//! `__PILLAR__` variables, node-cache's single-dash flags, the kube-dns ConfigMap). Loading is a
//! pure function of its inputs (file contents, environment map, resolv.conf text), so tests feed
//! it maps and strings; only [`load`] touches the filesystem.
//!
//! The pieces, in the order a load runs them:
//! - `args`: the flags, and [`normalize_args`] for node-cache's Go-style spelling;
//! - `kubedns`: the kube-dns ConfigMap's `stubDomains` and `upstreamNameservers`;
//! - `template`: node-cache's `__PILLAR__` variables, and the node's resolv.conf;
//! - `corefile`: Corefile syntax (words, blocks, `{$ENV}`), with a line for every word;
//!   `import`: snippets and imported files spliced into its words;
//! - `directives`: what each directive means, every problem collected with `file:line`;
//!   `compat`: the directives and options that change nothing nodedns does, explained;
//! - [`build`] here: CLI mode, kube-dns stub domains and upstreams, checks across blocks
//!   (duplicate zones, forwarding loops);
//! - `route`: the per-query [`Router`]; `watch`: change notification for live reload.

mod args;
pub(crate) mod compat;
pub(crate) mod corefile;
pub(crate) mod directives;
pub(crate) mod import;
mod kubedns;
pub(crate) mod querylog;
mod route;
pub(crate) mod template;
pub(crate) mod values;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use args::{ConfigArgs, normalize_args};
pub use import::{Found, Imports};
pub use kubedns::KubeDns;
pub use querylog::{Field as LogField, LogClasses, LogFormat, LogRule, Piece as LogPiece};
pub use route::{Route, Router, Takes};
pub(crate) use values::{go_duration, wire};
pub use watch::watch;

use directives::Placed;
use nodedns_upstream::Transport;

/// A complete, validated configuration. The agent publishes it as one immutable snapshot.
/// (`Default`: no server block, nothing set.)
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    /// Server blocks, in file order; kube-dns stub domains last.
    pub servers: Vec<Server>,
    /// The node-local addresses the host plumbing puts on the link and exempts from conntrack
    /// (node-cache `-localip`): the link-local address and, in iptables/nftables mode, the kube-dns
    /// ClusterIP. Empty when nodedns does no host setup.
    pub local_ips: Vec<IpAddr>,
    /// Liveness endpoint (`health` directive, node-cache `-health-port`).
    pub health: Option<SocketAddr>,
    /// The health port whose probes the host rules exempt from conntrack: node-cache's
    /// `-health-port`, which with a Corefile defaults to node-cache's 8080 whatever port
    /// `health` names (so that two instances on a node with their own `health` ports write the
    /// same rules); without a Corefile, the port /health is served on.
    pub host_health_port: Option<u16>,
    /// `health { lameduck D }`: keep answering for D after shutdown starts.
    pub lameduck: Option<Duration>,
    /// Readiness endpoint (`ready` directive).
    pub ready: Option<SocketAddr>,
    /// Prometheus endpoint (`prometheus` directive, `-metrics-listen-address`).
    pub metrics: Option<SocketAddr>,
    /// The other addresses `prometheus` names in other blocks: each serves the same metrics
    /// (CoreDNS opens a listener per address, all on one registry).
    pub extra_metrics: Vec<SocketAddr>,
    /// node-cache's own metrics address, `-metrics-listen-address` (default 0.0.0.0:9353),
    /// which node-cache serves whatever the Corefile says, `prometheus` or not (Gardener
    /// scrapes it), with the same metrics as the `prometheus` address: with a Corefile only.
    pub node_cache_metrics: Option<SocketAddr>,
    /// Polling interval for the Corefile, when the `reload` directive asks for one.
    pub reload: Option<Duration>,
    /// Settings accepted but meaning something slightly different in nodedns, each with its
    /// `file:line`: the agent logs them once per load.
    pub warnings: Vec<String>,
    /// The cluster domains (`cluster.local.`): the zones of the configuration's own blocks other
    /// than `.` and the reverse zones (kube-dns stub domains are not among them). The ndots
    /// cascade prefetch recognises a pod's search list by them.
    pub cluster_domains: Vec<String>,
    /// `--cascade-prefetch`: follow a first search-list step's NXDOMAIN with the later steps.
    pub cascade_prefetch: bool,
    /// Where nodedns deliberately does what node-cache's CoreDNS would not with this
    /// configuration, because a default of nodedns's applies (prefetch and serve-stale on, a
    /// cache sized in bytes, `max_concurrent`, `expire`), each with where it applies:
    /// `--check-config` prints them.
    pub differences: Vec<Difference>,
}

/// A default of nodedns's that makes it do what node-cache would not with a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Where it applies: the directive's `file:line`, or a stub domain's file and zone.
    pub at: String,
    /// What nodedns does, and what node-cache's CoreDNS does instead.
    pub what: String,
}

/// One server block: the zones it answers, where it listens, its cache and its upstreams.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// Zones in canonical form: lowercase, absolute, with the trailing dot (`cluster.local.`, `.`).
    pub zones: Vec<String>,
    /// Addresses this block is served on (`bind` × the block's port).
    pub listen: Vec<SocketAddr>,
    /// `None` when the block has no `cache` directive: every query goes upstream.
    pub cache: Option<nodedns_cache::Policy>,
    /// Its `forward` lines, in file order: a name goes to the first that takes it (CoreDNS
    /// chains them, each passing on what it does not take, and what its `next` rcodes name).
    /// Empty when the block has no `forward`: what no other plugin answers gets SERVFAIL, as at
    /// the end of CoreDNS's chain.
    pub forwards: Vec<Forward>,
    /// `log`: the rules of its `log` lines, in file order (a query is logged by the first whose
    /// name covers it, if its classes take the answer); empty without `log`.
    pub log: Vec<LogRule>,
    /// `errors`: log failed upstream exchanges of this block.
    pub errors: bool,
    /// `loop`: probe at start whether queries sent upstream come back (CoreDNS's loop plugin).
    pub loop_check: bool,
    /// `dnstap`, each directive a sink (`--dnstap-sample` filled in).
    pub dnstap: Vec<Dnstap>,
    /// The plugins after the cache other than `forward` (`hosts`, `whoami`), in chain order.
    pub chain: crate::plugin::Chain,
    /// How its queries arrive: the scheme of its keys (`dns://`, `tls://`, `https://`).
    pub scheme: Scheme,
    /// `tls CERT KEY [CA]`: the certificate a `tls://` or `https://` block serves with. `None`:
    /// the block is served unencrypted, as CoreDNS serves it (`tls://` as plain DNS over TCP,
    /// `https://` as HTTP/1.1 in cleartext).
    pub tls: Option<crate::plugin::tls::Settings>,
}

/// The scheme of a server block's keys: how clients reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, PartialOrd, Ord, Hash)]
pub enum Scheme {
    /// `dns://` or none: DNS over UDP and TCP.
    #[default]
    Dns,
    /// `tls://`: DNS over TLS (RFC 7858), or over plain TCP without a `tls` directive.
    Tls,
    /// `https://`: DNS over HTTPS (RFC 8484), or over cleartext HTTP without `tls`.
    Https,
}

impl Scheme {
    /// As written before `://` (and in CoreDNS's `server` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Dns => "dns",
            Scheme::Tls => "tls",
            Scheme::Https => "https",
        }
    }
}

/// A `forward` directive.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// FROM: the zone the directive applies to (canonical form).
    pub from: String,
    /// Names under FROM that are not forwarded (`except`), canonical form.
    pub except: Vec<String>,
    /// `next RCODE...` (CoreDNS 1.11.4+): a reply with one of these rcodes passes the query on
    /// to the block's next `forward` line; after the last one, the reply stands.
    pub next: Vec<u16>,
    pub upstream: nodedns_upstream::Config,
}

/// A `dnstap` directive: where the query/response stream goes and what it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dnstap {
    pub sink: Sink,
    /// `full`: the messages carry the DNS messages in wire form.
    pub full: bool,
    /// `identity`; the host name when not given.
    pub identity: Option<String>,
    /// `version`; `nodedns-VERSION` when not given.
    pub version: Option<String>,
    /// `extra`, written as given.
    pub extra: Option<String>,
    /// Messages queued at most.
    pub queue: usize,
    /// The TCP socket's send buffer, in bytes.
    pub write_buffer: usize,
    /// Tap one query in this many (`--dnstap-sample`; 1: every query).
    pub sample: u32,
}

impl Dnstap {
    /// CoreDNS's queue: 10,000 messages times the directive's `queue` multiplier.
    pub const QUEUE: usize = 10_000;
    /// CoreDNS's TCP write buffer: 1 MiB times the `writebuffer` multiplier.
    pub const WRITE_BUFFER: usize = 1 << 20;

    /// A tap of `sink` with CoreDNS's defaults.
    pub fn new(sink: Sink) -> Self {
        Dnstap {
            sink,
            full: false,
            identity: None,
            version: None,
            extra: None,
            queue: Dnstap::QUEUE,
            write_buffer: Dnstap::WRITE_BUFFER,
            sample: 1,
        }
    }
}

/// Where a `dnstap` directive writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sink {
    /// `unix://PATH` or a plain path.
    Unix(std::path::PathBuf),
    /// `tcp://HOST:PORT`; HOST may be a name, resolved at each dial.
    Tcp(String),
}

impl fmt::Display for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sink::Unix(path) => write!(f, "unix://{}", path.display()),
            Sink::Tcp(addr) => write!(f, "tcp://{addr}"),
        }
    }
}

impl Config {
    /// The cluster domain this configuration implies: its first server block zone that is
    /// neither the root nor a reverse zone (node-local-dns's Corefile starts with
    /// `cluster.local:53`).
    pub fn cluster_domain(&self) -> Option<&str> {
        self.servers
            .iter()
            .flat_map(|s| s.zones.iter())
            .find(|z| {
                z.as_str() != "." && !z.ends_with("in-addr.arpa.") && !z.ends_with("ip6.arpa.")
            })
            .map(String::as_str)
    }

    /// What differs between `self` (running) and `next` that a reload cannot apply: sockets
    /// already bound. Empty when `next` can be swapped in completely.
    pub fn restart_needed(&self, next: &Config) -> Vec<String> {
        // Each address with its transport: a socket is bound for one.
        let listen = |c: &Config| {
            let mut all: Vec<(SocketAddr, Scheme, bool)> = c
                .servers
                .iter()
                .flat_map(|s| s.listen.iter().map(|a| (*a, s.scheme, s.tls.is_some())))
                .collect();
            all.sort();
            all.dedup();
            all.into_iter()
                .map(|(addr, scheme, tls)| match (scheme, tls) {
                    (Scheme::Dns, _) => addr.to_string(),
                    (_, false) => format!("{}://{addr} (without tls)", scheme.as_str()),
                    (_, true) => format!("{}://{addr}", scheme.as_str()),
                })
                .collect::<Vec<_>>()
        };
        let mut out = Vec::new();
        let (old, new) = (listen(self), listen(next));
        if old != new {
            out.push(format!("listen addresses {old:?} → {new:?}"));
        }
        if self.local_ips != next.local_ips {
            out.push(format!(
                "local IPs {:?} → {:?}",
                self.local_ips, next.local_ips
            ));
        }
        if self.extra_metrics != next.extra_metrics {
            out.push(format!(
                "other prometheus addresses {:?} → {:?}",
                self.extra_metrics, next.extra_metrics
            ));
        }
        for (what, a, b) in [
            ("health", self.health, next.health),
            ("ready", self.ready, next.ready),
            ("metrics", self.metrics, next.metrics),
        ] {
            if a != b {
                out.push(format!("{what} address {a:?} → {b:?}"));
            }
        }
        out
    }
}

/// One thing wrong with the configuration, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `file:line`, `file`, or `None` for problems of the flags as a whole.
    pub location: Option<String>,
    pub message: String,
}

impl Problem {
    pub(crate) fn at(file: &str, line: usize, message: String) -> Problem {
        Problem {
            location: Some(format!("{file}:{line}")),
            message,
        }
    }

    pub(crate) fn in_file(file: &str, message: String) -> Problem {
        Problem {
            location: Some(file.to_owned()),
            message,
        }
    }

    pub(crate) fn general(message: String) -> Problem {
        Problem {
            location: None,
            message,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.location {
            Some(at) => write!(f, "{at}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Every problem found, not just the first.
    #[error("invalid configuration:\n  {}", problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    Invalid { problems: Vec<Problem> },
}

impl ConfigError {
    fn invalid(problems: Vec<Problem>) -> ConfigError {
        ConfigError::Invalid { problems }
    }
}

/// Every input of a load, so tests feed strings and maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inputs {
    /// The Corefile (or node-cache template) and its path; `None` in CLI mode.
    pub corefile: Option<(PathBuf, String)>,
    /// The process environment: `{$NAME}` in the Corefile and the `-upstreamsvc` Service's
    /// `*_SERVICE_HOST`.
    pub env: HashMap<String, String>,
    /// Contents of `--resolv-conf`; `None` when there is no such file (an error only where a
    /// configuration takes upstream servers from it).
    pub resolv_conf: Option<String>,
    /// The kube-dns ConfigMap, when its directory is mounted.
    pub kubedns: Option<KubeDns>,
    /// Contents of the other resolv.conf files the Corefile's `forward` names as upstreams
    /// (`forward . /etc/resolv.conf` beside `--resolv-conf /run/...`: CoreDNS reads the file
    /// named); `None` for one that does not exist. See [`forward_paths`].
    pub forward_files: BTreeMap<PathBuf, Option<String>>,
    /// What the Corefile's `import`s read: files and the directories their globs looked into.
    pub imports: Imports,
    /// The host's network interfaces by name, each with its addresses (`bind IFACE`), as read
    /// when the configuration is (re)loaded.
    pub interfaces: BTreeMap<String, Vec<IpAddr>>,
}

/// node-cache's default `-basecorefile`, where nodelocaldns.yaml mounts its ConfigMap.
pub(crate) const DEFAULT_BASE_COREFILE: &str = "/etc/coredns/Corefile.base";
/// node-cache's default `-health-port`.
pub(crate) const DEFAULT_HEALTH_PORT: u16 = 8080;
/// node-cache's default `-metrics-listen-address`.
pub(crate) const NODE_CACHE_METRICS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 9353);
/// node-cache's default kube-dns ConfigMap directory, used when it exists.
pub(crate) const DEFAULT_KUBEDNS_DIR: &str = "/etc/kube-dns";

/// Which file is read, and where the rendered Corefile is written (node-cache renders its
/// template into `-conf`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Source {
    pub read: PathBuf,
    pub write: Option<PathBuf>,
}

/// node-cache's rule: the template is `-basecorefile` (default /etc/coredns/Corefile.base), and
/// the rendered result goes to `-conf`. Without a template file, `-conf` is read as is (its
/// pillars are filled all the same). No `--conf` and no `--basecorefile`: CLI mode.
pub(crate) fn corefile_source(args: &ConfigArgs) -> Option<Source> {
    match (&args.basecorefile, &args.conf) {
        (Some(base), conf) => Some(Source {
            read: base.clone(),
            write: conf.clone().filter(|c| c != base),
        }),
        (None, Some(conf)) => {
            let base = Path::new(DEFAULT_BASE_COREFILE);
            if base.is_file() && base != conf {
                Some(Source {
                    read: base.to_path_buf(),
                    write: Some(conf.clone()),
                })
            } else {
                Some(Source {
                    read: conf.clone(),
                    write: None,
                })
            }
        }
        (None, None) => None,
    }
}

/// `--kubednscm`, or in Corefile mode node-cache's default directory when it exists.
pub(crate) fn kubedns_dir(args: &ConfigArgs) -> Option<PathBuf> {
    args.kubednscm.clone().or_else(|| {
        let default = Path::new(DEFAULT_KUBEDNS_DIR);
        (corefile_source(args).is_some() && default.is_dir()).then(|| default.to_path_buf())
    })
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A ConfigMap key: `None` when the file is absent.
fn read_key(dir: &Path, key: &str) -> Result<Option<String>, ConfigError> {
    read_if_present(&dir.join(key))
}

/// `None` when the file does not exist.
fn read_if_present(path: &Path) -> Result<Option<String>, ConfigError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ConfigError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The files the Corefile's `forward` directives name as upstreams, other than `--resolv-conf`
/// (always read). CoreDNS takes every `TO` that is not an address for a resolv.conf to read
/// (its `parse.HostPortOrFile`), whatever the path: node-cache's own rendering writes
/// `/etc/resolv.conf` there. Taken from the file as written (pillars are filled later and
/// never name a file but `--resolv-conf`); a file that does not parse names none, and its load
/// says why.
pub(crate) fn forward_paths(
    args: &ConfigArgs,
    file: &Path,
    text: &str,
    env: &HashMap<String, String>,
    imports: &Imports,
) -> Vec<PathBuf> {
    let dir = import_dir(args, file);
    let Ok(parsed) = corefile::parse(&file.display().to_string(), text, env, &dir, &mut &*imports)
    else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = parsed
        .blocks
        .iter()
        .flat_map(|b| &b.directives)
        .filter(|d| d.name == "forward")
        .flat_map(|d| d.args.iter().skip(1))
        .map(|w| w.text.strip_prefix("dns://").unwrap_or(&w.text))
        .filter(|to| {
            !to.contains("://")
                && !to.contains("__PILLAR__")
                && values::host_port(to, 53).is_err()
                && Path::new(to) != args.resolv_conf
        })
        .map(PathBuf::from)
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// The directory relative imports start from: that of the Corefile CoreDNS reads, which in
/// node-cache is the rendered `-conf` (so `import custom/*.override` in the template means
/// `/etc/custom/` for `-conf /etc/Corefile`), else the file read.
pub(crate) fn import_dir(args: &ConfigArgs, read: &Path) -> PathBuf {
    args.conf
        .as_deref()
        .unwrap_or(read)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// What the imports of `text` (the Corefile at `file`) read from disk; nothing when it does not
/// parse (the load says why).
fn read_imports(
    args: &ConfigArgs,
    file: &Path,
    text: &str,
    env: &HashMap<String, String>,
) -> Imports {
    let mut record = Imports::default();
    let _ = corefile::parse(
        &file.display().to_string(),
        text,
        env,
        &import_dir(args, file),
        &mut import::Disk {
            record: &mut record,
        },
    );
    record
}

/// The files the Corefile `args` names depends on, read from disk (none when it cannot be
/// read): the resolv.conf files its `forward`s name ([`forward_paths`]) and the files its
/// `import`s name. For the watcher: a change of those files is a change of the configuration.
pub(crate) fn paths_on_disk(args: &ConfigArgs) -> Vec<PathBuf> {
    let Some(source) = corefile_source(args) else {
        return Vec::new();
    };
    let Ok(text) = std::fs::read_to_string(&source.read) else {
        return Vec::new();
    };
    let env: HashMap<String, String> = std::env::vars().collect();
    let imports = read_imports(args, &source.read, &text, &env);
    let mut paths = forward_paths(args, &source.read, &text, &env, &imports);
    paths.extend(imports.paths().map(Path::to_path_buf));
    paths
}

/// Reads every input `args` names: the Corefile, the kube-dns ConfigMap, the resolv.conf, the
/// resolv.conf files the Corefile's `forward` names, the environment.
pub fn read_inputs(args: &ConfigArgs) -> Result<Inputs, ConfigError> {
    let corefile = match corefile_source(args) {
        Some(source) => Some((source.read.clone(), read(&source.read)?)),
        None => None,
    };
    let env: HashMap<String, String> = std::env::vars().collect();
    let mut forward_files = BTreeMap::new();
    let mut imports = Imports::default();
    if let Some((path, text)) = &corefile {
        imports = read_imports(args, path, text, &env);
        for file in forward_paths(args, path, text, &env, &imports) {
            let contents = read_if_present(&file)?;
            forward_files.insert(file, contents);
        }
    }
    let kubedns = match kubedns_dir(args) {
        Some(dir) => {
            std::fs::read_dir(&dir).map_err(|source| ConfigError::Read {
                path: dir.clone(),
                source,
            })?;
            Some(KubeDns {
                stub_domains: read_key(&dir, kubedns::STUB_DOMAINS)?,
                upstream_nameservers: read_key(&dir, kubedns::UPSTREAM_NAMESERVERS)?,
                dir,
            })
        }
        None => None,
    };
    Ok(Inputs {
        corefile,
        env,
        resolv_conf: read_if_present(&args.resolv_conf)?,
        kubedns,
        forward_files,
        imports,
        interfaces: interfaces(),
    })
}

/// The interfaces of the network namespace the agent runs in, with their IPv4 and IPv6
/// addresses (getifaddrs). None when they cannot be listed: `bind IFACE` then says so.
fn interfaces() -> BTreeMap<String, Vec<IpAddr>> {
    let mut out: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return out;
    };
    for ifa in list {
        let addrs = out.entry(ifa.interface_name).or_default();
        let Some(addr) = ifa.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        if !addrs.contains(&ip) {
            addrs.push(ip);
        }
    }
    out
}

/// Reads the files `args` names, then [`build`]s. When a node-cache template was rendered into
/// `--conf`, the rendered Corefile is written there, as node-cache does (for operators who look
/// at it; nodedns itself never reads it back). A failed write is logged, not fatal.
pub fn load(args: &ConfigArgs) -> Result<Config, ConfigError> {
    let inputs = read_inputs(args)?;
    let (config, rendered) = build_rendered(args, &inputs)?;
    if let (
        Some(Source {
            write: Some(out), ..
        }),
        Some(text),
    ) = (corefile_source(args), rendered)
    {
        if std::fs::read_to_string(&out).ok().as_deref() != Some(text.as_str()) {
            if let Err(e) = std::fs::write(&out, text) {
                tracing::warn!(path = %out.display(), error = %e, "cannot write the rendered Corefile");
            }
        }
    }
    Ok(config)
}

/// The configuration `args` and `inputs` describe. Pure: every problem is reported at once.
/// (The seam the tests and the fuzz targets feed; the binary goes through [`load`].)
pub fn build(args: &ConfigArgs, inputs: &Inputs) -> Result<Config, ConfigError> {
    build_rendered(args, inputs).map(|(config, _)| config)
}

/// What the Corefile configures, before the checks across blocks.
struct Layout {
    servers: Vec<Placed>,
    health: Option<SocketAddr>,
    lameduck: Option<Duration>,
    ready: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    extra_metrics: Vec<SocketAddr>,
    reload: Option<Duration>,
    warnings: Vec<String>,
    differences: Vec<Difference>,
}

fn build_rendered(
    args: &ConfigArgs,
    inputs: &Inputs,
) -> Result<(Config, Option<String>), ConfigError> {
    let mut problems = Vec::new();
    if args.setup_ebtables {
        problems.push(Problem::general(
            "-setupebtables: ebtables rules are not implemented (nodedns's rules do not need \
             them); remove the flag"
                .to_owned(),
        ));
    }
    let kube = match &inputs.kubedns {
        Some(k) => kubedns::interpret(k, &mut problems),
        None => kubedns::Parsed::default(),
    };
    let (layout, rendered) = match &inputs.corefile {
        Some((path, text)) => {
            let Some((layout, rendered)) =
                corefile_layout(args, inputs, path, text, &kube, &mut problems)
            else {
                return Err(ConfigError::invalid(problems));
            };
            (layout, Some(rendered))
        }
        None => (cli_layout(args, inputs, &mut problems), None),
    };
    let Layout {
        mut servers,
        health,
        lameduck,
        ready,
        metrics,
        extra_metrics,
        reload,
        warnings,
        mut differences,
    } = layout;

    let cluster_domains = cluster_domains(&servers);
    if args.cascade_prefetch && inputs.corefile.is_some() {
        differences.extend(cascade_difference(&servers, &cluster_domains));
    }
    let stub_file = inputs
        .kubedns
        .as_ref()
        .map(|k| k.dir.join(kubedns::STUB_DOMAINS).display().to_string());
    apply_kubedns(
        args,
        &kube,
        stub_file.as_deref(),
        &mut servers,
        &mut problems,
    );
    differences.extend(stub_differences(&kube, stub_file.as_deref()));
    check_duplicates(&servers, &mut problems);
    check_loops(args, &servers, &mut problems);
    for tap in servers.iter_mut().flat_map(|p| p.server.dnstap.iter_mut()) {
        tap.sample = args.dnstap_sample;
    }

    let node_cache_metrics = inputs
        .corefile
        .as_ref()
        .map(|_| args.metrics_listen_address.unwrap_or(NODE_CACHE_METRICS));
    let host_health_port = args.health_port.or(match inputs.corefile {
        Some(_) => Some(DEFAULT_HEALTH_PORT),
        None => health.map(|h| h.port()),
    });
    if problems.is_empty() {
        let config = Config {
            servers: servers.into_iter().map(|p| p.server).collect(),
            local_ips: args.local_ip.clone(),
            health,
            host_health_port,
            lameduck,
            ready,
            metrics,
            extra_metrics,
            node_cache_metrics,
            reload,
            warnings,
            cluster_domains,
            cascade_prefetch: args.cascade_prefetch,
            differences,
        };
        Ok((config, rendered))
    } else {
        Err(ConfigError::invalid(problems))
    }
}

fn corefile_layout(
    args: &ConfigArgs,
    inputs: &Inputs,
    path: &Path,
    text: &str,
    kube: &kubedns::Parsed,
    problems: &mut Vec<Problem>,
) -> Option<(Layout, String)> {
    let file = path.display().to_string();
    let fill = template::Fill {
        local_ips: &args.local_ip,
        upstream_service: &args.upstreamsvc,
        env: &inputs.env,
        resolv_conf_path: &args.resolv_conf,
        upstream_nameservers: kube.upstreams.as_deref(),
    };
    let rendered = template::render(&file, text, &fill)
        .map_err(|p| problems.extend(p))
        .ok()?;
    let dir = import_dir(args, path);
    let corefile::Corefile {
        blocks,
        lines,
        warnings: syntax_warnings,
    } = corefile::parse(
        &file,
        &rendered.text,
        &inputs.env,
        &dir,
        &mut &inputs.imports,
    )
    .map_err(|p| problems.extend(p))
    .ok()?;
    if blocks.is_empty() {
        problems.push(Problem::in_file(&file, "has no server block".to_owned()));
        return None;
    }
    let ctx = directives::Ctx {
        file: &file,
        dns_port: args.dns_port,
        resolv_conf_path: &args.resolv_conf,
        resolv_conf: inputs.resolv_conf.as_deref(),
        forward_files: &inputs.forward_files,
        upstream_lines: &rendered.upstream_lines,
        kube_upstreams: kube.upstreams.is_some(),
        interfaces: &inputs.interfaces,
    };
    let before = problems.len();
    let mut parsed = directives::interpret(&blocks, &ctx, problems);
    // What the directives say about lines of imported files, put back in those files.
    for p in &mut problems[before..] {
        p.location = p.location.as_deref().map(|l| lines.relocate(l));
        p.message = lines.relocate(&p.message);
    }
    for placed in &mut parsed.servers {
        placed.origin = lines.relocate(&placed.origin);
    }
    for d in &mut parsed.differences {
        d.at = lines.relocate(&d.at);
    }
    let mut warnings = syntax_warnings;
    warnings.extend(parsed.warnings.iter().map(|w| lines.relocate(w)));
    let directive_health = parsed.health.get();
    if let (Some(port), Some(h)) = (args.health_port, directive_health) {
        if h.port() != port {
            warnings.push(format!(
                "{file}: `health` listens on port {} but -health-port is {port}: the host rules \
                 exempt port {port} from conntrack",
                h.port()
            ));
        }
    }
    // Without `prometheus`, the flag's address is the metrics address (it is served anyway:
    // `node_cache_metrics`).
    let metrics = parsed.metrics.get().or(args.metrics_listen_address);
    let layout = Layout {
        servers: parsed.servers,
        health: args.health.or(directive_health),
        lameduck: parsed.lameduck.get(),
        ready: parsed.ready.get(),
        metrics,
        extra_metrics: parsed.extra_metrics,
        reload: parsed.reload.get(),
        warnings,
        differences: parsed.differences,
    };
    Some((layout, rendered.text))
}

/// CLI mode: one block for `.` on `--listen`, forwarding to `--upstream` (TCP) or the node's
/// resolvers (UDP first), with nodedns's cache defaults.
fn cli_layout(args: &ConfigArgs, inputs: &Inputs, problems: &mut Vec<Problem>) -> Layout {
    let listen = if !args.listen.is_empty() {
        args.listen.clone()
    } else if !args.local_ip.is_empty() {
        args.local_ip
            .iter()
            .map(|ip| SocketAddr::new(*ip, args.dns_port))
            .collect()
    } else {
        vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 5353)]
    };
    let (addrs, transport) = if args.upstream.is_empty() {
        let file = args.resolv_conf.display().to_string();
        match template::node_resolvers(&file, inputs.resolv_conf.as_deref()) {
            Ok(addrs) => (addrs, Transport::PreferUdp),
            Err(p) => {
                problems.extend(p);
                (Vec::new(), Transport::PreferUdp)
            }
        }
    } else {
        (args.upstream.clone(), Transport::Tcp)
    };
    let server = Server {
        zones: vec![".".to_owned()],
        listen,
        cache: Some(crate::plugin::cache::default_policy(args.cache_size)),
        forwards: vec![Forward {
            from: ".".to_owned(),
            except: Vec::new(),
            next: Vec::new(),
            upstream: nodedns_upstream::Config {
                addrs,
                transport,
                max_connections: usize::from(args.upstream_max_connections),
                ..Default::default()
            },
        }],
        log: Vec::new(),
        errors: true,
        loop_check: false,
        dnstap: Vec::new(),
        chain: crate::plugin::Chain::default(),
        scheme: Scheme::Dns,
        tls: None,
    };
    if let Err(e) = server
        .cache
        .as_ref()
        .map_or(Ok(()), nodedns_cache::Policy::validate)
    {
        problems.push(Problem::general(format!("--cache-size: {e}")));
    }
    let health = args.health.or_else(|| {
        let ip = args
            .local_ip
            .first()
            .copied()
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        args.health_port.map(|port| SocketAddr::new(ip, port))
    });
    Layout {
        servers: vec![Placed {
            server,
            origin: "the command line".to_owned(),
        }],
        health,
        lameduck: None,
        ready: None,
        metrics: args.metrics_listen_address,
        extra_metrics: Vec::new(),
        reload: None,
        warnings: Vec::new(),
        // No Corefile: nothing node-cache would run to compare with.
        differences: Vec::new(),
    }
}

/// The zones of `servers` that name a cluster domain: all but `.` and those under `arpa.`, in
/// order, each once.
fn cluster_domains(servers: &[Placed]) -> Vec<String> {
    let mut domains: Vec<String> = Vec::new();
    for zone in servers.iter().flat_map(|p| &p.server.zones) {
        let reverse = zone == "arpa." || zone.ends_with(".arpa.");
        if zone != "." && !reverse && !domains.contains(zone) {
            domains.push(zone.clone());
        }
    }
    domains
}

/// The ndots cascade prefetch, noted at the first block serving a cluster domain: node-cache
/// has none.
fn cascade_difference(servers: &[Placed], domains: &[String]) -> Option<Difference> {
    let first = domains.first()?;
    let block = servers.iter().find(|p| p.server.zones.contains(first))?;
    Some(Difference {
        at: block.origin.clone(),
        what: format!(
            "the ndots cascade prefetch is on: a pod's first search-list step under {} answered \
             NXDOMAIN starts the fetches of its later steps (--cascade-prefetch=false turns it \
             off); node-cache has no such thing",
            domains.join(" ")
        ),
    })
}

/// The cache node-cache gives stub domains (`cache 30`), with nodedns's defaults for the rest.
fn stub_policy() -> nodedns_cache::Policy {
    let mut p = crate::plugin::cache::default_policy(
        2 * crate::plugin::cache::DEFAULT_ENTRIES * crate::plugin::cache::BYTES_PER_ENTRY,
    );
    p.success.max = 30;
    p.denial.max = 30;
    p
}

/// kube-dns ConfigMap: `upstreamNameservers` replace the upstreams of `.` (over UDP, as
/// node-cache); each stub domain becomes a block like the one node-cache appends (`errors`,
/// `cache 30`, bound to the local IPs, forwarding over UDP).
fn apply_kubedns(
    args: &ConfigArgs,
    kube: &kubedns::Parsed,
    stub_file: Option<&str>,
    servers: &mut Vec<Placed>,
    problems: &mut Vec<Problem>,
) {
    if let Some(upstreams) = &kube.upstreams {
        let mut replaced = false;
        for p in servers.iter_mut() {
            if !p.server.zones.iter().any(|z| z == ".") {
                continue;
            }
            // node-cache fills `__PILLAR__UPSTREAM__SERVERS__` only: when a `forward .` line of
            // the block was filled from it already, its other `forward .` lines (a `next`
            // chain) keep their own upstreams.
            let filled = p
                .server
                .forwards
                .iter()
                .any(|f| f.from == "." && f.upstream.addrs == *upstreams);
            for f in p
                .server
                .forwards
                .iter_mut()
                .filter(|f| f.from == "." && (!filled || f.upstream.addrs == *upstreams))
            {
                f.upstream.addrs.clone_from(upstreams);
                f.upstream.tls = None;
                f.upstream.transport = Transport::PreferUdp;
                replaced = true;
            }
        }
        if !replaced {
            problems.push(Problem::general(
                "kube-dns upstreamNameservers: no server block forwards `.`, so there is nothing \
                 for them to replace"
                    .to_owned(),
            ));
        }
    }
    if kube.stub_domains.is_empty() {
        return;
    }
    let listen: Vec<SocketAddr> = if args.local_ip.is_empty() {
        servers
            .iter()
            .find(|p| p.server.scheme == Scheme::Dns && p.server.zones.iter().any(|z| z == "."))
            .map(|p| p.server.listen.clone())
            .unwrap_or_default()
    } else {
        args.local_ip
            .iter()
            .map(|ip| SocketAddr::new(*ip, args.dns_port))
            .collect()
    };
    if listen.is_empty() {
        problems.push(Problem::general(
            "kube-dns stubDomains: no address to serve them on: pass -localip, or serve `.`"
                .to_owned(),
        ));
        return;
    }
    let origin = stub_file.unwrap_or(kubedns::STUB_DOMAINS);
    for (zone, addrs) in &kube.stub_domains {
        servers.push(Placed {
            server: Server {
                zones: vec![zone.clone()],
                listen: listen.clone(),
                cache: Some(stub_policy()),
                forwards: vec![Forward {
                    from: ".".to_owned(),
                    except: Vec::new(),
                    next: Vec::new(),
                    upstream: nodedns_upstream::Config {
                        addrs: addrs.clone(),
                        transport: Transport::PreferUdp,
                        ..Default::default()
                    },
                }],
                log: Vec::new(),
                errors: true,
                loop_check: false,
                dnstap: Vec::new(),
                chain: crate::plugin::Chain::default(),
                scheme: Scheme::Dns,
                tls: None,
            },
            origin: format!("{origin} ({zone})"),
        });
    }
}

/// The block node-cache appends for a stub domain has `cache 30` and a bare `forward`: here it
/// takes nodedns's defaults for the rest.
fn stub_differences(kube: &kubedns::Parsed, stub_file: Option<&str>) -> Vec<Difference> {
    let origin = stub_file.unwrap_or(kubedns::STUB_DOMAINS);
    let upstream = nodedns_upstream::Config::default();
    kube.stub_domains
        .iter()
        .map(|(zone, _)| Difference {
            at: format!("{origin} ({zone})"),
            what: format!(
                "the stub domain's block takes nodedns's defaults where node-cache's has none: \
                 prefetch and serve_stale on, {} cache entries per class counted as {} B each, \
                 at most {} queries in flight, idle upstream connections closed after {:?}",
                crate::plugin::cache::DEFAULT_ENTRIES,
                crate::plugin::cache::BYTES_PER_ENTRY,
                upstream.max_concurrent,
                upstream.expire
            ),
        })
        .collect()
}

/// Whether two listen sets receive some of the same queries.
fn overlap(a: &[SocketAddr], b: &[SocketAddr]) -> Option<SocketAddr> {
    a.iter().copied().find(|x| {
        b.iter().any(|y| {
            x == y || (x.port() == y.port() && (x.ip().is_unspecified() || y.ip().is_unspecified()))
        })
    })
}

/// The same zone served twice on one address would make routing ambiguous (CoreDNS refuses it
/// too).
fn check_duplicates(servers: &[Placed], problems: &mut Vec<Problem>) {
    for (i, a) in servers.iter().enumerate() {
        for b in &servers[i + 1..] {
            let Some(addr) = overlap(&a.server.listen, &b.server.listen) else {
                continue;
            };
            // One address, one way of reading it: a socket serves one transport.
            let how = |s: &Server| match (s.scheme, s.tls.is_some()) {
                (Scheme::Dns, _) => "dns://",
                (Scheme::Tls, false) => "tls:// without tls (plain DNS over TCP)",
                (Scheme::Tls, true) => "tls://",
                (Scheme::Https, false) => "https:// without tls (cleartext HTTP)",
                (Scheme::Https, true) => "https://",
            };
            if how(&a.server) != how(&b.server) {
                problems.push(Problem::general(format!(
                    "{addr} is served as {} by {} and as {} by {}: one address serves one \
                     transport; give the blocks different ports",
                    how(&a.server),
                    a.origin,
                    how(&b.server),
                    b.origin
                )));
                continue;
            }
            for zone in a.server.zones.iter().filter(|z| b.server.zones.contains(z)) {
                problems.push(Problem::general(format!(
                    "zone `{zone}` is served twice on {addr}: by {} and by {}",
                    a.origin, b.origin
                )));
            }
        }
    }
}

/// An upstream that is nodedns itself: one of its listen addresses, or a local IP (which the
/// host plumbing puts on the node-local link, so the cluster DNS behind it is never reached).
fn check_loops(args: &ConfigArgs, servers: &[Placed], problems: &mut Vec<Problem>) {
    let listens: Vec<SocketAddr> = servers
        .iter()
        .flat_map(|p| p.server.listen.iter().copied())
        .collect();
    for p in servers {
        for addr in p.server.forwards.iter().flat_map(|f| &f.upstream.addrs) {
            let own_listen = listens.iter().any(|l| {
                l == addr
                    || (l.ip().is_unspecified()
                        && l.port() == addr.port()
                        && (addr.ip().is_loopback()
                            || addr.ip().is_unspecified()
                            || args.local_ip.contains(&addr.ip())))
            });
            let what = if own_listen {
                "one of nodedns's own listen addresses"
            } else if args.local_ip.contains(&addr.ip()) {
                "one of nodedns's local IPs (-localip), which live on the node-local link"
            } else {
                continue;
            };
            problems.push(Problem::general(format!(
                "{}: forwarding to {addr} loops: it is {what}. Forward to the cluster DNS through \
                 a Service nodedns does not intercept (kube-dns-upstream, filled into \
                 __PILLAR__CLUSTER__DNS__ through -upstreamsvc), or to the node's resolvers",
                p.origin
            )));
        }
    }
}

#[cfg(test)]
mod dnstap_tests;
#[cfg(test)]
pub(crate) mod tests;
