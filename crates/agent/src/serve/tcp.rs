//! TCP listeners (RFC 7766): one task per client connection.
//!
//! A connection may carry many queries back to back (pipelining); each is answered as soon as it
//! can be, so answers may leave out of order (RFC 7766 §7). The reader and the writer are separate
//! tasks joined by a bounded channel, so a slow upstream answer never holds back a cached one.
//!
//! Bounds, so that no client can hurt another: a cap on open connections, in all and per client
//! address (beyond either, new ones are closed at once), an idle timeout that also covers a client
//! dripping a frame byte by byte, and a cap on queries in flight per connection (the reader stops
//! reading until answers drain).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::Shared;
use super::pipeline::{self, Front, ReplyTo, Waiter};
use crate::metrics::{Client, Proto};

/// Limits for one client connection (the caps on open connections are [`Connections`], shared
/// by every listener).
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

/// The caps on open client connections, shared by every TCP listener: in all, and per client
/// address.
#[derive(Debug)]
pub struct Connections {
    total: Arc<Semaphore>,
    /// 0: no per-client cap.
    per_client: usize,
    /// Open connections per client address. An address is here only while it has a connection
    /// open, and each of those holds a `total` permit, so the map never outgrows the total cap.
    clients: Mutex<HashMap<IpAddr, usize>>,
}

impl Connections {
    pub fn new(total: usize, per_client: usize) -> Self {
        Connections {
            total: Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))),
            per_client,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// A place for one more connection from `client`, or `None` when either cap is reached.
    pub fn admit(self: &Arc<Self>, client: IpAddr) -> Option<Admitted> {
        let total = self.total.clone().try_acquire_owned().ok()?;
        if self.per_client > 0 {
            let mut clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
            let open = clients.entry(client).or_insert(0);
            if *open >= self.per_client {
                return None;
            }
            *open += 1;
        }
        Some(Admitted {
            connections: self.clone(),
            client,
            _total: total,
        })
    }
}

/// One admitted connection's place; given back on drop.
#[derive(Debug)]
pub struct Admitted {
    connections: Arc<Connections>,
    client: IpAddr,
    _total: OwnedSemaphorePermit,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.connections.per_client == 0 {
            return;
        }
        let mut clients = self
            .connections
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = clients.get_mut(&self.client) {
            *open -= 1;
            if *open == 0 {
                clients.remove(&self.client);
            }
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
    connections: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // EMFILE and friends: back off briefly rather than spin.
                tracing::warn!(%local, %err, "TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(admitted) = connections.admit(peer.ip()) else {
            shared.metrics.counters().tcp_refused();
            drop(stream);
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let client = Client {
                proto: Proto::Tcp,
                addr: peer,
            };
            serve_connection(shared, stream, local, client, limits, admitted).await;
        });
    }
}

/// Serves one client connection until it closes, idles out, or sends garbage framing.
async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    local: SocketAddr,
    client: Client,
    limits: Limits,
    _admitted: Admitted,
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

    let counters = shared.metrics.listener(local);
    let runtime = tokio::runtime::Handle::current();
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
        match pipeline::answer(counters, &snap, &query, local, &client, now, &mut out) {
            Front::Answered => {
                if tx.send(out).await.is_err() {
                    break;
                }
                drop(permit);
            }
            Front::AnsweredRefresh(miss) => {
                pipeline::spawn(&shared, &runtime, miss, Waiter::nobody());
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
                    client,
                    started: now,
                    labels: miss.labels,
                };
                pipeline::spawn(&shared, &runtime, miss, waiter);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 244, 1, last])
    }

    #[test]
    fn a_client_gets_at_most_its_share_and_others_still_get_in() {
        let connections = Arc::new(Connections::new(100, 2));
        let first = connections.admit(ip(1)).expect("first");
        let second = connections.admit(ip(1)).expect("second");
        assert!(
            connections.admit(ip(1)).is_none(),
            "a third from the same client"
        );
        let other = connections
            .admit(ip(2))
            .expect("another client is not affected");
        drop((first, second, other));
    }

    #[test]
    fn a_closed_connection_gives_its_place_back_and_idle_clients_are_forgotten() {
        let connections = Arc::new(Connections::new(100, 1));
        let held = connections.admit(ip(1)).unwrap();
        assert!(connections.admit(ip(1)).is_none());
        drop(held);
        let again = connections.admit(ip(1)).expect("the place came back");
        drop(again);
        for last in 0..=255 {
            drop(connections.admit(ip(last)).unwrap());
        }
        assert!(connections.clients.lock().unwrap().is_empty());
        assert_eq!(connections.total.available_permits(), 100);
    }

    #[test]
    fn the_total_cap_holds_whatever_the_clients() {
        let connections = Arc::new(Connections::new(3, 0));
        let held: Vec<_> = (0..3).map(|i| connections.admit(ip(i)).unwrap()).collect();
        assert!(connections.admit(ip(9)).is_none());
        // Without a per-client cap one address may take them all.
        drop(held);
        let same: Vec<_> = (0..3).map(|_| connections.admit(ip(1)).unwrap()).collect();
        assert_eq!(same.len(), 3);
        assert!(connections.clients.lock().unwrap().is_empty());
    }
}
