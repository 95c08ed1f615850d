//! Any packet a client can send: `Query::parse` never panics, and what it accepts round-trips
//! through the key and gets a well-formed error answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodedns_wire::{Key, Query, build_query, rcode, same_question, write_error, write_formerr};

fuzz_target!(|data: &[u8]| {
    let mut out = Vec::new();
    match Query::parse(data) {
        Ok(query) => {
            let key = query.key();
            assert_eq!(Key::from_bytes(key.as_bytes()).as_ref(), Some(&key));
            assert!(query.udp_limit() >= 512);
            let _ = (
                query.id(),
                query.rd(),
                query.cd(),
                query.qtype(),
                query.qclass(),
            );
            assert!(query.question().starts_with(query.qname()));

            write_error(&query, rcode::SERVFAIL.into(), &mut out);
            assert!(same_question(&out, data));

            // The upstream query for the key parses back to the same key.
            build_query(key.as_bytes(), query.id(), &mut out).expect("a parsed key is well-formed");
            let upstream = Query::parse(&out).expect("build_query writes a valid query");
            assert_eq!(upstream.key(), key);
        }
        Err(err) => {
            let answered = err
                .rcode()
                .is_some_and(|rcode| write_formerr(data, rcode, &mut out));
            assert_eq!(answered, err.rcode().is_some());
        }
    }
});
