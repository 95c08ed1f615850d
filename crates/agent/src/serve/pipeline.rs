//! The request pipeline shared by the UDP and TCP listeners.
//!
//! [`answer`] is the synchronous front: parse, route, look the cache up, and either write the
//! answer (a hit, or a refusal) or say that the query must go upstream. [`spawn`] hands a miss to
//! the async back (`resolve`): single-flight, the upstream exchange, caching the reply, and
//! answering every client that waited for it; at most [`MAX_PENDING`] at once. A cache hit never
//! reaches it and never touches the async runtime.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nodedns_cache::{Joined, Lookup, Stored};
use nodedns_wire::{Key, ParseError, Query, Reply, TtlRule, rcode};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::{InFlight, Shared, Snapshot, Zone};
use crate::metrics::{Client, Counters, Labels, Proto, Source};

/// What the synchronous front decided for one packet.
#[derive(Debug)]
pub enum Front {
    /// `out` holds the answer: send it.
    Answered,
    /// `out` holds the answer: send it; and refresh the key in the background (prefetch, or a
    /// stale answer given while the upstream is down).
    AnsweredRefresh(Miss),
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
}

/// Where the answer to a waiting query goes.
#[derive(Debug)]
pub enum ReplyTo {
    /// Back out of the UDP socket the query came in on, to the client's address (the socket is
    /// bound to the address the query was sent to, so the answer leaves from that address).
    Udp(Arc<std::net::UdpSocket>),
    /// The connection's writer. The permit is one of the connection's in-flight slots, given
    /// back when the answer is queued; the channel has one place per slot, so queuing never
    /// waits.
    Tcp(mpsc::Sender<Vec<u8>>, OwnedSemaphorePermit),
    /// A background refresh (prefetch, stale refresh): nobody to answer.
    Nobody,
}

/// A client waiting for an upstream answer: its query as received (to patch the answer for it)
/// and where to send the answer.
#[derive(Debug)]
pub struct Waiter {
    pub query: Box<[u8]>,
    pub reply_to: ReplyTo,
    pub client: Client,
    pub started: Instant,
    /// Its metric labels (from [`Miss::labels`]).
    pub labels: Labels,
}

impl Waiter {
    /// A waiter for a background refresh.
    pub fn nobody() -> Self {
        Waiter {
            query: Box::default(),
            reply_to: ReplyTo::Nobody,
            client: Client {
                proto: Proto::Udp,
                addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            },
            started: Instant::now(),
            labels: Labels::default(),
        }
    }
}

/// Largest answer over TCP (RFC 1035 §4.2.2: a 16-bit length).
pub const TCP_LIMIT: usize = 65535;

/// Decides what to do with one packet. When it returns [`Front::Answered`] or
/// [`Front::AnsweredRefresh`], the answer is in `out`.
///
/// Runs for every packet on the listener's own thread: it allocates nothing (after `out` has
/// grown once) and takes no lock.
pub fn answer(
    counters: &Counters,
    snap: &Snapshot,
    packet: &[u8],
    local: SocketAddr,
    client: &Client,
    now: Instant,
    out: &mut Vec<u8>,
) -> Front {
    let query = match Query::parse(packet) {
        Ok(query) => query,
        Err(err) => return malformed(counters, packet, err, out),
    };
    let key = query.key();
    let limit = match client.proto {
        Proto::Udp => query.udp_limit(),
        Proto::Tcp => TCP_LIMIT,
    };
    let Some((zone, route)) = snap.route(key.qname(), local) else {
        nodedns_wire::write_error(&query, rcode::REFUSED.into(), out);
        counters.answered(
            counters.dropped(),
            client,
            &query,
            Source::Refused,
            out,
            Duration::ZERO,
        );
        return Front::Answered;
    };
    let labels = counters.labels(
        zone.label + route.zone,
        zone.cache.is_some(),
        zone.server.log,
    );
    // Outside the block's `forward` (no forward, not under FROM, or an `except` name): nothing
    // in nodedns answers it.
    if !route.forward || zone.group.is_none() {
        nodedns_wire::write_error(&query, rcode::REFUSED.into(), out);
        counters.answered(labels, client, &query, Source::Refused, out, Duration::ZERO);
        return Front::Answered;
    }
    let Some(cache) = &zone.cache else {
        return Front::Miss(Miss {
            zone: zone.clone(),
            key,
            labels,
        });
    };
    match cache.lookup(key.as_bytes(), now) {
        Lookup::Fresh {
            entry,
            ttl,
            prefetch,
        } => {
            entry.reply().write_answer(&query, ttl, limit, out);
            let source = Source::Hit(entry.class());
            counters.answered(labels, client, &query, source, out, Duration::ZERO);
            if prefetch {
                counters.prefetch(labels);
                return Front::AnsweredRefresh(Miss {
                    zone: zone.clone(),
                    key,
                    labels,
                });
            }
            Front::Answered
        }
        // RFC 8767 §5: when the upstream is known to be down, answer stale at once rather than
        // make the client wait for a fetch that will fail; refresh in the background.
        Lookup::Stale { entry, ttl } if zone.group.as_ref().is_some_and(|g| !g.healthy()) => {
            entry.reply().write_answer(&query, ttl, limit, out);
            let source = Source::StaleHit(entry.class());
            counters.answered(labels, client, &query, source, out, Duration::ZERO);
            Front::AnsweredRefresh(Miss {
                zone: zone.clone(),
                key,
                labels,
            })
        }
        // Otherwise try upstream first; `resolve` falls back to the stale entry if it fails.
        Lookup::Stale { .. } | Lookup::Miss => Front::Miss(Miss {
            zone: zone.clone(),
            key,
            labels,
        }),
    }
}

fn malformed(counters: &Counters, packet: &[u8], err: ParseError, out: &mut Vec<u8>) -> Front {
    counters.malformed();
    match err.rcode() {
        Some(rcode) if nodedns_wire::write_formerr(packet, rcode, out) => Front::Answered,
        _ => Front::Dropped,
    }
}

/// The answer every waiter of one fetch gets.
enum Outcome {
    /// From the cache entry the fetch just stored (or a stale one when the fetch failed).
    Entry(Arc<nodedns_cache::Entry>, TtlRule, Source),
    /// A reply that was not cached (not cacheable, or the block has no cache).
    Reply(Reply),
    /// Nothing usable: SERVFAIL, not cached.
    Failed,
}

/// Misses handed to the async runtime and not answered yet, at most (process-wide). Beyond it a
/// miss is answered SERVFAIL at once by the listener that read it: a flood of unique names must
/// find this bound, not grow the runtime's queue of tasks (and the memory) without end. Well
/// above what the upstreams take at once (`max_concurrent`, 1000 per block by default) plus the
/// clients waiting on those fetches, so only a flood reaches it.
pub const MAX_PENDING: usize = 4096;

/// Hands a miss to `runtime` ([`resolve`]), unless [`MAX_PENDING`] misses are pending already:
/// then the waiter gets SERVFAIL now (counted as a SERVFAIL answer), and a background refresh
/// is skipped.
pub fn spawn(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle, miss: Miss, waiter: Waiter) {
    let Some(in_flight) = shared.track(MAX_PENDING) else {
        answer_waiter(shared, waiter, &Outcome::Failed);
        return;
    };
    runtime.spawn(resolve(shared.clone(), miss, waiter, in_flight));
}

/// Resolves a miss: joins (or leads) the fetch for its key, and when the leader's fetch ends,
/// answers every waiter.
async fn resolve(shared: Arc<Shared>, miss: Miss, waiter: Waiter, _in_flight: InFlight) {
    let Miss { zone, key, .. } = miss;
    // A probe of the loop check is answered but never stored: a cached answer (a SERVFAIL from
    // the looping upstream, say) would hide its next arrival from the check.
    let probe = shared.loops.armed() && shared.loops.arrived(&key, &waiter);
    match zone.flights.join(key.as_bytes(), waiter) {
        Joined::Leader => {}
        Joined::Follower => return,
        Joined::Full(waiter) => {
            shared.metrics.counters().flight_full();
            answer_waiter(&shared, waiter, &Outcome::Failed);
            return;
        }
    }
    let outcome = fetch(&shared, &zone, &key, !probe).await;
    for waiter in zone.flights.complete(key.as_bytes()) {
        answer_waiter(&shared, waiter, &outcome);
    }
}

/// Fetches `key` upstream, stores the reply (if `store` and the block has a cache), and returns
/// what waiters get.
async fn fetch(shared: &Shared, zone: &Zone, key: &Key, store: bool) -> Outcome {
    let Some(group) = &zone.group else {
        return Outcome::Failed;
    };
    let mut query = Vec::with_capacity(64);
    if nodedns_wire::build_query(key.as_bytes(), 0, &mut query).is_none() {
        return Outcome::Failed;
    }
    let reply = match group.query(&query).await {
        Ok(bytes) => Reply::parse(&bytes).map_err(|err| {
            tracing::debug!(%err, "upstream reply unusable");
        }),
        Err(err) => {
            shared.metrics.upstream_failed(
                zone.label,
                zone.server.errors,
                key.qname(),
                key.qtype(),
                &err,
            );
            Err(())
        }
    };
    let now = Instant::now();
    let Some(cache) = zone.cache.as_ref().filter(|_| store) else {
        return reply.map_or(Outcome::Failed, Outcome::Reply);
    };
    match reply {
        Ok(reply) => match cache.store(key.as_bytes(), reply, now) {
            Stored::Entry(entry) => {
                let ttl = TtlRule {
                    age: 0,
                    cap: entry.ttl(),
                };
                Outcome::Entry(entry, ttl, Source::Upstream)
            }
            Stored::NotCacheable(reply) => Outcome::Reply(reply),
        },
        // The upstream failed: an expired entry still inside the stale window is better than
        // SERVFAIL (RFC 8767 §4).
        Err(()) => match cache.lookup(key.as_bytes(), now) {
            Lookup::Stale { entry, ttl } => Outcome::Entry(entry, ttl, Source::StaleAfterMiss),
            // Refreshed by another fetch meanwhile.
            Lookup::Fresh { entry, ttl, .. } => Outcome::Entry(entry, ttl, Source::Upstream),
            Lookup::Miss => Outcome::Failed,
        },
    }
}

fn answer_waiter(shared: &Shared, waiter: Waiter, outcome: &Outcome) {
    if matches!(waiter.reply_to, ReplyTo::Nobody) {
        return;
    }
    let Ok(query) = Query::parse(&waiter.query) else {
        return;
    };
    let limit = match waiter.client.proto {
        Proto::Udp => query.udp_limit(),
        Proto::Tcp => TCP_LIMIT,
    };
    let mut out = Vec::with_capacity(512);
    let source = match outcome {
        Outcome::Entry(entry, ttl, source) => {
            entry.reply().write_answer(&query, *ttl, limit, &mut out);
            *source
        }
        Outcome::Reply(reply) => {
            reply.write_answer(
                &query,
                TtlRule {
                    age: 0,
                    cap: u32::MAX,
                },
                limit,
                &mut out,
            );
            Source::Upstream
        }
        Outcome::Failed => {
            nodedns_wire::write_error(&query, rcode::SERVFAIL.into(), &mut out);
            Source::ServFail
        }
    };
    let elapsed = waiter.started.elapsed();
    let labels = waiter.labels;
    shared
        .metrics
        .shared(labels)
        .answered(labels, &waiter.client, &query, source, &out, elapsed);
    send(shared, waiter.reply_to, waiter.client.addr, out);
}

/// Sends one answer. UDP sends never block: a full socket buffer drops the answer (counted), as
/// the kernel would have dropped the query.
fn send(shared: &Shared, reply_to: ReplyTo, peer: SocketAddr, out: Vec<u8>) {
    match reply_to {
        ReplyTo::Udp(socket) => {
            if super::udp::send_nonblocking(&socket, &out, peer).is_err() {
                shared.metrics.counters().send_failed();
            }
        }
        ReplyTo::Tcp(tx, _permit) => {
            // Closed: the client went away.
            if tx.try_send(out).is_err() {
                shared.metrics.counters().send_failed();
            }
        }
        ReplyTo::Nobody => {}
    }
}
