//! The instruction cost of one cache hit, for `valgrind --tool=callgrind` (not a timed test).
//!
//! Stores `ENTRIES` realistic replies (keys made by `nodedns_wire::Query::key`, replies parsed by
//! `nodedns_wire::Reply::parse`), then looks them up round-robin `LOOKUPS` times (the first
//! argument, default 1,000,000) at one `now`, every lookup a fresh hit. The cost per lookup is
//! the difference of two runs' totals divided by the lookups, which leaves out set-up and exit:
//!
//! ```text
//! cargo build --release -p nodedns-cache --example lookup_cost
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/lookup_cost 0
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/lookup_cost 1000000
//! # (Ir of the second − Ir of the first) / 1,000,000
//! ```

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use nodedns_cache::{Cache, Lookup, Policy};
use nodedns_wire::Reply;

const ENTRIES: usize = 10_000;

/// The wire key of `name` A and a NOERROR reply with one A record.
fn entry(name: &str, i: usize) -> (Vec<u8>, Reply) {
    let name = Name::from_ascii(name).expect("valid name");
    let mut query = Message::query();
    query.add_query(Query::query(name.clone(), RecordType::A));
    let query_bytes = query.to_vec().expect("encodes");
    let key = nodedns_wire::Query::parse(&query_bytes)
        .expect("parses")
        .key()
        .as_bytes()
        .to_vec();
    let mut msg = Message::response(0x1234, OpCode::Query);
    msg.metadata.response_code = ResponseCode::NoError;
    msg.metadata.recursion_desired = true;
    msg.metadata.recursion_available = true;
    msg.add_query(Query::query(name.clone(), RecordType::A));
    let addr = Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8);
    msg.add_answer(Record::from_rdata(name, 300, RData::A(A(addr))));
    let reply = Reply::parse(&msg.to_vec().expect("encodes")).expect("parses");
    (key, reply)
}

fn main() {
    let lookups: usize = std::env::args()
        .nth(1)
        .map_or(1_000_000, |n| n.parse().expect("LOOKUPS is a number"));
    let cache = Cache::new(Policy::default());
    let t0 = Instant::now();
    let keys: Vec<Vec<u8>> = (0..ENTRIES)
        .map(|i| {
            let (key, reply) = entry(&format!("svc-{i}.default.svc.cluster.local."), i);
            cache.insert(&key, reply, t0);
            key
        })
        .collect();
    let now = t0 + Duration::from_secs(1);
    let mut fresh = 0usize;
    for i in 0..lookups {
        let key = &keys[i % ENTRIES];
        fresh += usize::from(matches!(
            black_box(cache.lookup(black_box(key), now)),
            Lookup::Fresh { .. }
        ));
    }
    let stats = cache.stats();
    println!(
        "{lookups} lookups, {fresh} fresh; {} entries, {} bytes",
        stats.success, stats.bytes
    );
    assert_eq!(fresh, lookups, "every lookup should hit");
}
