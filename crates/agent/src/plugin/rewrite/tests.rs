//! Behaviours of CoreDNS's `rewrite` (its `rewrite_test.go` cases and README examples, and the
//! answers node-cache gave for the corpus' Corefiles), checked on [`Rewrite`] and [`Revert`].

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::opt::{ClientSubnet, EdnsCode, EdnsOption};
use hickory_proto::rr::rdata::{A, CNAME, SOA};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

use super::{InvalidName, Rewrite, Source};

fn source() -> Source {
    Source {
        client: "10.240.0.7:40053".parse().unwrap(),
        server: "169.254.20.10:53".parse().unwrap(),
        tcp: false,
    }
}

/// The `rewrite` lines of a one-block Corefile, or the problems as `file:line: message`.
fn parse(body: &str) -> Result<Rewrite, Vec<String>> {
    let text = format!(". {{\n{body}\n}}\n");
    let blocks = crate::plugin::testing::blocks(&text);
    let mut rewrite = Rewrite::default();
    let mut problems = Vec::new();
    for d in blocks[0].directives.iter().filter(|d| d.name == "rewrite") {
        rewrite.add(d, "Corefile", &mut problems);
    }
    if problems.is_empty() {
        Ok(rewrite)
    } else {
        Err(problems.iter().map(ToString::to_string).collect())
    }
}

fn name(s: &str) -> Name {
    Name::from_ascii(s).unwrap()
}

fn query(qname: &str, rtype: RecordType) -> Message {
    let mut msg = Message::new(0x4242, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = true;
    msg.queries.push(Query::query(name(qname), rtype));
    msg
}

/// What an authoritative upstream answers to `asked`: one A record for its name, or the records
/// given.
fn upstream(asked: &Message, answers: Vec<Record>) -> Message {
    let mut reply = Message::new(asked.metadata.id, MessageType::Response, OpCode::Query);
    reply.metadata.authoritative = true;
    reply.queries = asked.queries.clone();
    reply.answers = answers;
    reply
}

fn a(owner: &str, ttl: u32, ip: [u8; 4]) -> Record {
    Record::from_rdata(
        name(owner),
        ttl,
        RData::A(A::new(ip[0], ip[1], ip[2], ip[3])),
    )
}

fn lines(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| format!("{} {} {} {}", r.name, r.ttl, r.record_type(), r.data))
        .collect()
}

/// The query after the rules, as it goes on: `name type class`.
fn rewritten(rw: &Rewrite, qname: &str, rtype: RecordType, class: DNSClass) -> String {
    let mut msg = query(qname, rtype);
    msg.queries[0].query_class = class;
    rw.request(&mut msg, &source()).unwrap();
    let q = &msg.queries[0];
    format!("{} {} {}", q.name, q.query_type, q.query_class)
}

#[test]
fn rules_run_in_order_and_stop_or_continue_as_coredns_rewrite_test() {
    // CoreDNS's TestRewrite, with its rules in its order.
    let rw = parse(
        r#"rewrite name from.nl. to.nl.
rewrite name regex (core)\.(dns)\.(rocks)\.(nl) {2}.{1}.{3}.{4} answer name (dns)\.(core)\.(rocks)\.(nl) {2}.{1}.{3}.{4}
rewrite name exact from.exact.nl. to.nl.
rewrite name prefix prefix to
rewrite name suffix .suffix. .nl.
rewrite name substring from.substring to
rewrite name regex (f.*m)\.regex\.(nl) to.{2}
rewrite continue name regex consul\.(rocks) core.dns.{1}
rewrite name core.dns.rocks to.nl.
rewrite continue class HS CH
rewrite stop class CH IN
rewrite type ANY HINFO"#,
    )
    .unwrap();
    let ch = DNSClass::CH;
    let hs = DNSClass::HS;
    let inet = DNSClass::IN;
    use RecordType::{A, ANY};
    for (from, t, c, to) in [
        ("from.nl.", A, inet, "to.nl. A IN"),
        ("a.nl.", A, inet, "a.nl. A IN"),
        ("a.nl.", A, ch, "a.nl. A IN"),
        ("a.nl.", ANY, inet, "a.nl. HINFO IN"),
        // The name is rewritten and that rule stops: the type is not.
        ("from.nl.", ANY, inet, "to.nl. ANY IN"),
        ("from.exact.nl.", A, inet, "to.nl. A IN"),
        ("prefix.nl.", A, inet, "to.nl. A IN"),
        ("to.suffix.", A, inet, "to.nl. A IN"),
        ("from.substring.nl.", A, inet, "to.nl. A IN"),
        ("from.regex.nl.", A, inet, "to.nl. A IN"),
        // `continue` hands the rewritten name to the next rules.
        ("consul.rocks.", A, inet, "to.nl. A IN"),
        ("a.nl.", ANY, ch, "a.nl. ANY IN"),
        // HS → CH (continue), then CH → IN (stop).
        ("a.nl.", ANY, hs, "a.nl. ANY IN"),
        ("core.dns.rocks.nl.", A, inet, "dns.core.rocks.nl. A IN"),
    ] {
        assert_eq!(rewritten(&rw, from, t, c), to, "{from} {t} {c}");
    }
}

#[test]
fn exact_name_rule_reverts_answer_names_in_lowercase() {
    // issue-dns-525-rewrite: `rewrite name git.my.domain git.gogs.svc.k8s.cluster`, no answer
    // rule; node-cache answers `git.my.domain. 30 IN A 10.96.60.60` also when asked in capitals.
    let rw = parse("rewrite name git.my.domain git.gogs.svc.k8s.cluster").unwrap();
    for asked in ["git.my.domain.", "GIT.my.domain."] {
        let mut msg = query(asked, RecordType::A);
        let revert = rw.request(&mut msg, &source()).unwrap().expect("a rewrite");
        assert_eq!(msg.queries[0].name.to_ascii(), "git.gogs.svc.k8s.cluster.");
        let mut reply = upstream(
            &msg,
            vec![a("git.gogs.svc.k8s.cluster.", 30, [10, 96, 60, 60])],
        );
        revert.reply(&mut reply);
        assert_eq!(reply.queries[0].name.to_ascii(), asked);
        assert_eq!(lines(&reply.answers), ["git.my.domain. 30 A 10.96.60.60"]);
    }
    let mut other = query("other.my.domain.", RecordType::A);
    assert!(rw.request(&mut other, &source()).unwrap().is_none());
    assert_eq!(other, query("other.my.domain.", RecordType::A));
}

#[test]
fn substring_rule_restores_the_question_of_a_refusal() {
    // kubekey-v3: the rewritten name is in no zone the upstream serves; the client gets the
    // upstream's REFUSED with its own question.
    let rw =
        parse("rewrite name substring website.tld website.namespace.svc.cluster.local").unwrap();
    let mut msg = query("www.website.tld.mydomain.tld.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().expect("a rewrite");
    assert_eq!(
        msg.queries[0].name.to_ascii(),
        "www.website.namespace.svc.cluster.local.mydomain.tld."
    );
    let mut reply = upstream(&msg, Vec::new());
    reply.metadata.response_code = ResponseCode::Refused;
    reply.metadata.authoritative = false;
    revert.reply(&mut reply);
    assert_eq!(
        reply.queries[0].name.to_ascii(),
        "www.website.tld.mydomain.tld."
    );
    assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
    // Without `answer auto`, substring leaves the records' names alone.
    let mut msg = query("www.website.tld.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    let mut reply = upstream(
        &msg,
        vec![a(
            "www.website.namespace.svc.cluster.local.",
            5,
            [192, 0, 2, 9],
        )],
    );
    revert.reply(&mut reply);
    assert_eq!(
        lines(&reply.answers),
        ["www.website.namespace.svc.cluster.local. 5 A 192.0.2.9"]
    );
}

#[test]
fn block_form_with_answer_auto() {
    // kubekey-v4: `rewrite continue { name exact www.example.io www.example.com; answer auto }`.
    let rw = parse(
        "rewrite continue {\n    name exact www.example.io www.example.com\n    answer auto\n}",
    )
    .unwrap();
    let mut msg = query("www.example.io.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg.queries[0].name.to_ascii(), "www.example.com.");
    let mut reply = upstream(&msg, vec![a("www.example.com.", 300, [192, 0, 2, 80])]);
    revert.reply(&mut reply);
    assert_eq!(reply.queries[0].name.to_ascii(), "www.example.io.");
    assert_eq!(lines(&reply.answers), ["www.example.io. 300 A 192.0.2.80"]);
}

#[test]
fn suffix_answer_auto_reverts_names_and_values() {
    // variation-rewrite-answer-auto: `www.corp.example. A` → upstream `www.example.` →
    // `www.corp.example. 30 IN A 192.0.2.1`.
    let rw = parse("rewrite name suffix .corp.example .example answer auto").unwrap();
    let mut msg = query("www.corp.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg.queries[0].name.to_ascii(), "www.example.");
    let cname = Record::from_rdata(
        name("www.example."),
        30,
        RData::CNAME(CNAME(name("web.example."))),
    );
    let mut reply = upstream(&msg, vec![cname, a("web.example.", 30, [192, 0, 2, 1])]);
    revert.reply(&mut reply);
    assert_eq!(
        lines(&reply.answers),
        [
            "www.corp.example. 30 CNAME web.corp.example.",
            "web.corp.example. 30 A 192.0.2.1"
        ]
    );
    // Without `answer auto` the records keep the upstream's names.
    let rw = parse("rewrite name suffix .corp.example .example").unwrap();
    let mut msg = query("www.corp.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    let mut reply = upstream(&msg, vec![a("www.example.", 30, [192, 0, 2, 1])]);
    revert.reply(&mut reply);
    assert_eq!(reply.queries[0].name.to_ascii(), "www.corp.example.");
    assert_eq!(lines(&reply.answers), ["www.example. 30 A 192.0.2.1"]);
}

#[test]
fn type_rule_stops_before_the_edns0_rule_and_the_question_comes_back() {
    // variation-rewrite-type-edns0: `type ANY HINFO` then `edns0 local set 0xffee 0x61626364`.
    let rw = parse("rewrite type ANY HINFO\nrewrite edns0 local set 0xffee 0x61626364").unwrap();
    let mut msg = query("www.example.", RecordType::ANY);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg.queries[0].query_type, RecordType::HINFO);
    assert!(msg.edns.is_none(), "the type rule stopped the list");
    let soa = Record::from_rdata(
        Name::root(),
        300,
        RData::SOA(SOA::new(
            name("ns.resolver.test."),
            name("hostmaster.resolver.test."),
            1,
            7200,
            1800,
            86400,
            300,
        )),
    );
    let mut reply = upstream(&msg, Vec::new());
    reply.authorities.push(soa);
    revert.reply(&mut reply);
    assert_eq!(reply.queries[0].query_type, RecordType::ANY);
    assert_eq!(reply.authorities.len(), 1);

    // An A query: the type rule does not match; the option is set, the query given an OPT.
    let mut msg = query("www.example.", RecordType::A);
    assert!(rw.request(&mut msg, &source()).unwrap().is_some());
    let edns = msg.edns.as_ref().expect("an OPT record");
    assert_eq!(edns.max_payload(), 4096);
    assert_eq!(
        edns.options().options,
        [(
            EdnsCode::from(0xffee),
            EdnsOption::Unknown(0xffee, b"abcd".to_vec())
        )]
    );
    // A query with OPT keeps its size; `set` replaces an option of the same code.
    let mut msg = query("www.example.", RecordType::A);
    let mut edns = Edns::new();
    edns.set_max_payload(1232);
    edns.options_mut()
        .insert(EdnsOption::Unknown(0xffee, b"old".to_vec()));
    msg.edns = Some(edns);
    rw.request(&mut msg, &source()).unwrap();
    let edns = msg.edns.as_ref().unwrap();
    assert_eq!(edns.max_payload(), 1232);
    assert_eq!(
        edns.options().options,
        [(
            EdnsCode::from(0xffee),
            EdnsOption::Unknown(0xffee, b"abcd".to_vec())
        )]
    );
}

#[test]
fn edns0_actions_and_variables() {
    let opts = |body: &str, before: Vec<EdnsOption>| {
        let rw = parse(body).unwrap();
        let mut msg = query("Www.Example.", RecordType::AAAA);
        if !before.is_empty() {
            let mut e = Edns::new();
            for o in before {
                e.options_mut().insert(o);
            }
            msg.edns = Some(e);
        }
        let done = rw.request(&mut msg, &source()).unwrap().is_some();
        let opts: Vec<EdnsOption> = msg
            .edns
            .map(|e| e.options().options.iter().map(|(_, o)| o.clone()).collect())
            .unwrap_or_default();
        (done, opts)
    };
    let local = |code: u16, data: &[u8]| EdnsOption::Unknown(code, data.to_vec());
    // replace: only an option already there.
    assert_eq!(
        opts("rewrite edns0 local replace 0xffee abcd", vec![]),
        (false, vec![])
    );
    assert_eq!(
        opts(
            "rewrite edns0 local replace 0xffee abcd",
            vec![local(0xffee, b"x")]
        ),
        (true, vec![local(0xffee, b"abcd")])
    );
    // append: another option, even beside one of the same code.
    assert_eq!(
        opts(
            "rewrite edns0 local append 0xffee abcd",
            vec![local(0xffee, b"x")]
        ),
        (true, vec![local(0xffee, b"x"), local(0xffee, b"abcd")])
    );
    // Variables (CoreDNS's TestRewriteEDNS0LocalVariable).
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {qname}", vec![]).1,
        [local(0xffee, b"Www.Example.")]
    );
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {qtype}", vec![]).1,
        [local(0xffee, &[0, 28])]
    );
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {client_ip}", vec![]).1,
        [local(0xffee, &[10, 240, 0, 7])]
    );
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {client_port}", vec![]).1,
        [local(0xffee, &[0x9c, 0x75])]
    );
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {server_ip}", vec![]).1,
        [local(0xffee, &[169, 254, 20, 10])]
    );
    assert_eq!(
        opts("rewrite edns0 local set 0xffee {protocol}", vec![]).1,
        [local(0xffee, b"udp")]
    );
    // A metadata label: no provider in node-cache, so the rule never applies.
    assert!(
        !opts(
            "rewrite edns0 local set 0xffee {kubernetes/client-namespace}",
            vec![]
        )
        .0
    );
    // subnet: the client's address cut to the prefix.
    assert_eq!(
        opts("rewrite edns0 subnet set 24 56", vec![]).1,
        [EdnsOption::Subnet(ClientSubnet::new(
            "10.240.0.0".parse().unwrap(),
            24,
            0
        ))]
    );
    assert!(
        !opts(
            "rewrite edns0 subnet append 24 56",
            vec![EdnsOption::Subnet(ClientSubnet::new(
                "192.0.2.0".parse().unwrap(),
                24,
                0
            ))]
        )
        .0
    );
    // nsid: an empty NSID option.
    let (done, o) = opts("rewrite edns0 nsid set", vec![]);
    assert!(done);
    assert!(matches!(o.as_slice(), [EdnsOption::NSID(p)] if p.as_ref().is_empty()));
}

#[test]
fn answer_name_and_value_rules_rewrite_by_regex() {
    // CoreDNS's README: a regex name rule with an answer name and an answer value rule.
    let rw = parse(
        r#"rewrite stop {
    name regex (.*)\.svc\.example\.org {1}.svc.cluster.local
    answer name (.*)\.svc\.cluster\.local {1}.svc.example.org
    answer value (.*)\.svc\.cluster\.local {1}.svc.example.org
}"#,
    )
    .unwrap();
    let mut msg = query("api.svc.example.org.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg.queries[0].name.to_ascii(), "api.svc.cluster.local.");
    let cname = Record::from_rdata(
        name("api.svc.cluster.local."),
        10,
        RData::CNAME(CNAME(name("web.svc.cluster.local."))),
    );
    let mut reply = upstream(
        &msg,
        vec![cname, a("web.svc.cluster.local.", 10, [10, 0, 0, 1])],
    );
    revert.reply(&mut reply);
    assert_eq!(
        lines(&reply.answers),
        [
            "api.svc.example.org. 10 CNAME web.svc.example.org.",
            "web.svc.example.org. 10 A 10.0.0.1"
        ]
    );
}

#[test]
fn ttl_and_rcode_rules_change_the_reply_only() {
    let rw = parse(
        "rewrite continue ttl suffix .example 30-60\nrewrite continue ttl exact fixed.example 5\nrewrite rcode regex ^gone[.] NXDOMAIN NOERROR",
    )
    .unwrap();
    let mut msg = query("a.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg, query("a.example.", RecordType::A));
    let mut reply = upstream(
        &msg,
        vec![
            a("a.example.", 10, [192, 0, 2, 1]),
            a("a.example.", 3600, [192, 0, 2, 2]),
        ],
    );
    revert.reply(&mut reply);
    assert_eq!(
        lines(&reply.answers),
        ["a.example. 30 A 192.0.2.1", "a.example. 60 A 192.0.2.2"]
    );
    let mut msg = query("fixed.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    let mut reply = upstream(&msg, vec![a("fixed.example.", 3600, [192, 0, 2, 1])]);
    revert.reply(&mut reply);
    // Both ttl rules matched (continue); the last matched applies first: 5, then 30-60.
    assert_eq!(lines(&reply.answers), ["fixed.example. 30 A 192.0.2.1"]);
    let mut msg = query("gone.test.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    let mut reply = upstream(&msg, Vec::new());
    reply.metadata.response_code = ResponseCode::NXDomain;
    revert.reply(&mut reply);
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
}

#[test]
fn an_invalid_name_after_rewrite_is_an_error_with_the_question_restored() {
    let rw = parse(r"rewrite name regex ^(.*)\.example\.$ {1}..example").unwrap();
    let mut msg = query("www.example.", RecordType::A);
    assert_eq!(
        rw.request(&mut msg, &source()).unwrap_err(),
        InvalidName("www..example.".to_owned())
    );
    assert_eq!(msg, query("www.example.", RecordType::A));
    let long = format!("{}.example.", vec!["a".repeat(60); 4].join("."));
    let rw = parse(&format!(
        "rewrite name prefix www {}",
        long.trim_end_matches('.')
    ))
    .unwrap();
    let mut msg = query("www.example.", RecordType::A);
    assert!(rw.request(&mut msg, &source()).is_err());
}

#[test]
fn problems_are_reported_with_their_lines() {
    let errors = parse(
        "rewrite name stop website.tld website.namespace.svc.cluster.local\n\
         rewrite answer auto\n\
         rewrite continue\n\
         rewrite cname exact a. b.\n\
         rewrite ttl a.example 5-1\n\
         rewrite edns0 local bogus 1 2\n\
         rewrite class IN XX\n\
         rewrite type A\n\
         rewrite name regex (a {1}\n\
         rewrite name regex (a) {1}{2}\n\
         rewrite name suffix a b answer auto answer name x y\n\
         rewrite bogus a b\n\
         rewrite name prefix a b c\n\
         rewrite name prefix a b c d",
    )
    .unwrap_err();
    let expect = [
        "Corefile:2: rewrite: name rule supports only exact, prefix, suffix, substring, and regex name matching, received: stop",
        "Corefile:3: rewrite: response rewrites must begin with a name rule",
        "Corefile:4: rewrite: continue rule must begin with a rule type",
        "Corefile:5: rewrite: `cname` rules are not implemented",
        "Corefile:6: rewrite: invalid TTL '5-1' for a ttl rule",
        "Corefile:7: rewrite: invalid action: \"bogus\"",
        "Corefile:8: rewrite: invalid class \"XX\"",
        "Corefile:9: rewrite: type rules must have exactly two arguments",
        "Corefile:10: rewrite: invalid regex matching pattern: (a",
        "Corefile:11: rewrite: the rewrite regex pattern ({1}{2}) uses more subexpressions",
        "Corefile:12: rewrite: auto name answer rule cannot be combined",
        "Corefile:13: rewrite: invalid rule type \"bogus\"",
        "Corefile:14: rewrite: invalid arguments for prefix rule",
        "Corefile:15: rewrite: exceeded the number of arguments for a non-answer rule argument",
    ];
    assert_eq!(errors.len(), expect.len(), "{errors:#?}");
    for (got, want) in errors.iter().zip(expect) {
        assert!(got.starts_with(want), "{got}\n does not start with\n{want}");
    }
}

#[test]
fn types_and_classes_are_read_in_any_case() {
    let rw = parse("rewrite continue type aaaa a\nrewrite class ch in").unwrap();
    assert_eq!(
        rewritten(&rw, "x.example.", RecordType::AAAA, DNSClass::CH),
        "x.example. A IN"
    );
}

#[test]
fn a_chain_of_continue_rules_unwinds_to_the_name_asked() {
    // node-cache 1.23.1 (CoreDNS 1.10, answer rewrites in line order) answers `a.example. A`
    // with `b.example. 300 IN A 192.0.2.1` here; CoreDNS 1.12 and later, and nodedns, unwind
    // the chain.
    let rw = parse(
        "rewrite continue name exact a.example. b.example.\nrewrite continue name exact b.example. www.example.",
    )
    .unwrap();
    let mut msg = query("a.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    assert_eq!(msg.queries[0].name.to_ascii(), "www.example.");
    let mut reply = upstream(&msg, vec![a("www.example.", 300, [192, 0, 2, 1])]);
    revert.reply(&mut reply);
    assert_eq!(lines(&reply.answers), ["a.example. 300 A 192.0.2.1"]);
}

#[test]
fn continue_rules_without_answer_rewrites_still_restore_the_question() {
    // node-cache 1.23.1 leaves `www.example.` in the question of the reply to `cont.example.`
    // here (dig: "question sections are different"); nodedns restores it.
    let rw = parse("rewrite continue name prefix cont www").unwrap();
    let mut msg = query("cont.example.", RecordType::A);
    let revert = rw.request(&mut msg, &source()).unwrap().unwrap();
    let mut reply = upstream(&msg, vec![a("www.example.", 300, [192, 0, 2, 1])]);
    revert.reply(&mut reply);
    assert_eq!(reply.queries[0].name.to_ascii(), "cont.example.");
}
