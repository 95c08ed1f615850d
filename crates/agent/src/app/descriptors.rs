//! File descriptors: the limit raised at start, and what the TCP client connections may take of
//! it.
//!
//! Containers get a soft `RLIMIT_NOFILE` of 1024 under containerd 2.x (and systemd's default),
//! with a hard limit far above. As Go's runtime does for every Go program (CoreDNS and node-cache
//! included), the agent raises its soft limit to the hard one at start ([`raise`]); the child
//! processes it runs (`nft`, `iptables-restore`) inherit the raised limit.
//!
//! Client connections are the one use of descriptors a client controls, so the default caps on
//! them ([`Caps::derive`]) leave a reserve for everything else the agent must always be able to
//! open ([`reserve`]): its listening sockets (each held twice while served, three times during a
//! hand-over), the admin connections, every upstream connection its pools may open, the files
//! and sockets of a reload, the host plumbing and the hand-over. Beyond the caps a connection is
//! closed at once; an accept that fails anyway (another process of the pod, a limit lowered
//! under it) backs off ([`crate::accept`]).

use std::io;

use nix::sys::resource::{Resource, getrlimit, setrlimit};

use crate::config::Config;

/// Open TCP client connections at most when the descriptors allow more (the cap's default before
/// it was derived from the limit).
pub const MAX_CONNECTIONS: usize = 1024;
/// Open TCP connections from one client address at most when the descriptors allow more.
pub const MAX_PER_CLIENT: usize = 128;
/// The per-client cap is at most this share of the total, so that it takes this many clients to
/// use every connection.
const CLIENTS_TO_FILL: usize = 8;
/// Descriptors of the process besides its sockets: standard streams, the runtime's epoll and
/// wakers, signal handling, the configuration's file watch and the files a reload reads, the
/// netlink sockets of the host plumbing and of the admin's peer check, the hand-over socket,
/// `/proc` reads for the metrics.
const BASE: usize = 64;
/// Each listening socket is held by the listeners and by the generation serving them, and a
/// third time while a hand-over or a take-back passes it between instances.
const PER_LISTENER: usize = 3;
/// Connections one admin address may have open (`admin::MAX_CONNECTIONS`).
const PER_ADMIN_ADDRESS: usize = crate::admin::MAX_CONNECTIONS;

/// The soft and hard `RLIMIT_NOFILE`, before and after [`raise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub before: u64,
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft descriptor limit to the hard one. Called once at start, before any thread.
pub fn raise() -> io::Result<Limit> {
    let (before, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if before < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    Ok(Limit { before, soft, hard })
}

/// The soft descriptor limit in force (what an open beyond it fails with: EMFILE).
pub fn soft_limit() -> u64 {
    getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft)
}

/// Descriptors the agent keeps for everything but client connections, for `config` served by
/// `threads` UDP workers per address on `admin_addrs` admin addresses.
pub fn reserve(config: &Config, threads: usize, admin_addrs: usize) -> usize {
    let dns_addrs: std::collections::BTreeSet<_> = config
        .servers
        .iter()
        .flat_map(|s| s.listen.iter().copied())
        .collect();
    // One UDP socket per worker and one TCP listener per address, and the admin listeners.
    let listeners = dns_addrs.len() * (threads + 1) + admin_addrs;
    // Every block's pool may open its limit to each of its upstream addresses.
    let upstream: usize = config
        .servers
        .iter()
        .flat_map(|s| &s.forwards)
        .map(|f| f.upstream.addrs.len() * f.upstream.max_connections)
        .sum();
    BASE + PER_LISTENER * listeners + PER_ADMIN_ADDRESS * admin_addrs + upstream
}

/// The caps on TCP client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub total: usize,
    /// 0: none.
    pub per_client: usize,
}

impl Caps {
    /// The default caps for a soft limit of `limit` descriptors, `reserve` of them kept for the
    /// rest of the agent: what is left, up to [`MAX_CONNECTIONS`], in all; an eighth of that, up
    /// to [`MAX_PER_CLIENT`], per client. `total` and `per_client` are the flags, when given.
    pub fn derive(
        limit: u64,
        reserve: usize,
        total: Option<usize>,
        per_client: Option<usize>,
    ) -> Caps {
        let left = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .saturating_sub(reserve);
        // Below a handful the agent is misconfigured, not hostile-proof: still serve TCP.
        let total = total.unwrap_or_else(|| left.clamp(16, MAX_CONNECTIONS));
        let per_client = per_client.unwrap_or_else(|| {
            (total / CLIENTS_TO_FILL)
                .clamp(1, MAX_PER_CLIENT)
                .min(total)
        });
        Caps { total, per_client }
    }

    /// Whether `reserve` descriptors and every connection the caps allow fit under `limit`.
    pub fn fit(&self, limit: u64, reserve: usize) -> bool {
        (self.total.saturating_add(reserve) as u64) <= limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Forward, Server};

    fn block(upstreams: usize) -> Server {
        Server {
            zones: vec![".".to_owned()],
            listen: vec!["127.0.0.1:53".parse().unwrap()],
            cache: None,
            forwards: vec![Forward {
                from: ".".to_owned(),
                except: Vec::new(),
                next: Vec::new(),
                upstream: nodedns_upstream::Config {
                    addrs: (0..upstreams)
                        .map(|i| format!("192.0.2.{}:53", i + 1).parse().unwrap())
                        .collect(),
                    ..Default::default()
                },
            }],
            log: Vec::new(),
            errors: false,
            loop_check: false,
            dnstap: Vec::new(),
            chain: Default::default(),
            scheme: Default::default(),
            tls: None,
        }
    }

    #[test]
    fn the_reserve_counts_listeners_admin_connections_and_every_upstream_connection() {
        let config = Config {
            servers: vec![block(1), block(3)],
            ..Config::default()
        };
        let max = nodedns_upstream::Config::default().max_connections;
        // One address: 2 UDP workers and a TCP listener, and 2 admin listeners; 4 upstreams.
        let expected = BASE + PER_LISTENER * (3 + 2) + 2 * PER_ADMIN_ADDRESS + 4 * max;
        assert_eq!(reserve(&config, 2, 2), expected);
    }

    #[test]
    fn at_a_limit_of_1024_the_caps_leave_the_reserve_free() {
        let caps = Caps::derive(1024, 600, None, None);
        assert_eq!(caps.total, 424);
        assert_eq!(caps.per_client, 53);
        assert!(caps.fit(1024, 600));
        // Today's caps took every descriptor of such a container.
        assert!(
            !Caps {
                total: 1024,
                per_client: 128
            }
            .fit(1024, 600)
        );
    }

    #[test]
    fn with_descriptors_to_spare_the_caps_are_the_old_defaults() {
        let caps = Caps::derive(1 << 20, 600, None, None);
        assert_eq!(
            caps,
            Caps {
                total: MAX_CONNECTIONS,
                per_client: MAX_PER_CLIENT
            }
        );
    }

    #[test]
    fn flags_win_and_a_starved_limit_still_serves_tcp() {
        assert_eq!(
            Caps::derive(1024, 600, Some(2000), Some(0)),
            Caps {
                total: 2000,
                per_client: 0
            }
        );
        assert!(!Caps::derive(1024, 600, Some(2000), None).fit(1024, 600));
        let starved = Caps::derive(256, 600, None, None);
        assert_eq!((starved.total, starved.per_client), (16, 2));
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let limit = raise().unwrap();
        assert_eq!(limit.soft, limit.hard);
        assert!(limit.before <= limit.soft);
        assert_eq!(soft_limit(), limit.soft);
    }
}
