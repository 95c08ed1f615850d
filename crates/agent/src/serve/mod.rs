//! Serving DNS: the listeners and the request pipeline.
//!
//! - [`udp`]: one blocking OS thread per listen address and worker, each with its own
//!   `SO_REUSEPORT` socket, reading and answering in batches (`recvmmsg`/`sendmmsg`). Cache hits
//!   never leave that thread and await nothing; its misses resolve on the thread's own
//!   current-thread runtime.
//! - [`tcp`]: tokio tasks, one per client connection, pipelined; DNS over TLS (`tls://` blocks
//!   with `tls`) is the same with a TLS handshake in front.
//! - [`https`]: DNS over HTTPS (RFC 8484) for `https://` blocks, HTTP/2 and HTTP/1.1 (cleartext
//!   HTTP/1.1 without `tls`), each request answered through the pipeline as a TCP query is.
//! - [`pipeline`]: what both share: parse, route, cache lookup, and for misses the async path
//!   (single-flight, upstream, insert, answer every waiter); then, for every answer, count it,
//!   add it to its client's figures ([`crate::clients`]), tap it ([`crate::dnstap`]) and log
//!   it.
//! - [`request`]: what a query carries through the pipeline (its client, its labels, what
//!   answered it).
//! - [`cascade`]: the ndots cascade prefetch (a first search-list step's NXDOMAIN starts the
//!   later steps' fetches).
//! - [`querylog`] (the `log` directive), [`errors`] (the `errors` directive), [`loopcheck`] (the
//!   `loop` directive): the directives that act on the request path.
//! - [`sibling`]: another instance serving the same addresses (a second DaemonSet): found at
//!   shutdown, handed the queries, left the host plumbing.
//!
//! Data-path code reads one immutable [`Snapshot`] per batch (arc-swap); reload publishes a new
//! one and never blocks a reader.

pub mod cascade;
pub mod dns64;
pub mod errors;
pub mod https;
pub mod loopcheck;
pub mod pipeline;
pub mod querylog;
pub mod ratelimit;
pub mod request;
pub mod sibling;
pub mod tcp;
pub mod udp;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use nodedns_cache::{Cache, Flights};
use nodedns_upstream::Group;

use crate::clients;
use crate::config::{Config, Route, Router, Scheme, Server, Takes};
use crate::dnstap::{self, Tap};
use crate::metrics::{CacheFigures, Metrics, ZoneFigures};
use errors::Errors;
use pipeline::Waiter;
use querylog::QueryLog;
pub use request::{Client, Labels, Proto, Source};

/// Waiters queued behind one key's upstream fetch, at most. Beyond it a query gets SERVFAIL at
/// once: a flood of one name must not queue unbounded memory.
pub const MAX_WAITERS_PER_KEY: usize = 4096;

/// One server block, ready to serve: its config and the live objects built from it.
#[derive(Debug)]
pub struct Zone {
    pub server: Server,
    /// Index of this block in the configuration (its metrics labels).
    pub label: usize,
    pub cache: Option<Arc<Cache>>,
    /// Names `cache` for the life of the process (the metrics count its evictions under it).
    pub cache_id: u64,
    /// In-progress upstream fetches; lives as long as the cache so a reload that keeps the cache
    /// keeps the fetches it is waiting on.
    pub flights: Arc<Flights<Waiter>>,
    /// Its `forward` lines, in file order (`server.forwards`'s), each with its upstream group.
    pub forwards: Vec<Forwarder>,
    /// Its failed upstream exchanges, logged if it has `errors`.
    pub errors: Errors,
    /// Its `dnstap` sinks.
    pub taps: Vec<Arc<Tap>>,
    /// Its plugins after the cache other than `forward` (`hosts`, `whoami`), serving.
    pub plugins: crate::plugin::Live,
}

/// One `forward` line of a block, serving.
#[derive(Debug)]
pub struct Forwarder {
    /// The names it takes.
    pub takes: Takes,
    /// Its `next` rcodes: a reply with one of them passes the query on to a later line.
    pub next: Vec<u16>,
    /// Its upstreams: their pool, health checks and failover.
    pub group: Arc<Group>,
}

impl Zone {
    /// The first of the block's `forward` lines from index `start` on that takes `qname` (wire
    /// form, lowercase), as CoreDNS's chain of forward plugins passes a name on: its index.
    /// (The per-query path asks the [`Router`] only whether one does; this runs on a miss.)
    pub fn forward_for(&self, qname: &[u8], start: usize) -> Option<usize> {
        (start..self.forwards.len())
            .find(|&i| self.forwards[i].takes.takes(qname, None) == Some(true))
    }

    /// The upstream group of the first `forward` line that takes `qname`.
    pub fn group_for(&self, qname: &[u8]) -> Option<&Arc<Group>> {
        self.forward_for(qname, 0).map(|i| &self.forwards[i].group)
    }
}

/// Why a snapshot could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// One of a block's `forward` lines has upstream settings the pool refuses.
    #[error("forward of {zones}")]
    Forward {
        zones: String,
        #[source]
        source: nodedns_upstream::ConfigError,
    },
    /// A block's `dnstap` writer could not start (its thread).
    #[error("dnstap {sink} of {zones}")]
    Dnstap {
        zones: String,
        sink: String,
        #[source]
        source: std::io::Error,
    },
}

/// Everything the data path reads, swapped as a whole on reload.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Arc<Config>,
    pub router: Router,
    /// One per server block, in configuration order (a [`Route`] indexes it).
    pub zones: Vec<Arc<Zone>>,
}

impl Snapshot {
    /// Builds the data-path snapshot for `config`. A block is the same block as one of
    /// `previous` when it serves the same zones on the same addresses (the configuration never
    /// holds two such blocks). Blocks whose cache policy and `forward` are unchanged keep their
    /// cache (and its in-flight fetches); a block whose upstreams changed starts with an empty
    /// one, so it never answers from what the old upstreams said. Unchanged upstreams keep
    /// their pools, unchanged `dnstap` directives their writers (and connections), unchanged
    /// plugins their state (`hosts` its entries and its poller). Each block's metric label slots
    /// come from `metrics`, its taps count in `taps`. Must be called inside the tokio runtime
    /// (upstream pools spawn their reapers, `hosts` its poller).
    pub fn build(
        config: Arc<Config>,
        previous: Option<&Snapshot>,
        upstream_metrics: &nodedns_upstream::Metrics,
        plugin_metrics: &crate::plugin::Metrics,
        metrics: &Metrics,
        taps: &dnstap::Metrics,
    ) -> Result<Snapshot, SnapshotError> {
        let mut zones = Vec::with_capacity(config.servers.len());
        for server in &config.servers {
            let label = metrics.zone_slots(&server.zones);
            let same =
                |z: &&Arc<Zone>| z.server.zones == server.zones && z.server.listen == server.listen;
            let old = previous.and_then(|p| p.zones.iter().find(same));
            let new_flights = || Arc::new(Flights::new(MAX_WAITERS_PER_KEY));
            let (cache, cache_id, flights) = match (old, &server.cache) {
                (Some(old), Some(policy))
                    if old.server.cache.as_ref() == Some(policy)
                        && old.server.forwards == server.forwards
                        && old.cache.is_some() =>
                {
                    (old.cache.clone(), old.cache_id, old.flights.clone())
                }
                (_, Some(policy)) => (
                    Some(Arc::new(Cache::new(policy.clone()))),
                    next_cache_id(),
                    new_flights(),
                ),
                (_, None) => (None, 0, new_flights()),
            };
            let forwards = forwarders(server, old, upstream_metrics)?;
            let taps = match old {
                Some(old) if old.server.dnstap == server.dnstap => old.taps.clone(),
                _ => server
                    .dnstap
                    .iter()
                    .map(|tap| {
                        Tap::start(tap.clone(), taps).map_err(|source| SnapshotError::Dnstap {
                            zones: server.zones.join(" "),
                            sink: tap.sink.to_string(),
                            source,
                        })
                    })
                    .collect::<Result<_, _>>()?,
            };
            zones.push(Arc::new(Zone {
                label,
                cache,
                cache_id,
                flights,
                forwards,
                errors: Errors::new(&server.zones, server.errors),
                taps,
                plugins: server.chain.start(
                    old.map(|o| &o.plugins),
                    plugin_metrics,
                    &server.listen.first().map_or_else(String::new, |a| {
                        crate::metrics::scheme_label(server.scheme.as_str(), *a)
                    }),
                ),
                server: server.clone(),
            }));
        }
        let router = Router::new(&config.servers);
        Ok(Snapshot {
            config,
            router,
            zones,
        })
    }

    /// The block serving `qname` (lowercase wire form) on `local`, and whether one of its
    /// `forward` lines takes the name.
    pub fn route(&self, qname: &[u8], local: SocketAddr) -> Option<(&Arc<Zone>, Route)> {
        let route = self.router.route(qname, local)?;
        Some((self.zones.get(route.server)?, route))
    }

    /// The TLS configuration of the blocks served on `local` (the current `tls` directive of a
    /// `tls://` or `https://` block), if they have one.
    pub fn tls(&self, local: SocketAddr) -> Option<Arc<rustls::ServerConfig>> {
        self.config
            .servers
            .iter()
            .filter(|s| s.listen.contains(&local))
            .find_map(|s| s.tls.as_ref())
            .map(|tls| tls.config.clone())
    }

    /// What each block reports to the metrics at scrape time.
    pub fn figures(&self) -> Vec<ZoneFigures> {
        self.zones
            .iter()
            .map(|zone| {
                let flights = zone.flights.sizes();
                ZoneFigures {
                    listen: zone.server.listen.clone(),
                    scheme: zone.server.scheme.as_str(),
                    zones: zone.server.zones.clone(),
                    cache: zone.cache.as_ref().map(|cache| CacheFigures {
                        id: zone.cache_id,
                        stats: cache.stats(),
                        capacity_bytes: cache.policy().capacity_bytes,
                    }),
                    fetches: flights.fetches as u64,
                    waiters: flights.waiters as u64,
                }
            })
            .collect()
    }
}

/// How one listen address is served, as its blocks' scheme and `tls` directive say (the
/// configuration gives every address one: `config::check_duplicates`).
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// DNS over UDP and TCP (`dns://`).
    Dns,
    /// DNS over TCP only: a `tls://` block without `tls`, as CoreDNS serves it.
    Tcp,
    /// DNS over TLS (`tls://` with `tls`).
    Tls(Arc<rustls::ServerConfig>),
    /// DNS over HTTPS (`https://`): with TLS when `tls` is given, cleartext HTTP/1.1 otherwise.
    Https(Option<Arc<rustls::ServerConfig>>),
}

impl Endpoint {
    /// What the log says it serves.
    pub fn describe(&self) -> &'static str {
        match self {
            Endpoint::Dns => "DNS (UDP, TCP)",
            Endpoint::Tcp => "DNS (TCP; tls:// without tls)",
            Endpoint::Tls(_) => "DNS over TLS",
            Endpoint::Https(Some(_)) => "DNS over HTTPS",
            Endpoint::Https(None) => "DNS over HTTP (https:// without tls)",
        }
    }
}

/// Every address DNS is served on, with how.
pub fn endpoints(config: &Config) -> BTreeMap<SocketAddr, Endpoint> {
    let mut out = BTreeMap::new();
    for server in &config.servers {
        let tls = server.tls.as_ref().map(|t| t.config.clone());
        let endpoint = match (server.scheme, tls) {
            (Scheme::Dns, _) => Endpoint::Dns,
            (Scheme::Tls, None) => Endpoint::Tcp,
            (Scheme::Tls, Some(tls)) => Endpoint::Tls(tls),
            (Scheme::Https, tls) => Endpoint::Https(tls),
        };
        for addr in &server.listen {
            out.entry(*addr).or_insert_with(|| endpoint.clone());
        }
    }
    out
}

/// The `forward` lines of `server`, serving. A line whose upstream settings an old line of the
/// block had keeps that line's group (its pools and health), the nearest in file order first;
/// each old group goes to one line at most.
fn forwarders(
    server: &Server,
    old: Option<&Arc<Zone>>,
    upstream_metrics: &nodedns_upstream::Metrics,
) -> Result<Vec<Forwarder>, SnapshotError> {
    let old: Vec<(&crate::config::Forward, &Arc<Group>)> = old.map_or_else(Vec::new, |old| {
        old.server
            .forwards
            .iter()
            .zip(old.forwards.iter().map(|f| &f.group))
            .collect()
    });
    let mut taken = vec![false; old.len()];
    let mut out = Vec::with_capacity(server.forwards.len());
    for (i, forward) in server.forwards.iter().enumerate() {
        let kept = (0..old.len())
            .filter(|&j| !taken[j] && old[j].0.upstream == forward.upstream)
            .min_by_key(|&j| j.abs_diff(i));
        let group = match kept {
            Some(j) => {
                taken[j] = true;
                old[j].1.clone()
            }
            None => Arc::new(
                Group::new(forward.upstream.clone(), upstream_metrics).map_err(|source| {
                    SnapshotError::Forward {
                        zones: server.zones.join(" "),
                        source,
                    }
                })?,
            ),
        };
        out.push(Forwarder {
            takes: Takes::new(forward),
            next: forward.next.clone(),
            group,
        });
    }
    Ok(out)
}

/// A number no other cache of this process has.
fn next_cache_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// State shared by every listener and task.
#[derive(Debug)]
pub struct Shared {
    pub snapshot: ArcSwap<Snapshot>,
    pub metrics: Arc<Metrics>,
    /// The per-client figures: UDP workers take a tracker each, the rest share one.
    pub clients: Arc<clients::Board>,
    /// The query log of the async path (listeners keep their own, with the same settings).
    pub querylog: QueryLog,
    /// The start-up forwarding-loop check; the miss path reports probe names to it.
    pub loops: loopcheck::Detector,
    /// The ndots cascade prefetch's bounds (process-wide, across reloads).
    pub cascade: cascade::Bounds,
    /// The UDP listeners' limit per client address (off unless [`Shared::with_udp_limit`]).
    pub udp_limit: ratelimit::Limiter,
    /// The agent's main runtime, for work that outlives a query (the cascade prefetch's watch
    /// of the entries it fetched): a UDP worker's runtime serves queries only, and goes back to
    /// its cheapest wait once they are answered (`udp`).
    pub background: tokio::runtime::Handle,
    /// Set when shutdown begins: listeners stop reading new queries.
    stopping: AtomicBool,
    /// Misses being resolved, so shutdown can wait for their answers.
    in_flight: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Shared {
    /// Must be called on the agent's main runtime (it becomes [`Shared::background`]).
    pub fn new(
        snapshot: Snapshot,
        metrics: Arc<Metrics>,
        clients: Arc<clients::Board>,
        querylog: querylog::Settings,
    ) -> Self {
        Shared {
            snapshot: ArcSwap::from_pointee(snapshot),
            metrics,
            clients,
            querylog: QueryLog::new(querylog),
            loops: loopcheck::Detector::default(),
            cascade: cascade::Bounds::default(),
            udp_limit: ratelimit::Limiter::off(),
            background: tokio::runtime::Handle::current(),
            stopping: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
        }
    }

    /// With the UDP listeners limited per client address by `settings`.
    pub fn with_udp_limit(mut self, settings: ratelimit::Settings) -> Self {
        self.udp_limit = ratelimit::Limiter::new(settings);
        self
    }

    /// Marks one miss in flight until the guard drops, unless `limit` misses are in flight
    /// already: a flood of unique names must not queue unbounded work (and memory) in the
    /// runtime.
    pub fn track(self: &Arc<Self>, limit: usize) -> Option<InFlight> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= limit {
            self.release();
            return None;
        }
        Some(InFlight(self.clone()))
    }

    fn release(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Waits until no miss is in flight, or `limit` passes.
    pub async fn wait_idle(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let notified = self.idle.notified();
                if self.in_flight.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

/// One miss in flight (see [`Shared::track`]).
#[derive(Debug)]
pub struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Forward;

    fn block(listen: &str, upstream: &str) -> Server {
        Server {
            zones: vec![".".to_owned()],
            listen: vec![listen.parse().unwrap()],
            cache: Some(nodedns_cache::Policy::default()),
            forwards: vec![Forward {
                from: ".".to_owned(),
                except: Vec::new(),
                next: Vec::new(),
                upstream: nodedns_upstream::Config {
                    addrs: vec![upstream.parse().unwrap()],
                    ..Default::default()
                },
            }],
            log: Vec::new(),
            errors: false,
            loop_check: false,
            dnstap: Vec::new(),
            chain: Default::default(),
            scheme: Default::default(),
            tls: None,
        }
    }

    fn line(from: &str, except: &[&str], upstream: &str) -> Forward {
        let canonical = |z: &str| crate::config::values::canonical_name(z).unwrap();
        Forward {
            from: canonical(from),
            except: except.iter().map(|e| canonical(e)).collect(),
            next: Vec::new(),
            upstream: nodedns_upstream::Config {
                addrs: vec![upstream.parse().unwrap()],
                ..Default::default()
            },
        }
    }

    fn build(config: Config, previous: Option<&Snapshot>) -> Snapshot {
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        Snapshot::build(
            Arc::new(config),
            previous,
            &upstream_metrics,
            &crate::plugin::Metrics::default(),
            &Metrics::default(),
            &dnstap::Metrics::default(),
        )
        .unwrap()
    }

    /// What node-cache (CoreDNS 1.10) does with these lines: each name goes to the first line,
    /// in file order, whose FROM holds it and whose `except` names do not; an `except` name
    /// passes on to a later line; FROM itself is never excepted.
    #[tokio::test]
    async fn a_name_goes_to_the_first_forward_line_that_takes_it() {
        let mut server = block("127.0.0.1:53", "192.0.2.1:53");
        server.forwards = vec![
            line(".", &["a.example.com"], "192.0.2.1:53"),
            line("example.com", &[], "192.0.2.2:53"),
            line("b.example.com", &[], "192.0.2.3:53"),
        ];
        let other = Server {
            listen: vec!["127.0.0.1:5353".parse().unwrap()],
            forwards: vec![
                line(
                    "example.com",
                    &["example.com", "sub.example.com"],
                    "192.0.2.1:53",
                ),
                line("example.org", &[], "192.0.2.2:53"),
                line("example.org", &[], "192.0.2.3:53"),
            ],
            ..server.clone()
        };
        let snap = build(
            Config {
                servers: vec![server, other],
                ..Config::default()
            },
            None,
        );
        let wire =
            |name: &str| crate::config::wire(&crate::config::values::canonical_name(name).unwrap());
        let (first, second) = (&snap.zones[0], &snap.zones[1]);
        for (name, expected) in [
            ("www.example.com", Some(0)),
            ("a.example.com", Some(1)),
            ("x.a.example.com", Some(1)),
            ("b.example.com", Some(0)),
            ("www.org", Some(0)),
        ] {
            assert_eq!(first.forward_for(&wire(name), 0), expected, "{name}");
        }
        assert_eq!(first.forward_for(&wire("x.a.example.com"), 2), None);
        assert_eq!(first.forward_for(&wire("b.example.com"), 1), Some(1));
        for (name, expected) in [
            ("example.com", Some(0)),
            ("www.example.com", None),
            ("sub.example.com", None),
            ("www.example.org", Some(1)),
            ("foo.net", None),
        ] {
            assert_eq!(second.forward_for(&wire(name), 0), expected, "{name}");
        }
        let local = "127.0.0.1:5353".parse().unwrap();
        assert!(!snap.route(&wire("foo.net"), local).unwrap().1.forward);
        assert!(
            snap.route(&wire("www.example.org"), local)
                .unwrap()
                .1
                .forward
        );
        // Each line has its own upstream group.
        let to = |zone: &Zone, i: usize| zone.forwards[i].group.config().addrs[0].to_string();
        assert_eq!(
            [to(first, 0), to(first, 1), to(first, 2)],
            ["192.0.2.1:53", "192.0.2.2:53", "192.0.2.3:53"]
        );
    }

    /// A reload that reorders a block's forward lines keeps each line's group with its
    /// upstreams; a changed line gets a new one.
    #[tokio::test]
    async fn a_reload_keeps_each_forward_lines_group_wherever_the_line_moved() {
        let mut server = block("127.0.0.1:53", "192.0.2.1:53");
        server.forwards = vec![
            line("example.com", &[], "192.0.2.1:53"),
            line(".", &[], "192.0.2.2:53"),
        ];
        let config = |server: &Server| Config {
            servers: vec![server.clone()],
            ..Config::default()
        };
        let first = build(config(&server), None);
        server.forwards.reverse();
        server
            .forwards
            .push(line("example.org", &[], "192.0.2.3:53"));
        let again = build(config(&server), Some(&first));
        let (old, new) = (&first.zones[0].forwards, &again.zones[0].forwards);
        assert!(Arc::ptr_eq(&old[0].group, &new[1].group));
        assert!(Arc::ptr_eq(&old[1].group, &new[0].group));
        assert!(
            !Arc::ptr_eq(&old[0].group, &new[2].group)
                && !Arc::ptr_eq(&old[1].group, &new[2].group)
        );
        assert!(
            !Arc::ptr_eq(
                first.zones[0].cache.as_ref().unwrap(),
                again.zones[0].cache.as_ref().unwrap()
            ),
            "other forward lines: other answers, a new cache"
        );
    }

    /// `.:53` and `.:5353` are two blocks: after a reload each keeps its own cache and
    /// upstreams, never the other's.
    #[tokio::test]
    async fn a_reload_keeps_each_blocks_cache_and_upstreams_by_zones_and_addresses() {
        let config = Arc::new(Config {
            servers: vec![
                block("127.0.0.1:53", "192.0.2.1:53"),
                block("127.0.0.1:5353", "192.0.2.2:53"),
            ],
            ..Config::default()
        });
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        let (metrics, taps) = (Metrics::default(), dnstap::Metrics::default());
        let plugin_metrics = crate::plugin::Metrics::default();
        let first = Snapshot::build(
            config.clone(),
            None,
            &upstream_metrics,
            &plugin_metrics,
            &metrics,
            &taps,
        )
        .unwrap();
        let again = Snapshot::build(
            config,
            Some(&first),
            &upstream_metrics,
            &plugin_metrics,
            &metrics,
            &taps,
        )
        .unwrap();
        for (old, new) in first.zones.iter().zip(&again.zones) {
            let (old_cache, new_cache) = (old.cache.as_ref().unwrap(), new.cache.as_ref().unwrap());
            assert!(Arc::ptr_eq(old_cache, new_cache), "{:?}", new.server.listen);
            assert_eq!(old.cache_id, new.cache_id);
            assert!(Arc::ptr_eq(&old.flights, &new.flights));
            assert!(Arc::ptr_eq(&old.forwards[0].group, &new.forwards[0].group));
        }
        let (a, b) = (&again.zones[0], &again.zones[1]);
        assert!(!Arc::ptr_eq(
            a.cache.as_ref().unwrap(),
            b.cache.as_ref().unwrap()
        ));
        assert_eq!(
            b.forwards[0].group.config().addrs,
            ["192.0.2.2:53".parse::<SocketAddr>().unwrap()],
            "the second block forwards where it did"
        );
    }
}
