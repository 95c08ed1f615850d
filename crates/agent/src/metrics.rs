//! The agent's metrics: what the request path counts, and the one exposition of every metric.
//!
//! Names, label names and values, HELP texts and histogram buckets are CoreDNS 1.11's (the
//! version node-cache 1.2x embeds: `plugin/metrics/vars`, `plugin/cache/metrics.go`,
//! `plugin/reload`), so node-local-dns dashboards and alerts read nodedns unchanged; what CoreDNS
//! has no name for is `nodedns_*`. `docs/metrics.md` lists every series.
//!
//! Counting must not slow the hit path:
//! - each UDP worker thread owns a [`Counters`] block that only it writes, so a count is a relaxed
//!   load and store: no locked instruction, no lock, no allocation;
//! - the TCP listeners and the async (miss) path share one block per listen address and count
//!   with atomic adds;
//! - every label is an array index known before the query arrives: the block belongs to one
//!   listen address (`server`, `family`); a server block's zones own contiguous slots starting at
//!   `Zone::label`, so the matched zone is `label + Route::zone` (`zone`); type, RCODE, protocol,
//!   `plugin` and histogram bucket come from small fixed sets.
//!
//! A scrape sums the blocks and turns indices into label values. As with CoreDNS's vectors, only
//! series that counted something are written. [`Exposition`] adds what is read at scrape time
//! (cache entries and bytes, single-flight waiters) and is registered as a collector in the same
//! registry as the `upstream` and `hostnet` crates' metrics: one registry, one exposition, in the
//! Prometheus text format 0.0.4.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use nodedns_cache::{Cache, Class};
use nodedns_wire::Query;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::exemplar::Exemplar;

use crate::logging::RateLimit;
use crate::serve::{Shared, Snapshot};

/// Zone label slots. Slot 0 is CoreDNS's `dropped` zone (queries no server block serves). Each
/// distinct list of server-block zones gets contiguous slots for the life of the process, so a
/// reload never moves counts from one zone name to another; the last slot takes the zones of
/// blocks that found no room (`other`).
pub const ZONE_SLOTS: usize = 32;
const DROPPED: usize = 0;
const OVERFLOW: usize = ZONE_SLOTS - 1;

/// Transport of a client query (`proto` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Udp = 0,
    Tcp = 1,
}
const PROTOS: usize = 2;

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Udp => "udp",
            Proto::Tcp => "tcp",
        }
    }
}

/// Who asked a query: the transport it came over and the client's address (for the query log;
/// the counters need only the transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client {
    pub proto: Proto,
    pub addr: SocketAddr,
}

/// What answered a query, and how it went through its block's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A fresh cache entry, without going upstream (a hit).
    Hit(Class),
    /// An expired entry, at once, because the upstream is known to be down (RFC 8767 §5): a hit,
    /// served stale.
    StaleHit(Class),
    /// The upstream's reply, after a cache miss (or in a block without cache).
    Upstream,
    /// An expired entry after the upstream failed (RFC 8767 §4): a miss, served stale.
    StaleAfterMiss,
    /// SERVFAIL made by nodedns: the upstream failed and nothing stale was left.
    ServFail,
    /// REFUSED made by nodedns: no block serves the name, or its `forward` does not take it.
    Refused,
}

impl Source {
    /// Index into [`PLUGINS`]: the `plugin` label CoreDNS 1.11 puts on the response. Its
    /// recorder names the plugin whose response writer wrote last before it; in a block with
    /// `cache` that is the cache's writer for hits and for forwarded answers alike, `forward`
    /// only in a block without cache, and empty for errors the server itself writes.
    fn plugin(self, cache: bool) -> usize {
        match self {
            Source::Hit(_) | Source::StaleHit(_) | Source::StaleAfterMiss => 1,
            Source::Upstream if cache => 1,
            Source::Upstream => 2,
            Source::ServFail | Source::Refused => 0,
        }
    }

    /// For the query log.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Hit(_) => "cache",
            Source::StaleHit(_) => "cache-stale",
            Source::Upstream => "upstream",
            Source::StaleAfterMiss => "upstream-failed-stale",
            Source::ServFail => "servfail",
            Source::Refused => "refused",
        }
    }
}

/// `plugin` label values of `coredns_dns_responses_total`.
const PLUGINS: [&str; 3] = ["", "cache", "forward"];

/// Query types with their own `type` label: CoreDNS 1.11's `monitorType`; others are `other`.
pub const QTYPES: [(u16, &str); 18] = [
    (1, "A"),
    (28, "AAAA"),
    (5, "CNAME"),
    (48, "DNSKEY"),
    (43, "DS"),
    (15, "MX"),
    (50, "NSEC3"),
    (47, "NSEC"),
    (2, "NS"),
    (12, "PTR"),
    (46, "RRSIG"),
    (6, "SOA"),
    (33, "SRV"),
    (16, "TXT"),
    (65, "HTTPS"),
    (251, "IXFR"),
    (252, "AXFR"),
    (255, "ANY"),
];
const TYPES: usize = QTYPES.len() + 1;
const OTHER_TYPE: usize = QTYPES.len();

/// Index of `qtype` in [`QTYPES`] (a jump table, not a search: it runs for every query).
#[inline]
fn qtype_index(qtype: u16) -> usize {
    match qtype {
        1 => 0,
        28 => 1,
        5 => 2,
        48 => 3,
        43 => 4,
        15 => 5,
        50 => 6,
        47 => 7,
        2 => 8,
        12 => 9,
        46 => 10,
        6 => 11,
        33 => 12,
        16 => 13,
        65 => 14,
        251 => 15,
        252 => 16,
        255 => 17,
        _ => OTHER_TYPE,
    }
}

/// A query type's mnemonic, or `TYPEn` (RFC 3597 §5) for the ones without a label of their own.
pub fn qtype_name(qtype: u16) -> String {
    QTYPES
        .iter()
        .find(|&&(t, _)| t == qtype)
        .map_or_else(|| format!("TYPE{qtype}"), |&(_, name)| name.to_owned())
}

/// `rcode` label values for the header's 4-bit RCODE, as CoreDNS writes them (miekg/dns's
/// names; unnamed codes as `RCODEn`).
pub const RCODE_NAMES: [&str; 16] = [
    "NOERROR",
    "FORMERR",
    "SERVFAIL",
    "NXDOMAIN",
    "NOTIMP",
    "REFUSED",
    "YXDOMAIN",
    "YXRRSET",
    "NXRRSET",
    "NOTAUTH",
    "NOTZONE",
    "DSOTYPENI",
    "RCODE12",
    "RCODE13",
    "RCODE14",
    "RCODE15",
];
const RCODES: usize = RCODE_NAMES.len();

/// CoreDNS's `plugin.TimeBuckets`: 0.25 ms doubling to 8.192 s, in nanoseconds.
const TIME_BOUNDS_NS: [u64; 16] = {
    let mut b = [0u64; 16];
    let mut i = 0;
    while i < 16 {
        b[i] = 250_000 << i;
        i += 1;
    }
    b
};
const TIME_SLOTS: usize = TIME_BOUNDS_NS.len() + 1;

/// CoreDNS's buckets for request and response sizes, in bytes.
const SIZE_BOUNDS: [usize; 14] = [
    0, 100, 200, 300, 400, 511, 1023, 2047, 4095, 8291, 16000, 32000, 48000, 64000,
];
const SIZE_SLOTS: usize = SIZE_BOUNDS.len() + 1;

#[inline]
fn time_bucket(ns: u64) -> usize {
    TIME_BOUNDS_NS
        .iter()
        .position(|&b| ns <= b)
        .unwrap_or(TIME_SLOTS - 1)
}

#[inline]
fn size_bucket(len: usize) -> usize {
    // DNS messages are mostly under 400 bytes, where the bounds step by 100.
    if len <= 400 {
        return len.div_ceil(100);
    }
    SIZE_BOUNDS
        .iter()
        .position(|&b| len <= b)
        .unwrap_or(SIZE_SLOTS - 1)
}

/// Layout of one zone slot's counters in a block.
mod at {
    use super::{PROTOS, RCODES, SIZE_SLOTS, TIME_SLOTS, TYPES};
    /// `coredns_dns_requests_total`: [proto][type].
    pub const REQUESTS: usize = 0;
    /// `coredns_dns_do_requests_total`.
    pub const DO: usize = REQUESTS + PROTOS * TYPES;
    /// `coredns_dns_responses_total`: [rcode][plugin].
    pub const RESPONSES: usize = DO + 1;
    /// `coredns_dns_request_duration_seconds`: [bucket], not cumulative.
    pub const DURATION: usize = RESPONSES + RCODES * super::PLUGINS.len();
    /// Its sum, in nanoseconds.
    pub const DURATION_SUM: usize = DURATION + TIME_SLOTS;
    /// `coredns_dns_request_size_bytes`: [proto][bucket].
    pub const REQUEST_SIZE: usize = DURATION_SUM + 1;
    /// [proto]
    pub const REQUEST_SIZE_SUM: usize = REQUEST_SIZE + PROTOS * SIZE_SLOTS;
    /// `coredns_dns_response_size_bytes`: [proto][bucket].
    pub const RESPONSE_SIZE: usize = REQUEST_SIZE_SUM + PROTOS;
    /// [proto]
    pub const RESPONSE_SIZE_SUM: usize = RESPONSE_SIZE + PROTOS * SIZE_SLOTS;
    /// `coredns_cache_hits_total`: [success, denial].
    pub const HITS: usize = RESPONSE_SIZE_SUM + PROTOS;
    pub const MISSES: usize = HITS + 2;
    pub const STALE: usize = MISSES + 1;
    pub const PREFETCH: usize = STALE + 1;
    pub const PER_ZONE: usize = PREFETCH + 1;
}

/// Counts without labels, after the zone slots.
mod event {
    use super::{ZONE_SLOTS, at::PER_ZONE};
    pub const MALFORMED: usize = ZONE_SLOTS * PER_ZONE;
    pub const FLIGHT_FULL: usize = MALFORMED + 1;
    pub const SEND_FAILED: usize = FLIGHT_FULL + 1;
    pub const RECV_FAILED: usize = SEND_FAILED + 1;
    pub const TCP_REFUSED: usize = RECV_FAILED + 1;
    pub const CELLS: usize = TCP_REFUSED + 1;
}

/// CoreDNS's `type` label of cache hits: it keeps SERVFAIL in its denial cache.
fn class_index(class: Class) -> usize {
    match class {
        Class::Success => 0,
        Class::Denial | Class::ServFail => 1,
    }
}

/// The label indices of one query, resolved before it is counted. `Copy`, so a query that goes
/// upstream carries them to the task that answers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Labels {
    /// Index of the listen address (`server`, `family`).
    server: u16,
    /// Zone slot (`zone`).
    zone: u16,
    /// The block has a cache: hits and misses count, answers are the cache plugin's.
    cache: bool,
    /// The block logs its queries (`log`, or `--query-log`).
    log: bool,
}

/// One block of counters: one UDP worker's, or the block one listen address's TCP connections
/// and async answers share.
#[derive(Debug)]
pub struct Counters {
    cells: Box<[AtomicU64]>,
    server: u16,
    /// Only one thread writes: counts are a load and a store instead of a locked add.
    single_writer: bool,
    /// `--no-metrics` turns counting off (the query log still works).
    counting: bool,
    log_all: bool,
    /// Log one query in this many.
    log_every: u64,
    log_seq: AtomicU64,
    server_name: Arc<str>,
}

/// Adds `n` to a counter. A block with a single writer needs no locked instruction: its thread
/// is the only one that stores, scrapes only load.
#[inline(always)]
fn bump<const SINGLE_WRITER: bool>(cell: &AtomicU64, n: u64) {
    if SINGLE_WRITER {
        cell.store(
            cell.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    } else {
        cell.fetch_add(n, Ordering::Relaxed);
    }
}

impl Counters {
    fn new(server: usize, name: Arc<str>, single_writer: bool, options: &Options) -> Self {
        Counters {
            cells: (0..event::CELLS).map(|_| AtomicU64::new(0)).collect(),
            server: u16::try_from(server).unwrap_or(u16::MAX),
            single_writer,
            counting: options.counting,
            log_all: options.log_queries,
            log_every: options.log_every(),
            log_seq: AtomicU64::new(0),
            server_name: name,
        }
    }

    #[inline]
    fn add(&self, i: usize, n: u64) {
        if let Some(cell) = self.cells.get(i) {
            if self.single_writer {
                bump::<true>(cell, n);
            } else {
                bump::<false>(cell, n);
            }
        }
    }

    fn get(&self, i: usize) -> u64 {
        self.cells.get(i).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The labels of a query a server block serves: `zone_slot` is `Zone::label` plus the
    /// matched zone's index in the block.
    #[inline]
    pub fn labels(&self, zone_slot: usize, cache: bool, log: bool) -> Labels {
        Labels {
            server: self.server,
            zone: u16::try_from(zone_slot.min(OVERFLOW)).unwrap_or(OVERFLOW as u16),
            cache,
            log: log || self.log_all,
        }
    }

    /// The labels of a query no server block serves (CoreDNS's `dropped` zone).
    #[inline]
    pub fn dropped(&self) -> Labels {
        Labels {
            server: self.server,
            zone: DROPPED as u16,
            cache: false,
            log: self.log_all,
        }
    }

    /// Counts one answered query: request, response, duration, sizes, and how the cache took
    /// part. Called exactly once per answer sent (or handed to the socket). Inlined: a call
    /// with this many arguments costs a fifth of the counting itself.
    #[inline(always)]
    pub fn answered(
        &self,
        labels: Labels,
        client: &Client,
        query: &Query<'_>,
        source: Source,
        response: &[u8],
        elapsed: Duration,
    ) {
        if labels.log && self.sample() {
            crate::logging::query(&self.server_name, query, client, source, response, elapsed);
        }
        if !self.counting {
            return;
        }
        let proto = client.proto;
        // One branch on the kind of block, not one per count.
        if self.single_writer {
            self.count::<true>(labels, proto, query, source, response, elapsed);
        } else {
            self.count::<false>(labels, proto, query, source, response, elapsed);
        }
    }

    #[inline(always)]
    fn count<const SINGLE_WRITER: bool>(
        &self,
        labels: Labels,
        proto: Proto,
        query: &Query<'_>,
        source: Source,
        response: &[u8],
        elapsed: Duration,
    ) {
        let z = usize::from(labels.zone).min(OVERFLOW) * at::PER_ZONE;
        // The zone's cells as a fixed-size array: one bounds check here, none for the fixed
        // offsets below.
        let Some(Ok(cells)) = self
            .cells
            .get(z..z + at::PER_ZONE)
            .map(<&[AtomicU64; at::PER_ZONE]>::try_from)
        else {
            return;
        };
        let add = |i: usize, n: u64| {
            if let Some(cell) = cells.get(i) {
                bump::<SINGLE_WRITER>(cell, n);
            }
        };
        let p = proto as usize;
        add(at::REQUESTS + p * TYPES + qtype_index(query.qtype()), 1);
        if query.dnssec_ok() {
            add(at::DO, 1);
        }
        let rcode = response.get(3).map_or(0, |b| usize::from(b & 0x0f));
        add(
            at::RESPONSES + rcode * PLUGINS.len() + source.plugin(labels.cache),
            1,
        );
        // Cache answers pass 0: reading the clock per query would cost more than the answer
        // (they land in the first bucket, 0.25 ms, either way).
        if elapsed.is_zero() {
            add(at::DURATION, 1);
        } else {
            let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
            add(at::DURATION + time_bucket(ns), 1);
            add(at::DURATION_SUM, ns);
        }
        let size = query.bytes().len();
        add(at::REQUEST_SIZE + p * SIZE_SLOTS + size_bucket(size), 1);
        add(at::REQUEST_SIZE_SUM + p, size as u64);
        let size = response.len();
        add(at::RESPONSE_SIZE + p * SIZE_SLOTS + size_bucket(size), 1);
        add(at::RESPONSE_SIZE_SUM + p, size as u64);
        if !labels.cache {
            return;
        }
        match source {
            Source::Hit(class) => add(at::HITS + class_index(class), 1),
            Source::StaleHit(class) => {
                add(at::HITS + class_index(class), 1);
                add(at::STALE, 1);
            }
            Source::Upstream | Source::ServFail => add(at::MISSES, 1),
            Source::StaleAfterMiss => {
                add(at::MISSES, 1);
                add(at::STALE, 1);
            }
            Source::Refused => {}
        }
    }

    /// Whether this query is one the query log samples.
    fn sample(&self) -> bool {
        let seq = if self.single_writer {
            let seq = self.log_seq.load(Ordering::Relaxed);
            self.log_seq.store(seq.wrapping_add(1), Ordering::Relaxed);
            seq
        } else {
            self.log_seq.fetch_add(1, Ordering::Relaxed)
        };
        seq % self.log_every == 0
    }

    /// A cache hit started a prefetch of its entry.
    pub fn prefetch(&self, labels: Labels) {
        if self.counting {
            self.add(
                usize::from(labels.zone).min(OVERFLOW) * at::PER_ZONE + at::PREFETCH,
                1,
            );
        }
    }
    pub fn malformed(&self) {
        self.add(event::MALFORMED, 1);
    }
    pub fn flight_full(&self) {
        self.add(event::FLIGHT_FULL, 1);
    }
    pub fn send_failed(&self) {
        self.add(event::SEND_FAILED, 1);
    }
    pub fn recv_failed(&self) {
        self.add(event::RECV_FAILED, 1);
    }
    pub fn tcp_refused(&self) {
        self.add(event::TCP_REFUSED, 1);
    }
}

/// What the command line decides about counting and the query log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Count on the request path (`--no-metrics` turns it off, for benchmarks).
    pub counting: bool,
    /// Log the queries of every block, not only those with `log` (`--query-log`).
    pub log_queries: bool,
    /// Share of the logged blocks' queries written, in (0, 1] (`--query-log-sample`).
    pub log_sample: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            counting: true,
            log_queries: false,
            log_sample: 1.0,
        }
    }
}

impl Options {
    fn log_every(&self) -> u64 {
        if self.log_sample >= 1.0 || !self.log_sample.is_finite() || self.log_sample <= 0.0 {
            1
        } else {
            (1.0 / self.log_sample).round().max(1.0) as u64
        }
    }
}

/// A listen address and its label values.
#[derive(Debug)]
struct Server {
    addr: SocketAddr,
    /// `server`: as CoreDNS writes it, `dns://169.254.20.10:53`, or `dns://:53` for a wildcard.
    name: Arc<str>,
}

/// The `server` label CoreDNS gives a listen address.
pub fn server_label(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        format!("dns://:{}", addr.port())
    } else {
        format!("dns://{addr}")
    }
}

/// Names of the zone slots.
#[derive(Debug)]
struct Names {
    /// Per slot: the zone (`zone` label) and its block's zones joined by commas (`zones`).
    slots: Vec<Option<(String, String)>>,
    /// Zone lists given slots, with their first slot.
    blocks: Vec<(Vec<String>, usize)>,
    next: usize,
}

impl Default for Names {
    fn default() -> Self {
        let mut slots = vec![None; ZONE_SLOTS];
        slots[DROPPED] = Some(("dropped".to_owned(), String::new()));
        Names {
            slots,
            blocks: Vec::new(),
            next: DROPPED + 1,
        }
    }
}

/// Upstream failures of one block, by [`nodedns_upstream::Error`] kind.
const UPSTREAM_ERRORS: [&str; 5] = [
    "overloaded",
    "timeout",
    "unreachable",
    "bad_reply",
    "bad_query",
];

fn upstream_error_index(err: &nodedns_upstream::Error) -> usize {
    match err {
        nodedns_upstream::Error::Overloaded => 0,
        nodedns_upstream::Error::Timeout => 1,
        nodedns_upstream::Error::Unreachable => 2,
        nodedns_upstream::Error::BadReply => 3,
        nodedns_upstream::Error::BadQuery => 4,
    }
}

/// How often a repeated upstream error of one kind in one block is logged.
const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Every counter block, the label tables, and the counts of the control paths.
#[derive(Debug)]
pub struct Metrics {
    options: Options,
    servers: Vec<Server>,
    /// One per listen address: its TCP connections and async answers.
    shared: Vec<Counters>,
    /// The UDP workers' blocks (registered once per worker; the lock is never taken per query).
    workers: Mutex<Vec<Arc<Counters>>>,
    names: Mutex<Names>,
    reload_failed: AtomicU64,
    /// [first zone slot of the block][error kind]
    upstream_failures: Box<[AtomicU64]>,
    upstream_logs: Box<[RateLimit]>,
    /// Cache evictions, kept across reloads (see [`Exposition`]).
    evictions: Mutex<Evictions>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(&[], Options::default())
    }
}

impl Metrics {
    /// Counter blocks for the listen addresses `servers` (fixed for the life of the process:
    /// changing them needs a restart).
    pub fn new(servers: &[SocketAddr], options: Options) -> Self {
        let mut servers: Vec<Server> = servers
            .iter()
            .map(|&addr| Server {
                addr,
                name: server_label(addr).into(),
            })
            .collect();
        if servers.is_empty() {
            // Never indexed out of range, even with nothing to serve.
            let addr = SocketAddr::from(([0, 0, 0, 0], 0));
            servers.push(Server {
                addr,
                name: server_label(addr).into(),
            });
        }
        let shared = servers
            .iter()
            .enumerate()
            .map(|(i, s)| Counters::new(i, s.name.clone(), false, &options))
            .collect();
        let base = Instant::now();
        Metrics {
            options,
            servers,
            shared,
            workers: Mutex::new(Vec::new()),
            names: Mutex::new(Names::default()),
            reload_failed: AtomicU64::new(0),
            upstream_failures: (0..ZONE_SLOTS * UPSTREAM_ERRORS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
            upstream_logs: (0..ZONE_SLOTS * UPSTREAM_ERRORS.len())
                .map(|_| RateLimit::new(ERROR_LOG_INTERVAL, base))
                .collect(),
            evictions: Mutex::new(Evictions::default()),
        }
    }

    fn server_index(&self, local: SocketAddr) -> usize {
        self.servers
            .iter()
            .position(|s| s.addr == local)
            .unwrap_or(0)
    }

    /// The block shared by the async paths: counts without labels (malformed, send failures)
    /// from anywhere.
    pub fn counters(&self) -> &Counters {
        &self.shared[0]
    }

    /// The block the TCP connections of `local` and async answers to its clients share.
    pub fn listener(&self, local: SocketAddr) -> &Counters {
        &self.shared[self.server_index(local)]
    }

    /// The block for the async answer of a query that arrived with `labels`.
    pub fn shared(&self, labels: Labels) -> &Counters {
        self.shared
            .get(usize::from(labels.server))
            .unwrap_or(&self.shared[0])
    }

    /// A new block for one UDP worker thread of `local`, which only that thread may count into.
    pub fn worker(&self, local: SocketAddr) -> Arc<Counters> {
        let server = self.server_index(local);
        let counters = Arc::new(Counters::new(
            server,
            self.servers[server].name.clone(),
            true,
            &self.options,
        ));
        self.workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(counters.clone());
        counters
    }

    /// The first zone slot of a server block serving `zones` (its `Zone::label`): the same list
    /// always gets the same slots, so counts stay with their names across reloads.
    pub fn zone_slots(&self, zones: &[String]) -> usize {
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, first)) = names.blocks.iter().find(|(z, _)| z == zones) {
            return *first;
        }
        let first = if names.next + zones.len() <= OVERFLOW {
            names.next
        } else {
            OVERFLOW
        };
        if first == OVERFLOW {
            names.slots[OVERFLOW] = Some(("other".to_owned(), "other".to_owned()));
        } else {
            let joined = zones.join(",");
            for (i, zone) in zones.iter().enumerate() {
                names.slots[first + i] = Some((zone.clone(), joined.clone()));
            }
            names.next = first + zones.len();
        }
        names.blocks.push((zones.to_vec(), first));
        first
    }

    /// An upstream exchange of the block whose first zone slot is `slot` failed: counted, and
    /// logged at most once per interval per kind when the block has `errors`.
    pub fn upstream_failed(
        &self,
        slot: usize,
        errors: bool,
        qname: &[u8],
        qtype: u16,
        err: &nodedns_upstream::Error,
    ) {
        let i = slot.min(OVERFLOW) * UPSTREAM_ERRORS.len() + upstream_error_index(err);
        if let Some(count) = self.upstream_failures.get(i) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        if !errors {
            tracing::debug!(%err, "upstream query failed");
            return;
        }
        let Some(held_back) = self
            .upstream_logs
            .get(i)
            .and_then(|l| l.admit(Instant::now()))
        else {
            return;
        };
        let zones = self.zones_label(slot);
        tracing::error!(
            zones,
            qname = %crate::logging::name_text(qname),
            qtype = %qtype_name(qtype),
            %err,
            similar_errors_not_logged = held_back,
            "upstream query failed (the same error is logged at most every {}s)",
            ERROR_LOG_INTERVAL.as_secs()
        );
    }

    fn zones_label(&self, slot: usize) -> String {
        let names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        names
            .slots
            .get(slot)
            .and_then(|s| s.as_ref())
            .map_or_else(String::new, |(_, block)| block.clone())
    }

    /// A reload found a bad configuration and kept the running one.
    pub fn reload_failed(&self) {
        self.reload_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Every block of `server` summed, cell by cell.
    fn sum(&self, server: usize) -> Vec<u64> {
        let mut total = vec![0u64; event::CELLS];
        let mut add = |c: &Counters| {
            for (t, cell) in total.iter_mut().zip(c.cells.iter()) {
                *t = t.wrapping_add(cell.load(Ordering::Relaxed));
            }
        };
        if let Some(shared) = self.shared.get(server) {
            add(shared);
        }
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        for worker in workers.iter().filter(|w| usize::from(w.server) == server) {
            add(worker);
        }
        total
    }

    /// One count without labels, over every block.
    fn event(&self, i: usize) -> u64 {
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        self.shared
            .iter()
            .map(|c| c.get(i))
            .chain(workers.iter().map(|c| c.get(i)))
            .fold(0u64, u64::wrapping_add)
    }

    /// Writes the request-path families, the reload counter and the build info.
    pub fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        // (server, zone name) → summed cells of the slots with that name (a zone can hold slots
        // from before and after a reload).
        let names = {
            let names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
            names.slots.clone()
        };
        let mut zones: BTreeMap<(usize, &str), Vec<u64>> = BTreeMap::new();
        let mut caches: BTreeMap<(usize, &str), Vec<u64>> = BTreeMap::new();
        for server in 0..self.servers.len() {
            let cells = self.sum(server);
            for (slot, name) in names.iter().enumerate() {
                let Some((zone, block)) = name else { continue };
                let cells = &cells[slot * at::PER_ZONE..(slot + 1) * at::PER_ZONE];
                for (map, key) in [(&mut zones, zone.as_str()), (&mut caches, block.as_str())] {
                    let sum = map
                        .entry((server, key))
                        .or_insert_with(|| vec![0; at::PER_ZONE]);
                    for (s, c) in sum.iter_mut().zip(cells) {
                        *s = s.wrapping_add(*c);
                    }
                }
            }
        }
        let server = |i: usize| self.servers[i].name.as_ref();
        let family = |i: usize| {
            if self.servers[i].addr.is_ipv4() {
                "1"
            } else {
                "2"
            }
        };

        {
            let mut m = encoder.encode_descriptor(
                "coredns_build_info",
                "A metric with a constant '1' value labeled by version, revision, and goversion from which CoreDNS was built.",
                None,
                MetricType::Gauge,
            )?;
            let labels = [
                ("version", env!("CARGO_PKG_VERSION")),
                (
                    "revision",
                    option_env!("NODEDNS_REVISION").unwrap_or("unknown"),
                ),
                ("goversion", "none"),
            ];
            m.encode_family(&labels)?.encode_gauge(&1u64)?;
        }

        let mut m = encoder.encode_descriptor(
            "coredns_dns_requests",
            "Counter of DNS requests made per zone, protocol and family.",
            None,
            MetricType::Counter,
        )?;
        for (&(s, zone), cells) in &zones {
            for proto in [Proto::Udp, Proto::Tcp] {
                for t in 0..TYPES {
                    let v = cells[at::REQUESTS + proto as usize * TYPES + t];
                    if v == 0 {
                        continue;
                    }
                    let qtype = QTYPES.get(t).map_or("other", |&(_, name)| name);
                    let labels = [
                        ("server", server(s)),
                        ("zone", zone),
                        ("view", ""),
                        ("proto", proto.as_str()),
                        ("family", family(s)),
                        ("type", qtype),
                    ];
                    counter(&mut m, &labels, v)?;
                }
            }
        }

        let mut m = encoder.encode_descriptor(
            "coredns_dns_do_requests",
            "Counter of DNS requests with DO bit set per zone.",
            None,
            MetricType::Counter,
        )?;
        for (&(s, zone), cells) in &zones {
            if cells[at::DO] != 0 {
                let labels = [("server", server(s)), ("zone", zone), ("view", "")];
                counter(&mut m, &labels, cells[at::DO])?;
            }
        }

        let mut m = encoder.encode_descriptor(
            "coredns_dns_responses",
            "Counter of response status codes.",
            None,
            MetricType::Counter,
        )?;
        for (&(s, zone), cells) in &zones {
            for (rcode, rcode_name) in RCODE_NAMES.iter().enumerate() {
                for (plugin, plugin_name) in PLUGINS.iter().enumerate() {
                    let v = cells[at::RESPONSES + rcode * PLUGINS.len() + plugin];
                    if v == 0 {
                        continue;
                    }
                    let labels = [
                        ("server", server(s)),
                        ("zone", zone),
                        ("view", ""),
                        ("rcode", *rcode_name),
                        ("plugin", *plugin_name),
                    ];
                    counter(&mut m, &labels, v)?;
                }
            }
        }

        let mut m = encoder.encode_descriptor(
            "coredns_dns_request_duration_seconds",
            "Histogram of the time (in seconds) each request took per zone.",
            None,
            MetricType::Histogram,
        )?;
        for (&(s, zone), cells) in &zones {
            let counts = &cells[at::DURATION..at::DURATION + TIME_SLOTS];
            let bounds = TIME_BOUNDS_NS.iter().map(|&ns| ns as f64 / 1e9);
            let sum = cells[at::DURATION_SUM] as f64 / 1e9;
            let labels = [("server", server(s)), ("zone", zone), ("view", "")];
            histogram(&mut m, &labels, bounds, counts, sum)?;
        }

        for (name, help, buckets, sums) in [
            (
                "coredns_dns_request_size_bytes",
                "Size of the EDNS0 UDP buffer in bytes (64K for TCP) per zone and protocol.",
                at::REQUEST_SIZE,
                at::REQUEST_SIZE_SUM,
            ),
            (
                "coredns_dns_response_size_bytes",
                "Size of the returned response in bytes.",
                at::RESPONSE_SIZE,
                at::RESPONSE_SIZE_SUM,
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (&(s, zone), cells) in &zones {
                for proto in [Proto::Udp, Proto::Tcp] {
                    let p = proto as usize;
                    let counts = &cells[buckets + p * SIZE_SLOTS..buckets + (p + 1) * SIZE_SLOTS];
                    let bounds = SIZE_BOUNDS.iter().map(|&b| b as f64);
                    let labels = [
                        ("server", server(s)),
                        ("zone", zone),
                        ("view", ""),
                        ("proto", proto.as_str()),
                    ];
                    histogram(&mut m, &labels, bounds, counts, cells[sums + p] as f64)?;
                }
            }
        }

        // The cache families, by the block's zones (`zones`); a block without cache counts none.
        let cache_series = |name: &'static str| {
            move |cells: &Vec<u64>| -> u64 {
                match name {
                    "requests" => cells[at::HITS] + cells[at::HITS + 1] + cells[at::MISSES],
                    "misses" => cells[at::MISSES],
                    "prefetch" => cells[at::PREFETCH],
                    "served_stale" => cells[at::STALE],
                    _ => 0,
                }
            }
        };
        let mut m = encoder.encode_descriptor(
            "coredns_cache_hits",
            "The count of cache hits.",
            None,
            MetricType::Counter,
        )?;
        for (&(s, zones), cells) in &caches {
            for (i, kind) in ["success", "denial"].iter().enumerate() {
                let v = cells[at::HITS + i];
                if v != 0 {
                    let labels = [
                        ("server", server(s)),
                        ("type", *kind),
                        ("zones", zones),
                        ("view", ""),
                    ];
                    counter(&mut m, &labels, v)?;
                }
            }
        }
        for (name, help, which) in [
            (
                "coredns_cache_requests",
                "The count of cache requests.",
                "requests",
            ),
            (
                "coredns_cache_misses",
                "The count of cache misses. Deprecated, derive misses from cache hits/requests counters.",
                "misses",
            ),
            (
                "coredns_cache_prefetch",
                "The number of times the cache has prefetched a cached item.",
                "prefetch",
            ),
            (
                "coredns_cache_served_stale",
                "The number of requests served from stale cache entries.",
                "served_stale",
            ),
        ] {
            let value = cache_series(which);
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (&(s, zones), cells) in &caches {
                let v = value(cells);
                if v != 0 {
                    let labels = [("server", server(s)), ("zones", zones), ("view", "")];
                    counter(&mut m, &labels, v)?;
                }
            }
        }

        let mut m = encoder.encode_descriptor(
            "coredns_reload_failed",
            "Counter of the number of failed reload attempts.",
            None,
            MetricType::Counter,
        )?;
        m.encode_counter::<NoLabelSet, u64, u64>(
            &self.reload_failed.load(Ordering::Relaxed),
            None,
        )?;

        for (name, help, i) in [
            (
                "nodedns_dns_malformed_requests",
                "Packets dropped or answered FORMERR because they were not a query nodedns could parse (or came from port 0).",
                event::MALFORMED,
            ),
            (
                "nodedns_dns_send_failures",
                "Answers that could not be handed to the kernel (socket buffer full, client gone).",
                event::SEND_FAILED,
            ),
            (
                "nodedns_dns_receive_errors",
                "UDP receive calls that failed.",
                event::RECV_FAILED,
            ),
            (
                "nodedns_tcp_refused_connections",
                "Client TCP connections closed at once because the connection limit was reached.",
                event::TCP_REFUSED,
            ),
            (
                "nodedns_singleflight_rejected",
                "Queries answered SERVFAIL at once because too many clients already waited for the same name.",
                event::FLIGHT_FULL,
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            m.encode_counter::<NoLabelSet, u64, u64>(&self.event(i), None)?;
        }

        let mut failures: BTreeMap<(String, &str), u64> = BTreeMap::new();
        for (i, count) in self.upstream_failures.iter().enumerate() {
            let v = count.load(Ordering::Relaxed);
            if v == 0 {
                continue;
            }
            let (slot, kind) = (i / UPSTREAM_ERRORS.len(), i % UPSTREAM_ERRORS.len());
            let zones = names
                .get(slot)
                .and_then(|s| s.as_ref())
                .map_or_else(String::new, |(_, block)| block.clone());
            *failures.entry((zones, UPSTREAM_ERRORS[kind])).or_default() += v;
        }
        let mut m = encoder.encode_descriptor(
            "nodedns_upstream_failures",
            "Queries of a server block that got no usable upstream reply, by why (the `errors` directive logs them, rate-limited).",
            None,
            MetricType::Counter,
        )?;
        for ((zones, kind), v) in &failures {
            counter(&mut m, &[("zones", zones.as_str()), ("error", *kind)], *v)?;
        }
        Ok(())
    }
}

fn counter(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: u64) -> fmt::Result {
    m.encode_family(labels)?
        .encode_counter::<NoLabelSet, u64, u64>(&v, None)
}

/// Two gauges labelled by `zones` whose values come in pairs (used and capacity; fetches and
/// waiters): `names[0]` takes each pair's first value, `names[1]` its second.
fn gauge_pair<'a>(
    encoder: &mut DescriptorEncoder<'_>,
    names: [(&str, &str); 2],
    pairs: impl IntoIterator<Item = (&'a String, &'a (u64, u64))> + Copy,
) -> fmt::Result {
    for (i, (name, help)) in names.into_iter().enumerate() {
        let mut m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (zones, &(first, second)) in pairs {
            let v = if i == 0 { first } else { second };
            gauge(&mut m, &[("zones", zones.as_str())], v)?;
        }
    }
    Ok(())
}

fn gauge(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: u64) -> fmt::Result {
    m.encode_family(labels)?.encode_gauge(&v)
}

/// Writes one histogram series from per-bucket (not cumulative) counts whose last element is
/// the +Inf bucket; nothing when it is empty.
fn histogram(
    m: &mut MetricEncoder<'_>,
    labels: &impl EncodeLabelSet,
    bounds: impl Iterator<Item = f64>,
    counts: &[u64],
    sum: f64,
) -> fmt::Result {
    let count: u64 = counts.iter().sum();
    if count == 0 {
        return Ok(());
    }
    let buckets: Vec<(f64, u64)> = bounds
        .chain(std::iter::once(f64::INFINITY))
        .zip(counts.iter().copied())
        .collect();
    m.encode_family(labels)?.encode_histogram::<NoLabelSet>(
        sum,
        count,
        &buckets,
        None::<&std::collections::HashMap<usize, Exemplar<NoLabelSet, f64>>>,
    )
}

/// Cache evictions per (server, zones), kept monotonic across reloads: a cache a reload
/// replaced keeps counting while anything still holds it, and its last count stays in the
/// total once it is gone.
#[derive(Debug, Default)]
struct Evictions {
    live: Vec<(String, String, Weak<Cache>, u64)>,
    retired: BTreeMap<(String, String), u64>,
}

/// The agent's collector: the request-path counters ([`Metrics::encode`]) and what is read at
/// scrape time from the running configuration (cache entries, bytes and evictions, single-flight
/// waiters). Registered in the registry beside the crates' metrics.
#[derive(Debug)]
pub struct Exposition {
    shared: Arc<Shared>,
}

impl Exposition {
    pub fn new(shared: Arc<Shared>) -> Self {
        Exposition { shared }
    }
}

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let metrics = &self.shared.metrics;
        metrics.encode(&mut encoder)?;
        encode_snapshot(metrics, &self.shared.snapshot.load(), &mut encoder)?;
        encode_process(&mut encoder, &Process::read())
    }
}

/// What the Go client's process collector reports (CoreDNS and node-cache export it, and
/// dashboards graph memory and CPU from it), read from `/proc/self` at scrape time.
#[derive(Debug, Default, PartialEq)]
struct Process {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    start_time_seconds: Option<f64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
}

/// Clock ticks per second in `/proc` (`USER_HZ`: 100 on every Linux architecture's ABI).
const USER_HZ: f64 = 100.0;

impl Process {
    fn read() -> Process {
        let file = |path: &str| std::fs::read_to_string(path).ok();
        let mut p = Process::parse(
            file("/proc/self/stat").as_deref(),
            file("/proc/self/status").as_deref(),
            file("/proc/stat").as_deref(),
            file("/proc/self/limits").as_deref(),
        );
        p.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        p
    }

    /// Pure: the texts of `/proc/self/stat`, `/proc/self/status`, `/proc/stat` and
    /// `/proc/self/limits` (proc(5)).
    fn parse(
        stat: Option<&str>,
        status: Option<&str>,
        system: Option<&str>,
        limits: Option<&str>,
    ) -> Process {
        // Fields after the command name (which may hold spaces and parentheses): field 3 is the
        // first; utime 14, stime 15, starttime 22.
        let fields: Vec<&str> = stat
            .and_then(|s| s.rsplit_once(')'))
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
        let kib = |key: &str| {
            status?
                .lines()
                .find_map(|l| l.strip_prefix(key))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
                .map(|k| k * 1024)
        };
        let boot = system.and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))?
                .trim()
                .parse::<f64>()
                .ok()
        });
        let max_fds = limits.and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))?
                .split_whitespace()
                .nth(3)?
                .parse()
                .ok()
        });
        Process {
            cpu_seconds: field(14).zip(field(15)).map(|(u, s)| (u + s) / USER_HZ),
            resident_bytes: kib("VmRSS:"),
            virtual_bytes: kib("VmSize:"),
            start_time_seconds: boot.zip(field(22)).map(|(b, t)| b + t / USER_HZ),
            open_fds: None,
            max_fds,
        }
    }
}

fn encode_process(encoder: &mut DescriptorEncoder<'_>, p: &Process) -> fmt::Result {
    if let Some(v) = p.cpu_seconds {
        encoder
            .encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, f64, u64>(&v, None)?;
    }
    for (name, help, v) in [
        (
            "process_open_fds",
            "Number of open file descriptors.",
            p.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            p.max_fds,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            p.virtual_bytes,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            p.resident_bytes,
        ),
    ] {
        if let Some(v) = v {
            encoder
                .encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&v)?;
        }
    }
    if let Some(v) = p.start_time_seconds {
        encoder
            .encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&v)?;
    }
    Ok(())
}

/// The families read from the running configuration.
fn encode_snapshot(
    metrics: &Metrics,
    snap: &Snapshot,
    encoder: &mut DescriptorEncoder<'_>,
) -> fmt::Result {
    let mut entries: BTreeMap<(String, &'static str, String), u64> = BTreeMap::new();
    let mut bytes: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut flights: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut evictions: BTreeMap<(String, String), u64> = BTreeMap::new();
    {
        let mut ledger = metrics
            .evictions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for zone in &snap.zones {
            let zones = zone.server.zones.join(",");
            let (keys, waiters) = zone.flights.len();
            let f = flights.entry(zones.clone()).or_default();
            f.0 += keys as u64;
            f.1 += waiters as u64;
            let Some(cache) = &zone.cache else { continue };
            let tracked = ledger
                .live
                .iter()
                .any(|(_, _, weak, _)| std::ptr::eq(weak.as_ptr(), Arc::as_ptr(cache)));
            if !tracked {
                let server = zone
                    .server
                    .listen
                    .first()
                    .map_or_else(String::new, |a| server_label(*a));
                ledger
                    .live
                    .push((server, zones.clone(), Arc::downgrade(cache), 0));
            }
            let stats = cache.stats();
            for listen in &zone.server.listen {
                let server = server_label(*listen);
                *entries
                    .entry((server.clone(), "success", zones.clone()))
                    .or_default() += stats.success;
                *entries
                    .entry((server, "denial", zones.clone()))
                    .or_default() += stats.denial + stats.servfail;
            }
            let b = bytes.entry(zones).or_default();
            b.0 += stats.bytes;
            b.1 += cache.policy().capacity_bytes;
        }
        let Evictions { live, retired } = &mut *ledger;
        live.retain_mut(|(server, zones, weak, last)| match weak.upgrade() {
            Some(cache) => {
                *last = cache.stats().evictions;
                *evictions
                    .entry((server.clone(), zones.clone()))
                    .or_default() += *last;
                true
            }
            None => {
                *retired.entry((server.clone(), zones.clone())).or_default() += *last;
                false
            }
        });
        for (key, v) in retired.iter() {
            *evictions.entry(key.clone()).or_default() += v;
        }
    }

    let mut m = encoder.encode_descriptor(
        "coredns_cache_entries",
        "The number of elements in the cache.",
        None,
        MetricType::Gauge,
    )?;
    for ((server, kind, zones), v) in &entries {
        let labels = [
            ("server", server.as_str()),
            ("type", *kind),
            ("zones", zones.as_str()),
            ("view", ""),
        ];
        gauge(&mut m, &labels, *v)?;
    }
    let mut m = encoder.encode_descriptor(
        "coredns_cache_evictions",
        "The count of cache evictions.",
        None,
        MetricType::Counter,
    )?;
    for ((server, zones), v) in &evictions {
        // The cache counts evictions of every class together: `type` says so.
        let labels = [
            ("server", server.as_str()),
            ("type", "all"),
            ("zones", zones.as_str()),
            ("view", ""),
        ];
        counter(&mut m, &labels, *v)?;
    }
    gauge_pair(
        encoder,
        [
            (
                "nodedns_cache_bytes",
                "Weighted size of the cache's entries (keys, replies and bookkeeping), in bytes.",
            ),
            (
                "nodedns_cache_capacity_bytes",
                "The cache's capacity, in bytes.",
            ),
        ],
        &bytes,
    )?;
    gauge_pair(
        encoder,
        [
            (
                "nodedns_singleflight_fetches",
                "Upstream fetches in progress that other queries for the same name wait on.",
            ),
            (
                "nodedns_singleflight_waiters",
                "Client queries waiting for an upstream fetch in progress (the one that started it included).",
            ),
        ],
        &flights,
    )?;
    Ok(())
}

/// The registry's exposition in the Prometheus text format 0.0.4 (what `/metrics` serves).
pub fn text(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    if let Err(err) = prometheus_client::encoding::prometheus_text::encode(&mut out, registry) {
        tracing::error!(%err, "metrics encoding failed");
    }
    out
}

/// The `Content-Type` of [`text`].
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

#[cfg(test)]
mod tests {
    use super::*;

    /// The clients of the tests' queries.
    const UDP: Client = Client {
        proto: Proto::Udp,
        addr: SocketAddr::V4(std::net::SocketAddrV4::new(
            std::net::Ipv4Addr::new(10, 0, 0, 7),
            40000,
        )),
    };
    const TCP: Client = Client {
        proto: Proto::Tcp,
        ..UDP
    };
    use prometheus_client::registry::Registry;

    /// Registers `metrics`' request-path families alone (no snapshot).
    #[derive(Debug)]
    struct Only(Arc<Metrics>);
    impl prometheus_client::collector::Collector for Only {
        fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
            self.0.encode(&mut encoder)
        }
    }

    fn exposition(metrics: &Arc<Metrics>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Only(metrics.clone())));
        text(&registry)
    }

    /// A query for `name` (dotted, absolute) of `qtype`, with an OPT record if `edns`.
    fn query(name: &str, qtype: u16, edns: Option<(u16, bool)>) -> Vec<u8> {
        let mut q = vec![
            0x12,
            0x34,
            0x01,
            0x00,
            0,
            1,
            0,
            0,
            0,
            0,
            0,
            u8::from(edns.is_some()),
        ];
        for label in name
            .trim_end_matches('.')
            .split('.')
            .filter(|l| !l.is_empty())
        {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        if let Some((size, dnssec_ok)) = edns {
            q.extend_from_slice(&[0, 0, 41]);
            q.extend_from_slice(&size.to_be_bytes());
            q.extend_from_slice(&[0, 0, if dnssec_ok { 0x80 } else { 0 }, 0, 0, 0]);
        }
        q
    }

    /// A response of `len` bytes with `rcode`.
    fn response(rcode: u8, len: usize) -> Vec<u8> {
        let mut r = vec![0u8; len];
        r[2] = 0x81;
        r[3] = 0x80 | rcode;
        r
    }

    fn lines(text: &str, prefix: &str) -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_qtype_jump_table_agrees_with_the_label_list() {
        for (i, &(t, _)) in QTYPES.iter().enumerate() {
            assert_eq!(qtype_index(t), i);
        }
        assert_eq!(
            qtype_index(35),
            OTHER_TYPE,
            "NAPTR is not a CoreDNS type label"
        );
        assert_eq!(qtype_name(65), "HTTPS");
        assert_eq!(qtype_name(35), "TYPE35");
    }

    #[test]
    fn buckets_are_coredns_bounds_inclusive() {
        assert_eq!(time_bucket(0), 0);
        assert_eq!(time_bucket(250_000), 0);
        assert_eq!(time_bucket(250_001), 1);
        assert_eq!(time_bucket(8_192_000_000), 15);
        assert_eq!(time_bucket(8_192_000_001), 16);
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(29), 1);
        assert_eq!(size_bucket(511), 5);
        assert_eq!(size_bucket(65_535), 14);
        for len in 0..70_000 {
            let slow = SIZE_BOUNDS
                .iter()
                .position(|&b| len <= b)
                .unwrap_or(SIZE_SLOTS - 1);
            assert_eq!(size_bucket(len), slow, "{len}");
        }
    }

    #[test]
    fn server_labels_are_written_as_coredns_does() {
        assert_eq!(
            server_label("169.254.20.10:53".parse().unwrap()),
            "dns://169.254.20.10:53"
        );
        assert_eq!(server_label("0.0.0.0:53".parse().unwrap()), "dns://:53");
        assert_eq!(server_label("[::]:53".parse().unwrap()), "dns://:53");
        assert_eq!(
            server_label("[fd00::10]:53".parse().unwrap()),
            "dns://[fd00::10]:53"
        );
    }

    #[test]
    fn zone_slots_are_stable_per_zone_list_and_overflow_into_other() {
        let m = Metrics::default();
        let dot = vec![".".to_owned()];
        let cl = vec!["cluster.local.".to_owned(), "in-addr.arpa.".to_owned()];
        assert_eq!(m.zone_slots(&dot), 1);
        assert_eq!(m.zone_slots(&cl), 2);
        assert_eq!(m.zone_slots(&dot), 1, "same list, same slots");
        for i in 0..40 {
            let slot = m.zone_slots(&[format!("z{i}.")]);
            assert!(slot <= OVERFLOW);
        }
        assert_eq!(m.zone_slots(&["late.".to_owned()]), OVERFLOW);
    }

    #[test]
    fn a_known_sequence_gives_exact_coredns_series() {
        let local: SocketAddr = "169.254.20.10:53".parse().unwrap();
        let metrics = Arc::new(Metrics::new(&[local], Options::default()));
        let base = metrics.zone_slots(&["cluster.local.".to_owned()]);
        let worker = metrics.worker(local);
        let labels = worker.labels(base, true, false);

        let a = query("a.default.svc.cluster.local.", 1, None);
        let a = Query::parse(&a).unwrap();
        let aaaa = query("a.default.svc.cluster.local.", 28, Some((1232, true)));
        let aaaa = Query::parse(&aaaa).unwrap();
        // Miss (answered on the async path), then two hits, then an NXDOMAIN hit over AAAA.
        metrics.shared(labels).answered(
            labels,
            &UDP,
            &a,
            Source::Upstream,
            &response(0, 80),
            Duration::from_millis(3),
        );
        for _ in 0..2 {
            worker.answered(
                labels,
                &UDP,
                &a,
                Source::Hit(Class::Success),
                &response(0, 80),
                Duration::ZERO,
            );
        }
        worker.answered(
            labels,
            &UDP,
            &aaaa,
            Source::Hit(Class::Denial),
            &response(3, 120),
            Duration::ZERO,
        );
        worker.prefetch(labels);
        // A name no block serves.
        let refused = worker.dropped();
        worker.answered(
            refused,
            &TCP,
            &a,
            Source::Refused,
            &response(5, 40),
            Duration::ZERO,
        );

        let text = exposition(&metrics);
        let s = r#"server="dns://169.254.20.10:53""#;
        assert_eq!(
            lines(&text, "coredns_dns_requests_total"),
            [
                format!(
                    r#"coredns_dns_requests_total{{{s},zone="cluster.local.",view="",proto="udp",family="1",type="A"}} 3"#
                ),
                format!(
                    r#"coredns_dns_requests_total{{{s},zone="cluster.local.",view="",proto="udp",family="1",type="AAAA"}} 1"#
                ),
                format!(
                    r#"coredns_dns_requests_total{{{s},zone="dropped",view="",proto="tcp",family="1",type="A"}} 1"#
                ),
            ]
        );
        assert_eq!(
            lines(&text, "coredns_dns_responses_total"),
            [
                format!(
                    r#"coredns_dns_responses_total{{{s},zone="cluster.local.",view="",rcode="NOERROR",plugin="cache"}} 3"#
                ),
                format!(
                    r#"coredns_dns_responses_total{{{s},zone="cluster.local.",view="",rcode="NXDOMAIN",plugin="cache"}} 1"#
                ),
                format!(
                    r#"coredns_dns_responses_total{{{s},zone="dropped",view="",rcode="REFUSED",plugin=""}} 1"#
                ),
            ]
        );
        assert_eq!(
            lines(&text, "coredns_dns_do_requests_total"),
            [format!(
                r#"coredns_dns_do_requests_total{{{s},zone="cluster.local.",view=""}} 1"#
            )]
        );
        assert_eq!(
            lines(&text, "coredns_cache_hits_total"),
            [
                format!(
                    r#"coredns_cache_hits_total{{{s},type="success",zones="cluster.local.",view=""}} 2"#
                ),
                format!(
                    r#"coredns_cache_hits_total{{{s},type="denial",zones="cluster.local.",view=""}} 1"#
                ),
            ]
        );
        for (name, v) in [
            ("coredns_cache_requests_total", 4),
            ("coredns_cache_misses_total", 1),
            ("coredns_cache_prefetch_total", 1),
        ] {
            assert_eq!(
                lines(&text, name),
                [format!(
                    r#"{name}{{{s},zones="cluster.local.",view=""}} {v}"#
                )]
            );
        }
        assert!(lines(&text, "coredns_cache_served_stale_total").is_empty());
        // Duration: three answers at 0 and one at 3 ms (bucket 0.004).
        let dur = lines(
            &text,
            r#"coredns_dns_request_duration_seconds_bucket{server="dns://169.254.20.10:53",zone="cluster.local.""#,
        );
        assert!(
            dur.iter().any(|l| l.ends_with(r#"le="0.00025"} 3"#)),
            "{dur:?}"
        );
        assert!(
            dur.iter().any(|l| l.ends_with(r#"le="0.002"} 3"#)),
            "{dur:?}"
        );
        assert!(
            dur.iter().any(|l| l.ends_with(r#"le="0.004"} 4"#)),
            "{dur:?}"
        );
        assert!(
            dur.iter().any(|l| l.ends_with(r#"le="+Inf"} 4"#)),
            "{dur:?}"
        );
        assert!(text.contains(&format!(
            r#"coredns_dns_request_duration_seconds_sum{{{s},zone="cluster.local.",view=""}} 0.003"#
        )));
        // Sizes: responses 80, 80, 80 (≤100) and 120 (≤200) over UDP.
        let size = lines(
            &text,
            r#"coredns_dns_response_size_bytes_bucket{server="dns://169.254.20.10:53",zone="cluster.local.",view="",proto="udp""#,
        );
        assert!(
            size.iter().any(|l| l.ends_with(r#"le="100"} 3"#)),
            "{size:?}"
        );
        assert!(
            size.iter().any(|l| l.ends_with(r#"le="200"} 4"#)),
            "{size:?}"
        );
        assert!(text.contains(&format!(
            r#"coredns_dns_response_size_bytes_sum{{{s},zone="cluster.local.",view="",proto="udp"}} 360"#
        )));
        assert!(text.contains("# TYPE coredns_dns_requests_total counter\n"));
        assert!(text.contains("# HELP coredns_cache_hits_total The count of cache hits.\n"));
        assert!(text.contains("coredns_reload_failed_total 0\n"));
    }

    #[test]
    fn stale_answers_count_as_hits_or_misses_by_path_and_as_served_stale() {
        let local: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let metrics = Arc::new(Metrics::new(&[local], Options::default()));
        let labels =
            metrics
                .worker(local)
                .labels(metrics.zone_slots(&[".".to_owned()]), true, false);
        let q = query("example.com.", 1, None);
        let q = Query::parse(&q).unwrap();
        let shared = metrics.shared(labels);
        shared.answered(
            labels,
            &UDP,
            &q,
            Source::StaleHit(Class::Success),
            &response(0, 60),
            Duration::ZERO,
        );
        shared.answered(
            labels,
            &UDP,
            &q,
            Source::StaleAfterMiss,
            &response(0, 60),
            Duration::from_secs(2),
        );
        shared.answered(
            labels,
            &UDP,
            &q,
            Source::ServFail,
            &response(2, 30),
            Duration::from_secs(2),
        );
        let text = exposition(&metrics);
        let s = r#"server="dns://127.0.0.1:5353",zones=".",view="""#;
        assert!(
            text.contains(&format!("coredns_cache_served_stale_total{{{s}}} 2\n")),
            "{text}"
        );
        assert!(text.contains(&format!("coredns_cache_misses_total{{{s}}} 2\n")));
        assert!(text.contains(&format!("coredns_cache_requests_total{{{s}}} 3\n")));
        assert!(text.contains(r#"rcode="SERVFAIL",plugin=""} 1"#), "{text}");
    }

    #[test]
    fn counting_off_counts_nothing() {
        let local: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let options = Options {
            counting: false,
            ..Options::default()
        };
        let metrics = Arc::new(Metrics::new(&[local], options));
        let worker = metrics.worker(local);
        let labels = worker.labels(metrics.zone_slots(&[".".to_owned()]), true, false);
        let q = query("example.com.", 1, None);
        let q = Query::parse(&q).unwrap();
        worker.answered(
            labels,
            &UDP,
            &q,
            Source::Hit(Class::Success),
            &response(0, 60),
            Duration::ZERO,
        );
        let text = exposition(&metrics);
        assert!(
            lines(&text, "coredns_dns_requests_total").is_empty(),
            "{text}"
        );
        assert!(lines(&text, "coredns_cache_hits_total").is_empty());
    }

    #[test]
    fn process_figures_come_from_proc_texts() {
        let stat = "4242 (nodedns (udp) x) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 50 0 0 20 0 9 0 12345 1000 2000";
        let status = "Name:\tnodedns\nVmSize:\t  204800 kB\nVmRSS:\t   10240 kB\n";
        let system = "cpu  1 2 3\nbtime 1700000000\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        let p = Process::parse(Some(stat), Some(status), Some(system), Some(limits));
        assert_eq!(p.cpu_seconds, Some(3.0), "(250 + 50) ticks at 100 Hz");
        assert!((p.start_time_seconds.unwrap() - 1_700_000_123.45).abs() < 1e-6);
        assert_eq!(p.resident_bytes, Some(10240 * 1024));
        assert_eq!(p.virtual_bytes, Some(204800 * 1024));
        assert_eq!(p.max_fds, Some(1_048_576));
        assert_eq!(
            Process::parse(Some("garbage"), None, None, Some("")),
            Process::default()
        );
    }

    #[test]
    fn the_query_log_samples_one_in_n() {
        let options = Options {
            log_sample: 0.25,
            ..Options::default()
        };
        let c = Counters::new(0, "dns://:53".into(), true, &options);
        let logged = (0..100).filter(|_| c.sample()).count();
        assert_eq!(logged, 25);
        let all = Counters::new(0, "dns://:53".into(), false, &Options::default());
        assert_eq!((0..10).filter(|_| all.sample()).count(), 10);
    }
}
