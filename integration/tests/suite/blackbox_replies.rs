//! Upstream replies nodedns cannot pass on as they came (issue 12, finding 6), from a scripted
//! upstream, through the real binary on loopback:
//!
//! - a reply that fails nodedns's reply parser (a record count past the records it carries) is
//!   answered SERVFAIL, counted in `nodedns_upstream_failures_total{error="unusable_reply"}` and
//!   logged by the `errors` directive, as the upstream's other failures are;
//! - a reply of 65535 bytes (the most a TCP message holds) from an upstream without EDNS, asked
//!   for by an EDNS client over TCP: answered whole, without an OPT record (there is no room for
//!   one, and TCP has no larger transport to retry on), rather than cut to an empty TC answer.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::rdata::TXT;
use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::client;
use nodedns_integration::scripted::{Action, Scripted};

use crate::hostile_clients::Agent;

/// One exchange over a new TCP connection: the reply's bytes, within 5 s.
fn tcp_bytes(server: SocketAddr, query: &Message) -> Vec<u8> {
    let mut stream = TcpStream::connect_timeout(&server, Duration::from_secs(2)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let query = query.to_vec().unwrap();
    let mut frame = (query.len() as u16).to_be_bytes().to_vec();
    frame.extend_from_slice(&query);
    stream.write_all(&frame).unwrap();
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).unwrap();
    let mut reply = vec![0; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut reply).unwrap();
    reply
}

/// `nodedns run --conf` with one block on the agent's address: `errors`, `cache`, forwarding to
/// `upstream` over TCP (as to CoreDNS: the scripted upstream cannot send a reply over UDP that
/// does not fit a datagram), its metrics on the agent's metrics address. The directory goes
/// last (the agent reloads when its Corefile disappears).
fn agent(upstream: SocketAddr) -> (nodedns_integration::TempDir, Agent) {
    let dir = nodedns_integration::TempDir::new("nodedns-replies").unwrap();
    let path = dir.path().join("Corefile");
    let agent = Agent::spawn(&[], |dns, metrics| {
        let corefile = format!(
            ".:{port} {{\n    bind {ip}\n    errors\n    cache 30\n    forward . {upstream} {{\n        force_tcp\n    }}\n    prometheus {metrics}\n}}\n",
            port = dns.port(),
            ip = dns.ip()
        );
        std::fs::write(&path, corefile).unwrap();
        vec!["--conf".to_owned(), path.display().to_string()]
    });
    (dir, agent)
}

#[test]
fn a_reply_nodedns_cannot_parse_is_answered_servfail_counted_and_logged() {
    let _turn = crate::shared();
    let upstream = Scripted::start(|query, _| {
        let address = Action::a(Ipv4Addr::new(192, 0, 2, 9), 300);
        if query.queries[0].name().to_ascii().starts_with("broken") {
            // ANCOUNT one more: the reply promises a record it does not carry.
            Action::Edit(Box::new(address), |reply| {
                let count = u16::from_be_bytes([reply[6], reply[7]]) + 1;
                reply[6..8].copy_from_slice(&count.to_be_bytes());
            })
        } else {
            address
        }
    })
    .unwrap();
    let (_dir, agent) = agent(upstream.addr());
    let ask = |name: &str| {
        client::udp_blocking(
            agent.dns,
            &client::query(name, RecordType::A),
            Duration::from_secs(5),
        )
        .unwrap()
    };
    assert_eq!(
        ask("fine.replies.test.").metadata.response_code,
        ResponseCode::NoError
    );
    for name in ["broken1.replies.test.", "broken2.replies.test."] {
        let reply = ask(name);
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::ServFail,
            "{name}"
        );
        assert!(reply.answers.is_empty());
        assert_eq!(upstream.queries_for(name), 1, "asked once, never cached");
    }
    let counted = agent.labelled(
        "nodedns_upstream_failures_total",
        "error=\"unusable_reply\"",
    );
    assert_eq!(counted, 2.0, "each unusable reply counted");
    // Logged as the `errors` directive logs the upstream's failures: once per 10 s per kind.
    let deadline = Instant::now() + Duration::from_secs(5);
    // (The record count past the records makes the reply's OPT read as an answer record: a
    // misplaced OPT.)
    let wanted = "unusable upstream reply: misplaced OPT record";
    while !agent.output().contains(wanted) {
        assert!(
            Instant::now() < deadline,
            "no log line saying why:\n{}",
            agent.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = agent.output();
    let lines: Vec<&str> = output.lines().filter(|l| l.contains(wanted)).collect();
    assert_eq!(lines.len(), 1, "the second is held back: {lines:#?}");
    assert!(lines[0].contains("broken1.replies.test"), "{}", lines[0]);
}

/// TXT strings whose one record makes the reply to `name` (compressed owner, no OPT) exactly
/// 65535 bytes: 12 for the header, the question, 12 for the record's owner pointer and fixed
/// fields, then the strings (one length byte each).
fn txt_filling_a_tcp_message(name: &str) -> Vec<String> {
    let question = name.len() + 1 + 4;
    let mut left = 65535 - 12 - question - 12;
    let mut strings = Vec::new();
    while left > 0 {
        let len = (left - 1).min(255);
        strings.push("x".repeat(len));
        left -= len + 1;
    }
    strings
}

#[test]
fn a_65535_byte_reply_without_opt_reaches_an_edns_client_over_tcp_whole() {
    let _turn = crate::shared();
    const NAME: &str = "huge.replies.test.";
    let upstream = Scripted::start(|query, _| {
        let name = query.queries[0].name().to_ascii();
        let strings = txt_filling_a_tcp_message(&name);
        Action::NoEdns(Box::new(Action::Answer {
            ttl: 300,
            data: vec![RData::TXT(TXT::new(strings))],
        }))
    })
    .unwrap();
    let edns_query = client::query_edns(NAME, RecordType::TXT, 1232);
    // What the upstream sends, as a client asking it directly sees it.
    let direct = tcp_bytes(upstream.addr(), &edns_query);
    assert_eq!(
        direct.len(),
        65535,
        "the upstream's reply fills a TCP message"
    );
    let direct = client::decode(&direct).unwrap();
    assert!(direct.edns.is_none(), "and carries no OPT");
    assert!(!direct.metadata.truncation);

    let (_dir, agent) = agent(upstream.addr());
    // The miss (relayed from the upstream), then the hit (served from the cache).
    for what in ["relayed", "cached"] {
        let bytes = tcp_bytes(agent.dns, &edns_query);
        let reply = client::decode(&bytes).unwrap();
        assert!(
            !reply.metadata.truncation,
            "{what}: TC over TCP leaves the client nowhere to retry ({} bytes, {} answers)",
            bytes.len(),
            reply.answers.len()
        );
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NoError,
            "{what}"
        );
        assert_eq!(reply.answers, direct.answers, "{what}: the whole answer");
        assert_eq!(bytes.len(), 65535, "{what}");
        assert!(reply.edns.is_none(), "{what}: no room for an OPT");
    }
    assert_eq!(
        upstream.queries_for(NAME),
        2,
        "the test's own, and one miss"
    );
    // A client without EDNS gets the same; over UDP an EDNS client still gets TC and an OPT.
    let plain = client::decode(&tcp_bytes(agent.dns, &client::query(NAME, RecordType::TXT)));
    assert_eq!(plain.unwrap().answers, direct.answers);
    let udp = client::udp_blocking(agent.dns, &edns_query, Duration::from_secs(5)).unwrap();
    assert!(udp.metadata.truncation);
    assert!(udp.edns.is_some());
}
