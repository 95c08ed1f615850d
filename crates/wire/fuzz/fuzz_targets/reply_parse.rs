//! Any reply an upstream can send: `Reply::parse` never panics, and a reply it accepts is served
//! (for a fixed query and for one asking its own question in another case) as a reply that
//! parses again, within the size limit unless it is only the header and question (and OPT).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodedns_wire::{Query, Reply, TtlRule};

/// `example.com. A`, RD, with an OPT (UDP size 1232, DO).
const QUERY: &[u8] = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x01\
\x07example\x03com\x00\x00\x01\x00\x01\
\x00\x00\x29\x04\xd0\x00\x00\x80\x00\x00\x00";

fuzz_target!(|data: &[u8]| {
    let Ok(reply) = Reply::parse(data) else {
        return;
    };
    let fixed = Query::parse(QUERY).expect("the fixed query parses");
    // A query for the reply's own question, upper-cased, without EDNS.
    let question = reply.question();
    let name_len = question.len().saturating_sub(4);
    let mut own = vec![0xAB, 0xCD, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    own.extend(question[..name_len].iter().map(u8::to_ascii_uppercase));
    own.extend_from_slice(&question[name_len..]);
    let own = Query::parse(&own).ok();

    let mut out = Vec::new();
    let queries = std::iter::once((fixed, false)).chain(own.map(|own| (own, true)));
    for (query, is_own) in queries {
        for limit in [0, 512, 1232, 65535] {
            for ttl in [TtlRule::STORED, TtlRule::fresh(30, 5), TtlRule::stale(30)] {
                if ttl == TtlRule::STORED {
                    reply.write_relayed(&query, ttl, limit, &mut out);
                } else {
                    reply.write_answer(&query, ttl, limit, &mut out);
                }
                // The bare minimum (header, question, OPT) is written even beyond `limit`; the
                // question is the reply's own when the query asks another name (the fixed one).
                let opt_len = if query.edns().is_some() { 11 } else { 0 };
                let bare = 12 + reply.question().len() + opt_len;
                assert!(
                    out.len() <= limit.max(bare),
                    "{} bytes for {limit}",
                    out.len()
                );
                let served = Reply::parse(&out);
                assert!(served.is_ok() || out.len() > 65535, "{served:?}");
                if let Ok(served) = served {
                    // The extended RCODE bits need an OPT: only a query with EDNS gets them.
                    let rcode = reply.info().rcode;
                    let expected = if query.edns().is_some() {
                        rcode
                    } else {
                        rcode & 0xF
                    };
                    assert_eq!(served.info().rcode, expected);
                    if is_own {
                        // 0x20: the question comes back exactly as the query asked it.
                        assert_eq!(served.question(), query.question());
                    }
                }
            }
        }
    }
});
