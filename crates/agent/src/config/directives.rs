//! The meaning of a parsed Corefile: each server block becomes a [`Server`], the directives that
//! configure the process (`health`, `ready`, `prometheus`, `reload`) are merged across blocks.
//! Every problem is collected with its `file:line`; a directive or option nodedns does not
//! implement is a problem, never skipped.
//!
//! This module is the dispatcher and the vocabulary the directives' parsers share ([`Out`],
//! [`Ctx`], [`Parsed`], [`Global`], the word readers): each directive is read by its own module
//! under `crate::plugin`, called from `server_block` by name.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::corefile::{Block, Directive, Word};
use super::{Difference, Problem, Scheme, Server, compat, values};
use crate::plugin;

/// What the directives read besides the file itself.
pub(crate) struct Ctx<'a> {
    pub file: &'a str,
    /// Port of blocks whose keys name none (CoreDNS `-dns.port`).
    pub dns_port: u16,
    pub resolv_conf_path: &'a Path,
    pub resolv_conf: Option<&'a str>,
    /// The other resolv.conf files `forward` names, read ([`super::forward_paths`]).
    pub forward_files: &'a BTreeMap<PathBuf, Option<String>>,
    /// Lines where `__PILLAR__UPSTREAM__SERVERS__` stood.
    pub upstream_lines: &'a BTreeSet<usize>,
    /// kube-dns `upstreamNameservers`, when set: a `forward` filled from the pillar goes over UDP.
    pub kube_upstreams: bool,
    /// The host's interfaces and their addresses, for `bind IFACE` ([`super::Inputs`]).
    pub interfaces: &'a BTreeMap<String, Vec<IpAddr>>,
}

/// A server and where it came from, for messages.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    pub server: Server,
    pub origin: String,
}

/// A process-wide setting and the line that set it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Global<T> {
    pub value: Option<(T, usize)>,
}

impl<T> Default for Global<T> {
    fn default() -> Self {
        Global { value: None }
    }
}

impl<T: PartialEq + Copy + std::fmt::Debug> Global<T> {
    pub(crate) fn set(
        &mut self,
        value: T,
        line: usize,
        what: &str,
        file: &str,
        problems: &mut Vec<Problem>,
    ) {
        match self.value {
            None => self.value = Some((value, line)),
            Some((old, _)) if old == value => {}
            Some((old, first)) => problems.push(Problem::at(
                file,
                line,
                format!(
                    "{what}: {value:?} differs from {old:?} given at line {first}; nodedns has one \
                     {what} setting for all blocks"
                ),
            )),
        }
    }

    pub fn get(&self) -> Option<T> {
        self.value.map(|(v, _)| v)
    }
}

/// Everything a Corefile configures.
#[derive(Debug, Default)]
pub(crate) struct Parsed {
    pub servers: Vec<Placed>,
    pub health: Global<SocketAddr>,
    pub lameduck: Global<Duration>,
    pub ready: Global<SocketAddr>,
    pub metrics: Global<SocketAddr>,
    /// The other `prometheus` addresses of other blocks: each is served too (CoreDNS opens one
    /// listener per address, all on the same registry).
    pub extra_metrics: Vec<SocketAddr>,
    pub reload: Global<Duration>,
    pub warnings: Vec<String>,
    /// Where nodedns's defaults take over from CoreDNS's ([`super::Config::differences`]).
    pub differences: Vec<Difference>,
}

/// Where a directive's parser reports: problems (which fail the load), warnings (logged),
/// differences from node-cache (printed by `--check-config`), each with `file:line`.
pub(crate) struct Out<'p> {
    pub problems: &'p mut Vec<Problem>,
    warnings: &'p mut Vec<String>,
    differences: &'p mut Vec<Difference>,
    pub file: &'p str,
}

impl Out<'_> {
    pub(crate) fn err(&mut self, line: usize, message: String) {
        self.problems.push(Problem::at(self.file, line, message));
    }

    pub(crate) fn warn(&mut self, line: usize, message: String) {
        self.warnings
            .push(format!("{}:{line}: {message}", self.file));
    }

    /// Notes a default of nodedns's that differs from CoreDNS's, applied at `line`.
    pub(crate) fn differ(&mut self, line: usize, message: String) {
        self.differences.push(Difference {
            at: format!("{}:{line}", self.file),
            what: message,
        });
    }

    /// Reports a block written after a directive or option that takes none.
    pub(crate) fn no_block(&mut self, d: &Directive, what: &str) {
        if d.has_block {
            self.err(d.line, format!("{what} takes no `{{ }}` block"));
        }
    }

    /// Reports a wrong number of arguments; true when the count is fine.
    pub(crate) fn arity(
        &mut self,
        d: &Directive,
        what: &str,
        min: usize,
        max: usize,
        syntax: &str,
    ) -> bool {
        let n = d.args.len();
        if n < min || n > max {
            self.err(
                d.line,
                format!("{what}: expected `{syntax}`, got {n} argument(s)"),
            );
            return false;
        }
        true
    }
}

/// Turns parsed server blocks into servers and process settings.
pub(crate) fn interpret(blocks: &[Block], ctx: &Ctx<'_>, problems: &mut Vec<Problem>) -> Parsed {
    let mut parsed = Parsed::default();
    let mut warnings = Vec::new();
    let mut differences = Vec::new();
    for block in blocks {
        let mut out = Out {
            problems,
            warnings: &mut warnings,
            differences: &mut differences,
            file: ctx.file,
        };
        if let Some(server) = server_block(block, ctx, &mut parsed, &mut out) {
            parsed.servers.push(Placed {
                server,
                origin: format!("{}:{}", ctx.file, block.line),
            });
        }
    }
    parsed.warnings = warnings;
    parsed.differences = differences;
    parsed
}

/// `[scheme://]zone[:port]` keys → canonical zones, the block's port and its scheme. A key
/// without a port is on the scheme's port: `-dns.port` for `dns://`, 853 for `tls://`, 443 for
/// `https://` (CoreDNS's defaults).
fn keys(block: &Block, ctx: &Ctx<'_>, out: &mut Out<'_>) -> (Vec<String>, Option<u16>, Scheme) {
    let mut zones = Vec::new();
    let mut port: Option<u16> = None;
    let mut scheme: Option<Scheme> = None;
    for key in &block.keys {
        let text = key.text.as_str();
        let (this, text) = match text.split_once("://") {
            Some(("dns", rest)) => (Scheme::Dns, rest),
            Some(("tls", rest)) => (Scheme::Tls, rest),
            Some(("https", rest)) => (Scheme::Https, rest),
            Some((other, _)) => {
                out.err(
                    key.line,
                    format!(
                        "`{text}`: {other}:// server blocks are not implemented (nodedns serves \
                         dns://, tls:// and https://)"
                    ),
                );
                continue;
            }
            None => (Scheme::Dns, text),
        };
        match scheme {
            None => scheme = Some(this),
            Some(first) if first != this => {
                out.err(
                    key.line,
                    format!(
                        "`{text}`: a block's keys all have one scheme; this block's first is \
                         {}://",
                        first.as_str()
                    ),
                );
                continue;
            }
            Some(_) => {}
        }
        let (zone_text, port_text) = super::corefile::split_port(text);
        let p = match port_text.map(str::parse::<u16>) {
            None => match this {
                Scheme::Dns => ctx.dns_port,
                Scheme::Tls => 853,
                Scheme::Https => 443,
            },
            Some(Ok(p)) => p,
            Some(Err(_)) => {
                out.err(
                    key.line,
                    format!("`{}`: the port is not a number from 0 to 65535", key.text),
                );
                continue;
            }
        };
        // One port per block: the reader splits a block whose keys name several.
        port.get_or_insert(p);
        match values::zone(zone_text) {
            Ok(z) if zones.contains(&z) => out.err(key.line, format!("zone `{z}` is listed twice")),
            Ok(z) => zones.push(z),
            Err(e) => out.err(key.line, format!("server block zone {e}")),
        }
    }
    (zones, port, scheme.unwrap_or_default())
}

fn server_block(
    block: &Block,
    ctx: &Ctx<'_>,
    parsed: &mut Parsed,
    out: &mut Out<'_>,
) -> Option<Server> {
    let (zones, port, scheme) = keys(block, ctx, out);
    let mut bind: Vec<IpAddr> = Vec::new();
    let mut bind_written = false;
    let mut server = Server {
        zones: zones.clone(),
        listen: Vec::new(),
        cache: None,
        forwards: Vec::new(),
        log: Vec::new(),
        errors: false,
        loop_check: false,
        dnstap: Vec::new(),
        chain: crate::plugin::Chain::default(),
        scheme,
        tls: None,
    };
    let mut seen: Vec<(&str, usize)> = Vec::new();
    // The last `forward` line, and whether it has `next`.
    let mut last_forward: Option<(usize, bool)> = None;
    for d in &block.directives {
        let name = d.name.as_str();
        // CoreDNS allows several of these in a block: one handler per line, in file order.
        if !matches!(
            name,
            "bind" | "template" | "rewrite" | "dnstap" | "log" | "forward"
        ) {
            if let Some((_, first)) = seen.iter().find(|(n, _)| *n == name) {
                out.err(
                    d.line,
                    format!(
                        "`{name}` is already given at line {first}; it may appear once per block"
                    ),
                );
                continue;
            }
            seen.push((name, d.line));
        }
        // One line per directive: each plugin's module reads its own (`crate::plugin`).
        match name {
            "bind" => {
                bind_written = true;
                plugin::bind::parse(d, &mut bind, ctx.interfaces, out);
            }
            "cache" => server.cache = plugin::cache::parse(d, &zones, out),
            "forward" => {
                let forward = plugin::forward::parse(d, ctx, out);
                last_forward = Some((d.line, forward.as_ref().is_some_and(|f| !f.next.is_empty())));
                server.forwards.extend(forward);
            }
            "health" => plugin::health::parse(d, parsed, ctx, out),
            "ready" => plugin::ready::parse(d, parsed, ctx, out),
            "prometheus" => plugin::prometheus::parse(d, parsed, out),
            "errors" => server.errors = plugin::errors::parse(d, out),
            "debug" | "metadata" | "pprof" | "trace" => {
                if let Some(v) = compat::directive(d) {
                    verdict(v, d.line, out);
                }
            }
            "log" => server.log.extend(plugin::log::parse(d, out)),
            "reload" => plugin::reload::parse(d, parsed, out),
            "dnstap" => server.dnstap.extend(plugin::dnstap::parse(d, out)),
            "template" => {
                if let Some(t) =
                    plugin::template::Template::parse(d, &zones, ctx.file, out.problems)
                {
                    server.chain.template.push(plugin::Written::new(d, t));
                }
            }
            "rewrite" => {
                let all = server.chain.rewrite.get_or_insert_with(|| plugin::Written {
                    text: String::new(),
                    value: plugin::rewrite::Rewrite::default(),
                });
                all.value.add(d, ctx.file, out.problems);
                all.text.push_str(&plugin::Written::new(d, ()).text);
                all.text.push('\n');
            }
            "bufsize" => server.chain.before.bufsize = plugin::bufsize::parse(d, out),
            "dns64" => server.chain.before.dns64 = plugin::dns64::parse(d, out),
            "loadbalance" => server.chain.before.loadbalance = plugin::loadbalance::parse(d, out),
            "hosts" => server.chain.hosts = plugin::hosts::parse(d, &zones, out),
            "whoami" => server.chain.whoami = plugin::whoami::parse(d, out),
            "loop" => server.loop_check = plugin::r#loop::parse(d, out),
            "tls" => match scheme {
                Scheme::Tls => server.tls = plugin::tls::parse(d, &[], out),
                Scheme::Https => server.tls = plugin::tls::parse(d, &plugin::tls::HTTPS_ALPN, out),
                Scheme::Dns => out.warn(
                    d.line,
                    "tls has no effect in a dns:// block (as in CoreDNS): it serves plain DNS; \
                     write the block's key as tls://ZONE or https://ZONE"
                        .to_owned(),
                ),
            },
            other => out.err(
                d.line,
                format!(
                    "unknown directive `{other}`: nodedns does not implement it (see \
                     docs/configuration.md for the directives it does)"
                ),
            ),
        }
    }
    if let Some((line, true)) = last_forward {
        out.warn(
            line,
            "forward next: no `forward` line follows this one in its block, so its replies \
             stand whatever their rcode (as in CoreDNS)"
                .to_owned(),
        );
    }
    let port = port?;
    if zones.is_empty() {
        return None;
    }
    server.listen = if bind.is_empty() {
        if bind_written {
            out.err(
                block.line,
                "`bind` leaves no address to listen on: it excepts every address it lists, or \
                 its interfaces have none"
                    .to_owned(),
            );
            return None;
        }
        vec![
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        ]
    } else {
        bind.iter().map(|ip| SocketAddr::new(*ip, port)).collect()
    };
    Some(server)
}

/// A directive or option accepted for compatibility: its explanation as a warning, or its
/// problems.
pub(crate) fn verdict(v: compat::Verdict, line: usize, out: &mut Out<'_>) {
    match v {
        Ok(explanation) => out.warn(line, explanation),
        Err(problems) => {
            for (line, message) in problems {
                out.err(line, message);
            }
        }
    }
}

pub(crate) fn whole<T: std::str::FromStr>(w: &Word, what: &str, out: &mut Out<'_>) -> Option<T> {
    match w.text.parse::<T>() {
        Ok(v) => Some(v),
        Err(_) => {
            out.err(
                w.line,
                format!("{what} must be a whole number, not `{}`", w.text),
            );
            None
        }
    }
}

pub(crate) fn duration(w: &Word, what: &str, out: &mut Out<'_>) -> Option<Duration> {
    match values::go_duration(&w.text) {
        Ok(d) => Some(d),
        Err(e) => {
            out.err(w.line, format!("{what}: {e}"));
            None
        }
    }
}
