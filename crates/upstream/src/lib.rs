//! Talking to CoreDNS: pooled TCP connections, UDP where asked, IDs, deadlines, retries, health
//! and failover between upstream addresses.
//!
//! A [`Group`] is one `forward` target set: several upstream addresses, a selection policy, and
//! per address a pool of long-lived TCP connections. It takes a complete query message and
//! returns the validated reply bytes; it knows nothing about caching.
//!
//! Facts this crate is built on:
//! - CoreDNS serves one TCP connection serially (it reads the next query after answering the
//!   previous one) and closes a connection after 10 s idle. So each pooled connection carries one
//!   query at a time, the pool grows with concurrency up to a cap, idle connections are closed
//!   before CoreDNS would, and a query that fails on a reused connection is retried once on a
//!   fresh one (the server may have closed it just before we wrote).
//! - A reply is accepted only from the connection or socket that sent the query, with the same
//!   ID (random per attempt) and the same question.

use std::net::SocketAddr;
use std::time::Duration;

/// How a group reaches its upstreams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP only (CoreDNS `force_tcp`; nodedns's default towards CoreDNS).
    Tcp,
    /// UDP first, TCP when the reply is truncated (CoreDNS `prefer_udp`; what the node's own
    /// resolvers usually expect).
    PreferUdp,
}

/// Which upstream a query goes to first (CoreDNS `policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    Random,
    RoundRobin,
    Sequential,
}

/// One forward target set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Upstream addresses, in the order given (at most 15, as CoreDNS).
    pub addrs: Vec<SocketAddr>,
    pub transport: Transport,
    pub selection: Selection,
    /// Consecutive failures after which an upstream is considered down and health-checked
    /// (CoreDNS `max_fails`, default 2; 0 disables health tracking).
    pub max_fails: u32,
    /// Interval of the health check (`. IN NS`) while an upstream is down (default 0.5 s).
    pub health_check: Duration,
    /// Idle TCP connections are closed after this long (default 5 s, below CoreDNS's 10 s).
    pub expire: Duration,
    /// TCP connections per upstream address at most.
    pub max_connections: usize,
    /// Queries in flight in this group at most; beyond it a query fails at once with
    /// [`Error::Overloaded`] (CoreDNS `max_concurrent`).
    pub max_concurrent: usize,
    /// Deadline for a whole query, every retry and failover included (default 2 s: well before a
    /// stub resolver's 5 s timeout).
    pub timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            addrs: Vec::new(),
            transport: Transport::Tcp,
            selection: Selection::Random,
            max_fails: 2,
            health_check: Duration::from_millis(500),
            expire: Duration::from_secs(5),
            max_connections: 64,
            max_concurrent: 1000,
            timeout: Duration::from_secs(2),
        }
    }
}
