//! Configuration: what the agent serves, where, and how.
//!
//! Two sources produce the same [`Config`]: nodedns's own flags (`--listen`, `--upstream`: one
//! server block for `.`), and node-cache's inputs, unchanged (the node-local-dns Corefile with its
//! `__PILLAR__` variables, node-cache's single-dash flags, the kube-dns ConfigMap). Loading is a
//! pure function of its inputs (file contents, environment map, resolv.conf text), so tests feed
//! it maps and strings; only [`load`] touches the filesystem.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// A complete, validated configuration. The agent publishes it as one immutable snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Server blocks, in file order.
    pub servers: Vec<Server>,
    /// The node-local addresses the host plumbing puts on the link and exempts from conntrack
    /// (node-cache `-localip`): the link-local address and, in iptables/nftables mode, the kube-dns
    /// ClusterIP. Empty when nodedns does no host setup.
    pub local_ips: Vec<IpAddr>,
    /// Liveness endpoint (`health` directive, node-cache `-health-port`).
    pub health: Option<SocketAddr>,
    /// Readiness endpoint (`ready` directive).
    pub ready: Option<SocketAddr>,
    /// Prometheus endpoint (`prometheus` directive, `-metrics-listen-address`).
    pub metrics: Option<SocketAddr>,
    /// Polling interval for the Corefile, when the `reload` directive asks for one.
    pub reload: Option<Duration>,
}

/// One server block: the zones it answers, where it listens, its cache and its upstreams.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// Zones in canonical form: lowercase, absolute, with the trailing dot (`cluster.local.`, `.`).
    pub zones: Vec<String>,
    /// Addresses this block is served on (`bind` × the block's port).
    pub listen: Vec<SocketAddr>,
    /// `None` when the block has no `cache` directive: every query goes upstream.
    pub cache: Option<nodedns_cache::Policy>,
    /// `None` when the block has no `forward`: queries get REFUSED (nothing else answers them).
    pub forward: Option<Forward>,
    /// `log`: log every query of this block.
    pub log: bool,
    /// `errors`: log failed upstream exchanges of this block.
    pub errors: bool,
}

/// A `forward` directive.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// FROM: the zone the directive applies to (canonical form).
    pub from: String,
    /// Names under FROM that are not forwarded (`except`), canonical form.
    pub except: Vec<String>,
    pub upstream: nodedns_upstream::Config,
}
