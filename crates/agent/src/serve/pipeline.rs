//! The request pipeline shared by the UDP and TCP listeners.
//!
//! [`answer`] is the synchronous front: parse, route, look the cache up, and either write the
//! answer (a hit, or a refusal) or say that the query must go upstream. [`spawn`] hands a miss to
//! the async back (`resolve`): single-flight, the upstream exchange, caching the reply, and
//! answering every client that waited for it; at most [`MAX_PENDING`] at once. A cache hit never
//! reaches it and awaits nothing.
//!
//! A background refresh ([`refresh`]: a prefetch, or refreshing an entry served stale while the
//! upstream is down) is an operation of its own, not a client: the entry's one claim
//! ([`nodedns_cache::Entry::claim_refresh`]) lets one hit start it however many hits follow, and
//! [`nodedns_cache::Flights::refresh`] makes it one fetch per key with no waiter, so it never
//! takes a place a client needs. Clients that miss while it runs join it and get its answer.
//! The ndots cascade prefetch ([`super::cascade`]) starts such fetches for the later steps of a
//! pod's search list when a miss's fetch says its first step does not exist.
//!
//! Every answer ends with the same steps (`record`): count it, add it to its client's figures,
//! hand it to its block's dnstap sinks, and log it if its block logs queries.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::Message;
use nodedns_cache::{Cache, Class, Entry, Fetched, Found, Joined, Lookup, Stored, Updated};
use nodedns_wire::{Key, Layout, ParseError, Query, Reply, ReplyError, TtlRule, rcode, rtype};

use super::querylog::QueryLog;
use super::request::{Client, Labels, Proto, Source};
use super::{InFlight, Shared, Snapshot, Zone};
use crate::clients::Tracker;
use crate::config::LogRule;
use crate::dnstap::Tap;
use crate::metrics::{Answer, Counters};
use crate::plugin::{self, Step};

/// What the synchronous front decided for one packet.
///
/// A plain tag byte (`repr(u8)`): the listener reads it for every packet, and a tag packed into
/// the payloads' spare values would cost instructions to decode on the hit path.
#[derive(Debug)]
#[repr(u8)]
pub enum Front {
    /// `out` holds the answer: send it.
    Answered,
    /// `out` holds the answer: send it; and refresh the key in the background ([`refresh`]).
    AnsweredRefresh(Refresh),
    /// Nothing to send (not a query, or no header to answer to).
    Dropped,
    /// The cache cannot answer: hand the query to [`resolve`].
    Miss(Miss),
}

/// A query that must go upstream.
#[derive(Debug)]
pub struct Miss {
    pub zone: Arc<Zone>,
    pub key: Key,
    /// The query's metric labels, for the answer's count.
    pub labels: Labels,
    /// The AAAA answer `dns64` replaces once this miss (of the A question) is answered.
    pub dns64: Option<Box<super::dns64::Pending>>,
    /// The client's query as parsed: its waiter's answer is written without parsing it again.
    pub layout: Layout,
}

impl Miss {
    /// The client `query` (as received, from `client` at `started`: the bytes the miss was
    /// parsed from) waiting for this miss's answer, to be sent through `reply_to`: it takes the
    /// miss's labels, its query's layout and its `dns64` part.
    pub fn waiter(
        &mut self,
        query: &[u8],
        reply_to: ReplyTo,
        client: Client,
        started: Instant,
    ) -> Waiter {
        Waiter {
            query: query.into(),
            layout: self.layout,
            reply_to,
            client,
            started,
            labels: self.labels,
            dns64: self.dns64.take(),
        }
    }
}

/// A key to refresh in the background: a prefetch, or an entry just answered stale at once.
#[derive(Debug)]
pub struct Refresh {
    pub zone: Arc<Zone>,
    pub key: Key,
    /// The entry whose refresh this is (its claim is released if the refresh cannot start).
    pub entry: Arc<nodedns_cache::Entry>,
}

/// Where the answer to a waiting query goes.
#[derive(Debug)]
pub enum ReplyTo {
    /// Back out of the UDP socket the query came in on, to the client's address (the socket is
    /// bound to the address the query was sent to, so the answer leaves from that address).
    Udp(Arc<std::net::UdpSocket>),
    /// The connection's queue of answers, with one of its in-flight slots (given back when the
    /// answer is queued).
    Tcp(super::tcp::Answers),
    /// The DNS-over-HTTPS request waiting for it.
    Http(tokio::sync::oneshot::Sender<Vec<u8>>),
}

/// A client waiting for an upstream answer: its query as received (to patch the answer for it)
/// and where to send the answer.
#[derive(Debug)]
pub struct Waiter {
    pub query: Box<[u8]>,
    /// What parsing `query` found ([`Query::with_layout`]).
    pub layout: Layout,
    pub reply_to: ReplyTo,
    pub client: Client,
    pub started: Instant,
    /// Its metric labels (from [`Miss::labels`]).
    pub labels: Labels,
    /// From [`Miss::dns64`]: `query` is an AAAA question, the fetch answers the A question.
    pub dns64: Option<Box<super::dns64::Pending>>,
}

/// Largest answer over TCP (RFC 1035 §4.2.2: a 16-bit length).
pub const TCP_LIMIT: usize = nodedns_wire::MAX_MESSAGE_LEN;

/// Where a listener records its answers: its counter block, its clients' figures and its query
/// log.
#[derive(Debug, Clone, Copy)]
pub struct Recorder<'a> {
    pub counters: &'a Counters,
    /// `None` with `--clients-top 0`.
    pub clients: Option<&'a Tracker>,
    pub log: &'a QueryLog,
}

/// One answer, as the steps after it see it.
#[derive(Clone, Copy)]
pub(super) struct Answered<'a> {
    pub client: &'a Client,
    pub query: &'a Query<'a>,
    /// The question's name, lowercased (the cache key's).
    pub qname: &'a [u8],
    pub source: Source,
    pub response: &'a [u8],
    pub elapsed: Duration,
}

/// The last steps of every answer: count it, add it to its client's figures, hand it to its
/// block's dnstap sinks (`taps`), then log it if its block logs queries (by its `log` rules,
/// `rules`). Inlined: it runs once per query, hits included.
///
/// `rules` is the block's `Vec` itself, not a slice: a hit carries one pointer it already has
/// to the branch that logs, instead of a slice's pointer and length across the counting.
#[inline(always)]
#[allow(clippy::ptr_arg)]
pub(super) fn record(
    to: &Recorder<'_>,
    labels: Labels,
    taps: &[Arc<Tap>],
    rules: &Vec<LogRule>,
    answered: Answered<'_>,
) {
    let Answered {
        client,
        query,
        qname,
        source,
        response,
        elapsed,
    } = answered;
    to.counters.answered(
        labels.series,
        Answer {
            transport: client.proto.transport(),
            query,
            response,
            plugin: source.plugin(labels.cache),
            cache: source.cache_use(labels.cache),
            elapsed,
        },
    );
    if let Some(tracker) = to.clients {
        let rcode = response.get(3).map_or(0, |b| b & 0x0f);
        tracker.record(client.addr.ip(), qname, rcode, source.path(labels.cache));
    }
    for tap in taps {
        tap.client(
            query.bytes(),
            response,
            client.addr,
            client.proto == Proto::Tcp,
            elapsed,
        );
    }
    if labels.log {
        let server = to.counters.server_name();
        to.log
            .write(server, rules, query, client, source, response, elapsed);
    }
}

/// The rules of a query no block serves: none (only `--query-log` logs it).
const NO_RULES: &Vec<LogRule> = &Vec::new();

/// What [`answer`] took from the cache: a fresh entry's answer, already written, with the
/// entry itself only when it is due for a refresh; or a stale entry; or nothing.
enum Looked {
    Fresh {
        class: Class,
        refresh: Option<Arc<Entry>>,
    },
    Stale {
        entry: Arc<Entry>,
        ttl: TtlRule,
    },
    Miss,
}

/// Decides what to do with one packet. When it returns [`Front::Answered`] or
/// [`Front::AnsweredRefresh`], the answer is in `out`.
///
/// Runs for every packet on the listener's own thread: it allocates nothing (after `out` has
/// grown once) and takes no lock but its key's cache shard's.
pub fn answer(
    to: &Recorder<'_>,
    snap: &Snapshot,
    packet: &[u8],
    local: SocketAddr,
    client: &Client,
    now: Instant,
    out: &mut Vec<u8>,
) -> Front {
    let query = match Query::parse(packet) {
        Ok(query) => query,
        Err(err) => return malformed(to.counters, packet, err, out),
    };
    // Filled in place: a key is 262 bytes, and one returned by value is copied.
    let mut key = Key::default();
    query.key_into(&mut key);
    let limit = match client.proto {
        Proto::Udp => query.udp_limit(),
        Proto::Tcp => TCP_LIMIT,
    };
    let Some((zone, route)) = snap.route(key.qname(), local) else {
        nodedns_wire::write_error(&query, rcode::REFUSED.into(), out);
        let labels = Labels {
            series: to.counters.dropped(),
            cache: false,
            log: to.log.logs(false),
        };
        let answered = Answered {
            client,
            query: &query,
            qname: key.qname(),
            source: Source::Refused,
            response: out,
            elapsed: Duration::ZERO,
        };
        record(to, labels, &[], NO_RULES, answered);
        return Front::Answered;
    };
    // A name outside the cache's zones (`cache ZONES`) passes the cache untouched.
    let cache = zone.cache.as_ref().filter(|c| c.covers(key.qname()));
    let labels = Labels {
        series: to.counters.series(zone.label + route.zone),
        cache: cache.is_some(),
        log: to.log.logs(!zone.server.log.is_empty()),
    };
    // The plugins before the cache (`bufsize`) may lower the client's limit; `dns64` takes
    // the AAAA queries it translates.
    let limit = if zone.plugins.plain() {
        limit
    } else {
        let before = zone.plugins.before();
        let limit = before.limit(&query, client.proto, limit);
        if let Some(dns64) = before.dns64.filter(|d| d.takes(&query, client.addr)) {
            let at = Chained {
                to,
                zone,
                forward: route.forward,
                labels,
                client,
                limit,
            };
            return super::dns64::front(&at, dns64, &query, key, now, out);
        }
        limit
    };
    // Outside the block's `forward` lines (none, not under a FROM, or an `except` name), in a
    // block with no other plugin after the cache: the end of CoreDNS's chain, SERVFAIL. (A
    // block that forwards everything never tests more than `route.forward` here.)
    if !route.forward && zone.plugins.is_empty() {
        nodedns_wire::write_error(&query, rcode::SERVFAIL.into(), out);
        before_cache(zone, &query, out);
        let answered = Answered {
            client,
            query: &query,
            qname: key.qname(),
            source: Source::Unhandled,
            response: out,
            elapsed: Duration::ZERO,
        };
        record(to, labels, &zone.taps, &zone.server.log, answered);
        return Front::Answered;
    }
    let Some(cache) = cache else {
        if !zone.plugins.is_empty() {
            let at = Chained {
                to,
                zone,
                forward: route.forward,
                labels,
                client,
                limit,
            };
            if let Some(front) = chain(&at, &query, &key, None, now, out) {
                return front;
            }
        }
        return upstream(to, zone, key, labels, client, &query, out);
    };
    // A fresh entry's answer is written under its shard's lock (`Cache::lookup_with`): the
    // entry is shared only when it is due for a refresh.
    let looked = cache.lookup_with(key.as_bytes(), now, |found| match found {
        Found::Fresh {
            entry,
            ttl,
            prefetch,
        } => {
            entry.reply().write_answer(&query, ttl, limit, out);
            Looked::Fresh {
                class: entry.class(),
                refresh: prefetch.then(|| Arc::clone(entry)),
            }
        }
        Found::Stale { entry, ttl } => Looked::Stale {
            entry: Arc::clone(entry),
            ttl,
        },
        Found::Miss => Looked::Miss,
    });
    match looked {
        Looked::Fresh { class, refresh } => {
            before_cache(zone, &query, out);
            let answered = Answered {
                client,
                query: &query,
                qname: key.qname(),
                source: Source::Hit(class),
                response: out,
                elapsed: Duration::ZERO,
            };
            record(to, labels, &zone.taps, &zone.server.log, answered);
            if let Some(entry) = refresh {
                to.counters.prefetch(labels.series);
                return Front::AnsweredRefresh(Refresh {
                    zone: zone.clone(),
                    key,
                    entry,
                });
            }
            Front::Answered
        }
        // At once (and refreshed in the background by the hit that claims it) in `immediate`
        // mode, while the upstream is known to be down (RFC 8767 §5: no client waits for a
        // fetch that will fail), and during a failed fetch's recheck period.
        // (A block with plugins after the cache asks them first: see below.)
        Looked::Stale { entry, ttl }
            if zone.plugins.is_empty() && stale_at_once(cache, &entry, zone, key.qname(), now) =>
        {
            entry.reply().write_answer(&query, ttl, limit, out);
            before_cache(zone, &query, out);
            let answered = Answered {
                client,
                query: &query,
                qname: key.qname(),
                source: Source::StaleHit(entry.class()),
                response: out,
                elapsed: Duration::ZERO,
            };
            record(to, labels, &zone.taps, &zone.server.log, answered);
            if entry.claim_refresh(now) {
                return Front::AnsweredRefresh(Refresh {
                    zone: zone.clone(),
                    key,
                    entry,
                });
            }
            Front::Answered
        }
        // The plugins after the cache come before `forward`, so before a stale entry too.
        Looked::Stale { .. } | Looked::Miss if !zone.plugins.is_empty() => {
            let at = Chained {
                to,
                zone,
                forward: route.forward,
                labels,
                client,
                limit,
            };
            match chain(&at, &query, &key, Some(cache), now, out) {
                Some(front) => front,
                None => upstream(to, zone, key, labels, client, &query, out),
            }
        }
        // Otherwise try upstream first; `resolve` falls back to the stale entry if it fails.
        Looked::Stale { .. } | Looked::Miss => upstream(to, zone, key, labels, client, &query, out),
    }
}

/// Whether a stale entry is answered without asking the upstream first (the cache's rule, told
/// whether every upstream of the `forward` line that takes `qname` is marked down).
pub(super) fn stale_at_once(
    cache: &Cache,
    entry: &Entry,
    zone: &Zone,
    qname: &[u8],
    now: Instant,
) -> bool {
    let down = zone.group_for(qname).is_some_and(|g| !g.healthy());
    cache.stale_at_once(entry, down, now)
}

/// A query the cache cannot answer goes upstream, unless it asks for a zone transfer (AXFR,
/// RFC 5936; IXFR, RFC 1995): REFUSED, as unbound answers it. A node-local cache holds no zone,
/// and a transfer relayed as one exchange is its first message only (node-cache relays that
/// first message, and caches it). Checked here, after the lookup, so a hit pays nothing for it;
/// a transfer is never stored, so it never hits.
#[inline]
pub(super) fn upstream(
    to: &Recorder<'_>,
    zone: &Arc<Zone>,
    key: Key,
    labels: Labels,
    client: &Client,
    query: &Query<'_>,
    out: &mut Vec<u8>,
) -> Front {
    if matches!(query.qtype(), rtype::AXFR | rtype::IXFR) {
        nodedns_wire::write_error(query, rcode::REFUSED.into(), out);
        let answered = Answered {
            client,
            query,
            qname: key.qname(),
            source: Source::Refused,
            response: out,
            elapsed: Duration::ZERO,
        };
        record(to, labels, &zone.taps, &zone.server.log, answered);
        return Front::Answered;
    }
    Front::Miss(Miss {
        zone: zone.clone(),
        key,
        labels,
        dns64: None,
        layout: query.layout(),
    })
}

/// The block's plugins before the cache (`crate::plugin::Before`: `bufsize`, `loadbalance`), on
/// the answer to `query` written in `out`. A block without them tests one flag.
#[inline(always)]
pub(super) fn before_cache(zone: &Zone, query: &Query<'_>, out: &mut Vec<u8>) {
    if !zone.plugins.plain() {
        zone.plugins.before().served(query, out);
    }
}

/// Where [`chain`] answers: the query's block and how it was routed and labelled.
#[derive(Clone, Copy)]
pub(super) struct Chained<'a> {
    pub to: &'a Recorder<'a>,
    pub zone: &'a Arc<Zone>,
    /// Whether one of the block's `forward` lines takes the name.
    pub forward: bool,
    pub labels: Labels,
    pub client: &'a Client,
    pub limit: usize,
}

/// The block's plugins after the cache (`crate::plugin`), for a query the cache did not answer:
/// those before `forward`, then `forward` (`None`: the caller makes it a [`Miss`]), then those
/// after it, then SERVFAIL (CoreDNS's end of the chain). An answer is stored in `cache` as an
/// upstream answer is (its TTLs capped as the cache caps them), unless its plugin says not to.
///
/// Cold: only blocks with such plugins get here, and only on a miss.
#[cold]
fn chain(
    at: &Chained<'_>,
    query: &Query<'_>,
    key: &Key,
    cache: Option<&Arc<nodedns_cache::Cache>>,
    now: Instant,
    out: &mut Vec<u8>,
) -> Option<Front> {
    let source = chained(at, query, key, cache, now, out)?;
    before_cache(at.zone, query, out);
    let answered = Answered {
        client: at.client,
        query,
        qname: key.qname(),
        source,
        response: out,
        elapsed: Duration::ZERO,
    };
    record(
        at.to,
        at.labels,
        &at.zone.taps,
        &at.zone.server.log,
        answered,
    );
    Some(Front::Answered)
}

/// What [`chain`] answers, written in `out` (for `at.limit`) and not recorded: what answered,
/// or `None` when `forward` takes the query.
#[cold]
pub(super) fn chained(
    at: &Chained<'_>,
    query: &Query<'_>,
    key: &Key,
    cache: Option<&Arc<nodedns_cache::Cache>>,
    now: Instant,
    out: &mut Vec<u8>,
) -> Option<Source> {
    let request = plugin::Request {
        query,
        key,
        client: Some((at.client.addr, at.client.proto)),
    };
    let mut step = at.zone.plugins.before_forward(&request);
    if matches!(step, Step::Next) {
        if at.forward {
            return None;
        }
        step = at.zone.plugins.after_forward(&request);
    }
    let source = match step {
        Step::Answer {
            reply,
            by,
            cache: cacheable,
        } => match Reply::parse(&reply) {
            Ok(reply) => {
                let stored = match cache.filter(|_| cacheable) {
                    Some(cache) => cache.store(key.as_bytes(), reply, now),
                    None => Stored::NotCacheable(reply),
                };
                match stored {
                    Stored::Entry(entry) => {
                        let ttl = TtlRule::fresh(0, entry.ttl());
                        entry.reply().write_relayed(query, ttl, at.limit, out);
                    }
                    Stored::NotCacheable(reply) => {
                        reply.write_relayed(query, TtlRule::STORED, at.limit, out);
                    }
                    // Its class is disabled for the name (`cache { disable }`): passed on with
                    // the lifetime the cache gives it, as an upstream answer is.
                    Stored::Passed { reply, ttl } => {
                        reply.write_relayed(query, ttl, at.limit, out);
                    }
                }
                Source::Plugin(by)
            }
            Err(err) => {
                tracing::debug!(%err, "a plugin's reply does not parse");
                nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
                Source::PluginServFail
            }
        },
        Step::ServFail => {
            nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
            Source::PluginServFail
        }
        Step::Next => {
            nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
            Source::Unhandled
        }
    };
    Some(source)
}

fn malformed(counters: &Counters, packet: &[u8], err: ParseError, out: &mut Vec<u8>) -> Front {
    counters.malformed();
    match err.rcode() {
        Some(rcode) if nodedns_wire::write_formerr(packet, rcode, out) => Front::Answered,
        _ => Front::Dropped,
    }
}

/// The answer every waiter of one fetch gets.
pub(super) enum Outcome {
    /// From the cache entry the fetch just stored (or a stale one when the fetch failed).
    Entry(Arc<nodedns_cache::Entry>, TtlRule, Source),
    /// A reply that was not cached (not cacheable, the block has no cache or none for the
    /// name, or its class is disabled for the name), answered with its TTLs under the rule.
    Reply(Reply, TtlRule),
    /// Nothing usable: SERVFAIL, not cached.
    Failed,
}

/// Misses handed to a runtime (a UDP worker's own, or the main one) and not answered yet, at
/// most (process-wide). Beyond it a miss is answered SERVFAIL at once by the listener that read
/// it: a flood of unique names must find this bound, not grow the runtimes' queues of tasks (and
/// the memory) without end. Well above what the upstreams take at once (`max_concurrent`, 1000
/// per block by default) plus the clients waiting on those fetches, so only a flood reaches it.
pub const MAX_PENDING: usize = 4096;

/// Hands a miss to `runtime` ([`resolve`]), unless [`MAX_PENDING`] misses are pending already:
/// then the waiter gets SERVFAIL now (counted as a SERVFAIL answer).
pub fn spawn(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle, miss: Miss, waiter: Waiter) {
    let Some(in_flight) = shared.track(MAX_PENDING) else {
        let (zone, qname, now) = (&miss.zone, miss.key.qname(), Instant::now());
        answer_waiter(shared, zone, qname, waiter, &Outcome::Failed, now);
        return;
    };
    spawn_tracked(shared, runtime, miss, waiter, in_flight);
}

/// [`spawn`] for a miss that already has its place (`in_flight`, from [`Shared::track`]).
pub fn spawn_tracked(
    shared: &Arc<Shared>,
    runtime: &tokio::runtime::Handle,
    miss: Miss,
    waiter: Waiter,
    in_flight: InFlight,
) {
    runtime.spawn(resolve(shared.clone(), miss, waiter, in_flight));
}

/// The answer to a miss that finds [`MAX_PENDING`] misses pending (no place from
/// [`Shared::track`]): SERVFAIL, written into `out` for the listener to send with its batch, as
/// a hit's answer is, and counted as [`spawn`] counts it. No waiter, no allocation: under a
/// flood of unique names this is what most datagrams cost, and the cheaper it is, the more
/// datagrams the listener reads, the other clients' among them. `packet` is the query the
/// miss was parsed from.
pub fn refused_for_load(
    to: &Recorder<'_>,
    miss: &Miss,
    packet: &[u8],
    client: &Client,
    out: &mut Vec<u8>,
) {
    let query = Query::with_layout(packet, miss.layout);
    nodedns_wire::write_error(&query, rcode::SERVFAIL.into(), out);
    before_cache(&miss.zone, &query, out);
    let answered = Answered {
        client,
        query: &query,
        qname: miss.key.qname(),
        source: Source::ServFail,
        response: out,
        elapsed: Duration::ZERO,
    };
    record(
        to,
        miss.labels,
        &miss.zone.taps,
        &miss.zone.server.log,
        answered,
    );
}

/// Starts a background refresh of `refresh`'s key on `runtime`, unless a fetch for the key is
/// under way already (that one refreshes it), or [`MAX_PENDING`] misses are pending (a refresh
/// yields to clients). Nobody waits for it; clients that miss the key while it runs join it.
///
/// Cold: at most one hit per entry gets here, and its code must not crowd the listener's loop.
#[cold]
pub fn refresh(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle, refresh: Refresh) {
    let Refresh { zone, key, entry } = refresh;
    let Some(in_flight) = shared.track(MAX_PENDING) else {
        entry.release_refresh();
        return;
    };
    if !zone.plugins.is_empty() && refreshed_by_plugins(&zone, &key) {
        entry.release_refresh();
        return;
    }
    if !zone.flights.refresh(key.as_bytes()) {
        entry.release_refresh();
        return;
    }
    let shared = shared.clone();
    runtime.spawn(async move {
        let leading = Leading::new(&shared, &zone, &key);
        let outcome = fetch(&shared, &zone, &key, true).await;
        leading.complete(&outcome);
        drop(in_flight);
    });
}

/// A refresh in a block with plugins after the cache: they come before `forward`, so an entry
/// one of them answers is refreshed from it, never from upstream. True when nothing is left
/// for `forward` to do (answered, or a name `forward` does not take).
fn refreshed_by_plugins(zone: &Zone, key: &Key) -> bool {
    let mut bytes = Vec::with_capacity(64);
    let Some(query) = nodedns_wire::build_query(key.as_bytes(), 0, &mut bytes)
        .and_then(|()| Query::parse(&bytes).ok())
    else {
        return true;
    };
    let request = plugin::Request {
        query: &query,
        key,
        client: None,
    };
    match zone.plugins.before_forward(&request) {
        Step::Answer {
            reply, cache: true, ..
        } => {
            if let (Some(cache), Ok(reply)) = (&zone.cache, Reply::parse(&reply)) {
                cache.store(key.as_bytes(), reply, Instant::now());
            }
            true
        }
        Step::Answer { .. } | Step::ServFail => true,
        Step::Next => zone.forward_for(key.qname(), 0).is_none(),
    }
}

/// Resolves a miss: joins (or leads) the fetch for its key, and when the fetch ends, answers
/// every waiter.
///
/// Its future is each pending miss's task, so what it holds across the fetch is kept small:
/// the miss is read in place (a moved copy of the key would be another 262 bytes), and the
/// rare `verify` fetch is boxed.
async fn resolve(shared: Arc<Shared>, miss: Miss, waiter: Waiter, _in_flight: InFlight) {
    let (zone, key) = (&miss.zone, &miss.key);
    // A probe of the loop check is answered but never stored: a cached answer (a SERVFAIL from
    // the looping upstream, say) would hide its next arrival from the check.
    let probe = shared.loops.armed() && shared.loops.arrived(key, waiter.client.addr);
    // When the miss was read: the look-up below needs no clock read of its own.
    let read = waiter.started;
    match zone.flights.join(key.as_bytes(), waiter) {
        Joined::Leader => {}
        Joined::Follower => return,
        Joined::Full(waiter) => {
            shared.metrics.counters().flight_full();
            let now = Instant::now();
            answer_waiter(&shared, zone, key.qname(), waiter, &Outcome::Failed, now);
            return;
        }
    }
    let leading = Leading::new(&shared, zone, key);
    let outcome = match stored_meanwhile(zone, key, read) {
        Some(outcome) => outcome,
        None => match zone.cache.as_ref().and_then(|c| c.verify_timeout()) {
            Some(timeout) => {
                Box::pin(fetch_or_stale_after(&shared, zone, key, !probe, timeout)).await
            }
            None => fetch(&shared, zone, key, !probe).await,
        },
    };
    super::cascade::follow(&shared, zone, key, &outcome);
    leading.complete(&outcome);
}

/// A fetch that a task leads, from the moment its key's flight is open until its waiters are
/// answered. Should the task be dropped first (its runtime ended: a UDP worker that stopped and
/// whose misses outlasted its drain), the waiters still get an answer, SERVFAIL, and the
/// flight ends, so that later misses of the key do not join a fetch nobody runs.
pub(super) struct Leading<'a> {
    shared: &'a Arc<Shared>,
    zone: &'a Arc<Zone>,
    key: &'a Key,
    done: bool,
}

impl<'a> Leading<'a> {
    pub(super) fn new(shared: &'a Arc<Shared>, zone: &'a Arc<Zone>, key: &'a Key) -> Self {
        Leading {
            shared,
            zone,
            key,
            done: false,
        }
    }

    /// Ends the flight with `outcome` ([`complete`]); returns how many waiters it answered.
    pub(super) fn complete(mut self, outcome: &Outcome) -> usize {
        self.done = true;
        complete(self.shared, self.zone, self.key, outcome)
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        if !self.done {
            complete(self.shared, self.zone, self.key, &Outcome::Failed);
        }
    }
}

/// The fresh entry a fetch stored between this miss's cache look-up and its join, if one did:
/// an answer from the cache, not another upstream query. (A pod asks its next search-list step
/// just as the cascade prefetch's fetch of it ends, so this is no rare race there.)
fn stored_meanwhile(zone: &Zone, key: &Key, now: Instant) -> Option<Outcome> {
    match zone.cache.as_ref()?.lookup(key.as_bytes(), now) {
        Lookup::Fresh { entry, ttl, .. } => {
            let source = Source::Hit(entry.class());
            Some(Outcome::Entry(entry, ttl, source))
        }
        Lookup::Stale { .. } | Lookup::Miss => None,
    }
}

/// `serve_stale ... verify VERIFY_TIMEOUT`: [`fetch`], but once `timeout` has passed the clients
/// waiting so far get the stale entry, if there is one, while the fetch goes on to refresh the
/// cache and to answer whoever joins it later.
async fn fetch_or_stale_after(
    shared: &Arc<Shared>,
    zone: &Arc<Zone>,
    key: &Key,
    store: bool,
    timeout: Duration,
) -> Outcome {
    let fetching = fetch(shared, zone, key, store);
    tokio::pin!(fetching);
    tokio::select! {
        outcome = &mut fetching => return outcome,
        () = tokio::time::sleep(timeout) => {}
    }
    let now = Instant::now();
    let stale = zone
        .cache
        .as_ref()
        .map(|cache| cache.lookup(key.as_bytes(), now));
    if let Some(Lookup::Stale { entry, ttl }) = stale {
        let outcome = Outcome::Entry(entry, ttl, Source::StaleAfterMiss);
        for waiter in zone.flights.take(key.as_bytes()) {
            answer_waiter(shared, zone, key.qname(), waiter, &outcome, now);
        }
    }
    fetching.await
}

/// Ends the fetch for `key` and answers every client that waited for it; returns how many.
pub(super) fn complete(
    shared: &Arc<Shared>,
    zone: &Arc<Zone>,
    key: &Key,
    outcome: &Outcome,
) -> usize {
    let waiters = zone.flights.complete(key.as_bytes());
    let joined = waiters.len();
    // One clock read for all of them.
    let now = Instant::now();
    for waiter in waiters {
        answer_waiter(shared, zone, key.qname(), waiter, outcome, now);
    }
    joined
}

/// Fetches `key` upstream, and (if `store` and the block has a cache) lets the cache apply the
/// exchange: what waiters get. The upstreams are those of the block's first `forward` line that
/// takes the name; a reply with one of that line's `next` rcodes is asked again of the next line
/// that takes it, as CoreDNS's chained forward plugins do (`next` does nothing on the last line).
pub(super) async fn fetch(shared: &Shared, zone: &Zone, key: &Key, store: bool) -> Outcome {
    let Some(mut line) = zone.forward_for(key.qname(), 0) else {
        return Outcome::Failed;
    };
    let mut query = Vec::with_capacity(64);
    if nodedns_wire::build_query(key.as_bytes(), 0, &mut query).is_none() {
        return Outcome::Failed;
    }
    zone.plugins.before().upstream(&mut query);
    let revert = match zone.plugins.rewrite() {
        None => None,
        Some(rules) => match rewritten(rules, &mut query) {
            Ok(revert) => revert,
            Err(err) => {
                tracing::debug!(%err, "rewrite: the query is not sent");
                return Outcome::Failed;
            }
        },
    };
    let fetched = loop {
        let forward = &zone.forwards[line];
        let fetched = match forward.group.query(&query).await {
            // Counted and logged as the upstream's failures are: the client gets SERVFAIL.
            Ok(bytes) => reverted(revert.as_ref(), bytes).map_or_else(
                |err| {
                    shared.metrics.unusable_reply(zone.label);
                    zone.errors.unusable(key.qname(), key.qtype(), &err);
                    Fetched::Failed
                },
                Fetched::Reply,
            ),
            Err(err) => {
                shared.metrics.upstream_failed(zone.label, &err);
                zone.errors.failed(key.qname(), key.qtype(), &err);
                Fetched::Failed
            }
        };
        let passed_on = match &fetched {
            Fetched::Reply(reply) => {
                line + 1 < zone.forwards.len() && forward.next.contains(&reply.info().rcode)
            }
            Fetched::Failed => false,
        };
        if !passed_on {
            break fetched;
        }
        match zone.forward_for(key.qname(), line + 1) {
            Some(later) => line = later,
            // CoreDNS passes it on down its chain, past the forward lines that do not take the
            // name, to its end: SERVFAIL.
            None => break Fetched::Failed,
        }
    };
    let cache = zone
        .cache
        .as_ref()
        .filter(|c| store && c.covers(key.qname()));
    match cache {
        Some(cache) => outcome(cache.update(key.as_bytes(), fetched, Instant::now())),
        None => match fetched {
            Fetched::Reply(reply) => Outcome::Reply(reply, TtlRule::STORED),
            Fetched::Failed => Outcome::Failed,
        },
    }
}

/// `rewrite`'s rules applied to the upstream query `wire` (re-encoded when one matched): what
/// to undo in its reply. The query is built from the cache key and may serve many clients, so
/// the rules see no client: `edns0` variables and `subnet` read the unspecified address.
#[cold]
fn rewritten(
    rules: &plugin::rewrite::Rewrite,
    wire: &mut Vec<u8>,
) -> Result<Option<plugin::rewrite::Revert>, plugin::rewrite::InvalidName> {
    let Ok(mut message) = Message::from_vec(wire) else {
        return Ok(None);
    };
    let nobody = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0));
    let source = plugin::rewrite::Source {
        client: nobody,
        server: nobody,
        tcp: false,
    };
    let revert = rules.request(&mut message, &source)?;
    // An `edns0` rule may change the query without matching a name: sent as it now is.
    if let Some(bytes) = plugin::encode(&message) {
        *wire = bytes;
    }
    Ok(revert)
}

/// The upstream's reply, parsed for the cache; when `rewrite` changed the query, first reverted
/// (the question the client asked, the answer rewrites).
fn reverted(revert: Option<&plugin::rewrite::Revert>, bytes: Vec<u8>) -> Result<Reply, ReplyError> {
    let Some(revert) = revert else {
        return Reply::parse(&bytes);
    };
    // What hickory cannot read is refused as the cache's own parser would refuse it.
    Reply::parse(&bytes)?;
    let mut message = Message::from_vec(&bytes).map_err(|_| ReplyError::Truncated)?;
    revert.reply(&mut message);
    let bytes = plugin::encode(&message).ok_or(ReplyError::TooLarge)?;
    Reply::parse(&bytes)
}

/// What the waiters of a fetch get once the cache applied it: the reply stored; the entry kept
/// (the exchange failed, or `prefer_positive` set a denial aside), stale or fresh; the reply
/// relayed; or SERVFAIL.
fn outcome(updated: Updated) -> Outcome {
    match updated {
        Updated::Stored(entry) => {
            let ttl = TtlRule::fresh(0, entry.ttl());
            Outcome::Entry(entry, ttl, Source::Upstream)
        }
        // RFC 8767 §4: the stale entry is better than the failure.
        Updated::Kept {
            entry,
            ttl,
            stale: true,
        } => Outcome::Entry(entry, ttl, Source::StaleAfterMiss),
        // Fresh: stored meanwhile by another fetch, or a prefetch's entry, still fresh.
        Updated::Kept {
            entry,
            ttl,
            stale: false,
        } => {
            let source = Source::FreshAfterMiss(entry.class());
            Outcome::Entry(entry, ttl, source)
        }
        Updated::NotCacheable(reply, ttl) => Outcome::Reply(reply, ttl),
        Updated::Failed => Outcome::Failed,
    }
}

/// Answers one client that waited for `zone`'s fetch of `qname` (the fetch's key's: the name
/// every waiter of the fetch asked, lowercased as a key holds it).
fn answer_waiter(
    shared: &Arc<Shared>,
    zone: &Arc<Zone>,
    qname: &[u8],
    mut waiter: Waiter,
    outcome: &Outcome,
    now: Instant,
) {
    let bytes = std::mem::take(&mut waiter.query);
    let query = Query::with_layout(&bytes, waiter.layout);
    let limit = match waiter.client.proto {
        Proto::Udp => query.udp_limit(),
        Proto::Tcp => TCP_LIMIT,
    };
    let limit = if zone.plugins.plain() {
        limit
    } else {
        zone.plugins
            .before()
            .limit(&query, waiter.client.proto, limit)
    };
    let mut out = Vec::with_capacity(512);
    // A waiter of a block with plugins before the cache may be `dns64`'s (a waiter keeps the
    // zone of its miss, and a reload may have dropped `dns64` from it since).
    let source = if zone.plugins.plain() && waiter.dns64.is_none() {
        written(&query, limit, outcome, &mut out)
    } else {
        match super::dns64::waiter(shared, zone, waiter, &query, limit, outcome, &mut out) {
            Some((source, back)) => {
                waiter = back;
                source
            }
            // Handed to the fetch of the A question.
            None => return,
        }
    };
    before_cache(zone, &query, &mut out);
    let elapsed = now.saturating_duration_since(waiter.started);
    let labels = waiter.labels;
    let to = Recorder {
        counters: shared.metrics.shared(labels.series),
        clients: shared.clients.shared(),
        log: &shared.querylog,
    };
    let answered = Answered {
        client: &waiter.client,
        query: &query,
        qname,
        source,
        response: &out,
        elapsed,
    };
    record(&to, labels, &zone.taps, &zone.server.log, answered);
    send(shared, waiter.reply_to, waiter.client.addr, out);
}

/// The answer a fetch's `outcome` gives `query`, written in `out` for `limit`.
pub(super) fn written(
    query: &Query<'_>,
    limit: usize,
    outcome: &Outcome,
    out: &mut Vec<u8>,
) -> Source {
    match outcome {
        // What the fetch just brought goes out with the upstream's AA, as node-cache relays it;
        // only what is served from the cache (a stale entry here) sets AA.
        Outcome::Entry(entry, ttl, Source::Upstream) => {
            entry.reply().write_relayed(query, *ttl, limit, out);
            Source::Upstream
        }
        Outcome::Entry(entry, ttl, source) => {
            entry.reply().write_answer(query, *ttl, limit, out);
            *source
        }
        Outcome::Reply(reply, ttl) => {
            reply.write_relayed(query, *ttl, limit, out);
            Source::Upstream
        }
        Outcome::Failed => {
            nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
            Source::ServFail
        }
    }
}

/// Sends one answer. UDP sends never block: a full socket buffer drops the answer (counted), as
/// the kernel would have dropped the query; on the socket's own worker, the answer waits for the
/// others its runtime finishes in the same turn (`udp::send`).
fn send(shared: &Shared, reply_to: ReplyTo, peer: SocketAddr, out: Vec<u8>) {
    match reply_to {
        ReplyTo::Udp(socket) => {
            if !super::udp::send(&socket, out, peer) {
                shared.metrics.counters().send_failed();
            }
        }
        ReplyTo::Tcp(answers) => {
            // The client went away, or does not read its answers.
            if !answers.send(out) {
                shared.metrics.counters().send_failed();
            }
        }
        ReplyTo::Http(request) => {
            // The client went away.
            if request.send(out).is_err() {
                shared.metrics.counters().send_failed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, UdpSocket};
    use std::sync::mpsc as std_mpsc;

    use nodedns_cache::{Policy, Refresh, Stale, Stored};

    use super::*;
    use crate::config::{Config, Forward, Server};
    use crate::metrics::Metrics;

    const NAME: &[u8] = b"\x05stale\x07example\x00";

    /// A query for [`NAME`] A, as a client sends it.
    fn client_query(id: u16) -> Vec<u8> {
        let mut q = vec![0, 0, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        q[..2].copy_from_slice(&id.to_be_bytes());
        q.extend_from_slice(NAME);
        q.extend_from_slice(&[0, 1, 0, 1]);
        q
    }

    /// The answer to `query` (header and question as received): one A record `ip`, TTL 60.
    fn a_answer(query: &[u8], ip: Ipv4Addr) -> Vec<u8> {
        let parsed = Query::parse(query).unwrap();
        let question_end = 12 + parsed.qname().len() + 4;
        let mut r = query[..question_end].to_vec();
        r[2] = 0x81; // QR, RD
        r[3] = 0x80; // RA, NOERROR
        r[6..12].copy_from_slice(&[0, 1, 0, 0, 0, 0]);
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&ip.octets());
        r
    }

    /// An upstream that holds every query it gets (telling the test on `arrived` when it is for
    /// [`NAME`]: the group's health checks ask for `.`) until the test sends an address on
    /// `release`, then answers the held ones with it.
    fn holding_upstream(socket: UdpSocket) -> (std_mpsc::Receiver<()>, std_mpsc::Sender<Ipv4Addr>) {
        let (arrived_tx, arrived) = std_mpsc::channel();
        let (release, release_rx) = std_mpsc::channel::<Ipv4Addr>();
        socket
            .set_read_timeout(Some(Duration::from_millis(10)))
            .unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let mut buf = [0u8; 1500];
            loop {
                if let Ok((n, peer)) = socket.recv_from(&mut buf) {
                    held.push((buf[..n].to_vec(), peer));
                    if buf[..n].get(12..).is_some_and(|q| q.starts_with(NAME)) {
                        let _ = arrived_tx.send(());
                    }
                }
                match release_rx.try_recv() {
                    Ok(ip) => {
                        for (query, peer) in held.drain(..) {
                            let _ = socket.send_to(&a_answer(&query, ip), peer);
                        }
                    }
                    Err(std_mpsc::TryRecvError::Empty) => {}
                    Err(std_mpsc::TryRecvError::Disconnected) => return,
                }
            }
        });
        (arrived, release)
    }

    /// One block for `.` with serve-stale, forwarding to `upstream` over UDP. A failed exchange
    /// starts the health checks, and the second failed check marks the upstream down, 10 ms
    /// later; checks that go unanswered (the holding upstream answers none until the test
    /// releases it) keep it down.
    fn config(listen: SocketAddr, upstream: SocketAddr) -> Config {
        Config {
            servers: vec![Server {
                zones: vec![".".to_owned()],
                listen: vec![listen],
                cache: Some(Policy {
                    stale: Some(Stale {
                        window: Duration::from_secs(3600),
                        ttl: 30,
                        refresh: Refresh::Verify { timeout: None },
                        recheck: Duration::ZERO,
                        prefer_positive: false,
                    }),
                    ..Policy::default()
                }),
                forwards: vec![Forward {
                    from: ".".to_owned(),
                    except: Vec::new(),
                    next: Vec::new(),
                    upstream: nodedns_upstream::Config {
                        addrs: vec![upstream],
                        transport: nodedns_upstream::Transport::PreferUdp,
                        max_fails: 1,
                        health_check: Duration::from_millis(10),
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
            }],
            ..Config::default()
        }
    }

    /// Where the tests' block listens (nothing is bound there: the tests call the pipeline).
    const LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 53));

    /// The pipeline's state for [`config`], forwarding to a port nothing listens on yet (the
    /// upstream is down: ICMP port unreachable), and that port.
    fn agent_before_a_closed_port() -> (Arc<Shared>, SocketAddr) {
        let closed = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = closed.local_addr().unwrap();
        drop(closed);
        (agent_forwarding_to(upstream), upstream)
    }

    /// The pipeline's state for [`config`], forwarding to `upstream`.
    fn agent_forwarding_to(upstream: SocketAddr) -> Arc<Shared> {
        let metrics = Arc::new(Metrics::new(&[LISTEN], true));
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        let config = Arc::new(config(LISTEN, upstream));
        let taps = crate::dnstap::Metrics::default();
        let snapshot = Snapshot::build(
            config,
            None,
            &upstream_metrics,
            &Default::default(),
            &metrics,
            &taps,
        )
        .unwrap();
        Arc::new(Shared::new(
            snapshot,
            metrics,
            Default::default(),
            Default::default(),
        ))
    }

    /// A client's UDP socket (answers within 5 s, or the read fails) and its [`Client`].
    fn udp_client() -> (UdpSocket, Client) {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let client = Client {
            proto: Proto::Udp,
            addr: socket.local_addr().unwrap(),
        };
        (socket, client)
    }

    fn rejected(metrics: &Arc<Metrics>) -> u64 {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(crate::metrics::Exposition::new(
            metrics.clone(),
            Vec::new,
        )));
        let text = crate::metrics::text(&registry);
        let line = text
            .lines()
            .find(|l| l.starts_with("nodedns_singleflight_rejected_total "))
            .expect("the rejection counter");
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// Issue 13 (part 3): with the only upstream down, 6,000 stale hits of one name start one
    /// background refresh, reject nobody, and a client that misses the name while the refresh
    /// runs gets the refreshed answer once the upstream is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stale_hits_while_the_upstream_is_down_start_one_refresh_that_misses_join() {
        let (shared, upstream) = agent_before_a_closed_port();
        let (listen, metrics) = (LISTEN, shared.metrics.clone());
        let runtime = tokio::runtime::Handle::current();
        let snap = shared.snapshot.load_full();
        let zone = snap.zones[0].clone();
        let (cache, group) = (zone.cache.clone().unwrap(), zone.forwards[0].group.clone());

        // The name was cached a while ago; then the upstream went down.
        let stored = Instant::now();
        let reply = Reply::parse(&a_answer(&client_query(1), Ipv4Addr::new(10, 0, 0, 1))).unwrap();
        let key = Query::parse(&client_query(1)).unwrap().key();
        assert!(matches!(
            cache.store(key.as_bytes(), reply, stored),
            Stored::Entry(_)
        ));
        assert!(group.query(&client_query(2)).await.is_err());
        let deadline = Instant::now() + Duration::from_secs(5);
        while group.healthy() {
            assert!(
                Instant::now() < deadline,
                "the failure's health checks mark the only upstream down"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // It comes back, slowly: it holds what it gets until the test lets it answer.
        let (arrived, release) = holding_upstream(UdpSocket::bind(upstream).unwrap());

        let counters = metrics.worker(listen);
        let log = shared.querylog.single_writer();
        let to = Recorder {
            counters: &counters,
            clients: None,
            log: &log,
        };
        let client = Client {
            proto: Proto::Udp,
            addr: "10.244.0.7:40000".parse().unwrap(),
        };
        let expired = stored + Duration::from_secs(90);
        let mut refreshes = 0;
        let mut out = Vec::new();
        for i in 0..6000u16 {
            match answer(
                &to,
                &snap,
                &client_query(i),
                listen,
                &client,
                expired,
                &mut out,
            ) {
                Front::Answered => {}
                Front::AnsweredRefresh(r) => {
                    refreshes += 1;
                    refresh(&shared, &runtime, r);
                }
                other => panic!("stale hit {i}: {other:?}"),
            }
            assert_eq!(out[3] & 0x0f, 0, "answered NOERROR from the stale entry");
        }
        assert_eq!(refreshes, 1, "one refresh for 6,000 stale hits");
        arrived
            .recv_timeout(Duration::from_secs(5))
            .expect("the refresh went upstream");
        let sizes = zone.flights.sizes();
        assert_eq!(
            (sizes.fetches, sizes.waiters),
            (1, 0),
            "a refresh has no waiter"
        );
        assert_eq!(rejected(&metrics), 0, "every client had its answer");

        // Past the stale window a client misses; it joins the refresh under way.
        let listener = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let (client_socket, client) = udp_client();
        let gone = stored + Duration::from_secs(60 + 3600 + 1);
        let query = client_query(0x4242);
        let Front::Miss(mut miss) = answer(&to, &snap, &query, listen, &client, gone, &mut out)
        else {
            panic!("a miss past the stale window");
        };
        let waiter = miss.waiter(&query, ReplyTo::Udp(listener), client, Instant::now());
        spawn(&shared, &runtime, miss, waiter);
        let deadline = Instant::now() + Duration::from_secs(5);
        while zone.flights.sizes().waiters == 0 {
            assert!(
                Instant::now() < deadline,
                "the miss never joined the refresh"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            zone.flights.sizes().fetches,
            1,
            "joined, not a second fetch"
        );

        release.send(Ipv4Addr::new(10, 0, 0, 2)).unwrap();
        let mut buf = [0u8; 512];
        let n = client_socket.recv(&mut buf).expect("the client's answer");
        let answer = &buf[..n];
        assert_eq!(&answer[..2], &0x4242u16.to_be_bytes(), "its own ID");
        assert_eq!(answer[3] & 0x0f, 0, "NOERROR, not SERVFAIL");
        assert!(
            answer.ends_with(&[10, 0, 0, 2]),
            "the refreshed address: {answer:02x?}"
        );
        assert!(matches!(
            cache.lookup(key.as_bytes(), Instant::now()),
            Lookup::Fresh { .. }
        ));
        assert_eq!(rejected(&metrics), 0);
        assert_eq!(zone.flights.sizes().fetches, 0);
    }

    /// A miss that finds, when it comes to fetch, that another fetch stored its key since its
    /// cache look-up takes that entry: no upstream query, answered as a hit.
    #[tokio::test]
    async fn a_miss_whose_key_was_stored_meanwhile_does_not_go_upstream() {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = socket.local_addr().unwrap();
        let (arrived, _release) = holding_upstream(socket);
        let shared = agent_forwarding_to(upstream);
        let snap = shared.snapshot.load_full();
        let (counters, log) = (
            shared.metrics.worker(LISTEN),
            shared.querylog.single_writer(),
        );
        let to = Recorder {
            counters: &counters,
            clients: None,
            log: &log,
        };
        let (client_socket, client) = udp_client();
        let query = client_query(0x4343);
        let mut out = Vec::new();
        let now = Instant::now();
        let Front::Miss(mut miss) = answer(&to, &snap, &query, LISTEN, &client, now, &mut out)
        else {
            panic!("a cold cache misses");
        };
        // Another fetch of the key ends now, before this miss joins.
        let reply = Reply::parse(&a_answer(&query, Ipv4Addr::new(10, 0, 0, 3))).unwrap();
        let cache = snap.zones[0].cache.as_ref().unwrap();
        assert!(matches!(
            cache.store(miss.key.as_bytes(), reply, now),
            Stored::Entry(_)
        ));
        let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let waiter = miss.waiter(&query, ReplyTo::Udp(socket), client, now);
        spawn(&shared, &tokio::runtime::Handle::current(), miss, waiter);
        let mut buf = [0u8; 512];
        let n = tokio::task::spawn_blocking(move || {
            client_socket.recv(&mut buf).map(|n| buf[..n].to_vec())
        })
        .await
        .unwrap()
        .expect("the client's answer");
        assert!(n.ends_with(&[10, 0, 0, 3]), "the stored address: {n:02x?}");
        assert!(
            arrived.try_recv().is_err(),
            "the upstream never saw the name"
        );
    }

    /// A miss whose fetch failed, answered from an entry stored meanwhile, is an answer from the
    /// cache: the query log says so (`upstream-failed-cache`), not `upstream`.
    #[tokio::test]
    async fn a_fresh_entry_after_a_failed_fetch_is_labelled_as_the_caches() {
        let (shared, _) = agent_before_a_closed_port();
        let snap = shared.snapshot.load_full();
        let zone = &snap.zones[0];
        let key = Query::parse(&client_query(1)).unwrap().key();
        let reply = Reply::parse(&a_answer(&client_query(1), Ipv4Addr::new(10, 0, 0, 1))).unwrap();
        let cache = zone.cache.as_ref().unwrap();
        assert!(matches!(
            cache.store(key.as_bytes(), reply, Instant::now()),
            Stored::Entry(_)
        ));
        match fetch(&shared, zone, &key, true).await {
            Outcome::Entry(_, _, source) => {
                assert_eq!(
                    source,
                    Source::FreshAfterMiss(nodedns_cache::Class::Success)
                );
                assert_eq!(source.as_str(), "upstream-failed-cache");
            }
            Outcome::Reply(..) | Outcome::Failed => panic!("the stored entry answers"),
        }
    }

    /// The snapshot of `config`, counted in `shared`'s metrics.
    fn snapshot(config: Config, shared: &Shared) -> Snapshot {
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        Snapshot::build(
            Arc::new(config),
            None,
            &upstream_metrics,
            &Default::default(),
            &shared.metrics,
            &Default::default(),
        )
        .unwrap()
    }

    /// A block with `hosts` (ttl 3600) and `cache` (success TTL 30): the first query is
    /// answered by hosts and stored, with the TTL the cache caps it to; the second is a hit.
    /// A name hosts does not know and `forward` does not take gets SERVFAIL.
    #[tokio::test]
    async fn hosts_answers_are_stored_in_the_cache_with_its_ttl_cap() {
        let (shared, upstream) = agent_before_a_closed_port();
        let mut config = config(LISTEN, upstream);
        let server = &mut config.servers[0];
        server.cache.as_mut().unwrap().success.max = 30;
        server.forwards[0].from = "other.".to_owned();
        server.chain.hosts = Some(crate::plugin::hosts::Hosts {
            file: "/nonexistent/hosts".into(),
            zones: vec![".".to_owned()],
            inline: vec!["10.9.9.9 stale.example".to_owned()],
            ttl: 3600,
            reload: None,
            reverse: true,
            fallthrough: Some(vec![".".to_owned()]),
            at: "test".to_owned(),
        });
        let snap = snapshot(config, &shared);
        let counters = shared.metrics.worker(LISTEN);
        let log = shared.querylog.single_writer();
        let to = Recorder {
            counters: &counters,
            log: &log,
            clients: None,
        };
        let client = Client {
            proto: Proto::Udp,
            addr: "10.244.0.7:40000".parse().unwrap(),
        };
        let mut out = Vec::new();
        let now = Instant::now();
        let front = answer(&to, &snap, &client_query(7), LISTEN, &client, now, &mut out);
        assert!(matches!(front, Front::Answered), "{front:?}");
        let reply = hickory_proto::op::Message::from_vec(&out).unwrap();
        assert_eq!(reply.metadata.id, 7);
        assert!(reply.metadata.authoritative);
        assert_eq!(reply.answers.len(), 1);
        assert_eq!(reply.answers[0].ttl, 30, "capped by the cache");
        let key = Query::parse(&client_query(7)).unwrap().key();
        let cache = snap.zones[0].cache.as_ref().unwrap();
        assert!(matches!(
            cache.lookup(key.as_bytes(), now),
            Lookup::Fresh { .. }
        ));
        let later = now + Duration::from_secs(10);
        let front = answer(
            &to,
            &snap,
            &client_query(8),
            LISTEN,
            &client,
            later,
            &mut out,
        );
        assert!(matches!(front, Front::Answered), "{front:?}");
        let reply = hickory_proto::op::Message::from_vec(&out).unwrap();
        assert_eq!(reply.answers[0].ttl, 20, "a hit: the TTL left");

        // Unknown to hosts (fallthrough), outside `forward`: the end of the chain.
        let mut other = client_query(9);
        other[12..12 + NAME.len()].copy_from_slice(b"\x05other\x07example\x00");
        let front = answer(&to, &snap, &other, LISTEN, &client, now, &mut out);
        assert!(matches!(front, Front::Answered), "{front:?}");
        assert_eq!(out[3] & 0x0f, 2, "SERVFAIL");
    }

    /// `query` with its question's type `qtype`.
    fn of_type(mut query: Vec<u8>, qtype: u16) -> Vec<u8> {
        let at = 12 + NAME.len();
        query[at..at + 2].copy_from_slice(&qtype.to_be_bytes());
        query
    }

    /// The NODATA answer to the AAAA `query`, its SOA's TTL 50.
    fn nodata(query: &[u8]) -> Reply {
        use hickory_proto::rr::{Name, RData, Record, rdata};
        let mut nodata = Message::from_vec(query).unwrap();
        nodata.metadata.message_type = hickory_proto::op::MessageType::Response;
        nodata.authorities.push(Record::from_rdata(
            Name::from_ascii("example.").unwrap(),
            50,
            RData::SOA(rdata::SOA::new(
                Name::from_ascii("ns.example.").unwrap(),
                Name::from_ascii("hostmaster.example.").unwrap(),
                1,
                7200,
                1800,
                86400,
                300,
            )),
        ));
        Reply::parse(&plugin::encode(&nodata).unwrap()).unwrap()
    }

    /// The snapshot of [`config`] forwarding to `upstream`, with `dns64`.
    fn dns64_snapshot(
        shared: &Shared,
        upstream: SocketAddr,
        dns64: crate::plugin::dns64::Dns64,
    ) -> Snapshot {
        let mut config = config(LISTEN, upstream);
        config.servers[0].chain.before.dns64 = Some(dns64);
        snapshot(config, shared)
    }

    /// A block with `dns64` whose cache holds the AAAA NODATA (SOA TTL 50) and the A answer
    /// (TTL 60) of a name: an IPv6 client's AAAA query is answered at once, from both entries,
    /// not authoritative, with the smaller TTL; an IPv4 client gets the NODATA as cached.
    #[tokio::test]
    async fn dns64_answers_from_two_cached_entries_on_the_listeners_thread() {
        let (shared, upstream) = agent_before_a_closed_port();
        let snap = dns64_snapshot(&shared, upstream, Default::default());
        let now = Instant::now();
        let cache = snap.zones[0].cache.as_ref().unwrap();
        let key = |q: &[u8]| Query::parse(q).unwrap().key();
        let aaaa_query = of_type(client_query(1), rtype::AAAA);
        cache.store(key(&aaaa_query).as_bytes(), nodata(&aaaa_query), now);
        let a_query = client_query(1);
        let a = Reply::parse(&a_answer(&a_query, Ipv4Addr::new(10, 0, 0, 1))).unwrap();
        cache.store(key(&a_query).as_bytes(), a, now);
        let counters = shared.metrics.worker(LISTEN);
        let log = shared.querylog.single_writer();
        let to = Recorder {
            counters: &counters,
            log: &log,
            clients: None,
        };
        let mut out = Vec::new();
        let v6 = Client {
            proto: Proto::Udp,
            addr: "[fd00::7]:40000".parse().unwrap(),
        };
        let query = of_type(client_query(0x77), rtype::AAAA);
        let front = answer(&to, &snap, &query, LISTEN, &v6, now, &mut out);
        assert!(matches!(front, Front::Answered), "{front:?}");
        let reply = Message::from_vec(&out).unwrap();
        assert_eq!(reply.metadata.id, 0x77);
        assert!(!reply.metadata.authoritative, "synthesized");
        let answers: Vec<String> = reply.answers.iter().map(ToString::to_string).collect();
        assert_eq!(answers, ["stale.example. 50 IN AAAA 64:ff9b::a00:1"]);

        let v4 = Client {
            proto: Proto::Udp,
            addr: "10.244.0.7:40000".parse().unwrap(),
        };
        let front = answer(&to, &snap, &query, LISTEN, &v4, now, &mut out);
        assert!(matches!(front, Front::Answered), "{front:?}");
        let reply = Message::from_vec(&out).unwrap();
        assert!(reply.metadata.authoritative, "the cached NODATA");
        assert!(reply.answers.is_empty());
        assert_eq!(reply.authorities.len(), 1);
    }

    /// A cached AAAA NODATA whose A answer is not cached: the query becomes a miss of the A
    /// question, which goes upstream; when it comes, the client gets the AAAA answer made from
    /// it, and the A answer is cached.
    #[tokio::test]
    async fn dns64_fetches_the_a_answer_a_cached_nodata_needs() {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = socket.local_addr().unwrap();
        let (arrived, release) = holding_upstream(socket);
        let shared = agent_forwarding_to(upstream);
        let dns64 = crate::plugin::dns64::Dns64 {
            allow_ipv4: true,
            ..Default::default()
        };
        let snap = dns64_snapshot(&shared, upstream, dns64);
        let now = Instant::now();
        let cache = snap.zones[0].cache.as_ref().unwrap();
        let aaaa_query = of_type(client_query(1), rtype::AAAA);
        let aaaa_key = Query::parse(&aaaa_query).unwrap().key();
        cache.store(aaaa_key.as_bytes(), nodata(&aaaa_query), now);
        let counters = shared.metrics.worker(LISTEN);
        let log = shared.querylog.single_writer();
        let to = Recorder {
            counters: &counters,
            log: &log,
            clients: None,
        };
        let (client_socket, client) = udp_client();
        let query = of_type(client_query(0x99), rtype::AAAA);
        let mut out = Vec::new();
        let Front::Miss(mut miss) = answer(&to, &snap, &query, LISTEN, &client, now, &mut out)
        else {
            panic!("the A question misses");
        };
        assert_eq!(miss.key.qtype(), rtype::A);
        let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let waiter = miss.waiter(&query, ReplyTo::Udp(socket), client, now);
        assert!(waiter.dns64.is_some(), "the AAAA answer waits with it");
        spawn(&shared, &tokio::runtime::Handle::current(), miss, waiter);
        let (asked, release) = tokio::task::spawn_blocking(move || {
            let asked = arrived.recv_timeout(Duration::from_secs(5));
            (asked, release)
        })
        .await
        .unwrap();
        asked.expect("the A question went upstream");
        release.send(Ipv4Addr::new(10, 0, 0, 5)).unwrap();
        let mut buf = [0u8; 512];
        let got = tokio::task::spawn_blocking(move || {
            client_socket.recv(&mut buf).map(|n| buf[..n].to_vec())
        })
        .await
        .unwrap()
        .expect("the client's answer");
        let reply = Message::from_vec(&got).unwrap();
        assert_eq!(reply.metadata.id, 0x99);
        assert_eq!(
            reply.queries[0].query_type(),
            hickory_proto::rr::RecordType::AAAA
        );
        assert!(!reply.metadata.authoritative);
        let answers: Vec<String> = reply.answers.iter().map(ToString::to_string).collect();
        assert_eq!(answers, ["stale.example. 50 IN AAAA 64:ff9b::a00:5"]);
        let a_key = Query::parse(&client_query(1)).unwrap().key();
        assert!(matches!(
            cache.lookup(a_key.as_bytes(), Instant::now()),
            Lookup::Fresh { .. }
        ));
        drop(release);
    }

    /// A block with `loadbalance` and `bufsize 512`: hits of a stored three-address entry come
    /// out rotated by the query's ID, and an EDNS client's 1232 is answered with 512.
    #[tokio::test]
    async fn hits_go_through_the_plugins_before_the_cache() {
        let (shared, upstream) = agent_before_a_closed_port();
        let mut config = config(LISTEN, upstream);
        config.servers[0].chain.before = crate::plugin::Before {
            bufsize: Some(crate::plugin::bufsize::Bufsize { size: 512 }),
            dns64: None,
            loadbalance: Some(crate::plugin::loadbalance::Loadbalance),
        };
        let snap = snapshot(config, &shared);
        let now = Instant::now();
        let mut stored = a_answer(&client_query(1), Ipv4Addr::new(10, 0, 0, 1));
        stored[7] = 3;
        for last in [2, 3] {
            stored.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 10, 0, 0, last]);
        }
        let key = Query::parse(&client_query(1)).unwrap().key();
        let cache = snap.zones[0].cache.as_ref().unwrap();
        cache.store(key.as_bytes(), Reply::parse(&stored).unwrap(), now);
        let counters = shared.metrics.worker(LISTEN);
        let log = shared.querylog.single_writer();
        let to = Recorder {
            counters: &counters,
            log: &log,
            clients: None,
        };
        let client = Client {
            proto: Proto::Udp,
            addr: "10.244.0.7:40000".parse().unwrap(),
        };
        let mut out = Vec::new();
        let mut firsts = Vec::new();
        for id in 0..3u16 {
            let mut query = client_query(id);
            query[11] = 1;
            query.extend_from_slice(&[0, 0, 41, 0x04, 0xd0, 0, 0, 0, 0, 0, 0]);
            let front = answer(&to, &snap, &query, LISTEN, &client, now, &mut out);
            assert!(matches!(front, Front::Answered), "{front:?}");
            let reply = hickory_proto::op::Message::from_vec(&out).unwrap();
            assert_eq!(reply.answers.len(), 3);
            assert_eq!(reply.edns.as_ref().unwrap().max_payload(), 512);
            firsts.push(reply.answers[0].data.to_string());
        }
        assert_eq!(firsts, ["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    }

    /// A block with `rewrite name stale.example other.example`: the upstream is asked the
    /// rewritten name, and the reply is reverted before it is cached, under the name the
    /// client asked. A rule that makes an invalid name sends nothing and fails the fetch.
    #[tokio::test]
    async fn a_rewritten_miss_asks_the_new_name_and_caches_the_reverted_reply() {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = socket.local_addr().unwrap();
        let (asked_tx, asked) = std_mpsc::channel::<Vec<u8>>();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((n, peer)) = socket.recv_from(&mut buf) {
                let query = buf[..n].to_vec();
                // The owner written out (no pointer into the question, which the pipeline
                // overwrites with the client's): only the revert can give it the asked name.
                let asked = Message::from_vec(&query).unwrap();
                let mut reply = asked.clone();
                reply.metadata.message_type = hickory_proto::op::MessageType::Response;
                reply.answers.push(hickory_proto::rr::Record::from_rdata(
                    asked.queries[0].name.clone(),
                    60,
                    hickory_proto::rr::RData::A(Ipv4Addr::new(10, 0, 0, 9).into()),
                ));
                let _ = socket.send_to(&plugin::encode(&reply).unwrap(), peer);
                if asked_tx.send(query).is_err() {
                    return;
                }
            }
        });
        let shared = agent_forwarding_to(upstream);
        let rules = |line: &str| {
            let blocks = crate::plugin::testing::blocks(&format!(". {{\n    {line}\n}}\n"));
            let mut value = crate::plugin::rewrite::Rewrite::default();
            let mut problems = Vec::new();
            value.add(&blocks[0].directives[0], "Corefile", &mut problems);
            assert!(problems.is_empty(), "{problems:?}");
            let mut config = config(LISTEN, upstream);
            config.servers[0].chain.rewrite = Some(crate::plugin::Written {
                text: line.to_owned(),
                value,
            });
            snapshot(config, &shared)
        };
        let snap = rules("rewrite name exact stale.example other.example");
        let zone = &snap.zones[0];
        let key = Query::parse(&client_query(1)).unwrap().key();
        let Outcome::Entry(entry, ttl, Source::Upstream) = fetch(&shared, zone, &key, true).await
        else {
            panic!("the upstream's reply is stored");
        };
        let sent = asked.recv().unwrap();
        let sent = Message::from_vec(&sent).unwrap();
        assert_eq!(sent.queries[0].name.to_ascii(), "other.example.");
        let mut out = Vec::new();
        let query = client_query(2);
        entry
            .reply()
            .write_answer(&Query::parse(&query).unwrap(), ttl, 512, &mut out);
        let reply = Message::from_vec(&out).unwrap();
        assert_eq!(reply.queries[0].name.to_ascii(), "stale.example.");
        assert_eq!(reply.answers.len(), 1);
        assert_eq!(
            reply.answers[0].name.to_ascii(),
            "stale.example.",
            "reverted"
        );
        let cache = zone.cache.as_ref().unwrap();
        assert!(matches!(
            cache.lookup(key.as_bytes(), Instant::now()),
            Lookup::Fresh { .. }
        ));

        let snap = rules(r"rewrite name regex (.*)\.example {1}..example");
        assert!(matches!(
            fetch(&shared, &snap.zones[0], &key, true).await,
            Outcome::Failed
        ));
        assert!(asked.try_recv().is_err(), "nothing was sent upstream");
    }
}
