//! The Corefile's directives as plugins, CoreDNS's way: one module per directive, holding its
//! configuration (parse and validate, every problem with `file:line`), its logic, its metrics
//! (a `Metrics` with `register`, CoreDNS's metric names) and its place in the chain.
//!
//! The chain of a server block runs in CoreDNS's fixed order ([`ORDER`], `plugin.cfg` from
//! v1.10.0 to v1.14.0), never in the order the Corefile is written in. For nodedns that order
//! has three parts:
//! - process-wide directives (`reload`, `bind`, `health`, `ready`, `prometheus`): read by the
//!   configuration, acted on by the app;
//! - before the cache (`bufsize`, `errors`, `log`, `dnstap`, `dns64`, `loadbalance`): they see
//!   every query, hits included (`log`, `errors` and `dnstap`, run by the pipeline around every
//!   answer; `bufsize`, `dns64` and `loadbalance` in [`Before`], which edit the query's limit
//!   and the answer written for the client, `dns64` replacing an AAAA answer by one made from
//!   a second look-up, `crate::serve::dns64`);
//! - after the cache ([`Chain`]): only a query the cache could not answer gets there. The
//!   synchronous answerers before `forward` (`template`, `hosts`) run on the listener's
//!   thread; then `forward` (the async miss path: single-flight, the upstream pool), whose
//!   query `rewrite` changes and whose reply it reverts; then what comes after it (`whoami`). What they answer is stored in the block's cache as an
//!   upstream answer would be (the cache's TTL rules apply), except `whoami`'s, which is the
//!   client's own address.
//!
//! A block whose [`Chain`] is empty takes exactly the path it took before plugins existed: the
//! pipeline tests [`Live::plain`] (no [`Before`] plugin) around a hit, and [`Live::is_empty`]
//! (nothing after the cache) only once the cache has missed.
//!
//! The configuration half of each plugin is a pure function of the Corefile (it never reads a
//! file: `hosts` reads its file when the block starts serving, [`Chain::start`]).

pub mod bind;
pub mod bufsize;
pub mod cache;
pub mod dns64;
pub mod dnstap;
pub mod errors;
pub mod forward;
mod go;
pub mod health;
pub mod hosts;
pub mod loadbalance;
pub mod log;
pub mod r#loop;
pub mod prometheus;
pub mod ready;
pub mod reload;
pub mod rewrite;
pub mod template;
pub mod tls;
pub mod whoami;

use std::net::SocketAddr;

use hickory_proto::op::{Message, MessageType, OpCode, Query as Question};
use hickory_proto::rr::{DNSClass, Name, Record, RecordType};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder, NameEncoding};
use nodedns_wire::{Key, Query};
use prometheus_client::registry::Registry;

use crate::metrics::Plugin;

/// CoreDNS's plugin order (`plugin.cfg`, v1.10.0–v1.14.0), restricted to what node-cache
/// compiles in: a block's chain runs in this order whatever order its lines are written in.
/// `cache` splits it: what precedes it sees every query, what follows it only misses.
pub const ORDER: [&str; 22] = [
    "metadata",
    "reload",
    "bufsize",
    "bind",
    "debug",
    "trace",
    "ready",
    "health",
    "pprof",
    "prometheus",
    "errors",
    "log",
    "dnstap",
    "dns64",
    "loadbalance",
    "cache",
    "rewrite",
    "template",
    "hosts",
    "loop",
    "forward",
    "whoami",
];

/// A server block's plugins after the cache, as configured: one field per plugin, declared in
/// chain order ([`ORDER`]). `forward` is the block's `Server::forward` (it is the async step
/// between the fields before it and those after it); `loop` only probes at start.
///
/// A plugin CoreDNS allows several times in a block (`template`) is a `Vec`,
/// one handler per line in file order, each passing on what it does not match; `hosts` is an
/// `Option` because CoreDNS allows it once per block.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chain {
    /// The plugins before the cache (`bufsize`, `loadbalance`), on every answer, hits included.
    pub before: Before,
    /// `rewrite`: every line of the block, as one rule list (its text: the lines, in order).
    /// It changes only what goes upstream (see [`Live::rewrite`]).
    pub rewrite: Option<Written<rewrite::Rewrite>>,
    /// `template`: answers built from templates, one per line in file order.
    pub template: Vec<Written<template::Template>>,
    /// `hosts`: answers from a hosts file and inline entries.
    pub hosts: Option<hosts::Hosts>,
    /// `whoami`: the client's own address and port, for what reaches the end of the chain.
    pub whoami: Option<whoami::Whoami>,
}

impl Chain {
    /// Whether the block has no plugin after the cache but `forward`.
    pub fn is_empty(&self) -> bool {
        self.template.is_empty() && self.hosts.is_none() && self.whoami.is_none()
    }

    /// The chain ready to serve: files read, pollers started (inside the tokio runtime). A
    /// plugin whose configuration `previous` already runs unchanged is taken over as it is
    /// (`hosts` keeps its table and its poller).
    /// `server` is the block's `server` label (templates count their matches under it).
    pub fn start(&self, previous: Option<&Live>, metrics: &Metrics, server: &str) -> Live {
        let template = self
            .template
            .iter()
            .map(|line| {
                let mut t = line.value.clone();
                t.instrument(&metrics.template, server);
                t
            })
            .collect();
        let hosts = self.hosts.as_ref().map(|config| {
            previous
                .and_then(|p| p.hosts.as_ref())
                .filter(|old| old.config() == config)
                .cloned()
                .unwrap_or_else(|| hosts::Live::start(config.clone(), &metrics.hosts))
        });
        // Only a block with `dns64` has the series: at 0 from its start (CoreDNS's appears at
        // its first count).
        let translated = self.before.dns64.map(|_| {
            metrics
                .dns64
                .translated
                .get_or_create(&dns64::Server {
                    server: server.to_owned(),
                })
                .clone()
        });
        Live {
            before: self.before,
            any_before: !self.before.is_empty(),
            translated,
            rewrite: self.rewrite.as_ref().map(|r| r.value.clone()),
            template,
            hosts,
            whoami: self.whoami,
        }
    }
}

/// A block's [`Chain`], serving.
#[derive(Debug, Default)]
pub struct Live {
    before: Before,
    /// `!before.is_empty()`, kept: the hit path tests one flag (false by default: plain).
    any_before: bool,
    /// `coredns_dns64_requests_translated_total` of the block's `server`, with `dns64`.
    translated: Option<prometheus_client::metrics::counter::Counter>,
    rewrite: Option<rewrite::Rewrite>,
    template: Vec<template::Template>,
    hosts: Option<std::sync::Arc<hosts::Live>>,
    whoami: Option<whoami::Whoami>,
}

/// What one query asks, for the plugins after the cache.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The query as the client sent it.
    pub query: &'a Query<'a>,
    /// Its cache key: the lowercased name, type and class.
    pub key: &'a Key,
    /// The client's address and transport.
    pub client: Option<(SocketAddr, crate::serve::Proto)>,
}

/// What a plugin did with a query.
#[derive(Debug)]
pub enum Step {
    /// The reply to send (without OPT: the pipeline adds the client's), made by `by`. `cache`:
    /// whether the block's cache may store it.
    Answer {
        reply: Vec<u8>,
        by: Plugin,
        cache: bool,
    },
    /// SERVFAIL, made by the plugin and never cached (CoreDNS's handler returned the code
    /// without writing).
    ServFail,
    /// Not this plugin's: the next one in the chain.
    Next,
}

impl Live {
    /// Whether the block has no plugin before the cache: its hits take the path they took
    /// before plugins existed.
    #[inline(always)]
    pub fn plain(&self) -> bool {
        !self.any_before
    }

    /// Counts one answer `dns64` synthesized.
    pub fn translated(&self) {
        if let Some(counter) = &self.translated {
            counter.inc();
        }
    }

    /// The block's plugins before the cache.
    pub fn before(&self) -> &Before {
        &self.before
    }

    /// The block's `rewrite` rules. They run on the miss path only, on the query that goes
    /// upstream (built from the cache key: one fetch serves every client that joins it), and
    /// their [`rewrite::Revert`] on its reply before it is cached. `rewrite` alone does not make
    /// a block's chain non-empty: the answerers (`template`, `hosts`) see the name the client
    /// asked.
    pub fn rewrite(&self) -> Option<&rewrite::Rewrite> {
        self.rewrite.as_ref()
    }

    /// Whether the block has no plugin after the cache but `forward`.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.template.is_empty() && self.hosts.is_none() && self.whoami.is_none()
    }

    /// The plugins between the cache and `forward`, in chain order.
    pub fn before_forward(&self, request: &Request<'_>) -> Step {
        if !self.template.is_empty() {
            match self.templates(request) {
                Step::Next => {}
                step => return step,
            }
        }
        if let Some(hosts) = &self.hosts {
            match hosts.answer(request) {
                Step::Next => {}
                step => return step,
            }
        }
        Step::Next
    }

    /// The `template` lines in file order: the first that answers (or fails) ends the chain.
    fn templates(&self, request: &Request<'_>) -> Step {
        let Ok(query) = Message::from_vec(request.query.bytes()) else {
            return Step::Next;
        };
        let client = request.client.map_or(
            SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
            |(addr, _)| addr,
        );
        for t in &self.template {
            match t.answer(&query, client) {
                template::Outcome::Answer(reply) => {
                    return match encode(&reply) {
                        Some(reply) => Step::Answer {
                            reply,
                            by: Plugin::Template,
                            cache: true,
                        },
                        None => Step::ServFail,
                    };
                }
                template::Outcome::ServFail => return Step::ServFail,
                template::Outcome::Next => {}
            }
        }
        Step::Next
    }

    /// The plugins after `forward`, for what `forward` does not take.
    pub fn after_forward(&self, request: &Request<'_>) -> Step {
        match (&self.whoami, request.client) {
            (Some(whoami), Some(client)) => whoami.answer(request, client),
            _ => Step::Next,
        }
    }
}

/// A server block's plugins before the cache, in chain order ([`ORDER`]): they act on every
/// query and every answer, hits included. Each edits the query's limits or the answer already
/// written for the client; the cache never sees them (it stores what upstream and the plugins
/// after it answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Before {
    /// `bufsize`: the largest EDNS UDP size a query keeps.
    pub bufsize: Option<bufsize::Bufsize>,
    /// `dns64`: AAAA answers synthesized from A answers.
    pub dns64: Option<dns64::Dns64>,
    /// `loadbalance`: round robin of A, AAAA and MX records.
    pub loadbalance: Option<loadbalance::Loadbalance>,
}

impl Before {
    /// Whether the block has none.
    pub fn is_empty(&self) -> bool {
        self.bufsize.is_none() && self.dns64.is_none() && self.loadbalance.is_none()
    }

    /// The largest answer to `query` over `proto`, given the `limit` the query sets.
    ///
    /// Cold, as [`Before::served`].
    #[cold]
    #[inline(never)]
    pub fn limit(&self, query: &Query<'_>, proto: crate::serve::Proto, limit: usize) -> usize {
        match (self.bufsize, proto) {
            (Some(bufsize), crate::serve::Proto::Udp) => bufsize.limit(query, limit),
            _ => limit,
        }
    }

    /// Their edits of the answer in `out`, written for `query`, in chain order.
    ///
    /// Cold: a block without them never calls it, and its code must not crowd the hit path.
    #[cold]
    #[inline(never)]
    pub fn served(&self, query: &Query<'_>, out: &mut Vec<u8>) {
        if let Some(bufsize) = self.bufsize {
            bufsize.served(query, out);
        }
        if let Some(loadbalance) = self.loadbalance {
            loadbalance.served(query, out);
        }
    }

    /// Their edits of the query the block sends upstream (`out`).
    pub fn upstream(&self, out: &mut [u8]) {
        if let Some(bufsize) = self.bufsize {
            bufsize.upstream(out);
        }
    }
}

/// A plugin line's configuration, compared by what was written (its words and block) where the
/// value itself has no equality (compiled regexps): a reload that leaves the line as it was
/// keeps the configuration equal.
#[derive(Debug, Clone)]
pub struct Written<T> {
    pub text: String,
    pub value: T,
}

impl<T> PartialEq for Written<T> {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl<T> Written<T> {
    /// `value`, read from `d`.
    pub(crate) fn new(d: &crate::config::corefile::Directive, value: T) -> Written<T> {
        fn words(d: &crate::config::corefile::Directive, out: &mut String) {
            out.push_str(&d.name);
            for w in &d.args {
                out.push(' ');
                out.push_str(&format!("{:?}", w.text));
            }
            if d.has_block {
                out.push_str(" {");
                for o in &d.block {
                    out.push('\n');
                    words(o, out);
                }
                out.push_str("\n}");
            }
        }
        let mut text = String::new();
        words(d, &mut text);
        Written { text, value }
    }
}

/// The plugins' metrics, registered once per process (CoreDNS's are process-wide too).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub template: template::Metrics,
    pub hosts: hosts::Metrics,
    pub dns64: dns64::Metrics,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        Metrics {
            template: template::Metrics::register(registry),
            hosts: hosts::Metrics::register(registry),
            dns64: dns64::Metrics::register(registry),
        }
    }
}

/// A reply to `request` as CoreDNS's `m.SetReply(r)` makes it (the question, RD, opcode),
/// authoritative when `authoritative`, with `answers` and `additionals`. The question is the
/// key's (lowercased); names are written uncompressed, so the pipeline's copy of the client's
/// question (its letter case) over it never changes an owner name.
pub fn reply(
    request: &Request<'_>,
    authoritative: bool,
    answers: Vec<Record>,
    additionals: Vec<Record>,
) -> Option<Vec<u8>> {
    let name = name(request.key.qname())?;
    let mut message = Message::response(0, OpCode::Query);
    message.metadata.message_type = MessageType::Response;
    message.metadata.recursion_desired = request.query.rd();
    message.metadata.authoritative = authoritative;
    let mut question = Question::query(name, RecordType::from(request.key.qtype()));
    question.set_query_class(DNSClass::from(request.key.qclass()));
    message.add_query(question);
    message.answers = answers;
    message.additionals = additionals;
    encode(&message)
}

/// `message` in wire form with every name written out (no compression): the pipeline copies the
/// client's question (its letter case) over the question, and no owner name may point into it.
pub fn encode(message: &Message) -> Option<Vec<u8>> {
    let mut bytes = Vec::with_capacity(128);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.set_name_encoding(NameEncoding::Uncompressed);
    message.emit(&mut encoder).ok()?;
    Some(bytes)
}

/// A wire-form name as hickory's [`Name`] (absolute).
pub fn name(wire: &[u8]) -> Option<Name> {
    let mut labels = Vec::new();
    let mut at = 0;
    loop {
        let len = usize::from(*wire.get(at)?);
        if len == 0 {
            break;
        }
        labels.push(wire.get(at + 1..at + 1 + len)?);
        at += 1 + len;
    }
    let mut name = Name::from_labels(labels).ok()?;
    name.set_fqdn(true);
    Some(name)
}

/// The loading of one block, for the plugins' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    use crate::config::corefile::{self, Block};
    use crate::config::import::Imports;
    use crate::config::{Config, ConfigError, Inputs};

    /// The server blocks of a Corefile `text` as read, before any directive is interpreted (for
    /// the modules `server_block` does not call yet, or calls with more than a Corefile gives).
    pub(crate) fn blocks(text: &str) -> Vec<Block> {
        let imports = Imports::default();
        corefile::parse(
            "Corefile",
            text,
            &HashMap::new(),
            Path::new("."),
            &mut &imports,
        )
        .expect("Corefile syntax")
        .blocks
    }

    /// `body` as the directives of a `.:53` block forwarding to 192.0.2.53, loaded: the
    /// configuration, or every problem as `file:line: message`.
    pub(crate) fn load(body: &str) -> Result<Config, Vec<String>> {
        let args = crate::config::tests::cli(&["-conf", "/etc/Corefile"]);
        let inputs = Inputs {
            corefile: Some((
                PathBuf::from("Corefile"),
                format!(".:53 {{\n{body}\n    forward . 192.0.2.53\n}}\n"),
            )),
            env: HashMap::new(),
            resolv_conf: Some("nameserver 192.0.2.1\n".to_owned()),
            ..Inputs::default()
        };
        crate::config::build(&args, &inputs).map_err(|e| match e {
            ConfigError::Invalid { problems } => problems.iter().map(ToString::to_string).collect(),
            other => panic!("{other}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_puts_the_answerers_behind_the_cache_and_whoami_after_forward() {
        let at = |name: &str| ORDER.iter().position(|p| *p == name).unwrap();
        assert!(at("log") < at("cache"));
        assert!(at("cache") < at("rewrite"));
        assert!(at("rewrite") < at("template"));
        assert!(at("template") < at("hosts"));
        assert!(at("hosts") < at("forward"));
        assert!(at("forward") < at("whoami"));
    }

    #[test]
    fn wire_names_become_absolute_names() {
        assert!(name(b"\x05ab").is_none());
        assert_eq!(name(b"\x01a\x00").unwrap().to_string(), "a.");
    }
}
