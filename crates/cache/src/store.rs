//! The byte-bounded map from key bytes to entries.

use std::sync::Arc;
use std::time::Instant;

use nodedns_wire::{Reply, TtlRule};

use crate::{Class, Entry, Policy};

/// A byte-bounded cache of replies.
pub struct Cache {
    policy: Policy,
}

/// The result of a lookup.
#[derive(Debug)]
pub enum Lookup {
    /// Fresh: serve it with `ttl`. `prefetch` is true exactly once per entry, when it became due
    /// for a refresh under the prefetch policy: the caller should refresh it in the background.
    Fresh { entry: Arc<Entry>, ttl: TtlRule, prefetch: bool },
    /// Expired but inside the stale window: serve it with `ttl` (TTLs capped at the stale TTL)
    /// only if upstream cannot answer.
    Stale { entry: Arc<Entry>, ttl: TtlRule },
    /// Nothing usable.
    Miss,
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Stored(Class),
    /// Not cacheable: truncated, REFUSED/FORMERR/NOTIMP/other RCODEs, a denial without SOA
    /// (RFC 2308 §5), SERVFAIL with `servfail_ttl` 0, or a lifetime of 0 after clamping.
    NotCacheable,
}

/// Sizes for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub success: u64,
    pub denial: u64,
    pub servfail: u64,
    pub bytes: u64,
    pub evictions: u64,
}

impl Cache {
    pub fn new(policy: Policy) -> Self {
        let _ = policy;
        todo!()
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Looks `key` up at `now`. Allocates nothing.
    pub fn lookup(&self, key: &[u8], now: Instant) -> Lookup {
        let _ = (key, now);
        todo!()
    }

    /// Classifies `reply`, clamps its lifetime and stores it under `key` at `now`, replacing any
    /// entry there.
    pub fn insert(&self, key: &[u8], reply: Reply, now: Instant) -> Inserted {
        let _ = (key, reply, now);
        todo!()
    }

    pub fn stats(&self) -> Stats {
        todo!()
    }
}
