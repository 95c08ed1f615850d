//! Two micro-measurements of the cache, for `valgrind --tool=callgrind` and `/proc` (not timed
//! tests).
//!
//! `lookup_cost [LOOKUPS]`: stores 10,000 realistic entries (keys made by
//! `nodedns_wire::Query::key`, replies parsed by `nodedns_wire::Reply::parse`), then looks them up
//! round-robin `LOOKUPS` times (default 1,000,000) at one `now`, every lookup a fresh hit. The
//! instructions per lookup are the difference of two runs' totals over the lookups, which leaves
//! set-up and exit out:
//!
//! ```text
//! cargo build --release -p nodedns-cache --example lookup_cost
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/lookup_cost 0
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/lookup_cost 1000000
//! # (Ir of the second − Ir of the first) / 1,000,000
//! ```
//!
//! `lookup_cost flood [NAMES]`: a cache of the default capacity (16 MiB) takes `NAMES` (default
//! 1,000,000) unique names, as a random-subdomain flood would bring, then prints the process's
//! peak and current resident memory (`VmHWM`, `VmRSS`) beside the cache's own byte count: what
//! the cache really costs for what it charges.

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use nodedns_cache::{Cache, Lookup, Policy};
use nodedns_wire::Reply;

const ENTRIES: usize = 10_000;

/// Query and reply bytes for `name` A: NOERROR, one A record.
fn messages(name: &str) -> (Vec<u8>, Vec<u8>) {
    let name = Name::from_ascii(name).expect("valid name");
    let mut query = Message::query();
    query.add_query(Query::query(name.clone(), RecordType::A));
    let mut reply = Message::response(0x1234, OpCode::Query);
    reply.metadata.response_code = ResponseCode::NoError;
    reply.metadata.recursion_desired = true;
    reply.metadata.recursion_available = true;
    reply.add_query(Query::query(name.clone(), RecordType::A));
    let addr = Ipv4Addr::new(10, 1, 2, 3);
    reply.add_answer(Record::from_rdata(name, 300, RData::A(A(addr))));
    (
        query.to_vec().expect("encodes"),
        reply.to_vec().expect("encodes"),
    )
}

fn key_of(query: &[u8]) -> Vec<u8> {
    nodedns_wire::Query::parse(query)
        .expect("parses")
        .key()
        .as_bytes()
        .to_vec()
}

fn hits(lookups: usize) {
    let cache = Cache::new(Policy::default());
    let t0 = Instant::now();
    let keys: Vec<Vec<u8>> = (0..ENTRIES)
        .map(|i| {
            let (query, reply) = messages(&format!("svc-{i}.default.svc.cluster.local."));
            let key = key_of(&query);
            cache.store(&key, Reply::parse(&reply).expect("parses"), t0);
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

/// `VmHWM` and `VmRSS` of this process, in KiB.
fn memory_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("readable");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Where the 8 digits of the placeholder name `r00000000` start in `bytes` (every occurrence).
fn digit_offsets(bytes: &[u8]) -> Vec<usize> {
    bytes
        .windows(9)
        .enumerate()
        .filter(|(_, w)| *w == b"r00000000")
        .map(|(at, _)| at + 1)
        .collect()
}

fn patch(bytes: &mut [u8], offsets: &[usize], digits: &[u8; 8]) {
    for &at in offsets {
        bytes[at..at + 8].copy_from_slice(digits);
    }
}

fn flood(names: usize) {
    let policy = Policy::default();
    let capacity = policy.capacity_bytes;
    let cache = Cache::new(policy);
    let (mut query, mut reply) = messages("r00000000.flood.example.");
    let (in_query, in_reply) = (digit_offsets(&query), digit_offsets(&reply));
    let (_, before) = memory_kib();
    let t0 = Instant::now();
    for i in 0..names {
        let digits: [u8; 8] = format!("{:08}", i % 100_000_000)
            .into_bytes()
            .try_into()
            .expect("8 digits");
        patch(&mut query, &in_query, &digits);
        patch(&mut reply, &in_reply, &digits);
        let key = key_of(&query);
        cache.store(&key, Reply::parse(&reply).expect("parses"), t0);
    }
    let stats = cache.stats();
    let (peak, now) = memory_kib();
    println!(
        "{names} names into {capacity} bytes: {} entries, {} bytes charged, {} evictions",
        stats.success, stats.bytes, stats.evictions
    );
    println!(
        "RSS before {before} KiB; after: peak {peak} KiB, current {now} KiB \
         (peak − before: {} KiB; capacity {} KiB)",
        peak.saturating_sub(before),
        capacity / 1024
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("flood") => flood(args.next().map_or(1_000_000, |n| n.parse().expect("NAMES"))),
        Some(n) => hits(n.parse().expect("LOOKUPS is a number")),
        None => hits(1_000_000),
    }
}
