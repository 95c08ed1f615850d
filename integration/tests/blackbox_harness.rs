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
