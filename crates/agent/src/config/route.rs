//! Which server block answers a query: among the blocks listening on the address the query
//! arrived at, the one with the longest zone that the name is equal to or below (CoreDNS's
//! rule); and whether one of the block's `forward` lines takes the name. Runs once per query:
//! zones are kept in wire form, built once per configuration, and a lookup walks the query
//! name's labels without allocating. Which of the lines takes it is the miss path's question
//! ([`Takes`]).

use std::net::SocketAddr;

use super::{Forward, Server, values};

/// Routing table built from a configuration's servers (same order: [`Route::server`] indexes
/// `Config::servers`).
#[derive(Debug, Clone)]
pub struct Router {
    blocks: Vec<Entry>,
    /// Every zone of every block, the longest first (file order among equal lengths): the first
    /// one that holds a name, among the blocks listening where the query arrived, is its route.
    candidates: Vec<Candidate>,
    /// The same, per address some block listens on, kept to the blocks that receive queries
    /// arriving there: a query's route is then the first zone of its address's list that holds
    /// the name, with no block's listen addresses compared.
    by_local: Vec<(SocketAddr, Vec<Candidate>)>,
}

/// One zone of one block, as the router tries it.
#[derive(Debug, Clone)]
struct Candidate {
    server: usize,
    zone: usize,
    /// The zone in wire form.
    name: Box<[u8]>,
    /// Whether one of the block's `forward` lines takes every name of the zone (its FROM is the
    /// zone or above, and it has no `except`), decided once here so that most queries never
    /// look at the lines.
    whole: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    listen: Vec<SocketAddr>,
    /// The block's `forward` lines, in file order; empty when it does not forward.
    forwards: Vec<Takes>,
}

/// The names one `forward` line takes, in wire form: those under FROM and under none of its
/// `except` names (FROM itself always, as in CoreDNS's `isAllowedDomain`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Takes {
    from: Box<[u8]>,
    except: Vec<Box<[u8]>>,
}

impl Takes {
    pub fn new(forward: &Forward) -> Takes {
        let wire = |z: &String| values::wire(z).into_boxed_slice();
        Takes {
            from: wire(&forward.from),
            except: forward.except.iter().map(wire).collect(),
        }
    }

    /// Whether the line takes wire-form `qname` (lowercase). `zone`: a zone `qname` is known
    /// to be under (its block's), which spares the walk when it is FROM. `None` when `qname` is
    /// malformed.
    #[inline]
    pub fn takes(&self, qname: &[u8], zone: Option<&[u8]>) -> Option<bool> {
        if zone != Some(&*self.from) && !is_under(qname, &self.from)? {
            return Some(false);
        }
        Some(
            self.except.is_empty()
                || *qname == *self.from
                || !self.except.iter().any(|e| is_under(qname, e) == Some(true)),
        )
    }
}

/// Where a query goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Index into `Config::servers`.
    pub server: usize,
    /// Index into that server's `zones`: the zone that matched (CoreDNS's `zone` metric label).
    pub zone: usize,
    /// Whether one of the block's `forward` lines takes this name: it is under the line's FROM
    /// and under none of its `except` names.
    pub forward: bool,
}

/// Whether wire-form `name` is `zone` or below it: `zone` is a suffix of `name` that starts at a
/// label boundary. `None` when `name` is malformed (a label runs past its end).
fn suffix_at(name: &[u8], zone: &[u8]) -> Option<bool> {
    let mut at = 0;
    loop {
        let rest = name.get(at..)?;
        if rest.len() == zone.len() && rest == zone {
            return Some(true);
        }
        let len = usize::from(*rest.first()?);
        if len == 0 {
            return Some(false);
        }
        at += 1 + len;
    }
}

/// Whether a block listening on `listen` receives queries that arrive at `local`. A block bound
/// to a wildcard address receives everything on its port.
fn listens(listen: &[SocketAddr], local: SocketAddr) -> bool {
    listen
        .iter()
        .any(|l| *l == local || (l.ip().is_unspecified() && l.port() == local.port()))
}

impl Router {
    pub fn new(servers: &[Server]) -> Router {
        let blocks: Vec<Entry> = servers
            .iter()
            .map(|s| Entry {
                listen: s.listen.clone(),
                forwards: s.forwards.iter().map(Takes::new).collect(),
            })
            .collect();
        let mut candidates: Vec<Candidate> = servers
            .iter()
            .zip(&blocks)
            .enumerate()
            .flat_map(|(server, (s, block))| {
                s.zones.iter().enumerate().map(move |(zone, z)| {
                    let name = values::wire(z).into_boxed_slice();
                    let whole = block
                        .forwards
                        .iter()
                        .any(|f| f.except.is_empty() && is_under(&name, &f.from) == Some(true));
                    Candidate {
                        server,
                        zone,
                        name,
                        whole,
                    }
                })
            })
            .collect();
        // Stable: among zones of equal length, the first block's wins, as in CoreDNS.
        candidates.sort_by_key(|c| std::cmp::Reverse(c.name.len()));
        let mut by_local: Vec<(SocketAddr, Vec<Candidate>)> = Vec::new();
        for &local in blocks.iter().flat_map(|b| &b.listen) {
            if by_local.iter().any(|(l, _)| *l == local) {
                continue;
            }
            let here = candidates
                .iter()
                .filter(|c| listens(&blocks[c.server].listen, local))
                .cloned()
                .collect();
            by_local.push((local, here));
        }
        Router {
            blocks,
            candidates,
            by_local,
        }
    }

    /// The block for `qname` (wire form, already lowercased, as the query parser gives it)
    /// arriving at `local`; `None` when no block listening there serves the name, or the name
    /// is malformed below a zone other than the root (every name is under the root, and the
    /// parser has checked its labels: the root zone matches without walking them).
    #[inline]
    pub fn route(&self, qname: &[u8], local: SocketAddr) -> Option<Route> {
        // The longest zone wins. Zone lists are short (node-local-dns has four blocks of one zone
        // each): the candidates are tried longest first, each compared with the name's tail, the
        // labels walked only to confirm a tail that matched. The addresses the blocks listen on
        // have their candidates listed once; any other address checks each block as it goes.
        match self.by_local.iter().find(|(l, _)| *l == local) {
            Some((_, candidates)) => self.first(qname, candidates.iter()),
            None => self.first(
                qname,
                self.candidates
                    .iter()
                    .filter(|c| listens(&self.blocks[c.server].listen, local)),
            ),
        }
    }

    /// The route of `qname` to the first of `candidates` whose zone holds it.
    #[inline]
    fn first<'a>(
        &self,
        qname: &[u8],
        candidates: impl Iterator<Item = &'a Candidate>,
    ) -> Option<Route> {
        for c in candidates {
            if !routes_to(qname, &c.name)? {
                continue;
            }
            let mut forward = c.whole;
            if !forward {
                for f in &self.blocks[c.server].forwards {
                    if f.takes(qname, Some(&c.name))? {
                        forward = true;
                        break;
                    }
                }
            }
            return Some(Route {
                server: c.server,
                zone: c.zone,
                forward,
            });
        }
        None
    }
}

/// Whether wire-form `name` is `zone` or below it, cheaply: a zone that is not even a byte
/// suffix of the name cannot hold it; otherwise the labels are walked to confirm the suffix starts
/// at one. `None` when `name` is malformed.
fn is_under(name: &[u8], zone: &[u8]) -> Option<bool> {
    if !name.ends_with(zone) {
        return Some(false);
    }
    suffix_at(name, zone)
}

/// [`is_under`] for the router: the root zone (`[0]`) holds every name without a walk.
#[inline]
fn routes_to(name: &[u8], zone: &[u8]) -> Option<bool> {
    if *zone == [0] {
        return Some(!name.is_empty());
    }
    is_under(name, zone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Forward;

    fn server(zones: &[&str], listen: &[&str], forward: Option<(&str, &[&str])>) -> Server {
        Server {
            zones: zones
                .iter()
                .map(|z| values::canonical_name(z).unwrap())
                .collect(),
            listen: listen.iter().map(|a| a.parse().unwrap()).collect(),
            cache: None,
            forwards: forward
                .map(|(from, except)| Forward {
                    from: values::canonical_name(from).unwrap(),
                    except: except
                        .iter()
                        .map(|e| values::canonical_name(e).unwrap())
                        .collect(),
                    next: Vec::new(),
                    upstream: nodedns_upstream::Config::default(),
                })
                .into_iter()
                .collect(),
            log: Vec::new(),
            errors: false,
            loop_check: false,
            dnstap: Vec::new(),
            chain: Default::default(),
            scheme: Default::default(),
            tls: None,
        }
    }

    fn q(name: &str) -> Vec<u8> {
        values::wire(&values::canonical_name(name).unwrap())
    }

    const LOCAL: &str = "169.254.20.10:53";

    fn local() -> SocketAddr {
        LOCAL.parse().unwrap()
    }

    #[test]
    fn the_longest_matching_zone_wins() {
        let servers = [
            server(&["."], &[LOCAL], Some((".", &[]))),
            server(&["cluster.local"], &[LOCAL], Some((".", &[]))),
            server(&["svc.cluster.local"], &[LOCAL], None),
        ];
        let r = Router::new(&servers);
        assert_eq!(
            r.route(&q("kubernetes.default.svc.cluster.local"), local())
                .unwrap()
                .server,
            2
        );
        assert_eq!(
            r.route(&q("node1.cluster.local"), local()).unwrap().server,
            1
        );
        assert_eq!(r.route(&q("cluster.local"), local()).unwrap().server, 1);
        assert_eq!(r.route(&q("example.com"), local()).unwrap().server, 0);
        assert_eq!(r.route(&q("."), local()).unwrap().server, 0);
        // Label boundaries: `xcluster.local.` is not under `cluster.local.`.
        assert_eq!(r.route(&q("xcluster.local"), local()).unwrap().server, 0);
    }

    #[test]
    fn the_zone_index_names_which_zone_of_a_block_matched() {
        let servers = [server(&["a.example", "b.example"], &[LOCAL], None)];
        let r = Router::new(&servers);
        assert_eq!(
            r.route(&q("x.b.example"), local()),
            Some(Route {
                server: 0,
                zone: 1,
                forward: false
            })
        );
        assert_eq!(r.route(&q("c.example"), local()), None);
    }

    #[test]
    fn only_blocks_listening_on_the_local_address_are_considered() {
        let servers = [
            server(&["."], &["127.0.0.1:5353"], None),
            server(&["."], &[LOCAL], None),
            server(&["example.com"], &["0.0.0.0:53"], None),
        ];
        let r = Router::new(&servers);
        assert_eq!(
            r.route(&q("a.org"), "127.0.0.1:5353".parse().unwrap())
                .unwrap()
                .server,
            0
        );
        assert_eq!(r.route(&q("a.org"), local()).unwrap().server, 1);
        // The wildcard block receives everything on port 53.
        assert_eq!(r.route(&q("www.example.com"), local()).unwrap().server, 2);
        assert_eq!(
            r.route(&q("www.example.com"), "127.0.0.1:5353".parse().unwrap())
                .unwrap()
                .server,
            0
        );
        assert_eq!(r.route(&q("a.org"), "10.0.0.1:53".parse().unwrap()), None);
    }

    /// CoreDNS's rule, by brute force: among the blocks listening at `local`, the longest zone
    /// that holds the name, the first block's among equals.
    fn reference(servers: &[Server], qname: &[u8], local: SocketAddr) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for (server, s) in servers.iter().enumerate() {
            if !listens(&s.listen, local) {
                continue;
            }
            for (zone, z) in s.zones.iter().enumerate() {
                let z = values::wire(z);
                let holds = z == [0] || is_under(qname, &z) == Some(true);
                if holds && best.is_none_or(|(_, _, len)| z.len() > len) {
                    best = Some((server, zone, z.len()));
                }
            }
        }
        best.map(|(server, zone, _)| (server, zone))
    }

    #[test]
    fn every_address_routes_by_coredns_rule() {
        let servers = [
            server(&["cluster.local", "."], &["0.0.0.0:53"], None),
            server(
                &["in-addr.arpa", "ip6.arpa"],
                &[LOCAL, "10.96.0.10:53"],
                None,
            ),
            server(&["svc.cluster.local"], &[LOCAL], None),
            server(&["cluster.local"], &[LOCAL, "127.0.0.1:5353"], None),
            server(&["."], &["127.0.0.1:5353", "[::1]:53"], None),
            server(&["example.com", "b.example.com"], &["[::]:53"], None),
        ];
        let r = Router::new(&servers);
        let names = [
            ".",
            "cluster.local",
            "kubernetes.default.svc.cluster.local",
            "a.b.c.cluster.local",
            "10.in-addr.arpa",
            "1.0.0.127.in-addr.arpa",
            "ip6.arpa",
            "example.com",
            "x.b.example.com",
            "xcluster.local",
            "google.com",
        ];
        // Addresses some block listens on (listed once per router), and others it may receive
        // queries at through a wildcard (checked as the query comes).
        let locals = [
            LOCAL,
            "10.96.0.10:53",
            "0.0.0.0:53",
            "127.0.0.1:5353",
            "[::1]:53",
            "[::]:53",
            "10.0.0.1:53",
            "[fd00::1]:53",
            "127.0.0.1:53",
            "10.0.0.1:54",
        ];
        for name in names {
            for local in locals {
                let local: SocketAddr = local.parse().unwrap();
                let got = r.route(&q(name), local).map(|r| (r.server, r.zone));
                assert_eq!(
                    got,
                    reference(&servers, &q(name), local),
                    "{name} at {local}"
                );
            }
        }
    }

    #[test]
    fn forward_applies_under_from_and_not_under_except() {
        let servers = [server(
            &["."],
            &[LOCAL],
            Some(("example.com", &["internal.example.com"])),
        )];
        let r = Router::new(&servers);
        assert!(r.route(&q("www.example.com"), local()).unwrap().forward);
        assert!(
            !r.route(&q("internal.example.com"), local())
                .unwrap()
                .forward
        );
        assert!(
            !r.route(&q("a.internal.example.com"), local())
                .unwrap()
                .forward
        );
        assert!(!r.route(&q("example.org"), local()).unwrap().forward);
    }

    #[test]
    fn any_forward_line_of_the_block_may_take_a_name() {
        let mut s = server(&["."], &[LOCAL], Some(("example.com", &[])));
        let mut second = s.forwards[0].clone();
        second.from = "example.org.".to_owned();
        s.forwards.push(second);
        let r = Router::new(&[s]);
        assert!(r.route(&q("www.example.com"), local()).unwrap().forward);
        assert!(r.route(&q("www.example.org"), local()).unwrap().forward);
        assert!(!r.route(&q("www.example.net"), local()).unwrap().forward);
    }

    #[test]
    fn from_itself_is_taken_even_when_an_except_names_it() {
        let servers = [server(
            &["."],
            &[LOCAL],
            Some(("example.com", &["example.com"])),
        )];
        let r = Router::new(&servers);
        assert!(r.route(&q("example.com"), local()).unwrap().forward);
        assert!(!r.route(&q("www.example.com"), local()).unwrap().forward);
    }

    #[test]
    fn malformed_names_route_nowhere_and_never_panic() {
        let servers = [server(&["example"], &[LOCAL], Some((".", &[])))];
        let r = Router::new(&servers);
        let zone = q("example");
        let ending = |prefix: &[u8]| [prefix, &zone].concat();
        // Each ends with the zone's bytes, but a label runs past the end of the name.
        for bad in [ending(&[40]), ending(&[1, b'a', 20]), ending(&[3, b'a'])] {
            assert!(bad.ends_with(&zone));
            assert_eq!(r.route(&bad, local()), None, "{bad:?}");
        }
        assert_eq!(r.route(&[], local()), None);
        // The root zone takes every name without walking it (the parser checked its labels),
        // and never panics on one that is not well formed.
        let root = Router::new(&[server(&["."], &[LOCAL], Some((".", &[])))]);
        assert_eq!(root.route(&[], local()), None);
        for odd in [&[5, b'a'][..], &[63][..], &[1, b'a', 9, 0][..]] {
            assert!(root.route(odd, local()).is_some(), "{odd:?}");
        }
    }
}
