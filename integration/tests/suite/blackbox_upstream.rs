//! How the agent uses its upstream, seen from the upstream's side: few long-lived TCP
//! connections for sequential misses, never more than the pool cap (64) under load, one
//! upstream query for many identical concurrent misses, SERVFAIL within the deadline (4.5 s,
//! before a stub resolver's 5 s) when the upstream is silent, and queries retried at once when
//! a connection is reset or closed.
//!
//! The scripted upstream counts queries per name and TCP connections (total and at once).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use nodedns_integration::client::{self, a_addrs};
use nodedns_integration::scripted::{Action, Options, Scripted};
use nodedns_integration::{Agent, free_port, http_get, knot};

/// The address a scripted upstream gives every name it answers: 10.<i>.<j>.<k> built from the
/// name's number, so each answer shows it belongs to its own question.
fn numbered(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a00_0000 | i)
}

/// Parses `n<i>.<anything>` into `i`.
fn number_of(qname: &str) -> Option<u32> {
    qname.strip_prefix('n')?.split('.').next()?.parse().ok()
}

/// The queries the agent hedged (`nodedns_upstream_hedges_total`, every address), from its
/// `/metrics` at `metrics`.
fn hedges(metrics: SocketAddr) -> f64 {
    let (status, text) = http_get(metrics, "/metrics").expect("scrape /metrics");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| l.starts_with("nodedns_upstream_hedges_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn numbered_answers(delay: Duration) -> Scripted {
    Scripted::start(move |query, _| {
        let name = client::qname(query);
        match number_of(&name) {
            Some(i) => Action::a(numbered(i), 60).after(delay),
            None => Action::NxDomain {
                soa_ttl: 30,
                minimum: 60,
            },
        }
    })
    .unwrap()
}

async fn ask_a(agent: SocketAddr, name: &str) -> hickory_proto::op::Message {
    client::udp(agent, &client::query(name, RecordType::A))
        .await
        .unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_misses_reuse_few_connections() {
    let _turn = crate::shared();
    let upstream = numbered_answers(Duration::ZERO);
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for i in 0..100 {
        let reply = ask_a(agent.addr(), &format!("n{i}.seq.test.")).await;
        assert_eq!(a_addrs(&reply), [numbered(i)]);
    }
    assert_eq!(
        upstream.queries_under("seq.test."),
        100,
        "every miss went upstream once"
    );
    assert!(upstream.tcp_queries() >= 100, "over TCP");
    assert!(
        upstream.connections() <= 3,
        "100 sequential misses (plus the agent's start-up queries) used {} TCP connections; \
         names seen: {:?}",
        upstream.connections(),
        upstream
            .names()
            .iter()
            .filter(|(n, _)| !n.ends_with("seq.test."))
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_misses_to_knot_go_over_tcp() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let before = knot.queries().unwrap();
    let before_tcp = knot.tcp_queries().unwrap();
    for name in ["web", "kubernetes", "headless", "ttl7", "ttl300"] {
        let reply = ask_a(agent.addr(), &format!("{name}.default.svc.cluster.local.")).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert!(!reply.answers.is_empty());
    }
    assert_eq!(knot.queries().unwrap() - before, 5);
    assert_eq!(
        knot.tcp_queries().unwrap() - before_tcp,
        5,
        "misses go upstream over pooled TCP"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_stay_within_pool_cap() {
    let _turn = crate::shared();
    // Each answer takes 200 ms, so 200 concurrent misses would want 200 connections; the
    // pool serves them with at most 64 (4 rounds, well within the deadline).
    let upstream = numbered_answers(Duration::from_millis(200));
    let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let agent = Agent::start_with(
        &[upstream.addr()],
        &["--metrics-listen-address", &metrics.to_string()],
    )
    .expect("agent starts");
    let addr = agent.addr();
    // A few answers first, so the pool knows this upstream takes 200 ms and does not hedge
    // (a hedge replaces a connection, which the upstream would see as one more open for a
    // moment).
    for i in 0..3 {
        ask_a(addr, &format!("n{i}.warm.test.")).await;
    }
    let hedged_before = hedges(metrics);

    let tasks: Vec<_> = (0..200u32)
        .map(|i| {
            tokio::spawn(async move {
                let query = client::query(&format!("n{i}.burst.test."), RecordType::A);
                (i, client::udp(addr, &query).await)
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        let (i, reply) = task.await.unwrap();
        match reply {
            Ok(reply)
                if reply.metadata.response_code == ResponseCode::NoError
                    && a_addrs(&reply) == [numbered(i)] => {}
            Ok(reply) => failures.push(format!(
                "n{i}: {} {:?}",
                reply.metadata.response_code,
                a_addrs(&reply)
            )),
            Err(e) => failures.push(format!("n{i}: {e:#}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 200 concurrent misses not answered correctly, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    // On a busy machine an answer can still come later than the hedge timeout the warm-up
    // measured: each hedge is one more query, and its loser's connection is closed as its slot
    // goes to a new one, which the upstream may see open beside it for a moment.
    let hedged = (hedges(metrics) - hedged_before) as u64;
    assert_eq!(
        upstream.queries_under("burst.test."),
        200 + hedged,
        "each miss went upstream once, and once more per hedge ({hedged})"
    );
    let max = upstream.max_open_connections();
    assert!(
        max <= 64 + hedged,
        "{max} TCP connections open at once, cap 64 ({hedged} hedges)"
    );
    assert!(
        max >= 2,
        "the pool grows with concurrency (at most {max} connections open)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_concurrent_misses_make_one_upstream_query() {
    let _turn = crate::shared();
    // The upstream answers after 500 ms, so all 50 queries arrive while the first is in flight.
    let upstream = Scripted::start(|_, _| {
        Action::a(Ipv4Addr::new(192, 0, 2, 50), 60).after(Duration::from_millis(500))
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");
    let addr = agent.addr();

    // Three casings of one name: one key (RFC 4343), each answer in its own case.
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let name = match i % 3 {
                0 => "same.flight.test.",
                1 => "SAME.flight.TEST.",
                _ => "Same.Flight.Test.",
            };
            tokio::spawn(async move {
                let query = client::query(name, RecordType::A);
                let reply = client::udp(addr, &query).await;
                (name, query.metadata.id, reply)
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        let (name, id, reply) = task.await.unwrap();
        match reply {
            Ok(reply)
                if reply.metadata.id == id
                    && client::qname(&reply) == name
                    && a_addrs(&reply) == [Ipv4Addr::new(192, 0, 2, 50)] => {}
            Ok(reply) => failures.push(format!("{name}: {reply:?}")),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 50 waiters not answered with their own ID, case and the data, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    // One fetch; the upstream is much slower on it than on anything before (the start-up
    // probe), so the fetch may be hedged once.
    let sent = upstream.queries_for("same.flight.test.");
    assert!(
        (1..=2).contains(&sent),
        "50 concurrent identical misses, {sent} upstream queries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_upstream_gives_servfail_within_deadline() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| match client::qname(query).as_str() {
        "silent.test." | "silent-dig.test." => Action::Silence,
        _ => Action::a(Ipv4Addr::new(192, 0, 2, 1), 30),
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for round in 1..=2 {
        let started = Instant::now();
        let reply = ask_a(agent.addr(), "silent.test.").await;
        let took = started.elapsed();
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(
            took < Duration::from_secs(5),
            "SERVFAIL after {took:?}: the deadline is 4.5 s, a stub resolver gives up at 5 s"
        );
        // The agent's own SERVFAIL is not cached: the second round asks upstream again.
        assert!(
            upstream.queries_for("silent.test.") >= round,
            "round {round}: the query went upstream"
        );
    }

    // A real client with one try and a 5 s timeout gets the SERVFAIL, not a timeout.
    let started = Instant::now();
    let out = client::dig(agent.addr(), &["+time=5", "silent-dig.test.", "A"]).unwrap();
    assert_eq!(out.status, "SERVFAIL", "{}", out.raw);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_answer_within_deadline_is_served_and_cached() {
    let _turn = crate::shared();
    // 1.2 s is slow but inside the deadline: the client gets the answer, not a SERVFAIL.
    let upstream = Scripted::start(|_, _| {
        Action::a(Ipv4Addr::new(192, 0, 2, 12), 60).after(Duration::from_millis(1200))
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    let started = Instant::now();
    let reply = ask_a(agent.addr(), "slow.test.").await;
    let took = started.elapsed();
    assert_eq!(
        reply.metadata.response_code,
        ResponseCode::NoError,
        "after {took:?}"
    );
    assert_eq!(a_addrs(&reply), [Ipv4Addr::new(192, 0, 2, 12)]);
    assert!(took >= Duration::from_millis(1200));
    // Hedged once at most: the upstream is far slower on it than on the start-up probe.
    let sent = upstream.queries_for("slow.test.");
    assert!((1..=2).contains(&sent), "{sent} upstream queries");

    let started = Instant::now();
    let hit = ask_a(agent.addr(), "slow.test.").await;
    assert_eq!(a_addrs(&hit), [Ipv4Addr::new(192, 0, 2, 12)]);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "the second answer comes from the cache"
    );
    assert_eq!(upstream.queries_for("slow.test."), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_mid_flight_is_retried() {
    let _turn = crate::shared();
    // The first query for each name is answered with a RST on its (already used) connection,
    // the way a CoreDNS pod going away looks; the retry is answered.
    let upstream = Scripted::start(|query, ctx| {
        let action = if ctx.nth == 1 {
            Action::Reset
        } else {
            Action::a(Ipv4Addr::new(192, 0, 2, 7), 60)
        };
        // "slow-" names are reset after a moment, with the query well in flight (and before
        // the agent would hedge it: 50 ms at the soonest).
        if client::qname(query).starts_with("slow") {
            action.after(Duration::from_millis(20))
        } else {
            action
        }
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for name in ["reset.test.", "slow-reset.test."] {
        let connections = upstream.connections();
        let started = Instant::now();
        let reply = ask_a(agent.addr(), name).await;
        let took = started.elapsed();
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NoError,
            "{name}"
        );
        assert_eq!(a_addrs(&reply), [Ipv4Addr::new(192, 0, 2, 7)]);
        // A machine busy enough to delay the reset past the hedge timeout adds the hedge.
        let sent = upstream.queries_for(name);
        assert!(
            (2..=3).contains(&sent),
            "{name}: sent, reset, sent again (and perhaps hedged): {sent}"
        );
        assert!(
            upstream.connections() > connections,
            "{name}: the retry used a new connection"
        );
        assert!(
            took < Duration::from_secs(1),
            "{name}: retried at once, not after the deadline ({took:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_closed_by_upstream_is_retried() {
    let _turn = crate::shared();
    // Every connection is closed (FIN) by the upstream after one answer, as CoreDNS does to an
    // idle one: the pool's next query on it fails and must be retried on a fresh connection.
    let upstream = Scripted::start_with(
        Options {
            close_after: Some(1),
        },
        |query, _| match number_of(&client::qname(query)) {
            Some(i) => Action::a(numbered(i), 60),
            None => Action::NxDomain {
                soa_ttl: 30,
                minimum: 60,
            },
        },
    )
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for i in 0..10 {
        let started = Instant::now();
        let reply = ask_a(agent.addr(), &format!("n{i}.closing.test.")).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "n{i}");
        assert_eq!(a_addrs(&reply), [numbered(i)]);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "n{i}: answered without waiting for the deadline ({:?})",
            started.elapsed()
        );
    }
    assert!(upstream.connections() >= 10, "one connection per answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_upstream_replies_are_never_served() {
    let _turn = crate::shared();
    use nodedns_integration::scripted::response;

    // Replies that answer something else: another ID, or another question. Accepting either
    // would let an off-path or confused server poison the cache.
    let upstream = Scripted::start(|query, _| {
        let bogus = |mut reply: hickory_proto::op::Message| {
            reply.add_answer(hickory_proto::rr::Record::from_rdata(
                reply.queries[0].name().clone(),
                300,
                hickory_proto::rr::RData::A(Ipv4Addr::new(6, 6, 6, 6).into()),
            ));
            Action::Raw(reply)
        };
        match client::qname(query).as_str() {
            "wrong-id.test." => {
                let mut reply = response(query, ResponseCode::NoError);
                reply.metadata.id = query.metadata.id.wrapping_add(1);
                bogus(reply)
            }
            "wrong-question.test." => {
                let other = client::query("other.test.", query.queries[0].query_type());
                let mut reply = response(&other, ResponseCode::NoError);
                reply.metadata.id = query.metadata.id;
                bogus(reply)
            }
            _ => Action::a(Ipv4Addr::new(192, 0, 2, 1), 30),
        }
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for name in ["wrong-id.test.", "wrong-question.test."] {
        let started = Instant::now();
        let reply = ask_a(agent.addr(), name).await;
        assert!(
            !a_addrs(&reply).contains(&Ipv4Addr::new(6, 6, 6, 6)),
            "{name}: bogus data served: {reply:?}"
        );
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::ServFail,
            "{name}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{name}: within the deadline"
        );
    }
    // Nothing was cached under the other name either.
    let other = ask_a(agent.addr(), "other.test.").await;
    assert_eq!(a_addrs(&other), [Ipv4Addr::new(192, 0, 2, 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_gives_servfail_within_deadline() {
    let _turn = crate::shared();
    // A port nothing listens on: every connection attempt is refused.
    let port = nodedns_integration::free_port().unwrap();
    let agent = Agent::start(&[SocketAddr::from((Ipv4Addr::LOCALHOST, port))])
        .expect("agent starts (and answers) without a reachable upstream");
    for name in ["a.unreachable.test.", "b.unreachable.test."] {
        let started = Instant::now();
        let reply = ask_a(agent.addr(), name).await;
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::ServFail,
            "{name}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{name}: SERVFAIL after {:?}",
            started.elapsed()
        );
    }
    let out = client::kdig(agent.addr(), &["c.unreachable.test.", "A"]).unwrap();
    assert_eq!(out.status, "SERVFAIL", "{}", out.raw);
}
