//! Serve-stale against an upstream that answers with failures, seen from outside (RFC 8767 §4:
//! any RCODE but NOERROR and NXDOMAIN, or no answer, is a failure to refresh and leaves the
//! cached answer in place):
//!
//! - SERVFAIL, REFUSED and silence from the upstream each get the client the stale answer, for
//!   as long as the stale window lasts, and only past it the failure itself;
//! - a prefetch that gets SERVFAIL leaves the fresh entry fresh;
//! - `serve_stale_policy prefer_positive` answers the last good answer when the upstream
//!   suddenly says NXDOMAIN or NODATA for a name that had data (and without it, the denial);
//! - `immediate` answers stale at once, `verify VERIFY_TIMEOUT` after the timeout, and
//!   `FAILURE_RECHECK` spares the upstream for that long after a failure.
//!
//! The upstream is the scripted one (Knot cannot answer SERVFAIL or REFUSED on demand). Entries
//! live 1 s (`success 9984 1 0`), so they go stale quickly; the waits are the subject of the
//! tests (a window elapsing) and each is bounded.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::Agent;
use nodedns_integration::client::{self, a_addrs, answer_ttls};
use nodedns_integration::scripted::{self, Action, Scripted};

/// The address every name has while the upstream answers.
const GOOD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// How long a test client waits: more than the agent's 4.5 s upstream deadline (glibc's 5 s).
const CLIENT_WAIT: Duration = Duration::from_secs(5);

/// A `cache` block whose entries live 1 s, without prefetch, with these `serve_stale` lines.
fn cache(stale: &str) -> String {
    cache_for(1, stale)
}

/// [`cache`] with entries that live `lifetime` seconds.
fn cache_for(lifetime: u32, stale: &str) -> String {
    format!(
        "    cache {{\n        success 9984 {lifetime} 0\n        denial 9984 {lifetime} 0\n        prefetch 0\n{stale}\n    }}\n"
    )
}

fn agent(upstream: &Scripted, cache: &str) -> Agent {
    Agent::with_corefile(&format!("{cache}    forward . {}\n", upstream.addr()))
        .expect("agent starts")
}

fn ask(agent: &Agent, name: &str) -> Message {
    client::udp_blocking(
        agent.addr(),
        &client::query(name, RecordType::A),
        CLIENT_WAIT,
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn sleep_until(at: Instant) {
    std::thread::sleep(at.saturating_duration_since(Instant::now()));
}

/// An upstream that answers `GOOD` (TTL 60) the first time a name is asked, and `then` every
/// time after.
fn good_then(then: Action) -> Scripted {
    Scripted::start(move |_, ctx| {
        if ctx.nth == 1 {
            Action::a(GOOD, 60)
        } else {
            then.clone()
        }
    })
    .expect("scripted upstream")
}

/// The stale answer: the cached address, every TTL the stale TTL (30 s).
fn assert_stale(reply: &Message, what: &str) {
    assert_eq!(
        reply.metadata.response_code,
        ResponseCode::NoError,
        "{what}: {reply:?}"
    );
    assert_eq!(a_addrs(reply), [GOOD], "{what}");
    assert_eq!(answer_ttls(reply), [30], "{what}: RFC 8767's stale TTL");
}

/// One failure the upstream answers with, the scenario: cached, then every query inside the
/// window (1 s + 8 s) gets the stale answer although the upstream was asked and failed; past
/// the window the client gets `after`.
fn stale_through_the_window(what: &'static str, failure: Action, after: ResponseCode) {
    let upstream = good_then(failure);
    let agent = agent(&upstream, &cache("        serve_stale 8s verify"));
    let name = format!("{what}.example.");
    let cached = Instant::now();
    assert_eq!(a_addrs(&ask(&agent, &name)), [GOOD], "{what}: first answer");
    // Stale from 1 s, to 9 s; asked at 1.5 s and 4 s (a query the upstream leaves unanswered
    // waits for the exchanges' 2 s read timeout and a retry, until every address is marked
    // silent or down: answered stale then, within the 4.5 s deadline).
    for at in [1500, 4000] {
        sleep_until(cached + Duration::from_millis(at));
        assert_stale(&ask(&agent, &name), &format!("{what} at {at} ms"));
    }
    assert!(
        upstream.queries_for(&name) >= 2,
        "{what}: the upstream failed"
    );
    sleep_until(cached + Duration::from_millis(9500));
    let reply = ask(&agent, &name);
    assert_eq!(
        reply.metadata.response_code, after,
        "{what}: past the window, the failure: {reply:?}"
    );
}

#[test]
fn servfail_refused_and_silence_each_yield_the_stale_answer_while_the_window_lasts() {
    let _turn = crate::shared();
    let cases: [(&'static str, Action, ResponseCode); 4] = [
        (
            "servfail",
            Action::Rcode(ResponseCode::ServFail),
            ResponseCode::ServFail,
        ),
        (
            "refused",
            Action::Rcode(ResponseCode::Refused),
            ResponseCode::Refused,
        ),
        (
            "notimp",
            Action::Rcode(ResponseCode::NotImp),
            ResponseCode::NotImp,
        ),
        ("silence", Action::Silence, ResponseCode::ServFail),
    ];
    // Each with its own agent and upstream (silence marks an upstream down, which changes the
    // path the others take), side by side.
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(what, failure, after)| {
            std::thread::spawn(move || stale_through_the_window(what, failure, after))
        })
        .collect();
    let failed: Vec<_> = runs.into_iter().filter_map(|r| r.join().err()).collect();
    assert!(failed.is_empty(), "{} case(s) failed", failed.len());
}

#[test]
fn a_prefetch_that_gets_servfail_leaves_the_fresh_entry_fresh() {
    let _turn = crate::shared();
    let upstream = good_then(Action::Rcode(ResponseCode::ServFail));
    // Entries live 10 s; one hit makes an entry popular, 90 % of its TTL left makes it due.
    let agent = agent(
        &upstream,
        "    cache {\n        success 9984 10 0\n        prefetch 1 1m 90%\n    }\n",
    );
    let name = "prefetched.example.";
    let cached = Instant::now();
    assert_eq!(a_addrs(&ask(&agent, name)), [GOOD]);
    sleep_until(cached + Duration::from_millis(1500));
    // A hit, due: answered from the cache, and the prefetch goes upstream, which says SERVFAIL.
    assert_eq!(a_addrs(&ask(&agent, name)), [GOOD]);
    assert!(
        upstream.wait_queries_for(name, 2, Duration::from_secs(3)),
        "the prefetch went upstream: {:?}",
        upstream.names()
    );
    // Its SERVFAIL is in well before this (the scripted upstream answers at once).
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..3 {
        let reply = ask(&agent, name);
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NoError,
            "{reply:?}"
        );
        assert_eq!(a_addrs(&reply), [GOOD]);
        let ttl = answer_ttls(&reply)[0];
        assert!((7..=9).contains(&ttl), "still the fresh entry: TTL {ttl}");
    }
    assert_eq!(upstream.queries_for(name), 2, "hits, not misses");
}

/// A NOERROR reply without an answer, with the zone's SOA: NODATA.
fn nodata() -> Action {
    let mut reply = Message::query();
    reply.add_authority(scripted::soa(60, 60));
    Action::Reply(reply)
}

#[test]
fn prefer_positive_answers_the_last_good_answer_when_the_upstream_suddenly_denies_the_name() {
    let _turn = crate::shared();
    let nxdomain = Action::NxDomain {
        soa_ttl: 60,
        minimum: 60,
    };
    let preferring = |then: Action| {
        let upstream = good_then(then);
        let agent = agent(
            &upstream,
            &cache("        serve_stale 5s verify\n        serve_stale_policy prefer_positive"),
        );
        (upstream, agent)
    };
    let (nx_upstream, nx_agent) = preferring(nxdomain.clone());
    let (nodata_upstream, nodata_agent) = preferring(nodata());
    let plain_upstream = good_then(nxdomain);
    let plain = agent(&plain_upstream, &cache("        serve_stale 5s verify"));

    let cached = Instant::now();
    for agent in [&nx_agent, &nodata_agent, &plain] {
        assert_eq!(a_addrs(&ask(agent, "moved.example.")), [GOOD]);
    }
    sleep_until(cached + Duration::from_millis(1500));
    for (agent, upstream, what) in [
        (&nx_agent, &nx_upstream, "NXDOMAIN"),
        (&nodata_agent, &nodata_upstream, "NODATA"),
    ] {
        for _ in 0..2 {
            assert_stale(&ask(agent, "moved.example."), what);
        }
        assert!(
            upstream.queries_for("moved.example.") >= 2,
            "{what}: the upstream was asked and denied the name"
        );
    }
    // Without the policy, the denial is the answer (RFC 8767: NXDOMAIN refreshes the data).
    let reply = ask(&plain, "moved.example.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);

    // Past the positive entry's window, the denial.
    sleep_until(cached + Duration::from_millis(6500));
    let reply = ask(&nx_agent, "moved.example.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
    let reply = ask(&nodata_agent, "moved.example.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    assert!(reply.answers.is_empty(), "NODATA: {reply:?}");
}

#[test]
fn immediate_answers_stale_at_once_and_refreshes_in_the_background() {
    let _turn = crate::shared();
    // The upstream takes 1 s to answer anything after the first: with `immediate`, no client
    // waits for it.
    let upstream = Scripted::start(|_, ctx| {
        let address = Ipv4Addr::new(10, 0, 0, ctx.nth.min(200) as u8);
        let answer = Action::a(address, 60);
        if ctx.nth == 1 {
            answer
        } else {
            answer.after(Duration::from_secs(1))
        }
    })
    .unwrap();
    let agent = agent(&upstream, &cache_for(2, "        serve_stale 1h immediate"));
    let name = "immediate.example.";
    let cached = Instant::now();
    assert_eq!(a_addrs(&ask(&agent, name)), [Ipv4Addr::new(10, 0, 0, 1)]);
    sleep_until(cached + Duration::from_millis(2500));
    for _ in 0..5 {
        let sent = Instant::now();
        let reply = ask(&agent, name);
        assert!(
            sent.elapsed() < Duration::from_millis(500),
            "answered at once"
        );
        assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 0, 0, 1)]);
        assert_eq!(answer_ttls(&reply), [30]);
    }
    assert!(
        upstream.wait_queries_for(name, 2, Duration::from_secs(2)),
        "the first stale hit refreshed the entry"
    );
    assert_eq!(upstream.queries_for(name), 2, "one refresh for five hits");
    // Once the refresh is in (1 s after the first stale hit), its answer is served fresh.
    std::thread::sleep(Duration::from_millis(1300));
    let reply = ask(&agent, name);
    assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 0, 0, 2)]);
    assert_ne!(answer_ttls(&reply), [30], "fresh, not stale");
}

#[test]
fn verify_with_a_timeout_answers_stale_after_it_and_the_fetch_refreshes_the_cache() {
    let _turn = crate::shared();
    // After the first answer the upstream takes 1.5 s, with a new address.
    let upstream = Scripted::start(|_, ctx| {
        if ctx.nth == 1 {
            Action::a(GOOD, 60)
        } else {
            Action::a(Ipv4Addr::new(10, 0, 0, 2), 60).after(Duration::from_millis(1500))
        }
    })
    .unwrap();
    let agent = agent(
        &upstream,
        &cache_for(3, "        serve_stale 1h verify 300ms"),
    );
    let name = "verified.example.";
    let cached = Instant::now();
    assert_eq!(a_addrs(&ask(&agent, name)), [GOOD]);
    sleep_until(cached + Duration::from_millis(3500));
    let sent = Instant::now();
    let reply = ask(&agent, name);
    let waited = sent.elapsed();
    assert_stale(&reply, "after the verify timeout");
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_millis(1200),
        "answered after the 300 ms timeout, not the upstream's 1.5 s: {waited:?}"
    );
    // The fetch went on and stored its answer. (The slow exchange may have been hedged on
    // another connection: one query more at the upstream, for the same fetch.)
    std::thread::sleep(Duration::from_millis(1500));
    let fetched = upstream.queries_for(name);
    assert!((2..=3).contains(&fetched), "one fetch: {fetched} queries");
    let reply = ask(&agent, name);
    assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 0, 0, 2)]);
    assert_ne!(answer_ttls(&reply), [30], "fresh, not stale");
    assert_eq!(
        upstream.queries_for(name),
        fetched,
        "the refreshed entry is a hit"
    );
}

#[test]
fn a_failure_recheck_answers_stale_without_asking_again_for_that_long() {
    let _turn = crate::shared();
    let failing = Arc::new(AtomicBool::new(false));
    let upstream = {
        let failing = failing.clone();
        Scripted::start(move |_, _| {
            if failing.load(Ordering::SeqCst) {
                Action::Rcode(ResponseCode::ServFail)
            } else {
                Action::a(GOOD, 60)
            }
        })
        .unwrap()
    };
    let agent = agent(&upstream, &cache("        serve_stale 1h verify 0 30s 3s"));
    let name = "recheck.example.";
    let cached = Instant::now();
    assert_eq!(a_addrs(&ask(&agent, name)), [GOOD]);
    failing.store(true, Ordering::SeqCst);
    sleep_until(cached + Duration::from_millis(1500));
    // The first stale query asks and fails; the next ones, for 3 s, do not ask.
    assert_stale(&ask(&agent, name), "the verify that failed");
    let failed = Instant::now();
    assert_eq!(upstream.queries_for(name), 2);
    for _ in 0..5 {
        assert_stale(&ask(&agent, name), "during the recheck");
    }
    assert!(
        failed.elapsed() < Duration::from_secs(2),
        "the test is in the recheck period"
    );
    assert_eq!(upstream.queries_for(name), 2, "the upstream was spared");
    // After it the upstream is asked again: it answers now, and that is the answer.
    failing.store(false, Ordering::SeqCst);
    sleep_until(failed + Duration::from_millis(3200));
    let reply = ask(&agent, name);
    assert_eq!(a_addrs(&reply), [GOOD]);
    assert_ne!(answer_ttls(&reply), [30], "fresh, not stale");
    assert_eq!(
        upstream.queries_for(name),
        3,
        "asked again after the recheck"
    );
}
