//! CoreDNS restarts and outages, counted from the client's side:
//!
//! - an upstream that resets every third TCP connection mid-flight, and one that closes every
//!   connection after each answer (lameduck, idle close), under thousands of misses: no client
//!   sees a failure;
//! - one of two real Knot servers restarted after the other (a CoreDNS rollout) under load,
//!   and a single Knot restarted under its pooled connections: no client sees a failure;
//! - the upstream stopped for 60 s: every name cached before is answered (stale, TTL 30), new
//!   names get SERVFAIL at once, `coredns_cache_served_stale_total` counts, and the cache is
//!   refreshed when the upstream is back.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::knot::{self, Knot, Options as KnotOptions, Zone};
use nodedns_integration::scripted::{Action, Ctx, Options, Scripted, Transport};
use nodedns_integration::{Agent, client};

use crate::reliability_support::{Load, Query, Report, free_addr, metric, runtime, scrape};

/// Every query a name never asked before: each one is a miss that goes upstream.
fn unique(tag: &'static str) -> Arc<dyn Fn(u64) -> Query + Send + Sync> {
    Arc::new(move |n| (format!("u{n}.{tag}.cluster.local."), RecordType::A))
}

fn assert_no_failures(what: &str, report: &Report, expected: u64) {
    eprintln!("{what}: {report:?}");
    assert!(
        report.sent >= expected * 98 / 100,
        "{what}: the load fell behind: {report:?}"
    );
    assert_eq!(
        report.failures(),
        0,
        "{what}: no client saw a failure: {report:#?}"
    );
}

fn answer_everything() -> impl Fn(&Message, &Ctx) -> Action + Send + Sync + 'static {
    |_, _| Action::a(Ipv4Addr::new(192, 0, 2, 53), 300)
}

#[test]
fn resets_of_every_third_upstream_connection_are_invisible_to_clients() {
    let _turn = crate::alone();
    let resets = Arc::new(AtomicU64::new(0));
    let upstream = {
        let resets = resets.clone();
        Scripted::start_with(
            Options {
                // Connections also end cleanly now and then, as CoreDNS's do.
                close_after: Some(50),
            },
            move |_, ctx| {
                // Every third connection is reset with a query in flight: on its first query
                // (a fresh connection) or its second (a pooled one), alternately.
                let reset = ctx.transport == Transport::Tcp
                    && ctx.connection % 3 == 0
                    && ctx.on_connection == 1 + (ctx.connection / 3) % 2;
                if reset {
                    resets.fetch_add(1, Ordering::Relaxed);
                    Action::Reset
                } else {
                    Action::a(Ipv4Addr::new(192, 0, 2, 53), 300)
                }
            },
        )
        .unwrap()
    };
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");
    let load = Load {
        target: agent.addr(),
        qps: 1000,
        duration: Duration::from_secs(5),
        sockets: 8,
        deadline: Duration::from_secs(2),
        query: unique("resets"),
    };
    let report = runtime().block_on(load.run());
    assert_no_failures("resets", &report, 5000);
    let resets = resets.load(Ordering::Relaxed);
    assert!(
        resets >= 10,
        "the upstream did reset connections with queries in flight: {resets} resets, {} connections",
        upstream.connections()
    );
    eprintln!(
        "{resets} resets over {} connections, {} upstream queries for {} client queries",
        upstream.connections(),
        upstream.queries_under("resets.cluster.local."),
        report.sent
    );
}

#[test]
fn a_broken_upstream_address_is_failed_over_at_once() {
    let _turn = crate::alone();
    // One address resets every connection; the other answers. Misses never fail, and never
    // wait for a deadline.
    let broken = Scripted::start(|_, ctx| match ctx.transport {
        Transport::Tcp => Action::Reset,
        Transport::Udp => Action::Silence,
    })
    .unwrap();
    let good = Scripted::start(answer_everything()).unwrap();
    let agent = Agent::start(&[broken.addr(), good.addr()]).expect("agent starts");
    let load = Load {
        target: agent.addr(),
        qps: 500,
        duration: Duration::from_secs(4),
        sockets: 4,
        deadline: Duration::from_secs(1),
        query: unique("failover"),
    };
    let report = runtime().block_on(load.run());
    assert_no_failures("failover", &report, 2000);
    assert!(broken.queries() > 0, "the broken address was tried");
}

#[test]
fn connections_closed_by_the_server_after_each_answer_cost_no_answer_and_no_health() {
    let _turn = crate::alone();
    // CoreDNS in lameduck (or closing idle connections): every connection ends after one
    // answer. A closed pooled connection is not an upstream failure.
    let upstream = Scripted::start_with(
        Options {
            close_after: Some(1),
        },
        answer_everything(),
    )
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");
    let load = Load {
        target: agent.addr(),
        qps: 500,
        duration: Duration::from_secs(4),
        sockets: 4,
        deadline: Duration::from_secs(2),
        query: unique("lameduck"),
    };
    let report = runtime().block_on(load.run());
    assert_no_failures("lameduck", &report, 2000);
    let output = agent.output();
    assert!(
        !output.contains("upstream marked down"),
        "closing connections is not a failure:\n{output}"
    );
}

/// A zone of `count` names `s<i>.outage.cluster.local.` with A records `<prefix>.<i>`, TTL 5.
fn outage_zone(count: u8, prefix: [u8; 2]) -> Zone {
    let mut body = String::from(
        "$TTL 5\n@ 5 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 5\n\
         @ 5 IN NS ns.dns\nns.dns 5 IN A 10.96.0.10\n",
    );
    for i in 0..count {
        body.push_str(&format!(
            "s{i}.outage 5 IN A {}.{}.0.{i}\n",
            prefix[0], prefix[1]
        ));
    }
    Zone {
        origin: "cluster.local.".to_owned(),
        body,
    }
}

fn knot_at(listen: SocketAddr, zone: Zone) -> Knot {
    Knot::start(KnotOptions {
        listen: vec![listen],
        netns: None,
        zones: vec![zone],
    })
    .expect("knotd starts")
}

#[test]
fn two_upstreams_restarted_one_after_the_other_cost_no_answer() {
    let _turn = crate::alone();
    let Some(first) = knot::cluster_local_or_skip() else {
        return;
    };
    let second = knot_at(free_addr(), Knot::cluster_local());
    let (a, b) = (first.addr(), second.addr());
    let agent = Agent::start(&[a, b]).expect("agent starts");
    let runtime = runtime();
    let load = Load {
        target: agent.addr(),
        qps: 1000,
        duration: Duration::from_secs(12),
        sockets: 8,
        deadline: Duration::from_secs(2),
        // Half misses (NXDOMAIN from Knot), half cached names.
        query: Arc::new(|n| {
            if n % 2 == 0 {
                (format!("u{n}.rolling.cluster.local."), RecordType::A)
            } else {
                ("web.default.svc.cluster.local.".to_owned(), RecordType::A)
            }
        }),
    };
    let running = runtime.spawn(load.run());
    // A CoreDNS rollout: one pod goes away and comes back, then the other.
    std::thread::sleep(Duration::from_secs(2));
    first.stop();
    std::thread::sleep(Duration::from_secs(1));
    let first = knot_at(a, Knot::cluster_local());
    std::thread::sleep(Duration::from_secs(3));
    second.stop();
    std::thread::sleep(Duration::from_secs(1));
    let second = knot_at(b, Knot::cluster_local());
    let report = runtime.block_on(running).unwrap();
    assert_no_failures("rolling restart", &report, 12_000);
    drop((first, second));
}

#[test]
fn a_restarted_upstream_is_reconnected_to_without_a_failed_answer() {
    let _turn = crate::alone();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let addr = knot.addr();
    let agent = Agent::start(&[addr]).expect("agent starts");
    let runtime = runtime();
    let burst = |tag: &'static str| {
        let target = agent.addr();
        runtime.block_on(async move {
            let mut tasks = Vec::new();
            for i in 0..200 {
                let query = client::query(&format!("u{i}.{tag}.cluster.local."), RecordType::A);
                tasks.push(tokio::spawn(
                    async move { client::udp(target, &query).await },
                ));
            }
            let mut failed = Vec::new();
            for task in tasks {
                match task.await.unwrap() {
                    Ok(reply) if reply.metadata.response_code == ResponseCode::NXDomain => {}
                    other => failed.push(format!("{other:?}")),
                }
            }
            failed
        })
    };
    // Concurrent misses fill the pool with connections...
    assert_eq!(burst("warm"), Vec::<String>::new());
    // ...which all die with the restart (Knot closes them). The next misses find them dead and
    // reconnect.
    knot.stop();
    let knot = knot_at(addr, Knot::cluster_local());
    let failed = burst("after");
    assert!(failed.is_empty(), "{} failed: {failed:#?}", failed.len());
    drop(knot);
}

#[test]
fn a_60_second_upstream_outage_is_served_stale_and_refreshed_after() {
    let _turn = crate::alone();
    if !nodedns_integration::have("knotd") {
        eprintln!("skipped: knotd not installed");
        return;
    }
    const NAMES: u8 = 50;
    let outage = Duration::from_secs(
        std::env::var("NODEDNS_OUTAGE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    );
    let addr = free_addr();
    let knot = knot_at(addr, outage_zone(NAMES, [10, 1]));
    let metrics_addr = free_addr();
    let agent = Agent::start_with(
        &[addr],
        &[
            "--metrics-listen-address".to_owned(),
            metrics_addr.to_string(),
        ],
    )
    .expect("agent starts");
    let runtime = runtime();
    let target = agent.addr();
    let ask = |name: String| {
        runtime.block_on(async move {
            let started = Instant::now();
            let reply = client::udp(target, &client::query(&name, RecordType::A))
                .await
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            (reply, started.elapsed())
        })
    };
    for i in 0..NAMES {
        let (reply, _) = ask(format!("s{i}.outage.cluster.local."));
        assert_eq!(client::a_addrs(&reply), [Ipv4Addr::new(10, 1, 0, i)]);
    }

    // CoreDNS is gone for a minute (connections refused).
    knot.stop();
    let down = Instant::now();
    let mut round = 0;
    loop {
        for i in 0..NAMES {
            let (reply, took) = ask(format!("s{i}.outage.cluster.local."));
            assert_eq!(
                reply.metadata.response_code,
                ResponseCode::NoError,
                "s{i} at {:?}",
                down.elapsed()
            );
            assert_eq!(client::a_addrs(&reply), [Ipv4Addr::new(10, 1, 0, i)]);
            let ttls = client::answer_ttls(&reply);
            assert!(
                ttls.iter().all(|&t| (1..=30).contains(&t)),
                "stale answers carry a TTL of 30 s at most, never 0 (RFC 8767): {ttls:?}"
            );
            assert!(
                took < Duration::from_secs(1),
                "s{i} answered at once: {took:?}"
            );
        }
        let (reply, took) = ask(format!("new{round}.outage.cluster.local."));
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(took < Duration::from_secs(1), "SERVFAIL at once: {took:?}");
        round += 1;
        if down.elapsed() >= outage {
            break;
        }
        std::thread::sleep(Duration::from_secs(10).min(outage.saturating_sub(down.elapsed())));
    }
    let text = runtime.block_on(scrape(metrics_addr)).expect("scrape");
    let stale = metric(&text, "coredns_cache_served_stale_total").unwrap_or(0.0);
    assert!(
        stale >= f64::from(NAMES),
        "stale answers are counted: {stale}\n{text}"
    );

    // CoreDNS is back, with new addresses for every name: stale answers trigger refreshes, and
    // the new data is served within moments.
    let knot = knot_at(addr, outage_zone(NAMES, [10, 2]));
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0..NAMES {
        loop {
            let (reply, _) = ask(format!("s{i}.outage.cluster.local."));
            if client::a_addrs(&reply) == [Ipv4Addr::new(10, 2, 0, i)] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "s{i} refreshed after the outage: {reply:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    drop(knot);
}
