//! The agent's TCP listener with hostile bytes: each input is one client connection's stream
//! (length-prefixed messages, or not), written in pieces whose size the input's first byte
//! picks, then half-closed. Behind the listener runs the real request pipeline (cache,
//! single-flight, an upstream that refuses connections, so misses get SERVFAIL).
//!
//! Properties: the agent never panics and always closes the connection; it writes whole frames
//! only, each a DNS response that hickory-proto decodes; never more answers than the input held
//! complete frames.
#![no_main]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use clap::Parser;
use hickory_proto::op::{Message, MessageType};
use libfuzzer_sys::fuzz_target;
use nodedns_agent::{config, metrics, serve};
use serve::{Shared, Snapshot, tcp};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    config: config::ConfigArgs,
}

/// The agent under test: a runtime serving one TCP listener. Built once per fuzzing process.
struct World {
    _runtime: tokio::runtime::Runtime,
    addr: SocketAddr,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        // The discard port: nothing listens, so every upstream query is refused at once.
        let args = Cli::try_parse_from([
            "nodedns",
            "--listen",
            &addr.to_string(),
            "--upstream",
            "127.0.0.1:9",
        ])
        .expect("static arguments")
        .config;
        let inputs = config::Inputs {
            corefile: None,
            env: HashMap::new(),
            resolv_conf: None,
            kubedns: None,
            forward_files: Default::default(),
            imports: Default::default(),
            interfaces: Default::default(),
        };
        let config = Arc::new(config::build(&args, &inputs).expect("a valid configuration"));
        runtime.block_on(async {
            let upstream_metrics = nodedns_upstream::Metrics::register(
                &mut prometheus_client::registry::Registry::default(),
            );
            let metrics = Arc::new(metrics::Metrics::new(&[addr], true));
            let taps = nodedns_agent::dnstap::Metrics::default();
            let plugin_metrics = nodedns_agent::plugin::Metrics::default();
            let snapshot = Snapshot::build(
                config,
                None,
                &upstream_metrics,
                &plugin_metrics,
                &metrics,
                &taps,
            )
            .expect("a snapshot of a valid configuration");
            let shared = Arc::new(Shared::new(
                snapshot,
                metrics,
                Default::default(),
                Default::default(),
            ));
            let listener = tcp::bind(addr).expect("bind");
            let (stop, stopped) = tokio::sync::watch::channel(false);
            // Serves for the life of the process.
            std::mem::forget(stop);
            tokio::spawn(tcp::run(
                shared,
                listener,
                addr,
                tcp::Limits {
                    idle_timeout: Duration::from_secs(2),
                    ..tcp::Limits::default()
                },
                Arc::new(tcp::Connections::new(1024, 0)),
                stopped,
                None,
            ));
        });
        World {
            _runtime: runtime,
            addr,
        }
    })
}

/// Complete length-prefixed frames at the start of `data`.
fn complete_frames(mut data: &[u8]) -> usize {
    let mut frames = 0;
    while data.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([data[0], data[1]]));
        if data.len() < 2 + len {
            break;
        }
        frames += 1;
        data = &data[2 + len..];
    }
    frames
}

fuzz_target!(|input: &[u8]| {
    let Some((&piece, data)) = input.split_first() else {
        return;
    };
    let world = world();
    let mut stream = TcpStream::connect(world.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let piece = usize::from(piece).max(1);
    for chunk in data.chunks(piece) {
        // The agent closes on garbage: a write may then fail, which is fine.
        if stream.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut replies = Vec::new();
    // A reset after the agent gave up on the stream is a close too.
    let _ = stream.read_to_end(&mut replies);
    let mut rest = &replies[..];
    let mut answers = 0;
    while !rest.is_empty() {
        assert!(rest.len() >= 2, "a partial length prefix: {replies:02x?}");
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        assert!(rest.len() >= 2 + len, "a partial frame: {replies:02x?}");
        let reply = Message::from_vec(&rest[2..2 + len]).unwrap_or_else(|e| {
            panic!(
                "an answer hickory cannot decode ({e}): {:02x?}",
                &rest[2..2 + len]
            )
        });
        assert_eq!(reply.metadata.message_type, MessageType::Response);
        answers += 1;
        rest = &rest[2 + len..];
    }
    assert!(
        answers <= complete_frames(data),
        "{answers} answers for {} frames",
        complete_frames(data)
    );
});
