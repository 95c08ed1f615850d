//! Per-client figures seen from outside: traffic from several loopback source addresses
//! (127.0.0.2, 127.0.0.3, … are all loopback on Linux) with known volumes, through a running
//! agent in front of Knot, ends in exact, ordered `nodedns_client_*` series; a flood of source
//! addresses asking random names leaves the number of series where it was; `nodedns top --once`
//! shows the same clients, heaviest first, and the names they ask.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use hickory_proto::serialize::binary::BinEncodable;
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{Agent, client, free_port, http_get, nodedns_bin};

/// Asks `name` from `source` and returns the answer's RCODE.
fn ask_from(source: Ipv4Addr, server: SocketAddr, name: &str) -> ResponseCode {
    let socket = UdpSocket::bind((source, 0)).expect("bind a loopback source");
    socket
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let query = client::query(name, RecordType::A);
    socket.send_to(&query.to_bytes().unwrap(), server).unwrap();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        assert!(
            Instant::now() < deadline,
            "no answer to {name} from {source}"
        );
        let (n, _) = socket.recv_from(&mut buf).expect("an answer");
        let reply = client::decode(&buf[..n]).unwrap();
        if reply.metadata.id == query.metadata.id {
            return reply.metadata.response_code;
        }
    }
}

/// An agent forwarding to `knot`, its /metrics on a free port, with `flags`.
fn agent(knot: &Knot, flags: &[&str]) -> (Agent, SocketAddr) {
    let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let mut args = vec![
        "--threads".to_owned(),
        "2".to_owned(),
        "--cluster-domain".to_owned(),
        "cluster.local".to_owned(),
        "--metrics-listen-address".to_owned(),
        admin.to_string(),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    let agent = Agent::start_with(&[knot.addr()], &args).expect("nodedns starts");
    (agent, admin)
}

fn metrics(admin: SocketAddr) -> String {
    let (status, body) = http_get(admin, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    body
}

/// The value of the series `name{client="client"}`.
fn value(text: &str, name: &str, client: &str) -> Option<f64> {
    let prefix = format!("{name}{{client=\"{client}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}

/// 30 queries from 127.0.0.2 (one name, hits after the first), 20 from 127.0.0.3 (a pod in
/// namespace `default` with ndots:5 resolving api.example.com five times: three search-path
/// NXDOMAINs, then the name itself, outside Knot's zone: REFUSED), 10 from 127.0.0.4.
fn known_volumes(dns: SocketAddr) {
    let (heavy, cascade, light) = (
        Ipv4Addr::new(127, 0, 0, 2),
        Ipv4Addr::new(127, 0, 0, 3),
        Ipv4Addr::new(127, 0, 0, 4),
    );
    for _ in 0..30 {
        let r = ask_from(heavy, dns, "kube-dns.kube-system.svc.cluster.local.");
        assert_eq!(r, ResponseCode::NoError);
    }
    for _ in 0..5 {
        for suffix in [
            "default.svc.cluster.local.",
            "svc.cluster.local.",
            "cluster.local.",
        ] {
            let r = ask_from(cascade, dns, &format!("api.example.com.{suffix}"));
            assert_eq!(r, ResponseCode::NXDomain);
        }
        assert_eq!(
            ask_from(cascade, dns, "api.example.com."),
            ResponseCode::Refused
        );
    }
    for _ in 0..10 {
        assert_eq!(
            ask_from(light, dns, "web.default.svc.cluster.local."),
            ResponseCode::NoError
        );
    }
}

#[test]
fn known_volumes_from_loopback_sources_end_in_exact_ordered_figures() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let (agent, admin) = agent(&knot, &["--clients-top", "3", "--clients-sample", "1"]);
    known_volumes(agent.addr());
    let text = metrics(admin);
    let rows: Vec<(&str, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("nodedns_client_queries_total{client=\""))
        .filter_map(|l| l.split_once("\"} "))
        .map(|(c, v)| (c, v.parse().unwrap()))
        .collect();
    // The start-up probes from 127.0.0.1 are fewer than 10: they are `other`.
    assert_eq!(
        &rows[..3],
        [
            ("127.0.0.2", 30.0),
            ("127.0.0.3", 20.0),
            ("127.0.0.4", 10.0)
        ],
        "{text}"
    );
    assert_eq!(rows[3].0, "other");
    let figure = |name: &str, client: &str| value(&text, name, client).unwrap_or(-1.0);
    assert_eq!(figure("nodedns_client_nxdomain_total", "127.0.0.3"), 15.0);
    assert_eq!(
        figure("nodedns_client_search_path_nxdomain_total", "127.0.0.3"),
        15.0
    );
    assert_eq!(figure("nodedns_client_nxdomain_total", "127.0.0.2"), 0.0);
    // Negative answers are cached, REFUSED is not: 4 × 3 hits of 20 lookups.
    assert_eq!(figure("nodedns_client_cache_hits_total", "127.0.0.3"), 12.0);
    assert_eq!(
        figure("nodedns_client_cache_requests_total", "127.0.0.3"),
        20.0
    );
    assert_eq!(figure("nodedns_client_cache_hits_total", "127.0.0.2"), 29.0);
    assert_eq!(figure("nodedns_client_cache_hits_total", "127.0.0.4"), 9.0);
    for line in [
        "nodedns_client_name_queries_total{client=\"127.0.0.2\",name=\"kube-dns.kube-system.svc.cluster.local.\"} 30",
        "nodedns_client_name_queries_total{client=\"127.0.0.3\",name=\"api.example.com.cluster.local.\"} 5",
        // Its misses: the first round's three expansions, and api.example.com. every round
        // (REFUSED is not cached): the zone it asks under most is example.com., one name.
        "nodedns_client_zone_distinct_names{client=\"127.0.0.3\",zone=\"example.com.\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    drop(agent);
}

#[test]
fn a_flood_of_source_addresses_keeps_the_series_count_fixed() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let (agent, admin) = agent(&knot, &["--clients-top", "3"]);
    let dns = agent.addr();
    let fixed = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("nodedns_client_") && !l.contains("name_queries"))
            .count()
    };
    let flood = |from: u32, to: u32| {
        for i in from..to {
            let source = Ipv4Addr::from(0x7f01_0000 | i);
            ask_from(source, dns, &format!("r{i:06x}.flood.cluster.local."));
        }
    };
    flood(0, 100);
    let first = fixed(&metrics(admin));
    flood(100, 600);
    let text = metrics(admin);
    assert_eq!(fixed(&text), first, "{text}");
    // 7 counter families of 3 clients and `other`, a distinct gauge per client, 3 signals.
    assert_eq!(first, 7 * 4 + 3 + 3, "{text}");
    let other = value(&text, "nodedns_client_queries_total", "other").unwrap();
    assert!(
        other >= 597.0,
        "every query but the top three's is `other`: {other}"
    );
    drop(agent);
}

#[test]
fn a_tunnel_of_random_names_crosses_the_threshold_once_and_says_so() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let (agent, admin) = agent(&knot, &["--clients-alert-random", "20"]);
    let dns = agent.addr();
    let tunnel = Ipv4Addr::new(127, 0, 0, 7);
    // Base32 of a counter, 32 labels' worth of bytes each: what a DNS tunnel sends.
    const BASE32: &[u8] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..50 {
        let label: String = (0..40)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                char::from(BASE32[(state % 32) as usize])
            })
            .collect();
        ask_from(tunnel, dns, &format!("{label}.t.cluster.local."));
    }
    let text = metrics(admin);
    let random = value(&text, "nodedns_client_random_names_total", "127.0.0.7").unwrap();
    assert!(random >= 45.0, "{random} of 50 random-looking\n{text}");
    assert!(
        text.contains("nodedns_client_alerts_total{signal=\"random_names\"} 1\n"),
        "{text}"
    );
    let distinct = text
        .lines()
        .find_map(|l| l.strip_prefix("nodedns_client_zone_distinct_names{client=\"127.0.0.7\",zone=\"t.cluster.local.\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .expect("the tunnel's zone");
    assert!(
        (35.0..=65.0).contains(&distinct),
        "{distinct} distinct of 50"
    );
    let output = agent.output();
    assert_eq!(
        output
            .matches("a client crossed an abuse threshold")
            .count(),
        1,
        "{output}"
    );
    assert!(output.contains("client=127.0.0.7"), "{output}");
}

/// Answers one scrape that arrives at `listener` with `admin`'s `/metrics`: `top` reads the
/// agent through the test, so the test knows when each of its two scrapes happens.
fn relay_scrape(listener: &TcpListener, admin: SocketAddr) {
    let (conn, _) = listener.accept().expect("top's scrape");
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    while reader.read_line(&mut line).expect("the request") > 2 {
        line.clear();
    }
    let body = metrics(admin);
    write!(
        reader.get_mut(),
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
}

#[test]
fn top_once_shows_the_clients_heaviest_first_and_the_names_they_ask() {
    let _turn = crate::shared();
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let (agent, admin) = agent(&knot, &["--clients-top", "3", "--clients-sample", "1"]);
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let relay = listener.local_addr().unwrap().to_string();
    let top = std::thread::spawn(move || {
        Command::new(nodedns_bin())
            .args(["top", "--metrics", &relay, "--interval", "1s", "--once"])
            .output()
            .expect("run nodedns top")
    });
    // The traffic falls between top's two scrapes: its frame shows exactly that.
    relay_scrape(&listener, admin);
    known_volumes(agent.addr());
    relay_scrape(&listener, admin);
    let out = top.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains('\x1b'), "--once does not clear the screen");
    let panel = |title: &str| -> Vec<Vec<&str>> {
        text.lines()
            .skip_while(|l| !l.starts_with(title))
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.split_whitespace().collect())
            .collect()
    };
    let clients = panel("clients");
    let order: Vec<&str> = clients.iter().map(|row| row[0]).collect();
    assert_eq!(
        order,
        ["127.0.0.2", "127.0.0.3", "127.0.0.4", "other"],
        "{text}"
    );
    // client, q/s, NXDOMAIN, search-path, hit ratio: one name asked 30 times (a miss, then
    // hits); the cascade's 15 search-path NXDOMAINs of 20, 12 hits of 20 lookups. (`other`
    // holds the harness's start-up probes, whenever they arrive.)
    assert_eq!(clients[0][2..5], ["0.0%", "0.0%", "96.7%"], "{text}");
    assert_eq!(clients[1][2..5], ["75.0%", "75.0%", "60.0%"], "{text}");
    assert_eq!(clients[2][2..5], ["0.0%", "0.0%", "90.0%"], "{text}");
    let names = panel("names");
    assert_eq!(
        names[0][..2],
        ["kube-dns.kube-system.svc.cluster.local.", "127.0.0.2"],
        "{text}"
    );
    for (name, client) in [
        ("web.default.svc.cluster.local.", "127.0.0.4"),
        ("api.example.com.", "127.0.0.3"),
        ("api.example.com.default.svc.cluster.local.", "127.0.0.3"),
    ] {
        assert!(
            names.iter().any(|row| row[..2] == [name, client]),
            "{name} from {client} missing:\n{text}"
        );
    }
}
