//! The admin HTTP endpoints, each on the address it is for, as CoreDNS's plugins serve them:
//!
//! | address | paths |
//! | --- | --- |
//! | `health` (node-cache's health port, the liveness probe) | `/health` |
//! | `ready` (the readiness probe) | `/ready` |
//! | `prometheus` / `-metrics-listen-address` | `/metrics`, `/log-level`; `/health` and `/ready` too when they have no address of their own |
//! | node-cache's `-metrics-listen-address` (default `0.0.0.0:9353`, with a Corefile) | `/metrics`, `/log-level`, as node-cache serves its metrics there whatever the Corefile says |
//!
//! Several roles on one address serve the union of their paths. Anything else is 404.
//!
//! - `/health`: liveness. 200 while the process serves HTTP, draining included (a restart would
//!   not help a draining agent).
//! - `/ready`: readiness. 200 once the listeners are bound, the host rules are in place and every
//!   server block's upstream answered a probe; 503 before, and from the moment shutdown starts,
//!   so Kubernetes and Cilium stop sending new queries while the listeners still answer.
//! - `/metrics`: every metric, Prometheus text format 0.0.4 ([`crate::metrics`]).
//! - `/log-level`: `GET` prints the log filter in force; `PUT` with a filter as the body
//!   (`debug`, `info,nodedns::query=off`) replaces it, for a client on loopback whose socket
//!   belongs to the agent's own user ([`peer`]). Loopback alone would not do: in the hostNetwork
//!   modes it is shared by every hostNetwork pod of the node. A process of the agent's user could
//!   join the DNS sockets' `SO_REUSEPORT` group anyway, so it is trusted with the log level too.
//!
//! What one client can hold (docs/reliability.md): per address [`MAX_CONNECTIONS`] connections,
//! beyond which each new connection closes the oldest (so connections held open cannot lock the
//! kubelet's probes out); [`TIMEOUT`] to send a request's head (an idle keep-alive connection
//! included), to send its body, and for every write of a response to make progress (a client that
//! does not read); CoreDNS's `health`, `ready` and `prometheus` servers close after 5 s likewise.
//! An accept that fails (EMFILE) backs off, 5 ms doubling to 1 s, and logs once per 10 s
//! ([`crate::accept`], as the DNS TCP listeners do).
//!
//! The listeners use `SO_REUSEPORT` so a second instance on the node (a surge upgrade) can bind
//! beside this one.

mod peer;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::{accept, logging};

/// Default `/metrics` address when neither the Corefile (`prometheus`) nor the command line
/// (`-metrics-listen-address`) names one: node-local-dns's `:9253` with a Corefile, loopback only
/// in plain command-line mode (a development run should not open a port to the network).
pub const DEFAULT_METRICS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 9253);
pub const DEFAULT_METRICS_CLI: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9253);

/// Connections open at once on one admin address. The kubelet's two probes, a scrape and a
/// `nodedns top` need a handful; the bound keeps what a client can hold to a few hundred KiB and
/// as many descriptors.
pub const MAX_CONNECTIONS: usize = 32;

/// How long a client may take to send a request's head (from the connection's start, or from
/// the previous response: the keep-alive idle time), to send its body, and how long one write
/// of a response may wait for the client to read. CoreDNS's `ReadTimeout`, `IdleTimeout` and
/// `WriteTimeout` on these servers.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Read buffer of one connection (hyper's smallest allowed is 8 KiB). Requests here are one
/// short line and a few headers.
const MAX_BUF: usize = 16 * 1024;

/// Largest `PUT /log-level` body read.
const MAX_BODY: usize = 4096;

/// What an admin address serves: which of CoreDNS's `health`, `ready` and `prometheus`
/// listeners it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Roles {
    /// `/health`.
    pub health: bool,
    /// `/ready`.
    pub ready: bool,
    /// `/metrics` and `/log-level`.
    pub metrics: bool,
}

impl Roles {
    fn serves(self, path: &str) -> bool {
        match path {
            "/health" => self.health,
            "/ready" => self.ready,
            "/metrics" | "/log-level" => self.metrics,
            _ => false,
        }
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let paths = [
            (self.health, "/health"),
            (self.ready, "/ready"),
            (self.metrics, "/metrics"),
            (self.metrics, "/log-level"),
        ];
        let served: Vec<&str> = paths.iter().filter(|(on, _)| *on).map(|p| p.1).collect();
        f.write_str(&served.join(" "))
    }
}

/// Every address the admin endpoints are served on, and what each serves: the configured
/// `health`, `ready` and metrics addresses (the default metrics address when none is configured;
/// `cli_mode`: no Corefile), and node-cache's metrics address beside them. `/health` and
/// `/ready` without an address of their own are served on the metrics address.
pub fn addresses(config: &crate::config::Config, cli_mode: bool) -> BTreeMap<SocketAddr, Roles> {
    let metrics = config.metrics.unwrap_or(if cli_mode {
        DEFAULT_METRICS_CLI
    } else {
        DEFAULT_METRICS
    });
    let mut out: BTreeMap<SocketAddr, Roles> = BTreeMap::new();
    out.entry(metrics).or_default().metrics = true;
    for extra in &config.extra_metrics {
        out.entry(*extra).or_default().metrics = true;
    }
    if let Some(node_cache) = config.node_cache_metrics {
        out.entry(node_cache).or_default().metrics = true;
    }
    out.entry(config.health.unwrap_or(metrics))
        .or_default()
        .health = true;
    out.entry(config.ready.unwrap_or(metrics))
        .or_default()
        .ready = true;
    out
}

/// Readiness as a latch: ready once every start-up condition held, not ready from the moment
/// shutdown begins, never ready again after that.
#[derive(Debug, Default)]
pub struct Readiness {
    ready: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    pub fn set_ready(&self) {
        if !self.draining.load(Ordering::SeqCst) {
            self.ready.store(true, Ordering::SeqCst);
        }
    }

    /// Shutdown began: readiness is false from now on.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.ready.store(false, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// What the endpoints read.
pub trait Source: Send + Sync + 'static {
    /// The Prometheus text exposition (format 0.0.4).
    fn metrics(&self) -> String;
    fn readiness(&self) -> &Readiness;
    /// The log filter to show and change, if logging is reloadable.
    fn log(&self) -> Option<&logging::Handle> {
        None
    }
    /// Where the admin servers count what they refuse.
    fn counters(&self) -> &Metrics;
}

/// The admin servers' own counters.
pub type Metrics = accept::Refusals;

/// The names of the admin servers' [`Metrics`].
pub const NAMES: accept::Names = accept::Names {
    accept_errors: "nodedns_admin_accept_errors",
    accept_errors_help: "Failed accepts on the admin listeners (EMFILE and the like), each followed by a back-off",
    closed: "nodedns_admin_connections_closed",
    closed_help: "Admin connections closed by nodedns, by reason: timeout (no complete request head, body or write progress within 5 s), evicted (the oldest, to make room under the per-address cap)",
};

/// Binds an admin listener (`SO_REUSEPORT`, so a surge instance can bind beside this one).
pub fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_port(true)?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv4() {
        socket.set_freebind_v4(true)?;
    } else {
        socket.set_freebind_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    tokio::net::TcpListener::from_std(socket.into())
}

/// Serves what `roles` says on `listener` until `stop` turns true. Connections accepted by then
/// are served on until they close or time out.
pub async fn serve<S: Source>(
    listener: tokio::net::TcpListener,
    roles: Roles,
    source: Arc<S>,
    mut stop: watch::Receiver<bool>,
) {
    let address = listener.local_addr().ok();
    let open = Arc::new(Mutex::new(Open::default()));
    let mut backoff = accept::Backoff::new("admin", "nodedns_admin_accept_errors_total");
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => {
                backoff.accepted();
                accepted
            }
            Err(err) => {
                source.counters().accept_errors.inc();
                let delay = backoff.failed(&err, address);
                tokio::select! {
                    () = tokio::time::sleep(delay) => continue,
                    _ = stop.wait_for(|stop| *stop) => return,
                }
            }
        };
        let counters = source.counters().clone();
        let source = source.clone();
        Open::spawn(&open, &counters, connection(stream, peer, roles, source));
    }
}

/// The connections open on one listener, oldest first.
#[derive(Debug, Default)]
struct Open {
    next: u64,
    connections: VecDeque<(u64, AbortHandle)>,
}

impl Open {
    /// Spawns `connection`, closing the oldest one first if [`MAX_CONNECTIONS`] are open.
    fn spawn(
        open: &Arc<Mutex<Open>>,
        counters: &Metrics,
        connection: impl Future<Output = ()> + Send + 'static,
    ) {
        // Held across the spawn, so that a connection that ends at once finds itself listed.
        let mut list = open.lock().unwrap_or_else(PoisonError::into_inner);
        if list.connections.len() >= MAX_CONNECTIONS {
            if let Some((_, oldest)) = list.connections.pop_front() {
                // Dropped on a worker thread (never here, under the lock): its `Leave` finds it
                // gone already.
                oldest.abort();
                counters.closed("evicted");
            }
        }
        let id = list.next;
        list.next += 1;
        let leave = Leave {
            open: open.clone(),
            id,
        };
        let task = tokio::spawn(async move {
            let _leave = leave;
            connection.await;
        });
        list.connections.push_back((id, task.abort_handle()));
    }
}

/// Takes a connection off its listener's list when its task ends, however it ends.
struct Leave {
    open: Arc<Mutex<Open>>,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        let mut list = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = list.connections.iter().position(|(id, _)| *id == self.id) {
            list.connections.remove(at);
        }
    }
}

async fn connection<S: Source>(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    roles: Roles,
    source: Arc<S>,
) {
    let local = stream.local_addr().ok();
    let counters = source.counters().clone();
    let service = hyper::service::service_fn(move |req| {
        let source = source.clone();
        async move { Ok::<_, Infallible>(route(&*source, roles, req, peer, local).await) }
    });
    let result = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(TIMEOUT)
        .max_buf_size(MAX_BUF)
        .serve_connection(TokioIo::new(Stalls::new(stream, TIMEOUT)), service)
        .await;
    if let Err(err) = result {
        if timed_out(&err) {
            counters.closed("timeout");
        }
        tracing::debug!(%err, %peer, "admin connection ended");
    }
}

/// Whether hyper gave up on a connection for one of the timeouts: the head's, or a write's
/// ([`Stalls`]).
fn timed_out(err: &hyper::Error) -> bool {
    if err.is_timeout() {
        return true;
    }
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if cause
            .downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::TimedOut)
        {
            return true;
        }
        source = cause.source();
    }
    false
}

async fn route<S: Source>(
    source: &S,
    roles: Roles,
    req: Request<Incoming>,
    peer: SocketAddr,
    local: Option<SocketAddr>,
) -> Response<Full<Bytes>> {
    let read_only = req.method() == Method::GET || req.method() == Method::HEAD;
    let path = req.uri().path();
    if !roles.serves(path) {
        return text(StatusCode::NOT_FOUND, "not found\n".into());
    }
    match (path, read_only) {
        // Liveness: the process answers HTTP, so it is alive. (DNS answering is readiness.)
        ("/health", true) => text(StatusCode::OK, "OK".into()),
        ("/ready", true) => {
            if source.readiness().is_ready() {
                text(StatusCode::OK, "OK".into())
            } else if source.readiness().is_draining() {
                text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n".into())
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n".into())
            }
        }
        ("/metrics", true) => {
            let mut resp = Response::new(Full::new(Bytes::from(source.metrics())));
            resp.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            );
            resp
        }
        ("/log-level", _) => log_level(source, req, peer, local).await,
        _ => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n".into(),
        ),
    }
}

async fn log_level<S: Source>(
    source: &S,
    req: Request<Incoming>,
    peer: SocketAddr,
    local: Option<SocketAddr>,
) -> Response<Full<Bytes>> {
    let Some(log) = source.log() else {
        return text(StatusCode::NOT_FOUND, "not found\n".into());
    };
    match *req.method() {
        Method::GET | Method::HEAD => text(StatusCode::OK, format!("{}\n", log.current())),
        Method::PUT | Method::POST => {
            if let Err(why) = may_change_log_level(peer, local) {
                tracing::debug!(%peer, why, "PUT /log-level refused");
                return text(StatusCode::FORBIDDEN, format!("{why}\n"));
            }
            let body = Limited::new(req.into_body(), MAX_BODY).collect();
            let body = match tokio::time::timeout(TIMEOUT, body).await {
                Ok(Ok(body)) => body.to_bytes(),
                Ok(Err(_)) => {
                    return text(StatusCode::PAYLOAD_TOO_LARGE, "body too large\n".into());
                }
                Err(_) => return text(StatusCode::REQUEST_TIMEOUT, "body too slow\n".into()),
            };
            let Ok(filter) = std::str::from_utf8(&body) else {
                return text(StatusCode::BAD_REQUEST, "the body is not UTF-8\n".into());
            };
            match log.set(filter) {
                Ok(()) => {
                    tracing::warn!(filter = %log.current(), %peer, "log filter changed over HTTP");
                    text(StatusCode::OK, format!("{}\n", log.current()))
                }
                Err(err) => text(StatusCode::BAD_REQUEST, format!("{err}\n")),
            }
        }
        _ => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n".into(),
        ),
    }
}

/// Who may change the log level: a client on loopback whose socket belongs to the agent's own
/// user (by the kernel's socket table). `Err` says why not.
fn may_change_log_level(peer: SocketAddr, local: Option<SocketAddr>) -> Result<(), &'static str> {
    const WHO: &str = "the log level can only be changed from the node itself (loopback), by the user nodedns runs as";
    let (Some(local), true) = (local, peer.ip().to_canonical().is_loopback()) else {
        return Err(WHO);
    };
    let me = nix::unistd::geteuid().as_raw();
    match peer::owner(peer, local) {
        Ok(Some(uid)) if uid == me => Ok(()),
        Ok(_) => Err(WHO),
        Err(err) => {
            tracing::warn!(%err, "cannot look up the owner of an admin client's socket");
            Err("the owner of the client's socket could not be looked up")
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}

/// A stream whose write fails once it has waited `limit` for the client to read (a response
/// the client never reads would otherwise hold the connection forever).
pub(crate) struct Stalls<T> {
    inner: T,
    limit: Duration,
    /// Armed while a write waits; cleared when one goes through.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> Stalls<T> {
    pub(crate) fn new(inner: T, limit: Duration) -> Self {
        Stalls {
            inner,
            limit,
            stalled: None,
        }
    }

    /// After the inner write returned `Pending`: `Pending` still, or the time-out.
    fn poll_stall<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<R>(
        &mut self,
        poll: Poll<io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<R>> {
        match poll {
            Poll::Pending => self.poll_stall(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Stalls<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stalls<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(poll, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(poll, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(poll, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(poll, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_latch_never_returns_after_drain() {
        let r = Readiness::default();
        assert!(!r.is_ready());
        r.set_ready();
        assert!(r.is_ready());
        r.drain();
        assert!(!r.is_ready());
        assert!(r.is_draining());
        r.set_ready();
        assert!(!r.is_ready());
    }

    fn roles(health: bool, ready: bool, metrics: bool) -> Roles {
        Roles {
            health,
            ready,
            metrics,
        }
    }

    #[test]
    fn the_default_metrics_address_depends_on_the_mode_and_yields_to_configuration() {
        let mut config = crate::config::Config::default();
        let all = roles(true, true, true);
        assert_eq!(
            addresses(&config, true).into_iter().collect::<Vec<_>>(),
            [(DEFAULT_METRICS_CLI, all)]
        );
        assert_eq!(
            addresses(&config, false).into_iter().collect::<Vec<_>>(),
            [(DEFAULT_METRICS, all)]
        );
        let metrics: SocketAddr = "0.0.0.0:9353".parse().unwrap();
        config.metrics = Some(metrics);
        assert_eq!(
            addresses(&config, false).into_iter().collect::<Vec<_>>(),
            [(metrics, all)]
        );
    }

    #[test]
    fn each_address_serves_what_it_is_for() {
        // nodelocaldns.yaml's Corefile with `ready`, as the manifests deploy it.
        let health: SocketAddr = "169.254.20.10:8080".parse().unwrap();
        let ready: SocketAddr = "169.254.20.10:8181".parse().unwrap();
        let metrics: SocketAddr = "0.0.0.0:9253".parse().unwrap();
        let config = crate::config::Config {
            health: Some(health),
            ready: Some(ready),
            metrics: Some(metrics),
            ..crate::config::Config::default()
        };
        let got = addresses(&config, false);
        assert_eq!(got[&health], roles(true, false, false));
        assert_eq!(got[&ready], roles(false, true, false));
        assert_eq!(got[&metrics], roles(false, false, true));
        assert!(got[&health].serves("/health"));
        for path in ["/metrics", "/log-level", "/ready", "/", "/health/"] {
            assert!(!got[&health].serves(path), "{path}");
        }
        assert_eq!(got[&metrics].to_string(), "/metrics /log-level");
        // Without `ready` (node-cache's stock Corefile), /ready goes with the metrics.
        let config = crate::config::Config {
            ready: None,
            ..config
        };
        let got = addresses(&config, false);
        assert_eq!(got.len(), 2);
        assert_eq!(got[&metrics], roles(false, true, true));
        // Two roles on one address serve both.
        let config = crate::config::Config {
            ready: Some(health),
            ..config
        };
        assert_eq!(addresses(&config, false)[&health], roles(true, true, false));
    }

    #[test]
    fn every_prometheus_address_serves_the_metrics() {
        // `prometheus :9253` in one block, `prometheus :9254` in another: both serve /metrics,
        // and /ready (no address of its own) goes with the first.
        let first: SocketAddr = "0.0.0.0:9253".parse().unwrap();
        let second: SocketAddr = "0.0.0.0:9254".parse().unwrap();
        let config = crate::config::Config {
            metrics: Some(first),
            extra_metrics: vec![second],
            ..crate::config::Config::default()
        };
        let got = addresses(&config, false);
        assert_eq!(got.len(), 2);
        assert_eq!(got[&first], roles(true, true, true));
        assert_eq!(got[&second], roles(false, false, true));
    }

    #[test]
    fn node_caches_metrics_address_serves_the_metrics_beside_prometheus() {
        // The stock Corefile (`prometheus :9253`, no `ready`) and node-cache's default
        // -metrics-listen-address: both serve /metrics, only the Corefile's gets /ready.
        let prometheus: SocketAddr = "0.0.0.0:9253".parse().unwrap();
        let node_cache: SocketAddr = "0.0.0.0:9353".parse().unwrap();
        let health: SocketAddr = "169.254.20.10:8080".parse().unwrap();
        let config = crate::config::Config {
            health: Some(health),
            metrics: Some(prometheus),
            node_cache_metrics: Some(node_cache),
            ..crate::config::Config::default()
        };
        let got = addresses(&config, false);
        assert_eq!(got.len(), 3);
        assert_eq!(got[&prometheus], roles(false, true, true));
        assert_eq!(got[&node_cache], roles(false, false, true));
        // The same address named twice is one listener.
        let config = crate::config::Config {
            metrics: Some(node_cache),
            ..config
        };
        let got = addresses(&config, false);
        assert_eq!(got.len(), 2);
        assert_eq!(got[&node_cache], roles(false, true, true));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_never_reads_fails_after_the_limit() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, _far) = tokio::io::duplex(64);
        let mut stream = Stalls::new(near, TIMEOUT);
        let started = tokio::time::Instant::now();
        let big = vec![0u8; 4096];
        let err = stream.write_all(&big).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), TIMEOUT);
        // A reader that keeps reading is never cut off, however long the whole takes.
        let (near, mut far2) = tokio::io::duplex(64);
        let mut stream = Stalls::new(near, TIMEOUT);
        let reading = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let mut total = 0;
            while total < 4096 {
                tokio::time::sleep(TIMEOUT / 2).await;
                total += far2.read(&mut buf).await.unwrap();
            }
            total
        });
        stream.write_all(&big).await.unwrap();
        assert!(started.elapsed() > TIMEOUT * 10);
        assert_eq!(reading.await.unwrap(), 4096);
    }
}
