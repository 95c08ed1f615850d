//! The meaning of a parsed Corefile: each server block becomes a [`Server`], the directives that
//! configure the process (`health`, `ready`, `prometheus`, `reload`) are merged across blocks.
//! Every problem is collected with its `file:line`; a directive or option nodedns does not
//! implement is a problem, never skipped.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use nodedns_cache::{Clamp, Policy, Prefetch, Stale};
use nodedns_upstream::{Selection, Transport};

use super::corefile::{Block, Directive, Word};
use super::{Forward, Problem, Server, template, values};

/// Bytes one cache entry is counted as when a Corefile gives capacities in entries (CoreDNS's
/// CAPACITY): a typical cluster answer (~150 B), its key and the bookkeeping around it.
pub(crate) const BYTES_PER_ENTRY: u64 = 512;
/// CoreDNS's default capacity per class (256 shards × 39 entries).
pub(crate) const DEFAULT_ENTRIES: u64 = 9984;
/// CoreDNS's smallest capacity per class (256 shards × 4 entries).
const MIN_ENTRIES: u64 = 1024;
/// CoreDNS's longest `servfail` duration.
const MAX_SERVFAIL: Duration = Duration::from_secs(300);
/// CoreDNS's cap on `forward` destinations.
const MAX_UPSTREAMS: usize = 15;

/// nodedns's serve-stale when a Corefile does not configure it: CoreDNS's 1 h window, RFC 8767's
/// 30 s TTL.
pub(crate) const DEFAULT_STALE: Stale = Stale {
    window: Duration::from_secs(3600),
    ttl: 30,
};
/// nodedns's prefetch when a Corefile does not configure it: an entry asked for at least twice
/// during its life is refreshed when 10 % of its TTL is left (CoreDNS's percentage).
pub(crate) const DEFAULT_PREFETCH: Prefetch = Prefetch {
    amount: 2,
    percentage: 10,
};

/// A cache policy with CoreDNS's TTL clamps and nodedns's defaults for everything else.
pub(crate) fn default_policy(capacity_bytes: u64) -> Policy {
    Policy {
        capacity_bytes,
        stale: Some(DEFAULT_STALE),
        prefetch: Some(DEFAULT_PREFETCH),
        ..Policy::default()
    }
}

/// What the directives read besides the file itself.
pub(crate) struct Ctx<'a> {
    pub file: &'a str,
    /// Port of blocks whose keys name none (CoreDNS `-dns.port`).
    pub dns_port: u16,
    pub resolv_conf_path: &'a Path,
    pub resolv_conf: Option<&'a str>,
    /// Lines where `__PILLAR__UPSTREAM__SERVERS__` stood.
    pub upstream_lines: &'a BTreeSet<usize>,
    /// kube-dns `upstreamNameservers`, when set: a `forward` filled from the pillar goes over UDP.
    pub kube_upstreams: bool,
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
    fn set(&mut self, value: T, line: usize, what: &str, file: &str, problems: &mut Vec<Problem>) {
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
    pub reload: Global<Duration>,
    pub warnings: Vec<String>,
}

struct Out<'p> {
    problems: &'p mut Vec<Problem>,
    warnings: &'p mut Vec<String>,
    file: &'p str,
}

impl Out<'_> {
    fn err(&mut self, line: usize, message: String) {
        self.problems.push(Problem::at(self.file, line, message));
    }

    fn warn(&mut self, line: usize, message: String) {
        self.warnings
            .push(format!("{}:{line}: {message}", self.file));
    }

    /// Reports a block written after a directive or option that takes none.
    fn no_block(&mut self, d: &Directive, what: &str) {
        if d.has_block {
            self.err(d.line, format!("{what} takes no `{{ }}` block"));
        }
    }

    /// Reports a wrong number of arguments; true when the count is fine.
    fn arity(&mut self, d: &Directive, what: &str, min: usize, max: usize, syntax: &str) -> bool {
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
    for block in blocks {
        let mut out = Out {
            problems,
            warnings: &mut warnings,
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
    parsed
}

/// `zone[:port]` keys → canonical zones and the block's port.
fn keys(block: &Block, ctx: &Ctx<'_>, out: &mut Out<'_>) -> (Vec<String>, Option<u16>) {
    let mut zones = Vec::new();
    let mut port: Option<(u16, &str)> = None;
    for key in &block.keys {
        let text = key.text.as_str();
        let text = match text.split_once("://") {
            Some(("dns", rest)) => rest,
            Some((scheme, _)) => {
                out.err(
                    key.line,
                    format!("`{text}`: {scheme}:// server blocks are not implemented (nodedns serves plain DNS)"),
                );
                continue;
            }
            None => text,
        };
        // A CIDR zone may hold colons (IPv6): only a colon after the prefix length is a port.
        let (zone_text, port_text) = match text.split_once('/') {
            Some((addr, bits)) => match bits.split_once(':') {
                Some((bits, p)) => (format!("{addr}/{bits}"), Some(p)),
                None => (text.to_owned(), None),
            },
            None => match text.rsplit_once(':') {
                Some((z, p)) => (z.to_owned(), Some(p)),
                None => (text.to_owned(), None),
            },
        };
        let p = match port_text.map(str::parse::<u16>) {
            None => ctx.dns_port,
            Some(Ok(p)) => p,
            Some(Err(_)) => {
                out.err(
                    key.line,
                    format!("`{}`: the port is not a number from 0 to 65535", key.text),
                );
                continue;
            }
        };
        match port {
            None => port = Some((p, &key.text)),
            Some((q, first)) if q != p => out.err(
                key.line,
                format!(
                    "`{}` and `{first}` are in one block but on different ports: write one block \
                     per port",
                    key.text
                ),
            ),
            Some(_) => {}
        }
        match values::zone(&zone_text) {
            Ok(z) if zones.contains(&z) => out.err(key.line, format!("zone `{z}` is listed twice")),
            Ok(z) => zones.push(z),
            Err(e) => out.err(key.line, format!("server block zone {e}")),
        }
    }
    (zones, port.map(|(p, _)| p))
}

fn server_block(
    block: &Block,
    ctx: &Ctx<'_>,
    parsed: &mut Parsed,
    out: &mut Out<'_>,
) -> Option<Server> {
    let (zones, port) = keys(block, ctx, out);
    let mut bind: Vec<IpAddr> = Vec::new();
    let mut bind_except: Vec<IpAddr> = Vec::new();
    let mut server = Server {
        zones: zones.clone(),
        listen: Vec::new(),
        cache: None,
        forward: None,
        log: false,
        errors: false,
        loop_check: false,
    };
    let mut seen: Vec<(&str, usize)> = Vec::new();
    for d in &block.directives {
        let name = d.name.as_str();
        if name != "bind" {
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
        match name {
            "bind" => bind_directive(d, &mut bind, &mut bind_except, out),
            "cache" => server.cache = cache_directive(d, &zones, out),
            "forward" => server.forward = forward_directive(d, ctx, out),
            "health" => {
                if out.arity(d, "health", 0, 1, "health [ADDRESS]") {
                    let text = d.args.first().map_or(":8080", |w| w.text.as_str());
                    match values::listen_addr(text) {
                        Ok(a) => parsed
                            .health
                            .set(a, d.line, "health", ctx.file, out.problems),
                        Err(e) => out.err(d.line, format!("health: {e}")),
                    }
                }
                for o in &d.block {
                    match o.name.as_str() {
                        "lameduck" => {
                            out.no_block(o, "health lameduck");
                            if out.arity(o, "health lameduck", 1, 1, "lameduck DURATION") {
                                match values::go_duration(&o.args[0].text) {
                                    Ok(v) => parsed.lameduck.set(
                                        v,
                                        o.line,
                                        "health lameduck",
                                        ctx.file,
                                        out.problems,
                                    ),
                                    Err(e) => out.err(o.line, format!("health lameduck: {e}")),
                                }
                            }
                        }
                        other => out.err(o.line, format!("unknown option `{other}` of `health`")),
                    }
                }
            }
            "ready" => {
                out.no_block(d, "ready");
                if out.arity(d, "ready", 0, 1, "ready [ADDRESS]") {
                    let text = d.args.first().map_or(":8181", |w| w.text.as_str());
                    match values::listen_addr(text) {
                        Ok(a) => parsed.ready.set(a, d.line, "ready", ctx.file, out.problems),
                        Err(e) => out.err(d.line, format!("ready: {e}")),
                    }
                }
            }
            "prometheus" => {
                out.no_block(d, "prometheus");
                if out.arity(d, "prometheus", 0, 1, "prometheus [ADDRESS]") {
                    let text = d.args.first().map_or("localhost:9153", |w| w.text.as_str());
                    match values::listen_addr(text) {
                        Ok(a) => {
                            parsed
                                .metrics
                                .set(a, d.line, "prometheus", ctx.file, out.problems)
                        }
                        Err(e) => out.err(d.line, format!("prometheus: {e}")),
                    }
                }
            }
            "errors" => {
                server.errors = true;
                out.arity(d, "errors", 0, 0, "errors");
                for o in &d.block {
                    out.err(
                        o.line,
                        format!("option `{}` of `errors` is not implemented", o.name),
                    );
                }
            }
            "log" => {
                server.log = true;
                log_directive(d, &zones, out);
            }
            "reload" => reload_directive(d, parsed, ctx, out),
            "loop" => {
                server.loop_check = true;
                out.no_block(d, "loop");
                out.arity(d, "loop", 0, 0, "loop");
            }
            other => out.err(
                d.line,
                format!(
                    "unknown directive `{other}`: nodedns does not implement it (see \
                     docs/configuration.md for the directives it does)"
                ),
            ),
        }
    }
    let port = port?;
    if zones.is_empty() {
        return None;
    }
    let listed = !bind.is_empty();
    bind.retain(|ip| !bind_except.contains(ip));
    server.listen = if bind.is_empty() {
        if listed {
            out.err(
                block.line,
                "`bind` excepts every address it lists".to_owned(),
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

fn bind_directive(
    d: &Directive,
    bind: &mut Vec<IpAddr>,
    except: &mut Vec<IpAddr>,
    out: &mut Out<'_>,
) {
    if d.args.is_empty() {
        out.err(
            d.line,
            "bind: expected `bind ADDRESS...`, got no address".to_owned(),
        );
    }
    let addrs = |words: &[Word], into: &mut Vec<IpAddr>, out: &mut Out<'_>| {
        for w in words {
            match w.text.parse::<IpAddr>() {
                Ok(ip) if !into.contains(&ip) => into.push(ip),
                Ok(_) => {}
                Err(_) => out.err(
                    w.line,
                    format!(
                        "bind: `{}` is not an IP address (nodedns binds addresses; interface names \
                         and IPv6 zones are not implemented)",
                        w.text
                    ),
                ),
            }
        }
    };
    addrs(&d.args, bind, out);
    for o in &d.block {
        match o.name.as_str() {
            "except" => {
                out.no_block(o, "bind except");
                if out.arity(o, "bind except", 1, usize::MAX, "except ADDRESS...") {
                    addrs(&o.args, except, out);
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `bind`")),
        }
    }
}

/// Zones given to `cache` or `log`: nodedns applies these directives to a whole block, so the
/// zones must cover every zone of the block.
fn covers_block(
    d: &Directive,
    what: &str,
    words: &[Word],
    block_zones: &[String],
    out: &mut Out<'_>,
) {
    let mut given = Vec::new();
    for w in words {
        match values::zone(&w.text) {
            Ok(z) => given.push(z),
            Err(e) => {
                out.err(w.line, format!("{what}: {e}"));
                return;
            }
        }
    }
    for zone in block_zones {
        if !given.iter().any(|g| values::is_under(zone, g)) {
            out.err(
                d.line,
                format!(
                    "{what}: applying it to only some names ({}) is not implemented; it applies to \
                     the whole block, which serves `{zone}`",
                    given.join(" ")
                ),
            );
            return;
        }
    }
}

fn whole<T: std::str::FromStr>(w: &Word, what: &str, out: &mut Out<'_>) -> Option<T> {
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

fn duration(w: &Word, what: &str, out: &mut Out<'_>) -> Option<Duration> {
    match values::go_duration(&w.text) {
        Ok(d) => Some(d),
        Err(e) => {
            out.err(w.line, format!("{what}: {e}"));
            None
        }
    }
}

/// TTL (max) and MINTTL of a `success`/`denial` line or of `cache TTL`.
fn ttl(w: &Word, what: &str, zero_ok: bool, out: &mut Out<'_>) -> Option<u32> {
    let v: i64 = whole(w, what, out)?;
    if v < 0 || (v == 0 && !zero_ok) {
        let bound = if zero_ok {
            "negative"
        } else {
            "zero or negative"
        };
        out.err(w.line, format!("{what} cannot be {bound}: {v}"));
        return None;
    }
    match u32::try_from(v) {
        Ok(v) => Some(v),
        Err(_) => {
            out.err(w.line, format!("{what} is too large: {v}"));
            None
        }
    }
}

/// Entries of a `success`/`denial` CAPACITY as CoreDNS sizes them: rounded down to a multiple
/// of its 256 shards, at least 1024.
fn entries(cap: u64) -> u64 {
    (cap - cap % 256).max(MIN_ENTRIES)
}

fn cache_directive(d: &Directive, block_zones: &[String], out: &mut Out<'_>) -> Option<Policy> {
    let mut max = [None::<u32>; 2]; // success, denial
    let mut min = [None::<u32>; 2];
    let mut cap = [DEFAULT_ENTRIES; 2];
    let mut stale = Some(DEFAULT_STALE);
    let mut prefetch = Some(DEFAULT_PREFETCH);
    let mut servfail = 5;
    let before = out.problems.len();

    let mut args = d.args.as_slice();
    if let Some(first) = args.first() {
        if first.text.parse::<i64>().is_ok() {
            if let Some(t) = ttl(first, "cache TTL", false, out) {
                max = [Some(t), Some(t)];
            }
            args = &args[1..];
        }
    }
    if !args.is_empty() {
        covers_block(d, "cache ZONES", args, block_zones, out);
    }

    for o in &d.block {
        let name = o.name.as_str();
        match name {
            "success" | "denial" => {
                out.no_block(o, name);
                let syntax = format!("{name} CAPACITY [TTL [MINTTL]]");
                if !out.arity(o, name, 1, 3, &syntax) {
                    continue;
                }
                let class = usize::from(name == "denial");
                if let Some(c) = whole::<u64>(&o.args[0], &format!("{name} CAPACITY"), out) {
                    cap[class] = c;
                }
                if let Some(w) = o.args.get(1) {
                    max[class] = ttl(w, &format!("{name} TTL"), false, out);
                }
                if let Some(w) = o.args.get(2) {
                    min[class] = ttl(w, &format!("{name} MINTTL"), true, out);
                }
            }
            "prefetch" => {
                out.no_block(o, name);
                if !out.arity(o, name, 1, 3, "prefetch AMOUNT [[DURATION] [PERCENTAGE%]]") {
                    continue;
                }
                let amount = whole::<u32>(&o.args[0], "prefetch AMOUNT", out);
                let mut percentage = DEFAULT_PREFETCH.percentage;
                if let Some(w) = o.args.get(1) {
                    if duration(w, "prefetch DURATION", out).is_some() {
                        out.warn(
                            o.line,
                            format!(
                                "prefetch DURATION `{}` has no effect: nodedns counts an entry's \
                                 hits over its whole lifetime",
                                w.text
                            ),
                        );
                    }
                }
                if let Some(w) = o.args.get(2) {
                    match w.text.strip_suffix('%').map(str::parse::<u8>) {
                        Some(Ok(p)) if (10..=90).contains(&p) => percentage = p,
                        Some(Ok(p)) => out.err(w.line, format!("prefetch PERCENTAGE must be from 10% to 90%, not {p}%")),
                        _ => out.err(w.line, format!("prefetch PERCENTAGE must be a whole number and `%`, such as `10%`, not `{}`", w.text)),
                    }
                }
                prefetch = match amount {
                    Some(0) => None,
                    Some(amount) => Some(Prefetch { amount, percentage }),
                    None => prefetch,
                };
            }
            "serve_stale" => {
                out.no_block(o, name);
                if !out.arity(o, name, 0, 2, "serve_stale [DURATION] [REFRESH_MODE]") {
                    continue;
                }
                let window = match o.args.first() {
                    Some(w) => duration(w, "serve_stale DURATION", out),
                    None => Some(DEFAULT_STALE.window),
                };
                match o.args.get(1).map(|w| w.text.as_str()) {
                    None | Some("verified") => {}
                    Some("immediate") => out.warn(
                        o.line,
                        "serve_stale immediate: nodedns always asks upstream first and serves a \
                         stale entry only when upstream fails (`verified`)"
                            .to_owned(),
                    ),
                    Some(other) => out.err(
                        o.line,
                        format!("serve_stale REFRESH_MODE must be `immediate` or `verified`, not `{other}`"),
                    ),
                }
                stale = match window {
                    Some(w) if w.is_zero() => None,
                    Some(window) => Some(Stale {
                        window,
                        ..DEFAULT_STALE
                    }),
                    None => stale,
                };
            }
            "servfail" => {
                out.no_block(o, name);
                if !out.arity(o, name, 1, 1, "servfail DURATION") {
                    continue;
                }
                if let Some(dur) = duration(&o.args[0], "servfail", out) {
                    if dur > MAX_SERVFAIL {
                        out.err(
                            o.line,
                            format!(
                                "servfail DURATION may not be longer than 5m, not `{}`",
                                o.args[0].text
                            ),
                        );
                    } else {
                        servfail = values::ceil_secs(dur);
                    }
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `cache`")),
        }
    }
    if out.problems.len() > before {
        return None;
    }
    let defaults = Policy::default();
    let mut clamps = [defaults.success, defaults.denial];
    for (i, clamp) in clamps.iter_mut().enumerate() {
        let class = ["success", "denial"][i];
        let max = max[i].unwrap_or(clamp.max);
        let mut lo = min[i].unwrap_or(clamp.min);
        // CoreDNS applies the minimum, then the maximum: when they cross, the maximum wins.
        if lo > max {
            if min[i].is_some() {
                out.warn(
                    d.line,
                    format!(
                        "cache {class}: MINTTL {lo} is above TTL {max}; TTL wins, as in CoreDNS"
                    ),
                );
            }
            lo = max;
        }
        *clamp = Clamp { min: lo, max };
    }
    let policy = Policy {
        capacity_bytes: entries(cap[0])
            .saturating_add(entries(cap[1]))
            .saturating_mul(BYTES_PER_ENTRY),
        success: clamps[0],
        denial: clamps[1],
        servfail_ttl: servfail,
        stale,
        prefetch,
    };
    if let Err(e) = policy.validate() {
        for p in e.problems {
            out.err(d.line, format!("cache: {p}"));
        }
        return None;
    }
    Some(policy)
}

fn forward_directive(d: &Directive, ctx: &Ctx<'_>, out: &mut Out<'_>) -> Option<Forward> {
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
    for w in &d.args[1..] {
        let text = match w.text.split_once("://") {
            Some(("dns", rest)) => rest,
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
        } else if Path::new(text) == ctx.resolv_conf_path {
            let file = ctx.resolv_conf_path.display().to_string();
            match template::node_resolvers(&file, ctx.resolv_conf) {
                Ok(addrs) => upstream.addrs.extend(addrs),
                Err(problems) => {
                    out.err(
                        w.line,
                        format!("forward: cannot use the nameservers of {file}, see below"),
                    );
                    out.problems.extend(problems);
                }
            }
        } else if text.contains('/') {
            out.err(
                w.line,
                format!(
                    "forward: nodedns reads nameservers only from the --resolv-conf file ({}), \
                     not from `{text}`",
                    ctx.resolv_conf_path.display()
                ),
            );
        } else {
            out.err(
                w.line,
                format!("forward: `{text}` is not an IP address with an optional port"),
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
    let mut transport: Option<(&str, usize)> = None;
    for o in &d.block {
        let name = o.name.as_str();
        out.no_block(o, &format!("forward {name}"));
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
                if out.arity(o, name, 1, 1, "max_concurrent MAX") {
                    if let Some(n) = whole::<usize>(&o.args[0], "forward max_concurrent", out) {
                        // CoreDNS: 0 means no limit.
                        upstream.max_concurrent = if n == 0 { usize::MAX } else { n };
                    }
                }
            }
            "expire" => {
                if out.arity(o, name, 1, 1, "expire DURATION") {
                    if let Some(v) = duration(&o.args[0], "forward expire", out) {
                        upstream.expire = v;
                    }
                }
            }
            "health_check" => {
                if o.args.len() > 1 {
                    out.err(o.line, "forward health_check: the `no_rec` and `domain` options are not implemented".to_owned());
                } else if out.arity(o, name, 1, 1, "health_check DURATION") {
                    if let Some(v) = duration(&o.args[0], "forward health_check", out) {
                        if v.is_zero() {
                            // CoreDNS: 0 turns health checking off; upstreams are never marked down.
                            upstream.max_fails = 0;
                        } else {
                            upstream.health_check = v;
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
            "tls" | "tls_servername" => {
                out.err(
                    o.line,
                    format!("forward {name}: TLS upstreams are not implemented"),
                );
            }
            other => out.err(o.line, format!("unknown option `{other}` of `forward`")),
        }
    }
    if ctx.kube_upstreams && ctx.upstream_lines.contains(&d.line) {
        // node-cache: custom upstream nameservers are reached over UDP, force_tcp or not.
        upstream.transport = Transport::PreferUdp;
    }
    if out.problems.len() > before {
        return None;
    }
    Some(Forward {
        from,
        except,
        upstream,
    })
}

fn log_directive(d: &Directive, block_zones: &[String], out: &mut Out<'_>) {
    if !d.args.is_empty() {
        covers_block(d, "log", &d.args, block_zones, out);
    }
    for o in &d.block {
        out.no_block(o, "log class");
        match (
            o.name.as_str(),
            o.args
                .iter()
                .map(|w| w.text.as_str())
                .collect::<Vec<_>>()
                .as_slice(),
        ) {
            ("class", ["all"]) => {}
            ("class", _) => out.err(
                o.line,
                "log class: only `class all` is implemented".to_owned(),
            ),
            (other, _) => out.err(o.line, format!("unknown option `{other}` of `log`")),
        }
    }
}

fn reload_directive(d: &Directive, parsed: &mut Parsed, ctx: &Ctx<'_>, out: &mut Out<'_>) {
    out.no_block(d, "reload");
    if !out.arity(d, "reload", 0, 2, "reload [INTERVAL] [JITTER]") {
        return;
    }
    let interval = match d.args.first() {
        Some(w) => duration(w, "reload INTERVAL", out),
        None => Some(Duration::from_secs(30)),
    };
    let jitter = match d.args.get(1) {
        Some(w) => duration(w, "reload JITTER", out),
        None => Some(Duration::from_secs(15)),
    };
    let (Some(interval), Some(jitter)) = (interval, jitter) else {
        return;
    };
    if interval < Duration::from_secs(2) {
        out.err(d.line, "reload INTERVAL must be at least 2s".to_owned());
    } else if jitter < Duration::from_secs(1) {
        out.err(d.line, "reload JITTER must be at least 1s".to_owned());
    } else {
        // A JITTER above half the INTERVAL is lowered to it (CoreDNS); nodedns polls anyway.
        parsed
            .reload
            .set(interval, d.line, "reload", ctx.file, out.problems);
    }
}
