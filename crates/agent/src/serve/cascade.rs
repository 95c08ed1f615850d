//! The ndots cascade prefetch: the later steps of a pod's search list, fetched as soon as its
//! first step says the name is not there.
//!
//! A pod's resolv.conf (`search NS.svc.D svc.D D`, `ndots:5`) makes a lookup of
//! `api.example.com` four queries, one after the other: `api.example.com.NS.svc.D`,
//! `api.example.com.svc.D`, `api.example.com.D`, then `api.example.com.`, each sent when the
//! one before came back NXDOMAIN. When the first step ([`later_steps`] recognises it by the
//! configuration's cluster domains, `Config::cluster_domains`) comes back NXDOMAIN from the
//! upstream, [`follow`] starts background fetches of the three later steps for the same type,
//! class and DO/CD bits, each in the block that serves it: when the pod asks them they are in
//! flight (it joins the fetch) or cached.
//!
//! What it never does: answer anything. Each later step is fetched and stored exactly as a
//! prefetch is (a refresh through the block's single-flight table, with no waiter,
//! [`nodedns_cache::Flights::refresh`]); the pod still asks every step and gets what the
//! upstream said for that name. Why on NXDOMAIN and not on the first step's miss: a name that
//! exists at the first step (a service of the pod's own namespace, the most common lookup) then
//! costs nothing; the price is one cluster round trip before the later steps start.
//!
//! Bounds: at most [`MAX_IN_FLIGHT`] cascade fetches at once and [`MAX_WATCHED`] fetched
//! entries waiting to be judged used or wasted, process-wide; none while the step's upstream
//! group is unhealthy or has half its `max_concurrent` places taken, or while the misses
//! pending in the agent are past a quarter of their bound. A step skipped for a bound is
//! counted `skipped`; a step already fresh in the cache or in flight needs nothing and is not
//! counted.
//!
//! Counted (`nodedns_cascade_prefetches_total{outcome}`): `started`, then for each started one
//! `used` (a client joined its fetch, or found its entry while fresh) or `wasted` (neither,
//! judged when the entry expires, at most [`WATCH_LIMIT`] after it was stored).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nodedns_cache::Lookup;
use nodedns_wire::{Key, rcode};

use super::pipeline::{self, MAX_PENDING, Outcome, Refresh};
use super::{Shared, Snapshot, Source, Zone};
use crate::config;
use crate::metrics::Cascade;

/// Cascade fetches in flight at once, at most (process-wide). A pod's lookup starts three per
/// type; 32 leave room for ten pods starting cold lookups in the same round trip, and keep a
/// burst of misses from turning into three times as many upstream queries.
pub const MAX_IN_FLIGHT: usize = 32;

/// Fetched entries waiting to be judged used or wasted, at most: each holds its entry (and a
/// sleeping task) until it expires. Beyond it no cascade starts.
pub const MAX_WATCHED: usize = 4096;

/// How long a fetched entry is watched for a client's hit, at most: a pod asks its next step as
/// soon as the previous one is answered, or after a resolver timeout (glibc: 5 s).
pub const WATCH_LIMIT: Duration = Duration::from_secs(30);

/// The process-wide bounds: cascade fetches in flight, entries being watched.
#[derive(Debug, Default)]
pub struct Bounds {
    in_flight: AtomicUsize,
    watched: AtomicUsize,
}

/// One place under both bounds, taken for a fetch; the fetch place is given back when the fetch
/// ends ([`Place::fetched`]), the watch place when the entry has been judged (drop).
#[derive(Debug)]
struct Place {
    shared: Arc<Shared>,
    fetching: bool,
}

impl Bounds {
    fn take(shared: &Arc<Shared>) -> Option<Place> {
        let b = &shared.cascade;
        if b.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            b.in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        if b.watched.fetch_add(1, Ordering::AcqRel) >= MAX_WATCHED {
            b.watched.fetch_sub(1, Ordering::AcqRel);
            b.in_flight.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Place {
            shared: shared.clone(),
            fetching: true,
        })
    }
}

impl Place {
    fn fetched(&mut self) {
        if std::mem::take(&mut self.fetching) {
            self.shared.cascade.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.fetched();
        self.shared.cascade.watched.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Called by the miss path with the outcome of a client's fetch of `key` in `zone`, before its
/// waiters are answered (so that the later steps are in flight before the pod can ask them).
/// Does nothing unless the cascade prefetch is on, the upstream said NXDOMAIN, and `key` is a
/// first search-list step. Must run inside the tokio runtime.
pub(super) fn follow(shared: &Arc<Shared>, zone: &Zone, key: &Key, outcome: &Outcome) {
    if !upstream_nxdomain(outcome) {
        return;
    }
    let snap = shared.snapshot.load();
    if !snap.config.cascade_prefetch {
        return;
    }
    // The block the first step reached listens where the pod asked; its first address routes
    // the later steps as the pod's own queries will be routed (node-local-dns binds every block
    // to the same addresses).
    let Some(&local) = zone.server.listen.first() else {
        return;
    };
    let Some(steps) = snap
        .config
        .cluster_domains
        .iter()
        .find_map(|domain| later_steps(key.qname(), &config::wire(domain)))
    else {
        return;
    };
    for name in steps {
        let next = Key::new(
            &name,
            key.qtype(),
            key.qclass(),
            key.dnssec_ok(),
            key.checking_disabled(),
        );
        if let Some(next) = next {
            start(shared, &snap, local, next);
        }
    }
}

/// Whether the upstream itself answered NXDOMAIN (not a stale or cached answer after a failure).
fn upstream_nxdomain(outcome: &Outcome) -> bool {
    let info = match outcome {
        Outcome::Entry(entry, _, Source::Upstream) => entry.reply().info(),
        Outcome::Reply(reply, _) => reply.info(),
        Outcome::Entry(..) | Outcome::Failed => return false,
    };
    info.rcode == u16::from(rcode::NXDOMAIN)
}

/// The later steps of the standard search list when `qname` (lowercase wire form) is its first
/// step under `domain` (wire form): `NAME.NS.svc.DOMAIN` gives `NAME.svc.DOMAIN`,
/// `NAME.DOMAIN` and `NAME.`, in the order the pod asks them. `None` for any other name (NAME
/// must have at least one label).
pub fn later_steps(qname: &[u8], domain: &[u8]) -> Option<[Vec<u8>; 3]> {
    const SVC: &[u8] = b"\x03svc";
    if domain.len() <= 1 {
        return None;
    }
    let tail = qname.len().checked_sub(SVC.len() + domain.len())?;
    if qname.get(tail..tail + SVC.len())? != SVC || qname.get(tail + SVC.len()..)? != domain {
        return None;
    }
    // Walk the labels up to `tail`: it must start one, and NS is the label before it.
    let (mut at, mut ns) = (0, None);
    while at < tail {
        let len = usize::from(*qname.get(at)?);
        if len == 0 {
            return None;
        }
        ns = Some(at);
        at += 1 + len;
    }
    let ns = ns.filter(|&ns| at == tail && ns > 0)?;
    let name = &qname[..ns];
    let join = |rest: &[u8]| [name, rest].concat();
    let svc_domain = &qname[tail..];
    Some([join(svc_domain), join(domain), join(b"\x00")])
}

/// Starts the background fetch of `key` in the block that serves it, unless it needs none
/// (fresh in the cache, or in flight) or a bound says no.
fn start(shared: &Arc<Shared>, snap: &Snapshot, local: SocketAddr, key: Key) {
    let Some((zone, route)) = snap.route(key.qname(), local) else {
        return;
    };
    let Some(group) = zone.group_for(key.qname()).filter(|_| route.forward) else {
        return;
    };
    if let Some(cache) = &zone.cache {
        if let Lookup::Fresh {
            prefetch, entry, ..
        } = cache.lookup(key.as_bytes(), Instant::now())
        {
            // The look-up claimed the entry's prefetch: start it, as a hit would have.
            if prefetch {
                let refresh = Refresh {
                    zone: zone.clone(),
                    key,
                    entry,
                };
                pipeline::refresh(shared, &tokio::runtime::Handle::current(), refresh);
            }
            return;
        }
    }
    let metrics = &shared.metrics;
    let busy = group.in_flight().saturating_mul(2) >= group.config().max_concurrent;
    if !group.healthy() || busy {
        metrics.cascade(Cascade::Skipped);
        return;
    }
    let Some(mut place) = Bounds::take(shared) else {
        metrics.cascade(Cascade::Skipped);
        return;
    };
    let Some(pending) = shared.track(MAX_PENDING / 4) else {
        metrics.cascade(Cascade::Skipped);
        return;
    };
    if !zone.flights.refresh(key.as_bytes()) {
        return;
    }
    metrics.cascade(Cascade::Started);
    let (shared, zone) = (shared.clone(), zone.clone());
    tokio::spawn(async move {
        let leading = pipeline::Leading::new(&shared, &zone, &key);
        let outcome = pipeline::fetch(&shared, &zone, &key, true).await;
        let joined = leading.complete(&outcome);
        drop(pending);
        place.fetched();
        // The watch outlives the query: on the main runtime (`Shared::background`).
        let background = shared.background.clone();
        background.spawn(async move {
            let used = joined > 0 || watch(&outcome).await;
            shared
                .metrics
                .cascade(if used { Cascade::Used } else { Cascade::Wasted });
            drop(place);
        });
    });
}

/// Waits until the entry the fetch stored expires (at most [`WATCH_LIMIT`]), and says whether a
/// client found it meanwhile. Nothing stored: nobody can find it.
async fn watch(outcome: &Outcome) -> bool {
    let Outcome::Entry(entry, _, Source::Upstream) = outcome else {
        return false;
    };
    let lifetime = Duration::from_secs(entry.ttl().into()).min(WATCH_LIMIT);
    let expires = entry.stored() + lifetime;
    // The hit count is read after 50 ms, then at doubling intervals: a pod asks its next step
    // within a round trip, so a used entry is mostly judged at the first look, and an entry
    // nobody asks costs a handful of wake-ups over its life.
    let mut wait = FIRST_LOOK;
    loop {
        if entry.hits() > 0 {
            return true;
        }
        let left = expires.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        tokio::time::sleep(wait.min(left)).await;
        wait = wait.saturating_mul(2);
    }
}

/// When a watched entry's hit count is first read.
const FIRST_LOOK: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, UdpSocket};

    use nodedns_wire::Reply;

    use super::*;
    use crate::config::{Config, Forward, Server};
    use crate::metrics::Metrics;

    fn wire(name: &str) -> Vec<u8> {
        config::wire(name)
    }

    const LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 53));

    fn block(zone: &str, upstream: SocketAddr) -> Server {
        Server {
            zones: vec![zone.to_owned()],
            listen: vec![LISTEN],
            cache: Some(nodedns_cache::Policy::default()),
            forwards: vec![Forward {
                from: ".".to_owned(),
                except: Vec::new(),
                next: Vec::new(),
                upstream: nodedns_upstream::Config {
                    addrs: vec![upstream],
                    transport: nodedns_upstream::Transport::PreferUdp,
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

    /// node-local-dns's blocks for `cluster.local.` and `.`, forwarding to an upstream that
    /// never answers (the fetches the tests start stay in flight), with the prefetch `on`.
    fn agent(on: bool) -> (Arc<Shared>, UdpSocket) {
        let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = silent.local_addr().unwrap();
        let config = Config {
            servers: vec![block("cluster.local.", upstream), block(".", upstream)],
            cluster_domains: vec!["cluster.local.".to_owned()],
            cascade_prefetch: on,
            ..Config::default()
        };
        let metrics = Arc::new(Metrics::new(&[LISTEN], true));
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        let taps = crate::dnstap::Metrics::default();
        let snapshot = Snapshot::build(
            Arc::new(config),
            None,
            &upstream_metrics,
            &Default::default(),
            &metrics,
            &taps,
        )
        .unwrap();
        let shared = Arc::new(Shared::new(
            snapshot,
            metrics,
            Default::default(),
            Default::default(),
        ));
        (shared, silent)
    }

    fn key(name: &str) -> Key {
        Key::new(&wire(name), 28, 1, false, false).unwrap()
    }

    /// What the upstream says to `key`'s question: NXDOMAIN, no records.
    fn nxdomain(key: &Key) -> Outcome {
        let mut bytes = Vec::new();
        nodedns_wire::build_query(key.as_bytes(), 7, &mut bytes).unwrap();
        bytes[2] |= 0x80;
        bytes[3] = (bytes[3] & 0xf0) | 3;
        Outcome::Reply(Reply::parse(&bytes).unwrap(), nodedns_wire::TtlRule::STORED)
    }

    fn count(shared: &Shared, outcome: &str) -> u64 {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(crate::metrics::Exposition::new(
            shared.metrics.clone(),
            Vec::new,
        )));
        let text = crate::metrics::text(&registry);
        let series = format!("nodedns_cascade_prefetches_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .unwrap_or_else(|| panic!("{series} in {text}"))
            .parse()
            .unwrap()
    }

    /// Fetches in flight per block: (cluster.local., .).
    fn in_flight(shared: &Shared) -> (usize, usize) {
        let snap = shared.snapshot.load();
        (
            snap.zones[0].flights.sizes().fetches,
            snap.zones[1].flights.sizes().fetches,
        )
    }

    #[tokio::test]
    async fn a_first_steps_nxdomain_starts_the_later_steps_each_in_its_block() {
        let (shared, _upstream) = agent(true);
        let snap = shared.snapshot.load_full();
        let first = key("api.example.com.default.svc.cluster.local.");
        follow(&shared, &snap.zones[0], &first, &nxdomain(&first));
        assert_eq!(
            in_flight(&shared),
            (2, 1),
            "steps 2 and 3 under cluster.local., step 4 under ."
        );
        assert!(
            !snap.zones[0]
                .flights
                .refresh(key("api.example.com.svc.cluster.local.").as_bytes())
        );
        assert!(
            !snap.zones[1]
                .flights
                .refresh(key("api.example.com.").as_bytes())
        );
        assert_eq!(count(&shared, "started"), 3);
        // The same first step again: every later step is in flight already.
        follow(&shared, &snap.zones[0], &first, &nxdomain(&first));
        assert_eq!(count(&shared, "started"), 3);
        assert_eq!(count(&shared, "skipped"), 0);
    }

    #[tokio::test]
    async fn nothing_starts_when_off_for_other_names_or_other_answers() {
        let (shared, _upstream) = agent(false);
        let snap = shared.snapshot.load_full();
        let first = key("api.example.com.default.svc.cluster.local.");
        follow(&shared, &snap.zones[0], &first, &nxdomain(&first));
        assert_eq!(in_flight(&shared), (0, 0), "off");

        let (shared, _upstream) = agent(true);
        let snap = shared.snapshot.load_full();
        let other = key("api.example.com.cluster.local.");
        follow(&shared, &snap.zones[0], &other, &nxdomain(&other));
        follow(&shared, &snap.zones[0], &first, &Outcome::Failed);
        assert_eq!(in_flight(&shared), (0, 0), "no first step, or no NXDOMAIN");
        assert_eq!(count(&shared, "started"), 0);
    }

    #[tokio::test]
    async fn beyond_the_bound_later_steps_are_skipped() {
        let (shared, _upstream) = agent(true);
        let snap = shared.snapshot.load_full();
        // Each first step starts three: the eleventh finds two places left of 32.
        for i in 0..11 {
            let first = key(&format!("api{i}.example.com.default.svc.cluster.local."));
            follow(&shared, &snap.zones[0], &first, &nxdomain(&first));
        }
        assert_eq!(count(&shared, "started"), MAX_IN_FLIGHT as u64);
        assert_eq!(count(&shared, "skipped"), 33 - MAX_IN_FLIGHT as u64);
        let (cluster, root) = in_flight(&shared);
        assert_eq!(cluster + root, MAX_IN_FLIGHT);
    }

    #[test]
    fn a_first_step_gives_the_three_later_steps_in_the_pods_order() {
        let steps = later_steps(
            &wire("api.example.com.default.svc.cluster.local."),
            &wire("cluster.local."),
        )
        .expect("a first step");
        assert_eq!(
            steps,
            [
                wire("api.example.com.svc.cluster.local."),
                wire("api.example.com.cluster.local."),
                wire("api.example.com."),
            ]
        );
    }

    #[test]
    fn a_one_label_name_is_a_first_step_too() {
        let steps = later_steps(
            &wire("web.default.svc.cluster.local."),
            &wire("cluster.local."),
        )
        .unwrap();
        assert_eq!(steps[2], wire("web."));
    }

    #[test]
    fn names_that_are_no_first_step_give_none() {
        let domain = wire("cluster.local.");
        for name in [
            "default.svc.cluster.local.",
            "svc.cluster.local.",
            "cluster.local.",
            "api.example.com.",
            "web.default.pod.cluster.local.",
            "web.default.svc.cluster.example.",
            "web.default.xsvc.cluster.local.",
            "web.default.svc.other.cluster.local.",
        ] {
            assert_eq!(later_steps(&wire(name), &domain), None, "{name}");
        }
        assert_eq!(
            later_steps(&wire("web.default.svc.cluster.local."), &wire(".")),
            None,
            "the root is no cluster domain"
        );
    }

    #[test]
    fn a_malformed_name_gives_none() {
        let mut name = wire("web.default.svc.cluster.local.");
        name[0] = 60;
        assert_eq!(later_steps(&name, &wire("cluster.local.")), None);
    }
}
