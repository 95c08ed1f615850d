//! A scripted upstream: for faults a real server will not produce on demand (a reset in the
//! middle of a query, silence, SERVFAIL, truncation, slow answers, connections closed after a
//! few queries), and for counting what the agent sends (queries per name, TCP connections, the
//! most connections open at once), which single-flight and pool-bound tests assert on.
//!
//! It serves UDP and TCP on one port of 127.0.0.1. The script is called once per query and says
//! what to do with it ([`Action`]). Like CoreDNS, a TCP connection is served serially: the next
//! query on it is read only after the previous one's action completed (a delayed answer holds
//! the connection). UDP queries are handled concurrently.
//!
//! Queries for [`crate::PROBE_NAME`] (how the harness learns an agent is up) are answered
//! NXDOMAIN without consulting the script and are not counted as queries.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Edns, Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::SOA;
use hickory_proto::rr::{Name, RData, Record};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::oneshot;

/// What to do with one query.
#[derive(Debug, Clone)]
pub enum Action {
    /// NOERROR, AA, with one answer record per item, owned by the query's name, with this TTL.
    Answer { ttl: u32, data: Vec<RData> },
    /// NXDOMAIN with an SOA in the authority section (negative TTL = min(`soa_ttl`, `minimum`)).
    NxDomain { soa_ttl: u32, minimum: u32 },
    /// This message, with the query's ID, opcode, RD and question put in (and an OPT if the
    /// query had one).
    Reply(Message),
    /// A reply with this RCODE and no records (SERVFAIL, REFUSED, FORMERR, ...).
    Rcode(ResponseCode),
    /// TC=1, no records: "the answer did not fit".
    Truncated,
    /// No answer at all (TCP: keep reading the connection's next queries).
    Silence,
    /// TCP: abort the connection with a RST (SO_LINGER 0) without answering. UDP: no answer.
    Reset,
    /// TCP: close the connection cleanly (FIN) without answering. UDP: no answer.
    Close,
    /// Wait, then do the inner action.
    Delay(Duration, Box<Action>),
    /// This message sent exactly as given: no ID or question put in (for replies that must be
    /// refused, such as a wrong ID or another question).
    Raw(Message),
    /// The inner action's reply without an OPT record, whatever the query had: an upstream that
    /// does not speak EDNS (RFC 6891 §7). The inner action must be one that replies (not a
    /// delay, silence or an edit).
    NoEdns(Box<Action>),
    /// The inner action's reply bytes, changed by this function before they are sent (for
    /// replies no encoder writes: a record count past the records, bytes after the end).
    Edit(Box<Action>, fn(&mut Vec<u8>)),
}

impl Action {
    /// One A record with `ttl`.
    pub fn a(ip: Ipv4Addr, ttl: u32) -> Action {
        Action::Answer {
            ttl,
            data: vec![RData::A(ip.into())],
        }
    }

    /// `self` after `delay`.
    pub fn after(self, delay: Duration) -> Action {
        Action::Delay(delay, Box::new(self))
    }
}

/// Which transport a query came over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// What the script knows about a query besides the message itself.
#[derive(Debug, Clone, Copy)]
pub struct Ctx {
    pub transport: Transport,
    /// 1 for the first query for this name (any type, case-insensitive), 2 for the next, ...
    pub nth: u64,
    /// TCP: the connection's number (1 for the first accepted) and the query's position on it
    /// (1 for its first query). UDP: both 0.
    pub connection: u64,
    pub on_connection: u64,
}

/// Settings beyond the script.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Close (FIN) each TCP connection once it has answered this many queries, as a server
    /// that limits queries per connection or times out idle ones does.
    pub close_after: Option<u64>,
}

type Script = dyn Fn(&Message, &Ctx) -> Action + Send + Sync;

#[derive(Default)]
struct State {
    queries: AtomicU64,
    udp_queries: AtomicU64,
    tcp_queries: AtomicU64,
    probes: AtomicU64,
    undecodable: AtomicU64,
    connections: AtomicU64,
    open: AtomicU64,
    max_open: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    per_name: Mutex<HashMap<String, u64>>,
}

impl State {
    fn count_query(&self, name: &str, transport: Transport) -> u64 {
        self.queries.fetch_add(1, Ordering::SeqCst);
        match transport {
            Transport::Udp => self.udp_queries.fetch_add(1, Ordering::SeqCst),
            Transport::Tcp => self.tcp_queries.fetch_add(1, Ordering::SeqCst),
        };
        let mut per_name = self.per_name.lock().unwrap_or_else(|e| e.into_inner());
        let n = per_name.entry(name.to_owned()).or_insert(0);
        *n += 1;
        *n
    }
}

/// Raises a gauge and records its high-water mark; lowered when dropped.
struct Gauge<'a> {
    value: &'a AtomicU64,
}

impl<'a> Gauge<'a> {
    fn up(value: &'a AtomicU64, max: &AtomicU64) -> Gauge<'a> {
        let now = value.fetch_add(1, Ordering::SeqCst) + 1;
        max.fetch_max(now, Ordering::SeqCst);
        Gauge { value }
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.value.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running scripted upstream. Stops (every socket closed) on drop.
pub struct Scripted {
    addr: SocketAddr,
    state: Arc<State>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Scripted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scripted")
            .field("addr", &self.addr)
            .field("queries", &self.queries())
            .field("connections", &self.connections())
            .finish()
    }
}

impl Scripted {
    /// Starts serving on a free port of 127.0.0.1 (UDP and TCP), on its own thread and runtime,
    /// so it works from synchronous and asynchronous tests alike.
    pub fn start(
        script: impl Fn(&Message, &Ctx) -> Action + Send + Sync + 'static,
    ) -> std::io::Result<Scripted> {
        Scripted::start_with(Options::default(), script)
    }

    pub fn start_with(
        options: Options,
        script: impl Fn(&Message, &Ctx) -> Action + Send + Sync + 'static,
    ) -> std::io::Result<Scripted> {
        let (tcp, udp) = bind_pair()?;
        let addr = tcp.local_addr()?;
        tcp.set_nonblocking(true)?;
        udp.set_nonblocking(true)?;
        let state = Arc::new(State::default());
        let script: Arc<Script> = Arc::new(script);
        let (shutdown, stopped) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = {
            let state = Arc::clone(&state);
            std::thread::Builder::new()
                .name(format!("scripted-{}", addr.port()))
                .spawn(move || {
                    runtime.block_on(async move {
                        let tcp = TcpListener::from_std(tcp).expect("register TCP listener");
                        let udp = UdpSocket::from_std(udp).expect("register UDP socket");
                        tokio::select! {
                            _ = stopped => {}
                            _ = serve_tcp(tcp, Arc::clone(&state), Arc::clone(&script), options) => {}
                            _ = serve_udp(udp, state, script) => {}
                        }
                    });
                    // Dropping the runtime here cancels every connection task and closes its
                    // socket.
                })?
        };
        Ok(Scripted {
            addr,
            state,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queries received (UDP and TCP), probes and undecodable messages excluded, the agent's
    /// own (such as its start-up `. NS` check) included: tests count their own names with
    /// [`Scripted::queries_for`] or [`Scripted::queries_under`].
    pub fn queries(&self) -> u64 {
        self.state.queries.load(Ordering::SeqCst)
    }

    pub fn udp_queries(&self) -> u64 {
        self.state.udp_queries.load(Ordering::SeqCst)
    }

    pub fn tcp_queries(&self) -> u64 {
        self.state.tcp_queries.load(Ordering::SeqCst)
    }

    /// Queries received for `name` (any type; case and a final dot do not matter).
    pub fn queries_for(&self, name: &str) -> u64 {
        let per_name = self
            .state
            .per_name
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        per_name.get(&normalize(name)).copied().unwrap_or(0)
    }

    /// Queries received for names ending in `suffix` (case and a final dot do not matter), so
    /// a test counts its own queries apart from the agent's own (start-up or health checks).
    pub fn queries_under(&self, suffix: &str) -> u64 {
        let suffix = normalize(suffix);
        let per_name = self
            .state
            .per_name
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        per_name
            .iter()
            .filter(|(name, _)| name.ends_with(&suffix))
            .map(|(_, n)| n)
            .sum()
    }

    /// Every name queried so far with its count, sorted (for assertion messages).
    pub fn names(&self) -> Vec<(String, u64)> {
        let per_name = self
            .state
            .per_name
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<_> = per_name.iter().map(|(k, v)| (k.clone(), *v)).collect();
        names.sort();
        names
    }

    /// Harness probes answered (see the module docs).
    pub fn probes(&self) -> u64 {
        self.state.probes.load(Ordering::SeqCst)
    }

    /// Messages that did not decode as DNS.
    pub fn undecodable(&self) -> u64 {
        self.state.undecodable.load(Ordering::SeqCst)
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// TCP connections open now.
    pub fn open_connections(&self) -> u64 {
        self.state.open.load(Ordering::SeqCst)
    }

    /// The most TCP connections that were open at the same time.
    pub fn max_open_connections(&self) -> u64 {
        self.state.max_open.load(Ordering::SeqCst)
    }

    /// The most queries (UDP and TCP) being handled at the same time.
    pub fn max_in_flight(&self) -> u64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Polls until [`Scripted::queries_for`] `name` reaches `n` or `limit` passes; returns
    /// whether it did.
    pub fn wait_queries_for(&self, name: &str, n: u64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.queries_for(name) < n {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn bind_pair() -> std::io::Result<(std::net::TcpListener, std::net::UdpSocket)> {
    let mut last = None;
    for _ in 0..64 {
        let tcp = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        match std::net::UdpSocket::bind(tcp.local_addr()?) {
            Ok(udp) => return Ok((tcp, udp)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free port")))
}

fn normalize(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    if lower.ends_with('.') {
        lower
    } else {
        lower + "."
    }
}

fn is_probe(name: &str) -> bool {
    name == normalize(crate::PROBE_NAME)
}

/// What happens on the wire after the script has decided (delays already waited out).
enum Outcome {
    Send(Vec<u8>),
    Nothing,
    Reset,
    Close,
}

async fn decide(query: &Message, action: Action) -> Outcome {
    let mut action = action;
    while let Action::Delay(delay, inner) = action {
        tokio::time::sleep(delay).await;
        action = *inner;
    }
    match action {
        Action::Silence => Outcome::Nothing,
        Action::Reset => Outcome::Reset,
        Action::Close => Outcome::Close,
        Action::Edit(inner, edit) => match Box::pin(decide(query, *inner)).await {
            Outcome::Send(mut bytes) => {
                edit(&mut bytes);
                Outcome::Send(bytes)
            }
            other => other,
        },
        action => match message(query, action).map(|reply| reply.to_vec()) {
            Some(Ok(bytes)) => Outcome::Send(bytes),
            _ => Outcome::Nothing,
        },
    }
}

/// The reply an action that replies makes (`None` for one that does not, as inside
/// [`Action::NoEdns`]).
fn message(query: &Message, action: Action) -> Option<Message> {
    let reply = match action {
        Action::Silence | Action::Reset | Action::Close | Action::Delay(..) | Action::Edit(..) => {
            return None;
        }
        Action::NoEdns(inner) => {
            let mut reply = message(query, *inner)?;
            reply.edns = None;
            reply
        }
        Action::Answer { ttl, data } => {
            let mut reply = response(query, ResponseCode::NoError);
            let name = query
                .queries
                .first()
                .map(|q| q.name().clone())
                .unwrap_or_else(Name::root);
            for rdata in data {
                reply.add_answer(Record::from_rdata(name.clone(), ttl, rdata));
            }
            reply
        }
        Action::NxDomain { soa_ttl, minimum } => {
            let mut reply = response(query, ResponseCode::NXDomain);
            reply.add_authority(soa(soa_ttl, minimum));
            reply
        }
        Action::Reply(mut reply) => {
            let template = response(query, reply.metadata.response_code);
            reply.metadata.id = template.metadata.id;
            reply.metadata.message_type = MessageType::Response;
            reply.metadata.op_code = template.metadata.op_code;
            reply.metadata.recursion_desired = template.metadata.recursion_desired;
            reply.queries = template.queries;
            if reply.edns.is_none() {
                reply.edns = template.edns;
            }
            reply
        }
        Action::Rcode(rcode) => response(query, rcode),
        Action::Raw(reply) => reply,
        Action::Truncated => {
            let mut reply = response(query, ResponseCode::NoError);
            reply.metadata.truncation = true;
            reply
        }
    };
    Some(reply)
}

/// An authoritative reply to `query` with `rcode` and no records; OPT (1232) only if the query
/// had one.
pub fn response(query: &Message, rcode: ResponseCode) -> Message {
    let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.authoritative = true;
    reply.metadata.response_code = rcode;
    reply.add_queries(query.queries.clone());
    if query.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(1232);
        reply.set_edns(edns);
    }
    reply
}

/// The SOA record a scripted `cluster.local.` denial carries.
pub fn soa(ttl: u32, minimum: u32) -> Record {
    let origin = Name::from_ascii("cluster.local.").expect("static name");
    let soa = SOA::new(
        Name::from_ascii("ns.dns.cluster.local.").expect("static name"),
        Name::from_ascii("hostmaster.cluster.local.").expect("static name"),
        1,
        7200,
        1800,
        86400,
        minimum,
    );
    Record::from_rdata(origin, ttl, RData::SOA(soa))
}

/// Decodes a query; counts it; returns it with the script's action, or `None` for undecodable
/// messages. Probes get their NXDOMAIN here.
fn classify(
    bytes: &[u8],
    state: &State,
    script: &Script,
    transport: Transport,
    connection: u64,
    on_connection: u64,
) -> Option<(Message, Action)> {
    let Ok(query) = Message::from_vec(bytes) else {
        state.undecodable.fetch_add(1, Ordering::SeqCst);
        return None;
    };
    let name = query
        .queries
        .first()
        .map(|q| normalize(&q.name().to_ascii()))
        .unwrap_or_default();
    if is_probe(&name) {
        state.probes.fetch_add(1, Ordering::SeqCst);
        let action = Action::NxDomain {
            soa_ttl: 30,
            minimum: 60,
        };
        return Some((query, action));
    }
    let nth = state.count_query(&name, transport);
    let ctx = Ctx {
        transport,
        nth,
        connection,
        on_connection,
    };
    let action = script(&query, &ctx);
    Some((query, action))
}

async fn serve_udp(socket: UdpSocket, state: Arc<State>, script: Arc<Script>) {
    let socket = Arc::new(socket);
    let mut buf = vec![0; 65535];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        let Some((query, action)) = classify(&buf[..n], &state, &*script, Transport::Udp, 0, 0)
        else {
            continue;
        };
        let socket = Arc::clone(&socket);
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let _flight = Gauge::up(&state.in_flight, &state.max_in_flight);
            if let Outcome::Send(bytes) = decide(&query, action).await {
                let _ = socket.send_to(&bytes, from).await;
            }
        });
    }
}

async fn serve_tcp(
    listener: TcpListener,
    state: Arc<State>,
    script: Arc<Script>,
    options: Options,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let connection = state.connections.fetch_add(1, Ordering::SeqCst) + 1;
        let state = Arc::clone(&state);
        let script = Arc::clone(&script);
        tokio::spawn(async move {
            let _open = Gauge::up(&state.open, &state.max_open);
            serve_connection(stream, &state, &*script, options, connection).await;
        });
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    state: &State,
    script: &Script,
    options: Options,
    connection: u64,
) {
    let mut answered = 0;
    let mut on_connection = 0;
    loop {
        let Ok(len) = stream.read_u16().await else {
            return;
        };
        let mut bytes = vec![0; usize::from(len)];
        if stream.read_exact(&mut bytes).await.is_err() {
            return;
        }
        on_connection += 1;
        let Some((query, action)) = classify(
            &bytes,
            state,
            script,
            Transport::Tcp,
            connection,
            on_connection,
        ) else {
            continue;
        };
        let outcome = {
            let _flight = Gauge::up(&state.in_flight, &state.max_in_flight);
            decide(&query, action).await
        };
        match outcome {
            Outcome::Send(reply) => {
                let mut framed = Vec::with_capacity(reply.len() + 2);
                framed.extend_from_slice(&(reply.len() as u16).to_be_bytes());
                framed.extend_from_slice(&reply);
                if stream.write_all(&framed).await.is_err() {
                    return;
                }
                answered += 1;
                if options.close_after.is_some_and(|n| answered >= n) {
                    let _ = stream.shutdown().await;
                    return;
                }
            }
            Outcome::Nothing => {}
            Outcome::Reset => {
                // SO_LINGER 0: close sends RST instead of FIN.
                let _ = stream.set_zero_linger();
                return;
            }
            Outcome::Close => {
                let _ = stream.shutdown().await;
                return;
            }
        }
    }
}
