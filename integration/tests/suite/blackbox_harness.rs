//! The harness's own parts checked against real tools, before any agent is involved: if these
//! fail, a black-box failure says nothing about nodedns.

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::client;
use nodedns_integration::knot::{self, Knot, Options};

fn knot() -> Option<Knot> {
    if !nodedns_integration::have("knotd") {
        eprintln!("skipped: knotd is not installed (Debian package `knot`)");
        return None;
    }
    let options = Options {
        zones: vec![Knot::cluster_local()],
        ..Options::default()
    };
    Some(Knot::start(options).expect("knotd starts"))
}

#[tokio::test]
async fn knot_serves_cluster_local_and_counts_queries() {
    let _turn = crate::shared();
    let Some(knot) = knot() else { return };
    let before = knot.queries().unwrap();
    let before_tcp = knot.tcp_queries().unwrap();

    let reply = client::udp(
        knot.addr(),
        &client::query("kubernetes.default.svc.cluster.local.", RecordType::A),
    )
    .await
    .unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    assert!(reply.metadata.authoritative);
    assert_eq!(reply.answers.len(), 1);
    assert!(
        matches!(reply.answers[0].data, RData::A(a) if a.0 == std::net::Ipv4Addr::new(10, 96, 0, 1))
    );

    let reply = client::tcp(
        knot.addr(),
        &client::query("big.default.svc.cluster.local.", RecordType::A),
    )
    .await
    .unwrap();
    assert_eq!(reply.answers.len(), usize::from(knot::BIG_RECORDS));

    assert_eq!(knot.queries().unwrap(), before + 2);
    assert_eq!(knot.tcp_queries().unwrap(), before_tcp + 1);
}

#[test]
fn knot_negative_answers_carry_the_soa() {
    let _turn = crate::shared();
    let Some(knot) = knot() else { return };
    let out = client::dig(knot.addr(), &["nope.cluster.local.", "A"]).unwrap();
    assert_eq!(out.status, "NXDOMAIN", "{}", out.raw);
    assert_eq!(out.authority.len(), 1, "{}", out.raw);
    assert_eq!(out.authority[0].rtype, "SOA");
    assert_eq!(out.authority[0].ttl, knot::NEGATIVE_TTL);

    let out = client::kdig(
        knot.addr(),
        &["kubernetes.default.svc.cluster.local.", "AAAA"],
    )
    .unwrap();
    assert_eq!(out.status, "NOERROR", "{}", out.raw);
    assert!(out.answers.is_empty(), "{}", out.raw);
    assert!(out.has_flag("aa"), "{}", out.raw);
}

#[test]
fn knot_truncates_large_answers_over_udp() {
    let _turn = crate::shared();
    let Some(knot) = knot() else { return };
    let out = client::dig(
        knot.addr(),
        &["+ignore", "+noedns", "big.default.svc.cluster.local.", "A"],
    )
    .unwrap();
    assert!(out.has_flag("tc"), "{}", out.raw);
    assert_eq!(out.edns_udp, None, "{}", out.raw);
    let out = client::dig(
        knot.addr(),
        &["+tcp", "huge.default.svc.cluster.local.", "TXT"],
    )
    .unwrap();
    assert_eq!(out.answers.len(), 1, "{}", out.raw);
    assert_eq!(out.edns_udp, Some(1232), "{}", out.raw);
    let out = client::kdig(
        knot.addr(),
        &[
            "+edns=0",
            "+bufsize=1232",
            "+ignore",
            "huge.default.svc.cluster.local.",
            "TXT",
        ],
    )
    .unwrap();
    assert!(out.has_flag("tc"), "{}", out.raw);
    assert!(out.edns_udp.is_some(), "{}", out.raw);
}

#[tokio::test]
async fn scripted_upstream_follows_its_script_and_counts() {
    let _turn = crate::shared();
    use nodedns_integration::scripted::{Action, Options, Scripted};
    use std::time::{Duration, Instant};

    let upstream = Scripted::start_with(
        Options {
            close_after: Some(2),
        },
        |query, ctx| match client::qname(query).as_str() {
            "slow.test." => Action::a([192, 0, 2, 2].into(), 60).after(Duration::from_millis(300)),
            "fail.test." => Action::Rcode(ResponseCode::ServFail),
            "reset.test." if ctx.nth == 1 => Action::Reset,
            "tc.test." => Action::Truncated,
            "none.test." => Action::NxDomain {
                soa_ttl: 30,
                minimum: 60,
            },
            _ => Action::a([192, 0, 2, 1].into(), 60),
        },
    )
    .unwrap();
    let addr = upstream.addr();

    let reply = client::udp(addr, &client::query("Any.Test.", RecordType::A))
        .await
        .unwrap();
    assert_eq!(reply.answers.len(), 1);
    assert_eq!(client::qname(&reply), "Any.Test.");

    let started = Instant::now();
    let reply = client::tcp(addr, &client::query("slow.test.", RecordType::A))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(reply.answers.len(), 1);

    let reply = client::udp(addr, &client::query("fail.test.", RecordType::A))
        .await
        .unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
    let reply = client::udp(addr, &client::query("tc.test.", RecordType::A))
        .await
        .unwrap();
    assert!(reply.metadata.truncation);
    let reply = client::tcp(addr, &client::query("none.test.", RecordType::A))
        .await
        .unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(reply.authorities.len(), 1);

    // The first query for reset.test. gets a RST, the second an answer.
    let first = client::tcp(addr, &client::query("reset.test.", RecordType::A)).await;
    assert!(first.is_err(), "{first:?}");
    let second = client::tcp(addr, &client::query("reset.test.", RecordType::A))
        .await
        .unwrap();
    assert_eq!(second.answers.len(), 1);

    // close_after: 2 answers, then FIN, the third pipelined query goes unanswered.
    let queries: Vec<_> = ["a.test.", "b.test.", "c.test."]
        .iter()
        .map(|n| client::query(n, RecordType::A))
        .collect();
    assert!(client::tcp_pipelined(addr, &queries).await.is_err());

    assert_eq!(upstream.queries_for("reset.test"), 2);
    assert_eq!(upstream.queries_for("ANY.TEST."), 1);
    assert_eq!(upstream.udp_queries(), 3);
    // slow, none, reset x2, and a, b from the pipelined connection (c was never read).
    assert_eq!(upstream.tcp_queries(), 6);
    assert_eq!(upstream.connections(), 5);
    assert!(upstream.max_open_connections() >= 1);
}

#[test]
fn knot_counts_queries_by_type() {
    let _turn = crate::shared();
    let Some(knot) = knot() else { return };
    let (a, ns) = (
        knot.queries_of_type("A").unwrap(),
        knot.queries_of_type("NS").unwrap(),
    );
    client::kdig(knot.addr(), &["web.default.svc.cluster.local.", "A"]).unwrap();
    client::kdig(knot.addr(), &[".", "NS"]).unwrap();
    client::kdig(knot.addr(), &["web.default.svc.cluster.local.", "AAAA"]).unwrap();
    assert_eq!(knot.queries_of_type("A").unwrap(), a + 1);
    assert_eq!(knot.queries_of_type("NS").unwrap(), ns + 1);
}
