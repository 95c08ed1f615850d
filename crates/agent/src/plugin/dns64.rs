//! `dns64`: AAAA records synthesized from A records (RFC 6147), as CoreDNS's `plugin/dns64`
//! does, for IPv6-only pods behind a NAT64 gateway.
//!
//! - Configuration ([`parse`]): `dns64 [PREFIX]`, or a block with `prefix PREFIX`,
//!   `translate_all` and `allow_ipv4`. PREFIX is an IPv6 prefix of length 32, 40, 48, 56, 64 or
//!   96 (RFC 6052 §2.2), default the well-known prefix `64:ff9b::/96`. After a PREFIX argument
//!   the block's `translate_all` and `allow_ipv4` do nothing, as in CoreDNS (warned).
//! - Logic ([`Dns64`]): an AAAA query of class IN that came over IPv6 (or over IPv4, with
//!   `allow_ipv4`; an IPv4-mapped client address counts as IPv4, as in CoreDNS) whose answer is
//!   not NXDOMAIN and holds no AAAA record (any answer, with `translate_all`) is answered from
//!   the A records of the same name instead ([`Dns64::synthesize`]): each A record becomes an
//!   AAAA record under the prefix, with the smaller of its TTL and the TTL of the SOA record in
//!   the AAAA answer's authority section (600 s without one: RFC 6147 §5.1.7, CoreDNS's
//!   reading), other records (CNAMEs, the authority and additional sections) are passed as the
//!   A answer has them. The reply is not authoritative: it carries RD and CD from the query,
//!   as CoreDNS's `SetReply` makes it.
//! - Place in the chain: before the cache (`plugin::Before`), as in CoreDNS's `plugin.cfg`: the
//!   AAAA answer and the A answer are looked up (cache, the plugins after it, then `forward`)
//!   and cached as any answer is; the synthesized reply is never stored, it is made again from
//!   both entries for every query (`serve::dns64`).
//! - Metrics: CoreDNS's `coredns_dns64_requests_translated_total{server}` ([`Metrics`]).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use hickory_proto::op::{Message, MessageType, OpCode, Query as Question};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType, rdata};
use nodedns_wire::{Query, class, flags, rcode, rtype};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::config::corefile::Directive;
use crate::config::directives::Out;

/// The well-known prefix (RFC 6052 §2.1), CoreDNS's default.
pub const WELL_KNOWN: Prefix = Prefix {
    bits: Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0),
    len: 96,
};

/// The TTL bound when the AAAA answer has no SOA record (CoreDNS's choice, RFC 6147 §5.1.7).
const NO_SOA_TTL: u32 = 600;

/// The prefix lengths RFC 6052 §2.2 defines.
const LENGTHS: [u8; 6] = [32, 40, 48, 56, 64, 96];

/// An IPv6 prefix the IPv4 addresses are embedded in (its bits past `len` are zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub bits: Ipv6Addr,
    /// One of [`LENGTHS`].
    pub len: u8,
}

impl Prefix {
    /// `v4` embedded as RFC 6052 §2.2 places it: its four bytes right after the prefix,
    /// skipping byte 8 (bits 64–71, the "u" octet, left zero), the rest zero (the suffix). A /96
    /// keeps the prefix's bytes 0–11 as written, as CoreDNS does.
    pub fn embed(&self, v4: std::net::Ipv4Addr) -> Ipv6Addr {
        let prefix = self.bits.octets();
        let mut v6 = [0u8; 16];
        let mut at = usize::from(self.len / 8);
        v6[..at].copy_from_slice(&prefix[..at]);
        for byte in v4.octets() {
            if at == 8 {
                at += 1;
            }
            v6[at] = byte;
            at += 1;
        }
        Ipv6Addr::from(v6)
    }
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.bits, self.len)
    }
}

/// A `dns64` directive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dns64 {
    pub prefix: Prefix,
    /// `translate_all`: synthesize even when the AAAA answer has AAAA records (not RFC 6147
    /// §5.1.1's rule).
    pub translate_all: bool,
    /// `allow_ipv4`: translate queries that came over IPv4 too.
    pub allow_ipv4: bool,
}

impl Default for Dns64 {
    fn default() -> Self {
        Dns64 {
            prefix: WELL_KNOWN,
            translate_all: false,
            allow_ipv4: false,
        }
    }
}

const SYNTAX: &str = "dns64 [PREFIX] { prefix PREFIX; translate_all; allow_ipv4 }";

/// Reads a `dns64` directive.
pub(crate) fn parse(d: &Directive, out: &mut Out<'_>) -> Option<Dns64> {
    let mut dns64 = Dns64::default();
    let mut ok = out.arity(d, "dns64", 0, 1, "dns64 [PREFIX]");
    if let Some(word) = d.args.first().filter(|_| ok) {
        match prefix(&word.text) {
            Ok(p) => dns64.prefix = p,
            Err(e) => {
                out.err(word.line, format!("dns64: {e}"));
                ok = false;
            }
        }
    }
    for o in &d.block {
        let what = format!("dns64 {}", o.name);
        out.no_block(o, &what);
        match o.name.as_str() {
            "prefix" => {
                if !out.arity(o, &what, 1, 1, "prefix PREFIX") {
                    ok = false;
                    continue;
                }
                match prefix(&o.args[0].text) {
                    Ok(p) => dns64.prefix = p,
                    Err(e) => {
                        out.err(o.args[0].line, format!("dns64: {e}"));
                        ok = false;
                    }
                }
            }
            "translate_all" | "allow_ipv4" => {
                ok &= out.arity(o, &what, 0, 0, &o.name);
                if d.args.is_empty() {
                    let flag = if o.name == "translate_all" {
                        &mut dns64.translate_all
                    } else {
                        &mut dns64.allow_ipv4
                    };
                    *flag = true;
                } else {
                    // CoreDNS's setup reads a PREFIX argument, then the block's lines as
                    // directives of their own: a line without arguments does nothing.
                    out.warn(
                        o.line,
                        format!(
                            "dns64: `{}` has no effect after a PREFIX argument (CoreDNS, and so \
                             node-cache, ignores it there); write the prefix as `prefix PREFIX` \
                             inside the block for it to count",
                            o.name
                        ),
                    );
                }
            }
            other => {
                out.err(
                    o.line,
                    format!("dns64: unknown option `{other}` (expected `{SYNTAX}`)"),
                );
                ok = false;
            }
        }
    }
    ok.then_some(dns64)
}

/// An RFC 6052 prefix, `ADDRESS/LENGTH`: IPv6, a length of [`LENGTHS`]; the bits past the
/// length are dropped (as Go's `net.ParseCIDR` gives the network).
fn prefix(text: &str) -> Result<Prefix, String> {
    let (addr, len) = text
        .split_once('/')
        .ok_or_else(|| format!("`{text}` is not a prefix (ADDRESS/LENGTH, as 64:ff9b::/96)"))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("`{text}`: `{addr}` is not an IP address"))?;
    let IpAddr::V6(addr) = addr else {
        return Err(format!(
            "`{text}` is an IPv4 prefix: dns64 needs an IPv6 one"
        ));
    };
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| *l <= 128)
        .ok_or_else(|| format!("`{text}`: `{len}` is not a prefix length"))?;
    if !LENGTHS.contains(&len) {
        return Err(format!(
            "`{text}`: the prefix length must be 32, 40, 48, 56, 64 or 96 (RFC 6052 §2.2)"
        ));
    }
    let mask = u128::MAX << (128 - u32::from(len));
    Ok(Prefix {
        bits: Ipv6Addr::from(u128::from(addr) & mask),
        len,
    })
}

impl Dns64 {
    /// Whether dns64 handles `query` from `client`: AAAA, class IN (RFC 6147 §5.1), and over
    /// IPv6 unless `allow_ipv4`.
    #[inline]
    pub fn takes(&self, query: &Query<'_>, client: SocketAddr) -> bool {
        query.qtype() == rtype::AAAA
            && query.qclass() == class::IN
            && (self.allow_ipv4 || !is_ipv4(client.ip()))
    }

    /// Whether the AAAA answer `response` (as written for the client) is to be replaced by a
    /// synthesized one: not NXDOMAIN (RFC 6147 §5.1.2), and without AAAA records unless
    /// `translate_all` (§5.1.1). Every other RCODE counts as an empty answer, as in CoreDNS. An
    /// answer cut for the client's size (TC) is passed as it is: the client retries over TCP,
    /// where it is whole.
    pub fn wants(&self, response: &[u8]) -> bool {
        let Some(&[_, _, hi, lo]) = response.first_chunk::<4>() else {
            return false;
        };
        let header = u16::from_be_bytes([hi, lo]);
        if header & flags::RCODE_MASK == u16::from(rcode::NXDOMAIN) || header & flags::TC != 0 {
            return false;
        }
        if self.translate_all {
            return true;
        }
        // Walked, not decoded: every AAAA hit of the block comes here.
        nodedns_wire::answers_of_type(response, rtype::AAAA) == Some(0)
    }

    /// The reply to the AAAA `query`, made from its AAAA answer `aaaa` and the A answer `a` to
    /// the same name (both as written for the client), without OPT (the pipeline adds the
    /// client's); `None` when either does not decode.
    ///
    /// Its RCODE is the A answer's: NOERROR whenever there are A records. (CoreDNS answers
    /// NOERROR whatever the A lookup gave, an empty NOERROR for a SERVFAIL.)
    pub fn synthesize(&self, query: &Query<'_>, aaaa: &[u8], a: &[u8]) -> Option<Vec<u8>> {
        let aaaa = Message::from_vec(aaaa).ok()?;
        let a = Message::from_vec(a).ok()?;
        // The last SOA, as CoreDNS reads it.
        let soa_ttl = aaaa
            .authorities
            .iter()
            .rev()
            .find(|r| r.record_type() == RecordType::SOA)
            .map_or(NO_SOA_TTL, |r| r.ttl);
        let mut reply = Message::response(0, OpCode::Query);
        reply.metadata.message_type = MessageType::Response;
        reply.metadata.recursion_desired = query.rd();
        reply.metadata.checking_disabled = query.cd();
        reply.metadata.truncation = a.metadata.truncation;
        reply.metadata.response_code = a.metadata.response_code;
        let key = query.key();
        let mut question = Question::query(super::name(key.qname())?, RecordType::AAAA);
        question.set_query_class(DNSClass::IN);
        reply.add_query(question);
        reply.answers = a
            .answers
            .into_iter()
            .map(|record| match record.data {
                RData::A(v4) => {
                    let mut aaaa = Record::from_rdata(
                        record.name,
                        record.ttl.min(soa_ttl),
                        RData::AAAA(rdata::AAAA(self.prefix.embed(v4.0))),
                    );
                    aaaa.dns_class = record.dns_class;
                    aaaa
                }
                // RFC 6147 §5.3.3: every other record unchanged.
                _ => record,
            })
            .collect();
        // §5.3.2: the additional section passed unchanged; the authority section is the A
        // answer's, as CoreDNS has it.
        reply.authorities = a.authorities;
        reply.additionals = a.additionals;
        super::encode(&reply)
    }
}

/// Whether `ip` is IPv4 as Go's `To4` sees it: an IPv4 address or an IPv4-mapped IPv6 one.
fn is_ipv4(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(_) => true,
        IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some(),
    }
}

/// `dns64`'s metrics: CoreDNS's names.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// `coredns_dns64_requests_translated_total{server}`: answers synthesized.
    pub translated: Family<Server, Counter>,
}

/// The `server` label (`dns://ADDRESS:PORT`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct Server {
    pub server: String,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let metrics = Metrics::default();
        registry.register(
            "coredns_dns64_requests_translated",
            "Counter of DNS requests translated by dns64.",
            metrics.translated.clone(),
        );
        metrics
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::plugin::testing::load;

    fn dns64(body: &str) -> Result<Option<Dns64>, Vec<String>> {
        load(body).map(|config| config.servers[0].chain.before.dns64)
    }

    fn errs(body: &str) -> Vec<String> {
        dns64(body).expect_err(body)
    }

    #[test]
    fn a_bare_dns64_uses_the_well_known_prefix_for_ipv6_clients_only() {
        assert_eq!(dns64("dns64"), Ok(Some(Dns64::default())));
        assert_eq!(Dns64::default().prefix.to_string(), "64:ff9b::/96");
        assert_eq!(dns64("cache 30"), Ok(None));
    }

    #[test]
    fn the_prefix_is_an_argument_or_an_option_and_the_options_set_their_flags() {
        let custom = Prefix {
            bits: "64:1337::".parse().unwrap(),
            len: 96,
        };
        assert_eq!(dns64("dns64 64:1337::/96").unwrap().unwrap().prefix, custom);
        let block = dns64("dns64 {\n prefix 64:1337::/96\n translate_all\n allow_ipv4\n}")
            .unwrap()
            .unwrap();
        assert_eq!(
            block,
            Dns64 {
                prefix: custom,
                translate_all: true,
                allow_ipv4: true,
            }
        );
        let only = dns64("dns64 {\n translate_all\n}").unwrap().unwrap();
        assert!(only.translate_all && !only.allow_ipv4);
        assert_eq!(only.prefix, WELL_KNOWN);
        let only = dns64("dns64 {\n allow_ipv4\n}").unwrap().unwrap();
        assert!(only.allow_ipv4 && !only.translate_all);
        // The argument and a block together: the block's `prefix` comes last and wins.
        let both = dns64("dns64 2001:db8::/32 {\n prefix 2001:db8:1::/48\n}")
            .unwrap()
            .unwrap();
        assert_eq!(both.prefix.to_string(), "2001:db8:1::/48");
    }

    /// node-cache (CoreDNS 1.10, and CoreDNS since) reads `dns64 PREFIX { translate_all }` as
    /// the prefix alone: the options do nothing there, and nothing here, with a warning.
    #[test]
    fn options_after_a_prefix_argument_do_nothing_as_in_coredns_and_are_warned_about() {
        let config = load("dns64 64:ff9b::/96 {\n translate_all\n allow_ipv4\n}").unwrap();
        assert_eq!(config.servers[0].chain.before.dns64, Some(Dns64::default()));
        let warnings: Vec<&String> = config
            .warnings
            .iter()
            .filter(|w| w.contains("has no effect after a PREFIX argument"))
            .collect();
        assert_eq!(warnings.len(), 2, "{:?}", config.warnings);
        assert!(warnings[0].starts_with("Corefile:3:"), "{warnings:?}");
    }

    #[test]
    fn host_bits_past_the_prefix_length_are_dropped() {
        let p = dns64("dns64 2001:db8:aaaa:bbbb::1/48")
            .unwrap()
            .unwrap()
            .prefix;
        assert_eq!(p.to_string(), "2001:db8:aaaa::/48");
    }

    #[test]
    fn bad_forms_are_refused_with_their_line_and_reason() {
        for (body, reason) in [
            (
                "dns64 64:ff9b::/96 64:ff9b::/96",
                "expected `dns64 [PREFIX]`",
            ),
            ("dns64 64:ff9b::", "is not a prefix"),
            ("dns64 nonsense/96", "is not an IP address"),
            ("dns64 10.0.0.0/8", "is an IPv4 prefix"),
            ("dns64 64:ff9b::/129", "is not a prefix length"),
            ("dns64 64:ff9b::/x", "is not a prefix length"),
            ("dns64 64:ff9b::/33", "must be 32, 40, 48, 56, 64 or 96"),
            ("dns64 64:ff9b::/128", "must be 32, 40, 48, 56, 64 or 96"),
            ("dns64 {\n prefix\n}", "expected `prefix PREFIX`"),
            (
                "dns64 {\n prefix 64:ff9b::/96 extra\n}",
                "expected `prefix PREFIX`",
            ),
            ("dns64 {\n prefix 64:ff9b::/100\n}", "must be 32, 40"),
            ("dns64 {\n translate_all yes\n}", "expected `translate_all`"),
            ("dns64 {\n allow_ipv4 yes\n}", "expected `allow_ipv4`"),
            ("dns64 {\n allow_ipv6\n}", "unknown option `allow_ipv6`"),
            ("dns64 {\n translate_all {\n }\n}", "takes no `{ }` block"),
        ] {
            let problems = errs(body);
            assert!(
                problems
                    .iter()
                    .any(|p| p.contains(reason) && p.starts_with("Corefile:")),
                "{body}: {problems:?}"
            );
        }
        let twice = errs("dns64\n    dns64 {\n translate_all\n}");
        assert!(twice[0].contains("already given"), "{twice:?}");
    }

    /// RFC 6052 §2.4's examples: 192.0.2.33 under each prefix length.
    #[test]
    fn ipv4_bytes_go_where_rfc_6052_places_them() {
        let v4 = Ipv4Addr::new(192, 0, 2, 33);
        for (prefix, len, expected) in [
            ("2001:db8::", 32, "2001:db8:c000:221::"),
            ("2001:db8:100::", 40, "2001:db8:1c0:2:21::"),
            ("2001:db8:122::", 48, "2001:db8:122:c000:2:2100::"),
            ("2001:db8:122:300::", 56, "2001:db8:122:3c0:0:221::"),
            ("2001:db8:122:344::", 64, "2001:db8:122:344:c0:2:2100:0"),
            ("2001:db8:122:344::", 96, "2001:db8:122:344::192.0.2.33"),
            ("64:ff9b::", 96, "64:ff9b::192.0.2.33"),
        ] {
            let p = Prefix {
                bits: prefix.parse().unwrap(),
                len,
            };
            assert_eq!(p.embed(v4), expected.parse::<Ipv6Addr>().unwrap(), "/{len}");
            if len != 96 {
                assert_eq!(p.embed(v4).octets()[8], 0, "/{len}: the u octet stays zero");
            }
        }
    }

    /// `name. AAAA`, with RD, CD when `cd`, and an OPT.
    fn aaaa_query(cd: bool) -> Vec<u8> {
        let mut q = vec![
            0x12,
            0x34,
            0x01,
            if cd { 0x10 } else { 0 },
            0,
            1,
            0,
            0,
            0,
            0,
            0,
            1,
        ];
        q.extend_from_slice(b"\x03www\x07example\x00\x00\x1c\x00\x01");
        q.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0]);
        q
    }

    /// A reply to `www.example.` of type `qtype`, authoritative, with `answers` and
    /// `authorities`.
    fn reply(
        qtype: RecordType,
        rcode: hickory_proto::op::ResponseCode,
        answers: Vec<Record>,
        authorities: Vec<Record>,
    ) -> Vec<u8> {
        let mut m = Message::response(0x1234, OpCode::Query);
        m.metadata.authoritative = true;
        m.metadata.recursion_desired = true;
        m.metadata.response_code = rcode;
        m.add_query(Question::query(name("www.example."), qtype));
        m.answers = answers;
        m.authorities = authorities;
        super::super::encode(&m).unwrap()
    }

    fn name(text: &str) -> hickory_proto::rr::Name {
        hickory_proto::rr::Name::from_ascii(text).unwrap()
    }

    fn a(ttl: u32, ip: [u8; 4]) -> Record {
        Record::from_rdata(name("www.example."), ttl, RData::A(rdata::A(ip.into())))
    }

    fn soa(ttl: u32) -> Record {
        Record::from_rdata(
            name("example."),
            ttl,
            RData::SOA(rdata::SOA::new(
                name("ns.example."),
                name("hostmaster.example."),
                1,
                7200,
                1800,
                86400,
                300,
            )),
        )
    }

    fn cname() -> Record {
        Record::from_rdata(
            name("www.example."),
            120,
            RData::CNAME(rdata::CNAME(name("web.example."))),
        )
    }

    fn aaaa(ip: &str) -> Record {
        Record::from_rdata(
            name("www.example."),
            30,
            RData::AAAA(rdata::AAAA(ip.parse().unwrap())),
        )
    }

    use hickory_proto::op::ResponseCode;

    #[test]
    fn nodata_and_errors_are_translated_nxdomain_and_real_aaaa_records_are_not() {
        let d = Dns64::default();
        let nodata = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![],
            vec![soa(60)],
        );
        assert!(d.wants(&nodata));
        let servfail = reply(RecordType::AAAA, ResponseCode::ServFail, vec![], vec![]);
        assert!(
            d.wants(&servfail),
            "every RCODE but NXDOMAIN, as in CoreDNS"
        );
        let nxdomain = reply(
            RecordType::AAAA,
            ResponseCode::NXDomain,
            vec![],
            vec![soa(60)],
        );
        assert!(!d.wants(&nxdomain));
        let real = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![aaaa("2001:db8::6")],
            vec![],
        );
        assert!(!d.wants(&real));
        // A CNAME to a name without AAAA: no AAAA record, translated.
        let chain = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![cname()],
            vec![soa(60)],
        );
        assert!(d.wants(&chain));
        let all = Dns64 {
            translate_all: true,
            ..d
        };
        assert!(all.wants(&real));
        assert!(!all.wants(&nxdomain));
        let mut cut = nodata.clone();
        cut[2] |= 0x02;
        assert!(!all.wants(&cut), "a truncated answer is passed as it is");
        assert!(!d.wants(&[0, 1]));
    }

    #[test]
    fn each_a_record_becomes_an_aaaa_record_with_the_smaller_of_its_ttl_and_the_soas() {
        let d = Dns64::default();
        let packet = aaaa_query(true);
        let query = Query::parse(&packet).unwrap();
        let nodata = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![],
            vec![soa(40)],
        );
        let answer = reply(
            RecordType::A,
            ResponseCode::NoError,
            vec![cname(), a(30, [192, 0, 2, 1]), a(300, [192, 0, 2, 2])],
            vec![],
        );
        let out = Message::from_vec(&d.synthesize(&query, &nodata, &answer).unwrap()).unwrap();
        assert!(
            !out.metadata.authoritative,
            "synthesized, not authoritative"
        );
        assert!(out.metadata.recursion_desired && out.metadata.checking_disabled);
        assert!(!out.metadata.recursion_available);
        assert_eq!(out.metadata.response_code, ResponseCode::NoError);
        assert_eq!(out.queries[0].query_type(), RecordType::AAAA);
        let records: Vec<String> = out.answers.iter().map(ToString::to_string).collect();
        assert_eq!(
            records,
            [
                "www.example. 120 IN CNAME web.example.",
                "www.example. 30 IN AAAA 64:ff9b::c000:201",
                "www.example. 40 IN AAAA 64:ff9b::c000:202",
            ]
        );

        // No SOA in the AAAA answer (translate_all over real AAAA records): at most 600 s.
        let real = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![aaaa("2001:db8::6")],
            vec![],
        );
        let long = reply(
            RecordType::A,
            ResponseCode::NoError,
            vec![a(3600, [10, 0, 0, 1])],
            vec![],
        );
        let out = Message::from_vec(&d.synthesize(&query, &real, &long).unwrap()).unwrap();
        assert_eq!(out.answers.len(), 1);
        assert_eq!(out.answers[0].ttl, 600);
    }

    #[test]
    fn an_a_answer_without_records_gives_its_authority_and_rcode() {
        let d = Dns64::default();
        let packet = aaaa_query(false);
        let query = Query::parse(&packet).unwrap();
        let nodata = reply(
            RecordType::AAAA,
            ResponseCode::NoError,
            vec![],
            vec![soa(40)],
        );
        let empty = reply(RecordType::A, ResponseCode::NoError, vec![], vec![soa(20)]);
        let out = Message::from_vec(&d.synthesize(&query, &nodata, &empty).unwrap()).unwrap();
        assert!(out.answers.is_empty());
        assert_eq!(out.authorities.len(), 1);
        assert_eq!(out.authorities[0].ttl, 20, "the A answer's SOA");
        let failed = reply(RecordType::A, ResponseCode::ServFail, vec![], vec![]);
        let out = Message::from_vec(&d.synthesize(&query, &nodata, &failed).unwrap()).unwrap();
        assert_eq!(out.metadata.response_code, ResponseCode::ServFail);
        assert!(d.synthesize(&query, &nodata, &[0, 1, 2]).is_none());
    }

    #[test]
    fn ipv4_clients_are_left_alone_unless_allowed() {
        let d = Dns64::default();
        let packet = aaaa_query(false);
        let query = Query::parse(&packet).unwrap();
        let v6: SocketAddr = "[fd00::7]:5353".parse().unwrap();
        let v4: SocketAddr = "10.0.0.7:5353".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.7]:5353".parse().unwrap();
        assert!(d.takes(&query, v6));
        assert!(!d.takes(&query, v4));
        assert!(
            !d.takes(&query, mapped),
            "an IPv4-mapped address is IPv4, as in Go"
        );
        let allowed = Dns64 {
            allow_ipv4: true,
            ..d
        };
        assert!(allowed.takes(&query, v4) && allowed.takes(&query, mapped));
        let mut a_packet = packet.clone();
        a_packet[12 + 13 + 1] = 1;
        assert!(
            !allowed.takes(&Query::parse(&a_packet).unwrap(), v6),
            "A is not translated"
        );
        let mut chaos = packet;
        chaos[12 + 13 + 3] = 3;
        assert!(
            !allowed.takes(&Query::parse(&chaos).unwrap(), v6),
            "class IN only"
        );
    }
}
