//! Which client does what to DNS: per-client figures for the heaviest clients, abuse signals,
//! and their metrics, in memory and series that stay the same size whatever the traffic.
//!
//! - [`Tracker`]: what one counter block (a UDP worker, or the block the TCP listeners and the
//!   miss path share) records per answered query: a [`sketch::Table`] of clients in atomic cells
//!   (a UDP worker is its table's only writer).
//! - [`Board`]: every tracker, the settings, the cluster domain, and once for the process,
//!   behind one lock, what only some queries touch: the most asked (client, name) pairs and the
//!   per-minute checks ([`sketch::Watches`]). It merges the trackers at scrape time into a
//!   [`View`] (the top K clients, heaviest first, and everything else as `other`) and encodes
//!   it (a prometheus-client collector).
//! - [`name`]: what a name says (long, random-looking, under the cluster domain).
//!
//! What the hit path pays ([`Tracker::record`]): a hash of the address, at most
//! [`sketch::WAYS`] compares, one relaxed load and store (a second for an NXDOMAIN, with a
//! compare of the name's tail to the cluster domain), a label walk only for names longer than
//! the label limit, and a test of the count's low bits (the names sample). It takes no lock
//! and reads no clock. One query in `--clients-sample` goes to the names sketch, under the
//! lock. What needs the whole name (randomness of the labels, distinct names under a zone)
//! runs for queries that went upstream only: a random or new name is a cache miss by nature,
//! and the miss path costs a hundred times more anyway.

pub mod name;
pub mod sketch;

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::logging::RateLimit;
use sketch::{Figures, Names, Row, Table, Watch, Watches, at};

/// `nodedns run`'s per-client flags (there is no Corefile directive for them: CoreDNS has none,
/// and a Corefile means what it means to CoreDNS).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct Args {
    /// Clients with their own series and `top` rows, the heaviest first (0 turns per-client
    /// tracking off).
    #[arg(
        long,
        default_value_t = 10,
        value_name = "K",
        env = "NODEDNS_CLIENTS_TOP"
    )]
    pub clients_top: usize,

    /// The names panel counts one query in N of each client (a power of two; 1: every
    /// query), and scales its counts by N.
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = power_of_two)]
    pub clients_sample: u32,

    /// A query with a label longer than this many bytes counts as long.
    #[arg(long, default_value_t = 50, value_name = "BYTES")]
    pub clients_long_label: usize,

    /// A query with a name longer than this many bytes counts as long.
    #[arg(long, default_value_t = 150, value_name = "BYTES")]
    pub clients_long_name: usize,

    /// A label of 20 bytes or more is random-looking when its entropy is at least this share of
    /// what a random label of its length and alphabet has (docs/metrics.md).
    #[arg(long, default_value_t = 0.9, value_name = "RATIO", value_parser = ratio)]
    pub clients_randomness: f64,

    /// Log (once a minute per client, rate-limited) and count a client that sends this many
    /// long queries in a minute (0: never).
    #[arg(long, default_value_t = 60, value_name = "N")]
    pub clients_alert_long: u32,

    /// ... that sends this many random-looking names upstream in a minute (0: never).
    #[arg(long, default_value_t = 60, value_name = "N")]
    pub clients_alert_random: u32,

    /// ... that asks this many distinct names under one zone in a minute (0: never).
    #[arg(long, default_value_t = 300, value_name = "N")]
    pub clients_alert_distinct: u32,

    /// The cluster domain, for search-path misses. Default: the zone of the configuration's
    /// first server block that is neither `.` nor a reverse zone (`cluster.local.` in
    /// node-local-dns's Corefile).
    #[arg(long, value_name = "DOMAIN", value_parser = domain)]
    pub cluster_domain: Option<String>,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            clients_top: 10,
            clients_sample: 64,
            clients_long_label: 50,
            clients_long_name: 150,
            clients_randomness: 0.9,
            clients_alert_long: 60,
            clients_alert_random: 60,
            clients_alert_distinct: 300,
            cluster_domain: None,
        }
    }
}

fn power_of_two(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(v) if v.is_power_of_two() && v <= 1 << 16 => Ok(v),
        _ => Err(format!("`{text}` is not a power of two from 1 to 65536")),
    }
}

fn ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("`{text}` is not a ratio in (0, 1]")),
    }
}

fn domain(text: &str) -> Result<String, String> {
    let wire = name::wire(text).ok_or_else(|| format!("`{text}` is not a domain name"))?;
    if wire.len() <= 1 {
        return Err("the cluster domain cannot be the root".to_owned());
    }
    Ok(name::text(&wire))
}

/// The signals a client can cross a threshold of (`signal` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Long = 0,
    Random = 1,
    Distinct = 2,
}

const SIGNALS: [(Signal, &str); 3] = [
    (Signal::Long, "long_names"),
    (Signal::Random, "random_names"),
    (Signal::Distinct, "distinct_names"),
];

/// How often one signal's alerts are logged at most (each is counted).
const ALERT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// How a query went through its block, for the cache figures and the upstream-only analysis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Answered from the cache.
    Hit,
    /// Looked up, not found (or expired): went upstream.
    Miss,
    /// A block without cache: went upstream.
    Uncached,
    /// Answered by nodedns itself (REFUSED, a plugin after the cache, SERVFAIL at the end of
    /// the chain): nothing went upstream.
    Local,
}

/// One answered query, as a tracker sees it.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub client: IpAddr,
    /// The question's name, wire form, as the client wrote it.
    pub qname: &'a [u8],
    /// The answer's RCODE (header, 4 bits).
    pub rcode: u8,
    pub path: Path,
}

/// The address as a table key: IPv6, IPv4 mapped.
#[inline]
fn key(ip: IpAddr) -> u128 {
    match ip {
        // `::ffff:a.b.c.d` without going through the octets of an `Ipv6Addr`.
        IpAddr::V4(v4) => 0xffff << 32 | u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn address(key: u128) -> IpAddr {
    let v6 = Ipv6Addr::from(key);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

/// What every tracker reads and the board owns.
#[derive(Debug)]
struct Common {
    args: Args,
    seed: u64,
    /// Minutes count from here.
    base: Instant,
    alerts: [AtomicU64; 3],
    alert_logs: [RateLimit; 3],
    /// The cluster domain, wire form (`[0]`: none). Fixed for the life of the process: the hit
    /// path reads it for every NXDOMAIN, and a cluster's domain does not change.
    domain: Vec<u8>,
    /// What only sampled, long and upstream queries touch: one for the process, whatever the
    /// number of trackers.
    cold: Mutex<Cold>,
}

impl Common {
    fn minute(&self, now: Instant) -> u32 {
        (now.saturating_duration_since(self.base).as_secs() / 60) as u32
    }

    fn threshold(&self, signal: Signal) -> u32 {
        match signal {
            Signal::Long => self.args.clients_alert_long,
            Signal::Random => self.args.clients_alert_random,
            Signal::Distinct => self.args.clients_alert_distinct,
        }
    }

    /// `client` reached `value` of `signal` this minute: counted and logged (rate-limited) the
    /// first time in the minute it reaches the threshold.
    fn check(&self, watch: &mut Watch, signal: Signal, value: u32, zone: &[u8], now: Instant) {
        let threshold = self.threshold(signal);
        let bit = 1u8 << signal as u8;
        if threshold == 0 || value < threshold || watch.alerted & bit != 0 {
            return;
        }
        watch.alerted |= bit;
        self.alerts[signal as usize].fetch_add(1, Ordering::Relaxed);
        let Some(held_back) = self.alert_logs[signal as usize].admit(now) else {
            return;
        };
        let (_, signal_name) = SIGNALS[signal as usize];
        tracing::warn!(
            client = %address(watch.addr),
            signal = signal_name,
            per_minute = value,
            threshold,
            zone = %name::text(zone),
            similar_alerts_not_logged = held_back,
            "a client crossed an abuse threshold (logged at most every {}s per signal)",
            ALERT_LOG_INTERVAL.as_secs()
        );
    }
}

/// What only sampled, long and upstream queries touch, under the board's lock.
#[derive(Debug)]
struct Cold {
    names: Names,
    /// Per client: its per-minute counts and its busiest zone.
    watches: Watches,
}

/// What one recorder records into. See the module documentation for the cost.
#[derive(Debug)]
pub struct Tracker {
    table: Table,
    /// Only one thread records (a UDP worker): counts are loads and stores.
    single_writer: bool,
    /// `--clients-sample` less one: the low bits of a count that say "sample this one".
    sample_mask: u64,
    /// `--clients-long-label`, `--clients-long-name`: here, not behind `common`, because every
    /// query reads them.
    long_label: usize,
    long_name: usize,
    common: Arc<Common>,
}

impl Tracker {
    /// Records one answered query from `client`: `qname` as asked (wire form), the answer's
    /// `rcode`, and how it went through its block. Inlined: it runs for every answer, hits
    /// included.
    #[inline(always)]
    pub fn record(&self, client: IpAddr, qname: &[u8], rcode: u8, path: Path) {
        // One branch on the kind of table, not one per count.
        if self.single_writer {
            self.record_with::<true>(client, qname, rcode, path, Instant::now);
        } else {
            self.record_with::<false>(client, qname, rcode, path, Instant::now);
        }
    }

    /// [`Tracker::record`] at a given time.
    pub fn record_at(&self, seen: &Seen<'_>, now: Instant) {
        let Seen {
            client,
            qname,
            rcode,
            path,
        } = *seen;
        if self.single_writer {
            self.record_with::<true>(client, qname, rcode, path, || now);
        } else {
            self.record_with::<false>(client, qname, rcode, path, || now);
        }
    }

    /// The clock is read only when a figure needs it: a long query or one that went upstream.
    #[inline(always)]
    fn record_with<const SINGLE_WRITER: bool>(
        &self,
        client: IpAddr,
        qname: &[u8],
        rcode: u8,
        path: Path,
        now: impl FnOnce() -> Instant,
    ) {
        let addr = key(client);
        let slot = self.table.find::<SINGLE_WRITER>(addr);
        // Only what changes is written: most queries are hits of short names, answered NOERROR,
        // and count in one cell.
        let (count, upstream) = match path {
            Path::Hit => (at::HITS, false),
            Path::Miss => (at::MISSES, true),
            Path::Uncached => (at::OTHER, true),
            Path::Local => (at::OTHER, false),
        };
        // The names sketch takes every `--clients-sample`th query of each client and way
        // through (a power of two: the count's low bits say when).
        let sampled = slot.add::<SINGLE_WRITER>(count, 1) & self.sample_mask == 0;
        if rcode == 3 {
            slot.add::<SINGLE_WRITER>(at::NXDOMAIN, 1);
            if name::is_under(qname, &self.common.domain) {
                slot.add::<SINGLE_WRITER>(at::SEARCH_MISSES, 1);
            }
        }
        let long = name::is_long(qname, self.long_label, self.long_name);
        if long {
            slot.add::<SINGLE_WRITER>(at::LONG, 1);
        }
        if sampled || long || upstream {
            let now = (long || upstream).then(now);
            self.slow::<SINGLE_WRITER>(qname, addr, slot.index, sampled, long, upstream, now);
        }
    }

    /// The names sample, and what long and upstream queries are checked for.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn slow<const SINGLE_WRITER: bool>(
        &self,
        qname: &[u8],
        addr: u128,
        slot: usize,
        sampled: bool,
        long: bool,
        upstream: bool,
        now: Option<Instant>,
    ) {
        let common = &*self.common;
        let args = &common.args;
        let mut cold = common.cold.lock().unwrap_or_else(PoisonError::into_inner);
        let Cold { names, watches } = &mut *cold;
        if sampled {
            let hash = name::hash(common.seed, qname);
            names.count(addr, hash, qname, u64::from(args.clients_sample));
        }
        let Some(now) = now else {
            return;
        };
        let c = watches.count(addr);
        let minute = common.minute(now);
        c.roll(minute);
        let zone = name::parent(qname);
        if long {
            c.long_this_minute = c.long_this_minute.saturating_add(1);
            let value = c.long_this_minute;
            common.check(c, Signal::Long, value, zone, now);
        }
        if !upstream {
            return;
        }
        if name::is_random(qname, args.clients_randomness) {
            self.table.add::<SINGLE_WRITER>(slot, at::RANDOM, 1);
            c.random_this_minute = c.random_this_minute.saturating_add(1);
            let value = c.random_this_minute;
            common.check(c, Signal::Random, value, zone, now);
        }
        let distinct = c.distinct(
            name::hash(common.seed, zone),
            zone,
            name::hash(common.seed, qname),
            minute,
        );
        common.check(c, Signal::Distinct, distinct, zone, now);
    }
}

/// Every tracker and what they share.
#[derive(Debug)]
pub struct Board {
    common: Arc<Common>,
    /// The tracker the TCP connections and the async answers share (`None` when tracking is
    /// off).
    shared: Option<Arc<Tracker>>,
    trackers: Mutex<Vec<Arc<Tracker>>>,
}

impl Default for Board {
    /// Tracking off.
    fn default() -> Self {
        Board::new(Args {
            clients_top: 0,
            ..Args::default()
        })
    }
}

/// One client of the [`View`].
#[derive(Debug, Clone, PartialEq)]
pub struct Client {
    pub addr: IpAddr,
    /// Counted since the client took its slot (queries at least this many: see
    /// [`sketch::Row::error`]).
    pub figures: Figures,
    /// The zone it asks the most distinct names under, and how many per minute (the larger of
    /// the last complete minute and this one so far).
    pub zone: Option<(String, u32)>,
    /// Its most asked names with their estimated counts, the most asked first.
    pub names: Vec<(String, u64)>,
}

/// The merged figures at one moment.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct View {
    /// At most K, the heaviest first.
    pub clients: Vec<Client>,
    /// Every query not in `clients`' figures.
    pub other: Figures,
    /// Alerts per signal, in [`SIGNALS`] order.
    pub alerts: [u64; 3],
}

/// Names shown per client.
pub const NAMES_PER_CLIENT: usize = 5;

/// Table slots per client shown: a node's pods all fit (128 slots at K = 10), so their figures
/// are exact; under a flood of addresses the heavy ones still stay.
const SLOTS_PER_CLIENT: usize = 12;

impl Board {
    /// The board for `args`; the cluster domain is `--cluster-domain` (the settings fill it in
    /// from the configuration when the flag is not given), for the life of the process.
    pub fn new(args: Args) -> Self {
        let base = Instant::now();
        let domain = args
            .cluster_domain
            .as_deref()
            .and_then(name::wire)
            .unwrap_or_else(|| vec![0]);
        let seed = rand::random();
        let k = args.clients_top;
        let cold = Cold {
            names: Names::new(k * NAMES_PER_CLIENT * 2),
            watches: Watches::new(k * SLOTS_PER_CLIENT, seed),
        };
        let mut board = Board {
            common: Arc::new(Common {
                args,
                seed,
                base,
                alerts: Default::default(),
                alert_logs: std::array::from_fn(|_| RateLimit::new(ALERT_LOG_INTERVAL, base)),
                domain,
                cold: Mutex::new(cold),
            }),
            shared: None,
            trackers: Mutex::new(Vec::new()),
        };
        board.shared = board.tracker(false);
        board
    }

    /// A tracker for one UDP worker, which only that worker's thread may record into; `None`
    /// when tracking is off (`--clients-top 0`).
    pub fn worker(&self) -> Option<Arc<Tracker>> {
        self.tracker(true)
    }

    /// The tracker every other recorder shares (TCP connections, answers after a miss).
    pub fn shared(&self) -> Option<&Tracker> {
        self.shared.as_deref()
    }

    /// A tracker for one more recorder (`single_writer`: only one thread records into it).
    fn tracker(&self, single_writer: bool) -> Option<Arc<Tracker>> {
        let args = &self.common.args;
        if args.clients_top == 0 {
            return None;
        }
        let tracker = Arc::new(Tracker {
            table: Table::new(args.clients_top * SLOTS_PER_CLIENT, self.common.seed),
            single_writer,
            sample_mask: u64::from(args.clients_sample) - 1,
            long_label: args.clients_long_label,
            long_name: args.clients_long_name,
            common: self.common.clone(),
        });
        self.trackers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(tracker.clone());
        Some(tracker)
    }

    /// The cluster domain in use, `None` when there is none.
    pub fn domain(&self) -> Option<String> {
        let domain = &self.common.domain;
        (domain.len() > 1).then(|| name::text(domain))
    }

    fn trackers(&self) -> Vec<Arc<Tracker>> {
        self.trackers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every tracker merged, at `now`.
    pub fn view(&self, now: Instant) -> View {
        let k = self.common.args.clients_top;
        let minute = self.common.minute(now);
        let mut rows: Vec<Row> = Vec::new();
        let mut totals = Figures::default();
        for tracker in self.trackers() {
            let own = tracker.table.rows();
            totals.add(&tracker.table.evicted());
            for row in &own {
                totals.add(&row.own());
            }
            rows.extend(own);
        }
        // The same client in several trackers (UDP workers) is one row.
        rows.sort_unstable_by_key(|r| r.addr);
        let mut clients: Vec<Row> = Vec::with_capacity(rows.len());
        for row in rows {
            match clients.last_mut() {
                Some(last) if last.addr == row.addr => {
                    last.figures.add(&row.figures);
                    last.error += row.error;
                }
                _ => clients.push(row),
            }
        }
        // Heaviest first by the upper bound (space-saving's order), then by address.
        clients.sort_by(|x, y| {
            y.figures
                .queries
                .cmp(&x.figures.queries)
                .then_with(|| x.addr.cmp(&y.addr))
        });
        clients.truncate(k);
        let cold = self
            .common
            .cold
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut shown = Figures::default();
        let clients = clients
            .into_iter()
            .map(|row| {
                let figures = row.own();
                shown.add(&figures);
                let zone = cold
                    .watches
                    .get(row.addr)
                    .filter(|w| !w.zone.name.get().is_empty())
                    .map(|w| (name::text(w.zone.name.get()), w.per_minute(minute)));
                let mut names: Vec<(String, u64)> = cold
                    .names
                    .used()
                    .filter(|p| p.addr == row.addr)
                    .map(|p| (name::text(p.name.get()), p.count))
                    .collect();
                names.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                names.truncate(NAMES_PER_CLIENT);
                Client {
                    addr: address(row.addr),
                    figures,
                    zone,
                    names,
                }
            })
            .collect();
        drop(cold);
        View {
            clients,
            other: totals.minus(&shown),
            alerts: std::array::from_fn(|i| self.common.alerts[i].load(Ordering::Relaxed)),
        }
    }

    /// Writes the per-client families: K clients and `other` each, whatever the traffic.
    pub fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        if self.common.args.clients_top == 0 {
            return Ok(());
        }
        let view = self.view(Instant::now());
        let rows: Vec<(String, &Figures)> = view
            .clients
            .iter()
            .map(|c| (c.addr.to_string(), &c.figures))
            .chain(std::iter::once(("other".to_owned(), &view.other)))
            .collect();
        type Pick = fn(&Figures) -> u64;
        let families: [(&str, &str, Pick); 7] = [
            (
                "nodedns_client_queries",
                "Queries answered, by client: the heaviest --clients-top addresses, the rest as `other`.",
                |f| f.queries,
            ),
            (
                "nodedns_client_nxdomain",
                "NXDOMAIN answers, by client.",
                |f| f.nxdomain,
            ),
            (
                "nodedns_client_search_path_nxdomain",
                "NXDOMAIN answers for names under the cluster domain (search-path expansions), by client.",
                |f| f.search_misses,
            ),
            (
                "nodedns_client_cache_hits",
                "Answers from the cache, by client.",
                |f| f.hits,
            ),
            (
                "nodedns_client_cache_requests",
                "Queries looked up in a cache, by client.",
                |f| f.lookups,
            ),
            (
                "nodedns_client_long_names",
                "Queries with a label over --clients-long-label or a name over --clients-long-name bytes, by client.",
                |f| f.long,
            ),
            (
                "nodedns_client_random_names",
                "Queries sent upstream with a random-looking label (--clients-randomness), by client.",
                |f| f.random,
            ),
        ];
        for (name, help, pick) in families {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (client, figures) in &rows {
                counter(&mut m, &[("client", client.as_str())], pick(figures))?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "nodedns_client_zone_distinct_names",
            "Distinct names a client asked upstream under its most asked zone in a minute (HyperLogLog, ±13 %).",
            None,
            MetricType::Gauge,
        )?;
        // One gauge per shown client, so the series count stays fixed: a client nodedns holds
        // no watch of (it asked nothing upstream, or a flood of addresses took its watch) has
        // the empty zone and 0.
        for c in &view.clients {
            let (zone, per_minute) = c.zone.as_ref().map_or(("", 0), |(z, n)| (z.as_str(), *n));
            let client = c.addr.to_string();
            let labels = [("client", client.as_str()), ("zone", zone)];
            m.encode_family(&labels)?
                .encode_gauge(&u64::from(per_minute))?;
        }
        let mut m = encoder.encode_descriptor(
            "nodedns_client_name_queries",
            "Queries of a client's most asked names (one query in --clients-sample counted, times that number).",
            None,
            MetricType::Counter,
        )?;
        for c in &view.clients {
            let client = c.addr.to_string();
            for (name, count) in &c.names {
                let labels = [("client", client.as_str()), ("name", name.as_str())];
                counter(&mut m, &labels, *count)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "nodedns_client_alerts",
            "Times a client crossed an abuse threshold (once a minute per client and signal at most).",
            None,
            MetricType::Counter,
        )?;
        for (i, (_, signal)) in SIGNALS.iter().enumerate() {
            counter(&mut m, &[("signal", *signal)], view.alerts[i])?;
        }
        Ok(())
    }
}

fn counter(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: u64) -> fmt::Result {
    m.encode_family(labels)?
        .encode_counter::<NoLabelSet, u64, u64>(&v, None)
}

/// The board as a collector for the registry.
#[derive(Debug)]
pub struct Collector(pub Arc<Board>);

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        self.0.encode(&mut encoder)
    }
}

#[cfg(test)]
mod tests;
