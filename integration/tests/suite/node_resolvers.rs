//! Every resolver a pod may run gets its answers from nodedns: glibc (through `getent`, with
//! the resolv.conf options pods use), musl 1.2.3 (a static client built here with
//! `musl-gcc -static`) and Go's own resolver (a static pure-Go client built here, offline),
//! each in the pod's network namespace with the pod's resolv.conf (`search
//! default.svc.cluster.local svc.cluster.local cluster.local`, `ndots:5`).
//!
//! The names: a service with A and AAAA, headless services with 60 and 300 pod addresses (the
//! latter over 4,096 bytes), an external name reached through the search list, and a name that
//! does not exist; each looked up with a cold cache, then again with a warm one (no query
//! reaches CoreDNS the second time).
//!
//! musl asks over UDP without EDNS and, before 1.2.4, never retries over TCP when TC is set: it
//! uses what the truncated answer holds. nodedns, like node-cache, keeps as many whole records
//! as fit in 512 bytes, so a musl pod gets exactly that many addresses of a large headless
//! service (28 for the names here, as from node-cache). The others retry over TCP (glibc, Go)
//! and get every address.
//!
//! The clients' sources are in `integration/clients/`; each is built once per test run, into
//! Cargo's scratch directory for integration tests.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use nodedns_integration::knot::Zone;
use nodedns_integration::node::{self, Node, NodeOptions};

/// A name a pod looks up, as the application writes it, and what CoreDNS holds for it.
struct Name {
    /// As given to the resolver (short: expanded through the search list).
    lookup: &'static str,
    /// The name that answers (the search-list expansion that exists).
    fqdn: &'static str,
    v4: Vec<Ipv4Addr>,
    v6: Vec<Ipv6Addr>,
}

const SERVICE: &str = "web.default";
const HEADLESS_60: &str = "headless60.default";
const HEADLESS_300: &str = "headless300.default";
const EXTERNAL: &str = "www.example.com";
const MISSING: &str = "missing.default";

/// The address of pod `i` of a headless service (`i` < 60_000).
fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, (i / 200) as u8, (i % 200 + 1) as u8)
}

fn names() -> Vec<Name> {
    vec![
        Name {
            lookup: SERVICE,
            fqdn: "web.default.svc.cluster.local.",
            v4: vec![Ipv4Addr::new(10, 96, 12, 34)],
            v6: vec!["fd00:10:96::1234".parse().unwrap()],
        },
        Name {
            lookup: HEADLESS_60,
            fqdn: "headless60.default.svc.cluster.local.",
            v4: (0..60).map(pod_ip).collect(),
            v6: vec![],
        },
        Name {
            lookup: HEADLESS_300,
            fqdn: "headless300.default.svc.cluster.local.",
            v4: (0..300).map(pod_ip).collect(),
            v6: vec![],
        },
        Name {
            lookup: EXTERNAL,
            fqdn: "www.example.com.",
            v4: vec![Ipv4Addr::new(192, 0, 2, 80)],
            v6: vec!["2001:db8::80".parse().unwrap()],
        },
        Name {
            lookup: MISSING,
            fqdn: "missing.default.",
            v4: vec![],
            v6: vec![],
        },
    ]
}

/// CoreDNS's zones: the standard ones, the two headless services added to cluster.local (the
/// web service is already there), and an external zone.
fn zones() -> Vec<Zone> {
    let mut records = String::new();
    for (service, pods) in [("headless60", 60), ("headless300", 300)] {
        for i in 0..pods {
            let _ = writeln!(records, "{service}.default.svc 30 IN A {}", pod_ip(i));
        }
    }
    let mut zones = Node::standard_zones_with(&records);
    zones.push(Zone {
        origin: "example.com.".to_owned(),
        body: "@ 30 IN SOA ns.example.com. hostmaster.example.com. 1 7200 1800 86400 30\n\
               @ 30 IN NS ns\n\
               ns 30 IN A 192.0.2.53\n\
               www 30 IN A 192.0.2.80\n\
               www 30 IN AAAA 2001:db8::80\n"
            .to_owned(),
    });
    zones
}

/// How many A records of `fqdn` fit in a 512-byte answer without EDNS (RFC 1035 §4.2.1): the
/// header (12) and question (the name, type, class) first, then 16 bytes per record (a
/// compression pointer for the owner, type, class, TTL, length, 4 bytes of address).
fn a_records_in_512(fqdn: &str) -> usize {
    let name_len: usize = fqdn
        .trim_end_matches('.')
        .split('.')
        .map(|label| label.len() + 1)
        .sum::<usize>()
        + 1;
    (512 - 12 - (name_len + 4)) / 16
}

/// What one lookup printed: its exit status and the addresses it gave.
#[derive(Debug)]
struct Looked {
    status: Option<i32>,
    addrs: BTreeSet<IpAddr>,
    /// Addresses with repeats, in the order given (musl's answer must not repeat any).
    listed: usize,
    raw: String,
}

/// The resolvers of the matrix.
#[derive(Debug, Clone, Copy)]
enum Resolver {
    /// `getent ahosts` (getaddrinfo) and `getent hosts` (gethostbyname2), with these options
    /// added to the pod's resolv.conf.
    Glibc(&'static str),
    /// The static musl client.
    Musl,
    /// The static Go client.
    Go,
}

/// One way to look a name up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    /// `getent ahosts`: getaddrinfo, A and AAAA (its AI_ADDRCONFIG counts the link-local IPv6
    /// address every veth gets, so AAAA is asked on this IPv4 pod too).
    Ahosts,
    /// `getent hosts`: gethostbyname2, AF_INET6 first, AF_INET if that has nothing.
    Hosts,
    Musl,
    Go,
}

impl Resolver {
    fn tools(self) -> &'static [Tool] {
        match self {
            Resolver::Glibc(_) => &[Tool::Ahosts, Tool::Hosts],
            Resolver::Musl => &[Tool::Musl],
            Resolver::Go => &[Tool::Go],
        }
    }

    fn options(self) -> &'static str {
        match self {
            Resolver::Glibc(options) => options,
            Resolver::Musl | Resolver::Go => "",
        }
    }
}

impl Tool {
    fn run(self, node: &Node, name: &str, clients: &Clients) -> Looked {
        let out = match self {
            Tool::Ahosts => node.pod.output("getent", &["ahosts", name]),
            Tool::Hosts => node.pod.output("getent", &["hosts", name]),
            Tool::Musl => node.pod.output(path_str(&clients.musl), &[name]),
            Tool::Go => node.pod.output(path_str(&clients.go), &[name]),
        }
        .expect("the client runs");
        let raw = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // getent: the address first on each line; our clients: "NAME ADDRESS".
        let field = match self {
            Tool::Ahosts | Tool::Hosts => 0,
            Tool::Musl | Tool::Go => 1,
        };
        let mut addrs = BTreeSet::new();
        let mut listed = 0;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(Ok(addr)) = line.split_whitespace().nth(field).map(str::parse::<IpAddr>) {
                // ahosts prints each address three times (STREAM, DGRAM, RAW).
                if self != Tool::Ahosts || line.contains("STREAM") {
                    listed += 1;
                }
                addrs.insert(addr);
            }
        }
        Looked {
            status: out.status.code(),
            addrs,
            listed,
            raw,
        }
    }

    /// What this tool must give for `name`.
    fn check(self, name: &Name, got: &Looked, round: &str) {
        let context = format!("{self:?} {} ({round}):\n{}", name.lookup, got.raw);
        if name.v4.is_empty() && name.v6.is_empty() {
            // getent's "key not found" and our clients' EAI_NONAME / "no such host" are 2.
            assert_eq!(got.status, Some(2), "a missing name: {context}");
            assert!(got.addrs.is_empty(), "{context}");
            match self {
                Tool::Musl => assert!(got.raw.contains("Name does not resolve"), "{context}"),
                Tool::Go => assert!(got.raw.contains("no such host"), "{context}"),
                Tool::Ahosts | Tool::Hosts => {}
            }
            return;
        }
        assert_eq!(got.status, Some(0), "{context}");
        let v4: BTreeSet<IpAddr> = name.v4.iter().copied().map(IpAddr::V4).collect();
        let v6: BTreeSet<IpAddr> = name.v6.iter().copied().map(IpAddr::V6).collect();
        let fits = a_records_in_512(name.fqdn);
        match self {
            Tool::Ahosts | Tool::Go => assert_eq!(got.addrs, &v4 | &v6, "{context}"),
            Tool::Hosts if !v6.is_empty() => assert_eq!(got.addrs, v6, "{context}"),
            Tool::Hosts => assert_eq!(got.addrs, v4, "{context}"),
            Tool::Musl if name.v4.len() <= fits => {
                assert_eq!(got.addrs, &v4 | &v6, "{context}")
            }
            // Truncated: exactly the records that fit, each a real address, none repeated.
            Tool::Musl => {
                assert_eq!(got.addrs.len(), fits, "{context}");
                assert_eq!(got.listed, fits, "{context}");
                assert!(got.addrs.is_subset(&v4), "{context}");
            }
        }
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("client paths are UTF-8")
}

/// The clients built from `integration/clients/`.
#[derive(Debug)]
struct Clients {
    musl: PathBuf,
    go: PathBuf,
}

/// Builds both clients once per test run; `Err` says which tool is missing.
fn clients() -> Result<&'static Clients, String> {
    static CLIENTS: OnceLock<Result<Clients, String>> = OnceLock::new();
    CLIENTS
        .get_or_init(build_clients)
        .as_ref()
        .map_err(Clone::clone)
}

/// Where Debian's golang-1.19 puts `go` (it is not on PATH unless golang-go is installed).
const DEBIAN_GO: &str = "/usr/lib/go-1.19/bin/go";

fn build_clients() -> Result<Clients, String> {
    if !nodedns_integration::have("musl-gcc") {
        return Err("`musl-gcc` is not installed (Debian package musl-tools)".to_owned());
    }
    let go = if nodedns_integration::have("go") {
        PathBuf::from("go")
    } else if Path::new(DEBIAN_GO).exists() {
        PathBuf::from(DEBIAN_GO)
    } else {
        return Err("`go` is not installed (Debian package golang-1.19)".to_owned());
    };
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("node_resolvers");
    std::fs::create_dir_all(&out).expect("create the clients' build directory");
    // Built under a name of this process, then renamed: test runs at the same time never see
    // each other's half-written binaries.
    let pid = std::process::id();
    let musl = out.join("resolve-musl");
    let partial = out.join(format!("resolve-musl.{pid}"));
    run_build(
        Command::new("musl-gcc")
            .args(["-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&partial)
            .arg(sources.join("resolve.c")),
    );
    std::fs::rename(&partial, &musl).expect("rename the musl client");
    let go_bin = out.join("resolve-go");
    let partial = out.join(format!("resolve-go.{pid}"));
    // Standard library only, no module, no network: GOPROXY=off makes any download an error.
    run_build(
        Command::new(&go)
            .arg("build")
            .arg("-o")
            .arg(&partial)
            .arg(sources.join("resolve.go"))
            .current_dir(&out)
            .env("CGO_ENABLED", "0")
            .env("GOPROXY", "off")
            .env("GOFLAGS", "")
            .env("GO111MODULE", "off")
            .env("GOCACHE", out.join("go-cache"))
            .env("GOPATH", out.join("go-path"))
            .env("HOME", &out),
    );
    std::fs::rename(&partial, &go_bin).expect("rename the Go client");
    Ok(Clients { musl, go: go_bin })
}

fn run_build(command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Why the matrix cannot run here, if it cannot. Without root, namespaces or a tool the test
/// says so and passes as skipped, as the other node tests do, except under CI (`CI` set, as
/// `.ci/run` does): there every package is installed, so a missing one is a failure, not a
/// silent pass.
fn unavailable() -> Option<String> {
    let reason = node::unavailable().or_else(|| clients().err())?;
    assert!(
        std::env::var_os("CI").is_none(),
        "cannot run under CI: {reason}"
    );
    Some(reason)
}

/// Looks every name up with `resolver` on a fresh node: cold cache, then warm.
fn matrix(resolver: Resolver) {
    if let Some(reason) = unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let clients = clients().expect("checked above");
    let node = Node::build_serving(NodeOptions::default(), zones()).expect("simulated node");
    node.set_pod_resolver_options(resolver.options())
        .expect("pod resolv.conf");
    let agent = node.start_nodedns(&[]).expect("nodedns starts");
    let names = names();

    let before = node.coredns().queries().unwrap();
    for name in &names {
        for &tool in resolver.tools() {
            tool.check(name, &tool.run(&node, name.lookup, clients), "cold");
        }
    }
    let cold = node.coredns().queries().unwrap();
    assert!(cold > before, "the cold round went to CoreDNS");
    for name in &names {
        for &tool in resolver.tools() {
            tool.check(name, &tool.run(&node, name.lookup, clients), "warm");
        }
    }
    assert_eq!(
        node.coredns().queries().unwrap(),
        cold,
        "the warm round is answered from the cache"
    );
    drop(agent);
}

#[test]
fn truncation_keeps_28_records_of_these_names() {
    let _turn = crate::shared();
    // The figure the musl assertions rest on, as node-cache gives it too.
    assert_eq!(
        a_records_in_512("headless60.default.svc.cluster.local."),
        28
    );
    assert_eq!(
        a_records_in_512("headless300.default.svc.cluster.local."),
        28
    );
}

#[test]
fn glibc_with_default_options() {
    let _turn = crate::shared();
    matrix(Resolver::Glibc(""));
}

#[test]
fn glibc_over_tcp_with_use_vc() {
    let _turn = crate::shared();
    matrix(Resolver::Glibc("use-vc"));
}

#[test]
fn glibc_with_single_request_reopen() {
    let _turn = crate::shared();
    matrix(Resolver::Glibc("single-request-reopen"));
}

#[test]
fn glibc_with_edns0() {
    let _turn = crate::shared();
    matrix(Resolver::Glibc("edns0"));
}

#[test]
fn musl_gets_the_records_that_fit_in_512_bytes() {
    let _turn = crate::shared();
    matrix(Resolver::Musl);
}

#[test]
fn go_resolver() {
    let _turn = crate::shared();
    matrix(Resolver::Go);
}
