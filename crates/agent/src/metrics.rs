//! The agent's own metrics: what the request path counts.
//!
//! Counting must not slow the hit path: each UDP worker thread owns a [`Counters`] block that only
//! it writes (relaxed atomics, no lock, no allocation, no label lookup per query); the TCP and
//! async paths share one more block. A scrape sums the blocks. Labels are resolved to array
//! indices up front: the server block's index (its `zone` label), the protocol, the family, the
//! query type and the RCODE, each from a small fixed set (CoreDNS folds rare types into "other"
//! the same way).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nodedns_cache::Class;
use nodedns_wire::Query;

/// Server blocks with their own labels; blocks beyond share the last index.
pub const MAX_ZONES: usize = 16;
/// Index for queries no block serves (refused before routing).
const NO_ZONE: usize = MAX_ZONES;
const ZONES: usize = MAX_ZONES + 1;

/// Transport of a client query (`proto` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Udp,
    Tcp,
}

/// Where an answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A fresh cache entry.
    Cache(Class),
    /// An expired entry served because the upstream could not answer (RFC 8767).
    Stale,
    /// The upstream, after a cache miss; the class it was cached as, if it was.
    Upstream(Option<Class>),
    /// Refused by nodedns itself (no block, no forward, or an `except` name).
    Refused,
    /// SERVFAIL made by nodedns (upstream failed, nothing stale).
    ServFail,
}

/// Query types with their own `type` label (CoreDNS's list of common types); others are "other".
pub const QTYPES: [(u16, &str); 14] = [
    (1, "A"),
    (28, "AAAA"),
    (5, "CNAME"),
    (2, "NS"),
    (6, "SOA"),
    (12, "PTR"),
    (15, "MX"),
    (16, "TXT"),
    (33, "SRV"),
    (35, "NAPTR"),
    (43, "DS"),
    (48, "DNSKEY"),
    (65, "HTTPS"),
    (255, "ANY"),
];
const OTHER_TYPE: usize = QTYPES.len();
const TYPES: usize = QTYPES.len() + 1;

/// RCODEs with their own label; others are "OTHER".
pub const RCODES: [u16; 6] = [0, 1, 2, 3, 4, 5];
const OTHER_RCODE: usize = RCODES.len();
const RCODE_SLOTS: usize = RCODES.len() + 1;

fn qtype_index(qtype: u16) -> usize {
    QTYPES
        .iter()
        .position(|&(t, _)| t == qtype)
        .unwrap_or(OTHER_TYPE)
}

fn rcode_index(rcode: u16) -> usize {
    RCODES
        .iter()
        .position(|&r| r == rcode)
        .unwrap_or(OTHER_RCODE)
}

fn class_index(class: Class) -> usize {
    match class {
        Class::Success => 0,
        Class::Denial => 1,
        Class::ServFail => 2,
    }
}

/// A counter written by one thread (or a few), summed at scrape time.
#[derive(Debug, Default)]
struct Count(AtomicU64);

impl Count {
    #[inline]
    fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One block of counters.
#[derive(Debug)]
pub struct Counters {
    /// [zone][proto][family][type]
    requests: Vec<Count>,
    /// [zone][rcode]
    responses: Vec<Count>,
    /// [zone][class]: fresh cache hits.
    hits: Vec<Count>,
    /// [zone]: cache misses (went upstream).
    misses: Vec<Count>,
    /// [zone]
    stale: Vec<Count>,
    /// [zone]
    prefetch: Vec<Count>,
    malformed: Count,
    flight_full: Count,
    send_failed: Count,
    recv_failed: Count,
    tcp_refused: Count,
}

fn counts(n: usize) -> Vec<Count> {
    (0..n).map(|_| Count::default()).collect()
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            requests: counts(ZONES * 2 * 2 * TYPES),
            responses: counts(ZONES * RCODE_SLOTS),
            hits: counts(ZONES * 3),
            misses: counts(ZONES),
            stale: counts(ZONES),
            prefetch: counts(ZONES),
            malformed: Count::default(),
            flight_full: Count::default(),
            send_failed: Count::default(),
            recv_failed: Count::default(),
            tcp_refused: Count::default(),
        }
    }
}

fn zone_index(zone: Option<usize>) -> usize {
    zone.map_or(NO_ZONE, |z| z.min(MAX_ZONES - 1))
}

impl Counters {
    /// Counts one answered query: the request, the response, and where the answer came from.
    #[inline]
    pub fn answered(
        &self,
        zone: Option<usize>,
        proto: Proto,
        query: &Query<'_>,
        source: Source,
        response: &[u8],
        _elapsed_secs: f64,
    ) {
        let z = zone_index(zone);
        let p = proto as usize;
        let family = 0; // TODO(metrics): family from the listen address.
        self.requests[((z * 2 + p) * 2 + family) * TYPES + qtype_index(query.qtype())].inc();
        let rcode = response.get(3).map_or(0, |b| u16::from(b & 0x0f));
        self.responses[z * RCODE_SLOTS + rcode_index(rcode)].inc();
        match source {
            Source::Cache(class) => self.hits[z * 3 + class_index(class)].inc(),
            Source::Upstream(_) | Source::ServFail => self.misses[z].inc(),
            Source::Stale => self.stale[z].inc(),
            Source::Refused => {}
        }
    }

    pub fn prefetch(&self, zone: usize) {
        self.prefetch[zone_index(Some(zone))].inc();
    }
    pub fn malformed(&self) {
        self.malformed.inc();
    }
    pub fn flight_full(&self) {
        self.flight_full.inc();
    }
    pub fn send_failed(&self) {
        self.send_failed.inc();
    }
    pub fn recv_failed(&self) {
        self.recv_failed.inc();
    }
    pub fn tcp_refused(&self) {
        self.tcp_refused.inc();
    }
}

/// All the agent's counter blocks.
#[derive(Debug, Default)]
pub struct Metrics {
    shared: Counters,
    workers: Mutex<Vec<Arc<Counters>>>,
    reload_failed: Count,
}

impl Metrics {
    /// The block shared by the TCP and async paths.
    pub fn counters(&self) -> &Counters {
        &self.shared
    }

    /// A new block for one UDP worker thread.
    pub fn worker(&self) -> Arc<Counters> {
        let counters = Arc::new(Counters::default());
        self.workers
            .lock()
            .expect("metrics lock")
            .push(counters.clone());
        counters
    }

    /// Sums one counter over every block.
    fn sum(&self, get: impl Fn(&Counters) -> u64) -> u64 {
        let workers = self.workers.lock().expect("metrics lock");
        get(&self.shared) + workers.iter().map(|w| get(w)).sum::<u64>()
    }

    /// Upstream failure, for the `errors` directive's log (rate-limited).
    pub fn upstream_failed(&self, zone: usize, err: &nodedns_upstream::Error) {
        let _ = zone;
        tracing::debug!(%err, "upstream query failed");
    }

    /// A reload found a bad configuration and kept the running one.
    pub fn reload_failed(&self) {
        self.reload_failed.inc();
    }

    /// Appends the Prometheus text exposition of the agent's counters.
    pub fn encode(&self, out: &mut String, snap: &crate::serve::Snapshot) {
        use std::fmt::Write;
        let _ = writeln!(
            out,
            "# HELP coredns_dns_requests_total Counter of DNS requests made per zone, protocol and family."
        );
        let _ = writeln!(out, "# TYPE coredns_dns_requests_total counter");
        for (z, zone) in snap.zones.iter().enumerate().take(MAX_ZONES) {
            let name = zone.server.zones.first().map_or(".", String::as_str);
            let total = self.sum(|c| {
                c.requests[z * 2 * 2 * TYPES..(z + 1) * 2 * 2 * TYPES]
                    .iter()
                    .map(Count::get)
                    .sum()
            });
            let _ = writeln!(out, "coredns_dns_requests_total{{zone=\"{name}\"}} {total}");
        }
        let _ = writeln!(
            out,
            "# HELP coredns_cache_hits_total The count of cache hits."
        );
        let _ = writeln!(out, "# TYPE coredns_cache_hits_total counter");
        let _ = writeln!(out, "coredns_cache_hits_total {}", self.hits());
        let _ = writeln!(
            out,
            "# HELP coredns_reload_failed_total Counter of the number of failed reload attempts."
        );
        let _ = writeln!(out, "# TYPE coredns_reload_failed_total counter");
        let _ = writeln!(
            out,
            "coredns_reload_failed_total {}",
            self.reload_failed.get()
        );
    }

    /// Cache hits by class (summed), for tests and the live view.
    pub fn hits(&self) -> u64 {
        self.sum(|c| c.hits.iter().map(Count::get).sum())
    }
}
