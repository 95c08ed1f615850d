//! Property tests with hickory-proto as the oracle: messages hickory builds go through our
//! parsers and writers, and hickory decodes what comes out.

use std::net::{Ipv4Addr, Ipv6Addr};

use hickory_proto::op::{Message, MessageType, OpCode, Query as Question, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, MX, NS, PTR, SOA, SRV, TXT};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use proptest::prelude::*;

use crate::testutil::{decode, edns, encode};
use crate::{HEADER_LEN, Query, Reply, TtlRule, build_query, frame, same_question, write_error};
use crate::{Key, write_formerr};

/// Labels as text; `Name::from_labels` keeps their case.
type Labels = Vec<String>;

fn label() -> impl Strategy<Value = String> + Clone {
    "[a-zA-Z0-9][a-zA-Z0-9_-]{0,11}"
}

fn to_name(labels: &[String]) -> Name {
    Name::from_labels(labels.iter().map(|l| l.as_bytes())).expect("short labels make a name")
}

/// The wire form of a name, as written without compression.
fn wire(labels: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for label in labels {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out
}

/// The same labels with the case of each letter flipped where `flips` says so.
fn recase(labels: &[String], flips: &[bool]) -> Labels {
    let mut flips = flips.iter().cycle();
    labels
        .iter()
        .map(|l| {
            l.chars()
                .map(|c| {
                    if *flips.next().unwrap_or(&false) {
                        if c.is_ascii_uppercase() {
                            c.to_ascii_lowercase()
                        } else {
                            c.to_ascii_uppercase()
                        }
                    } else {
                        c
                    }
                })
                .collect()
        })
        .collect()
}

/// Names under one zone, so hickory compresses them against each other and the question.
fn names_under(zone: Labels) -> impl Strategy<Value = Name> + Clone {
    prop::collection::vec(label(), 0..3).prop_map(move |mut prefix| {
        prefix.extend(zone.iter().cloned());
        to_name(&prefix)
    })
}

fn rdata(zone: Labels) -> impl Strategy<Value = RData> {
    let name = names_under(zone);
    prop_oneof![
        any::<u32>().prop_map(|ip| RData::A(A(Ipv4Addr::from(ip)))),
        any::<u128>().prop_map(|ip| RData::AAAA(AAAA(Ipv6Addr::from(ip)))),
        name.clone().prop_map(|n| RData::CNAME(CNAME(n))),
        name.clone().prop_map(|n| RData::NS(NS(n))),
        name.clone().prop_map(|n| RData::PTR(PTR(n))),
        (any::<u16>(), name.clone()).prop_map(|(p, n)| RData::MX(MX::new(p, n))),
        (any::<u16>(), any::<u16>(), any::<u16>(), name.clone())
            .prop_map(|(p, w, port, n)| RData::SRV(SRV::new(p, w, port, n))),
        prop::collection::vec("[ -~]{0,20}", 1..3).prop_map(|t| RData::TXT(TXT::new(t))),
        (name.clone(), name, any::<u32>(), any::<u32>()).prop_map(|(m, r, serial, minimum)| {
            RData::SOA(SOA::new(m, r, serial, 3600, 600, 86400, minimum))
        }),
    ]
}

fn ttl() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..100_000, any::<u32>()]
}

fn records(zone: Labels, max: usize) -> impl Strategy<Value = Vec<Record>> {
    let record = (names_under(zone.clone()), ttl(), rdata(zone))
        .prop_map(|(owner, ttl, data)| Record::from_rdata(owner, ttl, data));
    prop::collection::vec(record, 0..max)
}

/// An upstream reply as hickory would send it, and the question's labels.
#[derive(Debug, Clone)]
struct Upstream {
    msg: Message,
    qname: Labels,
}

fn upstream() -> impl Strategy<Value = Upstream> {
    prop::collection::vec(label(), 1..4).prop_flat_map(|zone| {
        let qname = (prop::collection::vec(label(), 0..2), Just(zone.clone())).prop_map(
            |(mut prefix, zone)| {
                prefix.extend(zone);
                prefix
            },
        );
        (
            qname,
            any::<u16>(),
            prop::sample::select(vec![1u16, 28, 5, 33, 12, 16, 15, 255]),
            records(zone.clone(), 6),
            records(zone.clone(), 4),
            records(zone, 4),
            (
                0u8..=5,
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
            ),
            prop::option::of(any::<bool>()),
        )
            .prop_map(
                |(qname, id, qtype, answers, authorities, additionals, flags, opt)| {
                    let (rcode, aa, ad, tc, cd) = flags;
                    let mut msg = Message::new(id, MessageType::Response, OpCode::Query);
                    msg.metadata.authoritative = aa;
                    msg.metadata.recursion_desired = true;
                    msg.metadata.recursion_available = true;
                    msg.metadata.authentic_data = ad;
                    msg.metadata.truncation = tc;
                    msg.metadata.checking_disabled = cd;
                    msg.metadata.response_code = ResponseCode::from(0, rcode);
                    msg.add_query(Question::query(to_name(&qname), RecordType::from(qtype)));
                    msg.answers = answers;
                    msg.authorities = authorities;
                    msg.additionals = additionals;
                    if let Some(dnssec_ok) = opt {
                        msg.set_edns(edns(4096, dnssec_ok));
                    }
                    Upstream { msg, qname }
                },
            )
    })
}

/// A client query for the upstream's question, its name re-cased at random.
#[derive(Debug, Clone)]
struct Client {
    id: u16,
    rd: bool,
    flips: Vec<bool>,
    edns: Option<(u16, bool)>,
}

fn client() -> impl Strategy<Value = Client> {
    (
        any::<u16>(),
        any::<bool>(),
        prop::collection::vec(any::<bool>(), 1..16),
        prop::option::of((any::<u16>(), any::<bool>())),
    )
        .prop_map(|(id, rd, flips, edns)| Client {
            id,
            rd,
            flips,
            edns,
        })
}

fn client_query(upstream: &Upstream, client: &Client) -> (Message, Labels) {
    let labels = recase(&upstream.qname, &client.flips);
    let question = &upstream.msg.queries[0];
    let mut msg = Message::new(client.id, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = client.rd;
    msg.metadata.checking_disabled = upstream.msg.metadata.checking_disabled;
    msg.add_query(Question::query(to_name(&labels), question.query_type()));
    if let Some((size, dnssec_ok)) = client.edns {
        msg.set_edns(edns(size, dnssec_ok));
    }
    (msg, labels)
}

/// RFC 2181 §8, as `Info` applies it.
fn sane(ttl: u32) -> u32 {
    if ttl > i32::MAX as u32 { 0 } else { ttl }
}

/// `msg` with only its first `kept` records, counted in message order (answer, authority,
/// additional).
fn prefix(msg: &Message, kept: usize) -> Message {
    let mut cut = msg.clone();
    let answers = kept.min(cut.answers.len());
    cut.answers.truncate(answers);
    let authorities = (kept - answers).min(cut.authorities.len());
    cut.authorities.truncate(authorities);
    cut.additionals.truncate(kept - answers - authorities);
    cut
}

/// The size an answer must fit in.
#[derive(Debug, Clone)]
enum Limit {
    /// The client's UDP limit.
    Client,
    Bytes(usize),
    /// A size up to the whole answer's, so that every cut point is reached.
    Within(prop::sample::Index),
}

fn limit() -> impl Strategy<Value = Limit> {
    prop_oneof![
        1 => Just(Limit::Client),
        1 => Just(Limit::Bytes(65535)),
        1 => (0usize..2000).prop_map(Limit::Bytes),
        2 => any::<prop::sample::Index>().prop_map(Limit::Within),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn write_answer_matches_hickory(
        upstream in upstream(),
        client in client(),
        age in prop_oneof![0u32..1000, any::<u32>()],
        cap in prop_oneof![0u32..100_000, any::<u32>()],
        floor in prop_oneof![Just(0u32), 0u32..100],
        limit in limit(),
        relayed in any::<bool>(),
    ) {
        let original = &upstream.msg;
        let bytes = encode(original);
        let reply = Reply::parse(&bytes).unwrap();

        // Info agrees with the records hickory put in.
        let info = *reply.info();
        let all: Vec<&Record> = original.all_sections().collect();
        prop_assert_eq!(info.answers as usize, original.answers.len());
        prop_assert_eq!(info.min_ttl, all.iter().map(|r| sane(r.ttl)).min());
        let negative = original.authorities.iter().find_map(|r| match &r.data {
            RData::SOA(soa) => Some(sane(r.ttl).min(sane(soa.minimum))),
            _ => None,
        });
        prop_assert_eq!(info.negative_ttl, negative);
        prop_assert_eq!(info.rcode, u16::from(original.metadata.response_code));
        prop_assert_eq!(info.truncated, original.metadata.truncation);
        prop_assert_eq!(info.authentic_data, original.metadata.authentic_data);

        // The stored bytes are the reply as hickory encodes it without the OPT.
        let mut without_opt = original.clone();
        without_opt.edns = None;
        prop_assert_eq!(reply.bytes(), &encode(&without_opt)[..]);

        let (query_msg, _) = client_query(&upstream, &client);
        let query_bytes = encode(&query_msg);
        let query = Query::parse(&query_bytes).unwrap();
        prop_assert_eq!(Key::from_bytes(query.key().as_bytes()), Some(query.key()));
        let opt_len = if client.edns.is_some() { 11 } else { 0 };
        let limit = match limit {
            Limit::Client => query.udp_limit(),
            Limit::Bytes(n) => n,
            Limit::Within(at) => at.index(reply.bytes().len() + opt_len + 1),
        };
        let ttl = TtlRule { age, cap, floor };
        let mut out = Vec::new();
        if relayed {
            reply.write_relayed(&query, ttl, limit, &mut out);
        } else {
            reply.write_answer(&query, ttl, limit, &mut out);
        }
        let served = decode(&out);

        let cut = reply.bytes().len() + opt_len > limit;
        prop_assert_eq!(served.metadata.id, client.id);
        prop_assert_eq!(served.metadata.message_type, MessageType::Response);
        prop_assert_eq!(served.metadata.recursion_desired, client.rd);
        // AA: set on what the cache serves (as CoreDNS's cache does), the upstream's when relayed.
        prop_assert_eq!(
            served.metadata.authoritative,
            !relayed || original.metadata.authoritative
        );
        prop_assert_eq!(served.metadata.truncation, original.metadata.truncation || cut);
        prop_assert_eq!(served.metadata.recursion_available, original.metadata.recursion_available);
        prop_assert_eq!(served.metadata.authentic_data, original.metadata.authentic_data);
        prop_assert_eq!(served.metadata.checking_disabled, original.metadata.checking_disabled);
        prop_assert_eq!(served.metadata.response_code, original.metadata.response_code);
        // The question comes back byte for byte as the client sent it.
        prop_assert_eq!(&out[HEADER_LEN..HEADER_LEN + query.question().len()], query.question());
        prop_assert!(same_question(&out, &bytes));

        match (client.edns, &served.edns) {
            (None, None) => {}
            (Some((_, dnssec_ok)), Some(opt)) => {
                prop_assert_eq!(opt.max_payload(), crate::EDNS_UDP_SIZE);
                prop_assert_eq!(opt.version(), 0);
                prop_assert_eq!(opt.flags().dnssec_ok, dnssec_ok);
            }
            (asked, got) => prop_assert!(false, "OPT asked {:?}, got {:?}", asked, got),
        }

        // What is kept: the longest prefix of the records, in message order, that hickory's
        // own encoding of it (the reply without OPT, cut to that prefix) fits in the limit
        // beside the OPT; none at all if not even the question fits.
        let total = without_opt.answers.len() + without_opt.authorities.len()
            + without_opt.additionals.len();
        let kept = if cut {
            (0..total)
                .rev()
                .find(|&k| encode(&prefix(&without_opt, k)).len() + opt_len <= limit)
                .unwrap_or(0)
        } else {
            total
        };
        let expected = prefix(&without_opt, kept);
        prop_assert_eq!(out.len(), encode(&expected).len() + opt_len);
        let patch = |records: &[Record]| -> Vec<Record> {
            records
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.ttl = r.ttl.saturating_sub(age).min(cap).max(floor);
                    r
                })
                .collect()
        };
        prop_assert_eq!(served.answers, patch(&expected.answers));
        prop_assert_eq!(served.authorities, patch(&expected.authorities));
        prop_assert_eq!(served.additionals, patch(&expected.additionals));
        if cut && out.len() > limit {
            // Only the header and question (and OPT) are written beyond the limit.
            prop_assert_eq!(kept, 0);
        }
    }

    #[test]
    fn query_parse_agrees_with_hickory(
        labels in prop::collection::vec(label(), 0..5),
        id in any::<u16>(),
        rd in any::<bool>(),
        cd in any::<bool>(),
        qtype in any::<u16>(),
        qclass in prop::sample::select(vec![DNSClass::IN, DNSClass::CH, DNSClass::HS]),
        opt in prop::option::of((any::<u16>(), any::<bool>())),
    ) {
        let mut msg = Message::new(id, MessageType::Query, OpCode::Query);
        msg.metadata.recursion_desired = rd;
        msg.metadata.checking_disabled = cd;
        let mut question = Question::query(to_name(&labels), RecordType::from(qtype));
        question.set_query_class(qclass);
        msg.add_query(question);
        if let Some((size, dnssec_ok)) = opt {
            msg.set_edns(edns(size, dnssec_ok));
        }
        let bytes = encode(&msg);
        let query = Query::parse(&bytes).unwrap();
        // Hickory's own reading of the same bytes.
        let back = decode(&bytes);
        prop_assert_eq!(query.id(), back.metadata.id);
        prop_assert_eq!(query.rd(), back.metadata.recursion_desired);
        prop_assert_eq!(query.cd(), back.metadata.checking_disabled);
        prop_assert_eq!(query.qname(), &wire(&labels)[..]);
        prop_assert_eq!(query.qtype(), u16::from(back.queries[0].query_type()));
        prop_assert_eq!(query.qclass(), u16::from(back.queries[0].query_class()));
        let edns = query.edns();
        prop_assert_eq!(edns.map(|e| e.udp_size), back.edns.as_ref().map(|e| e.max_payload()));
        prop_assert_eq!(edns.map(|e| e.version), back.edns.as_ref().map(|e| e.version()));
        prop_assert_eq!(
            edns.map(|e| e.dnssec_ok),
            back.edns.as_ref().map(|e| e.flags().dnssec_ok)
        );
        let expected_limit = back
            .edns
            .as_ref()
            .map_or(512, |e| usize::from(e.max_payload()).clamp(512, 1232));
        prop_assert_eq!(query.udp_limit(), expected_limit);

        // The key: lowercased name, type, class, DO and CD.
        let key = query.key();
        let mut expected = wire(&labels).to_ascii_lowercase();
        expected.extend_from_slice(&qtype.to_be_bytes());
        expected.extend_from_slice(&u16::from(qclass).to_be_bytes());
        let dnssec_ok = opt.is_some_and(|(_, d)| d);
        expected.push(u8::from(dnssec_ok) | u8::from(cd) << 1);
        prop_assert_eq!(key.as_bytes(), &expected[..]);

        // The upstream query for that key asks hickory the same, lowercased.
        let mut upstream = Vec::new();
        build_query(key.as_bytes(), 99, &mut upstream).unwrap();
        let sent = decode(&upstream);
        prop_assert_eq!(&sent.queries[0].name().to_ascii(), &to_name(&labels).to_lowercase().to_ascii());
        prop_assert_eq!(sent.queries[0].query_type(), back.queries[0].query_type());
        prop_assert_eq!(sent.metadata.checking_disabled, cd);
        prop_assert_eq!(sent.edns.unwrap().flags().dnssec_ok, dnssec_ok);
        prop_assert_eq!(Query::parse(&upstream).unwrap().key(), key);

        // An error answer to it is what hickory expects of a response.
        let mut error = Vec::new();
        write_error(&query, 2, &mut error);
        let answered = decode(&error);
        prop_assert_eq!(answered.metadata.id, id);
        prop_assert_eq!(answered.metadata.response_code, ResponseCode::ServFail);
        prop_assert_eq!(&answered.queries, &back.queries);
        prop_assert_eq!(answered.edns.is_some(), opt.is_some());
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        exercise(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic(
        upstream in upstream(),
        client in client(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        for msg in [upstream.msg.clone(), client_query(&upstream, &client).0] {
            let mut bytes = encode(&msg);
            for (at, value) in &edits {
                let at = at.index(bytes.len());
                bytes[at] = *value;
            }
            exercise(&bytes);
            exercise(&bytes[..cut.index(bytes.len() + 1)]);
        }
    }
}

/// Runs every entry point on `bytes`; a panic fails the test. Also checks what holds for any
/// input: a parsed reply serves an answer that parses as a response to the query.
fn exercise(bytes: &[u8]) {
    let _ = frame::split(bytes);
    let _ = Key::from_bytes(bytes);
    let mut out = Vec::new();
    let _ = build_query(bytes, 1, &mut out);
    let _ = write_formerr(bytes, 16, &mut out);
    let _ = same_question(bytes, bytes);
    let query = Query::parse(bytes);
    if let Ok(query) = &query {
        let key = query.key();
        assert_eq!(Key::from_bytes(key.as_bytes()).as_ref(), Some(&key));
        let _ = (
            query.qname(),
            query.qtype(),
            query.qclass(),
            query.edns(),
            query.udp_limit(),
        );
        write_error(query, 2, &mut out);
        assert!(same_question(&out, bytes));
    }
    if let Ok(reply) = Reply::parse(bytes) {
        let fallback = encode(&crate::testutil::query_message(
            1,
            "example.com.",
            RecordType::A,
            Some((1232, true)),
        ));
        let query = query.unwrap_or_else(|_| Query::parse(&fallback).unwrap());
        for limit in [0, 512, 65535] {
            reply.write_answer(&query, TtlRule::fresh(7, 300), limit, &mut out);
            assert!(Reply::parse(&out).is_ok() || out.len() > 65535);
        }
    }
}

/// A query and the reply Knot DNS sent to it (the fuzz seed corpus, see its README).
macro_rules! knot {
    ($name:literal) => {
        (
            &include_bytes!(concat!("../fuzz/seeds/query_parse/", $name))[..],
            &include_bytes!(concat!("../fuzz/seeds/reply_parse/", $name))[..],
        )
    };
}

#[test]
fn knot_replies_are_served_as_hickory_reads_them() {
    let pairs = [
        knot!("a_edns_do_cookie"),
        knot!("aaaa_plain"),
        knot!("cname_edns"),
        knot!("srv_edns"),
        knot!("nxdomain_edns"),
        knot!("nodata_plain"),
        knot!("big_txt_udp512"),
        knot!("refused_edns"),
        knot!("soa_cd"),
    ];
    for (query_bytes, reply_bytes) in pairs {
        let query = Query::parse(query_bytes).unwrap();
        assert!(same_question(reply_bytes, query_bytes));
        let reply = Reply::parse(reply_bytes).unwrap();
        let mut out = Vec::new();
        reply.write_answer(
            &query,
            TtlRule::fresh(1, u32::MAX),
            query.udp_limit(),
            &mut out,
        );
        let original = decode(reply_bytes);
        let served = decode(&out);
        assert_eq!(served.metadata.id, query.id());
        assert_eq!(
            served.metadata.response_code,
            original.metadata.response_code
        );
        assert_eq!(served.metadata.truncation, original.metadata.truncation);
        assert_eq!(served.edns.is_some(), query.edns().is_some());
        assert_eq!(
            &out[HEADER_LEN..HEADER_LEN + query.question().len()],
            query.question()
        );
        let aged = |records: &[Record]| -> Vec<Record> {
            records
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.ttl = r.ttl.saturating_sub(1);
                    r
                })
                .collect()
        };
        assert_eq!(served.answers, aged(&original.answers));
        assert_eq!(served.authorities, aged(&original.authorities));
        assert_eq!(served.additionals, aged(&original.additionals));
    }
}

#[test]
fn knot_negative_answers_and_truncation_fill_info() {
    let (_, nxdomain) = knot!("nxdomain_edns");
    let info = *Reply::parse(nxdomain).unwrap().info();
    assert_eq!(info.rcode, 3);
    // The zone's SOA: TTL 30, MINIMUM 5.
    assert_eq!(info.negative_ttl, Some(5));

    let (_, nodata) = knot!("nodata_plain");
    let info = *Reply::parse(nodata).unwrap().info();
    assert_eq!(
        (info.rcode, info.answers, info.negative_ttl),
        (0, 0, Some(5))
    );

    let (_, cut) = knot!("big_txt_udp512");
    assert!(Reply::parse(cut).unwrap().info().truncated);
}

#[test]
fn knot_badvers_is_recognised_both_ways() {
    let (query, reply) = knot!("badvers");
    let err = Query::parse(query).unwrap_err();
    assert_eq!(err, crate::ParseError::BadVersion(1));
    assert_eq!(err.rcode(), Some(crate::rcode::BADVERS));
    assert_eq!(
        Reply::parse(reply).unwrap().info().rcode,
        crate::rcode::BADVERS
    );
    // What we would have answered carries the same extended RCODE.
    let mut ours = Vec::new();
    assert!(write_formerr(query, crate::rcode::BADVERS, &mut ours));
    let ours = decode(&ours);
    assert_eq!(
        u16::from(ours.metadata.response_code),
        crate::rcode::BADVERS
    );
    assert_eq!(ours.edns.map(|e| e.version()), Some(0));
}

#[test]
fn knot_reply_too_big_for_udp_is_cut_for_a_plain_client() {
    let (query, _) = knot!("big_txt_udp512");
    let whole = include_bytes!("../fuzz/seeds/reply_parse/big_txt_tcp");
    let reply = Reply::parse(whole).unwrap();
    let query = Query::parse(query).unwrap();
    let mut out = Vec::new();
    reply.write_answer(&query, TtlRule::fresh(0, 30), query.udp_limit(), &mut out);
    let served = decode(&out);
    assert!(served.metadata.truncation);
    assert!(served.answers.is_empty());
    reply.write_answer(&query, TtlRule::fresh(0, 30), 65535, &mut out);
    let served = decode(&out);
    assert!(!served.metadata.truncation);
    assert_eq!(served.answers.len(), 1);
}

#[test]
fn seed_streams_split_into_frames() {
    let stream = include_bytes!("../fuzz/seeds/frame_split/replies");
    let mut rest = &stream[..];
    let mut replies = 0;
    while let Ok(Some((message, consumed))) = frame::split(rest) {
        Reply::parse(message).unwrap();
        replies += 1;
        rest = &rest[consumed..];
    }
    assert_eq!((replies, rest.len()), (10, 0));

    let queries = include_bytes!("../fuzz/seeds/frame_split/two_queries_and_a_partial");
    let (first, used) = frame::split(queries).unwrap().unwrap();
    Query::parse(first).unwrap();
    let (second, used2) = frame::split(&queries[used..]).unwrap().unwrap();
    Query::parse(second).unwrap();
    assert_eq!(frame::split(&queries[used + used2..]), Ok(None));
}
