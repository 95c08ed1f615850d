//! Behaviours of CoreDNS's `template` (its `template_test.go` and `setup_test.go` cases, and the
//! answers node-cache gave for the corpus' Corefiles), checked on [`Template`].

use std::net::SocketAddr;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RecordType};
use prometheus_client::registry::Registry;

use super::{Metrics, Outcome, Template, add_follow_ups, follow_ups};
use crate::config::values;

const CLIENT: &str = "10.240.0.1:40053";

/// The `template` lines of a one-block Corefile whose zones are `zones`.
fn parse(zones: &[&str], body: &str) -> Result<Vec<Template>, Vec<String>> {
    let text = format!("{} {{\n{body}\n}}\n", zones.join(" "));
    let blocks = crate::plugin::testing::blocks(&text);
    let zones: Vec<String> = zones.iter().map(|z| values::zone(z).unwrap()).collect();
    let mut problems = Vec::new();
    let templates: Vec<Template> = blocks[0]
        .directives
        .iter()
        .filter(|d| d.name == "template")
        .filter_map(|d| Template::parse(d, &zones, "Corefile", &mut problems))
        .collect();
    if problems.is_empty() {
        Ok(templates)
    } else {
        Err(problems.iter().map(ToString::to_string).collect())
    }
}

fn query(name: &str, rtype: RecordType, class: DNSClass) -> Message {
    let mut msg = Message::new(0x1234, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = true;
    let mut q = Query::query(Name::from_ascii(name).unwrap(), rtype);
    q.query_class = class;
    msg.queries.push(q);
    msg
}

/// The chain of a block's templates: the first that does not pass the query on.
fn run(templates: &[Template], name: &str, rtype: RecordType) -> Outcome {
    run_class(templates, name, rtype, DNSClass::IN)
}

fn run_class(templates: &[Template], name: &str, rtype: RecordType, class: DNSClass) -> Outcome {
    let q = query(name, rtype, class);
    let client: SocketAddr = CLIENT.parse().unwrap();
    for t in templates {
        match t.answer(&q, client) {
            Outcome::Next => continue,
            other => return other,
        }
    }
    Outcome::Next
}

fn reply(outcome: Outcome) -> Message {
    match outcome {
        Outcome::Answer(m) => m,
        other => panic!("expected an answer, got {other:?}"),
    }
}

fn lines(records: &[hickory_proto::rr::Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| {
            format!(
                "{} {} {} {} {}",
                r.name,
                r.ttl,
                r.dns_class,
                r.record_type(),
                r.data
            )
        })
        .collect()
}

#[test]
fn aaaa_rcode_noerror_answers_nodata_without_soa_and_passes_other_types_on() {
    // deliveryhero-logging-no-ipv6 (`noIPv6Lookups`): `template IN AAAA { rcode NOERROR }`.
    let t = parse(&["cluster.local"], "template IN AAAA {\n rcode NOERROR\n}").unwrap();
    let m = reply(run(&t, "web.default.svc.cluster.local.", RecordType::AAAA));
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.metadata.authoritative);
    assert!(m.metadata.recursion_desired);
    assert!(!m.metadata.recursion_available);
    assert_eq!(m.metadata.message_type, MessageType::Response);
    assert_eq!(m.metadata.id, 0x1234);
    assert!(m.answers.is_empty() && m.authorities.is_empty() && m.additionals.is_empty());
    assert!(m.edns.is_none());
    assert_eq!(
        m.queries,
        query(
            "web.default.svc.cluster.local.",
            RecordType::AAAA,
            DNSClass::IN
        )
        .queries
    );
    assert!(matches!(
        run(&t, "web.default.svc.cluster.local.", RecordType::A),
        Outcome::Next
    ));
    // A query of type ANY matches any template type.
    assert!(matches!(
        run(&t, "web.default.svc.cluster.local.", RecordType::ANY),
        Outcome::Answer(_)
    ));
    // Outside the block's zones: not this template's.
    assert!(matches!(
        run(&t, "www.example.", RecordType::AAAA),
        Outcome::Next
    ));
}

#[test]
fn class_any_template_answers_every_class_and_class_in_only_in() {
    // lablabs-hosts-template: `template ANY AAAA { rcode NOERROR }` in `.`.
    let any = parse(&["."], "template ANY AAAA {\n rcode NOERROR\n}").unwrap();
    let m = reply(run_class(
        &any,
        "blabla.lala.",
        RecordType::AAAA,
        DNSClass::CH,
    ));
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    let inet = parse(&["."], "template IN AAAA {\n rcode NOERROR\n}").unwrap();
    assert!(matches!(
        run_class(&inet, "blabla.lala.", RecordType::AAAA, DNSClass::CH),
        Outcome::Next
    ));
    assert!(matches!(
        run_class(&inet, "blabla.lala.", RecordType::AAAA, DNSClass::ANY),
        Outcome::Answer(_)
    ));
}

const NXDOMAIN_AND_IP: &str = r#"
template ANY ANY cluster.local {
    match "[.](com|net|org)[.]svc[.]cluster[.]local[.]$"
    rcode NXDOMAIN
    fallthrough
}
template IN A example {
    match "^ip-(?P<a>[0-9]+)-(?P<b>[0-9]+)-(?P<c>[0-9]+)-(?P<d>[0-9]+)[.]example[.]$"
    answer "{{ .Name }} 60 IN A {{ .Group.a }}.{{ .Group.b }}.{{ .Group.c }}.{{ .Group.d }}"
    fallthrough
}
"#;

#[test]
fn nxdomain_for_search_suffixes_has_an_empty_authority() {
    // variation-template-nxdomain: node-cache answers NXDOMAIN, `aa rd`, no SOA.
    let t = parse(&["."], NXDOMAIN_AND_IP).unwrap();
    for rtype in [RecordType::A, RecordType::AAAA] {
        let m = reply(run(&t, "www.example.com.svc.cluster.local.", rtype));
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        assert!(m.metadata.authoritative);
        assert!(m.authorities.is_empty());
    }
    // The zone matches, the regexp does not, `fallthrough`: on to the next plugin.
    assert!(matches!(
        run(&t, "kubernetes.default.svc.cluster.local.", RecordType::A),
        Outcome::Next
    ));
}

#[test]
fn named_groups_build_the_answer() {
    // variation-template-nxdomain: `ip-10-1-2-3.example. A` → 10.1.2.3 (TTL 60 here; the cache
    // behind which the template runs caps it to 30).
    let t = parse(&["."], NXDOMAIN_AND_IP).unwrap();
    let m = reply(run(&t, "IP-10-1-2-3.Example.", RecordType::A));
    assert_eq!(lines(&m.answers), ["ip-10-1-2-3.example. 60 IN A 10.1.2.3"]);
    // The question keeps the client's case; the name the template sees is lowercased.
    assert_eq!(m.queries[0].name.to_ascii(), "IP-10-1-2-3.Example.");
    // Not the template's type: on to forward.
    assert!(matches!(
        run(&t, "ip-10-1-2-3.example.", RecordType::AAAA),
        Outcome::Next
    ));
}

#[test]
fn no_regexp_match_without_fallthrough_is_servfail() {
    let t = parse(
        &["."],
        "template ANY ANY example {\n match ^ip-(?P<a>[0-9]+)[.]example[.]$\n answer \"{{ .Name }} 60 IN A 10.0.0.{{ .Group.a }}\"\n}",
    )
    .unwrap();
    assert!(matches!(
        run(&t, "test.example.", RecordType::A),
        Outcome::ServFail
    ));
    // A name outside the template's zones is passed on whatever `fallthrough` says.
    assert!(matches!(
        run(&t, "test.invalid.", RecordType::A),
        Outcome::Next
    ));
    let m = reply(run(&t, "ip-7.example.", RecordType::A));
    assert_eq!(lines(&m.answers), ["ip-7.example. 60 IN A 10.0.0.7"]);
}

#[test]
fn fallthrough_zones_limit_what_falls_through() {
    let t = parse(
        &["."],
        "template ANY ANY {\n match ^nomatch$\n fallthrough in-addr.arpa\n}",
    )
    .unwrap();
    assert!(matches!(
        run(&t, "4.3.2.1.in-addr.arpa.", RecordType::PTR),
        Outcome::Next
    ));
    assert!(matches!(
        run(&t, "www.example.", RecordType::A),
        Outcome::ServFail
    ));
}

#[test]
fn several_templates_run_in_file_order_and_the_first_match_wins() {
    let t = parse(
        &["."],
        "template IN A {\n match ^a[.]\n answer \"{{ .Name }} 5 IN A 192.0.2.1\"\n fallthrough\n}\n\
         template IN A {\n answer \"{{ .Name }} 5 IN A 192.0.2.2\"\n}",
    )
    .unwrap();
    assert_eq!(
        lines(&reply(run(&t, "a.example.", RecordType::A)).answers),
        ["a.example. 5 IN A 192.0.2.1"]
    );
    assert_eq!(
        lines(&reply(run(&t, "b.example.", RecordType::A)).answers),
        ["b.example. 5 IN A 192.0.2.2"]
    );
}

#[test]
fn sections_remote_parse_int_and_the_longest_zone() {
    // CoreDNS's ExampleDomainANSMatch, ExampleDomainMatchHexIp and the .Remote template.
    let t = parse(
        &["."],
        r#"template IN ANY example. sub.example. {
    match "^ip(?P<b>[0-9a-f]{2})(?P<c>[0-9a-f]{2})[.]"
    answer "{{ .Name }} 60 IN A 10.{{ parseInt .Group.b 16 8 }}.{{ parseInt .Group.c 16 8 }}.{{ .Remote }}"
    additional "ns0.{{ .Zone }} 60 IN A 10.0.0.1"
    authority "{{ .Zone }} 60 IN NS ns0.{{ .Zone }}"
    authority "{{ .Zone }} 60 IN SOA ns0.{{ .Zone }} hostmaster.{{ .Zone }} 1 7200 1800 86400 {{ .Type }}"
}"#,
    );
    // `{{ .Type }}` is no number: the SOA fails to parse when rendered, not when read.
    let t = t.unwrap();
    assert!(matches!(
        run(&t, "ip0a5f.sub.example.", RecordType::A),
        Outcome::ServFail
    ));

    let t = parse(
        &["."],
        r#"template IN ANY example. sub.example. {
    match "^ip(?P<b>[0-9a-f]{2})(?P<c>[0-9a-f]{2})[.]"
    answer "{{ .Name }} 60 IN A 10.{{ parseInt .Group.b 16 8 }}.{{ parseInt .Group.c 16 8 }}.1"
    answer "{{ .Name }} 60 IN TXT \"{{ .Remote }} {{ .Class }} {{ .Type }}\""
    additional "ns0.{{ .Zone }} 60 IN A 10.0.0.1"
    authority "{{ .Zone }} 60 IN NS ns0.{{ .Zone }}"
}"#,
    )
    .unwrap();
    let m = reply(run(&t, "ip0a5f.sub.example.", RecordType::A));
    assert_eq!(
        lines(&m.answers),
        [
            "ip0a5f.sub.example. 60 IN A 10.10.95.1",
            "ip0a5f.sub.example. 60 IN TXT 10.240.0.1 IN A"
        ]
    );
    assert_eq!(lines(&m.additionals), ["ns0.sub.example. 60 IN A 10.0.0.1"]);
    assert_eq!(
        lines(&m.authorities),
        ["sub.example. 60 IN NS ns0.sub.example."]
    );
    // A query of type ANY gets the template's type name, here ANY.
    let m = reply(run(&t, "ip0a5f.example.", RecordType::ANY));
    assert_eq!(
        lines(&m.answers)[1],
        "ip0a5f.example. 60 IN TXT 10.240.0.1 IN ANY"
    );
}

#[test]
fn render_and_record_failures_are_servfail_and_counted() {
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let mut t = parse(
        &["."],
        r#"template ANY ANY {
    match "^(a)[.]"
    answer "{{ .Name }} 60 IN TXT \"{{ index .Match 2 }}\""
    fallthrough
}
template ANY ANY {
    match "^(b)[.]"
    answer "{{ .Name }}"
    fallthrough
}
template ANY ANY {
    match "^(c)[.]"
    additional "{{ .Name }} 60 IN TXT \"{{ parseInt \"gg\" 16 8 }}\""
    fallthrough
}
template ANY ANY {
    match "^(d)[.]"
    rcode SERVFAIL
}"#,
    )
    .unwrap();
    for t in &mut t {
        t.instrument(&metrics, "dns://:53");
    }
    for name in ["a.example.", "b.example.", "c.example.", "d.example."] {
        assert!(
            matches!(run(&t, name, RecordType::A), Outcome::ServFail),
            "{name}"
        );
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let count = |needle: &str| {
        text.lines()
            .filter(|l| !l.starts_with('#') && l.starts_with(needle))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum::<u64>()
    };
    // Each of the four matched (rcode SERVFAIL counts as a match too).
    assert_eq!(count("coredns_template_matches_total{"), 4, "{text}");
    assert_eq!(
        count("coredns_template_template_failures_total{"),
        2,
        "{text}"
    );
    assert_eq!(count("coredns_template_rr_failures_total{"), 1, "{text}");
    assert!(
        text.contains(r#"coredns_template_matches_total{server="dns://:53",zone=".",view="",class="IN",type="A"} 4"#),
        "{text}"
    );
    assert!(text.contains(r#"section="additional""#), "{text}");
}

#[test]
fn soa_authority_and_nxdomain_as_coredns_invalid_domain_template() {
    let t = parse(
        &["."],
        r#"template ANY ANY invalid {
    rcode NXDOMAIN
    authority "invalid. 60 {{ .Class }} SOA a.invalid. b.invalid. (1 60 60 60 60)"
}"#,
    )
    .unwrap();
    let m = reply(run(&t, "test.invalid.", RecordType::MX));
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(
        lines(&m.authorities),
        ["invalid. 60 IN SOA a.invalid. b.invalid. 1 60 60 60 60"]
    );
}

#[test]
fn records_default_to_ttl_3600_class_in_and_names_under_the_root() {
    let t = parse(
        &["."],
        "template IN CNAME {\n answer \"example.net CNAME target.example.com\"\n}",
    )
    .unwrap();
    let m = reply(run(&t, "example.net.", RecordType::CNAME));
    assert_eq!(
        lines(&m.answers),
        ["example.net. 3600 IN CNAME target.example.com."]
    );
}

#[test]
fn ederror_adds_an_extended_dns_error_option() {
    let t = parse(
        &["."],
        "template ANY ANY invalid {\n rcode NXDOMAIN\n ederror 21 \"Blocked by policy\"\n}",
    )
    .unwrap();
    let m = reply(run(&t, "test.invalid.", RecordType::A));
    let edns = m.edns.expect("an OPT record");
    let wire = Message::to_vec(&{
        let mut copy = query("test.invalid.", RecordType::A, DNSClass::IN);
        copy.edns = Some(edns.clone());
        copy
    })
    .unwrap();
    let expected: Vec<u8> = [0, 15, 0, 19, 0, 21]
        .into_iter()
        .chain(*b"Blocked by policy")
        .collect();
    assert!(
        wire.windows(expected.len())
            .any(|w| w == expected.as_slice())
    );
}

#[test]
fn problems_are_all_reported_with_their_lines() {
    let errors = parse(
        &["."],
        "template in A\ntemplate IN BOGUS {\n match \"(\"\n answer \"{{ printf .Name }}\"\n rcode NOPE\n upstream\n answe x\n ederror x\n}",
    )
    .unwrap_err();
    let expect = [
        "Corefile:2: template: `in` is not a query class",
        "Corefile:3: template: `BOGUS` is not a record type",
        "Corefile:4: template: could not parse regex `(`",
        "Corefile:5: template: could not compile the answer template `{{ printf .Name }}`: the function `printf` is not supported",
        "Corefile:6: template: unknown rcode `NOPE`",
        "Corefile:8: template: unknown option `answe`",
        "Corefile:9: template: the extended DNS error code must be a number",
    ];
    assert_eq!(errors.len(), expect.len(), "{errors:#?}");
    for (got, want) in errors.iter().zip(expect) {
        assert!(got.starts_with(want), "{got}\n does not start with\n{want}");
    }
    assert!(parse(&["."], "template IN").unwrap_err()[0].contains("TYPE is missing"));
    assert!(parse(&["."], "template").unwrap_err()[0].contains("CLASS and TYPE are missing"));
    assert!(
        parse(&["."], "template IN A {\n rcode BADCOOKIE\n}").unwrap_err()[0]
            .contains("extended RCODE")
    );
    assert!(
        parse(&["."], "template IN A {\n match\n}").unwrap_err()[0]
            .contains("at least one argument")
    );
}

#[test]
fn a_cname_answer_to_an_a_query_is_followed() {
    // CoreDNS's TestTruncatedCNAME: the target's records follow the CNAME, and the reply takes
    // the lookup's TC bit.
    let t = parse(
        &["."],
        "template IN A test {\n match ^cname[.]test[.]$\n answer \"cname.test. 600 IN CNAME test.up\"\n}",
    )
    .unwrap();
    let mut m = reply(run(&t, "cname.test.", RecordType::A));
    let asks = follow_ups(&m);
    assert_eq!(
        asks,
        [Query::query(
            Name::from_ascii("test.up.").unwrap(),
            RecordType::A
        )]
    );
    let mut up = query("test.up.", RecordType::A, DNSClass::IN);
    up.metadata.truncation = true;
    up.answers.push(hickory_proto::rr::Record::from_rdata(
        Name::from_ascii("test.up.").unwrap(),
        600,
        hickory_proto::rr::RData::A("1.2.3.4".parse().unwrap()),
    ));
    add_follow_ups(&mut m, vec![Some(up)]);
    assert!(m.metadata.truncation);
    assert_eq!(
        lines(&m.answers),
        [
            "cname.test. 600 IN CNAME test.up.",
            "test.up. 600 IN A 1.2.3.4"
        ]
    );
    // Only A and AAAA queries follow; a failed lookup adds nothing.
    let t = parse(
        &["."],
        "template IN ANY test {\n answer \"cname.test. 600 IN CNAME test.up\"\n}",
    )
    .unwrap();
    assert!(follow_ups(&reply(run(&t, "cname.test.", RecordType::TXT))).is_empty());
    let mut m = reply(run(&t, "cname.test.", RecordType::AAAA));
    assert_eq!(follow_ups(&m).len(), 1);
    add_follow_ups(&mut m, vec![None]);
    assert_eq!(m.answers.len(), 1);
    assert!(!m.metadata.truncation);
}
