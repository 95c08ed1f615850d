//! Forwarding-loop detection at start: what CoreDNS's `loop` plugin does, for blocks with `loop`.
//!
//! For every zone of such a block, [`check`] sends `<random>.<random>.<zone> HINFO` to the
//! block's upstreams. Nobody but nodedns knows that name, so if it ever arrives at a listener as
//! a client query, something upstream forwarded nodedns's own query back to it, and every query
//! for the zone would circle until it timed out. The request path reports such arrivals
//! ([`Detector::arrived`]) on the miss path only (the answer to a probe that arrived is never
//! stored, so every arrival is a miss) and only while a check runs: otherwise its whole cost is
//! one relaxed atomic load per miss.
//!
//! A loop is declared after [`ARRIVALS`] arrivals of one probe name. Behind a plain forwarder the
//! name comes back, nodedns forwards it (a miss), and it comes back again at once. (CoreDNS
//! counts three because it sends its probe to itself first; the two returns are the same
//! evidence.) A forwarder that merges identical queries in flight (dnsmasq, another nodedns)
//! passes the second copy on only after the first exchange timed out, so a probe that got no
//! answer is sent again each second, under the same name, counting across attempts, for up to
//! 30 s, as CoreDNS does. A SERVFAIL is no answer here: it is what a looping forwarder returns
//! once its exchange timed out, and it may cache it for a few seconds (CoreDNS and nodedns keep
//! an upstream SERVFAIL 5 s), so the retries go on until that expires and the probe circles
//! again. Once every probe has been answered, arrivals are still watched for
//! [`GRACE`], then the check ends.
//!
//! The caller runs a check at start and after every reload that applied a configuration. A
//! verdict at start stops the agent: the caller logs it, shuts down in the usual order (the host
//! rules are withdrawn, so pods fall back to the cluster DNS) and exits with status 1, as CoreDNS
//! exits on `loop`'s fatal error. A verdict after a reload undoes the reload (the previous
//! configuration serves again, and the failure is counted as any refused reload is). A check
//! whose upstreams never answered within 30 s ends without one.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nodedns_upstream::Group;
use nodedns_wire::rtype::HINFO;
use nodedns_wire::{Header, Key, class, rcode};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Snapshot;

/// Arrivals of one probe name as a client query that prove a loop.
pub const ARRIVALS: u32 = 2;
/// How long a probe is retried while no upstream answers it (CoreDNS: 30 s).
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Pause between two attempts of a probe that got no answer (CoreDNS: 1 s).
const RETRY: Duration = Duration::from_secs(1);
/// How long arrivals are still watched after every probe has been answered (CoreDNS: 2 s): a
/// loop through a slow path may deliver late.
pub const GRACE: Duration = Duration::from_secs(2);

/// A forwarding loop: nodedns's probe for `zone` came back to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loop {
    /// The zone whose upstreams send queries back (canonical form).
    pub zone: String,
    /// Where the block forwards it.
    pub upstreams: Vec<SocketAddr>,
    /// The probe name, presentation form.
    pub probe: String,
    /// How many times the probe arrived as a client query.
    pub arrivals: u32,
    /// The last client (UDP) that sent it: the hop just before nodedns in the loop.
    pub from: Option<SocketAddr>,
}

impl fmt::Display for Loop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let upstreams: Vec<String> = self.upstreams.iter().map(ToString::to_string).collect();
        write!(
            f,
            "forwarding loop detected: zone `{}` forwards to {}, which forwards back to nodedns \
             (its probe `{} HINFO` came back {} times",
            self.zone,
            upstreams.join(", "),
            self.probe,
            self.arrivals
        )?;
        if let Some(from) = self.from {
            write!(f, ", last from {from}")?;
        }
        write!(
            f,
            "), so every query for the zone would circle until it times out. Fix the upstream \
             so that it answers `{}` itself or forwards it elsewhere than to nodedns; the usual \
             causes are a cluster DNS that forwards to its node's resolv.conf, which names \
             nodedns's address, or a node resolver that forwards to nodedns",
            self.zone
        )
    }
}

/// One probe sent and watched for.
#[derive(Debug)]
struct Probe {
    /// Wire form, lowercase (what a [`nodedns_wire::Key`] holds).
    name: Vec<u8>,
    shown: String,
    zone: String,
    upstreams: Vec<SocketAddr>,
    arrivals: u32,
    from: Option<SocketAddr>,
}

/// The loop check's state, shared by [`check`] and the request path.
#[derive(Debug)]
pub struct Detector {
    /// Set while a check runs: all the request path reads otherwise.
    armed: AtomicBool,
    probes: Mutex<Vec<Probe>>,
    found: watch::Sender<Option<Arc<Loop>>>,
}

impl Default for Detector {
    fn default() -> Self {
        Detector {
            armed: AtomicBool::new(false),
            probes: Mutex::new(Vec::new()),
            found: watch::Sender::new(None),
        }
    }
}

impl Detector {
    /// Whether a check is running: only then does [`Detector::arrived`] need calling.
    #[inline]
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// A query for `qname` (lowercase wire form) of type `qtype` from client `from` reached the
    /// miss path. Returns whether it was a probe of the running check.
    fn arrived_name(&self, qname: &[u8], qtype: u16, from: Option<SocketAddr>) -> bool {
        if qtype != HINFO || !self.armed() {
            return false;
        }
        let mut probes = self.probes.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(probe) = probes.iter_mut().find(|p| p.name == qname) else {
            return false;
        };
        probe.arrivals += 1;
        probe.from = from.or(probe.from);
        tracing::warn!(
            zone = %probe.zone,
            probe = %probe.shown,
            arrivals = probe.arrivals,
            ?from,
            "loop check: nodedns's own probe arrived as a client query"
        );
        if probe.arrivals >= ARRIVALS {
            let found = Loop {
                zone: probe.zone.clone(),
                upstreams: probe.upstreams.clone(),
                probe: probe.shown.clone(),
                arrivals: probe.arrivals,
                from: probe.from,
            };
            self.found.send_if_modified(|slot| {
                let first = slot.is_none();
                if first {
                    *slot = Some(Arc::new(found));
                }
                first
            });
        }
        true
    }

    /// `key`, asked by the client at `from`, reached the miss path (call only while
    /// [`Detector::armed`], and only for client queries: a background refresh is not an
    /// arrival). Returns whether it was a probe of the running check.
    pub fn arrived(&self, key: &Key, from: SocketAddr) -> bool {
        self.arrived_name(key.qname(), key.qtype(), Some(from))
    }

    /// Registers the probes and arms the detector.
    fn arm(&self, probes: Vec<Probe>) {
        *self.probes.lock().unwrap_or_else(PoisonError::into_inner) = probes;
        self.armed.store(true, Ordering::Relaxed);
    }

    fn disarm(&self) {
        self.armed.store(false, Ordering::Relaxed);
        self.probes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Resolves once a loop has been found.
    async fn found(&self) -> Arc<Loop> {
        let mut rx = self.found.subscribe();
        let found = match rx.wait_for(Option::is_some).await {
            Ok(slot) => slot.clone(),
            // The sender lives as long as `self`.
            Err(_) => None,
        };
        match found {
            Some(found) => found,
            None => std::future::pending().await,
        }
    }
}

/// `<a>.<b>.<zone>` for the canonical `zone`: presentation and wire form.
fn probe_name(zone: &str, a: u64, b: u64) -> (String, Vec<u8>) {
    let shown = if zone == "." {
        format!("{a}.{b}.")
    } else {
        format!("{a}.{b}.{zone}")
    };
    (shown.clone(), crate::config::wire(&shown))
}

/// The query sent upstream for a probe name: what a client's `HINFO` query for it would become.
/// HINFO (RFC 1035 §3.2.2), as CoreDNS's probe, so that nothing real is asked.
fn probe_query(name: &[u8]) -> Option<Vec<u8>> {
    let key = Key::new(name, HINFO, class::IN, false, false)?;
    let mut query = Vec::with_capacity(key.as_bytes().len() + 23);
    nodedns_wire::build_query(key.as_bytes(), 0, &mut query)?;
    Some(query)
}

/// One zone to probe and the upstreams its block forwards to.
#[derive(Debug, Clone)]
pub struct Target {
    /// Canonical form.
    pub zone: String,
    pub group: Arc<Group>,
}

/// The zones of `snap` to probe: every zone of a block with `loop` that a `forward` line takes (a
/// zone outside FROM, or under an `except`, never reaches the upstream through this block).
pub fn targets(snap: &Snapshot) -> Vec<Target> {
    let mut out = Vec::new();
    for zone in snap.zones.iter().filter(|z| z.server.loop_check) {
        for name in &zone.server.zones {
            // The apex routes as `<a>.<b>.<zone>` does: random labels match no `except`.
            let wire = crate::config::wire(name);
            let routed = zone
                .server
                .listen
                .first()
                .and_then(|local| snap.route(&wire, *local));
            let group = zone.group_for(&wire);
            if let (Some(group), true) = (
                group,
                routed.is_some_and(|(to, route)| route.forward && Arc::ptr_eq(to, zone)),
            ) {
                out.push(Target {
                    zone: name.clone(),
                    group: group.clone(),
                });
            } else {
                tracing::debug!(zone = %name, "loop check: the block does not forward its zone");
            }
        }
    }
    out
}

/// Probes every target (see the module docs). Returns the loop found, or `None` once every
/// probe was answered (or given up on) and [`GRACE`] passed without one.
pub async fn check(detector: &Detector, targets: Vec<Target>) -> Option<Arc<Loop>> {
    let mut probes = Vec::new();
    let mut sends = JoinSet::new();
    for Target { zone, group } in targets {
        let (shown, wire) = probe_name(&zone, rand::random(), rand::random());
        let Some(query) = probe_query(&wire) else {
            continue;
        };
        probes.push(Probe {
            name: wire,
            shown,
            zone: zone.clone(),
            upstreams: group.config().addrs.clone(),
            arrivals: 0,
            from: None,
        });
        sends.spawn(send(group, query, zone));
    }
    if probes.is_empty() {
        return None;
    }
    detector.arm(probes);
    let verdict = tokio::select! {
        found = detector.found() => Some(found),
        () = async {
            while sends.join_next().await.is_some() {}
            tokio::time::sleep(GRACE).await;
        } => None,
    };
    detector.disarm();
    if verdict.is_none() {
        tracing::info!("loop check: no forwarding loop");
    }
    verdict
}

/// Sends one probe until an upstream answers it, retrying for up to [`DEADLINE`].
async fn send(group: Arc<Group>, query: Vec<u8>, zone: String) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let err = match group.query(&query).await {
            Ok(reply) if Header::read(&reply).map(|h| h.rcode()) != Some(rcode::SERVFAIL) => {
                tracing::debug!(%zone, "loop check: the probe was answered");
                return;
            }
            Ok(_) => "SERVFAIL".to_owned(),
            Err(err) => err.to_string(),
        };
        if Instant::now() + RETRY >= deadline {
            tracing::warn!(
                %zone,
                %err,
                "loop check gave up: no upstream answered the probe within {DEADLINE:?}"
            );
            return;
        }
        tracing::debug!(%zone, %err, "loop check: no answer to the probe yet");
        tokio::time::sleep(RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    fn detector_with(zone: &str) -> (Detector, Vec<u8>) {
        let (shown, name) = probe_name(zone, 11, 22);
        let detector = Detector::default();
        detector.arm(vec![Probe {
            name: name.clone(),
            shown,
            zone: zone.to_owned(),
            upstreams: vec!["10.96.0.11:53".parse().unwrap()],
            arrivals: 0,
            from: None,
        }]);
        (detector, name)
    }

    /// The labels of a wire name.
    fn labels(mut name: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        while let Some((&len, rest)) = name.split_first() {
            if len == 0 {
                break;
            }
            out.push(&rest[..usize::from(len)]);
            name = &rest[usize::from(len)..];
        }
        out
    }

    fn verdict(detector: &Detector) -> Option<Arc<Loop>> {
        detector.found.borrow().clone()
    }

    #[test]
    fn probe_names_are_two_random_labels_under_the_zone() {
        let (shown, wire) = probe_name("cluster.local.", 1, 23);
        assert_eq!(shown, "1.23.cluster.local.");
        assert_eq!(wire, b"\x011\x0223\x07cluster\x05local\x00");
        let (shown, wire) = probe_name(".", 4, 5);
        assert_eq!(shown, "4.5.");
        assert_eq!(wire, b"\x014\x015\x00");
        let query = probe_query(&wire).unwrap();
        let parsed = nodedns_wire::Query::parse(&query).unwrap();
        assert_eq!(parsed.qname(), wire.as_slice());
        assert_eq!(parsed.qtype(), HINFO);
        assert!(parsed.rd());
    }

    #[test]
    fn two_arrivals_of_a_probe_are_a_loop() {
        let (detector, name) = detector_with("cluster.local.");
        let hop: SocketAddr = "10.244.2.2:40000".parse().unwrap();
        assert!(detector.arrived_name(&name, HINFO, Some(hop)));
        assert_eq!(verdict(&detector), None, "one arrival is not yet a loop");
        assert!(detector.arrived_name(&name, HINFO, None));
        let found = verdict(&detector).expect("a loop after two arrivals");
        assert_eq!(found.zone, "cluster.local.");
        assert_eq!(found.arrivals, 2);
        assert_eq!(found.from, Some(hop));
        let text = found.to_string();
        assert!(
            text.starts_with("forwarding loop detected: zone `cluster.local.` forwards to 10.96.0.11:53, which forwards back to nodedns"),
            "{text}"
        );
        assert!(text.contains("11.22.cluster.local. HINFO"), "{text}");
        assert!(text.contains("Fix the upstream"), "{text}");
        // The first verdict stays.
        assert!(detector.arrived_name(&name, HINFO, None));
        assert_eq!(verdict(&detector).unwrap().arrivals, 2);
    }

    #[test]
    fn other_names_types_and_a_disarmed_detector_are_ignored() {
        let (detector, name) = detector_with(".");
        assert!(!detector.arrived_name(&name, nodedns_wire::rtype::A, None));
        assert!(!detector.arrived_name(b"\x014\x015\x00", HINFO, None));
        assert!(
            !detector.arrived_name(b"\x05\x00", HINFO, None),
            "malformed"
        );
        detector.disarm();
        assert!(!detector.armed());
        assert!(!detector.arrived_name(&name, HINFO, None));
        assert!(!detector.arrived_name(&name, HINFO, None));
        assert_eq!(verdict(&detector), None);
    }

    /// An upstream on a real UDP socket that answers every query with NXDOMAIN (the header
    /// flipped to a response), as an upstream without a loop does; it passes each query's
    /// question on to the test.
    fn nxdomain_upstream() -> (SocketAddr, std::sync::mpsc::Receiver<Vec<u8>>) {
        upstream_failing_first(0)
    }

    /// [`nxdomain_upstream`], but the first `servfails` queries get SERVFAIL.
    fn upstream_failing_first(
        mut servfails: usize,
    ) -> (SocketAddr, std::sync::mpsc::Receiver<Vec<u8>>) {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, peer)) = socket.recv_from(&mut buf) {
                let mut reply = buf[..n].to_vec();
                if let Ok(query) = nodedns_wire::Query::parse(&reply) {
                    let _ = tx.send(query.key().as_bytes().to_vec());
                }
                let code = if servfails > 0 { rcode::SERVFAIL } else { 3 }; // else NXDOMAIN
                servfails = servfails.saturating_sub(1);
                reply[2] |= 0x80; // QR
                reply[3] = (reply[3] & 0xf0) | code;
                let _ = socket.send_to(&reply, peer);
            }
        });
        (addr, rx)
    }

    fn target(zone: &str, upstream: SocketAddr) -> Target {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = nodedns_upstream::Metrics::register(&mut registry);
        let config = nodedns_upstream::Config {
            addrs: vec![upstream],
            transport: nodedns_upstream::Transport::PreferUdp,
            max_fails: 0,
            ..Default::default()
        };
        Target {
            zone: zone.to_owned(),
            group: Arc::new(Group::new(config, &metrics).unwrap()),
        }
    }

    #[tokio::test]
    async fn an_answered_probe_ends_the_check_without_a_verdict_and_disarms() {
        let (upstream, questions) = nxdomain_upstream();
        let detector = Detector::default();
        let started = Instant::now();
        let verdict = tokio::time::timeout(
            GRACE * 5,
            check(&detector, vec![target("cluster.local.", upstream)]),
        )
        .await
        .expect("the check ends");
        assert_eq!(verdict, None);
        assert!(!detector.armed(), "disarmed at the end");
        assert!(
            started.elapsed() >= GRACE,
            "arrivals are watched for the grace period"
        );
        let key = questions.try_recv().expect("the probe went upstream");
        let key = nodedns_wire::Key::from_bytes(&key).unwrap();
        assert_eq!(key.qtype(), HINFO);
        assert!(key.qname().ends_with(b"\x07cluster\x05local\x00"));
        let labels: Vec<&[u8]> = labels(key.qname());
        assert_eq!(labels.len(), 4, "<a>.<b>.cluster.local.");
        assert!(labels[..2].iter().all(|l| l.iter().all(u8::is_ascii_digit)));
        assert!(questions.try_recv().is_err(), "answered once: sent once");
    }

    #[tokio::test]
    async fn a_servfail_is_no_answer_and_the_probe_is_sent_again() {
        let (upstream, questions) = upstream_failing_first(2);
        let detector = Detector::default();
        let verdict = tokio::time::timeout(
            DEADLINE,
            check(&detector, vec![target("cluster.local.", upstream)]),
        )
        .await
        .expect("the check ends");
        assert_eq!(verdict, None);
        let sent: Vec<Vec<u8>> = questions.try_iter().collect();
        assert_eq!(sent.len(), 3, "two SERVFAILs retried, then answered");
        assert!(sent.iter().all(|key| *key == sent[0]), "one probe name");
    }

    fn server(zones: &[&str], except: &[&str], loop_check: bool) -> crate::config::Server {
        crate::config::Server {
            zones: zones.iter().map(|z| (*z).to_owned()).collect(),
            listen: vec!["127.0.0.1:53".parse().unwrap()],
            cache: None,
            forwards: vec![crate::config::Forward {
                from: ".".to_owned(),
                except: except.iter().map(|z| (*z).to_owned()).collect(),
                next: Vec::new(),
                upstream: nodedns_upstream::Config {
                    addrs: vec!["192.0.2.53:53".parse().unwrap()],
                    max_fails: 0,
                    ..Default::default()
                },
            }],
            log: Vec::new(),
            errors: false,
            loop_check,
            dnstap: Vec::new(),
            chain: Default::default(),
            scheme: Default::default(),
            tls: None,
        }
    }

    #[tokio::test]
    async fn only_zones_a_block_with_loop_forwards_are_probed() {
        let config = crate::config::Config {
            servers: vec![
                server(
                    &["example.", "internal.example."],
                    &["internal.example."],
                    true,
                ),
                server(&["cluster.local."], &[], false),
                server(&["."], &[], true),
            ],
            ..Default::default()
        };
        let mut registry = prometheus_client::registry::Registry::default();
        let upstream_metrics = nodedns_upstream::Metrics::register(&mut registry);
        let metrics = crate::metrics::Metrics::new(&["127.0.0.1:53".parse().unwrap()], true);
        let taps = crate::dnstap::Metrics::default();
        let snap = Snapshot::build(
            Arc::new(config),
            None,
            &upstream_metrics,
            &Default::default(),
            &metrics,
            &taps,
        )
        .unwrap();
        let zones: Vec<String> = targets(&snap).into_iter().map(|t| t.zone).collect();
        assert_eq!(zones, ["example.", "."]);
    }

    #[tokio::test]
    async fn nothing_to_probe_returns_at_once() {
        let detector = Detector::default();
        let verdict = tokio::time::timeout(Duration::from_millis(100), check(&detector, vec![]))
            .await
            .expect("returns at once");
        assert_eq!(verdict, None);
        assert!(!detector.armed());
    }
}
