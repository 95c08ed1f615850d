//! The admin HTTP endpoints: `/health` (liveness), `/ready` (readiness), `/metrics` (Prometheus).
//!
//! Every admin listen address serves all three paths, so node-cache's health port, CoreDNS's
//! `ready` port and the `prometheus` port can be the same or different addresses. The listeners
//! use `SO_REUSEPORT` so a second instance on the node (a surge upgrade) can bind beside this one.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;

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
}

/// What the endpoints read.
pub trait Source: Send + Sync + 'static {
    /// The Prometheus text exposition (format 0.0.4).
    fn metrics(&self) -> String;
    fn readiness(&self) -> &Readiness;
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
        let (stream, _) = tokio::select! {
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
                async move { Ok::<_, Infallible>(route(&*source, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            let _ = conn.await;
        });
    }
}

fn route<S: Source>(source: &S, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match req.uri().path() {
        // Liveness: the process answers HTTP, so it is alive. (DNS answering is readiness.)
        "/health" => text(StatusCode::OK, "OK"),
        "/ready" => {
            if source.readiness().is_ready() {
                text(StatusCode::OK, "OK")
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
            }
        }
        "/metrics" => {
            let mut resp = Response::new(Full::new(Bytes::from(source.metrics())));
            resp.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            resp
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
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
        r.set_ready();
        assert!(!r.is_ready());
    }
}
