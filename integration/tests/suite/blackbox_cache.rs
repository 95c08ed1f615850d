//! What the agent caches and for how long, seen from outside: positive answers for the record
//! TTL clamped to [5 s, 3600 s], denials for min(SOA TTL, SOA MINIMUM) clamped to [5 s, 1800 s],
//! upstream SERVFAIL for 5 s, truncated/REFUSED/FORMERR not at all; a hit's TTLs are the stored
//! ones minus the entry's age; cached answers have AA set.
//!
//! Upstream query counts are the proof of a hit: Knot's `mod-stats` counters, or the scripted
//! upstream's per-name counts. Waits appear only where elapsed time is what is tested; each is
//! bounded and says why.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use nodedns_integration::Agent;
use nodedns_integration::client::{self, a_addrs, answer_ttls, authority_ttls};
use nodedns_integration::knot;
use nodedns_integration::scripted::{Action, Scripted};

/// Sleeps until `at` (time itself is the subject of the calling test).
async fn sleep_until(at: Instant) {
    tokio::time::sleep(at.saturating_duration_since(Instant::now())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positive_answer_cached_and_ttl_decrements() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let name = "ttl300.default.svc.cluster.local.";
    let before = knot.queries().unwrap();

    let sent = Instant::now();
    let miss = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    let stored = Instant::now();
    assert_eq!(miss.metadata.response_code, ResponseCode::NoError);
    assert_eq!(a_addrs(&miss), [Ipv4Addr::new(10, 96, 3, 0)]);
    let ttl = answer_ttls(&miss)[0];
    assert!((299..=300).contains(&ttl), "miss TTL {ttl}, record TTL 300");
    assert_eq!(
        knot.queries().unwrap(),
        before + 1,
        "the miss went upstream once"
    );

    // The TTL decrement is the subject: let two whole seconds pass.
    sleep_until(stored + Duration::from_millis(2100)).await;
    let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    let age_max = sent.elapsed().as_secs() + 1;
    assert_eq!(a_addrs(&hit), [Ipv4Addr::new(10, 96, 3, 0)]);
    assert!(hit.metadata.authoritative, "cached answers set AA");
    let ttl = answer_ttls(&hit)[0];
    assert!(
        ttl <= 298 && u64::from(ttl) >= 300 - age_max,
        "hit TTL {ttl} after more than 2 s in the cache (record TTL 300)"
    );

    // A real client sees the same: AA, the data, a decremented TTL.
    let out = client::dig(agent.addr(), &[name, "A"]).unwrap();
    assert_eq!(out.status, "NOERROR", "{}", out.raw);
    assert!(out.has_flag("aa"), "{}", out.raw);
    assert_eq!(out.answers.len(), 1, "{}", out.raw);
    assert_eq!(out.answers[0].data, "10.96.3.0");
    assert!(out.answers[0].ttl <= 298, "{}", out.raw);

    assert_eq!(knot.queries().unwrap(), before + 1, "hits never reach Knot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_below_floor_cached_for_five_seconds() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let name = "ttl1.default.svc.cluster.local.";
    let before = knot.queries().unwrap();

    let sent = Instant::now();
    let miss = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&miss), [Ipv4Addr::new(10, 96, 1, 1)]);
    assert_eq!(knot.queries().unwrap(), before + 1);

    // The record's own TTL (1 s) has run out, the 5 s floor has not.
    sleep_until(sent + Duration::from_millis(2500)).await;
    let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&hit), [Ipv4Addr::new(10, 96, 1, 1)]);
    assert!(
        answer_ttls(&hit)[0] <= 1,
        "a hit never advertises more than the record's TTL: {:?}",
        answer_ttls(&hit)
    );
    assert_eq!(
        knot.queries().unwrap(),
        before + 1,
        "a 1 s record is kept for the 5 s floor"
    );

    // Past the floor (plus a second of slack), the entry is gone.
    sleep_until(sent + Duration::from_millis(6200)).await;
    let again = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&again), [Ipv4Addr::new(10, 96, 1, 1)]);
    assert_eq!(
        knot.queries().unwrap(),
        before + 2,
        "expired after the 5 s floor"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_above_cap_advertised_at_most_one_hour() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let name = "ttl86400.default.svc.cluster.local.";
    let before = knot.queries().unwrap();

    client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&hit), [Ipv4Addr::new(10, 96, 86, 4)]);
    let ttl = answer_ttls(&hit)[0];
    assert!(
        (3590..=3600).contains(&ttl),
        "a cached 86400 s record is kept (and advertised) for at most 3600 s, got {ttl}"
    );
    assert_eq!(knot.queries().unwrap(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nxdomain_cached_for_soa_minimum() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let name = "missing.default.svc.cluster.local.";
    let before = knot.queries().unwrap();

    let miss = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(miss.metadata.response_code, ResponseCode::NXDomain);
    assert!(miss.answers.is_empty());
    assert_eq!(
        authority_ttls(&miss).len(),
        1,
        "the SOA comes back: {miss:?}"
    );

    let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(hit.metadata.response_code, ResponseCode::NXDomain);
    assert!(hit.metadata.authoritative, "cached answers set AA");
    assert_eq!(hit.authorities.len(), 1, "{hit:?}");
    assert_eq!(hit.authorities[0].record_type(), RecordType::SOA);
    let ttl = hit.authorities[0].ttl;
    assert!(
        ttl <= knot::NEGATIVE_TTL && ttl + 2 >= knot::NEGATIVE_TTL,
        "SOA TTL {ttl}: min(SOA TTL 30, MINIMUM 60) minus a moment"
    );

    let out = client::kdig(agent.addr(), &[name, "A"]).unwrap();
    assert_eq!(out.status, "NXDOMAIN", "{}", out.raw);
    assert!(out.has_flag("aa"), "{}", out.raw);

    assert_eq!(knot.queries().unwrap(), before + 1, "denials are cached");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodata_cached() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    // kubernetes.default.svc has an A record and no AAAA: NOERROR with an empty answer.
    let name = "kubernetes.default.svc.cluster.local.";
    let before = knot.queries().unwrap();

    let miss = client::udp(agent.addr(), &client::query(name, RecordType::AAAA))
        .await
        .unwrap();
    assert_eq!(miss.metadata.response_code, ResponseCode::NoError);
    assert!(miss.answers.is_empty());

    let hit = client::udp(agent.addr(), &client::query(name, RecordType::AAAA))
        .await
        .unwrap();
    assert_eq!(hit.metadata.response_code, ResponseCode::NoError);
    assert!(hit.answers.is_empty());
    assert!(hit.metadata.authoritative);
    assert_eq!(hit.authorities.len(), 1, "{hit:?}");
    assert!(hit.authorities[0].ttl <= knot::NEGATIVE_TTL);

    let out = client::dig(agent.addr(), &[name, "AAAA"]).unwrap();
    assert_eq!(out.status, "NOERROR", "{}", out.raw);
    assert!(out.answers.is_empty(), "{}", out.raw);
    assert_eq!(knot.queries().unwrap(), before + 1, "NODATA is cached");

    // The A record of the same name is another key: it goes upstream and is answered.
    let a = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&a), [Ipv4Addr::new(10, 96, 0, 1)]);
    assert_eq!(knot.queries().unwrap(), before + 2);
}

/// The scripted upstream hands out denials whose SOA TTL and MINIMUM differ, so the lifetime
/// shows which of the two the agent used: RFC 2308 §5 says the smaller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_ttl_is_min_of_soa_ttl_and_minimum_with_five_second_floor() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| match client::qname(query).as_str() {
        "small-minimum.test." => Action::NxDomain {
            soa_ttl: 60,
            minimum: 6,
        },
        "small-ttl.test." => Action::NxDomain {
            soa_ttl: 6,
            minimum: 60,
        },
        "below-floor.test." => Action::NxDomain {
            soa_ttl: 1,
            minimum: 1,
        },
        _ => Action::a(Ipv4Addr::new(192, 0, 2, 1), 30),
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");
    let names = [
        "small-minimum.test.",
        "small-ttl.test.",
        "below-floor.test.",
    ];

    let sent = Instant::now();
    for name in names {
        let reply = client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NXDomain,
            "{name}"
        );
    }

    // 3 s in: every entry is still fresh (6 s, 6 s, and 1 s raised to 5 s).
    sleep_until(sent + Duration::from_secs(3)).await;
    for name in names {
        let reply = client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NXDomain,
            "{name}"
        );
        let ttl = authority_ttls(&reply);
        assert!(
            ttl.len() == 1 && ttl[0] <= 6,
            "{name}: the SOA never advertises longer than the entry lives: {ttl:?}"
        );
        assert_eq!(upstream.queries_for(name), 1, "{name} cached at 3 s");
    }

    // 7.2 s in: all three have expired (lifetimes 6 s, 6 s and 5 s, plus slack).
    sleep_until(sent + Duration::from_millis(7200)).await;
    for name in names {
        client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert_eq!(upstream.queries_for(name), 2, "{name} expired by 7 s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servfail_from_upstream_cached_briefly() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| match client::qname(query).as_str() {
        "broken.test." => Action::Rcode(ResponseCode::ServFail),
        _ => Action::a(Ipv4Addr::new(192, 0, 2, 1), 30),
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");
    let query = || client::query("broken.test.", RecordType::A);

    let sent = Instant::now();
    let first = client::udp(agent.addr(), &query()).await.unwrap();
    assert_eq!(first.metadata.response_code, ResponseCode::ServFail);
    let second = client::udp(agent.addr(), &query()).await.unwrap();
    assert_eq!(second.metadata.response_code, ResponseCode::ServFail);
    assert_eq!(
        upstream.queries_for("broken.test."),
        1,
        "an upstream SERVFAIL is cached"
    );

    // The SERVFAIL entry lives 5 s; ask again after it (plus slack).
    sleep_until(sent + Duration::from_millis(6000)).await;
    let third = client::udp(agent.addr(), &query()).await.unwrap();
    assert_eq!(third.metadata.response_code, ResponseCode::ServFail);
    assert_eq!(upstream.queries_for("broken.test."), 2, "... for 5 s only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_formerr_and_truncated_from_upstream_not_cached() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| match client::qname(query).as_str() {
        "refused.test." => Action::Rcode(ResponseCode::Refused),
        "formerr.test." => Action::Rcode(ResponseCode::FormErr),
        "truncated.test." => Action::Truncated,
        _ => Action::a(Ipv4Addr::new(192, 0, 2, 1), 30),
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    for name in ["refused.test.", "formerr.test.", "truncated.test."] {
        let first = client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        let after_first = upstream.queries_for(name);
        assert!(after_first >= 1, "{name} went upstream");
        let second = client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert!(
            upstream.queries_for(name) > after_first,
            "{name}: not cached, so the second query goes upstream again \
             (answers: {:?} then {:?})",
            first.metadata.response_code,
            second.metadata.response_code
        );
    }

    // Service goes on for names that do answer.
    let ok = client::udp(agent.addr(), &client::query("fine.test.", RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&ok), [Ipv4Addr::new(192, 0, 2, 1)]);
}
