//! The query log (the `log` directive, or `--query-log` for every block): one line per answered
//! query, sampled (`--query-log-sample`), for debugging the ndots search-list cascade. Its target
//! is `nodedns::query`, so a filter can silence it (`nodedns::query=off`).
//!
//! Each listener keeps its own sampler, as it keeps its own counters: a UDP worker's is written
//! by its thread only (a load and a store per logged-block query, no locked instruction); the
//! async path shares one.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nodedns_wire::{Header, Query, Reply, rcode, rtype};

use super::request::{Client, Proto, Source};
use crate::config::{LogClasses, LogField, LogFormat, LogPiece, LogRule};
use crate::logging::{TypeName, name_text, rcode_text};

/// What the command line says about the query log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Log the queries of every block, not only those with `log` (`--query-log`).
    pub all: bool,
    /// Share of the logged blocks' queries written, in (0, 1] (`--query-log-sample`).
    pub sample: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            all: false,
            sample: 1.0,
        }
    }
}

impl Settings {
    /// Log one query in this many.
    fn every(&self) -> u64 {
        if self.sample >= 1.0 || !self.sample.is_finite() || self.sample <= 0.0 {
            1
        } else {
            (1.0 / self.sample).round().max(1.0) as u64
        }
    }
}

/// One listener's query log: which blocks log, and the sampler.
#[derive(Debug)]
pub struct QueryLog {
    all: bool,
    every: u64,
    seq: AtomicU64,
    /// Only one thread writes `seq`: a load and a store instead of a locked add.
    single_writer: bool,
}

impl QueryLog {
    /// A query log for the async path and other shared writers.
    pub fn new(settings: Settings) -> Self {
        QueryLog {
            all: settings.all,
            every: settings.every(),
            seq: AtomicU64::new(0),
            single_writer: false,
        }
    }

    /// Another query log with the same settings, for a listener that writes it from one thread.
    pub fn single_writer(&self) -> Self {
        QueryLog {
            all: self.all,
            every: self.every,
            seq: AtomicU64::new(0),
            single_writer: true,
        }
    }

    /// Whether a block with (`log`) or without the `log` directive logs its queries.
    #[inline]
    pub fn logs(&self, log: bool) -> bool {
        log || self.all
    }

    /// Whether this query is one the log samples.
    fn sample(&self) -> bool {
        let seq = if self.single_writer {
            let seq = self.seq.load(Ordering::Relaxed);
            self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
            seq
        } else {
            self.seq.fetch_add(1, Ordering::Relaxed)
        };
        seq % self.every == 0
    }

    /// Logs one answered query of a logging block, if its rules take it and it is sampled:
    /// where it arrived (`server`), who asked, the question, what answered and how. `rules` are
    /// the block's `log` rules; none (a block logged by `--query-log` alone) logs every query
    /// as a `log` line without arguments would.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        server: &str,
        rules: &[LogRule],
        query: &Query<'_>,
        client: &Client,
        source: Source,
        response: &[u8],
        elapsed: Duration,
    ) {
        // CoreDNS: the first rule whose name covers the query decides, classes and format.
        let rule = match rules {
            [] => None,
            _ => match rules.iter().find(|r| under(query.qname(), &r.scope)) {
                Some(rule) => Some(rule),
                None => return,
            },
        };
        if let Some(rule) = rule.filter(|r| !r.classes.all()) {
            if !takes(rule.classes, classify(query, response)) {
                return;
            }
        }
        if !self.sample() {
            return;
        }
        if let Some(format) = rule.and_then(|r| r.format.as_ref()) {
            let line = render(format, server, query, client, response, elapsed);
            tracing::info!(target: "nodedns::query", server, "{line}");
            return;
        }
        let rcode = rcode_text(Header::read(response).map_or(0, |h| h.rcode()));
        tracing::info!(
            target: "nodedns::query",
            server,
            remote = %client.addr,
            id = query.id(),
            qtype = %TypeName(query.qtype()),
            qname = %name_text(query.qname()),
            proto = client.proto.as_str(),
            size = query.bytes().len(),
            dnssec_ok = query.dnssec_ok(),
            bufsize = query.udp_limit(),
            rcode = &*rcode,
            answered_by = source.as_str(),
            rsize = response.len(),
            duration = elapsed.as_secs_f64(),
            "query"
        );
    }
}

/// Whether wire-form `name` equals `zone` or is below it (ASCII case ignored).
fn under(name: &[u8], zone: &[u8]) -> bool {
    let mut at = 0;
    loop {
        if name.len() - at == zone.len() && name[at..].eq_ignore_ascii_case(zone) {
            return true;
        }
        match name.get(at) {
            Some(&len) if len != 0 && at + 1 + usize::from(len) < name.len() => {
                at += 1 + usize::from(len);
            }
            _ => return false,
        }
    }
}

/// Which of CoreDNS's classes an answer is in (`response.Typify`, then `Classify`): success
/// (NOERROR with answers, a referral, or NOERROR with neither answers nor SOA), denial
/// (NXDOMAIN or NODATA, each with the SOA in the authority section) and error (everything
/// else: SERVFAIL, REFUSED, NOTIMP, FORMERR, an NXDOMAIN without SOA, zone transfers and
/// NOTIFY). CoreDNS also counts a DNSSEC answer with expired signatures to a DO query as an
/// error; nodedns does not look at signatures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AnswerClass {
    Success,
    Denial,
    Error,
}

fn classify(query: &Query<'_>, response: &[u8]) -> AnswerClass {
    const NOERROR: u16 = rcode::NOERROR as u16;
    const NXDOMAIN: u16 = rcode::NXDOMAIN as u16;
    if query.opcode() != 0 || matches!(query.qtype(), rtype::AXFR | rtype::IXFR) {
        return AnswerClass::Error;
    }
    let Ok(reply) = Reply::parse(response) else {
        return AnswerClass::Error;
    };
    let info = reply.info();
    let soa = info.negative_ttl.is_some();
    match info.rcode {
        NOERROR if info.answers > 0 => AnswerClass::Success,
        NOERROR if soa => AnswerClass::Denial,
        NXDOMAIN if soa => AnswerClass::Denial,
        NOERROR => AnswerClass::Success,
        _ => AnswerClass::Error,
    }
}

fn takes(classes: LogClasses, class: AnswerClass) -> bool {
    match class {
        AnswerClass::Success => classes.success,
        AnswerClass::Denial => classes.denial,
        AnswerClass::Error => classes.error,
    }
}

/// One query's line in a `log` FORMAT, each placeholder as CoreDNS's replacer writes it.
fn render(
    format: &LogFormat,
    server: &str,
    query: &Query<'_>,
    client: &Client,
    response: &[u8],
    elapsed: Duration,
) -> String {
    use std::fmt::Write;
    let mut line = String::with_capacity(128);
    let header = Header::read(response);
    for piece in &format.0 {
        let field = match piece {
            LogPiece::Text(text) => {
                line.push_str(text);
                continue;
            }
            LogPiece::Field(field) => *field,
        };
        let _ = match field {
            LogField::Type => write!(line, "{}", TypeName(query.qtype())),
            LogField::Name => write!(line, "{}", name_text(query.qname()).to_ascii_lowercase()),
            LogField::Class => write!(line, "{}", ClassName(query.qclass())),
            LogField::Proto => write!(line, "{}", client.proto.as_str()),
            LogField::Remote => write!(line, "{}", Bracketed(client.addr.ip())),
            LogField::Local => write!(line, "{}", local_host(server)),
            LogField::Size => write!(line, "{}", query.bytes().len()),
            LogField::Port => write!(line, "{}", client.addr.port()),
            LogField::Duration => write!(line, "{}s", elapsed.as_secs_f64()),
            LogField::Rcode => write!(line, "{}", rcode_text(header.map_or(0, |h| h.rcode()))),
            LogField::Rsize => write!(line, "{}", response.len()),
            LogField::Rflags => write!(line, "{}", Flags(header.map_or(0, |h| h.flags()))),
            LogField::Bufsize => write!(line, "{}", bufsize(query, client.proto)),
            LogField::Do => write!(line, "{}", query.dnssec_ok()),
            LogField::Id => write!(line, "{}", query.id()),
            LogField::Opcode => write!(line, "{}", query.opcode()),
            LogField::Metadata => write!(line, "-"),
        };
    }
    line
}

/// `{>bufsize}` as CoreDNS computes it: 65535 over TCP; over UDP the client's EDNS size, at
/// least 512.
fn bufsize(query: &Query<'_>, proto: Proto) -> u16 {
    match proto {
        Proto::Tcp => u16::MAX,
        Proto::Udp => query.edns().map_or(512, |e| e.udp_size.max(512)),
    }
}

/// `{local}`: the address the block listens on, from its `server` label (`dns://IP:PORT`, or
/// `dns://:PORT` for the wildcard, which CoreDNS writes as `[::]`).
fn local_host(server: &str) -> &str {
    let host = server
        .strip_prefix("dns://")
        .and_then(|rest| rest.rsplit_once(':'))
        .map_or("", |(host, _)| host);
    if host.is_empty() { "[::]" } else { host }
}

/// An IP address as CoreDNS writes `{remote}`: IPv6 in brackets.
struct Bracketed(IpAddr);

impl std::fmt::Display for Bracketed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(ip) => write!(f, "{ip}"),
            IpAddr::V6(ip) => write!(f, "[{ip}]"),
        }
    }
}

/// A query class as miekg/dns names it.
struct ClassName(u16);

impl std::fmt::Display for ClassName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            1 => f.write_str("IN"),
            3 => f.write_str("CH"),
            4 => f.write_str("HS"),
            254 => f.write_str("NONE"),
            255 => f.write_str("ANY"),
            n => write!(f, "CLASS{n}"),
        }
    }
}

/// `{>rflags}`: the header flags that are set, comma-separated, in CoreDNS's order.
struct Flags(u16);

impl std::fmt::Display for Flags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const NAMES: [(u16, &str); 8] = [
            (0x8000, "qr"),
            (0x0400, "aa"),
            (0x0200, "tc"),
            (0x0100, "rd"),
            (0x0080, "ra"),
            (0x0040, "z"),
            (0x0020, "ad"),
            (0x0010, "cd"),
        ];
        let mut first = true;
        for (bit, name) in NAMES {
            if self.0 & bit != 0 {
                if !first {
                    f.write_str(",")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_log_samples_one_in_n() {
        let shared = QueryLog::new(Settings {
            all: false,
            sample: 0.25,
        });
        let worker = shared.single_writer();
        assert_eq!((0..100).filter(|_| worker.sample()).count(), 25);
        assert_eq!((0..100).filter(|_| shared.sample()).count(), 25);
        let all = QueryLog::new(Settings::default());
        assert_eq!((0..10).filter(|_| all.sample()).count(), 10);
    }

    /// `www.example.org. A` from a client, with an OPT (size 1232, DO) when `edns`.
    fn query(id: u16, edns: bool) -> Vec<u8> {
        let mut q = vec![0, 0, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, u8::from(edns)];
        q[..2].copy_from_slice(&id.to_be_bytes());
        q.extend_from_slice(b"\x03WWW\x07example\x03org\x00\x00\x01\x00\x01");
        if edns {
            q.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0x80, 0, 0, 0]);
        }
        q
    }

    /// A reply to `query(..)` with `rcode`, `answers` A records and, when `soa`, the zone's SOA
    /// in the authority section.
    fn reply(rcode: u8, answers: u16, soa: bool) -> Vec<u8> {
        let mut r = query(7, false);
        r[2] = 0x85; // QR, AA, RD
        r[3] = 0x80 | rcode; // RA
        r[6..8].copy_from_slice(&answers.to_be_bytes());
        r[9] = u8::from(soa);
        for _ in 0..answers {
            r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 192, 0, 2, 1]);
        }
        if soa {
            r.extend_from_slice(&[0xc0, 16, 0, 6, 0, 1, 0, 0, 0, 30, 0, 22, 0, 0]);
            r.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 5]);
        }
        r
    }

    #[test]
    fn answers_fall_in_coredns_classes() {
        let q = query(1, false);
        let q = Query::parse(&q).unwrap();
        for (rcode, answers, soa, class) in [
            (0, 1, false, AnswerClass::Success),
            (0, 0, true, AnswerClass::Denial),
            (3, 0, true, AnswerClass::Denial),
            (0, 0, false, AnswerClass::Success),
            (3, 0, false, AnswerClass::Error),
            (2, 0, false, AnswerClass::Error),
            (5, 0, false, AnswerClass::Error),
        ] {
            assert_eq!(
                classify(&q, &reply(rcode, answers, soa)),
                class,
                "rcode {rcode}, {answers} answers, soa {soa}"
            );
        }
    }

    #[test]
    fn a_name_is_under_its_zones_only_at_label_boundaries() {
        let name = b"\x03WWW\x07example\x03org\x00";
        assert!(under(name, b"\x00"));
        assert!(under(name, b"\x03org\x00"));
        assert!(under(name, b"\x07EXAMPLE\x03org\x00"));
        assert!(under(name, b"\x03www\x07example\x03org\x00"));
        assert!(!under(name, b"\x04wwww\x07example\x03org\x00"));
        assert!(!under(name, b"\x02rg\x00"));
        assert!(!under(b"\x03org\x00", b"\x07example\x03org\x00"));
    }

    #[test]
    fn formats_render_each_placeholder_as_coredns_does() {
        let bytes = query(4242, true);
        let q = Query::parse(&bytes).unwrap();
        let client = Client {
            proto: Proto::Udp,
            addr: "[fd00::7]:40053".parse().unwrap(),
        };
        let response = reply(3, 0, true);
        let format = LogFormat::parse("{common} | {local} {>opcode} {/pod} {unknown} {>rflags}");
        let line = render(
            &format,
            "dns://:53",
            &q,
            &client,
            &response,
            Duration::from_micros(1500),
        );
        assert_eq!(
            line,
            format!(
                "[fd00::7]:40053 - 4242 \"A IN www.example.org. udp {} true 1232\" NXDOMAIN \
                 qr,aa,rd,ra {} 0.0015s | [::] 0 - {{unknown}} qr,aa,rd,ra",
                bytes.len(),
                response.len()
            )
        );
        let tcp = Client {
            proto: Proto::Tcp,
            addr: "10.244.0.7:1234".parse().unwrap(),
        };
        let plain = query(1, false);
        let line = render(
            &LogFormat::parse("{remote} {port} {proto} {>bufsize} {>do} {local}"),
            "dns://169.254.20.10:53",
            &Query::parse(&plain).unwrap(),
            &tcp,
            &response,
            Duration::ZERO,
        );
        assert_eq!(line, "10.244.0.7 1234 tcp 65535 false 169.254.20.10");
    }

    #[test]
    fn blocks_log_with_their_directive_or_the_flag() {
        let some = QueryLog::new(Settings::default());
        assert!(some.logs(true) && !some.logs(false));
        let every = QueryLog::new(Settings {
            all: true,
            sample: 1.0,
        });
        assert!(every.logs(false));
    }
}
