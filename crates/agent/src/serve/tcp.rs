//! TCP listeners (RFC 7766): one task per client connection. A DNS-over-TLS listener (RFC 7858)
//! is one with a TLS handshake in front (within the idle timeout, after the connection is
//! admitted); the connection is then served as any other, over the TLS stream ([`Stream`]).
//!
//! A connection may carry many queries back to back (pipelining); each is answered as soon as it
//! can be, so answers may leave out of order (RFC 7766 §7). The reader and the writer are separate
//! tasks joined by a bounded queue, so a slow upstream answer never holds back a cached one.
//!
//! Bounds, so that no client can hurt another (docs/reliability.md lists them with what
//! exceeding each gets):
//! - open connections, in all and per client address ([`Connections`]): beyond either, a new one
//!   is closed at once;
//! - an idle timeout, which also covers a client dripping a frame byte by byte;
//! - queries in flight per connection: the reader stops reading until answers drain;
//! - a query frame longer than [`MAX_QUERY`] closes the connection, so a read buffer never
//!   grows past it;
//! - bytes of answers queued, per connection ([`Limits::max_queued_bytes`]) and in all
//!   ([`Connections`]): room for the largest answer is taken before a cached answer is written,
//!   so no answer is ever held outside the budgets, and the reader waits for it (a client that
//!   does not read stops being read); an upstream answer that finds no room closes its
//!   connection (the client retries unanswered queries on a new one, RFC 7766 §6.2.4);
//! - a write that makes no progress for [`Limits::write_timeout`] (a client that does not read)
//!   aborts the connection (RST, so the kernel drops what it still held for it too);
//! - small kernel buffers per connection ([`SEND_BUFFER`], [`RECEIVE_BUFFER`]): what the kernel
//!   holds for a client that does not read is charged to the agent's memory too.
//!
//! Frames are cut by `nodedns_wire::frame` (as the upstream pool's replies are): one buffer per
//! connection, so a read brings as many pipelined queries as have arrived, and a frame shorter
//! than a DNS header closes the connection (RFC 7766 §8).

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nodedns_wire::frame;
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::Shared;
use super::pipeline::{self, Front, Recorder, ReplyTo, TCP_LIMIT};
use super::request::{Client, MAX_QUERY, Proto};
use crate::accept;

/// Bytes of one answer in its frame: the message and its 2-byte length.
const LARGEST_ANSWER: usize = TCP_LIMIT + 2;

/// Bytes of answers queued for all connections at most, and for one connection (the default of
/// [`Limits::max_queued_bytes`]): room for two of the largest answers (a client that reads keeps
/// its queue near empty; one that does not finds the bound).
pub const MAX_QUEUED_TOTAL: usize = 16 << 20;
pub const MAX_QUEUED_PER_CONNECTION: usize = 2 * LARGEST_ANSWER;

/// Kernel buffers asked for each client connection (the kernel doubles them for bookkeeping):
/// plenty for a client on the node (a 32 KiB window at a loopback or veth round trip is hundreds
/// of MB/s), and small enough that a thousand clients that neither read nor stop sending hold
/// tens of MiB in the kernel, not gigabytes (autotuning grows each to several MiB).
pub const SEND_BUFFER: usize = 16 << 10;
pub const RECEIVE_BUFFER: usize = 8 << 10;

/// Limits for one client connection (the caps on open connections and the total of queued
/// answers are [`Connections`], shared by every listener).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A connection with no complete query for this long is closed (RFC 7766 §6.2.3).
    pub idle_timeout: Duration,
    /// A write that makes no progress for this long (the client does not read) aborts the
    /// connection (CoreDNS's write timeout on its TCP servers is 5 s).
    pub write_timeout: Duration,
    /// Queries in flight on one connection at most.
    pub max_in_flight: usize,
    /// Bytes of answers queued on one connection at most (at least [`LARGEST_ANSWER`]).
    pub max_queued_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            idle_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(5),
            max_in_flight: 128,
            max_queued_bytes: MAX_QUEUED_PER_CONNECTION,
        }
    }
}

/// What the TCP listeners refuse, beyond the connection caps (those are
/// `nodedns_tcp_refused_connections_total`, on the request path's counters).
pub type Metrics = accept::Refusals;

/// The names of the TCP listeners' [`Metrics`].
pub const NAMES: accept::Names = accept::Names {
    accept_errors: "nodedns_tcp_accept_errors",
    accept_errors_help: "Failed accepts on the DNS TCP listeners (EMFILE and the like), each followed by a back-off",
    closed: "nodedns_tcp_connections_closed",
    closed_help: "Client TCP connections closed by nodedns, by reason: write_timeout (a write made no progress: the client does not read), queue_full (an upstream answer found no room in the connection's or the agent's queued answers)",
};

/// The caps on open client connections, shared by every TCP listener: in all, and per client
/// address; and the bytes of answers queued for all of them.
#[derive(Debug)]
pub struct Connections {
    total: Arc<Semaphore>,
    /// 0: no per-client cap.
    per_client: usize,
    /// Open connections per client address. An address is here only while it has a connection
    /// open, and each of those holds a `total` permit, so the map never outgrows the total cap.
    clients: Mutex<HashMap<IpAddr, usize>>,
    /// One permit per byte of answers queued by any connection.
    queued: Arc<Semaphore>,
    metrics: Metrics,
}

impl Connections {
    pub fn new(total: usize, per_client: usize) -> Self {
        Connections {
            total: Arc::new(Semaphore::new(total.min(Semaphore::MAX_PERMITS))),
            per_client,
            clients: Mutex::new(HashMap::new()),
            queued: Arc::new(Semaphore::new(MAX_QUEUED_TOTAL)),
            metrics: Metrics::default(),
        }
    }

    /// What the listeners count.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
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

/// One answer in a connection's queue, with its bytes' places in both budgets (given back once
/// it is written).
#[derive(Debug)]
struct Queued {
    answer: Vec<u8>,
    _room: Room,
}

/// Places in a connection's budget and in the agent's, as many as an answer's frame takes.
#[derive(Debug)]
struct Room {
    own: OwnedSemaphorePermit,
    total: OwnedSemaphorePermit,
}

impl Room {
    /// Gives back what an answer of `len` bytes does not need.
    fn shrink_to(&mut self, len: usize) {
        let need = u32::try_from(len + 2).unwrap_or(u32::MAX);
        for permit in [&mut self.own, &mut self.total] {
            let held = u32::try_from(permit.num_permits()).unwrap_or(u32::MAX);
            if held > need {
                drop(permit.split((held - need) as usize));
            }
        }
    }
}

/// What one connection's reader, writer and waiting misses share: the writer's queue and the
/// budgets of its bytes.
#[derive(Debug)]
struct Queue {
    tx: mpsc::Sender<Queued>,
    own: Arc<Semaphore>,
    total: Arc<Semaphore>,
    /// Set when the connection must end now (an answer found no room, or the writer stalled):
    /// the reader stops, the writer aborts the connection.
    abort: watch::Sender<bool>,
    metrics: Metrics,
}

impl Queue {
    /// Room for the largest answer, waiting for it (in the connection's budget, then the
    /// agent's). `None` once the connection is ending.
    async fn reserve(&self) -> Option<Room> {
        let own = self.own.clone().acquire_many_owned(LARGEST_ANSWER as u32);
        let own = own.await.ok()?;
        let total = self.total.clone().acquire_many_owned(LARGEST_ANSWER as u32);
        let total = total.await.ok()?;
        Some(Room { own, total })
    }

    /// Room for `len` bytes now, or `None`.
    fn try_reserve(&self, len: usize) -> Option<Room> {
        let n = u32::try_from(len + 2).ok()?;
        let own = self.own.clone().try_acquire_many_owned(n).ok()?;
        let total = self.total.clone().try_acquire_many_owned(n).ok()?;
        Some(Room { own, total })
    }

    /// Ends the connection because of `reason` (counted once per connection).
    fn abort(&self, reason: &'static str) {
        if !self.abort.send_replace(true) {
            self.metrics.closed(reason);
        }
    }

    /// Ends the connection: the client is gone.
    fn end(&self) {
        self.abort.send_replace(true);
    }
}

/// Where a waiting miss's answer goes: its connection's queue, and the in-flight slot the query
/// holds until its answer is queued.
#[derive(Debug)]
pub struct Answers {
    queue: Arc<Queue>,
    _slot: OwnedSemaphorePermit,
}

impl Answers {
    /// Queues an upstream answer without waiting. When there is no room for it (the client does
    /// not read, or every connection's queue together is full), the connection is closed (the
    /// client asks again on a new one) and the answer is dropped: `false`, as when the
    /// connection is gone.
    pub fn send(self, answer: Vec<u8>) -> bool {
        if *self.queue.abort.borrow() {
            return false;
        }
        let Some(room) = self.queue.try_reserve(answer.len()) else {
            self.queue.abort("queue_full");
            return false;
        };
        let queued = Queued {
            answer,
            _room: room,
        };
        match self.queue.tx.try_send(queued) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.queue.abort("queue_full");
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
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
    socket
        .bind(&addr.into())
        .map_err(|e| super::sibling::in_use(addr, e))?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// Accepts connections on `listener` until `stop` turns true. With `tls`, each connection is
/// DNS over TLS (RFC 7858): the handshake comes first, within the idle timeout, and counts
/// against the same caps as any connection.
pub async fn run(
    shared: Arc<Shared>,
    listener: TcpListener,
    local: SocketAddr,
    limits: Limits,
    connections: Arc<Connections>,
    stop: watch::Receiver<bool>,
    tls: Option<Arc<rustls::ServerConfig>>,
) {
    let each = |stream: TcpStream, peer: SocketAddr, admitted| {
        let tls = current_tls(&shared, local, tls.as_ref());
        let shared = shared.clone();
        let budgets = (connections.queued.clone(), connections.metrics.clone());
        tokio::spawn(async move {
            let client = Client {
                proto: Proto::Tcp,
                addr: peer,
            };
            tune(&stream);
            let Some(tls) = tls else {
                serve_connection(shared, stream, local, client, limits, budgets, admitted).await;
                return;
            };
            if let Some(stream) = handshake(stream, tls, limits.idle_timeout, peer).await {
                serve_connection(shared, stream, local, client, limits, budgets, admitted).await;
            }
        });
    };
    accept_each(
        "DNS TCP",
        &shared,
        &listener,
        local,
        &connections,
        stop,
        each,
    )
    .await;
}

/// The accept loop of every TCP-based listener (DNS over TCP and TLS, DNS over HTTPS): accepts
/// on `listener` until `stop` turns true, backing off after accept errors, and hands each
/// connection `connections` admits to `each`. A connection beyond the caps is counted and
/// closed.
pub(crate) async fn accept_each(
    what: &'static str,
    shared: &Shared,
    listener: &TcpListener,
    local: SocketAddr,
    connections: &Arc<Connections>,
    mut stop: watch::Receiver<bool>,
    mut each: impl FnMut(TcpStream, SocketAddr, Admitted),
) {
    let mut backoff = accept::Backoff::new(what, "nodedns_tcp_accept_errors_total");
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
                connections.metrics.accept_errors.inc();
                let delay = backoff.failed(&err, Some(local));
                tokio::select! {
                    () = tokio::time::sleep(delay) => continue,
                    _ = stop.wait_for(|stop| *stop) => return,
                }
            }
        };
        let Some(admitted) = connections.admit(peer.ip()) else {
            shared.metrics.counters().tcp_refused();
            drop(stream);
            continue;
        };
        each(stream, peer, admitted);
    }
}

/// The certificate a new connection on `local` is served with: the current configuration's (a
/// reload may have rotated it), else `first`, the listener's own; `None` without TLS.
pub(crate) fn current_tls(
    shared: &Shared,
    local: SocketAddr,
    first: Option<&Arc<rustls::ServerConfig>>,
) -> Option<Arc<rustls::ServerConfig>> {
    first.map(|first| {
        shared
            .snapshot
            .load()
            .tls(local)
            .unwrap_or_else(|| first.clone())
    })
}

/// The server side of a TLS handshake on `stream`, within `timeout`; `None` (logged at debug)
/// when it fails or times out.
pub(crate) async fn handshake(
    stream: TcpStream,
    tls: Arc<rustls::ServerConfig>,
    timeout: Duration,
    peer: SocketAddr,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(err)) => {
            tracing::debug!(%peer, %err, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

/// Small kernel buffers and no Nagle for a client connection.
pub(crate) fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let socket = SockRef::from(stream);
    let _ = socket.set_send_buffer_size(SEND_BUFFER);
    let _ = socket.set_recv_buffer_size(RECEIVE_BUFFER);
}

/// A client connection: plain TCP, or TLS over it. Its halves are read and written by separate
/// tasks; a connection that must end at once is reset (RST), so the kernel drops what it still
/// holds for the client.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    type Reader: AsyncRead + Send + Unpin + 'static;
    type Writer: AsyncWrite + Send + Unpin + 'static;
    fn split(self) -> (Self::Reader, Self::Writer);
    /// Closes the connection with a reset.
    fn reset(reader: Self::Reader, writer: Self::Writer);
}

/// Sets `SO_LINGER` 0: closing the socket then sends RST and frees what the kernel held.
fn linger_zero(stream: &TcpStream) {
    let _ = SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

impl Stream for TcpStream {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;

    fn split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }

    fn reset(reader: OwnedReadHalf, writer: OwnedWriteHalf) {
        if let Ok(stream) = reader.reunite(writer) {
            linger_zero(&stream);
        }
    }
}

impl Stream for tokio_rustls::server::TlsStream<TcpStream> {
    type Reader = ReadHalf<Self>;
    type Writer = WriteHalf<Self>;

    fn split(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }

    fn reset(reader: Self::Reader, writer: Self::Writer) {
        let stream = reader.unsplit(writer);
        linger_zero(stream.get_ref().0);
    }
}

/// Serves one client connection until it closes, idles out, sends garbage framing, or does not
/// read its answers.
async fn serve_connection<S: Stream>(
    shared: Arc<Shared>,
    stream: S,
    local: SocketAddr,
    client: Client,
    limits: Limits,
    (total, metrics): (Arc<Semaphore>, Metrics),
    _admitted: Admitted,
) {
    let (mut reader, writer) = stream.split();
    let (tx, rx) = mpsc::channel::<Queued>(limits.max_in_flight);
    let (abort, aborted) = watch::channel(false);
    let queue = Arc::new(Queue {
        tx,
        own: Arc::new(Semaphore::new(limits.max_queued_bytes.max(LARGEST_ANSWER))),
        total,
        abort,
        metrics,
    });
    let in_flight = Arc::new(Semaphore::new(limits.max_in_flight));
    let writing = tokio::spawn(write_answers(
        writer,
        rx,
        limits.write_timeout,
        Arc::downgrade(&queue),
        aborted.clone(),
    ));

    let to = Recorder {
        counters: shared.metrics.listener(local),
        clients: shared.clients.shared(),
        log: &shared.querylog,
    };
    let runtime = tokio::runtime::Handle::current();
    let mut frames = frame::Buffer::new(512);
    let mut ending = aborted;
    loop {
        // One permit per query in flight: when the client has too many queries pending, stop
        // reading until answers drain.
        let slot = tokio::select! {
            slot = in_flight.clone().acquire_owned() => slot,
            _ = ending.wait_for(|abort| *abort) => break,
        };
        let Ok(slot) = slot else { break };
        let next = tokio::select! {
            next = tokio::time::timeout(limits.idle_timeout, read_frame(&mut reader, &mut frames)) => next,
            _ = ending.wait_for(|abort| *abort) => break,
        };
        let query = match next {
            Ok(Ok(Next::Frame)) => match frames.take() {
                Some(query) => query,
                None => break,
            },
            Ok(Ok(Next::Malformed)) => {
                // Too short for a header (nothing to answer to, as a datagram that short), or
                // longer than any query.
                to.counters.malformed();
                break;
            }
            Ok(Ok(Next::End)) | Ok(Err(_)) | Err(_) => break,
        };
        // Room for the largest answer before writing one, so that no answer waits outside the
        // budgets: a client that does not read stops being read here.
        let room = tokio::select! {
            room = queue.reserve() => room,
            _ = ending.wait_for(|abort| *abort) => None,
        };
        let Some(mut room) = room else { break };
        let now = Instant::now();
        let snap = shared.snapshot.load();
        let mut out = Vec::with_capacity(512);
        match pipeline::answer(&to, &snap, query, local, &client, now, &mut out) {
            Front::Answered => {
                room.shrink_to(out.len());
                if !queue_answer(&queue, out, room, &mut ending).await {
                    break;
                }
                drop(slot);
            }
            Front::AnsweredRefresh(refresh) => {
                pipeline::refresh(&shared, &runtime, refresh);
                room.shrink_to(out.len());
                if !queue_answer(&queue, out, room, &mut ending).await {
                    break;
                }
                drop(slot);
            }
            Front::Dropped => {
                // Not a query (or no header): a client speaking garbage on TCP gets closed.
                break;
            }
            Front::Miss(mut miss) => {
                drop(room);
                let answers = Answers {
                    queue: queue.clone(),
                    _slot: slot,
                };
                let waiter = miss.waiter(query, ReplyTo::Tcp(answers), client, now);
                pipeline::spawn(&shared, &runtime, miss, waiter);
            }
        }
    }
    // Answers still in flight are written before the connection closes (RFC 7766 §6.2.4):
    // the writer ends once every waiter has dropped its handle on the queue (or at once when the
    // connection is aborted).
    drop(queue);
    if let Ok(Some(writer)) = writing.await {
        S::reset(reader, writer);
    }
}

/// Queues a cached answer with its room; `false` once the connection is ending.
async fn queue_answer(
    queue: &Queue,
    answer: Vec<u8>,
    room: Room,
    ending: &mut watch::Receiver<bool>,
) -> bool {
    let queued = Queued {
        answer,
        _room: room,
    };
    tokio::select! {
        sent = queue.tx.send(queued) => sent.is_ok(),
        _ = ending.wait_for(|abort| *abort) => false,
    }
}

/// Writes queued answers until the queue ends (then closes the connection cleanly), or until the
/// connection must end at once: the client stopped reading for `write_timeout`, or an answer
/// found no room. Then it returns the writer, for the connection to be reset
/// ([`Stream::reset`]): nothing more is sent, and the kernel drops what it still holds.
async fn write_answers<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Queued>,
    write_timeout: Duration,
    // Weak: the queue ends (and with it this loop) when the reader and every waiting miss have
    // let go of it.
    queue: std::sync::Weak<Queue>,
    mut aborted: watch::Receiver<bool>,
) -> Option<W> {
    loop {
        let next = tokio::select! {
            next = rx.recv() => next,
            _ = aborted.wait_for(|abort| *abort) => break,
        };
        let Some(queued) = next else {
            let _ = tokio::time::timeout(write_timeout, writer.shutdown()).await;
            return None;
        };
        let written = tokio::select! {
            written = write_frame(&mut writer, &queued.answer, write_timeout) => written,
            _ = aborted.wait_for(|abort| *abort) => break,
        };
        match written {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::TimedOut => {
                if let Some(queue) = queue.upgrade() {
                    queue.abort("write_timeout");
                }
                break;
            }
            // The client went away: the reader stops too.
            Err(_) => {
                if let Some(queue) = queue.upgrade() {
                    queue.end();
                }
                return None;
            }
        }
    }
    rx.close();
    Some(writer)
}

/// Writes `answer` with its length prefix, and flushes it (TLS holds records until then). Each
/// write must make progress within `timeout`.
async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    answer: &[u8],
    timeout: Duration,
) -> io::Result<()> {
    let prefix = u16::try_from(answer.len())
        .unwrap_or(u16::MAX)
        .to_be_bytes();
    let total = prefix.len() + answer.len();
    let mut done = 0;
    while done < total {
        let parts = if done < prefix.len() {
            [IoSlice::new(&prefix[done..]), IoSlice::new(answer)]
        } else {
            [
                IoSlice::new(&answer[done - prefix.len()..]),
                IoSlice::new(&[]),
            ]
        };
        match tokio::time::timeout(timeout, writer.write_vectored(&parts)).await {
            Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(Ok(n)) => done += n,
            Ok(Err(err)) => return Err(err),
            Err(_) => return Err(io::ErrorKind::TimedOut.into()),
        }
    }
    match tokio::time::timeout(timeout, writer.flush()).await {
        Ok(flushed) => flushed,
        Err(_) => Err(io::ErrorKind::TimedOut.into()),
    }
}

/// What [`read_frame`] found.
enum Next {
    /// A whole frame is buffered: [`frame::Buffer::take`] returns it.
    Frame,
    /// The client closed the connection between frames.
    End,
    /// A frame too short to hold a DNS header, or longer than [`MAX_QUERY`].
    Malformed,
}

/// Reads until `frames` holds a whole frame (at once if it already does). A connection that ends
/// inside a frame is an error.
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    frames: &mut frame::Buffer,
) -> io::Result<Next> {
    loop {
        if frames.next_len().is_some_and(|len| len > MAX_QUERY) {
            return Ok(Next::Malformed);
        }
        match frames.ready() {
            Ok(true) => return Ok(Next::Frame),
            Err(_) => return Ok(Next::Malformed),
            Ok(false) => {}
        }
        match reader.read(frames.spare()).await? {
            0 if frames.is_empty() => return Ok(Next::End),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => frames.filled(n),
        }
    }
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

    /// A connection's queue with `own` bytes of budget, in an agent with `total`.
    fn queue(own: usize, total: usize) -> (Arc<Queue>, mpsc::Receiver<Queued>) {
        let (tx, rx) = mpsc::channel(8);
        let queue = Queue {
            tx,
            own: Arc::new(Semaphore::new(own)),
            total: Arc::new(Semaphore::new(total)),
            abort: watch::channel(false).0,
            metrics: Metrics::default(),
        };
        (Arc::new(queue), rx)
    }

    fn answers(queue: &Arc<Queue>) -> Answers {
        Answers {
            queue: queue.clone(),
            _slot: Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap(),
        }
    }

    fn closed(queue: &Queue, reason: &'static str) -> u64 {
        queue.metrics.closed_count(reason)
    }

    #[tokio::test]
    async fn room_for_the_largest_answer_shrinks_to_the_answer_written() {
        let (queue, _rx) = queue(2 * LARGEST_ANSWER, MAX_QUEUED_TOTAL);
        let mut room = queue.reserve().await.unwrap();
        assert_eq!(queue.own.available_permits(), LARGEST_ANSWER);
        room.shrink_to(100);
        assert_eq!(queue.own.available_permits(), 2 * LARGEST_ANSWER - 102);
        assert_eq!(queue.total.available_permits(), MAX_QUEUED_TOTAL - 102);
        drop(room);
        assert_eq!(queue.own.available_permits(), 2 * LARGEST_ANSWER);
    }

    #[test]
    fn an_upstream_answer_that_finds_no_room_ends_the_connection_counted_once() {
        let (queue, mut rx) = queue(LARGEST_ANSWER, MAX_QUEUED_TOTAL);
        assert!(answers(&queue).send(vec![0; 40_000]), "room for the first");
        assert!(!*queue.abort.borrow());
        assert!(
            !answers(&queue).send(vec![0; 40_000]),
            "none for the second"
        );
        assert!(*queue.abort.borrow(), "the connection ends");
        assert!(!answers(&queue).send(vec![0; 10]));
        assert_eq!(closed(&queue, "queue_full"), 1);
        // Written, the first answer gives its room back.
        drop(rx.try_recv().unwrap());
        assert_eq!(queue.own.available_permits(), LARGEST_ANSWER);
    }

    #[test]
    fn the_agents_budget_binds_every_connection() {
        let total = Arc::new(Semaphore::new(50_000));
        let (a, _rx_a) = queue(LARGEST_ANSWER, 0);
        let (b, _rx_b) = queue(LARGEST_ANSWER, 0);
        let share = |q: Arc<Queue>| {
            Arc::new(Queue {
                tx: q.tx.clone(),
                own: q.own.clone(),
                total: total.clone(),
                abort: watch::channel(false).0,
                metrics: Metrics::default(),
            })
        };
        let (a, b) = (share(a), share(b));
        assert!(answers(&a).send(vec![0; 30_000]));
        assert!(
            !answers(&b).send(vec![0; 30_000]),
            "the agent's budget is spent"
        );
        assert_eq!(closed(&b, "queue_full"), 1);
        assert_eq!(closed(&a, "queue_full"), 0);
    }

    /// The pipeline's state for one block on `listen` that forwards nowhere (every query is
    /// answered at once: SERVFAIL at the end of the chain).
    fn serving(listen: SocketAddr) -> Arc<Shared> {
        let config = crate::config::Config {
            servers: vec![crate::config::Server {
                zones: vec![".".to_owned()],
                listen: vec![listen],
                cache: None,
                forwards: Vec::new(),
                log: Vec::new(),
                errors: false,
                loop_check: false,
                dnstap: Vec::new(),
                chain: Default::default(),
                scheme: crate::config::Scheme::Tls,
                tls: None,
            }],
            ..Default::default()
        };
        let metrics = Arc::new(crate::metrics::Metrics::new(&[listen], true));
        let upstream_metrics = nodedns_upstream::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        );
        let snapshot = super::super::Snapshot::build(
            Arc::new(config),
            None,
            &upstream_metrics,
            &Default::default(),
            &metrics,
            &Default::default(),
        )
        .unwrap();
        Arc::new(Shared::new(
            snapshot,
            metrics,
            Default::default(),
            Default::default(),
        ))
    }

    /// A self-signed certificate for `dns.test`: the server's configuration, and a client's
    /// that trusts it.
    fn tls_pair() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["dns.test".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    }

    /// A query for `name.` A with `id`, framed.
    fn framed_query(id: u16) -> Vec<u8> {
        let mut q = vec![0, 0, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        q[..2].copy_from_slice(&id.to_be_bytes());
        q.extend_from_slice(b"\x04name\x00\x00\x01\x00\x01");
        let mut framed = u16::try_from(q.len()).unwrap().to_be_bytes().to_vec();
        framed.extend(q);
        framed
    }

    #[tokio::test]
    async fn a_tls_client_is_answered_and_one_that_does_not_read_is_cut_off() {
        let (server, client) = tls_pair();
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let local = listener.local_addr().unwrap();
        let shared = serving(local);
        let connections = Arc::new(Connections::new(16, 0));
        let limits = Limits {
            write_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let (_stop, stopped) = watch::channel(false);
        tokio::spawn(run(
            shared,
            listener,
            local,
            limits,
            connections.clone(),
            stopped,
            Some(server),
        ));
        let connector = tokio_rustls::TlsConnector::from(client);
        let name = rustls::pki_types::ServerName::try_from("dns.test").unwrap();

        // A client that reads gets its answer over TLS.
        let tcp = TcpStream::connect(local).await.unwrap();
        let mut tls = connector.connect(name.clone(), tcp).await.unwrap();
        tls.write_all(&framed_query(7)).await.unwrap();
        let mut len = [0u8; 2];
        tls.read_exact(&mut len).await.unwrap();
        let mut answer = vec![0; usize::from(u16::from_be_bytes(len))];
        tls.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer[..2], &7u16.to_be_bytes(), "its ID");
        assert_eq!(answer[2] & 0x80, 0x80, "a response");
        drop(tls);

        // One that only writes fills its buffers: the stalled write ends the connection, and the
        // client's writes fail.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let tcp = socket.connect(local).await.unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        let queries: Vec<u8> = (0..512u16).flat_map(framed_query).collect();
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Err(err) = tls.write_all(&queries).await {
                    return err;
                }
            }
        })
        .await
        .expect("the connection ends");
        assert!(
            matches!(
                ended.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            "{ended}"
        );
        assert_eq!(connections.metrics().closed_count("write_timeout"), 1);
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
