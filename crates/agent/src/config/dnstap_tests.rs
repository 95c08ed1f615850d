//! The `dnstap` directive: CoreDNS 1.10's syntax, newer CoreDNS's options where nodedns has them,
//! and a clear error for the rest.

use std::path::PathBuf;

use super::tests::cli;
use super::{ConfigError, Inputs, build};
use super::{Dnstap, Sink};

fn load(body: &str, flags: &[&str]) -> Result<Vec<Dnstap>, Vec<String>> {
    let corefile = format!(".:53 {{\n    bind 127.0.0.1\n    forward . 10.0.0.2\n{body}\n}}\n");
    let inputs = Inputs {
        corefile: Some((PathBuf::from("Corefile"), corefile)),
        ..Inputs::default()
    };
    match build(&cli(flags), &inputs) {
        Ok(config) => Ok(config.servers[0].dnstap.clone()),
        Err(ConfigError::Invalid { problems }) => {
            Err(problems.iter().map(ToString::to_string).collect())
        }
        Err(other) => panic!("{other}"),
    }
}

fn errs(body: &str) -> Vec<String> {
    load(body, &[]).expect_err("accepted")
}

#[test]
fn the_socket_is_a_path_a_unix_url_or_a_tcp_address() {
    let taps = load(
        "    dnstap /run/dnstap.sock\n    dnstap unix:///run/other.sock full\n    dnstap tcp://127.0.0.1:6000 full",
        &[],
    )
    .unwrap();
    assert_eq!(
        taps,
        [
            Dnstap::new(Sink::Unix("/run/dnstap.sock".into())),
            Dnstap {
                full: true,
                ..Dnstap::new(Sink::Unix("/run/other.sock".into()))
            },
            Dnstap {
                full: true,
                ..Dnstap::new(Sink::Tcp("127.0.0.1:6000".to_owned()))
            },
        ]
    );
}

#[test]
fn options_of_coredns_1_10_and_newer_are_taken() {
    let taps = load(
        "    dnstap tcp://collector.example:6000 full 4 2 {\n        identity node-a\n        version v9\n        extra \"cluster: prod\"\n    }",
        &["--dnstap-sample", "10"],
    )
    .unwrap();
    assert_eq!(
        taps,
        [Dnstap {
            full: true,
            identity: Some("node-a".to_owned()),
            version: Some("v9".to_owned()),
            extra: Some("cluster: prod".to_owned()),
            queue: 2 * Dnstap::QUEUE,
            write_buffer: 4 * Dnstap::WRITE_BUFFER,
            sample: 10,
            ..Dnstap::new(Sink::Tcp("collector.example:6000".to_owned()))
        }]
    );
}

#[test]
fn what_nodedns_does_not_implement_is_an_error_with_its_line() {
    let cases: [(&str, &str); 9] = [
        ("    dnstap", "expected `dnstap SOCKET"),
        (
            "    dnstap listen /run/x.sock",
            "dnstap listen (sinks that connect to nodedns) is not implemented",
        ),
        (
            "    dnstap tls://127.0.0.1:6000 full",
            "TLS sinks are not implemented",
        ),
        (
            "    dnstap tcp://127.0.0.1 full",
            "a TCP sink is `tcp://HOST:PORT`",
        ),
        (
            "    dnstap /run/x.sock partial",
            "expected `full` after the socket",
        ),
        (
            "    dnstap /run/x.sock full 0",
            "WRITEBUFFER (MiB): `0` is not a whole number from 1 to 1024",
        ),
        (
            "    dnstap /run/x.sock full 1 5000",
            "QUEUE (times 10,000 messages): `5000`",
        ),
        (
            "    dnstap /run/x.sock {\n        extra {/forward/upstream}\n    }",
            "metadata placeholders",
        ),
        (
            "    dnstap /run/x.sock {\n        sample 5\n    }",
            "unknown option `sample` of `dnstap`",
        ),
    ];
    for (body, fragment) in cases {
        let errs = errs(body);
        assert_eq!(errs.len(), 1, "{body}: {errs:#?}");
        assert!(errs[0].starts_with("Corefile:"), "{errs:?}");
        assert!(
            errs[0].contains(fragment),
            "{body}: expected …{fragment}…, got {errs:?}"
        );
    }
}

#[test]
fn skipverify_is_accepted_with_a_warning() {
    let corefile =
        ".:53 {\n    forward . 10.0.0.2\n    dnstap /run/x.sock {\n        skipverify\n    }\n}\n";
    let inputs = Inputs {
        corefile: Some((PathBuf::from("Corefile"), corefile.to_owned())),
        ..Inputs::default()
    };
    let config = build(&cli(&[]), &inputs).unwrap();
    assert!(
        config
            .warnings
            .iter()
            .any(|w| w.contains("Corefile:4: dnstap skipverify: no effect")),
        "{:?}",
        config.warnings
    );
}
