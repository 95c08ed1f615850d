//! What is cached, and for how long.
//!
//! The cache holds upstream replies ([`nodedns_wire::Reply`]) under their [`nodedns_wire::Key`]
//! bytes, classifies them (success, denial, server failure; everything else is not kept), clamps
//! their lifetime by policy, bounds the whole by bytes, and tells the caller when an entry is
//! fresh, stale-but-servable (RFC 8767) or due for prefetch. It also keeps the single-flight table
//! that turns many concurrent misses for one key into one upstream query.
//!
//! It never opens a socket and never reads a clock: every call that needs the time takes `now`.
//! (moka's own time-based expiry is not used for that reason; lifetimes are checked against the
//! caller's `now`, and moka only bounds the size.)

mod entry;
mod flight;
mod policy;
mod store;

pub use entry::{Class, Entry};
pub use flight::{Flights, Joined};
pub use policy::{Clamp, Policy, PolicyError, Prefetch, Stale};
pub use store::{Cache, Inserted, Lookup, Stats};
