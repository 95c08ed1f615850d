//! `template`: answers built from Go templates for the queries a line's class, type, zones and
//! regexps select (CoreDNS `plugin/template`).
//!
//! One [`Template`] per `template` line, in file order: each answers what it matches and passes
//! the rest on ([`Outcome::Next`]). A query in the line's zones, of its class and type, that none
//! of its regexps matches is a SERVFAIL unless `fallthrough` covers the name, as in CoreDNS. An
//! answer is authoritative (AA), has the rendered `answer`, `additional` and `authority` records
//! and no SOA unless `authority` writes one; it goes through the cache like an upstream answer.
//!
//! A CNAME answer to an A or AAAA query is followed, as CoreDNS's `upstream` lookup does, by the
//! caller: [`follow_ups`] are the questions to ask the server (from the top, like a client's),
//! [`add_follow_ups`] puts their answers in the reply. The Go templates are the subset in
//! [`text`].

mod text;

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use hickory_proto::op::{Edns, Message, MessageType, Query, ResponseCode};
use hickory_proto::rr::rdata::opt::EdnsOption;
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use hickory_proto::serialize::txt::Parser;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use regex::Regex;

use crate::config::Problem;
use crate::config::corefile::Directive;
use crate::config::values;
use crate::plugin::go;

use text::{Data, Text};

/// CoreDNS 1.11's cap on a `match` regexp's length.
const MAX_REGEX_LEN: usize = 10_000;

/// One `template` line.
#[derive(Debug, Clone)]
pub struct Template {
    /// ZONES, or the block's zones; canonical (lowercase, final dot).
    zones: Vec<String>,
    /// `None` for ANY.
    class: Option<DNSClass>,
    /// `None` for ANY.
    rtype: Option<RecordType>,
    /// `match`: the first that matches wins; none written means `.*`.
    regexes: Vec<Regex>,
    answer: Vec<Rr>,
    additional: Vec<Rr>,
    authority: Vec<Rr>,
    rcode: ResponseCode,
    /// `ederror CODE [REASON]` (RFC 8914 Extended DNS Error).
    ederror: Option<(u16, String)>,
    /// `fallthrough [ZONES]`: the names for which an unmatched query goes on.
    fall: Option<Vec<String>>,
    metrics: Metrics,
    /// The `server` label of this line's block.
    server: Arc<str>,
}

/// One `answer`, `additional` or `authority` argument.
#[derive(Debug, Clone)]
struct Rr {
    /// As written: the `template` label of the failure counters.
    source: String,
    text: Text,
}

/// What a template does with a query.
#[derive(Debug)]
pub enum Outcome {
    /// The reply to send (and cache).
    Answer(Message),
    /// Not this template's: the next template, or the next plugin.
    Next,
    /// SERVFAIL, not cached: no regexp matched and no `fallthrough`, `rcode SERVFAIL`, or a
    /// template that failed to render or to parse as a record (counted in [`Metrics`]).
    ServFail,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MatchLabels {
    server: String,
    zone: String,
    view: String,
    class: String,
    r#type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    server: String,
    zone: String,
    view: String,
    class: String,
    r#type: String,
    section: String,
    template: String,
}

/// CoreDNS's template metrics (`view` is always empty: nodedns has no `view` plugin).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    matches: Family<MatchLabels, Counter>,
    template_failures: Family<FailureLabels, Counter>,
    rr_failures: Family<FailureLabels, Counter>,
}

impl Metrics {
    /// Creates the counters and registers them (prometheus-client appends `_total`).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(
            "coredns_template_matches",
            "Counter of template regex matches",
            m.matches.clone(),
        );
        registry.register(
            "coredns_template_template_failures",
            "Counter of go template failures",
            m.template_failures.clone(),
        );
        registry.register(
            "coredns_template_rr_failures",
            "Counter of mis-templated RRs",
            m.rr_failures.clone(),
        );
        m
    }
}

fn class_name(class: DNSClass) -> String {
    match class {
        DNSClass::IN => "IN".to_owned(),
        DNSClass::CH => "CH".to_owned(),
        DNSClass::HS => "HS".to_owned(),
        DNSClass::NONE => "NONE".to_owned(),
        DNSClass::ANY => "ANY".to_owned(),
        other => format!("CLASS{}", u16::from(other)),
    }
}

impl Template {
    /// Reads one `template CLASS TYPE [ZONES...] { ... }` line; every problem is pushed with its
    /// line, and `None` returned when there was any.
    pub(crate) fn parse(
        d: &Directive,
        block_zones: &[String],
        file: &str,
        problems: &mut Vec<Problem>,
    ) -> Option<Template> {
        let before = problems.len();
        let mut err = |line: usize, message: String| {
            problems.push(Problem::at(file, line, format!("template: {message}")));
        };
        const SYNTAX: &str = "template CLASS TYPE [ZONES...] { ... }";
        let mut class = None;
        let mut rtype = None;
        match d.args.first() {
            None => err(d.line, format!("CLASS and TYPE are missing ({SYNTAX})")),
            Some(w) => match w.text.as_str() {
                "ANY" => {}
                text => match DNSClass::from_str(text) {
                    Ok(c) => class = Some(c),
                    Err(_) => err(
                        w.line,
                        format!("`{text}` is not a query class (IN, CH, HS, NONE or ANY)"),
                    ),
                },
            },
        }
        match d.args.get(1) {
            None if d.args.len() == 1 => err(d.line, format!("TYPE is missing ({SYNTAX})")),
            None => {}
            Some(w) => match w.text.as_str() {
                "ANY" => {}
                text => match RecordType::from_str(text) {
                    Ok(t) if text.bytes().all(|b| !b.is_ascii_lowercase()) => rtype = Some(t),
                    _ => err(
                        w.line,
                        format!("`{text}` is not a record type (A, AAAA, PTR, ... or ANY)"),
                    ),
                },
            },
        }
        let mut zones = Vec::new();
        for w in d.args.iter().skip(2) {
            match values::zone(&w.text) {
                Ok(z) => zones.push(z),
                Err(e) => err(w.line, format!("zone {e}")),
            }
        }
        if zones.is_empty() {
            zones = block_zones.to_vec();
        }
        let mut t = Template {
            zones,
            class,
            rtype,
            regexes: Vec::new(),
            answer: Vec::new(),
            additional: Vec::new(),
            authority: Vec::new(),
            rcode: ResponseCode::NoError,
            ederror: None,
            fall: None,
            metrics: Metrics::default(),
            server: Arc::from(""),
        };
        for o in &d.block {
            let name = o.name.as_str();
            if o.has_block {
                err(o.line, format!("`{name}` takes no `{{ }}` block"));
            }
            let needs_args = matches!(name, "match" | "answer" | "additional" | "authority");
            if needs_args && o.args.is_empty() {
                err(o.line, format!("`{name}` needs at least one argument"));
                continue;
            }
            match name {
                "match" => {
                    for w in &o.args {
                        if w.text.len() > MAX_REGEX_LEN {
                            err(
                                w.line,
                                format!(
                                    "a `match` regexp is {} bytes long; at most {MAX_REGEX_LEN} \
                                     are allowed",
                                    w.text.len()
                                ),
                            );
                            continue;
                        }
                        match Regex::new(&w.text) {
                            Ok(r) => t.regexes.push(r),
                            Err(e) => {
                                err(w.line, format!("could not parse regex `{}`: {e}", w.text))
                            }
                        }
                    }
                }
                "answer" | "additional" | "authority" => {
                    for w in &o.args {
                        match Text::parse(&w.text) {
                            Ok(text) => {
                                let rr = Rr {
                                    source: w.text.clone(),
                                    text,
                                };
                                match name {
                                    "answer" => t.answer.push(rr),
                                    "additional" => t.additional.push(rr),
                                    _ => t.authority.push(rr),
                                }
                            }
                            Err(e) => err(
                                w.line,
                                format!("could not compile the {name} template `{}`: {e}", w.text),
                            ),
                        }
                    }
                }
                "rcode" => match o.args.as_slice() {
                    [w] => match go::rcode(&w.text) {
                        Some(code) if code <= 10 => t.rcode = ResponseCode::from_low(code as u8),
                        Some(_) => err(
                            w.line,
                            format!(
                                "rcode `{}` is an extended RCODE, which a reply without EDNS \
                                 cannot carry; nodedns does not send it",
                                w.text
                            ),
                        ),
                        None => err(w.line, format!("unknown rcode `{}`", w.text)),
                    },
                    _ => err(o.line, "syntax: rcode CODE".to_owned()),
                },
                "ederror" => match o.args.as_slice() {
                    [code, reason @ ..] if reason.len() <= 1 => match code.text.parse::<u16>() {
                        Ok(c) => {
                            t.ederror = Some((
                                c,
                                reason.first().map(|w| w.text.clone()).unwrap_or_default(),
                            ))
                        }
                        Err(_) => err(
                            code.line,
                            format!(
                                "the extended DNS error code must be a number from 0 to 65535, \
                                 not `{}`",
                                code.text
                            ),
                        ),
                    },
                    _ => err(
                        o.line,
                        "syntax: ederror EXTENDED_ERROR_CODE [EXTRA_REASON]".to_owned(),
                    ),
                },
                "fallthrough" => {
                    let mut fall = Vec::new();
                    for w in &o.args {
                        match values::zone(&w.text) {
                            Ok(z) => fall.push(z),
                            Err(e) => err(w.line, format!("fallthrough zone {e}")),
                        }
                    }
                    if fall.is_empty() {
                        fall.push(".".to_owned());
                    }
                    t.fall = Some(fall);
                }
                // CoreDNS 1.10 accepts and ignores it ("remove soon").
                "upstream" => {}
                other => err(
                    o.line,
                    format!(
                        "unknown option `{other}` (match, answer, additional, authority, rcode, \
                         ederror, fallthrough)"
                    ),
                ),
            }
        }
        if t.regexes.is_empty() {
            t.regexes.push(Regex::new(".*").expect("a constant regexp"));
        }
        (problems.len() == before).then_some(t)
    }

    /// Counts into `metrics` under `server` (the block's `server` label, as
    /// [`crate::metrics::server_label`] writes it).
    pub fn instrument(&mut self, metrics: &Metrics, server: &str) {
        self.metrics = metrics.clone();
        self.server = Arc::from(server);
    }

    /// The reply to `query` from `client`, as CoreDNS's `ServeDNS` of one template.
    pub fn answer(&self, query: &Message, client: SocketAddr) -> Outcome {
        let Some(q) = query.queries.first() else {
            return Outcome::Next;
        };
        let name = q.name.to_ascii().to_ascii_lowercase();
        let Some(zone) = longest_zone(&self.zones, &name) else {
            return Outcome::Next;
        };
        let qclass = q.query_class;
        let qtype = q.query_type;
        if let Some(class) = self.class {
            if qclass != DNSClass::ANY && qclass != class {
                return Outcome::Next;
            }
        }
        if let Some(rtype) = self.rtype {
            if qtype != RecordType::ANY && qtype != rtype {
                return Outcome::Next;
            }
        }
        let Some((regex, captures)) = self
            .regexes
            .iter()
            .find_map(|r| r.captures(&name).map(|c| (r, c)))
        else {
            let through = self
                .fall
                .as_ref()
                .is_some_and(|zones| longest_zone(zones, &name).is_some());
            return if through {
                Outcome::Next
            } else {
                Outcome::ServFail
            };
        };
        let mut data = Data {
            name: name.clone(),
            zone: zone.to_owned(),
            class: if qclass == DNSClass::ANY {
                self.class.map_or_else(|| "ANY".to_owned(), class_name)
            } else {
                class_name(qclass)
            },
            rtype: if qtype == RecordType::ANY {
                self.rtype.unwrap_or(RecordType::ANY).to_string()
            } else {
                qtype.to_string()
            },
            regex: regex.as_str().to_owned(),
            remote: client.ip().to_string(),
            ..Data::default()
        };
        for (i, m) in captures.iter().enumerate() {
            let text = m.map_or("", |m| m.as_str()).to_owned();
            data.groups.insert(i.to_string(), text.clone());
            data.matches.push(text);
        }
        for (i, group) in regex.capture_names().enumerate() {
            if let Some(group) = group {
                data.groups
                    .insert(group.to_owned(), data.matches[i].clone());
            }
        }
        self.metrics
            .matches
            .get_or_create(&MatchLabels {
                server: self.server.to_string(),
                zone: data.zone.clone(),
                view: String::new(),
                class: data.class.clone(),
                r#type: data.rtype.clone(),
            })
            .inc();
        if self.rcode == ResponseCode::ServFail {
            return Outcome::ServFail;
        }
        let mut reply = Message::new(
            query.metadata.id,
            MessageType::Response,
            query.metadata.op_code,
        );
        reply.metadata.recursion_desired = query.metadata.recursion_desired;
        reply.metadata.checking_disabled = query.metadata.checking_disabled;
        reply.metadata.authoritative = true;
        reply.metadata.response_code = self.rcode;
        reply.queries.push(q.clone());
        for (section, rrs) in [
            ("answer", &self.answer),
            ("additional", &self.additional),
            ("authority", &self.authority),
        ] {
            for rr in rrs {
                let Some(record) = self.record(section, rr, &data) else {
                    return Outcome::ServFail;
                };
                match section {
                    "answer" => reply.answers.push(record),
                    "additional" => reply.additionals.push(record),
                    _ => reply.authorities.push(record),
                }
            }
        }
        if let Some((code, reason)) = &self.ederror {
            // CoreDNS: SetEdns0(4096, true) plus the option; the server then gives the OPT the
            // client's size and DO bit, as for every reply.
            let mut edns = Edns::new();
            edns.set_max_payload(4096);
            edns.set_dnssec_ok(true);
            let mut payload = code.to_be_bytes().to_vec();
            payload.extend_from_slice(reason.as_bytes());
            edns.options_mut().insert(EdnsOption::Unknown(15, payload));
            reply.edns = Some(edns);
        }
        Outcome::Answer(reply)
    }

    /// Renders one record; a failure is counted and logged, and the query gets SERVFAIL.
    fn record(&self, section: &str, rr: &Rr, data: &Data) -> Option<Record> {
        let labels = || FailureLabels {
            server: self.server.to_string(),
            zone: data.zone.clone(),
            view: String::new(),
            class: data.class.clone(),
            r#type: data.rtype.clone(),
            section: section.to_owned(),
            template: rr.source.clone(),
        };
        let text = match rr.text.render(data) {
            Ok(text) => text,
            Err(e) => {
                self.metrics
                    .template_failures
                    .get_or_create(&labels())
                    .inc();
                tracing::warn!(template = %rr.source, section, "template: {e}");
                return None;
            }
        };
        match zone_record(&text) {
            Ok(record) => Some(record),
            Err(e) => {
                self.metrics.rr_failures.get_or_create(&labels()).inc();
                tracing::warn!(template = %rr.source, section, rendered = %text, "template: {e}");
                None
            }
        }
    }
}

/// The questions CoreDNS's template asks the server after answering an A or AAAA query with
/// CNAME records: each target, with the query's type, in answer order.
pub fn follow_ups(reply: &Message) -> Vec<Query> {
    let Some(q) = reply.queries.first() else {
        return Vec::new();
    };
    if !matches!(q.query_type, RecordType::A | RecordType::AAAA) {
        return Vec::new();
    }
    reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::CNAME(target) => {
                let mut follow = Query::query(target.0.clone(), q.query_type);
                follow.query_class = q.query_class;
                Some(follow)
            }
            _ => None,
        })
        .collect()
}

/// Adds the answers to [`follow_ups`] (`None`: that lookup failed, nothing is added), each after
/// its CNAME record; the reply is truncated when the last answered lookup was.
pub fn add_follow_ups(reply: &mut Message, answers: Vec<Option<Message>>) {
    let mut answers = answers.into_iter();
    let mut merged = Vec::with_capacity(reply.answers.len());
    for record in std::mem::take(&mut reply.answers) {
        let cname = matches!(record.data, RData::CNAME(_));
        merged.push(record);
        if cname {
            if let Some(Some(up)) = answers.next() {
                reply.metadata.truncation = up.metadata.truncation;
                merged.extend(up.answers);
            }
        }
    }
    reply.answers = merged;
}

/// One record in zone-file form, as miekg/dns's `NewRR` reads it: relative names are under the
/// root, the TTL defaults to 3600 and the class to IN.
fn zone_record(text: &str) -> Result<Record, String> {
    if text.trim().is_empty() {
        return Err("the template rendered no record".to_owned());
    }
    let input = format!("$TTL 3600\n{text}\n");
    let (_, sets) = Parser::new(input, None, Some(Name::root()))
        .parse()
        .map_err(|e| format!("`{text}` is not a resource record: {e}"))?;
    let mut records = sets.into_values().flat_map(|set| set.into_iter());
    match (records.next(), records.next()) {
        (Some(record), None) => Ok(record),
        _ => Err(format!("`{text}` is not exactly one resource record")),
    }
}

/// The longest of `zones` that canonical `name` is in (CoreDNS `plugin.Zones.Matches`).
fn longest_zone<'z>(zones: &'z [String], name: &str) -> Option<&'z str> {
    zones
        .iter()
        .filter(|z| values::is_under(name, z))
        .max_by_key(|z| z.len())
        .map(String::as_str)
}

#[cfg(test)]
mod tests;
