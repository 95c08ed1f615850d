//! One cached reply and its lifetime.

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

/// A cached reply, when it was stored, and for how long it is fresh.
#[derive(Debug)]
pub struct Entry {
    reply: Reply,
    class: Class,
    stored: Instant,
    /// Lifetime after clamping, in seconds.
    ttl: u32,
}

impl Entry {
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
}
