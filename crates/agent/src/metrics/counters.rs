//! The counter blocks the request path writes, and their layout.
//!
//! Counting must not slow the hit path:
//! - each UDP worker thread owns a [`Counters`] block that only it writes, so a count is a relaxed
//!   load and store: no locked instruction, no lock, no allocation;
//! - the TCP listeners and the async (miss) path share one block per listen address and count
//!   with atomic adds;
//! - every label is an array index known before the query arrives ([`Series`]): the block
//!   belongs to one listen address (`server`, `family`); a server block's zones own contiguous
//!   slots, so the matched zone is the block's first slot plus the zone's index (`zone`); type,
//!   RCODE, protocol, `plugin` and histogram bucket come from small fixed sets
//!   ([`super::labels`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nodedns_cache::Class;
use nodedns_wire::{Header, Query};

use super::labels::{
    PLUGINS, Plugin, RCODES, SIZE_SLOTS, TIME_SLOTS, TRANSPORTS, TYPES, Transport, class_index,
    qtype_index, size_bucket, time_bucket,
};

/// Zone label slots. Slot 0 is CoreDNS's `dropped` zone (queries no server block serves). Each
/// distinct list of server-block zones gets contiguous slots for the life of the process, so a
/// reload never moves counts from one zone name to another; the last slot takes the zones of
/// blocks that found no room (`other`).
pub const ZONE_SLOTS: usize = 32;
pub(super) const DROPPED: usize = 0;
pub(super) const OVERFLOW: usize = ZONE_SLOTS - 1;

const PROTOS: usize = TRANSPORTS.len();

/// Layout of one zone slot's counters in a block.
pub(super) mod at {
    use super::{PLUGINS, PROTOS, RCODES, SIZE_SLOTS, TIME_SLOTS, TYPES};
    /// `coredns_dns_requests_total`: [proto][type].
    pub const REQUESTS: usize = 0;
    /// `coredns_dns_do_requests_total`.
    pub const DO: usize = REQUESTS + PROTOS * TYPES;
    /// `coredns_dns_responses_total`: [rcode][plugin].
    pub const RESPONSES: usize = DO + 1;
    /// `coredns_dns_request_duration_seconds`: [bucket], not cumulative.
    pub const DURATION: usize = RESPONSES + RCODES * PLUGINS.len();
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
pub(super) mod event {
    use super::{ZONE_SLOTS, at::PER_ZONE};
    pub const MALFORMED: usize = ZONE_SLOTS * PER_ZONE;
    pub const FLIGHT_FULL: usize = MALFORMED + 1;
    pub const SEND_FAILED: usize = FLIGHT_FULL + 1;
    pub const RECV_FAILED: usize = SEND_FAILED + 1;
    pub const TCP_REFUSED: usize = RECV_FAILED + 1;
    pub const FORBIDDEN_SOURCE: usize = TCP_REFUSED + 1;
    pub const RATE_TRUNCATED: usize = FORBIDDEN_SOURCE + 1;
    pub const RATE_DROPPED: usize = RATE_TRUNCATED + 1;
    pub const CELLS: usize = RATE_DROPPED + 1;
}

/// The series one query counts in: its listen address and its zone slot, resolved before it is
/// counted ([`Counters::series`], [`Counters::dropped`]). `Copy`, so a query that goes upstream
/// carries it to the task that answers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Series {
    /// Index of the listen address (`server`, `family`).
    pub(super) server: u16,
    /// Zone slot (`zone`, and the block's `zones`).
    pub(super) zone: u16,
}

/// How the cache took part in an answer (the `coredns_cache_*` families).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Not at all: the block has no cache, or the query was refused before the cache.
    Bypassed,
    /// A fresh entry of this class answered.
    Hit(Class),
    /// An expired entry answered at once (a hit, served stale).
    StaleHit(Class),
    /// The query missed and waited for an upstream fetch (whatever answered it then).
    Miss,
    /// The query missed, the fetch failed, and an expired entry answered (served stale).
    StaleMiss,
}

/// One answered query, as the counters see it: label values and sizes, nothing of how the
/// request path got there (the request path maps what it did onto this).
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    pub transport: Transport,
    /// The query as received (type, DO bit, size).
    pub query: &'a Query<'a>,
    /// The answer sent (RCODE, size).
    pub response: &'a [u8],
    pub plugin: Plugin,
    pub cache: CacheUse,
    /// Zero for answers the listener gave at once: reading the clock per query would cost more
    /// than the answer (they land in the first bucket, 0.25 ms, either way).
    pub elapsed: Duration,
}

/// One block of counters: one UDP worker's, or the block one listen address's TCP connections
/// and async answers share.
#[derive(Debug)]
pub struct Counters {
    pub(super) cells: Box<[AtomicU64]>,
    pub(super) server: u16,
    /// Only one thread writes: counts are a load and a store instead of a locked add.
    single_writer: bool,
    /// `--no-metrics` turns counting off.
    counting: bool,
    /// The `server` label of the block's listen address (the query log writes it too).
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
    pub(super) fn new(server: usize, name: Arc<str>, single_writer: bool, counting: bool) -> Self {
        Counters {
            cells: (0..event::CELLS).map(|_| AtomicU64::new(0)).collect(),
            server: u16::try_from(server).unwrap_or(u16::MAX),
            single_writer,
            counting,
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

    pub(super) fn get(&self, i: usize) -> u64 {
        self.cells.get(i).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The `server` label of this block's listen address.
    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// The series of a query a server block serves: `zone_slot` is the block's first zone slot
    /// ([`super::Metrics::zone_slots`]) plus the matched zone's index in the block.
    #[inline]
    pub fn series(&self, zone_slot: usize) -> Series {
        Series {
            server: self.server,
            zone: u16::try_from(zone_slot.min(OVERFLOW)).unwrap_or(OVERFLOW as u16),
        }
    }

    /// The series of a query no server block serves (CoreDNS's `dropped` zone).
    #[inline]
    pub fn dropped(&self) -> Series {
        Series {
            server: self.server,
            zone: DROPPED as u16,
        }
    }

    /// Counts one answered query: request, response, duration, sizes, and how the cache took
    /// part. Called exactly once per answer sent (or handed to the socket). Inlined: a call
    /// with this many arguments costs a fifth of the counting itself.
    #[inline(always)]
    pub fn answered(&self, series: Series, answer: Answer<'_>) {
        if !self.counting {
            return;
        }
        // One branch on the kind of block, not one per count.
        if self.single_writer {
            self.count::<true>(series, answer);
        } else {
            self.count::<false>(series, answer);
        }
    }

    #[inline(always)]
    fn count<const SINGLE_WRITER: bool>(&self, series: Series, answer: Answer<'_>) {
        let z = usize::from(series.zone).min(OVERFLOW) * at::PER_ZONE;
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
        let Answer {
            transport,
            query,
            response,
            plugin,
            cache,
            elapsed,
        } = answer;
        let p = transport as usize;
        add(at::REQUESTS + p * TYPES + qtype_index(query.qtype()), 1);
        if query.dnssec_ok() {
            add(at::DO, 1);
        }
        let rcode = Header::read(response).map_or(0, |h| usize::from(h.rcode()));
        add(at::RESPONSES + rcode * PLUGINS.len() + plugin as usize, 1);
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
        match cache {
            CacheUse::Bypassed => {}
            CacheUse::Hit(class) => add(at::HITS + class_index(class), 1),
            CacheUse::StaleHit(class) => {
                add(at::HITS + class_index(class), 1);
                add(at::STALE, 1);
            }
            CacheUse::Miss => add(at::MISSES, 1),
            CacheUse::StaleMiss => {
                add(at::MISSES, 1);
                add(at::STALE, 1);
            }
        }
    }

    /// A cache hit started a prefetch of its entry.
    pub fn prefetch(&self, series: Series) {
        if self.counting {
            self.add(
                usize::from(series.zone).min(OVERFLOW) * at::PER_ZONE + at::PREFETCH,
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
    /// A UDP datagram from a source no answer may go to (port 0, unspecified, broadcast,
    /// multicast), dropped unread.
    pub fn forbidden_source(&self) {
        self.add(event::FORBIDDEN_SOURCE, 1);
    }
    /// A UDP query beyond its client's rate limit: answered TC=1 (`truncated`) or dropped.
    pub fn rate_limited(&self, truncated: bool) {
        self.add(
            if truncated {
                event::RATE_TRUNCATED
            } else {
                event::RATE_DROPPED
            },
            1,
        );
    }
}
