//! Talking to CoreDNS: pooled TCP connections (DNS over TLS to `tls://` upstreams), UDP where
//! asked, IDs, deadlines, retries, health and failover between upstream addresses.
//!
//! A [`Group`] is one `forward` target set: several upstream addresses, a selection policy, and
//! per address a pool of long-lived TCP or TLS connections. It takes a complete query message and
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
//! - A connection can go silent without a FIN or a RST (the CoreDNS pod's node died), and
//!   behind a ClusterIP nothing tells which connections lead to the dead endpoint, nor where
//!   the next new one will land until kube-proxy rewrites its rules. So a query silent for
//!   longer than its address usually takes is sent again on another connection (a hedge)
//!   instead of waiting for a timeout, the silent connection is closed once the query is
//!   answered, and a new connection is tried as often as needed.
//!
//! Map:
//! - [`Group`]: validation, selection among the addresses, the exchanges of one query (hedges
//!   after silence, retries after failures, failover, the deadline), admission
//!   (`max_concurrent`), readiness probes.
//! - `pool`: per address, the TCP connections (LIFO idle stack, a slot semaphore capping them at
//!   `max_connections`, the idle reaper) and the one-query-at-a-time exchange on a connection.
//!   A connection is used only on the runtime whose reactor watches its socket; an idle one
//!   another runtime needs moves there.
//! - [`Dial`]: how a pool opens a connection (any byte stream; [`Net`] in production, plain
//!   [`Tcp`] with TLS on top for `tls://` addresses; an in-memory pipe under it in the tests, so
//!   that deadlines, expiry and health checks run on tokio's paused clock), and moves an idle
//!   one to another runtime.
//! - [`tls`]: what a TLS upstream's certificate must satisfy, loaded and checked once per
//!   configuration ([`tls::Settings`]); verification fails closed.
//! - `udp`: one exchange over a fresh connected UDP socket.
//! - `health`: the down mark (CoreDNS's: failed health checks), silence, and what wakes the
//!   health checker.
//! - `rtt`: the round-trip estimate of each address (RFC 6298) and the hedge timeout from it.
//! - [`Metrics`]: CoreDNS 1.11's forward/proxy metric names, plus nodedns's own for the pool.
//!
//! Must never: know about the cache or the client that asked; hand a connection with a query
//! still outstanding back to the pool; return a reply that failed validation; block a runtime
//! thread (every wait is an await bounded by the query's deadline).

mod dial;
mod group;
mod health;
mod metrics;
mod msg;
mod net;
mod pool;
mod rtt;
pub mod tls;
mod udp;

#[cfg(test)]
mod scripted;
#[cfg(test)]
mod testpki;

use std::net::SocketAddr;
use std::time::Duration;

pub use dial::{Dial, Tcp};
pub use group::Group;
pub use metrics::Metrics;
pub use net::{Net, Stream};

/// Most upstream addresses in one group (CoreDNS's limit for `forward`).
pub const MAX_ADDRS: usize = 15;

/// How a group reaches its upstreams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP only (CoreDNS `force_tcp`; nodedns's default towards CoreDNS).
    Tcp,
    /// UDP first, TCP when the reply is truncated (CoreDNS `prefer_udp`; what the node's own
    /// resolvers usually expect). `tls://` upstreams are always reached over TLS.
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
    /// Which of `addrs` are `tls://` upstreams (DNS over TLS, RFC 7858, whatever `transport`
    /// says), and how they are verified. `None`: all of them are plain DNS.
    pub tls: Option<tls::Settings>,
    pub transport: Transport,
    pub selection: Selection,
    /// Consecutive failed health checks beyond which an upstream is down (CoreDNS `max_fails`:
    /// down at the `max_fails + 1`-th; default 2; 0 disables health checking).
    pub max_fails: u32,
    /// Interval of the health checks (`. IN NS`), which start when an exchange fails and go on
    /// until one is answered (CoreDNS `health_check`, default 0.5 s).
    pub health_check: Duration,
    /// What the health checks ask (`health_check ... [no_rec] [domain FQDN]`).
    pub probe: Probe,
    /// Idle TCP connections are closed after this long (default 5 s, below CoreDNS's 10 s).
    pub expire: Duration,
    /// TCP connections per upstream address at most.
    pub max_connections: usize,
    /// Queries in flight in this group at most; beyond it a query fails at once with
    /// [`Error::Overloaded`] (CoreDNS `max_concurrent`).
    pub max_concurrent: usize,
    /// How long one exchange may go without a reply before it has failed (CoreDNS
    /// `read_timeout`, default 2 s), from the moment it has a connection slot (the connect and,
    /// to a `tls://` upstream, the TLS handshake included). Hedges start much earlier; this
    /// bounds what a silent exchange costs.
    pub read_timeout: Duration,
    /// Deadline for a whole query, every hedge, retry and failover included (default 4.5 s: a
    /// slow answer is still worth having while the client waits, and glibc and musl wait 5 s
    /// for an attempt, so the client gets the answer, or a SERVFAIL, rather than its timeout).
    /// CoreDNS has a fixed 5 s.
    pub timeout: Duration,
    /// When every upstream is marked down, fail at once with [`Error::AllDown`] instead of
    /// trying them anyway (CoreDNS `failfast_all_unhealthy_upstreams`).
    pub failfast_all_unhealthy: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            addrs: Vec::new(),
            tls: None,
            transport: Transport::Tcp,
            selection: Selection::Random,
            max_fails: 2,
            health_check: Duration::from_millis(500),
            probe: Probe::default(),
            expire: Duration::from_secs(5),
            max_connections: 64,
            max_concurrent: 1000,
            read_timeout: Duration::from_secs(2),
            timeout: Duration::from_millis(4500),
            failfast_all_unhealthy: false,
        }
    }
}

/// The question of a health check: `NAME IN NS`, as CoreDNS's `forward` asks it. Any reply
/// means the upstream is alive, whatever its RCODE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The name asked, in wire form: the root by default (`domain FQDN` changes it).
    pub name: Vec<u8>,
    /// RD set, the default; `no_rec` clears it (an upstream that refuses recursion still
    /// answers, and a recursive one does not go out to resolve the name).
    pub recursion_desired: bool,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            name: vec![0],
            recursion_desired: true,
        }
    }
}

impl Probe {
    /// The probe's message, ID 0.
    pub fn query(&self) -> Vec<u8> {
        nodedns_wire::ns_query(0, &self.name, self.recursion_desired)
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
    /// connection, or every exchange went unanswered for its `read_timeout`.
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
    /// Every upstream is marked down and `failfast_all_unhealthy` is set: the query was not
    /// sent (CoreDNS answers SERVFAIL).
    #[error("every upstream is marked down")]
    AllDown,
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
    #[error("TLS upstream {0} is not one of the upstream addresses")]
    TlsAddr(SocketAddr),
    #[error("health_check is zero while max_fails is not: the checker would spin")]
    HealthCheck,
    #[error("expire is zero: no connection could ever be reused")]
    Expire,
    #[error("max_connections is zero: no query could be sent")]
    MaxConnections,
    #[error("max_concurrent is zero: every query would be refused")]
    MaxConcurrent,
    #[error("read_timeout is zero: every exchange would time out")]
    ReadTimeout,
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
        for addr in self.tls.iter().flat_map(|t| &t.addrs) {
            if !self.addrs.contains(addr) {
                problems.push(Invalid::TlsAddr(*addr));
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
        if self.read_timeout.is_zero() {
            problems.push(Invalid::ReadTimeout);
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
            read_timeout: Duration::ZERO,
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
                Invalid::ReadTimeout,
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
