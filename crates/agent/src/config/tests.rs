//! Loading as a whole: the stock node-local-dns Corefile, every directive and option and their
//! error paths (with line numbers), CLI mode, the kube-dns ConfigMap, loop refusal, `load`.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser;
use nodedns_cache::{Clamp, Policy, Prefetch, Refresh, Scope, Stale};
use nodedns_upstream::{Selection, Transport};

use super::*;
use crate::plugin::cache::{BYTES_PER_ENTRY, DEFAULT_PREFETCH, DEFAULT_STALE};

/// A directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("nodedns-config-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    config: ConfigArgs,
}

/// Flags as the binary would parse them (node-cache spelling accepted).
pub(crate) fn cli(args: &[&str]) -> ConfigArgs {
    let all = std::iter::once("nodedns")
        .chain(args.iter().copied())
        .map(Into::into);
    Cli::try_parse_from(normalize_args(all))
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

const LOCAL: &str = "169.254.20.10";
const KUBE_DNS: &str = "10.96.0.10";
const UPSTREAM_SVC: &str = "10.96.0.11";
const NODE_RESOLVER: &str = "10.0.0.2";

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// The stock DaemonSet's flags (iptables mode, placeholders filled).
fn stock_args() -> ConfigArgs {
    cli(&[
        "-localip",
        &format!("{LOCAL},{KUBE_DNS}"),
        "-conf",
        "/etc/Corefile",
        "-upstreamsvc",
        "kube-dns-upstream",
    ])
}

fn stock_env() -> HashMap<String, String> {
    HashMap::from([(
        "KUBE_DNS_UPSTREAM_SERVICE_HOST".to_owned(),
        UPSTREAM_SVC.to_owned(),
    )])
}

fn inputs(corefile: &str) -> Inputs {
    Inputs {
        corefile: Some((PathBuf::from("Corefile"), corefile.to_owned())),
        env: stock_env(),
        resolv_conf: Some(format!("nameserver {NODE_RESOLVER}\n")),
        kubedns: None,
        forward_files: BTreeMap::new(),
        imports: Imports::default(),
        interfaces: host_interfaces(),
    }
}

/// The interfaces `bind IFACE` finds: `lo`, and `eth0` with an IPv6 link-local address beside
/// its others; `down0` has none.
fn host_interfaces() -> BTreeMap<String, Vec<IpAddr>> {
    BTreeMap::from([
        ("lo".to_owned(), vec![ip("127.0.0.1"), ip("::1")]),
        (
            "eth0".to_owned(),
            vec![ip("10.0.0.5"), ip("fe80::5"), ip("fd00::5")],
        ),
        ("down0".to_owned(), Vec::new()),
    ])
}

fn messages(err: ConfigError) -> Vec<String> {
    match err {
        ConfigError::Invalid { problems } => problems.iter().map(ToString::to_string).collect(),
        other => panic!("not a validation error: {other}"),
    }
}

/// `text` loaded with the stock flags.
fn load_str(text: &str) -> Result<Config, Vec<String>> {
    build(&stock_args(), &inputs(text)).map_err(messages)
}

fn ok(text: &str) -> Config {
    load_str(text).unwrap_or_else(|e| panic!("{e:#?}"))
}

fn errs(text: &str) -> Vec<String> {
    match load_str(text) {
        Ok(c) => panic!("accepted: {c:#?}"),
        Err(e) => e,
    }
}

/// One block for `.` on the local IP with `body` as its directives.
fn block(body: &str) -> String {
    format!(".:53 {{\n    bind {LOCAL}\n{body}\n}}\n")
}

fn cache_of(body: &str) -> Policy {
    ok(&block(body)).servers[0].cache.clone().unwrap()
}

fn forward_of(body: &str) -> Forward {
    ok(&block(body)).servers[0].forwards[0].clone()
}

/// Asserts `errs` holds one message per `(line, fragment)`, in order.
#[track_caller]
fn assert_errs(errs: &[String], expected: &[(usize, &str)]) {
    assert_eq!(errs.len(), expected.len(), "{errs:#?}");
    for (e, (line, fragment)) in errs.iter().zip(expected) {
        let at = format!("Corefile:{line}: ");
        assert!(
            e.starts_with(&at) && e.contains(fragment),
            "expected {at}…{fragment}…, got {e}"
        );
    }
}

fn q(name: &str) -> Vec<u8> {
    values::wire(&values::canonical_name(name).unwrap())
}

// ---------------------------------------------------------------------------------------------
// The stock node-local-dns Corefile

/// The fixture after the manifest's documented install step (iptables mode).
fn stock_corefile_after_install() -> String {
    include_str!("testdata/Corefile.base")
        .replace("__PILLAR__DNS__DOMAIN__", "cluster.local")
        .replace("__PILLAR__LOCAL__DNS__", LOCAL)
        .replace("__PILLAR__DNS__SERVER__", KUBE_DNS)
}

#[test]
fn stock_corefile_parses_fills_the_pillars_and_matches_node_cache() {
    let config = build(&stock_args(), &inputs(&stock_corefile_after_install())).unwrap();
    let zones: Vec<&str> = config.servers.iter().map(|s| s.zones[0].as_str()).collect();
    assert_eq!(zones, ["cluster.local.", "in-addr.arpa.", "ip6.arpa.", "."]);
    let listen = [addr("169.254.20.10:53"), addr("10.96.0.10:53")];
    for s in &config.servers {
        assert_eq!(s.zones.len(), 1);
        assert_eq!(s.listen, listen);
        assert!(s.errors && s.loop_check && s.log.is_empty());
    }
    let cluster = &config.servers[0];
    assert_eq!(
        cluster.cache,
        Some(Policy {
            capacity_bytes: (9984 + 9984) * BYTES_PER_ENTRY,
            success: Clamp { min: 5, max: 30 },
            denial: Clamp { min: 5, max: 5 },
            servfail_ttl: 5,
            stale: Some(DEFAULT_STALE),
            prefetch: Some(DEFAULT_PREFETCH),
            keep_ttl: false,
            scope: Scope::default(),
        })
    );
    let f = &cluster.forwards[0];
    assert_eq!(f.from, ".");
    assert_eq!(f.upstream.addrs, [addr("10.96.0.11:53")]);
    assert_eq!(f.upstream.transport, Transport::Tcp);
    for reverse in &config.servers[1..3] {
        let c = reverse.cache.as_ref().unwrap();
        assert_eq!(
            (c.success, c.denial),
            (Clamp { min: 5, max: 30 }, Clamp { min: 5, max: 30 })
        );
        assert_eq!(reverse.forwards[0].upstream.transport, Transport::Tcp);
    }
    let root = &config.servers[3].forwards[0];
    assert_eq!(
        root.upstream.addrs,
        [addr("10.0.0.2:53")],
        "the node's resolv.conf"
    );
    assert_eq!(
        root.upstream.transport,
        Transport::PreferUdp,
        "plain forward: UDP, as CoreDNS"
    );
    assert_eq!(config.local_ips, [ip(LOCAL), ip(KUBE_DNS)]);
    assert_eq!(config.health, Some(addr("169.254.20.10:8080")));
    assert_eq!(config.metrics, Some(addr("0.0.0.0:9253")));
    assert_eq!(config.ready, None);
    assert_eq!(config.reload, Some(Duration::from_secs(30)));
    assert!(config.warnings.is_empty(), "{:?}", config.warnings);
}

/// What `config` notes as differing from node-cache at `file:line`, in order.
fn differences_at<'c>(config: &'c Config, at: &str) -> Vec<&'c str> {
    config
        .differences
        .iter()
        .filter(|d| d.at == at)
        .map(|d| d.what.as_str())
        .collect()
}

#[test]
fn stock_corefile_notes_where_nodedns_defaults_differ_from_node_cache() {
    let config = build(&stock_args(), &inputs(&stock_corefile_after_install())).unwrap();
    // Each block: its cache line (bytes, prefetch, serve-stale) and its forward line.
    for (cache, forward) in [(3, 10), (18, 22), (29, 33), (40, 44)] {
        let noted = differences_at(&config, &format!("Corefile:{cache}"));
        assert_eq!(noted.len(), 3, "{noted:#?}");
        let [bytes, prefetch, stale] = [noted[0], noted[1], noted[2]];
        assert!(bytes.starts_with("cache: sized in bytes"), "{bytes}");
        assert!(
            bytes.contains("9984 success + 9984 denial entries"),
            "{bytes}"
        );
        assert!(bytes.contains("10223616 bytes"), "{bytes}");
        assert!(prefetch.starts_with("cache: prefetch is on"), "{prefetch}");
        assert!(stale.starts_with("cache: serve_stale is on"), "{stale}");
        let noted = differences_at(&config, &format!("Corefile:{forward}"));
        assert_eq!(noted.len(), 2, "{noted:#?}");
        assert!(
            noted[0].contains("at most 1000 queries in flight"),
            "{}",
            noted[0]
        );
        assert!(noted[1].contains("closed after 5s"), "{}", noted[1]);
    }
    let noted = differences_at(&config, "Corefile:1");
    assert_eq!(noted.len(), 1, "{noted:#?}");
    assert!(
        noted[0].starts_with(
            "the ndots cascade prefetch is on: a pod's first search-list step under cluster.local."
        ),
        "{}",
        noted[0]
    );
    assert_eq!(config.differences.len(), 4 * 5 + 1);
    let mut off = stock_args();
    off.cascade_prefetch = false;
    let config = build(&off, &inputs(&stock_corefile_after_install())).unwrap();
    assert_eq!(config.differences.len(), 4 * 5, "off: nothing to note");
}

#[test]
fn options_written_out_are_no_longer_differences() {
    let config = ok(&block(
        "    cache {\n        prefetch 2\n        serve_stale 1h\n    }\n    forward . 10.0.0.1 {\n        max_concurrent 1000\n        expire 5s\n    }",
    ));
    let noted: Vec<&str> = config.differences.iter().map(|d| d.what.as_str()).collect();
    assert_eq!(noted.len(), 1, "{noted:#?}");
    assert!(
        noted[0].starts_with("cache: sized in bytes"),
        "{}",
        noted[0]
    );
    // Without a Corefile there is no node-cache configuration to compare with.
    let cli_mode = build(&cli(&["--upstream", "10.0.0.1"]), &Inputs::default()).unwrap();
    assert!(
        cli_mode.differences.is_empty(),
        "{:#?}",
        cli_mode.differences
    );
}

#[test]
fn stock_corefile_routes_as_node_cache_does() {
    let config = build(&stock_args(), &inputs(&stock_corefile_after_install())).unwrap();
    let router = Router::new(&config.servers);
    for local in [addr("169.254.20.10:53"), addr("10.96.0.10:53")] {
        let r = router
            .route(&q("kubernetes.default.svc.cluster.local."), local)
            .unwrap();
        assert_eq!((r.server, r.forward), (0, true));
        assert_eq!(
            router
                .route(&q("10.0.96.10.in-addr.arpa."), local)
                .unwrap()
                .server,
            1
        );
        assert_eq!(
            router.route(&q("10.in-addr.arpa."), local).unwrap().server,
            1
        );
        let v6 = "1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.d.f.ip6.arpa.";
        assert_eq!(router.route(&q(v6), local).unwrap().server, 2);
        let r = router.route(&q("example.com."), local).unwrap();
        assert_eq!((r.server, r.forward), (3, true));
    }
    assert_eq!(
        router.route(&q("example.com."), addr("127.0.0.1:53")),
        None,
        "not bound there"
    );
}

#[test]
fn stock_corefile_with_local_pillars_left_to_node_cache_gives_the_same_config() {
    // IPVS mode: one local IP. Only the domain is filled by the install step; node-cache fills
    // __PILLAR__LOCAL__DNS__ from -localip and drops __PILLAR__DNS__SERVER__.
    let mut args = stock_args();
    args.local_ip = vec![ip(LOCAL)];
    let raw =
        include_str!("testdata/Corefile.base").replace("__PILLAR__DNS__DOMAIN__", "cluster.local");
    let installed = include_str!("testdata/Corefile.base")
        .replace("__PILLAR__DNS__DOMAIN__", "cluster.local")
        .replace("__PILLAR__LOCAL__DNS__", LOCAL)
        .replace("__PILLAR__DNS__SERVER__", "");
    let a = build(&args, &inputs(&raw)).unwrap();
    assert_eq!(a, build(&args, &inputs(&installed)).unwrap());
    assert_eq!(a.servers[0].listen, [addr("169.254.20.10:53")]);
    assert_eq!(a.health, Some(addr("169.254.20.10:8080")));
    let (_, rendered) = build_rendered(&args, &inputs(&raw)).unwrap();
    let rendered = rendered.unwrap();
    assert!(rendered.contains("bind 169.254.20.10 \n"), "{rendered}");
    assert!(rendered.contains("forward . 10.96.0.11 {\n"), "{rendered}");
    assert!(
        rendered.contains("forward . /etc/resolv.conf\n"),
        "node-cache writes the path: {rendered}"
    );
}

#[test]
fn local_pillar_with_two_local_ips_breaks_health_as_in_node_cache() {
    // node-cache renders `health 169.254.20.10 10.96.0.10:8080` too, which CoreDNS refuses: the
    // manifest's install step is meant to fill __PILLAR__LOCAL__DNS__ itself.
    let raw =
        include_str!("testdata/Corefile.base").replace("__PILLAR__DNS__DOMAIN__", "cluster.local");
    let errs = build(&stock_args(), &inputs(&raw))
        .map_err(messages)
        .unwrap_err();
    assert_errs(&errs, &[(14, "health: expected `health [ADDRESS]`, got 2")]);
}

#[test]
fn stock_corefile_without_the_upstream_service_variable_is_a_clear_error() {
    let mut i = inputs(&stock_corefile_after_install());
    i.env.clear();
    let errs = build(&stock_args(), &i).map_err(messages).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].starts_with("Corefile:10: __PILLAR__CLUSTER__DNS__ needs the ClusterIP of Service `kube-dns-upstream`"), "{}", errs[0]);
    assert!(
        errs[0].contains("KUBE_DNS_UPSTREAM_SERVICE_HOST"),
        "{}",
        errs[0]
    );
}

#[test]
fn stock_corefile_with_the_domain_unfilled_says_who_fills_it() {
    let raw = include_str!("testdata/Corefile.base");
    let errs = build(&stock_args(), &inputs(raw))
        .map_err(messages)
        .unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with("Corefile:1: __PILLAR__DNS__DOMAIN__ is not filled"),
        "{}",
        errs[0]
    );
}

#[test]
fn upstreamsvc_names_the_environment_variable() {
    let text = block("    forward . __PILLAR__CLUSTER__DNS__");
    let mut args = stock_args();
    args.upstreamsvc = "my-dns".to_owned();
    let mut i = inputs(&text);
    i.env
        .insert("MY_DNS_SERVICE_HOST".to_owned(), "10.96.0.53".to_owned());
    let config = build(&args, &i).unwrap();
    assert_eq!(
        config.servers[0].forwards[0].upstream.addrs,
        [addr("10.96.0.53:53")]
    );
}

// ---------------------------------------------------------------------------------------------
// Server block keys and `bind`

#[test]
fn keys_take_zones_ports_schemes_and_cidrs() {
    let c = ok(&format!(
        "dns://Example.ORG:1053 10.0.0.0/8:1053 {{\n  bind {LOCAL}\n}}\nexample.net {{\n  bind {LOCAL}\n}}\n"
    ));
    assert_eq!(c.servers[0].zones, ["example.org.", "10.in-addr.arpa."]);
    assert_eq!(c.servers[0].listen, [addr("169.254.20.10:1053")]);
    assert_eq!(
        c.servers[1].listen,
        [addr("169.254.20.10:53")],
        "default port"
    );
    let mut args = stock_args();
    args.dns_port = 5300;
    let c = build(
        &args,
        &inputs(&format!("example.net {{\n  bind {LOCAL}\n}}\n")),
    )
    .unwrap();
    assert_eq!(
        c.servers[0].listen,
        [addr("169.254.20.10:5300")],
        "-dns.port"
    );
}

#[test]
fn bad_keys_are_errors_with_their_lines() {
    let errs = errs(
        "grpc://example.org {\n}\na.example:53 b.example:54 {\n}\nc.example:99999 {\n}\nd..example {\n}\ne.example e.example {\n}\n10.0.0.0/12 {\n}\n",
    );
    assert_errs(
        &errs,
        &[
            (1, "grpc:// server blocks are not implemented"),
            (5, "port is not a number"),
            (7, "empty label"),
            (9, "listed twice"),
            (11, "label boundaries"),
        ],
    );
}

#[test]
fn tls_and_https_keys_take_their_scheme_and_its_default_port() {
    let c = ok(&format!(
        "tls://.:8853 {{\n  bind {LOCAL}\n}}\ntls://example.org {{\n  bind {LOCAL}\n}}\n\
         https://example.net {{\n  bind {LOCAL}\n}}\ndns://example.com {{\n  bind {LOCAL}\n}}\n"
    ));
    let got: Vec<_> = c
        .servers
        .iter()
        .map(|s| (s.scheme, s.listen.clone(), s.tls.is_some()))
        .collect();
    assert_eq!(
        got,
        [
            (Scheme::Tls, vec![addr("169.254.20.10:8853")], false),
            (Scheme::Tls, vec![addr("169.254.20.10:853")], false),
            (Scheme::Https, vec![addr("169.254.20.10:443")], false),
            (Scheme::Dns, vec![addr("169.254.20.10:53")], false),
        ]
    );
}

#[test]
fn a_tls_directive_loads_the_certificate_the_block_serves_with() {
    let dir = TempDir::new("server-tls");
    let (ca, cert, key) = tls_files(&dir);
    let (ca, cert, key) = (ca.display(), cert.display(), key.display());
    let c = ok(&format!(
        "tls://.:853 {{\n  bind {LOCAL}\n  tls {cert} {key}\n}}\n\
         https://.:443 {{\n  bind {LOCAL}\n  tls {cert} {key} {ca} {{\n    client_auth require_and_verify\n  }}\n}}\n"
    ));
    let dot = c.servers[0]
        .tls
        .as_ref()
        .expect("tls:// has its certificate");
    assert_eq!(dot.client_auth, crate::plugin::tls::ClientAuth::None);
    assert!(dot.config.alpn_protocols.is_empty(), "RFC 7858: no ALPN");
    let doh = c.servers[1]
        .tls
        .as_ref()
        .expect("https:// has its certificate");
    assert_eq!(doh.client_auth, crate::plugin::tls::ClientAuth::Require);
    assert_eq!(
        doh.config.alpn_protocols,
        [b"h2".to_vec(), b"http/1.1".to_vec()]
    );
    // The same files load equal settings (a reload that reads them again changes nothing).
    let again = ok(&format!(
        "tls://.:853 {{\n  bind {LOCAL}\n  tls {cert} {key}\n}}\n\
         https://.:443 {{\n  bind {LOCAL}\n  tls {cert} {key} {ca} {{\n    client_auth require_and_verify\n  }}\n}}\n"
    ));
    assert_eq!(c.servers, again.servers);
}

#[test]
fn server_tls_errors_are_all_reported_with_their_lines() {
    let dir = TempDir::new("server-tls-errors");
    let (ca, cert, key) = tls_files(&dir);
    let (ca, cert, key) = (ca.display(), cert.display(), key.display());
    let errs = errs(&format!(
        "tls://a.example {{\n  bind {LOCAL}\n  tls {cert}\n}}\n\
         tls://b.example:854 {{\n  bind {LOCAL}\n  tls /nonexistent/cert.pem {key}\n}}\n\
         tls://c.example:855 {{\n  bind {LOCAL}\n  tls {cert} {key} {{\n    client_auth require_and_verify\n  }}\n}}\n\
         tls://d.example:856 {{\n  bind {LOCAL}\n  tls {cert} {key} {ca} {{\n    client_auth request\n    ocsp on\n  }}\n}}\n\
         tls://e.example:857 {{\n  bind {LOCAL}\n  tls {cert} {cert}\n}}\n\
         tls://f.example:858 https://g.example:858 {{\n  bind {LOCAL}\n}}\n"
    ));
    assert_errs(
        &errs,
        &[
            (3, "tls: expected `tls CERT KEY [CA]`, got 1 argument(s)"),
            (7, "tls: cannot read the certificate /nonexistent/cert.pem"),
            (
                11,
                "client_auth that verifies client certificates needs the CA argument",
            ),
            (
                18,
                "client_auth request asks for a client certificate and does not verify it",
            ),
            (19, "tls: unknown option `ocsp`"),
            (24, "holds no private key"),
            (26, "a block's keys all have one scheme"),
        ],
    );
}

#[test]
fn one_address_serves_one_transport() {
    let errs = errs(&format!(
        ".:853 {{\n  bind {LOCAL}\n}}\ntls://example.org:853 {{\n  bind {LOCAL}\n}}\n"
    ));
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].contains(
            "169.254.20.10:853 is served as dns:// by Corefile:1 and as tls:// without tls"
        ),
        "{errs:?}"
    );
}

#[test]
fn tls_in_a_dns_block_is_a_warning() {
    let dir = TempDir::new("server-tls-dns");
    let (_, cert, key) = tls_files(&dir);
    let c = ok(&block(&format!(
        "    tls {} {}",
        cert.display(),
        key.display()
    )));
    assert!(c.servers[0].tls.is_none());
    assert!(
        c.warnings
            .iter()
            .any(|w| w.starts_with("Corefile:3: tls has no effect in a dns:// block")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn without_bind_a_block_listens_on_every_address() {
    let c = ok(".:1053 {\n  errors\n}\n");
    assert_eq!(
        c.servers[0].listen,
        [addr("0.0.0.0:1053"), addr("[::]:1053")]
    );
}

#[test]
fn bind_lines_accumulate_and_except_removes() {
    // `except` applies to its own line only, as in CoreDNS: 10.0.0.2 stays.
    let c = ok(
        ".:53 {\n  bind 10.0.0.1 10.0.0.2\n  bind fd00::1 10.0.0.1\n  bind 10.0.0.3 10.0.0.4 {\n    except 10.0.0.2 10.0.0.4\n  }\n}\n",
    );
    assert_eq!(
        c.servers[0].listen,
        [
            addr("10.0.0.1:53"),
            addr("10.0.0.2:53"),
            addr("[fd00::1]:53"),
            addr("10.0.0.3:53")
        ]
    );
}

#[test]
fn bind_takes_interfaces_for_their_addresses_without_ipv6_link_local() {
    let c = ok(".:53 {\n  bind lo eth0\n}\n");
    assert_eq!(
        c.servers[0].listen,
        [
            addr("127.0.0.1:53"),
            addr("[::1]:53"),
            addr("10.0.0.5:53"),
            addr("[fd00::5]:53")
        ]
    );
    // `except` takes interfaces and addresses too.
    let c = ok(".:53 {\n  bind lo eth0 {\n    except lo fd00::5\n  }\n}\n");
    assert_eq!(c.servers[0].listen, [addr("10.0.0.5:53")]);
    // An interface without an address leaves nothing to listen on.
    let errs = errs(".:53 {\n  bind down0\n}\n");
    assert_errs(&errs, &[(1, "`bind` leaves no address to listen on")]);
}

#[test]
fn bind_errors_name_their_lines() {
    let errs = errs(
        ".:53 {\n  bind\n  bind eth9 fe80::1%eth0\n  bind 10.0.0.1 {\n    only 10.0.0.1\n  }\n}\n",
    );
    assert_errs(
        &errs,
        &[
            (2, "expected `bind ADDRESS|IFACE...`"),
            (
                3,
                "`eth9` is not an IP address nor an interface of this host (interfaces: down0 eth0 lo;",
            ),
            (3, "`fe80::1%eth0` is not an IP address"),
            (5, "unknown option `only` of `bind`"),
        ],
    );
    let errs = self::errs(".:53 {\n  bind 10.0.0.1 {\n    except 10.0.0.1\n  }\n}\n");
    assert_errs(&errs, &[(1, "it excepts every address it lists")]);
}

// ---------------------------------------------------------------------------------------------
// `cache`

#[test]
fn cache_without_options_has_coredns_clamps_and_nodedns_defaults() {
    let p = cache_of("    cache");
    assert_eq!(p.success, Clamp { min: 5, max: 3600 });
    assert_eq!(p.denial, Clamp { min: 5, max: 1800 });
    assert_eq!(p.servfail_ttl, 5);
    assert_eq!(p.stale, Some(DEFAULT_STALE));
    assert_eq!(p.prefetch, Some(DEFAULT_PREFETCH));
    assert_eq!(p.capacity_bytes, 2 * 9984 * BYTES_PER_ENTRY);
}

#[test]
fn cache_ttl_caps_both_classes() {
    let p = cache_of("    cache 300");
    assert_eq!((p.success.max, p.denial.max), (300, 300));
    // Below the minimum, the maximum wins (CoreDNS applies the minimum first).
    let p = cache_of("    cache 2");
    assert_eq!(
        (p.success, p.denial),
        (Clamp { min: 2, max: 2 }, Clamp { min: 2, max: 2 })
    );
}

#[test]
fn cache_success_and_denial_set_capacity_ttl_and_minttl() {
    let p = cache_of("    cache {\n        success 5000 60 10\n        denial 2048 20 0\n    }");
    assert_eq!(p.success, Clamp { min: 10, max: 60 });
    assert_eq!(p.denial, Clamp { min: 0, max: 20 });
    // 5000 rounds down to 4864 (a multiple of CoreDNS's 256 shards).
    assert_eq!(p.capacity_bytes, (4864 + 2048) * BYTES_PER_ENTRY);
    let p = cache_of("    cache {\n        success 10\n        denial 1\n    }");
    assert_eq!(
        p.capacity_bytes,
        (1024 + 1024) * BYTES_PER_ENTRY,
        "CoreDNS's smallest cache"
    );
}

#[test]
fn cache_minttl_above_ttl_is_accepted_with_a_warning() {
    let c = ok(&block("    cache {\n        success 1024 10 20\n    }"));
    assert_eq!(
        c.servers[0].cache.as_ref().unwrap().success,
        Clamp { min: 10, max: 10 }
    );
    assert_eq!(c.warnings.len(), 1);
    assert!(
        c.warnings[0].starts_with("Corefile:3: cache success: MINTTL 20"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn cache_prefetch_sets_amount_window_and_percentage_or_turns_it_off() {
    let c = ok(&block("    cache {\n        prefetch 5 10m 20%\n    }"));
    assert_eq!(
        c.servers[0].cache.as_ref().unwrap().prefetch,
        Some(Prefetch {
            amount: 5,
            window: Duration::from_secs(600),
            percentage: 20
        })
    );
    assert!(
        !c.warnings.iter().any(|w| w.contains("prefetch")),
        "{:?}",
        c.warnings
    );
    let p = cache_of("    cache {\n        prefetch 3\n    }");
    assert_eq!(
        p.prefetch,
        Some(Prefetch {
            amount: 3,
            window: Duration::from_secs(60),
            percentage: 10
        })
    );
    assert_eq!(
        cache_of("    cache {\n        prefetch 0\n    }").prefetch,
        None
    );
}

/// The stale policy of a block whose `cache` has this one option line.
fn stale_of(option: &str) -> Option<Stale> {
    cache_of(&format!("    cache {{\n        {option}\n    }}")).stale
}

#[test]
fn cache_keepttl_and_disable_set_the_policy() {
    let p = cache_of(
        "    cache {\n        keepttl\n        disable denial sub.example.org Example.NET\n        disable success\n    }",
    );
    assert!(p.keep_ttl);
    assert_eq!(
        p.scope.no_denial,
        [
            values::wire("sub.example.org.").into_boxed_slice(),
            values::wire("example.net.").into_boxed_slice()
        ]
    );
    assert_eq!(p.scope.no_success, [values::wire(".").into_boxed_slice()]);
    assert!(p.scope.zones.is_empty());
    let errs = errs(&block(
        "    cache {\n        keepttl 5\n        disable\n        disable everything\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (4, "keepttl: expected `keepttl`"),
            (5, "disable: expected `disable success|denial [ZONES...]`"),
            (
                6,
                "cache disable: expected `success` or `denial`, not `everything`",
            ),
        ],
    );
}

#[test]
fn cache_zones_narrower_than_the_block_scope_the_cache() {
    let p = cache_of("    cache 30 example.com");
    assert_eq!(
        p.scope.zones,
        [values::wire("example.com.").into_boxed_slice()]
    );
    assert_eq!(p.success.max, 30);
    // Zones that cover the block leave the scope open.
    assert!(
        cache_of("    cache 30 . example.com")
            .scope
            .zones
            .is_empty()
    );
}

#[test]
fn cache_serve_stale_reads_coredns_1_14s_syntax() {
    let secs = Duration::from_secs;
    let written = |window: u64, refresh, ttl, recheck: u64| Stale {
        window: secs(window),
        ttl,
        refresh,
        recheck: secs(recheck),
        prefer_positive: false,
    };
    let immediate = Refresh::Immediate;
    let verify = |ms: Option<u64>| Refresh::Verify {
        timeout: ms.map(Duration::from_millis),
    };
    for (line, stale) in [
        // A written `serve_stale` is CoreDNS's: immediate, no recheck; the TTL is RFC 8767's.
        ("serve_stale", written(3600, immediate, 30, 0)),
        ("serve_stale 2h", written(7200, immediate, 30, 0)),
        ("serve_stale 2h immediate", written(7200, immediate, 30, 0)),
        (
            "serve_stale 2h IMMEDIATE 10s",
            written(7200, immediate, 10, 0),
        ),
        (
            "serve_stale 1h immediate 30s 30s",
            written(3600, immediate, 30, 30),
        ),
        ("serve_stale 1h verify", written(3600, verify(None), 30, 0)),
        (
            "serve_stale 1h verify 100ms",
            written(3600, verify(Some(100)), 30, 0),
        ),
        (
            "serve_stale 1h verify 0 20s",
            written(3600, verify(None), 20, 0),
        ),
        (
            "serve_stale 1h verify 100ms 30s 5m",
            written(3600, verify(Some(100)), 30, 300),
        ),
    ] {
        assert_eq!(stale_of(line), Some(stale), "{line}");
    }
    assert_eq!(
        stale_of("serve_stale 0s"),
        None,
        "a window of 0 turns it off"
    );
    assert_eq!(stale_of("serve_stale 0s verify"), None);
    // Without a line: nodedns's own (verify, a 5 s recheck).
    assert_eq!(cache_of("    cache").stale, Some(DEFAULT_STALE));
    assert_eq!(
        DEFAULT_STALE,
        written(3600, verify(None), 30, 5),
        "the difference note says `serve_stale 1h verify 0 30s 5s`"
    );
    // Nothing is left to warn about: both modes do what CoreDNS's do.
    assert!(
        ok(&block(
            "    cache {\n        serve_stale 1h immediate\n    }"
        ))
        .warnings
        .is_empty()
    );
}

#[test]
fn cache_serve_stale_policy_prefer_positive() {
    let stale = cache_of("    cache {\n        serve_stale 1h verify\n        serve_stale_policy prefer_positive\n    }")
        .stale
        .unwrap();
    assert!(stale.prefer_positive);
    assert_eq!(stale.refresh, Refresh::Verify { timeout: None });
    // In either order, and on nodedns's default serve-stale too.
    let stale = cache_of(
        "    cache {\n        serve_stale_policy PREFER_POSITIVE\n        serve_stale 2h\n    }",
    )
    .stale
    .unwrap();
    assert!(stale.prefer_positive && stale.window == Duration::from_secs(7200));
    assert!(
        stale_of("serve_stale_policy prefer_positive")
            .unwrap()
            .prefer_positive
    );
    assert!(!stale_of("serve_stale 1h").unwrap().prefer_positive);
}

#[test]
fn cache_serve_stale_errors_name_the_word() {
    let found = errs(&block(
        "    cache {
        serve_stale 1h verified
        serve_stale 1h immediate 0s
        serve_stale 1h immediate 1500ms
        serve_stale 1h immediate 30s 6m
        serve_stale 1h immediate 30s 30s 30s
        serve_stale 1h verify x
        serve_stale 1h verify 0 30s 30s 30s
        serve_stale 1h verify 0 5000000000s
        serve_stale_policy prefer_negative
        serve_stale_policy
        serve_stale_policy prefer_positive
    }",
    ));
    assert_errs(
        &found,
        &[
            (
                4,
                "serve_stale REFRESH_MODE must be `immediate` or `verify`, not `verified`",
            ),
            (5, "serve_stale RESPONSE_TTL must be above 0"),
            (
                6,
                "serve_stale RESPONSE_TTL must be a whole number of seconds, not `1500ms`",
            ),
            (7, "serve_stale FAILURE_RECHECK cannot exceed 5m, not `6m`"),
            (
                8,
                "serve_stale: expected `serve_stale [DURATION] [immediate",
            ),
            (9, "serve_stale VERIFY_TIMEOUT: `x`"),
            (10, "serve_stale: expected `serve_stale [DURATION]"),
            (
                11,
                "serve_stale RESPONSE_TTL `5000000000s` exceeds the DNS TTL range",
            ),
            (
                12,
                "serve_stale_policy must be `prefer_positive`, not `prefer_negative`",
            ),
            (13, "serve_stale_policy can only be given once"),
            (14, "serve_stale_policy can only be given once"),
        ],
    );
    let off = errs(&block(
        "    cache {\n        serve_stale 0s\n        serve_stale_policy prefer_positive\n    }",
    ));
    assert_errs(
        &off,
        &[(
            5,
            "serve_stale_policy needs serve-stale, which `serve_stale 0s` turns off",
        )],
    );
}

#[test]
fn cache_servfail_sets_the_servfail_ttl() {
    assert_eq!(
        cache_of("    cache {\n        servfail 10s\n    }").servfail_ttl,
        10
    );
    assert_eq!(
        cache_of("    cache {\n        servfail 0\n    }").servfail_ttl,
        0
    );
    assert_eq!(
        cache_of("    cache {\n        servfail 1500ms\n    }").servfail_ttl,
        2
    );
}

#[test]
fn cache_errors_are_all_reported_with_their_lines() {
    let errs = errs(&block(
        "    cache 0 {
        success
        success abc
        denial 100 0
        denial 100 10 -1
        prefetch 1 1m 5%
        prefetch 1 1m 10
        prefetch x
        prefetch 1 2 3 4
        serve_stale 1h sometimes
        serve_stale -1h
        servfail 6m
        servfail
        keepttl on
        success 1 { }
    }",
    ));
    assert_errs(
        &errs,
        &[
            (3, "cache TTL cannot be zero or negative: 0"),
            (
                4,
                "success: expected `success CAPACITY [TTL [MINTTL]]`, got 0",
            ),
            (5, "success CAPACITY must be a whole number, not `abc`"),
            (6, "denial TTL cannot be zero or negative: 0"),
            (7, "denial MINTTL cannot be negative: -1"),
            (8, "prefetch PERCENTAGE must be from 10% to 90%"),
            (9, "prefetch PERCENTAGE must be a whole number and `%`"),
            (10, "prefetch AMOUNT must be a whole number, not `x`"),
            (
                11,
                "prefetch: expected `prefetch AMOUNT [[DURATION] [PERCENTAGE%]]`",
            ),
            (
                12,
                "serve_stale REFRESH_MODE must be `immediate` or `verify`",
            ),
            (
                13,
                "serve_stale DURATION: `-1h`: a duration cannot be negative",
            ),
            (14, "servfail DURATION may not be longer than 5m"),
            (15, "servfail: expected `servfail DURATION`"),
            (16, "keepttl: expected `keepttl`, got 1 argument(s)"),
            (17, "success takes no `{ }` block"),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// `forward`

#[test]
fn several_forward_lines_in_a_block_keep_their_file_order_and_their_own_settings() {
    let c = ok(&block(
        "    forward example.com 10.0.0.53 {
        force_tcp
        except internal.example.com
        next NXDOMAIN
    }
    forward . 10.0.0.2 10.0.0.4 {
        max_fails 7
    }
    forward example.com 10.0.0.54",
    ));
    let lines = &c.servers[0].forwards;
    let froms: Vec<&str> = lines.iter().map(|f| f.from.as_str()).collect();
    // Overlapping FROMs are kept, in file order: the first that takes a name answers it.
    assert_eq!(froms, ["example.com.", ".", "example.com."]);
    assert_eq!(lines[0].upstream.addrs, [addr("10.0.0.53:53")]);
    assert_eq!(lines[0].upstream.transport, Transport::Tcp);
    assert_eq!(lines[0].except, ["internal.example.com."]);
    assert_eq!(lines[0].next, [u16::from(nodedns_wire::rcode::NXDOMAIN)]);
    assert_eq!(
        lines[1].upstream.addrs,
        [addr("10.0.0.2:53"), addr("10.0.0.4:53")]
    );
    assert_eq!(lines[1].upstream.transport, Transport::PreferUdp);
    assert_eq!(lines[1].upstream.max_fails, 7);
    assert!(lines[1].next.is_empty() && lines[1].except.is_empty());
    assert_eq!(
        lines[2].upstream.max_fails, 2,
        "CoreDNS's default, not line 2's"
    );
    // Each line is checked for loops, whichever it is.
    let errs = errs(&block(&format!(
        "    forward example.com 10.0.0.53\n    forward . {LOCAL}:53"
    )));
    assert!(errs.len() == 1 && errs[0].contains("loops"), "{errs:#?}");
}

#[test]
fn forward_next_reads_rcodes_as_coredns_does_and_names_a_bad_one() {
    let f = forward_of(
        "    forward . 10.0.0.1 {
        next NXDOMAIN refused NotImpl nxdomain SERVFAIL
    }
    forward . 10.0.0.2",
    );
    assert_eq!(f.next, [3, 5, 4, 2]);
    let errs = errs(&block(
        "    forward . 10.0.0.1 {
        next NXDOMIAN 3
        next
    }
    forward . 10.0.0.2",
    ));
    assert_errs(
        &errs,
        &[
            (
                4,
                "forward next: `NXDOMIAN` is not an rcode (NOERROR, FORMERR, SERVFAIL, NXDOMAIN",
            ),
            (4, "forward next: `3` is not an rcode"),
            (5, "next: expected `next RCODE...`, got 0 argument(s)"),
        ],
    );
}

#[test]
fn forward_next_on_the_last_line_of_a_block_is_a_warning_it_changes_nothing() {
    let c = ok(&block(
        "    forward . 10.0.0.1 {
        next NXDOMAIN
    }",
    ));
    assert_eq!(c.servers[0].forwards[0].next, [3]);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.starts_with("Corefile:3: forward next: no `forward` line follows")),
        "{:#?}",
        c.warnings
    );
    let c = ok(&block(
        "    forward . 10.0.0.1 {
        next NXDOMAIN
    }
    forward . 10.0.0.2",
    ));
    assert!(
        !c.warnings.iter().any(|w| w.contains("forward next")),
        "{:#?}",
        c.warnings
    );
}

#[test]
fn forward_defaults_to_udp_and_takes_every_implemented_option() {
    let f = forward_of("    forward . 10.0.0.1");
    assert_eq!(f.upstream.transport, Transport::PreferUdp);
    assert_eq!(f.upstream.selection, Selection::Random);
    assert_eq!(f.upstream.addrs, [addr("10.0.0.1:53")]);
    let f = forward_of(
        "    forward example.com dns://10.0.0.1:5353 fd00::1 [fd00::2]:54 {
        force_tcp
        max_concurrent 100
        expire 3s
        health_check 1s
        max_fails 5
        policy round_robin
        except Internal.Example.com b.example.com
    }",
    );
    assert_eq!(f.from, "example.com.");
    assert_eq!(
        f.upstream.addrs,
        [
            addr("10.0.0.1:5353"),
            addr("[fd00::1]:53"),
            addr("[fd00::2]:54")
        ]
    );
    assert_eq!(f.upstream.transport, Transport::Tcp);
    assert_eq!(f.upstream.max_concurrent, 100);
    assert_eq!(f.upstream.expire, Duration::from_secs(3));
    assert_eq!(f.upstream.health_check, Duration::from_secs(1));
    assert_eq!(f.upstream.max_fails, 5);
    assert_eq!(f.upstream.selection, Selection::RoundRobin);
    assert_eq!(f.except, ["internal.example.com.", "b.example.com."]);
    let f = forward_of(
        "    forward . 10.0.0.1 {\n        prefer_udp\n        policy sequential\n        max_concurrent 0\n        health_check 0s\n    }",
    );
    assert_eq!(f.upstream.transport, Transport::PreferUdp);
    assert_eq!(f.upstream.selection, Selection::Sequential);
    assert_eq!(
        f.upstream.max_concurrent,
        usize::MAX,
        "0: no limit, as CoreDNS"
    );
    assert_eq!(
        f.upstream.max_fails, 0,
        "health_check 0: never marked down, as CoreDNS"
    );
    assert_eq!(
        forward_of("    forward . 1.1.1.1 {\n        policy random\n    }")
            .upstream
            .selection,
        Selection::Random
    );
}

#[test]
fn forward_reads_the_node_resolv_conf_path() {
    let f = forward_of("    forward . /etc/resolv.conf 10.0.0.9");
    assert_eq!(f.upstream.addrs, [addr("10.0.0.2:53"), addr("10.0.0.9:53")]);
}

/// node-cache's own rendering of `__PILLAR__UPSTREAM__SERVERS__`, beside a `--resolv-conf`
/// that names another file.
const RUN_RESOLV: &str = "/run/nodedns/resolv.conf";

fn with_forward_files(mut i: Inputs, files: &[(&str, Option<&str>)]) -> Inputs {
    i.forward_files = files
        .iter()
        .map(|(path, text)| (PathBuf::from(path), text.map(str::to_owned)))
        .collect();
    i
}

#[test]
fn forward_reads_the_file_the_corefile_names_whatever_resolv_conf_says() {
    // CoreDNS reads any TO that is not an address as a resolv.conf: the file named, not
    // nodedns's --resolv-conf.
    let args = cli(&["-localip", LOCAL, "--resolv-conf", RUN_RESOLV]);
    let text = format!(
        "a.example {{\n    bind {LOCAL}\n    forward . /etc/resolv.conf\n}}\n\
         b.example {{\n    bind {LOCAL}\n    forward . __PILLAR__UPSTREAM__SERVERS__ 10.0.0.9\n}}\n\
         c.example {{\n    bind {LOCAL}\n    forward . resolv.local\n}}\n"
    );
    let i = with_forward_files(
        inputs(&text),
        &[
            (
                "/etc/resolv.conf",
                Some("nameserver 10.0.0.7\nnameserver 10.0.0.8\n"),
            ),
            ("resolv.local", Some("nameserver 10.0.0.6\n")),
        ],
    );
    let c = build(&args, &i).unwrap_or_else(|e| panic!("{e}"));
    let addrs = |n: usize| c.servers[n].forwards[0].upstream.addrs.clone();
    assert_eq!(addrs(0), [addr("10.0.0.7:53"), addr("10.0.0.8:53")]);
    // The pillar is --resolv-conf, as before (its contents: `inputs`'s resolv_conf).
    assert_eq!(addrs(1), [addr("10.0.0.2:53"), addr("10.0.0.9:53")]);
    // A relative name is a file too, when there is one.
    assert_eq!(addrs(2), [addr("10.0.0.6:53")]);
}

#[test]
fn a_forward_file_that_is_missing_or_names_a_stub_is_an_error_at_its_line() {
    let args = cli(&["-localip", LOCAL, "--resolv-conf", RUN_RESOLV]);
    let text = block("    forward . /etc/resolv.conf");
    let errs = errs_with(
        &args,
        &with_forward_files(inputs(&text), &[("/etc/resolv.conf", None)]),
    );
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert_eq!(
        errs[0],
        "Corefile:3: forward: cannot use the nameservers of /etc/resolv.conf, see below"
    );
    assert!(
        errs[1].starts_with("/etc/resolv.conf: does not exist"),
        "{errs:#?}"
    );
    // Not read at all (a caller of `build` that did not look): the same as missing.
    assert_eq!(errs_with(&args, &inputs(&text)), errs);
    let stub = Some("nameserver 127.0.0.53\n");
    let errs = errs_with(
        &args,
        &with_forward_files(inputs(&text), &[("/etc/resolv.conf", stub)]),
    );
    assert!(
        errs[1].starts_with("/etc/resolv.conf: names 127.0.0.53"),
        "{errs:#?}"
    );
    // A bare word with no such file is a bad address.
    let errs = errs_with(&args, &inputs(&block("    forward . resolv.local")));
    assert_errs(
        &errs,
        &[(
            3,
            "`resolv.local` is not an IP address with an optional port, nor a file",
        )],
    );
}

/// The messages of a load that must fail.
fn errs_with(args: &ConfigArgs, inputs: &Inputs) -> Vec<String> {
    build(args, inputs).map_err(messages).unwrap_err()
}

#[test]
fn forward_paths_are_the_words_that_are_not_addresses() {
    let args = cli(&["--resolv-conf", RUN_RESOLV]);
    let text = format!(
        "a.example {{\n    forward . 10.0.0.1 dns://10.0.0.2:53 [fd00::1]:53 /etc/resolv.conf\n}}\n\
         b.example {{\n    forward . __PILLAR__UPSTREAM__SERVERS__ tls://10.0.0.3 {RUN_RESOLV}\n}}\n\
         c.example {{\n    forward . dns://resolv.local /etc/resolv.conf\n    log\n}}\n"
    );
    assert_eq!(
        forward_paths(
            &args,
            Path::new("Corefile"),
            &text,
            &HashMap::new(),
            &Imports::default()
        ),
        [
            PathBuf::from("/etc/resolv.conf"),
            PathBuf::from("resolv.local")
        ]
    );
    // A file that does not parse names nothing (its load says why).
    assert!(
        forward_paths(
            &args,
            Path::new("Corefile"),
            "a {\n forward . /x\n",
            &HashMap::new(),
            &Imports::default()
        )
        .is_empty()
    );
}

#[test]
fn load_reads_the_forward_file_from_disk() {
    let tmp = TempDir::new("load-forward");
    let conf = tmp.path().join("Corefile");
    let named = tmp.path().join("named-resolv.conf");
    let flag = tmp.path().join("flag-resolv.conf");
    std::fs::write(&named, "nameserver 10.0.0.7\n").unwrap();
    std::fs::write(&flag, "nameserver 10.0.0.2\n").unwrap();
    std::fs::write(
        &conf,
        format!(
            ".:53 {{\n    bind {LOCAL}\n    forward . {}\n}}\n",
            named.display()
        ),
    )
    .unwrap();
    let args = cli(&[
        "-localip",
        LOCAL,
        "-conf",
        conf.to_str().unwrap(),
        "--resolv-conf",
        flag.to_str().unwrap(),
    ]);
    let c = load(&args).unwrap();
    assert_eq!(
        c.servers[0].forwards[0].upstream.addrs,
        [addr("10.0.0.7:53")]
    );
    std::fs::remove_file(&named).unwrap();
    let err = load(&args).unwrap_err().to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn forward_errors_are_all_reported_with_their_lines() {
    let many = (1..=16)
        .map(|i| format!("10.0.0.{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let errs = errs(&format!(
        ".:53 {{
    bind {LOCAL}
    forward .
}}
a.example {{
    bind {LOCAL}
    forward . https://1.1.1.1 dns.google {{
        force_tcp
        prefer_udp
        policy fastest
        tls /nonexistent/ca.pem
        health_check 1s no_rec fast
        max_fails -1
        max_concurrent lots
        expire -1s
        next NXDOMAIN nxdomain notimpl NOSUCH
        except bad..name
    }}
}}
b.example {{
    bind {LOCAL}
    forward . {many}
}}
"
    ));
    assert_errs(
        &errs,
        &[
            (3, "forward: expected `forward FROM TO...`"),
            (7, "https:// upstreams are not implemented"),
            (
                7,
                "`dns.google` is not an IP address with an optional port, nor a file",
            ),
            (9, "prefer_udp contradicts force_tcp at line 8"),
            (
                10,
                "forward policy must be random, round_robin or sequential, not `fastest`",
            ),
            (12, "forward health_check: unknown option `fast`"),
            (13, "forward max_fails must be a whole number, not `-1`"),
            (
                14,
                "forward max_concurrent must be a whole number, not `lots`",
            ),
            (15, "forward expire: `-1s`: a duration cannot be negative"),
            (16, "forward next: `NOSUCH` is not an rcode"),
            (17, "forward except: `bad..name` has an empty label"),
            (
                11,
                "forward tls: cannot read the CA file /nonexistent/ca.pem",
            ),
            (22, "more than 15 upstreams (16)"),
        ],
    );
}

/// A CA certificate and a client certificate and key it signed, written into `dir`: (CA,
/// client certificate, client key).
fn tls_files(dir: &TempDir) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let client = rcgen::CertificateParams::new(vec!["node.example".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    (
        write("ca.pem", ca.pem()),
        write("client.pem", client.pem()),
        write("client.key", key.serialize_pem()),
    )
}

#[test]
fn forward_tls_destinations_take_coredns_tls_options() {
    use nodedns_upstream::tls::{Files, Settings};
    let dir = TempDir::new("forward-tls");
    let (ca, cert, key) = tls_files(&dir);
    let (ca_s, cert_s, key_s) = (ca.display(), cert.display(), key.display());
    let tls = |addrs: &[&str], name: Option<&str>, ca: Option<&PathBuf>, client: bool| {
        let files = Files {
            ca: ca.cloned(),
            client: client.then(|| (cert.clone(), key.clone())),
        };
        let addrs = addrs.iter().map(|a| addr(a)).collect();
        Some(Settings::load(addrs, name, &files).unwrap())
    };

    // `tls://` alone: port 853, the system's CAs, the address as the name; a plain
    // destination beside it stays plain (CoreDNS allows both in one forward).
    let f = forward_of("    forward . tls://10.0.0.1 10.0.0.2 tls://[fd00::1]:8853");
    assert_eq!(
        f.upstream.addrs,
        [
            addr("10.0.0.1:853"),
            addr("10.0.0.2:53"),
            addr("[fd00::1]:8853")
        ]
    );
    assert_eq!(
        f.upstream.tls,
        tls(&["10.0.0.1:853", "[fd00::1]:8853"], None, None, false)
    );

    for (options, name, ca, client) in [
        (
            "tls_servername dns.example",
            Some("dns.example"),
            None,
            false,
        ),
        ("tls", None, None, false),
        (&format!("tls {ca_s}"), None, Some(&ca), false),
        (&format!("tls {cert_s} {key_s}"), None, None, true),
        (
            &format!("tls {cert_s} {key_s} {ca_s}\n        tls_servername dns.example"),
            Some("dns.example"),
            Some(&ca),
            true,
        ),
    ] {
        let f = forward_of(&format!(
            "    forward . tls://10.0.0.1 {{\n        {options}\n    }}"
        ));
        assert_eq!(
            f.upstream.tls,
            tls(&["10.0.0.1:853"], name, ca, client),
            "{options}"
        );
    }

    // The last `tls` line wins, as in CoreDNS.
    let f = forward_of(&format!(
        "    forward . tls://10.0.0.1 {{\n        tls /nonexistent/ca.pem\n        tls {ca_s}\n    }}"
    ));
    assert_eq!(
        f.upstream.tls,
        tls(&["10.0.0.1:853"], None, Some(&ca), false)
    );
}

#[test]
fn forward_tls_options_without_a_tls_destination_are_a_warning() {
    let c = ok(&block(
        "    forward . 10.0.0.1 {\n        tls_servername dns.example\n    }",
    ));
    let f = &c.servers[0].forwards[0];
    assert_eq!(f.upstream.tls, None);
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(
        c.warnings[0]
            .starts_with("Corefile:4: forward: `tls` and `tls_servername` apply to tls://"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn forward_tls_errors_are_all_reported_with_their_lines() {
    let dir = TempDir::new("forward-tls-errors");
    let (ca, _, key) = tls_files(&dir);
    let errs = errs(&format!(
        ".:53 {{
    bind {LOCAL}
    forward . tls://10.0.0.1 tls://10.0.0.2%dns.example tls://dns.example 10.0.0.1:853 {{
        tls a b c d
        tls_servername
    }}
}}
a.example {{
    bind {LOCAL}
    forward . tls://10.0.0.1 {{
        tls {ca} {key}
    }}
}}
b.example {{
    bind {LOCAL}
    forward . tls://10.0.0.1 {{
        tls_servername bad..name
        tls {key}
    }}
}}
",
        ca = ca.display(),
        key = key.display(),
    ));
    assert_errs(
        &errs,
        &[
            (
                3,
                "a server name per upstream (`tls://10.0.0.2%dns.example`) is not implemented",
            ),
            (
                3,
                "`dns.example` is not an IP address with an optional port",
            ),
            (
                4,
                "tls: expected `tls [CA] | tls CERT KEY [CA]`, got 4 argument(s)",
            ),
            (
                5,
                "tls_servername: expected `tls_servername NAME`, got 0 argument(s)",
            ),
            (3, "10.0.0.1:853 is listed both as tls:// and as plain DNS"),
            (
                11,
                "forward tls: the client certificate and key cannot be used",
            ),
            (
                17,
                "forward tls: tls_servername `bad..name` is neither a DNS name nor an IP address",
            ),
        ],
    );
    let errs = errs_of_key_as_ca(&key);
    assert!(errs[0].contains("holds no certificate"), "{errs:?}");
}

/// A CA file with no certificate in it (a key).
fn errs_of_key_as_ca(key: &Path) -> Vec<String> {
    errs(&block(&format!(
        "    forward . tls://10.0.0.1 {{\n        tls {}\n    }}",
        key.display()
    )))
}

#[test]
fn forward_timing_defaults_are_coredns_s_but_the_deadline() {
    let u = forward_of("    forward . 10.0.0.1").upstream;
    assert_eq!(
        u.read_timeout,
        Duration::from_secs(2),
        "CoreDNS's read_timeout"
    );
    assert_eq!(
        u.expire,
        Duration::from_secs(5),
        "under CoreDNS's 10 s idle close"
    );
    assert_eq!(u.health_check, Duration::from_millis(500));
    assert_eq!(u.max_fails, 2);
    assert!(!u.failfast_all_unhealthy);
    assert_eq!(
        u.timeout,
        Duration::from_millis(4500),
        "inside a stub resolver's 5 s"
    );
}

#[test]
fn forward_read_timeout_bounds_each_exchange() {
    let u = forward_of("    forward . 10.0.0.1 {\n        read_timeout 750ms\n    }").upstream;
    assert_eq!(u.read_timeout, Duration::from_millis(750));
    assert_eq!(
        u.timeout,
        Duration::from_millis(4500),
        "the deadline is apart"
    );
}

#[test]
fn forward_timeout_is_the_deadline_of_a_whole_query() {
    let u = forward_of("    forward . 10.0.0.1 {\n        timeout 3s\n    }").upstream;
    assert_eq!(u.timeout, Duration::from_secs(3));
    assert_eq!(u.read_timeout, Duration::from_secs(2));
}

#[test]
fn forward_expire_closes_idle_connections() {
    let u = forward_of("    forward . 10.0.0.1 {\n        expire 8s\n    }").upstream;
    assert_eq!(u.expire, Duration::from_secs(8));
}

#[test]
fn forward_max_fails_and_health_check_set_the_checker() {
    let u = forward_of(
        "    forward . 10.0.0.1 {\n        max_fails 4\n        health_check 250ms\n    }",
    )
    .upstream;
    assert_eq!(
        (u.max_fails, u.health_check),
        (4, Duration::from_millis(250))
    );
    let u = forward_of("    forward . 10.0.0.1 {\n        max_fails 0\n    }").upstream;
    assert_eq!(u.max_fails, 0, "never marked down (nor checked)");
}

#[test]
fn forward_health_check_asks_its_domain_with_or_without_recursion() {
    let u = forward_of("    forward . 10.0.0.1").upstream;
    assert_eq!(u.probe, nodedns_upstream::Probe::default());
    assert_eq!(
        (u.probe.name.as_slice(), u.probe.recursion_desired),
        (&[0u8][..], true)
    );
    let u = forward_of(
        "    forward . 10.0.0.1 {\n        health_check 5s no_rec domain Example.COM\n    }",
    )
    .upstream;
    assert_eq!(u.health_check, Duration::from_secs(5));
    assert_eq!(u.probe.name, q("example.com"));
    assert!(!u.probe.recursion_desired);
    let u =
        forward_of("    forward . 10.0.0.1 {\n        health_check 1s domain example.org.\n    }")
            .upstream;
    assert_eq!(u.probe.name, q("example.org"));
    assert!(u.probe.recursion_desired);
    let errs = errs(&block(
        "    forward . 10.0.0.1 {\n        health_check 1s domain\n        health_check 1s domain a..b\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (
                4,
                "forward health_check: expected `health_check DURATION [no_rec] [domain FQDN]`, `domain` without a name",
            ),
            (5, "forward health_check domain: `a..b` has an empty label"),
        ],
    );
}

#[test]
fn forward_failfast_all_unhealthy_upstreams_is_a_flag() {
    let u = forward_of(
        "    forward . 10.0.0.1 10.0.0.2 {\n        failfast_all_unhealthy_upstreams\n    }",
    )
    .upstream;
    assert!(u.failfast_all_unhealthy);
}

#[test]
fn forward_timing_options_need_positive_durations_and_their_arguments() {
    let errs = errs(&block(
        "    forward . 10.0.0.1 {
        read_timeout 0s
        timeout -1s
        expire 0
        read_timeout soon
        timeout
        failfast_all_unhealthy_upstreams yes
    }",
    ));
    assert_errs(
        &errs,
        &[
            (4, "forward read_timeout must be positive"),
            (5, "forward timeout: `-1s`: a duration cannot be negative"),
            (6, "forward expire must be positive"),
            (7, "forward read_timeout: `soon` is not a duration"),
            (8, "timeout: expected `timeout DURATION`, got 0 argument(s)"),
            (
                9,
                "failfast_all_unhealthy_upstreams: expected `failfast_all_unhealthy_upstreams`, got 1 argument(s)",
            ),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// `health`, `ready`, `prometheus`, `errors`, `log`, `reload`, `loop`

#[test]
fn health_ready_and_prometheus_take_addresses_with_coredns_defaults() {
    let c = ok(&block("    health\n    ready\n    prometheus"));
    assert_eq!(c.health, Some(addr("0.0.0.0:8080")));
    assert_eq!(c.ready, Some(addr("0.0.0.0:8181")));
    assert_eq!(c.metrics, Some(addr("127.0.0.1:9153")));
    let c = ok(&block(
        "    health 127.0.0.1:8081 {\n        lameduck 5s\n    }\n    ready [::1]:8182\n    prometheus :9253",
    ));
    assert_eq!(c.health, Some(addr("127.0.0.1:8081")));
    assert_eq!(c.lameduck, Some(Duration::from_secs(5)));
    assert_eq!(c.ready, Some(addr("[::1]:8182")));
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9253")));
}

#[test]
fn prometheus_in_several_blocks_serves_every_address_and_the_last_reload_wins() {
    let c = ok(&format!(
        "a.example {{\n  bind {LOCAL}\n  prometheus :9253\n  health :8080\n}}\nb.example {{\n  bind {LOCAL}\n  prometheus :9254\n  health :8080\n  reload 10s\n}}\nc.example {{\n  bind {LOCAL}\n  prometheus :9253\n  reload 20s\n}}\nd.example {{\n  bind {LOCAL}\n  prometheus :9254\n  reload 20s\n}}\n"
    ));
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9253")));
    assert_eq!(c.extra_metrics, [addr("0.0.0.0:9254")]);
    assert_eq!(c.reload, Some(Duration::from_secs(20)));
    let replaced: Vec<&String> = c.warnings.iter().filter(|w| w.contains("reload")).collect();
    assert_eq!(replaced.len(), 1, "{:#?}", c.warnings);
    assert!(
        replaced[0].starts_with("Corefile:15: reload: 20s replaces 10s given at line 10"),
        "{replaced:?}"
    );
}

#[test]
fn process_wide_directives_must_agree_across_blocks() {
    let errs = errs(&format!(
        "a.example {{\n  bind {LOCAL}\n  health :8080\n}}\nb.example {{\n  bind {LOCAL}\n  health :8081\n}}\n"
    ));
    assert_errs(
        &errs,
        &[(
            7,
            "health: 0.0.0.0:8081 differs from 0.0.0.0:8080 given at line 3",
        )],
    );
}

#[test]
fn health_ready_prometheus_errors() {
    let errs = errs(&block(
        "    health 169.254.20.10 {\n        lameduck\n        drain 5s\n    }\n    ready :x\n    prometheus a b\n    log {\n        class denial\n        format x\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (3, "health: `169.254.20.10` is not HOST:PORT"),
            (4, "health lameduck: expected `lameduck DURATION`"),
            (5, "unknown option `drain` of `health`"),
            (7, "ready: `:x` is not HOST:PORT"),
            (8, "prometheus: expected `prometheus [ADDRESS]`, got 2"),
            (11, "unknown option `format` of `log`"),
        ],
    );
}

#[test]
fn errors_and_log_switch_logging_on() {
    let c = ok(&block("    errors\n    log . {\n        class all\n    }"));
    assert!(c.servers[0].errors && !c.servers[0].log.is_empty());
    let c = ok(&block("    cache"));
    assert!(!c.servers[0].errors && c.servers[0].log.is_empty());
    let errs = errs(&block(
        "    errors a b\n    log example.com {\n        class nodata\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (3, "errors: expected `errors [stdout]`, got 2"),
            (5, "log class: `nodata` is not a class"),
        ],
    );
}

#[test]
fn log_lines_add_rules_in_file_order_with_their_formats_and_classes() {
    let c = ok(&block(
        "    log example.org {\n        class denial\n        class error\n    }\n    log . cluster.local \"{remote} {name} {rcode}\"\n    log . combined {\n        class all\n    }",
    ));
    let rules = &c.servers[0].log;
    let scopes: Vec<&[u8]> = rules.iter().map(|r| r.scope.as_slice()).collect();
    assert_eq!(
        scopes,
        [
            &q("example.org")[..],
            &[0],
            &q("cluster.local"),
            &[0],
            &q("combined")
        ]
    );
    let denial_error = LogClasses {
        success: false,
        denial: true,
        error: true,
    };
    assert_eq!(rules[0].classes, denial_error);
    assert_eq!(rules[0].format, None);
    assert!(rules[1..].iter().all(|r| r.classes.all()));
    assert_eq!(
        rules[1].format.as_ref().map(|f| f.0.len()),
        Some(5),
        "{:?}",
        rules[1].format
    );
    assert_eq!(rules[1].format, rules[2].format);
    assert!(rules[3].format.is_none() && rules[4].format.is_none());
    // A single argument with a brace is a name, as CoreDNS reads it; nodedns warns.
    let c = ok(&block("    log {common}"));
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("`{common}` is taken as a name")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn reload_sets_the_polling_interval_and_checks_its_jitter() {
    assert_eq!(
        ok(&block("    reload")).reload,
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        ok(&block("    reload 10s 5s")).reload,
        Some(Duration::from_secs(10))
    );
    // A JITTER above half the INTERVAL is lowered, as CoreDNS does.
    assert_eq!(
        ok(&block("    reload 10s 6s")).reload,
        Some(Duration::from_secs(10))
    );
    assert_eq!(ok(&block("    errors")).reload, None);
    let errs = errs(&format!(
        "a.example {{\n  bind {LOCAL}\n  reload 1s\n}}\nb.example {{\n  bind {LOCAL}\n  reload 10s 6s\n}}\nc.example {{\n  bind {LOCAL}\n  reload 10s 500ms\n}}\nd.example {{\n  bind {LOCAL}\n  reload 1 2 3\n}}\n"
    ));
    assert_errs(
        &errs,
        &[
            (3, "reload INTERVAL must be at least 2s"),
            (11, "reload JITTER must be at least 1s"),
            (15, "reload: expected `reload [INTERVAL] [JITTER]`"),
        ],
    );
}

#[test]
fn loop_is_accepted_and_takes_nothing() {
    assert!(ok(&block("    loop")).servers[0].loop_check);
    assert_errs(&errs(&block("    loop 3")), &[(3, "loop: expected `loop`")]);
}

#[test]
fn unknown_and_repeated_directives_are_errors_with_their_lines() {
    let errs = errs(&block(
        "    file {\n        db.example\n    }\n    import-common\n    cache\n    sign db.example\n    cache 30",
    ));
    assert_errs(
        &errs,
        &[
            (3, "unknown directive `file`: nodedns does not implement it"),
            (6, "unknown directive `import-common`"),
            (8, "unknown directive `sign`"),
            (9, "`cache` is already given at line 7"),
        ],
    );
}

#[test]
fn rewrite_lines_are_accepted_and_form_one_rule_list() {
    let config = ok(&block(
        "    rewrite name a.example b.example\n    rewrite continue {\n        name exact c.example d.example\n        answer auto\n    }",
    ));
    let rewrite = config.servers[0].chain.rewrite.as_ref().expect("rules");
    assert_eq!(
        rewrite
            .text
            .lines()
            .filter(|l| l.starts_with("rewrite"))
            .count(),
        2
    );
    assert_errs(&errs(&block("    rewrite name")), &[(3, "rewrite:")]);
}

#[test]
fn environment_variables_are_substituted_from_the_input_map() {
    let mut i = inputs(&block(
        "    forward . {$UPSTREAM} {\n        max_fails {$FAILS}\n    }",
    ));
    i.env
        .insert("UPSTREAM".to_owned(), "10.1.2.3:5353".to_owned());
    i.env.insert("FAILS".to_owned(), "7".to_owned());
    let f = build(&stock_args(), &i).unwrap().servers[0].forwards[0].clone();
    assert_eq!(f.upstream.addrs, [addr("10.1.2.3:5353")]);
    assert_eq!(f.upstream.max_fails, 7);
    // Unset: replaced by nothing, as CoreDNS does, and said in a warning.
    let errs = errs(&block("    forward . {$NOT_SET}"));
    assert_errs(&errs, &[(3, "forward: `` is not an IP address")]);
    let c = ok(&block(
        "    forward . 10.0.0.2\n    prometheus {$NOT_SET}:9253",
    ));
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9253")));
    assert!(
        c.warnings
            .iter()
            .any(|w| w.starts_with("Corefile:4: environment variable NOT_SET")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn keys_on_different_ports_are_served_on_each_port() {
    let c = ok(&format!(
        "example.com example.io:1053 {{\n  bind {LOCAL}\n  forward . 10.0.0.53\n}}\n"
    ));
    assert_eq!(c.servers.len(), 2);
    assert_eq!(c.servers[0].zones, ["example.com."]);
    assert_eq!(c.servers[0].listen, [addr("169.254.20.10:53")]);
    assert_eq!(c.servers[1].zones, ["example.io."]);
    assert_eq!(c.servers[1].listen, [addr("169.254.20.10:1053")]);
}

#[test]
fn a_key_glued_to_its_brace_is_a_zone_of_its_own_as_in_coredns() {
    let c = ok(&format!(
        "example.com example.io:1053{{\n  bind {LOCAL}\n  forward . 10.0.0.53\n}}\n.:53 {{\n  bind {LOCAL}\n  forward . 10.0.0.2\n}}\n"
    ));
    assert_eq!(c.servers[0].zones, ["example.com.", "example.io:1053{."]);
    assert_eq!(c.servers[0].listen, [addr("169.254.20.10:53")]);
    assert!(
        c.warnings.iter().any(|w| w.contains("is one key")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn an_imported_snippet_and_file_load_and_their_problems_name_their_files() {
    let mut i = inputs(
        "(common) {\n  errors\n  cache 30\n}\n. {\n  import common\n  import custom/*.server\n  forward . 10.0.0.2\n}\nimport extra.server\n",
    );
    i.imports.files.insert(
        PathBuf::from("/etc/extra.server"),
        Found::Text(
            "example.org {\n  errors\n  cache 30\n  cache 5\n  forward . 10.0.0.53\n}\n".to_owned(),
        ),
    );
    let errs = build(&stock_args(), &i).map_err(messages).unwrap_err();
    assert_eq!(
        errs,
        [
            "/etc/extra.server:4: `cache` is already given at /etc/extra.server:3; it may appear once per block"
        ]
    );
    i.imports.files.insert(
        PathBuf::from("/etc/extra.server"),
        Found::Text("example.org {\n  errors\n  cache 30\n  forward . 10.0.0.53\n}\n".to_owned()),
    );
    let c = build(&stock_args(), &i).unwrap();
    assert_eq!(c.servers.len(), 2);
    assert!(c.servers[0].errors);
    assert_eq!(c.servers[0].cache.as_ref().unwrap().success.max, 30);
    assert_eq!(c.servers[1].zones, ["example.org."]);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.starts_with("Corefile:7: import `custom/*.server`: no file matches")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn the_same_zone_twice_on_one_address_is_an_error() {
    let errs = errs(&format!(
        ".:53 {{\n  bind {LOCAL}\n}}\n. {{\n}}\n.:1053 {{\n}}\n"
    ));
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with(
            "zone `.` is served twice on 169.254.20.10:53: by Corefile:1 and by Corefile:4"
        ),
        "{}",
        errs[0]
    );
}

#[test]
fn an_empty_corefile_is_an_error() {
    assert_eq!(errs("# nothing\n"), ["Corefile: has no server block"]);
}

#[test]
fn health_port_and_metrics_flags_beside_a_corefile() {
    let mut args = stock_args();
    args.health_port = Some(8081);
    args.metrics_listen_address = Some(addr("0.0.0.0:9354"));
    let c = build(
        &args,
        &inputs(&block("    health :8080\n    prometheus :9253")),
    )
    .unwrap();
    // Both served, as node-cache serves its flag's address beside the `prometheus` port.
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9253")));
    assert_eq!(c.node_cache_metrics, Some(addr("0.0.0.0:9354")));
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(
        c.warnings[0].contains("-health-port is 8081"),
        "{:?}",
        c.warnings
    );
    // Without a `prometheus` directive the flag is the metrics address; --health overrides.
    args.health = Some(addr("127.0.0.1:9999"));
    let c = build(&args, &inputs(&block("    health :8080"))).unwrap();
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9354")));
    assert_eq!(c.node_cache_metrics, Some(addr("0.0.0.0:9354")));
    assert_eq!(c.health, Some(addr("127.0.0.1:9999")));
}

#[test]
fn node_caches_metrics_address_defaults_to_9353_with_a_corefile_only() {
    let c = ok(&block("    prometheus :9253"));
    assert_eq!(c.node_cache_metrics, Some(addr("0.0.0.0:9353")));
    let cli_mode = build(&cli(&["--upstream", "10.0.0.1"]), &Inputs::default()).unwrap();
    assert_eq!(cli_mode.node_cache_metrics, None);
}

#[test]
fn the_rules_health_port_is_node_caches_health_port_not_the_corefiles() {
    // kubespray's two DaemonSets: each Corefile's `health` on its own port, no -health-port.
    // node-cache's rules then cover 8080 in both, so the two write the same rules.
    let first = ok(&block("    health 169.254.20.10:9254"));
    let second = ok(&block("    health 169.254.20.10:9256"));
    assert_eq!(first.health, Some(addr("169.254.20.10:9254")));
    assert_eq!(
        (first.host_health_port, second.host_health_port),
        (Some(8080), Some(8080))
    );
    // No `health` at all: node-cache's rules cover 8080 all the same.
    assert_eq!(ok(&block("    cache 30")).host_health_port, Some(8080));
    let mut args = stock_args();
    args.health_port = Some(9254);
    let c = build(&args, &inputs(&block("    health :9254"))).unwrap();
    assert_eq!(c.host_health_port, Some(9254));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // Without a Corefile: the port /health is served on, or none.
    let cli_health = cli(&["--health", "127.0.0.1:9999", "--upstream", "10.0.0.9"]);
    let c = build(&cli_health, &cli_inputs("")).unwrap();
    assert_eq!(c.host_health_port, Some(9999));
    let c = build(&cli(&["--upstream", "10.0.0.9"]), &cli_inputs("")).unwrap();
    assert_eq!(c.host_health_port, None);
}

// ---------------------------------------------------------------------------------------------
// CLI mode

fn cli_inputs(resolv: &str) -> Inputs {
    Inputs {
        resolv_conf: Some(resolv.to_owned()),
        ..Inputs::default()
    }
}

#[test]
fn cli_mode_defaults_forward_to_the_node_resolvers_over_udp() {
    let c = build(
        &cli(&[]),
        &cli_inputs("nameserver 10.0.0.2\nnameserver 10.0.0.3\n"),
    )
    .unwrap();
    assert_eq!(c.servers.len(), 1);
    let s = &c.servers[0];
    assert_eq!(s.zones, ["."]);
    assert_eq!(s.listen, [addr("127.0.0.1:5353")]);
    let f = &s.forwards[0];
    assert_eq!(f.upstream.addrs, [addr("10.0.0.2:53"), addr("10.0.0.3:53")]);
    assert_eq!(f.upstream.transport, Transport::PreferUdp);
    let p = s.cache.as_ref().unwrap();
    assert_eq!(p.capacity_bytes, 16 << 20);
    assert_eq!(
        (p.success, p.denial),
        (Clamp { min: 5, max: 3600 }, Clamp { min: 5, max: 1800 })
    );
    assert_eq!(
        (p.stale, p.prefetch),
        (Some(DEFAULT_STALE), Some(DEFAULT_PREFETCH))
    );
    assert!(s.errors);
    assert_eq!(
        (c.health, c.metrics, c.ready, c.reload),
        (None, None, None, None)
    );
}

#[test]
fn cli_mode_explicit_upstreams_go_over_tcp_and_local_ips_become_listeners() {
    let args = cli(&[
        "-localip",
        "169.254.20.10,fd00::10",
        "--upstream",
        "10.96.0.11",
        "--cache-size",
        "1Mi",
        "-health-port",
        "8080",
    ]);
    let c = build(&args, &cli_inputs("")).unwrap();
    let s = &c.servers[0];
    assert_eq!(s.listen, [addr("169.254.20.10:53"), addr("[fd00::10]:53")]);
    let f = &s.forwards[0];
    assert_eq!(
        (f.upstream.addrs.as_slice(), f.upstream.transport),
        (&[addr("10.96.0.11:53")][..], Transport::Tcp)
    );
    assert_eq!(s.cache.as_ref().unwrap().capacity_bytes, 1 << 20);
    assert_eq!(c.health, Some(addr("169.254.20.10:8080")));
    let c = build(
        &cli(&["--listen", "127.0.0.1:5300", "--upstream", "127.0.0.1:5301"]),
        &cli_inputs(""),
    )
    .unwrap();
    assert_eq!(c.servers[0].listen, [addr("127.0.0.1:5300")]);
    assert_eq!(c.local_ips, Vec::<IpAddr>::new());
}

#[test]
fn cli_mode_upstream_pool_cap_is_a_flag() {
    let default = build(&cli(&["--upstream", "127.0.0.1:5301"]), &cli_inputs("")).unwrap();
    let forward = |c: &Config| c.servers[0].forwards[0].upstream.max_connections;
    assert_eq!(forward(&default), 64);
    let args = cli(&[
        "--upstream",
        "127.0.0.1:5301",
        "--upstream-max-connections",
        "8",
    ]);
    assert_eq!(forward(&build(&args, &cli_inputs("")).unwrap()), 8);
}

#[test]
fn cli_mode_problems_are_all_reported() {
    let args = cli(&["--cache-size", "0", "-setupebtables"]);
    let errs = build(&args, &cli_inputs("search x\n"))
        .map_err(messages)
        .unwrap_err();
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert!(errs[0].starts_with("-setupebtables"), "{errs:#?}");
    assert!(
        errs[1].starts_with("/etc/resolv.conf: lists no nameserver"),
        "{errs:#?}"
    );
    assert!(
        errs[2].starts_with("--cache-size: invalid cache policy"),
        "{errs:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Loop refusal

#[test]
fn forwarding_to_an_own_listen_address_is_refused() {
    let errs = build(
        &cli(&["--listen", "127.0.0.1:5353", "--upstream", "127.0.0.1:5353"]),
        &cli_inputs(""),
    )
    .map_err(messages)
    .unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with("the command line: forwarding to 127.0.0.1:5353 loops"),
        "{}",
        errs[0]
    );
    assert!(errs[0].contains("kube-dns-upstream"), "{}", errs[0]);
    // Another port on loopback is another server.
    assert!(
        build(
            &cli(&["--listen", "127.0.0.1:5353", "--upstream", "127.0.0.1:5300"]),
            &cli_inputs("")
        )
        .is_ok()
    );
    // A wildcard listener receives loopback traffic on its port.
    let errs = self::errs(".:1053 {\n  forward . 127.0.0.1:1053\n}\n");
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].contains("one of nodedns's own listen addresses"),
        "{}",
        errs[0]
    );
}

#[test]
fn forwarding_to_the_intercepted_kube_dns_service_is_refused() {
    // The classic mistake: -upstreamsvc kube-dns, whose ClusterIP nodedns itself holds.
    let mut args = stock_args();
    args.upstreamsvc = "kube-dns".to_owned();
    let mut i = inputs(&stock_corefile_after_install());
    i.env
        .insert("KUBE_DNS_SERVICE_HOST".to_owned(), KUBE_DNS.to_owned());
    let errs = build(&args, &i).map_err(messages).unwrap_err();
    assert_eq!(errs.len(), 3, "one per block forwarding to it: {errs:#?}");
    assert!(errs[0].starts_with("Corefile:1: forwarding to 10.96.0.10:53 loops: it is one of nodedns's own listen addresses"), "{}", errs[0]);
    // A local IP that no block binds is refused too: the link holds it.
    let errs = build(
        &cli(&[
            "-localip",
            "169.254.20.10",
            "--listen",
            "127.0.0.1:53",
            "--upstream",
            "169.254.20.10",
        ]),
        &cli_inputs(""),
    )
    .map_err(messages)
    .unwrap_err();
    assert!(errs[0].contains("one of nodedns's local IPs"), "{errs:#?}");
}

#[test]
fn a_missing_resolv_conf_is_an_error_only_where_upstreams_come_from_it() {
    let mut none = cli_inputs("");
    none.resolv_conf = None;
    // Upstreams named on the command line: the file is not needed.
    let config = build(&cli(&["--upstream", "10.0.0.9"]), &none).expect("no resolv.conf needed");
    assert_eq!(
        config.servers[0].forwards[0].upstream.addrs,
        vec!["10.0.0.9:53".parse().unwrap()]
    );
    // Taken from it: an error naming the file and what to do.
    let errs = build(&cli(&[]), &none).map_err(messages).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with("/etc/resolv.conf: does not exist") && errs[0].contains("--upstream"),
        "{}",
        errs[0]
    );
    // The stock Corefile's `.` block forwards to it (__PILLAR__UPSTREAM__SERVERS__).
    let mut i = inputs(&stock_corefile_after_install());
    i.resolv_conf = None;
    let errs = build(&stock_args(), &i).map_err(messages).unwrap_err();
    assert!(
        errs[0].starts_with("Corefile:44: forward: cannot use the nameservers of /etc/resolv.conf"),
        "{errs:#?}"
    );
    assert!(errs[1].contains("does not exist"), "{errs:#?}");
}

#[test]
fn a_resolv_conf_with_a_loopback_stub_is_refused_where_it_is_used() {
    let stub = "nameserver 127.0.0.53\n";
    let errs = build(&cli(&[]), &cli_inputs(stub))
        .map_err(messages)
        .unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].starts_with("/etc/resolv.conf: names 127.0.0.53"),
        "{}",
        errs[0]
    );
    assert!(
        errs[0].contains("/run/systemd/resolve/resolv.conf"),
        "{}",
        errs[0]
    );
    let mut i = inputs(&stock_corefile_after_install());
    i.resolv_conf = Some(stub.to_owned());
    let errs = build(&stock_args(), &i).map_err(messages).unwrap_err();
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[0].starts_with("Corefile:44: forward: cannot use the nameservers of /etc/resolv.conf"),
        "{errs:#?}"
    );
    assert!(
        errs[1].starts_with("/etc/resolv.conf: names 127.0.0.53"),
        "{errs:#?}"
    );
    // Not used: no problem.
    assert!(build(&cli(&["--upstream", "10.0.0.1"]), &cli_inputs(stub)).is_ok());
}

// ---------------------------------------------------------------------------------------------
// kube-dns ConfigMap

fn with_kubedns(mut i: Inputs, stub: Option<&str>, up: Option<&str>) -> Inputs {
    i.kubedns = Some(KubeDns {
        dir: PathBuf::from("/etc/kube-dns"),
        stub_domains: stub.map(str::to_owned),
        upstream_nameservers: up.map(str::to_owned),
    });
    i
}

#[test]
fn stub_domains_become_blocks_like_node_cache_appends() {
    let i = with_kubedns(
        inputs(&stock_corefile_after_install()),
        Some(r#"{"acme.local": ["1.2.3.4", "1.2.3.5:5353"]}"#),
        None,
    );
    let c = build(&stock_args(), &i).unwrap();
    assert_eq!(c.servers.len(), 5);
    let stub = &c.servers[4];
    assert_eq!(stub.zones, ["acme.local."]);
    assert_eq!(
        stub.listen,
        [addr("169.254.20.10:53"), addr("10.96.0.10:53")]
    );
    assert!(stub.errors);
    let f = &stub.forwards[0];
    assert_eq!(f.upstream.addrs, [addr("1.2.3.4:53"), addr("1.2.3.5:5353")]);
    assert_eq!(f.upstream.transport, Transport::PreferUdp);
    let p = stub.cache.as_ref().unwrap();
    assert_eq!(
        (p.success.max, p.denial.max),
        (30, 30),
        "node-cache's `cache 30`"
    );
    let noted: Vec<&Difference> = c
        .differences
        .iter()
        .filter(|d| d.at == "/etc/kube-dns/stubDomains (acme.local.)")
        .collect();
    assert_eq!(noted.len(), 1, "{:#?}", c.differences);
    assert!(
        noted[0].what.contains("prefetch and serve_stale on"),
        "{}",
        noted[0].what
    );
    let r = Router::new(&c.servers)
        .route(&q("db.acme.local."), addr("169.254.20.10:53"))
        .unwrap();
    assert_eq!((r.server, r.forward), (4, true));
}

/// The cascade prefetch's cluster domains are the Corefile's own zones: not `.`, not the
/// reverse zones, not the kube-dns stub domains.
#[test]
fn the_cluster_domain_is_the_corefiles_zone_and_no_stub_domain() {
    let i = with_kubedns(
        inputs(&stock_corefile_after_install()),
        Some(r#"{"acme.local": ["1.2.3.4"]}"#),
        None,
    );
    let c = build(&stock_args(), &i).unwrap();
    assert_eq!(c.cluster_domains, ["cluster.local."]);
    assert!(c.cascade_prefetch, "on by default");
    let mut args = stock_args();
    args.cascade_prefetch = false;
    assert!(!build(&args, &i).unwrap().cascade_prefetch);
    for off in ["--cascade-prefetch=false", "-cascade-prefetch=false"] {
        let c = build(&cli(&["--upstream", "10.0.0.1", off]), &cli_inputs("")).unwrap();
        assert!(!c.cascade_prefetch, "{off}");
        assert!(c.cluster_domains.is_empty(), "`.` alone names none");
    }
}

#[test]
fn upstream_nameservers_replace_the_root_upstreams_over_udp() {
    // The node's resolv.conf is not read at all then, so its stub does not matter.
    let mut i = inputs(&stock_corefile_after_install());
    i.resolv_conf = Some("nameserver 127.0.0.53\n".to_owned());
    let i = with_kubedns(i, None, Some(r#"["8.8.8.8", "8.8.4.4"]"#));
    let c = build(&stock_args(), &i).unwrap();
    let root = &c.servers[3].forwards[0];
    assert_eq!(
        root.upstream.addrs,
        [addr("8.8.8.8:53"), addr("8.8.4.4:53")]
    );
    assert_eq!(root.upstream.transport, Transport::PreferUdp);
    assert_eq!(
        c.servers[0].forwards[0].upstream.addrs,
        [addr("10.96.0.11:53")],
        "cluster block untouched"
    );
    // The same in CLI mode, and when `.` forwards over TCP (node-cache switches it to UDP).
    let c = build(
        &cli(&["--upstream", "10.0.0.1"]),
        &with_kubedns(cli_inputs(""), None, Some(r#"["9.9.9.9"]"#)),
    )
    .unwrap();
    let f = &c.servers[0].forwards[0];
    assert_eq!(
        (f.upstream.addrs.as_slice(), f.upstream.transport),
        (&[addr("9.9.9.9:53")][..], Transport::PreferUdp)
    );
    let tcp = block("    forward . __PILLAR__UPSTREAM__SERVERS__ {\n        force_tcp\n    }");
    let c = build(
        &stock_args(),
        &with_kubedns(inputs(&tcp), None, Some(r#"["9.9.9.9"]"#)),
    )
    .unwrap();
    assert_eq!(
        c.servers[0].forwards[0].upstream.transport,
        Transport::PreferUdp
    );
}

#[test]
fn upstream_nameservers_replace_only_the_pillar_line_of_a_next_chain() {
    let chain = block(
        "    forward . 10.0.0.1 {
        force_tcp
        next NXDOMAIN
    }
    forward . __PILLAR__UPSTREAM__SERVERS__",
    );
    let c = build(
        &stock_args(),
        &with_kubedns(inputs(&chain), None, Some(r#"["9.9.9.9"]"#)),
    )
    .unwrap();
    let lines = &c.servers[0].forwards;
    assert_eq!(
        (
            lines[0].upstream.addrs.as_slice(),
            lines[0].upstream.transport
        ),
        (&[addr("10.0.0.1:53")][..], Transport::Tcp)
    );
    assert_eq!(
        (
            lines[1].upstream.addrs.as_slice(),
            lines[1].upstream.transport
        ),
        (&[addr("9.9.9.9:53")][..], Transport::PreferUdp)
    );
}

#[test]
fn invalid_kube_dns_entries_are_all_reported() {
    let i = with_kubedns(
        inputs(&stock_corefile_after_install()),
        Some("{\"cluster.local\": [\"1.1.1.1\"],\n \"x..y\": [\"1.1.1.1\"]}"),
        Some(r#"["nope"]"#),
    );
    let errs = build(&stock_args(), &i).map_err(messages).unwrap_err();
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert!(
        errs[0].starts_with("/etc/kube-dns/stubDomains:2: stub domain `x..y`"),
        "{errs:#?}"
    );
    assert!(
        errs[1].starts_with("/etc/kube-dns/upstreamNameservers:1: upstream nameserver: `nope`"),
        "{errs:#?}"
    );
    assert!(
        errs[2].starts_with("zone `cluster.local.` is served twice on 169.254.20.10:53: by Corefile:1 and by /etc/kube-dns/stubDomains (cluster.local.)"),
        "{errs:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Errors and reload helpers

#[test]
fn config_errors_list_every_problem() {
    let err = build(&stock_args(), &inputs(&block("    cache 0\n    bogus"))).unwrap_err();
    let text = err.to_string();
    assert_eq!(
        text,
        "invalid configuration:\n  Corefile:3: cache TTL cannot be zero or negative: 0\n  \
         Corefile:4: unknown directive `bogus`: nodedns does not implement it (see \
         docs/configuration.md for the directives it does)"
    );
}

#[test]
fn restart_needed_names_what_a_reload_cannot_change() {
    let a = ok(&block("    cache 30\n    health :8080"));
    let b = ok(&block("    cache 60\n    health :8080"));
    assert!(a.restart_needed(&b).is_empty());
    let c = ok(".:53 {\n  bind 10.0.0.9\n  health :8081\n}\n");
    let changes = a.restart_needed(&c);
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert!(changes[0].starts_with("listen addresses"), "{changes:?}");
    assert!(changes[1].starts_with("health address"), "{changes:?}");
}

// ---------------------------------------------------------------------------------------------
// `load`: the files

#[test]
fn load_renders_the_template_into_conf_as_node_cache_does() {
    let tmp = TempDir::new("load");
    let base = tmp.path().join("Corefile.base");
    let conf = tmp.path().join("Corefile");
    let resolv = tmp.path().join("resolv.conf");
    let kube = tmp.path().join("kube-dns");
    std::fs::create_dir(&kube).unwrap();
    std::fs::write(kube.join("stubDomains"), r#"{"acme.local": ["1.2.3.4"]}"#).unwrap();
    std::fs::write(&resolv, "nameserver 10.0.0.2\n").unwrap();
    std::fs::write(&base, ".:53 {\n    bind __PILLAR__LOCAL__DNS__ __PILLAR__DNS__SERVER__\n    forward . __PILLAR__UPSTREAM__SERVERS__\n}\n").unwrap();
    let args = cli(&[
        "-localip",
        LOCAL,
        "-basecorefile",
        base.to_str().unwrap(),
        "-conf",
        conf.to_str().unwrap(),
        "-kubednscm",
        kube.to_str().unwrap(),
        "--resolv-conf",
        resolv.to_str().unwrap(),
    ]);
    let c = load(&args).unwrap();
    assert_eq!(c.servers.len(), 2);
    assert_eq!(
        c.servers[0].forwards[0].upstream.addrs,
        [addr("10.0.0.2:53")]
    );
    assert_eq!(c.servers[1].zones, ["acme.local."]);
    let written = std::fs::read_to_string(&conf).unwrap();
    assert_eq!(
        written,
        format!(
            ".:53 {{\n    bind {LOCAL} \n    forward . {}\n}}\n",
            resolv.display()
        )
    );
}

#[test]
fn load_reports_unreadable_files() {
    let tmp = TempDir::new("load-missing");
    let args = cli(&["-conf", tmp.path().join("nope").to_str().unwrap()]);
    match load(&args) {
        Err(ConfigError::Read { path, .. }) => assert_eq!(path, tmp.path().join("nope")),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed input

#[test]
fn malformed_corefiles_are_errors_never_panics() {
    let stock = stock_corefile_after_install();
    let mut cases: Vec<String> = stock
        .char_indices()
        .map(|(i, _)| stock[..i].to_owned())
        .collect();
    for (i, _) in stock.char_indices().step_by(7) {
        for c in [
            "{",
            "}",
            "\"",
            "#",
            ":",
            "/",
            "{$",
            "\n",
            "99999999999999999999",
            "%",
        ] {
            cases.push(format!("{}{c}{}", &stock[..i], &stock[i..]));
        }
    }
    cases.push(block("    cache {\n        success 18446744073709551615\n        denial 18446744073709551615\n    }"));
    cases.push(block(
        "    cache {\n        servfail 99999999999999999999h\n    }",
    ));
    for case in &cases {
        // Either outcome is fine; a panic fails the test.
        let _ = build(&stock_args(), &inputs(case));
    }
}

#[test]
fn the_cluster_domain_is_the_first_zone_that_is_neither_the_root_nor_reverse() {
    let config = load_str(
        "in-addr.arpa:53 ip6.arpa:53 {\n    forward . 10.0.0.2\n}\n.:53 {\n    forward . 10.0.0.2\n}\nCluster.Local:53 {\n    forward . 10.0.0.2\n}\n",
    )
    .unwrap();
    assert_eq!(config.cluster_domain(), Some("cluster.local."));
    let root = load_str(".:53 {\n    forward . 10.0.0.2\n}\n").unwrap();
    assert_eq!(root.cluster_domain(), None);
}

// ---------------------------------------------------------------------------------------------
// Accepted for compatibility: `debug`, `metadata`, `pprof`, `trace`, `errors`' options

#[test]
fn metadata_is_accepted_with_an_explanation_and_checked_as_coredns_checks_it() {
    let c = ok(&block(
        "    metadata cluster.local\n    log . \"{name} {/pod}\"",
    ));
    assert!(
        c.warnings.iter().any(|w| w
            .starts_with("Corefile:3: metadata: accepted; no plugin of nodedns provides metadata")),
        "{:?}",
        c.warnings
    );
    let errs = errs(&block("    metadata {\n        labels\n    }"));
    assert_errs(&errs, &[(4, "unknown option `labels` of `metadata`")]);
}

#[test]
fn debug_pprof_and_trace_are_accepted_with_an_explanation() {
    let c = ok(&block(
        "    debug\n    pprof 127.0.0.1:6053 {\n        block 1\n    }\n    trace zipkin localhost:9411 {\n        every 100\n        client_server\n    }",
    ));
    let explained = |start: &str| c.warnings.iter().any(|w| w.starts_with(start));
    assert!(explained("Corefile:3: debug: accepted"), "{:?}", c.warnings);
    assert!(
        explained("Corefile:4: pprof: accepted; nodedns serves nothing there"),
        "{:?}",
        c.warnings
    );
    assert!(explained("Corefile:7: trace: accepted"), "{:?}", c.warnings);
    let errs = errs(&block(
        "    debug on\n    pprof a b\n    trace jaeger x {\n        every\n        sample 1\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (3, "debug: takes no arguments"),
            (4, "pprof: expected `pprof [ADDRESS]`"),
            (
                5,
                "trace: ENDPOINT-TYPE must be zipkin or datadog, not `jaeger`",
            ),
            (6, "trace every: wrong arguments"),
            (7, "unknown option `sample` of `trace`"),
        ],
    );
}

#[test]
fn errors_consolidate_stacktrace_and_stdout_are_accepted_with_an_explanation() {
    let c = ok(&block(
        "    errors stdout {\n        consolidate 5m \".* i/o timeout$\"\n        consolidate 30s \"^Failed\" warning\n        stacktrace\n    }",
    ));
    assert!(c.servers[0].errors);
    let consolidate: Vec<&String> = c
        .warnings
        .iter()
        .filter(|w| w.contains("errors consolidate"))
        .collect();
    assert_eq!(consolidate.len(), 2, "{:?}", c.warnings);
    assert!(consolidate[0].starts_with("Corefile:4: errors consolidate 5m"));
    let errs = errs(&block(
        "    errors file.log {\n        consolidate 5m\n        consolidate x y\n        consolidate 1m y loud\n        verbose\n    }",
    ));
    assert_errs(
        &errs,
        &[
            (3, "errors: invalid log file `file.log`"),
            (
                4,
                "errors consolidate: expected `consolidate DURATION REGEXP [LEVEL]`",
            ),
            (5, "errors consolidate:"),
            (6, "LEVEL must be warning, error, info or debug, not `loud`"),
            (7, "unknown option `verbose` of `errors`"),
        ],
    );
}
