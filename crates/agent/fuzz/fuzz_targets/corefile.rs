//! The configuration load with hostile text: a Corefile (node-cache's template variables are
//! filled in it too), and the kube-dns ConfigMap's `stubDomains` and `upstreamNameservers`. The
//! input is split at 0xff bytes into those three (a byte no UTF-8 text holds).
//!
//! Properties: never panics; a load is a pure function of its inputs (loading twice gives the
//! same result); an accepted configuration serves somewhere and routes every name without
//! panicking; comparing it with itself needs no restart.
#![no_main]

use std::collections::HashMap;
use std::path::PathBuf;

use clap::Parser;
use libfuzzer_sys::fuzz_target;
use nodedns_agent::config;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    config: config::ConfigArgs,
}

/// The flags of node-cache's DaemonSet (parsed once: clap is slower than the load itself).
fn args() -> &'static config::ConfigArgs {
    static ARGS: std::sync::OnceLock<config::ConfigArgs> = std::sync::OnceLock::new();
    ARGS.get_or_init(|| {
        Cli::try_parse_from([
            "nodedns",
            "--conf",
            "/fuzz/Corefile",
            "--local-ip",
            "169.254.20.10,10.96.0.10",
            "--resolv-conf",
            "/fuzz/resolv.conf",
        ])
        .expect("static arguments")
        .config
    })
}

fuzz_target!(|data: &[u8]| {
    let mut parts = data.split(|&b| b == 0xff);
    let corefile = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let stub_domains = parts
        .next()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let upstream_nameservers = parts
        .next()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let kubedns =
        (stub_domains.is_some() || upstream_nameservers.is_some()).then(|| config::KubeDns {
            dir: PathBuf::from("/fuzz/kube-dns"),
            stub_domains,
            upstream_nameservers,
        });
    let inputs = config::Inputs {
        corefile: Some((PathBuf::from("/fuzz/Corefile"), corefile)),
        env: HashMap::from([
            (
                "KUBE_DNS_UPSTREAM_SERVICE_HOST".to_owned(),
                "10.96.0.11".to_owned(),
            ),
            ("NODE_NAME".to_owned(), "fuzz".to_owned()),
        ]),
        resolv_conf: Some("nameserver 10.0.0.2\nsearch example.internal\n".to_owned()),
        kubedns,
        forward_files: Default::default(),
        imports: Default::default(),
        interfaces: Default::default(),
    };
    let args = args();
    let first = config::build(args, &inputs);
    let second = config::build(args, &inputs);
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "a load is deterministic"),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "so are its errors"),
        _ => panic!("one load failed and the same one succeeded"),
    }
    if let Ok(config) = first {
        assert!(config.restart_needed(&config).is_empty());
        let router = config::Router::new(&config.servers);
        for server in &config.servers {
            for &local in &server.listen {
                for name in [
                    &b"\x00"[..],
                    b"\x07example\x03com\x00",
                    b"\x07cluster\x05local\x00",
                ] {
                    let _ = router.route(name, local);
                }
            }
        }
    }
});
