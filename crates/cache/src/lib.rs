//! What is cached, and for how long.
//!
//! The cache holds upstream replies ([`nodedns_wire::Reply`]) under their [`nodedns_wire::Key`]
//! bytes, classifies them (success, denial, server failure; everything else is not kept), clamps
//! their lifetime by policy, bounds the whole by bytes, and tells the caller when an entry is
//! fresh, stale-but-servable (RFC 8767) or due for prefetch. It also keeps the single-flight table
//! that turns many concurrent misses for one key into one upstream query.
//!
//! It never opens a socket and never reads a clock: every call that needs the time takes `now`,
//! and lifetimes are checked against it on lookup. It knows nothing of tokio or of clients: the
//! single-flight table is generic over what a waiter is.
//!
//! Map:
//! - [`Policy`]: what is kept and for how long (CoreDNS `cache` defaults), validated at once.
//! - [`Cache`]: classify and insert, [`Cache::lookup`] at `now` → fresh / stale / miss. Its store
//!   is the crate's own: shards of a slab indexed by a hash table, evicting by S3-FIFO, so a
//!   flood of names asked once cannot push out the names asked often.
//! - [`Cache::update`]: what an upstream exchange does to the entry held: a failure (SERVFAIL,
//!   REFUSED, no answer) never replaces a usable entry (RFC 8767 §4), nor, with
//!   `prefer_positive`, a denial a positive one; [`Cache::stale_at_once`]: when a stale entry is
//!   answered without asking first.
//! - [`Cache::export`], [`Cache::import`]: entries carried to another cache (an upgrade, a
//!   snapshot), each re-parsed and re-judged by the importing cache's policy.
//! - [`Entry`]: one stored reply with its class, store time and clamped lifetime.
//! - [`Flights`]: one upstream fetch per key, however many clients miss at once; a background
//!   refresh (prefetch, stale refresh) is a fetch of its own with no waiter, at most one per key.
//!
//! Invariants:
//! - A served TTL never exceeds the entry's remaining lifetime (fresh) or the stale TTL (stale):
//!   [`Lookup`] carries the [`nodedns_wire::TtlRule`] that enforces it.
//! - A lookup allocates nothing, and holds one shard's lock only for the probe, the hit count,
//!   the prefetch claim and an `Arc` clone.
//! - The sum of entry weights (key + reply heap bytes + [`ENTRY_OVERHEAD`]) is within
//!   `Policy::capacity_bytes` after every call: each insert evicts until its shard is within its
//!   share. [`ENTRY_OVERHEAD`] is measured, so the heap the entries really use tracks the capacity.

mod carry;
mod entry;
mod flight;
mod policy;
mod stale;
mod store;
#[cfg(test)]
mod testutil;

pub use carry::{Carried, Export, Exported, Refused};
pub use entry::{Class, Entry};
pub use flight::{Flights, Joined, Sizes};
pub use policy::{
    Clamp, MAX_RECHECK, MAX_TTL, MIN_RECHECK, PREFETCH_WINDOW, Policy, PolicyError, Prefetch,
    Refresh, Scope, Stale,
};
pub use stale::{Fetched, Updated};
pub use store::{Cache, ENTRY_OVERHEAD, Found, Lookup, Stats, Stored};
