//! Zone transfers through the agent, against a real Knot that serves them: AXFR and IXFR are
//! answered REFUSED at once, over UDP and TCP, never forwarded and never cached, as unbound
//! answers them. (node-cache, CoreDNS 1.10, forwards an AXFR as one exchange: the client gets the
//! first of the transfer's messages and waits for the rest until it times out, 5 s with `kdig`;
//! that first message is cached and served again over UDP. Issue 12, finding 5.)

use std::time::{Duration, Instant};

use hickory_proto::op::{MessageType, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::knot::{Knot, Options, Zone};
use nodedns_integration::{Agent, client, have};

/// A zone whose transfer takes dozens of messages: 3,000 TXT records of 200 bytes.
fn big_zone() -> Zone {
    let mut body = String::from(
        "$TTL 300\n@ SOA ns hostmaster 1 7200 1800 86400 300\n@ NS ns\nns A 192.0.2.53\n\
         www A 192.0.2.80\n",
    );
    for i in 0..3000 {
        body.push_str(&format!("r{i} TXT \"{i:04}{}\"\n", "x".repeat(196)));
    }
    Zone {
        origin: "transfer.test.".to_owned(),
        body,
    }
}

/// A transfer query (AXFR, or IXFR with the serial `0` the client holds in the authority
/// section, RFC 1995 §3), encoded.
fn transfer(rtype: RecordType) -> hickory_proto::op::Message {
    let mut query = client::query("transfer.test.", rtype);
    if rtype == RecordType::IXFR {
        let soa = hickory_proto::rr::rdata::SOA::new(
            hickory_proto::rr::Name::from_ascii("ns.transfer.test.").unwrap(),
            hickory_proto::rr::Name::from_ascii("hostmaster.transfer.test.").unwrap(),
            0,
            7200,
            1800,
            86400,
            300,
        );
        query.add_authority(hickory_proto::rr::Record::from_rdata(
            hickory_proto::rr::Name::from_ascii("transfer.test.").unwrap(),
            300,
            hickory_proto::rr::RData::SOA(soa),
        ));
    }
    query
}

/// `kdig +stat AXFR transfer.test.` at `server`: what it printed (standard output and error).
fn kdig_axfr(server: std::net::SocketAddr) -> String {
    let out = std::process::Command::new("kdig")
        .arg(format!("@{}", server.ip()))
        .args(["-p", &server.port().to_string(), "+time=5", "+stat"])
        .args(["transfer.test.", "AXFR"])
        .output()
        .expect("run kdig");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn zone_transfers_are_refused_at_once_never_forwarded_and_never_cached() {
    let _turn = crate::shared();
    if !have("knotd") || !have("kdig") {
        eprintln!("skipped: needs knotd and kdig (Debian packages knot, knot-dnsutils)");
        return;
    }
    let knot = Knot::start(Options {
        zones: vec![big_zone()],
        ..Options::default()
    })
    .expect("knotd starts");
    // Knot serves the transfer: many messages.
    let direct = kdig_axfr(knot.addr());
    let messages = direct
        .lines()
        .find_map(|l| {
            l.split_once(" B (")?
                .1
                .split_once(" messages")?
                .0
                .parse::<u32>()
                .ok()
        })
        .expect("kdig's summary line");
    assert!(
        messages > 10,
        "Knot sent the transfer in {messages} messages"
    );

    let agent = Agent::start(&[knot.addr()]).expect("agent starts");
    let asked = knot.queries().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for round in 0..2 {
        for rtype in [RecordType::AXFR, RecordType::IXFR] {
            let query = transfer(rtype);
            let started = Instant::now();
            let over_tcp = runtime.block_on(client::tcp(agent.addr(), &query)).unwrap();
            let over_udp =
                client::udp_blocking(agent.addr(), &query, Duration::from_secs(2)).unwrap();
            let took = started.elapsed();
            for (transport, reply) in [("TCP", &over_tcp), ("UDP", &over_udp)] {
                assert_eq!(reply.metadata.message_type, MessageType::Response);
                assert_eq!(
                    reply.metadata.response_code,
                    ResponseCode::Refused,
                    "{rtype} over {transport} (round {round}): {} records",
                    reply.answers.len()
                );
                assert!(!reply.metadata.truncation, "{rtype} over {transport}: TC");
                assert!(
                    reply.answers.is_empty(),
                    "{rtype} over {transport}: records"
                );
            }
            assert!(took < Duration::from_secs(1), "{rtype}: {took:?}");
        }
    }
    // kdig, a real transfer client, is told at once too.
    let started = Instant::now();
    let through = kdig_axfr(agent.addr());
    assert!(
        through.contains("REFUSED"),
        "kdig through the agent: {through}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        knot.queries().unwrap(),
        asked,
        "no transfer query reached the upstream"
    );
    // The zone's names are still served.
    let www = client::udp_blocking(
        agent.addr(),
        &client::query("www.transfer.test.", RecordType::A),
        Duration::from_secs(2),
    )
    .unwrap();
    assert_eq!(
        client::a_addrs(&www),
        [std::net::Ipv4Addr::new(192, 0, 2, 80)]
    );
}
