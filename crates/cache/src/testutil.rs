//! Replies and helpers the crate's tests share.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, SOA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use nodedns_wire::Reply;

use crate::{Cache, Class, Stored};

/// Stores `reply` under `key` at `now` and says how: the class it was kept as, or `None`
/// when it was not cacheable.
pub(crate) fn insert(cache: &Cache, key: &[u8], reply: Reply, now: Instant) -> Option<Class> {
    match cache.store(key, reply, now) {
        Stored::Entry(entry) => Some(entry.class()),
        Stored::NotCacheable(_) | Stored::Passed { .. } => None,
    }
}

/// An upstream reply to `name` A: `rcode`, one A record per TTL in `answers`, and an SOA
/// with (TTL, MINIMUM) in the authority section if `soa` is given.
pub(crate) fn reply(
    name: &str,
    rcode: ResponseCode,
    answers: &[u32],
    soa: Option<(u32, u32)>,
    truncated: bool,
) -> Reply {
    let name = Name::from_ascii(name).unwrap();
    let mut msg = Message::response(0x1234, OpCode::Query);
    msg.metadata.response_code = rcode;
    msg.metadata.truncation = truncated;
    msg.metadata.recursion_desired = true;
    msg.metadata.recursion_available = true;
    msg.add_query(Query::query(name.clone(), RecordType::A));
    for (i, ttl) in answers.iter().enumerate() {
        let addr = Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8);
        msg.add_answer(Record::from_rdata(name.clone(), *ttl, RData::A(A(addr))));
    }
    if let Some((ttl, minimum)) = soa {
        let zone = Name::from_ascii("example.").unwrap();
        let soa = SOA::new(
            Name::from_ascii("ns.example.").unwrap(),
            Name::from_ascii("hostmaster.example.").unwrap(),
            1,
            3600,
            600,
            86_400,
            minimum,
        );
        msg.add_authority(Record::from_rdata(zone, ttl, RData::SOA(soa)));
    }
    Reply::parse(&msg.to_vec().unwrap()).unwrap()
}

pub(crate) fn success(ttls: &[u32]) -> Reply {
    reply("www.example.", ResponseCode::NoError, ttls, None, false)
}

pub(crate) fn nxdomain(soa: Option<(u32, u32)>) -> Reply {
    reply("nx.example.", ResponseCode::NXDomain, &[], soa, false)
}

pub(crate) fn servfail() -> Reply {
    reply("www.example.", ResponseCode::ServFail, &[], None, false)
}

pub(crate) fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Serve-stale for `window`, answering with TTL `ttl`, in `verify` mode without a timeout,
/// no recheck period, no `prefer_positive`.
pub(crate) fn stale(window: Duration, ttl: u32) -> crate::Stale {
    crate::Stale {
        window,
        ttl,
        refresh: crate::Refresh::Verify { timeout: None },
        recheck: Duration::ZERO,
        prefer_positive: false,
    }
}
