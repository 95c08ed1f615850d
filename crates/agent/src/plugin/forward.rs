//! `forward`: where a block sends what its cache and its other plugins do not answer, as
//! CoreDNS's `plugin/forward` configures it (`forward FROM TO... { except ...; force_tcp;
//! prefer_udp; policy ...; max_concurrent ...; max_fails ...; health_check DURATION [no_rec]
//! [domain FQDN]; expire ...; next RCODE...;
//! timeout ...; read_timeout ...; tls ...; tls_servername ... }`).
//!
//! A block may hold several `forward` lines: CoreDNS chains them in file order, each taking
//! the names under its FROM and under none of its `except` names, and passing the others on to
//! the next line; `next RCODE...` passes on a query whose reply has one of those rcodes too
//! (to the next line only: after the last one, the reply stands). Each line has its own
//! upstream group (pool, health checks); the miss path picks the line.
//!
//! Its logic is the `nodedns-upstream` crate (pooled connections, health, failover); its place
//! in the chain is the pipeline's async miss path (`serve::pipeline`: single-flight, then the
//! block's `upstream::Group`), between the plugins before it ([`super::Chain`]: `hosts`) and
//! those after it (`whoami`); its metrics are the upstream crate's and the pipeline's
//! (`coredns_forward_*`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use nodedns_upstream::tls::{Files, LoadError, Settings};
use nodedns_upstream::{Selection, Transport};

use crate::config::corefile::{Directive, Word};
use crate::config::directives::{Ctx, Out, duration, whole};
use crate::config::{Forward, template, values};

/// CoreDNS's cap on `forward` destinations.
const MAX_UPSTREAMS: usize = 15;

pub(crate) fn parse(d: &Directive, ctx: &Ctx<'_>, out: &mut Out<'_>) -> Option<Forward> {
    if d.args.len() < 2 {
        out.err(d.line, "forward: expected `forward FROM TO...`".to_owned());
        return None;
    }
    let before = out.problems.len();
    let from = match values::zone(&d.args[0].text) {
        Ok(z) => z,
        Err(e) => {
            out.err(d.line, format!("forward FROM: {e}"));
            String::new()
        }
    };
    let mut upstream = nodedns_upstream::Config {
        transport: Transport::PreferUdp,
        ..Default::default()
    };
    let mut tls_addrs = Vec::new();
    for w in &d.args[1..] {
        let text = match w.text.split_once("://") {
            Some(("dns", rest)) => rest,
            Some(("tls", rest)) => {
                if let Some(addr) = tls_upstream(w, rest, &mut upstream.addrs, out) {
                    tls_addrs.push(addr);
                }
                continue;
            }
            Some((scheme, _)) => {
                out.err(
                    w.line,
                    format!(
                        "forward: {scheme}:// upstreams are not implemented (`{}`)",
                        w.text
                    ),
                );
                continue;
            }
            None => w.text.as_str(),
        };
        if let Ok(addr) = values::host_port(text, 53) {
            upstream.addrs.push(addr);
            continue;
        }
        // Not an address: a resolv.conf to read, as CoreDNS does (`forward . /etc/resolv.conf`).
        let file = if Path::new(text) == ctx.resolv_conf_path {
            Some(ctx.resolv_conf)
        } else {
            match ctx.forward_files.get(Path::new(text)) {
                Some(Some(contents)) => Some(Some(contents.as_str())),
                // A path that is not there; a bare word is simply not an address.
                _ if text.contains('/') => Some(None),
                _ => None,
            }
        };
        if let Some(contents) = file {
            match template::node_resolvers(text, contents) {
                Ok(addrs) => upstream.addrs.extend(addrs),
                Err(problems) => {
                    out.err(
                        w.line,
                        format!("forward: cannot use the nameservers of {text}, see below"),
                    );
                    out.problems.extend(problems);
                }
            }
        } else {
            out.err(
                w.line,
                format!("forward: `{text}` is not an IP address with an optional port, nor a file"),
            );
        }
    }
    if upstream.addrs.len() > MAX_UPSTREAMS {
        out.err(
            d.line,
            format!(
                "forward: more than {MAX_UPSTREAMS} upstreams ({})",
                upstream.addrs.len()
            ),
        );
    }
    let mut except = Vec::new();
    let mut next = Vec::new();
    let mut transport: Option<(&str, usize)> = None;
    let (mut max_concurrent_written, mut expire_written) = (false, false);
    let mut tls = ForwardTls::default();
    for o in &d.block {
        let name = o.name.as_str();
        out.no_block(o, &format!("forward {name}"));
        expire_written |= name == "expire";
        if forward_timing(o, &mut upstream, out) {
            continue;
        }
        match name {
            "force_tcp" | "prefer_udp" => {
                out.arity(o, name, 0, 0, name);
                if let Some((other, line)) = transport.filter(|(n, _)| *n != name) {
                    out.err(
                        o.line,
                        format!("forward: {name} contradicts {other} at line {line}"),
                    );
                }
                transport = Some((name, o.line));
                upstream.transport = if name == "force_tcp" {
                    Transport::Tcp
                } else {
                    Transport::PreferUdp
                };
            }
            "max_concurrent" => {
                max_concurrent_written = true;
                if out.arity(o, name, 1, 1, "max_concurrent MAX") {
                    if let Some(n) = whole::<usize>(&o.args[0], "forward max_concurrent", out) {
                        // CoreDNS: 0 means no limit.
                        upstream.max_concurrent = if n == 0 { usize::MAX } else { n };
                    }
                }
            }
            "policy" => {
                if out.arity(o, name, 1, 1, "policy random|round_robin|sequential") {
                    upstream.selection = match o.args[0].text.as_str() {
                        "random" => Selection::Random,
                        "round_robin" => Selection::RoundRobin,
                        "sequential" => Selection::Sequential,
                        other => {
                            out.err(o.line, format!("forward policy must be random, round_robin or sequential, not `{other}`"));
                            upstream.selection
                        }
                    };
                }
            }
            "except" => {
                if out.arity(o, name, 1, usize::MAX, "except IGNORED_NAMES...") {
                    for w in &o.args {
                        match values::zone(&w.text) {
                            Ok(z) => except.push(z),
                            Err(e) => out.err(w.line, format!("forward except: {e}")),
                        }
                    }
                }
            }
            "next" => {
                if out.arity(o, name, 1, usize::MAX, "next RCODE...") {
                    for w in &o.args {
                        match rcode_named(&w.text) {
                            Some(rcode) if next.contains(&rcode) => {}
                            Some(rcode) => next.push(rcode),
                            None => out.err(
                                w.line,
                                format!(
                                    "forward next: `{}` is not an rcode (NOERROR, FORMERR, \
                                     SERVFAIL, NXDOMAIN, NOTIMP, REFUSED, YXDOMAIN, ...)",
                                    w.text
                                ),
                            ),
                        }
                    }
                }
            }
            "tls" | "tls_servername" => tls.option(o, out),
            other => out.err(o.line, format!("unknown option `{other}` of `forward`")),
        }
    }
    upstream.tls = tls.settings(d, tls_addrs, &upstream.addrs, out);
    if ctx.kube_upstreams && ctx.upstream_lines.contains(&d.line) {
        // node-cache: custom upstream nameservers are reached over UDP, force_tcp or not.
        upstream.transport = Transport::PreferUdp;
    }
    if out.problems.len() > before {
        return None;
    }
    if !max_concurrent_written {
        out.differ(
            d.line,
            format!(
                "forward: at most {} queries in flight without `max_concurrent` (more are \
                 answered REFUSED); node-cache's CoreDNS sets no limit. `max_concurrent 0` lifts it",
                upstream.max_concurrent
            ),
        );
    }
    if !expire_written {
        out.differ(
            d.line,
            format!(
                "forward: idle upstream connections are closed after {:?} without `expire`; \
                 node-cache's CoreDNS keeps them 10s, as long as CoreDNS itself keeps an idle \
                 connection open, so a reused one may already be closing",
                upstream.expire
            ),
        );
    }
    Some(Forward {
        from,
        except,
        next,
        upstream,
    })
}

/// The rcode `text` names, as CoreDNS reads `next`'s arguments (miekg/dns's `StringToRcode`,
/// any case, with its `NOTIMPL` spelling of NOTIMP).
fn rcode_named(text: &str) -> Option<u16> {
    let upper = text.to_ascii_uppercase();
    if upper == "NOTIMPL" {
        return Some(nodedns_wire::rcode::NOTIMP.into());
    }
    (0..=u16::from(u8::MAX)).find(|&code| nodedns_wire::rcode::name(code) == Some(upper.as_str()))
}

/// A `tls://ADDR[:PORT]` destination of `forward` (port 853 by default), added to `addrs`.
fn tls_upstream(
    w: &Word,
    text: &str,
    addrs: &mut Vec<SocketAddr>,
    out: &mut Out<'_>,
) -> Option<SocketAddr> {
    if text.contains('%') {
        out.err(
            w.line,
            format!(
                "forward: a server name per upstream (`{}`) is not implemented; name it for all \
                 with `tls_servername`",
                w.text
            ),
        );
        return None;
    }
    match values::host_port(text, 853) {
        Ok(addr) => {
            addrs.push(addr);
            Some(addr)
        }
        Err(e) => {
            out.err(w.line, format!("forward: {e} (in `{}`)", w.text));
            None
        }
    }
}

/// `forward`'s TLS options as CoreDNS reads them (`plugin/forward`, `plugin/pkg/tls`): the last
/// of each wins, and they apply to the `tls://` destinations only.
#[derive(Debug, Default)]
struct ForwardTls {
    /// `tls [CERT KEY [CA]]` and its line.
    files: Option<(Files, usize)>,
    /// `tls_servername NAME` and its line.
    server_name: Option<(String, usize)>,
}

impl ForwardTls {
    /// Reads a `tls` or `tls_servername` line of the block.
    fn option(&mut self, o: &Directive, out: &mut Out<'_>) {
        if o.name == "tls_servername" {
            if out.arity(o, "tls_servername", 1, 1, "tls_servername NAME") {
                self.server_name = Some((o.args[0].text.clone(), o.line));
            }
            return;
        }
        if !out.arity(o, "tls", 0, 3, "tls [CA] | tls CERT KEY [CA]") {
            return;
        }
        let args: Vec<PathBuf> = o.args.iter().map(|w| PathBuf::from(&w.text)).collect();
        // 1 argument: the CA; 2: a client certificate and key; 3: both and the CA.
        let files = match args.as_slice() {
            [] => Files::default(),
            [ca] => Files {
                ca: Some(ca.clone()),
                client: None,
            },
            [cert, key, rest @ ..] => Files {
                ca: rest.first().cloned(),
                client: Some((cert.clone(), key.clone())),
            },
        };
        self.files = Some((files, o.line));
    }

    /// Loads what the options name for the `tls://` destinations `tls_addrs` (`addrs`: all of
    /// the forward's). Problems are reported; `None` then, and when there is no `tls://`
    /// destination.
    fn settings(
        self,
        d: &Directive,
        tls_addrs: Vec<SocketAddr>,
        addrs: &[SocketAddr],
        out: &mut Out<'_>,
    ) -> Option<Settings> {
        let tls_line = self.files.as_ref().map(|(_, line)| *line);
        let name_line = self.server_name.as_ref().map(|(_, line)| *line);
        if let (true, Some(first)) = (tls_addrs.is_empty(), tls_line.or(name_line)) {
            out.warn(
                first,
                "forward: `tls` and `tls_servername` apply to tls:// destinations only; this \
                 forward has none"
                    .to_owned(),
            );
        }
        let mut both = BTreeSet::new();
        for addr in &tls_addrs {
            let count = |list: &[SocketAddr]| list.iter().filter(|a| *a == addr).count();
            if count(addrs) > count(&tls_addrs) && both.insert(*addr) {
                out.err(
                    d.line,
                    format!("forward: {addr} is listed both as tls:// and as plain DNS"),
                );
            }
        }
        if tls_addrs.is_empty() && self.files.is_none() {
            return None;
        }
        let files = self.files.map(|(f, _)| f).unwrap_or_default();
        let name = self.server_name.as_ref().map(|(n, _)| n.as_str());
        // Loaded even when no destination uses them: a file that cannot be read is an error,
        // as in CoreDNS.
        match Settings::load(tls_addrs, name, &files) {
            Ok(settings) => (!settings.addrs.is_empty()).then_some(settings),
            Err(e) => {
                let line = match e {
                    LoadError::ServerName(_) => name_line,
                    _ => tls_line,
                };
                out.err(line.unwrap_or(d.line), format!("forward tls: {e}"));
                None
            }
        }
    }
}

/// The `forward` options about time and health, with CoreDNS's meanings, and `timeout`, the
/// deadline of a whole query (CoreDNS fixes it at 5 s). Returns false for any other option.
fn forward_timing(
    o: &Directive,
    upstream: &mut nodedns_upstream::Config,
    out: &mut Out<'_>,
) -> bool {
    let name = o.name.as_str();
    match name {
        // Per exchange (CoreDNS 1.14.5+), whole query (nodedns), idle connections.
        "read_timeout" | "timeout" | "expire" => {
            if out.arity(o, name, 1, 1, &format!("{name} DURATION")) {
                if let Some(v) = duration(&o.args[0], &format!("forward {name}"), out) {
                    if v.is_zero() {
                        out.err(o.line, format!("forward {name} must be positive"));
                    } else if name == "read_timeout" {
                        upstream.read_timeout = v;
                    } else if name == "timeout" {
                        upstream.timeout = v;
                    } else {
                        upstream.expire = v;
                    }
                }
            }
        }
        "health_check" => {
            let syntax = "health_check DURATION [no_rec] [domain FQDN]";
            if out.arity(o, name, 1, 4, syntax) {
                if let Some(v) = duration(&o.args[0], "forward health_check", out) {
                    if v.is_zero() {
                        // CoreDNS: 0 turns health checking off; upstreams are never marked down.
                        upstream.max_fails = 0;
                    } else {
                        upstream.health_check = v;
                    }
                }
                // CoreDNS: each `health_check` line starts again from `. IN NS` with RD set.
                upstream.probe = nodedns_upstream::Probe::default();
                let mut rest = o.args[1..].iter();
                while let Some(w) = rest.next() {
                    match w.text.as_str() {
                        "no_rec" => upstream.probe.recursion_desired = false,
                        "domain" => match rest.next().map(|w| values::canonical_name(&w.text)) {
                            Some(Ok(name)) => upstream.probe.name = values::wire(&name),
                            Some(Err(e)) => {
                                out.err(w.line, format!("forward health_check domain: {e}"))
                            }
                            None => out.err(
                                w.line,
                                format!("forward health_check: expected `{syntax}`, `domain` without a name"),
                            ),
                        },
                        other => out.err(
                            w.line,
                            format!("forward health_check: unknown option `{other}` (expected `{syntax}`)"),
                        ),
                    }
                }
            }
        }
        "max_fails" => {
            if out.arity(o, name, 1, 1, "max_fails INTEGER") {
                if let Some(n) = whole::<u32>(&o.args[0], "forward max_fails", out) {
                    upstream.max_fails = n;
                }
            }
        }
        // CoreDNS 1.13+.
        "failfast_all_unhealthy_upstreams" => {
            if out.arity(o, name, 0, 0, name) {
                upstream.failfast_all_unhealthy = true;
            }
        }
        _ => return false,
    }
    true
}
