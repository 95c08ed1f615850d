//! The upstream metrics.
//!
//! Names, labels and meanings follow CoreDNS 1.11 (the version node-cache 1.23+ embeds):
//! `plugin/pkg/proxy` exports `coredns_proxy_*` with `proxy_name="forward"`, and `plugin/forward`
//! keeps `coredns_forward_healthcheck_broken_total` and `coredns_forward_max_concurrent_rejects_total`.
//! The older per-upstream counters `coredns_forward_requests_total{to}` and
//! `coredns_forward_responses_total{rcode,to}` (CoreDNS ≤ 1.10, deprecated in 1.11) are exported
//! too, so dashboards built for older node-cache images keep working. What CoreDNS has no name
//! for (the pool) is `nodedns_upstream_*`.
//!
//! Labeled handles are resolved once per address when a [`crate::Group`] is built ([`Target`]),
//! per RCODE on its first use, never per query: a query touches atomics only.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The `proxy_name` label CoreDNS's forward plugin puts on the `coredns_proxy_*` metrics.
const PROXY_NAME: &str = "forward";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyTo {
    proxy_name: &'static str,
    to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyToRcode {
    proxy_name: &'static str,
    to: String,
    rcode: Cow<'static, str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyToProto {
    proxy_name: &'static str,
    to: String,
    proto: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToResult {
    to: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct To {
    to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RcodeTo {
    rcode: Cow<'static, str>,
    to: String,
}

type HistogramFamily = Family<ProxyToRcode, Histogram, fn() -> Histogram>;

/// CoreDNS's `plugin.TimeBuckets`: 0.25 ms doubling up to 8.192 s.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.00025, 2.0, 16))
}

/// Every metric of the upstream groups. Register once; every [`crate::Group`] built from it shares
/// the series (two groups forwarding to the same address add up, as in CoreDNS).
#[derive(Debug, Clone)]
pub struct Metrics {
    request_duration: HistogramFamily,
    healthcheck_failures: Family<ProxyTo, Counter>,
    conn_cache_hits: Family<ProxyToProto, Counter>,
    conn_cache_misses: Family<ProxyToProto, Counter>,
    pub(crate) healthcheck_broken: Counter,
    pub(crate) max_concurrent_rejects: Counter,
    requests: Family<To, Counter>,
    responses: Family<RcodeTo, Counter>,
    connections: Family<To, Gauge>,
    in_flight: Family<To, Gauge>,
    connection_resets: Family<To, Counter>,
    retries: Family<To, Counter>,
    hedges: Family<To, Counter>,
    connects: Family<To, Counter>,
    moves: Family<To, Counter>,
    tls_handshakes: Family<ToResult, Counter>,
}

impl Metrics {
    /// Creates the metrics and registers them. Counter names are given without `_total` and
    /// HELP texts without their final period: prometheus-client appends both.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            request_duration: Family::new_with_constructor(duration_histogram),
            healthcheck_failures: Family::default(),
            conn_cache_hits: Family::default(),
            conn_cache_misses: Family::default(),
            healthcheck_broken: Counter::default(),
            max_concurrent_rejects: Counter::default(),
            requests: Family::default(),
            responses: Family::default(),
            connections: Family::default(),
            in_flight: Family::default(),
            connection_resets: Family::default(),
            retries: Family::default(),
            hedges: Family::default(),
            connects: Family::default(),
            moves: Family::default(),
            tls_handshakes: Family::default(),
        };
        registry.register(
            "coredns_proxy_request_duration_seconds",
            "Histogram of the time each request took",
            m.request_duration.clone(),
        );
        registry.register(
            "coredns_proxy_healthcheck_failures",
            "Counter of the number of failed healthchecks",
            m.healthcheck_failures.clone(),
        );
        registry.register(
            "coredns_proxy_conn_cache_hits",
            "Counter of connection cache hits per upstream and protocol",
            m.conn_cache_hits.clone(),
        );
        registry.register(
            "coredns_proxy_conn_cache_misses",
            "Counter of connection cache misses per upstream and protocol",
            m.conn_cache_misses.clone(),
        );
        registry.register(
            "coredns_forward_healthcheck_broken",
            "Counter of the number of complete failures of the healthchecks",
            m.healthcheck_broken.clone(),
        );
        registry.register(
            "coredns_forward_max_concurrent_rejects",
            "Counter of the number of queries rejected because the concurrent queries were at maximum",
            m.max_concurrent_rejects.clone(),
        );
        registry.register(
            "coredns_forward_requests",
            "Counter of requests made per upstream",
            m.requests.clone(),
        );
        registry.register(
            "coredns_forward_responses",
            "Counter of responses received per upstream",
            m.responses.clone(),
        );
        registry.register(
            "nodedns_upstream_connections",
            "Open TCP connections to the upstream (in use and idle)",
            m.connections.clone(),
        );
        registry.register(
            "nodedns_upstream_in_flight",
            "Exchanges with the upstream in progress (waiting for a connection included)",
            m.in_flight.clone(),
        );
        registry.register(
            "nodedns_upstream_connection_resets",
            "TCP connections closed or reset by the upstream while a query was in flight",
            m.connection_resets.clone(),
        );
        registry.register(
            "nodedns_upstream_retries",
            "Exchanges with the upstream that repeat a query after an earlier exchange failed or was truncated",
            m.retries.clone(),
        );
        registry.register(
            "nodedns_upstream_hedges",
            "Exchanges that repeat a query on another connection because an earlier exchange of the same query went silent for longer than the upstream usually takes",
            m.hedges.clone(),
        );
        registry.register(
            "nodedns_upstream_connects",
            "TCP connections opened to the upstream by the pool",
            m.connects.clone(),
        );
        registry.register(
            "nodedns_upstream_connection_moves",
            "Idle TCP connections moved from one UDP worker's runtime to another's, which needed one while it had none idle (instead of opening another)",
            m.moves.clone(),
        );
        registry.register(
            "nodedns_upstream_tls_handshakes",
            "TLS handshakes with a tls:// upstream (pooled connections and health checks), by result: full, resumed (an earlier session), failed (certificate refused, not TLS, or unfinished by the deadline)",
            m.tls_handshakes.clone(),
        );
        m
    }

    /// The handshake counters of one `tls://` address.
    pub(crate) fn handshakes(&self, addr: SocketAddr) -> Handshakes {
        let counter = |result| {
            self.tls_handshakes.get_or_create_owned(&ToResult {
                to: addr.to_string(),
                result,
            })
        };
        Handshakes {
            full: counter("full"),
            resumed: counter("resumed"),
            failed: counter("failed"),
        }
    }

    /// The handles for one address; `tls`: it is a `tls://` upstream (CoreDNS labels its
    /// connections `proto="tcp-tls"`).
    pub(crate) fn target(&self, addr: SocketAddr, tls: bool) -> Target {
        // CoreDNS labels `to` with host:port, IPv6 in brackets: what SocketAddr displays.
        let to = addr.to_string();
        let stream = if tls { "tcp-tls" } else { "tcp" };
        let plain = To { to: to.clone() };
        let proto = |proto| ProxyToProto {
            proxy_name: PROXY_NAME,
            to: to.clone(),
            proto,
        };
        Target {
            requests: self.requests.get_or_create_owned(&plain),
            healthcheck_failures: self.healthcheck_failures.get_or_create_owned(&ProxyTo {
                proxy_name: PROXY_NAME,
                to: to.clone(),
            }),
            tcp_hits: self.conn_cache_hits.get_or_create_owned(&proto(stream)),
            tcp_misses: self.conn_cache_misses.get_or_create_owned(&proto(stream)),
            udp_misses: self.conn_cache_misses.get_or_create_owned(&proto("udp")),
            connections: self.connections.get_or_create_owned(&plain),
            in_flight: self.in_flight.get_or_create_owned(&plain),
            resets: self.connection_resets.get_or_create_owned(&plain),
            retries: self.retries.get_or_create_owned(&plain),
            hedges: self.hedges.get_or_create_owned(&plain),
            connects: self.connects.get_or_create_owned(&plain),
            moves: self.moves.get_or_create_owned(&plain),
            by_rcode: Default::default(),
            request_duration: self.request_duration.clone(),
            responses: self.responses.clone(),
            to,
        }
    }
}

/// One address's handles, resolved once.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) requests: Counter,
    pub(crate) healthcheck_failures: Counter,
    pub(crate) tcp_hits: Counter,
    pub(crate) tcp_misses: Counter,
    pub(crate) udp_misses: Counter,
    pub(crate) connections: Gauge,
    pub(crate) in_flight: Gauge,
    pub(crate) resets: Counter,
    pub(crate) retries: Counter,
    pub(crate) hedges: Counter,
    pub(crate) connects: Counter,
    pub(crate) moves: Counter,
    /// Duration histogram and response counter per header RCODE (4 bits), created on first use
    /// so an address shows only the RCODEs it actually returned.
    by_rcode: [OnceLock<(Histogram, Counter)>; 16],
    request_duration: HistogramFamily,
    responses: Family<RcodeTo, Counter>,
    to: String,
}

impl Target {
    /// A reply with `rcode` arrived `took` after the exchange started.
    pub(crate) fn reply(&self, rcode: u8, took: Duration) {
        let rcode = rcode & 0xf;
        let (histogram, responses) = self.by_rcode[usize::from(rcode)].get_or_init(|| {
            let name = rcode_label(rcode);
            (
                self.request_duration.get_or_create_owned(&ProxyToRcode {
                    proxy_name: PROXY_NAME,
                    to: self.to.clone(),
                    rcode: name.clone(),
                }),
                self.responses.get_or_create_owned(&RcodeTo {
                    rcode: name,
                    to: self.to.clone(),
                }),
            )
        });
        histogram.observe(took.as_secs_f64());
        responses.inc();
    }
}

/// The `rcode` label CoreDNS's forward gives a reply: the RCODE's name, or its number when it
/// has none (`plugin/pkg/proxy`: `RcodeToString`, else `strconv.Itoa`).
fn rcode_label(rcode: u8) -> Cow<'static, str> {
    match nodedns_wire::rcode::name(rcode.into()) {
        Some(name) => Cow::Borrowed(name),
        None => Cow::Owned(rcode.to_string()),
    }
}

/// One `tls://` address's handshake counters.
#[derive(Debug)]
pub(crate) struct Handshakes {
    pub(crate) full: Counter,
    pub(crate) resumed: Counter,
    pub(crate) failed: Counter,
}

/// Holds a gauge up for as long as it lives (an exchange in flight, an open connection), so a
/// dropped future can never leave it counted.
#[derive(Debug)]
pub(crate) struct Held(Gauge);

impl Held {
    pub(crate) fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Held(gauge.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    fn exposition(registry: &Registry) -> String {
        let mut out = String::new();
        encode(&mut out, registry).expect("encodes");
        out
    }

    #[test]
    fn names_and_labels_match_coredns_1_11() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let target = metrics.target("10.0.0.10:53".parse().unwrap(), false);
        target.requests.inc();
        target.reply(3, Duration::from_millis(3));
        target.healthcheck_failures.inc();
        target.tcp_hits.inc();
        metrics.healthcheck_broken.inc();
        metrics.max_concurrent_rejects.inc();
        let text = exposition(&registry);
        for line in [
            r#"coredns_proxy_request_duration_seconds_count{proxy_name="forward",to="10.0.0.10:53",rcode="NXDOMAIN"} 1"#,
            r#"coredns_proxy_request_duration_seconds_bucket{le="0.004",proxy_name="forward",to="10.0.0.10:53",rcode="NXDOMAIN"} 1"#,
            r#"coredns_proxy_healthcheck_failures_total{proxy_name="forward",to="10.0.0.10:53"} 1"#,
            r#"coredns_proxy_conn_cache_hits_total{proxy_name="forward",to="10.0.0.10:53",proto="tcp"} 1"#,
            r#"coredns_proxy_conn_cache_misses_total{proxy_name="forward",to="10.0.0.10:53",proto="udp"} 0"#,
            "coredns_forward_healthcheck_broken_total 1",
            "coredns_forward_max_concurrent_rejects_total 1",
            r#"coredns_forward_requests_total{to="10.0.0.10:53"} 1"#,
            r#"coredns_forward_responses_total{rcode="NXDOMAIN",to="10.0.0.10:53"} 1"#,
            r#"nodedns_upstream_connections{to="10.0.0.10:53"} 0"#,
            r#"nodedns_upstream_in_flight{to="10.0.0.10:53"} 0"#,
            r#"nodedns_upstream_connection_resets_total{to="10.0.0.10:53"} 0"#,
            r#"nodedns_upstream_retries_total{to="10.0.0.10:53"} 0"#,
            r#"nodedns_upstream_hedges_total{to="10.0.0.10:53"} 0"#,
            r#"nodedns_upstream_connects_total{to="10.0.0.10:53"} 0"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn rcodes_are_labeled_as_coredns_forward_labels_them() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let target = metrics.target("10.0.0.10:53".parse().unwrap(), false);
        for rcode in [2, 11, 12] {
            target.reply(rcode, Duration::from_millis(1));
        }
        let text = exposition(&registry);
        for rcode in ["SERVFAIL", "DSOTYPENI", "12"] {
            let line = format!(
                r#"coredns_forward_responses_total{{rcode="{rcode}",to="10.0.0.10:53"}} 1"#
            );
            assert!(text.contains(&line), "missing {line} in\n{text}");
            let line = format!(
                r#"coredns_proxy_request_duration_seconds_count{{proxy_name="forward",to="10.0.0.10:53",rcode="{rcode}"}} 1"#
            );
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn ipv6_upstreams_are_labeled_in_brackets() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics
            .target("[fd00::a]:53".parse().unwrap(), false)
            .requests
            .inc();
        assert!(
            exposition(&registry)
                .contains(r#"coredns_forward_requests_total{to="[fd00::a]:53"} 1"#)
        );
    }

    #[test]
    fn held_gauges_drop_back() {
        let gauge = Gauge::default();
        let a = Held::new(&gauge);
        let b = Held::new(&gauge);
        assert_eq!(gauge.get(), 2);
        drop(a);
        drop(b);
        assert_eq!(gauge.get(), 0);
    }
}
