//! Several `forward` lines in one server block, against two real upstreams (Knot), as CoreDNS
//! chains them: each name goes to the first line, in file order, whose FROM holds it and whose
//! `except` names do not; `next NXDOMAIN` asks the next line that takes the name when the first
//! one's upstream answers NXDOMAIN, and when no later line takes it the query ends in SERVFAIL;
//! the answer that stands is cached, and counted under the upstream that gave it (`to`).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{
    Process, TempDir, client, free_port, have, http_get, spawn_with_corefile,
};

fn ask(process: &Process, server: SocketAddr, name: &str) -> Message {
    client::udp_blocking(
        server,
        &client::query(name, RecordType::A),
        Duration::from_secs(5),
    )
    .unwrap_or_else(|e| panic!("{name} A to {server}: {e:#}\n{}", process.output()))
}

/// The IPv4 addresses of `reply`'s answer section.
fn addresses(reply: &Message) -> Vec<Ipv4Addr> {
    reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

fn zone(origin: &str, records: &str) -> knot::Zone {
    knot::Zone {
        origin: origin.to_owned(),
        body: format!(
            "$TTL 30\n@ 30 IN SOA ns.{origin} hostmaster.{origin} 1 7200 1800 86400 30\n\
             @ 30 IN NS ns\nns 30 IN A 192.0.2.250\n{records}"
        ),
    }
}

/// A queries `knot` has received so far (its `. NS` health checks and readiness probes apart).
fn a_queries(knot: &Knot) -> u64 {
    knot.queries_of_type("A").expect("knotc stats")
}

#[test]
fn each_name_goes_to_its_forward_line_and_next_nxdomain_asks_the_following_one() {
    let _turn = crate::shared();
    if !have("knotd") {
        eprintln!("skipped: knotd not installed");
        return;
    }
    // The first line's upstream knows example.com only partly; the second's has the rest of
    // it, other names of its own for the same names, and example.org.
    let first = Knot::start(knot::Options {
        zones: vec![zone(
            "example.com.",
            "www 30 IN A 192.0.2.1\nonly-first 30 IN A 192.0.2.11\n",
        )],
        ..knot::Options::default()
    })
    .expect("the first knotd starts");
    let second = Knot::start(knot::Options {
        zones: vec![
            zone(
                "example.com.",
                "www 30 IN A 192.0.2.2\nonly-second 30 IN A 192.0.2.22\n\
                 x.internal 30 IN A 192.0.2.44\n",
            ),
            zone("example.org.", "www 30 IN A 192.0.2.3\n"),
        ],
        ..knot::Options::default()
    })
    .expect("the second knotd starts");
    let port = free_port().unwrap();
    let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let corefile = format!(
        ".:{port} {{
    bind 127.0.0.1
    cache 30
    forward example.com {first} {{
        except internal.example.com
        next NXDOMAIN
    }}
    forward . {second}
    prometheus {admin}
}}
example.net:{port} {{
    bind 127.0.0.1
    forward . {first} {{
        next REFUSED
    }}
    forward example.org {second}
}}
",
        first = first.addr(),
        second = second.addr(),
    );
    let dir = TempDir::new("nodedns-forward-lines").unwrap();
    let (mut process, _) = spawn_with_corefile(&dir, &corefile);
    process
        .wait_output("serving DNS", Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", process.output()));
    let agent = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let counts = || (a_queries(&first), a_queries(&second));
    let before = counts();

    // Both lines take www.example.com; the first in file order answers it.
    let r = ask(&process, agent, "www.example.com.");
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 1)]);
    assert_eq!(
        counts(),
        (before.0 + 1, before.1),
        "asked of the first only"
    );
    let r = ask(&process, agent, "only-first.example.com.");
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 11)]);

    // Not under the first line's FROM: the second line's, and the first never hears of it.
    let before = counts();
    let r = ask(&process, agent, "www.example.org.");
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 3)]);
    assert_eq!(counts(), (before.0, before.1 + 1));

    // Under an `except` name of the first line: passed on to the second, the first not asked.
    let before = counts();
    let r = ask(&process, agent, "x.internal.example.com.");
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 44)]);
    assert_eq!(counts(), (before.0, before.1 + 1));

    // The first upstream says NXDOMAIN: `next NXDOMAIN` asks the second line, whose answer
    // stands, and is cached: asked again, neither upstream hears of it.
    let before = counts();
    let r = ask(&process, agent, "only-second.example.com.");
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 22)]);
    assert_eq!(
        counts(),
        (before.0 + 1, before.1 + 1),
        "both asked, in order"
    );
    let r = ask(&process, agent, "only-second.example.com.");
    assert_eq!(addresses(&r), [Ipv4Addr::new(192, 0, 2, 22)]);
    assert_eq!(
        counts(),
        (before.0 + 1, before.1 + 1),
        "answered from the cache"
    );

    // NXDOMAIN from both: the second line's stands (it has no `next`).
    let before = counts();
    let r = ask(&process, agent, "nowhere.example.com.");
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(counts(), (before.0 + 1, before.1 + 1));

    // A reply passed on by `next` to lines none of which takes the name: SERVFAIL, as at the
    // end of CoreDNS's chain (the first upstream serves no example.net: REFUSED).
    let before = counts();
    let r = ask(&process, agent, "www.example.net.");
    assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
    assert_eq!(
        counts(),
        (before.0 + 1, before.1),
        "the second line does not take it"
    );

    // Each reply counted under the upstream that gave it, as CoreDNS labels them (`to`).
    let (status, metrics) = http_get(admin, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    let line = |to: SocketAddr, rcode: &str| {
        let prefix = format!("coredns_forward_responses_total{{rcode=\"{rcode}\",to=\"{to}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map(|n| n.trim().to_owned())
    };
    assert_eq!(
        line(first.addr(), "NXDOMAIN").as_deref(),
        Some("2"),
        "{metrics}"
    );
    assert_eq!(
        line(first.addr(), "NOERROR").as_deref(),
        Some("2"),
        "{metrics}"
    );
    assert_eq!(
        line(second.addr(), "NOERROR").as_deref(),
        Some("3"),
        "{metrics}"
    );
    assert_eq!(
        line(second.addr(), "NXDOMAIN").as_deref(),
        Some("1"),
        "{metrics}"
    );
}
