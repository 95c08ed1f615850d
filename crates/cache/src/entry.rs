//! One cached reply and its lifetime.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nodedns_wire::Reply;

/// The class of a cached reply: what decides its lifetime (and, in the agent, the `type` label
/// of CoreDNS's cache metrics, where SERVFAIL counts as a denial).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// NOERROR with answers.
    Success,
    /// NXDOMAIN, or NOERROR with no answers (NODATA).
    Denial,
    /// SERVFAIL from upstream.
    ServFail,
}

/// A cached reply, when it was stored, and for how long it is fresh.
#[derive(Debug)]
pub struct Entry {
    reply: Reply,
    class: Class,
    stored: Instant,
    /// Lifetime after clamping, in seconds.
    ttl: u32,
    /// Fresh lookups that found this entry, none more than the prefetch window after the one
    /// before (CoreDNS's `freq`); decides whether it is popular enough to prefetch. Written under
    /// the shard's lock ([`Entry::hit`]); relaxed, read by whoever holds the entry.
    hits: AtomicU32,
    /// When the last of `hits` came: whole seconds after `stored` (the entry's age then).
    last_hit: AtomicU32,
    /// Its background refresh (a prefetch, or a refresh of the stale entry): [`FREE`], under
    /// way ([`UNDER_WAY`]), or failed and not to be tried again before a moment (milliseconds
    /// since `stored`, plus 1). One word, so that claiming and settling are single atomic steps:
    /// one refresh per entry at a time, however many hits come meanwhile.
    refresh: AtomicU64,
}

impl Entry {
    pub(crate) fn new(reply: Reply, class: Class, ttl: u32, stored: Instant) -> Self {
        Entry {
            reply,
            class,
            stored,
            ttl,
            hits: AtomicU32::new(0),
            last_hit: AtomicU32::new(0),
            refresh: AtomicU64::new(FREE),
        }
    }

    pub fn reply(&self) -> &Reply {
        &self.reply
    }
    pub fn class(&self) -> Class {
        self.class
    }
    pub fn ttl(&self) -> u32 {
        self.ttl
    }
    pub fn stored(&self) -> Instant {
        self.stored
    }

    /// Fresh lookups that found this entry so far (whether a client asked for it while it was
    /// fresh: a speculative fetch that nobody asked for shows 0). Since the last gap longer than
    /// the prefetch window, which starts the count again at 1, never at 0.
    pub fn hits(&self) -> u32 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Counts one fresh hit at age `at` (whole seconds since the store) and returns the count
    /// including it: a hit more than `window` seconds after the previous one (or after the
    /// store, for the first) starts the count again at 1, as CoreDNS's `freq.Update` does (to
    /// the second: the ages are whole seconds, which the lookup has at hand).
    ///
    /// Called under the lock of the entry's shard, which orders the hits: plain loads and
    /// stores, no read-modify-write (a locked instruction each on every hit), and `last_hit` is
    /// written only when the second changes.
    pub(crate) fn hit(&self, at: u32, window: u32) -> u32 {
        let last = self.last_hit.load(Ordering::Relaxed);
        if last != at {
            self.last_hit.store(at, Ordering::Relaxed);
        }
        let hits = if at.saturating_sub(last) > window {
            1
        } else {
            self.hits.load(Ordering::Relaxed).saturating_add(1)
        };
        self.hits.store(hits, Ordering::Relaxed);
        hits
    }

    /// Takes over the hits of `old`, the entry this one replaces while `old` was still fresh (a
    /// prefetch): the name stays as popular as it was, as CoreDNS carries a prefetched item's
    /// frequency over.
    pub(crate) fn inherit(&self, old: &Entry) {
        if old.stored() + std::time::Duration::from_secs(old.ttl.into()) > self.stored {
            self.hits
                .store(old.hits.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// True for the one caller that starts the entry's background refresh: none is under way,
    /// and no failed refresh's recheck period runs at `now`. [`crate::Cache::lookup`] claims it
    /// for a prefetch ([`crate::Lookup::Fresh`]'s `prefetch`); a caller that answers the entry
    /// stale at once claims it to refresh the entry, once however many hits it answers
    /// meanwhile. The claim ends when the refresh's result reaches [`crate::Cache::update`]
    /// (a stored reply replaces the entry; a failure keeps it, with its recheck period), or
    /// with [`Entry::release_refresh`] when the refresh could not start.
    pub fn claim_refresh(&self, now: Instant) -> bool {
        // Load first: while one is under way, every later hit reads a shared cache line instead
        // of writing it.
        let state = self.refresh.load(Ordering::Relaxed);
        if state == UNDER_WAY || (state != FREE && self.millis_since_stored(now) < state - 1) {
            return false;
        }
        self.refresh
            .compare_exchange(state, UNDER_WAY, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Ends a claimed refresh that could not start (no room for it, or another fetch of the key
    /// is under way): the next hit may claim it again.
    pub fn release_refresh(&self) {
        self.refresh.store(FREE, Ordering::Relaxed);
    }

    /// A fetch of this entry's key failed at `now` and the entry stays: no background refresh
    /// is claimed before `recheck` has passed (one under way ends here).
    pub(crate) fn refresh_failed(&self, now: Instant, recheck: Duration) {
        let until = u64::try_from(recheck.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(self.millis_since_stored(now));
        // +1: FREE is 0. Never UNDER_WAY.
        let state = until.saturating_add(1).min(UNDER_WAY - 1);
        self.refresh.store(state, Ordering::Relaxed);
    }

    /// Whether a failed fetch's recheck period runs at `now`: the entry is then answered stale
    /// at once, without asking the upstream (RFC 8767 §5).
    pub fn rechecking(&self, now: Instant) -> bool {
        let state = self.refresh.load(Ordering::Relaxed);
        state != FREE && state != UNDER_WAY && self.millis_since_stored(now) < state - 1
    }

    fn millis_since_stored(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.stored);
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
    }
}

/// [`Entry::refresh`]: no refresh claimed.
const FREE: u64 = 0;
/// [`Entry::refresh`]: one under way.
const UNDER_WAY: u64 = u64::MAX;
