//! TCP listeners (RFC 7766): one task per client connection.
//!
//! A connection may carry many queries back to back (pipelining); each is answered as soon as it
//! can be, so answers may leave out of order (RFC 7766 §7). The reader and the writer are separate
//! tasks joined by a bounded channel, so a slow upstream answer never holds back a cached one.
//!
//! Bounds, so that no client can hurt another: a cap on open connections (beyond it new ones are
//! closed at once), an idle timeout that also covers a client dripping a frame byte by byte, and a
//! cap on queries in flight per connection (the reader stops reading until answers drain).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::Shared;
use super::pipeline::{self, Front, ReplyTo, Waiter};
use crate::metrics::Proto;

/// Limits for one client connection (the cap on open connections is a semaphore shared by
/// every listener, given to [`run`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A connection with no complete query for this long is closed (RFC 7766 §6.2.3).
    pub idle_timeout: Duration,
    /// Queries in flight on one connection at most.
    pub max_in_flight: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            idle_timeout: Duration::from_secs(10),
            max_in_flight: 128,
        }
    }
}

/// Binds a listening socket in `addr`'s `SO_REUSEPORT` group (`IP_FREEBIND`, as for UDP).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_port(true)?;
    socket.set_reuse_address(true)?;
    match addr {
        SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
        SocketAddr::V6(_) => {
            socket.set_only_v6(true)?;
            socket.set_freebind_v6(true)?;
        }
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Accepts connections on `listener` until `stop` turns true.
pub async fn run(
    shared: Arc<Shared>,
    listener: TcpListener,
    local: SocketAddr,
    limits: Limits,
    connections: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => return,
        };
        let (stream, _peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // EMFILE and friends: back off briefly rather than spin.
                tracing::warn!(%local, %err, "TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            shared.metrics.counters().tcp_refused();
            drop(stream);
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            serve_connection(shared, stream, local, limits, permit).await;
        });
    }
}

/// Serves one client connection until it closes, idles out, or sends garbage framing.
async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    local: SocketAddr,
    limits: Limits,
    _permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(limits.max_in_flight);
    let in_flight = Arc::new(Semaphore::new(limits.max_in_flight));

    let writing = tokio::spawn(async move {
        let mut frame = Vec::with_capacity(1024);
        while let Some(answer) = rx.recv().await {
            frame.clear();
            frame.extend_from_slice(&(answer.len() as u16).to_be_bytes());
            frame.extend_from_slice(&answer);
            if writer.write_all(&frame).await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    });

    let counters = shared.metrics.counters();
    let mut query = Vec::with_capacity(512);
    loop {
        // One permit per query in flight: when the client has too many queries pending, stop
        // reading until answers drain.
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            break;
        };
        match tokio::time::timeout(limits.idle_timeout, read_frame(&mut reader, &mut query)).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) | Ok(Err(_)) | Err(_) => break,
        }
        let now = Instant::now();
        let snap = shared.snapshot.load();
        let mut out = Vec::with_capacity(512);
        match pipeline::answer(counters, &snap, &query, local, Proto::Tcp, now, &mut out) {
            Front::Answered => {
                if tx.send(out).await.is_err() {
                    break;
                }
                drop(permit);
            }
            Front::AnsweredRefresh(miss) => {
                tokio::spawn(pipeline::resolve(shared.clone(), miss, Waiter::nobody()));
                if tx.send(out).await.is_err() {
                    break;
                }
                drop(permit);
            }
            Front::Dropped => {
                // Not a query (or no header): a client speaking garbage on TCP gets closed.
                break;
            }
            Front::Miss(miss) => {
                let waiter = Waiter {
                    query: query.as_slice().into(),
                    reply_to: ReplyTo::Tcp(tx.clone(), permit),
                    proto: Proto::Tcp,
                    started: now,
                };
                tokio::spawn(pipeline::resolve(shared.clone(), miss, waiter));
            }
        }
    }
    // Answers still in flight are written before the connection closes (RFC 7766 §6.2.4):
    // the writer ends once every waiter has dropped its sender.
    drop(tx);
    let _ = writing.await;
}

/// Reads one length-prefixed message into `buf`. `Ok(false)` on a clean EOF between messages.
async fn read_frame(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    buf: &mut Vec<u8>,
) -> io::Result<bool> {
    let mut len = [0u8; 2];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(err) => return Err(err),
    }
    let len = u16::from_be_bytes(len) as usize;
    buf.clear();
    buf.resize(len, 0);
    reader.read_exact(buf).await?;
    Ok(true)
}
