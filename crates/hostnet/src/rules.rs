//! The rule set, independent of how it is written down.
//!
//! Per local IP this is node-cache's set (`cmd/node-cache/app/cache_app.go`), so a node that
//! switches from node-cache to nodedns sees the same packets skip conntrack and pass the filter:
//!
//! | chain | match | verdict |
//! | --- | --- | --- |
//! | raw PREROUTING | dst IP, dport 53, UDP and TCP | NOTRACK (pod queries) |
//! | filter INPUT | dst IP, dport 53, UDP and TCP | ACCEPT |
//! | raw OUTPUT | src IP, sport 53, UDP and TCP | NOTRACK (our replies) |
//! | filter OUTPUT | src IP, sport 53, UDP and TCP | ACCEPT |
//! | raw OUTPUT | dst IP, dport 53, UDP and TCP | NOTRACK (hostNetwork clients) |
//! | raw OUTPUT | dst IP, dport health, TCP | NOTRACK (kubelet's liveness probe) |
//! | raw OUTPUT | src IP, sport health, TCP | NOTRACK (its answers) |
//!
//! The backends ([`crate::nft`], [`crate::iptables`]) render this list; they add nothing to it.

use std::net::IpAddr;

/// Comment on every NOTRACK rule we write.
pub const COMMENT_SKIP_CONNTRACK: &str = "nodedns: skip conntrack";
/// Comment on every ACCEPT rule we write.
pub const COMMENT_ALLOW: &str = "nodedns: allow DNS traffic";
/// Prefix of the comments node-cache puts on its rules (`NodeLocal DNS Cache: skip conntrack`,
/// `NodeLocal DNS Cache: allow DNS traffic`): how its leftovers are recognised.
pub const NODE_CACHE_COMMENT_PREFIX: &str = "NodeLocal DNS Cache:";

/// Where a rule sits: the table (raw for NOTRACK, filter for ACCEPT) and the hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Chain {
    RawPrerouting,
    RawOutput,
    FilterInput,
    FilterOutput,
}

impl Chain {
    pub const ALL: [Chain; 4] = [
        Chain::RawPrerouting,
        Chain::RawOutput,
        Chain::FilterInput,
        Chain::FilterOutput,
    ];

    /// NOTRACK in the raw table (before conntrack), ACCEPT in the filter table.
    pub fn verdict(self) -> Verdict {
        match self {
            Chain::RawPrerouting | Chain::RawOutput => Verdict::Notrack,
            Chain::FilterInput | Chain::FilterOutput => Verdict::Accept,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Notrack,
    Accept,
}

impl Verdict {
    pub fn comment(self) -> &'static str {
        match self {
            Verdict::Notrack => COMMENT_SKIP_CONNTRACK,
            Verdict::Accept => COMMENT_ALLOW,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Udp,
    Tcp,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Udp => "udp",
            Proto::Tcp => "tcp",
        }
    }
}

/// Which end of the packet is the local IP and port: `Dst` for packets to us, `Src` for
/// packets from us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Dst,
    Src,
}

/// One rule: in `chain`, packets of `proto` whose `side` address is `ip` and `side` port is
/// `port` get the chain's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub chain: Chain,
    pub ip: IpAddr,
    pub side: Side,
    pub proto: Proto,
    pub port: u16,
}

/// Whether `ip` is a Service address (the kube-dns ClusterIP) rather than the node-local
/// link-local one: anything outside 169.254.0.0/16 and fe80::/10. Rules for these are withdrawn
/// first on shutdown so that pods fall back to kube-proxy → CoreDNS.
pub fn is_service_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
    }
}

/// The rules for `ips`, in a stable order (by IP, then node-cache's order).
pub fn for_ips(ips: &[IpAddr], dns_port: u16, health_port: Option<u16>) -> Vec<Rule> {
    let mut out = Vec::new();
    for &ip in ips {
        for proto in [Proto::Udp, Proto::Tcp] {
            let r = |chain, side| Rule {
                chain,
                ip,
                side,
                proto,
                port: dns_port,
            };
            out.push(r(Chain::RawPrerouting, Side::Dst));
            out.push(r(Chain::FilterInput, Side::Dst));
            out.push(r(Chain::RawOutput, Side::Src));
            out.push(r(Chain::FilterOutput, Side::Src));
            out.push(r(Chain::RawOutput, Side::Dst));
        }
        if let Some(port) = health_port {
            for side in [Side::Dst, Side::Src] {
                out.push(Rule {
                    chain: Chain::RawOutput,
                    ip,
                    side,
                    proto: Proto::Tcp,
                    port,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_addresses_are_not_service_ips() {
        assert!(!is_service_ip("169.254.20.10".parse().unwrap()));
        assert!(!is_service_ip("fe80::10".parse().unwrap()));
        assert!(!is_service_ip("febf::1".parse().unwrap()));
        assert!(is_service_ip("10.96.0.10".parse().unwrap()));
        assert!(is_service_ip("fd00::10".parse().unwrap()));
        assert!(is_service_ip("fec0::1".parse().unwrap()));
    }

    #[test]
    fn each_ip_gets_node_caches_ten_dns_rules_and_two_health_rules() {
        let ip: IpAddr = "169.254.20.10".parse().unwrap();
        let rules = for_ips(&[ip], 53, Some(8080));
        assert_eq!(rules.len(), 12);
        assert_eq!(rules.iter().filter(|r| r.port == 8080).count(), 2);
        assert!(
            rules
                .iter()
                .filter(|r| r.port == 8080)
                .all(|r| r.chain == Chain::RawOutput && r.proto == Proto::Tcp)
        );
        for proto in [Proto::Udp, Proto::Tcp] {
            for (chain, side) in [
                (Chain::RawPrerouting, Side::Dst),
                (Chain::FilterInput, Side::Dst),
                (Chain::RawOutput, Side::Src),
                (Chain::FilterOutput, Side::Src),
                (Chain::RawOutput, Side::Dst),
            ] {
                let want = Rule {
                    chain,
                    ip,
                    side,
                    proto,
                    port: 53,
                };
                assert!(rules.contains(&want), "missing {want:?}");
            }
        }
    }

    #[test]
    fn no_health_port_means_no_health_rules() {
        let rules = for_ips(&["10.96.0.10".parse().unwrap()], 53, None);
        assert_eq!(rules.len(), 10);
        assert!(rules.iter().all(|r| r.port == 53));
    }
}
