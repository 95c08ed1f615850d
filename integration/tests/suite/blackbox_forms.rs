//! Corefile forms node-cache loads, seen from outside: `import` of snippets, globs and files
//! holding whole server blocks (and a reload when an imported file changes), keys on several
//! ports in one block, and the cache's `keepttl`, `disable`, ZONES and `prefetch` DURATION.
//!
//! A real Knot serves cluster.local; its query counter says whether an answer came from the
//! cache.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::client::{self, a_addrs, answer_ttls, authority_ttls};
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Process, TempDir, free_port, spawn_with_corefile};

const START: Duration = Duration::from_secs(15);

fn ask(server: SocketAddr, name: &str, agent: &Process) -> Message {
    client::udp_blocking(
        server,
        &client::query(name, RecordType::A),
        Duration::from_secs(5),
    )
    .unwrap_or_else(|e| panic!("{name} at {server}: {e:#}\n{}", agent.output()))
}

fn write(dir: &Path, file: &str, text: &str) {
    let path = dir.join(file);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Upstream queries Knot received while `f` ran.
fn upstream_queries(knot: &Knot, f: impl FnOnce()) -> u64 {
    let before = knot.queries().unwrap();
    f();
    knot.queries().unwrap() - before
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

#[test]
fn snippets_globs_and_an_imported_server_block_are_served() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-import").unwrap();
    let port = free_port().unwrap();
    let upstream = knot.addr();
    // The `.` block has no cache; the imported block for svc.cluster.local caches.
    write(
        dir.path(),
        "blocks/svc.server",
        &format!(
            "svc.cluster.local:{port} {{\n    bind 127.0.0.1\n    import common\n    cache 30\n    forward . {upstream}\n}}\n"
        ),
    );
    write(dir.path(), "more/log.conf", "log\n");
    let corefile = format!(
        "(common) {{\n    errors\n}}\nimport blocks/*.server\n.:{port} {{\n    bind 127.0.0.1\n    import common\n    import custom/*.override\n    import more/*.conf\n    forward . {upstream}\n}}\n"
    );
    let (mut agent, _) = spawn_with_corefile(&dir, &corefile);
    agent.wait_output("serving DNS", START).unwrap();
    let dns = loopback(port);

    let cached = "web.default.svc.cluster.local.";
    let n = upstream_queries(&knot, || {
        for _ in 0..3 {
            let reply = ask(dns, cached, &agent);
            assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 12, 34)]);
        }
    });
    assert_eq!(n, 1, "the imported block caches\n{}", agent.output());
    let uncached = "ns.dns.cluster.local.";
    let n = upstream_queries(&knot, || {
        for _ in 0..3 {
            let reply = ask(dns, uncached, &agent);
            assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 0, 10)]);
        }
    });
    assert_eq!(n, 3, "the `.` block does not\n{}", agent.output());
    let output = agent.output();
    // `more/*.conf` put `log` in the `.` block; the glob that matches nothing only warns.
    assert!(output.contains("ns.dns.cluster.local"), "{output}");
    assert!(
        output.contains("import `custom/*.override`: no file matches"),
        "{output}"
    );
}

#[test]
fn a_change_of_an_imported_file_reloads_the_configuration() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-import-reload").unwrap();
    let port = free_port().unwrap();
    write(dir.path(), "custom/cache.override", "cache 30\n");
    let corefile = format!(
        ".:{port} {{\n    bind 127.0.0.1\n    import custom/*.override\n    forward . {}\n}}\n",
        knot.addr()
    );
    let (mut agent, _) = spawn_with_corefile(&dir, &corefile);
    agent.wait_output("serving DNS", START).unwrap();
    let dns = loopback(port);
    let twice = |name: &str, agent: &Process| {
        upstream_queries(&knot, || {
            ask(dns, name, agent);
            ask(dns, name, agent);
        })
    };
    assert_eq!(twice("web.default.svc.cluster.local.", &agent), 1);

    // The Corefile is untouched: only the imported file changes.
    write(dir.path(), "custom/cache.override", "errors\n");
    agent
        .wait_output("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        twice("kubernetes.default.svc.cluster.local.", &agent),
        2,
        "no cache after the reload\n{}",
        agent.output()
    );
}

#[test]
fn keys_on_different_ports_are_each_served_on_their_port() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-ports").unwrap();
    let (p1, p2) = (free_port().unwrap(), free_port().unwrap());
    let corefile = format!(
        "svc.cluster.local:{p1} dns.cluster.local:{p2} {{\n    bind 127.0.0.1\n    forward . {}\n}}\n",
        knot.addr()
    );
    let (mut agent, _) = spawn_with_corefile(&dir, &corefile);
    agent.wait_output("serving DNS", START).unwrap();
    let web = "web.default.svc.cluster.local.";
    let ns = "ns.dns.cluster.local.";
    assert_eq!(
        a_addrs(&ask(loopback(p1), web, &agent)),
        [Ipv4Addr::new(10, 96, 12, 34)]
    );
    assert_eq!(
        a_addrs(&ask(loopback(p2), ns, &agent)),
        [Ipv4Addr::new(10, 96, 0, 10)]
    );
    // Each zone only on its own port: elsewhere no block serves it.
    let refused = ask(loopback(p1), ns, &agent);
    assert_eq!(refused.metadata.response_code, ResponseCode::Refused);
    let refused = ask(loopback(p2), web, &agent);
    assert_eq!(refused.metadata.response_code, ResponseCode::Refused);
}

#[test]
fn cache_keepttl_disable_and_zones_as_coredns() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-cache-forms").unwrap();
    let port = free_port().unwrap();
    let upstream = knot.addr();
    let corefile = format!(
        ".:{port} {{
    bind 127.0.0.1
    cache {{
        keepttl
        denial 9984 5
        disable denial
    }}
    forward . {upstream}
}}
svc.cluster.local:{port} {{
    bind 127.0.0.1
    cache 30 default.svc.cluster.local
    forward . {upstream}
}}
"
    );
    let (mut agent, _) = spawn_with_corefile(&dir, &corefile);
    agent.wait_output("serving DNS", START).unwrap();
    let dns = loopback(port);

    // keepttl: a hit two seconds later still says 300.
    let name = "ttl300.default.svc.cluster.local.";
    // Answered by the svc.cluster.local block (no keepttl): the `.` block answers ns.dns.
    let ns = "ns.dns.cluster.local.";
    let stored = Instant::now();
    let n = upstream_queries(&knot, || {
        ask(dns, ns, &agent);
    });
    assert_eq!(n, 1);
    // The subject is the TTL after time in the cache: let two whole seconds pass.
    std::thread::sleep(
        (stored + Duration::from_millis(2100)).saturating_duration_since(Instant::now()),
    );
    let n = upstream_queries(&knot, || {
        let hit = ask(dns, ns, &agent);
        assert_eq!(answer_ttls(&hit), [30], "keepttl: the stored TTL, not 28");
    });
    assert_eq!(n, 0);

    // disable denial: every NXDOMAIN goes upstream, its SOA TTL still clamped to 5.
    let missing = "nosuch.dns.cluster.local.";
    let n = upstream_queries(&knot, || {
        for _ in 0..2 {
            let reply = ask(dns, missing, &agent);
            assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
            assert_eq!(authority_ttls(&reply), [5]);
        }
    });
    assert_eq!(n, 2, "denials are not kept\n{}", agent.output());

    // cache ZONES: inside default.svc.cluster.local cached, the rest of the block not.
    let n = upstream_queries(&knot, || {
        ask(dns, name, &agent);
        let hit = ask(dns, name, &agent);
        assert!(hit.metadata.authoritative);
        assert!(answer_ttls(&hit)[0] <= 30, "{:?}", answer_ttls(&hit));
    });
    assert_eq!(n, 1, "under the cache's zone\n{}", agent.output());
    let outside = "kube-dns.kube-system.svc.cluster.local.";
    let n = upstream_queries(&knot, || {
        for _ in 0..2 {
            let reply = ask(dns, outside, &agent);
            assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 0, 10)]);
        }
    });
    assert_eq!(n, 2, "outside the cache's zone\n{}", agent.output());
}

/// The sum of the series of `family` on the agent's /metrics.
fn metric(admin: SocketAddr, family: &str) -> f64 {
    let (status, text) = nodedns_integration::http_get(admin, "/metrics").unwrap();
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| l.starts_with(family) && l[family.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn prefetch_counts_hits_only_while_none_is_more_than_duration_after_the_last() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-prefetch-window").unwrap();
    let port = free_port().unwrap();
    let admin = loopback(free_port().unwrap());
    // 90 %: a 7 s entry is due from its first hit; popularity alone decides.
    let corefile = format!(
        ".:{port} {{\n    bind 127.0.0.1\n    prometheus {admin}\n    cache {{\n        prefetch 2 1s 90%\n    }}\n    forward . {}\n}}\n",
        knot.addr()
    );
    let (mut agent, _) = spawn_with_corefile(&dir, &corefile);
    agent.wait_output("serving DNS", START).unwrap();
    let dns = loopback(port);
    let name = "ttl7.default.svc.cluster.local.";
    const PREFETCHES: &str = "coredns_cache_prefetch_total";

    let stored = Instant::now();
    ask(dns, name, &agent);
    ask(dns, name, &agent);
    assert_eq!(metric(admin, PREFETCHES), 0.0, "one hit: not popular yet");
    // The subject is a gap longer than DURATION: let two whole seconds pass.
    std::thread::sleep(
        (stored + Duration::from_millis(2200)).saturating_duration_since(Instant::now()),
    );
    ask(dns, name, &agent);
    assert_eq!(
        metric(admin, PREFETCHES),
        0.0,
        "the second hit came 2 s after the first, more than the 1 s DURATION: the count starts \
         again\n{}",
        agent.output()
    );
    ask(dns, name, &agent);
    assert_eq!(
        metric(admin, PREFETCHES),
        1.0,
        "two hits within 1 s: popular, and due\n{}",
        agent.output()
    );
}
