//! The dialer a group uses in production: plain TCP to plain upstreams, DNS over TLS to the
//! `tls://` ones, so one `forward` may list both (as CoreDNS allows).
//!
//! A TLS connection is pooled exactly as a TCP one: it carries one query at a time, is reused
//! until idle for `expire`, and is replaced at once when a reused one turns out closed. Only the
//! dial differs, and the liveness check of an idle connection: TLS records may arrive on an idle
//! connection that are no data (session tickets, a close_notify), so it asks the TLS stream, not
//! the socket.
//!
//! The dial (TCP connect and handshake) has no timer of its own, as no step of an exchange has:
//! the group drops it when it outlasts the exchange's read timeout or the query's deadline, or
//! when a hedge on another connection was answered first. A handshake that completes proves the
//! path alive, as a TCP connect does for plain upstreams: a hedge that got that far and is not
//! answered either means a slow server, not a dead one, and is not hedged again.
//!
//! A handshake that fails, for whatever reason (a certificate that does not verify, a server
//! that does not speak TLS, no answer within the exchange's bounds), fails the dial: the pool
//! sees a connection it could not open, the upstream's health checks start, and no query is
//! ever written on that connection.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

use prometheus_client::metrics::counter::Counter;
use rustls::HandshakeKind;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::dial::{self, Dial, Tcp};
use crate::metrics::{Handshakes, Metrics};
use crate::tls::Settings;

/// Plain connections from `D`, with TLS on top for the addresses of the group's
/// [`Settings`]. `D` is [`Tcp`] in production, an in-memory pipe in the tests.
#[derive(Debug)]
pub struct Net<D: Dial = Tcp> {
    inner: D,
    tls: Option<Tls>,
}

struct Tls {
    settings: Settings,
    connector: TlsConnector,
    /// Per TLS address: its handshake counters.
    targets: Box<[(SocketAddr, Handshakes)]>,
    /// The addresses whose last handshake failed, so that a failure is logged as a warning
    /// once, not once per query.
    failing: Mutex<Vec<SocketAddr>>,
}

/// One connection [`Net`] opened.
#[derive(Debug)]
pub enum Stream<S> {
    Plain(S),
    /// Boxed: a TLS session's state is large, and most groups have none.
    Tls(Box<TlsStream<S>>),
}

impl<D: Dial> Net<D> {
    /// Plain connections from `inner`, and TLS over them to the addresses of `tls`, counted in
    /// `metrics`.
    pub fn new(inner: D, tls: Option<&Settings>, metrics: &Metrics) -> Self {
        let tls = tls.map(|settings| Tls {
            connector: TlsConnector::from(settings.client()),
            targets: settings
                .addrs
                .iter()
                .map(|&addr| (addr, metrics.handshakes(addr)))
                .collect(),
            settings: settings.clone(),
            failing: Mutex::new(Vec::new()),
        });
        Net { inner, tls }
    }
}

impl<D: Dial> Dial for Net<D> {
    type Conn = Stream<D::Conn>;

    async fn dial(&self, addr: SocketAddr) -> io::Result<Stream<D::Conn>> {
        let tls = self.tls.as_ref().and_then(|tls| {
            let (_, handshakes) = tls.targets.iter().find(|(a, _)| *a == addr)?;
            Some((tls, handshakes))
        });
        let stream = self.inner.dial(addr).await?;
        match tls {
            None => Ok(Stream::Plain(stream)),
            Some((tls, handshakes)) => tls.handshake(addr, stream, handshakes).await,
        }
    }

    fn usable(&self, conn: &mut Stream<D::Conn>) -> bool {
        match conn {
            Stream::Plain(stream) => self.inner.usable(stream),
            Stream::Tls(stream) => dial::nothing_to_read(stream),
        }
    }

    /// A TLS session's stream cannot be taken apart and put together again: a TLS connection
    /// stays on the runtime that opened it.
    fn movable(&self, conn: &Stream<D::Conn>) -> bool {
        match conn {
            Stream::Plain(stream) => self.inner.movable(stream),
            Stream::Tls(_) => false,
        }
    }

    fn rehome(&self, conn: Stream<D::Conn>) -> Option<Stream<D::Conn>> {
        match conn {
            Stream::Plain(stream) => self.inner.rehome(stream).map(Stream::Plain),
            Stream::Tls(_) => None,
        }
    }
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Tls {
    async fn handshake<S>(
        &self,
        addr: SocketAddr,
        stream: S,
        handshakes: &Handshakes,
    ) -> io::Result<Stream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        // Counts the handshake as failed unless it completes: the group drops this future when
        // the read timeout or the deadline passes first (a server that never answers the
        // ClientHello), or when a hedge was answered first.
        let mut unfinished = Unfinished(Some(&handshakes.failed));
        let result = self
            .connector
            .connect(self.settings.name_for(addr), stream)
            .await;
        unfinished.0 = None;
        match result {
            Ok(stream) => {
                let kind = stream.get_ref().1.handshake_kind();
                match kind {
                    Some(HandshakeKind::Resumed) => handshakes.resumed.inc(),
                    _ => handshakes.full.inc(),
                };
                if self.recovered(addr) {
                    tracing::info!(upstream = %addr, "TLS handshake succeeded again");
                }
                Ok(Stream::Tls(Box::new(stream)))
            }
            Err(error) => {
                handshakes.failed.inc();
                if self.newly_failing(addr) {
                    tracing::warn!(upstream = %addr, %error, "TLS handshake failed; queries to this upstream fail until it succeeds");
                } else {
                    tracing::debug!(upstream = %addr, %error, "TLS handshake failed");
                }
                Err(error)
            }
        }
    }

    /// Marks `addr` failing; true if it was not already.
    fn newly_failing(&self, addr: SocketAddr) -> bool {
        let mut failing = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
        if failing.contains(&addr) {
            return false;
        }
        failing.push(addr);
        true
    }

    /// Clears `addr`'s failing mark; true if it had one.
    fn recovered(&self, addr: SocketAddr) -> bool {
        let mut failing = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
        let before = failing.len();
        failing.retain(|a| *a != addr);
        failing.len() != before
    }
}

/// Counts a failed handshake when dropped (see [`Tls::handshake`]).
struct Unfinished<'a>(Option<&'a Counter>);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(failed) = self.0 {
            failed.inc();
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::Duration;

    use prometheus_client::encoding::text::encode;
    use prometheus_client::registry::Registry;
    use tokio::time::Instant;

    use super::*;
    use crate::scripted::{Memory, Mode, Upstream, query, read_reply};
    use crate::testpki::{Ca, Dir, Validity, server_config};
    use crate::tls::Files;
    use crate::{Config, Error, Group, Selection, Transport};

    const NAME: &str = "dns.example";

    /// A group over in-memory pipes with TLS to `tls` (loaded from `files`, verified against
    /// `server_name`), and its registry.
    struct Setup {
        group: Group<Net<Memory>>,
        registry: Registry,
    }

    fn setup(
        addrs: &[SocketAddr],
        tls: &[SocketAddr],
        server_name: Option<&str>,
        files: &Files,
        tweak: impl FnOnce(&mut Config),
    ) -> Setup {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let settings = Settings::load(tls.to_vec(), server_name, files).expect("settings load");
        let mut config = Config {
            addrs: addrs.to_vec(),
            tls: Some(settings),
            selection: Selection::Sequential,
            timeout: Duration::from_millis(500),
            health_check: Duration::from_millis(20),
            ..Config::default()
        };
        tweak(&mut config);
        let net = Net::new(Memory, config.tls.as_ref(), &metrics);
        let group = Group::with_dialer(config, &metrics, net).expect("valid config");
        Setup { group, registry }
    }

    impl Setup {
        /// The value of the series `series` (name and labels, as exposed).
        fn metric(&self, series: &str) -> u64 {
            let mut text = String::new();
            encode(&mut text, &self.registry).unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        }

        fn handshakes(&self, addr: SocketAddr, result: &str) -> u64 {
            self.metric(&format!(
                r#"nodedns_upstream_tls_handshakes_total{{to="{addr}",result="{result}"}}"#
            ))
        }

        async fn ask(&self, name: &str) -> Result<Option<Ipv4Addr>, Error> {
            let reply = self.group.query(&query(name, 0x4242)).await?;
            let (id, ip, qname) = read_reply(&reply);
            assert_eq!((id, qname.as_str()), (0x4242, name));
            Ok(ip)
        }
    }

    fn tag(n: u8) -> Option<Ipv4Addr> {
        Some(Ipv4Addr::new(192, 0, 2, n))
    }

    /// A DoT upstream presenting a certificate `ca` signed for `sans`.
    async fn dot(ca: &Ca, sans: &[&str], validity: Validity, tag: u8) -> Upstream {
        let config = server_config(&ca.server(sans, validity), None);
        Upstream::start_tls(Mode::Answer, tag, config).await
    }

    #[tokio::test(start_paused = true)]
    async fn queries_flow_over_one_reused_tls_connection() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let up = dot(&ca, &[NAME], Validity::Now, 1).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |_| {});
        for i in 0..20 {
            assert_eq!(s.ask(&format!("q{i}.example.")).await, Ok(tag(1)));
        }
        // One handshake, then the session tickets the server sent on the idle connection did
        // not make it look unusable.
        assert_eq!(up.stats().accepted.load(SeqCst), 1);
        assert_eq!(s.handshakes(up.addr, "full"), 1);
        let to = format!(r#"proxy_name="forward",to="{}",proto="tcp-tls""#, up.addr);
        assert_eq!(
            s.metric(&format!("coredns_proxy_conn_cache_misses_total{{{to}}}")),
            1
        );
        assert_eq!(
            s.metric(&format!("coredns_proxy_conn_cache_hits_total{{{to}}}")),
            19
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_resumes_the_earlier_session() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let up = dot(&ca, &[NAME], Validity::Now, 1).await;
        let expire = Duration::from_millis(100);
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |c| {
            c.expire = expire;
        });
        assert_eq!(s.ask("a.example.").await, Ok(tag(1)));
        up.until("the idle connection expired", |st| {
            st.client_closed.load(SeqCst) == 1
        })
        .await;
        assert_eq!(s.ask("b.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        assert_eq!(
            (
                s.handshakes(up.addr, "full"),
                s.handshakes(up.addr, "resumed")
            ),
            (1, 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_server_name_the_certificate_must_carry_the_address() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let ip = Upstream::start(Mode::Answer, 0).await.addr.ip().to_string();
        let up = dot(&ca, &[&ip], Validity::Now, 1).await;
        let s = setup(&[up.addr], &[up.addr], None, &dir.trust(&ca), |_| {});
        assert_eq!(s.ask("a.example.").await, Ok(tag(1)));

        let named = dot(&ca, &[NAME], Validity::Now, 2).await;
        let s = setup(&[named.addr], &[named.addr], None, &dir.trust(&ca), |_| {});
        assert_eq!(s.ask("a.example.").await, Err(Error::Unreachable));
        assert_eq!(named.stats().tcp_queries.load(SeqCst), 0);
    }

    /// Each certificate that must not be trusted: the query fails (the block answers
    /// SERVFAIL), every handshake is counted as failed and against the upstream's health, and
    /// no query is ever written to the server.
    async fn refused(up: &Upstream, s: &Setup) {
        assert_eq!(s.ask("a.example.").await, Err(Error::Unreachable));
        assert_eq!(s.ask("b.example.").await, Err(Error::Unreachable));
        let stats = up.stats();
        assert_eq!(stats.tcp_queries.load(SeqCst), 0, "{stats:?}");
        assert_eq!(stats.accepted.load(SeqCst), 0, "{stats:?}");
        up.until("the server saw the handshakes fail", |st| {
            st.tls_failed.load(SeqCst) >= 6
        })
        .await;
        // Three passes per query; then health checks, also over TLS, also failing: more than
        // max_fails of them in a row mark the address down.
        assert!(s.handshakes(up.addr, "failed") >= 6);
        assert_eq!(s.handshakes(up.addr, "full"), 0);
        let mut down = s.group.down_mark(up.addr);
        down.wait_for(|d| *d).await.expect("health alive");
        assert!(!s.group.healthy(), "marked down after max_fails");
        let failures = format!(
            r#"coredns_proxy_healthcheck_failures_total{{proxy_name="forward",to="{}"}}"#,
            up.addr
        );
        let before = s.metric(&failures);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(s.metric(&failures) > before, "health checks fail too");
        assert_eq!(stats.tcp_queries.load(SeqCst), 0, "{stats:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_certificate_from_another_ca_is_refused() {
        let (ca, other, dir) = (Ca::new("test CA"), Ca::new("other CA"), Dir::new());
        let up = dot(&other, &[NAME], Validity::Now, 1).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |_| {});
        refused(&up, &s).await;
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_certificate_is_refused() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let up = dot(&ca, &[NAME], Validity::Expired, 1).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |_| {});
        refused(&up, &s).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_certificate_for_another_name_is_refused() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let up = dot(&ca, &["other.example"], Validity::Now, 1).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |_| {});
        refused(&up, &s).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_dns_server_on_the_port_times_out_and_is_never_sent_a_query() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let plain = Upstream::start(Mode::Answer, 1).await;
        let timeout = Duration::from_millis(300);
        let s = setup(
            &[plain.addr],
            &[plain.addr],
            Some(NAME),
            &dir.trust(&ca),
            |c| {
                c.timeout = timeout;
            },
        );
        let start = Instant::now();
        // It reads the ClientHello as the start of a long DNS message and waits for the rest.
        assert_eq!(s.ask("a.example.").await, Err(Error::Timeout));
        assert_eq!(start.elapsed(), timeout);
        assert_eq!(plain.stats().tcp_queries.load(SeqCst), 0);
        // A handshake unfinished at the hedge timeout (200 ms before any reply) is hedged as a
        // connect is: a second connection beside it, before the deadline.
        assert_eq!(plain.stats().accepted.load(SeqCst), 2, "one hedge");
        assert_eq!(
            s.handshakes(plain.addr, "failed"),
            2,
            "unfinished ones count"
        );
        assert_eq!(plain.stats().udp_queries.load(SeqCst), 0, "no downgrade");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_certificate_is_presented_when_the_server_demands_one() {
        let (ca, clients, dir) = (Ca::new("test CA"), Ca::new("client CA"), Dir::new());
        let server = server_config(&ca.server(&[NAME], Validity::Now), Some(&clients));
        let up = Upstream::start_tls(Mode::Answer, 1, server).await;
        let files = dir.trust_with_client(&ca, &clients.client("node.example"));
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &files, |_| {});
        assert_eq!(s.ask("a.example.").await, Ok(tag(1)));

        // Without one, the server ends the connection; nothing is answered.
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |c| {
            c.max_fails = 0;
        });
        assert!(s.ask("b.example.").await.is_err());
        assert_eq!(up.stats().tcp_queries.load(SeqCst), 1, "only the first");
    }

    #[tokio::test(start_paused = true)]
    async fn prefer_udp_does_not_apply_to_tls_upstreams_nor_to_their_health_checks() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let up = dot(&ca, &[NAME], Validity::Now, 1).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |c| {
            c.transport = Transport::PreferUdp;
            c.max_fails = 1;
        });
        assert_eq!(s.ask("a.example.").await, Ok(tag(1)));
        up.set_mode(Mode::Silent);
        assert_eq!(s.ask("b.example.").await, Err(Error::Timeout));
        // The silent exchanges start the checks, over TLS and unanswered too: the second in a
        // row marks the address down.
        let mut down = s.group.down_mark(up.addr);
        down.wait_for(|d| *d).await.expect("health alive");
        assert!(!s.group.healthy());
        let queries = up.stats().tcp_queries.load(SeqCst);
        up.until("a health check over TLS", |st| {
            st.tcp_queries.load(SeqCst) > queries
        })
        .await;
        up.set_mode(Mode::Answer);
        // The check in flight waits out its deadline (the query it sent was read silently);
        // the next one is answered.
        let checked = Instant::now();
        while !s.group.healthy() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(
                checked.elapsed() < Duration::from_secs(2),
                "a health check marks it up"
            );
        }
        assert_eq!(up.stats().udp_queries.load(SeqCst), 0);
        assert!(
            s.handshakes(up.addr, "resumed") >= 1,
            "health checks resume"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_reused_tls_connection_closed_with_the_query_in_flight_is_retried_on_a_fresh_one() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let server = server_config(&ca.server(&[NAME], Validity::Now), None);
        let up = Upstream::start_tls(Mode::DropAfter(1), 1, server).await;
        let s = setup(&[up.addr], &[up.addr], Some(NAME), &dir.trust(&ca), |c| {
            c.max_fails = 1;
        });
        assert_eq!(s.ask("a.example.").await, Ok(tag(1)));
        assert_eq!(s.ask("b.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        assert_eq!(up.stats().tcp_queries.load(SeqCst), 3);
        let to = format!(r#"{{to="{}"}}"#, up.addr);
        assert_eq!(
            s.metric(&format!("nodedns_upstream_connection_resets_total{to}")),
            1
        );
        assert!(s.group.healthy(), "a stale connection is not a failure");
    }

    #[tokio::test(start_paused = true)]
    async fn one_group_mixes_plain_and_tls_upstreams() {
        let (ca, dir) = (Ca::new("test CA"), Dir::new());
        let plain = Upstream::start(Mode::Answer, 1).await;
        let tls = dot(&ca, &[NAME], Validity::Now, 2).await;
        let s = setup(
            &[plain.addr, tls.addr],
            &[tls.addr],
            Some(NAME),
            &dir.trust(&ca),
            |c| c.selection = Selection::RoundRobin,
        );
        let mut seen = Vec::new();
        for i in 0..4 {
            seen.push(s.ask(&format!("m{i}.example.")).await.unwrap());
        }
        seen.sort();
        assert_eq!(seen, [tag(1), tag(1), tag(2), tag(2)]);
        assert_eq!(plain.stats().tcp_queries.load(SeqCst), 2);
        assert_eq!(tls.stats().tcp_queries.load(SeqCst), 2);
        assert_eq!(s.handshakes(tls.addr, "full"), 1);
    }
}
