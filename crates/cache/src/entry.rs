//! One cached reply and its lifetime.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Instant;

use nodedns_wire::Reply;

/// The class of a cached reply; the `type` label of CoreDNS's cache metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// NOERROR with answers.
    Success,
    /// NXDOMAIN, or NOERROR with no answers (NODATA).
    Denial,
    /// SERVFAIL from upstream.
    ServFail,
}

impl Class {
    /// The value of the `type` label CoreDNS's cache metrics use for this class.
    pub fn label(self) -> &'static str {
        match self {
            Class::Success => "success",
            Class::Denial => "denial",
            Class::ServFail => "servfail",
        }
    }
}

/// A cached reply, when it was stored, and for how long it is fresh.
#[derive(Debug)]
pub struct Entry {
    reply: Reply,
    class: Class,
    stored: Instant,
    /// Lifetime after clamping, in seconds.
    ttl: u32,
    /// Fresh lookups that found this entry; decides whether it is popular enough to prefetch.
    /// Relaxed: it is a heuristic, an increment lost to a race changes nothing that matters.
    hits: AtomicU32,
    /// Set by the one lookup that reported this entry due for prefetch, so the caller starts one
    /// refresh per entry, not one per hit while the refresh is under way.
    prefetch_claimed: AtomicBool,
}

impl Entry {
    pub(crate) fn new(reply: Reply, class: Class, ttl: u32, stored: Instant) -> Self {
        Entry {
            reply,
            class,
            stored,
            ttl,
            hits: AtomicU32::new(0),
            prefetch_claimed: AtomicBool::new(false),
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

    /// Fresh hits so far (approximate under concurrency).
    pub fn hits(&self) -> u32 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Counts one fresh hit and returns the count including it.
    pub(crate) fn hit(&self) -> u32 {
        self.hits.fetch_add(1, Ordering::Relaxed).saturating_add(1)
    }

    /// True for exactly one caller over the entry's life.
    pub(crate) fn claim_prefetch(&self) -> bool {
        // Load first: once claimed, every later hit reads a shared cache line instead of
        // writing it.
        !self.prefetch_claimed.load(Ordering::Relaxed)
            && !self.prefetch_claimed.swap(true, Ordering::Relaxed)
    }
}
