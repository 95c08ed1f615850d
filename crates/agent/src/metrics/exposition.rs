//! The exposition: every agent metric written at scrape time, in the registry the `upstream`
//! and `hostnet` crates register in too (one registry, one exposition, Prometheus text format
//! 0.0.4).
//!
//! A scrape sums the counter blocks and turns indices into label values; as with CoreDNS's
//! vectors, only series that counted something are written. What the running configuration holds
//! (cache entries and bytes, evictions, single-flight fetches) comes from the request path as a
//! plain list of [`ZoneFigures`], gathered by a function it gives [`Exposition::new`]: this module
//! never walks the data path's state itself.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::exemplar::Exemplar;

use super::Metrics;
use super::counters::{at, event};
use super::labels::{
    CLASSES, PLUGINS, RCODES, SIZE_BOUNDS, SIZE_SLOTS, TIME_BOUNDS_NS, TIME_SLOTS, TRANSPORTS,
    TYPES, UPSTREAM_ERRORS, rcode_label, scheme_label, type_label,
};

/// What one server block reports at scrape time, read from the running configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ZoneFigures {
    /// The block's listen addresses (the `server` label of its cache families).
    pub listen: Vec<SocketAddr>,
    /// The block's scheme (`dns`, `tls`, `https`: the `server` label's).
    pub scheme: &'static str,
    /// Its zones (the `zones` label, joined by commas).
    pub zones: Vec<String>,
    /// Its cache, if it has one.
    pub cache: Option<CacheFigures>,
    /// Upstream fetches in progress, and the client queries waiting for them.
    pub fetches: u64,
    pub waiters: u64,
}

/// One cache's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheFigures {
    /// Names the cache for the life of the process: a reload that keeps a block's cache keeps
    /// its id, a new cache gets a new one. Evictions are summed per id, so the total stays
    /// monotonic when a reload replaces a cache.
    pub id: u64,
    pub stats: nodedns_cache::Stats,
    pub capacity_bytes: u64,
}

/// Gathers the [`ZoneFigures`] of the running configuration.
type Figures = Box<dyn Fn() -> Vec<ZoneFigures> + Send + Sync>;

/// The agent's collector: the request-path counters, the figures of the running configuration,
/// and the process metrics.
pub struct Exposition {
    metrics: Arc<Metrics>,
    figures: Figures,
    evictions: Mutex<Evictions>,
}

impl fmt::Debug for Exposition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposition")
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl Exposition {
    /// `figures` is called once per scrape.
    pub fn new(
        metrics: Arc<Metrics>,
        figures: impl Fn() -> Vec<ZoneFigures> + Send + Sync + 'static,
    ) -> Self {
        Exposition {
            metrics,
            figures: Box::new(figures),
            evictions: Mutex::new(Evictions::default()),
        }
    }
}

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        encode_requests(&self.metrics, &mut encoder)?;
        let figures = (self.figures)();
        let evictions = self
            .evictions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .update(&figures);
        encode_zones(&figures, &evictions, &mut encoder)?;
        super::process::encode(&mut encoder)
    }
}

/// Cache evictions per (server, zones), kept monotonic across reloads: each cache counts under
/// its id while it is in the figures, and its last count stays in the total once it is gone.
#[derive(Debug, Default)]
struct Evictions {
    /// id → (server, zones, last count).
    live: BTreeMap<u64, (String, String, u64)>,
    retired: BTreeMap<(String, String), u64>,
}

impl Evictions {
    /// Takes this scrape's counts and returns the totals per (server, zones).
    fn update(&mut self, figures: &[ZoneFigures]) -> BTreeMap<(String, String), u64> {
        let mut seen = BTreeMap::new();
        for zone in figures {
            let Some(cache) = &zone.cache else { continue };
            // A block on several addresses is counted under the first (the cache is one).
            let server = zone
                .listen
                .first()
                .map_or_else(String::new, |a| scheme_label(zone.scheme, *a));
            seen.insert(
                cache.id,
                (server, zone.zones.join(","), cache.stats.evictions),
            );
        }
        for (id, (server, zones, last)) in std::mem::take(&mut self.live) {
            if !seen.contains_key(&id) {
                *self.retired.entry((server, zones)).or_default() += last;
            }
        }
        self.live = seen;
        let mut totals = self.retired.clone();
        for (server, zones, v) in self.live.values() {
            *totals.entry((server.clone(), zones.clone())).or_default() += v;
        }
        totals
    }
}

/// Writes the request-path families, the reload counter and the build info.
fn encode_requests(metrics: &Metrics, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
    // (server, zone name) → summed cells of the slots with that name (a zone can hold slots
    // from before and after a reload).
    let names = {
        let names = metrics.names.lock().unwrap_or_else(PoisonError::into_inner);
        names.slots.clone()
    };
    let mut zones: BTreeMap<(usize, &str), Vec<u64>> = BTreeMap::new();
    let mut caches: BTreeMap<(usize, &str), Vec<u64>> = BTreeMap::new();
    for server in 0..metrics.servers.len() {
        let cells = metrics.sum(server);
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
    let server = |i: usize| metrics.servers[i].name.as_ref();
    let family = |i: usize| {
        if metrics.servers[i].addr.is_ipv4() {
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
        for proto in TRANSPORTS {
            for t in 0..TYPES {
                let v = cells[at::REQUESTS + proto as usize * TYPES + t];
                if v == 0 {
                    continue;
                }
                let qtype = type_label(t);
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
        for rcode in 0..RCODES {
            let rcode_name = rcode_label(rcode);
            for (plugin, plugin_name) in PLUGINS.iter().enumerate() {
                let v = cells[at::RESPONSES + rcode * PLUGINS.len() + plugin];
                if v == 0 {
                    continue;
                }
                let labels = [
                    ("server", server(s)),
                    ("zone", zone),
                    ("view", ""),
                    ("rcode", &*rcode_name),
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
            for proto in TRANSPORTS {
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
        for (i, kind) in CLASSES.iter().enumerate() {
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
    m.encode_counter::<NoLabelSet, u64, u64>(&metrics.reload_failed.load(Ordering::Relaxed), None)?;

    for (name, help, i) in [
        (
            "nodedns_dns_malformed_requests",
            "Packets dropped or answered FORMERR because they were not a query nodedns could parse.",
            event::MALFORMED,
        ),
        (
            "nodedns_dns_forbidden_sources",
            "UDP datagrams dropped unread because no answer may go to their source: port 0, an unspecified, broadcast or multicast address.",
            event::FORBIDDEN_SOURCE,
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
        m.encode_counter::<NoLabelSet, u64, u64>(&metrics.event(i), None)?;
    }

    let mut m = encoder.encode_descriptor(
        "nodedns_cascade_prefetches",
        "Later search-list steps the ndots cascade prefetch fetched (started), and what became of them: asked by a client while in flight or fresh (used), never asked (wasted), or not fetched because of its bounds (skipped).",
        None,
        MetricType::Counter,
    )?;
    for outcome in super::Cascade::ALL {
        let v = metrics.cascade[outcome as usize].load(Ordering::Relaxed);
        counter(&mut m, &[("outcome", outcome.as_str())], v)?;
    }
    let mut m = encoder.encode_descriptor(
        "nodedns_dns_rate_limited",
        "UDP queries beyond their client address's rate limit, by what they got: truncated (an empty answer with TC=1, to ask again over TCP) or dropped (beyond the rate of TC answers too).",
        None,
        MetricType::Counter,
    )?;
    for (action, i) in [
        ("truncated", event::RATE_TRUNCATED),
        ("dropped", event::RATE_DROPPED),
    ] {
        counter(&mut m, &[("action", action)], metrics.event(i))?;
    }

    let mut failures: BTreeMap<(String, &str), u64> = BTreeMap::new();
    for (i, count) in metrics.upstream_failures.iter().enumerate() {
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

/// The families read from the running configuration.
fn encode_zones(
    figures: &[ZoneFigures],
    evictions: &BTreeMap<(String, String), u64>,
    encoder: &mut DescriptorEncoder<'_>,
) -> fmt::Result {
    let mut entries: BTreeMap<(String, &'static str, String), u64> = BTreeMap::new();
    let mut bytes: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut flights: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for zone in figures {
        let zones = zone.zones.join(",");
        let f = flights.entry(zones.clone()).or_default();
        f.0 += zone.fetches;
        f.1 += zone.waiters;
        let Some(cache) = &zone.cache else { continue };
        let stats = cache.stats;
        for listen in &zone.listen {
            let server = scheme_label(zone.scheme, *listen);
            *entries
                .entry((server.clone(), CLASSES[0], zones.clone()))
                .or_default() += stats.success;
            *entries
                .entry((server, CLASSES[1], zones.clone()))
                .or_default() += stats.denial + stats.servfail;
        }
        let b = bytes.entry(zones).or_default();
        b.0 += stats.bytes;
        b.1 += cache.capacity_bytes;
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
    for ((server, zones), v) in evictions {
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
    use std::time::Duration;

    use nodedns_cache::{Class, Stats};
    use nodedns_wire::Query;
    use prometheus_client::registry::Registry;

    use super::super::{Answer, CacheUse, Plugin, Transport};
    use super::*;

    /// The exposition of `metrics` with `figures` as the running configuration, as `/metrics`
    /// serves it.
    fn exposition_with(metrics: &Arc<Metrics>, figures: Vec<ZoneFigures>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Exposition::new(metrics.clone(), move || {
            figures.clone()
        })));
        text(&registry)
    }

    fn exposition(metrics: &Arc<Metrics>) -> String {
        exposition_with(metrics, Vec::new())
    }

    fn answer<'a>(
        transport: Transport,
        query: &'a Query<'a>,
        response: &'a [u8],
        plugin: Plugin,
        cache: CacheUse,
        elapsed: Duration,
    ) -> Answer<'a> {
        Answer {
            transport,
            query,
            response,
            plugin,
            cache,
            elapsed,
        }
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
    fn a_known_sequence_gives_exact_coredns_series() {
        let local: SocketAddr = "169.254.20.10:53".parse().unwrap();
        let metrics = Arc::new(Metrics::new(&[local], true));
        let base = metrics.zone_slots(&["cluster.local.".to_owned()]);
        let worker = metrics.worker(local);
        let labels = worker.series(base);

        let a = query("a.default.svc.cluster.local.", 1, None);
        let a = Query::parse(&a).unwrap();
        let aaaa = query("a.default.svc.cluster.local.", 28, Some((1232, true)));
        let aaaa = Query::parse(&aaaa).unwrap();
        // Miss (answered on the async path), then two hits, then an NXDOMAIN hit over AAAA.
        metrics.shared(labels).answered(
            labels,
            answer(
                Transport::Udp,
                &a,
                &response(0, 80),
                Plugin::Cache,
                CacheUse::Miss,
                Duration::from_millis(3),
            ),
        );
        for _ in 0..2 {
            worker.answered(
                labels,
                answer(
                    Transport::Udp,
                    &a,
                    &response(0, 80),
                    Plugin::Cache,
                    CacheUse::Hit(Class::Success),
                    Duration::ZERO,
                ),
            );
        }
        worker.answered(
            labels,
            answer(
                Transport::Udp,
                &aaaa,
                &response(3, 120),
                Plugin::Cache,
                CacheUse::Hit(Class::Denial),
                Duration::ZERO,
            ),
        );
        worker.prefetch(labels);
        // A name no block serves.
        let refused = worker.dropped();
        worker.answered(
            refused,
            answer(
                Transport::Tcp,
                &a,
                &response(5, 40),
                Plugin::None,
                CacheUse::Bypassed,
                Duration::ZERO,
            ),
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
        let metrics = Arc::new(Metrics::new(&[local], true));
        let labels = metrics
            .worker(local)
            .series(metrics.zone_slots(&[".".to_owned()]));
        let q = query("example.com.", 1, None);
        let q = Query::parse(&q).unwrap();
        let shared = metrics.shared(labels);
        shared.answered(
            labels,
            answer(
                Transport::Udp,
                &q,
                &response(0, 60),
                Plugin::Cache,
                CacheUse::StaleHit(Class::Success),
                Duration::ZERO,
            ),
        );
        shared.answered(
            labels,
            answer(
                Transport::Udp,
                &q,
                &response(0, 60),
                Plugin::Cache,
                CacheUse::StaleMiss,
                Duration::from_secs(2),
            ),
        );
        shared.answered(
            labels,
            answer(
                Transport::Udp,
                &q,
                &response(2, 30),
                Plugin::None,
                CacheUse::Miss,
                Duration::from_secs(2),
            ),
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
        let metrics = Arc::new(Metrics::new(&[local], false));
        let worker = metrics.worker(local);
        let labels = worker.series(metrics.zone_slots(&[".".to_owned()]));
        let q = query("example.com.", 1, None);
        let q = Query::parse(&q).unwrap();
        worker.answered(
            labels,
            answer(
                Transport::Udp,
                &q,
                &response(0, 60),
                Plugin::Cache,
                CacheUse::Hit(Class::Success),
                Duration::ZERO,
            ),
        );
        let text = exposition(&metrics);
        assert!(
            lines(&text, "coredns_dns_requests_total").is_empty(),
            "{text}"
        );
        assert!(lines(&text, "coredns_cache_hits_total").is_empty());
    }

    #[test]
    fn zone_figures_become_the_cache_and_single_flight_families() {
        let metrics = Arc::new(Metrics::default());
        let listen: Vec<SocketAddr> = vec![
            "169.254.20.10:53".parse().unwrap(),
            "10.96.0.10:53".parse().unwrap(),
        ];
        let figures = |id, evictions| {
            vec![
                ZoneFigures {
                    listen: listen.clone(),
                    scheme: "dns",
                    zones: vec!["cluster.local.".to_owned(), "in-addr.arpa.".to_owned()],
                    cache: Some(CacheFigures {
                        id,
                        stats: Stats {
                            success: 3,
                            denial: 2,
                            servfail: 1,
                            bytes: 4096,
                            evictions,
                        },
                        capacity_bytes: 1 << 20,
                    }),
                    fetches: 2,
                    waiters: 5,
                },
                ZoneFigures {
                    listen: vec!["169.254.20.10:53".parse().unwrap()],
                    scheme: "dns",
                    zones: vec![".".to_owned()],
                    cache: None,
                    fetches: 0,
                    waiters: 0,
                },
            ]
        };
        let text = exposition_with(&metrics, figures(1, 7));
        let zones = r#"zones="cluster.local.,in-addr.arpa.""#;
        for (server, _) in [("dns://169.254.20.10:53", 0), ("dns://10.96.0.10:53", 1)] {
            assert!(
                text.contains(&format!(
                    r#"coredns_cache_entries{{server="{server}",type="success",{zones},view=""}} 3"#
                )),
                "{text}"
            );
            assert!(text.contains(&format!(
                r#"coredns_cache_entries{{server="{server}",type="denial",{zones},view=""}} 3"#
            )));
        }
        assert!(text.contains(&format!(
            r#"coredns_cache_evictions_total{{server="dns://169.254.20.10:53",type="all",{zones},view=""}} 7"#
        )));
        assert!(text.contains(&format!("nodedns_cache_bytes{{{zones}}} 4096\n")));
        assert!(text.contains(&format!(
            "nodedns_cache_capacity_bytes{{{zones}}} 1048576\n"
        )));
        assert!(text.contains(&format!("nodedns_singleflight_fetches{{{zones}}} 2\n")));
        assert!(text.contains(&format!("nodedns_singleflight_waiters{{{zones}}} 5\n")));
        assert!(text.contains("nodedns_singleflight_waiters{zones=\".\"} 0\n"));
        assert!(
            !text.contains("nodedns_cache_bytes{zones=\".\"}"),
            "a block without cache has no cache figures"
        );
    }

    #[test]
    fn evictions_stay_monotonic_when_a_reload_replaces_the_cache() {
        let metrics = Arc::new(Metrics::default());
        let exposition = Exposition::new(metrics, Vec::new);
        let zone = |id, evictions| ZoneFigures {
            listen: vec!["127.0.0.1:53".parse().unwrap()],
            scheme: "dns",
            zones: vec![".".to_owned()],
            cache: Some(CacheFigures {
                id,
                stats: Stats {
                    evictions,
                    ..Stats::default()
                },
                capacity_bytes: 1,
            }),
            ..ZoneFigures::default()
        };
        let mut ledger = exposition.evictions.lock().unwrap();
        let key = ("dns://127.0.0.1:53".to_owned(), ".".to_owned());
        assert_eq!(ledger.update(&[zone(1, 10)])[&key], 10);
        assert_eq!(
            ledger.update(&[zone(1, 12)])[&key],
            12,
            "the same cache counts on"
        );
        assert_eq!(
            ledger.update(&[zone(2, 1)])[&key],
            13,
            "a new cache adds to the old one's last count"
        );
        assert_eq!(ledger.update(&[zone(2, 4)])[&key], 16);
    }
}
