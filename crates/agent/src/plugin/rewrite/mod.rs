//! `rewrite`: changes the query that goes on behind the cache, and undoes the change in the
//! reply (CoreDNS `plugin/rewrite`: `rewrite.go`, `name.go`, `reverter.go`, `ttl.go`,
//! `edns0.go`, `rcode.go`).
//!
//! All `rewrite` lines of a block form one [`Rewrite`]: its rules run in file order on the
//! lowercased question name; a rule that matches with `stop` (the default) ends the list,
//! `continue` goes on to the next. [`Rewrite::request`] changes the query and returns a
//! [`Revert`], which [`Revert::reply`] applies to the reply before it is cached and answered:
//! the question restored, then the answer rewrites (`answer auto|name|value`, the reverse of an
//! exact name rule, `ttl`, `rcode`) in the reverse of the order the rules matched, so that a
//! chain of `continue` rules unwinds to the name the client asked. The cache key stays the name
//! the client asked.
//!
//! Where nodedns differs from the CoreDNS in node-cache (1.10 to 1.13), each a case where that
//! reply is one a client rejects or a rule silently does nothing, and each fixed in later CoreDNS:
//! answer rewrites run in reverse order (CoreDNS 1.12 and later; 1.10 and 1.11 run them in line
//! order, so `a→b`, `b→c` answers `b`); the question is restored whenever a rule matched (CoreDNS
//! leaves the rewritten question in the reply when only `continue` rules without answer
//! rewrites matched); `rcode` rules apply to a reply without records too (CoreDNS runs response
//! rules once per record); `ttl` rules do not touch the OPT record. `cname` (1.11) is not
//! implemented: it needs a lookup of its own.

use std::net::{IpAddr, SocketAddr};

use hickory_proto::op::{Edns, Message, Query};
use hickory_proto::rr::rdata::opt::{ClientSubnet, EdnsCode, EdnsOption, NSIDPayload};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use regex::Regex;

use crate::config::Problem;
use crate::config::corefile::Directive;
use crate::plugin::go;

#[cfg(test)]
mod tests;

/// Every `rewrite` line of one block, in file order.
#[derive(Debug, Clone, Default)]
pub struct Rewrite {
    rules: Vec<Rule>,
}

/// Where a query came from and arrived, for `edns0 local` variables and `edns0 subnet`.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub client: SocketAddr,
    /// The address the query arrived at (`{server_ip}`, `{server_port}`).
    pub server: SocketAddr,
    pub tcp: bool,
}

/// The rewritten name is not a domain name: the client gets SERVFAIL (question restored).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid name after rewrite: {0}")]
pub struct InvalidName(pub String);

/// What to undo in the reply to a rewritten query.
#[derive(Debug, Clone)]
pub struct Revert {
    question: Query,
    answers: Vec<Answer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Stop,
    Continue,
}

#[derive(Debug, Clone)]
struct Rule {
    mode: Mode,
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    Name(NameRule),
    Class(DNSClass, DNSClass),
    Type(RecordType, RecordType),
    /// `ttl` and `rcode`: a name match that adds a fixed answer rewrite.
    Answer(Matcher, Answer),
    Edns0(Edns0),
}

#[derive(Debug, Clone)]
struct NameRule {
    matcher: Matcher,
    /// The replacement: a name for exact, prefix, suffix and substring; a `{N}` pattern for regex.
    to: String,
    /// Revert the question's mapping in every record's name and value (always for `exact`,
    /// `answer auto` for prefix, substring and regex; suffix builds its own static reverse).
    auto: bool,
    /// `answer name|value` rewrites, and a suffix rule's reverse.
    answers: Vec<Answer>,
}

#[derive(Debug, Clone)]
enum Matcher {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Substring(String),
    Regex(Regex),
}

impl Matcher {
    fn matches(&self, name: &str) -> bool {
        match self {
            Matcher::Exact(s) => name == s,
            Matcher::Prefix(s) => name.starts_with(s.as_str()),
            Matcher::Suffix(s) => name.ends_with(s.as_str()),
            Matcher::Substring(s) => name.contains(s.as_str()),
            Matcher::Regex(r) => r.is_match(name),
        }
    }
}

/// A rewrite applied to the reply.
#[derive(Debug, Clone)]
enum Answer {
    Name(Strings),
    Value(Strings),
    Ttl { min: u32, max: u32 },
    Rcode { old: u16, new: u16 },
}

/// CoreDNS's string rewriters.
#[derive(Debug, Clone)]
enum Strings {
    /// The whole string becomes the pattern with `{N}` replaced by the groups, when it matches.
    Regex(Regex, String),
    /// `orig` or a name under it: `orig` becomes `to`.
    Remap { orig: String, to: String },
    /// A final `suffix` becomes `to`.
    Suffix { suffix: String, to: String },
}

impl Strings {
    fn apply(&self, src: &str) -> Option<String> {
        match self {
            Strings::Regex(r, pattern) => {
                let caps = r.captures(src)?;
                Some(substitute(pattern, &caps))
            }
            Strings::Remap { orig, to } => {
                if src == orig {
                    Some(to.clone())
                } else if src.len() > orig.len()
                    && src.ends_with(orig.as_str())
                    && src.as_bytes()[src.len() - orig.len() - 1] == b'.'
                {
                    Some(format!("{}{to}", &src[..src.len() - orig.len()]))
                } else {
                    None
                }
            }
            Strings::Suffix { suffix, to } => src
                .strip_suffix(suffix.as_str())
                .map(|head| format!("{head}{to}")),
        }
    }
}

/// `pattern` with every `{N}` replaced by group N.
fn substitute(pattern: &str, caps: &regex::Captures<'_>) -> String {
    let mut out = pattern.to_owned();
    for (i, m) in caps.iter().enumerate() {
        out = out.replace(&format!("{{{i}}}"), m.map_or("", |m| m.as_str()));
    }
    out
}

/// How many of `{0}`…`{100}` a replacement uses (CoreDNS's check against the pattern's groups).
fn groups_used(s: &str) -> usize {
    (0..=100)
        .filter(|i| s.contains(&format!("{{{i}}}")))
        .count()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Set,
    Append,
    Replace,
}

#[derive(Debug, Clone)]
enum Edns0 {
    Local {
        action: Action,
        code: u16,
        data: LocalData,
    },
    Nsid(Action),
    Subnet {
        action: Action,
        v4: u8,
        v6: u8,
    },
}

#[derive(Debug, Clone)]
enum LocalData {
    Bytes(Vec<u8>),
    QName,
    QType,
    ClientIp,
    ClientPort,
    ServerIp,
    ServerPort,
    Protocol,
    /// `{label}` of the metadata plugin: node-cache compiles in no plugin that provides one, so
    /// the rule never applies.
    Metadata,
}

/// CoreDNS's `plugin.Name(s).Normalize()`: lowercase, fully qualified.
fn normalize(s: &str) -> String {
    let lower = s.to_ascii_lowercase();
    if lower.ends_with('.') {
        lower
    } else {
        format!("{lower}.")
    }
}

fn compile(pattern: &str, to: &str) -> Result<Regex, String> {
    let r =
        Regex::new(pattern).map_err(|_| format!("invalid regex matching pattern: {pattern}"))?;
    // `captures_len` counts group 0, Go's NumSubexp does not.
    if groups_used(to) > r.captures_len() - 1 {
        return Err(format!(
            "the rewrite regex pattern ({to}) uses more subexpressions than its corresponding \
             matching regex pattern ({pattern})"
        ));
    }
    Ok(r)
}

/// A name matcher of `ttl` and `rcode` rules: `[TYPE] NAME`.
fn matcher(kind: &str, name: &str, what: &str) -> Result<Matcher, String> {
    Ok(match kind.to_ascii_lowercase().as_str() {
        "exact" => Matcher::Exact(normalize(name)),
        "prefix" => Matcher::Prefix(normalize(name)),
        "suffix" => Matcher::Suffix(normalize(name)),
        "substring" => Matcher::Substring(normalize(name)),
        "regex" => Matcher::Regex(
            Regex::new(name)
                .map_err(|_| format!("invalid regex pattern in a {what} rule: {name}"))?,
        ),
        _ => {
            return Err(format!(
                "{what} rule supports only exact, prefix, suffix, substring, and regex name matching"
            ));
        }
    })
}

fn name_rule(args: &[&str]) -> Result<NameRule, String> {
    if args.len() < 2 {
        return Err("too few arguments for a name rule".to_owned());
    }
    let (kind, from, to) = if args.len() == 2 {
        ("exact".to_owned(), normalize(args[0]), normalize(args[1]))
    } else {
        let kind = args[0].to_ascii_lowercase();
        if kind == "regex" {
            (kind, args[1].to_owned(), args[2].to_owned())
        } else {
            (kind, normalize(args[1]), normalize(args[2]))
        }
    };
    let (auto, answers) = if args.len() > 3 {
        answer_rules(&kind, &args[3..])?
    } else {
        (false, Vec::new())
    };
    Ok(match kind.as_str() {
        "exact" => {
            // CoreDNS checks TO as a pattern for FROM's `{N}`, whatever it means.
            compile(&to, &from)?;
            NameRule {
                matcher: Matcher::Exact(from),
                to,
                auto: true,
                answers,
            }
        }
        "prefix" => NameRule {
            matcher: Matcher::Prefix(from),
            to,
            auto,
            answers,
        },
        "suffix" => {
            let mut all = Vec::new();
            if auto {
                let reverse = Strings::Suffix {
                    suffix: to.clone(),
                    to: from.clone(),
                };
                all.push(Answer::Name(reverse.clone()));
                all.push(Answer::Value(reverse));
            }
            all.extend(answers);
            NameRule {
                matcher: Matcher::Suffix(from),
                to,
                auto: false,
                answers: all,
            }
        }
        "substring" => NameRule {
            matcher: Matcher::Substring(from),
            to,
            auto,
            answers,
        },
        "regex" => NameRule {
            matcher: Matcher::Regex(compile(&from, &to)?),
            to: normalize(&to),
            auto,
            answers,
        },
        other => {
            return Err(format!(
                "name rule supports only exact, prefix, suffix, substring, and regex name \
                 matching, received: {other}"
            ));
        }
    })
}

/// `answer auto`, `answer name FROM TO`, `answer value FROM TO`, as CoreDNS's
/// `parseAnswerRules` reads them (after the first, the word `answer` may be left out).
fn answer_rules(name: &str, args: &[&str]) -> Result<(bool, Vec<Answer>), String> {
    if args.len() < 2 {
        return Err(format!("invalid arguments for {name} rule"));
    }
    let mut auto = false;
    let mut rules = Vec::new();
    let mut names = 0;
    let mut at = 0;
    let mut first = true;
    while at < args.len() {
        if first && args[at] != "answer" {
            return Err(format!(
                "exceeded the number of arguments for a non-answer rule argument for {name} rule"
            ));
        }
        first = false;
        if args[at] == "answer" {
            at += 1;
        }
        let Some(&last) = args.get(at) else {
            return Err(format!("type missing for answer rule for {name} rule"));
        };
        at += 1;
        match last {
            "auto" => auto = true,
            "name" | "value" => {
                let [from, to] = args
                    .get(at..at + 2)
                    .and_then(|s| <[&str; 2]>::try_from(s).ok())
                    .ok_or_else(|| {
                        format!("{last} answer rule for {name} rule: 2 arguments required")
                    })?;
                let r = compile(from, to)
                    .map_err(|e| format!("{last} answer rule for {name} rule: {e}"))?;
                let strings = Strings::Regex(r, normalize(to));
                if last == "name" {
                    names += 1;
                    rules.push(Answer::Name(strings));
                } else {
                    rules.push(Answer::Value(strings));
                }
                at += 2;
            }
            other => {
                return Err(format!(
                    "invalid type {other:?} for answer rule for {name} rule"
                ));
            }
        }
    }
    if auto && names > 0 {
        return Err(
            "auto name answer rule cannot be combined with explicit name answer rules".to_owned(),
        );
    }
    Ok((auto, rules))
}

/// CoreDNS's `isValidRCode`: a number up to 23 or a miekg/dns name in any case.
fn parse_rcode(v: &str) -> Option<u16> {
    match go::parse_uint(v, 10, 32) {
        Ok(n) => u16::try_from(n).ok().filter(|n| *n <= 23),
        Err(_) => go::rcode(&v.to_ascii_uppercase()),
    }
}

/// CoreDNS's `isValidTTL`: `SECONDS`, `MIN-MAX`, `MIN-` or `-MAX`.
fn ttl_range(v: &str) -> Option<(u32, u32)> {
    let parse = |s: &str| s.parse::<u32>().ok();
    match v.split('-').collect::<Vec<_>>().as_slice() {
        [one] => parse(one).map(|n| (n, n)),
        ["", ""] => None,
        [min, max] => {
            let min = if min.is_empty() { 0 } else { parse(min)? };
            let max = if max.is_empty() {
                i32::MAX as u32
            } else {
                parse(max)?
            };
            (min <= max).then_some((min, max))
        }
        _ => None,
    }
}

/// Go's `strconv.ParseUint(s, 0, 16)`.
fn code16(s: &str) -> Option<u16> {
    go::parse_uint(s, 0, 16).ok().map(|n| n as u16)
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn edns0_rule(args: &[&str]) -> Result<Edns0, String> {
    if args.len() < 2 {
        return Err("too few arguments for an EDNS0 rule".to_owned());
    }
    let action = match args[1].to_ascii_lowercase().as_str() {
        "set" => Action::Set,
        "append" => Action::Append,
        "replace" => Action::Replace,
        other => return Err(format!("invalid action: {other:?}")),
    };
    match args[0].to_ascii_lowercase().as_str() {
        "local" => {
            let [_, _, code, data] = args else {
                return Err("EDNS0 local rules require exactly three args".to_owned());
            };
            let code = code16(code).ok_or_else(|| {
                format!("EDNS0 option code `{code}` is not a number from 0 to 65535")
            })?;
            let data = if data.starts_with('{') && data.ends_with('}') {
                match *data {
                    "{qname}" => LocalData::QName,
                    "{qtype}" => LocalData::QType,
                    "{client_ip}" => LocalData::ClientIp,
                    "{client_port}" => LocalData::ClientPort,
                    "{server_ip}" => LocalData::ServerIp,
                    "{server_port}" => LocalData::ServerPort,
                    "{protocol}" => LocalData::Protocol,
                    label if metadata_label(&label[1..label.len() - 1]) => LocalData::Metadata,
                    other => return Err(format!("unsupported variable name {other:?}")),
                }
            } else if let Some(h) = data.strip_prefix("0x") {
                LocalData::Bytes(hex(h).ok_or_else(|| format!("`{data}` is not hexadecimal data"))?)
            } else {
                LocalData::Bytes(data.as_bytes().to_vec())
            };
            Ok(Edns0::Local { action, code, data })
        }
        "nsid" => {
            if args.len() != 2 {
                return Err("EDNS0 NSID rules do not accept args".to_owned());
            }
            Ok(Edns0::Nsid(action))
        }
        "subnet" => {
            let [_, _, v4, v6] = args else {
                return Err("EDNS0 subnet rules require exactly three args".to_owned());
            };
            let v4 = code16(v4)
                .filter(|n| *n <= 32)
                .ok_or_else(|| format!("invalid IPv4 bit mask length {v4}"))?;
            let v6 = code16(v6)
                .filter(|n| *n <= 128)
                .ok_or_else(|| format!("invalid IPv6 bit mask length {v6}"))?;
            Ok(Edns0::Subnet {
                action,
                v4: v4 as u8,
                v6: v6 as u8,
            })
        }
        other => Err(format!("invalid rule type {other:?}")),
    }
}

/// CoreDNS's `metadata.IsLabel`: `plugin/name`, both parts non-empty.
fn metadata_label(label: &str) -> bool {
    label
        .split_once('/')
        .is_some_and(|(p, n)| !p.is_empty() && !n.is_empty())
}

fn rule(words: &[&str]) -> Result<Rule, String> {
    let Some(first) = words.first() else {
        return Err("no rule type specified for rewrite".to_owned());
    };
    let (mode, rest) = match first.to_ascii_lowercase().as_str() {
        "continue" | "stop" if words.len() < 2 => {
            return Err(format!("{first} rule must begin with a rule type"));
        }
        "continue" => (Mode::Continue, &words[1..]),
        "stop" => (Mode::Stop, &words[1..]),
        _ => (Mode::Stop, words),
    };
    let field = rest[0].to_ascii_lowercase();
    let args = &rest[1..];
    let kind = match field.as_str() {
        "answer" => return Err("response rewrites must begin with a name rule".to_owned()),
        "name" => Kind::Name(name_rule(args)?),
        "class" | "type" if args.len() != 2 => {
            return Err(format!("{field} rules must have exactly two arguments"));
        }
        "class" => {
            let class = |s: &str| {
                let upper = s.to_ascii_uppercase();
                match upper.as_str() {
                    "IN" => Some(DNSClass::IN),
                    "CS" => Some(DNSClass::Unknown(2)),
                    "CH" => Some(DNSClass::CH),
                    "HS" => Some(DNSClass::HS),
                    "NONE" => Some(DNSClass::NONE),
                    "ANY" => Some(DNSClass::ANY),
                    _ => None,
                }
                .ok_or_else(|| format!("invalid class {upper:?}"))
            };
            Kind::Class(class(args[0])?, class(args[1])?)
        }
        "type" => {
            let rtype = |s: &str| {
                let upper = s.to_ascii_uppercase();
                upper
                    .parse::<RecordType>()
                    .map_err(|_| format!("invalid type {upper:?}"))
            };
            Kind::Type(rtype(args[0])?, rtype(args[1])?)
        }
        "ttl" => {
            let (m, range) = match args {
                [name, range] => (Matcher::Exact(normalize(name)), range),
                [kind, name, range] => (matcher(kind, name, "ttl")?, range),
                [] | [_] => {
                    return Err(format!("too few ({}) arguments for a ttl rule", args.len()));
                }
                _ => return Err("too many arguments for a ttl rule".to_owned()),
            };
            let (min, max) =
                ttl_range(range).ok_or_else(|| format!("invalid TTL '{range}' for a ttl rule"))?;
            Kind::Answer(m, Answer::Ttl { min, max })
        }
        "rcode" => {
            let (m, old, new) = match args {
                [name, old, new] => (Matcher::Exact(normalize(name)), old, new),
                [kind, name, old, new] => (matcher(kind, name, "rcode")?, old, new),
                _ if args.len() < 3 => {
                    return Err(format!(
                        "too few ({}) arguments for a rcode rule",
                        args.len()
                    ));
                }
                _ => return Err("too many arguments for a rcode rule".to_owned()),
            };
            let old = parse_rcode(old)
                .ok_or_else(|| format!("invalid matching RCODE '{old}' for a rcode rule"))?;
            let new = parse_rcode(new)
                .ok_or_else(|| format!("invalid replacement RCODE '{new}' for a rcode rule"))?;
            Kind::Answer(m, Answer::Rcode { old, new })
        }
        "edns0" => Kind::Edns0(edns0_rule(args)?),
        "cname" => {
            return Err(
                "`cname` rules are not implemented in nodedns (they need a lookup of the new \
                 target through the server)"
                    .to_owned(),
            );
        }
        _ => return Err(format!("invalid rule type {:?}", rest[0])),
    };
    Ok(Rule { mode, kind })
}

impl Rewrite {
    /// Adds one `rewrite` line (`rewrite [continue|stop] FIELD ...`, or its `{ }` block form);
    /// a problem is pushed with its line and the line is not added.
    pub(crate) fn add(&mut self, d: &Directive, file: &str, problems: &mut Vec<Problem>) {
        let mut words: Vec<&str> = d.args.iter().map(|w| w.text.as_str()).collect();
        if d.has_block {
            if words.len() >= 2 {
                problems.push(Problem::at(
                    file,
                    d.line,
                    "rewrite: a `{ }` block follows only `rewrite`, `rewrite stop` or `rewrite \
                     continue`"
                        .to_owned(),
                ));
                return;
            }
            for line in &d.block {
                if line.has_block {
                    problems.push(Problem::at(
                        file,
                        line.line,
                        format!("rewrite: `{}` takes no `{{ }}` block", line.name),
                    ));
                    return;
                }
                words.push(&line.name);
                words.extend(line.args.iter().map(|w| w.text.as_str()));
            }
        }
        match rule(&words) {
            Ok(r) => self.rules.push(r),
            Err(e) => problems.push(Problem::at(file, d.line, format!("rewrite: {e}"))),
        }
    }

    /// Rewrites `msg` before it goes on. `Ok(None)`: no rule matched (an `edns0` rule may still
    /// have given the query an OPT record, as CoreDNS does). `Err`: a name rule made an invalid
    /// name; `msg`'s question is restored and the client gets SERVFAIL.
    pub fn request(&self, msg: &mut Message, from: &Source) -> Result<Option<Revert>, InvalidName> {
        let Some(question) = msg.queries.first().cloned() else {
            return Ok(None);
        };
        let mut revert = Revert {
            question: question.clone(),
            answers: Vec::new(),
        };
        let mut done = false;
        for rule in &self.rules {
            let applied = match rule.kind.apply(msg, from) {
                Ok(Some(applied)) => applied,
                Ok(None) => continue,
                Err(e) => {
                    msg.queries[0] = question;
                    return Err(e);
                }
            };
            done = true;
            revert.answers.extend(applied);
            if rule.mode == Mode::Stop {
                break;
            }
        }
        Ok(done.then_some(revert))
    }
}

/// A record value a name rewrite may change (CoreDNS's `getRecordValueForRewrite`; hickory has
/// no DNAME type).
fn value_mut(data: &mut RData) -> Option<&mut Name> {
    match data {
        RData::SRV(srv) => Some(&mut srv.target),
        RData::MX(mx) => Some(&mut mx.exchange),
        RData::CNAME(c) => Some(&mut c.0),
        RData::NS(ns) => Some(&mut ns.0),
        RData::NAPTR(n) => Some(&mut n.replacement),
        RData::SOA(soa) => Some(&mut soa.mname),
        RData::PTR(p) => Some(&mut p.0),
        _ => None,
    }
}

fn rewrite_name(name: &mut Name, strings: &Strings) {
    let text = name.to_ascii();
    if let Some(new) = strings.apply(&text) {
        if new != text {
            if let Ok(parsed) = Name::from_ascii(&new) {
                *name = parsed;
            }
        }
    }
}

impl Kind {
    /// Applies the rule to the query; `Some` with the answer rewrites when it matched.
    fn apply(&self, msg: &mut Message, from: &Source) -> Result<Option<Vec<Answer>>, InvalidName> {
        let lower = msg.queries[0].name.to_ascii().to_ascii_lowercase();
        match self {
            Kind::Name(rule) => {
                if !rule.matcher.matches(&lower) {
                    return Ok(None);
                }
                let new = match &rule.matcher {
                    Matcher::Exact(_) => rule.to.clone(),
                    Matcher::Prefix(p) => format!("{}{}", rule.to, &lower[p.len()..]),
                    Matcher::Suffix(s) => format!("{}{}", &lower[..lower.len() - s.len()], rule.to),
                    Matcher::Substring(s) => lower.replace(s.as_str(), &rule.to),
                    Matcher::Regex(r) => {
                        let caps = r.captures(&lower).expect("matched above");
                        substitute(&rule.to, &caps)
                    }
                };
                msg.queries[0].name = valid_name(&new)?;
                let mut answers = Vec::new();
                if rule.auto {
                    let back = Strings::Remap {
                        orig: new,
                        to: lower,
                    };
                    answers.push(Answer::Name(back.clone()));
                    answers.push(Answer::Value(back));
                }
                answers.extend(rule.answers.iter().cloned());
                Ok(Some(answers))
            }
            Kind::Class(old, new) => {
                let q = &mut msg.queries[0];
                if q.query_class != *old {
                    return Ok(None);
                }
                q.query_class = *new;
                Ok(Some(Vec::new()))
            }
            Kind::Type(old, new) => {
                let q = &mut msg.queries[0];
                if q.query_type != *old {
                    return Ok(None);
                }
                q.query_type = *new;
                Ok(Some(Vec::new()))
            }
            Kind::Answer(m, answer) => Ok(m.matches(&lower).then(|| vec![answer.clone()])),
            Kind::Edns0(rule) => Ok(rule.apply(msg, from).then(Vec::new)),
        }
    }
}

/// CoreDNS's `dns.IsDomainName` check of a rewritten name, as the name that goes on.
fn valid_name(text: &str) -> Result<Name, InvalidName> {
    let invalid = || InvalidName(text.to_owned());
    if text.is_empty() || text.starts_with('.') && text != "." || text.contains("..") {
        return Err(invalid());
    }
    let name = Name::from_ascii(text).map_err(|_| invalid())?;
    if name.len() > 255 || name.iter().any(|l| l.len() > 63) {
        return Err(invalid());
    }
    Ok(name)
}

impl Edns0 {
    /// Whether the rule changed the query's options. Like CoreDNS, it first gives a query
    /// without OPT one (payload 4096, DO clear), whatever it then does.
    fn apply(&self, msg: &mut Message, from: &Source) -> bool {
        let qname = msg.queries[0].name.to_ascii();
        let qtype = u16::from(msg.queries[0].query_type);
        let edns = msg.edns.get_or_insert_with(|| {
            let mut e = Edns::new();
            e.set_max_payload(4096);
            e
        });
        let options = &mut edns.options_mut().options;
        match self {
            Edns0::Local { action, code, data } => {
                let bytes = match data {
                    LocalData::Bytes(b) => b.clone(),
                    LocalData::QName => qname.into_bytes(),
                    LocalData::QType => qtype.to_be_bytes().to_vec(),
                    LocalData::ClientIp => ip_bytes(from.client.ip()),
                    LocalData::ClientPort => from.client.port().to_be_bytes().to_vec(),
                    LocalData::ServerIp => ip_bytes(from.server.ip()),
                    LocalData::ServerPort => from.server.port().to_be_bytes().to_vec(),
                    LocalData::Protocol => if from.tcp { "tcp" } else { "udp" }.as_bytes().to_vec(),
                    LocalData::Metadata => return false,
                };
                let variable = !matches!(data, LocalData::Bytes(_));
                let code = *code;
                let existing = options.iter_mut().find_map(|(_, o)| match o {
                    EdnsOption::Unknown(c, d) if *c == code => Some(d),
                    _ => None,
                });
                if let Some(d) = existing {
                    if matches!(action, Action::Replace | Action::Set) {
                        *d = bytes;
                        return true;
                    }
                    // CoreDNS: a variable rule stops at the first option of its code; a fixed
                    // one appends another.
                    if variable {
                        return false;
                    }
                }
                if matches!(action, Action::Append | Action::Set) {
                    options.push((EdnsCode::from(code), EdnsOption::Unknown(code, bytes)));
                    return true;
                }
                false
            }
            Edns0::Nsid(action) => {
                let empty = || NSIDPayload::new(Vec::new()).expect("an empty NSID fits");
                if let Some((_, o)) = options
                    .iter_mut()
                    .find(|(_, o)| matches!(o, EdnsOption::NSID(_)))
                {
                    if matches!(action, Action::Replace | Action::Set) {
                        *o = EdnsOption::NSID(empty());
                        return true;
                    }
                }
                if matches!(action, Action::Append | Action::Set) {
                    options.push((EdnsCode::NSID, EdnsOption::NSID(empty())));
                    return true;
                }
                false
            }
            Edns0::Subnet { action, v4, v6 } => {
                let subnet = subnet(from.client.ip(), *v4, *v6);
                if let Some((_, o)) = options
                    .iter_mut()
                    .find(|(_, o)| matches!(o, EdnsOption::Subnet(_)))
                {
                    if matches!(action, Action::Replace | Action::Set) {
                        *o = EdnsOption::Subnet(subnet);
                        return true;
                    }
                    return false;
                }
                if matches!(action, Action::Append | Action::Set) {
                    options.push((EdnsCode::Subnet, EdnsOption::Subnet(subnet)));
                    return true;
                }
                false
            }
        }
    }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// The client's address masked to the rule's prefix (RFC 7871 §6), scope 0.
fn subnet(ip: IpAddr, v4: u8, v6: u8) -> ClientSubnet {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            let bits = u32::from(a) & u32::MAX.checked_shl(32 - u32::from(v4)).unwrap_or(0);
            ClientSubnet::new(IpAddr::V4(bits.into()), v4, 0)
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a) & u128::MAX.checked_shl(128 - u32::from(v6)).unwrap_or(0);
            ClientSubnet::new(IpAddr::V6(bits.into()), v6, 0)
        }
    }
}

impl Revert {
    /// Undoes the rewrite in the reply: the question the client asked, then every answer
    /// rewrite, last matched first, on every record of authority, answer and additional.
    pub fn reply(&self, msg: &mut Message) {
        match msg.queries.first_mut() {
            Some(q) => *q = self.question.clone(),
            None => msg.queries.push(self.question.clone()),
        }
        if self.answers.is_empty() {
            return;
        }
        for record in msg
            .authorities
            .iter_mut()
            .chain(msg.answers.iter_mut())
            .chain(msg.additionals.iter_mut())
        {
            for answer in self.answers.iter().rev() {
                apply(answer, record);
            }
        }
        for answer in self.answers.iter().rev() {
            if let Answer::Rcode { old, new } = answer {
                if u16::from(msg.metadata.response_code) == *old {
                    msg.metadata.response_code = (*new).into();
                }
            }
        }
    }
}

fn apply(answer: &Answer, record: &mut Record) {
    match answer {
        Answer::Name(s) => rewrite_name(&mut record.name, s),
        Answer::Value(s) => {
            if let Some(name) = value_mut(&mut record.data) {
                rewrite_name(name, s);
            }
        }
        Answer::Ttl { min, max } => record.ttl = record.ttl.clamp(*min, *max),
        Answer::Rcode { .. } => {}
    }
}
