//! Loading as a whole: the stock node-local-dns Corefile, every directive and option and their
//! error paths (with line numbers), CLI mode, the kube-dns ConfigMap, loop refusal, `load`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser;
use nodedns_cache::{Clamp, Policy, Prefetch, Stale};
use nodedns_upstream::{Selection, Transport};

use super::directives::{BYTES_PER_ENTRY, DEFAULT_PREFETCH, DEFAULT_STALE};
use super::*;

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
    }
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
    ok(&block(body)).servers[0].forward.clone().unwrap()
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
        assert!(s.errors && s.loop_check && !s.log);
    }
    let cluster = &config.servers[0];
    assert_eq!(
        cluster.cache,
        Some(Policy {
            capacity_bytes: (9984 + 9984) * BYTES_PER_ENTRY,
            success: Clamp { min: 5, max: 30 },
            denial: Clamp { min: 5, max: 5 },
            servfail_ttl: 5,
            stale: Some(Stale {
                window: Duration::from_secs(3600),
                ttl: 30
            }),
            prefetch: Some(DEFAULT_PREFETCH),
        })
    );
    let f = cluster.forward.as_ref().unwrap();
    assert_eq!(f.from, ".");
    assert_eq!(f.upstream.addrs, [addr("10.96.0.11:53")]);
    assert_eq!(f.upstream.transport, Transport::Tcp);
    for reverse in &config.servers[1..3] {
        let c = reverse.cache.as_ref().unwrap();
        assert_eq!(
            (c.success, c.denial),
            (Clamp { min: 5, max: 30 }, Clamp { min: 5, max: 30 })
        );
        assert_eq!(
            reverse.forward.as_ref().unwrap().upstream.transport,
            Transport::Tcp
        );
    }
    let root = config.servers[3].forward.as_ref().unwrap();
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
        config.servers[0].forward.as_ref().unwrap().upstream.addrs,
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
        "tls://example.org {\n}\na.example:53 b.example:54 {\n}\nc.example:99999 {\n}\nd..example {\n}\ne.example e.example {\n}\n10.0.0.0/12 {\n}\n",
    );
    assert_errs(
        &errs,
        &[
            (1, "tls:// server blocks are not implemented"),
            (3, "on different ports"),
            (5, "port is not a number"),
            (7, "empty label"),
            (9, "listed twice"),
            (11, "label boundaries"),
        ],
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
    let c = ok(
        ".:53 {\n  bind 10.0.0.1 10.0.0.2\n  bind fd00::1 10.0.0.1\n  bind 10.0.0.3 {\n    except 10.0.0.2\n  }\n}\n",
    );
    assert_eq!(
        c.servers[0].listen,
        [
            addr("10.0.0.1:53"),
            addr("[fd00::1]:53"),
            addr("10.0.0.3:53")
        ]
    );
}

#[test]
fn bind_errors_name_their_lines() {
    let errs = errs(
        ".:53 {\n  bind\n  bind eth0 fe80::1%eth0\n  bind 10.0.0.1 {\n    only 10.0.0.1\n  }\n}\n",
    );
    assert_errs(
        &errs,
        &[
            (2, "expected `bind ADDRESS...`"),
            (3, "`eth0` is not an IP address"),
            (3, "`fe80::1%eth0` is not an IP address"),
            (5, "unknown option `only` of `bind`"),
        ],
    );
    let errs = self::errs(".:53 {\n  bind 10.0.0.1 {\n    except 10.0.0.1\n  }\n}\n");
    assert_errs(&errs, &[(1, "excepts every address")]);
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
fn cache_prefetch_sets_amount_and_percentage_or_turns_it_off() {
    let c = ok(&block("    cache {\n        prefetch 5 1m 20%\n    }"));
    assert_eq!(
        c.servers[0].cache.as_ref().unwrap().prefetch,
        Some(Prefetch {
            amount: 5,
            percentage: 20
        })
    );
    assert!(
        c.warnings[0].starts_with("Corefile:4: prefetch DURATION `1m` has no effect"),
        "{:?}",
        c.warnings
    );
    let p = cache_of("    cache {\n        prefetch 3\n    }");
    assert_eq!(
        p.prefetch,
        Some(Prefetch {
            amount: 3,
            percentage: 10
        })
    );
    assert_eq!(
        cache_of("    cache {\n        prefetch 0\n    }").prefetch,
        None
    );
}

#[test]
fn cache_serve_stale_sets_the_window_or_turns_it_off() {
    let p = cache_of("    cache {\n        serve_stale 2h verified\n    }");
    assert_eq!(
        p.stale,
        Some(Stale {
            window: Duration::from_secs(7200),
            ttl: 30
        })
    );
    assert_eq!(
        cache_of("    cache {\n        serve_stale\n    }").stale,
        Some(DEFAULT_STALE)
    );
    assert_eq!(
        cache_of("    cache {\n        serve_stale 0s\n    }").stale,
        None
    );
    let c = ok(&block(
        "    cache {\n        serve_stale 1h immediate\n    }",
    ));
    assert!(
        c.warnings[0].contains("serve_stale immediate"),
        "{:?}",
        c.warnings
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
fn cache_zones_must_cover_the_block() {
    assert!(cache_of("    cache 30 .").success.max == 30);
    let errs = errs(&block("    cache 30 example.com"));
    assert_errs(&errs, &[(3, "cache ZONES: applying it to only some names")]);
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
        keepttl
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
                "serve_stale REFRESH_MODE must be `immediate` or `verified`",
            ),
            (
                13,
                "serve_stale DURATION: `-1h`: a duration cannot be negative",
            ),
            (14, "servfail DURATION may not be longer than 5m"),
            (15, "servfail: expected `servfail DURATION`"),
            (16, "unknown option `keepttl` of `cache`"),
            (17, "success takes no `{ }` block"),
        ],
    );
}

// ---------------------------------------------------------------------------------------------
// `forward`

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
    forward . tls://1.1.1.1 dns.google /etc/other.conf {{
        force_tcp
        prefer_udp
        policy fastest
        tls cert.pem
        health_check 1s no_rec
        max_fails -1
        max_concurrent lots
        expire -1s
        next NXDOMAIN
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
            (7, "tls:// upstreams are not implemented"),
            (7, "`dns.google` is not an IP address"),
            (
                7,
                "nodedns reads nameservers only from the --resolv-conf file (/etc/resolv.conf), not from `/etc/other.conf`",
            ),
            (9, "prefer_udp contradicts force_tcp at line 8"),
            (
                10,
                "forward policy must be random, round_robin or sequential, not `fastest`",
            ),
            (11, "forward tls: TLS upstreams are not implemented"),
            (12, "the `no_rec` and `domain` options are not implemented"),
            (13, "forward max_fails must be a whole number, not `-1`"),
            (
                14,
                "forward max_concurrent must be a whole number, not `lots`",
            ),
            (15, "forward expire: `-1s`: a duration cannot be negative"),
            (16, "unknown option `next` of `forward`"),
            (17, "forward except: `bad..name` has an empty label"),
            (22, "more than 15 upstreams (16)"),
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
fn process_wide_directives_must_agree_across_blocks() {
    let errs = errs(&format!(
        "a.example {{\n  bind {LOCAL}\n  prometheus :9253\n  health :8080\n}}\nb.example {{\n  bind {LOCAL}\n  prometheus :9254\n  health :8080\n  reload 10s\n}}\nc.example {{\n  bind {LOCAL}\n  reload 20s\n}}\n"
    ));
    assert_errs(
        &errs,
        &[
            (
                8,
                "prometheus: 0.0.0.0:9254 differs from 0.0.0.0:9253 given at line 3",
            ),
            (14, "reload: 20s differs from 10s given at line 10"),
        ],
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
            (10, "log class: only `class all` is implemented"),
            (11, "unknown option `format` of `log`"),
        ],
    );
}

#[test]
fn errors_and_log_switch_logging_on() {
    let c = ok(&block("    errors\n    log . {\n        class all\n    }"));
    assert!(c.servers[0].errors && c.servers[0].log);
    let c = ok(&block("    cache"));
    assert!(!c.servers[0].errors && !c.servers[0].log);
    let errs = errs(&block(
        "    errors stdout {\n        consolidate 5m \".* timeout$\"\n    }\n    log example.com",
    ));
    assert_errs(
        &errs,
        &[
            (3, "errors: expected `errors`, got 1"),
            (4, "option `consolidate` of `errors` is not implemented"),
            (6, "log: applying it to only some names"),
        ],
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
        "    hosts {\n        10.0.0.1 a.example\n    }\n    import common\n    cache\n    rewrite name a b\n    cache 30",
    ));
    assert_errs(
        &errs,
        &[
            (
                3,
                "unknown directive `hosts`: nodedns does not implement it",
            ),
            (6, "unknown directive `import`"),
            (8, "unknown directive `rewrite`"),
            (9, "`cache` is already given at line 7"),
        ],
    );
}

#[test]
fn environment_variables_are_substituted_from_the_input_map() {
    let mut i = inputs(&block(
        "    forward . {$UPSTREAM} {\n        max_fails {$FAILS}\n    }",
    ));
    i.env
        .insert("UPSTREAM".to_owned(), "10.1.2.3:5353".to_owned());
    i.env.insert("FAILS".to_owned(), "7".to_owned());
    let f = build(&stock_args(), &i).unwrap().servers[0]
        .forward
        .clone()
        .unwrap();
    assert_eq!(f.upstream.addrs, [addr("10.1.2.3:5353")]);
    assert_eq!(f.upstream.max_fails, 7);
    let errs = errs(&block("    forward . {$NOT_SET}"));
    assert_errs(&errs, &[(3, "environment variable NOT_SET")]);
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
    args.metrics_listen_address = Some(addr("0.0.0.0:9353"));
    let c = build(
        &args,
        &inputs(&block("    health :8080\n    prometheus :9253")),
    )
    .unwrap();
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9253")));
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
    assert!(
        c.warnings[0].contains("-health-port is 8081"),
        "{:?}",
        c.warnings
    );
    assert!(
        c.warnings[1].contains("-metrics-listen-address 0.0.0.0:9353 is not opened"),
        "{:?}",
        c.warnings
    );
    // Without a `prometheus` directive the flag is the metrics address; --health overrides.
    args.health = Some(addr("127.0.0.1:9999"));
    let c = build(&args, &inputs(&block("    health :8080"))).unwrap();
    assert_eq!(c.metrics, Some(addr("0.0.0.0:9353")));
    assert_eq!(c.health, Some(addr("127.0.0.1:9999")));
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
    let f = s.forward.as_ref().unwrap();
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
    let f = s.forward.as_ref().unwrap();
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
    let forward = |c: &Config| {
        c.servers[0]
            .forward
            .as_ref()
            .unwrap()
            .upstream
            .max_connections
    };
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
        config.servers[0].forward.as_ref().unwrap().upstream.addrs,
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
    let f = stub.forward.as_ref().unwrap();
    assert_eq!(f.upstream.addrs, [addr("1.2.3.4:53"), addr("1.2.3.5:5353")]);
    assert_eq!(f.upstream.transport, Transport::PreferUdp);
    let p = stub.cache.as_ref().unwrap();
    assert_eq!(
        (p.success.max, p.denial.max),
        (30, 30),
        "node-cache's `cache 30`"
    );
    let r = Router::new(&c.servers)
        .route(&q("db.acme.local."), addr("169.254.20.10:53"))
        .unwrap();
    assert_eq!((r.server, r.forward), (4, true));
}

#[test]
fn upstream_nameservers_replace_the_root_upstreams_over_udp() {
    // The node's resolv.conf is not read at all then, so its stub does not matter.
    let mut i = inputs(&stock_corefile_after_install());
    i.resolv_conf = Some("nameserver 127.0.0.53\n".to_owned());
    let i = with_kubedns(i, None, Some(r#"["8.8.8.8", "8.8.4.4"]"#));
    let c = build(&stock_args(), &i).unwrap();
    let root = c.servers[3].forward.as_ref().unwrap();
    assert_eq!(
        root.upstream.addrs,
        [addr("8.8.8.8:53"), addr("8.8.4.4:53")]
    );
    assert_eq!(root.upstream.transport, Transport::PreferUdp);
    assert_eq!(
        c.servers[0].forward.as_ref().unwrap().upstream.addrs,
        [addr("10.96.0.11:53")],
        "cluster block untouched"
    );
    // The same in CLI mode, and when `.` forwards over TCP (node-cache switches it to UDP).
    let c = build(
        &cli(&["--upstream", "10.0.0.1"]),
        &with_kubedns(cli_inputs(""), None, Some(r#"["9.9.9.9"]"#)),
    )
    .unwrap();
    let f = c.servers[0].forward.as_ref().unwrap();
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
        c.servers[0].forward.as_ref().unwrap().upstream.transport,
        Transport::PreferUdp
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
        c.servers[0].forward.as_ref().unwrap().upstream.addrs,
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
