//! `hosts`: answers A, AAAA and PTR queries from a hosts file and from entries written inline,
//! as CoreDNS 1.10's `plugin/hosts` does.
//!
//! - Configuration ([`parse`]): `hosts [FILE [ZONES...]] { INLINE...; ttl SECONDS; no_reverse;
//!   reload DURATION; fallthrough [ZONES...] }`. FILE defaults to `/etc/hosts`, ZONES to the
//!   block's. Inline lines are hosts-file lines and must come before `fallthrough`.
//! - Logic ([`Live::answer`]): a name outside ZONES goes on, except for PTR (always looked up);
//!   a known name answers its addresses (owner = the lowercased name, AA), or NOERROR with no
//!   record when it has none of the asked type; an unknown name goes on with `fallthrough` for
//!   it, and is SERVFAIL without. A PTR query whose address is unknown always goes on.
//! - Entries whose name is outside ZONES are dropped, with their PTR; `no_reverse` makes no PTR
//!   at all. Entries of the file and inline entries add up.
//! - The file is read when the block starts serving and polled every `reload` (default 5 s,
//!   `0s`: never) for a change of its modification time or size; a file that cannot be read
//!   keeps the entries last read (and is logged).
//! - Metrics ([`Metrics`]): `coredns_hosts_entries`, `coredns_hosts_reload_timestamp_seconds`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use hickory_proto::rr::rdata::{A, AAAA, PTR};
use hickory_proto::rr::{RData, Record};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Request, Step};
use crate::config::corefile::Directive;
use crate::config::directives::Out;
use crate::config::values;
use crate::metrics::Plugin;

/// CoreDNS's default hosts file.
const DEFAULT_FILE: &str = "/etc/hosts";
/// CoreDNS's default TTL of the records `hosts` makes.
const DEFAULT_TTL: u32 = 3600;
/// CoreDNS's default polling interval of the file.
const DEFAULT_RELOAD: Duration = Duration::from_secs(5);
/// RFC 1035 §3.2.1 TYPE values the plugin answers.
const TYPE_A: u16 = 1;
const TYPE_PTR: u16 = 12;
const TYPE_AAAA: u16 = 28;

/// A `hosts` directive.
#[derive(Debug, Clone, PartialEq)]
pub struct Hosts {
    /// The hosts file (FILE, default `/etc/hosts`).
    pub file: PathBuf,
    /// The zones whose names it answers (canonical form): ZONES, or the block's.
    pub zones: Vec<String>,
    /// The inline entries, as hosts-file lines.
    pub inline: Vec<String>,
    /// TTL of every record it makes (`ttl`, 1–65535, default 3600).
    pub ttl: u32,
    /// How often the file is polled for a change (`reload`); `None` for `reload 0s`.
    pub reload: Option<Duration>,
    /// Whether entries make PTR records (off with `no_reverse`).
    pub reverse: bool,
    /// `fallthrough [ZONES...]`: the zones whose unknown names go on to the next plugin
    /// (`.` when the line names none); `None` without the line.
    pub fallthrough: Option<Vec<String>>,
    /// Where it is written, for logs.
    pub at: String,
}

/// Reads a `hosts` directive of a block serving `block_zones`. Every problem is reported.
pub(crate) fn parse(d: &Directive, block_zones: &[String], out: &mut Out<'_>) -> Option<Hosts> {
    let before = out.problems.len();
    let mut hosts = Hosts {
        file: PathBuf::from(DEFAULT_FILE),
        zones: block_zones.to_vec(),
        inline: Vec::new(),
        ttl: DEFAULT_TTL,
        reload: Some(DEFAULT_RELOAD),
        reverse: true,
        fallthrough: None,
        at: format!("{}:{}", out.file, d.line),
    };
    if let Some((file, zones)) = d.args.split_first() {
        hosts.file = PathBuf::from(&file.text);
        if !zones.is_empty() {
            hosts.zones.clear();
            for w in zones {
                match values::zone(&w.text) {
                    Ok(z) if !hosts.zones.contains(&z) => hosts.zones.push(z),
                    Ok(_) => {}
                    Err(e) => out.err(w.line, format!("hosts ZONES: {e}")),
                }
            }
        }
    }
    for o in &d.block {
        let name = o.name.as_str();
        match name {
            "fallthrough" => {
                out.no_block(o, "hosts fallthrough");
                let mut zones = Vec::new();
                for w in &o.args {
                    match values::zone(&w.text) {
                        Ok(z) => zones.push(z),
                        Err(e) => out.err(w.line, format!("hosts fallthrough: {e}")),
                    }
                }
                if zones.is_empty() {
                    zones.push(".".to_owned());
                }
                hosts.fallthrough = Some(zones);
            }
            "no_reverse" => {
                out.no_block(o, "hosts no_reverse");
                out.arity(o, "hosts no_reverse", 0, 0, "no_reverse");
                hosts.reverse = false;
            }
            "ttl" => {
                out.no_block(o, "hosts ttl");
                if out.arity(o, "hosts ttl", 1, 1, "ttl SECONDS") {
                    match o.args[0].text.parse::<u32>() {
                        Ok(t) if (1..=65535).contains(&t) => hosts.ttl = t,
                        _ => out.err(
                            o.line,
                            format!(
                                "hosts ttl must be a whole number of seconds from 1 to 65535, \
                                 not `{}`",
                                o.args[0].text
                            ),
                        ),
                    }
                }
            }
            "reload" => {
                out.no_block(o, "hosts reload");
                if out.arity(o, "hosts reload", 1, 1, "reload DURATION (0s: never)") {
                    match values::go_duration(&o.args[0].text) {
                        Ok(v) => hosts.reload = (!v.is_zero()).then_some(v),
                        Err(e) => out.err(o.line, format!("hosts reload: {e}")),
                    }
                }
            }
            // CoreDNS: any other line is an entry, until `fallthrough` has been read.
            _ if hosts.fallthrough.is_some() => out.err(
                o.line,
                format!(
                    "unknown option `{name}` of `hosts` (entries must come before `fallthrough`)"
                ),
            ),
            _ => {
                out.no_block(o, "a hosts entry");
                let line: Vec<&str> = std::iter::once(name)
                    .chain(o.args.iter().map(|w| w.text.as_str()))
                    .collect();
                if line.len() < 2 || parse_ip(line[0]).is_none() {
                    // CoreDNS skips such a line silently; here it is a mistake in the Corefile.
                    out.warn(
                        o.line,
                        format!(
                            "hosts: `{}` is not `ADDRESS NAME...`; skipped, as CoreDNS skips it",
                            line.join(" ")
                        ),
                    );
                }
                hosts.inline.push(line.join(" "));
            }
        }
    }
    (out.problems.len() == before).then_some(hosts)
}

/// An address of a hosts line: an IPv6 zone (`%eth0`) is dropped, an IPv4-mapped IPv6 address
/// is the IPv4 address (Go's `net.ParseIP` and `To4`).
fn parse_ip(text: &str) -> Option<IpAddr> {
    let text = text.split_once('%').map_or(text, |(a, _)| a);
    match text.parse::<IpAddr>().ok()? {
        IpAddr::V6(v6) => Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)),
        v4 => Some(v4),
    }
}

/// Entries of one source (the file, or the inline lines).
#[derive(Debug, Default)]
struct Map {
    v4: HashMap<String, Vec<Ipv4Addr>>,
    v6: HashMap<String, Vec<Ipv6Addr>>,
    /// Names of each address, for PTR (empty with `no_reverse`).
    names: HashMap<IpAddr, Vec<String>>,
}

impl Map {
    /// Reads hosts-file text: `#` starts a comment, a line needs an address and a name, a line
    /// whose address does not parse is skipped; names are lowercased and made absolute, and a
    /// name outside `zones` is dropped (with its PTR).
    fn parse(text: &str, zones: &[String], reverse: bool) -> Map {
        let mut map = Map::default();
        for line in text.lines() {
            let line = line.split_once('#').map_or(line, |(l, _)| l);
            let mut fields = line.split_ascii_whitespace();
            let (Some(addr), Some(first)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Some(ip) = parse_ip(addr) else { continue };
            for name in std::iter::once(first).chain(fields) {
                let mut name = name.to_ascii_lowercase();
                if !name.ends_with('.') {
                    name.push('.');
                }
                if !zones.iter().any(|z| values::is_under(&name, z)) {
                    continue;
                }
                match ip {
                    IpAddr::V4(v4) => map.v4.entry(name.clone()).or_default().push(v4),
                    IpAddr::V6(v6) => map.v6.entry(name.clone()).or_default().push(v6),
                }
                if reverse {
                    map.names.entry(ip).or_default().push(name);
                }
            }
        }
        map
    }

    /// What CoreDNS counts as entries: addresses of every name, and names of every address.
    fn len(&self) -> usize {
        self.v4.values().map(Vec::len).sum::<usize>()
            + self.v6.values().map(Vec::len).sum::<usize>()
            + self.names.values().map(Vec::len).sum::<usize>()
    }
}

/// What the file held when last read, and how it was seen then (modification time, size).
#[derive(Debug, Default)]
struct Read {
    map: Map,
    seen: Option<(SystemTime, u64)>,
}

/// A `hosts` directive serving: its entries, and the poller that rereads its file.
#[derive(Debug)]
pub struct Live {
    config: Hosts,
    inline: Map,
    file: ArcSwap<Read>,
    metrics: Metrics,
    /// The entries this instance adds to `coredns_hosts_entries`.
    counted: AtomicI64,
}

impl Live {
    /// Reads the file and, with `reload`, starts polling it (inside the tokio runtime; outside
    /// one the file is read once).
    pub fn start(config: Hosts, metrics: &Metrics) -> Arc<Live> {
        let inline = Map::parse(&config.inline.join("\n"), &config.zones, config.reverse);
        let live = Arc::new(Live {
            inline,
            file: ArcSwap::from_pointee(Read::default()),
            metrics: metrics.clone(),
            counted: AtomicI64::new(0),
            config,
        });
        live.count();
        let failing = match read(&live.config, None) {
            Ok(Some(read)) => {
                live.replace(read);
                false
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(
                    at = %live.config.at,
                    file = %live.config.file.display(),
                    error = %e,
                    "hosts: cannot read the file; serving the inline entries only"
                );
                true
            }
        };
        if let (Some(every), Ok(runtime)) =
            (live.config.reload, tokio::runtime::Handle::try_current())
        {
            runtime.spawn(poll(Arc::downgrade(&live), every, failing));
        }
        live
    }

    pub fn config(&self) -> &Hosts {
        &self.config
    }

    /// Puts what the file holds now in place.
    fn replace(&self, read: Read) {
        if let Some((mtime, _)) = read.seen {
            let secs = mtime
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.reload_timestamp.set(secs);
        }
        self.file.store(Arc::new(read));
        self.count();
    }

    /// Brings this instance's share of `coredns_hosts_entries` up to date.
    fn count(&self) {
        let now = (self.inline.len() + self.file.load().map.len()) as i64;
        let before = self.counted.swap(now, Ordering::Relaxed);
        self.metrics.entries.inc_by(now - before);
    }

    /// CoreDNS's `Hosts.ServeDNS`.
    pub fn answer(&self, request: &Request<'_>) -> Step {
        let key = request.key;
        let name = crate::logging::name_text(key.qname());
        let qtype = key.qtype();
        let in_zone = self.config.zones.iter().any(|z| values::is_under(&name, z));
        if !in_zone && qtype != TYPE_PTR {
            return Step::Next;
        }
        let file = self.file.load();
        let maps = [&file.map, &self.inline];
        let owner = super::name(key.qname());
        let Some(owner) = owner else {
            return Step::Next;
        };
        let ttl = self.config.ttl;
        let record = |rdata: RData| Record::from_rdata(owner.clone(), ttl, rdata);
        let answers: Vec<Record> = match qtype {
            TYPE_PTR => {
                let names: Vec<&String> = reverse_address(&name)
                    .map(|ip| {
                        maps.iter()
                            .filter_map(|m| m.names.get(&ip))
                            .flatten()
                            .collect()
                    })
                    .unwrap_or_default();
                if names.is_empty() {
                    return Step::Next;
                }
                names
                    .into_iter()
                    .filter_map(|n| hickory_proto::rr::Name::from_ascii(n).ok())
                    .map(|n| record(RData::PTR(PTR(n))))
                    .collect()
            }
            TYPE_A => maps
                .iter()
                .filter_map(|m| m.v4.get(&name))
                .flatten()
                .map(|ip| record(RData::A(A(*ip))))
                .collect(),
            TYPE_AAAA => maps
                .iter()
                .filter_map(|m| m.v6.get(&name))
                .flatten()
                .map(|ip| record(RData::AAAA(AAAA(*ip))))
                .collect(),
            _ => Vec::new(),
        };
        let known = || {
            maps.iter()
                .any(|m| m.v4.contains_key(&name) || m.v6.contains_key(&name))
        };
        if answers.is_empty() && !known() {
            let through = self
                .config
                .fallthrough
                .as_ref()
                .is_some_and(|zones| zones.iter().any(|z| values::is_under(&name, z)));
            // CoreDNS: "we don't have a SOA, so we make it SERVFAIL".
            return if through { Step::Next } else { Step::ServFail };
        }
        match super::reply(request, true, answers, Vec::new()) {
            Some(reply) => Step::Answer {
                reply,
                by: Plugin::Hosts,
                cache: true,
            },
            None => Step::ServFail,
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.metrics
            .entries
            .dec_by(self.counted.load(Ordering::Relaxed));
    }
}

/// The address a reverse name stands for (`4.3.2.1.in-addr.arpa.` → 1.2.3.4, 32 nibbles under
/// `ip6.arpa.`), as CoreDNS's `dnsutil.ExtractAddressFromReverse`.
fn reverse_address(name: &str) -> Option<IpAddr> {
    if let Some(rest) = name.strip_suffix(".in-addr.arpa.") {
        let mut octets: Vec<&str> = rest.split('.').collect();
        octets.reverse();
        return parse_ip(&octets.join("."));
    }
    let rest = name.strip_suffix(".ip6.arpa.")?;
    let nibbles: Vec<&str> = rest.split('.').collect();
    if nibbles.len() != 32 || nibbles.iter().any(|n| n.len() != 1) {
        return None;
    }
    let hex: String = nibbles.iter().rev().copied().collect();
    let groups: Vec<&str> = (0..8).map(|i| &hex[i * 4..i * 4 + 4]).collect();
    parse_ip(&groups.join(":"))
}

/// Reads the file if it changed since `seen` (`Ok(None)`: unchanged).
fn read(config: &Hosts, seen: Option<(SystemTime, u64)>) -> std::io::Result<Option<Read>> {
    let meta = std::fs::metadata(&config.file)?;
    if meta.is_dir() {
        return Err(std::io::Error::other("it is a directory"));
    }
    let now = (meta.modified()?, meta.len());
    if seen == Some(now) {
        return Ok(None);
    }
    let bytes = std::fs::read(&config.file)?;
    let text = String::from_utf8_lossy(&bytes);
    Ok(Some(Read {
        map: Map::parse(&text, &config.zones, config.reverse),
        seen: Some(now),
    }))
}

/// Polls the file every `every` until the instance is dropped (its block no longer serves). A
/// file that cannot be read is logged once (`failing`: it was already, at start), and its
/// entries last read stay.
async fn poll(live: Weak<Live>, every: Duration, mut failing: bool) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(current) = live.upgrade() else {
            return;
        };
        let (config, seen) = (current.config.clone(), current.file.load().seen);
        drop(current);
        let Ok(result) = tokio::task::spawn_blocking(move || read(&config, seen)).await else {
            return;
        };
        let Some(current) = live.upgrade() else {
            return;
        };
        match result {
            Ok(Some(read)) => {
                failing = false;
                let entries = read.map.len();
                current.replace(read);
                tracing::info!(
                    at = %current.config.at,
                    file = %current.config.file.display(),
                    entries,
                    "hosts: file reloaded"
                );
            }
            Ok(None) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(
                    at = %current.config.at,
                    file = %current.config.file.display(),
                    error = %e,
                    "hosts: cannot read the file; keeping the entries last read"
                );
            }
            Err(_) => {}
        }
    }
}

/// `hosts`' metrics, CoreDNS's names. Process-wide as in CoreDNS; where CoreDNS shows the last
/// block that read its file, nodedns adds the entries of every block up.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// `coredns_hosts_entries`: entries of every `hosts` serving (file and inline).
    pub entries: Gauge,
    /// `coredns_hosts_reload_timestamp_seconds`: modification time of the file last read.
    pub reload_timestamp: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let metrics = Metrics::default();
        registry.register(
            "coredns_hosts_entries",
            "The combined number of entries in hosts and Corefile",
            metrics.entries.clone(),
        );
        registry.register(
            "coredns_hosts_reload_timestamp_seconds",
            "The timestamp of the last reload of hosts file",
            metrics.reload_timestamp.clone(),
        );
        metrics
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::RecordType;

    use super::*;
    use crate::plugin::testing::load;

    fn hosts(body: &str) -> Hosts {
        let config = load(body).unwrap_or_else(|e| panic!("{e:#?}"));
        config.servers[0].chain.hosts.clone().expect("a hosts")
    }

    /// What `live` answers to `name` `qtype` (a question as a client writes it).
    fn ask(live: &Live, name: &str, qtype: RecordType) -> Option<Message> {
        let mut query = Message::query();
        query.add_query(hickory_proto::op::Query::query(
            hickory_proto::rr::Name::from_ascii(name).unwrap(),
            qtype,
        ));
        query.metadata.recursion_desired = true;
        let bytes = query.to_vec().unwrap();
        let query = nodedns_wire::Query::parse(&bytes).unwrap();
        let key = query.key();
        let request = Request {
            query: &query,
            key: &key,
            client: None,
        };
        match live.answer(&request) {
            Step::Answer { reply, by, cache } => {
                assert_eq!(by, Plugin::Hosts);
                assert!(cache, "hosts answers are cached");
                Some(Message::from_vec(&reply).unwrap())
            }
            Step::ServFail => {
                let mut m = Message::query();
                m.metadata.response_code = ResponseCode::ServFail;
                Some(m)
            }
            Step::Next => None,
        }
    }

    fn rdata(m: &Message) -> Vec<String> {
        let mut v: Vec<String> = m
            .answers
            .iter()
            .map(|r| format!("{} {} {}", r.name, r.ttl, r.data))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn defaults_are_coredns_s() {
        let h = hosts("    hosts");
        assert_eq!(h.file, PathBuf::from("/etc/hosts"));
        assert_eq!(h.zones, ["."]);
        assert_eq!(
            (h.ttl, h.reload, h.reverse),
            (3600, Some(DEFAULT_RELOAD), true)
        );
        assert_eq!(h.fallthrough, None);
    }

    #[test]
    fn options_file_zones_and_inline_entries_are_read() {
        let h = hosts(
            "    hosts /etc/extra example.com example.org {\n        10.0.0.1 a.example.com\n        ttl 60\n        reload \"0s\"\n        no_reverse\n        fallthrough example.org\n    }",
        );
        assert_eq!(h.file, PathBuf::from("/etc/extra"));
        assert_eq!(h.zones, ["example.com.", "example.org."]);
        assert_eq!(h.inline, ["10.0.0.1 a.example.com"]);
        assert_eq!((h.ttl, h.reload, h.reverse), (60, None, false));
        assert_eq!(h.fallthrough, Some(vec!["example.org.".to_owned()]));
        assert_eq!(
            hosts("    hosts {\n        fallthrough\n    }").fallthrough,
            Some(vec![".".to_owned()])
        );
    }

    #[test]
    fn bad_options_are_reported_with_their_lines() {
        let errs = load(
            "    hosts {\n        ttl 0\n        ttl 65536\n        reload soon\n        no_reverse 1\n        fallthrough\n        10.0.0.1 late.example\n    }\n    hosts",
        )
        .unwrap_err();
        let expected = [
            "Corefile:3: hosts ttl must be a whole number of seconds from 1 to 65535, not `0`",
            "Corefile:4: hosts ttl must be a whole number of seconds from 1 to 65535, not `65536`",
            "Corefile:5: hosts reload:",
            "Corefile:6: hosts no_reverse: expected `no_reverse`",
            "Corefile:8: unknown option `10.0.0.1` of `hosts` (entries must come before `fallthrough`)",
            "Corefile:10: `hosts` is already given at line 2; it may appear once per block",
        ];
        assert_eq!(errs.len(), expected.len(), "{errs:#?}");
        for (e, x) in errs.iter().zip(expected) {
            assert!(e.starts_with(x), "expected {x}…, got {e}");
        }
    }

    fn live(body: &str, file: Option<&str>) -> (Arc<Live>, Option<crate::config::tests::TempDir>) {
        let mut config = hosts(body);
        let dir = file.map(|text| {
            let dir = crate::config::tests::TempDir::new("hosts");
            std::fs::write(dir.path().join("hosts"), text).unwrap();
            config.file = dir.path().join("hosts");
            dir
        });
        if dir.is_none() {
            config.file = PathBuf::from("/nonexistent/hosts");
        }
        (Live::start(config, &Metrics::default()), dir)
    }

    const FILE: &str = "# the node's\n192.168.0.100 api.example.com API2.Example.com # two names\n192.168.0.101 ingress.example.com\nfd00::1 v6.example.com\nnot-an-address x.example.com\n10.1.1.1\n::ffff:10.2.2.2 mapped.example.com\n10.3.3.3 outside.test\n";

    #[test]
    fn file_and_inline_entries_answer_a_aaaa_and_ptr_with_the_lowercased_name() {
        let (live, _dir) = live(
            "    hosts FILE example.com in-addr.arpa {\n        10.0.0.9 api.example.com\n        ttl 60\n    }",
            Some(FILE),
        );
        let m = ask(&live, "API.Example.COM.", RecordType::A).unwrap();
        assert!(m.metadata.authoritative);
        assert!(m.metadata.recursion_desired, "RD copied");
        assert_eq!(
            rdata(&m),
            [
                "api.example.com. 60 10.0.0.9",
                "api.example.com. 60 192.168.0.100"
            ]
        );
        assert!(m.authorities.is_empty() && m.additionals.is_empty());
        let m = ask(&live, "api2.example.com.", RecordType::A).unwrap();
        assert_eq!(rdata(&m), ["api2.example.com. 60 192.168.0.100"]);
        let m = ask(&live, "v6.example.com.", RecordType::AAAA).unwrap();
        assert_eq!(rdata(&m), ["v6.example.com. 60 fd00::1"]);
        let m = ask(&live, "mapped.example.com.", RecordType::A).unwrap();
        assert_eq!(rdata(&m), ["mapped.example.com. 60 10.2.2.2"]);
        let m = ask(&live, "100.0.168.192.in-addr.arpa.", RecordType::PTR).unwrap();
        assert_eq!(
            rdata(&m),
            [
                "100.0.168.192.in-addr.arpa. 60 api.example.com.",
                "100.0.168.192.in-addr.arpa. 60 api2.example.com."
            ]
        );
        let m = ask(
            &live,
            "1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.d.f.ip6.arpa.",
            RecordType::PTR,
        )
        .unwrap();
        assert_eq!(rdata(&m).len(), 1);
    }

    #[test]
    fn a_known_name_without_the_type_is_noerror_empty_even_with_fallthrough() {
        let (live, _dir) = live("    hosts FILE {\n        fallthrough\n    }", Some(FILE));
        for qtype in [RecordType::AAAA, RecordType::MX, RecordType::TXT] {
            let m = ask(&live, "ingress.example.com.", qtype).unwrap();
            assert_eq!(m.metadata.response_code, ResponseCode::NoError);
            assert!(m.metadata.authoritative);
            assert!(m.answers.is_empty() && m.authorities.is_empty(), "no SOA");
        }
    }

    #[test]
    fn an_unknown_name_falls_through_only_where_fallthrough_says() {
        let (plain, _a) = live("    hosts FILE", Some(FILE));
        let m = ask(&plain, "nothing.example.com.", RecordType::A).unwrap();
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        let (through, _b) = live(
            "    hosts FILE {\n        fallthrough example.org\n    }",
            Some(FILE),
        );
        assert!(ask(&through, "www.example.org.", RecordType::A).is_none());
        let m = ask(&through, "www.example.com.", RecordType::A).unwrap();
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        // An unknown address's PTR always goes on.
        assert!(ask(&plain, "9.9.9.9.in-addr.arpa.", RecordType::PTR).is_none());
    }

    #[test]
    fn names_outside_the_zones_are_dropped_with_their_ptr_and_pass_on() {
        let (live, _dir) = live("    hosts FILE example.com", Some(FILE));
        assert!(ask(&live, "outside.test.", RecordType::A).is_none());
        assert!(ask(&live, "3.3.3.10.in-addr.arpa.", RecordType::PTR).is_none());
        // A PTR is looked up whatever the zones.
        assert!(ask(&live, "101.0.168.192.in-addr.arpa.", RecordType::PTR).is_some());
    }

    #[test]
    fn no_reverse_makes_no_ptr() {
        let (live, _dir) = live("    hosts FILE {\n        no_reverse\n    }", Some(FILE));
        assert!(ask(&live, "100.0.168.192.in-addr.arpa.", RecordType::PTR).is_none());
        assert!(ask(&live, "api.example.com.", RecordType::A).is_some());
    }

    #[test]
    fn a_missing_file_leaves_the_inline_entries() {
        let (live, _) = live("    hosts {\n        10.0.0.1 a.example\n    }", None);
        assert_eq!(
            rdata(&ask(&live, "a.example.", RecordType::A).unwrap()),
            ["a.example. 3600 10.0.0.1"]
        );
    }

    #[test]
    fn entries_count_file_and_inline_entries_and_leave_with_the_instance() {
        let metrics = Metrics::default();
        let dir = crate::config::tests::TempDir::new("hosts");
        std::fs::write(dir.path().join("hosts"), "10.0.0.1 a.example b.example\n").unwrap();
        let mut config = hosts("    hosts {\n        10.0.0.2 c.example\n    }");
        config.file = dir.path().join("hosts");
        let live = Live::start(config, &metrics);
        // Two names and their two PTR names, one inline name and its PTR.
        assert_eq!(metrics.entries.get(), 6);
        assert!(metrics.reload_timestamp.get() > 0.0);
        drop(live);
        assert_eq!(metrics.entries.get(), 0);
    }

    /// The poller rereads a changed file, and keeps the entries last read while the file is gone.
    #[tokio::test(start_paused = true)]
    async fn a_changed_file_is_reread_and_a_vanished_one_keeps_its_entries() {
        let dir = crate::config::tests::TempDir::new("hosts");
        let path = dir.path().join("hosts");
        std::fs::write(&path, "10.0.0.1 a.example\n").unwrap();
        let mut config = hosts("    hosts {\n        reload 1s\n    }");
        config.file = path.clone();
        let live = Live::start(config, &Metrics::default());
        // A different size: seen as a change whatever the clock's granularity.
        std::fs::write(&path, "10.0.0.22 a.example\n").unwrap();
        let answer = |live: &Live| rdata(&ask(live, "a.example.", RecordType::A).unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while answer(&live) != ["a.example. 3600 10.0.0.22"] {
            assert!(std::time::Instant::now() < deadline, "{:?}", answer(&live));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        std::fs::remove_file(&path).unwrap();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(answer(&live), ["a.example. 3600 10.0.0.22"]);
    }

    #[test]
    fn reverse_names_give_their_address() {
        assert_eq!(
            reverse_address("4.3.2.1.in-addr.arpa."),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(reverse_address("3.2.1.in-addr.arpa."), None);
        assert_eq!(reverse_address("www.example."), None);
    }
}
