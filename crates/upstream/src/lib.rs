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
//!
//! Map:
//! - [`Group`]: validation, selection among the addresses, the query's deadline split across
//!   attempts, retries and failover, admission (`max_concurrent`), readiness probes.
//! - `pool`: per address, the TCP connections (LIFO idle stack, a slot semaphore capping them at
//!   `max_connections`, the idle reaper) and the one-query-at-a-time exchange on a connection.
//! - `udp`: one exchange over a fresh connected UDP socket.
//! - `health`: consecutive failures, the down mark, and what wakes the health checker.
//! - [`Metrics`]: CoreDNS 1.11's forward/proxy metric names, plus nodedns's own for the pool.
//!
//! Must never: know about the cache or the client that asked; hand a connection with a query
//! still outstanding back to the pool; return a reply that failed validation; block a runtime
//! thread (every wait is an await bounded by the query's deadline).

mod group;
mod health;
mod metrics;
mod msg;
mod pool;
mod udp;

#[cfg(test)]
mod scripted;

use std::net::SocketAddr;
use std::time::Duration;

pub use group::Group;
pub use metrics::Metrics;

/// Most upstream addresses in one group (CoreDNS's limit for `forward`).
pub const MAX_ADDRS: usize = 15;

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

/// Why a query got no reply. Named by what failed; none of them allocates, so the hot path can
/// count and drop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `max_concurrent` queries were already in flight in the group; the query was not sent
    /// (CoreDNS answers REFUSED here; counted in `coredns_forward_max_concurrent_rejects_total`).
    #[error("max_concurrent queries already in flight")]
    Overloaded,
    /// The deadline (`timeout`) passed before any upstream answered, or while waiting for a free
    /// connection.
    #[error("no upstream answered within the deadline")]
    Timeout,
    /// Every attempt failed fast (connection refused, reset or closed) and the retries ran out
    /// before the deadline.
    #[error("no upstream could be reached")]
    Unreachable,
    /// Upstreams answered, but every reply was rejected: wrong ID, another question, or not a
    /// DNS response.
    #[error("every upstream reply was rejected (wrong ID or question, or malformed)")]
    BadReply,
    /// The query cannot be forwarded: shorter than a DNS header, larger than 65535 bytes, or a
    /// response rather than a query.
    #[error("not a DNS query that can be forwarded")]
    BadQuery,
}

/// One thing wrong with a [`Config`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("no upstream address")]
    NoAddrs,
    #[error("{0} upstream addresses, at most {MAX_ADDRS}")]
    TooManyAddrs(usize),
    #[error(
        "upstream {0} cannot be sent to (port 0, or an unspecified, multicast or broadcast address)"
    )]
    BadAddr(SocketAddr),
    #[error("health_check is zero while max_fails is not: the checker would spin")]
    HealthCheck,
    #[error("expire is zero: no connection could ever be reused")]
    Expire,
    #[error("max_connections is zero: no query could be sent")]
    MaxConnections,
    #[error("max_concurrent is zero: every query would be refused")]
    MaxConcurrent,
    #[error("timeout is zero: every query would time out")]
    Timeout,
}

/// A [`Config`] that cannot be used, with every problem found (not just the first).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid upstream configuration: {}", .problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct ConfigError {
    pub problems: Vec<Invalid>,
}

impl Config {
    /// Checks every field and reports every problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        if self.addrs.is_empty() {
            problems.push(Invalid::NoAddrs);
        }
        if self.addrs.len() > MAX_ADDRS {
            problems.push(Invalid::TooManyAddrs(self.addrs.len()));
        }
        for addr in &self.addrs {
            let ip = addr.ip();
            let broadcast = matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast());
            if addr.port() == 0 || ip.is_unspecified() || ip.is_multicast() || broadcast {
                problems.push(Invalid::BadAddr(*addr));
            }
        }
        if self.max_fails > 0 && self.health_check.is_zero() {
            problems.push(Invalid::HealthCheck);
        }
        if self.expire.is_zero() {
            problems.push(Invalid::Expire);
        }
        if self.max_connections == 0 {
            problems.push(Invalid::MaxConnections);
        }
        if self.max_concurrent == 0 {
            problems.push(Invalid::MaxConcurrent);
        }
        if self.timeout.is_zero() {
            problems.push(Invalid::Timeout);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_with_an_address_is_valid() {
        let config = Config {
            addrs: vec!["10.96.0.10:53".parse().unwrap()],
            ..Config::default()
        };
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn every_bad_field_is_reported_at_once() {
        let config = Config {
            addrs: vec!["0.0.0.0:53".parse().unwrap(), "10.0.0.1:0".parse().unwrap()],
            max_fails: 2,
            health_check: Duration::ZERO,
            expire: Duration::ZERO,
            max_connections: 0,
            max_concurrent: 0,
            timeout: Duration::ZERO,
            ..Config::default()
        };
        let err = config.validate().unwrap_err();
        assert_eq!(
            err.problems,
            [
                Invalid::BadAddr("0.0.0.0:53".parse().unwrap()),
                Invalid::BadAddr("10.0.0.1:0".parse().unwrap()),
                Invalid::HealthCheck,
                Invalid::Expire,
                Invalid::MaxConnections,
                Invalid::MaxConcurrent,
                Invalid::Timeout,
            ]
        );
        let text = err.to_string();
        assert!(
            text.contains("0.0.0.0:53") && text.contains("timeout is zero"),
            "{text}"
        );
    }

    #[test]
    fn no_addresses_or_more_than_fifteen_are_rejected() {
        let none = Config::default().validate().unwrap_err();
        assert_eq!(none.problems, [Invalid::NoAddrs]);
        let many = Config {
            addrs: (1..=16)
                .map(|i| SocketAddr::from(([10, 0, 0, i], 53)))
                .collect(),
            ..Config::default()
        };
        assert_eq!(
            many.validate().unwrap_err().problems,
            [Invalid::TooManyAddrs(16)]
        );
    }

    #[test]
    fn zero_health_check_is_fine_when_health_tracking_is_off() {
        let config = Config {
            addrs: vec!["[fd00::10]:53".parse().unwrap()],
            max_fails: 0,
            health_check: Duration::ZERO,
            ..Config::default()
        };
        assert_eq!(config.validate(), Ok(()));
    }

    #[tokio::test]
    async fn a_group_keeps_an_address_listed_twice_once() {
        let a: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let b: SocketAddr = "127.0.0.2:5353".parse().unwrap();
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let group = Group::new(
            Config {
                addrs: vec![a, b, a],
                ..Config::default()
            },
            &metrics,
        )
        .unwrap();
        assert_eq!(group.config().addrs, [a, b]);
    }

    #[tokio::test]
    async fn a_bad_config_builds_no_group() {
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let err = Group::new(Config::default(), &metrics).unwrap_err();
        assert_eq!(err.problems, [Invalid::NoAddrs]);
    }
}
