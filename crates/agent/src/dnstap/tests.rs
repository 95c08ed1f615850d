use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use super::frame::{Control, read_control, write_control};
use super::proto::tests::fields;
use super::*;

fn socket_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nodedns-dnstap-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("tap.sock")
}

/// A reader's side of one session: the handshake, then data frames until STOP.
fn read_session(listener: &UnixListener) -> Vec<Vec<u8>> {
    let (conn, _) = listener.accept().unwrap();
    session(conn)
}

fn session(conn: impl Read + Write) -> Vec<Vec<u8>> {
    let (payloads, mut conn) = until_stop(conn);
    write_control(&mut conn, Control::Finish, &[]).unwrap();
    payloads
}

/// A reader's side of one session up to the writer's STOP, not answered.
fn until_stop<C: Read + Write>(mut conn: C) -> (Vec<Vec<u8>>, C) {
    assert_eq!(read_control(&mut conn).unwrap().0, Control::Ready);
    write_control(&mut conn, Control::Accept, &[frame::CONTENT_TYPE]).unwrap();
    assert_eq!(read_control(&mut conn).unwrap().0, Control::Start);
    let mut payloads = Vec::new();
    loop {
        let mut len = [0u8; 4];
        conn.read_exact(&mut len).unwrap();
        let len = u32::from_be_bytes(len) as usize;
        if len == 0 {
            // The escape of a control frame: STOP.
            let mut rest = [0u8; 8];
            conn.read_exact(&mut rest).unwrap();
            assert_eq!(
                u32::from_be_bytes(rest[4..].try_into().unwrap()),
                Control::Stop as u32
            );
            return (payloads, conn);
        }
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload).unwrap();
        payloads.push(payload);
    }
}

/// The `Message` of a `Dnstap` payload, as (field, value) pairs.
fn message(payload: &[u8]) -> Vec<(u32, u64, Vec<u8>)> {
    let top = fields(payload);
    let m = top.iter().find(|f| f.0 == 14).expect("a message field");
    fields(&m.2)
}

fn config(path: &std::path::Path) -> Dnstap {
    Dnstap {
        full: true,
        identity: Some("node-a".to_owned()),
        ..Dnstap::new(Sink::Unix(path.to_path_buf()))
    }
}

#[test]
fn a_tap_writes_the_query_and_its_response_to_the_sink() {
    let path = socket_path("write");
    let listener = UnixListener::bind(&path).unwrap();
    let metrics = Metrics::default();
    let tap = Tap::start(config(&path), &metrics).unwrap();
    let client: SocketAddr = "127.0.0.2:40000".parse().unwrap();
    tap.client(
        b"the query",
        b"the answer",
        client,
        false,
        Duration::from_millis(2),
    );
    drop(tap);
    let payloads = read_session(&listener);
    assert_eq!(payloads.len(), 2);
    let (q, r) = (message(&payloads[0]), message(&payloads[1]));
    let get = |m: &[(u32, u64, Vec<u8>)], f: u32| m.iter().find(|x| x.0 == f).cloned();
    assert_eq!(get(&q, 1).unwrap().1, 5, "CLIENT_QUERY");
    assert_eq!(get(&q, 10).unwrap().2, b"the query");
    assert_eq!(get(&r, 1).unwrap().1, 6, "CLIENT_RESPONSE");
    assert_eq!(get(&r, 14).unwrap().2, b"the answer");
    assert_eq!(get(&r, 4).unwrap().2, [127, 0, 0, 2]);
    assert_eq!(get(&r, 6).unwrap().1, 40000);
    let top = fields(&payloads[0]);
    assert_eq!(top[0].2, b"node-a");
    assert_eq!(metrics.counts(&Sink::Unix(path.clone())), (2, 0));
}

#[test]
fn without_full_the_messages_carry_no_dns_message() {
    let path = socket_path("short");
    let listener = UnixListener::bind(&path).unwrap();
    let tap = Tap::start(
        Dnstap {
            full: false,
            ..config(&path)
        },
        &Metrics::default(),
    )
    .unwrap();
    tap.client(b"q", b"r", "[::1]:5".parse().unwrap(), true, Duration::ZERO);
    drop(tap);
    let payloads = read_session(&listener);
    let m = message(&payloads[1]);
    assert!(!m.iter().any(|f| f.0 == 10 || f.0 == 14), "{m:?}");
    assert_eq!(m.iter().find(|f| f.0 == 2).unwrap().1, 2, "INET6");
    assert_eq!(m.iter().find(|f| f.0 == 3).unwrap().1, 2, "TCP");
}

#[test]
fn a_stalled_sink_fills_the_queue_and_the_rest_is_dropped_without_waiting() {
    let path = socket_path("stall");
    // Accepts the connection, never answers READY: the writer waits for ACCEPT.
    let listener = UnixListener::bind(&path).unwrap();
    let metrics = Metrics::default();
    let tap = Tap::start(
        Dnstap {
            queue: 2,
            ..config(&path)
        },
        &metrics,
    )
    .unwrap();
    let (conn, _) = listener.accept().unwrap();
    for _ in 0..50 {
        tap.client(
            b"q",
            b"r",
            "127.0.0.2:1".parse().unwrap(),
            false,
            Duration::ZERO,
        );
    }
    let (sent, dropped) = metrics.counts(&Sink::Unix(path));
    assert_eq!(sent, 0);
    assert!(
        dropped >= 98,
        "100 messages, a queue of 2: {dropped} dropped"
    );
    drop(conn);
}

#[test]
fn the_tap_redials_a_sink_that_comes_back() {
    let path = socket_path("redial");
    let metrics = Metrics::default();
    // No sink yet: the first dial fails.
    let tap = Tap::start(config(&path), &metrics).unwrap();
    tap.client(
        b"lost",
        b"lost",
        "127.0.0.2:1".parse().unwrap(),
        false,
        Duration::ZERO,
    );
    let endpoint = Sink::Unix(path.clone());
    let stats = metrics.stats(&endpoint);
    // Dropped: the dial failed, and the writer waits to redial.
    while stats.dropped.load(Ordering::Relaxed) < 2 {
        std::thread::yield_now();
    }
    let listener = UnixListener::bind(&path).unwrap();
    // The redial is the next accept; what the tap gets once connected reaches the sink.
    let reader = std::thread::spawn(move || read_session(&listener));
    while !stats.connected.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
    tap.client(
        b"kept",
        b"kept",
        "127.0.0.2:1".parse().unwrap(),
        false,
        Duration::ZERO,
    );
    drop(tap);
    let payloads = reader.join().unwrap();
    let queries: Vec<Vec<u8>> = payloads
        .iter()
        .filter_map(|p| message(p).into_iter().find(|f| f.0 == 10).map(|f| f.2))
        .collect();
    assert_eq!(queries, [b"kept".to_vec()]);
    assert_eq!(
        metrics.counts(&endpoint).1,
        2,
        "the two messages of the lost query"
    );
}

#[test]
fn sampling_taps_one_query_in_n() {
    let path = socket_path("sample");
    let listener = UnixListener::bind(&path).unwrap();
    let tap = Tap::start(
        Dnstap {
            sample: 4,
            ..config(&path)
        },
        &Metrics::default(),
    )
    .unwrap();
    for _ in 0..8 {
        tap.client(
            b"q",
            b"r",
            "127.0.0.2:1".parse().unwrap(),
            false,
            Duration::ZERO,
        );
    }
    drop(tap);
    assert_eq!(
        read_session(&listener).len(),
        4,
        "2 of 8 queries, 2 messages each"
    );
}

#[test]
fn a_tcp_sink_gets_the_same_stream() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Metrics::default();
    let endpoint = Sink::Tcp(addr.to_string());
    let tap = Tap::start(
        Dnstap {
            full: true,
            ..Dnstap::new(endpoint.clone())
        },
        &metrics,
    )
    .unwrap();
    tap.client(
        b"q",
        b"r",
        "127.0.0.3:53000".parse().unwrap(),
        false,
        Duration::ZERO,
    );
    drop(tap);
    let (conn, _) = listener.accept().unwrap();
    let payloads = session(conn);
    assert_eq!(payloads.len(), 2);
    assert_eq!(
        message(&payloads[0]).iter().find(|f| f.0 == 4).unwrap().2,
        [127, 0, 0, 3]
    );
    assert_eq!(metrics.counts(&endpoint), (2, 0));
    assert_eq!(endpoint.to_string(), format!("tcp://{addr}"));
}

/// Waits until the tap's writer has opened its session.
fn wait_connected(metrics: &Metrics, endpoint: &Sink) {
    let stats = metrics.stats(endpoint);
    while !stats.connected.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
}

#[test]
fn finishing_writes_the_queue_out_and_closes_the_session_while_the_tap_is_held() {
    let path = socket_path("finish");
    let listener = UnixListener::bind(&path).unwrap();
    let metrics = Metrics::default();
    let endpoint = Sink::Unix(path.clone());
    let tap = Tap::start(config(&path), &metrics).unwrap();
    let reader = std::thread::spawn(move || read_session(&listener));
    wait_connected(&metrics, &endpoint);
    let client: SocketAddr = "127.0.0.2:40000".parse().unwrap();
    for i in 0..50u8 {
        tap.client(&[i], b"r", client, false, Duration::ZERO);
    }
    // The tap is still held (as the configuration holds it at shutdown): finishing alone ends
    // the session, once the reader has answered STOP.
    assert!(tap.finish(Instant::now() + Duration::from_secs(30)));
    let payloads = reader.join().unwrap();
    assert_eq!(payloads.len(), 100, "every message of the 50 queries");
    assert_eq!(metrics.counts(&endpoint), (100, 0));
    // The writer is gone: what is tapped now is dropped, and counted.
    tap.client(b"late", b"r", client, false, Duration::ZERO);
    assert_eq!(metrics.counts(&endpoint), (100, 2));
}

#[test]
fn finishing_gives_up_at_the_deadline_on_a_reader_that_never_answers_stop() {
    let path = socket_path("nofinish");
    let listener = UnixListener::bind(&path).unwrap();
    let metrics = Metrics::default();
    let endpoint = Sink::Unix(path.clone());
    let tap = Tap::start(config(&path), &metrics).unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let (payloads, conn) = until_stop(conn);
        // Holds the connection open without a FINISH until the test is done.
        let _ = released.recv();
        drop(conn);
        payloads.len()
    });
    wait_connected(&metrics, &endpoint);
    tap.client(
        b"q",
        b"r",
        "127.0.0.2:1".parse().unwrap(),
        false,
        Duration::ZERO,
    );
    let unfinished = finish([&*tap], Instant::now() + Duration::from_millis(200));
    assert_eq!(unfinished, [endpoint.to_string()]);
    release.send(()).unwrap();
    assert_eq!(reader.join().unwrap(), 2, "the messages came before STOP");
}
