//! dnstap read by a real reader: the `dnstap` command of golang-dnstap (Debian's
//! golang-github-dnstap-golang-dnstap-cli, the library CoreDNS's own plugin is built on) listens
//! on a Unix socket; an agent whose Corefile has `dnstap unix://SOCKET full` answers queries
//! from a known source; the reader's YAML holds the CLIENT_QUERY and CLIENT_RESPONSE of each,
//! with the client's address and the DNS messages.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::Duration;

use hickory_proto::rr::RecordType;
use hickory_proto::serialize::binary::BinEncodable;
use nodedns_integration::knot;
use nodedns_integration::node::wait_for;
use nodedns_integration::{Process, TempDir, client, free_port, have, http_get, nodedns_bin};

#[test]
fn the_dnstap_cli_reads_the_queries_and_answers_nodedns_taps() {
    let _turn = crate::shared();
    if !have("dnstap") {
        eprintln!("skipped: no `dnstap` (apt-get install golang-github-dnstap-golang-dnstap-cli)");
        return;
    }
    let Some(knot) = knot::cluster_local_or_skip() else {
        return;
    };
    let dir = TempDir::new("nodedns-dnstap").unwrap();
    let socket = dir.path().join("tap.sock");
    let yaml = dir.path().join("tap.yaml");
    let mut reader = Command::new("dnstap");
    reader.arg("-u").arg(&socket).arg("-y").arg("-w").arg(&yaml);
    let reader = Process::spawn("dnstap", reader).expect("spawn dnstap");
    wait_for("the dnstap socket", Duration::from_secs(10), || {
        socket.exists()
    })
    .unwrap();

    let port = free_port().unwrap();
    let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let corefile = dir.path().join("Corefile");
    std::fs::write(
        &corefile,
        format!(
            ".:{port} {{
    bind 127.0.0.1
    cache 30
    forward . {upstream}
    prometheus {admin}
    dnstap unix://{socket} full {{
        identity node-under-test
    }}
}}
",
            upstream = knot.addr(),
            socket = socket.display()
        ),
    )
    .unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.0.1\n").unwrap();
    let mut command = Command::new(nodedns_bin());
    command
        .arg("run")
        .arg("--conf")
        .arg(&corefile)
        .arg("--resolv-conf")
        .arg(&resolv)
        .arg("--threads")
        .arg("1");
    let mut agent = Process::spawn("nodedns", command).expect("spawn nodedns");
    wait_for("nodedns /ready", Duration::from_secs(15), || {
        matches!(http_get(admin, "/ready"), Ok((200, _)))
    })
    .unwrap();
    let connected = format!(
        "nodedns_dnstap_connected{{endpoint=\"unix://{}\"}} 1",
        socket.display()
    );
    wait_for("the tap's connection", Duration::from_secs(10), || {
        http_get(admin, "/metrics").is_ok_and(|(_, body)| body.contains(&connected))
    })
    .unwrap();

    // A miss, then a hit of the same name, from 127.0.0.2.
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let source = UdpSocket::bind((Ipv4Addr::new(127, 0, 0, 2), 0)).unwrap();
    source
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let source_port = source.local_addr().unwrap().port();
    for _ in 0..2 {
        let query = client::query("web.default.svc.cluster.local.", RecordType::A);
        source.send_to(&query.to_bytes().unwrap(), dns).unwrap();
        let mut buf = [0u8; 1500];
        let (n, _) = source.recv_from(&mut buf).expect("an answer");
        assert_eq!(
            client::decode(&buf[..n]).unwrap().metadata.id,
            query.metadata.id
        );
    }
    // Stopping the agent closes the tap (STOP, FINISH): everything is written by then.
    agent.stop();
    let mut text = String::new();
    wait_for(
        "4 messages in the reader's output",
        Duration::from_secs(10),
        || {
            text = std::fs::read_to_string(&yaml).unwrap_or_default();
            text.matches("type: CLIENT_RESPONSE").count() == 2
        },
    )
    .unwrap();
    let messages: Vec<&str> = text
        .split("\n---")
        .filter(|m| m.contains("message:"))
        .collect();
    assert_eq!(messages.len(), 4, "{text}");
    for (i, m) in messages.iter().enumerate() {
        let kind = if i % 2 == 0 {
            "CLIENT_QUERY"
        } else {
            "CLIENT_RESPONSE"
        };
        for part in [
            "identity: \"node-under-test\"",
            &format!("type: {kind}"),
            "socket_family: INET",
            "socket_protocol: UDP",
            "query_address: 127.0.0.2",
            &format!("query_port: {source_port}"),
            "web.default.svc.cluster.local.",
        ] {
            assert!(m.contains(part), "message {i} lacks {part:?}:\n{m}");
        }
    }
    // The answers carry the record Knot serves.
    assert!(
        messages[1].contains("10.96.12.34") && messages[3].contains("10.96.12.34"),
        "{text}"
    );
    drop(reader);
}
