//! The admin HTTP endpoints:
//!
//! - `/health`: liveness. 200 while the process serves HTTP, draining included (a restart would
//!   not help a draining agent).
//! - `/ready`: readiness. 200 once the listeners are bound, the host rules are in place and every
//!   server block's upstream answered a probe; 503 before, and from the moment shutdown starts,
//!   so Kubernetes and Cilium stop sending new queries while the listeners still answer.
//! - `/metrics`: every metric, Prometheus text format 0.0.4 ([`crate::metrics`]).
//! - `/log-level`: `GET` prints the log filter in force; `PUT` with a filter as the body
//!   (`debug`, `info,nodedns::query=off`) replaces it. Only from loopback clients: the admin
//!   port is often reachable from the whole node network.
//!
//! Every admin listen address serves every path, so node-cache's health port, CoreDNS's `ready`
//! port and the `prometheus` port can be the same or different addresses. The listeners use
//! `SO_REUSEPORT` so a second instance on the node (a surge upgrade) can bind beside this one.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;

use crate::logging;

/// Default `/metrics` address when neither the Corefile (`prometheus`) nor the command line
/// (`-metrics-listen-address`) names one: node-local-dns's `:9253` with a Corefile, loopback only
/// in plain command-line mode (a development run should not open a port to the network).
pub const DEFAULT_METRICS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 9253);
pub const DEFAULT_METRICS_CLI: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9253);

/// Every address the admin endpoints are served on: the configured ones, and the default
/// metrics address when none is configured (`cli_mode`: no Corefile).
pub fn addresses(
    config: &crate::config::Config,
    cli_mode: bool,
) -> std::collections::BTreeSet<SocketAddr> {
    let metrics = config.metrics.unwrap_or(if cli_mode {
        DEFAULT_METRICS_CLI
    } else {
        DEFAULT_METRICS
    });
    [config.health, config.ready, Some(metrics)]
        .into_iter()
        .flatten()
        .collect()
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
}

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

/// Serves the endpoints on `listener` until `stop` turns true.
pub async fn serve<S: Source>(
    listener: tokio::net::TcpListener,
    source: Arc<S>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(%err, "admin accept failed");
                    continue;
                }
            },
            _ = stop.wait_for(|stop| *stop) => return,
        };
        let source = source.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let source = source.clone();
                async move { Ok::<_, Infallible>(route(&*source, req, peer).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            let _ = conn.await;
        });
    }
}

/// Largest `PUT /log-level` body read.
const MAX_BODY: usize = 4096;

async fn route<S: Source>(
    source: &S,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let read_only = req.method() == Method::GET || req.method() == Method::HEAD;
    match (req.uri().path(), read_only) {
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
        ("/log-level", _) => log_level(source, req, peer).await,
        ("/health" | "/ready" | "/metrics", false) => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n".into(),
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

async fn log_level<S: Source>(
    source: &S,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let Some(log) = source.log() else {
        return text(StatusCode::NOT_FOUND, "not found\n".into());
    };
    match *req.method() {
        Method::GET | Method::HEAD => text(StatusCode::OK, format!("{}\n", log.current())),
        Method::PUT | Method::POST => {
            if !peer.ip().is_loopback() {
                return text(
                    StatusCode::FORBIDDEN,
                    "the log level can only be changed from the node itself (loopback)\n".into(),
                );
            }
            let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(body) => body.to_bytes(),
                Err(_) => return text(StatusCode::PAYLOAD_TOO_LARGE, "body too large\n".into()),
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

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
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

    #[test]
    fn the_default_metrics_address_depends_on_the_mode_and_yields_to_configuration() {
        let mut config = crate::config::Config::default();
        assert_eq!(
            addresses(&config, true).into_iter().collect::<Vec<_>>(),
            [DEFAULT_METRICS_CLI]
        );
        assert_eq!(
            addresses(&config, false).into_iter().collect::<Vec<_>>(),
            [DEFAULT_METRICS]
        );
        let health: SocketAddr = "169.254.20.10:8080".parse().unwrap();
        let metrics: SocketAddr = "0.0.0.0:9353".parse().unwrap();
        config.health = Some(health);
        config.metrics = Some(metrics);
        assert_eq!(
            addresses(&config, false).into_iter().collect::<Vec<_>>(),
            [metrics, health]
        );
    }
}
