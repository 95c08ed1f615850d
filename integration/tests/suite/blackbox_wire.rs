//! The shape of the agent's answers, seen from outside: the client's name case echoed, OPT only
//! when asked (advertising 1232), truncation to the client's UDP limit with the full answer over
//! TCP, pipelined TCP queries each answered under its own ID, and garbage that never stops
//! service (answered FORMERR/NOTIMP where the wire rules say, dropped where they say).

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::Agent;
use nodedns_integration::client::{self, a_addrs};
use nodedns_integration::knot::{self, Knot};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn start() -> Option<(Knot, Agent)> {
    let knot = knot::cluster_local_or_skip()?;
    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    Some((knot, agent))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_case_echoed() {
    let _turn = crate::shared();
    let Some((knot, agent)) = start() else { return };
    let before = knot.queries().unwrap();

    let mixed = "KuBeRnEtEs.DeFaUlT.sVc.ClUsTeR.lOcAl.";
    let miss = client::udp(agent.addr(), &client::query(mixed, RecordType::A))
        .await
        .unwrap();
    assert_eq!(client::qname(&miss), mixed, "miss echoes the case as sent");
    assert_eq!(a_addrs(&miss), [Ipv4Addr::new(10, 96, 0, 1)]);

    // Another casing of the same name is the same cache entry, answered in its own case.
    for name in [
        "KUBERNETES.DEFAULT.SVC.CLUSTER.LOCAL.",
        "kubernetes.default.svc.cluster.local.",
        "kUBERNETES.default.SVC.cluster.LOCAL.",
    ] {
        let hit = client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert_eq!(client::qname(&hit), name);
        assert_eq!(a_addrs(&hit), [Ipv4Addr::new(10, 96, 0, 1)]);
        let hit = client::tcp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
        assert_eq!(client::qname(&hit), name, "over TCP too");
    }
    assert_eq!(
        knot.queries().unwrap(),
        before + 1,
        "the cache key ignores case (RFC 4343)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edns_only_when_asked() {
    let _turn = crate::shared();
    let Some((_knot, agent)) = start() else {
        return;
    };
    let name = "web.default.svc.cluster.local.";

    // Miss without OPT, hits with and without; then the other way round for another name.
    for name in [name, "kube-dns.kube-system.svc.cluster.local."] {
        for edns in [None, Some(4096), None, Some(512), Some(1232)] {
            let query = match edns {
                None => client::query(name, RecordType::A),
                Some(size) => client::query_edns(name, RecordType::A, size),
            };
            let reply = client::udp(agent.addr(), &query).await.unwrap();
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
            match edns {
                None => assert!(reply.edns.is_none(), "no OPT asked, none given: {reply:?}"),
                Some(_) => {
                    let opt = reply.edns.as_ref().expect("OPT asked, OPT given");
                    assert_eq!(opt.max_payload(), 1232, "the agent advertises 1232");
                    assert_eq!(opt.version(), 0);
                }
            }
        }
    }

    let out = client::dig(agent.addr(), &["+noedns", name, "A"]).unwrap();
    assert_eq!(out.edns_udp, None, "{}", out.raw);
    let out = client::dig(agent.addr(), &["+edns=0", "+bufsize=4096", name, "A"]).unwrap();
    assert_eq!(out.edns_udp, Some(1232), "{}", out.raw);
    let out = client::kdig(agent.addr(), &["+edns=0", "+bufsize=4096", name, "A"]).unwrap();
    assert_eq!(out.edns_udp, Some(1232), "{}", out.raw);
    let out = client::kdig(agent.addr(), &["+noedns", name, "A"]).unwrap();
    assert_eq!(out.edns_udp, None, "{}", out.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn id_rd_and_do_echoed_on_misses_and_hits() {
    let _turn = crate::shared();
    let Some((_knot, agent)) = start() else {
        return;
    };
    let name = "kube-dns.kube-system.svc.cluster.local.";

    // Miss, then hits, alternating RD and DO: each answer carries the flags of its own query.
    for (i, (rd, dnssec_ok)) in [(true, false), (false, false), (true, true), (false, true)]
        .into_iter()
        .cycle()
        .take(8)
        .enumerate()
    {
        let mut query = client::query_edns(name, RecordType::A, 1232);
        query.metadata.id = 0x2000 + i as u16;
        query.metadata.recursion_desired = rd;
        if let Some(edns) = query.edns.as_mut() {
            edns.set_dnssec_ok(dnssec_ok);
        }
        let reply = client::udp(agent.addr(), &query).await.unwrap();
        assert_eq!(reply.metadata.id, 0x2000 + i as u16);
        assert_eq!(reply.metadata.recursion_desired, rd, "query {i}: RD echoed");
        assert_eq!(
            reply.edns.as_ref().map(|e| e.flags().dnssec_ok),
            Some(dnssec_ok),
            "query {i}: DO echoed"
        );
        assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 0, 10)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_answer_truncated_over_udp_and_complete_over_tcp() {
    let _turn = crate::shared();
    let Some((_knot, agent)) = start() else {
        return;
    };
    let big = "big.default.svc.cluster.local.";
    let huge = "huge.default.svc.cluster.local.";
    let big_records = usize::from(knot::BIG_RECORDS);

    // No EDNS: 512 bytes at most, so TC. (The first query is a miss, the second a hit.)
    for _ in 0..2 {
        let bytes = client::udp_bytes(agent.addr(), &client::query(big, RecordType::A))
            .await
            .unwrap();
        let reply = client::decode(&bytes).unwrap();
        assert!(bytes.len() <= 512, "{} bytes without EDNS", bytes.len());
        assert!(reply.metadata.truncation, "TC set: {reply:?}");
        assert_eq!(client::qname(&reply), big);
    }

    // An advertised size under 512 counts as 512.
    let bytes = client::udp_bytes(agent.addr(), &client::query_edns(big, RecordType::A, 256))
        .await
        .unwrap();
    assert!(bytes.len() <= 512);
    assert!(client::decode(&bytes).unwrap().metadata.truncation);

    // EDNS 1232: the ~1 kB answer fits.
    let bytes = client::udp_bytes(agent.addr(), &client::query_edns(big, RecordType::A, 1232))
        .await
        .unwrap();
    let reply = client::decode(&bytes).unwrap();
    assert!(!reply.metadata.truncation);
    assert!(bytes.len() <= 1232);
    assert_eq!(reply.answers.len(), big_records);

    // Over TCP: complete.
    let reply = client::tcp(agent.addr(), &client::query(big, RecordType::A))
        .await
        .unwrap();
    assert!(!reply.metadata.truncation);
    assert_eq!(reply.answers.len(), big_records);

    // Over 2 kB: truncated even for a client advertising 4096 (the agent sends at most 1232).
    let bytes = client::udp_bytes(
        agent.addr(),
        &client::query_edns(huge, RecordType::TXT, 4096),
    )
    .await
    .unwrap();
    assert!(bytes.len() <= 1232, "{} bytes over UDP", bytes.len());
    assert!(client::decode(&bytes).unwrap().metadata.truncation);
    let reply = client::tcp(agent.addr(), &client::query(huge, RecordType::TXT))
        .await
        .unwrap();
    let strings = match &reply.answers[..] {
        [record] => match &record.data {
            RData::TXT(txt) => txt.txt_data.len(),
            other => panic!("not a TXT: {other:?}"),
        },
        other => panic!("one TXT record expected: {other:?}"),
    };
    assert_eq!(strings, knot::HUGE_STRINGS);

    // Real clients.
    let out = client::dig(agent.addr(), &["+ignore", "+noedns", big, "A"]).unwrap();
    assert!(out.has_flag("tc"), "{}", out.raw);
    let out = client::dig(agent.addr(), &[big, "A"]).unwrap();
    assert!(!out.has_flag("tc"), "{}", out.raw);
    assert_eq!(out.answers.len(), big_records, "{}", out.raw);
    let out = client::dig(agent.addr(), &["+tcp", huge, "TXT"]).unwrap();
    assert_eq!(out.answers.len(), 1, "{}", out.raw);
    // kdig retries over TCP by itself on TC.
    let out = client::kdig(agent.addr(), &[huge, "TXT"]).unwrap();
    assert_eq!(out.status, "NOERROR", "{}", out.raw);
    assert_eq!(out.answers.len(), 1, "{}", out.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_pipelined_answers_match_ids() {
    let _turn = crate::shared();
    let Some((_knot, agent)) = start() else {
        return;
    };

    // Some of these are hits (asked once before), the rest misses, so answers may come back in
    // any order (RFC 7766 §7); each must carry its own query's ID and question.
    let warm = ["web.default.svc.cluster.local.", "missing.cluster.local."];
    for name in warm {
        client::udp(agent.addr(), &client::query(name, RecordType::A))
            .await
            .unwrap();
    }
    let cases: Vec<(&str, RecordType)> = vec![
        ("web.default.svc.cluster.local.", RecordType::A),
        ("web.default.svc.cluster.local.", RecordType::AAAA),
        ("headless.default.svc.cluster.local.", RecordType::A),
        ("headless.default.svc.cluster.local.", RecordType::AAAA),
        (
            "_http._tcp.headless.default.svc.cluster.local.",
            RecordType::SRV,
        ),
        ("missing.cluster.local.", RecordType::A),
        ("kube-dns.kube-system.svc.cluster.local.", RecordType::A),
        (
            "_dns._udp.kube-dns.kube-system.svc.cluster.local.",
            RecordType::SRV,
        ),
        ("big.default.svc.cluster.local.", RecordType::A),
        ("ttl7.default.svc.cluster.local.", RecordType::A),
    ];
    let mut queries: Vec<Message> = Vec::new();
    for (i, (name, rtype)) in cases.iter().enumerate() {
        let mut query = client::query(name, *rtype);
        query.metadata.id = 0x4000 + i as u16;
        queries.push(query);
    }
    let replies = client::tcp_pipelined(agent.addr(), &queries).await.unwrap();
    let by_id: HashMap<u16, &Message> = replies.iter().map(|r| (r.metadata.id, r)).collect();
    assert_eq!(by_id.len(), queries.len(), "one reply per ID");

    for query in &queries {
        let reply = by_id[&query.metadata.id];
        assert_eq!(
            reply.queries, query.queries,
            "reply {} question",
            query.metadata.id
        );
        let (name, rtype) = (client::qname(query), query.queries[0].query_type());
        let expect_answers = match (name.as_str(), rtype) {
            ("missing.cluster.local.", _) => 0,
            ("big.default.svc.cluster.local.", _) => usize::from(knot::BIG_RECORDS),
            ("headless.default.svc.cluster.local.", _) => 3,
            ("_http._tcp.headless.default.svc.cluster.local.", _) => 3,
            _ => 1,
        };
        assert_eq!(
            reply.answers.len(),
            expect_answers,
            "{name} {rtype}: {reply:?}"
        );
        let rcode = if expect_answers == 0 {
            ResponseCode::NXDomain
        } else {
            ResponseCode::NoError
        };
        assert_eq!(reply.metadata.response_code, rcode, "{name} {rtype}");
        assert!(reply.answers.iter().all(|r| r.record_type() == rtype));
    }
    let web6 = by_id[&0x4001];
    assert!(
        matches!(&web6.answers[0].data, RData::AAAA(a) if a.0 == "fd00:10:96::1234".parse::<Ipv6Addr>().unwrap())
    );
}

/// A 12-byte query header: `id`, flags byte 2 = `flags`, RD set, QDCOUNT = `qdcount`.
fn header(id: u16, flags: u8, qdcount: u16) -> Vec<u8> {
    let mut h = id.to_be_bytes().to_vec();
    h.extend_from_slice(&[flags, 0x00]);
    h.extend_from_slice(&qdcount.to_be_bytes());
    h.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    h
}

/// Checks that `reply` is a response to ID `id` with RCODE `rcode`.
fn assert_error_reply(reply: &[u8], id: u16, rcode: u8, what: &str) {
    assert!(reply.len() >= 12, "{what}: reply too short: {reply:02x?}");
    assert_eq!(
        u16::from_be_bytes([reply[0], reply[1]]),
        id,
        "{what}: ID echoed"
    );
    assert_ne!(reply[2] & 0x80, 0, "{what}: QR set");
    assert_eq!(reply[3] & 0x0f, rcode, "{what}: RCODE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_udp_and_tcp_does_not_stop_service() {
    let _turn = crate::shared();
    let Some((_knot, mut agent)) = start() else {
        return;
    };
    let addr = agent.addr();
    let short = Duration::from_millis(300);

    // Question with QDCOUNT = 0: FORMERR (RFC 1035 §4.1.2; RFC 9619).
    let no_question = header(0x1001, 0x01, 0);
    // A name that is a compression pointer to itself: FORMERR.
    let mut pointer_loop = header(0x1002, 0x01, 1);
    pointer_loop.extend_from_slice(&[0xc0, 0x0c, 0x00, 0x01, 0x00, 0x01]);
    // A label running past the end of the packet: FORMERR.
    let mut runaway = header(0x1003, 0x01, 1);
    runaway.extend_from_slice(&[0x3f, b'a', b'b']);
    // Opcode STATUS (2) with a proper question: NOTIMP (RFC 1035 §4.1.1).
    let mut status = header(0x1004, 0x01 | (2 << 3), 1);
    status.extend_from_slice(&[3, b'w', b'e', b'b', 0, 0x00, 0x01, 0x00, 0x01]);
    // A response (QR=1): never answered, or two servers could bounce packets forever.
    let mut response = Message::response(0x1005, OpCode::Query);
    response.metadata.message_type = MessageType::Response;
    response.add_query(hickory_proto::op::Query::query(
        "web.default.svc.cluster.local.".parse().unwrap(),
        RecordType::A,
    ));
    let response = response.to_vec().unwrap();
    // Shorter than a header: nothing to answer to.
    let stub = vec![0x10, 0x06, 0x01, 0x00, 0x00];

    // UDP: random datagrams first (their replies, if any, are not examined).
    for _ in 0..200 {
        let mut junk = vec![0u8; rand::random_range(0..600)];
        rand::fill(&mut junk[..]);
        client::udp_exchange(addr, &junk, Duration::ZERO)
            .await
            .unwrap();
    }
    for (packet, id, rcode, what) in [
        (&no_question, 0x1001, 1, "QDCOUNT=0"),
        (&pointer_loop, 0x1002, 1, "pointer loop"),
        (&runaway, 0x1003, 1, "label past the end"),
        (&status, 0x1004, 4, "opcode STATUS"),
    ] {
        let reply = client::udp_exchange(addr, packet, Duration::from_secs(2))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: no UDP reply"));
        assert_error_reply(&reply, id, rcode, what);
    }
    for (packet, what) in [(&response, "QR=1"), (&stub, "short header")] {
        let reply = client::udp_exchange(addr, packet, short).await.unwrap();
        assert_eq!(reply, None, "{what} must not be answered");
    }

    // TCP: a connection that stalls inside a frame, held open throughout.
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled.write_all(&[0x00, 0x40, 0x12]).await.unwrap();
    // Random bytes, unframed; a zero-length frame; a frame of random bytes.
    for junk in [
        {
            let mut j = vec![0u8; 300];
            rand::fill(&mut j[..]);
            j
        },
        vec![0x00, 0x00],
        {
            let mut j = vec![0x00, 0x20];
            j.extend((0..32).map(|_| rand::random::<u8>()));
            j
        },
    ] {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        let _ = conn.write_all(&junk).await;
    }
    // Well-framed malformed queries get their error over TCP too.
    for (packet, id, rcode, what) in [
        (&no_question, 0x1001, 1, "QDCOUNT=0 over TCP"),
        (&pointer_loop, 0x1002, 1, "pointer loop over TCP"),
    ] {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        client::write_frame(&mut conn, packet).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(2), client::read_frame(&mut conn))
            .await
            .unwrap_or_else(|_| panic!("{what}: no reply"))
            .unwrap();
        assert_error_reply(&reply, id, rcode, what);
    }

    // Service goes on, over both transports, while the stalled connection is still open.
    let name = "kubernetes.default.svc.cluster.local.";
    let reply = client::udp(addr, &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 0, 1)]);
    let reply = client::tcp(addr, &client::query(name, RecordType::A))
        .await
        .unwrap();
    assert_eq!(a_addrs(&reply), [Ipv4Addr::new(10, 96, 0, 1)]);
    let out = client::dig(addr, &["web.default.svc.cluster.local.", "A"]).unwrap();
    assert_eq!(out.status, "NOERROR", "{}", out.raw);
    assert!(agent.alive(), "the agent survived the garbage");
    drop(stalled);
}
