//! A scripted upstream for the tests: TCP and UDP on one loopback port, replies built with
//! hickory-proto, and the faults a real server does not produce on demand. Every counter change
//! wakes [`Upstream::until`], so tests await events instead of sleeping.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, OpCode, Query};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;

/// What the upstream does with each query it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Answer: `<qname> 30 IN A 192.0.2.<tag>`, the question echoed.
    Answer,
    /// Answer only once a permit is released ([`Upstream::release`]).
    Hold,
    /// Read the query, never answer.
    Silent,
    /// TCP: read the query, then reset the connection (RST) without answering.
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
    /// Queries read, over TCP and over UDP.
    pub(crate) tcp_queries: AtomicUsize,
    pub(crate) udp_queries: AtomicUsize,
}

#[derive(Debug)]
struct Shared {
    mode: Mutex<Mode>,
    /// UDP replies carry TC and no records.
    truncate_udp: bool,
    tag: u8,
    stats: Stats,
    changed: Notify,
    gate: Semaphore,
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
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Upstream {
    /// TCP and UDP on the same loopback port, answering with `192.0.2.<tag>`.
    pub(crate) async fn start(mode: Mode, tag: u8) -> Self {
        Self::start_with(mode, tag, false).await
    }

    /// As [`Upstream::start`]; UDP replies are truncated (TC, no records).
    pub(crate) async fn start_truncating(tag: u8) -> Self {
        Self::start_with(Mode::Answer, tag, true).await
    }

    async fn start_with(mode: Mode, tag: u8, truncate_udp: bool) -> Self {
        let (tcp, udp) = bind_pair().await;
        let addr = tcp.local_addr().unwrap();
        let shared = Arc::new(Shared {
            mode: Mutex::new(mode),
            truncate_udp,
            tag,
            stats: Stats::default(),
            changed: Notify::new(),
            gate: Semaphore::new(0),
        });
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

    /// Lets `n` held queries be answered.
    pub(crate) fn release(&self, n: usize) {
        self.shared.gate.add_permits(n);
    }

    /// Waits until `cond` holds (checked after every counter change), at most 5 s.
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
        if tokio::time::timeout(Duration::from_secs(5), wait)
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
        let open = shared.stats.open.fetch_add(1, Ordering::SeqCst) + 1;
        shared.stats.max_open.fetch_max(open, Ordering::SeqCst);
        shared.bump(&shared.stats.accepted);
        let shared = shared.clone();
        tokio::spawn(async move {
            serve_connection(stream, &shared).await;
            shared.stats.open.fetch_sub(1, Ordering::SeqCst);
            shared.changed.notify_waiters();
        });
    }
}

async fn serve_connection(mut stream: TcpStream, shared: &Shared) {
    let mut answered = 0;
    loop {
        let mut len = [0u8; 2];
        if stream.read_exact(&mut len).await.is_err() {
            shared.bump(&shared.stats.client_closed);
            return;
        }
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if stream.read_exact(&mut query).await.is_err() {
            shared.bump(&shared.stats.client_closed);
            return;
        }
        shared.bump(&shared.stats.tcp_queries);
        let mode = shared.mode();
        match mode {
            Mode::Silent => continue,
            Mode::Reset => {
                socket2::SockRef::from(&stream)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
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
        for frame in frames {
            let mut out = (frame.len() as u16).to_be_bytes().to_vec();
            out.extend_from_slice(&frame);
            if stream.write_all(&out).await.is_err() {
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
