//! The AA bit, as node-cache sets it: on what its cache serves, never on what it relays. An
//! upstream that answers without AA (a forwarder, or a REFUSED/NOTIMP/FORMERR) is passed on
//! without it; the same answer served again from the cache has it.

use std::net::Ipv4Addr;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, Record, RecordType};
use nodedns_integration::Agent;
use nodedns_integration::client::{self, a_addrs};
use nodedns_integration::scripted::{self, Action, Scripted};

/// The upstream's reply to `query` with `rcode`, AA clear, and for NOERROR one A record.
fn not_authoritative(query: &Message, rcode: ResponseCode) -> Action {
    let mut reply = scripted::response(query, rcode);
    reply.metadata.authoritative = false;
    if rcode == ResponseCode::NoError {
        let name = query.queries[0].name().clone();
        let data = RData::A(Ipv4Addr::new(192, 0, 2, 7).into());
        reply.add_answer(Record::from_rdata(name, 60, data));
    }
    Action::Reply(reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_answers_keep_the_upstreams_aa_and_cached_ones_set_it() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| {
        let rcode = match client::qname(query).as_str() {
            "refused.test." => ResponseCode::Refused,
            "notimp.test." => ResponseCode::NotImp,
            "formerr.test." => ResponseCode::FormErr,
            _ => ResponseCode::NoError,
        };
        not_authoritative(query, rcode)
    })
    .unwrap();
    let agent = Agent::start(&[upstream.addr()]).expect("agent starts");

    // Not cacheable: every answer is relayed, AA as the upstream sent it (clear).
    for (name, rcode) in [
        ("refused.test.", ResponseCode::Refused),
        ("notimp.test.", ResponseCode::NotImp),
        ("formerr.test.", ResponseCode::FormErr),
    ] {
        for _ in 0..2 {
            let reply = client::udp(agent.addr(), &client::query(name, RecordType::A))
                .await
                .unwrap();
            assert_eq!(reply.metadata.response_code, rcode);
            assert!(!reply.metadata.authoritative, "{name}: {reply:?}");
        }
    }

    // Cacheable: the miss is relayed (AA clear), the hit comes from the cache (AA set).
    let name = "forwarded.test.";
    let miss = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&miss), [Ipv4Addr::new(192, 0, 2, 7)]);
    assert!(
        !miss.metadata.authoritative,
        "the miss is relayed: {miss:?}"
    );
    let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&hit), [Ipv4Addr::new(192, 0, 2, 7)]);
    assert!(
        hit.metadata.authoritative,
        "the hit is the cache's: {hit:?}"
    );
    assert_eq!(upstream.queries_for(name), 1, "the second answer was a hit");

    // The same over TCP, and for a real client.
    let hit = client::tcp(agent.addr(), &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert!(hit.metadata.authoritative);
    let out = client::dig(agent.addr(), &["refused.test.", "A"]).unwrap();
    assert_eq!(out.status, "REFUSED", "{}", out.raw);
    assert!(!out.has_flag("aa"), "{}", out.raw);
}
