//! How long each class of reply is kept. Defaults are CoreDNS's cache plugin's, which is what
//! node-local-dns users run today.

use std::time::Duration;

/// Lower and upper bound, in seconds, for the lifetime of one class of entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamp {
    pub min: u32,
    pub max: u32,
}

/// Serve-stale (RFC 8767): answer from an expired entry when upstream cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    /// How long after expiry an entry may still be served (RFC 8767 §5 suggests 1–3 days;
    /// CoreDNS's default is 1 h).
    pub window: Duration,
    /// TTL put in stale answers (RFC 8767 §4: 30 s).
    pub ttl: u32,
}

/// Prefetch: refresh a popular entry before it expires, so hot names never miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// Hits an entry needs (since it was stored) to be worth refreshing.
    pub amount: u32,
    /// Refresh once the remaining lifetime is at most this percentage of the stored TTL.
    pub percentage: u8,
}

/// Everything that decides what one cache keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Total bytes of entries (keys, replies, bookkeeping) the cache may hold.
    pub capacity_bytes: u64,
    /// Lifetime bounds for positive answers (NOERROR with records in the answer section).
    pub success: Clamp,
    /// Lifetime bounds for NXDOMAIN and NODATA.
    pub denial: Clamp,
    /// How long a SERVFAIL from upstream is kept (CoreDNS: 5 s; 0 disables).
    pub servfail_ttl: u32,
    pub stale: Option<Stale>,
    pub prefetch: Option<Prefetch>,
}

/// A policy that cannot work, with every bad field named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cache policy: {}", .problems.join("; "))]
pub struct PolicyError {
    pub problems: Vec<String>,
}

impl Default for Policy {
    /// CoreDNS's `cache` defaults: success [5 s, 3600 s], denial [5 s, 1800 s], SERVFAIL 5 s,
    /// no serve-stale, no prefetch; 16 MiB.
    fn default() -> Self {
        todo!()
    }
}

impl Policy {
    /// Checks every field at once (min ≤ max, percentage in 1..=100, capacity > 0, ...).
    pub fn validate(&self) -> Result<(), PolicyError> {
        todo!()
    }
}
