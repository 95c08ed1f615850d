//! `dns64` on the request path (`crate::plugin::dns64` holds its configuration and synthesis).
//!
//! CoreDNS's dns64 sits before the cache: it passes an AAAA query down the chain, and when the
//! answer calls for it, asks the server itself the A question (`upstream.Lookup`: the whole
//! chain again, so the cache, the plugins after it and `forward`) and writes the AAAA answer it
//! makes from both. Here the same happens in two places:
//! - [`front`], on the listener's thread: the AAAA question through the block's cache and its
//!   plugins after the cache ([`local`]), then the A question the same way. Both hits (the
//!   usual case: a pod asks A and AAAA at once): answered at once. Either a miss: a [`Miss`] of
//!   its own, the AAAA answer (when there is one) carried in [`Pending`];
//! - [`waiter`], when a fetch ends: an AAAA answer the fetch brought is replaced as above (its
//!   A question, when it misses too, becomes a fetch the waiter joins), and a waiter with a
//!   [`Pending`] gets the answer made from the AAAA answer it carries and the fetched A answer.
//!
//! Both questions are cached as any answer is (single-flight, prefetch and serve-stale
//! included); the synthesized answer is not, as in CoreDNS. The A question is not counted or
//! logged as a query of its own (CoreDNS counts and logs it: its `upstream.Lookup` runs the
//! whole chain, `prometheus` and `log` included).

use std::sync::Arc;
use std::time::Instant;

use nodedns_cache::{Class, Lookup};
use nodedns_wire::{Key, Query, Reply, TtlRule, rcode, rtype};

use super::pipeline::{
    self, Answered, Chained, Front, Miss, Outcome, Recorder, Refresh, TCP_LIMIT, Waiter,
};
use super::request::Source;
use super::{Shared, Zone};
use crate::plugin::dns64::Dns64;

/// The AAAA answer that waits for the A answer to be fetched.
#[derive(Debug)]
pub struct Pending {
    /// The block's `dns64` when the AAAA answer came.
    dns64: Dns64,
    /// The AAAA answer, as written for the client.
    aaaa: Vec<u8>,
    /// The class of its cache entry, when it was a hit.
    hit: Option<Class>,
}

/// What the block answers a question without going upstream.
enum Local {
    /// An answer is in `out` (and the key is to be refreshed in the background, when given:
    /// boxed, as a key is large and rare to refresh).
    Written {
        source: Source,
        refresh: Option<Box<Refresh>>,
    },
    /// SERVFAIL that nodedns or a plugin made is in `out`: no answer that dns64 acts on (in
    /// CoreDNS no message was written).
    Failed(Source),
    /// It goes to `forward`.
    Miss,
}

/// An AAAA query `dns64` takes, on the listener's thread (see the module's documentation).
#[cold]
#[inline(never)]
pub(super) fn front(
    at: &Chained<'_>,
    dns64: Dns64,
    query: &Query<'_>,
    key: Key,
    now: Instant,
    out: &mut Vec<u8>,
) -> Front {
    let (source, refresh) = match local(at, query, &key, now, out) {
        Local::Miss => {
            return pipeline::upstream(at.to, at.zone, key, at.labels, at.client, query, out);
        }
        Local::Failed(source) => return finish(at, query, &key, source, out, None),
        Local::Written { source, refresh } => (source, refresh),
    };
    if !dns64.wants(out) {
        return finish(at, query, &key, source, out, refresh);
    }
    let aaaa = std::mem::take(out);
    let hit = hit(source);
    let packet = a_question(query.bytes());
    let Ok(a) = Query::parse(&packet) else {
        nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
        return finish(at, query, &key, Source::ServFail, out, refresh);
    };
    let a_key = a.key();
    let mut a_out = Vec::with_capacity(512);
    let whole = Chained {
        limit: TCP_LIMIT,
        ..*at
    };
    let a_refresh = match local(&whole, &a, &a_key, now, &mut a_out) {
        Local::Miss => {
            if let Some(refresh) = refresh {
                refresh.entry.release_refresh();
            }
            return Front::Miss(Miss {
                zone: at.zone.clone(),
                key: a_key,
                labels: at.labels,
                dns64: Some(Box::new(Pending { dns64, aaaa, hit })),
                layout: query.layout(),
            });
        }
        Local::Failed(_) => None,
        Local::Written { refresh, .. } => refresh,
    };
    synthesized(at.zone, &dns64, query, &aaaa, &a_out, at.limit, out);
    // One refresh per answer: the listener starts it; the other entry's claim is released.
    let refresh = match (refresh, a_refresh) {
        (Some(aaaa), a) => {
            if let Some(a) = a {
                a.entry.release_refresh();
            }
            Some(aaaa)
        }
        (None, a) => a,
    };
    finish(at, query, &key, Source::Dns64(hit), out, refresh)
}

/// The last steps of an answer the front wrote: the plugins before the cache, the records.
fn finish(
    at: &Chained<'_>,
    query: &Query<'_>,
    key: &Key,
    source: Source,
    out: &mut Vec<u8>,
    refresh: Option<Box<Refresh>>,
) -> Front {
    pipeline::before_cache(at.zone, query, out);
    let answered = Answered {
        client: at.client,
        query,
        qname: key.qname(),
        source,
        response: out,
        elapsed: std::time::Duration::ZERO,
    };
    pipeline::record(
        at.to,
        at.labels,
        &at.zone.taps,
        &at.zone.server.log,
        answered,
    );
    match refresh {
        Some(refresh) => {
            at.to.counters.prefetch(at.labels.series);
            Front::AnsweredRefresh(*refresh)
        }
        None => Front::Answered,
    }
}

/// The answer of a fetch for a waiter of a block with plugins before the cache, written in
/// `out` for `limit`: what answered and the waiter, or `None` when the waiter was handed to the
/// fetch of its A question.
pub(super) fn waiter(
    shared: &Arc<Shared>,
    zone: &Arc<Zone>,
    mut waiter: Waiter,
    query: &Query<'_>,
    limit: usize,
    outcome: &Outcome,
    out: &mut Vec<u8>,
) -> Option<(Source, Waiter)> {
    if let Some(pending) = waiter.dns64.take() {
        // The fetch answered the A question.
        let packet = a_question(query.bytes());
        let mut a_out = Vec::with_capacity(512);
        if let Ok(a) = Query::parse(&packet) {
            pipeline::written(&a, TCP_LIMIT, outcome, &mut a_out);
        }
        synthesized(
            zone,
            &pending.dns64,
            query,
            &pending.aaaa,
            &a_out,
            limit,
            out,
        );
        return Some((Source::Dns64(pending.hit), waiter));
    }
    let source = pipeline::written(query, limit, outcome, out);
    let client = waiter.client;
    let Some(dns64) = zone
        .plugins
        .before()
        .dns64
        .filter(|d| d.takes(query, client.addr))
    else {
        return Some((source, waiter));
    };
    // A fetch that failed wrote no message (CoreDNS's forward returns the error to dns64).
    if matches!(outcome, Outcome::Failed) || !dns64.wants(out) {
        return Some((source, waiter));
    }
    let aaaa = std::mem::take(out);
    let hit = hit(source);
    let packet = a_question(query.bytes());
    let Ok(a) = Query::parse(&packet) else {
        nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
        return Some((Source::ServFail, waiter));
    };
    let a_key = a.key();
    let to = Recorder {
        counters: shared.metrics.shared(waiter.labels.series),
        clients: shared.clients.shared(),
        log: &shared.querylog,
    };
    let at = Chained {
        to: &to,
        zone,
        forward: zone.forward_for(a_key.qname(), 0).is_some(),
        labels: waiter.labels,
        client: &client,
        limit: TCP_LIMIT,
    };
    let mut a_out = Vec::with_capacity(512);
    let runtime = tokio::runtime::Handle::try_current();
    match local(&at, &a, &a_key, Instant::now(), &mut a_out) {
        Local::Miss => {
            let Ok(runtime) = runtime else {
                nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
                return Some((Source::ServFail, waiter));
            };
            let miss = Miss {
                zone: zone.clone(),
                key: a_key,
                labels: waiter.labels,
                dns64: None,
                layout: waiter.layout,
            };
            waiter.query = query.bytes().into();
            waiter.dns64 = Some(Box::new(Pending { dns64, aaaa, hit }));
            pipeline::spawn(shared, &runtime, miss, waiter);
            return None;
        }
        Local::Failed(_) | Local::Written { refresh: None, .. } => {}
        Local::Written {
            refresh: Some(refresh),
            ..
        } => match runtime {
            Ok(runtime) => {
                to.counters.prefetch(waiter.labels.series);
                pipeline::refresh(shared, &runtime, *refresh);
            }
            Err(_) => refresh.entry.release_refresh(),
        },
    }
    synthesized(zone, &dns64, query, &aaaa, &a_out, limit, out);
    Some((Source::Dns64(hit), waiter))
}

/// `query` answered through the block's cache and its plugins after the cache, as the front
/// would (a stale entry at once under the same rule), into `out` for `at.limit`.
fn local(at: &Chained<'_>, query: &Query<'_>, key: &Key, now: Instant, out: &mut Vec<u8>) -> Local {
    let zone = at.zone;
    if !at.forward && zone.plugins.is_empty() {
        nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out);
        return Local::Failed(Source::Unhandled);
    }
    let cache = zone.cache.as_ref().filter(|c| c.covers(key.qname()));
    if let Some(cache) = cache {
        match cache.lookup(key.as_bytes(), now) {
            Lookup::Fresh {
                entry,
                ttl,
                prefetch,
            } => {
                entry.reply().write_answer(query, ttl, at.limit, out);
                let source = Source::Hit(entry.class());
                let refresh = prefetch.then(|| {
                    Box::new(Refresh {
                        zone: zone.clone(),
                        key: key.clone(),
                        entry,
                    })
                });
                return Local::Written { source, refresh };
            }
            Lookup::Stale { entry, ttl }
                if zone.plugins.is_empty()
                    && pipeline::stale_at_once(cache, &entry, zone, key.qname(), now) =>
            {
                entry.reply().write_answer(query, ttl, at.limit, out);
                let source = Source::StaleHit(entry.class());
                let refresh = entry.claim_refresh(now).then(|| {
                    Box::new(Refresh {
                        zone: zone.clone(),
                        key: key.clone(),
                        entry,
                    })
                });
                return Local::Written { source, refresh };
            }
            Lookup::Stale { .. } | Lookup::Miss => {}
        }
    }
    if !zone.plugins.is_empty() {
        match pipeline::chained(at, query, key, cache, now, out) {
            Some(source @ (Source::PluginServFail | Source::Unhandled)) => {
                return Local::Failed(source);
            }
            Some(source) => {
                return Local::Written {
                    source,
                    refresh: None,
                };
            }
            None => {}
        }
    }
    Local::Miss
}

/// The answer `dns64` makes for `query` from the AAAA answer `aaaa` and the A answer `a`,
/// written in `out` for `limit` (the client's OPT added, cut with TC beyond it); SERVFAIL if
/// either does not decode.
fn synthesized(
    zone: &Zone,
    dns64: &Dns64,
    query: &Query<'_>,
    aaaa: &[u8],
    a: &[u8],
    limit: usize,
    out: &mut Vec<u8>,
) {
    let made = dns64
        .synthesize(query, aaaa, a)
        .and_then(|bytes| Reply::parse(&bytes).ok());
    match made {
        Some(reply) => {
            reply.write_relayed(query, TtlRule::STORED, limit, out);
            zone.plugins.translated();
        }
        None => nodedns_wire::write_error(query, rcode::SERVFAIL.into(), out),
    }
}

/// The class of the cache entry that answered, when a hit did.
fn hit(source: Source) -> Option<Class> {
    match source {
        Source::Hit(class) | Source::StaleHit(class) => Some(class),
        _ => None,
    }
}

/// The AAAA query `packet` asking A instead (CoreDNS's `NewWithQuestion`: the same ID, flags,
/// name as written and OPT).
fn a_question(packet: &[u8]) -> Vec<u8> {
    let mut bytes = packet.to_vec();
    if let Ok(query) = Query::parse(packet) {
        let at = nodedns_wire::HEADER_LEN + query.qname().len();
        if let Some(qtype) = bytes.get_mut(at..at + 2) {
            qtype.copy_from_slice(&rtype::A.to_be_bytes());
        }
    }
    bytes
}
