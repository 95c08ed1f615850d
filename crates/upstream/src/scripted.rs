//! A scripted upstream for the tests: replies built with hickory-proto, and the faults a real
//! server does not produce on demand. Every counter change wakes [`Upstream::until`], so tests
//! await events instead of sleeping.
//!
//! Each upstream serves UDP and TCP on one loopback port, and TCP in memory too: [`Memory`]
//! dials it over a `tokio::io::duplex` pipe, so a group built with it runs entirely inside the
//! runtime and its tests can pause tokio's clock (deadlines, expiry and health checks then take
//! exactly the virtual time they should, however busy the machine). An upstream started with
//! [`Upstream::start_tls`] speaks DNS over TLS on its TCP side, in memory too. [`Dnat`] is
//! kube-proxy in memory: a Service address whose every new connection lands on one of several
//! upstreams, and [`Upstream::kill`] is the node of one of them dying (no FIN, no RST: silence).

use std::collections::HashMap;
use std::collections::VecDeque;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use hickory_proto::op::{Message, OpCode, Query};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::dial::Dial;

/// CoreDNS closes a TCP connection after this long without a query; so does the scripted
/// upstream.
pub(crate) const SERVER_IDLE: Duration = Duration::from_secs(10);

/// Room in each direction of an in-memory connection: a whole frame.
const PIPE: usize = 1 << 17;

/// What the upstream does with each query it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Answer: `<qname> 30 IN A 192.0.2.<tag>`, the question echoed.
    Answer,
    /// Answer only once a permit is released ([`Upstream::release`]).
    Hold,
    /// Read the query, never answer.
    Silent,
    /// TCP: read the query, then reset the connection (RST; in memory, close it) without
    /// answering.
    Reset,
    /// TCP: as `Reset` for the next `n` queries, then as `Answer`.
    ResetFirst(usize),
    /// TCP: answer `n` queries on a connection, then close it (the server closing an idle
    /// connection, as CoreDNS after 10 s).
    CloseAfter(usize),
    /// TCP: answer `n` queries on a connection, then close it on reading the next one, without
    /// answering (a query in flight meets EOF).
    DropAfter(usize),
    /// Answer with the ID flipped.
    WrongId,
    /// Answer another question.
    WrongQuestion,
    /// UDP: first a reply with the wrong ID, then the right one.
    SpoofFirst,
    /// TCP: every reply sent twice (the second is bytes nobody asked for).
    Twice,
    /// As `Hold` for names that start with `slow`, as `Answer` for the others (a query the
    /// server is slow on, among fast ones).
    HoldSlow,
}

#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// TCP connections accepted.
    pub(crate) accepted: AtomicUsize,
    /// TCP connections open right now, and the most ever open at once.
    pub(crate) open: AtomicUsize,
    pub(crate) max_open: AtomicUsize,
    /// TCP connections the client closed (EOF seen while waiting for a query).
    pub(crate) client_closed: AtomicUsize,
    /// TCP connections the upstream closed after [`SERVER_IDLE`] without a query.
    pub(crate) server_closed_idle: AtomicUsize,
    /// Queries read, over TCP and over UDP.
    pub(crate) tcp_queries: AtomicUsize,
    pub(crate) udp_queries: AtomicUsize,
    /// TLS: handshakes that did not complete (the client refused the certificate, spoke no TLS,
    /// or went away). Connections count in `accepted` once their handshake completed.
    pub(crate) tls_failed: AtomicUsize,
}

#[derive(Debug)]
struct Shared {
    mode: Mutex<Mode>,
    /// UDP replies carry TC and no records.
    truncate_udp: bool,
    tag: u8,
    /// Serve TCP as DNS over TLS.
    tls: Option<Arc<rustls::ServerConfig>>,
    stats: Stats,
    changed: Notify,
    gate: Semaphore,
    /// Its node died: connections in memory are never accepted, queries never answered.
    dead: AtomicBool,
    /// The runtime that started it, which serves every connection (an in-memory one is dialed
    /// on the client's runtime, which may end before the connection does).
    runtime: tokio::runtime::Handle,
}

impl Shared {
    fn bump(&self, counter: &AtomicUsize) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// The mode for the query just read (counting down `ResetFirst`).
    fn mode(&self) -> Mode {
        let mut mode = self.mode.lock().unwrap();
        match *mode {
            Mode::ResetFirst(0) => Mode::Answer,
            Mode::ResetFirst(n) => {
                *mode = Mode::ResetFirst(n - 1);
                Mode::Reset
            }
            m => m,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Upstream {
    pub(crate) addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        registry().lock().unwrap().remove(&self.addr);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The upstreams [`Memory`] can dial, by address (each one's real port: unique while it lives).
fn registry() -> &'static Mutex<HashMap<SocketAddr, Weak<Shared>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<SocketAddr, Weak<Shared>>>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

/// Dials the scripted upstreams in memory: each connection is a `tokio::io::duplex` pipe whose
/// other end the upstream serves as it serves a TCP connection. An address with no upstream
/// refuses the connection.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Memory;

impl Dial for Memory {
    type Conn = DuplexStream;

    async fn dial(&self, addr: SocketAddr) -> io::Result<DuplexStream> {
        dial_memory(addr).await
    }

    fn movable(&self, _: &DuplexStream) -> bool {
        true
    }

    fn rehome(&self, conn: DuplexStream) -> Option<DuplexStream> {
        Some(conn)
    }
}

/// [`Memory`]'s connections, as if each stayed on the runtime that opened it (as a TLS one
/// does).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Unmovable;

impl Dial for Unmovable {
    type Conn = DuplexStream;

    async fn dial(&self, addr: SocketAddr) -> io::Result<DuplexStream> {
        dial_memory(addr).await
    }
}

async fn dial_memory(addr: SocketAddr) -> io::Result<DuplexStream> {
    let shared = registry()
        .lock()
        .unwrap()
        .get(&addr)
        .and_then(Weak::upgrade);
    let shared = shared.ok_or(io::ErrorKind::ConnectionRefused)?;
    if shared.dead.load(Ordering::SeqCst) {
        // A SYN nobody answers: the connect waits until the caller gives up.
        std::future::pending::<()>().await;
    }
    let (client, server) = tokio::io::duplex(PIPE);
    serve(shared, server, None);
    Ok(client)
}

/// kube-proxy's DNAT in memory: a connection to `service` lands on one of the endpoints, the
/// next one the script names (then the endpoints in turn); other addresses are dialed as
/// [`Memory`] does. Clones share the state.
#[derive(Debug, Clone)]
pub(crate) struct Dnat {
    service: SocketAddr,
    state: Arc<Mutex<DnatState>>,
}

#[derive(Debug)]
struct DnatState {
    endpoints: Vec<SocketAddr>,
    /// Indexes into `endpoints` for the next dials.
    script: VecDeque<usize>,
    turn: usize,
    /// The endpoint each dial went to, in order.
    dials: Vec<SocketAddr>,
}

impl Dnat {
    pub(crate) fn new(service: SocketAddr, endpoints: &[SocketAddr]) -> Self {
        Dnat {
            service,
            state: Arc::new(Mutex::new(DnatState {
                endpoints: endpoints.to_vec(),
                script: VecDeque::new(),
                turn: 0,
                dials: Vec::new(),
            })),
        }
    }

    /// The next dials go to these endpoints (indexes), in this order.
    pub(crate) fn script(&self, next: &[usize]) {
        self.state.lock().unwrap().script.extend(next);
    }

    /// kube-proxy rewrote its rules: only these endpoints from now on.
    pub(crate) fn set_endpoints(&self, endpoints: &[SocketAddr]) {
        let mut state = self.state.lock().unwrap();
        state.endpoints = endpoints.to_vec();
        state.script.clear();
    }

    /// Where every dial to the service went, in order.
    pub(crate) fn dials(&self) -> Vec<SocketAddr> {
        self.state.lock().unwrap().dials.clone()
    }
}

impl Dial for Dnat {
    type Conn = DuplexStream;

    async fn dial(&self, addr: SocketAddr) -> io::Result<DuplexStream> {
        if addr != self.service {
            return dial_memory(addr).await;
        }
        let endpoint = {
            let mut state = self.state.lock().unwrap();
            let n = state.endpoints.len();
            let pick = match state.script.pop_front() {
                Some(i) => i % n,
                None => {
                    state.turn += 1;
                    state.turn % n
                }
            };
            let endpoint = state.endpoints[pick];
            state.dials.push(endpoint);
            endpoint
        };
        dial_memory(endpoint).await
    }

    fn movable(&self, _: &DuplexStream) -> bool {
        true
    }

    fn rehome(&self, conn: DuplexStream) -> Option<DuplexStream> {
        Some(conn)
    }
}

impl Upstream {
    /// TCP and UDP on the same loopback port, answering with `192.0.2.<tag>`.
    pub(crate) async fn start(mode: Mode, tag: u8) -> Self {
        Self::start_with(mode, tag, false, None).await
    }

    /// As [`Upstream::start`]; UDP replies are truncated (TC, no records).
    pub(crate) async fn start_truncating(tag: u8) -> Self {
        Self::start_with(Mode::Answer, tag, true, None).await
    }

    /// As [`Upstream::start`], with TCP (and its in-memory pipes) served as DNS over TLS with
    /// `config`.
    pub(crate) async fn start_tls(mode: Mode, tag: u8, config: Arc<rustls::ServerConfig>) -> Self {
        Self::start_with(mode, tag, false, Some(config)).await
    }

    async fn start_with(
        mode: Mode,
        tag: u8,
        truncate_udp: bool,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Self {
        let (tcp, udp) = bind_pair().await;
        let addr = tcp.local_addr().unwrap();
        let shared = Arc::new(Shared {
            mode: Mutex::new(mode),
            truncate_udp,
            tag,
            tls,
            stats: Stats::default(),
            changed: Notify::new(),
            gate: Semaphore::new(0),
            dead: AtomicBool::new(false),
            runtime: tokio::runtime::Handle::current(),
        });
        registry()
            .lock()
            .unwrap()
            .insert(addr, Arc::downgrade(&shared));
        let tasks = vec![
            tokio::spawn(serve_tcp(tcp, shared.clone())),
            tokio::spawn(serve_udp(udp, shared.clone())),
        ];
        Upstream {
            addr,
            shared,
            tasks,
        }
    }

    pub(crate) fn stats(&self) -> &Stats {
        &self.shared.stats
    }

    pub(crate) fn set_mode(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    /// Its node dies: in memory, new connections are never accepted and no query is answered
    /// again, on any connection (nothing is closed or reset).
    pub(crate) fn kill(&self) {
        self.shared.dead.store(true, Ordering::SeqCst);
    }

    /// Lets `n` held queries be answered.
    pub(crate) fn release(&self, n: usize) {
        self.shared.gate.add_permits(n);
    }

    /// Waits until `cond` holds (checked after every counter change), at most 60 s (of paused
    /// time, in the tests that pause it: beyond anything a test waits for).
    pub(crate) async fn until(&self, what: &str, cond: impl Fn(&Stats) -> bool) {
        let wait = async {
            loop {
                let changed = self.shared.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if cond(&self.shared.stats) {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .is_err()
        {
            panic!(
                "scripted upstream: timed out waiting for {what}: {:?}",
                self.shared.stats
            );
        }
    }
}

/// A loopback port free for both TCP and UDP.
async fn bind_pair() -> (TcpListener, UdpSocket) {
    for _ in 0..50 {
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        if let Ok(tcp) = TcpListener::bind(udp.local_addr().unwrap()).await {
            return (tcp, udp);
        }
    }
    panic!("no loopback port free for both TCP and UDP");
}

/// An address where nothing listens: connections are refused.
pub(crate) async fn refusing_addr() -> SocketAddr {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    listener.local_addr().unwrap()
}

/// The reply the upstream sends for `query` in `mode`, or `None` to send nothing.
fn reply(query: &[u8], tag: u8, mode: Mode, truncate: bool) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    let mut reply = Message::response(query.metadata.id, OpCode::Query);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    let mut question = query.queries.first()?.clone();
    if mode == Mode::WrongQuestion {
        question = Query::query(Name::from_ascii("wrong.example.").unwrap(), RecordType::A);
    }
    if mode == Mode::WrongId {
        reply.metadata.id = !reply.metadata.id;
    }
    if truncate {
        reply.metadata.truncation = true;
    } else if question.query_type() == RecordType::A {
        reply.add_answer(Record::from_rdata(
            question.name().clone(),
            30,
            RData::A(A::new(192, 0, 2, tag)),
        ));
    }
    reply.add_query(question);
    Some(reply.to_vec().unwrap())
}

async fn serve_tcp(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let reset = socket2::SockRef::from(&stream).try_clone().ok();
        serve(shared.clone(), stream, reset);
    }
}

/// Serves one connection: at once, or once its TLS handshake completed.
fn serve<S>(shared: Arc<Shared>, stream: S, reset: Option<socket2::Socket>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Some(acceptor) = shared.tls.clone().map(TlsAcceptor::from) else {
        accept(shared, stream, reset);
        return;
    };
    shared.runtime.clone().spawn(async move {
        match acceptor.accept(stream).await {
            Ok(stream) => accept(shared, stream, reset),
            Err(_) => shared.bump(&shared.stats.tls_failed),
        }
    });
}

/// Serves one connection in a task of its own. `reset`: the socket under it, for
/// [`Mode::Reset`]'s RST (none in memory).
fn accept<S>(shared: Arc<Shared>, stream: S, reset: Option<socket2::Socket>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let open = shared.stats.open.fetch_add(1, Ordering::SeqCst) + 1;
    shared.stats.max_open.fetch_max(open, Ordering::SeqCst);
    shared.bump(&shared.stats.accepted);
    shared.runtime.clone().spawn(async move {
        serve_connection(stream, reset, &shared).await;
        shared.stats.open.fetch_sub(1, Ordering::SeqCst);
        shared.changed.notify_waiters();
    });
}

async fn serve_connection<S>(mut stream: S, reset: Option<socket2::Socket>, shared: &Shared)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut answered = 0;
    loop {
        let mut len = [0u8; 2];
        match tokio::time::timeout(SERVER_IDLE, stream.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => {
                shared.bump(&shared.stats.client_closed);
                return;
            }
            Err(_) => {
                shared.bump(&shared.stats.server_closed_idle);
                return;
            }
        }
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if stream.read_exact(&mut query).await.is_err() {
            shared.bump(&shared.stats.client_closed);
            return;
        }
        shared.bump(&shared.stats.tcp_queries);
        if shared.dead.load(Ordering::SeqCst) {
            continue;
        }
        let mut mode = shared.mode();
        if mode == Mode::HoldSlow {
            let slow = reply_name(&query).is_some_and(|n| n.starts_with("slow"));
            mode = if slow { Mode::Hold } else { Mode::Answer };
        }
        match mode {
            Mode::Silent => continue,
            Mode::Reset => {
                if let Some(socket) = &reset {
                    socket.set_linger(Some(Duration::ZERO)).unwrap();
                }
                return;
            }
            Mode::DropAfter(n) if answered >= n => return,
            Mode::Hold => shared.gate.acquire().await.unwrap().forget(),
            _ => {}
        }
        let mut frames = Vec::new();
        if mode == Mode::SpoofFirst {
            frames.extend(reply(&query, shared.tag, Mode::WrongId, false));
        }
        frames.extend(reply(&query, shared.tag, mode, false));
        if mode == Mode::Twice {
            frames.extend(reply(&query, shared.tag, mode, false));
        }
        for frame in frames {
            let mut out = (frame.len() as u16).to_be_bytes().to_vec();
            out.extend_from_slice(&frame);
            if stream.write_all(&out).await.is_err() {
                // The client closed it (in memory, writing to a closed pipe fails at once).
                shared.bump(&shared.stats.client_closed);
                return;
            }
        }
        answered += 1;
        if matches!(mode, Mode::CloseAfter(n) if answered >= n) {
            return;
        }
    }
}

async fn serve_udp(socket: UdpSocket, shared: Arc<Shared>) {
    let mut buf = vec![0u8; 65535];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else {
            return;
        };
        shared.bump(&shared.stats.udp_queries);
        let mode = shared.mode();
        let mut replies = Vec::new();
        match mode {
            Mode::Silent | Mode::Reset => continue,
            Mode::SpoofFirst => {
                replies.extend(reply(&buf[..n], shared.tag, Mode::WrongId, false));
                replies.extend(reply(
                    &buf[..n],
                    shared.tag,
                    Mode::Answer,
                    shared.truncate_udp,
                ));
            }
            _ => replies.extend(reply(&buf[..n], shared.tag, mode, shared.truncate_udp)),
        }
        for r in replies {
            let _ = socket.send_to(&r, from).await;
        }
    }
}

/// The question's name of a query, lowercased.
fn reply_name(query: &[u8]) -> Option<String> {
    let msg = Message::from_vec(query).ok()?;
    Some(msg.queries.first()?.name().to_ascii().to_ascii_lowercase())
}

/// A query for `name` (A, RD set) with ID `id`.
pub(crate) fn query(name: &str, id: u16) -> Vec<u8> {
    let mut msg = Message::query();
    msg.metadata.id = id;
    msg.metadata.recursion_desired = true;
    msg.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    msg.to_vec().unwrap()
}

/// The reply's ID, its first answer's address (the upstream's tag is the last octet), and its
/// question name.
pub(crate) fn read_reply(reply: &[u8]) -> (u16, Option<Ipv4Addr>, String) {
    let msg = Message::from_vec(reply).expect("reply decodes");
    let ip = msg.answers.first().and_then(|r| match &r.data {
        RData::A(a) => Some(a.0),
        _ => None,
    });
    (msg.metadata.id, ip, msg.queries[0].name().to_ascii())
}
