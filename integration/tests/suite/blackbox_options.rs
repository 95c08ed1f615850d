//! Options of implemented directives as node-cache's CoreDNS reads them, seen from outside: `log`
//! lines with names, classes and FORMATs write what CoreDNS's would for real answers from Knot;
//! `bind` with an interface name serves that interface's addresses; `prometheus` in two blocks
//! with different addresses serves the same metrics on both.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nodedns_integration::knot::{self, Knot};
use nodedns_integration::{
    Process, TempDir, client, free_port, have, http_get, spawn_with_corefile,
};

fn ask(process: &Process, server: SocketAddr, name: &str, rtype: RecordType) -> Message {
    client::udp_blocking(server, &client::query(name, rtype), Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{name} {rtype} to {server}: {e:#}\n{}", process.output()))
}

/// The query log's lines (target `nodedns::query`) once `last` is among them.
fn query_log(process: &mut Process, last: &str) -> Vec<String> {
    process
        .wait_output(last, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", process.output()));
    process
        .output()
        .lines()
        .filter(|l| l.contains("nodedns::query"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn log_rules_bind_by_interface_and_prometheus_in_two_blocks() {
    let _turn = crate::shared();
    if !have("knotd") {
        eprintln!("skipped: knotd not installed");
        return;
    }
    let knot = Knot::start(knot::Options {
        zones: vec![Knot::cluster_local()],
        ..knot::Options::default()
    })
    .expect("knotd starts");
    let upstream = knot.addr();
    let port = free_port().unwrap();
    let first = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let second = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    // The first rule covering a name decides (CoreDNS): kubernetes.default.svc's denials are
    // not logged although the `.` rule would take them.
    let corefile = format!(
        "cluster.local:{port} {{
    bind lo
    log kubernetes.default.svc.cluster.local \"ok {{name}} {{type}} {{class}} {{rcode}} {{>rflags}} {{proto}} {{remote}} {{>bufsize}} {{local}}\" {{
        class success
    }}
    log . \"denied {{name}} {{type}} {{rcode}} {{/pod}} {{x}}\" {{
        class denial
    }}
    cache 30
    forward . {upstream}
    prometheus {first}
}}
.:{port} {{
    bind lo
    forward . {upstream}
    prometheus {second}
}}
"
    );
    let dir = TempDir::new("nodedns-options").unwrap();
    let (mut process, _) = spawn_with_corefile(&dir, &corefile);
    process
        .wait_output("serving DNS", Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e:#}\n{}", process.output()));
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));

    // Not logged: a success under the `.` rule (denials only), a NODATA under the first rule
    // (successes only).
    let r = ask(
        &process,
        v4,
        "web.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    let r = ask(
        &process,
        v4,
        "kubernetes.default.svc.cluster.local.",
        RecordType::MX,
    );
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert!(r.answers.is_empty(), "NODATA");
    // Logged, each in its rule's format.
    let r = ask(&process, v4, "nothere.cluster.local.", RecordType::A);
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    let r = ask(
        &process,
        v4,
        "kubernetes.default.svc.cluster.local.",
        RecordType::A,
    );
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    let lines = query_log(&mut process, "ok kubernetes.default.svc.cluster.local.");
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[0].contains("denied nothere.cluster.local. A NXDOMAIN - {x}"),
        "{lines:#?}"
    );
    // Knot's flags as relayed on a miss (AA, RD, no RA); the block listens on `lo`'s 127.0.0.1.
    assert!(
        lines[1].contains(
            "ok kubernetes.default.svc.cluster.local. A IN NOERROR qr,aa,rd udp 127.0.0.1 512 \
             127.0.0.1"
        ),
        "{lines:#?}"
    );

    // `bind lo` is every address of `lo`: ::1 too, when the host has it.
    let has_v6 = std::net::UdpSocket::bind((Ipv6Addr::LOCALHOST, 0)).is_ok();
    if has_v6 {
        let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port);
        let r = ask(
            &process,
            v6,
            "kubernetes.default.svc.cluster.local.",
            RecordType::A,
        );
        assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    }

    // Both `prometheus` addresses serve the same registry: the first block's requests on each.
    let requests = |addr: SocketAddr| -> f64 {
        let (status, text) = http_get(addr, "/metrics").unwrap();
        assert_eq!(status, 200, "{addr}");
        text.lines()
            .filter(|l| {
                l.starts_with("coredns_dns_requests_total{")
                    && l.contains("zone=\"cluster.local.\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let expected = if has_v6 { 5.0 } else { 4.0 };
    assert_eq!(requests(first), expected);
    assert_eq!(requests(second), expected);
    drop(process);
}
